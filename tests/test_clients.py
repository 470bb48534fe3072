"""clients: the asyncio library and its sync wrapper against a real server (tiny model).

The tiny model has random weights and rarely ends a turn by itself, so every turn here is
bounded by ``max_new_tokens`` (frames per segment) and texts are one sentence.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import time

import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.server import serve

from clients import (
    AudioChunk,
    ClientTimeoutError,
    ConnectionClosedError,
    RequestError,
    RtvoiceError,
    SyncSession,
    UnsupportedFormatError,
    VoiceError,
    connect,
    error_from_code,
    llm_tokens,
    normalize_url,
    paced,
    synthesize,
)
from clients import client as client_mod
from protocol import ErrorCode

# ============================================================================ no server needed


def test_normalize_url() -> None:
    assert normalize_url("http://127.0.0.1:80") == "ws://127.0.0.1:80/v1/tts/live"
    assert normalize_url("https://h/") == "wss://h/v1/tts/live"
    assert normalize_url("127.0.0.1:9") == "ws://127.0.0.1:9/v1/tts/live"
    assert normalize_url("ws://h:1/custom?x=1") == "ws://h:1/custom?x=1"
    with pytest.raises(ValueError):
        normalize_url("ftp://h")


def test_every_error_code_has_a_typed_exception() -> None:
    for code in ErrorCode:
        err = error_from_code(code.value, "msg", fatal=False, context_id="c")
        assert isinstance(err, RtvoiceError) and err.code == code.value
        assert err.context_id == "c" and not err.fatal and "msg" in str(err)
        assert type(err) is not RtvoiceError, code  # each maps to a specific subclass
    assert isinstance(error_from_code("unknown_voice"), VoiceError)
    assert isinstance(error_from_code("invalid_state"), RequestError)
    assert type(error_from_code("from_the_future")) is RtvoiceError
    assert isinstance(ClientTimeoutError(), TimeoutError)


def test_llm_tokens_round_trip() -> None:
    for text in ["Hello there, how are you?", "你好，世界。", "  spaced  out ", "Guten Tag!"]:
        toks = llm_tokens(text)
        assert "".join(toks) == text
    assert len(llm_tokens("你好世界")) == 4


def test_client_ttfa_is_measured_from_the_flush_and_never_clamped() -> None:
    """Audio after the flush: client TTFA = flush -> first audio. Audio before the flush (the
    server speaks a sentence as soon as it ends): no client TTFA (not 0 ms), flagged, and the
    first-text -> first-audio figure still given."""
    def result(first_text: float, flush: float, first_audio: float):
        turn = client_mod.Turn(None, None)  # type: ignore[arg-type]
        turn.first_text_at, turn.flush_at, turn.first_audio_at = first_text, flush, first_audio
        return turn._finish(first_audio + 1.0)

    after = result(1.0, 2.0, 2.25)
    assert after.client_ttfa_ms == pytest.approx(250.0) and not after.audio_before_flush
    assert after.first_audio_after_first_text_ms == pytest.approx(1250.0)
    early = result(1.0, 2.0, 1.5)
    assert early.client_ttfa_ms is None and early.audio_before_flush
    assert early.first_audio_after_first_text_ms == pytest.approx(500.0)


async def test_paced_keeps_its_rate() -> None:
    t0 = time.perf_counter()
    got = [t async for t in paced(["a"] * 6, tokens_per_s=50)]
    assert got == ["a"] * 6
    assert time.perf_counter() - t0 >= 5 / 50 * 0.9


async def test_connection_refused() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectionClosedError):
        await connect(f"ws://127.0.0.1:{port}", timeout=5)


async def test_silent_server_times_out() -> None:
    async def mute(ws) -> None:  # accepts the socket, reads, never answers
        async for _ in ws:
            pass

    async with serve(mute, "127.0.0.1", 0) as srv:
        port = srv.sockets[0].getsockname()[1]
        session = await connect(f"ws://127.0.0.1:{port}", timeout=0.3)
        with pytest.raises(ClientTimeoutError):
            await session.wait_ready()
        turn = await session.send_text("hi", flush=True)
        with pytest.raises(ClientTimeoutError):
            await turn
        await session.close()
        with pytest.raises(ConnectionClosedError):
            await turn.result(timeout=1)


# ============================================================================ real server

MAX_FRAMES = 12  # frames per segment: ~0.56 s of audio, fast on the tiny model


@pytest.fixture(scope="module")
def server_url():
    testing = pytest.importorskip("rtvoice.testing")
    with testing.running_server(max_contexts=3) as url:
        yield url


def _check_stream(chunks: list[AudioChunk], sample_rate: int, context_id: str | None) -> None:
    """seq from 0 without gaps, offsets continuous, s16 byte counts match the durations."""
    assert chunks, "no audio"
    assert [c.seq for c in chunks] == list(range(chunks[0].seq, chunks[0].seq + len(chunks)))
    for a, b in itertools.pairwise(chunks):
        assert b.offset_s == pytest.approx(a.offset_s + a.duration_s, abs=1e-4)
        assert b.received_at >= a.received_at
    for c in chunks:
        assert c.context_id == context_id
    total_samples = sum(len(c.data) for c in chunks) // 2
    total_s = sum(c.duration_s for c in chunks)
    # The resampler holds back a few ms until the turn's end; the total must still agree.
    assert total_samples / sample_rate == pytest.approx(total_s, abs=0.03)


async def test_incremental_text_two_turns_one_socket(server_url: str) -> None:
    async with connect(server_url, format="pcm", sample_rate=16000, seed=1,
                       max_new_tokens=MAX_FRAMES) as s:
        ready = await s.ready
        assert ready.sample_rate == 16000 and ready.format == "pcm"
        assert ready.session_id and ready.prefill_ms >= 0 and ready.model
        results = []
        for text in ("Hello there, how are you?", "Fine, thanks."):
            turn = await s.feed(paced(llm_tokens(text), tokens_per_s=200))
            chunks = [c async for c in turn]
            res = await turn
            _check_stream(chunks, 16000, None)
            assert res.reason in ("eos", "length")
            assert 0 < res.frames <= MAX_FRAMES
            assert res.text_chars == len(text) and res.chunks == len(chunks)
            assert (res.client_ttfa_ms is None) == res.audio_before_flush
            assert res.client_ttfa_ms is None or res.client_ttfa_ms >= 0
            assert res.first_audio_after_first_text_ms is not None
            assert res.first_audio_after_first_text_ms > 0
            assert res.server_ttfa_ms is not None and res.server_ttfa_ms >= 0
            assert res.server_prefill_ms is not None
            assert 0 < res.server_prefill_ms < res.server_ttfa_ms
            assert res.audio_s == pytest.approx(sum(c.duration_s for c in chunks), abs=0.03)
            assert res.rtf is not None and res.decode_tps and res.decode_tps > 0
            assert res.flush_at is not None and res.first_audio_at is not None
            assert res.bytes == len(turn.audio_bytes)
            results.append(res)
        assert s.session_id == ready.session_id and not s.errors
        assert len(s.turns) == 2
        await s.stop()  # Fish's end: finish{stop}, clean close
        assert s.finished.result() == "stop" and s.closed and s.fatal_error is None


async def test_a_blank_turn_ends_at_once_and_the_next_turn_gets_its_audio(server_url: str
                                                                       ) -> None:
    """Found in review: a turn of blank text (an LLM that yields only "\n") waited forever for
    a done the server never sends (it opens no turn for blank text), and took the next turn's
    audio."""
    async with connect(server_url, format="pcm", max_new_tokens=MAX_FRAMES) as s:
        await s.wait_ready()
        blank = await s.feed(["\n", "  "])
        assert (await asyncio.wait_for(blank.result(), 5)).reason == "eos" and not blank.chunks
        real = await s.feed(["Hello there."])
        res = await real
        assert real.chunks and res.frames > 0 and not blank.chunks
        # a cancel while the open turn holds only blank text: nothing of it is pending
        await s.send_text("   ")
        await s.cancel()
        after = await s.feed(["After the cancel."])
        assert (await asyncio.wait_for(after.result(), 30)).frames > 0 and after.chunks


async def test_keepalive_keeps_an_idle_session_past_the_idle_timeout() -> None:
    from rtvoice.testing import running_server

    with running_server(idle_timeout_s=1.0, max_turn_frames=4) as url:
        async with connect(url, format="pcm") as s:
            await s.wait_ready()
            for _ in range(6):  # 2.4 s idle: twice the idle timeout
                await asyncio.sleep(0.4)
                await s.keepalive()
            res = await (await s.feed(["Still here."]))
            assert res.frames > 0 and not s.errors
        async with connect(url, format="pcm") as idle:  # and without it, the session ends
            await idle.wait_ready()
            await asyncio.sleep(2.5)
            assert idle.closed and idle.fatal_error is not None
            assert idle.fatal_error.code == "timeout"


async def test_cancel_stops_audio_and_the_next_turn_works(server_url: str) -> None:
    async with connect(server_url, format="pcm", max_new_tokens=400, seed=2) as s:
        await s.wait_ready()
        # A long budget: the turn is still generating when we barge in.
        turn = await s.send_text("This is a long answer that keeps going, and going, and going",
                                 flush=True)
        first = await anext(aiter(turn))
        assert first.seq == 0
        cancelled = await s.cancel()
        assert cancelled == [turn]
        res = await turn
        assert res.reason == "cancelled" and res.cancelled
        assert res.cancel_at is not None and res.done_at >= res.cancel_at
        assert res.frames < 400
        n = len(turn.chunks)
        # Nothing of the cancelled turn may follow its done.
        await asyncio.sleep(0.3)
        assert len(turn.chunks) == n and len(s.turns) == 1
        # The next turn on the same socket is unaffected.
        nxt = await s.send_text("Next turn.", flush=True)
        r2 = await nxt.result()
        assert r2.reason in ("eos", "length") and r2.chunks > 0
        assert nxt.chunks[0].offset_s == pytest.approx(
            turn.chunks[-1].offset_s + turn.chunks[-1].duration_s, abs=1e-4)
        # Cancelling an idle context is acknowledged with a done of its own.
        ack = await s.cancel()
        assert len(ack) == 1 and (await ack[0]).reason == "cancelled"
        assert not s.errors


async def test_several_contexts_on_one_socket(server_url: str) -> None:
    async with connect(server_url, format="pcm", max_new_tokens=MAX_FRAMES, seed=3,
                       encoding="json") as s:  # JSON text frames; audio comes base64
        ready = await s.wait_ready()
        all_audio = s.audio()  # every chunk of every context from now on
        ta = await s.send_text("First context.", context_id="a", flush=True)
        tb = await s.send_text("Second context here.", context_id="b", flush=True)
        tc = await s.send_text("A third one that will be cancelled, soon", context_id="c")
        await s.cancel("c")
        ra, rb, rc = await asyncio.gather(ta.result(), tb.result(), tc.result())
        assert (ra.context_id, rb.context_id, rc.context_id) == ("a", "b", "c")
        assert ra.reason in ("eos", "length") and rb.reason in ("eos", "length")
        assert rc.reason == "cancelled" and not tc.chunks
        _check_stream(ta.chunks, ready.sample_rate, "a")
        _check_stream(tb.chunks, ready.sample_rate, "b")
        assert ta.chunks[0].seq == 0 and tb.chunks[0].seq == 0  # numbered per context
        await s.stop()
        seen = [c async for c in all_audio]
        assert {c.context_id for c in seen} == {"a", "b"}
        assert len(seen) == len(ta.chunks) + len(tb.chunks)


async def test_errors_carry_the_server_code(server_url: str) -> None:
    # Fatal at start: the session never gets a voice.
    s = await connect(server_url, voice="no-such-voice")
    with pytest.raises(VoiceError) as exc:
        await s.ready
    assert exc.value.code == "unknown_voice" and exc.value.fatal
    await s.close()
    s = await connect(server_url, format="pcm", sample_rate=12345)
    with pytest.raises(UnsupportedFormatError) as exc2:
        await s.ready
    assert exc2.value.code == "unsupported_format"
    with pytest.raises(UnsupportedFormatError):
        await s.send_text("anything")  # the session is dead: sending raises its error
    await s.close()
    # Not fatal: a fourth context with unfinished work (the server allows 3) is refused with
    # bad_request for that context; the session and its other contexts carry on.
    async with connect(server_url, format="pcm", max_new_tokens=MAX_FRAMES) as s:
        await s.wait_ready()
        live = [await s.send_text("Waiting text", context_id=f"k{i}") for i in range(3)]
        extra = await s.send_text("one too many", context_id="k3")
        with pytest.raises(RequestError) as exc3:
            await extra
        assert exc3.value.code == "bad_request" and not exc3.value.fatal
        assert exc3.value.context_id == "k3" and s.errors and not s.fatal_error
        for i in range(3):
            await s.flush(f"k{i}")
        results = await asyncio.gather(*(t.result() for t in live))
        assert all(r.reason in ("eos", "length") for r in results)


async def test_session_level_audio_iterator_and_default_context_id(server_url: str) -> None:
    # ``start.request.context_id`` names the default context: None and that id are one.
    async with connect(server_url, format="wav", max_new_tokens=8, context_id="main") as s:
        await s.wait_ready()
        turn = await s.send_text("Default context.", flush=True)
        res = await turn
        assert res.context_id == "main" and turn.chunks[0].context_id == "main"
        data = turn.audio_bytes
        assert data[:4] == b"RIFF"  # one WAV stream per turn
        pcm, sr = sf.read(io.BytesIO(data), dtype="int16")
        assert sr == 44100 and len(pcm) > 0


def test_sync_wrapper(server_url: str) -> None:
    wav = synthesize(server_url, "Hello from a script.", format="wav", max_new_tokens=8)
    pcm, sr = sf.read(io.BytesIO(wav), dtype="float32")
    assert sr == 44100 and pcm.size > 0 and np.isfinite(pcm).all()
    with SyncSession(server_url, format="pcm", sample_rate=24000, max_new_tokens=8) as s:
        assert s.info is not None and s.info.sample_rate == 24000
        chunks = list(s.stream(["Two ", "turns, ", "one socket."]))
        assert chunks and chunks[0].seq == 0
        data, res = s.say("Second turn.")
        assert res.reason in ("eos", "length") and len(data) == res.bytes > 0
        s.stop()


def test_client_module_exports() -> None:
    assert set(client_mod.__all__) <= set(dir(client_mod))
