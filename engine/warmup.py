"""Graphs captured after the engine is ready: the buckets light traffic needs are captured
before the engine serves (engine.py), the rest here, on a background thread, while it
serves; a bucket runs eagerly until its graph is in.

Why it is safe to capture next to live traffic (engine/capture.py has the general rules):
- a family's deferred graphs are warmed and captured on a stream of their own that nothing
  else ever launches into, so the cuBLAS workspace baked into them (per stream) is used by
  no other work, and they replay, like the family's other graphs, one at a time on the
  family's worker stream;
- the captures touch only scratch state (the KV pool's scratch block, the codec's scratch
  state row), which live work never reads for a real row;
- captures run in CUDA's thread-local capture mode, so the workers' own launches, copies
  and allocations on other threads go on during a capture.

The decode step's deferred graphs are captured by the decode thread itself: a capture sets
every decode row inactive for a moment (their state is kept and put back), which only the
thread that launches steps may do, between two steps, and only while decoding may pause:
nothing prefills or waits, and every speaking turn's audio is far enough ahead of playback
to sit out the capture (engine.py hands each graph over; this thread comes back to those
not taken within a second). All batch sizes are warmed (compiled)
before the engine is ready, so a batch whose graph is not in yet runs eagerly at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# capture(keys, stop, captured): warm and capture `keys` in order, calling captured(key) after
# each graph is in use and returning early once stop() is true
CaptureFn = Callable[[Sequence[Hashable], Callable[[], bool], Callable[[Hashable], None]], None]


@dataclass(slots=True)
class Family:
    """One family's deferred graphs (decode worker, prefill, codec) and its progress."""

    name: str
    keys: list[Hashable]
    capture: CaptureFn
    done: int = 0
    error: str | None = None
    seconds: float = 0.0

    @property
    def pending(self) -> int:
        return len(self.keys) - self.done


@dataclass
class BackgroundCapture:
    """Captures the families' deferred graphs in order, on one thread (`start`) or on the
    caller's (`run`). `status()` is what /ready reports while graphs are still warming."""

    families: list[Family] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ran: bool = False

    def add(self, name: str, keys: Sequence[Hashable], capture: CaptureFn) -> None:
        if keys:
            self.families.append(Family(name, list(keys), capture))

    @property
    def started(self) -> bool:
        """`start` or `run` was called (the graphs are being or were captured)."""
        return self._thread is not None or self._ran

    @property
    def pending(self) -> int:
        """Graphs not captured yet (a failed family's count as pending: they stay eager)."""
        return sum(f.pending for f in self.families)

    def status(self) -> dict[str, dict[str, object]]:
        """{family: {captured, total[, error]}} of every family not fully captured."""
        out: dict[str, dict[str, object]] = {}
        for f in self.families:
            if f.pending:
                out[f.name] = {"captured": f.done, "total": len(f.keys)}
                if f.error is not None:
                    out[f.name]["error"] = f.error
        return out

    def start(self) -> None:
        """Capture on a background thread (once; nothing to do: no thread)."""
        with self._lock:
            if self._ran or self._thread is not None:
                return
            if not self.pending:
                self._ran = True
                self._done.set()
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self.run, name="rtvoice-capture", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Capture every pending family on this thread. A family that fails is logged and
        left eager; the others still run. Runs once: later calls return at once."""
        with self._lock:
            if self._ran:
                return
            self._ran = True
        t0 = time.perf_counter()
        try:
            for f in self.families:
                log.info("capturing %d more %s graphs in the background", len(f.keys), f.name)
                self._capture(f)
            # a family that returned with keys left waits for a better moment (the decode
            # family: a quiet one); come back to it until every graph is in
            while True:
                left = [f for f in self.families if f.pending and f.error is None]
                if not left or self._stop.wait(0.1):
                    break
                for f in left:
                    self._capture(f)
            if not self._stop.is_set():
                log.info("background capture done in %.1fs: %s", time.perf_counter() - t0,
                         "every graph in" if not self.pending else f"{self.pending} left eager")
        finally:
            self._done.set()

    def _capture(self, f: Family) -> None:
        """One pass over `f`'s keys not captured yet."""
        if self._stop.is_set():
            return
        t1 = time.perf_counter()

        def captured(_key: Hashable) -> None:
            f.done += 1

        try:
            f.capture(f.keys[f.done:], self._stop.is_set, captured)
        except Exception as e:  # the engine serves on: those buckets stay eager
            f.error = f"{type(e).__name__}: {e}"
            log.error("background capture of the %s graphs failed after %d of %d (%s); "
                      "those buckets keep running eagerly (slower). Restart with "
                      "ready_rows=0 to capture everything before serving",
                      f.name, f.done, len(f.keys), f.error)
        f.seconds += time.perf_counter() - t1
        if not f.error and not f.pending:
            log.info("captured %d %s graphs in the background in %.1fs", f.done, f.name,
                     f.seconds)

    def in_background(self) -> bool:
        """Whether the caller is this capture's own thread (`start`), not one that called
        `run` itself."""
        return threading.current_thread() is self._thread

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background capture has ended; False on timeout (and at once when
        graphs are pending but nothing captures them)."""
        if self._thread is None and not self._ran:
            return not self.pending
        return self._done.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the graph being captured now and join the thread."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("the background capture did not stop within %.0fs", timeout)
