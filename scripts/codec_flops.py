"""The arithmetic of a codec tick: floating-point operations of decoding S streams x F frames
with the S2-Pro codec, counted by torch's flop counter on the meta device (no weights, no
compute: runs anywhere in seconds), by operation and by decoder stage, and the rate a tick
time asks for.

    PYTHONPATH=. python scripts/codec_flops.py [--ticks 64x8,64x2,16x4,1x2] [--ms 8] [--json F]

The count is the offline decode of F frames: a floor for a streamed tick, which computes the
same outputs and a little more (its transposed convs re-run their saved input, its window
attention also reads the cached keys).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TypedDict

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.codec import Codec, CodecConfig


class TickFlops(TypedDict):
    streams: int
    frames: int
    flops: int
    gflop_per_frame: float
    by_op: dict[str, int]  # aten op -> FLOPs
    decoder_stages: dict[str, int]  # Decoder.model.<i> -> FLOPs


def parse_ticks(ap: argparse.ArgumentParser, text: str,
                max_frames: int | None = None) -> list[tuple[int, int]]:
    """--ticks "64x8,1x2" -> [(streams, frames), ...], or the parser's usage error (at least
    1 stream, frames in 1..max_frames)."""
    ticks = []
    for t in text.split(","):
        try:
            s, f = (int(v) for v in t.lower().split("x"))
        except ValueError:
            ap.error(f"--ticks: {t!r} is not STREAMSxFRAMES (e.g. 64x8)")
        if s < 1 or f < 1:
            ap.error(f"--ticks: {t!r} needs at least 1 stream and 1 frame")
        if max_frames is not None and f > max_frames:
            ap.error(f"--ticks: {t!r}: streams >= 1, frames in 1..{max_frames} (one pass)")
        ticks.append((s, f))
    return ticks


def tick_flops(codec: Codec, streams: int, frames: int) -> TickFlops:
    """FLOPs of decoding `streams` x `frames` code frames: total, per op, per decoder stage."""
    codes = torch.zeros(streams, codec.n_codebooks_total, frames, dtype=torch.long,
                        device="meta")
    counter = FlopCounterMode(display=False, depth=3)  # depth: down to the decoder's stages
    with torch.no_grad(), counter:
        codec.decoder(codec.quantizer.decode(codes))  # Codec.decode checks values: not on meta
    counts = counter.get_flop_counts()
    by_op = {str(op).removeprefix("aten."): n for op, n in counts["Global"].items()}
    stages = {name: sum(ops.values()) for name, ops in counts.items()
              if name.count(".") == 2 and name.startswith("Decoder.model.")}
    total = counter.get_total_flops()
    return {"streams": streams, "frames": frames, "flops": total,
            "gflop_per_frame": total / (streams * frames) / 1e9, "by_op": by_op,
            "decoder_stages": stages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", default="64x8,64x2,16x4,1x2",
                    help="streams x frames per tick, comma-separated")
    ap.add_argument("--ms", type=float, default=8.0,
                    help="the tick time (ms, > 0) to give the rate for")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.ms) and args.ms > 0):
        ap.error(f"--ms must be a positive number of milliseconds, got {args.ms}")
    ticks = parse_ticks(ap, args.ticks)
    with torch.device("meta"):
        codec = Codec(CodecConfig.preset("s2-pro"))
    codec = codec.to(torch.bfloat16).eval()
    rows = [tick_flops(codec, s, f) for s, f in ticks]
    for r in rows:
        tflop = r["flops"] / 1e12
        ops = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in sorted(r["by_op"].items(),
                                                                key=lambda kv: -kv[1]))
        print(f"{r['streams']} x {r['frames']}: {tflop:.3f} TFLOP ({r['gflop_per_frame']:.2f} "
              f"GFLOP per frame; {ops}); in {args.ms:g} ms: {tflop / args.ms * 1e3:.0f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"codec": "s2-pro", "ms": args.ms, "ticks": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
