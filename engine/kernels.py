"""Thin wrappers over rtvoice's CUDA kernels (csrc/), each with a pure-torch fallback.

The wrappers check shapes and dtypes strictly (the seed's lesson: a silent reshape or dtype
promotion of the repetition window corrupts it and sounds like a worse model), then call the
compiled op on CUDA tensors when the extension is available, or the fallback otherwise.

    python -m engine.kernels --bench     # kernel vs fallback timing on this machine
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None}


def extension_available() -> bool:
    """Build (once) and load the CUDA extension; False on CPU-only machines or build errors."""
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    with _lock:
        if _state["loaded"] is not None:
            return bool(_state["loaded"])
        ok = False
        if os.environ.get("RTVOICE_CUDA_KERNELS", "1") != "0" and torch.cuda.is_available() \
                and (CSRC / "ops.cpp").is_file():
            try:
                from torch.utils.cpp_extension import load

                major, minor = torch.cuda.get_device_capability()
                load(name="rtvoice_kernels", sources=[str(CSRC / "ops.cpp"),
                                                      str(CSRC / "prev_tokens.cu")],
                     extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},"
                                               f"code=sm_{major}{minor}"],
                     verbose=False)
                ok = hasattr(torch.ops.rtvoice_kernels, "prev_tokens_shift_inplace")
                log.info("rtvoice CUDA kernels loaded (sm_%d%d)", major, minor)
            except Exception as e:  # no nvcc, no headers: the fallbacks are exact
                log.warning("rtvoice CUDA kernels unavailable (%s); using the torch fallbacks", e)
        _state["loaded"] = ok
        return ok


def _check_prev_tokens(prev: Tensor, next_tokens: Tensor) -> None:
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


def _prev_tokens_shift_torch(prev: Tensor, next_tokens: Tensor) -> None:
    prev[:, :-1] = prev[:, 1:].clone()
    prev[:, -1] = next_tokens


def prev_tokens_shift_inplace(prev: Tensor, next_tokens: Tensor) -> None:
    """prev int32 [bs, W, cw] <- window shifted left by one, next_tokens int32 [bs, cw] last."""
    _check_prev_tokens(prev, next_tokens)
    if prev.shape[1] == 0:
        return
    if prev.is_cuda and extension_available():
        torch.ops.rtvoice_kernels.prev_tokens_shift_inplace(prev, next_tokens)
    else:
        _prev_tokens_shift_torch(prev, next_tokens)


def _bench() -> None:
    import time

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for bs in (1, 64, 128):
        prev = torch.randint(0, 4096, (bs, 16, 10), dtype=torch.int32, device=dev)
        nxt = torch.randint(0, 4096, (bs, 10), dtype=torch.int32, device=dev)
        for name, fn in (("kernel" if dev == "cuda" else "wrapper", prev_tokens_shift_inplace),
                         ("torch", _prev_tokens_shift_torch)):
            for _ in range(10):
                fn(prev, nxt)
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(1000):
                fn(prev, nxt)
            if dev == "cuda":
                torch.cuda.synchronize()
            print(f"prev_tokens_shift bs={bs:4d} {name:7s} {1e6 * (time.perf_counter() - t) / 1000:8.2f} us")


if __name__ == "__main__":
    import sys

    if "--bench" in sys.argv:
        _bench()
    else:
        print(__doc__)
