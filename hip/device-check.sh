#!/usr/bin/env bash
# The device check of mori-tp's CUDA backend, for a machine with an NVIDIA GPU, its driver and
# nvcc, but no Rust and no network. Build the library elsewhere and bring it along:
#
#   (Rust machine)  cargo build --release --lib --features cuda
#   (GPU machine)   OUT=/some/dir hip/device-check.sh
#
# from a checkout of the repository that holds target/release/libmori_tp.so. In order, each step
# timed and bounded (its own cap below, in seconds) so that the whole check ends within
# MORI_TP_CHECK_BUDGET_S seconds (default 420: 7 minutes, so that a rerun fits a 15-minute device
# lease):
#   1. environment (20): glibc 2.34 or later (the library's own GLIBC_ symbol versions, and the
#      prebuilt library's floor), the GPU, driver and nvcc (nvidia-smi, nvcc --version), that the
#      library was built with the CUDA backend, and where compute-sanitizer is;
#   2. build (90): hip/device_test.cpp and hip/bench.cpp with nvcc through hip/cuda/hip/hip_runtime.h
#      (the HIP names as CUDA's), linked against the library; hip/lane_count.cpp (the kernel's
#      source on the CPU shim, for bench's lane column) with the host C++ compiler. This step
#      was compile-checked, without a GPU, on 2026-12-04 with Debian bookworm's nvcc 11.8.89
#      (nvidia-cuda-toolkit, host compiler gcc 11), as was hip/copy_kernel.hip as CUDA for
#      sm_90 and the library's embedded PTX with that toolkit's ptxas -arch=sm_90; and
#      hip/driver_cases.cpp with the host compiler (it finds the driver's functions itself);
#   3. device_test (60): every path byte-exact on the GPU (send per rect and with the kernel, pack and
#      unpack, the pair functions NHD <-> HND with pages of 16 and 64 and a partial last page,
#      groups, a device staging pool, two streams, pinned and registered host memory, two GPUs
#      when there are);
#   4. driver_cases (40): what the stand-in driver models, on the real one: a stream held by
#      cuStreamWaitValue32 (no send may wait for it), a second thread, graph capture with another
#      thread sending, a cuCtxCreate context, CU_STREAM_PER_THREAD (tests/cuda_runtime.rs runs
#      the same program over tests/fake_cuda);
#   5. python/tests/device_tensors.py (60) with torch and CuPy tensors (--backend cuda);
#   6. bench (90): the kernel against the per-rect copies against one memcpy, on issue 31's shapes
#      (at 4096 tokens with the per-rect rows, at 32768 tokens without them: seconds per call);
#   7. sanitizer (60): compute-sanitizer --tool memcheck on the quick set (bench --quick): 0
#      errors. compute-sanitizer is looked for on PATH, beside nvcc (bin/ and the toolkit's
#      compute-sanitizer/), under CUDA_HOME and CONDA_PREFIX, and in the pip wheels' tree (the
#      `nvidia` package PYTHON imports: nvidia/*/compute-sanitizer/, nvidia/*/bin/).
# Each step's output goes to the terminal and, when OUT is set, to $OUT/<step>.txt; $OUT/summary.txt
# has one line per step (PASS, FAIL, SKIP, with seconds; a step that exits 77 is a SKIP, and a
# FAIL under --require). Exit status: 0 when no step failed,
# 1 otherwise (a mismatch, a sanitizer error, a step out of time, a missing tool), 2 for a usage
# error.
#
# Options:
#   --dry-run         run the script's own logic here, without nvcc, a GPU or a sanitizer: the
#                     build and the GPU programs are stand-ins that print what would run (set
#                     MORI_TP_DRY_RUN_FAIL=<step> to make one fail), the Python step runs the
#                     same script with numpy on the host backend. tests/device_check.rs runs it
#                     (MORI_TP_DRY_RUN_SKIP=<step> makes one exit 77; MORI_TP_DRY_RUN_GLIBC=<x.y>
#                     stands for the system's glibc version).
#   --require         a step that skips (exit 77: no torch or CuPy, no device) fails instead.
#   --skip-python     leave out step 5;  --skip-bench: step 6;  --skip-sanitizer: step 7.
#   -h, --help        this text.
# Environment: OUT (where the tables go), MORI_TP_LIB (default target/release/libmori_tp.so),
# NVCC (default nvcc; CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc when not on PATH), CXX (host
# compiler, default c++), PYTHON (default python3), MORI_TP_CHECK_BUDGET_S (default 420),
# COMPUTE_SANITIZER (the sanitizer's path, instead of the search).
set -uo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry_run=0
# Internal: `device-check.sh --run-step FUNCTION ARGS...` runs one step's function (so that
# `timeout` can bound it: each step is this script again), `--fake-nvcc ARGS...` is the dry run's
# nvcc. Their settings come from the MORI_DC_* variables the main run exports.
internal=""
case "${1:-}" in
  --run-step | --fake-nvcc | --find-sanitizer)
    internal="$1"
    shift
    ;;
esac
if [ -z "$internal" ]; then
skip_python=0
skip_bench=0
skip_sanitizer=0
require=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --require) require=1 ;;
    --skip-python) skip_python=1 ;;
    --skip-bench) skip_bench=1 ;;
    --skip-sanitizer) skip_sanitizer=1 ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "device-check.sh: unknown argument '$arg' (see --help)" >&2
      exit 2
      ;;
  esac
done

  budget="${MORI_TP_CHECK_BUDGET_S:-420}"
  case "$budget" in
    '' | *[!0-9]*)
      echo "device-check.sh: MORI_TP_CHECK_BUDGET_S='$budget' is not a number of seconds" >&2
      exit 2
      ;;
  esac
  started=$(date +%s)
  lib="${MORI_TP_LIB:-$root/target/release/libmori_tp.so}"
  python="${PYTHON:-python3}"
  cxx="${CXX:-c++}"
  out="${OUT:-}"
  build="$(mktemp -d "${TMPDIR:-/tmp}/mori-device-check.XXXXXX")"
  trap 'rm -rf "$build"' EXIT
  if [ -n "$out" ]; then
    mkdir -p "$out" || { echo "device-check.sh: cannot create OUT=$out" >&2; exit 2; }
    : >"$out/summary.txt"
  fi
fi

failed=0
summary=()

# Seconds left of the budget.
left() {
  echo $((budget - ($(date +%s) - started)))
}

# record STEP STATUS SECONDS [NOTE]: one line of the summary.
record() {
  local line
  line=$(printf '%-15s %-4s %5ss  %s' "$1" "$2" "$3" "${4:-}")
  summary+=("$line")
  if [ -n "$out" ]; then
    echo "$line" >>"$out/summary.txt"
  fi
  if [ "$2" = FAIL ]; then
    failed=1
  fi
}

# step NAME CAP_SECONDS COMMAND...: runs COMMAND with at most min(CAP, what is left of the
# budget) seconds, its output on the terminal and in $OUT/NAME.txt; records PASS (exit 0), SKIP
# (exit 77: the program says why) or FAIL (anything else, or out of time: exit 124).
step() {
  local name="$1" cap="$2"
  shift 2
  local remaining limit begin rc
  remaining=$(left)
  limit=$cap
  if [ "$remaining" -lt "$limit" ]; then limit=$remaining; fi
  if [ "$limit" -le 0 ]; then
    echo "== $name: no time left of the ${budget}s budget" >&2
    record "$name" FAIL 0 "not run: the ${budget}s budget is spent"
    return 1
  fi
  echo "== $name (at most ${limit}s): $*"
  begin=$(date +%s)
  if [ -n "$out" ]; then
    timeout --signal=TERM --kill-after=10 "$limit" "$self" --run-step "$@" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
  else
    timeout --signal=TERM --kill-after=10 "$limit" "$self" --run-step "$@" 2>&1
    rc=$?
  fi
  local took=$(($(date +%s) - begin))
  case $rc in
    0) record "$name" PASS "$took" ;;
    77)
      if [ "$require" = 1 ]; then
        record "$name" FAIL "$took" "exit 77 (skipped) under --require: see its output for why"
      else
        record "$name" SKIP "$took" "exit 77: see its output for why"
      fi
      ;;
    124 | 137) record "$name" FAIL "$took" "out of time after ${limit}s" ;;
    *) record "$name" FAIL "$took" "exit $rc" ;;
  esac
  return "$rc"
}

# The tools, or their stand-ins in a dry run (exported for the steps, which run as this script).
if [ -z "$internal" ]; then
  if [ "$dry_run" = 1 ]; then
    echo "device-check.sh: DRY RUN: no nvcc, GPU or sanitizer is used; the GPU steps are stand-ins"
    MORI_DC_NVCC="$self --fake-nvcc"
    MORI_DC_SANITIZER=""
  else
    nvcc_bin="${NVCC:-}"
    if [ -z "$nvcc_bin" ]; then
      for candidate in nvcc "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        if command -v "$candidate" >/dev/null 2>&1; then nvcc_bin="$candidate"; break; fi
      done
    fi
    MORI_DC_NVCC="${nvcc_bin:-nvcc}"
    MORI_DC_SANITIZER=$(NVCC_FOUND="$MORI_DC_NVCC" PYTHON="$python" "$self" --find-sanitizer)
  fi
  export MORI_DC_DRY_RUN="$dry_run" MORI_DC_NVCC MORI_DC_SANITIZER MORI_DC_LIB="$lib" \
    MORI_DC_BUILD="$build" MORI_DC_PYTHON="$python" MORI_DC_CXX="$cxx"
fi

# compute-sanitizer: COMPUTE_SANITIZER, else the first found on PATH, beside nvcc (a toolkit's
# bin/ and compute-sanitizer/; a pip wheel's nvidia/cuNN/bin next to it), under CUDA_HOME and
# CONDA_PREFIX, or in the pip wheels' tree (the `nvidia` namespace package PYTHON imports); prints
# its path, or the toolkit's usual path when none is found (the sanitizer step then fails).
find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then
    echo "$COMPUTE_SANITIZER"
    return 0
  fi
  local found nvcc_dir="" candidate
  found=$(command -v compute-sanitizer 2>/dev/null) && { echo "$found"; return 0; }
  if found=$(command -v "${NVCC_FOUND:-nvcc}" 2>/dev/null); then nvcc_dir=$(dirname "$found"); fi
  local candidates=()
  if [ -n "$nvcc_dir" ]; then
    candidates+=("$nvcc_dir/compute-sanitizer" "$nvcc_dir/../compute-sanitizer/compute-sanitizer")
  fi
  for prefix in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "${CONDA_PREFIX:-}" /usr/local/cuda; do
    [ -n "$prefix" ] || continue
    candidates+=("$prefix/bin/compute-sanitizer" "$prefix/compute-sanitizer/compute-sanitizer")
  done
  local roots
  roots=$("${PYTHON:-python3}" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null)
  while IFS= read -r root_dir; do
    [ -n "$root_dir" ] || continue
    for candidate in "$root_dir"/*/compute-sanitizer/compute-sanitizer "$root_dir"/*/bin/compute-sanitizer; do
      candidates+=("$candidate")
    done
  done <<<"$roots"
  for candidate in "${candidates[@]}"; do
    if [ -f "$candidate" ] && [ -x "$candidate" ]; then
      echo "$candidate"
      return 0
    fi
  done
  echo "${nvcc_dir:-/usr/local/cuda/bin}/compute-sanitizer"
  return 1
}

# "major.minor" versions: true when $1 >= $2.
# shellcheck disable=SC2329 # called by the environment step
version_at_least() {
  local a_major=${1%%.*} a_minor=${1#*.} b_major=${2%%.*} b_minor=${2#*.}
  a_minor=${a_minor%%.*}
  b_minor=${b_minor%%.*}
  [ "$a_major" -gt "$b_major" ] || { [ "$a_major" -eq "$b_major" ] && [ "$a_minor" -ge "$b_minor" ]; }
}

# The dry run's nvcc: writes an executable that says what it stands for, and fails when
# MORI_TP_DRY_RUN_FAIL names its program.
fake_nvcc() {
  local output="" previous=""
  for a in "$@"; do
    if [ "$previous" = -o ]; then output="$a"; fi
    previous="$a"
  done
  [ -n "$output" ] || { echo "fake nvcc: no -o in: $*" >&2; return 1; }
  local program
  program=$(basename "$output")
  cat >"$output" <<STUB
#!/usr/bin/env bash
echo "$program (dry-run stand-in for the nvcc build): arguments \$*"
if [ "\${MORI_TP_DRY_RUN_FAIL:-}" = "$program" ]; then echo "FAIL: $program (dry run)" >&2; exit 1; fi
echo "$program: all checks passed (dry run)"
STUB
  chmod +x "$output"
  echo "nvcc (dry run): $*"
}

# The step functions below run through `--run-step` (a new process of this script).
# shellcheck disable=SC2329

# 1. Environment.
environment() {
  echo "repository: $root ($(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
  local lib="$MORI_DC_LIB"
  echo "library: $lib"
  if [ ! -f "$lib" ]; then
    echo "FAIL: $lib is missing: build it with 'cargo build --release --lib --features cuda'" \
      "and bring target/release/libmori_tp.so along (or set MORI_TP_LIB)"
    return 1
  fi
  # The CUDA runtime's function names are in the library only when it has the CUDA backend.
  if ! grep -a -q cuDevicePrimaryCtxRetain "$lib"; then
    echo "FAIL: $lib has no CUDA backend (built without --features cuda)"
    return 1
  fi
  # glibc: the prebuilt library needs 2.34 or later (its pthread and dl symbols are libc's
  # GLIBC_2.34 ones), and at least the highest GLIBC_ version the library's symbols name.
  local need=2.34 own have
  own=$(objdump -T "$lib" 2>/dev/null | grep -o 'GLIBC_[0-9]*\.[0-9]*' | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n | tail -1)
  if [ -n "$own" ] && ! version_at_least "$need" "$own"; then need=$own; fi
  if [ "$MORI_DC_DRY_RUN" = 1 ] && [ -n "${MORI_TP_DRY_RUN_GLIBC:-}" ]; then
    have=$MORI_TP_DRY_RUN_GLIBC
  else
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    [ -n "$have" ] || have=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]*\.[0-9]*$')
  fi
  if [ -z "$have" ]; then
    echo "FAIL: cannot tell this system's glibc version (getconf GNU_LIBC_VERSION, ldd --version)"
    return 1
  fi
  if ! version_at_least "$have" "$need"; then
    echo "FAIL: glibc $have is older than $need, which $lib needs${own:+ (its symbols name GLIBC_$own)}:" \
      "use a system with glibc $need or later, or build the library there"
    return 1
  fi
  echo "glibc: $have (the library needs $need or later)"
  if [ "$MORI_DC_DRY_RUN" = 1 ]; then
    echo "GPU, driver, nvcc: not asked (dry run)"
    return 0
  fi
  nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total --format=csv || {
    echo "FAIL: nvidia-smi found no NVIDIA GPU or driver"
    return 1
  }
  "$MORI_DC_NVCC" --version || {
    echo "FAIL: nvcc not found (set NVCC, or put the CUDA toolkit's bin on PATH)"
    return 1
  }
  if [ -x "$MORI_DC_SANITIZER" ]; then
    echo "compute-sanitizer: $MORI_DC_SANITIZER"
  else
    echo "note: compute-sanitizer not found (looked on PATH, beside nvcc, under CUDA_HOME and" \
      "CONDA_PREFIX, in the pip wheels): step sanitizer will fail; set COMPUTE_SANITIZER"
  fi
}

# 2. Build.
# shellcheck disable=SC2329
build_programs() {
  local build="$MORI_DC_BUILD" lib="$MORI_DC_LIB" cxx="$MORI_DC_CXX"
  local nvcc
  read -r -a nvcc <<<"$MORI_DC_NVCC"
  mkdir -p "$build/lib" || return 1
  cp "$lib" "$build/lib/libmori_tp.so" || return 1
  # The library's SONAME is libmori_tp.so.<ABI>: the loader looks for that name.
  local soname
  soname=$(objdump -p "$lib" 2>/dev/null | awk '/SONAME/ {print $2}')
  if [ -z "$soname" ]; then
    soname=$(readelf -d "$lib" 2>/dev/null | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
  fi
  if [ -z "$soname" ]; then
    soname=libmori_tp.so.1
    echo "note: neither objdump nor readelf read the library's SONAME; assuming $soname"
  fi
  echo "library SONAME: $soname"
  ln -sf libmori_tp.so "$build/lib/$soname"
  echo "host compiler: $cxx"
  "$cxx" -std=c++17 -O2 -I"$root/include" -I"$root/hip" -c "$root/hip/lane_count.cpp" -o "$build/lane_count.o" || return 1
  local common=(-x cu -std=c++17 -O2 -I"$root/include" -I"$root/hip/cuda" -I"$root/hip" -Xcompiler -Wall)
  local link=(-L"$build/lib" -lmori_tp -Xlinker -rpath -Xlinker "$build/lib")
  "${nvcc[@]}" "${common[@]}" "$root/hip/device_test.cpp" "${link[@]}" -o "$build/device_test" || return 1
  # bench links lane_count.o too: compiled first, then linked without -x cu (which would apply to
  # the object as well; nvcc has no `-x none`).
  "${nvcc[@]}" "${common[@]}" -c "$root/hip/bench.cpp" -o "$build/bench.o" || return 1
  "${nvcc[@]}" "$build/bench.o" "$build/lane_count.o" "${link[@]}" -o "$build/bench" || return 1
  # driver_cases needs no toolkit (it looks the driver's functions up itself): the host compiler
  # builds it, except in a dry run, where it is a stand-in like the nvcc programs.
  if [ "$MORI_DC_DRY_RUN" = 1 ]; then
    "${nvcc[@]}" "$root/hip/driver_cases.cpp" -o "$build/driver_cases" || return 1
  else
    "$cxx" -std=c++17 -O2 -Wall -I"$root/include" "$root/hip/driver_cases.cpp" -L"$build/lib" -lmori_tp \
      -ldl -pthread -Wl,-rpath,"$build/lib" -o "$build/driver_cases" || return 1
  fi
}

# A GPU program: exit 77 (no CUDA device) is a failure here, since this check is for a GPU.
# shellcheck disable=SC2329
gpu_program() {
  "$@"
  local rc=$?
  if [ "$rc" = 77 ]; then
    echo "FAIL: $(basename "$1") found no CUDA device: this check needs an NVIDIA GPU"
    return 1
  fi
  return "$rc"
}

# 5. bench: every row at 4096 tokens (the per-rect rows included: about 16,000 runtime calls
# each), and the kernel's rows at 32768 tokens (the per-rect rows there take seconds per call).
# shellcheck disable=SC2329
bench_tables() {
  gpu_program "$MORI_DC_BUILD/bench" --tokens 4096 || return 1
  gpu_program "$MORI_DC_BUILD/bench" --tokens 32768 --no-memcpy2d
}

# 4. The Python device script.
# shellcheck disable=SC2329
python_tensors() {
  # shellcheck disable=SC2054 # "torch,cupy" is one argument
  local run=(--frameworks torch,cupy --backend cuda --timeout 150)
  if [ "$MORI_DC_DRY_RUN" = 1 ]; then
    run=(--frameworks numpy --backend host --timeout 120)
  fi
  if [ "$MORI_DC_DRY_RUN" = 1 ] && [ "${MORI_TP_DRY_RUN_SKIP:-}" = device_tensors ]; then
    echo "SKIP: device_tensors (dry run: MORI_TP_DRY_RUN_SKIP)"
    return 77
  fi
  MORI_TP_LIBRARY="$MORI_DC_LIB" PYTHONPATH="$root/python" "$MORI_DC_PYTHON" \
    "$root/python/tests/device_tensors.py" "${run[@]}"
}

# 6. The sanitizer: exit 1 on any error, and its summary must say 0 errors.
# shellcheck disable=SC2329
sanitizer() {
  local log="$MORI_DC_BUILD/sanitizer.txt"
  if [ "$MORI_DC_DRY_RUN" = 1 ]; then
    "$MORI_DC_BUILD/bench" --quick
    if [ "${MORI_TP_DRY_RUN_FAIL:-}" = sanitizer ]; then
      echo "========= ERROR SUMMARY: 1 error (dry run)"
      return 1
    fi
    echo "========= ERROR SUMMARY: 0 errors (dry run)"
    return 0
  fi
  "$MORI_DC_SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
    "$MORI_DC_BUILD/bench" --quick 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if ! grep -q "ERROR SUMMARY: 0 errors" "$log"; then
    echo "FAIL: compute-sanitizer did not report 0 errors"
    return 1
  fi
  return "$rc"
}

# The internal modes run here and stop.
case "$internal" in
  --run-step)
    "$@"
    exit $?
    ;;
  --fake-nvcc)
    fake_nvcc "$@"
    exit $?
    ;;
  --find-sanitizer)
    find_sanitizer
    exit $?
    ;;
esac

step environment 20 environment
if [ "$failed" = 0 ]; then
  step build 90 build_programs
fi
if [ "$failed" = 0 ] || [ -x "$build/device_test" ]; then
  step device_test 60 gpu_program "$build/device_test"
  step driver_cases 40 gpu_program "$build/driver_cases"
  if [ "$skip_python" = 0 ]; then
    step device_tensors 60 python_tensors
  else
    record device_tensors SKIP 0 "--skip-python"
  fi
  if [ "$skip_bench" = 0 ]; then
    step bench 90 bench_tables
  else
    record bench SKIP 0 "--skip-bench"
  fi
  if [ "$skip_sanitizer" = 0 ]; then
    step sanitizer 60 sanitizer
  else
    record sanitizer SKIP 0 "--skip-sanitizer"
  fi
fi

echo
echo "device-check.sh summary ($(($(date +%s) - started))s of ${budget}s${out:+; tables in $out}):"
printf '  %s\n' "${summary[@]}"
if [ "$failed" != 0 ]; then
  echo "device-check.sh: FAILED"
  exit 1
fi
echo "device-check.sh: passed"
exit 0
