"""Wire schema, codecs, error codes and the session state machine (no I/O)."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

import msgspec
import pytest

import protocol as p
from protocol import (
    Audio,
    Cancel,
    CloseCode,
    Done,
    Encoding,
    Error,
    ErrorCode,
    Finish,
    Flush,
    InvalidTransition,
    Limits,
    ProtocolError,
    Ready,
    ReferenceAudio,
    SessionState,
    SessionStateMachine,
    Start,
    Stop,
    Text,
    TTSRequest,
    decode_client,
    decode_server,
    encode_client,
    encode_server,
)

S = SessionState
ENCODINGS = [Encoding.MSGPACK, Encoding.JSON]


def _pack(obj: object, encoding: Encoding) -> bytes | str:
    """Raw (untyped) serialisation, as a foreign client would produce."""
    if encoding is Encoding.MSGPACK:
        return msgspec.msgpack.encode(obj)
    return msgspec.json.encode(obj).decode()


def _code(data: bytes | str, **kw: object) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        decode_client(data, **kw)  # type: ignore[arg-type]
    return info.value.code


# ------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------

CLIENT_EVENTS = [
    Start(
        request=TTSRequest(
            text="hi",
            format="pcm",
            sample_rate=24000,
            references=[ReferenceAudio(audio=b"\x00\x01\xffRIFF", text="ref")],
            prosody=p.Prosody(speed=1.2, volume=-3.0),
            seed=7,
            first_chunk_frames=2,
        ),
        context_id="c1",
    ),
    Text(text="Hello, مرحبا, 你好, こんにちは."),
    Text(text="x", context_id="ctx"),
    Flush(),
    Stop(),
    Cancel(context_id="c2"),
]

SERVER_EVENTS = [
    Audio(audio=bytes(range(256)), context_id="c1", seq=3, offset_s=0.25, duration_s=0.1),
    Finish(reason="stop"),
    Finish(reason="error"),
    Ready(
        format="wav",
        sample_rate=16000,
        prefill_ms=12.5,
        limits=Limits(max_text_chars=10_000, max_contexts=4),
        model="tiny",
        session_id="s",
    ),
    Done(context_id="c1", reason="eos", ttfa_ms=41.0, audio_s=1.5, frames=32, rtf=0.1),
    Error(code="invalid_state", message="nope", context_id="c", fatal=False),
]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("event", CLIENT_EVENTS, ids=lambda e: p.event_name(e))
def test_client_round_trip(event: p.ClientEvent, encoding: Encoding) -> None:
    data = encode_client(event, encoding)
    assert isinstance(data, bytes if encoding is Encoding.MSGPACK else str)
    assert p.encoding_of(data) is encoding
    assert decode_client(data) == event


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("event", SERVER_EVENTS, ids=lambda e: p.event_name(e))
def test_server_round_trip(event: p.ServerEvent, encoding: Encoding) -> None:
    data = encode_server(event, encoding)
    assert isinstance(data, bytes if encoding is Encoding.MSGPACK else str)
    assert decode_server(data) == event


def test_json_bytes_are_base64() -> None:
    text = encode_server(Audio(audio=b"\x00\xffabc"), Encoding.JSON)
    assert json.loads(text)["audio"] == base64.b64encode(b"\x00\xffabc").decode()
    start = _pack(
        {"event": "start", "request": {"references": [{"audio": "AAE=", "text": "t"}]}},
        Encoding.JSON,
    )
    assert decode_client(start).request.references[0].audio == b"\x00\x01"


def test_every_event_has_event_tag_and_context_id() -> None:
    for event in CLIENT_EVENTS + SERVER_EVENTS:
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
        assert raw["event"] == p.event_name(event)
        assert "context_id" in raw


def test_defaults_match_fish() -> None:
    r = TTSRequest()
    assert (r.text, r.chunk_length, r.format, r.sample_rate) == ("", 200, "mp3", None)
    assert (r.mp3_bitrate, r.opus_bitrate, r.references, r.reference_id) == (128, 32, [], None)
    assert (r.normalize, r.latency, r.prosody, r.top_p, r.temperature) == (
        True, "balanced", None, 0.7, 0.7,
    )  # fmt: skip
    assert (r.max_new_tokens, r.repetition_penalty, r.min_chunk_length) == (1024, 1.2, 50)
    assert (r.condition_on_previous_chunks, r.early_stop_threshold) == (True, 1.0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_minimal_messages_and_unknown_fields(encoding: Encoding) -> None:
    # Every field but the tag (and the required payload) is optional...
    assert decode_client(_pack({"event": "start", "request": {}}, encoding)) == Start(
        request=TTSRequest()
    )
    assert decode_client(_pack({"event": "flush"}, encoding)) == Flush()
    # ...and unknown fields, at any depth, are ignored (forward compatibility).
    msg = {
        "event": "start",
        "future_field": [1, 2, {"x": None}],
        "request": {"text": "a", "brand_new_knob": 3.5, "prosody": {"speed": 2, "pitch": 1}},
    }
    ev = decode_client(_pack(msg, encoding))
    assert isinstance(ev, Start)
    assert ev.request.text == "a"
    assert ev.request.prosody == p.Prosody(speed=2.0)


def test_int_is_accepted_for_float_fields() -> None:
    ev = decode_client(
        _pack({"event": "start", "request": {"temperature": 1, "top_p": 0}}, Encoding.MSGPACK)
    )
    assert isinstance(ev.request.temperature, float) and ev.request.temperature == 1.0


# ------------------------------------------------------------------------------------------
# Error codes of the decoder
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\xc1", ErrorCode.MALFORMED_MESSAGE),  # invalid msgpack opcode
        (b"\x92\x01", ErrorCode.MALFORMED_MESSAGE),  # truncated msgpack array
        (b"", ErrorCode.MALFORMED_MESSAGE),
        ("{not json", ErrorCode.MALFORMED_MESSAGE),
        ("", ErrorCode.MALFORMED_MESSAGE),
        (msgspec.msgpack.encode([1, 2]), ErrorCode.MALFORMED_MESSAGE),  # not a map
        ("42", ErrorCode.MALFORMED_MESSAGE),
        (msgspec.msgpack.encode({"event": "dance"}), ErrorCode.UNKNOWN_EVENT),
        ('{"event": "dance"}', ErrorCode.UNKNOWN_EVENT),
        (msgspec.msgpack.encode({"event": 5}), ErrorCode.UNKNOWN_EVENT),
        (msgspec.msgpack.encode({"text": "no tag"}), ErrorCode.MISSING_FIELD),
        (msgspec.msgpack.encode({"event": "text"}), ErrorCode.MISSING_FIELD),
        ('{"event": "start"}', ErrorCode.MISSING_FIELD),
        (
            msgspec.msgpack.encode(
                {"event": "start", "request": {"references": [{"audio": b"x"}]}}
            ),
            ErrorCode.MISSING_FIELD,
        ),
        (msgspec.msgpack.encode({"event": "text", "text": 5}), ErrorCode.INVALID_FIELD),
        ('{"event": "text", "text": null}', ErrorCode.INVALID_FIELD),
        ('{"event": "flush", "context_id": 3}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": "x"}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": {"temperature": "hot"}}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": {"normalize": 1}}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": {"chunk_length": 0}}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": {"top_p": 1.5}}', ErrorCode.INVALID_FIELD),
        ('{"event": "start", "request": {"sample_rate": -1}}', ErrorCode.INVALID_FIELD),
        (
            '{"event": "start", "request": {"references": [{"audio": "!!", "text": ""}]}}',
            ErrorCode.INVALID_FIELD,
        ),
        (
            msgspec.msgpack.encode(
                {"event": "start", "request": {"references": [{"audio": "str", "text": ""}]}}
            ),
            ErrorCode.INVALID_FIELD,
        ),
    ],
)
def test_decode_error_codes(data: bytes | str, code: ErrorCode) -> None:
    assert _code(data) is code


def test_errors_name_event_and_context() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client('{"event": "text", "text": 1, "context_id": "c9"}')
    err = info.value
    assert (err.code, err.event, err.context_id) == (ErrorCode.INVALID_FIELD, "text", "c9")
    assert "$.text" in err.message
    assert not err.fatal and err.close_code is CloseCode.INVALID_PAYLOAD
    event = err.to_event()
    assert event == Error(code="invalid_field", message=err.message, fatal=False, context_id="c9")

    with pytest.raises(ProtocolError) as info:
        decode_client('{"event": "teleport"}')
    assert info.value.event == "teleport" and "'teleport'" in info.value.message


def test_too_large() -> None:
    small = encode_client(Text(text="x" * 10))
    assert decode_client(small, max_bytes=len(small)) == Text(text="x" * 10)
    assert _code(small, max_bytes=len(small) - 1) is ErrorCode.TOO_LARGE
    # JSON limits count UTF-8 bytes, not characters.
    text = encode_client(Text(text="é" * 100), Encoding.JSON)
    assert _code(text, max_bytes=len(text) + 50) is ErrorCode.TOO_LARGE
    assert decode_client(text, max_bytes=len(text.encode())) == Text(text="é" * 100)


def test_bytearray_and_memoryview_frames() -> None:
    data = encode_client(Flush(context_id="a"))
    assert decode_client(bytearray(data)) == Flush(context_id="a")
    assert decode_client(memoryview(data)) == Flush(context_id="a")


def test_decode_server_unknown_event_is_skippable() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_server(msgspec.msgpack.encode({"event": "from_the_future", "x": 1}))
    assert info.value.code is ErrorCode.UNKNOWN_EVENT


# ------------------------------------------------------------------------------------------
# Error table
# ------------------------------------------------------------------------------------------


def test_error_table_is_complete_and_consistent() -> None:
    for code in ErrorCode:
        spec = p.error_spec(code)
        assert spec.code is code
        assert spec.close_code in set(CloseCode)
        assert 400 <= spec.http_status < 600
        assert p.error_spec(code.value) == spec
    with pytest.raises(ValueError):
        p.error_spec("no_such_code")
    # The contract the issue spells out.
    expect = {
        "bad_request": (1008, False),
        "unknown_event": (1003, False),
        "invalid_state": (1008, False),
        "malformed_message": (1007, False),
        "invalid_field": (1007, False),
        "missing_field": (1007, False),
        "unknown_voice": (1008, True),
        "bad_reference_audio": (1007, True),
        "too_large": (1009, True),
        "overloaded": (1013, True),
        "unsupported_format": (1003, True),
        "timeout": (1008, True),
        "internal": (1011, True),
    }
    for code, (close, fatal) in expect.items():
        spec = p.error_spec(code)
        assert (int(spec.close_code), spec.fatal) == (close, fatal), code
        assert ProtocolError(code, "m").fatal is fatal


# ------------------------------------------------------------------------------------------
# State machine
# ------------------------------------------------------------------------------------------


def test_happy_path_transitions() -> None:
    sm = SessionStateMachine()
    assert sm.state is S.CONNECTING and sm.is_open and not sm.is_prefilled
    assert sm.apply(Start(request=TTSRequest())) is S.PREFILLING
    sm.apply(Text(text="early text is buffered during prefill"))
    assert sm.transition(S.READY) is S.READY and sm.is_prefilled
    for dst in (S.GENERATING, S.IDLE, S.GENERATING, S.IDLE):
        sm.transition(dst)
    assert sm.apply(Stop()) is S.IDLE and sm.stopping
    sm.transition(S.CLOSING)
    assert not sm.is_open
    sm.transition(S.CLOSED)
    assert sm.allowed_events() == frozenset()


def test_every_transition_in_the_table() -> None:
    for src in S:
        for dst in S:
            sm = SessionStateMachine(src)
            if dst in p.TRANSITIONS[src]:
                assert sm.can_transition(dst)
                assert sm.transition(dst) is dst
            else:
                assert not sm.can_transition(dst)
                with pytest.raises(InvalidTransition) as info:
                    sm.transition(dst)
                assert (info.value.src, info.value.dst) == (src, dst)
                assert f"{src.value} -> {dst.value}" in str(info.value)
                assert sm.state is src  # a refused transition changes nothing


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.CONNECTING, Text(text="x")),  # text before start
        (S.CONNECTING, Flush()),
        (S.CONNECTING, Cancel()),
        (S.PREFILLING, Start(request=TTSRequest())),  # start twice
        (S.IDLE, Start(request=TTSRequest())),
        (S.CLOSING, Text(text="x")),
        (S.CLOSED, Stop()),
    ],
)
def test_illegal_events_raise_invalid_state(state: SessionState, event: p.ClientEvent) -> None:
    sm = SessionStateMachine(state)
    with pytest.raises(ProtocolError) as info:
        sm.apply(event)
    assert info.value.code is ErrorCode.INVALID_STATE and not info.value.fatal
    assert info.value.event == p.event_name(event)
    assert sm.state is state


def test_text_before_start_hint_and_context() -> None:
    sm = SessionStateMachine()
    with pytest.raises(ProtocolError, match="send 'start' first") as info:
        sm.check_event(Text(text="x", context_id="k"))
    assert info.value.context_id == "k"


def test_legal_events_per_state() -> None:
    for state, allowed in p.ALLOWED_EVENTS.items():
        for name in ("start", "text", "flush", "stop", "cancel"):
            sm = SessionStateMachine(state)
            if name in allowed:
                sm.check_event(name)
            else:
                with pytest.raises(ProtocolError):
                    sm.check_event(name)


def test_stop_before_start_closes_and_after_stop_only_cancel() -> None:
    sm = SessionStateMachine()
    assert sm.apply(Stop()) is S.CLOSING

    sm = SessionStateMachine()
    sm.apply(Start(request=TTSRequest()))
    sm.apply(Text(text="a"))
    sm.apply(Stop())  # Fish's SDK sends start, text, stop back to back
    assert sm.state is S.PREFILLING and sm.stopping
    sm.apply(Cancel())
    with pytest.raises(ProtocolError, match="stopping"):
        sm.apply(Text(text="more"))
    # Draining continues through the normal states after stop.
    sm.transition(S.READY)
    sm.transition(S.GENERATING)
    sm.transition(S.IDLE)
    sm.transition(S.CLOSING)


# ------------------------------------------------------------------------------------------
# Fish Audio SDK compatibility: the exact bytes it sends, and what it does with ours
# ------------------------------------------------------------------------------------------


def _sdk_request(**overrides: object):  # -> fishaudio.types.TTSRequest
    tts = pytest.importorskip("fishaudio.resources.tts")
    from fishaudio import TTSConfig

    req = tts._config_to_tts_request(TTSConfig(), text="")  # what stream_websocket builds
    for key, value in overrides.items():
        setattr(req, key, value)
    return req


def test_sdk_start_event_decodes() -> None:
    ormsgpack = pytest.importorskip("ormsgpack")
    from fishaudio.types import Prosody as FishProsody
    from fishaudio.types import ReferenceAudio as FishRef
    from fishaudio.types import StartEvent

    req = _sdk_request(
        format="wav",
        references=[FishRef(audio=b"RIFF\x00\x00", text="transcript")],
        prosody=FishProsody.from_speed_override(1.3),
        reference_id="abc123",
    )
    data = ormsgpack.packb(StartEvent(request=req).model_dump())  # exactly what the SDK sends
    ev = decode_client(data)
    assert isinstance(ev, Start)
    r = ev.request
    assert (r.format, r.reference_id, r.text) == ("wav", "abc123", "")
    assert r.references == [ReferenceAudio(audio=b"RIFF\x00\x00", text="transcript")]
    assert r.prosody == p.Prosody(speed=1.3, volume=0.0)
    # Every field the SDK sends is a field of ours, with the same default.
    sdk_fields = req.model_dump()
    ours = msgspec.structs.asdict(TTSRequest())
    assert set(sdk_fields) <= set(ours)
    defaults = _sdk_request().model_dump()
    for name, value in defaults.items():
        assert ours[name] == value, name


def test_sdk_text_flush_stop_and_legacy_sdk_decode() -> None:
    ormsgpack = pytest.importorskip("ormsgpack")
    from fishaudio.types import CloseEvent, FlushEvent, TextEvent

    assert decode_client(ormsgpack.packb(TextEvent(text="Hi.").model_dump())) == Text(text="Hi.")
    assert decode_client(ormsgpack.packb(FlushEvent().model_dump())) == Flush()
    assert decode_client(ormsgpack.packb(CloseEvent().model_dump())) == Stop()

    legacy = pytest.importorskip("fish_audio_sdk")
    req = legacy.TTSRequest(
        text="hello", format="pcm", references=[legacy.ReferenceAudio(audio=b"a", text="b")]
    )
    ev = decode_client(ormsgpack.packb(legacy.StartEvent(request=req).model_dump()))
    assert isinstance(ev, Start) and ev.request.text == "hello" and ev.request.format == "pcm"
    assert decode_client(ormsgpack.packb(legacy.CloseEvent().model_dump())) == Stop()


def test_sdk_reads_our_server_events() -> None:
    ormsgpack = pytest.importorskip("ormsgpack")
    realtime = pytest.importorskip("fishaudio.resources.realtime")
    from fishaudio.exceptions import WebSocketError

    def sdk_view(event: p.ServerEvent) -> dict:
        return ormsgpack.unpackb(encode_server(event))  # the SDK's own decoder

    # audio -> yielded bytes; our extensions -> ignored; finish stop -> stop; error -> raise.
    assert realtime._process_audio_event(sdk_view(SERVER_EVENTS[0])) == bytes(range(256))
    for extension in SERVER_EVENTS[3:]:
        data = sdk_view(extension)
        assert realtime._process_audio_event(data) is None
        assert not realtime._should_stop(data)
    assert realtime._should_stop(sdk_view(Finish(reason="stop")))
    with pytest.raises(WebSocketError):
        realtime._process_audio_event(sdk_view(Finish(reason="error")))
    # The legacy SDK indexes data["event"] and, for finish, data["reason"].
    for event in SERVER_EVENTS:
        data = sdk_view(event)
        assert "event" in data
        if data["event"] == "finish":
            assert data["reason"] in ("stop", "error")


# ------------------------------------------------------------------------------------------
# Package hygiene
# ------------------------------------------------------------------------------------------


def test_protocol_is_sans_io() -> None:
    root = Path(p.__file__).parent
    forbidden = {"asyncio", "socket", "websockets", "starlette", "uvicorn", "threading"}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"


def _nested_text_event(encoding: str, n: int) -> bytes | str:
    """A ``text`` event with an unknown field ``x`` holding `n` nested one-element arrays."""
    if encoding == "msgpack":
        import msgspec

        head = msgspec.msgpack.encode
        return (bytes([0x83]) + head("event") + head("text") + head("text") + head("hi")
                + head("x") + bytes([0x91]) * n + bytes([0xC0]))
    return '{"event":"text","text":"hi","x":' + "[" * n + "null" + "]" * n + "}"


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
@pytest.mark.parametrize("max_depth", [None, 32])
def test_deeply_nested_message_is_malformed_not_a_crash(encoding, max_depth):
    """A 1 KB frame nested 1,000 deep (even inside an unknown field) is a non-fatal
    malformed_message naming the limit — with the depth check, and without it (the decoder's
    own bound, Python's recursion limit: no RecursionError escapes). The process's limit may
    have been raised (inductor raises it to 2,000 when it compiles): without the check the
    frame nests twice as deep as that."""
    import sys

    depth = 1000 if max_depth is not None else max(1000, 2 * sys.getrecursionlimit())
    with pytest.raises(ProtocolError) as e:
        decode_client(_nested_text_event(encoding, depth), max_depth=max_depth)
    assert e.value.code == "malformed_message" and not e.value.fatal
    assert "nested" in e.value.message and e.value.limit == "max_nesting_depth"


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_nesting_limit_is_exact(encoding):
    """The event map is level 1, so x holding n arrays is n + 1 levels deep."""
    assert decode_client(_nested_text_event(encoding, 7), max_depth=8).text == "hi"
    with pytest.raises(ProtocolError):
        decode_client(_nested_text_event(encoding, 8), max_depth=8)


def test_too_deep_scanners():
    import msgspec

    from protocol.codec import MAX_VALUES, too_deep

    cases = [({"a": 1}, 1), ({"a": [1, 2, {"b": []}]}, 4), ([[], [[]]], 3), ({}, 1),
             ({"t": 'a\\"[[[[[{{{', "u": [[]]}, 3), ({"t": "\\\\", "u": [[[[]]]]}, 5),
             ({"event": "start", "request": {"references": [{"audio": b"x" * 70000}]}}, 4)]
    for value, depth in cases:
        for frame in (msgspec.msgpack.encode(value), msgspec.json.encode(value).decode()):
            assert not too_deep(frame, depth), (value, frame[:40])
            assert too_deep(frame, depth - 1), (value, frame[:40])
    # more values than any event has: refused without walking them all
    assert too_deep(msgspec.msgpack.encode({"x": list(range(MAX_VALUES + 10))}), 32)
    assert too_deep(msgspec.json.encode({"x": [[]] * (MAX_VALUES + 10)}).decode(), 32)
    # but a long flat list of scalars in JSON, or brackets inside strings, are fine
    assert not too_deep(msgspec.json.encode({"x": [1] * 100_000}).decode(), 32)
    assert not too_deep(msgspec.json.encode({"t": "[" * 100_000}).decode(), 32)
    # truncated input is left to the decoder
    assert not too_deep(msgspec.msgpack.encode({"a": [1, 2, 3]})[:-2], 32)
