// Deterministic inputs for the C++ tests and programs: the C++ twin of crates/testkit (the Rust
// tests, benchmarks and CLI use that one). One splitmix64 generator, one shuffle, and one
// generator of fragmented page lists, so that every C++ test and program that wants a seeded
// order or a fragmented request gets the same thing from the same seed, and a failure replays
// from its seed alone. Plain C++17, no HIP: the CPU shim and the hip/ programs both include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mori_testkit {

// splitmix64 (Vigna): the next value of the sequence that `state` seeds.
inline uint64_t next(uint64_t &state) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in lo..=hi (lo <= hi), as crates/testkit's Rng::range.
inline uint64_t range(uint64_t &state, uint64_t lo, uint64_t hi) {
    return lo + next(state) % (hi - lo + 1);
}

// Fisher-Yates, as crates/testkit's Rng::shuffle.
template <class T>
inline void shuffle(std::vector<T> &items, uint64_t &state) {
    for (size_t i = items.size(); i > 1; i--) {
        const size_t j = static_cast<size_t>(range(state, 0, i - 1));
        T t = items[i - 1];
        items[i - 1] = items[j];
        items[j] = t;
    }
}

// A request: page pairs and the pages each side's buffers must hold.
struct Pages {
    std::vector<int32_t> src, dst;
    uint64_t src_capacity_pages = 0, dst_capacity_pages = 0;
};

// Runs of the given lengths, each contiguous on both sides, laid out in a shuffled order with
// one or two free pages between them, independently on each side (as crates/testkit lays them
// out, so that no two runs touch and a run is exactly what the caller asked for).
inline Pages lay_out(const std::vector<size_t> &lengths, uint64_t &state) {
    Pages pages;
    std::vector<size_t> starts[2];
    uint64_t capacity[2] = {0, 0};
    for (int side = 0; side < 2; side++) {
        std::vector<size_t> order(lengths.size());
        for (size_t i = 0; i < order.size(); i++) order[i] = i;
        shuffle(order, state);
        starts[side].resize(lengths.size());
        size_t at = static_cast<size_t>(range(state, 0, 2));
        for (size_t run : order) {
            starts[side][run] = at;
            at += lengths[run] + static_cast<size_t>(range(state, 1, 2));
        }
        capacity[side] = at;
    }
    for (size_t run = 0; run < lengths.size(); run++) {
        for (size_t k = 0; k < lengths[run]; k++) {
            pages.src.push_back(static_cast<int32_t>(starts[0][run] + k));
            pages.dst.push_back(static_cast<int32_t>(starts[1][run] + k));
        }
    }
    pages.src_capacity_pages = capacity[0];
    pages.dst_capacity_pages = capacity[1];
    return pages;
}

// `runs` runs of 1..=max_run pages (crates/testkit's fragmented_runs).
inline Pages fragmented(uint64_t seed, size_t runs, size_t max_run) {
    uint64_t state = seed;
    std::vector<size_t> lengths(runs);
    for (size_t &len : lengths) len = static_cast<size_t>(range(state, 1, max_run == 0 ? 1 : max_run));
    return lay_out(lengths, state);
}

// `pages` pages in runs of exactly `run` pages (the last may be shorter).
inline Pages fixed_runs(uint64_t seed, size_t pages, size_t run) {
    uint64_t state = seed;
    std::vector<size_t> lengths;
    for (size_t left = pages; left > 0; left -= lengths.back()) lengths.push_back(left < run ? left : run);
    return lay_out(lengths, state);
}

// One run of `count` pages, from page `src_first` on the source side and `dst_first` on the
// destination side.
inline Pages contiguous(size_t count, size_t src_first = 0, size_t dst_first = 0) {
    Pages pages;
    for (size_t i = 0; i < count; i++) {
        pages.src.push_back(static_cast<int32_t>(src_first + i));
        pages.dst.push_back(static_cast<int32_t>(dst_first + i));
    }
    pages.src_capacity_pages = src_first + count;
    pages.dst_capacity_pages = dst_first + count;
    return pages;
}

}  // namespace mori_testkit
