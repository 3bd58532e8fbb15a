/* hip/lane_count.cpp's entry point, for hip/bench (HIP) to call into the host-compiled CPU shim. */
#ifndef MORI_LANE_COUNT_H
#define MORI_LANE_COUNT_H

#include <stddef.h>
#include <stdint.h>

#include "mori_tp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The share of the copy kernel's (thread, slot) pairs that move bytes when it copies `rects`
 * (mori_tp_plan's) for one buffer pair at these base addresses (only their alignment matters):
 * 0 when there is nothing to copy. */
double mori_copy_lane_utilisation(const MoriCopyRect *rects, size_t num_rects, uint64_t src_base, uint64_t dst_base);

/* Bytes of the kernel's table that a call with these rects and buffer pairs uploads: 0 when the
 * table travels inside the kernel's argument (hip/copy_table.hpp builds the library's bytes). */
uint64_t mori_copy_table_upload_bytes(const MoriCopyRect *rects, size_t num_rects, const uint64_t *src_bases,
                                      const uint64_t *dst_bases, size_t num_buffers);

#ifdef __cplusplus
}
#endif

#endif /* MORI_LANE_COUNT_H */
