"""One-shot GPU check + timing at S2-Pro shapes (dummy bf16 weights).

    python scripts/gpu_bench.py [--out DIR] [--batches 1,4,16,64] [--frames 40]

1. correctness on the device: the reference fixtures' greedy frames (float32, TF32 off), when
   a fixture set is found (RTVOICE_FIXTURES or tests/fixtures/fish_s2_tiny);
2. s2-pro, bf16, dummy weights: prefill time, a short greedy generation at batch 1 with the
   per-frame time, and the eager decode step time at several batch sizes;
3. the s2-pro codec (dummy weights): offline decode speed and a batched streaming tick.
Prints one JSON document (also written to DIR/gpu_bench.json).

    python scripts/gpu_bench.py --summarise-step DIR/gpu_bench.json [--label NAME]

prints the frame-step profiles of such a document cut to their figures (graph ms, frames/s,
kernels, kernel ms by category, the top kernels) as compact JSON, and one line per profile
on stderr (`STEP_TABLES` in gpu_all.sh).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# the repository's packages (engine, bench_latency) without an install: the device machine
# runs this from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.config import (  # after the path: a plain checkout
    ATTENTION_TRITON_ROWS,
    DECODE_ROPE_ROWS,
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fixture_check(report: dict, device: str) -> None:
    root = Path(os.environ.get("RTVOICE_FIXTURES", "tests/fixtures/fish_s2_tiny"))
    if not (root / "config.json").is_file():
        report["fixtures"] = f"skipped: no fixture set at {root}"
        return
    from engine import verify_reference
    from engine.ops import build_ops

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for mode in ("reference", "compile"):
        ops = build_ops(device, fused=mode)
        checks = list(verify_reference.model_checks(root, device=device, ops=ops))
        failed = [c for c in checks if not c[1]]
        report[f"fixtures_{mode}"] = {"device": device, "checks": len(checks),
                                      "failed": [list(c) for c in failed],
                                      "details": {c[0]: c[2] for c in checks}}


def s2pro_decode(report: dict, device: str, batches: list[int], frames: int,
                 model: str = "s2-pro", dtype: str = "bf16") -> None:
    from engine.loader import load_bundle
    from engine.prompt import PromptBuilder
    from engine.runner import ModelRunner
    from engine.sampler import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    b = load_bundle(model, device=device, dtype=dtype if device == "cuda" else "fp32",
                    max_seq_len=4096)
    _sync()
    report["s2pro_load_s"] = round(time.perf_counter() - t0, 2)
    if device == "cuda":
        report["gpu_mem_weights_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    max_b = max(batches)
    runner = ModelRunner(b.model, n_rows=max_b, max_len=1024)
    pb = PromptBuilder(b.tokenizer)
    prompt = torch.cat([pb.system(), pb.user_turn("Hello world, this is a benchmark of the "
                                                  "S2-Pro shapes on one GPU.")], dim=1)
    T = prompt.shape[1]
    slots = list(range(max_b))
    greedy = SamplingParams.greedy()
    # prefill (warm once, then timed); row s decodes the blocks of its own context
    runner.prefill(runner.own_blocks(0), prompt[:, :-1], 0)
    _sync()
    t0 = time.perf_counter()
    for s in slots:
        runner.prefill(runner.own_blocks(s), prompt[:, :-1], 0)
    _sync()
    report["prefill_ms_per_seq"] = round(1000 * (time.perf_counter() - t0) / max_b, 2)
    report["prompt_len"] = T
    # greedy generation, batch 1, frame by frame (eager, host reads each frame)
    runner.join(slots[0], greedy, prompt[:, -1], T - 1, frames, 0, runner.own_blocks(0))
    times = []
    gen = []
    for i in range(frames):
        _sync()
        t = time.perf_counter()
        out = runner.step(1, T + i)
        gen.append(out[0, : b.model.cfg.frame_rows].cpu())  # the host reads every frame
        times.append(time.perf_counter() - t)
    codes = torch.stack(gen, 1)[1:]
    report["greedy_b1"] = {"frames": frames, "ms_per_frame_median": round(
        1000 * sorted(times)[len(times) // 2], 2), "first_frame_ms": round(1000 * times[0], 2),
        "first_codes": codes[:, :3].tolist()}
    # eager decode step at several batch sizes
    steps = {}
    for bs in batches:
        for s in slots[:bs]:
            runner.join(s, greedy, prompt[:, -1], T - 1, 10**6, s, runner.own_blocks(s))
        for _ in range(3):
            runner.step(bs, T + 64)
        _sync()
        n = 10
        t = time.perf_counter()
        for _ in range(n):
            runner.step(bs, T + 64)
        _sync()
        dt = (time.perf_counter() - t) / n
        steps[bs] = {"ms_per_step": round(1000 * dt, 2), "frames_per_s": round(bs / dt, 1)}
    report["eager_decode"] = steps
    del runner, b
    if device == "cuda":
        torch.cuda.empty_cache()


def codec_tick(dec, streams: int, frames: int, n: int = 5) -> dict:  # type: ignore[no-untyped-def]
    """Time a streaming decoder's tick of `streams` x `frames` (after 3 warm-up ticks): codes
    from the host, as the engine hands them over; the timing includes the copy out."""
    sids = [dec.open() for _ in range(streams)]
    chunk = {s: torch.randint(0, 1024, (10, frames)) for s in sids}
    with torch.inference_mode():
        for _ in range(3):
            torch.cat(list(dec.decode(chunk).values())).cpu()
        _sync()
        t = time.perf_counter()
        for _ in range(n):
            torch.cat(list(dec.decode(chunk).values())).cpu()
        _sync()
    tick = (time.perf_counter() - t) / n
    for sid in sids:
        dec.close(sid)
    return {"ms_per_tick": round(1000 * tick, 2),
            "x_realtime": round(streams * frames * 2048 / 44100 / tick, 1)}


def kernel_table(prof, categorize, cuda_only: bool = False):  # type: ignore[no-untyped-def]
    """GPU time per category (ms), the kernels as (ms, launches, name), longest first, and the
    number of launches, from a torch.profiler run."""
    cats: dict[str, float] = {}
    top = []
    n_kernels = 0
    for e in prof.key_averages():
        if cuda_only and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not t:
            continue
        n_kernels += e.count
        c = categorize(e.key)
        cats[c] = cats.get(c, 0.0) + t / 1000
        top.append((t / 1000, e.count, e.key))
    top.sort(reverse=True)
    return cats, top, n_kernels


def per_launch_us(prof, names: tuple[str, ...]) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Each launch's GPU microseconds, in launch order, of the kernels whose name contains one
    of `names` (e.g. the slow AR's attention apart from the fast AR's), from a torch.profiler
    run."""
    out: dict[str, list[float]] = {n: [] for n in names}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        for n in names:
            if n in e.name and "combine" not in e.name:
                out[n].append(round(e.time_range.elapsed_us(), 1))
    return out


def codec_bench(report: dict, device: str) -> None:
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.ops import build_ops

    out = {}
    # the same codes through the same weights in float32 and in bf16 (the engine's codec
    # dtype on a GPU): how far bf16 moves the audio
    g = torch.Generator(device="cpu").manual_seed(7)
    same = torch.cat([torch.randint(0, 4096, (1, 1, 64), generator=g),
                      torch.randint(0, 1024, (1, 9, 64), generator=g)], dim=1).to(device)
    audio: dict[str, torch.Tensor] = {}
    for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device=device, dtype=dt)
        n_params = sum(p.numel() for p in codec.parameters())
        with torch.inference_mode():
            audio[dt_name] = codec.decode(same)[0, 0].float().cpu()
        for bs in (1, 16):  # offline: the torch ops (the reference path)
            codes = torch.randint(0, 1024, (bs, 10, 64), device=device)
            with torch.inference_mode():
                codec.decode(codes)
                _sync()
                t = time.perf_counter()
                codec.decode(codes)
                _sync()
            dt_s = time.perf_counter() - t
            audio_s = bs * 64 * 2048 / 44100
            out[f"offline_{dt_name}_b{bs}"] = {
                "x_realtime": round(audio_s / dt_s, 1), "ms": round(1000 * dt_s, 1)}
        # streaming ticks below: with csrc's Snake and bias kernels (EngineConfig.codec_kernels,
        # the engine's default), keys say "_kernels"
        ops = build_ops(device).codec
        tag = "_kernels" if ops.fold_bias else ""
        graphed = None
        if device == "cuda" and dt == torch.bfloat16:  # the engine's setting on a GPU
            graphed = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096,
                                       ops=ops)
            # only the buckets timed below (the engine captures every bucket: its start)
            out["graphs_capture_s"] = round(graphed.capture(
                keys=[(16, 4), (64, 2), (64, 8), (1, 2)]), 2)
        for name, dec, streams, frames in (("eager", StreamingDecoder(codec, max_streams=64,
                                                                      ops=ops), 16, 4),
                                           ("graphs", graphed, 16, 4), ("graphs", graphed, 64, 2),
                                           ("graphs", graphed, 64, 8), ("graphs", graphed, 1, 2)):
            if dec is not None:
                out[f"stream_{dt_name}_{name}_{streams}x{frames}frames{tag}"] = \
                    codec_tick(dec, streams, frames)
        if graphed is not None:
            # the same tick with channels-first activations (conv1d: cuDNN transposes each
            # conv's input and output to NHWC and back): what the channels-last layout saves
            cf = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096,
                                  ops=build_ops(device, codec_channels_last=False).codec)
            cf.capture(keys=[(64, 8)])
            out[f"stream_{dt_name}_graphs_64x8frames{tag}_channels_first"] = codec_tick(cf, 64, 8)
            del cf
        out["params"] = n_params
        del codec, dec
    ref, err = audio["fp32"], audio["bf16"] - audio["fp32"]
    out["bf16_vs_fp32"] = {"frames": 64, "rel_l2": round(float(err.norm() / ref.norm()), 5),
                           "snr_db": round(float(20 * torch.log10(ref.norm() / err.norm())), 1),
                           "max_abs": round(float(err.abs().max()), 5),
                           "fp32_peak": round(float(ref.abs().max()), 4)}
    report["codec_s2pro"] = out


def codec_profile(report: dict, device: str) -> None:
    """Where a batched streaming codec tick's GPU time goes, in the engine's setting (bf16,
    csrc kernels): per (streams, frames) shape the graphed tick's time and kernels (one
    profiled replay), and the eager tick's GPU time by kernel category and convolution shape.
    Shapes 64x2 against 64x8 split a tick into a fixed and a per-frame part."""
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.ops import build_ops

    out: dict = {}
    report["codec_profile"] = out
    codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device=device, dtype=torch.bfloat16)
    ops = build_ops(device).codec
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    graphed = None
    if device == "cuda":
        graphed = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096,
                                   ops=ops)
        out["capture_s"] = round(graphed.capture(), 2)
    for streams, frames in ((64, 8), (64, 2), (16, 4), (1, 2)):
        row: dict = {"kernels": ops.fold_bias}
        for name, dec in (("graphs", graphed),
                          ("eager", StreamingDecoder(codec, max_streams=64, ops=ops))):
            if dec is None:
                continue
            row[f"{name}_tick"] = codec_tick(dec, streams, frames)
            sids = [dec.open() for _ in range(streams)]
            chunk = {s: torch.randint(0, 1024, (10, frames)) for s in sids}
            with torch.inference_mode():
                for _ in range(3):
                    dec.decode(chunk)
                _sync()
                with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
                    dec.decode(chunk)
                    _sync()
            for sid in sids:
                dec.close(sid)
            cats, kernels, n = kernel_table(prof, _codec_category, cuda_only=True)
            row[name] = {"gpu_ms": round(sum(cats.values()), 2), "kernel_launches": n,
                         "ms_by_category": {k: round(v, 2) for k, v in sorted(cats.items())},
                         "top_kernels": [(round(t, 3), c, k[:90]) for t, c, k in kernels[:16]]}
            if name == "eager":
                convs = []
                for e in prof.key_averages(group_by_input_shape=True):
                    if e.key == "aten::_convolution":  # conv and transposed conv, once each
                        t = getattr(e, "device_time_total", None) or 0.0
                        convs.append((round(t / 1000, 3), e.count,
                                      str(e.input_shapes[:2])[:70]))
                convs.sort(reverse=True)
                row[name]["convs_by_shape"] = convs[:16]
        out[f"{streams}x{frames}"] = row
        print(json.dumps({"codec_profile": {f"{streams}x{frames}": row}}, default=str)[:3000],
              flush=True)


def _codec_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("conv", "cudnn", "implicit", "xmma", "winograd", "fft", "wgrad",
                            "dgrad", "fprop")):
        return "conv"
    if any(k in n for k in ("sin", "pow", "reciprocal", "snake", "pointwise_kernel",
                            "pointwise_cl_kernel")):
        return "snake/pointwise"  # torch's Snake parts, or csrc's Snake and bias kernels
    if "cat" in n:
        return "cat"
    return _category(name)


def engine_sweep(report: dict, device: str, levels: list[int], frames: int,
                 only: set[str] | None = None, save: Callable[[], None] | None = None,
                 dtype: str = "bf16", attn_rows: int | None = None,
                 rope_rows: int | None = None) -> None:
    """The engine end to end (frames -> batched codec -> PCM): pingpong vs graphs vs naive
    (the engine's attention_triton_rows; `attn_rows` given: also the *_attn_triton runs,
    with EngineConfig.attention_triton_rows = attn_rows — 0: csrc's kernel at every batch —
    and, given, decode_rope_rows = `rope_rows` for the slow AR only)."""
    tri = dict(attention_triton_rows=attn_rows,
               **({} if rope_rows is None else {"decode_rope_rows": rope_rows,
                                                "fast_decode_rope_rows": DECODE_ROPE_ROWS}))
    from bench_latency.engine_throughput import DeviceStalled, sweep
    from engine.loader import load_bundle

    b = load_bundle("s2-pro", device=device, dtype=dtype, codec_dtype="bf16", max_seq_len=1024)
    out: dict = {}
    report["engine"] = out  # filled run by run: a cut or failed sweep keeps what finished
    ends = [levels[0], 64] if 64 in levels else [levels[0], levels[-1]]
    low, high = [c for c in levels if c <= 64], [c for c in levels if c > 64]
    hi = max(low or levels)  # the variants' level: 64 where the sweep reaches it
    runs = [("pingpong_codec", low, dict(mode="pingpong", codec=True)),
            # the naive loop at the lowest level only (at 64 its eager steps, ~100 ms each,
            # would take the rest of a 10-minute device call); early, so that a time-boxed
            # sweep keeps the side-by-side comparison
            ("naive_nocodec", levels[:1], dict(mode="naive", codec=False, fused_ops="reference")),
            # the stream-priority and prefill-batch choices, at the top level only (the
            # default: all streams at equal priority, prefill batches of 16)
            ("pingpong_codec_decode_priority", [hi], dict(mode="pingpong", codec=True, config=dict(
                high_priority_streams=("decode", "prefill")))),
            ("pingpong_codec_codec_priority", [hi], dict(mode="pingpong", codec=True, config=dict(
                high_priority_streams=("prefill", "codec")))),
            ("pingpong_codec_prefill_batch_64", [hi], dict(mode="pingpong", codec=True,
                                                           config=dict(prefill_batch=64))),
            # decode and prefill always sharing the GPU (no pause for a burst of prefills)
            ("pingpong_codec_no_prefill_first", [hi], dict(mode="pingpong", codec=True,
                                                           config=dict(prefill_first_lead_s=0.0))),
            # the earlier two-frame first chunk (the default is one: first audio a step sooner)
            ("pingpong_codec_first_chunk_2", [levels[0], hi], dict(mode="pingpong", codec=True,
                                                                   config=dict(first_chunk_frames=2))),
            ("pingpong_codec_split_kv", levels[:1], dict(mode="pingpong", codec=True,
                                                         config=dict(split_kv=True))),
            # every sequence with a 10 s cloned voice (215 frames): turns decode past it
            ("pingpong_codec_voice", [levels[0], hi], dict(mode="pingpong", codec=True,
                                                           ref_frames=215)),
            ("pingpong_nocodec", ends, dict(mode="pingpong", codec=False)),
            # FP8 with the table's W8A8 rows allowed (EngineConfig.fp8_activations: other
            # numerics, where a recorded W8A8 GEMM beat the weight-only and dense paths)
            *((("pingpong_nocodec_w8a8", ends, dict(mode="pingpong", codec=False,
                                                     config=dict(fp8_activations=True))),)
              if dtype == "fp8" else ()),
            # the slow AR's attention switched at attn_rows rows instead of the engine's
            # default (only with --attn-triton: not in a default sweep)
            # (and, every sequence on one 10 s voice whose KV the pool holds once, csrc's,
            # the Triton kernel's and the Triton kernel with that prefix read once per 16
            # rows: EngineConfig.attention_shared_prefix)
            *((("pingpong_nocodec_attn_triton", ends, dict(mode="pingpong", codec=False,
                                                            config=tri)),
               ("pingpong_nocodec_voice", [hi], dict(mode="pingpong", codec=False,
                                                     ref_frames=215)),
               ("pingpong_nocodec_voice_attn_triton", [hi], dict(
                   mode="pingpong", codec=False, ref_frames=215, config=tri)),
               ("pingpong_nocodec_voice_attn_triton_shared", [hi], dict(
                   mode="pingpong", codec=False, ref_frames=215,
                   config=tri | {"attention_shared_prefix": True})),
               ("pingpong_codec_voice_attn_triton", [levels[0], hi], dict(
                   mode="pingpong", codec=True, ref_frames=215, config=tri)),
               ("pingpong_codec_voice_attn_triton_shared", [levels[0], hi], dict(
                   mode="pingpong", codec=True, ref_frames=215,
                   config=tri | {"attention_shared_prefix": True})))
              if attn_rows is not None else ()),
            # a lone turn in an engine of `hi` rows (the server's case: its bucket is the
            # two-row step) against the same with the one-row bucket
            # (EngineConfig.one_row_bucket); the sweep's own c=1 engines have one row only
            ("pingpong_nocodec_rows", levels[:1], dict(mode="pingpong", codec=False,
                                                       config=dict(max_running=hi))),
            ("pingpong_nocodec_rows_one_row", levels[:1], dict(
                mode="pingpong", codec=False,
                config=dict(max_running=hi, one_row_bucket=True))),
            ("pingpong_unfused_nocodec", ends, dict(mode="pingpong", codec=False,
                                                    fused_ops="reference")),
            ("graphs_sync_nocodec", ends, dict(mode="graphs", codec=False)),
            # levels above 64 (128 slots) last: a time-boxed sweep cuts them first
            ("pingpong_codec", high, dict(mode="pingpong", codec=True))]
    for name, lv, kw in runs:
        if (only and name not in only) or not lv:
            continue
        rows: list = out.setdefault(name, [])  # a name may run twice (levels above 64 last)
        try:
            rows += sweep(b, lv, frames if kw["mode"] != "naive" else frames // 2, **kw)
        except DeviceStalled as e:  # the process is wedged: report and let main() exit
            rows.append({"levels": lv, "error": f"{type(e).__name__}: {e}"})
            raise
        except Exception as e:  # keep the other runs (and this run's earlier rows)
            rows.append({"levels": lv, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps({name: rows}), flush=True)
        if save is not None:  # a sweep cut by its time box still leaves the finished runs
            save()
    del b
    torch.cuda.empty_cache()


def _category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "splitk")):
        return "gemm"
    if any(k in n for k in ("fmha", "flash", "attention", "sdpa", "efficient")):
        return "attention"
    if any(k in n for k in ("sort", "topk", "radix", "select")):
        return "sort/topk"
    if "triton" in n:
        return "fused (triton)"
    if any(k in n for k in ("index", "scatter", "gather")):
        return "index"
    if any(k in n for k in ("memcpy", "memset", "copy")):
        return "copy"
    return "elementwise/other"


def profile_step(report: dict, device: str, sampler_kernel: bool = True,
                 dtype: str = "bf16", decode_rope: int | None = None, pdl: int | None = None,
                 batches: tuple[int, ...] = (1, 2, 16, 64),
                 normed_fp8: int | None = None, dense_copy: bool = True,
                 attend_prologue: bool = False, fp8_activations: bool = False,
                 step_book: bool = True, attn_triton: int = ATTENTION_TRITON_ROWS,
                 decode_rope_fast: int | None = None) -> None:
    """Where one frame step's GPU time goes (eager, fused ops), and graph-replay step time.
    `decode_rope`: the q/k norm + RoPE inside decode attention up to that many rows (key
    profile_decode_rope<rows>; None: the engine's default);
    `pdl`: csrc's PDL mode (0: plain launches, 1: PDL, 2, 3: the linears' other modes; key
    profile_pdl<mode>); None (key profile): the engine's `pdl=auto`, PDL for FP8 only;
    `normed_fp8`: FP8 weights take the normed prologue up to this many rows (key
    profile_fp8_normed); `dense_copy`: FP8 linears get their bf16 copies where the table
    measured them faster, as the engine's fp8_dense_copy does (False: key
    profile_fp8_nodense); `attend_prologue`: the fast AR's attention in wo's prologue at up
    to 2 rows (key profile_attend; the engine's default: its own launches);
    `fp8_activations`: FP8 linears may take the table's W8A8 rows, as the engine's
    --fp8-activations (key profile_fp8_w8a8); `step_book` False: the step's bookkeeping as
    the compiled functions, not csrc's kernels (key profile_compiled_book); `attn_triton`:
    the slow AR's attention as the Triton tile kernel from that many rows (0: csrc's kernel
    at every batch; other than the engine's default: key profile_attn_triton); `decode_rope_fast`: the fast AR's fold apart from `decode_rope`
    (None: the same)."""
    from engine.engine import add_fp8_copies
    from engine.fusion import pack_ffn
    from engine.loader import load_bundle
    from engine.ops import build_ops
    from engine.runner import ModelRunner
    from engine.sampler import SamplingParams

    b = load_bundle("s2-pro", device=device, dtype=dtype, max_seq_len=1024)
    ops = build_ops(device, fused="compile", sampler_kernel=sampler_kernel,
                    **({} if decode_rope is None else {"decode_rope": decode_rope}),
                    decode_rope_fast=decode_rope_fast, fp8_dense=dense_copy, attend_prologue=attend_prologue,
                    fp8_activations=fp8_activations, book_kernels=step_book,
                    attention_triton_rows=attn_triton,
                    **({} if normed_fp8 is None else {"normed_max_m_fp8": normed_fp8}),
                    pdl=(1 if dtype == "fp8" else 0) if pdl is None else pdl)
    pack_ffn(b.model)
    # the copies the engine makes (none without dense_copy; rowwise ones with fp8_activations)
    add_fp8_copies(b.model, ops.dense_plan, ops.rowwise_plan)
    out = {}
    runner = ModelRunner(b.model, n_rows=64, max_len=1024, ops=ops)
    col = torch.zeros(11, dtype=torch.long)
    col[0] = b.model.cfg.ids.semantic_start + 5
    # B=2: what the engine runs for one speaking turn with compiled ops (its smallest decode
    # bucket; the second row inactive), beside B=1, the step of one row alone
    for B in batches:
        active = 1 if B == 2 else B
        for s in range(active):
            runner.join(s, SamplingParams.greedy(), col, 200, 10**6, s, runner.own_blocks(s))
        for _ in range(3):
            runner.step(B, 256)
        _sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner.step(B, 256)
            _sync()
        cats, kernels, n_kernels = kernel_table(prof, _category)
        launches = per_launch_us(prof, ("decode_attention", "sample_topk"))
        top = [(t, c, k[:90]) for t, c, k in kernels]
        by_count = sorted(((c, round(t, 3), k) for t, c, k in top), reverse=True)[:40]
        g = torch.cuda.CUDAGraph()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            runner.step(B, 256)
        torch.cuda.current_stream().wait_stream(st)
        _sync()
        with torch.cuda.graph(g):
            runner.step(B, 256)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        e0.record()
        for _ in range(50):
            g.replay()
        e1.record()
        _sync()
        out[B] = {"graph_ms_per_step": round(e0.elapsed_time(e1) / 50, 3),
                  "graph_frames_per_s": round(active * 50 / (e0.elapsed_time(e1) / 1000), 1),
                  "eager_kernel_ms_by_category": {k: round(v, 3) for k, v in sorted(cats.items())},
                  "kernels_per_step": n_kernels,
                  "top_kernels_ms": [[round(t, 3), c, k] for t, c, k in top[:12]],
                  "most_launched": [list(x) for x in by_count],
                  # in launch order: the slow AR's layers, then the fast AR's codebook steps
                  "per_launch_us": launches}
        print(json.dumps({B: out[B]})[:1500], flush=True)
        del g
    report[("profile_attn_triton" + (f"_rope{decode_rope}" if decode_rope is not None else ""))
           if attn_triton != ATTENTION_TRITON_ROWS
           else f"profile_decode_rope{decode_rope}" if decode_rope is not None
           else f"profile_pdl{pdl}" if pdl is not None
           else "profile_fp8_normed" if normed_fp8 is not None
           else "profile_fp8_nodense" if not dense_copy
           else "profile_attend" if attend_prologue
           else "profile_fp8_w8a8" if fp8_activations
           else "profile_compiled_book" if not step_book
           else "profile" if sampler_kernel else "profile_compiled_sampler"] = out
    del runner, b
    torch.cuda.empty_cache()


STEP_FIGURES = ("graph_ms_per_step", "graph_frames_per_s", "kernels_per_step",
                "eager_kernel_ms_by_category")


def summarise_step(report: dict, top: int = 8) -> dict:
    """The frame-step profiles of a gpu_bench report (keys profile*) cut to STEP_FIGURES and
    the `top` costliest kernels (names cut to 90 characters), per batch."""
    out: dict = {}
    for key, batches in report.items():
        if not key.startswith("profile") or not isinstance(batches, dict):
            continue
        out[key] = {b: {**{f: row[f] for f in STEP_FIGURES if f in row},
                        "top_kernels_ms": [[t, c, k[:90]] for t, c, k in
                                           row.get("top_kernels_ms", [])[:top]]}
                    for b, row in batches.items()}
    return out


def step_line(summary: dict, label: str) -> str:
    """One line: each profile's graph ms per step / kernels per step by batch."""
    parts = [f"{key} " + " ".join(f"B{b} {row.get('graph_ms_per_step')} ms "
                                  f"{row.get('kernels_per_step')} kernels"
                                  for b, row in batches.items())
             for key, batches in summary.items()]
    return f"{label}: " + ("; ".join(parts) if parts else "no step profile")


def summarise_step_file(path: Path, label: str) -> int:
    """--summarise-step: a finished run's report cut to its step figures (no CUDA needed)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"{label}: no readable report at {path} ({e})", file=sys.stderr)
        return 1
    summary = summarise_step(report)
    print(json.dumps({"label": label, **summary}, separators=(",", ":")))
    print(step_line(summary, label), file=sys.stderr)
    return 0 if summary else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarise-step", type=Path, default=None, metavar="REPORT",
                    help="only cut a finished run's gpu_bench.json to its step figures")
    ap.add_argument("--label", default="step", help="--summarise-step's name for the run")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--skip", default="", help="comma list of: fixtures,decode,codec,codec_profile,profile,engine")
    ap.add_argument("--levels", default="1,4,16,32,64")
    ap.add_argument("--model", default="s2-pro", help="preset for the decode section")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                    help="the model's weights in the decode, profile and engine sections "
                    "(fp8: FP8 block-scaled linears)")
    ap.add_argument("--compiled-sampler", action="store_true",
                    help="profile the step again with the compiled torch sampler instead of "
                         "csrc's sample_topk (key profile_compiled_sampler)")
    ap.add_argument("--decode-rope", type=int, default=None, metavar="ROWS",
                    help="profile the step again with the q/k norm + RoPE inside decode "
                         "attention up to ROWS rows (0: never; key profile_decode_rope<ROWS>; "
                         "batches 1, 2 and 64)")
    ap.add_argument("--pdl-modes", default="",
                    help="comma list of csrc PDL modes to profile the step again with (0: "
                         "plain launches, 1: PDL; 2, 3: csrc/linear.cu's other modes; keys "
                         "profile_pdl<mode>, batches 1, 2, 64; key profile: the engine's "
                         "pdl=auto, on for FP8 only)")
    ap.add_argument("--fp8-normed", type=int, default=None,
                    help="profile the FP8 step again (batches 1, 2) with the normed prologue "
                    "for FP8 weights up to this many rows, 0: never (key profile_fp8_normed; "
                    "the engine's: engine.kernels.linear.NORMED_DISPATCH_M_FP8)")
    ap.add_argument("--fp8-nodense", action="store_true",
                    help="profile the FP8 step again without the bf16 copies of its linears "
                    "(batches 16, 32, 64; key profile_fp8_nodense)")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="also profile the FP8 step with the table's W8A8 rows allowed, as "
                    "`rtvoice serve --fp8-activations` (batches 1, 2, 16, 64; key "
                    "profile_fp8_w8a8)")
    ap.add_argument("--compiled-book", action="store_true",
                    help="also profile the step with its bookkeeping compiled, not csrc's "
                         "kernels (batches 1, 2, 64; key profile_compiled_book)")
    ap.add_argument("--attn-triton", type=int, default=None, metavar="ROWS",
                    help="also profile the step with the slow AR's attention as the Triton "
                         "tile kernel from ROWS rows, not the engine's "
                         f"{ATTENTION_TRITON_ROWS} (0: csrc's kernel at every batch; "
                         "batches 1, 2, 16, 64; key "
                         "profile_attn_triton; with --decode-rope R also with the q/k norm + "
                         "RoPE folded into it up to R rows, the fast AR's at its default: "
                         "profile_attn_triton_rope<R>), and "
                         "add the engine runs pingpong_nocodec_attn_triton / "
                         "pingpong_codec_voice_attn_triton with it from ROWS rows, and on one "
                         "10 s voice pingpong_nocodec_voice (the engine's default) / "
                         "pingpong_nocodec_voice_attn_triton / *_attn_triton_shared (its "
                         "prefix read once per 16 rows) / "
                         "pingpong_codec_voice_attn_triton_shared")
    ap.add_argument("--attend-prologue", action="store_true",
                    help="also profile the step with the fast AR's attention in its output "
                         "projection's prologue (batches 1, 2; key profile_attend)")
    ap.add_argument("--engine-runs", default="", help="comma list of engine runs to keep "
                    "(pingpong_codec, pingpong_codec_decode_priority, "
                    "pingpong_codec_codec_priority, pingpong_codec_prefill_batch_64, "
                    "pingpong_codec_no_prefill_first, "
                    "pingpong_codec_first_chunk_2, pingpong_codec_split_kv, pingpong_codec_voice, "
                    "pingpong_nocodec, pingpong_nocodec_w8a8 (FP8 only), "
                    "pingpong_nocodec_rows, pingpong_nocodec_rows_one_row, "
                    "pingpong_nocodec_attn_triton, pingpong_codec_voice_attn_triton, "
                    "pingpong_nocodec_voice, pingpong_nocodec_voice_attn_triton, "
                    "pingpong_nocodec_voice_attn_triton_shared, "
                    "pingpong_codec_voice_attn_triton_shared, "
                    "pingpong_unfused_nocodec, "
                    "graphs_sync_nocodec, "
                    "naive_nocodec); default all")
    args = ap.parse_args()
    if args.summarise_step is not None:
        return summarise_step_file(args.summarise_step, args.label)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                    "dtype": args.dtype,
                    "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    skip = set(filter(None, args.skip.split(",")))

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2, default=str))
    for name, fn in (("fixtures", lambda: fixture_check(report, device)),
                     ("decode", lambda: s2pro_decode(report, device,
                                                     [int(x) for x in args.batches.split(",")],
                                                     args.frames, args.model, args.dtype)),
                     ("codec", lambda: codec_bench(report, device)),
                     ("codec_profile", lambda: codec_profile(report, device)),
                     ("profile", lambda: profile_step(report, device, dtype=args.dtype)),
                     ("profile_compiled_sampler",
                      lambda: profile_step(report, device, sampler_kernel=False)),
                     ("profile_decode_rope",
                      lambda: profile_step(report, device, dtype=args.dtype,
                                           decode_rope=args.decode_rope, batches=(1, 2, 64))),
                     *((("profile_fp8_normed",
                         functools.partial(profile_step, report, device, dtype="fp8",
                                           normed_fp8=args.fp8_normed, batches=(1, 2))),)
                       if args.fp8_normed is not None else ()),
                     *((("profile_fp8_nodense",
                         functools.partial(profile_step, report, device, dtype="fp8",
                                           dense_copy=False, batches=(16, 32, 64))),)
                       if args.fp8_nodense else ()),
                     *((("profile_fp8_w8a8",
                         functools.partial(profile_step, report, device, dtype="fp8",
                                           fp8_activations=True)),)
                       if args.fp8_activations else ()),
                     *((("profile_compiled_book",
                         functools.partial(profile_step, report, device, dtype=args.dtype,
                                           step_book=False, batches=(1, 2, 64))),)
                       if args.compiled_book else ()),
                     *((("profile_attn_triton",
                         functools.partial(profile_step, report, device, dtype=args.dtype,
                                           attn_triton=args.attn_triton,
                                           batches=(1, 2, 16, 64))),
                        *((("profile_attn_triton_rope",  # with the q/k norm + RoPE folded in
                            functools.partial(profile_step, report, device, dtype=args.dtype,
                                              attn_triton=args.attn_triton,
                                              decode_rope=args.decode_rope,
                                              decode_rope_fast=DECODE_ROPE_ROWS,
                                              batches=(1, 2, 16, 64))),)
                          if args.decode_rope is not None else ()))
                       if args.attn_triton is not None else ()),
                     *((("profile_attend",
                         functools.partial(profile_step, report, device, dtype=args.dtype,
                                           attend_prologue=True, batches=(1, 2))),)
                       if args.attend_prologue else ()),
                     *((f"profile_pdl{mode}",
                        functools.partial(profile_step, report, device, dtype=args.dtype,
                                          pdl=mode, batches=(1, 2, 64)))
                       for mode in sorted({int(x) for x in args.pdl_modes.split(",") if x})),
                     ("engine", lambda: engine_sweep(report, device,
                                                     [int(x) for x in args.levels.split(",")],
                                                     args.frames,
                                                     set(filter(None, args.engine_runs.split(","))),
                                                     save, args.dtype,
                                                     args.attn_triton,
                                                     args.decode_rope))):
        if name in skip or (name == "profile_compiled_sampler" and not args.compiled_sampler) \
                or (name == "profile_decode_rope" and args.decode_rope is None):
            continue
        t = time.perf_counter()
        stalled = False
        try:
            fn()
        except Exception as e:  # report and go on: one call should bring back everything it can
            report[f"{name}_error"] = f"{type(e).__name__}: {e}"
            stalled = type(e).__name__ == "DeviceStalled"  # the GPU is stuck: nothing more runs
        report[f"{name}_wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({k: v for k, v in report.items()}, default=str)[:2000], flush=True)
        save()  # after every section: a run cut short by its time limit leaves its results
        if stalled:
            os._exit(3)  # not a normal exit: the engine's threads are stuck on the device
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
