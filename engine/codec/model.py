"""The modded-DAC codec: encoder, quantizer, decoder (module paths match the reference's
state dict, so checkpoints load by name after weight-norm folding).

Decode: codes [B, 10, T] -> quantizer.decode -> latent [B, D, 4T] -> decoder -> audio
[B, 1, 2048 T]. Decoder: causal conv k7 -> blocks (Snake, causal transposed conv k=2r stride r,
residual units with dilations 1, 3, 9) at rates [8, 8, 4, 2] -> Snake -> conv k7 -> tanh.

Encode: audio [B, 1, N] (right-padded to a multiple of 2048) -> encoder (conv k7, blocks of
residual units + Snake + strided conv at rates [2, 4, 8, 8], the last with a windowed
transformer, Snake, conv k3) -> quantizer.encode -> codes [B, 10, ceil(N/2048)].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import CodecConfig, WindowTransformerConfig
from .layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    ResidualUnit,
    Snake1d,
    Stateful,
    StreamContext,
    WindowLimitedTransformer,
    stream_modules,
    stream_sequential,
)
from .quantizer import CodecQuantizer

__all__ = ["Codec", "Decoder", "DecoderBlock", "Encoder", "EncoderBlock"]

# The reference hard-codes the encoder-block transformer's attention window (in encoder steps).
ENCODER_TRANSFORMER_WINDOW = 512


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, n_t_layer: int, cfg: CodecConfig) -> None:
        super().__init__()
        if n_t_layer:
            general = cfg.transformer_general_config
            transformer: nn.Module = WindowLimitedTransformer(
                WindowTransformerConfig(
                    config=general.build(n_t_layer, dim // 64, dim, 3 * dim),
                    input_dim=dim,
                    window_size=ENCODER_TRANSFORMER_WINDOW,
                )
            )
        else:
            transformer = nn.Identity()
        self.block = nn.Sequential(
            ResidualUnit(dim // 2, dilation=1),
            ResidualUnit(dim // 2, dilation=3),
            ResidualUnit(dim // 2, dilation=9),
            Snake1d(dim // 2),
            CausalConv1d(dim // 2, dim, kernel_size=2 * stride, stride=stride, weight_norm=True),
            transformer,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        d = cfg.encoder_dim
        layers: list[nn.Module] = [CausalConv1d(1, d, kernel_size=7, weight_norm=True)]
        for stride, n_t_layer in zip(cfg.encoder_rates, cfg.encoder_transformer_layers):
            d *= 2
            layers.append(EncoderBlock(d, stride, n_t_layer, cfg))
        assert cfg.latent_dim is not None
        layers += [Snake1d(d), CausalConv1d(d, cfg.latent_dim, kernel_size=3, weight_norm=True)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, 1, N] (N a multiple of the encoder hop) -> [B, latent_dim, N / 512]
        return self.block(x)


class DecoderBlock(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(input_dim),
            CausalConvTranspose1d(
                input_dim, output_dim, kernel_size=2 * stride, stride=stride, weight_norm=True
            ),
            ResidualUnit(output_dim, dilation=1),
            ResidualUnit(output_dim, dilation=3),
            ResidualUnit(output_dim, dilation=9),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        return stream_sequential(self.block, x, ctx)


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        channels = cfg.decoder_dim
        assert cfg.latent_dim is not None
        layers: list[nn.Module] = [
            CausalConv1d(cfg.latent_dim, channels, kernel_size=7, weight_norm=True)
        ]
        out_dim = channels
        for i, stride in enumerate(cfg.decoder_rates):
            in_dim, out_dim = channels // 2**i, channels // 2 ** (i + 1)
            layers.append(DecoderBlock(in_dim, out_dim, stride))
        layers += [
            Snake1d(out_dim),
            CausalConv1d(out_dim, 1, kernel_size=7, weight_norm=True),
            nn.Tanh(),
        ]
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, latent_dim, L] -> [B, 1, L * 512]
        return self.model(x)

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        # the blocks' modules as one chain: a block's last residual unit can then write the
        # next block's (or the output conv's) input itself (`stream_modules`)
        mods: list[nn.Module] = []
        for m in self.model:
            mods += list(m.block) if isinstance(m, DecoderBlock) else [m]
        return stream_modules(mods, x, ctx)


class Codec(nn.Module):
    """The whole codec. Build with :func:`~engine.codec.load_codec` or
    :func:`~engine.codec.dummy_codec` (a bare ``Codec(cfg)`` has placeholder weights)."""

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = CodecQuantizer(cfg.quantizer)
        self.decoder = Decoder(cfg)
        for name, m in self.named_modules():
            if isinstance(m, Stateful):
                m.state_key = name

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    @property
    def frame_length(self) -> int:
        return self.cfg.frame_length

    @property
    def hop_length(self) -> int:
        return self.cfg.hop_length

    @property
    def n_codebooks_total(self) -> int:
        return self.cfg.n_codebooks_total

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model[0].conv.weight.dtype

    # -- checks ----------------------------------------------------------------------------------
    def check_codes(
        self, codes: Tensor, what: str = "codes", ndim: int = 3, values: bool = True
    ) -> None:
        """Raise naming the problem unless ``codes`` is an integer tensor [(B,) 10, T] (and,
        with ``values``, >= 0; that check reads the values, a device sync on a GPU)."""
        if not isinstance(codes, Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise TypeError(f"{what} must have an integer dtype, got {codes.dtype}")
        n = self.n_codebooks_total
        if codes.dim() != ndim or codes.shape[ndim - 2] != n:
            want = f"[B, {n}, T]" if ndim == 3 else f"[{n}, T]"
            raise ValueError(f"{what} must have shape {want}, got {list(codes.shape)}")
        if values and codes.numel() and bool((codes < 0).any()):
            raise ValueError(f"{what} contain negative values (min {int(codes.min())})")

    # -- decode ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, 10, T] int -> audio [B, 1, T * 2048] in the model dtype.

        Row 0 is clamped to <= 4095 and rows 1..9 to <= 1023 on a copy (the caller's tensor is
        not modified).
        """
        self.check_codes(codes)
        codes = codes.to(self.device, torch.long)
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 1, 0, device=self.device, dtype=self.dtype)
        return self.decoder(self.quantizer.decode(codes))

    def stream_decode(self, codes: Tensor, ctx: StreamContext) -> Tensor:
        """Streaming continuation: clamped codes [B, 10, n_max] (right-padded) ->
        [B, 1, n_max * 2048]; layer state in ``ctx``."""
        return self.decoder.stream(self.quantizer.stream_decode(codes, ctx), ctx)

    def streaming_modules(self) -> list[Stateful]:
        """The stateful layers on the decode path (what a streaming decoder must carry)."""
        out: list[Stateful] = []
        for root in (self.quantizer.post_module, self.quantizer.upsample, self.decoder):
            for m in root.modules():
                if isinstance(m, Stateful) and (m.state_shapes() or m.ring_shapes()):
                    out.append(m)
        return out

    # -- encode ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, audio: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """audio [B, 1, N] (or [B, N]) at 44.1 kHz -> (codes [B, 10, F] int64, frames [B] int64),
        F = ceil(N / 2048). ``lengths`` [B] are the valid samples per item (default N); the
        returned frame counts are ceil(lengths / 2048).
        """
        if not isinstance(audio, Tensor):
            raise TypeError(f"audio must be a torch.Tensor, got {type(audio).__name__}")
        if not audio.dtype.is_floating_point:
            raise TypeError(f"audio must be a floating-point tensor, got {audio.dtype}")
        if audio.dim() == 2:
            audio = audio[:, None]
        if audio.dim() != 3 or audio.shape[1] != 1:
            raise ValueError(f"audio must have shape [B, 1, N] (mono), got {list(audio.shape)}")
        n = audio.shape[-1]
        if n == 0:
            raise ValueError("audio is empty (0 samples)")
        if lengths is None:
            lengths = torch.full((audio.shape[0],), n, dtype=torch.long)
        if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point:
            raise TypeError("lengths must be an integer torch.Tensor [B]")
        if lengths.shape != (audio.shape[0],):
            raise ValueError(
                f"lengths must have shape [{audio.shape[0]}], got {list(lengths.shape)}"
            )
        if bool((lengths < 0).any()) or bool((lengths > n).any()):
            raise ValueError(f"lengths must be within [0, {n}], got {lengths.tolist()}")
        frame = self.frame_length
        padded = -(-n // frame) * frame
        x = torch.nn.functional.pad(audio.to(self.device, self.dtype), (0, padded - n))
        codes = self.quantizer.encode(self.encoder(x))
        frames = (lengths.to(self.device, torch.long) + frame - 1) // frame
        return codes, frames
