"""bench-latency: TTFA, throughput and playback underruns of a live TTS server (or the engine
alone) across a concurrency sweep, with a decode_tps regression gate.

    bench-latency --url ws://127.0.0.1:8000/v1/tts/live --concurrency 1,4,16,64 --turns 5 \\
        --json bench.json --plot bench.png --baseline baseline.json --tolerance 0.05
    bench-latency --in-process --model tiny --concurrency 1,2,4,8 --duration 20
    bench-latency --from-json bench.json --baseline baseline.json     # re-gate / re-plot

For each concurrency level, that many sessions are opened (each waits for ``ready``), warmed
with ``--warmup-turns`` unmeasured turns, and then all start measuring together. Each session
runs in its own task like a voice agent: a turn's text is streamed at ``--tokens-per-s``, then
flushed, and the next turn starts when the previous one is done (after ``--pause-ms``:
``--arrivals lockstep``, the default, bursts of c turns), or after an exponential think time
(``--arrivals poisson --mean-gap-s S``: turns arrive as a Poisson process).

``--capacity`` searches the largest concurrency whose TTFA p99 stays within
``--capacity-ttfa-ms`` (300) with no underruns and no errors, doubling from the first
``--concurrency`` value up to ``--capacity-max`` and bisecting to ``--capacity-resolution``;
it prints the probes and the answer, keeps them under ``capacity`` in the JSON, and marks the
bound and the answer on the plot:

    bench-latency --url ws://HOST:PORT/v1/tts/live --capacity --concurrency 16 --turns 2 \\
        --jitter-ms 200 --max-frames 300 --json cap.json --plot cap.png

Figures per level (``--json`` has them all, with the exact settings, the server's ``ready``,
the git commit and the machine):
- client TTFA (flush sent -> first audio byte received, over the turns whose audio came after
  the flush; ``turns.audio_before_flush`` counts the others: the server speaks a sentence as
  soon as it ends, so streamed text can be heard before its flush), first text sent -> first
  audio (every turn), and server TTFA: p50/p90/p99/max;
- aggregate frames/s (all frames / measuring wall time) and per-request decode_tps
  (frames / the server's generation time for that request);
- RTF per request, inter-chunk gap distribution, and underruns: each turn is played back in
  simulation from its first chunk through a ``--jitter-ms`` buffer (``bench_latency.stats``);
- turns ok / errors / cancelled / truncated (hit the frame budget).

``--plot`` needs matplotlib (``pip install matplotlib``): without it the bench says so
at the start, runs, writes its JSON and skips the plot; the exit status does not change.

Exit status: 0 ok, 1 the ``--baseline`` gate failed, 2 bad arguments, 3 no turn succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from clients.client import (
    RtvoiceError,
    Session,
    TurnResult,
    connect,
    llm_tokens,
    normalize_url,
    paced,
)

from . import stats
from .capacity import Criteria, search

SCHEMA = "rtvoice-bench/1"
BASELINE_SCHEMA = "rtvoice-bench-baseline/1"
GATE_METRIC = "decode_tps.p50"  # per-request decode_tps, median over the level's turns

# Short sentences in several languages: voice agents speak one or two sentences a turn, and
# the tokenizer and segmentation must cope with every script, not only Latin.
BUILTIN_TEXTS: tuple[str, ...] = (
    "Hello! How can I help you today?",
    "Your table for two is booked at eight.",
    "Guten Tag, wie kann ich Ihnen helfen?",
    "Bonjour, votre commande est en route.",
    "Hola, ¿en qué puedo ayudarte hoy?",
    "Ciao, il tuo volo parte alle nove.",
    "Olá, tudo bem com você?",
    "你好，今天有什么可以帮你？",
    "こんにちは、ご用件をどうぞ。",
    "안녕하세요, 무엇을 도와드릴까요?",
    "مرحبا، كيف يمكنني مساعدتك؟",
    "Привет! Чем могу помочь?",
)


# ============================================================================================
# Records
# ============================================================================================


@dataclass(slots=True)
class TurnRecord:
    """One turn, timed relative to the level's measuring start (seconds)."""

    session: int
    turn: int
    text_chars: int
    tokens: int
    start_s: float
    flush_s: float | None = None
    first_audio_s: float | None = None
    done_s: float | None = None
    client_ttfa_ms: float | None = None  # flush -> first audio; None if the audio came first
    first_audio_after_first_text_ms: float | None = None
    audio_before_flush: bool = False
    server_ttfa_ms: float | None = None
    server_prefill_ms: float | None = None  # the part of server_ttfa_ms until the prompt was in
    frames: int = 0
    segments: int = 0  # the server cuts a turn at sentence ends; each has its own budget
    audio_s: float = 0.0
    rtf: float | None = None
    decode_tps: float | None = None
    reason: str = "error"
    error: str | None = None  # error code
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival_s, duration_s)
    underruns: int = 0
    stall_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    """What a backend reports for one turn (absolute perf_counter stamps)."""

    flush_at: float | None
    first_audio_at: float | None
    done_at: float
    server_ttfa_ms: float | None
    frames: int
    audio_s: float
    rtf: float | None
    reason: str
    arrivals: list[tuple[float, float]]
    segments: int = 1
    first_text_at: float | None = None
    server_prefill_ms: float | None = None

    @classmethod
    def from_turn(cls, r: TurnResult) -> Outcome:
        return cls(r.flush_at, r.first_audio_at, r.done_at, r.server_ttfa_ms, r.frames,
                   r.audio_s, r.rtf, r.reason, r.arrivals, r.segments, r.first_text_at,
                   r.server_prefill_ms)


class BenchSession(Protocol):
    async def run_turn(self, text: str, tokens_per_s: float) -> Outcome: ...
    async def close(self) -> None: ...


class Backend(Protocol):
    info: dict[str, Any]

    async def open(self, index: int) -> tuple[BenchSession, float | None]:
        """A ready session and its server-side prefill time (ms)."""
        ...

    async def aclose(self) -> None: ...


# ============================================================================================
# Backends
# ============================================================================================


class _WsSession:
    def __init__(self, session: Session, whole: bool) -> None:
        self.session = session
        self.whole = whole

    async def run_turn(self, text: str, tokens_per_s: float) -> Outcome:
        tokens = paced(llm_tokens(text), tokens_per_s)
        turn = await self.session.feed(_joined(tokens) if self.whole else tokens)
        return Outcome.from_turn(await turn)

    async def close(self) -> None:
        # A polite stop lets the server log a clean end; a stuck one must not hang the bench.
        try:
            await asyncio.wait_for(self.session.stop(), 10)
        except (RtvoiceError, TimeoutError):
            pass
        finally:
            await self.session.close()


async def _joined(tokens: AsyncIterator[str]) -> AsyncIterator[str]:
    """The paced tokens as one text event, sent when the last one is due (a client that
    buffers its LLM's sentence: the same flush time, no streamed text before it)."""
    yield "".join([t async for t in tokens])


class WsBackend:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = normalize_url(args.url)
        self.args = args
        self.info: dict[str, Any] = {"mode": "websocket", "url": self.url}
        ref = None
        if args.reference:
            ref = (Path(args.reference), args.reference_text or "")
        extra: dict[str, Any] = {}
        if args.max_frames:
            extra["max_new_tokens"] = args.max_frames
        self._kw = dict(voice=args.voice, reference=ref, format=args.format,
                        sample_rate=args.sample_rate, encoding=args.encoding,
                        timeout=args.timeout, api_key=args.api_key, **extra)

    async def open(self, index: int) -> tuple[BenchSession, float | None]:
        seed = None if self.args.seed is None else self.args.seed + index
        session = await connect(self.url, seed=seed, **self._kw)
        try:
            ready = await session.wait_ready()
        except BaseException:
            await session.close()
            raise
        if "ready" not in self.info:
            import msgspec

            self.info["ready"] = msgspec.to_builtins(ready)
        return _WsSession(session, self.args.send_text == "whole"), ready.prefill_ms

    async def aclose(self) -> None:
        return None  # sessions close themselves; nothing is shared


class _EngineSink:
    """Engine-thread callbacks -> the bench's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sample_rate: int) -> None:
        self.loop = loop
        self.sample_rate = sample_rate
        self.ready: asyncio.Future[float] = loop.create_future()
        self.turn: asyncio.Future[Any] | None = None
        self.arrivals: list[tuple[float, float]] = []

    def _set(self, fut: asyncio.Future[Any] | None, value: Any = None,
             exc: BaseException | None = None) -> None:
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def on_ready(self, seq: Any, prefill_s: float) -> None:
        self.loop.call_soon_threadsafe(self._set, self.ready, prefill_s * 1000.0)

    def on_audio(self, seq: Any, turn_id: str, pcm: Any, offset_s: float) -> None:
        # Stamped on the engine thread: in-process mode measures the engine, not the loop.
        self.arrivals.append((time.perf_counter(), len(pcm) / self.sample_rate))

    def on_turn_end(self, seq: Any, result: Any) -> None:
        self.loop.call_soon_threadsafe(self._set, self.turn, (result, time.perf_counter()))

    def on_error(self, seq: Any, message: str) -> None:
        err = RtvoiceError("internal", message)
        self.loop.call_soon_threadsafe(self._set, self.ready, None, err)
        self.loop.call_soon_threadsafe(self._set, self.turn, None, err)


class _EngineSession:
    def __init__(self, backend: InProcessBackend, seq: Any, sink: _EngineSink) -> None:
        self.backend = backend
        self.seq = seq
        self.sink = sink
        self.n = 0

    async def run_turn(self, text: str, tokens_per_s: float) -> Outcome:
        # The engine takes a turn's text whole: stream it at LLM pace first, as a server would
        # buffer it, then submit at the flush.
        first_text_at = time.perf_counter()
        async for _ in paced(llm_tokens(text), tokens_per_s):
            pass
        self.n += 1
        self.sink.arrivals = []
        self.sink.turn = asyncio.get_running_loop().create_future()
        flush_at = time.perf_counter()
        self.backend.engine.submit(self.seq, text, turn_id=f"t{self.n}",
                                   max_frames=self.backend.args.max_frames or None)
        try:
            result, done_at = await asyncio.wait_for(self.sink.turn, self.backend.args.timeout)
        except TimeoutError:
            self.backend.engine.cancel(self.seq)
            raise RtvoiceError("client_timeout", "engine turn timed out") from None
        arrivals = list(self.sink.arrivals)
        reason = str(getattr(result.reason, "value", result.reason))
        ttfa = result.ttfa_s
        prefill = (None if result.ready_at is None
                   else (result.ready_at - result.submitted_at) * 1000.0)
        return Outcome(flush_at, arrivals[0][0] if arrivals else None, done_at,
                       None if ttfa is None else ttfa * 1000.0, result.frames, result.audio_s,
                       result.rtf, reason, arrivals, first_text_at=first_text_at,
                       server_prefill_ms=prefill)

    async def close(self) -> None:
        self.backend.engine.close(self.seq)


class InProcessBackend:
    """Drives ``engine.Engine`` directly: the same figures without the server's cost."""

    def __init__(self, args: argparse.Namespace, max_running: int) -> None:
        from engine.config import EngineConfig
        from engine.engine import build_engine
        from engine.loader import load_bundle
        from engine.reference_audio import encode_reference

        self.args = args
        self.bundle = load_bundle(args.model, device=args.device, dtype=args.dtype,
                                  max_seq_len=args.max_len)
        cfg = EngineConfig(max_running=max_running, max_len=args.max_len)
        self.engine = build_engine(self.bundle, cfg)
        self.refs: list[Any] = []
        if args.reference:
            import soundfile as sf

            audio, sr = sf.read(args.reference, dtype="float32", always_2d=True)
            self.refs.append(encode_reference(self.bundle.codec, audio.mean(axis=1), sr,
                                              args.reference_text or ""))
        self.engine.start()
        self.engine.warmed()  # measure with every graph captured
        self.info = {"mode": "in-process", "model": args.model, "device": args.device,
                     "dtype": args.dtype,
                     "sample_rate": self.engine.sample_rate,
                     "frame_rate_hz": self.engine.frame_rate,
                     "engine_config": asdict(cfg)}

    async def open(self, index: int) -> tuple[BenchSession, float | None]:
        from engine.sampler import SamplingParams

        loop = asyncio.get_running_loop()
        sink = _EngineSink(loop, self.engine.sample_rate)
        seed = None if self.args.seed is None else self.args.seed + index
        seq = self.engine.open(self.refs, SamplingParams(seed=seed), sink)
        prefill_ms = await asyncio.wait_for(sink.ready, self.args.timeout)
        return _EngineSession(self, seq, sink), prefill_ms

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


# ============================================================================================
# Progress
# ============================================================================================


class Progress:
    """A plain-stderr progress bar: redrawn in place on a terminal, a line per quarter in a
    log (so CI output stays readable)."""

    def __init__(self, enabled: bool = True, stream: Any = None, width: int = 28) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.label = ""
        self.total: int | None = None
        self.deadline: float | None = None
        self.t0 = 0.0
        self.done = 0
        self.errors = 0
        self._last_draw = 0.0
        self._last_quarter = -1

    def start(self, label: str, total: int | None, duration: float | None = None) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + duration if duration else None
        self._last_quarter = -1
        self.draw(force=True)

    def step(self, error: bool = False) -> None:
        self.done += 1
        self.errors += int(error)
        self.draw()

    def _fraction(self) -> float:
        if self.total:
            return min(1.0, self.done / self.total)
        if self.deadline:
            span = self.deadline - self.t0
            return min(1.0, (time.perf_counter() - self.t0) / span) if span > 0 else 1.0
        return 0.0

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = self._fraction()
        if self.tty:
            if not force and now - self._last_draw < 0.1 and frac < 1.0:
                return
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
            self.stream.write(f"\r{self.label} [{bar}] {count} turns, {self.errors} errors, "
                              f"{now - self.t0:5.1f}s ")
            self.stream.flush()
        else:
            quarter = int(frac * 4)
            if quarter > self._last_quarter:
                self._last_quarter = quarter
                self.stream.write(f"{self.label}: {int(frac * 100)}% ({self.done} turns, "
                                  f"{self.errors} errors, {now - self.t0:.1f}s)\n")
                self.stream.flush()
        self._last_draw = now

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


# ============================================================================================
# Running one level
# ============================================================================================


def pick_text(texts: Sequence[str], session: int, turn: int) -> str:
    # Sessions start at different texts so that a level mixes languages at every moment.
    return texts[(session * 5 + turn) % len(texts)]


async def run_level(backend: Backend, c: int, args: argparse.Namespace, texts: Sequence[str],
                    progress: Progress) -> dict[str, Any]:
    t_open = time.perf_counter()
    opened = await asyncio.gather(*(backend.open(i) for i in range(c)), return_exceptions=True)
    sessions: list[BenchSession | None] = []
    prefill: list[float | None] = []
    open_errors: list[str] = []
    for o in opened:
        if isinstance(o, BaseException):
            sessions.append(None)
            open_errors.append(getattr(o, "code", type(o).__name__))
        else:
            sessions.append(o[0])
            prefill.append(o[1])
    open_s = time.perf_counter() - t_open
    records: list[TurnRecord] = []
    total = None if args.duration else c * (args.warmup_turns + args.turns)
    progress.start(f"c={c}", total, args.duration)
    t0 = 0.0

    async def one_turn(i: int, s: BenchSession, k: int, measured: bool) -> bool:
        text = pick_text(texts, i, k)
        start = time.perf_counter()
        rec = TurnRecord(session=i, turn=k, text_chars=len(text), tokens=len(llm_tokens(text)),
                         start_s=start - t0)
        ok = True
        try:
            out = await s.run_turn(text, args.tokens_per_s)
        except RtvoiceError as exc:
            rec.error, rec.done_s, ok = exc.code, time.perf_counter() - t0, False
        except Exception as exc:  # a bench must report a broken session, not die of it
            rec.error, rec.done_s, ok = type(exc).__name__, time.perf_counter() - t0, False
        else:
            fill_record(rec, out, t0, args.jitter_ms / 1000.0)
        progress.step(error=not ok)
        if measured:
            records.append(rec)
        return ok

    async def warm(i: int, s: BenchSession) -> bool:
        for k in range(args.warmup_turns):
            if not await one_turn(i, s, -1 - k, measured=False):
                return False
        return True

    alive = [(i, s) for i, s in enumerate(sessions) if s is not None]
    warm_ok = await asyncio.gather(*(warm(i, s) for i, s in alive))
    alive = [a for a, ok in zip(alive, warm_ok) if ok]
    t0 = time.perf_counter()  # every session starts measuring together
    deadline = t0 + args.duration if args.duration else None

    async def measure(i: int, s: BenchSession) -> None:
        k = 0
        rng = random.Random(args.seed * 7919 + i)  # the same arrivals run after run
        while (k < args.turns) if deadline is None else (time.perf_counter() < deadline):
            if args.arrivals == "poisson":  # exponential think time: turns arrive as a
                await asyncio.sleep(rng.expovariate(1.0 / args.mean_gap_s))  # Poisson process
            elif k and args.pause_ms:
                await asyncio.sleep(args.pause_ms / 1000.0)
            if not await one_turn(i, s, k, measured=True):
                break  # the session is broken; its error is recorded
            k += 1

    await asyncio.gather(*(measure(i, s) for i, s in alive))
    wall = time.perf_counter() - t0
    progress.finish()
    await asyncio.gather(*(s.close() for s in sessions if s is not None), return_exceptions=True)
    level = summarize_level(c, records, wall, args.jitter_ms)
    level["open"] = {"sessions": c, "failed": len(open_errors), "errors": open_errors,
                     "warmup_failed": len(warm_ok) - sum(warm_ok),
                     "wall_s": round(open_s, 3), "prefill_ms": stats.summarize(prefill)}
    if open_errors or len(warm_ok) != sum(warm_ok):
        level["turns"]["errors"] += len(open_errors) + len(warm_ok) - sum(warm_ok)
    return level


def fill_record(rec: TurnRecord, out: Outcome, t0: float, jitter_s: float) -> None:
    rec.flush_s = None if out.flush_at is None else out.flush_at - t0
    rec.first_audio_s = None if out.first_audio_at is None else out.first_audio_at - t0
    rec.done_s = out.done_at - t0
    if out.first_audio_at is not None and out.flush_at is not None:
        # Audio before the flush has no TTFA after it: counted apart, not as 0 ms.
        rec.audio_before_flush = out.first_audio_at < out.flush_at
        if not rec.audio_before_flush:
            rec.client_ttfa_ms = (out.first_audio_at - out.flush_at) * 1000.0
    if out.first_audio_at is not None and out.first_text_at is not None:
        rec.first_audio_after_first_text_ms = (out.first_audio_at - out.first_text_at) * 1000.0
    rec.server_ttfa_ms = out.server_ttfa_ms
    rec.server_prefill_ms = out.server_prefill_ms
    rec.frames, rec.audio_s, rec.rtf, rec.reason = out.frames, out.audio_s, out.rtf, out.reason
    rec.segments = out.segments
    gen = out.rtf * out.audio_s if out.rtf is not None and out.audio_s > 0 else None
    rec.decode_tps = out.frames / gen if gen and out.frames else None
    rec.chunks = [(round(a - t0, 6), round(d, 6)) for a, d in out.arrivals]
    if out.reason != "cancelled":
        play = stats.simulate_playback(rec.chunks, jitter_s)
        rec.underruns, rec.stall_s = play.underruns, round(play.stall_s, 6)


def summarize_level(c: int, records: list[TurnRecord], wall_s: float,
                    jitter_ms: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.reason in ("eos", "length")]
    frames = sum(r.frames for r in records if r.error is None)
    gaps_ms = [g * 1000.0 for r in ok for g in stats.gaps([a for a, _ in r.chunks])]
    per_stream: dict[int, int] = {}
    stall: dict[int, float] = {}
    for r in ok:
        per_stream[r.session] = per_stream.get(r.session, 0) + r.underruns
        stall[r.session] = stall.get(r.session, 0.0) + r.stall_s
    audio_s = sum(r.audio_s for r in ok)
    return {
        "concurrency": c,
        "wall_s": round(wall_s, 3),
        "turns": {
            "total": len(records),
            "ok": len(ok),
            "errors": sum(r.error is not None or r.reason == "error" for r in records),
            "cancelled": sum(r.reason == "cancelled" for r in records),
            "truncated": sum(r.error is None and r.reason == "length" for r in records),
            "eos": sum(r.error is None and r.reason == "eos" for r in records),
            "audio_before_flush": sum(r.audio_before_flush for r in ok),
            "error_codes": sorted({r.error for r in records if r.error}),
        },
        "client_ttfa_ms": stats.summarize(r.client_ttfa_ms for r in ok),
        "first_audio_after_first_text_ms": stats.summarize(
            r.first_audio_after_first_text_ms for r in ok),
        "server_ttfa_ms": stats.summarize(r.server_ttfa_ms for r in ok),
        # TTFA's first part: segment handed to the engine -> its prompt prefilled
        "server_prefill_ms": stats.summarize(r.server_prefill_ms for r in ok),
        "frames": frames,
        "audio_s": round(audio_s, 3),
        "aggregate_fps": round(frames / wall_s, 2) if wall_s > 0 else None,
        "realtime_x": round(audio_s / wall_s, 3) if wall_s > 0 else None,
        "decode_tps": stats.summarize(r.decode_tps for r in ok),
        "rtf": stats.summarize(r.rtf for r in ok),
        "gap_ms": stats.summarize(gaps_ms),
        "underruns": {
            "jitter_buffer_ms": jitter_ms,
            "total": sum(per_stream.values()),
            "streams_affected": sum(1 for v in per_stream.values() if v),
            "per_stream": [per_stream[k] for k in sorted(per_stream)],
            "stall_s": round(sum(stall.values()), 4),
            # turns by their number of segments (sentences): [turns, underruns] — a turn of
            # several starts each later sentence anew, where the stream may run dry
            "by_segments": _by_segments(ok),
        },
        "records": [asdict(r) for r in records],
    }


def _by_segments(turns: Sequence[TurnRecord]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in sorted(turns, key=lambda r: r.segments or 0):
        entry = out.setdefault(str(r.segments or 0), [0, 0])
        entry[0] += 1
        entry[1] += r.underruns
    return out


# ============================================================================================
# Reporting
# ============================================================================================


def _fmt(x: Any, nd: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}"


def table(levels: Sequence[dict[str, Any]]) -> str:
    head = (f"{'c':>4} {'turns':>6} {'err':>4} {'trunc':>5} {'early':>5}"
            f" | {'client TTFA ms p50/p90/p99/max':>30}"
            f" | {'server TTFA ms p50/p90/p99/max':>30} {'prefill p50':>11}"
            f" | {'agg fps':>8} {'tps p50':>8}"
            f" {'RTF p50':>7} {'gap p99':>7} {'underruns':>9}")
    lines = [head, "-" * len(head)]
    for lv in levels:  # early: turns whose audio came before their flush (no client TTFA)
        ct, st = lv["client_ttfa_ms"], lv["server_ttfa_ms"]
        ctt = "/".join(_fmt(ct[k]) for k in ("p50", "p90", "p99", "max"))
        stt = "/".join(_fmt(st[k]) for k in ("p50", "p90", "p99", "max"))
        t = lv["turns"]
        lines.append(
            f"{lv['concurrency']:>4} {t['total']:>6} {t['errors']:>4} {t['truncated']:>5} "
            f"{_fmt(t.get('audio_before_flush')):>5} | "
            f"{ctt:>30} | {stt:>30} "
            f"{_fmt((lv.get('server_prefill_ms') or {}).get('p50')):>11} | "
            f"{_fmt(lv['aggregate_fps'], 1):>8} "
            f"{_fmt(lv['decode_tps']['p50'], 1):>8} {_fmt(lv['rtf']['p50'], 3):>7} "
            f"{_fmt(lv['gap_ms']['p99']):>7} {lv['underruns']['total']:>9}")
    return "\n".join(lines)


def capacity_line(cap: dict[str, Any]) -> str:
    fail = cap["first_failure"]
    return (f"capacity: {cap['capacity']} concurrent streams (TTFA p99 <= {cap['ttfa_p99_ms']:g} "
            f"ms, <= {cap['max_underruns']} underruns with a {cap['jitter_ms']:g} ms buffer, "
            f"{cap['arrivals']} arrivals); "
            + (f"{fail} failed" if fail is not None else f"every level up to {cap['max_searched']} passed")
            + f"; {len(cap['probes'])} levels probed")


PLOT_HINT = "pip install matplotlib"


def plot_unavailable() -> str | None:
    """Why ``plot`` cannot run here (matplotlib missing or broken), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc})"
    return None


def plot(results: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    levels = results["levels"]
    cs = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, style, name in (("client_ttfa_ms", "-", "client"), ("server_ttfa_ms", "--", "server")):
        for q, marker in (("p50", "o"), ("p90", "s"), ("p99", "^")):
            ys = [lv[key][q] for lv in levels]
            if any(y is not None for y in ys):
                ax1.plot(cs, [float("nan") if y is None else y for y in ys], style, marker=marker,
                         label=f"{name} {q}")
    cap = results.get("capacity")
    if cap:  # the bound and the answer of a capacity search
        ax1.axhline(cap["ttfa_p99_ms"], color="red", linestyle=":", label="p99 bound")
        if cap["capacity"]:
            ax1.axvline(cap["capacity"], color="green", linestyle=":",
                        label=f"capacity {cap['capacity']}")
    agg = [lv["aggregate_fps"] or 0.0 for lv in levels]
    tps = [lv["decode_tps"]["p50"] or 0.0 for lv in levels]
    ax2.plot(cs, agg, "-o", label="aggregate frames/s")
    ax2.plot(cs, tps, "-s", label="per-request decode_tps (p50)")
    fr = results.get("server", {}).get("ready", {}).get("frame_rate_hz") or \
        results.get("server", {}).get("frame_rate_hz") or 44100 / 2048
    ax2.axhline(fr, color="grey", linestyle=":", label=f"realtime ({fr:.2f} frames/s)")
    for ax, ylabel, title in ((ax1, "TTFA (ms)", "Time to first audio"),
                              (ax2, "frames / s", "Throughput")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    mode = results.get("server", {}).get("mode", "")
    fig.suptitle(f"rtvoice bench ({mode}, {results.get('machine', {}).get('node', '')})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def git_info() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
            "branch": git("rev-parse", "--abbrev-ref", "HEAD")}


def machine_info(in_process: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "node": platform.node(), "platform": platform.platform(),
        "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    if in_process:
        with contextlib.suppress(Exception):
            import torch

            info["torch"] = torch.__version__
            info["torch_threads"] = torch.get_num_threads()
            if torch.cuda.is_available():
                info["gpu"] = torch.cuda.get_device_name(0)
    return info


def baseline_from(data: dict[str, Any]) -> dict[int, float]:
    """decode_tps per level from a baseline file or from a full results JSON."""
    if data.get("schema") == BASELINE_SCHEMA:
        return {int(k): float(v) for k, v in data["decode_tps"].items() if v is not None}
    if "levels" in data:
        return {int(lv["concurrency"]): float(lv["decode_tps"]["p50"])
                for lv in data["levels"] if lv["decode_tps"]["p50"] is not None}
    raise ValueError("not a bench baseline or results file")


def current_tps(results: dict[str, Any]) -> dict[int, float | None]:
    return {int(lv["concurrency"]): lv["decode_tps"]["p50"] for lv in results["levels"]}


def make_baseline(results: dict[str, Any]) -> dict[str, Any]:
    return {"schema": BASELINE_SCHEMA, "metric": GATE_METRIC,
            "decode_tps": {str(k): v for k, v in current_tps(results).items()},
            "created": results.get("created"), "settings": results.get("settings"),
            "server": {k: v for k, v in results.get("server", {}).items() if k != "ready"},
            "git": results.get("git"), "machine": results.get("machine")}


# ============================================================================================
# CLI
# ============================================================================================


def _levels(text: str) -> list[int]:
    try:
        cs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad concurrency list {text!r}") from None
    if not cs or any(c < 1 for c in cs):
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return cs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench-latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--url", help="server, e.g. ws://127.0.0.1:8000/v1/tts/live")
    target.add_argument("--in-process", action="store_true",
                        help="drive the engine directly (no server): engine cost alone")
    target.add_argument("--from-json", metavar="FILE",
                        help="do not run: report/plot/gate an earlier --json result")
    ap.add_argument("--api-key", default=os.environ.get("RTVOICE_API_KEY"),
                    help="for a server started with api_keys (default: $RTVOICE_API_KEY)")
    ap.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64], metavar="1,4,16,64")
    amount = ap.add_mutually_exclusive_group()
    amount.add_argument("--turns", type=int, default=5, help="measured turns per session")
    amount.add_argument("--duration", type=float, help="measure each level for S seconds instead")
    ap.add_argument("--warmup-turns", type=int, default=1, help="unmeasured turns per session")
    ap.add_argument("--texts", metavar="FILE", help="one text per line (default: built-in, multilingual)")
    ap.add_argument("--voice", help="stored voice id (reference_id)")
    ap.add_argument("--reference", metavar="AUDIO", help="inline reference clip")
    ap.add_argument("--reference-text", help="transcript of --reference")
    ap.add_argument("--format", default="pcm", help="pcm|wav|mp3|opus|mulaw (default pcm)")
    ap.add_argument("--sample-rate", type=int)
    ap.add_argument("--encoding", default="msgpack", choices=["msgpack", "json"])
    ap.add_argument("--seed", type=int, default=0, help="session i uses seed+i")
    ap.add_argument("--max-frames", type=int, default=0,
                    help="frame budget per segment (max_new_tokens); 0: the server's default")
    ap.add_argument("--tokens-per-s", type=float, default=40.0,
                    help="text streaming pace, LLM-like (0: all at once)")
    ap.add_argument("--send-text", choices=["stream", "whole"], default="stream",
                    help="stream: each LLM token as a text event; whole: the turn's tokens "
                         "collected at the same pace and sent as one text event with its flush "
                         "(nothing for the server to prefill ahead; --in-process: always whole)")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="lockstep: pause between a session's turns")
    ap.add_argument("--arrivals", choices=["lockstep", "poisson"], default="lockstep",
                    help="lockstep: every session starts its turns together, each right after "
                         "its last (bursts); poisson: each session waits an exponential think "
                         "time (mean --mean-gap-s) before each turn, so turns arrive as a "
                         "Poisson process")
    ap.add_argument("--mean-gap-s", type=float, default=2.0,
                    help="poisson: mean think time before a session's turn (seconds)")
    ap.add_argument("--capacity", action="store_true",
                    help="search the largest concurrency whose TTFA p99 (server-side where "
                         "reported) stays within --capacity-ttfa-ms with no underruns and no "
                         "errors: doubling from the first --concurrency value, then bisecting")
    ap.add_argument("--capacity-ttfa-ms", type=float, default=300.0,
                    help="--capacity: the TTFA p99 bound (ms)")
    ap.add_argument("--capacity-max", type=int, default=1024,
                    help="--capacity: the largest concurrency tried")
    ap.add_argument("--capacity-resolution", type=int, default=4,
                    help="--capacity: stop bisecting when pass and failure are this close")
    ap.add_argument("--jitter-ms", type=float, default=100.0,
                    help="playback jitter buffer for the underrun simulation")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds without any event before a turn counts as failed")
    ap.add_argument("--model", default="tiny", help="--in-process: model bundle")
    ap.add_argument("--device", default="cpu", help="--in-process: torch device")
    ap.add_argument("--dtype", default=None, help="--in-process: bf16, fp16, fp32 or fp8 "
                    "(FP8 block-scaled linears; default: fp32 on a CPU, bf16 on a GPU)")
    ap.add_argument("--max-len", type=int, default=1024, help="--in-process: KV positions per session")
    ap.add_argument("--json", metavar="FILE", help="write every figure and the settings")
    ap.add_argument("--plot", metavar="FILE.png", help="TTFA and throughput vs concurrency")
    ap.add_argument("--baseline", metavar="FILE", help="gate decode_tps against this baseline")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed decode_tps drop")
    ap.add_argument("--save-baseline", metavar="FILE", help="write this run's decode_tps as a baseline")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no table on stdout")
    return ap


def load_texts(path: str | None) -> list[str]:
    if not path:
        return list(BUILTIN_TEXTS)
    texts = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    texts = [t for t in texts if t and not t.startswith("#")]
    if not texts:
        raise ValueError(f"{path} has no texts")
    return texts


async def run_bench(args: argparse.Namespace, progress: Progress | None = None) -> dict[str, Any]:
    texts = load_texts(args.texts)
    progress = progress or Progress(enabled=not args.no_progress)
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    backend: Backend
    most = args.capacity_max if args.capacity else max(args.concurrency)
    if args.in_process:
        backend = await asyncio.to_thread(InProcessBackend, args, most)
    else:
        backend = WsBackend(args)
    levels = []
    found: dict[str, Any] | None = None
    try:
        if args.capacity:
            criteria = Criteria(ttfa_p99_ms=args.capacity_ttfa_ms)

            def said(c: int, ok: bool, why: str) -> None:
                if not args.quiet:
                    print(f"capacity: c={c} {'passes' if ok else 'fails'}: {why}",
                          file=sys.stderr, flush=True)

            result, levels = await search(
                lambda c: run_level(backend, c, args, texts, progress), criteria,
                start=args.concurrency[0], max_c=args.capacity_max,
                resolution=args.capacity_resolution, on_probe=said)
            levels.sort(key=lambda lv: lv["concurrency"])
            found = {**result.as_dict(), "ttfa_p99_ms": criteria.ttfa_p99_ms,
                     "max_underruns": criteria.max_underruns, "jitter_ms": args.jitter_ms,
                     "arrivals": args.arrivals, "max_searched": args.capacity_max,
                     "resolution": args.capacity_resolution}
        else:
            for c in args.concurrency:
                levels.append(await run_level(backend, c, args, texts, progress))
    finally:
        await backend.aclose()
    settings = {k: v for k, v in vars(args).items()
                if k not in ("json", "plot", "baseline", "save_baseline", "no_progress", "quiet",
                             "from_json")}
    settings["texts"] = args.texts or "builtin"
    settings["n_texts"] = len(texts)
    out = {"schema": SCHEMA, "created": created, "settings": settings,
           "server": backend.info, "git": git_info(), "machine": machine_info(args.in_process),
           "levels": levels}
    if found is not None:
        out["capacity"] = found
    return out


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not (args.url or args.in_process or args.from_json):
        ap.error("give --url, --in-process or --from-json")
    if args.turns is not None and args.turns < 1:
        ap.error("--turns must be >= 1")
    if args.mean_gap_s <= 0:
        ap.error("--mean-gap-s must be > 0")
    if args.capacity and (args.capacity_max < args.concurrency[0] or args.capacity_resolution < 1
                          or args.capacity_ttfa_ms <= 0):
        ap.error("--capacity needs --capacity-max >= the first --concurrency value, "
                 "--capacity-resolution >= 1 and --capacity-ttfa-ms > 0")
    if args.reference and args.reference_text is None:
        ap.error("--reference needs --reference-text")
    for flag in ("json", "plot", "save_baseline"):  # fail now, not after the whole sweep
        dest = getattr(args, flag)
        if dest and not Path(dest).expanduser().resolve().parent.is_dir():
            ap.error(f"--{flag.replace('_', '-')} {dest}: its folder does not exist")
    no_plot = plot_unavailable() if args.plot else None
    if no_plot:
        print(f"bench-latency: warning: --plot needs matplotlib: {no_plot}; running without "
              f"the plot (the JSON has every figure). For plots: {PLOT_HINT}", file=sys.stderr)
    if args.in_process and args.voice:
        ap.error("--voice needs a server's voice store; use --reference with --in-process")
    if not args.from_json:
        try:
            load_texts(args.texts)
        except (OSError, ValueError) as exc:
            ap.error(f"--texts: {exc}")
    base: dict[int, float] | None = None
    if args.baseline:  # read it first: a bad baseline must not cost a whole run
        try:
            base = baseline_from(json.loads(Path(args.baseline).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"cannot read baseline {args.baseline}: {exc}")
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        try:
            results = asyncio.run(run_bench(args))
        except KeyboardInterrupt:
            return 130
    if not args.quiet:
        out(table(results["levels"]))
        if "capacity" in results:
            out(capacity_line(results["capacity"]))
    code = 0
    if base is not None:
        gate = stats.gate_compare(current_tps(results), base, args.tolerance)
        results["gate"] = {"baseline": args.baseline, "metric": GATE_METRIC,
                           "tolerance": args.tolerance, "passed": gate.passed,
                           "rows": [asdict(r) for r in gate.rows], "missing": list(gate.missing)}
        out(gate.describe())
        if not gate.passed:
            code = 1
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(results, indent=1, ensure_ascii=False))
    if args.save_baseline:
        Path(args.save_baseline).write_text(json.dumps(make_baseline(results), indent=1))
    if args.plot and not no_plot:
        plot(results, args.plot)
    elif args.plot:
        src = args.from_json or args.json
        again = f", then: bench-latency --from-json {src} --plot {args.plot}" if src else ""
        print(f"bench-latency: no plot written to {args.plot}: matplotlib is missing "
              f"({PLOT_HINT}{again})", file=sys.stderr)
    if not args.from_json and not any(lv["turns"]["ok"] for lv in results["levels"]):
        print("no turn succeeded", file=sys.stderr)
        return 3
    return code


if __name__ == "__main__":
    raise SystemExit(main())
