"""Plot an engine sweep from scripts/gpu_bench.py's JSON (key "engine"):
throughput and TTFA vs concurrency per mode.

    python scripts/plot_engine_sweep.py docs/perf/gpu_engine_profile.json docs/perf/gpu_engine_sweep.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, dst: str) -> None:
    runs = {k: [r for r in v if "concurrency" in r]  # rows; a failed run leaves {"error"}
            for k, v in json.load(open(src))["engine"].items() if isinstance(v, list)}
    runs = {k: v for k, v in runs.items() if v}
    # newer sweeps time the whole engine share of TTFA (submit -> first PCM, incl. the turn's
    # prefill); older ones only ready -> first PCM
    whole = all("submit_to_audio_ms_p50" in r for rows in runs.values() for r in rows)
    key, label = (("submit_to_audio_ms_p50", "submit -> first PCM") if whole
                  else ("ttfa_ms_p50", "turn ready -> first PCM"))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, rows in runs.items():
        c = [r["concurrency"] for r in rows]
        ax1.plot(c, [r["aggregate_fps"] for r in rows], marker="o", label=name)
        ax2.plot(c, [r[key] for r in rows], marker="o", label=name)
    for ax, title, ylab in ((ax1, "Aggregate throughput", "frames / s"),
                            (ax2, f"Engine TTFA p50 ({label})", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("S2-Pro shapes, bf16, one H200 (engine only)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
