"""The codec's fused residual-unit convs (engine/kernels/codec_conv.py) against the path they
replace: cuDNN's channels-last conv (autotuned, as the codec's graph capture does) plus csrc's
Snake / bias-residual pass, at the S2-Pro decoder's shapes for a tick of 64 streams x 8 frames;
then the fused residual unit (both convs in one launch, up to 256 channels) against its two
convs as that plan runs them, and the decoder's transposed convs as the fused conv over their
input against cuDNN's; then the graphed streaming codec's ticks with and without the fused
convs, and each one's bf16 audio against the float32 offline decode.

    python -m bench_latency.codec_conv_bench [--sweep [--wide] [--accurate-sine]] [--streams 64,4]
        [--json out.json] [--no-ticks | --ticks-only]

`--sweep` times every launch shape of `SWEEP` (`--wide`: and of `WIDE`) per conv, the Snake
convs with the hardware sine as the engine runs them (`--accurate-sine`: Triton's), and
reports the fastest: the JSON is then a table the codec's plan loads (`codec_conv.load_plan`: the
fused conv where its best shape beat cuDNN's conv + pass, the fused unit where its best
shape of `UNIT_SWEEP` beat the unit's two convs, a transposed conv as the fused conv where it
beat cuDNN's). Timing: CUDA events over 20 calls
after 3 warm-ups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import codec_conv as cc
from engine.kernels.activation import bias_residual, snake

# (channels, samples per stream) at each decoder block for 8 frames of 2,048 samples
LEVELS = ((768, 256), (384, 2048), (192, 8192), (96, 16384))
SWEEP = tuple(cc.Config(*c) for c in (  # (block_m, block_n, block_k, warps, stages)
    (128, 64, 64, 4, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 3), (128, 128, 64, 4, 3),
    (256, 128, 64, 8, 3), (256, 64, 64, 8, 3), (128, 32, 64, 4, 3), (128, 128, 32, 4, 4)))
WIDE = tuple(cc.Config(*c) for c in (  # beyond SWEEP: what the next table may find faster
    (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 5), (256, 64, 32, 8, 4)))


def timed_ms(fn: Callable[[], object], n: int = 20) -> float:
    """Milliseconds per call: CUDA events where a GPU runs it, else the wall clock (the rows'
    functions on a CPU, as the tests run them)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1000
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def _cfg(c: cc.Config) -> list[int]:
    return [c.block_m, c.block_n, c.block_k, c.warps, c.stages]


def sweep_best(sweep: tuple[cc.Config, ...], c: int, run: Callable[[cc.Config], object],
               label: str = "", block_n_max: int = cc.N_PAD) -> dict:
    """Time `run(config)` for each launch shape of `sweep` (its reduction step narrowed to the
    widest that divides the c input channels, its block_n to `block_n_max`); the fastest as
    a row's best_ms / best_config ({} when none ran: a shape that does not fit is skipped)."""
    best = None
    for s in sweep:
        bk = next(b for b in (128, 64, 32, 16) if b <= s.block_k and c % b == 0)
        s = cc.Config(s.block_m, min(s.block_n, block_n_max), bk, s.warps, s.stages)
        try:
            ms = timed_ms(lambda s=s: run(s))
        except Exception as e:  # a shape that does not fit (registers, shared memory)
            print(f"  {label}{s}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        if best is None or ms < best[0]:
            best = (ms, s)
    return {} if best is None else {"best_ms": round(best[0], 4), "best_config": _cfg(best[1])}


def wall_ms(fn: Callable[[], object], n: int = 10) -> float:
    """Wall time per call, synchronised (the codec may run on streams of its own)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


def conv_rows(streams: list[int], sweep: tuple[cc.Config, ...],
              fast_sine: bool = True) -> list[dict]:
    torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = True, 3
    rows = []
    for n in streams:
        for c, t in LEVELS:
            for k, d in ((7, 9), (7, 3), (7, 1), (1, 1)):
                row = conv_row(n, c, t, k, d, sweep, fast_sine)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def conv_row(streams: int, c: int, t: int, k: int, d: int,
             sweep: tuple[cc.Config, ...], fast_sine: bool = True, device: str = "cuda") -> dict:
    """One conv of c -> c channels over `streams` x t samples: cuDNN + its pass vs fused
    (the sweep's Snake epilogues with the hardware sine where `fast_sine`, as the engine's
    `build_ops` runs them by default)."""
    dt = torch.bfloat16
    P = (k - 1) * d
    x = torch.randn(streams, P + t, c, device=device, dtype=dt).transpose(1, 2)
    w = (torch.randn(c, c, k, device=device) / (c * k) ** 0.5).to(dt)
    bias = torch.randn(c, device=device, dtype=dt) * 0.1
    alpha = torch.rand(c, device=device, dtype=dt) + 0.3
    res = torch.randn(streams, t, c, device=device, dtype=dt).transpose(1, 2)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    ep = {"alpha": alpha} if k == 7 else {"residual": res}
    taps = cc.conv_taps(w)

    def cudnn() -> torch.Tensor:  # the engine's path before: conv, then one pass
        y = F.conv2d(x.unsqueeze(2), w4, None, 1, 0, (1, d)).squeeze(2)
        return snake(y, alpha, bias) if k == 7 else bias_residual(res, y, bias)

    def fused(cfg: cc.Config | None = None, fast_sine: bool = False) -> torch.Tensor:
        return cc.causal_conv(x, w, bias, d, taps=taps, config=cfg, fast_sine=fast_sine, **ep)

    flop = 2 * streams * t * c * c * k
    cfg = cc.config_for(streams * t, c, c)
    ms = timed_ms(fused)
    row: dict = {"streams": streams, "channels": c, "samples": t, "k": k, "dilation": d,
                 "cudnn_ms": round(timed_ms(cudnn), 4), "fused_ms": round(ms, 4),
                 "fused_config": _cfg(cfg), "fused_tflops": round(flop / ms / 1e9, 1),
                 "max_abs_vs_cudnn": round(float((fused().float() - cudnn().float())
                                                 .abs().max()), 4)}
    if k == 7:  # the Snake epilogue with the hardware sine (csrc's pass uses it too)
        fast = timed_ms(lambda: fused(fast_sine=True))
        row.update(fused_fast_sine_ms=round(fast, 4), max_abs_fast_vs_accurate_sine=round(
            float((fused(fast_sine=True).float() - fused().float()).abs().max()), 4))
    if sweep:
        row.update(sweep_best(sweep, c, lambda s: fused(s, fast_sine and k == 7)))
        if "best_ms" in row:
            row["best_tflops"] = round(flop / row["best_ms"] / 1e9, 1)
    return row


UNIT_SWEEP = tuple(cc.Config(*c) for c in (  # the fused unit: block_n is its k=1 chunk
    (64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (32, 64, 64, 4, 3), (64, 32, 64, 4, 3),
    (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (64, 64, 32, 4, 4), (32, 128, 64, 4, 2)))


def unit_rows(streams: list[int], sweep: tuple[cc.Config, ...], conv_table: list[dict],
              fast_sine: bool = True) -> list[dict]:
    """The fused residual unit (`cc.residual_unit`) against its two convs as the plan made
    of `conv_table` (this run's conv rows) runs them, at every unit shape it takes (<= 256
    channels) and dilation: the table's "units" rows."""
    plan = cc.plan_from({"convs": conv_table})
    rows = []
    for n in streams:
        for c, t in LEVELS:
            if c > cc.UNIT_MAX_C:
                continue
            for d in (9, 3, 1):
                row = unit_row(n, c, t, d, plan, sweep, fast_sine)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def unit_row(streams: int, c: int, t: int, d: int, plan: cc.Plan, sweep: tuple[cc.Config, ...],
             fast_sine: bool = True, device: str = "cuda") -> dict:
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dt)

    P = 6 * d
    xx = randn(streams, P + t, c).transpose(1, 2)
    x = randn(streams, t, c).transpose(1, 2)
    w7, w1 = randn(c, c, 7, scale=(7 * c) ** -0.5), randn(c, c, 1, scale=c ** -0.5)
    b7, b1 = randn(c, scale=0.1), randn(c, scale=0.1)
    a2 = (torch.rand(c, device=device, generator=g) + 0.3).to(dt)
    taps7, taps1 = cc.conv_taps(w7), cc.conv_taps(w1)
    w7_4, w1_4 = (w.unsqueeze(2).contiguous(memory_format=torch.channels_last) for w in (w7, w1))
    m = streams * t
    cfg7, cfg1 = plan.choose(c, 7, d, m), plan.choose(c, 1, 1, m)

    def two_convs() -> torch.Tensor:  # the unit as the plan runs it without the fused unit
        if cfg7 is not None:
            h = cc.causal_conv(xx, w7, b7, d, alpha=a2, taps=taps7, config=cfg7,
                               fast_sine=fast_sine)
        else:
            h = snake(F.conv2d(xx.unsqueeze(2), w7_4, None, 1, 0, (1, d)).squeeze(2), a2, b7)
        if cfg1 is not None:
            return cc.causal_conv(h, w1, b1, 1, residual=x, taps=taps1, config=cfg1)
        return bias_residual(x, F.conv2d(h.unsqueeze(2), w1_4).squeeze(2), b1)

    def unit(cfg: cc.Config | None = None) -> torch.Tensor:
        return cc.residual_unit(x, xx, w7, b7, d, a2, w1, b1, taps7=taps7, taps1=taps1,
                                config=cfg, fast_sine=fast_sine)

    cfg = cc.unit_config_for(m, c)
    row: dict = {"streams": streams, "channels": c, "samples": t, "dilation": d,
                 "two_convs_ms": round(timed_ms(two_convs), 4),
                 "two_convs_fused": [cfg7 is not None, cfg1 is not None],
                 "unit_ms": round(timed_ms(unit), 4), "unit_config": _cfg(cfg),
                 "max_abs_vs_two_convs": round(float((unit().float() - two_convs().float())
                                                     .abs().max()), 4)}
    row.update(sweep_best(sweep, c, unit, "unit ", block_n_max=cc._pow2(c)))
    return row


# the decoder blocks' transposed convs: (input channels, input samples per stream for 8
# frames, stride); kernel 2 * stride, output channels half the input's
UPS = ((1536, 32, 8), (768, 256, 8), (384, 2048, 4), (192, 8192, 2))


def up_rows(streams: list[int], sweep: tuple[cc.Config, ...]) -> list[dict]:
    """Each transposed conv as the fused conv over its input (`cc.upsample`) against cuDNN's
    channels-last transposed conv with its bias (what the codec runs without it): the
    table's "ups" rows."""
    rows = []
    for n in streams:
        for c, t, s in UPS:
            row = up_row(n, c, t, s, sweep)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def up_row(streams: int, c: int, t: int, s: int, sweep: tuple[cc.Config, ...],
           device: str = "cuda") -> dict:
    dt, k, cout = torch.bfloat16, 2 * s, c // 2
    g = torch.Generator(device=device).manual_seed(0)
    xx = torch.randn(streams, 1 + t, c, device=device, generator=g).to(dt).transpose(1, 2)
    w = (torch.randn(c, cout, k, device=device, generator=g) / (2 * c) ** 0.5).to(dt)
    b = (torch.randn(cout, device=device, generator=g) * 0.1).to(dt)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    taps = cc.conv_taps(cc.transposed_weight(w, s))

    def cudnn() -> torch.Tensor:  # CausalConvTranspose1d.stream's conv_cl and slice
        y = F.conv_transpose2d(xx.unsqueeze(2), w4, b, (1, s)).squeeze(2)
        return y[..., s: s + t * s]

    def fused(cfg: cc.Config | None = None) -> torch.Tensor:
        return cc.upsample(xx, w, b, s, taps=taps, config=cfg)

    flop = 2 * streams * t * s * cout * c * 2  # each output sums 2 taps of c inputs
    ms = timed_ms(fused)
    row: dict = {"streams": streams, "channels": c, "samples": t, "k": k, "stride": s,
                 "cudnn_ms": round(timed_ms(cudnn), 4), "fused_ms": round(ms, 4),
                 "fused_config": _cfg(cc.config_for(streams * t, s * cout, c)),
                 "fused_tflops": round(flop / ms / 1e9, 1),
                 "max_abs_vs_cudnn": round(float((fused().float() - cudnn().float())
                                                 .abs().max()), 4)}
    row.update(sweep_best(sweep, c, fused, "up "))
    if "best_ms" in row:
        row["best_tflops"] = round(flop / row["best_ms"] / 1e9, 1)
    return row


def _tick_ms(dec, streams: int, frames: int) -> float:  # type: ignore[no-untyped-def]
    sids = [dec.open() for _ in range(streams)]
    chunk = {s: torch.randint(0, 1024, (10, frames)) for s in sids}
    with torch.inference_mode():
        ms = wall_ms(lambda: dec.decode(chunk))
    for s in sids:
        dec.close(s)
    return ms


def tick_rows(table: str | None) -> dict:
    """Graphed ticks with the fused convs where the plan (`table`: this run's measurement,
    else the committed one) chose them, as the engine runs them (the hardware sine), then
    with Triton's accurate sine, with `snake_into_next`, and with cuDNN everywhere, and each one's bf16 audio (64 streams in 8-frame ticks) against the float32
    offline decode."""
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.ops import build_ops

    out: dict = {}
    g = torch.Generator().manual_seed(0)
    same = torch.randint(0, 1024, (1, 10, 32), generator=g)
    ref = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda", dtype=torch.float32)
    with torch.inference_mode():
        want = ref.decode(same.cuda())[0, 0].float().cpu()
    del ref
    codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda", dtype=torch.bfloat16)
    keys = [(64, 8), (64, 2), (16, 4), (1, 2), (1, 8)]
    plan_ops = build_ops("cuda", **({"codec_conv_table": Path(table)} if table else {})).codec
    print(f"plan: {plan_ops.conv_plan}", flush=True)
    variants = [("plan", plan_ops),  # the engine's codec: the hardware sine, no chaining
                ("plan_accurate_sine", dataclasses.replace(plan_ops, conv_fast_sine=False)),
                ("plan_snake_into_next", dataclasses.replace(plan_ops, snake_into_next=True)),
                ("cudnn", build_ops("cuda", codec_conv_kernel=False).codec)]
    for name, ops in variants:
        dec = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096, ops=ops)
        t0 = time.perf_counter()
        dec.capture(keys=keys)
        row: dict = {"fused_convs": sum(cfg is not None for *_, cfg in ops.conv_plan.rows)
                     if ops.conv_plan is not None else 0,
                     "fused_units": sum(cfg is not None for *_, cfg in ops.conv_plan.units)
                     if ops.conv_plan is not None else 0,
                     "fused_ups": sum(cfg is not None for *_, cfg in ops.conv_plan.ups)
                     if ops.conv_plan is not None else 0,
                     "capture_s": round(time.perf_counter() - t0, 1)}
        for streams, frames in keys[:4]:
            ms = _tick_ms(dec, streams, frames)
            row[f"{streams}x{frames}_ms"] = round(ms, 2)
            row[f"{streams}x{frames}_x_realtime"] = round(streams * frames * 2048 / 44100
                                                          / ms * 1000, 1)
        # the same codes on 64 streams in 8-frame ticks: the 64 x 8 tick's convs (the plan's
        # choices there), stream 0's audio compared
        sids = [dec.open() for _ in range(64)]
        with torch.inference_mode():
            got = torch.cat([dec.decode({s: same[0, :, a:a + 8] for s in sids})[sids[0]]
                             .float().cpu() for a in range(0, 32, 8)])
        for s in sids:
            dec.close(s)
        err = got - want
        row["rel_l2_vs_fp32"] = round(float(err.norm() / want.norm()), 5)
        row["max_abs_vs_fp32"] = round(float(err.abs().max()), 5)
        print(json.dumps({name: row}), flush=True)
        out[name] = row
        del dec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time every launch shape of SWEEP")
    ap.add_argument("--wide", action="store_true",
                    help="with --sweep, also the shapes of WIDE (128-channel reduction steps, "
                         "deeper pipelines, 8 warps per 128 x 128 tile)")
    ap.add_argument("--streams", default="64",
                    help="comma-separated streams per tick (8 frames each) to time the convs at")
    ap.add_argument("--accurate-sine", action="store_true",
                    help="sweep the Snake convs with Triton's accurate sine (default: the "
                         "hardware sine, which the engine's build_ops runs)")
    ap.add_argument("--no-ticks", action="store_true", help="the convs only")
    ap.add_argument("--ticks-only", action="store_true",
                    help="the ticks only (the committed plan against cuDNN)")
    ap.add_argument("--json", help="write the results here (a table the codec can load: "
                    "build_ops(codec_conv_table=), engine/kernels/codec_conv_table.json)")
    a = ap.parse_args(argv)
    if not cc.available():
        print("codec_conv_bench needs a CUDA device and Triton")
        return 2
    streams = [int(v) for v in a.streams.split(",")]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "sweep_fast_sine": not a.accurate_sine,
                    "convs": [] if a.ticks_only else conv_rows(
                        streams, (SWEEP + (WIDE if a.wide else ())) if a.sweep else (),
                        fast_sine=not a.accurate_sine)}
    if not a.ticks_only:  # the fused residual unit against its two convs as planned above,
        # and the transposed convs as the fused conv against cuDNN's
        report["units"] = unit_rows(streams, UNIT_SWEEP if a.sweep else (), report["convs"],
                                    fast_sine=not a.accurate_sine)
        report["ups"] = up_rows(streams, (SWEEP + (WIDE if a.wide else ())) if a.sweep else ())
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if not a.no_ticks:  # with this run's plan where it swept, else the committed one
        report["ticks"] = tick_rows(a.json if a.sweep and not a.ticks_only else None)
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
