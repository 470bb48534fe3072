"""Small-M linears on S2-Pro's decode shapes: every candidate timed as CUDA-graph replays over
rotating weight copies (more than 200 MB of them, so the 50 MB L2 holds none), and the table
`engine.kernels.linear.load_plan` reads written with the fastest per (fp8, M, N, K):

    python -m bench_latency.linear_bench --out engine/kernels/linear_table.json

Candidates: bf16 weights: F.linear (cuBLAS, "library"), csrc `gemv` with each split count;
FP8 weights (e4m3, 128 x 128 block scales): csrc `fp8_gemv` with each split count, the Triton
kernel (engine/kernels/fp8_triton.py) if it imports, and the dequantising reference with
--reference (slow: it dequantises the whole weight per call). Each kernel's output is checked
against F.linear / the reference first; a candidate that disagrees is reported and never
chosen. Reports microseconds per call, achieved GB/s (weight + activation bytes / time) and
the share of a device-to-device copy's bandwidth measured the same way (read + write bytes).
Takes well under a minute on an H200 once the csrc extension is built (the first use of the
extension on a fresh machine compiles it: a few minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import extension_available
from engine.kernels.linear import MAX_M, PlanRow, fp8_gemv, gemv, triton_fp8
from engine.quant import Fp8Weight, dequantize_fp8, fp8_linear_torch, quantize_fp8

# name -> (N, K): S2-Pro's decode-step linears
SHAPES = {
    "wqkv": (6144, 2560),
    "wo": (2560, 4096),
    "w13": (19456, 2560),  # w1 | w3 packed (fusion.pack_ffn)
    "w1": (9728, 2560),
    "w2": (2560, 9728),
    "fast_out": (4096, 2560),  # the fast AR's output head
    "semantic": (4097, 2560),  # semantic logits: N not a multiple of 128
}
MS = (1, 2, 4, 8, 16, 32, 64)
SPLITS = (1, 2, 4, 8)
ROTATE_BYTES = 200 * 2**20


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Median microseconds per call of one CUDA graph running every call once (one per
    weight copy), over `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (cuBLAS workspaces, Triton JIT)
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del g
    return 1e3 * statistics.median(times) / len(calls)


def copy_gbs(reps: int) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), timed as above."""
    n = 256 * 2**20
    bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(4)]
    calls = [lambda i=i: bufs[2 * i + 1].copy_(bufs[2 * i]) for i in range(2)]
    us = graph_us(calls, reps)
    return 2 * n / us / 1e3


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A kernel's bf16 output against a reference of the same math (one bf16 rounding each,
    different float32 summation orders)."""
    err = (got.float() - want.float()).abs()
    return bool((err <= 2**-7 * want.float().abs() + 1e-2 * want.float().abs().mean()).all())


def bench_shape(name: str, n: int, k: int, ms: tuple[int, ...], reps: int, copy: float,
                built: bool, reference: bool) -> list[PlanRow]:
    rows: list[PlanRow] = []
    g = torch.Generator(device="cuda").manual_seed(n + k)
    base = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    tri = triton_fp8()
    for fp8 in (False, True):
        if fp8:
            q = quantize_fp8(base)
            wbytes = q.q.numel() + 4 * q.scale.numel()
        else:
            wbytes = 2 * n * k
        copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
        ws: list[torch.Tensor | Fp8Weight] = (
            [Fp8Weight(q.q.clone(), q.scale.clone()) for _ in range(copies)] if fp8
            else [base.clone() for _ in range(copies)])
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            io = 2 * m * (k + n)
            cands: dict[str, Callable[[torch.Tensor, object], torch.Tensor]] = {}
            if fp8:
                want = F.linear(x.float(), dequantize_fp8(ws[0])).to(torch.bfloat16)
                if tri is not None:
                    cands["triton"] = tri
                if reference:
                    cands["library"] = fp8_linear_torch
            else:
                want = F.linear(x.float(), base.float()).to(torch.bfloat16)
                cands["library"] = F.linear
            if built and m <= MAX_M:
                chunks = k // (128 if fp8 else 32)
                for s in SPLITS:
                    if s <= max(1, chunks // 2):
                        fn = fp8_gemv if fp8 else gemv
                        cands[f"gemv:s{s}"] = lambda x, w, fn=fn, s=s: fn(x, w, splits=s)
            us: dict[str, float] = {}
            for cname, fn in cands.items():
                try:
                    out = fn(x, ws[0])
                    torch.cuda.synchronize()
                    if not _agrees(out, want):
                        print(f"  {name} fp8={fp8} m={m} {cname}: WRONG RESULT "
                              f"(max err {(out.float() - want.float()).abs().max():.3g}); "
                              "not a candidate")
                        continue
                    us[cname] = graph_us([lambda w=w, fn=fn, x=x: fn(x, w) for w in ws], reps)
                except Exception as e:  # a candidate that cannot run here is skipped
                    print(f"  {name} fp8={fp8} m={m} {cname}: failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})")
            if not us:
                continue
            best = min(us, key=us.__getitem__)
            impl, splits = (("gemv", int(best.split(":s")[1])) if best.startswith("gemv")
                            else (best, 1))
            record = dict(us)
            gv = [t for c, t in us.items() if c.startswith("gemv")]
            if gv:
                record["gemv"] = min(gv)
            rows.append(PlanRow(fp8, m, n, k, impl, splits,
                                tuple(sorted((c, round(t, 2)) for c, t in record.items()))))
            cells = "  ".join(
                f"{c} {t:7.2f}us {(wbytes + io) / t / 1e3:6.0f}GB/s "
                f"{100 * (wbytes + io) / t / 1e3 / copy:4.0f}%"
                for c, t in sorted(us.items(), key=lambda ct: ct[1]))
            print(f"{name:9s} {n:6d}x{k:<5d} {'fp8 ' if fp8 else 'bf16'} m={m:3d} -> "
                  f"{impl}{f'/s{splits}' if impl == 'gemv' else ''}   {cells}")
        del ws
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the plan table (JSON) here")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows (M) to time")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per candidate")
    ap.add_argument("--reference", action="store_true",
                    help="also time the dequantising FP8 reference (slow)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_bench needs a CUDA device (the candidates are GPU kernels); nothing "
              "measured", file=sys.stderr)
        return 1
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    ms = tuple(int(m) for m in args.ms.split(","))
    built = extension_available()
    if not built:
        print("the csrc extension did not build: timing the library paths only",
              file=sys.stderr)
    if triton_fp8() is None:
        print("engine.kernels.fp8_triton does not import: no Triton FP8 candidate",
              file=sys.stderr)
    copy = copy_gbs(args.reps)
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s "
          "(read + write); GB/s below = (weight + x + y bytes) / time")
    rows: list[PlanRow] = []
    with torch.inference_mode():
        for s in names:
            rows += bench_shape(s, *SHAPES[s], ms, args.reps, copy, built, args.reference)
    if args.out:
        args.out.write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "copy_gbs": round(copy, 1),
             "torch": torch.__version__, "rows": [r.to_json() for r in rows]}, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
