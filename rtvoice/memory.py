"""Giving freed heap memory back to the operating system.

glibc's malloc keeps memory freed by short-lived large buffers (audio chunks, encoder
buffers, per-step tensors on a CPU) in its heaps and arenas, and raises its mmap threshold
as it goes: a server's RSS then ratchets up to its worst moment and stays there.
``malloc_trim(0)`` hands the free pages back. :func:`trim_loop` calls it every few seconds
in a worker thread; elsewhere (macOS, musl) it is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

__all__ = ["heap_trimmer", "trim_loop"]

log = logging.getLogger(__name__)


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` as a callable (1: memory was released), or None where the
    C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


async def trim_loop(interval_s: float) -> None:
    """Trim the heap every `interval_s` seconds until cancelled (nothing when unsupported)."""
    trim = heap_trimmer()
    if trim is None:
        log.info("malloc_trim is not available here: freed heap memory stays with the process")
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)
