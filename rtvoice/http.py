"""What every HTTP route of the service shares: the runtime of a running app, API-key
authentication, and errors as an HTTP status with a JSON body.

Error bodies are ``{"error": {"code": ..., "message": ...}}`` with the status of the code's
``protocol.error_spec`` (the same codes as the socket's ``error`` events)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol import ErrorCode, error_spec
from rtvoice.runtime import Runtime
from rtvoice.settings import Settings

__all__ = ["OPEN", "UNAUTHORIZED", "credential", "endpoint", "error_response", "not_serving",
           "runtime_of"]

OPEN: Final = -1  # credential()'s answer when authentication is off
UNAUTHORIZED: Final = ("missing or invalid API key: send 'Authorization: Bearer <key>' "
                       "(or ?api_key=<key> from a browser)")


def runtime_of(app: Any) -> Runtime | None:
    """The app's runtime while it serves (None before start-up and after shutdown)."""
    return getattr(app.state, "runtime", None)


def not_serving(app: Any) -> str:
    """Why the app has no runtime now, for a 503's message: loading (load_in_background),
    a failed load, or not started / shut down."""
    if getattr(app.state, "load_error", None):
        return f"the model failed to load ({app.state.load_error}); this instance is exiting"
    if getattr(app.state, "loading", False):
        return "the server is starting: the model is still loading; retry shortly"
    return "the service is not running"


def credential(settings: Settings, headers: Mapping[str, str], query: Mapping[str, str]) -> int | None:
    """Which API key the request presents (its index; `OPEN` when authentication is off),
    as ``Authorization: Bearer KEY`` (what Fish's and OpenAI's SDKs send) or ``?api_key=KEY``
    (browsers cannot set headers on a WebSocket); None when it presents none of them.
    Constant-time comparisons, every key compared."""
    keys = settings.network.keys()
    if not keys:
        return OPEN
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    offered = token.strip() if scheme.lower() == "bearer" else ""
    offered_b = (offered or (query.get("api_key") or "")).encode()
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(offered_b, key.encode()) and found is None:
            found = i
    return found if offered_b else None


def error_response(code: ErrorCode | str, message: str, *,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    code = ErrorCode(code)
    return JSONResponse({"error": {"code": str(code), "message": message}},
                        status_code=error_spec(code).http_status, headers=dict(headers or {}))


Refusal = Callable[..., Response]  # (code, message, *, headers=None) -> an error response


def endpoint(handler: Callable[[Request, Runtime], Awaitable[Response]], *,
             refuse: Refusal = error_response) -> Callable[[Request], Awaitable[Response]]:
    """An API route: 503 while the service is not running, 401 without a valid API key,
    else ``handler(request, runtime)`` with ``request.state.key`` set (the key's index, None
    when authentication is off). `refuse` shapes those error bodies (ours by default)."""

    async def route(request: Request) -> Response:
        rt = runtime_of(request.app)
        if rt is None:
            return refuse(ErrorCode.SHUTTING_DOWN, not_serving(request.app),
                          headers={"Retry-After": "1"})
        key = credential(rt.settings, request.headers, request.query_params)
        if key is None:
            rt.metrics.error(str(ErrorCode.UNAUTHORIZED))
            return refuse(ErrorCode.UNAUTHORIZED, UNAUTHORIZED)
        request.state.key = None if key == OPEN else key
        return await handler(request, rt)

    route.__name__ = handler.__name__
    route.__doc__ = handler.__doc__
    return route
