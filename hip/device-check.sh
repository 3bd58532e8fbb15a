#!/usr/bin/env bash
# The device check of mori-tp's CUDA backend, for a machine with an NVIDIA GPU, its driver and
# nvcc, but no Rust and no network. Build the library elsewhere and bring it along:
#
#   (Rust machine)  cargo build --release --lib --features cuda
#   (GPU machine)   OUT=/some/dir hip/device-check.sh
#
# from a checkout of the repository that holds target/release/libmori_tp.so. In order, each step
# timed and bounded so that the whole check ends within MORI_TP_CHECK_BUDGET_S seconds (default
# 360):
#   1. environment: the GPU, driver and nvcc (nvidia-smi, nvcc --version), and that the library
#      was built with the CUDA backend;
#   2. build: hip/device_test.cpp and hip/bench.cpp with nvcc through hip/cuda/hip/hip_runtime.h
#      (the HIP names as CUDA's), linked against the library; hip/lane_count.cpp (the kernel's
#      source on the CPU shim, for bench's lane column) with the host C++ compiler. This step
#      was compile-checked, without a GPU, on 2026-12-04 with Debian bookworm's nvcc 11.8.89
#      (nvidia-cuda-toolkit, host compiler gcc 11), as was hip/copy_kernel.hip as CUDA for
#      sm_90 and the library's embedded PTX with that toolkit's ptxas -arch=sm_90;
#   3. device_test: every path byte-exact on the GPU (send per rect and with the kernel, pack and
#      unpack, the pair functions NHD <-> HND with pages of 16 and 64 and a partial last page,
#      groups, a device staging pool, two streams, pinned and registered host memory, two GPUs
#      when there are);
#   4. python/tests/device_tensors.py with torch and CuPy tensors (--backend cuda);
#   5. bench: the kernel against the per-rect copies against one memcpy, on issue 31's shapes
#      (at 4096 tokens with the per-rect rows, at 32768 tokens without them: seconds per call);
#   6. compute-sanitizer --tool memcheck on the quick set (bench --quick): 0 errors.
# Each step's output goes to the terminal and, when OUT is set, to $OUT/<step>.txt; $OUT/summary.txt
# has one line per step (PASS, FAIL, SKIP, with seconds). Exit status: 0 when no step failed,
# 1 otherwise (a mismatch, a sanitizer error, a step out of time, a missing tool), 2 for a usage
# error.
#
# Options:
#   --dry-run         run the script's own logic here, without nvcc, a GPU or a sanitizer: the
#                     build and the GPU programs are stand-ins that print what would run (set
#                     MORI_TP_DRY_RUN_FAIL=<step> to make one fail), the Python step runs the
#                     same script with numpy on the host backend. tests/device_check.rs runs it.
#   --skip-python     leave out step 4;  --skip-bench: step 5;  --skip-sanitizer: step 6.
#   -h, --help        this text.
# Environment: OUT (where the tables go), MORI_TP_LIB (default target/release/libmori_tp.so),
# NVCC (default nvcc; CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc when not on PATH), CXX (host
# compiler, default c++), PYTHON (default python3), MORI_TP_CHECK_BUDGET_S (default 360).
set -uo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry_run=0
# Internal: `device-check.sh --run-step FUNCTION ARGS...` runs one step's function (so that
# `timeout` can bound it: each step is this script again), `--fake-nvcc ARGS...` is the dry run's
# nvcc. Their settings come from the MORI_DC_* variables the main run exports.
internal=""
case "${1:-}" in
  --run-step | --fake-nvcc)
    internal="$1"
    shift
    ;;
esac
if [ -z "$internal" ]; then
skip_python=0
skip_bench=0
skip_sanitizer=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
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

  budget="${MORI_TP_CHECK_BUDGET_S:-360}"
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
    77) record "$name" SKIP "$took" "exit 77: see its output for why" ;;
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
    MORI_DC_SANITIZER=$(command -v compute-sanitizer ||
      echo "$(dirname "$(command -v "$MORI_DC_NVCC" || echo /usr/local/cuda/bin/nvcc)")/compute-sanitizer")
  fi
  export MORI_DC_DRY_RUN="$dry_run" MORI_DC_NVCC MORI_DC_SANITIZER MORI_DC_LIB="$lib" \
    MORI_DC_BUILD="$build" MORI_DC_PYTHON="$python" MORI_DC_CXX="$cxx"
fi

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
  command -v "$MORI_DC_SANITIZER" >/dev/null 2>&1 ||
    echo "note: compute-sanitizer not found at $MORI_DC_SANITIZER: step sanitizer will fail"
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
esac

step environment 60 environment
if [ "$failed" = 0 ]; then
  step build 120 build_programs
fi
if [ "$failed" = 0 ] || [ -x "$build/device_test" ]; then
  step device_test 150 gpu_program "$build/device_test"
  if [ "$skip_python" = 0 ]; then
    step device_tensors 180 python_tensors
  else
    record device_tensors SKIP 0 "--skip-python"
  fi
  if [ "$skip_bench" = 0 ]; then
    step bench 180 bench_tables
  else
    record bench SKIP 0 "--skip-bench"
  fi
  if [ "$skip_sanitizer" = 0 ]; then
    step sanitizer 120 sanitizer
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
