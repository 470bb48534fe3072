"""The decode step's per-row bookkeeping around the model, as pure tensor functions: which
rows run and where they write, the RAS choice between two draws, the frame's token ids, and
the rows' state after the frame. Written out as torch ops each is a handful of one-element
kernels per step (~30 launches of a batch-1 frame step on the H200); engine/ops.py hands the
runner compiled versions (a fused kernel per output size each, same values) when it compiles
the others, and with csrc's extension built `ras_inputs`, `frame_tokens` and `step_end` as
one launch each (engine/kernels/step_book.py, csrc/bookkeeping.cu: 15 launches -> 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor


def step_begin(active: Tensor, pos: Tensor, tables: Tensor, block_size: int,
               scratch: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows 0..B-1 at a step's start: active [B] bool, pos [B], tables [B, MB] -> (was [B]:
    a copy of active, which the step changes; the positions the step runs, 0 for inactive
    rows; the block each row writes [B], the scratch block for inactive rows, so that blocks
    being prefilled or now held by another sequence are never touched)."""
    was = active.clone()
    p = torch.where(was, pos, 0)
    block = tables.gather(1, (p // block_size)[:, None])[:, 0]
    return was, p, torch.where(was, block, scratch)


def step_end(columns: Sequence[Tensor], was: Tensor, next_col: Tensor, pos: Tensor,
             frames_left: Tensor, active: Tensor, draw_step: Tensor, im_end: int) -> Tensor:
    """Rows' state after the step's frame columns (1+K tensors [B]: token, code 0..K-1):
    next_col [B, 1+K], pos, frames_left, active and the sampler's draw_step [B] (views of
    the runner's and the sampler's rows) are updated in place; every row's draw_step
    advances (as `SlotSampling.advance`), a row stops at <|im_end|> or when its frame budget runs
    out. -> [B, 1+K+2]: frame, was_active, stopped (int64)."""
    frames = torch.stack(list(columns), dim=1)  # [B, 1+K]
    next_col.copy_(torch.where(was[:, None], frames, next_col))
    pos.add_(was)
    frames_left.sub_(was.long())
    draw_step.add_(1)
    stop = was & ((frames[:, 0] == im_end) | (frames_left <= 0))
    active.copy_(was & ~stop)
    return torch.cat([frames, was[:, None].long(), stop[:, None].long()], dim=1)


def frame_tokens(idx: Tensor, n_semantic: int, semantic_start: int, im_end: int,
                 table: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The main draw idx [B] over [semantic 0..n-1, <|im_end|>] -> (token ids [B], code 0
    [B]: the semantic index, 0 for <|im_end|> as the reference clamps it, and the fast AR's
    first input [B, 2, D]: position 0 the slow hidden state h [B, D], position 1 code 0's
    row of `table` [R, D], put together in the same launch)."""
    semantic = idx < n_semantic
    code = torch.where(semantic, idx, 0)
    x = torch.stack([h, F.embedding(code, table)], dim=1)
    return torch.where(semantic, idx + semantic_start, im_end), code, x


def ras_inputs(logits: Tensor, temperature: Tensor, ras_temperature: Tensor, top_p: Tensor,
               ras_top_p: Tensor, top_k: Tensor, seed: Tensor,
               step: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The draw's inputs for the main token and its RAS candidate as one batch of 2B rows:
    logits [B, V] twice, then per row the main settings for the first B and the RAS ones
    (temperature 0 stays greedy) for the next B, the same seeds and steps."""
    ras_t = torch.where(temperature == 0, 0.0, ras_temperature)
    return (torch.cat([logits, logits]), torch.cat([temperature, ras_t]),
            torch.cat([top_p, ras_top_p]), torch.cat([top_k, top_k]),
            torch.cat([seed, seed]), torch.cat([step, step]))


def ras_choose(both: Tensor, window: Tensor, ras_window: Tensor, step: Tensor,
               n_semantic: int) -> tuple[Tensor, Tensor, Tensor]:
    """Repetition-aware choice. both [2B]: the main draws, then the RAS draws; window [B, W]
    the last W main tokens (newest last, -1 empty); ras_window [B] how many of them count;
    step [B] -> (chosen [B]: the RAS draw where the main one is semantic and already in the
    counted window, else the main one; that condition [B]; the token to push [B, 1] int32:
    -1 at step 0, whose frame (the prefill's) never enters the window)."""
    B = both.shape[0] // 2
    main, high = both[:B], both[B:]
    W = window.shape[1]
    live = torch.arange(W, device=window.device)[None, :] >= (W - ras_window)[:, None]
    condition = ((window == main[:, None]) & live).any(dim=-1) & (main < n_semantic)
    chosen = torch.where(condition, high, main)
    return chosen, condition, torch.where(step > 0, chosen, -1).to(torch.int32)[:, None]


@dataclass(frozen=True, slots=True)
class Bookkeeping:
    """The functions above as the runner calls them (the reference ones by default)."""

    step_begin: Callable[..., tuple[Tensor, Tensor, Tensor]] = step_begin
    step_end: Callable[..., Tensor] = step_end
    frame_tokens: Callable[..., tuple[Tensor, Tensor, Tensor]] = frame_tokens
    ras_inputs: Callable[..., tuple[Tensor, ...]] = ras_inputs
    ras_choose: Callable[..., tuple[Tensor, Tensor, Tensor]] = ras_choose

    @classmethod
    def built(cls, wrap: Callable[[str, Callable[..., object]], Callable[..., object]]
              ) -> Bookkeeping:
        """Every function through `wrap(name, fn)` (engine/fusion.py's `compiled`)."""
        ref = cls()
        return cls(**{f.name: wrap(f.name, getattr(ref, f.name)) for f in fields(cls)})
