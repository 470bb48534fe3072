"""One live TTS connection: the socket loop driving the protocol state machine, the session's
turns (rtvoice/turns.py, sans I/O) and the engine.

Data flow of a session (everything below runs on the event loop unless marked)::

    client frames --> receive loop --> Turns (contexts, segmenters, FIFO of segments)
        --> Engine.submit (one segment at a time per session)
    engine thread: on_ready / on_audio / on_turn_end --call_soon_threadsafe--> loop
        --> encode worker (per session, ordered; encoders run in a thread pool)
        --> outbox (bounded) --> sender task --> socket

Failures: every exception, wherever it is raised (receive loop, engine callbacks, encode
worker, sender), reaches :meth:`Session._on_failure`, the one place that maps it to an
``ErrorCode`` (and so, through ``protocol.error_spec``, to fatal-or-not and a close code). A
non-fatal error becomes an ``error`` event and the session goes on; a fatal one ends the
session with ``error``, ``finish{reason: "error"}`` and the error's close code. Nothing a
session does can raise into another session, the engine thread or the server. One exception
to "the code decides": a segment the engine refuses for the client's reasons (``too_large``:
it does not fit the context; ``invalid_state``) ends its turn with ``done{reason: "error"}``
after a non-fatal ``error`` event, and the session goes on.

Ordering: ``ready`` is the first event after ``start`` other than ``error``: a ``done`` that
comes about during the prefill (a ``cancel``) is held back until ``ready`` is queued.

Memory: everything queued per session is bounded. Text and contexts by `Turns`; events waiting
for the socket by ``send_queue_events`` and their audio by ``send_queue_bytes`` (`Outbox`); raw
audio waiting for the encoder by :func:`encode_backlog_chunks`. A client that lets a bound
overflow is too slow (or abusive) and is dropped with ``error{timeout}``; engine callbacks
never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
import starlette.websockets
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.config import EngineConfig
from engine.request import Sequence, TurnResult
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
    event_name,
)
from rtvoice import logs
from rtvoice.audio_formats import AudioEncoder, EncoderConfig, encoder_for
from rtvoice.encoder_calls import EncoderCalls
from rtvoice.outbox import CLOSE, Out, Outbox, SlowReader
from rtvoice.runtime import Runtime, known_error
from rtvoice.timestamps import segment_event
from rtvoice.turns import Segment, Turns, Utterance

__all__ = ["Session", "encode_backlog_chunks"]

# raised by a receive after the disconnect message was already taken (newer Starlettes)
WebSocketDisconnected: type[Exception] = getattr(
    starlette.websockets, "WebSocketDisconnected", type("_NeverRaised", (Exception,), {}))

log = logging.getLogger(__name__)

_FINAL_TIMEOUT_S: Final = 5.0  # last events + close to a client that may not read any more


def encode_backlog_chunks(engine: EngineConfig, chunk_frames: int | None = None) -> int:
    """Raw audio chunks (float32 PCM, usually ``chunk_frames`` frames, the session's or the
    engine's: 64 KiB by default; up to twice that for a stream far ahead of realtime) that
    may wait for a session's encoder: the chunks of two longest segments
    (``max_turn_frames``), 528 by default. The encoder falls this far behind the engine only
    when its thread pool is starved; the session is then dropped like a slow reader (the
    engine never waits for a session)."""
    return 2 * math.ceil(engine.max_turn_frames / (chunk_frames or engine.chunk_frames)) + 16


class ClientGone(Exception):
    """The client closed the socket or vanished; nothing more can be sent."""


class _Lapsed(Exception):
    """A socket kept open after ``finish{stop}`` saw no new ``start`` in time."""


# encode-worker jobs ---------------------------------------------------------------------------
_AUDIO, _ENDED, _FINISH, _CLOSE = "audio", "ended", "finish", "close"


@dataclass(slots=True, eq=False)
class _Job:
    kind: str
    utterance: Utterance
    pcm: np.ndarray | None = None
    segment: Segment | None = None  # audio jobs: whose audio; ended: which segment


_STOP_JOB: Final = object()


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


class Session:
    """Serves one WebSocket from accept to close. Create one per connection, ``await run()``."""

    def __init__(self, ws: WebSocket, runtime: Runtime, *,
                 denied: ProtocolError | None = None, key: int | None = None,
                 reused: bool = False) -> None:
        """`reused`: the socket (accepted already) carried a session that ended with
        ``finish{stop}``; this one waits for its next ``start``."""
        self.ws = ws
        self.rt = runtime
        self._denied = denied  # refused at the door (bad credentials): told why, then closed
        self._key = key  # which API key it presented (its index), None: authentication off
        self._reused = reused
        self.reusable = False  # after run(): it ended with finish{stop}, the socket is open
        self.settings = runtime.settings
        self.limits = runtime.settings.limits
        self.id = f"s{next(runtime.session_ids)}-{secrets.token_hex(4)}"
        self.sample_rate = runtime.engine.sample_rate  # of the PCM the engine hands over
        self._sm = SessionStateMachine()
        self._encoding: Encoding | None = None
        self._request: TTSRequest | None = None
        self._output: EncoderConfig | None = None  # the validated output format of the request
        self._timestamps = False  # send ``segment`` events (the request's ``timestamps``)
        self._default_ctx: str | None = None
        self._seq: Sequence | None = None
        self._counted_live = False
        self._unstarted = False  # counted in metrics.unstarted (connected, no 'start' yet)
        self._draining = False  # the server drains: end once the turns are done
        self._drained = False  # ... and they are: the last audio goes out before the error
        self.turns: Turns | None = None  # from `start` on
        # bounded by _queue_job, in the session's chunks (known at `start`)
        self._jobs: asyncio.Queue[Any] = asyncio.Queue()
        self._backlog = encode_backlog_chunks(self.settings.engine)
        self._raw_bytes = 0  # PCM in _jobs
        self._outbox = Outbox(self.limits.send_queue_bytes, self.limits.send_queue_events)
        self._ready_sent = False  # until then ``done`` events are held back (see _put)
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._calls = EncoderCalls(self._loop, runtime.encode_pool)
        self._end: asyncio.Future[None] = self._loop.create_future()
        self._tasks: list[asyncio.Task[None]] = []
        self._opened_at = time.perf_counter()
        self._voice = "-"  # for the log: which voice it uses (from start on)
        self._turns_done = 0
        self._audio_sent_s = 0.0

    # ------------------------------------------------------------------------- lifecycle

    async def run(self) -> bool:
        """Serve the socket until the session ends. True: it ended with ``finish{stop}`` and
        the socket is still open for another session (`reusable`); the caller then runs a
        `Session(..., reused=True)` on it, else the socket is closed."""
        logs.SESSION.set(self.id)  # every line this session's tasks log names it
        metrics = self.rt.metrics
        self.rt.sessions.add(self)
        try:
            if not self._reused:
                try:
                    await self.ws.accept()
                except Exception:  # handshake lost: nothing to clean up yet
                    return False
            if self._reused:  # waits for another start, in the lingering set
                self.rt.lingering[self] = None
                metrics.lingering += 1
            elif self._denied is None:
                self._unstarted = True
                metrics.unstarted += 1
            # a refused session reads nothing: its "receiver" fails at once with the reason
            receiver = self._spawn(self._receive_loop() if self._denied is None
                                   else self._refuse(self._denied), "receive")
            sender = self._spawn(self._send_loop(), "send")
            encoder = self._spawn(self._encode_loop(), "encode")
            error: ProtocolError | None = None
            gone = lapsed = False
            try:
                await self._end
            except ClientGone:
                gone = True
            except _Lapsed:
                lapsed = True
            except ProtocolError as exc:
                error = exc
            except Exception as exc:  # defensive: _fail only stores mapped errors
                error = self._to_protocol_error(exc)
            await self._shutdown(error, gone, receiver, sender, encoder, lapsed=lapsed)
            if self.reusable and (self._draining or self.rt.stopping):  # drained meanwhile
                self.reusable = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(code=1001, reason="shutting_down"),
                                           _FINAL_TIMEOUT_S)
            return self.reusable
        finally:
            self._closing = True
            self._started()
            self.rt.sessions.discard(self)
            if self._counted_live:
                self._counted_live = False
                self.rt.release_session(self._key)
            if self._seq is not None:  # idempotent; covers a handler cancelled mid-shutdown
                self.rt.engine.close(self._seq)
            for task in self._tasks:
                if not task.done():
                    task.cancel()
            self._release()

    def _release(self) -> None:
        """Let go of what the session held (text, contexts, the request's reference audio),
        so that its memory is freed when the socket closes, not when the cycle collector
        next runs."""
        if self.turns is not None:
            self.turns.close()
        # the session refers to these and they to it (turns: their port; the engine
        # sequence: its sink): break the cycles
        self.turns = None
        self._seq = None
        self._tasks.clear()
        self._outbox.clear()
        self._request = None
        if self._end.done() and not self._end.cancelled():
            # the error that ended it, and those it was raised from: their tracebacks' frames
            # refer to the session
            exc: BaseException | None = self._end.exception()
            for _ in range(8):
                if exc is None:
                    break
                exc.__traceback__ = None
                exc = exc.__cause__ or exc.__context__



    @staticmethod
    async def _refuse(error: ProtocolError) -> None:
        raise error

    def lapse(self) -> None:
        """A lingering socket (after finish{stop}) gives its place to a new connection:
        closed 1000, as when reuse_timeout_s runs out. Call on the event loop."""
        self._on_failure(_Lapsed())

    def _started(self) -> None:
        """No longer a connection waiting to send 'start' (it did, or it ended)."""
        if self.rt.lingering.pop(self, False) is None:
            self.rt.metrics.lingering -= 1
        if self._unstarted:
            self._unstarted = False
            self.rt.metrics.unstarted -= 1

    @property
    def queued_bytes(self) -> int:
        """Audio waiting for the socket (encoded) and for the encoder (raw PCM)."""
        return self._outbox.queued_bytes + self._raw_bytes

    def drain(self) -> None:
        """The server drains: the session ends (``shutting_down``, close 1001) as soon as its
        turns are done — at once when it has none. Call on the event loop."""
        self._draining = True
        self._end_if_drained()

    def _end_if_drained(self) -> None:
        if self._draining and not self._closing and (self.turns is None or self.turns.drained):
            self._drained = True
            self.server_stopping()

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
        *,
        lapsed: bool = False,
    ) -> None:
        """End the session: stop the engine's work, send what is owed (all audio after a
        ``stop``; the error after a failure), ``finish``, and close the socket — or leave it
        open for another ``start`` after a clean ``finish{stop}`` (Fish's clients reuse it).
        `lapsed`: a reused socket saw no new ``start`` in time: closed 1000, nothing sent."""
        self._closing = True
        if error is not None and self._denied is None:
            self.rt.metrics.dropped(_drop_cause(error))
        if self.turns is not None:
            self.turns.accepting = False
        if self._sm.is_open:
            self._sm.transition(SessionState.CLOSING)
        receiver.cancel()
        if self._seq is not None:
            self.rt.engine.close(self._seq)  # frees its KV blocks, stops any running turn
        if self.turns is not None and (error is not None or gone):
            for utt in list(self.turns.open_utterances):
                utt.cancelled = True
        await self._stop_encoder(encoder)  # the worker closes the encoders it still holds
        if gone:
            sender.cancel()
        elif lapsed:
            sender.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=1000, reason="no start after finish"),
                                       _FINAL_TIMEOUT_S)
        else:
            box = self._outbox
            if error is not None:
                if not self._drained:
                    box.clear()  # pending audio is moot; say what went wrong at once
                else:
                    box.release()
                box.put(Out(event=error.to_event()), force=True)
                box.put(Out(event=Finish(reason="error", context_id=self._default_ctx)), force=True)
                self.rt.metrics.error(str(error.code))
                log.info("session %s: %s (%s)", self.id, error.code, error.message)
            else:
                box.release()  # a cancel's ``done`` held back by a prefill that never ended
                box.put(Out(event=Finish(reason="stop", context_id=self._default_ctx)), force=True)
            box.put(CLOSE, force=True)
            # After ``stop`` the client is owed all its audio, however slowly it reads (each
            # write is bounded by send_timeout_s); after an error only two small events remain.
            try:
                if error is None or self._drained:  # owed all its audio, then the close
                    await asyncio.shield(sender)
                else:
                    await asyncio.wait_for(asyncio.shield(sender), _FINAL_TIMEOUT_S)
            except (TimeoutError, asyncio.CancelledError):
                sender.cancel()
            # A clean finish{stop} leaves the socket open for the client's next 'start' (Fish's
            # service does; LiveKit's Fish plugin pools its sockets on that), unless the
            # server is going away or the sender could not deliver everything.
            self.reusable = (error is None and self._denied is None and not self._draining
                             and self._request is not None  # it served a session
                             and self.limits.reuse_timeout_s > 0
                             and not self.rt.stopping and sender.done()
                             and not sender.cancelled() and sender.exception() is None)
            if not self.reusable:
                code = int(error.close_code) if error is not None else 1000
                reason = str(error.code) if error is not None else ""
                try:
                    await asyncio.wait_for(self.ws.close(code=code, reason=reason),
                                           _FINAL_TIMEOUT_S)
                except Exception:  # already closed by the client, or it stopped reading
                    pass
        try:
            await asyncio.wait_for(asyncio.shield(encoder), _FINAL_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            encoder.cancel()
        if self._sm.state is not SessionState.CLOSED:
            self._sm.transition(SessionState.CLOSED)
        if self._denied is None and not lapsed and (
                self._request is not None or not (gone or self._reused)):
            how = "client gone" if gone else str(error.code) if error is not None else "stop"
            if self.reusable:
                how += ", socket kept for another start"
            log.info("session %s ended (%s): voice %s, %d turns, %.2f s of audio, open %.1f s",
                     self.id, how, self._voice, self._turns_done, self._audio_sent_s,
                     time.perf_counter() - self._opened_at)

    async def _stop_encoder(self, encoder: asyncio.Task[None]) -> None:
        """Queue the encode worker's stop, behind at most `_backlog` jobs, which the worker
        (now only closing encoders, ``_closing`` is set) goes through quickly."""
        if not encoder.done():
            self._jobs.put_nowait(_STOP_JOB)

    def _finish_ok(self) -> None:
        if not self._end.done():
            self._end.set_result(None)

    # ------------------------------------------------------------------------- failures

    def _on_failure(self, exc: BaseException) -> None:
        """THE error boundary: every failure of this session ends up here exactly once."""
        if self._closing or self._end.done():
            return  # after the end was decided, late failures (a dying socket) change nothing
        if isinstance(exc, ClientGone | WebSocketDisconnect | _Lapsed):
            if not self._end.done():
                self._end.set_exception(exc if isinstance(exc, _Lapsed) else ClientGone())
            return
        error = self._to_protocol_error(exc)
        if error.limit is not None:
            self.rt.metrics.limit_hit(error.limit)
        if error.fatal:
            if not self._end.done():
                self._end.set_exception(error)
            return
        self.report(error.to_event())

    def report(self, event: Error) -> None:
        """Send a non-fatal ``error`` event; the session goes on."""
        self.rt.metrics.error(event.code)
        try:
            self._outbox.put(Out(event=event))
        except SlowReader as slow:
            self._on_failure(slow)

    def _to_protocol_error(self, exc: BaseException) -> ProtocolError:
        """Map any exception to its protocol error (code, and so fatal-or-not and close code)."""
        known = known_error(exc)
        if known is not None:
            return known
        if isinstance(exc, SlowReader):
            self.rt.metrics.slow_clients += 1
            log.warning("session %s: dropping a slow client: %s", self.id, exc)
            return ProtocolError(ErrorCode.TIMEOUT, str(exc), limit=exc.limit)
        if isinstance(exc, TimeoutError):
            return ProtocolError(ErrorCode.TIMEOUT, str(exc) or "operation timed out")
        log.error("session %s: internal error", self.id, exc_info=exc)
        return ProtocolError(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__})")

    # ------------------------------------------------------------------------- receiving

    async def _receive_loop(self) -> None:
        while True:
            started = self._sm.state is not SessionState.CONNECTING
            idle = (self.limits.idle_timeout_s if started else self.limits.reuse_timeout_s
                    if self._reused else self.limits.start_timeout_s)
            try:
                async with asyncio.timeout(idle):
                    message = await self.ws.receive()
            except WebSocketDisconnected:
                # the disconnect message was taken by a receive that the idle timeout then
                # cancelled (the timeout and the message raced): the client is gone all the same
                raise ClientGone() from None
            except TimeoutError:
                if not started and self._reused:
                    raise _Lapsed() from None  # the client kept the socket but is done with it
                if not started:
                    raise ProtocolError(ErrorCode.TIMEOUT,
                                        f"no 'start' within {idle:g} s of connecting",
                                        limit="start_timeout_s") from None
                if (self.turns is not None and self.turns.busy) \
                        or self._sm.state is SessionState.PREFILLING:
                    # generating for this client is activity too, and waiting for its voice
                    # (queued for KV blocks, or prefilling) is the server's doing
                    continue
                raise ProtocolError(
                    ErrorCode.TIMEOUT, f"no message for {idle:g} s and nothing to generate",
                    limit="idle_timeout_s") from None
            if message["type"] == "websocket.disconnect":
                raise ClientGone()
            data = message.get("bytes")
            if data is None:
                data = message.get("text")
            if data is None:
                continue
            try:
                event = decode_client(data, max_bytes=self.limits.max_message_bytes,
                                      max_depth=self.limits.max_nesting_depth)
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

    async def _dispatch(self, event: ClientEvent) -> None:
        self._check_context_id(event)
        if isinstance(event, Start):
            await self._on_start(event)
            return
        self._sm.apply(event)  # invalid_state for events not allowed now
        turns = self.turns
        if turns is None:  # 'stop' before 'start', the one other event allowed then
            self._finish_ok()
            return
        if isinstance(event, Text):
            turns.text(event.context_id, event.text)
        elif isinstance(event, Flush):
            turns.flush(event.context_id)
        elif isinstance(event, Cancel):
            targets = turns.cancel(event.context_id)
            if targets:  # no audio of these turns after this point, even if already queued
                self._outbox.purge(lambda item: item.utterance not in targets or item.is_done)
        elif isinstance(event, Stop):
            turns.stop()
        self._after_turns()

    def _check_context_id(self, event: ClientEvent) -> None:
        """context_id is echoed on every event of its context and kept per context: bounded."""
        most = self.limits.max_context_id_chars
        ids = [event.context_id]
        if isinstance(event, Start):
            ids.append(event.request.context_id)
        for cid in ids:
            if cid is not None and len(cid) > most:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"context_id is {len(cid)} characters long; the limit is {most}",
                    event=event_name(event), limit="max_context_id_chars")

    # ------------------------------------------------------------------------- start

    async def _on_start(self, event: Start) -> None:
        self._sm.check_event(event)
        req = event.request
        # Claimed before the first await, so that concurrent starts cannot all pass the
        # limits; a start that fails gives it back.
        self.rt.claim_session(self._key)
        self._counted_live = True
        self._started()
        try:
            await self._start(event, req)
        except BaseException:
            self._counted_live = False
            self.rt.release_session(self._key)
            raise

    async def _start(self, event: Start, req: TTSRequest) -> None:
        rt = self.rt
        try:  # validates format, rate and bitrates, with messages naming what is supported
            output = EncoderConfig(req.format, req.sample_rate, mp3_bitrate=req.mp3_bitrate,
                                   opus_bitrate=req.opus_bitrate,
                                   input_sample_rate=self.sample_rate)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.UNSUPPORTED_FORMAT, str(exc)) from None
        params, chunking = rt.sampling(req), rt.chunking(req)
        references = await rt.voice(req)
        # Cap chunk_length so that any segment fits the context next to this voice prompt
        # (the engine would otherwise refuse a long segment of wide characters: too_large).
        chunk_cap = rt.voice_room(references)
        self._sm.apply(event)  # -> prefilling: from here on text is buffered
        self._request = msgspec.structs.replace(req, references=[])  # the clips are encoded
        self._output = output
        self._timestamps = req.timestamps
        self._voice = (repr(req.reference_id[:64]) if req.reference_id is not None else
                       f"inline ({len(req.references)} clips)" if req.references else "default")
        self._default_ctx = req.context_id if req.context_id is not None else event.context_id
        svc, eng = self.settings.service, self.settings.engine
        self.turns = Turns(
            self, session_id=self.id, limits=self.limits, chunk_length=req.chunk_length,
            chunk_cap=chunk_cap, default_context=self._default_ctx, frame_rate=rt.engine.frame_rate,
            budget={"multiplier": svc.budget_multiplier, "min_frames": svc.min_turn_frames,
                    "max_frames": eng.max_turn_frames, "request_max": req.max_new_tokens})
        rt.metrics.sessions_total += 1
        # Prefill starts now, before any text: it never counts in a turn's TTFA.
        self._backlog = encode_backlog_chunks(self.settings.engine, chunking.size)
        self._seq = rt.engine.open(references, params, _Sink(self._loop, self), chunking)
        if req.text:  # Fish's legacy SDK may put the text in the request itself
            self.turns.text(None, req.text)

    # ------------------------------------------------------------------------- TurnPort

    def submit(self, seg: Segment) -> None:
        seg.submitted_at = time.perf_counter()  # the segment's TTFA origin
        assert self._seq is not None
        self.rt.engine.submit(self._seq, seg.text, turn_id=seg.turn_id, max_frames=seg.max_frames,
                              continues=seg.continues)
        self.rt.metrics.segments_total += 1

    def ahead(self, text: str) -> None:
        if self._seq is not None:  # idle: the engine may prefill the next segment's start
            self.rt.engine.prefill_ahead(self._seq, text)

    def cancel_running(self) -> None:
        if self._seq is not None:
            self.rt.engine.cancel(self._seq)  # stops before its next decode step

    def ended(self, seg: Segment) -> None:
        if self._timestamps:
            self._queue_job(_Job(_ENDED, seg.utterance, None, seg))

    def finish(self, utt: Utterance) -> None:
        self._queue_job(_Job(_FINISH, utt))

    def drop(self, utt: Utterance) -> None:
        self._queue_job(_Job(_CLOSE, utt))

    def done(self, utt: Utterance) -> None:
        self._put(Out(utterance=utt, is_done=True))

    def acknowledge_cancel(self, context_id: str | None) -> None:
        self._put(Out(event=Done(context_id=context_id, reason="cancelled")))
        self.rt.metrics.turn_done("cancelled")

    def _after_turns(self) -> None:
        """The protocol state follows the turns: generating while a segment runs; after
        ``stop``, the session ends once every turn has its ``done`` queued."""
        turns = self.turns
        if turns is None:
            return
        if turns.running is not None and self._sm.state in (SessionState.READY, SessionState.IDLE):
            self._sm.transition(SessionState.GENERATING)
        elif turns.running is None and self._sm.state is SessionState.GENERATING:
            self._sm.transition(SessionState.IDLE)
        if self._sm.stopping and turns.drained:
            self._finish_ok()
        self._end_if_drained()

    # ------------------------------------------------------------------------- engine side

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
            seq = self._seq
            if seq is not None and seq.admitted_at:
                self.rt.metrics.observe_slot_wait(max(0.0, seq.admitted_at - seq.created_at))
            ready = self._ready_event(prefill_s)
            self._put(Out(event=ready))
            self._ready_sent = True
            log.info("session %s ready: voice %s, %s at %d Hz, prefill %.1f ms", self.id,
                     self._voice, ready.format, ready.sample_rate, ready.prefill_ms)
            self._outbox.release()  # ``done`` events of cancels during the prefill
            assert self.turns is not None
            self.turns.accepting = True
            self.turns.pump()
            self._after_turns()

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
                max_context_id_chars=limits.max_context_id_chars,
                max_nesting_depth=limits.max_nesting_depth,
                max_reference_samples=limits.max_reference_samples,
                max_references=limits.max_references,
                max_chunk_length=limits.max_chunk_length,
                send_queue_bytes=limits.send_queue_bytes,
                send_timeout_s=limits.send_timeout_s,
                send_queue_events=limits.send_queue_events,
                max_sessions=limits.max_sessions,
                max_sessions_per_key=limits.max_sessions_per_key,
                max_unstarted=limits.max_unstarted,
                start_timeout_s=limits.start_timeout_s,
                reuse_timeout_s=limits.reuse_timeout_s,
                reference_workers=limits.reference_workers,
            ),
            model=self.rt.bundle.name,
            session_id=self.id,
            reference_id=req.reference_id,
        )

    def _on_engine_audio(self, turn_id: str, pcm: np.ndarray) -> None:
        def run() -> None:
            assert self.turns is not None
            seg = self.turns.audio(turn_id, pcm.shape[0])
            if seg is not None:
                self._queue_job(_Job(_AUDIO, seg.utterance, pcm, seg))

        self._guard_callback(run)

    def _on_engine_turn_end(self, result: TurnResult) -> None:
        def run() -> None:
            assert self.turns is not None
            if self.turns.segment_ended(result) is not None:
                self.rt.metrics.frames_total += result.frames
            self._after_turns()

        self._guard_callback(run)

    def _on_engine_error(self, message: str) -> None:
        def run() -> None:
            raise ProtocolError(ErrorCode.INTERNAL, f"the engine failed this session: {message}")

        self._guard_callback(run)

    def _queue_job(self, job: _Job) -> None:
        """Hand a job to the encode worker. Never waits (engine callbacks come through here):
        a full backlog means the session cannot keep up, and it is dropped as too slow."""
        if self._jobs.qsize() >= self._backlog:
            raise SlowReader(f"the audio encoder is {self._backlog} chunks behind the engine",
                             "encode_backlog")
        self._jobs.put_nowait(job)
        self._raw_bytes += job.pcm.nbytes if job.pcm is not None else 0

    # ------------------------------------------------------------------------- encoding

    async def _encode_loop(self) -> None:
        """Per-session, ordered: audio chunks -> encoder (thread pool) -> outbox."""
        output: EncoderConfig | None = None
        try:
            while True:
                job = await self._jobs.get()
                if job is _STOP_JOB:
                    return
                self._raw_bytes -= job.pcm.nbytes if job.pcm is not None else 0
                utt: Utterance = job.utterance
                if job.kind == _CLOSE or utt.cancelled or self._closing:
                    self._close_encoder(utt)
                    continue
                output = output or self._output
                assert output is not None
                if job.kind == _ENDED:  # all of the segment's audio is in the encoder
                    seg = job.segment
                    assert seg is not None
                    if seg.has_audio:
                        seg.end_s = utt.encoded_s
                        self._put(Out(utterance=utt, segment=seg))
                    continue
                if utt.encoder is None and (job.kind == _AUDIO or utt.samples_in):
                    utt.encoder = await self._calls.run(encoder_for, output)
                encoder: AudioEncoder | None = utt.encoder  # type: ignore[assignment]
                data = b""
                if job.kind == _AUDIO:
                    assert job.pcm is not None and encoder is not None
                    data = await self._calls.run(encoder.encode, job.pcm)
                elif encoder is not None:  # _FINISH
                    data = await self._calls.run(encoder.finish)
                    utt.encoder = None
                if utt.cancelled or self._closing:  # cancelled while the pool was encoding
                    self._close_encoder(utt)
                    continue
                # Audio an encoder holds back (resampler/codec delay) is accounted to the chunk
                # that finally carries it, so the durations of a turn's chunks add up.
                seconds = job.pcm.shape[0] / self.sample_rate if job.pcm is not None else 0.0
                utt.carry_s += seconds
                seg = job.segment
                if seg is not None and not seg.has_audio:
                    seg.has_audio = True
                    seg.start_s = utt.encoded_s
                    utt.awaiting_audio.append(seg)
                    if self._timestamps:  # before the chunk that carries its first audio
                        self._put(Out(utterance=utt, segment=seg))
                utt.encoded_s += seconds
                if data:
                    first_of = tuple(utt.awaiting_audio)
                    utt.awaiting_audio.clear()
                    self._put(
                        Out(utterance=utt, data=data, duration_s=utt.carry_s, first_of=first_of)
                    )
                    utt.carry_s = 0.0
                if job.kind == _FINISH:
                    assert self.turns is not None
                    self.turns.utterance_finished(utt)
                    self._put(Out(utterance=utt, is_done=True))
                    self._after_turns()
        finally:
            for utt in list(self.turns.open_utterances if self.turns is not None else ()):
                self._close_encoder(utt)

    def _close_encoder(self, utt: Utterance) -> None:
        enc, utt.encoder = utt.encoder, None
        self._calls.close(enc)

    # ------------------------------------------------------------------------- sending

    def _put(self, item: Out) -> None:
        # ``ready`` comes first: a ``done`` before it (a cancel during the prefill) waits.
        hold = not self._ready_sent and (item.is_done or isinstance(item.event, Done))
        self._outbox.put(item, hold=hold)  # SlowReader propagates to the failure boundary

    async def _send_loop(self) -> None:
        metrics = self.rt.metrics
        timeout = self.limits.send_timeout_s
        while True:
            item = await self._outbox.get()
            if item is CLOSE:
                return
            event = item.event
            utt = item.utterance
            if utt is not None and item.segment is not None:
                event = self._segment_event(utt, item.segment)
            elif utt is not None and item.is_done:
                event = utt.done_event(self.sample_rate)
                self._turns_done += 1
                self._audio_sent_s += utt.sent_s
                metrics.turn_done(event.reason)
                if not utt.cancelled:
                    metrics.audio_seconds_total += event.audio_s
                turn = f"{self.id}/t{utt.index}"
                log.info("turn %s done: %s, voice %s, ttfa %s ms, %.3f s of audio, %d frames, "
                         "%d segments", turn, event.reason, self._voice, event.ttfa_ms,
                         event.audio_s, event.frames, event.segments, extra={"turn": turn})
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
                raise SlowReader(f"the client accepted no data for {timeout:g} s (it is not "
                                 "reading)", "send_timeout_s") from None
            except (OSError, RuntimeError, WebSocketDisconnect):
                raise ClientGone() from None


    @staticmethod
    def _segment_event(utt: Utterance, seg: Segment) -> Any:
        """The segment's ``segment`` event at send time: its audio's place on the context's
        timeline is where the utterance's audio began there plus its place in the utterance."""
        ctx = utt.context
        base = ctx.sent_s - utt.sent_s
        final = seg.index >= 0
        if not final:
            seg.index = ctx.next_segment
            ctx.next_segment += 1
        return segment_event(
            context_id=ctx.id, index=seg.index, text=seg.text, char_start=seg.char_start,
            start_s=base + seg.start_s, end_s=base + seg.end_s if final else None)


_DROP_CAUSES: Final = {"idle_timeout_s": "idle", "start_timeout_s": "no_start",
                       "send_queue_bytes": "slow_reader", "send_queue_events": "slow_reader",
                       "send_timeout_s": "slow_reader", "encode_backlog": "slow_reader"}


def _drop_cause(error: ProtocolError) -> str:
    """Why the server ended a session, for ``rtvoice_drops_total``."""
    if error.code is ErrorCode.SHUTTING_DOWN:
        return "shutdown"
    return _DROP_CAUSES.get(error.limit or "", "error")

