#!/usr/bin/env bash
# Runs on the GPU host (device tool), from the repo root, after
#   ../shared/tools/stage-for-gpu-host .gpu build/bin/tpserve_gpu_tests build/bin/tpserve-bench ...
# Writes logs under $OUT (or ./gpu-out). Usage: bash benchmarks/gpu_check.sh [tests|bench|all] [bench args...]
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu-out}; mkdir -p "$out"
source .gpu/env.sh
{ nvidia-smi; nvidia-smi topo -m; } > "$out/nvidia-smi.txt" 2>&1
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== gpu tests"
  timeout ${TEST_TIMEOUT:-330} .gpu/bin/tpserve_gpu_tests --gtest_output=json:"$out/gpu_tests.json" \
    > "$out/gpu_tests.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$out/gpu_tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== tpserve-bench $*"
  timeout ${BENCH_TIMEOUT:-240} .gpu/bin/tpserve-bench --out "$out/bench.json" "$@" > "$out/bench.log" 2>&1 || rc=1
  grep -E "median|error|wrote" "$out/bench.log" | sed 's/^\[[^]]*\] \[[a-z]*\] //' | tail -80
fi
exit $rc
