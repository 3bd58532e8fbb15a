// Benchmark of the GPU backend's two ways to run a call (the HIP backend; built with nvcc and
// hip/cuda/, the CUDA backend), against one hipMemcpyAsync of the same bytes on the same device:
//   memcpy2d  one hipMemcpy2DAsync (CUDA: cuMemcpy2DAsync) per (buffer, rect) (MORI_SEND_MEMCPY2D);
//   kernel    one copy-kernel launch per call (MORI_SEND_COPY_KERNEL, and what flags 0 choose for
//             two copies or more), plus one table upload;
//   memcpy    one hipMemcpyAsync of the call's bytes, contiguous (the bandwidth ceiling).
// for direct sends (mori_send_kvcache) and for the two halves of a staged transfer
// (mori_pack_kvcache, mori_unpack_kvcache), on three layouts of 8 KV heads of 256 bytes
// (head_dim 128, bf16): prefill TP 2 -> decode TP 8 (a 256 B slice of each 1 KiB source token),
// TP 8 -> 2 (into a 1 KiB destination token) and TP 4 -> 8 (a 256 B slice of 512 B tokens), with
// page sizes 1 and 16 and the request's pages in runs of 1, 4 or 16 pages (shuffled with gaps on
// both sides: each run is one rect), or all contiguous.
//
// Then, for TP 2 -> 8 with one-page runs of page size 1 and with page size 16, contiguous: the
// staging region in pinned host memory (hipHostMalloc; pack and unpack, against a hipMemcpyAsync
// from device to pinned memory), and with two or more devices with peer access, prefill buffers
// on device 0 and decode buffers, staging and the stream on device 1 while device 0 is current
// (against a hipMemcpyAsync from device 0 to device 1); on a runtime without hipStreamGetDevice
// (HIP 5.x), where the library needs a copy-kernel call's stream on the current device, with
// device 1 current instead (it prints which).
//
// Columns: calls = runtime calls per mori call (memcpy2d: rects x buffers; kernel: 1 launch);
// ms = time per call from hipEvents around `iterations` calls on one stream without
// MORI_SEND_SYNCHRONIZE (so it includes the host's cost of issuing them); GB/s of slice bytes;
// ratio = GB/s over the memcpy ceiling; kernel/2d = the kernel's speed-up over memcpy2d;
// lanes = the kernel's active-lane utilisation: the share of its threads' steps that move bytes
// (hip/lane_count.cpp counts it on the CPU from the kernel's own source and the same table; it
// depends only on the rects' rows and widths, which a send and both halves of a staged transfer
// share).
//
// Usage: bench [--quick]   (--quick: small sizes and few iterations, for the test suite)
// Exit: 0 done, 1 failed, 77 "skipped: no HIP device".

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "lane_count.h"
#include "testkit.hpp"

namespace {

constexpr uint32_t kHeads = 8;
constexpr uint64_t kBytesPerHead = 256;
// Runtime calls one timing may issue in all (iterations x calls per mori call), at least one call.
constexpr uint64_t kCallBudget = 2000000;

struct Layout {
    const char *name;
    uint32_t prefill_tp, decode_tp;
};

const Layout kLayouts[] = {{"tp2to8", 2, 8}, {"tp8to2", 8, 2}, {"tp4to8", 4, 8}};

struct Settings {
    uint64_t tokens;   // tokens per request
    uint32_t buffers;  // K and V of layers / 2 layers
    int warmup;
    int iterations;
};

// The time per call of `body` on `stream`, a stream of `device` (its events must be that device's).
template <class Body>
float time_ms(int device, hipStream_t stream, int warmup, int iterations, const Body &body) {
    for (int i = 0; i < warmup; i++) {
        body();
    }
    hipEvent_t start, stop;
    on_device(device, [&] {
        HIP_OK(hipEventCreate(&start));
        HIP_OK(hipEventCreate(&stop));
    });
    HIP_OK(hipStreamSynchronize(stream));
    HIP_OK(hipEventRecord(start, stream));
    for (int i = 0; i < iterations; i++) {
        body();
    }
    HIP_OK(hipEventRecord(stop, stream));
    HIP_OK(hipEventSynchronize(stop));
    float ms = 0;
    HIP_OK(hipEventElapsedTime(&ms, start, stop));
    HIP_OK(hipEventDestroy(start));
    HIP_OK(hipEventDestroy(stop));
    return ms / static_cast<float>(iterations);
}

// Where a case's memory lives.
struct Placement {
    const char *name;
    int src_device;      // prefill buffers
    int dst_device;      // decode buffers and the stream
    int staging_device;  // the staging region; -1: pinned host memory
    bool send;           // time mori_send_kvcache (it uses no staging region)
};

constexpr Placement kLocal = {"device memory", 0, 0, 0, true};
constexpr Placement kPinnedStaging = {"staging in pinned host memory", 0, 0, -1, false};
constexpr Placement kPeer = {"prefill on device 0, decode on device 1", 0, 1, 1, true};

struct Buffers {
    std::vector<void *> pointers;
    uint64_t capacity = 0;
    int device;  // -1: pinned host memory

    Buffers(uint32_t count, uint64_t bytes, int fill, int device_ = 0)
        : pointers(count), capacity(bytes), device(device_) {
        for (void *&p : pointers) {
            if (device < 0) {
                HIP_OK(hipHostMalloc(&p, bytes, hipHostMallocDefault));
                std::memset(p, fill, bytes);
            } else {
                on_device(device, [&] {
                    HIP_OK(hipMalloc(&p, bytes));
                    HIP_OK(hipMemset(p, fill, bytes));
                });
            }
        }
    }
    ~Buffers() {
        for (void *p : pointers) {
            (void)(device < 0 ? hipHostFree(p) : hipFree(p));
        }
    }
    Buffers(const Buffers &) = delete;
    Buffers &operator=(const Buffers &) = delete;
};

void print_row(const char *layout, uint32_t page_size, const std::string &pages, const char *op, const char *path,
               uint64_t calls, float ms, uint64_t bytes, double ceiling_gbs, double versus, double lanes) {
    const double gbs = static_cast<double>(bytes) / (ms * 1e6);
    char speedup[16] = "", utilisation[16] = "-";
    if (versus > 0) {
        std::snprintf(speedup, sizeof speedup, "%.2f", gbs / versus);
    }
    if (lanes >= 0) {
        std::snprintf(utilisation, sizeof utilisation, "%.1f%%", 100.0 * lanes);
    }
    std::printf("%-7s %4u %-11s %-6s %-8s %9" PRIu64 " %9.3f %9.1f %6.2f %9s %7s\n", layout, page_size,
                pages.c_str(), op, path, calls, ms, gbs, gbs / ceiling_gbs, speedup, utilisation);
}

void run_case(const Layout &l, uint32_t page_size, uint64_t run, const Settings &s, const Placement &where,
              hipStream_t stream) {
    const uint64_t src_bpt = (kHeads / l.prefill_tp) * kBytesPerHead;
    const uint64_t dst_bpt = (l.decode_tp <= kHeads ? kHeads / l.decode_tp : 1) * kBytesPerHead;
    const uint64_t pages = s.tokens / page_size;
    // Runs of `run` pages in a shuffled order with free pages between them (0: one run), from
    // a seed of the case, so every run of the benchmark plans the same request.
    const mori_testkit::Pages request = run == 0 ? mori_testkit::contiguous(pages)
                                                 : mori_testkit::fixed_runs(1000 * page_size + run, pages, run);
    const std::vector<int32_t> &src_pages = request.src, &dst_pages = request.dst;
    const uint64_t capacity_pages = std::max(request.src_capacity_pages, request.dst_capacity_pages);
    const MoriTpSliceParams params = {l.prefill_tp, 0, l.decode_tp, 0, kHeads, page_size,
                                      page_size * src_bpt, page_size * dst_bpt};
    MoriTpSliceConfig config;
    MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
    size_t rects = 0;  // the size query answers MORI_ERR_BUFFER_TOO_SMALL when rects > 0
    const MoriStatus planned =
        mori_tp_plan(&config, src_pages.data(), dst_pages.data(), pages, nullptr, 0, &rects);
    if (planned != MORI_OK && planned != MORI_ERR_BUFFER_TOO_SMALL) {
        MORI_OK_OR_DIE(planned);
    }
    std::vector<MoriCopyRect> plan(rects);
    MORI_OK_OR_DIE(mori_tp_plan(&config, src_pages.data(), dst_pages.data(), pages, plan.data(), rects, &rects));
    uint64_t staging_len = 0;
    MORI_OK_OR_DIE(mori_tp_staging_len(&config, pages, &staging_len));

    Buffers src(s.buffers, capacity_pages * page_size * src_bpt, 1, where.src_device);
    Buffers dst(s.buffers, capacity_pages * page_size * dst_bpt, 2, where.dst_device);
    Buffers staging(1, staging_len * s.buffers, 3, where.staging_device);
    const uint64_t bytes = staging_len * s.buffers;  // slice bytes of one call
    // The ceiling: one copy of the call's bytes from the prefill side's memory to where they go.
    Buffers flat_src(1, bytes, 4, where.src_device);
    Buffers flat_dst(1, bytes, 4, where.send ? where.dst_device : where.staging_device);
    const MoriKvBuffers kv = {src.pointers.data(), dst.pointers.data(), s.buffers, src.capacity, dst.capacity};
    const double lanes = mori_copy_lane_utilisation(plan.data(), plan.size(), reinterpret_cast<uint64_t>(src.pointers[0]),
                                                    reinterpret_cast<uint64_t>(dst.pointers[0]));

    const float flat_ms = time_ms(where.dst_device, stream, s.warmup, s.iterations, [&] {
        HIP_OK(hipMemcpyAsync(flat_dst.pointers[0], flat_src.pointers[0], bytes, hipMemcpyDefault, stream));
    });
    const double ceiling = static_cast<double>(bytes) / (flat_ms * 1e6);
    const std::string shape = run == 0 ? "contiguous" : "runs of " + std::to_string(run);
    print_row(l.name, page_size, shape, "-", "memcpy", 1, flat_ms, bytes, ceiling, 0, -1);

    // Each op with MORI_SEND_MEMCPY2D (memcpy2d) and MORI_SEND_COPY_KERNEL (kernel).
    const char *ops[] = {"send", "pack", "unpack"};
    for (const char *op : ops) {
        if (!where.send && std::strcmp(op, "send") == 0) {
            continue;
        }
        double memcpy2d_gbs = 0;
        for (const uint32_t flags : {static_cast<uint32_t>(MORI_SEND_MEMCPY2D), static_cast<uint32_t>(MORI_SEND_COPY_KERNEL)}) {
            const MoriSendOptions options = {kBackend, flags, stream};
            // A send of half a million hipMemcpy2DAsync calls takes seconds: fewer iterations.
            const uint64_t calls = flags == MORI_SEND_MEMCPY2D ? rects * s.buffers : 1;
            const int iterations = static_cast<int>(
                std::max<uint64_t>(1, std::min<uint64_t>(s.iterations, kCallBudget / calls)));
            const float ms = time_ms(where.dst_device, stream, iterations < s.iterations ? 1 : s.warmup, iterations, [&] {
                if (std::strcmp(op, "send") == 0) {
                    MORI_OK_OR_DIE(mori_send_kvcache(&config, &kv, src_pages.data(), dst_pages.data(), pages, &options));
                } else if (std::strcmp(op, "pack") == 0) {
                    MORI_OK_OR_DIE(mori_pack_kvcache(&config, src.pointers.data(), s.buffers, src.capacity,
                                                     src_pages.data(), pages, staging.pointers[0], bytes, &options));
                } else {
                    MORI_OK_OR_DIE(mori_unpack_kvcache(&config, staging.pointers[0], bytes, dst.pointers.data(),
                                                       s.buffers, dst.capacity, dst_pages.data(), pages, &options));
                }
            });
            // Every run breaks on both sides (gaps), so pack and unpack have as many rects per
            // buffer as the send: one per run.
            const bool kernel = flags == MORI_SEND_COPY_KERNEL;
            print_row(l.name, page_size, shape, op, kernel ? "kernel" : "memcpy2d", calls, ms, bytes, ceiling,
                      kernel ? memcpy2d_gbs : 0, kernel ? lanes : -1);
            if (!kernel) {
                memcpy2d_gbs = static_cast<double>(bytes) / (ms * 1e6);
            }
        }
    }
    HIP_OK(hipStreamSynchronize(stream));
}

}  // namespace

int main(int argc, char **argv) {
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
    const int skip = skip_without_device("bench");
    if (skip >= 0) {
        return skip;
    }
    const Settings settings = quick ? Settings{256, 4, 1, 2} : Settings{16384, 32, 3, 20};
    int device = -1, devices = 0;
    HIP_OK(hipGetDevice(&device));
    HIP_OK(hipGetDeviceCount(&devices));
    hipDeviceProp_t props;
    HIP_OK(hipGetDeviceProperties(&props, device));
    std::printf("bench: device %d of %d, %s (%s); %" PRIu64 " tokens x %u buffers per call, 8 heads of 256 B, "
                "%d iterations%s\n",
                device, devices, props.name, device_arch(props).c_str(), settings.tokens, settings.buffers,
                settings.iterations, quick ? " (--quick)" : "");
    const auto header = [] {
        std::printf("%-7s %4s %-11s %-6s %-8s %9s %9s %9s %6s %9s %7s\n", "layout", "page", "pages", "op", "path",
                    "calls", "ms", "GB/s", "ratio", "kernel/2d", "lanes");
    };
    header();
    hipStream_t stream;
    HIP_OK(hipStreamCreate(&stream));
    for (const Layout &layout : kLayouts) {
        for (uint32_t page_size : {1u, 16u}) {
            for (uint64_t run : {uint64_t{1}, uint64_t{4}, uint64_t{16}, uint64_t{0}}) {
                run_case(layout, page_size, run, settings, kLocal, stream);
            }
        }
    }
    HIP_OK(hipStreamDestroy(stream));

    // The fragmented shape and one long run, with the memory elsewhere.
    const auto placed = [&](const Placement &where) {
        std::printf("bench: %s\n", where.name);
        header();
        hipStream_t on;
        on_device(where.dst_device, [&] { HIP_OK(hipStreamCreate(&on)); });
        run_case(kLayouts[0], 1, 1, settings, where, on);
        run_case(kLayouts[0], 16, 0, settings, where, on);
        HIP_OK(hipStreamDestroy(on));
    };
    placed(kPinnedStaging);
    int peers[2] = {0, 0};
    if (devices >= 2 && device == 0) {
        HIP_OK(hipDeviceCanAccessPeer(&peers[0], 0, 1));
        HIP_OK(hipDeviceCanAccessPeer(&peers[1], 1, 0));
    }
    if (peers[0] != 0 && peers[1] != 0) {
        for (const auto &link : {std::pair{0, 1}, std::pair{1, 0}}) {
            const int to = link.second;
            on_device(link.first, [&] {
                const hipError_t status = hipDeviceEnablePeerAccess(to, 0);
                if (status != hipSuccess && status != hipErrorPeerAccessAlreadyEnabled) HIP_OK(status);
            });
        }
        if (runtime_has_stream_get_device()) {
            std::printf("bench: two devices: this HIP runtime has hipStreamGetDevice, so device 0 stays current\n");
            placed(kPeer);
        } else {
            // The library needs a copy-kernel call's stream on the current device here.
            std::printf("bench: two devices: this HIP runtime has no hipStreamGetDevice, so device 1 (the "
                        "stream's) is made current for the two-device rows\n");
            on_device(1, [&] { placed(kPeer); });
        }
    } else {
        std::printf("bench: %s: skipped (needs devices 0 and 1 with peer access, device 0 current)\n", kPeer.name);
    }
    std::printf("bench: done\n");
    return kPassed;
}
