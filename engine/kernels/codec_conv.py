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

`residual_unit(x, xx, w7, b7, dilation, alpha2, w1, b1)`: a whole residual unit after its
first Snake, ``x + (conv1(snake(conv7(xx) + b7, alpha2)) + b1)``, in one launch for up to
256 channels: each program holds its rows' k=7 conv output for every channel (rounded to
x's dtype after the Snake, as the two-launch path stores it) and multiplies it by the k=1
conv's taps in chunks of block_n output channels, so the unit's middle activation never
goes through memory and the k=1 conv has no launch of its own. Contract: x [B, C, T] and xx
[B, C, P + T] channels-last as above, w7 [C, C, 7], w1 [C, C, 1], C a multiple of 16, at most
256; -> [B, C, T] channels-last.

`transposed_weight(weight, stride)` and `upsample(xx, ...)`: a causal transposed conv (the
decoder blocks' upsampling: kernel k, stride s) as this conv over its input: output sample
s * t + r of channel co is conv row t, channel r * C_out + co, so a conv with s * C_out output
channels and ceil(k / s) taps over the input's [history | new] rows gives the transposed conv
in channels-last order with its bias in the epilogue — the kernel above, unchanged.

Triton is imported lazily: importing this module needs neither triton nor CUDA (the programs,
which share their main loop and Snake, are in `_codec_conv_jit`).
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
from .build import CURRENT_DEVICE, current_device_name, device_table, triton_available

__all__ = ["Config", "Plan", "available", "causal_conv", "causal_conv_torch", "config_for",
           "conv_taps", "load_plan", "plan_from", "residual_unit", "residual_unit_torch", "supported",
           "transposed_weight", "unit_config_for", "unit_supported", "upsample"]

log = logging.getLogger(__name__)
N_PAD = 128  # the taps' output channels are padded to this: the kernel's loads need no mask
UNIT_MAX_C = 256  # the fused unit keeps a row tile's conv output for every channel
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
    # the fused residual unit (`residual_unit`), per (channels, dilation of its k=7 conv, m
    # rows): its fastest launch shape where it beat the unit's two convs as the rows above
    # run them by `margin`, else None; (c, 0, d, m, config) as the rows above
    units: tuple[tuple[int, int, int, int, Config | None], ...] = ()

    def choose(self, c: int, k: int, d: int, m: int) -> Config | None:
        return _nearest(self.rows, c, k, d, m)

    # the transposed convs as this conv (`upsample`), per (input channels, kernel, stride, m
    # input rows): the fastest launch shape where it beat cuDNN's transposed conv (with its
    # bias) by `margin`, else None; (c, k, stride, m, config)
    ups: tuple[tuple[int, int, int, int, Config | None], ...] = ()

    def choose_unit(self, c: int, d: int, m: int) -> Config | None:
        """The fused unit's launch shape for c channels, dilation d and m rows (None: the
        unit runs as its two convs)."""
        return _nearest(self.units, c, 0, d, m)

    def choose_up(self, c: int, k: int, stride: int, m: int) -> Config | None:
        """The launch shape of a transposed conv (c input channels, kernel k, `stride`, m
        input rows) as this conv (None: cuDNN's transposed conv)."""
        return _nearest(self.ups, c, k, stride, m)


def _nearest(rows: tuple[tuple[int, int, int, int, Config | None], ...], c: int, k: int,
             d: int, m: int) -> Config | None:
    """The measured row of (c, k, d) nearest m in log(m), or None."""
    near = [(abs(math.log(max(m, 1) / rm)), rm, cfg)
            for rc, rk, rd, rm, cfg in rows if (rc, rk, rd) == (c, k, d)]
    # no extrapolation to fewer rows than measured: launch-bound sizes (a 1-stream x
    # 2-frame tick) ran slower fused (H200: 2.23 vs 2.08 ms)
    if not near or 2 * m < min(rm for _, rm, _ in near):
        return None
    return min(near, key=lambda r: r[0])[2]


DEFAULT_TABLE = Path(__file__).with_name("codec_conv_table.json")
MARGIN = 0.03  # the fused conv must beat cuDNN + its pass by this fraction to be chosen


def _plan_rows(rows: list[dict], baseline: str, k: str | None, d: str,
               margin: float) -> tuple[tuple[int, int, int, int, Config | None], ...]:
    """(channels, k, d, rows, config) per table row: its best launch shape where it beat the
    row's `baseline` time by `margin`, else None (k: the row's key for the kernel size, None
    for the fused unit's 0)."""
    out = []
    for r in rows:
        cfg = None
        if r.get("best_ms") is not None and r["best_ms"] < (1 - margin) * r[baseline]:
            cfg = Config(*r["best_config"])
            cfg.check()
        out.append((int(r["channels"]), int(r[k]) if k else 0, int(r[d]),
                    int(r["streams"]) * int(r["samples"]), cfg))
    return tuple(out)


def plan_from(data: dict, margin: float = MARGIN) -> Plan:
    """The plan of a codec_conv_bench report (its "convs" rows against cuDNN's conv + pass;
    where it has them, its "units" rows against the unit's two convs and "ups" rows against
    cuDNN's transposed conv: tables recorded before those have none)."""
    return Plan(_plan_rows(data["convs"], "cudnn_ms", "k", "dilation", margin),
                _plan_rows(data.get("units", []), "two_convs_ms", None, "dilation", margin),
                _plan_rows(data.get("ups", []), "cudnn_ms", "k", "stride", margin))


def load_plan(path: Path | str = DEFAULT_TABLE, margin: float = MARGIN,
              device: str | None = CURRENT_DEVICE) -> Plan:
    """The plan from a codec_conv_bench JSON (`plan_from`); a clear error if the file is not
    one. The table is for the GPU it was measured on ("device"): when `device` (the
    current CUDA device's name by default; None: no check) differs, it is ignored with a
    warning and the plan is empty (cuDNN everywhere: the timings do not carry over). The
    default path stands for the current device kind's table (`build.device_table`); where
    that kind has none, the plan is empty, with a warning."""
    if Path(path) == DEFAULT_TABLE:
        path = device_table(DEFAULT_TABLE, device)
        if not path.is_file():
            log.warning("no codec conv table recorded on this GPU kind (%s is missing): the "
                        "codec's convs run cuDNN's; record one with `python -m "
                        "bench_latency.codec_conv_bench --sweep --streams 64,4 --json %s`",
                        path.name, path)
            return Plan()
    try:
        data = json.loads(Path(path).read_text())
        recorded = data.get("device")
        plan = plan_from(data, margin)
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
    return plan


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


def residual_unit_torch(x: Tensor, xx: Tensor, w7: Tensor, b7: Tensor, dilation: int,
                        alpha2: Tensor, w1: Tensor, b1: Tensor) -> Tensor:
    """The formulas of `residual_unit`: the k=7 conv with its Snake, then the k=1 conv with
    the residual sum, as the two `causal_conv_torch` calls of the unfused unit."""
    h = causal_conv_torch(xx, w7, b7, dilation, alpha=alpha2)
    return causal_conv_torch(h, w1, b1, 1, residual=x)


def transposed_weight(weight: Tensor, stride: int) -> Tensor:
    """A ConvTranspose1d weight [C_in, C_out, k] at `stride` s as a conv weight
    [s * C_out, C_in, m], m = ceil(k / s), over the transposed conv's input with m - 1 rows of
    history: row r * C_out + co, tap q holds weight[:, co, r + (m - 1 - q) * s] (zero past k),
    so conv row t, channel r * C_out + co is the transposed conv's output s * t + r (counted
    from the first output of the new rows), channel co."""
    if weight.dim() != 3 or isinstance(stride, bool) or not isinstance(stride, int) \
            or stride < 1:
        raise ValueError(f"transposed_weight: a ConvTranspose1d weight [C_in, C_out, k] and an "
                         f"int stride >= 1, got {list(weight.shape)} and {stride!r}")
    cin, cout, k = weight.shape
    m = -(-k // stride)
    w = F.pad(weight.detach(), (0, m * stride - k)).reshape(cin, cout, m, stride)
    # [ci, co, j, r] is tap j * s + r; the conv's tap q reads the input j = m - 1 - q back
    return w.flip(2).permute(3, 1, 0, 2).reshape(stride * cout, cin, m).contiguous()


def upsample(xx: Tensor, weight: Tensor, bias: Tensor, stride: int, *,
             taps: Tensor | None = None, bias_rows: Tensor | None = None,
             config: Config | None = None, kernel: bool = True) -> Tensor:
    """A causal transposed conv's new outputs from its input xx [B, C_in, m - 1 + T] (the
    saved history first): the conv of `transposed_weight(weight, stride)` [s * C_out, C_in,
    m] with the bias repeated s times, its rows read as s samples each -> [B, C_out, s * T],
    channels-last (its storage is the conv's). `weight` [C_in, C_out, k] and `bias` [C_out]
    are the transposed conv's; `taps`: `conv_taps(transposed_weight(weight, stride))` and
    `bias_rows`: `bias.repeat(stride)`, made once by the caller (made here when not given:
    a copy per call). The kernel reads only the taps, so no
    rearranged weight is kept for it; the formulas (CPU, other layouts) make one per call."""
    if weight.dim() != 3 or isinstance(stride, bool) or not isinstance(stride, int) \
            or stride < 1 or bias.numel() != weight.shape[1]:
        raise ValueError(f"upsample: a ConvTranspose1d weight [C_in, C_out, k] with its bias "
                         f"[C_out] and an int stride >= 1, got {list(weight.shape)}, "
                         f"{list(bias.shape)} and {stride!r}")
    cin, cout, k = weight.shape
    b = bias.reshape(-1).repeat(stride) if bias_rows is None else bias_rows
    if kernel and available() and supported(xx, weight):
        # the conv's weight only for its shape checks: a stride-0 view, no copy
        shape = weight.new_empty(()).expand(stride * cout, cin, -(-k // stride))
        t = _check(xx, shape, b, 1, None, None)
        if taps is None:
            taps = conv_taps(transposed_weight(weight, stride))
        y = _launch(xx, shape, b, 1, None, None, taps, config, t)
    else:
        y = causal_conv_torch(xx, transposed_weight(weight, stride), b, 1)
    B, N, T = y.shape
    return y.transpose(1, 2).reshape(B, T * stride, N // stride).transpose(1, 2)


def unit_config_for(m: int, c: int) -> Config:
    """The fused unit's launch shape where the plan has none: 64-row tiles, the k=1 conv in
    chunks of 64 channels, 8 warps for more than 128 channels (the row tile's conv output is
    then [64, 256] float32)."""
    block_k = 64 if c % 64 == 0 else 32 if c % 32 == 0 else 16
    block_n = min(64, _pow2(c))
    return Config(64 if m >= 64 else 32, block_n, block_k, 8 if c > 128 else 4, 3)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


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


def _unit_check(x: Tensor, xx: Tensor, w7: Tensor, b7: Tensor, dilation: int, alpha2: Tensor,
                w1: Tensor, b1: Tensor) -> int:
    """Validate `residual_unit`'s arguments (any device); return T."""
    if x.dim() != 3 or w7.dim() != 3 or w1.dim() != 3:
        raise ValueError(f"residual_unit: x [B, C, T] {list(x.shape)}, w7 [C, C, k] "
                         f"{list(w7.shape)} and w1 [C, C, 1] {list(w1.shape)} expected")
    B, C, t = x.shape
    if tuple(w7.shape[:2]) != (C, C) or tuple(w1.shape) != (C, C, 1):
        raise ValueError(f"residual_unit: w7 {list(w7.shape)} must be [{C}, {C}, k] and w1 "
                         f"{list(w1.shape)} [{C}, {C}, 1] for x's {C} channels")
    t_in = _check(xx, w7, b7, dilation, alpha2, None)
    if t_in != t or xx.shape[0] != B:
        raise ValueError(f"residual_unit: xx {list(xx.shape)} gives {t_in} outputs for "
                         f"{xx.shape[0]} streams; x {list(x.shape)} has {t} for {B}")
    if b1.numel() != C:
        raise ValueError(f"residual_unit: b1 has {b1.numel()} values for {C} channels")
    for name, v in (("x", x), ("w1", w1), ("b1", b1)):
        if v.dtype != xx.dtype or v.device != xx.device:
            raise TypeError(f"residual_unit: {name} ({v.dtype}, {v.device}) must match xx "
                            f"({xx.dtype}, {xx.device})")
    return t


def unit_supported(x: Tensor, xx: Tensor) -> bool:
    """Whether the fused unit's kernel takes these: `supported`'s layouts for xx and x (the
    residual), C a multiple of 16 and at most UNIT_MAX_C."""
    return x.shape[1] <= UNIT_MAX_C and supported(xx, xx, residual=x)


def residual_unit(x: Tensor, xx: Tensor, w7: Tensor, b7: Tensor, dilation: int,
                  alpha2: Tensor, w1: Tensor, b1: Tensor, *, taps7: Tensor | None = None,
                  taps1: Tensor | None = None, config: Config | None = None,
                  kernel: bool = True, fast_sine: bool = False) -> Tensor:
    """A residual unit after its first Snake (module docstring) in one launch where the
    kernel applies (`taps7`, `taps1`: `conv_taps` of w7 and w1, made once by the caller;
    made here when not given), `residual_unit_torch` otherwise (CPU, no triton,
    `kernel=False`, other layouts, more than UNIT_MAX_C channels). `fast_sine`: the Snake
    with the hardware sine, as `causal_conv`'s."""
    t = _unit_check(x, xx, w7, b7, dilation, alpha2, w1, b1)
    if not (kernel and available() and unit_supported(x, xx)):
        return residual_unit_torch(x, xx, w7, b7, dilation, alpha2, w1, b1)
    return _unit_launch(x, xx, w7, b7, dilation, alpha2, w1, b1, taps7, taps1, config, t,
                        fast_sine)


def _unit_launch(x: Tensor, xx: Tensor, w7: Tensor, b7: Tensor, dilation: int, alpha2: Tensor,
                 w1: Tensor, b1: Tensor, taps7: Tensor | None, taps1: Tensor | None,
                 config: Config | None, t: int, fast_sine: bool = False) -> Tensor:
    B, C, _ = x.shape
    k = w7.shape[2]
    taps7 = conv_taps(w7) if taps7 is None else taps7
    taps1 = conv_taps(w1) if taps1 is None else taps1
    np_ = -(-C // N_PAD) * N_PAD
    for name, tp, want in (("taps7", taps7, (k * C, np_)), ("taps1", taps1, (C, np_))):
        if tuple(tp.shape) != want or not tp.is_contiguous() or tp.dtype != x.dtype \
                or tp.device != x.device:
            raise ValueError(f"residual_unit: {name} {list(tp.shape)} {tp.dtype} is not "
                             f"conv_taps of its weight ({list(want)}, {x.dtype})")
    m = B * t
    cfg = config if config is not None else unit_config_for(m, C)
    cfg.check()
    npc = _pow2(C)
    if C % cfg.block_k or cfg.block_n > npc:
        raise ValueError(f"residual_unit: block_k {cfg.block_k} must divide C = {C} and "
                         f"block_n {cfg.block_n} be at most {npc}")
    out = torch.empty((B, t, C), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.transpose(1, 2)
    import triton

    grid = (triton.cdiv(m, cfg.block_m),)
    _unit_kernel()[grid](
        xx, taps7, b7.reshape(-1), alpha2.reshape(-1), taps1, b1.reshape(-1), x, out,
        m, t, C, np_, dilation * xx.stride(2), xx.stride(0), xx.stride(2), x.stride(0),
        x.stride(2), TAPS=k, FAST_SIN=bool(fast_sine), BM=cfg.block_m, NPC=npc,
        BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages)
    return out.transpose(1, 2)


@functools.cache
def _unit_kernel():  # type: ignore[no-untyped-def]
    """The fused residual unit's program, compiled on first use (imports triton)."""
    from . import _codec_conv_jit as jit

    return jit.unit_kernel


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    """The fused conv's program, compiled on first use (imports triton)."""
    from . import _codec_conv_jit as jit

    return jit.conv_kernel
