"""The capacity search of `bench-latency --capacity`: the largest number of concurrently
speaking streams a server holds within a TTFA bound with no underruns, found by probing
levels — doubling until a level fails, then bisecting between the last pass and the first
failure down to a resolution. Sans I/O: `probe(c)` runs one level (the caller's bench) and
returns its summary; the verdict on a level is `passes`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Criteria:
    ttfa_p99_ms: float = 300.0  # the bound on TTFA p99 (server-side where reported)
    max_underruns: int = 0  # with the bench's jitter buffer

    def verdict(self, level: dict[str, Any]) -> tuple[bool, str]:
        """Whether a level's summary passes, and why (or why not)."""
        t = level["turns"]
        if not t["ok"] or t["errors"]:
            return False, f"{t['errors']} of {t['total']} turns failed ({', '.join(t['error_codes'])})"
        ttfa = level["server_ttfa_ms"]["p99"]
        which = "server"
        if ttfa is None:
            ttfa, which = level["client_ttfa_ms"]["p99"], "client"
        if ttfa is None:
            return False, "no TTFA measured"
        under = level["underruns"]["total"]
        if ttfa > self.ttfa_p99_ms:
            return False, f"{which} TTFA p99 {ttfa:.0f} ms > {self.ttfa_p99_ms:g} ms"
        if under > self.max_underruns:
            return False, f"{under} underruns > {self.max_underruns}"
        return True, f"{which} TTFA p99 {ttfa:.0f} ms, {under} underruns"


@dataclass(slots=True)
class Search:
    capacity: int = 0  # the largest passing level (0: none passed)
    first_failure: int | None = None  # the smallest failing level probed
    probes: list[dict[str, Any]] = field(default_factory=list)  # in the order run

    def as_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "first_failure": self.first_failure,
                "probes": self.probes}


async def search(probe: Callable[[int], Awaitable[dict[str, Any]]], criteria: Criteria, *,
                 start: int = 1, max_c: int = 1024, resolution: int = 1,
                 on_probe: Callable[[int, bool, str], None] | None = None) -> tuple[Search, list[dict[str, Any]]]:
    """Probe levels (start, 2*start, ... up to max_c; then bisect) and return the search with
    every probed level's summary (in probe order)."""
    if start < 1 or max_c < start or resolution < 1:
        raise ValueError(f"capacity search needs 1 <= start <= max ({start}, {max_c}) and "
                         f"resolution >= 1 ({resolution})")
    result, levels = Search(), []

    async def run(c: int) -> bool:
        level = await probe(c)
        ok, why = criteria.verdict(level)
        levels.append(level)
        result.probes.append({"concurrency": c, "passed": ok, "why": why})
        if on_probe is not None:
            on_probe(c, ok, why)
        if ok:
            result.capacity = max(result.capacity, c)
        elif result.first_failure is None or c < result.first_failure:
            result.first_failure = c
        return ok

    c = start
    while True:  # grow
        if not await run(c):
            break
        if c == max_c:
            return result, levels
        c = min(2 * c, max_c)
    lo, hi = result.capacity, c  # lo passed (0: nothing did), hi failed
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        if await run(mid):
            lo = mid
        else:
            hi = mid
    return result, levels
