"""The model runner: owns the weights, the KV cache and the per-slot sampling state, and runs
the two kinds of work the engine schedules.

- `prefill(slot, cols, start)`: write a chunk of prompt columns into a slot's cache.
- `decode(slots, cols, positions)`: one audio frame for every row of the batch: slow AR on the
  previous column, main-token sampling (semantic slice + <|im_end|>), then the fast AR across
  the codebooks. Returns frames `[B, 1+K]` = [token id, c0..c9] and stays on the device.
The engine feeds each sequence's last prompt column through `decode`, so every frame,
the first included, comes from the same code path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import DecodeAttend, FastKV, PrefillAttend, SlowKVCache
from .config import ModelConfig
from .model import DualAR
from .sampler import SamplingParams, SlotSampling


class ModelRunner:
    def __init__(self, model: DualAR, *, n_slots: int, max_len: int,
                 dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.device = model.embeddings.weight.device
        self.dtype = dtype or model.embeddings.weight.dtype
        self.cache = SlowKVCache(self.cfg.slow, n_slots, max_len, device=self.device,
                                 dtype=self.dtype)
        self.sampling = SlotSampling(n_slots + 1, self.device)
        self.fast_kv = FastKV(self.cfg, n_slots + 1, device=self.device, dtype=self.dtype)
        self.n_semantic = self.cfg.ids.n_semantic

    # ------------------------------------------------------------------ bookkeeping
    def assign(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.sampling.assign(slot, params, seed)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, slot: int, cols: Tensor, start: int) -> Tensor:
        """cols: [1+K, T] prompt columns placed at positions start..start+T-1.
        Returns the final-normed hidden state of the last column [D]."""
        cols = cols.to(self.device)
        T = cols.shape[1]
        attend = PrefillAttend(self.cache, slot, start, T)
        positions = torch.arange(start, start + T, device=self.device)[None]
        h = self.model.forward_slow(cols[None], positions, attend)
        return h[0, -1]

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode(self, slots: Tensor, cols: Tensor, positions: Tensor, span: int) -> Tensor:
        """slots [B] int64, cols [B, 1+K] (the column each row feeds), positions [B].
        `span` bounds max(positions)+1. Returns frames [B, 1+K] int64 on the device."""
        attend = DecodeAttend(self.cache, slots, positions, span)
        h = self.model.forward_slow(cols[:, :, None], positions[:, None], attend)[:, 0]  # [B, D]
        return self.frame_from_hidden(slots, h)

    def frame_from_hidden(self, slots: Tensor, h: Tensor) -> Tensor:
        """Sample one frame from slow hidden states h [B, D]."""
        m, ids = self.model, self.cfg.ids
        idx = self.sampling.sample_main(slots, m.semantic_logits(h), self.n_semantic)
        token = torch.where(idx < self.n_semantic, idx + ids.semantic_start,
                            torch.full_like(idx, ids.im_end))
        # c0 is the semantic index (0 for <|im_end|>, as the reference clamps it).
        code = torch.where(idx < self.n_semantic, idx, torch.zeros_like(idx))
        B = h.shape[0]
        fkv = self.fast_kv
        m.forward_fast(h[:, None], 0, fkv.at(0, B))  # position 0: the slow hidden state; output unused
        codes = [code]
        for j in range(1, self.cfg.num_codebooks):
            logits = m.forward_fast(m.fast_embeddings(code)[:, None], j, fkv.at(j, B))
            code = self.sampling.sample_fast(slots, logits, j)
            codes.append(code)
        self.sampling.advance(slots)
        return torch.stack([token, *codes], dim=1)
