"""Pipecat TTS service for rtvoice (``pip install -e '.[pipecat]'`` in the rtvoice checkout).

::

    from clients.pipecat import RtvoiceTTSService

    tts = RtvoiceTTSService(
        url="ws://127.0.0.1:8000/v1/tts/live",
        reference_id="alice",                      # a stored voice; None: the server's default
        settings=RtvoiceTTSService.Settings(temperature=0.7, top_p=0.7, seed=42),
    )
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, transport.output(), ...])

How it maps Pipecat onto the live socket (``docs/integrations/pipecat.md`` has the details):

- **One socket per service**, opened when the pipeline is set up (the ``start`` request goes
  out at once, so the voice is prefilled before the first turn) and kept open; it is
  reopened only when it died (the receive loop saw it close) or when the voice or sampling
  settings change (a new ``start``).
- **Contexts.** Each Pipecat audio context (a TTSSpeakFrame, or one LLM reply) is one rtvoice
  ``context_id``: audio, ``segment`` and ``done`` events carry it, so they are routed exactly
  and frame processing is never paused while audio arrives.
- **Turn end** is the server's ``done``: TTSStoppedFrame is pushed right after the last audio
  of the context, not after a silence timeout.
- **Barge-in.** On an InterruptionFrame, ``cancel`` is sent for every context the server
  still works on, on the same socket (no reconnect, no new prefill); whatever still arrives
  for those contexts is dropped, and the next turn's text goes out at once.
- **TTFB** is measured by the client: from the moment the context's first text is written to
  the socket to the moment its first ``audio`` event is read from it (not when Pipecat's
  playback queue gets to it). The server's own figure (``done.ttfa_ms``) comes with
  ``on_turn_done``.
- **Word timestamps** come from the server's ``segment`` events (estimated timings, replaced by
  rescaled ones once a segment's audio is complete); a word is handed to Pipecat once the
  audio at its start has arrived, with its time relative to the context's first audio.
- **Errors.** A server ``error`` becomes an ErrorFrame whose text starts with the server's code
  and whose ``exception`` is the typed ``clients.RtvoiceError`` (``.code``, ``.message``,
  ``.fatal``). Configuration errors (unknown voice, unsupported format, bad key) make the
  service unusable (no reconnect loop); other fatal errors end the socket and the service
  reconnects; a non-fatal error naming one of our contexts ends that turn (cancelled on the
  server, TTSStoppedFrame pushed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

try:
    from loguru import logger
    from pipecat.frames.frames import (
        CancelFrame,
        EndFrame,
        ErrorFrame,
        Frame,
        InterruptionFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
    from pipecat.utils.errors import ErrorCategory
    from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given
    from websockets.protocol import State
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without pipecat
    raise ImportError(
        f"clients.pipecat needs Pipecat ({exc.name} is missing): "
        "pip install -e '.[pipecat]' in the rtvoice checkout (pipecat-ai[fish]==1.14.0)"
    ) from exc

import msgspec

from .client import RtvoiceError, error_from_code, normalize_url

__all__ = ["PCM_SAMPLE_RATES", "RtvoiceTTSService", "RtvoiceTTSSettings", "TurnStats"]

PCM_SAMPLE_RATES: tuple[int, ...] = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
"""Output rates the server encodes ``pcm`` at (the service always asks for ``pcm``)."""

# A context id no text is ever sent to: a ``flush`` to it is a no-op on the server (nothing
# is pending there, nothing is answered) that still counts as client activity for the
# server's idle timeout.
_KEEPALIVE_CONTEXT = "rtvoice-pipecat-keepalive"

# Server error code -> Pipecat's error category. Non-fatal (message-level) errors are the
# application's (they cost one turn, never the service); fatal ones follow the table.
_FATAL_CATEGORIES: dict[str, ErrorCategory] = {
    "unauthorized": ErrorCategory.AUTHENTICATION,
    "unknown_voice": ErrorCategory.INVALID_REQUEST,
    "bad_reference_audio": ErrorCategory.INVALID_REQUEST,
    "unsupported_format": ErrorCategory.INVALID_REQUEST,
    "too_large": ErrorCategory.INVALID_REQUEST,
    "overloaded": ErrorCategory.RATE_LIMIT,
    "timeout": ErrorCategory.CONNECTIVITY,
    "shutting_down": ErrorCategory.CONNECTIVITY,
    "internal": ErrorCategory.SERVER,
}

# Scripts written without spaces: their words carry their own spacing in Pipecat's terms.
_NO_SPACES = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


@dataclass
class RtvoiceTTSSettings(TTSSettings):
    """Runtime-updatable settings of :class:`RtvoiceTTSService`.

    ``None`` leaves a field to the server's default (see ``docs/PROTOCOL.md``). Changing any
    of ``voice`` or the sampling fields (``TTSUpdateSettingsFrame``) opens a new session: a
    new ``start`` request, so a new voice prefill.

    Parameters:
        voice: ``reference_id``: a stored voice's id or name (``POST /v1/voices``); ``None``
            for the server's default voice.
        temperature: Sampling temperature (server default 0.7; 0 is greedy).
        top_p: Nucleus sampling (server default 0.7).
        top_k: Top-k sampling (server default 30).
        seed: Makes the session's sampling reproducible (server default: random).
        chunk_length: Characters per segment when no sentence end comes first (server
            default 200, clamped to 10..1000).
        max_new_tokens: Upper bound of the per-segment frame budget (server default 1024).
    """

    temperature: float | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    top_p: float | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    top_k: int | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    seed: int | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    chunk_length: int | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    max_new_tokens: int | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)


_REQUEST_FIELDS = ("temperature", "top_p", "top_k", "seed", "chunk_length", "max_new_tokens")


@dataclass(frozen=True, slots=True)
class TurnStats:
    """One finished Pipecat context (one or more server turns), passed to ``on_turn_done``.

    Parameters:
        context_id: The Pipecat context id (also the rtvoice ``context_id``).
        reason: The last server ``done.reason`` (``eos``, ``length``, ``error``...).
        server_ttfa_ms: The server's ``done.ttfa_ms`` of the context's first turn: segment
            ready to generate -> first audio chunk handed to the socket.
        client_ttfb_ms: First text written to the socket -> first audio event read from it
            (what Pipecat's TTFB metric reports, for the context it timed).
        audio_s: Seconds of audio the server reported (sum over the server turns).
        frames: Codec frames generated.
        server_turns: Server turns (flushes) the context was spoken in.
        audio_bytes: PCM bytes received.
        words: Words handed to Pipecat's word-timestamp API.
    """

    context_id: str
    reason: str
    server_ttfa_ms: float | None
    client_ttfb_ms: float | None
    audio_s: float
    frames: int
    server_turns: int
    audio_bytes: int
    words: int


@dataclass(eq=False)
class _Turn:
    """What the service tracks of one context while the server owes it something."""

    id: str
    open: bool = True  # Pipecat may still send text to it (flush_audio not called yet)
    unflushed: bool = False  # non-whitespace text sent since the last flush
    flushes: int = 0  # server turns ended by a flush: as many ``done`` events are due
    dones: int = 0
    first_text_wall: float | None = None  # time.time() of the first text sent
    first_audio_wall: float | None = None
    origin_s: float | None = None  # offset_s of its first audio (the words' zero)
    audio_end_s: float = 0.0  # end of the audio received so far, on the context's timeline
    audio_bytes: int = 0
    audio_s: float = 0.0
    frames: int = 0
    reason: str = "eos"
    server_ttfa_ms: float | None = None
    segments: dict[int, dict[str, Any]] = field(default_factory=dict)  # latest per index
    released: dict[int, int] = field(default_factory=dict)  # words handed out per index
    last_word_s: float = 0.0
    words: int = 0
    last_event: float = field(default_factory=time.monotonic)

    @property
    def owed(self) -> bool:
        """The server has text of this context it has not finished (a ``done`` is due)."""
        return self.unflushed or self.flushes > self.dones


class RtvoiceTTSService(WebsocketTTSService):
    """Text-to-speech through an rtvoice server's live socket (``/v1/tts/live``).

    Speaks raw PCM (s16le mono) at the pipeline's output rate, or at ``sample_rate`` when
    given (:data:`PCM_SAMPLE_RATES`). See the module documentation for the behaviour.

    Event handlers (besides TTSService's ``on_connected``, ``on_disconnected``,
    ``on_connection_error``, ``on_tts_request``):

    - ``on_ready(service, ready: dict)``: the server's ``ready`` event (voice prefilled;
      ``session_id``, ``prefill_ms``, ``limits``...).
    - ``on_turn_done(service, stats: TurnStats)``: a context ended with the server's ``done``
      (not called for cancelled contexts).

    Example::

        tts = RtvoiceTTSService(url="ws://127.0.0.1:8000/v1/tts/live", reference_id=None)

        @tts.event_handler("on_turn_done")
        async def on_turn_done(service, stats):
            print(stats.server_ttfa_ms, stats.client_ttfb_ms)
    """

    Settings = RtvoiceTTSSettings
    _settings: RtvoiceTTSSettings

    def __init__(
        self,
        *,
        url: str,
        reference_id: str | None = None,
        api_key: str | None = None,
        sample_rate: int | None = None,
        settings: RtvoiceTTSSettings | None = None,
        word_timestamps: bool = True,
        text_aggregation_mode: TextAggregationMode | None = None,
        stall_timeout_s: float = 30.0,
        keepalive_interval_s: float | None = None,
        open_timeout_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        """Create the service (the socket opens when the pipeline is set up).

        Args:
            url: The server's live endpoint, ``ws://HOST:PORT/v1/tts/live`` (``http://``,
                ``wss://``, ``https://`` and a bare ``HOST:PORT`` are accepted; the path
                defaults to ``/v1/tts/live``).
            reference_id: A stored voice (id or name) or ``None`` for the server's default
                voice. ``settings.voice`` wins when both are given.
            api_key: Sent as ``Authorization: Bearer <key>`` (servers started with
                ``--api-keys``); ``None`` sends no header.
            sample_rate: Output rate in Hz, one of :data:`PCM_SAMPLE_RATES`; ``None`` uses
                the pipeline's ``audio_out_sample_rate``.
            settings: Sampling settings (:class:`RtvoiceTTSSettings`); unset fields are the
                server's defaults.
            word_timestamps: Ask the server for ``segment`` events and push word-level
                TTSTextFrames timed against the audio. ``False``: no segment events, and
                each sentence's TTSTextFrame follows its audio (Pipecat's plain mode).
            text_aggregation_mode: ``SENTENCE`` (default): each sentence Pipecat aggregates
                is sent and flushed as its own server turn, so it is spoken at once.
                ``TOKEN``: LLM tokens are streamed as they come and the server cuts
                sentences itself; the context is flushed when the reply ends.
            stall_timeout_s: A turn the server owes audio or ``done`` for, with no event of
                it for this long, is given up (ErrorFrame, ``cancel``, TTSStoppedFrame).
                While it is not reached the turn's audio context is kept open, so a slow
                first audio does not end the turn on Pipecat's 3 s silence timer.
            keepalive_interval_s: Seconds between no-op messages on an idle socket, so the
                server's ``idle_timeout_s`` never drops it; ``None``: a third of the
                ``idle_timeout_s`` the server announces in ``ready`` (40 s by default).
            open_timeout_s: Handshake timeout when (re)connecting.
            **kwargs: Passed to ``WebsocketTTSService`` / ``TTSService``.
        """
        default_settings = self.Settings(
            model=None,
            voice=reference_id,
            language=None,
            temperature=None,
            top_p=None,
            top_k=None,
            seed=None,
            chunk_length=None,
            max_new_tokens=None,
        )
        if settings is not None:
            default_settings.apply_update(settings)
        kwargs.setdefault("push_start_frame", True)
        kwargs.setdefault("push_stop_frames", True)  # a safety net: ours come on ``done``
        super().__init__(
            push_text_frames=not word_timestamps,
            pause_frame_processing=False,
            sample_rate=sample_rate,
            settings=default_settings,
            text_aggregation_mode=text_aggregation_mode,
            **kwargs,
        )
        self._url = normalize_url(url)
        self._api_key = api_key
        self._word_timestamps = word_timestamps
        self._stall_timeout_s = stall_timeout_s
        self._keepalive_interval_s = keepalive_interval_s
        self._open_timeout_s = open_timeout_s
        self._receive_task: asyncio.Task | None = None
        self._housekeeping_task: asyncio.Task | None = None
        self._turns: dict[str, _Turn] = {}
        self._ready: dict[str, Any] | None = None
        self._last_send = time.monotonic()
        self._fatal: RtvoiceError | None = None
        self._sessions_opened = 0
        self._cancels_sent = 0
        self._keepalives_sent = 0
        self._ttfb_owner: str | None = None  # the context Pipecat's TTFB metric now times
        self._register_event_handler("on_ready")
        self._register_event_handler("on_turn_done")

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """The live endpoint this service connects to."""
        return self._url

    @property
    def session_id(self) -> str | None:
        """The current session's id (from ``ready``), ``None`` before it."""
        return self._ready.get("session_id") if self._ready else None

    @property
    def ready_info(self) -> dict[str, Any] | None:
        """The current session's ``ready`` event, ``None`` before it."""
        return self._ready

    @property
    def sessions_opened(self) -> int:
        """How many sockets (sessions) this service has opened so far."""
        return self._sessions_opened

    @property
    def cancels_sent(self) -> int:
        """How many ``cancel`` events this service has sent (barge-ins)."""
        return self._cancels_sent

    @property
    def keepalives_sent(self) -> int:
        """How many keepalive messages (no-op ``flush`` events) this service has sent."""
        return self._keepalives_sent

    async def start_ttfb_metrics(self, *, start_time: float | None = None) -> None:
        """Ignored: Pipecat's base class starts TTFB when it opens an audio context; this
        service starts it itself when the context's first text is written to the socket.

        Args:
            start_time: Unused.
        """

    async def stop_ttfb_metrics(self, *, end_time: float | None = None) -> None:
        """Ignored: this service stops TTFB itself when a context's first audio is read off
        the socket (not when Pipecat's playback queue reaches it).

        Args:
            end_time: Unused.
        """

    async def _ttfb_start(self, turn: _Turn) -> None:
        # One TTFB measurement at a time (Pipecat keeps one per processor): a context whose
        # text goes out while another still waits for its first audio is not timed here
        # (its TurnStats.client_ttfb_ms still is).
        owner = self._turns.get(self._ttfb_owner) if self._ttfb_owner else None
        if owner is not None and owner.first_audio_wall is None:
            return
        self._ttfb_owner = turn.id
        await super().start_ttfb_metrics(start_time=turn.first_text_wall)

    async def _ttfb_stop(self, turn: _Turn) -> None:
        if self._ttfb_owner == turn.id:
            self._ttfb_owner = None
            await super().stop_ttfb_metrics(end_time=turn.first_audio_wall)

    async def _ttfb_cancel(self, context_id: str | None = None) -> None:
        if context_id is None or self._ttfb_owner == context_id:
            self._ttfb_owner = None
            await self.cancel_ttfb_metrics()

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA and usage metrics are generated.

        Returns:
            True.
        """
        return True

    # ------------------------------------------------------------------ lifecycle

    async def setup(self, setup: FrameProcessorSetup) -> None:
        """Set the output rate and open the socket, so the voice is prefilled at once.

        Args:
            setup: Pipecat's setup parameters (the pipeline's output rate among them).
        """
        await super().setup(setup)
        await self._connect()

    async def stop(self, frame: EndFrame) -> None:
        """End gracefully: queued audio plays, then the socket closes.

        Args:
            frame: The end frame.
        """
        await super().stop(frame)
        await self._disconnect()

    async def cancel(self, frame: CancelFrame) -> None:
        """Cancel the pipeline: close the socket now.

        Args:
            frame: The cancel frame.
        """
        await super().cancel(frame)
        await self._disconnect()

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        """Apply a settings delta; a new voice or sampling setting opens a new session.

        Args:
            delta: A settings delta (``RtvoiceTTSService.Settings``).

        Returns:
            The changed fields with their previous values.
        """
        changed = await super()._update_settings(delta)
        if set(changed) & {"voice", *_REQUEST_FIELDS}:
            await self._disconnect()
            await self._connect()
        return changed

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))
        if not self._housekeeping_task:
            self._housekeeping_task = self.create_task(self._housekeeping(), name="housekeeping")

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._housekeeping_task:
            await self.cancel_task(self._housekeeping_task)
            self._housekeeping_task = None
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    def _start_request(self) -> dict[str, Any]:
        request: dict[str, Any] = {"format": "pcm", "sample_rate": self.sample_rate}
        voice = self._settings.voice
        if is_given(voice) and voice is not None:
            request["reference_id"] = voice
        for name in _REQUEST_FIELDS:
            value = getattr(self._settings, name)
            if is_given(value) and value is not None:
                request[name] = value
        if not self._word_timestamps:
            request["timestamps"] = False
        return request

    async def _connect_websocket(self) -> None:
        try:
            if self._websocket and self._websocket.state is State.OPEN:
                return
            if not self.is_usable:
                return
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
            logger.debug(f"{self}: connecting to {self._url}")
            self._ready = None
            self._fatal = None
            self._turns.clear()
            websocket = await self._websocket_connect(
                self._url,
                additional_headers=headers,
                open_timeout=self._open_timeout_s,
                max_size=64 * 2**20,
                compression=None,  # audio does not deflate; compressing only adds latency
                proxy=None,  # a local server must not go through an environment proxy
            )
            self._websocket = websocket
            await self._send({"event": "start", "request": self._start_request()})
            self._sessions_opened += 1
            await self._call_event_handler("on_connected")
        except Exception as e:
            self._websocket = None
            await self.push_error(error_msg=f"rtvoice: could not connect to {self._url}: {e}",
                                  exception=e, category=ErrorCategory.CONNECTIVITY)
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self._ttfb_cancel()  # a turn cut off has no TTFB to report
            await self.stop_all_metrics()
            if self._websocket:
                logger.debug(f"{self}: disconnecting")
                await self._websocket.close()
        except Exception as e:
            logger.debug(f"{self}: error while closing the socket: {e}")
        finally:
            self._websocket = None
            self._ready = None
            self._turns.clear()
            await self._call_event_handler("on_disconnected")

    def _socket_open(self) -> bool:
        return self._websocket is not None and self._websocket.state is State.OPEN

    async def _send(self, event: dict[str, Any]) -> None:
        if self._websocket is None:
            raise ConnectionError("rtvoice: socket not connected")
        await self._websocket.send(msgspec.msgpack.encode(event))
        self._last_send = time.monotonic()

    # ------------------------------------------------------------------ text in

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send text of a context; its audio arrives on the receive task.

        In sentence mode the text is flushed at once (one server turn per sentence); in
        token mode the context is flushed by :meth:`flush_audio` when the reply ends.

        Args:
            text: The text to speak.
            context_id: The Pipecat context (also the rtvoice ``context_id``).

        Yields:
            ``None`` (audio comes through the audio context), or an ErrorFrame.
        """
        try:
            if not self._socket_open():
                await self._connect()
            if not self._socket_open():
                raise ConnectionError(f"rtvoice: no connection to {self._url}")
            turn = self._turns.get(context_id)
            if turn is None:
                turn = self._turns[context_id] = _Turn(context_id)
            await self._send({"event": "text", "text": text, "context_id": context_id})
            turn.last_event = time.monotonic()
            if turn.first_text_wall is None:
                turn.first_text_wall = time.time()
                # TTFB starts when the turn's first text is on the wire.
                await self._ttfb_start(turn)
            if text.strip():
                turn.unflushed = True
            if not self._is_streaming_tokens:
                await self._flush_turn(turn)
            await self.start_tts_usage_metrics(text)
            yield None
        except Exception as e:
            self._turns.pop(context_id, None)
            yield ErrorFrame(error=f"rtvoice: could not send text: {e}", exception=e)
            yield TTSStoppedFrame(context_id=context_id)

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The context gets no more text: flush what the server has of it.

        Args:
            context_id: The context to flush (default: the active one).
        """
        cid = context_id or self.get_active_audio_context_id()
        turn = self._turns.get(cid) if cid else None
        if turn is None:
            return
        turn.open = False
        try:
            await self._flush_turn(turn)
        except Exception as e:
            await self.push_error(error_msg=f"rtvoice: could not flush: {e}", exception=e)
        await self._maybe_finish(turn)

    async def _flush_turn(self, turn: _Turn) -> None:
        if not turn.unflushed:
            return  # the server would treat it as a no-op and answer no ``done``
        turn.unflushed = False
        turn.flushes += 1
        await self._send({"event": "flush", "context_id": turn.id})

    # ------------------------------------------------------------------ barge-in

    async def _handle_interruption(self, frame: InterruptionFrame,
                                   direction: FrameDirection) -> None:
        await super()._handle_interruption(frame, direction)
        # Contexts the base class dropped call on_audio_context_interrupted; one whose audio
        # context already ended while the server still owes it audio is cancelled here.
        kept = set(self.get_audio_contexts())
        for cid in [c for c in self._turns if c not in kept]:
            await self._cancel_turn(cid)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel the context on the server (same socket) and drop its audio.

        Args:
            context_id: The interrupted context.
        """
        await self._cancel_turn(context_id)
        await super().on_audio_context_interrupted(context_id)

    async def _cancel_turn(self, context_id: str) -> None:
        await self._ttfb_cancel(context_id)
        turn = self._turns.pop(context_id, None)  # events still coming for it are dropped
        if turn is None or not turn.owed or not self._socket_open():
            return
        try:
            await self._send({"event": "cancel", "context_id": context_id})
            self._cancels_sent += 1
        except Exception as e:
            logger.warning(f"{self}: could not send cancel: {e}")

    # ------------------------------------------------------------------ events in

    async def _receive_messages(self) -> None:
        websocket = self._websocket
        if websocket is None:
            raise ConnectionError("rtvoice: socket not connected")
        async for message in websocket:
            try:
                event = (json.loads(message) if isinstance(message, str)
                         else msgspec.msgpack.decode(message))
            except Exception as e:
                await self.push_error(error_msg=f"rtvoice: undecodable server message: {e}",
                                      exception=e)
                continue
            if isinstance(event, dict):
                await self._on_event(event)

    async def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        cid = event.get("context_id")
        turn = self._turns.get(cid) if isinstance(cid, str) else None
        if turn is not None:
            turn.last_event = time.monotonic()
        if kind == "audio":
            if turn is not None:
                await self._on_audio(turn, event)
        elif kind == "segment":
            if turn is not None and self._word_timestamps:
                await self._on_segment(turn, event)
        elif kind == "done":
            if turn is not None:
                await self._on_done(turn, event)
        elif kind == "ready":
            self._ready = event
            await self._call_event_handler("on_ready", event)
        elif kind == "error":
            await self._on_error(event, turn)
        elif kind == "finish":
            logger.debug(f"{self}: session finished: {event.get('reason')}")

    async def _on_audio(self, turn: _Turn, event: dict[str, Any]) -> None:
        audio = event.get("audio") or b""
        if isinstance(audio, str):  # JSON frames carry base64 (we ask for msgpack)
            audio = base64.b64decode(audio)
        if not audio:
            return
        offset = float(event.get("offset_s") or 0.0)
        if turn.first_audio_wall is None:
            turn.first_audio_wall = time.time()
            turn.origin_s = offset
            # TTFB ends when the first audio is read off the socket, not when it plays.
            await self._ttfb_stop(turn)
        turn.audio_bytes += len(audio)
        turn.audio_end_s = max(turn.audio_end_s, offset + float(event.get("duration_s") or 0.0))
        frame = TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=turn.id)
        await self.append_to_audio_context(turn.id, frame)
        await self._release_words(turn, turn.audio_end_s)

    async def _on_segment(self, turn: _Turn, event: dict[str, Any]) -> None:
        try:
            index = int(event["index"])
        except (KeyError, TypeError, ValueError):
            return
        turn.segments[index] = event
        await self._release_words(turn, turn.audio_end_s)

    async def _release_words(self, turn: _Turn, upto_s: float | None) -> None:
        """Hand Pipecat the words whose audio has started arriving (``upto_s``: end of the
        audio received; ``None``: all), in order; a final segment releases all of its words.
        """
        if not self._word_timestamps:
            return
        out: list[tuple[str, float, bool]] = []
        for index in sorted(turn.segments):
            seg = turn.segments[index]
            words = seg.get("words") or []
            done = turn.released.get(index, 0)
            final = bool(seg.get("final"))
            blocked = False
            while done < len(words):
                word = words[done]
                start = float(word.get("start") or 0.0)
                if upto_s is not None and not final and start >= upto_s:
                    blocked = True
                    break
                text = str(word.get("text") or "")
                origin = turn.origin_s or 0.0
                t = max(turn.last_word_s, start - origin, 0.0)
                turn.last_word_s = t
                done += 1
                if text:
                    out.append((text, t, bool(_NO_SPACES.search(text))))
            turn.released[index] = done
            if blocked:
                break  # later segments wait for this one
        if not out:
            return
        turn.words += len(out)
        # One call per run of words of the same kind: CJK characters carry their own spacing.
        i = 0
        while i < len(out):
            j = i
            while j < len(out) and out[j][2] == out[i][2]:
                j += 1
            await self.add_word_timestamps([(w, t) for w, t, _ in out[i:j]], turn.id,
                                           includes_inter_frame_spaces=out[i][2] or None)
            i = j

    async def _on_done(self, turn: _Turn, event: dict[str, Any]) -> None:
        turn.dones += 1
        turn.reason = str(event.get("reason") or "eos")
        turn.audio_s += float(event.get("audio_s") or 0.0)
        turn.frames += int(event.get("frames") or 0)
        if turn.server_ttfa_ms is None and event.get("ttfa_ms") is not None:
            turn.server_ttfa_ms = float(event["ttfa_ms"])
        logger.debug(f"{self}: done {turn.id}: reason={turn.reason} "
                     f"ttfa_ms={event.get('ttfa_ms')} audio_s={event.get('audio_s')}")
        await self._maybe_finish(turn)

    async def _maybe_finish(self, turn: _Turn) -> None:
        """End the context once Pipecat sends no more text and every ``done`` is in."""
        if turn.open or turn.owed or self._turns.get(turn.id) is not turn:
            return
        del self._turns[turn.id]
        await self._ttfb_cancel(turn.id)  # a no-op unless it ended without audio
        await self._release_words(turn, None)
        await self._end_context(turn.id)
        ttfb = None
        if turn.first_audio_wall is not None and turn.first_text_wall is not None:
            ttfb = round((turn.first_audio_wall - turn.first_text_wall) * 1000.0, 3)
        if turn.flushes:
            await self._call_event_handler("on_turn_done", TurnStats(
                context_id=turn.id, reason=turn.reason, server_ttfa_ms=turn.server_ttfa_ms,
                client_ttfb_ms=ttfb, audio_s=turn.audio_s, frames=turn.frames,
                server_turns=turn.flushes, audio_bytes=turn.audio_bytes, words=turn.words))

    async def _end_context(self, context_id: str) -> None:
        if self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)

    async def _on_error(self, event: dict[str, Any], turn: _Turn | None) -> None:
        code = str(event.get("code") or "error")
        message = str(event.get("message") or "")
        fatal = bool(event.get("fatal"))
        cid = event.get("context_id")
        error = error_from_code(code, message, fatal=fatal,
                                context_id=cid if isinstance(cid, str) else None)
        text = f"rtvoice {code}: {message}" if message else f"rtvoice {code}"
        if fatal:
            self._fatal = error
            category = _FATAL_CATEGORIES.get(code, ErrorCategory.SERVER)
            # The server closes the socket next; the receive loop then reconnects, unless the
            # category is permanent (the service is then unusable and is not reconnected).
            await self.push_error(error_msg=text, exception=error, category=category)
            # No audio of this session follows: end every turn in flight now.
            turns = list(self._turns)
            self._turns.clear()
            await self._ttfb_cancel()
            for context_id in turns:
                await self._end_context(context_id)
            return
        await self.push_error(error_msg=text, exception=error, category=ErrorCategory.APPLICATION)
        if turn is not None:
            # This turn lost text or a segment: stop what is left of it and end it here.
            await self._cancel_turn(turn.id)
            await self._end_context(turn.id)

    # ------------------------------------------------------------------ housekeeping

    async def _housekeeping(self) -> None:
        """Keep audio contexts open while the server owes them audio (up to the stall
        timeout), give up on stalled turns, and keep an idle socket alive."""
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._housekeeping_step()
            except Exception as e:
                logger.warning(f"{self}: housekeeping error: {e}")

    async def _housekeeping_step(self) -> None:
        if not self._socket_open() or self._ready is None:
            return
        now = time.monotonic()
        for turn in list(self._turns.values()):
            if not turn.owed:
                continue
            if now - turn.last_event > self._stall_timeout_s:
                await self.push_error(
                    error_msg=f"rtvoice: no event for context {turn.id} in "
                              f"{self._stall_timeout_s:g} s; giving the turn up",
                    category=ErrorCategory.SERVER)
                await self._cancel_turn(turn.id)
                await self._end_context(turn.id)
            elif self.audio_context_available(turn.id):
                self._refresh_audio_context(turn.id)
        interval = self._keepalive_interval_s
        if interval is None:
            idle = (self._ready.get("limits") or {}).get("idle_timeout_s")
            interval = max(1.0, float(idle) / 3.0) if idle else 40.0
        if now - self._last_send >= interval:
            await self._send({"event": "flush", "context_id": _KEEPALIVE_CONTEXT})
            self._keepalives_sent += 1
