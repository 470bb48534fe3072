"""q/k per-head RMSNorm + interleaved RoPE in one launch (Triton), for the attention's
prologue of every block.

`norm_rope_qk(q, k, qw, kw, cs, eps)` has the signature and the math of
`engine.functional.norm_rope_qk`: per head, x * rsqrt(mean(x^2) + eps) rounded to the
activation dtype, times the norm weight (rounded again), then the GPT-J rotation of each
adjacent pair (2i, 2i+1) in float32, rounded once. Without weights (the fast AR) only the
rotation. torch.compile made this 6 kernels per slow-AR layer and 2 per fast-AR layer
(296 of the 1,025 launches of a frame step on the H200, docs/PERF.md); here it is one:
one program per (row, head) over q's heads then k's.

Contract (checked by the wrapper; anything else runs the torch reference):
  q  [B, T, H, Dh], k [B, T, Hkv, Dh]: CUDA, bf16/fp16/fp32, last dim contiguous (the
     heads of one row may be strided: q and k are column slices of the qkv GEMM's output)
  qw, kw [Dh] (both or neither), the activation dtype
  cs [B or 1, T, Dh/2, 2]: cos/sin per position and pair (any strides, broadcast over B)
  -> new contiguous q' [B, T, H, Dh], k' [B, T, Hkv, Dh]
Triton is imported lazily: importing this module needs neither triton nor CUDA.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import functional
from .build import triton_available

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


available = triton_available  # Triton importable and a CUDA device present


def supported(q: Tensor, k: Tensor, qw: Tensor | None, kw: Tensor | None, cs: Tensor) -> bool:
    """Whether the kernel takes these arguments (else the reference runs)."""
    B, T, _, dh = q.shape
    return (q.is_cuda and q.dtype in _DTYPES and k.dtype == q.dtype and k.device == q.device
            and k.dim() == 4 and k.shape[:2] == (B, T) and k.shape[3] == dh and dh % 2 == 0
            and q.stride(3) == 1 and k.stride(3) == 1
            and (qw is None) == (kw is None)
            and (qw is None or (qw.shape == (dh,) and kw is not None and kw.shape == (dh,)
                                and qw.is_contiguous() and kw.is_contiguous()))
            and cs.dim() == 4 and cs.shape[0] in (1, B) and cs.shape[1:] == (T, dh // 2, 2)
            and cs.device == q.device)


def norm_rope_qk(q: Tensor, k: Tensor, qw: Tensor | None, kw: Tensor | None, cs: Tensor,
                 eps: float, *, kernel: bool = True) -> tuple[Tensor, Tensor]:
    """`functional.norm_rope_qk` in one launch where the kernel applies (module docstring);
    the reference otherwise (CPU, no triton, `kernel=False`, other layouts)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, Dh], got shape {tuple(q.shape)}")
    if not (kernel and available() and supported(q, k, qw, kw, cs)):
        return functional.norm_rope_qk(q, k, qw, kw, cs, eps)
    B, T, H, dh = q.shape
    hkv = k.shape[2]
    qo = torch.empty((B, T, H, dh), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, hkv, dh), dtype=k.dtype, device=k.device)
    if B * T == 0:
        return qo, ko
    import triton

    half = dh // 2
    csb = cs.stride(0) if cs.shape[0] > 1 else 0
    _kernel()[(B * T, H + hkv)](
        q, k, qo, ko, qw if qw is not None else q, kw if kw is not None else k, cs,
        T, H, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        csb, cs.stride(1), cs.stride(2), cs.stride(3), float(eps),
        HALF=half, BLOCK=triton.next_power_of_2(half), NORM=qw is not None,
        num_warps=1 if dh <= 128 else 2)
    return qo, ko


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    # one compiled variant for every batch, length and position table (no specialisation on
    # these values: nothing compiles after the warm-ups, e.g. inside a graph capture)
    @triton.jit(do_not_specialize=["T", "sqb", "skb", "scb", "sct"])
    def norm_rope_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cs_ptr,
                            T, H, sqb, sqt, sqh, skb, skt, skh,
                            scb, sct, sci, scj, eps,
                            HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
        # program (row, head): row = b * T + t; heads 0..H-1 are q's, H.. are k's
        row = tl.program_id(0)
        head = tl.program_id(1)
        b = row // T
        t = row % T
        i = tl.arange(0, BLOCK)  # pair index: elements 2i and 2i + 1
        m = i < HALF
        if head < H:
            src = q_ptr + b * sqb + t * sqt + head * sqh
            dst = qo_ptr + (row * H + head) * (2 * HALF)
            w_ptr = qw_ptr
        else:
            src = k_ptr + b * skb + t * skt + (head - H) * skh
            dst = ko_ptr + (row * (tl.num_programs(1) - H) + head - H) * (2 * HALF)
            w_ptr = kw_ptr
        x0 = tl.load(src + 2 * i, mask=m, other=0.0)
        x1 = tl.load(src + 2 * i + 1, mask=m, other=0.0)
        if NORM:
            f0 = x0.to(tl.float32)
            f1 = x1.to(tl.float32)
            ms = (tl.sum(f0 * f0, axis=0) + tl.sum(f1 * f1, axis=0)) / (2 * HALF)
            r = tl.rsqrt(ms + eps)
            # rounded to the activation dtype, then times the weight and rounded again: the
            # reference's two roundings
            w0 = tl.load(w_ptr + 2 * i, mask=m, other=0.0).to(tl.float32)
            w1 = tl.load(w_ptr + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
            x0 = ((f0 * r).to(x0.dtype).to(tl.float32) * w0).to(x0.dtype)
            x1 = ((f1 * r).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        c = tl.load(cs_ptr + b * scb + t * sct + i * sci, mask=m, other=0.0).to(tl.float32)
        s = tl.load(cs_ptr + b * scb + t * sct + i * sci + scj, mask=m,
                    other=0.0).to(tl.float32)
        a0 = x0.to(tl.float32)
        a1 = x1.to(tl.float32)
        tl.store(dst + 2 * i, (a0 * c - a1 * s).to(x0.dtype), mask=m)
        tl.store(dst + 2 * i + 1, (a1 * c + a0 * s).to(x0.dtype), mask=m)

    return norm_rope_qk_kernel
