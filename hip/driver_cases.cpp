// The CUDA backend's cases that the stand-in driver (tests/fake_cuda) models, run on the real
// driver by hip/device-check.sh (step driver_cases) and over the stand-in by tests/cuda_runtime.rs:
//   held_stream          a stream held by cuStreamWaitValue32 on a flag this thread raises later
//                        gets 40 uploaded-table sends with MORI_SEND_COPY_KERNEL: none may wait
//                        (issue 45.1); every byte lands once the flag is raised;
//   second_thread        two threads send uploaded tables on their own streams at once;
//   graph_capture        a capture (global mode) of an inline-table send and an uploaded-table
//                        send (flags 0: per-rect copies), while another thread sends on its own
//                        stream; the graph replayed twice, every byte checked after each replay;
//   non_primary_context  a cuCtxCreate context: flags 0 on its stream and on the NULL stream take
//                        the per-rect copies, MORI_SEND_COPY_KERNEL is refused (MORI_ERR_GPU);
//   per_thread_stream    CU_STREAM_PER_THREAD with the kernel, inline and uploaded tables.
// It needs no CUDA toolkit: the driver functions are looked up in libcuda.so.1 (signatures and
// values from cuda.h, CUDA 12 and later; the versioned symbols are the ones cuda.h maps its names
// to). Build: c++ -std=c++17 -O2 -Iinclude hip/driver_cases.cpp -L<dir> -lmori_tp -ldl -pthread.
// Exit status: 0 when every case passed, 1 when one failed, 77 when no CUDA device was found.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mori_tp.h"

namespace {

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUgraph;
typedef void *CUgraphExec;
typedef unsigned long long CUdeviceptr;

struct Driver {
    CUresult (*init)(unsigned);
    CUresult (*device_get_count)(int *);
    CUresult (*primary_retain)(CUcontext *, int);
    CUresult (*set_current)(CUcontext);
    CUresult (*ctx_create)(CUcontext *, unsigned, int);
    CUresult (*ctx_destroy)(CUcontext);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_device_pointer)(CUdeviceptr *, void *, unsigned);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_sync)(CUstream);
    CUresult (*wait_value)(CUstream, CUdeviceptr, uint32_t, unsigned);
    CUresult (*begin_capture)(CUstream, int);
    CUresult (*end_capture)(CUstream, CUgraph *);
    CUresult (*instantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*graph_launch)(CUgraphExec, CUstream);
} cu;

int failures = 0;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            std::printf(__VA_ARGS__);                     \
            std::printf("\n");                            \
            failures++;                                   \
            return;                                       \
        }                                                 \
    } while (0)

#define CU(call) CHECK((call) == 0, "%s failed", #call)

void *symbol(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (p == nullptr) {
        std::printf("FAIL: libcuda.so.1 lacks %s\n", name);
        std::exit(1);
    }
    return p;
}

template <typename F>
void bind(F &field, void *lib, const char *name) {
    field = reinterpret_cast<F>(symbol(lib, name));
}

// 0: the driver is loaded and has a device; 77: no driver or no device.
int load() {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
        std::printf("no libcuda.so.1: %s\n", dlerror());
        return 77;
    }
    bind(cu.init, lib, "cuInit");
    bind(cu.device_get_count, lib, "cuDeviceGetCount");
    bind(cu.primary_retain, lib, "cuDevicePrimaryCtxRetain");
    bind(cu.set_current, lib, "cuCtxSetCurrent");
    bind(cu.ctx_create, lib, "cuCtxCreate_v2");
    bind(cu.ctx_destroy, lib, "cuCtxDestroy_v2");
    bind(cu.mem_alloc, lib, "cuMemAlloc_v2");
    bind(cu.mem_free, lib, "cuMemFree_v2");
    bind(cu.htod, lib, "cuMemcpyHtoD_v2");
    bind(cu.dtoh, lib, "cuMemcpyDtoH_v2");
    bind(cu.host_alloc, lib, "cuMemHostAlloc");
    bind(cu.host_device_pointer, lib, "cuMemHostGetDevicePointer_v2");
    bind(cu.stream_create, lib, "cuStreamCreate");
    bind(cu.stream_sync, lib, "cuStreamSynchronize");
    bind(cu.wait_value, lib, "cuStreamWaitValue32_v2");
    bind(cu.begin_capture, lib, "cuStreamBeginCapture_v2");
    bind(cu.end_capture, lib, "cuStreamEndCapture");
    bind(cu.instantiate, lib, "cuGraphInstantiateWithFlags");
    bind(cu.graph_launch, lib, "cuGraphLaunch");
    int count = 0;
    if (cu.init(0) != 0 || cu.device_get_count(&count) != 0 || count < 1) {
        std::printf("no CUDA device\n");
        return 77;
    }
    return 0;
}

CUcontext primary() {
    CUcontext ctx = nullptr;
    if (cu.primary_retain(&ctx, 0) != 0 || cu.set_current(ctx) != 0) {
        std::printf("FAIL: cannot make device 0's primary context current\n");
        std::exit(1);
    }
    return ctx;
}

// Device memory filled with `fill`, freed with the value.
struct Buffer {
    CUdeviceptr p = 0;
    size_t len = 0;
    Buffer(size_t bytes, int fill) : len(bytes) {
        std::vector<uint8_t> host(bytes, static_cast<uint8_t>(fill));
        if (cu.mem_alloc(&p, bytes) != 0 || cu.htod(p, host.data(), bytes) != 0) {
            std::printf("FAIL: cuMemAlloc/cuMemcpyHtoD of %zu bytes\n", bytes);
            std::exit(1);
        }
    }
    ~Buffer() { cu.mem_free(p); }
    std::vector<uint8_t> read() const {
        std::vector<uint8_t> out(len);
        cu.dtoh(out.data(), p, len);
        return out;
    }
    void fill(int value) const {
        std::vector<uint8_t> host(len, static_cast<uint8_t>(value));
        cu.htod(p, host.data(), len);
    }
};

// Prefill TP 2 rank 1 -> decode TP 4 rank 3, 8 heads, one-token pages of 64 and 32 bytes: the
// destination page gets the source page's second half (heads 6 and 7).
MoriTpSliceConfig config_2_to_4() {
    MoriTpSliceParams params;
    std::memset(&params, 0, sizeof params);
    params.prefill_tp_size = 2;
    params.prefill_tp_rank = 1;
    params.decode_tp_size = 4;
    params.decode_tp_rank = 3;
    params.total_kv_heads = 8;
    params.page_size = 1;
    params.src_item_len = 64;
    params.dst_item_len = 32;
    MoriTpSliceConfig config;
    std::memset(&config, 0, sizeof config);
    if (mori_tp_slice_config(&params, &config) != MORI_OK) {
        std::printf("FAIL: mori_tp_slice_config: %s\n", mori_tp_last_error_message());
        std::exit(1);
    }
    return config;
}

// A table too big for the kernel's argument, the 32 KiB one of a CUDA 12.1+ driver's wide entry
// too (8 bytes a rect, about 33.7 KB): uploaded.
constexpr int kPages = 4200;
constexpr size_t kUploadedSrc = 2 * kPages * 64, kUploadedDst = 2 * kPages * 32;
constexpr size_t kSmallSrc = 4 * 64, kSmallDst = 4 * 32;

MoriStatus send(const Buffer &src, const Buffer &dst, bool uploaded, uint32_t flags, CUstream stream) {
    static std::vector<int32_t> src_pages, dst_pages;
    static std::once_flag once;
    std::call_once(once, [] {
        for (int p = 0; p < kPages; p++) {
            src_pages.push_back(2 * p);
            dst_pages.push_back(2 * kPages - 1 - 2 * p);
        }
    });
    static const int32_t small[3] = {0, 1, 3};
    const MoriTpSliceConfig config = config_2_to_4();
    const void *srcs[1] = {reinterpret_cast<const void *>(src.p)};
    void *dsts[1] = {reinterpret_cast<void *>(dst.p)};
    MoriKvBuffers buffers;
    std::memset(&buffers, 0, sizeof buffers);
    buffers.src = srcs;
    buffers.dst = dsts;
    buffers.num_buffers = 1;
    buffers.src_capacity = src.len;
    buffers.dst_capacity = dst.len;
    MoriSendOptions options;
    std::memset(&options, 0, sizeof options);
    options.backend = MORI_BACKEND_CUDA;
    options.flags = flags;
    options.stream = stream;
    return uploaded ? mori_tp_kvcache_send(&config, &buffers, src_pages.data(), dst_pages.data(), kPages, &options)
                    : mori_tp_kvcache_send(&config, &buffers, small, small, 3, &options);
}

// What the destination (filled with 9) holds after a send from a source filled with `source`.
bool landed(const Buffer &dst, bool uploaded, int source) {
    const std::vector<uint8_t> got = dst.read();
    for (size_t page = 0; page < got.size() / 32; page++) {
        const bool sent = uploaded ? page % 2 == 1 : (page == 0 || page == 1 || page == 3);
        for (size_t b = 0; b < 32; b++) {
            if (got[page * 32 + b] != (sent ? source : 9)) return false;
        }
    }
    return true;
}

void held_stream() {
    primary();
    Buffer src(kUploadedSrc, 7), dst(kUploadedDst, 9);
    CUstream stream = nullptr;
    CU(cu.stream_create(&stream, 0));
    void *flag_host = nullptr;
    CU(cu.host_alloc(&flag_host, 4, 2));  // CU_MEMHOSTALLOC_DEVICEMAP
    auto *flag = static_cast<volatile uint32_t *>(flag_host);
    *flag = 0;
    CUdeviceptr flag_device = 0;
    CU(cu.host_device_pointer(&flag_device, flag_host, 0));
    // CU_STREAM_WAIT_VALUE_GEQ (0): later work waits until *flag >= 1.
    CU(cu.wait_value(stream, flag_device, 1, 0));
    for (int i = 0; i < 40; i++) {
        const auto t0 = std::chrono::steady_clock::now();
        const MoriStatus s = send(src, dst, true, MORI_SEND_COPY_KERNEL, stream);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s != MORI_OK || dt > 1.0) *flag = 1;  // let the stream go before failing
        CHECK(s == MORI_OK, "held_stream: send %d: %s", i + 1, mori_tp_last_error_message());
        CHECK(dt <= 1.0, "held_stream: send %d took %.2f s: it waited for its own held stream", i + 1, dt);
    }
    *flag = 1;
    CU(cu.stream_sync(stream));
    CHECK(landed(dst, true, 7), "held_stream: bytes");
    std::printf("PASS held_stream: 40 sends on a held stream, none waited\n");
}

void second_thread() {
    primary();
    std::atomic<int> bad{0};
    auto worker = [&bad](int fill) {
        primary();
        Buffer src(kUploadedSrc, fill), dst(kUploadedDst, 9);
        CUstream stream = nullptr;
        if (cu.stream_create(&stream, 0) != 0) {
            bad++;
            return;
        }
        for (int i = 0; i < 20; i++) {
            if (send(src, dst, true, MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE, stream) != MORI_OK ||
                !landed(dst, true, fill)) {
                std::printf("second_thread (source %d), send %d: %s\n", fill, i, mori_tp_last_error_message());
                bad++;
                return;
            }
            dst.fill(9);
        }
    };
    std::thread a(worker, 5), b(worker, 6);
    a.join();
    b.join();
    CHECK(bad == 0, "second_thread: %d thread(s) failed", bad.load());
    std::printf("PASS second_thread: two threads, 20 uploaded sends each\n");
}

void graph_capture() {
    primary();
    Buffer small_src(kSmallSrc, 7), small_dst(kSmallDst, 9), src(kUploadedSrc, 8), dst(kUploadedDst, 9);
    // What the other thread sends, made before the capture: in the global mode an allocation on
    // any thread would break it.
    Buffer other_src(kUploadedSrc, 4), other_dst(kUploadedDst, 9);
    CUstream stream = nullptr, other_stream = nullptr;
    CU(cu.stream_create(&stream, 1));  // CU_STREAM_NON_BLOCKING
    CU(cu.stream_create(&other_stream, 1));
    CU(cu.begin_capture(stream, 0));  // CU_STREAM_CAPTURE_MODE_GLOBAL
    std::atomic<int> other{-1};
    std::thread elsewhere([&] {
        primary();
        other = send(other_src, other_dst, true, MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE, other_stream);
    });
    elsewhere.join();
    const MoriStatus inline_status = send(small_src, small_dst, false, 0, stream);
    const MoriStatus uploaded_status = send(src, dst, true, 0, stream);
    CUgraph graph = nullptr;
    const CUresult ended = cu.end_capture(stream, &graph);
    CHECK(other == MORI_OK, "graph_capture: another thread's send during the capture returned %d", other.load());
    CHECK(landed(other_dst, true, 4), "graph_capture: the other thread's bytes");
    CHECK(inline_status == MORI_OK && uploaded_status == MORI_OK, "graph_capture: captured sends %d %d: %s",
          inline_status, uploaded_status, mori_tp_last_error_message());
    CHECK(ended == 0 && graph != nullptr, "graph_capture: cuStreamEndCapture returned %d (capture broken)", ended);
    CHECK(landed(small_dst, false, 9) && landed(dst, true, 9), "graph_capture: a captured send ran before the replay");
    CUgraphExec exec = nullptr;
    CU(cu.instantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; replay++) {
        small_dst.fill(9);
        dst.fill(9);
        CU(cu.graph_launch(exec, stream));
        CU(cu.stream_sync(stream));
        CHECK(landed(small_dst, false, 7) && landed(dst, true, 8), "graph_capture: replay %d bytes", replay);
    }
    std::printf("PASS graph_capture: captured with another thread sending, replayed twice\n");
}

void non_primary_context() {
    CUcontext prim = primary();
    CUcontext own = nullptr;
    CU(cu.ctx_create(&own, 0, 0));  // current now
    {
        Buffer src(kUploadedSrc, 7), dst(kUploadedDst, 9);
        CUstream stream = nullptr;
        CU(cu.stream_create(&stream, 0));
        for (CUstream s : {stream, static_cast<CUstream>(nullptr)}) {
            dst.fill(9);
            CHECK(send(src, dst, true, MORI_SEND_SYNCHRONIZE, s) == MORI_OK, "non_primary_context: flags 0: %s",
                  mori_tp_last_error_message());
            CHECK(landed(dst, true, 7), "non_primary_context: bytes");
            dst.fill(9);
            const MoriStatus refused = send(src, dst, true, MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL, s);
            CHECK(refused == MORI_ERR_GPU && std::strstr(mori_tp_last_error_message(), "cuCtxCreate") != nullptr,
                  "non_primary_context: MORI_SEND_COPY_KERNEL gave %d: %s", refused, mori_tp_last_error_message());
            CHECK(landed(dst, true, 9), "non_primary_context: a refused send wrote");
        }
        CU(cu.stream_sync(stream));
    }
    CU(cu.set_current(prim));
    cu.ctx_destroy(own);
    std::printf("PASS non_primary_context: per-rect copies for flags 0, the kernel refused\n");
}

void per_thread_stream() {
    primary();
    CUstream per_thread = reinterpret_cast<CUstream>(uintptr_t{2});  // CU_STREAM_PER_THREAD
    Buffer small_src(kSmallSrc, 7), small_dst(kSmallDst, 9), src(kUploadedSrc, 8), dst(kUploadedDst, 9);
    CHECK(send(small_src, small_dst, false, MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE, per_thread) == MORI_OK,
          "per_thread_stream: inline: %s", mori_tp_last_error_message());
    CHECK(send(src, dst, true, MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE, per_thread) == MORI_OK,
          "per_thread_stream: uploaded: %s", mori_tp_last_error_message());
    CHECK(landed(small_dst, false, 7) && landed(dst, true, 8), "per_thread_stream: bytes");
    std::printf("PASS per_thread_stream: the kernel on CU_STREAM_PER_THREAD\n");
}

}  // namespace

int main(int argc, char **argv) {
    if (const int rc = load(); rc != 0) return rc;
    alarm(120);  // a case that waits for good ends the program (SIGALRM) instead of the check
    const std::string only = argc > 1 ? argv[1] : "";
    struct Case {
        const char *name;
        void (*run)();
    } cases[] = {{"held_stream", held_stream},
                 {"second_thread", second_thread},
                 {"graph_capture", graph_capture},
                 {"non_primary_context", non_primary_context},
                 {"per_thread_stream", per_thread_stream}};
    for (const Case &c : cases) {
        if (only.empty() || only == c.name) c.run();
    }
    std::printf(failures == 0 ? "driver_cases: all checks passed\n" : "driver_cases: %d failure(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
