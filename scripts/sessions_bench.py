"""Open sessions on one engine (S2-Pro shapes, random bf16 weights on a GPU; the tiny model on
a CPU): how many 10 s voices the paged KV pool holds, how long a burst of opens takes with
one shared voice vs distinct voices, and what an evicted session's next turn costs.

    python scripts/sessions_bench.py [--sessions 1000] [--out DIR]

Prints one JSON line per part and writes DIR/sessions_bench.json:
- `open`: N sessions with distinct 10 s voices opened at once: seconds until all are ready,
  KV blocks used, a turn on the first, middle and last of them (frames, TTFA);
- `burst_shared` / `burst_distinct`: 64 sessions opened at once with one stored voice vs 64
  different ones, open -> ready p50 / max (ms) and prefill columns;
- `evict`: a pool of ~`--evict-pool` sessions' worth, 2 x as many opened: evictions to host,
  then a turn on the least recently used (restored) and on a resident one: TTFA of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import CollectingSink, Engine, build_engine
from engine.prompt import Reference
from engine.sampler import SamplingParams

FRAMES_10S = 215  # 10 s at 21.5 frames/s


def voice(i: int, k: int, frames: int = FRAMES_10S) -> list[Reference]:
    g = torch.Generator().manual_seed(1000 + i)
    return [Reference(f"Reference clip number {i}, read aloud.",
                      torch.randint(0, 1024, (k, frames), generator=g))]


def open_all(eng: Engine, voices: list[list[Reference]]) -> tuple[list, list[CollectingSink], float]:
    sinks = [CollectingSink() for _ in voices]
    t0 = time.perf_counter()
    seqs = [eng.open(v, SamplingParams(seed=i), s) for i, (v, s) in enumerate(zip(voices, sinks))]
    for s in sinks:
        if not s.ready.wait(600):
            raise TimeoutError("a session was not ready within 600 s")
    return seqs, sinks, time.perf_counter() - t0


def turn(eng: Engine, seq, sink: CollectingSink, frames: int = 32) -> dict[str, float]:
    sink.done.clear()
    eng.submit(seq, "A short sentence to speak now.", turn_id="t", max_frames=frames)
    if not sink.done.wait(120):
        raise TimeoutError("turn did not end")
    r = sink.results[-1]
    return {"frames": r.frames, "reason": str(r.reason),
            "ttfa_ms": round(1e3 * (r.ttfa_s or 0), 1),
            "submit_to_audio_ms": round(1e3 * ((r.first_audio_at or 0) - r.submitted_at), 1)}


def pcts(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(1e3 * statistics.median(xs), 1), "max_ms": round(1e3 * max(xs), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--evict-pool", type=int, default=200, help="sessions' worth of blocks")
    ap.add_argument("--out", type=Path, default=Path("artifacts/gpu"))
    ap.add_argument("--only", choices=("open", "evict"), help="run one part")
    args = ap.parse_args()
    from engine.loader import load_bundle

    cuda = torch.cuda.is_available()
    model = "s2-pro" if cuda else "tiny"
    b = load_bundle(model, device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32",
                    codec_dtype="bf16" if cuda else "fp32", max_seq_len=1024)
    k = b.model.cfg.num_codebooks
    n = args.sessions if cuda else min(args.sessions, 40)
    report: dict[str, object] = {"model": model, "device": torch.cuda.get_device_name() if cuda
                                 else "cpu"}

    def engine(**kw) -> Engine:
        eng = build_engine(b, EngineConfig(max_running=64, max_len=1024, **kw))
        eng.start()
        eng.warmed()  # every graph in before anything is timed
        return eng

    per = 6  # blocks of 64 per session: a 10 s voice prompt is 355 positions
    if args.only != "evict":
        per = open_part(engine, report, n, k)
    if args.only != "open":
        evict_part(engine, report, per, args.evict_pool if cuda else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sessions_bench.json").write_text(json.dumps(report, indent=1))
    return 0


def open_part(engine, report: dict, n: int, k: int) -> int:  # type: ignore[no-untyped-def]
    """1,000 sessions, then the two bursts; returns blocks per session."""
    eng = engine()
    try:
        seqs, sinks, dt = open_all(eng, [voice(i, k) for i in range(n)])
        load = eng.load()
        used = load["kv_blocks"] - load["kv_blocks_free"]
        row = {"sessions": n, "all_ready_s": round(dt, 2), "kv_blocks_used": used,
               "kv_blocks": load["kv_blocks"], "positions_per_session": seqs[0].pos,
               "offloaded": load["offloaded"],
               "turns": [turn(eng, seqs[i], sinks[i]) for i in (0, n // 2, n - 1)]}
        print(json.dumps({"open": row}), flush=True)
        report["open"] = row
        for s in seqs:
            eng.close(s)
        time.sleep(0.5)
        for name, vs in (("burst_shared", [voice(9000, k)] * 64),  # a voice not yet in the pool
                         ("burst_distinct", [voice(5000 + i, k) for i in range(64)])):
            cols0 = eng.stats["prefill_cols"]
            seqs, sinks, dt = open_all(eng, vs)
            row = {**pcts([s.prefill_s for s in sinks]), "all_ready_s": round(dt, 3),
                   "prefill_cols": int(eng.stats["prefill_cols"] - cols0),
                   "prefix_hits": int(eng.stats["prefix_hits"])}
            print(json.dumps({name: row}), flush=True)
            report[name] = row
            for s in seqs:
                eng.close(s)
            time.sleep(0.3)
    finally:
        eng.shutdown()
    return -(-report["open"]["positions_per_session"] // 64)


def evict_part(engine, report: dict, per: int, pool: int) -> None:  # type: ignore[no-untyped-def]
    """A pool of `pool` sessions' blocks, twice as many sessions (eager codec: a faster
    build; both measured turns use it)."""
    eng = engine(kv_blocks=pool * per + 8, codec_graphs=False)
    k = eng.model_cfg.num_codebooks
    try:
        m = 2 * pool
        # in waves, as sessions arrive at a server: a wave's prompts fill the pool while the
        # last wave sits idle, so those get evicted (all at once, the pool would be all
        # prefilling and the surplus refused as overloaded: max_waiting)
        wave = max(1, min(eng.cfg.max_waiting, pool) // 2)
        seqs, sinks, dt = [], [], 0.0
        for at in range(0, m, wave):
            s1, k1, d1 = open_all(eng, [voice(i, k) for i in range(at, min(m, at + wave))])
            seqs += s1
            sinks += k1
            dt += d1
        load = eng.load()
        evicted = next(i for i, s in enumerate(seqs) if s.offloaded is not None)
        turn(eng, seqs[-2], sinks[-2])  # warm-up: the first turn after a build is slower
        restored = turn(eng, seqs[evicted], sinks[evicted])
        resident = turn(eng, seqs[-1], sinks[-1])
        row = {"sessions": m, "waves_of": wave, "all_ready_s": round(dt, 2), "kv_blocks": load["kv_blocks"],
               "offloaded": load["offloaded"], "evictions": int(eng.stats["kv_evictions"]),
               "host_kv_gib": round(load["host_kv_bytes"] / 2**30, 2),
               "restore_s": round(eng.stats["kv_restore_s"], 4),
               "restores": int(eng.stats["kv_restores"]),
               "turn_restored": restored, "turn_resident": resident}
        print(json.dumps({"evict": row}), flush=True)
        report["evict"] = row
    finally:
        eng.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
