#!/usr/bin/env bash
# On the GPU host, after staging tpserve-bench-model: the CUDA model's prefill
# throughput with mode none and the tuned overlap config, and the PyTorch
# model on the same shapes, in one call; merged into one results file.
#   COMMIT=<sha> bash benchmarks/run_model_bench.sh
# Knobs: MODEL (llama3-70b), LAYERS (0), BATCHES ("8x1024 16x1024"), ROUNDS (10),
# TP (2), OVERLAP (deploy/overlap-llama3-70b-tp$TP.yaml), BENCH_TIMEOUT / PEER_TIMEOUT (s),
# PEER: eager (torch_model.py, any TP) or compiled (torch_model_compiled.py: torch.compile,
# CUDA graphs, fastest SDPA; FAST_ACCUM on|off|both, ATTENTION=1 adds SDPA alone per backend at
# TP 1; at TP > 1 inductor's micro-pipeline async TP with symmetric memory, ASYNC_TP=off for
# plain NCCL collectives, and COMPILE_MODE (default there: default, since the fused async-TP
# ops are not autotuned anyway)).
# CHECK_LOGITS=<bound> fails the run when an overlap setting's logits differ from none's by
# more than the bound or pick another top-1 token; RESIDUAL_GAIN scales the random o and down
# weights so that such a check can tell a wrong schedule from rounding (tpserve-bench-model
# --residual-gain: at 1, 80 random blocks are chaotic). FP8_ATTENTION=1 runs tpserve's prefill
# attention in E4M3 (tpserve-bench-model --fp8-attention; recorded in the meta).
# The compiled peer autotunes each GEMM shape once (llama3-70b's four take about 42 s each on
# an H200): give it PEER_TIMEOUT of 300 s or more there.
# The file of record at TP 1 (results/model-llama3-8b-tp1.json):
#   MODEL=llama3-8b TP=1 BATCHES="8x1024 1x8192 64x128" OVERLAP=deploy/overlap-tp1-fast-accum.yaml \
#   PEER=compiled ATTENTION=1 COMMIT=<sha> bash benchmarks/run_model_bench.sh
# LAYERS=0 (the default): all of the model's layers (llama3-70b: 80; FP8 weights ≈ 35 GB per
# GPU at TP=2, so all of them fit). Fewer layers measure a short burst: the GPUs spend part of
# each round below their power limit and clock higher, which favours overlap
# (benchmarks/PERFORMANCE.md).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
source .gpu/env.sh
commit=${COMMIT:-unknown}
model=${MODEL:-llama3-70b}
layers=${LAYERS:-0}
batches=${BATCHES:-8x1024 16x1024}
rounds=${ROUNDS:-10}
tp=${TP:-2}
overlap=${OVERLAP:-deploy/overlap-llama3-70b-tp$tp.yaml}
date=$(date -u +%Y-%m-%d)
rc=0
ours=".gpu/bin/tpserve-bench-model --tp $tp --model $model --layers $layers --batches $batches --rounds $rounds --overlap $overlap --commit $commit"
[ -z "${CHECK_LOGITS:-}" ] || ours="$ours --check-logits $CHECK_LOGITS"
[ -z "${RESIDUAL_GAIN:-}" ] || ours="$ours --residual-gain $RESIDUAL_GAIN"
[ "${FP8_ATTENTION:-0}" != 1 ] || ours="$ours --fp8-attention"
case ${PEER:-eager} in
  eager) peer="python3 benchmarks/torch_model.py --tp $tp --model $model --layers $layers --batches $batches --rounds $rounds" ;;
  # torch is run without env.sh's LD_LIBRARY_PATH: the host's system cuDNN would shadow its own.
  compiled) peer="env -u LD_LIBRARY_PATH python3 benchmarks/torch_model_compiled.py --model $model --layers $layers --batches $batches --rounds $rounds --fast-accum ${FAST_ACCUM:-both}${ATTENTION:+ --attention-only}"
            [ "$tp" = 1 ] || peer="$peer --tp $tp --async-tp ${ASYNC_TP:-on} --compile-mode ${COMPILE_MODE:-default}" ;;
  *) echo "PEER: eager or compiled, not '$PEER'" >&2; exit 2 ;;
esac
# Never merge an earlier run's file under this commit.
rm -f /tmp/model-ours.json /tmp/model-peer.json
# The GPUs' SM clock, power and temperature every 200 ms while both benchmarks
# run (read only), with each benchmark's start and end marked, so that a
# difference between runs of different lengths can be put down to clocks or not.
clocks="$out/gpu-clocks.csv"
: > "$clocks"
# Appending (O_APPEND) on both sides keeps the marks: a plain '>' lets nvidia-smi
# write over them from its own file offset.
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu \
  --format=csv,noheader -lms 200 >> "$clocks" 2>/dev/null &
smi=$!
mark() { echo "# $(date '+%Y/%m/%d %H:%M:%S.%3N') $1" >> "$clocks"; }
mark "start ours"
echo "== $ours"
timeout ${BENCH_TIMEOUT:-300} $ours --out /tmp/model-ours.json 2>&1 | tee "$out/model-bench.log" | grep -E "tokens/s|error|logits vs none" || rc=1
mark "end ours"
echo "== $peer"
mark "start peer"
PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-300} $peer --out /tmp/model-peer.json 2>&1 | tee -a "$out/model-bench.log" | grep -E "tokens/s|fatal|Error" || rc=1
mark "end peer"
kill $smi 2>/dev/null; wait $smi 2>/dev/null
python3 - "$clocks" <<'PY' || true
import sys
phase, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("# "):
        parts = line.split()
        phase = parts[-1] if parts[-2] == "start" else None
        continue
    f = [x.strip() for x in line.split(",")]
    if phase is None or len(f) < 5:
        continue
    try:
        clock, power = float(f[2].split()[0]), float(f[3].split()[0])
    except ValueError:
        continue
    rows.setdefault((phase, f[1]), []).append((clock, power))
for (ph, gpu), v in sorted(rows.items()):
    busy = [c for c in v if c[1] > 300]  # samples under load
    if busy:
        cl = sorted(c for c, _ in busy)
        print("clocks %-4s GPU %s: %d samples over 300 W, SM clock median %.0f MHz (min %.0f), "
              "power mean %.0f W" % (ph, gpu, len(busy), cl[len(cl) // 2], cl[0],
                                     sum(p for _, p in busy) / len(busy)))
PY
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
python3 - "$out/$date-model-$model-tp$tp.json" "$commit" "$ours ; $peer" "$date" "$device" <<'PY' || rc=1
import json, os, sys
path, commit, command, date, device = sys.argv[1:6]
inputs = [p for p in ("/tmp/model-ours.json", "/tmp/model-peer.json") if os.path.exists(p)]
missing = [p for p in ("/tmp/model-ours.json", "/tmp/model-peer.json") if p not in inputs]
if not inputs:
    sys.exit("merge: neither benchmark wrote its file")
docs = [json.load(open(p)) for p in inputs]
meta = dict(docs[0]["meta"], commit=commit, command=command, date=date,
            device="%sx %s" % (docs[0]["meta"].get("tp", "?"), device))
meta["torch"] = next((d["meta"].get("torch") for d in docs if d["meta"].get("torch")), None)
records = [r for d in docs for r in d["records"]]
doc = {"meta": meta, "records": records}
attention = [a for d in docs for a in d.get("attention", [])]
if attention:
    doc["attention"] = attention  # the compiled peer's SDPA alone, per backend
if missing:
    doc["missing_inputs"] = missing  # a benchmark died: not a complete comparison
json.dump(doc, open(path, "w"), indent=1)
print("wrote %s (%d records)" % (path, len(records)))
by = {}
for r in records:
    by.setdefault((r["seqs"], r["seq_len"]), {})[r.get("overlap_config") or r["method"]] = \
        r["tokens_per_sec"]
rounds = {(r["seqs"], r["seq_len"]): {} for r in records}
for r in records:
    if r.get("impl") == "tpserve" and r.get("times_ms"):
        rounds[(r["seqs"], r["seq_len"])][r.get("overlap_config") or r["method"]] = r["times_ms"]
peers = ("torch_eager", "torch_compiled", "torch_compiled_fast_accum", "torch_compiled_async_tp",
         "torch_compiled_async_tp_fast_accum", "torch_compiled_tp", "torch_compiled_tp_fast_accum")
for (seqs, length), v in sorted(by.items()):
    none = v.get("none")
    tuned = max((x for k, x in v.items() if k != "none" and k not in peers), default=None)
    def ratio(a, b):
        return "%.3f" % (a / b) if a and b else "n/a"
    line = "%dx%d: none %s, tuned %s tokens/s; tuned/none %s" % (
        seqs, length, none and round(none), tuned and round(tuned), ratio(tuned, none))
    for p in peers:
        if p in v:
            line += "; %s %d, tuned/it %s, none/it %s" % (p, round(v[p]), ratio(tuned, v[p]),
                                                          ratio(none, v[p]))
    print(line)
    # none and each overlap config ran interleaved round by round: the ratio of each round's
    # pair, so that drift over the run (clocks, temperature) falls on both sides alike.
    t = rounds.get((seqs, length), {})
    for name, times in sorted(t.items()):
        if name == "none" or "none" not in t or len(times) != len(t["none"]):
            continue
        pairs = sorted(a / b for a, b in zip(t["none"], times))
        q = lambda p: pairs[min(len(pairs) - 1, int(p * (len(pairs) - 1) + 0.5))]
        print("%dx%d: speed-up of %s over none per round (none's time / its time, %d "
              "pairs): median %.3f, quartiles %.3f-%.3f, range %.3f-%.3f"
              % (seqs, length, name, len(pairs), q(0.5), q(0.25), q(0.75), pairs[0], pairs[-1]))
sys.exit(1 if missing else 0)
PY
exit $rc
