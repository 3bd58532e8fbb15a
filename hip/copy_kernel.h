/* The batched copy kernel's ABI: what the host builds, where the kernel finds it, and how the
 * kernel is launched.
 *
 * One launch of `mori_copy_kernel` copies every (buffer, rect) of one call: for every buffer b
 * and every rect r, `height` rows of `width` bytes, row i read at
 * `src_bases[b] + src_offset + i * src_pitch` and written at `dst_bases[b] + dst_offset + i *
 * dst_pitch` (the rects are mori_tp_plan's, offsets relative to each buffer's base).
 *
 * THE WORK SPLIT. The host plans all of it, so that no thread searches:
 * - Rects become RUNS: consecutive rects with the same width, pitches, height and unit (the
 *   widest of 16, 8, 4, 2 or 1 bytes that every row start, the width and every buffer base
 *   allow). When a rect's height and its run's divide one another (at most
 *   MORI_COPY_MAX_RUN_SPLIT times), the taller are cut into rects of the smaller height, so that
 *   fragmented pages in runs of 1, 2, 3... pages form one run of one-page rects. A run's rows
 *   are numbered g = 0 .. rows - 1; row g is row g % height of rect first_rect + g / height.
 * - Each run is cut into TILES of at most MORI_COPY_TILE_UNITS units of one buffer: whole rows
 *   (rows_per_tile = MORI_COPY_TILE_UNITS / units rows), or, for a row of more units than that,
 *   column chunks of one row (col_chunks per row). Tiles are numbered across runs.
 * - Grid x walks tiles; grid y walks groups of buffers_per_block buffers. A block's thread t
 *   takes the tile's units t, t + blockDim.x, ..., MORI_COPY_SLOTS_PER_THREAD of them (unit i
 *   of a tile of C units per row is column i % C of its row i / C, so adjacent threads touch
 *   adjacent addresses), works out their offsets once, then copies them for every buffer of its
 *   group, several buffers' loads in flight before their stores. So a block reads its run and
 *   rect entries once and reuses them for all of its buffers, and a tile of one-row rects keeps
 *   every thread as busy as a tall rect does. Rows move in the run's unit (a 256-byte bf16 head
 *   in 16-byte loads and stores, a 72-byte fp8 head in 8-byte ones).
 *
 * No shared memory, no atomics, no barriers: threads are independent, so the same source also
 * runs on a CPU (hip/cpu_shim.hpp). hip/copy_table.hpp builds and decodes tables in C++; the Rust
 * side (src/backend/copy_kernel.rs) builds the same bytes (a test compares them).
 *
 * THE TABLE: 8-byte aligned, little-endian, at byte offsets the args give:
 *   [0, 8 * num_buffers)            source base address of each buffer (uint64)
 *   [8 * num_buffers, 16 * ...)     destination base address of each buffer (uint64)
 *   runs_at                         num_runs MoriCopyKernelRun entries (48 bytes each)
 *   tile_runs_at                    the run of each tile (uint32 each), when num_runs > 1
 *   rects_at                        num_rects rect offsets: (src, dst) as two uint32 each
 *                                   (8 bytes), or with MORI_COPY_WIDE_OFFSETS two uint64 each
 *                                   (16 bytes); either way shifted right by offset_shift bits
 * When it fits in MORI_COPY_INLINE_TABLE_BYTES it travels inside the kernel's argument
 * (`inline_table`, `table` = 0), so the call uploads nothing; on a CUDA 12.1+ driver one that fits
 * in MORI_COPY_WIDE_INLINE_TABLE_BYTES travels inside the wide entry's 32,760-byte argument
 * (MoriCopyKernelWideArgs, the same header); otherwise the host uploads it
 * (one hipMemcpyAsync into device memory, or any memory the kernel reaches) and `table` is its
 * address.
 *
 * THE LAUNCH: hipModuleLaunchKernel(function, grid.x, grid.y, 1, MORI_COPY_BLOCK_THREADS, 1, 1,
 * 0, stream, NULL, extra) with extra = {HIP_LAUNCH_PARAM_BUFFER_POINTER, &args,
 * HIP_LAUNCH_PARAM_BUFFER_SIZE, &size, HIP_LAUNCH_PARAM_END}, where args is a MoriCopyKernelArgs
 * and size = sizeof args (MORI_COPY_ARGS_BYTES): the struct is the whole kernel-argument buffer.
 * (`extra` rather than kernelParams because HIP 5.2's header still says kernelParams is not
 * implemented.) The wide entry launches the same way (cuLaunchKernel with CUDA's markers) with a
 * MoriCopyKernelWideArgs and size MORI_COPY_WIDE_ARGS_BYTES. Grid x = min(num_tiles, MORI_COPY_MAX_GRID_X), grid y = min(ceil(num_buffers /
 * buffers_per_block), MORI_COPY_MAX_GRID_Y), then within the launch's block limit
 * (mori_copy_fit, below: the persistent grid and the caller's SM budget); the kernel strides over
 * the rest, and any grid or smaller block copies the same bytes.
 *
 * Requirements: every row of every (buffer, rect) is device-accessible memory (device memory, a
 * peer's with peer access enabled, or host memory mapped into the device, such as
 * hipHostMalloc's); no destination byte is written twice or is also a source byte of the same
 * launch (threads run in no particular order, so such a byte may end as either copy leaves it).
 *
 * This header is plain C (and C++), usable from host code, device code and the CPU shim.
 */
#ifndef MORI_COPY_KERNEL_H
#define MORI_COPY_KERNEL_H

#include <stdint.h>

/* The kernel's symbol in the code object, for hipModuleGetFunction / cuModuleGetFunction. */
#define MORI_COPY_KERNEL_NAME "mori_copy_kernel"
/* The wide entry, the same kernel with a MoriCopyKernelWideArgs argument (CUDA 12.1+ drivers;
 * built into a module of its own, see copy_kernel.hip). */
#define MORI_COPY_WIDE_KERNEL_NAME "mori_copy_kernel_wide"

/* Threads per block; the kernel is compiled for at most this block size (launch bounds). */
#define MORI_COPY_BLOCK_THREADS 256u
/* Units of one tile each thread of a full block takes (its loads in flight per buffer). */
#define MORI_COPY_SLOTS_PER_THREAD 4u
/* Units of one buffer a tile holds: MORI_COPY_BLOCK_THREADS * MORI_COPY_SLOTS_PER_THREAD (16 KiB
 * of 16-byte units). */
#define MORI_COPY_TILE_UNITS 1024u
/* Grid limits the host applies; the kernel strides over tiles and buffer groups beyond them.
 * Grid y is capped at 65535 by the hardware; grid x is capped so that grid.x * block stays far
 * below 2^32 (AMD's limit on the threads of one dimension). */
#define MORI_COPY_MAX_GRID_X 1048576u
#define MORI_COPY_MAX_GRID_Y 65535u
/* Buffers a block copies its tile for: about tiles * buffers / MORI_COPY_TARGET_BLOCKS, within
 * [1, MORI_COPY_MAX_BUFFERS_PER_BLOCK] (mori_copy_buffers_per_block). 2048 blocks are about
 * one wave on a 304-CU MI300X and four or five on a 132-SM H200 (3-4 resident blocks of 256
 * threads per SM), so a partial last wave costs little; more buffers per block share one
 * block's reading of its run and rect entries. Host-side, so the same for every target. */
#define MORI_COPY_TARGET_BLOCKS 2048u
#define MORI_COPY_MAX_BUFFERS_PER_BLOCK 16u
/* A rect and its run are cut to the smaller of their heights when that makes at most this many
 * rects of each. */
#define MORI_COPY_MAX_RUN_SPLIT 64u
/* Limits the host keeps the entries within by cutting rects (never visible to a caller): row
 * width in bytes, rows of one run. */
#define MORI_COPY_MAX_WIDTH 1073741824u
#define MORI_COPY_MAX_RUN_ROWS 1073741824u
/* Bytes of the kernel's argument and of the table room inside it. */
#define MORI_COPY_ARGS_BYTES 4096u
#define MORI_COPY_INLINE_TABLE_BYTES 4032u
/* The same for the wide entry (MORI_COPY_WIDE_KERNEL_NAME): CUDA 12.1+ drivers take kernel
 * parameters of up to 32,764 bytes on sm_70 and newer (PTX ISA 8.1; CUDA C++ Programming Guide,
 * "Function Parameters"), so its table room is the largest multiple of 8 with the 64-byte header
 * within that: 32,696 bytes, 32,760 in all. HIP keeps 4 KiB. */
#define MORI_COPY_WIDE_ARGS_BYTES 32760u
#define MORI_COPY_WIDE_INLINE_TABLE_BYTES 32696u
/* Bytes of one run entry. */
#define MORI_COPY_RUN_BYTES 48u
/* A piece at least this wide whose unit is below 16 bytes, with every buffer base and both
 * pitches 16-byte aligned and its source and destination rows equally misaligned, is cut into a
 * head (up to the next 16-byte boundary), a body of 16-byte units and a tail; the bodies keep
 * their order, the heads and tails follow every other piece (so like rects' bodies still form
 * one run). An unaligned offset or odd width then costs one narrow strip, not the whole row. */
#define MORI_COPY_SPLIT_MIN_WIDTH 128u

/* args.flags: rect offsets are two uint64 (16 bytes per rect) rather than two uint32. */
#define MORI_COPY_WIDE_OFFSETS 1u

/* One run: rects of equal shape, copied in tiles. 48 bytes. */
typedef struct MoriCopyKernelRun {
    uint64_t src_pitch;     /* bytes between source rows of a rect (0 when height is 1) */
    uint64_t dst_pitch;     /* bytes between destination rows of a rect (0 when height is 1) */
    uint32_t first_rect;    /* index of its first rect in the rect offsets */
    uint32_t rows;          /* rows of the run: its rects times height */
    uint32_t height;        /* rows of each rect, >= 1 */
    uint32_t units;         /* units per row: width >> unit_shift, >= 1 */
    uint32_t rows_per_tile; /* rows of a tile: MORI_COPY_TILE_UNITS / units, or 1 */
    uint32_t col_chunks;    /* tiles per row: 1, or ceil(units / MORI_COPY_TILE_UNITS) */
    uint32_t first_tile;    /* tiles of the runs before it */
    uint32_t unit_shift;    /* log2 of the unit: 0 (bytes) to 4 (16 bytes) */
} MoriCopyKernelRun;

/* The 64-byte header of the kernel's argument, the same in both entries' argument structs. */
#define MORI_COPY_KERNEL_ARGS_HEADER                                                          \
    uint64_t table;             /* address of the table, or 0: it is inline_table */         \
    uint32_t table_bytes;       /* bytes of the table */                                      \
    uint32_t num_buffers;       /* buffer pairs */                                            \
    uint32_t buffers_per_block; /* buffers one block copies its tile for, >= 1 */             \
    uint32_t num_runs;                                                                        \
    uint32_t num_tiles;         /* tiles of all runs */                                       \
    uint32_t num_rects;         /* rect offsets in the table */                               \
    uint32_t runs_at;           /* byte offset of the runs in the table */                    \
    uint32_t tile_runs_at;      /* byte offset of the tiles' runs (when num_runs > 1) */      \
    uint32_t rects_at;          /* byte offset of the rect offsets */                         \
    uint32_t flags;             /* MORI_COPY_WIDE_OFFSETS */                                  \
    uint32_t offset_shift;      /* rect offsets are stored shifted right by this many bits */ \
    uint32_t reserved[3];       /* 0 */

/* The kernel's one parameter, passed by value: MORI_COPY_ARGS_BYTES bytes. */
typedef struct MoriCopyKernelArgs {
    MORI_COPY_KERNEL_ARGS_HEADER
    uint64_t inline_table[MORI_COPY_INLINE_TABLE_BYTES / 8]; /* the table when table is 0 */
} MoriCopyKernelArgs;

/* The wide entry's one parameter: the same header and MORI_COPY_WIDE_INLINE_TABLE_BYTES of table,
 * MORI_COPY_WIDE_ARGS_BYTES in all. */
typedef struct MoriCopyKernelWideArgs {
    MORI_COPY_KERNEL_ARGS_HEADER
    uint64_t inline_table[MORI_COPY_WIDE_INLINE_TABLE_BYTES / 8]; /* the table when table is 0 */
} MoriCopyKernelWideArgs;

/* Rows of a tile and tiles per row for rows of `units` units (>= 1). */
static inline uint32_t mori_copy_rows_per_tile(uint32_t units) {
    return units >= MORI_COPY_TILE_UNITS ? 1u : MORI_COPY_TILE_UNITS / units;
}

static inline uint32_t mori_copy_col_chunks(uint32_t units) {
    return units <= MORI_COPY_TILE_UNITS ? 1u : (units + MORI_COPY_TILE_UNITS - 1) / MORI_COPY_TILE_UNITS;
}

/* Buffers per block for `tiles` tiles of `buffers` buffers on about `target` blocks (>= 1): each
 * block copies its tile for at least one and at most MORI_COPY_MAX_BUFFERS_PER_BLOCK buffers:
 * clamp(tiles * buffers / target, 1, min(buffers, 16)). */
static inline uint32_t mori_copy_buffers_per_block_for(uint64_t tiles, uint64_t buffers, uint64_t target) {
    uint64_t per = tiles * buffers / (target == 0 ? 1 : target);
    uint64_t most = buffers < MORI_COPY_MAX_BUFFERS_PER_BLOCK ? buffers : MORI_COPY_MAX_BUFFERS_PER_BLOCK;
    if (per > most) {
        per = most;
    }
    return (uint32_t)(per < 1 ? 1 : per);
}

/* The builder's buffers per block: about MORI_COPY_TARGET_BLOCKS blocks. */
static inline uint32_t mori_copy_buffers_per_block(uint64_t tiles, uint64_t buffers) {
    return mori_copy_buffers_per_block_for(tiles, buffers, MORI_COPY_TARGET_BLOCKS);
}

/* The grid for these args: x over tiles, y over buffer groups, within the caps. Nothing to copy
 * gives 0: do not launch. */
static inline void mori_copy_grid(const MoriCopyKernelArgs *args, uint32_t *grid_x, uint32_t *grid_y) {
    const uint64_t per = args->buffers_per_block == 0 ? 1 : args->buffers_per_block;
    const uint64_t groups = (args->num_buffers + per - 1) / per;
    *grid_x = args->num_tiles > MORI_COPY_MAX_GRID_X ? MORI_COPY_MAX_GRID_X : args->num_tiles;
    *grid_y = (uint32_t)(groups > MORI_COPY_MAX_GRID_Y ? MORI_COPY_MAX_GRID_Y : groups);
    if (*grid_x == 0 || *grid_y == 0) {
        *grid_x = *grid_y = 0;
    }
}

/* THE LAUNCH GEOMETRY. The grid of a launch of at most `max_blocks` blocks (0: no limit beyond
 * the caps above), which may change args->buffers_per_block: the persistent grid (max_blocks =
 * the blocks the device runs at once, its SM or CU count times the kernel's occupancy, computed
 * once per device) and the caller's SM budget (MORI_SEND_MAX_BLOCKS) both come here, the
 * smaller of the two. With a limit below MORI_COPY_TARGET_BLOCKS, buffers per block aim at
 * max_blocks blocks instead (so a small grid takes more buffers per block, and each block's
 * software-pipelined buffer loop is longer); then, when grid x * grid y still exceeds the limit,
 * grid y (buffer groups) is cut to the limit if it alone reaches it (grid x = 1), else grid x to
 * limit / grid y. The kernel strides over every tile and buffer group beyond the grid, so the
 * bytes are the same for any limit; grid x * grid y <= max_blocks always holds. */
static inline void mori_copy_fit(MoriCopyKernelArgs *args, uint32_t max_blocks, uint32_t *grid_x, uint32_t *grid_y) {
    if (max_blocks != 0 && max_blocks < MORI_COPY_TARGET_BLOCKS) {
        args->buffers_per_block = mori_copy_buffers_per_block_for(args->num_tiles, args->num_buffers, max_blocks);
    }
    mori_copy_grid(args, grid_x, grid_y);
    if (max_blocks != 0 && *grid_x != 0 && (uint64_t)*grid_x * *grid_y > max_blocks) {
        if (*grid_y >= max_blocks) {
            *grid_y = max_blocks;
            *grid_x = 1;
        } else {
            *grid_x = max_blocks / *grid_y;
        }
    }
}

#endif /* MORI_COPY_KERNEL_H */
