"""rtvoice clients: an asyncio client library for the live TTS socket, a blocking wrapper,
and the turn-taking demo (``python -m clients.turn_taking``).

::

    from clients import connect

    async with connect("ws://127.0.0.1:8000/v1/tts/live", voice="alice") as session:
        await session.ready
        turn = await session.feed(llm_token_stream())
        async for chunk in turn:
            play(chunk.data)
        print((await turn).client_ttfa_ms)
"""

from .client import (
    DEFAULT_PATH,
    AudioChunk,
    ClientTimeoutError,
    ConnectionClosedError,
    InternalServerError,
    OverloadedError,
    RequestError,
    RtvoiceError,
    ServerTimeoutError,
    Session,
    ShuttingDownError,
    TooLargeError,
    Turn,
    TurnResult,
    UnauthorizedError,
    UnsupportedFormatError,
    VoiceError,
    build_request,
    connect,
    error_from_code,
    llm_tokens,
    normalize_url,
    paced,
)
from .sync import SyncSession, synthesize, write_wav

__all__ = [
    "DEFAULT_PATH",
    "AudioChunk",
    "ClientTimeoutError",
    "ConnectionClosedError",
    "InternalServerError",
    "OverloadedError",
    "RequestError",
    "RtvoiceError",
    "ServerTimeoutError",
    "Session",
    "ShuttingDownError",
    "SyncSession",
    "TooLargeError",
    "Turn",
    "TurnResult",
    "UnauthorizedError",
    "UnsupportedFormatError",
    "VoiceError",
    "build_request",
    "connect",
    "error_from_code",
    "llm_tokens",
    "normalize_url",
    "paced",
    "synthesize",
    "write_wav",
]
