#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (-fsanitize=fuzzer,address,undefined)
# and runs each for SECONDS (default 30) on a copy of its seed corpus
# (tests/fuzz/corpus/<target>/; the repository is not modified).
#
#   bash tests/fuzz/build_and_run.sh [SECONDS]
#
# Environment: FUZZ_BUILD_DIR (default build-fuzz/ at the repository root),
# FUZZ_CXX (default clang++), JOBS (parallel compiles, default nproc).
# Exits non-zero if a target does not build or a fuzzer finds a crash, a leak,
# a timeout or an invariant violation; the reproducer's path is printed.
#
# Not part of the CMake build (which uses g++). Debian's protobuf, yaml-cpp and
# nlohmann_json are not built with sanitizers; only tpserve's code is
# instrumented, which is what is being fuzzed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

seconds=${1:-30}
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${FUZZ_CXX:-clang++}
jobs=${JOBS:-$(nproc)}
targets=(infer_request safetensors overlap_config)

# Sources the targets need (the archive pulls in only what each one uses).
tpserve_sources=(
  comm/status.cc comm/dtype.cc comm/nccl_config.cc
  layers/overlap_config.cc layers/overlap_plan.cc layers/overlap_plan_check.cc
  layers/linear_knobs.cc layers/scale_scheme.cc
  engine/safetensors.cc
  server/request_validation.cc
)

t0=$(date +%s)
rm -rf "$build/obj" "$build/gen" "$build/bin"
mkdir -p "$build/obj" "$build/gen" "$build/bin"

echo "== [fuzz] protoc --cpp_out proto/grpc_service.proto"
protoc --proto_path="$root" --cpp_out="$build/gen" proto/grpc_service.proto

san="-fsanitize=address,undefined -fno-sanitize-recover=all"
common="-std=c++20 -O1 -g -fno-omit-frame-pointer -I$root -isystem $build/gen"
# Our code: coverage-instrumented for libFuzzer plus ASan/UBSan.
ours="$common $san -fsanitize=fuzzer-no-link -Wall -Wextra"
# Generated protobuf code: sanitized, not coverage-instrumented, not our warnings.
gen="$common $san -w"

compile() {  # compile FLAGS SRC OBJ
  echo "   $2"
  # shellcheck disable=SC2086
  $cxx $1 -c "$2" -o "$3"
}
export -f compile
export cxx

{
  for s in "${tpserve_sources[@]}"; do
    printf '%s\0%s\0%s\0' "$ours" "$s" "$build/obj/$(echo "$s" | tr / _).o"
  done
  printf '%s\0%s\0%s\0' "$gen" "$build/gen/proto/grpc_service.pb.cc" "$build/obj/grpc_service.pb.o"
  for t in "${targets[@]}"; do
    printf '%s\0%s\0%s\0' "$ours" "tests/fuzz/fuzz_$t.cc" "$build/obj/fuzz_$t.o"
  done
} | xargs -0 -n 3 -P "$jobs" bash -c 'compile "$0" "$1" "$2"'

# A fresh archive each time (ar rcs appends to an existing one).
rm -f "$build/libtpserve_fuzz.a"
ar rcs "$build/libtpserve_fuzz.a" $(ls "$build"/obj/*.o | grep -v '/fuzz_')

for t in "${targets[@]}"; do
  echo "== [fuzz] link fuzz_$t"
  # shellcheck disable=SC2086
  $cxx -fsanitize=fuzzer $san -o "$build/bin/fuzz_$t" "$build/obj/fuzz_$t.o" \
    "$build/libtpserve_fuzz.a" -lprotobuf -lyaml-cpp -lpthread
done
echo "== [fuzz] built in $(($(date +%s) - t0)) s"

failed=()
for t in "${targets[@]}"; do
  work="$build/run/$t"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp -r "tests/fuzz/corpus/$t/." "$work/corpus/"
  echo "== [fuzz] fuzz_$t for ${seconds}s (corpus: $(ls "$work/corpus" | wc -l) seeds, copy in $work/corpus)"
  t1=$(date +%s)
  rc=0
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/bin/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$work/artifacts/" \
    "$work/corpus" >"$work/log" 2>&1 || rc=$?
  grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added)' "$work/log" || true
  echo "   exit $rc after $(($(date +%s) - t1)) s (log: $work/log)"
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    tail -n 60 "$work/log"
    for a in "$work"/artifacts/*; do
      [ -e "$a" ] || continue
      echo "!! [fuzz] fuzz_$t reproducer: $a"
      echo "!!   reproduce: $build/bin/fuzz_$t $a"
    done
  fi
done

echo "== [fuzz] total $(($(date +%s) - t0)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "!! [fuzz] findings in: ${failed[*]}"
  exit 1
fi
echo "== [fuzz] OK: no findings"
