"""Pure parts of the service: settings (declared once: CLI, environment and docs derived),
the segmenter, the frame budget, the CLI parser, the bounded outbox. No server needed."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import pytest

from protocol import Done
from rtvoice.outbox import Out as _Out
from rtvoice.outbox import Outbox as _Outbox
from rtvoice.outbox import SlowReader as _SlowReader
from rtvoice.segmenter import Segmenter, estimate_speech_seconds, is_speakable
from rtvoice.session import Session, _Job, encode_backlog_chunks
from rtvoice.settings import Settings
from rtvoice.turns import frame_budget

# ------------------------------------------------------------------------------ settings


def test_settings_defaults_are_production():
    s = Settings()
    assert (s.network.host, s.network.port) == ("127.0.0.1", 8000)
    assert (s.model.model, s.model.device) == ("tiny", "cpu")
    assert s.engine.max_turn_frames == 2048 and s.limits.max_sessions > 0


def test_settings_env_then_overrides(tmp_path):
    env = {
        "RTVOICE_PORT": "9001",
        "RTVOICE_MODEL": "/models/s2-pro",
        "RTVOICE_DEVICE": "cuda",
        "RTVOICE_MAX_TURN_FRAMES": "1_000",
        "RTVOICE_BUDGET_MULTIPLIER": "2.5",
        "RTVOICE_ACCESS_LOG": "yes",
        "RTVOICE_MAX_RUNNING": "auto",
        "RTVOICE_DATA_DIR": str(tmp_path),
        "RTVOICE_NOT_A_SETTING": "1",  # warned about, not fatal
        "OTHER": "ignored",
    }
    s = Settings.from_env(env, port=9002)
    assert s.network.port == 9002  # override beats env
    assert s.model.model == "/models/s2-pro" and s.model.device == "cuda"
    assert s.engine.max_turn_frames == 1000 and s.service.budget_multiplier == 2.5
    assert s.network.access_log is True and s.engine.max_running is None
    assert s.voices.data_dir == Path(tmp_path)
    assert s.as_dict()["network"]["port"] == 9002


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"port": 70000}, "port"),
        ({"max_turn_frames": 0}, "max_turn_frames"),
        ({"budget_multiplier": -1.0}, "budget_multiplier"),
        ({"min_chunk_length": 500, "max_chunk_length": 100}, "min_chunk_length"),
        ({"dtype": "int3"}, "dtype"),
        ({"drain_timeout_s": -1.0}, "drain_timeout_s"),
        ({"max_nesting_depth": 2}, "max_nesting_depth"),
        ({"log_format": "xml"}, "log_format"),
        ({"send_queue_events": 0}, "send_queue_events"),
        ({"codec_hold_s": -0.5}, "codec_hold_s"),
        ({"prefill_first_lead_s": -0.1}, "prefill_first_lead_s"),
        ({"slow_start_x": -1.0}, "slow_start_x"),
        ({"prefill_first_wait_s": float("nan")}, "prefill_first_wait_s"),
    ],
)
def test_settings_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        Settings().replace(**overrides)


def test_engine_settings_are_the_engine_config(tiny_bundle):
    """The server's engine group is the engine's own EngineConfig (declared once): what a
    flag sets is what the engine it builds runs with, device defaults filled in."""
    from engine.config import EngineConfig
    from engine.engine import build_engine

    s = Settings().replace(codec_hold_s=0.25, chunk_frames=6, first_chunk_frames=3,
                           max_running=3, max_len=512, kv_reserve_gib=2.0,
                           prefill_first_lead_s=0.7, prefill_first_wait_s=0.02, slow_start_x=1.5)
    assert isinstance(s.engine, EngineConfig)
    cfg = build_engine(tiny_bundle, s.engine).cfg
    assert (cfg.prefill_first_lead_s, cfg.prefill_first_wait_s) == (0.7, 0.02)
    assert cfg.slow_start_x == 1.5
    assert (cfg.codec_hold_s, cfg.chunk_frames, cfg.first_chunk_frames) == (0.25, 6, 3)
    assert (cfg.max_running, cfg.max_len, cfg.kv_reserve_gib) == (3, 512, 2.0)
    auto = build_engine(tiny_bundle, Settings().engine).cfg  # 'auto': the CPU's defaults
    assert (auto.max_running, auto.max_len) == (8, min(4096, tiny_bundle.model.cfg.slow.max_seq_len))


def _flag_value(name: str):  # type: ignore[no-untyped-def]
    """A valid non-default value of option `name`, as a string and as parsed."""
    from rtvoice.settings import option_type

    default = getattr(next(getattr(Settings(), g) for g in Settings.__dataclass_fields__
                           if hasattr(getattr(Settings(), g), name)), name)
    base, _ = option_type(name)
    special = {"host": ("0.0.0.0", "0.0.0.0"), "model": ("s2-pro", "s2-pro"),
               "device": ("cuda:1", "cuda:1"), "dtype": ("fp16", "fp16"),
               "fused_ops": ("reference", "reference"), "api_keys": ("k1,k2", "k1,k2"),
               "pdl": ("on", "on"),
               "high_priority_streams": ("decode,codec", ("decode", "codec")),
               "data_dir": ("/tmp/rtvoice-x", Path("/tmp/rtvoice-x")),
               "max_chunk_length": ("999", 999), "min_chunk_length": ("11", 11),
               "port": ("9123", 9123), "log_format": ("json", "json"),
               "gpus": ("0,1", "0,1"), "replicas": ("3", 3),
               "fp8_keep": ("layers.0.*,fast_layers.*", ("layers.0.*", "fast_layers.*"))}
    if name in special:
        return special[name]
    if base is bool:
        return ("false", False) if default else ("true", True)
    if base is int:
        v = (default or 3) + 131
        return (str(v), v)
    if base is float:
        v = (default or 1.0) + 0.25
        return (repr(v), v)
    raise AssertionError(f"no test value for option {name} ({base})")


def test_every_option_is_reachable_from_the_cli_and_the_environment():
    """Each option, declared once, is a `rtvoice serve` flag and an RTVOICE_* variable with
    the same meaning, and shows up in --help and docs/OPTIONS.md."""
    from rtvoice.cli import build_parser
    from rtvoice.settings import ENV_PREFIX, option_names, option_type

    ap = build_parser()
    help_text = ap._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md").read_text()
    names = [n for ns in option_names().values() for n in ns]
    assert len(names) == len(set(names)) >= 50
    for name in names:
        raw, want = _flag_value(name)
        flag = "--" + name.replace("_", "-")
        base, _ = option_type(name)
        argv = ["serve", flag] if base is bool and want else \
            ["serve", f"--no-{name.replace('_', '-')}"] if base is bool else ["serve", flag, raw]
        args = ap.parse_args(argv)
        from_cli = Settings.from_env({}, **{name: getattr(args, name)})
        from_env = Settings.from_env({ENV_PREFIX + name.upper(): raw})
        for s in (from_cli, from_env):
            group = next(g for g, ns in option_names().items() if name in ns)
            assert getattr(getattr(s, group), name) == want, (name, s)
        assert flag in help_text and ENV_PREFIX + name.upper() in help_text, name
        assert f"`{flag}`" in docs and f"`{ENV_PREFIX}{name.upper()}`" in docs, name


def test_options_doc_is_current():
    """docs/OPTIONS.md is generated from the declarations: regenerate it with
    `python -m rtvoice.settings --markdown > docs/OPTIONS.md` when an option changes."""
    from rtvoice.settings import markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md").read_text()
    assert docs == markdown()


def test_settings_env_known_non_settings_are_not_warned_about(caplog):
    env = {"RTVOICE_CUDA_KERNELS": "0", "RTVOICE_FIXTURES": "/x", "RTVOICE_MAX_TURN_FRAMEZ": "3"}
    with caplog.at_level(logging.WARNING, logger="rtvoice.settings"):
        s = Settings.from_env(env)
    warned = " ".join(r.getMessage().split(" (known")[0] for r in caplog.records)
    assert "RTVOICE_MAX_TURN_FRAMEZ" in warned  # a typo is still visible
    assert "RTVOICE_CUDA_KERNELS" not in warned and "RTVOICE_FIXTURES" not in warned
    assert s.engine.cuda_kernels is False  # an engine option like any other


def test_settings_unknown_option_and_bad_env():
    with pytest.raises(TypeError, match="unknown setting"):
        Settings().replace(max_turn_framez=3)
    with pytest.raises(ValueError, match="RTVOICE_PORT"):
        Settings.from_env({"RTVOICE_PORT": "eighty"})


def test_serve_parser_has_every_setting():
    from rtvoice.cli import build_parser

    ap = build_parser()
    args = ap.parse_args(["serve", "--port", "0", "--model", "tiny", "--max-turn-frames", "8",
                          "--no-access-log", "--data-dir", "/tmp/x"])
    assert args.port == 0 and args.model == "tiny" and args.max_turn_frames == 8
    assert args.access_log is False and args.data_dir == Path("/tmp/x")
    # unspecified flags stay unset so that the environment can supply them
    assert not hasattr(args, "max_sessions")
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--port", "x"])
    help_text = ap._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for flag in ("--host", "--device", "--max-running", "--idle-timeout-s", "RTVOICE_MAX_SESSIONS",
                 "--send-queue-events"):
        assert flag in help_text
    # a session holds KV blocks from start to close, a decode row only while a turn speaks
    flat = " ".join(help_text.split())
    assert "idle sessions hold KV blocks (kv_blocks) but no row" in flat
    assert isinstance(ap, argparse.ArgumentParser)


# ------------------------------------------------------------------------------ segmenter


def segments(chunks: list[str], chunk_length: int = 200) -> list[str]:
    seg = Segmenter(chunk_length)
    out: list[str] = []
    for c in chunks:
        out += seg.push(c)
    return out + seg.flush()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello world. How are you? Fine!", ["Hello world.", "How are you?", "Fine!"]),
        ("Pi is 3.14 and e is 2.71. Done", ["Pi is 3.14 and e is 2.71.", "Done"]),
        ("Mr. Smith met Dr. Who. Then J. K. Rowling.", ["Mr. Smith met Dr. Who.", "Then J. K. Rowling."]),
        ("Wait... what?! Really.", ["Wait...", "what?!", "Really."]),
        ('He said "stop." Then left.', ['He said "stop."', "Then left."]),
        ("你好，世界。今天天气很好！「是的。」好", ["你好，世界。", "今天天气很好！", "「是的。」", "好"]),
        ("こんにちは。お元気ですか？はい", ["こんにちは。", "お元気ですか？", "はい"]),
        ("مرحبا بالعالم. كيف حالك؟ بخير", ["مرحبا بالعالم.", "كيف حالك؟", "بخير"]),
        ("یہ اردو ہے۔ اور یہ بھی", ["یہ اردو ہے۔", "اور یہ بھی"]),
        ("नमस्ते। आप कैसे हैं॥ ठीक", ["नमस्ते।", "आप कैसे हैं॥", "ठीक"]),
        ("first line\nsecond line", ["first line", "second line"]),
        ("... !!! ", ["...", "!!!"]),  # punctuation alone is text too: the model decides
        (" \n \t ", []),  # whitespace alone is nothing
        ("file.txt is v1.2.3 ok", ["file.txt is v1.2.3 ok"]),
    ],
)
def test_sentence_ends_in_any_script(text, expected):
    assert segments([text]) == expected
    assert segments(list(text)) == expected  # token by token gives the same cut


def test_terminator_waits_for_the_next_character():
    seg = Segmenter()
    assert seg.push("It costs 3.") == []  # could still become 3.14
    assert seg.push("14 now. And") == ["It costs 3.14 now."]
    assert seg.push("。") == []  # the closer may follow
    assert seg.flush() == ["And。"]
    assert seg.buffered == 0


def test_chunk_length_cuts_on_word_boundaries_and_stays_bounded():
    seg = Segmenter(40)
    out: list[str] = []
    text = "word " * 50
    for ch in text:
        out += seg.push(ch)
        assert seg.buffered <= 40
    out += seg.flush()
    assert all(len(s) <= 40 for s in out)
    assert " ".join(out).split() == text.split()  # no word is split or lost
    clause = segments(["one, two, three, four, five, six, seven, eight, nine, ten"], 20)
    assert all(s.endswith(",") for s in clause[:-1])


def test_chunk_length_without_boundaries_never_splits_combining_marks():
    cjk = segments(["字" * 100], 30)
    assert [len(s) for s in cjk] == [30, 30, 30, 10]
    hindi = "कि" * 40  # consonant + vowel sign (a combining mark)
    out = segments([hindi], 15)
    assert "".join(out) == hindi
    assert all(not ("\u0900" <= s[0] <= "\u0903" or "\u093e" <= s[0] <= "\u094f") for s in out)


def test_segments_never_exceed_chunk_length_even_from_one_big_push():
    # a sentence longer than chunk_length that arrives in one piece is cut on length too
    for chunk in (10, 40, 200):
        seg = Segmenter(chunk)
        text = "a" * 500 + ". b " + "word " * 80 + "\n" + "字" * 300 + "。" + "x" * 3
        out = seg.push(text) + seg.flush()
        assert out and all(len(s) <= chunk for s in out), (chunk, [len(s) for s in out])
        assert "".join(out).replace(" ", "") == text.replace(" ", "").replace("\n", "")


def test_clear_drops_the_buffer():
    seg = Segmenter()
    seg.push("Half a sent")
    assert seg.clear() == len("Half a sent") and seg.flush() == []


def test_speech_estimate_per_script():
    en = estimate_speech_seconds("The quick brown fox jumps over the lazy dog.")
    zh = estimate_speech_seconds("敏捷的棕色狐狸跳过了懒狗。")
    assert 2.0 < en < 5.0 and 2.0 < zh < 5.0
    assert estimate_speech_seconds("2024") > estimate_speech_seconds("abcd")
    assert is_speakable("١٢٣") and not is_speakable("?!…")


def test_frame_budget_bounds():
    rate = 44100 / 2048

    def budget(text: str, request_max: int | None, lo: int = 32, hi: int = 500) -> int:
        return frame_budget(text, multiplier=3.0, min_frames=lo, max_frames=hi,
                            request_max=request_max, frame_rate=rate)

    short = budget("Hi.", None)
    long = budget("A much longer sentence that takes several seconds to say.", None)
    assert short == 32 and 32 < long <= 500
    assert budget("x " * 1000, None) == 500  # the hard cap
    assert budget("A much longer sentence.", 10) == 10  # the request's max
    assert budget("Hello there, how are you?", 1024, lo=2, hi=4) == 4


# ------------------------------------------------------------------------------ outbox


async def test_outbox_bounds_queued_audio_and_purges():
    box = _Outbox(max_bytes=100, max_events=100)
    box.put(_Out(data=b"x" * 60))
    keep = _Out(data=b"y" * 30)
    box.put(keep)
    with pytest.raises(_SlowReader, match="not reading"):
        box.put(_Out(data=b"z" * 20))
    box.purge(lambda item: item is keep)
    assert await asyncio.wait_for(box.get(), 1) is keep
    box.put(_Out(data=b"w" * 90))  # room again


async def test_outbox_bounds_queued_events_too():
    # events without audio (a client sending cancels or bad frames and never reading)
    box = _Outbox(max_bytes=10**6, max_events=3)
    for _ in range(3):
        box.put(_Out(event=Done(reason="cancelled")))
    with pytest.raises(_SlowReader, match="not reading its events: 4 are queued"):
        box.put(_Out(event=Done(reason="cancelled")))
    box.clear()
    # held-back items count too, and come out after what was queued meanwhile
    held = _Out(is_done=True)
    box.put(held, hold=True)
    first = _Out(event="ready")
    box.put(first)
    box.put(_Out(), hold=True)
    with pytest.raises(_SlowReader):
        box.put(_Out(), hold=True)
    box.purge(lambda item: item is held or item is first)
    box.release()
    assert await asyncio.wait_for(box.get(), 1) is first
    assert await asyncio.wait_for(box.get(), 1) is held
    # the last events of a session always fit
    for _ in range(10):
        box.put(_Out(data=b"x" * 1000), force=True)
    assert len(box) == 10


async def test_encoder_backlog_is_bounded_without_waiting():
    session = Session.__new__(Session)  # only the queue and its bound are needed
    session._jobs, session._backlog = asyncio.Queue(), 2
    session._raw_bytes = 0
    job = _Job("audio", None)  # type: ignore[arg-type]
    session._queue_job(job)
    session._queue_job(job)
    with pytest.raises(_SlowReader, match="2 chunks behind"):
        session._queue_job(job)  # never blocks: the engine's callbacks come through here
    # the bound is the chunks of two longest segments, in the session's own chunk size
    from engine.config import EngineConfig

    cfg = EngineConfig(max_turn_frames=256, chunk_frames=8)
    assert encode_backlog_chunks(cfg) == 2 * 32 + 16
    assert encode_backlog_chunks(cfg, 1) == 2 * 256 + 16


def test_gc_watch_times_every_pass_and_warns_about_a_long_one(caplog):
    """Every collector pass holds every thread (no step, tick or send): each is timed per
    generation; one longer than warn_s is a warning naming what to do."""
    import gc

    from rtvoice.gc_pauses import GcWatch, freeze, unfreeze

    watch = GcWatch(warn_s=1e-9)
    watch.install()
    watch.install()  # once only
    try:
        with caplog.at_level(logging.WARNING, logger="rtvoice.gc_pauses"):
            gc.collect()
            gc.collect(0)
    finally:
        watch.uninstall()
    snap = watch.snapshot()
    assert snap["passes"][2] == 1 and snap["passes"][0] >= 1
    assert 0 < snap["longest"][2] <= snap["seconds"][2]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "generation 2" in warnings[0]  # one per 10 s at most
    assert "held every thread" in warnings[0] and "--no-gc-freeze" in warnings[0]
    gc.collect()
    assert watch.snapshot()["passes"][2] == 1  # uninstalled: no longer counted
    try:
        assert freeze(collect=True) == gc.get_freeze_count() > 0
        class Cycle:
            pass
        a = Cycle()
        a.self = a  # made after the freeze: still collected
        del a
        assert gc.collect() >= 1
    finally:
        unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_probe_times_a_full_pass_with_and_without_the_frozen_heap():
    """scripts/gc_probe.py (the PERF.md figure): a real tiny server's tracked objects, and a
    full collector pass that frozen objects no longer cost."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "scripts/gc_probe.py", "--reps", "1"], cwd=root,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tracked_objects"] > 100_000 and got["frozen_objects"] > 100_000
    assert got["full_pass_ms_frozen"] < got["full_pass_ms"]
