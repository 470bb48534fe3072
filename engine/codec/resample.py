"""Resampling reference audio to the codec rate (44.1 kHz) with ``soxr`` (libsoxr, "HQ").

soxr is used rather than a torch resampler because reference clips arrive at any rate
(8k..48k, odd rates from phones), soxr handles arbitrary ratios with a proper anti-aliasing
filter, and it is a small wheel already required by the service.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CODEC_SAMPLE_RATE", "resample_to_codec_rate"]

CODEC_SAMPLE_RATE = 44100


def _to_mono(x: np.ndarray) -> np.ndarray:
    if x.ndim == 1:
        return x
    if x.ndim != 2:
        raise ValueError(f"audio must be 1-D (mono) or 2-D (multi-channel), got shape {x.shape}")
    # soundfile gives [frames, channels]; torchaudio gives [channels, frames]. Channels are the
    # short axis.
    axis = 1 if x.shape[1] <= x.shape[0] else 0
    return x.mean(axis=axis)


def resample_to_codec_rate(
    audio: np.ndarray | torch.Tensor, sr: int, target_sr: int = CODEC_SAMPLE_RATE
) -> np.ndarray | torch.Tensor:
    """Mono float32 audio at ``target_sr`` (44.1 kHz) from any rate.

    ``audio``: [N] mono, or [N, C] / [C, N] multi-channel (averaged to mono; the shorter axis is
    taken as channels). Integer PCM is scaled to [-1, 1) (unsigned PCM is re-centred first). Returns the same kind as given
    (numpy array or CPU torch tensor), float32, shape [M] with M ~= N * target_sr / sr.
    """
    if isinstance(sr, bool) or not isinstance(sr, int | np.integer) or sr <= 0:
        raise ValueError(f"sr must be a positive int sample rate, got {sr!r}")
    as_tensor = isinstance(audio, torch.Tensor)
    if as_tensor:
        x = audio.detach().to("cpu")
        x = x.float().numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()
    elif isinstance(audio, np.ndarray):
        x = audio
    else:
        raise TypeError(f"audio must be a numpy array or torch tensor, got {type(audio).__name__}")
    if np.issubdtype(x.dtype, np.integer):
        info = np.iinfo(x.dtype)
        if info.min < 0:  # signed PCM: full scale is -min (e.g. 32768 for int16)
            x = x.astype(np.float32) / float(-info.min)
        else:  # unsigned PCM (e.g. 8-bit WAV) is offset by half scale
            mid = (float(info.max) + 1.0) / 2.0
            x = (x.astype(np.float32) - mid) / mid
    elif not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"audio must be float or integer PCM, got dtype {x.dtype}")
    x = _to_mono(np.asarray(x, dtype=np.float32))
    if x.size == 0:
        raise ValueError("audio is empty")
    if not np.isfinite(x).all():
        raise ValueError("audio contains NaN or infinite samples")
    if int(sr) != target_sr:
        import soxr  # imported here so the codec package loads where soxr is absent (GPU boxes)

        x = soxr.resample(x, int(sr), target_sr, quality="HQ").astype(np.float32, copy=False)
    x = np.ascontiguousarray(x, dtype=np.float32)
    return torch.from_numpy(x) if as_tensor else x
