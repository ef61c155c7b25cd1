#!/usr/bin/env bash
# The whole GPU-host session in one call: GPU tests, then tpserve-bench and the
# PyTorch peer on the same shapes, merged into one results file per preset,
# rendered as tables and a PNG. Run from the repo root on the GPU host after
# staging (see benchmarks/README.md):
#   COMMIT=<sha> bash benchmarks/run_overlap_bench.sh
# Outputs go to $OUT (the device tool's folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
source .gpu/env.sh
commit=${COMMIT:-unknown}
date=$(date -u +%Y-%m-%d)
rounds=${ROUNDS:-30}
ms=${MS:-512 2048 8192 16384}
rc=0
log="$out/bench.log"
: > "$log"

echo "== gpu tests (layers, GEMM)"
timeout ${TEST_TIMEOUT:-240} .gpu/bin/tpserve_gpu_tests --gtest_filter='-GpuNcclTest.*' \
  > "$out/gpu_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/gpu_tests.log" | tail -12
echo "== gpu tests (NCCL communicator)"
timeout ${NCCL_TEST_TIMEOUT:-150} .gpu/bin/tpserve_gpu_tests --gtest_filter='GpuNcclTest.*' \
  > "$out/gpu_nccl_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/gpu_nccl_tests.log" | tail -12

run_preset() {  # preset, extra args for tpserve-bench
  local preset=$1; shift
  local cmd_ours=".gpu/bin/tpserve-bench --shapes $preset --m $ms --dtype fp8 bf16 --chunks 2 4 8 --rounds $rounds --commit $commit $*"
  local cmd_peer="python3 benchmarks/torch_peer.py --tp 2 --shapes $preset --m $ms --dtype fp8 bf16 --chunks 2 4 8 --rounds $rounds --timeout 300"
  echo "== $preset: $cmd_ours" | tee -a "$log"
  timeout ${BENCH_TIMEOUT:-240} $cmd_ours --out "/tmp/ours-$preset.json" >> "$log" 2>&1 || rc=1
  echo "== $preset: $cmd_peer" | tee -a "$log"
  PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-240} $cmd_peer --out "/tmp/peer-$preset.json" >> "$log" 2>&1 || rc=1
  local merged="$out/$date-$preset-tp2.json"
  python3 benchmarks/merge_results.py --ours "/tmp/ours-$preset.json" --peer "/tmp/peer-$preset.json" \
    --commit "$commit" --date "$date" \
    --command "COMMIT=$commit bash benchmarks/run_overlap_bench.sh: $cmd_ours ; $cmd_peer" \
    --out "$merged" >> "$log" 2>&1 || rc=1
  python3 benchmarks/render_results.py "$merged" --png "$out/$date-$preset-tp2.png" \
    >> "$out/tables.txt" 2>&1 || rc=1
}
run_preset llama70b --max-ctas 0 8 --methods gemm_only comm_only none pipeline ring pipeline_ce layer_gemm
ms="65536" run_preset seed --max-ctas 0 8
grep -A40 -i "summary" "$out/tables.txt" | head -80
exit $rc
