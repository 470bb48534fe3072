"""asyncio client for rtvoice's live TTS socket (``/v1/tts/live``).

::

    async with connect("ws://127.0.0.1:8000", voice="alice", format="pcm") as session:
        ready = await session.ready                   # the voice is prefilled
        turn = await session.feed(llm_tokens())      # text streamed, then flushed
        async for chunk in turn:                      # audio of this turn as it arrives
            play(chunk.data)
        result = await turn                           # TurnResult: TTFA, audio_s, reason

Model: a *context* is a stream of turns on one socket (``context_id``; ``None`` is the
session's default context). A *turn* is the text sent to one context up to a ``flush`` (or a
``cancel``); it ends when the server's ``done`` for it arrives. Audio and ``done`` events are
attributed to the oldest unfinished turn of their context, which is exact because the server
speaks a context's turns in order. Several contexts may be active at once.

One reader task owns the socket's receive side; everything the caller awaits is fed by it,
so a slow consumer of one turn never blocks another turn's events (queues are unbounded:
audio is small next to what a caller keeps anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from protocol import (
    Audio,
    Cancel,
    Done,
    Encoding,
    Error,
    ErrorCode,
    Finish,
    Flush,
    ProtocolError,
    Ready,
    ReferenceAudio,
    Segment,
    Start,
    Stop,
    Text,
    TTSRequest,
    decode_server,
    encode_client,
)

__all__ = [
    "DEFAULT_PATH",
    "AudioChunk",
    "ClientTimeoutError",
    "ConnectionClosedError",
    "InternalServerError",
    "OverloadedError",
    "RequestError",
    "RtvoiceError",
    "ServerTimeoutError",
    "Session",
    "ShuttingDownError",
    "TooLargeError",
    "Turn",
    "TurnResult",
    "UnauthorizedError",
    "UnsupportedFormatError",
    "VoiceError",
    "connect",
    "error_from_code",
    "llm_tokens",
    "normalize_url",
    "paced",
]

DEFAULT_PATH = "/v1/tts/live"


# ============================================================================================
# Errors
# ============================================================================================


class RtvoiceError(Exception):
    """An error reported by the server (``code`` is a ``protocol.ErrorCode`` value) or found
    by the client (``connection_closed``, ``client_timeout``, ``protocol_error``)."""

    default_code = "error"

    def __init__(
        self,
        code: str | None = None,
        message: str = "",
        *,
        fatal: bool = True,
        context_id: str | None = None,
    ) -> None:
        self.code: str = str(code or self.default_code)
        self.message = message
        self.fatal = fatal
        self.context_id = context_id
        super().__init__(f"{self.code}: {message}" if message else self.code)


class RequestError(RtvoiceError):
    """One bad message (malformed, unknown event, bad field, wrong state). Not fatal: the
    session and its other contexts carry on."""


class VoiceError(RtvoiceError):
    """``unknown_voice`` / ``bad_reference_audio``: the session has no voice."""


class UnsupportedFormatError(RtvoiceError):
    pass


class TooLargeError(RtvoiceError):
    pass


class UnauthorizedError(RtvoiceError):
    pass


class OverloadedError(RtvoiceError):
    """No capacity now: retry later (possibly elsewhere)."""


class ServerTimeoutError(RtvoiceError):
    """The server gave up on this session (idle too long, or an operation timed out)."""


class ShuttingDownError(RtvoiceError):
    pass


class InternalServerError(RtvoiceError):
    pass


class ConnectionClosedError(RtvoiceError):
    """The socket closed before the session finished (no ``finish{stop}``)."""

    default_code = "connection_closed"

    def __init__(self, message: str = "", *, close_code: int | None = None,
                 close_reason: str = "") -> None:
        super().__init__(self.default_code, message)
        self.close_code = close_code
        self.close_reason = close_reason


class ClientTimeoutError(RtvoiceError, TimeoutError):
    """Nothing arrived from the server within the client's timeout."""

    default_code = "client_timeout"


_E = ErrorCode
_ERROR_CLASSES: dict[str, type[RtvoiceError]] = {
    _E.MALFORMED_MESSAGE: RequestError,
    _E.UNKNOWN_EVENT: RequestError,
    _E.INVALID_FIELD: RequestError,
    _E.MISSING_FIELD: RequestError,
    _E.BAD_REQUEST: RequestError,
    _E.INVALID_STATE: RequestError,
    _E.UNKNOWN_VOICE: VoiceError,
    _E.BAD_REFERENCE_AUDIO: VoiceError,
    _E.UNSUPPORTED_FORMAT: UnsupportedFormatError,
    _E.TOO_LARGE: TooLargeError,
    _E.UNAUTHORIZED: UnauthorizedError,
    _E.OVERLOADED: OverloadedError,
    _E.TIMEOUT: ServerTimeoutError,
    _E.SHUTTING_DOWN: ShuttingDownError,
    _E.INTERNAL: InternalServerError,
}

# HTTP statuses a server or proxy may answer the upgrade with, mapped to the same codes.
_HTTP_CODES = {401: _E.UNAUTHORIZED, 403: _E.UNAUTHORIZED, 413: _E.TOO_LARGE,
               429: _E.OVERLOADED, 503: _E.OVERLOADED, 504: _E.TIMEOUT}


def error_from_code(code: str, message: str = "", *, fatal: bool = True,
                    context_id: str | None = None) -> RtvoiceError:
    """The typed exception for a server error code (unknown codes give ``RtvoiceError``)."""
    cls = _ERROR_CLASSES.get(code, RtvoiceError)
    return cls(code, message, fatal=fatal, context_id=context_id)


# ============================================================================================
# Results
# ============================================================================================


@dataclass(frozen=True, slots=True)
class AudioChunk:
    data: bytes  # encoded audio in the session's format (raw s16le for "pcm")
    context_id: str | None
    seq: int  # per context, from 0
    offset_s: float  # where this chunk starts in its context's audio
    duration_s: float  # audio duration this chunk completes
    received_at: float  # time.perf_counter() when it arrived


@dataclass(slots=True)
class TurnResult:
    """What one turn produced, as measured by the client and reported by the server."""

    context_id: str | None
    reason: str  # eos | length | cancelled | error (the server's done.reason)
    # flush sent -> first audio received; None when audio came before the flush (the server
    # speaks each sentence as soon as it ends): see audio_before_flush and
    # first_audio_after_first_text_ms
    client_ttfa_ms: float | None
    server_ttfa_ms: float | None  # the server's own figure (first segment of the turn)
    audio_s: float  # audio duration the server reported
    frames: int  # codec frames generated
    rtf: float | None  # generation time / audio duration (server)
    segments: int  # segments the server cut the turn into (sentence ends, chunk_length)
    chunks: int
    bytes: int
    text_chars: int
    first_text_at: float | None  # perf_counter stamps, for timelines
    flush_at: float | None
    cancel_at: float | None
    first_audio_at: float | None
    done_at: float
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (received_at, duration_s)
    error: RtvoiceError | None = None
    # the part of server_ttfa_ms until the prompt was prefilled (queueing included)
    server_prefill_ms: float | None = None
    # first text sent -> first audio received: defined whether or not audio beat the flush
    first_audio_after_first_text_ms: float | None = None

    @property
    def audio_before_flush(self) -> bool:
        """The first audio arrived before the flush was sent (so ``client_ttfa_ms`` is None)."""
        return (self.first_audio_at is not None and self.flush_at is not None
                and self.first_audio_at < self.flush_at)

    @property
    def truncated(self) -> bool:
        """The turn hit its frame budget rather than ending by itself."""
        return self.reason == "length"

    @property
    def cancelled(self) -> bool:
        return self.reason == "cancelled"

    @property
    def generation_s(self) -> float | None:
        if self.rtf is None or self.audio_s <= 0:
            return None
        return self.rtf * self.audio_s

    @property
    def decode_tps(self) -> float | None:
        """Frames per second of generation for this request (server timing)."""
        gen = self.generation_s
        return self.frames / gen if gen and gen > 0 and self.frames else None


# ============================================================================================
# Turns
# ============================================================================================


class Turn:
    """One turn of one context. Iterate it for its audio; await it for its ``TurnResult``.

    Iteration replays the turn's chunks from the start, so it may begin at any time (even
    after the turn ended); it ends after the last chunk, when ``done`` has arrived.
    """

    def __init__(self, session: Session, context_id: str | None) -> None:
        self._session = session
        self.context_id = context_id
        self.chunks: list[AudioChunk] = []
        self.text_chars = 0
        self.text_events = 0
        self.first_text_at: float | None = None
        self.flush_at: float | None = None
        self.cancel_at: float | None = None
        self.first_audio_at: float | None = None
        self.done_events: list[Done] = []
        self.text = ""  # what was sent, from the first text that is not blank (as the server
        # counts characters for ``segment.char_start``)
        self.segments: list[Segment] = []  # the latest ``segment`` event per index, in order
        self.result_: TurnResult | None = None
        self.error: RtvoiceError | None = None  # the turn failed (no result)
        self.turn_error: RtvoiceError | None = None  # a non-fatal error its result carries
        self._changed = asyncio.Event()  # set on every chunk / end; cleared by waiters

    # ---------------------------------------------------------------- state
    @property
    def flushed(self) -> bool:
        return self.flush_at is not None or self.cancel_at is not None

    @property
    def finished(self) -> bool:
        return self.result_ is not None or self.error is not None

    @property
    def audio_bytes(self) -> bytes:
        return b"".join(c.data for c in self.chunks)

    def __repr__(self) -> str:
        state = "finished" if self.finished else "flushed" if self.flushed else "open"
        return f"<Turn context={self.context_id!r} {state} chunks={len(self.chunks)}>"

    @property
    def start_offset_s(self) -> float | None:
        """Where the turn's audio begins on its context's timeline (its first chunk's
        ``offset_s``); None before any audio."""
        return self.chunks[0].offset_s if self.chunks else None

    def heard_chars(self, played_s: float) -> int:
        """How many characters of `text` were spoken once `played_s` seconds of this turn's
        audio have been played: the end of the last word that ended by then. Word ends are
        the server's estimates (``segment.timing``); a segment whose audio is complete counts
        whole once its measured end is reached."""
        start = self.start_offset_s
        if start is None:
            return 0
        at = start + played_s + 1e-6
        chars = 0
        for seg in self.segments:
            if seg.start > at:
                break
            if seg.end is not None and seg.end <= at:
                chars = seg.char_end
                continue
            for word in seg.words:
                if word.end > at:
                    break
                chars = word.char_end
            break
        return chars

    def heard(self, played_s: float) -> str:
        """The text heard so far after `played_s` seconds of this turn's audio (for a
        barge-in: what the listener actually heard, to keep in the conversation)."""
        n = self.heard_chars(played_s)
        if self.text:
            return self.text[:n]
        return " ".join(w.text for s in self.segments for w in s.words if w.char_end <= n)

    # ---------------------------------------------------------------- consumer side
    async def _wait_change(self, timeout: float | None) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            raise ClientTimeoutError(
                "client_timeout", f"no event for context {self.context_id!r} in {timeout} s",
                context_id=self.context_id) from None

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        i = 0
        while True:
            while i < len(self.chunks):
                yield self.chunks[i]
                i += 1
            if self.error is not None:
                raise self.error
            if self.result_ is not None:
                return
            await self._wait_change(self._session.timeout)

    async def result(self, timeout: float | None = ...) -> TurnResult:  # type: ignore[assignment]
        """Wait for the turn's ``done``. ``timeout`` (default: the session's) bounds the wait
        for *any* event of this turn, not the whole turn: a long turn that keeps streaming
        never times out, a silent server does."""
        idle = self._session.timeout if timeout is ... else timeout
        while True:
            if self.error is not None:
                raise self.error
            if self.result_ is not None:
                return self.result_
            await self._wait_change(idle)

    def __await__(self) -> Generator[Any, None, TurnResult]:
        return self.result().__await__()

    # ---------------------------------------------------------------- reader side
    def _notify(self) -> None:
        self._changed.set()

    def _add_chunk(self, chunk: AudioChunk) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = chunk.received_at
        self.chunks.append(chunk)
        self._notify()

    def _add_segment(self, event: Segment) -> None:
        i = next((k for k, s in enumerate(self.segments) if s.index == event.index), None)
        if i is None:
            self.segments.append(event)
            self.segments.sort(key=lambda s: s.index)
        else:
            self.segments[i] = event  # ``final`` replaces the estimate
        self._notify()

    def _fail(self, error: RtvoiceError) -> None:
        if not self.finished:
            self.error = error
            self._notify()

    def _finish(self, now: float) -> TurnResult:
        evs = self.done_events
        reasons = [d.reason for d in evs]
        # The turn's reason is its last segment's, except that a cancel or an error anywhere
        # is what the caller needs to know about.
        reason = ("error" if "error" in reasons else "cancelled" if "cancelled" in reasons
                  else reasons[-1] if reasons else "eos")  # eos: nothing to say, said
        gen = [d.rtf * d.audio_s for d in evs if d.rtf is not None and d.audio_s > 0]
        audio_s = sum(d.audio_s for d in evs)
        ttfa = since_text = None
        if self.first_audio_at is not None and self.flush_at is not None \
                and self.first_audio_at >= self.flush_at:
            ttfa = (self.first_audio_at - self.flush_at) * 1000.0
        if self.first_audio_at is not None and self.first_text_at is not None:
            since_text = (self.first_audio_at - self.first_text_at) * 1000.0
        first = next((d for d in evs if d.ttfa_ms is not None), None)
        server_ttfa = first.ttfa_ms if first is not None else None
        self.result_ = TurnResult(
            context_id=self.context_id,
            reason=reason,
            client_ttfa_ms=ttfa,
            server_ttfa_ms=server_ttfa,
            server_prefill_ms=first.prefill_ms if first is not None else None,
            audio_s=audio_s,
            frames=sum(d.frames for d in evs),
            rtf=(sum(gen) / audio_s) if gen and audio_s > 0 else None,
            segments=sum(d.segments for d in evs),
            chunks=len(self.chunks),
            bytes=sum(len(c.data) for c in self.chunks),
            text_chars=self.text_chars,
            first_text_at=self.first_text_at,
            flush_at=self.flush_at,
            cancel_at=self.cancel_at,
            first_audio_at=self.first_audio_at,
            done_at=now,
            arrivals=[(c.received_at, c.duration_s) for c in self.chunks],
            first_audio_after_first_text_ms=since_text,
            error=self.turn_error,
        )
        self._notify()
        return self.result_


# ============================================================================================
# Session
# ============================================================================================


class _Subscriber:
    """An ``audio()`` iterator over every chunk from its creation on (all or one context)."""

    _END = object()

    def __init__(self, session: Session, context_id: str | None, all_contexts: bool) -> None:
        self._session = session
        self.context_id = context_id
        self.all = all_contexts
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def wants(self, context_id: str | None) -> bool:
        return self.all or context_id == self.context_id

    def __aiter__(self) -> _Subscriber:
        return self

    async def __anext__(self) -> AudioChunk:
        item = await self.queue.get()
        if item is self._END:
            self.queue.put_nowait(item)  # stay ended for repeated calls
            self._session._subscribers.discard(self)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)
            self._session._subscribers.discard(self)
            raise item
        return item

    async def aclose(self) -> None:
        self._session._subscribers.discard(self)


_ALL = object()


class Session:
    """A connected session. Create it with :func:`connect`."""

    def __init__(self, ws: ClientConnection, encoding: Encoding, *, timeout: float | None,
                 default_context: str | None = None) -> None:
        self._ws = ws
        self.encoding = encoding
        self.timeout = timeout
        # The server files events of the default context under ``start.request.context_id``
        # when one is given; so do we, so that ``None`` and that id are the same context.
        self.default_context = default_context
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[Ready] = loop.create_future()
        # A failure nobody awaited must not log "exception was never retrieved".
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.info: Ready | None = None
        self.finished: asyncio.Future[str] = loop.create_future()
        self.finished.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.errors: list[RtvoiceError] = []  # every error event, fatal or not, in order
        self.fatal_error: RtvoiceError | None = None
        self.on_error: Callable[[RtvoiceError], None] | None = None
        self.turns: list[Turn] = []  # every turn of the session, in creation order
        self._open: dict[str | None, Turn] = {}  # context -> turn still taking text
        self._pending: dict[str | None, deque[Turn]] = {}  # context -> flushed, awaiting done
        self._subscribers: set[_Subscriber] = set()
        self._closed = False
        self._reader = asyncio.create_task(self._read_loop(), name="rtvoice-client-reader")

    # ================================================================ properties
    @property
    def session_id(self) -> str | None:
        return self.info.session_id if self.info else None

    @property
    def sample_rate(self) -> int | None:
        return self.info.sample_rate if self.info else None

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait_ready(self, timeout: float | None = ...) -> Ready:  # type: ignore[assignment]
        t = self.timeout if timeout is ... else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(self.ready), t)
        except TimeoutError:
            raise ClientTimeoutError("client_timeout", f"no 'ready' within {t} s") from None

    # ================================================================ sending
    async def _send(self, event: Any) -> None:
        if self.fatal_error is not None:
            raise self.fatal_error
        if self._closed:
            raise ConnectionClosedError("the session is closed")
        try:
            await self._ws.send(encode_client(event, self.encoding))
        except websockets.ConnectionClosed as exc:
            raise self.fatal_error or _closed_error(exc) from None

    def _key(self, context_id: str | None) -> str | None:
        return self.default_context if context_id is None else context_id

    def _turn_for_text(self, context_id: str | None) -> Turn:
        key = self._key(context_id)
        turn = self._open.get(key)
        if turn is None:
            turn = Turn(self, key)
            self._open[key] = turn
            self.turns.append(turn)
        return turn

    async def send_text(self, text: str, *, context_id: str | None = None,
                        flush: bool = False) -> Turn:
        """Send more text for the current turn of ``context_id`` (any granularity)."""
        turn = self._turn_for_text(context_id)
        now = time.perf_counter()
        if turn.first_text_at is None:
            turn.first_text_at = now
        turn.text_chars += len(text)
        turn.text_events += 1
        if turn.text or text.strip():
            turn.text += text
        await self._send(Text(text=text, context_id=context_id))
        if flush:
            await self.flush(context_id=context_id)
        return turn

    async def feed(self, tokens: AsyncIterable[str] | Iterable[str], *,
                   context_id: str | None = None, flush: bool = True) -> Turn:
        """Stream text from an (async) iterator — an LLM's tokens — then flush.

        Empty tokens are skipped. Returns the turn; its audio may already be arriving.
        """
        turn = self._turn_for_text(context_id)

        async def send(tok: str) -> bool:
            if turn.error is not None:  # the server refused this turn's text: stop feeding
                raise turn.error
            if turn.cancel_at is not None:
                return False  # barged in: the rest of the stream is abandoned
            if tok:
                await self.send_text(tok, context_id=context_id)
            return True

        if isinstance(tokens, AsyncIterable):
            async for tok in tokens:
                if not await send(tok):
                    break
        else:
            for tok in tokens:
                if not await send(tok):
                    break
        if turn.error is not None:
            raise turn.error
        if flush and turn.cancel_at is None and not turn.finished:
            await self.flush(context_id=context_id)
        return turn

    async def flush(self, context_id: str | None = None) -> Turn:
        """End the current turn of ``context_id``: the server speaks what it has now."""
        turn = self._turn_for_text(context_id)
        key = turn.context_id
        turn.flush_at = time.perf_counter()
        # From now on this turn only waits for its done: text sent next is the next turn.
        del self._open[key]
        if not turn.text:
            # The server opens no turn for a context that got no text or only blank text: a
            # flush there is a no-op that answers nothing, so this empty turn ends here.
            turn._finish(turn.flush_at)
            return turn
        self._pending.setdefault(key, deque()).append(turn)
        await self._send(Flush(context_id=context_id))
        return turn

    async def keepalive(self) -> None:
        """Tell the server the session is still wanted (its idle timer restarts) without
        starting a turn: a ``flush`` of a context with nothing pending, which the server
        ignores. For pooled sessions that wait longer than ``ready.limits.idle_timeout_s``
        between turns; WebSocket pings keep the socket alive, not the session."""
        await self._send(Flush(context_id=KEEPALIVE_CONTEXT))

    async def cancel(self, context_id: str | None = None) -> list[Turn]:
        """Barge-in: drop ``context_id``'s unspoken text and stop its audio now.

        Every unfinished turn of the context ends with reason ``cancelled`` when the server's
        ``done`` arrives; the server acknowledges a cancel even when nothing was in progress,
        so the list returned is never empty and each of its turns can be awaited.

        The server may confirm the turns of one context in another order than they were
        sent (the running one last); all end ``cancelled``, but their frame counts may be
        swapped.
        """
        now = time.perf_counter()
        key = self._key(context_id)
        pending = self._pending.setdefault(key, deque())
        open_turn = self._open.pop(key, None)
        if open_turn is not None and open_turn.text:
            pending.append(open_turn)
        elif open_turn is not None:
            open_turn._finish(now)  # no text reached the server: nothing to cancel there
        if not pending:
            # Give the acknowledgement a turn to land in, instead of an orphan.
            ack = Turn(self, key)
            self.turns.append(ack)
            pending.append(ack)
        turns = list(pending)
        for t in turns:
            if t.cancel_at is None:
                t.cancel_at = now
        await self._send(Cancel(context_id=context_id))
        return turns

    async def stop(self, timeout: float | None = ...) -> None:  # type: ignore[assignment]
        """End the session the Fish way: the server finishes every turn, sends ``finish``
        and closes; this waits for all of it (idle ``timeout``) and closes the socket."""
        t = self.timeout if timeout is ... else timeout
        for ctx in list(self._open):
            turn = self._open.pop(ctx)
            turn.flush_at = time.perf_counter()
            if turn.text:
                # The server flushes on stop; account for that here so the turn completes.
                self._pending.setdefault(ctx, deque()).append(turn)
            else:
                turn._finish(turn.flush_at)
        await self._send(Stop())
        try:
            await self._wait_finished(t)
        finally:
            await self.close()  # the server closes after finish; complete the handshake

    async def _wait_finished(self, idle_timeout: float | None) -> None:
        # Idle timeout: as long as turns keep progressing, keep waiting.
        while not self.finished.done():
            before = sum(len(t.chunks) + len(t.done_events) for t in self.turns)
            done, _ = await asyncio.wait({self.finished}, timeout=idle_timeout)
            if done:
                break
            if sum(len(t.chunks) + len(t.done_events) for t in self.turns) == before:
                raise ClientTimeoutError("client_timeout", f"no 'finish' within {idle_timeout} s")
        reason = self.finished.result()
        if reason != "stop":
            raise self.fatal_error or RtvoiceError("error", f"finish reason {reason!r}")

    async def close(self) -> None:
        """Close the socket now (turns in flight fail with ``ConnectionClosedError``)."""
        if not self._closed:
            with contextlib.suppress(Exception):
                await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._reader, 5.0)
        if not self._reader.done():
            self._reader.cancel()
        self._mark_closed(ConnectionClosedError("closed by the client", close_code=1000))

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ================================================================ receiving
    def audio(self, context_id: Any = _ALL) -> AsyncIterator[AudioChunk]:
        """Every audio chunk from now on: of all contexts (no argument) or of one.

        Ends when the session finishes; raises the session's fatal error if it failed.
        """
        sub = _Subscriber(self, None if context_id is _ALL else self._key(context_id),
                          context_id is _ALL)
        if self._closed:
            sub.queue.put_nowait(self.fatal_error or _Subscriber._END)
        else:
            self._subscribers.add(sub)
        return sub

    def open_turn(self, context_id: str | None = None) -> Turn:
        """The turn that text sent to ``context_id`` now goes to (created if none is open).

        Lets a caller start consuming a turn's audio before its text is all sent::

            turn = session.open_turn("agent")
            feeder = asyncio.create_task(session.feed(tokens, context_id="agent"))
            async for chunk in turn: ...
        """
        return self._turn_for_text(context_id)

    def current_turn(self, context_id: str | None = None) -> Turn | None:
        """The oldest unfinished turn of ``context_id`` (the one audio now goes to)."""
        key = self._key(context_id)
        pending = self._pending.get(key)
        if pending:
            return pending[0]
        return self._open.get(key)

    def _target(self, context_id: str | None) -> Turn:
        """Which turn an audio/done event of ``context_id`` belongs to (see module doc)."""
        turn = self.current_turn(context_id)
        if turn is None:
            # Audio for text we did not send as a turn (e.g. ``start.request.text``).
            key = self._key(context_id)
            turn = Turn(self, key)
            self.turns.append(turn)
            self._pending.setdefault(key, deque()).append(turn)
        return turn

    async def _read_loop(self) -> None:
        error: RtvoiceError | None = None
        try:
            async for frame in self._ws:
                now = time.perf_counter()
                try:
                    event = decode_server(frame)
                except ProtocolError as exc:
                    if exc.code == ErrorCode.UNKNOWN_EVENT:
                        continue  # a newer server's event: ignore, as the protocol asks
                    error = RtvoiceError("protocol_error", f"undecodable server message: {exc}")
                    break
                self._dispatch(event, now)
        except websockets.ConnectionClosed as exc:
            error = _closed_error(exc)
        except Exception as exc:  # the reader must always settle every waiter
            error = RtvoiceError("protocol_error", f"client reader failed: {exc!r}")
        else:
            close_code = self._ws.close_code
            if close_code not in (None, 1000) or not self.finished.done():
                error = ConnectionClosedError(
                    f"closed with code {close_code}" + (
                        f" ({self._ws.close_reason})" if self._ws.close_reason else ""),
                    close_code=close_code, close_reason=self._ws.close_reason or "")
        finally:
            if error is not None and self.finished.done() and self.finished.result() == "stop":
                error = None  # the session ended properly; a close race after it is noise
            self._mark_closed(self.fatal_error or error)

    def _dispatch(self, event: Any, now: float) -> None:
        if isinstance(event, Audio):
            turn = self._target(event.context_id)
            chunk = AudioChunk(event.audio, event.context_id, event.seq, event.offset_s,
                               event.duration_s, now)
            turn._add_chunk(chunk)
            for sub in list(self._subscribers):
                if sub.wants(event.context_id):
                    sub.queue.put_nowait(chunk)
        elif isinstance(event, Segment):
            self._target(event.context_id)._add_segment(event)
        elif isinstance(event, Done):
            self._on_done(event, now)
        elif isinstance(event, Ready):
            self.info = event
            if not self.ready.done():
                self.ready.set_result(event)
        elif isinstance(event, Error):
            self._on_error(event)
        elif isinstance(event, Finish):
            if not self.finished.done():
                self.finished.set_result(event.reason)

    def _on_done(self, event: Done, now: float) -> None:
        ctx = self._key(event.context_id)
        turn = self._target(ctx)
        turn.done_events.append(event)
        if not turn.flushed and event.reason not in ("cancelled", "error"):
            # A segment the server cut at a sentence end before our flush: the turn goes on.
            turn._notify()
            return
        pending = self._pending.get(ctx)
        if pending and pending[0] is turn:
            pending.popleft()
        if self._open.get(ctx) is turn:
            del self._open[ctx]
        turn._finish(now)

    def _on_error(self, event: Error) -> None:
        err = error_from_code(event.code, event.message, fatal=event.fatal,
                              context_id=event.context_id)
        self.errors.append(err)
        if self.on_error is not None:
            self.on_error(err)
        if event.fatal:
            self.fatal_error = err
            if not self.ready.done():
                self.ready.set_exception(err)
            return
        # A refused segment (done_follows): its turn still gets its done{error}, whose result
        # carries the error. Another message-level error that names a context hurt that
        # context's turn, which will get no done: fail it now rather than let its waiter time
        # out. Errors without a context are about the message alone (``errors``/``on_error``).
        turn = self.current_turn(event.context_id)
        if turn is not None and event.done_follows:
            turn.turn_error = err  # its done{error} ends it (TurnResult.error)
        elif turn is not None and event.context_id is not None:
            self._drop(turn)
            turn._fail(err)

    def _drop(self, turn: Turn) -> None:
        ctx = turn.context_id
        if self._open.get(ctx) is turn:
            del self._open[ctx]
        pending = self._pending.get(ctx)
        if pending and turn in pending:
            pending.remove(turn)

    def _mark_closed(self, error: RtvoiceError | None) -> None:
        if self._closed:
            return
        self._closed = True
        if error is not None and self.fatal_error is None and not (
                self.finished.done() and self.finished.result() == "stop"):
            self.fatal_error = error
        failure = self.fatal_error or ConnectionClosedError("the session closed")
        if not self.ready.done():
            self.ready.set_exception(failure)
        if not self.finished.done():
            self.finished.set_result("error" if self.fatal_error else "closed")
        for turn in self.turns:
            turn._fail(failure)
        for sub in list(self._subscribers):
            sub.queue.put_nowait(self.fatal_error or _Subscriber._END)
        self._subscribers.clear()


KEEPALIVE_CONTEXT = "rtvoice.keepalive"  # a context no turn uses: its flush is a no-op


def _closed_error(exc: websockets.ConnectionClosed) -> ConnectionClosedError:
    rcvd = exc.rcvd
    code = rcvd.code if rcvd is not None else None
    reason = rcvd.reason if rcvd is not None else ""
    return ConnectionClosedError(f"connection closed (code {code}{', ' + reason if reason else ''})",
                                 close_code=code, close_reason=reason)


# ============================================================================================
# Text as an LLM streams it
# ============================================================================================

# Scripts written without spaces between words: an LLM emits them one or two characters a
# token, so a whole sentence must not become one "word".
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def llm_tokens(text: str) -> list[str]:
    """Split text roughly the way an LLM streams it: words with their leading space,
    punctuation on its own, CJK characters one by one. ``"".join`` gives ``text`` back."""
    out: list[str] = []
    for m in re.finditer(r"\s*[^\s\w]|\s*\w+|\s+", text):
        piece = m.group(0)
        if _CJK.search(piece):
            lead = piece[: len(piece) - len(piece.lstrip())]
            chars = list(piece.lstrip())
            if chars:
                chars[0] = lead + chars[0]
            out.extend(chars)
        else:
            out.append(piece)
    return out


async def paced(tokens: Iterable[str], tokens_per_s: float | None) -> AsyncIterator[str]:
    """Yield ``tokens`` at a steady rate (``None`` or <= 0: as fast as possible). The schedule
    is absolute, so a slow consumer does not stretch it."""
    interval = 1.0 / tokens_per_s if tokens_per_s and tokens_per_s > 0 else 0.0
    t0 = time.perf_counter()
    for i, tok in enumerate(tokens):
        if interval:
            delay = t0 + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        yield tok


# ============================================================================================
# connect
# ============================================================================================


def normalize_url(url: str) -> str:
    """``http://h:p`` / ``ws://h:p`` / ``h:p`` -> ``ws://h:p/v1/tts/live`` (path kept if given)."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"not a WebSocket URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else DEFAULT_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


ReferenceLike = tuple[bytes | str | Path, str]


def _reference(ref: ReferenceLike) -> ReferenceAudio:
    audio, text = ref
    data = Path(audio).read_bytes() if isinstance(audio, str | Path) else bytes(audio)
    return ReferenceAudio(audio=data, text=text)


def build_request(*, voice: str | None = None,
                  reference: ReferenceLike | list[ReferenceLike] | None = None,
                  format: str = "pcm", sample_rate: int | None = None, seed: int | None = None,
                  **extra: Any) -> TTSRequest:
    """The ``start`` request for these options (``extra``: any other ``TTSRequest`` field)."""
    refs: list[ReferenceAudio] = []
    if reference is not None:
        items = reference if isinstance(reference, list) else [reference]
        refs = [_reference(r) for r in items]
    return TTSRequest(reference_id=voice, references=refs, format=format,
                      sample_rate=sample_rate, seed=seed, **extra)


class _Connect:
    """``await connect(...)`` gives a Session; ``async with connect(...)`` closes it after."""

    def __init__(self, url: str, request: TTSRequest, *, encoding: Encoding,
                 timeout: float | None, ping_interval: float | None,
                 ping_timeout: float | None, headers: dict[str, str] | None,
                 wait_ready: bool) -> None:
        self.url = normalize_url(url)
        self.request = request
        self.encoding = encoding
        self.timeout = timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.headers = headers
        self.wait_ready = wait_ready
        self._session: Session | None = None

    async def _open(self) -> Session:
        try:
            ws = await ws_connect(
                self.url,
                open_timeout=self.timeout,
                ping_interval=self.ping_interval,
                ping_timeout=self.ping_timeout,
                close_timeout=5,
                max_size=64 * 2**20,  # audio chunks of long lossless formats can be big
                compression=None,  # audio does not deflate; compressing only adds latency
                proxy=None,  # a local server must not go through an environment proxy
                additional_headers=self.headers,
            )
        except websockets.InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode(errors="replace")[:200] if exc.response.body else ""
            raise error_from_code(_HTTP_CODES.get(status, "http_" + str(status)),
                                  f"HTTP {status} on upgrade {body}".strip()) from None
        except TimeoutError:
            raise ClientTimeoutError("client_timeout",
                                     f"could not connect to {self.url} in {self.timeout} s") from None
        except OSError as exc:
            raise ConnectionClosedError(f"could not connect to {self.url}: {exc}") from None
        session = Session(ws, self.encoding, timeout=self.timeout,
                          default_context=self.request.context_id)
        try:
            await session._send(Start(request=self.request))
            if self.wait_ready:
                await session.wait_ready()
        except BaseException:
            await session.close()
            raise
        return session

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        self._session = await self._open()
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


def connect(
    url: str,
    *,
    voice: str | None = None,
    reference: ReferenceLike | list[ReferenceLike] | None = None,
    format: str = "pcm",
    sample_rate: int | None = None,
    encoding: Encoding | str = Encoding.MSGPACK,
    seed: int | None = None,
    timeout: float | None = 30.0,
    ping_interval: float | None = 20.0,
    ping_timeout: float | None = 20.0,
    headers: dict[str, str] | None = None,
    api_key: str | None = None,
    wait_ready: bool = False,
    **request: Any,
) -> _Connect:
    """Open a session: ``session = await connect(...)`` or ``async with connect(...) as s``.

    - ``voice``: a stored voice id; ``reference``: ``(audio, transcript)`` or a list of them
      (audio as bytes in any format the server decodes, or a file path).
    - ``format``/``sample_rate``: output audio (``pcm`` is raw s16le mono).
    - ``encoding``: ``"msgpack"`` (binary frames) or ``"json"`` (text frames).
    - ``timeout``: connect + ``ready`` deadline, and the longest silence tolerated while a
      turn is in progress; ``None`` waits forever.
    - ``ping_interval``/``ping_timeout``: keepalive pings; a dead peer fails the session.
    - ``api_key``: sent as ``Authorization: Bearer <key>`` (servers started with api_keys).
    - ``request``: any other ``TTSRequest`` field (``max_new_tokens``, ``top_k``,
      ``first_chunk_frames``, ``temperature``...).
    - ``wait_ready``: also wait for ``ready`` before returning (else ``await session.ready``;
      text may be sent at once: the server buffers it while it prefills).
    """
    req = build_request(voice=voice, reference=reference, format=format,
                        sample_rate=sample_rate, seed=seed, **request)
    if api_key is not None:
        headers = {**(headers or {}), "Authorization": f"Bearer {api_key}"}
    return _Connect(url, req, encoding=Encoding(encoding), timeout=timeout,
                    ping_interval=ping_interval, ping_timeout=ping_timeout, headers=headers,
                    wait_ready=wait_ready)
