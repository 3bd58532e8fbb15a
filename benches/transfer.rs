//! mori-tp against today's per-token approach and against memcpy, measured side by side in one
//! run. `cargo bench --bench transfer` runs everything (`-- '^plan/'` one group) and ends, after
//! a line `== results ==`, with Markdown tables of ratios computed from this run's estimates
//! only; `benches/regenerate` pastes them into BENCHMARKS.md, which explains them.
//!
//! Everything goes through the C ABI a runtime would call (`mori_tp::ffi`).

use std::ffi::c_void;
use std::hint::black_box;
use std::path::PathBuf;
use std::ptr::null_mut;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use mori_tp::ffi::*;
use mori_tp_testkit::{Request, Rng, RunLengths, fragmented_request};

// ---------------------------------------------------------------------------------------------
// Inputs

/// Page pairs for `pages` pages: one contiguous run, or runs of 1 to 16 pages in a shuffled order
/// with free pages between them on each side (what a paged allocator hands out under load), from
/// the generator the tests and the CLI share, seeded by the page count so every run plans the
/// same request.
fn request(pages: usize, fragmented: bool) -> Request {
    if !fragmented {
        let all: Vec<i32> = (0..pages as i32).collect();
        return Request {
            src_pages: all.clone(),
            dst_pages: all,
            src_capacity_pages: pages,
            dst_capacity_pages: pages,
        };
    }
    fragmented_request(pages as u64, pages, RunLengths::UpTo(16))
}

fn slice_config(params: &MoriTpSliceParams) -> MoriTpSliceConfig {
    let mut config = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_slice_config(params, &mut config) };
    assert_eq!(status, MORI_OK, "{params:?}");
    config
}

/// Llama-3.1-70B (8 KV heads, head_dim 128, bf16) from prefill TP 4 to decode TP 8: each decode
/// token takes one 256-byte head out of a 512-byte prefill token.
fn llama70b_config(page_size: u32) -> MoriTpSliceConfig {
    let bytes_per_head = 128 * 2;
    slice_config(&MoriTpSliceParams {
        prefill_tp_size: 4,
        prefill_tp_rank: 1,
        decode_tp_size: 8,
        decode_tp_rank: 3,
        total_kv_heads: 8,
        page_size,
        src_item_len: u64::from(page_size) * 2 * bytes_per_head,
        dst_item_len: u64::from(page_size) * bytes_per_head,
    })
}

// ---------------------------------------------------------------------------------------------
// Today's approach, written the way serving stacks build their transfer lists

/// One (src, dst, len) entry per page per token slot.
fn per_token_plan(config: &MoriTpSliceConfig, src: &[i32], dst: &[i32]) -> Vec<(u64, u64, u64)> {
    let tokens = config.page_size as usize;
    let mut out = Vec::with_capacity(src.len() * tokens);
    for (&s, &d) in src.iter().zip(dst) {
        let (s_page, d_page) = (
            s as u64 * config.src_item_len,
            d as u64 * config.dst_item_len,
        );
        for slot in 0..tokens as u64 {
            out.push((
                s_page + slot * config.bytes_per_token_src + config.src_head_slice_offset,
                d_page + slot * config.bytes_per_token_dst + config.dst_head_slice_offset,
                config.heads_bytes_per_token_to_send,
            ));
        }
    }
    out
}

/// Runs a plan function (`call(out, capacity, &mut out_len)`) into `out`, whose capacity must
/// hold the whole plan.
fn plan_into<T>(out: &mut Vec<T>, call: impl FnOnce(*mut T, usize, &mut usize) -> MoriStatus) {
    let mut len = 0;
    assert_eq!(call(out.as_mut_ptr(), out.capacity(), &mut len), MORI_OK);
    // SAFETY: the library initialised `len` entries of the capacity it was given.
    unsafe { out.set_len(len) };
}

fn plan_rects(config: &MoriTpSliceConfig, src: &[i32], dst: &[i32], out: &mut Vec<MoriCopyRect>) {
    // SAFETY: arrays valid for their lengths; out valid for its capacity.
    plan_into(out, |out, capacity, len| unsafe {
        mori_tp_plan(
            config,
            src.as_ptr(),
            dst.as_ptr(),
            src.len(),
            out,
            capacity,
            len,
        )
    });
}

fn plan_segments(config: &MoriTpSliceConfig, src: &[i32], dst: &[i32], out: &mut Vec<MoriSegment>) {
    // SAFETY: arrays valid for their lengths; out valid for its capacity.
    plan_into(out, |out, capacity, len| unsafe {
        mori_tp_plan_segments(
            config,
            src.as_ptr(),
            dst.as_ptr(),
            src.len(),
            out,
            capacity,
            len,
        )
    });
}

// ---------------------------------------------------------------------------------------------
// Benchmarks

fn bench_slice_config(c: &mut Criterion) {
    // Every rank pair of a mix of layouts: GQA, MLA, both sides replicated, non-integer ratio.
    let mut all = Vec::new();
    for (heads, p_tp, d_tp) in [
        (8, 2, 8),
        (8, 16, 4),
        (4, 2, 8),
        (1, 8, 16),
        (2, 6, 4),
        (12, 6, 4),
    ] {
        let per = |tp: u32| u64::from((heads / tp).max(1)) * 256 * 16;
        for p in 0..p_tp {
            for d in 0..d_tp {
                all.push(MoriTpSliceParams {
                    prefill_tp_size: p_tp,
                    prefill_tp_rank: p,
                    decode_tp_size: d_tp,
                    decode_tp_rank: d,
                    total_kv_heads: heads,
                    page_size: 16,
                    src_item_len: per(p_tp),
                    dst_item_len: per(d_tp),
                });
            }
        }
    }
    let mut group = c.benchmark_group("slice_config");
    group.throughput(Throughput::Elements(all.len() as u64));
    group.bench_function("mix_of_layouts", |b| {
        let mut out = MoriTpSliceConfig::default();
        b.iter(|| {
            for params in &all {
                // SAFETY: valid pointers.
                let status = unsafe { mori_tp_slice_config(params, &mut out) };
                black_box((status, &out));
            }
        })
    });
    group.finish();
}

/// (tokens, page size, fragmented)
const PLAN_CASES: [(usize, u32, bool); 8] = [
    (32 * 1024, 1, false),
    (32 * 1024, 1, true),
    (32 * 1024, 16, false),
    (32 * 1024, 16, true),
    (128 * 1024, 1, false),
    (128 * 1024, 1, true),
    (128 * 1024, 16, false),
    (128 * 1024, 16, true),
];

fn plan_case_name(tokens: usize, page_size: u32, fragmented: bool) -> String {
    let layout = if fragmented {
        "fragmented"
    } else {
        "contiguous"
    };
    format!("{}k_tokens/page{page_size}/{layout}", tokens / 1024)
}

fn bench_plans(c: &mut Criterion) {
    for (tokens, page_size, fragmented) in PLAN_CASES {
        let config = llama70b_config(page_size);
        let Request {
            src_pages: src,
            dst_pages: dst,
            ..
        } = request(tokens / page_size as usize, fragmented);
        let mut rects = Vec::with_capacity(src.len());
        let mut segments = Vec::with_capacity(tokens);
        let name = plan_case_name(tokens, page_size, fragmented);
        let mut group = c.benchmark_group(format!("plan/{name}"));
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function("mori_tp_plan", |b| {
            b.iter(|| plan_rects(&config, black_box(&src), &dst, &mut rects))
        });
        group.bench_function("mori_tp_plan_segments", |b| {
            b.iter(|| plan_segments(&config, black_box(&src), &dst, &mut segments))
        });
        group.bench_function("per_token", |b| {
            b.iter(|| black_box(per_token_plan(&config, black_box(&src), &dst)))
        });
        group.finish();
    }
}

/// The uniform configs of the pair comparison: Llama-3.1-70B's 8 KV heads of 256 bytes from
/// prefill TP 4 to decode TP `decode_tp` (8: a head out of every two, a segment per token; 4:
/// whole tokens, a segment per run of pages), as a slice config and as the NHD pair config that
/// describes the same ranks.
fn section4_pair(decode_tp: u32, page_size: u32) -> (MoriTpSliceConfig, MoriTpPairConfig) {
    let head_bytes = 256;
    let (p, d) = (1, if decode_tp == 8 { 3 } else { 1 });
    let local = |tp: u32| u64::from(8 / tp);
    let config = slice_config(&MoriTpSliceParams {
        prefill_tp_size: 4,
        prefill_tp_rank: p,
        decode_tp_size: decode_tp,
        decode_tp_rank: d,
        total_kv_heads: 8,
        page_size,
        src_item_len: u64::from(page_size) * local(4) * head_bytes,
        dst_item_len: u64::from(page_size) * local(decode_tp) * head_bytes,
    });
    let (mut src, mut dst) = (MoriTpLayout::default(), MoriTpLayout::default());
    let mut pair = MoriTpPairConfig::default();
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(
            mori_tp_layout_nhd(8, 4, p, page_size, head_bytes, &mut src),
            MORI_OK
        );
        assert_eq!(
            mori_tp_layout_nhd(8, decode_tp, d, page_size, head_bytes, &mut dst),
            MORI_OK
        );
        assert_eq!(mori_tp_pair_config(&src, &dst, &mut pair), MORI_OK);
    }
    (config, pair)
}

fn pair_segments(pair: &MoriTpPairConfig, request: &MoriTpRequest, out: &mut Vec<MoriSegment>) {
    // SAFETY: a valid config and request; out valid for its capacity.
    plan_into(out, |out, capacity, len| unsafe {
        mori_tp_pair_segments(pair, request, MORI_TP_STAGING_NONE, out, capacity, len)
    });
}

fn pair_plan(pair: &MoriTpPairConfig, request: &MoriTpRequest, out: &mut Vec<MoriCopyRect>) {
    // SAFETY: a valid config and request; out valid for its capacity.
    plan_into(out, |out, capacity, len| unsafe {
        mori_tp_pair_plan(pair, request, out, capacity, len)
    });
}

/// The shapes of the pair comparison: (name, decode TP).
const PAIR_SHAPES: [(&str, u32); 2] = [("per_token", 8), ("whole_token", 4)];

/// mori_tp_pair_segments against mori_tp_plan_segments on the same uniform requests: the
/// general generator (every order counted, the fewest chosen) must stay within 1.25x.
fn bench_pair_segments(c: &mut Criterion) {
    for (tokens, page_size, fragmented) in PLAN_CASES {
        for (shape, decode_tp) in PAIR_SHAPES {
            let (config, pair) = section4_pair(decode_tp, page_size);
            let Request {
                src_pages: src,
                dst_pages: dst,
                ..
            } = request(tokens / page_size as usize, fragmented);
            let r = MoriTpRequest {
                src_pages: src.as_ptr(),
                num_src_pages: src.len(),
                dst_pages: dst.as_ptr(),
                num_dst_pages: dst.len(),
                num_tokens: tokens as u64,
            };
            let mut out = Vec::with_capacity(tokens);
            let mut rects = Vec::with_capacity(tokens);
            let name = plan_case_name(tokens, page_size, fragmented);
            let mut group = c.benchmark_group(format!("pair/{shape}/{name}"));
            group.throughput(Throughput::Elements(tokens as u64));
            group.bench_function("mori_tp_plan_segments", |b| {
                b.iter(|| plan_segments(&config, black_box(&src), &dst, &mut out))
            });
            group.bench_function("mori_tp_pair_segments", |b| {
                b.iter(|| pair_segments(&pair, black_box(&r), &mut out))
            });
            group.bench_function("mori_tp_pair_plan", |b| {
                b.iter(|| pair_plan(&pair, black_box(&r), &mut rects))
            });
            group.finish();
        }
    }
}

/// The gapped-plan cases: (name, the two layouts for pages of `P` slots). Two pages per side,
/// 2 * P tokens; each plan has the same few rects at every P.
type GappedCase = (&'static str, fn(u32) -> [MoriTpLayout; 2]);

const GAPPED_CASES: [GappedCase; 2] = [
    // Two heads of 2 bytes, 4 apart, in slots of 8 (issue 37's request): a segment per
    // (token, head) in every order, all one rect.
    ("gapped_heads", |p| {
        let l = MoriTpLayout {
            total_kv_heads: 2,
            tp_size: 1,
            tp_rank: 0,
            page_size: p,
            head_bytes: 2,
            page_stride: 8 * u64::from(p),
            offset: 0,
            token_stride: 8,
            head_stride: 4,
        };
        [l, l]
    }),
    // 8 KV heads of 256 bytes at TP 4 -> 4, HND into NHD: a rect per (page, head).
    ("hnd_to_nhd", |p| {
        let (mut src, mut dst) = (MoriTpLayout::default(), MoriTpLayout::default());
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!(mori_tp_layout_hnd(8, 4, 1, p, 256, &mut src), MORI_OK);
            assert_eq!(mori_tp_layout_nhd(8, 4, 1, p, 256, &mut dst), MORI_OK);
        }
        [src, dst]
    }),
];

/// Tokens of the gapped-plan cases: the plan's time must not grow from the first to the second.
const GAPPED_TOKENS: [u64; 2] = [1 << 21, 1 << 25];

/// `mori_tp_pair_plan` on requests of two pages of 2^20 and 2^24 slots whose plans are a few
/// rects: the time is the pages' and the rects', so both sizes take about as long.
fn bench_pair_gapped(c: &mut Criterion) {
    for (name, layouts) in GAPPED_CASES {
        for tokens in GAPPED_TOKENS {
            let [src, dst] = layouts((tokens / 2) as u32);
            let mut pair = MoriTpPairConfig::default();
            // SAFETY: valid pointers.
            assert_eq!(
                unsafe { mori_tp_pair_config(&src, &dst, &mut pair) },
                MORI_OK
            );
            let (src_pages, dst_pages) = ([0, 1], [1, 0]);
            let r = MoriTpRequest {
                src_pages: src_pages.as_ptr(),
                num_src_pages: 2,
                dst_pages: dst_pages.as_ptr(),
                num_dst_pages: 2,
                num_tokens: tokens,
            };
            let mut rects = Vec::with_capacity(16);
            let mut group =
                c.benchmark_group(format!("pair_gapped/{name}/{}M_tokens", tokens >> 20));
            group.bench_function("mori_tp_pair_plan", |b| {
                b.iter(|| pair_plan(&pair, black_box(&r), &mut rects))
            });
            group.finish();
        }
    }
}

/// Row widths of the host-copy benchmark, in bytes.
const WIDTHS: [u64; 5] = [128, 256, 512, 1024, 4096];
/// 32 layers, K and V.
const COPY_BUFFERS: usize = 64;
/// Bytes moved per iteration over all buffers: far beyond the caches of the machine.
const COPY_BYTES: u64 = 64 << 20;

/// The three shapes a head slice takes, as (name, prefill TP, decode TP) over 8 KV heads:
/// decode tokens hold one of two prefill heads (rows strided on the source), prefill tokens one of
/// two decode heads (strided on the destination), or equal TP (whole tokens, contiguous runs).
const SHAPES: [(&str, u32, u32); 3] = [
    ("strided_src", 4, 8),
    ("strided_dst", 8, 4),
    ("whole_token", 8, 8),
];

/// The pair (rank 1, its first decode partner) of a shape, with one head of `width` bytes, for as
/// many tokens as make COPY_BYTES over all buffers, in pages of 16 tokens.
fn copy_config(prefill_tp: u32, decode_tp: u32, width: u64) -> (MoriTpSliceConfig, usize) {
    let page_size = 16u32;
    let tokens = (COPY_BYTES / COPY_BUFFERS as u64 / width) as usize;
    let heads_per = |tp: u32| u64::from(8 / tp);
    let config = slice_config(&MoriTpSliceParams {
        prefill_tp_size: prefill_tp,
        prefill_tp_rank: 1,
        decode_tp_size: decode_tp,
        // The decode rank that owns prefill rank 1's first head.
        decode_tp_rank: (heads_per(prefill_tp) / heads_per(decode_tp)) as u32,
        total_kv_heads: 8,
        page_size,
        src_item_len: u64::from(page_size) * heads_per(prefill_tp) * width,
        dst_item_len: u64::from(page_size) * heads_per(decode_tp) * width,
    });
    assert_eq!(config.action, MORI_TP_ACTION_SEND);
    assert_eq!(config.heads_bytes_per_token_to_send, width);
    (config, tokens / page_size as usize)
}

/// Bytes that are not all alike, so no page is shared or zero-filled behind the benchmark's back.
fn noise(len: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(len as usize + 8);
    while (out.len() as u64) < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len as usize);
    out
}

fn bench_host_copies(c: &mut Criterion) {
    let flat_src = noise(COPY_BYTES, 1);
    let mut flat_dst = noise(COPY_BYTES, 2);
    for (shape, prefill_tp, decode_tp) in SHAPES {
        for width in WIDTHS {
            let (config, pages) = copy_config(prefill_tp, decode_tp, width);
            let request = request(pages, true);
            let (src_pages, dst_pages) = (&request.src_pages, &request.dst_pages);
            let src_capacity = request.src_capacity_pages as u64 * config.src_item_len;
            let dst_capacity = request.dst_capacity_pages as u64 * config.dst_item_len;
            let src: Vec<Vec<u8>> = (0..COPY_BUFFERS)
                .map(|b| noise(src_capacity, b as u64))
                .collect();
            let mut dst: Vec<Vec<u8>> = (0..COPY_BUFFERS)
                .map(|b| noise(dst_capacity, 1000 + b as u64))
                .collect();
            let src_ptrs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
            let dst_ptrs: Vec<*mut c_void> =
                dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
            let buffers = MoriKvBuffers {
                src: src_ptrs.as_ptr(),
                dst: dst_ptrs.as_ptr(),
                num_buffers: COPY_BUFFERS,
                src_capacity,
                dst_capacity,
            };
            let options = MoriSendOptions {
                backend: MORI_BACKEND_HOST,
                flags: 0,
                stream: null_mut(),
            };
            let mut segments = Vec::with_capacity(pages * 16);
            plan_segments(&config, src_pages, dst_pages, &mut segments);
            let per_token = per_token_plan(&config, src_pages, dst_pages);

            let mut group = c.benchmark_group(format!("copy/{shape}/width{width}"));
            group.throughput(Throughput::Bytes(COPY_BYTES));
            group
                .sample_size(10)
                .measurement_time(Duration::from_secs(3));
            group.bench_function("send_kvcache_host", |b| {
                b.iter(|| {
                    // SAFETY: every buffer holds every page of the request.
                    let status = unsafe {
                        mori_tp_kvcache_send(
                            &config,
                            &buffers,
                            src_pages.as_ptr(),
                            dst_pages.as_ptr(),
                            pages,
                            &options,
                        )
                    };
                    assert_eq!(status, MORI_OK);
                })
            });
            group.bench_function("memcpy_same_bytes", |b| {
                b.iter(|| flat_dst.copy_from_slice(black_box(&flat_src)))
            });
            group.bench_function("per_token_segments", |b| {
                b.iter(|| {
                    for (&s, &d) in src_ptrs.iter().zip(&dst_ptrs) {
                        for &(src_offset, dst_offset, len) in &per_token {
                            // SAFETY: the per-token entries lie inside the buffers.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    s.cast::<u8>().add(src_offset as usize),
                                    d.cast::<u8>().add(dst_offset as usize),
                                    len as usize,
                                )
                            }
                        }
                    }
                })
            });
            group.finish();
            black_box(&segments);
        }
    }
}

/// The staged-transfer layouts: (name, KV heads, prefill TP, decode TP), each with 128-element
/// bf16 heads (256 bytes): prefill tokens wider than decode tokens (tp2to8, tp4to8), the reverse
/// (tp8to2), and a non-integer ratio (12 heads, 6 -> 4: a prefill rank's 2 heads land in part of
/// a decode rank's 3-head token, so the decode side is staged).
const STAGING_LAYOUTS: [(&str, u32, u32, u32); 4] = [
    ("tp2to8", 4, 2, 8),
    ("tp8to2", 8, 8, 2),
    ("tp4to8", 8, 4, 8),
    ("tp6to4_h12", 12, 6, 4),
];
/// Tokens per staged request, in pages of 16 tokens laid out in runs of 1-16 pages.
const STAGING_TOKENS: usize = 4096;

/// The first sending pair of a staging layout, page size 16, 256-byte heads.
fn staging_config(heads: u32, prefill_tp: u32, decode_tp: u32) -> MoriTpSliceConfig {
    let per = |tp: u32| u64::from((heads / tp).max(1)) * 256 * 16;
    (0..prefill_tp)
        .flat_map(|p| (0..decode_tp).map(move |d| (p, d)))
        .map(|(p, d)| {
            slice_config(&MoriTpSliceParams {
                prefill_tp_size: prefill_tp,
                prefill_tp_rank: p,
                decode_tp_size: decode_tp,
                decode_tp_rank: d,
                total_kv_heads: heads,
                page_size: 16,
                src_item_len: per(prefill_tp),
                dst_item_len: per(decode_tp),
            })
        })
        .find(|c| c.action == MORI_TP_ACTION_SEND)
        .expect("every layout has a sending pair")
}

fn staging_for(config: &MoriTpSliceConfig) -> MoriTpStaging {
    let mut staging = 0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_staging_for(config, &mut staging) },
        MORI_OK
    );
    staging
}

/// mori_tp_plan_transfer into `out`, whose capacity must hold the whole list.
fn plan_transfer(
    config: &MoriTpSliceConfig,
    staging: MoriTpStaging,
    src: &[i32],
    dst: &[i32],
    out: &mut Vec<MoriSegment>,
) {
    // SAFETY: arrays valid for their lengths; out valid for its capacity.
    plan_into(out, |out, capacity, len| unsafe {
        mori_tp_plan_transfer(
            config,
            staging,
            src.as_ptr(),
            dst.as_ptr(),
            src.len(),
            out,
            capacity,
            len,
        )
    });
}

fn bench_staging_plans(c: &mut Criterion) {
    let Request {
        src_pages: src,
        dst_pages: dst,
        ..
    } = request(STAGING_TOKENS / 16, true);
    for (name, heads, prefill_tp, decode_tp) in STAGING_LAYOUTS {
        let config = staging_config(heads, prefill_tp, decode_tp);
        let staging = staging_for(&config);
        let mut out = Vec::with_capacity(STAGING_TOKENS);
        let mut group = c.benchmark_group(format!("staging_plan/{name}"));
        group.throughput(Throughput::Elements(STAGING_TOKENS as u64));
        group.bench_function("per_token", |b| {
            b.iter(|| black_box(per_token_plan(&config, black_box(&src), &dst)))
        });
        group.bench_function("direct_segments", |b| {
            b.iter(|| plan_segments(&config, black_box(&src), &dst, &mut out))
        });
        group.bench_function("staged_segments", |b| {
            b.iter(|| plan_transfer(&config, staging, black_box(&src), &dst, &mut out))
        });
        group.finish();
    }
}

/// Row widths of the pack/unpack benchmark, in bytes.
const PACK_WIDTHS: [u64; 5] = [128, 256, 512, 1024, 4096];

/// Host pack and unpack of the strided side against the same rows copied by a plain loop over
/// (buffer, token), for 64 buffers and 64 MiB per call.
fn bench_pack_unpack(c: &mut Criterion) {
    let host = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: 0,
        stream: null_mut(),
    };
    // (shape, prefill TP, decode TP): pack reads strided prefill tokens, unpack writes strided
    // decode tokens.
    for (shape, prefill_tp, decode_tp) in [("pack", 4, 8), ("unpack", 8, 4)] {
        for width in PACK_WIDTHS {
            let (config, pages) = copy_config(prefill_tp, decode_tp, width);
            let request = request(pages, true);
            let (src_pages, dst_pages) = (&request.src_pages, &request.dst_pages);
            let (pitch, item, page_list) = if shape == "pack" {
                (config.bytes_per_token_src, config.src_item_len, src_pages)
            } else {
                (config.bytes_per_token_dst, config.dst_item_len, dst_pages)
            };
            let offset = if shape == "pack" {
                config.src_head_slice_offset
            } else {
                config.dst_head_slice_offset
            };
            let capacity_pages = request.src_capacity_pages.max(request.dst_capacity_pages);
            let capacity = capacity_pages as u64 * item;
            let mut paged: Vec<Vec<u8>> = (0..COPY_BUFFERS)
                .map(|b| noise(capacity, 7 + b as u64))
                .collect();
            let mut len = 0u64;
            // SAFETY: valid pointers.
            let status = unsafe { mori_tp_staging_len(&config, pages, &mut len) };
            assert_eq!(status, MORI_OK);
            let mut staging = noise(len * COPY_BUFFERS as u64, 99);
            let paged_ptrs: Vec<*mut c_void> =
                paged.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
            let tokens = config.page_size as usize;

            let mut group = c.benchmark_group(format!("staging_copy/{shape}/width{width}"));
            group.throughput(Throughput::Bytes(COPY_BYTES));
            group
                .sample_size(10)
                .measurement_time(Duration::from_secs(3));
            group.bench_function("mori", |b| {
                b.iter(|| {
                    // SAFETY: every buffer holds every page; the region holds every buffer.
                    let status = unsafe {
                        if shape == "pack" {
                            mori_tp_kvcache_pack(
                                &config,
                                paged_ptrs.as_ptr().cast(),
                                COPY_BUFFERS,
                                capacity,
                                page_list.as_ptr(),
                                pages,
                                staging.as_mut_ptr().cast(),
                                staging.len() as u64,
                                &host,
                            )
                        } else {
                            mori_tp_kvcache_unpack(
                                &config,
                                staging.as_ptr().cast(),
                                staging.len() as u64,
                                paged_ptrs.as_ptr(),
                                COPY_BUFFERS,
                                capacity,
                                page_list.as_ptr(),
                                pages,
                                &host,
                            )
                        }
                    };
                    assert_eq!(status, MORI_OK);
                })
            });
            group.bench_function("per_row_loop", |b| {
                b.iter(|| {
                    for (buffer, &base) in paged_ptrs.iter().enumerate() {
                        let region = staging.as_mut_ptr().wrapping_add(buffer * len as usize);
                        let mut k = 0usize;
                        for &page in page_list.iter() {
                            for t in 0..tokens {
                                let at = page as usize * item as usize
                                    + t * pitch as usize
                                    + offset as usize;
                                let slot = region.wrapping_add(k * width as usize);
                                let row = base.cast::<u8>().wrapping_add(at);
                                // SAFETY: both rows lie inside their allocations.
                                unsafe {
                                    if shape == "pack" {
                                        std::ptr::copy_nonoverlapping(row, slot, width as usize)
                                    } else {
                                        std::ptr::copy_nonoverlapping(slot, row, width as usize)
                                    }
                                }
                                k += 1;
                            }
                        }
                    }
                    black_box(&mut staging);
                })
            });
            group.finish();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ratios, from the estimates criterion just wrote

/// When this run started: estimates older than this come from an earlier run and are ignored.
static START: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();

/// Mean time in nanoseconds of one benchmark of this run, from criterion's estimates file.
fn mean_ns(group: &str, function: &str) -> Option<f64> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    // criterion stores group "a/b" in the directory "a_b".
    let path = target
        .join("criterion")
        .join(group.replace('/', "_"))
        .join(function)
        .join("new/estimates.json");
    let written = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
    if written < *START.get()? {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

/// Prints a Markdown table (a header and rows of cells) if it has rows: benchmarks that did not
/// run now leave their table out.
fn print_table(title: &str, header: &[&str], right: &[bool], rows: &[Vec<String>]) {
    if rows.is_empty() {
        return;
    }
    println!("\n{title}\n");
    println!("| {} |", header.join(" | "));
    let rule: Vec<&str> = right
        .iter()
        .map(|&r| if r { "---:" } else { "---" })
        .collect();
    println!("|{}|", rule.join("|"));
    for row in rows {
        println!("| {} |", row.join(" | "));
    }
}

/// "32k, page 16, fragmented": a plan case as the tables name it.
fn case_label(tokens: usize, page_size: u32, fragmented: bool) -> String {
    let layout = if fragmented {
        "fragmented"
    } else {
        "contiguous"
    };
    format!("{}k, page {page_size}, {layout}", tokens / 1024)
}

/// The pair generator's time over the slice-config generator's (REFERENCE.md section 5) on the
/// same requests.
fn print_pair_ratios() {
    let mut rows = Vec::new();
    for (shape, decode_tp) in PAIR_SHAPES {
        for (tokens, page_size, fragmented) in PLAN_CASES {
            let name = plan_case_name(tokens, page_size, fragmented);
            let group = format!("pair/{shape}/{name}");
            let (Some(plan), Some(pair)) = (
                mean_ns(&group, "mori_tp_plan_segments"),
                mean_ns(&group, "mori_tp_pair_segments"),
            ) else {
                continue;
            };
            let (config, _) = section4_pair(decode_tp, page_size);
            let Request {
                src_pages: src,
                dst_pages: dst,
                ..
            } = request(tokens / page_size as usize, fragmented);
            let mut out = Vec::with_capacity(tokens);
            plan_segments(&config, &src, &dst, &mut out);
            let rects = mean_ns(&group, "mori_tp_pair_plan")
                .map_or("-".to_string(), |t| format!("{:.2}", t / plan));
            rows.push(vec![
                format!("{shape} (TP 4 -> {decode_tp})"),
                case_label(tokens, page_size, fragmented),
                out.len().to_string(),
                format!("{:.2}", pair / plan),
                rects,
            ]);
        }
    }
    print_table(
        "`mori_tp_pair_segments` and `mori_tp_pair_plan` against `mori_tp_plan_segments`, same \
         requests (time of the pair function / time of the uniform function; the target, for \
         `mori_tp_pair_segments`: 1.25 or less):",
        &[
            "shape",
            "request",
            "segments",
            "pair time / plan time",
            "pair_plan time / plan time",
        ],
        &[false, false, true, true, true],
        &rows,
    );
    let mut rows = Vec::new();
    for (name, _) in GAPPED_CASES {
        let base = mean_ns(
            &format!("pair_gapped/{name}/{}M_tokens", GAPPED_TOKENS[0] >> 20),
            "mori_tp_pair_plan",
        );
        for tokens in GAPPED_TOKENS {
            let group = format!("pair_gapped/{name}/{}M_tokens", tokens >> 20);
            let (Some(t), Some(base)) = (mean_ns(&group, "mori_tp_pair_plan"), base) else {
                continue;
            };
            rows.push(vec![
                name.to_string(),
                format!("2^{}", tokens.trailing_zeros()),
                format!("{:.2}", t / 1e3),
                format!("{:.2}", t / base),
            ]);
        }
    }
    print_table(
        &format!(
            "`mori_tp_pair_plan` on two pages per side whose plan is a few rects (the time must \
             not grow with the tokens; \"time / first\": over the time at 2^{} tokens):",
            GAPPED_TOKENS[0].trailing_zeros()
        ),
        &["case", "tokens", "time (us)", "time / first"],
        &[false, true, true, true],
        &rows,
    );
}

/// Segment counts (exact) and plan times (measured) of the staged layouts, and the host pack and
/// unpack against a per-row loop.
fn print_staging_ratios() {
    let Request {
        src_pages: src,
        dst_pages: dst,
        ..
    } = request(STAGING_TOKENS / 16, true);
    let mut rows = Vec::new();
    for (name, heads, prefill_tp, decode_tp) in STAGING_LAYOUTS {
        let group = format!("staging_plan/{name}");
        let (Some(per_token_time), Some(direct_time), Some(staged_time)) = (
            mean_ns(&group, "per_token"),
            mean_ns(&group, "direct_segments"),
            mean_ns(&group, "staged_segments"),
        ) else {
            continue;
        };
        let config = staging_config(heads, prefill_tp, decode_tp);
        let staging = staging_for(&config);
        let mut out = Vec::with_capacity(STAGING_TOKENS);
        plan_segments(&config, &src, &dst, &mut out);
        let direct = out.len();
        plan_transfer(&config, staging, &src, &dst, &mut out);
        let staged = out.len();
        let per_token = per_token_plan(&config, &src, &dst).len();
        let mode = ["NONE", "SRC", "DST", "BOTH"][staging as usize];
        rows.push(vec![
            format!("{name} ({heads} heads)"),
            mode.to_string(),
            per_token.to_string(),
            direct.to_string(),
            staged.to_string(),
            format!("{:.0}x", per_token as f64 / staged as f64),
            format!("{:.2}", per_token_time / staged_time),
            format!("{:.2}", direct_time / staged_time),
        ]);
    }
    print_table(
        &format!(
            "Staged segment lists ({STAGING_TOKENS} tokens in runs of 1-16 pages of 16, 256-byte \
             heads, the first sending pair; counts exact, times measured):"
        ),
        &[
            "layout",
            "`staging_for`",
            "per-token segments",
            "direct segments",
            "staged segments",
            "per-token / staged segments",
            "per-token time / staged time",
            "direct time / staged time",
        ],
        &[false, false, true, true, true, true, true, true],
        &rows,
    );
    let mut rows = Vec::new();
    for width in PACK_WIDTHS {
        let mut row = vec![format!("{} B", width)];
        for shape in ["pack", "unpack"] {
            let group = format!("staging_copy/{shape}/width{width}");
            match (mean_ns(&group, "mori"), mean_ns(&group, "per_row_loop")) {
                (Some(mori), Some(looped)) => {
                    row.push(format!("{:.1}", COPY_BYTES as f64 / mori));
                    row.push(format!("{:.2}", looped / mori));
                }
                _ => row.extend(["-".to_string(), "-".to_string()]),
            }
        }
        if row.iter().skip(1).any(|cell| cell != "-") {
            rows.push(row);
        }
    }
    print_table(
        &format!(
            "Host pack and unpack, {COPY_BUFFERS} buffers, 64 MiB per call (\"vs loop\": the per-row \
             loop's time / ours; above 1 is faster than the loop):"
        ),
        &[
            "rows",
            "pack GB/s",
            "pack vs loop",
            "unpack GB/s",
            "unpack vs loop",
        ],
        &[false, true, true, true, true],
        &rows,
    );
}

/// Calls of `mori_tp_slice_config` per iteration of `bench_slice_config`: every rank pair of
/// its six layouts.
const SLICE_CONFIG_CALLS: u64 = 8 * 2 + 16 * 4 + 2 * 8 + 8 * 16 + 6 * 4 + 6 * 4;

fn print_ratios() {
    if let Some(t) = mean_ns("slice_config", "mix_of_layouts") {
        print_table(
            "`mori_tp_slice_config` over every rank pair of six layouts (GQA, MLA, both sides \
             replicated, a non-integer ratio), validation included:",
            &["calls per iteration", "ns per call", "M calls/s"],
            &[true, true, true],
            &[vec![
                SLICE_CONFIG_CALLS.to_string(),
                format!("{:.1}", t / SLICE_CONFIG_CALLS as f64),
                format!("{:.1}", SLICE_CONFIG_CALLS as f64 / t * 1e3),
            ]],
        );
    }
    let mut rows = Vec::new();
    for (tokens, page_size, fragmented) in PLAN_CASES {
        let name = plan_case_name(tokens, page_size, fragmented);
        let group = format!("plan/{name}");
        let (Some(rect), Some(segs), Some(tok)) = (
            mean_ns(&group, "mori_tp_plan"),
            mean_ns(&group, "mori_tp_plan_segments"),
            mean_ns(&group, "per_token"),
        ) else {
            continue;
        };
        let config = llama70b_config(page_size);
        let Request {
            src_pages: src,
            dst_pages: dst,
            ..
        } = request(tokens / page_size as usize, fragmented);
        let mut rects = Vec::with_capacity(src.len());
        plan_rects(&config, &src, &dst, &mut rects);
        let per_token = per_token_plan(&config, &src, &dst).len();
        rows.push(vec![
            case_label(tokens, page_size, fragmented),
            rects.len().to_string(),
            per_token.to_string(),
            if per_token % rects.len() == 0 {
                format!("{}x", per_token / rects.len())
            } else {
                format!("{:.1}x", per_token as f64 / rects.len() as f64)
            },
            format!("{:.2}", tok / rect),
            format!("{:.2}", tok / segs),
        ]);
    }
    print_table(
        "Plans for Llama-3.1-70B's KV (8 heads x 256 B) from prefill TP 4 to decode TP 8 (counts \
         exact, times measured; above 1: faster than the per-token list):",
        &[
            "request",
            "rects",
            "per-token entries",
            "per-token entries / rects",
            "per-token time / `mori_tp_plan`",
            "per-token time / `mori_tp_plan_segments`",
        ],
        &[false, true, true, true, true, true],
        &rows,
    );
    let mut rows = Vec::new();
    for (shape, _, _) in SHAPES {
        for width in WIDTHS {
            let group = format!("copy/{shape}/width{width}");
            let (Some(send), Some(memcpy), Some(per_token)) = (
                mean_ns(&group, "send_kvcache_host"),
                mean_ns(&group, "memcpy_same_bytes"),
                mean_ns(&group, "per_token_segments"),
            ) else {
                continue;
            };
            rows.push(vec![
                format!("{shape}, {width} B"),
                format!("{:.1}", COPY_BYTES as f64 / send),
                format!("{:.2}", memcpy / send),
                format!("{:.2}", per_token / send),
            ]);
        }
    }
    print_table(
        &format!(
            "Host sends, {COPY_BUFFERS} buffers, 64 MiB per call, fragmented pages (above 1: \
             faster than the other):"
        ),
        &[
            "shape, row width",
            "send GB/s",
            "memcpy time / send time",
            "per-token copies time / send time",
        ],
        &[false, true, true, true],
        &rows,
    );
}

/// `rounds` calls of each plan function on the pair comparison's requests (and of
/// `mori_tp_pair_plan` on the gapped ones) whose group name contains `filter`
/// (`pair/whole_token/32k_tokens/page1/fragmented`, `pair/` or `pair_gapped/`), for
/// instruction counts: run under `valgrind --tool=callgrind` with `MORI_TP_BENCH_CALLS=<filter>`
/// and `MORI_TP_BENCH_ROUNDS` 1 and 2; the difference of the inclusive counts of
/// `mori_tp_plan_segments`, `mori_tp_pair_segments` and `mori_tp_pair_plan` is one call's,
/// without the first call's one-time set-up (BENCHMARKS.md says how).
fn call_pair_plans(filter: &str, rounds: usize) {
    for (tokens, page_size, fragmented) in PLAN_CASES {
        for (shape, decode_tp) in PAIR_SHAPES {
            let group = format!(
                "pair/{shape}/{}",
                plan_case_name(tokens, page_size, fragmented)
            );
            if !group.contains(filter) {
                continue;
            }
            let (config, pair) = section4_pair(decode_tp, page_size);
            let Request {
                src_pages: src,
                dst_pages: dst,
                ..
            } = request(tokens / page_size as usize, fragmented);
            let r = MoriTpRequest {
                src_pages: src.as_ptr(),
                num_src_pages: src.len(),
                dst_pages: dst.as_ptr(),
                num_dst_pages: dst.len(),
                num_tokens: tokens as u64,
            };
            let mut out = Vec::with_capacity(tokens);
            let mut rects = Vec::with_capacity(tokens);
            for _ in 0..rounds {
                plan_segments(&config, black_box(&src), &dst, &mut out);
                let segments = out.len();
                pair_segments(&pair, black_box(&r), &mut out);
                assert_eq!(out.len(), segments);
                pair_plan(&pair, black_box(&r), &mut rects);
            }
            println!("{group}: {} segments, {} rects", out.len(), rects.len());
        }
    }
    for (name, layouts) in GAPPED_CASES {
        for tokens in GAPPED_TOKENS {
            let group = format!("pair_gapped/{name}/{}M_tokens", tokens >> 20);
            if !group.contains(filter) {
                continue;
            }
            let [src, dst] = layouts((tokens / 2) as u32);
            let mut pair = MoriTpPairConfig::default();
            // SAFETY: valid pointers.
            assert_eq!(
                unsafe { mori_tp_pair_config(&src, &dst, &mut pair) },
                MORI_OK
            );
            let (src_pages, dst_pages) = ([0, 1], [1, 0]);
            let r = MoriTpRequest {
                src_pages: src_pages.as_ptr(),
                num_src_pages: 2,
                dst_pages: dst_pages.as_ptr(),
                num_dst_pages: 2,
                num_tokens: tokens,
            };
            let mut rects = Vec::with_capacity(16);
            for _ in 0..rounds {
                pair_plan(&pair, black_box(&r), &mut rects);
            }
            println!("{group}: {} rects", rects.len());
        }
    }
}

fn main() {
    if let Some(filter) = std::env::var_os("MORI_TP_BENCH_CALLS") {
        let rounds = std::env::var("MORI_TP_BENCH_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(1);
        call_pair_plans(&filter.to_string_lossy(), rounds);
        return;
    }
    START.get_or_init(std::time::SystemTime::now);
    let mut c = Criterion::default().configure_from_args();
    bench_slice_config(&mut c);
    bench_plans(&mut c);
    bench_pair_segments(&mut c);
    bench_pair_gapped(&mut c);
    bench_host_copies(&mut c);
    bench_staging_plans(&mut c);
    bench_pack_unpack(&mut c);
    c.final_summary();
    // benches/regenerate pastes what follows this line into BENCHMARKS.md.
    println!("\n== results ==");
    print_ratios();
    print_pair_ratios();
    print_staging_ratios();
}
