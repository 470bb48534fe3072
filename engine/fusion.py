"""Fused elementwise ops for the decode hot path, applied by the runner (the model keeps the
plain math in engine/model.py and calls it through `OPS`).

`enable("compile")` swaps each op for a `torch.compile`d version of the very same function
(inductor fuses the float32 upcast, the reductions and the casts into one kernel per op:
RMSNorm ~8 launches -> 1, q/k norm + interleaved RoPE ~36 -> 1-2, SiLU*mul 2 -> 1), which
matters because a frame step of S2-Pro is ~4,000 launches when left unfused. `disable()`
restores the reference functions. Results agree with the reference within float rounding
(tests/test_cuda.py checks it on the device).
"""

from __future__ import annotations

import logging

import torch

from . import model

log = logging.getLogger(__name__)

_REFERENCE = {name: getattr(model.Ops, name) for name in
              ("rms_norm", "add_rms_norm", "norm_rope_qk", "silu_mul")}
_state = {"mode": "reference"}


def enable(mode: str = "compile") -> str:
    """Switch the model's elementwise ops to fused versions; returns the mode in effect."""
    if mode == "reference":
        disable()
        return "reference"
    if mode != "compile":
        raise ValueError(f"unknown fusion mode {mode!r}; use 'compile' or 'reference'")
    if _state["mode"] == "compile":
        return "compile"
    for name, fn in _REFERENCE.items():
        setattr(model.OPS, name, torch.compile(fn, dynamic=True, fullgraph=True))
    _state["mode"] = "compile"
    log.info("fused elementwise ops enabled (torch.compile)")
    return "compile"


def disable() -> None:
    for name, fn in _REFERENCE.items():
        setattr(model.OPS, name, fn)
    _state["mode"] = "reference"


def mode() -> str:
    return _state["mode"]
