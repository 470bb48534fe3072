"""deploy/: the Kubernetes manifests pass the API schemas and name real settings and
metrics; nginx (the Debian package) really balances two rtvoice processes: sessions spread
over both, a drained replica finishes its running turns while new sessions go to the other,
and a killed replica loses only its own sessions, which reconnect to the other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
import yaml
from _live import Client, is_finish, request
from test_hardening import _free_port, start_server_process

from protocol import Audio, Done, Error, Flush, Ready, Start, Stop, Text
from rtvoice.settings import ENV_PREFIX, option_names

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S_VERSION = "1.30.0"

pytestmark = pytest.mark.timeout(300)


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def test_kubernetes_manifests_pass_the_api_schemas():
    import kubernetes_validate

    checked = 0
    for name, doc in _manifests():
        if doc.get("kind") == "Kustomization":  # not an API object: check what it lists
            for res in doc["resources"]:
                assert (DEPLOY / "k8s" / res).is_file(), f"{name} lists missing {res}"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error
        checked += 1
    kinds = {doc["kind"] for _, doc in _manifests()}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert checked >= 6


def test_manifests_use_real_settings_probes_and_metrics():
    deployment = next(d for _, d in _manifests() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    known = {ENV_PREFIX + n.upper() for names in option_names().values() for n in names}
    for env in container["env"]:
        assert env["name"] in known, f"{env['name']} is not an rtvoice setting"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    drain = next(float(e["value"]) for e in container["env"]
                 if e["name"] == "RTVOICE_DRAIN_TIMEOUT_S")
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop  # room to drain, then exit
    hpa = next(d for _, d in _manifests() if d["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    from rtvoice.testing import running_server

    with running_server(max_turn_frames=4) as url:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    assert re.search(rf"^{metric} ", text, re.M), f"{metric} is not exported on /metrics"


# ------------------------------------------------------------------------------ nginx


def _nginx() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                     else None)
    if path is None:  # like the browser test: Debian packages need root to install
        pytest.skip("nginx is not installed (scripts/test.sh installs the Debian package when "
                    "run as root: apt-get install nginx)")
    return path


def _render(conf: str, ports: tuple[int, int], listen: int, logs: Path) -> str:
    """deploy/nginx/rtvoice.conf with this test's ports and log paths."""
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+.*;$", conf, re.M)
    assert len(servers) == 2, servers
    for line, port in zip(servers, ports):
        conf = conf.replace(line, re.sub(r":\d+", f":{port}", line, count=1))
    conf = re.sub(r"listen \d+;", f"listen 127.0.0.1:{listen};", conf)
    return conf.replace("/var/log/nginx/rtvoice.access.log", str(logs / "access.log"))


def _start_nginx(tmp: Path, ports: tuple[int, int]) -> tuple[subprocess.Popen[bytes], int]:
    nginx = _nginx()
    listen = _free_port()
    (tmp / "rtvoice.conf").write_text(
        _render((DEPLOY / "nginx" / "rtvoice.conf").read_text(), ports, listen, tmp))
    temp = "".join(f"    {k}_temp_path {tmp}/{k};\n" for k in
                   ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log info;\n"
        f"events {{ worker_connections 512; }}\nhttp {{\n{temp}    include {tmp}/rtvoice.conf;\n}}\n")
    test = subprocess.run([nginx, "-t", "-p", str(tmp), "-e", str(tmp / "error.log"), "-c",
                           str(tmp / "nginx.conf")], capture_output=True, text=True)
    assert test.returncode == 0, test.stderr
    proc = subprocess.Popen([nginx, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c",
                             str(tmp / "nginx.conf")])
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{listen}/health", timeout=2)
            return proc, listen
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp / "error.log").read_text()[-2000:]
            time.sleep(0.1)


def _sessions(port: int) -> int:
    return int(httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json()["sessions"])


async def _open(url: str, n: int) -> list[Client]:
    clients = []
    for _ in range(n):
        c = await Client.connect(url)
        await c.send(Start(request=request(max_new_tokens=60)))
        assert isinstance(await c.recv(), Ready)
        clients.append(c)
    return clients


async def _turn(c: Client) -> Done:
    await c.send(Text(text="Still here, speaking through the proxy."))
    await c.send(Flush())
    return (await c.until(lambda e: isinstance(e, Done)))[-1]


LONG = ("A long answer that is still being spoken when this replica is told to stop. "
        "It has a second sentence. And then a third one, to be sure.")


def test_nginx_in_front_of_two_replicas(tmp_path: Path):
    ports = (_free_port(), _free_port())
    server_args = ("--max-turn-frames", "60", "--budget-multiplier", "3",
                   "--drain-timeout-s", "60")
    replicas = {p: start_server_process(p, tmp_path, *server_args) for p in ports}
    nginx, listen = _start_nginx(tmp_path, ports)
    url = f"ws://127.0.0.1:{listen}/v1/tts/live"
    a, b = ports

    async def run() -> None:
        # 1. least_conn spreads sessions over both replicas
        first = await _open(url, 6)
        assert (_sessions(a), _sessions(b)) == (3, 3)
        on_b_before = _sessions(b)

        # 2. kill -9 replica B: only its sessions are lost; they reconnect, to A
        replicas[b].kill()
        replicas[b].wait(30)
        survivors, lost = [], 0
        for c in first:
            try:
                done = await _turn(c)
                assert done.reason in ("length", "eos")
                survivors.append(c)
            except Exception:  # the socket died with its replica
                lost += 1
        assert lost == on_b_before and len(survivors) == 3
        again = await _open(url, lost)  # reconnects: B refuses connections, nginx goes to A
        assert _sessions(a) == 6
        for c in survivors + again:
            await c.send(Stop())
            await c.until(is_finish)
            await c.closed()

        # 3. B comes back; then drain A while it speaks
        replicas[b] = start_server_process(b, tmp_path, *server_args)
        speaking = await _open(url, 2)
        assert (_sessions(a), _sessions(b)) == (1, 1)
        for c in speaking:
            await c.send(Text(text=LONG))
            await c.send(Flush())
            assert isinstance(await c.recv(), Audio)
        replicas[a].send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        newcomers = await _open(url, 3)  # A answers 503: nginx hands them to B
        assert _sessions(b) == 4
        closes = []
        for c in speaking:  # each running turn finishes, on A as on B
            done = (await c.until(lambda e: isinstance(e, Done)))[-1]
            assert done.reason in ("length", "eos"), done
            with contextlib.suppress(websockets.ConnectionClosed):
                await c.send(Stop())  # B's session ends on request; A's has been closed
            events = await c.until(is_finish)
            drained = [e for e in events if isinstance(e, Error)]
            assert all(e.code == "shutting_down" for e in drained), drained
            closes.append(await c.closed())
        assert sorted(closes) == [1000, 1001]  # A closed its session once its turn was done
        assert replicas[a].wait(90) == 0
        for c in newcomers:
            assert (await _turn(c)).reason in ("length", "eos")
            await c.send(Stop())
            await c.until(is_finish)

    try:
        asyncio.run(run())
    finally:
        nginx.terminate()
        nginx.wait(30)
        for proc in replicas.values():
            if proc.poll() is None:
                proc.kill()
    access = (tmp_path / "access.log").read_text()
    assert "/v1/tts/live" in access and "api_key" not in access
