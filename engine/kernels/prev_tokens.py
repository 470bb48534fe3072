"""`prev_tokens_shift_inplace` (csrc/prev_tokens.cu): shift a token window left by one and
append. The seed's lesson: a silent reshape or dtype promotion of the repetition window
corrupts it and sounds like a worse model, so the contract is checked strictly."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import kernel_ok


def check(prev: Tensor, next_tokens: Tensor) -> None:
    if prev.dtype != torch.int32 or next_tokens.dtype != torch.int32:
        raise TypeError(f"prev_tokens_shift_inplace needs int32 tensors, got prev {prev.dtype} "
                        f"and next_tokens {next_tokens.dtype}")
    if prev.dim() != 3 or next_tokens.dim() != 2:
        raise ValueError(f"prev must be [bs, W, cw] and next_tokens [bs, cw]; got "
                         f"{list(prev.shape)} and {list(next_tokens.shape)}")
    if prev.shape[0] != next_tokens.shape[0] or prev.shape[2] != next_tokens.shape[1]:
        raise ValueError(f"shape mismatch: prev {list(prev.shape)} vs next_tokens "
                         f"{list(next_tokens.shape)} (bs and cw must agree)")
    if prev.device != next_tokens.device:
        raise ValueError(f"tensors on different devices: {prev.device} and {next_tokens.device}")
    if not (prev.is_contiguous() and next_tokens.is_contiguous()):
        raise ValueError("prev and next_tokens must be contiguous (the window is updated in place)")


def prev_tokens_shift_torch(prev: Tensor, next_tokens: Tensor) -> None:
    """The fallback."""
    prev[:, :-1] = prev[:, 1:].clone()
    prev[:, -1] = next_tokens


def prev_tokens_shift_inplace(prev: Tensor, next_tokens: Tensor, *, kernel: bool = True) -> None:
    """prev int32 [bs, W, cw] <- window shifted left by one, next_tokens int32 [bs, cw] last.
    `kernel=False` runs the fallback."""
    check(prev, next_tokens)
    if prev.shape[1] == 0:
        return
    if kernel_ok(kernel, prev):
        torch.ops.rtvoice_kernels.prev_tokens_shift_inplace(prev, next_tokens)
    else:
        prev_tokens_shift_torch(prev, next_tokens)


def prev_tokens_shift_checked(prev: Tensor, next_tokens: Tensor) -> None:
    """The wrapper with the kernel off: the contract checked, the fallback run."""
    prev_tokens_shift_inplace(prev, next_tokens, kernel=False)
