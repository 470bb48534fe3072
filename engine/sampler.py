"""Batched sampling with per-row parameters and no host synchronisation: per-request
settings, and the per-slot state on the device (parameters, seeds, step counters, the
repetition-aware window). The draw itself — the reference's rule with counter-based noise,
so a request's draws depend only on its own seed and step — is
`engine.kernels.sampling.sample` (or the csrc kernel, when the engine's ops say so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .bookkeeping import Bookkeeping
from .kernels.prev_tokens import prev_tokens_shift_checked
from .kernels.sampling import TOPK_MAX, draw_then_embed, exponential_noise, sample

__all__ = ["STREAM_FAST", "STREAM_MAIN", "STREAM_RAS", "TOPK_MAX", "SamplingParams",
           "SlotSampling", "exponential_noise", "sample"]

# Noise streams: independent draws per purpose within one frame.
STREAM_MAIN, STREAM_RAS, STREAM_FAST = 1, 2, 16


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling settings (defaults seen in the S2 reference)."""

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    ras_window: int = 10  # repetition-aware sampling window (0 disables RAS)
    ras_temperature: float = 1.0
    ras_top_p: float = 0.9
    seed: int | None = None  # None: drawn by the engine

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 5.0):
            raise ValueError(f"temperature must be in [0, 5], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and 1 <= self.top_k <= TOPK_MAX):
            raise ValueError(f"top_k must be an int in [1, {TOPK_MAX}], got {self.top_k!r}")
        if not (0 <= self.ras_window <= 64):
            raise ValueError(f"ras_window must be in [0, 64], got {self.ras_window}")
        if not (0.0 < self.ras_temperature <= 5.0 and 0.0 < self.ras_top_p <= 1.0):
            raise ValueError("ras_temperature must be in (0, 5] and ras_top_p in (0, 1]")
        if self.seed is not None and not (0 <= self.seed < 2**31):
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0, top_p=1.0, top_k=1)


class SlotSampling:
    """Per-slot sampling state held on the device: parameters, seeds, step counters and the
    RAS window of recent main tokens (-1 = empty). `draw` is the sampling rule's
    implementation and `shift` the window update (the engine's ops; the torch versions by
    default)."""

    def __init__(self, n_slots: int, device: torch.device | str, max_window: int = 16, *,
                 draw: Callable[..., Tensor] = sample,
                 draw_embed: Callable[..., tuple[Tensor, Tensor]] | None = None,
                 shift: Callable[[Tensor, Tensor], None] | None = None,
                 book: Bookkeeping | None = None) -> None:
        d = torch.device(device)
        # draw_embed: the draw with the drawn ids' table rows (None: `draw`, then the lookup —
        # never another rule than `draw`'s)
        self.draw = draw
        self.draw_embed = draw_embed or functools.partial(draw_then_embed, draw)
        self.book = book or Bookkeeping()
        self.shift = shift or prev_tokens_shift_checked
        self.temperature = torch.zeros(n_slots, device=d)
        self.top_p = torch.ones(n_slots, device=d)
        self.top_k = torch.ones(n_slots, dtype=torch.int64, device=d)
        self.ras_temperature = torch.ones(n_slots, device=d)
        self.ras_top_p = torch.ones(n_slots, device=d)
        self.ras_window = torch.zeros(n_slots, dtype=torch.int64, device=d)
        self.seed = torch.zeros(n_slots, dtype=torch.int64, device=d)
        self.step = torch.zeros(n_slots, dtype=torch.int64, device=d)
        # int32 [slots, W]: the contract of csrc's prev_tokens_shift_inplace (with cw = 1)
        self.window = torch.full((n_slots, max_window), -1, dtype=torch.int32, device=d)
        self.max_window = max_window
        self.last_ras_condition = torch.zeros(0, dtype=torch.bool, device=d)
        self._stream_ids: dict[tuple[int, torch.device, int], Tensor] = {}

    def assign(self, slot: int, p: SamplingParams, seed: int) -> None:
        if p.ras_window > self.max_window:
            raise ValueError(f"ras_window {p.ras_window} exceeds the engine's {self.max_window}")
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = p.top_k
        self.ras_temperature[slot] = p.ras_temperature
        self.ras_top_p[slot] = p.ras_top_p
        self.ras_window[slot] = p.ras_window
        self.seed[slot] = seed
        self.step[slot] = 0
        self.window[slot] = -1

    def begin_turn_dev(self, slot: int, seed: Tensor) -> None:
        """A new generation on this slot: fresh noise stream (seed already on the device, so
        no host sync), empty RAS window."""
        self.seed[slot] = seed
        self.step[slot] = 0
        self.window[slot] = -1

    def sample_main(self, slots: Tensor | slice, logits: Tensor, n_semantic: int) -> Tensor:
        """Main-token choice with repetition-aware sampling. logits [B, n_semantic+1] -> idx [B]
        (index n_semantic means <|im_end|>). Updates the window of `slots`; their step is
        advanced once per frame, after every draw of it (`advance`, or the decode step's
        `Bookkeeping.step_end`)."""
        seed, step = self.seed[slots], self.step[slots]
        # RAS: a second candidate (temperature 1.0, top-p 0.9, same top-k); taken when the main
        # token is semantic and already among the last `ras_window` main tokens. The frame
        # made by the prefill never enters the window (step 0 does not push). Both draws run
        # as one batch of 2B rows (one top-k, one launch sequence), each with its own stream.
        B = logits.shape[0]
        both = self.draw(*self.book.ras_inputs(
            logits, self.temperature[slots], self.ras_temperature[slots], self.top_p[slots],
            self.ras_top_p[slots], self.top_k[slots], seed, step), self._streams(B, logits.device))
        chosen, self.last_ras_condition, nxt = self.book.ras_choose(
            both, self.window[slots], self.ras_window[slots], step, n_semantic)
        # Push the chosen token (nxt [B, 1]); a row at step 0 (its prefill frame) pushes -1
        # instead, which leaves its freshly reset all -1 window unchanged.
        if isinstance(slots, slice):  # dense rows: the window rows are a contiguous view
            self.shift(self.window[slots].unsqueeze(-1), nxt)
        else:
            rows = self.window[slots].unsqueeze(-1).contiguous()
            self.shift(rows, nxt)
            self.window[slots] = rows[..., 0]
        return chosen

    def _streams(self, B: int, device: torch.device, fast: int = -1) -> Tensor:
        """Noise stream ids: [2B] MAIN for the first B rows and RAS for the next B, or (`fast`
        = a codebook) [B] of that codebook's. Cached per shape, so a graphed step reads them
        instead of filling them each step — but made afresh inside a CUDA graph capture (a
        fill there runs only when that graph replays: the cache would hold garbage until
        then for every other user)."""
        key = (B, device, fast)
        ids = self._stream_ids.get(key)
        if ids is None:
            if fast >= 0:
                ids = torch.full((B,), STREAM_FAST + fast, dtype=torch.int64, device=device)
            else:
                ids = torch.full((2 * B,), STREAM_RAS, dtype=torch.int64, device=device)
                ids[:B] = STREAM_MAIN
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._stream_ids[key] = ids
        return ids

    def sample_fast(self, slots: Tensor | slice, logits: Tensor, codebook: int) -> Tensor:
        """A residual codebook: logits [B, 4096] -> codes [B] (no bias, no RAS)."""
        return self.draw(logits, self.temperature[slots], self.top_p[slots], self.top_k[slots],
                         self.seed[slots], self.step[slots],
                         self._streams(logits.shape[0], logits.device, codebook))

    def sample_fast_embed(self, slots: Tensor | slice, logits: Tensor, codebook: int,
                          table: Tensor) -> tuple[Tensor, Tensor]:
        """`sample_fast`, and the drawn codes' rows of `table` [R, D] (the next codebook's
        input embedding) -> (codes [B], rows [B, D]): one launch with csrc's kernel."""
        return self.draw_embed(logits, self.temperature[slots], self.top_p[slots],
                               self.top_k[slots], self.seed[slots], self.step[slots],
                               self._streams(logits.shape[0], logits.device, codebook), table)

    def advance(self, slots: Tensor | slice) -> None:
        self.step[slots] += 1
