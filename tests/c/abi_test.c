/*
 * A C program that uses mori-tp only through include/mori_tp.h and the library: the struct
 * layouts and constants of the ABI, a full heterogeneous-TP transfer between host buffers checked
 * byte for byte, directly and staged (pack, transport segments, unpack), the plan functions with
 * their size query, one call for each refusal class, and every function of the layout API
 * (REFERENCE.md section 11): an HND prefill at TP 8 into an NHD decode at TP 2 with a larger page and a partial
 * last page, direct and staged, checked byte for byte against a loop over every element; and a
 * staging pool (slots, full, misuse, a destroyed handle); and a request of several groups (HND
 * KV pages, a per-token record every rank holds whole, two parts of one state slot) planned,
 * sent, packed and unpacked as one, with its refusals, and a pipeline layer map.
 * Exits 0 after printing "all checks passed".
 */
#include "mori_tp.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                              \
        }                                                                            \
    } while (0)

/* Checks a status and that the last error message mentions `needle`. */
static void expect(MoriStatus got, MoriStatus want, const char *needle, int line) {
    const char *message = mori_last_error_message();
    if (got != want) {
        fprintf(stderr, "line %d: got %s, want %s (%s)\n", line, mori_status_str(got),
                mori_status_str(want), message);
        failures++;
    } else if (needle != NULL && strstr(message, needle) == NULL) {
        fprintf(stderr, "line %d: message \"%s\" lacks \"%s\"\n", line, message, needle);
        failures++;
    }
}
#define EXPECT(call, want, needle) expect((call), (want), (needle), __LINE__)

static void check_layout(void) {
    CHECK(sizeof(MoriStatus) == 4);
    CHECK(sizeof(MoriTpSliceParams) == 40);
    CHECK(offsetof(MoriTpSliceParams, decode_tp_rank) == 12);
    CHECK(offsetof(MoriTpSliceParams, page_size) == 20);
    CHECK(offsetof(MoriTpSliceParams, dst_item_len) == 32);
    CHECK(sizeof(MoriTpSliceConfig) == 72);
    CHECK(offsetof(MoriTpSliceConfig, num_heads) == 12);
    CHECK(offsetof(MoriTpSliceConfig, bytes_per_token_src) == 32);
    CHECK(offsetof(MoriTpSliceConfig, heads_bytes_per_token_to_send) == 64);
    CHECK(sizeof(MoriCopyRect) == 48 && offsetof(MoriCopyRect, height) == 40);
    CHECK(sizeof(MoriSegment) == 24 && offsetof(MoriSegment, length) == 16);
    CHECK(offsetof(MoriKvBuffers, num_buffers) == 2 * sizeof(void *));
    CHECK(offsetof(MoriSendOptions, stream) == 8);
    CHECK(MORI_TP_ACTION_NOT_PAIRED == 0 && MORI_TP_ACTION_SEND == 1 && MORI_TP_ACTION_SKIP_REPLICA == 2);
    CHECK(MORI_BACKEND_AUTO == 0 && MORI_BACKEND_HOST == 1 && MORI_BACKEND_HIP == 2);
    CHECK(MORI_SEND_SYNCHRONIZE == 1 && MORI_SEND_COPY_KERNEL == 2);
    CHECK(MORI_TP_STAGING_NONE == 0 && MORI_TP_STAGING_SRC == 1 && MORI_TP_STAGING_DST == 2 &&
          MORI_TP_STAGING_BOTH == 3);
    CHECK(sizeof(MoriTpStaging) == 4);
    CHECK(MORI_OK == 0 && MORI_ERR_PANIC == 10);
    CHECK(mori_abi_version() == MORI_TP_ABI_VERSION);
    CHECK(strlen(mori_version()) > 0);
    CHECK(strcmp(mori_status_str(MORI_ERR_GPU), "MORI_ERR_GPU") == 0);
    CHECK(strcmp(mori_status_str(1234), "MORI_ERR_UNKNOWN") == 0);
}

/* 4 KV heads of 32 bytes, prefill TP 2 (2 heads per rank), decode TP 8 (each head on 2 ranks),
 * page size 4, 2 layers x (K, V): a layout where the seed formula sends the wrong heads. */
enum { H = 4, P = 2, D = 8, BPH = 32, PAGE = 4, BUFS = 4, SRC_PAGES = 10, DST_PAGES = 12, REQ = 6 };
#define SRC_ITEM ((uint64_t)PAGE * (H / P) * BPH)
#define DST_ITEM ((uint64_t)PAGE * 1 * BPH)

static uint8_t head_byte(int buffer, int page, int token, int head, int byte) {
    return (uint8_t)(buffer * 53 + page * 29 + token * 11 + head * 97 + byte * 3 + 1);
}

/* What an RDMA engine does with mori_tp_plan_transfer's list: for every buffer, every segment,
 * from the buffer's base on each side (its page buffer, or its part of a staging region). */
static void transport(const MoriSegment *segments, size_t n, const uint8_t *const *from,
                      uint8_t *const *to) {
    size_t b, i;
    for (b = 0; b < BUFS; b++)
        for (i = 0; i < n; i++)
            memcpy(to[b] + segments[i].dst_offset, from[b] + segments[i].src_offset, segments[i].length);
}

/* The staged path for one pair: staging_for's mode; pack, transport, unpack. */
static void staged_send(const MoriTpSliceConfig *config, const void *const *srcs, void *const *dsts,
                        uint64_t src_capacity, uint64_t dst_capacity, const int32_t *src_pages,
                        const int32_t *dst_pages) {
    static uint8_t src_staging[BUFS * REQ * PAGE * BPH], dst_staging[BUFS * REQ * PAGE * BPH];
    const MoriSendOptions host = {MORI_BACKEND_HOST, 0, NULL};
    uint32_t staging = 99;
    uint64_t len = 0;
    MoriSegment segments[REQ * PAGE];
    size_t n = 0, b;
    const uint8_t *from[BUFS];
    uint8_t *to[BUFS];

    EXPECT(mori_tp_staging_for(config, &staging), MORI_OK, NULL);
    EXPECT(mori_tp_staging_len(config, REQ, &len), MORI_OK, NULL);
    if (config->action == MORI_TP_ACTION_SEND) {
        /* 2 heads on a prefill token, 1 on a decode token: only the prefill side is wider. */
        CHECK(staging == MORI_TP_STAGING_SRC);
        CHECK(len == (uint64_t)REQ * PAGE * BPH);
    } else {
        CHECK(staging == MORI_TP_STAGING_NONE && len == 0);
    }
    if (staging == MORI_TP_STAGING_SRC || staging == MORI_TP_STAGING_BOTH)
        EXPECT(mori_pack_kvcache(config, srcs, BUFS, src_capacity, src_pages, REQ, src_staging,
                                 sizeof src_staging, &host),
               MORI_OK, NULL);
    EXPECT(mori_tp_plan_transfer(config, staging, src_pages, dst_pages, REQ, segments, REQ * PAGE, &n),
           MORI_OK, NULL);
    if (config->action == MORI_TP_ACTION_SEND)
        CHECK(n == 3); /* one per run of decode pages, instead of one per token */
    for (b = 0; b < BUFS; b++) {
        from[b] = (staging == MORI_TP_STAGING_SRC || staging == MORI_TP_STAGING_BOTH)
                      ? src_staging + b * len
                      : (const uint8_t *)srcs[b];
        to[b] = (staging == MORI_TP_STAGING_DST || staging == MORI_TP_STAGING_BOTH)
                    ? dst_staging + b * len
                    : (uint8_t *)dsts[b];
    }
    transport(segments, n, from, to);
    if (staging == MORI_TP_STAGING_DST || staging == MORI_TP_STAGING_BOTH)
        EXPECT(mori_unpack_kvcache(config, dst_staging, sizeof dst_staging, dsts, BUFS, dst_capacity,
                                   dst_pages, REQ, &host),
               MORI_OK, NULL);
}

static void full_transfer(void) {
    /* Runs: 7,8,9 -> 1,2,3 | 0 -> 11 | 4,5 -> 6,7 */
    const int32_t src_pages[REQ] = {7, 8, 9, 0, 4, 5};
    const int32_t dst_pages[REQ] = {1, 2, 3, 11, 6, 7};
    static uint8_t src[P][BUFS][SRC_PAGES * SRC_ITEM];
    static uint8_t dst[D][BUFS][DST_PAGES * DST_ITEM];
    static uint8_t staged[D][BUFS][DST_PAGES * DST_ITEM];
    int p, d, b, i, k;
    size_t rects_total = 0;

    for (p = 0; p < P; p++)
        for (b = 0; b < BUFS; b++)
            for (i = 0; i < (int)(SRC_PAGES * SRC_ITEM); i++) {
                int page = i / (int)SRC_ITEM, token = (i % (int)SRC_ITEM) / (2 * BPH);
                int head = p * 2 + (i % (2 * BPH)) / BPH;
                src[p][b][i] = head_byte(b, page, token, head, i % BPH);
            }
    memset(dst, 0xEE, sizeof dst);
    memset(staged, 0xEE, sizeof staged);

    for (p = 0; p < P; p++) {
        for (d = 0; d < D; d++) {
            MoriTpSliceParams params = {P, 0, D, 0, H, PAGE, SRC_ITEM, DST_ITEM};
            MoriTpSliceConfig config;
            const void *srcs[BUFS];
            void *dsts[BUFS];
            MoriKvBuffers buffers;
            MoriSendOptions options = {MORI_BACKEND_HOST, MORI_SEND_SYNCHRONIZE, NULL};
            size_t n = 0, n_seg = 0;
            MoriCopyRect rects[REQ];
            MoriSegment segments[REQ * PAGE];

            params.prefill_tp_rank = (uint32_t)p;
            params.decode_tp_rank = (uint32_t)d;
            EXPECT(mori_tp_slice_config(&params, &config), MORI_OK, NULL);
            /* decode rank d owns head d/2, which prefill rank d/4 holds at slot (d/2)%2 */
            if (p == d / 4) {
                CHECK(config.action == MORI_TP_ACTION_SEND);
                CHECK(config.first_head == (uint32_t)(d / 2) && config.num_heads == 1);
                CHECK(config.src_head_slice_offset == (uint64_t)((d / 2) % 2) * BPH);
                CHECK(config.dst_head_slice_offset == 0);
                CHECK(config.heads_bytes_per_token_to_send == BPH);
            } else {
                CHECK(config.action == MORI_TP_ACTION_NOT_PAIRED);
            }

            EXPECT(mori_tp_plan(&config, src_pages, dst_pages, REQ, NULL, 0, &n),
                   config.action == MORI_TP_ACTION_SEND ? MORI_ERR_BUFFER_TOO_SMALL : MORI_OK, NULL);
            EXPECT(mori_tp_plan(&config, src_pages, dst_pages, REQ, rects, REQ, &n), MORI_OK, NULL);
            EXPECT(mori_tp_plan_segments(&config, src_pages, dst_pages, REQ, segments, REQ * PAGE, &n_seg),
                   MORI_OK, NULL);
            if (config.action == MORI_TP_ACTION_SEND) {
                CHECK(n == 3);
                CHECK(rects[0].src_offset == 7 * SRC_ITEM + config.src_head_slice_offset);
                CHECK(rects[0].dst_offset == 1 * DST_ITEM && rects[0].height == 3 * PAGE);
                CHECK(rects[0].src_pitch == 2 * BPH && rects[0].dst_pitch == BPH);
                /* the decode token is exactly the slice: contiguous only on that side, so rows */
                CHECK(n_seg == REQ * PAGE);
                CHECK(segments[1].src_offset == rects[0].src_offset + 2 * BPH);
                CHECK(segments[1].dst_offset == rects[0].dst_offset + BPH && segments[1].length == BPH);
            } else {
                CHECK(n == 0 && n_seg == 0);
            }
            rects_total += n;

            for (b = 0; b < BUFS; b++) {
                srcs[b] = src[p][b];
                dsts[b] = dst[d][b];
            }
            buffers.src = srcs;
            buffers.dst = dsts;
            buffers.num_buffers = BUFS;
            buffers.src_capacity = sizeof src[p][0];
            buffers.dst_capacity = sizeof dst[d][0];
            EXPECT(mori_send_kvcache(&config, &buffers, src_pages, dst_pages, REQ, &options), MORI_OK, NULL);
            for (b = 0; b < BUFS; b++)
                dsts[b] = staged[d][b];
            staged_send(&config, srcs, dsts, sizeof src[p][0], sizeof staged[d][0], src_pages, dst_pages);
        }
    }
    /* The staged path leaves every decode byte exactly as the direct one. */
    CHECK(memcmp(staged, dst, sizeof dst) == 0);
    CHECK(rects_total == 3 * D);

    for (d = 0; d < D; d++)
        for (b = 0; b < BUFS; b++)
            for (i = 0; i < (int)(DST_PAGES * DST_ITEM); i++) {
                int page = i / (int)DST_ITEM, token = (i % (int)DST_ITEM) / BPH;
                uint8_t want = 0xEE;
                for (k = 0; k < REQ; k++)
                    if (dst_pages[k] == page)
                        want = head_byte(b, src_pages[k], token, d / 2, i % BPH);
                if (dst[d][b][i] != want) {
                    fprintf(stderr, "decode rank %d buffer %d byte %d: %u != %u\n", d, b, i,
                            dst[d][b][i], want);
                    failures++;
                    return;
                }
            }
}

static void refusals(void) {
    MoriTpSliceParams good = {2, 1, 8, 3, 4, 4, SRC_ITEM, DST_ITEM};
    MoriTpSliceParams bad;
    MoriTpSliceConfig config, edited;
    const int32_t pages[2] = {0, 1};
    const int32_t negative[2] = {0, -5};
    const int32_t far[2] = {0, 12};
    uint8_t srcbuf[SRC_PAGES * SRC_ITEM], dstbuf[DST_PAGES * DST_ITEM], before[sizeof dstbuf];
    const void *srcs[1];
    void *dsts[1];
    MoriKvBuffers buffers;
    MoriSendOptions hip = {MORI_BACKEND_HIP, 0, NULL};
    MoriCopyRect rects[1];
    size_t n = 0;

    memset(srcbuf, 1, sizeof srcbuf);
    memset(dstbuf, 2, sizeof dstbuf);
    memcpy(before, dstbuf, sizeof dstbuf);
    srcs[0] = srcbuf;
    dsts[0] = dstbuf;
    buffers.src = srcs;
    buffers.dst = dsts;
    buffers.num_buffers = 1;
    buffers.src_capacity = sizeof srcbuf;
    buffers.dst_capacity = sizeof dstbuf;

    good.prefill_tp_rank = 0; /* decode rank 3 owns head 1, held by prefill rank 0 */
    EXPECT(mori_tp_slice_config(&good, &config), MORI_OK, NULL);
    CHECK(config.action == MORI_TP_ACTION_SEND);

    EXPECT(mori_tp_slice_config(NULL, &config), MORI_ERR_NULL_POINTER, "params is NULL");
    bad = good;
    bad.decode_tp_rank = 8;
    EXPECT(mori_tp_slice_config(&bad, &config), MORI_ERR_INVALID_ARGUMENT, "tp_rank 8");
    bad = good;
    bad.prefill_tp_size = 3;
    EXPECT(mori_tp_slice_config(&bad, &config), MORI_ERR_TOPOLOGY, "tp_size 3 and total_kv_heads 4");
    bad = good;
    bad.dst_item_len = DST_ITEM / 2; /* fp8 on the decode side against bf16 */
    EXPECT(mori_tp_slice_config(&bad, &config), MORI_ERR_LAYOUT_MISMATCH,
           "bytes_per_head 16 != prefill side bytes_per_head 32");
    edited = config;
    edited.heads_bytes_per_token_to_send = 2 * BPH; /* wider than the 32-byte decode token */
    edited.num_heads = 2;
    EXPECT(mori_send_kvcache(&edited, &buffers, pages, pages, 2, NULL), MORI_ERR_SLICE_OVERFLOW,
           "offset 32 of width 64 ends past the 64-byte token slot");
    EXPECT(mori_send_kvcache(&config, &buffers, negative, pages, 2, NULL), MORI_ERR_OUT_OF_BOUNDS,
           "page index -5 at position 1 is negative");
    EXPECT(mori_send_kvcache(&config, &buffers, pages, far, 2, NULL), MORI_ERR_OUT_OF_BOUNDS,
           "page 12 at position 1");
    EXPECT(mori_tp_plan(&config, pages, pages, 2, rects, 0, &n), MORI_ERR_BUFFER_TOO_SMALL, "needs 1 entries");
    CHECK(n == 1);
    {
        /* A staging region one byte short, an unknown staging value. */
        uint8_t staging[2 * PAGE * BPH];
        uint64_t len = 0;
        memset(staging, 7, sizeof staging);
        EXPECT(mori_tp_staging_len(&config, 2, &len), MORI_OK, NULL);
        CHECK(len == sizeof staging);
        EXPECT(mori_pack_kvcache(&config, srcs, 1, sizeof srcbuf, pages, 2, staging, len - 1, NULL),
               MORI_ERR_BUFFER_TOO_SMALL, "staging_capacity 255 is below the 256 bytes");
        CHECK(staging[0] == 7 && staging[sizeof staging - 2] == 7);
        EXPECT(mori_unpack_kvcache(&config, staging, len, dsts, 1, sizeof dstbuf, far, 2, NULL),
               MORI_ERR_OUT_OF_BOUNDS, "page 12 at position 1");
        EXPECT(mori_tp_plan_transfer(&config, 4, pages, pages, 2, NULL, 0, &n), MORI_ERR_INVALID_ARGUMENT,
               "staging 4 is not a MoriTpStaging");
    }
    CHECK(memcmp(before, dstbuf, sizeof dstbuf) == 0); /* every refusal above wrote nothing */
    {
        /* HIP is a refusal unless the library is built with it and a device is present; then host
         * memory is legal for hipMemcpyDefault and the copy lands. */
        MoriStatus status = mori_send_kvcache(&config, &buffers, pages, pages, 2, &hip);
        if (status == MORI_OK) {
            printf("abi_test.c: a HIP device is present; MORI_BACKEND_HIP copied host memory\n");
            CHECK(memcmp(before, dstbuf, sizeof dstbuf) != 0);
        } else {
            EXPECT(status, MORI_ERR_BACKEND_UNAVAILABLE, "backend unavailable");
            CHECK(memcmp(before, dstbuf, sizeof dstbuf) == 0);
        }
    }
}

/* ---- any layout: HND prefill TP 8 (page 4) -> NHD decode TP 2 (page 8), 8 heads ------------ */
#define LH 8
#define LHB 4  /* bytes of one head */
#define LN 13u /* tokens: 4 prefill pages (the last partial), 2 decode pages (the last partial) */
#define LSRC_PAGES 6
#define LDST_PAGES 3

/* Where local head j of slot t of page p lies in a layout. */
static uint64_t element(const MoriTpLayout *l, uint64_t p, uint64_t t, uint64_t j) {
    return p * l->page_stride + l->offset + t * l->token_stride + j * l->head_stride;
}

static void layouts(void) {
    MoriTpLayout src, dst, bad;
    MoriTpPairConfig config, edited;
    MoriTpRequest request;
    const int32_t src_pages[4] = {5, 0, 1, 3};
    const int32_t dst_pages[2] = {2, 0};
    uint8_t srcbuf[2][LSRC_PAGES * 4 * LHB], dstbuf[2][LDST_PAGES * 8 * 4 * LHB];
    uint8_t want[2][sizeof dstbuf[0]], staged[2][sizeof dstbuf[0]];
    uint8_t src_region[2 * LN * LHB], dst_region[2 * LN * LHB];
    const void *srcs[2];
    void *dsts[2], *sdsts[2];
    MoriKvBuffers buffers;
    MoriSegment segments[64];
    MoriCopyRect rects[64];
    MoriTpMemory prefill_memory, decode_memory;
    size_t n_seg = 0, n_rect = 0, i, b;
    uint32_t staging = 99, k, j;
    uint64_t len = 0;
    int d;

    CHECK(sizeof(MoriTpLayout) == 56 && offsetof(MoriTpLayout, head_bytes) == 16 &&
          offsetof(MoriTpLayout, head_stride) == 48);
    CHECK(sizeof(MoriTpPairConfig) == 136 && offsetof(MoriTpPairConfig, src) == 24 &&
          offsetof(MoriTpPairConfig, dst) == 80);
    CHECK(offsetof(MoriTpRequest, num_tokens) == 4 * sizeof(void *));
    CHECK(offsetof(MoriTpMemory, staging_capacity) == 16);

    /* HND on the prefill rank: one local head, so a page is its 4 slots of that head. */
    EXPECT(mori_tp_layout_hnd(LH, 8, 5, 4, LHB, &src), MORI_OK, NULL);
    CHECK(src.token_stride == LHB && src.head_stride == 4 * LHB && src.page_stride == 4 * LHB);
    /* NHD on decode rank 1 of 2: heads 4..7, 4 local heads. */
    EXPECT(mori_tp_layout_nhd(LH, 2, 1, 8, LHB, &dst), MORI_OK, NULL);
    CHECK(dst.head_stride == LHB && dst.token_stride == 4 * LHB && dst.page_stride == 8 * 4 * LHB);
    EXPECT(mori_tp_pair_config(&src, &dst, &config), MORI_OK, NULL);
    CHECK(config.action == MORI_TP_ACTION_SEND && config.first_head == 5 && config.num_heads == 1);
    CHECK(config.src_first_local == 0 && config.dst_first_local == 1 && config.reserved == 0);

    request.src_pages = src_pages;
    request.num_src_pages = 4;
    request.dst_pages = dst_pages;
    request.num_dst_pages = 2;
    request.num_tokens = LN;

    for (b = 0; b < 2; b++) {
        for (i = 0; i < sizeof srcbuf[b]; i++)
            srcbuf[b][i] = (uint8_t)(b * 97 + i * 7 + 1);
        memset(dstbuf[b], 0xEE, sizeof dstbuf[b]);
        memset(staged[b], 0xEE, sizeof staged[b]);
        memset(want[b], 0xEE, sizeof want[b]);
        /* The oracle: element by element. */
        for (k = 0; k < LN; k++)
            for (j = 0; j < config.num_heads; j++) {
                uint64_t from = element(&src, (uint64_t)src_pages[k / 4], k % 4, config.src_first_local + j);
                uint64_t to = element(&dst, (uint64_t)dst_pages[k / 8], k % 8, config.dst_first_local + j);
                memcpy(&want[b][to], &srcbuf[b][from], LHB);
            }
        srcs[b] = srcbuf[b];
        dsts[b] = dstbuf[b];
        sdsts[b] = staged[b];
    }
    buffers.src = srcs;
    buffers.dst = dsts;
    buffers.num_buffers = 2;
    buffers.src_capacity = sizeof srcbuf[0];
    buffers.dst_capacity = sizeof dstbuf[0];
    EXPECT(mori_send_kvcache_pair(&config, &buffers, &request, NULL), MORI_OK, NULL);
    CHECK(memcmp(dstbuf, want, sizeof want) == 0);

    /* Segments: the prefill head's slots are back to back within a page, the decode head's are
     * a token apart, so a segment is one token (13), in token-major order. */
    EXPECT(mori_tp_pair_segments(&config, &request, MORI_TP_STAGING_NONE, NULL, 0, &n_seg),
           MORI_ERR_BUFFER_TOO_SMALL, NULL);
    CHECK(n_seg == 13);
    EXPECT(mori_tp_pair_segments(&config, &request, MORI_TP_STAGING_NONE, segments, 64, &n_seg), MORI_OK,
           NULL);
    CHECK(n_seg == LN && segments[0].src_offset == 5 * src.page_stride && segments[0].length == LHB);
    CHECK(segments[0].dst_offset == 2 * dst.page_stride + LHB);
    EXPECT(mori_tp_pair_plan(&config, &request, rects, 64, &n_rect), MORI_OK, NULL);
    CHECK(n_rect >= 1 && n_rect <= n_seg);
    CHECK(rects[0].width == LHB && rects[0].src_pitch == LHB && rects[0].dst_pitch == 4 * LHB);

    /* The decode side is wider than the slice, the prefill side full: DST staging, whose region
     * is head-major in chunks of the prefill page (4 tokens), so each prefill page run is one
     * segment. */
    EXPECT(mori_tp_pair_staging_for(&config, &staging), MORI_OK, NULL);
    CHECK(staging == MORI_TP_STAGING_DST);
    EXPECT(mori_tp_pair_staging_len(&config, LN, &len), MORI_OK, NULL);
    CHECK(len == LN * LHB);
    prefill_memory.num_buffers = 2;
    prefill_memory.capacity = sizeof srcbuf[0];
    prefill_memory.staging_capacity = 0;
    decode_memory.num_buffers = 2;
    decode_memory.capacity = sizeof dstbuf[0];
    decode_memory.staging_capacity = 2 * len;
    EXPECT(mori_tp_check_pair_transfer(&config, &request, staging, &prefill_memory, &decode_memory),
           MORI_OK, NULL);
    EXPECT(mori_tp_pair_segments(&config, &request, staging, segments, 64, &n_seg), MORI_OK, NULL);
    CHECK(n_seg == 3); /* pages 5 | 0, 1 | 3 */
    /* Every mode: pack if the prefill side is staged, every segment of every buffer, unpack if
     * the decode side is: the decode bytes must equal the direct send's. */
    for (d = 0; d < 4; d++) {
        uint32_t mode = (uint32_t)d;
        int pack = mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH;
        int unpack = mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH;
        for (b = 0; b < 2; b++)
            memset(staged[b], 0xEE, sizeof staged[b]);
        if (pack)
            EXPECT(mori_pack_kvcache_pair(&config, mode, srcs, 2, sizeof srcbuf[0], &request, src_region,
                                          sizeof src_region, NULL),
                   MORI_OK, NULL);
        EXPECT(mori_tp_pair_segments(&config, &request, mode, segments, 64, &n_seg), MORI_OK, NULL);
        for (b = 0; b < 2; b++)
            for (i = 0; i < n_seg; i++) {
                const uint8_t *from = pack ? src_region + b * len : srcbuf[b];
                uint8_t *to = unpack ? dst_region + b * len : staged[b];
                memcpy(to + segments[i].dst_offset, from + segments[i].src_offset, segments[i].length);
            }
        if (unpack)
            EXPECT(mori_unpack_kvcache_pair(&config, mode, dst_region, sizeof dst_region, sdsts, 2,
                                            sizeof staged[0], &request, NULL),
                   MORI_OK, NULL);
        if (memcmp(staged, want, sizeof want) != 0) {
            fprintf(stderr, "layouts: staging mode %u differs from the direct send\n", mode);
            failures++;
        }
    }

    /* Refusals: each names its values and writes nothing. */
    memcpy(staged, dstbuf, sizeof staged);
    EXPECT(mori_tp_layout_nhd(LH, 2, 1, 8, 2 * LHB, &bad), MORI_OK, NULL); /* fp32 against fp16 */
    EXPECT(mori_tp_pair_config(&src, &bad, &edited), MORI_ERR_LAYOUT_MISMATCH,
           "head_bytes 8 != prefill side head_bytes 4");
    bad = dst;
    bad.page_stride = dst.page_stride - 1;
    EXPECT(mori_tp_pair_config(&src, &bad, &edited), MORI_ERR_LAYOUT_MISMATCH, "past page_stride");
    edited = config;
    edited.reserved = 3;
    EXPECT(mori_send_kvcache_pair(&edited, &buffers, &request, NULL), MORI_ERR_INVALID_ARGUMENT, "reserved 3");
    request.num_src_pages = 3;
    EXPECT(mori_send_kvcache_pair(&config, &buffers, &request, NULL), MORI_ERR_INVALID_ARGUMENT,
           "prefill side: 3 pages for 13 tokens of page_size 4");
    request.num_src_pages = 4;
    EXPECT(mori_pack_kvcache_pair(&config, MORI_TP_STAGING_DST, srcs, 2, sizeof srcbuf[0], &request,
                                  src_region, sizeof src_region, NULL),
           MORI_ERR_INVALID_ARGUMENT, "pack takes staging mode SRC or BOTH");
    EXPECT(mori_unpack_kvcache_pair(&config, MORI_TP_STAGING_DST, dst_region, 2 * len - 1, dsts, 2,
                                    sizeof dstbuf[0], &request, NULL),
           MORI_ERR_BUFFER_TOO_SMALL, "staging_capacity 103 is below the 104 bytes");
    buffers.dst_capacity = 2 * dst.page_stride; /* decode page 2 ends past it */
    EXPECT(mori_send_kvcache_pair(&config, &buffers, &request, NULL), MORI_ERR_OUT_OF_BOUNDS,
           "decode side: page 2 at position 0");
    CHECK(memcmp(staged, dstbuf, sizeof staged) == 0);
}

/* A staging pool from C: slots inside the region, full, misuse, a dead handle. */
static void staging_pool(void) {
    MoriTpPoolOptions options = {1u << 20, 65536, MORI_TP_POOL_HOST, 0};
    MoriTpPool pool = 0;
    MoriTpSlot a, b;
    MoriTpPoolInfo info;
    CHECK(sizeof(MoriTpPool) == 8 && sizeof(MoriTpPoolOptions) == 24);
    CHECK(sizeof(MoriTpSlot) == 24 && sizeof(MoriTpPoolInfo) == 80);
    EXPECT(mori_tp_pool_create(&options, &pool), MORI_OK, NULL);
    EXPECT(mori_tp_pool_info(pool, &info), MORI_OK, NULL);
    CHECK(info.capacity == (1u << 20) && info.min_slot == 65536 && info.memory == MORI_TP_POOL_HOST);
    EXPECT(mori_tp_pool_try_alloc(pool, 100000, &a), MORI_OK, NULL);
    CHECK(a.size == 131072 && (char *)a.address == (char *)info.base + a.offset);
    memset(a.address, 0x5a, (size_t)a.size);
    EXPECT(mori_tp_pool_alloc(pool, 950000, 0, &b), MORI_ERR_POOL_FULL, "staging pool full");
    EXPECT(mori_tp_pool_try_alloc(pool, 950000, &b), MORI_ERR_POOL_FULL, "staging pool full");
    EXPECT(mori_tp_pool_try_alloc(pool, 2u << 20, &b), MORI_ERR_BUFFER_TOO_SMALL, "can never be granted");
    EXPECT(mori_tp_pool_free(pool, a.offset + 1), MORI_ERR_INVALID_ARGUMENT, "inside the live slot");
    EXPECT(mori_tp_pool_destroy(pool), MORI_ERR_INVALID_ARGUMENT, "still allocated");
    EXPECT(mori_tp_pool_free(pool, a.offset), MORI_OK, NULL);
    EXPECT(mori_tp_pool_free(pool, a.offset), MORI_ERR_INVALID_ARGUMENT, "double free");
    EXPECT(mori_tp_pool_destroy(pool), MORI_OK, NULL);
    EXPECT(mori_tp_pool_try_alloc(pool, 1, &b), MORI_ERR_INVALID_ARGUMENT, "not a live staging pool");
}

/* A request of four groups between prefill TP 1 and decode rank 1 of TP 2: full-attention KV
 * (4 heads, HND, pages of 4 -> 8, 10 tokens, K and V); a 12-byte per-token record every rank
 * holds whole (H = 1, its own buffer); and two parts of one per-request state slot (40 bytes
 * a slot, slot 1 -> 2), x split by its 4 heads of 6 bytes and B, one 4-byte group every rank
 * holds, after x. Everything is checked against a loop over every element. */
#define GN 10u
static void group_layout(uint32_t h, uint32_t tp, uint32_t rank, uint32_t ps, uint64_t hb,
                         uint64_t page_stride, uint64_t offset, MoriTpLayout *out) {
    out->total_kv_heads = h;
    out->tp_size = tp;
    out->tp_rank = rank;
    out->page_size = ps;
    out->head_bytes = hb;
    out->page_stride = page_stride;
    out->offset = offset;
    out->token_stride = hb;
    out->head_stride = hb;
}

static void groups(void) {
    MoriTpLayout src[4], dst[4];
    MoriTpGroup g[4];
    MoriTpGroupInfo info[4];
    MoriTpGroupsTotal total;
    MoriTpLayerRange layers;
    static const int32_t kv_src[3] = {2, 0, 1}, kv_dst[2] = {1, 0};
    static const int32_t rec_src[3] = {0, 2, 1}, rec_dst[3] = {1, 0, 3};
    static const int32_t slot_src[1] = {1}, slot_dst[1] = {2};
    static const uint32_t pp_prefill[2] = {3, 2}, pp_decode[1] = {5}, pp_bad[2] = {3, 3};
    /* Buffers: KV K and V (2), the record (1), the state slot (1), on each side. */
    uint8_t s_kv[2][3 * 4 * 4 * 4], d_kv[2][2 * 8 * 2 * 4], s_rec[3 * 4 * 12], d_rec[4 * 4 * 12];
    uint8_t s_slot[3 * 40], d_slot[3 * 40];
    uint8_t want_kv[2][sizeof d_kv[0]], want_rec[sizeof d_rec], want_slot[sizeof d_slot];
    uint8_t init_kv[2][sizeof d_kv[0]], init_rec[sizeof d_rec], init_slot[sizeof d_slot];
    uint8_t src_region[512], dst_region[512];
    const void *kv_s[2], *rec_s[1], *slot_s[1];
    void *kv_d[2], *rec_d[1], *slot_d[1];
    MoriSegment segments[128];
    size_t n = 0, i, b, x;
    int mode;

    CHECK(sizeof(MoriTpGroup) == 232 && offsetof(MoriTpGroup, staging) == 136 &&
          offsetof(MoriTpGroup, first_token) == 144 && offsetof(MoriTpGroup, request) == 152 &&
          offsetof(MoriTpGroup, buffers) == 192);
    CHECK(sizeof(MoriTpGroupInfo) == 40 && offsetof(MoriTpGroupInfo, dst_staging_offset) == 32);
    CHECK(sizeof(MoriTpGroupsTotal) == 40 && offsetof(MoriTpGroupsTotal, dst_staging_bytes) == 32);
    CHECK(sizeof(MoriTpLayerRange) == 16 && offsetof(MoriTpLayerRange, decode_first_local) == 12);

    EXPECT(mori_tp_layout_hnd(4, 1, 0, 4, 4, &src[0]), MORI_OK, NULL);
    EXPECT(mori_tp_layout_hnd(4, 2, 1, 8, 4, &dst[0]), MORI_OK, NULL);
    EXPECT(mori_tp_layout_nhd(1, 1, 0, 4, 12, &src[1]), MORI_OK, NULL);
    EXPECT(mori_tp_layout_nhd(1, 2, 1, 4, 12, &dst[1]), MORI_OK, NULL);
    group_layout(4, 1, 0, 1, 6, 40, 0, &src[2]);      /* x: 4 local heads */
    group_layout(4, 2, 1, 1, 6, 40, 0, &dst[2]);      /* x: heads 2 and 3 */
    group_layout(1, 1, 0, 1, 4, 40, 4 * 6, &src[3]);  /* B after x's 24 bytes */
    group_layout(1, 2, 1, 1, 4, 40, 2 * 6, &dst[3]);  /* B after x's 12 bytes */
    memset(g, 0, sizeof g);
    for (i = 0; i < 4; i++)
        EXPECT(mori_tp_pair_config(&src[i], &dst[i], &g[i].config), MORI_OK, NULL);
    g[0].request.src_pages = kv_src;
    g[0].request.num_src_pages = 3;
    g[0].request.dst_pages = kv_dst;
    g[0].request.num_dst_pages = 2;
    g[1].request.src_pages = rec_src;
    g[1].request.num_src_pages = 3;
    g[1].request.dst_pages = rec_dst;
    g[1].request.num_dst_pages = 3;
    for (i = 2; i < 4; i++) {
        g[i].request.src_pages = slot_src;
        g[i].request.num_src_pages = 1;
        g[i].request.dst_pages = slot_dst;
        g[i].request.num_dst_pages = 1;
        g[i].request.num_tokens = 1;
    }
    g[0].request.num_tokens = g[1].request.num_tokens = GN;

    for (b = 0; b < 2; b++) {
        for (i = 0; i < sizeof s_kv[b]; i++) s_kv[b][i] = (uint8_t)(b * 31 + i * 7 + 3);
        for (i = 0; i < sizeof d_kv[b]; i++) init_kv[b][i] = (uint8_t)(b * 17 + i * 5 + 11);
        kv_s[b] = s_kv[b];
        kv_d[b] = d_kv[b];
    }
    for (i = 0; i < sizeof s_rec; i++) s_rec[i] = (uint8_t)(i * 13 + 1);
    for (i = 0; i < sizeof d_rec; i++) init_rec[i] = (uint8_t)(i * 3 + 2);
    for (i = 0; i < sizeof s_slot; i++) s_slot[i] = (uint8_t)(i * 11 + 5);
    for (i = 0; i < sizeof d_slot; i++) init_slot[i] = (uint8_t)(i * 19 + 9);
    rec_s[0] = s_rec;
    rec_d[0] = d_rec;
    slot_s[0] = s_slot;
    slot_d[0] = d_slot;
    g[0].buffers.src = kv_s;
    g[0].buffers.dst = kv_d;
    g[0].buffers.num_buffers = 2;
    g[0].buffers.src_capacity = sizeof s_kv[0];
    g[0].buffers.dst_capacity = sizeof d_kv[0];
    g[1].buffers.src = rec_s;
    g[1].buffers.dst = rec_d;
    g[1].buffers.num_buffers = 1;
    g[1].buffers.src_capacity = sizeof s_rec;
    g[1].buffers.dst_capacity = sizeof d_rec;
    for (i = 2; i < 4; i++) {
        g[i].buffers.src = slot_s;
        g[i].buffers.dst = slot_d;
        g[i].buffers.num_buffers = 1;
        g[i].buffers.src_capacity = sizeof s_slot;
        g[i].buffers.dst_capacity = sizeof d_slot;
    }

    /* The oracle, element by element. */
    memcpy(want_kv, init_kv, sizeof want_kv);
    memcpy(want_rec, init_rec, sizeof want_rec);
    memcpy(want_slot, init_slot, sizeof want_slot);
    for (b = 0; b < 2; b++)
        for (i = 0; i < GN; i++)
            for (x = 0; x < 2; x++) /* decode heads 2, 3 = prefill local heads 2, 3 */
                memcpy(&want_kv[b][element(&dst[0], (uint64_t)kv_dst[i / 8], i % 8, x)],
                       &s_kv[b][element(&src[0], (uint64_t)kv_src[i / 4], i % 4, 2 + x)], 4);
    for (i = 0; i < GN; i++)
        memcpy(&want_rec[element(&dst[1], (uint64_t)rec_dst[i / 4], i % 4, 0)],
               &s_rec[element(&src[1], (uint64_t)rec_src[i / 4], i % 4, 0)], 12);
    for (x = 0; x < 2; x++)
        memcpy(&want_slot[element(&dst[2], 2, 0, x)], &s_slot[element(&src[2], 1, 0, 2 + x)], 6);
    memcpy(&want_slot[element(&dst[3], 2, 0, 0)], &s_slot[element(&src[3], 1, 0, 0)], 4);

    /* Every group staged as the library chooses, then each mode forced on all of them. */
    for (mode = -1; mode < 4; mode++) {
        size_t want_first = 0;
        uint64_t src_off = 0, dst_off = 0;
        for (i = 0; i < 4; i++) {
            if (mode < 0)
                EXPECT(mori_tp_pair_staging_for(&g[i].config, &g[i].staging), MORI_OK, NULL);
            else
                g[i].staging = (uint32_t)mode;
        }
        memcpy(d_kv, init_kv, sizeof d_kv);
        memcpy(d_rec, init_rec, sizeof d_rec);
        memcpy(d_slot, init_slot, sizeof d_slot);
        EXPECT(mori_send_kvcache_groups(g, 4, NULL), MORI_OK, NULL);
        CHECK(memcmp(d_kv, want_kv, sizeof d_kv) == 0 && memcmp(d_rec, want_rec, sizeof d_rec) == 0 &&
              memcmp(d_slot, want_slot, sizeof d_slot) == 0);

        EXPECT(mori_tp_groups_info(g, 4, info, &total), MORI_OK, NULL);
        EXPECT(mori_tp_groups_segments(g, 4, NULL, 0, &n), MORI_ERR_BUFFER_TOO_SMALL, NULL);
        CHECK(n == total.num_segments && n <= 128);
        EXPECT(mori_tp_groups_segments(g, 4, segments, 128, &n), MORI_OK, NULL);
        for (i = 0; i < 4; i++) {
            uint64_t bytes = info[i].staging_len * g[i].buffers.num_buffers;
            int packs = g[i].staging == MORI_TP_STAGING_SRC || g[i].staging == MORI_TP_STAGING_BOTH;
            int unpacks = g[i].staging == MORI_TP_STAGING_DST || g[i].staging == MORI_TP_STAGING_BOTH;
            CHECK(info[i].first_segment == want_first);
            CHECK(info[i].src_staging_offset == (packs ? src_off : 0));
            CHECK(info[i].dst_staging_offset == (unpacks ? dst_off : 0));
            want_first += info[i].num_segments;
            src_off += packs ? bytes : 0;
            dst_off += unpacks ? bytes : 0;
        }
        CHECK(info[0].staging_len == GN * 2 * 4 && info[1].staging_len == GN * 12);
        CHECK(info[2].staging_len == 2 * 6 && info[3].staging_len == 4);
        CHECK(total.src_staging_bytes == src_off && total.dst_staging_bytes == dst_off);
        CHECK(total.bytes == 2 * GN * 8 + GN * 12 + 12 + 4);
        EXPECT(mori_tp_check_groups_transfer(g, 4, src_off, dst_off), MORI_OK, NULL);

        /* Pack, every group's segments on each of its buffers, unpack. */
        memcpy(d_kv, init_kv, sizeof d_kv);
        memcpy(d_rec, init_rec, sizeof d_rec);
        memcpy(d_slot, init_slot, sizeof d_slot);
        EXPECT(mori_pack_kvcache_groups(g, 4, src_region, sizeof src_region, NULL), MORI_OK, NULL);
        for (i = 0; i < 4; i++) {
            int packs = g[i].staging == MORI_TP_STAGING_SRC || g[i].staging == MORI_TP_STAGING_BOTH;
            int unpacks = g[i].staging == MORI_TP_STAGING_DST || g[i].staging == MORI_TP_STAGING_BOTH;
            for (b = 0; b < g[i].buffers.num_buffers; b++)
                for (x = info[i].first_segment; x < info[i].first_segment + info[i].num_segments; x++) {
                    uint64_t part = b * info[i].staging_len;
                    const uint8_t *from = packs ? src_region + info[i].src_staging_offset + part
                                                : (const uint8_t *)g[i].buffers.src[b];
                    uint8_t *to = unpacks ? dst_region + info[i].dst_staging_offset + part
                                          : (uint8_t *)g[i].buffers.dst[b];
                    memcpy(to + segments[x].dst_offset, from + segments[x].src_offset, segments[x].length);
                }
        }
        EXPECT(mori_unpack_kvcache_groups(g, 4, dst_region, sizeof dst_region, NULL), MORI_OK, NULL);
        if (memcmp(d_kv, want_kv, sizeof d_kv) != 0 || memcmp(d_rec, want_rec, sizeof d_rec) != 0 ||
            memcmp(d_slot, want_slot, sizeof d_slot) != 0) {
            fprintf(stderr, "groups: staging mode %d differs from the oracle\n", mode);
            failures++;
        }
    }

    /* Refusals name the group and write nothing. */
    memcpy(d_kv, init_kv, sizeof d_kv);
    g[0].first_token = 4; /* a window must start on both pages: 4 and 8 */
    EXPECT(mori_send_kvcache_groups(g, 4, NULL), MORI_ERR_INVALID_ARGUMENT,
           "group 0: first_token 4 is not a multiple of both page sizes (prefill page_size 4, decode "
           "page_size 8)");
    g[0].first_token = 8;
    g[3].buffers.dst = NULL;
    EXPECT(mori_send_kvcache_groups(g, 4, NULL), MORI_ERR_NULL_POINTER, "group 3: decode side");
    g[3].buffers.dst = slot_d;
    g[1].buffers.dst_capacity = 3 * 4 * 12; /* decode page 3 ends past it */
    EXPECT(mori_send_kvcache_groups(g, 4, NULL), MORI_ERR_OUT_OF_BOUNDS,
           "group 1: decode side: page 3 at position 2 ends at byte 192, past dst_capacity 144");
    CHECK(memcmp(d_kv, init_kv, sizeof d_kv) == 0);
    EXPECT(mori_tp_groups_info(NULL, 4, info, &total), MORI_ERR_NULL_POINTER, "groups is NULL");

    /* Pipeline parallelism: prefill stages of 3 and 2 layers into one decode stage of 5. */
    EXPECT(mori_tp_pp_layers(pp_prefill, 2, pp_decode, 1, 1, 0, &layers), MORI_OK, NULL);
    CHECK(layers.first_layer == 3 && layers.num_layers == 2 && layers.prefill_first_local == 0 &&
          layers.decode_first_local == 3);
    EXPECT(mori_tp_pp_layers(pp_bad, 2, pp_decode, 1, 0, 0, &layers), MORI_ERR_INVALID_ARGUMENT,
           "partition [3, 3] holds 6 layers but the decode partition [5] holds 5");
    CHECK(layers.first_layer == 3); /* written only on success */
}

int main(void) {
    check_layout();
    full_transfer();
    refusals();
    layouts();
    staging_pool();
    groups();
    if (failures != 0) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("abi_test.c: all checks passed (mori-tp %s, ABI %u)\n", mori_version(), mori_abi_version());
    return 0;
}
