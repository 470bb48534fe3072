"""The turn-taking demo: jitter-buffer playback on a fake clock, script parsing, and a scripted
conversation with a barge-in against a real server (tiny model)."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import pytest

from clients import turn_taking as tt

EXAMPLE = Path(__file__).resolve().parents[1] / "clients" / "examples" / "conversation.json"

# ============================================================================ playback


class _Mem:
    def __init__(self) -> None:
        self.data = bytearray()
        self.aborted = False
        self.closed = False

    def write(self, pcm: bytes) -> None:
        self.data += pcm

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True


def _pcm(seconds: float, sr: int = 1000) -> bytes:
    return b"\x01\x00" * round(seconds * sr)


def _drive(player: tt.JitterPlayer, arrivals: list[tuple[float, float]], until: float,
           tick: float = 0.01) -> None:
    """Feed ``(arrival_s, seconds)`` chunks and step the player's clock in ticks."""
    pending = sorted(arrivals)
    t = 0.0
    while t <= until + 1e-9 and not player.finished:
        while pending and pending[0][0] <= t + 1e-9:
            player.push(_pcm(pending.pop(0)[1]))
        if not pending:
            player.end_of_input()
        player.step(t)
        t = round(t + tick, 6)


def test_player_plays_an_on_time_stream_without_underruns() -> None:
    out = _Mem()
    p = tt.JitterPlayer(1000, 0.1, [out])
    # 0.2 s chunks every 0.2 s: after the 0.1 s buffer, always on time.
    _drive(p, [(i * 0.2, 0.2) for i in range(5)], until=3.0)
    assert p.state == "done" and p.underruns == 0
    assert p.played_samples == 1000 == len(out.data) // 2
    assert p.started_at == pytest.approx(0.1)
    assert p.ended_at == pytest.approx(1.1, abs=0.011)


def test_player_counts_an_underrun_and_rebuffers() -> None:
    events: list[str] = []
    out = _Mem()
    p = tt.JitterPlayer(1000, 0.05, [out], on_event=lambda ev, **_: events.append(ev))
    # 0.1 s, then a chunk 0.3 s late: the buffer runs dry at 0.15 s.
    _drive(p, [(0.0, 0.1), (0.4, 0.1)], until=2.0)
    assert p.underruns == 1
    assert events == ["playback_start", "underrun", "playback_resume"]
    assert p.stall_s == pytest.approx(0.3, abs=0.011)  # 0.15 -> 0.45 (arrival + buffer)
    assert p.played_samples == 200 and p.state == "done"


def test_player_stop_is_immediate_and_drops_the_rest() -> None:
    out = _Mem()
    p = tt.JitterPlayer(1000, 0.0, [out], clock=lambda: 42.0)
    p.push(_pcm(1.0))
    p.step(0.0)
    p.step(0.25)
    assert p.played_s == pytest.approx(0.25)
    assert p.stop() == 42.0 and out.aborted and p.finished
    p.push(_pcm(1.0))  # late audio after a barge-in is never played
    p.step(0.5)
    assert p.played_s == pytest.approx(0.25) and len(out.data) == 500


# ============================================================================ scripts


def test_example_script_parses() -> None:
    script = tt.load_script(EXAMPLE)
    assert len(script.turns) >= 3
    assert any(t.barge_in_after_s for t in script.turns)
    assert script.tokens_per_s > 0 and script.jitter_ms > 0


def test_script_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="turns"):
        tt.parse_script({"turns": []})
    with pytest.raises(ValueError, match="agent"):
        tt.parse_script({"turns": [{"user": "hi"}]})
    with pytest.raises(ValueError, match="unknown"):
        tt.parse_script({"turns": ["ok"], "colour": "blue"})
    with pytest.raises(ValueError, match="barge_in_after_s"):
        tt.parse_script({"turns": [{"agent": "x", "barge_in_after_s": -1}]})
    s = tt.parse_script({"turns": ["Plain string turns work."],
                         "reference": {"audio": "ref.wav", "text": "t"}}, tmp_path)
    assert s.turns[0].agent == "Plain string turns work."
    assert s.reference == (tmp_path / "ref.wav", "t")


# ============================================================================ real server


@pytest.fixture(scope="module")
def server_url():
    testing = pytest.importorskip("rtvoice.testing")
    # Short turns stay short: the budget follows the text (1x its expected duration).
    with testing.running_server(budget_multiplier=1.0, min_turn_frames=8) as url:
        yield url


def test_demo_with_a_barge_in(server_url: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    script = {
        "title": "test",
        "sample_rate": 16000,
        "tokens_per_s": 400,
        "jitter_ms": 100,
        "seed": 5,
        "request": {"max_new_tokens": 160},
        "turns": [
            {"agent": "Hi there."},
            {"user": "Tell me everything.", "user_s": 0.1,
             "agent": "Well, there is a lot to say about this, so let me start at the very "
                      "beginning, with the history of the place, its people, its food, its "
                      "music, its long winters and its short but glorious summers",
             "barge_in_after_s": 0.3},
            {"user": "Stop, just the time please.", "user_s": 0.1, "agent": "It is nine."},
        ],
    }
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    out = tmp_path / "out"
    rc = tt.main([str(path), "--url", server_url, "--out", str(out), "--sound", "off"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "barge_in" in printed and "first_audio" in printed  # the live timeline
    log = json.loads((out / "log.json").read_text())
    assert log["summary"] == {**log["summary"], "turns": 3, "barge_ins": 1, "errors": 0,
                              "late_audio_bytes": 0}
    assert log["server"]["sample_rate"] == 16000
    t1, t2, t3 = log["turns"]
    for t in (t1, t2, t3):
        # Every WAV holds exactly the audio that was played, at the session's rate.
        with wave.open(str(out / t["wav"])) as w:
            assert w.getframerate() == 16000 and w.getnframes() == t["wav_samples"]
        assert t["wav_samples"] == round(t["played_s"] * 16000)
        assert (t["client_ttfa_ms"] is None) == t["audio_before_flush"]  # no TTFA before flush
        assert t["first_audio_after_first_text_ms"] > 0 and t["first_audio_s"] is not None
        assert t["start_s"] <= t["first_audio_s"] <= t["end_s"]
        assert t["late_audio_bytes"] == 0
    # Turns without a barge-in play everything they received.
    for t in (t1, t3):
        assert t["reason"] in ("eos", "length") and t["barge_in"] is None
        assert t["played_s"] == pytest.approx(t["audio_received_s"], abs=1e-6)
        assert t["played_s"] > 0
    # The barge-in: cancelled on the server, silent at once, nothing played after it.
    b = t2["barge_in"]
    assert t2["reason"] == "cancelled" and b["cancel_sent"] and b["reason"] == "cancelled"
    assert b["after_s"] >= 0.3 and t2["played_s"] == pytest.approx(b["after_s"], abs=1e-6)
    assert b["cancel_to_silence_ms"] < 50
    assert b["at_s"] <= b["silence_s"] <= b["cancel_sent_s"] <= b["done_s"]
    assert b["cancel_to_done_ms"] >= 0
    assert t2["played_s"] < t2["audio_received_s"] + 1e-6
    # The next turn starts after the cancelled one is confirmed, on the same socket.
    assert t3["start_s"] >= b["done_s"]
    # The timeline is ordered and tells the same story.
    times = [e["t"] for e in log["timeline"]]
    assert times == sorted(times)
    t2_events = [e["event"] for e in log["timeline"] if e["turn"] == 2]
    assert t2_events.index("barge_in") < t2_events.index("cancel_confirmed")
    after = t2_events[t2_events.index("barge_in"):]
    assert "playback_resume" not in after and "underrun" not in after
