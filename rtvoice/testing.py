"""Run a real rtvoice server inside a test (or a bench, or a notebook).

::

    from rtvoice.testing import running_server

    with running_server(max_turn_frames=8) as url:      # url == "http://127.0.0.1:PORT"
        ...  # talk to url.ws_url ("ws://127.0.0.1:PORT/v1/tts/live") with any client

``running_server(**settings_overrides)`` starts uvicorn (uvloop, the production app and
settings) on a free port in a background thread, waits until it accepts connections, yields
the base URL and stops the server on exit. It is a plain synchronous context manager, so it
works from sync tests, async tests (the server has its own loop in its own thread) and scripts.

Stable contract (other tests and the bench rely on it):

- keyword arguments are flat ``rtvoice.settings`` option names (``max_turn_frames=8``,
  ``budget_multiplier=1.0``, ``max_sessions=2``, ``data_dir=path``...); the environment is
  *not* read, so tests are hermetic;
- defaults differ from ``rtvoice serve`` only where a test needs it: ``host=127.0.0.1``,
  ``port=0`` (any free port), ``model="tiny"``, ``device="cpu"``, and a fresh temporary
  ``data_dir`` (deleted on exit) unless one is given;
- the yielded value is a ``str`` (the base URL) with extra attributes: ``.ws_url`` (the live
  TTS endpoint), ``.port``, ``.settings`` and ``.app`` (the Starlette app;
  ``.app.state.runtime`` holds the engine and metrics while the server runs);
- a preset model (``tiny``) is loaded once per process and shared by every server started
  here: loading is the slowest part of a start, and the weights are read-only.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from engine.loader import Bundle, load_bundle
from rtvoice.app import Server, create_app, uvicorn_config
from rtvoice.settings import Settings

__all__ = ["ServerURL", "running_server"]

_STARTUP_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
_bundles: dict[tuple[Any, ...], Bundle] = {}
_bundles_lock = threading.Lock()


class ServerURL(str):
    """The base URL (``http://127.0.0.1:PORT``) plus handles on the running server."""

    ws_url: str
    port: int
    settings: Settings
    app: Any

    def __new__(cls, base: str, *, port: int, settings: Settings, app: Any) -> ServerURL:
        self = super().__new__(cls, base)
        self.port = port
        self.ws_url = base.replace("http://", "ws://", 1) + "/v1/tts/live"
        self.settings = settings
        self.app = app
        return self


def _shared_bundle(settings: Settings) -> Bundle | None:
    m = settings.model
    if not m.is_preset:
        return None  # a checkpoint: let the app load it (no point caching big weights here)
    seed = settings.engine.seed
    key = (m.model, m.device, m.dtype, seed, m.max_seq_len)
    with _bundles_lock:
        if key not in _bundles:
            _bundles[key] = load_bundle(
                m.model, device=m.device, dtype=m.dtype, seed=seed, max_seq_len=m.max_seq_len
            )
        return _bundles[key]


@contextlib.contextmanager
def running_server(*, send_buffer_bytes: int | None = None,
                   **settings_overrides: Any) -> Iterator[ServerURL]:
    """Start a real uvicorn server with the given settings; yield its base URL; stop it.

    `send_buffer_bytes`: the kernel send buffer of every connection the server accepts
    (SO_SNDBUF on the listening socket, which accepted sockets inherit), for tests of
    clients that stop reading: Linux otherwise grows it to megabytes (tcp_wmem), so how much
    audio a stalled reader's socket swallows before the server's own bounds see it depends
    on the machine."""
    if send_buffer_bytes is not None and send_buffer_bytes < 1:
        raise ValueError(f"send_buffer_bytes must be positive, got {send_buffer_bytes}")
    with contextlib.ExitStack() as stack:
        if "data_dir" not in settings_overrides:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rtvoice-test-"))
            settings_overrides["data_dir"] = tmp
        values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "model": "tiny", "device": "cpu"}
        values.update(settings_overrides)
        settings = Settings().replace(**values)
        bundle = _shared_bundle(settings)
        app = create_app(settings, bundle=bundle)

        # Bind here, so the port is known before uvicorn starts and nothing can take it.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        sock.bind((settings.network.host, settings.network.port))
        stack.callback(sock.close)
        port = sock.getsockname()[1]
        server = Server(uvicorn_config(app, settings, port=port, log_level="warning"), app)
        failure: list[BaseException] = []

        def serve() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # SystemExit from a failed lifespan, among others
                failure.append(exc)

        thread = threading.Thread(target=serve, name=f"rtvoice-test-server-{port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"rtvoice test server failed to start: {failure or 'exited'}")
            if time.monotonic() > deadline:
                server.should_exit = True
                raise TimeoutError(f"rtvoice test server did not start in {_STARTUP_TIMEOUT_S}s")
            time.sleep(0.01)
        try:
            yield ServerURL(f"http://127.0.0.1:{port}", port=port, settings=settings, app=app)
        finally:
            server.should_exit = True
            thread.join(_STOP_TIMEOUT_S)
            if thread.is_alive():  # a hung shutdown: make it loud, the daemon thread dies with us
                server.force_exit = True
                thread.join(5.0)
