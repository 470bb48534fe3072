"""Fish's REST ``POST /v1/tts`` and OpenAI's ``POST /v1/audio/speech`` / ``GET /v1/models``
against a live server, with the official SDKs (fish-audio-sdk, openai) and with plain HTTP
for the errors."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import soundfile as sf
from _audio import wav_bytes
from _live import Client, engine_at_rest, is_finish, poll, request

from protocol import Audio, Done, Flush, Ready, Start, Stop, Text
from rtvoice.testing import running_server

pytestmark = pytest.mark.timeout(180)

FRAMES = 8  # max_turn_frames: every segment is exactly this long (random weights rarely stop)
HOP = 2048


@pytest.fixture(scope="module")
def server():
    with running_server(max_turn_frames=FRAMES, budget_multiplier=1.0, min_turn_frames=FRAMES,
                        max_message_bytes=512 * 1024, max_text_chars=400) as url:
        yield url


def _fish(url: str) -> Any:
    from fishaudio import FishAudio

    return FishAudio(api_key="unused", base_url=str(url))


def _openai(url: str, key: str = "unused") -> Any:
    from openai import OpenAI

    return OpenAI(api_key=key, base_url=f"{url}/v1", max_retries=0)


async def _socket_pcm(url: str, text: str, **req: Any) -> bytes:
    c = await Client.connect(url)
    await c.send(Start(request=request(max_new_tokens=FRAMES, **req)))
    assert isinstance(await c.recv(), Ready)
    await c.send(Text(text=text))
    await c.send(Flush())
    await c.send(Stop())
    events = await c.until(is_finish)
    return b"".join(e.audio for e in events if isinstance(e, Audio))


def _close(a: bytes, b: bytes) -> bool:
    x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
    return x.shape == y.shape and int(np.abs(x - y).max(initial=0)) <= 8


# ------------------------------------------------------------------------------ Fish REST


def test_fish_sdk_convert_and_stream_give_the_sockets_audio(server):
    """The official SDK's tts.convert() and tts.stream() (msgpack body, model header) get
    the audio the socket gives for the same request: the same engine, voice and budget."""
    fish = _fish(server)
    text = "Hello from the REST endpoint."
    pcm = fish.tts.convert(text=text, format="pcm",
                           config=_fish_config(top_p=0.0, seed=3, max_new_tokens=FRAMES))
    assert len(pcm) == FRAMES * HOP * 2  # one segment of FRAMES frames, 44.1 kHz s16le
    live = asyncio.run(_socket_pcm(server.ws_url, text, top_p=0.0, seed=3))
    assert _close(pcm, live)
    mp3 = b"".join(fish.tts.stream(text=text, format="mp3"))
    audio, rate = sf.read(io.BytesIO(mp3))
    assert rate == 44100 and abs(len(audio) - FRAMES * HOP) < 2 * 1152 + 600
    # the response's last byte can reach the client a moment before the request is closed
    asyncio.run(poll(engine_at_rest(server), "the requests kept their slots"))


def _fish_config(**kw: Any) -> Any:
    from fishaudio.types import TTSConfig

    fields = TTSConfig.model_fields
    return TTSConfig(**{k: v for k, v in kw.items() if k in fields})


def test_fish_rest_json_body_voice_and_headers(server):
    voice = httpx.post(f"{server}/v1/voices", files={"audio": ("a.wav", wav_bytes(1.0))},
                       data={"transcript": "A reference clip.", "name": "rest-voice"},
                       timeout=60).json()["id"]
    body = {"text": "Stored voice, JSON body.", "format": "wav", "reference_id": voice,
            "opus_bitrate": 64000, "sample_rate": 32000, "prosody": {"speed": 1.0}}
    with httpx.stream("POST", f"{server}/v1/tts", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert r.headers["x-request-id"].startswith("r")
        data = b"".join(r.iter_bytes())
    audio, rate = sf.read(io.BytesIO(data))
    assert rate == 32000 and len(audio) == pytest.approx(FRAMES * HOP * 32000 / 44100, abs=2)


@pytest.mark.parametrize(("content", "headers", "status", "code"), [
    (b"\xc1", {"content-type": "application/msgpack"}, 400, "malformed_message"),
    (msgspec.msgpack.encode({"text": 5}), {"content-type": "application/msgpack"}, 400,
     "invalid_field"),
    (b'{"text": "hi", "format": "flac"}', {"content-type": "application/json"}, 415,
     "unsupported_format"),
    (b'{"text": "hi", "reference_id": "nope"}', {"content-type": "application/json"}, 404,
     "unknown_voice"),
    (b'{"text": "   "}', {"content-type": "application/json"}, 400, "bad_request"),
    (b'{"text": "hi", "first_chunk_frames": 9, "chunk_frames": 4}',
     {"content-type": "application/json"}, 400, "invalid_field"),
    (json.dumps({"text": "x" * 401}).encode(), {"content-type": "application/json"}, 413,
     "too_large"),
    (b"x" * (512 * 1024 + 1), {"content-type": "application/json"}, 413, "too_large"),
    (b'{"text": "hi"}', {"content-type": "text/plain"}, 400, "bad_request"),
    (b'{"text": "hi", "references": [{"audio": "AAAA", "text": "t"}]}',
     {"content-type": "application/json"}, 422, "bad_reference_audio"),
])
def test_fish_rest_errors_are_statuses_with_json_bodies(server, content, headers, status, code):
    r = httpx.post(f"{server}/v1/tts", content=content, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
    assert engine_at_rest(server)() and server.app.state.runtime.metrics.sessions_live == 0


def test_rest_needs_the_api_key_like_the_socket():
    with running_server(api_keys="k-rest", max_turn_frames=4) as url:
        r = httpx.post(f"{url}/v1/tts", json={"text": "hi"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = httpx.post(f"{url}/v1/tts", json={"text": "hi", "format": "pcm"}, timeout=30,
                       headers={"Authorization": "Bearer k-rest"})
        assert r.status_code == 200 and len(r.content) == 4 * HOP * 2
        from openai import AuthenticationError

        with pytest.raises(AuthenticationError):
            _openai(url, key="wrong").models.list()
        assert [m.id for m in _openai(url, key="k-rest").models.list()] == ["tiny"]


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            text = "A long text to speak. " * 12  # several segments
            async with http.stream("POST", "/v1/tts", json={"text": text, "format": "pcm"}) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break  # gone after the first chunk
        await poll(engine_at_rest(server), "the request still holds the engine", 30)
        await poll(lambda: server.app.state.runtime.metrics.sessions_live == 0,
                   "the request still counts as a session")

    asyncio.run(run())


# ------------------------------------------------------------------------------ OpenAI


def test_openai_sdk_one_shot_formats(server):
    oa = _openai(server)
    pcm = oa.audio.speech.create(model="tts-1", voice="alloy", input="Hello there.",
                                 response_format="pcm").content
    assert len(pcm) == pytest.approx(FRAMES * HOP * 24000 / 44100 * 2, abs=4)  # 24 kHz s16le
    for fmt, rate in (("wav", 44100), ("flac", 44100), ("mp3", 44100), ("opus", 48000)):
        data = oa.audio.speech.create(model="gpt-4o-mini-tts", voice="nova", input="Hi.",
                                      response_format=fmt).content
        audio, got = sf.read(io.BytesIO(data))
        assert got == rate and len(audio) > 0.5 * FRAMES * HOP * rate / 44100, fmt


def test_openai_sdk_streamed_and_sse(server):
    oa = _openai(server)
    with oa.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="First sentence. Second sentence.",
            response_format="pcm") as resp:
        chunks = list(resp.iter_bytes())
    assert sum(map(len, chunks)) == pytest.approx(2 * FRAMES * HOP * 24000 / 44100 * 2, abs=8)
    raw = oa.audio.speech.create(model="tts-1", voice="alloy", input="Hi there.",
                                 response_format="pcm", stream_format="sse").content
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == pytest.approx(FRAMES * HOP * 24000 / 44100 * 2, abs=4)
    assert events[-1]["usage"]["output_tokens"] == FRAMES


def test_openai_voices_by_id_name_and_builtin_names(server):
    oa = _openai(server)
    voice = httpx.post(f"{server}/v1/voices", files={"audio": ("b.wav", wav_bytes(1.0, seed=4))},
                       data={"transcript": "Another clip.", "name": "openai-voice"},
                       timeout=60).json()
    by_name = oa.audio.speech.create(model="tts-1", voice="openai-voice", input="Hi.",
                                     response_format="pcm").content
    by_id = oa.audio.speech.create(model="tts-1", voice=voice["id"], input="Hi.",
                                   response_format="pcm").content
    default = oa.audio.speech.create(model="tts-1", voice="shimmer", input="Hi.",
                                     response_format="pcm").content
    assert len(by_name) == len(by_id) == len(default) > 0
    from openai import BadRequestError, NotFoundError

    with pytest.raises(NotFoundError, match="no stored voice"):
        oa.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    with pytest.raises(BadRequestError, match="no speed control"):
        oa.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", speed=1.5)
    with pytest.raises(BadRequestError, match="'aac' is not supported"):
        oa.audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                               response_format="aac")
    r = httpx.post(f"{server}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_field"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_rest_requests_count_as_sessions_and_in_metrics(server):
    m = server.app.state.runtime.metrics
    before = m.sessions_total
    r = httpx.post(f"{server}/v1/tts", json={"text": "Counted.", "format": "pcm"}, timeout=60)
    assert r.status_code == 200 and m.sessions_total == before + 1 and m.sessions_live == 0
    text = httpx.get(f"{server}/metrics", timeout=30).text
    assert 'rtvoice_turns_total{reason="length"}' in text
    with running_server(max_sessions=1, max_turn_frames=4) as url:
        async def run() -> None:
            c = await Client.connect(url.ws_url)
            await c.send(Start(request=request()))
            assert isinstance(await c.recv(), Ready)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                r = await http.post("/v1/tts", json={"text": "No room.", "format": "pcm"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            await c.send(Stop())
            await c.until(lambda e: isinstance(e, Done) or is_finish(e))

        asyncio.run(run())


# ------------------------------------------------------------------------------ hostile clients

_LONG = " ".join(f"Sentence number {i} of a long text nobody reads." for i in range(40))


def _raw_post(url: Any, path: str, body: dict[str, Any], rcvbuf: int = 4096) -> Any:
    """A POST from a client that then reads nothing (a tiny receive buffer)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(str(url))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((u.hostname, u.port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _at_rest(url: Any) -> bool:
    rt = url.app.state.runtime
    return engine_at_rest(url)() and rt.metrics.sessions_live == 0 and not rt.sessions


@pytest.mark.parametrize("bound", ["send_queue_bytes", "send_timeout_s"])
def test_a_rest_client_that_stops_reading_gives_its_slot_back(bound):
    """Found in review: audio for a REST client that stopped reading piled up unbounded and
    held its KV slot and session. Now the socket's bounds apply: queued audio
    (send_queue_bytes) and time without accepting data (send_timeout_s).

    The next segment starts when the response has taken the last one's end, so a reader
    that stalls at a segment boundary makes the server generate nothing more (no queue to
    bound; send_timeout_s cuts it): the stall must come inside a segment with more than the
    bound still to come. With the send buffer Linux grows on its own (~3 MB here) it fell at
    a boundary now and then (a CI run waited its whole 120 s). With 8 KB the response stalls
    after ~32 frames (the rest of what it took waits in uvicorn's 64 KB write buffer), inside
    the first segment's 128, and the ~96 behind it (768 KB of float32 PCM) are three times
    the 256 KB bound, which a reading client's backlog stays well under (~100 KB seen)."""
    # only the bound under test can trip (the other one is far away)
    limits = ({"send_queue_bytes": 256 * 1024, "send_timeout_s": 600.0}
              if bound == "send_queue_bytes"
              else {"send_timeout_s": 1.0, "send_queue_bytes": 1 << 30})
    with running_server(send_buffer_bytes=8192, max_turn_frames=128, min_turn_frames=128,
                        max_text_chars=4000, **limits) as url:
        m = url.app.state.runtime.metrics
        s = _raw_post(url, "/v1/tts", {"text": _LONG, "format": "pcm"})
        try:
            asyncio.run(poll(lambda: m.slow_clients == 1 and _at_rest(url),
                             "the stalled request kept its slot", timeout=120))
            assert 'rtvoice_limit_hits_total{limit="' + bound + '"}' in httpx.get(
                f"{url}/metrics", timeout=30).text
        finally:
            s.close()
        # the server goes on serving
        # (16 frames, 128 KB of float32 PCM: under the bound however slowly this one reads)
        r = httpx.post(f"{url}/v1/tts", timeout=60,
                       json={"text": "Still here.", "format": "pcm", "max_new_tokens": 16})
        assert r.status_code == 200 and len(r.content) > 0


def test_a_rest_client_gone_before_its_audio_frees_its_place_in_the_queue():
    """Found in review: a client that hung up while its request waited for KV kept its
    place (and its session) until the prefill."""
    with running_server(max_running=1, max_turn_frames=4, max_len=256, kv_block_size=256,
                        kv_blocks=1, prefix_cache=0, kv_host_gib=0) as url:
        rt = url.app.state.runtime

        async def run() -> None:
            holder = await Client.connect(url.ws_url)  # holds the pool's one block
            await holder.send(Start(request=request()))
            assert isinstance(await holder.recv(), Ready)
            s = _raw_post(url, "/v1/tts", {"text": "Waiting.", "format": "pcm"})
            await poll(lambda: rt.engine.load()["waiting"] == 1, "the request never queued")
            s.close()
            await poll(lambda: rt.engine.load()["waiting"] == 0 and rt.metrics.sessions_live == 1,
                       "the request outlived its client")
            await holder.send(Stop())
            await holder.until(is_finish)

        asyncio.run(run())


def test_rest_while_draining_is_refused_and_errors_keep_each_apis_shape():
    with running_server(max_turn_frames=4, api_keys="k-1") as url:
        rt = url.app.state.runtime
        auth = {"Authorization": "Bearer k-1"}
        r = httpx.post(f"{url}/v1/audio/speech", json={"model": "m", "voice": "alloy",
                                                       "input": "Hi."}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        rt.metrics.draining = True
        try:
            r = httpx.post(f"{url}/v1/tts", json={"text": "Hi."}, headers=auth, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert r.headers["Retry-After"] == "1"
            r = httpx.post(f"{url}/v1/audio/speech", headers=auth, timeout=30,
                           json={"model": "m", "voice": "alloy", "input": "Hi."})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            assert r.json()["error"]["code"] == "shutting_down"
        finally:
            rt.metrics.draining = False


def test_an_encoder_is_never_closed_while_a_pool_thread_encodes(monkeypatch):
    """Found in review: a client leaving mid-stream cancelled the await of an encode whose
    pool thread went on, and the encoder (libsndfile for mp3/opus) was closed under it."""
    import threading
    import time as _time

    import rtvoice.synthesis as synthesis

    seen = {"closed_during": 0, "closes": 0}
    lock = threading.Lock()
    real = synthesis.encoder_for

    class Slow:
        """An encoder whose encode takes a while; it notes a close while it encodes."""

        def __init__(self, enc: Any) -> None:
            self.enc = enc
            self.busy = False

        def encode(self, pcm: Any) -> bytes:
            self.busy = True
            try:
                _time.sleep(0.3)
                return self.enc.encode(pcm)
            finally:
                self.busy = False

        def finish(self) -> bytes:
            return self.enc.finish()

        def close(self) -> None:
            with lock:
                seen["closes"] += 1
                seen["closed_during"] += self.busy
            self.enc.close()

    monkeypatch.setattr(synthesis, "encoder_for", lambda output: Slow(real(output)))
    with running_server(max_turn_frames=16) as url:
        for _ in range(3):
            with httpx.stream("POST", f"{url}/v1/tts", timeout=60,
                              json={"text": _LONG[:300], "format": "mp3"}) as r:
                next(r.iter_bytes())  # the first audio, then the client leaves
        asyncio.run(poll(lambda: _at_rest(url) and seen["closes"] == 3, "requests not closed",
                         timeout=30))
    assert seen["closed_during"] == 0, seen
