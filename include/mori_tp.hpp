/*
 * mori_tp.hpp: C++17 over the C API of mori_tp.h, header-only. Written by hand (mori_tp.h is
 * generated); it adds no behaviour of its own, only C++ shapes for the C calls:
 *
 *  - errors: every function throws mori_tp::error (a std::system_error carrying the MoriStatus
 *    and the library's message) or, called with std::nothrow as its first argument, returns a
 *    mori_tp::result<T> (an expected-like value-or-error holding a std::error_code of
 *    mori_tp::category() and the message). Built without exceptions (-fno-exceptions), only
 *    the std::nothrow forms are declared, and result<T>::value() on an error prints the message
 *    and aborts.
 *  - the plan functions return std::vector: the size query and the second call are done here.
 *  - page lists, buffer lists and staging regions are mori_tp::span (std::span under C++20, a
 *    small span of the same shape under C++17): a std::vector, std::array or C array converts.
 *  - staging pools and their slots are RAII: mori_tp::pool destroys the pool when the pool
 *    object and every slot taken from it are gone; mori_tp::slot frees its slot when destroyed.
 *
 * The C header's documentation (mori_tp.h) is the reference for what each call checks and
 * refuses; each function here names the C function it calls. Link as for the C API: CMake's
 * mori_tp::static or mori_tp::shared, or pkg-config's mori_tp-static or mori_tp.
 *
 *   mori_tp::pool pool(64 << 20);                       // 64 MiB of host memory
 *   mori_tp::slot slot = pool.alloc(bytes, std::chrono::seconds(5));
 *   auto segments = mori_tp::plan_transfer(config, staging, src_pages, dst_pages);
 *   mori_tp::result<mori_tp::slot> maybe = pool.try_alloc(std::nothrow, bytes);
 *   if (!maybe && maybe.status() == MORI_ERR_POOL_FULL) { ... retry later ... }
 */
#ifndef MORI_TP_HPP
#define MORI_TP_HPP

#include "mori_tp.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_MSVC_LANG)
#define MORI_TP_HPP_CPLUSPLUS _MSVC_LANG
#else
#define MORI_TP_HPP_CPLUSPLUS __cplusplus
#endif
#if MORI_TP_HPP_CPLUSPLUS < 201703L
#error "mori_tp.hpp needs C++17 or later; C and older C++ use mori_tp.h"
#endif
#if MORI_TP_HPP_CPLUSPLUS >= 202002L && defined(__has_include)
#if __has_include(<span>)
#include <span>
#endif
#endif

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define MORI_TP_HPP_EXCEPTIONS 1
#else
#define MORI_TP_HPP_EXCEPTIONS 0
#endif

namespace mori_tp {

// ---------------------------------------------------------------------------------------------
// Spans

#if defined(__cpp_lib_span) && __cpp_lib_span >= 202002L
/// A view of contiguous elements: std::span under C++20.
template <class T>
using span = std::span<T>;
#else
/// A view of contiguous elements, the subset of C++20's std::span (dynamic extent) that this
/// header uses: from (pointer, size), a C array, or any container with std::data and std::size
/// whose elements convert (a const span also takes a temporary container).
template <class T>
class span {
    template <class C>
    using data_of = decltype(std::data(std::declval<C &>()));

    template <class C, class = void>
    struct compatible : std::false_type {};
    template <class C>
    struct compatible<C, std::void_t<data_of<C>, decltype(std::size(std::declval<C &>()))>>
        : std::is_convertible<std::remove_pointer_t<data_of<C>> (*)[], T (*)[]> {};

    template <class U>
    struct is_span : std::false_type {};
    template <class U>
    struct is_span<span<U>> : std::true_type {};

public:
    using element_type = T;
    using value_type = std::remove_cv_t<T>;
    using size_type = std::size_t;
    using difference_type = std::ptrdiff_t;
    using pointer = T *;
    using reference = T &;
    using iterator = T *;

    constexpr span() noexcept = default;
    constexpr span(T *data, size_type size) noexcept : data_(data), size_(size) {}
    template <class C,
              std::enable_if_t<!std::is_same_v<std::remove_cv_t<std::remove_reference_t<C>>, span> &&
                                   (std::is_lvalue_reference_v<C> || std::is_const_v<T> ||
                                    is_span<std::remove_cv_t<std::remove_reference_t<C>>>::value) &&
                                   compatible<std::remove_reference_t<C>>::value,
                               int> = 0>
    constexpr span(C &&container) noexcept  // NOLINT(google-explicit-constructor): as std::span
        : data_(std::data(container)), size_(std::size(container)) {}

    constexpr T *data() const noexcept { return data_; }
    constexpr size_type size() const noexcept { return size_; }
    constexpr size_type size_bytes() const noexcept { return size_ * sizeof(T); }
    [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
    constexpr iterator begin() const noexcept { return data_; }
    constexpr iterator end() const noexcept { return data_ + size_; }
    constexpr T &operator[](size_type i) const noexcept { return data_[i]; }

private:
    T *data_ = nullptr;
    size_type size_ = 0;
};
#endif

// ---------------------------------------------------------------------------------------------
// Errors

/// The failure codes of MoriStatus, as a std::error_code enum (mori_tp::category()).
enum class errc : std::int32_t {
    null_pointer = MORI_ERR_NULL_POINTER,
    invalid_argument = MORI_ERR_INVALID_ARGUMENT,
    topology = MORI_ERR_TOPOLOGY,
    layout_mismatch = MORI_ERR_LAYOUT_MISMATCH,
    slice_overflow = MORI_ERR_SLICE_OVERFLOW,
    out_of_bounds = MORI_ERR_OUT_OF_BOUNDS,
    buffer_too_small = MORI_ERR_BUFFER_TOO_SMALL,
    backend_unavailable = MORI_ERR_BACKEND_UNAVAILABLE,
    gpu = MORI_ERR_GPU,
    panic = MORI_ERR_PANIC,
    pool_full = MORI_ERR_POOL_FULL,
};

namespace detail {
class category_impl final : public std::error_category {
public:
    const char *name() const noexcept override { return "mori_tp"; }
    std::string message(int status) const override { return mori_tp_status_name(status); }
    /// MORI_ERR_NULL_POINTER and MORI_ERR_INVALID_ARGUMENT compare equal to
    /// std::errc::invalid_argument, MORI_ERR_POOL_FULL to std::errc::resource_unavailable_try_again.
    std::error_condition default_error_condition(int status) const noexcept override {
        switch (status) {
        case MORI_ERR_NULL_POINTER:
        case MORI_ERR_INVALID_ARGUMENT:
            return std::errc::invalid_argument;
        case MORI_ERR_POOL_FULL:
            return std::errc::resource_unavailable_try_again;
        default:
            return std::error_condition(status, *this);
        }
    }
};
}  // namespace detail

/// The std::error_category of MoriStatus codes: name() "mori_tp", message() the code's name
/// (mori_tp_status_name).
inline const std::error_category &category() noexcept {
    // Never destroyed, so that error codes stay usable from static destructors.
    alignas(detail::category_impl) static unsigned char storage[sizeof(detail::category_impl)];
    static const detail::category_impl *const instance = new (storage) detail::category_impl();
    return *instance;
}

inline std::error_code make_error_code(errc code) noexcept {
    return {static_cast<int>(code), category()};
}

/// A failing call: its status and the library's message (mori_tp_last_error_message(), copied
/// when the call failed).
struct failure {
    MoriStatus status = MORI_OK;
    std::string message;

    std::error_code code() const noexcept { return {status, category()}; }
};

#if MORI_TP_HPP_EXCEPTIONS
/// What the throwing functions throw: a std::system_error whose code() is the status in
/// mori_tp::category() and whose what() starts with the library's message, e.g.
/// "mori_tp_slice_config: invalid topology: prefill side: tp_size 3 ...: MORI_ERR_TOPOLOGY".
class error : public std::system_error {
public:
    error(MoriStatus status, const std::string &message)
        : std::system_error(std::error_code(status, category()), message),
          status_(status),
          message_(std::make_shared<const std::string>(message)) {}

    /// The MoriStatus (MORI_ERR_*).
    MoriStatus status() const noexcept { return status_; }
    /// The library's message alone, without the code's name.
    const std::string &message() const noexcept { return *message_; }
    /// True for MORI_ERR_POOL_FULL: the same call may succeed once other slots are freed.
    bool retryable() const noexcept { return status_ == MORI_ERR_POOL_FULL; }

private:
    MoriStatus status_;
    std::shared_ptr<const std::string> message_;  // shared: copying an exception cannot throw
};
#endif

namespace detail {
[[noreturn]] inline void raise(const failure &f) {
#if MORI_TP_HPP_EXCEPTIONS
    throw error(f.status, f.message);
#else
    std::fprintf(stderr, "mori_tp: %s: %s\n", mori_tp_status_name(f.status), f.message.c_str());
    std::abort();
#endif
}

/// The failure of a call that just returned `status`, with this thread's message.
inline failure fail(MoriStatus status) { return failure{status, mori_tp_last_error_message()}; }
}  // namespace detail

/// The outcome of a std::nothrow call: a T, or the failure. Like C++23's std::expected:
/// `if (r) use(*r); else log(r.message());`. value() on a failure throws mori_tp::error (or,
/// without exceptions, prints the message and aborts).
template <class T>
class [[nodiscard]] result {
public:
    result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
    result(failure f) : failure_(std::move(f)) {}  // NOLINT(google-explicit-constructor)

    bool has_value() const noexcept { return value_.has_value(); }
    explicit operator bool() const noexcept { return has_value(); }

    T &value() & {
        check();
        return *value_;
    }
    const T &value() const & {
        check();
        return *value_;
    }
    T &&value() && {
        check();
        return std::move(*value_);
    }
    template <class U>
    T value_or(U &&fallback) const & {
        return has_value() ? *value_ : static_cast<T>(std::forward<U>(fallback));
    }

    T &operator*() & noexcept { return *value_; }
    const T &operator*() const & noexcept { return *value_; }
    T &&operator*() && noexcept { return std::move(*value_); }
    T *operator->() noexcept { return &*value_; }
    const T *operator->() const noexcept { return &*value_; }

    /// MORI_OK, or the failure's MORI_ERR_* code.
    MoriStatus status() const noexcept { return has_value() ? MORI_OK : failure_.status; }
    /// Empty (false) on success, else the status in mori_tp::category().
    std::error_code error() const noexcept {
        return has_value() ? std::error_code() : failure_.code();
    }
    /// The library's message ("" on success).
    const std::string &message() const noexcept { return failure_.message; }

private:
    void check() const {
        if (!value_) detail::raise(failure_);
    }

    std::optional<T> value_;
    failure failure_;
};

/// The outcome of a std::nothrow call that returns nothing.
template <>
class [[nodiscard]] result<void> {
public:
    result() = default;
    result(failure f) : failure_(std::move(f)) {}  // NOLINT(google-explicit-constructor)

    bool has_value() const noexcept { return failure_.status == MORI_OK; }
    explicit operator bool() const noexcept { return has_value(); }
    void value() const {
        if (!has_value()) detail::raise(failure_);
    }
    MoriStatus status() const noexcept { return failure_.status; }
    std::error_code error() const noexcept {
        return has_value() ? std::error_code() : failure_.code();
    }
    const std::string &message() const noexcept { return failure_.message; }

private:
    failure failure_;
};

namespace detail {
inline result<void> check(MoriStatus status) {
    if (status == MORI_OK) return {};
    return fail(status);
}

/// `value` if `status` is MORI_OK. Call the C function first, in its own statement: the
/// value is read when this is called.
template <class T>
result<T> value_if_ok(MoriStatus status, T value) {
    if (status == MORI_OK) return value;
    return fail(status);
}

/// A plan function's entries: the size query (out = NULL, capacity = 0), then the call with an
/// array that large. `call(out, capacity, &len)` is the C function with its other arguments.
template <class Entry, class Call>
result<std::vector<Entry>> sized(Call &&call) {
    std::size_t needed = 0;
    MoriStatus status = call(static_cast<Entry *>(nullptr), std::size_t{0}, &needed);
    if (status == MORI_OK) return std::vector<Entry>();
    if (status != MORI_ERR_BUFFER_TOO_SMALL) return fail(status);
    std::vector<Entry> out(needed);
    status = call(out.data(), out.size(), &needed);
    if (status != MORI_OK) return fail(status);
    out.resize(needed);
    return out;
}

/// Refuses buffer lists of different lengths the way the library refuses bad input.
inline result<void> same_count(const char *function, std::size_t src, std::size_t dst) {
    if (src == dst) return {};
    return failure{MORI_ERR_INVALID_ARGUMENT,
                   std::string(function) + ": invalid argument: src has " + std::to_string(src) +
                       " buffers, dst " + std::to_string(dst) + " (they are paired one to one)"};
}
}  // namespace detail

/// The MoriSendOptions.flags bits of an SM budget: at most `blocks` blocks of the copy kernel per
/// call (MORI_SEND_MAX_BLOCKS_SHIFT; 0: no budget). OR them into the flags:
/// `MoriSendOptions{MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL | mori_tp::max_blocks(8), stream}`.
/// More than MORI_SEND_MAX_BLOCKS_LIMIT (65535) blocks do not fit the flags:
/// MORI_ERR_INVALID_ARGUMENT (the std::nothrow form) or mori_tp::error.
inline result<std::uint32_t> max_blocks(std::nothrow_t, std::uint32_t blocks) {
    if (blocks > MORI_SEND_MAX_BLOCKS_LIMIT) {
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::max_blocks: invalid argument: a budget of " + std::to_string(blocks) +
                           " blocks is above MORI_SEND_MAX_BLOCKS_LIMIT (" +
                           std::to_string(MORI_SEND_MAX_BLOCKS_LIMIT) + ")"};
    }
    return std::uint32_t{blocks << MORI_SEND_MAX_BLOCKS_SHIFT};
}

#if MORI_TP_HPP_EXCEPTIONS
inline std::uint32_t max_blocks(std::uint32_t blocks) { return max_blocks(std::nothrow, blocks).value(); }
#endif

// ---------------------------------------------------------------------------------------------
// Versions and names

/// mori_tp_version(): the library's version, "MAJOR.MINOR.PATCH".
inline std::string_view version() noexcept { return mori_tp_version(); }
/// mori_tp_abi_version(): the loaded library's ABI version.
inline std::uint32_t abi_version() noexcept { return mori_tp_abi_version(); }
/// Whether the loaded library has the ABI this header was written for (check at start-up).
inline bool abi_compatible() noexcept { return mori_tp_abi_version() == MORI_TP_ABI_VERSION; }
/// mori_tp_status_name: "MORI_OK", "MORI_ERR_POOL_FULL", ... ("MORI_ERR_UNKNOWN" otherwise).
inline std::string_view status_name(MoriStatus status) noexcept { return mori_tp_status_name(status); }
/// mori_tp_action_name: "MORI_TP_ACTION_SEND", ... ("MORI_TP_ACTION_UNKNOWN" otherwise).
inline std::string_view action_name(MoriTpAction action) noexcept {
    return mori_tp_action_name(action);
}
/// mori_tp_staging_name: "MORI_TP_STAGING_BOTH", ... ("MORI_TP_STAGING_UNKNOWN" otherwise).
inline std::string_view staging_name(MoriTpStaging staging) noexcept {
    return mori_tp_staging_name(staging);
}
/// mori_tp_backend_name: "MORI_BACKEND_HIP", ... ("MORI_BACKEND_UNKNOWN" otherwise).
inline std::string_view backend_name(MoriBackend backend) noexcept {
    return mori_tp_backend_name(backend);
}
/// mori_tp_last_error_message(), copied.
inline std::string last_error_message() { return mori_tp_last_error_message(); }

// ---------------------------------------------------------------------------------------------
// One pair, pages of mori_tp_slice_config's layout (REFERENCE.md sections 3 to 6)

/// mori_tp_slice_config.
inline result<MoriTpSliceConfig> slice_config(std::nothrow_t, const MoriTpSliceParams &params) {
    MoriTpSliceConfig out{};
    const MoriStatus status = mori_tp_slice_config(&params, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpSliceConfig slice_config(const MoriTpSliceParams &params) {
    return slice_config(std::nothrow, params).value();
}
#endif

/// The heads one rank of an engine holds (mori_tp_rank_heads): `num_heads` consecutive global
/// heads from `first_head`.
struct rank_heads_t {
    std::uint32_t first_head;
    std::uint32_t num_heads;
};

/// mori_tp_rank_heads.
inline result<rank_heads_t> rank_heads(std::nothrow_t, std::uint32_t total_kv_heads, std::uint32_t tp_size,
                                       std::uint32_t tp_rank) {
    rank_heads_t out{};
    const MoriStatus status = mori_tp_rank_heads(total_kv_heads, tp_size, tp_rank, &out.first_head, &out.num_heads);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline rank_heads_t rank_heads(std::uint32_t total_kv_heads, std::uint32_t tp_size, std::uint32_t tp_rank) {
    return rank_heads(std::nothrow, total_kv_heads, tp_size, tp_rank).value();
}
#endif

/// mori_tp_head_sender: the one prefill rank that sends `head` to decode rank `decode_tp_rank`.
inline result<std::uint32_t> head_sender(std::nothrow_t, std::uint32_t total_kv_heads,
                                         std::uint32_t prefill_tp_size, std::uint32_t decode_tp_size,
                                         std::uint32_t decode_tp_rank, std::uint32_t head) {
    std::uint32_t out = 0;
    const MoriStatus status =
        mori_tp_head_sender(total_kv_heads, prefill_tp_size, decode_tp_size, decode_tp_rank, head, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::uint32_t head_sender(std::uint32_t total_kv_heads, std::uint32_t prefill_tp_size,
                                 std::uint32_t decode_tp_size, std::uint32_t decode_tp_rank, std::uint32_t head) {
    return head_sender(std::nothrow, total_kv_heads, prefill_tp_size, decode_tp_size, decode_tp_rank, head).value();
}
#endif

/// mori_tp_plan: one rect per run of page pairs.
inline result<std::vector<MoriCopyRect>> plan(std::nothrow_t, const MoriTpSliceConfig &config,
                                              span<const std::int32_t> src_pages,
                                              span<const std::int32_t> dst_pages) {
    if (src_pages.size() != dst_pages.size())
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::plan: invalid argument: " + std::to_string(src_pages.size()) +
                           " source pages, " + std::to_string(dst_pages.size()) + " destination pages"};
    return detail::sized<MoriCopyRect>([&](MoriCopyRect *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_plan(&config, src_pages.data(), dst_pages.data(), src_pages.size(), out, capacity,
                            len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriCopyRect> plan(const MoriTpSliceConfig &config, span<const std::int32_t> src_pages,
                                      span<const std::int32_t> dst_pages) {
    return plan(std::nothrow, config, src_pages, dst_pages).value();
}
#endif

/// mori_tp_plan_segments: the plan as contiguous copies.
inline result<std::vector<MoriSegment>> plan_segments(std::nothrow_t, const MoriTpSliceConfig &config,
                                                      span<const std::int32_t> src_pages,
                                                      span<const std::int32_t> dst_pages) {
    if (src_pages.size() != dst_pages.size())
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::plan_segments: invalid argument: " + std::to_string(src_pages.size()) +
                           " source pages, " + std::to_string(dst_pages.size()) + " destination pages"};
    return detail::sized<MoriSegment>([&](MoriSegment *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_plan_segments(&config, src_pages.data(), dst_pages.data(), src_pages.size(), out,
                                     capacity, len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriSegment> plan_segments(const MoriTpSliceConfig &config,
                                              span<const std::int32_t> src_pages,
                                              span<const std::int32_t> dst_pages) {
    return plan_segments(std::nothrow, config, src_pages, dst_pages).value();
}
#endif

/// mori_tp_kvcache_send: src[i] -> dst[i] for every buffer; src and dst must have the same length.
inline result<void> send_kvcache(std::nothrow_t, const MoriTpSliceConfig &config,
                                 span<const void *const> src, std::uint64_t src_capacity,
                                 span<void *const> dst, std::uint64_t dst_capacity,
                                 span<const std::int32_t> src_pages, span<const std::int32_t> dst_pages,
                                 const MoriSendOptions &options = MoriSendOptions{}) {
    if (auto counts = detail::same_count("mori_tp::send_kvcache", src.size(), dst.size()); !counts)
        return counts;
    if (src_pages.size() != dst_pages.size())
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::send_kvcache: invalid argument: " + std::to_string(src_pages.size()) +
                           " source pages, " + std::to_string(dst_pages.size()) + " destination pages"};
    const MoriKvBuffers buffers{src.data(), dst.data(), src.size(), src_capacity, dst_capacity};
    return detail::check(mori_tp_kvcache_send(&config, &buffers, src_pages.data(), dst_pages.data(),
                                           src_pages.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void send_kvcache(const MoriTpSliceConfig &config, span<const void *const> src,
                         std::uint64_t src_capacity, span<void *const> dst, std::uint64_t dst_capacity,
                         span<const std::int32_t> src_pages, span<const std::int32_t> dst_pages,
                         const MoriSendOptions &options = MoriSendOptions{}) {
    send_kvcache(std::nothrow, config, src, src_capacity, dst, dst_capacity, src_pages, dst_pages, options)
        .value();
}
#endif

/// mori_tp_staging_for: a MoriTpStaging.
inline result<MoriTpStaging> staging_for(std::nothrow_t, const MoriTpSliceConfig &config) {
    std::uint32_t out = 0;
    const MoriStatus status = mori_tp_staging_for(&config, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpStaging staging_for(const MoriTpSliceConfig &config) {
    return staging_for(std::nothrow, config).value();
}
#endif

/// mori_tp_staging_len: bytes one buffer stages for num_pages page pairs.
inline result<std::uint64_t> staging_len(std::nothrow_t, const MoriTpSliceConfig &config,
                                         std::size_t num_pages) {
    std::uint64_t out = 0;
    const MoriStatus status = mori_tp_staging_len(&config, num_pages, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::uint64_t staging_len(const MoriTpSliceConfig &config, std::size_t num_pages) {
    return staging_len(std::nothrow, config, num_pages).value();
}
#endif

/// mori_tp_plan_transfer: the transport's segments for a staging mode.
inline result<std::vector<MoriSegment>> plan_transfer(std::nothrow_t, const MoriTpSliceConfig &config,
                                                      MoriTpStaging staging,
                                                      span<const std::int32_t> src_pages,
                                                      span<const std::int32_t> dst_pages) {
    if (src_pages.size() != dst_pages.size())
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::plan_transfer: invalid argument: " + std::to_string(src_pages.size()) +
                           " source pages, " + std::to_string(dst_pages.size()) + " destination pages"};
    return detail::sized<MoriSegment>([&](MoriSegment *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_plan_transfer(&config, staging, src_pages.data(), dst_pages.data(), src_pages.size(),
                                     out, capacity, len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriSegment> plan_transfer(const MoriTpSliceConfig &config, MoriTpStaging staging,
                                              span<const std::int32_t> src_pages,
                                              span<const std::int32_t> dst_pages) {
    return plan_transfer(std::nothrow, config, staging, src_pages, dst_pages).value();
}
#endif

/// mori_tp_check_transfer: the request against both ranks' registered memory.
inline result<void> check_transfer(std::nothrow_t, const MoriTpSliceConfig &config, MoriTpStaging staging,
                                   span<const std::int32_t> src_pages, span<const std::int32_t> dst_pages,
                                   const MoriTpMemory &prefill, const MoriTpMemory &decode) {
    if (src_pages.size() != dst_pages.size())
        return failure{MORI_ERR_INVALID_ARGUMENT,
                       "mori_tp::check_transfer: invalid argument: " + std::to_string(src_pages.size()) +
                           " source pages, " + std::to_string(dst_pages.size()) + " destination pages"};
    return detail::check(mori_tp_check_transfer(&config, staging, src_pages.data(), dst_pages.data(),
                                                src_pages.size(), &prefill, &decode));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void check_transfer(const MoriTpSliceConfig &config, MoriTpStaging staging,
                           span<const std::int32_t> src_pages, span<const std::int32_t> dst_pages,
                           const MoriTpMemory &prefill, const MoriTpMemory &decode) {
    check_transfer(std::nothrow, config, staging, src_pages, dst_pages, prefill, decode).value();
}
#endif

/// mori_tp_kvcache_pack: the prefill side's slices into a staging region (a slot's bytes()).
inline result<void> pack_kvcache(std::nothrow_t, const MoriTpSliceConfig &config,
                                 span<const void *const> src, std::uint64_t src_capacity,
                                 span<const std::int32_t> src_pages, span<std::byte> staging,
                                 const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(mori_tp_kvcache_pack(&config, src.data(), src.size(), src_capacity, src_pages.data(),
                                           src_pages.size(), staging.data(), staging.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void pack_kvcache(const MoriTpSliceConfig &config, span<const void *const> src,
                         std::uint64_t src_capacity, span<const std::int32_t> src_pages,
                         span<std::byte> staging, const MoriSendOptions &options = MoriSendOptions{}) {
    pack_kvcache(std::nothrow, config, src, src_capacity, src_pages, staging, options).value();
}
#endif

/// mori_tp_kvcache_unpack: a staging region onto the decode side's pages.
inline result<void> unpack_kvcache(std::nothrow_t, const MoriTpSliceConfig &config,
                                   span<const std::byte> staging, span<void *const> dst,
                                   std::uint64_t dst_capacity, span<const std::int32_t> dst_pages,
                                   const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(mori_tp_kvcache_unpack(&config, staging.data(), staging.size(), dst.data(), dst.size(),
                                             dst_capacity, dst_pages.data(), dst_pages.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void unpack_kvcache(const MoriTpSliceConfig &config, span<const std::byte> staging,
                           span<void *const> dst, std::uint64_t dst_capacity,
                           span<const std::int32_t> dst_pages,
                           const MoriSendOptions &options = MoriSendOptions{}) {
    unpack_kvcache(std::nothrow, config, staging, dst, dst_capacity, dst_pages, options).value();
}
#endif

// ---------------------------------------------------------------------------------------------
// Any page layout (REFERENCE.md section 11)

/// mori_tp_layout_nhd: token-major pages of one rank.
inline result<MoriTpLayout> layout_nhd(std::nothrow_t, std::uint32_t total_kv_heads, std::uint32_t tp_size,
                                       std::uint32_t tp_rank, std::uint32_t page_size,
                                       std::uint64_t head_bytes) {
    MoriTpLayout out{};
    const MoriStatus status = mori_tp_layout_nhd(total_kv_heads, tp_size, tp_rank, page_size, head_bytes, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpLayout layout_nhd(std::uint32_t total_kv_heads, std::uint32_t tp_size, std::uint32_t tp_rank,
                               std::uint32_t page_size, std::uint64_t head_bytes) {
    return layout_nhd(std::nothrow, total_kv_heads, tp_size, tp_rank, page_size, head_bytes).value();
}
#endif

/// mori_tp_layout_hnd: head-major pages of one rank.
inline result<MoriTpLayout> layout_hnd(std::nothrow_t, std::uint32_t total_kv_heads, std::uint32_t tp_size,
                                       std::uint32_t tp_rank, std::uint32_t page_size,
                                       std::uint64_t head_bytes) {
    MoriTpLayout out{};
    const MoriStatus status = mori_tp_layout_hnd(total_kv_heads, tp_size, tp_rank, page_size, head_bytes, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpLayout layout_hnd(std::uint32_t total_kv_heads, std::uint32_t tp_size, std::uint32_t tp_rank,
                               std::uint32_t page_size, std::uint64_t head_bytes) {
    return layout_hnd(std::nothrow, total_kv_heads, tp_size, tp_rank, page_size, head_bytes).value();
}
#endif

/// mori_tp_pair_config: what a prefill rank and a decode rank move between their layouts.
inline result<MoriTpPairConfig> pair_config(std::nothrow_t, const MoriTpLayout &prefill,
                                            const MoriTpLayout &decode) {
    MoriTpPairConfig out{};
    const MoriStatus status = mori_tp_pair_config(&prefill, &decode, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpPairConfig pair_config(const MoriTpLayout &prefill, const MoriTpLayout &decode) {
    return pair_config(std::nothrow, prefill, decode).value();
}
#endif

/// A MoriTpRequest over two page lists (which must outlive it) and a token count.
inline MoriTpRequest request(span<const std::int32_t> src_pages, span<const std::int32_t> dst_pages,
                             std::uint64_t num_tokens) noexcept {
    return MoriTpRequest{src_pages.data(), src_pages.size(), dst_pages.data(), dst_pages.size(), num_tokens};
}

/// mori_tp_pair_segments: the transport's segments of a request for a staging mode.
inline result<std::vector<MoriSegment>> pair_segments(std::nothrow_t, const MoriTpPairConfig &config,
                                                      const MoriTpRequest &request, MoriTpStaging staging) {
    return detail::sized<MoriSegment>([&](MoriSegment *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_pair_segments(&config, &request, staging, out, capacity, len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriSegment> pair_segments(const MoriTpPairConfig &config, const MoriTpRequest &request,
                                              MoriTpStaging staging) {
    return pair_segments(std::nothrow, config, request, staging).value();
}
#endif

/// mori_tp_pair_plan: the request's strided copies page to page.
inline result<std::vector<MoriCopyRect>> pair_plan(std::nothrow_t, const MoriTpPairConfig &config,
                                                   const MoriTpRequest &request) {
    return detail::sized<MoriCopyRect>([&](MoriCopyRect *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_pair_plan(&config, &request, out, capacity, len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriCopyRect> pair_plan(const MoriTpPairConfig &config, const MoriTpRequest &request) {
    return pair_plan(std::nothrow, config, request).value();
}
#endif

/// mori_tp_pair_staging_for.
inline result<MoriTpStaging> pair_staging_for(std::nothrow_t, const MoriTpPairConfig &config) {
    std::uint32_t out = 0;
    const MoriStatus status = mori_tp_pair_staging_for(&config, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpStaging pair_staging_for(const MoriTpPairConfig &config) {
    return pair_staging_for(std::nothrow, config).value();
}
#endif

/// mori_tp_pair_staging_len: bytes one buffer stages for num_tokens tokens.
inline result<std::uint64_t> pair_staging_len(std::nothrow_t, const MoriTpPairConfig &config,
                                              std::uint64_t num_tokens) {
    std::uint64_t out = 0;
    const MoriStatus status = mori_tp_pair_staging_len(&config, num_tokens, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::uint64_t pair_staging_len(const MoriTpPairConfig &config, std::uint64_t num_tokens) {
    return pair_staging_len(std::nothrow, config, num_tokens).value();
}
#endif

/// mori_tp_check_pair_transfer.
inline result<void> check_pair_transfer(std::nothrow_t, const MoriTpPairConfig &config,
                                        const MoriTpRequest &request, MoriTpStaging staging,
                                        const MoriTpMemory &prefill, const MoriTpMemory &decode) {
    return detail::check(mori_tp_check_pair_transfer(&config, &request, staging, &prefill, &decode));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void check_pair_transfer(const MoriTpPairConfig &config, const MoriTpRequest &request,
                                MoriTpStaging staging, const MoriTpMemory &prefill,
                                const MoriTpMemory &decode) {
    check_pair_transfer(std::nothrow, config, request, staging, prefill, decode).value();
}
#endif

/// mori_tp_pair_send: src[i] -> dst[i] for every buffer.
inline result<void> send_kvcache_pair(std::nothrow_t, const MoriTpPairConfig &config,
                                      span<const void *const> src, std::uint64_t src_capacity,
                                      span<void *const> dst, std::uint64_t dst_capacity,
                                      const MoriTpRequest &request,
                                      const MoriSendOptions &options = MoriSendOptions{}) {
    if (auto counts = detail::same_count("mori_tp::send_kvcache_pair", src.size(), dst.size()); !counts)
        return counts;
    const MoriKvBuffers buffers{src.data(), dst.data(), src.size(), src_capacity, dst_capacity};
    return detail::check(mori_tp_pair_send(&config, &buffers, &request, &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void send_kvcache_pair(const MoriTpPairConfig &config, span<const void *const> src,
                              std::uint64_t src_capacity, span<void *const> dst, std::uint64_t dst_capacity,
                              const MoriTpRequest &request, const MoriSendOptions &options = MoriSendOptions{}) {
    send_kvcache_pair(std::nothrow, config, src, src_capacity, dst, dst_capacity, request, options).value();
}
#endif

/// mori_tp_pair_pack.
inline result<void> pack_kvcache_pair(std::nothrow_t, const MoriTpPairConfig &config,
                                      MoriTpStaging staging_mode, span<const void *const> src,
                                      std::uint64_t src_capacity, const MoriTpRequest &request,
                                      span<std::byte> staging,
                                      const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(mori_tp_pair_pack(&config, staging_mode, src.data(), src.size(), src_capacity,
                                                &request, staging.data(), staging.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void pack_kvcache_pair(const MoriTpPairConfig &config, MoriTpStaging staging_mode,
                              span<const void *const> src, std::uint64_t src_capacity,
                              const MoriTpRequest &request, span<std::byte> staging,
                              const MoriSendOptions &options = MoriSendOptions{}) {
    pack_kvcache_pair(std::nothrow, config, staging_mode, src, src_capacity, request, staging, options).value();
}
#endif

/// mori_tp_pair_unpack.
inline result<void> unpack_kvcache_pair(std::nothrow_t, const MoriTpPairConfig &config,
                                        MoriTpStaging staging_mode, span<const std::byte> staging,
                                        span<void *const> dst, std::uint64_t dst_capacity,
                                        const MoriTpRequest &request,
                                        const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(mori_tp_pair_unpack(&config, staging_mode, staging.data(), staging.size(),
                                                  dst.data(), dst.size(), dst_capacity, &request, &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void unpack_kvcache_pair(const MoriTpPairConfig &config, MoriTpStaging staging_mode,
                                span<const std::byte> staging, span<void *const> dst,
                                std::uint64_t dst_capacity, const MoriTpRequest &request,
                                const MoriSendOptions &options = MoriSendOptions{}) {
    unpack_kvcache_pair(std::nothrow, config, staging_mode, staging, dst, dst_capacity, request, options)
        .value();
}
#endif

// ---------------------------------------------------------------------------------------------
// Requests of several groups, pipeline layer maps (REFERENCE.md sections 15 and 16)

/// What mori_tp_groups_info answers: one entry per group, and the request's totals.
struct groups_layout {
    std::vector<MoriTpGroupInfo> groups;
    MoriTpGroupsTotal total{};
};

/// mori_tp_groups_info.
inline result<groups_layout> groups_info(std::nothrow_t, span<const MoriTpGroup> groups) {
    groups_layout out;
    out.groups.resize(groups.size());
    const MoriStatus status =
        mori_tp_groups_info(groups.data(), groups.size(), out.groups.data(), &out.total);
    if (status != MORI_OK) return detail::fail(status);
    return out;
}
#if MORI_TP_HPP_EXCEPTIONS
inline groups_layout groups_info(span<const MoriTpGroup> groups) {
    return groups_info(std::nothrow, groups).value();
}
#endif

/// mori_tp_groups_segments: every group's segments, in one array.
inline result<std::vector<MoriSegment>> groups_segments(std::nothrow_t, span<const MoriTpGroup> groups) {
    return detail::sized<MoriSegment>([&](MoriSegment *out, std::size_t capacity, std::size_t *len) {
        return mori_tp_groups_segments(groups.data(), groups.size(), out, capacity, len);
    });
}
#if MORI_TP_HPP_EXCEPTIONS
inline std::vector<MoriSegment> groups_segments(span<const MoriTpGroup> groups) {
    return groups_segments(std::nothrow, groups).value();
}
#endif

/// mori_tp_check_groups_transfer.
inline result<void> check_groups_transfer(std::nothrow_t, span<const MoriTpGroup> groups,
                                          std::uint64_t src_staging_capacity,
                                          std::uint64_t dst_staging_capacity) {
    return detail::check(mori_tp_check_groups_transfer(groups.data(), groups.size(), src_staging_capacity,
                                                       dst_staging_capacity));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void check_groups_transfer(span<const MoriTpGroup> groups, std::uint64_t src_staging_capacity,
                                  std::uint64_t dst_staging_capacity) {
    check_groups_transfer(std::nothrow, groups, src_staging_capacity, dst_staging_capacity).value();
}
#endif

/// mori_tp_groups_send.
inline result<void> send_kvcache_groups(std::nothrow_t, span<const MoriTpGroup> groups,
                                        const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(mori_tp_groups_send(groups.data(), groups.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void send_kvcache_groups(span<const MoriTpGroup> groups,
                                const MoriSendOptions &options = MoriSendOptions{}) {
    send_kvcache_groups(std::nothrow, groups, options).value();
}
#endif

/// mori_tp_groups_pack.
inline result<void> pack_kvcache_groups(std::nothrow_t, span<const MoriTpGroup> groups,
                                        span<std::byte> staging,
                                        const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(
        mori_tp_groups_pack(groups.data(), groups.size(), staging.data(), staging.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void pack_kvcache_groups(span<const MoriTpGroup> groups, span<std::byte> staging,
                                const MoriSendOptions &options = MoriSendOptions{}) {
    pack_kvcache_groups(std::nothrow, groups, staging, options).value();
}
#endif

/// mori_tp_groups_unpack.
inline result<void> unpack_kvcache_groups(std::nothrow_t, span<const MoriTpGroup> groups,
                                          span<const std::byte> staging,
                                          const MoriSendOptions &options = MoriSendOptions{}) {
    return detail::check(
        mori_tp_groups_unpack(groups.data(), groups.size(), staging.data(), staging.size(), &options));
}
#if MORI_TP_HPP_EXCEPTIONS
inline void unpack_kvcache_groups(span<const MoriTpGroup> groups, span<const std::byte> staging,
                                  const MoriSendOptions &options = MoriSendOptions{}) {
    unpack_kvcache_groups(std::nothrow, groups, staging, options).value();
}
#endif

/// mori_tp_pp_layers: the layers two pipeline stages share.
inline result<MoriTpLayerRange> pp_layers(std::nothrow_t, span<const std::uint32_t> prefill_layers,
                                          span<const std::uint32_t> decode_layers,
                                          std::uint32_t prefill_stage, std::uint32_t decode_stage) {
    MoriTpLayerRange out{};
    const MoriStatus status = mori_tp_pp_layers(prefill_layers.data(), prefill_layers.size(), decode_layers.data(),
                                                decode_layers.size(), prefill_stage, decode_stage, &out);
    return detail::value_if_ok(status, out);
}
#if MORI_TP_HPP_EXCEPTIONS
inline MoriTpLayerRange pp_layers(span<const std::uint32_t> prefill_layers,
                                  span<const std::uint32_t> decode_layers, std::uint32_t prefill_stage,
                                  std::uint32_t decode_stage) {
    return pp_layers(std::nothrow, prefill_layers, decode_layers, prefill_stage, decode_stage).value();
}
#endif

// ---------------------------------------------------------------------------------------------
// Staging pools (REFERENCE.md section 12)

namespace detail {
/// A live MoriTpPool, destroyed with the last pool or slot object that refers to it.
struct pool_owner {
    MoriTpPool handle = 0;
    void *base = nullptr;
    std::uint64_t capacity = 0;
    MoriTpPoolMemory memory = MORI_TP_POOL_HOST;

    pool_owner() = default;
    pool_owner(const pool_owner &) = delete;
    pool_owner &operator=(const pool_owner &) = delete;
    ~pool_owner() {
        // No slot is live here (each holds this owner), unless one was released: then the
        // library refuses and the pool stays until the process ends.
        if (handle != 0) (void)mori_tp_pool_destroy(handle);
    }
};
}  // namespace detail

class pool;

/// One slot of a pool, freed (mori_tp_pool_free) when destroyed. Move-only. It keeps its pool
/// alive: a pool is destroyed only once its last slot is gone.
class slot {
public:
    slot() = default;
    slot(slot &&other) noexcept : owner_(std::move(other.owner_)), slot_(other.slot_) { other.slot_ = {}; }
    slot &operator=(slot &&other) noexcept {
        if (this != &other) {
            reset();
            owner_ = std::move(other.owner_);
            slot_ = other.slot_;
            other.slot_ = {};
        }
        return *this;
    }
    slot(const slot &) = delete;
    slot &operator=(const slot &) = delete;
    ~slot() { reset(); }

    /// Whether this object holds a slot (not moved from, freed or released).
    explicit operator bool() const noexcept { return owner_ != nullptr; }
    /// Bytes from the region's first byte: what a peer adds to the base it registered.
    std::uint64_t offset() const noexcept { return slot_.offset; }
    /// Bytes granted (the size asked for, rounded up to the pool's min_slot).
    std::uint64_t size() const noexcept { return slot_.size; }
    /// The slot's first byte (a device address for device pools).
    void *address() const noexcept { return slot_.address; }
    /// The slot as a staging region for pack and unpack.
    span<std::byte> bytes() const noexcept {
        return {static_cast<std::byte *>(slot_.address), static_cast<std::size_t>(slot_.size)};
    }
    /// The C slot.
    const MoriTpSlot &get() const noexcept { return slot_; }
    /// The pool's handle (0 once this object holds no slot).
    MoriTpPool pool_handle() const noexcept { return owner_ ? owner_->handle : 0; }

    /// Returns the slot to its pool now (mori_tp_pool_free); this object then holds none.
    result<void> free(std::nothrow_t) {
        if (!owner_) return {};
        const MoriStatus status = mori_tp_pool_free(owner_->handle, slot_.offset);
        owner_.reset();
        slot_ = {};
        return detail::check(status);
    }
#if MORI_TP_HPP_EXCEPTIONS
    void free() { free(std::nothrow).value(); }
#endif

    /// Gives the slot up without freeing it: the caller frees it with mori_tp_pool_free, and
    /// until then the pool cannot be destroyed (its handle stays live).
    MoriTpSlot release() noexcept {
        const MoriTpSlot out = slot_;
        owner_.reset();
        slot_ = {};
        return out;
    }

private:
    friend class pool;
    slot(std::shared_ptr<detail::pool_owner> owner, const MoriTpSlot &s) noexcept
        : owner_(std::move(owner)), slot_(s) {}

    void reset() noexcept {
        if (owner_) (void)mori_tp_pool_free(owner_->handle, slot_.offset);
        owner_.reset();
        slot_ = {};
    }

    std::shared_ptr<detail::pool_owner> owner_;
    MoriTpSlot slot_{};
};

/// A staging pool (mori_tp_pool_create): one region, carved into slots. Move-only; the pool is
/// destroyed when this object and every slot taken from it are gone (destroy it earlier with
/// close()). Thread-safe: slots may be taken and freed from any thread.
class pool {
public:
    /// mori_tp_pool_create.
    static result<pool> create(std::nothrow_t, const MoriTpPoolOptions &options) {
        MoriTpPool handle = 0;
        const MoriStatus status = mori_tp_pool_create(&options, &handle);
        if (status != MORI_OK) return detail::fail(status);
        auto owner = std::make_shared<detail::pool_owner>();
        owner->handle = handle;
        MoriTpPoolInfo info{};
        if (const MoriStatus s = mori_tp_pool_info(handle, &info); s != MORI_OK) return detail::fail(s);
        owner->base = info.base;
        owner->capacity = info.capacity;
        owner->memory = info.memory;
        return pool(std::move(owner));
    }
    static result<pool> create(std::nothrow_t, std::uint64_t capacity, std::uint64_t min_slot = 0,
                               MoriTpPoolMemory memory = MORI_TP_POOL_HOST) {
        return create(std::nothrow, MoriTpPoolOptions{capacity, min_slot, memory, 0});
    }
#if MORI_TP_HPP_EXCEPTIONS
    explicit pool(const MoriTpPoolOptions &options) : pool(create(std::nothrow, options).value()) {}
    /// A pool of capacity bytes in slots of multiples of min_slot (0: 64 KiB).
    explicit pool(std::uint64_t capacity, std::uint64_t min_slot = 0,
                  MoriTpPoolMemory memory = MORI_TP_POOL_HOST)
        : pool(MoriTpPoolOptions{capacity, min_slot, memory, 0}) {}
#endif
    pool(pool &&) noexcept = default;
    pool &operator=(pool &&) noexcept = default;
    pool(const pool &) = delete;
    pool &operator=(const pool &) = delete;
    ~pool() = default;

    explicit operator bool() const noexcept { return owner_ != nullptr; }
    MoriTpPool handle() const noexcept { return owner_ ? owner_->handle : 0; }
    /// The whole region: register [data(), data() + size()) with the transfer engine once.
    span<std::byte> region() const noexcept {
        if (!owner_) return {};
        return {static_cast<std::byte *>(owner_->base), static_cast<std::size_t>(owner_->capacity)};
    }

    /// mori_tp_pool_try_alloc: a slot now, or MORI_ERR_POOL_FULL at once.
    result<slot> try_alloc(std::nothrow_t, std::uint64_t size) {
        MoriTpSlot out{};
        const MoriStatus status = mori_tp_pool_try_alloc(handle(), size, &out);
        if (status != MORI_OK) return detail::fail(status);
        return slot(owner_, out);
    }
    /// mori_tp_pool_alloc: waits up to timeout (rounded up to milliseconds) while the pool is
    /// full; MORI_ERR_POOL_FULL if it still is.
    template <class Rep, class Period>
    result<slot> alloc(std::nothrow_t, std::uint64_t size, std::chrono::duration<Rep, Period> timeout) {
        const auto ms = std::chrono::ceil<std::chrono::milliseconds>(timeout).count();
        MoriTpSlot out{};
        const MoriStatus status =
            mori_tp_pool_alloc(handle(), size, ms > 0 ? static_cast<std::uint64_t>(ms) : 0, &out);
        if (status != MORI_OK) return detail::fail(status);
        return slot(owner_, out);
    }
#if MORI_TP_HPP_EXCEPTIONS
    slot try_alloc(std::uint64_t size) { return try_alloc(std::nothrow, size).value(); }
    template <class Rep, class Period>
    slot alloc(std::uint64_t size, std::chrono::duration<Rep, Period> timeout) {
        return alloc(std::nothrow, size, timeout).value();
    }
#endif

    /// mori_tp_pool_info.
    result<MoriTpPoolInfo> info(std::nothrow_t) const {
        MoriTpPoolInfo out{};
        const MoriStatus status = mori_tp_pool_info(handle(), &out);
    return detail::value_if_ok(status, out);
    }
#if MORI_TP_HPP_EXCEPTIONS
    MoriTpPoolInfo info() const { return info(std::nothrow).value(); }
#endif

    /// Destroys the pool now (mori_tp_pool_destroy), refused while slots are live; on success
    /// this object holds no pool.
    result<void> close(std::nothrow_t) {
        if (!owner_) return {};
        const MoriStatus status = mori_tp_pool_destroy(owner_->handle);
        if (status != MORI_OK) return detail::fail(status);
        owner_->handle = 0;
        owner_.reset();
        return {};
    }
#if MORI_TP_HPP_EXCEPTIONS
    void close() { close(std::nothrow).value(); }
#endif

private:
    explicit pool(std::shared_ptr<detail::pool_owner> owner) noexcept : owner_(std::move(owner)) {}

    std::shared_ptr<detail::pool_owner> owner_;
};

}  // namespace mori_tp

namespace std {
template <>
struct is_error_code_enum<mori_tp::errc> : true_type {};
}  // namespace std

#endif  // MORI_TP_HPP
