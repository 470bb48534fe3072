"""One text spoken outside a socket: the REST endpoints' synthesis (Fish's ``POST /v1/tts``,
OpenAI's ``POST /v1/audio/speech``).

It is a session without the socket: the same limits (it counts against ``max_sessions`` and
its key's ``max_sessions_per_key``), the same voice (stored or inline clips, encoded in the
bounded pool), the same segmentation and frame budgets (`rtvoice.turns.Turns`, one utterance),
the same engine and encoders. Everything that can be refused is refused by :meth:`start`,
before any audio, so that an HTTP handler can still answer with an error status;
:meth:`audio` then yields the encoded bytes as they are generated. Cancelling the iteration
(the client went away) or :meth:`close` gives the KV slot and the session back at once.

    synth = Synthesis(rt, request, output, key=None)
    await synth.start()           # ProtocolError: nothing was generated
    try:
        async for chunk in synth.audio():
            ...
    finally:
        await synth.close()
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engine.request import Sequence, TurnResult
from protocol import Error, ErrorCode, ProtocolError, TTSRequest
from rtvoice.audio_formats import AudioEncoder, EncoderConfig, encoder_for
from rtvoice.encoder_calls import EncoderCalls
from rtvoice.runtime import Runtime, known_error
from rtvoice.turns import Segment, Turns, Utterance

__all__ = ["Synthesis"]

log = logging.getLogger(__name__)


_READY, _AUDIO, _END, _FINISH, _FAIL = "ready", "audio", "end", "finish", "fail"


class _Sink:
    """Engine callbacks (engine thread) -> the synthesis, on its loop."""

    __slots__ = ("_loop", "_synth")

    def __init__(self, loop: asyncio.AbstractEventLoop, synth: Synthesis) -> None:
        self._loop = loop
        self._synth = synth

    def _post(self, *item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._synth._deliver, item)
        except RuntimeError:  # the loop is closed: so is the request
            pass

    def on_ready(self, seq: Sequence, prefill_s: float) -> None:
        self._post(_READY, prefill_s)

    def on_audio(self, seq: Sequence, turn_id: str, pcm: np.ndarray, offset_s: float) -> None:
        self._post(_AUDIO, turn_id, pcm)

    def on_turn_end(self, seq: Sequence, result: TurnResult) -> None:
        self._post(_END, result)

    def on_error(self, seq: Sequence, message: str) -> None:
        self._post(_FAIL, ProtocolError(ErrorCode.INTERNAL,
                                        f"the engine failed this request: {message}"))


class Synthesis:
    """See the module docstring."""

    def __init__(self, rt: Runtime, req: TTSRequest, output: EncoderConfig, *,
                 key: int | None) -> None:
        self.rt = rt
        self.req = req
        self.output = output
        self.key = key
        self.id = f"r{next(rt.session_ids)}-{secrets.token_hex(4)}"
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._raw_bytes = 0  # PCM waiting in _events (bounded by send_queue_bytes)
        self._failure: ProtocolError | None = None  # why it was cut (slow reader, shutdown)
        self._calls = EncoderCalls(self._loop, rt.encode_pool)
        self._seq: Sequence | None = None
        self._turns: Turns | None = None
        self._claimed = False
        self._encoder: AudioEncoder | None = None
        self._first_audio: float | None = None
        self.started_at = time.perf_counter()
        self.frames = 0
        self.samples = 0  # model-rate samples generated
        self.audio_bytes = 0
        self.reason = ""  # eos / length / error, once done

    # ------------------------------------------------------------------------- the request
    async def start(self) -> None:
        """Claim a session, encode the voice, queue the prefill and the text, and wait until
        the voice is in. Raises `ProtocolError` (nothing has been generated)."""
        rt, req = self.rt, self.req
        if not req.text.strip():
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the text to speak is empty")
        lim = rt.settings.limits
        if len(req.text) > lim.max_text_chars:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"the text has {len(req.text)} characters; "
                                f"the limit is {lim.max_text_chars}", limit="max_text_chars")
        rt.claim_session(self.key)
        self._claimed = True
        rt.sessions.add(self)  # the drain sees it (and cuts it if it outlives the deadline)
        params, chunking = rt.sampling(req), rt.chunking(req)
        references = await rt.voice(req)
        chunk_cap = rt.voice_room(references)
        svc, eng = rt.settings.service, rt.settings.engine
        self._turns = Turns(
            self, session_id=self.id, limits=lim, chunk_length=req.chunk_length,
            chunk_cap=chunk_cap, default_context=None, frame_rate=rt.engine.frame_rate,
            budget={"multiplier": svc.budget_multiplier, "min_frames": svc.min_turn_frames,
                    "max_frames": eng.max_turn_frames, "request_max": req.max_new_tokens})
        try:
            self._seq = rt.engine.open(references, params, _Sink(self._loop, self), chunking)
        except Exception as exc:
            known = known_error(exc)
            if known is None:
                raise
            raise known from None
        rt.metrics.sessions_total += 1
        self._turns.text(None, req.text)
        self._turns.flush(None)
        kind, *rest = await self._events.get()  # the prefill, or why there is none
        if kind == _FAIL:
            raise rest[0]
        assert kind == _READY, kind
        self.rt.metrics.observe_prefill(rest[0])
        self._encoder = await self._calls.run(encoder_for, self.output)
        self._turns.accepting = True
        self._turns.pump()

    def _deliver(self, item: tuple[Any, ...]) -> None:
        """An engine event, on the loop. The audio waiting for a client that does not read is
        bounded (send_queue_bytes): past it the request is cut, its slot given back at once."""
        if self._failure is not None:
            return
        if item[0] == _AUDIO:
            self._raw_bytes += item[2].nbytes
            limit = self.rt.settings.limits.send_queue_bytes
            if self._raw_bytes > limit:
                self.rt.metrics.slow_clients += 1
                self.rt.metrics.dropped("slow_reader")
                self.rt.metrics.limit_hit("send_queue_bytes")
                self.cut(ProtocolError(
                    ErrorCode.TIMEOUT, f"the client is not reading its audio: {self._raw_bytes} "
                    f"bytes are waiting (limit {limit})", limit="send_queue_bytes"))
                return
        self._events.put_nowait(item)

    def cut(self, error: ProtocolError) -> None:
        """End the request now (slow reader, shutdown): the engine's work stops and the slot
        and the session are given back; the response ends at its next chunk."""
        if self._failure is not None:
            return
        self._failure = error
        log.warning("request %s cut: %s", self.id, error.message)
        self._release()
        while not self._events.empty():  # drop the waiting audio
            self._events.get_nowait()
        self._raw_bytes = 0
        self._events.put_nowait((_FAIL, error))

    @property
    def failure(self) -> ProtocolError | None:
        """Why it was cut (None: it was not)."""
        return self._failure

    # ----------------------------------------------------------------- the shutdown's view
    def drain(self) -> None:
        """The server drains: a request is one utterance, it finishes on its own."""

    def server_stopping(self) -> None:
        self.cut(ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down"))

    @property
    def queued_bytes(self) -> int:
        return self._raw_bytes

    async def audio(self) -> AsyncIterator[bytes]:
        """The encoded audio as it comes. Raises `ProtocolError` if generation fails or the
        request was cut."""
        assert self._turns is not None and self._encoder is not None, "start() first"
        while True:
            kind, *rest = await self._events.get()
            if kind == _AUDIO:
                turn_id, pcm = rest
                self._raw_bytes -= pcm.nbytes
                seg = self._turns.audio(turn_id, pcm.shape[0])
                if seg is None:
                    continue
                self.samples += pcm.shape[0]
                data = await self._calls.run(self._encoder.encode, pcm)
                if seg is not None and not seg.has_audio:
                    seg.has_audio = True
                    ttfa = time.perf_counter() - seg.submitted_at
                    self.rt.metrics.observe_ttfa(ttfa)
                    if self._first_audio is None:
                        self._first_audio = time.perf_counter()
                if data:
                    self.audio_bytes += len(data)
                    yield data
            elif kind == _END:
                result: TurnResult = rest[0]
                if self._turns.segment_ended(result) is not None:
                    self.frames += result.frames
                    self.rt.metrics.frames_total += result.frames
            elif kind == _FINISH:
                utt: Utterance = rest[0]
                data = await self._calls.run(self._encoder.finish)
                self._encoder = None
                self.reason = utt.done_reason()
                self.rt.metrics.turn_done(self.reason)
                self.rt.metrics.audio_seconds_total += self.samples / self.rt.engine.sample_rate
                if data:
                    self.audio_bytes += len(data)
                    yield data
                self.rt.metrics.audio_bytes_total += self.audio_bytes
                log.info("request %s done: %s, ttfa %s ms, %.3f s of audio, %d frames", self.id,
                         self.reason, None if self.ttfa_ms is None else round(self.ttfa_ms, 1),
                         self.samples / self.rt.engine.sample_rate, self.frames)
                return
            elif kind == _FAIL:
                self.reason = self.reason or "error"
                raise rest[0]

    async def close(self, *, refused: bool = False) -> None:
        """Give the KV slot and the session back, close the encoder (idempotent). `refused`:
        it never started (the caller logs why)."""
        if self._claimed and not (refused or self.reason or self._failure is not None):
            log.info("request %s ended early: the client went away", self.id)
        self._release()
        if self._turns is not None:
            self._turns.close()
        enc, self._encoder = self._encoder, None
        self._calls.close(enc)

    def _release(self) -> None:
        if self._seq is not None:
            self.rt.engine.close(self._seq)
            self._seq = None
        if self._claimed:
            self._claimed = False
            self.rt.release_session(self.key)
        self.rt.sessions.discard(self)

    @property
    def ttfa_ms(self) -> float | None:
        """Request received -> first audio encoded (the server's figure for REST)."""
        if self._first_audio is None:
            return None
        return (self._first_audio - self.started_at) * 1000

    # ------------------------------------------------------------------------- TurnPort
    def submit(self, seg: Segment) -> None:
        seg.submitted_at = time.perf_counter()
        assert self._seq is not None
        self.rt.engine.submit(self._seq, seg.text, turn_id=seg.turn_id, max_frames=seg.max_frames,
                              continues=seg.continues)
        self.rt.metrics.segments_total += 1

    def cancel_running(self) -> None:  # a REST request has no cancel: closing ends it
        if self._seq is not None:
            self.rt.engine.cancel(self._seq)

    def ended(self, seg: Segment) -> None:  # no timestamps in a REST response
        pass

    def finish(self, utt: Utterance) -> None:
        self._events.put_nowait((_FINISH, utt))

    def drop(self, utt: Utterance) -> None:
        pass

    def done(self, utt: Utterance) -> None:
        pass

    def acknowledge_cancel(self, context_id: str | None) -> None:
        pass

    def ahead(self, text: str) -> None:  # a request's text is all there: nothing streams
        pass

    def report(self, error: Error) -> None:
        """A segment the engine refused for the request's reasons: the request fails."""
        self._events.put_nowait((_FAIL, ProtocolError(error.code, error.message)))

