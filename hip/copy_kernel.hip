// The batched copy kernel: one launch copies every (buffer, rect) of a mori-tp call.
// copy_kernel.h describes the table it reads, the launch and the work split.
//
// The same source builds two ways:
// - for AMD GPUs: hipcc --genco (build.rs embeds the code objects in libmori_tp);
// - for the CPU: a C++ compiler with MORI_COPY_KERNEL_CPU defined, through hip/cpu_shim.hpp
//   (a launch is loops over blocks and threads), which is how the tests run it without a GPU.
// So the kernel uses only what both provide: threadIdx/blockIdx/blockDim/gridDim, plain loads
// and stores (through mori_load/mori_store), no shared memory, no barriers, no atomics.

#if defined(MORI_COPY_KERNEL_CPU)
#include "cpu_shim.hpp"
#else
#include <hip/hip_runtime.h>

#define MORI_DEVICE __device__ __forceinline__

// Addresses are global memory (device, peer or mapped host memory; never LDS or scratch), so
// the loads and stores are global_* instructions rather than flat_* ones.
#define MORI_GLOBAL __attribute__((address_space(1)))

template <class T>
MORI_DEVICE T mori_load(uint64_t address) {
    return *(const MORI_GLOBAL T *)address;
}

template <class T>
MORI_DEVICE void mori_store(uint64_t address, T value) {
    *(MORI_GLOBAL T *)address = value;
}
#endif

#include "copy_kernel.h"

// Counts one (thread, step) of a tile, and whether the thread moved bytes in it. Nothing on a
// GPU; the CPU shim counts, which is how the tests and hip/bench measure the share of lanes
// that work (active-lane utilisation).
#ifndef MORI_COPY_COUNT_LANE
#define MORI_COPY_COUNT_LANE(active) ((void)(active))
#endif

namespace mori_copy {

// 16 bytes as one value, so that an aligned row moves with 128-bit loads and stores (GCC and
// Clang both know vector_size; the type is 16-byte aligned).
typedef uint32_t U128 __attribute__((vector_size(16)));

MORI_DEVICE uint64_t min_u64(uint64_t a, uint64_t b) {
    return a < b ? a : b;
}

// The rect that holds flattened row `row`: the last one in [lo, num_rects) whose first_row <= row
// (rects are sorted by first_row, and the one at lo starts at or before row). A zero-height rect
// never holds a row: the next rect starts at the same row and wins.
MORI_DEVICE uint64_t find_rect(const MoriCopyKernelRect *rects, uint64_t lo, uint64_t num_rects, uint64_t row) {
    uint64_t hi = num_rects;  // answer in [lo, hi)
    while (hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (rects[mid].first_row <= row) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// One row of `width` bytes as units of T (both starts and the width are multiples of
// sizeof(T)): lane `lane` of `lanes` takes units lane, lane + lanes, ..., so adjacent lanes touch
// adjacent addresses. True when this lane moved any unit.
template <class T>
MORI_DEVICE bool copy_row(uint64_t s, uint64_t d, uint64_t width, uint32_t lane, uint32_t lanes) {
    const uint64_t units = width / sizeof(T);
    uint64_t unit = lane;
    // Four loads in flight before their stores, for rows wider than one pass of the group.
    for (; unit + 3 * lanes < units; unit += 4 * lanes) {
        const T a = mori_load<T>(s + unit * sizeof(T));
        const T b = mori_load<T>(s + (unit + lanes) * sizeof(T));
        const T c = mori_load<T>(s + (unit + 2 * lanes) * sizeof(T));
        const T e = mori_load<T>(s + (unit + 3 * lanes) * sizeof(T));
        mori_store<T>(d + unit * sizeof(T), a);
        mori_store<T>(d + (unit + lanes) * sizeof(T), b);
        mori_store<T>(d + (unit + 2 * lanes) * sizeof(T), c);
        mori_store<T>(d + (unit + 3 * lanes) * sizeof(T), e);
    }
    for (; unit < units; unit += lanes) {
        mori_store<T>(d + unit * sizeof(T), mori_load<T>(s + unit * sizeof(T)));
    }
    return lane < units;
}

// One row with the widest unit both starts and the width allow.
MORI_DEVICE bool copy_row_widest(uint64_t s, uint64_t d, uint64_t width, uint32_t lane, uint32_t lanes) {
    const uint64_t alignment = s | d | width;
    if (alignment % 16 == 0) {
        return copy_row<U128>(s, d, width, lane, lanes);
    }
    if (alignment % 8 == 0) {
        return copy_row<uint64_t>(s, d, width, lane, lanes);
    }
    if (alignment % 4 == 0) {
        return copy_row<uint32_t>(s, d, width, lane, lanes);
    }
    return copy_row<uint8_t>(s, d, width, lane, lanes);
}

}  // namespace mori_copy

extern "C" __global__ void __launch_bounds__(MORI_COPY_BLOCK_THREADS)
    mori_copy_kernel(MoriCopyKernelArgs args) {
    using namespace mori_copy;
    if (args.num_rects == 0 || args.rows_per_block == 0) {
        return;
    }
    const uint32_t lanes = static_cast<uint32_t>(
        args.lanes_per_row == 0 ? 1 : min_u64(args.lanes_per_row, blockDim.x));
    const uint32_t groups = blockDim.x / lanes;
    // Threads past the last whole group (when lanes does not divide the block) stay idle.
    const uint32_t group = threadIdx.x / lanes, lane = threadIdx.x % lanes;
    const uint64_t tiles = (args.total_rows + args.rows_per_block - 1) / args.rows_per_block;
    for (uint64_t buffer = blockIdx.y; buffer < args.num_buffers; buffer += gridDim.y) {
        const uint64_t src_base = args.src_bases[buffer], dst_base = args.dst_bases[buffer];
        for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const uint64_t first = tile * args.rows_per_block;
            const uint64_t end = min_u64(first + args.rows_per_block, args.total_rows);
            const uint64_t steps = (end - first + groups - 1) / groups;
            // Each group takes every groups-th row of the tile, across rect boundaries; its rows
            // only move forward, so each search starts at the previous row's rect.
            uint64_t index = 0;
            for (uint64_t step = 0; step < steps; step++) {
                const uint64_t row = first + step * groups + group;
                bool active = false;
                if (group < groups && row < end) {
                    index = find_rect(args.rects, index, args.num_rects, row);
                    const MoriCopyKernelRect rect = args.rects[index];
                    const uint64_t r = row - rect.first_row;
                    active = copy_row_widest(src_base + rect.src_offset + r * rect.src_pitch,
                                             dst_base + rect.dst_offset + r * rect.dst_pitch, rect.width, lane, lanes);
                }
                MORI_COPY_COUNT_LANE(active);
            }
        }
    }
}
