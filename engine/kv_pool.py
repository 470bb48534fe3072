"""The host side of the paged KV pool: which blocks are free, how many holders each block
has (sessions sharing a voice prefix hold the same blocks), and the shared voice prefixes
themselves. Pure bookkeeping — the tensors live in engine/cache.py, the decisions (who gets
blocks, who is evicted) in engine/scheduler.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor


def table_width(max_len: int, block_size: int) -> int:
    """Entries of a block table: max_len positions, plus one block for the look-ahead of a
    decode step."""
    return -(-max_len // block_size) + 1


class BlockPool:
    """`n_blocks` blocks of `block_size` positions; a block is free when nothing holds it."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of one position, got "
                             f"{n_blocks} blocks of {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: low ids handed out first
        self._refs = [0] * n_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold positions [0, positions)."""
        return -(-max(0, positions) // self.block_size)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh blocks (one holder each), or None when fewer than n are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder of each block."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} shared while free")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> int:
        """One holder fewer of each block; returns how many became free."""
        freed = 0
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} released while free")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def holders(self, block: int) -> int:
        return self._refs[block]


def prompt_key(cols: Tensor) -> str:
    """Identity of a voice prompt's columns [1+K, n]: equal keys mean equal KV."""
    data = cols.contiguous().numpy().tobytes()
    return f"{tuple(cols.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


@dataclass(slots=True)
class Prefix:
    blocks: list[int]  # the pool holds one reference on each for this entry
    length: int  # positions of the voice prompt


class PrefixCache:
    """Voice prompts already in the pool, by `prompt_key`, least recently used first. A new
    session with a known prompt shares the blocks (copy-on-write for the last, partly
    filled one) instead of prefilling them."""

    def __init__(self, pool: BlockPool, max_entries: int) -> None:
        self.pool = pool
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Prefix] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Prefix | None:
        p = self._entries.get(key)
        if p is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return p

    def add(self, key: str, blocks: list[int], length: int) -> None:
        """Keep a session's freshly prefilled voice prompt (its first blocks) for others."""
        if self.max_entries == 0 or key in self._entries:
            return
        n = self.pool.blocks_for(length)
        kept = blocks[:n]
        self.pool.share(kept)
        self._entries[key] = Prefix(kept, length)
        while len(self._entries) > self.max_entries:
            self.drop_oldest()

    def drop_oldest(self) -> int:
        """Forget the least recently used prefix; returns the blocks that became free (those
        no session holds)."""
        if not self._entries:
            return 0
        _, p = self._entries.popitem(last=False)
        return self.pool.release(p.blocks)

    def unused_blocks(self) -> int:
        """Blocks only the cache holds (dropping their entries would free them); safe to call
        from another thread (a snapshot)."""
        return len({b for p in list(self._entries.values()) for b in p.blocks
                    if self.pool.holders(b) == 1})

    def drop_unused(self) -> int:
        """Forget the least recently used prefix that no session shares; returns the blocks
        freed (0: none was unused)."""
        for key, p in self._entries.items():
            if all(self.pool.holders(b) == 1 for b in p.blocks):
                del self._entries[key]
                return self.pool.release(p.blocks)
        return 0

    def clear(self) -> None:
        while self._entries:
            self.drop_oldest()
