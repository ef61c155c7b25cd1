#!/usr/bin/env bash
# The TP = 2 runs (two H200s of one host), prepared so that a lent machine is used for measuring:
# one PART per device call (each bounded under the device tool's 10 minutes), each printing the
# decision it serves before it runs, then its numbers. Run from the repo root on the GPU host
# after staging (.gpu/: tpserve, tpserve-bench, tpserve-bench-model, tpserve-loadtest,
# tpserve_gpu_tests; see benchmarks/README.md), with `source .gpu/env.sh` done by this script.
#
#   bash benchmarks/run_tp2_session.sh PART        PART: tests | overlap | model | serve | missing
#
# Outputs go to $OUT (the device tool's folder) or ./gpu-out. COMMIT=<sha> is recorded in the
# JSON files. The parts and what each decides:
#   tests    all GPU tests on two GPUs (the two-GPU cases skip on one): 0 failed, and
#            GpuLayerProcessesTest (every shipped mode as two processes, eager and replayed) ran.
#   overlap  the overlap benchmark, FP8, llama70b shapes (run_overlap_bench.sh): per shape our
#            best <= 1.02 x PyTorch's best, geomean >= 1.10, auto <= 1.02 x none, and at
#            m >= 4096 our best <= 1.05 x max(gemm_only, comm_only).
#   model    the 80-layer llama3-70b prefill (run_model_bench.sh): tuned (deploy config) >= 1.10 x
#            none at 8x1024, beside the eager PyTorch model; logits checked against none.
#   serve    llama3-70b FP8 serving (run_generation_bench.sh, TP=2, deploy config): output
#            tokens/s >= 0.7 x TensorRT-LLM's published Llama-3.1-70B FP8 H200 TP=2 figures:
#            128/128 6,477, 1000/1000 5,097, 2048/128 773.
#   missing  prints the TP = 2 runs that have no tool yet.
set -euo pipefail
part=${1:-}
case "$part" in
  tests | overlap | model | serve | missing) ;;
  *)
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
out=${OUT:-gpu-out}
mkdir -p "$out"
export COMMIT=${COMMIT:-unknown}
# shellcheck source=/dev/null
[ "$part" = missing ] || source .gpu/env.sh
if [ "$part" != missing ]; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  [ "$gpus" -ge 2 ] || { echo "this part needs two GPUs; this host has $gpus" >&2; exit 1; }
  nvidia-smi --query-gpu=index,name,clocks.sm,power.draw,temperature.gpu --format=csv >"$out/gpus-$part.csv"
fi

decide() { echo "== decision: $*"; }

case "$part" in
  tests)
    decide "0 failed; GpuLayerProcessesTest ran (not skipped)"
    timeout 420 .gpu/bin/tpserve_gpu_tests >"$out/gpu-tests-tp2.log" 2>&1 || echo "tpserve_gpu_tests: exit $?"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$out/gpu-tests-tp2.log" | tail -12
    grep -E "^\[ +(OK|FAILED|SKIPPED) +\] GpuLayerProcesses" "$out/gpu-tests-tp2.log" || echo "GpuLayerProcessesTest: no result"
    gzip -f "$out/gpu-tests-tp2.log"
    ;;
  overlap)
    decide "per shape ours <= 1.02 x PyTorch's best; geomean >= 1.10; auto <= 1.02 x none; m >= 4096: ours <= 1.05 x max(gemm_only, comm_only)"
    SKIP_TESTS=1 DTYPES=fp8 PRESETS=llama70b ROUNDS=${ROUNDS:-20} \
      timeout 560 bash benchmarks/run_overlap_bench.sh || echo "run_overlap_bench.sh: exit $?"
    ;;
  model)
    decide "tuned / none >= 1.10 at 8x1024 (80 layers); each setting's logits against none within the check's bound"
    MODEL=llama3-70b TP=2 BATCHES="8x1024 16x1024" ROUNDS=${ROUNDS:-10} PEER=eager \
      BENCH_TIMEOUT=300 PEER_TIMEOUT=200 timeout 560 bash benchmarks/run_model_bench.sh ||
      echo "run_model_bench.sh: exit $?"
    ;;
  serve)
    decide "output tokens/s >= 0.7 x 6,477 (128/128), 5,097 (1000/1000), 773 (2048/128)"
    MODEL=llama3-70b TP=2 OVERLAP=deploy/overlap-llama3-70b-tp2.yaml KV_GIB=${KV_GIB:-60} \
      CASE_TIMEOUT_S=${CASE_TIMEOUT_S:-150} BIN_DIR=.gpu/bin timeout 580 \
      bash benchmarks/run_generation_bench.sh "$out/gen" 128:128:256 2048:128:64 1000:1000:256 ||
      echo "run_generation_bench.sh: exit $?"
    ;;
  missing)
    echo "not runnable yet (no tool): the compiled PyTorch peer with inductor's micro-pipeline"
    echo "async TP and symmetric memory (benchmarks/torch_model_compiled.py is TP 1 only), and"
    echo "decode steps at TP = 2 (tpserve-bench-decode runs one GPU)."
    ;;
esac
