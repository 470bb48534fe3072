"""What every CUDA-graph capture in the engine needs around it.

A capture fails ("operation not permitted when stream is capturing") if anything frees a
CUDA graph while it runs; the usual culprit is Python's cyclic garbage collector collecting
an earlier engine's graphs at an allocation inside the capture. So: collect first, then keep
the collector off until the capture is over.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
