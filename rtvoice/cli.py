"""`rtvoice` command line: `serve` (the WebSocket service), `synth` (offline, to a WAV) and
`inspect` (what a checkpoint holds and how it will load)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _synth(args: argparse.Namespace) -> int:
    from .synth import synthesize

    info = synthesize(args.text, args.output, model=args.model, device=args.device,
                      reference=args.reference, reference_text=args.reference_text, seed=args.seed,
                      max_frames=args.max_frames, temperature=args.temperature)
    print(f"wrote {args.output}: {info['audio_s']:.2f}s of audio, {info['frames']} frames "
          f"({info['reason']}) in {info['wall_s']:.2f}s")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engine.inspect_checkpoint import inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint)
    print(report.text())
    return 1 if report.problems else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtvoice", description="Realtime streaming TTS for Fish "
                                 "Audio S2-style DualAR models.")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="synthesize TEXT to a WAV file")
    s.add_argument("text")
    s.add_argument("-o", "--output", type=Path, default=Path("out.wav"))
    s.add_argument("--model", default="tiny", help="preset (tiny, s2-pro) or checkpoint directory")
    s.add_argument("--device", default="cpu")
    s.add_argument("--reference", type=Path, help="reference clip to clone the voice from")
    s.add_argument("--reference-text", help="transcript of the reference clip")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-frames", type=int, default=600)
    s.add_argument("--temperature", type=float, default=0.8)
    s.set_defaults(fn=_synth)
    i = sub.add_parser(
        "inspect", help="show what a checkpoint holds and how it will load (exit 1 on problems)",
        description="Print what a checkpoint holds and how it will be loaded — config summary, "
        "weight shards and parameter count against the S2-Pro preset, dtypes, tokenizer special "
        "ids, the codec's keys (loaded / rebuilt / ignored / missing), estimated GPU memory at "
        "bf16 and FP8 — without loading it. Exits 1 and names each problem when anything would "
        "fail to load.")
    i.add_argument("checkpoint", help="a checkpoint directory, or a Hub model id "
                   "(org/name[@revision]) in the local Hub cache")
    i.set_defaults(fn=_inspect)
    try:
        from .server_cli import add_serve_parser
    except ImportError:  # the service module is optional until it lands
        pass
    else:
        add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"rtvoice {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
