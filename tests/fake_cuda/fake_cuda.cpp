// A host-memory stand-in for the CUDA driver functions (libcuda.so.1) that libmori_tp's CUDA
// backend and its tests call, for machines without an NVIDIA GPU: tests/cuda_runtime.rs builds it
// as libcuda.so.1 and runs child processes with it first on the loader's path. It lets the
// library's real CUDA runtime (src/backend/gpu/lib_cuda.rs: the loader, the symbol look-ups, the
// argument marshalling, the context handling) run end to end. It proves nothing about a GPU:
// "device" memory is host memory, every copy is a synchronous memcpy, streams and events only
// keep order.
//
// There is no CUDA toolkit here, so the types are declared below with the layouts cuda.h gives
// them (as cudarc's bindings, generated from cuda.h, have them: CUresult and the other enums are
// int-sized, CUdeviceptr is 64 bits, handles are pointers), and each function has the signature
// and exported name (the `_v2` ones where cuda.h maps the name) of cuda.h.
//
// It models what the driver does that a caller can get wrong, each rule from NVIDIA's
// documentation:
// - contexts (Driver API reference, Context Management and Primary Context Management; CUDA C++
//   Programming Guide, Driver API, "Context"): each thread has a stack of current contexts, empty
//   at first; each device has one primary context (cuDevicePrimaryCtxRetain), and cuCtxCreate
//   makes others. Calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is
//   current. Allocations, modules, streams and events belong to the context current when they
//   were made ("each context has its own distinct address space", the guide says of modules
//   and memory); a module's function launches only with its context current;
// - several devices (FAKE_CUDA_DEVICES=n). Per the Programming Guide's "Stream and Event
//   Behavior": a kernel launch fails on a stream that is not of the current context
//   (CUDA_ERROR_INVALID_HANDLE here), a memory copy succeeds on any stream, cuEventRecord fails
//   when the event and the stream belong to different contexts, cuEventQuery,
//   cuEventSynchronize and cuStreamWaitEvent work across contexts;
// - peer access (cuCtxEnablePeerAccess): a kernel reaches another device's memory only after it;
// - memory kinds: cuMemAlloc (device), cuMemHostAlloc (pinned, reached by kernels at its host
//   address: unified addressing), cuMemHostRegister (pinned in place, also reached at its host
//   address). cuPointerGetAttributes answers for all three and, for memory it does not know,
//   assigns default values and returns CUDA_SUCCESS (its reference says so);
//   cuMemGetAddressRange answers for device memory, CUDA_ERROR_NOT_FOUND otherwise;
// - cuMemcpy2DAsync with CU_MEMORYTYPE_UNIFIED sides (device or host, by address);
// - graph capture (Driver API reference, cuThreadExchangeStreamCaptureMode and
//   cuStreamBeginCapture; Programming Guide, CUDA Graphs, "Prohibited and Unhandled Operations"
//   and "Invalidation"):
//   - each thread has a capture mode, CU_STREAM_CAPTURE_MODE_GLOBAL unless it exchanged it;
//     a capture begun in GLOBAL mode is global, one begun in GLOBAL or THREAD_LOCAL mode is also
//     the beginning thread's own;
//   - "potentially unsafe API calls" (the reference's example is cudaMalloc; modelled here:
//     cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemFreeHost, cuModuleLoadData, cuModuleUnload)
//     from a thread not in RELAXED mode, while the thread has a capture of its own or (GLOBAL
//     mode) any thread has a global one, return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
//     invalidate those captures;
//   - synchronizing or querying a capturing stream, and querying or synchronizing an event last
//     recorded in a capture, are invalid in every mode ("it is invalid to synchronize or query
//     the execution status of a stream which is being captured or a captured event"): they
//     return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and CUDA_ERROR_CAPTURED_EVENT and invalidate
//     the capture;
//   - "when any stream in the same context is being captured, and it was not created with
//     cudaStreamNonBlocking, any attempted use of the legacy stream is invalid":
//     CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the capture invalidated;
//   - a stream that waits (cuStreamWaitEvent) for an event recorded in a capture joins that
//     capture: its later work is captured, not run (the guide's cross-stream dependencies); a
//     capturing stream that waits for an event of no capture, or of another capture, gets
//     CUDA_ERROR_STREAM_CAPTURE_ISOLATION ("it is invalid to wait on a non-captured event from a
//     stream which is being captured"), and the capture is invalidated;
//   - cuStreamEndCapture of an invalidated capture returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
//     and no graph ("Invalidation"); cuStreamIsCapturing then says
//     CU_STREAM_CAPTURE_STATUS_INVALIDATED until the capture is ended;
//   - cuGraphLaunch replays the captured work on a stream;
//   - a cuLaunchKernel on a capturing stream becomes a kernel node that owns a copy of its
//     argument values, taken at the call ("the argument values it points to, are owned by the
//     node", cuGraphKernelNodeGetParams), so every replay runs with the captured call's argument;
//     what the argument points to (a table in device memory) is read at the replay.
// - streams that wait: cuStreamWaitValue32(stream, flag, value) makes the stream's later work
//   wait until *flag >= value. The work still runs at once (this is not a GPU), but what reports
//   completion waits for it: cuEventQuery of an event recorded behind such a wait (directly,
//   through cuStreamWaitEvent, or on the legacy stream, which waits for the context's blocking
//   streams) says CUDA_ERROR_NOT_READY, and cuEventSynchronize, cuStreamSynchronize,
//   cuCtxSynchronize, cuMemFree and cuMemFreeHost (which wait for the context's streams: the
//   Programming Guide's "Implicit Synchronization") wait for it. A wait that has not ended after
//   FAKE_CUDA_HANG_MS milliseconds (default 3000) is one a GPU would never end: it says so on
//   stderr, counts in fake_cuda_stat("hangs") and returns CUDA_ERROR_NOT_READY.
// - cuDevicePrimaryCtxReset (what cudaDeviceReset calls) frees the primary context's memory,
//   unloads its modules and destroys its streams; the context stays retained, and usable.
//
// Kernels: cuModuleLoadData takes NUL-terminated PTX text that declares `.entry
// mori_copy_kernel(` (anything else is CUDA_ERROR_INVALID_PTX), and its one function is mori-tp's
// copy kernel, whose own source (hip/copy_kernel.hip) is compiled into this library through
// hip/cpu_shim.hpp: cuLaunchKernel runs it on the CPU, every thread of every block, blocks in a
// shuffled order. It takes the kernel's argument through `kernelParams` or through `extra` with
// the driver's markers (CU_LAUNCH_PARAM_BUFFER_POINTER 1, CU_LAUNCH_PARAM_BUFFER_SIZE 2,
// CU_LAUNCH_PARAM_END 0: HIP's END value, 3, is an unknown marker here, CUDA_ERROR_INVALID_VALUE).
// A launch first runs the kernel with every load and store checked and none performed; if any
// address is memory the kernel cannot reach from the stream's device it returns
// CUDA_ERROR_ILLEGAL_ADDRESS having written nothing (a GPU would fault and abort the process).
//
// Strict where a GPU would fail: a copy any row of which leaves the device allocations (for
// device sides) or is NULL returns CUDA_ERROR_INVALID_VALUE without copying, as does
// width > pitch.
//
// Build: c++ -std=c++17 -shared -fPIC -Wl,-soname,libcuda.so.1 fake_cuda.cpp -o libcuda.so.1
// (-DFAKE_CUDA_NO_CAPTURE_MODE: a driver without cuThreadExchangeStreamCaptureMode, as one older
// than CUDA 10.1, which the library must refuse by name).
// Environment (read on every call): FAKE_CUDA_DEVICES=n (default 1; 0: cuInit returns
// CUDA_ERROR_NO_DEVICE, as the real driver does on a machine without a GPU),
// FAKE_CUDA_COPY_STATUS=<n> makes every cuMemcpy2DAsync return n without copying,
// FAKE_CUDA_LAUNCH_STATUS=<n> every cuLaunchKernel, FAKE_CUDA_HANG_MS. fake_cuda_stat(name)
// counts what happened (see there).

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define MORI_COPY_KERNEL_CPU
// Both entries: the main one and the wide one (32,760-byte argument) of the CUDA 12.1+ module.
#define MORI_COPY_WIDE_ENTRY 1
#include "../../hip/copy_kernel.hip"

// ---- cuda.h's types and values, as the driver's ABI has them ----------------------------------

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct Ctx;
struct Stream;
struct Event;
struct Module;
struct Function;
struct Graph;
struct GraphExec;
typedef Ctx *CUcontext;
typedef Stream *CUstream;
typedef Event *CUevent;
typedef Module *CUmodule;
typedef Function *CUfunction;
typedef Graph *CUgraph;
typedef GraphExec *CUgraphExec;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDA_ERROR_CAPTURED_EVENT = 907,
};

enum : int { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2, CU_MEMORYTYPE_ARRAY = 3, CU_MEMORYTYPE_UNIFIED = 4 };
enum : int { CAPTURE_GLOBAL = 0, CAPTURE_THREAD_LOCAL = 1, CAPTURE_RELAXED = 2 };
enum : int { STATUS_NONE = 0, STATUS_ACTIVE = 1, STATUS_INVALIDATED = 2 };
enum : int {
    ATTR_CONTEXT = 1,
    ATTR_MEMORY_TYPE = 2,
    ATTR_DEVICE_POINTER = 3,
    ATTR_HOST_POINTER = 4,
    ATTR_BUFFER_ID = 7,
    ATTR_DEVICE_ORDINAL = 9,
};
constexpr unsigned STREAM_NON_BLOCKING = 0x1;
constexpr uintptr_t STREAM_LEGACY = 0x1, STREAM_PER_THREAD = 0x2;

// CUDA_MEMCPY2D (cuda.h; CUDA_MEMCPY2D_v2 since CUDA 11.3, the same layout).
struct CUDA_MEMCPY2D {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
};

// ---- the model ---------------------------------------------------------------------------------

// A cuStreamWaitValue32 condition: *flag >= value.
struct Gate {
    volatile uint32_t *flag;
    uint32_t value;
};

struct Ctx {
    int device;
    bool primary;
    Stream *legacy;  // the legacy (NULL) stream of this context
};

struct Stream {
    Ctx *ctx;
    bool non_blocking;
    bool legacy;
    bool destroyed = false;
    Graph *capture = nullptr;   // the capture it records into (its own or one it joined)
    bool origin = false;        // the stream that began `capture`
    std::vector<Gate> waits;
};

struct Graph {
    std::vector<std::function<CUresult()>> work;
    bool invalidated = false;
    bool global = false;
    std::thread::id thread;     // the thread whose own capture it is (not Relaxed)
    bool owned = false;
    std::vector<Stream *> streams;  // the origin and the streams that joined
};

struct GraphExec {
    std::vector<std::function<CUresult()>> work;
};

struct Event {
    Ctx *ctx;
    Graph *captured = nullptr;  // the capture its last record went into
    Stream *recorded_on = nullptr;
    std::vector<Gate> waits;
};

struct Function {
    Module *module;
    bool wide;  // mori_copy_kernel_wide (a MoriCopyKernelWideArgs argument)
};

// A loaded module: the entries its PTX declared (mori_copy_kernel, mori_copy_kernel_wide).
struct Module {
    Ctx *ctx;
    bool live;
    Function function;
    Function wide_function;
    bool has_main;
    bool has_wide;
};

namespace {

std::recursive_mutex lock;
using Guard = std::lock_guard<std::recursive_mutex>;

struct Allocation {
    size_t size;
    Ctx *ctx;
    unsigned long long id;  // CU_POINTER_ATTRIBUTE_BUFFER_ID: unique for the process
};
unsigned long long next_buffer_id = 1;
std::map<uintptr_t, unsigned long long> pinned_ids;     // cuMemHostAlloc'd memory's ids

std::map<uintptr_t, Allocation> device_memory;          // cuMemAlloc
std::map<uintptr_t, size_t> pinned_memory;              // cuMemHostAlloc
std::map<uintptr_t, size_t> registered_memory;          // cuMemHostRegister
std::set<std::pair<int, int>> peer_access;              // (device, peer it reaches)
std::vector<Ctx *> primaries;                           // per device, made on first retain
std::vector<Ctx *> contexts;                            // every context made
std::vector<Stream *> streams;                          // every stream made
std::vector<Graph *> captures;                          // active captures
std::map<std::string, long> stats;
uint64_t launches = 0;
bool initialized = false;
thread_local std::vector<Ctx *> ctx_stack;
thread_local int capture_mode = CAPTURE_GLOBAL;

int device_count() {
    const char *devices = std::getenv("FAKE_CUDA_DEVICES");
    return devices == nullptr ? 1 : std::atoi(devices);
}

void count(const char *what) {
    Guard guard(lock);
    stats[what]++;
}

void count_load_failure() {
    count("module_load_failures");
}

CUresult status_from_env(const char *name) {
    const char *status = std::getenv(name);
    return status == nullptr ? CUDA_SUCCESS : std::atoi(status);
}

Ctx *current() {
    return ctx_stack.empty() ? nullptr : ctx_stack.back();
}

// Memory from addresses of its own (as a GPU's aperture is): a freed address is never reused.
void *reserve(size_t size) {
    void *p = mmap(nullptr, size == 0 ? 1 : size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
}

void retire(void *p, size_t size) {
    mprotect(p, size == 0 ? 1 : size, PROT_NONE);
}

template <class Map>
typename Map::const_iterator holding(const Map &map, uintptr_t p, size_t len) {
    auto next = map.upper_bound(p);
    if (next == map.begin()) return map.end();
    auto it = std::prev(next);
    size_t size;
    if constexpr (std::is_same_v<typename Map::mapped_type, size_t>) {
        size = it->second;
    } else {
        size = it->second.size;
    }
    return p >= it->first && p + len >= p && p + len <= it->first + size ? it : map.end();
}

const Allocation *device_allocation(uintptr_t p, size_t len) {
    Guard guard(lock);
    auto it = holding(device_memory, p, len);
    return it == device_memory.end() ? nullptr : &it->second;
}

bool pinned(uintptr_t p, size_t len) {
    Guard guard(lock);
    return holding(pinned_memory, p, len) != pinned_memory.end() ||
           holding(registered_memory, p, len) != registered_memory.end();
}

// The stream a handle names: the legacy stream of the current context for NULL, CU_STREAM_LEGACY
// and CU_STREAM_PER_THREAD (modelled as the legacy one), else the handle; nullptr when a default
// stream is named with no context current.
Stream *resolve(CUstream handle) {
    const uintptr_t h = reinterpret_cast<uintptr_t>(handle);
    if (h == 0 || h == STREAM_LEGACY || h == STREAM_PER_THREAD) {
        Ctx *ctx = current();
        return ctx == nullptr ? nullptr : ctx->legacy;
    }
    return handle;
}

Stream *new_stream(Ctx *ctx, bool non_blocking, bool legacy) {
    auto *s = new Stream{ctx, non_blocking, legacy, false, nullptr, false, {}};
    Guard guard(lock);
    streams.push_back(s);
    return s;
}

Ctx *new_context(int device, bool primary) {
    auto *ctx = new Ctx{device, primary, nullptr};
    ctx->legacy = new_stream(ctx, false, true);
    Guard guard(lock);
    contexts.push_back(ctx);
    return ctx;
}

void invalidate(Graph *graph) {
    if (graph != nullptr && !graph->invalidated) {
        graph->invalidated = true;
        stats["invalidated_captures"]++;
    }
}

// A potentially unsafe call from this thread: true (and the captures invalidated) when refused.
bool capture_unsupported() {
    Guard guard(lock);
    if (capture_mode == CAPTURE_RELAXED) return false;
    bool refused = false;
    for (Graph *g : captures) {
        const bool own = g->owned && g->thread == std::this_thread::get_id();
        if (own || (capture_mode == CAPTURE_GLOBAL && g->global)) {
            invalidate(g);
            refused = true;
        }
    }
    return refused;
}

// Use of the legacy stream while a blocking stream of its context captures: true (and that
// capture invalidated) when refused.
bool implicit_capture(Stream *s) {
    Guard guard(lock);
    if (s == nullptr || !s->legacy) return false;
    bool refused = false;
    for (Graph *g : captures) {
        for (Stream *t : g->streams) {
            if (t->ctx == s->ctx && !t->non_blocking) {
                invalidate(g);
                refused = true;
            }
        }
    }
    return refused;
}

// Runs `work` now, or records it in the capture `s` records into.
CUresult run_or_capture(Stream *s, std::function<CUresult()> work) {
    {
        Guard guard(lock);
        if (s->capture != nullptr) {
            s->capture->work.push_back(std::move(work));
            return CUDA_SUCCESS;
        }
    }
    return work();
}

// What work enqueued on `s` now waits for: its own waits; for a legacy stream, also those of
// every blocking stream of its context.
std::vector<Gate> waits_of(Stream *s) {
    Guard guard(lock);
    std::vector<Gate> waits = s->waits;
    if (s->legacy) {
        for (Stream *t : streams) {
            if (t != s && !t->destroyed && !t->non_blocking && t->ctx == s->ctx) {
                waits.insert(waits.end(), t->waits.begin(), t->waits.end());
            }
        }
    }
    return waits;
}

bool passed(const std::vector<Gate> &waits) {
    for (const Gate &gate : waits) {
        if (*gate.flag < gate.value) return false;
    }
    return true;
}

CUresult wait_for(const std::vector<Gate> &waits, const char *what, const void *on) {
    const char *ms = std::getenv("FAKE_CUDA_HANG_MS");
    const long limit = ms == nullptr ? 3000 : std::atol(ms);
    const auto start = std::chrono::steady_clock::now();
    while (!passed(waits)) {
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(limit)) {
            std::fprintf(stderr, "fake_cuda: %s(%p) still waits after %ld ms: on a GPU it would never return\n",
                         what, on, limit);
            count("hangs");
            return CUDA_ERROR_NOT_READY;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return CUDA_SUCCESS;
}

// What a free waits for: every stream of `ctx`.
CUresult sync_context(Ctx *ctx, const char *what, const void *on) {
    std::vector<Gate> waits;
    {
        Guard guard(lock);
        for (Stream *s : streams) {
            if (!s->destroyed && s->ctx == ctx) waits.insert(waits.end(), s->waits.begin(), s->waits.end());
        }
    }
    return wait_for(waits, what, on);
}

// Where a copy's side may be: device memory (any context), or host memory.
bool row_ok(uintptr_t row, size_t len, bool device) {
    if (row == 0) return false;
    return device ? device_allocation(row, len) != nullptr : device_allocation(row, 1) == nullptr;
}

CUresult copy_2d(uintptr_t dst, size_t dpitch, uintptr_t src, size_t spitch, size_t width, size_t height) {
    if (width > dpitch || width > spitch) return CUDA_ERROR_INVALID_VALUE;
    const bool dst_device = device_allocation(dst, 1) != nullptr, src_device = device_allocation(src, 1) != nullptr;
    for (size_t r = 0; r < height; r++) {
        if (!row_ok(dst + r * dpitch, width, dst_device) || !row_ok(src + r * spitch, width, src_device)) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (size_t r = 0; r < height; r++) {
        std::memmove(reinterpret_cast<void *>(dst + r * dpitch), reinterpret_cast<const void *>(src + r * spitch),
                     width);
    }
    return CUDA_SUCCESS;
}

// Memory a kernel on `device` reaches: that device's memory, a peer's with access enabled, and
// pinned or registered host memory (at its host address: unified addressing).
bool kernel_reaches(int device, uintptr_t address, size_t len) {
    if (const Allocation *a = device_allocation(address, len)) {
        Guard guard(lock);
        return a->ctx->device == device || peer_access.count({device, a->ctx->device}) != 0;
    }
    return pinned(address, len);
}

// The check pass of a launch: every load and store is checked and none performed.
struct LaunchCheck {
    bool active = false;
    int device = 0;
    bool fault = false;
    alignas(64) unsigned char scratch[64] = {};
};
thread_local LaunchCheck launch_check;

uint64_t checked_translate(uint64_t address) {
    if (!launch_check.active) return address;
    if (!kernel_reaches(launch_check.device, address, 1)) launch_check.fault = true;
    return reinterpret_cast<uint64_t>(launch_check.scratch);
}

// The table the kernel reads (directly, not through the check pass) must be memory it reaches,
// unless it travels inside the argument.
template <class Args>
bool table_reachable(const Args &a, int device) {
    if (a.table == 0) return a.table_bytes <= sizeof a.inline_table;
    return kernel_reaches(device, static_cast<uintptr_t>(a.table), a.table_bytes);
}

// The driver's version, as cuDriverGetVersion says it (1000 * major + 10 * minor):
// FAKE_CUDA_DRIVER_VERSION, default 12080 (CUDA 12.8).
int driver_version() {
    const char *version = std::getenv("FAKE_CUDA_DRIVER_VERSION");
    return version == nullptr ? 12080 : std::atoi(version);
}

// The first driver that takes kernel parameters beyond 4 KiB (CUDA 12.1, PTX ISA 8.1) and the
// most bytes it takes then (CUDA C++ Programming Guide, "Function Parameters": 32,764 bytes).
constexpr int kLargeParamsDriver = 12010;
constexpr size_t kOldParamBytes = 4096;
constexpr size_t kLargeParamBytes = 32764;

// The launch's argument buffer: through kernelParams (params[0] points at the struct) or `extra`.
// Its size must be the function's argument struct's: what a driver before 12.1 refuses beyond
// 4 KiB (CUDA_ERROR_INVALID_VALUE, as a launch whose parameters exceed the limit is), is refused
// as the same status here.
template <class Args>
CUresult kernel_args(void **params, void **extra, Args &args) {
    if ((params == nullptr) == (extra == nullptr)) return CUDA_ERROR_INVALID_VALUE;
    const size_t most = driver_version() >= kLargeParamsDriver ? kLargeParamBytes : kOldParamBytes;
    if (sizeof args > most) {
        std::fprintf(stderr,
                     "fake_cuda: cuLaunchKernel: a %zu-byte kernel argument on driver %d, which takes at most %zu "
                     "bytes\n",
                     sizeof args, driver_version(), most);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (params != nullptr) {
        std::memcpy(&args, params[0], sizeof args);
        return CUDA_SUCCESS;
    }
    const void *buffer = nullptr;
    const size_t *size = nullptr;
    for (size_t i = 0; extra[i] != nullptr; i += 2) {  // CU_LAUNCH_PARAM_END is 0
        const uintptr_t marker = reinterpret_cast<uintptr_t>(extra[i]);
        if (marker == 0x01) {
            buffer = extra[i + 1];
        } else if (marker == 0x02) {
            size = static_cast<const size_t *>(extra[i + 1]);
        } else {
            std::fprintf(stderr, "fake_cuda: cuLaunchKernel: unknown marker %#lx in extra (CU_LAUNCH_PARAM_END is 0)\n",
                         static_cast<unsigned long>(marker));
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (buffer == nullptr || size == nullptr || *size != sizeof args) {
        std::fprintf(stderr, "fake_cuda: cuLaunchKernel: an argument buffer of %zu bytes for a %zu-byte argument\n",
                     size == nullptr ? size_t{0} : *size, sizeof args);
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::memcpy(&args, buffer, sizeof args);
    return CUDA_SUCCESS;
}

const char *error_name(CUresult status) {
    switch (status) {
#define NAME(x) \
    case x:     \
        return #x;
        NAME(CUDA_SUCCESS)
        NAME(CUDA_ERROR_INVALID_VALUE)
        NAME(CUDA_ERROR_OUT_OF_MEMORY)
        NAME(CUDA_ERROR_NOT_INITIALIZED)
        NAME(CUDA_ERROR_NO_DEVICE)
        NAME(CUDA_ERROR_INVALID_DEVICE)
        NAME(CUDA_ERROR_INVALID_IMAGE)
        NAME(CUDA_ERROR_INVALID_CONTEXT)
        NAME(CUDA_ERROR_INVALID_PTX)
        NAME(CUDA_ERROR_UNSUPPORTED_PTX_VERSION)
        NAME(CUDA_ERROR_INVALID_HANDLE)
        NAME(CUDA_ERROR_NOT_FOUND)
        NAME(CUDA_ERROR_NOT_READY)
        NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
        NAME(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
        NAME(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
        NAME(CUDA_ERROR_CONTEXT_IS_DESTROYED)
        NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        NAME(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        NAME(CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
        NAME(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        NAME(CUDA_ERROR_CAPTURED_EVENT)
#undef NAME
    default:
        return nullptr;
    }
}

// The rest of a cuLaunchKernel once its argument is read: `kernel` with `args` on stream `s`,
// run now or captured (counted as `stat` too, when not null).
template <class Args>
CUresult launch(Stream *s, MoriDim3 grid, MoriDim3 block, void (*kernel)(Args), std::shared_ptr<Args> args,
                const char *stat) {
    if (implicit_capture(s)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    const int device = s->ctx->device;
    if (s->capture != nullptr) count("captured_launches");
    // FAKE_CUDA_LAUNCH_SLEEP_MS=<n>: the call takes n ms more, holding none of the stand-in's
    // locks (a test forks while another thread is inside a send).
    if (const char *ms = std::getenv("FAKE_CUDA_LAUNCH_SLEEP_MS")) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
    }
    // `args` is a copy made now: a captured launch keeps it in the graph's node.
    return run_or_capture(s, [=] {
        if (!table_reachable(*args, device)) return CUDA_ERROR_ILLEGAL_ADDRESS;
        uint64_t seed;
        {
            Guard guard(lock);
            seed = ++launches;
        }
        mori_cpu_translate = checked_translate;
        launch_check.active = true;
        launch_check.device = device;
        launch_check.fault = false;
        mori_cpu_launch(kernel, grid, block, *args, seed);
        launch_check.active = false;
        if (launch_check.fault) return CUDA_ERROR_ILLEGAL_ADDRESS;
        mori_cpu_launch(kernel, grid, block, *args, seed);
        count("kernel_launches");
        if (stat != nullptr) count(stat);
        return CUDA_SUCCESS;
    });
}

}  // namespace

#define NEED_INIT                                                  \
    do {                                                           \
        if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;       \
    } while (0)
#define NEED_CONTEXT                                               \
    do {                                                           \
        NEED_INIT;                                                 \
        if (current() == nullptr) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

extern "C" {

// How often something happened in this process: "module_loads", "kernel_launches" (kernels
// run), "memcpy2d_calls" (cuMemcpy2DAsync calls accepted), "graph_launches",
// "invalidated_captures", "hangs", "primary_retains", "context_pushes"; "htod_copies",
// "mem_allocs", "host_allocs", "events_created", "streams_created" (calls of
// cuMemcpyHtoDAsync, cuMemAlloc, cuMemHostAlloc, cuEventCreate and cuStreamCreate that
// succeeded, 0-byte copies included); "captured_launches" (cuLaunchKernel calls recorded into a
// graph); "module_load_failures" (cuModuleLoadDataEx calls that failed); "wide_launches"
// (kernels run of the wide entry, mori_copy_kernel_wide, which kernel_launches counts too); -1
// for an unknown name.
long fake_cuda_stat(const char *name) {
    Guard guard(lock);
    auto it = stats.find(name);
    if (it != stats.end()) return it->second;
    for (const char *known :
         {"module_loads", "kernel_launches", "memcpy2d_calls", "graph_launches", "invalidated_captures", "hangs",
          "primary_retains", "context_pushes", "htod_copies", "mem_allocs", "host_allocs", "events_created",
          "streams_created", "captured_launches", "module_load_failures", "wide_launches"}) {
        if (std::strcmp(known, name) == 0) return 0;
    }
    return -1;
}

CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (device_count() <= 0) return CUDA_ERROR_NO_DEVICE;
    // fork: the stand-in's own lock is taken before a fork and released on both sides, so that
    // a child forked while another thread is inside the stand-in finds it unlocked (what the
    // child then meets is the caller's own state: mori-tp's, which it must refuse).
    static std::once_flag at_fork;
    std::call_once(at_fork, [] {
        // The child made afresh: a recursive mutex remembers its owner's thread id, which the
        // child's thread does not have, so it could not unlock it.
        pthread_atfork([] { lock.lock(); }, [] { lock.unlock(); }, [] { new (&lock) std::recursive_mutex(); });
    });
    Guard guard(lock);
    initialized = true;
    primaries.resize(static_cast<size_t>(device_count()), nullptr);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *version = driver_version();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    NEED_INIT;
    if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    NEED_INIT;
    if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    NEED_INIT;
    if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    std::snprintf(name, static_cast<size_t>(len), "fake_cuda device %d (host memory, not a GPU)", device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice device, CUdevice peer) {
    NEED_INIT;
    if (can == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || peer < 0 || device >= device_count() || peer >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *can = device != peer && std::getenv("FAKE_CUDA_NO_PEER") == nullptr;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    NEED_INIT;
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    Guard guard(lock);
    if (primaries[static_cast<size_t>(device)] == nullptr) {
        primaries[static_cast<size_t>(device)] = new_context(device, true);
    }
    stats["primary_retains"]++;
    *ctx = primaries[static_cast<size_t>(device)];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    NEED_INIT;
    return device < 0 || device >= device_count() ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

// cudaDeviceReset: the primary context's memory freed, its modules unloaded, its streams
// destroyed (handles stay readable); the context itself stays retained and usable.
CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    NEED_INIT;
    if (device < 0 || device >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    Guard guard(lock);
    Ctx *ctx = primaries[static_cast<size_t>(device)];
    if (ctx == nullptr) return CUDA_SUCCESS;
    for (auto it = device_memory.begin(); it != device_memory.end();) {
        if (it->second.ctx == ctx) {
            retire(reinterpret_cast<void *>(it->first), it->second.size);
            it = device_memory.erase(it);
        } else {
            ++it;
        }
    }
    for (Stream *s : streams) {
        if (s->ctx == ctx && !s->legacy) s->destroyed = true;
    }
    stats["resets"]++;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned, CUdevice device) {
    NEED_INIT;
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = new_context(device, false);
    ctx_stack.push_back(*ctx);
    return CUDA_SUCCESS;
}

// Leaves the context's memory and streams to the model (nothing is reused); pops it where it is
// current.
CUresult cuCtxDestroy_v2(CUcontext ctx) {
    NEED_INIT;
    if (ctx == nullptr || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack.erase(std::remove(ctx_stack.begin(), ctx_stack.end(), ctx), ctx_stack.end());
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    NEED_INIT;
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current();
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED_INIT;
    if (ctx == nullptr) {
        if (!ctx_stack.empty()) ctx_stack.pop_back();
        return CUDA_SUCCESS;
    }
    if (ctx_stack.empty()) {
        ctx_stack.push_back(ctx);
    } else {
        ctx_stack.back() = ctx;
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    NEED_INIT;
    if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack.push_back(ctx);
    count("context_pushes");
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    NEED_INIT;
    if (ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx != nullptr) *ctx = ctx_stack.back();
    ctx_stack.pop_back();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    NEED_CONTEXT;
    if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *device = current()->device;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    NEED_CONTEXT;
    return sync_context(current(), "cuCtxSynchronize", current());
}

CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned) {
    NEED_CONTEXT;
    if (peer == nullptr || peer->device == current()->device) return CUDA_ERROR_INVALID_DEVICE;
    Guard guard(lock);
    return peer_access.insert({current()->device, peer->device}).second ? CUDA_SUCCESS
                                                                        : CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
}

CUresult cuGetErrorName(CUresult status, const char **name) {
    if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const char *known = error_name(status);
    if (known == nullptr) {
        *name = nullptr;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *name = known;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult status, const char **text) {
    return cuGetErrorName(status, text);
}

#ifndef FAKE_CUDA_NO_CAPTURE_MODE
// CUDA 10.1 and later.
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (mode == nullptr || *mode < CAPTURE_GLOBAL || *mode > CAPTURE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    const int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    return CUDA_SUCCESS;
}
#endif

CUresult cuStreamCreate(CUstream *stream, unsigned flags) {
    NEED_CONTEXT;
    if (stream == nullptr || (flags & ~STREAM_NON_BLOCKING) != 0) return CUDA_ERROR_INVALID_VALUE;
    *stream = new_stream(current(), flags == STREAM_NON_BLOCKING, false);
    count("streams_created");
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream stream) {
    Stream *s = resolve(stream);
    if (s == nullptr || s->legacy || s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    s->destroyed = true;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream stream, CUcontext *ctx) {
    NEED_INIT;
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    Stream *s = resolve(stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    *ctx = s->ctx;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, int *status) {
    NEED_INIT;
    if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
    Stream *s = resolve(stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    Guard guard(lock);
    if (s->legacy) {
        // Asking about the legacy stream while a blocking stream of its context captures.
        for (Graph *g : captures) {
            for (Stream *t : g->streams) {
                if (t->ctx == s->ctx && !t->non_blocking) {
                    *status = STATUS_ACTIVE;
                    return CUDA_SUCCESS;
                }
            }
        }
    }
    *status = s->capture == nullptr ? STATUS_NONE : s->capture->invalidated ? STATUS_INVALIDATED : STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture_v2(CUstream stream, int mode) {
    NEED_INIT;
    Stream *s = resolve(stream);
    if (s == nullptr || s->legacy || s->capture != nullptr || mode < CAPTURE_GLOBAL || mode > CAPTURE_RELAXED) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Guard guard(lock);
    auto *g = new Graph{};
    g->global = mode == CAPTURE_GLOBAL;
    g->owned = mode != CAPTURE_RELAXED;
    g->thread = std::this_thread::get_id();
    g->streams.push_back(s);
    s->capture = g;
    s->origin = true;
    captures.push_back(g);
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph) {
    NEED_INIT;
    Stream *s = resolve(stream);
    if (s == nullptr || s->capture == nullptr || !s->origin || graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
    Guard guard(lock);
    Graph *g = s->capture;
    for (Stream *t : g->streams) {
        t->capture = nullptr;
        t->origin = false;
    }
    captures.erase(std::remove(captures.begin(), captures.end(), g), captures.end());
    if (g->invalidated) {
        *graph = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = g;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long) {
    if (exec == nullptr || graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *exec = new GraphExec{graph->work};
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    NEED_CONTEXT;
    Stream *s = resolve(stream);
    if (exec == nullptr || s == nullptr) return CUDA_ERROR_INVALID_VALUE;
    count("graph_launches");
    for (const auto &work : exec->work) {
        if (const CUresult status = run_or_capture(s, work); status != CUDA_SUCCESS) return status;
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec exec) {
    delete exec;
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph graph) {
    delete graph;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream) {
    NEED_INIT;
    Stream *s = resolve(stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    {
        Guard guard(lock);
        if (s->capture != nullptr) {
            invalidate(s->capture);
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    if (implicit_capture(s)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    return wait_for(waits_of(s), "cuStreamSynchronize", s);
}

// Later work on `stream` waits until *ptr >= value (CU_STREAM_WAIT_VALUE_GEQ; other flags are
// not modelled).
CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr ptr, uint32_t value, unsigned) {
    Stream *s = resolve(stream);
    if (s == nullptr || ptr == 0) return CUDA_ERROR_INVALID_VALUE;
    Guard guard(lock);
    s->waits.push_back(Gate{reinterpret_cast<volatile uint32_t *>(ptr), value});
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr ptr, uint32_t value, unsigned flags) {
    return cuStreamWaitValue32(stream, ptr, value, flags);
}

CUresult cuEventCreate(CUevent *event, unsigned) {
    NEED_CONTEXT;
    if (event == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *event = new Event{current(), nullptr, nullptr, {}};
    count("events_created");
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
    delete event;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
    NEED_INIT;
    if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    Stream *s = resolve(stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    // "cudaEventRecord() will fail if the input event and input stream are associated to
    // different devices" (here: contexts).
    if (event->ctx != s->ctx) return CUDA_ERROR_INVALID_HANDLE;
    if (implicit_capture(s)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    Guard guard(lock);
    event->recorded_on = s;
    event->captured = s->capture;
    event->waits = s->capture == nullptr ? waits_of(s) : std::vector<Gate>{};
    return CUDA_SUCCESS;
}

// True (and the capture invalidated) when `event` was last recorded in a capture still going.
static bool captured_event(CUevent event) {
    Guard guard(lock);
    if (event->captured != nullptr &&
        std::find(captures.begin(), captures.end(), event->captured) != captures.end()) {
        invalidate(event->captured);
        return true;
    }
    return false;
}

CUresult cuEventQuery(CUevent event) {
    NEED_INIT;
    if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (captured_event(event)) return CUDA_ERROR_CAPTURED_EVENT;
    Guard guard(lock);
    return passed(event->waits) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent event) {
    NEED_INIT;
    if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (captured_event(event)) return CUDA_ERROR_CAPTURED_EVENT;
    std::vector<Gate> waits;
    {
        Guard guard(lock);
        waits = event->waits;
    }
    return wait_for(waits, "cuEventSynchronize", event);
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags) {
    NEED_INIT;
    if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    Stream *s = resolve(stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    Guard guard(lock);
    const bool live_capture = event->captured != nullptr &&
                              std::find(captures.begin(), captures.end(), event->captured) != captures.end();
    if (s->capture != nullptr) {
        if (!live_capture || event->captured != s->capture) {
            invalidate(s->capture);
            if (live_capture) invalidate(event->captured);
            return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
        }
        return CUDA_SUCCESS;  // an in-capture dependency
    }
    if (live_capture) {
        // The stream joins the capture: its later work is captured.
        s->capture = event->captured;
        event->captured->streams.push_back(s);
        return CUDA_SUCCESS;
    }
    s->waits.insert(s->waits.end(), event->waits.begin(), event->waits.end());
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *pointer, size_t size) {
    NEED_CONTEXT;
    if (pointer == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    void *p = reserve(size);
    if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    Guard guard(lock);
    device_memory[reinterpret_cast<uintptr_t>(p)] = Allocation{size, current(), next_buffer_id++};
    *pointer = reinterpret_cast<CUdeviceptr>(p);
    stats["mem_allocs"]++;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr pointer) {
    NEED_CONTEXT;
    if (pointer == 0) return CUDA_SUCCESS;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    Ctx *owner;
    {
        Guard guard(lock);
        auto it = device_memory.find(static_cast<uintptr_t>(pointer));
        if (it == device_memory.end()) return CUDA_ERROR_INVALID_VALUE;
        owner = it->second.ctx;
    }
    if (const CUresult status = sync_context(owner, "cuMemFree", reinterpret_cast<void *>(pointer));
        status != CUDA_SUCCESS) {
        return status;
    }
    Guard guard(lock);
    auto it = device_memory.find(static_cast<uintptr_t>(pointer));
    retire(reinterpret_cast<void *>(pointer), it->second.size);
    device_memory.erase(it);
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void **pointer, size_t size, unsigned) {
    NEED_CONTEXT;
    if (pointer == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    void *p = reserve(size);
    if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    Guard guard(lock);
    pinned_memory[reinterpret_cast<uintptr_t>(p)] = size;
    pinned_ids[reinterpret_cast<uintptr_t>(p)] = next_buffer_id++;
    *pointer = p;
    stats["host_allocs"]++;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *pointer) {
    NEED_CONTEXT;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (const CUresult status = sync_context(current(), "cuMemFreeHost", pointer); status != CUDA_SUCCESS) {
        return status;
    }
    Guard guard(lock);
    auto it = pinned_memory.find(reinterpret_cast<uintptr_t>(pointer));
    if (it == pinned_memory.end()) return CUDA_ERROR_INVALID_VALUE;
    retire(pointer, it->second);
    pinned_memory.erase(it);
    return CUDA_SUCCESS;
}

CUresult cuMemHostRegister_v2(void *pointer, size_t size, unsigned) {
    NEED_CONTEXT;
    if (pointer == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    Guard guard(lock);
    registered_memory[reinterpret_cast<uintptr_t>(pointer)] = size;
    return CUDA_SUCCESS;
}

CUresult cuMemHostUnregister(void *pointer) {
    NEED_CONTEXT;
    Guard guard(lock);
    return registered_memory.erase(reinterpret_cast<uintptr_t>(pointer)) == 1 ? CUDA_SUCCESS
                                                                              : CUDA_ERROR_INVALID_VALUE;
}

// Unified addressing: pinned and registered memory have the same address on the device.
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *device, void *host, unsigned) {
    NEED_CONTEXT;
    if (device == nullptr || !pinned(reinterpret_cast<uintptr_t>(host), 1)) return CUDA_ERROR_INVALID_VALUE;
    *device = reinterpret_cast<CUdeviceptr>(host);
    return CUDA_SUCCESS;
}

CUresult cuPointerGetAttributes(unsigned count, int *attributes, void **data, CUdeviceptr pointer) {
    NEED_INIT;
    if (attributes == nullptr || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const uintptr_t p = static_cast<uintptr_t>(pointer);
    const Allocation *a = device_allocation(p, 1);
    const bool host = a == nullptr && pinned(p, 1);
    for (unsigned i = 0; i < count; i++) {
        switch (attributes[i]) {
        case ATTR_MEMORY_TYPE:
            *static_cast<unsigned *>(data[i]) = a != nullptr ? CU_MEMORYTYPE_DEVICE : host ? CU_MEMORYTYPE_HOST : 0;
            break;
        case ATTR_DEVICE_ORDINAL:
            *static_cast<int *>(data[i]) = a != nullptr ? a->ctx->device : host && current() ? current()->device : -2;
            break;
        case ATTR_DEVICE_POINTER:
            *static_cast<void **>(data[i]) = a != nullptr || host ? reinterpret_cast<void *>(p) : nullptr;
            break;
        case ATTR_HOST_POINTER:
            *static_cast<void **>(data[i]) = host ? reinterpret_cast<void *>(p) : nullptr;
            break;
        case ATTR_CONTEXT:
            *static_cast<CUcontext *>(data[i]) = a != nullptr ? a->ctx : nullptr;
            break;
        case ATTR_BUFFER_ID: {
            // The allocation's id (device memory and cuMemHostAlloc'd memory; 0, the default,
            // for memory the driver does not know or only registered).
            unsigned long long id = a != nullptr ? a->id : 0;
            if (a == nullptr) {
                Guard guard(lock);
                auto it = holding(pinned_memory, p, 1);
                if (it != pinned_memory.end()) id = pinned_ids[it->first];
            }
            *static_cast<unsigned long long *>(data[i]) = id;
            break;
        }
        default:
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr pointer) {
    NEED_CONTEXT;
    Guard guard(lock);
    auto it = holding(device_memory, static_cast<uintptr_t>(pointer), 1);
    if (it == device_memory.end()) return CUDA_ERROR_NOT_FOUND;
    if (base != nullptr) *base = it->first;
    if (size != nullptr) *size = it->second.size;
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr pointer, unsigned char value, size_t size) {
    NEED_CONTEXT;
    if (device_allocation(static_cast<uintptr_t>(pointer), size) == nullptr) return CUDA_ERROR_INVALID_VALUE;
    std::memset(reinterpret_cast<void *>(pointer), value, size);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size) {
    NEED_CONTEXT;
    if (device_allocation(static_cast<uintptr_t>(dst), size) == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (implicit_capture(current()->legacy)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    std::memcpy(reinterpret_cast<void *>(dst), src, size);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    NEED_CONTEXT;
    if (device_allocation(static_cast<uintptr_t>(src), size) == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (implicit_capture(current()->legacy)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    std::memcpy(dst, reinterpret_cast<const void *>(src), size);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t size, CUstream stream) {
    NEED_CONTEXT;
    Stream *s = resolve(stream);
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    if (device_allocation(static_cast<uintptr_t>(dst), size) == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (implicit_capture(s)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    count("htod_copies");
    return run_or_capture(s, [=] {
        std::memcpy(reinterpret_cast<void *>(dst), src, size);
        return CUDA_SUCCESS;
    });
}

CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *copy, CUstream stream) {
    NEED_CONTEXT;
    if (const CUresult status = status_from_env("FAKE_CUDA_COPY_STATUS"); status != CUDA_SUCCESS) return status;
    if (copy == nullptr) return CUDA_ERROR_INVALID_VALUE;
    Stream *s = resolve(stream);
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    if (copy->srcMemoryType != CU_MEMORYTYPE_UNIFIED || copy->dstMemoryType != CU_MEMORYTYPE_UNIFIED ||
        copy->srcXInBytes != 0 || copy->srcY != 0 || copy->dstXInBytes != 0 || copy->dstY != 0) {
        return CUDA_ERROR_INVALID_VALUE;  // only what the library uses is modelled
    }
    if (implicit_capture(s)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    count("memcpy2d_calls");
    const CUDA_MEMCPY2D c = *copy;
    return run_or_capture(s, [=] {
        return copy_2d(static_cast<uintptr_t>(c.dstDevice), c.dstPitch, static_cast<uintptr_t>(c.srcDevice), c.srcPitch,
                       c.WidthInBytes, c.Height);
    });
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    NEED_CONTEXT;
    if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    // NUL-terminated PTX text (within 16 MiB) that declares the kernel's entry.
    const char *text = static_cast<const char *>(image);
    const size_t len = strnlen(text, 16u << 20);
    const std::string ptx(text, len);
    const bool has_main = ptx.find(".entry " MORI_COPY_KERNEL_NAME "(") != std::string::npos;
    const bool has_wide = ptx.find(".entry " MORI_COPY_WIDE_KERNEL_NAME "(") != std::string::npos;
    const size_t version_at = ptx.find(".version ");
    if (len == 16u << 20 || version_at == std::string::npos || !(has_main || has_wide)) {
        return CUDA_ERROR_INVALID_PTX;
    }
    // A driver JIT-compiles PTX of the ISA versions it knows: 8.1 from CUDA 12.1 on.
    unsigned major = 0, minor = 0;
    if (std::sscanf(ptx.c_str() + version_at, ".version %u.%u", &major, &minor) != 2) return CUDA_ERROR_INVALID_PTX;
    if ((major > 8 || (major == 8 && minor >= 1)) && driver_version() < kLargeParamsDriver) {
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    }
    auto *loaded = new Module{current(), true, {nullptr, false}, {nullptr, true}, has_main, has_wide};
    loaded->function.module = loaded;
    loaded->wide_function.module = loaded;
    *module = loaded;
    count("module_loads");
    return CUDA_SUCCESS;
}

// cuModuleLoadData with JIT options: the logs the library asks for (CU_JIT_INFO_LOG_BUFFER 3,
// CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES 4, CU_JIT_ERROR_LOG_BUFFER 5,
// CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6; a size travels in the pointer's place, as cuda.h says);
// other options are CUDA_ERROR_INVALID_VALUE here. The load itself is cuModuleLoadData's; on
// failure the error log names the status. FAKE_CUDA_MODULE_LOAD_STATUS=<n> with
// FAKE_CUDA_MODULE_LOAD_FAILS=<count> (default 1) makes the first <count> loads of the process
// fail with n (e.g. 2, CUDA_ERROR_OUT_OF_MEMORY, as a JIT on a full GPU can) and write
// "fake_cuda: injected load failure <n>" into the error log.
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned count, int *options, void **values) {
    NEED_CONTEXT;
    if (count > 0 && (options == nullptr || values == nullptr)) return CUDA_ERROR_INVALID_VALUE;
    char *logs[2] = {nullptr, nullptr};
    size_t sizes[2] = {0, 0};
    for (unsigned i = 0; i < count; i++) {
        switch (options[i]) {
        case 3: logs[0] = static_cast<char *>(values[i]); break;
        case 4: sizes[0] = reinterpret_cast<uintptr_t>(values[i]); break;
        case 5: logs[1] = static_cast<char *>(values[i]); break;
        case 6: sizes[1] = reinterpret_cast<uintptr_t>(values[i]); break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (int k = 0; k < 2; k++) {
        if (logs[k] != nullptr && sizes[k] > 0) logs[k][0] = 0;
    }
    CUresult status = CUDA_SUCCESS;
    {
        static int failed = 0;
        const CUresult injected = status_from_env("FAKE_CUDA_MODULE_LOAD_STATUS");
        const char *fails = std::getenv("FAKE_CUDA_MODULE_LOAD_FAILS");
        Guard guard(lock);
        if (injected != CUDA_SUCCESS && failed < (fails == nullptr ? 1 : std::atoi(fails))) {
            failed++;
            status = injected;
        }
    }
    // FAKE_CUDA_WIDE_LOAD_STATUS=<n>: every load of PTX that declares the wide entry fails with n.
    if (status == CUDA_SUCCESS && image != nullptr &&
        std::strstr(static_cast<const char *>(image), ".entry " MORI_COPY_WIDE_KERNEL_NAME "(") != nullptr) {
        status = status_from_env("FAKE_CUDA_WIDE_LOAD_STATUS");
    }
    if (status == CUDA_SUCCESS) status = cuModuleLoadData(module, image);
    if (status != CUDA_SUCCESS) {
        count_load_failure();
        if (logs[1] != nullptr && sizes[1] > 0) {
            std::snprintf(logs[1], sizes[1], "fake_cuda: load failure %d (ptxas fatal: a stand-in's log)", status);
        }
    }
    return status;
}

CUresult cuModuleUnload(CUmodule module) {
    NEED_CONTEXT;
    if (module == nullptr || !module->live) return CUDA_ERROR_INVALID_HANDLE;
    if (capture_unsupported()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    module->live = false;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    NEED_CONTEXT;
    if (function == nullptr || module == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!module->live) return CUDA_ERROR_INVALID_HANDLE;
    if (module->has_main && std::strcmp(name, MORI_COPY_KERNEL_NAME) == 0) {
        *function = &module->function;
        return CUDA_SUCCESS;
    }
    if (module->has_wide && std::strcmp(name, MORI_COPY_WIDE_KERNEL_NAME) == 0) {
        *function = &module->wide_function;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_NOT_FOUND;
}

// CU_DEVICE_ATTRIBUTE_MAX_PITCH (11): FAKE_CUDA_MAX_PITCH, else 2147483647 (what NVIDIA GPUs
// report); other attributes are CUDA_ERROR_INVALID_VALUE here.
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    NEED_INIT;
    if (value == nullptr || attribute != 11) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    const char *pitch = std::getenv("FAKE_CUDA_MAX_PITCH");
    *value = pitch == nullptr ? 2147483647 : std::atoi(pitch);
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                        unsigned block_y, unsigned block_z, unsigned shared, CUstream stream, void **params,
                        void **extra) {
    NEED_CONTEXT;
    if (const CUresult status = status_from_env("FAKE_CUDA_LAUNCH_STATUS"); status != CUDA_SUCCESS) return status;
    if (f == nullptr || !f->module->live) return CUDA_ERROR_INVALID_HANDLE;
    // The function's module must be of the current context.
    if (f->module->ctx != current()) return CUDA_ERROR_INVALID_CONTEXT;
    Stream *s = resolve(stream);
    if (s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    // "A kernel launch will fail if it is issued to a stream that is not associated to the
    // current device."
    if (s->ctx != current()) return CUDA_ERROR_INVALID_HANDLE;
    if (grid_x == 0 || grid_y == 0 || grid_z == 0 || block_x == 0 || block_y == 0 || block_z == 0 || shared != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (uint64_t{block_x} * block_y * block_z > MORI_COPY_BLOCK_THREADS) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    const MoriDim3 grid{grid_x, grid_y, grid_z}, block{block_x, block_y, block_z};
    if (f->wide) {
        // 32 KiB: on the heap, not the caller's stack.
        auto args = std::make_shared<MoriCopyKernelWideArgs>();
        if (const CUresult status = kernel_args(params, extra, *args); status != CUDA_SUCCESS) return status;
        return launch(s, grid, block, mori_copy_kernel_wide, args, "wide_launches");
    }
    auto args = std::make_shared<MoriCopyKernelArgs>();
    if (const CUresult status = kernel_args(params, extra, *args); status != CUDA_SUCCESS) return status;
    return launch(s, grid, block, mori_copy_kernel, args, nullptr);
}

}  // extern "C"
