#!/usr/bin/env bash
# On the GPU host, after staging tpserve-bench-attention: tpserve's prefill attention kernels
# and PyTorch SDPA's backends (cuDNN, flash, memory-efficient) on the same shapes in one call,
# merged into one results file (benchmarks/results/attention-llama3-8b-tp1.json).
#   COMMIT=<sha> bash benchmarks/run_attention_bench.sh
# Knobs: SHAPES ("1x8192 8x1024 64x128 1x16384"), ROUNDS (20), OUT_FILE, TIMEOUT (s, per step).
# Heads are llama3-8b's (32 query, 8 KV, head_dim 128). The peer runs without .gpu/env.sh's
# LD_LIBRARY_PATH (the host's system cuDNN would shadow torch's).
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
shapes=${SHAPES:-1x8192 8x1024 64x128 1x16384}
rounds=${ROUNDS:-20}
file=${OUT_FILE:-$out/attention-llama3-8b-tp1.json}
limit=${TIMEOUT:-240}
# shellcheck disable=SC2086  # SHAPES is a list
timeout "$limit" .gpu/bin/tpserve-bench-attention --shapes $shapes --rounds "$rounds" \
  --out "$out/attention-bf16.json" || exit 1
# shellcheck disable=SC2086
timeout "$limit" .gpu/bin/tpserve-bench-attention --fp8-out --shapes $shapes \
  --rounds "$rounds" --out "$out/attention-fp8out.json" || exit 1
# shellcheck disable=SC2086
timeout "$limit" env -u LD_LIBRARY_PATH python3 benchmarks/torch_model_compiled.py \
  --attention-only --skip-model --batches $shapes --out "$out/attention-sdpa.json" || exit 1
python3 - "$out" "$file" "${COMMIT:-unknown}" <<'PY'
import json, sys
out, file, commit = sys.argv[1:4]
bf16 = json.load(open(out + "/attention-bf16.json"))
fp8 = json.load(open(out + "/attention-fp8out.json"))
sdpa = json.load(open(out + "/attention-sdpa.json"))
meta = dict(bf16["meta"], commit=commit, torch=sdpa["meta"].get("torch"))
doc = {"meta": meta, "tpserve": bf16["records"] + fp8["records"], "sdpa": sdpa["attention"]}
with open(file, "w") as f:
    json.dump(doc, f, indent=1)
for r in doc["tpserve"]:
    print("tpserve %-8s %-4s %dx%d %.3f ms %.0f TFLOP/s" % (
        r["kernel"], r["output"], r["seqs"], r["seq_len"], r["median_ms"], r["tflops"]))
for r in doc["sdpa"]:
    print("sdpa    %-8s      %dx%d %.3f ms %.0f TFLOP/s" % (
        r["backend"], r["seqs"], r["seq_len"], r["median_ms"], r["tflops"]))
PY
