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
    import torch._dynamo
    import torch._inductor.config

    # Keep every bf16 rounding the reference does (e.g. after the q/k norm, before RoPE):
    # by default inductor may keep float32 intermediates, which changes bf16 results.
    torch._inductor.config.emulate_precision_casts = True

    # Each op sees a few ranks/dtypes (decode rows, prefill chunks, q/k heads): allow them all.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    for name, fn in _REFERENCE.items():
        setattr(model.OPS, name, _guarded(name, fn, torch.compile(fn, dynamic=True, fullgraph=True)))
    _state["mode"] = "compile"
    log.info("fused elementwise ops enabled (torch.compile)")
    return "compile"


def _guarded(name: str, ref, fused):  # type: ignore[no-untyped-def]
    """Call the fused op; if compiling it ever fails (a new shape past the recompile limit,
    a backend error), log once and use the reference function from then on."""
    state = {"ok": True}

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        if state["ok"]:
            try:
                return fused(*args, **kwargs)
            except Exception:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # never fall back silently inside a graph capture
                state["ok"] = False
                log.exception("fused op %s failed; using the reference implementation", name)
        return ref(*args, **kwargs)

    return call


def disable() -> None:
    for name, fn in _REFERENCE.items():
        setattr(model.OPS, name, fn)
    _state["mode"] = "reference"


def mode() -> str:
    return _state["mode"]
