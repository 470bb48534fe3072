"""Prefill as CUDA graphs, so a chunk of prompt columns costs one replay instead of ~1,000
kernel launches from Python (the host time that bounded TTFA).

- One sequence: a graph per (columns bucket, span bucket); a turn's text or a voice-prompt
  chunk is padded to the next columns bucket and reads keys over the next span bucket.
- N sequences: short chunks (turn texts, <= `BATCHED_COLS` columns) of up to `batch`
  sequences in one replay, grouped by start position, keys over the span bucket that holds
  the group's rows, padding rows on the scratch block: a burst of turns (every session of a
  server starting to speak) takes a few replays.

Padded columns write k/v past a sequence's end, where everything is written again before
it is read (runner.prefill_static). Graphs are captured against the scratch block; inputs
go through per-graph device buffers filled from fresh pinned host tensors on the caller's
stream (the prefill thread's), then the graph is replayed there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import staging
from .capture import bucket, buckets, capture_graphs
from .runner import ModelRunner

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (rows, columns, span)
Chunk = tuple[tuple[int, ...], Tensor, int]  # (blocks, cols [1+K, n], start position)


class PrefillGraphs:
    BATCHED_COLS = 64  # chunks up to this many columns are prefilled N at a time

    def __init__(self, runner: ModelRunner, *, chunk: int, batch: int, spans: list[int]) -> None:
        self.runner = runner
        self.spans = spans  # ascending; the last is the whole context
        # 24 and 48 for turn texts: a batched replay is compute-bound (16 x 64 columns cost
        # 18.4 ms vs 11.2 for 16 x 32 on the H200), and a typical turn is 30-48 columns
        self.cols = buckets((8, 16, 24, 32, 48, 64, 128, 256), chunk)
        self.rows = buckets((2, 4, 8, 16, 32), batch) if batch > 1 else []
        self.graphs: dict[Key, tuple[Any, dict[str, Tensor]]] = {}
        self.capture_s = 0.0

    def __len__(self) -> int:
        return len(self.graphs)

    def keys(self) -> list[Key]:
        """Every graph this set captures."""
        keys = [(1, T, span) for T in self.cols for span in self.spans if T <= span]
        keys += [(N, T, span) for N in self.rows for T in self.cols if T <= self.BATCHED_COLS
                 for span in self.spans if T <= span]
        return keys

    def capture(self, side: torch.cuda.Stream | None = None, keys: list[Key] | None = None, *,
                stop: Callable[[], bool] | None = None,
                captured: Callable[[Key], None] | None = None) -> None:
        """Warm and capture `keys` (default: every key) on `side`: the stream that will
        replay the graphs, or one that nothing else uses (cuBLAS's per-stream workspace is
        baked into each graph). Each graph is used from the moment it is captured."""
        t0 = time.perf_counter()
        r = self.runner
        keys = self.keys() if keys is None else list(keys)
        side = side if side is not None else torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm every shape once: nothing compiles inside a capture
            for N, T, span in keys:
                if stop is not None and stop():
                    return
                r.prefill_static(r.prefill_inputs(T, N), span)

        def install(key: Key, entry: tuple[Any, dict[str, Tensor], Any]) -> None:
            self.graphs[key] = (entry[0], entry[1])
            if captured is not None:
                captured(key)

        capture_graphs(side, sorted(keys, key=lambda k: k[0] * k[1] * k[2], reverse=True),
                       lambda key: r.prefill_inputs(key[1], key[0]),  # largest first
                       lambda key, inp: r.prefill_static(inp, key[2]), stop=stop, captured=install)
        self.capture_s += time.perf_counter() - t0
        log.info("captured %d of %d prefill graphs (columns %s; batches of %s) in %.1fs",
                 len(self.graphs), len(self.keys()), self.cols, self.rows,
                 time.perf_counter() - t0)

    def _span(self, end: int) -> int | None:
        """The smallest span bucket holding positions [0, end); None past the cache."""
        return bucket(self.spans, end)

    def plan(self, items: list[Chunk]) -> tuple[list[tuple[Key, list[Chunk]]], list[Chunk]]:
        """Split one round's chunks into graph replays (key, its chunks) and the rest (for
        the eager batched prefill)."""
        if not self.graphs:
            return [], items
        full = self.spans[-1]
        replays: list[tuple[Key, list[Chunk]]] = []
        eager: list[Chunk] = []
        short: list[tuple[int, Chunk]] = []
        for it in items:
            n, start = it[1].shape[1], it[2]
            T = bucket(self.cols, n)
            if T is None:
                eager.append(it)
                continue
            # a group replays at its widest chunk's columns (up to BATCHED_COLS): a chunk
            # may join one only if that many columns from its start still fit the cache
            if self.rows and T <= self.BATCHED_COLS and start + self.BATCHED_COLS <= full:
                short.append((T, it))
                continue
            span = self._span(start + T)
            if span is None:  # the padded chunk would run past the cache
                eager.append(it)
            else:
                replays.append(((1, T, span), [it]))
        if len(short) == 1:  # alone: the single-sequence graph with the smallest span
            T, it = short[0]
            replays.append(((1, T, self._span(it[2] + T)), [it]))
        elif short:
            # groups of neighbouring start positions, each reading keys over the smallest span
            # that holds its rows (a group over the whole context would read every row's
            # keys up to max_len: at 4,096 positions most of a round's memory traffic)
            most = self.rows[-1]
            short.sort(key=lambda ti: ti[1][2])
            for k in range(0, len(short), most):
                group = short[k: k + most]
                N = bucket(self.rows, len(group))
                assert N is not None
                T = max(t for t, _ in group)
                span = self._span(max(it[2] for _, it in group) + T)
                replays.append(((N, T, span), [it for _, it in group]))
        return [r for key, chunks in replays for r in self._captured(key, chunks, eager)], eager

    def _captured(self, key: Key, chunks: list[Chunk], eager: list[Chunk],
                  ) -> list[tuple[Key, list[Chunk]]]:
        """`key`'s replay if its graph is in; else the chunks in groups of the largest
        captured row count at the same (columns, span) — graphs still being captured in the
        background (engine/warmup.py) — or, with none, eager."""
        if key in self.graphs:
            return [(key, chunks)]
        _, T, span = key
        fits = [n for n in (1, *self.rows) if n < key[0] and (n, T, span) in self.graphs]
        if not fits:
            eager.extend(chunks)
            return []
        n = fits[-1]
        return [((n, T, span), chunks[k: k + n]) for k in range(0, len(chunks), n)]

    def replay(self, key: Key, chunks: list[Chunk]) -> None:
        g, inp = self.graphs[key]
        N, T, _ = key
        host = staging.host((N, self.runner.cfg.frame_rows, T), torch.long, self.runner.device)
        cache = self.runner.cache
        tables = [cache.table([])] * N  # padding rows: all scratch, position 0
        starts = [0] * N
        for i, (blocks, cols, start) in enumerate(chunks):
            host[i, :, : cols.shape[1]] = cols
            tables[i], starts[i] = cache.table(list(blocks)), start
        staging.stage(inp["cols"], host)
        staging.stage(inp["table"], tables)
        staging.stage(inp["start"], starts)
        g.replay()
