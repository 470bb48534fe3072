"""The official Fish Audio SDK against our server, the voices REST API (add, use, list, get,
delete, persistence across a restart) and ``rtvoice serve`` as a real process."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from _audio import wav_bytes

from rtvoice.audio_formats import make_encoder
from rtvoice.testing import running_server

fishaudio = pytest.importorskip("fishaudio")
from fishaudio import FishAudio, TTSConfig  # noqa: E402
from fishaudio import ReferenceAudio as FishReference  # noqa: E402
from fishaudio.exceptions import WebSocketError  # noqa: E402

pytestmark = pytest.mark.timeout(180)

FRAMES = 4  # per segment (the SDK's max_new_tokens); the random model never stops by itself




def add_voice(base: str, *, name: str = "test voice", audio: bytes | None = None,
              transcript: str = "A short reference clip.") -> httpx.Response:
    files = {"audio": ("clip.wav", audio if audio is not None else wav_bytes(), "audio/wav")}
    data = {"transcript": transcript, "name": name}
    return httpx.post(f"{base}/v1/voices", files=files, data=data, timeout=60)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def server(data_dir):
    with running_server(data_dir=data_dir, budget_multiplier=1.0, min_turn_frames=2) as url:
        yield url


@pytest.fixture(scope="module")
def voice_id(server) -> str:
    r = add_voice(server)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def stream(base: str, texts: list[str], **kw) -> bytes:
    client = FishAudio(api_key="test-key", base_url=base)
    config = TTSConfig(max_new_tokens=FRAMES)
    return b"".join(client.tts.stream_websocket(iter(texts), config=config, **kw))


def check_duration(fmt: str, data: bytes, frames: int, rate: int = 44100) -> None:
    if fmt == "pcm":
        x, sr = sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=rate,
                        channels=1)
    else:
        x, sr = sf.read(io.BytesIO(data))
    assert sr == rate
    expected = frames * 2048 / 44100
    got = len(x) / sr
    bound = make_encoder(fmt, rate, input_sample_rate=44100).padding_bound_s
    assert -1 / rate - 1e-9 <= got - expected <= bound + 1e-9, (fmt, got, expected)


TEXTS = ["Hello ", "from the ", "official SDK. ", "Second sentence!"]  # two segments


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3"])
def test_fish_sdk_formats_with_reference_id(server, voice_id, fmt):
    data = stream(server, TEXTS, format=fmt, reference_id=voice_id)
    check_duration(fmt, data, 2 * FRAMES)


def test_fish_sdk_inline_references(server):
    ref = FishReference(audio=wav_bytes(0.4, seed=3), text="Inline reference transcript.")
    data = stream(server, TEXTS, format="wav", references=[ref])
    check_duration("wav", data, 2 * FRAMES)


def test_fish_sdk_opus_default_latency_and_speed(server):
    # every SDK field is sent (prosody, latency, normalize...): accepted, not rejected
    data = stream(server, ["Opus works too."], format="opus", latency="normal", speed=1.2)
    check_duration("opus", data, FRAMES, rate=48000)


def test_fish_sdk_legacy_websocket_session(server):
    legacy = pytest.importorskip("fish_audio_sdk")
    with legacy.WebSocketSession("test-key", base_url=server) as ws:
        req = legacy.TTSRequest(text="", format="pcm", chunk_length=100)
        data = b"".join(ws.tts(req, iter(["Legacy SDK. ", "Still works."])))
    # the legacy request has no max_new_tokens: the server's budget applies, so just check
    # that whole frames of audio arrived
    assert len(data) > 0 and len(data) % (2048 * 2) == 0


def test_fish_sdk_unknown_voice_raises_cleanly(server):
    with pytest.raises(WebSocketError):
        stream(server, ["Hi."], format="pcm", reference_id="missing-voice")
    # and the server keeps serving
    check_duration("pcm", stream(server, ["Still fine."], format="pcm"), FRAMES)


def test_a_voice_by_name_and_the_stock_clients_default_voice_ids(server, voice_id):
    """A stored voice may be named by its name too; the default voice id of a stock client
    written for Fish's cloud (LiveKit's plugin) and OpenAI's names mean the default voice."""
    import asyncio

    from _live import Client, is_finish, request

    from protocol import Audio, Flush, Ready, Start, Stop, Text

    async def pcm(reference_id: str | None) -> bytes:
        c = await Client.connect(server.ws_url)
        await c.send(Start(request=request(max_new_tokens=FRAMES, top_p=0.0, seed=4,
                                           reference_id=reference_id)))
        assert isinstance(await c.recv(), Ready)
        await c.send(Text(text="Which voice is this?"))
        await c.send(Flush())
        await c.send(Stop())
        return b"".join(e.audio for e in await c.until(is_finish) if isinstance(e, Audio))

    def same(a: bytes, b: bytes) -> bool:
        """The same frames: PCM within 8 LSB (batched codec passes move float rounding)."""
        import numpy as np

        x, y = (np.frombuffer(v, dtype="<i2").astype(np.int32) for v in (a, b))
        return len(x) == len(y) and int(np.abs(x - y).max()) <= 8

    async def run() -> None:
        default = await pcm(None)
        assert same(await pcm("933563129e564b19a115bedd57b7406a"), default)  # LiveKit's default
        assert same(await pcm("alloy"), default)
        stored = await pcm(voice_id)
        assert same(await pcm("test voice"), stored) and not same(stored, default)

    asyncio.run(run())


def test_voices_rest_api(server, voice_id):
    r = httpx.get(f"{server}/v1/voices/{voice_id}")
    assert r.status_code == 200
    info = r.json()
    assert info["name"] == "test voice" and info["transcript"] == "A short reference clip."
    assert info["frames"] > 0 and info["codebooks"] == 10
    assert info["sample_rate"] == 22050 and info["duration_s"] == pytest.approx(0.5)
    ids = [v["id"] for v in httpx.get(f"{server}/v1/voices").json()["voices"]]
    assert voice_id in ids
    # errors are JSON with the protocol's codes
    r = httpx.get(f"{server}/v1/voices/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_voice"
    r = add_voice(server, audio=b"definitely not audio")
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_reference_audio"
    r = add_voice(server, transcript="   ")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
    r = httpx.post(f"{server}/v1/voices", json={"transcript": "x"})
    assert r.status_code == 400
    # a body that is not the multipart it claims to be: still the JSON error, not plain text
    r = httpx.post(f"{server}/v1/voices", content=b"--x\r\ngarbage without headers",
                   headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    # add and delete a second voice
    r = add_voice(server, name="temporary")
    assert r.status_code == 201
    tmp_id = r.json()["id"]
    assert httpx.delete(f"{server}/v1/voices/{tmp_id}").json() == {"id": tmp_id, "deleted": True}
    assert httpx.get(f"{server}/v1/voices/{tmp_id}").status_code == 404
    assert httpx.delete(f"{server}/v1/voices/{tmp_id}").status_code == 404


def test_voices_upload_size_limit(tmp_path):
    with running_server(data_dir=tmp_path, max_upload_bytes=10_000) as url:
        r = add_voice(url, audio=wav_bytes(2.0))
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_voices_survive_restart(tmp_path):
    with running_server(data_dir=tmp_path, min_turn_frames=2) as url:
        r = add_voice(url, name="persistent")
        assert r.status_code == 201
        vid = r.json()["id"]
    with running_server(data_dir=tmp_path, min_turn_frames=2) as url:  # a new server process state
        voices = httpx.get(f"{url}/v1/voices").json()["voices"]
        assert [v["id"] for v in voices] == [vid] and voices[0]["name"] == "persistent"
        check_duration("pcm", stream(url, ["Same voice."], format="pcm", reference_id=vid), FRAMES)
        assert httpx.delete(f"{url}/v1/voices/{vid}").status_code == 200
    with running_server(data_dir=tmp_path) as url:
        assert httpx.get(f"{url}/v1/voices").json()["voices"] == []


# ------------------------------------------------------------------------------ rtvoice serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_rtvoice_serve_process(tmp_path):
    """``rtvoice serve`` as a user runs it: tiny model, the random-weights notice, a client
    receives audio, SIGINT shuts it down cleanly."""
    port = _free_port()
    env = {**os.environ, "RTVOICE_DATA_DIR": str(tmp_path), "RTVOICE_MAX_TURN_FRAMES": "4"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rtvoice.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        data = stream(base, ["Hello from a real process."], format="pcm")
        check_duration("pcm", data, FRAMES)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert "RANDOM WEIGHTS" in out and "--model /path/to/s2-pro --device cuda" in out
    assert f"ws://127.0.0.1:{port}/v1/tts/live" in out


def test_api_keys_guard_the_socket_and_the_voices_api(tmp_path):
    """With api_keys set: Fish's SDK (Authorization: Bearer) and our client work with a
    valid key; a missing or wrong key gets 'unauthorized' (fatal error + close 1008 on the
    socket, 401 on REST); ?api_key= works for browsers; health/ready/metrics stay open."""
    import asyncio

    from clients import UnauthorizedError, connect

    with running_server(data_dir=tmp_path, api_keys="k-one, k-two", budget_multiplier=1.0,
                        min_turn_frames=2) as base:
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{base}{path}").status_code == 200, path
        r = httpx.get(f"{base}/v1/voices")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{base}/v1/voices",
                         headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.get(f"{base}/v1/voices", headers={"Authorization": "Bearer k-two"})
        assert ok.status_code == 200 and ok.json()["voices"] == []
        assert httpx.get(f"{base}/v1/voices?api_key=k-one").status_code == 200

        good = FishAudio(api_key="k-one", base_url=base)
        audio = b"".join(good.tts.stream_websocket(iter(["Hello there. "]),
                                                    config=TTSConfig(max_new_tokens=FRAMES)))
        assert len(audio) > 0
        bad = FishAudio(api_key="wrong", base_url=base)
        with pytest.raises(WebSocketError):
            b"".join(bad.tts.stream_websocket(iter(["Hello. "]),
                                              config=TTSConfig(max_new_tokens=FRAMES)))

        ws = base.replace("http://", "ws://", 1) + "/v1/tts/live"

        async def ours() -> None:
            async with connect(ws, api_key="k-two", max_new_tokens=FRAMES) as s:
                await s.ready
            async with connect(ws + "?api_key=k-one", max_new_tokens=FRAMES) as s:
                await s.ready
            with pytest.raises(UnauthorizedError, match="API key"):
                async with connect(ws, max_new_tokens=FRAMES) as s:
                    await s.ready

        asyncio.run(ours())
        metrics = httpx.get(f"{base}/metrics").text
        assert 'rtvoice_errors_total{code="unauthorized"}' in metrics
