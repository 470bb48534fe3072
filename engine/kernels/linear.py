"""`linear_small_m` (csrc/linear.cu): y = x @ W^T for the few rows of a decode step
(M = prod(x.shape[:-1]) <= 64) on the tensor cores, with W in bf16 (`gemv`) or in FP8 e4m3 with
128 x 128 block scales (`fp8_gemv`, engine/quant.py's `Fp8Weight`); and the per-shape choice
among it, the library GEMM and the Triton FP8 kernel (`LinearPlan`, `make_linear`), made from
a table the benchmark records (`python -m bench_latency.linear_bench --out table.json`).

The kernels' contract (checked here, then again in C++): x bf16 [..., K] whose leading dims
flatten to rows without a copy (last dim contiguous; row stride a multiple of 8 elements and
the base 16-byte aligned), K % 16 == 0, 1 <= M <= 64; W contiguous and 16-byte aligned.
Output: bf16 [..., N], float32 accumulation, rounded once.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import Fp8Weight, fp8_linear_torch
from .build import extension_available, kernel_ok

MAX_M = 64  # the kernel's largest template: 8 MMA tiles of 8 rows
MAX_SPLITS = 64
K_MULTIPLE = 16
KWARPS = (0, 1, 2, 4, 8)  # warps per 16-row tile splitting K inside a block; 0: automatic
IMPLS = ("library", "gemv", "triton")
DEFAULT_TABLE = Path(__file__).with_name("linear_table.json")

LinearFn = Callable[[Tensor, Tensor | Fp8Weight], Tensor]


# ---------------------------------------------------------------------- contract
def _problem(x: Tensor, wq: Tensor, splits: object, kwarps: object,
             fp8: bool) -> str | None:
    """What keeps the kernel from taking x [..., K] and weights wq [N, K] (bf16, or e4m3 with
    `fp8`; an FP8 weight's scales are checked by Fp8Weight.check and in C++), or None."""
    want = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if not isinstance(wq, Tensor) or wq.dtype != want:
        return f"the weight must be a {want} tensor, got {getattr(wq, 'dtype', type(wq).__name__)}"
    if isinstance(splits, bool) or not isinstance(splits, int) or not 0 <= splits <= MAX_SPLITS:
        return f"splits must be an int in 0..{MAX_SPLITS} (0: automatic), got {splits!r}"
    if isinstance(kwarps, bool) or kwarps not in KWARPS:
        return f"kwarps must be one of {KWARPS} (0: automatic), got {kwarps!r}"
    if x.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x.dtype}"
    if wq.dim() != 2:
        return f"the weight must be [N, K], got shape {tuple(wq.shape)}"
    n, k = wq.shape
    if x.dim() < 1 or x.shape[-1] != k:
        return f"x's last dim must be K = {k} (the weight is {tuple(wq.shape)}), got x " \
               f"{tuple(x.shape)}"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return f"K = {k} must be a positive multiple of {K_MULTIPLE}"
    if n < 1:
        return "the weight has no rows (N = 0)"
    m = x.numel() // k
    if m > MAX_M:
        return f"M = {m} rows (x {tuple(x.shape)}); the kernel takes at most {MAX_M}"
    if x.device != wq.device:
        return f"x is on {x.device} but the weight on {wq.device}"
    if not wq.is_contiguous() or wq.data_ptr() % 16:
        return "the weight must be contiguous and 16-byte aligned"
    if m == 0:
        return None
    try:
        x2 = x.view(m, k)
    except RuntimeError:
        return (f"x's leading dims (shape {tuple(x.shape)}, strides {x.stride()}) do not "
                "flatten to rows without a copy")
    if x2.stride(1) != 1:
        return f"x's last dim must be contiguous, got strides {x.stride()}"
    if x2.data_ptr() % 16 or (m > 1 and x2.stride(0) % 8):
        return (f"x's rows must be 16-byte aligned (the base address, and a row stride that is "
                f"a multiple of 8 elements), got row stride {x2.stride(0)} and a base "
                f"{x2.data_ptr() % 16} bytes past a 16-byte boundary")
    return None


def _check_fp8(w: object) -> Fp8Weight:
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"fp8_gemv takes an Fp8Weight, got {type(w).__name__}")
    w.check()
    return w


@functools.cache
def _mma_device(index: int) -> bool:
    """The kernel's bf16 MMA needs compute capability 8.0+."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _mma_current() -> bool:
    return _mma_device(torch.cuda.current_device())


def _use_kernel(kernel: bool, x: Tensor, wq: Tensor) -> bool:
    return kernel_ok(kernel, x, wq) and _mma_device(x.device.index or 0)


def _run(x: Tensor, wq: Tensor, scale: Tensor | None, splits: int, kwarps: int) -> Tensor:
    """The kernel on a contract-checked x [..., K] (CUDA, extension built)."""
    n, k = wq.shape
    m = x.numel() // k
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m:
        torch.ops.rtvoice_kernels.linear_small_m(x.view(m, k), wq, scale, out, splits, kwarps)
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------- wrappers
def supports(m: int, n: int, k: int, fp8: bool) -> bool:
    """Whether the built kernel takes an [m, k] x [n, k] linear (bf16 W, or FP8 W with `fp8`;
    the same shapes either way) on a CUDA device."""
    del fp8  # one contract for both weight formats
    return (1 <= m <= MAX_M and n >= 1 and k >= K_MULTIPLE and k % K_MULTIPLE == 0
            and extension_available() and _mma_current())


def gemv(x: Tensor, w: Tensor, *, splits: int = 0, kwarps: int = 0,
         kernel: bool = True) -> Tensor:
    """x [..., K] bf16 @ w [N, K]^T bf16 -> [..., N] bf16 (float32 accumulation), at most 64
    rows. `splits`: K cut into this many ranges read by separate blocks (partial sums in
    float32, then summed), 0: automatic; `kwarps`: warps of a block sharing a 16-row tile
    (1, 2, 4, 8; 0: automatic). Neither changes the result beyond float32 summation order.
    `kernel=False`, CPU tensors or no extension: `F.linear`."""
    problem = _problem(x, w, splits, kwarps, False)
    if problem is not None:
        raise ValueError(f"gemv: {problem}")
    if _use_kernel(kernel, x, w):
        return _run(x, w, None, splits, kwarps)
    return F.linear(x, w)


def fp8_gemv(x: Tensor, w: Fp8Weight, *, splits: int = 0, kwarps: int = 0,
             kernel: bool = True) -> Tensor:
    """x [..., K] bf16 @ W^T with W = w.q * w.scale (e4m3 [N, K], float32 scales per 128 x 128
    block) -> [..., N] bf16: weight-only FP8, the values converted to bf16 in registers, each
    128-wide K block's sum scaled in float32. `splits`, `kwarps`: as for `gemv`. `kernel=False`,
    CPU tensors or no extension: `engine.quant.fp8_linear_torch` (the dequantising
    reference)."""
    w = _check_fp8(w)
    problem = _problem(x, w.q, splits, kwarps, True)
    if problem is not None:
        raise ValueError(f"fp8_gemv: {problem}")
    if _use_kernel(kernel, x, w.q):
        return _run(x, w.q, w.scale, splits, kwarps)
    return fp8_linear_torch(x, w)


# ---------------------------------------------------------------------- the per-shape plan
@dataclass(frozen=True, slots=True)
class PlanRow:
    """One measured shape: the fastest implementation of an [m, k] x [n, k] linear (`fp8`: FP8
    weights) and, for "gemv", its split count; `us`: what each candidate took (microseconds)."""

    fp8: bool
    m: int
    n: int
    k: int
    impl: str
    splits: int = 1
    us: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"fp8": self.fp8, "m": self.m, "n": self.n, "k": self.k, "impl": self.impl,
                "splits": self.splits, "us": dict(self.us)}


def _row(d: object, where: str) -> PlanRow:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: a row must be an object, got {type(d).__name__}")
    missing = {"fp8", "m", "n", "k", "impl"} - set(d)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}")
    fp8, impl, splits = d["fp8"], d["impl"], d.get("splits", 1)
    if not isinstance(fp8, bool):
        raise ValueError(f"{where}: fp8 must be true or false, got {fp8!r}")
    for key in ("m", "n", "k"):
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {key} must be an int >= 1, got {v!r}")
    if impl not in IMPLS or (impl == "triton" and not fp8):
        raise ValueError(f"{where}: impl must be one of {IMPLS} ('triton' for FP8 rows only), "
                         f"got {impl!r}")
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{where}: splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    us = d.get("us", {})
    if not isinstance(us, Mapping) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in us.values()):
        raise ValueError(f"{where}: us must map implementations to microseconds, got {us!r}")
    return PlanRow(fp8, d["m"], d["n"], d["k"], impl, splits,
                   tuple((str(name), float(t)) for name, t in us.items()))


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """Which implementation runs each linear shape, from a recorded table. `choose(m, n, k,
    fp8)` takes the row of the same (fp8, N, K) with the nearest recorded M at or above m
    (the table's M are buckets: a shape between them gets the next larger one's choice); any
    other shape is "library"."""

    rows: tuple[PlanRow, ...]
    # (fp8, n, k) -> [(m, impl, splits)] sorted by m
    _index: dict[tuple[bool, int, int], list[tuple[int, str, int]]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[tuple[bool, int, int], list[tuple[int, str, int]]] = {}
        seen = set()
        for r in self.rows:
            if (r.fp8, r.m, r.n, r.k) in seen:
                raise ValueError(f"linear plan: two rows for fp8={r.fp8} m={r.m} n={r.n} "
                                 f"k={r.k}")
            seen.add((r.fp8, r.m, r.n, r.k))
            index.setdefault((r.fp8, r.n, r.k), []).append((r.m, r.impl, r.splits))
        for v in index.values():
            v.sort()
        object.__setattr__(self, "_index", index)

    @classmethod
    def from_rows(cls, rows: Iterable[object], where: str = "linear plan") -> LinearPlan:
        return cls(tuple(_row(d, f"{where}: row {i}") for i, d in enumerate(rows)))

    def choose(self, m: int, n: int, k: int, fp8: bool) -> tuple[str, int]:
        """(impl, splits) for an [m, k] x [n, k] linear: "library" (F.linear; for FP8 the
        Triton kernel if importable, else the dequantising reference), "gemv" (this module's
        kernel with `splits`) or "triton" (FP8 only)."""
        entries = self._index.get((bool(fp8), n, k))
        if entries:
            i = bisect.bisect_left(entries, (m,))
            if i < len(entries):
                return entries[i][1], entries[i][2]
        return "library", 1

    def to_json(self) -> list[dict[str, object]]:
        return [r.to_json() for r in self.rows]


def load_plan(path: str | Path | None = DEFAULT_TABLE) -> LinearPlan | None:
    """The plan recorded at `path` (a JSON list of rows, or an object with a "rows" list and
    any other keys: device, bandwidths), or None if there is no such file. A malformed table
    raises ValueError naming the row."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e})") from e
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{p}: expected a list of rows or an object with a 'rows' list")
    return LinearPlan.from_rows(rows, where=str(p))


# ---------------------------------------------------------------------- the Ops.linear
@functools.cache
def triton_fp8() -> LinearFn | None:
    """engine.kernels.fp8_triton.fp8_linear_triton where it imports and can run here (Triton
    and a CUDA device it supports: its `available()`), else None."""
    try:
        from . import fp8_triton

        fn = fp8_triton.fp8_linear_triton
        ok = getattr(fp8_triton, "available", lambda: True)()
    except Exception:  # not there, or broken: the caller falls back
        return None
    return fn if ok else None


def _kernel_or(fallback: LinearFn, splits: int) -> LinearFn:
    """The kernel where this call's x and W meet its layout contract (the shape was checked
    when the plan was consulted; strides and alignment can differ between calls), else
    `fallback`."""

    def run(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        fp8 = isinstance(w, Fp8Weight)
        wq, scale = (w.q, w.scale) if fp8 else (w, None)
        if _problem(x, wq, splits, 0, fp8) is None:  # type: ignore[arg-type]
            return _run(x, wq, scale, splits, 0)
        return fallback(x, w)

    return run


def resolve(plan: LinearPlan | None, kernels: bool, m: int, n: int, k: int, fp8: bool,
            dtype: torch.dtype, cuda: bool) -> LinearFn:
    """The function that computes an [m, k] x [n, k] linear for x of `dtype` on CUDA or not
    (`make_linear` calls this once per shape and keeps it)."""
    impl, splits = plan.choose(m, n, k, fp8) if plan is not None else ("library", 1)
    if fp8:
        tri = triton_fp8() if cuda else None
        library: LinearFn = tri if tri is not None else fp8_linear_torch  # type: ignore[assignment]
    else:
        library = F.linear
    if (impl == "gemv" and kernels and cuda and dtype == torch.bfloat16
            and supports(m, n, k, fp8)):
        return _kernel_or(library, splits)
    return library


def make_linear(plan: LinearPlan | None, kernels: bool) -> LinearFn:
    """`Ops.linear`: x [..., K] @ W^T for a dense weight (F.linear, or `gemv` where the plan
    picked it) or an `Fp8Weight` (`fp8_gemv` where the plan picked it, else the Triton FP8
    kernel if importable, else the dequantising reference). `kernels=False` never runs the
    csrc kernel (the Triton kernel is FP8's library path and stays). Without a plan every
    shape takes the library path. The choice is made once per (M, N, K, FP8, x's dtype,
    CUDA or not) and kept in a dict, so a call costs one lookup (eager prefill runs this per
    layer; a CUDA graph captures it once per shape)."""
    chosen: dict[tuple[int, int, int, bool, torch.dtype, bool], LinearFn] = {}

    def linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
        fp8 = isinstance(w, Fp8Weight)
        n, k = w.shape
        key = (x.numel() // k if k else 0, n, k, fp8, x.dtype, x.is_cuda)
        fn = chosen.get(key)
        if fn is None:
            fn = chosen[key] = resolve(plan, kernels, *key)
        return fn(x, w)

    return linear
