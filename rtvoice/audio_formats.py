"""Streaming output encoders (pcm, wav, mulaw, mp3, opus).

The codec produces float32 mono PCM (at its own rate: 44.1 kHz for S2) in chunks. An :class:`AudioEncoder` turns
those chunks into bytes of the requested format *as they come*: ``encode(chunk)`` returns what
can be emitted now, ``finish()`` flushes the rest. One encoder serves one turn: the bytes of a
turn concatenated form one standalone stream that standard decoders read (a WAV header, an
MP3 or Ogg stream per turn).

Choices and their reasons:

- Resampling uses ``soxr.ResampleStream`` (HQ). Streaming it is exact: the concatenated
  output equals a one-shot ``soxr.resample`` of the whole turn, so chunk boundaries leave no
  artefacts. The resampler holds back its filter delay (18-27 ms of audio at HQ, depending
  on the rate) until the next chunk or ``finish()``: the first chunk still goes out at once
  (TTFA is unchanged), it just carries that much less audio.
- WAV is streamed: a 44-byte RIFF header whose RIFF and ``data`` sizes are ``0xFFFFFFFF``
  ("unknown length": libsndfile/soundfile and Python's ``wave`` read such a stream to its
  end), then s16le samples.
- MP3 and Ogg Opus go through libsndfile (LAME / libopus) writing into an append-only file
  object; every call hands out the bytes written so far. Two libsndfile behaviours need care:
  * MP3: LAME reserves its first frame for a Xing/LAME "Info" tag that libsndfile writes at
    close by seeking back. Bytes already sent cannot be rewritten, so that placeholder frame
    (a header plus zeros, which decoders would play as 26 ms of silence) is dropped from the
    stream. Without the Info tag decoders cannot trim LAME's encoder delay and end padding:
    the decoded stream is longer than the input by ``padding_bound_s`` at most (see below).
    CBR is forced so that decoders estimate the length from the file size correctly.
  * Opus: libsndfile buffers Ogg pages for 1 s by default, which would delay the first audio
    by a second; ``SFC_SET_OGG_PAGE_LATENCY_MS`` lowers it to one 20 ms packet. Opus stays
    sample-exact: the Ogg pre-skip and end granule position trim the codec padding.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import soundfile as sf
import soxr

__all__ = [
    "FORMATS",
    "AudioEncoder",
    "EncoderConfig",
    "FormatInfo",
    "make_encoder",
    "mulaw_encode",
    "wav_stream_header",
]


@dataclass(frozen=True, slots=True)
class FormatInfo:
    name: str
    sample_rates: tuple[int, ...]
    default_sample_rate: int | None  # None: the input's rate (the codec's, no resampling)
    content_type: str


# MP3 rates are the MPEG-1 (32/44.1/48k), MPEG-2 (16/22.05/24k) and MPEG-2.5 (8k) rates LAME
# writes; Opus only exists at 8/12/16/24/48 kHz, so 44.1 kHz input is resampled.
_PCM_RATES: Final = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
FORMATS: Final[dict[str, FormatInfo]] = {
    "pcm": FormatInfo("pcm", _PCM_RATES, None, "audio/pcm;encoding=s16le;channels=1"),
    "wav": FormatInfo("wav", _PCM_RATES, None, "audio/wav"),
    "mulaw": FormatInfo("mulaw", (8000,), 8000, "audio/basic"),  # RFC 2046: 8 kHz G.711 u-law
    "mp3": FormatInfo("mp3", (8000, 16000, 22050, 24000, 32000, 44100, 48000), None, "audio/mpeg"),
    "opus": FormatInfo("opus", (8000, 12000, 16000, 24000, 48000), 48000, "audio/ogg;codecs=opus"),
}

_OPUS_AUTO: Final = -1000  # Fish's opus_bitrate value for libopus' OPUS_AUTO


def _kbps(value: int) -> int:
    """A bitrate as Fish's clients send it -> kbps: values of 1000 and more are bits per
    second (Fish documents ``opus_bitrate: 64000``), smaller ones kbps; -1000 stays (auto)."""
    return value // 1000 if value >= 1000 else value


def _supported_text() -> str:
    return "; ".join(
        f"{name}: {', '.join(map(str, info.sample_rates))}" for name, info in FORMATS.items()
    )


@dataclass(slots=True)
class EncoderConfig:
    """A validated output format request for PCM at ``input_sample_rate`` (the codec's rate).
    ``sample_rate=None`` takes the format's default: the input's own rate where the format
    has it (pcm, wav, mp3), else 48 kHz (opus) or 8 kHz (mulaw)."""

    format: str
    sample_rate: int | None = None
    # kbps, or bits per second (any value >= 1000: Fish documents bps); each is checked and
    # used only for its own format
    mp3_bitrate: int = 128  # clamped to what the MPEG version at this rate allows
    opus_bitrate: int = 32  # 6..256 kbps, or -1000 for libopus' automatic choice
    input_sample_rate: int = field(kw_only=True)

    def __post_init__(self) -> None:
        info = FORMATS.get(self.format)
        if info is None:
            raise ValueError(
                f"unsupported audio format {self.format!r}; supported formats and sample rates: "
                f"{_supported_text()}"
            )
        if self.sample_rate is None:
            self.sample_rate = info.default_sample_rate or self.input_sample_rate
        if self.sample_rate not in info.sample_rates:
            raise ValueError(
                f"unsupported sample rate {self.sample_rate} Hz for {self.format}; supported: "
                f"{', '.join(map(str, info.sample_rates))} Hz (all formats: {_supported_text()})"
            )
        self.mp3_bitrate = _kbps(self.mp3_bitrate)
        self.opus_bitrate = _kbps(self.opus_bitrate)
        if self.format == "mp3" and not 8 <= self.mp3_bitrate <= 320:
            raise ValueError(f"mp3_bitrate must be 8..320 kbps (or 8000..320000 bps), got "
                             f"{self.mp3_bitrate}")
        if self.format == "opus" and self.opus_bitrate != _OPUS_AUTO \
                and not 6 <= self.opus_bitrate <= 256:
            raise ValueError(f"opus_bitrate must be 6..256 kbps (or 6000..256000 bps) or -1000 "
                             f"(auto), got {self.opus_bitrate}")
        if self.input_sample_rate <= 0:
            raise ValueError(f"input_sample_rate must be positive, got {self.input_sample_rate}")

    @property
    def info(self) -> FormatInfo:
        return FORMATS[self.format]


# --------------------------------------------------------------------------------------------
# Sample conversion helpers
# --------------------------------------------------------------------------------------------


def _as_mono_float32(chunk: np.ndarray) -> np.ndarray:
    x = np.asarray(chunk)
    if x.ndim == 2 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 1:
        raise ValueError(f"expected mono PCM of shape [n] (or [n, 1]), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"expected float PCM in [-1, 1], got dtype {x.dtype}")
    return x.astype(np.float32, copy=False)


def _to_s16le(x: np.ndarray) -> bytes:
    # NaN would become an arbitrary int16; clip first so rint cannot overflow.
    y = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    np.clip(y, -1.0, 1.0, out=y)
    return np.rint(y * 32767.0).astype("<i2").tobytes()


def _build_ulaw_table() -> np.ndarray:
    """G.711 u-law of every int16 value (CCITT segment search on the 14-bit magnitude, the
    same algorithm as Sun's g711.c / CPython's audioop.lin2ulaw), indexed by ``uint16`` view."""
    pcm = np.arange(-32768, 32768, dtype=np.int32)
    v = pcm >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + 33  # clip, then add the bias (0x84 >> 2)
    seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), v)
    u = np.where(seg >= 8, 0x7F, (seg << 4) | ((v >> (seg + 1)) & 0xF))
    table = np.empty(65536, dtype=np.uint8)
    table[pcm.astype(np.int16).view(np.uint16)] = (u ^ mask).astype(np.uint8)
    return table


_ULAW: Final = _build_ulaw_table()


def mulaw_encode(pcm16: np.ndarray) -> bytes:
    """G.711 u-law bytes of int16 samples (one table lookup per sample)."""
    return _ULAW[np.asarray(pcm16, dtype=np.int16).view(np.uint16)].tobytes()


class _Resampler:
    """Streaming resampler; identity when the rates match."""

    __slots__ = ("_stream",)

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")
        )

    def __call__(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=last)


_EMPTY: Final = np.zeros(0, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------------------------


class AudioEncoder(ABC):
    """Encodes one turn of float32 mono PCM (at ``config.input_sample_rate``) as it streams.

    ``encode`` may return ``b""`` (the codec is still buffering); ``finish`` must be called
    once at the end of the turn and returns the rest. ``close`` releases resources without
    flushing (for a cancelled turn). An encoder is not thread-safe: one turn, one caller.
    """

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self._resample = _Resampler(config.input_sample_rate, self.sample_rate)
        self._samples_in = 0
        self._finished = False

    @property
    def format(self) -> str:
        return self.config.format

    @property
    def sample_rate(self) -> int:
        assert self.config.sample_rate is not None  # resolved in EncoderConfig.__post_init__
        return self.config.sample_rate

    @property
    def channels(self) -> int:
        return 1

    @property
    def content_type(self) -> str:
        ct = self.config.info.content_type
        return f"{ct};rate={self.sample_rate}" if self.format == "pcm" else ct

    @property
    def samples_in(self) -> int:
        """Input samples consumed so far (at the input rate)."""
        return self._samples_in

    @property
    def padding_bound_s(self) -> float:
        """Upper bound of (decoded duration - input duration) for the whole turn's bytes.

        The decoded stream is never shorter than the input by more than one output sample.
        """
        return 1.0 / self.sample_rate  # resampling rounds the length to a whole sample

    def encode(self, chunk: np.ndarray) -> bytes:
        if self._finished:
            raise RuntimeError(f"{self.format} encoder already finished")
        x = _as_mono_float32(chunk)
        self._samples_in += x.shape[0]
        return self._encode(self._resample(x))

    def finish(self) -> bytes:
        if self._finished:
            raise RuntimeError(f"{self.format} encoder already finished")
        self._finished = True
        tail = self._resample(_EMPTY, last=True)
        return self._encode(tail) + self._finish()

    def close(self) -> None:
        """Drop the turn without flushing; idempotent."""
        self._finished = True

    @abstractmethod
    def _encode(self, x: np.ndarray) -> bytes: ...

    def _finish(self) -> bytes:
        return b""


class _PcmEncoder(AudioEncoder):
    def _encode(self, x: np.ndarray) -> bytes:
        return _to_s16le(x)


_UNKNOWN_SIZE: Final = 0xFFFFFFFF


def wav_stream_header(sample_rate: int, channels: int = 1) -> bytes:
    """44-byte PCM s16le WAV header for a stream of unknown length (sizes 0xFFFFFFFF)."""
    block_align = 2 * channels
    return (
        b"RIFF"
        + struct.pack("<I", _UNKNOWN_SIZE)
        + b"WAVEfmt "
        + struct.pack(
            "<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16
        )
        + b"data"
        + struct.pack("<I", _UNKNOWN_SIZE)
    )


class _WavEncoder(_PcmEncoder):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self._header: bytes | None = wav_stream_header(self.sample_rate)

    def _encode(self, x: np.ndarray) -> bytes:
        # The header goes out with the first call even if the resampler emitted nothing yet,
        # so that the first audio event already identifies the stream.
        header, self._header = self._header, None
        return (header or b"") + _to_s16le(x)


class _MulawEncoder(AudioEncoder):
    def _encode(self, x: np.ndarray) -> bytes:
        return mulaw_encode(np.frombuffer(_to_s16le(x), dtype="<i2"))


class _AppendSink:
    """File object for libsndfile's virtual I/O that hands out bytes as they are appended.

    libsndfile may seek back to rewrite a header at close (LAME's Info tag). Bytes already
    handed out cannot change, so such rewrites are dropped and counted. Never raises: it runs
    inside cffi callbacks, where an exception would only be printed.
    """

    def __init__(self) -> None:
        self._buf = bytearray()  # not yet handed out; starts at absolute offset _base
        self._base = 0
        self._pos = 0
        self.dropped_rewrites = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        end = self._base + len(self._buf)
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self._pos + offset, os.SEEK_END: end + offset}
        self._pos = max(0, target.get(whence, self._pos))
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""  # write-only: libsndfile's encoders never need to read back

    def write(self, data: bytes) -> int:
        n = len(data)
        start = self._pos
        if start < self._base:  # rewrite of bytes already handed out
            self.dropped_rewrites += 1
            skip = min(n, self._base - start)
            data, start = data[skip:], start + skip
        if data:
            i = start - self._base
            if i > len(self._buf):
                self._buf.extend(bytes(i - len(self._buf)))
            self._buf[i : i + len(data)] = data
        self._pos = self._pos + n
        return n

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._base += len(self._buf)
        self._buf.clear()
        return out


_SFC_SET_OGG_PAGE_LATENCY_MS: Final = 0x1302  # sndfile.h, libsndfile >= 1.2.0


class _SndfileEncoder(AudioEncoder):
    _sf_format: str
    _sf_subtype: str

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self._sink = _AppendSink()
        self._file = sf.SoundFile(
            self._sink,  # type: ignore[arg-type]  # duck-typed virtual I/O
            mode="w",
            samplerate=self.sample_rate,
            channels=1,
            format=self._sf_format,
            subtype=self._sf_subtype,
            **self._open_kwargs(),
        )
        self._configure()

    def _open_kwargs(self) -> dict[str, object]:
        return {}

    def _configure(self) -> None:
        pass

    def _encode(self, x: np.ndarray) -> bytes:
        if x.shape[0]:
            self._file.write(x)
        return self._filter(self._sink.drain())

    def _finish(self) -> bytes:
        self._file.close()  # flushes the codec and writes the stream's end
        return self._filter(self._sink.drain())

    def _filter(self, data: bytes) -> bytes:
        return data

    def close(self) -> None:
        super().close()
        if not self._file.closed:
            self._file.close()


# MPEG audio Layer III tables (ISO 11172-3 / 13818-3), for parsing LAME's placeholder frame.
_MP3_BITRATES: Final = {
    3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2
    0: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2.5
}
_MP3_RATES: Final = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
# Samples a decoder outputs beyond the input when it cannot trim (no Info tag): LAME's 576
# encoder delay plus its flush padding, which is at least 576 and less than one more frame.
# Measured with libsndfile 1.2.2 / LAME 3.100 over random lengths at every rate: the extra
# is within [1152, 1152 + frame_samples] samples.
_MP3_BASE_EXTRA: Final = 1152


def _mp3_frame_length(header: bytes) -> int | None:
    """Length in bytes of the Layer III frame starting with ``header`` (None if not one)."""
    if len(header) < 4 or header[0] != 0xFF or (header[1] & 0xE0) != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    bitrate_index, rate_index, padding = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if version == 1 or layer != 1 or bitrate_index in (0, 15) or rate_index == 3:
        return None
    kbps = _MP3_BITRATES[version][bitrate_index]
    rate = _MP3_RATES[version][rate_index]
    return (144 if version == 3 else 72) * kbps * 1000 // rate + padding


class _Mp3Encoder(_SndfileEncoder):
    _sf_format = "MP3"
    _sf_subtype = "MPEG_LAYER_III"

    def __init__(self, config: EncoderConfig) -> None:
        self._head = bytearray()  # bytes held until LAME's first frame can be inspected
        self._head_done = False
        super().__init__(config)

    def _open_kwargs(self) -> dict[str, object]:
        # libsndfile maps compression level c in [0, 1] linearly onto the bitrate range of the
        # MPEG version (bitrate = hi - c * (hi - lo), truncated); invert it for an exact CBR.
        rate = self.sample_rate
        lo, hi = (32, 320) if rate >= 32000 else (8, 160) if rate >= 16000 else (8, 64)
        kbps = min(max(self.config.mp3_bitrate, lo), hi)
        level = min(max((hi - kbps - 0.5) / (hi - lo), 0.0), 1.0)  # -0.5: survive truncation
        return {"compression_level": level, "bitrate_mode": "CONSTANT"}

    @property
    def frame_samples(self) -> int:
        return 1152 if self.sample_rate >= 32000 else 576

    @property
    def padding_bound_s(self) -> float:
        # No Info tag (see module doc): decoders keep LAME's delay and its end padding;
        # +1 sample for resampling rounding. 52 ms at 44.1 kHz, 48 ms at 48 kHz.
        return (_MP3_BASE_EXTRA + self.frame_samples + 1) / self.sample_rate

    def _filter(self, data: bytes) -> bytes:
        if self._head_done:
            return data
        self._head += data
        if len(self._head) < 4 and not self._file.closed:
            return b""
        n = _mp3_frame_length(bytes(self._head[:4]))
        if n is not None and len(self._head) < n and not self._file.closed:
            return b""  # wait for the whole first frame
        self._head_done = True
        head, self._head = bytes(self._head), bytearray()
        # LAME's reserved Info-tag frame is a valid header followed by zeros only.
        if n is not None and len(head) >= n and not any(head[4:n]):
            return head[n:]
        return head


class _OpusEncoder(_SndfileEncoder):
    _sf_format = "OGG"
    _sf_subtype = "OPUS"
    page_latency_ms = 20.0  # one Opus packet per Ogg page

    def _open_kwargs(self) -> dict[str, object]:
        if self.config.opus_bitrate == _OPUS_AUTO:
            return {}
        # libsndfile: bitrate = (1 - c) * 250000 + 6000 bps per channel.
        level = 1.0 - (self.config.opus_bitrate * 1000 - 6000) / 250000
        return {"compression_level": min(max(level, 0.0), 1.0)}

    def _configure(self) -> None:
        # soundfile has no wrapper for this command; use its cffi handles. If that ever fails,
        # the stream stays correct, only its pages (and so the audio) come out once a second.
        try:
            from soundfile import _ffi, _snd  # type: ignore[attr-defined]

            value = _ffi.new("double*", self.page_latency_ms)
            _snd.sf_command(
                self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, _ffi.sizeof("double")
            )
        except Exception:  # pragma: no cover - depends on the soundfile/libsndfile build
            pass


_ENCODERS: Final[dict[str, type[AudioEncoder]]] = {
    "pcm": _PcmEncoder,
    "wav": _WavEncoder,
    "mulaw": _MulawEncoder,
    "mp3": _Mp3Encoder,
    "opus": _OpusEncoder,
}


def encoder_for(config: EncoderConfig) -> AudioEncoder:
    """A fresh encoder for an already validated output format."""
    return _ENCODERS[config.format](config)


def make_encoder(
    format: str,
    sample_rate: int | None = None,
    *,
    mp3_bitrate: int = 128,
    opus_bitrate: int = 32,
    input_sample_rate: int,
) -> AudioEncoder:
    """A fresh encoder for one turn of PCM at `input_sample_rate`. Raises ``ValueError``
    naming the supported combinations."""
    config = EncoderConfig(
        format=format,
        sample_rate=sample_rate,
        mp3_bitrate=mp3_bitrate,
        opus_bitrate=opus_bitrate,
        input_sample_rate=input_sample_rate,
    )
    return _ENCODERS[config.format](config)
