"""Reference clips for voice cloning: audio at any rate -> the codec's codes, ready for the
prompt builder (a `Reference` of transcript + codes)."""

from __future__ import annotations

import numpy as np
import torch

from .codec import resample_to_codec_rate
from .loader import Bundle
from .prompt import Reference


def encode_reference(bundle: Bundle, audio: np.ndarray, sample_rate: int, text: str) -> Reference:
    """Reference audio (any rate, mono float) -> codes with the bundle's codec encoder."""
    wav = resample_to_codec_rate(audio, sample_rate)
    x = torch.as_tensor(np.asarray(wav, dtype=np.float32)).reshape(1, 1, -1)
    codec = bundle.codec
    p = next(codec.parameters())
    with torch.inference_mode():
        codes, lengths = codec.encode(x.to(p.device, p.dtype),
                                      torch.tensor([x.shape[-1]], device=p.device))
    return Reference(text, codes[0, :, : int(lengths[0])].cpu())
