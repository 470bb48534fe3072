"""One-position paged decode attention in Triton for many rows: csrc's `decode_attention`
contract (engine/kernels/decode_attention.py) — store the new key/value at (wblock[b], :,
pos[b] % BS), attend to positions 0..pos[b] through the block table, the last one taken from
k_new/v_new — with the keys and values read as tiles through the tensor cores.

Why: csrc's kernel walks a row's positions one dependent round trip after another on the CUDA
cores; at 64 rows and 200 positions a slow-AR layer's launch reads 53 MB of keys and values
in ~35 us on the H200 (~1.5 TB/s; this kernel: 17 us, docs/PERF.md), where the bytes alone
take ~13 us. Here one
program owns a (row, kv head, split) and streams [BT, D] key and value tiles of that head
(one page each: BT divides BS) through Triton's pipelined loads, several tiles in flight,
with all REP query heads of the kv head as the rows of one `tl.dot` (padded to QM = 16, the
dot's minimum; mma.sync, not wgmma: enough for bytes that bound it) and the online softmax in
float32. Each tile's page number is loaded a tile ahead, so its addresses depend on no load
of its own iteration and the pipeliner keeps stages - 1 tiles in flight (compiled for sm_90 on
a CPU with Triton 3.5: the default shape, 2 stages, holds one tile of keys and values
loading while the other is read, within shared memory, no spills; 3 stages 72 KB and 140
registers; tests/test_triton_sm90.py). On the H200 2 stages measured faster than 3 at 2-64
rows and equal at 256: more programs fit an SM. With `cs` the
launch also does the q/k RMSNorm + RoPE of the new position (`decode_attention_triton`).

Numerics: q.k^T of the model's dtype in float32; the probabilities rounded to that dtype for
the p.v dot (flash attention's choice), so the output is within a few of that dtype's ulps of
the float32 reference, not bit-equal to csrc's kernel (which keeps them in float32).

Splits: with `splits` > 1 each row's positions 0..pos are cut into that many ranges of whole
tiles, each program writes its range's softmax state (max, sum, unnormalised output; float32)
and a second launch merges them in split order. `splits=0` picks the count from the rows
(as many as still fit one wave of programs): `auto_splits`.

Shared prefixes (`prefix`, a `PrefixTiles`): rows whose block tables begin with the same
blocks — sessions speaking with one stored voice, whose prompt's KV the pool keeps once
(engine/kv_pool.py) — read those positions once per tile of rows instead of once per row
(cascade attention): a third launch, one program per (tile, kv head, prefix split), puts the
tile's rows x query heads (up to `PREFIX_QUERIES`) as the rows of one dot against each key /
value tile of the shared range, and each row's own program reads only its positions after
it; the merge launch combines both. Where most of a row's positions are a shared 10 s voice
(~215 frames of a ~500-position context), the step's attention reads about half the bytes.

Contract (`supported` says whether the kernel takes a call; the wrapper checks the rest):
  q          [B, H, D] bf16/fp16, heads and dims packed (rows may be strided)
  k_new/v_new [B, Hkv, D] q's dtype, heads and dims packed
  k_cache/v_cache [N, Hkv, BS, D] q's dtype, contiguous; BS a multiple of 16, D a multiple
             of 8 in 16..256 (padded to a power of two in registers), H / Hkv at most 16
  table      [B, MB] int64 (row stride free, entries contiguous); wblock, pos [B] int64,
             contiguous
  out        [B, H, D] q's dtype, heads and dims packed (rows may be strided)

Triton is imported lazily: importing this module needs neither triton nor CUDA (the programs
are in `_decode_attention_triton_jit`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .build import sm_count, triton_available

__all__ = ["PREFIX_QUERIES", "Config", "PrefixTiles", "auto_splits", "available",
           "decode_attention_triton", "prefix_rows_per_tile", "shapes_supported", "supported"]

QM = 16  # query rows per dot: a kv head's REP query heads, padded
MAX_SPLITS = 32
PREFIX_QUERIES = 64  # a shared-prefix tile's rows x query heads: the rows of its dots
_DTYPES = (torch.bfloat16, torch.float16)
available = triton_available  # Triton importable and a CUDA device present


@dataclass(frozen=True, slots=True)
class Config:
    """A launch shape: `block_t` positions per tile (divides the cache's block size),
    `warps` warps, `stages` tiles in flight."""

    block_t: int = 64
    warps: int = 4
    stages: int = 2  # H200 (gpu_s32_kernel_bench.txt): 17.0 against 3 stages' 22.6 us at
    # 64 rows x 200 positions, 64.7 / 74.1 at 64 x 1000, 9.1 / 11.3 at 16 x 200, even at 256

    def check(self, bs: int) -> None:
        if self.block_t < 16 or self.block_t & (self.block_t - 1) or bs % self.block_t:
            raise ValueError(f"Config.block_t must be a power of two >= 16 dividing the "
                             f"cache's block size {bs}, got {self.block_t}")
        if self.warps not in (2, 4, 8) or not 1 <= self.stages <= 6:  # one warp spills
            raise ValueError(f"Config: warps in (2, 4, 8), stages in 1..6; got "
                             f"{self.warps}, {self.stages}")


class PrefixTiles(NamedTuple):
    """Which rows share which leading positions (`decode_attention_triton`'s `prefix`), as
    device tensors a CUDA graph can read (engine/shared_prefix.py plans them):
      rows   [T, RT] int32: tile t's rows (-1: none), each row in at most one tile
      length [T] int32: the positions [0, length) the tile's rows share (a multiple of the
             cache's block size; 0: an unused tile)
      src    [T] int32: the tile's lowest row, whose table's first length / BS entries
             every row of the tile has (a tile whose src is not a row of the call is
             skipped: its table row is not read)
      start  [>= B] int32: each row's first position of its own, its tile's length (0: in
             no tile)
    Positions at or past a row's own `pos` are never read from the prefix, whatever the
    plan says; a plan whose rows do not share those blocks gives wrong attention."""

    rows: Tensor
    length: Tensor
    src: Tensor
    start: Tensor


def prefix_rows_per_tile(heads: int, kv_heads: int) -> int:
    """Rows per shared-prefix tile: PREFIX_QUERIES query heads of one kv head."""
    return max(1, PREFIX_QUERIES // (heads // kv_heads))


def shapes_supported(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """The attention shapes the kernel takes: head_dim a multiple of 8 in 16..256, at most
    QM query heads per kv head, cache blocks of a multiple of 16 positions."""
    return (16 <= head_dim <= 256 and head_dim % 8 == 0
            and heads % kv_heads == 0 and heads // kv_heads <= QM and block_size % 16 == 0)


def supported(q: Tensor, k_cache: Tensor, table: Tensor, wblock: Tensor, pos: Tensor) -> bool:
    """Whether the kernel takes a call with these (the rest of the contract is csrc's, which
    the caller has checked): CUDA, bf16/fp16, `shapes_supported`, the layouts the module
    docstring names."""
    _, H, D = q.shape
    return (q.is_cuda and q.dtype in _DTYPES
            and shapes_supported(H, k_cache.shape[1], D, k_cache.shape[2])
            and q.stride(2) == 1 and q.stride(1) == D and k_cache.is_contiguous()
            and table.stride(1) == 1 and wblock.stride(0) == 1 and pos.stride(0) == 1)


def auto_splits(rows: int, kv_heads: int, sms: int) -> int:
    """Splits per row for `rows` rows: the largest power of two whose programs still fit one
    wave (rows x kv heads x splits <= SMs), at least 1, at most MAX_SPLITS. A split only pays
    where programs would leave SMs idle: on the H200 (132 SMs, 8 kv heads) 16 rows x 200
    positions took 6.95 us unsplit against 8.1 with 2 splits and 11.3 with 4 (two waves, the
    old rule), and 2 rows 5.4 us with 4 against 6.4 unsplit (gpu_s32_kernel_bench.txt). From
    the rows alone (not the positions, which a CUDA graph does not know): each count is a
    compiled variant, and every batch bucket's warm-up step then compiles the one its
    captures use; powers of two keep the variants few."""
    s = 1
    while 2 * s <= MAX_SPLITS and rows * kv_heads * 2 * s <= sms:
        s *= 2
    return s


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def decode_attention_triton(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                            v_cache: Tensor, table: Tensor, wblock: Tensor, pos: Tensor, *,
                            splits: int = 0, config: Config | None = None,
                            out: Tensor | None = None, cs: Tensor | None = None,
                            qw: Tensor | None = None, kw: Tensor | None = None,
                            eps: float = 0.0, prefix: PrefixTiles | None = None,
                            prefix_warps: int = 8) -> Tensor:
    """The kernel on one position per row (module docstring; it reads exactly 0..pos[b]).
    `splits`: 1..MAX_SPLITS, or 0 for `auto_splits`. Returns `out` (given: q's shape and
    dtype, heads and dims packed, rows may be strided) or a new [B, H, D] tensor. The
    layouts are checked here (csrc's wrapper checks the rest of the contract).
    `cs` [B or 1, D/2, 2] (q's dtype, last two dims packed; D even): q and k_new are first
    rotated as `functional.apply_rope` does (interleaved pairs), after the per-head RMSNorm
    with `qw`, `kw` [D] and `eps` where those are given (`functional.norm_rope_qk`, every
    rounding of it; products not fused into FMAs), and that k is what the cache stores —
    the model's q/k norm + RoPE launch folded into this one (csrc's `rope`). `prefix`: the
    rows' shared leading positions read once per tile of rows (module docstring; not with
    `cs`: that tile's queries must be rotated already), its programs with `prefix_warps`
    warps (2, 4 or 8; compiled for sm_90, 16 rows x 4 heads: 192 registers at 8 warps, 255
    at 4); the result is the same up to rounding."""
    B, H, D = q.shape
    Hkv, BS = k_cache.shape[1], k_cache.shape[2]
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("out", out)):
        if t is not None and (t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != D):
            raise ValueError(f"decode_attention_triton: {name} {list(t.shape)} must be [B, H, "
                             f"{D}] with heads and dims packed (strides {t.stride()})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or k_cache.shape != v_cache.shape:
        raise ValueError("decode_attention_triton: k_cache and v_cache must be contiguous "
                         f"and of one shape, got {list(k_cache.shape)} / {list(v_cache.shape)}")
    # a dimension of size 1 may carry any stride (torch calls it contiguous): only one element
    if any(t.shape[d] > 1 and t.stride(d) != 1 for t, d in ((table, 1), (wblock, 0), (pos, 0))):
        raise ValueError("decode_attention_triton: table rows, wblock and pos must be "
                         f"contiguous, got strides {table.stride()}, {wblock.stride()}, "
                         f"{pos.stride()}")
    if (qw is None) != (kw is None) or (qw is not None and cs is None):
        raise ValueError("decode_attention_triton: give qw and kw together, with cs")
    if qw is not None and not eps > 0:  # the padded query rows are normed too: rsqrt(0 + eps)
        raise ValueError(f"decode_attention_triton: the norm's eps must be > 0, got {eps!r}")
    if cs is not None and (D % 2 or cs.dtype != q.dtype or cs.dim() != 3
                           or cs.shape[0] not in (1, B) or tuple(cs.shape[1:]) != (D // 2, 2)
                           or cs.stride(2) != 1 or cs.stride(1) != 2):
        raise ValueError(f"decode_attention_triton: cs {list(cs.shape)} {cs.dtype} must be "
                         f"[B or 1, {D // 2}, 2] {q.dtype} with its last two dims packed")
    for name, wt in (("qw", qw), ("kw", kw)):
        if wt is not None and (wt.shape != (D,) or wt.dtype != q.dtype
                               or not wt.is_contiguous()):
            raise ValueError(f"decode_attention_triton: {name} must be a contiguous [{D}] "
                             f"{q.dtype} tensor")
    rep = H // Hkv
    if prefix is not None:
        _check_prefix(prefix, B, rep, q.device)
        if cs is not None:
            raise ValueError("decode_attention_triton: a shared prefix needs q rotated "
                             "already: rope first, then call without cs")
        if prefix_warps not in (2, 4, 8):
            raise ValueError(f"decode_attention_triton: prefix_warps must be 2, 4 or 8, got "
                             f"{prefix_warps!r}")
    cfg = config or Config(block_t=min(64, BS & -BS))  # a power of two dividing BS
    cfg.check(BS)
    if isinstance(splits, bool) or not isinstance(splits, int) or not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention_triton: splits must be an int in 0..{MAX_SPLITS}, "
                         f"got {splits!r}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    sms = sm_count(q.device) if q.is_cuda else 132
    if splits == 0:
        splits = auto_splits(B, Hkv, sms)
    psplits = 0
    if prefix is not None:  # the prefix programs: one wave, as auto_splits
        psplits = auto_splits(prefix.rows.shape[0], Hkv, sms)
    slots = splits + psplits
    scale = math.log2(math.e) / math.sqrt(D)  # exp2 of scores in log2 units
    if slots == 1:
        ws_o = ws_ml = out  # unused
    else:
        ws_o = torch.empty((B, H, slots, D), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((B, H, slots, 2), dtype=torch.float32, device=q.device)
    attend, combine, shared = _kernels()
    rope = 0 if cs is None else 1 if qw is None else 2
    attend[(B, Hkv, splits)](
        q, k_new, v_new, k_cache, v_cache, table, wblock, pos, out, ws_o, ws_ml,
        q if cs is None else cs, q if qw is None else qw, q if kw is None else kw,
        pos if prefix is None else prefix.start,
        q.stride(0), k_new.stride(0), v_new.stride(0), out.stride(0), table.stride(0), Hkv,
        0 if cs is None or cs.shape[0] == 1 else cs.stride(0), scale, float(eps),
        REP=rep, QMR=QM, D=D, DP=_pow2(D), BS=BS, BT=cfg.block_t, SPLITS=splits, ROPE=rope,
        SLOTS=slots, num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False)
    if prefix is not None:
        T, RT = prefix.rows.shape
        shared[(T, Hkv, psplits)](
            q, k_cache, v_cache, table, pos, prefix.rows, prefix.length, prefix.src, ws_o,
            ws_ml, q.stride(0), table.stride(0), Hkv, B, scale,
            REP=rep, RT=RT, QMP=max(QM, _pow2(RT * rep)), D=D, DP=_pow2(D), BS=BS,
            BT=cfg.block_t, SPLITS=splits, SLOTS=slots, PSPLITS=psplits,
            num_warps=prefix_warps, num_stages=cfg.stages)
    if slots > 1:
        combine[(B, H)](ws_o, ws_ml, out, out.stride(0), H, D=D, DP=_pow2(D), SPLITS=slots,
                        SP=max(2, 1 << (slots - 1).bit_length()), num_warps=4)
    return out


def _check_prefix(prefix: PrefixTiles, B: int, rep: int, device: torch.device) -> None:
    """The layouts of a `PrefixTiles` (their values are the planner's: checking them would
    need a device sync); a tile's rows x query heads at most 2 * PREFIX_QUERIES (its
    accumulator lives in registers)."""
    rows, length, src, start = prefix
    T, RT = rows.shape if rows.dim() == 2 else (-1, -1)
    if not 1 <= RT * rep <= 2 * PREFIX_QUERIES:
        raise ValueError(f"decode_attention_triton: prefix.rows must be [tiles, rows per "
                         f"tile] with rows per tile x {rep} query heads per kv head in 1.."
                         f"{2 * PREFIX_QUERIES}, got {list(rows.shape)}")
    for name, t, shape in (("rows", rows, (T, RT)), ("length", length, (T,)),
                           ("src", src, (T,))):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or not t.is_contiguous() \
                or t.device != device:
            raise ValueError(f"decode_attention_triton: prefix.{name} must be a contiguous "
                             f"int32 {list(shape)} tensor on {device}, got {list(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if T < 1 or start.dim() != 1 or start.shape[0] < B or start.dtype != torch.int32 \
            or start.stride(0) != 1 or start.device != device:
        raise ValueError(f"decode_attention_triton: prefix.start must be a contiguous int32 "
                         f"[>= {B}] tensor on {device} and there must be a tile, got "
                         f"{list(start.shape)} {start.dtype}, {T} tiles")


@functools.cache
def _kernels():  # type: ignore[no-untyped-def]
    """(attend, combine, shared prefix), compiled on first use (imports triton)."""
    from . import _decode_attention_triton_jit as jit

    return (jit.decode_attention_tiles, jit.decode_attention_combine_tiles,
            jit.decode_attention_prefix_tiles)
