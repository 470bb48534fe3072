"""One decode step of the tiny model on this machine's CPU: 8 rows at position 1,000, keys
over a span of 1,280 and 4,096 positions (the torch fallback's attention through the paged
KV pool).

    PYTHONPATH=. python scripts/step_probe.py
"""

from __future__ import annotations

import time

import torch

from engine.loader import load_bundle
from engine.runner import ModelRunner
from engine.sampler import SamplingParams


def main() -> int:
    torch.set_num_threads(2)
    b = load_bundle("tiny", device="cpu", max_seq_len=4096)
    r = ModelRunner(b.model, n_rows=8, max_len=4096)
    col = torch.zeros(b.model.cfg.frame_rows, dtype=torch.long)
    col[0] = b.model.cfg.ids.semantic_start + 5
    for row in range(8):
        r.join(row, SamplingParams.greedy(), col, 1000, 10**6, row, r.own_blocks(row))
    for span in (1280, 4096):
        for _ in range(3):
            r.step(8, span)
        n, t = 20, time.perf_counter()
        for _ in range(n):
            r.step(8, span)
        print(f"span {span}: {1000 * (time.perf_counter() - t) / n:.1f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
