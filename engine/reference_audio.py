"""Reference clips for voice cloning: bytes of audio in any format libsndfile reads -> the
codec's codes, ready for the prompt builder (a `Reference` of transcript + codes).

Untrusted input: every failure is a `BadReferenceAudio` (or `ReferenceAudioTooLong`) whose
message says what is wrong; at most `max_seconds` of audio is ever decoded, so a tiny file
claiming hours of audio costs nothing.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import soundfile as sf
import soxr
import torch

from .codec import Codec, resample_to_codec_rate
from .errors import BadReferenceAudio, ReferenceAudioTooLong
from .prompt import Reference

__all__ = ["decode_reference_audio", "encode_reference", "reference_from_bytes"]

log = logging.getLogger(__name__)


def decode_reference_audio(data: bytes, *, max_seconds: float = 30.0,
                           max_samples: int = 48000 * 30 * 2,
                           target_sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    """Decode a reference clip (wav, flac, ogg, opus, mp3, ...).

    Returns ``(audio, sample_rate)``: float32 mono (channels averaged), resampled to
    ``target_sample_rate`` when given. Raises `BadReferenceAudio` ("could not decode
    reference audio: ...") for anything undecodable or empty, `ReferenceAudioTooLong` above
    ``max_seconds`` or when what would be decoded (frames x channels, up to ``max_seconds``)
    exceeds ``max_samples`` — checked from the header, before decoding: a small file that
    claims many channels at a high rate costs nothing.
    """
    if not data:
        raise BadReferenceAudio("could not decode reference audio: no data")
    try:
        f = sf.SoundFile(io.BytesIO(bytes(data)))
    except Exception as exc:  # untrusted input: any decoder failure means "bad audio"
        raise BadReferenceAudio(f"could not decode reference audio: {exc}") from None
    with f:
        rate, channels = int(f.samplerate), int(f.channels)
        limit = int(max_seconds * rate)
        frames = f.frames if 0 < f.frames < limit + 1 else limit + 1  # unknown: the bound
        if channels * frames > max_samples:
            raise ReferenceAudioTooLong(
                f"reference audio would decode to {channels} channels x {frames} frames at "
                f"{rate} Hz: more than the limit of {max_samples} samples x channels", "samples")
        try:
            audio = f.read(frames=limit + 1, dtype="float32", always_2d=True)
        except Exception as exc:
            raise BadReferenceAudio(f"could not decode reference audio: {exc}") from None
    if audio.shape[0] > limit:
        raise ReferenceAudioTooLong(f"reference audio is longer than the {max_seconds:g} s limit")
    if audio.shape[0] == 0 or rate <= 0:
        raise BadReferenceAudio("could not decode reference audio: it holds no audio frames")
    mono = audio.mean(axis=1, dtype=np.float32) if audio.shape[1] > 1 else audio[:, 0]
    mono = np.nan_to_num(mono, nan=0.0, posinf=1.0, neginf=-1.0)
    if target_sample_rate is not None and target_sample_rate != rate:
        mono = soxr.resample(mono, rate, target_sample_rate, quality="HQ").astype(np.float32)
        rate = target_sample_rate
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def encode_reference(codec: Codec, audio: np.ndarray, sample_rate: int, text: str) -> Reference:
    """Reference audio (any rate, mono float) -> codes with the codec's encoder."""
    wav = resample_to_codec_rate(audio, sample_rate)
    x = torch.as_tensor(np.asarray(wav, dtype=np.float32)).reshape(1, 1, -1)
    with torch.inference_mode():
        codes, lengths = codec.encode(x.to(codec.device, codec.dtype),
                                      torch.tensor([x.shape[-1]], device=codec.device))
    return Reference(text, codes[0, :, : int(lengths[0])].cpu())


def reference_from_bytes(codec: Codec, data: bytes, text: str, *, max_seconds: float,
                         max_samples: int = 48000 * 30 * 2) -> tuple[Reference, int, float]:
    """A clip's bytes and transcript -> (its `Reference`, the clip's sample rate, its
    seconds). Raises `BadReferenceAudio` / `ReferenceAudioTooLong`."""
    wav, rate = decode_reference_audio(data, max_seconds=max_seconds, max_samples=max_samples)
    frame_s = codec.cfg.hop_length / codec.cfg.sample_rate
    if wav.shape[0] / rate < frame_s:
        raise BadReferenceAudio(f"the clip is shorter than one codec frame "
                                f"({frame_s * 1000:.0f} ms)")
    try:
        reference = encode_reference(codec, wav, rate, text)
    except Exception as exc:  # a clip the codec cannot take (odd lengths, NaNs...)
        log.warning("reference encoding failed", exc_info=True)
        raise BadReferenceAudio(f"the codec could not encode it: {exc}") from None
    return reference, rate, wav.shape[0] / rate
