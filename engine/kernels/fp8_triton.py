"""FP8 block-scaled GEMM in Triton: out = x @ W^T with W in engine.quant's FP8 layout
(e4m3 `q` [N, K] row-major, float32 `scale` [ceil(N/128), ceil(K/128)] row-major,
W[n, k] = q[n, k] * scale[n // 128, k // 128]), for decode and prefill shapes (M = 1..~512).

`fp8_linear_triton` (weight-only): each program owns a BLOCK_M x BLOCK_N output tile and a run
of 128-wide K blocks (the scale blocks). Per K block it loads the x tile (bf16/fp16) and the
e4m3 weight tile, converts the weights to x's dtype in registers (exact: e4m3 fits in bf16
and fp16), accumulates `tl.dot` in fp32 over the block's 128 / BLOCK_K steps, then adds that
partial product times the block's scale. BLOCK_N divides 128, so a tile's columns share one
scale row and the scale is one scalar per K block. `swap_ab` configs compute the transposed
tile (W_tile @ x_tile^T) instead: the MMA's M side is then BLOCK_N, not the tiny M.
`prescale` configs scale the converted weight tile by its block's scale and round it to x's
dtype before the dot instead, which is exactly the reference's dequantised weight
(`engine.quant.fp8_linear_torch`), and chain every K block's dot into one accumulator (no
per-block partial to wait for and rescale).

`fp8_linear_triton_w8a8`: the same, with the activations quantised on the fly per 1 x 128
block (amax / 448, round to e4m3) and an fp8 x fp8 `tl.dot`, each block's partial product
rescaled by act_scale * w_scale. Not exact to the reference (it rounds the activations to
3 mantissa bits); it pays where the GEMM is compute-bound (prefill), not at decode's small M.
`prequant` configs quantise x once per call in a launch of their own (`quantize_act`, the
same values) and stream e4m3 x tiles with their scales: the main loop then holds no
conversion at all, where every program quantising its x tiles again repeats that work once
per output-column tile.

`dense_linear_triton`: the same kernel over a dense bf16 / fp16 W [N, K] (no scales, the
weight tiles fed to the dots as loaded, one chain of dots): a candidate beside cuBLAS at
decode's 8-64 rows (`sweep_configs(m, dense=True)`), where a recorded table chooses it.

Small M: BLOCK_M = 16 (tl.dot's minimum) and split-K: `split_k` programs per output tile each
take a run of K blocks and write an fp32 partial; a second kernel sums the partials in a fixed
order (deterministic, no atomics) and casts. `split_k=0` picks the count that fills the GPU.

No autotuning at call time: the config comes from a fixed table (`default_config`, keyed on
the M bucket, N and K) or the `config` keyword (`configs()` lists candidates to sweep), so
the first call for a (config, dtype, alignment) compiles and later calls only launch — the
call is CUDA-graph capturable once warmed, and deterministic.

Triton is imported lazily: importing this module needs neither triton nor CUDA, and off CUDA
(or without triton) the wrapper runs `engine.quant.fp8_linear_torch`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..quant import BLOCK, FP8_MAX, Fp8Weight, fp8_linear_torch, scale_shape
from .build import sm_count

ACT_DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 16  # bytes: base pointers of x, q and scale (Triton specialises on it)
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------ configs
@dataclass(frozen=True, slots=True)
class Config:
    """One launch configuration. block_n divides 128 (one scale per K block per tile),
    block_k divides 128 (a K block is 128 / block_k dot steps; W8A8 needs 128)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # compute the tile as W @ x^T (MMA M side = block_n)
    # weight-only: scale the weight tile before the dot (the reference's bf16 dequantised
    # weight, exactly) and accumulate every K block into one chain of dots, instead of a
    # float32 partial per K block scaled after its dot (which waits for each block's MMA)
    prescale: bool = False
    # W8A8: x quantised per 1 x 128 block by a launch of its own before the GEMM (once per
    # call: `quantize_act`), which then reads e4m3 x tiles and their scales — both dot
    # operands straight from shared memory, no conversion in the main loop — instead of
    # every program quantising its x tiles again (the same values either way)
    prequant: bool = False

    def check(self, *, w8a8: bool = False, dense: bool = False) -> None:
        if dense and (w8a8 or self.prescale or self.prequant):
            raise ValueError("a dense (bf16 / fp16 weight) config has no scales to apply and "
                             "no activations to quantise: prescale, prequant and W8A8 are "
                             "for FP8 weights")
        if self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_m must be 16, 32, 64, 128 or 256, got {self.block_m}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"block_n must divide 128 (16, 32, 64 or 128), got {self.block_n}")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"block_k must divide 128 (32, 64 or 128), got {self.block_k}")
        if w8a8 and self.prescale:
            raise ValueError("prescale scales the weight tile in the activations' dtype: a "
                             "weight-only config (the W8A8 kernel scales each block's product)")
        if self.prequant and not w8a8:
            raise ValueError("prequant quantises the activations: a W8A8 config only")
        if w8a8 and self.block_k != BLOCK:
            raise ValueError(f"the W8A8 kernel quantises activations per 1 x {BLOCK} block: "
                             f"block_k must be {BLOCK}, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")

    def to_json(self) -> dict[str, int | bool]:
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k,
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "swap_ab": self.swap_ab, "prescale": self.prescale, "prequant": self.prequant}

    @classmethod
    def from_json(cls, d: object, *, w8a8: bool = False, dense: bool = False) -> Config:
        """A config from `to_json`'s dict (a recorded plan's), checked; ValueError naming
        what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a Triton config must be an object, got {type(d).__name__}")
        names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "swap_ab",
                 "prescale", "prequant")
        unknown = set(d) - set(names)
        missing = {"block_m", "block_n", "block_k"} - set(d)
        if unknown or missing:
            raise ValueError(f"a Triton config takes {names} (block_m/n/k required); "
                             f"unknown {sorted(unknown)}, missing {sorted(missing)}")
        for key in names[:5]:
            v = d.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"Triton config {key} must be an int, got {v!r}")
        for key in ("swap_ab", "prescale", "prequant"):
            if not isinstance(d.get(key, False), bool):
                raise ValueError(f"Triton config {key} must be true or false, got {d[key]!r}")
        cfg = cls(**d)
        cfg.check(w8a8=w8a8, dense=dense)
        return cfg


# M buckets (upper bounds) -> config. A starting point from the shapes' arithmetic (small M:
# memory-bound, many programs, split-K; large M: bigger tiles, fewer weight re-reads); a
# sweep over `configs()` on the target GPU should replace it (bench: pass `config=`).
_TABLE: tuple[tuple[int, Config], ...] = (
    (16, Config(16, 64, 128, num_warps=4, num_stages=4)),
    (32, Config(32, 64, 128, num_warps=4, num_stages=4)),
    (64, Config(64, 64, 128, num_warps=4, num_stages=4)),
    (128, Config(64, 128, 128, num_warps=4, num_stages=3)),
    (INT32_MAX, Config(128, 128, 64, num_warps=8, num_stages=3)),
)
# W8A8 quantises activations per 1 x 128 block: BLOCK_K 128 at every size
_TABLE_W8A8: tuple[tuple[int, Config], ...] = (
    *_TABLE[:-1], (INT32_MAX, Config(128, 128, 128, num_warps=8, num_stages=3)))


def default_config(m: int, n: int, k: int, *, w8a8: bool = False) -> Config:
    """The table's config for an [m, k] x [n, k]^T GEMM (no autotuning: fixed per shape)."""
    cfg = next(c for bound, c in (_TABLE_W8A8 if w8a8 else _TABLE) if m <= bound)
    if k <= 2 * BLOCK and cfg.num_stages > 2:
        cfg = dataclasses.replace(cfg, num_stages=2)
    if n <= 64 and cfg.block_n > 32:  # a tiny N: narrower tiles for more programs
        cfg = dataclasses.replace(cfg, block_n=32)
    return cfg


# What linear_bench times per M bucket (upper bound -> configs), all among `configs()`: the
# table's entry, swap_ab (W @ x^T: the MMA's M side is block_n, not the few rows of x) with
# block_n 64 and 128, and more warps / stages for the larger tiles. Each distinct config
# costs a compilation (~1 s) on first use, so the lists stay short.
_SWEEP: tuple[tuple[int, tuple[Config, ...]], ...] = (
    (16, (Config(16, 64, 128, 4, 4), Config(16, 64, 128, 4, 4, swap_ab=True),
          Config(16, 128, 128, 4, 4, swap_ab=True))),
    (32, (Config(32, 64, 128, 4, 4), Config(32, 64, 128, 4, 4, swap_ab=True),
          Config(32, 128, 128, 4, 4, swap_ab=True), Config(32, 128, 128, 8, 4, swap_ab=True))),
    (64, (Config(64, 64, 128, 4, 4), Config(64, 128, 128, 4, 4),
          Config(64, 64, 128, 4, 4, swap_ab=True), Config(64, 128, 128, 8, 4, swap_ab=True),
          Config(64, 128, 64, 4, 5, swap_ab=True))),
)
# the prescaled kernel (weight-only): some of the same tiles with one chain of dots. On sm_90
# the swapped 128-deep ones take the dequantised weight tile as wgmma's register operand, and
# ptxas serialises their wgmmas (its warning C7515 under Triton 3.5); the unswapped 64-row
# tiles (the weight as the shared-memory operand, x's rows padded to 64 below 64 rows) keep
# them asynchronous (tests/test_triton_sm90.py), not yet timed
_SWEEP_PRESCALE: tuple[tuple[int, tuple[Config, ...]], ...] = (
    (16, (Config(16, 64, 128, 4, 4, prescale=True),
          Config(16, 128, 128, 4, 4, swap_ab=True, prescale=True),
          Config(64, 128, 128, 4, 4, prescale=True))),
    (32, (Config(32, 64, 128, 4, 4, swap_ab=True, prescale=True),
          Config(32, 128, 128, 4, 4, swap_ab=True, prescale=True),
          Config(64, 128, 128, 4, 4, prescale=True))),
    (64, (Config(64, 64, 128, 4, 4, swap_ab=True, prescale=True),
          Config(64, 128, 128, 8, 4, swap_ab=True, prescale=True),
          Config(64, 128, 64, 4, 5, swap_ab=True, prescale=True),
          Config(64, 128, 128, 4, 4, prescale=True), Config(64, 64, 128, 4, 4, prescale=True))),
)
_SWEEP_W8A8: tuple[tuple[int, tuple[Config, ...]], ...] = (
    # prequant: tiles whose dot is a wgmma (its M side >= 64 rows: x's rows at 64, else the
    # weight's, swapped); below that Triton's mma.sync path converts e4m3 operands to f16
    (16, (Config(16, 64, 128, 4, 4), Config(16, 64, 128, 4, 4, swap_ab=True, prequant=True),
          Config(16, 128, 128, 4, 4, swap_ab=True, prequant=True))),
    (32, (Config(32, 64, 128, 4, 4), Config(32, 128, 128, 4, 4, swap_ab=True),
          Config(32, 64, 128, 4, 4, swap_ab=True, prequant=True),
          Config(32, 128, 128, 4, 4, swap_ab=True, prequant=True))),
    (64, (Config(64, 64, 128, 4, 4), Config(64, 128, 128, 4, 4),
          Config(64, 128, 128, 8, 4, swap_ab=True), Config(64, 64, 128, 4, 4, prequant=True),
          Config(64, 128, 128, 4, 4, prequant=True),
          Config(64, 128, 128, 8, 4, swap_ab=True, prequant=True))),
    # prefill's rows (after the table's entry, `sweep_configs`): compute-bound, where e4m3
    # MMAs have twice bf16's rate — prequantised tiles of 128 and 64 rows
    (INT32_MAX, (Config(128, 128, 128, 8, 3, prequant=True),
                 Config(64, 128, 128, 4, 4, prequant=True))),
)


# dense weights (bf16 / fp16, `dense_linear_triton`) at 8-64 rows, where cuBLAS ran S2-Pro's
# shapes at 53-81 % of copy bandwidth on the H200 (docs/PERF.md): both dot operands through
# shared memory as loaded (no conversion), one chain of dots; unswapped tiles (x's rows on the
# MMA's M side, padded to 64 for a wgmma) and swapped ones (the weight's rows there). Above
# 64 rows none: cuBLAS's tiles are the ones to beat at prefill's sizes.
_SWEEP_DENSE: tuple[tuple[int, tuple[Config, ...]], ...] = (
    (16, (Config(16, 64, 128, 4, 4), Config(16, 64, 128, 4, 4, swap_ab=True),
          Config(16, 128, 128, 4, 4, swap_ab=True), Config(64, 128, 64, 4, 4))),
    (32, (Config(32, 64, 128, 4, 4), Config(32, 64, 128, 4, 4, swap_ab=True),
          Config(32, 128, 128, 4, 4, swap_ab=True), Config(64, 128, 64, 4, 4))),
    (64, (Config(64, 64, 128, 4, 4), Config(64, 128, 64, 4, 4), Config(64, 128, 128, 4, 3),
          Config(64, 64, 128, 4, 4, swap_ab=True), Config(64, 128, 128, 8, 3, swap_ab=True))),
)


def configs(*, w8a8: bool = False) -> tuple[Config, ...]:
    """Candidate configs for a benchmark sweep (the table's entries and `sweep_configs`'
    among them)."""
    out: list[Config] = [c for _, c in (_TABLE_W8A8 if w8a8 else _TABLE)]
    for bm in (16, 32, 64, 128):
        for bn in (32, 64, 128):
            for bk in ((128,) if w8a8 else (64, 128)):
                warps = 8 if bm * bn >= 128 * 128 else 4
                stages = 3 if bm * bk * 2 + bn * bk >= 48 * 1024 else 4
                out.append(Config(bm, bn, bk, warps, stages))
                if bm <= 64:  # small M: W @ x^T puts block_n on the MMA's M side
                    out.append(Config(bm, bn, bk, warps, stages, swap_ab=True))
    for sweep in (*_sweeps(w8a8), *(() if w8a8 else (_SWEEP_DENSE,))):
        for _, cs in sweep:
            out += cs
    return tuple(dict.fromkeys(out))


def _sweeps(w8a8: bool) -> tuple[tuple[tuple[int, tuple[Config, ...]], ...], ...]:
    """The sweep tables of a kind: W8A8's, or weight-only's plain and prescaled."""
    return (_SWEEP_W8A8,) if w8a8 else (_SWEEP, _SWEEP_PRESCALE)


def sweep_configs(m: int, *, w8a8: bool = False, dense: bool = False) -> tuple[Config, ...]:
    """The few configs worth timing for M = m rows: up to 64, the M bucket's configs
    (weight-only: its plain and prescaled ones; `dense`: the dense weights' ones); above,
    the table's entry (and for W8A8 the prequantised large tiles after it; dense: none)."""
    if dense:
        if w8a8:
            raise ValueError("dense weights have no W8A8 configs")
        return next((cs for bound, cs in _SWEEP_DENSE if m <= bound), ())
    out = [next((cs for bound, cs in sweep if m <= bound), ()) for sweep in _sweeps(w8a8)]
    if m > _SWEEP[-1][0]:
        return (default_config(m, 4096, 4096, w8a8=w8a8), *(out[0] if w8a8 else ()))
    return tuple(c for cs in out for c in cs)


def auto_split_k(m: int, n: int, k: int, cfg: Config, sms: int) -> int:
    """Splits of K so that the grid has about two programs per SM when the output tiles alone
    are fewer than the SMs (at most one split per 128-wide K block, at least two K blocks per
    split)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    kb = -(-k // BLOCK)
    if tiles >= sms or kb < 4:
        return 1
    want = min(-(-2 * sms // tiles), kb // 2)
    return normalise_split(kb, max(want, 1))


def normalise_split(kb: int, split_k: int) -> int:
    """The split count actually launched: K blocks per split = ceil(kb / split_k), and no
    split left without a block."""
    per = -(-kb // max(1, min(split_k, kb)))
    return -(-kb // per)


def launch_split(m: int, n: int, k: int, cfg: Config, split_k: int, sms: int) -> int:
    """The split count an [m, k] x [n, k]^T call with `split_k` (0: automatic) launches on a
    device of `sms` SMs."""
    kb = scale_shape(n, k)[1]
    split = auto_split_k(m, n, k, cfg, sms) if split_k == 0 else normalise_split(kb, split_k)
    while split > 1 and split * m * n > INT32_MAX:  # the fp32 partials' int32 offsets
        split = normalise_split(kb, split // 2)
    return split


# ---------------------------------------------------------------------------- contract
def check(x: Tensor, w: Fp8Weight, config: Config | None = None, split_k: int = 0, *,
          w8a8: bool = False) -> None:
    """Raise ValueError naming what breaks the contract: x bf16/fp16 [..., K] with a
    contiguous last dim, the FP8 layout (engine.quant.check_fp8), K matching, one device,
    16-byte aligned base pointers, int32-addressable sizes, a valid config and split_k."""
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"fp8_linear_triton takes an Fp8Weight, got {type(w).__name__}")
    w.check()
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    _check_x(x, w.q, "the weight's q", config, split_k, w8a8=w8a8, scale=w.scale)


def check_prequant(x: QuantAct, w: Fp8Weight, config: Config | None = None,
                   split_k: int = 0) -> None:
    """`check`'s contract for activations already quantised: x a valid `QuantAct` whose q
    [..., K] meets x's layout rules there, a W8A8 config."""
    if not isinstance(x, QuantAct):
        raise ValueError(f"the prequantised W8A8 GEMM takes a QuantAct, got {type(x).__name__}")
    x.check()
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"the prequantised W8A8 GEMM takes an Fp8Weight, got "
                         f"{type(w).__name__}")
    w.check()
    _check_x(x.q, w.q, "the weight's q", config, split_k, w8a8=True, scale=w.scale)


def check_dense(x: Tensor, w: Tensor, config: Config | None = None, split_k: int = 0) -> None:
    """`check`'s contract for a dense weight: W a [N, K] tensor of x's dtype (bf16 / fp16)
    on x's device, contiguous and 16-byte aligned."""
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError(f"dense_linear_triton takes a [N, K] weight tensor, got "
                         f"{type(w).__name__} {list(getattr(w, 'shape', []))}")
    if x.dtype not in ACT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and the weight must both be bfloat16 or both float16, got "
                         f"{x.dtype} and {w.dtype}")
    if not w.is_contiguous():
        raise ValueError(f"the weight must be contiguous (strides {w.stride()})")
    _check_x(x, w, "the weight", config, split_k, dense=True)


def _check_x(x: Tensor, q: Tensor, name: str, config: Config | None, split_k: int, *,
             w8a8: bool = False, dense: bool = False, scale: Tensor | None = None) -> None:
    """The checks a call shares whatever its weight's kind: x [..., K] against q [N, K], one
    device, alignment, int32-addressable sizes, the config and split_k."""
    if x.dim() < 1 or x.shape[-1] != q.shape[1]:
        raise ValueError(f"x {list(x.shape)} does not match the weight {list(q.shape)}: "
                         f"its last dim must be K = {q.shape[1]}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x's last dim must be contiguous (strides {x.stride()}); only its "
                         "rows may be strided")
    if x.device != q.device:
        raise ValueError(f"x on {x.device} but the weight on {q.device}")
    named = (("x", x), (name, q), *((("the weight's scale", scale),) if scale is not None
                                     else ()))
    for what, t in named:
        if t.numel() and t.data_ptr() % ALIGN:
            raise ValueError(f"{what} must start on a {ALIGN}-byte boundary (data_ptr % {ALIGN}"
                             f" = {t.data_ptr() % ALIGN}); slice it from an aligned buffer")
    n, k = q.shape
    m = x.numel() // k if k else 0
    if q.numel() > INT32_MAX or m * max(n, k) > INT32_MAX:
        raise ValueError(f"a [{m}, {k}] x [{n}, {k}]^T GEMM is too large for int32 offsets")
    if config is not None:
        if not isinstance(config, Config):
            raise ValueError(f"config must be a fp8_triton.Config, got {type(config).__name__}")
        config.check(w8a8=w8a8, dense=dense)
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 0:
        raise ValueError(f"split_k must be an int >= 0 (0: automatic), got {split_k!r}")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def available() -> bool:
    """Triton importable and a CUDA device present that has e4m3 conversions (sm_89+)."""
    if not torch.cuda.is_available() or not _triton_importable():
        return False
    try:
        return torch.cuda.get_device_capability() >= (8, 9)
    except Exception:
        return False


@functools.cache
def _smem_bytes(index: int) -> int | None:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin",
                   None)


def fit_smem(cfg: Config, smem: int | None, *, w8a8: bool = False,
             dense: bool = False) -> Config:
    """`cfg` with num_stages lowered until its pipelined tiles (x in 16 bits, W in 8 — dense:
    16 —, plus the converted operand the dot reads from shared memory) fit in `smem` bytes
    (the table's stage counts are for Hopper's 227 KiB; sm_89 parts have about 100)."""
    if smem is None:
        return cfg
    per_stage = cfg.block_m * cfg.block_k * (1 if cfg.prequant else 2) \
        + cfg.block_n * cfg.block_k * (2 if dense else 1)
    scratch = (0 if cfg.prequant or dense else cfg.block_m if w8a8
               else 2 * cfg.block_n) * cfg.block_k
    stages = cfg.num_stages
    while stages > 1 and stages * per_stage + scratch > smem:
        stages -= 1
    if stages == cfg.num_stages:
        return cfg
    return dataclasses.replace(cfg, num_stages=stages)


# ------------------------------------------------------------------------------ kernels
@functools.cache
def _kernels():
    """Compile-on-first-use Triton kernels (imported lazily: no triton needed to import
    this module)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def fp8_gemm(x_ptr, q_ptr, s_ptr, out_ptr, xs_ptr, r_ptr, M, N, K, stride_xm, stride_om,
                 stride_os, stride_rm, blocks_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, ACT_FP8: tl.constexpr,
                 PRESCALE: tl.constexpr, X_Q: tl.constexpr, DENSE: tl.constexpr,
                 RESIDUAL: tl.constexpr):
        # X_Q (with ACT_FP8): x_ptr holds x already quantised (e4m3 [M, K] rows) and xs_ptr
        # its float32 scales [M, ceil(K / 128)] (`quant_rows`). DENSE: q_ptr holds W itself
        # in x's dtype ([N, K] rows; s_ptr unused): one chain of dots, no scales. RESIDUAL
        # (unsplit launches only; with splits the reduce adds it): out = r + the product,
        # the product rounded to out's dtype first, as the linear and then the add round
        # program (pid, split): output tile pid (M tiles fastest, so the programs reading one
        # weight tile run together and share it through L2), K blocks of split `split`
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_pid_m
        pid_n = pid // num_pid_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rm = offs_m % M  # rows/columns past the end re-read valid ones; the store masks them
        rn = offs_n % N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        q_ptrs = q_ptr + rn[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        kb = tl.cdiv(K, 128)
        s_ptrs = s_ptr + (pid_n * BLOCK_N // 128) * kb  # this tile's scale row
        b0 = split * blocks_per_split
        b1 = tl.minimum(b0 + blocks_per_split, kb)
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(b0, b1):
            if DENSE:
                s_b = 1.0
            else:
                s_b = tl.load(s_ptrs + b)
            if SWAP_AB:
                part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.static_range(0, 128, BLOCK_K):
                k0 = b * 128 + kk
                if EVEN_K:
                    xt = tl.load(x_ptrs + k0)
                    wt = tl.load(q_ptrs + k0)
                else:
                    kmask = (k0 + offs_k) < K
                    xt = tl.load(x_ptrs + k0, mask=kmask[None, :], other=0.0)
                    wt = tl.load(q_ptrs + k0, mask=kmask[None, :], other=0.0)
                if DENSE:
                    if SWAP_AB:
                        acc = tl.dot(wt, tl.trans(xt), acc)
                    else:
                        acc = tl.dot(xt, tl.trans(wt), acc)
                elif PRESCALE:  # W's tile scaled and rounded as the reference dequantises it
                    wb = (wt.to(tl.float32) * s_b).to(xt.dtype)
                    if SWAP_AB:
                        acc = tl.dot(wb, tl.trans(xt), acc)
                    else:
                        acc = tl.dot(xt, tl.trans(wb), acc)
                elif ACT_FP8:  # BLOCK_K == 128: this tile is the rows' 1 x 128 blocks
                    if X_Q:
                        xq = xt
                        a_s = tl.load(xs_ptr + rm * kb + b)  # [BLOCK_M]
                    else:
                        xf = xt.to(tl.float32)
                        # true divisions (`/` is div.full.f32, an ulp off at times: a value
                        # on an e4m3 tie would round otherwise than the reference)
                        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30),
                                             448.0)
                        xq = tl.clamp(tl.math.div_rn(xf, a_s[:, None]), -448.0,
                                      448.0).to(tl.float8e4nv)
                    if SWAP_AB:
                        part += tl.dot(wt, tl.trans(xq)) * a_s[None, :]
                    else:
                        part += tl.dot(xq, tl.trans(wt)) * a_s[:, None]
                else:
                    wb = wt.to(xt.dtype)
                    if SWAP_AB:
                        part = tl.dot(wb, tl.trans(xt), part)
                    else:
                        part = tl.dot(xt, tl.trans(wb), part)
            if not (PRESCALE or DENSE):
                acc += part * s_b
        out = acc.to(out_ptr.dtype.element_ty)
        base = out_ptr + split * stride_os
        if SWAP_AB:
            ptrs = base + offs_n[:, None] + offs_m[None, :] * stride_om
            mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        else:
            ptrs = base + offs_m[:, None] * stride_om + offs_n[None, :]
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if RESIDUAL:
            if SWAP_AB:
                r_ptrs = r_ptr + offs_n[:, None] + offs_m[None, :] * stride_rm
            else:
                r_ptrs = r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
            r = tl.load(r_ptrs, mask=mask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(ptrs, out, mask=mask)

    @triton.jit
    def reduce_splits(p_ptr, out_ptr, r_ptr, MN, N, stride_rm, splits, BLOCK: tl.constexpr,
                      RESIDUAL: tl.constexpr):
        # out[i] = sum over s in order of p[s, i] (fp32), cast: the split-K epilogue; with
        # RESIDUAL then + r[i // N, i % N] (rows stride_rm apart), rounded again
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
        y = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:
            row = offs // N
            r = tl.load(r_ptr + row * stride_rm + (offs - row * N), mask=mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, y, mask=mask)

    @triton.jit
    def quant_rows(x_ptr, q_ptr, s_ptr, K, stride_xm, kb, BLOCK: tl.constexpr):
        # row m's K block b: amax / 448 and the block rounded to e4m3, exactly as fp8_gemm
        # quantises an x tile in its main loop (the same operations, in the same order)
        m = tl.program_id(0)
        b = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        ok = offs < K
        xf = tl.load(x_ptr + m * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30), 448.0)
        q = tl.clamp(tl.math.div_rn(xf, a_s), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + m * K + offs, q, mask=ok)
        tl.store(s_ptr + m * kb + b, a_s)

    return fp8_gemm, reduce_splits, quant_rows


REDUCE_BLOCK = 1024


def quantize_act(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] (bf16/fp16 on CUDA or under Triton's interpreter, last dim contiguous, 16-byte
    aligned: `check`'s contract) -> (e4m3 [M, K], float32 scales
    [M, ceil(K/128)]): the W8A8 kernel's own per-block quantisation as one launch, with
    true divisions: `quantize_act_torch`'s values bit for bit."""
    _, _, quant = _kernels()
    m, k = x2.shape
    kb = scale_shape(1, k)[1]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=x2.device)
    if m and k:
        quant[(m, kb)](x2, q, s, k, x2.stride(0), kb, BLOCK=BLOCK, num_warps=1)
    return q, s


def _launch(x2: Tensor, q: Tensor, scale: Tensor | None, cfg: Config, split_k: int, sms: int,
            *, w8a8: bool = False, xs: Tensor | None = None,
            residual: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """x2 [M, K] (rows strided, last dim contiguous) @ W^T -> out [M, N] in x2's dtype (or
    `out_dtype`), W the FP8 weight's (q [N, K], scale) or, with scale None, dense q in x2's
    dtype. `xs` (W8A8): x2 is x already quantised (e4m3) and xs its scales [M, ceil(K/128)].
    `residual` [M, N] (rows strided, last dim contiguous): out = residual + the product.
    Contract already checked; split_k = 0: automatic."""
    import triton

    gemm, reduce_splits, _ = _kernels()
    m, k = x2.shape
    n = q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    kb = scale_shape(n, k)[1]
    split = launch_split(m, n, k, cfg, split_k, sms)
    per = -(-kb // split)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                             device=x2.device)
    s = q if scale is None else scale  # the dense kernel reads no scales
    x_q = xs is not None or (w8a8 and cfg.prequant)  # the GEMM reads e4m3 x and its scales
    if xs is not None:
        xq = x2
    else:
        xq, xs = quantize_act(x2) if x_q else (x2, s)  # xs: unused unless x_q
    r = out if residual is None else residual  # r: unused without one
    gemm[(tiles, split)](
        xq, q, s, dst, xs, r, m, n, k, xq.stride(0), n, 0 if split == 1 else m * n,
        r.stride(0), per,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % BLOCK == 0, SWAP_AB=cfg.swap_ab, ACT_FP8=w8a8, PRESCALE=cfg.prescale,
        X_Q=x_q,
        DENSE=scale is None, RESIDUAL=residual is not None and split == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        reduce_splits[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            dst, out, r, m * n, n, r.stride(0), split, BLOCK=REDUCE_BLOCK,
            RESIDUAL=residual is not None, num_warps=4)
    return out


# ----------------------------------------------------------------------------- wrappers
def _check_residual(residual: Tensor | None, x: Tensor, n: int, dtype: torch.dtype) -> None:
    """A residual for out [..., N] = residual + x W^T: x's leading shape and N, the output's
    dtype, x's device, its last dim contiguous, 16-byte aligned."""
    if residual is None:
        return
    want = (*x.shape[:-1], n)
    if tuple(residual.shape) != want:
        raise ValueError(f"residual {list(residual.shape)} must have the output's shape "
                         f"{list(want)}")
    if residual.dtype != dtype:
        raise ValueError(f"residual must be {dtype} (the output's dtype), got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual on {residual.device} but x on {x.device}")
    if n > 1 and residual.stride(-1) != 1:
        raise ValueError(f"residual's last dim must be contiguous (strides {residual.stride()})")
    if residual.numel() and residual.data_ptr() % ALIGN:
        raise ValueError(f"residual must start on a {ALIGN}-byte boundary")
    if residual.numel() and sum((d - 1) * st for d, st in zip(residual.shape,
                                                             residual.stride())) >= INT32_MAX:
        raise ValueError("residual spans too many elements for int32 offsets")


def _run(x: Tensor, q: Tensor, scale: Tensor | None, config: Config | None, split_k: int,
         kernel: bool, w8a8: bool, *, xs: Tensor | None = None,
         residual: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor | None:
    """The kernel's product (contract checked by the caller) where it runs here, else None;
    `scale` None: q is a dense weight; `xs`: x is already quantised (its scales, [..., kb])."""
    if not (kernel and x.is_cuda and available()):
        return None
    n, k = q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    dtype = out_dtype or x.dtype
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((*lead, n), dtype=dtype, device=x.device)
        return out if residual is None else out + residual
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg = config or fit_smem(default_config(m, n, k, w8a8=w8a8), _smem_bytes(index),
                             w8a8=w8a8, dense=scale is None)
    r2 = None if residual is None else residual.reshape(m, n)
    with torch.cuda.device(index):
        out = _launch(x2, q, scale, cfg, split_k, sm_count(x.device), w8a8=w8a8,
                      xs=None if xs is None else xs.reshape(m, -1), residual=r2,
                      out_dtype=dtype)
    return out.view(*lead, n)


def _plus(out: Tensor, residual: Tensor | None) -> Tensor:
    """A fallback's product with its residual added as the epilogue adds it (rounded, then
    the sum rounded: the linear, then the add)."""
    return out if residual is None else residual + out


def fp8_linear_triton(x: Tensor, w: Fp8Weight, *, config: Config | None = None,
                      split_k: int = 0, kernel: bool = True,
                      residual: Tensor | None = None) -> Tensor:
    """x [..., K] (bf16/fp16; rows may be strided) @ W^T, W an `Fp8Weight` [N, K] -> [..., N]
    in x's dtype, fp32 accumulation, weight-only dequantisation in registers. `config`: a
    `Config` (None: `default_config`'s table); `split_k`: programs per output tile along K
    (0: enough to fill the GPU; clamped to the 128-wide K blocks; the result does not depend
    on it beyond fp32 summation order). `residual` [..., N] (x's dtype): residual + the
    product in the epilogue (the block's residual add; the split reduce adds it), rounded
    as the linear then the add. Off CUDA, without Triton, or `kernel=False`: the torch
    reference `engine.quant.fp8_linear_torch`."""
    check(x, w, config, split_k)
    _check_residual(residual, x, w.q.shape[0], x.dtype)
    out = _run(x, w.q, w.scale, config, split_k, kernel, w8a8=False, residual=residual)
    return _plus(fp8_linear_torch(x, w), residual) if out is None else out


def dense_linear_triton(x: Tensor, w: Tensor, *, config: Config | None = None,
                        split_k: int = 0, kernel: bool = True,
                        residual: Tensor | None = None) -> Tensor:
    """x [..., K] @ W^T for a dense W [N, K] of x's dtype (bf16 / fp16) -> [..., N], fp32
    accumulation: the same kernel with the weight tiles fed to the dots as loaded (a
    candidate beside cuBLAS for decode's 8-64 rows, `sweep_configs(m, dense=True)`);
    `config`, `split_k` and `residual` as `fp8_linear_triton`'s (a config without prescale
    or prequant). Off CUDA, without Triton, or `kernel=False`: F.linear."""
    check_dense(x, w, config, split_k)
    _check_residual(residual, x, w.shape[0], x.dtype)
    out = _run(x, w, None, config, split_k, kernel, w8a8=False, residual=residual)
    return _plus(torch.nn.functional.linear(x, w), residual) if out is None else out


def quantize_act_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]): per 1 x 128 block,
    scale = amax / 448, as the W8A8 kernels do it on the fly. The division is a true one on
    every device (a CUDA tensor divided by a Python number is multiplied by its reciprocal,
    a rounding apart: then a block's values could round otherwise than csrc's variant 7,
    which divides exactly)."""
    m, k = x.shape
    kb = scale_shape(1, k)[1]
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(m, kb, BLOCK)
    amax = xf.abs().amax(-1).clamp_min(1e-30)
    s = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, kb * BLOCK)[:, :k], s


def _w8a8_product_torch(q: Tensor, s: Tensor, w: Fp8Weight, dtype: torch.dtype) -> Tensor:
    """Quantised rows q [M, K] (e4m3) with scales s [M, kb], dequantised, times the
    dequantised weight, in float32 -> [M, N] in `dtype`."""
    from ..quant import dequantize_fp8

    return (_dequantised(q, s) @ dequantize_fp8(w, torch.float32).T).to(dtype)


def _dequantised(q: Tensor, s: Tensor) -> Tensor:
    """e4m3 rows q [..., K] times their 1 x 128 block scales s [..., ceil(K/128)], float32."""
    return q.float() * s.repeat_interleave(BLOCK, -1)[..., :q.shape[-1]]


def fp8_linear_w8a8_torch(x: Tensor, w: Fp8Weight) -> Tensor:
    """The W8A8 reference: activations quantised per 1 x 128 block (quantize_act_torch),
    dequantised, times the dequantised weight, in float32 -> x's dtype."""
    k = w.q.shape[1]
    q, s = quantize_act_torch(x.reshape(-1, k))
    return _w8a8_product_torch(q, s, w, x.dtype).view(*x.shape[:-1], w.q.shape[0])


def fp8_linear_triton_w8a8(x: Tensor, w: Fp8Weight, *, config: Config | None = None,
                           split_k: int = 0, kernel: bool = True,
                           residual: Tensor | None = None) -> Tensor:
    """Like `fp8_linear_triton`, with the activations quantised per 1 x 128 block to e4m3 on
    the fly and an fp8 x fp8 dot (config.block_k must be 128). Approximates the reference by
    e4m3's rounding of x (about 2^-5 relative per element); the fallback is
    `fp8_linear_w8a8_torch`, which rounds the same way. `residual` as there."""
    check(x, w, config, split_k, w8a8=True)
    _check_residual(residual, x, w.q.shape[0], x.dtype)
    out = _run(x, w.q, w.scale, config, split_k, kernel, w8a8=True, residual=residual)
    return _plus(fp8_linear_w8a8_torch(x, w), residual) if out is None else out


@dataclass(frozen=True, slots=True)
class QuantAct:
    """Activations quantised for a W8A8 GEMM by the op that made them (`engine.kernels.
    act_quant`: the norm or the silu * mul with the quantisation in its launch): q [..., K]
    e4m3, contiguous; s [..., ceil(K/128)] float32, amax / 448 of each 1 x 128 block;
    `dtype` the activations' own dtype (bf16 / fp16), the product's."""

    q: Tensor
    s: Tensor
    dtype: torch.dtype

    def check(self) -> None:
        """Raise ValueError naming what breaks the layout."""
        if self.q.dtype != torch.float8_e4m3fn or self.s.dtype != torch.float32:
            raise ValueError(f"QuantAct needs e4m3 q and float32 s, got {self.q.dtype} and "
                             f"{self.s.dtype}")
        if self.dtype not in ACT_DTYPES:
            raise ValueError(f"QuantAct's dtype must be bfloat16 or float16, got {self.dtype}")
        k = self.q.shape[-1] if self.q.dim() else 0
        want = (*self.q.shape[:-1], scale_shape(1, k)[1])
        if self.q.dim() < 1 or tuple(self.s.shape) != want:
            raise ValueError(f"QuantAct's scales {list(self.s.shape)} do not match q "
                             f"{list(self.q.shape)}: expected {list(want)}")
        if not (self.q.is_contiguous() and self.s.is_contiguous()):
            raise ValueError("QuantAct's q and s must be contiguous")
        if self.s.device != self.q.device:
            raise ValueError(f"QuantAct's s on {self.s.device} but q on {self.q.device}")

    def dequantize(self) -> Tensor:
        """The values the GEMM multiplies: q * s per block, in float32 [..., K]."""
        return _dequantised(self.q, self.s)


def fp8_linear_triton_prequant(x: QuantAct, w: Fp8Weight, *, config: Config | None = None,
                               split_k: int = 0, kernel: bool = True,
                               residual: Tensor | None = None) -> Tensor:
    """The W8A8 GEMM over activations its producer already quantised (x: `QuantAct`, e.g.
    from the norm before it): `fp8_linear_triton_w8a8`'s product without its quantising
    launch -> [..., N] in x.dtype; `config` any W8A8 config (None: the default), `split_k`
    and `residual` as there. Off CUDA, without Triton, or `kernel=False`: the same values
    dequantised times the dequantised weight in float32 (`fp8_linear_w8a8_torch`'s
    product)."""
    check_prequant(x, w, config, split_k)
    _check_residual(residual, x.q, w.q.shape[0], x.dtype)
    out = _run(x.q, w.q, w.scale, config, split_k, kernel, w8a8=True, xs=x.s,
               residual=residual, out_dtype=x.dtype)
    if out is not None:
        return out
    k = w.q.shape[1]
    y = _w8a8_product_torch(x.q.reshape(-1, k), x.s.reshape(-1, x.s.shape[-1]), w, x.dtype)
    return _plus(y.view(*x.q.shape[:-1], w.q.shape[0]), residual)
