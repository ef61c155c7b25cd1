#!/usr/bin/env bash
# On the GPU host, after staging tpserve-bench-attention: tpserve's prefill attention kernels
# and PyTorch SDPA's backends (cuDNN, flash, memory-efficient) on the same shapes in one call,
# merged into one results file (benchmarks/results/attention-llama3-8b-tp1.json).
#   COMMIT=<sha> bash benchmarks/run_attention_bench.sh
# Knobs: SHAPES ("1x8192 8x1024 64x128 1x16384 128x64 2x4096"), ROUNDS (20), OUT_FILE,
# TIMEOUT (s, per step).
# A third run adds the E4M3 kernel's rows (--fp8: the attention alone, and the stage as the
# model runs it: RoPE + BF16 kernel against the pass that rotates and quantizes + E4M3 kernel);
# if that run fails (its output too far from the BF16 kernel's), the
# file records it under meta.fp8_failed and keeps the other rows.
# Heads are llama3-8b's (32 query, 8 KV, head_dim 128). The peer runs without .gpu/env.sh's
# LD_LIBRARY_PATH (the host's system cuDNN would shadow torch's).
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
shapes=${SHAPES:-1x8192 8x1024 64x128 1x16384 128x64 2x4096}
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
fp8_failed=0
timeout "$limit" .gpu/bin/tpserve-bench-attention --fp8 --shapes $shapes --rounds "$rounds" \
  --out "$out/attention-e4m3.json" || fp8_failed=1
# shellcheck disable=SC2086
timeout "$limit" env -u LD_LIBRARY_PATH python3 benchmarks/torch_model_compiled.py \
  --attention-only --skip-model --batches $shapes --out "$out/attention-sdpa.json" || exit 1
python3 - "$out" "$file" "${COMMIT:-unknown}" "$fp8_failed" <<'PY'
import json, sys
out, file, commit, fp8_failed = sys.argv[1:5]
bf16 = json.load(open(out + "/attention-bf16.json"))
fp8 = json.load(open(out + "/attention-fp8out.json"))
sdpa = json.load(open(out + "/attention-sdpa.json"))
e4m3 = []
if fp8_failed == "0":
    e4m3 = [r for r in json.load(open(out + "/attention-e4m3.json"))["records"]
            if r["kernel"] in ("wgmma_fp8", "rope+wgmma", "fp8_inputs+attn")]
meta = dict(bf16["meta"], commit=commit, torch=sdpa["meta"].get("torch"),
            fp8_failed=fp8_failed != "0")
doc = {"meta": meta, "tpserve": bf16["records"] + fp8["records"] + e4m3,
       "sdpa": sdpa["attention"]}
with open(file, "w") as f:
    json.dump(doc, f, indent=1)
for r in doc["tpserve"]:
    print("tpserve %-15s %-4s %dx%d %.3f ms %.0f TFLOP/s" % (
        r["kernel"], r["output"], r["seqs"], r["seq_len"], r["median_ms"], r["tflops"]))
for r in e4m3:
    if r["kernel"] == "wgmma_fp8":
        print("E4M3 against the BF16 Hopper kernel, %dx%d: rel. Frobenius difference %.2e" %
              (r["seqs"], r["seq_len"], r["rel_diff_fp8_vs_wgmma"]))
for r in doc["sdpa"]:
    print("sdpa    %-8s      %dx%d %.3f ms %.0f TFLOP/s" % (
        r["backend"], r["seqs"], r["seq_len"], r["median_ms"], r["tflops"]))
PY
