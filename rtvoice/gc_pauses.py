"""Keeping CPython's cyclic garbage collector out of the audio path.

Every pass of the cyclic collector holds the GIL: while it runs, no engine thread launches a
decode step or plans a codec tick, and no chunk goes to a socket — every stream stalls at
once. A full pass (generation 2) scans every container object alive, and a server holds
many: the model's modules, compiled kernels, CUDA graphs, the libraries' own (306k objects
with the tiny model on the 2-core CPU, where one full pass took ~100 ms; more on a GPU with
its graphs and compiled code). Under load every decode step makes objects (its frames), so
full passes come by themselves every few seconds. On the H200 a capacity run (128 streams)
saw one ~0.5 s silence in every stream at the same moment, the signature of such a stall.

`freeze` moves every object alive into the permanent generation, which the collector never
scans (``gc.freeze``): the runtime calls it once the engine is ready (after a full
collection, before serving) and again when the background graph captures are in (without
one: traffic flows by then). Objects made later — sessions, turns, frames — are collected as
before. `GcWatch` times every pass (``gc.callbacks``) for ``/metrics`` and warns about a
pass longer than `warn_s`.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

__all__ = ["GcWatch", "freeze", "unfreeze"]

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0  # at most one warning per this many seconds


def freeze(*, collect: bool) -> int:
    """Every object alive into the permanent generation (after a full collection when
    `collect`: a pass that stops every thread, so only before serving). Returns how many
    objects are frozen now."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Back to the collected generations (a stopped runtime: what it froze may be garbage
    now, and the process may go on, e.g. a test run)."""
    gc.unfreeze()


class GcWatch:
    """Times the collector's passes per generation: count, total and longest seconds."""

    def __init__(self, warn_s: float) -> None:
        self.warn_s = warn_s
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._t0: float | None = None
        self._warned_at = float("-inf")

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collector, on whichever thread triggered it: cheap, never raises
        now = time.perf_counter()
        if phase == "start":
            self._t0 = now
            return
        if self._t0 is None:
            return
        dt, self._t0 = now - self._t0, None
        g = min(max(int(info.get("generation", 0)), 0), 2)
        self.passes[g] += 1
        self.seconds[g] += dt
        self.longest[g] = max(self.longest[g], dt)
        if self.warn_s and dt > self.warn_s and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            # (no count of the tracked objects here: listing them would lengthen the pause)
            log.warning("garbage collection (generation %d) held every thread for %.0f ms: "
                        "audio of every stream may have a gap; %d objects frozen (the service "
                        "freezes its start-up objects unless --no-gc-freeze)",
                        g, dt * 1000, gc.get_freeze_count())

    def snapshot(self) -> dict[str, list[float] | list[int] | int]:
        return {"passes": list(self.passes), "seconds": list(self.seconds),
                "longest": list(self.longest), "frozen": gc.get_freeze_count()}
