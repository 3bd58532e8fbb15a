// The copy kernel's active-lane utilisation for a plan, for hip/bench: the share of the
// (thread, step) slots of the kernel's tiles that move bytes. It runs the kernel's own source
// (hip/copy_kernel.hip) through the CPU shim as a dry run (lanes counted, no memory touched)
// on the table and grid the library builds for one buffer pair. The count depends only on the
// kernel's work split, never on timing, so it is the GPU's too.
//
// Built with the host C++ compiler (the shim is not HIP): see hip/Makefile.

#define MORI_COPY_KERNEL_CPU
#include "copy_kernel.hip"
#include "lane_count.h"

extern "C" double mori_copy_lane_utilisation(const MoriCopyRect *rects, size_t num_rects, uint64_t src_base,
                                             uint64_t dst_base) {
    std::vector<MoriCopyKernelRect> table(num_rects);
    uint64_t rows = 0, max_width = 0;
    for (size_t i = 0; i < num_rects; i++) {
        const MoriCopyRect &r = rects[i];
        table[i] = {r.src_offset, r.dst_offset, r.src_pitch, r.dst_pitch, r.width, r.height, rows, 0};
        rows += r.height;
        max_width = r.width > max_width ? r.width : max_width;
    }
    const uint64_t src_bases[1] = {src_base}, dst_bases[1] = {dst_base};
    const MoriCopyKernelArgs args = {table.data(), src_bases, dst_bases, num_rects, 1, rows,
                                     mori_copy_rows_per_block(max_width), mori_copy_lanes_per_row(max_width)};
    uint32_t grid_x = 0, grid_y = 0;
    mori_copy_grid(args.total_rows, args.rows_per_block, args.num_buffers, &grid_x, &grid_y);
    if (grid_x == 0) {
        return 0.0;
    }
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_lanes.dry_run = true;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, 1}, MoriDim3{MORI_COPY_BLOCK_THREADS, 1, 1}, args, 1);
    const double utilisation = mori_cpu_lanes.utilisation();
    mori_cpu_lanes = MoriCpuLanes{};
    return utilisation;
}
