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

from clients import TurnResult, connect, llm_tokens, paced, write_wav


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
    print(f"{out}: {result.audio_s:.2f} s of audio, reason {result.reason}, {ttfa_text(result)}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def ttfa_text(result: TurnResult) -> str:
    """Client TTFA is flush sent -> first audio; audio that beat the flush (the server speaks
    each sentence as soon as it ends) is reported as such, timed from the first text sent."""
    if result.audio_before_flush:
        client = (f"audio before flush, {_ms(result.first_audio_after_first_text_ms)} after the "
                  "first text")
    else:
        client = f"{_ms(result.client_ttfa_ms)} after flush"
    return f"TTFA client {client} / server {_ms(result.server_ttfa_ms)}"


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
