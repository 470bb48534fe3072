"""The live TTS socket end to end: a real uvicorn server (rtvoice.testing.running_server) and
real clients (plain ``websockets``, msgpack and JSON).

Budgets are kept tiny (a few frames per segment) so the suite stays fast on 2 CPU cores; the
tests that need a long turn (cancel) ask for one explicitly.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import math
import threading
import time
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import soundfile as sf
import websockets
from _audio import wav_bytes
from _live import (
    Client,
    audio_of,
    check_audio_sequence,
    engine_at_rest,
    is_done,
    is_finish,
    next_error,
    poll,
    request,
    speak,
    still_serving,
    wait_at_rest,
)

import rtvoice.turns
from protocol import (
    Audio,
    Cancel,
    Done,
    Encoding,
    Error,
    Finish,
    Flush,
    Ready,
    ReferenceAudio,
    Start,
    Stop,
    Text,
    encode_client,
)
from rtvoice.audio_formats import FORMATS, make_encoder
from rtvoice.testing import running_server
from rtvoice.turns import segment_chars

FRAME_S = 2048 / 44100

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server():
    with running_server(
        max_turn_frames=400,
        budget_multiplier=0.5,
        min_turn_frames=4,
        max_message_bytes=256 * 1024,
        max_contexts=3,
        max_text_chars=2000,
    ) as url:
        yield url


# ------------------------------------------------------------------------------ happy paths


async def test_msgpack_session_ready_audio_done_finish(server):
    t0 = time.perf_counter()
    events, code = await speak(server.ws_url, ["Hello ", "world. ", "How are you?"])
    assert code == 1000
    ready = events[0]
    assert isinstance(ready, Ready)
    assert ready.format == "pcm" and ready.sample_rate == 44100 and ready.model == "tiny"
    assert ready.frame_rate_hz == pytest.approx(44100 / 2048)
    assert ready.prefill_ms >= 0 and ready.session_id
    assert ready.limits.max_new_tokens == 6 and ready.limits.max_message_bytes == 256 * 1024
    done = [e for e in events if isinstance(e, Done)]
    assert len(done) == 1 and done[0].reason in ("length", "eos")
    assert done[0].segments == 2 and done[0].text_chars == len("Hello world. How are you?")
    assert 0 < done[0].frames <= 12
    assert done[0].ttfa_ms is not None and 0 < done[0].ttfa_ms < (time.perf_counter() - t0) * 1000
    # TTFA's first part: the segment's prompt prefilled (then its first frames, the codec)
    assert done[0].prefill_ms is not None and 0 < done[0].prefill_ms < done[0].ttfa_ms
    assert done[0].rtf is not None and done[0].rtf > 0
    audio = audio_of(events)
    check_audio_sequence(audio)
    pcm = b"".join(a.audio for a in audio)
    assert len(pcm) == done[0].frames * 2048 * 2  # s16le at the model rate: exact
    assert done[0].audio_s == pytest.approx(done[0].frames * FRAME_S)
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"
    # order: ready, audio..., done, finish
    assert events.index(done[0]) == len(events) - 2


async def test_json_client_gets_text_frames_and_base64_audio(server):
    c = await Client.connect(server.ws_url, Encoding.JSON)
    await c.send_raw(json.dumps({"event": "start", "request": {"format": "pcm", "max_new_tokens": 4}}))
    await c.send_raw(json.dumps({"event": "text", "text": "Plain JSON works."}))
    await c.send_raw(json.dumps({"event": "flush"}))
    await c.send_raw(json.dumps({"event": "stop"}))
    events = await c.until(is_finish)  # Client.recv asserts every frame is a text frame
    audio = audio_of(events)
    done = next(e for e in events if isinstance(e, Done))
    assert audio and len(b"".join(a.audio for a in audio)) == done.frames * 4096
    assert await c.closed() == 1000
    # and on the wire it really is base64 in JSON
    raw = encode_client(Text(text="x"), Encoding.JSON)
    assert isinstance(raw, str)
    wire = msgspec.json.encode(Audio(audio=b"\x01\x02")).decode()
    assert base64.b64encode(b"\x01\x02").decode() in wire


@pytest.mark.parametrize(
    ("lang", "text", "segments"),
    [
        ("en", "Good morning. The weather is fine today!", 2),
        ("ar", "مرحبا بالعالم. كيف حالك اليوم؟", 2),
        ("zh", "你好，世界。今天天气很好！", 2),
        ("ja", "こんにちは。お元気ですか？", 2),
    ],
)
async def test_languages(server, lang, text, segments):
    # token-by-token streaming, as an LLM would send it
    events, code = await speak(server.ws_url, list(text), max_new_tokens=3)
    assert code == 1000
    done = next(e for e in events if isinstance(e, Done))
    assert done.segments == segments, lang
    assert done.frames == 3 * segments  # the random-weight model never says <|im_end|>
    assert len(b"".join(a.audio for a in audio_of(events))) == done.frames * 4096


async def test_several_turns_per_session(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=4)))
    assert isinstance(await c.recv(), Ready)
    dones = []
    for i in range(3):
        await c.send(Text(text=f"Turn number {i}."))
        await c.send(Flush())
        evs = await c.until(is_done())
        dones.append(evs[-1])
        assert audio_of(evs), i
    assert [d.frames for d in dones] == [4, 4, 4]
    check_audio_sequence(audio_of(c.events))  # seq and offsets continue across turns
    await c.send(Stop())
    assert (await c.until(is_finish))[-1].reason == "stop"
    assert await c.closed() == 1000


async def test_concurrent_sessions(server):
    async def one(i: int) -> tuple[list[Any], int | None]:
        return await speak(server.ws_url, [f"Session {i} says hello.", " And goodbye."],
                           max_new_tokens=4, seed=i)

    results = await asyncio.gather(*(one(i) for i in range(4)))
    for events, code in results:
        assert code == 1000
        done = next(e for e in events if isinstance(e, Done))
        assert done.frames == 8 and done.segments == 2
        assert len(b"".join(a.audio for a in audio_of(events))) == 8 * 4096


async def test_text_during_prefill_and_in_start_request(server):
    # Fish's legacy SDK may put the text into the request itself
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(text="Spoken from the request.", max_new_tokens=3)))
    await c.send(Stop())
    events = await c.until(is_finish)
    done = next(e for e in events if isinstance(e, Done))
    assert done.frames == 3 and done.text_chars == len("Spoken from the request.")
    assert await c.closed() == 1000


async def test_cancel_mid_turn_then_next_turn(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=400)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Text(text="This is a rather long sentence that would take a while to say " * 3))
    await c.send(Flush())
    first = await c.until(lambda e: isinstance(e, Audio))
    assert first[-1].seq == 0
    await c.send(Cancel())
    evs = await c.until(is_done())
    done = evs[-1]
    assert done.reason == "cancelled"
    assert 0 < done.frames < 400  # generation stopped early
    # what was sent before the done is all there is: the next events belong to the next turn
    sent_audio = audio_of(c.events)
    assert done.audio_s == pytest.approx(sum(a.duration_s for a in sent_audio), abs=1e-5)
    await c.send(Text(text="Next turn."))
    await c.send(Flush())
    evs = await c.until(is_done())
    assert evs[-1].reason in ("length", "eos") and evs[-1].frames > 0
    # nothing of the cancelled turn arrived after its done: every later audio is the new turn's
    later = audio_of(evs)
    assert later and sum(len(a.audio) for a in later) == evs[-1].frames * 4096
    check_audio_sequence(audio_of(c.events))
    await c.send(Stop())
    await c.until(is_finish)
    assert await c.closed() == 1000


async def test_cancel_with_nothing_running_is_acknowledged(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request()))
    await c.send(Cancel(context_id="nothing"))
    evs = await c.until(is_done("nothing"))
    assert evs[-1].reason == "cancelled" and evs[-1].frames == 0
    await c.send(Stop())
    await c.until(is_finish)
    await c.close()


async def test_two_contexts_cancel_one_other_completes(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=400)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Text(context_id="a", text="Context A talks for a long time, " * 6))
    await c.send(Flush(context_id="a"))
    await c.send(Text(context_id="b", text="Hi from B."))
    await c.send(Flush(context_id="b"))
    await c.until(lambda e: isinstance(e, Audio) and e.context_id == "a")
    await c.send(Cancel(context_id="a"))
    evs = await c.until(is_done("b"))
    done_a = next(e for e in c.events if isinstance(e, Done) and e.context_id == "a")
    done_b = evs[-1]
    assert done_a.reason == "cancelled"
    assert done_b.reason in ("length", "eos") and done_b.frames > 0
    # no audio of A after A's done; B's audio is complete and numbered on its own
    i_done_a = c.events.index(done_a)
    assert not audio_of(c.events[i_done_a:], "a")
    audio_b = audio_of(c.events, "b")
    check_audio_sequence(audio_b)
    check_audio_sequence(audio_of(c.events, "a"))
    assert sum(len(a.audio) for a in audio_b) == done_b.frames * 4096
    await c.send(Stop())
    await c.until(is_finish)
    assert await c.closed() == 1000


# ------------------------------------------------------------------------------ formats


def _decoded_seconds(fmt: str, rate: int, data: bytes) -> float:
    if fmt == "pcm":
        x, sr = sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=rate, channels=1)
    elif fmt == "mulaw":
        x, sr = sf.read(io.BytesIO(data), format="RAW", subtype="ULAW", samplerate=rate, channels=1)
    else:
        x, sr = sf.read(io.BytesIO(data))
    assert sr == rate
    return len(x) / sr


FORMAT_CASES = [("pcm", r) for r in FORMATS["pcm"].sample_rates] + [
    ("wav", 44100), ("wav", 16000), ("mulaw", 8000), ("mp3", 44100), ("mp3", 24000),
    ("opus", 48000), ("opus", 24000),
]


@pytest.mark.parametrize(("fmt", "rate"), FORMAT_CASES)
async def test_every_format_decodes_to_the_generated_duration(server, fmt, rate):
    events, code = await speak(server.ws_url, ["Format check. Second sentence."], format=fmt,
                               sample_rate=rate, max_new_tokens=5)
    assert code == 1000
    ready = events[0]
    assert ready.format == fmt and ready.sample_rate == rate
    done = next(e for e in events if isinstance(e, Done))
    assert done.frames == 10 and done.segments == 2
    data = b"".join(a.audio for a in audio_of(events))
    expected = done.frames * 2048 / 44100
    got = _decoded_seconds(fmt, rate, data)
    bound = make_encoder(fmt, rate, input_sample_rate=44100).padding_bound_s
    assert -1.0 / rate - 1e-9 <= got - expected <= bound + 1e-9, (fmt, rate, got, expected)
    # chunk durations add up to the generated audio
    assert sum(a.duration_s for a in audio_of(events)) == pytest.approx(expected, abs=1e-4)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1\x00garbage", "malformed_message"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed_message"),
        (msgspec.msgpack.encode({"event": "sing", "text": "la"}), "unknown_event"),
        (msgspec.msgpack.encode({"event": "text", "text": 5}), "invalid_field"),
        (msgspec.msgpack.encode({"event": "text"}), "missing_field"),
        ('{"event": "text", "text": ', "malformed_message"),
    ],
)
async def test_bad_messages_are_reported_and_the_session_survives(server, frame, code):
    c = await Client.connect(server.ws_url, Encoding.JSON if isinstance(frame, str)
                             else Encoding.MSGPACK)
    await c.send_raw(frame)
    err = await next_error(c)
    assert err.code == code and not err.fatal
    # the same socket still works
    await c.send(Start(request=request(max_new_tokens=2)))
    await c.send(Text(text="Recovered."))
    await c.send(Stop())
    events = await c.until(is_finish)
    assert events[-1].reason == "stop" and any(isinstance(e, Done) for e in events)
    assert await c.closed() == 1000


async def test_text_before_start_is_invalid_state(server):
    c = await Client.connect(server.ws_url)
    await c.send(Text(text="too early"))
    err = await next_error(c)
    assert err.code == "invalid_state" and not err.fatal and "start" in err.message
    await c.send(Start(request=request(max_new_tokens=6)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Start(request=request()))  # a second start
    assert (await next_error(c)).code == "invalid_state"
    await c.send(Text(text="Pending words keep the session draining for a while."))
    await c.send(Stop())
    await c.send(Text(text="after stop"))
    assert (await next_error(c)).code == "invalid_state"
    assert (await c.until(is_finish))[-1].reason == "stop"
    await c.close()


async def _fatal(url: str, first: Any, *, encoding: Encoding = Encoding.MSGPACK) -> tuple[Error, int | None]:
    c = await Client.connect(url, encoding)
    if isinstance(first, bytes | str):
        await c.send_raw(first)
    else:
        await c.send(first)
    events = await c.until(is_finish)
    assert events[-1].reason == "error"
    err = next(e for e in events if isinstance(e, Error))
    assert err.fatal
    return err, await c.closed()


async def test_unknown_voice_is_fatal_with_policy_close(server):
    err, code = await _fatal(server.ws_url, Start(request=request(reference_id="no-such-voice")))
    assert err.code == "unknown_voice" and code == 1008
    await still_serving(server.ws_url)


async def test_a_session_chooses_its_audio_chunks(server):
    """first_chunk_frames / chunk_frames in `start` are the session's own chunking (the
    engine's settings for what it leaves out); out-of-range values are refused, naming the
    field, and leave the server serving."""
    engine = server.app.state.runtime.engine
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(first_chunk_frames=1, chunk_frames=1, max_new_tokens=12)))
    await c.send(Text(text="A sentence long enough to say a dozen frames or so, please."))
    await c.send(Flush())
    await poll(lambda: any(q.chunking.size == 1 for q in list(engine.scheduler.live.values())),
               "the session's chunking never reached the engine")
    await c.send(Stop())
    events = await c.until(is_finish)
    done = next(e for e in events if isinstance(e, Done))
    audio = audio_of(events)
    check_audio_sequence(audio)
    assert done.frames >= 4 and sum(a.duration_s for a in audio) == pytest.approx(
        done.frames * FRAME_S, abs=1e-4)
    # one-frame chunks: more, smaller audio events than the engine's 8-frame chunks give
    assert len(audio) >= math.ceil(done.frames / 2), [round(a.duration_s / FRAME_S) for a in audio]
    # refused like any bad field of `start`: the socket stays, ready for a good one
    c = await Client.connect(server.ws_url)
    for req, field in ((request(first_chunk_frames=5, chunk_frames=3), "first_chunk_frames (5)"),
                       (request(first_chunk_frames=9), "first_chunk_frames (9)"),
                       (request(chunk_frames=401), "chunk_frames must be 1..400")):
        await c.send(Start(request=req))
        err = await next_error(c)
        assert err.code == "invalid_field" and field in err.message and not err.fatal, err
    await c.send(Start(request=request(chunk_frames=3)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Stop())
    await c.until(is_finish)


async def test_undecodable_reference_audio(server):
    bad = Start(request=request(references=[ReferenceAudio(audio=b"not audio at all", text="x")]))
    err, code = await _fatal(server.ws_url, bad)
    assert err.code == "bad_reference_audio" and code == 1007
    await still_serving(server.ws_url)


async def test_unsupported_format(server):
    err, code = await _fatal(server.ws_url, Start(request=request(format="flac")))
    assert err.code == "unsupported_format" and code == 1003 and "pcm" in err.message
    err, code = await _fatal(server.ws_url, Start(request=request(format="pcm", sample_rate=12345)))
    assert err.code == "unsupported_format"


async def test_oversized_message_is_too_large(server):
    big = encode_client(Text(text="x" * (300 * 1024)))
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request()))
    await c.send_raw(big)
    events = await c.until(is_finish)
    err = next(e for e in events if isinstance(e, Error))
    assert err.code == "too_large" and err.fatal and events[-1].reason == "error"
    assert await c.closed() == 1009
    await still_serving(server.ws_url)


async def test_too_much_unspoken_text_and_too_many_contexts(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=2)))
    for ctx in ("c1", "c2", "c3"):
        await c.send(Text(context_id=ctx, text="open"))
    await c.send(Text(context_id="c4", text="one too many"))
    err = await next_error(c)
    assert err.code == "bad_request" and not err.fatal and err.context_id == "c4"
    await c.send(Text(context_id="c1", text="y" * 2500))  # max_text_chars=2000
    events = await c.until(is_finish)
    err = [e for e in events if isinstance(e, Error)][-1]
    assert err.code == "too_large" and err.fatal
    assert await c.closed() == 1009


async def test_bad_input_does_not_disturb_a_running_session(server):
    good = await Client.connect(server.ws_url)
    await good.send(Start(request=request(max_new_tokens=60)))
    await good.send(Text(text="A turn that keeps generating while the neighbours misbehave."))
    await good.send(Flush())
    await good.until(lambda e: isinstance(e, Audio))
    neighbours = [
        (b"\xc1 not msgpack", "malformed_message"),
        (encode_client(Text(text="x" * 300_000)), "too_large"),
        (msgspec.msgpack.encode({"event": "start", "request": {"reference_id": "nope"}}),
         "unknown_voice"),
        (msgspec.msgpack.encode({"event": "start", "request": {"references": [
            {"audio": b"RIFF garbage", "text": "t"}]}}), "bad_reference_audio"),
    ]
    for frame, code in neighbours:
        bad = await Client.connect(server.ws_url)
        await bad.send_raw(frame)
        assert (await next_error(bad)).code == code
        await bad.close()
    evs = await good.until(is_done())
    done = evs[-1]
    assert done.reason == "length" and done.frames > 0  # ran to its budget, undisturbed
    assert sum(len(a.audio) for a in audio_of(good.events)) == done.frames * 4096
    check_audio_sequence(audio_of(good.events))
    assert not [e for e in good.events if isinstance(e, Error)]
    await good.send(Stop())
    await good.until(is_finish)
    assert await good.closed() == 1000


async def test_inline_reference_clip(server):
    events, code = await speak(
        server.ws_url, ["Cloned voice."], max_new_tokens=3,
        references=[ReferenceAudio(audio=wav_bytes(0.4, rate=16000, freq=220.0), text="A short reference clip.")],
    )
    assert code == 1000
    done = next(e for e in events if isinstance(e, Done))
    assert done.frames == 3


async def test_disconnect_mid_turn_releases_everything(server):
    engine = server.app.state.runtime.engine
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=400)))
    await c.send(Text(text="Talking and talking until the client vanishes."))
    await c.send(Flush())
    await c.until(lambda e: isinstance(e, Audio))
    assert engine.load()["live"] == 1 and engine.codec_worker.decoder.n_open == 1  # mid-turn, really
    c.ws.transport.abort()  # vanish without a close handshake
    # its KV blocks, its engine sequence and its codec stream are all given back
    await poll(engine_at_rest(server), f"not released: {engine.load()}, "
                f"{engine.codec_worker.decoder.n_open} codec streams open")
    assert server.app.state.runtime.metrics.sessions_live == 0
    await still_serving(server.ws_url)


async def test_nothing_to_say_is_a_no_op_and_ready_comes_first(server):
    c = await Client.connect(server.ws_url)
    await c.send(Start(request=request(max_new_tokens=2)))
    # all of this arrives while the voice prompt is still being prefilled
    await c.send(Text(text=""))
    await c.send(Flush())  # nothing pending: no-op, no done
    await c.send(Text(text=" \n "))
    await c.send(Flush())  # whitespace is nothing too
    await c.send(Flush(context_id="never"))
    await c.send(Cancel(context_id="x"))  # acknowledged, but not before ready
    await c.send(Text(text="🙂"))  # emoji or punctuation alone is spoken like any text
    await c.send(Flush())
    await c.send(Text(text="... !!"))
    await c.send(Flush())
    await c.send(Stop())
    events = await c.until(is_finish)
    assert isinstance(events[0], Ready), events[:2]
    assert not [e for e in events if isinstance(e, Error)]
    dones = [e for e in events if isinstance(e, Done)]
    assert [(d.context_id, d.reason) for d in dones[:1]] == [("x", "cancelled")]
    emoji, punct = dones[1:]
    assert (emoji.segments, emoji.frames, emoji.text_chars) == (1, 2, 1)
    assert (punct.segments, punct.frames) == (2, 4)  # "..." and "!!"
    assert len(b"".join(a.audio for a in audio_of(events))) == 6 * 4096
    assert await c.closed() == 1000


async def test_every_segment_ttfa_goes_to_metrics(server):
    metrics = server.app.state.runtime.metrics
    before = sum(metrics.ttfa_counts)
    events, code = await speak(server.ws_url, ["One. Two. ", "Three."], max_new_tokens=2)
    assert code == 1000
    done = next(e for e in events if isinstance(e, Done))
    assert done.segments == 3
    assert sum(metrics.ttfa_counts) - before == 3  # one TTFA per segment
    first, *_ = list(metrics.ttfa_recent)[-3:]
    assert done.ttfa_ms == round(first * 1000, 3)  # done reports the first segment's


async def test_later_sentences_reach_the_engine_as_continuations(server):
    """Every segment had audio (above): the second and third continue an utterance the
    client plays, and the engine serves them first (Turn.continues)."""
    stats = server.app.state.runtime.engine.stats
    before = stats["continuations"]
    events, code = await speak(server.ws_url, ["One. Two. ", "Three."], max_new_tokens=2)
    assert code == 1000
    assert next(e for e in events if isinstance(e, Done)).segments == 3
    assert stats["continuations"] - before == 2
    events, code = await speak(server.ws_url, ["One sentence only."], max_new_tokens=2)
    assert code == 1000 and stats["continuations"] - before == 2
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        text = (await http.get("/metrics")).text
    assert f"rtvoice_engine_continuations_total {int(stats['continuations'])}" in text
    assert 'rtvoice_engine_row_waits_total{kind="continuation"}' in text


async def test_a_streamed_sentence_is_prefilled_ahead_and_sounds_the_same(server):
    """Text streamed word by word into an idle session: the start of the sentence is
    prefilled while it streams (the engine's ahead counters move), and the audio is that of
    the sentence sent whole (same seed), up to the codec ticks' rounding."""
    words = "Your table for two is booked at eight tonight, and the kitchen closes late."
    stats = server.app.state.runtime.engine.stats

    async def session(pieces: list[str], pause_s: float) -> bytes:
        c = await Client.connect(server.ws_url)
        await c.send(Start(request=request(seed=7, max_new_tokens=5)))
        assert isinstance(await c.recv(), Ready)
        for p in pieces:
            await c.send(Text(text=p))
            await asyncio.sleep(pause_s)
        await c.send(Flush())
        await c.send(Stop())
        events = await c.until(is_finish)
        await c.closed()
        assert next(e for e in events if isinstance(e, Done)).reason in ("length", "eos")
        return b"".join(a.audio for a in audio_of(events))

    whole = await session([words], 0.0)
    jobs, hits = stats["ahead_jobs"], stats["ahead_hits"]
    streamed = await session([w + " " for w in words.split()], 0.05)
    assert stats["ahead_jobs"] > jobs and stats["ahead_hits"] == hits + 1
    # the same frames: the PCM equal but for the codec's streaming ticks, which timing may cut
    # differently (streamed and offline decodes agree within 2e-5 of full scale: < 1 LSB)
    got, want = np.frombuffer(streamed, np.int16), np.frombuffer(whole, np.int16)
    assert got.shape == want.shape and want.size > 0
    assert int(np.abs(got.astype(np.int32) - want).max()) <= 2
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        text = (await http.get("/metrics")).text
    assert 'rtvoice_engine_prefill_ahead_total{result="hits"}' in text


# ------------------------------------------------------------------------------ HTTP side


async def test_health_ready_metrics(server):
    await still_serving(server.ws_url)
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        r = await http.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = await http.get("/ready")
        body = r.json()
        assert r.status_code == 200 and body["ready"] and body["model"] == "tiny"
        assert body["random_weights"] is True and body["engine"]["free_rows"] >= 1
        r = await http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
    for name in ("rtvoice_sessions_total", "rtvoice_turns_total", "rtvoice_ttfa_seconds_bucket",
                 "rtvoice_ttfa_recent_seconds", "rtvoice_frames_total", "rtvoice_errors_total",
                 "rtvoice_engine_free_rows", "rtvoice_model_info"):
        assert name in text, name
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["rtvoice_frames_total"] > 0
    assert samples['rtvoice_ttfa_seconds_bucket{le="+Inf"}'] == samples["rtvoice_ttfa_seconds_count"] > 0
    assert samples["rtvoice_connections_open"] >= 0
    assert samples["rtvoice_engine_codec_slow_ticks_total"] >= 0
    # the start-up heap is frozen (gc_freeze, on by default): the collector's passes are timed
    assert samples["rtvoice_gc_frozen_objects"] > 10_000 and gc.get_freeze_count() > 10_000
    assert all(f'rtvoice_gc_pause_max_seconds{{generation="{g}"}}' in samples for g in range(3))
    assert samples['rtvoice_gc_passes_total{generation="0"}'] > 0


async def test_ready_reports_a_stalled_device(server):
    """A device wait far past the engine's stall limit (a GPU that stopped making progress)
    turns /ready into 503 with a reason naming it, and shows on /metrics."""
    import time as _time

    from rtvoice.http import runtime_of

    engine = runtime_of(server.app).engine
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        engine.decode_worker.waiting_since = _time.perf_counter() - (engine.cfg.stall_s + 5)
        try:
            r = await http.get("/ready")
            text = (await http.get("/metrics")).text
        finally:
            engine.decode_worker.waiting_since = None
        assert r.status_code == 503 and r.json()["ready"] is False
        assert "device stalled" in r.json()["reason"]
        wait = next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("rtvoice_engine_device_wait_seconds "))
        assert wait > engine.cfg.stall_s
        r = await http.get("/ready")
        assert r.status_code == 200 and r.json()["engine"]["device_wait_s"] < engine.cfg.stall_s


async def test_ready_reports_a_stuck_engine_thread(server, caplog):
    """A decode thread stuck in one pass of its loop (here: held in an engine command) past
    the stall limit turns /ready into 503 naming it, shows on /metrics, and logs where the
    engine threads are; it recovers when the thread moves on."""
    from rtvoice.http import runtime_of

    engine = runtime_of(server.app).engine
    gate, limit = threading.Event(), engine.cfg.stall_s
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        engine._post(lambda: gate.wait(30))  # runs on the decode thread, which waits there
        try:
            engine.cfg.stall_s = 0.3
            await poll(lambda: engine.loop_stall_s() > 0.3, "the decode thread never looked stuck")
            with caplog.at_level("ERROR", logger="rtvoice.app"):
                r = await http.get("/ready")
            text = (await http.get("/metrics")).text
        finally:
            gate.set()
            engine.cfg.stall_s = limit
        assert r.status_code == 503 and "engine stalled" in r.json()["reason"], r.json()
        assert "--- rtvoice-decode" in caplog.text and "gate.wait(30)" in caplog.text
        stall = next(float(line.split()[1]) for line in text.splitlines()
                     if line.startswith("rtvoice_engine_loop_stall_seconds "))
        assert stall > 0.3
        await poll(lambda: engine.loop_stall_s() < 0.3, "the decode thread never moved on")
        assert (await http.get("/ready")).status_code == 200


async def test_a_stuck_prefill_round_counts_as_a_stall(server):
    """The prefill thread is watched while it runs a round (not while it waits for jobs): a
    round held past the limit shows in loop_stall_s, and goes once the round ends."""
    from rtvoice.http import runtime_of

    engine = runtime_of(server.app).engine
    worker, gate = engine.prefill_worker, threading.Event()
    real_round = worker.round

    def held_round(jobs):  # runs on the prefill thread
        gate.wait(30)
        return real_round(jobs)

    assert engine.loop_stall_s() < 1.0  # idle prefill thread: not a stall
    worker.round = held_round
    try:
        c = await Client.connect(server.ws_url)
        # the default voice may be a shared prefix already (no prefill): the turn's is held
        await c.send(Start(request=request()))
        await c.send(Text(text="Held for a moment."))
        await c.send(Flush())
        await poll(lambda: engine.loop_stall_s() > 0.5, "a held prefill round never showed")
    finally:
        worker.round = real_round
        gate.set()
    await c.send(Stop())
    events = await c.until(is_finish)
    assert isinstance(events[0], Ready) and any(isinstance(e, Done) for e in events)
    await poll(lambda: engine.loop_stall_s() < 0.5, "the prefill thread never moved on")


def test_overloaded_and_idle_timeout():
    async def run(base: str, url: str) -> None:
        first = await Client.connect(url)
        await first.send(Start(request=request()))
        assert isinstance(await first.recv(), Ready)
        err, code = await _fatal(url, Start(request=request()))
        assert err.code == "overloaded" and code == 1013
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            r = await http.get("/ready")
            assert r.status_code == 503 and r.json()["ready"] is False
        # the idle session is closed by the server with a timeout error
        events = await first.until(is_finish)
        err = next(e for e in events if isinstance(e, Error))
        assert err.code == "timeout" and events[-1].reason == "error"
        assert await first.closed() == 1008
        # a socket that never says anything is closed too
        silent = await Client.connect(url)
        assert await silent.closed() == 1008

    with running_server(max_sessions=1, idle_timeout_s=1.0, start_timeout_s=1.0) as url:
        asyncio.run(run(url, url.ws_url))


# ------------------------------------------------------------------------------ a small engine


@pytest.fixture(scope="module")
def small_server():
    """KV for one session of 256 positions (a pool of one 256-position block, nothing shared or
    evicted), one decode row, one place in the wait queue, 64 queued events per socket."""
    with running_server(max_len=256, max_running=1, max_waiting=1, min_turn_frames=2,
                        kv_block_size=256, kv_blocks=1, prefix_cache=0, kv_host_gib=0,
                        budget_multiplier=0.5, send_queue_events=64) as url:
        yield url


async def test_segments_are_capped_to_what_the_context_holds(small_server):
    room = segment_chars(small_server.app.state.runtime.engine.text_room([]))
    assert 10 <= room < 100
    # 100 CJK characters without a boundary = 300 byte tokens: more than the whole context
    events, code = await speak(small_server.ws_url, ["字" * 100], chunk_length=1000,
                               max_new_tokens=2)
    assert code == 1000 and not [e for e in events if isinstance(e, Error)]
    done = next(e for e in events if isinstance(e, Done))
    assert done.reason == "length" and done.segments == math.ceil(100 / room)
    assert done.frames == 2 * done.segments
    await wait_at_rest(small_server)


async def test_segment_the_engine_cannot_fit_ends_its_turn_not_the_session(small_server,
                                                                           monkeypatch):
    # Pretend 1 token per character: the cap lets through a segment the engine refuses.
    monkeypatch.setattr(rtvoice.turns, "WORST_TOKENS_PER_CHAR", 1)
    c = await Client.connect(small_server.ws_url)
    await c.send(Start(request=request(chunk_length=1000, max_new_tokens=2)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Text(text="字" * 100))
    await c.send(Flush())
    evs = await c.until(is_done())
    err = next(e for e in evs if isinstance(e, Error))
    assert err.code == "too_large" and not err.fatal and "not spoken" in err.message
    assert evs[-1].reason == "error" and evs[-1].frames == 0
    # the session goes on
    await c.send(Text(text="This fits."))
    await c.send(Flush())
    done = (await c.until(is_done()))[-1]
    assert done.reason == "length" and done.frames == 2
    await c.send(Stop())
    assert (await c.until(is_finish))[-1].reason == "stop"
    assert await c.closed() == 1000
    await wait_at_rest(small_server)
    assert err.done_follows

    # The client library: the error rides on that turn's result, the next turn is unharmed
    # (found in review: it failed the turn at the error, then gave its done to the next turn).
    from clients import connect

    async with connect(small_server, chunk_length=1000, max_new_tokens=2) as session:
        await session.wait_ready()
        bad = await session.feed(["字" * 100])
        good = await session.feed(["This fits."])
        bad_result, good_result = await bad, await good
        assert bad_result.reason == "error" and bad_result.error is not None
        assert bad_result.error.code == "too_large" and not bad_result.error.fatal
        assert good_result.reason == "length" and good_result.frames == 2
        assert good_result.error is None
    await wait_at_rest(small_server)


async def test_voice_too_large_for_the_context(small_server):
    clip = wav_bytes(0.4, rate=16000, freq=220.0)
    files = {"audio": ("clip.wav", clip, "audio/wav")}
    async with httpx.AsyncClient(base_url=small_server, timeout=60) as http:
        r = await http.post("/v1/voices", files=files, data={"transcript": "word " * 60})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text
        assert "leaves room for" in r.json()["error"]["message"]
        r = await http.post("/v1/voices", files=files, data={"transcript": "Short clip."})
        assert r.status_code == 201, r.text  # a voice that fits is taken
    # the same clip inline in start: too_large as well, before any prefill
    err, code = await _fatal(small_server.ws_url, Start(request=request(
        references=[ReferenceAudio(audio=clip, text="word " * 60)])))
    assert err.code == "too_large" and code == 1009 and "leaves room for" in err.message
    await wait_at_rest(small_server)


async def test_waiting_session_that_leaves_gives_its_place_back(small_server):
    engine = small_server.app.state.runtime.engine
    a = await Client.connect(small_server.ws_url)
    await a.send(Start(request=request()))
    assert isinstance(await a.recv(), Ready)
    b = await Client.connect(small_server.ws_url)
    await b.send(Start(request=request()))
    await poll(lambda: engine.load()["waiting"] == 1, "B does not wait for KV blocks")
    async with httpx.AsyncClient(base_url=small_server, timeout=30) as http:
        r = await http.get("/ready")  # the pool is full, one waiting: send others elsewhere
        assert r.status_code == 503 and "KV pool is full" in r.json()["reason"], r.json()
        await b.close()  # B gives up before it got blocks
        await poll(lambda: engine.load()["waiting"] == 0, "B still holds its place in the queue")
        r = await http.get("/ready")  # no block free yet: still not ready, truthfully
        assert r.status_code == 503 and r.json()["engine"]["waiting"] == 0, r.json()
        c = await Client.connect(small_server.ws_url)
        await c.send(Start(request=request()))  # waits for A's blocks (not overloaded)
        await a.send(Stop())
        await a.until(is_finish)
        assert await a.closed() == 1000
        assert isinstance(await c.recv(), Ready)
        await c.send(Stop())
        await c.until(is_finish)
        assert await c.closed() == 1000
        await wait_at_rest(small_server)
        r = await http.get("/ready")  # the pool is free again
        assert r.status_code == 200 and r.json()["ready"], r.json()


async def test_client_that_reads_no_events_is_dropped(small_server, monkeypatch):
    """A client that sends cancels (each answered by a done) and reads nothing: its queue of
    events is bounded (send_queue_events=64), then it is dropped like a slow reader."""
    from starlette.websockets import WebSocket

    stalled = threading.Event()  # the socket accepts nothing while set
    real_send = WebSocket.send_bytes

    async def send_bytes(self: WebSocket, data: bytes) -> None:
        while stalled.is_set():
            await asyncio.sleep(0.005)
        await real_send(self, data)

    monkeypatch.setattr(WebSocket, "send_bytes", send_bytes)
    metrics = small_server.app.state.runtime.metrics
    slow = metrics.slow_clients
    c = await Client.connect(small_server.ws_url)
    await c.send(Start(request=request()))
    assert isinstance(await c.recv(), Ready)
    stalled.set()
    for _ in range(200):
        await c.send(Cancel())
    await poll(lambda: metrics.slow_clients > slow, "the client was not dropped")
    stalled.clear()
    events = await c.until(is_finish)
    err = next(e for e in events if isinstance(e, Error))
    assert err.code == "timeout" and err.fatal and "not reading its events" in err.message
    assert len(events) <= 3  # the done in flight, error, finish: the queue was dropped
    assert await c.closed() == 1008
    await wait_at_rest(small_server)


def test_startup_refuses_a_context_too_small_for_any_segment():
    from rtvoice.runtime import Runtime
    from rtvoice.settings import Settings
    from rtvoice.testing import _shared_bundle

    settings = Settings().replace(max_len=128, max_running=1)
    with pytest.raises(ValueError, match="max_len=128 leaves room for 0 characters"):
        asyncio.run(Runtime.start(settings, _shared_bundle(settings)))


def test_shutdown_tells_live_sessions():
    """Stopping the server ends every live session with a shutting_down error and a 1001
    close (not a bare drop), so clients know to reconnect elsewhere."""
    events: list[Any] = []
    codes: list[int | None] = []
    ready = threading.Event()

    def client(url: str) -> None:
        async def run() -> None:
            c = await Client.connect(url)
            await c.send(Start(request=request()))
            assert isinstance(await c.recv(), Ready)
            ready.set()
            events.extend(await c.until(is_finish))
            codes.append(await c.closed())

        asyncio.run(run())

    with running_server() as base:
        t = threading.Thread(target=client, args=(base.ws_url,))
        t.start()
        assert ready.wait(60)
    t.join(60)
    err = next(e for e in events if isinstance(e, Error))
    assert err.code == "shutting_down" and err.fatal
    assert events[-1].reason == "error" and codes == [1001]


def test_one_info_line_per_session_and_per_turn(caplog):
    """At the default log level, each session says when it is ready and how it ended, and
    each turn how it ended: ids, voice, TTFA, audio seconds, reason."""
    import logging

    async def run(url: Any) -> None:
        c = await Client.connect(url.ws_url)
        await c.send(Start(request=request(max_new_tokens=4)))
        assert isinstance(await c.recv(), Ready)
        await c.send(Text(text="Log me."))
        await c.send(Flush())
        await c.send(Stop())
        await c.until(is_finish)
        await c.closed()

    caplog.set_level(logging.INFO, logger="rtvoice.session")
    with running_server(max_turn_frames=4) as url:
        asyncio.run(run(url))
    lines = [r.getMessage() for r in caplog.records if r.name == "rtvoice.session"]
    ready = [line for line in lines if " ready: " in line]
    turns = [line for line in lines if line.startswith("turn ")]
    ended = [line for line in lines if " ended (" in line]
    assert len(ready) == len(turns) == len(ended) == 1, lines
    assert "voice default" in ready[0] and "prefill" in ready[0]
    assert "done: length, voice default, ttfa " in turns[0] and "s of audio" in turns[0]
    assert "ended (stop, socket kept for another start): voice default, 1 turns" in ended[0]


def test_the_socket_stays_open_after_finish_for_another_start():
    """Fish's clients reuse a socket after finish{stop} (LiveKit's plugin pools them): the
    next start on it is a new session; a socket nobody reuses closes 1000 after
    reuse_timeout_s, and 0 closes it at once."""

    async def turn(c: Client) -> Ready:
        await c.send(Start(request=request(max_new_tokens=4)))
        ready = await c.recv()
        assert isinstance(ready, Ready)
        await c.send(Text(text="Once more."))
        await c.send(Flush())
        await c.send(Stop())
        events = await c.until(is_finish)
        assert any(isinstance(e, Audio) for e in events) and events[-1].reason == "stop"
        return ready

    async def run(url: Any) -> None:
        c = await Client.connect(url.ws_url)
        first, second = await turn(c), await turn(c)
        assert first.session_id != second.session_id
        assert url.app.state.runtime.metrics.connections_total == 1
        t0 = time.monotonic()
        assert await asyncio.wait_for(c.ws.wait_closed(), 30) is None
        assert c.ws.close_code == 1000 and 0.3 < time.monotonic() - t0 < 10
        assert not [e for e in c.events if isinstance(e, Error)]

    with running_server(max_turn_frames=4, reuse_timeout_s=0.5) as url:
        asyncio.run(run(url))

    async def no_reuse(url: Any) -> None:
        c = await Client.connect(url.ws_url)
        await turn(c)
        await asyncio.wait_for(c.ws.wait_closed(), 10)
        assert c.ws.close_code == 1000

    with running_server(max_turn_frames=4, reuse_timeout_s=0) as url:
        asyncio.run(no_reuse(url))

    async def crowded(url: Any) -> None:
        """Kept sockets give their place to new connections (max_unstarted); a stop before
        any start is no session to keep the socket for."""
        rt = url.app.state.runtime
        kept = [await Client.connect(url.ws_url) for _ in range(2)]
        for c in kept:
            await turn(c)
        await poll(lambda: rt.metrics.lingering == 2, "the sockets were not kept")
        newcomer = await Client.connect(url.ws_url)  # over max_unstarted with the kept ones
        await asyncio.wait_for(kept[0].ws.wait_closed(), 10)
        assert kept[0].ws.close_code == 1000 and kept[1].ws.close_code is None
        await turn(newcomer)
        never = await Client.connect(url.ws_url)
        await never.send(Stop())
        assert (await never.until(is_finish))[-1].reason == "stop"
        await asyncio.wait_for(never.ws.wait_closed(), 10)
        assert never.ws.close_code == 1000
        for c in (kept[1], newcomer):
            await c.close()

    with running_server(max_turn_frames=4, max_unstarted=2) as url:
        asyncio.run(crowded(url))


# ------------------------------------------------------------------------------ background load
def test_load_in_background_serves_health_then_speaks(monkeypatch):
    """load_in_background: the port answers while the engine builds — /health 200 'loading',
    /ready 503 'loading the model', the API and the socket 503 with Retry-After naming the
    load — and once it is built the server is ready and speaks."""
    import rtvoice.runtime

    release, building = threading.Event(), threading.Event()
    real = rtvoice.runtime.build_engine

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        building.set()
        assert release.wait(30), "the test never released the build"
        return real(*args, **kwargs)

    monkeypatch.setattr(rtvoice.runtime, "build_engine", slow_build)

    async def run(url: Any) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert building.wait(10)
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "loading"
            r = await http.get("/ready")
            assert r.status_code == 503 and r.json()["loading"] is True
            assert r.json()["reason"] == "loading the model"
            r = await http.get("/v1/voices")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "still loading" in r.text
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(url.ws_url, open_timeout=10)
            denial = refused.value.response
            assert denial.status_code == 503
            assert json.loads(denial.body)["error"]["code"] == "shutting_down"
            assert "still loading" in json.loads(denial.body)["error"]["message"]
            release.set()
            deadline = time.monotonic() + 30
            while (r := await http.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, f"not ready after the build: {r.json()}"
                await asyncio.sleep(0.02)
            assert r.json()["ready"] is True
            assert (await http.get("/health")).json()["status"] == "ok"
        events, code = await speak(url.ws_url, ["Hello there, background load."])
        assert code == 1000 and audio_of(events)

    try:
        with running_server(load_in_background=True) as url:
            asyncio.run(run(url))
    finally:
        release.set()


def test_load_in_background_failure_fails_health_and_exits(monkeypatch):
    """A background load that fails: /health turns 503 naming the error and the server ends
    with exit status 1 (an orchestrator restarts it); nothing hangs at 'loading'."""
    import rtvoice.runtime

    def broken(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        raise RuntimeError("no GPU memory left for the KV pool")

    monkeypatch.setattr(rtvoice.runtime, "build_engine", broken)
    with running_server(load_in_background=True) as url:
        app = url.app
        deadline = time.monotonic() + 10
        while not getattr(app.state, "load_error", None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "no GPU memory left" in app.state.load_error
        assert not app.state.loading and app.state.runtime is None
        assert app.state.request_exit.__self__.exit_code == 1
        assert app.state.request_exit.__self__.should_exit
