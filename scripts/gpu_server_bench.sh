#!/usr/bin/env bash
# The server-level GPU measurement: `rtvoice serve` on the GPU with the S2-Pro shapes
# (deterministic random bf16 weights), driven by bench-latency over real WebSockets, one
# concurrency level at a time (each level's results are kept even if a later one fails).
# Results: $OUT/server_c<N>.json per level, $OUT/server.log, $OUT/ready.json (seconds to
# /ready and to the end of the background graph capture), $OUT/server_metrics.txt (the
# engine's counters after each run: prefill-ahead jobs, hits and misses, steps). A level that does not finish in
# LEVEL_TIMEOUT seconds gets the server's thread dump (faulthandler, SIGABRT) in server.log.
# REFERENCE_S (default 10; 0: the default voice): every session clones a voice from an inline
# clip of that many seconds (turns then decode past a ~215-frame voice prompt, as real
# voice-agent sessions do; the clips are identical, so the sessions share one prefilled copy).
# MAX_FRAMES (300): a turn's frame cap. WARM_TIMEOUT (150): the longest wait for the background
# graphs after /ready (the levels then run anyway; ready.json's warm_s is null).
# PRESTART=1: start the server once first (until /ready),
# so that ready.json times a warm machine's start (compile and autotune caches filled).
# ARRIVALS=poisson (MEAN_GAP_S, 2): the levels' turns staggered instead of lockstep bursts;
# POISSON_LEVELS="64 ...": after the levels, these with Poisson arrivals on the same server
# ($OUT/server_poisson_c<N>.json). WHOLE_LEVELS="64 ...": before those, these with each turn's
# paced tokens sent as one text event at the flush (bench-latency --send-text whole: the same
# arrivals, nothing for the server to prefill ahead; $OUT/server_whole_c<N>.json). CAPACITY=1: last, bench-latency --capacity (TTFA p99 <=
# 300 ms, 0 underruns) from CAPACITY_FROM (16) streams up to CAPACITY_MAX (512), one result
# file $OUT/server_capacity.json (+ .png), the search within CAPACITY_TIMEOUT (300) s;
# CAPACITY_ARGS: more bench-latency options for it (e.g. "--capacity-resolution 32").
# After the levels: $OUT/server.json (+ .png) merges them, $OUT/baseline.json is this run's
# decode_tps per level (bench-latency --save-baseline), and with BASELINE=FILE (e.g.
# bench_latency/baselines/h200_s2pro_bf16.json) the run is gated against it (exit 1 when
# decode_tps drops > 5 % at a level). DTYPE (bf16): the server's --dtype (fp8: FP8 linears).
# The server's --max-sessions and --max-unstarted are set to the most streams any level (or
# the capacity search) opens at once, at least 128, unless SERVER_ARGS gives them.
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
# the server's open-session bounds sized to the most streams a level (or the capacity search)
# opens at once, so that no level is cut by them ('overloaded') unless SERVER_ARGS sets them
MOST=128
for C in $LEVELS ${WHOLE_LEVELS:-} ${POISSON_LEVELS:-}; do [ "$C" -gt "$MOST" ] && MOST=$C; done
[ "${CAPACITY:-0}" = 1 ] && [ "${CAPACITY_MAX:-512}" -gt "$MOST" ] && MOST=${CAPACITY_MAX:-512}
BOUNDS=()
case " ${SERVER_ARGS:-} " in *" --max-sessions "*) ;; *) BOUNDS+=(--max-sessions "$MOST") ;; esac
case " ${SERVER_ARGS:-} " in *" --max-unstarted "*) ;; *) BOUNDS+=(--max-unstarted "$MOST") ;; esac
SERVE=(--model "${MODEL:-s2-pro}" --device "${DEVICE:-cuda}" --port "$PORT" --dtype "${DTYPE:-bf16}"
       --max-running "$MAX_RUNNING" --max-len "$MAX_LEN" "${BOUNDS[@]}" ${SERVER_ARGS:-}
       --data-dir /tmp/rtvoice-bench)
if [ "${PRESTART:-0}" = 1 ]; then
    # A first start (until /ready) fills the compile and autotune caches on disk, so the
    # start measured below is that of a warm machine (a restart, a second replica)
    python3 -m rtvoice.cli serve "${SERVE[@]}" >"$OUT/server_prestart.log" 2>&1 &
    PRE=$!
    T_PRE=$(date +%s)
    READY=-1  # seconds to /ready once it answered 200
    while kill -0 $PRE 2>/dev/null && [ $(( $(date +%s) - T_PRE )) -le 300 ]; do
        if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null; then
            READY=$(( $(date +%s) - T_PRE ))
            break
        fi
        sleep 0.5
    done
    kill -INT $PRE 2>/dev/null
    timeout 60 tail --pid=$PRE -f /dev/null || kill -KILL $PRE 2>/dev/null
    wait $PRE 2>/dev/null
    if [ $READY -ge 0 ]; then
        echo "first start (caches filled): ready after $READY s"
        rm -f "$OUT/server_prestart.log"
    else  # the start below would be timed on a cold machine: say so, keep the log
        echo "WARNING: the first start never became ready (see $OUT/server_prestart.log);" \
             "the start timed below is not a warm machine's"
    fi
fi
# MODEL / DEVICE (s2-pro / cuda): tiny / cpu tries the script on a CPU machine
python3 -X faulthandler -m rtvoice.cli serve "${SERVE[@]}" >"$OUT/server.log" 2>&1 &
SRV=$!
T_LAUNCH=$(date +%s.%N)
# Fast start: seconds from launch to /ready 200, then to the end of the background capture
# (the benches below measure the steady state); both, with /ready's body, in $OUT/ready.json.
python3 - "$PORT" "$T_LAUNCH" "$OUT/ready.json" "${WARM_TIMEOUT:-150}" <<'PY'
import json, sys, time, urllib.request
port, t0, out, patience = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
def ready():
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
        return json.load(r)
for _ in range(3000):
    try:
        body = ready()
        break
    except Exception:
        time.sleep(0.1)
else:
    sys.exit("server did not become ready")
res = {"ready_s": round(time.time() - t0, 1), "ready": body}
print(f"server ready {res['ready_s']} s after launch; warming: {body.get('warming', {})}", flush=True)
json.dump(res, open(out, "w"), indent=1)  # again below, with the time to the last graph
def warming(body):  # families still capturing (one that failed stays eager: no wait)
    return [f for f in (body.get("warming") or {}).values() if "error" not in f]
t_ready = time.time()
while warming(body) and time.time() - t_ready < patience:
    time.sleep(0.5)
    try:
        body = ready()
    except Exception:  # 503 while busy: ask again
        pass
res["warm"] = body
if warming(body):  # measure anyway: the levels below then run partly on eager buckets
    res["warm_s"] = None
    print(f"still warming {patience:g} s after ready: {body.get('warming')}; the levels "
          "below run without every graph", flush=True)
else:
    res["warm_s"] = round(time.time() - t0, 1)
    print(f"every graph captured {res['warm_s']} s after launch", flush=True)
json.dump(res, open(out, "w"), indent=1)
PY
RC=$?
REF_ARGS=()
if [ "${REFERENCE_S:-10}" != 0 ]; then  # every session clones a voice from an inline clip
    python3 - "$OUT/reference.wav" "${REFERENCE_S:-10}" <<'PY'
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
COMMON=(--turns 2 --warmup-turns 1 --max-frames "${MAX_FRAMES:-300}" --jitter-ms "$JITTER_MS"
        --mean-gap-s "${MEAN_GAP_S:-2}" --no-progress)
run_level() {  # run_level C RESULT LIMIT_S [more bench-latency args]: its JSON in RESULT
    local C=$1 RESULT=$2 LIMIT=$3
    shift 3
    timeout "$LIMIT" python3 -m bench_latency --url "ws://127.0.0.1:$PORT/v1/tts/live" \
        --concurrency "$C" "${COMMON[@]}" "${REF_ARGS[@]}" --json "$RESULT" "$@"
    RC=$?
    if [ $RC -eq 124 ]; then
        echo "$RESULT did not finish in ${LIMIT}s: server thread dump in server.log"
        kill -ABRT $SRV; sleep 2
    fi
    # the engine's counters after each run (cumulative), e.g. the turn heads prefilled ahead
    { echo "# after $(basename "$RESULT")"
      python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=5).read().decode())" \
          2>/dev/null | grep -E "^rtvoice_engine_(prefill_ahead|steps_total|seconds_total)"; } >> "$OUT/server_metrics.txt"
}
for C in $LEVELS; do
    [ $RC -ne 0 ] && break
    F="$OUT/server_c$C.json"
    N=2
    while [ -e "$F" ]; do F="$OUT/server_c${C}_$N.json"; N=$((N + 1)); done  # a level run again
    run_level "$C" "$F" "$LEVEL_TIMEOUT" --arrivals "${ARRIVALS:-lockstep}"
done
for C in ${WHOLE_LEVELS:-}; do  # the same server, each turn's text in one event: no prefill ahead
    [ $RC -ne 0 ] && break
    run_level "$C" "$OUT/server_whole_c$C.json" "$LEVEL_TIMEOUT" --arrivals "${ARRIVALS:-lockstep}" \
        --send-text whole
done
for C in ${POISSON_LEVELS:-}; do  # the same server, staggered turns
    [ $RC -ne 0 ] && break
    run_level "$C" "$OUT/server_poisson_c$C.json" "$LEVEL_TIMEOUT" --arrivals poisson
done
if [ "${CAPACITY:-0}" = 1 ] && [ $RC -eq 0 ]; then
    run_level "${CAPACITY_FROM:-16}" "$OUT/server_capacity.json" "${CAPACITY_TIMEOUT:-300}" --capacity \
        --capacity-max "${CAPACITY_MAX:-512}" --arrivals "${ARRIVALS:-lockstep}" \
        --plot "$OUT/server_capacity.png" ${CAPACITY_ARGS:-}
fi
kill -INT $SRV 2>/dev/null; wait $SRV
tail -5 "$OUT/server.log"
if [ -n "$LEVELS" ] && ls "$OUT"/server_c[0-9]*.json >/dev/null 2>&1; then
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/plot_server_levels.py "$OUT/server.json" "$OUT/server.png" \
        $(ls "$OUT"/server_c[0-9]*.json | sort -V)
    GATE_ARGS=()
    [ -n "${BASELINE:-}" ] && GATE_ARGS=(--baseline "$BASELINE")
    python3 -m bench_latency --from-json "$OUT/server.json" --save-baseline "$OUT/baseline.json" \
        "${GATE_ARGS[@]}" || { G=$?; [ $RC -eq 0 ] && RC=$G; }
fi
exit $RC
