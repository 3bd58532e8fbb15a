#!/usr/bin/env bash
# A/B benchmark of the host copy engine (BENCHMARKS.md, "Host copy A/B"): builds libmori_tp from
# this working tree and from each given revision (default dae7bbe, the first release), loads them
# side by side in benches/host_ab/host_ab.c, and times them against a per-row memcpy loop.
#
#   benches/host_ab/run.sh [REV...] [-- HOST_AB_OPTIONS]
#   benches/host_ab/run.sh dae7bbe 6c75015 -- --rounds 3 --case strided_src_256
#
# Everything it writes lives under target/host_ab: each revision is exported with `git archive`
# into target/host_ab/src-<commit> and built there once (its own Cargo.lock, --locked).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out="$root/target/host_ab"
mkdir -p "$out"

revs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do revs+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#revs[@]} -gt 0 ] || revs=(dae7bbe)

libs=()
for rev in "${revs[@]}"; do
  commit=$(git -C "$root" rev-parse --verify "$rev^{commit}")
  short=${commit:0:7}
  lib="$out/libmori_tp-$short.so"
  if [ ! -f "$lib" ]; then
    src="$out/src-$short"
    rm -rf "$src" && mkdir -p "$src"
    git -C "$root" archive "$commit" | tar -x -C "$src"
    echo "building $rev ($short) in $src" >&2
    CARGO_TARGET_DIR="$src/target" \
      cargo build --quiet --release --locked -p mori-tp --lib --manifest-path "$src/Cargo.toml"
    cp "$src/target/release/libmori_tp.so" "$lib.tmp" && mv "$lib.tmp" "$lib"
  fi
  libs+=("$rev=$lib")
done

# This tree, copied so that a later build cannot change the file while it is loaded.
echo "building this tree" >&2
cargo build --quiet --release -p mori-tp --lib --manifest-path "$root/Cargo.toml"
target_dir=${CARGO_TARGET_DIR:-$root/target}
cp "$target_dir/release/libmori_tp.so" "$out/libmori_tp-tree.so"
libs+=("tree=$out/libmori_tp-tree.so")

cc -O2 -Wall -Wextra -std=c11 -o "$out/host_ab" "$root/benches/host_ab/host_ab.c" -ldl
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores" >&2
"$out/host_ab" "$@" "${libs[@]}"
