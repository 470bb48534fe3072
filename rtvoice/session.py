"""One live TTS connection: the protocol state machine driving the engine.

Data flow of a session (everything below runs on the event loop unless marked)::

    client frames --> receive loop --> contexts (segmenters) --> FIFO of segments
        --> Engine.submit (one turn at a time per session)
    engine thread: on_ready / on_audio / on_turn_end --call_soon_threadsafe--> loop
        --> encode worker (per session, ordered; encoders run in a thread pool)
        --> outbox (bounded) --> sender task --> socket

Vocabulary:

- A **context** (``context_id``, ``None`` = the session's default) is an independent stream of
  text on the socket. It owns a segmenter, its audio sequence numbers and offsets.
- An **utterance** is a context's text up to a ``flush`` (or ``stop``): one audio stream (one
  encoder, so the bytes of an utterance form one WAV/MP3/Ogg stream) and one ``done``. The
  protocol calls it a *turn*.
- A **segment** is a piece of an utterance cut by the segmenter (sentence ends,
  ``chunk_length``); each is one engine turn with its own frame budget. All contexts share the
  session's engine sequence (one voice, one KV cache), so segments run one after another in
  FIFO order.

Failures: every exception, wherever it is raised (receive loop, engine callbacks, encode
worker, sender), reaches :meth:`Session._on_failure`, the one place that maps it to an
``ErrorCode`` (and so, through ``protocol.error_spec``, to fatal-or-not and a close code). A
non-fatal error becomes an ``error`` event and the session goes on; a fatal one ends the
session with ``error``, ``finish{reason: "error"}`` and the error's close code. Nothing a
session does can raise into another session, the engine thread or the server. One exception
to "the code decides": a segment the engine refuses for the client's reasons (``too_large``:
it does not fit the context; ``invalid_state``) ends its turn with ``done{reason: "error"}``
after a non-fatal ``error`` event (:meth:`Session._report`), and the session goes on.

Ordering: ``ready`` is the first event after ``start`` other than ``error``: a ``done`` that
comes about during the prefill (a ``cancel``) is held back until ``ready`` is queued.

Memory: everything queued per session is bounded. Text by ``max_text_chars``; events waiting
for the socket by ``send_queue_events`` and their audio by ``send_queue_bytes``; raw audio
waiting for the encoder by :func:`encode_backlog_chunks`. A client that lets a bound overflow
is too slow (or abusive) and is dropped with ``error{timeout}``; engine callbacks never wait.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.engine import TURN_MARGIN, Engine, EngineOverloaded, TurnTooLong
from engine.loader import Bundle
from engine.prompt import Reference
from engine.reference_audio import encode_reference
from engine.request import FinishReason, Sequence, TurnResult
from engine.sampler import SamplingParams
from protocol import (
    Audio,
    Cancel,
    ClientEvent,
    Done,
    Encoding,
    Error,
    ErrorCode,
    Finish,
    Flush,
    Limits,
    ProtocolError,
    Ready,
    SessionState,
    SessionStateMachine,
    Start,
    Stop,
    Text,
    TTSRequest,
    decode_client,
    encode_server,
    encoding_of,
)
from rtvoice.audio_formats import (
    MODEL_SAMPLE_RATE,
    AudioEncoder,
    EncoderConfig,
    ReferenceAudioTooLong,
    decode_reference_audio,
    make_encoder,
)
from rtvoice.segmenter import Segmenter, estimate_speech_seconds
from rtvoice.settings import Settings
from rtvoice.voices import UnknownVoice, VoiceLimitError, VoiceStore

__all__ = ["Metrics", "Runtime", "Session", "check_voice_room", "frame_budget", "segment_room"]

log = logging.getLogger(__name__)

_FINAL_TIMEOUT_S: Final = 5.0  # last events + close to a client that may not read any more
# Worst-case text tokens per character: a code point is at most 4 UTF-8 bytes, and both the
# byte tokenizer (tiny) and a byte-level BPE (S2-Pro's Qwen3) need at most one token per byte.
WORST_TOKENS_PER_CHAR: Final = 4

# ============================================================================ shared runtime


class Metrics:
    """Service counters for ``/metrics``. Updated and read on the event loop only."""

    TTFA_BUCKETS: Final = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
    PREFILL_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
    RECENT: Final = 2048  # TTFA values (one per segment) kept for the quantiles

    def __init__(self) -> None:
        self.connections_total = 0
        self.connections_open = 0
        self.sessions_total = 0  # sessions that got past ``start``
        self.sessions_live = 0
        self.turns: dict[str, int] = {}  # by done reason
        self.segments_total = 0
        self.frames_total = 0
        self.audio_seconds_total = 0.0
        self.audio_bytes_total = 0
        self.errors: dict[str, int] = {}  # by error code
        self.slow_clients = 0  # sessions dropped because a send/encode bound overflowed
        self.ttfa_counts = [0] * (len(self.TTFA_BUCKETS) + 1)
        self.ttfa_sum = 0.0
        self.ttfa_recent: deque[float] = deque(maxlen=self.RECENT)
        self.prefill_counts = [0] * (len(self.PREFILL_BUCKETS) + 1)
        self.prefill_sum = 0.0

    @staticmethod
    def _observe(buckets: tuple[float, ...], counts: list[int], value: float) -> None:
        for i, b in enumerate(buckets):
            if value <= b:
                counts[i] += 1
                return
        counts[-1] += 1

    def observe_ttfa(self, seconds: float) -> None:
        """One segment's TTFA (handed to the engine -> first audio handed to the socket)."""
        self._observe(self.TTFA_BUCKETS, self.ttfa_counts, seconds)
        self.ttfa_sum += seconds
        self.ttfa_recent.append(seconds)

    def observe_prefill(self, seconds: float) -> None:
        self._observe(self.PREFILL_BUCKETS, self.prefill_counts, seconds)
        self.prefill_sum += seconds

    def turn_done(self, reason: str) -> None:
        self.turns[reason] = self.turns.get(reason, 0) + 1

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def ttfa_quantiles(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        if not self.ttfa_recent:
            return {}
        arr = np.fromiter(self.ttfa_recent, dtype=np.float64)
        return {q: float(np.quantile(arr, q)) for q in qs}


@dataclass(slots=True)
class Runtime:
    """What every session of one server shares. Built by the app's lifespan."""

    settings: Settings
    bundle: Bundle
    engine: Engine
    store: VoiceStore
    encode_pool: ThreadPoolExecutor  # audio encoders (mp3/opus/resampling)
    codec_pool: ThreadPoolExecutor  # reference decoding + codec encoder (one worker)
    metrics: Metrics = field(default_factory=Metrics)
    session_ids: itertools.count[int] = field(default_factory=itertools.count)
    sessions: set[Session] = field(default_factory=set)  # connected now (shutdown notices)
    stopping: bool = False  # the server is shutting down: new sockets are refused


def frame_budget(settings: Settings, text: str, request_max: int | None, frame_rate: float) -> int:
    """Frames one segment may generate: a few times its expected speech duration, at least
    ``min_turn_frames``, at most the request's ``max_new_tokens`` and ``max_turn_frames``."""
    eng = settings.engine
    derived = math.ceil(estimate_speech_seconds(text) * eng.budget_multiplier * frame_rate)
    budget = max(eng.min_turn_frames, derived)
    if request_max is not None:
        budget = min(budget, request_max)
    return max(1, min(budget, eng.max_turn_frames))


def encode_backlog_chunks(settings: Settings) -> int:
    """Raw audio chunks (float32 PCM, usually ``chunk_frames`` x 2048 samples: 64 KiB by
    default; up to twice that for a stream far ahead of realtime) that may wait for a
    session's encoder: the chunks of two longest segments (``max_turn_frames``), 528 by
    default. The encoder falls this far behind the engine only when its thread pool is
    starved; the session is then dropped like a slow reader (the engine never waits for a
    session)."""
    eng = settings.engine
    return 2 * math.ceil(eng.max_turn_frames / eng.chunk_frames) + 16


def segment_room(engine: Engine, references: Iterable[Reference]) -> int:
    """Characters one segment may have so that, with this voice prompt, it always fits the
    engine's context (``max_len``): worst-case tokens (:data:`WORST_TOKENS_PER_CHAR`) plus the
    turn's chat wrapper plus :data:`TURN_MARGIN`. Negative when even an empty turn does not
    fit. Sessions cap their ``chunk_length`` to it; a voice that leaves less than
    ``min_chunk_length`` is refused (``too_large``) at upload and at ``start``
    (:func:`check_voice_room`)."""
    prompts = engine.prompts
    system = prompts.system(tuple(references)).shape[1]
    wrapper = prompts.user_turn("").shape[1]
    room = engine.runner.cache.max_len - system - wrapper - TURN_MARGIN
    return room // WORST_TOKENS_PER_CHAR if room >= 0 else -1


def check_voice_room(engine: Engine, references: Iterable[Reference], min_chars: int) -> int:
    """:func:`segment_room` of this voice; ``ProtocolError(too_large)`` when it leaves room for
    less than ``min_chars`` characters per segment (the voice cannot be served)."""
    room = segment_room(engine, references)
    if room < min_chars:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"the voice prompt (transcript + reference codes) leaves room for {max(0, room)} "
            f"characters per segment in the engine's context of {engine.runner.cache.max_len} "
            f"positions; at least {min_chars} are needed: use a shorter clip or transcript",
        )
    return room


# ============================================================================ per-session state


class ClientGone(Exception):
    """The client closed the socket or vanished; nothing more can be sent."""


@dataclass(slots=True, eq=False)
class _Context:
    id: str | None
    segmenter: Segmenter
    open: _Utterance | None = None  # accepting text
    pending: list[_Utterance] = field(default_factory=list)  # flushed, audio not finished
    unspoken_chars: int = 0  # buffered + queued segment text (bounded by max_text_chars)
    next_seq: int = 0  # audio event sequence number (assigned at send time: no gaps)
    sent_s: float = 0.0  # audio seconds sent in this context (offset of the next chunk)

    @property
    def live(self) -> bool:
        return self.open is not None or bool(self.pending) or self.segmenter.buffered > 0

    def utterances(self) -> list[_Utterance]:
        return [*self.pending, *([self.open] if self.open is not None else [])]


@dataclass(slots=True, eq=False)
class _Utterance:
    context: _Context
    index: int
    flushed: bool = False  # no more segments will be added
    cancelled: bool = False
    finished: bool = False  # ``done`` queued
    segments_total: int = 0
    segments_done: int = 0
    text_chars: int = 0
    frames: int = 0
    gen_s: float = 0.0  # generation wall time of its segments (for rtf)
    samples_in: int = 0  # model-rate samples handed to the encoder
    carry_s: float = 0.0  # audio encoded but not yet in a chunk (encoder delay)
    sent_s: float = 0.0  # audio seconds sent
    reasons: set[str] = field(default_factory=set)
    encoder: AudioEncoder | None = None  # created and used by the encode worker only
    # segments whose first audio went into the encoder but is in no chunk yet (encode worker)
    awaiting_audio: list[_Segment] = field(default_factory=list)
    segment_ttfa_s: list[float] = field(default_factory=list)  # in the order they were sent

    def done_reason(self) -> str:
        if self.cancelled:
            return "cancelled"
        for reason in ("error", "length", "eos"):
            if reason in self.reasons:
                return reason
        return "eos"  # nothing to say (empty utterance) ends like a natural end

    def ttfa_s(self) -> float | None:
        """The turn's TTFA: that of its first segment (the first one that had audio)."""
        return self.segment_ttfa_s[0] if self.segment_ttfa_s else None

    def done_event(self) -> Done:
        audio_s = self.sent_s if self.cancelled else self.samples_in / MODEL_SAMPLE_RATE
        ttfa = self.ttfa_s()
        return Done(
            context_id=self.context.id,
            reason=self.done_reason(),
            ttfa_ms=None if ttfa is None else round(ttfa * 1000, 3),
            audio_s=round(audio_s, 6),
            frames=self.frames,
            rtf=round(self.gen_s / audio_s, 4) if audio_s > 0 and self.gen_s > 0 else None,
            segments=self.segments_total,
            text_chars=self.text_chars,
        )


@dataclass(slots=True, eq=False)
class _Segment:
    utterance: _Utterance
    text: str
    max_frames: int
    turn_id: str = ""
    # TTFA origin: handed to the engine, i.e. the moment it was complete (cut) and the
    # session's previous segment had ended: ready to generate
    submitted_at: float = 0.0
    has_audio: bool = False  # its first audio went to the encoder (encode worker)


# encode-worker jobs and outbox items --------------------------------------------------------

_AUDIO, _FINISH, _CLOSE = "audio", "finish", "close"


@dataclass(slots=True, eq=False)
class _Job:
    kind: str
    utterance: _Utterance
    pcm: np.ndarray | None = None
    segment: _Segment | None = None  # audio jobs: whose audio


_STOP_JOB: Final = object()


@dataclass(slots=True, eq=False)
class _Out:
    """An outbox item. Audio and ``done`` are completed at send time (seq, offset, TTFA)."""

    event: Any = None  # a ServerEvent, or None for audio/done
    utterance: _Utterance | None = None
    data: bytes = b""
    duration_s: float = 0.0
    is_done: bool = False
    first_of: tuple[_Segment, ...] = ()  # segments whose first audio this chunk carries


_CLOSE_OUT: Final = _Out()


class _SlowReader(Exception):
    pass


class _Outbox:
    """FIFO of server events, bounded by queued audio bytes and by queued events (any kind:
    a client sending cancels or bad frames without reading must not grow it either), with
    removal (for cancel) and a held-back side queue (``done`` events before ``ready``)."""

    def __init__(self, max_bytes: int, max_events: int) -> None:
        self._q: deque[_Out] = deque()
        self._held: deque[_Out] = deque()
        self._bytes = 0
        self._max = max_bytes
        self._max_events = max_events
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._q) + len(self._held)

    def put(self, item: _Out, *, hold: bool = False, force: bool = False) -> None:
        """Queue ``item`` (``hold``: in the side queue, until :meth:`release`). Raises
        ``_SlowReader`` once a bound is exceeded; ``force`` (the last events of a session,
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
            raise _SlowReader(
                f"the client is not reading its audio: {self._bytes} bytes are queued "
                f"(limit {self._max})"
            )
        if len(self) > self._max_events:
            raise _SlowReader(
                f"the client is not reading its events: {len(self)} are queued "
                f"(limit {self._max_events})"
            )

    def release(self) -> None:
        """Move the held-back items to the end of the queue, in order."""
        if self._held:
            self._q.extend(self._held)
            self._held.clear()
            self._ready.set()

    async def get(self) -> _Out:
        while not self._q:
            self._ready.clear()
            await self._ready.wait()
        item = self._q.popleft()
        self._bytes -= len(item.data)
        return item

    def purge(self, keep: Callable[[_Out], bool]) -> None:
        self._q = deque(i for i in self._q if keep(i))
        self._held = deque(i for i in self._held if keep(i))
        self._bytes = sum(len(i.data) for i in self._q)

    def clear(self) -> None:
        self.purge(lambda _: False)


class _Sink:
    """Engine callbacks (engine thread) -> the session's loop. Never blocks, never raises."""

    __slots__ = ("_loop", "_session")

    def __init__(self, loop: asyncio.AbstractEventLoop, session: Session) -> None:
        self._loop = loop
        self._session = session

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone, so is the session
            pass

    def on_ready(self, seq: Sequence, prefill_s: float) -> None:
        self._post(self._session._on_engine_ready, prefill_s)

    def on_audio(self, seq: Sequence, turn_id: str, pcm: np.ndarray, offset_s: float) -> None:
        self._post(self._session._on_engine_audio, turn_id, pcm)  # fresh per tick: no copy

    def on_turn_end(self, seq: Sequence, result: TurnResult) -> None:
        self._post(self._session._on_engine_turn_end, result)

    def on_error(self, seq: Sequence, message: str) -> None:
        self._post(self._session._on_engine_error, message)


# ============================================================================ the session


class Session:
    """Serves one WebSocket from accept to close. Create one per connection, ``await run()``."""

    def __init__(self, ws: WebSocket, runtime: Runtime, *,
                 denied: ProtocolError | None = None) -> None:
        self.ws = ws
        self.rt = runtime
        self._denied = denied  # refused at the door (bad credentials): told why, then closed
        self.settings = runtime.settings
        self.limits = runtime.settings.limits
        self.id = f"s{next(runtime.session_ids)}-{secrets.token_hex(4)}"
        self._sm = SessionStateMachine()
        self._encoding: Encoding | None = None
        self._request: TTSRequest | None = None
        self._output: EncoderConfig | None = None  # the validated output format of the request
        self._default_ctx: str | None = None
        self._seq: Sequence | None = None
        self._counted_live = False
        self._contexts: dict[str | None, _Context] = {}
        self._open_utts: set[_Utterance] = set()
        self._fifo: deque[_Segment] = deque()
        self._running: _Segment | None = None
        self._by_turn: dict[str, _Segment] = {}
        self._turn_ids = itertools.count()
        self._utt_ids = itertools.count()
        self._jobs: asyncio.Queue[Any] = asyncio.Queue(maxsize=encode_backlog_chunks(self.settings))
        self._outbox = _Outbox(self.limits.send_queue_bytes, self.limits.send_queue_events)
        self._ready_sent = False  # until then ``done`` events are held back (see _put)
        self._chunk_cap: int | None = None  # segment_room() of the session's voice
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._end: asyncio.Future[None] = self._loop.create_future()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        metrics = self.rt.metrics
        metrics.connections_total += 1
        metrics.connections_open += 1
        self.rt.sessions.add(self)
        try:
            try:
                await self.ws.accept()
            except Exception:  # handshake lost: nothing to clean up yet
                return
            # a refused session reads nothing: its "receiver" fails at once with the reason
            receiver = self._spawn(self._receive_loop() if self._denied is None
                                   else self._refuse(self._denied), "receive")
            sender = self._spawn(self._send_loop(), "send")
            encoder = self._spawn(self._encode_loop(), "encode")
            error: ProtocolError | None = None
            gone = False
            try:
                await self._end
            except ClientGone:
                gone = True
            except ProtocolError as exc:
                error = exc
            except Exception as exc:  # defensive: _fail only stores mapped errors
                error = self._to_protocol_error(exc)
            await self._shutdown(error, gone, receiver, sender, encoder)
        finally:
            self.rt.sessions.discard(self)
            metrics.connections_open -= 1
            if self._counted_live:
                metrics.sessions_live -= 1
            if self._seq is not None:  # idempotent; covers a handler cancelled mid-shutdown
                self.rt.engine.close(self._seq)
            for task in self._tasks:
                if not task.done():
                    task.cancel()

    @staticmethod
    async def _refuse(error: ProtocolError) -> None:
        raise error

    def server_stopping(self) -> None:
        """The server is shutting down: end the session now with a ``shutting_down`` error
        (close 1001), so the client knows to reconnect elsewhere rather than just seeing the
        socket drop. Call on the event loop."""
        self._on_failure(ProtocolError(
            ErrorCode.SHUTTING_DOWN,
            "the server is shutting down; reconnect (to another instance) to continue"))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._on_failure(exc)

        task = asyncio.create_task(guarded(), name=f"{self.id}-{name}")
        self._tasks.append(task)
        return task

    async def _shutdown(
        self,
        error: ProtocolError | None,
        gone: bool,
        receiver: asyncio.Task[None],
        sender: asyncio.Task[None],
        encoder: asyncio.Task[None],
    ) -> None:
        self._closing = True
        if self._sm.is_open:
            self._sm.transition(SessionState.CLOSING)
        receiver.cancel()
        if self._seq is not None:
            self.rt.engine.close(self._seq)  # frees the KV slot, stops any running turn
        for utt in list(self._open_utts):
            if error is not None or gone:
                utt.cancelled = True
        await self._stop_encoder(encoder)  # the worker closes the encoders it still holds
        if gone:
            sender.cancel()
        else:
            box = self._outbox
            if error is not None:
                box.clear()  # pending audio is moot; say what went wrong at once
                box.put(_Out(event=error.to_event()), force=True)
                box.put(_Out(event=Finish(reason="error", context_id=self._default_ctx)), force=True)
                self.rt.metrics.error(str(error.code))
                log.info("session %s: %s (%s)", self.id, error.code, error.message)
            else:
                box.release()  # a cancel's ``done`` held back by a prefill that never ended
                box.put(_Out(event=Finish(reason="stop", context_id=self._default_ctx)), force=True)
            box.put(_CLOSE_OUT, force=True)
            # After ``stop`` the client is owed all its audio, however slowly it reads (each
            # write is bounded by send_timeout_s); after an error only two small events remain.
            try:
                if error is None:
                    await asyncio.shield(sender)
                else:
                    await asyncio.wait_for(asyncio.shield(sender), _FINAL_TIMEOUT_S)
            except (TimeoutError, asyncio.CancelledError):
                sender.cancel()
            code = int(error.close_code) if error is not None else 1000
            reason = str(error.code) if error is not None else ""
            try:
                await asyncio.wait_for(self.ws.close(code=code, reason=reason), _FINAL_TIMEOUT_S)
            except Exception:  # already closed by the client, or it stopped reading
                pass
        try:
            await asyncio.wait_for(asyncio.shield(encoder), _FINAL_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            encoder.cancel()
        if self._sm.state is not SessionState.CLOSED:
            self._sm.transition(SessionState.CLOSED)

    async def _stop_encoder(self, encoder: asyncio.Task[None]) -> None:
        """Queue the encode worker's stop. Its queue is bounded: when it is full, the worker
        (which now only closes encoders, ``_closing`` is set) makes room quickly."""
        if encoder.done():
            return
        try:
            self._jobs.put_nowait(_STOP_JOB)
        except asyncio.QueueFull:
            try:
                await asyncio.wait_for(self._jobs.put(_STOP_JOB), _FINAL_TIMEOUT_S)
            except TimeoutError:
                encoder.cancel()

    def _finish_ok(self) -> None:
        if not self._end.done():
            self._end.set_result(None)

    # ------------------------------------------------------------------------- failures

    def _on_failure(self, exc: BaseException) -> None:
        """THE error boundary: every failure of this session ends up here exactly once."""
        if self._closing or self._end.done():
            return  # after the end was decided, late failures (a dying socket) change nothing
        if isinstance(exc, ClientGone | WebSocketDisconnect):
            if not self._end.done():
                self._end.set_exception(ClientGone())
            return
        error = self._to_protocol_error(exc)
        if error.fatal:
            if not self._end.done():
                self._end.set_exception(error)
            return
        self._report(error.to_event())

    def _report(self, event: Error) -> None:
        """Send a non-fatal ``error`` event; the session goes on."""
        self.rt.metrics.error(event.code)
        try:
            self._outbox.put(_Out(event=event))
        except _SlowReader as slow:
            self._on_failure(slow)

    def _to_protocol_error(self, exc: BaseException) -> ProtocolError:
        """Map any exception to its protocol error (code, and so fatal-or-not and close code)."""
        if isinstance(exc, ProtocolError):
            return exc
        if isinstance(exc, EngineOverloaded):
            return ProtocolError(ErrorCode.OVERLOADED, f"the engine is at capacity: {exc}")
        if isinstance(exc, TurnTooLong | VoiceLimitError | ReferenceAudioTooLong):
            return ProtocolError(ErrorCode.TOO_LARGE, str(exc))
        if isinstance(exc, UnknownVoice):
            return ProtocolError(ErrorCode.UNKNOWN_VOICE, str(exc))
        if isinstance(exc, _SlowReader):
            self.rt.metrics.slow_clients += 1
            log.warning("session %s: dropping a slow client: %s", self.id, exc)
            return ProtocolError(ErrorCode.TIMEOUT, str(exc))
        if isinstance(exc, TimeoutError):
            return ProtocolError(ErrorCode.TIMEOUT, str(exc) or "operation timed out")
        log.error("session %s: internal error", self.id, exc_info=exc)
        return ProtocolError(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__})")

    # ------------------------------------------------------------------------- receiving

    async def _receive_loop(self) -> None:
        idle = self.limits.idle_timeout_s
        while True:
            try:
                async with asyncio.timeout(idle):
                    message = await self.ws.receive()
            except TimeoutError:
                if self._busy():
                    continue  # generating for this client is activity too: wait another period
                raise ProtocolError(
                    ErrorCode.TIMEOUT, f"no message for {idle:g} s and nothing to generate"
                ) from None
            if message["type"] == "websocket.disconnect":
                raise ClientGone()
            data = message.get("bytes")
            if data is None:
                data = message.get("text")
            if data is None:
                continue
            try:
                event = decode_client(data, max_bytes=self.limits.max_message_bytes)
                if self._encoding is None:
                    self._encoding = encoding_of(data)
                await self._dispatch(event)
            except ProtocolError as exc:
                if self._encoding is None:
                    self._encoding = encoding_of(data)  # answer in the client's encoding
                self._on_failure(exc)
            except (ClientGone, WebSocketDisconnect):
                raise
            except Exception as exc:
                self._on_failure(exc)
            if self._end.done():
                return
            if len(self._outbox):
                # Frames already buffered are received without a suspension: let the sender
                # drain what this one queued, so a burst (of cancels, say) from a client that
                # does read is not mistaken for a slow reader.
                await asyncio.sleep(0)

    def _busy(self) -> bool:
        return self._running is not None or bool(self._fifo) or any(
            u.flushed for u in self._open_utts
        )

    async def _dispatch(self, event: ClientEvent) -> None:
        if isinstance(event, Start):
            await self._on_start(event)
            return
        self._sm.apply(event)  # invalid_state for events not allowed now
        if isinstance(event, Text):
            self._on_text(event.context_id, event.text)
        elif isinstance(event, Flush):
            self._on_flush(event.context_id)
        elif isinstance(event, Cancel):
            self._on_cancel(event.context_id)
        elif isinstance(event, Stop):
            self._on_stop()

    # ------------------------------------------------------------------------- start

    async def _on_start(self, event: Start) -> None:
        self._sm.check_event(event)
        req = event.request
        rt = self.rt
        if rt.metrics.sessions_live >= self.limits.max_sessions:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"the server is at its session limit ({self.limits.max_sessions}); retry later",
            )
        # Reserve the session slot before the first await, so that concurrent starts cannot
        # all pass the check above; a start that fails gives it back.
        rt.metrics.sessions_live += 1
        self._counted_live = True
        try:
            await self._start(event, req)
        except BaseException:
            rt.metrics.sessions_live -= 1
            self._counted_live = False
            raise

    async def _start(self, event: Start, req: TTSRequest) -> None:
        rt = self.rt
        try:  # validates format, rate and bitrates, with messages naming what is supported
            output = EncoderConfig(
                req.format,
                req.sample_rate,
                mp3_bitrate=req.mp3_bitrate,
                opus_bitrate=req.opus_bitrate,
            )
        except ValueError as exc:
            raise ProtocolError(ErrorCode.UNSUPPORTED_FORMAT, str(exc)) from None
        params = self._sampling(req)
        references = await self._references(req)
        # Cap chunk_length so that any segment fits the context next to this voice prompt
        # (the engine would otherwise refuse a long segment of wide characters: too_large).
        self._chunk_cap = check_voice_room(rt.engine, references, self.limits.min_chunk_length)
        self._sm.apply(event)  # -> prefilling: from here on text is buffered
        self._request = req
        self._output = output
        self._default_ctx = req.context_id if req.context_id is not None else event.context_id
        rt.metrics.sessions_total += 1
        # Prefill starts now, before any text: it never counts in a turn's TTFA.
        self._seq = rt.engine.open(references, params, _Sink(self._loop, self))
        if req.text:  # Fish's legacy SDK may put the text in the request itself
            self._on_text(None, req.text)

    def _sampling(self, req: TTSRequest) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None else self.settings.engine.default_top_k
        top_p = req.top_p
        if top_p <= 0.0:  # "no nucleus" = keep only the most likely token
            top_p, top_k = 1.0, 1
        seed = None if req.seed is None else req.seed % (2**31)
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=top_p, top_k=top_k, seed=seed
            )
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), event="start") from None

    async def _references(self, req: TTSRequest) -> list[Reference]:
        """The voice: a stored voice (``reference_id`` wins) or inline clips, encoded to codes
        with the codec encoder off the event loop."""
        rt = self.rt
        if req.reference_id is not None:
            try:
                voice = await asyncio.to_thread(rt.store.get, req.reference_id)
            except UnknownVoice:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_VOICE, f"no stored voice with id {req.reference_id!r}"
                ) from None
            codes = torch.from_numpy(np.array(voice.codes, dtype=np.int64))
            return [Reference(voice.transcript, codes)]
        if len(req.references) > self.limits.max_references:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{len(req.references)} references; the limit is {self.limits.max_references}",
            )
        refs: list[Reference] = []
        for i, ref in enumerate(req.references):
            if not ref.text.strip():
                raise ProtocolError(
                    ErrorCode.BAD_REFERENCE_AUDIO, f"references[{i}].text (the transcript) is empty"
                )
            refs.append(await self._encode_reference(ref.audio, ref.text, f"references[{i}]"))
        return refs

    async def _encode_reference(self, audio: bytes, text: str, what: str) -> Reference:
        reference, _, _ = await encode_reference_bytes(self.rt, audio, text, what)
        return reference

    # ------------------------------------------------------------------------- text, flush

    def _context(self, context_id: str | None, *, create: bool) -> _Context | None:
        key = context_id if context_id is not None else self._default_ctx
        ctx = self._contexts.get(key)
        if ctx is not None or not create:
            return ctx
        assert self._request is not None
        chunk = min(
            max(self._request.chunk_length, self.limits.min_chunk_length),
            self.limits.max_chunk_length,
        )
        if self._chunk_cap is not None:  # what the context holds next to the voice prompt
            chunk = max(1, min(chunk, self._chunk_cap))
        ctx = _Context(key, Segmenter(chunk))
        self._contexts[key] = ctx
        return ctx

    def _on_text(self, context_id: str | None, text: str) -> None:
        ctx = self._context(context_id, create=True)
        assert ctx is not None
        if ctx.open is None and not text.strip():
            # Nothing to say (empty or whitespace) opens no turn: a flush after it is a no-op.
            self._forget_idle_context(ctx)
            return
        if not ctx.live and sum(c.live for c in self._contexts.values()) >= self.limits.max_contexts:
            self._forget_idle_context(ctx)
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"too many contexts with unfinished work (limit {self.limits.max_contexts}); "
                "flush or cancel one first",
                context_id=ctx.id,
                event="text",
            )
        if ctx.unspoken_chars + len(text) > self.limits.max_text_chars:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"context {ctx.id!r} would hold {ctx.unspoken_chars + len(text)} unspoken "
                f"characters; the limit is {self.limits.max_text_chars}",
                context_id=ctx.id,
                event="text",
            )
        utt = ctx.open
        if utt is None:
            utt = ctx.open = _Utterance(ctx, next(self._utt_ids))
            self._open_utts.add(utt)
        utt.text_chars += len(text)
        before = ctx.segmenter.buffered
        segments = ctx.segmenter.push(text)
        ctx.unspoken_chars += ctx.segmenter.buffered - before + sum(len(s) for s in segments)
        self._queue_segments(utt, segments)

    def _forget_idle_context(self, ctx: _Context) -> None:
        if not ctx.live and ctx.next_seq == 0:
            self._contexts.pop(ctx.id, None)

    def _evict_idle_contexts(self) -> None:
        """Idle contexts keep their sequence numbers and offsets for a later turn, but a
        client cycling through context ids must not grow the session without bound: beyond
        4 x max_contexts, the oldest idle ones are forgotten (a reused id then restarts at 0)."""
        excess = len(self._contexts) - 4 * self.limits.max_contexts
        if excess <= 0:
            return
        for key in [k for k, c in self._contexts.items() if not c.live][:excess]:
            del self._contexts[key]

    def _on_flush(self, context_id: str | None) -> None:
        ctx = self._context(context_id, create=False)
        if ctx is None or ctx.open is None:
            return  # nothing pending in this context: a flush is a no-op
        self._close_utterance(ctx)
        self._pump()

    def _close_utterance(self, ctx: _Context) -> None:
        utt = ctx.open
        assert utt is not None
        before = ctx.segmenter.buffered
        segments = ctx.segmenter.flush()
        ctx.unspoken_chars += sum(len(s) for s in segments) - before
        self._queue_segments(utt, segments)
        utt.flushed = True
        ctx.open = None
        ctx.pending.append(utt)
        self._maybe_finish_utterance(utt)

    def _queue_segments(self, utt: _Utterance, segments: list[str]) -> None:
        if not segments:
            return
        frame_rate = self.rt.engine.frame_rate
        req_max = self._request.max_new_tokens if self._request is not None else None
        for text in segments:
            budget = frame_budget(self.settings, text, req_max, frame_rate)
            self._fifo.append(_Segment(utt, text, budget))
            utt.segments_total += 1
        self._pump()

    def _on_stop(self) -> None:
        for ctx in list(self._contexts.values()):
            if ctx.open is not None:
                self._close_utterance(ctx)
        self._pump()
        self._check_drained()

    # ------------------------------------------------------------------------- cancel

    def _on_cancel(self, context_id: str | None) -> None:
        ctx = self._context(context_id, create=False)
        key = context_id if context_id is not None else self._default_ctx
        utts = ctx.utterances() if ctx is not None else []
        if ctx is not None:
            ctx.segmenter.clear()
            ctx.open = None
            ctx.pending = []
            ctx.unspoken_chars = 0
        if not utts:
            # Nothing to stop: still acknowledge, so a client can always wait for ``done``.
            self._put(_Out(event=Done(context_id=key, reason="cancelled")))
            self.rt.metrics.turn_done("cancelled")
            return
        targets = set(utts)
        for utt in utts:
            utt.cancelled = True
            self._queue_job(_Job(_CLOSE, utt))
        self._fifo = deque(s for s in self._fifo if s.utterance not in targets)
        # No audio of these utterances after this point, even if already queued for sending.
        self._outbox.purge(lambda item: item.utterance not in targets or item.is_done)
        running = self._running
        if running is not None and running.utterance in targets and self._seq is not None:
            self.rt.engine.cancel(self._seq)  # stops before its next decode step
            # ``done`` follows the engine's acknowledgement (on_turn_end) with the real frames.
        for utt in utts:
            if running is None or running.utterance is not utt:
                self._finish_cancelled(utt)
        self._check_drained()

    def _finish_cancelled(self, utt: _Utterance) -> None:
        if utt.finished:
            return
        utt.finished = True
        self._open_utts.discard(utt)
        self._put(_Out(utterance=utt, is_done=True))
        self._evict_idle_contexts()

    # ------------------------------------------------------------------------- engine side

    def _pump(self) -> None:
        """Hand the next segment to the engine when the previous one has ended."""
        if self._closing or self._seq is None or not self._sm.is_prefilled:
            return
        while self._running is None and self._fifo:
            seg = self._fifo.popleft()
            if seg.utterance.cancelled:
                continue
            seg.turn_id = f"{self.id}.{next(self._turn_ids)}"
            seg.submitted_at = time.perf_counter()  # the segment's TTFA origin
            self.rt.engine.submit(self._seq, seg.text, turn_id=seg.turn_id, max_frames=seg.max_frames)
            self._running = seg
            self._by_turn[seg.turn_id] = seg
            self.rt.metrics.segments_total += 1
            if self._sm.state is not SessionState.GENERATING:
                self._sm.transition(SessionState.GENERATING)
        if self._running is None and self._sm.state is SessionState.GENERATING:
            self._sm.transition(SessionState.IDLE)

    def _guard_callback(self, fn: Callable[[], None]) -> None:
        if self._closing:
            return
        try:
            fn()
        except Exception as exc:
            self._on_failure(exc)

    def _on_engine_ready(self, prefill_s: float) -> None:
        def run() -> None:
            if self._sm.state is not SessionState.PREFILLING:
                return
            self._sm.transition(SessionState.READY)
            self.rt.metrics.observe_prefill(prefill_s)
            self._put(_Out(event=self._ready_event(prefill_s)))
            self._ready_sent = True
            self._outbox.release()  # ``done`` events of cancels during the prefill
            self._pump()

        self._guard_callback(run)

    def _ready_event(self, prefill_s: float) -> Ready:
        req, output = self._request, self._output
        assert req is not None and output is not None
        limits = self.limits
        return Ready(
            context_id=self._default_ctx,
            format=req.format,
            sample_rate=output.sample_rate,
            frame_rate_hz=self.rt.engine.frame_rate,
            prefill_ms=round(prefill_s * 1000, 3),
            limits=Limits(
                max_message_bytes=limits.max_message_bytes,
                max_text_chars=limits.max_text_chars,
                max_contexts=limits.max_contexts,
                max_new_tokens=min(req.max_new_tokens, self.settings.engine.max_turn_frames),
                max_reference_s=limits.max_reference_s,
                idle_timeout_s=limits.idle_timeout_s,
            ),
            model=self.rt.bundle.name,
            session_id=self.id,
            reference_id=req.reference_id,
        )

    def _on_engine_audio(self, turn_id: str, pcm: np.ndarray) -> None:
        def run() -> None:
            seg = self._by_turn.get(turn_id)
            if seg is None or seg.utterance.cancelled or pcm.size == 0:
                return
            seg.utterance.samples_in += pcm.shape[0]
            self._queue_job(_Job(_AUDIO, seg.utterance, pcm, seg))

        self._guard_callback(run)

    def _on_engine_turn_end(self, result: TurnResult) -> None:
        def run() -> None:
            seg = self._by_turn.pop(result.turn_id, None)
            if seg is None:
                return
            if self._running is seg:
                self._running = None
            utt = seg.utterance
            ctx = utt.context
            if not utt.cancelled:
                ctx.unspoken_chars = max(0, ctx.unspoken_chars - len(seg.text))
            utt.frames += result.frames
            utt.segments_done += 1
            self.rt.metrics.frames_total += result.frames
            if result.reason is FinishReason.ERROR and not utt.cancelled:
                self._turn_error(seg, result)  # raises for our own failures (fatal)
            if result.ready_at is not None:
                utt.gen_s += max(0.0, result.decode_s)
            utt.reasons.add(str(result.reason))
            if utt.cancelled:
                self._finish_cancelled(utt)
            else:
                self._maybe_finish_utterance(utt)
            self._pump()
            self._check_drained()

        self._guard_callback(run)

    def _turn_error(self, seg: _Segment, result: TurnResult) -> None:
        """A segment the engine failed, by whose fault (``TurnResult.error_code``): the
        client's (``too_large``: it does not fit the context) or the caller's
        (``invalid_state``) end this turn with ``done{reason: "error"}`` after a non-fatal
        ``error`` event, and the session goes on; our own (``internal``, or no code) is fatal."""
        message = result.error or "engine error"
        code = {"too_large": ErrorCode.TOO_LARGE, "invalid_state": ErrorCode.INVALID_STATE}.get(
            result.error_code or "internal"
        )
        if code is None:
            raise ProtocolError(ErrorCode.INTERNAL, f"generation failed: {message}")
        log.info("session %s: segment %s refused (%s): %s", self.id, seg.turn_id, code, message)
        self._report(
            Error(
                code=str(code),
                message=f"a segment of this turn was not spoken: {message}",
                fatal=False,
                context_id=seg.utterance.context.id,
            )
        )

    def _on_engine_error(self, message: str) -> None:
        def run() -> None:
            raise ProtocolError(ErrorCode.INTERNAL, f"the engine failed this session: {message}")

        self._guard_callback(run)

    def _maybe_finish_utterance(self, utt: _Utterance) -> None:
        if utt.flushed and not utt.cancelled and utt.segments_done == utt.segments_total:
            self._queue_job(_Job(_FINISH, utt))

    def _queue_job(self, job: _Job) -> None:
        """Hand a job to the encode worker. Never waits (engine callbacks come through here):
        a full backlog means the session cannot keep up, and it is dropped as too slow."""
        try:
            self._jobs.put_nowait(job)
        except asyncio.QueueFull:
            raise _SlowReader(
                f"the audio encoder is {self._jobs.maxsize} chunks behind the engine"
            ) from None

    def _check_drained(self) -> None:
        """After ``stop``: once every utterance's ``done`` is queued, finish the session."""
        if self._sm.stopping and not self._open_utts and not self._fifo and self._running is None:
            self._finish_ok()

    # ------------------------------------------------------------------------- encoding

    async def _encode_loop(self) -> None:
        """Per-session, ordered: audio chunks -> encoder (thread pool) -> outbox."""
        loop = self._loop
        pool = self.rt.encode_pool
        req_fmt: TTSRequest | None = None
        try:
            while True:
                job = await self._jobs.get()
                if job is _STOP_JOB:
                    return
                utt: _Utterance = job.utterance
                if job.kind == _CLOSE or utt.cancelled or self._closing:
                    self._close_encoder(utt)
                    continue
                req_fmt = req_fmt or self._request
                assert req_fmt is not None
                if utt.encoder is None and (job.kind == _AUDIO or utt.samples_in):
                    utt.encoder = await loop.run_in_executor(pool, _new_encoder, req_fmt)
                data = b""
                if job.kind == _AUDIO:
                    assert job.pcm is not None and utt.encoder is not None
                    data = await loop.run_in_executor(pool, utt.encoder.encode, job.pcm)
                elif utt.encoder is not None:  # _FINISH
                    data = await loop.run_in_executor(pool, utt.encoder.finish)
                    utt.encoder = None
                if utt.cancelled or self._closing:  # cancelled while the pool was encoding
                    self._close_encoder(utt)
                    continue
                # Audio an encoder holds back (resampler/codec delay) is accounted to the chunk
                # that finally carries it, so the durations of a turn's chunks add up.
                utt.carry_s += job.pcm.shape[0] / MODEL_SAMPLE_RATE if job.pcm is not None else 0.0
                seg = job.segment
                if seg is not None and not seg.has_audio:
                    seg.has_audio = True
                    utt.awaiting_audio.append(seg)
                if data:
                    first_of = tuple(utt.awaiting_audio)
                    utt.awaiting_audio.clear()
                    self._put(
                        _Out(utterance=utt, data=data, duration_s=utt.carry_s, first_of=first_of)
                    )
                    utt.carry_s = 0.0
                if job.kind == _FINISH:
                    self._finish_utterance(utt)
        finally:
            for utt in list(self._open_utts):
                self._close_encoder(utt)

    def _finish_utterance(self, utt: _Utterance) -> None:
        utt.finished = True
        self._open_utts.discard(utt)
        ctx = utt.context
        if utt in ctx.pending:
            ctx.pending.remove(utt)
        self._put(_Out(utterance=utt, is_done=True))
        self._evict_idle_contexts()
        self._check_drained()

    @staticmethod
    def _close_encoder(utt: _Utterance) -> None:
        enc, utt.encoder = utt.encoder, None
        if enc is not None:
            try:
                enc.close()
            except Exception:  # closing a half-written stream must not fail the session
                log.debug("encoder close failed", exc_info=True)

    # ------------------------------------------------------------------------- sending

    def _put(self, item: _Out) -> None:
        # ``ready`` comes first: a ``done`` before it (a cancel during the prefill) waits.
        hold = not self._ready_sent and (item.is_done or isinstance(item.event, Done))
        self._outbox.put(item, hold=hold)  # _SlowReader propagates to the failure boundary

    async def _send_loop(self) -> None:
        metrics = self.rt.metrics
        timeout = self.limits.send_timeout_s
        while True:
            item = await self._outbox.get()
            if item is _CLOSE_OUT:
                return
            event = item.event
            utt = item.utterance
            if utt is not None and item.is_done:
                event = utt.done_event()
                metrics.turn_done(event.reason)
                if not utt.cancelled:
                    metrics.audio_seconds_total += event.audio_s
            elif utt is not None:
                ctx = utt.context
                duration = item.duration_s
                event = Audio(
                    context_id=ctx.id,
                    audio=item.data,
                    seq=ctx.next_seq,
                    offset_s=round(ctx.sent_s, 6),
                    duration_s=round(duration, 6),
                )
                ctx.next_seq += 1
                ctx.sent_s += duration
                utt.sent_s += duration
                metrics.audio_bytes_total += len(item.data)
                if item.first_of:  # TTFA of these segments: their first audio goes out now
                    now = time.perf_counter()
                    for seg in item.first_of:
                        ttfa = max(0.0, now - seg.submitted_at)
                        utt.segment_ttfa_s.append(ttfa)
                        metrics.observe_ttfa(ttfa)
            frame = encode_server(event, self._encoding or Encoding.MSGPACK)
            try:
                async with asyncio.timeout(timeout):
                    if isinstance(frame, bytes):
                        await self.ws.send_bytes(frame)
                    else:
                        await self.ws.send_text(frame)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.TIMEOUT,
                    f"the client accepted no data for {timeout:g} s (it is not reading)",
                ) from None
            except (OSError, RuntimeError, WebSocketDisconnect):
                raise ClientGone() from None


def _new_encoder(req: TTSRequest) -> AudioEncoder:
    return make_encoder(
        req.format, req.sample_rate, mp3_bitrate=req.mp3_bitrate, opus_bitrate=req.opus_bitrate
    )


async def encode_reference_bytes(
    rt: Runtime, audio: bytes, text: str, what: str
) -> tuple[Reference, int, float]:
    """Reference clip bytes -> (prompt ``Reference`` with codes, clip sample rate, clip
    seconds), decoded and encoded in the codec pool. Raises ``ProtocolError``
    (bad_reference_audio / too_large). Shared with the voices REST endpoint, which stores the
    codes."""
    loop = asyncio.get_running_loop()
    max_s = rt.settings.limits.max_reference_s
    try:
        wav, rate = await loop.run_in_executor(
            rt.codec_pool, lambda: decode_reference_audio(audio, max_seconds=max_s)
        )
    except ReferenceAudioTooLong as exc:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what}: {exc}") from None
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REFERENCE_AUDIO, f"{what}: {exc}") from None
    frame_s = rt.engine.frame_samples / rt.engine.sample_rate
    if wav.shape[0] / rate < frame_s:
        raise ProtocolError(
            ErrorCode.BAD_REFERENCE_AUDIO,
            f"{what}: the clip is shorter than one codec frame ({frame_s * 1000:.0f} ms)",
        )
    try:
        reference = await loop.run_in_executor(
            rt.codec_pool, encode_reference, rt.bundle, wav, rate, text
        )
    except Exception as exc:  # a clip the codec cannot take (odd lengths, NaNs...)
        log.warning("reference encoding failed", exc_info=True)
        raise ProtocolError(
            ErrorCode.BAD_REFERENCE_AUDIO, f"{what}: the codec could not encode it: {exc}"
        ) from None
    return reference, rate, wav.shape[0] / rate
