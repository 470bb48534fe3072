"""Fused versions of the model's ops, for engine/ops.py to hand to an engine.

- `compiled(name, fn)`: a `torch.compile`d version of the very same function (inductor fuses
  the float32 upcast, the reductions and the casts into one kernel per op: RMSNorm ~8
  launches -> 1, q/k norm + interleaved RoPE ~36 -> 1-2, SiLU*mul 2 -> 1, a
  top-k/top-p/temperature/exponential-race draw ~35 -> ~6), which matters because a frame
  step of S2-Pro is ~4,000 launches when left unfused. Results agree with the reference
  within float rounding (tests/test_cuda.py checks it on the device).
- `pack_ffn(model)` lays each FFN's W1 and W3 out as consecutive halves of one buffer (same
  values), so the FFN's input projection is one GEMM (`packed`).
- `gathered_rows(w, rows)`: a contiguous copy of some row ranges of a weight, so a head over
  scattered rows of the tied embedding (the semantic slice and <|im_end|>) is one GEMM.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .quant import BLOCK, Fp8Linear, Fp8Weight, dequantize_fp8, rowwise_fp8

log = logging.getLogger(__name__)

# Keep every bf16 rounding the reference does (e.g. after the q/k norm, before RoPE): by
# default inductor may keep float32 intermediates, which changes bf16 results.
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
# Each op sees a few ranks/dtypes (decode rows, prefill chunks, q/k heads): dynamo must be
# allowed that many specialisations of one function.
_RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit to what the fused ops need, for the calling
    thread: dynamo's config is process-wide up to torch 2.11 and per thread from 2.12 on
    (the engine's prefill and decode threads would keep the default 8, and a fused op
    recompiled there past it would fall back to the reference for good). It is only ever
    raised here, never lowered, and decides no kernel choice."""
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit"):
        if getattr(torch._dynamo.config, knob, _RECOMPILE_LIMIT) < _RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, knob, _RECOMPILE_LIMIT)


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` as a function with a code object of its own: dynamo keeps its compiled graphs,
    and counts recompiles against the limit, per code object, whichever torch.compile
    wrapper called it."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"own_cache needs a plain Python function, got {type(fn).__name__}")
    copy = types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name),
                              fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    copy.__doc__, copy.__module__ = fn.__doc__, fn.__module__
    copy.__annotations__ = dict(fn.__annotations__)
    return copy


def compiled(name: str, fn: Callable[..., Any], *, own_cache: bool = False) -> Callable[..., Any]:
    """`fn` compiled by inductor (dynamic shapes, one graph); if compiling it ever fails (a new
    shape past the recompile limit, a backend error) the call logs once and `fn` runs from
    then on, except inside a CUDA-graph capture, where it raises. `own_cache`: compiled
    graphs and recompile budget of its own, not shared with other compiled wrappers of
    `fn` (dynamo keys both on the code object)."""
    if own_cache:
        fn = _own_code(fn, name)
    fused = torch.compile(fn, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS)
    state = {"ok": True}
    limits = threading.local()  # this op's calling threads that have the raised limit

    def call(*args: Any, **kwargs: Any) -> Any:
        if not getattr(limits, "raised", False):
            _allow_recompiles()
            limits.raised = True
        if state["ok"]:
            try:
                return fused(*args, **kwargs)
            except Exception:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # never fall back silently inside a graph capture
                state["ok"] = False
                log.exception("fused op %s failed; using the reference implementation", name)
        return fn(*args, **kwargs)

    call.__name__ = f"compiled_{name}"
    return call


def _adjacent(a: Tensor, b: Tensor) -> Tensor | None:
    """[a; b] as one tensor when b's rows follow a's in one buffer."""
    if not (a.is_contiguous() and b.is_contiguous() and a.shape == b.shape) \
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() \
            or b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
        return None
    return a.as_strided((2 * a.shape[0], a.shape[1]), (a.shape[1], 1))


def packed(w1: Tensor | Fp8Weight, w3: Tensor | Fp8Weight) -> Tensor | Fp8Weight | None:
    """W1 and W3 as one [2I, D] matrix when they are consecutive rows of one buffer (for FP8
    weights: their values and their block scales both; I a multiple of the scale block)."""
    if isinstance(w1, Fp8Weight) and isinstance(w3, Fp8Weight):
        if w1.q.shape[0] % BLOCK:
            return None
        q, s = _adjacent(w1.q, w3.q), _adjacent(w1.scale, w3.scale)
        if q is None or s is None:
            return None
        d = (_adjacent(w1.dense, w3.dense)
             if w1.dense is not None and w3.dense is not None else None)
        rw = None
        if w1.rowwise is not None and w3.rowwise is not None:
            rq = _adjacent(w1.rowwise[0], w3.rowwise[0])
            rs = _adjacent(w1.rowwise[1][:, None], w3.rowwise[1][:, None])
            rw = (rq, rs[:, 0]) if rq is not None and rs is not None else None
        return Fp8Weight(q, s, d, rw)
    if isinstance(w1, Tensor) and isinstance(w3, Tensor):
        return _adjacent(w1, w3)
    return None


def derived(store: dict, name: object, w: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
    """``make(w)``, made once and kept in ``store[name]`` (a module's or the weight's
    ``__dict__``): inference weights do not change, and a new weight tensor, new storage,
    dtype, device or an in-place edit remakes it. One made inside a CUDA graph capture (the
    graph's pool) is not kept."""
    key = (id(w), w._version, w.data_ptr(), w.dtype, w.device)
    cached = store.get(name)
    if cached is None or cached[0] != key:
        value = make(w.detach())
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return value
        cached = store[name] = (key, value)
    return cached[1]


@torch.no_grad()
def gathered_rows(w: Tensor, rows: tuple[tuple[int, int], ...]) -> Tensor:
    """[w[a0:b0]; w[a1:b1]; ...] as one contiguous matrix (a head over scattered rows of a
    tied embedding as one GEMM), kept on the weight (`derived`)."""
    return derived(w.__dict__.setdefault("_gathered_rows", {}), rows, w,
                   lambda v: torch.cat([v[a:b] for a, b in rows]).contiguous())


@torch.no_grad()
def pack_ffn(m: nn.Module) -> int:
    """Re-lay every SwiGLU FFN's W1 and W3 (modules with w1/w2/w3 linears, dense or FP8) as
    consecutive halves of one buffer (same values, same memory), so `packed` reads them with
    one GEMM. Returns the FFNs packed (0 when already packed)."""
    n = 0
    for ff in m.modules():
        kinds = {type(getattr(ff, w, None)) for w in ("w1", "w3")}
        if not hasattr(ff, "w2") or len(kinds) != 1 or kinds.pop() not in (nn.Linear, Fp8Linear):
            continue
        w1, w3 = ff.w1.weight, ff.w3.weight
        if packed(w1, w3) is not None:
            continue
        if isinstance(ff.w1, Fp8Linear):
            if ff.w1.qweight.shape[0] % BLOCK:
                continue  # the scales of W1's last block row would mix with W3's
            for buf in ("qweight", "weight_scale_inv", "dense_weight", "rowwise_q",
                        "rowwise_scale"):
                a, b = getattr(ff.w1, buf), getattr(ff.w3, buf)
                if a is None or b is None:  # no such copies (yet)
                    continue
                both = torch.cat([a, b])
                setattr(ff.w1, buf, both[: a.shape[0]])
                setattr(ff.w3, buf, both[a.shape[0]:])
        else:
            both = torch.cat([w1, w3])
            ff.w1.weight = nn.Parameter(both[: w1.shape[0]], requires_grad=False)
            ff.w3.weight = nn.Parameter(both[w1.shape[0]:], requires_grad=False)
        n += 1
    return n


def _copy_groups(m: nn.Module, has_copy: Callable[[Fp8Linear], bool],
                 pays: Callable[[int, int], bool] | None
                 ) -> Iterator[tuple[list[Fp8Linear], Fp8Weight]]:
    """The FP8 linears of `m` without a copy (`has_copy`) in the groups a copy is made for,
    those whose [N, K] `pays` (default: all): each packed W1|W3 as one (judged by its packed
    shape: one copy, split like their values, so `packed` still gives one GEMM), then every
    other linear alone."""
    halves: set[int] = set()  # W1, W3 of packed FFNs: never copied one by one
    for ff in m.modules():
        w1, w3 = getattr(ff, "w1", None), getattr(ff, "w3", None)
        if (isinstance(w1, Fp8Linear) and isinstance(w3, Fp8Linear)
                and not has_copy(w1) and not has_copy(w3)):
            both = packed(w1.weight, w3.weight)
            if both is None:
                continue
            halves.update((id(w1), id(w3)))
            if pays is None or pays(*both.shape):
                yield [w1, w3], both
    for mod in m.modules():
        if (isinstance(mod, Fp8Linear) and not has_copy(mod) and id(mod) not in halves
                and (pays is None or pays(*mod.qweight.shape))):
            yield [mod], mod.weight


def _add_copies(m: nn.Module, pays: Callable[[int, int], bool] | None,
                has_copy: Callable[[Fp8Linear], bool],
                make: Callable[[Fp8Weight], tuple[Tensor, ...]],
                keep: Callable[[Fp8Linear, tuple[Tensor, ...] | None], None]) -> int:
    """`make` a copy of each group's weight (`_copy_groups`; tensors with a row per output
    row) and `keep` each linear's rows of it; on running out of memory every copy made here
    is dropped again (`keep(mod, None)`) and the error re-raised. Returns the bytes added."""
    made: list[Fp8Linear] = []
    added = 0
    try:
        for mods, w in _copy_groups(m, has_copy, pays):
            parts = make(w)
            at = 0
            for mod in mods:
                n = mod.qweight.shape[0]
                keep(mod, tuple(t[at: at + n] for t in parts))
                made.append(mod)
                at += n
            added += sum(t.numel() * t.element_size() for t in parts)
    except torch.cuda.OutOfMemoryError:
        for mod in made:
            keep(mod, None)
        raise
    return added


@torch.no_grad()
def add_dense_copies(m: nn.Module, dtype: torch.dtype = torch.bfloat16,
                     pays: Callable[[int, int], bool] | None = None) -> int:
    """Give the FP8 linears of `m` a dequantised copy of their weight in `dtype` (the
    `Fp8Weight.dense` the linears run large batches through): those whose [N, K] `pays`
    (default: all), a packed W1|W3 judged by its packed shape and given adjacent copies, so
    `packed` still gives one GEMM. Layers that have one keep it. On running out of memory the
    copies made here are dropped again and the error re-raised. Returns the bytes added."""
    def keep(mod: Fp8Linear, parts: tuple[Tensor, ...] | None) -> None:
        mod.dense_weight = None if parts is None else parts[0]

    return _add_copies(m, pays, lambda mod: mod.dense_weight is not None,
                       lambda w: (dequantize_fp8(w, dtype),), keep)


def add_dense_copies_where_faster(m: nn.Module, plan: Any,
                                  fp8_activations: bool = False) -> int:
    """`add_dense_copies` for the FP8 linears of `m` whose shape `plan` (a
    kernels.linear.LinearPlan, or None: none) measured faster in bf16 at some batch size
    (`dense_pays`, against the W8A8 rows too with `fp8_activations`; a packed W1|W3 by its
    packed shape, which the FFN runs). Returns the bytes added."""
    if plan is None:
        return 0
    return add_dense_copies(m, torch.bfloat16,
                            pays=lambda n, k: plan.dense_pays(n, k, fp8_activations))


@torch.no_grad()
def add_rowwise_copies(m: nn.Module, pays: Callable[[int, int], bool] | None = None) -> int:
    """Give the FP8 linears of `m` whose [N, K] `pays` (default: all) their rowwise-scaled
    copy (`quant.rowwise_fp8`: the `Fp8Weight.rowwise` of the W8A8 GEMM), a packed W1|W3 by
    its packed shape and as one buffer split in halves, so `packed` gives one GEMM. Layers
    that have one keep it; on running out of memory the copies made here are dropped again
    and the error re-raised. Returns the bytes added."""
    def keep(mod: Fp8Linear, parts: tuple[Tensor, ...] | None) -> None:
        mod.rowwise_q, mod.rowwise_scale = (None, None) if parts is None else parts

    return _add_copies(m, pays, lambda mod: mod.rowwise_q is not None,
                       lambda w: rowwise_fp8(w), keep)
