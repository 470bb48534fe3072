"""Audio-encoder calls in a thread pool, for one owner (a session, a REST request).

Encoders are not thread-safe, and cancelling the await of a pool call does not stop its
thread: the call goes on while its owner ends. So calls are awaited shielded (the future
stays "running" until the thread is done), and an encoder is closed only once no call of its
owner is running — at once, or when that call returns.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any

__all__ = ["EncoderCalls"]

log = logging.getLogger(__name__)


class EncoderCalls:
    """One owner's encoder calls: at most one runs at a time (the owner awaits each)."""

    __slots__ = ("_loop", "_pool", "_running")

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: Executor) -> None:
        self._loop = loop
        self._pool = pool
        self._running: asyncio.Future[Any] | None = None

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the pool."""
        running = self._running = self._loop.run_in_executor(self._pool, fn, *args)
        result = await asyncio.shield(running)
        if self._running is running:
            self._running = None
        return result

    def close(self, encoder: Any) -> None:
        """Close `encoder` (None: nothing) once no call is running; errors are logged."""
        if encoder is None:
            return
        running = self._running
        if running is not None and not running.done():  # a pool thread still uses it
            running.add_done_callback(lambda _: _close(encoder))
        else:
            _close(encoder)


def _close(encoder: Any) -> None:
    try:
        encoder.close()
    except Exception:  # closing a half-written stream must not fail its owner
        log.debug("encoder close failed", exc_info=True)
