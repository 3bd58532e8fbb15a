// The few CUDA names hip/copy_kernel.hip uses, for clang compiling it as CUDA device code without
// a CUDA toolkit (clang -x cuda --cuda-device-only -nocudainc -nocudalib; build.rs does this for
// the `cuda` feature). With -nocudainc clang includes none of CUDA's headers, which is where
// threadIdx and the qualifier macros normally come from; clang itself knows the attributes and
// the NVVM special-register builtins below. Nothing here is CUDA's code: each line is the
// attribute or builtin that clang documents for it.
#pragma once

#if !defined(__clang__) || !defined(__CUDA__)
#error "cuda_stand_in.h is for clang compiling CUDA (-x cuda -nocudainc)"
#endif

#include <stdint.h>

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))

// What CUDA calls dim3 / uint3: three unsigned coordinates.
struct MoriCudaIndex {
    unsigned x, y, z;
};

// The thread's coordinates and the launch's dimensions, read from the PTX special registers
// (%tid, %ctaid, %ntid, %nctaid) each time they are used; the reads have no side effects, so the
// unused ones are dropped.
#define threadIdx                                                                                         \
    (MoriCudaIndex{static_cast<unsigned>(__nvvm_read_ptx_sreg_tid_x()),                                   \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_tid_y()),                                   \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_tid_z())})
#define blockIdx                                                                                          \
    (MoriCudaIndex{static_cast<unsigned>(__nvvm_read_ptx_sreg_ctaid_x()),                                 \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_ctaid_y()),                                 \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_ctaid_z())})
#define blockDim                                                                                          \
    (MoriCudaIndex{static_cast<unsigned>(__nvvm_read_ptx_sreg_ntid_x()),                                  \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_ntid_y()),                                  \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_ntid_z())})
#define gridDim                                                                                           \
    (MoriCudaIndex{static_cast<unsigned>(__nvvm_read_ptx_sreg_nctaid_x()),                                \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_nctaid_y()),                                \
                   static_cast<unsigned>(__nvvm_read_ptx_sreg_nctaid_z())})
