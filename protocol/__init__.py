"""rtvoice wire protocol (sans-I/O): schema, codecs, error codes and the session state machine.

Nothing in this package performs I/O or depends on an event loop; the service and the clients
share it.
"""

from .codec import (
    Encoding,
    decode_client,
    decode_server,
    encode_client,
    encode_server,
    encoding_of,
)
from .errors import CloseCode, ErrorCode, ErrorSpec, ProtocolError, error_spec
from .schema import (
    PROTOCOL_VERSION,
    Audio,
    Cancel,
    ClientEvent,
    Done,
    DoneReason,
    Error,
    Finish,
    FinishReason,
    Flush,
    Limits,
    Prosody,
    Ready,
    ReferenceAudio,
    ServerEvent,
    Start,
    Stop,
    Text,
    TTSRequest,
    event_name,
)
from .state import (
    ALLOWED_EVENTS,
    TRANSITIONS,
    InvalidTransition,
    SessionState,
    SessionStateMachine,
)

__all__ = [
    "ALLOWED_EVENTS",
    "PROTOCOL_VERSION",
    "TRANSITIONS",
    "Audio",
    "Cancel",
    "ClientEvent",
    "CloseCode",
    "Done",
    "DoneReason",
    "Encoding",
    "Error",
    "ErrorCode",
    "ErrorSpec",
    "Finish",
    "FinishReason",
    "Flush",
    "InvalidTransition",
    "Limits",
    "Prosody",
    "ProtocolError",
    "Ready",
    "ReferenceAudio",
    "ServerEvent",
    "SessionState",
    "SessionStateMachine",
    "Start",
    "Stop",
    "TTSRequest",
    "Text",
    "decode_client",
    "decode_server",
    "encode_client",
    "encode_server",
    "encoding_of",
    "error_spec",
    "event_name",
]
