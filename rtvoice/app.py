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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
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

from engine.engine import EngineConfig, build_engine
from engine.loader import Bundle, load_bundle
from protocol import ErrorCode, ProtocolError, error_spec
from rtvoice.session import (
    Metrics,
    Runtime,
    Session,
    check_voice_room,
    encode_reference_bytes,
    segment_room,
)
from rtvoice.settings import Settings
from rtvoice.voices import UnknownVoice, VoiceLimitError, VoiceStore, VoiceStoreConfig

__all__ = ["create_app", "engine_config", "render_metrics", "uvicorn_config"]

log = logging.getLogger(__name__)

_FIELD_BYTES = 64 * 1024  # non-file multipart fields (transcript, name)
_MULTIPART_OVERHEAD = 64 * 1024  # boundaries and headers on top of the file itself
_STATIC_DIR = Path(__file__).resolve().parent / "static"  # the browser demo page


def engine_config(settings: Settings, bundle: Bundle) -> EngineConfig:
    """The engine configuration for ``settings`` on ``bundle``'s model and device."""
    eng = settings.engine
    on_cpu = torch.device(settings.model.device).type == "cpu"
    model_len = bundle.model.cfg.slow.max_seq_len
    max_len = min(eng.max_len or 4096, model_len)
    return EngineConfig(
        max_running=eng.max_running or (8 if on_cpu else 64),
        max_len=max_len,
        prefill_chunk=eng.prefill_chunk,
        first_chunk_frames=eng.first_chunk_frames,
        slow_start_x=eng.slow_start_x,
        chunk_frames=eng.chunk_frames,
        codec_hold_s=eng.codec_hold_s,
        prefill_first_lead_s=eng.prefill_first_lead_s,
        prefill_first_wait_s=eng.prefill_first_wait_s,
        max_turn_frames=eng.max_turn_frames,
        max_waiting=eng.max_waiting,
        kv_reserve_gib=eng.kv_reserve_gib,
        seed=settings.model.seed,
    )


def create_app(settings: Settings | None = None, *, bundle: Bundle | None = None) -> Starlette:
    """The service as a Starlette app. ``bundle``: an already loaded model to serve (else the
    lifespan loads ``settings.model``); it is not unloaded at shutdown."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime = await _start_runtime(settings, bundle)
        app.state.runtime = runtime
        app.state.started_at = time.time()
        try:
            yield
        finally:
            app.state.runtime = None
            await _stop_runtime(runtime)

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


async def _start_runtime(settings: Settings, bundle: Bundle | None) -> Runtime:
    m = settings.model
    if m.torch_threads:
        torch.set_num_threads(m.torch_threads)
    elif m.device == "cpu":
        # The engine runs prefill, decode and codec on their own threads; intra-op threads on
        # top of them only oversubscribe the cores (the tiny model's matmuls are too small).
        torch.set_num_threads(1)
    if bundle is None:
        bundle = await asyncio.to_thread(
            load_bundle,
            m.model,
            device=m.device,
            dtype=m.dtype,
            seed=m.seed,
            max_seq_len=m.max_seq_len,
        )
    cfg = engine_config(settings, bundle)
    engine = build_engine(bundle, cfg)
    # Cross-check the limits: even the plain voice prompt (no reference) must leave room for
    # a segment of min_chunk_length characters, or no session could ever speak.
    room = segment_room(engine, [])
    if room < settings.limits.min_chunk_length:
        raise ValueError(
            f"max_len={cfg.max_len} leaves room for {max(0, room)} characters per segment next "
            f"to the plain voice prompt; min_chunk_length is {settings.limits.min_chunk_length}: "
            "raise max_len"
        )
    store = VoiceStore(
        settings.voices.data_dir, VoiceStoreConfig(max_voices=settings.voices.max_voices)
    )
    engine.start()
    log.info(
        "engine ready: model %s%s on %s, %d KV slots x %d positions, voices in %s",
        bundle.name,
        " (RANDOM WEIGHTS)" if bundle.random_weights else "",
        m.device,
        engine.runner.n_slots,  # fewer than max_running when GPU memory is short
        cfg.max_len,
        settings.voices.data_dir,
    )
    return Runtime(
        settings=settings,
        bundle=bundle,
        engine=engine,
        store=store,
        encode_pool=ThreadPoolExecutor(settings.engine.encode_threads, "rtvoice-encode"),
        # One worker: the codec encoder is a big torch op that already uses every core; running
        # two at once only makes both slower, and it bounds the memory of concurrent uploads.
        codec_pool=ThreadPoolExecutor(1, "rtvoice-codec"),
        metrics=Metrics(),
    )


async def _stop_runtime(rt: Runtime) -> None:
    await asyncio.to_thread(rt.engine.shutdown)
    rt.encode_pool.shutdown(wait=False, cancel_futures=True)
    rt.codec_pool.shutdown(wait=False, cancel_futures=True)
    rt.store.close()


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
        reference, rate, seconds = await encode_reference_bytes(
            rt, data, transcript.strip(), "audio")
        # A voice whose prompt leaves no room for a minimal segment could never be used.
        check_voice_room(rt.engine, [reference], rt.settings.limits.min_chunk_length)
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
    return PlainTextResponse(
        render_metrics(rt), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(rt: Runtime) -> str:
    """Prometheus text exposition (format 0.0.4) of the service's counters."""
    m = rt.metrics
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            out.append(f"{name}{labels} {value:.9g}" if isinstance(value, float) else
                       f"{name}{labels} {value}")

    def histogram(name: str, help_: str, buckets: tuple[float, ...], counts: list[int],
                  total: float) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} histogram")
        acc = 0
        for b, c in zip(buckets, counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        acc += counts[-1]
        out.append(f'{name}_bucket{{le="+Inf"}} {acc}')
        out.append(f"{name}_sum {total:.9g}")
        out.append(f"{name}_count {acc}")

    b = rt.bundle
    metric("rtvoice_model_info", "gauge", "The served model.", [
        (f'{{model="{_label(b.name)}",device="{_label(rt.settings.model.device)}",'
         f'random_weights="{str(b.random_weights).lower()}"}}', 1)])
    metric("rtvoice_connections_total", "counter", "WebSocket connections accepted.",
           [("", m.connections_total)])
    metric("rtvoice_connections_open", "gauge", "WebSocket connections open now.",
           [("", m.connections_open)])
    metric("rtvoice_sessions_total", "counter", "Sessions started (a 'start' accepted).",
           [("", m.sessions_total)])
    metric("rtvoice_sessions_live", "gauge", "Sessions started and not yet closed.",
           [("", m.sessions_live)])
    metric("rtvoice_turns_total", "counter", "Turns (utterances) ended, by done reason.",
           [(f'{{reason="{_label(r)}"}}', n) for r, n in sorted(m.turns.items())])
    metric("rtvoice_segments_total", "counter", "Segments handed to the engine.",
           [("", m.segments_total)])
    metric("rtvoice_frames_total", "counter", "Codec frames generated.", [("", m.frames_total)])
    metric("rtvoice_audio_seconds_total", "counter", "Seconds of audio delivered in finished turns.",
           [("", float(m.audio_seconds_total))])
    metric("rtvoice_audio_bytes_total", "counter", "Encoded audio bytes sent.",
           [("", m.audio_bytes_total)])
    metric("rtvoice_errors_total", "counter", "Error events sent, by code.",
           [(f'{{code="{_label(c)}"}}', n) for c, n in sorted(m.errors.items())])
    metric("rtvoice_slow_clients_total", "counter", "Sessions dropped (error timeout) because "
           "the client did not read fast enough (send queue or encoder backlog full).",
           [("", m.slow_clients)])
    histogram("rtvoice_ttfa_seconds", "Time to first audio per segment (segment handed to "
              "the engine, i.e. ready to generate -> its first audio chunk handed to the "
              "socket).", Metrics.TTFA_BUCKETS, m.ttfa_counts, m.ttfa_sum)
    metric("rtvoice_ttfa_recent_seconds", "summary",
           f"TTFA quantiles over the last {Metrics.RECENT} segments.",
           [(f'{{quantile="{q:g}"}}', float(v)) for q, v in m.ttfa_quantiles().items()])
    histogram("rtvoice_prefill_seconds", "Voice prompt prefill time (open -> ready).",
              Metrics.PREFILL_BUCKETS, m.prefill_counts, m.prefill_sum)
    load = rt.engine.load()
    metric("rtvoice_engine_sequences", "gauge", "Engine sequences by state.",
           [('{state="live"}', load["live"]), ('{state="waiting"}', load["waiting"])])
    metric("rtvoice_engine_free_slots", "gauge", "Free KV slots.", [("", load["free_slots"])])
    metric("rtvoice_engine_device_wait_seconds", "gauge",
           "How long the engine has been waiting on the device right now (a stall if large).",
           [("", load["device_wait_s"])])
    stats = rt.engine.stats
    metric("rtvoice_engine_steps_total", "counter", "Engine steps.", [("", int(stats["steps"]))])
    metric("rtvoice_engine_seconds_total", "counter", "Engine time by phase.",
           [(f'{{phase="{p}"}}', float(stats[f"{p}_s"])) for p in ("prefill", "decode", "codec")])
    return "\n".join(out) + "\n"


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
