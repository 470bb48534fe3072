"""Merge per-level bench JSONs (scripts/gpu_server_bench.sh writes one per concurrency level)
into one report and plot it with bench-latency's own plot (TTFA and throughput vs c).

    python scripts/plot_server_levels.py OUT.json OUT.png server_c1.json server_c16.json ...
"""

from __future__ import annotations

import json
import sys

from bench_latency.cli import plot


def main(dst_json: str, dst_png: str, *sources: str) -> None:
    reports = [json.load(open(p)) for p in sources]
    if not reports:
        raise SystemExit("no input files")
    merged = dict(reports[0])
    merged["levels"] = sorted((lv for r in reports for lv in r["levels"]),
                              key=lambda lv: lv["concurrency"])
    merged["settings"] = {**reports[0]["settings"],
                          "concurrency": [lv["concurrency"] for lv in merged["levels"]]}
    with open(dst_json, "w") as f:
        json.dump(merged, f, indent=1)
    try:
        plot(merged, dst_png)
    except ImportError as e:  # the merged JSON is what the gate needs; the plot is a bonus
        print(f"no plot ({e}); merged report in {dst_json}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
