"""Connect, stream text the way an LLM produces it, and write the audio to a WAV file.

    python clients/examples/write_wav.py --url ws://127.0.0.1:8000/v1/tts/live out.wav \
        "Hello! This sentence arrives token by token."
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients import connect, llm_tokens, paced, write_wav


async def speak(url: str, text: str, out: Path, voice: str | None) -> None:
    async with connect(url, voice=voice, format="pcm", sample_rate=24000) as session:
        ready = await session.ready  # the voice prompt is prefilled at connection open
        # An LLM streams ~30 tokens/s; the server starts speaking at the first sentence end.
        turn = await session.feed(paced(llm_tokens(text), tokens_per_s=30))
        pcm = bytearray()
        async for chunk in turn:  # audio as it arrives (chunk.seq, chunk.offset_s...)
            pcm += chunk.data
        result = await turn
        await session.stop()
    write_wav(out, bytes(pcm), ready.sample_rate)
    print(f"{out}: {result.audio_s:.2f} s of audio, reason {result.reason}, "
          f"TTFA {result.client_ttfa_ms:.0f} ms (client) / {result.server_ttfa_ms:.0f} ms (server)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("text", nargs="?", default="Hello! This sentence arrives token by token.")
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/live")
    ap.add_argument("--voice", help="stored voice id")
    args = ap.parse_args()
    asyncio.run(speak(args.url, args.text, args.out, args.voice))


if __name__ == "__main__":
    main()
