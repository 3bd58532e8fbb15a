// For hip/bench: the copy kernel's active-lane utilisation for a plan, the share of the
// (thread, slot) pairs of the kernel's tiles that move bytes, and the bytes of its table a call
// uploads. The first runs the kernel's own source (hip/copy_kernel.hip) through the CPU shim as a
// dry run (lanes counted, no buffer touched) on the table and grid hip/copy_table.hpp builds for
// one buffer pair, as the library does. The count depends only on the kernel's work split, never
// on timing, so it is the GPU's too.
//
// Built with the host C++ compiler (the shim is not HIP): see hip/Makefile.

#define MORI_COPY_KERNEL_CPU
#include "copy_kernel.hip"
#include "copy_table.hpp"
#include "lane_count.h"

extern "C" double mori_copy_lane_utilisation(const MoriCopyRect *rects, size_t num_rects, uint64_t src_base,
                                             uint64_t dst_base) {
    mori_copy_table::Built built;
    if (!mori_copy_table::build(rects, num_rects, &src_base, &dst_base, 1, built) || built.grid_x == 0) {
        return 0.0;
    }
    std::vector<uint64_t> words((built.bytes.size() + 7) / 8);
    std::memcpy(words.data(), built.bytes.data(), built.bytes.size());
    if (!built.inline_table) {
        built.args.table = reinterpret_cast<uint64_t>(words.data());
    }
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_lanes.dry_run = true;
    mori_cpu_launch(mori_copy_kernel, MoriDim3{built.grid_x, built.grid_y, 1}, MoriDim3{MORI_COPY_BLOCK_THREADS, 1, 1},
                    built.args, 1);
    const double utilisation = mori_cpu_lanes.utilisation();
    mori_cpu_lanes = MoriCpuLanes{};
    return utilisation;
}

extern "C" uint64_t mori_copy_table_upload_bytes(const MoriCopyRect *rects, size_t num_rects, const uint64_t *src_bases,
                                                 const uint64_t *dst_bases, size_t num_buffers) {
    mori_copy_table::Built built;
    if (!mori_copy_table::build(rects, num_rects, src_bases, dst_bases, num_buffers, built) || built.inline_table) {
        return 0;
    }
    return built.bytes.size();
}
