"""The rtvoice ASGI application: live TTS WebSocket, voices REST API, health and metrics.

``create_app(settings, bundle=None)`` builds a Starlette app whose lifespan loads the model
(unless a ``bundle`` is passed: tests share one), starts the engine thread and opens the voice
store; shutdown stops them. Routes:

- ``WS  /v1/tts/live``           live TTS (docs/PROTOCOL.md)
- ``POST /v1/tts``               Fish's REST TTS: a request body, streamed audio back
- ``POST /v1/audio/speech``      OpenAI's speech endpoint; ``GET /v1/models``
- ``POST /v1/voices``            multipart: ``audio`` file, ``transcript``, optional ``name``
- ``GET  /v1/voices``            list; ``GET/DELETE /v1/voices/{id}``
- ``GET  /health``               liveness
- ``GET  /ready``                model loaded, not draining, room for a session (200) or not (503);
                                 graphs still captured in the background under ``warming``
- ``GET  /metrics``              Prometheus text format
- ``GET  /``                     the browser demo page (``rtvoice/static/index.html``)
- ``GET  /static/...``           its scripts (``rtvoice/static/``)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
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
from protocol import ErrorCode, ProtocolError
from rtvoice import logs
from rtvoice.http import (
    OPEN,
    UNAUTHORIZED,
    credential,
    endpoint,
    error_response,
    not_serving,
    runtime_of,
)
from rtvoice.metrics import render_metrics
from rtvoice.rest import fish_tts, openai_models, openai_speech
from rtvoice.runtime import Runtime
from rtvoice.session import Session
from rtvoice.settings import Settings
from rtvoice.voices import UnknownVoice, VoiceLimitError

__all__ = ["Server", "create_app", "drain", "startup_warnings", "uvicorn_config"]

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
        for warning in startup_warnings(settings):
            log.warning("%s", warning)
        app.state.started_at = time.time()
        if settings.network.load_in_background:
            app.state.loading = True  # before the first request can look (the task starts later)
            task = asyncio.create_task(_load(app, settings, bundle), name="rtvoice-load")
        else:
            app.state.runtime = await Runtime.start(settings, bundle)
            task = None
        try:
            yield
        finally:
            if task is not None and not task.done():
                # the load's current stage (a worker thread) still runs to its end before the
                # process can exit; its result is dropped
                log.info("shutting down while the model loads: the load is abandoned")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            runtime, app.state.runtime = app.state.runtime, None
            if runtime is not None:
                await runtime.stop()

    routes = [
        WebSocketRoute("/v1/tts/live", _live),
        Route("/v1/tts", fish_tts, methods=["POST"]),
        Route("/v1/audio/speech", openai_speech, methods=["POST"]),
        Route("/v1/models", openai_models, methods=["GET"]),
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


async def _load(app: Starlette, settings: Settings, bundle: Bundle | None) -> None:
    """load_in_background: the model and engine behind a listening server. A failure is
    logged, shown by /health (503) and ends the server (exit status 1) where the app runs
    under `Server`."""
    try:
        app.state.runtime = await Runtime.start(settings, bundle, build_off_loop=True)
    except Exception as exc:
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("loading the model failed (%s); the server exits", app.state.load_error)
        stop = getattr(app.state, "request_exit", None)
        if stop is not None:
            stop(1)
    finally:
        app.state.loading = False


# ------------------------------------------------------------------------------- websocket


def startup_warnings(settings: Settings) -> list[str]:
    """What an operator should hear about at start: listening beyond this machine without
    API keys (anyone who can reach the port can use the GPU and the voice store), and a
    keepalive that would drop a client that stops reading before the slow-client rule does
    (uncounted, with no error event)."""
    net, lim = settings.network, settings.limits
    out = []
    if not net.keys() and net.host not in _LOOPBACK and not net.host.startswith("127."):
        out.append(f"listening on {net.host} WITHOUT API KEYS: anyone who can reach port "
                   f"{net.port} can synthesize and read, add or delete voices. Set --api-keys "
                   "(RTVOICE_API_KEYS), or bind to 127.0.0.1 behind an authenticating proxy")
    if net.ws_ping_timeout_s <= lim.send_timeout_s:
        out.append(f"ws_ping_timeout_s ({net.ws_ping_timeout_s:g}) is not above send_timeout_s "
                   f"({lim.send_timeout_s:g}): a client that stops reading will be cut by the "
                   "keepalive (close 1011, no error event, not counted as a slow client)")
    return out


_LOOPBACK = frozenset({"localhost", "::1", "[::1]"})


async def _live(ws: WebSocket) -> None:
    rt = runtime_of(ws.app)
    if rt is None or rt.stopping:
        # Draining (or not started): refused before the upgrade, with an HTTP 503 that a load
        # balancer retries on another instance (nginx: proxy_next_upstream http_503).
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            why = ("the server is shutting down; connect to another instance" if rt is not None
                   else not_serving(ws.app))
            await ws.send_denial_response(error_response(
                ErrorCode.SHUTTING_DOWN, why, headers={"Retry-After": "1"}))
        else:  # pragma: no cover - uvicorn supports denial responses
            await ws.close(code=1013)
        return
    denied = None
    key = credential(rt.settings, ws.headers, ws.query_params)
    limit = rt.settings.limits.max_unstarted
    if key is None:
        denied = ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED)
    elif rt.metrics.unstarted + rt.metrics.lingering >= limit and rt.lingering:
        next(iter(rt.lingering)).lapse()  # the oldest socket kept after finish{stop} goes
    elif rt.metrics.unstarted >= limit:
        denied = ProtocolError(ErrorCode.OVERLOADED, f"{limit} connections are open without "
                               "'start' (max_unstarted); retry later", limit="max_unstarted")
    metrics = rt.metrics
    metrics.connections_total += 1
    metrics.connections_open += 1
    try:
        # One session after another on the same socket: a clean finish{stop} leaves it open
        # for the client's next 'start' (as Fish's service does).
        reused = False
        while await Session(ws, rt, denied=denied, key=None if key == OPEN else key,
                            reused=reused).run():
            reused = True
    finally:
        metrics.connections_open -= 1


# ------------------------------------------------------------------------------- voices REST


@endpoint
async def _create_voice(request: Request, rt: Runtime) -> Response:
    limit = rt.settings.voices.max_upload_bytes
    length = request.headers.get("content-length")
    if length is None:
        return error_response(ErrorCode.BAD_REQUEST, "Content-Length is required")
    try:
        if int(length) > limit + _MULTIPART_OVERHEAD:
            rt.metrics.limit_hit("max_upload_bytes")
            return error_response(ErrorCode.TOO_LARGE, f"upload is {length} bytes; the limit is {limit}")
    except ValueError:
        return error_response(ErrorCode.BAD_REQUEST, "invalid Content-Length")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return error_response(
            ErrorCode.BAD_REQUEST,
            "send multipart/form-data with an 'audio' file, a 'transcript' and an optional 'name'",
        )
    try:
        async with request.form(max_files=2, max_fields=8, max_part_size=_FIELD_BYTES) as form:
            upload = form.get("audio") or form.get("file")
            transcript = form.get("transcript") or form.get("text")
            name = form.get("name")
            if not isinstance(upload, UploadFile):
                return error_response(ErrorCode.BAD_REQUEST, "multipart field 'audio' (a file) is required")
            if not isinstance(transcript, str) or not transcript.strip():
                return error_response(
                    ErrorCode.BAD_REQUEST,
                    "multipart field 'transcript' (what the clip says) is required",
                )
            data = await upload.read(limit + 1)
            filename = upload.filename or ""
    except MultiPartException as exc:
        return error_response(ErrorCode.BAD_REQUEST, f"invalid multipart body: {exc.message}")
    except HTTPException as exc:  # Starlette turns a MultiPartException into a plain-text 400
        if exc.status_code == 413:
            return error_response(ErrorCode.TOO_LARGE, f"multipart body: {exc.detail}")
        return error_response(ErrorCode.BAD_REQUEST, f"invalid multipart body: {exc.detail}")
    if len(data) > limit:
        rt.metrics.limit_hit("max_upload_bytes")
        return error_response(ErrorCode.TOO_LARGE, f"audio file is larger than {limit} bytes")
    try:
        reference, rate, seconds = await rt.reference(data, transcript.strip(), "audio")
        # A voice whose prompt leaves no room for a minimal segment could never be used.
        rt.voice_room([reference])
    except ProtocolError as exc:
        if exc.limit is not None:
            rt.metrics.limit_hit(exc.limit)
        return error_response(exc.code, exc.message)
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
        rt.metrics.limit_hit("max_voices")
        return error_response(ErrorCode.TOO_LARGE, str(exc))
    except ValueError as exc:
        return error_response(ErrorCode.BAD_REQUEST, str(exc))
    return JSONResponse(voice.info.to_dict(), status_code=201)


@endpoint
async def _list_voices(request: Request, rt: Runtime) -> Response:
    voices = await asyncio.to_thread(rt.store.list)
    return JSONResponse({"voices": [v.to_dict() for v in voices]})


@endpoint
async def _get_voice(request: Request, rt: Runtime) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        info = await asyncio.to_thread(rt.store.info, voice_id)
    except UnknownVoice as exc:
        return error_response(ErrorCode.UNKNOWN_VOICE, str(exc))
    return JSONResponse(info.to_dict())


@endpoint
async def _delete_voice(request: Request, rt: Runtime) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        await asyncio.to_thread(rt.store.delete, voice_id)
    except UnknownVoice as exc:
        return error_response(ErrorCode.UNKNOWN_VOICE, str(exc))
    return JSONResponse({"id": voice_id, "deleted": True})


# ------------------------------------------------------------------------------- demo page


async def _index(request: Request) -> Response:
    return FileResponse(_STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")


# ------------------------------------------------------------------------------- health


async def _health(request: Request) -> Response:
    """Liveness: 200 while the process serves or loads its model (load_in_background), 503
    once a background load has failed (the process is exiting)."""
    state = request.app.state
    started = getattr(state, "started_at", None)
    uptime = round(time.time() - started, 3) if started else 0.0
    error = getattr(state, "load_error", None)
    if error:
        return JSONResponse({"status": "failed", "error": error, "uptime_s": uptime},
                            status_code=503)
    return JSONResponse({"status": "loading" if getattr(state, "loading", False) else "ok",
                         "uptime_s": uptime})


async def _ready(request: Request) -> Response:
    rt = runtime_of(request.app)
    if rt is None:
        loading = getattr(request.app.state, "loading", False)
        return JSONResponse({"ready": False, "loading": loading,
                             "reason": "loading the model" if loading else not_serving(request.app)},
                            status_code=503)
    load = rt.engine.load()
    limits = rt.settings.limits
    sessions = rt.metrics.sessions_live
    reason = None
    if rt.stopping:
        reason = "draining: the server is shutting down"
    elif rt.engine.stalled():
        reason = (f"device stalled: the engine has waited {load['device_wait_s']:.1f} s on the "
                  f"GPU (limit {rt.engine.cfg.stall_s:g} s); restart the server"
                  if load["device_wait_s"] >= load["loop_stall_s"] else
                  f"engine stalled: a worker thread has been in one pass of its loop for "
                  f"{load['loop_stall_s']:.1f} s (limit {rt.engine.cfg.stall_s:g} s; the "
                  f"server log has its stack); restart the server")
        log.error("/ready: %s; the engine threads:%s", reason, rt.engine.thread_stacks())
    elif sessions >= limits.max_sessions:
        reason = f"at capacity: {sessions} live sessions (max_sessions)"
    elif load["waiting"] > 0 or load["kv_blocks_available"] <= load["max_running"] - load["free_rows"]:
        # A new session would only queue (behind the ones already waiting): send it elsewhere.
        reason = (f"at capacity: the KV pool is full ({load['kv_blocks']} blocks, none free "
                  f"or reclaimable), {load['waiting']} sessions wait for blocks")
    body: dict[str, Any] = {
        "ready": reason is None,
        "model": rt.bundle.name,
        "random_weights": rt.bundle.random_weights,
        "device": rt.settings.model.device,
        "sessions": sessions,
        "max_sessions": limits.max_sessions,
        "unstarted": rt.metrics.unstarted,
        "engine": load,
        "limits": _limits(rt),
        "startup_s": rt.startup_s,
    }
    warming = rt.engine.warming()
    if warming:  # serving already; these buckets run eagerly (slower) until captured
        body["warming"] = warming
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, status_code=200 if reason is None else 503)


def _limits(rt: Runtime) -> dict[str, Any]:
    """Every limit a client or an operator may run into, by its option name."""
    lim, eng = rt.settings.limits, rt.engine.cfg
    names = ("max_sessions", "max_sessions_per_key", "max_unstarted", "start_timeout_s",
             "max_message_bytes", "max_nesting_depth", "max_text_chars", "max_contexts",
             "max_context_id_chars", "max_references", "max_reference_s",
             "max_reference_samples", "reference_workers", "min_chunk_length",
             "max_chunk_length", "idle_timeout_s", "send_queue_bytes", "send_queue_events",
             "send_timeout_s")
    out: dict[str, Any] = {n: getattr(lim, n) for n in names}
    out.update(max_waiting=eng.max_waiting, max_turn_frames=eng.max_turn_frames,
               max_running=rt.engine.n_rows, kv_blocks=rt.engine.runner.n_blocks,
               max_upload_bytes=rt.settings.voices.max_upload_bytes,
               drain_timeout_s=rt.settings.network.drain_timeout_s)
    return out


async def _metrics(request: Request) -> Response:
    rt = runtime_of(request.app)
    if rt is None:
        return PlainTextResponse("", status_code=503)
    text = render_metrics(rt.metrics, rt.engine, model=rt.bundle.name,
                          device=rt.settings.model.device, random_weights=rt.bundle.random_weights,
                          queued_bytes=sum(s.queued_bytes for s in list(rt.sessions)),
                          gc=rt.gc_watch.snapshot() if rt.gc_watch is not None else None)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# ------------------------------------------------------------------------------- uvicorn


_CLOSE_WAIT_S = 5.0  # after the drain: sessions told to stop get this long to close


async def drain(app: Starlette, timeout_s: float) -> dict[str, int]:
    """Drain the server: from now on /ready answers 503 and new connections are refused
    (HTTP 503, shutting_down); each session ends (``shutting_down``, close 1001) as soon as
    its turns are done; after `timeout_s` the rest are ended mid-turn. Returns how many
    sessions there were, how many ended on their own, how many were cut."""
    rt = runtime_of(app)
    if rt is None:
        return {"sessions": 0, "finished": 0, "cut": 0}
    rt.metrics.draining = True
    sessions = list(rt.sessions)
    log.info("draining: %d sessions open; new connections are refused; waiting up to %g s "
             "for their turns to finish", len(sessions), timeout_s)
    for session in sessions:
        session.drain()
    deadline = time.monotonic() + timeout_s
    while rt.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    cut = list(rt.sessions)
    for session in cut:
        session.server_stopping()
    deadline = time.monotonic() + _CLOSE_WAIT_S
    while rt.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    result = {"sessions": len(sessions), "finished": len(sessions) - len(cut), "cut": len(cut)}
    log.info("drained: %(finished)d sessions finished their turns, %(cut)d were cut at the "
             "deadline", result)
    return result


class Server(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown: uvicorn alone would stop
    listening at once and drop every socket with a bare 1012. Its request-line loggers
    redact secrets (logs.protect)."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.rtvoice_app = app
        self.exit_code = 0  # 1: the model failed to load behind the listening server
        app.state.request_exit = self.request_exit
        logs.protect(app.state.settings.network.keys())

    def request_exit(self, code: int) -> None:
        """End serving with this exit status (a background load that failed)."""
        self.exit_code = code
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        settings: Settings = self.rtvoice_app.state.settings
        try:  # a failing drain must never block the shutdown
            await drain(self.rtvoice_app, settings.network.drain_timeout_s)
        except Exception:
            log.exception("drain failed; shutting down anyway")
        await super().shutdown(sockets=sockets)


_WS_SLACK = 64 * 1024  # transport bytes above max_message_bytes: still a too_large event


def uvicorn_config(app: Starlette, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for the service: uvloop when installed, no per-message deflate (audio
    does not compress; it would only cost CPU), a transport message limit just above the
    protocol's own ``max_message_bytes``: a message a little too large gets a ``too_large``
    error event, a far larger one is refused by the transport (close 1009) without being
    buffered whole."""
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
        "ws_max_size": settings.limits.max_message_bytes + _WS_SLACK,
        "ws_ping_interval": net.ws_ping_interval_s,
        "ws_ping_timeout": net.ws_ping_timeout_s,
        "ws_per_message_deflate": False,
        "lifespan": "on",
        "log_config": None,  # keep the process's logging setup (``rtvoice --log-level``)
        "log_level": None,  # uvicorn's loggers inherit the root level
        "access_log": net.access_log,
        # the drain (Server.shutdown) has closed the sessions; this bounds what is left
        "timeout_graceful_shutdown": max(1, round(_CLOSE_WAIT_S)),
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)
