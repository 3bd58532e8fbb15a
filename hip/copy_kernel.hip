// The batched copy kernel: one launch copies every (buffer, rect) of a mori-tp call.
// copy_kernel.h describes the table it reads, the launch and the work split.
//
// The same source builds four ways:
// - for AMD GPUs: hipcc --genco (build.rs embeds the code objects in libmori_tp);
// - for NVIDIA GPUs as PTX: clang -x cuda --cuda-device-only -nocudainc (build.rs, feature
//   `cuda`), with hip/cuda_stand_in.h in place of CUDA's headers;
// - with nvcc, as standard CUDA (CUDA's own headers);
// - for the CPU: a C++ compiler with MORI_COPY_KERNEL_CPU defined, through hip/cpu_shim.hpp
//   (a launch is loops over blocks and threads), which is how the tests run it without a GPU.
// So the kernel uses only what all of them provide: threadIdx/blockIdx/blockDim/gridDim, plain
// loads and stores (through mori_load/mori_store and mori_table_load), no shared memory, no
// barriers, no atomics. The target-specific lines are the macros below.

#if defined(MORI_COPY_KERNEL_CPU)
#include "cpu_shim.hpp"
#else
#if defined(__HIP__)
#include <hip/hip_runtime.h>
#elif defined(__CUDA__) && !defined(__CUDACC__)
// clang -x cuda -nocudainc: no CUDA toolkit, so the few CUDA names the kernel uses come from here.
#include "cuda_stand_in.h"
#elif defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#error "copy_kernel.hip builds with hipcc, clang -x cuda, nvcc, or a C++ compiler with MORI_COPY_KERNEL_CPU"
#endif
// uint64_t and friends: hip_runtime.h brings them, CUDA's headers need not.
#include <stdint.h>

#define MORI_DEVICE __device__ __forceinline__

// Addresses are global memory (device, peer or mapped host memory; never shared memory or the
// stack). Clang's AMDGPU and NVPTX targets both call that address space 1, so the loads and
// stores become global_* (AMD) or ld.global/st.global (NVPTX) instructions rather than flat or
// generic ones; nvcc has no such attribute and infers it.
#if defined(__clang__) && (defined(__AMDGPU__) || defined(__NVPTX__))
#define MORI_GLOBAL __attribute__((address_space(1)))
#else
#define MORI_GLOBAL
#endif

template <class T>
MORI_DEVICE T mori_load(uint64_t address) {
    return *(const MORI_GLOBAL T *)address;
}

template <class T>
MORI_DEVICE void mori_store(uint64_t address, T value) {
    *(MORI_GLOBAL T *)address = value;
}

// The table (when not inside the argument) is global memory like the buffers.
template <class T>
MORI_DEVICE T mori_table_load(uint64_t address) {
    return *(const MORI_GLOBAL T *)address;
}
#endif

#include "copy_kernel.h"

// Counts one (thread, slot) of a tile, and whether the thread moves bytes in it. Nothing on a
// GPU; the CPU shim counts, which is how the tests and hip/bench measure the share of lanes
// that work (active-lane utilisation).
#ifndef MORI_COPY_COUNT_LANE
#define MORI_COPY_COUNT_LANE(active) ((void)(active))
#endif

// 16 bytes as one value, so that an aligned row moves with 128-bit loads and stores: a clang or
// GCC vector (AMD, NVPTX through clang, the CPU shim; 16-byte aligned), CUDA's uint4 with nvcc,
// which has no vector_size.
#if defined(__CUDACC__) && !defined(__clang__)
typedef uint4 MoriU128;
#else
typedef uint32_t MoriU128 __attribute__((vector_size(16)));
#endif

// Unrolls the fixed-count loops over a thread's slots, so that its loads stay in registers and
// are all in flight before the first store (GCC, for the CPU shim, needs no hint).
#if defined(__clang__) || defined(__CUDACC__)
#define MORI_UNROLL _Pragma("unroll")
#else
#define MORI_UNROLL
#endif

// Buffers one step of a thread's buffer loop moves: MORI_COPY_SLOTS_PER_THREAD units of each. The
// loop is software-pipelined: the loads of step n + 1 are issued before the stores of step n,
// so a thread always has a step's loads in flight while it stores (2 x 4 units of 16 bytes per
// thread at the default of 1, the registers of the unpipelined 2-buffer step it replaces).
// Kernel-internal (the host's table and grid do not depend on it), so a target may set its own
// after profiling.
#ifndef MORI_COPY_BUFFERS_IN_FLIGHT
#define MORI_COPY_BUFFERS_IN_FLIGHT 1
#endif

// The kernel's argument is 4 KiB (the wide entry's 32 KiB) of table read with per-thread
// indices. nvcc 11.7+ can leave it in the parameter space instead of copying it per thread when
// it is __grid_constant__; clang reads a by-value parameter in place anyway (ld.param on NVPTX,
// the kernarg segment on AMD).
#if defined(__CUDACC__) && !defined(__clang__) && \
    (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
#define MORI_GRID_CONSTANT __grid_constant__
#else
#define MORI_GRID_CONSTANT
#endif

namespace mori_copy {

constexpr uint32_t kSlots = MORI_COPY_SLOTS_PER_THREAD;

MORI_DEVICE uint32_t min_u32(uint32_t a, uint32_t b) {
    return a < b ? a : b;
}

// Reads of the table where it lies: kInline, inside the argument; else at args.table. The kernel
// body is instantiated for each, so that no read branches on it, and for each argument struct
// (Args: MoriCopyKernelArgs, or MoriCopyKernelWideArgs of the wide entry), which differ only in
// the room of inline_table.
template <bool kInline, class Args>
MORI_DEVICE uint64_t table_u64(const Args &a, uint32_t at) {
    // `at` is a multiple of 8.
    if (kInline) {
        return a.inline_table[at / 8];
    }
    return mori_table_load<uint64_t>(a.table + at);
}

template <bool kInline, class Args>
MORI_DEVICE uint32_t table_u32(const Args &a, uint32_t at) {
    // `at` is a multiple of 4; the table is little-endian.
    if (kInline) {
        return static_cast<uint32_t>(a.inline_table[at / 8] >> (8 * (at % 8)));
    }
    return mori_table_load<uint32_t>(a.table + at);
}

struct Run {
    uint64_t src_pitch, dst_pitch;
    uint32_t first_rect, rows, height, units, rows_per_tile, col_chunks, first_tile, unit_shift;
};

template <bool kInline, class Args>
MORI_DEVICE Run read_run(const Args &a, uint32_t index) {
    const uint32_t at = a.runs_at + index * MORI_COPY_RUN_BYTES;
    Run run;
    run.src_pitch = table_u64<kInline>(a, at);
    run.dst_pitch = table_u64<kInline>(a, at + 8);
    run.first_rect = table_u32<kInline>(a, at + 16);
    run.rows = table_u32<kInline>(a, at + 20);
    run.height = table_u32<kInline>(a, at + 24);
    run.units = table_u32<kInline>(a, at + 28);
    run.rows_per_tile = table_u32<kInline>(a, at + 32);
    run.col_chunks = table_u32<kInline>(a, at + 36);
    run.first_tile = table_u32<kInline>(a, at + 40);
    run.unit_shift = table_u32<kInline>(a, at + 44);
    return run;
}

// The offsets of one thread's units of a tile, relative to each buffer's base: the first
// `count` slots are valid.
struct Slots {
    uint64_t src[kSlots];
    uint64_t dst[kSlots];
    uint32_t count;
};

// Slot k of this thread is unit first + k * stride of the tile; a tile holds rows
// [first_row, first_row + rows) of the run, columns [col0, col0 + cols) of each.
template <bool kInline, class Args>
MORI_DEVICE Slots tile_slots(const Args &a, const Run &run, uint32_t first_row, uint32_t col0,
                             uint32_t cols, uint32_t units, uint32_t first, uint32_t stride) {
    Slots s;
    s.count = 0;
    MORI_UNROLL
    for (uint32_t k = 0; k < kSlots; k++) {
        s.src[k] = s.dst[k] = 0;
        const uint32_t i = first + k * stride;
        if (i < units) {
            const uint32_t g = first_row + i / cols;  // the run's row
            const uint64_t col = static_cast<uint64_t>(col0 + i % cols) << run.unit_shift;
            const uint32_t rect = run.first_rect + g / run.height, r = g % run.height;
            uint64_t src, dst;
            if (a.flags & MORI_COPY_WIDE_OFFSETS) {
                src = table_u64<kInline>(a, a.rects_at + 16 * rect);
                dst = table_u64<kInline>(a, a.rects_at + 16 * rect + 8);
            } else {
                const uint64_t both = table_u64<kInline>(a, a.rects_at + 8 * rect);
                src = both & 0xffffffffu;
                dst = both >> 32;
            }
            s.src[k] = (src << a.offset_shift) + r * run.src_pitch + col;
            s.dst[k] = (dst << a.offset_shift) + r * run.dst_pitch + col;
            s.count = k + 1;
        }
    }
    return s;
}

// The loads of one step: units of buffers [b, b + kBuffers) that lie before `end`.
template <bool kInline, class T, class Args>
MORI_DEVICE void load_step(const Args &a, const Slots &s, uint32_t b, uint32_t end,
                           T (&v)[MORI_COPY_BUFFERS_IN_FLIGHT][kSlots]) {
    constexpr uint32_t kBuffers = MORI_COPY_BUFFERS_IN_FLIGHT;
    MORI_UNROLL
    for (uint32_t j = 0; j < kBuffers; j++) {
        if (b + j < end) {
            const uint64_t src = table_u64<kInline>(a, 8 * (b + j));
            MORI_UNROLL
            for (uint32_t k = 0; k < kSlots; k++) {
                if (k < s.count) {
                    v[j][k] = mori_load<T>(src + s.src[k]);
                }
            }
        }
    }
}

// The stores of one step.
template <bool kInline, class T, class Args>
MORI_DEVICE void store_step(const Args &a, const Slots &s, uint32_t b, uint32_t end,
                            const T (&v)[MORI_COPY_BUFFERS_IN_FLIGHT][kSlots]) {
    constexpr uint32_t kBuffers = MORI_COPY_BUFFERS_IN_FLIGHT;
    MORI_UNROLL
    for (uint32_t j = 0; j < kBuffers; j++) {
        if (b + j < end) {
            const uint64_t dst = table_u64<kInline>(a, 8 * (a.num_buffers + b + j));
            MORI_UNROLL
            for (uint32_t k = 0; k < kSlots; k++) {
                if (k < s.count) {
                    mori_store<T>(dst + s.dst[k], v[j][k]);
                }
            }
        }
    }
}

// Moves the slots' units of buffers [b, end), MORI_COPY_BUFFERS_IN_FLIGHT buffers a step,
// software-pipelined: the next step's loads go out before this step's stores.
template <bool kInline, class T, class Args>
MORI_DEVICE void copy_slots(const Args &a, const Slots &s, uint32_t b, uint32_t end) {
    constexpr uint32_t kBuffers = MORI_COPY_BUFFERS_IN_FLIGHT;
    // Two register sets in turn (no copies between them): a step's loads go into one while the
    // other's stores go out.
    T even[kBuffers][kSlots] = {};
    T odd[kBuffers][kSlots] = {};
    load_step<kInline, T>(a, s, b, end, even);
    while (b < end) {
        if (b + kBuffers < end) {
            load_step<kInline, T>(a, s, b + kBuffers, end, odd);
        }
        store_step<kInline, T>(a, s, b, end, even);
        b += kBuffers;
        if (b >= end) {
            break;
        }
        if (b + kBuffers < end) {
            load_step<kInline, T>(a, s, b + kBuffers, end, even);
        }
        store_step<kInline, T>(a, s, b, end, odd);
        b += kBuffers;
    }
}

// The whole launch for this block, with the table inside the argument (kInline) or in memory.
template <bool kInline, class Args>
MORI_DEVICE void copy_blocks(const Args &args) {
    const uint32_t per = args.buffers_per_block;
    const uint32_t groups = args.num_buffers / per + (args.num_buffers % per != 0);
    const uint32_t stride = blockDim.x;
    for (uint32_t tile = blockIdx.x; tile < args.num_tiles; tile += gridDim.x) {
        // The tile's run, and which rows and columns of it the tile holds.
        const uint32_t run_index = args.num_runs == 1 ? 0 : table_u32<kInline>(args, args.tile_runs_at + 4 * tile);
        const Run run = read_run<kInline>(args, run_index);
        const uint32_t in_run = tile - run.first_tile;
        const uint32_t first_row = in_run / run.col_chunks * run.rows_per_tile;
        const uint32_t col0 = in_run % run.col_chunks * MORI_COPY_TILE_UNITS;
        const uint32_t rows = min_u32(run.rows_per_tile, run.rows - first_row);
        const uint32_t cols = min_u32(run.units - col0, MORI_COPY_TILE_UNITS);
        const uint32_t units = rows * cols;
        // One pass with a full block; a smaller block takes several.
        for (uint32_t base = 0; base < units; base += kSlots * stride) {
            const Slots s = tile_slots<kInline>(args, run, first_row, col0, cols, units, base + threadIdx.x, stride);
            for (uint32_t k = 0; k < kSlots; k++) {
                MORI_COPY_COUNT_LANE(k < s.count);
            }
            if (s.count == 0) {
                continue;
            }
            for (uint32_t group = blockIdx.y; group < groups; group += gridDim.y) {
                const uint32_t b = group * per, end = min_u32(b + per, args.num_buffers);
                switch (run.unit_shift) {
                    case 4:
                        copy_slots<kInline, MoriU128>(args, s, b, end);
                        break;
                    case 3:
                        copy_slots<kInline, uint64_t>(args, s, b, end);
                        break;
                    case 2:
                        copy_slots<kInline, uint32_t>(args, s, b, end);
                        break;
                    case 1:
                        copy_slots<kInline, uint16_t>(args, s, b, end);
                        break;
                    default:
                        copy_slots<kInline, uint8_t>(args, s, b, end);
                        break;
                }
            }
        }
    }
}

}  // namespace mori_copy

// Blocks per SM the compiler keeps the registers for (launch bounds' second argument). At 2,
// ptxas 12.9 -v gives 96 registers on sm_70 and 88 on sm_80, sm_90 and sm_100, with no spills on
// any; at 3 (80 registers) sm_70 spills 12 bytes, and without the hint sm_100's ptxas picks 64
// registers and spills 12 bytes. 2 blocks of 256 threads per SM, each thread with two steps of
// 4 x 16 bytes in flight, is 64 KiB of loads in flight per SM. REFERENCE.md section 7 records
// the counts and the command.
#ifndef MORI_COPY_MIN_BLOCKS_PER_SM
#define MORI_COPY_MIN_BLOCKS_PER_SM 2
#endif

namespace mori_copy {

// An entry's body: the launch for this block, whichever argument struct it takes.
template <class Args>
MORI_DEVICE void entry(const Args &args) {
    if (args.num_tiles == 0 || args.num_buffers == 0 || args.buffers_per_block == 0 || threadIdx.y != 0 ||
        threadIdx.z != 0) {
        return;
    }
    if (args.table == 0) {
        copy_blocks<true>(args);
    } else {
        copy_blocks<false>(args);
    }
}

}  // namespace mori_copy

// Which entries this build defines: mori_copy_kernel (MORI_COPY_NARROW_ENTRY, default 1) and
// mori_copy_kernel_wide (MORI_COPY_WIDE_ENTRY, default 0). build.rs builds the wide one alone into
// a PTX module of its own, whose `.version` it raises to 8.1 (the first PTX ISA with parameters
// beyond 4 KiB, which clang-15 does not emit), so that a driver older than CUDA 12.1 still loads
// the main module; the CPU shim (tests/fake_cuda) builds both. HIP never builds the wide one: its
// kernel argument stays 4 KiB.
#ifndef MORI_COPY_NARROW_ENTRY
#define MORI_COPY_NARROW_ENTRY 1
#endif
#ifndef MORI_COPY_WIDE_ENTRY
#define MORI_COPY_WIDE_ENTRY 0
#endif

#if MORI_COPY_NARROW_ENTRY
extern "C" __global__ void __launch_bounds__(MORI_COPY_BLOCK_THREADS, MORI_COPY_MIN_BLOCKS_PER_SM)
    mori_copy_kernel(MORI_GRID_CONSTANT const MoriCopyKernelArgs args) {
    mori_copy::entry(args);
}
#endif

#if MORI_COPY_WIDE_ENTRY
extern "C" __global__ void __launch_bounds__(MORI_COPY_BLOCK_THREADS, MORI_COPY_MIN_BLOCKS_PER_SM)
    mori_copy_kernel_wide(MORI_GRID_CONSTANT const MoriCopyKernelWideArgs args) {
    mori_copy::entry(args);
}
#endif
