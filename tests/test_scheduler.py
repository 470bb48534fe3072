"""The scheduler alone: no threads, no torch device, no model. A few lines of Python stand in
for the runner (`FakeDevice`: the row ops, block tables and the step's stop rules, frames
made up), so the tests drive admission, KV blocks (sharing, eviction, growth), decode rows,
joins, cancels, drains, context overflow, closes and the chunk policy step by step —
including the pingpong order (step N launched before step N-1 is read)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine.config import TINY_IDS, EngineConfig
from engine.engine import CollectingSink
from engine.errors import TurnError
from engine.kv_pool import prompt_key
from engine.prompt import PromptBuilder
from engine.request import Chunking, FinishReason, RowOp, SeqState, Sequence, Turn
from engine.sampler import SamplingParams
from engine.scheduler import TURN_MARGIN, Scheduler, StepPlan
from engine.tokenizer import ByteTokenizer

K = 10  # codebooks
K1 = K + 1
SR, HOP = 44100, 2048


class FakeDevice:
    """The runner's device state and step, in plain Python: what a launched step would
    write into its output row, computed at launch (the GPU runs steps in order). It checks
    that every active row's table holds the block its step writes into."""

    def __init__(self, n_rows: int, block_size: int,
                 eos_after: dict[int, int] | None = None) -> None:
        self.active = [False] * (n_rows + 1)
        self.pos = [0] * (n_rows + 1)
        self.left = [0] * (n_rows + 1)
        self.made = [0] * (n_rows + 1)  # frames made in the row's current turn
        self.tables: list[list[int]] = [[] for _ in range(n_rows + 1)]
        self.block_size = block_size
        self.eos_after = eos_after or {}  # row -> frames before it emits <|im_end|>
        self.ops: list[RowOp] = []

    def apply(self, ops: list[RowOp]) -> None:
        for op in ops:
            self.ops.append(op)
            if op.kind == "join":
                self.active[op.row], self.pos[op.row] = True, op.pos
                self.left[op.row], self.made[op.row] = op.max_frames, 0
                self.tables[op.row] = list(op.blocks)
            elif op.kind == "extend":
                assert len(self.tables[op.row]) == op.pos
                self.tables[op.row] += op.blocks
            elif op.kind == "leave":
                self.active[op.row] = False

    def step(self, plan: StepPlan) -> torch.Tensor:
        out = torch.zeros(plan.B, K1 + 2, dtype=torch.long)
        for b in range(plan.B):
            if not self.active[b]:
                continue
            assert self.pos[b] // self.block_size < len(self.tables[b]), \
                f"row {b} writes position {self.pos[b]} past its blocks {self.tables[b]}"
            eos = self.eos_after.get(b) == self.made[b]
            code = (7 * b + self.made[b]) % 4096
            out[b, 0] = TINY_IDS.im_end if eos else TINY_IDS.semantic_start + code
            out[b, 1:K1] = torch.tensor([code if not eos else 0] + [code % 1024] * (K - 1))
            self.made[b] += 1
            self.pos[b] += 1
            self.left[b] -= 1
            stop = eos or self.left[b] <= 0
            out[b, K1], out[b, K1 + 1] = 1, int(stop)
            self.active[b] = not stop
        return out


class FakeHost:
    """Stands in for the runner's save: what was evicted, and when."""

    def __init__(self) -> None:
        self.saved: list[list[int]] = []

    def __call__(self, blocks: list[int]) -> object:
        self.saved.append(list(blocks))
        return ("saved", tuple(blocks))


def make(n_rows: int = 2, evict: FakeHost | None = None,
         **cfg: object) -> tuple[Scheduler, FakeDevice]:
    """A scheduler over a fake device; no shared voice prefixes unless `prefix_cache` is
    given (most tests open several sessions with the same voice)."""
    cfg = {"max_len": 512, "max_running": n_rows, "prefix_cache": 0, **cfg}
    config = EngineConfig(**cfg).resolved(cuda=False, model_len=4096)  # type: ignore[arg-type]
    prompts = PromptBuilder(ByteTokenizer(special_base=TINY_IDS.semantic_start - 35), K)
    bs = config.kv_block_size
    n_blocks = config.kv_blocks or n_rows * 2 * -(-config.max_len // bs)
    sched = Scheduler(config, prompts, n_rows=n_rows, n_blocks=n_blocks, block_size=bs,
                      sample_rate=SR, frame_samples=HOP, ids=TINY_IDS, evict=evict,
                      block_bytes=1)
    return sched, FakeDevice(n_rows, bs)


def new_seq(sched: Scheduler, sink: CollectingSink | None = None, seed: int = 0) -> Sequence:
    system = sched.prompts.system(())
    return Sequence(seed + 1, (), SamplingParams(seed=seed), seed, sink or CollectingSink(),
                    system_cols=system, prompt_key=prompt_key(system))


def prefill_all(sched: Scheduler) -> int:
    """Every prefill job lands at once (the prefill worker's part, done)."""
    jobs = sched.take_prefill_jobs()
    for job in jobs:
        job.done = job.cols.shape[1]
        sched.prefill_done(job)
    return len(jobs)


def sync_step(sched: Scheduler, dev: FakeDevice) -> bool:
    """One decode step launched and read at once (the sync loop)."""
    plan = sched.plan_step(time.perf_counter())
    dev.apply(sched.take_row_ops())
    if plan is None:
        return False
    sched.step_done(plan.k, plan.B, dev.step(plan))
    return True


def codec_all(sched: Scheduler, now: float | None = None) -> list[int]:
    """One codec tick with silent audio; returns the frames decoded per stream."""
    plan = sched.plan_codec(time.perf_counter() if now is None else now)
    pcm = [np.zeros(codes.shape[1] * HOP, np.float32) for _, _, codes in plan.work]
    sched.codec_done(plan, pcm)
    return [codes.shape[1] for _, _, codes in plan.work]


def run_idle(sched: Scheduler, dev: FakeDevice, limit: int = 2000) -> None:
    for _ in range(limit):
        did = prefill_all(sched) > 0
        did |= sync_step(sched, dev)
        did |= bool(codec_all(sched))
        if not did and not sched.plan_codec(time.perf_counter()).busy:
            return
    raise AssertionError("the scheduler did not go idle")


def ready(sched: Scheduler, sink: CollectingSink | None = None, seed: int = 0) -> Sequence:
    seq = new_seq(sched, sink, seed)
    sched.admit(seq)
    prefill_all(sched)
    assert seq.state is SeqState.IDLE
    return seq


def test_admission_gives_blocks_and_queues_when_the_pool_is_full():
    sched, _ = make(n_rows=2, max_waiting=1, kv_block_size=16, kv_blocks=7)
    sinks = [CollectingSink() for _ in range(3)]
    seqs = [new_seq(sched, s, i) for i, s in enumerate(sinks)]
    for seq in seqs:
        assert sched.has_room()
        sched.admit(seq)
    # the 45-column voice prompt takes 3 blocks of 16: a third does not fit in 7
    assert [s.blocks for s in seqs] == [[0, 1, 2], [3, 4, 5], []]
    assert list(sched.waiting) == [seqs[2]] and not sched.has_room()
    assert not sched.take_row_ops()  # no decode row for a voice prompt
    jobs = sched.take_prefill_jobs()
    assert [(j.blocks, j.start, j.turn) for j in jobs] == [((0, 1, 2), 0, None),
                                                          ((3, 4, 5), 0, None)]
    assert sched.prefill_outstanding == 2
    for job in jobs:
        sched.prefill_done(job)
    assert sched.prefill_outstanding == 0
    assert sinks[0].ready.is_set() and sinks[1].ready.is_set() and not sinks[2].ready.is_set()
    assert seqs[0].pos == seqs[0].system_cols.shape[1]
    sched.close(seqs[1])  # idle: its blocks go back at once, to the waiting sequence
    assert sorted(seqs[2].blocks) == [3, 4, 5] and not sched.waiting


def test_a_waiting_sequence_that_closes_gives_its_place_back():
    sched, _ = make(n_rows=1, max_waiting=1, kv_block_size=16, kv_blocks=4)
    a, b = ready(sched), new_seq(sched, seed=1)
    sched.admit(b)
    assert not sched.has_room()
    sched.close(b)
    assert sched.has_room() and not sched.waiting and b.state is SeqState.CLOSED
    sched.close(a)
    assert sched.pool.free == 4


def test_a_turn_streams_in_growing_chunks_then_ends():
    sched, dev = make(slow_start_x=0.0)
    sink = CollectingSink()
    seq = ready(sched, sink)
    pos0 = seq.pos
    sched.start_turn(seq, Turn("t1", "Hello world.", 12))
    job = sched.take_prefill_jobs()[0]
    assert job.turn is not None and job.start == pos0 and seq.state is SeqState.TURN_PREFILL
    job.done = job.cols.shape[1]
    sched.prefill_done(job)
    ops = sched.take_row_ops()
    assert [o.kind for o in ops] == ["join"]  # parameters, table and first column at once
    join = ops[0]
    assert join.row == seq.row == 0 and join.max_frames == 12 and join.pos == seq.pos
    assert join.params is seq.params and join.blocks == tuple(seq.blocks)
    assert sched.running == {seq.row: seq} and seq.state is SeqState.DECODING
    dev.apply(ops)
    sizes = []
    for _ in range(20):
        sync_step(sched, dev)
        sizes += codec_all(sched)
    assert sizes == [1, 1, 2, 4, 4]  # 12 frames: 1, 1, 2, 4, then the remaining 4
    res = sink.results[-1]
    assert (res.turn_id, res.reason, res.frames) == ("t1", FinishReason.LENGTH, 12)
    assert res.codes.shape == (K, 12) and res.audio_s == pytest.approx(12 * HOP / SR)
    assert seq.state is SeqState.IDLE and not sched.running and seq.row is None
    assert len(seq.history) == 1 and seq.history[0][1].shape == (K, 11)  # all but the last fed
    assert [o for o in sink.offsets] == pytest.approx(np.cumsum([0, 1, 1, 2, 4])[:5] * HOP / SR)


def test_eos_ends_a_turn_and_its_frame_is_not_audio():
    sched, dev = make()
    dev.eos_after = {0: 3}
    sink = CollectingSink()
    seq = ready(sched, sink)
    sched.start_turn(seq, Turn("t", "Hi.", 50))
    run_idle(sched, dev)
    res = sink.results[-1]
    assert res.reason is FinishReason.EOS and res.frames == 3 and len(sink.pcm()) == 3 * HOP
    assert seq.history[0][1].shape == (K, 3)  # after an EOS every audible frame was fed


def test_cancel_while_decoding_drains_the_steps_in_flight():
    """Pingpong order: step k+1 is launched before step k is read. A cancel takes the row
    off the batch (a leave op); rows the launched steps still produce are wasted; the turn
    ends at once, with no audio after it; a queued turn starts once the row has drained."""
    sched, dev = make()
    sink = CollectingSink()
    seq = ready(sched, sink)
    sched.start_turn(seq, Turn("a", "A long turn.", 400))
    prefill_all(sched)
    dev.apply(sched.take_row_ops())
    pending = None
    for _ in range(6):  # steps run ahead of what the host reads by one
        plan = sched.plan_step(time.perf_counter())
        out = dev.step(plan)
        if pending is not None:
            sched.step_done(*pending)
        pending = (plan.k, plan.B, out)
        codec_all(sched)
    n_audio = len(sink.audio)
    sched.cancel(seq)
    assert seq.draining and sink.results[-1].reason is FinishReason.CANCELLED
    sched.start_turn(seq, Turn("b", "Next.", 5))  # queued behind the drain
    assert seq.queued_turn is not None and not sched.take_prefill_jobs()
    dev.apply(sched.take_row_ops())  # the leave lands before the next step
    plan = sched.plan_step(time.perf_counter())  # the draining row is still in the batch
    out = dev.step(plan)
    wasted = sched.stats["wasted_rows"]
    # the step launched before the cancel is the last that can produce the row: once it is
    # read (wasted) the row has drained, and the queued turn starts
    sched.step_done(*pending)
    assert sched.stats["wasted_rows"] == wasted + 1
    assert not seq.draining and seq.state is SeqState.TURN_PREFILL
    assert sched.take_prefill_jobs()[0].turn.turn_id == "b"
    frames = sched.stats["frames"]
    sched.step_done(plan.k, plan.B, out)  # after the leave: the row was inactive
    assert sched.stats["frames"] == frames and sched.stats["wasted_rows"] == wasted + 1
    codec_all(sched)
    assert len(sink.audio) == n_audio  # nothing of the cancelled turn after the cancel
    assert [t for t, _ in seq.history] == ["A long turn."]


def test_cancel_during_turn_prefill_rolls_back():
    sched, dev = make()
    sink = CollectingSink()
    seq = ready(sched, sink)
    pos0 = seq.pos
    sched.start_turn(seq, Turn("x", "Never spoken.", 50))
    job = sched.take_prefill_jobs()[0]
    sched.cancel(seq)
    assert job.abandoned and seq.pos == pos0 and seq.state is SeqState.IDLE
    assert sink.results[-1].reason is FinishReason.CANCELLED and sink.results[-1].frames == 0
    sched.prefill_done(job)  # lands anyway: nothing joins
    assert not sched.running and not [o for o in sched.take_row_ops() if o.kind == "join"]
    sched.start_turn(seq, Turn("y", "Spoken.", 3))
    run_idle(sched, dev)
    assert sink.results[-1].turn_id == "y" and sink.results[-1].frames == 3
    assert seq.history[0][0] == "Spoken."


def test_one_turn_at_a_time_and_none_on_a_closed_sequence():
    sched, _ = make()
    sink = CollectingSink()
    seq = ready(sched, sink)
    sched.start_turn(seq, Turn("a", "One.", 10))
    sched.start_turn(seq, Turn("b", "Two.", 10))
    err = sink.results[-1]
    assert err.turn_id == "b" and err.error_code is TurnError.INVALID_STATE
    assert "already running" in err.error
    sched.close(seq)
    sched.start_turn(seq, Turn("c", "Three.", 10))
    assert sink.results[-1].error_code is TurnError.INVALID_STATE


def test_a_full_context_drops_the_oldest_turns_and_re_prefills():
    sched, dev = make(n_rows=1, max_len=200)
    sink = CollectingSink()
    seq = ready(sched, sink)
    starts = []
    for i in range(6):
        sched.start_turn(seq, Turn(str(i), f"Turn number {i}.", 30))
        jobs = sched.take_prefill_jobs()
        starts.append(jobs[0].start)
        for job in jobs:
            job.done = job.cols.shape[1]
            sched.prefill_done(job)
        run_idle(sched, dev)
        assert sink.results[-1].error is None and seq.pos <= 200
    # a rebuild re-prefills the turns kept after the voice prompt, which stays in the cache
    assert seq.system_cols.shape[1] in starts[1:]
    assert len(seq.history) < 6


def test_text_too_long_for_the_context_is_the_clients_fault():
    sched, _ = make(n_rows=1, max_len=160)
    sink = CollectingSink()
    seq = ready(sched, sink)
    sched.start_turn(seq, Turn("long", "x" * 500, 5))
    res = sink.results[-1]
    assert res.reason is FinishReason.ERROR and res.error_code is TurnError.TOO_LARGE
    assert seq.state is SeqState.IDLE and seq.turn is None


def test_turn_room_counts_the_wrapper_and_the_margin():
    sched, _ = make(max_len=512)
    system = sched.prompts.system(()).shape[1]
    wrapper = sched.prompts.user_turn("").shape[1]
    assert sched.turn_room(system) == 512 - system - wrapper - TURN_MARGIN
    assert sched.turn_room(512) < 0


def test_close_while_decoding_frees_row_and_blocks_after_the_drain():
    sched, dev = make(n_rows=1)
    a_sink, b_sink = CollectingSink(), CollectingSink()
    a, b = ready(sched, a_sink), ready(sched, b_sink, 1)
    sched.start_turn(a, Turn("a", "A long turn.", 400))
    prefill_all(sched)
    sync_step(sched, dev)
    sched.start_turn(b, Turn("b", "Waits for the row.", 5))
    prefill_all(sched)
    assert b.state is SeqState.QUEUED and list(sched.row_queue) == [b]
    plan = sched.plan_step(time.perf_counter())
    dev.apply(sched.take_row_ops())
    out = dev.step(plan)  # in flight when a closes
    free = sched.pool.free
    sched.close(a)
    assert a.state is SeqState.CLOSED and a.row == 0 and b.row is None  # still in flight
    assert sched.pool.free == free  # a's blocks too: the step in flight writes one
    sched.step_done(plan.k, plan.B, out)
    assert a.row is None and b.row == 0 and b.state is SeqState.DECODING  # handed to b
    assert sched.pool.free > free and not a.blocks
    assert [r.turn_id for r in a_sink.results] == []  # a close reports nothing
    run_idle(sched, dev)
    assert b_sink.results[-1].turn_id == "b" and b_sink.results[-1].frames == 5


def test_a_failed_step_ends_every_decoding_turn_and_resets_their_context():
    sched, dev = make()
    sinks = [CollectingSink(), CollectingSink()]
    seqs = [ready(sched, s, i) for i, s in enumerate(sinks)]
    for i, seq in enumerate(seqs):
        sched.start_turn(seq, Turn("t", f"Turn {i}.", 100))
    prefill_all(sched)
    sync_step(sched, dev)
    sched.fail_all_decoding("decode step failed")
    for seq, sink in zip(seqs, sinks):
        res = sink.results[-1]
        assert res.reason is FinishReason.ERROR and res.error_code is TurnError.INTERNAL
        assert seq.needs_rebuild and seq.state is SeqState.IDLE and not sched.running
    assert {op.kind for op in sched.take_row_ops()} == {"leave", "free"}
    assert sched.free_rows == 2


def test_a_failed_prefill_fails_only_its_sequence():
    sched, _ = make(n_rows=3)
    sinks = [CollectingSink() for _ in range(3)]
    seqs = [new_seq(sched, s, i) for i, s in enumerate(sinks)]
    for seq in seqs:
        sched.admit(seq)
    jobs = sched.take_prefill_jobs()
    jobs[1].event = RuntimeError("boom in block 1")
    for job in jobs:
        sched.prefill_done(job)
    assert sinks[0].ready.is_set() and sinks[2].ready.is_set()
    assert "boom" in sinks[1].errors[0] and seqs[1].state is SeqState.CLOSED
    assert len(sched.live) == 2 and not seqs[1].blocks


def _audio_turn(sched: Scheduler, frames: int, decoded: int, ahead_s: float,
                sink: CollectingSink | None = None) -> Turn:
    g = torch.Generator().manual_seed(frames)
    seq = Sequence(100 + frames, (), SamplingParams(), 0, sink or CollectingSink())
    turn = Turn("t", "x", 64)
    turn.frames = [torch.randint(0, 16, (K1,), generator=g) for _ in range(frames)]
    turn.decoded_frames = decoded
    if decoded:
        turn.first_audio_at = time.perf_counter()
        turn.samples_out = int(ahead_s * SR)
    sched._audio.append((seq, turn))
    return turn


def test_codec_holds_streams_far_ahead_for_a_fuller_tick():
    """A stream more than codec_hold_s ahead of realtime waits (up to two chunks) and rides
    along in the next tick another stream needs, except one carrying a first chunk (which
    would get longer: TTFA); first chunks never wait; 0 turns holding off."""
    sched, _ = make(codec_hold_s=1.0)
    a_sink = CollectingSink()
    a = _audio_turn(sched, 16, 8, ahead_s=3.0, sink=a_sink)  # one chunk pending, 3 s ahead
    assert codec_all(sched) == [] and a.decoded_frames == 8  # held
    b = _audio_turn(sched, 2, 0, ahead_s=0.0)  # a new turn's first chunk is due at once...
    assert codec_all(sched) == [2]
    assert b.decoded_frames == 2 and a.decoded_frames == 8  # ...alone: a keeps waiting
    g0 = torch.Generator().manual_seed(2)
    b.frames += [torch.randint(0, 16, (K1,), generator=g0) for _ in range(2)]
    b.samples_out = 0  # b's next chunk is due (no audio ahead)...
    assert sorted(codec_all(sched)) == [2, 8]
    assert b.decoded_frames == 4 and a.decoded_frames == 16  # ...and a rides along
    assert len(a_sink.audio) == 1 and len(a_sink.audio[0]) == 8 * HOP
    g = torch.Generator().manual_seed(1)
    a.frames += [torch.randint(0, 16, (K1,), generator=g) for _ in range(15)]
    assert codec_all(sched) == []  # 15 pending, still far ahead
    a.frames.append(torch.randint(0, 16, (K1,), generator=g))
    assert codec_all(sched) == [16] and a.decoded_frames == 32  # two chunks: goes alone
    a.frames += [torch.randint(0, 16, (K1,), generator=g) for _ in range(8)]
    a.samples_out = int(0.5 * SR) + int((time.perf_counter() - a.first_audio_at) * SR)
    assert codec_all(sched) == [8] and a.decoded_frames == 40  # only 0.5 s ahead: due
    sched.cfg.codec_hold_s = 0.0
    a.samples_out += 10 * SR
    a.frames += [torch.randint(0, 16, (K1,), generator=g) for _ in range(8)]
    assert codec_all(sched) == [8] and a.decoded_frames == 48  # holding off


def test_decode_pauses_for_prefills_while_every_turn_is_ahead():
    """Prefill first: with prompts prefilling, the decode step waits unless a running turn
    needs it (audio less than prefill_first_lead_s ahead, a joined turn without its first
    chunk for prefill_first_wait_s); a draining (cancelled) turn needs none; no prefill: it
    never waits; prefill_first_lead_s=0 turns it off."""
    sched, _ = make(n_rows=4, prefill_first_lead_s=0.5, prefill_first_wait_s=0.05)
    fr = sched.frame_rate
    now = time.perf_counter()

    def running(slot: int, frames: int, *, ready_ago: float, audio_ago: float | None) -> Turn:
        seq = Sequence(slot, (), SamplingParams(), 0, CollectingSink())
        turn = Turn("t", "x", 64)
        turn.frames = [torch.zeros(K1, dtype=torch.long)] * frames
        turn.ready_at = now - ready_ago
        turn.first_audio_at = None if audio_ago is None else now - audio_ago
        seq.decoding = turn
        sched.running[slot] = seq
        return turn

    ahead = running(0, int(2 * fr), ready_ago=1.1, audio_ago=1.0)  # 1 s ahead
    assert not sched._yield_to_prefill(now)  # nothing prefilling: never wait
    sched.prefill_outstanding = 1
    assert sched._yield_to_prefill(now)
    new = running(1, 0, ready_ago=0.01, audio_ago=None)  # just joined: may wait 50 ms
    assert sched._yield_to_prefill(now)
    assert not sched._yield_to_prefill(now + 0.05)  # ...but not longer
    new.frames = [ahead.frames[0]] * sched.cfg.first_chunk_frames  # first chunk at the codec
    assert sched._yield_to_prefill(now + 0.05)
    new.first_audio_at = now  # its audio is out: one chunk (46 ms) ahead < 0.5 s
    assert not sched._yield_to_prefill(now)
    sched.running[1].draining = True  # cancelled: leaves when the step in flight is read
    assert sched._yield_to_prefill(now)
    sched.running[1].draining = False
    new.finished = FinishReason.LENGTH  # a finished turn needs nothing
    assert sched._yield_to_prefill(now)
    assert not sched._yield_to_prefill(now + 0.6)  # the 1 s lead is down to 0.4 s
    # the pause is counted and timed when the decode thread asks for a step
    assert sched.plan_step(now, may_pause=True) is None and sched.stats["decode_pauses"] == 1
    assert sched.plan_step(now, may_pause=False) is not None
    assert sched.stats["decode_paused_s"] > 0
    sched.running.pop(1)
    sched.cfg.prefill_first_lead_s = 0.0
    assert not sched._yield_to_prefill(now)


def test_a_session_chooses_its_own_chunks():
    """A session's chunking replaces the engine's for its turns only: its first chunk as
    chosen (no slow-start doubling), then growth up to its chunk size; a session that
    chose a chunk size only takes the engine's first chunk, cut to that size; the others
    keep the engine's settings."""
    sched, _ = make(first_chunk_frames=2, chunk_frames=8, slow_start_x=0.0, codec_hold_s=0)

    def stream(chunking: Chunking) -> list[int]:
        turn = _audio_turn(sched, 0, 0, 0.0)
        seq = sched._audio[-1][0]
        seq.chunking = chunking
        sizes = []
        for i in range(40):  # one frame per step, a codec tick after each
            turn.frames.append(torch.full((K1,), i % 16, dtype=torch.long))
            sizes += codec_all(sched)
        sched._drop_audio(turn)
        return sizes

    assert stream(Chunking()) == [2, 2, 4, 8, 8, 8, 8]
    assert stream(Chunking(first=1, size=3)) == [1, 1, 2, 3] + [3] * 11
    assert stream(Chunking(size=1)) == [1] * 40
    assert stream(Chunking(first=5)) == [5, 5, 8, 8, 8]
    sched.step_s = 1.0  # very slow streams: slow start doubles the engine's first chunk...
    sched.cfg.slow_start_x = 2.0
    assert stream(Chunking())[:2] == [4, 4]
    assert stream(Chunking(first=1, size=4))[:3] == [1, 1, 2]  # ...never a chosen one
    assert stream(Chunking(size=3))[:2] == [3, 3]  # cut to the session's chunk size


def test_slow_start_doubles_the_first_chunk_while_streams_are_slow():
    """The first chunk is first_chunk_frames while the measured decode rate gives every
    stream at least slow_start_x times realtime, twice that below it (and before any rate is
    known: first_chunk_frames); the rate comes from back-to-back launches."""
    sched, _ = make(first_chunk_frames=1, slow_start_x=2.0, codec_hold_s=0)
    fr = sched.frame_rate
    assert sched.first_chunk() == 1  # no rate measured yet
    sched.step_s = 1 / (2.5 * fr)  # 2.5x realtime per stream
    assert sched.first_chunk() == 1
    sched.step_s = 1 / (1.7 * fr)  # 1.7x: a thicker start
    assert sched.first_chunk() == 2
    turn = _audio_turn(sched, 1, 0, 0.0)
    assert codec_all(sched) == [] and turn.decoded_frames == 0  # one frame: not yet
    turn.frames.append(torch.zeros(K1, dtype=torch.long))
    assert codec_all(sched) == [2]
    sched.cfg.slow_start_x = 0.0  # off: one frame whatever the rate
    assert sched.first_chunk() == 1
    sched.step_s, sched._last_launch = None, None
    t = time.perf_counter()
    for k in range(3):
        sched._note_launch(StepPlan(k, 1, 1, t + 0.02 * k))
    assert sched.step_s == pytest.approx(0.02)
    sched._note_launch(None)
    sched._note_launch(StepPlan(3, 1, 1, t + 5.0))  # after an idle gap: not a step
    assert sched.step_s == pytest.approx(0.02)


def test_a_failed_codec_tick_ends_its_turns_with_an_internal_error():
    sched, dev = make()
    sink = CollectingSink()
    seq = ready(sched, sink)
    sched.start_turn(seq, Turn("t", "Text.", 100))
    prefill_all(sched)
    for _ in range(3):
        sync_step(sched, dev)
    plan = sched.plan_codec(time.perf_counter())
    assert plan.work
    failed = sched.codec_failed(plan, RuntimeError("codec exploded"))
    assert [t.turn_id for _, t in failed] == ["t"]
    res = sink.results[-1]
    assert res.error_code is TurnError.INTERNAL and "codec exploded" in res.error
    for s, t in failed:
        sched.abort_decoding(s, t)  # sync: every launched step was read, it leaves at once
    assert not seq.draining and RowOp("leave", 0) in sched.take_row_ops()
    run_idle(sched, dev)
    assert not sched.running and seq.state is SeqState.IDLE and sched.audio_streams == 0


# ---------------------------------------------------------------------- sessions >> rows
def test_idle_sessions_hold_no_row_and_a_waiting_turn_gets_the_first_free_one():
    """max_running=2: sessions that started and went idle never keep another from its voice
    prompt or its speech; a third turn waits for a row (not for a session to close) and
    speaks as soon as one frees."""
    sched, dev = make(n_rows=2)
    sinks = [CollectingSink() for _ in range(5)]
    seqs = [ready(sched, s, i) for i, s in enumerate(sinks)]  # 5 ready on 2 rows
    for seq in seqs[:2]:
        sched.start_turn(seq, Turn("first", "Hello.", 3))
    run_idle(sched, dev)
    assert all(s.state is SeqState.IDLE and s.row is None for s in seqs[:2])
    assert sched.free_rows == 2  # two idle, started sessions: no row held
    for seq in seqs[2:]:
        sched.start_turn(seq, Turn("second", "Speak now.", 4))
    prefill_all(sched)
    assert [s.state for s in seqs[2:]] == [SeqState.DECODING, SeqState.DECODING,
                                           SeqState.QUEUED]
    assert list(sched.row_queue) == [seqs[4]] and sched.stats["row_waits"] == 1
    for _ in range(4):  # the first two turns end after 4 frames: a row frees, seqs[4] joins
        sync_step(sched, dev)
    assert seqs[4].state is SeqState.DECODING and seqs[4].row == 0
    run_idle(sched, dev)
    assert [s.results[-1].frames for s in sinks] == [3, 3, 4, 4, 4]
    assert all(s.results[-1].reason is FinishReason.LENGTH for s in sinks)


def test_a_continuing_sentence_takes_the_next_free_row_before_new_turns():
    """A later sentence of an utterance whose audio already plays (`Turn.continues`) waits
    for a row ahead of turns that start an utterance (they only wait longer for their first
    audio; it would leave a gap in audio already playing), behind earlier continuations, and
    its prefill job comes first in its round."""
    sched, dev = make(n_rows=1)
    a, b, c, d, e = (ready(sched, CollectingSink(), i) for i in range(5))
    sched.start_turn(a, Turn("a", "Holds the row.", 3))
    sched.start_turn(b, Turn("b", "A new turn.", 2))
    sched.start_turn(c, Turn("c", "Another new turn.", 2))
    prefill_all(sched)
    assert list(sched.row_queue) == [b, c]
    sched.start_turn(d, Turn("d", "How can I help?", 2, continues=True))
    sched.start_turn(e, Turn("e", "And then?", 2, continues=True))
    jobs = sched.take_prefill_jobs()
    assert [j.rank for j in jobs] == [0, 0]
    for job in jobs:
        job.done = job.cols.shape[1]
        sched.prefill_done(job)
    assert list(sched.row_queue) == [d, e, b, c]  # continuations first, FIFO within each
    order = []
    for _ in range(40):
        sync_step(sched, dev)
        seq = sched.running.get(0)
        if seq is not None and (not order or order[-1] is not seq):
            order.append(seq)
    assert order == [a, d, e, b, c]
    run_idle(sched, dev)
    assert [s.sink.results[-1].frames for s in (a, b, c, d, e)] == [3, 2, 2, 2, 2]


def test_prefill_rounds_put_continuations_first_and_speculative_heads_last():
    from engine.request import PrefillJob

    seq = new_seq(make()[0])
    cols = torch.zeros(K + 1, 4, dtype=torch.long)
    new = PrefillJob(seq, cols, 0, Turn("n", "New.", 2), ())
    cont = PrefillJob(seq, cols, 0, Turn("c", "Next.", 2, continues=True), ())
    voice = PrefillJob(seq, cols, 0, None, ())
    head = PrefillJob(seq, cols, 0, None, (), ahead=True)
    waited = PrefillJob(seq, cols, 0, None, (), ahead=True, urgent=True)
    jobs = [head, new, voice, cont, waited]
    assert sorted(jobs, key=lambda j: j.rank) == [cont, new, voice, waited, head]


def test_a_queued_turn_can_be_cancelled_and_closed():
    sched, dev = make(n_rows=1)
    a, b = ready(sched), ready(sched, CollectingSink(), 1)
    sched.start_turn(a, Turn("a", "Holds the row.", 50))
    sched.start_turn(b, Turn("b", "Waits.", 5))
    prefill_all(sched)
    pos = b.turn_start_pos
    sched.cancel(b)
    assert b.state is SeqState.IDLE and not sched.row_queue and b.pos == pos
    assert b.sink.results[-1].reason is FinishReason.CANCELLED
    sched.start_turn(b, Turn("b2", "Waits again.", 5))
    prefill_all(sched)
    sched.close(b)
    assert not sched.row_queue
    run_idle(sched, dev)
    assert a.sink.results[-1].frames == 50


def test_a_speaking_turn_grows_its_blocks_as_it_goes():
    sched, dev = make(n_rows=1, kv_block_size=16)
    seq = ready(sched)
    sched.start_turn(seq, Turn("long", "Talk for a while.", 200))
    jobs = sched.take_prefill_jobs()
    reserved = len(seq.blocks)
    for job in jobs:
        job.done = job.cols.shape[1]
        sched.prefill_done(job)
    run_idle(sched, dev)  # FakeDevice asserts every step's write lands in a held block
    assert seq.sink.results[-1].frames == 200
    assert len(seq.blocks) > reserved
    assert any(op.kind == "extend" for op in dev.ops)


def test_a_turn_that_cannot_grow_ends_with_the_audio_it_made():
    # the turn's start (45 + 24 + 64 frames + slack) takes 9 blocks of 16: 1 more to grow
    sched, dev = make(n_rows=1, kv_block_size=16, kv_blocks=10, kv_host_gib=0)
    seq = ready(sched)
    sched.start_turn(seq, Turn("long", "Talk for a while.", 400))
    run_idle(sched, dev)
    res = seq.sink.results[-1]
    assert res.reason is FinishReason.LENGTH and 0 < res.frames < 400
    assert sched.stats["turns_cut_no_blocks"] == 1
    assert len(seq.sink.pcm()) == res.frames * HOP  # every frame it made was heard


# ---------------------------------------------------------------------- shared voice prefixes
def test_sessions_with_one_voice_share_its_blocks_and_copy_the_last_on_write():
    sched, dev = make(prefix_cache=8, kv_block_size=16)
    a = ready(sched)
    n = sched.pool.blocks_for(a.pos)
    b_sink = CollectingSink()
    b = new_seq(sched, b_sink, 1)
    sched.admit(b)
    assert b_sink.ready.is_set() and not sched.take_prefill_jobs()  # no prefill at all
    assert b.blocks == a.blocks[:n] and b.pos == a.pos and sched.stats["prefix_hits"] == 1
    shared_last = b.blocks[-1]
    assert sched.pool.holders(shared_last) == 3  # a, b and the cache
    sched.start_turn(b, Turn("t", "Hi.", 5))
    job = sched.take_prefill_jobs()[0]
    # 45 positions: the last block is partly filled and b writes into it: copied first
    assert job.copies == ((shared_last, b.blocks[n - 1]),) and b.blocks[n - 1] != shared_last
    assert sched.stats["cow_copies"] == 1  # b's hold on the source passes to its job...
    assert sched.pool.holders(shared_last) == 3
    assert b.blocks[: n - 1] == a.blocks[: n - 1]  # the full blocks stay shared
    job.done = job.cols.shape[1]
    sched.prefill_done(job)
    assert sched.pool.holders(shared_last) == 2  # ...and ends once the copy has run
    run_idle(sched, dev)
    assert b_sink.results[-1].frames == 5
    sched.close(a)
    sched.close(b)
    assert sched.pool.free == sched.pool.n_blocks - n  # the cache keeps the voice


def test_sessions_opening_together_wait_for_one_prefill_of_their_voice():
    sched, _ = make(prefix_cache=8)
    sinks = [CollectingSink() for _ in range(4)]
    seqs = [new_seq(sched, s, i) for i, s in enumerate(sinks)]
    for seq in seqs:
        sched.admit(seq)
    jobs = sched.take_prefill_jobs()
    assert len(jobs) == 1 and jobs[0].seq is seqs[0]
    sched.close(seqs[0])  # the one prefilling goes away: the next takes over
    sched.prefill_done(jobs[0])
    jobs = sched.take_prefill_jobs()
    assert len(jobs) == 1 and jobs[0].seq is seqs[1]
    sched.prefill_done(jobs[0])
    assert all(s.ready.is_set() for s in sinks[1:]) and not sinks[0].ready.is_set()
    assert seqs[2].blocks == seqs[1].blocks[: len(seqs[2].blocks)]


# ---------------------------------------------------------------------- eviction to host
def test_idle_sessions_are_evicted_least_recent_first_and_restored_with_their_next_turn():
    host = FakeHost()
    sched, dev = make(n_rows=1, evict=host, kv_block_size=16, kv_blocks=11)
    a, b, c = (ready(sched, CollectingSink(), i) for i in range(3))  # 3 blocks each
    sched.start_turn(a, Turn("a", "Hi.", 3))  # 2 more blocks: the pool is full
    run_idle(sched, dev)
    assert sched.pool.free == 0 and not host.saved
    d = new_seq(sched, CollectingSink(), 3)
    sched.admit(d)  # needs 3 blocks: b (least recently used, idle) goes to host
    assert b.offloaded is not None and not b.blocks and host.saved == [[3, 4, 5]]
    assert d.state is SeqState.PREFILLING and sched.stats["kv_evictions"] == 1
    prefill_all(sched)
    assert a.offloaded is None and c.offloaded is None
    sched.start_turn(b, Turn("b", "Back again.", 4))  # c (next least recent) goes, b comes back
    job = sched.take_prefill_jobs()[0]
    assert c.offloaded is not None and b.offloaded is None and d.offloaded is None
    saved, blocks = job.restore
    assert saved == ("saved", (3, 4, 5)) and len(blocks) == 3 and sched.stats["kv_restores"] == 1
    assert job.start == b.turn_start_pos == 45 and blocks == tuple(b.blocks[:3])
    job.done = job.cols.shape[1]
    sched.prefill_done(job)
    run_idle(sched, dev)
    assert b.sink.results[-1].frames == 4
    held = sched.host_bytes
    sched.close(c)  # an evicted session closes: its host copy is dropped
    assert sched.host_bytes == held - 3 and sched.offloaded == (a.offloaded is not None)


def test_without_eviction_a_full_pool_makes_new_sessions_wait():
    sched, _ = make(n_rows=1, kv_block_size=16, kv_blocks=6, max_waiting=4)
    a, _b = ready(sched), ready(sched, CollectingSink(), 1)
    c = new_seq(sched, CollectingSink(), 2)
    sched.admit(c)
    assert list(sched.waiting) == [c] and a.offloaded is None
    sched.close(a)
    assert c.state is SeqState.PREFILLING


def test_a_turn_whose_blocks_can_never_free_is_refused_not_left_waiting():
    sched, dev = make(n_rows=1, kv_block_size=16, kv_blocks=8, kv_host_gib=0)
    seq = ready(sched)
    pos = seq.pos
    sched.start_turn(seq, Turn("t", "Talk.", 400))  # needs 9 blocks; 8 in the pool
    res = seq.sink.results[-1]
    assert res.reason is FinishReason.ERROR and res.error_code is TurnError.OVERLOADED
    assert "no KV blocks free" in res.error and not sched.block_queue
    assert seq.state is SeqState.IDLE and seq.pos == pos
    sched.start_turn(seq, Turn("u", "Short.", 3))  # a smaller turn fits
    run_idle(sched, dev)
    assert seq.sink.results[-1].frames == 3


def test_a_session_closed_while_prefilling_keeps_its_blocks_until_the_job_lands():
    """The prefill stream may still be writing a closed session's blocks: they go back only
    once its job has landed, and an idle session with a cancelled turn's job in flight is
    not evicted."""
    host = FakeHost()
    sched, _ = make(n_rows=1, evict=host, kv_block_size=16, kv_blocks=12)
    a = ready(sched)
    sched.start_turn(a, Turn("t", "Hello.", 10))
    job = sched.take_prefill_jobs()[0]
    free = sched.pool.free
    sched.close(a)
    assert sched.pool.free == free and a.blocks
    sched.prefill_done(job)
    assert sched.pool.free == 12 and not a.blocks
    b = ready(sched, CollectingSink(), 1)
    sched.start_turn(b, Turn("t", "Hello.", 10))
    job = sched.take_prefill_jobs()[0]
    sched.cancel(b)  # idle again, its job still in flight
    c = new_seq(sched, CollectingSink(), 2)
    sched.admit(c)
    assert b.offloaded is None and not host.saved  # not evicted under a running job
    sched.prefill_done(job)
    assert b.jobs_in_flight == 0


def test_an_evicted_session_whose_next_turn_rebuilds_its_context_gets_all_its_blocks_back():
    """A context rebuild moves the position back to the voice prompt's end: the restore
    still brings every saved block back (fewer blocks would not hold the saved copy)."""
    host = FakeHost()
    sched, dev = make(n_rows=1, evict=host, kv_block_size=16, kv_blocks=25, max_len=200)
    a = ready(sched)
    for i in range(3):  # fill a's context with turns
        sched.start_turn(a, Turn(str(i), f"Turn number {i} of several.", 30))
        run_idle(sched, dev)
    n = sched.pool.blocks_for(a.pos)
    others = [ready(sched, CollectingSink(), 10 + i) for i in range(5)]  # a goes to host
    assert a.offloaded is not None and a.offloaded[2] == n
    sched.start_turn(a, Turn("r", "Please rebuild the context for this turn, okay?", 30))
    job = sched.take_prefill_jobs()[0]
    saved, blocks = job.restore
    assert saved == ("saved", tuple(host.saved[0])) and len(blocks) == n
    assert job.turn.rebuilt and job.start == a.system_cols.shape[1]
    job.done = job.cols.shape[1]
    sched.prefill_done(job)
    run_idle(sched, dev)
    assert a.sink.results[-1].turn_id == "r" and a.sink.results[-1].error is None
    assert all(s.state is SeqState.IDLE for s in others)


def test_a_copy_on_write_source_stays_held_until_its_copy_has_run():
    """Found in review: the source of a copy-on-write was released when the job was made,
    so with the prefix forgotten it could be handed to a speaking turn before the prefill
    stream copied it."""
    sched, _ = make(prefix_cache=1, kv_block_size=16)
    a = ready(sched)
    sched.start_turn(a, Turn("t", "Hi.", 5))
    job = sched.take_prefill_jobs()[0]
    (src, _), = job.copies
    assert job.sources == (src,)
    sched.prefixes.clear()  # the cache forgets the voice: only the job holds the source now
    assert sched.pool.holders(src) == 1 and src not in sched.pool._free
    job.done = job.cols.shape[1]
    sched.prefill_done(job)
    assert sched.pool.holders(src) == 0 and src in sched.pool._free


def test_a_turn_queued_behind_a_cancel_starts_after_a_failed_step():
    """Found in review: fail_all_decoding reset a draining session to idle without starting
    the turn queued behind its cancel, which then never ran."""
    sched, dev = make()
    seq = ready(sched)
    sched.start_turn(seq, Turn("a", "A long turn.", 100))
    prefill_all(sched)
    sync_step(sched, dev)
    plan = sched.plan_step(time.perf_counter())
    dev.apply(sched.take_row_ops())
    dev.step(plan)  # in flight, never read: the step "failed"
    sched.cancel(seq)
    sched.start_turn(seq, Turn("b", "Next.", 4))
    assert seq.queued_turn is not None
    sched.fail_all_decoding("decode step failed")
    assert seq.queued_turn is None and seq.turn.turn_id == "b"
    run_idle(sched, dev)
    assert seq.sink.results[-1].turn_id == "b" and seq.sink.results[-1].frames == 4


# ---------------------------------------------------------------- prefill ahead
def land(sched: Scheduler, job) -> None:
    job.done = job.cols.shape[1]
    sched.prefill_done(job)


def test_prefill_ahead_writes_a_turns_head_and_the_turn_prefills_only_the_rest():
    sched, dev = make()
    seq = ready(sched)
    pos0 = seq.pos
    p = sched.prompts
    sched.prefill_ahead(seq, "Hello there, how are")
    (job,) = sched.take_prefill_jobs()
    head = p.user_head("Hello there, how are")
    assert job.ahead and job.turn is None and job.start == pos0 and torch.equal(job.cols, head)
    assert seq.state is SeqState.IDLE and seq.pos == pos0  # not in until it lands
    land(sched, job)
    assert seq.pos == pos0 + head.shape[1]
    sched.prefill_ahead(seq, "Hello there, how are you doing")  # the text grew: the new part
    (job,) = sched.take_prefill_jobs()
    head2 = p.user_head("Hello there, how are you doing")
    assert job.start == pos0 + head.shape[1] and torch.equal(job.cols, head2[:, head.shape[1]:])
    land(sched, job)
    sched.prefill_ahead(seq, "Hello there, how are you doing")  # nothing new: no job
    assert not sched.take_prefill_jobs()
    text = "Hello there, how are you doing today?"
    sched.start_turn(seq, Turn("t", text, 5))
    (job,) = sched.take_prefill_jobs()
    full = p.user_turn(text)
    n = head2.shape[1]
    assert not job.ahead and job.start == pos0 + n and torch.equal(job.cols, full[:, n:-1])
    assert seq.turn_start_pos == pos0
    assert sched.stats["ahead_hits"] == 1 and sched.stats["ahead_misses"] == 0
    assert sched.stats["ahead_jobs"] == 2 and sched.stats["ahead_cols"] == n
    land(sched, job)
    run_idle(sched, dev)
    assert seq.sink.results[-1].frames == 5 and seq.history[-1][0] == text
    # the same turn without the head ahead ends at the same position
    other, dev2 = make()
    s2 = ready(other)
    other.start_turn(s2, Turn("t", text, 5))
    run_idle(other, dev2)
    assert s2.pos == seq.pos and s2.closed_turn == seq.closed_turn is False


def test_a_turn_that_begins_otherwise_rolls_the_head_back():
    sched, dev = make()
    seq = ready(sched)
    pos0 = seq.pos
    sched.prefill_ahead(seq, "Good morning everyone, and")
    land(sched, sched.take_prefill_jobs()[0])
    assert seq.pos > pos0
    sched.start_turn(seq, Turn("t", "Bye now.", 3))
    (job,) = sched.take_prefill_jobs()
    assert job.start == pos0 and torch.equal(job.cols, sched.prompts.user_turn("Bye now.")[:, :-1])
    assert sched.stats["ahead_misses"] == 1 and sched.stats["ahead_hits"] == 0
    land(sched, job)
    run_idle(sched, dev)
    assert seq.sink.results[-1].frames == 3 and seq.ahead is None


def test_a_changed_text_replaces_the_head_and_a_later_turn_closes_the_previous_one():
    sched, dev = make()
    seq = ready(sched)
    sched.start_turn(seq, Turn("a", "First turn.", 3))
    run_idle(sched, dev)
    pos1 = seq.pos
    assert seq.closed_turn is False  # the first turn's <|im_end|> is not in the cache yet
    sched.prefill_ahead(seq, "Something else entirely here")
    (job,) = sched.take_prefill_jobs()
    close = sched.prompts.assistant_close()
    assert job.start == pos1 and torch.equal(job.cols[:, : close.shape[1]], close)
    land(sched, job)
    sched.prefill_ahead(seq, "Second turn begins with")  # not what was prefilled: replaced
    (job,) = sched.take_prefill_jobs()
    assert sched.stats["ahead_misses"] == 1 and job.start == pos1
    assert torch.equal(job.cols[:, : close.shape[1]], close)
    land(sched, job)
    sched.start_turn(seq, Turn("b", "Second turn begins with these words.", 3))
    (job,) = sched.take_prefill_jobs()
    assert sched.stats["ahead_hits"] == 1 and seq.turn_start_pos == pos1
    assert seq.turn.closes_previous
    sched.cancel(seq)  # before it spoke: back to before the head, the close undone too
    assert seq.pos == pos1 and seq.closed_turn is False and seq.ahead is None
    land(sched, job)
    sched.start_turn(seq, Turn("c", "Third.", 3))
    (job,) = sched.take_prefill_jobs()
    full = torch.cat([close, sched.prompts.user_turn("Third.")], dim=1)
    assert job.start == pos1 and torch.equal(job.cols, full[:, :-1])
    land(sched, job)
    run_idle(sched, dev)
    assert seq.sink.results[-1].turn_id == "c" and seq.sink.results[-1].frames == 3


def test_a_turn_that_arrives_while_its_head_prefills_waits_for_it():
    sched, dev = make()
    seq = ready(sched)
    pos0 = seq.pos
    sched.prefill_ahead(seq, "Wait for me please")
    (ahead_job,) = sched.take_prefill_jobs()
    assert not ahead_job.urgent and sched.ahead_outstanding == 1
    sched.start_turn(seq, Turn("t", "Wait for me please, thanks.", 3))
    assert seq.queued_turn is not None and not sched.take_prefill_jobs()
    # its turn waits: the prefill worker no longer puts it last, and it is no longer
    # speculative (a prefill the decode steps may pause for)
    assert ahead_job.urgent and sched.ahead_outstanding == 0 and sched.prefill_outstanding == 1
    sched.prefill_ahead(seq, "Wait for me please, thanks")  # a job in flight: nothing more
    assert not sched.take_prefill_jobs()
    land(sched, ahead_job)
    assert sched.ahead_outstanding == 0
    (job,) = sched.take_prefill_jobs()
    assert job.start == pos0 + ahead_job.cols.shape[1] and sched.stats["ahead_hits"] == 1
    land(sched, job)
    run_idle(sched, dev)
    assert seq.sink.results[-1].frames == 3


def test_prefill_ahead_only_on_an_idle_sequence_and_only_when_asked():
    sched, dev = make()
    seq = ready(sched)
    sched.start_turn(seq, Turn("t", "Speaking now.", 50))
    prefill_all(sched)
    sync_step(sched, dev)
    sched.prefill_ahead(seq, "The next sentence is streaming")  # decoding: not now
    assert not sched.take_prefill_jobs() and seq.ahead is None
    sched.cancel(seq)
    run_idle(sched, dev)
    sched.prefill_ahead(seq, "Hello there")
    land(sched, sched.take_prefill_jobs()[0])
    sched.prefill_ahead(seq, "Hello there, h")  # 2 more columns: not worth a job
    assert not sched.take_prefill_jobs()
    off, _ = make(prefill_ahead=False)
    s2 = ready(off)
    off.prefill_ahead(s2, "The next sentence is streaming")
    assert not off.take_prefill_jobs() and s2.ahead is None


def test_prefill_ahead_takes_only_free_blocks_and_a_closed_session_returns_them():
    host = FakeHost()
    sched, _ = make(n_rows=1, evict=host, kv_block_size=16, kv_blocks=12)
    a = ready(sched)
    b = ready(sched, CollectingSink(), 1)
    free = sched.pool.free
    long_text = "word " * 100  # more blocks than are free: nobody is evicted for it
    sched.prefill_ahead(a, long_text)
    assert not sched.take_prefill_jobs() and not host.saved and b.offloaded is None
    assert sched.pool.free == free
    sched.prefill_ahead(a, "A short head of text")
    (job,) = sched.take_prefill_jobs()
    sched.close(a)  # its job still writes: the blocks come back when it lands
    assert a.blocks
    land(sched, job)
    assert not a.blocks and sched.pool.free == free + 3  # its voice prompt's and the head's


def test_an_evicted_head_comes_back_with_its_session():
    host = FakeHost()
    sched, dev = make(n_rows=1, evict=host, kv_block_size=16, kv_blocks=12)
    a = ready(sched)
    sched.prefill_ahead(a, "Remember this head of")
    land(sched, sched.take_prefill_jobs()[0])
    pos = a.pos
    others = [ready(sched, CollectingSink(), 10 + i) for i in range(5)]  # a goes to host
    assert a.offloaded is not None and a.offloaded[2] == sched.pool.blocks_for(pos)
    assert len(host.saved[0]) == sched.pool.blocks_for(pos)  # the head's positions too
    for s in others:
        sched.close(s)
    sched.start_turn(a, Turn("t", "Remember this head of text.", 3))
    (job,) = sched.take_prefill_jobs()
    assert job.restore is not None and job.start == pos and sched.stats["ahead_hits"] == 1
    land(sched, job)
    run_idle(sched, dev)
    assert a.sink.results[-1].frames == 3


def test_a_context_rebuild_discards_the_head_as_a_miss():
    sched, dev = make(max_len=180)
    seq = ready(sched)
    sched.start_turn(seq, Turn("0", "Hi.", 4))
    run_idle(sched, dev)
    sched.prefill_ahead(seq, "A short head")  # fits: the head and a turn's margin
    (job,) = sched.take_prefill_jobs()
    land(sched, job)
    # the whole turn and its 64 frames do not: the context is rebuilt, the head rewritten
    sched.start_turn(seq, Turn("r", "A short head, then the rest of it.", 64))
    (job,) = sched.take_prefill_jobs()
    assert job.turn.rebuilt and job.start == seq.system_cols.shape[1]
    assert sched.stats["ahead_misses"] == 1 and sched.stats["ahead_hits"] == 0
    land(sched, job)
    run_idle(sched, dev)
    assert seq.sink.results[-1].turn_id == "r" and seq.sink.results[-1].error is None
