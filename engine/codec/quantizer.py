"""The codec's quantizer: x4 temporal down/upsampling around a semantic VQ and a residual RVQ.

Decode (codes -> latent):  z = semantic_out + (r_0 + r_1 + ... + r_8)   (that summation order)
                           -> post_module (windowed causal transformer) -> upsample x2 x2.
Encode (latent -> codes):  downsample x2 x2 -> pre_module -> semantic VQ on z -> residual RVQ
                           on z - semantic_out, with residual -= out_i after each codebook.

Each VQ is factorised: a 1x1 conv projects to ``codebook_dim`` (8), the nearest codebook row is
found by cosine similarity (both sides L2-normalised), and a 1x1 conv projects back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import QuantizerConfig
from .layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    StreamContext,
    WindowLimitedTransformer,
    stream_sequential,
)

__all__ = ["CodecQuantizer", "ResidualVQ", "VectorQuantizer", "lookup_sum"]


class VectorQuantizer(nn.Module):
    """One factorised codebook (weight-normed 1x1 in/out projections in the reference)."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.codebook_size = codebook_size
        self.in_proj = nn.Conv1d(input_dim, codebook_dim, kernel_size=1)
        self.out_proj = nn.Conv1d(codebook_dim, input_dim, kernel_size=1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def lookup(self, codes: Tensor) -> Tensor:
        # codes: [B, T] int -> [B, input_dim, T]
        z_p = F.embedding(codes, self.codebook.weight).transpose(1, 2)  # [B, codebook_dim, T]
        return self.out_proj(z_p)

    @torch.no_grad()
    def table(self) -> Tensor:
        """`lookup` of every code at once: out_proj over the whole codebook, [codebook_size,
        input_dim] (row c = code c's lookup, up to the 1x1 conv's rounding for a batch of
        another shape), kept until a weight is replaced or edited in place (autograd's
        version counter: edits through `.data` go unseen). Made inside a CUDA graph capture:
        not kept. A replaced CUDA table stays alive (graphs captured with it keep reading
        it): the weights are meant to stay as loaded."""
        params = [p for p in (self.codebook.weight, self.out_proj.weight, self.out_proj.bias)
                  if p is not None]
        state = [(p._version, p.data_ptr(), p.dtype, p.device) for p in params]
        cached = self.__dict__.get("_table")
        if (cached is not None and len(cached[0]) == len(params)
                and all(a is b for a, b in zip(cached[0], params)) and cached[1] == state):
            return cached[2]
        t = self.out_proj(self.codebook.weight.t()[None])[0].t().contiguous()
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            if cached is not None and cached[2].is_cuda:
                self.__dict__.setdefault("_old_tables", []).append(cached[2])
            self.__dict__["_table"] = (params, state, t)
        return t

    def scores(self, z_e: Tensor) -> Tensor:
        # z_e: [B, codebook_dim, T] -> [B*T, codebook_size]: minus squared distance between the
        # L2-normalised latent and L2-normalised codebook rows (the reference's formula).
        enc = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]))  # [(B T), d]
        cb = F.normalize(self.codebook.weight)  # [N, d]
        dist = (
            enc.pow(2).sum(1, keepdim=True) - 2 * enc @ cb.t() + cb.pow(2).sum(1, keepdim=True).t()
        )
        return -dist

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        # z: [B, input_dim, T] -> (out [B, input_dim, T], codes [B, T])
        z_e = self.in_proj(z)
        codes = self.scores(z_e).max(1)[1].view(z.shape[0], z.shape[-1])
        z_q = F.embedding(codes, self.codebook.weight).transpose(1, 2)
        z_q = z_e + (z_q - z_e)  # the reference's straight-through form (changes rounding)
        return self.out_proj(z_q), codes


def lookup_sum(codes: Tensor, tables: list[Tensor]) -> Tensor:
    """The decode's latent from the codebooks' projected rows (`VectorQuantizer.table`):
    codes [B, 1+N, T] (clamped) -> [B, D, T] (the transpose of a [B, T, D] tensor), summed in
    the decode's order: (0 + S[c_0]) + (((0 + R_1[c_1]) + R_2[c_2]) + ... + R_N[c_N]) —
    the modules' lookup up to the rounding of each table row's 1x1 conv."""
    r: Tensor | float = 0.0
    for i in range(1, len(tables)):
        r = r + F.embedding(codes[:, i], tables[i])  # [B, T, D]
    return ((0.0 + F.embedding(codes[:, 0], tables[0])) + r).transpose(1, 2)


class ResidualVQ(nn.Module):
    def __init__(
        self, input_dim: int, n_codebooks: int, codebook_size: int, codebook_dim: int
    ) -> None:
        super().__init__()
        self.codebook_size = codebook_size
        self.quantizers = nn.ModuleList(
            VectorQuantizer(input_dim, codebook_size, codebook_dim) for _ in range(n_codebooks)
        )

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, N, T] -> [B, D, T]; summed in codebook order
        z: Tensor | float = 0.0
        for i, q in enumerate(self.quantizers):
            z = z + q.lookup(codes[:, i])
        assert isinstance(z, Tensor)
        return z

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        # z: [B, D, T] -> (sum of outputs [B, D, T], codes [B, N, T])
        residual = z
        total: Tensor | float = 0.0
        codes = []
        for q in self.quantizers:
            out, c = q.quantize(residual)
            total = total + out
            residual = residual - out
            codes.append(c)
        assert isinstance(total, Tensor)
        return total, torch.stack(codes, dim=1)


class CodecQuantizer(nn.Module):
    """``DownsampleResidualVectorQuantize`` (attribute names match its state dict)."""

    def __init__(self, cfg: QuantizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dims = (cfg.input_dim, *cfg.downsample_dims)
        self.semantic_quantizer = ResidualVQ(
            cfg.input_dim, 1, cfg.semantic_codebook_size, cfg.codebook_dim
        )
        self.quantizer = ResidualVQ(
            cfg.input_dim, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim
        )
        self.downsample = nn.Sequential(
            *[
                nn.Sequential(
                    CausalConv1d(dims[i], dims[i + 1], kernel_size=f, stride=f),
                    ConvNeXtBlock(dims[i + 1]),
                )
                for i, f in enumerate(cfg.downsample_factor)
            ]
        )
        self.upsample = nn.Sequential(
            *[
                nn.Sequential(
                    CausalConvTranspose1d(dims[i + 1], dims[i], kernel_size=f, stride=f),
                    ConvNeXtBlock(dims[i]),
                )
                for i, f in reversed(list(enumerate(cfg.downsample_factor)))
            ]
        )
        self.pre_module = (
            WindowLimitedTransformer(cfg.pre_module)
            if cfg.pre_module is not None
            else nn.Identity()
        )
        self.post_module = (
            WindowLimitedTransformer(cfg.post_module)
            if cfg.post_module is not None
            else nn.Identity()
        )

    @property
    def n_codebooks_total(self) -> int:
        return 1 + len(self.quantizer.quantizers)

    def clamp_codes(self, codes: Tensor) -> Tensor:
        """Copy of ``codes`` with row 0 clamped to the semantic codebook and rows 1.. to the
        residual codebook (the LLM can emit up to 4095 in every row)."""
        out = torch.empty_like(codes)
        out[:, 0] = codes[:, 0].clamp(max=self.semantic_quantizer.codebook_size - 1)
        out[:, 1:] = codes[:, 1:].clamp(max=self.quantizer.codebook_size - 1)
        return out

    def lookup(self, codes: Tensor) -> Tensor:
        # codes: [B, 10, T] (already clamped) -> latent at frame rate [B, D, T]
        return self.semantic_quantizer.decode(codes[:, :1]) + self.quantizer.decode(codes[:, 1:])

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, 10, T] int -> [B, D, T * 4]
        z = self.lookup(self.clamp_codes(codes))
        return self.upsample(self.post_module(z))

    def tables(self) -> list[Tensor]:
        """Every codebook's projected rows, semantic first (`lookup_sum`'s tables)."""
        return [q.table() for q in (*self.semantic_quantizer.quantizers,
                                    *self.quantizer.quantizers)]

    def stream_decode(self, codes: Tensor, ctx: StreamContext) -> Tensor:
        # codes: [B, 10, n_max] clamped, right-padded -> [B, D, n_max * 4]
        if ctx.ops.lookup_sum is not None:  # one op over the projected codebooks
            z = ctx.ops.lookup_sum(codes, self.tables())
        else:
            z = self.lookup(codes)
        z = stream_sequential(self.post_module, z, ctx)
        for stage in self.upsample:
            z = stream_sequential(stage, z, ctx)
        return z

    def encode(self, z: Tensor) -> Tensor:
        # z: [B, D, L] encoder latent (L a multiple of 4) -> codes [B, 10, L / 4]
        z = self.pre_module(self.downsample(z))
        semantic_out, semantic_codes = self.semantic_quantizer.quantize(z)
        _, residual_codes = self.quantizer.quantize(z - semantic_out)
        return torch.cat([semantic_codes, residual_codes], dim=1)
