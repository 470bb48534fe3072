"""Engine-only throughput: N concurrent sequences decoding fixed-length turns, no server.

    python -m bench_latency.engine_throughput --model tiny --concurrency 1,2,4,8 --frames 64

Reports aggregate frames/s, per-sequence frames/s, realtime factor (frames/s ÷ 21.53) and
the split of engine time between decode, prefill and codec.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.engine import CollectingSink, EngineConfig
from engine.loader import load_bundle
from engine.sampler import SamplingParams
from rtvoice.synth import make_engine


class _IgnoreEos(SamplingParams):
    pass


def run_level(bundle, c: int, frames: int, *, codec: bool = True) -> dict[str, float]:
    eng = make_engine(bundle, EngineConfig(max_running=c, max_len=1024, max_turn_frames=frames))
    eos = bundle.model.cfg.ids.im_end
    # Fixed-length turns: forbid <|im_end|> by pushing its logit down (benchmarks only).
    orig = bundle.model.semantic_logits

    def no_eos(h):
        out = orig(h)
        out[..., -1] = float("-inf")
        return out

    bundle.model.semantic_logits = no_eos
    try:
        sinks = [CollectingSink() for _ in range(c)]
        seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
        eng.run_until_idle()
        for i, s in enumerate(seqs):
            eng.submit(s, f"Benchmark sentence number {i}.", turn_id="b", max_frames=frames)
        if not codec:
            eng._codec_tick = lambda: False  # type: ignore[method-assign]
        for k in eng.stats:
            eng.stats[k] = 0 if isinstance(eng.stats[k], int) else 0.0
        t0 = time.perf_counter()
        eng.run_until_idle(timeout_s=3600)
        wall = time.perf_counter() - t0
    finally:
        del bundle.model.semantic_logits
    total = sum(r.frames for s in sinks for r in s.results)
    assert eos is not None
    return {"concurrency": c, "frames": total, "wall_s": round(wall, 3),
            "aggregate_fps": round(total / wall, 1), "per_seq_fps": round(total / wall / c, 1),
            "x_realtime_per_seq": round(total / wall / c / (44100 / 2048), 2),
            "decode_s": round(eng.stats["decode_s"], 3), "prefill_s": round(eng.stats["prefill_s"], 3),
            "codec_s": round(eng.stats["codec_s"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, device=args.device, max_seq_len=1024)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        run_level(bundle, c, 8)  # warm-up
        row = run_level(bundle, c, args.frames)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
