"""Several engine processes behind one address (``rtvoice serve --replicas N`` / ``--gpus``):
the options, the nginx configuration, and on the CPU two tiny-model replicas behind the real
nginx: sessions spread, one voice store, a killed replica restarted, SIGTERM drains to exit 0."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _audio import wav_bytes
from _live import Client, is_finish, request

from protocol import Audio, Flush, Ready, Start, Stop, Text
from rtvoice.replicas import TEMPLATE, _flags, devices_for, nginx_config
from rtvoice.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_devices_and_options():
    assert devices_for(Settings().replace(replicas=3)) == ["cpu"] * 3
    assert devices_for(Settings().replace(gpus="0,2")) == ["cuda:0", "cuda:2"]
    assert devices_for(Settings()) == ["cpu"]
    for bad, match in (({"gpus": "0,x"}, "GPU indices"), ({"gpus": "1,1"}, "twice"),
                       ({"gpus": "0,1", "replicas": 2}, "not both")):
        with pytest.raises(ValueError, match=match):
            Settings().replace(**bad)
    # the supervisor's own options stay with it; every other flag reaches each replica
    assert _flags({"port": 9, "gpus": "0", "max_turn_frames": 8, "access_log": True,
                   "api_keys": "k"}) == ["--max-turn-frames", "8", "--access-log",
                                         "--api-keys", "k"]


def test_nginx_config_comes_from_the_deploy_template(tmp_path: Path):
    conf = nginx_config(TEMPLATE.read_text(), listen="127.0.0.1:9000", ports=[7001, 7002],
                        workdir=tmp_path)
    assert "server 127.0.0.1:7001 max_fails=0;" in conf and "127.0.0.1:8001" not in conf
    assert "listen 127.0.0.1:9000;" in conf and "least_conn;" in conf
    assert f"access_log {tmp_path / 'access.log'} rtvoice;" in conf
    assert "daemon off;" in conf and conf.count("upstream rtvoice") == 1


def _nginx() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                     else None)
    if path is None:
        pytest.skip("nginx is not installed (scripts/test.sh installs the Debian package when "
                    "run as root)")
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_log(log: Path, pattern: str, timeout: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the supervisor's log:\n{log.read_text()}")


def _metric(port: int, name: str) -> int:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))


def _live(port: int) -> int:
    return _metric(port, "rtvoice_sessions_live")


def test_two_replicas_behind_nginx(tmp_path: Path):
    _nginx()
    port = _free_port()
    log = tmp_path / "supervisor.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "rtvoice.cli", "serve", "--replicas", "2", "--port", str(port),
             "--data-dir", str(tmp_path / "data"), "--max-turn-frames", "4",
             "--drain-timeout-s", "5"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        m = _wait_log(log, r"metrics per replica: http://127\.0\.0\.1:(\d+)/metrics, "
                           r"http://127\.0\.0\.1:(\d+)/metrics")
        ports = [int(m.group(1)), int(m.group(2))]
        front = f"http://127.0.0.1:{port}"
        ws = f"ws://127.0.0.1:{port}/v1/tts/live"
        assert httpx.get(f"{front}/ready", timeout=10).json()["ready"]
        r = httpx.post(f"{front}/v1/voices", files={"audio": ("a.wav", wav_bytes(0.5))},
                       data={"transcript": "A shared voice.", "name": "shared"}, timeout=60)
        assert r.status_code == 201, r.text
        voice = r.json()["id"]

        async def run() -> None:
            # four sessions with the voice stored through the front: two on each replica
            # (least connections), every one of them finds it (one voice store)
            clients = []
            for _ in range(4):
                c = await Client.connect(ws)
                await c.send(Start(request=request(reference_id=voice)))
                assert isinstance(await c.recv(), Ready)
                clients.append(c)
            assert [_live(p) for p in ports] == [2, 2]
            for c in clients:
                await c.send(Text(text="Spread out."))
                await c.send(Flush())
                await c.send(Stop())
                events = await c.until(is_finish)
                assert any(isinstance(e, Audio) for e in events) and events[-1].reason == "stop"
                await c.closed()

        asyncio.run(run())

        # the capacity bench against the one front: its sessions spread over both replicas
        from bench_latency import cli as bench_cli

        before = [_metric(p, "rtvoice_sessions_total") for p in ports]
        said: list[str] = []
        rc = bench_cli.main(["--url", ws, "--capacity", "--concurrency", "2", "--capacity-max",
                             "4", "--capacity-ttfa-ms", "5000", "--jitter-ms", "10000",
                             "--turns", "1", "--warmup-turns", "0", "--max-frames", "4",
                             "--tokens-per-s", "0", "--no-progress",
                             "--json", str(tmp_path / "cap.json")], out=said.append)
        assert rc == 0, said
        assert any(line.startswith("capacity: 4 concurrent streams") for line in said), said
        gained = [_metric(p, "rtvoice_sessions_total") - b for p, b in zip(ports, before)]
        assert sum(gained) == 2 + 4 and min(gained) >= 1, gained

        # a replica killed outright is restarted; the other serves meanwhile
        pid = int(re.search(r"\d+", subprocess.run(
            ["pgrep", "-f", "--", f"--port {ports[0]} --device"], capture_output=True,
            text=True).stdout
        ).group())
        os.kill(pid, signal.SIGKILL)
        _wait_log(log, r"replica 0 \(cpu, 127\.0\.0\.1:\d+\) restarted")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{ports[0]}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the restarted replica never came up")
        assert httpx.get(f"{front}/v1/voices/{voice}", timeout=10).status_code == 200

        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        assert "rtvoice: stopped" in log.read_text()
        for p in ports:
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        subprocess.run(["pkill", "-f", "rtvoice-front-.*nginx.conf"], check=False)
