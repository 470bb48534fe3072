"""The decode step's bookkeeping in one launch each (csrc/bookkeeping.cu): `ras_inputs`,
`frame_tokens` and `step_end` with engine/bookkeeping.py's signatures and results (integer
and copy work: bit-equal). Compiled by inductor those functions are one kernel per output
size (15 launches of a batch-1 frame step on the H200, docs/PERF.md); these are three.

Each wrapper checks what the kernel needs and runs the torch function (engine/bookkeeping.py)
where the kernel does not take the call: off CUDA, without the extension, `kernel=False`,
or inputs of other dtypes or layouts (the torch function then decides what they mean).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import bookkeeping as ref
from .build import kernel_ok

__all__ = ["frame_tokens", "frame_tokens_takes", "ras_inputs", "ras_inputs_takes", "step_end",
           "step_end_takes"]

MAX_COLUMNS = 32  # csrc/bookkeeping.cu's kMaxColumns: the frame's 1 + K ids
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _vectors(n: int, dtype: torch.dtype, device: torch.device, *ts: Tensor) -> bool:
    return all(t.dim() == 1 and t.shape[0] == n and t.dtype == dtype and t.device == device
               and t.is_contiguous() for t in ts)


def ras_inputs_takes(logits: Tensor, temperature: Tensor, ras_temperature: Tensor,
                     top_p: Tensor, ras_top_p: Tensor, top_k: Tensor, seed: Tensor, step: Tensor,
                     *, kernel: bool = True) -> bool:
    """Whether `ras_inputs` runs the kernel on these: logits [B, V] of a float dtype with unit
    column stride, the settings contiguous float32 / int64 [B] on its device."""
    d = logits.device
    B = logits.shape[0] if logits.dim() == 2 else -1
    return (kernel_ok(kernel, logits) and B >= 0 and logits.dtype in _FLOATS
            and logits.stride(1) == 1
            and _vectors(B, torch.float32, d, temperature, ras_temperature, top_p, ras_top_p)
            and _vectors(B, torch.int64, d, top_k, seed, step))


def frame_tokens_takes(idx: Tensor, table: Tensor, h: Tensor, *, kernel: bool = True) -> bool:
    """Whether `frame_tokens` runs the kernel on these: idx contiguous int64 [B], table a
    contiguous float [R, D], h [B, D] of its dtype with unit column stride, one device."""
    B = idx.shape[0] if idx.dim() == 1 else -1
    return (kernel_ok(kernel, idx, table, h) and B >= 0
            and _vectors(B, torch.int64, idx.device, idx) and table.dim() == 2
            and table.is_contiguous() and table.dtype in _FLOATS
            and table.device == idx.device and h.device == idx.device
            and h.dim() == 2 and tuple(h.shape) == (B, table.shape[1])
            and h.dtype == table.dtype and h.stride(1) == 1)


def step_end_takes(columns: Sequence[Tensor], was: Tensor, next_col: Tensor, pos: Tensor,
                   frames_left: Tensor, active: Tensor, draw_step: Tensor, *,
                   kernel: bool = True) -> bool:
    """Whether `step_end` runs the kernel on these: 1..MAX_COLUMNS contiguous int64 [B]
    columns (the draws' outputs; a column of a [B, 1+K] tensor is strided: the torch
    function runs), was / active bool and pos / frames_left / draw_step int64 contiguous [B],
    next_col int64 [B, 1+K] with unit column stride and rows that do not overlap, one
    device."""
    cols = list(columns)
    B = was.shape[0] if was.dim() == 1 else -1
    d = was.device
    return (kernel_ok(kernel, was) and B >= 0 and 1 <= len(cols) <= MAX_COLUMNS
            and _vectors(B, torch.bool, d, was, active)
            and _vectors(B, torch.int64, d, *cols, pos, frames_left, draw_step)
            and next_col.dim() == 2 and tuple(next_col.shape) == (B, len(cols))
            and next_col.dtype == torch.int64 and next_col.device == d
            and next_col.stride(1) == 1 and (B <= 1 or next_col.stride(0) >= len(cols)))


def ras_inputs(logits: Tensor, temperature: Tensor, ras_temperature: Tensor, top_p: Tensor,
               ras_top_p: Tensor, top_k: Tensor, seed: Tensor, step: Tensor, *,
               kernel: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`bookkeeping.ras_inputs`: the main and RAS draws' inputs as one batch of 2B rows."""
    if not ras_inputs_takes(logits, temperature, ras_temperature, top_p, ras_top_p, top_k,
                            seed, step, kernel=kernel):
        return ref.ras_inputs(logits, temperature, ras_temperature, top_p, ras_top_p, top_k,
                              seed, step)
    B = logits.shape[0]
    out = (logits.new_empty(2 * B, logits.shape[1]), temperature.new_empty(2 * B),
           top_p.new_empty(2 * B), top_k.new_empty(2 * B), seed.new_empty(2 * B),
           step.new_empty(2 * B))
    torch.ops.rtvoice_kernels.book_ras_inputs(logits, temperature, ras_temperature, top_p,
                                              ras_top_p, top_k, seed, step, *out)
    return out


def frame_tokens(idx: Tensor, n_semantic: int, semantic_start: int, im_end: int, table: Tensor,
                 h: Tensor, *, kernel: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`bookkeeping.frame_tokens`: the frame's token ids, code 0 and the fast AR's first input
    [B, 2, D]."""
    if not frame_tokens_takes(idx, table, h, kernel=kernel):
        return ref.frame_tokens(idx, n_semantic, semantic_start, im_end, table, h)
    B = idx.shape[0]
    token, code = idx.new_empty(B), idx.new_empty(B)
    x = h.new_empty(B, 2, h.shape[1])
    torch.ops.rtvoice_kernels.book_frame_tokens(idx, table, h, n_semantic, semantic_start,
                                                im_end, token, code, x)
    return token, code, x


def step_end(columns: Sequence[Tensor], was: Tensor, next_col: Tensor, pos: Tensor,
             frames_left: Tensor, active: Tensor, draw_step: Tensor, im_end: int, *,
             kernel: bool = True) -> Tensor:
    """`bookkeeping.step_end`: the rows' state after the frame (updated in place) -> [B, 1+K+2]
    frame, was_active, stopped."""
    cols = list(columns)
    if not step_end_takes(cols, was, next_col, pos, frames_left, active, draw_step,
                          kernel=kernel):
        return ref.step_end(cols, was, next_col, pos, frames_left, active, draw_step, im_end)
    out = torch.empty(was.shape[0], len(cols) + 2, dtype=torch.int64, device=was.device)
    torch.ops.rtvoice_kernels.book_step_end(cols, was, next_col, pos, frames_left, active,
                                            draw_step, im_end, out)
    return out
