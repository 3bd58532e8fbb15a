// The copy kernel's own source (hip/copy_kernel.hip), compiled for the CPU through
// hip/cpu_shim.hpp, against libmori_tp's host backend, byte for byte.
//
// For heterogeneous-TP layouts (head slices of 1, 3, 64, 72, 128, 256 and 1152 bytes), page
// sizes 1 and 16, fragmented and contiguous pages, misaligned base pointers and many buffers,
// every (prefill rank, decode rank) pair is planned with mori_tp_plan, its rects and buffer bases
// go into the kernel's table (one block of memory, laid out as the header prescribes), and the
// kernel moves the bytes; mori_send_kvcache with MORI_BACKEND_HOST moves the same pair into a
// second copy of the decode buffers. Both copies must agree on every byte, bytes outside the
// slices keep their sentinel, and the guard bytes around each buffer stay untouched. Each pair
// also runs on small grids and small tiles, so the kernel's grid-stride loops, tiles spanning
// several rects and rects spanning several tiles all run; blocks run in a shuffled order.
//
// Build (tests/copy_kernel.rs does this, also with -fsanitize=address,undefined):
//   c++ -std=c++17 -DMORI_COPY_KERNEL_CPU -I include -I hip tests/kernel/kernel_test.cpp
//       target/debug/libmori_tp.a -lpthread -ldl -lm -lrt -lutil -lgcc_s
// Exit: 0 passed, 1 failed.

#include <cinttypes>
#include <string>
#include <vector>

#include "copy_kernel.hip"
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

// The kernel's table for one call, in one allocation as the header lays it out.
struct Table {
    std::vector<uint64_t> words;  // uint64 storage keeps every part 8-byte aligned
    MoriCopyKernelArgs args{};
    uint64_t max_width = 0;
};

Table make_table(const std::vector<MoriCopyRect> &rects, const std::vector<uint8_t *> &src,
                 const std::vector<uint8_t *> &dst) {
    Table t;
    const size_t rect_words = sizeof(MoriCopyKernelRect) / sizeof(uint64_t);
    t.words.assign(rects.size() * rect_words + 2 * src.size(), 0);
    auto *table = reinterpret_cast<MoriCopyKernelRect *>(t.words.data());
    uint64_t rows = 0;
    for (size_t i = 0; i < rects.size(); i++) {
        table[i] = {rects[i].src_offset, rects[i].dst_offset, rects[i].src_pitch, rects[i].dst_pitch,
                    rects[i].width, rects[i].height, rows, 0};
        rows += rects[i].height;
        t.max_width = rects[i].width > t.max_width ? rects[i].width : t.max_width;
    }
    uint64_t *src_bases = t.words.data() + rects.size() * rect_words;
    uint64_t *dst_bases = src_bases + src.size();
    for (size_t b = 0; b < src.size(); b++) {
        src_bases[b] = reinterpret_cast<uint64_t>(src[b]);
        dst_bases[b] = reinterpret_cast<uint64_t>(dst[b]);
    }
    t.args = {table,
              src_bases,
              dst_bases,
              rects.size(),
              src.size(),
              rows,
              mori_copy_rows_per_block(t.max_width),
              mori_copy_lanes_per_row(t.max_width)};
    return t;
}

struct Launch {
    const char *name;
    uint64_t rows_per_block;  // 0: the header's formula
    uint32_t grid_x, grid_y;  // 0: the header's formula
    uint64_t lanes_per_row;   // 0: the header's formula
};

// The header's launch, then small grids, tiles and lane groups (one lane per row, groups that
// leave threads over, one group per block): the kernel must not depend on them.
const Launch kLaunches[] = {
    {"formula", 0, 0, 0, 0},
    {"one block", 0, 1, 1, 0},
    {"grid 3x2, 1-row tiles", 1, 3, 2, 0},
    {"grid 2x3, 7-row tiles, 7 lanes per row", 7, 2, 3, 7},
    {"1 lane per row", 0, 0, 0, 1},
    {"256 lanes per row, 3-row tiles", 3, 0, 0, 256},
};

void launch(const Table &table, const Launch &how, uint64_t seed) {
    MoriCopyKernelArgs args = table.args;
    if (how.rows_per_block != 0) args.rows_per_block = how.rows_per_block;
    if (how.lanes_per_row != 0) args.lanes_per_row = how.lanes_per_row;
    uint32_t grid_x = 0, grid_y = 0;
    mori_copy_grid(args.total_rows, args.rows_per_block, args.num_buffers, &grid_x, &grid_y);
    if (grid_x == 0) return;  // nothing to copy: no launch
    if (how.grid_x != 0) grid_x = how.grid_x;
    if (how.grid_y != 0) grid_y = how.grid_y;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, 1}, MoriDim3{MORI_COPY_BLOCK_THREADS, 1, 1}, args,
                    seed);
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

// Hand-made tables the planner never produces: a zero-height rect between two others, rects
// whose rows overlap a tile boundary, and a rect table where every rect is one row.
void unusual_tables() {
    std::vector<uint8_t> src(4096), dst(4096, 0xEE), want(4096, 0xEE);
    for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 1);
    const std::vector<MoriCopyRect> rects = {
        {0, 8, 40, 24, 24, 3},   // rows of 24 B (8-byte units)
        {200, 100, 8, 8, 8, 0},  // zero rows
        {400, 300, 17, 5, 5, 9}, // rows of 5 B (bytes)
        {1000, 1001, 1, 1, 1, 1},
    };
    for (const MoriCopyRect &r : rects) {
        for (uint64_t i = 0; i < r.height; i++) {
            std::memcpy(&want[r.dst_offset + i * r.dst_pitch], &src[r.src_offset + i * r.src_pitch], r.width);
        }
    }
    for (const Launch &how : kLaunches) {
        for (uint64_t rows_per_block : {1, 2, 4, 100}) {
            std::fill(dst.begin(), dst.end(), 0xEE);
            Table t = make_table(rects, {src.data()}, {dst.data()});
            Launch l = how;
            l.rows_per_block = rows_per_block;
            launch(t, l, rows_per_block);
            if (dst != want) {
                fail(std::string("hand-made table, ") + how.name + ", rows_per_block " +
                     std::to_string(rows_per_block));
            }
        }
    }
}

void grid_formula() {
    uint32_t x = 0, y = 0;
    mori_copy_grid(1000, 64, 70000, &x, &y);
    if (x != 16 || y != MORI_COPY_MAX_GRID_Y) fail("grid for 1000 rows, 64-row tiles, 70000 buffers");
    mori_copy_grid(uint64_t{1} << 40, 1, 3, &x, &y);
    if (x != MORI_COPY_MAX_GRID_X || y != 3) fail("grid x is capped");
    mori_copy_grid(0, 64, 3, &x, &y);
    if (x != 0 || y != 0) fail("no rows, no launch");
    if (mori_copy_rows_per_block(256) != 64 || mori_copy_rows_per_block(1) != MORI_COPY_MAX_ROWS_PER_BLOCK ||
        mori_copy_rows_per_block(1 << 20) != 1) {
        fail("rows per block formula");
    }
    if (mori_copy_lanes_per_row(256) != 16 || mori_copy_lanes_per_row(72) != 5 || mori_copy_lanes_per_row(0) != 1 ||
        mori_copy_lanes_per_row(1 << 20) != MORI_COPY_BLOCK_THREADS) {
        fail("lanes per row formula");
    }
    static_assert(sizeof(MoriCopyKernelRect) == 64, "a rect entry is 64 bytes");
    static_assert(sizeof(MoriCopyKernelArgs) == 64, "the args struct is 64 bytes");
}

// The fragmented shape (page size 1, runs of one page, one 256-byte head per decode rank): every
// rect is one row. Each lane group takes its own rows across rects, so every lane of every step
// works; copying each rect on its own kept 16 of 256 threads busy over 64 steps per tile. The
// count comes from the CPU shim, and the kernel's work split makes it the GPU's too.
void fragmented_shape_keeps_every_lane_busy() {
    const uint64_t rows = 4096, width = 256;
    std::vector<MoriCopyRect> rects;
    for (uint64_t i = 0; i < rows; i++) rects.push_back({2 * i * width, (3 * i + 1) * width, width, width, width, 1});
    // A dry run: the lanes are counted, no memory is touched (the bases only need alignment).
    uint8_t *base = reinterpret_cast<uint8_t *>(uintptr_t{1} << 20);
    const Table t = make_table(rects, {base}, {base});
    uint32_t grid_x = 0, grid_y = 0;
    mori_copy_grid(t.args.total_rows, t.args.rows_per_block, t.args.num_buffers, &grid_x, &grid_y);
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_lanes.dry_run = true;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, 1}, MoriDim3{MORI_COPY_BLOCK_THREADS, 1, 1}, t.args, 7);
    const MoriCpuLanes counted = mori_cpu_lanes;
    mori_cpu_lanes = MoriCpuLanes{};
    const uint64_t steps_per_tile = counted.slots / (uint64_t{grid_x} * MORI_COPY_BLOCK_THREADS);
    std::printf("kernel_test: one-row rects of 256 B: %.1f%% of lanes active, %" PRIu64 " steps per 64-row tile\n",
                100.0 * counted.utilisation(), steps_per_tile);
    if (counted.active != counted.slots || steps_per_tile != 4) {
        fail("one-row rects: " + std::to_string(counted.active) + " of " + std::to_string(counted.slots) +
             " lane steps active, " + std::to_string(steps_per_tile) + " steps per tile (want all, 4)");
    }
}

// Any page layout (section 7): every pair of two layouts with the pair plan's rects, whose
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
    grid_formula();
    fragmented_shape_keeps_every_lane_busy();
    unusual_tables();
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
