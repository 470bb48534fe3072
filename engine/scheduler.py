"""The scheduler: every decision of the engine, as plain host state — no threads, no device.

It owns the lifecycle of sequences (a voice session's conversation, its KV in blocks of the
paged pool) and their turns: admission (KV blocks for the voice prompt, or a share of an
identical prompt already in the pool), the voice prompt's prefill, turns (blocks for the
prompt and the first frames, copy-on-write of a shared last block, context rebuild when the
context is full, rollback of a turn cancelled before it spoke), a decode row for each
speaking turn (a turn waits in a queue when every row is taken; an idle session holds blocks
but no row), growing a speaking turn's blocks, leaving the batch (end of a turn, cancel,
close) and draining the steps still in flight, and eviction of the least recently used idle
sessions' KV to host memory when the pool runs low (restored with their next turn).
It also owns the chunk policy of the audio (first chunk, growth, holding far-ahead streams
for a fuller codec tick) and the prefill-first pause. The workers only move tensors: the
engine's loops ask the scheduler for a plan, hand it to a worker and give the result back:

    prefill:  take_prefill_jobs() -> PrefillWorker.round(...) -> prefill_done(job)
    decode:   plan_step(now) + take_row_ops() -> DecodeWorker.launch / read -> step_done(...)
    codec:    plan_codec(now) -> CodecWorker.decode(...) -> codec_done(plan, pcm)

Device-side changes the scheduler decides (a turn joining a row with its sampling
parameters and block table, a table growing, leaving) are queued as `RowOp`s, which the
decode worker applies on its stream before its next step. Moving an idle session's KV to
host memory is the one device call it makes, through the `evict` callback it is given.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .config import EngineConfig, TokenIds
from .errors import TurnError
from .kv_pool import BlockPool, PrefixCache, table_width
from .prompt import PromptBuilder
from .request import (
    Ahead,
    FinishReason,
    PrefillJob,
    RowOp,
    SeqState,
    Sequence,
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
# Fewest new columns worth a prefill-ahead job (a round of the prefill stream).
AHEAD_MIN_COLS = 4

Evict = Callable[[list[int]], object]  # blocks -> their KV saved in host memory


@dataclass(slots=True, frozen=True)
class StepPlan:
    """One decode step to launch: rows 0..B-1, keys over [0, span)."""

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
            "codec_s": 0.0, "codec_ticks": 0, "codec_slow_ticks": 0, "wasted_rows": 0, "prefill_calls": 0,
            "decode_pauses": 0, "decode_paused_s": 0.0, "prefix_hits": 0, "kv_evictions": 0,
            "kv_restores": 0, "kv_restore_s": 0.0, "cow_copies": 0, "row_waits": 0,
            "continuations": 0, "continuation_row_waits": 0,
            "turns_cut_no_blocks": 0, "ahead_jobs": 0, "ahead_cols": 0, "ahead_hits": 0,
            "ahead_misses": 0}


class Scheduler:
    def __init__(self, cfg: EngineConfig, prompts: PromptBuilder, *, n_rows: int,
                 n_blocks: int, block_size: int, sample_rate: int, frame_samples: int,
                 ids: TokenIds, stats: dict[str, float] | None = None,
                 evict: Evict | None = None, block_bytes: int = 0) -> None:
        """n_rows: decode rows (the batch); n_blocks / block_size: the KV pool; `evict`
        saves blocks to host memory (None: idle sessions are never evicted), each block
        costing `block_bytes` there, within cfg.kv_host_gib."""
        if cfg.max_len is None:
            raise ValueError("the scheduler needs a resolved EngineConfig (max_len set)")
        self.cfg = cfg
        self.prompts = prompts
        self.n_rows = n_rows
        self.max_len: int = cfg.max_len
        self.sample_rate = sample_rate
        self.frame_rate = sample_rate / frame_samples  # audio frames per second
        self.ids = ids
        self.frame_rows = prompts.k + 1  # a frame column: the token, then its codes
        self.stats = stats if stats is not None else new_stats()
        self._rng = random.Random(cfg.seed)
        self.pool = BlockPool(n_blocks, block_size)
        self.table_width = table_width(self.max_len, block_size)
        self.prefixes = PrefixCache(self.pool, cfg.prefix_cache)
        self._evict = evict
        self.block_bytes = block_bytes
        self.host_budget = int(cfg.kv_host_gib * 2**30)
        self.host_bytes = 0  # KV of evicted sessions held in host memory
        self._free_rows = list(range(n_rows))  # decode rows no turn holds
        self.waiting: deque[Sequence] = deque()  # admitted, waiting for blocks for the voice
        self.live: dict[int, Sequence] = {}  # seq_id -> sequences past the wait
        self.running: dict[int, Sequence] = {}  # row -> sequence that may be active on the device
        self.row_queue: deque[Sequence] = deque()  # turns prefilled, waiting for a row
        self.block_queue: deque[Sequence] = deque()  # turns waiting for blocks to prefill
        self._leaders: dict[str, Sequence] = {}  # prompt key -> the sequence prefilling it
        self._followers: dict[str, list[Sequence]] = {}  # ... and those waiting to share it
        self._row_ops: list[RowOp] = []
        self._new_jobs: list[PrefillJob] = []
        self.prefill_outstanding = 0  # prefill jobs created and not landed yet
        self.ahead_outstanding = 0  # ... of which prefill-ahead jobs (speculative)
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
    def free_rows(self) -> int:
        return len(self._free_rows)

    def may_pause(self, now: float, seconds: float) -> bool:
        """Whether decoding may stop for about `seconds` (a deferred graph's capture) with no
        one waiting on it: nothing prefills or waits for a row or blocks (their TTFA clocks
        run), and every speaking turn's generated audio is more than `seconds` ahead of its
        playback (its listener's buffer covers the pause; the codec lags generation by up
        to a chunk, so callers ask for that much more)."""
        if not self._nothing_waits():
            return False
        for seq in self.running.values():
            turn = seq.decoding
            if seq.draining or turn is None or turn.finished is not None:
                continue
            start = turn.first_audio_at  # None: its first audio is not out yet
            if start is None or len(turn.frames) / self.frame_rate - (now - start) < seconds:
                return False
        return True

    def _nothing_waits(self) -> bool:
        return not (self.prefill_outstanding or self.row_queue or self.block_queue
                    or self._row_ops or self._new_jobs)

    @property
    def offloaded(self) -> int:
        """Sessions whose KV is in host memory."""
        return sum(1 for s in list(self.live.values()) if s.offloaded is not None)

    def blocks_available(self) -> int:
        """Blocks a new session could get now: free ones, those only unused voice prefixes
        hold, and (with eviction, within the host budget) idle sessions' (read from other
        threads: a snapshot)."""
        n = self.pool.free + self.prefixes.unused_blocks()
        if self._evict is not None and self.host_bytes < self.host_budget:
            n += sum(len(s.blocks) for s in list(self.live.values())
                     if s.state is SeqState.IDLE and s.turn is None and not s.jobs_in_flight)
        return n

    def turn_room(self, system_cols: int) -> int:
        """Text tokens one turn may have next to a voice prompt of `system_cols` positions, so
        that it always fits the context with room to speak (`TURN_MARGIN`); negative when
        even an empty turn does not fit."""
        wrapper = self.prompts.user_turn("").shape[1]
        return self.max_len - system_cols - wrapper - TURN_MARGIN

    def has_room(self) -> bool:
        """Whether one more sequence may be admitted (a place in the queue for blocks)."""
        return len(self.waiting) < self.cfg.max_waiting + (0 if self.waiting else 1)

    def seed_for(self, requested: int | None) -> int:
        return requested if requested is not None else self._rng.randrange(2**31)

    # ================================================================ KV blocks
    def _reserve(self, n: int, *, keep: int = 0) -> bool:
        """Make n blocks free (and `keep` more, headroom for speaking turns to grow): drop
        voice prefixes no session shares, then evict the least recently used idle sessions
        to host memory. Whether they are free now."""
        while self.pool.free < n + keep:
            if self.prefixes.drop_unused():
                continue
            if not self._evict_one():
                return self.pool.free >= n + keep
        return True

    def _evict_one(self) -> bool:
        """Move the least recently used idle session's KV to host memory; False when none
        can go (none idle, or the host budget is spent)."""
        if self._evict is None:
            return False
        idle = [s for s in self.live.values()
                if s.state is SeqState.IDLE and s.turn is None and s.queued_turn is None
                and not s.draining and s.offloaded is None and s.blocks
                and not s.jobs_in_flight]  # a cancelled turn's prefill may still write them
        for seq in sorted(idle, key=lambda s: s.last_used):
            n = self.pool.blocks_for(seq.pos)
            cost = n * self.block_bytes
            if self.host_bytes + cost > self.host_budget:
                continue
            saved = self._evict(seq.blocks[:n]) if n else None
            self.host_bytes += cost
            seq.offloaded = (saved, cost, n)
            self.pool.release(seq.blocks)
            seq.blocks = []
            self.stats["kv_evictions"] += 1
            log.info("seq %d: idle, its KV (%d positions) moved to host memory", seq.seq_id,
                     seq.pos)
            return True
        return False

    def _drop_offloaded(self, seq: Sequence) -> tuple[object, int]:
        """Forget a session's host copy; returns it and how many blocks it holds (None, 0:
        there was none)."""
        if seq.offloaded is None:
            return None, 0
        saved, cost, n = seq.offloaded
        self.host_bytes -= cost
        seq.offloaded = None
        return saved, n

    def _release_blocks(self, seq: Sequence) -> None:
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks = []
        self._drop_offloaded(seq)

    def _retry_waits(self) -> None:
        """Blocks or rows may have freed: serve the turns and sessions waiting for them."""
        while self.block_queue:
            seq = self.block_queue[0]
            if seq.state is SeqState.CLOSED or seq.turn is None or seq.turn.cancelled:
                self.block_queue.popleft()
                continue
            if not self._prefill_turn(seq):
                break
            self.block_queue.popleft()
        if self.block_queue and not self.running and not self.prefill_outstanding:
            # nothing speaks or prefills, and every block is held by idle sessions that
            # cannot be evicted: these turns would wait for ever
            while self.block_queue:
                seq = self.block_queue.popleft()
                turn = seq.turn
                if turn is None or seq.state is SeqState.CLOSED:
                    continue
                self._rollback(seq, turn)
                seq.turn, seq.state = None, SeqState.IDLE
                self._fail_turn(seq, turn, f"no KV blocks free for this turn's prompt (pool of "
                                           f"{self.pool.n_blocks} blocks, all held by open "
                                           f"sessions); retry later", TurnError.OVERLOADED)
        self._admit_waiting()

    # ================================================================ commands
    def admit(self, seq: Sequence) -> None:
        """A new sequence: it shares an identical voice prompt already in the pool, or waits
        for blocks, then its voice prompt is prefilled."""
        self.waiting.append(seq)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if seq.state is SeqState.CLOSED:
                self.waiting.popleft()
                continue
            key = seq.prompt_key
            shared = self.prefixes.get(key) if key else None
            if shared is None and key in self._leaders:  # its twin is prefilling: wait for it
                self.waiting.popleft()
                self._enter(seq)
                self._followers.setdefault(key, []).append(seq)
                continue
            if shared is not None:
                self.waiting.popleft()
                self._enter(seq)
                self._share_prefix(seq)
                continue
            assert seq.system_cols is not None
            n = self.pool.blocks_for(seq.system_cols.shape[1])
            if not self._reserve(n, keep=len(self.running)):
                return  # first come, first served: later ones wait behind it
            self.waiting.popleft()
            self._enter(seq)
            seq.blocks = self.pool.alloc(n) or []
            if key and self.prefixes.max_entries:
                self._leaders[key] = seq
            self._queue_prefill(seq, seq.system_cols, 0, None)

    def _enter(self, seq: Sequence) -> None:
        seq.admitted_at = time.perf_counter()
        self.live[seq.seq_id] = seq
        seq.pos = 0
        seq.state = SeqState.PREFILLING

    def _share_prefix(self, seq: Sequence) -> None:
        """The voice prompt's blocks are in the pool already: share them, ready at once."""
        p = self.prefixes.get(seq.prompt_key)
        assert p is not None
        self.pool.share(p.blocks)
        seq.blocks = list(p.blocks)
        seq.pos = p.length
        seq.state = SeqState.IDLE
        self.stats["prefix_hits"] += 1
        seq.sink.on_ready(seq, time.perf_counter() - seq.created_at)
        self._next_queued_turn(seq)

    def _orphans(self, seq: Sequence) -> None:
        """A sequence prefilling a voice prompt others wait for is gone: the first of them
        prefills it instead."""
        key = seq.prompt_key
        if self._leaders.get(key) is not seq:
            return
        del self._leaders[key]
        for f in reversed(self._followers.pop(key, [])):
            if f.state is not SeqState.CLOSED:
                self.live.pop(f.seq_id, None)
                f.state = SeqState.WAITING
                self.waiting.appendleft(f)

    def _queue_prefill(self, seq: Sequence, cols: Tensor, start: int, turn: Turn | None, *,
                       restore: tuple[object, tuple[int, ...]] | None = None,
                       copies: tuple[tuple[int, int], ...] = (),
                       ahead: bool = False) -> PrefillJob:
        self.prefill_outstanding += 1
        self.ahead_outstanding += ahead
        seq.jobs_in_flight += 1
        job = PrefillJob(seq, cols, start, turn, tuple(seq.blocks), restore=restore,
                         copies=copies, sources=tuple(src for src, _ in copies), ahead=ahead)
        self._new_jobs.append(job)
        return job

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
        seq.last_used = time.perf_counter()
        self.stats["continuations"] += turn.continues
        if self._turn_may_start(seq):
            seq.turn = turn
            self._queue_turn_prefill(seq)
        else:
            seq.queued_turn = turn
            job = seq.ahead.job if seq.ahead is not None else None
            if job is not None and not job.urgent:  # its turn waits for it now: no longer
                job.urgent = True                   # speculative (first in its round, and
                self.ahead_outstanding -= 1         # a prefill the decode may pause for)

    @staticmethod
    def _turn_may_start(seq: Sequence) -> bool:
        """Idle, nothing draining, and no prefill-ahead job writing its head (the turn's
        job must come after it: two jobs of a sequence never share a prefill round)."""
        return seq.state is SeqState.IDLE and not seq.draining \
            and not (seq.ahead is not None and seq.ahead.in_flight)

    def _queue_turn_prefill(self, seq: Sequence) -> None:
        turn = seq.turn
        assert turn is not None
        ahead = self._drop_ahead(seq)  # back where the turn begins; its columns stay cached
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
            turn.rebuilt = True
            if ahead is not None:  # its columns sit at positions the rebuild rewrites
                self.stats["ahead_misses"] += 1
                ahead = None
        seq.closed_turn = True
        seq.turn_start_pos = seq.pos
        # -2: one position of slack for the frame a pingpong step may add after a cancel
        turn.max_frames = max(1, min(turn.max_frames, self.max_len - seq.pos - cols.shape[1] - 2))
        seq.state = SeqState.TURN_PREFILL
        if ahead is not None:  # the turn begins with what was prefilled ahead: keep it
            hit = _begins_with(cols, ahead.cols)
            self.stats["ahead_hits" if hit else "ahead_misses"] += 1
            if hit:
                seq.pos += ahead.cols.shape[1]
                cols = cols[:, ahead.cols.shape[1]:]
        turn.cols = cols
        if not self._prefill_turn(seq):
            _enqueue(self.block_queue, seq)  # served when blocks free (a close, an idle session)
            self._retry_waits()  # or refused now if none ever can

    def _prefill_turn(self, seq: Sequence) -> bool:
        """Blocks for the turn's prompt and first frames, then its prefill job. False: not
        enough blocks now (nothing was changed)."""
        turn = seq.turn
        assert turn is not None and turn.cols is not None
        end = seq.pos + turn.cols.shape[1] + min(turn.max_frames, TURN_FRAMES_ROOM) + TURN_SLACK
        claimed = self._claim_blocks(seq, min(end, self.max_len), evict=True)
        if claimed is None:
            return False
        restore, copies = claimed
        # all columns but the last go through prefill; the first decode step feeds the last
        self._queue_prefill(seq, turn.cols[:, :-1], seq.pos, turn, restore=restore,
                            copies=copies)
        return True

    def _claim_blocks(self, seq: Sequence, end: int, *, evict: bool
                      ) -> tuple[tuple[object, tuple[int, ...]] | None,
                                 tuple[tuple[int, int], ...]] | None:
        """Make the sequence's blocks cover positions [0, end) and own the ones from `pos`
        on: an evicted session's saved blocks come back (`restore`), a shared block it will
        write into is copied first (copy-on-write of a voice prefix's last block). `evict`:
        free blocks by evicting idle sessions if needed (False: only blocks free now).
        Returns (restore, copies) for its prefill job, or None: not enough blocks now
        (nothing was changed)."""
        p = self.pool
        bs = p.block_size
        want = min(p.blocks_for(end), self.table_width)
        first = seq.pos // bs  # the first block the job writes into
        shared: list[int] = []  # indices of the blocks it writes into that others hold
        if seq.offloaded is not None:
            # its saved blocks all come back (a context rebuild may have moved pos below them)
            want = need = max(want, seq.offloaded[2])
        else:
            shared = [i for i in range(first, len(seq.blocks)) if p.holders(seq.blocks[i]) > 1]
            need = max(0, want - len(seq.blocks)) + len(shared)
        keep = len(self.running)  # headroom for the speaking turns to grow
        if not (self._reserve(need, keep=keep) if evict else p.free >= need + keep):
            return None
        restore, copies = None, []
        if seq.offloaded is not None:
            seq.blocks = p.alloc(want) or []
            saved, n_saved = self._drop_offloaded(seq)
            if n_saved:
                restore = (saved, tuple(seq.blocks[:n_saved]))
                self.stats["kv_restores"] += 1
        else:
            for i in shared:  # copy-on-write: the voice prefix's last block
                new = p.alloc(1)
                assert new is not None
                if i * bs < seq.pos:  # the source stays held until the copy has run
                    copies.append((seq.blocks[i], new[0]))
                    self.stats["cow_copies"] += 1
                else:
                    p.release([seq.blocks[i]])
                seq.blocks[i] = new[0]
            more = p.alloc(max(0, want - len(seq.blocks)))
            assert more is not None
            seq.blocks += more
        return restore, tuple(copies)

    # ================================================================ prefill ahead
    def prefill_ahead(self, seq: Sequence, text: str) -> None:
        """The start of the sequence's next turn while its text still streams (`text`: what
        of it has arrived): the columns it fixes — the previous turn's close, the user
        header, its tokens but the last — are prefilled now, so that the turn, when it comes
        and begins with them, prefills only the rest (its TTFA waits for a few columns, not
        a sentence). Speculative, so never in anyone's way: only on an idle sequence with
        nothing in flight, only into blocks free now (no eviction), behind every other
        prefill; a turn that does not begin with these columns rolls them back."""
        if not self.cfg.prefill_ahead or seq.state is not SeqState.IDLE or seq.draining \
                or seq.turn is not None or seq.queued_turn is not None \
                or seq.offloaded is not None or seq.needs_rebuild or seq.jobs_in_flight:
            return  # (a job in flight: the next call extends the head)
        seq.last_used = time.perf_counter()
        ahead = seq.ahead
        start = seq.pos if ahead is None else ahead.start
        closes = not seq.closed_turn if ahead is None else ahead.closes_previous
        close = [self.prompts.assistant_close()] if closes else []
        cols = torch.cat([*close, self.prompts.user_head(text)], dim=1)
        if ahead is not None and not _begins_with(cols, ahead.cols):
            self._drop_ahead(seq)  # the text changed under it (a cancel, a new utterance)
            self.stats["ahead_misses"] += 1
            ahead = None
        done = 0 if ahead is None else ahead.cols.shape[1]
        if cols.shape[1] - done < AHEAD_MIN_COLS \
                or start + cols.shape[1] + TURN_MARGIN > self.max_len:
            return  # too little new, or a turn this long will rebuild the context anyway
        claimed = self._claim_blocks(seq, start + cols.shape[1], evict=False)
        if claimed is None:
            return
        copies = claimed[1]  # (no restore: an evicted sequence gets no head)
        if ahead is None:
            ahead = seq.ahead = Ahead(start, cols, closes)
            seq.closed_turn = True
        ahead.cols = cols
        ahead.in_flight += 1
        self.stats["ahead_jobs"] += 1
        self.stats["ahead_cols"] += cols.shape[1] - done
        ahead.job = self._queue_prefill(seq, cols[:, done:], start + done, None, copies=copies,
                                        ahead=True)

    def _drop_ahead(self, seq: Sequence) -> Ahead | None:
        """Forget the sequence's prefilled head: its cache ends where the head began again
        (the head's columns stay in the blocks until overwritten). Returns it."""
        ahead, seq.ahead = seq.ahead, None
        if ahead is not None:
            assert not ahead.in_flight, "a prefill-ahead job is still writing"
            seq.pos = ahead.start
            seq.closed_turn = not ahead.closes_previous
        return ahead

    def _rebuild_context(self, seq: Sequence, new: Tensor) -> Tensor | None:
        """Drop the oldest turns until system + recent turns + the new turn fit; re-prefill
        them after the voice prompt, which stays in the cache (keys at a position depend only
        on the positions before it)."""
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
        seq.pos = system.shape[1]
        return torch.cat([*keep, new], dim=1)

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
        # TURN_PREFILL / QUEUED: nothing was spoken; roll the cache back as if it never happened
        turn.cancelled = True
        self._unqueue(seq)
        self._rollback(seq, turn)
        seq.turn = None
        seq.state = SeqState.IDLE
        self._end_turn(seq, turn, FinishReason.CANCELLED)

    def _unqueue(self, seq: Sequence) -> None:
        for q in (self.row_queue, self.block_queue):
            if seq in q:
                q.remove(seq)

    def abort_decoding(self, seq: Sequence, turn: Turn) -> None:
        """Take a turn that already reported its end (an error) off the device batch."""
        if seq.decoding is turn and seq.state is SeqState.DECODING and not seq.draining:
            self._leave(seq)
            self._maybe_drained(seq)

    def _leave(self, seq: Sequence) -> None:
        """Take a decoding sequence off the batch: steps launched before now (up to k - 1)
        may still produce its rows; it drains until they have been read."""
        assert seq.row is not None
        self._row_ops.append(RowOp("leave", seq.row))
        if not seq.draining:
            seq.draining, seq.leave_step = True, self.k

    @staticmethod
    def _rollback(seq: Sequence, turn: Turn) -> None:
        seq.pos = seq.turn_start_pos
        seq.closed_turn = not turn.closes_previous
        seq.needs_rebuild = turn.rebuilt  # its rebuild may be half written

    def close(self, seq: Sequence) -> None:
        """The sequence ends: its turns stop without a report, its blocks go back (once no
        launched step can write to them), and so does its row."""
        if seq.state is SeqState.CLOSED:
            return
        for t in (seq.turn, seq.queued_turn):
            if t is not None and t.finished is None:
                self._end_turn(seq, t, FinishReason.CANCELLED, notify=False)
        seq.queued_turn = None
        self.live.pop(seq.seq_id, None)
        if seq in self.waiting:  # it never got blocks: it must not hold a place in the queue
            self.waiting.remove(seq)
        self._unqueue(seq)
        followers = self._followers.get(seq.prompt_key)
        if followers and seq in followers:
            followers.remove(seq)
        self._orphans(seq)
        on_device = seq.state is SeqState.DECODING or seq.draining
        seq.state = SeqState.CLOSED
        if on_device:  # blocks and row go back once no launched step can write to them
            self._leave(seq)
            self._maybe_drained(seq)
        else:
            self._release(seq)
        self._retry_waits()

    def _release(self, seq: Sequence) -> None:
        """A closed sequence's row and blocks go back (its blocks once no prefill job of it
        is in flight: the prefill stream may still be writing them)."""
        self._free_row(seq)
        if not seq.jobs_in_flight:
            self._release_blocks(seq)

    def _free_row(self, seq: Sequence) -> None:
        row = seq.row
        if row is None:
            return
        if self.running.get(row) is seq:
            del self.running[row]
        if row in self._free_rows or not 0 <= row < self.n_rows:
            raise RuntimeError(f"decode row {row} released twice or never taken")
        self._free_rows.append(row)
        self._row_ops.append(RowOp("free", row))
        seq.row = None
        while self.row_queue and self._free_rows:
            self._join(self.row_queue.popleft())

    def fail_sequence(self, seq: Sequence, message: str) -> None:
        """Tell the sink and close the sequence (its blocks go back), whatever state it is in."""
        if seq.state is SeqState.CLOSED:
            return
        try:
            seq.sink.on_error(seq, message)
            self.close(seq)
        except Exception:
            log.exception("closing failed sequence %d failed too", seq.seq_id)

    def row_failed(self, row: int, message: str) -> None:
        """A row op the decode worker could not apply: the sequence holding the row fails
        (its device state is unknown), no other."""
        for seq in list(self.live.values()):
            if seq.row == row:
                self.fail_sequence(seq, message)

    def fail_all_decoding(self, message: str) -> None:
        """A decode step failed: every turn on the device ends with an error, every sequence
        leaves the batch (its cache past the voice prompt is suspect: the next turn
        re-prefills its context)."""
        for row, seq in list(self.running.items()):
            self.running.pop(row, None)
            turn = seq.decoding
            if turn is not None and turn.finished is None:
                self._end_turn(seq, turn, FinishReason.ERROR, error=message)
            seq.decoding = seq.turn = None
            seq.draining = False
            seq.needs_rebuild = True
            self._row_ops.append(RowOp("leave", row))
            closed = seq.state is SeqState.CLOSED
            if not closed:
                seq.state = SeqState.IDLE
            self._free_row(seq)
            if closed:
                if not seq.jobs_in_flight:
                    self._release_blocks(seq)
            else:
                self._next_queued_turn(seq)  # one queued behind a cancel's drain starts now
        self._retry_waits()

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
        self.ahead_outstanding -= job.ahead and not job.urgent
        if self.prefill_outstanding < 0:  # every job is counted when created: a bug if seen
            log.warning("prefill bookkeeping: %d more jobs landed than were queued",
                        -self.prefill_outstanding)
            self.prefill_outstanding = 0
        job.seq.jobs_in_flight -= 1
        if job.sources:  # its copies ran (or it failed): the sources may be reused now
            self.pool.release(list(job.sources))
        if job.seq.state is SeqState.CLOSED and not job.seq.jobs_in_flight:
            self._release_blocks(job.seq)  # its last prefill landed: nothing writes them now
            self._retry_waits()
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
        if job.ahead:  # a turn's head: the turn (if it came meanwhile) starts from it
            assert seq.ahead is not None
            seq.ahead.in_flight -= 1
            seq.ahead.job = None
            seq.pos = job.start + job.cols.shape[1]
            self._next_queued_turn(seq)
            return
        if job.turn is None:  # the voice prompt
            seq.pos = job.cols.shape[1]
            seq.state = SeqState.IDLE
            seq.sink.on_ready(seq, time.perf_counter() - seq.created_at)
            self._prompt_in(seq)
            self._next_queued_turn(seq)
            return
        turn = job.turn
        if turn.cancelled or seq.turn is not turn:
            return  # cancelled while prefilling: already rolled back
        seq.pos = job.start + job.cols.shape[1]
        if self._free_rows:
            self._join(seq)
        else:  # every row speaks: served as rows free (continuations first, else FIFO)
            seq.state = SeqState.QUEUED
            _enqueue(self.row_queue, seq)
            self.stats["row_waits"] += 1
            self.stats["continuation_row_waits"] += turn.continues

    def _prompt_in(self, seq: Sequence) -> None:
        """A voice prompt landed: kept for later sessions with the same voice, and shared now
        with those that waited for it."""
        key = seq.prompt_key
        if not key:
            return
        self.prefixes.add(key, seq.blocks, seq.pos)
        if self._leaders.get(key) is seq:
            del self._leaders[key]
        for f in self._followers.pop(key, []):
            if f.state is SeqState.CLOSED:
                continue
            if self.prefixes.get(key) is not None:
                self._share_prefix(f)
            else:  # not kept (the cache is full of shared entries): prefill its own
                self.live.pop(f.seq_id, None)
                f.state = SeqState.WAITING
                self.waiting.appendleft(f)
        self._admit_waiting()

    def _join(self, seq: Sequence) -> None:
        """A prefilled turn takes a decode row and speaks from the next step on."""
        turn = seq.turn
        assert turn is not None and turn.cols is not None
        self._free_rows.sort()
        seq.row = self._free_rows.pop(0)  # lowest first keeps the batch's rows dense
        last = turn.cols[:, -1]
        turn.cols = None
        turn.ready_at = time.perf_counter()
        seq.state = SeqState.DECODING
        self._row_ops.append(RowOp("join", seq.row, params=seq.params, seed=self._turn_seed(seq),
                                   col=last, pos=seq.pos, max_frames=turn.max_frames,
                                   blocks=tuple(seq.blocks)))
        self.running[seq.row] = seq
        seq.decoding = turn
        with self._audio_lock:
            self._audio.append((seq, turn))

    @staticmethod
    def _turn_seed(seq: Sequence) -> int:
        seq.turns_started += 1
        return (seq.seed * 1_000_003 + seq.turns_started * 7919) % (2**31)

    def _next_queued_turn(self, seq: Sequence) -> None:
        if seq.queued_turn is not None and self._turn_may_start(seq):
            seq.turn, seq.queued_turn = seq.queued_turn, None
            self._queue_turn_prefill(seq)

    # ================================================================ decode
    def take_row_ops(self) -> list[RowOp]:
        """The device-side row changes decided since the last call, in order: the decode
        worker applies them before it launches the next step."""
        ops, self._row_ops = self._row_ops, []
        return ops

    def plan_step(self, now: float, *, may_pause: bool = False) -> StepPlan | None:
        """The next decode step, or None: nothing runs, or (`may_pause`, the pingpong decode
        thread) the batch pauses for prefills — counted, and timed, in stats. Speaking turns
        get the blocks this step writes into first (row ops: apply them before launching)."""
        if self.block_queue or self.waiting:
            self._retry_waits()
        plan = None
        if self.running:
            if may_pause and self._yield_to_prefill(now):
                if self._paused_at is None:  # a pause starts
                    self._paused_at = now
                    self.stats["decode_pauses"] += 1
            else:
                self._grow()
                plan = self._step_plan(now) if self.running else None
        if self._paused_at is not None and (plan is not None or not self.running):
            self.stats["decode_paused_s"] += time.perf_counter() - self._paused_at
            self._paused_at = None  # the pause ended: a step went, or nothing runs
        self._note_launch(plan)
        return plan

    def _grow(self) -> None:
        """Each speaking turn holds the block the next step writes into: the device may be
        `self.k - self.processed` steps past the frames read. A turn that cannot get one
        (every block held by speaking or prefilling sessions) ends there."""
        ahead = self.k - self.processed + 1
        for seq in list(self.running.values()):
            if seq.draining or seq.row is None:
                continue
            # never past the context: the turn's frame budget stops it before max_len
            want = min(self.pool.blocks_for(seq.pos + ahead), self.pool.blocks_for(self.max_len))
            n = want - len(seq.blocks)
            if n <= 0:
                continue
            if self._reserve(n):
                more = self.pool.alloc(n)
                assert more is not None
                self._row_ops.append(RowOp("extend", seq.row, pos=len(seq.blocks),
                                           blocks=tuple(more)))
                seq.blocks += more
                continue
            turn = seq.decoding
            log.warning("seq %d: no KV block free to go on speaking (every block is held by "
                        "speaking or prefilling sessions); its turn ends here — raise "
                        "kv_blocks or lower max_running", seq.seq_id)
            self.stats["turns_cut_no_blocks"] += 1
            self._leave(seq)
            if turn is not None and turn.finished is None:
                turn.finished = FinishReason.LENGTH  # its audio so far still plays out

    def _step_plan(self, now: float) -> StepPlan:
        top = max(self.running) + 1  # rows 0..top-1 hold every running row
        # the device may be one step ahead of what the host has read: +2 covers it
        need = max(s.pos for s in self.running.values()) + 2
        plan = StepPlan(self.k, top, need, now)
        self.k += 1
        self.stats["steps"] += 1
        return plan

    def decoding_paused(self) -> None:
        """Decoding stopped for a while (a deferred graph's capture): the gap is no step, so
        the next launch starts a new chain of step timings."""
        self._last_launch = None

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

    def chunk(self, seq: Sequence) -> int:
        """Frames in the later audio chunks of `seq`'s turns."""
        return seq.chunking.size or self.cfg.chunk_frames

    def first_chunk(self, seq: Sequence | None = None) -> int:
        """Frames in a turn's first audio chunk now: the session's choice, else twice
        first_chunk_frames while the streams generate slower than slow_start_x times
        realtime (never more than the session's later chunks)."""
        if seq is not None and seq.chunking.first is not None:
            return seq.chunking.first
        first = self._default_first()
        return first if seq is None else min(first, self.chunk(seq))

    def _default_first(self) -> int:
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
        # (a prefill-ahead job is speculative: no turn waits for it)
        if self.prefill_outstanding == self.ahead_outstanding or self.cfg.prefill_first_lead_s == 0:
            return False
        for seq in self.running.values():
            turn = seq.decoding
            # a draining (cancelled) turn needs no new step: reading the one in flight frees it
            if seq.draining or turn is None or turn.finished is not None:
                continue
            n = len(turn.frames)
            if n < self.first_chunk(seq):  # joined, first chunk not generated yet: waits a bounded time
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
        for r, seq in list(self.running.items()):
            if r >= B:
                continue
            row = rows[r]
            if not row[K1]:  # was not active in that step (or joined after it was launched)
                continue
            seq.pos += 1
            turn = seq.decoding
            if turn is None:
                continue
            frame = out[r, :K1]  # a view of this step's (host) result
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
        """EOS / LENGTH: the GPU already stopped the row (later steps see it inactive, so a
        turn joining it now is safe); audio drains through the codec."""
        turn.finished = reason  # read by the codec side after the last frame was appended
        self._record_history(seq, turn, reason)
        seq.turn = None
        seq.decoding = None
        seq.state = SeqState.IDLE
        seq.last_used = time.perf_counter()
        self._free_row(seq)
        self._next_queued_turn(seq)

    def _maybe_drained(self, seq: Sequence) -> None:
        """A sequence that left the batch is free once every step launched before it left
        has been read."""
        if not seq.draining or self.processed < seq.leave_step - 1:
            return
        turn = seq.decoding
        seq.draining = False
        seq.decoding = None
        seq.turn = None
        if seq.state is SeqState.CLOSED:
            self._release(seq)
            self._retry_waits()
            return
        self._free_row(seq)
        if turn is not None:
            self._record_history(seq, turn, FinishReason.CANCELLED)
        seq.state = SeqState.IDLE
        seq.last_used = time.perf_counter()
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
        due = first = False
        ripe: list[tuple[Sequence, Turn, int, bool]] = []  # (.., pending, due on its own)
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
            chunk = self.chunk(s)
            need = min(chunk, max(self.first_chunk(s), turn.decoded_frames))
            if pending == 0 or (pending < need and not finished):
                continue
            needs = finished or self._codec_due(turn, pending, chunk, now)
            due |= needs
            first |= turn.decoded_frames == 0
            ripe.append((s, turn, pending, needs))
        if due:  # else every ripe stream is far enough ahead: wait for a fuller tick
            for s, turn, pending, needs in ripe:
                # a stream far ahead rides along in a tick others need, but not in one that
                # carries a first chunk: its frames would make that tick longer (a tick's
                # streams are padded to its longest chunk), and TTFA waits for the tick
                if first and not needs:
                    continue
                codes = torch.stack(turn.frames[turn.decoded_frames: turn.decoded_frames + pending],
                                    dim=1)[1:]  # [K, n]
                plan.work.append((s, turn, codes))
        return plan

    def _codec_due(self, turn: Turn, pending: int, chunk: int, now: float) -> bool:
        """Whether a stream with a chunk's worth of frames needs a tick now. One that is
        more than `codec_hold_s` of audio ahead of realtime playback can wait: it rides
        along in the next tick another stream needs (not one carrying a first chunk:
        `plan_codec`), or goes once it has two chunks
        pending — fewer, fuller ticks (each costs ~3 ms however few streams it carries).
        First chunks never wait (TTFA)."""
        if self.cfg.codec_hold_s == 0 or turn.decoded_frames < chunk \
                or pending >= 2 * chunk or turn.first_audio_at is None:
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



def _enqueue(queue: deque[Sequence], seq: Sequence) -> None:
    """A turn into a wait queue: one that continues an utterance the client is playing
    (`Turn.continues`) after the queue's other continuations but before every turn that starts
    one — a new turn only waits longer for its first audio, a continuation would leave a gap in
    audio already playing. FIFO otherwise."""
    if seq.turn is None or not seq.turn.continues:
        queue.append(seq)
        return
    # continuations only ever go in ahead of the rest: they form the queue's head
    at = next((i for i, o in enumerate(queue) if o.turn is None or not o.turn.continues),
              len(queue))
    queue.insert(at, seq)


def _begins_with(cols: Tensor, head: Tensor) -> bool:
    """Whether prompt columns `cols` [1+K, n] start with `head` [1+K, m]."""
    m = head.shape[1]
    return cols.shape[1] >= m and bool(torch.equal(cols[:, :m], head))
