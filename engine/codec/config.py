"""Configuration of the Fish Audio S2 "modded DAC" codec.

Field names and nesting follow fish-speech's ``modded_dac_vq.yaml`` (and the fixture's
``codec_config.json``) so a config file written for the reference loads as is. Hydra keys
(``_target_``, ``_partial_``) are ignored; any other unknown key is an error (a typo in a
config should not silently fall back to a default).

Sizes that matter downstream:

- ``frame_length`` (= ``hop_length`` here) = 2048 samples per code frame at 44.1 kHz
  (21.53 frames/s). NOTE: the reference DAC calls the *encoder step* (512 samples) its
  ``hop_length``; here that number is ``encoder_hop_length`` and ``hop_length`` is the code-frame
  hop, because that is what the rest of rtvoice needs.
- ``n_codebooks_total`` = 10 (1 semantic + 9 residual).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "CodecConfig",
    "QuantizerConfig",
    "TransformerConfig",
    "TransformerGeneralConfig",
    "WindowTransformerConfig",
]

_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_")


def _require_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _require_positive_float(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


def _require_int_list(owner: str, name: str, value: Any, minimum: int = 1) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) == 0:
        raise ValueError(f"{owner}.{name} must be a non-empty list of ints, got {value!r}")
    for i, v in enumerate(value):
        _require_int(owner, f"{name}[{i}]", v, minimum)
    return tuple(int(v) for v in value)


def _strip(owner: str, data: Any, cls: type) -> dict[str, Any]:
    """Drop hydra keys, reject unknown keys (naming them), return a plain dict."""
    if not isinstance(data, dict):
        raise ValueError(f"{owner} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    out = {}
    for k, v in data.items():
        if k in _HYDRA_KEYS:
            continue
        if k not in known:
            raise ValueError(f"{owner}: unknown field {k!r} (known: {sorted(known)})")
        out[k] = v
    return out


@dataclass(slots=True)
class TransformerGeneralConfig:
    """The partially-applied ``ModelArgs`` used for the encoder-block transformers.

    The encoder block fills in ``n_layer``, ``n_head = dim // 64``, ``dim`` and
    ``intermediate_size = 3 * dim`` itself (see :meth:`build`).
    """

    block_size: int = 16384
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dropout_rate: float = 0.1
    attn_dropout_rate: float = 0.1
    channels_first: bool = True
    pos_embed_type: str = "rope"
    max_relative_position: int = 128

    def __post_init__(self) -> None:
        o = "transformer_general_config"
        _require_int(o, "block_size", self.block_size)
        if self.n_local_heads != -1:
            _require_int(o, "n_local_heads", self.n_local_heads)
        _require_int(o, "head_dim", self.head_dim, 2)
        if self.head_dim % 2:
            raise ValueError(f"{o}.head_dim must be even (RoPE pairs), got {self.head_dim}")
        _require_positive_float(o, "rope_base", self.rope_base)
        _require_positive_float(o, "norm_eps", self.norm_eps)
        if self.pos_embed_type != "rope":
            raise ValueError(
                f"{o}.pos_embed_type: only 'rope' is supported, got {self.pos_embed_type!r}"
            )
        if self.channels_first is not True:
            raise ValueError(f"{o}.channels_first must be true (the codec feeds [B, C, T])")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerGeneralConfig:
        return cls(**_strip("transformer_general_config", data, cls))

    def build(
        self, n_layer: int, n_head: int, dim: int, intermediate_size: int
    ) -> TransformerConfig:
        return TransformerConfig(
            block_size=self.block_size,
            n_layer=n_layer,
            n_head=n_head,
            dim=dim,
            intermediate_size=intermediate_size,
            n_local_heads=self.n_local_heads,
            head_dim=self.head_dim,
            rope_base=self.rope_base,
            norm_eps=self.norm_eps,
            dropout_rate=self.dropout_rate,
            attn_dropout_rate=self.attn_dropout_rate,
            channels_first=self.channels_first,
            pos_embed_type=self.pos_embed_type,
            max_relative_position=self.max_relative_position,
        )


@dataclass(slots=True)
class TransformerConfig:
    """``ModelArgs`` of a codec transformer (RMSNorm, interleaved RoPE, SwiGLU, LayerScale)."""

    block_size: int = 2048
    n_layer: int = 8
    n_head: int = 8
    dim: int = 512
    intermediate_size: int = 1536
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dropout_rate: float = 0.1
    attn_dropout_rate: float = 0.1
    channels_first: bool = True
    pos_embed_type: str = "rope"
    max_relative_position: int = 128

    def __post_init__(self) -> None:
        o = "transformer config"
        _require_int(o, "block_size", self.block_size)
        _require_int(o, "n_layer", self.n_layer, 0)
        _require_int(o, "n_head", self.n_head)
        _require_int(o, "dim", self.dim)
        _require_int(o, "intermediate_size", self.intermediate_size)
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        _require_int(o, "n_local_heads", self.n_local_heads)
        # The reference splits wqkv into three equal parts of n_local_heads*head_dim, which only
        # lines up with the (n_head + 2*n_local_heads)*head_dim projection when they are equal.
        if self.n_local_heads != self.n_head:
            raise ValueError(
                f"{o}.n_local_heads ({self.n_local_heads}) must equal n_head ({self.n_head}): "
                "the codec attention has no grouped-query variant"
            )
        if self.dim % self.n_head:
            raise ValueError(f"{o}.dim ({self.dim}) must be divisible by n_head ({self.n_head})")
        _require_int(o, "head_dim", self.head_dim, 2)
        if self.head_dim % 2:
            raise ValueError(f"{o}.head_dim must be even (RoPE pairs), got {self.head_dim}")
        _require_positive_float(o, "rope_base", self.rope_base)
        _require_positive_float(o, "norm_eps", self.norm_eps)
        if self.pos_embed_type != "rope":
            raise ValueError(
                f"{o}.pos_embed_type: only 'rope' is supported, got {self.pos_embed_type!r}"
            )
        if self.channels_first is not True:
            raise ValueError(f"{o}.channels_first must be true (the codec feeds [B, C, T])")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        return cls(**_strip("transformer config", data, cls))


@dataclass(slots=True)
class WindowTransformerConfig:
    """``WindowLimitedTransformer``: causal transformer whose frame i sees frames i-window+1..i."""

    config: TransformerConfig
    input_dim: int = 512
    window_size: int | None = None
    causal: bool = True

    def __post_init__(self) -> None:
        o = "window transformer"
        if isinstance(self.config, dict):
            self.config = TransformerConfig.from_dict(self.config)
        if not isinstance(self.config, TransformerConfig):
            raise ValueError(f"{o}.config must be a TransformerConfig or mapping")
        _require_int(o, "input_dim", self.input_dim)
        if self.window_size is not None:
            _require_int(o, "window_size", self.window_size)
        if self.causal is not True:
            raise ValueError(f"{o}.causal must be true (the reference only implements causal)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowTransformerConfig:
        return cls(**_strip("window transformer", data, cls))


@dataclass(slots=True)
class QuantizerConfig:
    """``DownsampleResidualVectorQuantize``: x4 down/upsampling + semantic VQ + residual RVQ."""

    input_dim: int = 1024
    n_codebooks: int = 9
    codebook_size: int = 1024
    codebook_dim: int = 8
    quantizer_dropout: float = 0.5
    semantic_codebook_size: int = 4096
    downsample_factor: tuple[int, ...] = (2, 2)
    downsample_dims: tuple[int, ...] | None = None
    pre_module: WindowTransformerConfig | None = None
    post_module: WindowTransformerConfig | None = None

    def __post_init__(self) -> None:
        o = "quantizer"
        _require_int(o, "input_dim", self.input_dim)
        _require_int(o, "n_codebooks", self.n_codebooks)
        _require_int(o, "codebook_size", self.codebook_size)
        _require_int(o, "codebook_dim", self.codebook_dim)
        _require_int(o, "semantic_codebook_size", self.semantic_codebook_size)
        self.downsample_factor = _require_int_list(o, "downsample_factor", self.downsample_factor)
        if self.downsample_dims is None:
            self.downsample_dims = tuple(self.input_dim for _ in self.downsample_factor)
        self.downsample_dims = _require_int_list(o, "downsample_dims", self.downsample_dims)
        if len(self.downsample_dims) != len(self.downsample_factor):
            raise ValueError(
                f"{o}.downsample_dims has {len(self.downsample_dims)} entries, "
                f"downsample_factor has {len(self.downsample_factor)}"
            )
        # The VQs, pre_module and post_module all work on `input_dim` channels, so the innermost
        # downsample width must come back to it.
        if self.downsample_dims[-1] != self.input_dim:
            raise ValueError(
                f"{o}.downsample_dims[-1] ({self.downsample_dims[-1]}) must equal "
                f"input_dim ({self.input_dim})"
            )
        for name in ("pre_module", "post_module"):
            m = getattr(self, name)
            if isinstance(m, dict):
                m = WindowTransformerConfig.from_dict(m)
                setattr(self, name, m)
            if m is not None and not isinstance(m, WindowTransformerConfig):
                raise ValueError(f"{o}.{name} must be a mapping or WindowTransformerConfig")
            if m is not None and m.input_dim != self.input_dim:
                raise ValueError(
                    f"{o}.{name}.input_dim ({m.input_dim}) must equal quantizer.input_dim "
                    f"({self.input_dim})"
                )
        if self.post_module is not None and self.post_module.window_size is None:
            raise ValueError(
                f"{o}.post_module.window_size must be set: the streaming decoder keeps a bounded "
                "attention window"
            )

    @property
    def latent_frames_per_code(self) -> int:
        return math.prod(self.downsample_factor)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizerConfig:
        return cls(**_strip("quantizer", data, cls))


def _tiny_transformer() -> WindowTransformerConfig:
    return WindowTransformerConfig(
        config=TransformerConfig(
            block_size=2048, n_layer=1, n_head=2, dim=64, intermediate_size=192, head_dim=32
        ),
        input_dim=64,
        window_size=4,
    )


def _s2pro_transformer() -> WindowTransformerConfig:
    return WindowTransformerConfig(
        config=TransformerConfig(
            block_size=4096, n_layer=8, n_head=16, dim=1024, intermediate_size=3072, head_dim=64
        ),
        input_dim=1024,
        window_size=128,
    )


@dataclass(slots=True)
class CodecConfig:
    """The whole codec (``DAC`` in fish_speech/models/dac/modded_dac.py)."""

    sample_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    causal: bool = True
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)
    # Carried for fidelity: the reference builds these decoder-block transformers but never
    # attaches them, so they have no weights and no effect.
    decoder_transformer_layers: tuple[int, ...] = (4, 0, 0, 0)
    transformer_general_config: TransformerGeneralConfig = field(
        default_factory=TransformerGeneralConfig
    )
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)

    def __post_init__(self) -> None:
        o = "codec"
        _require_int(o, "sample_rate", self.sample_rate)
        _require_int(o, "encoder_dim", self.encoder_dim)
        self.encoder_rates = _require_int_list(o, "encoder_rates", self.encoder_rates)
        self.decoder_rates = _require_int_list(o, "decoder_rates", self.decoder_rates)
        _require_int(o, "decoder_dim", self.decoder_dim)
        self.encoder_transformer_layers = _require_int_list(
            o, "encoder_transformer_layers", self.encoder_transformer_layers, 0
        )
        self.decoder_transformer_layers = _require_int_list(
            o, "decoder_transformer_layers", self.decoder_transformer_layers, 0
        )
        if self.causal is not True:
            raise ValueError(f"{o}.causal must be true (only the causal codec is implemented)")
        if len(self.encoder_transformer_layers) != len(self.encoder_rates):
            raise ValueError(
                f"{o}.encoder_transformer_layers has {len(self.encoder_transformer_layers)} "
                f"entries, encoder_rates has {len(self.encoder_rates)}"
            )
        if len(self.decoder_transformer_layers) != len(self.decoder_rates):
            raise ValueError(
                f"{o}.decoder_transformer_layers has {len(self.decoder_transformer_layers)} "
                f"entries, decoder_rates has {len(self.decoder_rates)}"
            )
        if math.prod(self.encoder_rates) != math.prod(self.decoder_rates):
            raise ValueError(
                f"{o}: prod(encoder_rates)={math.prod(self.encoder_rates)} must equal "
                f"prod(decoder_rates)={math.prod(self.decoder_rates)}"
            )
        if self.decoder_dim % (2 ** len(self.decoder_rates)):
            raise ValueError(
                f"{o}.decoder_dim ({self.decoder_dim}) must be divisible by "
                f"2**len(decoder_rates) = {2 ** len(self.decoder_rates)}"
            )
        if self.latent_dim is None:
            self.latent_dim = self.encoder_dim * 2 ** len(self.encoder_rates)
        _require_int(o, "latent_dim", self.latent_dim)
        if isinstance(self.transformer_general_config, dict):
            self.transformer_general_config = TransformerGeneralConfig.from_dict(
                self.transformer_general_config
            )
        if not isinstance(self.transformer_general_config, TransformerGeneralConfig):
            raise ValueError(f"{o}.transformer_general_config must be a mapping")
        if isinstance(self.quantizer, dict):
            self.quantizer = QuantizerConfig.from_dict(self.quantizer)
        if not isinstance(self.quantizer, QuantizerConfig):
            raise ValueError(f"{o}.quantizer must be a mapping")
        if self.quantizer.input_dim != self.latent_dim:
            raise ValueError(
                f"{o}.quantizer.input_dim ({self.quantizer.input_dim}) must equal latent_dim "
                f"({self.latent_dim} = encoder_dim * 2**len(encoder_rates) unless given)"
            )
        for i, n in enumerate(self.encoder_transformer_layers):
            width = self.encoder_dim * 2 ** (i + 1)
            if n and width < 64:
                raise ValueError(
                    f"{o}.encoder_transformer_layers[{i}] = {n} needs an encoder block width "
                    f">= 64 (its head count is width // 64), got width {width}"
                )

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def encoder_hop_length(self) -> int:
        """Samples per encoder latent step (the reference DAC's ``hop_length``, 512)."""
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        """Samples per code frame (2048 = 512 * 4 at the real and tiny sizes)."""
        return self.encoder_hop_length * self.quantizer.latent_frames_per_code

    @property
    def hop_length(self) -> int:
        """Samples per code frame; same as :attr:`frame_length` (see the module docstring)."""
        return self.frame_length

    @property
    def n_codebooks_total(self) -> int:
        return 1 + self.quantizer.n_codebooks

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.frame_length

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodecConfig:
        return cls(**_strip("codec", data, cls))

    @classmethod
    def from_file(cls, path: str | Path) -> CodecConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "codec_config.json"
        if not p.is_file():
            raise FileNotFoundError(f"codec config not found: {p}")
        text = p.read_text(encoding="utf-8")
        if p.suffix in (".yaml", ".yml"):
            import yaml  # optional; only for the reference's own yaml file

            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"codec config {p} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str) -> CodecConfig:
        """``"tiny"``: the fixture's dims (fast on a CPU). ``"s2-pro"``: the real S2 codec."""
        if name == "tiny":
            return cls(
                sample_rate=44100,
                encoder_dim=4,
                encoder_rates=(2, 4, 8, 8),
                decoder_dim=64,
                decoder_rates=(8, 8, 4, 2),
                encoder_transformer_layers=(0, 0, 0, 1),
                decoder_transformer_layers=(4, 0, 0, 0),
                transformer_general_config=TransformerGeneralConfig(block_size=8192),
                quantizer=QuantizerConfig(
                    input_dim=64,
                    n_codebooks=9,
                    codebook_size=1024,
                    codebook_dim=8,
                    semantic_codebook_size=4096,
                    downsample_factor=(2, 2),
                    pre_module=_tiny_transformer(),
                    post_module=_tiny_transformer(),
                ),
            )
        if name in ("s2-pro", "s2pro", "s2_pro"):
            return cls(
                sample_rate=44100,
                encoder_dim=64,
                encoder_rates=(2, 4, 8, 8),
                decoder_dim=1536,
                decoder_rates=(8, 8, 4, 2),
                encoder_transformer_layers=(0, 0, 0, 4),
                decoder_transformer_layers=(4, 0, 0, 0),
                transformer_general_config=TransformerGeneralConfig(block_size=16384),
                quantizer=QuantizerConfig(
                    input_dim=1024,
                    n_codebooks=9,
                    codebook_size=1024,
                    codebook_dim=8,
                    semantic_codebook_size=4096,
                    downsample_factor=(2, 2),
                    pre_module=_s2pro_transformer(),
                    post_module=_s2pro_transformer(),
                ),
            )
        raise ValueError(f"unknown codec preset {name!r} (known: 'tiny', 's2-pro')")
