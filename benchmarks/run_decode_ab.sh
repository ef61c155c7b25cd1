#!/usr/bin/env bash
# A/B of decode between builds in one device call, on the GPU host: each build's
# tpserve-bench-decode (llama3-8b, one GPU) and tpserve-bench-attention --decode, round by
# round, the builds' order reversed every other round so that drift over the call falls on
# all of them; then one table per case (benchmarks/ab_table.py: every round's host-timed step,
# the median, the ratio to the first build).
#
#   source .gpu/env.sh
#   benchmarks/run_decode_ab.sh before=.gpu/ab/before after=.gpu/bin norope=.gpu/bin@rope
#
# LABEL=DIR[@NAMES]: a build's directory holding tpserve-bench-decode and (unless ATTENTION=0)
# tpserve-bench-attention (staged with ../shared/tools/stage-for-gpu-host; its libraries come
# from .gpu/env.sh); NAMES (comma-separated) are decode fusions that build runs without:
# tpserve-bench-decode --unfused NAMES. tpserve-bench-attention merges the splits as the
# engine does, by the combine pass (--no-cluster-merge, where the build has the flag; older
# builds merged in a cluster by default). At least two. Environment knobs: ROUNDS (3),
# DTYPE (fp8), KV_DTYPES ("bf16 fp8"), BATCHES ("1 8 64 256"), CONTEXT (1024), STEPS (30),
# DECODE_ARGS (more tpserve-bench-decode flags for every build, e.g. "--temperature 0.8
# --top-p 0.95"), ATTENTION (1: also time the attention kernel alone, BF16 and --fp8-out), OUT
# (gpu-out/decode-ab), STEP_TIMEOUT (seconds a benchmark run may take, 300). A run that fails
# or times out is named and the script goes on; it exits 1 if any did (2 on usage errors).
set -uo pipefail

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
[ $# -ge 2 ] || usage
labels=() dirs=() unfused=()
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage ;;
    *=*@*) labels+=("${arg%%=*}") rest=${arg#*=} dirs+=("${rest%%@*}") unfused+=("${rest#*@}") ;;
    *=*) labels+=("${arg%%=*}") dirs+=("${arg#*=}") unfused+=("") ;;
    *) echo "run_decode_ab.sh: expected LABEL=DIR[@NAMES], got '$arg'" >&2; exit 2 ;;
  esac
done
tools=(tpserve-bench-decode)
[ "${ATTENTION:-1}" = 1 ] && tools+=(tpserve-bench-attention)
for i in "${!dirs[@]}"; do
  for tool in "${tools[@]}"; do
    if [ ! -x "${dirs[$i]}/$tool" ]; then
      echo "run_decode_ab.sh: ${labels[$i]}: ${dirs[$i]}/$tool is missing or not executable" >&2
      exit 2
    fi
  done
done

ROUNDS=${ROUNDS:-3}
DTYPE=${DTYPE:-fp8}
KV_DTYPES=${KV_DTYPES:-"bf16 fp8"}
BATCHES=${BATCHES:-"1 8 64 256"}
CONTEXT=${CONTEXT:-1024}
STEPS=${STEPS:-30}
DECODE_ARGS=${DECODE_ARGS:-}
ATTENTION=${ATTENTION:-1}
OUT=${OUT:-gpu-out/decode-ab}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT"
failed=0

run() {  # NAME CMD...: runs CMD under the step timeout, its output in $OUT/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  if ! timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1; then
    echo "!! $name failed or timed out (log: $OUT/$name.log)" >&2
    tail -5 "$OUT/$name.log" >&2
    failed=1
  fi
  grep -E "batch +[0-9]+ at context|^decode " "$OUT/$name.log" || true
}

for ((r = 1; r <= ROUNDS; r++)); do
  order=("${!labels[@]}")
  if ((r % 2 == 0)); then  # reversed every other round
    order=()
    for ((i = ${#labels[@]} - 1; i >= 0; i--)); do order+=("$i"); done
  fi
  for kv in $KV_DTYPES; do
    for i in "${order[@]}"; do
      extra=()
      [ -n "${unfused[$i]}" ] && extra=(--unfused "${unfused[$i]}")
      # shellcheck disable=SC2086
      run "${labels[$i]}-$DTYPE-kv$kv-r$r" "${dirs[$i]}/tpserve-bench-decode" --model llama3-8b \
        --dtype "$DTYPE" --kv-dtype "$kv" --batches $BATCHES --context "$CONTEXT" \
        --steps "$STEPS" --commit "${labels[$i]}" "${extra[@]}" $DECODE_ARGS \
        --out "$OUT/${labels[$i]}-$DTYPE-kv$kv-r$r.json"
    done
  done
  if [ "$ATTENTION" = 1 ]; then
    for i in "${order[@]}"; do
      for output in bf16 fp8; do
        flag=()
        [ "$output" = fp8 ] && flag=(--fp8-out)
        if "${dirs[$i]}/tpserve-bench-attention" --help 2>/dev/null | grep -q -- --no-cluster-merge; then
          flag+=(--no-cluster-merge)
        fi
        # shellcheck disable=SC2086
        run "${labels[$i]}-attention-$output-r$r" "${dirs[$i]}/tpserve-bench-attention" --decode \
          --batches $BATCHES --context "$CONTEXT" --kv-dtypes $KV_DTYPES "${flag[@]}" \
          --out "$OUT/${labels[$i]}-attention-$output-r$r.json"
      done
    done
  fi
done

table() {  # CASE FILE-SUFFIX: one table over every label's rounds
  local args=()
  for i in "${!labels[@]}"; do
    for ((r = 1; r <= ROUNDS; r++)); do args+=(--run "${labels[$i]}=$OUT/${labels[$i]}-$2-r$r.json"); done
  done
  echo
  echo "### $1"
  python3 "$HERE/ab_table.py" "${args[@]}" --json "$OUT/ab-$2.json" || failed=1
}
for kv in $KV_DTYPES; do table "decode step, $DTYPE weights, $kv KV cache, ms" "$DTYPE-kv$kv"; done
if [ "$ATTENTION" = 1 ]; then
  table "decode attention alone, BF16 out, ms" attention-bf16
  table "decode attention alone, E4M3 out, ms" attention-fp8
fi
exit "$failed"
