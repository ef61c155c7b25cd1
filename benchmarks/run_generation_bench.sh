#!/usr/bin/env bash
# Generation serving throughput: `tpserve serve` (CUDA backend, TP=1 unless TP says otherwise, a
# preset with random FP8 weights made on the device) driven by `tpserve-loadtest --mode generate` (closed loop,
# random prompts, ignore EOS), one loadtest JSON per case.
#
#   run_generation_bench.sh OUTDIR ISL:OSL:CONCURRENCY[:unary] [...]
#
# A case ending in :unary sends each request as one ModelInfer (the whole generation in one
# response, --no-streaming) instead of streaming it, to measure what streaming costs. A third
# field pRATE instead of a concurrency (e.g. 128:128:p120) is an open loop: Poisson arrivals at
# RATE requests/s, streaming.
#
# Environment: BIN_DIR (default .gpu/bin: tpserve, tpserve-loadtest), MODEL (llama3-8b),
# KV_GIB (40: KV cache per GPU), KV_DTYPE (bf16, or fp8: E4M3 KV cache; its JSON names end in
# -kvfp8), STEP_TOKENS (8192), RUNNING (256), CASE_TIMEOUT_S (240), TP (1: one process per GPU
# beyond; JSON names end in -tpN), OVERLAP (an overlap config for TP > 1, e.g.
# deploy/overlap-llama3-70b-tp2.yaml; none: every layer in mode none), WARMUP_S (3), DURATION_S
# (10: seconds per window), MAX_TRIALS (3: windows per case; long generations need long windows,
# since a closed loop's clients start together and finish in waves).
# Each step is bounded in time; the server is stopped with SIGTERM at the end (or on error).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
out=$1
shift
mkdir -p "$out"
bin=${BIN_DIR:-.gpu/bin}
model=${MODEL:-llama3-8b}
step_tokens=${STEP_TOKENS:-8192}
running=${RUNNING:-256}
case_timeout=${CASE_TIMEOUT_S:-240}
kv_dtype=${KV_DTYPE:-bf16}
kv_suffix=""
[ "$kv_dtype" = bf16 ] || kv_suffix="-kv$kv_dtype"
tp=${TP:-1}
[ "$tp" = 1 ] || kv_suffix="$kv_suffix-tp$tp"
overlap=()
# OVERLAP=none: no config, so every layer runs in mode none.
[ -z "${OVERLAP:-}" ] || [ "$OVERLAP" = none ] || overlap=(--overlap-config "$OVERLAP")

"$bin/tpserve" serve --backend cuda --tp "$tp" ${overlap[@]+"${overlap[@]}"} --model "$model" --device-random-weights \
  --kv-cache-gib "${KV_GIB:-40}" --kv-cache-dtype "$kv_dtype" --max-batch-tokens "$step_tokens" --max-step-tokens "$step_tokens" \
  --max-batch-sequences "$running" --max-running-sequences "$running" --max-output-len 4096 \
  --host 127.0.0.1 --grpc-port 0 --metrics-port 0 >"$out/serve.stdout" 2>"$out/serve.log" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT

port=""
for _ in $(seq 1 600); do  # the model loads and captures its graphs: up to 5 minutes
  port=$(sed -n "s/.*on gRPC port \([0-9]*\).*/\1/p" "$out/serve.stdout" | head -1)
  [ -n "$port" ] && break
  kill -0 $server 2>/dev/null || { echo "the server exited:" >&2; tail -20 "$out/serve.log" >&2; exit 1; }
  sleep 0.5
done
[ -n "$port" ] || { echo "the server did not start within 5 minutes" >&2; exit 1; }
echo "== server on port $port"

for c in "$@"; do
  IFS=: read -r isl osl conc kind <<<"$c"
  mode=(--streaming)
  suffix=""
  if [ "${kind:-}" = unary ]; then mode=(--no-streaming); suffix="-unary"; fi
  load=(--concurrency-range "$conc:$conc:1")
  if [ "${conc#p}" != "$conc" ]; then
    load=(--request-rate-range "${conc#p}:${conc#p}:1" --distribution poisson)
  fi
  echo "== ISL $isl OSL $osl concurrency $conc ${kind:-streaming}, $kv_dtype KV cache"
  timeout "$case_timeout" "$bin/tpserve-loadtest" --url "127.0.0.1:$port" --model-name "$model" \
    --mode generate --prompt-len "$isl" --output-len "$osl" --ignore-eos --vocab 128256 "${mode[@]}" \
    "${load[@]}" --warmup "${WARMUP_S:-3}" --duration "${DURATION_S:-10}" --max-trials "${MAX_TRIALS:-3}" --timeout-ms 600000 \
    --json "$out/generation-$model-isl$isl-osl$osl-c$conc$suffix$kv_suffix.json" || echo "case $c failed ($?)"
done
kill -TERM $server
wait $server || true
trap - EXIT
