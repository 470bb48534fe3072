"""GPU time of one prefill-graph replay per (rows, columns, span) bucket, alone on the GPU
(S2-Pro shapes, bf16 dummy weights): what a burst of turn prefills costs before any
contention with decode steps and codec ticks.

    python scripts/prefill_probe.py        # prints {"(rows, cols, span)": ms, ...}
"""

from __future__ import annotations

import json
import time

import torch

from engine.config import EngineConfig
from engine.engine import build_engine
from engine.loader import load_bundle


def main() -> None:
    t = time.time()
    b = load_bundle("s2-pro", device="cuda", dtype="bf16", codec_dtype="bf16", max_seq_len=1024)
    eng = build_engine(b, EngineConfig(max_running=16, max_len=1024, cuda_graphs=False,
                                       codec_graphs=False))
    print(f"built in {time.time() - t:.1f}s", flush=True)
    res = {}
    graphs = eng.prefill_worker.graphs.graphs
    for key in sorted(graphs):
        if key[0] not in (1, 16) or key[1] > 64:
            continue
        g, _ = graphs[key]
        with torch.cuda.stream(eng.prefill_worker.stream):
            g.replay()  # warm
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
        res[str(key)] = round(e0.elapsed_time(e1) / 5, 2)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
