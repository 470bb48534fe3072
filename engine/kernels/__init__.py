"""Thin Python wrappers over rtvoice's CUDA kernels (csrc/), laid out like csrc/: one module
per kernel family (its contract check, its pure-torch fallback, its wrapper), one build
module. Each wrapper checks shapes and dtypes strictly, then runs the compiled op on CUDA
tensors when the extension is built and `kernel=True`, or the fallback otherwise. Which
kernels an engine uses is decided once, by the `Ops` it is built with (engine/ops.py).

Benchmarks: `python -m bench_latency.kernel_bench`.
"""

from .build import extension_available

__all__ = ["extension_available"]
