"""Fish Audio S2 "modded DAC" codec (44.1 kHz, 2048 samples per code frame, 10 codebooks).

Offline encode/decode matching the reference implementation, and a batched stateful
streaming decoder (:class:`StreamingDecoder`) whose output equals the offline decode up to
float rounding (:data:`STREAM_ATOL`). The checks against the reference fixtures
(`reference_checks`) are a tool of `python -m engine.verify_reference` and the tests, not
imported by the runtime.
"""

from .config import (
    CodecConfig,
    QuantizerConfig,
    TransformerConfig,
    TransformerGeneralConfig,
    WindowTransformerConfig,
)
from .model import Codec
from .resample import resample_to_codec_rate
from .streaming import STREAM_ATOL, StreamingDecoder
from .weights import (
    REBUILT_SUFFIXES,
    CodecKeys,
    codec_keys,
    dummy_codec,
    fold_weight_norm,
    load_codec,
    read_checkpoint,
)

__all__ = [
    "REBUILT_SUFFIXES",
    "STREAM_ATOL",
    "Codec",
    "CodecConfig",
    "CodecKeys",
    "QuantizerConfig",
    "StreamingDecoder",
    "TransformerConfig",
    "TransformerGeneralConfig",
    "WindowTransformerConfig",
    "codec_keys",
    "dummy_codec",
    "fold_weight_norm",
    "load_codec",
    "read_checkpoint",
    "resample_to_codec_rate",
]
