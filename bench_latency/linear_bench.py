"""Small-M linears on S2-Pro's decode shapes: every candidate timed as CUDA-graph replays over
rotating weight copies (more than 200 MB of them, so the 50 MB L2 holds none), and the table
`engine.kernels.linear.load_plan` reads written with the fastest per (fp8, M, N, K):

    python -m bench_latency.linear_bench --out engine/kernels/linear_table.json

Candidates: bf16 weights: F.linear (cuBLAS, "library"), the csrc kernel (`gemv`) in
variants 0, 1, 4 and 5 and, from M = 8, the Triton GEMM over the dense weights
(`dense_linear_triton` in `sweep_configs(M, dense=True)`'s configs, "triton"); FP8 weights (e4m3, 128 x 128 block scales): `fp8_gemv` in variants 0-6 (7, W8A8, with the W8A8 candidates below)
(3 only when asked: `--variants`; 6 at the M and K whose rows it can stage), the
Triton weight-only kernel (engine/kernels/fp8_triton.py) in `sweep_configs(M)`'s few configs,
and the W8A8 candidates (activations quantised to e4m3: other numerics, recorded as a
separate row, "triton_w8a8", "rowwise_w8a8" or "gemv_w8a8", that `make_linear` takes only
with `fp8_activations=True`): the Triton W8A8 kernel (x per 1 x 128 block; its prequant
configs at wqkv, w13 and w2 — whose inputs the norm or the gate before them quantise in the
engine, `FUSED_QUANT` — timed as the GEMM over x already quantised, elsewhere with their
quantising launch), the
rowwise-scaled FP8 GEMM (`torch._scaled_mm` on the weight requantised per output row, x per
row) and, with `--variants` naming 7, the csrc kernel's variant 7 (x per 1 x 128 block in
its prologue, e4m3 MMAs; swept like the other variants), plus
the dequantising reference with --reference (slow). Each csrc variant is swept over kwarps
1, 2, 4, 8 without a K split, then over splits 2, 4, 8 at its best kwarps; each Triton config
at its automatic K split and, from M = 16, at splits 1, 2, 3, 4, 6, 8. Each candidate's
output is checked first (weight-only: against the float32 product, to bf16 rounding; W8A8:
against its torch reference); a candidate that disagrees is reported and never chosen.
Variants 2 and 3 are probed once for exactness on subnormal products (variant 2 relies on
the tensor cores keeping them) and left out where they fail. Reports microseconds per call,
achieved GB/s (weight + activation bytes / time) and the share of a device-to-device copy's
bandwidth measured the same way (read + write bytes); the table records the device, and a
table from another device kind is ignored by `load_plan`.

Time on an H200: about 1.5-2.5 minutes once the csrc extension is built (about 2,500 graph
timings, ~10 ms each, and ~20 Triton compilations of ~1 s); the first use of the extension on
a fresh machine compiles it first (a few minutes). `--shapes`, `--ms`, `--variants`,
`--no-triton` cut it down.

`--glu` times the FP8 packed w13 over x already quantised up to w2's quantised input: the
prequantised W8A8 GEMM then the quantising gate (two launches) against the GLU GEMM with
both in its epilogue (one), per 128-wide prequant config at 16-64 rows.

`--swiglu` times instead the FFN's gated input as the engine runs it at each M where the
recorded table picks the csrc kernel for the packed [W1; W3]: that linear then the compiled
silu * mul (two launches) against the kernel's SwiGLU epilogue with the same parameters
(one), and checks that the two agree. `--norm` times a block's residual add and the RMSNorm
after it as the engine runs them at each M where the table picks the kernel for both
projections (wo then wqkv; w2 then the packed w13 with its SwiGLU): the projection, the fused
add + norm, the next projection (three launches) against the residual epilogue and the normed
prologue (two), and checks that they agree. `--attend` times the fast AR's attention and its
output projection: csrc's decode attention then wo with the residual epilogue (two launches)
against the attention prologue (one), and each part alone. `--rowwise` times FP8 weights at
16-64 rows, where the engine runs their dequantised bf16 copies through cuBLAS, against the
rowwise-scaled FP8 GEMM (`torch._scaled_mm`: the weights requantised per output row, x per
row, W8A8) and reports each one's error against the block-scaled FP8 product (the table's
sweep records the same GEMM as the "rowwise_w8a8" candidate).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import functional, fusion
from engine.kernels import extension_available
from engine.kernels.fp8_triton import fp8_linear_w8a8_torch
from engine.kernels.linear import (
    BATCHED_VARIANTS,
    DEFAULT_TABLE,
    EXACT_VARIANTS,
    FP8_VARIANTS,
    GEMV_W8A8,
    MAX_M,
    QUANT_VARIANT,
    ROWWISE,
    STAGED_VARIANT,
    VARIANTS,
    W8A8,
    W8A8_IMPLS,
    LinearPlan,
    PlanRow,
    _normed_params,
    _triton_module,
    cancellation_case,
    fp8_gemv,
    gemv,
    gemv_attend,
    gemv_normed,
    gemv_residual,
    gemv_swiglu,
    load_plan,
    small_binade_case,
    subnormal_case,
    supports,
)
from engine.quant import (
    Fp8Weight,
    dequantize_fp8,
    fp8_linear_torch,
    fp8_rowwise_linear,
    fp8_rowwise_linear_torch,
    quantize_fp8,
    quantize_rows,
    rowwise_fp8,
    rowwise_gemm,
)

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
# the linears whose input, with fp8_activations, the op that makes it quantises where the
# linear runs the prequantised W8A8 GEMM (the norms before wqkv / w13, the gate before w2:
# Ops.prequant): their prequant candidates are timed as that GEMM alone, without the
# quantising launch the others (wo, after attention) still run
FUSED_QUANT = ("wqkv", "w13", "w2")
ROWWISE_MS = (16, 32, 64)  # --rowwise: the batch sizes that run FP8 weights' bf16 copies
KWARPS = (1, 2, 4, 8)
SPLITS = (2, 4, 8)  # tried at each variant's best kwarps (1 is part of the kwarps sweep)
ROTATE_BYTES = 200 * 2**20
# Triton FP8 configs are timed at their automatic K split and, from this M on, at these too:
# the automatic rule aims at two programs per SM, which the 128-wide tiles at M >= 32 (one
# program per SM by shared memory) turn into two waves
TRITON_SPLIT_SWEEP_M = 16
# bf16 weights: the dense Triton GEMM is timed from this M (below, csrc's kernel leads)
DENSE_TRITON_MIN_M = 8
TRITON_SPLITS = (1, 2, 3, 4, 6, 8)

Meta = dict[str, object]  # a candidate's PlanRow fields: impl, splits, kwarps, variant, config


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


def _agrees_w8a8(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> bool:
    """The W8A8 kernel against its torch reference (the same activation rounding; a rare
    tie may round one element of x differently: 2^-9 of sum |x w| allows a few)."""
    err = (got.float() - want.float()).abs()
    return bool((err <= 2**-7 * want.float().abs() + 2**-9 * mag).all())


def probe_bit_equal(variant: int, against: int) -> str | None:
    """None if `variant` gives `against`'s outputs bit for bit on rows that expose how the
    tensor cores align products (`cancellation_case`: +P, -P and small products in one MMA
    k-group, P 2^10..2^30) and on f16-subnormal staged rows (`small_binade_case`), else
    what differed: variant 6 is in the table's exact set only where its f16 MMAs sum as the
    bf16 ones do, which the PTX manual does not promise."""
    cases = {"cancellation": cancellation_case(16, 256, 256, seed=3),
             "small binade": small_binade_case(16, 256, 256, seed=4)}
    try:
        for name, (w, x) in cases.items():
            for m in (1, 2, 16):
                got = fp8_gemv(x[:m], w, splits=1, kwarps=1, variant=variant)
                want = fp8_gemv(x[:m], w, splits=1, kwarps=1, variant=against)
                if not torch.equal(got, want):
                    bad = int((got != want).sum())
                    return (f"{name} rows, M = {m}: {bad} of {got.numel()} outputs differ from "
                            f"variant {against}'s")
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return None


def probe_variant(variant: int) -> str | None:
    """None if `variant` computes an FP8 product of subnormal weights (e4m3 codes 1-7) and
    small activations (2^-10) to the kernel's usual bound (variant 2 keeps 2^-120 times the
    weights through the MMA: exact only if the tensor cores keep subnormal inputs and
    float32 subnormal products), else what went wrong."""
    w, x = subnormal_case(256, 1024, 8, seed=11)
    wf = dequantize_fp8(w)
    ref = x.float() @ wf.T
    bound = 2**-8 * ref.abs() + 2**-14 * (x.float().abs() @ wf.abs().T)
    try:
        got = fp8_gemv(x, w, splits=1, variant=variant).float()
    except Exception as e:  # e.g. variant 3 below sm_89
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    bad = (got - ref).abs() > bound
    if bool(bad.any()):
        return (f"{int(bad.sum())} of {bad.numel()} outputs off (max relative error "
                f"{float(((got - ref).abs() / ref.abs().clamp_min(1e-30)).max()):.3g})")
    return None


def _triton_splits(mod, m: int, n: int, k: int, cfg, sms: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The K splits to time a Triton config with: the automatic one (about two programs per
    SM) and, from TRITON_SPLIT_SWEEP_M rows on (where the Triton kernels compete), the splits
    of TRITON_SPLITS that launch a different count (a split costs a launch, not a compile)."""
    splits = [mod.launch_split(m, n, k, cfg, 0, sms)]
    if m >= TRITON_SPLIT_SWEEP_M:
        for s in TRITON_SPLITS:
            s = mod.launch_split(m, n, k, cfg, s, sms)
            if s not in splits:
                splits.append(s)
    return splits


def _cfg_name(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
            f"{'T' if cfg.swap_ab else ''}{'P' if cfg.prescale else ''}"
            f"{'Q' if cfg.prequant else ''}")


class Timer:
    """Times candidates for one (shape, dtype, M) against its references; keeps the
    results."""

    def __init__(self, ws: list, x: torch.Tensor, want: torch.Tensor, reps: int,
                 label: str) -> None:
        self.ws, self.x, self.want, self.reps, self.label = ws, x, want, reps, label
        self.us: dict[str, float] = {}
        self.meta: dict[str, Meta] = {}

    def time(self, name: str, fn: Callable, meta: Meta,
             check: Callable[[torch.Tensor], bool] | None = None) -> float | None:
        x = self.x
        try:
            out = fn(x, self.ws[0])
            torch.cuda.synchronize()
            ok = check(out) if check is not None else _agrees(out, self.want)
            if not ok:
                print(f"  {self.label} {name}: WRONG RESULT (max err "
                      f"{(out.float() - self.want.float()).abs().max():.3g}); not a candidate")
                return None
            t = graph_us([lambda w=w: fn(x, w) for w in self.ws], self.reps)
        except Exception as e:  # a candidate that cannot run here is skipped
            print(f"  {self.label} {name}: failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]})")
            return None
        self.us[name], self.meta[name] = t, meta
        return t


def _chunks(k: int, fp8: bool, variant: int) -> int:
    """K chunks of the csrc kernel: 128 k for FP8, bf16 32 (variants 0, 4, 5) or 64 (1)."""
    return -(-k // (128 if fp8 else (32 if variant in BATCHED_VARIANTS else 64)))


def sweep_gemv(timer: Timer, fp8: bool, variants: tuple[int, ...], chunks_of,
               pdl: int = 1, impl: str = "gemv", check=None) -> None:
    """Each variant over kwarps (no split), then over splits at its best kwarps; `pdl`: the
    kernel launched with programmatic dependent launch, as the engine launches it; `impl`:
    the rows' implementation ("gemv", or GEMV_W8A8 for variant 7, timed against `check`)."""
    fn = fp8_gemv if fp8 else gemv
    for v in variants:
        best: tuple[float, int] | None = None
        for kw in KWARPS:
            call = functools.partial(fn, splits=1, kwarps=kw, variant=v, pdl=pdl)
            t = timer.time(f"{impl}:v{v}:k{kw}:s1", call,
                           {"impl": impl, "splits": 1, "kwarps": kw, "variant": v}, check=check)
            if t is not None and (best is None or t < best[0]):
                best = (t, kw)
        if best is None:
            continue
        kw = best[1]
        for s in SPLITS:
            if s > chunks_of(v) // kw:  # a split with no chunk for some warp
                break
            call = functools.partial(fn, splits=s, kwarps=kw, variant=v, pdl=pdl)
            timer.time(f"{impl}:v{v}:k{kw}:s{s}", call,
                       {"impl": impl, "splits": s, "kwarps": kw, "variant": v}, check=check)


def pdl_mode(pdl: str, fp8: bool) -> int:
    """csrc's PDL mode for a `--pdl` value: "auto" as the engine's `pdl=auto` (FP8 weights:
    mode 1; bf16: plain), else the mode given."""
    return (1 if fp8 else 0) if pdl == "auto" else int(pdl)


def _rowwise_call(x: torch.Tensor, w: Fp8Weight, quant: Callable) -> torch.Tensor:
    assert w.rowwise is not None
    return fp8_rowwise_linear(x, *w.rowwise, quantize=quant)


def _on_quantised(mod, xa, cfg, split: int) -> Callable:  # type: ignore[no-untyped-def]
    """A timed call (x, W) of the prequantised W8A8 GEMM over xa, x already quantised."""
    def call(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return mod.fp8_linear_triton_prequant(xa, w, config=cfg, split_k=split)
    return call


def bench_shape(name: str, n: int, k: int, ms: tuple[int, ...], reps: int, copy: float,
                built: bool, reference: bool, variants: tuple[int, ...],
                triton: bool, pdl: str = "auto") -> list[PlanRow]:
    rows: list[PlanRow] = []
    g = torch.Generator(device="cuda").manual_seed(n + k)
    base = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    mod = _triton_module() if triton else None
    quant = fusion.compiled("quantize_rows", quantize_rows)  # as the engine's W8A8 linears
    rw = None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for fp8 in (False, True):
        if fp8:
            q = quantize_fp8(base)
            wbytes = q.q.numel() + 4 * q.scale.numel()
            # each copy with its rowwise-scaled one: the rowwise W8A8 candidate's operand
            rw = rowwise_fp8(q) if n % 16 == 0 and k % 16 == 0 else None
        else:
            wbytes = 2 * n * k
        copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
        ws: list[torch.Tensor | Fp8Weight] = (
            [Fp8Weight(q.q.clone(), q.scale.clone(), None,
                       None if rw is None else (rw[0].clone(), rw[1].clone()))
             for _ in range(copies)] if fp8
            else [base.clone() for _ in range(copies)])
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            io = 2 * m * (k + n)
            label = f"{name} {'fp8' if fp8 else 'bf16'} m={m}"
            if fp8:
                wf = dequantize_fp8(ws[0])
                want = F.linear(x.float(), wf).to(torch.bfloat16)
            else:
                want = F.linear(x.float(), base.float()).to(torch.bfloat16)
            timer = Timer(ws, x, want, reps, label)
            if not fp8:
                timer.time("library", F.linear, {"impl": "library"})
            elif reference:
                timer.time("reference", fp8_linear_torch, {"impl": "library"})
            if built and m <= MAX_M:
                vs = tuple(v for v in variants if (fp8 or v not in FP8_VARIANTS)
                           and v != QUANT_VARIANT)  # W8A8: timed with the W8A8 candidates
                vs = tuple(v for v in vs if supports(m, n, k, fp8, v))
                sweep_gemv(timer, fp8, vs, functools.partial(_chunks, k, fp8),
                           pdl_mode(pdl, fp8))
            w8a8: Timer | None = None
            if not fp8 and mod is not None and m >= DENSE_TRITON_MIN_M:
                for cfg in mod.sweep_configs(m, dense=True):
                    for split in _triton_splits(mod, m, n, k, cfg, sms):
                        call = functools.partial(mod.dense_linear_triton, config=cfg,
                                                 split_k=split)
                        timer.time(f"triton:{_cfg_name(cfg)}:k{split}", call,
                                   {"impl": "triton", "splits": split, "config": cfg.to_json()})
            if fp8 and mod is not None:
                # N not a multiple of 16 compiles every config anew: the default one only
                cfgs = mod.sweep_configs(m)[: None if n % 16 == 0 else 1]
                for cfg in cfgs:
                    for split in _triton_splits(mod, m, n, k, cfg, sms):
                        call = functools.partial(mod.fp8_linear_triton, config=cfg,
                                                 split_k=split)
                        timer.time(f"triton:{_cfg_name(cfg)}:k{split}", call,
                                   {"impl": "triton", "splits": split, "config": cfg.to_json()})
            if fp8 and n % 16 == 0:  # the W8A8 candidates, each against its own reference
                w8a8 = Timer(ws, x, want, reps, label)
                if (built and QUANT_VARIANT in variants and m <= MAX_M
                        and supports(m, n, k, True, QUANT_VARIANT)):
                    want7 = fp8_linear_w8a8_torch(x, ws[0])
                    mag7 = x.float().abs() @ wf.abs().T
                    sweep_gemv(w8a8, True, (QUANT_VARIANT,), functools.partial(_chunks, k, True),
                               pdl_mode(pdl, True), GEMV_W8A8,
                               lambda out, want7=want7, mag7=mag7: _agrees_w8a8(out, want7, mag7))
                if rw is not None:
                    wantr = fp8_rowwise_linear_torch(x, *rw)
                    w8a8.time(ROWWISE, functools.partial(_rowwise_call, quant=quant),
                              {"impl": ROWWISE},
                              check=lambda out, wantr=wantr: _agrees(out, wantr))
                if mod is not None:
                    want8 = mod.fp8_linear_w8a8_torch(x, ws[0])
                    mag = x.float().abs() @ wf.abs().T
                    xq, xs = mod.quantize_act(x)
                    xa = mod.QuantAct(xq, xs, x.dtype)  # what the norm / gate before it makes
                    for cfg in mod.sweep_configs(m, w8a8=True):
                        for split in _triton_splits(mod, m, n, k, cfg, sms):
                            if cfg.prequant and name in FUSED_QUANT:
                                # the engine's op before it quantised x: the GEMM alone
                                call = _on_quantised(mod, xa, cfg, split)
                            else:
                                call = functools.partial(mod.fp8_linear_triton_w8a8,
                                                         config=cfg, split_k=split)
                            w8a8.time(f"{W8A8}:{_cfg_name(cfg)}:k{split}", call,
                                      {"impl": W8A8, "splits": split, "config": cfg.to_json()},
                                      check=lambda out, want8=want8, mag=mag: _agrees_w8a8(
                                          out, want8, mag))
            if not timer.us:
                continue
            best = min(timer.us, key=timer.us.__getitem__)
            rows.append(_plan_row(fp8, m, n, k, timer.meta[best], timer.us))
            extra = ""
            if w8a8 is not None and w8a8.us:
                b8 = min(w8a8.us, key=w8a8.us.__getitem__)
                rows.append(_plan_row(fp8, m, n, k, w8a8.meta[b8], w8a8.us))
                extra = f"   [W8A8 {w8a8.us[b8]:.2f}us: {b8}]"
            # the best of each family (library, each gemv variant, triton), fastest first
            fam: dict[str, tuple[float, str]] = {}
            for c, t in timer.us.items():
                f = ":".join(c.split(":")[:2]) if c.startswith("gemv") else c.split(":")[0]
                if f not in fam or t < fam[f][0]:
                    fam[f] = (t, c)
            cells = "  ".join(
                f"{c} {t:7.2f}us {100 * (wbytes + io) / t / 1e3 / copy:3.0f}%"
                for t, c in sorted(fam.values()))
            print(f"{name:9s} {n:6d}x{k:<5d} {'fp8 ' if fp8 else 'bf16'} m={m:3d} -> "
                  f"{best:22s} {timer.us[best]:7.2f}us "
                  f"{(wbytes + io) / timer.us[best] / 1e3:5.0f}GB/s   {cells}{extra}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def bench_glu(ms: tuple[int, ...], reps: int) -> list[dict[str, object]]:
    """The FP8 packed w13 at decode's 16-64 rows with x already quantised (by the norm
    before it) up to w2's quantised input, in each prequant W8A8 config with 128-wide tiles
    the sweep times: the prequantised GEMM then the quantising gate (two launches, as
    `Ops.prequant` runs them) against the GLU GEMM (`act_quant.glu_w8a8_quant`: one launch,
    no bf16 [M, 2I] in between); each unsplit, and the two quantisations compared. Returns
    one result per (M, config)."""
    from engine.kernels import act_quant
    from engine.kernels import fp8_triton as ft

    n, k = SHAPES["w13"]
    i = n // 2
    g = torch.Generator(device="cuda").manual_seed(n + k)
    base = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k))
    ws = [Fp8Weight(base.q.clone(), base.scale.clone())
          for _ in range(max(2, math.ceil(ROTATE_BYTES / base.q.numel())))]
    results: list[dict[str, object]] = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        xq, xs = ft.quantize_act(x)
        xa = ft.QuantAct(xq, xs, x.dtype)
        for cfg in (c for c in ft.sweep_configs(m, w8a8=True)
                    if c.prequant and c.block_n == 128):
            def two(w: Fp8Weight, cfg: ft.Config = cfg, xa: ft.QuantAct = xa) -> ft.QuantAct:
                h = ft.fp8_linear_triton_prequant(xa, w, config=cfg, split_k=1)
                return act_quant.silu_mul_quant(h[:, :i], h[:, i:])

            def one(w: Fp8Weight, cfg: ft.Config = cfg, xa: ft.QuantAct = xa) -> ft.QuantAct:
                return act_quant.glu_w8a8_quant(xa, w, config=cfg)

            a, b = two(ws[0]), one(ws[0])
            differ = float((a.q.view(torch.uint8) != b.q.view(torch.uint8)).float().mean())
            t2 = graph_us([functools.partial(two, w) for w in ws], reps)
            t1 = graph_us([functools.partial(one, w) for w in ws], reps)
            r = {"m": m, "config": cfg.to_json(), "two_launches_us": round(t2, 2),
                 "glu_us": round(t1, 2), "codes_differing": differ}
            print(f"glu m={m} {_cfg_name(cfg)}: GEMM + quantising gate {t2:.2f} us, GLU GEMM "
                  f"{t1:.2f} us ({t2 - t1:+.2f} us saved); {100 * differ:.3f} % of the codes "
                  "differ", flush=True)
            results.append(r)
    return results


def bench_swiglu(ms: tuple[int, ...], reps: int, table: Path,
                 pdl: int = 1) -> list[dict[str, object]]:
    """The packed FFN input projection + SwiGLU at each M where `table` picks the csrc kernel
    for it: unfused (the kernel, then the compiled silu * mul, as Ops.swiglu ran it) vs the
    kernel's SwiGLU epilogue with the same splits / kwarps / variant. Returns one result per
    M (microseconds, agreement)."""
    n, k = SHAPES["w13"]
    i = n // 2
    plan = load_plan(table)
    silu_mul = fusion.compiled("silu_mul", functional.silu_mul)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    base = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    ws = [base.clone() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    results: list[dict[str, object]] = []
    for m in ms:
        row = plan.choose(m, n, k, False) if plan is not None else None
        if row is None or row.impl != "gemv":
            print(f"swiglu m={m}: the table runs the library linear here (no epilogue)")
            continue
        kw = {"splits": row.splits, "kwarps": row.kwarps, "variant": row.variant, "pdl": pdl}
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)

        def unfused(w: torch.Tensor, x: torch.Tensor = x, kw: dict = kw) -> torch.Tensor:
            h = gemv(x, w, **kw)
            return silu_mul(h[:, :i], h[:, i:])

        def fused(w: torch.Tensor, x: torch.Tensor = x, kw: dict = kw) -> torch.Tensor:
            return gemv_swiglu(x, w, **kw)

        a, b = unfused(ws[0]), fused(ws[0])
        ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        t_un = graph_us([functools.partial(unfused, w) for w in ws], reps)
        t_fu = graph_us([functools.partial(fused, w) for w in ws], reps)
        r = {"m": m, **kw, "unfused_us": round(t_un, 2), "fused_us": round(t_fu, 2),
             "max_ulps": int(ulps.max()), "differing": float((ulps > 0).float().mean())}
        print(f"swiglu m={m} ({row.splits} splits, kwarps {row.kwarps}, variant "
              f"{row.variant}): linear + silu*mul {t_un:.2f} us, SwiGLU epilogue {t_fu:.2f} us "
              f"({t_un - t_fu:+.2f} us saved); results {r['max_ulps']} ulp apart at most "
              f"({100 * r['differing']:.3f} % differ)", flush=True)
        results.append(r)
    return results


def _norm_pair_unfused(wa: torch.Tensor, wb: torch.Tensor, *, y: torch.Tensor, x: torch.Tensor,
                       nw: torch.Tensor, eps: float, glu: bool, kw1: dict, kw2: dict,
                       add_rms_norm: Callable) -> torch.Tensor:
    """x + y Wa^T, its RMSNorm (one compiled op), then Wb (or its SwiGLU): three launches."""
    _, hn = add_rms_norm(x, gemv(y, wa, **kw1), nw, eps)
    return gemv_swiglu(hn, wb, **kw2) if glu else gemv(hn, wb, **kw2)


def _norm_pair_fused(wa: torch.Tensor, wb: torch.Tensor, *, y: torch.Tensor, x: torch.Tensor,
                     nw: torch.Tensor, eps: float, glu: bool, kw1: dict,
                     kw2: dict) -> torch.Tensor:
    """The same as the residual epilogue, then the normed prologue: two launches."""
    h = gemv_residual(y, wa, x, **kw1)
    return gemv_normed(h, nw, eps, wb, glu=glu, **kw2)


def bench_norm(ms: tuple[int, ...], reps: int, table: Path,
               pdl: int = 1) -> list[dict[str, object]]:
    """A block's residual add + RMSNorm between two projections, at each M where `table`
    picks the csrc kernel, variant 0, 4 or 5, for both: unfused (projection, compiled add_rms_norm,
    projection: as the engine ran it before) vs the residual epilogue + normed prologue.
    Returns one result per (pair, M): microseconds and agreement."""
    plan = load_plan(table)
    add_rms_norm = fusion.compiled("add_rms_norm", functional.add_rms_norm)
    g = torch.Generator(device="cuda").manual_seed(5)
    eps = 1e-6
    results: list[dict[str, object]] = []
    for first, second, glu in (("wo", "wqkv", False), ("w2", "w13", True)):
        (n1, k1), (n2, k2) = SHAPES[first], SHAPES[second]
        pair = 2 * (n1 * k1 + n2 * k2)
        copies = max(2, math.ceil(ROTATE_BYTES / pair))
        w1s = [(torch.randn(n1, k1, device="cuda", generator=g) / math.sqrt(k1)).to(torch.bfloat16)
               for _ in range(copies)]
        w2s = [(torch.randn(n2, k2, device="cuda", generator=g) / math.sqrt(k2)).to(torch.bfloat16)
               for _ in range(copies)]
        nw = (1 + 0.1 * torch.randn(k2, device="cuda", generator=g)).to(torch.bfloat16)
        for m in ms:
            rows = [plan.choose(m, n, k, False) if plan is not None else None
                    for n, k in ((n1, k1), (n2, k2))]
            if any(r is None or r.impl != "gemv" or r.variant not in BATCHED_VARIANTS
                   for r in rows) or m > 16:
                print(f"norm {first}->{second} m={m}: the table does not run both on the "
                      "kernel's variant 0, 4 or 5 here (no fusion)")
                continue
            kw1, kw2 = ({"splits": r.splits, "kwarps": r.kwarps, "variant": r.variant,  # type: ignore[union-attr]
                         "pdl": pdl} for r in rows)
            y = torch.randn(m, k1, device="cuda", generator=g).to(torch.bfloat16)
            x = torch.randn(m, n1, device="cuda", generator=g).to(torch.bfloat16)

            args = {"y": y, "x": x, "nw": nw, "eps": eps, "glu": glu, "kw1": kw1, "kw2": kw2}
            unfused = functools.partial(_norm_pair_unfused, add_rms_norm=add_rms_norm, **args)
            fused = functools.partial(_norm_pair_fused, **args)
            a, b = unfused(w1s[0], w2s[0]), fused(w1s[0], w2s[0])
            ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
            t_un = graph_us([functools.partial(unfused, p, q) for p, q in zip(w1s, w2s)], reps)
            t_fu = graph_us([functools.partial(fused, p, q) for p, q in zip(w1s, w2s)], reps)
            r = {"pair": f"{first}->{second}", "m": m, "unfused_us": round(t_un, 2),
                 "fused_us": round(t_fu, 2), "max_ulps": int(ulps.max()),
                 "differing": float((ulps > 0).float().mean())}
            print(f"norm {first}->{second} m={m}: projection + add_rms_norm + projection "
                  f"{t_un:.2f} us, residual epilogue + normed prologue {t_fu:.2f} us "
                  f"({t_un - t_fu:+.2f} us saved); results {r['max_ulps']} ulp apart at most "
                  f"({100 * r['differing']:.3f} % differ)", flush=True)
            results.append(r)
        del w1s, w2s
        torch.cuda.empty_cache()
    return results


def _attend_timings(m: int, pos: int, ws: list[torch.Tensor], tiny: torch.Tensor,
                    kw_plain: dict, kw_fused: dict, reps: int, pdl: int,
                    g: torch.Generator) -> dict[str, object]:
    """`bench_attend`'s timings at M rows and one position (S2-Pro's fast AR shapes)."""
    from engine.kernels.decode_attention import Rope, decode_attention

    H, Hkv, D, S = 32, 8, 128, 10
    n, dev = ws[0].shape[0], ws[0].device
    qkv = torch.randn(m, (H + 2 * Hkv) * D, device=dev, generator=g).to(torch.bfloat16)
    kc = torch.randn(m, Hkv, S, D, device=dev, generator=g).to(torch.bfloat16)
    vc = torch.randn(m, Hkv, S, D, device=dev, generator=g).to(torch.bfloat16)
    cs = functional.rope_table(S, D, 1e6)[pos].to(device=dev, dtype=torch.bfloat16)
    r = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
    q = qkv[:, :H * D].view(m, H, D)
    kn = qkv[:, H * D:(H + Hkv) * D].view(m, Hkv, D)
    vn = qkv[:, (H + Hkv) * D:].view(m, Hkv, D)
    rows = torch.arange(m, device=dev)
    at = torch.full((m,), pos, device=dev, dtype=torch.long)
    rope = Rope(None, None, cs[None], 0.0)

    def attention() -> torch.Tensor:  # [M, H D]: csrc's decode attention with its RoPE
        return decode_attention(q, kn, vn, kc, vc, rows[:, None], rows, at, pos + 1,
                                rope=rope, pdl=bool(pdl)).reshape(m, H * D)

    def unfused(w: torch.Tensor) -> torch.Tensor:
        return gemv_residual(attention(), w, r, **kw_plain)

    def fused(w: torch.Tensor) -> torch.Tensor:
        return gemv_attend(qkv, kc, vc, cs, pos, w, r, **kw_fused)

    a, b = unfused(ws[0]), fused(ws[0])
    ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    y = attention()
    return {"m": m, "pos": pos, "plain": kw_plain, "prologue": kw_fused,
            "unfused_us": round(graph_us([functools.partial(unfused, w) for w in ws], reps), 2),
            "fused_us": round(graph_us([functools.partial(fused, w) for w in ws], reps), 2),
            "attention_us": round(graph_us([attention] * len(ws), reps), 2),
            "wo_us": round(graph_us([functools.partial(gemv_residual, y, w, r, **kw_plain)
                                     for w in ws], reps), 2),
            "prologue_16_rows_us": round(graph_us([functools.partial(
                gemv_attend, qkv, kc, vc, cs, pos, tiny, **kw_fused)] * len(ws), reps), 2),
            "max_ulps": int(ulps.max()), "differing": float((ulps > 0).float().mean())}


def bench_attend(ms: tuple[int, ...], reps: int, table: Path,
                 pdl: int = 1) -> list[dict[str, object]]:
    """The fast AR's attention and its output projection (S2-Pro: 32 query heads, 8 kv heads,
    head_dim 128, wo 2560 x 4096, 10 cache positions) at each M and at positions 1 and 9:
    csrc's decode attention with its RoPE, then wo with the residual epilogue (two launches,
    as the engine runs them) against the attention prologue (one, `gemv_attend`, with the
    normed prologue's parameter rule), and each part alone: the attention, wo, and the
    prologue on a 16-row W (its own cost with almost no weights behind it). Returns one
    result per (M, position): microseconds and the fused result's distance from the unfused
    one in bf16 ulps (the prologue's float32 attention is not csrc's decode attention's)."""
    plan = load_plan(table)
    g = torch.Generator(device="cuda").manual_seed(7)
    n, k = SHAPES["wo"]
    copies = max(2, math.ceil(ROTATE_BYTES / (2 * n * k)))
    ws = [(torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
          for _ in range(copies)]
    tiny = (torch.randn(16, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    results: list[dict[str, object]] = []
    for m in ms:
        row = plan.choose(m, n, k, False) if plan is not None else None
        prologue = _normed_params(row, (0,)) if row is not None else None
        if row is None or row.impl != "gemv" or prologue is None or m > 16:
            print(f"attend m={m}: the table has no variant-0 kernel candidate for wo here")
            continue
        kw_plain = {"splits": row.splits, "kwarps": row.kwarps, "variant": row.variant,
                    "pdl": pdl}
        kw_fused = {"splits": prologue[0], "kwarps": prologue[1], "pdl": pdl}
        for pos in (1, 9):
            res = _attend_timings(m, pos, ws, tiny, kw_plain, kw_fused, reps, pdl, g)
            print(f"attend m={m} pos={pos}: attention + wo {res['unfused_us']} us (attention "
                  f"{res['attention_us']}, wo {res['wo_us']}), prologue + wo {res['fused_us']} "
                  f"us (the prologue on 16 rows {res['prologue_16_rows_us']}); results "
                  f"{res['max_ulps']} ulp apart at most", flush=True)
            results.append(res)
    del ws
    torch.cuda.empty_cache()
    return results


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def bench_rowwise(names: list[str], ms: tuple[int, ...], reps: int, copy: float, *,
                  device: str = "cuda", shapes: dict[str, tuple[int, int]] = SHAPES,
                  rotate_bytes: int = ROTATE_BYTES) -> list[dict[str, object]]:
    """FP8 weights at the batch sizes where the engine runs their dequantised bf16 copies
    (cuBLAS): that dense GEMM against the rowwise-scaled FP8 GEMM (`torch._scaled_mm` on the
    weights requantised per output row, `quant.rowwise_fp8`, and x quantised per row by
    the compiled `quantize_rows`: W8A8, two launches), and that GEMM alone; each one's
    relative L2 error against the float32 product of x and the block-scaled weights (what
    the weight-only FP8 path computes). Rotating weight copies, CUDA-graph medians."""
    quant = fusion.compiled("quantize_rows", quantize_rows)
    out: list[dict[str, object]] = []
    for name in names:
        n, k = shapes[name]
        g = torch.Generator(device=device).manual_seed(n + k)
        base = (torch.randn(n, k, device=device, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        f8 = quantize_fp8(base)
        dense = dequantize_fp8(f8, torch.bfloat16)
        wq, ws = rowwise_fp8(f8)
        exact = dequantize_fp8(f8)  # float32
        copies = max(2, math.ceil(rotate_bytes / (n * k)))
        denses = [dense.clone() for _ in range(max(2, math.ceil(rotate_bytes / (2 * n * k))))]
        rowws = [(wq.clone(), ws.clone()) for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            want = F.linear(x.float(), exact)
            row: dict[str, object] = {"shape": name, "n": n, "k": k, "m": m}
            dense_y = F.linear(x, dense)
            row["dense_us"] = graph_us([lambda d=d, x=x: F.linear(x, d) for d in denses], reps)
            row["dense_rel_err"] = _rel(dense_y, want)
            try:
                y = fp8_rowwise_linear(x, wq, ws, quant)
                ref = fp8_rowwise_linear_torch(x, wq, ws)
                row["rowwise_agrees"] = _agrees(y, ref)
                row["rowwise_rel_err"] = _rel(y, want)
                row["rowwise_us"] = graph_us(
                    [lambda w=w, x=x: fp8_rowwise_linear(x, w[0], w[1], quant) for w in rowws],
                    reps)
                xq, xs = quant(x)
                row["rowwise_gemm_us"] = graph_us(
                    [lambda w=w, xq=xq, xs=xs: rowwise_gemm(xq, xs, w[0], w[1], torch.bfloat16)
                     for w in rowws],
                    reps)
            except Exception as e:  # not supported here: reported, nothing timed
                row["rowwise_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            io = 2 * m * (k + n)
            for key, wbytes in (("dense_us", 2 * n * k), ("rowwise_us", n * k + 4 * n),
                                ("rowwise_gemm_us", n * k + 4 * n)):
                if key in row:
                    row[key.replace("_us", "_copy_pct")] = round(
                        100 * (wbytes + io) / float(row[key]) / 1e3 / copy, 1)  # type: ignore[arg-type]
            out.append(row)
            cells = "  ".join(f"{key} {row[key]:.2f}" if isinstance(row[key], float)
                              else f"{key} {row[key]}" for key in row
                              if key not in ("shape", "n", "k", "m"))
            print(f"rowwise {name:9s} {n:6d}x{k:<5d} m={m:3d}  {cells}", flush=True)
        del denses, rowws
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def _plan_row(fp8: bool, m: int, n: int, k: int, meta: Meta, us: dict[str, float]) -> PlanRow:
    config = meta.get("config")
    return PlanRow(fp8, m, n, k, str(meta["impl"]), int(meta.get("splits", 1)),  # type: ignore[arg-type]
                   tuple(sorted((c, round(t, 2)) for c, t in us.items())),
                   int(meta.get("kwarps", 0)), int(meta.get("variant", 0)),  # type: ignore[arg-type]
                   None if config is None else tuple(sorted(config.items())))  # type: ignore[union-attr]


def merge_into(table: dict, rows: list[PlanRow], device: str, *, w8a8_only: bool = False,
               flag: str = "--into") -> dict:
    """`table` (a recorded table's JSON) with `rows` in place of its rows of the same (fp8,
    M, N, K) and kind (weight-only or W8A8: each shape and M has one of each); its other rows
    and keys kept. `w8a8_only`: only `rows`' W8A8 rows go in (its weight-only rows stay as
    they were). The table must be from `device` (timings from two GPU kinds do not mix)."""
    if table.get("device") != device:
        raise SystemExit(f"{flag}: that table was recorded on {table.get('device')!r}, "
                         f"this is {device!r}")

    def key(fp8: bool, m: int, n: int, k: int, impl: str) -> tuple:
        return fp8, m, n, k, impl in W8A8_IMPLS

    new = [r for r in rows if r.impl in W8A8_IMPLS or not w8a8_only]
    keys = {key(r.fp8, r.m, r.n, r.k, r.impl) for r in new}
    kept = [d for d in table["rows"]
            if key(d["fp8"], d["m"], d["n"], d["k"], d["impl"]) not in keys]
    merged = {**table, "rows": kept + [r.to_json() for r in new]}
    LinearPlan.from_rows(merged["rows"], "merged table")
    return merged


def merge_w8a8(table: dict, rows: list[PlanRow], device: str) -> dict:
    """`merge_into` with `rows`' W8A8 rows only (`--w8a8-into`)."""
    return merge_into(table, rows, device, w8a8_only=True, flag="--w8a8-into")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the plan table (JSON) here")
    ap.add_argument("--w8a8-into", type=Path, default=None, metavar="TABLE",
                    help="with --out: write TABLE with this sweep's W8A8 rows in place of its "
                    "W8A8 rows of the same shape and M (its weight-only rows kept): a partial "
                    "sweep, e.g. --variants 5,7, adds its W8A8 candidates to a full table")
    ap.add_argument("--into", type=Path, default=None, metavar="TABLE",
                    help="with --out: write TABLE with this sweep's rows in place of its rows "
                    "of the same shape, M and kind (weight-only / W8A8), the rest kept: a "
                    "partial sweep (--shapes, --ms) refreshes part of a full table of this GPU")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--ms", default=None,
                    help=f"rows (M) to time (default {','.join(map(str, MS))}; with --rowwise "
                    f"{','.join(map(str, ROWWISE_MS))})")
    ap.add_argument("--variants", default=",".join(map(str, (*EXACT_VARIANTS, QUANT_VARIANT))),
                    help=f"csrc kernel variants to time (of {','.join(map(str, VARIANTS))}; "
                    "3 rounds x to f16: not by default; 7, W8A8, is recorded as the W8A8 "
                    "row's candidate)")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernels out")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per candidate")
    ap.add_argument("--reference", action="store_true",
                    help="also time the dequantising FP8 reference (slow)")
    ap.add_argument("--swiglu", action="store_true",
                    help="time the packed FFN projection + SwiGLU, unfused vs the kernel's "
                    "epilogue, at the M where the table (--table) picks the kernel")
    ap.add_argument("--glu", action="store_true",
                    help="time the FP8 packed w13 with x prequantised up to w2's quantised "
                    "input: its W8A8 GEMM + the quantising gate vs the GLU GEMM (one launch), "
                    "each 128-wide prequant config (default --ms 16,32,64)")
    ap.add_argument("--norm", action="store_true",
                    help="time a block's projection + residual add + RMSNorm + next projection, "
                    "unfused vs the residual epilogue and normed prologue, at the M where the "
                    "table (--table) picks the kernel for both")
    ap.add_argument("--attend", action="store_true",
                    help="time the fast AR's attention + wo (two launches) against the "
                    "attention prologue (one), and each part alone, at the M where the table "
                    "(--table) has a variant-0 kernel candidate for wo")
    ap.add_argument("--pdl", default="auto", choices=("auto", "0", "1", "2", "3"),
                    help="csrc's kernel launch: auto (the engine's pdl=auto: FP8 weights with "
                    "programmatic dependent launch, bf16 plainly), 1 PDL, each call's first "
                    "weights fetched while the call before ends; 0 a plain launch; 2, 3 "
                    "csrc/linear.cu's other PDL modes")
    ap.add_argument("--rowwise", action="store_true",
                    help="time FP8 weights at the batch sizes that run their bf16 copies "
                    "(default --ms 16,32,64): the dense GEMM against the rowwise-scaled FP8 "
                    "GEMM (torch._scaled_mm, weights requantised per row, x per row: W8A8) "
                    "and its error; writes --out as {device, rowwise: [...]}")
    ap.add_argument("--table", type=Path, default=DEFAULT_TABLE,
                    help="the recorded table --swiglu, --norm and --attend follow")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_bench needs a CUDA device (the candidates are GPU kernels); nothing "
              "measured", file=sys.stderr)
        return 1
    if args.glu:
        with torch.inference_mode():
            res = bench_glu(tuple(int(m) for m in (args.ms or "16,32,64").split(",")),
                            args.reps)
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "glu": res}, indent=1) + "\n")
        return 0
    if args.swiglu or args.norm or args.attend:
        what = "swiglu" if args.swiglu else "norm" if args.norm else "attend"
        if not extension_available():
            print(f"--{what} needs the csrc extension, which did not build", file=sys.stderr)
            return 1
        bench = {"swiglu": bench_swiglu, "norm": bench_norm, "attend": bench_attend}[what]
        with torch.inference_mode():
            res = bench(tuple(int(m) for m in (args.ms or ",".join(map(str, MS))).split(",")),
                        args.reps, args.table,
                        pdl_mode(args.pdl, False))  # both time bf16 weights
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            what: res}, indent=1) + "\n")
        return 0
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    ms = (tuple(int(m) for m in args.ms.split(",")) if args.ms
          else ROWWISE_MS if args.rowwise else MS)
    if args.rowwise:
        copy = copy_gbs(args.reps)
        with torch.inference_mode():
            res = bench_rowwise(names, ms, args.reps, copy)
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "copy_gbs": round(copy, 1), "rowwise": res},
                                           indent=1) + "\n")
        return 0
    if args.into is not None and args.w8a8_into is not None:
        ap.error("--into and --w8a8-into are two ways to merge: give one")
    variants = tuple(int(v) for v in args.variants.split(",") if v)
    if not set(variants) <= set(VARIANTS):
        ap.error(f"variants must be among {VARIANTS}")
    t0 = time.perf_counter()
    built = extension_available()
    if not built:
        print("the csrc extension did not build: timing the library paths only",
              file=sys.stderr)
    else:
        print(f"csrc extension ready ({time.perf_counter() - t0:.0f} s)", flush=True)
        for v in FP8_VARIANTS:
            if v in variants and v != QUANT_VARIANT:  # 7 is checked against its W8A8 reference
                problem = probe_variant(v)
                print(f"variant {v} subnormal probe: {problem or 'exact'}", flush=True)
                if problem is None and v == STAGED_VARIANT:
                    problem = probe_bit_equal(v, 5)
                    print(f"variant {v} bit-equality probe against variant 5: "
                          f"{problem or 'equal'}", flush=True)
                if problem is not None:
                    variants = tuple(u for u in variants if u != v)
    triton = not args.no_triton and _triton_module() is not None
    if not args.no_triton and not triton:
        print("engine.kernels.fp8_triton cannot run here: no Triton FP8 candidates",
              file=sys.stderr)
    copy = copy_gbs(args.reps)
    device = torch.cuda.get_device_name()
    print(f"device {device}: copy bandwidth {copy:.0f} GB/s (read + write); % below = "
          "(weight + x + y bytes) / time / copy bandwidth; variants "
          f"{','.join(map(str, variants))}", flush=True)
    rows: list[PlanRow] = []
    with torch.inference_mode():
        for s in names:
            print(f"-- {s} {SHAPES[s]} at {time.perf_counter() - t0:.0f} s", flush=True)
            rows += bench_shape(s, *SHAPES[s], ms, args.reps, copy, built, args.reference,
                                variants, triton, args.pdl)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    if args.out:
        table = {"device": device, "copy_gbs": round(copy, 1), "torch": torch.__version__,
                 "variants": list(variants), "pdl": args.pdl, "rows": [r.to_json() for r in rows]}
        if args.w8a8_into is not None:
            table = merge_w8a8(json.loads(args.w8a8_into.read_text()), rows, device)
        elif args.into is not None:
            table = merge_into(json.loads(args.into.read_text()), rows, device)
        args.out.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {len(table['rows'])} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
