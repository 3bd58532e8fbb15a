// Device test of the GPU backend on real GPU memory, for both ways it runs a call: one
// hipMemcpy2DAsync per (buffer, rect) (MORI_SEND_MEMCPY2D), and one copy-kernel launch
// (MORI_SEND_COPY_KERNEL). Built with hipcc it checks the HIP backend; built with nvcc and
// -I hip/cuda (hip/cuda/hip/hip_runtime.h maps the HIP names to CUDA's; hip/device-check.sh),
// the CUDA backend (MORI_BACKEND_CUDA, cuMemcpy2DAsync and the kernel as PTX).
//
// For several heterogeneous-TP layouts it allocates per-layer K and V buffers for every prefill
// and decode rank with hipMalloc, fills them, moves every (prefill rank, decode rank) pair's
// slice with mori_tp_kvcache_send (the backend, MORI_SEND_SYNCHRONIZE, on a created stream and
// on the null stream), copies the decode buffers back and checks them byte for byte against an
// independent statement of REFERENCE.md. It then does the same transfer through a staging
// region per pair (mori_tp_kvcache_pack on the prefill side, asynchronous, then mori_tp_kvcache_unpack
// on the decode side, on one stream), checking the staging bytes too, and checks that a refused
// call writes nothing. Each of these runs once per path.
//
// Then the same in the places a deployment puts memory, each on both paths:
// - the fragmented shape: page size 1 and runs of one page, so every rect is one row;
// - pinned host memory (hipHostMalloc) for every buffer and staging region;
// - with two or more devices: prefill buffers on device 0, decode buffers, staging and the stream
//   on device 1, while device 0 stays current (so the kernel must load on the stream's device),
//   with peer access enabled both ways where the devices allow it; on a runtime without
//   hipStreamGetDevice (HIP 5.x), where the library needs the stream's device current for
//   copy-kernel calls, with device 1 current instead (it prints which rule it followed);
// and host memory registered with hipHostRegister: the copy kernel takes it at the address
// hipHostGetDevicePointer returns, and refuses its host address when that differs. Then the pair
// functions (NHD pages of 16 -> HND pages of 64, a partial last page), two groups in one request,
// pack and unpack through a device staging pool, and interleaved sends on two streams.
//
// Exit: 0 passed, 1 failed, 77 "skipped: no HIP device".

#include <algorithm>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "testkit.hpp"

namespace {

struct Layout {
    const char *name;
    uint32_t heads;        // H: total KV heads (1 for MLA)
    uint32_t head_dim;     // elements per head
    uint32_t dtype_bytes;  // 2 = bf16, 1 = fp8
    uint32_t page_size;    // tokens per page
    uint32_t prefill_tp;
    uint32_t decode_tp;
    uint32_t layers;
    bool separate_v;       // K and V buffers per layer (false: one MLA latent buffer)
};

const Layout kLayouts[] = {
    {"qwen2.5-7b bf16, prefill TP 2 -> decode TP 8", 4, 128, 2, 16, 2, 8, 2, true},
    {"llama-3.1-70b fp8, prefill TP 8 -> decode TP 2", 8, 128, 1, 16, 8, 2, 2, true},
    {"gpt-oss-120b bf16 head_dim 64, prefill TP 4 -> decode TP 16", 8, 64, 2, 16, 4, 16, 2, true},
    {"12 heads fp8 head_dim 64, prefill TP 6 -> decode TP 4", 12, 64, 1, 8, 6, 4, 2, true},
    {"deepseek-v3 MLA bf16, prefill TP 8 -> decode TP 4", 1, 576, 2, 16, 8, 4, 2, false},
};

// A fragmented request: four runs of 3, 1, 2 and 4 pages, out of order on both sides.
mori_testkit::Pages fragmented_request() {
    mori_testkit::Pages pages;
    pages.src = {3, 4, 5, 9, 0, 1, 12, 13, 14, 15};
    pages.dst = {7, 8, 9, 1, 4, 5, 10, 11, 12, 13};
    pages.src_capacity_pages = 16;
    pages.dst_capacity_pages = 14;
    return pages;
}

// Where a test's buffers live and which stream it uses.
struct Placement {
    const char *name;
    int src_device;  // prefill buffers' device (-1: pinned host memory)
    int dst_device;  // decode buffers', staging regions' and the stream's device (-1: pinned host memory)
};

constexpr Placement kLocal = {"device memory", 0, 0};
constexpr Placement kPinned = {"pinned host memory", -1, -1};
constexpr Placement kTwoDevices = {"prefill on device 0, decode on device 1", 0, 1};

// `bytes` of memory as `device` says: hipMalloc'd there, or pinned host memory for -1.
void *allocate(int device, uint64_t bytes) {
    void *p = nullptr;
    if (device < 0) {
        HIP_OK(hipHostMalloc(&p, bytes, hipHostMallocDefault));
    } else {
        on_device(device, [&] { HIP_OK(hipMalloc(&p, bytes)); });
    }
    return p;
}

void release(int device, void *p) {
    (void)(device < 0 ? hipHostFree(p) : hipFree(p));
}

// Source bytes: a hash of (buffer, page, token, global head, byte), so any misplaced byte shows.
uint8_t pattern(uint32_t buffer, uint32_t page, uint32_t token, uint32_t head, uint32_t byte) {
    uint32_t x = buffer * 0x9E3779B1u ^ page * 0x85EBCA77u ^ token * 0xC2B2AE3Du ^
                 head * 0x27D4EB2Fu ^ byte * 0x165667B1u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return static_cast<uint8_t>(x);
}

// Destination bytes before the transfer: depend on rank, buffer and position, on no head.
uint8_t sentinel(uint32_t rank, uint32_t buffer, uint64_t offset) {
    return static_cast<uint8_t>(0xA5u ^ (rank * 7u) ^ (buffer * 13u) ^ static_cast<uint32_t>(offset * 31u));
}

struct Side {
    int device;  // as Placement says
    uint32_t tp;
    uint64_t bytes_per_token;
    uint64_t item_len;
    uint64_t capacity;
    // ranks[r][b]: device buffer b of rank r.
    std::vector<std::vector<void *>> ranks;
};

int failures = 0;

void fail(const std::string &what) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    failures++;
}

class Test {
  public:
    Test(const Layout &l, const mori_testkit::Pages &pages, const Placement &where)
        : l_(l), pages_(pages), where_(where), bph_(uint64_t{l.head_dim} * l.dtype_bytes),
          buffers_(l.layers * (l.separate_v ? 2 : 1)) {
        src_ = make_side(l.prefill_tp, pages.src_capacity_pages, where.src_device);
        dst_ = make_side(l.decode_tp, pages.dst_capacity_pages, where.dst_device);
        staged_ = make_side(l.decode_tp, pages.dst_capacity_pages, where.dst_device);
        on_device(where.dst_device, [&] { HIP_OK(hipStreamCreate(&stream_)); });
    }

    ~Test() {
        for (Side *side : {&src_, &dst_, &staged_}) {
            for (auto &rank : side->ranks) {
                for (void *p : rank) {
                    release(side->device, p);
                }
            }
        }
        (void)hipStreamDestroy(stream_);
    }

    void run() {
        std::printf("%s, %s, %zu pages: %u buffers, %" PRIu64 " bytes per head\n", l_.name, where_.name,
                    pages_.src.size(), buffers_, bph_);
        // The per-rect copies, the kernel, and the kernel on a budget of one block (the SM
        // budget, MORI_SEND_MAX_BLOCKS: the whole call strided over by a single block).
        const uint32_t one_block = static_cast<uint32_t>(MORI_SEND_COPY_KERNEL) | (1u << MORI_SEND_MAX_BLOCKS_SHIFT);
        for (const uint32_t path :
             {static_cast<uint32_t>(MORI_SEND_MEMCPY2D), static_cast<uint32_t>(MORI_SEND_COPY_KERNEL), one_block}) {
            const std::string name = path == MORI_SEND_MEMCPY2D      ? kPerRect
                                     : path == MORI_SEND_COPY_KERNEL ? "one copy-kernel launch"
                                                                     : "one copy-kernel launch on a budget of 1 block";
            fill();
            direct(path);
            verify(dst_, ("direct, " + name).c_str());
            refused_call_writes_nothing(path);
            staged(path);
            verify(staged_, ("pack + unpack, " + name).c_str());
        }
    }

  private:
    Side make_side(uint32_t tp, uint64_t capacity_pages, int device) {
        Side side;
        side.device = device;
        side.tp = tp;
        side.bytes_per_token = owned_heads(l_.heads, tp, 0).count * bph_;
        side.item_len = l_.page_size * side.bytes_per_token;
        side.capacity = capacity_pages * side.item_len;
        side.ranks.resize(tp);
        for (auto &rank : side.ranks) {
            rank.resize(buffers_);
            for (void *&p : rank) {
                p = allocate(device, side.capacity);
            }
        }
        return side;
    }

    void fill() {
        std::vector<uint8_t> host(src_.capacity);
        for (uint32_t p = 0; p < src_.tp; p++) {
            const HeadRange owned = owned_heads(l_.heads, src_.tp, p);
            for (uint32_t b = 0; b < buffers_; b++) {
                for (uint64_t at = 0; at < src_.capacity; at++) {
                    const uint64_t token_index = at / src_.bytes_per_token;
                    const uint64_t in_token = at % src_.bytes_per_token;
                    host[at] = pattern(b, static_cast<uint32_t>(token_index / l_.page_size),
                                       static_cast<uint32_t>(token_index % l_.page_size),
                                       owned.first + static_cast<uint32_t>(in_token / bph_),
                                       static_cast<uint32_t>(in_token % bph_));
                }
                HIP_OK(hipMemcpy(src_.ranks[p][b], host.data(), src_.capacity, hipMemcpyDefault));
            }
        }
        for (Side *side : {&dst_, &staged_}) {
            std::vector<uint8_t> init(side->capacity);
            for (uint32_t d = 0; d < side->tp; d++) {
                for (uint32_t b = 0; b < buffers_; b++) {
                    for (uint64_t at = 0; at < side->capacity; at++) {
                        init[at] = sentinel(d, b, at);
                    }
                    HIP_OK(hipMemcpy(side->ranks[d][b], init.data(), side->capacity, hipMemcpyDefault));
                }
            }
        }
        HIP_OK(hipDeviceSynchronize());
    }

    MoriTpSliceConfig config(uint32_t p, uint32_t d) const {
        const MoriTpSliceParams params = {l_.prefill_tp, p, l_.decode_tp, d, l_.heads, l_.page_size,
                                          src_.item_len, dst_.item_len};
        MoriTpSliceConfig config;
        MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
        return config;
    }

    static MoriKvBuffers buffers(const std::vector<void *> &src, const std::vector<void *> &dst,
                                 uint64_t src_capacity, uint64_t dst_capacity) {
        return MoriKvBuffers{src.data(), dst.data(), src.size(),
                             src_capacity, dst_capacity};
    }

    // Every pair, straight from the prefill buffers into the decode buffers.
    void direct(uint32_t path) {
        int sends = 0;
        for (uint32_t p = 0; p < l_.prefill_tp; p++) {
            for (uint32_t d = 0; d < l_.decode_tp; d++) {
                const MoriTpSliceConfig c = config(p, d);
                const MoriKvBuffers kv = buffers(src_.ranks[p], dst_.ranks[d], src_.capacity, dst_.capacity);
                // Alternate the created stream and the null stream.
                const MoriSendOptions options = {kBackend, MORI_SEND_SYNCHRONIZE | path,
                                                 (p + d) % 2 == 0 ? stream_ : nullptr};
                MORI_OK_OR_DIE(mori_tp_kvcache_send(&c, &kv, pages_.src.data(), pages_.dst.data(), pages_.src.size(),
                                                 &options));
                sends += c.action == MORI_TP_ACTION_SEND;
            }
        }
        // Each (decode rank, head) has exactly one sender.
        const uint32_t expected = l_.decode_tp * owned_heads(l_.heads, l_.decode_tp, 0).count;
        int pairs_heads = 0;
        for (uint32_t p = 0; p < l_.prefill_tp; p++) {
            for (uint32_t d = 0; d < l_.decode_tp; d++) {
                pairs_heads += static_cast<int>(config(p, d).num_heads);
            }
        }
        if (pairs_heads != static_cast<int>(expected)) {
            fail(std::string(l_.name) + ": sending pairs move " + std::to_string(pairs_heads) +
                 " (decode rank, head) slots, expected " + std::to_string(expected));
        }
        std::printf("  direct: %d sending pairs\n", sends);
    }

    // Every pair through a staging region: pack (asynchronous), then unpack (synchronize).
    void staged(uint32_t path) {
        const MoriSendOptions async = {kBackend, path, stream_};
        const MoriSendOptions sync = {kBackend, MORI_SEND_SYNCHRONIZE | path, stream_};
        for (uint32_t p = 0; p < l_.prefill_tp; p++) {
            for (uint32_t d = 0; d < l_.decode_tp; d++) {
                const MoriTpSliceConfig c = config(p, d);
                if (c.action != MORI_TP_ACTION_SEND) {
                    continue;
                }
                const size_t n = pages_.src.size();
                uint64_t staging_len = 0;
                MORI_OK_OR_DIE(mori_tp_staging_len(&c, n, &staging_len));
                const uint64_t region_bytes = staging_len * buffers_;
                void *region = allocate(where_.dst_device, region_bytes);
                MORI_OK_OR_DIE(mori_tp_kvcache_pack(&c, src_.ranks[p].data(), buffers_, src_.capacity, pages_.src.data(),
                                                 n, region, region_bytes, &async));
                MORI_OK_OR_DIE(mori_tp_kvcache_unpack(&c, region, region_bytes, staged_.ranks[d].data(), buffers_,
                                                   staged_.capacity, pages_.dst.data(), n, &sync));
                verify_staging(region, staging_len, c, p, d);
                release(where_.dst_device, region);
            }
        }
    }

    // Buffer b's staged slice is at b * staging_len: token k of it is the slice of token
    // k % page_size of the page at position k / page_size.
    void verify_staging(void *region, uint64_t staging_len, const MoriTpSliceConfig &c, uint32_t p, uint32_t d) {
        std::vector<uint8_t> host(staging_len);
        for (uint32_t b = 0; b < buffers_; b++) {
            HIP_OK(hipMemcpy(host.data(), static_cast<uint8_t *>(region) + b * staging_len, staging_len,
                             hipMemcpyDefault));
            uint64_t at = 0;
            for (size_t i = 0; i < pages_.src.size(); i++) {
                for (uint32_t t = 0; t < l_.page_size; t++) {
                    for (uint32_t k = 0; k < c.num_heads; k++) {
                        for (uint64_t x = 0; x < bph_; x++, at++) {
                            const uint8_t want = pattern(b, static_cast<uint32_t>(pages_.src[i]), t,
                                                         c.first_head + k, static_cast<uint32_t>(x));
                            if (host[at] != want) {
                                fail(std::string(l_.name) + ": staging of pair (" + std::to_string(p) +
                                     ", " + std::to_string(d) + ") buffer " + std::to_string(b) +
                                     ": wrong byte at " + std::to_string(at));
                                return;
                            }
                        }
                    }
                }
            }
        }
    }

    // What decode rank d's buffer b must hold: its sentinel, except its own heads of the
    // requested pages, which hold the source pattern.
    std::vector<uint8_t> expected(const Side &side, uint32_t d, uint32_t b) const {
        std::vector<uint8_t> want(side.capacity);
        for (uint64_t at = 0; at < side.capacity; at++) {
            want[at] = sentinel(d, b, at);
        }
        const HeadRange owned = owned_heads(l_.heads, side.tp, d);
        for (size_t i = 0; i < pages_.src.size(); i++) {
            for (uint32_t t = 0; t < l_.page_size; t++) {
                for (uint32_t k = 0; k < owned.count; k++) {
                    const uint64_t base = pages_.dst[i] * side.item_len + t * side.bytes_per_token + k * bph_;
                    for (uint64_t x = 0; x < bph_; x++) {
                        want[base + x] = pattern(b, static_cast<uint32_t>(pages_.src[i]), t, owned.first + k,
                                                 static_cast<uint32_t>(x));
                    }
                }
            }
        }
        return want;
    }

    void verify(const Side &side, const char *how) {
        std::vector<uint8_t> got(side.capacity);
        for (uint32_t d = 0; d < side.tp; d++) {
            for (uint32_t b = 0; b < buffers_; b++) {
                HIP_OK(hipMemcpy(got.data(), side.ranks[d][b], side.capacity, hipMemcpyDefault));
                const std::vector<uint8_t> want = expected(side, d, b);
                for (uint64_t at = 0; at < side.capacity; at++) {
                    if (got[at] != want[at]) {
                        fail(std::string(l_.name) + ", " + where_.name + " (" + how + "): decode rank " + std::to_string(d) +
                             " buffer " + std::to_string(b) + ": first wrong byte at " + std::to_string(at) +
                             " (page " + std::to_string(at / side.item_len) + ", byte " +
                             std::to_string(at % side.item_len) + " of the page)");
                        break;
                    }
                }
            }
        }
        std::printf("  %s: every decode byte checked\n", how);
    }

    // A page one past the decode capacity: MORI_ERR_OUT_OF_BOUNDS, and no byte written.
    void refused_call_writes_nothing(uint32_t path) {
        const MoriTpSliceConfig c = config(0, 0);
        const MoriKvBuffers kv = buffers(src_.ranks[0], dst_.ranks[0], src_.capacity, dst_.capacity);
        const int32_t src_pages[2] = {0, 1};
        const int32_t dst_pages[2] = {0, static_cast<int32_t>(pages_.dst_capacity_pages)};
        const MoriSendOptions options = {kBackend, MORI_SEND_SYNCHRONIZE | path, stream_};
        const MoriStatus status = mori_tp_kvcache_send(&c, &kv, src_pages, dst_pages, 2, &options);
        if (status != MORI_ERR_OUT_OF_BOUNDS) {
            fail(std::string(l_.name) + ": a page past capacity returned " + mori_tp_status_name(status) + ": " +
                 mori_tp_last_error_message());
        }
        verify(dst_, "after a refused call");
    }

    const Layout &l_;
    mori_testkit::Pages pages_;
    Placement where_;
    uint64_t bph_;
    uint32_t buffers_;
    Side src_, dst_, staged_;
    hipStream_t stream_ = nullptr;
};

// Qwen2.5-7B's heads with one-token pages: with runs of one page every rect is one row.
const Layout kOneTokenPages = {"qwen2.5-7b bf16 page size 1, prefill TP 2 -> decode TP 8", 4, 128, 2, 1, 2, 8, 2, true};

// The fragmented shape: 48 pages in runs of one page, shuffled with gaps on both sides.
mori_testkit::Pages one_page_runs() {
    return mori_testkit::fixed_runs(24, 48, 1);
}

// Zeroed host bytes on whole pages of their own, as hipHostRegister pins whole pages.
class PageBytes {
  public:
    explicit PageBytes(size_t size) : size_(size) {
        const size_t page = 4096, rounded = (size + page - 1) / page * page;
        bytes_ = static_cast<uint8_t *>(std::aligned_alloc(page, rounded));
        if (bytes_ == nullptr) {
            std::fprintf(stderr, "device_test: cannot allocate %zu host bytes\n", rounded);
            std::exit(kFailed);
        }
        std::memset(bytes_, 0, rounded);
    }
    ~PageBytes() { std::free(bytes_); }
    PageBytes(const PageBytes &) = delete;
    PageBytes &operator=(const PageBytes &) = delete;

    uint8_t *data() { return bytes_; }
    size_t size() const { return size_; }
    uint8_t &operator[](size_t i) { return bytes_[i]; }
    uint8_t *begin() { return bytes_; }
    uint8_t *end() { return bytes_ + size_; }

  private:
    size_t size_;
    uint8_t *bytes_;
};

// Host memory registered with hipHostRegister, through the copy kernel: at the address
// hipHostGetDevicePointer returns the bytes land; at its host address, when that differs, the
// library refuses (the kernel would fault) and writes nothing. The per-rect path takes either.
void registered_host_memory() {
    const MoriTpSliceParams params = {2, 1, 4, 3, 8, 1, 64, 32};  // 8 heads of 16 B, pair (1, 3)
    MoriTpSliceConfig config;
    MORI_OK_OR_DIE(mori_tp_slice_config(&params, &config));
    PageBytes src(4 * 64), dst(4 * 32);
    for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 3);
    HIP_OK(hipHostRegister(src.data(), src.size(), hipHostRegisterDefault));
    HIP_OK(hipHostRegister(dst.data(), dst.size(), hipHostRegisterDefault));
    void *src_device = nullptr, *dst_device = nullptr;
    HIP_OK(hipHostGetDevicePointer(&src_device, src.data(), 0));
    HIP_OK(hipHostGetDevicePointer(&dst_device, dst.data(), 0));
    const int32_t pages[3] = {0, 1, 3};
    const MoriSendOptions kernel = {kBackend, MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL, nullptr};
    const auto expect = [&](const char *how) {
        for (uint32_t page = 0; page < 4; page++) {
            for (uint32_t x = 0; x < 32; x++) {
                const bool sent = page != 2;
                const uint8_t want = sent ? src[page * 64 + 32 + x] : uint8_t{0xEE};
                if (dst[page * 32 + x] != want) {
                    fail(std::string("registered host memory, ") + how + ": wrong byte " + std::to_string(x) +
                         " of page " + std::to_string(page));
                    return;
                }
            }
        }
    };
    {
        std::fill(dst.begin(), dst.end(), 0xEE);
        const void *srcs[1] = {src_device};
        void *dsts[1] = {dst_device};
        const MoriKvBuffers kv = {srcs, dsts, 1, src.size(), dst.size()};
        MORI_OK_OR_DIE(mori_tp_kvcache_send(&config, &kv, pages, pages, 3, &kernel));
        expect("copy kernel at the hipHostGetDevicePointer address");
    }
    if (src_device != src.data()) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        const void *srcs[1] = {src.data()};
        void *dsts[1] = {dst.data()};
        const MoriKvBuffers kv = {srcs, dsts, 1, src.size(), dst.size()};
        const MoriStatus status = mori_tp_kvcache_send(&config, &kv, pages, pages, 3, &kernel);
        if (status != MORI_ERR_GPU || std::strstr(mori_tp_last_error_message(), "hipHostRegister") == nullptr ||
            std::count(dst.begin(), dst.end(), uint8_t{0xEE}) != static_cast<long>(dst.size())) {
            fail(std::string("the copy kernel given registered memory's host address returned ") +
                 mori_tp_status_name(status) + ": " + mori_tp_last_error_message());
        }
        const MoriSendOptions per_rect = {kBackend, MORI_SEND_SYNCHRONIZE | MORI_SEND_MEMCPY2D, nullptr};
        MORI_OK_OR_DIE(mori_tp_kvcache_send(&config, &kv, pages, pages, 3, &per_rect));
        expect("hipMemcpy2DAsync at the host address");
        std::printf("registered host memory (hipHostRegister): the copy kernel takes the device address %p, "
                    "refuses the host address %p; the per-rect path takes both\n",
                    src_device, static_cast<void *>(src.data()));
    } else {
        std::printf("registered host memory (hipHostRegister): device address = host address here\n");
    }
    HIP_OK(hipHostUnregister(src.data()));
    HIP_OK(hipHostUnregister(dst.data()));
}

// Issue 19: a pair of layouts (prefill NHD, pages of 16, TP 2 -> decode HND, pages of 64, TP 4;
// 173 tokens, so both last pages are partial) through mori_send/pack/unpack_kvcache_pair in device
// memory, per rect and with the copy kernel, checked byte for byte (untouched bytes included)
// against MORI_BACKEND_HOST on host copies of the same buffers.
void pair_layouts() {
    MoriTpLayout prefill, decode;
    MORI_OK_OR_DIE(mori_tp_layout_nhd(8, 2, 1, 16, 32, &prefill));
    MORI_OK_OR_DIE(mori_tp_layout_hnd(8, 4, 2, 64, 32, &decode));
    MoriTpPairConfig config;
    MORI_OK_OR_DIE(mori_tp_pair_config(&prefill, &decode, &config));
    const uint64_t tokens = 173;
    const std::vector<int32_t> src_pages = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0};  // ceil(173 / 16)
    const std::vector<int32_t> dst_pages = {3, 1, 0};                                // ceil(173 / 64)
    const MoriTpRequest request = {src_pages.data(), src_pages.size(), dst_pages.data(), dst_pages.size(), tokens};
    const uint64_t src_len = 14 * prefill.page_stride, dst_len = 4 * decode.page_stride;
    uint64_t staging_len = 0;
    MORI_OK_OR_DIE(mori_tp_pair_staging_len(&config, tokens, &staging_len));
    const uint64_t region_len = 2 * staging_len;
    std::vector<std::vector<uint8_t>> src(2, std::vector<uint8_t>(src_len)), dst(2, std::vector<uint8_t>(dst_len));
    for (size_t b = 0; b < 2; b++) {
        for (uint64_t i = 0; i < src_len; i++) src[b][i] = static_cast<uint8_t>(i * 131 + b * 7 + 1);
        for (uint64_t i = 0; i < dst_len; i++) dst[b][i] = static_cast<uint8_t>(i * 29 + b * 3 + 0x80);
    }
    std::vector<uint8_t> region_in(region_len);
    for (uint64_t i = 0; i < region_len; i++) region_in[i] = static_cast<uint8_t>(i * 53 + 5);
    const MoriSendOptions host = {MORI_BACKEND_HOST, 0, nullptr};
    const auto device_copy = [](const std::vector<uint8_t> &bytes) {
        void *p = nullptr;
        HIP_OK(hipMalloc(&p, bytes.size()));
        HIP_OK(hipMemcpy(p, bytes.data(), bytes.size(), hipMemcpyHostToDevice));
        return p;
    };
    const auto read_back = [](void *p, size_t len) {
        std::vector<uint8_t> out(len);
        HIP_OK(hipMemcpy(out.data(), p, len, hipMemcpyDeviceToHost));
        return out;
    };
    for (const uint32_t path : {static_cast<uint32_t>(MORI_SEND_MEMCPY2D), static_cast<uint32_t>(MORI_SEND_COPY_KERNEL)}) {
        const char *name = path == MORI_SEND_MEMCPY2D ? kPerRect : "one copy-kernel launch";
        const MoriSendOptions hip = {kBackend, MORI_SEND_SYNCHRONIZE | path, nullptr};
        std::vector<const void *> host_src = {src[0].data(), src[1].data()};
        std::vector<const void *> dev_src = {device_copy(src[0]), device_copy(src[1])};
        // Send.
        std::vector<std::vector<uint8_t>> want = dst;
        std::vector<void *> host_dst = {want[0].data(), want[1].data()};
        std::vector<void *> dev_dst = {device_copy(dst[0]), device_copy(dst[1])};
        const MoriKvBuffers host_kv = {host_src.data(), host_dst.data(), 2, src_len, dst_len};
        const MoriKvBuffers dev_kv = {dev_src.data(), dev_dst.data(), 2, src_len, dst_len};
        MORI_OK_OR_DIE(mori_tp_pair_send(&config, &host_kv, &request, &host));
        MORI_OK_OR_DIE(mori_tp_pair_send(&config, &dev_kv, &request, &hip));
        for (size_t b = 0; b < 2; b++) {
            if (read_back(dev_dst[b], dst_len) != want[b]) fail(std::string("pair send, ") + name + ": bytes differ");
        }
        // Pack (SRC, BOTH) and unpack (DST, BOTH).
        for (const uint32_t mode : {MORI_TP_STAGING_SRC, MORI_TP_STAGING_BOTH}) {
            std::vector<uint8_t> want_region(region_len, 0x5a);
            void *region = device_copy(want_region);
            MORI_OK_OR_DIE(mori_tp_pair_pack(&config, mode, host_src.data(), 2, src_len, &request,
                                                  want_region.data(), region_len, &host));
            MORI_OK_OR_DIE(
                mori_tp_pair_pack(&config, mode, dev_src.data(), 2, src_len, &request, region, region_len, &hip));
            if (read_back(region, region_len) != want_region) fail(std::string("pair pack, ") + name + ": bytes differ");
            HIP_OK(hipFree(region));
        }
        void *region = device_copy(region_in);
        for (const uint32_t mode : {MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH}) {
            want = dst;
            host_dst = {want[0].data(), want[1].data()};
            for (size_t b = 0; b < 2; b++) HIP_OK(hipMemcpy(dev_dst[b], dst[b].data(), dst_len, hipMemcpyHostToDevice));
            MORI_OK_OR_DIE(mori_tp_pair_unpack(&config, mode, region_in.data(), region_len, host_dst.data(), 2,
                                                    dst_len, &request, &host));
            MORI_OK_OR_DIE(mori_tp_pair_unpack(&config, mode, region, region_len, dev_dst.data(), 2, dst_len,
                                                    &request, &hip));
            for (size_t b = 0; b < 2; b++) {
                if (read_back(dev_dst[b], dst_len) != want[b]) {
                    fail(std::string("pair unpack, ") + name + ": bytes differ");
                }
            }
        }
        HIP_OK(hipFree(region));
        for (size_t b = 0; b < 2; b++) {
            HIP_OK(hipFree(const_cast<void *>(dev_src[b])));
            HIP_OK(hipFree(dev_dst[b]));
        }
        std::printf("pair NHD (pages of 16) -> HND (pages of 64), 173 tokens, %s: send, pack, unpack checked\n",
                    name);
    }
}

// Bytes of device memory holding `bytes`, and back.
void *device_copy_of(const std::vector<uint8_t> &bytes) {
    void *p = nullptr;
    HIP_OK(hipMalloc(&p, bytes.size()));
    HIP_OK(hipMemcpy(p, bytes.data(), bytes.size(), hipMemcpyHostToDevice));
    return p;
}

std::vector<uint8_t> host_copy_of(const void *p, size_t len) {
    std::vector<uint8_t> out(len);
    HIP_OK(hipMemcpy(out.data(), p, len, hipMemcpyDeviceToHost));
    return out;
}

// One fragmented send for two_streams and device_pool: 8 heads of 256 bytes, prefill TP 2 ->
// decode TP 4, pair (1, 3), pages of 16, `pages` pages in runs of one page (seeded), 4 buffers;
// its source and initial destination bytes, and what a host send leaves in the destination.
struct Case {
    MoriTpSliceConfig config;
    mori_testkit::Pages pages;
    uint64_t src_len, dst_len;
    std::vector<std::vector<uint8_t>> src, dst, want;
};

Case make_case(uint64_t seed, size_t pages) {
    Case c;
    const MoriTpSliceParams params = {2, 1, 4, 3, 8, 16, 16 * 4 * 256, 16 * 2 * 256};
    MORI_OK_OR_DIE(mori_tp_slice_config(&params, &c.config));
    c.pages = mori_testkit::fixed_runs(seed, pages, 1);
    c.src_len = c.pages.src_capacity_pages * params.src_item_len;
    c.dst_len = c.pages.dst_capacity_pages * params.dst_item_len;
    for (uint64_t b = 0; b < 4; b++) {
        std::vector<uint8_t> src(c.src_len), dst(c.dst_len);
        for (uint64_t i = 0; i < c.src_len; i++) src[i] = static_cast<uint8_t>(i * 131 + b * 7 + seed * 13 + 1);
        for (uint64_t i = 0; i < c.dst_len; i++) dst[i] = static_cast<uint8_t>(i * 29 + b * 3 + seed + 0x80);
        c.src.push_back(src);
        c.dst.push_back(dst);
    }
    c.want = c.dst;
    std::vector<const void *> srcs;
    std::vector<void *> dsts;
    for (size_t b = 0; b < 4; b++) {
        srcs.push_back(c.src[b].data());
        dsts.push_back(c.want[b].data());
    }
    const MoriKvBuffers kv = {srcs.data(), dsts.data(), 4, c.src_len, c.dst_len};
    const MoriSendOptions host = {MORI_BACKEND_HOST, 0, nullptr};
    MORI_OK_OR_DIE(mori_tp_kvcache_send(&c.config, &kv, c.pages.src.data(), c.pages.dst.data(), c.pages.src.size(),
                                     &host));
    return c;
}

// Two streams, each given kernel sends of its own requests, interleaved and not waited for
// between calls (the library fences each stream's table buffers on that stream): every byte of
// every destination as a host send leaves it.
void two_streams() {
    hipStream_t streams[2];
    HIP_OK(hipStreamCreate(&streams[0]));
    HIP_OK(hipStreamCreate(&streams[1]));
    std::vector<Case> cases;
    std::vector<std::vector<void *>> src(8), dst(8);
    for (uint64_t i = 0; i < 8; i++) {
        cases.push_back(make_case(100 + i, 40 + 3 * i));
        for (size_t b = 0; b < 4; b++) {
            src[i].push_back(device_copy_of(cases[i].src[b]));
            dst[i].push_back(device_copy_of(cases[i].dst[b]));
        }
    }
    for (const uint32_t path : {static_cast<uint32_t>(MORI_SEND_COPY_KERNEL), static_cast<uint32_t>(MORI_SEND_MEMCPY2D)}) {
        for (uint64_t i = 0; i < 8; i++) {
            for (size_t b = 0; b < 4; b++) {
                HIP_OK(hipMemcpy(dst[i][b], cases[i].dst[b].data(), cases[i].dst_len, hipMemcpyHostToDevice));
            }
        }
        for (uint64_t i = 0; i < 8; i++) {
            const Case &c = cases[i];
            std::vector<const void *> srcs(src[i].begin(), src[i].end());
            const MoriKvBuffers kv = {srcs.data(), dst[i].data(), 4, c.src_len, c.dst_len};
            const MoriSendOptions options = {kBackend, path, streams[i % 2]};
            MORI_OK_OR_DIE(mori_tp_kvcache_send(&c.config, &kv, c.pages.src.data(), c.pages.dst.data(),
                                             c.pages.src.size(), &options));
        }
        HIP_OK(hipStreamSynchronize(streams[0]));
        HIP_OK(hipStreamSynchronize(streams[1]));
        for (uint64_t i = 0; i < 8; i++) {
            for (size_t b = 0; b < 4; b++) {
                if (host_copy_of(dst[i][b], cases[i].dst_len) != cases[i].want[b]) {
                    fail("two streams, " + std::string(path == MORI_SEND_MEMCPY2D ? kPerRect : "the copy kernel") +
                         ": send " + std::to_string(i) + " buffer " + std::to_string(b) + ": bytes differ");
                }
            }
        }
    }
    for (uint64_t i = 0; i < 8; i++) {
        for (size_t b = 0; b < 4; b++) {
            HIP_OK(hipFree(src[i][b]));
            HIP_OK(hipFree(dst[i][b]));
        }
    }
    HIP_OK(hipStreamDestroy(streams[0]));
    HIP_OK(hipStreamDestroy(streams[1]));
    std::printf("two streams, 8 interleaved sends each way (kernel, then per rect), not waited for between "
                "calls: every byte checked\n");
}

// A staging pool of device memory (mori_tp_pool_create, MORI_TP_POOL_DEVICE): pack into a slot,
// unpack from it, with each path: the destination as a host send leaves it.
void device_pool() {
    const Case c = make_case(7, 48);
    uint64_t staging_len = 0;
    MORI_OK_OR_DIE(mori_tp_staging_len(&c.config, c.pages.src.size(), &staging_len));
    const MoriTpPoolOptions options = {64u << 20, 64u << 10, MORI_TP_POOL_DEVICE, 0};
    MoriTpPool pool = 0;
    MORI_OK_OR_DIE(mori_tp_pool_create(&options, &pool));
    std::vector<void *> src, dst;
    for (size_t b = 0; b < 4; b++) {
        src.push_back(device_copy_of(c.src[b]));
        dst.push_back(device_copy_of(c.dst[b]));
    }
    std::vector<const void *> srcs(src.begin(), src.end());
    for (const uint32_t path : {static_cast<uint32_t>(MORI_SEND_MEMCPY2D), static_cast<uint32_t>(MORI_SEND_COPY_KERNEL)}) {
        for (size_t b = 0; b < 4; b++) {
            HIP_OK(hipMemcpy(dst[b], c.dst[b].data(), c.dst_len, hipMemcpyHostToDevice));
        }
        MoriTpSlot slot;
        MORI_OK_OR_DIE(mori_tp_pool_try_alloc(pool, 4 * staging_len, &slot));
        const MoriSendOptions sync = {kBackend, MORI_SEND_SYNCHRONIZE | path, nullptr};
        MORI_OK_OR_DIE(mori_tp_kvcache_pack(&c.config, srcs.data(), 4, c.src_len, c.pages.src.data(), c.pages.src.size(),
                                         slot.address, slot.size, &sync));
        MORI_OK_OR_DIE(mori_tp_kvcache_unpack(&c.config, slot.address, slot.size, dst.data(), 4, c.dst_len,
                                           c.pages.dst.data(), c.pages.dst.size(), &sync));
        for (size_t b = 0; b < 4; b++) {
            if (host_copy_of(dst[b], c.dst_len) != c.want[b]) {
                fail(std::string("device pool, ") + (path == MORI_SEND_MEMCPY2D ? kPerRect : "the copy kernel") +
                     ": buffer " + std::to_string(b) + ": bytes differ");
            }
        }
        MORI_OK_OR_DIE(mori_tp_pool_free(pool, slot.offset));
    }
    MORI_OK_OR_DIE(mori_tp_pool_destroy(pool));
    for (size_t b = 0; b < 4; b++) {
        HIP_OK(hipFree(src[b]));
        HIP_OK(hipFree(dst[b]));
    }
    std::printf("device staging pool (MORI_TP_POOL_DEVICE): pack into a slot and unpack from it, per rect and "
                "with the kernel: every byte checked\n");
}

// Two groups in one request (mori_tp_groups_send): the NHD (pages of 16) -> HND (pages of
// 64) pair of pair_layouts with 173 tokens, and an HND -> NHD pair with pages of 16 and 40
// tokens, on buffers of their own; per rect and with the kernel, against the host backend.
void groups() {
    struct Side {
        MoriTpLayout prefill, decode;
        std::vector<int32_t> src_pages, dst_pages;
        uint64_t tokens;
    };
    Side sides[2];
    MORI_OK_OR_DIE(mori_tp_layout_nhd(8, 2, 1, 16, 32, &sides[0].prefill));
    MORI_OK_OR_DIE(mori_tp_layout_hnd(8, 4, 2, 64, 32, &sides[0].decode));
    sides[0].src_pages = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0};
    sides[0].dst_pages = {3, 1, 0};
    sides[0].tokens = 173;
    MORI_OK_OR_DIE(mori_tp_layout_hnd(4, 2, 0, 16, 64, &sides[1].prefill));
    MORI_OK_OR_DIE(mori_tp_layout_nhd(4, 4, 1, 16, 64, &sides[1].decode));
    sides[1].src_pages = {2, 0, 1};
    sides[1].dst_pages = {1, 3, 0};
    sides[1].tokens = 40;
    MoriTpGroup host_groups[2], dev_groups[2];
    std::vector<std::vector<uint8_t>> src[2], dst[2], want[2];
    std::vector<const void *> host_src[2], dev_src[2];
    std::vector<void *> host_dst[2], dev_dst[2];
    for (int g = 0; g < 2; g++) {
        Side &side = sides[g];
        MoriTpPairConfig config;
        MORI_OK_OR_DIE(mori_tp_pair_config(&side.prefill, &side.decode, &config));
        const uint64_t src_len = 14 * side.prefill.page_stride, dst_len = 4 * side.decode.page_stride;
        for (size_t b = 0; b < 2; b++) {
            std::vector<uint8_t> s(src_len), d(dst_len);
            for (uint64_t i = 0; i < src_len; i++) s[i] = static_cast<uint8_t>(i * 97 + b * 5 + g * 11 + 3);
            for (uint64_t i = 0; i < dst_len; i++) d[i] = static_cast<uint8_t>(i * 23 + b + g * 17 + 0x40);
            src[g].push_back(s);
            dst[g].push_back(d);
        }
        want[g] = dst[g];
        for (size_t b = 0; b < 2; b++) {
            host_src[g].push_back(src[g][b].data());
            host_dst[g].push_back(want[g][b].data());
            dev_src[g].push_back(device_copy_of(src[g][b]));
            dev_dst[g].push_back(device_copy_of(dst[g][b]));
        }
        const MoriTpRequest request = {side.src_pages.data(), side.src_pages.size(), side.dst_pages.data(),
                                       side.dst_pages.size(), side.tokens};
        host_groups[g] = MoriTpGroup{config, MORI_TP_STAGING_NONE, 0, 0, request,
                                     MoriKvBuffers{host_src[g].data(), host_dst[g].data(), 2, src_len, dst_len}};
        dev_groups[g] = MoriTpGroup{config, MORI_TP_STAGING_NONE, 0, 0, request,
                                    MoriKvBuffers{dev_src[g].data(), dev_dst[g].data(), 2, src_len, dst_len}};
    }
    const MoriSendOptions host = {MORI_BACKEND_HOST, 0, nullptr};
    MORI_OK_OR_DIE(mori_tp_groups_send(host_groups, 2, &host));
    for (const uint32_t path : {static_cast<uint32_t>(MORI_SEND_MEMCPY2D), static_cast<uint32_t>(MORI_SEND_COPY_KERNEL)}) {
        for (int g = 0; g < 2; g++) {
            for (size_t b = 0; b < 2; b++) {
                HIP_OK(hipMemcpy(dev_dst[g][b], dst[g][b].data(), dst[g][b].size(), hipMemcpyHostToDevice));
            }
        }
        const MoriSendOptions sync = {kBackend, MORI_SEND_SYNCHRONIZE | path, nullptr};
        MORI_OK_OR_DIE(mori_tp_groups_send(dev_groups, 2, &sync));
        for (int g = 0; g < 2; g++) {
            for (size_t b = 0; b < 2; b++) {
                if (host_copy_of(dev_dst[g][b], want[g][b].size()) != want[g][b]) {
                    fail(std::string("groups, ") + (path == MORI_SEND_MEMCPY2D ? kPerRect : "the copy kernel") +
                         ": group " + std::to_string(g) + " buffer " + std::to_string(b) + ": bytes differ");
                }
            }
        }
    }
    for (int g = 0; g < 2; g++) {
        for (size_t b = 0; b < 2; b++) {
            HIP_OK(hipFree(const_cast<void *>(dev_src[g][b])));
            HIP_OK(hipFree(dev_dst[g][b]));
        }
    }
    std::printf("groups: two pairs (NHD 16 -> HND 64, 173 tokens; HND 16 -> NHD 16, 40 tokens) in one "
                "mori_tp_groups_send, per rect and with the kernel: every byte checked\n");
}

// Enables peer access between devices 0 and 1 where the hardware allows it; false otherwise.
bool enable_peer_access() {
    int forward = 0, backward = 0;
    HIP_OK(hipDeviceCanAccessPeer(&forward, 0, 1));
    HIP_OK(hipDeviceCanAccessPeer(&backward, 1, 0));
    if (forward == 0 || backward == 0) {
        return false;
    }
    for (const auto &link : {std::pair{0, 1}, std::pair{1, 0}}) {
        const int peer = link.second;
        on_device(link.first, [&] {
            const hipError_t status = hipDeviceEnablePeerAccess(peer, 0);
            if (status != hipSuccess && status != hipErrorPeerAccessAlreadyEnabled) HIP_OK(status);
        });
    }
    return true;
}

}  // namespace

int main() {
    const int skip = skip_without_device("device_test");
    if (skip >= 0) {
        return skip;
    }
    int device = -1, devices = 0;
    HIP_OK(hipGetDevice(&device));
    HIP_OK(hipGetDeviceCount(&devices));
    hipDeviceProp_t props;
    HIP_OK(hipGetDeviceProperties(&props, device));
    std::printf("device_test: device %d of %d, %s (%s)\n", device, devices, props.name, device_arch(props).c_str());
    for (const Layout &layout : kLayouts) {
        Test(layout, fragmented_request(), kLocal).run();
    }
    std::printf("one-page runs (every rect one row):\n");
    Test(kOneTokenPages, one_page_runs(), kLocal).run();
    std::printf("pinned host memory (hipHostMalloc):\n");
    Test(kLayouts[0], fragmented_request(), kPinned).run();
    Test(kOneTokenPages, one_page_runs(), kPinned).run();
    registered_host_memory();
    pair_layouts();
    groups();
    device_pool();
    two_streams();
    if (devices >= 2 && device == 0) {
        if (enable_peer_access()) {
            const auto two_devices = [] {
                Test(kLayouts[0], fragmented_request(), kTwoDevices).run();
                Test(kLayouts[1], fragmented_request(), kTwoDevices).run();
                Test(kOneTokenPages, one_page_runs(), kTwoDevices).run();
            };
            if (runtime_has_stream_get_device()) {
                std::printf("two devices, device 0 current, stream and decode side on device 1, peer access on:\n"
                            "  rule: this HIP runtime has hipStreamGetDevice, so the copy kernel loads on the "
                            "stream's device while device 0 stays current\n");
                two_devices();
            } else {
                std::printf("two devices, device 1 made current, stream and decode side on device 1, peer access "
                            "on:\n"
                            "  rule: this HIP runtime has no hipStreamGetDevice, so copy-kernel calls need the "
                            "stream's device current: device_test makes device 1 current for them\n");
                on_device(1, two_devices);
            }
        } else {
            std::printf("two devices, but devices 0 and 1 cannot access each other: not checked\n");
        }
    } else {
        std::printf("one device: the two-device checks need two (and device 0 current)\n");
    }
    int after = -1;
    HIP_OK(hipGetDevice(&after));
    if (after != device) {
        fail("the current device changed from " + std::to_string(device) + " to " + std::to_string(after));
    }
    if (failures != 0) {
        std::fprintf(stderr, "device_test: %d failures\n", failures);
        return kFailed;
    }
    std::printf("device_test: all checks passed\n");
    return kPassed;
}
