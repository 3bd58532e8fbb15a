// The copy kernel's own source as a shared library for the CPU, with C entry points that launch
// it (hip/cpu_shim.hpp: every thread of every block, in an order shuffled by `seed`) and report
// the launch's lane count. The HIP engine's tests (tests/gpu_engine.rs) build it with
// c++ -shared and load it with dlopen, so that their recording HIP runtime runs the real kernel
// when the engine launches it.

#define MORI_COPY_KERNEL_CPU
#define MORI_COPY_WIDE_ENTRY 1  // the wide entry too, for a recorder with a wide argument
#include "../../hip/copy_kernel.hip"

extern "C" void mori_cpu_copy_kernel_launch(uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uint32_t block_x,
                                            uint32_t block_y, uint32_t block_z, const MoriCopyKernelArgs *args,
                                            uint64_t seed) {
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_launch(mori_copy_kernel, MoriDim3{grid_x, grid_y, grid_z}, MoriDim3{block_x, block_y, block_z}, *args,
                    seed);
}

// The same for the wide entry (mori_copy_kernel_wide, a MoriCopyKernelWideArgs argument).
extern "C" void mori_cpu_copy_kernel_wide_launch(uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uint32_t block_x,
                                                 uint32_t block_y, uint32_t block_z,
                                                 const MoriCopyKernelWideArgs *args, uint64_t seed) {
    mori_cpu_lanes = MoriCpuLanes{};
    mori_cpu_launch(mori_copy_kernel_wide, MoriDim3{grid_x, grid_y, grid_z}, MoriDim3{block_x, block_y, block_z},
                    *args, seed);
}

// The (thread, step) slots of the last launch on this thread, and how many moved bytes.
extern "C" void mori_cpu_copy_kernel_lanes(uint64_t *slots, uint64_t *active) {
    *slots = mori_cpu_lanes.slots;
    *active = mori_cpu_lanes.active;
}
