// Helpers shared by the HIP programs: error checks, the "no device" protocol, switching the
// current device for a moment, and the head ownership rule (REFERENCE.md section 3) restated
// independently of the library. Built with nvcc and -I hip/cuda (hip/cuda/hip/hip_runtime.h maps
// the HIP names to CUDA's), the same programs check the CUDA backend on NVIDIA GPUs.
#pragma once

#include <dlfcn.h>
#include <hip/hip_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mori_tp.h"

// The backend the programs request, and the words their messages use for it.
#ifdef MORI_TP_DEVICE_BACKEND_CUDA
constexpr MoriBackend kBackend = MORI_BACKEND_CUDA;
constexpr const char *kBackendName = "CUDA";
constexpr const char *kDeviceCountCall = "cuDeviceGetCount";
constexpr const char *kPerRect = "cuMemcpy2DAsync per rect";
#else
constexpr MoriBackend kBackend = MORI_BACKEND_HIP;
constexpr const char *kBackendName = "HIP";
constexpr const char *kDeviceCountCall = "hipGetDeviceCount";
constexpr const char *kPerRect = "hipMemcpy2DAsync per rect";
#endif

// The device's architecture: gfx90a, ... on AMD GPUs, sm_90, ... on NVIDIA GPUs.
inline std::string device_arch(const hipDeviceProp_t &props) {
#ifdef MORI_TP_DEVICE_BACKEND_CUDA
    return "sm_" + std::to_string(props.major) + std::to_string(props.minor);
#else
    return props.gcnArchName;
#endif
}

// Exit codes: 0 passed, 1 failed, 77 skipped (no HIP device; the automake convention).
constexpr int kPassed = 0;
constexpr int kFailed = 1;
constexpr int kSkipped = 77;

#define HIP_OK(call)                                                                        \
    do {                                                                                    \
        hipError_t hip_ok_status_ = (call);                                                 \
        if (hip_ok_status_ != hipSuccess) {                                                 \
            std::fprintf(stderr, "%s:%d: %s failed: %s (%d)\n", __FILE__, __LINE__, #call,  \
                         hipGetErrorName(hip_ok_status_), static_cast<int>(hip_ok_status_)); \
            std::exit(kFailed);                                                             \
        }                                                                                   \
    } while (0)

#define MORI_OK_OR_DIE(call)                                                                  \
    do {                                                                                      \
        MoriStatus mori_ok_status_ = (call);                                                  \
        if (mori_ok_status_ != MORI_OK) {                                                     \
            std::fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call,    \
                         mori_status_str(mori_ok_status_), mori_last_error_message());        \
            std::exit(kFailed);                                                               \
        }                                                                                     \
    } while (0)

// Runs `f` with `device` current (no change for -1, which the programs use for pinned host
// memory), then makes the caller's device current again.
template <class F>
void on_device(int device, const F &f) {
    int current = 0;
    HIP_OK(hipGetDevice(&current));
    if (device >= 0) HIP_OK(hipSetDevice(device));
    f();
    HIP_OK(hipSetDevice(current));
}

// Whether the HIP runtime this program runs on has hipStreamGetDevice (HIP 5.6 and later; HIP 5.2
// lacks it), looked up as libmori_tp looks it up: in the library that hipGetDevice comes from
// (libamdhip64, or a stand-in preloaded in its place). Without it, the library takes a copy-kernel
// call's stream to be the current device's and refuses a stream of another device
// (docs/src/concepts/hip-backend.md), so the programs make the stream's device current for such
// calls.
inline bool runtime_has_stream_get_device() {
#ifdef MORI_TP_DEVICE_BACKEND_CUDA
    return true;  // the CUDA backend asks the driver for the stream's context (cuStreamGetCtx)
#endif
    Dl_info info;
    if (dladdr(reinterpret_cast<void *>(&hipGetDevice), &info) != 0 && info.dli_fname != nullptr) {
        if (void *handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD); handle != nullptr) {
            const bool found = dlsym(handle, "hipStreamGetDevice") != nullptr;
            dlclose(handle);
            return found;
        }
    }
    return dlsym(RTLD_DEFAULT, "hipStreamGetDevice") != nullptr;
}

// The heads rank `rank` of a side with TP size `tp` owns (REFERENCE.md section 3).
struct HeadRange {
    uint32_t first;
    uint32_t count;
};

inline HeadRange owned_heads(uint32_t heads, uint32_t tp, uint32_t rank) {
    if (tp <= heads) {
        return {rank * (heads / tp), heads / tp};
    }
    return {rank / (tp / heads), 1};
}

// Returns -1 when a device is present. Otherwise checks that libmori_tp refuses its backend
// (MORI_BACKEND_HIP, or MORI_BACKEND_CUDA with nvcc) cleanly (MORI_ERR_BACKEND_UNAVAILABLE,
// naming hipGetDeviceCount or cuDeviceGetCount: proof that the library was built with the
// backend and does not crash without a GPU), prints the skip line and returns 77, or returns 1
// if the library misbehaves.
inline int skip_without_device(const char *program) {
    if (mori_abi_version() != MORI_TP_ABI_VERSION) {
        std::fprintf(stderr, "%s: libmori_tp ABI %u, header ABI %u\n", program, mori_abi_version(),
                     MORI_TP_ABI_VERSION);
        return kFailed;
    }
    int count = 0;
    hipError_t status = hipGetDeviceCount(&count);
    if (status == hipSuccess && count > 0) {
        return -1;
    }
    // 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair (1, 3), one-token pages.
    const MoriTpSliceParams params = {2, 1, 4, 3, 8, 1, 64, 32};
    MoriTpSliceConfig config;
    MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
    uint8_t src[64] = {1}, dst[32] = {2};
    const void *srcs[1] = {src};
    void *dsts[1] = {dst};
    const MoriKvBuffers buffers = {srcs, dsts, 1, sizeof src, sizeof dst};
    const int32_t page[1] = {0};
    const MoriSendOptions device = {kBackend, MORI_SEND_SYNCHRONIZE, nullptr};
    MoriStatus sent = mori_send_kvcache(&config, &buffers, page, page, 1, &device);
    const char *message = mori_last_error_message();
    if (sent != MORI_ERR_BACKEND_UNAVAILABLE || std::strstr(message, kDeviceCountCall) == nullptr) {
        std::fprintf(stderr,
                     "%s: without a device, MORI_BACKEND_%s returned %s (%s); expected "
                     "MORI_ERR_BACKEND_UNAVAILABLE naming %s (is libmori_tp built with --features "
                     "%s?)\n",
                     program, kBackendName, mori_status_str(sent), message, kDeviceCountCall,
                     kBackend == MORI_BACKEND_HIP ? "hip" : "cuda");
        return kFailed;
    }
    std::printf("%s: skipped: no %s device (%s: %s (%d), %d devices); "
                "libmori_tp refuses MORI_BACKEND_%s with MORI_ERR_BACKEND_UNAVAILABLE as it "
                "should\n",
                program, kBackendName, kDeviceCountCall, hipGetErrorName(status), static_cast<int>(status),
                count, kBackendName);
    return kSkipped;
}
