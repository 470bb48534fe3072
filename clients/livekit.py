"""LiveKit Agents TTS plugin for rtvoice (``pip install -e '.[livekit]'`` in the rtvoice checkout).

::

    from livekit.agents import AgentSession
    from clients.livekit import TTS

    session = AgentSession(tts=TTS(url="http://127.0.0.1:8000", voice="alice"), ...)

What it does beyond a plain socket client (docs/integrations/livekit.md has the details and
measured numbers):

- **A pool of prefilled sessions.** ``pool_size`` sockets are opened up front (at
  construction inside an event loop, or at ``prewarm()``), each with the voice, and kept
  until their ``ready`` arrived: the voice prompt is in the server's KV cache before a turn
  starts. A stream takes one (with ``pool_size`` >= 2, taking the last idle one opens a
  replacement in the background); healthy sessions come back after their turn, so in
  steady state no socket is opened at all. Idle sessions are kept alive within the server's
  ``idle_timeout_s``.
- **Barge-in by ``cancel``.** A stream closed mid-turn (LiveKit does that on interruption)
  sends ``cancel`` on its socket; the server stops generating at once and confirms with
  ``done{cancelled}``; audio of the cancelled turn that was still in flight is dropped, and the
  session goes back to the pool with its voice still prefilled. No reconnect, no new prefill.
- **Streaming**: text pushed to ``stream()`` goes out as it comes; the server cuts it at
  sentence ends and starts speaking the first sentence before the rest arrives; each
  ``flush`` ends a turn (one LiveKit segment). ``synthesize()`` takes the same path (a pooled,
  prefilled socket): the lowest time to first audio the server offers, since ``POST /v1/tts``
  would prefill the voice on every request.
- **Word timing**: when the server sends ``segment`` events (exposed by the client library as
  ``Turn.segments``), their words become LiveKit ``TimedString`` aligned transcripts.
- **Errors**: server ``error`` codes become ``APIStatusError`` (HTTP status of the code,
  retryable only for server-side conditions), lost sockets ``APIConnectionError``, silence
  ``APITimeoutError``; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

try:
    import aiohttp
    from livekit.agents import (
        APIConnectionError,
        APIConnectOptions,
        APIError,
        APIStatusError,
        APITimeoutError,
        tts,
        utils,
    )
    from livekit.agents.types import (
        DEFAULT_API_CONNECT_OPTIONS,
        NOT_GIVEN,
        NotGivenOr,
        TimedString,
    )
    from livekit.agents.utils import is_given
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "clients.livekit needs the LiveKit Agents framework: pip install -e '.[livekit]' in "
        "the rtvoice checkout (livekit-agents==1.8.9) "
        f"({_exc})"
    ) from _exc

from protocol import ErrorCode, TTSRequest, error_spec

from .client import (
    AudioChunk,
    ClientTimeoutError,
    ConnectionClosedError,
    RtvoiceError,
    Session,
    Turn,
    connect,
    normalize_url,
)

__all__ = [
    "DEFAULT_URL",
    "SAMPLE_RATES",
    "TTS",
    "ChunkedStream",
    "PoolStats",
    "SessionInfo",
    "SynthesizeStream",
    "to_api_error",
]

log = logging.getLogger("rtvoice.livekit")

DEFAULT_URL = "http://127.0.0.1:8000"
SAMPLE_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
"""Output rates the plugin accepts (the server's ``pcm`` rates)."""

NUM_CHANNELS = 1

# Server-side conditions that a new attempt (a new session, possibly another replica) may not
# hit; everything else (a bad voice, a bad field, auth, limits) fails the same way again.
_RETRYABLE_CODES = frozenset({ErrorCode.OVERLOADED, ErrorCode.TIMEOUT, ErrorCode.SHUTTING_DOWN,
                              ErrorCode.INTERNAL})
_REQUEST_FIELDS = frozenset(TTSRequest.__struct_fields__)
_SETTLE_TIMEOUT_S = 5.0  # how long a returned session may take to confirm its cancel
_WATCHDOG_S = 0.5


# ============================================================================================
# Errors
# ============================================================================================


def to_api_error(exc: BaseException, *, request_id: str | None = None) -> APIError:
    """The LiveKit ``APIError`` for an rtvoice client error (or any other failure).

    - a server ``error`` event → ``APIStatusError`` with the code's HTTP status (404 for
      ``unknown_voice``, 503 for ``overloaded``...), the code, message and ``fatal`` flag in
      ``body``; retryable only for ``overloaded``, ``timeout``, ``shutting_down``, ``internal``;
    - no event within the timeout → ``APITimeoutError``;
    - the socket lost / refused → ``APIConnectionError`` (retryable).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClientTimeoutError | TimeoutError):
        return APITimeoutError(f"rtvoice: {exc}")
    if isinstance(exc, ConnectionClosedError):
        return APIConnectionError(f"rtvoice: {exc}")
    if isinstance(exc, RtvoiceError):
        try:
            code = ErrorCode(exc.code)
            status = error_spec(code).http_status
            retryable = code in _RETRYABLE_CODES
        except ValueError:  # a code this client does not know (a newer server, http_NNN)
            status, retryable = -1, exc.fatal
            if exc.code.startswith("http_") and exc.code[5:].isdigit():
                status = int(exc.code[5:])
                retryable = status >= 500
        body = {"code": exc.code, "message": exc.message, "fatal": exc.fatal}
        return APIStatusError(f"rtvoice {exc.code}: {exc.message}", status_code=status,
                              request_id=request_id, body=body, retryable=retryable)
    if isinstance(exc, OSError | aiohttp.ClientError):
        return APIConnectionError(f"rtvoice: {exc!r}")
    return APIError(f"rtvoice: unexpected failure: {exc!r}", retryable=False)


# ============================================================================================
# Options
# ============================================================================================


@dataclass
class _Options:
    url: str  # ws(s)://host:port/v1/tts/live
    http_url: str  # http(s)://host:port
    voice: str | None
    api_key: str | None
    sample_rate: int
    request: dict[str, Any]  # TTSRequest fields besides format/sample_rate/reference_id
    word_timestamps: bool
    timeout: float

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _http_base(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}[parts.scheme]
    path = parts.path
    if path.endswith("/v1/tts/live"):
        path = path[: -len("/v1/tts/live")]
    return urlunsplit((scheme, parts.netloc, path.rstrip("/"), "", ""))


def _sampling(**knobs: Any) -> dict[str, Any]:
    out = {k: v for k, v in knobs.items() if v is not None}
    unknown = set(out) - _REQUEST_FIELDS
    if unknown:
        raise ValueError(f"unknown request fields: {sorted(unknown)}")
    return out


# ============================================================================================
# The session pool
# ============================================================================================


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the session pool (``TTS.pool_stats()``)."""

    idle: int  # prefilled sessions waiting for a turn
    lent: int  # sessions a stream is using
    opening: int  # sessions connecting / prefilling
    settling: int  # sessions back from a stream, waiting for their cancel to be confirmed
    opened: int  # sessions opened since the start
    reused: int  # takes of a session that had already served a turn
    cancels: int  # cancels sent for interrupted turns
    discarded: int  # sessions closed because they were unhealthy, stale or surplus


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """Which pooled session a stream spoke on (``stream.session_info``)."""

    session_id: str | None
    ready_at: float | None  # perf_counter when its ``ready`` had arrived (voice prefilled)
    acquired_at: float  # perf_counter when the stream took it
    prefill_ms: float | None  # the server's figure for the voice prefill
    turns_before: int  # turns it had already served (0: fresh)
    from_idle: bool  # taken ready from the pool (False: opened or awaited on demand)


@dataclass(eq=False)
class _Pooled:
    session: Session
    generation: int
    ready_at: float
    turns: int = 0
    last_sent: float = field(default_factory=time.monotonic)

    @property
    def healthy(self) -> bool:
        s = self.session
        return not s.closed and s.fatal_error is None and s.ready.done()


class _Pool:
    """Pre-opened, prefilled sessions of one ``TTS`` (one event loop)."""

    def __init__(self, tts_: TTS, size: int) -> None:
        self._tts = tts_
        self.size = size
        self.generation = 0
        self._idle: list[_Pooled] = []  # LIFO: the most recently used session first
        self._opening: dict[asyncio.Task[_Pooled], bool] = {}  # task -> claimed by a taker
        self._lent: set[_Pooled] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._settling = 0
        self._maintainer: asyncio.Task[None] | None = None
        self._voice_ids: dict[str, str] = {}
        self._closed = False
        self.last_error: BaseException | None = None
        self.opened = self.reused = self.cancels = self.discarded = 0

    # ---------------------------------------------------------------- state
    def stats(self) -> PoolStats:
        return PoolStats(idle=len(self._idle), lent=len(self._lent), opening=len(self._opening),
                         settling=self._settling, opened=self.opened, reused=self.reused,
                         cancels=self.cancels, discarded=self.discarded)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---------------------------------------------------------------- opening
    async def _voice_id(self, opts: _Options) -> str | None:
        """``voice`` as a stored voice id: an id is used as is, a name is looked up once
        (``GET /v1/voices``); unknown names go to the server, which says ``unknown_voice``."""
        voice = opts.voice
        if voice is None:
            return None
        if voice in self._voice_ids:
            return self._voice_ids[voice]
        resolved = voice
        try:
            timeout = aiohttp.ClientTimeout(total=opts.timeout)
            async with aiohttp.ClientSession(timeout=timeout, headers=opts.headers) as http:
                async with http.get(f"{opts.http_url}/v1/voices/{quote(voice, safe='')}") as r:
                    found = r.status == 200
                if not found:
                    async with http.get(f"{opts.http_url}/v1/voices") as r:
                        if r.status == 200:
                            voices = (await r.json()).get("voices", [])
                            named = [v for v in voices if v.get("name") == voice]
                            if named:
                                resolved = max(named, key=lambda v: v.get("created_at", 0))["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("voice lookup of %r failed (%r): using it as an id", voice, exc)
            return voice  # not cached: the lookup is retried with the next session
        self._voice_ids[voice] = resolved
        return resolved

    async def _open(self, generation: int) -> _Pooled:
        opts = self._tts._opts
        voice_id = await self._voice_id(opts)
        session = await connect(opts.url, voice=voice_id, format="pcm",
                                sample_rate=opts.sample_rate, api_key=opts.api_key,
                                timeout=opts.timeout, **opts.request)
        try:
            await session.wait_ready()
        except BaseException:
            await session.close()
            raise
        session.timeout = None  # turns are watched by the stream (text may come slowly)
        self.opened += 1
        return _Pooled(session, generation, time.perf_counter())

    def _start_opening(self) -> asyncio.Task[_Pooled]:
        task = self._spawn(self._open(self.generation), "rtvoice-pool-open")
        self._opening[task] = False
        task.add_done_callback(self._opened)
        return task

    def _opened(self, task: asyncio.Task[_Pooled]) -> None:
        claimed = self._opening.pop(task, False)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.last_error = exc
            if not claimed:
                log.warning("rtvoice pool: could not open a session: %s", exc)
            return
        self.last_error = None
        if not claimed:
            self._put(task.result())

    def top_up(self) -> None:
        """Open sessions in the background so that the pool owns ``size`` sessions (idle,
        opening, lent or settling) and, with ``size`` >= 2, at least one of them is spare
        (idle, opening or on its way back): a stream that takes the last idle session gets a
        replacement opened behind it."""
        if self._closed:
            return
        self._ensure_maintainer()
        spare = len(self._idle) + len(self._opening) + self._settling
        owned = spare + len(self._lent)
        min_spare = 1 if self.size >= 2 else 0
        for _ in range(max(self.size - owned, min_spare - spare)):
            self._start_opening()

    # ---------------------------------------------------------------- taking
    async def acquire(self, timeout: float) -> tuple[_Pooled, bool]:
        """A prefilled session for one stream, and whether it came ready from the pool."""
        if self._closed:
            raise APIConnectionError("rtvoice: the TTS is closed", retryable=False)
        lease: _Pooled | None = None
        from_idle = False
        while self._idle:
            p = self._idle.pop()
            if p.healthy and p.generation == self.generation:
                lease, from_idle = p, True
                break
            self._discard(p)
        if lease is None:
            # Wait for a session already on its way (it is nearer ready than a new one).
            task = next((t for t, claimed in self._opening.items() if not claimed), None)
            if task is None:
                task = self._start_opening()
            self._opening[task] = True
            try:
                lease = await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                task.add_done_callback(lambda t: t.cancelled() or t.exception() or
                                       self._close_later(t.result()))
                raise APITimeoutError(f"rtvoice: no session ready within {timeout} s") from None
            except asyncio.CancelledError:
                task.add_done_callback(lambda t: t.cancelled() or t.exception() or
                                       self._put(t.result()))
                raise
            except Exception as exc:
                raise to_api_error(exc) from exc
        if lease.turns:
            self.reused += 1
        self._lent.add(lease)
        self.top_up()  # the next stream should find a prefilled voice too
        return lease, from_idle

    # ---------------------------------------------------------------- returning
    def release(self, lease: _Pooled, *, cancel: bool) -> None:
        """A stream is done with ``lease``: cancel its unfinished turn if asked, wait for the
        confirmation in the background, then pool it (or close it)."""
        self._lent.discard(lease)
        self._settling += 1
        self._spawn(self._settle(lease, cancel), "rtvoice-pool-settle")

    async def _settle(self, lease: _Pooled, cancel: bool) -> None:
        session = lease.session
        try:
            if cancel and lease.healthy:
                self.cancels += 1
                await session.cancel()
            unfinished = [t for t in session.turns if not t.finished]
            if unfinished:
                await asyncio.wait_for(
                    asyncio.gather(*(t.result(timeout=None) for t in unfinished),
                                   return_exceptions=True), _SETTLE_TIMEOUT_S)
        except Exception as exc:  # a socket that cannot confirm a cancel is not reused
            log.debug("rtvoice pool: session %s not reusable: %r", session.session_id, exc)
            self._settling -= 1
            self._discard(lease)
            return
        self._settling -= 1
        lease.turns += 1
        # The cancelled turn (and its late audio) is dropped here: nobody reads it again.
        session.turns[:] = [t for t in session.turns if not t.finished]
        self._put(lease)

    def _put(self, lease: _Pooled) -> None:
        if (self._closed or not lease.healthy or lease.generation != self.generation
                or len(self._idle) >= self.size):
            self._discard(lease)
            return
        self._idle.append(lease)

    def _discard(self, lease: _Pooled) -> None:
        self.discarded += 1
        self._close_later(lease)

    def _close_later(self, lease: _Pooled) -> None:
        self._spawn(lease.session.close(), "rtvoice-pool-close")

    def invalidate(self) -> None:
        """Options changed: sessions opened with the old ones are not used again."""
        self.generation += 1
        self._voice_ids.clear()
        for task in list(self._opening):
            if not self._opening[task]:
                task.cancel()
        idle, self._idle = self._idle, []
        for lease in idle:
            self._discard(lease)
        self.top_up()

    # ---------------------------------------------------------------- upkeep
    def _ensure_maintainer(self) -> None:
        if self._maintainer is None or self._maintainer.done():
            self._maintainer = asyncio.create_task(self._maintain(), name="rtvoice-pool-upkeep")

    async def _maintain(self) -> None:
        """Keep idle sessions alive (a no-op ``flush`` well within the server's
        ``idle_timeout_s``), drop dead ones and top the pool up."""
        while not self._closed:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for lease in list(self._idle):
                if not lease.healthy:
                    self._idle.remove(lease)
                    self._discard(lease)
                    continue
                info = lease.session.info
                idle_limit = info.limits.idle_timeout_s if info else 120.0
                if now - lease.last_sent < max(1.0, min(30.0, idle_limit / 3)):
                    continue
                # Out of the pool while sending, so no stream starts a turn behind the flush.
                self._idle.remove(lease)
                try:
                    await lease.session.keepalive()
                    lease.last_sent = now
                except Exception:
                    self._discard(lease)
                    continue
                self._put(lease)
            if self.last_error is None:
                self.top_up()

    async def aclose(self) -> None:
        self._closed = True
        if self._maintainer is not None:
            await utils.aio.cancel_and_wait(self._maintainer)
        for task in list(self._opening):
            task.cancel()
        idle, self._idle = self._idle, []
        lent, self._lent = list(self._lent), set()
        for lease in idle + lent:
            self._close_later(lease)
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


# ============================================================================================
# Speaking one turn into an AudioEmitter
# ============================================================================================


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _turn_segments(turn: Turn) -> list[Any] | None:
    """The ``segment`` events the client library filed under this turn (None: it files
    none, an older client library)."""
    segs = getattr(turn, "segments", None)
    if segs is None or isinstance(segs, int | float):
        return None
    if isinstance(segs, dict):
        return list(segs.values())
    return list(segs) if isinstance(segs, Iterable) else None


def _timed_words(seg: Any, text: str, base: float) -> list[TimedString]:
    """A segment's words as ``TimedString``s with times relative to the turn's first audio.
    Each keeps the whitespace that follows it in the turn's text, so they concatenate to
    the text (LiveKit's transcript synchronizer joins them as they come)."""
    words = list(_field(seg, "words") or [])
    seg_end = _field(seg, "char_end", 0)
    out: list[TimedString] = []
    if not words:
        start, end = _field(seg, "start"), _field(seg, "end")
        piece = _field(seg, "text", "") or ""
        out.append(TimedString(piece + " ", start_time=max(0.0, start - base),
                               end_time=max(0.0, end - base) if end is not None else start))
        return out
    for i, w in enumerate(words):
        cs, ce = _field(w, "char_start", -1), _field(w, "char_end", -1)
        nxt = _field(words[i + 1], "char_start", ce) if i + 1 < len(words) else seg_end
        if 0 <= cs < ce <= len(text) and nxt >= ce:
            piece = text[cs:nxt]
            if i + 1 == len(words):  # keep the gap to the next segment
                rest = text[nxt:]
                piece += rest[: len(rest) - len(rest.lstrip())] or " "
        else:
            piece = (_field(w, "text", "") or "") + " "
        out.append(TimedString(piece, start_time=max(0.0, _field(w, "start") - base),
                               end_time=max(0.0, _field(w, "end") - base)))
    return out


class _TurnSpeaker:
    """Pushes one turn's audio (and word timings) into an emitter as it arrives."""

    def __init__(self, tts_: TTS, turn: Turn, emitter: tts.AudioEmitter, text: list[str],
                 timeout: float, request_id: str) -> None:
        self._tts = tts_
        self.turn = turn
        self._emitter = emitter
        self._text = text  # the turn's text as sent (grows while the turn is open)
        self._timeout = timeout
        self._request_id = request_id
        self._base: float | None = None
        self._timed: set[int] = set()
        self.chunks = 0

    def _push_timings(self, final: bool) -> None:
        segs = _turn_segments(self.turn)
        if not segs:
            return
        text = getattr(self.turn, "text", None) or "".join(self._text)
        for seg in sorted(segs, key=lambda s: _field(s, "index", 0)):
            index = _field(seg, "index", 0)
            if index in self._timed or not (_field(seg, "final", False) or final):
                continue
            if self._base is None:
                self._base = _field(seg, "start", 0.0)
            self._timed.add(index)
            self._emitter.push_timed_transcript(_timed_words(seg, text, self._base))

    def _on_chunk(self, chunk: AudioChunk) -> None:
        if self._base is None:
            self._base = chunk.offset_s
        if self._tts._opts.word_timestamps:
            self._push_timings(final=False)
        if chunk.data:
            self._emitter.push(chunk.data)
            self.chunks += 1

    async def run(self) -> None:
        """Until the turn's ``done``; raises the turn's error as an ``APIError``."""
        turn = self.turn

        async def consume() -> None:
            async for chunk in turn:
                self._on_chunk(chunk)

        task = asyncio.create_task(consume(), name="rtvoice-turn-audio")
        try:
            last, seen = time.monotonic(), -1
            while True:
                done, _ = await asyncio.wait({task}, timeout=_WATCHDOG_S)
                if done:
                    task.result()
                    break
                # Silence counts only once the turn is flushed: before that the server may
                # simply be waiting for the rest of the text.
                progress = len(turn.chunks) + len(turn.done_events)
                now = time.monotonic()
                if progress != seen or not turn.flushed:
                    last, seen = now, progress
                elif now - last > self._timeout:
                    raise APITimeoutError(
                        f"rtvoice: no audio for {self._timeout:g} s after the turn's flush")
        except RtvoiceError as exc:
            raise to_api_error(exc, request_id=self._request_id) from exc
        finally:
            if not task.done():
                await utils.aio.cancel_and_wait(task)
        result = turn.result_
        if self._tts._opts.word_timestamps:
            self._push_timings(final=True)
            if result is not None and result.chunks and _turn_segments(turn) is None:
                self._tts._no_timings()
        if result is not None and result.reason == "error":
            err = result.error or RtvoiceError(
                "error", "the server refused a segment of this turn", fatal=False)
            raise to_api_error(err, request_id=self._request_id)


# ============================================================================================
# TTS
# ============================================================================================


class TTS(tts.TTS):
    """rtvoice as a LiveKit Agents TTS: streaming, pooled prefilled sessions, barge-in by
    ``cancel``.

    Args:
        url: the server: ``http(s)://host:port``, ``ws(s)://host:port`` or the full live URL
            (``ws://host:port/v1/tts/live``). Default ``http://127.0.0.1:8000``, or
            ``RTVOICE_URL``.
        voice: a stored voice's id or name (``POST /v1/voices``); ``None``: the model's
            default voice. A name is looked up once per pool (``GET /v1/voices``).
        api_key: sent as ``Authorization: Bearer`` (servers started with ``--api-keys``);
            default ``RTVOICE_API_KEY``.
        sample_rate: PCM output rate, one of :data:`SAMPLE_RATES` (default 24000).
        temperature, top_p, top_k, seed, chunk_length, max_new_tokens: sampling and
            segmentation knobs of the ``start`` request; ``None`` leaves the server default
            (temperature 0.7, top_p 0.7, top_k 30, random seed, chunk_length 200,
            max_new_tokens 1024).
        extra_request: any other ``TTSRequest`` field (e.g. ``{"first_chunk_frames": 1}``).
        pool_size: prefilled sessions kept idle (default 2, at least 1). Each holds a KV slot
            on the server while it waits.
        word_timestamps: ask for ``segment`` events and turn them into aligned transcripts
            (``capabilities.aligned_transcript``).
        timeout: the longest silence tolerated from the server once a turn is flushed, and
            the session open / ``ready`` deadline (seconds, default 30).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        voice: str | None = None,
        api_key: str | None = None,
        sample_rate: int = 24000,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        chunk_length: int | None = None,
        max_new_tokens: int | None = None,
        extra_request: dict[str, Any] | None = None,
        pool_size: int = 2,
        word_timestamps: bool = True,
        timeout: float = 30.0,
    ) -> None:
        if sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {SAMPLE_RATES}, got {sample_rate}")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=word_timestamps),
            sample_rate=sample_rate,
            num_channels=NUM_CHANNELS,
        )
        ws_url = normalize_url(url or os.environ.get("RTVOICE_URL") or DEFAULT_URL)
        request = _sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            chunk_length=chunk_length, max_new_tokens=max_new_tokens,
                            **(extra_request or {}))
        if "timestamps" in _REQUEST_FIELDS:  # a protocol that knows segment events
            request.setdefault("timestamps", word_timestamps)
        self._opts = _Options(url=ws_url, http_url=_http_base(ws_url), voice=voice,
                              api_key=api_key or os.environ.get("RTVOICE_API_KEY") or None,
                              sample_rate=sample_rate, request=request,
                              word_timestamps=word_timestamps, timeout=timeout)
        self._pool = _Pool(self, pool_size)
        self._streams: weakref.WeakSet[SynthesizeStream] = weakref.WeakSet()
        self._warned_timings = False
        with contextlib.suppress(RuntimeError):  # no running loop: prewarm() or first use
            asyncio.get_running_loop()
            self.prewarm()

    # ---------------------------------------------------------------- properties
    @property
    def model(self) -> str:
        """The server's model name once a session told it, else ``"rtvoice"``."""
        for lease in self._pool._idle:
            if lease.session.info is not None and lease.session.info.model:
                return lease.session.info.model
        return "rtvoice"

    @property
    def provider(self) -> str:
        """``"rtvoice"`` (LiveKit labels metrics with it)."""
        return "rtvoice"

    @property
    def url(self) -> str:
        """The live socket URL sessions open."""
        return self._opts.url

    @property
    def voice(self) -> str | None:
        """The voice as given (id or name; None: the model's default)."""
        return self._opts.voice

    def pool_stats(self) -> PoolStats:
        """How many sessions are idle, lent, opening; how many were opened, reused,
        cancelled, discarded."""
        return self._pool.stats()

    async def wait_pool_ready(self, timeout: float = 30.0) -> PoolStats:
        """Wait until the pool holds ``pool_size`` idle prefilled sessions (or nothing more is
        opening); raises the ``APIError`` of a failed open."""
        self._pool.top_up()
        deadline = time.monotonic() + timeout
        while self._pool._opening and len(self._pool._idle) < self._pool.size:
            if time.monotonic() > deadline:
                raise APITimeoutError(f"rtvoice: pool not ready within {timeout} s")
            await asyncio.wait(list(self._pool._opening), timeout=deadline - time.monotonic())
        if not self._pool._idle and self._pool.last_error is not None:
            raise to_api_error(self._pool.last_error)
        return self._pool.stats()

    def _no_timings(self) -> None:
        # The server (or client library) sends no segment events: stop advertising aligned
        # transcripts so LiveKit falls back to the text without warning on every turn.
        if not self._warned_timings:
            self._warned_timings = True
            log.info("rtvoice: no word timings from this server; aligned transcripts off")
        self._capabilities.aligned_transcript = False

    # ---------------------------------------------------------------- lifecycle
    def prewarm(self) -> None:
        """Open the pool's sessions now (needs a running event loop)."""
        self._pool.top_up()

    def update_options(
        self,
        *,
        voice: NotGivenOr[str | None] = NOT_GIVEN,
        temperature: NotGivenOr[float | None] = NOT_GIVEN,
        top_p: NotGivenOr[float | None] = NOT_GIVEN,
        top_k: NotGivenOr[int | None] = NOT_GIVEN,
        seed: NotGivenOr[int | None] = NOT_GIVEN,
        chunk_length: NotGivenOr[int | None] = NOT_GIVEN,
        max_new_tokens: NotGivenOr[int | None] = NOT_GIVEN,
        extra_request: dict[str, Any] | None = None,
    ) -> None:
        """Change the voice or request knobs (``None`` resets a knob to the server default;
        knobs not given stay). Idle sessions opened with the old options are closed and the
        pool refills in the background; streams already running finish on their session. The
        output rate is fixed at construction."""
        opts = replace(self._opts, request=dict(self._opts.request))
        if is_given(voice):
            opts.voice = voice
        knobs = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                 "chunk_length": chunk_length, "max_new_tokens": max_new_tokens,
                 **(extra_request or {})}
        for name, value in knobs.items():
            if not is_given(value):
                continue
            _sampling(**{name: 0})  # validates the name
            if value is None:
                opts.request.pop(name, None)
            else:
                opts.request[name] = value
        if opts != self._opts:
            self._opts = opts
            self._pool.invalidate()

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        """Speak ``text`` as one turn on a pooled, prefilled session."""
        self._pool.top_up()
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> SynthesizeStream:
        """A streaming synthesis: ``push_text`` as an LLM produces it, ``flush`` ends a turn,
        ``end_input`` ends the stream; closing it mid-turn cancels the turn on the server."""
        self._pool.top_up()
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        """Close the running streams (their turns are cancelled) and every pooled session."""
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        await self._pool.aclose()


# ============================================================================================
# Streams
# ============================================================================================


class _Lease:
    """One stream's hold on a pooled session; gives it back (cancelling if needed)."""

    def __init__(self, tts_: TTS) -> None:
        self._tts = tts_
        self.pooled: _Pooled | None = None
        self.info: SessionInfo | None = None
        self.acquire_time = 0.0

    async def take(self, timeout: float) -> Session:
        t0 = time.perf_counter()
        pooled, from_idle = await self._tts._pool.acquire(timeout)
        self.pooled = pooled
        s = pooled.session
        self.info = SessionInfo(session_id=s.session_id, ready_at=pooled.ready_at,
                                acquired_at=time.perf_counter(),
                                prefill_ms=s.info.prefill_ms if s.info else None,
                                turns_before=pooled.turns, from_idle=from_idle)
        self.acquire_time = time.perf_counter() - t0
        return s

    def give_back(self) -> None:
        if self.pooled is None:
            return
        pooled, self.pooled = self.pooled, None
        unfinished = any(not t.finished for t in pooled.session.turns)
        self._tts._pool.release(pooled, cancel=unfinished)


class _Leased:
    """What a LiveKit stream does around its work on a pooled session: take one (timed,
    reused or not, as LiveKit's metrics want), map our errors to LiveKit's, give it back."""

    _lease: _Lease
    _conn_options: APIConnectOptions
    _acquire_time: float
    _connection_reused: bool

    @property
    def session_info(self) -> SessionInfo | None:
        """The pooled session this stream speaks on (None before it took one)."""
        return self._lease.info

    async def _on_session(self, work: Callable[[Session], Awaitable[None]],
                          request_id: str) -> None:
        lease = self._lease
        try:
            session = await lease.take(self._conn_options.timeout)
            self._acquire_time = lease.acquire_time
            self._connection_reused = bool(lease.info and lease.info.from_idle)
            await work(session)
        except RtvoiceError as exc:
            raise to_api_error(exc, request_id=request_id) from exc
        finally:
            lease.give_back()


class ChunkedStream(_Leased, tts.ChunkedStream):
    """``TTS.synthesize(text)``: one turn on a pooled, prefilled socket.

    The socket rather than ``POST /v1/tts``: a pooled session has the voice prefilled
    already, so the time to first audio is the first segment's generation alone (REST
    prefills the voice, and opens a connection, per request)."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._rt: TTS = tts
        self._lease = _Lease(tts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(request_id=request_id, sample_rate=self._rt.sample_rate,
                                  num_channels=NUM_CHANNELS, mime_type="audio/pcm")
        if not self._input_text.strip():
            return

        async def speak(session: Session) -> None:
            turn = await session.send_text(self._input_text, flush=True)
            await _TurnSpeaker(self._rt, turn, output_emitter, [self._input_text],
                               self._rt._opts.timeout, request_id).run()

        await self._on_session(speak, request_id)


class SynthesizeStream(_Leased, tts.SynthesizeStream):
    """``TTS.stream()``: text goes to a pooled session as it is pushed; each flush is one turn
    (one LiveKit segment) whose audio streams out as the server produces it."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._rt: TTS = tts
        self._lease = _Lease(tts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(request_id=request_id, sample_rate=self._rt.sample_rate,
                                  num_channels=NUM_CHANNELS, mime_type="audio/pcm", stream=True)
        await self._on_session(lambda s: self._speak(s, output_emitter, request_id), request_id)

    async def _speak(self, session: Session, emitter: tts.AudioEmitter,
                     request_id: str) -> None:
        turns: asyncio.Queue[tuple[Turn, list[str]] | None] = asyncio.Queue()

        async def send_input() -> None:
            turn: Turn | None = None
            text: list[str] = []
            held = ""  # whitespace before a turn's first word: it would open no turn
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if turn is not None:
                        await session.flush()
                    turn, text, held = None, [], ""
                    continue
                if not data:
                    continue
                if turn is None and not data.strip():
                    held += data
                    continue
                piece, held = held + data, ""
                self._mark_started()
                text.append(piece)
                sent = await session.send_text(piece)
                if turn is None:
                    turn = sent
                    await turns.put((turn, text))
            if turn is not None:
                await session.flush()
            await turns.put(None)

        async def speak_turns() -> None:
            while (item := await turns.get()) is not None:
                turn, text = item
                emitter.start_segment(segment_id=utils.shortuuid())
                await _TurnSpeaker(self._rt, turn, emitter, text, self._rt._opts.timeout,
                                   request_id).run()
                emitter.end_segment()

        tasks = [asyncio.create_task(send_input(), name="rtvoice-stream-input"),
                 asyncio.create_task(speak_turns(), name="rtvoice-stream-audio")]
        try:
            await asyncio.gather(*tasks)
        finally:
            await utils.aio.gracefully_cancel(*tasks)
