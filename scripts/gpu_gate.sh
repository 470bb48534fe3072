#!/usr/bin/env bash
# The ±5 % performance gate of a change, in one device call: the engine sweep (S2-Pro shapes,
# bf16 random weights, pingpong with the codec, 64-frame turns, a warm-up round first) at
# GATE_LEVELS for this tree and for BASE (a checkout of the code before the change:
#   mkdir -p .baseline && git archive REV engine csrc bench_latency | tar -x -C .baseline
# with .baseline in .git/info/exclude and carried), then frames/s side by side.
# Results: $OUT/gate_new.json, $OUT/gate_base.json (the sweep's rows), $OUT/gate.txt.
set -uo pipefail
OUT=${OUT:-artifacts/gate}
BASE=${BASE:-.baseline}
LEVELS=${GATE_LEVELS:-1,64}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # the sweeps run from the trees' own folders
export PYTHONUNBUFFERED=1
sweep() {  # tree, json
    (cd "$1" && timeout "${SWEEP_TIMEOUT:-240}" python3 -m bench_latency.engine_throughput \
        --model s2-pro --device cuda --concurrency "$LEVELS" --frames 64 --json "$2") \
        2>&1 | grep '^{"' | cut -c1-300
}
echo "== this tree"; sweep . "$OUT/gate_new.json"
if [ -d "$BASE/engine" ]; then
    echo "== base ($BASE)"; sweep "$BASE" "$OUT/gate_base.json"
fi
python3 - "$OUT" <<'PY' | tee "$OUT/gate.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for name in ("base", "new"):
    p = out / f"gate_{name}.json"
    if p.is_file():
        rows[name] = {r["concurrency"]: r for r in json.loads(p.read_text())["rows"]}
print("c    base fps    new fps   new/base   decode_tps p50 base/new   submit->audio p50 base/new")
worst = None
for c in sorted(rows.get("new", {})):
    n, b = rows["new"][c], rows.get("base", {}).get(c)
    ratio = n["aggregate_fps"] / b["aggregate_fps"] if b else None
    worst = ratio if worst is None or (ratio is not None and ratio < worst) else worst
    print(f"{c:<4} {b['aggregate_fps'] if b else '-':>9} {n['aggregate_fps']:>10} "
          f"{ratio if ratio is None else round(ratio, 3)!s:>10}   "
          f"{b['decode_tps_p50'] if b else '-'} / {n['decode_tps_p50']}   "
          f"{b['submit_to_audio_ms_p50'] if b else '-'} / {n['submit_to_audio_ms_p50']}")
if worst is not None:
    print("gate (new >= 0.95 x base at every level):", "PASS" if worst >= 0.95 else "FAIL")
PY
