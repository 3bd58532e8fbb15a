// Benchmark of the HIP backend's two ways to run a call, against one hipMemcpyAsync of the same
// bytes on the same device:
//   memcpy2d  one hipMemcpy2DAsync per (buffer, rect) (the default);
//   kernel    one copy-kernel launch per call (MORI_SEND_COPY_KERNEL), plus one table upload;
//   memcpy    one hipMemcpyAsync of the call's bytes, contiguous (the bandwidth ceiling).
// for direct sends (mori_send_kvcache) and for the two halves of a staged transfer
// (mori_pack_kvcache, mori_unpack_kvcache), on three layouts of 8 KV heads of 256 bytes
// (head_dim 128, bf16): prefill TP 2 -> decode TP 8 (a 256 B slice of each 1 KiB source token),
// TP 8 -> 2 (into a 1 KiB destination token) and TP 4 -> 8 (a 256 B slice of 512 B tokens), with
// page sizes 1 and 16 and the request's pages in runs of 1, 4 or 16 pages (shuffled with gaps on
// both sides: each run is one rect), or all contiguous.
//
// Columns: calls = runtime calls per mori call (memcpy2d: rects x buffers; kernel: 1 launch);
// ms = time per call from hipEvents around `iterations` calls on one stream without
// MORI_SEND_SYNCHRONIZE (so it includes the host's cost of issuing them); GB/s of slice bytes;
// ratio = GB/s over the memcpy ceiling; kernel/2d = the kernel's speed-up over memcpy2d.
//
// Usage: bench [--quick]   (--quick: small sizes and few iterations, for the test suite)
// Exit: 0 done, 1 failed, 77 "skipped: no HIP device".

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <string>
#include <vector>

#include "common.hpp"

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

// A deterministic shuffle (splitmix64), so runs are comparable.
void shuffle(std::vector<uint32_t> &v, uint64_t seed) {
    for (size_t i = v.size(); i > 1; i--) {
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        std::swap(v[i - 1], v[z % i]);
    }
}

// Page lists of `pages` pairs in runs of `run` pages (0: one contiguous run), the runs in a
// shuffled order with a one-page gap after each on both sides. Returns the capacity in pages.
uint64_t make_pages(uint64_t pages, uint64_t run, uint64_t seed, std::vector<int32_t> &src,
                    std::vector<int32_t> &dst) {
    src.clear();
    dst.clear();
    if (run == 0) {
        for (uint64_t i = 0; i < pages; i++) {
            src.push_back(static_cast<int32_t>(i));
            dst.push_back(static_cast<int32_t>(i));
        }
        return pages;
    }
    const uint64_t runs = (pages + run - 1) / run;
    std::vector<uint32_t> src_order(runs), dst_order(runs);
    for (uint32_t r = 0; r < runs; r++) {
        src_order[r] = dst_order[r] = r;
    }
    shuffle(src_order, seed);
    shuffle(dst_order, seed + 1);
    for (uint64_t i = 0; i < pages; i++) {
        const uint64_t r = i / run, k = i % run;
        src.push_back(static_cast<int32_t>(src_order[r] * (run + 1) + k));
        dst.push_back(static_cast<int32_t>(dst_order[r] * (run + 1) + k));
    }
    return runs * (run + 1);
}

template <class Body>
float time_ms(hipStream_t stream, int warmup, int iterations, const Body &body) {
    for (int i = 0; i < warmup; i++) {
        body();
    }
    hipEvent_t start, stop;
    HIP_OK(hipEventCreate(&start));
    HIP_OK(hipEventCreate(&stop));
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

struct Buffers {
    std::vector<void *> pointers;
    uint64_t capacity = 0;

    Buffers(uint32_t count, uint64_t bytes, int fill) : pointers(count), capacity(bytes) {
        for (void *&p : pointers) {
            HIP_OK(hipMalloc(&p, bytes));
            HIP_OK(hipMemset(p, fill, bytes));
        }
    }
    ~Buffers() {
        for (void *p : pointers) {
            (void)hipFree(p);
        }
    }
    Buffers(const Buffers &) = delete;
    Buffers &operator=(const Buffers &) = delete;
};

void print_row(const char *layout, uint32_t page_size, const std::string &pages, const char *op, const char *path,
               uint64_t calls, float ms, uint64_t bytes, double ceiling_gbs, double versus) {
    const double gbs = static_cast<double>(bytes) / (ms * 1e6);
    char speedup[16] = "";
    if (versus > 0) {
        std::snprintf(speedup, sizeof speedup, "%.2f", gbs / versus);
    }
    std::printf("%-7s %4u %-11s %-6s %-8s %9" PRIu64 " %9.3f %9.1f %6.2f %9s\n", layout, page_size, pages.c_str(),
                op, path, calls, ms, gbs, gbs / ceiling_gbs, speedup);
}

void run_case(const Layout &l, uint32_t page_size, uint64_t run, const Settings &s, hipStream_t stream) {
    const uint64_t src_bpt = (kHeads / l.prefill_tp) * kBytesPerHead;
    const uint64_t dst_bpt = (l.decode_tp <= kHeads ? kHeads / l.decode_tp : 1) * kBytesPerHead;
    const uint64_t pages = s.tokens / page_size;
    std::vector<int32_t> src_pages, dst_pages;
    const uint64_t capacity_pages = make_pages(pages, run, 1000 * page_size + run, src_pages, dst_pages);
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
    uint64_t staging_len = 0;
    MORI_OK_OR_DIE(mori_tp_staging_len(&config, pages, &staging_len));

    Buffers src(s.buffers, capacity_pages * page_size * src_bpt, 1);
    Buffers dst(s.buffers, capacity_pages * page_size * dst_bpt, 2);
    Buffers staging(1, staging_len * s.buffers, 3);
    const uint64_t bytes = staging_len * s.buffers;  // slice bytes of one call
    Buffers flat(2, bytes, 4);
    const MoriKvBuffers kv = {src.pointers.data(), dst.pointers.data(), s.buffers, src.capacity, dst.capacity};

    const float flat_ms = time_ms(stream, s.warmup, s.iterations, [&] {
        HIP_OK(hipMemcpyAsync(flat.pointers[1], flat.pointers[0], bytes, hipMemcpyDeviceToDevice, stream));
    });
    const double ceiling = static_cast<double>(bytes) / (flat_ms * 1e6);
    const std::string shape = run == 0 ? "contiguous" : "runs of " + std::to_string(run);
    print_row(l.name, page_size, shape, "-", "memcpy", 1, flat_ms, bytes, ceiling, 0);

    // Each op with flags 0 (memcpy2d) and MORI_SEND_COPY_KERNEL (kernel).
    const char *ops[] = {"send", "pack", "unpack"};
    for (const char *op : ops) {
        double memcpy2d_gbs = 0;
        for (const uint32_t flags : {0u, static_cast<uint32_t>(MORI_SEND_COPY_KERNEL)}) {
            const MoriSendOptions options = {MORI_BACKEND_HIP, flags, stream};
            // A send of half a million hipMemcpy2DAsync calls takes seconds: fewer iterations.
            const uint64_t calls = flags == 0 ? rects * s.buffers : 1;
            const int iterations = static_cast<int>(
                std::max<uint64_t>(1, std::min<uint64_t>(s.iterations, kCallBudget / calls)));
            const float ms = time_ms(stream, iterations < s.iterations ? 1 : s.warmup, iterations, [&] {
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
            const bool kernel = flags != 0;
            print_row(l.name, page_size, shape, op, kernel ? "kernel" : "memcpy2d", calls, ms, bytes, ceiling,
                      kernel ? memcpy2d_gbs : 0);
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
    int device = -1;
    HIP_OK(hipGetDevice(&device));
    hipDeviceProp_t props;
    HIP_OK(hipGetDeviceProperties(&props, device));
    std::printf("bench: device %d, %s (%s); %" PRIu64 " tokens x %u buffers per call, 8 heads of 256 B, "
                "%d iterations%s\n",
                device, props.name, props.gcnArchName, settings.tokens, settings.buffers, settings.iterations,
                quick ? " (--quick)" : "");
    std::printf("%-7s %4s %-11s %-6s %-8s %9s %9s %9s %6s %9s\n", "layout", "page", "pages", "op", "path", "calls",
                "ms", "GB/s", "ratio", "kernel/2d");
    hipStream_t stream;
    HIP_OK(hipStreamCreate(&stream));
    for (const Layout &layout : kLayouts) {
        for (uint32_t page_size : {1u, 16u}) {
            for (uint64_t run : {uint64_t{1}, uint64_t{4}, uint64_t{16}, uint64_t{0}}) {
                run_case(layout, page_size, run, settings, stream);
            }
        }
    }
    HIP_OK(hipStreamDestroy(stream));
    std::printf("bench: done\n");
    return kPassed;
}
