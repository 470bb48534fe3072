"""The elementwise math shared by the DualAR model and the codec: RoPE and RMSNorm (one
implementation each), and the model's other pointwise pieces. These are the reference
functions; engine/ops.py may hand the model fused versions of the same math."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor


def rope_table(n_pos: int, head_dim: int, base: float) -> Tensor:
    """cos/sin table [n_pos, head_dim/2, 2], rounded to bf16 as the reference does.

    Angles are float32 on purpose: float64 angles change hundreds of bf16 entries from
    position ~100 on, which moves logits enough to flip codes at real lengths.
    """
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).to(torch.bfloat16)


def apply_rope(x: Tensor, cs: Tensor) -> Tensor:
    """Interleaved (GPT-J) rotation of adjacent pairs (2i, 2i+1), computed in float32.

    x: [B, T, H, Dh]; cs: [B or 1, T, Dh/2, 2] (bf16 values, promoted to float32 here)
    """
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, Dh/2, 2]
    cs = cs.unsqueeze(2)  # [B, T, 1, Dh/2, 2]
    out = torch.stack([xp[..., 0] * cs[..., 0] - xp[..., 1] * cs[..., 1],
                       xp[..., 1] * cs[..., 0] + xp[..., 0] * cs[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * w, normalised in float32 whatever the activation dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def add_rms_norm(x: Tensor, y: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual sum and its norm: (x + y, rms_norm(x + y))."""
    h = x + y
    return h, rms_norm(h, w, eps)


def norm_rope_qk(q: Tensor, k: Tensor, qw: Tensor | None, kw: Tensor | None, cs: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """Per-head RMSNorm of q and k (when the weights are given), then the rotation."""
    if qw is not None and kw is not None:
        q, k = rms_norm(q, qw, eps), rms_norm(k, kw, eps)
    return apply_rope(q, cs), apply_rope(k, cs)


def silu_mul(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


def add_scaled(x: Tensor, y: Tensor, gamma: Tensor) -> Tensor:
    """A residual add with a LayerScale on its branch: x + y * gamma."""
    return x + y * gamma


def embed_columns(cols: Tensor, tok_table: Tensor, cb_table: Tensor, offsets: Tensor,
                  semantic_start: int, semantic_end: int, scale: float) -> Tensor:
    """The slow AR's input: cols [B, 1+K, T] int (row 0 token ids, rows 1..K codes) -> x
    [B, T, D]. At semantic tokens x = (E_tok[t] + sum_i E_cb[c_i + offsets[i]]) / scale;
    elsewhere x = E_tok[t] (the codebook rows are ignored)."""
    tok = cols[:, 0]  # [B, T]
    codes = cols[:, 1:] + offsets[None, :, None]  # [B, K, T]
    vq = F.embedding(codes, cb_table).sum(dim=1)  # [B, T, D]
    semantic = (tok >= semantic_start) & (tok <= semantic_end)  # [B, T]
    x = F.embedding(tok, tok_table) + vq * semantic.unsqueeze(-1)
    return torch.where(semantic.unsqueeze(-1), x / scale, x)


def param_seed(seed: int, name: str) -> int:
    """The seed of one random-weight tensor: from the model's seed and the tensor's name, so
    values do not depend on creation order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
