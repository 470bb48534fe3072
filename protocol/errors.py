"""Stable error codes of the live TTS protocol, and what each one means for the session.

The codes are part of the wire contract (clients switch on them), so they never change
meaning; new codes may be added. Everything a server needs to react to an error — the
WebSocket close code to use if the error ends the session, whether it does end it, and the
HTTP status for the REST side — lives in the single ``_SPECS`` table below and is read
through :func:`error_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum

from .schema import Error

__all__ = [
    "CloseCode",
    "ErrorCode",
    "ErrorSpec",
    "ProtocolError",
    "error_spec",
]


class CloseCode(IntEnum):
    """WebSocket close codes (RFC 6455 §7.4.1 and the IANA registry) that the service uses."""

    NORMAL = 1000
    GOING_AWAY = 1001
    UNSUPPORTED_DATA = 1003
    INVALID_PAYLOAD = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013


class ErrorCode(StrEnum):
    """The ``code`` field of an ``error`` event."""

    # Message-level problems: one bad frame, the session carries on.
    MALFORMED_MESSAGE = "malformed_message"  # not msgpack / not JSON / not a map
    UNKNOWN_EVENT = "unknown_event"  # ``event`` names nothing we know
    INVALID_FIELD = "invalid_field"  # a known field has the wrong type or value
    MISSING_FIELD = "missing_field"  # a required field is absent
    BAD_REQUEST = "bad_request"  # well-formed but semantically invalid
    INVALID_STATE = "invalid_state"  # legal event, wrong moment (``text`` before ``start``)
    # Session-level problems: the session cannot go on.
    UNKNOWN_VOICE = "unknown_voice"
    BAD_REFERENCE_AUDIO = "bad_reference_audio"
    UNSUPPORTED_FORMAT = "unsupported_format"
    TOO_LARGE = "too_large"
    UNAUTHORIZED = "unauthorized"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """How the server reacts to an error code."""

    code: ErrorCode
    close_code: CloseCode
    fatal: bool  # True: send ``finish{reason: "error"}`` and close with ``close_code``
    http_status: int  # for the REST endpoints (voices) that report the same codes
    description: str


_E, _C = ErrorCode, CloseCode

# The one table. Message-level errors are not fatal: a client that sent one bad frame keeps
# its prefilled voice and its other contexts. Errors that leave the session without a voice or
# without an output format, or that come from the server's side, are fatal.
# fmt: off
_ROWS: list[tuple[ErrorCode, CloseCode, bool, int, str]] = [
    # code                    close code           fatal  http  meaning
    (_E.MALFORMED_MESSAGE,    _C.INVALID_PAYLOAD,   False, 400, "not valid msgpack/JSON, or not a map"),
    (_E.UNKNOWN_EVENT,        _C.UNSUPPORTED_DATA,  False, 400, "the event name is not known"),
    (_E.INVALID_FIELD,        _C.INVALID_PAYLOAD,   False, 400, "a known field has a wrong type or value"),
    (_E.MISSING_FIELD,        _C.INVALID_PAYLOAD,   False, 400, "a required field is missing"),
    (_E.BAD_REQUEST,          _C.POLICY_VIOLATION,  False, 400, "well-formed, but cannot be served as asked"),
    (_E.INVALID_STATE,        _C.POLICY_VIOLATION,  False, 409, "event not allowed in the current state"),
    (_E.UNKNOWN_VOICE,        _C.POLICY_VIOLATION,  True,  404, "reference_id names no stored voice"),
    (_E.BAD_REFERENCE_AUDIO,  _C.INVALID_PAYLOAD,   True,  422, "reference audio could not be decoded"),
    (_E.UNSUPPORTED_FORMAT,   _C.UNSUPPORTED_DATA,  True,  415, "format / sample rate not supported"),
    (_E.TOO_LARGE,            _C.MESSAGE_TOO_BIG,   True,  413, "message, text or reference over a limit"),
    (_E.UNAUTHORIZED,         _C.POLICY_VIOLATION,  True,  401, "missing or invalid credentials"),
    (_E.OVERLOADED,           _C.TRY_AGAIN_LATER,   True,  503, "no capacity now; retry later"),
    (_E.TIMEOUT,              _C.POLICY_VIOLATION,  True,  504, "idle too long, or an operation timed out"),
    (_E.SHUTTING_DOWN,        _C.GOING_AWAY,        True,  503, "the server is shutting down"),
    (_E.INTERNAL,             _C.INTERNAL_ERROR,    True,  500, "unexpected server error"),
]
# fmt: on
_SPECS: dict[ErrorCode, ErrorSpec] = {row[0]: ErrorSpec(*row) for row in _ROWS}

assert set(_SPECS) == set(ErrorCode), "every ErrorCode needs a row in _SPECS"


def error_spec(code: ErrorCode | str) -> ErrorSpec:
    """Look up how to react to ``code``; raises ``ValueError`` for an unknown code string."""
    return _SPECS[ErrorCode(code)]


class ProtocolError(Exception):
    """An error to report to the client as an ``error`` event (and, if fatal, to close on)."""

    __slots__ = ("code", "context_id", "event", "limit", "message")

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        *,
        context_id: str | None = None,
        event: str | None = None,
        limit: str | None = None,
    ) -> None:
        self.code: ErrorCode = ErrorCode(code)
        self.message: str = message
        self.context_id: str | None = context_id
        self.event: str | None = event  # the client event that caused it, when known
        self.limit: str | None = limit  # the configured limit that refused it (its name)
        super().__init__(f"{self.code}: {message}")

    @property
    def spec(self) -> ErrorSpec:
        return _SPECS[self.code]

    @property
    def fatal(self) -> bool:
        return _SPECS[self.code].fatal

    @property
    def close_code(self) -> CloseCode:
        return _SPECS[self.code].close_code

    def to_event(self) -> Error:
        """The ``error`` event to send for this error."""
        return Error(
            code=str(self.code), message=self.message, fatal=self.fatal, context_id=self.context_id
        )
