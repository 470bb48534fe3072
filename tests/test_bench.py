"""bench_latency: pure statistics on synthetic data with known answers, then the CLI against a
real server (tiny model) at c=1 and c=4, the regression gate, and the in-process mode."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from bench_latency import cli, stats
from rtvoice.segmenter import Segmenter

# ============================================================================ percentiles


def test_percentile_matches_linear_interpolation() -> None:
    xs = list(range(1, 101))  # 1..100
    assert stats.percentile(xs, 0) == 1
    assert stats.percentile(xs, 100) == 100
    assert stats.percentile(xs, 50) == pytest.approx(50.5)
    assert stats.percentile(xs, 90) == pytest.approx(90.1)
    assert stats.percentile(xs, 99) == pytest.approx(99.01)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([3, 1, 2], 50) == 2  # order does not matter
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_summarize_skips_missing_values() -> None:
    s = stats.summarize([10.0, None, 30.0, 20.0, float("nan")])
    assert s == {"n": 3, "mean": 20.0, "min": 10.0, "p50": 20.0, "p90": 28.0, "p99": 29.8,
                 "max": 30.0}
    empty = stats.summarize([None])
    assert empty["n"] == 0 and empty["p50"] is None and empty["max"] is None


def test_gaps() -> None:
    assert stats.gaps([0.0, 0.1, 0.35]) == pytest.approx([0.1, 0.25])
    assert stats.gaps([1.0]) == []


# ============================================================================ playback simulation


def _steady(n: int, every: float, dur: float, start: float = 0.0) -> list[tuple[float, float]]:
    return [(start + i * every, dur) for i in range(n)]


def test_on_time_stream_never_starves() -> None:
    # Chunks of 0.1 s arriving every 0.1 s: each arrives exactly when the previous one ends.
    r = stats.simulate_playback(_steady(20, 0.1, 0.1), jitter_buffer_s=0.0)
    assert r.underruns == 0 and r.stall_s == 0.0
    assert r.start_s == 0.0 and r.end_s == pytest.approx(2.0) and r.audio_s == pytest.approx(2.0)


def test_faster_than_realtime_stream_never_starves() -> None:
    r = stats.simulate_playback(_steady(50, 0.02, 0.1), jitter_buffer_s=0.0)
    assert r.underruns == 0


def test_one_late_chunk_is_one_underrun_with_known_stall() -> None:
    # 0.1 s chunks at t=0, 0.1, then the third is 0.3 s late (arrives at 0.5, needed at 0.25
    # given a 50 ms buffer): one underrun; playback resumes 50 ms after it arrives.
    chunks = [(0.0, 0.1), (0.1, 0.1), (0.5, 0.1), (0.55, 0.1)]
    r = stats.simulate_playback(chunks, jitter_buffer_s=0.05)
    assert r.underruns == 1
    assert len(r.stalls) == 1 and r.stalls[0] == pytest.approx((0.25, 0.3))
    assert r.stall_s == pytest.approx(0.3)
    assert r.end_s == pytest.approx(0.55 + 0.2)  # resumed at 0.55, two chunks left


def test_a_large_enough_jitter_buffer_absorbs_the_gap() -> None:
    chunks = [(0.0, 0.1), (0.1, 0.1), (0.5, 0.1), (0.55, 0.1)]
    assert stats.simulate_playback(chunks, jitter_buffer_s=0.3).underruns == 0  # on time
    assert stats.simulate_playback(chunks, jitter_buffer_s=0.29).underruns == 1


def test_slow_stream_starves_repeatedly() -> None:
    # Generation at half realtime: 0.1 s of audio every 0.2 s. With no buffer, every chunk
    # after the first is late by 0.1 s: 9 underruns for 10 chunks.
    r = stats.simulate_playback(_steady(10, 0.2, 0.1), jitter_buffer_s=0.0)
    assert r.underruns == 9
    assert r.stall_s == pytest.approx(0.9)
    # A buffer of 0.15 s re-buffers after each stall; stalls happen every other chunk then.
    r2 = stats.simulate_playback(_steady(10, 0.2, 0.1), jitter_buffer_s=0.15)
    assert 0 < r2.underruns < 9


def test_playback_edge_cases() -> None:
    assert stats.simulate_playback([], 0.1) == stats.PlaybackResult(0, 0.0, None, None, 0.0)
    single = stats.simulate_playback([(1.0, 0.5)], 0.2)
    assert single.underruns == 0 and single.start_s == 1.2 and single.end_s == pytest.approx(1.7)
    with pytest.raises(ValueError):
        stats.simulate_playback([(0.0, 0.1)], -0.1)


# ============================================================================ gate


def test_gate_passes_against_itself_and_within_tolerance() -> None:
    base = {1: 100.0, 16: 80.0, 64: 50.0}
    assert stats.gate_compare(base, base, 0.05).passed
    assert stats.gate_compare({1: 95.5, 16: 76.1, 64: 47.6}, base, 0.05).passed  # -4.5 %..-4.8 %


def test_gate_fails_against_a_faster_baseline() -> None:
    current = {1: 100.0, 4: 90.0}
    faster = {c: v * 1.2 for c, v in current.items()}
    g = stats.gate_compare(current, faster, 0.05)
    assert not g.passed
    assert all(not r.ok and r.ratio == pytest.approx(1 / 1.2) for r in g.rows)
    assert "REGRESSION" in g.describe()
    # One level regressing is enough to fail.
    assert not stats.gate_compare({1: 100.0, 4: 80.0}, {1: 100.0, 4: 90.0}, 0.05).passed


def test_gate_missing_levels_and_failed_levels() -> None:
    g = stats.gate_compare({1: 100.0}, {1: 100.0, 64: 10.0}, 0.05)
    assert g.passed and g.missing == (64,)  # a quick run may measure fewer levels
    assert not stats.gate_compare({1: None}, {1: 100.0}, 0.05).passed  # every turn failed
    assert not stats.gate_compare({4: 100.0}, {1: 100.0}, 0.05).passed  # nothing compared


# ============================================================================ CLI helpers


def test_builtin_texts_are_multilingual_and_levels_parse() -> None:
    assert len(cli.BUILTIN_TEXTS) >= 8
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in t) for t in cli.BUILTIN_TEXTS)
    assert any(any("\u0600" <= ch <= "\u06ff" for ch in t) for t in cli.BUILTIN_TEXTS)
    args = cli.build_parser().parse_args(["--url", "x", "--concurrency", "1,4,16,64"])
    assert args.concurrency == [1, 4, 16, 64]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--url", "x", "--concurrency", "0,2"])


def test_texts_file(tmp_path: Path) -> None:
    f = tmp_path / "texts.txt"
    f.write_text("# comment\nFirst.\n\nSecond one.\n", encoding="utf-8")
    assert cli.load_texts(str(f)) == ["First.", "Second one."]


def test_progress_bar_plain_log(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    buf = io.StringIO()
    p = cli.Progress(stream=buf)
    p.start("c=2", total=4)
    for _ in range(4):
        p.step()
    p.finish()
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("c=2: 0%") and lines[-1].startswith("c=2: 100%")


# ============================================================================ against a server

LEVEL_FIGURES = {
    "first_audio_after_first_text_ms": ("p50", "p90", "p99", "max"),
    "server_ttfa_ms": ("p50", "p90", "p99", "max"),
    "decode_tps": ("p50", "mean"),
    "rtf": ("p50", "p90", "max"),
    "gap_ms": ("p50", "p90", "p99", "max"),
}


@pytest.fixture(scope="module")
def server_url():
    testing = pytest.importorskip("rtvoice.testing")
    with testing.running_server() as url:
        yield url


@pytest.fixture(scope="module")
def bench_run(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bench")
    paths = {"json": d / "bench.json", "plot": d / "bench.png", "baseline": d / "baseline.json"}
    out: list[str] = []
    rc = cli.main([
        "--url", server_url, "--concurrency", "1,4", "--turns", "2", "--warmup-turns", "1",
        "--max-frames", "10", "--tokens-per-s", "300", "--jitter-ms", "100", "--no-progress",
        "--json", str(paths["json"]), "--plot", str(paths["plot"]),
        "--save-baseline", str(paths["baseline"]),
    ], out=out.append)
    assert rc == 0, out
    paths["table"] = d / "table.txt"
    paths["table"].write_text("\n".join(out))
    return paths


def _sentences(text: str) -> int:
    seg = Segmenter()
    return len(seg.push(text) + seg.flush())


def test_bench_json_has_every_figure(bench_run: dict[str, Path]) -> None:
    res = json.loads(bench_run["json"].read_text())
    assert res["schema"] == cli.SCHEMA
    st = res["settings"]
    assert st["concurrency"] == [1, 4] and st["turns"] == 2 and st["max_frames"] == 10
    assert res["server"]["mode"] == "websocket"
    ready = res["server"]["ready"]
    assert ready["sample_rate"] > 0 and ready["model"] and "limits" in ready
    assert "commit" in res["git"] and res["machine"]["cpu_count"] >= 1
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        c = lv["concurrency"]
        t = lv["turns"]
        assert t["total"] == 2 * c and t["errors"] == 0 and t["ok"] == 2 * c
        assert t["truncated"] + t["eos"] == t["ok"]
        for key, qs in LEVEL_FIGURES.items():
            for q in qs:
                assert isinstance(lv[key][q], float) and lv[key][q] >= 0, (c, key, q)
        # client TTFA counts the turns whose audio came after their flush; the others are
        # counted apart (never as 0 ms)
        assert lv["client_ttfa_ms"]["n"] + t["audio_before_flush"] == 2 * c
        assert lv["client_ttfa_ms"]["n"] == 0 or lv["client_ttfa_ms"]["min"] >= 0
        assert lv["aggregate_fps"] > 0 and lv["frames"] > 0 and lv["audio_s"] > 0
        u = lv["underruns"]
        assert u["jitter_buffer_ms"] == 100 and len(u["per_stream"]) == c
        assert u["total"] == sum(u["per_stream"])
        by = u["by_segments"]  # the builtin texts 0 and 11 have two sentences, the rest one
        assert sum(n for n, _ in by.values()) == 2 * c and sum(x for _, x in by.values()) == u["total"]
        assert set(by) <= {"1", "2"} and by["1"][0] > 0
        assert by.get("2", [0])[0] == sum(_sentences(cli.pick_text(cli.BUILTIN_TEXTS, i, k)) == 2
                                          for i in range(c) for k in range(2))
        assert lv["open"]["failed"] == 0 and lv["open"]["prefill_ms"]["n"] == c
        # The per-turn records back every figure: underruns recomputed from the chunk
        # timelines agree, and no turn exceeded its frame budget.
        recs = lv["records"]
        assert len(recs) == 2 * c
        assert {r["session"] for r in recs} == set(range(c))
        for r in recs:
            assert r["segments"] >= 1 and r["frames"] <= 10 * r["segments"]
            assert r["chunks"] and r["first_audio_after_first_text_ms"] > 0
            assert (r["client_ttfa_ms"] is None) == r["audio_before_flush"]
            if r["audio_before_flush"]:
                assert r["first_audio_s"] < r["flush_s"]
            else:
                assert r["client_ttfa_ms"] == pytest.approx(
                    1000 * (r["first_audio_s"] - r["flush_s"]), abs=1e-6)
            play = stats.simulate_playback([tuple(x) for x in r["chunks"]], 0.1)
            assert play.underruns == r["underruns"]
        assert u["total"] == sum(r["underruns"] for r in recs)
        assert lv["frames"] == sum(r["frames"] for r in recs)
    assert bench_run["plot"].stat().st_size > 10_000
    table = bench_run["table"].read_text()
    assert "client TTFA" in table and len(table.splitlines()) == 4


def test_bench_gate_against_itself_and_a_faster_baseline(bench_run: dict[str, Path],
                                                        tmp_path: Path) -> None:
    base = json.loads(bench_run["baseline"].read_text())
    assert base["schema"] == cli.BASELINE_SCHEMA and set(base["decode_tps"]) == {"1", "4"}
    assert all(v > 0 for v in base["decode_tps"].values())
    out: list[str] = []
    args = ["--from-json", str(bench_run["json"]), "--quiet"]
    assert cli.main([*args, "--baseline", str(bench_run["baseline"])], out=out.append) == 0
    assert "PASS" in out[-1]
    # A full results file works as a baseline too.
    assert cli.main([*args, "--baseline", str(bench_run["json"])], out=out.append) == 0
    faster = dict(base, decode_tps={k: v * 1.2 for k, v in base["decode_tps"].items()})
    f = tmp_path / "faster.json"
    f.write_text(json.dumps(faster))
    out.clear()
    assert cli.main([*args, "--baseline", str(f), "--tolerance", "0.05"], out=out.append) == 1
    assert "FAIL" in out[-1]
    # A 20 % drop is still inside a 25 % tolerance.
    assert cli.main([*args, "--baseline", str(f), "--tolerance", "0.25"], out=out.append) == 0


def test_send_text_whole_leaves_nothing_to_prefill_ahead(server_url: str) -> None:
    """--send-text whole: the paced tokens reach the server as one text event (same flush
    time), so its engine prefills no turn head ahead; streamed, it does."""
    stats = server_url.app.state.runtime.engine.stats  # type: ignore[attr-defined]
    texts = ["Your table for two is booked at eight tonight, see you then."]

    def run(mode: str) -> None:
        out: list[str] = []
        f = Path(tempfile.mkdtemp()) / "texts.txt"
        f.write_text("\n".join(texts))
        assert cli.main(["--url", server_url, "--concurrency", "1", "--turns", "1",
                         "--warmup-turns", "0", "--max-frames", "4", "--tokens-per-s", "200",
                         "--texts", str(f), "--send-text", mode, "--no-progress", "--quiet"],
                        out=out.append) == 0, out

    jobs = stats["ahead_jobs"]
    run("whole")
    assert stats["ahead_jobs"] == jobs
    run("stream")
    assert stats["ahead_jobs"] > jobs and stats["ahead_hits"] >= 1


def test_bench_in_process(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out: list[str] = []
    f = tmp_path / "inproc.json"
    rc = cli.main(["--in-process", "--concurrency", "2", "--turns", "1", "--warmup-turns", "0",
                   "--max-frames", "6", "--tokens-per-s", "0", "--no-progress",
                   "--json", str(f)], out=out.append)
    assert rc == 0, out
    lv = json.loads(f.read_text())["levels"][0]
    assert lv["turns"]["ok"] == 2 and 0 < lv["frames"] <= 12
    assert lv["server_ttfa_ms"]["p50"] is not None and not math.isnan(lv["aggregate_fps"])
    assert 0 < lv["server_prefill_ms"]["p50"] < lv["server_ttfa_ms"]["p50"]


# ============================================================================ capacity search
def _level(c: int, p99: float, underruns: int = 0, errors: int = 0) -> dict:
    return {"concurrency": c, "turns": {"ok": c - errors, "errors": errors, "total": c,
                                        "error_codes": ["overloaded"] if errors else []},
            "server_ttfa_ms": {"p99": p99}, "client_ttfa_ms": {"p99": p99 + 5},
            "underruns": {"total": underruns}}


@pytest.mark.parametrize("limit,start,resolution,want", [
    (100, 1, 1, 100), (100, 16, 4, (96, 100)), (1, 1, 1, 1), (0, 1, 1, 0), (5000, 8, 1, 1024),
])
def test_capacity_search_finds_the_largest_passing_level(limit, start, resolution, want) -> None:
    """A fake server whose TTFA p99 exceeds the bound past `limit` streams: the search
    doubles, then bisects to within the resolution, and never reports a failing level."""
    import asyncio

    from bench_latency.capacity import Criteria, search

    async def probe(c: int) -> dict:
        return _level(c, 100.0 if c <= limit else 400.0)

    found, levels = asyncio.run(search(probe, Criteria(300.0), start=start, max_c=1024,
                                       resolution=resolution))
    lo, hi = want if isinstance(want, tuple) else (want, want)
    assert lo <= found.capacity <= hi and found.capacity <= limit
    assert all(p["passed"] == (p["concurrency"] <= limit) for p in found.probes)
    assert len(levels) == len(found.probes) <= 2 * 11  # doubling + bisection, no more
    if limit < 1024:
        assert found.first_failure is not None and found.first_failure > found.capacity
        assert found.first_failure - found.capacity <= max(resolution, 1) or found.capacity == 0


def test_capacity_verdict_counts_underruns_errors_and_falls_back_to_client_ttfa() -> None:
    from bench_latency.capacity import Criteria

    crit = Criteria(300.0)
    assert crit.verdict(_level(4, 250.0))[0]
    assert "underruns" in crit.verdict(_level(4, 250.0, underruns=1))[1]
    assert "failed" in crit.verdict(_level(4, 250.0, errors=1))[1]
    lv = _level(4, 250.0)
    lv["server_ttfa_ms"]["p99"] = None  # a server that reports none: the client's is used
    ok, why = crit.verdict(lv)
    assert ok and why.startswith("client TTFA p99 255")


def test_bench_capacity_and_poisson_arrivals_in_process(tmp_path: Path) -> None:
    """The real search against the in-process engine (tiny model): every probe is a level
    in the JSON, the answer passes and the first failure (if any) fails; Poisson arrivals
    stagger the turns' starts."""
    pytest.importorskip("torch")
    out: list[str] = []
    f = tmp_path / "cap.json"
    rc = cli.main(["--in-process", "--capacity", "--concurrency", "1", "--capacity-max", "4",
                   "--capacity-ttfa-ms", "5000", "--turns", "1", "--warmup-turns", "0",
                   "--max-frames", "6", "--tokens-per-s", "0", "--no-progress",
                   "--arrivals", "poisson", "--mean-gap-s", "0.05", "--jitter-ms", "10000",
                   "--json", str(f)],
                  out=out.append)
    assert rc == 0, out
    res = json.loads(f.read_text())
    cap = res["capacity"]
    assert cap["capacity"] == 4 and cap["first_failure"] is None  # a loose bound: all pass
    assert [p["concurrency"] for p in cap["probes"]] == [1, 2, 4]
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2, 4]
    assert any(line.startswith("capacity: 4 concurrent streams") for line in out)
    starts = [r["start_s"] for r in res["levels"][-1]["records"]]
    assert len(set(round(s, 4) for s in starts)) == 4  # no lockstep: each waited its own gap
    with pytest.raises(SystemExit):
        cli.main(["--in-process", "--capacity", "--concurrency", "8", "--capacity-max", "4"])


def test_engine_sweep_wait_gives_up_on_a_stalled_device() -> None:
    """The in-process sweep stops waiting (DeviceStalled, naming the level) as soon as the
    engine's watchdog reports the GPU stuck, instead of sitting out its hour-long limit; a
    plain slow wait still ends in TimeoutError."""
    import threading
    import time

    from bench_latency.engine_throughput import DeviceStalled, _wait

    class FakeEngine:
        def __init__(self, stalled: bool) -> None:
            self._stalled = stalled

        def stalled(self) -> bool:
            return self._stalled

        def device_wait_s(self) -> float:
            return 12.0 if self._stalled else 0.0

    t0 = time.perf_counter()
    with pytest.raises(DeviceStalled, match="c=64"):
        _wait(FakeEngine(True), threading.Event(), "turn", 64, 3600)  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 5
    with pytest.raises(TimeoutError, match="did not finish"):
        _wait(FakeEngine(False), threading.Event(), "turn", 1, 0.6)  # type: ignore[arg-type]
    done = threading.Event()
    done.set()
    _wait(FakeEngine(True), done, "turn", 1, 1)  # type: ignore[arg-type]  # done wins


def test_engine_sweep_reports_one_row_per_level(tiny_bundle):
    """bench_latency.engine_throughput.sweep: fixed-length turns (EOS masked), one row per
    level with the latency split (submit -> prefilled -> first audio) and the codec share;
    `config` overrides the mode's engine settings."""
    from bench_latency.engine_throughput import sweep

    rows = sweep(tiny_bundle, [1, 2], 6, config=dict(first_chunk_frames=1, max_len=512))
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["frames"] == 6 * r["concurrency"]  # every turn ran to exactly 6 frames
        assert r["aggregate_fps"] > 0 and r["decode_tps_p50"] > 0
        assert r["submit_to_audio_ms_p50"] >= r["turn_prefill_ms_p50"] >= 0
        assert 0 < r["codec_share"] <= 1
        assert r["config"] == {"first_chunk_frames": 1, "max_len": 512}
    # with a cloned voice: the turns start past the voice prompt
    row, = sweep(tiny_bundle, [2], 6, ref_frames=40, config=dict(max_len=512))
    assert row["frames"] == 12 and row["voice_prompt_frames"] == 40
    assert row["prompt_positions"] >= rows[1]["prompt_positions"] + 40


_NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if it were not installed: `import matplotlib` fails
from bench_latency.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_bench_without_matplotlib_warns_first_and_keeps_its_exit_codes(tmp_path: Path) -> None:
    """--plot without matplotlib: a warning before the sweep, the JSON written, a hint
    instead of the plot, and exit 0 (1 stays for a failed gate only)."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    f, png, base = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "base.json"

    def bench(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, *argv], cwd=root,
                              capture_output=True, text=True, timeout=600)

    p = bench("--in-process", "--concurrency", "1", "--turns", "1", "--warmup-turns", "0",
              "--max-frames", "2", "--tokens-per-s", "0", "--json", str(f), "--plot", str(png),
              "--save-baseline", str(base))
    assert p.returncode == 0, p.stderr
    err = p.stderr
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert err.index("--plot needs matplotlib") < err.index("c=1")  # warned before the sweep
    assert "no plot written" in err and f"--from-json {f}" in err
    assert json.loads(f.read_text())["levels"][0]["turns"]["ok"] == 1 and not png.exists()
    # A failed gate is still exit 1, a passed one 0, with or without matplotlib.
    faster = json.loads(base.read_text())
    faster["decode_tps"] = {k: v * 10 for k, v in faster["decode_tps"].items()}
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(faster))
    again = ("--from-json", str(f), "--plot", str(png), "--quiet")
    assert bench(*again, "--baseline", str(fast)).returncode == 1
    assert bench(*again, "--baseline", str(base)).returncode == 0


def test_bench_refuses_an_output_folder_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--in-process", "--json", str(tmp_path / "nope" / "r.json")])
    assert e.value.code == 2


def test_gpu_bench_summarises_a_step_report(tmp_path):
    """`scripts/gpu_bench.py --summarise-step` (gpu_all.sh's STEP_TABLES A/B): a finished
    report's step profiles cut to their figures and top kernels, one line per run on stderr;
    no CUDA needed; a missing report is named (exit 1)."""
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "scripts" / "gpu_bench.py"
    row = {"graph_ms_per_step": 4.09, "graph_frames_per_s": 244.5, "kernels_per_step": 514,
           "eager_kernel_ms_by_category": {"attention": 0.5},
           "top_kernels_ms": [[2.0, 151, "k" * 200]] * 10, "per_launch_us": [1.0] * 500}
    report = {"device": "NVIDIA H200", "profile": {"1": row, "2": {**row, "kernels_per_step": 513}},
              "profile_attend": {"1": row}, "engine": {"pingpong_nocodec": []}}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(report))
    r = subprocess.run([sys.executable, str(script), "--summarise-step", str(path),
                        "--label", "new fp8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["label"] == "new fp8" and set(out) == {"label", "profile", "profile_attend"}
    one = out["profile"]["1"]
    assert one["graph_ms_per_step"] == 4.09 and one["kernels_per_step"] == 514
    assert "per_launch_us" not in one and len(one["top_kernels_ms"]) == 8
    assert all(len(k) == 90 for _, _, k in one["top_kernels_ms"])
    assert "new fp8: profile B1 4.09 ms 514 kernels B2 4.09 ms 513 kernels" in r.stderr
    r = subprocess.run([sys.executable, str(script), "--summarise-step",
                        str(tmp_path / "missing.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "no readable report" in r.stderr
