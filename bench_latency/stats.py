"""Pure statistics for the latency bench: percentiles, playback simulation, regression gate.

Nothing here does I/O or reads a clock, so every function can be checked on synthetic data
whose answer is known (tests/test_bench.py does exactly that).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "GateResult",
    "GateRow",
    "PlaybackResult",
    "gaps",
    "gate_compare",
    "percentile",
    "simulate_playback",
    "summarize",
]

# Arrival times and durations are floats from clocks and codecs; an arrival "exactly on time"
# must not count as a starvation because of rounding in the last bit.
_EPS = 1e-9


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (NumPy's default "linear" method). ``None`` for no values: an empty level must show as
    missing, never as a zero latency."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None], *, ndigits: int | None = 3) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of the non-None values (all None when empty)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]

    def r(x: float | None) -> float | None:
        return None if x is None or ndigits is None else round(x, ndigits)

    if not xs:
        return {"n": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None,
                "max": None}
    return {
        "n": len(xs),
        "mean": r(sum(xs) / len(xs)),
        "min": r(min(xs)),
        "p50": r(percentile(xs, 50)),
        "p90": r(percentile(xs, 90)),
        "p99": r(percentile(xs, 99)),
        "max": r(max(xs)),
    }


def gaps(arrivals: Sequence[float]) -> list[float]:
    """Time between consecutive chunk arrivals (same unit as the input)."""
    return [b - a for a, b in itertools.pairwise(arrivals)]


@dataclass(frozen=True, slots=True)
class PlaybackResult:
    underruns: int  # times the player found its buffer empty while audio was still to come
    stall_s: float  # total time spent starved (waiting for the late chunk)
    start_s: float | None  # when playback started (first arrival + jitter buffer)
    end_s: float | None  # when the last sample finished playing
    audio_s: float  # audio played
    stalls: tuple[tuple[float, float], ...] = field(default=())  # (when, how long) per underrun


def simulate_playback(
    chunks: Sequence[tuple[float, float]], jitter_buffer_s: float = 0.0
) -> PlaybackResult:
    """Play a stream in real time and count the times it would starve.

    ``chunks`` are ``(arrival_s, duration_s)`` in stream order. Playback starts
    ``jitter_buffer_s`` after the first arrival and consumes audio at 1 s per second. When
    the next chunk has not arrived by the time the previous one has finished playing, that is
    one underrun; the player then waits for the chunk and, like a real jitter buffer,
    re-buffers ``jitter_buffer_s`` before resuming. A chunk arriving exactly when it is needed
    is on time.
    """
    if jitter_buffer_s < 0:
        raise ValueError("jitter_buffer_s must be >= 0")
    if not chunks:
        return PlaybackResult(0, 0.0, None, None, 0.0)
    clock = chunks[0][0] + jitter_buffer_s  # when the next chunk must start playing
    start = clock
    underruns = 0
    stall = 0.0
    stalls: list[tuple[float, float]] = []
    audio = 0.0
    for i, (arrival, duration) in enumerate(chunks):
        if duration < 0:
            raise ValueError(f"chunk {i} has a negative duration")
        if i > 0 and arrival > clock + _EPS:
            underruns += 1
            resume = arrival + jitter_buffer_s
            stalls.append((clock, resume - clock))
            stall += resume - clock
            clock = resume
        clock += duration
        audio += duration
    return PlaybackResult(underruns, stall, start, clock, audio, tuple(stalls))


@dataclass(frozen=True, slots=True)
class GateRow:
    concurrency: int
    baseline: float
    current: float | None
    ratio: float | None  # current / baseline
    ok: bool


@dataclass(frozen=True, slots=True)
class GateResult:
    passed: bool
    tolerance: float
    rows: tuple[GateRow, ...]
    missing: tuple[int, ...]  # levels in the baseline that the run did not measure

    def describe(self) -> str:
        lines = [f"decode_tps gate (tolerance {self.tolerance:.1%}): "
                 f"{'PASS' if self.passed else 'FAIL'}"]
        for r in self.rows:
            cur = "n/a" if r.current is None else f"{r.current:.1f}"
            ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
            lines.append(f"  c={r.concurrency:<4} baseline {r.baseline:.1f}  now {cur}  "
                         f"ratio {ratio}  {'ok' if r.ok else 'REGRESSION'}")
        if self.missing:
            lines.append(f"  not measured in this run: {', '.join(map(str, self.missing))}")
        return "\n".join(lines)


def gate_compare(
    current: Mapping[int, float | None], baseline: Mapping[int, float], tolerance: float = 0.05
) -> GateResult:
    """Compare per-level decode_tps with a frozen baseline.

    A level regresses when ``current < baseline * (1 - tolerance)``; a level present in both
    with no current figure (every turn failed) regresses too. Levels only in the baseline are
    reported as missing but do not fail the gate (a quick run may measure fewer levels); a
    gate that compared nothing at all fails, since it would otherwise pass vacuously.
    """
    if not 0.0 <= tolerance < 1.0:
        raise ValueError("tolerance must be in [0, 1)")
    rows: list[GateRow] = []
    missing: list[int] = []
    for c in sorted(baseline):
        base = float(baseline[c])
        if c not in current:
            missing.append(c)
            continue
        cur = current[c]
        if cur is None:
            rows.append(GateRow(c, base, None, None, False))
            continue
        ratio = cur / base if base > 0 else math.inf
        rows.append(GateRow(c, base, float(cur), ratio, cur >= base * (1.0 - tolerance) - _EPS))
    passed = bool(rows) and all(r.ok for r in rows)
    return GateResult(passed, tolerance, tuple(rows), tuple(missing))
