"""CUDA graphs for the whole frame step, applied by the runner (the model stays plain).

One graph per (batch bucket, attention-span bucket): slow AR step, semantic-slice logits,
sampling with RAS, the fast AR across the codebooks. Every batch size up to `max_batch` has a
bucket (the seed's lesson: capping graphs at 24 collapsed throughput at c=32/64). A batch is
padded to its bucket with rows that write into the cache's scratch slot.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import Tensor

from .runner import ModelRunner

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128) if b < max_batch]
    return [*out, max_batch]


def span_buckets(max_len: int, step: int = 512) -> list[int]:
    spans = list(range(step, max_len, step))
    return [*spans, max_len]


class GraphedDecoder:
    """Replays captured decode steps. `decode(slots, cols, positions, span)` has the runner's
    signature and falls back to eager for shapes outside the captured buckets."""

    def __init__(self, runner: ModelRunner, *, max_batch: int | None = None,
                 span_step: int = 512) -> None:
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use the eager runner on CPU")
        self.runner = runner
        self.max_batch = max_batch or runner.cache.n_slots
        self.batches = batch_buckets(self.max_batch)
        self.spans = span_buckets(runner.cache.max_len, span_step)
        d = runner.device
        K1 = runner.cfg.frame_rows
        self.slots = torch.full((self.max_batch,), runner.cache.scratch, dtype=torch.long, device=d)
        self.cols = torch.zeros(self.max_batch, K1, dtype=torch.long, device=d)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=d)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = None
        self.capture_s = 0.0

    def capture(self) -> None:
        t0 = time.perf_counter()
        r = self.runner
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for span in self.spans:  # warm up every kernel configuration once, eagerly
                r.decode(self.slots[:1], self.cols[:1], self.positions[:1], span)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Largest first so the memory pool is sized once and shared by the smaller graphs.
        for span in reversed(self.spans):
            for b in reversed(self.batches):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = r.decode(self.slots[:b], self.cols[:b], self.positions[:b], span)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(b, span)] = (g, out)
        torch.cuda.synchronize()
        # Capturing ran the steps once more on the scratch slot; reset what it touched.
        r.sampling.step[r.cache.scratch] = 0
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batches %s, spans %s) in %.1fs", len(self.graphs),
                 self.batches, self.spans, self.capture_s)

    def decode(self, slots: Tensor, cols: Tensor, positions: Tensor, span: int) -> Tensor:
        n = slots.shape[0]
        bi = bisect.bisect_left(self.batches, n)
        si = bisect.bisect_left(self.spans, span)
        if bi == len(self.batches) or si == len(self.spans):
            return self.runner.decode(slots, cols, positions, span)
        b, s = self.batches[bi], self.spans[si]
        self.slots[:n].copy_(slots, non_blocking=True)
        self.cols[:n].copy_(cols, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if b > n:  # padding rows: scratch slot, position 0
            self.slots[n:b].fill_(self.runner.cache.scratch)
            self.positions[n:b].zero_()
        g, out = self.graphs[(b, s)]
        g.replay()
        return out[:n]
