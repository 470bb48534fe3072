"""KV storage for the slow AR (a pool of fixed-size blocks shared by every sequence) and the
fast AR (one frame's 10 positions), and the `Attend` objects through which the model's
attention layers reach it.

Paged: a sequence's positions live in blocks of `block_size` positions, listed in its block
table (position t at block table[t // block_size], offset t % block_size). Blocks are handed
out as a sequence grows and shared between sequences with the same voice prompt; which
sequence owns which block is the scheduler's business (engine/kv_pool.py,
engine/scheduler.py), not the cache's. The last block is scratch: padded rows and unused
table entries point at it, so stray writes land where nothing reads.

The decode attends (the slow AR's one position per row; the fast AR's T positions, its first
call two) take an optional `kernel`: csrc's decode_attention, which stores the new k/v and
attends through the block table in one launch (per position; the fast AR's first two
positions together), engine/ops.py deciding; without
it they write, gather the rows' blocks and run the model's attention.
With `fuse_rope` (FastKV: `rope_rows` covering the batch) they also offer
`norm_rope_attend`, which hands the kernel q and k before their norm and rotation (one
launch for both; the model takes it where it exists).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .config import ModelConfig, TransformerConfig
from .kernels.decode_attention import Rope, gather_blocks
from .kernels.decode_attention_triton import PrefixTiles
from .kv_pool import table_width
from .model import explicit_attention, gqa_attention
from .ops import PendingHeads

Kernel = Callable[..., Tensor] | None  # engine.kernels.decode_attention.decode_attention


class SlowKVCache:
    def __init__(self, cfg: TransformerConfig, n_blocks: int, block_size: int, max_len: int, *,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        self.n_blocks, self.block_size, self.max_len = n_blocks, block_size, max_len
        self.table_width = table_width(max_len, block_size)
        shape = (cfg.n_layer, n_blocks + 1, cfg.n_local_heads, block_size, cfg.head_dim)
        # k, v: [L, blocks+1, Hkv, BS, Dh]; block n_blocks is scratch.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def position_bytes(cfg: TransformerConfig, dtype: torch.dtype) -> int:
        """Bytes of one position's keys and values, all layers."""
        return 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * dtype.itemsize

    @property
    def scratch(self) -> int:
        return self.n_blocks

    def table(self, blocks: list[int]) -> list[int]:
        """A full table row: the blocks, then scratch."""
        if len(blocks) > self.table_width:
            raise ValueError(f"{len(blocks)} blocks exceed the table's {self.table_width}")
        return list(blocks) + [self.scratch] * (self.table_width - len(blocks))

    def locate(self, table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(block, offset) of positions [..., T] through table [..., MB] (same leading dims)."""
        bs = self.block_size
        return table.gather(-1, positions // bs), positions % bs

    # ------------------------------------------------------------ blocks as a unit
    def save(self, blocks: list[int]) -> tuple[Tensor, Tensor]:
        """The blocks' keys and values copied to host memory: [L, n, Hkv, BS, Dh] each (pinned
        on a GPU; the copy is complete when this returns)."""
        idx = torch.tensor(blocks, device=self.k.device)
        pin = self.k.is_cuda
        k = torch.empty((self.k.shape[0], len(blocks), *self.k.shape[2:]), dtype=self.k.dtype,
                        pin_memory=pin)
        v = torch.empty_like(k, pin_memory=pin)
        k.copy_(self.k.index_select(1, idx), non_blocking=pin)
        v.copy_(self.v.index_select(1, idx), non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()
        return k, v

    def restore(self, saved: tuple[Tensor, Tensor], blocks: list[int]) -> None:
        """Write `save`d keys and values into `blocks` (on the current stream)."""
        idx = torch.tensor(blocks, device=self.k.device)
        k, v = saved
        self.k.index_copy_(1, idx, k.to(self.k.device, non_blocking=True))
        self.v.index_copy_(1, idx, v.to(self.v.device, non_blocking=True))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared block (on the current stream)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


class PrefillAttend:
    """Causal attention for one sequence's chunk at positions [start, start+T), through its
    block table [MB] (a device tensor)."""

    def __init__(self, cache: SlowKVCache, table: Tensor, start: int, length: int) -> None:
        if start + length > cache.max_len:
            raise ValueError(f"sequence would reach {start + length} positions, over the "
                             f"cache's {cache.max_len}")
        self.cache, self.table, self.start, self.end = cache, table, start, start + length
        q_pos = torch.arange(start, self.end, device=cache.k.device)
        self.w_block, self.w_off = cache.locate(table, q_pos)  # [T]
        k_pos = torch.arange(self.end, device=cache.k.device)
        self.mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, T, S]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[layer, self.w_block, :, self.w_off] = k[0].transpose(0, 1)  # [T, Hkv, Dh]
        c.v[layer, self.w_block, :, self.w_off] = v[0].transpose(0, 1)
        keys = gather_blocks(c.k[layer], self.table[None], self.end)  # [1, Hkv, S, Dh]
        vals = gather_blocks(c.v[layer], self.table[None], self.end)
        return gqa_attention(q, keys, vals, self.mask)


class BatchedPrefillAttend:
    """Causal attention for several sequences' chunks at once, padded to T columns.

    Row n holds `lengths[n]` columns at positions starts[n].. through block table tables[n];
    padded columns neither write the cache nor matter (they attend to position 0 only)."""

    def __init__(self, cache: SlowKVCache, tables: Tensor, starts: list[int],
                 lengths: list[int], T: int) -> None:
        d = cache.k.device
        ends = [s + n for s, n in zip(starts, lengths)]
        if max(ends) > cache.max_len:
            raise ValueError(f"a sequence would reach {max(ends)} positions, over the cache's "
                             f"{cache.max_len}")
        self.cache, self.end, self.tables = cache, max(ends), tables  # [N, MB]
        st = torch.tensor(starts, device=d)
        ln = torch.tensor(lengths, device=d)
        t = torch.arange(T, device=d)
        self.valid = t[None, :] < ln[:, None]  # [N, T]
        q_pos = st[:, None] + t[None, :]  # [N, T]
        self.positions = torch.where(self.valid, q_pos, st[:, None])
        k_pos = torch.arange(self.end, device=d)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [N, T, S]
        mask |= (~self.valid[:, :, None]) & (k_pos[None, None, :] == 0)
        self.mask = mask[:, None]  # [N, 1, T, S]
        blk, off = cache.locate(tables, self.positions)
        self.w_block, self.w_off = blk[self.valid], off[self.valid]  # [n_valid]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[layer, self.w_block, :, self.w_off] = k.transpose(1, 2)[self.valid]
        c.v[layer, self.w_block, :, self.w_off] = v.transpose(1, 2)[self.valid]
        keys = gather_blocks(c.k[layer], self.tables, self.end)  # [N, Hkv, S, Dh]
        vals = gather_blocks(c.v[layer], self.tables, self.end)
        return gqa_attention(q, keys, vals, self.mask)


class TablePrefillAttend:
    """N sequences' chunks of T columns, row n at positions[n, 0..T-1] through block table
    tables[n] ([N, MB] int64), with every index a device tensor, so a whole prefill forward
    can be captured as a CUDA graph. Chunks may be padded (extra columns, or whole rows whose
    table is all scratch): padding writes k/v at positions past a sequence's end — in its own
    blocks, written again before anything reads them, or in scratch. Keys are read over
    [0, span)."""

    def __init__(self, cache: SlowKVCache, tables: Tensor, positions: Tensor, span: int) -> None:
        self.cache, self.tables, self.span = cache, tables, span
        self.w_block, self.w_off = cache.locate(tables, positions)  # [N, T]
        k_pos = torch.arange(span, device=positions.device)
        self.mask = (k_pos[None, None, :] <= positions[:, :, None])[:, None]  # [N, 1, T, span]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[layer, self.w_block, :, self.w_off] = k.transpose(1, 2)  # [N, T, Hkv, Dh]
        c.v[layer, self.w_block, :, self.w_off] = v.transpose(1, 2)
        keys = gather_blocks(c.k[layer], self.tables, self.span)  # [N, Hkv, span, Dh]
        vals = gather_blocks(c.v[layer], self.tables, self.span)
        return gqa_attention(q, keys, vals, self.mask)


class PagedDecodeAttend:
    """One new position per row: row b writes its k/v at (wblock[b], positions[b] % BS) and
    attends to its positions [0, positions[b]] through tables[b] ([B, MB]). `prefix`: the
    rows' shared leading blocks, handed to the kernel (engine/shared_prefix.py)."""

    def __init__(self, cache: SlowKVCache, tables: Tensor, wblock: Tensor, positions: Tensor,
                 span: int, kernel: Kernel = None, fuse_rope: bool = False,
                 prefix: PrefixTiles | None = None) -> None:
        self.cache, self.tables, self.wblock, self.positions = cache, tables, wblock, positions
        self.span, self.kernel, self.prefix = span, kernel, prefix
        self.norm_rope_attend = self._norm_rope_attend if kernel and fuse_rope else None
        # the fallback's write offsets and mask, made on its first call: with the kernel they
        # would be three launches of every frame step that nothing reads
        self._fallback: tuple[Tensor, Tensor] | None = None

    def _offsets_and_mask(self) -> tuple[Tensor, Tensor]:
        """(w_off [B]: each row's offset in its write block, mask [B, 1, 1, S] bool)."""
        if self._fallback is None:
            p = self.positions
            k_pos = torch.arange(self.span, device=p.device)
            self._fallback = (p % self.cache.block_size,
                              (k_pos[None, :] <= p[:, None])[:, None, None, :])
        return self._fallback

    def _launch(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                rope: Rope | None = None) -> Tensor:
        """The kernel on one position: q [B, H, Dh], k/v [B, Hkv, Dh] -> [B, H, 1, Dh]."""
        c = self.cache
        assert self.kernel is not None
        extra = {} if self.prefix is None else {"prefix": self.prefix}
        return self.kernel(q, k, v, c.k[layer], c.v[layer], self.tables, self.wblock,
                           self.positions, self.span, rope=rope, **extra)[:, :, None]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        if self.kernel is not None:  # write + attend in one csrc launch
            return self._launch(layer, q[:, :, 0], k[:, :, 0], v[:, :, 0])
        w_off, mask = self._offsets_and_mask()
        c.k[layer, self.wblock, :, w_off] = k[:, :, 0]
        c.v[layer, self.wblock, :, w_off] = v[:, :, 0]
        keys = gather_blocks(c.k[layer], self.tables, self.span)  # [B, Hkv, S, Dh]
        vals = gather_blocks(c.v[layer], self.tables, self.span)
        return gqa_attention(q, keys, vals, mask)

    def _norm_rope_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, qw: Tensor | None,
                          kw: Tensor | None, cs: Tensor, eps: float) -> Tensor:
        """q [B, 1, H, Dh], k/v [B, 1, Hkv, Dh] before the q/k norm and RoPE (cs [B, 1,
        Dh/2, 2]) -> the attention output [B, H, 1, Dh]: norm, rotation, store and attend
        in the kernel's one launch."""
        return self._launch(layer, q[:, 0], k[:, 0], v[:, 0], Rope(qw, kw, cs[:, 0], eps))


class FastKV:
    """The fast AR's cache: 10 positions, rewritten from position 0 for every frame."""

    def __init__(self, cfg: ModelConfig, batch: int, *, device: torch.device | str,
                 dtype: torch.dtype, kernel: Kernel = None, rope_rows: int = 0,
                 deferred: bool = False) -> None:
        f = cfg.fast
        self.kernel = kernel
        self.deferred = deferred  # `defer` offers the attention to wo's prologue
        self.rope_rows = rope_rows if kernel else 0  # `at` offers norm_rope_attend up to these
        self.norm_rope_attend: Callable[..., Tensor] | None = None
        shape = (f.n_layer, batch, f.n_local_heads, cfg.num_codebooks, f.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        n = cfg.num_codebooks
        self._masks = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        # for the csrc kernel: row b is a one-block table [b] of n positions
        self._rows = torch.arange(batch, device=device)
        self._tables = self._rows[:, None].contiguous()
        self._pos = torch.arange(n, device=device)[:, None].expand(n, batch).contiguous()

    def at(self, pos: int, batch: int) -> FastKV:
        self.pos, self.batch = pos, batch
        self.norm_rope_attend = self._norm_rope_attend if batch <= self.rope_rows else None
        return self

    def _launch(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                rope: Rope | None = None) -> Tensor:
        """The kernel on positions pos..pos+T-1: q [B, T, H, Dh], k/v [B, T, Hkv, Dh] (rows
        may be strided; rope's cs [B, T, Dh/2, 2]) -> [B, H, T, Dh]. One position is one
        launch into its [B, H, Dh] slice; several are one call (decode_attention's [B, T, ...]
        form: the frame's first two positions in one launch, each query attending causally)."""
        p, b, T = self.pos, self.batch, q.shape[1]
        assert self.kernel is not None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        args = (self.k[layer], self.v[layer], self._tables[:b], self._rows[:b], self._pos[p, :b],
                p + T)
        if T == 1:
            one = None if rope is None else Rope(rope.qw, rope.kw, rope.cs[:, 0], rope.eps)
            self.kernel(q[:, 0], k[:, 0], v[:, 0], *args, rope=one, out=out[:, 0])
        else:
            self.kernel(q, k, v, *args, rope=rope, out=out)
        return out.transpose(1, 2)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, H, T, Dh], k/v [B, Hkv, T, Dh] at positions pos..pos+T-1 (rotated) -> the
        attention output [B, H, T, Dh], their K/V stored."""
        p, b, T = self.pos, self.batch, q.shape[2]
        if self.kernel is not None:
            return self._launch(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        self.k[layer, :b, :, p: p + T] = k
        self.v[layer, :b, :, p: p + T] = v
        mask = self._masks[p: p + T, : p + T][None, None]  # [1, 1, T, p+T]
        return explicit_attention(q, self.k[layer, :b, :, : p + T], self.v[layer, :b, :, : p + T],
                                  mask)

    def defer(self, layer: int, qkv: Tensor, cs: Tensor,
              compute: Callable[[], Tensor]) -> PendingHeads | None:
        """This position's attention for the output projection's prologue to compute
        (`Ops.attend_kernel`): qkv [B, 1, q + 2 kv] before the rotation cs [B, 1, Dh/2, 2]
        (every row at `pos`, so one row of it serves all); `compute` is the usual path. None
        where not `deferred`, or for more than one position."""
        if not self.deferred or qkv.shape[1] != 1:
            return None
        return PendingHeads(qkv, self.k[layer], self.v[layer], cs[0, 0], self.pos, compute)

    def _norm_rope_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, qw: Tensor | None,
                          kw: Tensor | None, cs: Tensor, eps: float) -> Tensor:
        """As PagedDecodeAttend's (q/k before their norm and RoPE, cs [B, T, Dh/2, 2]), folded
        into the attention's launch."""
        return self._launch(layer, q, k, v, Rope(qw, kw, cs, eps))
