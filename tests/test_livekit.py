"""The LiveKit Agents TTS plugin (clients/livekit.py) against a live server, standalone (no
LiveKit room or server): streaming, synthesize, the pool of prefilled sessions, barge-in by
``cancel`` (timed against the stock ``livekit.plugins.fishaudio.TTS`` pointed at the same
server), every output rate, word timings, errors."""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _audio import wav_bytes

pytest.importorskip("livekit.agents")
import aiohttp
from livekit import rtc
from livekit.agents import APIConnectOptions, APIStatusError
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from clients.livekit import SAMPLE_RATES, TTS, to_api_error
from clients.livekit import _timed_words as timed_words
from rtvoice.testing import running_server

pytestmark = pytest.mark.timeout(120)

FRAMES = 8  # every segment is exactly FRAMES codec frames (budget 1x, min = max = FRAMES)
SEGMENT_S = FRAMES * 2048 / 44100  # 0.3715 s
TWO_SENTENCES = ["Hello ", "there. ", "How are ", "you?"]  # pushed in pieces: 2 segments
LONG = "This is a long answer that keeps going. " * 16  # 16 segments, about 6 s of audio
NO_RETRY = APIConnectOptions(max_retry=0, timeout=10.0)


@pytest.fixture(scope="module")
def server():
    with running_server(max_turn_frames=FRAMES, budget_multiplier=1.0,
                        min_turn_frames=FRAMES) as url:
        yield url


@pytest.fixture(scope="module")
def voice(server) -> dict[str, Any]:
    """A stored voice (the stock Fish plugin's default voice id is Fish's, not ours)."""
    r = httpx.post(f"{server}/v1/voices", data={"transcript": "A short clip.", "name": "lk"},
                   files={"audio": ("clip.wav", wav_bytes(), "audio/wav")}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def metrics(server: str) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(rtvoice_(?:sessions_total|sessions_live|turns_total|connections_total)\S*) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


CANCELLED = 'rtvoice_turns_total{reason="cancelled"}'


async def collect(stream: Any) -> tuple[list[rtc.AudioFrame], float | None, list[Any]]:
    """Frames of a stream, the time to its first frame, the timed transcripts."""
    t0 = time.perf_counter()
    frames, first, timed = [], None, []
    async for ev in stream:
        first = time.perf_counter() - t0 if first is None else first
        frames.append(ev.frame)
        timed += ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
    return frames, first, timed


def duration(frames: list[rtc.AudioFrame]) -> float:
    return sum(f.samples_per_channel for f in frames) / frames[0].sample_rate


# ------------------------------------------------------------------------------ our plugin


async def test_stream_pieces_pool_prefilled_and_reused(server, voice):
    """Text pushed in pieces gives AudioFrames at the requested rate and the expected length;
    the pool's sessions were opened and prefilled before the turn; the session comes back
    and serves the next turn; aclose() closes every socket."""
    before = metrics(server)
    tts = TTS(url=server, voice=voice["name"], sample_rate=16000, pool_size=2)
    stats = await tts.wait_pool_ready()
    assert stats.idle == 2 and stats.opened == 2
    assert metrics(server)["rtvoice_sessions_total"] == before["rtvoice_sessions_total"] + 2

    stream = tts.stream(conn_options=NO_RETRY)
    pushed_at = time.perf_counter()
    for piece in TWO_SENTENCES:
        stream.push_text(piece)
    stream.end_input()
    frames, _, timed = await collect(stream)
    info = stream.session_info
    assert info is not None and info.from_idle and info.turns_before == 0
    assert info.ready_at is not None and info.ready_at < pushed_at  # voice ready beforehand
    assert all(isinstance(f, rtc.AudioFrame) and f.sample_rate == 16000 for f in frames)
    assert duration(frames) == pytest.approx(2 * SEGMENT_S, abs=0.005)
    if timed:  # a server that sends segment events: the words, timed, in order
        assert "".join(timed).split() == "Hello there. How are you?".split()
        assert timed[0].start_time == pytest.approx(0.0, abs=0.01)
        assert timed[-1].end_time == pytest.approx(2 * SEGMENT_S, abs=0.01)
    await stream.aclose()

    second = tts.stream(conn_options=NO_RETRY)
    second.push_text("Again. ")
    second.end_input()
    frames2, _, _ = await collect(second)
    assert duration(frames2) == pytest.approx(SEGMENT_S, abs=0.005)
    assert second.session_info.session_id == info.session_id  # the same socket, reused
    assert second.session_info.turns_before == 1
    await second.aclose()
    stats = tts.pool_stats()
    assert stats.opened == 2 and stats.reused >= 1 and stats.cancels == 0
    assert metrics(server)["rtvoice_sessions_total"] == before["rtvoice_sessions_total"] + 2

    await tts.aclose()
    deadline = time.monotonic() + 10
    while metrics(server)["rtvoice_sessions_live"] > before["rtvoice_sessions_live"]:
        assert time.monotonic() < deadline, "aclose() left sessions open"
        await asyncio.sleep(0.05)


async def test_synthesize(server):
    async with TTS(url=server, sample_rate=24000, pool_size=1) as tts:
        stream = tts.synthesize("Hello there. How are you?", conn_options=NO_RETRY)
        frame = await stream.collect()
        assert frame.sample_rate == 24000
        assert frame.duration == pytest.approx(2 * SEGMENT_S, abs=0.005)
        # Called at once: it took the session the pool was already opening, not another one.
        assert stream.session_info is not None and tts.pool_stats().opened == 1


@pytest.mark.parametrize("rate", SAMPLE_RATES)
async def test_every_output_rate(server, rate):
    async with TTS(url=server, sample_rate=rate, pool_size=1) as tts:
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text("One sentence. ")
        stream.end_input()
        frames, _, _ = await collect(stream)
        await stream.aclose()
    assert {f.sample_rate for f in frames} == {rate}
    assert {f.num_channels for f in frames} == {1}
    assert duration(frames) == pytest.approx(SEGMENT_S, abs=0.005)


async def test_unknown_voice_is_a_clear_api_error(server):
    async with TTS(url=server, voice="no-such-voice", pool_size=1) as tts:
        t0 = time.monotonic()
        stream = tts.stream()  # default retries: the error is not retryable
        stream.push_text("Hello.")
        stream.end_input()
        with pytest.raises(APIStatusError) as err:
            await collect(stream)
        await stream.aclose()
        assert time.monotonic() - t0 < 10
        e = err.value
        assert e.status_code == 404 and not e.retryable
        assert e.body["code"] == "unknown_voice" and "no-such-voice" in e.message
        with pytest.raises(APIStatusError, match="unknown_voice"):
            await tts.synthesize("Hello.").collect()


async def test_update_options_reopens_the_pool_with_the_new_voice(server, voice):
    async with TTS(url=server, pool_size=1, temperature=0.5) as tts:
        await tts.wait_pool_ready()
        first = tts.pool_stats()
        tts.update_options(voice=voice["name"], seed=7)
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text("New voice. ")
        stream.end_input()
        frames, _, _ = await collect(stream)
        await stream.aclose()
        assert duration(frames) == pytest.approx(SEGMENT_S, abs=0.005)
        lease = tts._pool._idle[-1].session
        assert lease.info.reference_id == voice["id"]  # the name was resolved to the id
        stats = tts.pool_stats()
        assert stats.opened == first.opened + 1 and stats.discarded >= 1
        with pytest.raises(ValueError):
            tts.update_options(extra_request={"no_such_field": 1})


async def test_idle_pool_sessions_are_kept_alive():
    """Idle sessions send a no-op flush well within the server's idle timeout."""
    with running_server(idle_timeout_s=3.0, max_turn_frames=FRAMES, budget_multiplier=1.0,
                        min_turn_frames=FRAMES) as url:
        async with TTS(url=url, pool_size=1) as tts:
            await tts.wait_pool_ready()
            await asyncio.sleep(7.0)
            stream = tts.stream(conn_options=NO_RETRY)
            stream.push_text("Still here. ")
            stream.end_input()
            frames, _, _ = await collect(stream)
            await stream.aclose()
            assert duration(frames) == pytest.approx(SEGMENT_S, abs=0.005)
            stats = tts.pool_stats()
            assert stats.opened == 1 and stats.discarded == 0


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['livekit.agents'] = None\n"
            "try:\n    import clients.livekit\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert "pip install -e '.[livekit]'" in out.stdout, out.stdout + out.stderr


def test_error_mapping():
    from clients.client import ConnectionClosedError, error_from_code

    busy = to_api_error(error_from_code("overloaded", "no capacity"))
    assert isinstance(busy, APIStatusError) and busy.status_code == 503 and busy.retryable
    bad = to_api_error(error_from_code("invalid_field", "bad top_p", fatal=False))
    assert bad.status_code == 400 and not bad.retryable and bad.body["fatal"] is False
    lost = to_api_error(ConnectionClosedError("gone"))
    assert type(lost).__name__ == "APIConnectionError" and lost.retryable


def test_timed_words_keep_the_text_and_rebase_times():
    text = "Hi there. Bye."
    seg = {"index": 3, "text": "Hi there.", "char_start": 0, "char_end": 9, "start": 10.0,
           "end": 10.6, "final": True,
           "words": [{"text": "Hi", "start": 10.0, "end": 10.2, "char_start": 0, "char_end": 2},
                     {"text": "there.", "start": 10.2, "end": 10.6, "char_start": 3,
                      "char_end": 9}]}
    words = timed_words(seg, text, 10.0)
    assert list(words) == ["Hi ", "there. "]
    assert [(w.start_time, w.end_time) for w in words] == [(0.0, pytest.approx(0.2)),
                                                           (pytest.approx(0.2),
                                                            pytest.approx(0.6))]


# ------------------------------------------------------------------------------ barge-in


async def _interrupt_then_next(tts: Any, conn: APIConnectOptions, *,
                               rounds: int = 5) -> tuple[list[float], list[Any]]:
    """Start a long turn, close the stream after ~0.3 s of audio, then time the next turn's
    first audio from the interruption. Returns the latencies and the streams, in order."""
    latencies, streams = [], []
    for _ in range(rounds):
        long = tts.stream(conn_options=conn)
        long.push_text(LONG)
        long.flush()
        heard = 0.0
        async for ev in long:
            heard += ev.frame.duration
            if heard >= 0.3:
                break
        t0 = time.perf_counter()
        await long.aclose()  # what LiveKit does to the TTS stream on an interruption
        nxt = tts.stream(conn_options=conn)
        nxt.push_text("Sorry, go ahead.")
        nxt.end_input()
        async for _ev in nxt:  # read it all: only the long turn is interrupted
            if len(latencies) < len(streams) // 2 + 1:
                latencies.append(time.perf_counter() - t0)
        await nxt.aclose()
        streams += [long, nxt]
        await asyncio.sleep(0.5)  # let both sockets settle before the next round
    return latencies, streams


async def _synthesize_ttfa(tts: Any, rounds: int = 5) -> float:
    """Median time from synthesize() to its first frame, in ms (each read to its end)."""
    times = []
    for _ in range(rounds):
        async with tts.synthesize("Hello there. How are you?") as stream:
            _, first, _ = await collect(stream)
        times.append(first)
    return statistics.median(times) * 1000


async def test_barge_in_cancels_on_the_socket_and_beats_the_stock_plugin(server, voice):
    from livekit.plugins import fishaudio

    # ours
    before = metrics(server)
    tts = TTS(url=server, voice=voice["id"], pool_size=2)
    await tts.wait_pool_ready()
    ours, streams = await _interrupt_then_next(tts, NO_RETRY)
    stats = tts.pool_stats()
    # Every interruption was a cancel on the stream's own socket, the server confirmed each,
    # and no socket was reopened.
    assert stats.cancels == 5 and stats.discarded == 0 and stats.opened == 2
    after = metrics(server)
    assert after[CANCELLED] - before.get(CANCELLED, 0) == 5
    assert after["rtvoice_sessions_total"] - before["rtvoice_sessions_total"] == 2
    # The two pool sessions served all ten turns: each interrupted one went back to the pool
    # and spoke a later turn (without late audio of the cancelled one: exact durations).
    ids = [st.session_info.session_id for st in streams]
    assert len(set(ids)) == 2
    for i in range(0, len(streams) - 2, 2):
        assert ids[i] in ids[i + 1:]
    probe = tts.stream(conn_options=NO_RETRY)
    probe.push_text("Still there?")
    probe.end_input()
    frames, _, _ = await collect(probe)
    assert probe.session_info.session_id in ids and probe.session_info.turns_before >= 1
    assert duration(frames) == pytest.approx(SEGMENT_S, abs=0.005)
    await probe.aclose()
    ours_synth = await _synthesize_ttfa(tts)
    await tts.aclose()

    # the stock Fish plugin: its defaults (its default voice id is an alias of the model's
    # default voice here), only the URL changed
    before = metrics(server)
    async with aiohttp.ClientSession() as http:
        stock = fishaudio.TTS(base_url=str(server), api_key="unused", http_session=http)
        warm = stock.stream(conn_options=NO_RETRY)
        warm.push_text("Warm up.")
        warm.end_input()
        assert (await collect(warm))[0]
        await warm.aclose()
        # It pools its sockets and sends the next 'start' on one that saw 'finish': the
        # server keeps them open for that, so no attempt fails (no retries allowed here).
        again = stock.stream(conn_options=NO_RETRY)
        again.push_text("Same socket.")
        again.end_input()
        assert (await collect(again))[0]
        await again.aclose()
        assert metrics(server)["rtvoice_connections_total"] - before[
            "rtvoice_connections_total"] == 1
        theirs, _ = await _interrupt_then_next(stock, NO_RETRY)
        frame = await stock.synthesize("Hello there. How are you?").collect()
        assert frame.sample_rate == 24000 and frame.duration == pytest.approx(2 * SEGMENT_S,
                                                                              abs=0.01)
        theirs_synth = await _synthesize_ttfa(stock)
        await stock.aclose()
    stock_sessions = metrics(server)["rtvoice_sessions_total"] - before["rtvoice_sessions_total"]

    ours_ms = statistics.median(ours) * 1000
    theirs_ms = statistics.median(theirs) * 1000
    print(f"\ninterruption -> next turn's first audio, median of {len(ours)}: "
          f"rtvoice plugin {ours_ms:.0f} ms {[round(x * 1000) for x in ours]}, "
          f"stock fishaudio plugin {theirs_ms:.0f} ms {[round(x * 1000) for x in theirs]}; "
          f"sessions opened by the stock plugin: {stock_sessions:.0f}; synthesize() to first "
          f"audio: rtvoice plugin {ours_synth:.0f} ms, stock (POST /v1/tts) "
          f"{theirs_synth:.0f} ms")
    assert ours_ms <= theirs_ms
