// A host-memory stand-in for the libamdhip64 functions that the hip/ programs and libmori_tp
// call, for machines without an AMD GPU. Loaded with LD_PRELOAD, it lets the programs' own logic
// (layouts, expected bytes, gather/scatter configs, the size query, timing) and the library's
// real HIP bindings run end to end. It proves nothing about a GPU: "device" memory is malloc'd,
// every copy is a synchronous memcpy, streams and events only keep order and time.
//
// It models what a runtime does that a caller can get wrong, as clr (ROCm's HIP runtime) does:
// - several devices (FAKE_HIP_DEVICES=n), a current device per thread, streams, allocations,
//   events and modules that belong to the device current when they were made; a module loads for
//   the current device only, looking up its function on another device aborts (clr's guarantee),
//   and a launch on a stream of a device the function is not loaded on returns
//   hipErrorInvalidDevice; an event records only on a stream of its own device;
// - peer access: a kernel reaches another device's memory only after hipDeviceEnablePeerAccess;
// - pinned host memory (hipHostMalloc) that kernels reach at its host address, and
//   hipHostRegister'd memory that kernels reach only at a different device address (the one
//   hipHostGetDevicePointer returns, as often on a GPU);
// - hipPointerGetAttributes, which knows only those kinds of memory (pageable host memory is
//   hipErrorInvalidValue, as in HIP 5), and hipMemGetAddressRange of device memory;
// - graph capture: work on a capturing stream is recorded and runs at hipGraphLaunch. A graph that
//   captured an upload from pageable host memory refuses to launch (hipErrorIllegalAddress): the
//   runtime would read that memory at every replay, long after its owner may have freed it. A
//   captured hipModuleLaunchKernel copies its argument buffer into the graph's kernel node at the
//   call (hipamd rocm-5.3.0 src/hip_graph.cpp, capturehipModuleLaunchKernel, and
//   src/hip_graph_internal.hpp, hipGraphKernelNode::copyParams, which copies `extra`'s buffer),
//   so a replay runs it with the captured call's argument; the node's function is checked
//   against the current device (ihipGraphAddKernelNode validates it on ihipGetDevice()), and a
//   function of another device's module is refused (hipErrorInvalidDeviceFunction: a GPU runtime
//   finds no kernel of that device there). HIP 5.2 (-DFAKE_HIP_5_2) has no capture path in
//   hipModuleLaunchKernel (its libamdhip64 never asks the stream's capture status there): the
//   kernel runs at once and the graph never holds it (counted in "uncaptured_launches").
//   hipEventRecord on a capturing stream is captured before the event's device is checked
//   (hipEventRecord_common: STREAM_CAPTURE comes first);
// - hipDeviceReset, which frees the device's memory, invalidates its modules and destroys its
//   streams (clr hipamd/src/hip_device.cpp, Device::Reset: destroyAllStreams);
// - HIP 5.2 without hipStreamGetDevice (built with -DFAKE_HIP_5_2), and HIP 6 with it;
//   hipRuntimeGetVersion reports 5.2.21153 (Debian bookworm's libamdhip64) or 6.0.32830.
//
// Graph capture across threads, as clr (ROCm/clr, hipamd/src) rules it:
// - each thread has a capture mode, Global unless hipThreadExchangeStreamCaptureMode changed it
//   (hip_graph.cpp); hipStreamBeginCapture in Global mode makes a global capture, in Global or
//   ThreadLocal mode one of the calling thread's own;
// - hipMalloc, hipHostMalloc, hipFree and hipHostFree from a thread not in Relaxed mode, while a
//   global capture exists (Global mode) or the thread has one of its own, return
//   hipErrorStreamCaptureUnsupported and invalidate those captures (CHECK_STREAM_CAPTURE_SUPPORTED
//   in hip_internal.hpp, used by those functions in hip_memory.cpp);
// - hipStreamSynchronize of a non-NULL stream and hipEventSynchronize do the same, and also when
//   the stream itself is capturing (Stream::StreamCaptureOngoing in hip_stream.cpp);
// - an event remembers the stream of its last hipEventRecord (hip_event.cpp,
//   hipEventRecord_common: SetCaptureStream); hipEventQuery and hipEventSynchronize of an event
//   whose stream is capturing now invalidate that capture and return hipErrorCapturedEvent
//   (ihipEventQuery, hipEventSynchronize); hipStreamWaitEvent on it returns
//   hipErrorStreamCaptureIsolation (hip_stream.cpp, hipStreamWaitEvent_common);
// - hipStreamEndCapture of an invalidated capture returns hipErrorStreamCaptureInvalidated, and
//   hipStreamIsCapturing says hipStreamCaptureStatusInvalidated.
//
// Streams that wait: hipStreamWaitValue32(stream, flag, value) makes the stream's later work wait
// until *flag >= value. The work itself still runs at once (this is not a GPU), but what reports
// completion waits for it: hipEventQuery of an event recorded behind such a wait (directly, or
// through hipStreamWaitEvent, or on the NULL stream, which waits for every blocking stream) says
// hipErrorNotReady, and hipEventSynchronize, hipStreamSynchronize, hipDeviceSynchronize, hipFree
// and hipHostFree (which wait for every stream of the device first: clr's ihipFree,
// hip_memory.cpp, SyncAllStreams) wait for it. A wait that has not ended after FAKE_HIP_HANG_MS
// milliseconds (default 3000) is one a GPU would never end either: it says so on stderr, counts
// in fake_hip_stat("hangs") and returns hipErrorNotReady.
//
// Kernels: hipModuleLoadData accepts a code-object bundle (plain or compressed) or ELF as hipcc
// --genco writes it, and its one function is mori-tp's copy kernel, whose own source
// (hip/copy_kernel.hip) is compiled into this library through hip/cpu_shim.hpp:
// hipModuleLaunchKernel runs it on the CPU, every thread of every block, blocks in a shuffled
// order.
//
// It is strict where a GPU would fail: a copy any row of which leaves the hipMalloc'd
// allocations (or, for host sides, is NULL) returns hipErrorInvalidValue without copying, as do
// width > pitch and an unknown hipMemcpyKind. A kernel launch whose table or any row of any
// (buffer, rect) is memory the kernel cannot reach returns hipErrorIllegalAddress without running
// (a GPU would fault and abort the process), and one with more threads per block than the kernel
// is built for returns hipErrorInvalidConfiguration. Each function is defined against the
// prototype in hip/hip_runtime_api.h, so the compiler holds the stand-in to the real signatures.
//
// Build: c++ -std=c++17 -shared -fPIC -D__HIP_PLATFORM_AMD__ fake_hip.cpp -o libfake_hip.so
// Environment (read on every call): FAKE_HIP_DEVICES=0 reports no device, like Debian's runtime
// on a machine without a GPU, FAKE_HIP_DEVICES=n reports n; FAKE_HIP_COPY_STATUS=<n> makes every
// hipMemcpy2DAsync return the status n without copying, FAKE_HIP_LAUNCH_STATUS=<n> every
// hipModuleLaunchKernel, FAKE_HIP_MALLOC_STATUS=<n> every hipMalloc and
// FAKE_HIP_MALLOC_ASYNC_STATUS=<n> every hipMallocAsync (some ROCm versions report
// hipErrorOutOfMemory there where hipMalloc works). fake_hip_stat(name) counts what happened
// (see there).

#include <hip/hip_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define MORI_COPY_KERNEL_CPU
#include "../../hip/copy_kernel.hip"
#include "../../hip/copy_table.hpp"

// A hipStreamWaitValue32 condition: *flag >= value.
struct Gate {
    volatile uint32_t *flag;
    uint32_t value;
};

struct ihipStream_t {
    int device;
    struct ihipGraph *capture;  // the graph being captured, or nullptr
    bool non_blocking;          // hipStreamNonBlocking: not synchronized with the NULL stream
    bool invalidated;           // its capture was invalidated
    bool destroyed;             // hipStreamDestroy or hipDeviceReset (the handle stays readable)
    std::vector<Gate> waits;    // what work enqueued on it from now on waits for
};

struct ihipEvent_t {
    std::chrono::steady_clock::time_point at;
    int device;
    hipStream_t recorded_on;  // the stream of its last record (clr: its capture stream)
    std::vector<Gate> waits;  // what its last record waits for
};

// The one function a module holds: the copy kernel, compiled for the CPU.
struct ihipModuleSymbol_t {
    void (*kernel)(MoriCopyKernelArgs);
    struct ihipModule_t *module;
};

struct ihipModule_t {
    int device;
    bool live;
    ihipModuleSymbol_t function;
};

// A captured graph: its work, in order, and why it must not launch (empty when it may).
struct ihipGraph {
    std::vector<std::function<hipError_t()>> work;
    std::string poisoned;
};

struct hipGraphExec {
    ihipGraph *graph;
};

extern "C" hipError_t hipStreamGetDevice(hipStream_t stream, hipDevice_t *device);

namespace {

std::recursive_mutex lock;
using Guard = std::lock_guard<std::recursive_mutex>;

struct Allocation {
    size_t size;
    int device;
    unsigned long long id;  // HIP_POINTER_ATTRIBUTE_BUFFER_ID: unique for the process
};
unsigned long long next_buffer_id = 1;

// hipMalloc'd memory (start -> size, device) and hipHostMalloc'd memory.
std::map<uintptr_t, Allocation> device_memory;
std::map<uintptr_t, size_t> pinned_memory;

// hipHostRegister'd memory: its device address (start of a reserved range) -> host range.
struct Registered {
    uintptr_t host;
    size_t size;
};
std::map<uintptr_t, Registered> registered;

std::set<std::pair<int, int>> peer_access;  // (device, peer it may reach)
std::vector<hipStream_t> streams;           // every stream made, destroyed ones too
thread_local int capture_mode = hipStreamCaptureModeGlobal;
thread_local std::vector<hipStream_t> thread_captures;  // this thread's Global/ThreadLocal ones
std::vector<hipStream_t> global_captures;               // every thread's Global-mode ones
std::vector<ihipModule_t *> modules;        // kept after unload or reset: handles stay readable
thread_local int current_device = 0;
// Seeds each launch's block order differently.
uint64_t launches = 0;
std::map<std::string, long> stats;

int device_count() {
    const char *devices = std::getenv("FAKE_HIP_DEVICES");
    return devices == nullptr ? 1 : std::atoi(devices);
}

bool devices_present() {
    return device_count() > 0;
}

void count(const char *what) {
    Guard guard(lock);
    stats[what]++;
}

// Memory for hipMalloc and hipHostMalloc, from addresses of its own (as a GPU's aperture is):
// once freed, an address is never handed out again, by these or by malloc.
void *reserve(size_t size) {
    void *p = mmap(nullptr, size == 0 ? 1 : size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
}

void retire(void *p, size_t size) {
    mprotect(p, size == 0 ? 1 : size, PROT_NONE);
}

hipError_t status_from_env(const char *name) {
    const char *status = std::getenv(name);
    return status == nullptr ? hipSuccess : static_cast<hipError_t>(std::atoi(status));
}

int stream_device(hipStream_t stream) {
    return stream == nullptr ? current_device : stream->device;
}

// The allocation of `map` that holds [p, p + len), or end().
template <class Map>
typename Map::const_iterator holding(const Map &map, uintptr_t p, size_t len) {
    auto next = map.upper_bound(p);
    if (next == map.begin()) {
        return map.end();
    }
    auto it = std::prev(next);
    const size_t size = [&] {
        if constexpr (std::is_same_v<typename Map::mapped_type, size_t>) {
            return it->second;
        } else {
            return it->second.size;
        }
    }();
    return p >= it->first && p + len >= p && p + len <= it->first + size ? it : map.end();
}

// The device that holds [p, p + len) in hipMalloc'd memory, or -1.
int device_of(const void *p, size_t len) {
    Guard guard(lock);
    auto it = holding(device_memory, reinterpret_cast<uintptr_t>(p), len);
    return it == device_memory.end() ? -1 : it->second.device;
}

bool in_device_memory(const void *p, size_t len) {
    return device_of(p, len) >= 0;
}

bool in_pinned_memory(const void *p, size_t len) {
    Guard guard(lock);
    return holding(pinned_memory, reinterpret_cast<uintptr_t>(p), len) != pinned_memory.end();
}

// The host address of registered memory's device address `address` (the address itself
// elsewhere): the CPU shim's translation, so that the kernel reaches it as a GPU would.
uint64_t translate(uint64_t address) {
    Guard guard(lock);
    auto next = registered.upper_bound(address);
    if (next != registered.begin()) {
        auto it = std::prev(next);
        if (address >= it->first && address < it->first + it->second.size) {
            return it->second.host + (address - it->first);
        }
    }
    return address;
}

bool in_registered_alias(const void *p, size_t len) {
    Guard guard(lock);
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    auto next = registered.upper_bound(at);
    if (next == registered.begin()) {
        return false;
    }
    auto it = std::prev(next);
    return at >= it->first && at + len <= it->first + it->second.size;
}

// Registered memory whose host range holds [p, p + len): its registration, or end().
std::map<uintptr_t, Registered>::const_iterator registered_host(const void *p, size_t len) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    for (auto it = registered.begin(); it != registered.end(); ++it) {
        if (at >= it->second.host && at + len <= it->second.host + it->second.size) {
            return it;
        }
    }
    return registered.end();
}

// Pageable host memory: none of the kinds the runtime knows.
bool pageable(const void *p, size_t len) {
    Guard guard(lock);
    return !in_device_memory(p, 1) && !in_pinned_memory(p, len) && !in_registered_alias(p, len) &&
           registered_host(p, len) == registered.end();
}

// Where a side of a copy may be: device memory, host memory (any non-NULL pointer outside the
// device allocations), or either (hipMemcpyDefault: decided by where the first row starts).
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
        const uint64_t to = translate(reinterpret_cast<uint64_t>(d + r * dpitch));
        const uint64_t from = translate(reinterpret_cast<uint64_t>(s + r * spitch));
        std::memmove(reinterpret_cast<void *>(to), reinterpret_cast<const void *>(from), width);
    }
    return hipSuccess;
}

// Runs `work` now, or records it in the graph `stream` is capturing.
hipError_t run_or_capture(hipStream_t stream, std::function<hipError_t()> work) {
    if (stream != nullptr && stream->capture != nullptr) {
        stream->capture->work.push_back(std::move(work));
        return hipSuccess;
    }
    return work();
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

// Memory a kernel on `device` reaches: its own device memory, a peer's with access enabled,
// pinned host memory, and registered memory at its device address.
bool kernel_reaches(int device, uint64_t address, uint64_t len) {
    const void *p = reinterpret_cast<const void *>(address);
    const int owner = device_of(p, len);
    if (owner >= 0) {
        Guard guard(lock);
        return owner == device || peer_access.count({device, owner}) != 0;
    }
    return in_pinned_memory(p, len) || in_registered_alias(p, len);
}

// Every byte the launch reads or writes is memory the kernel reaches from `device`: the table
// (unless it is inside the argument) and each row of each (buffer, rect) it describes. (A GPU
// would fault on the first one that is not.)
bool kernel_memory_ok(const MoriCopyKernelArgs &a, int device) {
    if (a.num_tiles == 0 || a.num_buffers == 0) {
        return true;
    }
    const uint8_t *table = reinterpret_cast<const uint8_t *>(a.inline_table);
    if (a.table != 0) {
        if (!kernel_reaches(device, a.table, a.table_bytes)) {
            return false;
        }
        table = reinterpret_cast<const uint8_t *>(a.table);
    } else if (a.table_bytes > MORI_COPY_INLINE_TABLE_BYTES) {
        return false;
    }
    bool ok = true;
    mori_copy_table::for_each_rect(a, table,
                                   [&](uint64_t src_base, uint64_t dst_base, uint64_t src_offset, uint64_t dst_offset,
                                       uint64_t src_pitch, uint64_t dst_pitch, uint64_t width, uint64_t height) {
                                       for (uint64_t i = 0; ok && i < height; i++) {
                                           ok = kernel_reaches(device, src_base + src_offset + i * src_pitch, width) &&
                                                kernel_reaches(device, dst_base + dst_offset + i * dst_pitch, width);
                                       }
                                   });
    return ok;
}

void invalidate(std::vector<hipStream_t> &captures) {
    for (hipStream_t stream : captures) {
        if (!stream->invalidated) {
            stream->invalidated = true;
            stats["invalidated_captures"]++;
        }
    }
}

// clr CHECK_STREAM_CAPTURE_SUPPORTED (hip_internal.hpp): true when the call is refused.
bool capture_unsupported() {
    Guard guard(lock);
    if (capture_mode == hipStreamCaptureModeRelaxed) {
        return false;
    }
    if (!thread_captures.empty()) {
        invalidate(thread_captures);
        return true;
    }
    if (capture_mode == hipStreamCaptureModeGlobal && !global_captures.empty()) {
        invalidate(global_captures);
        return true;
    }
    return false;
}

// clr Stream::StreamCaptureOngoing (hip_stream.cpp): true when a wait for `stream` is refused.
bool capture_ongoing(hipStream_t stream) {
    Guard guard(lock);
    if (stream == nullptr) {
        return false;
    }
    if (stream->capture != nullptr) {
        std::vector<hipStream_t> self{stream};
        invalidate(self);
        return true;
    }
    if (capture_mode == hipStreamCaptureModeRelaxed) {
        return false;
    }
    if (!global_captures.empty()) {
        invalidate(global_captures);
        return true;
    }
    if (!thread_captures.empty()) {
        invalidate(thread_captures);
        return true;
    }
    return false;
}

// clr ihipEventQuery / hipEventSynchronize (hip_event.cpp): an event last recorded on a stream
// that is capturing now invalidates that capture.
bool captured_event(hipEvent_t event) {
    Guard guard(lock);
    hipStream_t stream = event->recorded_on;
    if (stream != nullptr && stream->capture != nullptr && !stream->invalidated) {
        std::vector<hipStream_t> self{stream};
        invalidate(self);
        return true;
    }
    return false;
}

// What work enqueued on `stream` now waits for: its own waits; for the NULL stream, every
// blocking stream's (the NULL stream synchronizes with them).
std::vector<Gate> waits_of(hipStream_t stream) {
    Guard guard(lock);
    if (stream != nullptr) {
        return stream->waits;
    }
    std::vector<Gate> waits;
    for (hipStream_t s : streams) {
        if (!s->destroyed && !s->non_blocking && s->device == current_device) {
            waits.insert(waits.end(), s->waits.begin(), s->waits.end());
        }
    }
    return waits;
}

bool passed(const std::vector<Gate> &waits) {
    for (const Gate &gate : waits) {
        if (*gate.flag < gate.value) {
            return false;
        }
    }
    return true;
}

// Waits until `waits` have passed, or reports a wait that would never end.
hipError_t wait_for(const std::vector<Gate> &waits, const char *what, const void *on) {
    const char *ms = std::getenv("FAKE_HIP_HANG_MS");
    const long limit = ms == nullptr ? 3000 : std::atol(ms);
    const auto start = std::chrono::steady_clock::now();
    while (!passed(waits)) {
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(limit)) {
            std::fprintf(stderr, "fake_hip: %s(%p) still waits after %ld ms: on a GPU it would never return\n",
                         what, on, limit);
            count("hangs");
            return hipErrorNotReady;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return hipSuccess;
}

// clr ihipFree: SyncAllStreams of the device before the memory goes.
hipError_t sync_all_streams(const char *what, const void *ptr) {
    std::vector<Gate> waits;
    {
        Guard guard(lock);
        for (hipStream_t s : streams) {
            if (!s->destroyed) {
                waits.insert(waits.end(), s->waits.begin(), s->waits.end());
            }
        }
    }
    return wait_for(waits, what, ptr);
}

bool dead(hipStream_t stream) {
    return stream != nullptr && stream->destroyed;
}

}  // namespace

extern "C" {

// How often something happened in this process: "pageable_async_copies" (hipMemcpyAsync from
// pageable host memory, which HIP performs synchronously), "module_loads", "graph_launches";
// "kernel_launches" (kernels run), "memcpy2d_calls" (hipMemcpy2DAsync calls accepted);
// "invalidated_captures" (graph captures a call invalidated), "hangs" (waits a GPU would never
// end), "bad_frees" (hipFree of memory that is not, or no longer, allocated);
// "memcpy_async_calls", "device_mallocs", "host_mallocs", "events_created", "streams_created"
// (calls of hipMemcpyAsync, hipMalloc, hipHostMalloc, hipEventCreate(WithFlags) and
// hipStreamCreate(WithFlags) that succeeded); "captured_launches" (hipModuleLaunchKernel calls
// recorded into a graph), "uncaptured_launches" (HIP 5.2: run at once on a capturing stream);
// -1 for an unknown name.
long fake_hip_stat(const char *name) {
    Guard guard(lock);
    auto it = stats.find(name);
    if (it != stats.end()) {
        return it->second;
    }
    const std::string known[] = {"pageable_async_copies", "module_loads",       "graph_launches",
                                 "kernel_launches",       "memcpy2d_calls",     "invalidated_captures",
                                 "hangs",                 "bad_frees",          "memcpy_async_calls",
                                 "device_mallocs",        "host_mallocs",       "events_created",
                                 "streams_created",       "captured_launches",  "uncaptured_launches"};
    for (const std::string &k : known) {
        if (k == name) {
            return 0;
        }
    }
    return -1;
}

hipError_t hipGetDeviceCount(int *count) {
    if (count == nullptr) {
        return hipErrorInvalidValue;
    }
    *count = device_count();
    return devices_present() ? hipSuccess : hipErrorNoDevice;
}

// HIP_VERSION (major * 10000000 + minor * 100000 + patch) of the runtime this stands in for.
hipError_t hipRuntimeGetVersion(int *version) {
    if (version == nullptr) {
        return hipErrorInvalidValue;
    }
#ifdef FAKE_HIP_5_2
    *version = 50221153;
#else
    *version = 60032830;
#endif
    return hipSuccess;
}

hipError_t hipGetDevice(int *device) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    *device = current_device;
    return hipSuccess;
}

hipError_t hipSetDevice(int device) {
    if (device < 0 || device >= device_count()) {
        return hipErrorInvalidDevice;
    }
    current_device = device;
    return hipSuccess;
}

hipError_t hipGetDeviceProperties(hipDeviceProp_t *props, int device) {
    if (device < 0 || device >= device_count()) {
        return hipErrorInvalidDevice;
    }
    std::memset(props, 0, sizeof *props);
    std::snprintf(props->name, sizeof props->name, "fake_hip device %d (host memory, not a GPU)", device);
    std::strcpy(props->gcnArchName, "none");
    return hipSuccess;
}

// FAKE_HIP_NO_PEER=1: no device can ever reach another's memory.
hipError_t hipDeviceCanAccessPeer(int *can, int device, int peer) {
    if (can == nullptr || device < 0 || peer < 0 || device >= device_count() || peer >= device_count()) {
        return hipErrorInvalidDevice;
    }
    *can = device != peer && std::getenv("FAKE_HIP_NO_PEER") == nullptr;
    return hipSuccess;
}

hipError_t hipDeviceEnablePeerAccess(int peer, unsigned int) {
    if (peer < 0 || peer >= device_count() || peer == current_device) {
        return hipErrorInvalidDevice;
    }
    Guard guard(lock);
    return peer_access.insert({current_device, peer}).second ? hipSuccess : hipErrorPeerAccessAlreadyEnabled;
}

hipError_t hipDeviceReset(void) {
    Guard guard(lock);
    for (auto it = device_memory.begin(); it != device_memory.end();) {
        if (it->second.device == current_device) {
            retire(reinterpret_cast<void *>(it->first), it->second.size);
            it = device_memory.erase(it);
        } else {
            ++it;
        }
    }
    for (ihipModule_t *module : modules) {
        if (module->device == current_device) {
            module->live = false;
        }
    }
    for (auto it = peer_access.begin(); it != peer_access.end();) {
        it = it->first == current_device ? peer_access.erase(it) : std::next(it);
    }
    for (hipStream_t stream : streams) {
        if (stream->device == current_device) {
            stream->destroyed = true;
        }
    }
    return hipSuccess;
}

const char *hipGetErrorName(hipError_t status) {
    switch (status) {
    case hipSuccess:
        return "hipSuccess";
    case hipErrorInvalidValue:
        return "hipErrorInvalidValue";
    case hipErrorOutOfMemory:
        return "hipErrorOutOfMemory";
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
    case hipErrorInvalidHandle:
        return "hipErrorInvalidHandle";
    case hipErrorNotFound:
        return "hipErrorNotFound";
    case hipErrorIllegalAddress:
        return "hipErrorIllegalAddress";
    case hipErrorPeerAccessAlreadyEnabled:
        return "hipErrorPeerAccessAlreadyEnabled";
    case hipErrorStreamCaptureUnsupported:
        return "hipErrorStreamCaptureUnsupported";
    case hipErrorStreamCaptureInvalidated:
        return "hipErrorStreamCaptureInvalidated";
    case hipErrorStreamCaptureIsolation:
        return "hipErrorStreamCaptureIsolation";
    case hipErrorCapturedEvent:
        return "hipErrorCapturedEvent";
    case hipErrorNotReady:
        return "hipErrorNotReady";
    case hipErrorContextIsDestroyed:
        return "hipErrorContextIsDestroyed";
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
    if (const hipError_t status = status_from_env("FAKE_HIP_MALLOC_STATUS"); status != hipSuccess) {
        return status;
    }
    if (capture_unsupported()) {
        return hipErrorStreamCaptureUnsupported;
    }
    *ptr = reserve(size);
    if (*ptr == nullptr) {
        return hipErrorOutOfMemory;
    }
    Guard guard(lock);
    device_memory[reinterpret_cast<uintptr_t>(*ptr)] = Allocation{size, current_device, next_buffer_id++};
    stats["device_mallocs"]++;
    return hipSuccess;
}

hipError_t hipFree(void *ptr) {
    if (ptr == nullptr) {
        return hipSuccess;
    }
    if (capture_unsupported()) {
        return hipErrorStreamCaptureUnsupported;
    }
    if (const hipError_t status = sync_all_streams("hipFree", ptr); status != hipSuccess) {
        return status;
    }
    Guard guard(lock);
    auto it = device_memory.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == device_memory.end()) {
        stats["bad_frees"]++;
        return hipErrorInvalidValue;
    }
    retire(ptr, it->second.size);
    device_memory.erase(it);
    return hipSuccess;
}

hipError_t hipMallocAsync(void **ptr, size_t size, hipStream_t) {
    if (const hipError_t status = status_from_env("FAKE_HIP_MALLOC_ASYNC_STATUS"); status != hipSuccess) {
        return status;
    }
    return hipMalloc(ptr, size);
}

hipError_t hipFreeAsync(void *ptr, hipStream_t stream) {
    // A free captured in a graph would happen at replay; the memory is the graph's until then.
    if (stream != nullptr && stream->capture != nullptr) {
        return hipSuccess;
    }
    return hipFree(ptr);
}

hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int) {
    if (ptr == nullptr) {
        return hipErrorInvalidValue;
    }
    if (capture_unsupported()) {
        return hipErrorStreamCaptureUnsupported;
    }
    *ptr = reserve(size);
    if (*ptr == nullptr) {
        return hipErrorOutOfMemory;
    }
    Guard guard(lock);
    pinned_memory[reinterpret_cast<uintptr_t>(*ptr)] = size;
    stats["host_mallocs"]++;
    return hipSuccess;
}

hipError_t hipHostFree(void *ptr) {
    if (ptr == nullptr) {
        return hipSuccess;
    }
    if (capture_unsupported()) {
        return hipErrorStreamCaptureUnsupported;
    }
    if (const hipError_t status = sync_all_streams("hipHostFree", ptr); status != hipSuccess) {
        return status;
    }
    Guard guard(lock);
    auto it = pinned_memory.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == pinned_memory.end()) {
        return hipErrorInvalidValue;
    }
    retire(ptr, it->second);
    pinned_memory.erase(it);
    return hipSuccess;
}

hipError_t hipHostRegister(void *host, size_t size, unsigned int) {
    if (host == nullptr || size == 0) {
        return hipErrorInvalidValue;
    }
    // A range of addresses nothing else uses, for the device's view of the memory.
    void *alias = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (alias == MAP_FAILED) {
        return hipErrorOutOfMemory;
    }
    Guard guard(lock);
    registered[reinterpret_cast<uintptr_t>(alias)] = Registered{reinterpret_cast<uintptr_t>(host), size};
    mori_cpu_translate = translate;
    return hipSuccess;
}

hipError_t hipHostUnregister(void *host) {
    Guard guard(lock);
    auto it = registered_host(host, 1);
    if (it == registered.end() || it->second.host != reinterpret_cast<uintptr_t>(host)) {
        return hipErrorHostMemoryNotRegistered;
    }
    registered.erase(it);  // its device addresses stay reserved, never to be reused
    return hipSuccess;
}

hipError_t hipHostGetDevicePointer(void **device_pointer, void *host, unsigned int) {
    if (device_pointer == nullptr) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    if (in_pinned_memory(host, 1)) {
        *device_pointer = host;
        return hipSuccess;
    }
    auto it = registered_host(host, 1);
    if (it == registered.end()) {
        return hipErrorInvalidValue;
    }
    *device_pointer = reinterpret_cast<void *>(it->first + (reinterpret_cast<uintptr_t>(host) - it->second.host));
    return hipSuccess;
}

hipError_t hipPointerGetAttributes(hipPointerAttribute_t *attributes, const void *ptr) {
    if (attributes == nullptr || ptr == nullptr) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    std::memset(attributes, 0, sizeof *attributes);
    void *p = const_cast<void *>(ptr);
    if (const int device = device_of(ptr, 1); device >= 0) {
        attributes->memoryType = hipMemoryTypeDevice;
        attributes->device = device;
        attributes->devicePointer = p;
        return hipSuccess;
    }
    attributes->memoryType = hipMemoryTypeHost;
    attributes->device = current_device;
    if (in_pinned_memory(ptr, 1)) {
        attributes->devicePointer = attributes->hostPointer = p;
        return hipSuccess;
    }
    if (in_registered_alias(ptr, 1)) {
        attributes->devicePointer = p;
        attributes->hostPointer = reinterpret_cast<void *>(translate(reinterpret_cast<uint64_t>(ptr)));
        return hipSuccess;
    }
    if (auto it = registered_host(ptr, 1); it != registered.end()) {
        attributes->hostPointer = p;
        attributes->devicePointer =
            reinterpret_cast<void *>(it->first + (reinterpret_cast<uintptr_t>(ptr) - it->second.host));
        return hipSuccess;
    }
    return hipErrorInvalidValue;
}

// hipPointerGetAttribute: HIP_POINTER_ATTRIBUTE_BUFFER_ID (7, as hipPointer_attribute numbers it)
// of hipMalloc'd memory only (clr answers from the allocation's memory object); anything else
// is hipErrorInvalidValue here.
hipError_t hipPointerGetAttribute(void *data, hipPointer_attribute attribute, hipDeviceptr_t ptr) {
    if (data == nullptr || attribute != HIP_POINTER_ATTRIBUTE_BUFFER_ID) return hipErrorInvalidValue;
    Guard guard(lock);
    auto it = holding(device_memory, reinterpret_cast<uintptr_t>(ptr), 1);
    if (it == device_memory.end()) return hipErrorInvalidValue;
    *static_cast<unsigned long long *>(data) = it->second.id;
    return hipSuccess;
}

hipError_t hipMemGetAddressRange(hipDeviceptr_t *base, size_t *size, hipDeviceptr_t ptr) {
    if (base == nullptr || size == nullptr) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    auto it = holding(device_memory, reinterpret_cast<uintptr_t>(ptr), 1);
    if (it == device_memory.end()) {
        return hipErrorNotFound;  // as clr answers for an address it does not know
    }
    *base = reinterpret_cast<hipDeviceptr_t>(it->first);
    *size = it->second.size;
    return hipSuccess;
}

hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (module == nullptr || image == nullptr) {
        return hipErrorInvalidValue;
    }
    // What hipcc --genco writes: a clang offload bundle, compressed or not (or one ELF object).
    if (std::memcmp(image, "__CLANG_OFFLOAD_BUNDLE__", 24) != 0 && std::memcmp(image, "CCOB", 4) != 0 &&
        std::memcmp(image, "\x7f" "ELF", 4) != 0) {
        return hipErrorInvalidImage;
    }
    auto *loaded = new ihipModule_t{current_device, true, {mori_copy_kernel, nullptr}};
    loaded->function.module = loaded;
    Guard guard(lock);
    modules.push_back(loaded);
    stats["module_loads"]++;
    *module = loaded;
    return hipSuccess;
}

hipError_t hipModuleUnload(hipModule_t module) {
    if (module == nullptr || !module->live) {
        return hipErrorInvalidHandle;
    }
    module->live = false;
    return hipSuccess;
}

hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *name) {
    if (function == nullptr || module == nullptr || name == nullptr) {
        return hipErrorInvalidValue;
    }
    if (module->device != current_device) {
        // clr: guarantee(false, "Device mismatch from where this module is loaded").
        std::fprintf(stderr, "fake_hip: hipModuleGetFunction of a module of device %d with device %d current\n",
                     module->device, current_device);
        std::abort();
    }
    if (!module->live) {
        return hipErrorInvalidHandle;
    }
    if (std::strcmp(name, MORI_COPY_KERNEL_NAME) != 0) {
        return hipErrorNotFound;
    }
    *function = &module->function;
    return hipSuccess;
}

hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                                 unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int,
                                 hipStream_t stream, void **params, void **extra) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (const hipError_t status = status_from_env("FAKE_HIP_LAUNCH_STATUS"); status != hipSuccess) {
        return status;
    }
    if (f == nullptr || !f->module->live) {
        return hipErrorInvalidHandle;
    }
    if (dead(stream)) {
        return hipErrorContextIsDestroyed;
    }
    const int device = stream_device(stream);
    // clr: the function has no kernel loaded for the stream's device.
    if (f->module->device != device) {
        return hipErrorInvalidDevice;
    }
    if (grid_x == 0 || grid_y == 0 || grid_z == 0 || block_x == 0 || block_y == 0 || block_z == 0 ||
        uint64_t{block_x} * block_y * block_z > MORI_COPY_BLOCK_THREADS) {
        return hipErrorInvalidConfiguration;
    }
    MoriCopyKernelArgs args;
    if (!kernel_args(params, extra, args)) {
        return hipErrorInvalidValue;
    }
    auto *kernel = f->kernel;
    const MoriDim3 grid{grid_x, grid_y, grid_z}, block{block_x, block_y, block_z};
    const bool capturing = stream != nullptr && stream->capture != nullptr;
#ifndef FAKE_HIP_5_2
    if (capturing && f->module->device != current_device) {
        return hipErrorInvalidDeviceFunction;
    }
#endif
    // `args` is a copy made now: a captured launch keeps it in the graph's node.
    auto work = [=] {
        if (!kernel_memory_ok(args, device)) {
            return hipErrorIllegalAddress;
        }
        uint64_t seed;
        {
            Guard guard(lock);
            seed = ++launches;
        }
        mori_cpu_launch(kernel, grid, block, args, seed);
        count("kernel_launches");
        return hipSuccess;
    };
    if (capturing) {
#ifdef FAKE_HIP_5_2
        // No capture path: the kernel runs now, outside the graph.
        count("uncaptured_launches");
        return work();
#else
        count("captured_launches");
#endif
    }
    return run_or_capture(stream, work);
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

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t size, hipMemcpyKind kind, hipStream_t stream) {
    if (dead(stream)) {
        return hipErrorContextIsDestroyed;
    }
    count("memcpy_async_calls");
    const bool from_pageable = !in_device_memory(src, 1) && pageable(src, size);
    if (from_pageable) {
        count("pageable_async_copies");
    }
    if (stream != nullptr && stream->capture != nullptr && from_pageable) {
        stream->capture->poisoned =
            "it captured a hipMemcpyAsync from pageable host memory, which the runtime would read at every "
            "replay";
    }
    return run_or_capture(stream, [=] { return copy_2d(dst, size, src, size, size, 1, kind); });
}

hipError_t hipMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                            size_t height, hipMemcpyKind kind, hipStream_t stream) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (const hipError_t status = status_from_env("FAKE_HIP_COPY_STATUS"); status != hipSuccess) {
        return status;
    }
    if (dead(stream)) {
        return hipErrorContextIsDestroyed;
    }
    count("memcpy2d_calls");
    return run_or_capture(stream, [=] { return copy_2d(dst, dpitch, src, spitch, width, height, kind); });
}

hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (stream == nullptr || (flags & ~hipStreamNonBlocking) != 0) {
        return hipErrorInvalidValue;
    }
    *stream = new ihipStream_t{current_device, nullptr, flags == hipStreamNonBlocking, false, false, {}};
    Guard guard(lock);
    streams.push_back(*stream);
    stats["streams_created"]++;
    return hipSuccess;
}

hipError_t hipStreamCreate(hipStream_t *stream) {
    return hipStreamCreateWithFlags(stream, hipStreamDefault);
}

// The handle stays readable (an event may still name it as the stream of its last record).
hipError_t hipStreamDestroy(hipStream_t stream) {
    if (stream == nullptr || stream->destroyed) {
        return hipErrorInvalidHandle;
    }
    stream->destroyed = true;
    return hipSuccess;
}

// Later work on `stream` waits until *ptr >= value (hipStreamWaitValueGte; other flags and the
// mask are not modelled).
hipError_t hipStreamWaitValue32(hipStream_t stream, void *ptr, uint32_t value, unsigned int, uint32_t) {
    if (stream == nullptr || ptr == nullptr) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    stream->waits.push_back(Gate{static_cast<volatile uint32_t *>(ptr), value});
    return hipSuccess;
}

hipError_t hipThreadExchangeStreamCaptureMode(hipStreamCaptureMode *mode) {
    if (mode == nullptr || *mode < hipStreamCaptureModeGlobal || *mode > hipStreamCaptureModeRelaxed) {
        return hipErrorInvalidValue;
    }
    const int previous = capture_mode;
    capture_mode = *mode;
    *mode = static_cast<hipStreamCaptureMode>(previous);
    return hipSuccess;
}

#ifndef FAKE_HIP_5_2
// HIP 5.6 and later (hipamd rocm-5.6.0).
hipError_t hipStreamGetDevice(hipStream_t stream, hipDevice_t *device) {
    if (device == nullptr) {
        return hipErrorInvalidValue;
    }
    *device = stream_device(stream);
    return hipSuccess;
}
#endif

hipError_t hipStreamSynchronize(hipStream_t stream) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    if (dead(stream)) {
        return hipErrorContextIsDestroyed;
    }
    if (capture_ongoing(stream)) {
        return hipErrorStreamCaptureUnsupported;
    }
    return wait_for(waits_of(stream), "hipStreamSynchronize", stream);
}

hipError_t hipDeviceSynchronize(void) {
    if (!devices_present()) {
        return hipErrorInvalidDevice;
    }
    return sync_all_streams("hipDeviceSynchronize", nullptr);
}

hipError_t hipStreamIsCapturing(hipStream_t stream, hipStreamCaptureStatus *status) {
    if (status == nullptr) {
        return hipErrorInvalidValue;
    }
    if (stream == nullptr || stream->capture == nullptr) {
        *status = hipStreamCaptureStatusNone;
    } else {
        *status = stream->invalidated ? hipStreamCaptureStatusInvalidated : hipStreamCaptureStatusActive;
    }
    return hipSuccess;
}

hipError_t hipStreamBeginCapture(hipStream_t stream, hipStreamCaptureMode mode) {
    if (stream == nullptr || stream->capture != nullptr || mode < hipStreamCaptureModeGlobal ||
        mode > hipStreamCaptureModeRelaxed) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    stream->capture = new ihipGraph{};
    stream->invalidated = false;
    if (mode != hipStreamCaptureModeRelaxed) {
        thread_captures.push_back(stream);
    }
    if (mode == hipStreamCaptureModeGlobal) {
        global_captures.push_back(stream);
    }
    return hipSuccess;
}

hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t *graph) {
    if (stream == nullptr || stream->capture == nullptr || graph == nullptr) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    for (std::vector<hipStream_t> *captures : {&thread_captures, &global_captures}) {
        captures->erase(std::remove(captures->begin(), captures->end(), stream), captures->end());
    }
    const bool invalidated = stream->invalidated;
    stream->invalidated = false;
    if (invalidated) {
        delete stream->capture;
        stream->capture = nullptr;
        *graph = nullptr;
        return hipErrorStreamCaptureInvalidated;
    }
    *graph = stream->capture;
    stream->capture = nullptr;
    return hipSuccess;
}

hipError_t hipGraphInstantiate(hipGraphExec_t *exec, hipGraph_t graph, hipGraphNode_t *, char *, size_t) {
    if (exec == nullptr || graph == nullptr) {
        return hipErrorInvalidValue;
    }
    *exec = new hipGraphExec{graph};
    return hipSuccess;
}

hipError_t hipGraphLaunch(hipGraphExec_t exec, hipStream_t stream) {
    if (exec == nullptr) {
        return hipErrorInvalidValue;
    }
    if (!exec->graph->poisoned.empty()) {
        std::fprintf(stderr, "fake_hip: hipGraphLaunch refused: %s\n", exec->graph->poisoned.c_str());
        return hipErrorIllegalAddress;
    }
    count("graph_launches");
    for (const auto &work : exec->graph->work) {
        if (const hipError_t status = run_or_capture(stream, work); status != hipSuccess) {
            return status;
        }
    }
    return hipSuccess;
}

hipError_t hipGraphExecDestroy(hipGraphExec_t exec) {
    delete exec;
    return hipSuccess;
}

hipError_t hipGraphDestroy(hipGraph_t graph) {
    delete graph;
    return hipSuccess;
}

hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned) {
    if (event == nullptr) {
        return hipErrorInvalidValue;
    }
    *event = new ihipEvent_t{std::chrono::steady_clock::now(), current_device, nullptr, {}};
    count("events_created");
    return hipSuccess;
}

hipError_t hipEventCreate(hipEvent_t *event) {
    return hipEventCreateWithFlags(event, 0);
}

hipError_t hipEventDestroy(hipEvent_t event) {
    delete event;
    return hipSuccess;
}

hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
    if (event == nullptr) {
        return hipErrorInvalidHandle;
    }
    if (dead(stream)) {
        return hipErrorContextIsDestroyed;
    }
    Guard guard(lock);
    // clr sets the event's stream before it checks the device (hipEventRecord_common), and a
    // capturing stream's record is captured before that check.
    event->recorded_on = stream;
    const bool captured = stream != nullptr && stream->capture != nullptr;
    if (!captured && event->device != stream_device(stream)) {
        return hipErrorInvalidHandle;
    }
    event->at = std::chrono::steady_clock::now();
    event->waits = waits_of(stream);
    return hipSuccess;
}

hipError_t hipEventQuery(hipEvent_t event) {
    if (event == nullptr) {
        return hipErrorInvalidHandle;
    }
    if (captured_event(event)) {
        return hipErrorCapturedEvent;
    }
    Guard guard(lock);
    return passed(event->waits) ? hipSuccess : hipErrorNotReady;
}

hipError_t hipEventSynchronize(hipEvent_t event) {
    if (event == nullptr) {
        return hipErrorInvalidHandle;
    }
    if (captured_event(event)) {
        return hipErrorCapturedEvent;
    }
    if (capture_ongoing(event->recorded_on)) {
        return hipErrorStreamCaptureUnsupported;
    }
    std::vector<Gate> waits;
    {
        Guard guard(lock);
        waits = event->waits;
    }
    return wait_for(waits, "hipEventSynchronize", event);
}

hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned int flags) {
    if (event == nullptr || dead(stream)) {
        return hipErrorInvalidHandle;
    }
    if (flags != 0) {
        return hipErrorInvalidValue;
    }
    Guard guard(lock);
    // clr: an event recorded on a stream that is capturing now, but not into this capture.
    if (event->recorded_on != nullptr && event->recorded_on->capture != nullptr) {
        return hipErrorStreamCaptureIsolation;
    }
    if (stream != nullptr) {
        stream->waits.insert(stream->waits.end(), event->waits.begin(), event->waits.end());
    }
    return hipSuccess;
}

hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop) {
    *ms = std::chrono::duration<float, std::milli>(stop->at - start->at).count();
    return hipSuccess;
}

}  // extern "C"
