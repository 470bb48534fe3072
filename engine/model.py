"""The Fish Audio S2 DualAR model ("fish_qwen3_omni"), written as the math.

Slow AR: a Qwen3-style decoder over frame columns `[t, c0..c9]` that predicts the next
semantic token. Fast AR: a small decoder run across the 10 codebooks of one frame.
Caching is not the model's business: every attention layer hands its rotated q/k/v to an
`Attend` object supplied by the runner, which owns the KV storage and the masking. Nor is
speed: the elementwise pieces and the linear layers are called through the `ops` the
caller passes (engine/ops.py; the reference math by default).
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, TransformerConfig
from .functional import rope_table
from .ops import REFERENCE, Normed, Ops, PendingGate, PendingGlu, PendingHeads


class Attend(Protocol):
    """Stores this step's k/v for `layer` and returns the attention output.

    q: [B, H, T, Dh], k/v: [B, Hkv, T, Dh] (already normed and rotated) -> [B, H, T, Dh]

    An attend may also offer `norm_rope_attend(layer, q, k, v, qw, kw, cs, eps)`: the same
    with q [B, T, H, Dh] and k/v [B, T, Hkv, Dh] before the q/k norm and rotation, which it
    applies itself (a kernel that does both in one launch); None or absent: not offered.
    And `defer(layer, qkv, cs, compute)`: a `PendingHeads` for one position's projections
    qkv [B, 1, q + 2 kv] (no q/k norm), which the output projection may attend in its
    prologue (`compute` otherwise); None or absent: not offered.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, ops: Ops = REFERENCE) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=False)  # rows [q | k | v]
        self.wo = nn.Linear(cfg.q_size, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def heads(self, x: Tensor | Normed, cs: Tensor, attend: Attend, layer: int,
              ops: Ops) -> Tensor | PendingHeads:
        """x: [B, T, D] (normed; `Normed`: its norm still to apply) -> the heads' output
        before the output projection wo: [B, T, q_size], or left pending (`PendingHeads`)
        where the attend offers it (`defer`) for wo's prologue to compute."""
        qkv = ops.project(x, self.wqkv.weight)  # [B, T, q_size + 2 kv_size]
        now = functools.partial(self.attend_heads, qkv, cs, attend, layer, ops)
        defer = getattr(attend, "defer", None)
        if defer is not None and not self.cfg.qk_norm:
            pending = defer(layer, qkv, cs, now)
            if pending is not None:
                return pending
        return now()

    def attend_heads(self, qkv: Tensor, cs: Tensor, attend: Attend, layer: int,
                     ops: Ops) -> Tensor:
        """qkv: [B, T, q_size + 2 kv_size] -> the heads' output [B, T, q_size]."""
        c = self.cfg
        B, T, _ = qkv.shape
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(B, T, c.n_head, c.head_dim)
        k = k.view(B, T, c.n_local_heads, c.head_dim)
        v = v.view(B, T, c.n_local_heads, c.head_dim)
        # per-head q/k norm (slow AR only) before the rotation
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if c.qk_norm else (None, None)
        fused = getattr(attend, "norm_rope_attend", None)
        if fused is not None:  # the norm and rotation inside the attention kernel
            y = fused(layer, q, k, v, qw, kw, cs, c.norm_eps)
        else:
            q, k = ops.norm_rope_qk(q, k, qw, kw, cs, c.norm_eps)
            y = attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return y.transpose(1, 2).reshape(B, T, c.q_size)


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def gate(self, x: Tensor | Normed, ops: Ops) -> Tensor | PendingGate | PendingGlu:
        """The gated input of w2: silu(x W1^T) * (x W3^T). x: [B, T, D] -> [B, T, I] (or
        left pending for w2's GEMM to quantise as it is made: `PendingGate`, `PendingGlu`)."""
        return ops.swiglu(x, self.w1.weight, self.w3.weight)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: Tensor, xn: Tensor | Normed, cs: Tensor, attend: Attend, layer: int,
                next_norm: RMSNorm, ops: Ops) -> tuple[Tensor, Tensor | Normed]:
        """x: the residual stream [B, T, D]; xn: attention_norm(x) -> (x', next_norm(x')),
        x' = h + gate(ffn_norm(h)) W2^T, h = x + heads(xn) Wo^T. Each residual add comes with
        the projection whose output it adds and the norm that reads its sum (the next
        block's attention_norm, or the final norm): one pass, or folded into the
        projection's epilogue and the next projection's prologue (Ops.linear_add_rms_norm)."""
        a = self.attention.heads(xn, cs, attend, layer, ops)
        h, hn = ops.linear_add_rms_norm(a, self.attention.wo.weight, x, self.ffn_norm.weight,
                                        self.ffn_norm.eps)
        f = self.feed_forward.gate(hn, ops)
        return ops.linear_add_rms_norm(f, self.feed_forward.w2.weight, h, next_norm.weight,
                                       next_norm.eps)


def run_blocks(blocks: nn.ModuleList, final_norm: RMSNorm, x: Tensor, cs: Tensor,
               attend: Attend, ops: Ops) -> Tensor | Normed:
    """The decoder stack: x [B, T, D] through every block -> final_norm(output) [B, T, D],
    left pending (`Normed`) where `ops` may fold it into the projection that reads it."""
    first = blocks[0].attention_norm
    xn = ops.pending_norm(x, first.weight, first.eps)
    for i, block in enumerate(blocks):
        nxt = blocks[i + 1].attention_norm if i + 1 < len(blocks) else final_norm
        x, xn = block(x, xn, cs, attend, i, nxt, ops)
    return xn


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Reference-style attention. q: [B, H, T, Dh]; k/v: [B, Hkv, S, Dh]; mask bool [B|1, 1, T, S].

    Each kv head serves n_head/n_kv consecutive query heads (repeat_interleave).
    """
    B, H, T, Dh = q.shape
    rep = H // k.shape[1]
    if rep == 1 or mask is None:  # no mask: the flash kernel takes the GQA broadcast itself
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
    # With a mask, SDPA has no fused kernel for the GQA broadcast and falls back to its math
    # path (K/V repeated, scores materialised: most of a batched prefill's extra time). The
    # same attention without it: a kv head's `rep` query heads become `rep` blocks of rows.
    qf = q.reshape(B, k.shape[1], rep * T, Dh)  # [B, Hkv, rep*T, Dh], head h = g*rep + r
    mf = mask.unsqueeze(2).expand(-1, -1, rep, -1, -1).reshape(mask.shape[0], 1, rep * T, -1)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf)  # [B, Hkv, rep*T, Dh]
    return out.reshape(B, H, T, Dh)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """The fast AR's attention as the reference writes it: scores * (1/sqrt(d)), softmax, @ v."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


class DualAR(nn.Module):
    """Slow AR + fast AR with S2-Pro module names (see engine/weights.py for the key map)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        s, f = cfg.slow, cfg.fast
        self.embeddings = nn.Embedding(s.vocab_size, s.dim)  # tied with the output head
        self.codebook_embeddings = nn.Embedding(cfg.num_codebooks * cfg.codebook_size, s.dim)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.norm = RMSNorm(s.dim, s.norm_eps)
        self.fast_embeddings = nn.Embedding(cfg.codebook_size, f.dim)
        self.fast_layers = nn.ModuleList(Block(f) for _ in range(f.n_layer))
        self.fast_norm = RMSNorm(f.dim, f.norm_eps)
        self.fast_output = nn.Linear(f.dim, cfg.codebook_size, bias=False)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)build the derived, non-persistent buffers (after a meta-device load, say)."""
        s, f, cfg = self.cfg.slow, self.cfg.fast, self.cfg
        if device is None:
            device = self.embeddings.weight.device
        if torch.device(device).type == "meta":  # filled in by the loader after weights arrive
            self.register_buffer("rope", None, persistent=False)
            self.register_buffer("fast_rope", None, persistent=False)
            self.register_buffer("codebook_offsets", None, persistent=False)
            return
        self.register_buffer("rope", rope_table(s.max_seq_len, s.head_dim, s.rope_base).to(device),
                             persistent=False)
        self.register_buffer("fast_rope",
                             rope_table(cfg.num_codebooks, f.head_dim, s.rope_base).to(device),
                             persistent=False)
        self.register_buffer("codebook_offsets", torch.arange(
            cfg.num_codebooks, device=device) * cfg.codebook_size, persistent=False)

    # ------------------------------------------------------------------ slow AR
    def embed(self, cols: Tensor, ops: Ops = REFERENCE) -> Tensor:
        """cols: [B, 1+K, T] int (row 0 token id, rows 1..K codes) -> x: [B, T, D].

        At semantic positions x = (E_tok[t] + sum_i E_cb[c_i + i*4096]) / sqrt(K+1);
        elsewhere the codebook rows are ignored (functional.embed_columns).
        """
        ids = self.cfg.ids
        return ops.embed_columns(cols, self.embeddings.weight, self.codebook_embeddings.weight,
                                 self.codebook_offsets, ids.semantic_start, ids.semantic_end,
                                 math.sqrt(self.cfg.num_codebooks + 1))

    def forward_slow(self, cols: Tensor, positions: Tensor, attend: Attend,
                     ops: Ops = REFERENCE) -> Tensor:
        """cols: [B, 1+K, T]; positions: [B, T] -> final-normed hidden states h: [B, T, D]."""
        x = self.embed(cols, ops)
        cs = self.rope[positions]  # [B, T, Dh/2, 2]
        # dense: h feeds two heads and the fast AR's residual stream
        return ops.dense(run_blocks(self.layers, self.norm, x, cs, attend, ops))

    def semantic_logits(self, h: Tensor, ops: Ops = REFERENCE) -> Tensor:
        """h: [..., D] -> logits over [semantic 0..N-1, <|im_end|>]: [..., N+1].

        Only these 4,097 rows of the tied 155,776-row head can ever be sampled.
        """
        ids = self.cfg.ids
        rows = ((ids.semantic_start, ids.semantic_end + 1), (ids.im_end, ids.im_end + 1))
        return ops.rows_linear(h, self.embeddings.weight, rows)

    def full_logits(self, h: Tensor) -> Tensor:
        """Logits over the whole text vocabulary (for reference checks only)."""
        return F.linear(h, self.embeddings.weight)

    # ------------------------------------------------------------------ fast AR
    def forward_fast(self, x: Tensor, pos: int, attend: Attend, ops: Ops = REFERENCE) -> Tensor:
        """Fast-AR positions pos..pos+T-1 for a batch. x: [B, T, D] -> logits [B, T, 4096].

        Position 0 is the slow hidden state and position j >= 1 the embedding of code j-1;
        position j's logits give code j (position 0's are never sampled). The runner feeds
        positions 0 and 1 as one call (T = 2: the fast AR's weights read once for both),
        then one position per call."""
        return ops.project(self.fast_hidden(x, pos, attend, ops), self.fast_output.weight)

    def fast_hidden(self, x: Tensor, pos: int, attend: Attend,
                    ops: Ops = REFERENCE) -> Tensor | Normed:
        """The fast AR's final-normed hidden states at positions pos..pos+T-1: x [B, T, D]
        -> [B, T, D], the final norm left pending (`Normed`: `ops.dense` computes it) where
        `ops` may fold it into the head's prologue."""
        B, T = x.shape[:2]
        cs = self.fast_rope[pos: pos + T].unsqueeze(0).expand(B, -1, -1, -1)  # [B, T, Dh/2, 2]
        return run_blocks(self.fast_layers, self.fast_norm, x, cs, attend, ops)
