// Benchmark: GB/s of mori_send_kvcache's HIP backend against one hipMemcpyAsync of the same
// number of bytes on the same device, for head-slice row widths of 128 B to 4 KiB, with the
// request's pages contiguous (one hipMemcpy2DAsync per buffer) or fragmented (a random page
// order on both sides: one hipMemcpy2DAsync per page per buffer).
//
// Layout: 8 KV heads, prefill TP 2 -> decode TP 8, so each decode rank receives one head per
// token: width = bytes per head, source pitch = 4 x width, destination pitch = width. Four
// buffers (K and V of two layers). Times come from hipEvents around `iterations` sends on one
// stream, without MORI_SEND_SYNCHRONIZE, so they include the host's cost of issuing the copies.
//
// Usage: bench [--quick]   (--quick: small sizes and few iterations, for the test suite)
// Exit: 0 done, 1 failed, 77 "skipped: no HIP device".

#include <cinttypes>
#include <cstring>
#include <vector>

#include "common.hpp"

namespace {

constexpr uint32_t kHeads = 8, kPrefillTp = 2, kDecodeTp = 8, kPageSize = 16, kBuffers = 4;

struct Settings {
    uint64_t bytes_per_send;  // slice bytes moved by one mori_send_kvcache, all buffers
    int warmup;
    int iterations;
};

// A deterministic shuffle (splitmix64), so runs are comparable.
void shuffle(std::vector<int32_t> &v, uint64_t seed) {
    for (size_t i = v.size(); i > 1; i--) {
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        std::swap(v[i - 1], v[z % i]);
    }
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

void run(uint64_t width, bool fragmented, const Settings &s, hipStream_t stream) {
    const uint64_t rows = s.bytes_per_send / (kBuffers * width);
    const uint64_t pages = rows / kPageSize;
    const uint64_t src_pitch = (kHeads / kPrefillTp) * width, dst_pitch = width;
    const uint64_t src_capacity = pages * kPageSize * src_pitch, dst_capacity = pages * kPageSize * dst_pitch;
    const MoriTpSliceParams params = {kPrefillTp, 0, kDecodeTp, 0, kHeads, kPageSize,
                                      kPageSize * src_pitch, kPageSize * dst_pitch};
    MoriTpSliceConfig config;
    MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));

    std::vector<int32_t> src_pages(pages), dst_pages(pages);
    for (uint64_t i = 0; i < pages; i++) {
        src_pages[i] = dst_pages[i] = static_cast<int32_t>(i);
    }
    if (fragmented) {
        shuffle(src_pages, 1);
        shuffle(dst_pages, 2);
    }
    size_t rects = 0;  // the size query answers MORI_ERR_BUFFER_TOO_SMALL when rects > 0
    const MoriStatus planned = mori_tp_plan(&config, src_pages.data(), dst_pages.data(), pages, nullptr, 0, &rects);
    if (planned != MORI_OK && planned != MORI_ERR_BUFFER_TOO_SMALL) {
        MORI_OK_OR_DIE(planned);
    }

    std::vector<void *> src(kBuffers), dst(kBuffers);
    for (uint32_t b = 0; b < kBuffers; b++) {
        HIP_OK(hipMalloc(&src[b], src_capacity));
        HIP_OK(hipMalloc(&dst[b], dst_capacity));
        HIP_OK(hipMemset(src[b], static_cast<int>(b + 1), src_capacity));
    }
    const uint64_t bytes = kBuffers * rows * width;
    void *flat_src = nullptr, *flat_dst = nullptr;
    HIP_OK(hipMalloc(&flat_src, bytes));
    HIP_OK(hipMalloc(&flat_dst, bytes));
    HIP_OK(hipMemset(flat_src, 1, bytes));

    const MoriKvBuffers kv = {src.data(), dst.data(), kBuffers, src_capacity, dst_capacity};
    const MoriSendOptions options = {MORI_BACKEND_HIP, 0, stream};
    const float mori_ms = time_ms(stream, s.warmup, s.iterations, [&] {
        MORI_OK_OR_DIE(mori_send_kvcache(&config, &kv, src_pages.data(), dst_pages.data(), pages, &options));
    });
    const float flat_ms = time_ms(stream, s.warmup, s.iterations, [&] {
        HIP_OK(hipMemcpyAsync(flat_dst, flat_src, bytes, hipMemcpyDeviceToDevice, stream));
    });

    const double mori_gbs = static_cast<double>(bytes) / (mori_ms * 1e6);
    const double flat_gbs = static_cast<double>(bytes) / (flat_ms * 1e6);
    std::printf("%8" PRIu64 " %6" PRIu64 " %6" PRIu64 " %-11s %8zu %10.3f %10.1f %14.1f %7.2f\n", width,
                src_pitch, dst_pitch, fragmented ? "fragmented" : "contiguous", rects * kBuffers, mori_ms,
                mori_gbs, flat_gbs, mori_gbs / flat_gbs);

    for (uint32_t b = 0; b < kBuffers; b++) {
        HIP_OK(hipFree(src[b]));
        HIP_OK(hipFree(dst[b]));
    }
    HIP_OK(hipFree(flat_src));
    HIP_OK(hipFree(flat_dst));
}

}  // namespace

int main(int argc, char **argv) {
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
    const int skip = skip_without_device("bench");
    if (skip >= 0) {
        return skip;
    }
    const Settings settings = quick ? Settings{2ull << 20, 1, 2} : Settings{64ull << 20, 2, 10};
    int device = -1;
    HIP_OK(hipGetDevice(&device));
    hipDeviceProp_t props;
    HIP_OK(hipGetDeviceProperties(&props, device));
    std::printf("bench: device %d, %s (%s); %" PRIu64 " MiB of head slices per send, %d iterations%s\n",
                device, props.name, props.gcnArchName, settings.bytes_per_send >> 20, settings.iterations,
                quick ? " (--quick)" : "");
    std::printf("%8s %6s %6s %-11s %8s %10s %10s %14s %7s\n", "width_B", "spitch", "dpitch", "pages",
                "copies", "mori_ms", "mori_GB/s", "hipMemcpy_GB/s", "ratio");
    hipStream_t stream;
    HIP_OK(hipStreamCreate(&stream));
    for (uint64_t width = 128; width <= 4096; width *= 2) {
        for (bool fragmented : {false, true}) {
            run(width, fragmented, settings, stream);
        }
    }
    HIP_OK(hipStreamDestroy(stream));
    return kPassed;
}
