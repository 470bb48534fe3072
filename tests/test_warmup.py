"""Fast start: the graphs light traffic needs before the engine is ready, the rest captured
in the background while it serves (engine/warmup.py), and what /ready and /metrics say
meanwhile. The captures themselves need CUDA (tests/test_cuda.py); here the scheduling of
the work, the prefill plan over a partly captured set, and the service's reports."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from engine.config import EngineConfig
from engine.engine import _CAPTURE_LEAD_S, _first, build_engine
from engine.warmup import BackgroundCapture
from rtvoice.testing import running_server
from tests.test_engine import _EagerGraph, greedy_turns, install_eager_graphs


def _family(log: list, gate: threading.Event | None = None, fail_at: int | None = None):
    def capture(keys, stop, captured):
        for i, key in enumerate(keys):
            if stop():
                return
            if gate is not None:
                gate.wait(10)
            if fail_at == i:
                raise RuntimeError("out of memory")
            log.append(key)
            captured(key)
    return capture


def test_background_capture_runs_each_family_and_reports_progress():
    gate = threading.Event()
    got: list = []
    bc = BackgroundCapture()
    bc.add("prefill", [(2, 8, 256), (4, 8, 256)], _family(got, gate))
    bc.add("codec", [(8, 1), (8, 2), (16, 1)], _family(got))
    bc.add("empty", [], _family(got))  # nothing deferred: no family
    assert [f.name for f in bc.families] == ["prefill", "codec"]
    assert bc.pending == 5 and not bc.started
    assert not bc.wait(0)  # pending, and nothing captures them yet
    bc.start()
    time.sleep(0.05)
    assert bc.status() == {"prefill": {"captured": 0, "total": 2},
                           "codec": {"captured": 0, "total": 3}}
    gate.set()
    assert bc.wait(10)
    assert bc.status() == {} and bc.pending == 0
    assert got == [(2, 8, 256), (4, 8, 256), (8, 1), (8, 2), (16, 1)]  # in order, once
    bc.start()
    bc.run()
    assert len(got) == 5


def test_a_failed_family_is_reported_and_the_others_still_run():
    got: list = []
    bc = BackgroundCapture()
    bc.add("prefill", [1, 2, 3], _family(got, fail_at=1))
    bc.add("codec", [7], _family(got))
    bc.run()  # on this thread
    assert got == [1, 7]
    status = bc.status()
    assert status == {"prefill": {"captured": 1, "total": 3,
                                  "error": "RuntimeError: out of memory"}}
    assert bc.pending == 2 and bc.wait(0)


def test_stop_ends_the_capture_after_the_current_graph():
    gate = threading.Event()
    got: list = []
    bc = BackgroundCapture()
    bc.add("codec", list(range(10)), _family(got, gate))
    bc.start()
    threading.Timer(0.1, gate.set).start()
    bc.stop()  # set before the gate opens: at most the graph in hand is captured
    assert bc.wait(5) and len(got) <= 1 and bc.pending >= 9


def test_first_splits_keys_by_rows():
    keys = [(1, 8, 256), (2, 8, 256), (4, 64, 512), (8, 8, 256), (16, 1)]
    assert _first(keys, 4) == ([(1, 8, 256), (2, 8, 256), (4, 64, 512)], [(8, 8, 256), (16, 1)])
    assert _first(keys, 0) == (keys, [])  # 0: everything before ready


def test_prefill_plan_over_a_partly_captured_set_matches_eager(tiny_bundle):
    """While the bigger prefill graphs are still being captured, a burst runs in groups of
    the largest captured row count (the rest eager) and gives eager prefill's codes."""
    texts = ["Hello there.", "Five.", "A somewhat longer sentence for the third voice.", "Six!",
             "Seven.", "Eight, nine.", "Ten!", "Eleven, twelve."]

    def run(rows: int | None):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False,
                                                     prefill_chunk=32, prefix_cache=0))
        pg = eng.prefill_worker.graphs
        if rows is not None:
            first, rest = _first(pg.keys(), rows)
            assert rest  # some buckets are left to the background
            install_eager_graphs(eng, first)
        return greedy_turns(eng, texts, 8), pg

    want, _ = run(None)
    _EagerGraph.replays.clear()
    got, pg = run(2)
    assert set(_EagerGraph.replays) <= {1, 2} and _EagerGraph.replays.get(2, 0) >= 4
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # a group of 8 short chunks at (8, 8, 256) is not captured: four replays of two
    chunks = [(i, torch.zeros(11, 5, dtype=torch.long), 10) for i in range(8)]
    plan, eager = pg.plan(chunks)
    assert not eager and [(k, len(c)) for k, c in plan] == [((2, 8, 256), 2)] * 4
    # no graph at all for a bucket: eager
    pg.graphs = {k: v for k, v in pg.graphs.items() if k[1] != 8}
    plan, eager = pg.plan(chunks[:3])
    assert plan == [] and len(eager) == 3


def test_ready_reports_graphs_warming_in_the_background():
    """A server still capturing graphs is ready (it serves, those buckets eagerly) and says
    what is warming on /ready and /metrics; once done, neither mentions it."""
    with running_server(max_turn_frames=4) as url:
        rt = url.app.state.runtime
        gate = threading.Event()
        bc = BackgroundCapture()
        bc.add("codec", [(8, 1), (8, 2)], _family([], gate))
        rt.engine.warmup = bc
        bc.start()
        try:
            r = httpx.get(f"{url}/ready", timeout=10)
            assert r.status_code == 200
            body = r.json()
            assert body["warming"] == {"codec": {"captured": 0, "total": 2}}
            phases = body["startup_s"]
            assert phases["ready_s"] >= phases["load_s"] + phases["ops_s"]
            assert min(phases.values()) >= 0
            m = httpx.get(f"{url}/metrics", timeout=10).text
            assert "rtvoice_engine_graphs_warming 2" in m
        finally:
            gate.set()
        assert bc.wait(10)
        body = httpx.get(f"{url}/ready", timeout=10).json()
        assert "warming" not in body
        assert "rtvoice_engine_graphs_warming 0" in httpx.get(f"{url}/metrics",
                                                              timeout=10).text


class _FakeCodecGraph:
    """Stands in for a captured codec pass on a CPU: replay runs the same static pass on
    the same input buffers into the same output buffer, as the CUDA graph does."""

    def __init__(self, dec, inp, out, log):
        self.dec, self.inp, self.out, self.log = dec, inp, out, log

    def replay(self):
        self.log.append(tuple(self.inp["codes"].shape[::2]))
        self.out.copy_(self.dec._static_pass(self.inp))


def test_codec_ticks_use_the_captured_stream_buckets_while_the_rest_warm():
    """With only the one-stream graphs in, a tick of three streams runs as three one-stream
    replays (not one eager pass of four) and gives the eager decoder's audio; with a larger
    bucket in, as one padded replay of it."""
    from engine.codec import STREAM_ATOL, CodecConfig, StreamingDecoder, dummy_codec

    codec = dummy_codec(CodecConfig.preset("tiny"), seed=0)
    g = torch.Generator().manual_seed(3)
    codes = [torch.cat([torch.randint(0, 4096, (1, 6), generator=g),
                        torch.randint(0, 1024, (9, 6), generator=g)]) for _ in range(3)]

    def run(graphs: set[int] | None):
        dec = StreamingDecoder(codec, max_streams=4, buckets=True, max_frames=16)
        log: list = []
        for b, n in dec.bucket_keys():
            if graphs is not None and b in graphs:
                inp = dec._inputs(b, n)
                out = dec._static_pass(inp).clone()
                dec._passes[(b, n)] = (_FakeCodecGraph(dec, inp, out, log), inp, out)
        sids = [dec.open() for _ in codes]
        parts = [[] for _ in codes]
        for at in (0, 2, 3):  # chunks of 2, 1 and 3 frames
            n = {0: 2, 2: 1, 3: 3}[at]
            got = dec.decode({sid: c[:, at: at + n] for sid, c in zip(sids, codes)})
            for p, sid in zip(parts, sids):
                p.append(got[sid])
        return [torch.cat(p) for p in parts], log, dec

    want, _, _ = run(None)
    got, log, dec = run({1})
    assert dec._group_streams(3) == 1
    assert log and {b for b, _ in log} == {1}  # every pass a one-stream replay
    for a, b in zip(want, got):
        assert float((a - b).abs().max()) <= STREAM_ATOL
    # the background captures the biggest bucket first: with 1 and 4 in but not 2, two and
    # three streams run as one padded replay of four (cheaper than one-stream replays)
    got, log, dec = run({1, 4})
    assert dec._group_streams(2) == 4 and dec._group_streams(3) == 4
    assert dec._pass_streams(2) == 4 and dec._pass_streams(1) == 1
    assert log and {b for b, _ in log} == {4}  # three streams: every pass a replay of four
    for a, b in zip(want, got):
        assert float((a - b).abs().max()) <= STREAM_ATOL
    _, _, full = run({1, 2, 4})
    assert full._group_streams(2) == 4 and full._group_streams(3) == 4


def test_every_codec_pass_replays_while_the_middle_buckets_warm():
    """Largest first: the top stream bucket's graphs are in before the middle ones; a tick
    whose own bucket is missing runs as one padded replay of a larger captured one (or
    splits over a smaller one), never an eager pass."""
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec

    codec = dummy_codec(CodecConfig.preset("tiny"), seed=0)
    dec = StreamingDecoder(codec, max_streams=4, buckets=True, max_frames=16)
    log: list = []
    for b, n in dec.bucket_keys():
        if b in (1, 4):
            inp = dec._inputs(b, n)
            out = dec._static_pass(inp).clone()
            dec._passes[(b, n)] = (_FakeCodecGraph(dec, inp, out, log), inp, out)
    passes = {"n": 0}
    real = dec._static_pass

    def counted(inp):  # every pass, replayed or eager
        passes["n"] += 1
        return real(inp)

    dec._static_pass = counted
    sids = [dec.open() for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    dec.decode({sid: torch.randint(0, 1024, (10, 2), generator=g) for sid in sids})
    assert [b for b, _ in log] == [4] and passes["n"] == 1  # one padded replay, none eager
    dec._group_streams = lambda n: 1  # split over the one-stream graphs instead
    dec.decode({sid: torch.randint(0, 1024, (10, 2), generator=g) for sid in sids})
    assert [b for b, _ in log] == [4, 1, 1] and passes["n"] == 3


def test_a_started_engine_captures_on_its_own_thread_not_the_serving_loop(tiny_bundle):
    """start() hands the deferred captures to the background thread before any loop runs
    (pingpong or the sync loop): the serving thread never captures."""
    for pingpong in (False, True):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256,
                                                     pingpong=pingpong))
        where: list[str] = []

        def capture(keys, stop, captured, where=where):
            for k in keys:
                where.append(threading.current_thread().name)
                captured(k)

        eng.warmup.add("codec", [(2, 1), (2, 2)], capture)
        eng.start()
        try:
            assert eng.warmed(10)
            assert where == ["rtvoice-capture"] * 2 and not eng.warming()
        finally:
            eng.shutdown()


def test_deferred_decode_graphs_are_captured_by_the_stepping_thread_only_when_quiet(tiny_bundle):
    """The decode family's deferred graphs (a capture sets every decode row inactive for a
    moment) are captured by the thread that launches steps, between two steps, only when
    decoding may pause for it (nothing prefills or waits, every speaking turn far enough
    ahead of playback). Pingpong and the sync loop alike; on the stepping thread itself
    (step() without start()) at once."""
    from engine.engine import CollectingSink
    from engine.sampler import SamplingParams

    for pingpong in (True, False):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256,
                                                     pingpong=pingpong))
        seen: list[tuple[tuple[int, int], str, bool]] = []

        def capture(keys, eng=eng, seen=seen):  # stands in for the CUDA capture
            for k in keys:
                due = eng.scheduler.may_pause(time.perf_counter(), _CAPTURE_LEAD_S)
                seen.append((k, threading.current_thread().name, due))

        eng.decode_worker.capture = capture
        sink = CollectingSink()
        seq = eng.open([], SamplingParams.greedy(), sink)
        eng.submit(seq, "A turn that speaks for a while.", turn_id="t", max_frames=40)
        eng.warmup.add("decode", [(2, 256)], eng._capture_decode_later)
        eng.start()
        try:
            assert sink.done.wait(60)
            assert eng.warmed(30) and not eng.warming()
            assert len(seen) == 1
            key, thread, due = seen[0]
            assert key == (2, 256) and due  # quiet, or every speaking turn far enough ahead
            assert thread == ("rtvoice-decode" if pingpong else "rtvoice-engine")
            assert sink.results[-1].frames > 0
        finally:
            eng.shutdown()

    eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256, pingpong=False))
    got: list = []
    eng.decode_worker.capture = lambda keys: got.extend(keys)
    eng.warmup.add("decode", [(2, 256)], eng._capture_decode_later)
    eng.step()  # not started: the stepping thread captures first, itself
    assert got == [(2, 256)] and not eng.warming()


def test_compiled_ops_start_the_decode_batch_ladder_at_two_rows():
    """With compiled (fused) ops a lone turn decodes in the two-row bucket: the ops are then
    never traced for a batch of exactly one (dynamo specialises size 1), one trace per op
    fewer before ready; reference ops keep the one-row bucket, and a one-row engine too."""
    from types import SimpleNamespace

    from engine.decode_worker import DecodeWorker

    def worker(fused: str, rows: int, one_row: bool = False) -> DecodeWorker:
        runner = SimpleNamespace(device=torch.device("cpu"), n_rows=rows, max_len=256,
                                 attention_kernel=True, out_width=13,
                                 ops=SimpleNamespace(fused=fused))
        return DecodeWorker(runner, None, span_step=256, stats={},  # type: ignore[arg-type]
                            one_row=one_row)

    assert worker("compile", 8).batches == [2, 4, 8]
    assert worker("reference", 8).batches == [1, 2, 4, 8]
    assert worker("compile", 1).batches == [1]
    # EngineConfig.one_row_bucket: the one-row bucket with compiled ops too
    assert worker("compile", 8, one_row=True).batches == [1, 2, 4, 8]
    from engine.config import EngineConfig

    assert EngineConfig().one_row_bucket is False


def test_decoding_may_pause_only_when_no_one_waits_on_it():
    """Scheduler.may_pause: not while a prompt prefills or a turn waits for a row, nor while
    a speaking turn's audio is less than the pause ahead of its playback (or not out yet)."""
    from types import SimpleNamespace

    from engine.scheduler import Scheduler

    s = Scheduler.__new__(Scheduler)  # only the state may_pause reads
    s.frame_rate, s.prefill_outstanding, s.running = 21.5, 0, {}
    s.row_queue, s.block_queue, s._row_ops, s._new_jobs = [], [], [], []
    assert s.may_pause(100.0, 1.5)  # nothing at all
    turn = SimpleNamespace(frames=[0] * 43, first_audio_at=99.0, finished=None)  # 2 s made
    s.running = {0: SimpleNamespace(decoding=turn, draining=False)}
    assert s.may_pause(99.4, 1.5)  # 2.0 s made, 0.4 s played: 1.6 s ahead
    assert not s.may_pause(99.6, 1.5)  # 1.4 s ahead
    turn.first_audio_at = None  # its first chunk still in the codec
    assert not s.may_pause(99.4, 1.5)
    turn.first_audio_at = 99.0
    s.prefill_outstanding = 1  # a prompt prefilling: its TTFA clock runs
    assert not s.may_pause(99.4, 1.5)
    s.prefill_outstanding, s.row_queue = 0, [object()]  # a turn waiting for a row
    assert not s.may_pause(99.4, 1.5)


def test_a_step_with_every_row_set_inactive_leaves_speaking_turns_as_they_were(tiny_bundle):
    """What a deferred capture does to live rows (its eager warm-up step, with every row set
    inactive) changes nothing a speaking turn depends on: sampled turns (seeded, RAS on)
    continue exactly as in an engine that never paused."""
    from engine.engine import CollectingSink
    from engine.sampler import SamplingParams

    def run(pause_at: int | None):
        eng = build_engine(tiny_bundle, EngineConfig(max_running=2, max_len=256,
                                                     pingpong=False))
        sinks = [CollectingSink() for _ in range(2)]
        for i, sink in enumerate(sinks):
            seq = eng.open([], SamplingParams(seed=7 + i), sink)
            eng.submit(seq, f"Turn number {i} speaks a while.", turn_id="t", max_frames=24)
        n = 0
        while eng.step():
            n += 1
            if n == pause_at:
                assert eng.scheduler.running  # mid-turn
                with eng.runner._rows_inactive(None):
                    eng.runner.step(2, eng.decode_worker.spans[0])
        return [s.results[-1].codes for s in sinks]

    for a, b in zip(run(None), run(6)):
        assert torch.equal(a, b)
