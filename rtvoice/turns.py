"""A session's turns, sans I/O: text in, segments out to the engine, and when each turn is
done — no sockets, no asyncio, no engine. `Turns` is driven by the session (client events,
engine turn ends) and acts through a `TurnPort` the session implements (submit a segment,
cancel the running one, finish or drop a turn's audio stream, say `done`).

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

Memory: text per context is bounded by ``max_text_chars``; contexts with unfinished work by
``max_contexts``; remembered idle contexts by four times that.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import TurnError
from engine.request import FinishReason, TurnResult
from protocol import Done, Error, ErrorCode, ProtocolError
from rtvoice.segmenter import Cut, Segmenter, estimate_speech_seconds
from rtvoice.settings import LimitSettings

__all__ = ["Context", "Segment", "TurnPort", "Turns", "Utterance", "frame_budget",
           "segment_chars"]

# A context's next segment goes to the engine to prefill ahead while its text streams: once
# its fixed start (Segmenter.head) has HEAD_FIRST_CHARS characters, then each time that has
# grown by HEAD_STEP_CHARS more — a few prefill jobs per sentence, leaving at most that much
# text (plus the turn's wrapper) to prefill once the sentence is complete.
HEAD_FIRST_CHARS = 12
HEAD_STEP_CHARS = 32

# Worst-case text tokens per character: a code point is at most 4 UTF-8 bytes, and both the
# byte tokenizer (tiny) and a byte-level BPE (S2-Pro's Qwen3) need at most one token per byte.
WORST_TOKENS_PER_CHAR = 4


def segment_chars(text_room: int) -> int:
    """Characters one segment may have when the engine leaves `text_room` tokens for a turn's
    text next to the voice prompt (`Engine.text_room`); negative when there is no room."""
    return text_room // WORST_TOKENS_PER_CHAR if text_room >= 0 else -1


def frame_budget(text: str, *, multiplier: float, min_frames: int, max_frames: int,
                 request_max: int | None, frame_rate: float) -> int:
    """Frames one segment may generate: `multiplier` times its expected speech duration, at
    least `min_frames`, at most the request's ``max_new_tokens`` and `max_frames`."""
    derived = math.ceil(estimate_speech_seconds(text) * multiplier * frame_rate)
    budget = max(min_frames, derived)
    if request_max is not None:
        budget = min(budget, request_max)
    return max(1, min(budget, max_frames))


@dataclass(slots=True, eq=False)
class Context:
    id: str | None
    segmenter: Segmenter
    open: Utterance | None = None  # accepting text
    pending: list[Utterance] = field(default_factory=list)  # flushed, audio not finished
    unspoken_chars: int = 0  # buffered + queued segment text (bounded by max_text_chars)
    next_seq: int = 0  # audio event sequence number (assigned at send time: no gaps)
    sent_s: float = 0.0  # audio seconds sent in this context (offset of the next chunk)
    next_segment: int = 0  # index of its next ``segment`` event
    head_sent: str = ""  # the start of its next segment last offered to prefill ahead

    @property
    def live(self) -> bool:
        return self.open is not None or bool(self.pending) or self.segmenter.buffered > 0

    def utterances(self) -> list[Utterance]:
        return [*self.pending, *([self.open] if self.open is not None else [])]


@dataclass(slots=True, eq=False)
class Utterance:
    context: Context
    index: int
    flushed: bool = False  # no more segments will be added
    cancelled: bool = False
    finished: bool = False  # ``done`` queued
    segments_total: int = 0
    segments_done: int = 0
    text_chars: int = 0
    text_events: int = 0
    frames: int = 0
    gen_s: float = 0.0  # generation wall time of its segments (for rtf)
    samples_in: int = 0  # model-rate samples handed to the encoder
    encoded_s: float = 0.0  # audio seconds that went into its encoder (encode worker)
    carry_s: float = 0.0  # audio encoded but not yet in a chunk (encoder delay)
    sent_s: float = 0.0  # audio seconds sent
    reasons: set[str] = field(default_factory=set)
    encoder: object | None = None  # an AudioEncoder, created and used by the encode worker
    # segments whose first audio went into the encoder but is in no chunk yet (encode worker)
    awaiting_audio: list[Segment] = field(default_factory=list)
    segment_ttfa_s: list[float] = field(default_factory=list)  # in the order they were sent
    prefill_s: float | None = None  # its first spoken segment: handed over -> prompt in

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

    def done_event(self, sample_rate: int) -> Done:
        """Its ``done``; `sample_rate`: the model's (the rate of `samples_in`)."""
        audio_s = self.sent_s if self.cancelled else self.samples_in / sample_rate
        ttfa = self.ttfa_s()
        return Done(
            context_id=self.context.id,
            reason=self.done_reason(),
            ttfa_ms=None if ttfa is None else round(ttfa * 1000, 3),
            prefill_ms=None if self.prefill_s is None else round(self.prefill_s * 1000, 3),
            audio_s=round(audio_s, 6),
            frames=self.frames,
            rtf=round(self.gen_s / audio_s, 4) if audio_s > 0 and self.gen_s > 0 else None,
            segments=self.segments_total,
            text_chars=self.text_chars,
        )


@dataclass(slots=True, eq=False)
class Segment:
    utterance: Utterance
    text: str
    max_frames: int
    turn_id: str = ""
    # TTFA origin: handed to the engine, i.e. the moment it was complete (cut) and the
    # session's previous segment had ended: ready to generate
    submitted_at: float = 0.0
    has_audio: bool = False  # its first audio went to the encoder (encode worker)
    char_start: int = 0  # [char_start, char_end) in its utterance's text
    char_end: int = 0
    index: int = -1  # its ``segment`` event's index in the context (-1: none sent)
    start_s: float = 0.0  # where its audio starts within its utterance's audio
    end_s: float = 0.0  # ... and ends (known when the engine ended it)

    @property
    def continues(self) -> bool:
        """An earlier segment of its utterance had audio: the client is playing it, and this
        one must start before that audio runs out (the engine serves it first)."""
        return self.utterance.samples_in > 0


class TurnPort(Protocol):
    """What `Turns` asks of its session."""

    def submit(self, seg: Segment) -> None:
        """Hand the segment to the engine now (`seg.turn_id` is set)."""

    def cancel_running(self) -> None:
        """Stop the engine's running segment (its end arrives as `Turns.segment_ended`)."""

    def ended(self, seg: Segment) -> None:
        """The engine ended the segment (not cancelled): all of its audio is in. Comes before
        its utterance's `finish`."""

    def finish(self, utt: Utterance) -> None:
        """All of the utterance's audio is in: flush its encoder, then say ``done``."""

    def drop(self, utt: Utterance) -> None:
        """The utterance was cancelled: close its encoder, send none of its audio."""

    def done(self, utt: Utterance) -> None:
        """Say the (cancelled) utterance's ``done`` now."""

    def acknowledge_cancel(self, context_id: str | None) -> None:
        """A cancel with nothing to stop: say ``done{cancelled}`` anyway."""

    def report(self, error: Error) -> None:
        """Send a non-fatal error event."""

    def ahead(self, text: str) -> None:
        """Nothing is generating or queued, and the next segment will begin with `text` (its
        text is still streaming): the engine may prefill that much of it now."""


class Turns:
    def __init__(self, port: TurnPort, *, session_id: str, limits: LimitSettings,
                 chunk_length: int, chunk_cap: int | None, default_context: str | None,
                 budget: dict[str, float | int | None], frame_rate: float) -> None:
        """`budget`: frame_budget's keyword arguments but the text and the frame rate."""
        self.port = port
        self.session_id = session_id
        self.limits = limits
        chunk = min(max(chunk_length, limits.min_chunk_length), limits.max_chunk_length)
        if chunk_cap is not None:  # what the context holds next to the voice prompt
            chunk = max(1, min(chunk, chunk_cap))
        self.chunk = chunk
        self.default_context = default_context
        self.budget = budget
        self.frame_rate = frame_rate
        self.contexts: dict[str | None, Context] = {}
        self.open_utterances: set[Utterance] = set()
        self.fifo: deque[Segment] = deque()
        self.running: Segment | None = None
        self.by_turn: dict[str, Segment] = {}
        # segments go to the engine only while this is set: from the voice's ``ready`` until
        # the session closes (before it they wait in the FIFO)
        self.accepting = False
        self._turn_ids = itertools.count()
        self._utt_ids = itertools.count()

    def close(self) -> None:
        """The session is over: drop every context, utterance and segment. Contexts and their
        utterances refer to each other; without this their memory (text, encoders, audio
        awaiting the encoder) would wait for the cycle collector after the session ends."""
        self.accepting = False
        for ctx in self.contexts.values():
            ctx.open = None
            ctx.pending.clear()
        for utt in self.open_utterances:
            utt.awaiting_audio.clear()
        self.contexts.clear()
        self.open_utterances.clear()
        self.fifo.clear()
        self.by_turn.clear()
        self.running = None

    # ------------------------------------------------------------------------- queries
    @property
    def busy(self) -> bool:
        """Something is generating or waits to: an idle timer must not fire."""
        return self.running is not None or bool(self.fifo) or any(
            u.flushed for u in self.open_utterances)

    @property
    def drained(self) -> bool:
        """Every utterance has its ``done`` queued and nothing is left to generate."""
        return not self.open_utterances and not self.fifo and self.running is None

    # ------------------------------------------------------------------------- client events
    def context(self, context_id: str | None, *, create: bool) -> Context | None:
        key = context_id if context_id is not None else self.default_context
        ctx = self.contexts.get(key)
        if ctx is not None or not create:
            return ctx
        ctx = Context(key, Segmenter(self.chunk))
        self.contexts[key] = ctx
        return ctx

    def text(self, context_id: str | None, text: str) -> None:
        """Text for a context: segments that are complete go to the FIFO (and the engine)."""
        ctx = self.context(context_id, create=True)
        assert ctx is not None
        if ctx.open is None and not text.strip():
            # Nothing to say (empty or whitespace) opens no turn: a flush after it is a no-op.
            self._forget_idle(ctx)
            return
        if not ctx.live and sum(c.live for c in self.contexts.values()) >= self.limits.max_contexts:
            self._forget_idle(ctx)
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"too many contexts with unfinished work (limit {self.limits.max_contexts}); "
                "flush or cancel one first",
                context_id=ctx.id,
                event="text",
                limit="max_contexts",
            )
        if ctx.unspoken_chars + len(text) > self.limits.max_text_chars:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"context {ctx.id!r} would hold {ctx.unspoken_chars + len(text)} unspoken "
                f"characters; the limit is {self.limits.max_text_chars}",
                context_id=ctx.id,
                event="text",
                limit="max_text_chars",
            )
        utt = ctx.open
        if utt is None:
            utt = ctx.open = Utterance(ctx, next(self._utt_ids))
            self.open_utterances.add(utt)
        utt.text_chars += len(text)
        utt.text_events += 1
        before = ctx.segmenter.buffered
        segments = ctx.segmenter.push_cuts(text)
        ctx.unspoken_chars += ctx.segmenter.buffered - before + sum(len(c.text) for c in segments)
        self._queue(utt, segments)
        if utt.text_events > 1:  # streaming (a sentence sent whole is flushed at once)
            self._offer_head(ctx)

    def flush(self, context_id: str | None) -> None:
        """End of a turn: its buffered text becomes its last segments."""
        ctx = self.context(context_id, create=False)
        if ctx is None or ctx.open is None:
            return  # nothing pending in this context: a flush is a no-op
        self._close_utterance(ctx)
        self.pump()

    def stop(self) -> None:
        """Every open turn is flushed."""
        for ctx in list(self.contexts.values()):
            if ctx.open is not None:
                self._close_utterance(ctx)
        self.pump()

    def cancel(self, context_id: str | None) -> set[Utterance]:
        """Barge-in: the context's turns stop now (buffered text dropped, queued segments
        removed, the running one cancelled in the engine). Returns the utterances
        cancelled (none of their audio may be sent from now on)."""
        ctx = self.context(context_id, create=False)
        key = context_id if context_id is not None else self.default_context
        utts = ctx.utterances() if ctx is not None else []
        if ctx is not None:
            ctx.segmenter.clear()
            ctx.head_sent = ""
            ctx.open = None
            ctx.pending = []
            ctx.unspoken_chars = 0
        if not utts:
            # Nothing to stop: still acknowledge, so a client can always wait for ``done``.
            self.port.acknowledge_cancel(key)
            return set()
        targets = set(utts)
        for utt in utts:
            utt.cancelled = True
            self.port.drop(utt)
        self.fifo = deque(s for s in self.fifo if s.utterance not in targets)
        running = self.running
        if running is not None and running.utterance in targets:
            self.port.cancel_running()
            # ``done`` follows the engine's acknowledgement (segment_ended) with the real frames;
            # the next segment need not wait for it: the engine stops this one before it
            # starts the next (it queues behind the cancel's drain), so it goes at once.
            self.running = None
        for utt in utts:
            if running is None or running.utterance is not utt:
                self._finish_cancelled(utt)
        return targets

    # ------------------------------------------------------------------------- engine side
    def pump(self) -> None:
        """Hand the next segment to the engine when the previous one has ended."""
        while self.accepting and self.running is None and self.fifo:
            seg = self.fifo.popleft()
            if seg.utterance.cancelled:
                continue
            seg.turn_id = f"{self.session_id}.{next(self._turn_ids)}"
            seg.utterance.context.head_sent = ""  # its next head is the next segment's
            self.running = seg
            self.by_turn[seg.turn_id] = seg
            self.port.submit(seg)

    def audio(self, turn_id: str, samples: int) -> Segment | None:
        """`samples` of audio for a segment: its segment, or None when nobody wants them
        (an unknown or cancelled turn)."""
        seg = self.by_turn.get(turn_id)
        if seg is None or seg.utterance.cancelled or samples == 0:
            return None
        seg.utterance.samples_in += samples
        return seg

    def segment_ended(self, result: TurnResult) -> Segment | None:
        """The engine ended a segment: its utterance's counters, its error (a non-fatal
        report when it was the client's fault; `ProtocolError(internal)` when ours), and its
        utterance's end once every segment is in. Returns the segment (None: unknown)."""
        seg = self.by_turn.pop(result.turn_id, None)
        if seg is None:
            return None
        if self.running is seg:
            self.running = None
        utt = seg.utterance
        ctx = utt.context
        if not utt.cancelled:
            ctx.unspoken_chars = max(0, ctx.unspoken_chars - len(seg.text))
        utt.frames += result.frames
        utt.segments_done += 1
        if result.reason is FinishReason.ERROR and not utt.cancelled:
            self._segment_error(seg, result)  # raises for our own failures (fatal)
        if result.ready_at is not None:
            utt.gen_s += max(0.0, result.decode_s)
            if utt.prefill_s is None and result.frames > 0:
                utt.prefill_s = max(0.0, result.ready_at - result.submitted_at)
        utt.reasons.add(str(result.reason))
        if utt.cancelled:
            self._finish_cancelled(utt)
        else:
            self.port.ended(seg)
            self._maybe_finish(utt)
        self.pump()
        return seg

    def _segment_error(self, seg: Segment, result: TurnResult) -> None:
        """A segment the engine failed, by whose fault (``TurnResult.error_code``): the
        client's (``too_large``: it does not fit the context), the caller's
        (``invalid_state``) or the server's capacity (``overloaded``: no KV blocks) end this turn with ``done{reason: "error"}`` after a non-fatal
        ``error`` event, and the session goes on; our own (``internal``, or no code) is fatal."""
        message = result.error or "engine error"
        code = {TurnError.TOO_LARGE: ErrorCode.TOO_LARGE,
                TurnError.INVALID_STATE: ErrorCode.INVALID_STATE,
                TurnError.OVERLOADED: ErrorCode.OVERLOADED}.get(
                    result.error_code or TurnError.INTERNAL)
        if code is None:
            raise ProtocolError(ErrorCode.INTERNAL, f"generation failed: {message}")
        self.port.report(Error(
            code=str(code),
            message=f"a segment of this turn was not spoken: {message}",
            fatal=False,
            done_follows=True,
            context_id=seg.utterance.context.id,
        ))

    def utterance_finished(self, utt: Utterance) -> None:
        """Its ``done`` is queued (after its audio)."""
        utt.finished = True
        self.open_utterances.discard(utt)
        ctx = utt.context
        if utt in ctx.pending:
            ctx.pending.remove(utt)
        self._evict_idle()

    # ------------------------------------------------------------------------- internals
    def _offer_head(self, ctx: Context) -> None:
        """While the engine has nothing to do for this session, the start of the context's
        next segment goes to it (`port.ahead`): first at HEAD_FIRST_CHARS characters, then
        each HEAD_STEP_CHARS more."""
        if not self.accepting or self.running is not None or self.fifo:
            return
        head, sent = ctx.segmenter.head(), ctx.head_sent
        if len(head) < HEAD_FIRST_CHARS or (sent and head.startswith(sent)
                                            and len(head) < len(sent) + HEAD_STEP_CHARS):
            return
        ctx.head_sent = head
        self.port.ahead(head)

    def _queue(self, utt: Utterance, segments: list[Cut]) -> None:
        if not segments:
            return
        for text, start, end in segments:
            budget = frame_budget(text, frame_rate=self.frame_rate, **self.budget)  # type: ignore[arg-type]
            self.fifo.append(Segment(utt, text, budget, char_start=start, char_end=end))
            utt.segments_total += 1
        self.pump()

    def _close_utterance(self, ctx: Context) -> None:
        utt = ctx.open
        assert utt is not None
        before = ctx.segmenter.buffered
        segments = ctx.segmenter.flush_cuts()
        ctx.unspoken_chars += sum(len(c.text) for c in segments) - before
        self._queue(utt, segments)
        utt.flushed = True
        ctx.open = None
        ctx.pending.append(utt)
        self._maybe_finish(utt)

    def _maybe_finish(self, utt: Utterance) -> None:
        if utt.flushed and not utt.cancelled and utt.segments_done == utt.segments_total:
            self.port.finish(utt)

    def _finish_cancelled(self, utt: Utterance) -> None:
        if utt.finished:
            return
        utt.finished = True
        self.open_utterances.discard(utt)
        self.port.done(utt)
        self._evict_idle()

    def _forget_idle(self, ctx: Context) -> None:
        if not ctx.live and ctx.next_seq == 0:
            self.contexts.pop(ctx.id, None)

    def _evict_idle(self) -> None:
        """Idle contexts keep their sequence numbers and offsets for a later turn, but a
        client cycling through context ids must not grow the session without bound: beyond
        4 x max_contexts, the oldest idle ones are forgotten (a reused id then restarts at 0)."""
        excess = len(self.contexts) - 4 * self.limits.max_contexts
        if excess <= 0:
            return
        for key in [k for k, c in self.contexts.items() if not c.live][:excess]:
            del self.contexts[key]
