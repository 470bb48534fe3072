"""Fused ops for the decode hot path, applied by the runner (the model keeps the plain math
in engine/model.py and calls it through `OPS`; the sampler through `SAMPLER_OPS`).

`enable("compile")` swaps each op for a `torch.compile`d version of the very same function
(inductor fuses the float32 upcast, the reductions and the casts into one kernel per op:
RMSNorm ~8 launches -> 1, q/k norm + interleaved RoPE ~36 -> 1-2, SiLU*mul 2 -> 1, a
top-k/top-p/temperature/exponential-race draw ~35 -> ~6), which matters because a frame step
of S2-Pro is ~4,000 launches when left unfused. It also swaps the FFN's input projection for
one GEMM over W1 and W3 when `pack_ffn(model)` has laid them out as one buffer. `disable()`
restores the reference functions. Results agree with the reference within float rounding
(tests/test_cuda.py checks it on the device).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from . import model, sampler

log = logging.getLogger(__name__)

_COMPILED = (("rms_norm", model.OPS), ("add_rms_norm", model.OPS), ("norm_rope_qk", model.OPS),
             ("silu_mul", model.OPS), ("sample", sampler.SAMPLER_OPS))
_REFERENCE = {**{name: getattr(type(holder), name) for name, holder in _COMPILED},
              "swiglu": model.Ops.swiglu, "linear": model.Ops.linear}
_HOLDER = {**{name: holder for name, holder in _COMPILED}, "swiglu": model.OPS,
           "linear": model.OPS}
_state: dict = {"mode": "reference", "compiled_sample": None}


def _packed(w1: Tensor, w3: Tensor) -> Tensor | None:
    """W1 and W3 as one [2I, D] matrix when they are consecutive rows of one buffer."""
    if not (w1.is_contiguous() and w3.is_contiguous() and w1.shape == w3.shape) \
            or w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr() \
            or w3.data_ptr() != w1.data_ptr() + w1.numel() * w1.element_size():
        return None
    return w1.as_strided((2 * w1.shape[0], w1.shape[1]), (w1.shape[1], 1))


def packed_swiglu(x: Tensor, w1: Tensor, w3: Tensor) -> Tensor:
    """model.swiglu with one GEMM when W1/W3 are packed (see `pack_ffn`)."""
    w13 = _packed(w1, w3)
    if w13 is None:
        return model.swiglu(x, w1, w3)
    h = model.OPS.linear(x, w13)  # [..., 2I]: the gate and the up projection side by side
    n = w1.shape[0]
    return model.OPS.silu_mul(h[..., :n], h[..., n:])


@torch.no_grad()
def pack_ffn(m: nn.Module) -> int:
    """Re-lay every FFN's W1 and W3 as consecutive halves of one buffer (same values, same
    memory), so `packed_swiglu` reads them with one GEMM. Returns the FFNs packed."""
    n = 0
    for ff in (mod for mod in m.modules() if isinstance(mod, model.FeedForward)):
        w1, w3 = ff.w1.weight, ff.w3.weight
        if _packed(w1, w3) is not None:
            continue
        both = torch.cat([w1, w3])
        ff.w1.weight = nn.Parameter(both[: w1.shape[0]], requires_grad=False)
        ff.w3.weight = nn.Parameter(both[w1.shape[0]:], requires_grad=False)
        n += 1
    return n


def enable(mode: str = "compile", *, sampler_kernel: bool = False) -> str:
    """Switch the model's elementwise ops to fused versions; returns the mode in effect.
    `sampler_kernel`: the sampler's draw as the csrc kernel (engine.kernels.sample_topk,
    when built) instead of its compiled version."""
    if mode == "reference":
        disable()
        return "reference"
    if mode != "compile":
        raise ValueError(f"unknown fusion mode {mode!r}; use 'compile' or 'reference'")
    if _state["mode"] == "compile":
        _set_kernels(sampler_kernel)
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
    for name, holder in _COMPILED:
        fn = _REFERENCE[name]
        setattr(holder, name, _guarded(name, fn, torch.compile(fn, dynamic=True, fullgraph=True)))
    model.OPS.swiglu = packed_swiglu
    _state["mode"] = "compile"
    _state["compiled_sample"] = sampler.SAMPLER_OPS.sample
    _set_kernels(sampler_kernel)
    log.info("fused elementwise ops enabled (torch.compile)")
    return "compile"


def _set_kernels(sampler_kernel: bool) -> None:
    from . import kernels

    built = sampler_kernel and kernels.extension_available()
    sampler.SAMPLER_OPS.sample = kernels.sample_topk if built else _state["compiled_sample"]


def split_kv(enabled: bool) -> bool:
    """Let csrc's decode_attention split each row's positions over more blocks when the batch
    is too small to fill the GPU (engine.kernels.decode_attention, splits=0), or read each row
    in one block (splits=1). Process-wide; set before the decode graphs are captured (a graph
    keeps the launch it captured). Returns the setting."""
    from . import kernels

    kernels._state["splits"] = 0 if enabled else 1
    return enabled


def codec_kernels(enabled: bool) -> bool:
    """Route the codec's pointwise ops (`engine.codec.layers.CODEC_OPS`) through csrc's
    one-pass kernels (engine.kernels.snake / snake_cat / bias_residual, with the streaming
    residual units' conv biases folded into them; the wrappers fall back to the torch
    formulas for CPU tensors) or back to the plain torch ops. Returns whether the kernels are
    in use. Process-wide, like the other fused ops: the engine built last decides."""
    from . import kernels
    from .codec import layers

    on = enabled and kernels.extension_available()
    layers.CODEC_OPS.snake = kernels.snake if on else layers.CodecOps.snake  # type: ignore[method-assign]
    layers.CODEC_OPS.snake_cat = (kernels.snake_cat if on  # type: ignore[method-assign]
                                  else layers.CodecOps.snake_cat)
    layers.CODEC_OPS.snake_bias = (kernels.snake if on  # type: ignore[method-assign]
                                   else layers.CodecOps.snake_bias)
    layers.CODEC_OPS.bias_residual = (kernels.bias_residual if on  # type: ignore[method-assign]
                                      else layers.CodecOps.bias_residual)
    layers.CODEC_OPS.fold_bias = on
    return on


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
        setattr(_HOLDER[name], name, fn)
    _state["mode"] = "reference"


def mode() -> str:
    return _state["mode"]
