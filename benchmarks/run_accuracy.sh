#!/usr/bin/env bash
# FP8 accuracy against BF16 on a Llama-3.1-style checkpoint written by transformers (the GPU
# host has torch and transformers; the measuring runs on the CPU, or on the GPU with BACKEND=cuda): writes the checkpoint
# (benchmarks/make_accuracy_checkpoint.py: hidden 512, 8 layers, 8 heads / 2 KV heads, head_dim
# 64, intermediate 1408, vocab 1024, llama3 RoPE, BF16, seeded) into a temporary directory, then
# runs tpserve-accuracy on it twice: the checkpoint as is, and with outlier channels of
# 2^OUTLIER_EXPONENT that leave its BF16 logits unchanged (--outlier-exponent).
#
#   run_accuracy.sh OUTDIR [BIN_DIR]
#
# From the repository root, after `source .gpu/env.sh`. BIN_DIR holds tpserve-accuracy (default:
# $TPSERVE_BIN_DIR, else .gpu/bin as staged). Writes into OUTDIR: accuracy-llama31-medium.{json,md}
# and accuracy-llama31-medium-outliers.{json,md}, checkpoint.log (the writer's output) and the
# tool's progress in accuracy*.log. Environment: PYTHON (python3), COMMIT (recorded in the
# JSON; default: git rev-parse HEAD, else unknown), NUM_PROMPTS (8), PROMPT_LEN (128),
# OUTLIER_EXPONENT (14), CKPT_TIMEOUT_S (900), TOOL_TIMEOUT_S (1800), BACKEND (cpu; cuda: the
# CUDA engine computes every model's logits, tpserve-accuracy --backend cuda), HEAD_DIM (64; 128
# for the E4M3 attention), FP8_ATTENTION (0; 1 with BACKEND=cuda and HEAD_DIM=128: the FP8
# schemes' passes run attention in E4M3, tpserve-accuracy --fp8-attention), KV_SCALES (one;
# calibrate with FP8_ATTENTION=1: K's and V's scales from their largest values over random
# calibration prompts, tpserve-accuracy --kv-scales calibrate).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
out=$1
bin=${2:-${TPSERVE_BIN_DIR:-.gpu/bin}}
python=${PYTHON:-python3}
commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
num_prompts=${NUM_PROMPTS:-8}
prompt_len=${PROMPT_LEN:-128}
exponent=${OUTLIER_EXPONENT:-14}
backend=${BACKEND:-cpu}
head_dim=${HEAD_DIM:-64}
attention=()
[ "${FP8_ATTENTION:-0}" != 1 ] || attention=(--fp8-attention --kv-scales "${KV_SCALES:-one}")
ckpt_timeout=${CKPT_TIMEOUT_S:-900}
tool_timeout=${TOOL_TIMEOUT_S:-1800}
[ -x "$bin/tpserve-accuracy" ] || { echo "no tpserve-accuracy in $bin (set TPSERVE_BIN_DIR or pass BIN_DIR)" >&2; exit 1; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ckpt="$work/llama31-medium"

echo "== writing the checkpoint with transformers into $ckpt"
timeout "$ckpt_timeout" "$python" benchmarks/make_accuracy_checkpoint.py --out "$ckpt" --head-dim "$head_dim" \
  >"$out/checkpoint.log" 2>&1 || { echo "the checkpoint writer failed ($?):" >&2; tail -20 "$out/checkpoint.log" >&2; exit 1; }
tail -2 "$out/checkpoint.log"

run() {  # NAME EXPONENT
  echo "== tpserve-accuracy: $1 (outlier exponent $2)"
  timeout "$tool_timeout" "$bin/tpserve-accuracy" --model "$ckpt" --num-prompts "$num_prompts" \
    --prompt-len "$prompt_len" --outlier-exponent "$2" --commit "$commit" --backend "$backend" \
    "${attention[@]}" \
    --out-json "$out/$1.json" --out-md "$out/$1.md" 2>"$out/$1.log"
}
run accuracy-llama31-medium 0
run accuracy-llama31-medium-outliers "$exponent"
