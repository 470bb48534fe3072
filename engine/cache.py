"""KV storage for the slow AR (per-sequence slots) and the fast AR (one frame's 10 positions),
and the `Attend` objects through which the model's attention layers reach it.

Slots: each live sequence owns one row of the cache for its whole life (voice prompt, turns,
generated frames), so a session keeps its context between turns without re-prefill. The
last row is a scratch slot that padded batch rows write into. Which sequence owns which row
is the scheduler's business (engine/scheduler.py), not the cache's.

The one-position attends (decode) take an optional `kernel`: csrc's decode_attention, which
stores the new k/v and attends in one launch (engine/ops.py decides); without it they write
and run the model's attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .config import ModelConfig, TransformerConfig
from .model import explicit_attention, gqa_attention

Kernel = Callable[..., Tensor] | None  # engine.kernels.decode_attention.decode_attention


class SlowKVCache:
    def __init__(self, cfg: TransformerConfig, n_slots: int, max_len: int, *,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        self.n_slots, self.max_len = n_slots, max_len
        shape = (cfg.n_layer, n_slots + 1, cfg.n_local_heads, max_len, cfg.head_dim)
        # k, v: [L, slots+1, Hkv, S, Dh]; slot n_slots is the scratch row for padding.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def slot_bytes(cfg: TransformerConfig, max_len: int, dtype: torch.dtype) -> int:
        """Bytes of one slot's keys and values over `max_len` positions, all layers."""
        return 2 * cfg.n_layer * cfg.n_local_heads * max_len * cfg.head_dim * dtype.itemsize

    @property
    def scratch(self) -> int:
        return self.n_slots


class PrefillAttend:
    """Causal attention for one sequence's chunk at positions [start, start+T)."""

    def __init__(self, cache: SlowKVCache, slot: int, start: int, length: int) -> None:
        if start + length > cache.max_len:
            raise ValueError(f"sequence would reach {start + length} positions, over the "
                             f"cache's {cache.max_len}")
        self.cache, self.slot, self.start, self.end = cache, slot, start, start + length
        q_pos = torch.arange(start, self.end, device=cache.k.device)
        k_pos = torch.arange(self.end, device=cache.k.device)
        self.mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, T, S]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[layer, self.slot, :, self.start:self.end] = k[0]
        c.v[layer, self.slot, :, self.start:self.end] = v[0]
        keys = c.k[layer, self.slot: self.slot + 1, :, : self.end]
        vals = c.v[layer, self.slot: self.slot + 1, :, : self.end]
        return gqa_attention(q, keys, vals, self.mask)


class BatchedPrefillAttend:
    """Causal attention for several sequences' chunks at once, padded to T columns.

    Row n holds `lengths[n]` columns at positions starts[n].. of slot slots[n]; padded
    columns neither write the cache nor matter (they attend to position 0 only)."""

    def __init__(self, cache: SlowKVCache, slots: list[int], starts: list[int],
                 lengths: list[int], T: int) -> None:
        d = cache.k.device
        ends = [s + n for s, n in zip(starts, lengths)]
        if max(ends) > cache.max_len:
            raise ValueError(f"a sequence would reach {max(ends)} positions, over the cache's "
                             f"{cache.max_len}")
        self.cache, self.end = cache, max(ends)
        self.slots = torch.tensor(slots, device=d)
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
        self.w_slot = self.slots[:, None].expand_as(self.valid)[self.valid]  # [n_valid]
        self.w_pos = q_pos[self.valid]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[layer, self.w_slot, :, self.w_pos] = k.transpose(1, 2)[self.valid]
        c.v[layer, self.w_slot, :, self.w_pos] = v.transpose(1, 2)[self.valid]
        keys = c.k[layer, self.slots, :, : self.end]  # [N, Hkv, S, Dh]
        vals = c.v[layer, self.slots, :, : self.end]
        return gqa_attention(q, keys, vals, self.mask)


class SlotPrefillAttend:
    """N sequences' chunks of T columns, row n at positions[n, 0..T-1] of slot slots[n]
    ([N] int64), with every index a device tensor, so a whole prefill forward can be captured
    as a CUDA graph. Chunks may be padded (extra columns, or whole rows on the scratch slot):
    padding writes k/v at positions past a sequence's end, which are written again before
    anything reads them. Keys are read over [0, span)."""

    def __init__(self, cache: SlowKVCache, slots: Tensor, positions: Tensor, span: int) -> None:
        self.cache, self.slots, self.positions, self.span = cache, slots, positions, span
        k_pos = torch.arange(span, device=positions.device)
        self.mask = (k_pos[None, None, :] <= positions[:, :, None])[:, None]  # [N, 1, T, span]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        rows = self.slots[:, None]  # [N, 1], broadcast against positions [N, T]
        c.k[layer, rows, :, self.positions] = k.transpose(1, 2)  # [N, T, Hkv, Dh]
        c.v[layer, rows, :, self.positions] = v.transpose(1, 2)
        keys = c.k[layer, :, :, : self.span].index_select(0, self.slots)  # [N, Hkv, span, Dh]
        vals = c.v[layer, :, :, : self.span].index_select(0, self.slots)
        return gqa_attention(q, keys, vals, self.mask)


class DenseDecodeAttend:
    """One new position per row, rows 0..B-1 being slots 0..B-1: row b writes its k/v at
    (wslots[b], positions[b]) and attends to [0, positions[b]] of slot b, read in place."""

    def __init__(self, cache: SlowKVCache, B: int, wslots: Tensor, positions: Tensor,
                 span: int, kernel: Kernel = None) -> None:
        self.cache, self.B, self.wslots, self.positions, self.span = cache, B, wslots, positions, span
        self.kernel = kernel
        k_pos = torch.arange(span, device=positions.device)
        self.mask = (k_pos[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, S]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        if self.kernel is not None:  # write + attend in one csrc launch
            return self.kernel(q[:, :, 0], k[:, :, 0], v[:, :, 0], c.k[layer], c.v[layer],
                               self.wslots, self.positions, self.span)[:, :, None]
        c.k[layer, self.wslots, :, self.positions] = k[:, :, 0]
        c.v[layer, self.wslots, :, self.positions] = v[:, :, 0]
        keys = c.k[layer, : self.B, :, : self.span]  # [B, Hkv, S, Dh], a view
        vals = c.v[layer, : self.B, :, : self.span]
        return gqa_attention(q, keys, vals, self.mask)


class FastKV:
    """The fast AR's cache: 10 positions, rewritten from position 0 for every frame."""

    def __init__(self, cfg: ModelConfig, batch: int, *, device: torch.device | str,
                 dtype: torch.dtype, kernel: Kernel = None) -> None:
        f = cfg.fast
        self.kernel = kernel
        shape = (f.n_layer, batch, f.n_local_heads, cfg.num_codebooks, f.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        n = cfg.num_codebooks
        self._masks = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        # for the csrc kernel: row b writes row b at position p
        self._rows = torch.arange(batch, device=device)
        self._pos = torch.arange(n, device=device)[:, None].expand(n, batch).contiguous()

    def at(self, pos: int, batch: int) -> FastKV:
        self.pos, self.batch = pos, batch
        return self

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p, b = self.pos, self.batch
        if self.kernel is not None:
            return self.kernel(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.k[layer], self.v[layer],
                               self._rows[:b], self._pos[p, :b], p + 1)[:, :, None]
        self.k[layer, :b, :, p] = k[:, :, 0]
        self.v[layer, :b, :, p] = v[:, :, 0]
        mask = self._masks[p: p + 1, : p + 1][None, None]  # [1, 1, 1, p+1]
        return explicit_attention(q, self.k[layer, :b, :, : p + 1], self.v[layer, :b, :, : p + 1],
                                  mask)
