// The copy kernel's own source as a shared library for the CPU, with one C entry point that
// launches it (hip/cpu_shim.hpp: every thread of every block, in an order shuffled by `seed`).
// tests/hip_engine.rs builds it with c++ -shared and loads it with dlopen, so that its recording
// HIP runtime runs the real kernel when the engine launches it.

#define MORI_COPY_KERNEL_CPU
#include "../../hip/copy_kernel.hip"

extern "C" void mori_cpu_copy_kernel_launch(uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uint32_t block_x,
                                            uint32_t block_y, uint32_t block_z, const MoriCopyKernelArgs *args,
                                            uint64_t seed) {
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, grid_z}, MoriDim3{block_x, block_y, block_z}, *args,
                    seed);
}
