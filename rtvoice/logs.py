"""The service's log lines: secrets redacted in every one, plain text or JSON objects.

- :class:`Redact` rewrites any ``api_key=...`` query parameter, ``Authorization`` header value
  or configured API key in a record to ``[redacted]`` — uvicorn's own lines print the request
  path with its query string, so a browser's ``?api_key=`` (a wrong one too) would otherwise
  land in the log in plain text.
- :class:`JsonFormatter` writes one JSON object per line (``ts``, ``level``, ``logger``,
  ``msg``, and ``session`` / ``turn`` when the line is about one), for log collectors.
- :data:`SESSION` and :data:`TURN` are context variables: a session sets its id once, and every
  line logged from its tasks carries it.

:func:`setup` installs both on the process's handlers (``rtvoice serve``); :func:`protect`
installs the redaction on the loggers that print request lines (any server, tests included).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Final

__all__ = ["SESSION", "TURN", "ClientFaults", "JsonFormatter", "Redact", "protect", "setup"]

SESSION: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "rtvoice_session", default=None)
TURN: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "rtvoice_turn", default=None)

# loggers that print request lines or handshake failures (with the query string)
REQUEST_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "websockets",
                          "websockets.server", "websockets.protocol")

_SECRET_PARAM = re.compile(r"(?i)(?<![a-z0-9])((?:api[_-]?key|access[_-]?token|token|key)=)[^&\s\"']+")
_AUTH_VALUE = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer\s+)?)[^\s'\",]+")
REDACTED: Final = "[redacted]"


class Redact(logging.Filter):
    """Rewrites a record's message so that it names no secret: query parameters like
    ``api_key=``, ``Authorization`` values, and the configured keys wherever they appear."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        super().__init__()
        self._keys = tuple(sorted({k for k in keys if k}, key=len, reverse=True))

    def redact(self, text: str) -> str:
        text = _SECRET_PARAM.sub(r"\1" + REDACTED, text)
        text = _AUTH_VALUE.sub(r"\1" + REDACTED, text)
        for key in self._keys:
            text = text.replace(key, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler to report
            return True
        clean = self.redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:  # tracebacks may quote a URL too
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
        return True


class ClientFaults(logging.Filter):
    """uvicorn logs a client's text frame that is not UTF-8 as an ERROR with a traceback,
    one per frame: a log flood at an attacker's command. It is the client's fault (uvicorn
    closes the socket with 1007), so it becomes one warning line. A streamed response that
    rtvoice cut on purpose is a warning too."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UnicodeDecodeError):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = ("a client sent a text frame that is not UTF-8; its "
                                       "socket was closed (1007)"), None
            record.exc_info = record.exc_text = None
        elif record.msg == _INCOMPLETE:
            # rtvoice's streamed REST responses end this way on purpose when they are cut
            # (the client must not take a cut stream for a whole one); the line before, ours,
            # says why
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = ("a streamed response was cut short and its connection closed (the "
                          "line before says why)")
        return True


_INCOMPLETE: Final = "ASGI callable returned without completing response."


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, msg, session and turn
    (when known), exc (a traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        session = getattr(record, "session", None) or SESSION.get()
        turn = getattr(record, "turn", None) or TURN.get()
        if session:
            out["session"] = session
        if turn:
            out["turn"] = turn
        if record.exc_info:
            out["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def protect(keys: Iterable[str] = ()) -> Redact:
    """Install one `Redact` and one `ClientFaults` on the request-line loggers (idempotent:
    previous ones are replaced, so the current keys count). Returns the `Redact`."""
    flt = Redact(keys)
    for name in REQUEST_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, Redact | ClientFaults)]:
            logger.removeFilter(old)
        logger.addFilter(ClientFaults())
        logger.addFilter(flt)
    return flt


def setup(log_format: str, keys: Iterable[str] = ()) -> None:
    """Configure the process's root handlers: redaction on each (records from any logger
    pass through them), and the JSON formatter when ``log_format == "json"``."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    flt = protect(keys)
    for handler in root.handlers:
        for old in [f for f in handler.filters if isinstance(f, Redact)]:
            handler.removeFilter(old)
        handler.addFilter(flt)
        if log_format == "json":
            handler.setFormatter(JsonFormatter())
