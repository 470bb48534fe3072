"""Encoding and decoding of protocol events: msgpack in binary frames, JSON in text frames.

Encoders and decoders are built once, at import, and reused: msgspec's typed decoders are
fast precisely because the type is compiled once. The server answers in the encoding the
client used, so :func:`encoding_of` tells it which one a frame was in.

Decoding errors become :class:`~protocol.errors.ProtocolError` with a stable code. The
classification runs only on the error path, so the happy path is one ``decode`` call.
"""

from __future__ import annotations

import itertools
import re
import struct
from enum import StrEnum
from typing import Any, Final

import msgspec

from .errors import ErrorCode, ProtocolError
from .schema import ClientEvent, ServerEvent, TTSRequest

__all__ = [
    "Encoding",
    "decode_client",
    "decode_request",
    "decode_server",
    "encode_client",
    "encode_server",
    "encoding_of",
    "too_deep",
]

MAX_DEPTH: Final = 32  # default bound on nesting (events themselves are at most 4 deep)
MAX_VALUES: Final = 4096  # values a depth check walks before it refuses the message
MAX_ECHO_CHARS: Final = 1024  # a context_id longer than this is not echoed in an error


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
_REQUEST_DECODERS: dict[Encoding, msgspec.msgpack.Decoder | msgspec.json.Decoder] = {
    Encoding.MSGPACK: msgspec.msgpack.Decoder(TTSRequest),
    Encoding.JSON: msgspec.json.Decoder(TTSRequest),
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
    max_depth: int | None = None,
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
                ErrorCode.TOO_LARGE, f"message is {size} bytes; the limit is {max_bytes}",
                limit="max_message_bytes")
    if max_depth is not None and too_deep(data, max_depth):
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE,
            f"the {encoding.value} message is nested more than {max_depth} levels deep, or holds "
            f"more than {MAX_VALUES} values in nested containers (events are flat maps; the "
            "limit is max_nesting_depth)", limit="max_nesting_depth")
    try:
        return decoders[encoding].decode(data)
    except msgspec.ValidationError as exc:
        raise _classify(exc, data, encoding) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE, f"not a valid {encoding.value} message: {exc}"
        ) from None
    except RecursionError:  # the decoder's own bound (also for unknown fields it skips)
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE,
            f"the {encoding.value} message is nested too deeply (events are flat maps)",
            limit="max_nesting_depth") from None


# -------------------------------------------------------------------------- nesting depth
# msgspec's decoders recurse (also when they skip unknown fields), so nesting is bounded
# before decoding, by scanners that cost little more than the decode itself: JSON strings
# are cut out by C-level string methods; msgpack strings and binaries are skipped by their
# length, and at most MAX_VALUES values are walked (no event has nearly as many).

_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def too_deep(data: Frame, limit: int = MAX_DEPTH) -> bool:
    """Whether a frame nests containers more than `limit` levels deep (a flat map is one
    level), or holds more than MAX_VALUES values (msgpack) or containers (JSON). Malformed
    input is not judged here: the decoder reports it."""
    if isinstance(data, str):
        return _json_too_deep(data, limit)
    return _msgpack_too_deep(memoryview(data).cast("B"), limit)


def _json_too_deep(text: str, limit: int) -> bool:
    if text.count("[") + text.count("{") <= limit:  # the common case: no scan at all
        return False
    # Drop escaped characters (so every remaining quote delimits a string), then the
    # strings (every other piece between quotes), then everything but brackets.
    plain = text.replace("\\\\", "").replace('\\"', "")
    structure = "".join(plain.split('"')[::2])
    if structure.count("[") + structure.count("{") > MAX_VALUES:
        return True
    brackets = _NOT_BRACKET.sub("", structure)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


# msgpack type bytes (besides the fix* ranges): payload sizes
_MP_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
             0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_MP_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4,  # bin, str: length bytes
             0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext: length bytes, then a type byte
_MP_EXT = frozenset((0xC7, 0xC8, 0xC9))
_MP_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (length bytes, x)
_BE = {1: ">B", 2: ">H", 4: ">I"}


def _msgpack_too_deep(buf: memoryview, limit: int) -> bool:
    pos, end = 0, len(buf)
    open_: list[int] = []  # per open container: values still to read
    for _ in range(MAX_VALUES):
        if pos >= end:
            return False  # done (or truncated: the decoder says so)
        while open_ and open_[-1] == 0:
            open_.pop()
        if open_:
            open_[-1] -= 1
        b = buf[pos]
        pos += 1
        count = -1
        if b <= 0x7F or b >= 0xE0:  # fixint
            pass
        elif b <= 0x8F:  # fixmap
            count = 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            count = b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _MP_FIXED:
            pos += _MP_FIXED[b]
        elif b in _MP_SIZED:
            n = _MP_SIZED[b]
            if pos + n > end:
                return False
            pos += n + struct.unpack_from(_BE[n], buf, pos)[0] + (b in _MP_EXT)
        elif b in _MP_CONTAINER:
            n, per_entry = _MP_CONTAINER[b]
            if pos + n > end:
                return False
            count = per_entry * struct.unpack_from(_BE[n], buf, pos)[0]
            pos += n
        else:  # 0xC1 (never used): malformed
            return False
        if count >= 0:
            if len(open_) + 1 > limit:  # this container is one level below its parents
                return True
            if count:
                open_.append(count)
        if not open_ and pos >= end:
            return False
    return True


def decode_client(data: Frame, *, max_bytes: int | None = None,
                  max_depth: int | None = MAX_DEPTH) -> ClientEvent:
    """Decode one client frame (``str`` = JSON text frame, bytes-like = msgpack binary frame).

    Raises ``ProtocolError`` with code ``malformed_message`` (also for nesting deeper than
    `max_depth`), ``unknown_event``, ``invalid_field``, ``missing_field`` or (with
    ``max_bytes``) ``too_large``.
    """
    return _decode(data, _CLIENT_DECODERS, max_bytes, max_depth)


def decode_request(data: Frame, *, max_bytes: int | None = None,
                   max_depth: int | None = MAX_DEPTH) -> TTSRequest:
    """Decode a bare ``TTSRequest`` (the body of Fish's REST ``POST /v1/tts``: msgpack for
    bytes, JSON for ``str``), with the same checks and error codes as `decode_client`."""
    return _decode(data, _REQUEST_DECODERS, max_bytes, max_depth)


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
    if context_id is not None and len(context_id) > MAX_ECHO_CHARS:
        context_id = None  # an error must not amplify what the client sent

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
