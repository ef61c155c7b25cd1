#!/usr/bin/env bash
# The whole GPU-host session in one call: GPU tests, then tpserve-bench and the
# PyTorch peer on the same shapes, merged into one results file per preset,
# rendered as tables and a PNG. Run from the repo root on the GPU host after
# staging (see benchmarks/README.md):
#   COMMIT=<sha> bash benchmarks/run_overlap_bench.sh
# Outputs go to $OUT (the device tool's folder) or ./gpu-out: one merged file
# per preset, and with COMBINED=<what> one more holding every preset.
# BRACKET=1 (the default): the PyTorch peer runs once before tpserve's runs
# and once after, and each of its methods' rounds from both passes are pooled
# (merge_results.py --pool-peer-passes), so that the GPUs' clock and power
# drift over the call falls on both implementations alike; BRACKET=0: once,
# after.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
source .gpu/env.sh
commit=${COMMIT:-unknown}
date=$(date -u +%Y-%m-%d)
rounds=${ROUNDS:-30}
ms=${MS:-512 2048 8192 16384}
dtypes=${DTYPES:-fp8 bf16}
chunks=${CHUNKS:-2 4 8}
presets=${PRESETS:-llama70b seed}
methods=${METHODS:-gemm_only comm_only none pipeline ring auto layer_gemm}
# The peer's methods: its three ways to run a layer, and torch_seq's GEMM and collective
# timed alone (diagnostics: where a gap to torch_seq comes from; never PyTorch's best).
peer_methods=${PEER_METHODS:-torch_seq torch_chunked torch_symm_mem gemm_only comm_only}
tp=${TP:-2}  # GPUs (tensor-parallel size) of both implementations
overlap=${OVERLAP:-deploy/overlap-llama3-70b-tp$tp.yaml}  # what method auto resolves
max_ctas=${MAX_CTAS:-0 8}  # NCCL CTA limits swept for pipeline/ring
gemm_algo=${GEMM_ALGO:-timed}  # tpserve-bench --gemm-algo: timed | heuristic
bracket=${BRACKET:-1}
pool=(); [ "$bracket" = 1 ] && pool=(--pool-peer-passes)
rc=0
all_files=()   # every preset's --ours and --peer files (COMBINED below)
all_cmds=""
log="$out/bench.log"
: > "$log"

if [ -z "${SKIP_TESTS:-}" ]; then
echo "== gpu tests (layers, GEMM, kernels)"
timeout ${TEST_TIMEOUT:-240} .gpu/bin/tpserve_gpu_tests --gtest_filter='-GpuNcclTest.*' \
  > "$out/gpu_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/gpu_tests.log" | tail -12
echo "== gpu tests (NCCL communicator)"
timeout ${NCCL_TEST_TIMEOUT:-150} .gpu/bin/tpserve_gpu_tests --gtest_filter='GpuNcclTest.*' \
  > "$out/gpu_nccl_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/gpu_nccl_tests.log" | tail -12
fi

# Copy-engine methods first on their own, briefly: a copy-engine failure must
# not take the whole sweep down with it (a failed case aborts the
# communicators, and every later case fails too).
if [[ " $methods " == *_ce* ]]; then
  echo "== copy-engine smoke test"
  if ! timeout ${SMOKE_TIMEOUT:-60} .gpu/bin/tpserve-bench --shapes llama70b --m 8192 --dtype fp8 \
      --chunks 2 --methods none none_ce ring_ce pipeline_ce --rounds 3 --timeout-s 20 \
      --out /tmp/smoke.json > "$out/smoke.log" 2>&1; then
    echo "copy-engine smoke test failed (see smoke.log): sweeping without copy engines"
    methods=$(for x in $methods; do [[ $x == *_ce || $x == ring_inplace || $x == *_fullw ]] || printf '%s ' "$x"; done)
    rc=1
  fi
fi

run_preset() {  # preset, extra args for tpserve-bench
  local preset=$1; shift
  local sweep_methods="$methods" tuned="" ours_files=()
  # TUNE=1: the sweep also tunes (--tune-out), and method auto is then
  # measured in a second run that resolves the config just written, so that
  # auto, none and PyTorch come from one session. The runs' records are
  # tagged (--run-label sweep / auto); the criteria judge the auto run.
  if [ -n "${TUNE:-}" ]; then
    tuned="$out/$date-overlap-$preset-tp$tp-tuned.yaml"
    sweep_methods=$(for x in $methods; do [ "$x" = auto ] || printf '%s ' "$x"; done)
  fi
  local cmd_ours=".gpu/bin/tpserve-bench --tp $tp --shapes $preset --m $ms --dtype $dtypes --chunks $chunks --rounds $rounds --commit $commit --gemm-algo $gemm_algo $* --methods $sweep_methods ${BENCH_ARGS:-}"
  [ -n "$tuned" ] && cmd_ours="$cmd_ours --tune-out $tuned --run-label sweep" || cmd_ours="$cmd_ours --overlap $overlap"
  local cmd_peer="python3 benchmarks/torch_peer.py --tp $tp --shapes $preset --m $ms --dtype $dtypes --chunks $chunks --rounds $rounds --methods $peer_methods --timeout 300"
  local peer_files=() peer_cmds=""
  if [ "$bracket" = 1 ]; then
    echo "== $preset: $cmd_peer (before tpserve)" | tee -a "$log"
    rm -f "/tmp/peer-pre-$preset.json"  # never merge an earlier run's file
    PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-240} $cmd_peer --out "/tmp/peer-pre-$preset.json" >> "$log" 2>&1 || rc=1
    peer_files+=(--peer "/tmp/peer-pre-$preset.json")
    peer_cmds="$cmd_peer ; "
  fi
  echo "== $preset: $cmd_ours" | tee -a "$log"
  rm -f "/tmp/ours-$preset.json"
  timeout ${BENCH_TIMEOUT:-240} $cmd_ours --out "/tmp/ours-$preset.json" >> "$log" 2>&1 || rc=1
  ours_files+=(--ours "/tmp/ours-$preset.json")
  local cmd_all="$cmd_ours"
  if [ -n "$tuned" ] && [[ " $methods " == *" auto "* ]] && [ -s "$tuned" ]; then
    # Its own gemm_only and comm_only: render_results.py judges each shape
    # within one run (best, none and floor measured in the same context).
    local cmd_auto=".gpu/bin/tpserve-bench --tp $tp --shapes $preset --m $ms --dtype $dtypes --rounds $rounds --commit $commit --gemm-algo $gemm_algo --methods gemm_only comm_only none auto --overlap $tuned --run-label auto"
    echo "== $preset: $cmd_auto" | tee -a "$log"
    rm -f "/tmp/ours-auto-$preset.json"
    timeout ${AUTO_TIMEOUT:-120} $cmd_auto --out "/tmp/ours-auto-$preset.json" >> "$log" 2>&1 || rc=1
    ours_files+=(--ours "/tmp/ours-auto-$preset.json")
    cmd_all="$cmd_all ; $cmd_auto"
  fi
  echo "== $preset: $cmd_peer" | tee -a "$log"
  rm -f "/tmp/peer-$preset.json"
  PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-240} $cmd_peer --out "/tmp/peer-$preset.json" >> "$log" 2>&1 || rc=1
  peer_files+=(--peer "/tmp/peer-$preset.json")
  local merged="$out/$date-$preset-tp$tp.json"
  python3 benchmarks/merge_results.py "${ours_files[@]}" "${peer_files[@]}" "${pool[@]}" \
    --commit "$commit" --date "$date" \
    --command "COMMIT=$commit BRACKET=$bracket bash benchmarks/run_overlap_bench.sh: $peer_cmds$cmd_all ; $cmd_peer" \
    --out "$merged" >> "$log" 2>&1 || rc=1
  python3 benchmarks/render_results.py "$merged" --png "$out/$date-$preset-tp$tp.png" \
    >> "$out/tables.txt" 2>&1 || rc=1
  all_files+=("${ours_files[@]}" "${peer_files[@]}")
  all_cmds="$all_cmds${all_cmds:+ ; }$peer_cmds$cmd_all ; $cmd_peer"
}
for preset in $presets; do
  if [ "$preset" = seed ]; then
    ms="65536" run_preset seed --max-ctas $max_ctas
  else
    run_preset "$preset" --max-ctas $max_ctas
  fi
done
# COMBINED=<what>: every preset of this call in one more file,
# $date-<what>.json, whose criteria cover the whole shape set.
if [ -n "${COMBINED:-}" ]; then
  combined="$out/$date-$COMBINED.json"
  python3 benchmarks/merge_results.py "${all_files[@]}" "${pool[@]}" --commit "$commit" --date "$date" \
    --command "COMMIT=$commit PRESETS='$presets' COMBINED=$COMBINED BRACKET=$bracket bash benchmarks/run_overlap_bench.sh: $all_cmds" \
    --out "$combined" >> "$log" 2>&1 || rc=1
  echo "== combined: $combined" >> "$out/tables.txt"
  python3 benchmarks/render_results.py "$combined" --png "$out/$date-$COMBINED.png" \
    >> "$out/tables.txt" 2>&1 || rc=1
fi
grep -A40 -i "summary" "$out/tables.txt" | tail -${SUMMARY_LINES:-80}
exit $rc
