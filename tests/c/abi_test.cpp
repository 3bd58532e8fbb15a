// A C++17 program that links mori-tp through include/mori_tp.h: a transfer where both sides
// replicate the KV heads with a non-integer TP ratio (2 KV heads, prefill TP 6, decode TP 4),
// checked byte for byte, directly and through each of the four staging modes, the plan size
// query, one call per refusal class the way a C++ runtime would wrap the C API, failing calls
// made from thread_local destructors while threads exit, and the layout API (REFERENCE.md section 11): an NHD
// prefill at TP 2 with page 64 into HND decode ranks at TP 8 with page 16, every pair, every
// staging mode, partial last pages; and a request of several groups (a sliding window of HND
// pages and the x, B and C parts of a Mamba2 conv state slot) moved as one and checked against
// a loop over every element, and pipeline layer maps. Exits 0 after printing "all checks
// passed".
#include "mori_tp.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char *what, int line) {
    if (!ok) {
        std::fprintf(stderr, "line %d: check failed: %s\n", line, what);
        ++failures;
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

// The error-handling wrapper a C++ caller writes once: status -> exception with the message.
struct MoriError : std::runtime_error {
    MoriStatus status;
    MoriError(MoriStatus s, const char *message)
        : std::runtime_error(std::string(mori_status_str(s)) + ": " + message), status(s) {}
};

void ok(MoriStatus status) {
    if (status != MORI_OK) throw MoriError(status, mori_last_error_message());
}

void expect_error(MoriStatus got, MoriStatus want, const char *needle, int line) {
    const std::string message = mori_last_error_message();
    if (got != want || message.find(needle) == std::string::npos) {
        std::fprintf(stderr, "line %d: got %s (%s), want %s mentioning \"%s\"\n", line,
                     mori_status_str(got), message.c_str(), mori_status_str(want), needle);
        ++failures;
    }
}
#define EXPECT_ERROR(call, want, needle) expect_error((call), (want), (needle), __LINE__)

constexpr uint32_t kHeads = 2, kPrefill = 6, kDecode = 4, kPage = 2, kHeadBytes = 24;
constexpr uint32_t kBuffers = 2;  // one layer: K and V
constexpr uint64_t kItem = uint64_t{kPage} * kHeadBytes;  // every rank holds exactly one head
constexpr size_t kPages = 9;

uint8_t head_byte(uint32_t buffer, int32_t page, uint32_t token, uint32_t head, uint32_t byte) {
    return static_cast<uint8_t>(buffer * 71 + page * 13 + token * 5 + head * 101 + byte + 7);
}

// Head owned by a rank of a replicated side (TP > heads): rank / (TP / heads).
uint32_t owned_head(uint32_t tp, uint32_t rank) { return rank / (tp / kHeads); }

using Buffers = std::vector<std::vector<uint8_t>>;

bool stages_src(uint32_t mode) { return mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH; }
bool stages_dst(uint32_t mode) { return mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH; }

// A staged transfer of one pair through the C API: pack when the prefill side is staged, every
// segment of mori_tp_plan_transfer for every buffer (what an RDMA engine does), unpack when the
// decode side is staged.
void staged_send(const MoriTpSliceConfig &config, uint32_t mode, const Buffers &src, Buffers &dst,
                 const std::vector<int32_t> &src_pages, const std::vector<int32_t> &dst_pages) {
    const size_t pages = src_pages.size();
    uint64_t len = 0;
    ok(mori_tp_staging_len(&config, pages, &len));
    std::vector<uint8_t> src_staging(kBuffers * len), dst_staging(kBuffers * len);
    std::vector<const void *> s;
    std::vector<void *> t;
    for (uint32_t b = 0; b < kBuffers; ++b) {
        s.push_back(src[b].data());
        t.push_back(dst[b].data());
    }
    const MoriSendOptions host{MORI_BACKEND_HOST, 0, nullptr};
    if (stages_src(mode))
        ok(mori_pack_kvcache(&config, s.data(), kBuffers, src[0].size(), src_pages.data(), pages,
                             src_staging.data(), src_staging.size(), &host));
    size_t needed = 0;
    const MoriStatus query = mori_tp_plan_transfer(&config, mode, src_pages.data(), dst_pages.data(),
                                                   pages, nullptr, 0, &needed);
    CHECK(query == (needed == 0 ? MORI_OK : MORI_ERR_BUFFER_TOO_SMALL));
    std::vector<MoriSegment> segments(needed);
    ok(mori_tp_plan_transfer(&config, mode, src_pages.data(), dst_pages.data(), pages, segments.data(),
                             segments.size(), &needed));
    if (mode == MORI_TP_STAGING_BOTH && config.action == MORI_TP_ACTION_SEND)
        CHECK(needed == 1 && segments[0].length == len);
    for (uint32_t b = 0; b < kBuffers; ++b) {
        const uint8_t *from = stages_src(mode) ? src_staging.data() + b * len : src[b].data();
        uint8_t *to = stages_dst(mode) ? dst_staging.data() + b * len : dst[b].data();
        for (const MoriSegment &seg : segments) std::memcpy(to + seg.dst_offset, from + seg.src_offset, seg.length);
    }
    if (stages_dst(mode))
        ok(mori_unpack_kvcache(&config, dst_staging.data(), dst_staging.size(), t.data(), kBuffers,
                               dst[0].size(), dst_pages.data(), pages, &host));
}

void transfer() {
    const std::vector<int32_t> src_pages = {3, 4, 0, 8, 6, 7};
    const std::vector<int32_t> dst_pages = {5, 6, 8, 0, 1, 2};
    std::vector<Buffers> src(kPrefill, Buffers(kBuffers, std::vector<uint8_t>(kPages * kItem)));
    std::vector<Buffers> dst(kDecode, Buffers(kBuffers, std::vector<uint8_t>(kPages * kItem, 0x5A)));
    // One decode side per staging mode, each moved only through that mode.
    std::vector<std::vector<Buffers>> staged(4, dst);
    for (uint32_t p = 0; p < kPrefill; ++p)
        for (uint32_t b = 0; b < kBuffers; ++b)
            for (size_t i = 0; i < src[p][b].size(); ++i)
                src[p][b][i] = head_byte(b, static_cast<int32_t>(i / kItem),
                                         static_cast<uint32_t>(i % kItem / kHeadBytes),
                                         owned_head(kPrefill, p), i % kHeadBytes);

    std::vector<int> senders(kDecode, 0);
    for (uint32_t p = 0; p < kPrefill; ++p) {
        for (uint32_t d = 0; d < kDecode; ++d) {
            const MoriTpSliceParams params{kPrefill, p, kDecode, d, kHeads, kPage, kItem, kItem};
            MoriTpSliceConfig config{};
            ok(mori_tp_slice_config(&params, &config));
            const bool shares = owned_head(kPrefill, p) == owned_head(kDecode, d);
            CHECK(shares == (config.action != MORI_TP_ACTION_NOT_PAIRED));
            if (config.action == MORI_TP_ACTION_SEND) {
                ++senders[d];
                CHECK(config.heads_bytes_per_token_to_send == kHeadBytes);
                CHECK(config.bytes_per_token_src == kHeadBytes);  // whole-token copies
            }

            size_t needed = 0;
            const MoriStatus query = mori_tp_plan_segments(&config, src_pages.data(), dst_pages.data(),
                                                           src_pages.size(), nullptr, 0, &needed);
            CHECK(query == (needed == 0 ? MORI_OK : MORI_ERR_BUFFER_TOO_SMALL));
            std::vector<MoriSegment> segments(needed);
            size_t written = 0;
            ok(mori_tp_plan_segments(&config, src_pages.data(), dst_pages.data(), src_pages.size(),
                                     segments.data(), segments.size(), &written));
            CHECK(written == needed);
            if (config.action == MORI_TP_ACTION_SEND) {
                // Runs 3,4->5,6 | 0->8 | 8->0 | 6,7->1,2; whole tokens make each run one segment.
                CHECK(needed == 4);
                CHECK(segments[0].src_offset == 3 * kItem && segments[0].length == 2 * kItem);
            }

            std::vector<const void *> s;
            std::vector<void *> t;
            for (uint32_t b = 0; b < kBuffers; ++b) {
                s.push_back(src[p][b].data());
                t.push_back(dst[d][b].data());
            }
            const MoriKvBuffers buffers{s.data(), t.data(), kBuffers, kPages * kItem, kPages * kItem};
            ok(mori_send_kvcache(&config, &buffers, src_pages.data(), dst_pages.data(),
                                 src_pages.size(), nullptr));
            uint32_t chosen = 99;
            ok(mori_tp_staging_for(&config, &chosen));
            CHECK(chosen == MORI_TP_STAGING_NONE);  // every token slot is exactly the slice here
            for (uint32_t mode = MORI_TP_STAGING_NONE; mode <= MORI_TP_STAGING_BOTH; ++mode)
                staged_send(config, mode, src[p], staged[mode][d], src_pages, dst_pages);
        }
    }
    for (uint32_t d = 0; d < kDecode; ++d) CHECK(senders[d] == 1);
    for (uint32_t mode = MORI_TP_STAGING_NONE; mode <= MORI_TP_STAGING_BOTH; ++mode)
        CHECK(staged[mode] == dst);  // the composition law: staged equals direct, byte for byte

    for (uint32_t d = 0; d < kDecode; ++d)
        for (uint32_t b = 0; b < kBuffers; ++b)
            for (size_t i = 0; i < dst[d][b].size(); ++i) {
                const int32_t page = static_cast<int32_t>(i / kItem);
                uint8_t want = 0x5A;
                for (size_t k = 0; k < dst_pages.size(); ++k)
                    if (dst_pages[k] == page)
                        want = head_byte(b, src_pages[k], static_cast<uint32_t>(i % kItem / kHeadBytes),
                                         owned_head(kDecode, d), i % kHeadBytes);
                if (dst[d][b][i] != want) {
                    std::fprintf(stderr, "decode rank %u buffer %u byte %zu wrong\n", d, b, i);
                    ++failures;
                    return;
                }
            }
}

void refusals() {
    const MoriTpSliceParams good{kPrefill, 0, kDecode, 0, kHeads, kPage, kItem, kItem};
    MoriTpSliceConfig config{};
    ok(mori_tp_slice_config(&good, &config));

    MoriTpSliceParams bad = good;
    bad.page_size = 0;
    EXPECT_ERROR(mori_tp_slice_config(&bad, &config), MORI_ERR_INVALID_ARGUMENT, "page_size is 0");
    bad = good;
    bad.decode_tp_size = 3;
    EXPECT_ERROR(mori_tp_slice_config(&bad, &config), MORI_ERR_TOPOLOGY, "nearest valid tp sizes: 2 and 4");
    bad = good;
    bad.src_item_len = kItem + 1;
    EXPECT_ERROR(mori_tp_slice_config(&bad, &config), MORI_ERR_LAYOUT_MISMATCH, "src_item_len 49");
    EXPECT_ERROR(mori_tp_slice_config(&good, nullptr), MORI_ERR_NULL_POINTER, "out is NULL");

    MoriTpSliceConfig edited = config;
    edited.dst_head_slice_offset = kHeadBytes;
    size_t n = 0;
    EXPECT_ERROR(mori_tp_plan(&edited, nullptr, nullptr, 0, nullptr, 0, &n), MORI_ERR_SLICE_OVERFLOW,
                 "decode side");
    const int32_t pages[] = {1, 2};
    // The size query is not a failure: it leaves the last message (the one above) alone.
    EXPECT_ERROR(mori_tp_plan(&config, pages, pages, 2, nullptr, 0, &n), MORI_ERR_BUFFER_TOO_SMALL, "decode side");
    CHECK(n == 1);

    std::vector<uint8_t> src(kItem), dst(kItem, 0x33);
    const void *s[] = {src.data()};
    void *t[] = {dst.data()};
    const MoriKvBuffers buffers{s, t, 1, kItem, kItem};
    EXPECT_ERROR(mori_send_kvcache(&config, &buffers, pages, pages, 2, nullptr), MORI_ERR_OUT_OF_BOUNDS,
                 "page 2 at position 1 ends at byte 144, past src_capacity 48");
    const MoriSendOptions hip{MORI_BACKEND_HIP, MORI_SEND_SYNCHRONIZE, nullptr};
    const int32_t zero[] = {0};
    CHECK(dst == std::vector<uint8_t>(kItem, 0x33));  // the refusals above wrote nothing
    // HIP is a refusal unless the library is built with it and a device is present; then host
    // memory is legal for hipMemcpyDefault and the copy lands.
    const MoriStatus hip_status = mori_send_kvcache(&config, &buffers, zero, zero, 1, &hip);
    if (hip_status == MORI_OK) {
        std::printf("abi_test.cpp: a HIP device is present; MORI_BACKEND_HIP copied host memory\n");
        CHECK(dst == src);
    } else {
        EXPECT_ERROR(hip_status, MORI_ERR_BACKEND_UNAVAILABLE, "backend unavailable");
        CHECK(dst == std::vector<uint8_t>(kItem, 0x33));
    }

    try {
        ok(mori_tp_slice_config(&bad, &config));
        CHECK(false);
    } catch (const MoriError &e) {
        CHECK(e.status == MORI_ERR_LAYOUT_MISMATCH);
        CHECK(std::string(e.what()).rfind("MORI_ERR_LAYOUT_MISMATCH: mori_tp_slice_config:", 0) == 0);
    }
}

// What the thread_local destructor below saw when it called into mori-tp.
std::atomic<int> exit_status{-1};
std::atomic<bool> exit_message_null{true};

// A C++ runtime's per-thread object that calls mori-tp when its thread exits. It is constructed
// before the thread's first mori-tp call, so its destructor runs after mori-tp's own thread-local
// storage has been torn down: the failing call must still return its status (no abort).
struct CallsMoriAtThreadExit {
    bool armed = false;
    ~CallsMoriAtThreadExit() {
        if (!armed) return;
        const MoriTpSliceParams zero{};
        MoriTpSliceConfig out{};
        exit_status = mori_tp_slice_config(&zero, &out);
        exit_message_null = mori_last_error_message() == nullptr;
    }
};
thread_local CallsMoriAtThreadExit at_thread_exit;

void failing_calls_from_thread_local_destructors() {
    for (int round = 0; round < 3; ++round) {
        exit_status = -1;
        std::thread worker([] {
            at_thread_exit.armed = true;  // constructed now, before mori-tp's thread locals
            const MoriTpSliceParams zero{};
            MoriTpSliceConfig out{};
            // A failing call gives mori-tp's last-error storage its thread-local slot.
            CHECK(mori_tp_slice_config(&zero, &out) == MORI_ERR_INVALID_ARGUMENT);
        });
        worker.join();
        CHECK(exit_status == MORI_ERR_INVALID_ARGUMENT);
        CHECK(!exit_message_null);  // never NULL, even when the message could not be kept
    }
}


// ---- any layout: NHD prefill TP 2 (page 64) -> HND decode TP 8 (page 16), 4 KV heads --------

struct Side7 {
    MoriTpLayout layout;
    std::vector<int32_t> pages;
    size_t bytes;
};

uint64_t element(const MoriTpLayout &l, uint64_t page, uint64_t slot, uint64_t local) {
    return page * l.page_stride + l.offset + slot * l.token_stride + local * l.head_stride;
}

void layouts() {
    constexpr uint32_t heads = 4, head_bytes = 8;
    for (uint64_t tokens : {0ull, 64ull, 100ull}) {
        for (uint32_t p = 0; p < 2; ++p) {
            for (uint32_t d = 0; d < 8; ++d) {
                Side7 src{}, dst{};
                ok(mori_tp_layout_nhd(heads, 2, p, 64, head_bytes, &src.layout));
                ok(mori_tp_layout_hnd(heads, 8, d, 16, head_bytes, &dst.layout));
                // Pages in reverse order, so no two are adjacent on the decode side.
                for (uint64_t i = 0; i < (tokens + 63) / 64; ++i) src.pages.push_back(int32_t(i + 1));
                const int32_t dst_count = int32_t((tokens + 15) / 16);
                for (int32_t i = 0; i < dst_count; ++i) dst.pages.push_back(dst_count - i);
                src.bytes = size_t(src.pages.size() + 2) * src.layout.page_stride;
                dst.bytes = size_t(dst.pages.size() + 2) * dst.layout.page_stride;
                MoriTpPairConfig config{};
                ok(mori_tp_pair_config(&src.layout, &dst.layout, &config));
                const MoriTpRequest request{src.pages.data(), src.pages.size(), dst.pages.data(),
                                            dst.pages.size(), tokens};
                Buffers from(kBuffers, std::vector<uint8_t>(src.bytes)), want(kBuffers),
                    got(kBuffers);
                for (uint32_t b = 0; b < kBuffers; ++b) {
                    for (size_t i = 0; i < src.bytes; ++i) from[b][i] = uint8_t(b * 31 + i * 13 + 3);
                    want[b].assign(dst.bytes, 0xEE);
                    for (uint64_t k = 0; k < tokens; ++k)
                        for (uint32_t j = 0; j < config.num_heads; ++j)
                            std::memcpy(&want[b][element(dst.layout, dst.pages[k / 16], k % 16,
                                                         config.dst_first_local + j)],
                                        &from[b][element(src.layout, src.pages[k / 64], k % 64,
                                                         config.src_first_local + j)],
                                        head_bytes);
                }
                // Direct, then each staging mode: pack, the segments, unpack.
                for (int mode = -1; mode < 4; ++mode) {
                    for (auto &g : got) g.assign(dst.bytes, 0xEE);
                    std::vector<const void *> s;
                    std::vector<void *> t;
                    for (uint32_t b = 0; b < kBuffers; ++b) {
                        s.push_back(from[b].data());
                        t.push_back(got[b].data());
                    }
                    if (mode < 0) {
                        const MoriKvBuffers buffers{s.data(), t.data(), kBuffers, src.bytes, dst.bytes};
                        ok(mori_send_kvcache_pair(&config, &buffers, &request, nullptr));
                    } else {
                        const uint32_t m = uint32_t(mode);
                        uint64_t len = 0;
                        ok(mori_tp_pair_staging_len(&config, tokens, &len));
                        std::vector<uint8_t> src_region(kBuffers * len + 1), dst_region(kBuffers * len + 1);
                        if (stages_src(m))
                            ok(mori_pack_kvcache_pair(&config, m, s.data(), kBuffers, src.bytes, &request,
                                                      src_region.data(), src_region.size(), nullptr));
                        size_t count = 0;
                        EXPECT_ERROR(mori_tp_pair_segments(&config, &request, m, nullptr, 1, &count),
                                     MORI_ERR_NULL_POINTER, "out is NULL");
                        MoriStatus query = mori_tp_pair_segments(&config, &request, m, nullptr, 0, &count);
                        CHECK(query == MORI_OK || query == MORI_ERR_BUFFER_TOO_SMALL);
                        std::vector<MoriSegment> segments(count);
                        ok(mori_tp_pair_segments(&config, &request, m, segments.data(), count, &count));
                        for (uint32_t b = 0; b < kBuffers; ++b)
                            for (const MoriSegment &seg : segments) {
                                const uint8_t *a = stages_src(m) ? src_region.data() + b * len : from[b].data();
                                uint8_t *z = stages_dst(m) ? dst_region.data() + b * len : got[b].data();
                                std::memcpy(z + seg.dst_offset, a + seg.src_offset, seg.length);
                            }
                        if (stages_dst(m))
                            ok(mori_unpack_kvcache_pair(&config, m, dst_region.data(), dst_region.size(),
                                                        t.data(), kBuffers, dst.bytes, &request, nullptr));
                        uint32_t chosen = 9;
                        ok(mori_tp_pair_staging_for(&config, &chosen));
                        // The prefill page holds other heads, the decode page exactly its head.
                        CHECK(config.action != MORI_TP_ACTION_SEND || chosen == MORI_TP_STAGING_SRC);
                    }
                    if (got != want) {
                        std::fprintf(stderr, "layouts: pair (%u, %u), %llu tokens, mode %d differs\n", p, d,
                                     static_cast<unsigned long long>(tokens), mode);
                        ++failures;
                    }
                }
                size_t rects = 0;
                MoriStatus query = mori_tp_pair_plan(&config, &request, nullptr, 0, &rects);
                CHECK(query == MORI_OK || query == MORI_ERR_BUFFER_TOO_SMALL);
            }
        }
    }
    MoriTpLayout nhd{}, wrong{};
    ok(mori_tp_layout_nhd(4, 2, 0, 64, 8, &nhd));
    EXPECT_ERROR(mori_tp_layout_hnd(4, 3, 0, 16, 8, &wrong), MORI_ERR_TOPOLOGY, "tp_size 3");
    ok(mori_tp_layout_hnd(8, 8, 0, 16, 8, &wrong));
    MoriTpPairConfig config{};
    EXPECT_ERROR(mori_tp_pair_config(&nhd, &wrong, &config), MORI_ERR_TOPOLOGY, "total_kv_heads 4");
    CHECK(config.src.page_size == 0);  // written only on success
}

// Where local head j of slot t of page p lies.
uint64_t at(const MoriTpLayout &l, uint64_t p, uint64_t t, uint64_t j) {
    return p * l.page_stride + l.offset + t * l.token_stride + j * l.head_stride;
}

// One group of a request and what the oracle moves for it.
struct GroupCase {
    MoriTpLayout src{}, dst{};
    std::vector<int32_t> src_pages, dst_pages;
    uint64_t tokens = 0, first_token = 0;
    std::vector<std::vector<uint8_t>> *from = nullptr, *to = nullptr;
};

// 8 KV heads, prefill TP 2 rank 1 (heads 4..7) -> decode TP 4 rank 3 (heads 6, 7): a sliding
// window of 40 tokens from token 64 (a multiple of both page sizes, 16 and 32), HND; and the
// conv state of a Mamba2 layer in vLLM's SD layout (state_len rows of every channel: x by 8
// heads of 4 channels, then B and C by 1 group of 4 channels, which every rank holds), slot 3
// -> slot 0, 2-byte values, the slot padded to 256 bytes.
void groups() {
    constexpr uint32_t kRows = 3;
    const uint32_t p = 1, d = 3;
    std::vector<std::vector<uint8_t>> kv_src(2, std::vector<uint8_t>(6 * 4 * 16 * 8)),
        kv_dst(2, std::vector<uint8_t>(4 * 2 * 32 * 8)), conv_src(1, std::vector<uint8_t>(4 * 256)),
        conv_dst(1, std::vector<uint8_t>(2 * 256));
    uint32_t salt = 0;
    for (auto *set : {&kv_src, &kv_dst, &conv_src, &conv_dst}) {
        ++salt;
        for (size_t b = 0; b < set->size(); ++b)
            for (size_t i = 0; i < (*set)[b].size(); ++i)
                (*set)[b][i] = static_cast<uint8_t>(i * 7 + b * 13 + salt * 41);
    }
    const auto initial_kv = kv_dst;
    const auto initial_conv = conv_dst;
    // Puts the decode buffers back as they started, in place (the groups point into them).
    auto restore = [&] {
        for (size_t b = 0; b < kv_dst.size(); ++b)
            std::copy(initial_kv[b].begin(), initial_kv[b].end(), kv_dst[b].begin());
        for (size_t b = 0; b < conv_dst.size(); ++b)
            std::copy(initial_conv[b].begin(), initial_conv[b].end(), conv_dst[b].begin());
    };
    std::vector<GroupCase> cases(4);
    ok(mori_tp_layout_hnd(8, 2, p, 16, 8, &cases[0].src));
    ok(mori_tp_layout_hnd(8, 4, d, 32, 8, &cases[0].dst));
    cases[0].src_pages = {4, 1, 5};
    cases[0].dst_pages = {0, 3};
    cases[0].tokens = 40;
    cases[0].first_token = 64;
    cases[0].from = &kv_src;
    cases[0].to = &kv_dst;
    // conv_dim per rank: 8 / tp heads x 4 channels + 2 x 1 group x 4 channels, 2 bytes each.
    auto conv = [&](uint32_t tp, uint32_t rank, uint32_t units, uint64_t first_channel) {
        const uint64_t dim = 8 / tp * 4 + 2 * 4;
        return MoriTpLayout{units, tp, rank, kRows, 4 * 2, 256, first_channel * 2, dim * 2, 4 * 2};
    };
    const uint64_t x_src = 8 / 2 * 4, x_dst = 8 / 4 * 4;
    const uint64_t firsts[3][2] = {{0, 0}, {x_src, x_dst}, {x_src + 4, x_dst + 4}};
    for (int part = 0; part < 3; ++part) {
        GroupCase &c = cases[1 + part];
        const uint32_t units = part == 0 ? 8 : 1;
        c.src = conv(2, p, units, firsts[part][0]);
        c.dst = conv(4, d, units, firsts[part][1]);
        c.src_pages = {3};
        c.dst_pages = {0};
        c.tokens = kRows;
        c.from = &conv_src;
        c.to = &conv_dst;
    }
    // The oracle.
    auto want_kv = kv_dst;
    auto want_conv = conv_dst;
    for (const GroupCase &c : cases) {
        auto &want = c.to == &kv_dst ? want_kv : want_conv;
        MoriTpPairConfig config{};
        ok(mori_tp_pair_config(&c.src, &c.dst, &config));
        for (size_t b = 0; b < c.from->size(); ++b)
            for (uint64_t k = 0; k < c.tokens; ++k)
                for (uint32_t j = 0; j < config.num_heads; ++j)
                    std::memcpy(&want[b][at(c.dst, c.dst_pages[k / c.dst.page_size], k % c.dst.page_size,
                                            config.dst_first_local + j)],
                                &(*c.from)[b][at(c.src, c.src_pages[k / c.src.page_size], k % c.src.page_size,
                                                 config.src_first_local + j)],
                                c.src.head_bytes);
    }
    // The request, as a C++ caller builds it.
    std::vector<std::vector<const void *>> srcs;
    std::vector<std::vector<void *>> dsts;
    std::vector<MoriTpGroup> request;
    for (const GroupCase &c : cases) {
        srcs.emplace_back();
        dsts.emplace_back();
        for (size_t b = 0; b < c.from->size(); ++b) {
            srcs.back().push_back((*c.from)[b].data());
            dsts.back().push_back((*c.to)[b].data());
        }
        MoriTpGroup g{};
        ok(mori_tp_pair_config(&c.src, &c.dst, &g.config));
        ok(mori_tp_pair_staging_for(&g.config, &g.staging));
        g.first_token = c.first_token;
        g.request = {c.src_pages.data(), c.src_pages.size(), c.dst_pages.data(), c.dst_pages.size(), c.tokens};
        g.buffers = {srcs.back().data(), dsts.back().data(), c.from->size(), (*c.from)[0].size(),
                     (*c.to)[0].size()};
        request.push_back(g);
    }
    ok(mori_send_kvcache_groups(request.data(), request.size(), nullptr));
    CHECK(kv_dst == want_kv && conv_dst == want_conv);

    // The same through pack, the segments of each group on each buffer, and unpack.
    restore();
    std::vector<MoriTpGroupInfo> info(request.size());
    MoriTpGroupsTotal total{};
    ok(mori_tp_groups_info(request.data(), request.size(), info.data(), &total));
    std::vector<MoriSegment> segments(total.num_segments);
    size_t count = 0;
    ok(mori_tp_groups_segments(request.data(), request.size(), segments.data(), segments.size(), &count));
    ok(mori_tp_check_groups_transfer(request.data(), request.size(), total.src_staging_bytes,
                                     total.dst_staging_bytes));
    CHECK(total.dst_staging_bytes > 0);  // the conv parts are staged BOTH
    EXPECT_ERROR(mori_tp_check_groups_transfer(request.data(), request.size(), total.src_staging_bytes,
                                               total.dst_staging_bytes - 1),
                 MORI_ERR_BUFFER_TOO_SMALL, "decode side: staging_capacity");
    std::vector<uint8_t> src_region(total.src_staging_bytes), dst_region(total.dst_staging_bytes);
    ok(mori_pack_kvcache_groups(request.data(), request.size(), src_region.data(), src_region.size(), nullptr));
    for (size_t g = 0; g < request.size(); ++g) {
        const MoriTpGroup &group = request[g];
        const bool packs = group.staging == MORI_TP_STAGING_SRC || group.staging == MORI_TP_STAGING_BOTH;
        const bool unpacks = group.staging == MORI_TP_STAGING_DST || group.staging == MORI_TP_STAGING_BOTH;
        for (size_t b = 0; b < group.buffers.num_buffers; ++b)
            for (uint64_t s = info[g].first_segment; s < info[g].first_segment + info[g].num_segments; ++s) {
                const MoriSegment &seg = segments[s];
                const uint64_t part = b * info[g].staging_len;
                const uint8_t *from = packs ? src_region.data() + info[g].src_staging_offset + part
                                            : static_cast<const uint8_t *>(group.buffers.src[b]);
                uint8_t *to = unpacks ? dst_region.data() + info[g].dst_staging_offset + part
                                      : static_cast<uint8_t *>(group.buffers.dst[b]);
                std::memcpy(to + seg.dst_offset, from + seg.src_offset, seg.length);
            }
    }
    ok(mori_unpack_kvcache_groups(request.data(), request.size(), dst_region.data(), dst_region.size(),
                                  nullptr));
    CHECK(kv_dst == want_kv && conv_dst == want_conv);
    CHECK(count == total.num_segments && total.bytes > 0);

    // A window that does not start on both pages, and one request's refusal naming its group.
    restore();
    request[0].first_token = 48;  // a multiple of 16, not of 32
    EXPECT_ERROR(mori_send_kvcache_groups(request.data(), request.size(), nullptr), MORI_ERR_INVALID_ARGUMENT,
                 "group 0: first_token 48 is not a multiple of both page sizes (prefill page_size 16, decode "
                 "page_size 32): a window starts on a page of each side; round it down to 32");
    CHECK(kv_dst == initial_kv);
    request[0].first_token = 64;
    request[2].reserved = 1;
    EXPECT_ERROR(mori_tp_groups_info(request.data(), request.size(), info.data(), &total),
                 MORI_ERR_INVALID_ARGUMENT, "group 2: reserved is 1, not 0");

    // Pipeline parallelism: prefill PP 2 {3, 3} into decode PP 3 {2, 2, 2}.
    const std::vector<uint32_t> prefill{3, 3}, decode{2, 2, 2};
    MoriTpLayerRange range{};
    ok(mori_tp_pp_layers(prefill.data(), prefill.size(), decode.data(), decode.size(), 0, 1, &range));
    CHECK(range.first_layer == 2 && range.num_layers == 1 && range.prefill_first_local == 2 &&
          range.decode_first_local == 0);
    ok(mori_tp_pp_layers(prefill.data(), prefill.size(), decode.data(), decode.size(), 1, 1, &range));
    CHECK(range.first_layer == 3 && range.num_layers == 1 && range.prefill_first_local == 0 &&
          range.decode_first_local == 1);
    try {
        ok(mori_tp_pp_layers(prefill.data(), prefill.size(), decode.data(), decode.size(), 2, 0, &range));
        CHECK(false);
    } catch (const MoriError &e) {
        CHECK(e.status == MORI_ERR_INVALID_ARGUMENT);
        CHECK(std::string(e.what()).find("prefill side: pipeline stage 2 is out of range for 2 stages") !=
              std::string::npos);
    }
}

}  // namespace

int main() {
    try {
        transfer();
        refusals();
        layouts();
        groups();
        failing_calls_from_thread_local_destructors();
        // The main thread too: its thread_local destructor runs at exit, after main returns.
        at_thread_exit.armed = true;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "unexpected failure: %s\n", e.what());
        return 1;
    }
    if (failures != 0) {
        std::fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    std::printf("abi_test.cpp: all checks passed (mori-tp %s)\n", mori_version());
    return 0;
}
