// A CPU stand-in for the little of HIP that hip/copy_kernel.hip uses, so that the kernel's own
// source compiles with a plain C++ compiler (define MORI_COPY_KERNEL_CPU) and runs on host
// memory: in tests without a GPU, and inside tests/fake_hip.
//
// A launch (mori_cpu_launch) runs every thread of every block one after the other. That is a
// faithful execution of a kernel that shares nothing between threads (no shared memory, no
// barriers, no atomics, which the copy kernel promises). Blocks run in a shuffled order, and the
// threads of a block in a shuffled order too, so a kernel whose result depends on which block or
// thread runs first shows it. Loads and stores check their alignment: a GPU's wide loads need
// it, and a misaligned access aborts here instead of passing silently.
//
// The thread coordinates are thread_local: launches on different host threads do not interfere.
//
// It also counts, per launch, the (thread, slot) pairs of the kernel's tiles and how many of them
// moved bytes (MORI_COPY_COUNT_LANE): the kernel's active-lane utilisation, which depends only on
// its work split, so the count here is the GPU's too. A dry run (mori_cpu_lanes.dry_run) counts
// without touching memory: loads read zeros and stores are dropped, alignment still checked.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "testkit.hpp"

struct MoriDim3 {
    uint32_t x, y, z;
};

// What HIP calls threadIdx, blockIdx, blockDim and gridDim, for the thread being run.
inline thread_local MoriDim3 threadIdx, blockIdx, blockDim, gridDim;

// HIP's host headers (included first by tests/fake_hip) may already define these as empty.
#ifndef __global__
#define __global__
#endif
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define MORI_DEVICE inline

// The lane count of the launches on this host thread since the last reset.
struct MoriCpuLanes {
    uint64_t slots = 0;   // (thread, slot) pairs of the kernel's tiles
    uint64_t active = 0;  // of those, the ones that moved bytes
    bool dry_run = false;
    double utilisation() const { return slots == 0 ? 0.0 : static_cast<double>(active) / static_cast<double>(slots); }
};

inline thread_local MoriCpuLanes mori_cpu_lanes;

#define MORI_COPY_COUNT_LANE(moved)                 \
    do {                                            \
        mori_cpu_lanes.slots++;                     \
        mori_cpu_lanes.active += (moved) ? 1 : 0;   \
    } while (0)

// Where the host reaches a device address: the address itself, unless a stand-in runtime maps
// device addresses of its own (tests/fake_hip: hipHostRegister'd memory seen through another
// address, as on a GPU) and installs the translation here.
inline uint64_t (*mori_cpu_translate)(uint64_t address) = nullptr;

inline uint64_t mori_cpu_address(uint64_t address) {
    return mori_cpu_translate == nullptr ? address : mori_cpu_translate(address);
}

// Alignment of a T access: natural alignment, at least the size for the vector types a GPU
// loads in one instruction (at most 16 bytes).
template <class T>
inline void mori_cpu_check_alignment(uint64_t address, const char *what) {
    if (address % sizeof(T) != 0) {
        std::fprintf(stderr, "mori cpu shim: %s of %zu bytes at 0x%llx is misaligned\n", what, sizeof(T),
                     static_cast<unsigned long long>(address));
        std::abort();
    }
}

template <class T>
inline T mori_load(uint64_t address) {
    mori_cpu_check_alignment<T>(address, "load");
    T value;
    if (mori_cpu_lanes.dry_run) {
        std::memset(&value, 0, sizeof(T));
        return value;
    }
    std::memcpy(&value, reinterpret_cast<const void *>(mori_cpu_address(address)), sizeof(T));
    return value;
}

template <class T>
inline void mori_store(uint64_t address, T value) {
    mori_cpu_check_alignment<T>(address, "store");
    if (!mori_cpu_lanes.dry_run) {
        std::memcpy(reinterpret_cast<void *>(mori_cpu_address(address)), &value, sizeof(T));
    }
}

// A read of the kernel's table: host memory at its own address (the tables of the tests and of
// the stand-in runtimes are ordinary host or "device" memory), read even in a dry run, since the
// kernel's work split depends on it.
template <class T>
inline T mori_table_load(uint64_t address) {
    mori_cpu_check_alignment<T>(address, "table load");
    T value;
    std::memcpy(&value, reinterpret_cast<const void *>(address), sizeof(T));
    return value;
}

// Runs kernel(args) for every thread of a grid x block launch, blocks and threads in an order
// shuffled by `seed` (so a failing order replays from the seed).
template <class Args>
inline void mori_cpu_launch(void (*kernel)(Args), MoriDim3 grid, MoriDim3 block, const Args &args, uint64_t seed) {
    std::vector<MoriDim3> blocks, threads;
    for (uint32_t z = 0; z < grid.z; z++) {
        for (uint32_t y = 0; y < grid.y; y++) {
            for (uint32_t x = 0; x < grid.x; x++) {
                blocks.push_back({x, y, z});
            }
        }
    }
    for (uint32_t z = 0; z < block.z; z++) {
        for (uint32_t y = 0; y < block.y; y++) {
            for (uint32_t x = 0; x < block.x; x++) {
                threads.push_back({x, y, z});
            }
        }
    }
    uint64_t state = seed;
    mori_testkit::shuffle(blocks, state);
    const MoriDim3 saved[4] = {threadIdx, blockIdx, blockDim, gridDim};
    gridDim = grid;
    blockDim = block;
    for (const MoriDim3 &b : blocks) {
        blockIdx = b;
        mori_testkit::shuffle(threads, state);
        for (const MoriDim3 &t : threads) {
            threadIdx = t;
            kernel(args);
        }
    }
    threadIdx = saved[0];
    blockIdx = saved[1];
    blockDim = saved[2];
    gridDim = saved[3];
}
