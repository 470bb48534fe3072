"""The codec's residual-unit convolutions with their pointwise ops in the epilogue (Triton).

`causal_conv(x, taps, bias, dilation, alpha=, residual=)`: a "valid" 1-D convolution of x,
which already holds each stream's left context (a streaming causal conv's ``[tail | new]``
input), plus the conv's bias, and then in the same pass either

- the next Snake: ``snake(conv(x) + bias, alpha)`` (a residual unit's dilated k=7 conv and
  the Snake after it), or
- the residual sum: ``residual + (conv(x) + bias)`` (its k=1 conv and the unit's output),
  optionally with the next Snake of that sum written as a second output (`next_input`:
  straight into the next streaming conv's ``[tail | new]`` input, which then needs no
  Snake-and-concatenate pass of its own).

cuDNN runs these as a conv and then a pointwise pass each (a 64-stream x 8-frame codec tick:
~8 ms of convs at ~165 TFLOP/s, ~4.9 ms of Snake/bias passes on the H200, docs/PERF.md).
Here the conv is an implicit GEMM over channels-last activations: output rows are the
(stream, time) pairs, the reduction runs over (tap, input channel), and tap j of row t reads
input row ``t + j * dilation`` (rows of one stream are contiguous in [B, T, C] memory), so no
im2col buffer is made. The epilogue works on the float32 accumulator and rounds once.

Contract (checked by the wrapper; anything else runs the torch formulas):
  x         [B, C, P + T] channels-last (stored [B, P + T, C], streams may be further apart),
            CUDA bf16/fp16; P = (k - 1) * dilation
  taps      [k * C, Np] the conv weight [N, C, k] as (tap, input channel) rows, output
            channels zero-padded to Np (a multiple of 128): `conv_taps(weight)`
  bias      [N], alpha [N] (Snake), residual [B, N, T] channels-last: x's dtype
  next_input  (xx [B, N, P2 + T] channels-last, stored dense [B, P2 + T, N]; alpha2 [N]):
            with residual only; rows P2.. of each stream get snake(output, alpha2), the
            output's rounded values activated as the unfused Snake would
  -> a new [B, N, T] channels-last tensor (stored dense [B, T, N])
The kernel needs C a multiple of 16 (the reduction step); the fixture codec's 4-32 channel
convs run the formulas.

Triton is imported lazily: importing this module needs neither triton nor CUDA.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .activation import bias_residual_torch, snake_torch
from .build import CURRENT_DEVICE, current_device_name, triton_available

__all__ = ["Config", "Plan", "available", "causal_conv", "causal_conv_torch", "config_for",
           "conv_taps", "load_plan", "supported"]

log = logging.getLogger(__name__)
N_PAD = 128  # the taps' output channels are padded to this: the kernel's loads need no mask
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Config:
    """One launch shape: an output tile of block_m rows x block_n channels, block_k input
    channels per reduction step, `warps` warps, `stages` pipelined loads."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 4
    stages: int = 3

    def check(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Config.{name} must be a power of two >= 16, got {v}")
        if self.block_n > N_PAD:  # the taps' padding: wider tiles would read past it
            raise ValueError(f"Config.block_n must be at most {N_PAD}, got {self.block_n}")
        if self.warps not in (1, 2, 4, 8, 16) or not 1 <= self.stages <= 8:
            raise ValueError(f"Config.warps in (1, 2, 4, 8, 16), stages in 1..8: got "
                             f"{self.warps}, {self.stages}")


def config_for(m: int, n: int, c: int) -> Config:
    """A launch shape for an [m rows, n channels] output reducing over c input channels where
    the plan has none: 128 x 64 tiles (fastest for most of the S2-Pro codec's k=7 convs on
    the H200, docs/perf/gpu_s20_codec_conv.json), smaller for few rows."""
    block_k = 64 if c % 64 == 0 else 32 if c % 32 == 0 else 16
    block_n = 64 if n > 32 else 32
    block_m = 128 if m >= 4096 else 64
    return Config(block_m, block_n, block_k, 4, 3)


@dataclass(frozen=True, slots=True)
class Plan:
    """Where the fused conv runs, from measurements (`python -m bench_latency.codec_conv_bench
    --sweep --json FILE`): per measured conv (input channels c, kernel k, dilation d, m output
    rows) the fastest launch shape when it beat cuDNN's conv + csrc's pointwise pass by
    `margin`, else None (cuDNN). A conv takes the row of its (c, k, d) nearest in log(m);
    one never measured, or with under half the fewest rows measured, runs cuDNN."""

    rows: tuple[tuple[int, int, int, int, Config | None], ...] = ()

    def choose(self, c: int, k: int, d: int, m: int) -> Config | None:
        rows = [(abs(math.log(max(m, 1) / rm)), rm, cfg)
                for rc, rk, rd, rm, cfg in self.rows if (rc, rk, rd) == (c, k, d)]
        # no extrapolation to fewer rows than measured: launch-bound sizes (a 1-stream x
        # 2-frame tick) ran slower fused (H200: 2.23 vs 2.08 ms)
        if not rows or 2 * m < min(rm for _, rm, _ in rows):
            return None
        return min(rows, key=lambda r: r[0])[2]


DEFAULT_TABLE = Path(__file__).with_name("codec_conv_table.json")
MARGIN = 0.03  # the fused conv must beat cuDNN + its pass by this fraction to be chosen


def load_plan(path: Path | str = DEFAULT_TABLE, margin: float = MARGIN,
              device: str | None = CURRENT_DEVICE) -> Plan:
    """The plan from a codec_conv_bench JSON (its "convs" rows); a clear error if the file
    is not one. The table is for the GPU it was measured on ("device"): when `device` (the
    current CUDA device's name by default; None: no check) differs, it is ignored with a
    warning and the plan is empty (cuDNN everywhere: the timings do not carry over)."""
    try:
        data = json.loads(Path(path).read_text())
        recorded = data.get("device")
        rows = []
        for r in data["convs"]:
            cfg = None
            if r.get("best_ms") is not None and r["best_ms"] < (1 - margin) * r["cudnn_ms"]:
                cfg = Config(*r["best_config"])
                cfg.check()
            rows.append((int(r["channels"]), int(r["k"]), int(r["dilation"]),
                         int(r["streams"]) * int(r["samples"]), cfg))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"codec conv table {path}: {type(e).__name__}: {e} (write one with "
                         f"`python -m bench_latency.codec_conv_bench --sweep --json FILE`)"
                         ) from e
    if device == CURRENT_DEVICE:
        device = current_device_name()
    if recorded is not None and device is not None and recorded != device:
        log.warning("%s was recorded on %r, not this %r: ignored (the codec's convs run "
                    "cuDNN's; record a table here with `python -m "
                    "bench_latency.codec_conv_bench --sweep --streams 64,4 --json FILE`)",
                    path, recorded, device)
        return Plan()
    return Plan(tuple(rows))


# ------------------------------------------------------------------------- the formulas
def conv_taps(weight: Tensor) -> Tensor:
    """A conv weight [N, C, k] as the kernel's [k * C, Np] (tap, input channel) rows, output
    channels zero-padded to a multiple of N_PAD."""
    if weight.dim() != 3:
        raise ValueError(f"conv_taps needs a conv1d weight [N, C, k], got {list(weight.shape)}")
    n, c, k = weight.shape
    taps = weight.detach().permute(2, 1, 0).reshape(k * c, n)
    np_ = -(-n // N_PAD) * N_PAD
    return F.pad(taps, (0, np_ - n)).contiguous()


def causal_conv_torch(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, *,
                      alpha: Tensor | None = None, residual: Tensor | None = None,
                      next_input: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The formulas: torch's conv, then the codec's Snake or residual sum, as the unfused
    residual unit computes them (conv output rounded, then bias + Snake / x + (y + bias));
    with `next_input` the Snake of the sum written into its buffer's new rows."""
    y = F.conv1d(x, weight, None, dilation=dilation)
    if alpha is not None:
        return snake_torch(y, alpha, bias)
    if residual is not None:
        out = bias_residual_torch(residual, y, bias)
        if next_input is not None:
            xx, alpha2 = next_input
            xx[..., xx.shape[-1] - out.shape[-1]:] = snake_torch(out, alpha2)
        return out
    return y + bias.reshape(1, -1, 1)


# ------------------------------------------------------------------------- the kernel
available = triton_available  # Triton importable and a CUDA device present


def _check(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None,
           residual: Tensor | None, next_input: tuple[Tensor, Tensor] | None = None) -> int:
    """Validate the arguments (any device); return T, the output length."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"causal_conv: x [B, C, L] {list(x.shape)} and weight [N, C, k] "
                         f"{list(weight.shape)} do not fit")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"causal_conv: dilation must be an int >= 1, got {dilation!r}")
    n, _, k = weight.shape
    t = x.shape[2] - (k - 1) * dilation
    if t < 0:
        raise ValueError(f"causal_conv: x has {x.shape[2]} samples, fewer than the conv's "
                         f"span {(k - 1) * dilation + 1} minus one")
    if alpha is not None and residual is not None:
        raise ValueError("causal_conv: give alpha (Snake) or residual, not both")
    for name, v in (("bias", bias), ("alpha", alpha)):
        if v is not None and v.numel() != n:
            raise ValueError(f"causal_conv: {name} has {v.numel()} values for {n} channels")
    if residual is not None and tuple(residual.shape) != (x.shape[0], n, t):
        raise ValueError(f"causal_conv: residual {list(residual.shape)} must be "
                         f"[{x.shape[0]}, {n}, {t}]")
    xx, alpha2 = next_input if next_input is not None else (None, None)
    if xx is not None:
        if residual is None:
            raise ValueError("causal_conv: next_input comes with the residual sum only")
        if xx.dim() != 3 or xx.shape[:2] != (x.shape[0], n) or xx.shape[2] < t:
            raise ValueError(f"causal_conv: next_input buffer {list(xx.shape)} must be "
                             f"[{x.shape[0]}, {n}, >= {t}]")
        if alpha2 is None or alpha2.numel() != n:
            raise ValueError(f"causal_conv: next_input's alpha must have {n} values")
    for name, v in (("weight", weight), ("bias", bias), ("alpha", alpha),
                    ("residual", residual), ("next_input buffer", xx),
                    ("next_input alpha", alpha2)):
        if v is not None and (v.dtype != x.dtype or v.device != x.device):
            raise TypeError(f"causal_conv: {name} ({v.dtype}, {v.device}) must match x "
                            f"({x.dtype}, {x.device})")
    return t


def supported(x: Tensor, weight: Tensor, residual: Tensor | None = None,
              next_input: Tensor | None = None) -> bool:
    """Whether the kernel takes these (else the formulas run): CUDA bf16/fp16, x (and the
    residual) channels-last, C a multiple of 16; a next_input buffer channels-last with dense
    rows."""
    return (x.is_cuda and x.dtype in _DTYPES and x.shape[1] % 16 == 0
            and x.stride(1) == 1 and x.stride(2) == x.shape[1]
            and (residual is None or (residual.stride(1) == 1
                                      and residual.stride(2) == residual.shape[1]))
            and (next_input is None or (next_input.stride(1) == 1
                                        and next_input.stride(2) == next_input.shape[1])))


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor, dilation: int = 1, *,
                alpha: Tensor | None = None, residual: Tensor | None = None,
                next_input: tuple[Tensor, Tensor] | None = None,
                taps: Tensor | None = None, config: Config | None = None,
                kernel: bool = True, fast_sine: bool = False) -> Tensor:
    """The conv + bias + (Snake | residual sum [+ the next Snake into `next_input`]) of the
    module docstring in one launch where the kernel applies (`taps`: `conv_taps(weight)`,
    made once by the caller; made here when not given), the formulas otherwise (CPU, no
    triton, `kernel=False`, other layouts). `fast_sine`: the kernel's Snake takes the
    hardware sine (`sin.approx`, as csrc's bf16 Snake pass does: absolute error ~2^-21 near
    0, growing slowly with the argument, far below bf16's rounding) instead of the accurate
    one (range reduction, ~40 instructions per value)."""
    t = _check(x, weight, bias, dilation, alpha, residual, next_input)
    xx = next_input[0] if next_input is not None else None
    if not (kernel and available() and supported(x, weight, residual, xx)):
        return causal_conv_torch(x, weight, bias, dilation, alpha=alpha, residual=residual,
                                 next_input=next_input)
    return _launch(x, weight, bias, dilation, alpha, residual, taps, config, t, next_input,
                   fast_sine)


def _launch(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None,
            residual: Tensor | None, taps: Tensor | None, config: Config | None,
            t: int, next_input: tuple[Tensor, Tensor] | None = None,
            fast_sine: bool = False) -> Tensor:
    B, C, _ = x.shape
    n, _, k = weight.shape
    taps = conv_taps(weight) if taps is None else taps
    if taps.shape != (k * C, -(-n // N_PAD) * N_PAD) or not taps.is_contiguous() \
            or taps.dtype != x.dtype or taps.device != x.device:
        raise ValueError(f"causal_conv: taps {list(taps.shape)} {taps.dtype} are not "
                         f"conv_taps(weight) for weight {list(weight.shape)} {weight.dtype}")
    m = B * t
    cfg = config if config is not None else config_for(m, n, C)
    cfg.check()
    if C % cfg.block_k:
        raise ValueError(f"causal_conv: block_k {cfg.block_k} must divide C = {C}")
    out = torch.empty((B, t, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.transpose(1, 2)
    import triton

    epi = 1 if alpha is not None else 0 if residual is None else 2 if next_input is None else 3
    r = residual if residual is not None else out.transpose(1, 2)
    a = alpha if alpha is not None else next_input[1] if next_input is not None else bias
    # the second output: rows P2.. of next_input's buffer (else unused: out, never written)
    xx = next_input[0] if next_input is not None else out.transpose(1, 2)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _kernel()[grid](
        x, taps, bias.reshape(-1), a.reshape(-1), r, out, xx,
        m, t, n, C, taps.shape[1], dilation * x.stride(2), x.stride(0), x.stride(2),
        r.stride(0), r.stride(2), xx.stride(0), xx.shape[2] - t, TAPS=k, EPI=epi,
        FAST_SIN=bool(fast_sine), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.warps,
        num_stages=cfg.stages)
    return out.transpose(1, 2)


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit(do_not_specialize=["M", "T"])
    def conv_kernel(x_ptr, w_ptr, b_ptr, a_ptr, r_ptr, o_ptr, s_ptr, M, T, N, C, NP, s_tap,
                    sxb, sxt, srb, srt, ssb, s_off, TAPS: tl.constexpr, EPI: tl.constexpr,
                    FAST_SIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
        # output tiles in row-major order with the channel tiles fastest: the programs that
        # run together read the same input rows (from L2) and the whole weight stays in L2
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BN)
        pid_m = pid // n_tiles
        pid_n = pid % n_tiles
        rm = pid_m * BM + tl.arange(0, BM)  # output rows: (stream b, time t) = b * T + t
        rn = pid_n * BN + tl.arange(0, BN)  # output channels (taps are padded: no mask)
        rk = tl.arange(0, BK)
        row_ok = rm < M
        rmc = tl.where(row_ok, rm, 0)  # rows past the end read row 0 and are not stored
        b = rmc // T
        t = rmc - b * T
        # x: [B, P + T, C] rows; output row t's tap j reads input row t + j * dilation
        # (s_tap = dilation * sxt elements further on)
        a_row = b.to(tl.int64) * sxb + t.to(tl.int64) * sxt
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, TAPS * C, BK):  # (tap, channel block): BK divides C
            j = kk // C
            c0 = kk - j * C
            a = tl.load(x_ptr + a_row[:, None] + j * s_tap + (c0 + rk)[None, :])
            w = tl.load(w_ptr + (kk + rk)[:, None] * NP + rn[None, :])
            acc = tl.dot(a, w, acc)
        n_ok = rn < N
        v = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPI == 1:  # Snake: v + sin(alpha v)^2 / (alpha + 1e-9)
            al = tl.load(a_ptr + rn, mask=n_ok, other=1.0).to(tl.float32)
            if FAST_SIN:
                s = libdevice.fast_sinf(al[None, :] * v)
            else:
                s = tl.sin(al[None, :] * v)
            v = v + (1.0 / (al + 1e-9))[None, :] * (s * s)
        elif EPI >= 2:  # the residual sum x + (y + bias)
            r_row = b.to(tl.int64) * srb + t.to(tl.int64) * srt
            res = tl.load(r_ptr + r_row[:, None] + rn[None, :],
                          mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            v = res.to(tl.float32) + v
        y = v.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], y,
                 mask=row_ok[:, None] & n_ok[None, :])
        if EPI == 3:  # and the next Snake of the rounded sum into the next conv's input
            al = tl.load(a_ptr + rn, mask=n_ok, other=1.0).to(tl.float32)
            yf = y.to(tl.float32)
            if FAST_SIN:
                s = libdevice.fast_sinf(al[None, :] * yf)
            else:
                s = tl.sin(al[None, :] * yf)
            sv = yf + (1.0 / (al + 1e-9))[None, :] * (s * s)
            s_row = b.to(tl.int64) * ssb + (s_off + t).to(tl.int64) * N
            tl.store(s_ptr + s_row[:, None] + rn[None, :], sv.to(s_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & n_ok[None, :])

    return conv_kernel
