//! Staged transfers through the C ABI: the composition law (pack, then every transport segment
//! for every buffer, then unpack, leaves every decode byte exactly as one mori_tp_kvcache_send
//! does), the segment counts of each staging mode, and the refusals of the new functions.

mod common;

use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};

use common::{HEAD_COUNTS, Request, fragmented_request, owned_heads, valid_tp};
use mori_tp::ffi::*;

const MODES: [MoriTpStaging; 4] = [
    MORI_TP_STAGING_NONE,
    MORI_TP_STAGING_SRC,
    MORI_TP_STAGING_DST,
    MORI_TP_STAGING_BOTH,
];

const HOST: MoriSendOptions = MoriSendOptions {
    backend: MORI_BACKEND_HOST,
    flags: 0,
    stream: null_mut(),
};

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn stages_src(mode: MoriTpStaging) -> bool {
    mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH
}

fn stages_dst(mode: MoriTpStaging) -> bool {
    mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH
}

/// The layouts of the topology sweep: H in HEAD_COUNTS, P and D in 1..=32, both valid.
fn valid_layouts() -> impl Iterator<Item = (u32, u32, u32)> {
    HEAD_COUNTS
        .into_iter()
        .flat_map(|h| (1..=32u32).flat_map(move |p| (1..=32u32).map(move |d| (h, p, d))))
        .filter(|&(h, p, d)| valid_tp(h, p) && valid_tp(h, d))
}

fn slice_config(params: &MoriTpSliceParams) -> MoriTpSliceConfig {
    let mut out = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_slice_config(params, &mut out) };
    assert_eq!(status, MORI_OK, "{params:?}: {}", last_error());
    out
}

/// The config of pair (p, d) with `bph` bytes per head.
fn config(
    h: u32,
    p_tp: u32,
    p: u32,
    d_tp: u32,
    d: u32,
    page_size: u32,
    bph: u64,
) -> MoriTpSliceConfig {
    let item = |tp| u64::from(page_size) * owned_heads(h, tp, 0).len() as u64 * bph;
    slice_config(&MoriTpSliceParams {
        prefill_tp_size: p_tp,
        prefill_tp_rank: p,
        decode_tp_size: d_tp,
        decode_tp_rank: d,
        total_kv_heads: h,
        page_size,
        src_item_len: item(p_tp),
        dst_item_len: item(d_tp),
    })
}

fn staging_for(config: &MoriTpSliceConfig) -> MoriTpStaging {
    let mut out = 99;
    // SAFETY: valid pointers.
    assert_eq!(unsafe { mori_tp_staging_for(config, &mut out) }, MORI_OK);
    out
}

fn staging_len(config: &MoriTpSliceConfig, num_pages: usize) -> u64 {
    let mut out = 0;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_staging_len(config, num_pages, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

/// Calls a plan function of the segment shape with a size query, then for real.
fn segments_of(
    call: impl Fn(*mut MoriSegment, usize, &mut usize) -> MoriStatus,
) -> Vec<MoriSegment> {
    let mut needed = 0;
    let status = call(null_mut(), 0, &mut needed);
    assert!(
        status == MORI_OK || status == MORI_ERR_BUFFER_TOO_SMALL,
        "size query: {}",
        last_error()
    );
    let mut out = vec![MoriSegment::default(); needed];
    let mut written = 0;
    assert_eq!(
        call(out.as_mut_ptr(), out.len(), &mut written),
        MORI_OK,
        "{}",
        last_error()
    );
    assert_eq!(written, needed);
    out
}

fn plan_transfer(config: &MoriTpSliceConfig, mode: MoriTpStaging, r: &Request) -> Vec<MoriSegment> {
    segments_of(|out, capacity, len| {
        // SAFETY: valid arrays of the stated lengths.
        unsafe {
            mori_tp_plan_transfer(
                config,
                mode,
                r.src_pages.as_ptr(),
                r.dst_pages.as_ptr(),
                r.src_pages.len(),
                out,
                capacity,
                len,
            )
        }
    })
}

fn plan_segments(config: &MoriTpSliceConfig, r: &Request) -> Vec<MoriSegment> {
    segments_of(|out, capacity, len| {
        // SAFETY: valid arrays of the stated lengths.
        unsafe {
            mori_tp_plan_segments(
                config,
                r.src_pages.as_ptr(),
                r.dst_pages.as_ptr(),
                r.src_pages.len(),
                out,
                capacity,
                len,
            )
        }
    })
}

/// Page buffers of one rank: a pattern whose prime period lines up with no head, token or
/// page boundary, different per buffer and salt, so a shifted or misplaced copy shows.
fn buffers(num: usize, len: usize, salt: u8) -> Vec<Vec<u8>> {
    (0..num)
        .map(|b| {
            let period: Vec<u8> = (0..251u32)
                .map(|i| (i * 31 + b as u32 * 57) as u8 ^ salt)
                .collect();
            let mut buffer = Vec::with_capacity(len + period.len());
            while buffer.len() < len {
                buffer.extend_from_slice(&period);
            }
            buffer.truncate(len);
            buffer
        })
        .collect()
}

fn send(config: &MoriTpSliceConfig, r: &Request, src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    let dsts: Vec<*mut c_void> = dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    let buffers = MoriKvBuffers {
        src: srcs.as_ptr(),
        dst: dsts.as_ptr(),
        num_buffers: srcs.len(),
        src_capacity: src[0].len() as u64,
        dst_capacity: dst[0].len() as u64,
    };
    // SAFETY: valid buffers of the stated capacities.
    let status = unsafe {
        mori_tp_kvcache_send(
            config,
            &buffers,
            r.src_pages.as_ptr(),
            r.dst_pages.as_ptr(),
            r.src_pages.len(),
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
}

fn pack(
    config: &MoriTpSliceConfig,
    src: &[Vec<u8>],
    pages: &[i32],
    staging: &mut [u8],
) -> MoriStatus {
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    // SAFETY: valid buffers of the stated capacities.
    unsafe {
        mori_tp_kvcache_pack(
            config,
            srcs.as_ptr(),
            srcs.len(),
            src.first().map_or(0, |b| b.len() as u64),
            pages.as_ptr(),
            pages.len(),
            staging.as_mut_ptr().cast(),
            staging.len() as u64,
            &HOST,
        )
    }
}

fn unpack(
    config: &MoriTpSliceConfig,
    staging: &[u8],
    dst: &mut [Vec<u8>],
    pages: &[i32],
) -> MoriStatus {
    let capacity = dst.first().map_or(0, |b| b.len() as u64);
    let dsts: Vec<*mut c_void> = dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    // SAFETY: valid buffers of the stated capacities.
    unsafe {
        mori_tp_kvcache_unpack(
            config,
            staging.as_ptr().cast(),
            staging.len() as u64,
            dsts.as_ptr(),
            dsts.len(),
            capacity,
            pages.as_ptr(),
            pages.len(),
            &HOST,
        )
    }
}

/// What a transfer engine does with a segment list: for every buffer, every segment, from the
/// buffer's base on each side (its page buffer, or its part of the staging region).
fn transport(segments: &[MoriSegment], src: &[&[u8]], dst: &mut [&mut [u8]], skip: Option<usize>) {
    for (b, (s, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
        for (i, seg) in segments.iter().enumerate() {
            if skip == Some(b * segments.len() + i) {
                continue;
            }
            let (from, to, n) = (
                seg.src_offset as usize,
                seg.dst_offset as usize,
                seg.length as usize,
            );
            d[to..to + n].copy_from_slice(&s[from..from + n]);
        }
    }
}

/// One staged transfer of `r` for a pair: pack if the prefill side is staged, transport every
/// segment (but `skip`, a negative control), unpack if the decode side is staged.
fn staged(
    config: &MoriTpSliceConfig,
    mode: MoriTpStaging,
    r: &Request,
    src: &[Vec<u8>],
    dst: &mut [Vec<u8>],
    skip: Option<usize>,
) {
    let len = staging_len(config, r.src_pages.len()) as usize;
    let n = src.len();
    let mut src_staging = vec![0xC3u8; n * len];
    let mut dst_staging = vec![0x3Cu8; n * len];
    if stages_src(mode) {
        assert_eq!(
            pack(config, src, &r.src_pages, &mut src_staging),
            MORI_OK,
            "{}",
            last_error()
        );
    }
    let segments = plan_transfer(config, mode, r);
    {
        let from: Vec<&[u8]> = if stages_src(mode) {
            src_staging.chunks(len.max(1)).collect()
        } else {
            src.iter().map(Vec::as_slice).collect()
        };
        let mut to: Vec<&mut [u8]> = if stages_dst(mode) {
            dst_staging.chunks_mut(len.max(1)).collect()
        } else {
            dst.iter_mut().map(Vec::as_mut_slice).collect()
        };
        transport(&segments, &from, &mut to, skip);
    }
    if stages_dst(mode) {
        assert_eq!(
            unpack(config, &dst_staging, dst, &r.dst_pages),
            MORI_OK,
            "{}",
            last_error()
        );
    }
}

/// For one layout, page size and request: every sending pair and the first pair that does not
/// send, every mode, byte for byte against a direct send. Returns the number of (pair, mode)
/// transfers that moved bytes.
fn composition_law(h: u32, p_tp: u32, d_tp: u32, page_size: u32, r: &Request) -> usize {
    // An odd head size catches offsets computed in the wrong unit.
    const BPH: u64 = 3;
    const BUFFERS: usize = 2;
    let mut checked = 0;
    let mut idle_checked = false;
    for p in 0..p_tp {
        for d in 0..d_tp {
            let (src_heads, dst_heads) = (owned_heads(h, p_tp, p), owned_heads(h, d_tp, d));
            let shares = src_heads.start < dst_heads.end && dst_heads.start < src_heads.end;
            if !shares && idle_checked {
                continue;
            }
            let c = config(h, p_tp, p, d_tp, d, page_size, BPH);
            // Pairs that do not send move nothing in every mode (checked by byte for one of
            // them per layout; the segment-count test checks all of them have empty plans).
            if c.action != MORI_TP_ACTION_SEND {
                if idle_checked {
                    continue;
                }
                idle_checked = true;
            }
            let src = buffers(
                BUFFERS,
                r.src_capacity_pages * c.src_item_len as usize,
                0x11,
            );
            let initial = buffers(
                BUFFERS,
                r.dst_capacity_pages * c.dst_item_len as usize,
                0x77,
            );
            let mut direct = initial.clone();
            send(&c, r, &src, &mut direct);
            for mode in MODES {
                let mut dst = initial.clone();
                staged(&c, mode, r, &src, &mut dst, None);
                assert!(
                    dst == direct,
                    "H={h} P={p_tp} D={d_tp} pair ({p}, {d}) page_size {page_size} staging \
                     {mode}: the staged transfer differs from mori_tp_kvcache_send ({r:?})"
                );
                checked += usize::from(c.action == MORI_TP_ACTION_SEND);
            }
        }
    }
    checked
}

/// A request of one contiguous run of pages on both sides.
fn contiguous(pages: usize) -> Request {
    Request {
        src_pages: (2..2 + pages as i32).collect(),
        dst_pages: (1..1 + pages as i32).collect(),
        src_capacity_pages: pages + 2,
        dst_capacity_pages: pages + 1,
    }
}

#[test]
fn pack_transport_unpack_equals_one_send_for_every_layout_mode_and_page_list() {
    // The sweep is large: split it over the machine's cores, each thread a share of the layouts.
    let layouts: Vec<(u32, u32, u32)> = valid_layouts().collect();
    assert!(layouts.len() > 1000, "only {} layouts", layouts.len());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let checked: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let layouts = &layouts;
                scope.spawn(move || {
                    let mut checked = 0;
                    for (i, &(h, p_tp, d_tp)) in layouts.iter().enumerate() {
                        if i % threads != t {
                            continue;
                        }
                        for page_size in [1, 16] {
                            let seed = u64::from(h) << 40 | u64::from(p_tp) << 20 | u64::from(d_tp);
                            let runs = if page_size == 1 { 5 } else { 2 };
                            let fragmented = fragmented_request(seed ^ u64::from(page_size), runs);
                            let whole = contiguous(if page_size == 1 { 6 } else { 2 });
                            for request in [&fragmented, &whole] {
                                checked += composition_law(h, p_tp, d_tp, page_size, request);
                            }
                        }
                    }
                    checked
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a worker failed"))
            .sum()
    });
    // Every layout sends from at least one pair per decode rank, in all four modes, twice per
    // page size: the sweep must not have skipped its work.
    assert!(
        checked > layouts.len() * 4 * 4,
        "only {checked} staged transfers checked"
    );
}

#[test]
fn dropping_one_transport_segment_breaks_the_law() {
    // The negative control: the check above must be able to fail. Qwen2.5-7B-like, 4 heads,
    // prefill TP 2 -> decode TP 8, pair (0, 1) sends head 0.
    let r = fragmented_request(7, 3);
    let c = config(4, 2, 0, 8, 1, 16, 4);
    let src = buffers(2, r.src_capacity_pages * c.src_item_len as usize, 1);
    let initial = buffers(2, r.dst_capacity_pages * c.dst_item_len as usize, 2);
    let mut direct = initial.clone();
    send(&c, &r, &src, &mut direct);
    for mode in MODES {
        let segments = plan_transfer(&c, mode, &r).len();
        for skip in [0, 2 * segments - 1] {
            let mut dst = initial.clone();
            staged(&c, mode, &r, &src, &mut dst, Some(skip));
            assert!(
                dst != direct,
                "mode {mode}: skipping segment {skip} went unnoticed"
            );
        }
    }
}

#[test]
fn staging_for_stages_exactly_the_sides_wider_than_the_slice_and_never_leaves_per_token_lists() {
    for (h, p_tp, d_tp) in valid_layouts() {
        for p in 0..p_tp {
            for d in 0..d_tp {
                let c = config(h, p_tp, p, d_tp, d, 16, 8);
                let chosen = staging_for(&c);
                if c.action != MORI_TP_ACTION_SEND {
                    assert_eq!(chosen, MORI_TP_STAGING_NONE);
                    continue;
                }
                let w = c.heads_bytes_per_token_to_send;
                let expected = match (c.bytes_per_token_src > w, c.bytes_per_token_dst > w) {
                    (false, false) => MORI_TP_STAGING_NONE,
                    (true, false) => MORI_TP_STAGING_SRC,
                    (false, true) => MORI_TP_STAGING_DST,
                    (true, true) => MORI_TP_STAGING_BOTH,
                };
                assert_eq!(chosen, expected, "H={h} P={p_tp} D={d_tp} ({p}, {d})");
            }
        }
    }
}

/// Runs of one page list alone.
fn runs_of(pages: &[i32]) -> usize {
    pages.len() - pages.windows(2).filter(|w| w[1] == w[0] + 1).count()
}

#[test]
fn segment_counts_of_the_four_modes() {
    let mut layouts = 0;
    for (h, p_tp, d_tp) in valid_layouts().filter(|&(_, p, d)| p <= 16 && d <= 16) {
        layouts += 1;
        let fragmented = fragmented_request(u64::from(h * 1000 + p_tp * 33 + d_tp), 4);
        let whole = contiguous(3);
        for p in 0..p_tp {
            for d in 0..d_tp {
                let c = config(h, p_tp, p, d_tp, d, 16, 8);
                let w = c.heads_bytes_per_token_to_send;
                let chosen = staging_for(&c);
                for r in [&fragmented, &whole] {
                    let count = |mode| plan_transfer(&c, mode, r).len();
                    let len = staging_len(&c, r.src_pages.len());
                    // NONE is mori_tp_plan_segments itself.
                    let none = plan_transfer(&c, MORI_TP_STAGING_NONE, r);
                    let direct = plan_segments(&c, r);
                    assert!(
                        none.len() == direct.len()
                            && none.iter().zip(&direct).all(|(a, b)| {
                                (a.src_offset, a.dst_offset, a.length)
                                    == (b.src_offset, b.dst_offset, b.length)
                            })
                    );
                    if c.action != MORI_TP_ACTION_SEND {
                        assert!(MODES.iter().all(|&m| count(m) == 0));
                        continue;
                    }
                    // BOTH: one segment of staging_len per buffer, at offset 0 on both sides.
                    let both = plan_transfer(&c, MORI_TP_STAGING_BOTH, r);
                    assert_eq!(both.len(), 1);
                    assert_eq!(
                        (both[0].src_offset, both[0].dst_offset, both[0].length),
                        (0, 0, len)
                    );
                    // staging_for's choice never leaves one segment per token: at most one per
                    // run, and no mode that stages only sides wider than the slice does better.
                    let best = count(chosen);
                    assert!(
                        best <= r.runs(),
                        "H={h} P={p_tp} D={d_tp} ({p},{d}): {best}"
                    );
                    for mode in MODES {
                        let stages_only_wide = (!stages_src(mode) || c.bytes_per_token_src > w)
                            && (!stages_dst(mode) || c.bytes_per_token_dst > w);
                        if stages_only_wide {
                            assert!(best <= count(mode), "H={h} P={p_tp} D={d_tp} mode {mode}");
                        }
                    }
                    // On a request that is one run, no mode at all gives fewer.
                    if r.runs() == 1 {
                        assert_eq!(best, MODES.iter().map(|&m| count(m)).min().unwrap());
                    }
                }
            }
        }
    }
    assert!(layouts > 300, "only {layouts} layouts");
}

#[test]
fn tp2_to_tp8_with_4_heads_goes_from_a_segment_per_token_to_one_per_run() {
    // The case that motivates staging: 4 KV heads of 256 bytes, prefill TP 2, decode TP 8,
    // 4096 tokens in runs of 1-4 pages of 16: 4096 segments per buffer direct, one per run
    // staged on the prefill side.
    let c = config(4, 2, 0, 8, 0, 16, 256);
    let r = fragmented_request(11, 100);
    let tokens = r.src_pages.len() * 16;
    assert_eq!(staging_for(&c), MORI_TP_STAGING_SRC);
    assert_eq!(plan_transfer(&c, MORI_TP_STAGING_NONE, &r).len(), tokens);
    // Staging the prefill side leaves the runs of the decode pages alone to break segments.
    assert_eq!(
        plan_transfer(&c, MORI_TP_STAGING_SRC, &r).len(),
        runs_of(&r.dst_pages)
    );
    assert!(runs_of(&r.dst_pages) <= r.runs() && r.runs() <= 100);
    assert_eq!(staging_len(&c, r.src_pages.len()), tokens as u64 * 256);
}

// ---- refusals -----------------------------------------------------------------------------

/// 8 heads of 16 bytes, page size 4, prefill TP 2 -> decode TP 4, pair (1, 3): 32 of every 64
/// source bytes per token.
fn small() -> MoriTpSliceConfig {
    config(8, 2, 1, 4, 3, 4, 16)
}

#[test]
fn a_staging_region_one_byte_short_is_buffer_too_small_and_nothing_is_written() {
    let c = small();
    let pages = [3, 0, 1];
    let src = buffers(2, 4 * c.src_item_len as usize, 5);
    let needed = 2 * staging_len(&c, 3) as usize;
    assert_eq!(needed, 2 * 3 * 4 * 32);
    let mut short = vec![0xEEu8; needed - 1];
    assert_eq!(
        pack(&c, &src, &pages, &mut short),
        MORI_ERR_BUFFER_TOO_SMALL
    );
    let message = last_error();
    assert!(
        message.contains(&format!("staging_capacity {}", needed - 1))
            && message.contains(&format!("{needed} bytes")),
        "{message}"
    );
    assert!(
        short.iter().all(|&b| b == 0xEE),
        "a refused pack wrote bytes"
    );
    let staging = vec![0u8; needed - 1];
    let initial = buffers(2, 4 * c.dst_item_len as usize, 9);
    let mut dst = initial.clone();
    assert_eq!(
        unpack(&c, &staging, &mut dst, &pages),
        MORI_ERR_BUFFER_TOO_SMALL
    );
    assert!(last_error().contains(&format!("{needed} bytes")));
    assert_eq!(dst, initial, "a refused unpack wrote bytes");
    let mut exact = vec![0u8; needed];
    assert_eq!(pack(&c, &src, &pages, &mut exact), MORI_OK);
}

#[test]
fn unknown_staging_values_are_invalid_arguments() {
    let c = small();
    let pages = [0, 1];
    let mut len = 77;
    for mode in [4u32, 0x8000_0000, u32::MAX] {
        // SAFETY: valid pointers.
        let status = unsafe {
            mori_tp_plan_transfer(
                &c,
                mode,
                pages.as_ptr(),
                pages.as_ptr(),
                2,
                null_mut(),
                0,
                &mut len,
            )
        };
        assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains(&format!("staging {mode} is not a MoriTpStaging")));
        assert_eq!(
            len, 77,
            "out_len must not be written for an invalid argument"
        );
    }
}

#[test]
fn null_pointers_are_refused_by_the_staging_functions() {
    let c = small();
    let pages = [0, 1];
    let src = buffers(2, 4 * c.src_item_len as usize, 5);
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    let mut staging_byte = 0u32;
    let mut len = 0usize;
    let mut len64 = 0u64;
    // SAFETY (every call): the pointers are valid or NULL, as each case says.
    unsafe {
        assert_eq!(
            mori_tp_staging_for(null(), &mut staging_byte),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(mori_tp_staging_for(&c, null_mut()), MORI_ERR_NULL_POINTER);
        assert_eq!(
            mori_tp_staging_len(null(), 2, &mut len64),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            mori_tp_staging_len(&c, 2, null_mut()),
            MORI_ERR_NULL_POINTER
        );
        let plan = |src: *const i32, out_len: *mut usize| {
            mori_tp_plan_transfer(
                &c,
                MORI_TP_STAGING_SRC,
                src,
                pages.as_ptr(),
                2,
                null_mut(),
                0,
                out_len,
            )
        };
        assert_eq!(plan(null(), &mut len), MORI_ERR_NULL_POINTER);
        assert_eq!(plan(pages.as_ptr(), null_mut()), MORI_ERR_NULL_POINTER);
        // NULL staging with a non-zero capacity.
        let status = mori_tp_kvcache_pack(
            &c,
            srcs.as_ptr(),
            2,
            src[0].len() as u64,
            pages.as_ptr(),
            2,
            null_mut(),
            512,
            &HOST,
        );
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        assert!(last_error().contains("staging is NULL but staging_capacity is 512"));
        let status =
            mori_tp_kvcache_unpack(&c, null(), 512, null(), 0, 0, pages.as_ptr(), 2, &HOST);
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        // NULL source array with buffers, NULL pages with pages.
        let mut staging = vec![0u8; 1024];
        let status = mori_tp_kvcache_pack(
            &c,
            null(),
            2,
            0,
            pages.as_ptr(),
            2,
            staging.as_mut_ptr().cast(),
            1024,
            &HOST,
        );
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        let status = mori_tp_kvcache_pack(
            &c,
            srcs.as_ptr(),
            2,
            src[0].len() as u64,
            null(),
            2,
            staging.as_mut_ptr().cast(),
            1024,
            &HOST,
        );
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        assert!(last_error().contains("src_pages is NULL but its length is 2"));
        // A NULL entry among the buffers.
        let with_null = [srcs[0], null()];
        let status = mori_tp_kvcache_pack(
            &c,
            with_null.as_ptr(),
            2,
            src[0].len() as u64,
            pages.as_ptr(),
            2,
            staging.as_mut_ptr().cast(),
            1024,
            &HOST,
        );
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        assert!(last_error().contains("buffers.src[1] is NULL"));
    }
}

#[test]
fn pages_past_capacity_are_out_of_bounds_and_nothing_is_written() {
    let c = small();
    let src = buffers(2, 4 * c.src_item_len as usize, 5);
    let mut staging = vec![0xEEu8; 2 * staging_len(&c, 2) as usize];
    assert_eq!(
        pack(&c, &src, &[1, 4], &mut staging),
        MORI_ERR_OUT_OF_BOUNDS
    );
    assert!(
        last_error().contains("prefill side: page 4 at position 1"),
        "{}",
        last_error()
    );
    assert_eq!(
        pack(&c, &src, &[-1, 0], &mut staging),
        MORI_ERR_OUT_OF_BOUNDS
    );
    assert!(staging.iter().all(|&b| b == 0xEE));
    let initial = buffers(2, 4 * c.dst_item_len as usize, 9);
    let mut dst = initial.clone();
    assert_eq!(
        unpack(&c, &staging, &mut dst, &[0, 9]),
        MORI_ERR_OUT_OF_BOUNDS
    );
    assert!(
        last_error().contains("decode side: page 9 at position 1"),
        "{}",
        last_error()
    );
    assert_eq!(dst, initial);
}

#[test]
fn sizes_that_overflow_64_bits_are_refused_not_wrapped() {
    // 1 TiB tokens: num_pages * page_size * width overflows u64 long before any page does.
    let item: u64 = 1 << 40;
    let c = slice_config(&MoriTpSliceParams {
        prefill_tp_size: 1,
        prefill_tp_rank: 0,
        decode_tp_size: 1,
        decode_tp_rank: 0,
        total_kv_heads: 1,
        page_size: 1,
        src_item_len: item,
        dst_item_len: item,
    });
    let mut len = 0u64;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_staging_len(&c, 1 << 24, &mut len) };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("overflows 64 bits"),
        "{}",
        last_error()
    );
    assert_eq!(len, 0);
    // 2^24 pairs of page 0: every page fits, the bytes per buffer do not.
    let pages = vec![0i32; 1 << 24];
    let mut out_len = 0usize;
    for mode in MODES {
        // SAFETY: valid arrays.
        let status = unsafe {
            mori_tp_plan_transfer(
                &c,
                mode,
                pages.as_ptr(),
                pages.as_ptr(),
                pages.len(),
                null_mut(),
                0,
                &mut out_len,
            )
        };
        assert_eq!(
            status,
            MORI_ERR_INVALID_ARGUMENT,
            "mode {mode}: {}",
            last_error()
        );
        assert!(
            last_error().contains("overflows 64 bits"),
            "{}",
            last_error()
        );
    }
}

#[test]
fn pairs_that_do_not_send_validate_move_nothing_and_succeed() {
    // Pair (0, 3) of the small layout shares no head.
    let c = config(8, 2, 0, 4, 3, 4, 16);
    assert_eq!(c.action, MORI_TP_ACTION_NOT_PAIRED);
    assert_eq!(staging_len(&c, 3), 0);
    assert_eq!(staging_for(&c), MORI_TP_STAGING_NONE);
    let src = buffers(2, 4 * c.src_item_len as usize, 5);
    let initial = buffers(2, 4 * c.dst_item_len as usize, 9);
    let mut dst = initial.clone();
    let mut staging: Vec<u8> = Vec::new();
    assert_eq!(pack(&c, &src, &[0, 1, 2], &mut staging), MORI_OK);
    assert_eq!(unpack(&c, &staging, &mut dst, &[3, 2, 1]), MORI_OK);
    assert_eq!(dst, initial);
    // The pages are still checked.
    assert_eq!(
        pack(&c, &src, &[0, 7], &mut staging),
        MORI_ERR_OUT_OF_BOUNDS
    );
    // (NULL, 0) is the empty staging region, as for every C array.
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    let capacity = src[0].len() as u64;
    // SAFETY: valid buffers; the staging region is empty.
    let status = unsafe {
        mori_tp_kvcache_pack(
            &c,
            srcs.as_ptr(),
            2,
            capacity,
            [0].as_ptr(),
            1,
            null_mut(),
            0,
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
    let dsts: Vec<*mut c_void> = dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    let capacity = dst[0].len() as u64;
    // SAFETY: as above.
    let status = unsafe {
        mori_tp_kvcache_unpack(
            &c,
            null(),
            0,
            dsts.as_ptr(),
            2,
            capacity,
            [0].as_ptr(),
            1,
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
}

#[test]
fn a_staging_region_that_overlaps_a_page_buffer_is_refused() {
    let c = small();
    let mut src = buffers(2, 4 * c.src_item_len as usize, 5);
    let initial = src.clone();
    let needed = 2 * staging_len(&c, 2);
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    // The staging region is the tail of source buffer 1.
    let tail = src[1].len() as u64 - needed;
    // SAFETY: the region lies inside src[1]; the call must refuse before writing.
    let status = unsafe {
        mori_tp_kvcache_pack(
            &c,
            srcs.as_ptr(),
            2,
            src[0].len() as u64,
            [0, 1].as_ptr(),
            2,
            src[1].as_mut_ptr().add(tail as usize).cast(),
            needed,
            &HOST,
        )
    };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("overlaps source buffer 1"),
        "{}",
        last_error()
    );
    assert_eq!(src, initial);
}

#[test]
fn the_staging_functions_refuse_the_hip_backend_only_after_validating_the_request() {
    let c = small();
    let src = buffers(2, 4 * c.src_item_len as usize, 5);
    let srcs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    let mut staging = vec![0u8; 2 * staging_len(&c, 2) as usize];
    let hip = MoriSendOptions {
        backend: MORI_BACKEND_HIP,
        flags: MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
        stream: null_mut(),
    };
    let call = |pages: &[i32], staging: &mut [u8]| unsafe {
        mori_tp_kvcache_pack(
            &c,
            srcs.as_ptr(),
            2,
            src[0].len() as u64,
            pages.as_ptr(),
            2,
            staging.as_mut_ptr().cast(),
            staging.len() as u64,
            &hip,
        )
    };
    // A page past capacity is OUT_OF_BOUNDS whatever the machine: validation comes first.
    assert_eq!(call(&[0, 40], &mut staging), MORI_ERR_OUT_OF_BOUNDS);
    // A valid request reaches the backend: unavailable without the feature or a device.
    if cfg!(not(feature = "hip")) {
        assert_eq!(call(&[0, 1], &mut staging), MORI_ERR_BACKEND_UNAVAILABLE);
    }
}

fn check_transfer(
    config: &MoriTpSliceConfig,
    mode: MoriTpStaging,
    r: &Request,
    prefill: &MoriTpMemory,
    decode: &MoriTpMemory,
) -> MoriStatus {
    // SAFETY: valid arrays of the stated lengths and valid structs.
    unsafe {
        mori_tp_check_transfer(
            config,
            mode,
            r.src_pages.as_ptr(),
            r.dst_pages.as_ptr(),
            r.src_pages.len(),
            prefill,
            decode,
        )
    }
}

#[test]
fn check_transfer_refuses_what_an_engine_would_copy_outside_its_buffers() {
    // Qwen-like 4 heads, TP 2 -> 8: the prefill slot is wider than the slice, DST unstaged.
    let config = config(4, 2, 0, 8, 1, 16, 256);
    let r = fragmented_request(11, 24);
    let len = staging_len(&config, r.src_pages.len());
    let buffers = 6usize;
    let memory = |capacity_pages: usize, item_len: u64, staging_capacity: u64| MoriTpMemory {
        num_buffers: buffers,
        capacity: capacity_pages as u64 * item_len,
        staging_capacity,
    };
    let prefill = memory(
        r.src_capacity_pages,
        config.src_item_len,
        buffers as u64 * len,
    );
    let decode = memory(
        r.dst_capacity_pages,
        config.dst_item_len,
        buffers as u64 * len,
    );
    for mode in MODES {
        assert_eq!(
            check_transfer(&config, mode, &r, &prefill, &decode),
            MORI_OK
        );
    }

    let fewer = MoriTpMemory {
        num_buffers: buffers - 1,
        ..decode
    };
    let status = check_transfer(&config, MORI_TP_STAGING_SRC, &r, &prefill, &fewer);
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("6 source buffers but 5 destination buffers"));

    // A decode page past its buffers is refused whether or not the decode side is staged.
    let last_dst_end = (*r.dst_pages.iter().max().unwrap() as u64 + 1) * config.dst_item_len;
    let short = MoriTpMemory {
        capacity: last_dst_end - 1,
        ..decode
    };
    for mode in MODES {
        let status = check_transfer(&config, mode, &r, &prefill, &short);
        assert_eq!(status, MORI_ERR_OUT_OF_BOUNDS, "{}", last_error());
        assert!(last_error().contains("decode side"), "{}", last_error());
    }

    // A staged side's region one byte short names the side and both sizes; an unstaged side
    // needs no region at all.
    let no_region = MoriTpMemory {
        staging_capacity: 0,
        ..prefill
    };
    let one_short = MoriTpMemory {
        staging_capacity: buffers as u64 * len - 1,
        ..decode
    };
    assert_eq!(
        check_transfer(&config, MORI_TP_STAGING_DST, &r, &no_region, &decode),
        MORI_OK
    );
    let status = check_transfer(&config, MORI_TP_STAGING_BOTH, &r, &prefill, &one_short);
    assert_eq!(status, MORI_ERR_BUFFER_TOO_SMALL);
    let message = last_error();
    assert!(
        message.contains(&format!(
            "decode side: staging_capacity {} is below the {} bytes",
            buffers as u64 * len - 1,
            buffers as u64 * len
        )),
        "{message}"
    );
    let status = check_transfer(&config, MORI_TP_STAGING_SRC, &r, &no_region, &decode);
    assert_eq!(status, MORI_ERR_BUFFER_TOO_SMALL);
    assert!(last_error().contains("prefill side: staging_capacity 0"));

    // NULLs and an unknown staging value.
    // SAFETY: NULL memory pointers, which the library refuses before reading anything.
    let status = unsafe { mori_tp_check_transfer(&config, 0, null(), null(), 0, null(), &decode) };
    assert_eq!(status, MORI_ERR_NULL_POINTER);
    assert!(last_error().contains("prefill is NULL"));
    assert_eq!(
        check_transfer(&config, 4, &r, &prefill, &decode),
        MORI_ERR_INVALID_ARGUMENT
    );
}
