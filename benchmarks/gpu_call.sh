#!/usr/bin/env bash
# Several gpu_session.sh parts in one device call, within the call's 10
# minutes: each part's logs go to $OUT/<part>/ and are packed into
# $OUT/<part>.tgz as soon as the part ends (the device tool returns only a
# few files), so that a later part running out of time loses nothing before.
#   COMMIT=<sha> bash benchmarks/gpu_call.sh overlap serve model
# Parts: those of gpu_session.sh, plus "serve" (the gRPC serve test alone).
# BUDGET_S (default 560) bounds the whole call; each part gets what is left.
# An overlap part's tuned config becomes OVERLAP for the parts after it.
set -uo pipefail
root=${OUT:-gpu-out}; mkdir -p "$root"
budget=${BUDGET_S:-560}
for part in "$@"; do
  left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $part: skipped, ${left}s left"; continue; fi
  mkdir -p "$root/$part"
  echo "== $part (${left}s left)"
  if [ "$part" = serve ]; then
    ( source .gpu/env.sh
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      cd tests && TPSERVE_BIN=../.gpu/bin/tpserve PROTO_DIR=.. timeout "$left" \
        python3 -m unittest -v gpu_serve_test ) > "$root/$part/console.txt" 2>&1
  else
    OUT="$root/$part" timeout "$left" bash benchmarks/gpu_session.sh "$part" \
      > "$root/$part/console.txt" 2>&1
  fi
  echo "exit $?"
  tail -${TAIL_LINES:-25} "$root/$part/console.txt"
  # The config the overlap part tuned is what later parts (model) use.
  tuned=$(ls "$root/$part"/*-overlap-llama70b-tp${TP:-2}-tuned.yaml 2>/dev/null | head -1)
  if [ -n "$tuned" ]; then cp "$tuned" /tmp/overlap-tuned.yaml; export OVERLAP=/tmp/overlap-tuned.yaml; fi
  cp /tmp/ours-*.json /tmp/peer-*.json /tmp/model-*.json "$root/$part/" 2>/dev/null
  rm -f /tmp/ours-*.json /tmp/peer-*.json /tmp/model-*.json
  (cd "$root" && tar czf "$part.tgz" "$part" && rm -rf "$part")
done
