"""Several engine processes behind one address: ``rtvoice serve --gpus all|0,1`` (one per GPU)
or ``--replicas N`` (N on ``--device``).

The front is nginx, configured from ``deploy/nginx/rtvoice.conf`` (least connections: a
session is one long WebSocket; a replica's 503 while it drains, or a refused connection, is
retried on another). The replicas are ordinary ``rtvoice serve`` processes on 127.0.0.1, each
pinned to its device with its own KV pool and graphs, all with the same settings and the same
data dir (one SQLite voice store, WAL: a voice stored through any replica serves on all).
This process supervises them:

- starts the replicas, waits for each to answer ``/health`` (model loaded, graphs captured),
  then starts nginx on ``--host:--port``;
- restarts a replica that dies (with a growing pause: 1 s, 2 s, ... 30 s), while nginx sends
  new sessions to the others;
- on SIGTERM/SIGINT drains: every replica gets SIGTERM (it refuses new sessions with 503,
  which nginx retries elsewhere while any is still serving, and ends its sessions as their
  turns finish), then nginx stops; exit 0.

``/health`` and ``/ready`` through the front answer for the replica they reach (``/ready`` is
retried on another replica when one answers 503: the front is ready while any replica has
room); Prometheus scrapes each replica's ``/metrics`` on its own port (logged at start, and
``rtvoice_model_info`` names the device).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rtvoice.settings import ENV_PREFIX, Settings

__all__ = ["Replica", "devices_for", "nginx_config", "serve_replicas"]

log = logging.getLogger("rtvoice.replicas")

TEMPLATE: Final = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "rtvoice.conf"
# options the supervisor sets per replica (the rest are passed on unchanged)
_PER_REPLICA: Final = ("host", "port", "device", "gpus", "replicas")
_START_TIMEOUT_S: Final = 900.0  # a GPU replica captures its graphs before /health answers


def devices_for(settings: Settings) -> list[str]:
    """The device of each replica: one per GPU of ``gpus``, or ``replicas`` times ``device``."""
    net = settings.network
    if net.gpus is None:
        return [settings.model.device] * net.replicas
    if net.gpus.strip() == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError("--gpus all: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, the "
                             "driver, a CUDA build of torch?)")
        return [f"cuda:{i}" for i in range(n)]
    return [f"cuda:{int(g)}" for g in net.gpus.split(",")]


def nginx_config(template: str, *, listen: str, ports: list[int], workdir: Path) -> str:
    """The deploy/nginx/rtvoice.conf `template` with these replicas, this listen address and
    its access log in `workdir`, wrapped in a whole nginx.conf (foreground, files in
    `workdir`)."""
    lines = template.splitlines()
    out: list[str] = []
    in_upstream = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("upstream rtvoice"):
            in_upstream = True
        elif in_upstream and stripped.startswith("server "):
            continue  # the template's example replicas
        elif in_upstream and stripped.startswith("least_conn"):
            out.append(line)
            out += [f"    server 127.0.0.1:{p} max_fails=0;" for p in ports]
            continue
        elif in_upstream and stripped == "}":
            in_upstream = False
        elif stripped.startswith("listen "):
            line = f"    listen {listen};"
        elif stripped.startswith("access_log "):
            line = f"    access_log {workdir / 'access.log'} rtvoice;"
        out.append(line)
    conf = "\n".join(out)
    if sum(f"server 127.0.0.1:{p} " in conf for p in ports) != len(ports):
        raise ValueError(f"{TEMPLATE} has no 'upstream rtvoice {{ least_conn; ... }}' block")
    return (f"daemon off;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} "
            f"warn;\nworker_processes 1;\nevents {{ worker_connections 4096; }}\n"
            f"http {{\n{conf}\n}}\n")


@dataclass(slots=True, eq=False)
class Replica:
    index: int
    device: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0  # monotonic time of the next restart (after a crash)
    log_path: Path = field(default_factory=Path)

    @property
    def name(self) -> str:
        return f"replica {self.index} ({self.device}, 127.0.0.1:{self.port})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {f"{ENV_PREFIX}{n.upper()}" for n in _PER_REPLICA}}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(rep: Replica, flags: list[str]) -> None:
    cmd = [sys.executable, "-m", "rtvoice.cli", "serve", *flags, "--host", "127.0.0.1",
           "--port", str(rep.port), "--device", rep.device]
    log_file = rep.log_path.open("ab")
    try:
        # its own process group: a Ctrl-C on the terminal reaches the supervisor, which
        # drains the replicas itself
        rep.proc = subprocess.Popen(cmd, env=_child_env(), stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log_file.close()


def _flags(overrides: dict[str, Any]) -> list[str]:
    """The command-line options given to the supervisor, for each replica (env variables
    reach them by inheritance)."""
    out: list[str] = []
    for name, value in overrides.items():
        if name in _PER_REPLICA:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            out += [flag, str(value)]
    return out


def serve_replicas(settings: Settings, overrides: dict[str, Any]) -> int:
    """Run the replicas and nginx until SIGTERM/SIGINT; the exit status."""
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
    if nginx is None:
        log.error("--gpus/--replicas put nginx in front of the replicas, and there is no nginx "
                  "binary here: install it (Debian: apt-get install nginx), or run one "
                  "'rtvoice serve --device cuda:N --port 800N' per GPU behind your own "
                  "balancer (deploy/nginx/rtvoice.conf)")
        return 2
    if not TEMPLATE.is_file():
        log.error("the nginx template %s is missing: run from an rtvoice checkout", TEMPLATE)
        return 2
    try:
        devices = devices_for(settings)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="rtvoice-front-"))
    flags = _flags(overrides)
    reps = [Replica(i, d, _free_port(), log_path=workdir / f"replica{i}.log")
            for i, d in enumerate(devices)]
    stop: dict[str, Any] = {"signal": 0, "front": None}

    def on_signal(signum: int, frame: Any) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 1
    try:
        status = _run(reps, flags, workdir, nginx, settings, stop)
        return status
    finally:
        _stop_all(reps, stop["front"], settings.network.drain_timeout_s)
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)  # its logs are kept after a failure


def _run(reps: list[Replica], flags: list[str], workdir: Path, nginx: str,
         settings: Settings, stop: dict[str, Any]) -> int:
    """Start the replicas, then nginx; supervise until a signal. `stop` holds the signal
    received (0: none yet) and the nginx process."""
    net = settings.network
    for rep in reps:
        _start(rep, flags)
        log.info("%s starting (log: %s)", rep.name, rep.log_path)
    deadline = time.monotonic() + _START_TIMEOUT_S
    pending = list(reps)
    while pending and not stop["signal"]:
        for rep in list(pending):
            assert rep.proc is not None
            if rep.proc.poll() is not None:
                tail = rep.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                log.error("%s failed to start (exit %s):\n  %s", rep.name,
                          rep.proc.returncode, "\n  ".join(tail))
                return 1
            if _healthy(rep.port):
                log.info("%s is up", rep.name)
                pending.remove(rep)
        if time.monotonic() > deadline:
            log.error("replicas not up after %g s: %s", _START_TIMEOUT_S,
                      ", ".join(r.name for r in pending))
            return 1
        time.sleep(0.2)
    if stop["signal"]:
        return 0
    listen = f"[{net.host}]:{net.port}" if ":" in net.host else f"{net.host}:{net.port}"
    (workdir / "nginx.conf").write_text(nginx_config(
        TEMPLATE.read_text(), listen=listen, ports=[r.port for r in reps], workdir=workdir))
    args = [nginx, "-p", str(workdir), "-e", str(workdir / "error.log"),
            "-c", str(workdir / "nginx.conf")]
    check = subprocess.run([*args, "-t"], capture_output=True, text=True)
    if check.returncode != 0:
        log.error("nginx refused its configuration (%s):\n%s", workdir / "nginx.conf",
                  check.stderr.strip())
        return 1
    front = stop["front"] = subprocess.Popen(args, start_new_session=True)
    host = f"[{net.host}]" if ":" in net.host else net.host
    log.info("rtvoice: %d replicas behind nginx at ws://%s:%d/v1/tts/live (metrics per "
             "replica: %s; files in %s)", len(reps), host, net.port,
             ", ".join(f"http://127.0.0.1:{r.port}/metrics" for r in reps), workdir)
    while not stop["signal"]:
        if front.poll() is not None:
            log.error("nginx exited (%s); see %s", front.returncode, workdir / "error.log")
            return 1
        now = time.monotonic()
        for rep in reps:
            assert rep.proc is not None
            if rep.proc.poll() is None:
                continue
            if rep.next_start == 0.0:
                pause = min(30.0, 2.0 ** rep.restarts)
                rep.next_start = now + pause
                log.warning("%s exited with %s; restarting it in %g s (nginx sends new "
                            "sessions to the others)", rep.name, rep.proc.returncode, pause)
            elif now >= rep.next_start:
                rep.restarts += 1
                rep.next_start = 0.0
                _start(rep, flags)
                log.info("%s restarted (%d restarts)", rep.name, rep.restarts)
        time.sleep(0.2)
    log.info("rtvoice: draining %d replicas (signal %d)", len(reps), stop["signal"])
    return 0


def _stop_all(reps: list[Replica], front: subprocess.Popen[bytes] | None,
              drain_s: float) -> None:
    """Drain the replicas (SIGTERM: each ends its sessions as their turns finish), then stop
    nginx; whatever is left after the drain's deadline is killed."""
    for rep in reps:
        if rep.proc is not None and rep.proc.poll() is None:
            rep.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_s + 15.0
    for rep in reps:
        if rep.proc is None:
            continue
        try:
            rep.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop after its drain; killing it", rep.name)
            rep.proc.kill()
            rep.proc.wait()
    if front is not None and front.poll() is None:
        front.send_signal(signal.SIGQUIT)  # nginx's graceful stop
        try:
            front.wait(10)
        except subprocess.TimeoutExpired:
            front.kill()
            with contextlib.suppress(Exception):
                front.wait(5)
    log.info("rtvoice: stopped")
