"""Activations quantised for the W8A8 GEMM in the launch that makes them (Triton).

With `fp8_activations`, a linear the recorded table runs as the prequantised W8A8 GEMM
(`fp8_triton.fp8_linear_triton_prequant`) reads e4m3 rows with one float32 scale per
1 x 128 block. Quantising them in a launch of their own (`fp8_triton.quantize_act`) costs
a launch and a round trip of the bf16 rows per linear; the two ops that make the inputs
of most of a block's linears do it in their own launch instead:

- `rms_norm_quant(h, weight, eps)`: rms_norm(h) * weight (a block's attention_norm before
  wqkv, its ffn_norm before w13), then quantised;
- `silu_mul_quant(a, b)`: silu(a) * b (the FFN's gate before w2), then quantised.

Each rounds as the unfused ops do (the norm in float32, rounded to h's dtype, times the
weight, rounded again: `engine.functional.rms_norm`; silu rounded, then the product:
`F.silu(a) * b`), then quantises each 1 x 128 block exactly as `quantize_act` does (amax /
448 and the values divided by it with true divisions, saturated, rounded to nearest even).
The torch references are those ops followed by `fp8_triton.quantize_act_torch`; off CUDA,
without Triton, or with `kernel=False` the functions run them. The kernels' only
differences from them are float32's: the norm's sum of squares in another order and the
hardware rsqrt / exp (every division a true one, as torch's), which can move a bf16 rounding (and so, rarely, a block's scale or
an e4m3 code) by one step.

Grid: one program per (row, 128-wide block); the norm's program reads its whole row for the
sum of squares (a row of K <= 16384 elements from L2), so the rows' blocks run in parallel
rather than one program walking a row.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional
from ..quant import BLOCK, scale_shape
from . import fp8_triton
from .fp8_triton import QuantAct

MAX_K = 16384  # the norm kernel holds a row in registers: S2-Pro's dim is 2560


def rms_norm_quant_torch(h: Tensor, weight: Tensor, eps: float) -> QuantAct:
    """The reference: `functional.rms_norm`, then `quantize_act_torch`."""
    y = functional.rms_norm(h, weight, eps)
    return _quantised(y)


def silu_mul_quant_torch(a: Tensor, b: Tensor) -> QuantAct:
    """The reference: F.silu(a) * b, then `quantize_act_torch`."""
    return _quantised(F.silu(a) * b)


def _quantised(y: Tensor) -> QuantAct:
    k = y.shape[-1]
    q, s = fp8_triton.quantize_act_torch(y.reshape(-1, k))
    return QuantAct(q.contiguous().view(*y.shape), s.view(*y.shape[:-1], s.shape[-1]),
                    y.dtype)


def _check_rows(name: str, t: Tensor) -> None:
    if t.dtype not in fp8_triton.ACT_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
    if t.dim() < 1 or t.shape[-1] == 0:
        raise ValueError(f"{name} must be [..., K] with K > 0, got {list(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous (strides {t.stride()})")


def _rows(t: Tensor) -> Tensor:
    """t [..., K] as [M, K] with rows a fixed stride apart (a view where the strides allow)."""
    k = t.shape[-1]
    return t.reshape(-1, k)


def _runs_here(t: Tensor, kernel: bool) -> bool:
    return kernel and t.is_cuda and fp8_triton.available()


def rms_norm_quant(h: Tensor, weight: Tensor, eps: float, *, kernel: bool = True) -> QuantAct:
    """rms_norm(h) * weight quantised per 1 x 128 block: h [..., K] (bf16 / fp16, last dim
    contiguous, rows may be strided), weight [K] of h's dtype -> `QuantAct` of h's shape."""
    _check_rows("h", h)
    k = h.shape[-1]
    if tuple(weight.shape) != (k,) or weight.dtype != h.dtype or weight.device != h.device:
        raise ValueError(f"the norm weight must be [{k}] {h.dtype} on {h.device}, got "
                         f"{list(weight.shape)} {weight.dtype} on {weight.device}")
    if k > MAX_K:
        raise ValueError(f"rms_norm_quant holds a row in registers: K = {k} > {MAX_K}")
    if not _runs_here(h, kernel):
        return rms_norm_quant_torch(h, weight, eps)
    with torch.cuda.device(h.device):
        q, s = _launch_norm(_rows(h), weight.contiguous(), eps)
    return QuantAct(q.view(*h.shape), s.view(*h.shape[:-1], s.shape[-1]), h.dtype)


def _launch_norm(h2: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The norm kernel over h2 [M, K] (rows strided; checked) -> (e4m3 [M, K], scales)."""
    import triton

    m, k = h2.shape
    kb = scale_shape(1, k)[1]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=h2.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=h2.device)
    if m:
        _kernels()[0][(m, kb)](h2, weight, q, s, k, h2.stride(0), kb, float(eps),
                               ROW=triton.next_power_of_2(k), BLOCK=BLOCK, num_warps=4)
    return q, s


def silu_mul_quant(a: Tensor, b: Tensor, *, kernel: bool = True) -> QuantAct:
    """silu(a) * b quantised per 1 x 128 block: a, b [..., K] of one shape and dtype (bf16 /
    fp16, last dims contiguous, rows may be strided: e.g. the two halves of the packed FFN
    projection) -> `QuantAct` of that shape."""
    _check_rows("a", a)
    _check_rows("b", b)
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must match: {list(a.shape)} {a.dtype} {a.device} vs "
                         f"{list(b.shape)} {b.dtype} {b.device}")
    if not _runs_here(a, kernel):
        return silu_mul_quant_torch(a, b)
    with torch.cuda.device(a.device):
        q, s = _launch_glu(_rows(a), _rows(b))
    return QuantAct(q.view(*a.shape), s.view(*a.shape[:-1], s.shape[-1]), a.dtype)


def _launch_glu(a2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor]:
    """The gate kernel over a2, b2 [M, K] (rows strided; checked) -> (e4m3 [M, K], scales)."""
    m, k = a2.shape
    kb = scale_shape(1, k)[1]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=a2.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=a2.device)
    if m:
        _kernels()[1][(m, kb)](a2, b2, q, s, k, a2.stride(0), b2.stride(0), kb, BLOCK=BLOCK,
                               num_warps=1)
    return q, s


@functools.cache
def _kernels():
    """Compile-on-first-use Triton kernels (triton imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def norm_quant(h_ptr, w_ptr, q_ptr, s_ptr, K, stride_hm, kb, eps,
                   ROW: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0)
        b = tl.program_id(1)
        row = tl.arange(0, ROW)
        hf = tl.load(h_ptr + m * stride_hm + row, mask=row < K, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.math.div_rn(tl.sum(hf * hf, axis=0), K.to(tl.float32)) + eps)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        ok = cols < K
        x = tl.load(h_ptr + m * stride_hm + cols, mask=ok, other=0.0)
        wv = tl.load(w_ptr + cols, mask=ok, other=0.0)
        # rms_norm's roundings: normalised in float32, to h's dtype, times the weight
        n = (x.to(tl.float32) * r).to(x.dtype)
        y = (n.to(tl.float32) * wv.to(tl.float32)).to(x.dtype).to(tl.float32)
        # this block quantised as fp8_triton's quant_rows does it: amax / 448, true
        # divisions, saturated, rounded to e4m3
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30), 448.0)
        qv = tl.clamp(tl.math.div_rn(y, a_s), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + m * K + cols, qv, mask=ok)
        tl.store(s_ptr + m * kb + b, a_s)

    @triton.jit
    def glu_quant(a_ptr, b_ptr, q_ptr, s_ptr, K, stride_am, stride_bm, kb,
                  BLOCK: tl.constexpr):
        m = tl.program_id(0)
        b = tl.program_id(1)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        ok = cols < K
        av = tl.load(a_ptr + m * stride_am + cols, mask=ok, other=0.0)
        bv = tl.load(b_ptr + m * stride_bm + cols, mask=ok, other=0.0)
        af = av.to(tl.float32)
        # F.silu(a) * b's roundings: silu in float32, to a's dtype, times b
        g = tl.math.div_rn(af, 1.0 + tl.exp(-af)).to(av.dtype)
        y = (g.to(tl.float32) * bv.to(tl.float32)).to(av.dtype).to(tl.float32)
        # this block quantised as fp8_triton's quant_rows does it: amax / 448, true
        # divisions, saturated, rounded to e4m3
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30), 448.0)
        qv = tl.clamp(tl.math.div_rn(y, a_s), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + m * K + cols, qv, mask=ok)
        tl.store(s_ptr + m * kb + b, a_s)

    return norm_quant, glu_quant
