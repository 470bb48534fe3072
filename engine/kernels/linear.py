"""`linear_small_m` (csrc/linear.cu): y = x @ W^T for the few rows of a decode step
(M = prod(x.shape[:-1]) <= 64) on the tensor cores, with W in bf16 (`gemv`) or in FP8 e4m3 with
128 x 128 block scales (`fp8_gemv`, engine/quant.py's `Fp8Weight`); and the per-shape choice
among it, the library GEMM and the Triton FP8 kernels (`LinearPlan`, `make_linear`), made from
a table the benchmark records on the target GPU (`python -m bench_latency.linear_bench --out
table.json`; a table recorded on another device kind is ignored).

Kernel variants (`variant=`, the table picks one per shape):
  0  register batches: a warp issues a batch of 16-byte weight loads, waits, converts and
     multiplies, then issues the next (bf16 and FP8; FP8 converted exactly, as bf16)
  1  pipelined: weights stream through a per-warp cp.async ring in shared memory, S - 1
     chunks in flight while the oldest is computed (bf16 and FP8; exact like 0)
  2  FP8 only: 1 without the per-element 2^120 multiply (folded into the block scale); exact
     where the tensor cores keep subnormal inputs and products (the bench probes it)
  3  FP8 only, sm_89+: 1 with the hardware e4m3x2 -> f16x2 conversion and f16 MMAs; x is
     rounded to f16 (exact for 2^-17 <= |x| <= 65504; larger |x| saturate to 65504)
  4  0 software-pipelined in registers: a warp's next batch of weight loads goes out before
     this batch's MMAs, its first batch before the PDL wait (bit-equal to 0; everything 0
     takes: the SwiGLU, residual and normed epilogues and prologue, but not the attention
     prologue)
  5  4 with half of 0's batches at M <= 16 and one block per SM more (FP8 at M <= 8: three
     where 0 has two): more warps to issue the FP8 conversion (bit-equal to 0 with one warp
     per tile, exact the same way otherwise; the same epilogues and prologue as 4)
  6  FP8 only, sm_89+, at most NORM_MAX_M rows whose M x (K + NORM_PAD) bf16 fit
     NORM_SMEM_MAX: 5 with the hardware e4m3x2 -> f16x2 conversion (one instruction per pair
     where the bit move takes five) and f16 MMAs; a prologue stages x's rows (normed first in
     `gemv_normed`) in shared memory as f16 times a power of two that puts each row's largest
     |value| in [2^14, 2^15), the epilogue scales back: every product 2^e times 5's, so
     bit-equal to 5 where the f16 MMAs sum as the bf16 ones do (linear_bench probes it
     before recording 6) unless a row's values span more than 2^31 (the smallest then
     rounded: an error under 2^-39 of the row's largest per value, times its weight)
  7  FP8 only, sm_89+, at most NORM_MAX_M rows whose e4m3 copy (QUANT_PAD bytes more per
     row, 64 bytes of scales per 128 of K; and the normed rows in `gemv_normed`) fit
     NORM_SMEM_MAX: W8A8. 5 with x quantised to e4m3 per 1 x 128 block of K by a prologue
     (normed first in `gemv_normed`) and e4m3 MMAs: no conversion of the weights at all.
     Other numerics (x rounded to e4m3, about 2^-5 relative):
     `fp8_triton.fp8_linear_w8a8_torch` is its reference and fallback. A table's W8A8 row
     runs it ("gemv_w8a8", taken only with `fp8_activations`), never a weight-only row.

`gemv_swiglu` runs the same kernel with a SwiGLU epilogue: for the packed FFN input
projection [W1; W3] it writes silu(x W1^T) * (x W3^T) straight from the accumulators (one
launch where the FFN took two), and `make_swiglu` picks it per shape like `make_linear`.
`gemv_residual` adds a residual in the epilogue, `gemv_normed` RMS-norms x in a prologue, and
`gemv_attend` computes one position's attention over a few cached positions (the fast AR's)
in a prologue (csrc's `linear_small_m_attend`; `make_attend`, off by default in `build_ops`).

The kernels' contract (checked here, then again in C++): x bf16 [..., K] whose leading dims
flatten to rows without a copy (last dim contiguous; row stride a multiple of 8 elements and
the base 16-byte aligned), K % 16 == 0, 1 <= M <= 64; W contiguous and 16-byte aligned.
Output: bf16 [..., N], float32 accumulation, rounded once.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional
from ..quant import BLOCK as FP8_BLOCK
from ..quant import Fp8Weight, fp8_linear_torch, fp8_rowwise_linear, quantize_rows
from . import act_quant
from .build import CURRENT_DEVICE, current_device_name, device_table, extension_available, kernel_ok

MAX_M = 64  # the kernel's largest template: 8 MMA tiles of 8 rows
MAX_SPLITS = 64
K_MULTIPLE = 16
KWARPS = (0, 1, 2, 4, 8)  # warps per 16-row tile splitting K inside a block; 0: automatic
VARIANTS = (0, 1, 2, 3, 4, 5, 6, 7)  # csrc kernel variants (module docstring)
FP8_VARIANTS = (2, 3, 6, 7)  # variants that exist for FP8 weights only
# register batches: FP8 SwiGLU and the normed prologue run in these
BATCHED_VARIANTS = (0, 4, 5, 6, 7)
STAGED_VARIANT = 6  # x's rows staged in shared memory in f16 (at most NORM_MAX_M of them)
QUANT_VARIANT = 7  # W8A8: x's rows quantised to e4m3 in shared memory (at most NORM_MAX_M)
# what a recorded table chooses among by default: the variants exact to bf16 x (3 rounds x to
# f16, which saturates above 65504: only for activations known to be small, on request; 6
# scales each row by a power of two first: bit-equal to 5 unless a row spans 2^31)
EXACT_VARIANTS = (0, 1, 2, 4, 5, 6)
IMPLS = ("library", "gemv", "triton", "triton_w8a8", "rowwise_w8a8", "gemv_w8a8")
W8A8 = "triton_w8a8"  # FP8 activations: another numerics, taken only when asked
# the same, through the rowwise-scaled FP8 GEMM (torch._scaled_mm) on the weights' rowwise
# copies (`Fp8Weight.rowwise`) with x quantised per row
ROWWISE = "rowwise_w8a8"
# the same, through csrc's small-M kernel in variant 7 (x quantised per 1 x 128 block, as
# the Triton W8A8 kernel does; e4m3 MMAs)
GEMV_W8A8 = "gemv_w8a8"
W8A8_IMPLS = (W8A8, ROWWISE, GEMV_W8A8)  # a shape's W8A8 row takes one of these
DEFAULT_TABLE = Path(__file__).with_name("linear_table.json")

log = logging.getLogger(__name__)

LinearFn = Callable[[Tensor, Tensor | Fp8Weight], Tensor]


# ---------------------------------------------------------------------- contract
def _problem(x: Tensor, wq: Tensor, splits: object, kwarps: object,
             fp8: bool, variant: object = 0) -> str | None:
    """What keeps the kernel from taking x [..., K] and weights wq [N, K] (bf16, or e4m3 with
    `fp8`; an FP8 weight's scales are checked by Fp8Weight.check and in C++), or None."""
    want = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if not isinstance(wq, Tensor) or wq.dtype != want:
        return f"the weight must be a {want} tensor, got {getattr(wq, 'dtype', type(wq).__name__)}"
    if isinstance(splits, bool) or not isinstance(splits, int) or not 0 <= splits <= MAX_SPLITS:
        return f"splits must be an int in 0..{MAX_SPLITS} (0: automatic), got {splits!r}"
    if isinstance(kwarps, bool) or kwarps not in KWARPS:
        return f"kwarps must be one of {KWARPS} (0: automatic), got {kwarps!r}"
    if isinstance(variant, bool) or variant not in VARIANTS:
        return f"variant must be one of {VARIANTS}, got {variant!r}"
    if variant in FP8_VARIANTS and not fp8:
        return f"variant {variant} converts FP8 weights; bf16 weights take variant 0, 1, 4 or 5"
    if x.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x.dtype}"
    if wq.dim() != 2:
        return f"the weight must be [N, K], got shape {tuple(wq.shape)}"
    n, k = wq.shape
    if x.dim() < 1 or x.shape[-1] != k:
        return f"x's last dim must be K = {k} (the weight is {tuple(wq.shape)}), got x " \
               f"{tuple(x.shape)}"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return f"K = {k} must be a positive multiple of {K_MULTIPLE}"
    if n < 1:
        return "the weight has no rows (N = 0)"
    m = x.numel() // k
    if m > MAX_M:
        return f"M = {m} rows (x {tuple(x.shape)}); the kernel takes at most {MAX_M}"
    if variant == STAGED_VARIANT and not _stages(m, k, _device_index(x)):
        return _staging_problem(m, k)
    if variant == QUANT_VARIANT and not _quantises(m, k, False, _device_index(x)):
        return _quant_problem(m, k, False)
    if x.device != wq.device:
        return f"x is on {x.device} but the weight on {wq.device}"
    if not wq.is_contiguous() or wq.data_ptr() % 16:
        return "the weight must be contiguous and 16-byte aligned"
    if m == 0:
        return None
    try:
        x2 = x.view(m, k)
    except RuntimeError:
        return (f"x's leading dims (shape {tuple(x.shape)}, strides {x.stride()}) do not "
                "flatten to rows without a copy")
    if x2.stride(1) != 1:
        return f"x's last dim must be contiguous, got strides {x.stride()}"
    if x2.data_ptr() % 16 or (m > 1 and x2.stride(0) % 8):
        return (f"x's rows must be 16-byte aligned (the base address, and a row stride that is "
                f"a multiple of 8 elements), got row stride {x2.stride(0)} and a base "
                f"{x2.data_ptr() % 16} bytes past a 16-byte boundary")
    return None


def _operands(w: Tensor | Fp8Weight) -> tuple[Tensor, Tensor | None]:
    """The kernel's weight operands: (e4m3 values, block scales) of an Fp8Weight, (w, None)
    of a dense weight."""
    return (w.q, w.scale) if isinstance(w, Fp8Weight) else (w, None)


def _check_fp8(w: object) -> Fp8Weight:
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"fp8_gemv takes an Fp8Weight, got {type(w).__name__}")
    w.check()
    return w


@functools.cache
def _mma_device(index: int) -> bool:
    """The kernel's bf16 MMA needs compute capability 8.0+."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


@functools.cache
def _cvt_device(index: int) -> bool:
    """Variant 3's e4m3 conversion instructions need compute capability 8.9+."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _mma_current() -> bool:
    return _mma_device(torch.cuda.current_device())


def _device_ok(index: int, variant: int) -> bool:
    return _mma_device(index) and (variant not in (3, STAGED_VARIANT, QUANT_VARIANT)
                                   or _cvt_device(index))


def _use_kernel(kernel: bool, x: Tensor, wq: Tensor, variant: int = 0) -> bool:
    return kernel_ok(kernel, x, wq) and _device_ok(x.device.index or 0, variant)


def _run(x: Tensor, wq: Tensor, scale: Tensor | None, splits: int, kwarps: int,
         variant: int = 0, glu: bool = False, residual: Tensor | None = None,
         norm: tuple[Tensor, float] | None = None, pdl: bool | int = False) -> Tensor:
    """The kernel on a contract-checked x [..., K] (CUDA, extension built); `glu`: the
    SwiGLU epilogue (wq = [W1; W3], output [..., N / 2]); `residual` [..., N]: added to
    the output (checked by `_residual_problem`); `norm` (weight [K], eps): x is normed
    first (checked by `_norm_problem`); `pdl`: launched with programmatic dependent launch
    (sm_90+, csrc/launch.cuh: the kernel's blocks start while the kernel before ends; an
    int picks one of csrc/linear.cu's PDL modes, True = 1)."""
    n, k = wq.shape
    m = x.numel() // k
    n_out = n // 2 if glu else n
    out = torch.empty(m, n_out, dtype=torch.bfloat16, device=x.device)
    if m:
        nw, eps = norm if norm is not None else (None, 0.0)
        torch.ops.rtvoice_kernels.linear_small_m(
            x.view(m, k), wq, scale, out, splits, kwarps, variant, glu,
            None if residual is None else residual.view(m, n), nw, eps, int(pdl))
    return out.view(*x.shape[:-1], n_out)


# the normed prologue keeps M x (K + NORM_PAD) bf16 rows in shared memory (csrc/linear.cu)
NORM_MAX_M = 16
NORM_PAD = 32
NORM_SMEM_MAX = 160 * 1024
# the kernel's own (its warps' partial sums, variant 6's row scales), at most
NORM_STATIC_SMEM = 8 * 1024 + 64
# The rows up to which Ops takes the normed prologue: measured on the H200 (linear_bench
# --norm), wo + add_rms_norm + wqkv 22.88 -> 21.79 us at M = 1 and 23.66 -> 23.30 at M = 2,
# but 24.0 -> 24.3 at M = 4 and 24.2 -> 29.2 at M = 8 (w2 -> w13: 48.4 -> 64.4 us at M = 4):
# every block's prologue reads its rows' h from L2 one row after another before its main
# loop starts, which costs more than the norm's own launch from a few rows on.
NORMED_DISPATCH_M = 2
# FP8 [W1; W3]: the SwiGLU epilogue's rows (compiled into the two smallest FP8 tiles only:
# in the larger ones its registers made the kernel spill)
FP8_GLU_MAX_M = 16
# FP8 weights: the same. With the fewest warps per tile (`_normed_params`: fewer blocks
# normalising the rows) the FP8 frame step took 4.64 / 4.81 ms at batch 1 / 2 with the
# prologue against 4.68 / 4.87 with the norms as their own launches (H200, 2026-12-03;
# with the plan's own kwarps it had lost: 5.42 against 5.19 ms).
NORMED_DISPATCH_M_FP8 = 2


def _residual_problem(x: Tensor, w: Tensor | Fp8Weight, r: object) -> str | None:
    """What keeps the residual epilogue from adding r to x W^T (the plain contract aside),
    or None: r must be a bf16 tensor of the output's shape whose rows flatten without a
    copy, last dim contiguous."""
    n = w.shape[0]
    if not isinstance(r, Tensor) or r.dtype != torch.bfloat16:
        return f"the residual must be a bfloat16 tensor, got {getattr(r, 'dtype', type(r).__name__)}"
    want = (*x.shape[:-1], n)
    if tuple(r.shape) != want:
        return f"the residual must have the output's shape {want}, got {tuple(r.shape)}"
    if r.device != x.device:
        return f"the residual is on {r.device}, x on {x.device}"
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    try:
        r2 = r.view(m, n)
    except RuntimeError:
        return f"the residual's rows (strides {r.stride()}) do not flatten without a copy"
    if m and r2.stride(1) != 1:
        return f"the residual's last dim must be contiguous, got strides {r.stride()}"
    return None


def _norm_problem(x: Tensor, w: object, nw: object, eps: object) -> str | None:
    """What keeps the normed prologue from taking x [..., K] (the plain contract aside; bf16
    or FP8 W, variant 0, 4, 5 or 6), or None: at most NORM_MAX_M rows that fit its shared memory, a
    contiguous bf16 norm weight [K], eps >= 0."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not _stages(m, k):
        return (f"the normed prologue holds the rows in shared memory: at most {NORM_MAX_M} "
                f"rows and {NORM_SMEM_MAX} bytes, got {m} rows of K = {k}")
    if not isinstance(nw, Tensor) or nw.dtype != torch.bfloat16 or nw.shape != (k,):
        return (f"the norm weight must be a bfloat16 [K] = [{k}] tensor, got "
                f"{getattr(nw, 'dtype', type(nw).__name__)} {tuple(getattr(nw, 'shape', ()))}")
    if nw.device != x.device or not nw.is_contiguous() or nw.data_ptr() % 16:
        return "the norm weight must be contiguous, 16-byte aligned and on x's device"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        return f"eps must be a number >= 0, got {eps!r}"
    device = _device_index(x)
    if device is not None and not _stages(m, k, device):
        room = _smem_optin(device) - NORM_STATIC_SMEM
        return (f"the normed prologue's {m} rows of K = {k} need more shared memory than "
                f"this device gives a block ({room} bytes beside the kernel's own)")
    return None


def _device_index(x: Tensor) -> int | None:
    """x's CUDA device index (None: not on CUDA)."""
    return (x.device.index or 0) if x.is_cuda else None


def _stages(m: int, k: int, device: int | None = None) -> bool:
    """Whether m rows of K bf16 fit the shared memory a prologue stages them in (the normed
    one, variant 6's): the kernel's bound and, on CUDA `device`, what it gives a block."""
    need = m * (k + NORM_PAD) * 2
    return (m <= NORM_MAX_M and need <= NORM_SMEM_MAX
            and (device is None or need <= _smem_optin(device) - NORM_STATIC_SMEM))


# variant 7's e4m3 rows: K rounded up to 128 plus this many bytes each (csrc's kQuantPad),
# then 16 float32 scales per 128 of K
QUANT_PAD = 64


def _quant_bytes(m: int, k: int, norm: bool) -> int:
    """Shared memory of variant 7's prologue: the e4m3 rows, their scales, the normed rows."""
    kb = -(-k // FP8_BLOCK)
    return m * (kb * FP8_BLOCK + QUANT_PAD) + kb * 16 * 4 + (m * (k + NORM_PAD) * 2 if norm else 0)


def _quantises(m: int, k: int, norm: bool, device: int | None = None) -> bool:
    """Whether variant 7's prologue fits m rows of K (normed first or not): the kernel's bound
    and, on CUDA `device`, what it gives a block."""
    need = _quant_bytes(m, k, norm)
    return (m <= NORM_MAX_M and need <= NORM_SMEM_MAX
            and (device is None or need <= _smem_optin(device) - NORM_STATIC_SMEM))


def _quant_problem(m: int, k: int, norm: bool) -> str:
    return (f"variant {QUANT_VARIANT} quantises x's rows into shared memory: at most "
            f"{NORM_MAX_M} rows and {NORM_SMEM_MAX} bytes, got M = {m}, K = {k} "
            f"({_quant_bytes(m, k, norm)} bytes{' with the normed rows' if norm else ''})")


def _fp8_product(x: Tensor, w: Fp8Weight, variant: int) -> Tensor:
    """The kernel's reference product for FP8 weights in `variant`: W8A8 (x quantised per
    1 x 128 block) for variant 7, the dequantising weight-only one otherwise."""
    if variant == QUANT_VARIANT:
        from .fp8_triton import fp8_linear_w8a8_torch

        return fp8_linear_w8a8_torch(x, w)
    return fp8_linear_torch(x, w)


def _staging_problem(m: int, k: int) -> str:
    return (f"variant {STAGED_VARIANT} stages x's rows in shared memory: at most {NORM_MAX_M} "
            f"rows of M x (K + {NORM_PAD}) x 2 bytes <= {NORM_SMEM_MAX}, got M = {m}, K = {k}")


@functools.cache
def _smem_optin(index: int) -> int:
    """Shared memory one block may have on CUDA device `index` (opting in past 48 KB)."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))


def _glu_problem(x: Tensor, w13: object, splits: object, kwarps: object,
                 variant: object) -> str | None:
    """What keeps the SwiGLU epilogue from taking x [..., K] and w13 = [W1; W3] [2I, K] (bf16
    or an Fp8Weight), or None: the plain kernel's contract and an even row count; FP8: variant
    0, 4, 5 or 6, at most FP8_GLU_MAX_M rows and I a multiple of the 128-row scale block (a tile's 8 gate
    and 8 up rows each inside one block row of W1's and W3's scales)."""
    fp8 = isinstance(w13, Fp8Weight)
    wq = w13.q if fp8 else w13  # type: ignore[union-attr]
    problem = _problem(x, wq, splits, kwarps, fp8, variant)  # type: ignore[arg-type]
    if problem is not None:
        return problem
    if wq.shape[0] % 2:
        return f"[W1; W3] must have an even row count, got {wq.shape[0]}"
    if fp8 and variant not in BATCHED_VARIANTS:
        return (f"the SwiGLU epilogue of FP8 weights runs in variant 0, 4, 5, 6 or 7, got variant "
                f"{variant}")
    m = x.numel() // wq.shape[1]
    if fp8 and m > FP8_GLU_MAX_M:
        return (f"the SwiGLU epilogue of FP8 weights takes at most {FP8_GLU_MAX_M} rows, "
                f"got {m}")
    if fp8 and (wq.shape[0] // 2) % FP8_BLOCK:
        return (f"FP8 [W1; W3] needs I = {wq.shape[0] // 2} to be a multiple of {FP8_BLOCK} "
                "(W1's and W3's block scales apart)")
    return None


# ---------------------------------------------------------------------- wrappers
def supports(m: int, n: int, k: int, fp8: bool, variant: int = 0) -> bool:
    """Whether the built kernel takes an [m, k] x [n, k] linear (bf16 W, or FP8 W with `fp8`;
    the same shapes either way) in `variant` on the current CUDA device."""
    return (1 <= m <= MAX_M and n >= 1 and k >= K_MULTIPLE and k % K_MULTIPLE == 0
            and variant in VARIANTS and (fp8 or variant not in FP8_VARIANTS)
            and extension_available() and _device_ok(torch.cuda.current_device(), variant)
            and (variant != STAGED_VARIANT or _stages(m, k, torch.cuda.current_device()))
            and (variant != QUANT_VARIANT
                 or _quantises(m, k, False, torch.cuda.current_device())))


def gemv(x: Tensor, w: Tensor, *, splits: int = 0, kwarps: int = 0, variant: int = 0,
         kernel: bool = True, pdl: bool | int = False) -> Tensor:
    """x [..., K] bf16 @ w [N, K]^T bf16 -> [..., N] bf16 (float32 accumulation), at most 64
    rows. `splits`: K cut into this many ranges read by separate blocks (partial sums in
    float32, then summed), 0: automatic; `kwarps`: warps of a block sharing a row tile
    (1, 2, 4, 8; 0: automatic); `variant`: 0 or 1 (module docstring). None of them changes
    the result beyond float32 summation order; nor does `pdl` (launched with programmatic
    dependent launch on sm_90+, as the engine's step does; 2 and 3 are csrc/linear.cu's
    other PDL modes, for benchmarks). `kernel=False`, CPU tensors or
    no extension: `F.linear`."""
    problem = _problem(x, w, splits, kwarps, False, variant)
    if problem is not None:
        raise ValueError(f"gemv: {problem}")
    if _use_kernel(kernel, x, w, variant):
        return _run(x, w, None, splits, kwarps, variant, pdl=pdl)
    return F.linear(x, w)


def fp8_gemv(x: Tensor, w: Fp8Weight, *, splits: int = 0, kwarps: int = 0, variant: int = 0,
             kernel: bool = True, pdl: bool | int = False) -> Tensor:
    """x [..., K] bf16 @ W^T with W = w.q * w.scale (e4m3 [N, K], float32 scales per 128 x 128
    block) -> [..., N] bf16: weight-only FP8, the values converted in registers, each 128-wide
    K block's sum scaled in float32. `splits`, `kwarps`, `pdl`: as for `gemv`; `variant` 0..7 (module
    docstring: 0, 1, 4, 5 are exact like the reference's float32 product, 2 where the tensor
    cores keep subnormals, 3 rounds x to f16, 6 scales x's rows by powers of two into f16:
    exact unless a row spans 2^31; 7 is W8A8, x quantised to e4m3 per 1 x 128 block).
    `kernel=False`, CPU tensors or no extension: `engine.quant.fp8_linear_torch` (the
    dequantising reference; variant 7: `fp8_triton.fp8_linear_w8a8_torch`)."""
    w = _check_fp8(w)
    problem = _problem(x, w.q, splits, kwarps, True, variant)
    if problem is not None:
        raise ValueError(f"fp8_gemv: {problem}")
    if _use_kernel(kernel, x, w.q, variant):
        return _run(x, w.q, w.scale, splits, kwarps, variant, pdl=pdl)
    return _fp8_product(x, w, variant)


def swiglu_reference(x: Tensor, w13: Tensor | Fp8Weight, variant: int = 0) -> Tensor:
    """silu(x W1^T) * (x W3^T) for w13 = [W1; W3] [2I, K], unfused: the library linear (the
    dequantising reference for an Fp8Weight; variant 7's W8A8 one), then F.silu(gate) * up
    (what the kernel's epilogue reproduces)."""
    h = _fp8_product(x, w13, variant) if isinstance(w13, Fp8Weight) else F.linear(x, w13)
    i = w13.shape[0] // 2
    return F.silu(h[..., :i]) * h[..., i:]


def gemv_swiglu(x: Tensor, w13: Tensor | Fp8Weight, *, splits: int = 0, kwarps: int = 0,
                variant: int = 0, kernel: bool = True, pdl: bool | int = False) -> Tensor:
    """The FFN's gated input in one launch: x [..., K] bf16 and w13 = [W1; W3] [2I, K] bf16
    or an Fp8Weight (variant 0, 4, 5 or 6, at most 16 rows, I a multiple of 128) (the gate's rows,
    then the up projection's) -> silu(x W1^T) * (x W3^T) [..., I] bf16, at most 64 rows. The
    gate and up values are rounded to bf16 as `gemv` would return them, then combined as
    F.silu(gate) * up computes it in bf16. `splits`, `kwarps`, `variant`, `pdl`: as
    for `gemv` (same accumulation, so the same gate and up values as `gemv` with the same
    arguments). `kernel=False`, CPU tensors or no extension: `swiglu_reference`."""
    problem = _glu_problem(x, w13, splits, kwarps, variant)
    if problem is not None:
        raise ValueError(f"gemv_swiglu: {problem}")
    wq, scale = _operands(w13)
    if _use_kernel(kernel, x, wq, variant):
        return _run(x, wq, scale, splits, kwarps, variant, glu=True, pdl=pdl)
    return swiglu_reference(x, w13, variant)


def residual_reference(x: Tensor, w: Tensor, r: Tensor) -> Tensor:
    """r + x W^T as the unfused ops compute it: the linear rounded to bf16, then the add."""
    return r + F.linear(x, w)


def gemv_residual(x: Tensor, w: Tensor, r: Tensor, *, splits: int = 0, kwarps: int = 0,
                  variant: int = 0, kernel: bool = True, pdl: bool | int = False) -> Tensor:
    """r + x W^T in one launch (a residual block's projection and its add): x [..., K] and
    r [..., N] bf16, w [N, K] bf16. The product is rounded to bf16 as `gemv` returns it,
    then the sum, as `residual_reference`. `splits`, `kwarps`, `variant`, `pdl`: as for `gemv`.
    `kernel=False`, CPU tensors or no extension: `residual_reference`."""
    problem = _problem(x, w, splits, kwarps, False, variant) or _residual_problem(x, w, r)
    if problem is not None:
        raise ValueError(f"gemv_residual: {problem}")
    if _use_kernel(kernel, x, w, variant):
        return _run(x, w, None, splits, kwarps, variant, residual=r, pdl=pdl)
    return residual_reference(x, w, r)


def normed_reference(h: Tensor, nw: Tensor, eps: float, w: Tensor | Fp8Weight,
                     glu: bool = False, variant: int = 0) -> Tensor:
    """rms_norm(h) * nw, then the linear (the dequantising one for an Fp8Weight, variant 7's
    W8A8 one; glu: `swiglu_reference` of w = [W1; W3])."""
    x = functional.rms_norm(h, nw, eps)
    if glu:
        return swiglu_reference(x, w, variant)
    return _fp8_product(x, w, variant) if isinstance(w, Fp8Weight) else F.linear(x, w)


def _normed_problem(h: Tensor, w: Tensor | Fp8Weight, nw: object, eps: object, glu: bool,
                    splits: object, kwarps: object, variant: object) -> str | None:
    """What keeps the normed prologue from running rms_norm(h) * nw @ W^T (glu: its SwiGLU)
    with these launch parameters, or None."""
    wq, scale = _operands(w)
    if isinstance(variant, bool) or variant not in BATCHED_VARIANTS:
        return f"the normed prologue runs in variant 0, 4, 5, 6 or 7, got variant {variant!r}"
    problem = ((_glu_problem(h, w, splits, kwarps, variant) if glu
                else _problem(h, wq, splits, kwarps, scale is not None, variant))
               or _norm_problem(h, w, nw, eps))
    k = h.shape[-1]
    m = h.numel() // k if k else 0
    if problem is None and variant == QUANT_VARIANT \
            and not _quantises(m, k, True, _device_index(h)):
        return _quant_problem(m, k, True)
    return problem


def gemv_normed(h: Tensor, nw: Tensor, eps: float, w: Tensor | Fp8Weight, *, glu: bool = False,
                splits: int = 0, kwarps: int = 0, variant: int = 0, kernel: bool = True,
                pdl: bool | int = False) -> Tensor:
    """rms_norm(h) * nw @ W^T in one launch (the norm in the kernel's prologue, rounded as
    engine.functional.rms_norm rounds it; glu: the SwiGLU epilogue of w = [W1; W3]): h
    [..., K] bf16 with at most NORM_MAX_M rows, nw [K] bf16, w [N, K] bf16 or an Fp8Weight.
    Variant 0, 4 or 5, or 6 for FP8 weights (sm_89+: the rows in f16, module docstring);
    `pdl` as for `gemv`.
    `kernel=False`, CPU tensors or no extension: `normed_reference`."""
    problem = _normed_problem(h, w, nw, eps, glu, splits, kwarps, variant)
    if problem is not None:
        raise ValueError(f"gemv_normed: {problem}")
    wq, scale = _operands(w)
    if _use_kernel(kernel, h, wq, variant):
        return _run(h, wq, scale, splits, kwarps, variant, glu=glu, norm=(nw, float(eps)),
                    pdl=pdl)
    return normed_reference(h, nw, eps, w, glu, variant)


# ---------------------------------------------------------------------- the attention prologue
ATTN_HEAD_DIM = 128  # csrc/linear.cu's kAttnD: the head_dim it takes
ATTN_MAX_POS = 32  # kAttnMaxPos: cache positions per row (a lane scores one)
_ATTN_HEADS, _ATTN_KPAD = 4, 8  # kAttnHeads, kAttnKPad (shared memory layout)
# The rows up to which Ops folds the fast AR's attention into its output projection (where
# build_ops' attend_prologue asks for it): every block of the launch recomputes the rows'
# attention (a warp per row and kv head, its keys and values read from L2) before its main
# loop, so the prologue's cost grows with the rows.
ATTEND_DISPATCH_M = 2


def _attend_smem(m: int, k: int, s: int) -> int:
    """Shared memory bytes of the attention prologue: M x (K + pad) rows, 8 warps' scratch."""
    d = ATTN_HEAD_DIM
    return m * (k + NORM_PAD) * 2 + 8 * (s * (d + _ATTN_KPAD) + s * d + _ATTN_HEADS * d) * 2


def _attend_problem(qkv: Tensor, k_cache: object, v_cache: object, cs: object, pos: object,
                    k: int) -> str | None:
    """What keeps the attention prologue from taking this position (beyond the plain
    contract on q = qkv[..., :K]), or None: bf16 caches [B >= M, Hkv, S <= ATTN_MAX_POS,
    ATTN_HEAD_DIM] contiguous on qkv's device, K = H x head_dim with H a multiple of Hkv,
    qkv rows holding q, k and v, a contiguous bf16 cs [head_dim / 2, 2], 0 <= pos < S, at
    most NORM_MAX_M rows within the shared memory."""
    d = ATTN_HEAD_DIM
    if qkv.dtype != torch.bfloat16 or qkv.dim() < 1:
        return f"qkv must be a bfloat16 tensor [..., q + 2 kv], got {qkv.dtype} {tuple(qkv.shape)}"
    m = qkv.numel() // qkv.shape[-1] if qkv.shape[-1] else 0
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (not isinstance(c, Tensor) or c.dtype != torch.bfloat16 or c.dim() != 4
                or c.shape[-1] != d or not c.is_contiguous() or c.device != qkv.device
                or c.data_ptr() % 16):
            return (f"{name} must be a contiguous, 16-byte aligned bfloat16 [B, Hkv, S, {d}] "
                    f"tensor on qkv's device, got {getattr(c, 'dtype', type(c).__name__)} "
                    f"{tuple(getattr(c, 'shape', ()))}")
    assert isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor)
    if v_cache.shape != k_cache.shape:
        return f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
    b, hkv, s, _ = k_cache.shape
    if b < m:
        return f"the caches hold {b} rows, fewer than qkv's {m}"
    if not 1 <= s <= ATTN_MAX_POS:
        return f"the caches have {s} positions; the prologue takes 1..{ATTN_MAX_POS}"
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < s:
        return f"pos must be an int in 0..{s - 1}, got {pos!r}"
    if k % d or (k // d) % hkv:
        return f"K = {k} must be H x {d} with H a multiple of the caches' {hkv} kv heads"
    if qkv.shape[-1] < k + 2 * hkv * d:
        return f"qkv rows must hold q ({k}), k and v ({hkv * d} each), got {qkv.shape[-1]}"
    if (not isinstance(cs, Tensor) or cs.dtype != torch.bfloat16 or tuple(cs.shape) != (d // 2, 2)
            or not cs.is_contiguous() or cs.device != qkv.device or cs.data_ptr() % 8):
        return (f"cs must be a contiguous, 8-byte aligned bfloat16 [{d // 2}, 2] tensor on "
                f"qkv's device, got "
                f"{getattr(cs, 'dtype', type(cs).__name__)} {tuple(getattr(cs, 'shape', ()))}")
    if m > NORM_MAX_M or _attend_smem(m, k, s) > NORM_SMEM_MAX:
        return (f"the attention prologue holds the rows and its warps' keys in shared memory: "
                f"at most {NORM_MAX_M} rows and {NORM_SMEM_MAX} bytes, got {m} rows of K = {k}"
                f" with {s} positions")
    if qkv.is_cuda and _attend_smem(m, k, s) > _smem_optin(qkv.device.index or 0) - NORM_STATIC_SMEM:
        return f"the attention prologue's {m} rows need more shared memory than this device has"
    return None


def attend_reference(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cs: Tensor,
                     pos: int, n_head: int) -> Tensor:
    """One position's attention as the prologue computes it: rows m < M of qkv [M, q + 2 kv]
    are [q | k | v] at position `pos`; q and k rotated by cs [Dh/2, 2] (engine/functional.py's
    apply_rope), this position's rotated key and its value stored in row m of the caches
    [B, Hkv, S, Dh], then softmax(q k^T / sqrt(Dh)) v over positions 0..pos in float32,
    rounded once -> [M, n_head Dh] (query head h reads kv head h / (n_head / Hkv))."""
    m = qkv.shape[0]
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    qs, kvs = n_head * d, hkv * d
    rot = cs[None, None]  # [1, 1, Dh/2, 2]: one position for every row
    q = functional.apply_rope(qkv[:, :qs].reshape(m, 1, n_head, d), rot)[:, 0]
    k = functional.apply_rope(qkv[:, qs:qs + kvs].reshape(m, 1, hkv, d), rot)[:, 0]
    k_cache[:m, :, pos] = k
    v_cache[:m, :, pos] = qkv[:, qs + kvs:qs + 2 * kvs].reshape(m, hkv, d)
    rep = n_head // hkv
    keys = k_cache[:m, :, :pos + 1].float().repeat_interleave(rep, dim=1)  # [M, H, T, Dh]
    vals = v_cache[:m, :, :pos + 1].float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("mhd,mhtd->mht", q.float(), keys) / math.sqrt(d)
    out = torch.einsum("mht,mhtd->mhd", torch.softmax(scores, dim=-1), vals)
    return out.reshape(m, qs).to(qkv.dtype)


def _run_attend(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cs: Tensor, pos: int,
                wq: Tensor, scale: Tensor | None, r: Tensor | None, splits: int, kwarps: int,
                pdl: bool | int) -> Tensor:
    """csrc's attention prologue on contract-checked operands (`gemv_attend`'s checks):
    qkv [..., q + 2 kv] -> [r +] attend(qkv) W^T [..., N]."""
    n = wq.shape[0]
    m = qkv.numel() // qkv.shape[-1]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=qkv.device)
    if m:
        torch.ops.rtvoice_kernels.linear_small_m_attend(
            qkv.reshape(m, qkv.shape[-1]), k_cache, v_cache, cs, pos, wq, scale, out, splits,
            kwarps, None if r is None else r.reshape(m, n), int(pdl))
    return out.view(*qkv.shape[:-1], n)


def gemv_attend(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cs: Tensor, pos: int,
                w: Tensor | Fp8Weight, r: Tensor | None = None, *, splits: int = 0,
                kwarps: int = 0, kernel: bool = True, pdl: bool | int = False) -> Tensor:
    """[r +] attend(qkv) @ W^T in one launch: one position's attention (`attend_reference`,
    which also stores its key and value in the caches) as the prologue of the output
    projection W [N, K = n_head Dh] (bf16 or an Fp8Weight; variant 0), and the residual add
    in its epilogue. qkv [..., q + 2 kv] bf16 (every row at position `pos`), k_cache /
    v_cache [B, Hkv, S, Dh], cs [Dh/2, 2] -> [..., N]. `kernel=False`, CPU tensors or no
    extension: the reference, then the linear (rounded) and the add."""
    wq, scale = _operands(w)
    n, k = w.shape
    x = qkv[..., :k]  # q: the rows the linear multiplies, once attended
    problem = (_problem(x, wq, splits, kwarps, scale is not None, 0)
               or _attend_problem(qkv, k_cache, v_cache, cs, pos, k)
               or (None if r is None else _residual_problem(x, w, r)))
    if problem is not None:
        raise ValueError(f"gemv_attend: {problem}")
    if _use_kernel(kernel, x, wq, 0):
        return _run_attend(qkv, k_cache, v_cache, cs, pos, wq, scale, r, splits, kwarps, pdl)
    m = qkv.numel() // qkv.shape[-1]
    a = attend_reference(qkv.reshape(m, qkv.shape[-1]), k_cache, v_cache, cs, pos,
                         k // k_cache.shape[-1])
    y = (fp8_linear_torch(a, w) if isinstance(w, Fp8Weight) else F.linear(a, w))
    y = y.view(*qkv.shape[:-1], n)
    return y if r is None else r + y


# ---------------------------------------------------------------------- the per-shape plan
# a csrc candidate's label in a row's recorded timings (linear_bench)
_GEMV_LABEL = re.compile(r"gemv:v(\d+):k(\d+):s(\d+)$")
@dataclass(frozen=True, slots=True)
class PlanRow:
    """One measured shape: the fastest implementation of an [m, k] x [n, k] linear (`fp8`: FP8
    weights) and its parameters: "gemv" (the csrc kernel) with `splits`, `kwarps`, `variant`;
    "triton" (FP8: `fp8_linear_triton`; bf16: `dense_linear_triton`) / "triton_w8a8" (FP8)
    with `config` (fp8_triton.Config's fields; None: its table's) and split_k = `splits`;
    "rowwise_w8a8" (FP8: torch._scaled_mm on the weight's rowwise copy, x quantised per row); "library" (F.linear, FP8: the Triton kernel's
    defaults).
    A "triton_w8a8" row (activations quantised to e4m3: other numerics) sits beside the
    weight-only row of its shape and is taken only when asked. `us`: what each candidate took
    (microseconds)."""

    fp8: bool
    m: int
    n: int
    k: int
    impl: str
    splits: int = 1
    us: tuple[tuple[str, float], ...] = ()
    kwarps: int = 0
    variant: int = 0
    config: tuple[tuple[str, int | bool], ...] | None = None

    def gemv_candidates(self) -> list[tuple[float, int, int, int]]:
        """The recorded csrc candidates as (us, variant, kwarps, splits), from their labels
        ("gemv:v{variant}:k{kwarps}:s{splits}")."""
        out = []
        for label, us in self.us:
            hit = _GEMV_LABEL.match(label)
            if hit is not None:
                variant, kwarps, splits = (int(g) for g in hit.groups())
                if variant != QUANT_VARIANT:  # W8A8: never a weight-only row's candidate
                    out.append((us, variant, kwarps, splits))
        return out

    @property
    def best_us(self) -> float:
        """The chosen candidate's time: the fastest recorded (inf when none was)."""
        return min((t for _, t in self.us), default=math.inf)

    def triton_config(self):
        """The row's fp8_triton.Config (None: the Triton table's default)."""
        if self.config is None:
            return None
        from .fp8_triton import Config

        return Config.from_json(dict(self.config), w8a8=self.impl == W8A8, dense=not self.fp8)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {"fp8": self.fp8, "m": self.m, "n": self.n, "k": self.k,
                                "impl": self.impl, "splits": self.splits}
        if self.impl in ("gemv", GEMV_W8A8):
            d.update(kwarps=self.kwarps, variant=self.variant)
        if self.config is not None:
            d["config"] = dict(self.config)
        d["us"] = dict(self.us)
        return d


def _int_in(d: Mapping, key: str, default: int, allowed: Iterable[int], where: str) -> int:
    v = d.get(key, default)
    allowed = tuple(allowed)
    if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
        raise ValueError(f"{where}: {key} must be an int in {allowed[0]}..{allowed[-1]}"
                         f"{'' if len(allowed) == allowed[-1] - allowed[0] + 1 else ' ' + str(allowed)}"
                         f", got {v!r}")
    return v


def _row(d: object, where: str) -> PlanRow:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: a row must be an object, got {type(d).__name__}")
    missing = {"fp8", "m", "n", "k", "impl"} - set(d)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}")
    fp8, impl = d["fp8"], d["impl"]
    if not isinstance(fp8, bool):
        raise ValueError(f"{where}: fp8 must be true or false, got {fp8!r}")
    for key in ("m", "n", "k"):
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {key} must be an int >= 1, got {v!r}")
    if impl not in IMPLS or (impl in W8A8_IMPLS and not fp8):
        only = ", ".join(map(repr, W8A8_IMPLS))
        raise ValueError(f"{where}: impl must be one of {IMPLS} ({only} for FP8 rows only), "
                         f"got {impl!r}")
    splits = _int_in(d, "splits", 1, range(1, MAX_SPLITS + 1), where)
    kwarps = _int_in(d, "kwarps", 0, KWARPS, where)
    variant = _int_in(d, "variant", 0, VARIANTS, where)
    if impl == "gemv" and variant in FP8_VARIANTS and not fp8:
        raise ValueError(f"{where}: variant {variant} is for FP8 weights only")
    if (impl == "gemv") == (variant == QUANT_VARIANT) and impl in ("gemv", GEMV_W8A8):
        raise ValueError(f"{where}: variant {QUANT_VARIANT} quantises the activations (W8A8): "
                         f"a '{GEMV_W8A8}' row runs it, a 'gemv' row another variant; got "
                         f"{impl!r} with variant {variant}")
    if impl == "gemv" and variant == STAGED_VARIANT and not _stages(d["m"], d["k"]):
        raise ValueError(f"{where}: {_staging_problem(d['m'], d['k'])}")
    config = d.get("config")
    if config is not None:
        if impl not in ("triton", W8A8):
            raise ValueError(f"{where}: a config belongs to a Triton row, not {impl!r}")
        from .fp8_triton import Config

        try:
            Config.from_json(config, w8a8=impl == W8A8, dense=not fp8)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
        config = tuple(sorted(config.items()))
    us = d.get("us", {})
    if not isinstance(us, Mapping) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in us.values()):
        raise ValueError(f"{where}: us must map implementations to microseconds, got {us!r}")
    return PlanRow(fp8, d["m"], d["n"], d["k"], impl, splits,
                   tuple((str(name), float(t)) for name, t in us.items()), kwarps, variant,
                   config)


# At one row a K split's reduce launch bought nothing in the step: the H200 FP8 frame step at
# batch 1 took 4.099 ms with w2 (the only split row at M = 1) in one launch against 4.091 with
# its split-2 kernel and reduce (4.088-4.092 over three calls), 75 launches fewer; at two rows
# the split was worth 0.17 ms (4.347 against 4.174 ms), so only M = 1 rows take this
# (docs/PERF.md, gpu_s25_step_fp8.json).
ONE_ROW_SPLIT_MARGIN_US = 1.0


@functools.cache  # per plan row (frozen, hashable)
def _one_launch(row: PlanRow) -> PlanRow:
    """An M = 1 csrc row of FP8 weights with a K split (what was measured): its fastest
    recorded one-launch csrc candidate instead where that is within ONE_ROW_SPLIT_MARGIN_US
    of it; any other row as it is."""
    if row.m != 1 or row.impl != "gemv" or row.splits <= 1 or not row.fp8:
        return row
    best = min((c for c in row.gemv_candidates() if c[3] == 1), key=lambda c: c[0],
               default=None)
    if best is None or best[0] > row.best_us + ONE_ROW_SPLIT_MARGIN_US:
        return row
    _, variant, kwarps, _ = best
    return dataclasses.replace(row, variant=variant, kwarps=kwarps, splits=1)


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """Which implementation runs each linear shape, from a recorded table. `choose(m, n, k,
    fp8)` takes the row of the same (fp8, N, K) with the nearest recorded M at or above m
    (the table's M are buckets: a shape between them gets the next larger one's choice); any
    other shape is "library". With `fp8_activations`, an FP8 shape's W8A8 row of the same
    bucket replaces it where it was measured faster (past the table's largest M, its
    largest W8A8 row where that is the rowwise GEMM, which runs any M). An M = 1 row's K
    split gives way to a one-launch candidate within ONE_ROW_SPLIT_MARGIN_US of it."""

    rows: tuple[PlanRow, ...]
    # (fp8, n, k, w8a8 row) -> [(m, row)] sorted by m
    _index: dict[tuple[bool, int, int, bool], list[tuple[int, PlanRow]]] = field(
        init=False, repr=False, compare=False)
    # (m, n, k, fp8_activations) -> dense_faster's answer, filled as asked
    _dense: dict[tuple[int, int, int, bool], bool] = field(
        init=False, repr=False, compare=False, default_factory=dict)
    # (m, n, k, fp8, fp8_activations) -> choose's row, filled as asked
    _chosen: dict[tuple[int, int, int, bool, bool], PlanRow] = field(
        init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        index: dict[tuple[bool, int, int, bool], list[tuple[int, PlanRow]]] = {}
        seen = set()
        for r in self.rows:
            key = (r.fp8, r.m, r.n, r.k, r.impl in W8A8_IMPLS)
            if key in seen:
                raise ValueError(f"linear plan: two {'W8A8 ' if key[-1] else ''}rows for "
                                 f"fp8={r.fp8} m={r.m} n={r.n} k={r.k}")
            seen.add(key)
            index.setdefault((r.fp8, r.n, r.k, r.impl in W8A8_IMPLS), []).append((r.m, r))
        for v in index.values():
            v.sort(key=lambda e: e[0])
        object.__setattr__(self, "_index", index)

    @classmethod
    def from_rows(cls, rows: Iterable[object], where: str = "linear plan") -> LinearPlan:
        return cls(tuple(_row(d, f"{where}: row {i}") for i, d in enumerate(rows)))

    def _bucket(self, m: int, n: int, k: int, fp8: bool, w8a8: bool) -> PlanRow | None:
        entries = self._index.get((bool(fp8), n, k, w8a8))
        if entries:
            i = bisect.bisect_left([e[0] for e in entries], m)
            if i < len(entries):
                return entries[i][1]
        return None

    def choose(self, m: int, n: int, k: int, fp8: bool,
               fp8_activations: bool = False) -> PlanRow:
        """The row for an [m, k] x [n, k] linear: impl "library" (F.linear; for FP8 the
        Triton kernel if importable, else the dequantising reference), "gemv" (this module's
        kernel with the row's splits, kwarps, variant), "triton" (the Triton GEMM with the
        row's config and split_k: FP8's, or the dense one for bf16) or, only with
        `fp8_activations`, "triton_w8a8" / "rowwise_w8a8". A shape the table lacks gets a
        "library" row."""
        key = (m, n, k, bool(fp8), bool(fp8 and fp8_activations))
        hit = self._chosen.get(key)
        if hit is None:
            hit = self._chosen[key] = self._choose(m, n, k, fp8, fp8_activations)
        return hit

    def _choose(self, m: int, n: int, k: int, fp8: bool, fp8_activations: bool) -> PlanRow:
        row = self._bucket(m, n, k, fp8, False)
        if fp8 and fp8_activations:
            alt = self._bucket(m, n, k, fp8, True)
            top = self._index.get((True, n, k, True))
            if (row is None and alt is None and top and top[-1][1].impl == ROWWISE
                    and self.choose(top[-1][0], n, k, True, True) is top[-1][1]):
                alt = top[-1][1]  # past the table: the rowwise GEMM, where it won at the top
            if alt is not None and (row is None or (alt.m == row.m
                                                    and alt.best_us < row.best_us)):
                row = alt
        return _one_launch(row) if row is not None else PlanRow(bool(fp8), m, n, k, "library")

    def dense_faster(self, m: int, n: int, k: int, fp8_activations: bool = False) -> bool:
        """Whether the table measured this shape faster with bf16 weights than with FP8 ones
        at m rows' bucket (both rows recorded there, each with its fastest candidate's time;
        with `fp8_activations`, FP8's W8A8 row of that bucket too): an FP8 linear with a
        dequantised copy (`Fp8Weight.dense`) then runs on that. Past the table's largest M,
        its largest bucket decides (a dense GEMM's lead over the weight-only FP8 kernels only
        grows with M: they become compute-bound on bf16 MMAs too; the W8A8 kernels' e4m3
        MMAs do not, so record W8A8 rows at prefill's M for them to count there)."""
        key = (m, n, k, fp8_activations)
        hit = self._dense.get(key)
        if hit is None:
            f8, bf = self._index.get((True, n, k, False)), self._index.get((False, n, k, False))
            hit = False
            if f8 and bf:
                mm = min(m, f8[-1][0], bf[-1][0])
                a, b = self._bucket(mm, n, k, True, False), self._bucket(mm, n, k, False, False)
                if a is not None and b is not None and a.m == b.m and a.us and b.us:
                    fp8_us = a.best_us
                    alt = self._bucket(mm, n, k, True, True) if fp8_activations else None
                    if alt is not None and alt.m == a.m and alt.us:
                        fp8_us = min(fp8_us, alt.best_us)
                    hit = b.best_us < fp8_us
            self._dense[key] = hit
        return hit

    def dense_pays(self, n: int, k: int, fp8_activations: bool = False) -> bool:
        """Whether any recorded M of this shape runs faster on a dense copy (dense_faster)."""
        return any(self.dense_faster(m, n, k, fp8_activations)
                   for m, _ in self._index.get((True, n, k, False), ()))

    def rowwise_pays(self, n: int, k: int, dense: bool = True) -> bool:
        """Whether, with `fp8_activations`, some recorded M of this shape takes the
        rowwise-scaled W8A8 GEMM (its W8A8 row chose it and beat the weight-only row there,
        and the dense copy where the engine makes those: `dense`), which needs the weight's
        rowwise copy."""
        for m, row in self._index.get((True, n, k, True), ()):
            if (row.impl == ROWWISE and self.choose(m, n, k, True, True) is row
                    and not (dense and self.dense_faster(m, n, k, True))):
                return True
        return False

    def to_json(self) -> list[dict[str, object]]:
        return [r.to_json() for r in self.rows]


def load_plan(path: str | Path | None = DEFAULT_TABLE,
              device: str | None = CURRENT_DEVICE) -> LinearPlan | None:
    """The plan recorded at `path` (a JSON list of rows, or an object with a "rows" list and
    any other keys: device, bandwidths), or None if there is no such file. A malformed table
    raises ValueError naming the row. A table that records the GPU it was measured on
    ("device") is for that device kind only: when `device` (the current CUDA device's name
    by default; None: no check, as on a CPU) differs, it is ignored with a warning and None
    returned (its timings, and so its choices, do not carry over). The default path stands
    for the current device kind's table (`build.device_table`: the committed H200 table, or
    its sibling recorded on another kind); where that kind has none, None with a warning."""
    if path is None:
        return None
    p = Path(path)
    if p == DEFAULT_TABLE:
        p = device_table(p, device)
        if not p.is_file():
            log.warning("no linear table recorded on this GPU kind (%s is missing): every "
                        "linear takes the library path; record one with `python -m "
                        "bench_latency.linear_bench --out %s`", p.name, p)
            return None
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e})") from e
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{p}: expected a list of rows or an object with a 'rows' list")
    plan = LinearPlan.from_rows(rows, where=str(p))
    recorded = data.get("device") if isinstance(data, dict) else None
    if device == CURRENT_DEVICE:
        device = current_device_name()
    if recorded is not None and device is not None and recorded != device:
        log.warning("%s was recorded on %r, not this %r: ignored (every linear takes the "
                    "library path; record a table here with `python -m "
                    "bench_latency.linear_bench --out %s`)", p, recorded, device, p)
        return None
    return plan


def subnormal_case(n: int, k: int, m: int, seed: int,
                   device: str = "cuda") -> tuple[Fp8Weight, Tensor]:
    """An FP8 weight of subnormal e4m3 codes only (1..7, either sign) with block scales
    2^-8..2^7, and x [m, k] of magnitude ~2^-10: products the kernels' variants must keep
    exact (the subnormal probe of the bench and of the tests)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor([c for c in range(256) if 0 < c & 0x7F < 8], dtype=torch.uint8)
    q = codes[torch.randint(0, len(codes), (n, k), generator=g)]
    scale = 2.0 ** torch.randint(-8, 8, (-(-n // 128), -(-k // 128)), generator=g).float()
    w = Fp8Weight(q.view(torch.float8_e4m3fn).to(device), scale.to(device))
    x = (torch.randn(m, k, generator=g) * 2**-10).to(torch.bfloat16).to(device)
    return w, x


def _e4m3(values: Tensor) -> Tensor:
    return values.to(torch.float8_e4m3fn)


def _signs(g: torch.Generator, *shape: int) -> Tensor:
    """Random +-1 of `shape`."""
    return torch.randint(0, 2, shape, generator=g).float() * 2 - 1


def cancellation_case(m: int, n: int, k: int, seed: int,
                      device: str = "cuda") -> tuple[Fp8Weight, Tensor]:
    """Rows whose first 16 products (one MMA k-group) are +P, -P and 14 small full-mantissa
    ones (P from 2^10 to 2^30 over the rows, everything past k = 16 zero; scales 1): the
    output is the small sum as the tensor cores align it to P's exponent, so two variants
    whose MMAs align or truncate differently disagree visibly. k a multiple of 128."""
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(n, k)
    w[:, :2] = 1.0
    w[:, 2:16] = (1 + torch.randint(0, 8, (n, 14), generator=g) / 8) * _signs(g, n, 14)
    x = torch.zeros(m, k)
    p = 2.0 ** torch.linspace(10, 30, m).round()
    x[:, 0], x[:, 1] = p, -p
    x[:, 2:16] = (1 + torch.randint(0, 128, (m, 14), generator=g) / 128) * _signs(g, m, 14)
    scale = torch.ones(-(-n // 128), -(-k // 128))
    return (Fp8Weight(_e4m3(w).to(device), scale.to(device)),
            x.to(torch.bfloat16).to(device))


def small_binade_case(m: int, n: int, k: int, seed: int,
                      device: str = "cuda") -> tuple[Fp8Weight, Tensor]:
    """Rows led by 2^14 (a staged row scale of 1) with weight 0 on it, the rest of x in
    [2^-17, 2^-14) with full mantissas: f16 subnormals when staged (exact down to 2^-31 of
    the row's largest), so the output is their products' sum alone."""
    g = torch.Generator().manual_seed(seed)
    x = (2.0 ** -torch.randint(15, 18, (m, k), generator=g).float()
         * (1 + torch.randint(0, 128, (m, k), generator=g) / 128) * _signs(g, m, k))
    x[:, 0] = 2.0**14
    w = torch.randn(n, k, generator=g).clamp(-400, 400)
    w[:, 0] = 0.0
    scale = 2.0 ** torch.randint(-4, 4, (-(-n // 128), -(-k // 128)), generator=g).float()
    return (Fp8Weight(_e4m3(w).to(device), scale.to(device)),
            x.to(torch.bfloat16).to(device))


# ---------------------------------------------------------------------- the Ops.linear
@functools.cache
def _triton_module():
    """engine.kernels.fp8_triton where it imports and can run here (Triton and a CUDA device
    it supports: its `available()`), else None."""
    try:
        from . import fp8_triton

        ok = getattr(fp8_triton, "available", lambda: True)()
    except Exception:  # not there, or broken: the caller falls back
        return None
    return fp8_triton if ok else None


def _triton_here(x: Tensor):  # type: ignore[no-untyped-def]
    """`_triton_module()` for an x its GEMMs take (CUDA bf16 / fp16), else None."""
    return (_triton_module() if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            else None)


def triton_fp8() -> LinearFn | None:
    """engine.kernels.fp8_triton.fp8_linear_triton where it can run here, else None."""
    mod = _triton_module()
    return None if mod is None else mod.fp8_linear_triton


def _kernel_or(fallback: LinearFn, splits: int, kwarps: int = 0, variant: int = 0,
               pdl: bool | int = False) -> LinearFn:
    """The kernel where this call's x and W meet its layout contract (the shape was checked
    when the plan was consulted; strides and alignment can differ between calls), else
    `fallback`."""

    def run(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        wq, scale = _operands(w)
        if _problem(x, wq, splits, kwarps, scale is not None, variant) is None:
            return _run(x, wq, scale, splits, kwarps, variant, pdl=pdl)
        return fallback(x, w)

    return run


def _dense_or(mod, config, splits: int) -> LinearFn:  # type: ignore[no-untyped-def]
    """The Triton GEMM over a dense weight (`dense_linear_triton` with a bf16 row's config
    and split) where the call meets its contract (a contiguous, aligned weight of x's
    dtype: strides and alignment can differ between calls), else F.linear."""
    def run(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        try:  # the wrapper checks the contract once, before it launches anything
            return mod.dense_linear_triton(x, w, config=config, split_k=splits)
        except ValueError:
            return F.linear(x, w)

    return run


def rowwise_or(fallback: LinearFn, quantize: Callable[[Tensor], tuple[Tensor, Tensor]]
                ) -> LinearFn:
    """The rowwise-scaled W8A8 GEMM on a weight's rowwise copy (`fp8_rowwise_linear`, x
    quantised by `quantize`); `fallback` for a weight without one."""
    def run(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        if isinstance(w, Fp8Weight) and w.rowwise is not None:
            return fp8_rowwise_linear(x, *w.rowwise, quantize=quantize)
        return fallback(x, w)

    return run


def resolve(plan: LinearPlan | None, kernels: bool, m: int, n: int, k: int, fp8: bool,
            dtype: torch.dtype, cuda: bool, fp8_activations: bool = False,
            pdl: bool | int = False,
            quantize: Callable[[Tensor], tuple[Tensor, Tensor]] = quantize_rows) -> LinearFn:
    """The function that computes an [m, k] x [n, k] linear for x of `dtype` on CUDA or not
    (`make_linear` calls this once per shape and keeps it); `pdl`: csrc's kernel launched
    with programmatic dependent launch; `quantize`: the per-row activation quantisation of
    the rowwise W8A8 GEMM (its compiled version in the engine)."""
    row = (plan.choose(m, n, k, fp8, fp8_activations) if plan is not None
           else PlanRow(fp8, m, n, k, "library"))
    if row.impl == ROWWISE and fp8 and cuda and n % 16 == 0 and k % 16 == 0:
        # a weight without its rowwise copy takes the weight-only row's implementation
        return rowwise_or(resolve(plan, kernels, m, n, k, fp8, dtype, cuda, False, pdl),
                           quantize)
    triton_ok = cuda and dtype in (torch.bfloat16, torch.float16) and (
        fp8 or row.impl == "triton")
    mod = _triton_module() if triton_ok else None
    if not fp8 and row.impl == "triton":
        if mod is None or row.config is None:
            return F.linear
        return _dense_or(mod, row.triton_config(), row.splits)
    if fp8:
        tri = triton_fp8() if triton_ok else None
        library: LinearFn = tri if tri is not None else fp8_linear_torch  # type: ignore[assignment]
    else:
        library = F.linear
    if (row.impl == "gemv" and kernels and cuda and dtype == torch.bfloat16
            and supports(m, n, k, fp8, row.variant)):
        return _kernel_or(library, row.splits, row.kwarps, row.variant, pdl)
    if row.impl == GEMV_W8A8:
        # off the kernel (or its layout contract): the Triton W8A8 kernel (the same rounding
        # of x) where it runs, else the library path, as a "triton_w8a8" row falls back
        w8a8: LinearFn = mod.fp8_linear_triton_w8a8 if mod is not None else library
        if kernels and cuda and dtype == torch.bfloat16 and supports(m, n, k, True,
                                                                     QUANT_VARIANT):
            return _kernel_or(w8a8, row.splits, row.kwarps, QUANT_VARIANT, pdl)
        return w8a8
    if row.impl in ("triton", W8A8) and mod is not None:
        if row.config is None and row.impl == "triton":
            return library
        return functools.partial(_triton_fn(mod, row), config=row.triton_config(),
                                 split_k=row.splits)
    return library


def _triton_fn(mod, row: PlanRow) -> Callable[..., Tensor] | None:  # type: ignore[no-untyped-def]
    """The fp8_triton function a "triton" / "triton_w8a8" row runs (bf16 "triton": the dense
    GEMM), or None for another implementation."""
    if row.impl == "triton":
        return mod.fp8_linear_triton if row.fp8 else mod.dense_linear_triton
    if row.impl == W8A8 and row.fp8:
        return mod.fp8_linear_triton_w8a8
    return None


def _as_dense(plan: LinearPlan | None, w: Tensor | Fp8Weight, x: Tensor,
              fp8_activations: bool = False) -> Tensor | Fp8Weight:
    """W's dequantised copy where it has one in x's dtype and the plan (None: the ops take no
    copies) measured the dense path faster at x's rows (`LinearPlan.dense_faster`; with
    `fp8_activations`, faster than the W8A8 kernel too), else W itself: the same weight values
    either way (`Fp8Weight.dense` is exactly what `fp8_linear_torch` multiplies bf16 x by)."""
    k = w.shape[1]
    if _dense_taken(plan, w, x.numel() // k if k else 0, x.dtype, fp8_activations):
        return w.dense  # type: ignore[union-attr]
    return w


def _dense_taken(plan: LinearPlan | None, w: Tensor | Fp8Weight, m: int, dtype: torch.dtype,
                 fp8_activations: bool) -> bool:
    """Whether `_as_dense` takes W's dequantised copy for m rows of x in `dtype`."""
    if not (isinstance(w, Fp8Weight) and w.dense is not None and plan is not None
            and w.dense.dtype == dtype):
        return False
    n, k = w.shape
    return plan.dense_faster(m, n, k, fp8_activations)


def _rows(x: Tensor) -> int:
    """Rows of x [..., K] whatever K (0 for an empty last dim)."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def _w8a8_takes(plan: LinearPlan | None, x: Tensor, w: Tensor | Fp8Weight,
                fp8_activations: bool) -> bool:
    """Whether, with `fp8_activations`, the plan runs this FP8 linear as a W8A8 GEMM at x's
    rows (its W8A8 row won there): the csrc epilogues and prologues then decline the call,
    so that the linear runs it (with its add, norm or silu * mul as their own launches),
    unless it is csrc's variant 7 (`_w8a8_kernel_row`), which runs them in its launch."""
    if not (fp8_activations and plan is not None and isinstance(w, Fp8Weight)):
        return False
    n, k = w.shape
    impl = plan.choose(x.numel() // k if k else 0, n, k, True, True).impl
    return impl in (W8A8, GEMV_W8A8) or (impl == ROWWISE and w.rowwise is not None)


def _w8a8_kernel_row(plan: LinearPlan | None, kernels: bool, x: Tensor,
                     w: Tensor | Fp8Weight) -> PlanRow | None:
    """Where `_w8a8_takes` says the plan runs this FP8 linear as a W8A8 GEMM and that is
    csrc's variant 7 ("gemv_w8a8") on this x: its row, whose kernel also takes the
    epilogues and the normed prologue (so they run in its launch, not as their own);
    else None."""
    if not (kernels and plan is not None and isinstance(w, Fp8Weight) and x.is_cuda
            and x.dtype == torch.bfloat16):
        return None
    n, k = w.shape
    m = x.numel() // k if k else 0
    row = plan.choose(m, n, k, True, True)
    if row.impl != GEMV_W8A8 or not supports(m, n, k, True, QUANT_VARIANT):
        return None
    return row


def _gemv_row(plan: LinearPlan | None, kernels: bool, m: int, n: int, k: int, fp8: bool,
              dtype: torch.dtype, cuda: bool, slack_us: float = 0.0,
              variant_ok: Callable[[int], bool] = lambda variant: True) -> PlanRow | None:
    """The plan's row where it picked csrc's kernel (in a variant `variant_ok` takes) for
    this linear and the kernel can run it here; otherwise its fastest such recorded csrc
    candidate when that is within `slack_us` of the choice (as a "gemv" row); else None."""
    row = plan.choose(m, n, k, fp8) if plan is not None else None
    if row is None or not kernels or not cuda or dtype != torch.bfloat16:
        return None
    if row.impl == "gemv" and variant_ok(row.variant) and supports(m, n, k, fp8, row.variant):
        return row
    best = min((c for c in row.gemv_candidates()
                if variant_ok(c[1]) and supports(m, n, k, fp8, c[1])),
               key=lambda c: c[0], default=None)
    if best is None or best[0] > row.best_us + slack_us:
        return None
    _, variant, kwarps, splits = best
    return dataclasses.replace(row, impl="gemv", variant=variant, kwarps=kwarps, splits=splits,
                               config=None)


SwigluFn = Callable[[Tensor, Tensor | Fp8Weight], Tensor | None]


def _no_swiglu(x: Tensor, w13: Tensor | Fp8Weight) -> None:
    return None


# What the SwiGLU epilogue saves beside the linear itself: the separate silu * mul launch
# (H200: the packed w13 linear + compiled silu * mul 29.8 us vs the epilogue 28.7 at M = 1,
# linear_bench --swiglu; docs/PERF.md). A recorded csrc candidate that takes the epilogue is
# preferred to a faster one that does not by up to this much.
GLU_SAVES_US = 1.5


def _glu_row(plan: LinearPlan | None, kernels: bool, m: int, n: int, k: int, fp8: bool,
             dtype: torch.dtype, cuda: bool) -> PlanRow | None:
    """The plan row to run the packed [W1; W3] linear with its SwiGLU epilogue, or None: the
    chosen row where it is csrc's kernel in a variant with the epilogue (FP8: 0, 4, 5, 6),
    else the fastest recorded csrc candidate with it when that is within GLU_SAVES_US of the
    chosen implementation (which would need the silu * mul launch after it)."""
    if n % 2:
        return None
    return _gemv_row(plan, kernels, m, n, k, fp8, dtype, cuda, GLU_SAVES_US,
                     lambda variant: not fp8 or variant in BATCHED_VARIANTS)


def make_swiglu(plan: LinearPlan | None, kernels: bool,
                pdl: bool | int = False, dense: bool = False,
                fp8_activations: bool = False) -> SwigluFn:
    """`Ops.swiglu_kernel`: for x [..., K] and the packed [W1; W3], silu(x W1^T) * (x W3^T)
    from the csrc kernel's SwiGLU epilogue (`gemv_swiglu` with `_glu_row`'s splits, kwarps,
    variant: the plan's row, or its fastest recorded candidate with the epilogue where that
    costs less than the silu * mul launch it saves) where the call meets the contract; None
    otherwise (the library's shapes, misaligned x): the caller then runs the linear and its
    silu * mul. Chosen once per (M, N, K, FP8, x's dtype, CUDA or not), as `make_linear`
    does; `pdl` as there. With `fp8_activations` (as make_linear's) a call the plan runs as
    a W8A8 GEMM is declined (so are make_residual's, make_normed's and make_attend's) unless
    that GEMM is csrc's variant 7 (a "gemv_w8a8" row), whose launch takes the epilogue (and
    the normed prologue) too."""
    dense_plan = plan if dense else None  # FP8 weights' dense copies taken or not
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool], SwigluFn] = {}

    def resolve_glu(m: int, n: int, k: int, fp8: bool, dtype: torch.dtype,
                    cuda: bool) -> SwigluFn:
        row = _glu_row(plan, kernels, m, n, k, fp8, dtype, cuda)
        if row is None:
            return _no_swiglu
        splits, kwarps, variant = row.splits, row.kwarps, row.variant

        def run(x: Tensor, w13: Tensor | Fp8Weight) -> Tensor | None:
            if _glu_problem(x, w13, splits, kwarps, variant) is not None:
                return None
            wq, scale = _operands(w13)
            return _run(x, wq, scale, splits, kwarps, variant, glu=True, pdl=pdl)

        return run

    def swiglu(x: Tensor, w13: Tensor | Fp8Weight) -> Tensor | None:
        n, k = w13.shape
        w13 = _as_dense(dense_plan, w13, x, fp8_activations)
        if _w8a8_takes(plan, x, w13, fp8_activations):
            row = _w8a8_kernel_row(plan, kernels, x, w13)
            if row is None or _glu_problem(x, w13, row.splits, row.kwarps,
                                           QUANT_VARIANT) is not None:
                return None
            wq, scale = _operands(w13)
            return _run(x, wq, scale, row.splits, row.kwarps, QUANT_VARIANT, glu=True, pdl=pdl)
        key = (x.numel() // k if k else 0, n, k, isinstance(w13, Fp8Weight), x.dtype,
               x.is_cuda)
        fn = chosen.get(key)
        if fn is None:
            fn = chosen[key] = resolve_glu(*key)
        return fn(x, w13)

    return swiglu


def _row_lookup(plan: LinearPlan | None, kernels: bool,
                slack_us: float = 0.0) -> Callable[[Tensor, Tensor | Fp8Weight], PlanRow | None]:
    """x, W -> `_gemv_row` for x @ W^T, chosen once per (M, N, K, FP8, x's dtype, CUDA or
    not) and kept in a dict (a call costs one lookup)."""
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool], PlanRow | None] = {}

    def row_for(x: Tensor, w: Tensor | Fp8Weight) -> PlanRow | None:
        n, k = w.shape
        key = (x.numel() // k if k else 0, n, k, isinstance(w, Fp8Weight), x.dtype, x.is_cuda)
        if key not in chosen:
            chosen[key] = _gemv_row(plan, kernels, *key, slack_us=slack_us)
        return chosen[key]

    return row_for


ResidualFn = Callable[[Tensor, Tensor | Fp8Weight, Tensor], Tensor | None]

# The residual epilogue saves the add's launch (with the norm after it, one add_rms_norm; and
# the next projection's normed prologue only reads a pending norm): a csrc candidate within
# this much of a plan row that chose cuBLAS or Triton runs instead, with the epilogue.
RESIDUAL_SLACK_US = 1.0


def make_residual(plan: LinearPlan | None, kernels: bool,
                  pdl: bool | int = False, dense: bool = False,
                  fp8_activations: bool = False) -> ResidualFn:
    """`Ops.residual_kernel`: (y, W, r) -> r + y W^T from csrc's residual epilogue where the
    plan picked the kernel for that linear (dense or FP8 W) and the call meets the contract;
    None otherwise (the caller runs the linear, then the add). Where the plan chose another
    implementation by less than RESIDUAL_SLACK_US, the fastest recorded csrc candidate runs
    with the epilogue instead. Chosen once per shape; `pdl` as for `make_linear`."""
    dense_plan = plan if dense else None  # FP8 weights' dense copies taken or not
    row_for = _row_lookup(plan, kernels, RESIDUAL_SLACK_US)
    triton_for = _triton_lookup(plan, fp8_activations)

    def residual(y: Tensor, w: Tensor | Fp8Weight, r: Tensor) -> Tensor | None:
        w = _as_dense(dense_plan, w, y, fp8_activations)
        if _w8a8_takes(plan, y, w, fp8_activations):
            row = _w8a8_kernel_row(plan, kernels, y, w)
        else:
            row = row_for(y, w)
        if row is None:  # a Triton GEMM's row: its residual epilogue, where it takes it
            return _triton_residual(triton_for(y, w), y, w, r)
        wq, scale = _operands(w)
        if (_problem(y, wq, row.splits, row.kwarps, scale is not None, row.variant)
                or _residual_problem(y, w, r)) is not None:
            return None
        return _run(y, wq, scale, row.splits, row.kwarps, row.variant, residual=r, pdl=pdl)

    return residual


TritonCall = tuple[Callable[..., Tensor], object, int]  # (function, its Config, its split)


def _triton_lookup(plan: LinearPlan | None, fp8_activations: bool
                   ) -> Callable[[Tensor, Tensor | Fp8Weight], TritonCall | None]:
    """x, W -> the Triton GEMM the plan runs this linear as at x's rows, with the row's
    config and split (bf16 "triton": `dense_linear_triton`; FP8 "triton":
    `fp8_linear_triton`; with `fp8_activations` a "triton_w8a8" row:
    `fp8_linear_triton_w8a8`), or None (another implementation, no recorded config, not a
    CUDA bf16 / fp16 x, no Triton). Chosen once per (M, N, K, FP8, x's dtype, CUDA)."""
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool], TritonCall | None] = {}

    def lookup(x: Tensor, w: Tensor | Fp8Weight) -> TritonCall | None:
        n, k = w.shape
        fp8 = isinstance(w, Fp8Weight)
        key = (x.numel() // k if k else 0, n, k, fp8, x.dtype, x.is_cuda)
        if key not in chosen:
            chosen[key] = None
            mod = _triton_here(x) if plan is not None else None
            if mod is not None:
                row = plan.choose(key[0], n, k, fp8, fp8_activations)
                fn = _triton_fn(mod, row)
                if fn is not None and row.config is not None:
                    chosen[key] = (fn, row.triton_config(), row.splits)
        return chosen[key]

    return lookup


def _triton_residual(call: TritonCall | None, y: Tensor, w: Tensor | Fp8Weight,
                     r: Tensor) -> Tensor | None:
    """r + y W^T from the Triton GEMM's residual epilogue where `call` is the linear's Triton
    GEMM and y, W and r meet its contract (checked per call: strides and alignment can
    differ between calls), else None."""
    if call is None or _residual_problem(y, w, r) is not None:
        return None
    fn, config, splits = call
    try:
        return fn(y, w, config=config, split_k=splits, residual=r)
    except ValueError:  # this call's x, W or r break the kernel's layout contract
        return None


PrequantFn = Callable[[Tensor, Tensor | Fp8Weight],
                      Callable[..., Tensor] | None]


def make_prequant(plan: LinearPlan | None, fp8_activations: bool = False,
                  dense: bool = False) -> PrequantFn:
    """`Ops.prequant`: (x, W) -> the GEMM to run x W^T on activations quantised by the op
    that makes them (`fp8_triton.fp8_linear_triton_prequant` with the row's config and
    split: call it as fn(QuantAct, W, residual=None)), where the plan runs this FP8 linear
    at x's rows as the Triton W8A8 GEMM in a prequantised config (its measured winner
    quantises x in a launch of its own: the norm or the gate before it can do that in
    theirs, `engine.kernels.act_quant`); None elsewhere (no `fp8_activations`, a dense
    weight or its dense copy taken, another implementation, not CUDA bf16 / fp16, no
    Triton). Chosen once per (M, N, K, x's dtype, CUDA), as `make_linear` does."""
    dense_plan = plan if dense else None
    chosen: dict[tuple[int, int, int, torch.dtype, bool], Callable[..., Tensor] | None] = {}

    def prequant(x: Tensor, w: Tensor | Fp8Weight) -> Callable[..., Tensor] | None:
        if not fp8_activations or plan is None or not isinstance(w, Fp8Weight):
            return None
        n, k = w.shape
        m = _rows(x)  # x: any tensor of the rows (its last dim need not be K)
        if _dense_taken(dense_plan, w, m, x.dtype, True):
            return None  # its dense copy is faster here
        key = (m, n, k, x.dtype, x.is_cuda)
        if key not in chosen:
            chosen[key] = None
            mod = _triton_here(x)
            row = plan.choose(key[0], n, k, True, True)
            if mod is not None and row.impl == W8A8 and row.config is not None:
                cfg = row.triton_config()
                if cfg.prequant:
                    chosen[key] = functools.partial(mod.fp8_linear_triton_prequant,
                                                    config=cfg, split_k=row.splits)
        return chosen[key]

    return prequant


GluFn = Callable[[Tensor, Tensor | Fp8Weight], Callable[..., object] | None]


def make_glu(plan: LinearPlan | None, fp8_activations: bool = False,
             dense: bool = False) -> GluFn:
    """`Ops.glu_quant`: (x, w13) -> the packed [W1; W3]'s W8A8 GEMM with silu * mul and the
    quantisation of its output in the epilogue (`act_quant.glu_w8a8_quant` with the row's
    config: call it as fn(QuantAct, w13) -> QuantAct) where `make_prequant` runs w13 at x's
    rows (x: any tensor of those rows; decode's at most MAX_M, the rows `linear_bench
    --glu` times) unsplit in a config with 128-wide N and K tiles and N is a multiple of
    256; None elsewhere. Ops takes it only where w2 also reads prequantised rows there."""
    prequant = make_prequant(plan, fp8_activations, dense)
    chosen: dict[tuple[int, int, int, torch.dtype, bool], Callable[..., object] | None] = {}

    def glu(x: Tensor, w13: Tensor | Fp8Weight) -> Callable[..., object] | None:
        m = _rows(x)
        gemm = prequant(x, w13) if 0 < m <= MAX_M else None
        if gemm is None or not isinstance(gemm, functools.partial):
            return None
        n, k = w13.shape
        key = (m, n, k, x.dtype, x.is_cuda)
        if key not in chosen:
            cfg, split = gemm.keywords["config"], gemm.keywords["split_k"]
            ok = (n % (2 * FP8_BLOCK) == 0 and split == 1 and cfg.block_n == FP8_BLOCK
                  and cfg.block_k == FP8_BLOCK)
            chosen[key] = (functools.partial(act_quant.glu_w8a8_quant, config=cfg) if ok
                           else None)
        return chosen[key]

    return glu


NormedFn = Callable[[Tensor, Tensor, float, Tensor | Fp8Weight, bool], Tensor | None]


# Every block of the normed prologue normalises all of x's rows itself, and a launch has
# tiles x kwarps / 8 blocks: the plan's kwarps, timed without the prologue, can cost it more
# than they gain (H200 bf16 step at batch 1: the 152 normed launches of wqkv and the packed
# w13 averaged 23.5 us with a table's kwarps 8 for both, 20.5 us with 4 and 1, where the
# plain kernels' timings were within 0.6 us of each other). The prologue runs with the fewest
# warps per tile among the row's variant-0 (and 4, 5) candidates within this much of its
# fastest; and where the row chose another implementation (cuBLAS, variant 1) by less than
# this, the prologue still runs on such a candidate: it saves the norm's launch (a re-recorded
# H200 table chose cuBLAS for bf16 wqkv at M = 1 by 0.02 us, which cost the batch-1 step its
# 76 normed prologues: 568 -> 644 launches, 6.07 -> 6.49 ms).
NORMED_SLACK_US = 1.0


@functools.cache  # per plan row (frozen, hashable): a call costs one lookup
def _normed_params(row: PlanRow,
                   variants: tuple[int, ...] = BATCHED_VARIANTS) -> tuple[int, int, int] | None:
    """(splits, kwarps, variant) for a prologue on `row`'s shape, or None: the recorded csrc
    candidates in `variants` (the register-batch ones that have the prologue) within
    NORMED_SLACK_US of the row's fastest time (the row's own choice when that is one) with
    the fewest warps per tile (fewer blocks, each normalising the rows), the fastest of
    those; None when no such candidate is that close."""
    near = [(kw, us, sp, v) for us, v, kw, sp in row.gemv_candidates()
            if v in variants and kw > 0 and us <= row.best_us + NORMED_SLACK_US]
    if row.impl == "gemv" and row.variant in variants:
        near.append((row.kwarps, row.best_us, row.splits, row.variant))
    if not near:
        return None
    kwarps, _, splits, variant = min(near)
    return splits, kwarps, variant


PrologueLookup = Callable[[Tensor, int, int, bool], tuple[int, int, int] | None]


def _prologue_lookup(plan: LinearPlan | None, kernels: bool,
                     variants: tuple[int, ...] = BATCHED_VARIANTS) -> PrologueLookup:
    """(x, N, K, FP8 W) -> `_normed_params` of the plan's row for x's M rows (among
    `variants`), or None where csrc's kernel cannot take it here (no plan, kernels off, not
    CUDA bf16, unsupported shape): a prologue's launch parameters, chosen once per shape and
    kept in a dict."""
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool],
                 tuple[int, int, int] | None] = {}

    def lookup(x: Tensor, n: int, k: int, fp8: bool) -> tuple[int, int, int] | None:
        m = x.numel() // k if k else 0
        key = (m, n, k, fp8, x.dtype, x.is_cuda)
        if key not in chosen:
            params = (_normed_params(plan.choose(m, n, k, fp8), variants)
                      if (plan is not None and kernels and x.is_cuda
                          and x.dtype == torch.bfloat16) else None)
            chosen[key] = params if params and supports(m, n, k, fp8, params[2]) else None
        return chosen[key]

    return lookup


def make_normed(plan: LinearPlan | None, kernels: bool, max_m: int = NORMED_DISPATCH_M,
                max_m_fp8: int = NORMED_DISPATCH_M_FP8, pdl: bool | int = False,
                dense: bool = False, fp8_activations: bool = False) -> NormedFn:
    """`Ops.normed_kernel`: (h, nw, eps, W, glu) -> rms_norm(h) * nw @ W^T (glu: the SwiGLU
    of W = [W1; W3]) from csrc's normed prologue where h has at most `max_m` rows
    (`max_m_fp8` for FP8 W; where it measured faster than the norm's own launch), the plan
    recorded a variant-0, 4, 5 or 6 kernel candidate for that linear (bf16 or FP8 W) within
    NORMED_SLACK_US of its choice and the call meets the contract (with `_normed_params`'
    splits, kwarps and variant); None otherwise (the caller computes the norm first). Chosen once per
    shape; `pdl` as for `make_linear`."""
    dense_plan = plan if dense else None  # FP8 weights' dense copies taken or not
    lookup = _prologue_lookup(plan, kernels)

    def normed(h: Tensor, nw: Tensor, eps: float, w: Tensor | Fp8Weight,
               glu: bool) -> Tensor | None:
        w = _as_dense(dense_plan, w, h, fp8_activations)
        fp8 = isinstance(w, Fp8Weight)
        n, k = w.shape
        if h.numel() > (max_m_fp8 if fp8 else max_m) * k:
            return None
        if _w8a8_takes(plan, h, w, fp8_activations):
            row = _w8a8_kernel_row(plan, kernels, h, w)  # variant 7 norms, then quantises
            chosen = None if row is None else (row.splits, row.kwarps, QUANT_VARIANT)
        else:
            chosen = lookup(h, n, k, fp8)
        if chosen is None:
            return None
        splits, kwarps, variant = chosen
        if _normed_problem(h, w, nw, eps, glu, splits, kwarps, variant) is not None:
            return None
        wq, scale = _operands(w)
        return _run(h, wq, scale, splits, kwarps, variant, glu=glu, norm=(nw, float(eps)),
                    pdl=pdl)

    return normed


AttendFn = Callable[..., Tensor | None]


def make_attend(plan: LinearPlan | None, kernels: bool, max_m: int = ATTEND_DISPATCH_M,
                pdl: bool | int = False, dense: bool = False,
                fp8_activations: bool = False) -> AttendFn:
    """`Ops.attend_kernel`: (qkv, k_cache, v_cache, cs, pos, W, r) -> r + attend(qkv) W^T
    from csrc's attention prologue (`gemv_attend`) where qkv has at most `max_m` rows, the
    plan recorded a variant-0 csrc candidate for that linear within NORMED_SLACK_US of its
    choice (the prologue's splits and kwarps as the normed one's: `_normed_params`) and the
    call meets the contract; None otherwise (the caller runs the attention, then the
    projection). Chosen once per shape; `pdl` as for `make_linear`."""
    dense_plan = plan if dense else None  # FP8 weights' dense copies taken or not
    lookup = _prologue_lookup(plan, kernels, (0,))  # the attention prologue: variant 0 only

    def attend(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cs: Tensor, pos: int,
               w: Tensor | Fp8Weight, r: Tensor) -> Tensor | None:
        n, k = w.shape
        x = qkv[..., :k]
        if x.numel() > max_m * k:
            return None
        w = _as_dense(dense_plan, w, x, fp8_activations)
        if _w8a8_takes(plan, x, w, fp8_activations):
            return None
        fp8 = isinstance(w, Fp8Weight)
        chosen = lookup(x, n, k, fp8)
        if chosen is None:
            return None
        splits, kwarps, _ = chosen
        wq, scale = _operands(w)
        if (_problem(x, wq, splits, kwarps, fp8, 0)
                or _attend_problem(qkv, k_cache, v_cache, cs, pos, k)
                or _residual_problem(x, w, r)) is not None:
            return None
        return _run_attend(qkv, k_cache, v_cache, cs, pos, wq, scale, r, splits, kwarps, pdl)

    return attend


def make_linear(plan: LinearPlan | None, kernels: bool,
                fp8_activations: bool = False, pdl: bool | int = False,
                dense: bool = False,
                quantize: Callable[[Tensor], tuple[Tensor, Tensor]] = quantize_rows) -> LinearFn:
    """`Ops.linear`: x [..., K] @ W^T for a dense weight (F.linear, or `gemv` where the plan
    picked it) or an `Fp8Weight` (`fp8_gemv` where the plan picked it, the Triton FP8 kernel
    with the plan's config where it picked that, else with its defaults if importable, else
    the dequantising reference). `kernels=False` never runs the csrc kernel (the Triton
    kernel is FP8's library path and stays). `fp8_activations`: FP8 shapes may take the W8A8
    Triton kernel (activations quantised to e4m3 per 1 x 128 block: not the weight-only
    numerics) or the rowwise-scaled W8A8 GEMM on the weight's rowwise copy (x quantised per
    row by `quantize`; `Fp8Weight.rowwise`, fusion.add_rowwise_copies) where the plan
    measured it faster; off by default. With `dense`, an
    `Fp8Weight` with a dequantised copy in x's dtype (`Fp8Weight.dense`,
    fusion.add_dense_copies) runs on that, as a bf16 weight, at the M where the plan
    measured bf16 faster than FP8 (`LinearPlan.dense_faster`; compared with the weight-only
    FP8 row, and with `fp8_activations` its W8A8 row too); so do make_swiglu's,
    make_residual's and make_normed's with `dense`. Without a plan every shape
    takes the library path. The choice is made once per (M, N, K, FP8, x's dtype, CUDA or
    not) and kept in a dict, so a call costs one lookup (eager prefill runs this per layer; a
    CUDA graph captures it once per shape). `pdl`: csrc's kernel launched with programmatic
    dependent launch (sm_90+; csrc/launch.cuh), where each linear's first weight loads
    overlap the end of the kernel before it."""
    dense_plan = plan if dense else None  # FP8 weights' dense copies taken or not
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool], LinearFn] = {}

    def linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        n, k = w.shape
        w = _as_dense(dense_plan, w, x, fp8_activations)
        fp8 = isinstance(w, Fp8Weight)
        key = (x.numel() // k if k else 0, n, k, fp8, x.dtype, x.is_cuda)
        fn = chosen.get(key)
        if fn is None:
            fn = chosen[key] = resolve(plan, kernels, *key, fp8_activations=fp8_activations,
                                       pdl=pdl, quantize=quantize)
        return fn(x, w)

    return linear
