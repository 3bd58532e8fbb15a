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
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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
#define __launch_bounds__(threads)
#endif
#define MORI_DEVICE inline

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
    std::memcpy(&value, reinterpret_cast<const void *>(address), sizeof(T));
    return value;
}

template <class T>
inline void mori_store(uint64_t address, T value) {
    mori_cpu_check_alignment<T>(address, "store");
    std::memcpy(reinterpret_cast<void *>(address), &value, sizeof(T));
}

// splitmix64: a deterministic order from a seed, so a failing order can be replayed.
inline uint64_t mori_cpu_next(uint64_t &state) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <class T>
inline void mori_cpu_shuffle(std::vector<T> &items, uint64_t &state) {
    for (size_t i = items.size(); i > 1; i--) {
        const size_t j = static_cast<size_t>(mori_cpu_next(state) % i);
        T t = items[i - 1];
        items[i - 1] = items[j];
        items[j] = t;
    }
}

// Runs kernel(args) for every thread of a grid x block launch, blocks and threads in an order
// shuffled by `seed`.
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
    mori_cpu_shuffle(blocks, state);
    const MoriDim3 saved[4] = {threadIdx, blockIdx, blockDim, gridDim};
    gridDim = grid;
    blockDim = block;
    for (const MoriDim3 &b : blocks) {
        blockIdx = b;
        mori_cpu_shuffle(threads, state);
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
