"""What every CUDA-graph capture in the engine needs around it (decode steps, prefill
chunks and codec ticks all go through `capture_graphs`).

A capture fails ("operation not permitted when stream is capturing") if anything frees a
CUDA graph on the capturing thread while it runs; the usual culprit is Python's cyclic
garbage collector collecting an earlier engine's graphs at an allocation inside the capture.
So the collector stays off until the capture is over.

Captures also run next to live traffic (engine/warmup.py), so they wait for nothing but their
own stream: `torch.cuda.graph` would synchronise the device, run a full collection (holding
the GIL every worker needs) and empty the device and pinned-host caches (cudaFree and
cudaFreeHost synchronise the device, and the next step's allocations pay for it again) —
a stall of every stream for a graph that needs none of it.

Each family of graphs is captured on the stream that will replay it: cuBLAS's workspace is
per stream and its address is baked into a captured graph, so families captured on one
stream and replayed concurrently on several would share one workspace.

Graphs have static shapes, so every graphed call is padded to a bucket: `buckets` builds
each family's list, `bucket` picks the one a call runs in.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Run on `stream` (CUDA: a worker's own stream), or nowhere in particular (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def buckets(ladder: Sequence[int], top: int) -> list[int]:
    """The sizes of `ladder` below `top`, then `top` itself: every size up to `top` has a
    bucket, and the largest is exactly the limit."""
    return sorted({*(b for b in ladder if b < top), top})


def bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `n`; None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class _GcPause:
    """Python's cycle collector is process-wide: off while any capture runs (the engine's
    start, a background capture, another engine's), back on when the last one ends."""

    lock = threading.Lock()
    holders = 0
    was_enabled = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    with _GcPause.lock:
        if _GcPause.holders == 0:
            _GcPause.was_enabled = gc.isenabled()
            gc.disable()
        _GcPause.holders += 1
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.holders -= 1
            if _GcPause.holders == 0 and _GcPause.was_enabled:
                gc.enable()


def capture_graphs(side: torch.cuda.Stream, keys: Sequence[Hashable],
                   inputs: Callable[[Any], Any], run: Callable[[Any, Any], Any], *,
                   stop: Callable[[], bool] | None = None,
                   captured: Callable[[Any, tuple[torch.cuda.CUDAGraph, Any, Any]], None]
                   | None = None, pool: tuple[int, int] | None = None
                   ) -> dict[Any, tuple[torch.cuda.CUDAGraph, Any, Any]]:
    """After the caller's eager warm-up on `side` (nothing may compile or autotune inside a
    capture): `run(key, inputs(key))` captured as one CUDA graph per key on `side`, in the
    order given — largest first, so the memory pool the graphs share is sized by the first.
    The inputs are made before each capture (outside its pool). Returns
    {key: (graph, inputs, outputs)}; `captured(key, entry)` hears of each graph as soon as
    it can replay (background captures put it in use then), and `stop()` true ends the
    captures early. `pool`: an earlier capture's memory pool to share (graphs that never
    replay at the same time)."""
    graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any, Any]] = {}
    with gc_paused():
        for key in keys:
            if stop is not None and stop():
                break
            inp = inputs(key)
            side.wait_stream(torch.cuda.current_stream())  # the caller's warm-up and inputs
            g = torch.cuda.CUDAGraph()
            with _capturing(g, side, pool):
                out = run(key, inp)
            pool = g.pool() if pool is None else pool
            graphs[key] = (g, inp, out)
            if captured is not None:
                captured(key, graphs[key])
    side.synchronize()  # a graph replays once its capture (and the memory it took) is done
    return graphs


@contextlib.contextmanager
def _capturing(g: torch.cuda.CUDAGraph, side: torch.cuda.Stream,
               pool: tuple[int, int] | None) -> Iterator[None]:
    """What `torch.cuda.graph` does minus its device-wide waits and cache flushes (module
    docstring): capture on `side`, in CUDA's thread-local mode (other threads' launches go
    on), into `pool` (None: a new one)."""
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            g.capture_end()
