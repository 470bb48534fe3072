#!/usr/bin/env bash
# The whole GPU measurement of issue 5 in one device call (sized for 10 minutes on one H200;
# the parts run under their own limits — tests ~220-300 s incl. the 70 s extension build,
# server ~130-200 s incl. its ~100 s start-up — and the engine sweep gets what is left):
#   1. the CUDA tests (csrc kernels vs their fallbacks, graphs vs eager, pingpong vs sync,
#      no host sync in steady state, graphed codec/prefill vs eager, fixtures with fused ops);
#   2. the server bench: `rtvoice serve` (S2-Pro shapes, bf16 dummy weights) driven by
#      bench-latency over real WebSockets at c = 1, 16, 64, 200 ms jitter buffer;
#   3. scripts/gpu_bench.py: reference fixtures on the GPU, codec speed (eager vs graphs),
#      the frame-step profile, and the engine sweep (pingpong with/without codec vs naive).
# Results under $OUT (default artifacts/gpu): tests.txt, server_c<N>.json, server.log,
# gpu_bench.json, gpu_bench_log.txt. Knobs: TESTS_K (pytest -k), SERVER_LEVELS ("1 16 64"),
# LEVEL_TIMEOUT, TESTS_TIMEOUT, SERVER_TIMEOUT, ENGINE_LEVELS ("1,16,64"), ENGINE_RUNS,
# SKIP (gpu_bench sections; default decode,codec_profile), TOTAL (s),
# COMPILED_SAMPLER=1 (profile the step again with the compiled torch sampler, for comparison).
set -uo pipefail
OUT=${OUT:-artifacts/gpu}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 RTVOICE_FIXTURES=${RTVOICE_FIXTURES:-.fixtures/fish_s2_tiny}
t0=$(date +%s)
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | grep -v "Warning\|warn\|^  \|^$" | tail -15 | tee "$OUT/tests.txt"
echo "tests done at +$(( $(date +%s) - t0 ))s"
MAX_LEN=${MAX_LEN:-1024} timeout ${SERVER_TIMEOUT:-200} bash scripts/gpu_server_bench.sh 2>&1 | grep -v "^ \|^$" | tail -40
echo "server bench done at +$(( $(date +%s) - t0 ))s"
timeout -s ABRT $(( ${TOTAL:-570} - ($(date +%s) - t0) )) python3 -X faulthandler scripts/gpu_bench.py \
    --skip "${SKIP:-decode,codec_profile}" ${COMPILED_SAMPLER:+--compiled-sampler} \
    --levels "${ENGINE_LEVELS:-1,16,64}" --frames 64 \
    --engine-runs "${ENGINE_RUNS:-pingpong_codec,pingpong_nocodec,naive_nocodec}" --out "$OUT" \
    >"$OUT/gpu_bench_log.txt" 2>&1
grep '^{"' "$OUT/gpu_bench_log.txt" | cut -c1-400 | tail -14
echo "all done at +$(( $(date +%s) - t0 ))s"
