"""`decode_attention` (csrc/decode_attention.cu): one query position per row, grouped-query
attention over the row's paged KV blocks, the new k/v stored in place, in one launch; with
`rope`, the model's q/k RMSNorm and interleaved RoPE of that position folded into it."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import functional
from . import decode_attention_triton as triton_kernel
from .build import extension_available

HEAD_DIMS = (40, 48, 64, 128)  # head_dim / 8 in the .cu switch
ROPE_HEAD_DIMS = (48, 64, 128)  # an even number of elements per lane (not 40: 5)


class Rope(NamedTuple):
    """The q/k norm and rotation of the attended position: per-head RMSNorm weights qw, kw
    [D] (both None: no norm), (cos, sin) per pair cs [B or 1, D/2, 2], the norm's eps: what
    functional.norm_rope_qk applies before attention."""

    qw: Tensor | None
    kw: Tensor | None
    cs: Tensor
    eps: float


def apply_rope(q: Tensor, k: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
    """functional.norm_rope_qk on one position: q [B, H, D], k [B, Hkv, D] -> the normed,
    rotated (q, k) (the reference of the kernel's fused path)."""
    cs = rope.cs[:, None]  # [B or 1, 1, D/2, 2]
    qn, kn = functional.norm_rope_qk(q[:, None], k[:, None], rope.qw, rope.kw, cs, rope.eps)
    return qn[:, 0], kn[:, 0]


def rope_supported(q: Tensor, rope: Rope) -> bool:
    """Whether the kernel takes `rope` with q [B, H, D] (head_dim, dtypes, cs's layout)."""
    cs, (B, _, D) = rope.cs, q.shape
    ws = [w for w in (rope.qw, rope.kw) if w is not None]
    return (D in ROPE_HEAD_DIMS and (rope.qw is None) == (rope.kw is None)
            and cs.dtype == q.dtype and cs.dim() == 3 and cs.shape[0] in (1, B)
            and cs.shape[1:] == (D // 2, 2) and cs.stride(2) == 1 and cs.stride(1) == 2
            and all(w.dtype == q.dtype and w.shape == (D,) and w.is_contiguous() for w in ws)
            and cs.device == q.device)
GROUPS = (1, 2, 4)  # query heads per kv head
MAX_SPLITS = 32


def check(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
          table: Tensor, wblock: Tensor, pos: Tensor, splits: int) -> None:
    if q.dim() != 3 or k_new.dim() != 3 or v_new.dim() != 3:
        raise ValueError(f"q must be [B, H, D] and k_new/v_new [B, Hkv, D]; got "
                         f"{list(q.shape)}, {list(k_new.shape)}, {list(v_new.shape)}")
    B, H, D = q.shape
    Hkv = k_new.shape[1]
    if k_new.shape != v_new.shape or k_new.shape[0] != B or k_new.shape[2] != D or H % Hkv:
        raise ValueError(f"k_new/v_new {list(k_new.shape)}/{list(v_new.shape)} do not fit q "
                         f"{list(q.shape)} (same B and D, H a multiple of Hkv)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[1] != Hkv \
            or k_cache.shape[3] != D:
        raise ValueError(f"caches must be [blocks, {Hkv}, block_size, {D}]; got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (written in place)")
    dts = {t.dtype for t in (q, k_new, v_new, k_cache, v_cache)}
    if len(dts) != 1 or next(iter(dts)) not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k_new, v_new and the caches must share one float dtype, got {dts}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != B \
            or table.shape[1] < 1 or table.stride(1) != 1:
        raise TypeError(f"table must be int64 [{B}, blocks per row] with packed rows, got "
                        f"{table.dtype} {list(table.shape)}")
    if wblock.dtype != torch.int64 or pos.dtype != torch.int64 or wblock.shape != (B,) \
            or pos.shape != (B,):
        raise TypeError(f"wblock and pos must be int64 [{B}], got {wblock.dtype} "
                        f"{list(wblock.shape)} and {pos.dtype} {list(pos.shape)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"{name}'s heads and dims must be packed (strides "
                             f"{t.stride()}); only its rows may be strided")
    if len({t.device for t in (q, k_new, v_new, k_cache, v_cache, table, wblock, pos)}) != 1:
        raise ValueError("decode_attention: all tensors must be on one device")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
        raise ValueError(f"decode_attention: splits must be an int >= 0 (0: automatic), "
                         f"got {splits!r}")


def gather_blocks(cache: Tensor, table: Tensor, span: int) -> Tensor:
    """Positions [0, span) of each row's blocks: cache [N, Hkv, BS, D], table [B, MB] ->
    [B, Hkv, span, D]. One copy: the blocks are gathered head-major ([Hkv, B, nb, BS, D],
    so that a row's positions are adjacent) and returned as a strided view of that."""
    bs = cache.shape[2]
    nb = -(-span // bs)
    g = cache.transpose(0, 1)[:, table[:, :nb]]  # [Hkv, B, nb, BS, D]
    Hkv, B, _, _, D = g.shape
    return g.view(Hkv, B, nb * bs, D).transpose(0, 1)[:, :, :span]


def decode_attention_torch(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                           v_cache: Tensor, table: Tensor, wblock: Tensor, pos: Tensor,
                           span: int) -> Tensor:
    """The fallback (float32 math)."""
    B, H, D = q.shape
    bs = k_cache.shape[2]
    k_cache[wblock, :, pos % bs] = k_new
    v_cache[wblock, :, pos % bs] = v_new
    # Row b reads its blocks; position pos[b] comes from k_new/v_new (as the kernel does).
    keys = gather_blocks(k_cache, table, span).float()  # [B, Hkv, S, D]
    vals = gather_blocks(v_cache, table, span).float()
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
                     table: Tensor, wblock: Tensor, pos: Tensor, span: int, *, splits: int = 1,
                     kernel: bool = True, rope: Rope | None = None, pdl: bool = False,
                     out: Tensor | None = None, triton_rows: int = 0,
                     prefix: triton_kernel.PrefixTiles | None = None) -> Tensor:
    """q [B, H, D]; k_new/v_new [B, Hkv, D]; k_cache/v_cache [N, Hkv, BS, D]: N blocks of BS
    positions; table int64 [B, MB]: row b's position t is at (table[b, t // BS], t % BS);
    wblock/pos int64 [B]: row b writes k_new/v_new at (wblock[b], :, pos[b] % BS) — its own
    block table[b, pos[b] // BS], or a block no row reads (scratch). Row b attends to its
    positions 0..pos[b], the last one being k_new/v_new. Values are not checked (that would
    need a device sync): pos < MB * BS and every table entry < N. `span` (> every pos)
    bounds the fallback's reads; the kernel reads exactly 0..pos[b]. A dense cache
    [N, Hkv, S, D] is the case table[b] = [b], BS = S. `splits` (kernel only; the result is
    the same): each row's positions read by this many blocks (at most 32) and merged (1: one
    block), 0 = as many as fill the GPU at small batches. `rope`: q and k_new are first
    normed and rotated (`apply_rope`; in the kernel's launch where `rope_supported`), and
    that k is what the cache stores. `kernel=False` runs the fallback. `pdl` (kernel only,
    sm_90+): launched with programmatic dependent launch (csrc/launch.cuh; same result).
    Returns out [B, H, D] in q's dtype: `out` when given (q's shape and dtype, heads and dims
    packed, rows may be strided: one position of a [B, T, H, D] output), else a new tensor.
    `triton_rows` (> 0): calls of at least that many rows run the Triton kernel instead
    (engine/kernels/decode_attention_triton.py: tiles through the tensor cores, automatic
    splits; `rope` in its launch too where `rope_supported`) where it takes them; 0: never
    (one-position calls only: the several-positions form below keeps csrc's kernel).
    `prefix` (a `PrefixTiles`: rows sharing leading KV blocks, engine/shared_prefix.py): the
    Triton kernel reads those positions once per tile of rows (with `rope`, q and k are then
    rotated first, apart); the other paths read every row's positions and ignore it.

    Several new positions per row: q [B, T, H, D], k_new/v_new [B, T, Hkv, D], rope's cs
    [B or 1, T, D/2, 2], out [B, T, H, D]: row b's queries at pos[b] + t, each attending
    causally to 0..pos[b] + t — the T one-position calls in order, all positions stored in
    block wblock[b] (so they must share one block: the fast AR's dense cache). T = 2 in bf16 /
    fp16 is one kernel launch (the second query reads the first's key/value from k_new /
    v_new), bit-equal to the two calls; otherwise the calls run one by one.
    """
    if q.dim() == 4:
        return _positions(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, span,
                          splits=splits, kernel=kernel, rope=rope, pdl=pdl, out=out)
    check(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, splits)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(2) != 1
                            or out.stride(1) != q.shape[2]
                            or (q.shape[0] > 1 and out.stride(0) < q.shape[1] * q.shape[2])):
        raise ValueError(f"out must be {list(q.shape)} {q.dtype} on {q.device} with heads and "
                         f"dims packed and rows apart, got {list(out.shape)} {out.dtype} strides "
                         f"{out.stride()}")
    if isinstance(triton_rows, bool) or not isinstance(triton_rows, int) or triton_rows < 0:
        raise ValueError(f"decode_attention: triton_rows must be an int >= 0 (0: never), got "
                         f"{triton_rows!r}")
    if (kernel and 0 < triton_rows <= q.shape[0] and triton_kernel.available()
            and triton_kernel.supported(q, k_cache, table, wblock, pos)):
        if rope is not None and (prefix is not None or not rope_supported(q, rope)):
            q, k_new = apply_rope(q, k_new, rope)
            rope = None
        return triton_kernel.decode_attention_triton(
            q, k_new, v_new, k_cache, v_cache, table, wblock, pos, out=out, prefix=prefix,
            **({} if rope is None else dict(cs=rope.cs, qw=rope.qw, kw=rope.kw, eps=rope.eps)))
    use = kernel and q.is_cuda and supports(q.shape[-1], q.shape[1], k_new.shape[1])
    if rope is not None and not (use and rope_supported(q, rope)):
        q, k_new = apply_rope(q, k_new, rope)
        rope = None
    if use:
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        qw, kw, cs, eps = (None, None, None, 0.0) if rope is None else (
            rope.qw, rope.kw, rope.cs, rope.eps)
        torch.ops.rtvoice_kernels.decode_attention(q, k_new, v_new, k_cache, v_cache, table,
                                                   wblock, pos, out, splits, qw, kw, cs, eps,
                                                   pdl)
        return out
    y = decode_attention_torch(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, span)
    return y if out is None else out.copy_(y)


def _positions(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
               table: Tensor, wblock: Tensor, pos: Tensor, span: int, *, splits: int,
               kernel: bool, rope: Rope | None, pdl: bool, out: Tensor | None) -> Tensor:
    """decode_attention on T positions per row (q [B, T, H, D]; its docstring)."""
    if k_new.dim() != 4 or v_new.dim() != 4 or k_new.shape[:2] != q.shape[:2] \
            or v_new.shape != k_new.shape:
        raise ValueError(f"with q [B, T, H, D] {list(q.shape)}, k_new/v_new must be "
                         f"[B, T, Hkv, D]; got {list(k_new.shape)}, {list(v_new.shape)}")
    T = q.shape[1]
    if rope is not None and (rope.cs.dim() != 4 or rope.cs.shape[1] != T):
        raise ValueError(f"with {T} positions per row rope.cs must be [B or 1, {T}, D/2, 2], "
                         f"got {list(rope.cs.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be {list(q.shape)} {q.dtype} on {q.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    for t in range(T):  # every one-position contract (shapes, strides, dtypes, devices)
        check(q[:, t], k_new[:, t], v_new[:, t], k_cache, v_cache, table, wblock, pos, splits)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    use = (kernel and q.is_cuda and T == 2 and q.dtype in (torch.bfloat16, torch.float16)
           and supports(q.shape[-1], q.shape[2], k_new.shape[2])
           and (rope is None or rope_supported(q[:, 0], Rope(rope.qw, rope.kw, rope.cs[:, 0],
                                                             rope.eps)))
           and out.stride(3) == 1 and out.stride(2) == q.shape[3]
           and out.stride(1) >= q.shape[2] * q.shape[3]
           and (q.shape[0] <= 1 or out.stride(0) >= 2 * out.stride(1)))
    if use:
        qw, kw, cs, eps = (None, None, None, 0.0) if rope is None else rope
        torch.ops.rtvoice_kernels.decode_attention(q, k_new, v_new, k_cache, v_cache, table,
                                                   wblock, pos, out, splits, qw, kw, cs, eps,
                                                   pdl)
        return out
    for t in range(T):
        decode_attention(q[:, t], k_new[:, t], v_new[:, t], k_cache, v_cache, table, wblock,
                         pos if t == 0 else pos + t, span, splits=splits, kernel=kernel,
                         pdl=pdl, out=out[:, t],
                         rope=None if rope is None else Rope(rope.qw, rope.kw, rope.cs[:, t],
                                                             rope.eps))
    return out
