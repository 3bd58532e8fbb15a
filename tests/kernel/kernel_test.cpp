// The copy kernel's own source (hip/copy_kernel.hip), compiled for the CPU through
// hip/cpu_shim.hpp, against libmori_tp's host backend, byte for byte.
//
// For heterogeneous-TP layouts (head slices of 1, 3, 64, 72, 128, 256 and 1152 bytes), page
// sizes 1 and 16, fragmented and contiguous pages, misaligned base pointers and many buffers,
// every (prefill rank, decode rank) pair is planned with mori_tp_plan, its rects and buffer bases
// go into the kernel's table (hip/copy_table.hpp builds it as the header prescribes), and the
// kernel moves the bytes; mori_send_kvcache with MORI_BACKEND_HOST moves the same pair into a
// second copy of the decode buffers. Both copies must agree on every byte, bytes outside the
// slices keep their sentinel, and the guard bytes around each buffer stay untouched. Each pair
// also runs with its table in memory rather than in the argument, on small grids, other buffer
// groups and smaller blocks, so the kernel's grid-stride loops, several passes per tile, tiles
// spanning several rects and rects spanning several tiles all run; blocks run in a shuffled
// order.
//
// Build (tests/copy_kernel.rs does this, also with -fsanitize=address,undefined):
//   c++ -std=c++17 -DMORI_COPY_KERNEL_CPU -I include -I hip tests/kernel/kernel_test.cpp
//       target/debug/libmori_tp.a -lpthread -ldl -lm -lrt -lutil -lgcc_s
// Exit: 0 passed, 1 failed.

#include <cinttypes>
#include <cstddef>
#include <string>
#include <vector>

#include "copy_kernel.hip"
#include "copy_table.hpp"
#include "mori_tp.h"

namespace {

int failures = 0;

void fail(const std::string &what) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    if (++failures > 20) {
        std::fprintf(stderr, "kernel_test: too many failures, stopping\n");
        std::exit(1);
    }
}

#define CHECK_OK(call)                                                                                  \
    do {                                                                                                \
        const MoriStatus check_status_ = (call);                                                        \
        if (check_status_ != MORI_OK) {                                                                 \
            std::fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call,              \
                         mori_status_str(check_status_), mori_last_error_message());                    \
            std::exit(1);                                                                               \
        }                                                                                               \
    } while (0)

using mori_testkit::next;

// Guard bytes before and after every buffer: a write outside a buffer changes them.
constexpr size_t kGuard = 32;
constexpr uint8_t kGuardByte = 0xC3;

// One buffer: kGuard + misalignment guard bytes, the capacity, kGuard guard bytes.
struct Buffer {
    std::vector<uint8_t> storage;
    size_t misalign = 0;

    Buffer(uint64_t capacity, size_t misalign_) : storage(kGuard + misalign_ + capacity + kGuard, kGuardByte),
                                                    misalign(misalign_) {}
    uint8_t *base() { return storage.data() + kGuard + misalign; }
    uint64_t capacity() const { return storage.size() - 2 * kGuard - misalign; }
    bool guards_intact() const {
        for (size_t i = 0; i < kGuard + misalign; i++) {
            if (storage[i] != kGuardByte) return false;
        }
        for (size_t i = storage.size() - kGuard; i < storage.size(); i++) {
            if (storage[i] != kGuardByte) return false;
        }
        return true;
    }
};

struct Layout {
    const char *name;
    uint32_t heads, prefill_tp, decode_tp;
    uint64_t bytes_per_head;
    uint32_t buffers;
};

const Layout kLayouts[] = {
    {"H=4 P2->D8, 256 B heads", 4, 2, 8, 256, 4},
    {"H=8 P8->D2, 128 B heads", 8, 8, 2, 128, 4},
    {"H=8 P4->D8, 64 B heads", 8, 4, 8, 64, 4},
    {"H=12 P6->D4, 72 B heads", 12, 6, 4, 72, 4},
    {"MLA H=1 P8->D4, 1152 B latent", 1, 8, 4, 1152, 2},
    {"H=4 P2->D8, 1 B heads", 4, 2, 8, 1, 4},
    {"H=8 P4->D8, 3 B heads", 8, 4, 8, 3, 3},
    {"H=2 P1->D2, 36 B heads", 2, 1, 2, 36, 5},
    {"H=8 P2->D4, 16 B heads, 160 buffers", 8, 2, 4, 16, 160},
    // Rows wider than four passes of a block (256 threads x 16 or 8 bytes), plus a remainder.
    {"MLA H=1 P2->D1, 16000 B rows", 1, 2, 1, 16000, 2},
    {"H=2 P1->D2, 8200 B heads", 2, 1, 2, 8200, 2},
};

// (source, destination) base misalignments in bytes.
const size_t kMisalign[][2] = {{0, 0}, {1, 3}, {2, 6}, {8, 4}, {4, 12}, {16, 8}};

using mori_testkit::Pages;

// The kernel's table for one call, as hip/copy_table.hpp builds it (the library's Rust builder
// makes the same bytes; tests/gpu_engine/table.rs compares them).
struct Table {
    mori_copy_table::Built built;
    std::vector<uint64_t> words;  // a copy of the table in memory, 8-byte aligned
};

Table make_table(const std::vector<MoriCopyRect> &rects, const std::vector<uint8_t *> &src,
                 const std::vector<uint8_t *> &dst) {
    Table t;
    std::vector<uint64_t> src_bases, dst_bases;
    for (size_t b = 0; b < src.size(); b++) {
        src_bases.push_back(reinterpret_cast<uint64_t>(src[b]));
        dst_bases.push_back(reinterpret_cast<uint64_t>(dst[b]));
    }
    std::string why;
    if (!mori_copy_table::build(rects.data(), rects.size(), src_bases.data(), dst_bases.data(), src.size(), t.built,
                                &why)) {
        std::fprintf(stderr, "kernel_test: cannot build the table: %s\n", why.c_str());
        std::exit(1);
    }
    t.words.assign((t.built.bytes.size() + 7) / 8, 0);
    std::memcpy(t.words.data(), t.built.bytes.data(), t.built.bytes.size());
    return t;
}

struct Launch {
    const char *name;
    bool in_memory;              // the table in memory even when it fits in the argument
    uint32_t grid_x, grid_y;     // 0: the header's formula
    uint32_t buffers_per_block;  // 0: the builder's
    uint32_t block;              // threads per block; 0: MORI_COPY_BLOCK_THREADS
    uint32_t max_blocks;         // a block limit through mori_copy_fit (the SM budget); 0: none
};

// The builder's launch, then the table in memory, small grids, other buffer groups and smaller
// blocks (several passes per tile): the kernel must not depend on them.
const Launch kLaunches[] = {
    {"formula", false, 0, 0, 0, 0, 0},
    {"table in memory", true, 0, 0, 0, 0, 0},
    {"one block", false, 1, 1, 0, 0, 0},
    {"grid 3x2, 1 buffer per block", true, 3, 2, 1, 0, 0},
    {"grid 2x3, 3 buffers per block, 100 threads", false, 2, 3, 3, 100, 0},
    {"64 threads, 5 buffers per block", true, 0, 0, 5, 64, 0},
    {"budget of 1 block", false, 0, 0, 0, 0, 1},
    {"budget of 3 blocks, table in memory", true, 0, 0, 0, 0, 3},
    {"budget of 70000 blocks (more than any device runs)", false, 0, 0, 0, 0, 70000},
};

void launch(const Table &table, const Launch &how, uint64_t seed) {
    MoriCopyKernelArgs args = table.built.args;
    if (how.in_memory || !table.built.inline_table) {
        std::memset(args.inline_table, 0, sizeof args.inline_table);
        args.table = reinterpret_cast<uint64_t>(table.words.data());
    }
    if (how.buffers_per_block != 0) args.buffers_per_block = how.buffers_per_block;
    uint32_t grid_x = 0, grid_y = 0;
    if (how.max_blocks != 0) {
        mori_copy_fit(&args, how.max_blocks, &grid_x, &grid_y);
        if (uint64_t{grid_x} * grid_y > how.max_blocks) {
            fail(std::string(how.name) + ": grid " + std::to_string(grid_x) + " x " + std::to_string(grid_y) +
                 " exceeds the limit");
        }
    } else {
        mori_copy_grid(&args, &grid_x, &grid_y);
    }
    if (grid_x == 0) return;  // nothing to copy: no launch
    if (how.grid_x != 0) grid_x = how.grid_x;
    if (how.grid_y != 0) grid_y = how.grid_y;
    const uint32_t block = how.block != 0 ? how.block : MORI_COPY_BLOCK_THREADS;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, 1}, MoriDim3{block, 1, 1}, args, seed);
}

class Case {
  public:
    Case(const Layout &l, uint32_t page_size, const Pages &pages, size_t src_misalign, size_t dst_misalign,
         uint64_t seed)
        : l_(l), page_size_(page_size), pages_(pages) {
        src_bpt_ = heads_per_rank(l.prefill_tp) * l.bytes_per_head;
        dst_bpt_ = heads_per_rank(l.decode_tp) * l.bytes_per_head;
        uint64_t state = seed;
        for (uint32_t p = 0; p < l.prefill_tp; p++) {
            src_.emplace_back();
            for (uint32_t b = 0; b < l.buffers; b++) {
                src_[p].emplace_back(pages.src_capacity_pages * page_size * src_bpt_, src_misalign);
                uint8_t *base = src_[p][b].base();
                for (uint64_t i = 0; i < src_[p][b].capacity(); i++) base[i] = static_cast<uint8_t>(next(state));
            }
        }
        for (uint32_t d = 0; d < l.decode_tp; d++) {
            kernel_.emplace_back();
            for (uint32_t b = 0; b < l.buffers; b++) {
                kernel_[d].emplace_back(pages.dst_capacity_pages * page_size * dst_bpt_, dst_misalign);
                uint8_t *base = kernel_[d][b].base();
                for (uint64_t i = 0; i < kernel_[d][b].capacity(); i++) {
                    base[i] = static_cast<uint8_t>(0xA5 ^ (d * 7) ^ (b * 13) ^ (i * 31 % 251));
                }
            }
        }
        initial_ = kernel_;
        host_ = kernel_;
    }

    // Every pair through the kernel (with `how`) and through the host backend; then compare.
    void run(const Launch &how, uint64_t seed, const std::string &label) {
        kernel_ = initial_;
        host_ = initial_;
        uint64_t rects_total = 0;
        for (uint32_t p = 0; p < l_.prefill_tp; p++) {
            for (uint32_t d = 0; d < l_.decode_tp; d++) {
                rects_total += pair(p, d, how, seed + p * 131 + d);
            }
        }
        bool moved = false;
        for (uint32_t d = 0; d < l_.decode_tp; d++) {
            for (uint32_t b = 0; b < l_.buffers; b++) {
                Buffer &k = kernel_[d][b], &h = host_[d][b];
                if (!k.guards_intact()) {
                    fail(label + ": decode rank " + std::to_string(d) + " buffer " + std::to_string(b) +
                         ": the kernel wrote outside the buffer");
                }
                moved |= std::memcmp(h.base(), initial_[d][b].base(), h.capacity()) != 0;
                for (uint64_t i = 0; i < k.capacity(); i++) {
                    if (k.base()[i] != h.base()[i]) {
                        fail(label + ": decode rank " + std::to_string(d) + " buffer " + std::to_string(b) +
                             ": first wrong byte at " + std::to_string(i) + " (kernel " +
                             std::to_string(k.base()[i]) + ", host backend " + std::to_string(h.base()[i]) + ")");
                        break;
                    }
                }
            }
        }
        if (!moved) {
            fail(label + ": no pair moved a byte (" + std::to_string(rects_total) + " rects)");
        }
    }

  private:
    uint64_t heads_per_rank(uint32_t tp) const { return tp <= l_.heads ? l_.heads / tp : 1; }

    uint64_t pair(uint32_t p, uint32_t d, const Launch &how, uint64_t seed) {
        const MoriTpSliceParams params = {l_.prefill_tp, p, l_.decode_tp, d, l_.heads, page_size_,
                                          page_size_ * src_bpt_, page_size_ * dst_bpt_};
        MoriTpSliceConfig config;
        CHECK_OK(mori_tp_slice_config(&params, &config));
        const size_t n = pages_.src.size();
        size_t count = 0;
        const MoriStatus query = mori_tp_plan(&config, pages_.src.data(), pages_.dst.data(), n, nullptr, 0, &count);
        if (query != MORI_OK && query != MORI_ERR_BUFFER_TOO_SMALL) CHECK_OK(query);
        std::vector<MoriCopyRect> rects(count);
        CHECK_OK(mori_tp_plan(&config, pages_.src.data(), pages_.dst.data(), n, rects.data(), count, &count));

        std::vector<uint8_t *> src, kernel_dst, host_dst;
        for (uint32_t b = 0; b < l_.buffers; b++) {
            src.push_back(src_[p][b].base());
            kernel_dst.push_back(kernel_[d][b].base());
            host_dst.push_back(host_[d][b].base());
        }
        launch(make_table(rects, src, kernel_dst), how, seed);

        std::vector<const void *> host_src(src.begin(), src.end());
        std::vector<void *> host_out(host_dst.begin(), host_dst.end());
        const MoriKvBuffers buffers = {host_src.data(), host_out.data(), l_.buffers, src_[p][0].capacity(),
                                       host_[d][0].capacity()};
        const MoriSendOptions host = {MORI_BACKEND_HOST, 0, nullptr};
        CHECK_OK(mori_send_kvcache(&config, &buffers, pages_.src.data(), pages_.dst.data(), n, &host));
        return count;
    }

    const Layout &l_;
    uint32_t page_size_;
    Pages pages_;
    uint64_t src_bpt_ = 0, dst_bpt_ = 0;
    std::vector<std::vector<Buffer>> src_, kernel_, host_, initial_;
};

// Hand-made tables the planner never produces: a zero-height rect, rows of bytes and of 8-byte
// units, heights of 16, 32 and 48 rows that form one run of 16-row rects, a run of one-row rects
// that a 3-row rect joins as three, and rows wider than a tile (two column chunks).
void unusual_tables() {
    std::vector<uint8_t> src(1 << 17), dst(1 << 17, 0xEE), want(1 << 17, 0xEE);
    for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 1);
    const std::vector<MoriCopyRect> rects = {
        {0, 8, 40, 24, 24, 3},    // rows of 24 B (8-byte units)
        {200, 100, 8, 8, 8, 0},   // zero rows
        {400, 300, 17, 5, 5, 9},  // rows of 5 B (bytes)
        {1000, 1001, 1, 1, 1, 1},
        {4096, 4096, 64, 32, 32, 16},  // 16, 32 and 48 rows: one run of six 16-row rects
        {8192, 6144, 64, 32, 32, 32},
        {16384, 8192, 64, 32, 32, 48},
        {30000, 20000, 48, 48, 48, 1},  // one-row rects; the 3-row one joins as three
        {30112, 20112, 48, 48, 48, 1},
        {30224, 20224, 96, 64, 48, 3},
        {40960, 40960, 20000, 20000, 20000, 2},  // 1250 units of 16 B a row: two column chunks
    };
    for (const MoriCopyRect &r : rects) {
        for (uint64_t i = 0; i < r.height; i++) {
            std::memcpy(&want[r.dst_offset + i * r.dst_pitch], &src[r.src_offset + i * r.src_pitch], r.width);
        }
    }
    const Table t = make_table(rects, {src.data()}, {dst.data()});
    const MoriCopyKernelArgs &a = t.built.args;
    if (a.num_runs != 6 || a.num_rects != 15 || a.num_tiles != 9 || !t.built.inline_table) {
        fail("hand-made table: " + std::to_string(a.num_runs) + " runs, " + std::to_string(a.num_rects) + " rects, " +
             std::to_string(a.num_tiles) + " tiles (want 6, 15, 9, inline)");
    }
    uint64_t seed = 11;
    for (const Launch &how : kLaunches) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        launch(t, how, seed++);
        if (dst != want) {
            fail(std::string("hand-made table, ") + how.name);
        }
    }
}

// 16-byte-aligned buffers (as a GPU allocator gives): rows equally misaligned on both sides (every
// residue of 16) and odd widths, which the builder cuts into head, 16-byte body and tail; zero
// rects; tables of exactly MORI_COPY_INLINE_TABLE_BYTES and one entry more. Every launch shape,
// every byte against memcpy.
void aligned_edges() {
    constexpr size_t kBytes = 1 << 20;
    std::vector<uint64_t> src_words(kBytes / 8 + 2), dst_words(kBytes / 8 + 2);
    uint8_t *src = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(src_words.data()) + 15) & ~uintptr_t{15});
    uint8_t *dst = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(dst_words.data()) + 15) & ~uintptr_t{15});
    for (size_t i = 0; i < kBytes; i++) src[i] = static_cast<uint8_t>(i * 13 + 7);
    struct Shape {
        const char *name;
        std::vector<MoriCopyRect> rects;
        int32_t inline_table;  // -1: either
        uint32_t min_16_byte_runs;
    };
    std::vector<Shape> shapes;
    for (uint64_t residue = 0; residue < 16; residue++) {
        Shape one{"one-row rects equally misaligned", {}, -1, 1};
        for (uint64_t i = 0; i < 24; i++) {
            one.rects.push_back({residue + 4096 * i, residue + 8192 * i + 2048, 0, 0, 128 + 37 * i, 1});
        }
        shapes.push_back(one);
        Shape tall{"tall rect of an odd width, misaligned offset", {{residue, 512 + residue, 1024, 2048, 1000 - residue, 33}},
                   -1, 1};
        shapes.push_back(tall);
    }
    shapes.push_back({"zero rects", {{0, 0, 16, 16, 0, 5}, {64, 64, 16, 16, 16, 0}}, -1, 0});
    Shape at_limit{"table of exactly the inline limit", {}, 1, 1}, over{"one entry over the inline limit", {}, 0, 1};
    for (uint64_t i = 0; i < 496; i++) at_limit.rects.push_back({512 * i, 1024 * i, 0, 0, 256, 1});
    over.rects = at_limit.rects;
    over.rects.push_back({512 * 496, 1024 * 496, 0, 0, 256, 1});
    shapes.push_back(at_limit);
    shapes.push_back(over);
    uint64_t seed = 99;
    for (const Shape &shape : shapes) {
        std::vector<uint8_t> want(kBytes, 0xEE);
        for (const MoriCopyRect &r : shape.rects) {
            for (uint64_t i = 0; i < r.height; i++) {
                std::memcpy(&want[r.dst_offset + i * r.dst_pitch], &src[r.src_offset + i * r.src_pitch], r.width);
            }
        }
        const Table t = make_table(shape.rects, {src}, {dst});
        if (shape.inline_table >= 0 && t.built.inline_table != (shape.inline_table == 1)) {
            fail(std::string(shape.name) + ": a table of " + std::to_string(t.built.bytes.size()) + " bytes, inline " +
                 std::to_string(t.built.inline_table));
        }
        uint32_t wide_runs = 0;
        for (uint32_t r = 0; r < t.built.args.num_runs; r++) {
            wide_runs += mori_copy_table::detail::get_u32(t.built.bytes.data(), t.built.args.runs_at + 48 * r + 44) == 4;
        }
        if (wide_runs < shape.min_16_byte_runs) fail(std::string(shape.name) + ": no run of 16-byte units");
        for (const Launch &how : kLaunches) {
            std::memset(dst, 0xEE, kBytes);
            launch(t, how, seed++);
            if (std::memcmp(dst, want.data(), kBytes) != 0) fail(std::string(shape.name) + ", " + how.name);
        }
    }
}

// The builder's choices on the shapes (4096 tokens, 256-byte heads, 64 buffers): the
// table fits in the argument for contiguous pages and for 256 rects of 16 rows, each shape is
// one run, tiles of 16 KiB, about MORI_COPY_TARGET_BLOCKS blocks.
void table_rules() {
    static_assert(sizeof(MoriCopyKernelArgs) == MORI_COPY_ARGS_BYTES, "the argument is 4 KiB");
    static_assert(offsetof(MoriCopyKernelArgs, inline_table) == MORI_COPY_ARGS_BYTES - MORI_COPY_INLINE_TABLE_BYTES,
                  "the inline table follows a 64-byte header");
    static_assert(sizeof(MoriCopyKernelRun) == MORI_COPY_RUN_BYTES, "a run entry is 48 bytes");
    static_assert(MORI_COPY_TILE_UNITS == MORI_COPY_BLOCK_THREADS * MORI_COPY_SLOTS_PER_THREAD, "tile units");
    std::vector<uint8_t *> src, dst;
    for (uint64_t b = 0; b < 64; b++) {
        src.push_back(reinterpret_cast<uint8_t *>((b + 1) << 30));
        dst.push_back(reinterpret_cast<uint8_t *>((b + 100) << 30));
    }
    struct Want {
        const char *name;
        std::vector<MoriCopyRect> rects;
        bool inline_table;
        uint32_t runs, tiles, table_bytes, buffers_per_block, grid_x, grid_y;
    };
    std::vector<MoriCopyRect> pages, rows;
    for (uint64_t i = 0; i < 256; i++) pages.push_back({(i * 37 % 512) * 16384, (i * 91 % 512) * 4096, 1024, 256, 256, 16});
    for (uint64_t i = 0; i < 4096; i++) rows.push_back({(i * 37 % 8192) * 1024, (i * 91 % 8192) * 256, 1024, 256, 256, 1});
    const Want wants[] = {
        {"contiguous", {{0, 0, 1024, 256, 256, 4096}}, true, 1, 64, 1024 + 48 + 8, 2, 64, 32},
        {"pages of 16 in runs of 1", pages, true, 1, 64, 1024 + 48 + 256 * 8, 2, 64, 32},
        {"page size 1", rows, false, 1, 64, 1024 + 48 + 4096 * 8, 2, 64, 32},
    };
    for (const Want &w : wants) {
        const Table t = make_table(w.rects, src, dst);
        const MoriCopyKernelArgs &a = t.built.args;
        if (t.built.inline_table != w.inline_table || a.num_runs != w.runs || a.num_tiles != w.tiles ||
            a.table_bytes != w.table_bytes || a.buffers_per_block != w.buffers_per_block ||
            t.built.grid_x != w.grid_x || t.built.grid_y != w.grid_y) {
            fail(std::string("table rules, ") + w.name + ": inline " + std::to_string(t.built.inline_table) + ", " +
                 std::to_string(a.num_runs) + " runs, " + std::to_string(a.num_tiles) + " tiles, " +
                 std::to_string(a.table_bytes) + " bytes, " + std::to_string(a.buffers_per_block) +
                 " buffers per block, grid " + std::to_string(t.built.grid_x) + " x " + std::to_string(t.built.grid_y));
        }
    }
    if (mori_copy_buffers_per_block(64, 64) != 2 || mori_copy_buffers_per_block(1024, 64) != 16 ||
        mori_copy_buffers_per_block(3, 5) != 1 || mori_copy_buffers_per_block(100000, 3) != 3) {
        fail("buffers per block formula");
    }
    uint32_t x = 0, y = 0;
    MoriCopyKernelArgs args{};
    args.num_tiles = 5;
    args.num_buffers = 70000 * 2;
    args.buffers_per_block = 1;
    mori_copy_grid(&args, &x, &y);
    if (x != 5 || y != MORI_COPY_MAX_GRID_Y) fail("grid y is capped");
    args.num_tiles = 1u << 31;
    args.buffers_per_block = 16;
    mori_copy_grid(&args, &x, &y);
    if (x != MORI_COPY_MAX_GRID_X || y != 8750) fail("grid x is capped");
    args.num_tiles = 0;
    mori_copy_grid(&args, &x, &y);
    if (x != 0 || y != 0) fail("no tiles, no launch");
    // The launch geometry within a block limit (src/backend/copy_kernel.rs tests the same
    // numbers): 64 tiles x 64 buffers on 264 blocks (132 SMs x 2), on 4, on 1, and no limit.
    const uint32_t limits[][4] = {{264, 52, 5, 15}, {4, 1, 4, 16}, {1, 1, 1, 16}, {0, 64, 32, 2}};
    for (const auto &l : limits) {
        MoriCopyKernelArgs a{};
        a.num_tiles = 64;
        a.num_buffers = 64;
        a.buffers_per_block = mori_copy_buffers_per_block(64, 64);
        mori_copy_fit(&a, l[0], &x, &y);
        if (x != l[1] || y != l[2] || a.buffers_per_block != l[3]) {
            fail("launch geometry within " + std::to_string(l[0]) + " blocks: grid " + std::to_string(x) + " x " +
                 std::to_string(y) + ", " + std::to_string(a.buffers_per_block) + " buffers per block");
        }
    }
}

// The fragmented shape (page size 1, runs of one page, one 256-byte head per decode rank): every
// rect is one row. A tile takes 64 of them (16 KiB), one unit of 16 bytes per thread and slot, so
// every slot of every thread works; copying each rect on its own kept 16 of 256 threads busy. The
// count comes from the CPU shim, and the kernel's work split makes it the GPU's too.
void fragmented_shape_keeps_every_lane_busy() {
    const uint64_t rows = 4096, width = 256;
    std::vector<MoriCopyRect> rects;
    for (uint64_t i = 0; i < rows; i++) rects.push_back({2 * i * width, (3 * i + 1) * width, width, width, width, 1});
    // A dry run: the lanes are counted, no memory is touched (the bases only need alignment).
    uint8_t *base = reinterpret_cast<uint8_t *>(uintptr_t{1} << 20);
    const Table t = make_table(rects, {base}, {base});
    MoriCopyKernelArgs args = t.built.args;
    args.table = reinterpret_cast<uint64_t>(t.words.data());
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_lanes.dry_run = true;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{t.built.grid_x, t.built.grid_y, 1},
                    MoriDim3{MORI_COPY_BLOCK_THREADS, 1, 1}, args, 7);
    const MoriCpuLanes counted = mori_cpu_lanes;
    mori_cpu_lanes = MoriCpuLanes{};
    const uint64_t slots_per_tile = counted.slots / t.built.args.num_tiles;
    std::printf("kernel_test: one-row rects of 256 B: %.1f%% of lanes active, %" PRIu64 " slots per 16 KiB tile\n",
                100.0 * counted.utilisation(), slots_per_tile);
    if (counted.active != counted.slots || slots_per_tile != MORI_COPY_TILE_UNITS || t.built.args.num_tiles != 64) {
        fail("one-row rects: " + std::to_string(counted.active) + " of " + std::to_string(counted.slots) +
             " slots active, " + std::to_string(slots_per_tile) + " slots per tile (want all, 1024)");
    }
}

// Any page layout (REFERENCE.md section 11): every pair of two layouts with the pair plan's rects, whose
// pitches are the advances of head-major or padded pages rather than token slots, through every
// launch shape, against mori_send_kvcache_pair on the host backend.
struct LayoutPair {
    const char *name;
    char src_kind, dst_kind;  // 'n' NHD, 'h' HND, 'p' NHD padded with an offset
    uint32_t heads, prefill_tp, decode_tp, src_page, dst_page;
    uint64_t head_bytes, tokens;
};

const LayoutPair kLayoutPairs[] = {
    {"HND P2->D8, pages 16, partial", 'h', 'h', 8, 2, 8, 16, 16, 32, 40},
    {"NHD P2 -> HND D4, pages 16 -> 64, partial", 'n', 'h', 8, 2, 4, 16, 64, 32, 173},
    {"HND P8 -> NHD D2, pages 64 -> 16, 24 B heads", 'h', 'n', 8, 8, 2, 64, 16, 24, 100},
    {"padded NHD P4 -> HND D4, 3 B heads", 'p', 'h', 8, 4, 4, 3, 5, 3, 29},
};

MoriTpLayout make_layout(char kind, uint32_t heads, uint32_t tp, uint32_t rank, uint32_t page, uint64_t hb) {
    MoriTpLayout l;
    if (kind == 'h') {
        CHECK_OK(mori_tp_layout_hnd(heads, tp, rank, page, hb, &l));
    } else {
        CHECK_OK(mori_tp_layout_nhd(heads, tp, rank, page, hb, &l));
    }
    if (kind == 'p') {
        l.offset = 5;
        l.page_stride += 5 + 11;
    }
    return l;
}

std::vector<int32_t> rotated(uint64_t count, int32_t capacity) {
    std::vector<int32_t> pages;
    for (int32_t i = 0; i < capacity; i++) pages.push_back((i + capacity / 3) % capacity);
    pages.resize(count);
    return pages;
}

void any_page_layout(int &cases) {
    constexpr uint32_t kBuffers = 3;
    uint64_t seed = 4242;
    for (const LayoutPair &lp : kLayoutPairs) {
        for (uint32_t p = 0; p < lp.prefill_tp; p++) {
            for (uint32_t d = 0; d < lp.decode_tp; d++) {
                const MoriTpLayout src_l = make_layout(lp.src_kind, lp.heads, lp.prefill_tp, p, lp.src_page, lp.head_bytes);
                const MoriTpLayout dst_l = make_layout(lp.dst_kind, lp.heads, lp.decode_tp, d, lp.dst_page, lp.head_bytes);
                MoriTpPairConfig config;
                CHECK_OK(mori_tp_pair_config(&src_l, &dst_l, &config));
                const uint64_t src_count = (lp.tokens + lp.src_page - 1) / lp.src_page;
                const uint64_t dst_count = (lp.tokens + lp.dst_page - 1) / lp.dst_page;
                const int32_t src_cap = static_cast<int32_t>(src_count + 3), dst_cap = static_cast<int32_t>(dst_count + 2);
                const std::vector<int32_t> src_pages = rotated(src_count, src_cap), dst_pages = rotated(dst_count, dst_cap);
                const MoriTpRequest request = {src_pages.data(), src_pages.size(), dst_pages.data(), dst_pages.size(),
                                               lp.tokens};
                size_t count = 0;
                const MoriStatus query = mori_tp_pair_plan(&config, &request, nullptr, 0, &count);
                if (query != MORI_OK && query != MORI_ERR_BUFFER_TOO_SMALL) CHECK_OK(query);
                std::vector<MoriCopyRect> rects(count);
                CHECK_OK(mori_tp_pair_plan(&config, &request, rects.data(), count, &count));

                std::vector<Buffer> src, initial;
                for (uint32_t b = 0; b < kBuffers; b++) {
                    src.emplace_back(src_cap * src_l.page_stride, b % 2);
                    for (uint64_t i = 0; i < src[b].capacity(); i++) src[b].base()[i] = static_cast<uint8_t>(next(seed));
                    initial.emplace_back(dst_cap * dst_l.page_stride, 2 - b % 2);
                    for (uint64_t i = 0; i < initial[b].capacity(); i++) {
                        initial[b].base()[i] = static_cast<uint8_t>(0x5A ^ (b * 29) ^ (i * 13 % 241));
                    }
                }
                std::vector<Buffer> host = initial;
                std::vector<const void *> host_src;
                std::vector<void *> host_dst;
                for (uint32_t b = 0; b < kBuffers; b++) {
                    host_src.push_back(src[b].base());
                    host_dst.push_back(host[b].base());
                }
                const MoriKvBuffers buffers = {host_src.data(), host_dst.data(), kBuffers, src[0].capacity(),
                                               host[0].capacity()};
                const MoriSendOptions host_options = {MORI_BACKEND_HOST, 0, nullptr};
                CHECK_OK(mori_send_kvcache_pair(&config, &buffers, &request, &host_options));
                for (const Launch &how : kLaunches) {
                    std::vector<Buffer> kernel = initial;
                    std::vector<uint8_t *> srcs, dsts;
                    for (uint32_t b = 0; b < kBuffers; b++) {
                        srcs.push_back(src[b].base());
                        dsts.push_back(kernel[b].base());
                    }
                    launch(make_table(rects, srcs, dsts), how, seed++);
                    const std::string label = std::string(lp.name) + ", pair (" + std::to_string(p) + ", " +
                                              std::to_string(d) + "), " + how.name;
                    for (uint32_t b = 0; b < kBuffers; b++) {
                        if (!kernel[b].guards_intact()) fail(label + ": the kernel wrote outside buffer " + std::to_string(b));
                        if (std::memcmp(kernel[b].base(), host[b].base(), host[b].capacity()) != 0) {
                            fail(label + ": buffer " + std::to_string(b) + " differs from the host backend's");
                        }
                    }
                    cases++;
                }
            }
        }
    }
}

}  // namespace

int main() {
    if (mori_abi_version() != MORI_TP_ABI_VERSION) {
        std::fprintf(stderr, "kernel_test: libmori_tp ABI %u, header %u\n", mori_abi_version(), MORI_TP_ABI_VERSION);
        return 1;
    }
    table_rules();
    fragmented_shape_keeps_every_lane_busy();
    unusual_tables();
    aligned_edges();
    int cases = 0;
    uint64_t seed = 1;
    for (const Layout &layout : kLayouts) {
        for (uint32_t page_size : {1u, 16u}) {
            const bool many = layout.buffers > 8;
            const Pages shapes[2] = {mori_testkit::fragmented(seed * 977 + page_size, page_size == 1 ? 9 : 4, 4),
                                     mori_testkit::contiguous(page_size == 1 ? 12 : 3, 2, 1)};
            for (int shape = 0; shape < 2; shape++) {
                for (const auto &misalign : kMisalign) {
                    Case c(layout, page_size, shapes[shape], misalign[0], misalign[1], seed++);
                    for (const Launch &how : kLaunches) {
                        // Many buffers: the formula grid only (the others add nothing there).
                        if (many && how.grid_x != 0) continue;
                        // Block limits: on the first two misalignments (the grid, not the
                        // alignment, is what they change), to keep the run short.
                        if (how.max_blocks != 0 && &misalign - kMisalign >= 2) continue;
                        const std::string label = std::string(layout.name) + ", page size " +
                                                  std::to_string(page_size) + (shape == 0 ? ", fragmented" : ", contiguous") +
                                                  ", misaligned by (" + std::to_string(misalign[0]) + ", " +
                                                  std::to_string(misalign[1]) + "), " + how.name;
                        c.run(how, seed, label);
                        cases++;
                    }
                }
            }
        }
    }
    any_page_layout(cases);
    if (failures != 0) {
        std::fprintf(stderr, "kernel_test: %d failures\n", failures);
        return 1;
    }
    std::printf("kernel_test: %d cases, every byte equal to the host backend's\n", cases);
    return 0;
}
