"""`snake`, `snake_cat`, `bias_residual` (csrc/activation.cu): the codec's pointwise ops in
one pass each, and their torch formulas (the reference: the codec's layers compute these).

x [B, C, T], channels-first (last dim contiguous for the kernels) or channels-last (stored
as [B, T, C]: the codec's NHWC convs' layout; results keep it, densely); alpha and bias [C]
or [1, C, 1] of x's dtype. The kernels do float32 math in the reference's rounding order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .build import kernel_ok


# ---------------------------------------------------------------------- the torch formulas
def snake_formula(x: Tensor, alpha: Tensor) -> Tensor:
    """Snake ``x + sin(alpha x)^2 / (alpha + 1e-9)``, x [B, C, T], alpha [1, C, 1], written as
    descript-audio-codec computes it (reciprocal, then multiply): what the fixtures were
    made with."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def snake_torch(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """Snake of x (+ bias: a conv's bias folded in) with alpha/bias [C] or [1, C, 1]."""
    a = alpha.reshape(1, -1, 1)
    return snake_formula(x if bias is None else x + bias.reshape(1, -1, 1), a)


def snake_cat_torch(tail: Tensor, x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """A streaming conv's input: its saved tail [B, C, P], then the activated new samples
    (in x's layout)."""
    return cat_time(tail, snake_torch(x, alpha, bias))


def bias_residual_torch(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """x + (y + bias): a residual unit's sum, its last conv's bias added to the conv's output
    first (the reference's rounding order)."""
    return x + (y + bias.reshape(1, -1, 1))


# ---------------------------------------------------------------------- layouts
def is_channels_last(x: Tensor) -> bool:
    """x [B, C, T] stored as [B, T, C] (channels contiguous; streams may lie further apart: a
    slice along T of a longer tensor), where that differs from channels-first (C, T > 1)."""
    if x.dim() != 3:
        return False
    _, C, T = x.shape
    return C > 1 and T > 1 and x.stride(1) == 1 and x.stride(2) == C and x.stride(0) >= C * T


def empty_like_layout(x: Tensor, length: int) -> Tensor:
    """An empty [B, C, length] tensor of x's dtype and device, channels-last where x is."""
    B, C, _ = x.shape
    if is_channels_last(x):
        return torch.empty((B, length, C), dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty((B, C, length), dtype=x.dtype, device=x.device)


def cat_time(tail: Tensor, x: Tensor) -> Tensor:
    """[tail | x] along T ([B, C, P] then [B, C, T]), in x's layout (torch.cat would make a
    channels-last x channels-first)."""
    if not is_channels_last(x):
        return torch.cat([tail, x], dim=-1)
    out = empty_like_layout(x, tail.shape[-1] + x.shape[-1])
    out[..., : tail.shape[-1]] = tail
    out[..., tail.shape[-1]:] = x
    return out


# ---------------------------------------------------------------------- checks
def _check_channels(x: Tensor, t: Tensor, what: str, op: str) -> None:
    if t.numel() != x.shape[1]:
        raise ValueError(f"{op}: {what} has {t.numel()} values for {x.shape[1]} channels")
    if t.dtype != x.dtype or t.device != x.device:
        raise TypeError(f"{op}: {what} ({t.dtype}, {t.device}) must match x "
                        f"({x.dtype}, {x.device})")


def check_snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> None:
    if x.dim() != 3:
        raise ValueError(f"snake needs x [B, C, T], got shape {list(x.shape)}")
    _check_channels(x, alpha, "alpha", "snake")
    if bias is not None:
        _check_channels(x, bias, "bias", "snake")


def _channel_args(use: bool, alpha: Tensor, bias: Tensor | None,
                  *ts: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """alpha and bias as the kernels take them (contiguous [C]), or None where the torch
    formula runs instead (not asked to, CPU tensors, other dtypes, no extension, layouts
    the kernels do not take: every operand channels-last, or every one with a contiguous
    last dim)."""
    a = alpha.reshape(-1)
    b = bias.reshape(-1) if bias is not None else None
    layout_ok = (all(is_channels_last(t) for t in ts)
                 or all(t.stride(-1) == 1 for t in ts))
    if (kernel_ok(use, *ts) and layout_ok
            and ts[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
            and a.is_contiguous() and (b is None or b.is_contiguous())):
        return a, b
    return None


# ---------------------------------------------------------------------- wrappers
def _snake_into(x: Tensor, alpha: Tensor, bias: Tensor | None, out: Tensor, kernel: bool) -> None:
    args = _channel_args(kernel, alpha, bias, x)
    if args is not None:
        torch.ops.rtvoice_kernels.snake(x, *args, out)
    else:
        out.copy_(snake_torch(x, alpha, bias))


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None, *, kernel: bool = True) -> Tensor:
    """The codec's Snake activation (of x + bias, when given) in one pass."""
    check_snake(x, alpha, bias)
    out = empty_like_layout(x, x.shape[-1])
    _snake_into(x, alpha, bias, out, kernel)
    return out


def snake_cat(tail: Tensor, x: Tensor, alpha: Tensor, bias: Tensor | None = None, *,
              kernel: bool = True) -> Tensor:
    """torch.cat([tail, snake(x + bias)], -1) with the activation written straight into its
    place in the result (no separate concatenation pass): a streaming causal conv's input,
    its saved tail [B, C, P] followed by the activated new samples [B, C, T]."""
    check_snake(x, alpha, bias)
    if tail.dim() != 3 or tail.shape[:2] != x.shape[:2] or tail.dtype != x.dtype \
            or tail.device != x.device:
        raise ValueError(f"snake_cat: tail {list(tail.shape)} {tail.dtype} {tail.device} "
                         f"does not fit x {list(x.shape)} {x.dtype} {x.device}")
    P = tail.shape[-1]
    out = empty_like_layout(x, P + x.shape[-1])
    # channels-last x: the kernel reads the tail in any layout (a few samples)
    args = _channel_args(kernel, alpha, bias, *((x,) if is_channels_last(x) else (x, tail)))
    if args is not None:
        # one flat pass with 16-byte stores (channels-first: the per-row path would start
        # each row's new samples P elements in, 2-wide or scalar)
        torch.ops.rtvoice_kernels.snake_cat(tail, x, *args, out)
        return out
    out[..., :P] = tail
    _snake_into(x, alpha, bias, out[..., P:], kernel)
    return out


def bias_residual(x: Tensor, y: Tensor, bias: Tensor, *, kernel: bool = True) -> Tensor:
    """x + (y + bias) in one pass. x, y [B, C, T] of one dtype; bias [C] or [1, C, 1]."""
    if x.dim() != 3 or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"bias_residual: x {list(x.shape)} {x.dtype} and y {list(y.shape)} "
                         f"{y.dtype} must be [B, C, T] tensors of one shape, dtype and device")
    _check_channels(x, bias, "bias", "bias_residual")
    args = _channel_args(kernel, bias, None, x, y)
    if args is None:
        return bias_residual_torch(x, y, bias)
    out = empty_like_layout(x, x.shape[-1])
    torch.ops.rtvoice_kernels.bias_residual(x, y, args[0], out)
    return out
