"""FP8 weights: e4m3 values with one float32 scale per 128 x 128 block.

A linear layer's weight W [N, K] is held as `q` (float8_e4m3fn, [N, K], row-major: K is the
fastest axis) and `scale` (float32, [ceil(N/128), ceil(K/128)], row-major), with

    W[n, k] ~= float(q[n, k]) * scale[n // 128, k // 128]

(the fine-grained FP8 layout of DeepSeek-V3 and of Hugging Face's `fp8` quantisation
config, where the scale tensor is called `weight_scale_inv`). Each block's scale is its
largest |w| / 448, so every block uses e4m3's whole range.

`quantize_model` swaps a model's `nn.Linear` layers for `Fp8Linear` ones in place; the
model still calls `ops.linear(x, layer.weight)`, and `layer.weight` is then an `Fp8Weight`,
which the ops' linear (`linear` below is the reference) multiplies by dequantising. The
embeddings, norms and output heads stay in bf16: only the transformer layers' linears are
quantised unless told otherwise, and `keep` patterns hold chosen layers in bf16.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BLOCK = 128  # weight-scale block: 128 output rows x 128 input columns
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
# Linear layers quantised by default: every projection of the slow and fast AR's layers.
# Embeddings, norms, the tied semantic head and the fast AR's output head stay in bf16.
DEFAULT_QUANTISED = ("layers.*", "fast_layers.*")


@dataclass(frozen=True, slots=True, eq=False)
class Fp8Weight:
    """A linear layer's weight as e4m3 values `q` [N, K] and block scales `scale`
    [ceil(N/128), ceil(K/128)] (float32): W[n, k] = q[n, k] * scale[n // 128, k // 128].
    `dense`: the same W dequantised to bf16 (`dequantize_fp8(w, torch.bfloat16)`, exactly
    the weight `fp8_linear_torch` multiplies bf16 x by), kept where the engine runs large
    batches through the dense kernels (fusion.add_dense_copies); None: FP8 kernels only.
    `rowwise`: W requantised with one scale per row (`rowwise_fp8`: values [N, K] e4m3,
    scales [N]), kept where the engine runs large batches through the rowwise-scaled FP8
    GEMM with activations quantised per row (W8A8, only with `fp8_activations`;
    fusion.add_rowwise_copies); None: not made."""

    q: Tensor
    scale: Tensor
    dense: Tensor | None = None
    rowwise: tuple[Tensor, Tensor] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def check(self) -> None:
        """Raise ValueError naming what breaks the layout contract."""
        check_fp8(self.q, self.scale)


def scale_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // BLOCK), -(-k // BLOCK)


def check_fp8(q: Tensor, scale: Tensor, name: str = "weight") -> None:
    """The contract every FP8 path relies on: e4m3 [N, K] row-major, float32 scales
    [ceil(N/128), ceil(K/128)] row-major. A scale tensor saved in another layout (the K-major
    bug: right numbers, wrong order) has the same element count, so the shape is checked
    exactly and contiguity is required."""
    if q.dtype != FP8:
        raise ValueError(f"{name}: FP8 weights must be float8_e4m3fn, got {q.dtype}")
    if q.dim() != 2:
        raise ValueError(f"{name}: FP8 weights must be [N, K], got shape {tuple(q.shape)}")
    want = scale_shape(*q.shape)
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: block scales must be float32, got {scale.dtype}")
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: block scales of a {tuple(q.shape)} weight must have shape "
                         f"{want} (one per 128 x 128 block, row-major), got {tuple(scale.shape)}")
    if not (q.is_contiguous() and scale.is_contiguous()):
        raise ValueError(f"{name}: FP8 weights and their scales must be contiguous (row-major)")
    if q.device != scale.device:
        raise ValueError(f"{name}: weights on {q.device} but scales on {scale.device}")


@torch.no_grad()
def check_fp8_values(q: Tensor, scale: Tensor, name: str = "weight") -> None:
    """The values every FP8 kernel assumes (checked where weights are loaded, not per call):
    no e4m3 NaN code (0x7F / 0xFF: the kernels' conversions disagree on it, some reading
    +-480) and finite, non-negative block scales. `quantize_fp8` writes neither."""
    nan_codes = int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if nan_codes:
        raise ValueError(f"{name}: {nan_codes} FP8 values are NaN (e4m3 code 0x7F/0xFF): "
                         "requantise the layer from its bf16 weights (`rtvoice quantize`)")
    bad = ~torch.isfinite(scale) | (scale < 0)
    if bool(bad.any()):
        raise ValueError(f"{name}: {int(bad.sum())} block scales are negative or not finite "
                         f"(first at block {tuple(bad.nonzero()[0].tolist())}): requantise the "
                         "layer from its bf16 weights (`rtvoice quantize`)")


@torch.no_grad()
def quantize_fp8(w: Tensor) -> Fp8Weight:
    """W [N, K] (any float dtype) -> e4m3 values and per-128x128-block scales (amax / 448)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 takes a float [N, K] weight, got {w.dtype} "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    nb, kb = scale_shape(n, k)
    wf = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))  # zeros do not raise amax
    blocks = wf.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous()
    return Fp8Weight(q, scale.contiguous())


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32,
                   rows: int = 8 * BLOCK) -> Tensor:
    """The weight the FP8 values stand for, [N, K] in `dtype` (float32 math, one rounding),
    made `rows` rows (a multiple of the scale block) at a time: its float32 temporaries stay
    small (S2-Pro's packed w13 at once would take ~600 MB of them)."""
    if rows < 1 or rows % BLOCK:
        raise ValueError(f"dequantize_fp8: rows must be a positive multiple of {BLOCK}, "
                         f"got {rows}")
    n, k = w.q.shape
    out = torch.empty(n, k, dtype=dtype, device=w.q.device)
    for r in range(0, n, rows):
        q = w.q[r: r + rows]
        s = w.scale[r // BLOCK:].repeat_interleave(BLOCK, 0)[: q.shape[0]]
        out[r: r + rows] = q.float() * s.repeat_interleave(BLOCK, 1)[:, :k]
    return out


def fp8_linear_torch(x: Tensor, w: Fp8Weight) -> Tensor:
    """x [..., K] @ W^T with W given in FP8: the reference (dequantise, then a dense GEMM in
    x's dtype). Every FP8 kernel is checked against this."""
    return F.linear(x, dequantize_fp8(w, x.dtype))


@torch.no_grad()
def rowwise_fp8(w: Fp8Weight, rows: int = 8 * BLOCK) -> tuple[Tensor, Tensor]:
    """W's values requantised with one scale per output row, the operand layout of the
    rowwise-scaled FP8 GEMM (`torch._scaled_mm`: CUTLASS on sm_90): (q [N, K] e4m3, scale
    [N] float32, each row's largest |W| / 448) with W[n, k] ~= q[n, k] * scale[n]. A second
    rounding of the block-scaled values (3 mantissa bits, as the first); a row whose blocks
    span more than e4m3's range keeps fewer bits of its smallest ones. Made `rows` rows at a
    time (float32 temporaries of that many rows)."""
    if rows < 1 or rows % BLOCK:
        raise ValueError(f"rowwise_fp8: rows must be a positive multiple of {BLOCK}, "
                         f"got {rows}")
    n, k = w.q.shape
    q = torch.empty(n, k, dtype=FP8, device=w.q.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.q.device)
    for r in range(0, n, rows):
        part = Fp8Weight(w.q[r: r + rows], w.scale[r // BLOCK: (r + rows) // BLOCK])
        d = dequantize_fp8(part)  # [rows, K] float32
        s = (d.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        q[r: r + rows] = (d / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[r: r + rows] = s
    return q, scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-row (per-token) activation quantisation: x [M, K] -> (e4m3 [M, K], scale
    [M, 1] float32: each row's largest |x| / 448), x ~= q * scale."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_rowwise_linear(x: Tensor, wq: Tensor, ws: Tensor,
                       quantize: Callable[[Tensor], tuple[Tensor, Tensor]] = quantize_rows
                       ) -> Tensor:
    """x [..., K] @ W^T with W rowwise FP8 (`rowwise_fp8`: wq [N, K], ws [N]) and x quantised
    per row by `quantize` (W8A8: other numerics than the block-scaled weight-only path), one
    `torch._scaled_mm` on CUDA (float32 accumulation, both scales in its epilogue; off CUDA
    the same roundings dequantised, then a float32 product) -> [..., N] in x's dtype."""
    k = x.shape[-1]
    xq, xs = quantize(x.reshape(-1, k))
    return rowwise_gemm(xq, xs, wq, ws, x.dtype).view(*x.shape[:-1], wq.shape[0])


def rowwise_gemm(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, dtype: torch.dtype) -> Tensor:
    """(xq * xs) @ (wq * ws)^T for e4m3 xq [M, K] with scales xs [M, 1] and wq [N, K] with ws
    [N]: one `torch._scaled_mm` on CUDA (row-major x), off CUDA the same values dequantised
    and multiplied in float32 (torch's CPU _scaled_mm takes per-tensor scales only before
    2.12) -> [M, N] in `dtype`."""
    if not xq.is_cuda:
        return _rowwise_reference(xq, xs, wq, ws, dtype)
    return torch._scaled_mm(xq.contiguous(), wq.t(), scale_a=xs, scale_b=ws[None, :],
                            out_dtype=dtype)


def fp8_rowwise_linear_torch(x: Tensor, wq: Tensor, ws: Tensor) -> Tensor:
    """`fp8_rowwise_linear`'s reference: the same roundings of x and W, dequantised, then a
    float32 product, rounded to x's dtype."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    return _rowwise_reference(xq, xs, wq, ws, x.dtype).view(*x.shape[:-1], wq.shape[0])


def _rowwise_reference(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor,
                       dtype: torch.dtype) -> Tensor:
    """Both rowwise-scaled FP8 operands dequantised, a float32 product, rounded to `dtype`."""
    return F.linear(xq.float() * xs, wq.float() * ws[:, None]).to(dtype)


def linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
    """The reference linear of `Ops`: x [..., K] @ w [N, K]^T for dense or FP8 weights."""
    if isinstance(w, Fp8Weight):
        return fp8_linear_torch(x, w)
    return F.linear(x, w)


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is held in FP8 (buffers `qweight` and
    `weight_scale_inv`); `.weight` is the `Fp8Weight` the model hands to `ops.linear`."""

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", q)
        self.register_buffer("weight_scale_inv", scale)
        # the dequantised bf16 copy (fusion.add_dense_copies) and the rowwise-scaled FP8 one
        # (fusion.add_rowwise_copies), never saved: they are derived
        self.register_buffer("dense_weight", None, persistent=False)
        self.register_buffer("rowwise_q", None, persistent=False)
        self.register_buffer("rowwise_scale", None, persistent=False)

    @property
    def weight(self) -> Fp8Weight:
        rowwise = (None if self.rowwise_q is None or self.rowwise_scale is None
                   else (self.rowwise_q, self.rowwise_scale))
        return Fp8Weight(self.qweight, self.weight_scale_inv, self.dense_weight, rowwise)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantisable(model: nn.Module, include: Iterable[str] = DEFAULT_QUANTISED) -> list[str]:
    """Names of the bias-free `nn.Linear` layers the FP8 path quantises (those matching
    `include`)."""
    include = tuple(include)
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.bias is None and _matches(n, include)]


def check_keep(model: nn.Module, keep: Iterable[str]) -> None:
    """Every keep pattern must name at least one quantisable layer (a typo must not silently
    quantise what was meant to stay in bf16)."""
    names = quantisable(model)
    bad = [p for p in keep if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if bad:
        raise ValueError(f"FP8 keep pattern(s) {bad} match no quantised layer; layers look "
                         f"like {names[0] if names else '(none)'!r} (fnmatch patterns, e.g. "
                         "'layers.34.attention.wo' or 'layers.*.feed_forward.w2')")


@torch.no_grad()
def quantize_model(model: nn.Module, keep: Iterable[str] = ()) -> list[str]:
    """Swap the model's quantisable linears (not matching a `keep` pattern) for `Fp8Linear`
    layers, in place, on their device. Returns the names quantised."""
    keep = tuple(keep)
    check_keep(model, keep)
    done = []
    for name in quantisable(model):
        if _matches(name, keep):
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        fw = quantize_fp8(getattr(owner, leaf).weight)
        setattr(owner, leaf, Fp8Linear(fw.q, fw.scale))
        done.append(name)
    return done


def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the model's FP8 linears."""
    return [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (what a frame reads, and more)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
