// hip/copy_table.hpp's builder as a shared library for the CPU, with one C entry point, so that
// the GPU engine's tests (tests/gpu_engine/table.rs) can build a table from the same rects with
// both builders and compare the bytes: the C++ one (which the C++ tests and hip/bench use) and
// the Rust one (which the library launches with).

#include <cstring>

#include "../../hip/copy_table.hpp"

// Builds the table of `rects` (six uint64 each, MoriCopyRect's order) for the buffer pairs:
// the argument into *args (table = 0), the table into `table` (at most `capacity` bytes; *len
// gets its length either way), the grid into grid[0..2], and whether it fits in the argument.
// Returns 0, 1 when the builder refuses (a 32-bit field overflows), 2 when capacity is short.
extern "C" int mori_cpu_copy_table(const uint64_t *rects, size_t num_rects, const uint64_t *src_bases,
                                   const uint64_t *dst_bases, size_t num_buffers, MoriCopyKernelArgs *args,
                                   uint8_t *table, size_t capacity, size_t *len, uint32_t *grid, int *fits) {
    std::vector<mori_copy_table::Rect> list(num_rects);
    for (size_t i = 0; i < num_rects; i++) {
        const uint64_t *r = rects + 6 * i;
        list[i] = {r[0], r[1], r[2], r[3], r[4], r[5]};
    }
    mori_copy_table::Built built;
    if (!mori_copy_table::build(list.data(), list.size(), src_bases, dst_bases, num_buffers, built)) {
        return 1;
    }
    *len = built.bytes.size();
    if (built.bytes.size() > capacity) {
        return 2;
    }
    std::memcpy(table, built.bytes.data(), built.bytes.size());
    *args = built.args;
    grid[0] = built.grid_x;
    grid[1] = built.grid_y;
    *fits = built.inline_table ? 1 : 0;
    return 0;
}
