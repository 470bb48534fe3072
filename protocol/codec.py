"""Encoding and decoding of protocol events: msgpack in binary frames, JSON in text frames.

Encoders and decoders are built once, at import, and reused: msgspec's typed decoders are
fast precisely because the type is compiled once. The server answers in the encoding the
client used, so :func:`encoding_of` tells it which one a frame was in.

Decoding errors become :class:`~protocol.errors.ProtocolError` with a stable code. The
classification runs only on the error path, so the happy path is one ``decode`` call.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

from .errors import ErrorCode, ProtocolError
from .schema import ClientEvent, ServerEvent

__all__ = [
    "Encoding",
    "decode_client",
    "decode_server",
    "encode_client",
    "encode_server",
    "encoding_of",
]


class Encoding(StrEnum):
    MSGPACK = "msgpack"  # binary WebSocket frames (Fish's encoding)
    JSON = "json"  # text WebSocket frames; bytes fields are base64 strings


Frame = bytes | bytearray | memoryview | str


def encoding_of(frame: Frame) -> Encoding:
    """Text frames (``str``) are JSON, binary frames are msgpack."""
    return Encoding.JSON if isinstance(frame, str) else Encoding.MSGPACK


_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()
_CLIENT_DECODERS: dict[Encoding, msgspec.msgpack.Decoder | msgspec.json.Decoder] = {
    Encoding.MSGPACK: msgspec.msgpack.Decoder(ClientEvent),
    Encoding.JSON: msgspec.json.Decoder(ClientEvent),
}
_SERVER_DECODERS: dict[Encoding, msgspec.msgpack.Decoder | msgspec.json.Decoder] = {
    Encoding.MSGPACK: msgspec.msgpack.Decoder(ServerEvent),
    Encoding.JSON: msgspec.json.Decoder(ServerEvent),
}


class _Peek(msgspec.Struct, gc=False):
    """Just enough of a message to name it in an error report. Any type is accepted."""

    event: Any = None
    context_id: Any = None


_PEEK_DECODERS = {
    Encoding.MSGPACK: msgspec.msgpack.Decoder(_Peek),
    Encoding.JSON: msgspec.json.Decoder(_Peek),
}


def _encode(event: msgspec.Struct, encoding: Encoding) -> bytes | str:
    if encoding is Encoding.MSGPACK:
        return _MSGPACK_ENCODER.encode(event)
    # Text frames must be str; msgspec emits UTF-8 bytes, so this decode is exact.
    return _JSON_ENCODER.encode(event).decode()


def encode_server(event: ServerEvent, encoding: Encoding = Encoding.MSGPACK) -> bytes | str:
    """Serialise a server event: ``bytes`` for msgpack, ``str`` for JSON."""
    return _encode(event, Encoding(encoding))


def encode_client(event: ClientEvent, encoding: Encoding = Encoding.MSGPACK) -> bytes | str:
    """Serialise a client event (used by our own clients and tests)."""
    return _encode(event, Encoding(encoding))


def _decode(
    data: Frame,
    decoders: dict[Encoding, msgspec.msgpack.Decoder | msgspec.json.Decoder],
    max_bytes: int | None,
) -> Any:
    encoding = encoding_of(data)
    if max_bytes is not None:
        if isinstance(data, str):
            # Count UTF-8 bytes only when the character count cannot decide (avoids a copy).
            size = len(data) if len(data) * 4 <= max_bytes else len(data.encode())
        else:
            size = len(data)
        if size > max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"message is {size} bytes; the limit is {max_bytes}"
            )
    try:
        return decoders[encoding].decode(data)
    except msgspec.ValidationError as exc:
        raise _classify(exc, data, encoding) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE, f"not a valid {encoding.value} message: {exc}"
        ) from None


def decode_client(data: Frame, *, max_bytes: int | None = None) -> ClientEvent:
    """Decode one client frame (``str`` = JSON text frame, bytes-like = msgpack binary frame).

    Raises ``ProtocolError`` with code ``malformed_message``, ``unknown_event``,
    ``invalid_field``, ``missing_field`` or (with ``max_bytes``) ``too_large``.
    """
    return _decode(data, _CLIENT_DECODERS, max_bytes)


def decode_server(data: Frame, *, max_bytes: int | None = None) -> ServerEvent:
    """Decode one server frame (for clients). Unknown future events raise ``unknown_event``,
    which a tolerant client simply skips."""
    return _decode(data, _SERVER_DECODERS, max_bytes)


def _classify(exc: msgspec.ValidationError, data: Frame, encoding: Encoding) -> ProtocolError:
    """Map a msgspec validation failure to a stable code.

    msgspec's messages are stable in form: "Object missing required field `x` - at `$.path`",
    "Invalid value 'x' - at `$.event`" (unknown tag), "Expected `str`, got `int` - at `$.a`",
    "Expected `object`, got `array`" (top level). Only the code depends on this parsing; the
    message passes msgspec's text through, so a change there cannot lose information.
    """
    text = str(exc)
    try:
        peek = _PEEK_DECODERS[encoding].decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        peek = None  # not a map at all
    event = peek.event if peek is not None and isinstance(peek.event, str) else None
    context_id = peek.context_id if peek is not None and isinstance(peek.context_id, str) else None

    if peek is None:
        code, message = ErrorCode.MALFORMED_MESSAGE, f"message must be a map: {text}"
    elif text.startswith("Object missing required field"):
        code, message = ErrorCode.MISSING_FIELD, text
    elif text.endswith("- at `$.event`"):
        code = ErrorCode.UNKNOWN_EVENT
        shown = repr(peek.event) if len(repr(peek.event)) <= 64 else repr(peek.event)[:61] + "..."
        message = f"unknown event {shown}"
    else:
        code, message = ErrorCode.INVALID_FIELD, text
    return ProtocolError(code, message, context_id=context_id, event=event)
