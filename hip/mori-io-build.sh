#!/usr/bin/env bash
# Single quotes hold what the chroot's or mmdebstrap's shell expands (SC2016); the compiler flags
# and file lists are word lists (SC2046, SC2086).
# shellcheck disable=SC2016,SC2046,SC2086
# Builds AMD's MORI-IO (the IO library of ROCm/mori and its pybind11 module, the IO part alone)
# from a checkout of ROCm/mori at commit 1e3ce4e1 (branch feature/tcp-backend, whose TCP
# backend moves host memory over sockets with no GPU and no RDMA device), in a Debian
# sid+experimental chroot with Debian's HIP 7 (MORI-IO needs libamdhip64 7; forky's is 6.4),
# and runs commands against it in that chroot.
#
#   hip/mori-io-build.sh              build (or reuse) the chroot and MORI-IO; prints the output
#   hip/mori-io-build.sh --run CMD..  runs CMD in the chroot, in the checkout, with the build's
#                                     Python package on PYTHONPATH and MORI_TP_MORI_IO set
#
# Pinned: the chroot's HIP packages come from experimental (an apt pin, below) and must be the
# HIP_VERSION below; the MORI sources must hash to MORI_DIGEST (their src/, include/,
# 3rdparty/spdlog/include and the Python files used), and a git checkout must be at 1e3ce4e1.
# Cached: the chroot is made once (a stamp names its suites, packages and pins); the build's
# outputs live outside the checkout in $MORI_TP_MORI_CACHE/<key>/ (default
# /var/cache/mori-tp/mori-io), keyed by the sources' digest and this script's hash, so that a
# rerun with both unchanged reuses them, from any clone on the machine. target/mori-io/current
# links the checkout to the build it uses.
#
# The outputs (glibc and libstdc++ of sid) run inside the chroot only: the tests that use them
# (tests/python.rs, tests/mori_io.rs) run there through --run. libmori_tp itself is built on the
# host; its shared library runs in the chroot as it is.
#
# Needs root (mmdebstrap --mode=root, mount, chroot), mmdebstrap, unshare and a Debian mirror
# that carries sid and experimental. About 1.4 GB and a minute for the chroot the first time;
# the build takes a few minutes on 2 cores.
#
# Environment:
#   MORI_TP_MORI_SRC        the ROCm/mori checkout; its 3rdparty/spdlog submodule must be present
#                           (default: shared/third_party/mori-tcp-backend in the folder that
#                           holds this checkout, where CI puts it)
#   MORI_TP_MORI_CHROOT     where the chroot lives (default /var/tmp/mori-tp/sid-hip7)
#   MORI_TP_MORI_CACHE      where the builds live (default /var/cache/mori-tp/mori-io)
#   MORI_TP_DEBIAN_MIRROR   the Debian mirror (default: this machine's, from /etc/apt/sources*)
#   MORI_TP_JOBS            parallel compiles (default: the number of cores)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
SCRIPT=$ROOT/hip/mori-io-build.sh
SRC=${MORI_TP_MORI_SRC:-$(dirname "$ROOT")/shared/third_party/mori-tcp-backend}
[ -d "$SRC" ] && SRC=$(cd "$SRC" && pwd -P)
export SRC
CHROOT=${MORI_TP_MORI_CHROOT:-/var/tmp/mori-tp/sid-hip7}
CACHE=${MORI_TP_MORI_CACHE:-/var/cache/mori-tp/mori-io}
MORI_COMMIT=1e3ce4e1
MORI_DIGEST=b0503e69489f7dbe
# Debian experimental's HIP: the version the build was made with and is tested against.
HIP_VERSION=7.2.4
HIP_PACKAGES="libamdhip64-7 libamdhip64-dev libhsa-runtime64-1 libhsa-runtime-dev libamd-comgr3 libamd-comgr-dev libhiprtc7 libhiprtc-builtins7 libhiprtc-dev"
PACKAGES=g++,make,libc6-dev,binutils,libamdhip64-dev,libhsa-runtime-dev,librocm-smi-dev,libibverbs-dev,libmsgpack-cxx-dev,libpci-dev,libnuma-dev,pybind11-dev,python3-dev,python3-numpy
# The sources MORI-IO's IO library is made of: the IO engine with its backends (RDMA, TCP,
# XGMI, FABRIC: engine.cpp refers to all of them) and the application parts they use.
IO_SOURCES="engine.cpp rdma/protocol.cpp rdma/backend_impl.cpp rdma/async_event_monitor.cpp
  rdma/executor.cpp rdma/common.cpp rdma/ledger.cpp tcp/backend_impl.cpp tcp/protocol.cpp
  tcp/transport.cpp xgmi/backend_impl.cpp xgmi/hip_resource_pool.cpp fabric/backend_impl.cpp
  fabric/vpod_topology.cpp fabric/torch_allocator.cpp"
APP_SOURCES="bootstrap/socket_bootstrap.cpp bootstrap/local_bootstrap.cpp transport/rdma/rdma.cpp
  transport/rdma/providers/dv_loader.cpp transport/rdma/providers/mlx5/mlx5.cpp
  transport/rdma/providers/mlx5/mlx5_abi_parity.cpp transport/rdma/providers/bnxt/bnxt.cpp
  transport/rdma/providers/ionic/ionic.cpp transport/rdma/providers/ibverbs/ibverbs.cpp
  transport/rdma/providers/ibverbs/ibv_shim.cpp transport/tcp/tcp.cpp memory/va_manager.cpp
  memory/memory_region.cpp topology/gpu.cpp topology/net.cpp topology/node.cpp
  topology/pci.cpp topology/system.cpp"
PY_FILES="python/mori/__init__.py python/mori/cpp/__init__.py python/mori/io/engine.py"

die() {
  echo "mori-io-build: $*" >&2
  exit 1
}

# The digest of what the build reads from the MORI checkout.
sources_digest() {
  (cd "$SRC" && find src include 3rdparty/spdlog/include -type f -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum && sha256sum $PY_FILES) | sha256sum | cut -c1-16
}

# --- inside the chroot: compile, link, lay out the Python package, check it imports ---------
if [ "${1:-}" = --inside-build ]; then
  OUT=$2
  cd "$SRC"
  # -w: MORI's own build does not build with -Werror either; its warnings are not ours to fix.
  CXXFLAGS="-std=c++17 -O2 -g0 -fPIC -w -D__HIP_PLATFORM_AMD__=1 -DMSGPACK_NO_BOOST
    -DSPDLOG_HEADER_ONLY -I$SRC/include -I$SRC -I$SRC/3rdparty/spdlog/include"
  list=()
  for f in $IO_SOURCES; do list+=("src/io/$f"); done
  for f in $APP_SOURCES; do list+=("src/application/$f"); done
  mkdir -p "$OUT/obj"
  export CXXFLAGS OUT
  printf '%s\n' "${list[@]}" | xargs -P "${MORI_TP_JOBS:-$(nproc)}" -I{} bash -c '
    o=$OUT/obj/$(echo {} | tr / _).o
    [ -f "$o" ] && exit 0
    g++ $CXXFLAGS -c {} -o "$o.tmp" 2>"$o.log" || { echo "mori-io-build: g++ failed on {}:"; head -c 4000 "$o.log"; exit 255; }
    mv "$o.tmp" "$o"'
  mkdir -p "$OUT/python/mori/cpp" "$OUT/python/mori/io"
  g++ -shared -o "$OUT/python/mori/libmori_io.so" "$OUT"/obj/*.o -Wl,--no-undefined \
    -Wl,-soname,libmori_io.so -lamdhip64 -lhsa-runtime64 -libverbs -lnuma -lpci -ldl -lpthread
  # The pybind11 module of the IO part alone: MORI's pybind_io.cpp, registered by a module
  # of our own (MORI's mori.cpp registers every part: ops, shmem, ccl, which need a GPU build).
  cat >"$OUT/pybind_io_module.cpp" <<'EOF'
// The IO part of MORI's Python module alone (mori-tp's hip/mori-io-build.sh).
#include "src/pybind/mori.hpp"
PYBIND11_MODULE(libmori_pybinds, m) { mori::RegisterMoriIo(m); }
EOF
  g++ $CXXFLAGS -shared $(python3-config --includes) src/pybind/pybind_io.cpp \
    "$OUT/pybind_io_module.cpp" -o "$OUT/python/mori/libmori_pybinds.so" \
    -L"$OUT/python/mori" -lmori_io -Wl,-rpath,'$ORIGIN' -lamdhip64
  # MORI's own Python files, unchanged, except mori/io/__init__.py: MORI's imports its torch
  # allocator (torch, which mori-tp does not need); ours imports engine.py (IOEngine) and the
  # pybind11 names that MORI's exports.
  cp python/mori/__init__.py "$OUT/python/mori/__init__.py"
  cp python/mori/cpp/__init__.py "$OUT/python/mori/cpp/__init__.py"
  cp python/mori/io/engine.py "$OUT/python/mori/io/engine.py"
  cat >"$OUT/python/mori/io/__init__.py" <<'EOF'
"""MORI-IO's Python API as mori-tp's hip/mori-io-build.sh lays it out: MORI's own engine.py
(``IOEngine``, ``IOEngineSession``) and the pybind11 names that MORI's ``mori.io`` exports,
without its torch allocator. engine.py imports torch only for ``register_torch_tensor`` (and an
annotation): where torch is not installed it loads with an empty module in torch's place,
removed again once loaded, so ``register_torch_tensor`` fails and nothing else sees it."""
import sys
import types

try:
    import torch  # noqa: F401
    _placeholder = None
except ImportError:
    _placeholder = types.ModuleType("torch")
    _placeholder.Tensor = object
    sys.modules["torch"] = _placeholder
try:
    from .engine import *  # noqa: F401,F403
finally:
    if _placeholder is not None and sys.modules.get("torch") is _placeholder:
        del sys.modules["torch"]
from mori.cpp import (  # noqa: F401,E402
    IOEngineConfig, StatusCode, BackendType, EngineDesc, MemoryDesc, MemoryLocationType,
    PollCqMode, RdmaBackendConfig, TcpBackendConfig, XgmiBackendConfig, FabricBackendConfig,
    TransferStatus, set_log_level,
)
EOF
  (cd / && PYTHONPATH="$OUT/python" python3 -c '
import mori.io as mio
e = mio.IOEngine("mori-io-build-check", mio.IOEngineConfig("127.0.0.1", 0))
e.create_backend(mio.BackendType.TCP, mio.TcpBackendConfig())
print("mori-io-build: mori.io loads and makes a TCP engine:", e.get_engine_desc().key)')
  exit 0
fi

# --- inside the chroot: run a command -------------------------------------------------------
if [ "${1:-}" = --inside-run ]; then
  shift
  cd "$ROOT"
  exec "$@"
fi

if [ "$(id -u)" != 0 ]; then
  die "needs root (mmdebstrap --mode=root, mount, chroot)"
fi

# This machine's Debian mirror: the first non-security URI of its apt sources.
mirror() {
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
    sed -nE 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' |
    grep -v security | head -n 1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# Runs "$@" in the chroot with /proc, /dev, the checkout, the MORI checkout and the cargo
# target folder (when outside the checkout) bind-mounted at their own paths.
in_chroot() {
  local target=${CARGO_TARGET_DIR:-$ROOT/target}
  MOUNTS="$ROOT"
  [ -d "$SRC" ] && MOUNTS="$MOUNTS $SRC"
  [ -d "$CACHE" ] && MOUNTS="$MOUNTS $(cd "$CACHE" && pwd -P)"
  if [ -d "$target" ]; then
    target=$(cd "$target" && pwd -P)
    case $target/ in "$ROOT"/*) ;; *) MOUNTS="$MOUNTS $target" ;; esac
  fi
  export CHROOT MOUNTS
  unshare --mount -- bash -euo pipefail -c '
    for dir in $MOUNTS; do
      [ -d "$dir" ] || continue
      mkdir -p "$CHROOT$dir"
      mount --bind "$dir" "$CHROOT$dir"
    done
    mount --bind /proc "$CHROOT/proc"
    mount --bind /dev "$CHROOT/dev"
    exec chroot "$CHROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
      MORI_TP_MORI_SRC="$SRC" ${EXTRA_ENV:-} "$@"' bash "$@"
}

if [ "${1:-}" = --run ]; then
  shift
  [ $# -gt 0 ] || die "--run needs a command"
  current=$ROOT/target/mori-io/current
  [ -f "$current/ok" ] || die "no MORI-IO build in $current: run hip/mori-io-build.sh first"
  out=$(cd "$current" && pwd -P)
  [ -d "$CHROOT/usr" ] || die "no chroot at $CHROOT: run hip/mori-io-build.sh first"
  # The variables the tests use, passed through env -i.
  EXTRA_ENV="PYTHONPATH=$ROOT/python:$out/python MORI_TP_MORI_IO=$out PYTHONDONTWRITEBYTECODE=1"
  for name in MORI_TP_LIBRARY MORI_TP_REQUIRE_TOOLS RUST_LOG; do
    [ -n "${!name:-}" ] && EXTRA_ENV="$EXTRA_ENV $name=${!name}"
  done
  export EXTRA_ENV
  in_chroot bash "$SCRIPT" --inside-run "$@"
  exit $?
fi

# --- the build ------------------------------------------------------------------------------
[ -f "$SRC/src/io/engine.cpp" ] ||
  die "no MORI checkout at $SRC (a checkout of ROCm/mori at commit $MORI_COMMIT, branch feature/tcp-backend; set MORI_TP_MORI_SRC)"
[ -f "$SRC/3rdparty/spdlog/include/spdlog/spdlog.h" ] ||
  die "$SRC lacks its spdlog submodule (git submodule update --init 3rdparty/spdlog)"
if [ -e "$SRC/.git" ]; then
  head=$(git -C "$SRC" rev-parse HEAD)
  case $head in $MORI_COMMIT*) ;; *) die "$SRC is at $head, not $MORI_COMMIT (the revision mori-tp is tested with)" ;; esac
fi
digest=$(sources_digest)
[ "$digest" = "$MORI_DIGEST" ] ||
  die "$SRC's sources hash to $digest, not $MORI_DIGEST (ROCm/mori $MORI_COMMIT's): another revision, or changed files"
key=$digest-$(sha256sum "$SCRIPT" | cut -c1-12)
mkdir -p "$CACHE" "$ROOT/target/mori-io"
CACHE=$(cd "$CACHE" && pwd -P)
OUT=$CACHE/$key
if [ -f "$OUT/ok" ]; then
  ln -sfn "$OUT" "$ROOT/target/mori-io/current"
  echo "mori-io-build: reusing $OUT (MORI $MORI_COMMIT, sources $digest, HIP $HIP_VERSION)"
  exit 0
fi

STAMP="sid+experimental $PACKAGES pin:$HIP_PACKAGES"
if [ "$(cat "$CHROOT/.mori-tp-chroot" 2>/dev/null || true)" != "$STAMP" ]; then
  MIRROR=${MORI_TP_DEBIAN_MIRROR:-$(mirror)}
  echo "mori-io-build: creating $CHROOT (sid, with HIP from experimental) from $MIRROR"
  rm -rf "$CHROOT" "$CHROOT.partial"
  mkdir -p "$(dirname "$CHROOT")"
  # HIP 7 is in experimental only: an apt pin takes its HIP packages from there, all else from
  # sid. An experimental that lacks them fails here with apt's error; nothing falls back.
  PIN="Package: $HIP_PACKAGES
Pin: release a=experimental
Pin-Priority: 990"
  export PIN
  mmdebstrap --quiet --mode=root --variant=minbase --aptopt='Acquire::Check-Valid-Until "false"' \
    --setup-hook='mkdir -p "$1/etc/apt/preferences.d" && printf "%s\n" "$PIN" >"$1/etc/apt/preferences.d/mori-tp-hip"' \
    --include="$PACKAGES" sid "$CHROOT.partial" \
    "deb $MIRROR sid main" "deb $MIRROR experimental main"
  echo "$STAMP" >"$CHROOT.partial/.mori-tp-chroot"
  mv "$CHROOT.partial" "$CHROOT"
else
  echo "mori-io-build: reusing $CHROOT"
fi
hip=$(chroot "$CHROOT" dpkg-query -W -f='${Version}' libamdhip64-dev)
case $hip in
  $HIP_VERSION*) ;;
  *) die "the chroot's libamdhip64-dev is $hip, not $HIP_VERSION (the HIP mori-tp tests MORI-IO with); remove $CHROOT to remake it" ;;
esac

echo "mori-io-build: building MORI $MORI_COMMIT (sources $digest) with HIP $hip into $OUT"
mkdir -p "$OUT"
in_chroot bash "$SCRIPT" --inside-build "$OUT"
echo "MORI $MORI_COMMIT sources $digest HIP $hip" >"$OUT/ok"
ln -sfn "$OUT" "$ROOT/target/mori-io/current"
echo "mori-io-build: built $OUT"
