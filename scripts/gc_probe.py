"""What one full pass of the garbage collector costs in a running server (every thread waits
for it: rtvoice/gc_pauses.py): a real server on `--model` / `--device`, its objects tracked,
full passes timed (median of `--reps`), then the same after `gc.freeze()`. One JSON line.
`PYTHONPATH=. python scripts/gc_probe.py [--model tiny] [--device cpu] [--reps 3]`."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def _full_pass_ms(reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from rtvoice.testing import running_server

    with running_server(model=args.model, device=args.device, gc_freeze=False):
        tracked = len(gc.get_objects())
        unfrozen = _full_pass_ms(args.reps)
        gc.freeze()
        try:
            frozen = _full_pass_ms(args.reps)
            count = gc.get_freeze_count()
        finally:
            gc.unfreeze()
    print(json.dumps({"model": args.model, "device": args.device, "tracked_objects": tracked,
                      "full_pass_ms": unfrozen, "frozen_objects": count,
                      "full_pass_ms_frozen": frozen}))


if __name__ == "__main__":
    main()
