"""The scheduler: every decision of the engine, as plain host state — no threads, no device.

It owns the lifecycle of sequences (a voice session's conversation in one KV slot) and their
turns: admission and the wait for a slot, the voice prompt's prefill, turns (context rebuild
when the cache is full, rollback of a turn cancelled before it spoke), joining the decode
batch, leaving it (end of a turn, cancel, close) and draining the steps still in flight.
It also owns the chunk policy of the audio (first chunk, growth, holding far-ahead streams
for a fuller codec tick) and the prefill-first pause. The workers only move tensors: the
engine's loops ask the scheduler for a plan, hand it to a worker and give the result back:

    prefill:  take_prefill_jobs() -> PrefillWorker.round(...) -> prefill_done(job)
    decode:   take_slot_ops() + plan_step(now) -> DecodeWorker.launch / read -> step_done(...)
    codec:    plan_codec(now) -> CodecWorker.decode(...) -> codec_done(plan, pcm)

Device-side changes the scheduler decides (a slot's sampling parameters, joining, leaving)
are queued as `SlotOp`s, which the decode worker applies on its stream before its next step.

Threads (the scheduler starts none): the decode side (commands, prefill landings, steps) is
driven by one thread — the decode thread, or the caller in sync mode. The codec side
(`plan_codec`, `codec_done`, `codec_failed`) may run on another thread: the audio list is
shared under a lock, and turn ends are ordered against audio by the emit lock. Everything
else it reads across (a turn's frame list, its `finished` mark, `step_s`) is written in an
order that makes a stale read harmless (see `step_done`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .config import EngineConfig, TokenIds
from .errors import TurnError
from .prompt import PromptBuilder
from .request import (
    FinishReason,
    PrefillJob,
    SeqState,
    Sequence,
    SlotOp,
    Turn,
    TurnResult,
)

log = logging.getLogger(__name__)

# Positions a (re)built context keeps free beyond a turn's prompt: room for this many frames
# of generation plus slack (and a position for the frame a pingpong step may add after a
# cancel).
TURN_FRAMES_ROOM = 64
TURN_SLACK = 2
TURN_MARGIN = TURN_FRAMES_ROOM + TURN_SLACK


@dataclass(slots=True, frozen=True)
class StepPlan:
    """One decode step to launch: slot rows 0..B-1, keys over [0, span)."""

    k: int  # the step's number (steps launched before it)
    B: int
    span: int
    t_launch: float


@dataclass(slots=True)
class CodecPlan:
    """One codec tick: the new frames of each stream that has a chunk due, and the turns
    whose codec streams the worker must close (their audio ended or was dropped)."""

    work: list[tuple[Sequence, Turn, Tensor]] = field(default_factory=list)  # codes [K, n]
    released: list[Turn] = field(default_factory=list)
    busy: bool = False  # something happened (turns ended): the codec loop should not sleep


def new_stats() -> dict[str, float]:
    """The engine's counters (shared by the scheduler and the workers; benches reset them)."""
    return {"steps": 0, "frames": 0, "prefill_cols": 0, "decode_s": 0.0, "prefill_s": 0.0,
            "codec_s": 0.0, "codec_ticks": 0, "wasted_rows": 0, "prefill_calls": 0,
            "decode_pauses": 0, "decode_paused_s": 0.0}


class Scheduler:
    def __init__(self, cfg: EngineConfig, prompts: PromptBuilder, *, n_slots: int,
                 sample_rate: int, frame_samples: int, ids: TokenIds,
                 stats: dict[str, float] | None = None) -> None:
        if cfg.max_len is None:
            raise ValueError("the scheduler needs a resolved EngineConfig (max_len set)")
        self.cfg = cfg
        self.prompts = prompts
        self.n_slots = n_slots
        self.max_len: int = cfg.max_len
        self.sample_rate = sample_rate
        self.frame_rate = sample_rate / frame_samples  # audio frames per second
        self.ids = ids
        self.frame_rows = prompts.k + 1  # a frame column: the token, then its codes
        self.stats = stats if stats is not None else new_stats()
        self._rng = random.Random(cfg.seed)
        self._free = list(range(n_slots))  # slots not owned by any sequence
        self.waiting: deque[Sequence] = deque()  # admitted, waiting for a slot
        self.live: dict[int, Sequence] = {}  # seq_id -> sequences that hold a slot
        self.running: dict[int, Sequence] = {}  # slot -> sequence that may be active on the device
        self._slot_ops: list[SlotOp] = []
        self._new_jobs: list[PrefillJob] = []
        self.prefill_outstanding = 0  # prefill jobs created and not landed yet
        self.k = 0  # decode steps planned (launched)
        self.processed = -1  # the last step whose result was read
        # seconds per decode step (EMA over back-to-back launches; None until measured):
        # each step gives every running stream one frame, so it sets their speed
        self.step_s: float | None = None
        self._last_launch: float | None = None
        self._paused_at: float | None = None  # when the current pause for prefills began
        # audio side, shared with the codec thread
        self._audio: list[tuple[Sequence, Turn]] = []
        self._audio_lock = threading.Lock()
        self._emit_lock = threading.Lock()  # orders on_audio vs. a cancel's on_turn_end

    # ================================================================ sizes
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def turn_room(self, system_cols: int) -> int:
        """Text tokens one turn may have next to a voice prompt of `system_cols` positions, so
        that it always fits the context with room to speak (`TURN_MARGIN`); negative when
        even an empty turn does not fit."""
        wrapper = self.prompts.user_turn("").shape[1]
        return self.max_len - system_cols - wrapper - TURN_MARGIN

    def has_room(self) -> bool:
        """Whether one more sequence may be admitted (a free slot or a place in the queue)."""
        return len(self.waiting) < self.cfg.max_waiting + max(0, self.free_slots)

    def seed_for(self, requested: int | None) -> int:
        return requested if requested is not None else self._rng.randrange(2**31)

    # ================================================================ commands
    def admit(self, seq: Sequence) -> None:
        """A new sequence: it waits for a slot, then its voice prompt is prefilled."""
        self.waiting.append(seq)
        self._assign_slots()

    def _assign_slots(self) -> None:
        while self.waiting and self._free:
            seq = self.waiting.popleft()
            if seq.state is SeqState.CLOSED:
                continue
            self._free.sort()
            seq.slot = self._free.pop(0)  # lowest first keeps live slots dense
            seq.slot_at = time.perf_counter()
            self._slot_ops.append(SlotOp("assign", seq.slot, params=seq.params, seed=seq.seed))
            self.live[seq.seq_id] = seq
            seq.pos = 0
            seq.state = SeqState.PREFILLING
            assert seq.system_cols is not None
            self._queue_prefill(seq, seq.system_cols, 0, None)

    def _queue_prefill(self, seq: Sequence, cols: Tensor, start: int, turn: Turn | None) -> None:
        assert seq.slot is not None
        self.prefill_outstanding += 1
        self._new_jobs.append(PrefillJob(seq, cols, start, turn, seq.slot))

    def start_turn(self, seq: Sequence, turn: Turn) -> None:
        """A turn on a sequence: prefilled now, or queued behind its voice prompt or a
        cancelled turn still draining."""
        if seq.state is SeqState.CLOSED:
            self._fail_turn(seq, turn, "the sequence is closed", TurnError.INVALID_STATE)
            return
        if (seq.turn is not None and not seq.draining) or seq.queued_turn is not None:
            self._fail_turn(seq, turn, "a turn is already running on this sequence",
                            TurnError.INVALID_STATE)
            return
        if seq.state is SeqState.IDLE and not seq.draining:
            seq.turn = turn
            self._queue_turn_prefill(seq)
        else:
            seq.queued_turn = turn

    def _queue_turn_prefill(self, seq: Sequence) -> None:
        turn = seq.turn
        assert turn is not None
        new = self.prompts.user_turn(turn.text)
        close = [] if seq.closed_turn else [self.prompts.assistant_close()]
        cols = torch.cat([*close, new], dim=1)
        turn.closes_previous = bool(close)
        if seq.needs_rebuild or seq.pos + cols.shape[1] + min(turn.max_frames, TURN_FRAMES_ROOM) \
                + TURN_SLACK > self.max_len:
            rebuilt = self._rebuild_context(seq, new)
            if rebuilt is None:
                seq.turn = None
                self._fail_turn(seq, turn, f"turn text is too long for the context "
                                           f"({self.max_len} positions)", TurnError.TOO_LARGE)
                return
            cols = rebuilt
        seq.closed_turn = True
        seq.turn_start_pos = seq.pos
        # -2: one position of slack for the frame a pingpong step may add after a cancel
        turn.max_frames = max(1, min(turn.max_frames, self.max_len - seq.pos - cols.shape[1] - 2))
        seq.state = SeqState.TURN_PREFILL
        turn.cols = cols
        # all columns but the last go through prefill; the first decode step feeds the last
        self._queue_prefill(seq, cols[:, :-1], seq.pos, turn)

    def _rebuild_context(self, seq: Sequence, new: Tensor) -> Tensor | None:
        """Drop the oldest turns until system + recent turns + the new turn fit; re-prefill."""
        system = seq.system_cols
        assert system is not None
        keep: list[Tensor] = []
        budget = self.max_len - system.shape[1] - new.shape[1] - TURN_MARGIN
        if budget < 0:
            return None
        for text, codes in reversed(seq.history):
            cols = torch.cat([self.prompts.user_turn(text), self.prompts.assistant_close(codes)], 1)
            if cols.shape[1] > budget:
                break
            keep.insert(0, cols)
            budget -= cols.shape[1]
        dropped = len(seq.history) - len(keep)
        seq.history = seq.history[dropped:]
        seq.needs_rebuild = False
        log.info("seq %d: context full, dropped %d oldest turns and re-prefills", seq.seq_id, dropped)
        seq.pos = 0
        return torch.cat([system, *keep, new], dim=1)

    def cancel(self, seq: Sequence) -> None:
        """Stop the sequence's turn now: no audio of it after its `cancelled` end."""
        # A turn whose generation ended but whose audio is still draining stops here too.
        with self._audio_lock:
            draining_audio = [t for s, t in self._audio if s is seq and t is not seq.turn]
        for t in draining_audio:
            self._end_turn(seq, t, FinishReason.CANCELLED)
        if seq.queued_turn is not None:
            t, seq.queued_turn = seq.queued_turn, None
            self._end_turn(seq, t, FinishReason.CANCELLED)
        turn = seq.turn
        if turn is None or turn.finished is not None:
            return
        if seq.state is SeqState.DECODING:
            self._leave(seq)
            self._end_turn(seq, turn, FinishReason.CANCELLED)
            self._maybe_drained(seq)
            return
        # TURN_PREFILL: nothing was spoken; roll the cache back as if it never happened
        turn.cancelled = True
        self._rollback(seq, turn)
        seq.turn = None
        seq.state = SeqState.IDLE
        self._end_turn(seq, turn, FinishReason.CANCELLED)

    def abort_decoding(self, seq: Sequence, turn: Turn) -> None:
        """Take a turn that already reported its end (an error) off the device batch."""
        if seq.decoding is turn and seq.state is SeqState.DECODING and not seq.draining:
            self._leave(seq)
            self._maybe_drained(seq)

    def _leave(self, seq: Sequence) -> None:
        """Take a decoding sequence off the batch: steps launched before now (up to k - 1)
        may still produce its rows; it drains until they have been read."""
        assert seq.slot is not None
        self._slot_ops.append(SlotOp("leave", seq.slot))
        if not seq.draining:
            seq.draining, seq.leave_step = True, self.k

    @staticmethod
    def _rollback(seq: Sequence, turn: Turn) -> None:
        seq.pos = seq.turn_start_pos
        seq.closed_turn = not turn.closes_previous
        seq.needs_rebuild = seq.pos == 0

    def close(self, seq: Sequence) -> None:
        """The sequence ends: its turns stop without a report, its slot goes back once no
        launched step can write to it."""
        if seq.state is SeqState.CLOSED:
            return
        for t in (seq.turn, seq.queued_turn):
            if t is not None and t.finished is None:
                self._end_turn(seq, t, FinishReason.CANCELLED, notify=False)
        seq.queued_turn = None
        self.live.pop(seq.seq_id, None)
        if seq in self.waiting:  # it never got a slot: it must not hold a place in the queue
            self.waiting.remove(seq)
        on_device = seq.state is SeqState.DECODING or seq.draining
        seq.state = SeqState.CLOSED
        if seq.slot is not None:
            if on_device:  # the slot goes back once no launched step can write to it
                self._leave(seq)
                self._maybe_drained(seq)
            else:
                self._release(seq)
        self._assign_slots()

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.running.pop(seq.slot, None)
            if seq.slot in self._free or not 0 <= seq.slot < self.n_slots:
                raise RuntimeError(f"slot {seq.slot} released twice or never allocated")
            self._free.append(seq.slot)
            seq.slot = None

    def fail_sequence(self, seq: Sequence, message: str) -> None:
        """Tell the sink and close the sequence (its slot goes back), whatever state it is in."""
        if seq.state is SeqState.CLOSED:
            return
        try:
            seq.sink.on_error(seq, message)
            self.close(seq)
        except Exception:
            log.exception("closing failed sequence %d failed too", seq.seq_id)

    def slot_failed(self, slot: int, message: str) -> None:
        """A slot op the decode worker could not apply: the sequence holding the slot fails
        (its device state is unknown), no other."""
        for seq in list(self.live.values()):
            if seq.slot == slot:
                self.fail_sequence(seq, message)

    def fail_all_decoding(self, message: str) -> None:
        """A decode step failed: every turn on the device ends with an error, every sequence
        leaves the batch (its cache is suspect: the next turn re-prefills its context)."""
        for slot, seq in list(self.running.items()):
            self.running.pop(slot, None)
            turn = seq.decoding
            if turn is not None and turn.finished is None:
                self._end_turn(seq, turn, FinishReason.ERROR, error=message)
            seq.decoding = seq.turn = None
            seq.draining = False
            seq.needs_rebuild = True
            if seq.state is not SeqState.CLOSED:
                seq.state = SeqState.IDLE
            if seq.slot is not None:
                self._slot_ops.append(SlotOp("leave", seq.slot))
                if seq.state is SeqState.CLOSED:
                    self._release(seq)

    # ================================================================ prefill
    def take_prefill_jobs(self) -> list[PrefillJob]:
        """The prefill jobs created since the last call, in order."""
        jobs, self._new_jobs = self._new_jobs, []
        return jobs

    def prefill_done(self, job: PrefillJob) -> None:
        """A job's last chunk is on the device (or the job failed, or was abandoned): the
        voice prompt is in (ready), or the turn joins the decode batch. A failure here fails
        only this job's sequence."""
        self.prefill_outstanding -= 1
        if self.prefill_outstanding < 0:  # every job is counted when created: a bug if seen
            log.warning("prefill bookkeeping: %d more jobs landed than were queued",
                        -self.prefill_outstanding)
            self.prefill_outstanding = 0
        if isinstance(job.event, Exception):
            self.fail_sequence(job.seq, f"prefill failed: {job.event}")
            return
        try:
            self._land(job)
        except Exception as e:
            log.exception("joining sequence %d after its prefill failed", job.seq.seq_id)
            self.fail_sequence(job.seq, f"joining after prefill failed: {e}")

    def _land(self, job: PrefillJob) -> None:
        seq = job.seq
        if seq.state is SeqState.CLOSED:
            return
        if job.turn is None:  # the voice prompt
            seq.pos = job.cols.shape[1]
            seq.state = SeqState.IDLE
            seq.sink.on_ready(seq, time.perf_counter() - seq.created_at)
            self._next_queued_turn(seq)
            return
        turn = job.turn
        if turn.cancelled or seq.turn is not turn:
            return  # cancelled while prefilling: already rolled back
        seq.pos = job.start + job.cols.shape[1]
        assert turn.cols is not None and seq.slot is not None
        last = turn.cols[:, -1]
        turn.cols = None
        turn.ready_at = time.perf_counter()
        seq.state = SeqState.DECODING
        self._slot_ops.append(SlotOp("join", seq.slot, col=last, pos=seq.pos,
                                     max_frames=turn.max_frames, seed=self._turn_seed(seq)))
        self.running[seq.slot] = seq
        seq.decoding = turn
        with self._audio_lock:
            self._audio.append((seq, turn))

    @staticmethod
    def _turn_seed(seq: Sequence) -> int:
        seq.turns_started += 1
        return (seq.seed * 1_000_003 + seq.turns_started * 7919) % (2**31)

    def _next_queued_turn(self, seq: Sequence) -> None:
        if seq.queued_turn is not None and seq.state is SeqState.IDLE and not seq.draining:
            seq.turn, seq.queued_turn = seq.queued_turn, None
            self._queue_turn_prefill(seq)

    # ================================================================ decode
    def take_slot_ops(self) -> list[SlotOp]:
        """The device-side slot changes decided since the last call, in order: the decode
        worker applies them before it launches the next step."""
        ops, self._slot_ops = self._slot_ops, []
        return ops

    def plan_step(self, now: float, *, may_pause: bool = False) -> StepPlan | None:
        """The next decode step, or None: nothing runs, or (`may_pause`, the pingpong decode
        thread) the batch pauses for prefills — counted, and timed, in stats."""
        plan = None
        if self.running:
            if may_pause and self._yield_to_prefill(now):
                if self._paused_at is None:  # a pause starts
                    self._paused_at = now
                    self.stats["decode_pauses"] += 1
            else:
                plan = self._step_plan(now)
        if self._paused_at is not None and (plan is not None or not self.running):
            self.stats["decode_paused_s"] += time.perf_counter() - self._paused_at
            self._paused_at = None  # the pause ended: a step went, or nothing runs
        self._note_launch(plan)
        return plan

    def _step_plan(self, now: float) -> StepPlan:
        top = max(self.running) + 1  # rows 0..top-1 hold every running slot
        # the device may be one step ahead of what the host has read: +2 covers it
        need = max(s.pos for s in self.running.values()) + 2
        plan = StepPlan(self.k, top, need, now)
        self.k += 1
        self.stats["steps"] += 1
        return plan

    def _note_launch(self, plan: StepPlan | None) -> None:
        """Time back-to-back step launches (the decode rate every running stream gets); a
        pass without a launch (idle, paused) breaks the chain."""
        if plan is None:
            self._last_launch = None
            return
        if self._last_launch is not None:
            dt = plan.t_launch - self._last_launch
            self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt
        self._last_launch = plan.t_launch

    def first_chunk(self) -> int:
        """Frames in a turn's first audio chunk now: twice first_chunk_frames while the
        streams generate slower than slow_start_x times realtime."""
        first, step_s = self.cfg.first_chunk_frames, self.step_s
        if self.cfg.slow_start_x and step_s is not None \
                and step_s * self.frame_rate * self.cfg.slow_start_x > 1.0:
            return 2 * first
        return first

    def _yield_to_prefill(self, now: float) -> bool:
        """Prefill first: whether the next decode step waits because prompts are
        prefilling and no running turn needs a frame yet. LLM servers run a prefill batch
        alone for the same reason: sharing the GPU with decode steps and codec ticks, 64
        turns submitted at once spent 166 ms p50 in prefill (H200, docs/PERF.md) for ~75 ms
        of replays on an idle GPU."""
        if not self.prefill_outstanding or self.cfg.prefill_first_lead_s == 0:
            return False
        first = self.first_chunk()
        for seq in self.running.values():
            turn = seq.decoding
            # a draining (cancelled) turn needs no new step: reading the one in flight frees it
            if seq.draining or turn is None or turn.finished is not None:
                continue
            n = len(turn.frames)
            if n < first:  # joined, first chunk not generated yet: waits a bounded time
                if turn.ready_at is None or now - turn.ready_at >= self.cfg.prefill_first_wait_s:
                    return False
                continue
            start = turn.first_audio_at  # set by the codec side; None: first chunk in flight
            if start is not None and n / self.frame_rate - (now - start) < self.cfg.prefill_first_lead_s:
                return False
        return True

    def step_done(self, k: int, B: int, out: Tensor) -> bool:
        """Step k's result, read: out [B, 1+K+2] (host) = frame, was-active, stopped per row.
        Hands frames to their turns; returns whether any audible frame was added."""
        self.processed = k
        K1 = self.frame_rows
        im_end = self.ids.im_end
        rows = out.tolist()
        appended = False
        for slot, seq in list(self.running.items()):
            if slot >= B:
                continue
            row = rows[slot]
            if not row[K1]:  # was not active in that step
                if not seq.draining and seq.state is not SeqState.DECODING:
                    self.running.pop(slot, None)
                continue
            seq.pos += 1
            turn = seq.decoding
            if turn is None:
                continue
            frame = out[slot, :K1]  # a view of this step's (host) result
            turn.all_frames.append(frame)
            if seq.draining or turn.finished is not None:
                self.stats["wasted_rows"] += 1
                continue
            self.stats["frames"] += 1
            if row[0] == im_end:
                turn.all_frames.pop()
                self._generation_ended(seq, turn, FinishReason.EOS)
                continue
            # the frame goes in before `finished` is set: the codec side reads `finished`
            # first, then the frame count, so it never ends a turn with frames left behind
            turn.frames.append(frame)
            appended = True
            if row[K1 + 1]:
                self._generation_ended(seq, turn, FinishReason.LENGTH)
        for seq in [s for s in self.running.values() if s.draining]:
            self._maybe_drained(seq)
        return appended

    def _generation_ended(self, seq: Sequence, turn: Turn, reason: FinishReason) -> None:
        """EOS / LENGTH: the GPU already stopped the slot; audio drains through the codec."""
        turn.finished = reason  # read by the codec side after the last frame was appended
        self.running.pop(seq.slot, None)  # type: ignore[arg-type]
        self._record_history(seq, turn, reason)
        seq.turn = None
        seq.decoding = None
        seq.state = SeqState.IDLE
        self._next_queued_turn(seq)

    def _maybe_drained(self, seq: Sequence) -> None:
        """A sequence that left the batch is free once every step launched before it left
        has been read."""
        if not seq.draining or self.processed < seq.leave_step - 1:
            return
        turn = seq.decoding
        seq.draining = False
        seq.decoding = None
        self.running.pop(seq.slot, None)  # type: ignore[arg-type]
        seq.turn = None
        if seq.state is SeqState.CLOSED:
            self._release(seq)
            self._assign_slots()
            return
        if turn is not None:
            self._record_history(seq, turn, FinishReason.CANCELLED)
        seq.state = SeqState.IDLE
        self._next_queued_turn(seq)

    def _record_history(self, seq: Sequence, turn: Turn, reason: FinishReason) -> None:
        # Frames fed back into the cache form the assistant turn: all of them after an EOS
        # (the <|im_end|> frame itself is not fed), all but the last otherwise.
        frames = turn.all_frames
        n_fed = len(frames) if reason is FinishReason.EOS else max(0, len(frames) - 1)
        codes = (torch.stack(frames[:n_fed], 1)[1:] if n_fed
                 else torch.zeros(self.prompts.k, 0, dtype=torch.long))
        seq.history.append((turn.text, codes))
        seq.closed_turn = False

    # ================================================================ audio (codec side)
    def plan_codec(self, now: float) -> CodecPlan:
        """The streams with a chunk due, their new frames, and the turns whose audio is
        complete (reported here) or dropped (cancelled)."""
        plan = CodecPlan()
        due, first = False, self.first_chunk()
        ripe: list[tuple[Sequence, Turn, int]] = []
        with self._audio_lock:
            audio = list(self._audio)
        for s, turn in audio:
            if turn.cancelled:
                plan.released += self._drop_audio(turn)
                continue
            finished = turn.finished is not None  # read before the frame count (step_done)
            pending = len(turn.frames) - turn.decoded_frames
            if finished and pending == 0:
                plan.released += self._finish_audio(s, turn)
                plan.busy = True
                continue
            # Chunks grow 1, 1, 2, 4, 8, 8…: a small first chunk for TTFA, then doubling, so
            # the listener's buffer is topped up before it drains, then full-size chunks.
            need = min(self.cfg.chunk_frames, max(first, turn.decoded_frames))
            if pending == 0 or (pending < need and not finished):
                continue
            due |= finished or self._codec_due(turn, pending, now)
            ripe.append((s, turn, pending))
        if due:  # else every ripe stream is far enough ahead: wait for a fuller tick
            for s, turn, pending in ripe:
                codes = torch.stack(turn.frames[turn.decoded_frames: turn.decoded_frames + pending],
                                    dim=1)[1:]  # [K, n]
                plan.work.append((s, turn, codes))
        return plan

    def _codec_due(self, turn: Turn, pending: int, now: float) -> bool:
        """Whether a stream with a chunk's worth of frames needs a tick now. One that is
        more than `codec_hold_s` of audio ahead of realtime playback can wait: it rides
        along in the next tick another stream needs, or goes once it has two chunks
        pending — fewer, fuller ticks (each costs ~3 ms however few streams it carries).
        First chunks never wait (TTFA)."""
        if self.cfg.codec_hold_s == 0 or turn.decoded_frames < self.cfg.chunk_frames \
                or pending >= 2 * self.cfg.chunk_frames or turn.first_audio_at is None:
            return True
        ahead = turn.samples_out / self.sample_rate - (now - turn.first_audio_at)
        return ahead < self.cfg.codec_hold_s

    def codec_done(self, plan: CodecPlan, pcm: list[np.ndarray]) -> list[Turn]:
        """The tick's audio (float32 host samples per work item, by index): each turn's chunk
        goes to its sink; turns whose audio is complete end. Returns the turns whose codec
        streams to close."""
        released: list[Turn] = []
        for i, (s, turn, codes) in enumerate(plan.work):
            samples = pcm[i]
            with self._emit_lock:
                if turn.cancelled:
                    continue
                offset = turn.samples_out / self.sample_rate
                turn.decoded_frames += codes.shape[1]
                turn.samples_out += len(samples)
                if turn.first_audio_at is None:
                    turn.first_audio_at = time.perf_counter()
                s.sink.on_audio(s, turn.turn_id, samples, offset)
            if turn.finished is not None and turn.decoded_frames == len(turn.frames):
                released += self._finish_audio(s, turn)
        return released

    def codec_failed(self, plan: CodecPlan, exc: BaseException) -> list[tuple[Sequence, Turn]]:
        """The tick failed: its turns end with an error (their audio is lost). Returns them:
        the caller releases their codec streams and takes them off the decode batch
        (`abort_decoding`, on the decode side)."""
        failed = []
        for s, turn, _ in plan.work:
            self._drop_audio(turn)
            self._end_turn(s, turn, FinishReason.ERROR, error=f"audio decoding failed: {exc}")
            failed.append((s, turn))
        return failed

    def _drop_audio(self, turn: Turn) -> list[Turn]:
        with self._audio_lock:
            self._audio = [(s, t) for s, t in self._audio if t is not turn]
        return [turn] if turn.codec_stream is not None else []

    def _finish_audio(self, seq: Sequence, turn: Turn) -> list[Turn]:
        released = self._drop_audio(turn)
        with self._emit_lock:
            if not turn.reported and not turn.cancelled:
                turn.reported = True
                seq.sink.on_turn_end(seq, self._result(turn, turn.finished or FinishReason.ERROR))
        return released

    @property
    def audio_streams(self) -> int:
        """Turns whose audio is still being produced or decoded."""
        with self._audio_lock:
            return len(self._audio)

    # ================================================================ endings
    def _fail_turn(self, seq: Sequence, turn: Turn, message: str, code: TurnError) -> None:
        self._end_turn(seq, turn, FinishReason.ERROR, error=message, code=code)

    def _end_turn(self, seq: Sequence, turn: Turn, reason: FinishReason, *,
                  error: str | None = None, code: TurnError | None = None,
                  notify: bool = True) -> None:
        """Report a turn's end now (cancel, error): no audio of it is emitted afterwards."""
        with self._emit_lock:
            turn.cancelled = True
            turn.finished = reason
            if notify and not turn.reported:
                turn.reported = True
                if reason is FinishReason.ERROR and code is None:
                    code = TurnError.INTERNAL
                seq.sink.on_turn_end(seq, self._result(turn, reason, error, code))

    def _result(self, turn: Turn, reason: FinishReason, error: str | None = None,
                code: TurnError | None = None) -> TurnResult:
        frames = len(turn.frames)
        codes = torch.stack(turn.frames, 1)[1:] if frames else None
        return TurnResult(turn.turn_id, reason, frames, turn.samples_out / self.sample_rate,
                          turn.submitted_at, turn.ready_at, turn.first_audio_at,
                          time.perf_counter(), codes=codes, error=error, error_code=code)

