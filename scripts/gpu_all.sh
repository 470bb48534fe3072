#!/usr/bin/env bash
# The whole GPU measurement of issue 5 in one device call (sized for 10 minutes on one H200;
# the parts run under their own limits and the engine sweep gets what is left):
#   1. CUDA tests: by default the smoke set (no host sync in steady state, the graphed
#      engine codec's audio, pingpong == sync, capture streams, the fused masked attention,
#      decode attention with split positions, two engines with different ops in one process,
#      the reference fixtures with the fused ops, the step's bookkeeping kernels, the ops' errors,
#      the codec's fused unit and transposed convs, the Triton decode attention with and
#      without shared prefixes; 136-148 s with the extension build on a fresh machine, before
#      the Triton attention's cases; one pytest process per test file, the Triton attention's
#      first: a segfault stops only its file); TESTS=all runs tests/test_cuda.py and tests/test_kernels.py whole,
#      TESTS_K picks by name; GATE=1 then runs scripts/gpu_gate.sh (this tree against
#      .baseline at c=1 and 64: the ±5 % performance gate of a change);
#   1b. scripts/sessions_bench.py (SESSIONS=0 skips it): 1,000 sessions with distinct 10 s
#      voices open on the paged KV pool, 64 opened at once with one voice vs 64 voices, and
#      eviction to host memory with a restored turn;
#   2. diagnostics, only with PROBE=1 (~50 s): scripts/prefill_probe.py (one prefill-graph
#      replay per bucket alone), `python -m bench_latency.kernel_bench` (csrc kernels vs torch)
#      and scripts/start_probe.py (the start before the engine); KBENCH=1 runs only
#      kernel_bench, into $OUT/kernel_bench.txt (its decode_attention_rows: csrc's attention
#      against the Triton tile kernel at 16-256 rows, graph-timed);
#   3. the server bench: `rtvoice serve` (S2-Pro shapes, bf16 dummy weights, 128 decode rows)
#      driven by bench-latency over real WebSockets at c = 1, 4, 16, 32, 64, 128, 200 ms
#      jitter buffer, every session cloning a 10 s voice, turns up to 300 frames (knobs of
#      scripts/gpu_server_bench.sh: REFERENCE_S, MAX_FRAMES, ARRIVALS, POISSON_LEVELS, CAPACITY=1);
#   4. scripts/gpu_bench.py: the codec profile (graphed and eager ticks at 64x8, 64x2, 16x4
#      and 1x2 streams x frames, their kernels by category) and the engine sweep (pingpong
#      with codec at c = 1, 4, 16, 32, 64, the naive loop at 1, pingpong without codec at 1
#      and 64, then pingpong with codec at 128: the first cut if time runs out);
#      SKIP=decode,codec_profile drops only the two slowest sections, adding the reference
#      fixtures on the GPU, the offline codec bench and the frame-step profile (~55 s).
# The sweep is time-boxed (TOTAL): its last runs are the first cut if it overruns; its rows
# are in gpu_bench_log.txt as they finish.
# Results under $OUT (default artifacts/gpu; 7-8 files, what one device call brings back):
# tests.txt, sessions_bench.json, probes.txt, server.json (+ server.png), server.log,
# gpu_bench.json, gpu_bench_log.txt. Knobs: TESTS, TESTS_K, SERVER_LEVELS, LEVEL_TIMEOUT,
# TESTS_TIMEOUT, SERVER_TIMEOUT, ENGINE_LEVELS, ENGINE_RUNS, SKIP (gpu_bench sections;
# default decode,codec,fixtures,profile), TOTAL (s, default 585), PROBE,
# COMPILED_SAMPLER=1 (profile the step again with the compiled torch sampler), DECODE_ROPE=ROWS
# (again with the q/k norm + RoPE inside decode attention up to ROWS rows, 0: never; batches
# 1, 2 and 64), PDL_MODES="0,1" (again
# with csrc's kernels launched without (0) or with (1) programmatic dependent launch, or in
# the linears' other PDL modes 2, 3; batches 1, 2, 64), FP8_NORMED=M (the FP8 step again with
# the normed prologue for FP8 weights up to M rows; batches 1, 2), FP8_NODENSE=1 (the FP8 step
# again without the bf16 copies of its linears, batches 16, 32, 64), ATTEND=1 (the step
# again with the fast AR's attention in wo's prologue, not its own launches; batches 1, 2),
# FP8_W8A8=1 (the FP8 step again with the table's W8A8 rows allowed, as --fp8-activations:
# key profile_fp8_w8a8; record a table with them first, LINEAR=1; the FP8 engine with them:
# ENGINE_RUNS=pingpong_nocodec_w8a8 with DTYPES=fp8), COMPILED_BOOK=1 (the step
# again with its bookkeeping compiled, not csrc/bookkeeping.cu's kernels: key
# profile_compiled_book; batches 1, 2, 64), ATTN_TRITON=ROWS (the step again with the slow
# AR's attention as the Triton tile kernel from ROWS rows instead of the engine's 16 — 0:
# csrc's kernel at every batch: key profile_attn_triton; batches
# 1, 2, 16, 64; with DECODE_ROPE=R also with the q/k norm + RoPE folded into it up to R rows,
# the fast AR's at its default: profile_attn_triton_rope<R>; add pingpong_nocodec_attn_triton /
# pingpong_codec_voice_attn_triton to ENGINE_RUNS for the engine with it from ROWS rows; on one
# 10 s voice: pingpong_nocodec_voice, pingpong_nocodec_voice_attn_triton[_shared],
# pingpong_codec_voice_attn_triton_shared — _shared: its prefix read once per 16 rows).
# CONV=1: `python -m bench_latency.codec_conv_bench` (the codec's fused residual-unit convs
# against cuDNN's conv + csrc's pass at the 64 x 8 tick's shapes, the fused residual unit
# against its two convs (the table's units rows), the transposed convs as the fused conv
# against cuDNN's (ups rows), then graphed ticks with and
# without them (and with the hardware sine and / or `snake_into_next`: ~40 s of capture
# each) and their bf16 audio against float32;
# CONV_ARGS="--sweep": every launch shape; CONV_INSTALL=1: the swept table then serves the
# rest of the call, installed as this GPU kind's codec_conv table)
# into $OUT/codec_conv.{json,txt}.
# GLU=1: `linear_bench --glu` (the FP8 w13 over prequantised x up to w2's quantised input:
# its W8A8 GEMM + the quantising gate vs the GLU GEMM) into $OUT/glu.{json,txt}.
# SWIGLU=1: `linear_bench --swiglu` (the FFN's packed linear + silu*mul vs csrc's SwiGLU
# epilogue at the M where the table picks the kernel) into $OUT/swiglu.{json,txt}. NORM=1:
# `linear_bench --norm` (projection + add_rms_norm + projection vs the residual epilogue and
# normed prologue) into $OUT/norm.{json,txt}. ATTEND_BENCH=1: `linear_bench --attend` (the fast
# AR's attention + wo vs the attention prologue, and each part alone, M = 1, 2) into
# $OUT/attend.{json,txt}. ROWWISE=1: `linear_bench --rowwise` (FP8 weights at 16-64 rows:
# their bf16 copies' cuBLAS GEMM vs the rowwise-scaled FP8 GEMM, W8A8, and its error) into
# $OUT/rowwise.{json,txt}.
# FP8 (issue 14): LINEAR=1 first records the per-shape linear table (bench_latency.linear_bench:
# cuBLAS vs csrc's small-M kernel vs the Triton FP8 GEMM, every S2-Pro shape at M = 1..64) into
# $OUT/linear_table.json and installs it as this GPU kind's table for the rest of the call
# (build.device_table: the committed one on an H200, its sibling elsewhere; LINEAR_INSTALL=0: not, for a
# partial sweep such as LINEAR_ARGS="--shapes wo --ms 1 --variants 0,3"; LINEAR_MERGE=1: a
# partial sweep's rows merged into this GPU kind's table, which is then installed, e.g.
# LINEAR_ARGS="--shapes wqkv,wo,w13,w2 --ms 16,32,64"); FP8_GATE=1 runs the FP8-vs-
# bf16 correctness gate at real size with its negative controls (engine.fp8_gate); FP8_GATE_W8A8=1
# also runs it with the activations quantised (--w8a8 table: as --fp8-activations runs; rowwise:
# every FP8 linear through the rowwise W8A8 GEMM) into $OUT/fp8_gate_w8a8_<mode>.{json,txt};
# SKIP_AFTER_FIRST: gpu_bench sections to skip for every dtype after the first (codec_profile:
# the codec does not depend on the model's dtype).
# DTYPES="bf16 fp8" runs the server bench and gpu_bench once per model dtype, under
# $OUT/<dtype>/ (default: bf16 only, straight under $OUT); the server bench saves each
# dtype's decode_tps baseline and gates against bench_latency/baselines/h200_s2pro_<dtype>.json
# where that exists (GATE_BASELINE=0: no gate). SERVER=0 skips the server bench; BENCH_FIRST=1
# runs gpu_bench first, BENCH_S seconds per dtype (BENCH=0: no gpu_bench); BENCH_DTYPES: gpu_bench's dtypes (default
# DTYPES); LINEAR_ARGS: more linear_bench options (e.g. "--variants 0,1,2 --reps 10").
# STEP_TABLES="new=current old=tables/before.json new2=current": the frame step (graph
# replay ms and kernels per step at batches 1, 2, 16, 64; scripts/gpu_bench.py's profile)
# with each linear table in turn, after LINEAR (so `current`, the table in place then, can be
# a freshly recorded one), in STEP_DTYPES (default fp8): $OUT/step_<name>_<dtype>.json (the
# profile's figures) and one line each; a path is a table file carried with the tree (make
# an older one with `git show REV:engine/kernels/linear_table.json > FILE` before the call).
# The device lacks the service's own packages (uvicorn, starlette, msgspec...): run
# scripts/device_wheels.sh here first and carry .whl; they are installed into /tmp/site.
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/*.py import the packages
OUT=${OUT:-artifacts/gpu}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 RTVOICE_FIXTURES=${RTVOICE_FIXTURES:-tests/fixtures/fish_s2_tiny}
t0=$(date +%s)
# this GPU kind's recorded tables (the committed H200 ones, or their per-device siblings:
# engine.kernels.build.device_table), where LINEAR / CONV_INSTALL install what they record
read -r LT CT < <(python3 -c 'from engine.kernels import build, codec_conv, linear
print(build.device_table(linear.DEFAULT_TABLE), build.device_table(codec_conv.DEFAULT_TABLE))' \
    2>/dev/null) || { LT=engine/kernels/linear_table.json; CT=engine/kernels/codec_conv_table.json; }
echo "tables of this GPU kind: $LT $CT"
SMOKE="host_sync or engine_audio or pingpong or replay_streams or fused_kernel or bias_folding or split or two_engines or fixtures_with_fused or swiglu or fused_rope or prefilled_ahead or residual_epilogue or norm_fusion or pdl or step_book or naming or unit_kernel or upsample or decode_attention_triton or triton_attention or shared_prefix or prequant or act_quant or triton_rows"
if [ "${TESTS:-smoke}" = all ]; then K=${TESTS_K:-}; else K=${TESTS_K:-$SMOKE}; fi
# one pytest process per file, within TESTS_TIMEOUT in all: a file whose test takes the
# process down (a segfault: faulthandler names the test) stops only that file
if [ "${TESTS:-smoke}" != none ]; then
    : >"$OUT/tests.txt"
    T_END=$(( $(date +%s) + ${TESTS_TIMEOUT:-300} ))
    for F in tests/test_decode_attention_triton.py tests/test_cuda.py tests/test_bookkeeping.py \
             tests/test_codec_conv.py tests/test_fp8_triton.py tests/test_quant.py tests/test_kernels.py; do
        LEFT=$(( T_END - $(date +%s) ))
        [ $LEFT -gt 5 ] || { echo "$F: not run (TESTS_TIMEOUT)" | tee -a "$OUT/tests.txt"; continue; }
        echo "== $F" >>"$OUT/tests.txt"
        timeout $LEFT python3 -m pytest -q -p no:cacheprovider "$F" ${K:+-k "$K"} 2>&1 \
            | grep -Ev '^ {4,}|^$|site-packages|Warning:|warnings.html' | tail -12 >>"$OUT/tests.txt"
    done
    grep -E "^==|passed|failed|error|Fatal|File \"/.*tests/" "$OUT/tests.txt" | tail -30
fi
echo "tests done at +$(( $(date +%s) - t0 ))s"
if [ "${GATE:-0}" = 1 ]; then  # the change's ±5 % gate against .baseline (~200 s)
    OUT="$OUT" bash scripts/gpu_gate.sh 2>&1 | tail -12
    echo "gate done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${PROBE:-0}" = 1 ]; then  # prefill graphs alone: what a burst of turns costs (~25 s)
    timeout 90 python3 scripts/prefill_probe.py 2>&1 | grep -v "Warn\|warn" | tail -2 | tee "$OUT/probes.txt"
    # the csrc kernels vs torch (decode attention with and without split positions, ~15 s)
    timeout 60 python3 -m bench_latency.kernel_bench 2>&1 | grep -v "Warn\|warn" | tee -a "$OUT/probes.txt" | grep decode_attention
    # where the server's start goes before the engine (import, CUDA init, random weights)
    timeout 60 python3 scripts/start_probe.py 2>&1 | tail -1 | tee -a "$OUT/probes.txt"
fi
if [ "${KBENCH:-0}" = 1 ]; then  # kernel_bench alone (with its graph-timed attention rows:
    # csrc's decode attention against the Triton tile kernel at 16-256 rows, and with a
    # shared voice prefix read once per 16 rows; ~60 s)
    timeout ${KBENCH_TIMEOUT:-150} python3 -m bench_latency.kernel_bench --attention-rows 2>&1 \
        | grep -v "Warn\|warn" >"$OUT/kernel_bench.txt"
    grep decode_attention "$OUT/kernel_bench.txt" | tail -45
    echo "kernel_bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${CONV:-0}" = 1 ]; then  # the codec's fused residual-unit convs vs cuDNN + a pass, ticks
    timeout ${CONV_TIMEOUT:-420} python3 -m bench_latency.codec_conv_bench ${CONV_ARGS:-} \
        --json "$OUT/codec_conv.json" 2>&1 | grep -v "Warn\|warn" | tee "$OUT/codec_conv.txt" | tail -20
    # CONV_INSTALL=1 (with a --sweep): the new table serves the rest of the call
    [ "${CONV_INSTALL:-0}" = 1 ] && [ -s "$OUT/codec_conv.json" ] \
        && cp "$OUT/codec_conv.json" "$CT" \
        && echo "installed the swept codec conv table"
    echo "codec conv bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${SWIGLU:-0}" = 1 ]; then  # the FFN's linear + silu*mul vs the SwiGLU epilogue (~20 s)
    timeout 120 python3 -m bench_latency.linear_bench --swiglu --out "$OUT/swiglu.json" 2>&1 \
        | grep -v "Warn\|warn" | tee "$OUT/swiglu.txt" | grep "^swiglu"
    echo "swiglu bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${GLU:-0}" = 1 ]; then  # FP8 w13 over prequantised x: GEMM + quantising gate vs the GLU GEMM
    timeout 150 python3 -m bench_latency.linear_bench --glu --out "$OUT/glu.json" 2>&1 \
        | grep -v "Warn\|warn" | tee "$OUT/glu.txt" | grep "^glu"
    echo "glu bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${NORM:-0}" = 1 ]; then  # residual add + RMSNorm between projections: unfused vs folded (~30 s)
    timeout 150 python3 -m bench_latency.linear_bench --norm --ms 1,2,4,8,16 --out "$OUT/norm.json" 2>&1 \
        | grep -v "Warn\|warn" | tee "$OUT/norm.txt" | grep "^norm"
    echo "norm bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${ATTEND_BENCH:-0}" = 1 ]; then  # the fast AR's attention + wo vs the attention prologue
    timeout 150 python3 -m bench_latency.linear_bench --attend --ms 1,2 --out "$OUT/attend.json" 2>&1 \
        | grep -v "Warn\|warn" | tee "$OUT/attend.txt" | grep "^attend"
    echo "attend bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${ROWWISE:-0}" = 1 ]; then  # FP8 at 16-64 rows: bf16 copies vs rowwise-scaled W8A8
    timeout 200 python3 -m bench_latency.linear_bench --rowwise --shapes wqkv,wo,w13,w2 \
        --out "$OUT/rowwise.json" 2>&1 | grep -v "Warn\|warn" | tee "$OUT/rowwise.txt" \
        | grep "^rowwise"
    echo "rowwise bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${LINEAR:-0}" = 1 ]; then  # the per-shape linear table, used by every engine below
    # LINEAR_MERGE=1 (with a partial sweep's LINEAR_ARGS="--shapes .. --ms .."): its rows
    # replace those of this GPU kind's table ($LT, where one is recorded) in what is written
    MERGE=()
    [ "${LINEAR_MERGE:-0}" = 1 ] && [ -f "$LT" ] && MERGE=(--into "$LT")
    timeout ${LINEAR_TIMEOUT:-240} python3 -m bench_latency.linear_bench --out "$OUT/linear_table.json" ${LINEAR_ARGS:-} "${MERGE[@]}" \
        > "$OUT/linear_bench.txt" 2>&1
    tail -40 "$OUT/linear_bench.txt"
    [ -s "$OUT/linear_table.json" ] && [ "${LINEAR_INSTALL:-1}" = 1 ] \
        && cp "$OUT/linear_table.json" "$LT"
    echo "linear bench done at +$(( $(date +%s) - t0 ))s"
fi
if [ -n "${STEP_TABLES:-}" ]; then  # the frame step with each linear table in turn (A/B)
    kept=$(mktemp)
    if [ -f "$LT" ]; then cp "$LT" "$kept"; else : >"$kept"; fi  # none: restored as none
    for pair in $STEP_TABLES; do
        name=${pair%%=*}
        src=${pair#*=}
        [ "$src" = current ] && src=$kept
        if [ ! -s "$src" ]; then echo "STEP_TABLES: no table file '$src' for $name"; continue; fi
        cp "$src" "$LT"
        for DT in ${STEP_DTYPES:-fp8}; do
            d=$(mktemp -d)
            timeout ${STEP_TIMEOUT:-150} python3 scripts/gpu_bench.py --dtype "$DT" \
                --skip fixtures,decode,codec,codec_profile,engine --out "$d" >"$d/log" 2>&1
            python3 scripts/gpu_bench.py --summarise-step "$d/gpu_bench.json" \
                --label "$name $DT" >"$OUT/step_${name}_${DT}.json" \
                || { echo "step with table $name ($DT) failed:"; tail -5 "$d/log"
                     rm -f "$OUT/step_${name}_${DT}.json"; }
            rm -rf "$d"
        done
    done
    if [ -s "$kept" ]; then cp "$kept" "$LT"; else rm -f "$LT"; fi
    rm -f "$kept"
    echo "step tables done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${FP8_GATE:-0}" = 1 ]; then  # FP8 vs bf16 at real size, with the negative controls
    timeout ${FP8_GATE_TIMEOUT:-240} python3 -m engine.fp8_gate --model s2-pro --device cuda \
        --controls --json "$OUT/fp8_gate.json" 2>&1 | grep -v "Warn\|warn" | tail -30 | tee "$OUT/fp8_gate.txt"
    echo "fp8 gate done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${FP8_GATE_W8A8:-0}" = 1 ]; then  # the same with the activations quantised to e4m3 too
    for mode in table rowwise; do
        timeout ${FP8_GATE_TIMEOUT:-240} python3 -m engine.fp8_gate --model s2-pro --device cuda \
            --controls --w8a8 $mode --json "$OUT/fp8_gate_w8a8_$mode.json" 2>&1 \
            | grep -v "Warn\|warn" | tail -30 | tee "$OUT/fp8_gate_w8a8_$mode.txt"
    done
    echo "fp8 w8a8 gates done at +$(( $(date +%s) - t0 ))s"
fi
if [ "${SESSIONS:-1}" = 1 ]; then  # open sessions: 1,000 10 s voices, shared vs distinct bursts, eviction (~100 s)
    timeout ${SESSIONS_TIMEOUT:-200} python3 scripts/sessions_bench.py --sessions ${N_SESSIONS:-1000} \
        ${SESSIONS_ONLY:+--only $SESSIONS_ONLY} --out "$OUT" 2>&1 | grep -v "Warn\|warn" | cut -c1-600 | tail -12
    echo "sessions bench done at +$(( $(date +%s) - t0 ))s"
fi
DTYPES=${DTYPES:-bf16}
N_DT=$(echo $DTYPES | wc -w)
dir_for() { if [ "$N_DT" -gt 1 ]; then mkdir -p "$OUT/$1"; echo "$OUT/$1"; else echo "$OUT"; fi; }
servers() {
    [ "${SERVER:-1}" = 1 ] || return 0
    for DT in $DTYPES; do
        D_OUT=$(dir_for "$DT")
        BASE=bench_latency/baselines/h200_s2pro_$DT.json
        [ "${GATE_BASELINE:-1}" = 1 ] && [ -f "$BASE" ] || BASE=
        OUT=$D_OUT DTYPE=$DT BASELINE=$BASE MAX_LEN=${MAX_LEN:-1024} MAX_RUNNING=${MAX_RUNNING:-128} \
            SERVER_LEVELS=${SERVER_LEVELS:-1 4 16 32 64 128} \
            timeout ${SERVER_TIMEOUT:-220} bash scripts/gpu_server_bench.sh 2>&1 | grep -v "^ \|^$" | tail -40
        # gpu_server_bench.sh merged the levels into server.json: the device returns few files
        [ -s "$D_OUT/server.json" ] && rm -f "$D_OUT"/server_c[0-9]*.json
        echo "server bench ($DT) done at +$(( $(date +%s) - t0 ))s"
    done
}
benches() {
    [ "${BENCH:-1}" = 1 ] || return 0
    local n skip
    n=$(echo ${BENCH_DTYPES:-$DTYPES} | wc -w)
    skip=${SKIP:-decode,codec,fixtures,profile}
    for DT in ${BENCH_DTYPES:-$DTYPES}; do
        D_OUT=$(dir_for "$DT")
        LEFT=$(( (${TOTAL:-585} - ($(date +%s) - t0)) / n ))
        [ -n "${BENCH_S:-}" ] && LEFT=$BENCH_S  # a fixed box per dtype (BENCH_FIRST=1 runs)
        [ "$LEFT" -lt 30 ] && echo "only ${LEFT}s left of TOTAL: gpu_bench ($DT) gets 30s" && LEFT=30
        n=$(( n > 1 ? n - 1 : 1 ))
        timeout -s ABRT "$LEFT" python3 -X faulthandler scripts/gpu_bench.py --dtype "$DT" \
            --skip "$skip" ${COMPILED_SAMPLER:+--compiled-sampler} \
            ${DECODE_ROPE:+--decode-rope $DECODE_ROPE} ${PDL_MODES:+--pdl-modes $PDL_MODES} \
            ${FP8_NORMED:+--fp8-normed $FP8_NORMED} \
            $([ "$DT" = fp8 ] && [ "${FP8_NODENSE:-0}" = 1 ] && echo --fp8-nodense) \
            $([ "${ATTEND:-0}" = 1 ] && echo --attend-prologue) \
            $([ "${COMPILED_BOOK:-0}" = 1 ] && echo --compiled-book) \
            ${ATTN_TRITON:+--attn-triton $ATTN_TRITON} \
            $([ "${FP8_W8A8:-0}" = 1 ] && echo --fp8-activations) \
            --levels "${ENGINE_LEVELS:-1,4,16,32,64,128}" --frames 64 \
            --engine-runs "${ENGINE_RUNS:-pingpong_codec,pingpong_nocodec,naive_nocodec}" --out "$D_OUT" \
            >"$D_OUT/gpu_bench_log.txt" 2>&1
        grep '^{"' "$D_OUT/gpu_bench_log.txt" | cut -c1-400 | tail -14
        echo "gpu_bench ($DT) done at +$(( $(date +%s) - t0 ))s"
        skip="$skip${SKIP_AFTER_FIRST:+,$SKIP_AFTER_FIRST}"  # e.g. the dtype-free codec profile
    done
}
# BENCH_FIRST=1: gpu_bench (with BENCH_S seconds per dtype) before the server bench
if [ "${BENCH_FIRST:-0}" = 1 ]; then benches; servers; else servers; benches; fi
echo "all done at +$(( $(date +%s) - t0 ))s"
