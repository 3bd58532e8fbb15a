// The copy kernel's table in C++ (host code only): the builder the C++ tests and hip/bench use,
// and the decoder the stand-in runtime (tests/fake_hip) uses to check every row a launch
// touches. src/backend/copy_kernel.rs builds the same bytes for the library; a unit test builds
// both from the same rects and compares them byte for byte. hip/copy_kernel.h describes the
// format; the steps below are its rules.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "copy_kernel.h"

namespace mori_copy_table {

// A rect as mori_tp_plan gives it (MoriCopyRect's fields, in its order).
struct Rect {
    uint64_t src_offset, dst_offset, src_pitch, dst_pitch, width, height;
};

// A built table: the kernel's argument (table = 0: `inline_table` holds the table; otherwise set
// `table` to the address of a copy of `bytes`) and the launch grid.
struct Built {
    MoriCopyKernelArgs args;
    std::vector<uint8_t> bytes;  // the table, table_bytes long
    bool inline_table = false;
    uint32_t grid_x = 0, grid_y = 0;
};

inline uint32_t trailing_zeros(uint64_t v) {
    uint32_t n = 0;
    if (v == 0) {
        return 64;
    }
    while ((v & 1) == 0) {
        v >>= 1;
        n++;
    }
    return n;
}

namespace detail {

struct Piece {
    uint64_t src, dst, src_pitch, dst_pitch, width, height;
    uint32_t unit_shift;
};

struct Run {
    uint64_t src_pitch, dst_pitch, width, height, rows;
    uint32_t unit_shift;
    uint64_t first_rect;
};

inline void put_u32(std::vector<uint8_t> &b, size_t at, uint32_t v) {
    for (int i = 0; i < 4; i++) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

inline void put_u64(std::vector<uint8_t> &b, size_t at, uint64_t v) {
    for (int i = 0; i < 8; i++) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

inline uint64_t get_u64(const uint8_t *b, size_t at) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[at + i];
    return v;
}

inline uint32_t get_u32(const uint8_t *b, size_t at) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | b[at + i];
    return v;
}

}  // namespace detail

// Builds the table of `rects` (any type with MoriCopyRect's six fields) for the buffer pairs
// (src_bases[b], dst_bases[b]). False, with the reason in *why, when a count exceeds its 32-bit
// field (a table of 4 GiB or more, 2^32 tiles, buffers or rects).
template <class R>
bool build(const R *rects, size_t num_rects, const uint64_t *src_bases, const uint64_t *dst_bases, size_t num_buffers,
           Built &out, std::string *why = nullptr) {
    using detail::Piece;
    using detail::Run;
    auto fail = [&](const std::string &what) {
        if (why != nullptr) *why = what;
        return false;
    };
    if (num_buffers > UINT32_MAX) return fail("more than 2^32 - 1 buffers");
    uint64_t bases = 0;
    for (size_t b = 0; b < num_buffers; b++) bases |= src_bases[b] | dst_bases[b];

    // 1. Pieces: no empty rects, rows of at most MORI_COPY_MAX_WIDTH bytes, at most
    //    MORI_COPY_MAX_RUN_ROWS rows, pitches 0 for one row, and each piece's unit; a piece
    //    equally misaligned on both sides is cut into head, 16-byte body and tail
    //    (MORI_COPY_SPLIT_MIN_WIDTH), the heads and tails after every other piece.
    std::vector<Piece> pieces, edges;
    for (size_t i = 0; i < num_rects; i++) {
        const R &r = rects[i];
        if (r.width == 0 || r.height == 0) continue;
        for (uint64_t row = 0; row < r.height; row += MORI_COPY_MAX_RUN_ROWS) {
            const uint64_t height = r.height - row < MORI_COPY_MAX_RUN_ROWS ? r.height - row : MORI_COPY_MAX_RUN_ROWS;
            for (uint64_t col = 0; col < r.width; col += MORI_COPY_MAX_WIDTH) {
                Piece p;
                p.src = r.src_offset + row * r.src_pitch + col;
                p.dst = r.dst_offset + row * r.dst_pitch + col;
                p.src_pitch = height == 1 ? 0 : r.src_pitch;
                p.dst_pitch = height == 1 ? 0 : r.dst_pitch;
                p.width = r.width - col < MORI_COPY_MAX_WIDTH ? r.width - col : MORI_COPY_MAX_WIDTH;
                p.height = height;
                auto with = [&](uint64_t src, uint64_t dst, uint64_t width) {
                    Piece q = p;
                    q.src = src;
                    q.dst = dst;
                    q.width = width;
                    const uint32_t shift = trailing_zeros(bases | width | src | dst | q.src_pitch | q.dst_pitch);
                    q.unit_shift = shift < 4 ? shift : 4;
                    return q;
                };
                const Piece whole = with(p.src, p.dst, p.width);
                const uint64_t head = (16 - p.src % 16) % 16;
                if (whole.unit_shift < 4 && p.width >= MORI_COPY_SPLIT_MIN_WIDTH && bases % 16 == 0 &&
                    (p.src_pitch | p.dst_pitch) % 16 == 0 && p.src % 16 == p.dst % 16) {
                    const uint64_t body = (p.width - head) & ~uint64_t{15};
                    const uint64_t tail = p.width - head - body;
                    pieces.push_back(with(p.src + head, p.dst + head, body));
                    if (head > 0) edges.push_back(with(p.src, p.dst, head));
                    if (tail > 0) edges.push_back(with(p.src + head + body, p.dst + head + body, tail));
                } else {
                    pieces.push_back(whole);
                }
            }
        }
    }
    pieces.insert(pieces.end(), edges.begin(), edges.end());

    // 2. Runs: a piece joins the run before it when it has the run's width and unit and one
    //    height divides the other at most MORI_COPY_MAX_RUN_SPLIT times: the taller side is cut
    //    into rects of the smaller height (the run's rects, retroactively, when the piece is the
    //    shorter), and for a height above one row their pitches must agree.
    std::vector<Run> runs;
    std::vector<uint64_t> offsets;  // (src, dst) of every rect, in run order
    for (const Piece &p : pieces) {
        uint64_t height = 0;  // 0: a run of its own
        if (!runs.empty()) {
            const Run &run = runs.back();
            const bool same =
                p.width == run.width && p.unit_shift == run.unit_shift && run.rows + p.height <= MORI_COPY_MAX_RUN_ROWS;
            const bool pitches = p.src_pitch == run.src_pitch && p.dst_pitch == run.dst_pitch;
            if (!same) {
                height = 0;
            } else if (p.height % run.height == 0 && p.height / run.height <= MORI_COPY_MAX_RUN_SPLIT &&
                       (run.height == 1 || pitches)) {
                height = run.height;
            } else if (run.height % p.height == 0 && run.height / p.height <= MORI_COPY_MAX_RUN_SPLIT &&
                       (p.height == 1 || pitches)) {
                height = p.height;
            }
        }
        if (height == 0) {
            runs.push_back(Run{p.src_pitch, p.dst_pitch, p.width, p.height, p.height, p.unit_shift,
                               offsets.size() / 2});
            offsets.push_back(p.src);
            offsets.push_back(p.dst);
            continue;
        }
        Run &run = runs.back();
        if (height < run.height) {
            // Cut the run's rects into rects of the piece's height.
            const uint64_t k = run.height / height;
            std::vector<uint64_t> cut;
            for (size_t i = 2 * size_t{run.first_rect}; i < offsets.size(); i += 2) {
                for (uint64_t j = 0; j < k; j++) {
                    cut.push_back(offsets[i] + j * height * run.src_pitch);
                    cut.push_back(offsets[i + 1] + j * height * run.dst_pitch);
                }
            }
            offsets.resize(2 * size_t{run.first_rect});
            offsets.insert(offsets.end(), cut.begin(), cut.end());
            run.height = height;
            if (height == 1) {
                run.src_pitch = run.dst_pitch = 0;
            }
        }
        for (uint64_t j = 0; j < p.height / height; j++) {
            offsets.push_back(p.src + j * height * p.src_pitch);
            offsets.push_back(p.dst + j * height * p.dst_pitch);
        }
        run.rows += p.height;
    }
    const uint64_t num_table_rects = offsets.size() / 2;
    if (num_table_rects > UINT32_MAX) return fail("more than 2^32 - 1 rects");

    // 3. Offsets: shifted right by their common trailing zeros; two uint32 when they all fit.
    uint64_t all = 0;
    for (uint64_t o : offsets) all |= o;
    const uint32_t offset_shift = all == 0 ? 0 : trailing_zeros(all);
    bool wide = false;
    for (uint64_t o : offsets) wide |= (o >> offset_shift) > UINT32_MAX;

    // 4. Tiles of each run, numbered across runs.
    uint64_t tiles = 0;
    std::vector<uint64_t> first_tiles;
    for (const Run &run : runs) {
        const uint32_t units = static_cast<uint32_t>(run.width >> run.unit_shift);
        const uint64_t rows_per_tile = mori_copy_rows_per_tile(units);
        first_tiles.push_back(tiles);
        tiles += (run.rows + rows_per_tile - 1) / rows_per_tile * mori_copy_col_chunks(units);
        if (tiles > UINT32_MAX) return fail("more than 2^32 - 1 tiles");
    }

    // 5. The layout: bases, runs, the tiles' runs (more than one run), rect offsets.
    const uint64_t runs_at = 16 * uint64_t{num_buffers};
    const uint64_t tile_runs_at = runs_at + MORI_COPY_RUN_BYTES * runs.size();
    const uint64_t tile_runs_bytes = runs.size() > 1 ? (4 * tiles + 7) / 8 * 8 : 0;
    const uint64_t rects_at = tile_runs_at + tile_runs_bytes;
    const uint64_t table_bytes = rects_at + (wide ? 16 : 8) * num_table_rects;
    if (table_bytes > UINT32_MAX) return fail("a table of " + std::to_string(table_bytes) + " bytes (4 GiB or more)");

    std::vector<uint8_t> &b = out.bytes;
    b.assign(table_bytes, 0);
    for (size_t i = 0; i < num_buffers; i++) {
        detail::put_u64(b, 8 * i, src_bases[i]);
        detail::put_u64(b, 8 * (num_buffers + i), dst_bases[i]);
    }
    for (size_t i = 0; i < runs.size(); i++) {
        const Run &run = runs[i];
        const uint32_t units = static_cast<uint32_t>(run.width >> run.unit_shift);
        const size_t at = runs_at + MORI_COPY_RUN_BYTES * i;
        detail::put_u64(b, at, run.src_pitch);
        detail::put_u64(b, at + 8, run.dst_pitch);
        detail::put_u32(b, at + 16, static_cast<uint32_t>(run.first_rect));
        detail::put_u32(b, at + 20, static_cast<uint32_t>(run.rows));
        detail::put_u32(b, at + 24, static_cast<uint32_t>(run.height));
        detail::put_u32(b, at + 28, units);
        detail::put_u32(b, at + 32, mori_copy_rows_per_tile(units));
        detail::put_u32(b, at + 36, mori_copy_col_chunks(units));
        detail::put_u32(b, at + 40, static_cast<uint32_t>(first_tiles[i]));
        detail::put_u32(b, at + 44, run.unit_shift);
        if (runs.size() > 1) {
            const uint64_t end = i + 1 < runs.size() ? first_tiles[i + 1] : tiles;
            for (uint64_t t = first_tiles[i]; t < end; t++) detail::put_u32(b, tile_runs_at + 4 * t, static_cast<uint32_t>(i));
        }
    }
    for (uint64_t i = 0; i < num_table_rects; i++) {
        const uint64_t src = offsets[2 * i] >> offset_shift, dst = offsets[2 * i + 1] >> offset_shift;
        if (wide) {
            detail::put_u64(b, rects_at + 16 * i, src);
            detail::put_u64(b, rects_at + 16 * i + 8, dst);
        } else {
            detail::put_u64(b, rects_at + 8 * i, src | dst << 32);
        }
    }

    MoriCopyKernelArgs &a = out.args;
    std::memset(&a, 0, sizeof a);
    a.table = 0;
    a.table_bytes = static_cast<uint32_t>(table_bytes);
    a.num_buffers = static_cast<uint32_t>(num_buffers);
    a.buffers_per_block = mori_copy_buffers_per_block(tiles, num_buffers);
    a.num_runs = static_cast<uint32_t>(runs.size());
    a.num_tiles = static_cast<uint32_t>(tiles);
    a.num_rects = static_cast<uint32_t>(num_table_rects);
    a.runs_at = static_cast<uint32_t>(runs_at);
    a.tile_runs_at = static_cast<uint32_t>(tile_runs_at);
    a.rects_at = static_cast<uint32_t>(rects_at);
    a.flags = wide ? MORI_COPY_WIDE_OFFSETS : 0;
    a.offset_shift = offset_shift;
    out.inline_table = table_bytes <= MORI_COPY_INLINE_TABLE_BYTES;
    if (out.inline_table) std::memcpy(a.inline_table, b.data(), b.size());
    mori_copy_grid(&a, &out.grid_x, &out.grid_y);
    return true;
}

// Calls f(src_base, dst_base, src_offset, dst_offset, src_pitch, dst_pitch, width, height) for
// every (buffer, rect) of a table as the kernel reads it: `table` is its bytes (args.table_bytes
// of them; for an inline table, args.inline_table). The caller checks the table lies where the
// kernel reaches first.
template <class F>
void for_each_rect(const MoriCopyKernelArgs &a, const uint8_t *table, F f) {
    using detail::get_u32;
    using detail::get_u64;
    for (uint32_t run = 0; run < a.num_runs; run++) {
        const size_t at = a.runs_at + size_t{MORI_COPY_RUN_BYTES} * run;
        const uint64_t src_pitch = get_u64(table, at), dst_pitch = get_u64(table, at + 8);
        const uint32_t first_rect = get_u32(table, at + 16), rows = get_u32(table, at + 20);
        const uint32_t height = get_u32(table, at + 24), units = get_u32(table, at + 28);
        const uint32_t unit_shift = get_u32(table, at + 44);
        for (uint32_t i = 0; height != 0 && i < rows / height; i++) {
            const uint64_t rect = uint64_t{first_rect} + i;
            uint64_t src, dst;
            if (a.flags & MORI_COPY_WIDE_OFFSETS) {
                src = get_u64(table, a.rects_at + 16 * rect);
                dst = get_u64(table, a.rects_at + 16 * rect + 8);
            } else {
                const uint64_t both = get_u64(table, a.rects_at + 8 * rect);
                src = both & 0xffffffffu;
                dst = both >> 32;
            }
            for (uint32_t b = 0; b < a.num_buffers; b++) {
                f(get_u64(table, 8 * size_t{b}), get_u64(table, 8 * (size_t{a.num_buffers} + b)), src << a.offset_shift,
                  dst << a.offset_shift, src_pitch, dst_pitch, uint64_t{units} << unit_shift, uint64_t{height});
            }
        }
    }
}

}  // namespace mori_copy_table
