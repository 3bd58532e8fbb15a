// A host-memory stand-in for the few libamdhip64 functions that the hip/ programs and
// libmori_tp call, for machines without an AMD GPU. Loaded with LD_PRELOAD, it lets the programs'
// own logic (layouts, expected bytes, gather/scatter configs, the size query, timing) and the
// library's real HIP bindings run end to end. It proves nothing about a GPU: "device" memory is
// malloc'd, every copy is a synchronous memcpy, streams and events only keep order and time.
//
// Kernels: hipModuleLoadData accepts a code-object bundle (or ELF) as hipcc --genco writes it,
// and its one function is mori-tp's copy kernel, whose own source (hip/copy_kernel.hip) is
// compiled into this library through hip/cpu_shim.hpp: hipModuleLaunchKernel runs it on the CPU,
// every thread of every block, blocks in a shuffled order.
//
// It is strict where a GPU would fail: a copy any row of which leaves the hipMalloc'd
// allocations (or, for host sides, is NULL) returns hipErrorInvalidValue without copying, as do
// width > pitch and an unknown hipMemcpyKind. A kernel launch whose table or any row of any
// (buffer, rect) is not device memory returns hipErrorIllegalAddress without running (a GPU
// would fault), and one with more threads per block than the kernel is built for returns
// hipErrorInvalidConfiguration. Each function is defined against the prototype in
// hip/hip_runtime_api.h, so the compiler holds the stand-in to the real signatures.
//
// Build: c++ -std=c++17 -shared -fPIC -D__HIP_PLATFORM_AMD__ fake_hip.cpp -o libfake_hip.so
// Environment (read on every call): FAKE_HIP_DEVICES=0 reports no device, like Debian's runtime
// on a machine without a GPU; FAKE_HIP_COPY_STATUS=<n> makes every hipMemcpy2DAsync return the
// status n without copying, FAKE_HIP_LAUNCH_STATUS=<n> every hipModuleLaunchKernel (to test how
// callers report runtime errors, unknown codes included).

#include <hip/hip_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#define MORI_COPY_KERNEL_CPU
#include "../../hip/copy_kernel.hip"

struct ihipStream_t {
    int unused;
};

struct ihipEvent_t {
    std::chrono::steady_clock::time_point at;
};

struct ihipModule_t {
    int unused;
};

// The one function a module holds: the copy kernel, compiled for the CPU.
struct ihipModuleSymbol_t {
    void (*kernel)(MoriCopyKernelArgs);
};

namespace {

std::mutex lock;
// Live allocations: start address -> size.
std::map<uintptr_t, size_t> allocations;
ihipModuleSymbol_t copy_kernel{mori_copy_kernel};
// Seeds each launch's block order differently.
uint64_t launches = 0;

bool devices_present() {
    const char *devices = std::getenv("FAKE_HIP_DEVICES");
    return devices == nullptr || std::strcmp(devices, "0") != 0;
}

// True when [p, p + len) lies inside one live allocation.
bool in_device_memory(const void *p, size_t len) {
    std::lock_guard<std::mutex> guard(lock);
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    auto next = allocations.upper_bound(at);
    if (next == allocations.begin()) {
        return false;
    }
    const auto &[start, size] = *std::prev(next);
    return at >= start && at + len >= at && at + len <= start + size;
}

// Where a side of a copy may be: device memory, host memory (pageable; any non-NULL pointer
// outside the allocations), or either (hipMemcpyDefault: decided by where the first row starts).
enum class Space { Device, Host, Any };

Space resolve(const void *base, Space space) {
    if (space != Space::Any) {
        return space;
    }
    return in_device_memory(base, 1) ? Space::Device : Space::Host;
}

bool row_ok(const void *row, size_t len, Space space) {
    if (row == nullptr) {
        return false;
    }
    return space == Space::Device ? in_device_memory(row, len) : !in_device_memory(row, 1);
}

bool kind_spaces(hipMemcpyKind kind, Space &dst, Space &src) {
    switch (kind) {
    case hipMemcpyHostToHost:
        dst = src = Space::Host;
        return true;
    case hipMemcpyHostToDevice:
        dst = Space::Device;
        src = Space::Host;
        return true;
    case hipMemcpyDeviceToHost:
        dst = Space::Host;
        src = Space::Device;
        return true;
    case hipMemcpyDeviceToDevice:
        dst = src = Space::Device;
        return true;
    case hipMemcpyDefault:
        dst = src = Space::Any;
        return true;
    default:
        return false;
    }
}

hipError_t copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                   hipMemcpyKind kind) {
    Space dst_space, src_space;
    if (!kind_spaces(kind, dst_space, src_space)) {
        return hipErrorInvalidMemcpyDirection;
    }
    if (width > dpitch || width > spitch) {
        return hipErrorInvalidValue;
    }
    auto *d = static_cast<unsigned char *>(dst);
    const auto *s = static_cast<const unsigned char *>(src);
    dst_space = resolve(dst, dst_space);
    src_space = resolve(src, src_space);
    for (size_t r = 0; r < height; r++) {
        if (!row_ok(d + r * dpitch, width, dst_space) || !row_ok(s + r * spitch, width, src_space)) {
            return hipErrorInvalidValue;
        }
    }
    for (size_t r = 0; r < height; r++) {
        std::memmove(d + r * dpitch, s + r * spitch, width);
    }
    return hipSuccess;
}

hipError_t status_from_env(const char *name) {
    const char *status = std::getenv(name);
    return status == nullptr ? hipSuccess : static_cast<hipError_t>(std::atoi(status));
}

// The kernel's argument buffer from hipModuleLaunchKernel's kernelParams or extra.
bool kernel_args(void **params, void **extra, MoriCopyKernelArgs &args) {
    if ((params == nullptr) == (extra == nullptr)) {
        return false;  // exactly one of the two
    }
    if (params != nullptr) {
        std::memcpy(&args, params[0], sizeof args);
        return true;
    }
    const void *buffer = nullptr;
    const size_t *size = nullptr;
    for (size_t i = 0; extra[i] != HIP_LAUNCH_PARAM_END; i += 2) {
        if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_POINTER) {
            buffer = extra[i + 1];
        } else if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_SIZE) {
            size = static_cast<const size_t *>(extra[i + 1]);
        } else {
            return false;
        }
    }
    if (buffer == nullptr || size == nullptr || *size != sizeof args) {
        return false;
    }
    std::memcpy(&args, buffer, sizeof args);
    return true;
}

// Every byte the launch reads or writes is device memory: the tables and each row of each
// (buffer, rect). (A GPU would fault on the first one that is not.)
bool kernel_memory_ok(const MoriCopyKernelArgs &a) {
    if (a.num_rects == 0 || a.num_buffers == 0) {
        return true;
    }
    if (!in_device_memory(a.rects, a.num_rects * sizeof(MoriCopyKernelRect)) ||
        !in_device_memory(a.src_bases, a.num_buffers * sizeof(uint64_t)) ||
        !in_device_memory(a.dst_bases, a.num_buffers * sizeof(uint64_t))) {
        return false;
    }
    for (uint64_t b = 0; b < a.num_buffers; b++) {
        for (uint64_t r = 0; r < a.num_rects; r++) {
            const MoriCopyKernelRect &rect = a.rects[r];
            for (uint64_t i = 0; i < rect.height; i++) {
                const auto *src = reinterpret_cast<const void *>(a.src_bases[b] + rect.src_offset + i * rect.src_pitch);
                const auto *dst = reinterpret_cast<const void *>(a.dst_bases[b] + rect.dst_offset + i * rect.dst_pitch);
                if (!in_device_memory(src, rect.width) || !in_device_memory(dst, rect.width)) {
                    return false;
                }
            }
        }
    }
    return true;
}

}  // namespace

extern "C" {

hipError_t hipGetDeviceCount(int *count) {
    if (count == nullptr) {
        return hipErrorInvalidValue;
    }
    *count = devices_present() ? 1 : 0;
    return devices_present() ? hipSuccess : hipErrorNoDevice;
}

hipError_t hipGetDevice(int *device) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    *device = 0;
    return hipSuccess;
}

hipError_t hipGetDeviceProperties(hipDeviceProp_t *props, int device) {
    if (!devices_present() || device != 0) {
        return hipErrorInvalidDevice;
    }
    std::memset(props, 0, sizeof *props);
    std::strcpy(props->name, "fake_hip (host memory, not a GPU)");
    std::strcpy(props->gcnArchName, "none");
    return hipSuccess;
}

const char *hipGetErrorName(hipError_t status) {
    switch (status) {
    case hipSuccess:
        return "hipSuccess";
    case hipErrorInvalidValue:
        return "hipErrorInvalidValue";
    case hipErrorInvalidMemcpyDirection:
        return "hipErrorInvalidMemcpyDirection";
    case hipErrorNoDevice:
        return "hipErrorNoDevice";
    case hipErrorInvalidDevice:
        return "hipErrorInvalidDevice";
    case hipErrorInvalidConfiguration:
        return "hipErrorInvalidConfiguration";
    case hipErrorInvalidImage:
        return "hipErrorInvalidImage";
    case hipErrorNotFound:
        return "hipErrorNotFound";
    case hipErrorIllegalAddress:
        return "hipErrorIllegalAddress";
    default:
        return "hipErrorUnknown";
    }
}

hipError_t hipMalloc(void **ptr, size_t size) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (ptr == nullptr) {
        return hipErrorInvalidValue;
    }
    *ptr = std::malloc(size == 0 ? 1 : size);
    if (*ptr == nullptr) {
        return hipErrorOutOfMemory;
    }
    std::lock_guard<std::mutex> guard(lock);
    allocations[reinterpret_cast<uintptr_t>(*ptr)] = size;
    return hipSuccess;
}

hipError_t hipFree(void *ptr) {
    if (ptr == nullptr) {
        return hipSuccess;
    }
    std::lock_guard<std::mutex> guard(lock);
    if (allocations.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
        return hipErrorInvalidValue;
    }
    std::free(ptr);
    return hipSuccess;
}

hipError_t hipMallocAsync(void **ptr, size_t size, hipStream_t) {
    return hipMalloc(ptr, size);
}

hipError_t hipFreeAsync(void *ptr, hipStream_t) {
    return hipFree(ptr);
}

hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (module == nullptr || image == nullptr) {
        return hipErrorInvalidValue;
    }
    // What hipcc --genco writes: a clang offload bundle (or one ELF code object).
    if (std::memcmp(image, "__CLANG_OFFLOAD_BUNDLE__", 24) != 0 && std::memcmp(image, "\x7f" "ELF", 4) != 0) {
        return hipErrorInvalidImage;
    }
    *module = new ihipModule_t{0};
    return hipSuccess;
}

hipError_t hipModuleUnload(hipModule_t module) {
    delete module;
    return hipSuccess;
}

hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *name) {
    if (function == nullptr || module == nullptr || name == nullptr) {
        return hipErrorInvalidValue;
    }
    if (std::strcmp(name, MORI_COPY_KERNEL_NAME) != 0) {
        return hipErrorNotFound;
    }
    *function = &copy_kernel;
    return hipSuccess;
}

hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                                 unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int,
                                 hipStream_t, void **params, void **extra) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (const hipError_t status = status_from_env("FAKE_HIP_LAUNCH_STATUS"); status != hipSuccess) {
        return status;
    }
    if (f != &copy_kernel) {
        return hipErrorInvalidResourceHandle;
    }
    if (grid_x == 0 || grid_y == 0 || grid_z == 0 || block_x == 0 || block_y == 0 || block_z == 0 ||
        uint64_t{block_x} * block_y * block_z > MORI_COPY_BLOCK_THREADS) {
        return hipErrorInvalidConfiguration;
    }
    MoriCopyKernelArgs args;
    if (!kernel_args(params, extra, args)) {
        return hipErrorInvalidValue;
    }
    if (!kernel_memory_ok(args)) {
        return hipErrorIllegalAddress;
    }
    uint64_t seed;
    {
        std::lock_guard<std::mutex> guard(lock);
        seed = ++launches;
    }
    mori_cpu_launch(f->kernel, MoriDim3{grid_x, grid_y, grid_z}, MoriDim3{block_x, block_y, block_z}, args, seed);
    return hipSuccess;
}

hipError_t hipMemset(void *dst, int value, size_t size) {
    if (!in_device_memory(dst, size)) {
        return hipErrorInvalidValue;
    }
    std::memset(dst, value, size);
    return hipSuccess;
}

hipError_t hipMemcpy(void *dst, const void *src, size_t size, hipMemcpyKind kind) {
    return copy_2d(dst, size, src, size, size, 1, kind);
}

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t size, hipMemcpyKind kind, hipStream_t) {
    return copy_2d(dst, size, src, size, size, 1, kind);
}

hipError_t hipMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                            size_t height, hipMemcpyKind kind, hipStream_t) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (const hipError_t status = status_from_env("FAKE_HIP_COPY_STATUS"); status != hipSuccess) {
        return status;
    }
    return copy_2d(dst, dpitch, src, spitch, width, height, kind);
}

hipError_t hipStreamCreate(hipStream_t *stream) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    *stream = new ihipStream_t{0};
    return hipSuccess;
}

hipError_t hipStreamDestroy(hipStream_t stream) {
    delete stream;
    return hipSuccess;
}

hipError_t hipStreamSynchronize(hipStream_t) {
    return devices_present() ? hipSuccess : hipErrorInvalidDevice;
}

hipError_t hipDeviceSynchronize(void) {
    return devices_present() ? hipSuccess : hipErrorInvalidDevice;
}

hipError_t hipEventCreate(hipEvent_t *event) {
    *event = new ihipEvent_t{std::chrono::steady_clock::now()};
    return hipSuccess;
}

hipError_t hipEventDestroy(hipEvent_t event) {
    delete event;
    return hipSuccess;
}

hipError_t hipEventRecord(hipEvent_t event, hipStream_t) {
    event->at = std::chrono::steady_clock::now();
    return hipSuccess;
}

hipError_t hipEventSynchronize(hipEvent_t) {
    return hipSuccess;
}

hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop) {
    *ms = std::chrono::duration<float, std::milli>(stop->at - start->at).count();
    return hipSuccess;
}

}  // extern "C"
