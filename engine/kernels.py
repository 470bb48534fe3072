"""Thin wrappers over rtvoice's CUDA kernels (csrc/), each with a pure-torch fallback.

The wrappers check shapes and dtypes strictly (the seed's lesson: a silent reshape or dtype
promotion of the repetition window corrupts it and sounds like a worse model), then call the
compiled op on CUDA tensors when the extension is available, or the fallback otherwise.

    python -m engine.kernels --bench     # kernel vs fallback timing on this machine
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KERNEL_FILES = ("prev_tokens.cu", "decode_attention.cu", "sampling.cu", "activation.cu")  # per family
KERNEL_OPS = ("prev_tokens_shift_inplace", "decode_attention", "sample_topk", "snake", "bias_residual",
              "snake_cat")
_lock = threading.Lock()
# "splits": decode_attention's default position split (1: none; 0: automatic, small batches
# spread over more blocks; engine.fusion.split_kv sets it, process-wide)
_state: dict[str, object] = {"loaded": None, "splits": 1}


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
                load(name="rtvoice_kernels",
                     sources=[str(CSRC / f) for f in ("ops.cpp", *KERNEL_FILES)],
                     extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},"
                                               f"code=sm_{major}{minor}"],
                     verbose=False)
                ok = all(hasattr(torch.ops.rtvoice_kernels, op) for op in KERNEL_OPS)
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


# ---------------------------------------------------------------------- decode attention
DECODE_ATTENTION_HEAD_DIMS = (40, 48, 64, 128)  # head_dim / 8 in the .cu switch
DECODE_ATTENTION_GROUPS = (1, 2, 4)  # query heads per kv head


def _check_decode_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                            v_cache: Tensor, wslot: Tensor, pos: Tensor) -> None:
    if q.dim() != 3 or k_new.dim() != 3 or v_new.dim() != 3:
        raise ValueError(f"q must be [B, H, D] and k_new/v_new [B, Hkv, D]; got "
                         f"{list(q.shape)}, {list(k_new.shape)}, {list(v_new.shape)}")
    B, H, D = q.shape
    Hkv = k_new.shape[1]
    if k_new.shape != v_new.shape or k_new.shape[0] != B or k_new.shape[2] != D or H % Hkv:
        raise ValueError(f"k_new/v_new {list(k_new.shape)}/{list(v_new.shape)} do not fit q "
                         f"{list(q.shape)} (same B and D, H a multiple of Hkv)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] < B \
            or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"caches must be [N >= {B}, {Hkv}, S, {D}]; got {list(k_cache.shape)} "
                         f"and {list(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (written in place)")
    dts = {t.dtype for t in (q, k_new, v_new, k_cache, v_cache)}
    if len(dts) != 1 or next(iter(dts)) not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k_new, v_new and the caches must share one float dtype, got {dts}")
    if wslot.dtype != torch.int64 or pos.dtype != torch.int64 or wslot.shape != (B,) \
            or pos.shape != (B,):
        raise TypeError(f"wslot and pos must be int64 [{B}], got {wslot.dtype} "
                        f"{list(wslot.shape)} and {pos.dtype} {list(pos.shape)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"{name}'s heads and dims must be packed (strides "
                             f"{t.stride()}); only its rows may be strided")
    if len({t.device for t in (q, k_new, v_new, k_cache, v_cache, wslot, pos)}) != 1:
        raise ValueError("decode_attention: all tensors must be on one device")


def _decode_attention_torch(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                            v_cache: Tensor, wslot: Tensor, pos: Tensor, span: int) -> Tensor:
    B, H, D = q.shape
    k_cache[wslot, :, pos] = k_new
    v_cache[wslot, :, pos] = v_new
    # Row b reads its own slot b; position pos[b] comes from k_new/v_new (as the kernel does).
    keys = k_cache[:B, :, :span].float().clone()  # [B, Hkv, S, D]
    vals = v_cache[:B, :, :span].float().clone()
    rows = torch.arange(B, device=q.device)
    inside = pos < span
    keys[rows[inside], :, pos[inside]] = k_new[inside].float()
    vals[rows[inside], :, pos[inside]] = v_new[inside].float()
    rep = H // k_new.shape[1]
    keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) / math.sqrt(D)
    live = torch.arange(span, device=q.device)[None, :] <= pos[:, None]  # [B, S]
    probs = torch.softmax(scores.masked_fill(~live[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", probs, vals).to(q.dtype)


def decode_attention_supports(head_dim: int, n_head: int, n_kv_heads: int) -> bool:
    """Whether the built kernel handles these attention shapes (on a CUDA device)."""
    return (head_dim in DECODE_ATTENTION_HEAD_DIMS
            and n_head // n_kv_heads in DECODE_ATTENTION_GROUPS and extension_available())


def decode_attention_available(q: Tensor, k_heads: int) -> bool:
    """Whether `decode_attention` would run the CUDA kernel for a query like `q` [B, H, ..., D]
    with `k_heads` kv heads."""
    return q.is_cuda and decode_attention_supports(q.shape[-1], q.shape[1], k_heads)


def decode_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                     wslot: Tensor, pos: Tensor, span: int, splits: int | None = None) -> Tensor:
    """One query position per row, grouped-query attention, the new k/v stored in place.

    q [B, H, D]; k_new/v_new [B, Hkv, D]; k_cache/v_cache [N, Hkv, S, D] (written at
    (wslot[b], :, pos[b])); wslot/pos int64 [B]. Row b attends to positions 0..pos[b] of
    cache row b, the last one being k_new/v_new. wslot[b] must be b or a slot no row reads
    (>= B), and pos < S: values are not checked (that would need a device sync). `span`
    (> every pos) bounds the fallback's reads; the kernel reads exactly 0..pos[b].
    `splits` (kernel only; the result is the same): each row's positions read by this many
    blocks (at most 32) and merged (1: one block), 0 = as many as fill the GPU at small
    batches; None = the process-wide setting (`engine.fusion.split_kv`).
    Returns out [B, H, D] in q's dtype.
    """
    _check_decode_attention(q, k_new, v_new, k_cache, v_cache, wslot, pos)
    if splits is None:
        splits = int(_state["splits"])  # type: ignore[call-overload]
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
        raise ValueError(f"decode_attention: splits must be an int >= 0 (0: automatic), "
                         f"got {splits!r}")
    if decode_attention_available(q, k_new.shape[1]):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.ops.rtvoice_kernels.decode_attention(q, k_new, v_new, k_cache, v_cache, wslot,
                                                   pos, out, splits)
        return out
    return _decode_attention_torch(q, k_new, v_new, k_cache, v_cache, wslot, pos, span)


# ---------------------------------------------------------------------- sampling
SAMPLE_TOPK_MAX_V = 8192


def _check_sample(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                  seed: Tensor, step: Tensor, stream: Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"logits must be float32 or bfloat16 [B, V], got {logits.dtype} "
                        f"{list(logits.shape)}")
    B = logits.shape[0]
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_p", top_p, torch.float32),
                        ("top_k", top_k, torch.int64), ("seed", seed, torch.int64),
                        ("step", step, torch.int64), ("stream", stream, torch.int64)):
        if t.dtype != dt or t.shape != (B,):
            raise TypeError(f"{name} must be {dt} [{B}], got {t.dtype} {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")


def sample_topk(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
                step: Tensor, stream: int | Tensor) -> Tensor:
    """engine.sampler.sample in one launch per batch (csrc/sampling.cu): the same rule and
    noise, equal results but for float rounding at top-p boundaries and race near-ties.
    Falls back to engine.sampler.sample off CUDA, for V > 8192, or without the extension."""
    from .sampler import sample

    if isinstance(stream, int):
        stream = torch.full((logits.shape[0],), stream, dtype=torch.int64, device=logits.device)
    _check_sample(logits, temperature, top_p, top_k, seed, step, stream)
    if (logits.is_cuda and logits.shape[1] <= SAMPLE_TOPK_MAX_V and logits.stride(1) == 1
            and extension_available()):
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        torch.ops.rtvoice_kernels.sample_topk(logits, temperature.contiguous(), top_p.contiguous(),
                                              top_k.contiguous(), seed.contiguous(),
                                              step.contiguous(), stream.contiguous(), out)
        return out
    return sample(logits, temperature, top_p, top_k, seed, step, stream)


# ---------------------------------------------------------------------- codec pointwise ops
def _check_channels(x: Tensor, t: Tensor, what: str, op: str) -> None:
    if t.numel() != x.shape[1]:
        raise ValueError(f"{op}: {what} has {t.numel()} values for {x.shape[1]} channels")
    if t.dtype != x.dtype or t.device != x.device:
        raise TypeError(f"{op}: {what} ({t.dtype}, {t.device}) must match x "
                        f"({x.dtype}, {x.device})")


def _check_snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> None:
    if x.dim() != 3:
        raise ValueError(f"snake needs x [B, C, T], got shape {list(x.shape)}")
    _check_channels(x, alpha, "alpha", "snake")
    if bias is not None:
        _check_channels(x, bias, "bias", "snake")


def snake_torch(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """The fallback: the codec's own reference ops (engine.codec.layers.CodecOps), of x + bias
    when a conv's bias is folded in; alpha and bias [C] or [1, C, 1]."""
    from .codec.layers import CodecOps

    a = alpha.reshape(1, -1, 1)
    return CodecOps.snake(x, a) if bias is None else CodecOps.snake_bias(x, a, bias)


def _kernel_ok(*ts: Tensor) -> bool:
    return all(t.is_cuda and t.stride(-1) == 1 for t in ts) \
        and ts[0].dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and extension_available()


def _channel_args(alpha: Tensor, bias: Tensor | None,
                  *ts: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """alpha and bias as the kernels take them (contiguous [C]), or None where the torch
    fallback runs instead (CPU tensors, other dtypes, no extension, strided last dims)."""
    a = alpha.reshape(-1)
    b = bias.reshape(-1) if bias is not None else None
    if _kernel_ok(*ts) and a.is_contiguous() and (b is None or b.is_contiguous()):
        return a, b
    return None


def _snake_into(x: Tensor, alpha: Tensor, bias: Tensor | None, out: Tensor) -> None:
    args = _channel_args(alpha, bias, x)
    if args is not None:
        torch.ops.rtvoice_kernels.snake(x, *args, out)
    else:
        out.copy_(snake_torch(x, alpha, bias))


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """The codec's Snake activation (of x + bias, when given) in one pass
    (csrc/activation.cu) on CUDA, the torch formula elsewhere. x [B, C, T]; alpha and bias
    [C] or [1, C, 1] of x's dtype."""
    _check_snake(x, alpha, bias)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _snake_into(x, alpha, bias, out)
    return out


def snake_cat(tail: Tensor, x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """torch.cat([tail, snake(x + bias)], -1) with the activation written straight into its
    place in the result (no separate concatenation pass): a streaming causal conv's input,
    its saved tail [B, C, P] followed by the activated new samples [B, C, T]."""
    _check_snake(x, alpha, bias)
    if tail.dim() != 3 or tail.shape[:2] != x.shape[:2] or tail.dtype != x.dtype \
            or tail.device != x.device:
        raise ValueError(f"snake_cat: tail {list(tail.shape)} {tail.dtype} {tail.device} "
                         f"does not fit x {list(x.shape)} {x.dtype} {x.device}")
    P = tail.shape[-1]
    out = torch.empty((*x.shape[:2], P + x.shape[-1]), dtype=x.dtype, device=x.device)
    args = _channel_args(alpha, bias, x, tail)
    if args is not None:
        # one flat pass with 16-byte stores (the per-row path would start each row's new
        # samples P elements in: 2-wide or scalar)
        torch.ops.rtvoice_kernels.snake_cat(tail, x, *args, out)
        return out
    out[..., :P] = tail
    _snake_into(x, alpha, bias, out[..., P:])
    return out


def bias_residual_torch(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """The fallback, the codec's reference op: x + (y + bias), a residual unit's output with
    its last conv's bias added to the conv's output first (the reference's rounding order)."""
    from .codec.layers import CodecOps

    return CodecOps.bias_residual(x, y, bias)


def bias_residual(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """x + (y + bias) in one pass (csrc/activation.cu) on CUDA, torch elsewhere. x, y
    [B, C, T] of one dtype; bias [C] or [1, C, 1]."""
    if x.dim() != 3 or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"bias_residual: x {list(x.shape)} {x.dtype} and y {list(y.shape)} "
                         f"{y.dtype} must be [B, C, T] tensors of one shape, dtype and device")
    _check_channels(x, bias, "bias", "bias_residual")
    b = bias.reshape(-1)
    if not (_kernel_ok(x, y) and b.is_contiguous()):
        return bias_residual_torch(x, y, bias)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.rtvoice_kernels.bias_residual(x, y, b, out)
    return out


def _timed(fn, args: tuple, n: int, cuda: bool) -> float:  # type: ignore[no-untyped-def]
    import time

    for _ in range(5):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / n


def _bench() -> None:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    kind = "kernel" if cuda and extension_available() else "wrapper"
    for bs in (1, 64, 128):
        prev = torch.randint(0, 4096, (bs, 16, 10), dtype=torch.int32, device=dev)
        nxt = torch.randint(0, 4096, (bs, 10), dtype=torch.int32, device=dev)
        for name, fn in ((kind, prev_tokens_shift_inplace), ("torch", _prev_tokens_shift_torch)):
            us = _timed(fn, (prev, nxt), 1000, cuda)
            print(f"prev_tokens_shift bs={bs:4d} {name:7s} {us:8.2f} us")
    # decode attention at S2-Pro's slow-AR shapes: 32 query heads, 8 kv heads, head_dim 128
    dt = torch.bfloat16 if cuda else torch.float32
    for bs, pos in ((1, 200), (1, 1000), (64, 200), (64, 1000)):
        S = 1024
        q = torch.randn(bs, 32, 128, device=dev, dtype=dt)
        kn, vn = (torch.randn(bs, 8, 128, device=dev, dtype=dt) for _ in range(2))
        kc, vc = (torch.randn(bs + 1, 8, S, 128, device=dev, dtype=dt) for _ in range(2))
        ws = torch.arange(bs, device=dev)
        ps = torch.full((bs,), pos, device=dev)
        for name, fn in ((kind, lambda *a: decode_attention(*a, splits=1)),
                         (f"{kind}-split", lambda *a: decode_attention(*a, splits=0)),
                         ("torch", _decode_attention_torch)):
            us = _timed(fn, (q, kn, vn, kc, vc, ws, ps, pos + 1), 200 if cuda else 5, cuda)
            print(f"decode_attention bs={bs:3d} pos={pos:5d} {name:12s} {us:9.2f} us")
    from .sampler import sample

    for bs in (1, 64, 128):  # a main-token draw: 4,096 semantic tokens + <|im_end|>
        logits = 3 * torch.randn(bs, 4097, device=dev)
        args = (logits, torch.full((bs,), 0.8, device=dev), torch.full((bs,), 0.8, device=dev),
                torch.full((bs,), 30, device=dev), torch.arange(bs, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev),
                torch.ones(bs, dtype=torch.int64, device=dev))
        for name, fn in ((kind, sample_topk), ("torch", sample)):
            us = _timed(fn, args, 200 if cuda else 20, cuda)
            print(f"sample_topk bs={bs:4d} {name:7s} {us:9.2f} us")
    # the codec's Snake at its widest streaming shapes (64 streams x 8 frames)
    for C, T in ((96, 16384), (192, 8192), (768, 256)):
        x = torch.randn(64 if cuda else 2, C, T, device=dev, dtype=dt)
        alpha = torch.rand(C, device=dev, dtype=dt) + 0.5
        for name, fn in ((kind, snake), ("torch", snake_torch)):
            us = _timed(fn, (x, alpha), 100 if cuda else 3, cuda)
            gbs = 2 * x.numel() * x.element_size() / us / 1e3
            print(f"snake C={C:4d} T={T:5d} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")
        for P in (1, 54):  # a streaming conv's input [tail | snake(x)]: transposed / dilated
            tail = torch.randn(x.shape[0], C, P, device=dev, dtype=dt)
            for name, fn in ((kind, snake_cat),
                             ("torch", lambda t, x, a: torch.cat([t, snake_torch(x, a)], -1))):
                us = _timed(fn, (tail, x, alpha), 100 if cuda else 3, cuda)
                gbs = 2 * (x.numel() + tail.numel()) * x.element_size() / us / 1e3
                print(f"snake_cat C={C:4d} T={T:5d} P={P:2d} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")
        y, bias = torch.randn_like(x), torch.randn(C, device=dev, dtype=dt)
        for name, fn in ((kind, bias_residual), ("torch", bias_residual_torch)):
            us = _timed(fn, (x, y, bias), 100 if cuda else 3, cuda)
            gbs = 3 * x.numel() * x.element_size() / us / 1e3
            print(f"bias_residual C={C:4d} T={T:5d} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")


if __name__ == "__main__":
    import sys

    if "--bench" in sys.argv:
        _bench()
    else:
        print(__doc__)
