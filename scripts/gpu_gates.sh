#!/usr/bin/env bash
# The seed's two gates on one GPU, in one command (issue 14; DESIGN.md §2):
#   correctness — engine.fp8_gate at S2-Pro size: greedy FP8 == bf16 for 5 frames and the
#     logits' relative error within its bound, and both corrupted-scale controls failing;
#   performance — the server bench at c = 1, 16, 64 in bf16 and in FP8 against the frozen
#     H200 baselines bench_latency/baselines/h200_s2pro_{bf16,fp8}.json (per-request
#     decode_tps may not drop more than 5 %), each run's own baseline saved beside it.
# Results under $OUT: fp8_gate.{json,txt}, {bf16,fp8}/server.json (+ gate verdict printed),
# {bf16,fp8}/baseline.json. Exit status: nonzero when either gate fails.
# The baselines were recorded with these settings (change them together):
set -uo pipefail
export OUT=${OUT:-artifacts/gates}
mkdir -p "$OUT"
FP8_GATE=1 TESTS=none SESSIONS=0 DTYPES="bf16 fp8" MAX_RUNNING=64 SERVER_LEVELS="1 16 64" \
    REFERENCE_S=0 MAX_FRAMES=96 SKIP=${SKIP:-decode,codec,fixtures,codec_profile,profile,engine} \
    bash scripts/gpu_all.sh 2>&1 | tee "$OUT/gates_log.txt"
rc=0
grep -q "^PASS" "$OUT/fp8_gate.txt" || { echo "correctness gate: FAILED (see $OUT/fp8_gate.txt)"; rc=1; }
grep -q "decode_tps gate.*FAIL" "$OUT/gates_log.txt" && { echo "performance gate: FAILED"; rc=1; }
grep -c "decode_tps gate.*PASS" "$OUT/gates_log.txt" | grep -q "^2$" \
    || { echo "performance gate: not run for both dtypes (no baseline, or a run failed)"; rc=1; }
exit $rc
