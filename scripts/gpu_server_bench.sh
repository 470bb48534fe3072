#!/usr/bin/env bash
# The server-level GPU measurement in one device call: `rtvoice serve` on the GPU with the
# S2-Pro shapes (deterministic random bf16 weights), driven by bench-latency over real
# WebSockets. Results: $OUT/server_bench.json, $OUT/server_bench.png, $OUT/server.log.
set -uo pipefail
OUT=${OUT:-artifacts/gpu}
PORT=${PORT:-8765}
LEVELS=${LEVELS:-1,16,64}
MAX_LEN=${MAX_LEN:-2048}
JITTER_MS=${JITTER_MS:-200}
mkdir -p "$OUT"
python3 -m rtvoice.cli serve --model s2-pro --device cuda --port "$PORT" --max-running 64 \
    --max-len "$MAX_LEN" --data-dir /tmp/rtvoice-bench >"$OUT/server.log" 2>&1 &
SRV=$!
python3 - "$PORT" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2)
        print("server ready", flush=True)
        break
    except Exception:
        time.sleep(1)
else:
    sys.exit("server did not become ready")
PY
python3 -m bench_latency --url "ws://127.0.0.1:$PORT/v1/tts/live" --concurrency "$LEVELS" \
    --turns 2 --warmup-turns 1 --max-frames 96 --jitter-ms "$JITTER_MS" --json "$OUT/server_bench.json" \
    --plot "$OUT/server_bench.png" --no-progress
RC=$?
kill -INT $SRV; wait $SRV
tail -5 "$OUT/server.log"
exit $RC
