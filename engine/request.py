"""The one request object passed between engine parts: a `Sequence` (a voice session's
conversation, whose KV lives in blocks of the paged pool) and its current `Turn`; and the
two messages the scheduler sends its workers about them: a `PrefillJob` (columns to write
into a sequence's blocks) and a `RowOp` (a change to a decode row's device-side state)."""

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
    WAITING = "waiting"  # voice prompt waits for KV blocks
    PREFILLING = "prefilling"  # voice prompt being prefilled (or shared, once its owner's lands)
    IDLE = "idle"  # voice prompt (and earlier turns) in the cache (or evicted to host), no turn
    TURN_PREFILL = "turn_prefill"  # a turn's prompt waits for blocks or is being prefilled
    QUEUED = "queued"  # a turn's prompt is in; the turn waits for a decode row
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


@dataclass(frozen=True, slots=True)
class Chunking:
    """A session's own audio chunking; a field left None takes the engine's setting (and a
    default first chunk doubles during slow start; a chosen one is kept as chosen)."""

    first: int | None = None  # codec frames in a turn's first chunk
    size: int | None = None  # codec frames in later chunks


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
    rebuilt: bool = False  # its prompt re-prefills the context after the voice (context full)
    finished: FinishReason | None = None
    # the client already plays audio of this utterance (a later sentence of it): its prefill
    # and its decode row come before those of turns that start an utterance, which have no
    # audio to run out of
    continues: bool = False


@dataclass(slots=True, eq=False)
class Ahead:
    """The head of a turn prefilled before the turn arrived (its text was still streaming):
    columns `cols` (the previous assistant turn's close, the user header, the text's first
    tokens) written at positions [start, start + n) while the sequence was idle."""

    start: int  # the sequence's pos before it (where the turn's prompt begins)
    cols: Tensor  # [1+K, n] everything prefilled ahead so far
    closes_previous: bool  # cols begin with the previous assistant turn's <|im_end|>
    in_flight: int = 0  # its prefill jobs not landed yet
    job: PrefillJob | None = None  # the last one (a turn that waits for it makes it urgent)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    references: tuple[Reference, ...]
    params: SamplingParams
    seed: int
    sink: SequenceSink
    created_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0  # when it got KV blocks (its wait in the queue: - created_at)
    state: SeqState = SeqState.WAITING
    row: int | None = None  # the decode row its running turn holds
    blocks: list[int] = field(default_factory=list)  # its block table (KV pool blocks)
    prompt_key: str = ""  # identity of its voice prompt (shared prefixes)
    # its KV in host memory (evicted while idle): (saved KV, host bytes, blocks), or None
    offloaded: tuple[object, int, int] | None = None
    last_used: float = field(default_factory=time.perf_counter)  # LRU order of idle sessions
    jobs_in_flight: int = 0  # prefill jobs created and not landed: its blocks may be written
    pos: int = 0  # positions filled in the KV cache
    system_cols: Tensor | None = None
    history: list[tuple[str, Tensor]] = field(default_factory=list)  # (text, codes fed) per turn
    chunking: Chunking = field(default_factory=Chunking)
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
    ahead: Ahead | None = None  # the next turn's head, prefilled while its text streams

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.state.value}, row={self.row}, pos={self.pos}, "
                f"blocks={len(self.blocks)})")


@dataclass(slots=True, eq=False)
class PrefillJob:
    """Prompt columns to write into a sequence's blocks, a chunk per prefill round; before
    the first chunk, the block work its sequence needs (restore from host, copy-on-write)."""

    seq: Sequence
    cols: Tensor  # [1+K, n] columns to write at `start`
    start: int
    turn: Turn | None  # None: the voice prompt, or (`ahead`) the head of a turn to come
    blocks: tuple[int, ...]  # fixed at creation: the prefill thread never reads seq.blocks
    restore: tuple[object, tuple[int, ...]] | None = None  # (saved KV, blocks to write it to)
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) blocks to copy first
    # the copies' sources: the sequence's hold on them ends when the job lands (until the copy
    # has run, nothing may reuse them)
    sources: tuple[int, ...] = ()
    prepared: bool = False  # restore and copies done
    done: int = 0  # columns written so far
    # set by the prefill worker: a CUDA event the decode stream waits on before the sequence
    # joins, None (CPU, or nothing to wait for), or the exception that failed it
    event: object | None = None
    landed_at: float = 0.0  # when the decode thread took it (launched, maybe not done)
    ahead: bool = False  # columns of `seq.ahead`: a turn's head prefilled before the turn
    # (ahead) a turn waits for it: not behind the other jobs any more, and no longer counted
    # as speculative (Scheduler.ahead_outstanding)
    urgent: bool = False

    @property
    def rank(self) -> int:
        """Order in a prefill round (lowest first; FIFO within a rank): a turn whose
        utterance is playing, then other turns and voice prompts, then speculative heads."""
        if self.ahead and not self.urgent:
            return 2
        return 0 if self.turn is not None and self.turn.continues else 1

    @property
    def abandoned(self) -> bool:
        """Its sequence closed or its turn was cancelled: nothing more to write."""
        return self.seq.state is SeqState.CLOSED or (self.turn is not None and self.turn.cancelled)


@dataclass(slots=True, frozen=True)
class RowOp:
    """A change to one decode row's device-side state, in the order the scheduler decided
    it; the decode worker applies the queued ops on the decode stream before its next step.
    join: a turn starts decoding on the row from the next step on — its sampling parameters
    and seed, its block table `blocks`, the column `col` fed at `pos`, at most `max_frames`
    frames; extend: `blocks` appended to the row's table from entry `pos` on; leave: stop
    decoding the row; free: the row holds no turn any more (the host's bookkeeping only —
    the device already stopped it, or a leave did: the runner's shared-prefix plan)."""

    kind: Literal["join", "extend", "leave", "free"]
    row: int
    params: SamplingParams | None = None
    seed: int = 0
    col: Tensor | None = None  # [1+K]
    pos: int = 0
    max_frames: int = 0
    blocks: tuple[int, ...] = ()
