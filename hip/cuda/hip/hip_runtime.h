// The HIP runtime names that hip/device_test.cpp, hip/bench.cpp and hip/common.hpp use, as the
// CUDA runtime's, so that the same programs build with nvcc for NVIDIA GPUs:
//
//   nvcc -x cu -std=c++17 -I include -I hip/cuda -I hip hip/device_test.cpp ...
//
// (-I hip/cuda makes `#include <hip/hip_runtime.h>` find this file; hip/device-check.sh builds
// them so). Each name maps to the CUDA runtime function or constant of the same meaning and
// arguments (CUDA Runtime API reference); the programs use nothing else of HIP. It also tells
// the programs which mori-tp backend to request (MORI_TP_DEVICE_BACKEND_CUDA: MORI_BACKEND_CUDA)
// and that the device's architecture is major.minor, not a gcnArchName.
#pragma once

#include <cuda_runtime.h>

#define MORI_TP_DEVICE_BACKEND_CUDA 1

// Errors.
#define hipError_t cudaError_t
#define hipSuccess cudaSuccess
#define hipErrorPeerAccessAlreadyEnabled cudaErrorPeerAccessAlreadyEnabled
#define hipGetErrorName cudaGetErrorName

// Devices.
#define hipGetDeviceCount cudaGetDeviceCount
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipDeviceProp_t cudaDeviceProp
#define hipGetDeviceProperties cudaGetDeviceProperties
#define hipDeviceSynchronize cudaDeviceSynchronize
#define hipDeviceCanAccessPeer cudaDeviceCanAccessPeer
#define hipDeviceEnablePeerAccess cudaDeviceEnablePeerAccess

// Streams and events.
#define hipStream_t cudaStream_t
#define hipStreamCreate cudaStreamCreate
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipStreamAddCallback cudaStreamAddCallback
#define hipEvent_t cudaEvent_t
#define hipEventCreate cudaEventCreate
#define hipEventRecord cudaEventRecord
#define hipEventSynchronize cudaEventSynchronize
#define hipEventElapsedTime cudaEventElapsedTime
#define hipEventDestroy cudaEventDestroy

// Memory.
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipMemset cudaMemset
#define hipHostMalloc cudaHostAlloc
#define hipHostMallocDefault cudaHostAllocDefault
#define hipHostFree cudaFreeHost
#define hipHostRegister cudaHostRegister
#define hipHostRegisterDefault cudaHostRegisterDefault
#define hipHostUnregister cudaHostUnregister
#define hipHostGetDevicePointer cudaHostGetDevicePointer
#define hipMemcpy cudaMemcpy
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemcpy2DAsync cudaMemcpy2DAsync
#define hipMemcpyDefault cudaMemcpyDefault
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
