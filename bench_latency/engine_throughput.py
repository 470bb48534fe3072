"""Engine-only throughput: N concurrent sequences decoding fixed-length turns, no server.

    python -m bench_latency.engine_throughput --model tiny --concurrency 1,2,4,8 --frames 64
    python -m bench_latency.engine_throughput --model s2-pro --device cuda --concurrency 1,16,64

Turns run to exactly --frames frames (<|im_end|> is masked: random weights would stop at
random points). Reports aggregate frames/s, per-sequence frames/s (decode_tps), the
realtime factor (frames/s ÷ 21.53) and the split of engine time between decode, prefill
and codec. --mode naive|graphs|pingpong; --no-codec skips the audio decoder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import torch

from engine.config import EngineConfig
from engine.engine import CollectingSink, Engine, build_engine
from engine.loader import Bundle, load_bundle
from engine.model import DualAR
from engine.ops import REFERENCE, Ops
from engine.prompt import Reference
from engine.sampler import SamplingParams


@contextlib.contextmanager
def no_eos(model: DualAR) -> Iterator[None]:
    """Fixed-length turns for benchmarks: <|im_end|>'s logit is -inf (it is the last column)."""
    orig = model.semantic_logits

    def masked(h: torch.Tensor, ops: Ops = REFERENCE) -> torch.Tensor:
        out = orig(h, ops)
        out[..., -1] = float("-inf")
        return out

    model.semantic_logits = masked  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.semantic_logits


def _silent_codec(engine: Engine) -> None:
    hop = engine.frame_samples
    engine.codec_worker.decoder.decode = lambda chunks: {  # type: ignore[method-assign]
        sid: torch.zeros(c.shape[1] * hop) for sid, c in chunks.items()}


MODES = {  # name: (cuda_graphs, pingpong threads)
    "naive": (False, False),  # synchronous loop, eager kernels, host reads every step at once
    "graphs": (True, False),  # synchronous loop, CUDA-graph steps
    "pingpong": (True, True),  # prefill/decode/codec threads, graph steps, one-step-late reads
}


class DeviceStalled(RuntimeError):
    """The engine's device waits passed its stall limit: the GPU stopped making progress (the
    process is wedged; later GPU work in it would hang too)."""


def _wait(engine: Engine, event: threading.Event, what: str, c: int, limit_s: float) -> None:
    """Wait for `event`, but give up early (DeviceStalled) when the engine's watchdog says
    the GPU stopped making progress, instead of sitting out `limit_s`."""
    deadline = time.perf_counter() + limit_s
    while not event.wait(0.5):
        if engine.stalled():
            raise DeviceStalled(f"the GPU stopped making progress at c={c} ({what}; waited "
                                f"{engine.device_wait_s():.0f}s on the device)")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} did not finish in {limit_s:.0f}s at c={c}")


def voice_reference(engine: Engine, frames: int) -> list[Reference]:
    """A cloned voice's prompt for benchmarks: `frames` frames of random codes (~21.5 per
    second of reference audio) and a one-sentence transcript; [] for 0. Real sessions carry
    one, so the turns decode at positions past it (longer attention, fuller prefill spans)."""
    if frames <= 0:
        return []
    cfg = engine.model_cfg
    g = torch.Generator().manual_seed(frames)
    codes = torch.randint(0, cfg.codebook_size, (cfg.num_codebooks, frames), generator=g)
    return [Reference("This is the reference speaker reading a sentence aloud.", codes)]


def run_level(engine: Engine, c: int, frames: int, *, threaded: bool,
              ref_frames: int = 0) -> dict[str, float]:
    sinks = [CollectingSink() for _ in range(c)]
    refs = voice_reference(engine, ref_frames)
    seqs = [engine.open(refs, SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
    if threaded:
        for s in sinks:
            _wait(engine, s.ready, "voice prefill", c, 600)
    else:
        engine.run_until_idle()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prompt_len = max(s.pos for s in seqs)  # positions the voice prompts take
    for k in engine.stats:
        engine.stats[k] = 0 if isinstance(engine.stats[k], int) else 0.0
    engine.measure_gaps = threaded and engine.cuda
    t0 = time.perf_counter()
    for i, s in enumerate(seqs):
        engine.submit(s, f"Benchmark sentence number {i}.", turn_id="b", max_frames=frames)
    if threaded:
        for s in sinks:
            _wait(engine, s.done, "turn", c, 3600)
    else:
        engine.run_until_idle(timeout_s=3600)
    wall = time.perf_counter() - t0
    engine.measure_gaps = False
    gaps = engine.gpu_idle_gaps_ms() if threaded and engine.cuda else []
    total = sum(r.frames for s in sinks for r in s.results)
    ttfa = sorted(r.ttfa_s for s in sinks for r in s.results if r.ttfa_s is not None)
    dtps = sorted(r.frames / r.decode_s for s in sinks for r in s.results if r.decode_s > 0)
    # submit -> turn prefilled (queueing + the turn's text prefill): the part of a server's
    # TTFA that `ttfa_ms` (prefilled -> first audio) leaves out
    prefill = sorted(1000 * (r.ready_at - r.submitted_at) for s in sinks for r in s.results
                     if r.ready_at is not None)
    # submit -> first PCM: the engine's whole share of a server's TTFA
    to_audio = sorted(1000 * (r.first_audio_at - r.submitted_at) for s in sinks
                      for r in s.results if r.first_audio_at is not None)
    steps = engine.stats["steps"]
    for s in seqs:
        engine.close(s)
    if not threaded:
        engine.run_until_idle()

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None

    row = {"concurrency": c, "frames": total, "wall_s": round(wall, 3),
           "aggregate_fps": round(total / wall, 1),
           "decode_tps_p50": pct(dtps, 0.5), "decode_tps_min": pct(dtps, 0.0),
           "x_realtime_per_seq": round(total / wall / c / engine.frame_rate, 2),
           "ttfa_ms_p50": pct([1000 * t for t in ttfa], 0.5),
           "turn_prefill_ms_p50": pct(prefill, 0.5), "turn_prefill_ms_max": pct(prefill, 1.0),
           "ttfa_ms_p90": pct([1000 * t for t in ttfa], 0.9),
           "ttfa_ms_max": pct([1000 * t for t in ttfa], 1.0),
           "submit_to_audio_ms_p50": pct(to_audio, 0.5),
           "submit_to_audio_ms_p90": pct(to_audio, 0.9),
           "voice_prompt_frames": ref_frames, "prompt_positions": prompt_len,
           "steps": steps, "wasted_rows": engine.stats["wasted_rows"],
           "codec_s": round(engine.stats["codec_s"], 3),
           # the codec thread's busy share of the wall time (its ticks run on the GPU
           # alongside the decode steps): a proxy for the codec's share of GPU time
           "codec_share": round(engine.stats["codec_s"] / wall, 3) if wall > 0 else None,
           "codec_ticks": engine.stats["codec_ticks"],
           "codec_slow_ticks": engine.stats["codec_slow_ticks"],  # slower than their audio
           "prefill_s": round(engine.stats["prefill_s"], 3),
           # times the decode thread left the GPU to prefills, and for how long in all
           # (EngineConfig.prefill_first_*)
           "decode_pauses": engine.stats["decode_pauses"],
           "decode_paused_ms": round(1000 * engine.stats["decode_paused_s"], 1)}
    if gaps:
        gs = sorted(gaps[2:]) or sorted(gaps)
        row.update(gpu_gap_ms_p50=pct(gs, 0.5), gpu_gap_ms_p90=pct(gs, 0.9),
                   gpu_gap_ms_sum=round(sum(gs), 1))
    return row


def sweep(bundle: Bundle, levels: list[int], frames: int, *, mode: str = "pingpong",
          codec: bool = True, max_len: int = 1024, fused_ops: str = "auto",
          config: dict | None = None, ref_frames: int = 0) -> list[dict]:
    """One engine per level; `config`: EngineConfig fields that override the mode's (variants
    to compare); `ref_frames`: every sequence carries a voice prompt of that many frames."""
    graphs, threaded = MODES[mode]
    rows = []
    with no_eos(bundle.model):
        for c in levels:
            fields = dict(max_running=c, max_len=max_len, max_turn_frames=max(frames, 8),
                          cuda_graphs=graphs, pingpong=threaded, codec_graphs=graphs and codec,
                          prefill_graphs=graphs, fused_ops=fused_ops)
            eng = build_engine(bundle, EngineConfig(**{**fields, **(config or {})}))
            if not codec:
                _silent_codec(eng)
            if threaded:
                eng.start()
                eng.warmed()  # the steady state: every graph captured (no fast start)
            try:
                # warm-up at the measured length: codec chunk shapes and allocator pools too
                run_level(eng, c, frames, threaded=threaded, ref_frames=ref_frames)
                row = run_level(eng, c, frames, threaded=threaded, ref_frames=ref_frames)
            except DeviceStalled:
                raise  # no shutdown: its threads are stuck on the device and would not join
            except BaseException:
                eng.shutdown()
                raise
            eng.shutdown()
            row.update(mode=mode, codec=codec, config=config or {},
                       capture_s=round(eng.capture_s, 1),
                       codec_capture_s=round(eng.codec_capture_s, 1),
                       startup_s={k: round(v, 1) for k, v in eng.startup_s.items()},
                       fused_ops=eng.ops.fused)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del eng  # build_engine collects it before sizing the next one's KV cache
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="bf16, fp32, fp16 or fp8 (FP8 block-scaled "
                    "linears); default: fp32 on a CPU, bf16 on a GPU")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--mode", choices=list(MODES), default="pingpong")
    ap.add_argument("--no-codec", action="store_true", help="AR decode only")
    ap.add_argument("--voice-frames", type=int, default=0,
                    help="a voice prompt of this many frames per sequence (215 = 10 s)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, device=args.device, dtype=args.dtype, max_seq_len=1024)
    rows = sweep(bundle, [int(x) for x in args.concurrency.split(",")], args.frames,
                 mode=args.mode, codec=not args.no_codec, ref_frames=args.voice_frames)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device,
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
