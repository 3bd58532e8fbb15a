// A C++ program that uses mori-tp through include/mori_tp.hpp, as a C++ runtime would: versions
// and name strings, the integer constants in template deduction, a request moved directly and
// staged through two pools' slots (checked byte for byte against the ownership rule), the same
// for any page layout and for a request of groups, every refusal as an exception and as a
// result, the size query that leaves the last message alone, the pool's RAII, MORI_ERR_POOL_FULL,
// and slots taken, written, handed over and freed by eight threads. Built from C++17 and C++20,
// linked static, shared and fully static, under AddressSanitizer with UndefinedBehaviorSanitizer,
// under ThreadSanitizer, and without exceptions (tests/c_api.rs, tests/install.rs). Exits 0
// after printing "cpp_api_test.cpp: all checks passed".
#include "mori_tp.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <future>
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
// A call that returns a result passes when it succeeded; its message says why it did not.
template <class T>
void check(const mori_tp::result<T> &outcome, const char *what, int line) {
    if (!outcome) {
        std::fprintf(stderr, "line %d: %s failed: %s\n", line, what, outcome.message().c_str());
        ++failures;
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

bool contains(const std::string &text, const char *needle) { return text.find(needle) != std::string::npos; }

// ---- the integer constants have their fields' types (uint32_t), so templates deduce one type
static_assert(std::is_same_v<decltype(MORI_TP_ACTION_SEND), std::uint32_t>, "action");
static_assert(std::is_same_v<decltype(MORI_TP_ACTION_NOT_PAIRED), std::uint32_t>, "action");
static_assert(std::is_same_v<decltype(MORI_TP_ACTION_SKIP_REPLICA), std::uint32_t>, "action");
static_assert(std::is_same_v<decltype(MORI_TP_STAGING_NONE), std::uint32_t>, "staging");
static_assert(std::is_same_v<decltype(MORI_TP_STAGING_BOTH), std::uint32_t>, "staging");
static_assert(std::is_same_v<decltype(MORI_BACKEND_AUTO), std::uint32_t>, "backend");
static_assert(std::is_same_v<decltype(MORI_BACKEND_HOST), std::uint32_t>, "backend");
static_assert(std::is_same_v<decltype(MORI_BACKEND_HIP), std::uint32_t>, "backend");
static_assert(std::is_same_v<decltype(MORI_SEND_SYNCHRONIZE), std::uint32_t>, "flag");
static_assert(std::is_same_v<decltype(MORI_SEND_COPY_KERNEL), std::uint32_t>, "flag");
static_assert(std::is_same_v<decltype(MORI_SEND_MEMCPY2D), std::uint32_t>, "flag");
static_assert(std::is_same_v<decltype(MORI_TP_POOL_HOST), std::uint32_t>, "memory");
static_assert(std::is_same_v<decltype(MORI_TP_POOL_LOCKED), std::uint32_t>, "pool flag");
static_assert(std::is_same_v<decltype(MORI_OK), MoriStatus>, "status");
static_assert(std::is_same_v<decltype(MORI_ERR_POOL_FULL), MoriStatus>, "status");
static_assert(MORI_ERR_POOL_FULL == 11, "the next free status value");
static_assert(MORI_TP_VERSION ==
                  MORI_TP_VERSION_MAJOR * 1000000 + MORI_TP_VERSION_MINOR * 1000 + MORI_TP_VERSION_PATCH,
              "the combined version");
#if MORI_TP_VERSION < 1000
#error "MORI_TP_VERSION is usable in #if"
#endif

void versions_and_names() {
    CHECK(mori_tp::abi_compatible());
    const std::string expected = std::to_string(MORI_TP_VERSION / 1000000) + "." +
                                 std::to_string(MORI_TP_VERSION / 1000 % 1000) + "." +
                                 std::to_string(MORI_TP_VERSION % 1000);
    CHECK(mori_tp::version() == expected);
    CHECK(mori_tp::action_name(MORI_TP_ACTION_SEND) == "MORI_TP_ACTION_SEND");
    CHECK(mori_tp::action_name(MORI_TP_ACTION_NOT_PAIRED) == "MORI_TP_ACTION_NOT_PAIRED");
    CHECK(mori_tp::action_name(MORI_TP_ACTION_SKIP_REPLICA) == "MORI_TP_ACTION_SKIP_REPLICA");
    CHECK(mori_tp::action_name(7) == "MORI_TP_ACTION_UNKNOWN");
    CHECK(mori_tp::staging_name(MORI_TP_STAGING_NONE) == "MORI_TP_STAGING_NONE");
    CHECK(mori_tp::staging_name(MORI_TP_STAGING_SRC) == "MORI_TP_STAGING_SRC");
    CHECK(mori_tp::staging_name(MORI_TP_STAGING_DST) == "MORI_TP_STAGING_DST");
    CHECK(mori_tp::staging_name(MORI_TP_STAGING_BOTH) == "MORI_TP_STAGING_BOTH");
    CHECK(mori_tp::staging_name(4) == "MORI_TP_STAGING_UNKNOWN");
    CHECK(mori_tp::backend_name(MORI_BACKEND_AUTO) == "MORI_BACKEND_AUTO");
    CHECK(mori_tp::backend_name(MORI_BACKEND_HOST) == "MORI_BACKEND_HOST");
    CHECK(mori_tp::backend_name(MORI_BACKEND_HIP) == "MORI_BACKEND_HIP");
    CHECK(mori_tp::backend_name(0xffffffffu) == "MORI_BACKEND_UNKNOWN");
    CHECK(mori_tp::status_name(MORI_ERR_POOL_FULL) == "MORI_ERR_POOL_FULL");
    CHECK(mori_tp::status_name(12) == "MORI_ERR_UNKNOWN");

    MoriTpSliceConfig config{};
    config.action = MORI_TP_ACTION_SKIP_REPLICA;
    CHECK(std::max(config.action, MORI_TP_ACTION_SEND) == MORI_TP_ACTION_SKIP_REPLICA);
    std::uint32_t modes = 0;
    for (auto mode : {config.action, MORI_TP_STAGING_BOTH}) modes += mode;  // one deduced type
    CHECK(modes == 5);
}

// ---- one pair of uniform layouts: H = 4, prefill TP 2, decode TP 8; prefill rank 0 sends
// head 0 to decode rank 1.
constexpr std::uint32_t kHeads = 4, kPage = 4, kHeadBytes = 16, kBuffers = 2, kPages = 8;
constexpr std::uint64_t kSrcItem = std::uint64_t{kPage} * 2 * kHeadBytes;  // two heads per rank
constexpr std::uint64_t kDstItem = std::uint64_t{kPage} * 1 * kHeadBytes;  // one head per rank

using Bytes = std::vector<unsigned char>;

struct Side {
    std::vector<Bytes> buffers;
    std::vector<const void *> src() const {
        std::vector<const void *> out;
        for (const Bytes &b : buffers) out.push_back(b.data());
        return out;
    }
    std::vector<void *> dst() {
        std::vector<void *> out;
        for (Bytes &b : buffers) out.push_back(b.data());
        return out;
    }
};

Side prefill_side() {
    Side side;
    for (std::uint32_t b = 0; b < kBuffers; ++b) {
        Bytes bytes(kPages * kSrcItem);
        for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + b * 31 + 1);
        side.buffers.push_back(bytes);
    }
    return side;
}

Side decode_side() {
    Side side;
    for (std::uint32_t b = 0; b < kBuffers; ++b) side.buffers.emplace_back(kPages * kDstItem, 0xEE);
    return side;
}

// What decode rank 1 must hold: head 0 (the first of prefill rank 0's two heads) of every token
// of every page pair, and 0xEE elsewhere.
Side expected_decode(const Side &src, const std::vector<std::int32_t> &src_pages,
                     const std::vector<std::int32_t> &dst_pages) {
    Side want = decode_side();
    for (std::uint32_t b = 0; b < kBuffers; ++b)
        for (std::size_t i = 0; i < src_pages.size(); ++i)
            for (std::uint32_t t = 0; t < kPage; ++t)
                std::memcpy(&want.buffers[b][static_cast<std::size_t>(dst_pages[i]) * kDstItem + t * kHeadBytes],
                            &src.buffers[b][static_cast<std::size_t>(src_pages[i]) * kSrcItem + t * 2 * kHeadBytes],
                            kHeadBytes);
    return want;
}

// The transport: every segment for every buffer, between the page buffers and the regions.
void transport(const std::vector<MoriSegment> &segments, const std::vector<const unsigned char *> &from,
               const std::vector<unsigned char *> &to) {
    for (std::size_t b = 0; b < from.size(); ++b)
        for (const MoriSegment &s : segments) std::memcpy(to[b] + s.dst_offset, from[b] + s.src_offset, s.length);
}

void one_pair(mori_tp::pool &prefill_pool, mori_tp::pool &decode_pool) {
    const MoriTpSliceParams params{2, 0, 8, 1, kHeads, kPage, kSrcItem, kDstItem};
    const MoriTpSliceConfig config = mori_tp::slice_config(std::nothrow, params).value();
    CHECK(config.action == MORI_TP_ACTION_SEND && config.first_head == 0 && config.num_heads == 1);
    const std::vector<std::int32_t> src_pages{5, 6, 0, 3, 2};
    const std::vector<std::int32_t> dst_pages{1, 2, 7, 4, 0};
    const Side src = prefill_side();
    const Side want = expected_decode(src, src_pages, dst_pages);

    // Runs {5,6}->{1,2}, {0}->{7}, {3}->{4}, {2}->{0}: four rects, one row per token each.
    const std::vector<MoriCopyRect> rects = mori_tp::plan(std::nothrow, config, src_pages, dst_pages).value();
    CHECK(rects.size() == 4 && rects[0].height == 2 * kPage);
    const auto segments = mori_tp::plan_segments(std::nothrow, config, src_pages, dst_pages);
    CHECK(segments && segments->size() == src_pages.size() * kPage);

    Side direct = decode_side();
    const MoriSendOptions host{MORI_BACKEND_HOST, 0, nullptr};
    CHECK(mori_tp::send_kvcache(std::nothrow, config, src.src(), kPages * kSrcItem, direct.dst(),
                                kPages * kDstItem, src_pages, dst_pages, host));
    CHECK(direct.buffers == want.buffers);

    // Staged through slots of the two pools, in every mode.
    const std::uint64_t len = mori_tp::staging_len(std::nothrow, config, src_pages.size()).value();
    CHECK(len == src_pages.size() * kPage * kHeadBytes);
    CHECK(mori_tp::staging_for(std::nothrow, config).value() == MORI_TP_STAGING_SRC);
    for (std::uint32_t mode :
         {MORI_TP_STAGING_NONE, MORI_TP_STAGING_SRC, MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH}) {
        const bool src_staged = mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH;
        const bool dst_staged = mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH;
        mori_tp::slot src_slot = prefill_pool.try_alloc(std::nothrow, kBuffers * len).value();
        mori_tp::slot dst_slot = decode_pool.alloc(std::nothrow, kBuffers * len, std::chrono::seconds(5)).value();
        const MoriTpMemory prefill_memory{kBuffers, kPages * kSrcItem, src_slot.size()};
        const MoriTpMemory decode_memory{kBuffers, kPages * kDstItem, dst_slot.size()};
        CHECK(mori_tp::check_transfer(std::nothrow, config, mode, src_pages, dst_pages, prefill_memory,
                                      decode_memory));
        Side staged = decode_side();
        if (src_staged)
            CHECK(mori_tp::pack_kvcache(std::nothrow, config, src.src(), kPages * kSrcItem, src_pages,
                                        src_slot.bytes(), host));
        const std::vector<MoriSegment> transfer =
            mori_tp::plan_transfer(std::nothrow, config, mode, src_pages, dst_pages).value();
        std::vector<const unsigned char *> from;
        std::vector<unsigned char *> to;
        for (std::uint32_t b = 0; b < kBuffers; ++b) {
            from.push_back(src_staged ? reinterpret_cast<const unsigned char *>(src_slot.bytes().data()) + b * len
                                      : src.buffers[b].data());
            to.push_back(dst_staged ? reinterpret_cast<unsigned char *>(dst_slot.bytes().data()) + b * len
                                    : staged.buffers[b].data());
        }
        transport(transfer, from, to);
        if (dst_staged)
            CHECK(mori_tp::unpack_kvcache(std::nothrow, config, dst_slot.bytes(), staged.dst(), kPages * kDstItem,
                                          dst_pages, host));
        if (staged.buffers != want.buffers)
            std::fprintf(stderr, "staging %s moved other bytes\n",
                         std::string(mori_tp::staging_name(mode)).c_str());
        CHECK(staged.buffers == want.buffers);
    }  // both slots freed here
    CHECK(prefill_pool.info(std::nothrow).value().live_slots == 0);
    CHECK(decode_pool.info(std::nothrow).value().live_slots == 0);
}

// ---- any layout: NHD pages of 8 at prefill TP 2 into HND pages of 4 at decode TP 4, 10 tokens
void any_layout() {
    const MoriTpLayout prefill = mori_tp::layout_nhd(std::nothrow, 4, 2, 1, 8, kHeadBytes).value();
    const MoriTpLayout decode = mori_tp::layout_hnd(std::nothrow, 4, 4, 3, 4, kHeadBytes).value();
    const MoriTpPairConfig config = mori_tp::pair_config(std::nothrow, prefill, decode).value();
    CHECK(config.action == MORI_TP_ACTION_SEND && config.first_head == 3 && config.num_heads == 1);
    const std::vector<std::int32_t> src_pages{2, 0};
    const std::vector<std::int32_t> dst_pages{3, 1, 0};
    const MoriTpRequest request = mori_tp::request(src_pages, dst_pages, 10);
    const std::uint64_t src_capacity = 3 * prefill.page_stride, dst_capacity = 4 * decode.page_stride;
    Bytes s0(src_capacity), s1(src_capacity);
    for (std::size_t i = 0; i < src_capacity; ++i) {
        s0[i] = static_cast<unsigned char>(i * 3 + 1);
        s1[i] = static_cast<unsigned char>(i * 5 + 2);
    }
    const std::vector<const void *> src{s0.data(), s1.data()};
    Bytes direct0(dst_capacity, 0), direct1(dst_capacity, 0);
    const std::vector<void *> direct{direct0.data(), direct1.data()};
    const MoriSendOptions host{MORI_BACKEND_HOST, 0, nullptr};
    CHECK(mori_tp::send_kvcache_pair(std::nothrow, config, src, src_capacity, direct, dst_capacity, request, host));
    // Token k, local head 1 of the prefill rank (global head 3) -> the decode rank's only head.
    bool exact = true;
    for (std::uint64_t k = 0; k < 10; ++k) {
        const std::uint64_t from = static_cast<std::uint64_t>(src_pages[k / 8]) * prefill.page_stride +
                                   (k % 8) * prefill.token_stride + 1 * prefill.head_stride;
        const std::uint64_t to = static_cast<std::uint64_t>(dst_pages[k / 4]) * decode.page_stride +
                                 (k % 4) * decode.token_stride;
        exact = exact && std::memcmp(&direct0[to], &s0[from], kHeadBytes) == 0 &&
                std::memcmp(&direct1[to], &s1[from], kHeadBytes) == 0;
    }
    CHECK(exact);
    CHECK(!mori_tp::pair_plan(std::nothrow, config, request).value().empty());

    // Staged the way pair_staging_for says, through one host region per side.
    const MoriTpStaging mode = mori_tp::pair_staging_for(std::nothrow, config).value();
    const std::uint64_t len = mori_tp::pair_staging_len(std::nothrow, config, 10).value();
    CHECK(len == 10 * kHeadBytes);
    std::vector<std::byte> src_region(2 * len), dst_region(2 * len);
    Bytes staged0(dst_capacity, 0), staged1(dst_capacity, 0);
    const std::vector<void *> staged{staged0.data(), staged1.data()};
    const bool src_staged = mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH;
    const bool dst_staged = mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH;
    if (src_staged)
        CHECK(mori_tp::pack_kvcache_pair(std::nothrow, config, mode, src, src_capacity, request, src_region, host));
    const std::vector<MoriSegment> segments = mori_tp::pair_segments(std::nothrow, config, request, mode).value();
    std::vector<const unsigned char *> from;
    std::vector<unsigned char *> to;
    for (std::size_t b = 0; b < 2; ++b) {
        from.push_back(src_staged ? reinterpret_cast<const unsigned char *>(src_region.data()) + b * len
                                  : static_cast<const unsigned char *>(src[b]));
        to.push_back(dst_staged ? reinterpret_cast<unsigned char *>(dst_region.data()) + b * len
                                : static_cast<unsigned char *>(staged[b]));
    }
    transport(segments, from, to);
    if (dst_staged)
        CHECK(mori_tp::unpack_kvcache_pair(std::nothrow, config, mode, dst_region, staged, dst_capacity, request,
                                           host));
    CHECK(staged0 == direct0 && staged1 == direct1);

    // The same pair as a request of one group.
    Bytes grouped0(dst_capacity, 0), grouped1(dst_capacity, 0);
    const std::vector<void *> grouped{grouped0.data(), grouped1.data()};
    MoriTpGroup group{};
    group.config = config;
    group.staging = mode;
    group.request = request;
    group.buffers = MoriKvBuffers{src.data(), grouped.data(), 2, src_capacity, dst_capacity};
    const std::array<MoriTpGroup, 1> groups{group};
    const auto layout = mori_tp::groups_info(std::nothrow, groups).value();
    CHECK(layout.groups.size() == 1 && layout.total.bytes == 2 * len);
    CHECK(mori_tp::groups_segments(std::nothrow, groups).value().size() == segments.size());
    CHECK(mori_tp::check_groups_transfer(std::nothrow, groups, 2 * len, 2 * len));
    CHECK(mori_tp::send_kvcache_groups(std::nothrow, groups, host));
    CHECK(grouped0 == direct0 && grouped1 == direct1);

    const std::array<std::uint32_t, 3> prefill_stages{10, 12, 10};
    const std::array<std::uint32_t, 2> decode_stages{16, 16};
    const MoriTpLayerRange shared = mori_tp::pp_layers(std::nothrow, prefill_stages, decode_stages, 1, 0).value();
    CHECK(shared.first_layer == 10 && shared.num_layers == 6 && shared.prefill_first_local == 0 &&
          shared.decode_first_local == 10);
}

// ---- who holds which head, and who sends it (the same answers as mori_tp_slice_config)
void ownership() {
    // 4 heads, prefill TP 2 -> decode TP 8: each decode rank holds one head, replicated twice.
    for (std::uint32_t d = 0; d < 8; d++) {
        const mori_tp::rank_heads_t held = mori_tp::rank_heads(std::nothrow, kHeads, 8, d).value();
        CHECK(held.first_head == d / 2 && held.num_heads == 1);
        const std::uint32_t sender = mori_tp::head_sender(std::nothrow, kHeads, 2, 8, d, held.first_head).value();
        for (std::uint32_t p = 0; p < 2; p++) {
            const MoriTpSliceParams params{2, p, 8, d, kHeads, kPage, kSrcItem, kDstItem};
            const MoriTpSliceConfig config = mori_tp::slice_config(std::nothrow, params).value();
            CHECK((config.action == MORI_TP_ACTION_SEND) == (p == sender));
        }
    }
    const mori_tp::rank_heads_t prefill = mori_tp::rank_heads(std::nothrow, kHeads, 2, 1).value();
    CHECK(prefill.first_head == 2 && prefill.num_heads == 2);
    const auto wrong_rank = mori_tp::rank_heads(std::nothrow, kHeads, 2, 2);
    CHECK(!wrong_rank && wrong_rank.status() == MORI_ERR_INVALID_ARGUMENT);
    const auto not_held = mori_tp::head_sender(std::nothrow, kHeads, 2, 8, 0, 3);
    CHECK(!not_held && not_held.status() == MORI_ERR_INVALID_ARGUMENT);
    const auto bad_topology = mori_tp::head_sender(std::nothrow, kHeads, 3, 8, 0, 0);
    CHECK(!bad_topology && bad_topology.status() == MORI_ERR_TOPOLOGY);
#if MORI_TP_HPP_EXCEPTIONS
    CHECK(mori_tp::head_sender(kHeads, 2, 8, 5, 2) == 1);
    try {
        (void)mori_tp::rank_heads(3, 2, 0);
        CHECK(!"rank_heads threw");
    } catch (const mori_tp::error &e) {
        CHECK(e.status() == MORI_ERR_TOPOLOGY && contains(e.what(), "mori_tp_rank_heads"));
    }
#endif
}

// ---- refusals, as results and as exceptions
void refusals() {
    const MoriTpSliceParams bad_topology{3, 0, 8, 1, kHeads, kPage, kSrcItem, kDstItem};
    const auto refused = mori_tp::slice_config(std::nothrow, bad_topology);
    CHECK(!refused && refused.status() == MORI_ERR_TOPOLOGY);
    CHECK(refused.error() == mori_tp::errc::topology);
    CHECK(refused.error().category() == mori_tp::category() && refused.error().message() == "MORI_ERR_TOPOLOGY");
    CHECK(contains(refused.message(), "mori_tp_slice_config: invalid topology: prefill side: tp_size 3"));
    const MoriTpSliceParams bad_rank{2, 2, 8, 1, kHeads, kPage, kSrcItem, kDstItem};
    const auto invalid = mori_tp::slice_config(std::nothrow, bad_rank);
    CHECK(invalid.error() == std::errc::invalid_argument);  // the portable condition
    CHECK(mori_tp::slice_config(std::nothrow, bad_rank).value_or(MoriTpSliceConfig{}).action == 0);
    const std::vector<std::int32_t> one{0}, two{0, 1};
    CHECK(mori_tp::plan(std::nothrow, MoriTpSliceConfig{}, one, two).status() == MORI_ERR_INVALID_ARGUMENT);
#if MORI_TP_HPP_EXCEPTIONS
    try {
        (void)mori_tp::slice_config(bad_topology);
        CHECK(!"slice_config threw");
    } catch (const mori_tp::error &e) {
        CHECK(e.status() == MORI_ERR_TOPOLOGY && e.code() == mori_tp::errc::topology && !e.retryable());
        CHECK(contains(e.message(), "prefill side: tp_size 3"));
        CHECK(contains(e.what(), "mori_tp_slice_config: invalid topology") &&
              contains(e.what(), "MORI_ERR_TOPOLOGY"));
    }
    try {
        (void)mori_tp::layout_nhd(0, 2, 0, 16, 128);
        CHECK(!"layout_nhd threw");
    } catch (const std::system_error &e) {  // mori_tp::error is one
        CHECK(e.code() == mori_tp::errc::topology);
    }
#endif
}

// ---- a size query is not a failure: the last message, and a pointer taken to it, stay valid
void size_query_keeps_the_message() {
    const MoriTpSliceParams bad{3, 0, 8, 1, kHeads, kPage, kSrcItem, kDstItem};
    MoriTpSliceConfig out{};
    CHECK(mori_tp_slice_config(&bad, &out) == MORI_ERR_TOPOLOGY);
    const char *kept = mori_last_error_message();
    const std::string copy = kept;
    const MoriTpSliceParams good{2, 0, 8, 1, kHeads, kPage, kSrcItem, kDstItem};
    MoriTpSliceConfig config{};
    CHECK(mori_tp_slice_config(&good, &config) == MORI_OK);
    const std::int32_t pages[2] = {0, 1};
    std::size_t needed = 0;
    CHECK(mori_tp_plan(&config, pages, pages, 2, nullptr, 0, &needed) == MORI_ERR_BUFFER_TOO_SMALL && needed == 1);
    // Under AddressSanitizer, reading `kept` after a freed message is a heap-use-after-free.
    CHECK(std::strcmp(kept, copy.c_str()) == 0);
    CHECK(mori_last_error_message() == kept);
    // An array that is really too small (not NULL) is a failure, with its own message.
    MoriCopyRect one{};
    std::size_t len = 0;
    CHECK(mori_tp_plan(&config, pages, pages, 2, &one, 0, &len) == MORI_ERR_BUFFER_TOO_SMALL);
    CHECK(contains(mori_last_error_message(), "the output array holds 0"));
}

// ---- pools: full, too large, RAII
void pools() {
    mori_tp::pool pool = mori_tp::pool::create(std::nothrow, 256 << 10, 64 << 10).value();
    CHECK(pool && pool.region().size() == (256 << 10));
    mori_tp::slot whole = pool.try_alloc(std::nothrow, 256 << 10).value();
    CHECK(whole && whole.offset() == 0 && whole.size() == (256 << 10));

    const auto full = pool.try_alloc(std::nothrow, 1);
    CHECK(!full && full.status() == MORI_ERR_POOL_FULL);
    CHECK(full.error() == mori_tp::errc::pool_full);
    CHECK(full.error() == std::errc::resource_unavailable_try_again);
    CHECK(contains(full.message(), "mori_tp_pool_try_alloc: staging pool full: a slot of 1 bytes"));
    const auto waited = pool.alloc(std::nothrow, 1, std::chrono::milliseconds(5));
    CHECK(waited.status() == MORI_ERR_POOL_FULL && contains(waited.message(), "still full after waiting"));
    const auto never = pool.alloc(std::nothrow, 1 << 20, std::chrono::hours(1));  // refused at once
    CHECK(never.status() == MORI_ERR_BUFFER_TOO_SMALL && contains(never.message(), "can never be granted"));
#if MORI_TP_HPP_EXCEPTIONS
    try {
        (void)pool.try_alloc(1);
        CHECK(!"try_alloc threw");
    } catch (const mori_tp::error &e) {
        CHECK(e.status() == MORI_ERR_POOL_FULL && e.retryable());
    }
#endif
    CHECK(pool.close(std::nothrow).status() == MORI_ERR_INVALID_ARGUMENT);  // a slot is live
    CHECK(whole.free(std::nothrow));
    CHECK(!whole && pool.info(std::nothrow).value().live_slots == 0);
    CHECK(pool.close(std::nothrow) && !pool);

    // The pool lives until its object and every slot are gone, in either order.
    MoriTpPool handle = 0;
    mori_tp::slot kept;
    {
        mori_tp::pool scoped = mori_tp::pool::create(std::nothrow, 1 << 20).value();
        handle = scoped.handle();
        kept = scoped.alloc(std::nothrow, 100, std::chrono::seconds(1)).value();
        mori_tp::slot moved = scoped.try_alloc(std::nothrow, 100).value();
        mori_tp::slot target = std::move(moved);
        CHECK(!moved && target && scoped.info(std::nothrow).value().live_slots == 2);
    }  // `target` freed, then the pool object dropped; `kept` holds the pool
    MoriTpPoolInfo info{};
    CHECK(mori_tp_pool_info(handle, &info) == MORI_OK && info.live_slots == 1);
    std::memset(kept.address(), 0x5A, static_cast<std::size_t>(kept.size()));
    kept = mori_tp::slot();  // the last one: the slot is freed and the pool destroyed
    CHECK(mori_tp_pool_info(handle, &info) == MORI_ERR_INVALID_ARGUMENT);

    // release(): the caller frees with the C API.
    mori_tp::pool released = mori_tp::pool::create(std::nothrow, 1 << 20).value();
    const MoriTpSlot raw = released.try_alloc(std::nothrow, 10).value().release();
    CHECK(released.info(std::nothrow).value().live_slots == 1);
    CHECK(mori_tp_pool_free(released.handle(), raw.offset) == MORI_OK);
}

// ---- eight threads taking, writing and freeing slots of one pool; slots handed between threads
void threads() {
    mori_tp::pool pool = mori_tp::pool::create(std::nothrow, 1 << 20, 4096).value();
    std::atomic<int> bad{0};
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < 8; ++t)
        workers.emplace_back([&pool, &bad, t] {
            for (unsigned i = 0; i < 100; ++i) {
                const std::uint64_t size = 4096u * (1 + (i * 7 + t) % 9);
                auto slot = pool.alloc(std::nothrow, size, std::chrono::seconds(60));
                if (!slot) {
                    ++bad;
                    return;
                }
                auto *bytes = static_cast<unsigned char *>(slot->address());
                for (std::uint64_t b = 0; b < slot->size(); b += 64) bytes[b] = static_cast<unsigned char>(t);
                std::this_thread::yield();
                for (std::uint64_t b = 0; b < slot->size(); b += 64)
                    if (bytes[b] != static_cast<unsigned char>(t)) ++bad;
            }  // each slot freed by its destructor
        });
    // A producer fills slots that a consumer checks and frees.
    std::vector<std::future<mori_tp::slot>> handed;
    std::vector<std::promise<mori_tp::slot>> promises(16);
    for (auto &promise : promises) handed.push_back(promise.get_future());
    std::thread producer([&pool, &promises] {
        for (std::size_t i = 0; i < promises.size(); ++i) {
            mori_tp::slot slot = pool.alloc(std::nothrow, 8192, std::chrono::seconds(60)).value();
            std::memset(slot.address(), static_cast<int>(i), 8192);
            promises[i].set_value(std::move(slot));
        }
    });
    std::thread consumer([&handed, &bad] {
        for (std::size_t i = 0; i < handed.size(); ++i) {
            mori_tp::slot slot = handed[i].get();
            const auto *bytes = static_cast<const unsigned char *>(slot.address());
            if (bytes[0] != i || bytes[8191] != i) ++bad;
        }
    });
    for (auto &worker : workers) worker.join();
    producer.join();
    consumer.join();
    CHECK(bad == 0);
    CHECK(pool.info(std::nothrow).value().live_slots == 0);
}

}  // namespace

int main() {
    versions_and_names();
    {
        mori_tp::pool prefill_pool = mori_tp::pool::create(std::nothrow, 1 << 20, 4096).value();
        mori_tp::pool decode_pool = mori_tp::pool::create(std::nothrow, 1 << 20, 4096).value();
        one_pair(prefill_pool, decode_pool);
    }
    any_layout();
    ownership();
    refusals();
    size_query_keeps_the_message();
    pools();
    threads();
    if (failures != 0) {
        std::fprintf(stderr, "cpp_api_test.cpp: %d checks failed\n", failures);
        return 1;
    }
    std::printf("cpp_api_test.cpp: all checks passed\n");
    return 0;
}
