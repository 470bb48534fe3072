#!/usr/bin/env bash
# The server-level GPU measurement: `rtvoice serve` on the GPU with the S2-Pro shapes
# (deterministic random bf16 weights), driven by bench-latency over real WebSockets, one
# concurrency level at a time (each level's results are kept even if a later one fails).
# Results: $OUT/server_c<N>.json per level, $OUT/server.log. A level that does not finish in
# LEVEL_TIMEOUT seconds gets the server's thread dump (faulthandler, SIGABRT) in server.log.
# Merge and plot: python scripts/plot_server_levels.py merged.json merged.png $OUT/server_c*.json
set -uo pipefail
OUT=${OUT:-artifacts/gpu}
PORT=${PORT:-8765}
LEVELS=${SERVER_LEVELS:-1 16 64}
MAX_LEN=${MAX_LEN:-2048}
JITTER_MS=${JITTER_MS:-200}
LEVEL_TIMEOUT=${LEVEL_TIMEOUT:-120}
mkdir -p "$OUT"
python3 -X faulthandler -m rtvoice.cli serve --model s2-pro --device cuda --port "$PORT" \
    --max-running 64 --max-len "$MAX_LEN" --data-dir /tmp/rtvoice-bench >"$OUT/server.log" 2>&1 &
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
RC=$?
for C in $LEVELS; do
    [ $RC -ne 0 ] && break
    timeout "$LEVEL_TIMEOUT" python3 -m bench_latency --url "ws://127.0.0.1:$PORT/v1/tts/live" \
        --concurrency "$C" --turns 2 --warmup-turns 1 --max-frames 96 --jitter-ms "$JITTER_MS" \
        --json "$OUT/server_c$C.json" --no-progress
    RC=$?
    if [ $RC -eq 124 ]; then
        echo "level c=$C did not finish in ${LEVEL_TIMEOUT}s: server thread dump in server.log"
        kill -ABRT $SRV; sleep 2
    fi
done
kill -INT $SRV 2>/dev/null; wait $SRV
tail -5 "$OUT/server.log"
exit $RC
