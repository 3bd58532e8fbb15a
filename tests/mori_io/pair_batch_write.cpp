// mori-tp's pair plan driving MORI-IO: two processes, one MORI-IO IOEngine each (its TCP
// backend, host memory, 127.0.0.1). The prefill process (a child) holds TP 2 ranks of an HND
// layout with 16-token pages; the decode process (the parent) holds TP 4 ranks of an NHD layout
// with 64-token pages; 8 KV heads, K and V, a request of 173 tokens (a partial last page) on
// scattered pages. For every pair that sends, mori_tp_pair_config and mori_tp_pair_segments
// give the segments, and the prefill process writes them with one IOEngine::BatchWrite entry
// per (pair, buffer), except the first pair's, which go through an IOEngineSession's
// BatchWrite. It checks every entry's status (Failed() first), then tells the decode process
// over a pipe (the connector's side channel, as SGLang and vLLM do) with the transfer ids. The
// decode process checks MORI-IO's inbound status of each id, then every byte of every decode
// buffer against what mori_send_kvcache_pair (host backend) leaves in sentinel-filled copies,
// bytes outside the slice included. A second round drops one segment and must fail the check
// in that segment only.
//
// Built and run by tests/mori_io.rs in hip/mori-io-build.sh's chroot, linked against
// libmori_io (ROCm/mori 1e3ce4e1) and libmori_tp. Exits 0 after "pair_batch_write: passed".
#include "mori_tp.hpp"

#include <msgpack.hpp>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "mori/io/io.hpp"

using namespace mori::io;

namespace {

constexpr uint32_t kHeads = 8, kPrefillTp = 2, kDecodeTp = 4, kBuffers = 2;
constexpr uint64_t kHeadBytes = 32, kTokens = 173;
constexpr uint32_t kSrcPage = 16, kDstPage = 64;
constexpr uint64_t kSrcPages = 16, kDstPages = 6;
const std::vector<int32_t> kSrcPageList = {5, 0, 11, 3, 14, 7, 1, 9, 12, 4, 15};  // 11 pages
const std::vector<int32_t> kDstPageList = {4, 1, 3};                                // 3 pages

[[noreturn]] void fail(const std::string &what) {
    std::fprintf(stderr, "pair_batch_write: FAILED: %s\n", what.c_str());
    std::fflush(stderr);
    _exit(1);
}

MoriTpLayout hnd(uint32_t tp, uint32_t rank, uint32_t page) {
    const uint64_t local = kHeads / tp;
    return MoriTpLayout{kHeads, tp, rank, page, kHeadBytes, local * page * kHeadBytes, 0,
                        kHeadBytes, page * kHeadBytes};
}

MoriTpLayout nhd(uint32_t tp, uint32_t rank, uint32_t page) {
    const uint64_t local = kHeads / tp;
    return MoriTpLayout{kHeads, tp, rank, page, kHeadBytes, page * local * kHeadBytes, 0,
                        local * kHeadBytes, kHeadBytes};
}

uint64_t src_capacity() { return kSrcPages * hnd(kPrefillTp, 0, kSrcPage).page_stride; }
uint64_t dst_capacity() { return kDstPages * nhd(kDecodeTp, 0, kDstPage).page_stride; }

MoriTpRequest request() {
    return MoriTpRequest{kSrcPageList.data(), kSrcPageList.size(), kDstPageList.data(),
                         kDstPageList.size(), kTokens};
}

MoriTpPairConfig config(uint32_t p, uint32_t d) {
    return mori_tp::pair_config(hnd(kPrefillTp, p, kSrcPage), nhd(kDecodeTp, d, kDstPage));
}

// Prefill rank p's buffer b: the same bytes in both processes.
std::vector<uint8_t> source(uint32_t p, uint32_t b) {
    std::vector<uint8_t> out(src_capacity());
    uint32_t x = 0x9E3779B9u ^ (p * 131 + b * 7 + 1);
    for (auto &byte : out) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        byte = static_cast<uint8_t>(x);
    }
    return out;
}

std::vector<uint8_t> sentinel(uint32_t d, uint32_t b) {
    std::vector<uint8_t> out(dst_capacity());
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>((i % 251) * 31 + d * 7 + b * 13);
    return out;
}

struct Pair {
    uint32_t p, d;
    std::vector<MoriSegment> segments;
};

std::vector<Pair> sending() {
    std::vector<Pair> out;
    for (uint32_t p = 0; p < kPrefillTp; ++p)
        for (uint32_t d = 0; d < kDecodeTp; ++d) {
            const MoriTpPairConfig c = config(p, d);
            if (c.action != MORI_TP_ACTION_SEND) continue;
            out.push_back({p, d, mori_tp::pair_segments(c, request(), MORI_TP_STAGING_NONE)});
        }
    return out;
}

// Length-prefixed messages over a pipe.
void put(int fd, const std::string &bytes) {
    const uint64_t n = bytes.size();
    std::string frame(reinterpret_cast<const char *>(&n), sizeof n);
    frame += bytes;
    size_t at = 0;
    while (at < frame.size()) {
        const ssize_t w = write(fd, frame.data() + at, frame.size() - at);
        if (w <= 0) fail("pipe write");
        at += static_cast<size_t>(w);
    }
}

std::string get(int fd) {
    auto read_all = [fd](char *to, size_t n) {
        size_t at = 0;
        while (at < n) {
            const ssize_t r = read(fd, to + at, n - at);
            if (r <= 0) fail("the other process closed its pipe");
            at += static_cast<size_t>(r);
        }
    };
    uint64_t n = 0;
    read_all(reinterpret_cast<char *>(&n), sizeof n);
    std::string out(n, '\0');
    read_all(out.data(), n);
    return out;
}

template <class T>
std::string pack(const T &value) {
    msgpack::sbuffer buffer;
    msgpack::pack(buffer, value);
    return std::string(buffer.data(), buffer.size());
}

template <class T>
T unpack(const std::string &bytes) {
    return msgpack::unpack(bytes.data(), bytes.size()).get().as<T>();
}

std::unique_ptr<IOEngine> engine(const std::string &key) {
    auto out = std::make_unique<IOEngine>(key, IOEngineConfig{"127.0.0.1", 0});
    out->CreateBackend(BackendType::TCP, TcpBackendConfig{});
    return out;
}

// Every entry's status: a failed one first (entries after a backend failure stay INIT).
void wait_all(std::vector<TransferStatus> &statuses, const char *what) {
    for (int round = 0; round < 20000; ++round) {
        size_t done = 0;
        for (size_t e = 0; e < statuses.size(); ++e) {
            if (statuses[e].Failed())
                fail(std::string(what) + ": entry " + std::to_string(e) + " failed: code " +
                     std::to_string(unsigned(statuses[e].Code())) + " " + statuses[e].Message());
            done += statuses[e].Succeeded();
        }
        if (done == statuses.size()) return;
        usleep(1000);
    }
    fail(std::string(what) + ": entries still in progress after 20 s");
}

// The prefill process: registers its buffers, writes every pair's segments (round 2: one
// dropped), reports the transfer ids.
void prefill(int in, int out) {
    auto e = engine("mori-tp-cpp-prefill");
    std::vector<std::vector<uint8_t>> buffers;
    std::vector<MemoryDesc> local;
    for (uint32_t p = 0; p < kPrefillTp; ++p)
        for (uint32_t b = 0; b < kBuffers; ++b) {
            buffers.push_back(source(p, b));
            local.push_back(e->RegisterMemory(buffers.back().data(), buffers.back().size(), -1,
                                              MemoryLocationType::CPU));
        }
    put(out, pack(e->GetEngineDesc()));
    const auto peer = unpack<EngineDesc>(get(in));
    const auto remote = unpack<std::vector<MemoryDesc>>(get(in));
    e->RegisterRemoteEngine(peer);
    const std::vector<Pair> pairs = sending();
    for (int round = 0; round < 2; ++round) {
        if (get(in) != "go") fail("prefill: expected go");
        MemDescVec ls, rs;
        BatchSizeVec lo, ro, sz;
        std::vector<TransferUniqueId> session_ids;
        std::vector<TransferStatus> session_statuses(kBuffers);
        for (size_t i = 0; i < pairs.size(); ++i) {
            const Pair &pair = pairs[i];
            for (uint32_t b = 0; b < kBuffers; ++b) {
                SizeVec s, d, n;
                for (size_t k = 0; k < pair.segments.size(); ++k) {
                    // Round 2 drops the middle segment of the first pair's buffer 0.
                    if (round == 1 && i == 0 && b == 0 && k == pair.segments.size() / 2) continue;
                    s.push_back(pair.segments[k].src_offset);
                    d.push_back(pair.segments[k].dst_offset);
                    n.push_back(pair.segments[k].length);
                }
                const MemoryDesc &src = local[pair.p * kBuffers + b];
                const MemoryDesc &dst = remote[pair.d * kBuffers + b];
                if (i == 0) {
                    auto session = e->CreateSession(src, dst);
                    if (!session) fail("CreateSession returned none");
                    session_ids.push_back(session->AllocateTransferUniqueId());
                    session->BatchWrite(s, d, n, &session_statuses[b], session_ids.back());
                    continue;
                }
                ls.push_back(src);
                rs.push_back(dst);
                lo.push_back(s);
                ro.push_back(d);
                sz.push_back(n);
            }
        }
        std::vector<TransferStatus> statuses(sz.size());
        TransferStatusPtrVec pointers;
        for (auto &status : statuses) pointers.push_back(&status);
        TransferUniqueIdVec ids;
        for (size_t k = 0; k < sz.size(); ++k) ids.push_back(e->AllocateTransferUniqueId());
        e->BatchWrite(ls, lo, rs, ro, sz, pointers, ids);
        wait_all(session_statuses, "session BatchWrite");
        wait_all(statuses, "BatchWrite");
        ids.insert(ids.end(), session_ids.begin(), session_ids.end());
        std::printf("pair_batch_write: prefill round %d: %zu pairs, one BatchWrite of %zu "
                    "entries and %u session BatchWrites, every status SUCCESS\n",
                    round, pairs.size(), sz.size(), kBuffers);
        std::fflush(stdout);
        put(out, pack(std::vector<uint64_t>(ids.begin(), ids.end())));
    }
    if (get(in) != "stop") fail("prefill: expected stop");
}

// What every decode buffer holds after one host send per pair (round 2: none of the dropped
// segment), and where the dropped segment lies.
std::vector<std::vector<uint8_t>> expected() {
    std::vector<std::vector<uint8_t>> want;
    for (uint32_t d = 0; d < kDecodeTp; ++d)
        for (uint32_t b = 0; b < kBuffers; ++b) want.push_back(sentinel(d, b));
    for (const Pair &pair : sending()) {
        std::vector<std::vector<uint8_t>> src;
        std::vector<const void *> src_ptrs;
        std::vector<void *> dst_ptrs;
        for (uint32_t b = 0; b < kBuffers; ++b) {
            src.push_back(source(pair.p, b));
            src_ptrs.push_back(src.back().data());
            dst_ptrs.push_back(want[pair.d * kBuffers + b].data());
        }
        const MoriKvBuffers buffers{src_ptrs.data(), dst_ptrs.data(), kBuffers, src_capacity(),
                                    dst_capacity()};
        const MoriSendOptions options{MORI_BACKEND_HOST, 0, nullptr};
        const MoriTpPairConfig c = config(pair.p, pair.d);
        const MoriTpRequest r = request();
        if (mori_send_kvcache_pair(&c, &buffers, &r, &options) != MORI_OK)
            fail(std::string("mori_send_kvcache_pair: ") + mori_last_error_message());
    }
    return want;
}

void decode(int in, int out) {
    auto e = engine("mori-tp-cpp-decode");
    std::vector<std::vector<uint8_t>> buffers;
    std::vector<MemoryDesc> local;
    for (uint32_t d = 0; d < kDecodeTp; ++d)
        for (uint32_t b = 0; b < kBuffers; ++b) {
            buffers.push_back(sentinel(d, b));
            local.push_back(e->RegisterMemory(buffers.back().data(), buffers.back().size(), -1,
                                              MemoryLocationType::CPU));
        }
    const auto peer = unpack<EngineDesc>(get(in));
    e->RegisterRemoteEngine(peer);
    put(out, pack(e->GetEngineDesc()));
    put(out, pack(local));
    const std::vector<std::vector<uint8_t>> want = expected();
    const std::vector<Pair> pairs = sending();
    const MoriSegment dropped = pairs[0].segments[pairs[0].segments.size() / 2];
    const size_t dropped_buffer = pairs[0].d * kBuffers + 0;
    for (int round = 0; round < 2; ++round) {
        for (uint32_t d = 0; d < kDecodeTp; ++d)
            for (uint32_t b = 0; b < kBuffers; ++b) {
                // In place: the engine registered these bytes (a move would free them).
                const std::vector<uint8_t> fill = sentinel(d, b);
                std::copy(fill.begin(), fill.end(), buffers[d * kBuffers + b].begin());
            }
        put(out, "go");
        const auto ids = unpack<std::vector<uint64_t>>(get(in));
        for (uint64_t id : ids) {
            TransferStatus status;
            bool found = false;
            for (int k = 0; k < 4000 && !(found = e->PopInboundTransferStatus(peer.key, id, &status)); ++k)
                usleep(1000);
            if (!found) fail("no inbound status for transfer " + std::to_string(id));
            if (status.Code() != StatusCode::SUCCESS)
                fail("inbound status of transfer " + std::to_string(id) + ": " + status.Message());
        }
        std::vector<size_t> wrong;
        size_t first = 0;
        for (size_t i = 0; i < buffers.size(); ++i) {
            if (buffers[i] == want[i]) continue;
            if (wrong.empty())
                for (first = 0; buffers[i][first] == want[i][first]; ++first) {
                }
            wrong.push_back(i);
        }
        if (round == 0 && !wrong.empty())
            fail("decode rank " + std::to_string(wrong[0] / kBuffers) + " buffer " +
                 std::to_string(wrong[0] % kBuffers) + " differs from the host send's, first at byte " +
                 std::to_string(first) + " (" + std::to_string(wrong.size()) + " buffers differ)");
        if (round == 1 &&
            (wrong != std::vector<size_t>{dropped_buffer} || first < dropped.dst_offset ||
             first >= dropped.dst_offset + dropped.length))
            fail("dropping one segment was not caught at that segment (" +
                 std::to_string(wrong.size()) + " buffers differ)");
        std::printf(round == 0 ? "pair_batch_write: decode: %zu transfers' inbound status SUCCESS; "
                                 "every byte of %zu decode buffers as mori_send_kvcache_pair leaves it\n"
                               : "pair_batch_write: decode: one segment dropped: %zu transfers, the "
                                 "check fails in that segment only (%zu buffers checked)\n",
                    ids.size(), buffers.size());
        std::fflush(stdout);
    }
    put(out, "stop");
}

}  // namespace

int main() {
    alarm(120);  // nothing here may hang a test run (the child sets its own)
    int to_prefill[2], to_decode[2];
    if (pipe(to_prefill) != 0 || pipe(to_decode) != 0) fail("pipe");
    const pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        alarm(120);
        close(to_prefill[1]);
        close(to_decode[0]);
        prefill(to_prefill[0], to_decode[1]);
        std::fflush(stdout);
        _exit(0);
    }
    close(to_prefill[0]);
    close(to_decode[1]);
    decode(to_decode[0], to_prefill[1]);
    int status = 0;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("the prefill process failed (status " + std::to_string(status) + ")");
    std::printf("pair_batch_write: passed\n");
    return 0;
}
