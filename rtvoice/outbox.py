"""A session's outgoing events, bounded: a FIFO by queued audio bytes and by queued events
(any kind: a client sending cancels or bad frames without reading must not grow it either),
with removal (for cancel) and a held-back side queue (``done`` events before ``ready``).
A bound that overflows raises `SlowReader`: the client cannot keep up (or is abusive) and is
dropped; nothing the engine does ever waits for a client."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rtvoice.turns import Segment, Utterance

__all__ = ["CLOSE", "Out", "Outbox", "SlowReader"]


class SlowReader(Exception):
    """The client is not reading fast enough: a send or encode bound overflowed. `limit`
    names the bound (an option name) for the metrics."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(slots=True, eq=False)
class Out:
    """An outbox item. Audio and ``done`` are completed at send time (seq, offset, TTFA)."""

    event: Any = None  # a ServerEvent, or None for audio/done
    utterance: Utterance | None = None
    data: bytes = b""
    duration_s: float = 0.0
    is_done: bool = False
    first_of: tuple[Segment, ...] = ()  # segments whose first audio this chunk carries
    segment: Segment | None = None  # a ``segment`` event (timestamps) of this utterance


CLOSE: Final = Out()  # the sender's last item: close the socket


class Outbox:
    def __init__(self, max_bytes: int, max_events: int) -> None:
        self._q: deque[Out] = deque()
        self._held: deque[Out] = deque()
        self._bytes = 0
        self._max = max_bytes
        self._max_events = max_events
        self._ready = asyncio.Event()

    @property
    def queued_bytes(self) -> int:
        """Audio bytes waiting for the socket."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._q) + len(self._held)

    def put(self, item: Out, *, hold: bool = False, force: bool = False) -> None:
        """Queue ``item`` (``hold``: in the side queue, until :meth:`release`). Raises
        ``SlowReader`` once a bound is exceeded; ``force`` (the last events of a session,
        after the queue was cleared or drained) skips the bounds."""
        if hold:
            self._held.append(item)
        else:
            self._q.append(item)
            self._ready.set()
        self._bytes += len(item.data)
        if force:
            return
        if self._bytes > self._max:
            raise SlowReader(
                f"the client is not reading its audio: {self._bytes} bytes are queued "
                f"(limit {self._max})", "send_queue_bytes")
        if len(self) > self._max_events:
            raise SlowReader(
                f"the client is not reading its events: {len(self)} are queued "
                f"(limit {self._max_events})", "send_queue_events")

    def release(self) -> None:
        """Move the held-back items to the end of the queue, in order."""
        if self._held:
            self._q.extend(self._held)
            self._held.clear()
            self._ready.set()

    async def get(self) -> Out:
        while not self._q:
            self._ready.clear()
            await self._ready.wait()
        item = self._q.popleft()
        self._bytes -= len(item.data)
        return item

    def purge(self, keep: Callable[[Out], bool]) -> None:
        self._q = deque(i for i in self._q if keep(i))
        self._held = deque(i for i in self._held if keep(i))
        self._bytes = sum(len(i.data) for i in self._q)

    def clear(self) -> None:
        self.purge(lambda _: False)
