/* The batched copy kernel's ABI: what the host uploads and how it launches the kernel.
 *
 * One launch of `mori_copy_kernel` copies every (buffer, rect) of one call: for every buffer b
 * and every rect r, `height` rows of `width` bytes, row i read at
 * `src_bases[b] + src_offset + i * src_pitch` and written at `dst_bases[b] + dst_offset + i *
 * dst_pitch` (the rects are mori_tp_plan's, offsets relative to each buffer's base).
 *
 * The host builds, in ONE device allocation uploaded with ONE hipMemcpyAsync:
 *   [num_rects x MoriCopyKernelRect][num_buffers x uint64 source bases][num_buffers x uint64
 *   destination bases]
 * (64 * num_rects + 16 * num_buffers bytes; every part stays 8-byte aligned), then calls
 * hipModuleLaunchKernel(function, grid.x, grid.y, 1, MORI_COPY_BLOCK_THREADS, 1, 1, 0, stream,
 * NULL, extra) with extra = {HIP_LAUNCH_PARAM_BUFFER_POINTER, &args, HIP_LAUNCH_PARAM_BUFFER_SIZE,
 * &size, HIP_LAUNCH_PARAM_END}, where args is a MoriCopyKernelArgs whose pointers point into that
 * allocation and size = sizeof args: the struct is the whole kernel-argument buffer. (`extra`
 * rather than kernelParams because HIP 5.2's header still says kernelParams is not implemented;
 * `extra` works with every HIP version.) The grid is any size; mori_copy_grid below gives the
 * one that covers the work with one block per tile, and the kernel strides over the rest when a
 * dimension is capped.
 *
 * Requirements: the rects are in the order of their first_row, which is the prefix sum of the
 * heights before them; every row of every (buffer, rect) is device-accessible memory (device
 * memory, a peer's with peer access enabled, or host memory mapped into the device, such as
 * hipHostMalloc's); no destination byte is written twice or is also a source byte of the same
 * launch (threads run in no particular order, so such a byte may end as either copy leaves it).
 *
 * Work split: the rows of all rects, in order, form one flattened list of total_rows rows. Grid
 * x walks tiles of rows_per_block consecutive rows of that list, grid y walks buffers. A block's
 * threads form groups of lanes_per_row lanes (the blockDim.x / lanes_per_row whole groups; the
 * threads left over idle), and group g copies rows g, g + groups, g + 2 * groups, ... of the tile,
 * whichever rects they belong to: one-row rects keep every group busy as well as tall ones do.
 * A group finds its row's rect by binary search of first_row, and its lanes copy the row with
 * the widest of 16, 8 or 4-byte loads and stores that both row starts and the width allow (bytes
 * otherwise), lane i taking units i, i + lanes, ... No shared memory, no atomics, no barriers:
 * threads are independent, so the same source also runs on a CPU (hip/cpu_shim.hpp).
 *
 * This header is plain C (and C++), usable from host code, device code and the CPU shim. The
 * Rust side (src/backend/copy_kernel.rs) mirrors these structs and formulas; keep them in sync.
 */
#ifndef MORI_COPY_KERNEL_H
#define MORI_COPY_KERNEL_H

#include <stdint.h>

/* The kernel's symbol in the code object, for hipModuleGetFunction. */
#define MORI_COPY_KERNEL_NAME "mori_copy_kernel"

/* Threads per block; the kernel is compiled for exactly this block size (launch bounds). */
#define MORI_COPY_BLOCK_THREADS 256u
/* Grid limits the host applies; the kernel strides over tiles and buffers beyond them. Grid y
 * is capped at 65535 by the hardware; grid x is capped so that grid.x * block stays far below
 * 2^32 (AMD's limit on the threads of one dimension). */
#define MORI_COPY_MAX_GRID_X 1048576u
#define MORI_COPY_MAX_GRID_Y 65535u
/* A tile holds about this many bytes of one buffer (whole rows), enough rows of a narrow slice
 * to keep all threads of a block busy. */
#define MORI_COPY_TILE_BYTES 16384u
#define MORI_COPY_MAX_ROWS_PER_BLOCK 1024u

/* One rect of the table: 8 x uint64 = 64 bytes. */
typedef struct MoriCopyKernelRect {
    uint64_t src_offset; /* first source row, relative to each source base */
    uint64_t dst_offset; /* first destination row, relative to each destination base */
    uint64_t src_pitch;  /* bytes between source rows */
    uint64_t dst_pitch;  /* bytes between destination rows */
    uint64_t width;      /* bytes per row */
    uint64_t height;     /* rows */
    uint64_t first_row;  /* rows of all rects before this one: the prefix sum of heights */
    uint64_t reserved;   /* 0; pads the entry to 64 bytes */
} MoriCopyKernelRect;

/* The kernel's one parameter, passed by value (8 x 8 = 64 bytes). */
typedef struct MoriCopyKernelArgs {
    const MoriCopyKernelRect *rects; /* num_rects entries, device-accessible */
    const uint64_t *src_bases;       /* num_buffers source base addresses, device-accessible */
    const uint64_t *dst_bases;       /* num_buffers destination base addresses, device-accessible */
    uint64_t num_rects;
    uint64_t num_buffers;
    uint64_t total_rows;     /* sum of all heights = first_row + height of the last rect */
    uint64_t rows_per_block; /* rows of one tile, >= 1 (mori_copy_rows_per_block) */
    uint64_t lanes_per_row;  /* threads per row, >= 1 (mori_copy_lanes_per_row); capped at blockDim.x */
} MoriCopyKernelArgs;

/* Rows per tile for rects whose widest row is `max_width` bytes:
 * clamp(MORI_COPY_TILE_BYTES / max_width, 1, MORI_COPY_MAX_ROWS_PER_BLOCK). */
static inline uint64_t mori_copy_rows_per_block(uint64_t max_width) {
    uint64_t rows = max_width == 0 ? MORI_COPY_MAX_ROWS_PER_BLOCK : MORI_COPY_TILE_BYTES / max_width;
    if (rows < 1) {
        rows = 1;
    }
    return rows > MORI_COPY_MAX_ROWS_PER_BLOCK ? MORI_COPY_MAX_ROWS_PER_BLOCK : rows;
}

/* Threads per row for rects whose widest row is `max_width` bytes: enough for one 16-byte unit
 * each, clamp(ceil(max_width / 16), 1, MORI_COPY_BLOCK_THREADS). A row that moves in narrower
 * units gives each lane several. */
static inline uint64_t mori_copy_lanes_per_row(uint64_t max_width) {
    uint64_t lanes = max_width / 16 + (max_width % 16 != 0);
    if (lanes < 1) {
        lanes = 1;
    }
    return lanes > MORI_COPY_BLOCK_THREADS ? MORI_COPY_BLOCK_THREADS : lanes;
}

/* The grid that gives each (tile, buffer) its own block, within the caps:
 * x = min(ceil(total_rows / rows_per_block), MORI_COPY_MAX_GRID_X),
 * y = min(num_buffers, MORI_COPY_MAX_GRID_Y). Nothing to copy gives 0: do not launch. */
static inline void mori_copy_grid(uint64_t total_rows, uint64_t rows_per_block, uint64_t num_buffers,
                                  uint32_t *grid_x, uint32_t *grid_y) {
    uint64_t tiles = rows_per_block == 0 ? 0 : (total_rows + rows_per_block - 1) / rows_per_block;
    *grid_x = (uint32_t)(tiles > MORI_COPY_MAX_GRID_X ? MORI_COPY_MAX_GRID_X : tiles);
    *grid_y = (uint32_t)(num_buffers > MORI_COPY_MAX_GRID_Y ? MORI_COPY_MAX_GRID_Y : num_buffers);
    if (*grid_x == 0 || *grid_y == 0) {
        *grid_x = *grid_y = 0;
    }
}

#endif /* MORI_COPY_KERNEL_H */
