// Benchmark of mori-tp's copy kernel through the library, on the request shapes of issue 31,
// against the bandwidth ceiling and against one hipMemcpy2DAsync per (buffer, rect). Built with
// hipcc it measures the HIP backend; with nvcc and -I hip/cuda (hip/cuda/hip/hip_runtime.h maps
// the HIP names to CUDA's; hip/device-check.sh builds it so), the CUDA backend.
//
// Shapes (8 KV heads of 256 bytes: head_dim 128, bf16), each at 4096 and 32768 tokens x 64
// buffers (32 layers, K and V):
//   nhd-tp2to8-p16-runs1    NHD, prefill TP 2 -> decode TP 8, pages of 16 in runs of one page
//   nhd-tp2to8-p16-contig   the same, all pages contiguous (one rect)
//   nhd-tp8to2-p16-runs1    TP 8 -> 2, runs of one page
//   nhd-tp2to8-p1-runs1     page size 1, runs of one page: one-row rects
//   hnd-tp2to8-p16-runs1    HND -> HND (the pair API), pages of 16, runs of one page
//   nhd16-hnd64-tp2to8      NHD pages of 16 -> HND pages of 64 (pair), runs of one page
//   hnd16-nhd16-tp4to4      HND pages of 16 -> NHD pages of 16, TP 4 -> 4 (pair)
// Pages are laid out in runs with free pages between them, shuffled, from a seed per shape, so
// every run of the benchmark plans the same requests.
//
// Rows, per shape and token count:
//   memcpy          one hipMemcpyAsync of the call's bytes, contiguous, device to device: the
//                   ceiling every ratio is taken against;
//   send/pack/unpack kernel
//                   mori_tp_kvcache_send(_pair), mori_tp_kvcache_pack(_pair) into a staging region and
//                   mori_tp_kvcache_unpack(_pair) out of it, with MORI_SEND_COPY_KERNEL: whatever
//                   the library does per call (building the table, uploading it unless it fits
//                   in the kernel's argument, the launch) is counted;
//   send memcpy2d   one hipMemcpy2DAsync per (buffer, rect) of the same plan, issued here (the
//                   design card's path; hundreds of thousands of calls).
// Columns: rects per buffer; MiB moved per call; calls = runtime calls per mori call (memcpy2d:
// rects x buffers); upload = bytes of the kernel's table the library uploads for the send (0:
// the table travels inside the kernel's argument; from hip/copy_table.hpp, which builds the
// library's bytes); gpu_us = GPU time of one call alone, queued behind a stream callback that
// holds the stream until the call is issued, so neither the host's cost nor an idle GPU is in
// it: the upload and the launch as the GPU runs them (median of several); stream_us = time per
// call of back-to-back calls without MORI_SEND_SYNCHRONIZE (it includes the host's cost when
// the host is the slower); each ratio = the ceiling's time over the row's (1.00 = as fast as
// one contiguous copy); lanes = the kernel's share of (thread, slot) pairs that move bytes,
// counted on the CPU from the kernel's own source and the same table (hip/lane_count.cpp).
// Each shape also checks that the kernel's send and the memcpy2D send leave the first and the
// last decode buffer byte for byte the same.
//
// Then, at 4096 tokens, the one-row and the contiguous shape with the staging region in pinned
// host memory (pack and unpack against a hipMemcpyAsync between device and pinned memory), and
// with two devices with peer access, prefill buffers on device 0 and decode buffers, staging
// and the stream on device 1 while device 0 is current (against a hipMemcpyAsync from device 0
// to device 1); on a runtime without hipStreamGetDevice (HIP 5.x), where the library needs a
// copy-kernel call's stream on the current device, with device 1 current instead (it says so).
//
// Usage: bench [--quick] [--no-memcpy2d] [--tokens N]
//   --quick        640 tokens x 4 buffers (the one-row shape's table is then uploaded, most
//                  others fit in the argument), few iterations, no gpu_us (for the test suite,
//                  which also runs it over a stand-in runtime)
//   --no-memcpy2d  skips the per-rect rows (the slowest: seconds per call at 32768 tokens) and
//                  with them the byte check
//   --tokens N     one token count instead of 4096 and 32768
// Exit: 0 done, 1 failed (a runtime error or bytes that differ), 77 "skipped: no HIP device".

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "lane_count.h"
#include "testkit.hpp"

namespace {

constexpr uint32_t kHeads = 8;
constexpr uint64_t kHeadBytes = 256;
// Runtime calls one memcpy2D timing may issue in all (iterations x calls per mori call).
constexpr uint64_t kCallBudget = 2000000;

struct Shape {
    const char *name;
    // Through the pair API (any layout); else the slice-config API (REFERENCE.md sections 4-6:
    // NHD, one page size).
    bool pair;
    char src_kind, dst_kind;  // 'n' NHD, 'h' HND
    uint32_t prefill_tp, decode_tp, src_page, dst_page;
    uint64_t run;  // pages per run; 0: all pages contiguous
};

const Shape kShapes[] = {
    {"nhd-tp2to8-p16-runs1", false, 'n', 'n', 2, 8, 16, 16, 1},
    {"nhd-tp2to8-p16-contig", false, 'n', 'n', 2, 8, 16, 16, 0},
    {"nhd-tp8to2-p16-runs1", false, 'n', 'n', 8, 2, 16, 16, 1},
    {"nhd-tp2to8-p1-runs1", false, 'n', 'n', 2, 8, 1, 1, 1},
    {"hnd-tp2to8-p16-runs1", true, 'h', 'h', 2, 8, 16, 16, 1},
    {"nhd16-hnd64-tp2to8", true, 'n', 'h', 2, 8, 16, 64, 1},
    {"hnd16-nhd16-tp4to4", true, 'h', 'n', 4, 4, 16, 16, 1},
};

struct Settings {
    std::vector<uint64_t> tokens;
    uint32_t buffers;
    int warmup;
    int iterations;
    int gated;  // repetitions of the gated one-call timing; 0: none
    bool memcpy2d;
};

// Where a case's memory lives.
struct Placement {
    const char *name;
    int src_device;      // prefill buffers
    int dst_device;      // decode buffers and the stream
    int staging_device;  // the staging region; -1: pinned host memory
    bool send;           // time the send (it uses no staging region) and the per-rect copies
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

// Time per call of `iterations` back-to-back calls of `body` on `stream` (of `device`).
template <class Body>
float stream_ms(int device, hipStream_t stream, int warmup, int iterations, const Body &body) {
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

// A host callback that holds its stream until the host opens it (or 5 s pass: a call that
// waits for the stream itself would otherwise never return; that timing is then flagged).
struct Gate {
    std::mutex lock;
    std::condition_variable opened;
    bool open = false;
    bool timed_out = false;

    // A stream callback (hipStreamAddCallback: HIP 5.2 has it, CUDA as cudaStreamAddCallback);
    // the stream runs nothing after it until it returns.
    static void hold(hipStream_t, hipError_t, void *self) {
        Gate *gate = static_cast<Gate *>(self);
        std::unique_lock<std::mutex> guard(gate->lock);
        if (!gate->opened.wait_for(guard, std::chrono::seconds(5), [&] { return gate->open; })) {
            gate->timed_out = true;
        }
    }
    void release() {
        {
            std::lock_guard<std::mutex> guard(lock);
            open = true;
        }
        opened.notify_all();
    }
};

// GPU time of one call of `body` alone: the stream is held by a Gate while the call is issued,
// then released, so the events bracket only the GPU's work of that call. The median of `reps`;
// *flagged when a gate timed out.
template <class Body>
float gated_ms(int device, hipStream_t stream, int reps, const Body &body, bool *flagged) {
    std::vector<float> times;
    for (int r = 0; r < reps; r++) {
        hipEvent_t start, stop;
        on_device(device, [&] {
            HIP_OK(hipEventCreate(&start));
            HIP_OK(hipEventCreate(&stop));
        });
        Gate gate;
        HIP_OK(hipStreamAddCallback(stream, Gate::hold, &gate, 0));
        HIP_OK(hipEventRecord(start, stream));
        body();
        HIP_OK(hipEventRecord(stop, stream));
        gate.release();
        HIP_OK(hipEventSynchronize(stop));
        float ms = 0;
        HIP_OK(hipEventElapsedTime(&ms, start, stop));
        HIP_OK(hipEventDestroy(start));
        HIP_OK(hipEventDestroy(stop));
        times.push_back(ms);
        *flagged |= gate.timed_out;
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

void print_header() {
    std::printf("%-22s %6s %6s %7s %-6s %-8s %8s %8s %9s %6s %10s %6s %7s\n", "shape", "tokens", "rects", "MiB",
                "op", "path", "calls", "upload", "gpu_us", "ratio", "stream_us", "ratio", "lanes");
}

struct Row {
    const char *op, *path;
    uint64_t calls;
    std::string upload;
    float gpu_ms;  // < 0: not measured
    float stream_ms;
    double lanes;  // < 0: not applicable
    bool flagged;
};

void print_row(const Shape &s, uint64_t tokens, uint64_t rects, uint64_t bytes, const Row &r, float ceiling_gpu,
               float ceiling_stream) {
    char gpu[16] = "-", gpu_ratio[16] = "-", lanes[16] = "-";
    if (r.gpu_ms >= 0) {
        std::snprintf(gpu, sizeof gpu, "%.1f%s", 1000.0 * r.gpu_ms, r.flagged ? "*" : "");
        std::snprintf(gpu_ratio, sizeof gpu_ratio, "%.2f", ceiling_gpu / r.gpu_ms);
    }
    if (r.lanes >= 0) {
        std::snprintf(lanes, sizeof lanes, "%.1f%%", 100.0 * r.lanes);
    }
    std::printf("%-22s %6" PRIu64 " %6" PRIu64 " %7.1f %-6s %-8s %8" PRIu64 " %8s %9s %6s %10.1f %6.3f %7s\n", s.name,
                tokens, rects, static_cast<double>(bytes) / 1048576.0, r.op, r.path, r.calls, r.upload.c_str(), gpu,
                gpu_ratio, 1000.0 * r.stream_ms, ceiling_stream / r.stream_ms, lanes);
}

// One side's pages: `count` pages in runs of `run` (0: one run), shuffled with gaps, from `seed`.
struct SidePages {
    std::vector<int32_t> pages;
    uint64_t capacity_pages;
};

SidePages side_pages(uint64_t seed, uint64_t count, uint64_t run, bool src) {
    const mori_testkit::Pages p =
        run == 0 ? mori_testkit::contiguous(count) : mori_testkit::fixed_runs(seed, count, run);
    return src ? SidePages{p.src, p.src_capacity_pages} : SidePages{p.dst, p.dst_capacity_pages};
}

MoriTpLayout make_layout(char kind, uint32_t tp, uint32_t page) {
    MoriTpLayout l;
    if (kind == 'h') {
        MORI_OK_OR_DIE(mori_tp_layout_hnd(kHeads, tp, 0, page, kHeadBytes, &l));
    } else {
        MORI_OK_OR_DIE(mori_tp_layout_nhd(kHeads, tp, 0, page, kHeadBytes, &l));
    }
    return l;
}

// Shapes whose kernel send was checked against the memcpy2D send.
int checked_shapes = 0;

// Returns false when a byte check failed.
bool run_case(const Shape &s, uint64_t tokens, const Settings &set, const Placement &where, hipStream_t stream) {
    const uint64_t seed = 1000 * s.src_page + 10 * s.dst_page + s.prefill_tp + s.run;
    // The request and the plan, through the API the shape names.
    MoriTpSliceConfig config{};
    MoriTpPairConfig pair{};
    SidePages src_side, dst_side;
    uint64_t src_stride = 0, dst_stride = 0, staging_len = 0;
    std::vector<MoriCopyRect> plan;
    size_t count = 0;
    if (s.pair) {
        const MoriTpLayout src_l = make_layout(s.src_kind, s.prefill_tp, s.src_page);
        const MoriTpLayout dst_l = make_layout(s.dst_kind, s.decode_tp, s.dst_page);
        MORI_OK_OR_DIE(mori_tp_pair_config(&src_l, &dst_l, &pair));
        src_side = side_pages(seed, (tokens + s.src_page - 1) / s.src_page, s.run, true);
        dst_side = side_pages(seed + 1, (tokens + s.dst_page - 1) / s.dst_page, s.run, false);
        src_stride = src_l.page_stride;
        dst_stride = dst_l.page_stride;
    } else {
        const uint64_t src_bpt = (kHeads / s.prefill_tp) * kHeadBytes;
        const uint64_t dst_bpt = (s.decode_tp <= kHeads ? kHeads / s.decode_tp : 1) * kHeadBytes;
        const MoriTpSliceParams params = {s.prefill_tp, 0, s.decode_tp, 0, kHeads, s.src_page,
                                          s.src_page * src_bpt, s.src_page * dst_bpt};
        MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
        const uint64_t pages = tokens / s.src_page;
        const mori_testkit::Pages p =
            s.run == 0 ? mori_testkit::contiguous(pages) : mori_testkit::fixed_runs(seed, pages, s.run);
        src_side = {p.src, p.src_capacity_pages};
        dst_side = {p.dst, p.dst_capacity_pages};
        src_stride = s.src_page * src_bpt;
        dst_stride = s.src_page * dst_bpt;
    }
    const MoriTpRequest request = {src_side.pages.data(), src_side.pages.size(), dst_side.pages.data(),
                                   dst_side.pages.size(), tokens};
    const uint64_t n = src_side.pages.size();
    if (s.pair) {
        const MoriStatus q = mori_tp_pair_plan(&pair, &request, nullptr, 0, &count);
        if (q != MORI_OK && q != MORI_ERR_BUFFER_TOO_SMALL) MORI_OK_OR_DIE(q);
        plan.resize(count);
        MORI_OK_OR_DIE(mori_tp_pair_plan(&pair, &request, plan.data(), count, &count));
        MORI_OK_OR_DIE(mori_tp_pair_staging_len(&pair, tokens, &staging_len));
    } else {
        const MoriStatus q =
            mori_tp_plan(&config, src_side.pages.data(), dst_side.pages.data(), n, nullptr, 0, &count);
        if (q != MORI_OK && q != MORI_ERR_BUFFER_TOO_SMALL) MORI_OK_OR_DIE(q);
        plan.resize(count);
        MORI_OK_OR_DIE(
            mori_tp_plan(&config, src_side.pages.data(), dst_side.pages.data(), n, plan.data(), count, &count));
        MORI_OK_OR_DIE(mori_tp_staging_len(&config, n, &staging_len));
    }

    const uint32_t nb = set.buffers;
    Buffers src(nb, src_side.capacity_pages * src_stride, 1, where.src_device);
    Buffers dst(nb, dst_side.capacity_pages * dst_stride, 2, where.dst_device);
    const uint64_t bytes = staging_len * nb;  // slice bytes of one call
    Buffers staging(1, bytes, 3, where.staging_device);
    // The ceiling: one copy of the call's bytes from the prefill side's memory to where they go.
    Buffers flat_src(1, bytes, 4, where.src_device);
    Buffers flat_dst(1, bytes, 4, where.send ? where.dst_device : where.staging_device);
    const MoriKvBuffers kv = {src.pointers.data(), dst.pointers.data(), nb, src.capacity, dst.capacity};
    std::vector<uint64_t> src_bases, dst_bases;
    for (uint32_t b = 0; b < nb; b++) {
        src_bases.push_back(reinterpret_cast<uint64_t>(src.pointers[b]));
        dst_bases.push_back(reinterpret_cast<uint64_t>(dst.pointers[b]));
    }
    const double lanes = mori_copy_lane_utilisation(plan.data(), plan.size(), src_bases[0], dst_bases[0]);
    const uint64_t upload =
        mori_copy_table_upload_bytes(plan.data(), plan.size(), src_bases.data(), dst_bases.data(), nb);

    // Back to back, then gated when asked: (stream ms, gpu ms or -1, whether a gate timed out).
    struct Timed {
        float stream, gpu;
        bool flagged;
    };
    const auto measure = [&](const auto &body, int warmup, int iterations, bool gate) {
        Timed t{stream_ms(where.dst_device, stream, warmup, iterations, body), -1.0f, false};
        if (gate && set.gated > 0) {
            t.gpu = gated_ms(where.dst_device, stream, set.gated, body, &t.flagged);
        }
        return t;
    };
    const Timed ceiling = measure(
        [&] {
            HIP_OK(hipMemcpyAsync(flat_dst.pointers[0], flat_src.pointers[0], bytes, hipMemcpyDefault, stream));
        },
        set.warmup, set.iterations, true);
    const auto row = [&](const Row &r) {
        print_row(s, tokens, plan.size(), bytes, r, ceiling.gpu > 0 ? ceiling.gpu : ceiling.stream, ceiling.stream);
    };
    row({"-", "memcpy", 1, "-", ceiling.gpu, ceiling.stream, -1, ceiling.flagged});

    const MoriSendOptions kernel = {kBackend, MORI_SEND_COPY_KERNEL, stream};
    const auto send = [&] {
        if (s.pair) {
            MORI_OK_OR_DIE(mori_tp_pair_send(&pair, &kv, &request, &kernel));
        } else {
            MORI_OK_OR_DIE(mori_tp_kvcache_send(&config, &kv, src_side.pages.data(), dst_side.pages.data(), n, &kernel));
        }
    };
    const auto pack = [&] {
        if (s.pair) {
            MORI_OK_OR_DIE(mori_tp_pair_pack(&pair, MORI_TP_STAGING_BOTH, src.pointers.data(), nb, src.capacity,
                                                  &request, staging.pointers[0], bytes, &kernel));
        } else {
            MORI_OK_OR_DIE(mori_tp_kvcache_pack(&config, src.pointers.data(), nb, src.capacity, src_side.pages.data(), n,
                                             staging.pointers[0], bytes, &kernel));
        }
    };
    const auto unpack = [&] {
        if (s.pair) {
            MORI_OK_OR_DIE(mori_tp_pair_unpack(&pair, MORI_TP_STAGING_BOTH, staging.pointers[0], bytes,
                                                    dst.pointers.data(), nb, dst.capacity, &request, &kernel));
        } else {
            MORI_OK_OR_DIE(mori_tp_kvcache_unpack(&config, staging.pointers[0], bytes, dst.pointers.data(), nb,
                                               dst.capacity, dst_side.pages.data(), n, &kernel));
        }
    };
    if (where.send) {
        const Timed t = measure(send, set.warmup, set.iterations, true);
        row({"send", "kernel", 1, std::to_string(upload), t.gpu, t.stream, lanes, t.flagged});
    }
    const Timed packed = measure(pack, set.warmup, set.iterations, true);
    row({"pack", "kernel", 1, "-", packed.gpu, packed.stream, -1, packed.flagged});
    const Timed unpacked = measure(unpack, set.warmup, set.iterations, true);
    row({"unpack", "kernel", 1, "-", unpacked.gpu, unpacked.stream, -1, unpacked.flagged});
    if (!where.send || !set.memcpy2d) {
        HIP_OK(hipStreamSynchronize(stream));
        return true;
    }

    // The per-rect path, issued here, and the byte check against the kernel's send.
    const auto memcpy2d = [&] {
        for (uint32_t b = 0; b < nb; b++) {
            const auto *s_base = static_cast<const uint8_t *>(src.pointers[b]);
            auto *d_base = static_cast<uint8_t *>(dst.pointers[b]);
            for (const MoriCopyRect &r : plan) {
                HIP_OK(hipMemcpy2DAsync(d_base + r.dst_offset, r.dst_pitch, s_base + r.src_offset, r.src_pitch,
                                        r.width, r.height, hipMemcpyDefault, stream));
            }
        }
    };
    const uint64_t calls = plan.size() * nb;
    const int iterations = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(set.iterations, kCallBudget / calls)));
    const Timed per_rect = measure(memcpy2d, iterations < set.iterations ? 0 : set.warmup, iterations, false);
    row({"send", "memcpy2d", calls, "-", -1, per_rect.stream, -1, false});

    const uint32_t checked[2] = {0, nb - 1};
    std::vector<std::vector<uint8_t>> by_kernel, by_memcpy2d;
    for (int path = 0; path < 2; path++) {
        HIP_OK(hipStreamSynchronize(stream));
        for (void *p : dst.pointers) {
            on_device(dst.device, [&] { HIP_OK(hipMemset(p, 0x5A, dst.capacity)); });
        }
        if (path == 0) {
            send();
        } else {
            memcpy2d();
        }
        HIP_OK(hipStreamSynchronize(stream));
        for (uint32_t b : checked) {
            std::vector<uint8_t> host(dst.capacity);
            HIP_OK(hipMemcpy(host.data(), dst.pointers[b], dst.capacity, hipMemcpyDefault));
            (path == 0 ? by_kernel : by_memcpy2d).push_back(std::move(host));
        }
    }
    if (by_kernel != by_memcpy2d) {
        std::fprintf(stderr, "bench: %s, %" PRIu64 " tokens: the kernel's send differs from the memcpy2D send\n",
                     s.name, tokens);
        return false;
    }
    checked_shapes++;
    return true;
}

// The kernel at the memory limit (issue 45, REFERENCE.md section 7): mori_tp_kvcache_pack with
// MORI_SEND_COPY_KERNEL of rows of 128, 256 and 512 B (one rect of all tokens per buffer: NHD,
// prefill TP 2 -> decode TP 8, one head of that size out of four, pages of 16, contiguous) and
// of one-row rects (page size 1, runs of one page), each against one hipMemcpyAsync of the same
// bytes in the same run (gpu_us, gated, medians); then the SM-budget curve: the 256 B rows with
// MORI_SEND_MAX_BLOCKS of 1, 2, 4, ... blocks up to the SM count, and none. Prints Markdown
// tables for BENCHMARKS.md. Every shape's first and last staged buffer is checked against the
// host backend's pack of the same source bytes. Returns false when a byte differs.
bool limit_suite(const Settings &set, hipStream_t stream, int sms, bool quick) {
    struct LimitShape {
        const char *name;
        uint64_t width;
        uint32_t page;
        uint64_t run;  // 0: contiguous pages
        double target;
    };
    const LimitShape shapes[] = {
        {"rows of 128 B", 128, 16, 0, 0.9},
        {"rows of 256 B", 256, 16, 0, 0.9},
        {"rows of 512 B", 512, 16, 0, 0.9},
        {"one-row rects of 128 B", 128, 1, 1, 0.7},
        {"one-row rects of 256 B", 256, 1, 1, 0.7},
        {"one-row rects of 512 B", 512, 1, 1, 0.7},
    };
    const uint64_t tokens = set.tokens.front();
    const uint32_t nb = set.buffers;
    const bool gated = set.gated > 0;
    std::printf("bench: the kernel at the memory limit: pack with MORI_SEND_COPY_KERNEL, %" PRIu64
                " tokens x %u buffers, against one hipMemcpyAsync of the same bytes (%s)\n",
                tokens, nb, gated ? "gpu_us: medians of gated calls" : "no gated timing: stream_us");
    std::printf("| shape | MiB | rects/buffer | memcpy us | kernel us | ratio | target |\n|---|---|---|---|---|---|---|\n");
    bool ok = true;
    std::vector<uint32_t> budgets;
    for (uint32_t b = 1; b < static_cast<uint32_t>(sms); b *= 2) budgets.push_back(b);
    budgets.push_back(static_cast<uint32_t>(sms));
    budgets.push_back(0);
    struct Curve {
        uint32_t budget;
        float ms;
    };
    std::vector<Curve> curve;
    float curve_memcpy = 0;
    uint64_t curve_bytes = 0;
    for (const LimitShape &shape : shapes) {
        const uint64_t src_bpt = 4 * shape.width, dst_bpt = shape.width;
        const MoriTpSliceParams params = {2, 0, 8, 0, 8, shape.page, shape.page * src_bpt, shape.page * dst_bpt};
        MoriTpSliceConfig config{};
        MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
        const uint64_t n = tokens / shape.page;
        const mori_testkit::Pages p =
            shape.run == 0 ? mori_testkit::contiguous(n) : mori_testkit::fixed_runs(7 + shape.width, n, shape.run);
        size_t rects = 0;
        const MoriStatus q = mori_tp_plan(&config, p.src.data(), p.dst.data(), n, nullptr, 0, &rects);
        if (q != MORI_OK && q != MORI_ERR_BUFFER_TOO_SMALL) MORI_OK_OR_DIE(q);
        uint64_t staging_len = 0;
        MORI_OK_OR_DIE(mori_tp_staging_len(&config, n, &staging_len));
        const uint64_t bytes = staging_len * nb;
        Buffers src(nb, p.src_capacity_pages * shape.page * src_bpt, 0, 0);
        for (uint32_t b = 0; b < nb; b++) {
            std::vector<uint8_t> fill(src.capacity);
            for (uint64_t i = 0; i < fill.size(); i++) fill[i] = static_cast<uint8_t>(i * 7 + b * 13 + shape.width);
            HIP_OK(hipMemcpy(src.pointers[b], fill.data(), fill.size(), hipMemcpyHostToDevice));
        }
        Buffers staging(1, bytes, 0, 0), flat_src(1, bytes, 4, 0), flat_dst(1, bytes, 5, 0);
        const auto timed = [&](const auto &body) {
            if (gated) {
                bool flagged = false;
                return gated_ms(0, stream, set.gated, body, &flagged);
            }
            return stream_ms(0, stream, set.warmup, set.iterations, body);
        };
        const float memcpy_ms = timed([&] {
            HIP_OK(hipMemcpyAsync(flat_dst.pointers[0], flat_src.pointers[0], bytes, hipMemcpyDefault, stream));
        });
        const auto pack = [&](uint32_t budget) {
            const MoriSendOptions options = {kBackend, MORI_SEND_COPY_KERNEL | (budget << MORI_SEND_MAX_BLOCKS_SHIFT),
                                             stream};
            return [&config, &src, &p, &staging, n, nb, bytes, options] {
                MORI_OK_OR_DIE(mori_tp_kvcache_pack(&config, src.pointers.data(), nb, src.capacity, p.src.data(), n,
                                                 staging.pointers[0], bytes, &options));
            };
        };
        const float kernel_ms = timed(pack(0));
        std::printf("| %s | %.1f | %zu | %.1f | %.1f | %.2f | %.1f |\n", shape.name,
                    static_cast<double>(bytes) / 1048576.0, rects, 1000.0 * memcpy_ms, 1000.0 * kernel_ms,
                    memcpy_ms / kernel_ms, shape.target);
        // The bytes: the first and the last buffer against the host backend's pack.
        HIP_OK(hipStreamSynchronize(stream));
        HIP_OK(hipMemset(staging.pointers[0], 0x5A, bytes));
        pack(quick ? 1 : 0)();
        HIP_OK(hipStreamSynchronize(stream));
        for (uint32_t b : {0u, nb - 1}) {
            std::vector<uint8_t> host_src(src.capacity), want(staging_len), got(staging_len);
            HIP_OK(hipMemcpy(host_src.data(), src.pointers[b], src.capacity, hipMemcpyDeviceToHost));
            HIP_OK(hipMemcpy(got.data(), static_cast<uint8_t *>(staging.pointers[0]) + b * staging_len, staging_len,
                             hipMemcpyDeviceToHost));
            const void *one[1] = {host_src.data()};
            const MoriSendOptions host = {MORI_BACKEND_HOST, 0, nullptr};
            MORI_OK_OR_DIE(mori_tp_kvcache_pack(&config, one, 1, src.capacity, p.src.data(), n, want.data(), staging_len,
                                             &host));
            if (want != got) {
                std::fprintf(stderr, "bench: %s: buffer %u of the kernel's pack differs from the host's\n", shape.name, b);
                ok = false;
            }
        }
        if (shape.width == 256 && shape.run == 0) {
            curve_memcpy = memcpy_ms;
            curve_bytes = bytes;
            for (uint32_t budget : budgets) curve.push_back({budget, timed(pack(budget))});
        }
    }
    std::printf("bench: the SM budget (MORI_SEND_MAX_BLOCKS), rows of 256 B, %d SMs: memcpy %.1f us\n", sms,
                1000.0 * curve_memcpy);
    std::printf("| blocks | kernel us | GB/s | share of memcpy |\n|---|---|---|---|\n");
    for (const Curve &c : curve) {
        char name[16];
        std::snprintf(name, sizeof name, "%u", c.budget);
        std::printf("| %s | %.1f | %.1f | %.2f |\n", c.budget == 0 ? "none" : name, 1000.0 * c.ms,
                    static_cast<double>(curve_bytes) / (1e6 * c.ms), curve_memcpy / c.ms);
    }
    return ok;
}

}  // namespace

int main(int argc, char **argv) {
    bool quick = false, memcpy2d = true;
    uint64_t only_tokens = 0;
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--no-memcpy2d") == 0) {
            memcpy2d = false;
        } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            only_tokens = std::strtoull(argv[++i], nullptr, 10);
        } else {
            std::fprintf(stderr, "usage: bench [--quick] [--no-memcpy2d] [--tokens N]\n");
            return kFailed;
        }
    }
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    const int skip = skip_without_device("bench");
    if (skip >= 0) {
        return skip;
    }
    Settings settings = quick ? Settings{{640}, 4, 1, 2, 0, memcpy2d} : Settings{{4096, 32768}, 64, 3, 20, 7, memcpy2d};
    if (only_tokens != 0) {
        settings.tokens = {only_tokens};
    }
    int device = -1, devices = 0;
    HIP_OK(hipGetDevice(&device));
    HIP_OK(hipGetDeviceCount(&devices));
    hipDeviceProp_t props;
    HIP_OK(hipGetDeviceProperties(&props, device));
    std::printf("bench: device %d of %d, %s (%s); %u buffers per call, 8 heads of 256 B; %d iterations back to "
                "back%s%s\n",
                device, devices, props.name, device_arch(props).c_str(), settings.buffers, settings.iterations,
                settings.gated > 0 ? ", gpu_us the median of 7 gated calls" : ", no gated timing",
                quick ? " (--quick)" : "");
    print_header();
    bool ok = true;
    hipStream_t stream;
    HIP_OK(hipStreamCreate(&stream));
    for (uint64_t tokens : settings.tokens) {
        for (const Shape &shape : kShapes) {
            ok &= run_case(shape, tokens, settings, kLocal, stream);
        }
    }
    ok &= limit_suite(settings, stream, props.multiProcessorCount > 0 ? props.multiProcessorCount : 4, quick);
    HIP_OK(hipStreamDestroy(stream));

    // The one-row and the contiguous shape with the memory elsewhere.
    const uint64_t tokens = settings.tokens.front();
    const auto placed = [&](const Placement &where) {
        std::printf("bench: %s\n", where.name);
        print_header();
        hipStream_t on;
        on_device(where.dst_device, [&] { HIP_OK(hipStreamCreate(&on)); });
        ok &= run_case(kShapes[3], tokens, settings, where, on);
        ok &= run_case(kShapes[1], tokens, settings, where, on);
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
    if (!ok) {
        std::printf("bench: FAILED: a kernel send differs from the memcpy2D send\n");
        return kFailed;
    }
    std::printf("bench: byte checks: %d cases, the kernel's send equal to the memcpy2D send on the first and the "
                "last buffer\n",
                checked_shapes);
    std::printf("bench: done\n");
    return kPassed;
}
