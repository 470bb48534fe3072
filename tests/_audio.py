"""Test audio: a short tone plus a little noise, as WAV bytes (a reference clip to upload)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


def wav_bytes(seconds: float = 0.5, rate: int = 22050, seed: int = 0, freq: float = 180.0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.shape)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()
