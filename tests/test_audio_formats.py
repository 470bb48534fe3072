"""Streaming output encoders (rtvoice/audio_formats.py) and reference-audio decoding
(engine/reference_audio.py), checked by decoding with soundfile."""

from __future__ import annotations

import functools
import io
import struct
import warnings
import wave

import numpy as np
import pytest
import soundfile as sf
import soxr

from engine.errors import ReferenceAudioTooLong
from engine.reference_audio import decode_reference_audio
from rtvoice.audio_formats import FORMATS, EncoderConfig, make_encoder, mulaw_encode

SR = 44100  # the S2 codec's rate: what the encoders get
_make_encoder = functools.partial(make_encoder, input_sample_rate=SR)
# A codec-like chunk pattern: small first chunk (2 frames of 2048), larger later ones.
CHUNKS = [4096, 6144] + [12288] * 40


def _signal(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(seconds * SR) + 37  # deliberately not a multiple of any frame size
    t = np.arange(n) / SR
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(n)
    return x.astype(np.float32)


def _stream(enc, x: np.ndarray, chunks: list[int] = CHUNKS) -> list[bytes]:
    out, i = [], 0
    for size in chunks:
        if i >= len(x):
            break
        out.append(enc.encode(x[i : i + size]))
        i += size
    assert i >= len(x), "chunk pattern too short for the signal"
    out.append(enc.finish())
    return out


def _decode(fmt: str, data: bytes, rate: int) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, rate
    if fmt == "mulaw":
        return sf.read(io.BytesIO(data), format="RAW", subtype="ULAW", samplerate=8000, channels=1)
    return sf.read(io.BytesIO(data))


ALL = [(fmt, rate) for fmt, info in FORMATS.items() for rate in info.sample_rates]


@pytest.mark.parametrize(("fmt", "rate"), ALL, ids=[f"{f}-{r}" for f, r in ALL])
def test_every_format_and_rate_decodes_with_right_rate_and_duration(fmt: str, rate: int) -> None:
    x = _signal(1.2)
    enc = _make_encoder(fmt, rate)
    assert (enc.format, enc.sample_rate, enc.channels) == (fmt, rate, 1)
    assert enc.content_type
    data = b"".join(_stream(enc, x))
    assert enc.samples_in == len(x)
    y, got_rate = _decode(fmt, data, rate)
    assert got_rate == rate
    extra = len(y) / got_rate - len(x) / SR
    # Never shorter than the input (but for one sample of resampling rounding), and longer by
    # at most the documented codec padding: 0 for pcm/wav/mulaw/opus, ~50 ms for mp3 at 44.1k.
    assert -1.0 / rate - 1e-9 <= extra <= enc.padding_bound_s + 1e-9, (extra, enc.padding_bound_s)
    if fmt in ("pcm", "wav", "mulaw", "opus"):
        assert abs(extra) <= 1.0 / rate + 1e-9


@pytest.mark.parametrize("rate", FORMATS["pcm"].sample_rates)
def test_streamed_resampling_equals_one_shot(rate: int) -> None:
    x = _signal(1.0, seed=1)
    enc = _make_encoder("pcm", rate)
    # Irregular chunk sizes, including tiny and empty ones, must not change a single sample.
    chunks = [1, 0, 4096, 333, 2048, 7, 8192] + [10_000] * 10
    streamed = np.frombuffer(b"".join(_stream(enc, x, chunks)), "<i2")
    reference = soxr.resample(x, SR, rate, quality="HQ") if rate != SR else x
    expected = np.rint(np.clip(reference, -1, 1) * 32767).astype(np.int16)
    assert len(streamed) == len(expected)
    # Identical up to float rounding: at most one LSB of int16 anywhere.
    assert np.abs(streamed.astype(np.int32) - expected.astype(np.int32)).max() <= 1


def test_pcm_44k_is_exact_passthrough() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, np.nan], dtype=np.float32)
    enc = _make_encoder("pcm")
    data = enc.encode(x) + enc.finish()
    assert np.frombuffer(data, "<i2").tolist() == [
        0,
        16384,
        -16384,
        32767,
        -32767,
        32767,
        -32767,
        0,
    ]


def test_wav_stream_header() -> None:
    enc = _make_encoder("wav", 16000)
    first = enc.encode(np.zeros(10, np.float32))  # header goes out with the first call
    assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt " and first[36:40] == b"data"
    # Unknown-length convention: RIFF and data sizes are 0xFFFFFFFF.
    assert struct.unpack("<I", first[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", first[40:44])[0] == 0xFFFFFFFF
    channels, rate, _, _, bits = struct.unpack("<HIIHH", first[22:36])
    assert (channels, rate, bits) == (1, 16000, 16)
    data = first + enc.finish()
    # Python's wave module also reads such a stream (to its end).
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 16000
        assert len(w.readframes(10**6)) // 2 == len(data[44:]) // 2


def test_wav_without_audio_is_header_only() -> None:
    enc = _make_encoder("wav")
    data = enc.finish()
    assert len(data) == 44
    y, rate = sf.read(io.BytesIO(data))
    assert rate == 44100 and len(y) == 0


def _ulaw_reference(pcm: np.ndarray) -> np.ndarray:
    """G.711 u-law straight from the standard's description (scalar, no tables)."""
    out = []
    for s in pcm.tolist():
        v = s >> 2  # 14-bit
        sign = 0x80 if v < 0 else 0
        mag = min(-v if v < 0 else v, 8159) + 33
        seg = max(0, mag.bit_length() - 6)  # 0..7: position of the highest set bit above 5
        mant = (mag >> (seg + 1)) & 0x0F
        if seg > 7:  # beyond the last segment: the largest code
            seg, mant = 7, 0x0F
        out.append(~(sign | (seg << 4) | mant) & 0xFF)
    return np.array(out, dtype=np.uint8)


def test_mulaw_matches_g711_reference() -> None:
    pcm = np.arange(-32768, 32768, 7, dtype=np.int16)
    ours = np.frombuffer(mulaw_encode(pcm), np.uint8)
    np.testing.assert_array_equal(ours, _ulaw_reference(pcm))
    # And CPython's audioop (the classic Sun g711.c) where it still exists (< 3.13), exhaustively.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    every = np.arange(-32768, 32768, dtype=np.int16)
    ref = np.frombuffer(audioop.lin2ulaw(every.astype("<i2").tobytes(), 2), np.uint8)
    np.testing.assert_array_equal(np.frombuffer(mulaw_encode(every), np.uint8), ref)


def test_mulaw_decodes_back_to_the_signal() -> None:
    x = _signal(0.5)
    enc = _make_encoder("mulaw")
    assert enc.content_type == "audio/basic"
    y, _ = _decode("mulaw", b"".join(_stream(enc, x)), 8000)
    ref = soxr.resample(x, SR, 8000, quality="HQ")
    # u-law's relative quantisation error is < 1/16 of the magnitude (+ the small-signal step).
    assert np.all(np.abs(y - ref) <= np.abs(ref) / 16 + 2.5e-4)


def test_mp3_stream_starts_with_audio_and_bitrate_is_honoured() -> None:
    x = _signal(1.0)
    sizes = {}
    for kbps in (64, 128, 192):
        enc = _make_encoder("mp3", mp3_bitrate=kbps)
        data = b"".join(_stream(enc, x))
        # No LAME Info-tag placeholder (a header followed by zeros) at the start.
        assert data[:2] == b"\xff\xfb" and any(data[4:40])
        sizes[kbps] = len(data)
    duration = len(x) / SR
    for kbps, size in sizes.items():
        assert size * 8 / duration / 1000 == pytest.approx(kbps, rel=0.15)


def test_opus_bitrate_and_streaming_latency() -> None:
    x = _signal(2.0)
    enc = _make_encoder("opus", opus_bitrate=24)
    parts = _stream(enc, x)
    # Pages are flushed per packet: audio flows with every chunk, not once a second.
    assert all(len(part) > 0 for part in parts[1:-1])
    total = sum(map(len, parts))
    assert 20 <= total * 8 / 2.0 / 1000 <= 45  # 24 kbps + headers and page overhead


def test_cancelled_turn_can_close_without_finish() -> None:
    for fmt in FORMATS:
        enc = _make_encoder(fmt)
        enc.encode(_signal(0.2))
        enc.close()
        enc.close()  # idempotent
        with pytest.raises(RuntimeError):
            enc.encode(np.zeros(4, np.float32))


def test_finish_twice_and_bad_input() -> None:
    enc = _make_encoder("pcm")
    with pytest.raises(ValueError, match="mono"):
        enc.encode(np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="float"):
        enc.encode(np.zeros(4, np.int16))
    enc.encode(np.zeros((4, 1), np.float64))  # [n, 1] and float64 are fine
    enc.finish()
    with pytest.raises(RuntimeError):
        enc.finish()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "flac"}, "unsupported audio format 'flac'"),
        ({"format": "pcm", "sample_rate": 11025}, "unsupported sample rate 11025 Hz for pcm"),
        ({"format": "opus", "sample_rate": 44100}, "for opus; supported: 8000, 12000"),
        ({"format": "mulaw", "sample_rate": 16000}, "supported: 8000 Hz"),
        ({"format": "mp3", "mp3_bitrate": 1000}, "mp3_bitrate"),
        ({"format": "opus", "opus_bitrate": 2}, "opus_bitrate"),
    ],
)
def test_unsupported_combinations_are_rejected_clearly(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        _make_encoder(**kwargs)
    if "bitrate" not in match:  # format/rate errors list every supported combination
        assert "pcm: 8000, 16000, 22050, 24000, 32000, 44100, 48000" in str(info.value)


def test_bitrates_in_fishs_units_and_only_for_their_format() -> None:
    """LiveKit's Fish plugin sends opus_bitrate=64000 (bps, as Fish documents) in every start,
    whatever the format; Fish documents 32 kHz for pcm and wav."""
    assert EncoderConfig("opus", opus_bitrate=64000, input_sample_rate=SR).opus_bitrate == 64
    assert EncoderConfig("mp3", mp3_bitrate=192000, input_sample_rate=SR).mp3_bitrate == 192
    assert EncoderConfig("opus", opus_bitrate=-1000, input_sample_rate=SR).opus_bitrate == -1000
    for fmt in ("pcm", "wav", "mulaw", "mp3"):  # an opus bitrate means nothing to them
        EncoderConfig(fmt, opus_bitrate=64000, input_sample_rate=SR)
        EncoderConfig(fmt, opus_bitrate=2, input_sample_rate=SR)
    EncoderConfig("opus", mp3_bitrate=5, input_sample_rate=SR)
    for fmt in ("pcm", "wav"):
        enc = _make_encoder(fmt, 32000)
        out = enc.encode(np.zeros(SR // 10, dtype=np.float32)) + enc.finish()
        assert len(out) >= 3200 * 2 - 8  # 0.1 s at 32 kHz, s16


def test_defaults() -> None:
    assert EncoderConfig("opus", input_sample_rate=SR).sample_rate == 48000
    assert EncoderConfig("mulaw", input_sample_rate=SR).sample_rate == 8000
    assert EncoderConfig("pcm", input_sample_rate=SR).sample_rate == 44100
    # pcm, wav and mp3 default to the codec's own rate: no resampling
    assert EncoderConfig("wav", input_sample_rate=24000).sample_rate == 24000
    assert (
        _make_encoder("pcm", 24000).content_type == "audio/pcm;encoding=s16le;channels=1;rate=24000"
    )


# ------------------------------------------------------------------------------------------
# Reference audio
# ------------------------------------------------------------------------------------------


def _file(fmt: str, subtype: str | None, x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "subtype", "rate"),
    [
        ("WAV", "PCM_16", 16000),
        ("FLAC", None, 44100),
        ("OGG", "VORBIS", 22050),
        ("OGG", "OPUS", 48000),
        ("MP3", None, 24000),
    ],
)
def test_reference_audio_decodes_any_format(fmt: str, subtype: str | None, rate: int) -> None:
    t = np.arange(int(rate * 1.5)) / rate
    stereo = np.stack([0.4 * np.sin(2 * np.pi * 300 * t), 0.2 * np.sin(2 * np.pi * 300 * t)], 1)
    audio, got_rate = decode_reference_audio(_file(fmt, subtype, stereo, rate))
    assert got_rate == rate and audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) / rate == pytest.approx(1.5, abs=0.1)
    assert np.abs(audio).max() == pytest.approx(0.3, abs=0.05)  # the channel average


def test_reference_audio_resample_to_target() -> None:
    x = np.zeros(16000, np.float32)
    audio, rate = decode_reference_audio(_file("WAV", "PCM_16", x, 16000), target_sample_rate=44100)
    assert rate == 44100 and len(audio) == 44100 and audio.dtype == np.float32


@pytest.mark.parametrize(
    "data",
    [b"", b"definitely not audio", b"RIFF\x00\x00\x00\x00WAVEjunk", bytes(range(256)) * 40],
)
def test_garbage_reference_audio(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"^could not decode reference audio"):
        decode_reference_audio(data)


def test_empty_reference_audio() -> None:
    with pytest.raises(ValueError, match="could not decode reference audio"):
        decode_reference_audio(_file("WAV", "PCM_16", np.zeros(0, np.float32), 16000))


def test_reference_audio_length_limit() -> None:
    data = _file("FLAC", None, np.zeros(8000 * 5, np.float32), 8000)
    assert len(decode_reference_audio(data, max_seconds=5.0)[0]) == 8000 * 5
    with pytest.raises(ReferenceAudioTooLong, match="4 s limit"):
        decode_reference_audio(data, max_seconds=4.0)
    assert issubclass(ReferenceAudioTooLong, ValueError)
