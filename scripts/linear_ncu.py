"""One launch of csrc's small-M linear per case, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats python3 scripts/linear_ncu.py [--cases fp8:w13:1:4:1,...]

(`--clock-control none`: the GPU's own boost clocks, as in the benches; ncu's default locks
them at base, and durations then run ~30 % longer.)

Each case is dtype:shape:M:variant:kwarps (shape names and sizes as bench_latency.linear_bench's
SHAPES). Every case is run twice unprofiled (the extension's first launch, caches), then once
between cudaProfilerStart / Stop, so ncu sees exactly one launch per case, in order. What the
profile answers: how close each kernel gets to DRAM bandwidth, its occupancy, and where its
warps stall (scoreboard on loads vs math pipes vs barriers) — the open question of why FP8
weights stream slower than bf16 ones (docs/PERF.md, the small-M linears).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_latency.linear_bench import SHAPES
from engine.kernels import extension_available
from engine.kernels.linear import fp8_gemv, gemv
from engine.quant import quantize_fp8

DEFAULT_CASES = "fp8:w13:1:4:1,fp8:w13:1:0:2,bf16:w13:1:0:8,fp8:wqkv:1:0:4,bf16:wqkv:1:0:4"


def parse(spec: str) -> list[tuple[bool, str, int, int, int]]:
    cases = []
    for item in spec.split(","):
        try:
            dtype, shape, m, variant, kwarps = item.split(":")
            case = (dtype == "fp8", shape, int(m), int(variant), int(kwarps))
        except ValueError:
            raise SystemExit(f"bad case {item!r}: want dtype:shape:M:variant:kwarps") from None
        if dtype not in ("bf16", "fp8") or shape not in SHAPES:
            raise SystemExit(f"bad case {item!r}: dtype bf16|fp8, shape one of {sorted(SHAPES)}")
        cases.append(case)
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"dtype:shape:M:variant:kwarps, comma-separated (default {DEFAULT_CASES})")
    args = ap.parse_args()
    cases = parse(args.cases)
    if not torch.cuda.is_available() or not extension_available():
        print("needs a CUDA device and the csrc extension", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for fp8, shape, m, variant, kwarps in cases:
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        kw = {"splits": 1, "kwarps": kwarps, "variant": variant, "pdl": 0}
        if fp8:
            fw = quantize_fp8(w)
            runs.append((f"{shape} fp8 M={m} v{variant} k{kwarps}",
                         lambda x=x, fw=fw, kw=kw: fp8_gemv(x, fw, **kw)))
        else:
            runs.append((f"{shape} bf16 M={m} v{variant} k{kwarps}",
                         lambda x=x, w=w, kw=kw: gemv(x, w, **kw)))
    for _, run in runs:
        run(), run()
    torch.cuda.synchronize()
    for name, run in runs:
        print(f"profiled launch: {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
