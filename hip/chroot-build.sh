#!/usr/bin/env bash
# Builds libmori_tp with the HIP backend (and so the copy kernel) and the hip/ programs with
# Debian forky's HIP toolchain (hipcc 7.0.2, HIP 6.4.3, clang 21) in a chroot, and checks that
# the kernel's code-object bundle, the library and the programs hold code objects for gfx942
# (MI300) and gfx950 (MI350). Debian 12's own hipcc 5.2 builds gfx90a (MI200) only. It also
# builds the library once more with a compressed bundle (--offload-compress), whose targets
# build.rs must list.
#
# The chroot is made once with mmdebstrap and reused (a stamp names its suite and packages);
# the build runs in it under `unshare --mount`, with /proc, the checkout and the host's Rust
# toolchain and cargo home bind-mounted at their own paths (cargo runs --offline: the crates
# come from the host's cargo home, fetched first).
#
# Needs root (mmdebstrap --mode=root, mount, chroot), mmdebstrap, unshare, a Debian mirror and
# the Rust toolchain that `rustc` names. About 900 MB and a minute or two the first time.
#
# Environment:
#   MORI_TP_HIP_CHROOT     where the chroot lives (default /var/tmp/mori-tp/forky-hip)
#   MORI_TP_DEBIAN_MIRROR  the Debian mirror (default: this machine's, from /etc/apt/sources.list*)
#   MORI_TP_CHROOT_ARCHS   targets that must be present (default "gfx942 gfx950")
# Outputs land in target/hip-chroot/ of the checkout.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/target/hip-chroot
REQUIRED=${MORI_TP_CHROOT_ARCHS:-gfx942 gfx950}

# Inside the chroot: build, then check the code objects.
if [ "${1:-}" = --inside ]; then
  cd "$ROOT"
  echo "hip-chroot: $(hipcc --version 2>/dev/null | grep -m1 'HIP version'), $(hipcc --version 2>/dev/null | grep -m1 'clang version')"
  cargo build --release --lib --features hip --offline --target-dir "$OUT/cargo"
  make -C hip HIPCC=hipcc HOST_CXX=clang++ MORI_TP_LIB="$OUT/cargo/release/libmori_tp.a" BUILD="$OUT/programs" | tee "$OUT/make.log"
  # A compressed bundle (hipcc --offload-compress, which clang 21 knows): build.rs must read its
  # targets with clang-offload-bundler instead of refusing it.
  MORI_TP_HIPCC_FLAGS=--offload-compress cargo build --release --lib --features hip --offline \
    --target-dir "$OUT/cargo-compressed" 2>&1 | tee "$OUT/compressed.log" | tail -n 3

  bundler=$(ls /usr/bin/clang-offload-bundler* | head -n 1)
  kernel=$(ls -t "$OUT"/cargo/release/build/mori-tp-*/out/copy_kernel.hsaco | head -n 1)
  kernel_targets=$("$bundler" --list --type=o --input="$kernel")
  echo "hip-chroot: the copy kernel's bundle ($kernel) holds:" $kernel_targets
  status=0
  for arch in $REQUIRED; do
    id="hipv4-amdgcn-amd-amdhsa--$arch"
    grep -Eq "^$id(:|\$)" <<<"$kernel_targets" || { echo "hip-chroot: the copy kernel lacks $arch"; status=1; }
    grep -Fqa "$id" "$OUT/cargo/release/libmori_tp.a" || { echo "hip-chroot: libmori_tp.a does not embed $arch"; status=1; }
    grep -Eq "^built for: .*\\b$arch\\b" "$OUT/make.log" || { echo "hip-chroot: make did not build for $arch"; status=1; }
  done
  compressed=$(ls -t "$OUT"/cargo-compressed/release/build/mori-tp-*/out/copy_kernel.hsaco | head -n 1)
  if [ "$(head -c 4 "$compressed")" != CCOB ]; then
    echo "hip-chroot: --offload-compress did not give a compressed bundle"; status=1
  elif grep -q "embedded unchecked" "$OUT/compressed.log"; then
    echo "hip-chroot: build.rs could not list the compressed bundle's targets"; status=1
  else
    echo "hip-chroot: the compressed bundle ($compressed) was built and checked:" $("$bundler" --list --type=o --input="$compressed")
  fi
  # No GPU here: each program must refuse cleanly (77); with one it must pass (0).
  for program in device_test "bench --quick"; do
    rc=0
    $OUT/programs/$program || rc=$?
    case $rc in 0 | 77) ;; *) echo "hip-chroot: $program exited $rc"; status=1 ;; esac
  done
  if [ $status -eq 0 ]; then
    echo "hip-chroot: passed: code objects for $REQUIRED in the copy kernel and libmori_tp.a; the hip/ programs built for them"
  fi
  exit $status
fi

if [ "$(id -u)" != 0 ]; then
  echo "hip/chroot-build.sh: needs root (mmdebstrap --mode=root, mount, chroot)" >&2
  exit 1
fi

# This machine's Debian mirror: the first non-security URI of its apt sources.
mirror() {
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
    sed -nE 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' |
    grep -v security | head -n 1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

CHROOT=${MORI_TP_HIP_CHROOT:-/var/tmp/mori-tp/forky-hip}
SUITE=forky
PACKAGES=hipcc,libamdhip64-dev,make,gcc,libc6-dev,binutils
STAMP="$SUITE $PACKAGES"
if [ "$(cat "$CHROOT/.mori-tp-chroot" 2>/dev/null || true)" != "$STAMP" ]; then
  MIRROR=${MORI_TP_DEBIAN_MIRROR:-$(mirror)}
  echo "hip-chroot: creating $CHROOT ($SUITE with $PACKAGES) from $MIRROR"
  rm -rf "$CHROOT" "$CHROOT.partial"
  mkdir -p "$(dirname "$CHROOT")"
  # forky's Release files may carry a Valid-Until before this machine's clock.
  mmdebstrap --quiet --mode=root --variant=minbase --aptopt='Acquire::Check-Valid-Until "false"' \
    --include="$PACKAGES" "$SUITE" "$CHROOT.partial" "$MIRROR"
  echo "$STAMP" >"$CHROOT.partial/.mori-tp-chroot"
  mv "$CHROOT.partial" "$CHROOT"
else
  echo "hip-chroot: reusing $CHROOT"
fi

SYSROOT=$(rustc --print sysroot)
CARGO_DIR=${CARGO_HOME:-$HOME/.cargo}
mkdir -p "$OUT"
cargo fetch --quiet --manifest-path "$ROOT/Cargo.toml"

export ROOT SYSROOT CARGO_DIR CHROOT
unshare --mount -- bash -euo pipefail -c '
  for dir in "$ROOT" "$SYSROOT" "$CARGO_DIR"; do
    mkdir -p "$CHROOT$dir"
    mount --bind "$dir" "$CHROOT$dir"
  done
  mount --bind /proc "$CHROOT/proc"
  exec chroot "$CHROOT" /usr/bin/env -i PATH="$SYSROOT/bin:/usr/bin:/bin:$(ls -d "$CHROOT"/usr/lib/llvm-*/bin | head -n 1 | sed "s|^$CHROOT||")" HOME=/root \
    CARGO_HOME="$CARGO_DIR" bash "$ROOT/hip/chroot-build.sh" --inside
'
