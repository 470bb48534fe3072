"""Building and loading csrc/ as one torch extension (namespace `torch.ops.rtvoice_kernels`).

The extension is compiled on first use on a CUDA machine with
`torch.utils.cpp_extension.load` (cached under `~/.cache/torch_extensions`). Whether it built
is a fact of the machine, found once per process; which kernels an engine *uses* is decided
by the `Ops` it is built with (engine/ops.py), never here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# one .cu file per kernel family, registered in ops.cpp
KERNEL_FILES = ("prev_tokens.cu", "decode_attention.cu", "sampling.cu", "activation.cu",
                "linear.cu", "bookkeeping.cu")
KERNEL_OPS = ("prev_tokens_shift_inplace", "decode_attention", "sample_topk", "snake",
              "bias_residual", "snake_cat", "linear_small_m", "book_ras_inputs",
              "book_frame_tokens", "book_step_end")


@functools.cache
def extension_available() -> bool:
    """Build (once per process) and load the CUDA extension; False on CPU-only machines or
    build errors (no nvcc, no headers: every wrapper then runs its torch fallback)."""
    if not torch.cuda.is_available() or not (CSRC / "ops.cpp").is_file():
        return False
    try:
        from torch.utils.cpp_extension import load

        major, minor = torch.cuda.get_device_capability()
        load(name="rtvoice_kernels",
             sources=[str(CSRC / f) for f in ("ops.cpp", *KERNEL_FILES)],
             extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},"
                                       f"code=sm_{major}{minor}",
                                f"-DRTV_HEADERS_HASH={_headers_hash()}"],
             verbose=False)
        ok = all(hasattr(torch.ops.rtvoice_kernels, op) for op in KERNEL_OPS)
        log.info("rtvoice CUDA kernels loaded (sm_%d%d)", major, minor)
        return ok
    except Exception as e:
        log.warning("rtvoice CUDA kernels unavailable (%s); using the torch fallbacks", e)
        return False


def _headers_hash() -> str:
    """A hash of csrc's headers: torch's extension cache hashes the sources and flags only,
    so the headers' hash goes into the flags (a changed header rebuilds)."""
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


CURRENT_DEVICE = "current"  # recorded tables: compare their device with the current GPU's


def current_device_name() -> str | None:
    """The current CUDA device's name (what recorded kernel tables are keyed by), or None
    without one."""
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.get_device_name()
    except Exception:  # a broken CUDA setup: no comparison possible
        return None


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (its index, or the current one)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def triton_available() -> bool:
    """Triton importable and a CUDA device present (the Triton kernels' precondition)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def kernel_ok(use: bool, *ts: torch.Tensor) -> bool:
    """Whether a wrapper runs its kernel: asked to (`use`), CUDA tensors, extension built."""
    return use and all(t.is_cuda for t in ts) and extension_available()
