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

namespace mori_copy {

// 16 bytes as one value, so that an aligned row moves with 128-bit loads and stores (GCC and
// Clang both know vector_size; the type is 16-byte aligned).
typedef uint32_t U128 __attribute__((vector_size(16)));

MORI_DEVICE uint64_t min_u64(uint64_t a, uint64_t b) {
    return a < b ? a : b;
}

// The index of the rect that holds flattened row `row`: the last rect whose first_row <= row
// (rects are sorted by first_row; a zero-height rect is skipped by the caller's walk).
MORI_DEVICE uint64_t find_rect(const MoriCopyKernelRect *rects, uint64_t num_rects, uint64_t row) {
    uint64_t lo = 0, hi = num_rects;  // answer in [lo, hi)
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

// Copies `rows` rows of `width` bytes as units of T (width, pitches and both starts are
// multiples of sizeof(T)). Threads split into groups of a power-of-two size, each group one row
// at a time, its lanes over consecutive units: narrow rows still use every thread, and adjacent
// lanes touch adjacent addresses.
template <class T>
MORI_DEVICE void copy_rows(uint64_t src, uint64_t dst, uint64_t src_pitch, uint64_t dst_pitch, uint64_t width,
                           uint64_t rows) {
    const uint64_t units = width / sizeof(T);
    uint32_t lanes = 1;
    while (lanes < units && lanes < blockDim.x) {
        lanes <<= 1;
    }
    const uint32_t groups = blockDim.x / lanes;
    const uint32_t lane = threadIdx.x & (lanes - 1);
    for (uint64_t row = threadIdx.x / lanes; row < rows; row += groups) {
        const uint64_t s = src + row * src_pitch, d = dst + row * dst_pitch;
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
    }
}

// Rows [first, first + rows) of `rect` for one buffer, with the widest unit both sides allow.
MORI_DEVICE void copy_rect_rows(const MoriCopyKernelRect &rect, uint64_t src_base, uint64_t dst_base,
                                uint64_t first, uint64_t rows) {
    const uint64_t src = src_base + rect.src_offset + first * rect.src_pitch;
    const uint64_t dst = dst_base + rect.dst_offset + first * rect.dst_pitch;
    const uint64_t alignment = src | dst | rect.src_pitch | rect.dst_pitch | rect.width;
    if (alignment % 16 == 0) {
        copy_rows<U128>(src, dst, rect.src_pitch, rect.dst_pitch, rect.width, rows);
    } else if (alignment % 8 == 0) {
        copy_rows<uint64_t>(src, dst, rect.src_pitch, rect.dst_pitch, rect.width, rows);
    } else if (alignment % 4 == 0) {
        copy_rows<uint32_t>(src, dst, rect.src_pitch, rect.dst_pitch, rect.width, rows);
    } else {
        copy_rows<uint8_t>(src, dst, rect.src_pitch, rect.dst_pitch, rect.width, rows);
    }
}

}  // namespace mori_copy

extern "C" __global__ void __launch_bounds__(MORI_COPY_BLOCK_THREADS)
    mori_copy_kernel(MoriCopyKernelArgs args) {
    using namespace mori_copy;
    if (args.num_rects == 0 || args.rows_per_block == 0) {
        return;
    }
    const uint64_t tiles = (args.total_rows + args.rows_per_block - 1) / args.rows_per_block;
    for (uint64_t buffer = blockIdx.y; buffer < args.num_buffers; buffer += gridDim.y) {
        const uint64_t src_base = args.src_bases[buffer], dst_base = args.dst_bases[buffer];
        for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            uint64_t row = tile * args.rows_per_block;
            const uint64_t end = min_u64(row + args.rows_per_block, args.total_rows);
            // The tile's rows, rect by rect: a tile may span several short rects.
            for (uint64_t index = find_rect(args.rects, args.num_rects, row); row < end && index < args.num_rects;
                 index++) {
                const MoriCopyKernelRect rect = args.rects[index];
                const uint64_t rect_end = min_u64(end, rect.first_row + rect.height);
                if (rect_end > row) {
                    copy_rect_rows(rect, src_base, dst_base, row - rect.first_row, rect_end - row);
                    row = rect_end;
                }
            }
        }
    }
}
