"""Host -> device copies with no host synchronisation: host values go through fresh pinned
memory (an earlier copy from a reused buffer may still be in flight) and are copied
asynchronously on the current stream. The one way the engine sends small inputs (slot
state, graph inputs) to the device; on a CPU the same calls are plain copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def host(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed host tensor to fill and `stage`, pinned when headed for a CUDA `device`."""
    return torch.zeros(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


def stage(dst: Tensor, src: Tensor | Sequence[int] | Sequence[Sequence[int]]) -> None:
    """dst (a device buffer) <- src (host values of dst's shape), without a host sync."""
    if not isinstance(src, Tensor):
        src = torch.tensor(src, dtype=dst.dtype)
    if dst.is_cuda:
        dst.copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """A new device tensor holding `values`."""
    out = torch.empty(len(values), dtype=dtype, device=device)
    stage(out, values)
    return out
