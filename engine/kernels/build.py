"""Building and loading csrc/ as one torch extension (namespace `torch.ops.rtvoice_kernels`).

The extension is compiled on first use on a CUDA machine with
`torch.utils.cpp_extension.load` (cached under `~/.cache/torch_extensions`), by a compiler
that links the shared C++ runtime (`toolchain`: a static copy crashes the process on an error
message with a number in it). Whether it built
is a fact of the machine, found once per process; which kernels an engine *uses* is decided
by the `Ops` it is built with (engine/ops.py), never here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from pathlib import Path

import torch

from . import toolchain

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# one .cu file per kernel family, registered in ops.cpp
KERNEL_FILES = ("prev_tokens.cu", "decode_attention.cu", "sampling.cu", "activation.cu",
                "linear.cu", "bookkeeping.cu")
KERNEL_OPS = ("prev_tokens_shift_inplace", "decode_attention", "sample_topk", "snake",
              "bias_residual", "snake_cat", "linear_small_m", "book_ras_inputs",
              "book_frame_tokens", "book_step_end")


_BUILD_LOCK = threading.Lock()


def extension_available() -> bool:
    """Build (once per process) and load the CUDA extension; False on CPU-only machines or
    build errors (no nvcc, no headers, no compiler that links the shared C++ runtime: every
    wrapper then runs its torch fallback)."""
    return extension_path() is not None


@functools.cache
def extension_path() -> str | None:
    """`extension_available`'s work: the loaded extension's file, or None. One build at a
    time, once (it sets CC / CXX in the process environment while torch builds)."""
    with _BUILD_LOCK:
        return _build()


@functools.cache
def _build() -> str | None:
    if not torch.cuda.is_available() or not (CSRC / "ops.cpp").is_file():
        return None
    try:
        from torch.utils.cpp_extension import load

        tc, passed_over = toolchain.choose()
        for why in passed_over:
            log.warning("csrc build: %s; trying the next compiler", why)
        if tc is None:
            log.warning("rtvoice CUDA kernels unavailable: no C++ compiler here links the "
                        "shared libstdc++ (install the system's g++, or point CXX at one); "
                        "using the torch fallbacks")
            return None
        major, minor = torch.cuda.get_device_capability()
        compilers = f"-DRTV_TOOLCHAIN={tc.key}"  # both object kinds' flags: a build of its own
        with tc.environ():
            mod = load(name="rtvoice_kernels",
                       sources=[str(CSRC / f) for f in ("ops.cpp", *KERNEL_FILES)],
                       extra_cflags=[compilers],
                       extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},"
                                                 f"code=sm_{major}{minor}",
                                          f"-DRTV_HEADERS_HASH={_headers_hash()}", compilers],
                       verbose=False)
        if not toolchain.links_shared_cxx_runtime(mod.__file__):
            log.warning("rtvoice CUDA kernels built by %s carry their own copy of libstdc++ "
                        "(%s): loaded, but their error checks could crash the process, so no "
                        "engine uses them (the torch fallbacks run); point CXX at a compiler "
                        "that links the shared libstdc++", tc.cxx, mod.__file__)
            return None
        missing = [op for op in KERNEL_OPS if not hasattr(torch.ops.rtvoice_kernels, op)]
        if missing:
            log.warning("rtvoice CUDA kernels lack %s (a stale build?); using the torch "
                        "fallbacks", ", ".join(missing))
            return None
        log.info("rtvoice CUDA kernels loaded (sm_%d%d, built by %s)", major, minor, tc.cxx)
        return str(mod.__file__)
    except Exception as e:
        log.warning("rtvoice CUDA kernels unavailable (%s); using the torch fallbacks", e)
        return None


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


def device_slug(name: str) -> str:
    """A GPU's name as a file-name part: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def recorded_device(path: Path) -> str | None:
    """The GPU a kernel table file records ("device"), or None (no file, not a JSON object,
    no such key): the loaders report malformed files themselves."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    device = data.get("device") if isinstance(data, dict) else None
    return device if isinstance(device, str) else None


def device_table(base: Path, device: str | None = CURRENT_DEVICE) -> Path:
    """Where `device`'s recorded kernel table of `base`'s kind lives (the current GPU by
    default): `base` itself where it was recorded on that device kind (or records none, or
    there is no device to compare, as on a CPU), else its per-device sibling
    `<stem>.<slug>.json` (e.g. linear_table.nvidia-h100-80gb-hbm3.json), whether or not that
    exists yet: the loaders read it, the benches' recordings are installed there. Each GPU
    kind keeps its own timings (a table from another kind's choices does not carry over)."""
    if device == CURRENT_DEVICE:
        device = current_device_name()
    if device is None:
        return base
    sibling = base.with_name(f"{base.stem}.{device_slug(device)}{base.suffix}")
    if sibling.is_file():
        return sibling
    recorded = recorded_device(base)
    return base if recorded is None or recorded == device else sibling


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
