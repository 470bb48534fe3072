"""One-shot speech over HTTP: Fish Audio's ``POST /v1/tts``, OpenAI's ``POST /v1/audio/speech``
and ``GET /v1/models``.

Both run a `rtvoice.synthesis.Synthesis` (the socket's engine, voices, limits and encoders)
and stream the audio in a chunked response as it is generated. Everything that can be
refused is refused before the first byte, with an HTTP status and a JSON error body; a
failure after it can only cut the stream short (logged). docs/PROTOCOL.md describes both.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import numpy as np
import soundfile as sf
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from protocol import ErrorCode, ProtocolError, TTSRequest, decode_request, error_spec
from rtvoice.audio_formats import EncoderConfig
from rtvoice.http import endpoint, error_response
from rtvoice.runtime import Runtime
from rtvoice.synthesis import Synthesis

__all__ = ["fish_tts", "openai_error", "openai_models", "openai_speech"]

log = logging.getLogger(__name__)

# OpenAI's response formats -> ours; "pcm" is OpenAI's raw 24 kHz s16le; flac is encoded whole
_OPENAI_FORMATS: Final = {"mp3": ("mp3", None), "opus": ("opus", None), "wav": ("wav", None),
                          "pcm": ("pcm", 24000), "flac": ("pcm", None)}
_OPENAI_TYPES: Final = {"mp3": "audio/mpeg", "opus": "audio/ogg", "wav": "audio/wav",
                        "pcm": "audio/pcm", "flac": "audio/flac"}


# ----------------------------------------------------------------------------- Fish REST


@endpoint
async def fish_tts(request: Request, rt: Runtime) -> Response:
    """Fish's ``POST /v1/tts``: a ``TTSRequest`` body (msgpack or JSON, as Fish's SDK sends
    it), the audio streamed back in the requested format."""
    try:
        body = await _body(request, rt.settings.limits.max_message_bytes)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind in ("application/msgpack", "application/x-msgpack"):
            req = decode_request(body, max_depth=rt.settings.limits.max_nesting_depth)
        elif kind in ("application/json", ""):
            req = decode_request(body.decode("utf-8", "replace"),
                                 max_depth=rt.settings.limits.max_nesting_depth)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"Content-Type {kind!r}: send "
                                "application/msgpack (Fish's SDK) or application/json")
        output = _output(rt, req.format, req.sample_rate, req)
    except ProtocolError as exc:
        return _refuse(rt, exc)
    return await _stream(rt, request, req, output, media_type=_media_type(output))


# ----------------------------------------------------------------------------- OpenAI


async def openai_speech(request: Request, rt: Runtime) -> Response:
    """OpenAI's ``POST /v1/audio/speech``: JSON ``model``, ``input``, ``voice``,
    ``response_format``, ``speed``, ``stream_format`` (``audio`` or ``sse``)."""
    try:
        body = await _body(request, rt.settings.limits.max_message_bytes)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"the body is not JSON: {exc}"
                                ) from None
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, "the body must be a JSON object")
        text = _field(data, "input", str, required=True)
        voice = data.get("voice")
        if isinstance(voice, dict):  # {"id": "..."}: a custom voice by id
            voice = voice.get("id")
        if not isinstance(voice, str) or not voice:
            raise ProtocolError(ErrorCode.MISSING_FIELD if voice is None else
                                ErrorCode.INVALID_FIELD, "'voice' (a stored voice's id or name, "
                                "or an OpenAI voice name) is required")
        _field(data, "model", str, required=True)
        fmt = _field(data, "response_format", str) or "mp3"
        if fmt not in _OPENAI_FORMATS:
            raise ProtocolError(ErrorCode.UNSUPPORTED_FORMAT, f"response_format {fmt!r} is not "
                                f"supported; use one of {', '.join(sorted(_OPENAI_FORMATS))}")
        speed = _field(data, "speed", (int, float))
        if speed is not None and abs(float(speed) - 1.0) > 1e-6:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"speed {speed} is not supported: this "
                                "model has no speed control (send 1.0, or change the playback "
                                "rate on the client)")
        stream_format = _field(data, "stream_format", str) or "audio"
        if stream_format not in ("audio", "sse"):
            raise ProtocolError(ErrorCode.INVALID_FIELD, "stream_format must be 'audio' or 'sse'")
        ours, rate = _OPENAI_FORMATS[fmt]
        req = TTSRequest(text=text, format=ours, sample_rate=rate,
                         reference_id=voice)
        output = _output(rt, ours, rate, req)
    except ProtocolError as exc:
        return _refuse(rt, exc, openai=True)
    if stream_format == "sse":
        return await _stream(rt, request, req, output, media_type="text/event-stream",
                             transform=_sse_events(fmt, output, len(text)), openai=True)
    if fmt == "flac":
        return await _stream(rt, request, req, output, media_type=_OPENAI_TYPES[fmt],
                             transform=_flac(output), openai=True)
    return await _stream(rt, request, req, output, media_type=_OPENAI_TYPES[fmt], openai=True)


async def openai_models(request: Request, rt: Runtime) -> Response:
    """OpenAI's ``GET /v1/models``: the one model this server serves."""
    created = int(getattr(request.app.state, "started_at", 0))
    return JSONResponse({"object": "list", "data": [
        {"id": rt.bundle.name, "object": "model", "created": created, "owned_by": "rtvoice"}]})


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *,
           required: bool = False) -> Any:
    value = data.get(name)
    if value is None:
        if required:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"'{name}' is required")
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"'{name}' has the wrong type "
                            f"({type(value).__name__})")
    return value


# ----------------------------------------------------------------------------- streaming


def _output(rt: Runtime, fmt: str, rate: int | None, req: TTSRequest) -> EncoderConfig:
    try:
        return EncoderConfig(fmt, rate, mp3_bitrate=req.mp3_bitrate,
                             opus_bitrate=req.opus_bitrate,
                             input_sample_rate=rt.engine.sample_rate)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.UNSUPPORTED_FORMAT, str(exc)) from None


def _media_type(output: EncoderConfig) -> str:
    kind = output.info.content_type
    return f"{kind};rate={output.sample_rate}" if output.format == "pcm" else kind


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (too_large) as soon as it exceeds `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"the body is {length} bytes; the limit is "
                            f"{limit} (max_message_bytes)", limit="max_message_bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"the body is over {limit} bytes "
                                    "(max_message_bytes)", limit="max_message_bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the client went away mid-body") from None
    return b"".join(chunks)


def openai_error(code: ErrorCode | str, message: str, *,
                 headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape; 415/422 are 400, as OpenAI answers bad parameters."""
    status = error_spec(ErrorCode(code)).http_status
    if status in (415, 422):
        status = 400
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": str(code)}}, status_code=status,
                        headers=dict(headers or {}))


def _refuse(rt: Runtime, exc: ProtocolError, *, openai: bool = False,
            headers: Mapping[str, str] | None = None) -> Response:
    rt.metrics.error(str(exc.code))
    if exc.limit is not None:
        rt.metrics.limit_hit(exc.limit)
    log.info("request refused: %s (%s)", exc.code, exc.message)
    if exc.code is ErrorCode.SHUTTING_DOWN:
        headers = {**(headers or {}), "Retry-After": "1"}
    return (openai_error if openai else error_response)(exc.code, exc.message, headers=headers)


Transform = Any  # (AsyncIterator[bytes], Synthesis) -> AsyncIterator[bytes]


async def _stream(rt: Runtime, request: Request, req: TTSRequest, output: EncoderConfig, *,
                  media_type: str, transform: Transform | None = None,
                  openai: bool = False) -> Response:
    """Start the synthesis (errors -> an error response) and stream its audio."""
    if rt.stopping:
        return _refuse(rt, ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting "
                                         "down; send the request to another instance"),
                       openai=openai)
    synth = Synthesis(rt, req, output, key=request.state.key)
    ids = {"X-Request-Id": synth.id}
    try:
        await _until_started(synth, request)
    except BaseException as exc:
        await synth.close(refused=not isinstance(exc, _Gone | asyncio.CancelledError))
        if isinstance(exc, ProtocolError):
            return _refuse(rt, exc, openai=openai, headers=ids)
        if isinstance(exc, _Gone | asyncio.CancelledError):
            if isinstance(exc, asyncio.CancelledError):
                raise
            return Response(status_code=499, headers=ids)  # nobody is there to read it
        log.error("request %s failed to start", synth.id, exc_info=exc)
        rt.metrics.error(str(ErrorCode.INTERNAL))
        return (openai_error if openai else error_response)(
            ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__})", headers=ids)

    async def body() -> AsyncIterator[bytes]:
        try:
            chunks = synth.audio()
            async for chunk in (transform(chunks, synth) if transform else chunks):
                yield chunk
        finally:
            await synth.close()

    return _AudioStream(rt, synth, body(), media_type=media_type,
                        headers={**ids, "Cache-Control": "no-store"})


class _Gone(Exception):
    """The client went away before its audio began."""


async def _until_started(synth: Synthesis, request: Request) -> None:
    """`synth.start()`, given up as soon as the client disconnects (its body is read: the
    next ASGI message can only be the disconnect) — waiting for a slot or the prefill must
    not outlive the client."""
    start = asyncio.ensure_future(synth.start())
    gone = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()  # raises what start raised
            return
        if gone.result().get("type") == "http.disconnect":
            raise _Gone()
        await start  # another message (none is expected): wait for the start alone
    finally:
        for task in (start, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(start, gone, return_exceptions=True)


class _AudioStream(StreamingResponse):
    """A chunked audio response that ends by cutting the connection (no final chunk: the
    client sees the stream fail, not a short file) when the synthesis fails after the first
    byte, and drops a client that accepts no data for ``send_timeout_s``."""

    def __init__(self, rt: Runtime, synth: Synthesis, content: AsyncIterator[bytes],
                 **kw: Any) -> None:
        super().__init__(content, **kw)
        self.rt = rt
        self.synth = synth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        timeout = self.rt.settings.limits.send_timeout_s

        async def timed_send(message: Any) -> None:
            async with asyncio.timeout(timeout):
                await send(message)

        try:
            await super().__call__(scope, receive, timed_send)
        except TimeoutError:
            if self.synth.failure is None:  # not cut already (by the queued-audio bound)
                m = self.rt.metrics
                m.slow_clients += 1
                m.dropped("slow_reader")
                m.limit_hit("send_timeout_s")
            self.synth.cut(ProtocolError(ErrorCode.TIMEOUT, f"the client accepted no data "
                                         f"for {timeout:g} s", limit="send_timeout_s"))
            await self.synth.close()
        except ProtocolError as exc:  # after the first byte: all that is left is to stop
            self.rt.metrics.error(str(exc.code))
            log.warning("request %s cut short mid-stream: %s (%s)", self.synth.id, exc.code,
                        exc.message)


def _sse_events(fmt: str, output: EncoderConfig, input_chars: int) -> Transform:
    """OpenAI's SSE stream: ``speech.audio.delta`` events (base64 audio), then
    ``speech.audio.done`` with usage (input characters; output codec frames)."""
    encode_flac = _flac(output) if fmt == "flac" else None

    async def events(chunks: AsyncIterator[bytes], synth: Synthesis) -> AsyncIterator[bytes]:
        source = encode_flac(chunks, synth) if encode_flac else chunks
        async for chunk in source:
            delta = {"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()}
            yield f"data: {json.dumps(delta)}\n\n".encode()
        usage = {"input_tokens": input_chars, "output_tokens": synth.frames,
                 "total_tokens": input_chars + synth.frames}
        yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n".encode()

    return events


def _flac(output: EncoderConfig) -> Transform:
    """FLAC for OpenAI's ``response_format: flac``: the s16 PCM collected, then encoded
    whole (a FLAC header holds the length, so it cannot be streamed as it is made)."""

    async def encode(chunks: AsyncIterator[bytes], synth: Synthesis) -> AsyncIterator[bytes]:
        pcm = b"".join([c async for c in chunks])

        def write() -> bytes:
            buf = io.BytesIO()
            sf.write(buf, np.frombuffer(pcm, dtype="<i2"), output.sample_rate or 0,
                     format="FLAC", subtype="PCM_16")
            return buf.getvalue()

        yield await asyncio.get_running_loop().run_in_executor(synth.rt.encode_pool, write)

    return encode


openai_speech = endpoint(openai_speech, refuse=openai_error)
openai_models = endpoint(openai_models, refuse=openai_error)
