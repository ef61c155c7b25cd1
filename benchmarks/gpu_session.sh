#!/usr/bin/env bash
# One GPU-host session's checks in a fixed order, each bounded in time, logs
# under $OUT (the device tool's folder). Run from the repo root after staging
#   ../shared/tools/stage-for-gpu-host .gpu build/bin/tpserve_gpu_tests \
#       build/bin/tpserve build/bin/tpserve-bench build/bin/tpserve-bench-model \
#       build/bin/tpserve-loadtest build/bin/tpserve_e2e_tests
# as: bash benchmarks/gpu_session.sh PART   (one device call per part, each
# under the 10-minute limit of a call; benchmarks/gpu_call.sh runs several):
#   layers  the kernel tests and the layer check of every copy-engine mode
#   e2e     the server's e2e suite against the CUDA engine (tpserve_e2e_tests)
#   reference  tpserve vs a PyTorch model on one llama3-8b-shaped checkpoint
#   refsweep   the same on fewer layers, the tiny model and the scaled init
#   trained    the reference on a checkpoint whose LM head is trained on a synthetic
#              language (torch_reference.py --head markov), FP8 and BF16
#   selfcheck  tpserve against itself (mode none vs ring on copy engines) on the
#              same checkpoints, next to tpserve against PyTorch
#   tests   (bounded to ~9 min) the GPU tests, `tpserve layer` in the multi-process model,
#           `tpserve run --backend cuda` vs the CPU backend, the tiny model with one-chunk
#           copy-engine rings vs mode none (tpserve-bench-model --check-logits), the serve test
#   overlap the overlap benchmark with PyTorch (run_overlap_bench.sh), one process
#           per GPU, copy-engine methods included, Llama-3-70B's layers and the
#           seed's shape; tunes the overlap config and measures auto with it
#   tunesplit  the overlap sweep and tuner with --split-output (gemm_rs layers as the engine
#           runs o and down, their last sum left to the add & norm), Llama-3-70B's layers;
#           the tuned config is left at /tmp/overlap-split.yaml for the parts after it
#   modelcmp   the model (8x1024; LAYERS, default all) with mode none, the deploy config and
#           each file of CONFIGS (default /tmp/overlap-split.yaml; empty: none) interleaved
#           round by round, each setting's logits compared with mode none's, the GPUs idle
#           IDLE_MS before every pass (default 0), EAGER=1 for eager passes instead of graph
#           replays, GRAPH_BLOCKS=N for one graph per N blocks, CONNECTIONS=N for
#           CUDA_DEVICE_MAX_CONNECTIONS, NAME for the files' name, power sampled; no PyTorch
#   graphlead  modelcmp four ways (as served, CUDA_DEVICE_MAX_CONNECTIONS=32, eager, one graph
#           per 8 blocks): where the 80-layer overlapped graph loses against its eager pass
#   graphprio  the layer benchmark (NCCL modes and ring_ce) with graphs instantiated with
#           per-node priorities and with CUDA's default, alternating: what the comm streams'
#           priority is worth inside a graph
#   inplace  gemm_rs rings reading the running sums in the peer's memory (ring_inplace)
#           against copy-engine rings: layer benchmark of o and down (with and without
#           --split-output), then the model with the deploy config's o and down made in_place
#   fullw   gemm_rs without partial sums (LinearKnobs::full_weight) against the copy-engine
#           rings: the layer benchmark of Llama-3-70B's layers, ratios to gemm_only; then
#           (unless FULLW_MODEL=0) the 80-layer model with the deploy config's o entries made
#           full_weight (FULLW_VARIANTS, mode:chunks) against none and the deploy config
#   lanes   GEMM steps on two streams (LinearKnobs::gemm_lanes): the layer benchmark's
#           copy-engine rings with --gemm-lanes 1 and 2 (as the engine runs o and down), the
#           model (modelcmp) with the deploy config against the same config with gemm_lanes: 2
#           on every ring entry, then the model benchmark with PyTorch on that config
#   gateup  the whole model (8x1024) with the deploy config and variants of it that change
#           gate_up alone (mode none on NCCL; none on copy engines; ring on copy engines with
#           2 chunks), interleaved round by round with mode none
#   model   the model benchmark with PyTorch (run_model_bench.sh)
#   load    tpserve serve --backend cuda (llama3-70b, weights generated on the
#           GPUs) under a tpserve-loadtest concurrency sweep
#   stress  copy-engine layers in the process model, ITERS (default 3000) graph
#           replays per case, then 10 replays alternating two inputs, checked against eager
#   sustained  the whole model (8x1024) with the overlap config and variants of it made by
#           line edits (1 chunk everywhere; only the row- or column-parallel layers
#           overlapped; gate_up not overlapped), all interleaved round by round in one
#           process: which per-layer choices pay under the GPUs' sustained power limit
#   stages  where the model's time goes: tpserve-bench-model --stages (8x1024, all layers,
#           mode none and the overlap config), one eager pass timed stage by stage
#   ab      the model benchmark of this build against a base build staged as
#           .gpu/bin/tpserve-bench-model-base (commit BASE_COMMIT), processes alternating
#           base, new, base, new with static input scales, then base, new with dynamic ones
#   profile Nsight Compute on one GPU (tp 1, llama3-70b, 2 blocks, 8x1024): the elementwise
#           and attention kernels' speed-of-light, occupancy, warp stalls and hot SASS lines
#           (KERNELS, a regex, default all of engine/cuda_ops.cu's), clocks left alone
# TP=N (default 2) runs the layer check, overlap, model and load parts on N
# GPUs (the tests part's tiny-model run stays at 2: 4 KV heads), with
# deploy/overlap-llama3-70b-tpN.yaml as the default config and -tpN in the
# file names (issue 9: TP=4 and TP=8).
set -uo pipefail
part=${1:?usage: gpu_session.sh tests|layers|e2e|reference|refsweep|trained|selfcheck|overlap|tunesplit|modelcmp|graphlead|graphprio|inplace|fullw|lanes|gateup|model|load|stress|sustained|stages|ab|profile}
out=${OUT:-gpu-out}; mkdir -p "$out"
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit=${COMMIT:-unknown}
tp=${TP:-2}  # GPUs of the layer check, benchmarks and server (overlap, model, load)
export TP=$tp
rc=0
# An overlap config with every layer in mode ring on copy engines, 2 chunks
# (trained and selfcheck parts); prints its path.
ring_ce_config() {
  printf 'version: 1\ntp: 2\ndefaults:\n  mode: ring\n  chunks: 2\n  copy_engine: true\n' \
    > /tmp/ring-ce-all.yaml
  echo /tmp/ring-ce-all.yaml
}
# One torch_reference.py case named TAG, bounded to LIMIT seconds: the
# script's own arguments follow; the common ones (binary, commit, checkpoint
# directory, results file under $out, log) are added here, the checkpoint is
# removed afterwards, and the log lines matching PATTERN are shown (the last
# LINES of them; with 1, on the exit line).
reference_case() {
  local tag=$1 limit=$2 pattern=$3 lines=$4
  shift 4
  PYTHONUNBUFFERED=1 timeout "$limit" python3 benchmarks/torch_reference.py "$@" \
    --tpserve .gpu/bin/tpserve --commit "$commit" --dir "/tmp/ref-$tag" \
    --out "$out/$(date -u +%F)-torch-reference-$tag-$commit.json" > "$out/reference-$tag.log" 2>&1
  local status=$?
  if [ "$lines" = 1 ]; then
    echo "$tag: exit $status $(grep -E "$pattern" "$out/reference-$tag.log" | tail -1)"
  else
    echo "$tag: exit $status"; grep -E "$pattern" "$out/reference-$tag.log" | tail -"$lines"
  fi
  rm -rf "/tmp/ref-$tag"
}
# Calls FN once per case of SPECS (cases separated by ';'), with the case's
# words as its arguments: each_case SPECS FN.
each_case() {
  local specs spec
  IFS=';' read -ra specs <<< "$1"
  for spec in "${specs[@]}"; do
    # shellcheck disable=SC2086  # the case's words are the arguments
    "$2" $spec
  done
}
# The tiny model at TP = 2 with the overlap config $out/overlap-NAME.yaml against mode none
# (--check-logits), one process per GPU, eager and replayed; the batches follow:
# tiny_vs_none NAME LOG BATCHES... (results model-tiny-NAME.json, log model_tiny_LOG.log).
tiny_vs_none() {
  local name=$1 log=$2
  shift 2
  timeout 120 .gpu/bin/tpserve-bench-model --tp 2 --model tiny --batches "$@" --rounds 3 \
    --overlap "$out/overlap-$name.yaml" --check-logits 5e-2 --out "$out/model-tiny-$name.json" \
    > "$out/model_tiny_$log.log" 2>&1 || rc=1
  grep -E "logits vs none|error" "$out/model_tiny_$log.log"
}
case "$part" in
  tests)
    { nvidia-smi; nvidia-smi topo -m; } > "$out/nvidia-smi.txt" 2>&1
    echo "== gpu tests"
    timeout 240 .gpu/bin/tpserve_gpu_tests > "$out/gpu_tests.log" 2>&1 || rc=1
    grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/gpu_tests.log" | tail -20
    echo "== tpserve layer, one process per GPU"
    # Its verdict is its exit status (every rank PASS, and the --split-output ranks' kinds).
    timeout ${LAYER_CLI_TIMEOUT:-240} bash benchmarks/gpu_layer_cli.sh > "$out/layer_cli_verdict.txt" 2>&1 || rc=1
    echo "$(grep -c -- "-> PASS" "$out/layer_cli.log") rank checks PASS"
    grep "split-output:" "$out/layer_cli_verdict.txt"
    echo "== tpserve run --backend cuda vs cpu (tiny)"
    timeout 60 .gpu/bin/tpserve run --model tiny --tp 2 --backend cuda --ids 5,6,7,8 --json \
      > "$out/run_cuda.json" 2> "$out/run_cuda.log" || rc=1
    timeout 30 .gpu/bin/tpserve run --model tiny --tp 2 --backend cpu --ids 5,6,7,8 --json \
      > "$out/run_cpu.json" 2>/dev/null || rc=1
    python3 - "$out/run_cuda.json" "$out/run_cpu.json" <<'PY' || rc=1
import json, math, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
num = sum((a - b) ** 2 for a, b in zip(g["logits"], c["logits"]))
den = sum(b * b for b in c["logits"])
print("next token cuda %d cpu %d; logits rel_frobenius %.3g" % (
    g["next_token_id"], c["next_token_id"], math.sqrt(num / den)))
PY
    # The engine with o and down as one-chunk copy-engine rings (their last sum left to the
    # add & norm, CudaLinear::RunSplit) against mode none, one process per GPU, eager and
    # graph-replayed, awkward token counts included.
    echo "== tpserve-bench-model tiny: ring on copy engines, 1 chunk, vs none (--check-logits)"
    printf 'version: 1\ntp: 2\ndefaults:\n  mode: ring\n  chunks: 1\n  copy_engine: true\n' \
      > "$out/overlap-ring-ce-c1.yaml"
    tiny_vs_none ring-ce-c1 logits 4x100 3x37
    # The same with o and down reading the peer's running sum in place (LinearKnobs::in_place):
    # one rounding fewer than the split sum, so close to none's logits rather than equal.
    echo "== tpserve-bench-model tiny: ring on copy engines, o and down in_place, vs none"
    printf 'version: 1\ntp: 2\ndefaults:\n  mode: ring\n  chunks: 1\n  copy_engine: true\nlayers:\n  - {match: "*.attn.o", in_place: true}\n  - {match: "*.mlp.down", in_place: true}\n' \
      > "$out/overlap-ring-ce-c1-inplace.yaml"
    tiny_vs_none ring-ce-c1-inplace inplace 4x100 3x37 1x1
    # o and down without partial sums (LinearKnobs::full_weight: the engine gathers each
    # layer's whole weight once, at PrepareBucket), pipelined in 2 chunks: one GEMM over the
    # whole K instead of a sum of BF16 partials, so close to none's logits rather than equal.
    echo "== tpserve-bench-model tiny: o and down full_weight (pipeline, 2 chunks), vs none"
    printf 'version: 1\ntp: 2\ndefaults:\n  mode: ring\n  chunks: 1\n  copy_engine: true\nlayers:\n  - {match: "*.attn.o", mode: pipeline, chunks: 2, full_weight: true}\n  - {match: "*.mlp.down", mode: none, full_weight: true}\n' \
      > "$out/overlap-fullw.yaml"
    tiny_vs_none fullw fullw 4x100 3x37 1x1
    if python3 -c "import grpc" 2>/dev/null; then
      echo "== serve --backend cuda (gRPC, killed worker)"
      (cd tests && TPSERVE_BIN=../.gpu/bin/tpserve PROTO_DIR=.. timeout 150 \
        python3 -m unittest -v gpu_serve_test) > "$out/serve_cuda.log" 2>&1 || rc=1
      tail -5 "$out/serve_cuda.log"
    else
      echo "no python grpc on this host: serve test skipped"
    fi
    ;;
  reference)
    # tpserve vs an independent PyTorch model on one checkpoint (llama3-8b
    # shapes, random FP8 weights written by the script): top-1 agreement and
    # relative error over 1,000 positions.
    PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/torch_reference.py --model llama3-8b \
      --seqs 8 --len 125 --tpserve .gpu/bin/tpserve --commit "$commit" \
      --dir /tmp/ref-llama3-8b --out "$out/$(date -u +%F)-torch-reference-llama3-8b-$commit.json" \
      > "$out/reference.log" 2>&1 || rc=1
    grep -E "top-1|error|Error" "$out/reference.log" | tail -5
    ;;
  refsweep)
    # Where tpserve and the PyTorch model part: the same comparison on fewer
    # layers, on the tiny model (CUDA and the CPU reference engine), and on
    # all 32 layers with the scaled init, a few positions each.
    # REFSWEEP: cases separated by ';', each "model layers backend init seqs len".
    refsweep_case() {  # model layers backend init seqs len
      reference_case "$1-L$2-$3-$4" 300 'top-1 agreement|Error' 1 --model "$1" --layers "$2" \
        --backend "$3" --init "$4" --seqs "$5" --len "$6"
    }
    each_case "${REFSWEEP:-tiny 0 cuda plain 4 125;tiny 0 cpu plain 4 125;llama3-8b 1 cuda plain 2 50;llama3-8b 4 cuda plain 2 50;llama3-8b 32 cuda scaled 8 125}" refsweep_case
    ;;
  trained)
    # The reference with confident predictions: the LM head trained on a
    # synthetic Markov language from the random blocks' hidden states, the
    # prompts held-out text of that language (llama3-8b shapes, 32 layers,
    # 1,000 positions). TRAINED: cases separated by ';', each "dtype init" or
    # "dtype init ringce" (served with every layer in mode ring on copy engines,
    # 2 chunks, instead of mode none).
    cfg=$(ring_ce_config)
    trained_case() {  # dtype init [ringce]
      local overlap=()
      [ "${3:-}" = ringce ] && overlap=(--overlap-config "$cfg")
      reference_case "llama3-8b-L32-cuda-$2-$1-markov${3:+-$3}" 330 \
        'head training: held|top-1 agreement|Error' 4 --model llama3-8b --head markov \
        --dtype "$1" --init "$2" --seqs 8 --len 125 "${overlap[@]}"
    }
    each_case "${TRAINED:-fp8 scaled;bf16 scaled}" trained_case
    ;;
  selfcheck)
    # How far tpserve lands from itself: the same checkpoint and prompts served
    # with every layer in mode none and with every layer in mode ring on copy
    # engines (2 chunks), two valid executions that differ only in the order
    # of their additions, next to tpserve vs PyTorch from the same run.
    # SELFCHECK: cases separated by ';', each "model layers init seqs len".
    cfg=$(ring_ce_config)
    selfcheck_case() {  # model layers init seqs len
      reference_case "$1-L$2-cuda-$3-selfcheck" 400 'top-1 agreement|Error' 3 --model "$1" \
        --layers "$2" --init "$3" --seqs "$4" --len "$5" --compare-overlap "$cfg"
    }
    each_case "${SELFCHECK:-llama3-8b 32 scaled 8 125;llama3-8b 1 plain 2 50}" selfcheck_case
    ;;
  e2e)
    # The server's e2e suite (every RPC, bad inputs, 64 concurrent requests,
    # deadlines, SIGTERM drain) against the CUDA engine, one process per GPU.
    TPSERVE_E2E_BACKEND=cuda TPSERVE_BIN=.gpu/bin/tpserve timeout 300 \
      .gpu/bin/tpserve_e2e_tests --gtest_filter='ServerE2eTest.*' > "$out/e2e_cuda.log" 2>&1 || rc=1
    grep -E "^\[ +(OK|FAILED|PASSED) " "$out/e2e_cuda.log"
    ;;
  layers)
    # The layer checks alone: kernels and every copy-engine mode, one
    # process per GPU.
    timeout 60 .gpu/bin/tpserve_gpu_tests --gtest_filter='GpuTest.*:GpuOpsTest.*' \
      > "$out/gpu_kernel_tests.log" 2>&1 || rc=1
    grep -E "^\[  (PASSED|FAILED) " "$out/gpu_kernel_tests.log"
    timeout ${LAYER_CLI_TIMEOUT:-240} bash benchmarks/gpu_layer_cli.sh > /dev/null 2>&1 || rc=1
    grep -E "FAIL|error" "$out/layer_cli.log"; grep -c -- "-> PASS" "$out/layer_cli.log"
    ;;
  overlap)
    # The sweep, which also tunes the overlap config, then auto (resolving
    # that config) next to none, then PyTorch; Llama-3-70B's layers and the
    # seed's shape, each in its own file and both in one (COMBINED).
    COMMIT=$commit PRESETS="${PRESETS:-llama70b seed}" COMBINED=llama70b-seed-fp8-tp$tp DTYPES=fp8 CHUNKS="2 4" ROUNDS=${ROUNDS:-20} MAX_CTAS=0 TUNE=1 \
      METHODS="gemm_only comm_only none none_ce pipeline ring pipeline_ce ring_ce ring_inplace none_fullw pipeline_fullw ring_fullw layer_gemm auto" \
      SKIP_TESTS=1 SMOKE_TIMEOUT=45 BENCH_TIMEOUT=200 AUTO_TIMEOUT=90 PEER_TIMEOUT=200 \
      BENCH_ARGS="${BENCH_ARGS:---breakdown}" \
      bash benchmarks/run_overlap_bench.sh || rc=1
    ;;
  tunesplit)
    tuned="$out/$(date -u +%F)-overlap-llama70b-tp$tp-tuned-split-$commit.yaml"
    timeout ${TUNE_TIMEOUT:-300} .gpu/bin/tpserve-bench --tp $tp --shapes llama70b \
      --m 512 2048 8192 16384 --dtype fp8 --chunks 2 4 --rounds ${ROUNDS:-20} --commit "$commit" \
      --gemm-algo timed --max-ctas 0 --methods none none_ce pipeline ring pipeline_ce ring_ce \
      --split-output --tune-out "$tuned" \
      --out "$out/$(date -u +%F)-overlap-llama70b-tp$tp-split-$commit.json" \
      > "$out/tunesplit.log" 2>&1 || rc=1
    grep -E "error|wrote" "$out/tunesplit.log" | tail -5
    [ -s "$tuned" ] && cp "$tuned" /tmp/overlap-split.yaml && grep -E "op: gemm_rs" "$tuned"
    ;;
  modelcmp)
    # IDLE_MS: the GPUs idle that long before every pass (tpserve-bench-model --idle-ms);
    # EAGER=1: eager passes, no CUDA graphs (--eager); GRAPH_BLOCKS=N: one graph per N blocks;
    # CONNECTIONS=N: CUDA_DEVICE_MAX_CONNECTIONS for the benchmark's processes; NAME: the
    # files' name (default cmp).
    layers=${LAYERS:-0}; [ "$layers" = 0 ] && layers=80  # 0: all of llama3-70b's
    tag=L$layers-tp$tp-${NAME:-cmp}${IDLE_MS:+-idle$IDLE_MS}${EAGER:+-eager}${GRAPH_BLOCKS:+-gb$GRAPH_BLOCKS}${CONNECTIONS:+-conn$CONNECTIONS}-$commit
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw --format=csv,noheader \
      -lms 200 > "$out/gpu-clocks-$tag.csv" 2>/dev/null &
    smi=$!
    ${CONNECTIONS:+env CUDA_DEVICE_MAX_CONNECTIONS=$CONNECTIONS} \
    timeout ${MODEL_TIMEOUT:-300} .gpu/bin/tpserve-bench-model --tp $tp --model llama3-70b \
      --layers ${LAYERS:-0} --batches ${BATCHES:-8x1024} --rounds ${ROUNDS:-10} --commit "$commit" \
      --idle-ms ${IDLE_MS:-0} ${EAGER:+--eager} --graph-blocks ${GRAPH_BLOCKS:-0} \
      --overlap deploy/overlap-llama3-70b-tp$tp.yaml ${CONFIGS-/tmp/overlap-split.yaml} \
      --out "$out/$(date -u +%F)-model-llama3-70b-$tag.json" > "$out/modelcmp-$tag.log" 2>&1 || rc=1
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    grep -E "tokens/s|logits vs none|error" "$out/modelcmp-$tag.log"
    # Power over the whole run (idle gaps included), per GPU: mean and the busy samples' mean.
    awk -F', ' '{split($4, p, " "); n[$2]++; s[$2] += p[1]; if (p[1] > 300) {b[$2]++; t[$2] += p[1]}}
      END {for (g in n) printf "GPU %s: mean power %.0f W over %d samples, %.0f W over the %d above 300 W\n",
        g, s[g] / n[g], n[g], b[g] ? t[g] / b[g] : 0, b[g]}' "$out/gpu-clocks-$tag.csv"
    ;;
  model)
    COMMIT=$commit BENCH_TIMEOUT=250 PEER_TIMEOUT=250 bash benchmarks/run_model_bench.sh || rc=1
    ;;
  load)
    echo "== serve llama3-70b (cuda, device random weights) + loadtest"
    overlap=${OVERLAP:-deploy/overlap-llama3-70b-tp$tp.yaml}
    .gpu/bin/tpserve serve --model llama3-70b --tp $tp --backend cuda --device-random-weights \
      --overlap-config "$overlap" --grpc-port 8001 --metrics-port 0 \
      --max-batch-tokens 8192 --max-tokens-per-request 1024 > "$out/serve.out" 2> "$out/serve.log" &
    pid=$!
    for _ in $(seq 1 240); do grep -q "gRPC port" "$out/serve.out" 2>/dev/null && break; sleep 1; done
    # 10 s windows: at saturation the server completes one batch of 8 requests
    # every ~0.6 s, so a 5 s window counts throughput in steps of 12.5 % (10 s:
    # ~6 %); 3 of them, the fewest that tpserve-loadtest checks stability on
    # (earlier runs used 2 × 15 s windows, whose "stable" compared only 2).
    timeout 300 .gpu/bin/tpserve-loadtest -u 127.0.0.1:8001 -m llama3-70b \
      --concurrency-range 4:64:20 --prompt-len 1024 --duration 10 --warmup 3 --max-trials 3 \
      --json "$out/loadtest-llama3-70b.json" > "$out/loadtest.log" 2>&1 || rc=1
    tail -15 "$out/loadtest.log"
    # The run's provenance beside the client's own report.
    printf '{"commit": "%s", "date": "%s", "device": "'$tp'x %s", "server": "tpserve serve --model llama3-70b --tp '$tp' --backend cuda --device-random-weights --overlap-config %s --max-batch-tokens 8192 --max-tokens-per-request 1024"}\n' \
      "$commit" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
      "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" "$overlap" \
      > "$out/loadtest-meta.json"
    python3 benchmarks/render_loadtest.py "$out/loadtest-llama3-70b.json" \
      --png "$out/loadtest-llama3-70b.png" || rc=1
    kill -TERM $pid; wait $pid; echo "serve exit $?"
    # The engine alone on the batches the server formed (8 prompts of 1024
    # tokens fill --max-batch-tokens 8192), same model and overlap config.
    echo "== engine alone: tpserve-bench-model, all layers, 8x1024"
    timeout 200 .gpu/bin/tpserve-bench-model --tp $tp --model llama3-70b --layers 0 --batches 8x1024 --rounds 10 \
      --overlap "$overlap" --commit "$commit" --out "$out/engine-llama3-70b.json" \
      > "$out/engine.log" 2>&1 || rc=1
    grep -E "tokens/s|error" "$out/engine.log" | tail -4
    python3 - "$out/loadtest-llama3-70b.json" "$out/engine-llama3-70b.json" <<'PY' || rc=1
import json, sys
steps = json.load(open(sys.argv[1]))
steps = steps.get("steps", steps) if isinstance(steps, dict) else steps
engine = [r for r in json.load(open(sys.argv[2]))["records"] if r["method"] != "none"]
served = max(s["tokens_per_sec"] for s in steps)
own = max(r["tokens_per_sec"] for r in engine)
print("server at saturation %.0f tokens/s; engine alone %.0f tokens/s; ratio %.3f (goal >= 0.95)"
      % (served, own, served / own))
PY
    ;;
  stress)
    # Copy-engine graph replays in the production process model, many of them:
    # with ranks as threads, one replay in ~1,400 of ag_gemm pipeline hung
    # (NOTES.md), which is why CudaLinear refuses that setting. Each case ends
    # with 10 replays, the input alternating between two tensors, each checked
    # bit for bit against the eager run of its input.
    while read -r m args; do
      echo "== tpserve layer --backend cuda --tp $tp --m $m --n 1024 --k 1024 --iters ${ITERS:-3000} $args"
      timeout 120 .gpu/bin/tpserve layer --backend cuda --tp "$tp" --m "$m" --n 1024 --k 1024 \
        --iters ${ITERS:-3000} $args 2>&1 | grep -vE "\[info\] NCCL communicator" || rc=1
    done <<'CASES' | tee "$out/stress.log"
4099 --op ag_gemm --mode pipeline --chunks 4 --copy-engine
4099 --op ag_gemm --mode ring --chunks 2 --copy-engine
4099 --op gemm_rs --mode ring --chunks 4 --copy-engine
4099 --op gemm_rs --mode pipeline --chunks 4 --copy-engine
4099 --op gemm_rs --mode none --chunks 1 --copy-engine
CASES
    # The loop ran in a pipeline's subshell, where rc=1 does not reach this
    # shell: the verdict comes from the PASS lines.
    passes=$(grep -c -- "-> PASS" "$out/stress.log")
    echo "PASS lines: $passes of $((5 * tp))"
    [ "$passes" -eq $((5 * tp)) ] || rc=1
    ;;
  sustained)
    base=${OVERLAP:-deploy/overlap-llama3-70b-tp$tp.yaml}
    # Entries are one line each (flow style), so each variant is a line edit.
    sed 's/chunks: [0-9]*,/chunks: 1,/' "$base" > /tmp/overlap-c1.yaml
    grep -v "op: ag_gemm" "$base" > /tmp/overlap-rs-only.yaml
    grep -v "op: gemm_rs" "$base" > /tmp/overlap-ag-only.yaml
    grep -v "op: ag_gemm, n: 57344" "$base" > /tmp/overlap-no-gate-up.yaml
    cp /tmp/overlap-{c1,rs-only,ag-only,no-gate-up}.yaml "$out/"
    timeout 300 .gpu/bin/tpserve-bench-model --tp $tp --model llama3-70b --layers 0 \
      --batches 8x1024 --rounds ${ROUNDS:-10} --commit "$commit" \
      --overlap "$base" /tmp/overlap-{c1,rs-only,ag-only,no-gate-up}.yaml \
      --out "$out/$(date -u +%F)-model-llama3-70b-L80-tp$tp-sustained-variants-$commit.json" \
      > "$out/sustained.log" 2>&1 || rc=1
    grep -E "tokens/s|error" "$out/sustained.log"
    ;;
  graphlead)
    # Why the 80-layer overlapped graph replays slower than its eager pass (NOTES, eleventh
    # session): modelcmp (none and the deploy config, no other configs) as is, with 32
    # hardware queues, eagerly, and as one graph per 8 blocks; every round also timed on the
    # GPU (gpu_times_ms).
    for variant in "" "CONNECTIONS=32" "EAGER=1" "GRAPH_BLOCKS=8"; do
      echo "== modelcmp ${variant:-(as served)}"
      env CONFIGS= ${variant} bash "$0" modelcmp || rc=1
    done
    ;;
  graphprio)
    # CUDA graphs instantiated with per-node priorities (the comm streams' kernels keep their
    # high priority, as eagerly; tpserve's default) or CUDA's default (every kernel at the launch
    # stream's priority), alternating stream, node, stream, node: NCCL's pipelined modes are
    # the ones with kernels on the comm stream; ring_ce the control (memory operations and
    # copies only). Llama-3-70B's layers at m 2048 and 8192.
    for run in stream-1 node-1 stream-2 node-2; do
      prio=${run%-*}
      timeout ${PRIO_TIMEOUT:-150} .gpu/bin/tpserve-bench --tp $tp --shapes llama70b \
        --m ${MS:-2048 8192} --dtype fp8 --chunks 2 4 --rounds ${ROUNDS:-15} --commit "$commit" \
        --methods gemm_only none pipeline ring ring_ce --graph-priority $prio --run-label $run \
        --out "$out/$(date -u +%F)-overlap-llama70b-tp$tp-prio-$run-$commit.json" \
        > "$out/graphprio-$run.log" 2>&1 || rc=1
      grep -E "error" "$out/graphprio-$run.log" | tail -3
    done
    python3 - "$out"/*-prio-*-"$commit".json <<'PY'
import json, statistics, sys
t = {}
for path in sys.argv[1:]:
    prio = "node" if "-prio-node-" in path else "stream"
    for r in json.load(open(path))["records"]:
        key = (r["n"], r["k"], r["m"], r["method"] + ("_ce" if r["config"].get("copy_engine") else ""), r["chunks"])
        t.setdefault(key, {}).setdefault(prio, []).append(r["median_ms"])
print("n k m method chunks: stream ms / node ms (median of the runs), node/stream")
for key in sorted(t):
    s, n = (statistics.median(t[key].get(p, [float("nan")])) for p in ("stream", "node"))
    print(*key, "%.4f / %.4f  %.3f" % (s, n, n / s))
PY
    ;;
  inplace)
    # gemm_rs rings whose GEMMs read the running sums in the peer's memory (LinearKnobs::
    # in_place) against the copy-engine rings: the layer benchmark for o and down (as the
    # engine runs them, --split-output, then as layers for issue 4's floor), then the whole
    # model (modelcmp, 8x1024) with the deploy config's ring entries for o and down made
    # in_place by a line edit, interleaved with none and the deploy config.
    for run in split layer; do
      timeout ${INPLACE_TIMEOUT:-150} .gpu/bin/tpserve-bench --tp $tp --shapes llama70b \
        --m ${MS:-2048 8192 16384} --dtype fp8 --chunks 2 --rounds ${ROUNDS:-20} --commit "$commit" \
        --methods gemm_only comm_only ring_ce ring_inplace $([ $run = split ] && echo --split-output) \
        --run-label $run --out "$out/$(date -u +%F)-overlap-llama70b-tp$tp-inplace-$run-$commit.json" \
        > "$out/inplace-$run.log" 2>&1 || rc=1
      grep -E "error" "$out/inplace-$run.log" | tail -3
      python3 benchmarks/render_results.py --vs-gemm \
        "$out/$(date -u +%F)-overlap-llama70b-tp$tp-inplace-$run-$commit.json"
    done
    sed '/op: gemm_rs/s/mode: ring, \(.*\)copy_engine: true,/mode: ring, \1copy_engine: true, in_place: true,/' \
      deploy/overlap-llama3-70b-tp$tp.yaml > /tmp/inplace-rs.yaml
    grep -c "in_place: true" /tmp/inplace-rs.yaml
    cp /tmp/inplace-rs.yaml "$out/"
    env LAYERS=${LAYERS:-0} BATCHES="${BATCHES:-8x1024}" ROUNDS=${MODEL_ROUNDS:-10} NAME=inplace \
      CONFIGS=/tmp/inplace-rs.yaml bash "$0" modelcmp || rc=1
    ;;
  fullw)
    # gemm_rs without partial sums (LinearKnobs::full_weight: the whole weight on every rank,
    # the peers' input columns of the own rows pulled, one whole-K GEMM per chunk) against the
    # copy-engine rings, Llama-3-70B's layers (the ag_gemm ones get the baselines and ring_ce
    # only) at MS (default 512 2048 8192 16384); ratios to gemm_only printed per case.
    # FULLW_LAYERS=0 skips the layer benchmark (stage tpserve-bench-model alone for the model).
    if [ "${FULLW_LAYERS:-1}" = 1 ]; then
      timeout ${FULLW_TIMEOUT:-240} .gpu/bin/tpserve-bench --tp $tp --shapes llama70b \
        --m ${MS:-512 2048 8192 16384} --dtype fp8 --chunks 2 4 --rounds ${ROUNDS:-20} \
        --commit "$commit" --methods gemm_only comm_only ring_ce ring_inplace none_fullw \
        pipeline_fullw ring_fullw --out "$out/$(date -u +%F)-overlap-llama70b-tp$tp-fullw-$commit.json" \
        > "$out/fullw.log" 2>&1 || rc=1
      grep -E "error" "$out/fullw.log" | tail -3
      python3 benchmarks/render_results.py --vs-gemm \
        "$out/$(date -u +%F)-overlap-llama70b-tp$tp-fullw-$commit.json"
    fi
    [ "${FULLW_MODEL:-1}" = 1 ] || exit $rc
    # Then the whole model (modelcmp, 8x1024) with the deploy config's o entries (gemm_rs,
    # n = k = 8192) made full_weight by a line edit, one file per FULLW_VARIANTS entry
    # (mode:chunks, default pipeline:2 ring:2 ring:4), interleaved with none and the deploy config.
    configs=""
    for v in ${FULLW_VARIANTS:-pipeline:2 ring:2 ring:4}; do
      mode=${v%%:*} c=${v##*:}
      f=/tmp/fullw-o-$mode$c.yaml
      sed "/op: gemm_rs, n: 8192, k: 8192,/{s/mode: [a-z]*, chunks: [0-9]*,/mode: $mode, chunks: $c,/;s/copy_engine: true,/copy_engine: true, full_weight: true,/}" \
        deploy/overlap-llama3-70b-tp$tp.yaml > $f
      echo "o entries made full_weight, mode $mode, $c chunk(s): $(grep -c "full_weight: true" $f)"
      cp $f "$out/"
      configs="$configs $f"
    done
    env LAYERS=${LAYERS:-0} BATCHES="${BATCHES:-8x1024}" ROUNDS=${MODEL_ROUNDS:-10} NAME=fullw \
      CONFIGS="$configs" bash "$0" modelcmp || rc=1
    ;;
  lanes)
    # Each GEMM step that does not depend on the one before on a second stream: the layers
    # (LANES_MS, default 8192 16384; --split-output, as the engine runs o and down), then the
    # 80-layer model with the deploy config's ring entries given gemm_lanes: 2 (a line edit),
    # interleaved with none and the deploy config, then the same config with PyTorch.
    timeout ${LANES_TIMEOUT:-150} .gpu/bin/tpserve-bench --tp $tp --shapes llama70b \
      --m ${LANES_MS:-8192 16384} --dtype fp8 --chunks 2 --rounds ${ROUNDS:-20} --commit "$commit" \
      --methods gemm_only comm_only ring_ce --gemm-lanes 1 2 --split-output --run-label lanes \
      --out "$out/$(date -u +%F)-overlap-llama70b-tp$tp-lanes-$commit.json" \
      > "$out/lanes-layers.log" 2>&1 || rc=1
    grep -E "error" "$out/lanes-layers.log" | tail -3
    python3 benchmarks/render_results.py --vs-gemm \
      "$out/$(date -u +%F)-overlap-llama70b-tp$tp-lanes-$commit.json"
    sed '/mode: ring/s/copy_engine: true,/copy_engine: true, gemm_lanes: 2,/' \
      deploy/overlap-llama3-70b-tp$tp.yaml > /tmp/lanes.yaml
    grep -c "gemm_lanes: 2" /tmp/lanes.yaml
    cp /tmp/lanes.yaml "$out/"
    env LAYERS=${LAYERS:-0} BATCHES="${BATCHES:-8x1024}" ROUNDS=${MODEL_ROUNDS:-10} NAME=lanes \
      CONFIGS=/tmp/lanes.yaml bash "$0" modelcmp || rc=1
    if [ -z "${NO_PEER:-}" ]; then
      OVERLAP=/tmp/lanes.yaml COMMIT=$commit BENCH_TIMEOUT=250 PEER_TIMEOUT=250 \
        bash benchmarks/run_model_bench.sh || rc=1
    fi
    ;;
  gateup)
    # gate_up alone varied in the whole model (modelcmp: 8x1024; the deploy config otherwise),
    # all interleaved round by round: does its overlap pay under the power limit? The
    # variants are line edits of the deploy file's gate_up entries (n: 57344).
    base=deploy/overlap-llama3-70b-tp$tp.yaml
    grep -v "op: ag_gemm, n: 57344" "$base" > /tmp/gate-up-none-nccl.yaml
    sed '/op: ag_gemm, n: 57344/s/mode: ring, chunks: 1,/mode: none, chunks: 1,/' "$base" \
      > /tmp/gate-up-none-ce.yaml
    sed '/op: ag_gemm, n: 57344/s/mode: ring, chunks: 1,/mode: ring, chunks: 2,/' "$base" \
      > /tmp/gate-up-ring-ce-c2.yaml
    cp /tmp/gate-up-{none-nccl,none-ce,ring-ce-c2}.yaml "$out/"
    env LAYERS=0 BATCHES=8x1024 ROUNDS=${ROUNDS:-20} NAME=gate-up \
      CONFIGS="$(echo /tmp/gate-up-{none-nccl,none-ce,ring-ce-c2}.yaml)" bash "$0" modelcmp || rc=1
    ;;
  stages)
    timeout 200 .gpu/bin/tpserve-bench-model --tp $tp --model llama3-70b --layers 0 \
      --batches ${BATCHES:-8x1024} --rounds ${ROUNDS:-5} --stages --commit "$commit" \
      --overlap "${OVERLAP:-deploy/overlap-llama3-70b-tp$tp.yaml}" \
      --out "$out/$(date -u +%F)-model-llama3-70b-L80-tp$tp-stages-$commit.json" \
      > "$out/stages.log" 2>&1 || rc=1
    grep -E "tokens/s|stages|error" "$out/stages.log"
    ;;
  ab)
    # The same benchmark from two builds, alternating, so that the GPUs'
    # state drifts over both alike.
    base_commit=${BASE_COMMIT:?BASE_COMMIT names the base build}
    i=0
    for run in static:base static:new static:base static:new dynamic:base dynamic:new; do
      i=$((i + 1)); scales=${run%%:*} which=${run##*:}
      bin=.gpu/bin/tpserve-bench-model; c=$commit
      [ "$which" = base ] && { bin=.gpu/bin/tpserve-bench-model-base; c=$base_commit; }
      flag=""; [ "$scales" = dynamic ] && flag=--dynamic-input-scales
      echo "== $which ($c) $scales"
      timeout 120 $bin --tp $tp --model llama3-70b --layers 0 --batches 8x1024 --rounds ${ROUNDS:-10} \
        --overlap deploy/overlap-llama3-70b-tp$tp.yaml --commit "$c" $flag \
        --out "$out/$(date -u +%F)-model-llama3-70b-L80-tp$tp-ab-$i-$scales-$which-$c.json" \
        > "$out/ab-$i-$scales-$which.log" 2>&1 || rc=1
      grep -E "tokens/s|error" "$out/ab-$i-$scales-$which.log" | tail -2
    done
    ;;
  profile)
    kernels=${KERNELS:-CausalAttention|SwiGlu|RmsNorm|Rope}
    ncu_run=(ncu --clock-control none --set full --import-source no)
    bench=(.gpu/bin/tpserve-bench-model --tp 1 --model llama3-70b --layers 2 --batches 8x1024
      --rounds 1 --warmup 0 --gemm-algo heuristic --out /tmp/profile-model.json)
    timeout 400 "${ncu_run[@]}" -k "regex:$kernels" -c ${COUNT:-6} --page details \
      --print-details all "${bench[@]}" > "$out/profile.log" 2>&1 || rc=1
    timeout 120 "${ncu_run[@]}" -k "regex:${SASS_KERNEL:-CausalAttention}" -c 1 --page source \
      --print-source sass "${bench[@]}" > "$out/profile-sass.log" 2>&1 || rc=1
    grep -E "^  [A-Za-z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per" \
      "$out/profile.log" | head -60
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
exit $rc
