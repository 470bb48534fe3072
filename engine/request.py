"""The one request object passed between engine parts: a `Sequence` (a voice session's
conversation, living in one KV slot) and its current `Turn`; and the two messages the
scheduler sends its workers about them: a `PrefillJob` (columns to write into a slot) and
a `SlotOp` (a change to a slot's device-side decode state)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from torch import Tensor

from .errors import TurnError
from .prompt import Reference
from .sampler import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"  # voice prompt queued for prefill
    PREFILLING = "prefilling"
    IDLE = "idle"  # voice prompt (and earlier turns) in the cache, no turn running
    TURN_PREFILL = "turn_prefill"
    DECODING = "decoding"
    CLOSED = "closed"


class FinishReason(enum.StrEnum):
    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class TurnResult:
    turn_id: str
    reason: FinishReason
    frames: int
    audio_s: float
    submitted_at: float
    ready_at: float | None  # prefill of the turn done: generation may start (TTFA origin)
    first_audio_at: float | None
    finished_at: float
    codes: Tensor | None = None  # [K, frames] generated codes (all frames, im_end excluded)
    error: str | None = None
    error_code: TurnError | None = None  # with reason ERROR: whose fault

    @property
    def ttfa_s(self) -> float | None:
        if self.first_audio_at is None or self.ready_at is None:
            return None
        return self.first_audio_at - self.ready_at

    @property
    def decode_s(self) -> float:
        return self.finished_at - (self.ready_at or self.submitted_at)

    @property
    def rtf(self) -> float | None:
        """Generation time / audio time (< 1 is faster than realtime)."""
        return self.decode_s / self.audio_s if self.audio_s > 0 else None


class SequenceSink(Protocol):
    """Callbacks from the engine thread. They must be quick and must not block: the service
    hands them over to its event loop."""

    def on_ready(self, seq: Sequence, prefill_s: float) -> None: ...

    def on_audio(self, seq: Sequence, turn_id: str, pcm: np.ndarray, offset_s: float) -> None:
        """pcm: float32 samples in an array made for this codec tick, never reused by the
        engine (the sink may keep it without copying)."""

    def on_turn_end(self, seq: Sequence, result: TurnResult) -> None: ...

    def on_error(self, seq: Sequence, message: str) -> None: ...


@dataclass(slots=True, eq=False)
class Turn:
    turn_id: str
    text: str
    max_frames: int
    submitted_at: float = field(default_factory=time.perf_counter)
    cols: Tensor | None = None  # prompt columns still to prefill [1+K, n]
    ready_at: float | None = None
    first_audio_at: float | None = None
    frames: list[Tensor] = field(default_factory=list)  # audible frames, each [1+K] (host)
    all_frames: list[Tensor] = field(default_factory=list)  # every frame generated (history)
    reported: bool = False  # on_turn_end was called
    decoded_frames: int = 0  # frames handed to the codec
    samples_out: int = 0
    codec_stream: int | None = None
    cancelled: bool = False
    closes_previous: bool = False  # its prompt starts by closing the previous assistant turn
    finished: FinishReason | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    references: tuple[Reference, ...]
    params: SamplingParams
    seed: int
    sink: SequenceSink
    created_at: float = field(default_factory=time.perf_counter)
    slot_at: float = 0.0  # when it got a KV slot (its wait in the queue: slot_at - created_at)
    state: SeqState = SeqState.WAITING
    slot: int | None = None
    pos: int = 0  # positions filled in the KV cache
    system_cols: Tensor | None = None
    history: list[tuple[str, Tensor]] = field(default_factory=list)  # (text, codes fed) per turn
    turn: Turn | None = None  # the turn in prefill or on the device
    queued_turn: Turn | None = None  # waits for the voice prompt or a cancelled turn's drain
    decoding: Turn | None = None  # the turn whose frames the device produces
    draining: bool = False  # left the device batch; steps already launched may still emit rows
    leave_step: int = 0
    turns_started: int = 0
    next_col: Tensor | None = None  # the column the next decode step feeds [1+K]
    turn_start_pos: int = 0  # cache position where the running turn's prompt began
    closed_turn: bool = True  # the last assistant turn has been closed with <|im_end|>
    needs_rebuild: bool = False  # the cache lost its prompt (rollback past a rebuild)
    prefill_s: float = 0.0

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.state.value}, slot={self.slot}, pos={self.pos})"


@dataclass(slots=True, eq=False)
class PrefillJob:
    """Prompt columns to write into a sequence's slot, a chunk per prefill round."""

    seq: Sequence
    cols: Tensor  # [1+K, n] columns to write at `start`
    start: int
    turn: Turn | None  # None: the voice prompt
    slot: int  # fixed at creation: the prefill thread never reads seq.slot
    done: int = 0  # columns written so far
    # set by the prefill worker: a CUDA event the decode stream waits on before the sequence
    # joins, None (CPU, or nothing to wait for), or the exception that failed it
    event: object | None = None
    landed_at: float = 0.0  # when the decode thread took it (launched, maybe not done)

    @property
    def abandoned(self) -> bool:
        """Its sequence closed or its turn was cancelled: nothing more to write."""
        return self.seq.state is SeqState.CLOSED or (self.turn is not None and self.turn.cancelled)


@dataclass(slots=True, frozen=True)
class SlotOp:
    """A change to one slot's device-side decode state, in the order the scheduler decided
    it; the decode worker applies the queued ops on the decode stream before its next step.
    assign: sampling parameters (a new sequence); join: feed `col` at `pos` from the next
    step on, for at most `max_frames` frames; leave: stop decoding the slot."""

    kind: Literal["assign", "join", "leave"]
    slot: int
    params: SamplingParams | None = None
    seed: int = 0
    col: Tensor | None = None  # [1+K]
    pos: int = 0
    max_frames: int = 0
