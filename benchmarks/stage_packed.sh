#!/usr/bin/env bash
# Stages binaries for the GPU host packed: ../shared/tools/stage-for-gpu-host into a temporary
# folder, then one gzipped tarball in DIR (default .gpu) with DIR/unpack.sh beside it. The
# binaries and libraries shrink to about a third, so that they and the working tree (which
# travels too: benchmarks/results/ alone is over 30 MiB) stay under the device tool's 64 MiB.
# usage: benchmarks/stage_packed.sh [--dir DIR] FILE...
# On the host: source DIR/unpack.sh   (unpacks next to itself, then sources DIR/env.sh)
set -euo pipefail
dir=.gpu
if [ "${1:-}" = --dir ]; then dir=${2:?--dir needs a folder}; shift 2; fi
[ $# -ge 1 ] || { echo "usage: $0 [--dir DIR] FILE..." >&2; exit 2; }
stager=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/tools/stage-for-gpu-host
[ -x "$stager" ] || { echo "error: $stager not found (../shared beside the checkout)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$stager" "$tmp" "$@" > /dev/null
rm -rf "$dir"
mkdir -p "$dir"
tar -C "$tmp" -czf "$dir/stage.tgz" .
cat > "$dir/unpack.sh" <<'UNPACK'
# source this on the GPU host: unpacks stage.tgz beside it, then sources its env.sh
_packed=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tar -xzf "$_packed/stage.tgz" -C "$_packed" && source "$_packed/env.sh"
UNPACK
echo "packed $(du -sh "$dir/stage.tgz" | cut -f1) in $dir/stage.tgz (unpacked: $(du -sh "$tmp" | cut -f1))"
