"""`decode_attention` (csrc/decode_attention.cu): one query position per row, grouped-query
attention over a slot's cached positions, the new k/v stored in place, in one launch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .build import extension_available

HEAD_DIMS = (40, 48, 64, 128)  # head_dim / 8 in the .cu switch
GROUPS = (1, 2, 4)  # query heads per kv head
MAX_SPLITS = 32


def check(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
          wslot: Tensor, pos: Tensor, splits: int) -> None:
    if q.dim() != 3 or k_new.dim() != 3 or v_new.dim() != 3:
        raise ValueError(f"q must be [B, H, D] and k_new/v_new [B, Hkv, D]; got "
                         f"{list(q.shape)}, {list(k_new.shape)}, {list(v_new.shape)}")
    B, H, D = q.shape
    Hkv = k_new.shape[1]
    if k_new.shape != v_new.shape or k_new.shape[0] != B or k_new.shape[2] != D or H % Hkv:
        raise ValueError(f"k_new/v_new {list(k_new.shape)}/{list(v_new.shape)} do not fit q "
                         f"{list(q.shape)} (same B and D, H a multiple of Hkv)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] < B \
            or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"caches must be [N >= {B}, {Hkv}, S, {D}]; got {list(k_cache.shape)} "
                         f"and {list(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (written in place)")
    dts = {t.dtype for t in (q, k_new, v_new, k_cache, v_cache)}
    if len(dts) != 1 or next(iter(dts)) not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k_new, v_new and the caches must share one float dtype, got {dts}")
    if wslot.dtype != torch.int64 or pos.dtype != torch.int64 or wslot.shape != (B,) \
            or pos.shape != (B,):
        raise TypeError(f"wslot and pos must be int64 [{B}], got {wslot.dtype} "
                        f"{list(wslot.shape)} and {pos.dtype} {list(pos.shape)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"{name}'s heads and dims must be packed (strides "
                             f"{t.stride()}); only its rows may be strided")
    if len({t.device for t in (q, k_new, v_new, k_cache, v_cache, wslot, pos)}) != 1:
        raise ValueError("decode_attention: all tensors must be on one device")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
        raise ValueError(f"decode_attention: splits must be an int >= 0 (0: automatic), "
                         f"got {splits!r}")


def decode_attention_torch(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                           v_cache: Tensor, wslot: Tensor, pos: Tensor, span: int) -> Tensor:
    """The fallback (float32 math)."""
    B, H, D = q.shape
    k_cache[wslot, :, pos] = k_new
    v_cache[wslot, :, pos] = v_new
    # Row b reads its own slot b; position pos[b] comes from k_new/v_new (as the kernel does).
    keys = k_cache[:B, :, :span].float().clone()  # [B, Hkv, S, D]
    vals = v_cache[:B, :, :span].float().clone()
    rows = torch.arange(B, device=q.device)
    inside = pos < span
    keys[rows[inside], :, pos[inside]] = k_new[inside].float()
    vals[rows[inside], :, pos[inside]] = v_new[inside].float()
    rep = H // k_new.shape[1]
    keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) / math.sqrt(D)
    live = torch.arange(span, device=q.device)[None, :] <= pos[:, None]  # [B, S]
    probs = torch.softmax(scores.masked_fill(~live[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", probs, vals).to(q.dtype)


def supports(head_dim: int, n_head: int, n_kv_heads: int) -> bool:
    """Whether the built kernel handles these attention shapes (on a CUDA device)."""
    return (head_dim in HEAD_DIMS and n_head // n_kv_heads in GROUPS
            and extension_available())


def decode_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                     wslot: Tensor, pos: Tensor, span: int, *, splits: int = 1,
                     kernel: bool = True) -> Tensor:
    """q [B, H, D]; k_new/v_new [B, Hkv, D]; k_cache/v_cache [N, Hkv, S, D] (written at
    (wslot[b], :, pos[b])); wslot/pos int64 [B]. Row b attends to positions 0..pos[b] of
    cache row b, the last one being k_new/v_new. wslot[b] must be b or a slot no row reads
    (>= B), and pos < S: values are not checked (that would need a device sync). `span`
    (> every pos) bounds the fallback's reads; the kernel reads exactly 0..pos[b].
    `splits` (kernel only; the result is the same): each row's positions read by this many
    blocks (at most 32) and merged (1: one block), 0 = as many as fill the GPU at small
    batches. `kernel=False` runs the fallback. Returns out [B, H, D] in q's dtype.
    """
    check(q, k_new, v_new, k_cache, v_cache, wslot, pos, splits)
    if kernel and q.is_cuda and supports(q.shape[-1], q.shape[1], k_new.shape[1]):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.ops.rtvoice_kernels.decode_attention(q, k_new, v_new, k_cache, v_cache, wslot,
                                                   pos, out, splits)
        return out
    return decode_attention_torch(q, k_new, v_new, k_cache, v_cache, wslot, pos, span)
