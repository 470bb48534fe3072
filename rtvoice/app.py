"""The rtvoice ASGI application: live TTS WebSocket, voices REST API, health and metrics.

``create_app(settings, bundle=None)`` builds a Starlette app whose lifespan loads the model
(unless a ``bundle`` is passed: tests share one), starts the engine thread and opens the voice
store; shutdown stops them. Routes:

- ``WS  /v1/tts/live``           live TTS (docs/PROTOCOL.md)
- ``POST /v1/voices``            multipart: ``audio`` file, ``transcript``, optional ``name``
- ``GET  /v1/voices``            list; ``GET/DELETE /v1/voices/{id}``
- ``GET  /health``               liveness
- ``GET  /ready``                model loaded and capacity left (200) or not (503)
- ``GET  /metrics``              Prometheus text format
- ``GET  /``                     the browser demo page (``rtvoice/static/index.html``)
- ``GET  /static/...``           its scripts (``rtvoice/static/``)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine.loader import Bundle
from protocol import ErrorCode, ProtocolError, error_spec
from rtvoice.metrics import render_metrics
from rtvoice.runtime import Runtime
from rtvoice.session import Session
from rtvoice.settings import Settings
from rtvoice.voices import UnknownVoice, VoiceLimitError

__all__ = ["create_app", "uvicorn_config"]

log = logging.getLogger(__name__)

_FIELD_BYTES = 64 * 1024  # non-file multipart fields (transcript, name)
_MULTIPART_OVERHEAD = 64 * 1024  # boundaries and headers on top of the file itself
_STATIC_DIR = Path(__file__).resolve().parent / "static"  # the browser demo page


def create_app(settings: Settings | None = None, *, bundle: Bundle | None = None) -> Starlette:
    """The service as a Starlette app. ``bundle``: an already loaded model to serve (else the
    lifespan loads ``settings.model``); it is not unloaded at shutdown."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime = await Runtime.start(settings, bundle)
        app.state.runtime = runtime
        app.state.started_at = time.time()
        try:
            yield
        finally:
            app.state.runtime = None
            await runtime.stop()

    routes = [
        WebSocketRoute("/v1/tts/live", _live),
        Route("/v1/voices", _create_voice, methods=["POST"]),
        Route("/v1/voices", _list_voices, methods=["GET"]),
        Route("/v1/voices/{voice_id}", _get_voice, methods=["GET"]),
        Route("/v1/voices/{voice_id}", _delete_voice, methods=["DELETE"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/", _index, methods=["GET"]),
        Mount("/static", StaticFiles(directory=_STATIC_DIR), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.settings = settings
    app.state.runtime = None
    return app


def _runtime(scope_app: Any) -> Runtime | None:
    return getattr(scope_app.state, "runtime", None)


# ------------------------------------------------------------------------------- websocket


def _authorized(settings: Settings, headers: Any, query: Any) -> bool:
    """True when authentication is off, or the request presents one of the API keys as
    ``Authorization: Bearer KEY`` (what Fish's SDK sends) or ``?api_key=KEY`` (browsers
    cannot set headers on a WebSocket). Constant-time comparisons."""
    keys = settings.network.keys()
    if not keys:
        return True
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    offered = token.strip() if scheme.lower() == "bearer" else ""
    offered = offered or (query.get("api_key") or "")
    return bool(offered) and any(hmac.compare_digest(offered.encode(), k.encode()) for k in keys)


_UNAUTHORIZED = ("missing or invalid API key: send 'Authorization: Bearer <key>' "
                 "(or ?api_key=<key> from a browser)")


async def _live(ws: WebSocket) -> None:
    rt = _runtime(ws.app)
    if rt is None:  # not started or shutting down
        await ws.close(code=1013)
        return
    denied = None
    if rt.stopping:
        denied = ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
    elif not _authorized(rt.settings, ws.headers, ws.query_params):
        denied = ProtocolError(ErrorCode.UNAUTHORIZED, _UNAUTHORIZED)
    await Session(ws, rt, denied=denied).run()


# ------------------------------------------------------------------------------- voices REST


def _error(code: ErrorCode, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": str(code), "message": message}}, status_code=error_spec(code).http_status
    )


def _unavailable() -> JSONResponse:
    return _error(ErrorCode.SHUTTING_DOWN, "the service is not running")


def _voices_endpoint(
    handler: Callable[[Request, Runtime], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A voices REST route: 503 while the service is not running, 401 without a valid API
    key, else ``handler(request, runtime)``."""

    async def endpoint(request: Request) -> Response:
        rt = _runtime(request.app)
        if rt is None:
            return _unavailable()
        if not _authorized(rt.settings, request.headers, request.query_params):
            rt.metrics.error(str(ErrorCode.UNAUTHORIZED))
            return _error(ErrorCode.UNAUTHORIZED, _UNAUTHORIZED)
        return await handler(request, rt)

    return endpoint


@_voices_endpoint
async def _create_voice(request: Request, rt: Runtime) -> Response:
    limit = rt.settings.voices.max_upload_bytes
    length = request.headers.get("content-length")
    if length is None:
        return _error(ErrorCode.BAD_REQUEST, "Content-Length is required")
    try:
        if int(length) > limit + _MULTIPART_OVERHEAD:
            return _error(ErrorCode.TOO_LARGE, f"upload is {length} bytes; the limit is {limit}")
    except ValueError:
        return _error(ErrorCode.BAD_REQUEST, "invalid Content-Length")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return _error(
            ErrorCode.BAD_REQUEST,
            "send multipart/form-data with an 'audio' file, a 'transcript' and an optional 'name'",
        )
    try:
        async with request.form(max_files=2, max_fields=8, max_part_size=_FIELD_BYTES) as form:
            upload = form.get("audio") or form.get("file")
            transcript = form.get("transcript") or form.get("text")
            name = form.get("name")
            if not isinstance(upload, UploadFile):
                return _error(ErrorCode.BAD_REQUEST, "multipart field 'audio' (a file) is required")
            if not isinstance(transcript, str) or not transcript.strip():
                return _error(
                    ErrorCode.BAD_REQUEST,
                    "multipart field 'transcript' (what the clip says) is required",
                )
            data = await upload.read(limit + 1)
            filename = upload.filename or ""
    except MultiPartException as exc:
        return _error(ErrorCode.BAD_REQUEST, f"invalid multipart body: {exc.message}")
    except HTTPException as exc:  # Starlette turns a MultiPartException into a plain-text 400
        if exc.status_code == 413:
            return _error(ErrorCode.TOO_LARGE, f"multipart body: {exc.detail}")
        return _error(ErrorCode.BAD_REQUEST, f"invalid multipart body: {exc.detail}")
    if len(data) > limit:
        return _error(ErrorCode.TOO_LARGE, f"audio file is larger than {limit} bytes")
    try:
        reference, rate, seconds = await rt.reference(data, transcript.strip(), "audio")
        # A voice whose prompt leaves no room for a minimal segment could never be used.
        rt.voice_room([reference])
    except ProtocolError as exc:
        return _error(exc.code, exc.message)
    name_str = name if isinstance(name, str) and name.strip() else Path(filename).stem or "voice"
    codes = reference.codes.cpu().numpy()
    try:
        voice = await asyncio.to_thread(
            rt.store.add,
            name_str,
            reference.text,
            codes,
            {"filename": filename, "model": rt.bundle.name},
            sample_rate=rate,
            duration_s=seconds,
        )
    except VoiceLimitError as exc:
        return _error(ErrorCode.TOO_LARGE, str(exc))
    except ValueError as exc:
        return _error(ErrorCode.BAD_REQUEST, str(exc))
    return JSONResponse(voice.info.to_dict(), status_code=201)


@_voices_endpoint
async def _list_voices(request: Request, rt: Runtime) -> Response:
    voices = await asyncio.to_thread(rt.store.list)
    return JSONResponse({"voices": [v.to_dict() for v in voices]})


@_voices_endpoint
async def _get_voice(request: Request, rt: Runtime) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        info = await asyncio.to_thread(rt.store.info, voice_id)
    except UnknownVoice as exc:
        return _error(ErrorCode.UNKNOWN_VOICE, str(exc))
    return JSONResponse(info.to_dict())


@_voices_endpoint
async def _delete_voice(request: Request, rt: Runtime) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        await asyncio.to_thread(rt.store.delete, voice_id)
    except UnknownVoice as exc:
        return _error(ErrorCode.UNKNOWN_VOICE, str(exc))
    return JSONResponse({"id": voice_id, "deleted": True})


# ------------------------------------------------------------------------------- demo page


async def _index(request: Request) -> Response:
    return FileResponse(_STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")


# ------------------------------------------------------------------------------- health


async def _health(request: Request) -> Response:
    started = getattr(request.app.state, "started_at", None)
    return JSONResponse(
        {"status": "ok", "uptime_s": round(time.time() - started, 3) if started else 0.0}
    )


async def _ready(request: Request) -> Response:
    rt = _runtime(request.app)
    if rt is None:
        return JSONResponse({"ready": False, "reason": "model not loaded"}, status_code=503)
    load = rt.engine.load()
    limits = rt.settings.limits
    sessions = rt.metrics.sessions_live
    stalled = rt.engine.stalled()
    has_room = not stalled and sessions < limits.max_sessions and (
        load["free_slots"] > 0 or load["waiting"] < rt.engine.cfg.max_waiting
    )
    body = {
        "ready": has_room,
        "model": rt.bundle.name,
        "random_weights": rt.bundle.random_weights,
        "device": rt.settings.model.device,
        "sessions": sessions,
        "max_sessions": limits.max_sessions,
        "engine": load,
    }
    if stalled:
        body["reason"] = (f"device stalled: the engine has waited {load['device_wait_s']:.1f} s "
                          f"on the GPU (limit {rt.engine.cfg.stall_s:g} s); restart the server")
        log.error("/ready: %s", body["reason"])
    elif not has_room:
        body["reason"] = "at capacity"
    return JSONResponse(body, status_code=200 if has_room else 503)


async def _metrics(request: Request) -> Response:
    rt = _runtime(request.app)
    if rt is None:
        return PlainTextResponse("", status_code=503)
    text = render_metrics(rt.metrics, rt.engine, model=rt.bundle.name,
                          device=rt.settings.model.device, random_weights=rt.bundle.random_weights)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# ------------------------------------------------------------------------------- uvicorn


async def notify_shutdown(app: Starlette, timeout_s: float) -> int:
    """Tell every connected session that the server is stopping (each gets a
    ``shutting_down`` error and a 1001 close) and wait up to `timeout_s` for them to finish;
    new sockets are refused from now on. Returns the sessions told."""
    rt = _runtime(app)
    if rt is None:
        return 0
    rt.stopping = True
    sessions = list(rt.sessions)
    for session in sessions:
        session.server_stopping()
    deadline = time.monotonic() + timeout_s
    while rt.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if sessions:
        log.info("shutdown: told %d sessions; %d still open", len(sessions), len(rt.sessions))
    return len(sessions)


class Server(uvicorn.Server):
    """uvicorn's server, plus a ``shutting_down`` notice to every live session before
    uvicorn closes the sockets (which alone would drop them with a bare 1012)."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.rtvoice_app = app

    async def shutdown(self, sockets: Any = None) -> None:
        settings: Settings = self.rtvoice_app.state.settings
        with contextlib.suppress(Exception):  # a notice must never block the shutdown
            await notify_shutdown(self.rtvoice_app, min(5.0, settings.network.graceful_shutdown_s))
        await super().shutdown(sockets=sockets)


def uvicorn_config(app: Starlette, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for the service: uvloop when installed, no per-message deflate (audio
    does not compress; it would only cost CPU), a transport frame limit above the protocol's
    own ``max_message_bytes`` so that oversized messages get a ``too_large`` error event
    rather than a bare close."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        loop = "asyncio"
    net = settings.network
    kwargs: dict[str, Any] = {
        "host": net.host,
        "port": net.port,
        "loop": loop,
        "ws_max_size": 2 * settings.limits.max_message_bytes,
        "ws_ping_interval": net.ws_ping_interval_s,
        "ws_ping_timeout": net.ws_ping_timeout_s,
        "ws_per_message_deflate": False,
        "lifespan": "on",
        "log_config": None,  # keep the process's logging setup (``rtvoice --log-level``)
        "log_level": None,  # uvicorn's loggers inherit the root level
        "access_log": net.access_log,
        "timeout_graceful_shutdown": max(1, round(net.graceful_shutdown_s)),
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)
