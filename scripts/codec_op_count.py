"""The operations of one graphed codec pass: the aten ops a bucketed streaming pass of S streams
x F frames of the S2-Pro codec dispatches (view-only ops left out: they launch nothing), on the
meta device (no weights, no compute: runs anywhere in seconds), with the codec ops build_ops
compiles (the window transformer's pointwise ops, the convs' tail cuts, the quantizer's
projected-codebook lookup) as the torch formulas (the lookups: per codebook)
and as one op each (what their compiled versions make of them: one inductor graph per call),
the latter with each transformer FFN's W1 | W3 packed into one GEMM (`fusion.pack_ffn`), as
the engine runs them.

    PYTHONPATH=. python scripts/codec_op_count.py [--ticks 64x8,1x2] [--json F]

It also prints a stream's codec state: the bytes every pass gathers and scatters, and the
attention's K/V rings kept in place.

The torch formulas stand in for csrc's Snake / bias kernels too, so the counts are an upper
bound on a CUDA pass's kernels, for comparing trees and settings, not a profile.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from codec_flops import parse_ticks  # this folder's (the scripts run from it)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from engine.codec import Codec, CodecConfig
from engine.codec.layers import MAX_PASS_FRAMES, CodecOps
from engine.codec.quantizer import lookup_sum
from engine.codec.streaming import StreamingDecoder
from engine.fusion import pack_ffn

COMPILED = ("rms_norm", "norm_rope_qk", "silu_mul", "add_scaled", "ring_window", "take_last",
            "lookup_sum")
VIEWS = {"view", "_unsafe_view", "transpose", "slice", "unsqueeze", "squeeze", "expand",
         "permute", "select", "split", "split_with_sizes", "t", "reshape", "alias", "detach",
         "as_strided"}


class OpCount(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it, and `count.opaque` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _opaque(fn: Callable[..., Any], name: str, counts: list[OpCount]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with _disable_current_modes():
            out = fn(*args)
        counts[-1].ops[f"compiled:{name}"] += 1
        return out
    return call


def pass_ops(codec: Codec, streams: int, frames: int, compiled: bool) -> dict[str, int]:
    counts: list[OpCount] = []
    ref = CodecOps(lookup_sum=lookup_sum)  # the functions build_ops compiles
    ops = (CodecOps(packed_ffn=True, **{n: _opaque(getattr(ref, n), n, counts) for n in COMPILED})
           if compiled else CodecOps())  # the torch formulas, each codebook's lookup and 1x1 conv
    dec = StreamingDecoder(codec, max_streams=max(streams, 1), buckets=True, max_frames=512,
                           ops=ops)
    inp = dec._inputs(streams, frames)
    counts.append(OpCount())
    with torch.no_grad():
        dec._static_pass(inp)  # warm, as a capture is (the projected codebooks made once)
        counts[-1] = OpCount()
        with counts[-1]:
            dec._static_pass(inp)
    return dict(counts[-1].ops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", default="64x8,1x2",
                    help="streams x frames per pass, comma-separated")
    ap.add_argument("--json", help="write the counts by op here")
    args = ap.parse_args(argv)
    ticks = parse_ticks(ap, args.ticks, max_frames=MAX_PASS_FRAMES)
    with torch.device("meta"):
        codec = Codec(CodecConfig.preset("s2-pro"))
    codec = codec.to(torch.bfloat16)
    out = {f"{s}x{f}": {"eager": pass_ops(codec, s, f, False)} for s, f in ticks}
    pack_ffn(codec)  # as the engine does with compiled ops: each FFN's W1 | W3 one GEMM
    for s, f in ticks:
        row = out[f"{s}x{f}"]
        row["compiled"] = pass_ops(codec, s, f, True)
        print(f"{s:3d} x {f:2d}: {sum(row['eager'].values()):4d} ops with the torch formulas, "
              f"{sum(row['compiled'].values()):4d} with the codec ops compiled and the FFNs "
              "packed")
    # a stream's codec state: gathered and scattered by every pass, or kept in place (the
    # attention's K/V rings)
    dec = StreamingDecoder(codec, max_streams=1)
    size = dec._flat.element_size()
    state = {"gathered": dec._flat.shape[1] * size, "rings": dec._ring_flat.shape[1] * size}
    print(f"codec state per stream: {state['gathered'] / 1e6:.2f} MB gathered per pass, "
          f"{state['rings'] / 1e6:.2f} MB of K/V rings in place")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**out, "state_bytes_per_stream": state}, fh, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
