#!/usr/bin/env bash
# The server-level GPU measurement: `rtvoice serve` on the GPU with the S2-Pro shapes
# (deterministic random bf16 weights), driven by bench-latency over real WebSockets, one
# concurrency level at a time (each level's results are kept even if a later one fails).
# Results: $OUT/server_c<N>.json per level, $OUT/server.log. A level that does not finish in
# LEVEL_TIMEOUT seconds gets the server's thread dump (faulthandler, SIGABRT) in server.log.
# REFERENCE_S=10: every session clones a voice from an inline 10 s clip (turns then decode
# past a ~215-frame voice prompt, as real voice-agent sessions do).
# Merge and plot: python scripts/plot_server_levels.py merged.json merged.png $OUT/server_c*.json
set -uo pipefail
OUT=${OUT:-artifacts/gpu}
PORT=${PORT:-8765}
LEVELS=${SERVER_LEVELS:-1 16 64}
MAX_LEN=${MAX_LEN:-2048}
JITTER_MS=${JITTER_MS:-200}
LEVEL_TIMEOUT=${LEVEL_TIMEOUT:-120}
MAX_RUNNING=${MAX_RUNNING:-64}
# SERVER_ARGS: more `rtvoice serve` options, e.g. "--prefill-first-lead-s 0"
mkdir -p "$OUT"
python3 -X faulthandler -m rtvoice.cli serve --model s2-pro --device cuda --port "$PORT" \
    --max-running "$MAX_RUNNING" --max-len "$MAX_LEN" ${SERVER_ARGS:-} --data-dir /tmp/rtvoice-bench >"$OUT/server.log" 2>&1 &
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
REF_ARGS=()
if [ "${REFERENCE_S:-0}" != 0 ]; then  # every session clones a voice from an inline clip
    python3 - "$OUT/reference.wav" "$REFERENCE_S" <<'PY'
import sys
import numpy as np
import soundfile as sf
sr, secs = 44100, float(sys.argv[2])
t = np.arange(int(sr * secs)) / sr  # a voiced-like tone with a slow vibrato, plus a little noise
x = 0.3 * np.sin(2 * np.pi * (140 + 20 * np.sin(2 * np.pi * 3 * t)) * t)
x += 0.01 * np.random.default_rng(0).standard_normal(len(t))
sf.write(sys.argv[1], x.astype(np.float32), sr)
PY
    REF_ARGS=(--reference "$OUT/reference.wav" --reference-text "This is the reference speaker reading a sentence aloud.")
fi
for C in $LEVELS; do
    [ $RC -ne 0 ] && break
    timeout "$LEVEL_TIMEOUT" python3 -m bench_latency --url "ws://127.0.0.1:$PORT/v1/tts/live" \
        --concurrency "$C" --turns 2 --warmup-turns 1 --max-frames 96 --jitter-ms "$JITTER_MS" \
        "${REF_ARGS[@]}" --json "$OUT/server_c$C.json" --no-progress
    RC=$?
    if [ $RC -eq 124 ]; then
        echo "level c=$C did not finish in ${LEVEL_TIMEOUT}s: server thread dump in server.log"
        kill -ABRT $SRV; sleep 2
    fi
done
kill -INT $SRV 2>/dev/null; wait $SRV
tail -5 "$OUT/server.log"
exit $RC
