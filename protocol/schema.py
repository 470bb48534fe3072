"""Wire schema of ``/v1/tts/live``: Fish Audio's live TTS events plus rtvoice's extensions.

Every message is a map whose ``event`` field names its type (msgspec tagged unions with
``tag_field="event"``). Fish's events are reproduced field for field (see
``docs/fish_sdk_compat.md``); ours are additions that Fish clients ignore.

Compatibility rules, enforced by the types below:

- every field added after the first release has a default, so old peers keep working;
- unknown fields are ignored (msgspec's default), so newer clients can talk to older servers;
- a known field with the wrong type is an error (``invalid_field``), never silently coerced
  (the one lax conversion msgspec makes is int -> float, which loses nothing);
- every event may carry ``context_id`` (default ``None``: the session's default context).

String enumerations that may grow (``format``, ``latency``, ``Done.reason``) are typed ``str``
rather than ``Literal`` so that a value we do not know yet is the application's decision
(e.g. ``unsupported_format``), not a decode failure that loses the whole message.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "Audio",
    "Cancel",
    "ClientEvent",
    "Done",
    "DoneReason",
    "Error",
    "Finish",
    "FinishReason",
    "Flush",
    "Limits",
    "Prosody",
    "Ready",
    "ReferenceAudio",
    "Segment",
    "ServerEvent",
    "Start",
    "Stop",
    "TTSRequest",
    "Text",
    "Word",
    "event_name",
]

PROTOCOL_VERSION: Final = 1

FinishReason = Literal["stop", "error"]
"""``finish.reason``: Fish clients stop reading on ``stop`` and raise on ``error``."""

DoneReason = Literal["eos", "length", "cancelled", "error"]
"""``done.reason``: the model ended the turn, hit max_new_tokens, was cancelled, or failed."""

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(ge=1)]


# --------------------------------------------------------------------------------------------
# Request payload (Fish's TTSRequest, every field, Fish's defaults, plus ours)
# --------------------------------------------------------------------------------------------


class ReferenceAudio(msgspec.Struct, kw_only=True, gc=False):
    """One inline reference clip: audio bytes in any format soundfile reads + its transcript."""

    audio: bytes  # msgpack bin; base64 string in JSON
    text: str


class Prosody(msgspec.Struct, kw_only=True, gc=False):
    speed: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    volume: float = 0.0  # dB


class TTSRequest(msgspec.Struct, kw_only=True, gc=False):
    """The ``request`` of a ``start`` event.

    The first block is Fish's ``TTSRequest`` (fish-audio-sdk 1.3.0) with Fish's defaults; the
    SDK always sends all of them. The service decides which it honours (documented in the
    README); accepting them all is what keeps the unmodified SDK working. Ranges are checked
    only where a value would be nonsensical for any engine (the SDK itself restricts
    ``chunk_length`` to 100..300 and ``temperature`` to 0..1; we are laxer on purpose).
    """

    # --- Fish fields -----------------------------------------------------------------------
    text: str = ""  # text to speak right away; the SDK sends "" and streams ``text`` events
    chunk_length: _PosInt = 200  # characters per segment when no sentence end comes first
    format: str = "mp3"  # pcm | wav | mp3 | opus | mulaw (ours)
    sample_rate: Annotated[int, msgspec.Meta(gt=0)] | None = None  # None: format's default
    mp3_bitrate: _PosInt = 128  # kbps
    opus_bitrate: int = 32  # kbps; -1000 = libopus "auto"
    references: list[ReferenceAudio] = msgspec.field(default_factory=list)
    reference_id: str | None = None
    normalize: bool = True
    latency: str = "balanced"  # normal | balanced
    prosody: Prosody | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.7
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.7
    max_new_tokens: _PosInt = 1024  # frames per segment, upper bound
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.2
    min_chunk_length: _NonNegInt = 50
    condition_on_previous_chunks: bool = True
    early_stop_threshold: float = 1.0

    # --- rtvoice extensions (all optional; None = the server's configured default) ---------
    top_k: _PosInt | None = None
    seed: int | None = None  # makes sampling reproducible for this session
    first_chunk_frames: _PosInt | None = None  # codec frames in the first audio chunk of a turn
    chunk_frames: _PosInt | None = None  # codec frames in later chunks
    context_id: str | None = None  # default context id for this session's events
    timestamps: bool = True  # send a ``segment`` event per spoken segment (text <-> audio times)


# --------------------------------------------------------------------------------------------
# Client -> server
# --------------------------------------------------------------------------------------------


class _ClientEventBase(msgspec.Struct, tag_field="event", kw_only=True, gc=False):
    context_id: str | None = None


class Start(_ClientEventBase, tag="start"):
    """Open the session: choose the voice and output format. The server prefills at once."""

    request: TTSRequest


class Text(_ClientEventBase, tag="text"):
    """More text for the current turn (any granularity: token, word, sentence)."""

    text: str


class Flush(_ClientEventBase, tag="flush"):
    """End of turn: synthesise whatever text is buffered now, without waiting for more."""


class Stop(_ClientEventBase, tag="stop"):
    """End of session (Fish): flush, finish all audio, answer ``finish{stop}``, close."""


class Cancel(_ClientEventBase, tag="cancel"):
    """Barge-in (ours): drop buffered text and stop generating now; answer ``done{cancelled}``."""


ClientEvent = Start | Text | Flush | Stop | Cancel


# --------------------------------------------------------------------------------------------
# Server -> client
# --------------------------------------------------------------------------------------------


class _ServerEventBase(msgspec.Struct, tag_field="event", kw_only=True, gc=False):
    context_id: str | None = None


class Audio(_ServerEventBase, tag="audio"):
    """A chunk of encoded audio. Fish clients read only ``audio``."""

    audio: bytes
    seq: int = 0  # per context, from 0, no gaps
    offset_s: float = 0.0  # start of this chunk within the context's audio
    duration_s: float = 0.0  # audio duration this chunk completes (see README for codecs)


class Word(msgspec.Struct, kw_only=True, gc=False):
    """One word of a ``segment`` with its time span (Fish's alignment item: text, start, end)."""

    text: str
    start: float  # seconds, on the context's audio timeline (that of ``audio.offset_s``)
    end: float
    char_start: int  # range in the turn's text, like the segment's
    char_end: int


class Segment(_ServerEventBase, tag="segment"):
    """A spoken segment: which text the audio around it says, and when.

    Sent twice per segment: with ``final: false`` right before the segment's first audio
    (``end`` unknown, word times estimated from a speaking-rate model), then with
    ``final: true`` and the same ``index`` once all of its audio is generated (measured
    ``end``, word times rescaled to it). The later one replaces the earlier."""

    index: int  # per context, from 0, in speaking order
    text: str  # the segment's text (as cut by the server: surrounding whitespace stripped)
    char_start: int  # [char_start, char_end) in the turn's text, as the server received it
    char_end: int
    start: float  # seconds, on the context's audio timeline (that of ``audio.offset_s``)
    end: float | None = None  # None until ``final``
    final: bool = False
    words: list[Word] = msgspec.field(default_factory=list)
    timing: str = "estimated"  # how word times were found: "estimated" (no model alignment)


class Finish(_ServerEventBase, tag="finish"):
    """Fish's terminal event. ``reason`` is always present: the legacy SDK indexes it."""

    reason: str  # FinishReason


class Limits(msgspec.Struct, kw_only=True, gc=False):
    """Server limits announced in ``ready``; ``None`` means not limited / not announced."""

    max_message_bytes: int | None = None
    max_text_chars: int | None = None  # unflushed text buffered per context
    max_contexts: int | None = None  # contexts alive at once on one socket
    max_new_tokens: int | None = None  # frames per segment
    max_reference_s: float | None = None
    idle_timeout_s: float | None = None
    max_context_id_chars: int | None = None
    max_nesting_depth: int | None = None  # a flat map is 1
    max_reference_samples: int | None = None  # samples x channels one clip may decode to
    max_references: int | None = None
    max_chunk_length: int | None = None
    send_queue_bytes: int | None = None  # audio queued for a slow reader before it is dropped
    send_timeout_s: float | None = None
    send_queue_events: int | None = None
    max_sessions: int | None = None  # per server
    max_sessions_per_key: int | None = None  # 0: no per-key limit
    max_unstarted: int | None = None  # connections that have not sent start yet
    start_timeout_s: float | None = None
    reuse_timeout_s: float | None = None  # the socket stays open after finish{stop} this long
    reference_workers: int | None = None  # reference clips decoded at once


class Ready(_ServerEventBase, tag="ready"):
    """Voice prompt prefilled; text sent from now on is not delayed by the prefill."""

    format: str
    sample_rate: int
    channels: int = 1
    frame_rate_hz: float = 44100 / 2048  # codec frames per second
    prefill_ms: float = 0.0
    limits: Limits = msgspec.field(default_factory=Limits)
    model: str = ""
    session_id: str = ""
    reference_id: str | None = None
    protocol_version: int = PROTOCOL_VERSION


class Done(_ServerEventBase, tag="done"):
    """End of one turn (one context's flushed text), with its measurements."""

    reason: str  # DoneReason
    ttfa_ms: float | None = None  # segment ready -> first audio chunk handed to the socket
    # the part of ttfa_ms until the segment's prompt was prefilled (waiting for a decode row
    # or KV blocks included); the rest is its first frames' decode, the codec, the encoder
    prefill_ms: float | None = None
    audio_s: float = 0.0
    frames: int = 0
    rtf: float | None = None  # generation wall time / audio duration
    segments: int = 0
    text_chars: int = 0


class Error(_ServerEventBase, tag="error"):
    """A structured error; ``code`` is one of ``protocol.errors.ErrorCode``."""

    code: str
    message: str = ""
    fatal: bool = False
    done_follows: bool = False  # non-fatal: the context's turn still ends with done{error}


ServerEvent = Audio | Finish | Ready | Done | Error | Segment


def event_name(event: msgspec.Struct | type[msgspec.Struct]) -> str:
    """The ``event`` tag of an event instance or class (e.g. ``"text"``)."""
    cls = event if isinstance(event, type) else type(event)
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} is not a protocol event")
    return tag
