"""The generation engine with the built-in tiny model: turns, streaming audio, batching,
cancel, context reuse and rebuild."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import CollectingSink, build_engine
from engine.errors import EngineOverloaded, TurnError
from engine.request import FinishReason
from engine.sampler import SamplingParams


@pytest.fixture()
def engine(tiny_bundle):
    return build_engine(tiny_bundle, EngineConfig(max_running=4, max_len=1024, max_waiting=2))


def _turn(engine, sink, seq, text, n, tid="t"):
    engine.submit(seq, text, turn_id=tid, max_frames=n)
    engine.run_until_idle()
    return sink.results[-1]


def test_turn_streams_exact_audio(engine, tiny_bundle):
    engine.cfg.slow_start_x = 0.0  # the chunk sizes below, however fast this machine decodes
    sink = CollectingSink()
    seq = engine.open([], SamplingParams(seed=5), sink)
    engine.run_until_idle()
    assert sink.ready.is_set() and sink.prefill_s > 0
    res = _turn(engine, sink, seq, "Hello world.", 12)
    assert res.reason in (FinishReason.LENGTH, FinishReason.EOS)
    assert res.frames == res.codes.shape[1] <= 12
    pcm = sink.pcm()
    assert len(pcm) == res.frames * 2048
    # chunking: a small first chunk, larger later ones, offsets contiguous
    sizes = [len(a) // 2048 for a in sink.audio]
    assert sizes[:4] == [1, 1, 2, 4]  # 12 frames: 1, 1, 2, 4, then the remaining 4
    assert max(sizes) <= 8 and sum(sizes) == res.frames
    assert np.allclose(np.cumsum([0, *sizes[:-1]]) * 2048 / 44100, sink.offsets)
    # streaming through the engine == offline decode of the same codes
    with torch.inference_mode():
        offline = tiny_bundle.codec.decode(res.codes[None].long())[0, 0].numpy()
    assert np.abs(offline - pcm).max() < 1e-4
    assert res.ttfa_s is not None and res.ttfa_s >= 0


def test_concurrent_sequences_match_alone(tiny_bundle):
    texts = ["Hello there.", "مرحبا بالعالم.", "你好，世界。", "こんにちは。"]
    greedy = SamplingParams.greedy()

    def run(batch):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=4, max_len=512))
        sinks = [CollectingSink() for _ in batch]
        seqs = [eng.open([], greedy, s) for s in sinks]
        for seq, t in zip(seqs, batch):
            eng.submit(seq, t, turn_id="x", max_frames=10)
        eng.run_until_idle()
        return [s.results[-1].codes for s in sinks]

    together = run(texts)
    for i, t in enumerate(texts):
        assert torch.equal(run([t])[0], together[i]), t


def test_seed_reproduces_sampled_turns(tiny_bundle):
    def once(seed):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=512))
        sink = CollectingSink()
        seq = eng.open([], SamplingParams(seed=seed), sink)
        eng.submit(seq, "Same text.", turn_id="a", max_frames=8)
        eng.run_until_idle()
        return sink.results[-1].codes

    assert torch.equal(once(11), once(11))
    assert not torch.equal(once(11), once(12))


def test_cancel_stops_audio_and_next_turn_works(engine):
    sink = CollectingSink()
    seq = engine.open([], SamplingParams(seed=1), sink)
    engine.submit(seq, "A long sentence that keeps going.", turn_id="one", max_frames=200)
    for _ in range(200):
        engine.step()
        if len(sink.audio) >= 2:
            break
    n_audio = len(sink.audio)
    engine.cancel(seq)
    engine.run_until_idle()
    assert len(sink.audio) == n_audio  # nothing after the cancel was processed
    res = sink.results[-1]
    assert res.turn_id == "one" and res.reason is FinishReason.CANCELLED
    pos_after = seq.pos
    res2 = _turn(engine, sink, seq, "Next turn.", 6, "two")
    assert res2.turn_id == "two" and res2.frames > 0
    assert seq.pos > pos_after  # the conversation continued in the same cache
    assert len(seq.history) == 2


def test_cancel_before_any_frame_rolls_back(engine):
    sink = CollectingSink()
    seq = engine.open([], SamplingParams(seed=1), sink)
    engine.run_until_idle()
    pos0 = seq.pos
    engine.submit(seq, "Never spoken.", turn_id="x", max_frames=50)
    engine.cancel(seq)
    engine.run_until_idle()
    assert sink.results[-1].reason is FinishReason.CANCELLED and sink.results[-1].frames == 0
    assert seq.pos == pos0 and seq.history == []


def test_context_rebuild_drops_oldest_turns(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=200))
    sink = CollectingSink()
    seq = eng.open([], SamplingParams(seed=2), sink)
    for i in range(6):
        res = _turn(eng, sink, seq, f"Turn number {i}.", 30, str(i))
        assert res.error is None and res.frames > 0
        assert seq.pos <= 200
    assert len(seq.history) < 6  # oldest turns were dropped, the session went on


def test_errors_are_reported_not_raised(engine):
    sink = CollectingSink()
    seq = engine.open([], SamplingParams(), sink)
    with pytest.raises(ValueError):
        engine.submit(seq, "   ", turn_id="e")
    engine.submit(seq, "one", turn_id="a", max_frames=100)
    engine.submit(seq, "two", turn_id="b", max_frames=5)  # while a turn runs
    engine.run_until_idle()
    by_id = {r.turn_id: r for r in sink.results}
    assert by_id["b"].reason is FinishReason.ERROR and "already running" in by_id["b"].error
    assert by_id["a"].error is None
    # too long for the context
    res = _turn(engine, sink, seq, "x" * 2000, 5, "long")
    assert res.reason is FinishReason.ERROR and "too long" in res.error


def test_admission_queue_and_overload(tiny_bundle):
    """A voice prompt waits for KV blocks when the pool is full (and nothing can be evicted
    or shared), up to max_waiting; then opens are refused."""
    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=256, max_waiting=1, kv_block_size=16, kv_blocks=4,
                                                 prefix_cache=0, kv_host_gib=0))
    a, b = CollectingSink(), CollectingSink()
    sa = eng.open([], SamplingParams(), a)
    eng.run_until_idle()
    sb = eng.open([], SamplingParams(), b)
    eng.run_until_idle()
    assert a.ready.is_set() and not b.ready.is_set()  # b waits for blocks
    with pytest.raises(EngineOverloaded):
        eng.open([], SamplingParams(), CollectingSink())
    eng.close(sa)
    eng.run_until_idle()
    assert b.ready.is_set()
    eng.close(sb)
    eng.run_until_idle()
    assert eng.load()["kv_blocks_free"] == 4


def test_engine_thread(engine):
    engine.start()
    try:
        sink = CollectingSink()
        seq = engine.open([], SamplingParams(seed=3), sink)
        engine.submit(seq, "Threaded.", turn_id="t", max_frames=5)
        assert sink.done.wait(30)
        assert sink.results[-1].frames == 5 or sink.results[-1].reason is FinishReason.EOS
    finally:
        engine.shutdown()


def test_pingpong_threads_match_sync(tiny_bundle):
    """The threaded pingpong loop (decode thread reads step N-1 while step N runs) produces
    the same frames as the synchronous loop, with several sequences joining and a cancel."""
    texts = ["One two three.", "Four five.", "Six seven eight nine."]

    def run(pingpong):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=4, max_len=512,
                                                    pingpong=pingpong))
        sinks = [CollectingSink() for _ in texts]
        seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
        if pingpong:
            eng.start()
        for seq, t in zip(seqs, texts):
            eng.submit(seq, t, turn_id="a", max_frames=12)
        if pingpong:
            for s in sinks:
                assert s.done.wait(60)
            for s in sinks:
                s.done.clear()
        else:
            eng.run_until_idle()
        for _i, seq in enumerate(seqs):  # a second turn continues each conversation
            eng.submit(seq, "And again.", turn_id="b", max_frames=6)
        if pingpong:
            for s in sinks:
                assert s.done.wait(60)
            eng.shutdown()
        else:
            eng.run_until_idle()
        return [[r.codes for r in s.results] for s in sinks], eng

    sync, _ = run(False)
    threaded, eng = run(True)
    for a, b in zip(sync, threaded):
        assert len(a) == len(b) == 2
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert eng.stats["wasted_rows"] >= 0


def test_prefill_joins_when_it_lands_and_running_turns_go_on(tiny_bundle, monkeypatch):
    """Pingpong: a launched prefill joins the batch only once its event says the GPU is done
    (polled, never waited on), so a running turn keeps producing audio meanwhile; the
    watchdog counts how long the prefill has been landing."""
    import threading
    import time

    # codec_hold_s=0: every chunk goes at once (a held stream could go quiet for a while)
    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=512, codec_hold_s=0,
                                                 prefix_cache=0))  # b prefills its own voice
    gate = threading.Event()

    class Landing:  # stands in for the CUDA event of a prefill round still on the GPU
        def query(self) -> bool:
            return gate.is_set()

    a_sink, b_sink = CollectingSink(), CollectingSink()
    a = eng.open([], SamplingParams(seed=1), a_sink)
    eng.start()
    try:
        assert a_sink.ready.wait(60)
        eng.submit(a, "A long turn that keeps going.", turn_id="a", max_frames=400)
        deadline = time.perf_counter() + 60
        while not a_sink.audio and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert a_sink.audio, "the running turn produced no audio"
        real = eng.prefill_worker.round

        def held(jobs):
            done = real(jobs)
            for j in done:
                j.event = j.event if j.event is not None else Landing()
            return done

        monkeypatch.setattr(eng.prefill_worker, "round", held)
        b = eng.open([], SamplingParams(seed=2), b_sink)
        while not eng._landing and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert eng._landing, "b's voice prompt never reached the decode thread"
        seen = time.perf_counter()  # b's job landed before this
        chunks = len(a_sink.audio)
        while len(a_sink.audio) <= chunks + 1 and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert len(a_sink.audio) > chunks + 1  # a's turn goes on...
        assert not b_sink.ready.is_set()  # ...while b's prefill is still on the "GPU"
        waited = time.perf_counter() - seen
        assert eng.device_wait_s() >= waited > 0  # the watchdog sees how long it has landed
        # a sequence closed while its prefill lands never joins, and frees its slot
        c_sink = CollectingSink()
        c = eng.open([], SamplingParams(seed=3), c_sink)  # waits for a slot (2 in use)
        eng.close(b)
        while len(eng._landing) < 2 and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert len(eng._landing) == 2  # b's and c's voice prompts
        eng.close(c)
        gate.set()
        while eng._landing and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert not eng._landing
        assert not b_sink.ready.is_set() and not c_sink.ready.is_set()
        assert not b_sink.errors and not c_sink.errors
        eng.cancel(a)
        assert a_sink.done.wait(60)
        d_sink = CollectingSink()
        eng.open([], SamplingParams(seed=4), d_sink)  # the slot b and then c held is usable
        assert d_sink.ready.wait(10)
    finally:
        eng.shutdown()


def test_a_failed_join_fails_only_its_sequence(tiny_bundle, monkeypatch):
    """Several prefills land in one pass and joining one of them raises: that sequence gets
    an error and is closed; the others join."""
    import threading

    eng = build_engine(tiny_bundle, EngineConfig(max_running=3, max_len=512, prefix_cache=0))
    gate = threading.Event()

    class Landing:
        def query(self) -> bool:
            return gate.is_set()

    real_round, real_land = eng.prefill_worker.round, eng.scheduler._land

    def held(jobs):
        done = real_round(jobs)
        for j in done:
            j.event = j.event if j.event is not None else Landing()
        return done

    sinks = [CollectingSink() for _ in range(3)]
    seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]

    def flaky(job):
        if job.seq is seqs[1]:
            raise RuntimeError("boom")
        real_land(job)

    monkeypatch.setattr(eng.prefill_worker, "round", held)
    monkeypatch.setattr(eng.scheduler, "_land", flaky)
    eng.start()
    try:
        import time

        deadline = time.perf_counter() + 30
        while len(eng._landing) < 3 and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert len(eng._landing) == 3
        gate.set()  # all three complete in one pass
        assert sinks[0].ready.wait(10) and sinks[2].ready.wait(10)
        assert sinks[1].ready.wait(10) and "joining after prefill failed: boom" in sinks[1].errors[0]
        assert not sinks[0].errors and not sinks[2].errors
        load = eng.load()  # the failed sequence gave its blocks back
        assert load["live"] == 2 and load["kv_blocks"] - load["kv_blocks_free"] == 2
    finally:
        eng.shutdown()


def test_pingpong_cancel_drains(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=512, pingpong=True))
    sink = CollectingSink()
    seq = eng.open([], SamplingParams(seed=4), sink)
    eng.start()
    try:
        eng.submit(seq, "A long turn to cancel.", turn_id="x", max_frames=300)
        import time

        deadline = time.time() + 30
        while len(sink.audio) < 2 and time.time() < deadline:
            time.sleep(0.01)
        eng.cancel(seq)
        assert sink.done.wait(30)
        n = len(sink.audio)
        assert sink.results[-1].reason is FinishReason.CANCELLED
        sink.done.clear()
        eng.submit(seq, "Next.", turn_id="y", max_frames=5)  # queued until the drain
        assert sink.done.wait(30)
        res = sink.results[-1]
        assert res.turn_id == "y" and res.frames == 5
        # audio after the cancel belongs to turn y only
        assert sum(len(a) for a in sink.audio[n:]) == 5 * 2048
        assert len(seq.history) == 2
    finally:
        eng.shutdown()


def test_closed_waiting_sequence_frees_its_queue_place(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=256, max_waiting=1, kv_block_size=16, kv_blocks=4,
                                                 prefix_cache=0, kv_host_gib=0))
    sa = eng.open([], SamplingParams(), CollectingSink())
    eng.run_until_idle()
    sb = eng.open([], SamplingParams(), CollectingSink())
    eng.run_until_idle()
    assert eng.load()["waiting"] == 1
    eng.close(sb)  # gives up while waiting for blocks
    eng.run_until_idle()
    assert eng.load()["waiting"] == 0
    c = CollectingSink()
    sc = eng.open([], SamplingParams(), c)  # no EngineOverloaded: the place was freed
    eng.close(sa)
    eng.run_until_idle()
    assert c.ready.is_set() and sc.blocks


def test_failed_prefill_fails_only_its_sequence(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=3, max_len=256, prefix_cache=0))
    sinks = [CollectingSink() for _ in range(3)]
    seqs = [eng.open([], SamplingParams(), s) for s in sinks]
    orig = eng.runner.prefill_batch

    def flaky(items):  # the second sequence's voice prompt (its one block is block 1)
        if any(blocks[0] == 1 for blocks, _, _ in items):
            raise RuntimeError("boom in block 1")
        return orig(items)

    eng.runner.prefill_batch = flaky
    eng.run_until_idle()
    assert sinks[0].ready.is_set() and sinks[2].ready.is_set()
    assert sinks[1].prefill_s == 0 and "boom" in sinks[1].errors[0]  # on_error, never on_ready
    load = eng.load()  # the failed sequence was closed and its block released
    assert load["live"] == 2 and load["kv_blocks"] - load["kv_blocks_free"] == 2
    eng.runner.prefill_batch = orig
    eng.submit(seqs[0], "Still fine.", turn_id="ok", max_frames=4)
    eng.run_until_idle()
    assert sinks[0].results[-1].frames == 4


def test_codec_failure_ends_the_turn_with_an_internal_error(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=512))
    sink = CollectingSink()
    seq = eng.open([], SamplingParams(seed=1), sink)
    decoder = eng.codec_worker.decoder
    orig = decoder.decode
    calls = {"n": 0}

    def broken(chunks):
        calls["n"] += 1
        raise RuntimeError("codec exploded")

    decoder.decode = broken
    eng.submit(seq, "This turn loses its audio.", turn_id="bad", max_frames=100)
    eng.run_until_idle()
    res = sink.results[-1]
    assert res.turn_id == "bad" and res.reason is FinishReason.ERROR
    assert res.error_code is TurnError.INTERNAL and "codec exploded" in res.error
    assert eng.runner.active.sum() == 0 and not eng.scheduler.running  # off the device batch
    assert decoder.n_open == 0  # its codec stream closed
    decoder.decode = orig
    eng.submit(seq, "The next turn works.", turn_id="good", max_frames=5)
    eng.run_until_idle()
    assert sink.results[-1].turn_id == "good" and sink.results[-1].frames == 5


def test_turn_too_long_is_the_clients_fault(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=160))
    sink = CollectingSink()
    seq = eng.open([], SamplingParams(), sink)
    eng.submit(seq, "x" * 500, turn_id="long", max_frames=5)
    eng.run_until_idle()
    assert sink.results[-1].error_code is TurnError.TOO_LARGE


def test_kv_pool_is_sized_from_free_memory():
    """On a GPU the pool takes the memory left after a reserve (or kv_blocks, if fewer);
    when not even one full context fits the engine refuses to build with the numbers and
    what to change."""
    from engine.cache import SlowKVCache
    from engine.config import preset
    from engine.engine import fit_kv_blocks
    from engine.errors import EngineOutOfMemory

    cfg = preset("s2-pro").slow
    pos = SlowKVCache.position_bytes(cfg, torch.bfloat16)
    assert pos == 2 * 36 * 8 * 128 * 2  # 144 KiB per position: a 10 s voice (~215) is 31 MiB
    block, gib = 64 * pos, 2**30
    fit = dict(block_bytes=block, block_size=64, max_len=2048)
    assert fit_kv_blocks(None, free_bytes=130 * gib, reserve_bytes=8 * gib, **fit) \
        == 122 * gib // block - 1  # an H200 after the weights: 13,000+ blocks
    assert fit_kv_blocks(500, free_bytes=130 * gib, reserve_bytes=8 * gib, **fit) == 500
    with pytest.raises(EngineOutOfMemory, match="lower max_len or free GPU memory"):
        fit_kv_blocks(None, free_bytes=8 * gib + 31 * block, reserve_bytes=8 * gib, **fit)
    tiny = preset("tiny").slow
    cache = SlowKVCache(tiny, 3, 16, 256, device="cpu", dtype=torch.float32)
    assert (cache.k.numel() + cache.v.numel()) * 4 == 4 * 16 * SlowKVCache.position_bytes(
        tiny, torch.float32)  # 3 blocks + scratch
    assert cache.table_width == 256 // 16 + 1


class _EagerGraph:
    """Stands in for a captured prefill graph on a CPU: replay runs the same static forward
    on the same input buffers, which is what the CUDA graph records."""

    replays: ClassVar[dict[int, int]] = {}

    def __init__(self, runner, inp, span):
        self.runner, self.inp, self.span = runner, inp, span

    def replay(self):
        n = self.inp["cols"].shape[0]
        _EagerGraph.replays[n] = _EagerGraph.replays.get(n, 0) + 1
        self.runner.prefill_static(self.inp, self.span)


def install_eager_graphs(eng, keys) -> None:
    """`_EagerGraph`s in the engine's prefill graph set for `keys` ((rows, columns, span))."""
    r, pg = eng.runner, eng.prefill_worker.graphs
    for N, T, span in keys:
        inp = r.prefill_inputs(T, N)
        pg.graphs[(N, T, span)] = (_EagerGraph(r, inp, span), inp)


def greedy_turns(eng, texts: list[str], frames: int) -> list:
    """One greedy turn per text, each in a session of its own opened first; the sync loop
    runs them. Returns each turn's codes."""
    sinks = [CollectingSink() for _ in texts]
    seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
    eng.run_until_idle()
    for seq, t in zip(seqs, texts):
        eng.submit(seq, t, turn_id="a", max_frames=frames)
    eng.run_until_idle()
    return [s.results[-1].codes for s in sinks]


def test_prefill_graph_plan_matches_eager(tiny_bundle):
    """The prefill graph path (single chunks per (columns, span) bucket, short chunks N at a
    time with padding rows on the scratch block) gives the greedy codes of eager prefill."""
    texts = ["Hello there.", "Five.", "A somewhat longer sentence for the third voice.", "Six!"]

    def run(graphs: bool):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=4, max_len=512, pingpong=False,
                                                     prefill_chunk=32, prefix_cache=0))
        if graphs:
            install_eager_graphs(eng, eng.prefill_worker.graphs.keys())
        return greedy_turns(eng, texts, 10), eng

    want, _ = run(False)
    _EagerGraph.replays.clear()
    got, eng = run(True)
    assert _EagerGraph.replays.get(4, 0) >= 2  # voice prompts and turns, four at a time
    plan, eager = eng.prefill_worker.graphs.plan([(0, torch.zeros(11, 5, dtype=torch.long), 40),
                                     (1, torch.zeros(11, 20, dtype=torch.long), 30),
                                     (2, torch.zeros(11, 30, dtype=torch.long), 0)])
    # three short chunks, one replay at the widest one's bucket (30 -> 32 columns), keys
    # over the span that holds them (40 + 32 <= 256)
    assert not eager and [k for k, _ in plan] == [(4, 32, 256)]
    # more chunks than a replay takes: grouped by start, each group over its own span
    many = [(i, torch.zeros(11, 5, dtype=torch.long), 300 if i % 3 == 0 else 10)
            for i in range(24)]  # 16 early, 8 later in their contexts, interleaved
    plan, eager = eng.prefill_worker.graphs.plan(many)
    assert not eager and sorted(k for k, _ in plan) == [(8, 8, 512), (16, 8, 256)]
    for (N, T, span), chunks in plan:
        assert len(chunks) <= N and all(start + T <= span for _, _, start in chunks)
    plan, _ = eng.prefill_worker.graphs.plan([(0, torch.zeros(11, 5, dtype=torch.long), 40)])
    assert [k for k, _ in plan] == [(1, 8, 256)]  # alone: the single graph, smallest span
    # a short chunk near the end of the context never joins a group padded to 64 columns
    # (it would write past the cache): it gets its own graph
    near, far = (0, torch.zeros(11, 5, dtype=torch.long), 500), \
        (1, torch.zeros(11, 20, dtype=torch.long), 100)
    plan, _ = eng.prefill_worker.graphs.plan([near, far])
    for (N, T, span), chunks in plan:
        assert all(start + T <= 512 for _, _, start in chunks), (N, T, span)
    assert sorted(k for k, _ in plan) == [(1, 8, 512), (1, 24, 256)]
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_running=0), "max_running must be >= 1"),
    (dict(stall_s=0), "stall_s must be > 0"),
    (dict(fused_ops="fast"), "fused_ops: unknown value(s) ['fast']"),
    (dict(high_priority_streams="decode"), "must be a tuple of names"),
    (dict(high_priority_streams=None), "high_priority_streams must be set"),
    (dict(high_priority_streams=("decode", "audio")), "unknown value(s) ['audio']"),
    (dict(max_waiting=True), "max_waiting must be int"),
    (dict(prefill_first_wait_s=float("nan")), "prefill_first_wait_s must be a number"),
])
def test_engine_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert needle in str(e.value)


def test_prefill_first_keeps_every_turn_and_its_audio(tiny_bundle):
    """Pingpong with prefill first at a tiny lead: while a second wave of turns is being
    prefilled (held in its prefill round until the decode thread has paused for it), the
    first wave, ahead of realtime, waits; afterwards every turn ends with all its audio."""
    import threading
    import time

    eng = build_engine(tiny_bundle, EngineConfig(max_running=4, max_len=256,
                                                 prefill_first_lead_s=1e-3))
    sinks = [CollectingSink() for _ in range(4)]
    frames = {"a": 40, "b": 12}
    release, held = threading.Event(), threading.Event()
    real_round = eng.prefill_worker._round

    def held_round(jobs):  # the prefill thread: wave two's prompt waits for `release`
        if any(j.turn is not None and j.turn.turn_id.startswith("b") for j in jobs):
            held.set()
            release.wait(30)
        return real_round(jobs)

    eng.prefill_worker._round = held_round
    eng.start()
    try:
        seqs = [eng.open([], SamplingParams(seed=i, temperature=0.0), s) for i, s in enumerate(sinks)]
        deadline = time.time() + 60
        for s in sinks:
            assert s.ready.wait(30)
        for i, seq in enumerate(seqs[:2]):
            eng.submit(seq, "first wave of text", turn_id=f"a{i}", max_frames=frames["a"])
        # the first wave a few chunks in, ahead of realtime (tiny decodes ~3x realtime here)
        while (min(len(s.pcm()) for s in sinks[:2]) < 4 * eng.frame_samples
               and time.time() < deadline):
            time.sleep(0.005)
        eng.stats["decode_pauses"] = 0
        for i, seq in enumerate(seqs[2:]):
            eng.submit(seq, "a second wave arrives", turn_id=f"b{i}", max_frames=frames["b"])
        assert held.wait(30)
        while eng.stats["decode_pauses"] == 0 and time.time() < deadline:
            time.sleep(0.005)
        paused_for_wave_two = eng.stats["decode_pauses"]
        release.set()
        while sum(len(s.results) for s in sinks) < 4 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        eng.shutdown()
    assert paused_for_wave_two > 0 and eng.stats["decode_paused_s"] > 0
    for s, wave in zip(sinks, "aabb"):
        assert [r.reason for r in s.results] == [FinishReason.LENGTH]
        assert len(s.pcm()) == frames[wave] * eng.frame_samples


def test_two_engines_with_different_ops_in_one_process(tiny_bundle):
    """The kernels an engine runs are its own `Ops`: two engines over one model, one with
    the reference math and one whose linear layers compute in float64 (and count their
    calls), run interleaved in one process; each gives the frames of a fresh engine of its
    own kind, and neither's ops are ever called by the other."""
    import dataclasses

    import torch.nn.functional as F

    from engine import quant
    from engine.ops import REFERENCE

    calls = {"f64": 0}

    def linear64(x, w):  # type: ignore[no-untyped-def]
        calls["f64"] += 1
        return F.linear(x.double(), w.double()).to(x.dtype)

    f64 = dataclasses.replace(REFERENCE, linear=linear64)
    cfg = EngineConfig(max_running=2, max_len=512)
    texts = ["Hello there.", "A second voice."]

    def run(engines):  # type: ignore[no-untyped-def]
        sinks = {e: [CollectingSink() for _ in texts] for e in engines}
        for e, ss in sinks.items():
            for s, t in zip(ss, texts):
                e.submit(e.open([], SamplingParams.greedy(), s), t, turn_id="a", max_frames=10)
        while any([e.step() for e in engines]):
            pass
        return {e: [s.results[-1].codes for s in ss] for e, ss in sinks.items()}

    ref_alone = run([build_engine(tiny_bundle, cfg)])
    f64_alone = run([build_engine(tiny_bundle, cfg, ops=f64)])
    n_alone = calls["f64"]
    ref, wide = build_engine(tiny_bundle, cfg), build_engine(tiny_bundle, cfg, ops=f64)
    assert ref.ops.linear is quant.linear and wide.ops is f64 and wide.runner.ops is f64
    both = run([ref, wide])
    assert calls["f64"] == 2 * n_alone  # the same calls as alone: none came from `ref`
    for a, b in zip(both[ref], next(iter(ref_alone.values()))):
        assert torch.equal(a, b)
    for a, b in zip(both[wide], next(iter(f64_alone.values()))):
        assert torch.equal(a, b)


def test_a_voice_that_leaves_no_room_is_refused_at_open(tiny_bundle):
    """The engine's one room rule (Engine.text_room, also what the service caps segments
    with): a voice prompt that leaves no room for a turn is refused when opened."""
    from engine.errors import PromptTooLong
    from engine.prompt import Reference

    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=256))
    assert eng.text_room([]) > 0
    big = [Reference("A long transcript.", torch.zeros(10, 200, dtype=torch.long))]
    assert eng.text_room(big) < 0
    with pytest.raises(PromptTooLong, match="leaves no room"):
        eng.open(big, SamplingParams(), CollectingSink())


def test_a_failed_row_op_fails_only_its_sequence(tiny_bundle, monkeypatch):
    """The decode worker applies the scheduler's row ops one by one: one that fails fails
    its own sequence (closed, its row and blocks back), and a turn running beside it goes
    on."""
    eng = build_engine(tiny_bundle, EngineConfig(max_running=3, max_len=512, pingpong=False))
    a_sink, b_sink = CollectingSink(), CollectingSink()
    a = eng.open([], SamplingParams(seed=1), a_sink)
    b = eng.open([], SamplingParams(seed=2), b_sink)
    eng.submit(a, "A turn that keeps going.", turn_id="a", max_frames=20)
    for _ in range(10):
        eng.step()
    real = eng.runner.apply

    def broken(op):  # the second turn's row cannot be set up
        if op.kind == "join" and op.row == 1:
            raise RuntimeError("device write failed")
        real(op)

    monkeypatch.setattr(eng.runner, "apply", broken)
    eng.submit(b, "Never spoken.", turn_id="b", max_frames=5)
    eng.run_until_idle()
    assert "setting up its decode state failed: device write failed" in b_sink.errors[0]
    assert a_sink.results[-1].reason is FinishReason.LENGTH and a_sink.results[-1].frames == 20
    assert eng.free_rows() == 3 and eng.load()["live"] == 1  # b's row and blocks went back


def test_open_refuses_a_window_the_engine_cannot_hold(tiny_bundle):
    eng = build_engine(tiny_bundle, EngineConfig(max_running=1, max_len=256))
    with pytest.raises(ValueError, match="ras_window 20 exceeds the engine's 16"):
        eng.open([], SamplingParams(ras_window=20), CollectingSink())


def _conversation(tiny_bundle, n_sessions, **cfg):
    """Greedy two-turn conversations on n sessions with one voice, turns taken in order
    (each session idles while the others speak); returns every turn's codes and the stats."""
    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256, pingpong=False,
                                                 **cfg))
    sinks = [CollectingSink() for _ in range(n_sessions)]
    seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
    eng.run_until_idle()
    for rnd in range(2):
        for i, seq in enumerate(seqs):
            eng.submit(seq, f"Round {rnd}, session {i}.", turn_id=f"{rnd}", max_frames=12)
            eng.run_until_idle()
    assert all(len(s.results) == 2 and not s.errors for s in sinks)
    return [r.codes for s in sinks for r in s.results], eng.stats


def test_shared_voice_prefixes_and_host_eviction_change_no_frame(tiny_bundle):
    """The same conversations give the same greedy frames whether each session prefills its
    own voice or shares one copy (copy-on-write of its last block), and whether idle
    sessions stay in the pool or go to host memory and come back."""
    want, base = _conversation(tiny_bundle, 4, prefix_cache=0)
    assert base["prefix_hits"] == 0 and base["kv_evictions"] == 0
    shared, st = _conversation(tiny_bundle, 4, kv_block_size=16)
    assert st["prefix_hits"] == 3 and st["cow_copies"] >= 3
    assert st["prefill_cols"] < base["prefill_cols"]  # the voice prefilled once
    # 12 blocks of 16: two speaking sessions fit, the idle ones go to host and come back
    evicted, ev = _conversation(tiny_bundle, 4, prefix_cache=0, kv_block_size=16, kv_blocks=12)
    assert ev["kv_evictions"] >= 4 and ev["kv_restores"] >= 4
    for got in (shared, evicted):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_idle_sessions_never_keep_others_from_speaking(tiny_bundle):
    """max_running=2 with 6 sessions open: every one gets ready; sessions that spoke and went
    idle hold no decode row; 3 turns at once take both rows and the third speaks as soon as
    one frees (threaded engine)."""
    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256))
    eng.start()
    try:
        sinks = [CollectingSink() for _ in range(6)]
        seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
        assert all(s.ready.wait(30) for s in sinks)
        for seq in seqs[:2]:
            eng.submit(seq, "First.", turn_id="a", max_frames=4)
        assert all(s.done.wait(30) for s in sinks[:2])
        for s in sinks:
            s.done.clear()
        for seq in seqs[2:5]:
            eng.submit(seq, "Three at once.", turn_id="b", max_frames=6)
        assert all(s.done.wait(30) for s in sinks[2:5])
        assert [s.results[-1].frames for s in sinks[:5]] == [4, 4, 6, 6, 6]
        assert eng.stats["row_waits"] >= 1 and eng.load()["live"] == 6
    finally:
        eng.shutdown()


def test_a_turn_cancelled_before_its_restore_keeps_the_sessions_context(tiny_bundle):
    """An evicted session's turn is cancelled before its prefill job runs: the restore (and
    copy-on-write) still happen, so its next turn speaks from its real context."""
    want, _ = _conversation(tiny_bundle, 4, prefix_cache=0)

    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256, pingpong=False,
                                                 prefix_cache=0, kv_block_size=16,
                                                 kv_blocks=12))
    sinks = [CollectingSink() for _ in range(4)]
    seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
    eng.run_until_idle()
    for i, seq in enumerate(seqs):
        eng.submit(seq, f"Round 0, session {i}.", turn_id="0", max_frames=12)
        eng.run_until_idle()
    assert seqs[0].offloaded is not None  # the least recently used went to host
    eng.submit(seqs[0], "Never spoken.", turn_id="x", max_frames=12)
    eng.cancel(seqs[0])  # both commands run in one pass: the job is abandoned before it runs
    eng.run_until_idle()
    assert sinks[0].results[-1].reason is FinishReason.CANCELLED
    eng.submit(seqs[0], "Round 1, session 0.", turn_id="1", max_frames=12)
    eng.run_until_idle()
    assert torch.equal(sinks[0].results[-1].codes, want[1])  # session 0's round-1 codes


def test_a_codec_tick_slower_than_its_audio_is_counted_and_logged(caplog, monkeypatch) -> None:
    """A tick that takes longer than the audio its longest stream gains lets every stream
    fall behind realtime: counted in the stats (/metrics) and logged with its cause's usual
    suspects, at most once per SLOW_LOG_S; a tick faster than its audio is not."""
    import logging
    import time
    from types import SimpleNamespace

    from engine.codec import CodecConfig, dummy_codec
    from engine.codec.layers import CodecOps
    from engine.codec_worker import CodecWorker
    from engine.scheduler import new_stats

    stats = new_stats()
    worker = CodecWorker(dummy_codec(CodecConfig.preset("tiny"), seed=0), CodecOps(), None,
                         n_rows=2, graphed=False, max_frames=64, stats=stats)
    real = worker.decoder.decode
    delay = {"s": 0.0}

    def decode(chunks):  # the real decode, then the stall under test
        out = real(chunks)
        time.sleep(delay["s"])
        return out

    monkeypatch.setattr(worker.decoder, "decode", decode)
    monkeypatch.setattr(CodecWorker, "SLOW_TICK_MIN_S", 0.5)  # a busy CI machine's fast tick
    turns = [SimpleNamespace(codec_stream=None) for _ in range(2)]
    codes = torch.randint(0, 1024, (10, 2))  # 2 frames: ~93 ms of audio at 44.1 kHz
    work = [(None, t, codes[:, : 1 + i]) for i, t in enumerate(turns)]
    with caplog.at_level(logging.WARNING, logger="engine.codec_worker"):
        pcm = worker.decode(work)  # fast: a few ms for 2 frames of the tiny codec
        assert [len(p) for p in pcm] == [worker.decoder.frame_length * n for n in (1, 2)]
        assert stats["codec_slow_ticks"] == 0 and not caplog.records
        delay["s"] = 2 * worker.frame_s + CodecWorker.SLOW_TICK_MIN_S
        worker.decode(work)
        worker.decode(work)
    assert stats["codec_slow_ticks"] == 2 and stats["codec_ticks"] == 3
    assert len(caplog.records) == 1  # once per SLOW_LOG_S
    msg = caplog.records[0].getMessage()
    assert "2 streams (up to 2 frames each)" in msg and "falling behind realtime" in msg
    assert "rtvoice_engine_codec_slow_ticks_total" in msg


def test_a_turn_prefilled_ahead_speaks_as_it_would_without(tiny_bundle):
    """The head of a turn prefilled while its text streams (Engine.prefill_ahead) leaves the
    cache as one prefill of the whole prompt would: the same frames, greedy and sampled; a
    head the turn does not begin with is rolled back."""
    text = "Hello there, how are you doing today?"

    def run(heads, params):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=1024))
        sink = CollectingSink()
        seq = eng.open([], params, sink)
        eng.submit(seq, "First.", turn_id="a", max_frames=6)  # the heads then close it
        eng.run_until_idle()
        for h in heads:
            eng.prefill_ahead(seq, h)
            eng.run_until_idle()
        eng.submit(seq, text, turn_id="b", max_frames=10)
        eng.run_until_idle()
        return sink.results[-1].codes, eng.stats

    for params in (SamplingParams.greedy(), SamplingParams(seed=3)):
        plain, st = run([], params)
        assert st["ahead_jobs"] == 0
        ahead, st = run(["Hello there,", "Hello there, how are you"], params)
        assert st["ahead_jobs"] == 2 and st["ahead_hits"] == 1 and st["ahead_misses"] == 0
        assert torch.equal(plain, ahead)
        missed, st = run(["Goodbye my friend, see"], params)
        assert st["ahead_misses"] == 1 and torch.equal(plain, missed)


def test_prefill_ahead_jobs_go_after_the_others_unless_a_turn_waits(tiny_bundle):
    """A prefill round takes turn and voice-prompt jobs before speculative ahead jobs; an
    ahead job its turn waits for (urgent) is no longer put last."""
    from engine.request import Turn

    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=512, prefill_batch=1))
    sinks = [CollectingSink(), CollectingSink()]
    a, b = (eng.open([], SamplingParams.greedy(), s) for s in sinks)
    eng.run_until_idle()
    sched, worker = eng.scheduler, eng.prefill_worker
    sched.prefill_ahead(a, "A head that streams in")
    sched.start_turn(b, Turn("t", "Hello.", 3))
    ahead, turn = sched.take_prefill_jobs()
    assert ahead.ahead and not turn.ahead
    assert worker.round([ahead, turn]) == [turn] and ahead.done == 0
    sched.start_turn(a, Turn("u", "A head that streams in, and ends.", 3))  # waits for it
    assert ahead.urgent
    # the same columns again (the scheduler never made this one: it only rewrites them)
    other = ahead.__class__(b, turn.cols, turn.start, turn.turn, turn.blocks)
    assert worker.round([other, ahead]) == [other]  # FIFO again between the two
    assert worker.round([ahead]) == [ahead]
    for job in (turn, ahead):
        sched.prefill_done(job)
    eng.run_until_idle()
    assert sinks[0].results[-1].turn_id == "u" and sched.stats["ahead_hits"] == 1
