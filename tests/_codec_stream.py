"""A small codec block streamed chunk by chunk, for the tests of the streaming codec ops."""

from __future__ import annotations

import torch

from engine.codec.layers import (
    CausalConv1d,
    CodecOps,
    ResidualUnit,
    Snake1d,
    StreamContext,
    stream_sequential,
)

CUTS = ((0, 7), (7, 8), (8, 31), (31, 50))  # uneven chunks of 50 samples, one of 1


def unit_block(channels: int, seed: int = 0) -> torch.nn.Module:
    """A residual unit (dilation 3), a Snake and a k=7 conv to 4 channels: a decoder block's
    streaming paths in small, its Snake alphas random in [0.3, 1.3)."""
    torch.manual_seed(seed)
    block = torch.nn.Sequential(ResidualUnit(channels, dilation=3), Snake1d(channels),
                                CausalConv1d(channels, 4, kernel_size=7)).eval()
    for m in block.modules():
        if isinstance(m, Snake1d):
            m.alpha.data = torch.rand_like(m.alpha) + 0.3
    return block


def stream_vs_offline(block: torch.nn.Module, x: torch.Tensor, ops: CodecOps,
                      channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(streamed, offline) outputs of `block` on x [B, C, 50]: the stream in CUTS, every
    stream of the batch at the same offset, its state carried between chunks; with
    `channels_last`, each chunk stored [B, T, C]."""
    B = x.shape[0]
    with torch.no_grad():
        want = block(x)
        states = {}
        for name, m in block.named_modules():
            if hasattr(m, "state_shapes"):
                m.state_key = name
                for key, shape in m.state_shapes().items():
                    states[f"{name}.{key}"] = torch.zeros(B, *shape, dtype=x.dtype,
                                                          device=x.device)
        got = []
        for a, b in CUTS:
            xs = x[..., a:b]
            if channels_last:
                xs = xs.transpose(1, 2).contiguous().transpose(1, 2)
            ctx = StreamContext(torch.tensor([b - a] * B, device=x.device),
                                torch.tensor([a] * B, device=x.device), b - a, a,
                                states, uniform=True, ops=ops)
            got.append(stream_sequential(block, xs, ctx))
            states = {**states, **ctx.new_state}
    return torch.cat(got, -1), want
