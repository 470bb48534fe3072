"""Shared voice prefixes in the decode step: which speaking rows begin with the same KV blocks.

Sessions that speak with one stored voice (or identical inline references) hold one copy of
its prompt's KV (engine/kv_pool.py's prefix cache): their block tables begin with the same
block ids. The Triton decode attention can read those positions once per tile of rows instead
of once per row (cascade attention, engine/kernels/decode_attention_triton.py). This module
plans the tiles from the rows' block lists on the host — a row's table changes only at its
row ops (join, extend, leave) — and keeps them in one device buffer that the step's CUDA
graphs read; `refresh` stages a new plan, on the decode stream, before a step that follows
a change.

Only identical block ids count as shared (the pool's copy-on-write gives a row its own copy
of a block before it writes into it), and the kernel never reads a row's prefix at or past
its own position: a plan can only be slower, never wrong, if a row stops sharing between two
refreshes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import staging
from .kernels.decode_attention_triton import PrefixTiles

MAX_GROUPS = 8  # distinct shared prefixes planned at once (each adds a partial tile at most)

Tile = tuple[list[int], int, int]  # (rows, shared positions, the row whose table is read)


def plan(tables: Sequence[Sequence[int]], block_size: int, rows_per_tile: int,
         max_tiles: int, min_blocks: int = 1) -> tuple[list[Tile], list[int]]:
    """tables[r]: row r's block ids ([]: no turn) -> (tiles, start): rows whose tables begin
    with the same block form a group sharing their longest common run of leading blocks (at
    least `min_blocks`), cut into tiles of at most `rows_per_tile` rows (a lone row left
    over reads its prefix itself); start[r] is the first position row r reads on its own
    (its tile's shared positions, else 0). At most `max_tiles` tiles, groups in order of
    their first row; a tile's rows ascending, the one whose table it reads its first."""
    if rows_per_tile < 1 or max_tiles < 0 or block_size < 1 or min_blocks < 1:
        raise ValueError(f"plan: rows_per_tile >= 1, max_tiles >= 0, block_size >= 1, "
                         f"min_blocks >= 1; got {rows_per_tile}, {max_tiles}, {block_size}, "
                         f"{min_blocks}")
    groups: dict[int, list[int]] = {}
    for r, t in enumerate(tables):
        if len(t):
            groups.setdefault(t[0], []).append(r)
    tiles: list[Tile] = []
    start = [0] * len(tables)
    for members in groups.values():
        if len(members) < 2:
            continue
        first = tables[members[0]]
        n = len(first)
        for r in members[1:]:
            t = tables[r]
            n = min(n, len(t))
            i = 0
            while i < n and t[i] == first[i]:
                i += 1
            n = i
        if n < min_blocks:
            continue
        for i in range(0, len(members), rows_per_tile):
            part = members[i: i + rows_per_tile]
            if len(part) < 2 or len(tiles) == max_tiles:
                break
            tiles.append((part, n * block_size, part[0]))
            for r in part:
                start[r] = n * block_size
    return tiles, start


class SharedPrefixes:
    """The rows' block lists (host) and their plan (device, `tiles`) for `n_rows` rows."""

    def __init__(self, n_rows: int, block_size: int, rows_per_tile: int,
                 device: torch.device | str, max_groups: int = MAX_GROUPS) -> None:
        self.block_size, self.rows_per_tile = block_size, rows_per_tile
        self.max_tiles = -(-n_rows // rows_per_tile) + max_groups
        self.tables: list[list[int]] = [[] for _ in range(n_rows)]
        T, RT = self.max_tiles, rows_per_tile
        # one buffer, one copy per refresh: rows [T, RT] | length [T] | src [T] | start [n_rows]
        self._buf = torch.zeros(T * RT + 2 * T + n_rows, dtype=torch.int32, device=device)
        self._buf[: T * RT] = -1
        b = self._buf
        self.tiles = PrefixTiles(rows=b[: T * RT].view(T, RT), length=b[T * RT: T * RT + T],
                                 src=b[T * RT + T: T * RT + 2 * T], start=b[T * RT + 2 * T:])
        self.dirty = False
        self.n_tiles = 0  # in the current plan
        self._start = [0] * n_rows  # the current plan's `start`, on the host

    def set(self, row: int, blocks: Sequence[int]) -> None:
        """Row `row` now has exactly these blocks (a join)."""
        self.tables[row] = list(blocks)
        self.dirty = True

    def extend(self, row: int, index: int, blocks: Sequence[int]) -> None:
        """Row `row`'s entries from `index` on are these blocks (entries skipped in between
        match no other row's). Blocks appended past the row's shared run change no plan (a
        decoding row's every ~64th step): only a rewrite, or a row whose blocks all lie in
        its shared run (it may bound the run), asks for a new one."""
        t = self.tables[row]
        if index < len(t) or len(t) * self.block_size <= self._start[row]:
            self.dirty = True
        if index > len(t):
            t.extend([-2 - row] * (index - len(t)))
        t[index: index + len(blocks)] = list(blocks)

    def clear(self, row: int) -> None:
        """Row `row` speaks no more (a leave)."""
        if self.tables[row]:
            self.tables[row] = []
            self.dirty = True

    def refresh(self) -> None:
        """After a change: plan again and stage the plan into `tiles` on the current stream
        (before the step that reads it; no host sync)."""
        if not self.dirty:
            return
        tiles, start = plan(self.tables, self.block_size, self.rows_per_tile, self.max_tiles)
        T, RT = self.max_tiles, self.rows_per_tile
        rows = [-1] * (T * RT)
        length, src = [0] * T, [0] * T
        for i, (members, n, s) in enumerate(tiles):
            rows[i * RT: i * RT + len(members)] = members
            length[i], src[i] = n, s
        staging.stage(self._buf, rows + length + src + start)
        self.n_tiles, self._start = len(tiles), start
        self.dirty = False
