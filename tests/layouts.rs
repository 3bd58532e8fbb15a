//! Any page layout (REFERENCE.md section 11) through the C ABI, against an independent oracle that
//! copies element by element and finds the segments of every order itself: every valid
//! (H, P, D) with H, P, D <= 16; NHD, HND, padded strides, offsets and heads outside pages, mixed
//! between the sides; page sizes 1, 3, 16 and 64 on each side; empty requests, whole pages and
//! partial last pages. Checked: the destination bytes (untouched ones included), the segment
//! list (the order with the fewest segments, ties to the first), the greedy rects (of the order
//! with the fewest rects among those with the fewest segments, ties to the first) and that
//! every rect's rows lie inside the buffers at true, non-negative pitches, the composition law
//! in all four staging modes and the staging region's own layout, and the agreement with
//! REFERENCE.md sections 4-6 on their layouts. Also: layouts whose strides reach the top of the
//! 64-bit range (planned in this test build, which checks integer overflow), and that the work a plan
//! does grows with its pages and entries, not with its tokens.

mod common;

use std::ffi::{CStr, c_void};
use std::ptr::null_mut;

use common::{local_heads, moved_heads, owned_heads, valid_tp};
use mori_tp::ffi::*;
use mori_tp::{PairPlan, Staging};
use mori_tp_testkit::{Rng, mix};

const HOST: MoriSendOptions = MoriSendOptions {
    backend: MORI_BACKEND_HOST,
    flags: 0,
    stream: null_mut(),
};

const MODES: [MoriTpStaging; 4] = [
    MORI_TP_STAGING_NONE,
    MORI_TP_STAGING_SRC,
    MORI_TP_STAGING_DST,
    MORI_TP_STAGING_BOTH,
];

const PAGE_SIZES: [u32; 4] = [1, 3, 16, 64];

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

// ---- the oracle: the documented formulas, written again here (ownership: tests/common) ---

/// Where element (slot, local head) of page `page` lies in a layout.
fn element(l: &MoriTpLayout, page: u64, slot: u64, local: u64) -> u64 {
    page * l.page_stride + l.offset + slot * l.token_stride + local * l.head_stride
}

/// True when the layout holds heads head-major within a page (the documented test).
fn head_major(l: &MoriTpLayout) -> bool {
    l.page_size > 1 && l.head_stride > l.token_stride
}

fn heads_outside_pages(l: &MoriTpLayout) -> bool {
    local_heads(l.total_kv_heads, l.tp_size) > 1 && l.head_stride > l.page_stride
}

/// One side of a request, as the oracle sees it: a layout and pages, or a staging region in
/// token-major order (`chunk` None) or head-major in chunks of `chunk` tokens.
#[derive(Clone, Copy)]
enum Place<'a> {
    Pages {
        layout: &'a MoriTpLayout,
        pages: &'a [i32],
        first_local: u64,
    },
    Region {
        chunk: Option<u64>,
    },
}

struct Pair<'a> {
    src: Place<'a>,
    dst: Place<'a>,
    tokens: u64,
    heads: u64,
    hb: u64,
}

impl Pair<'_> {
    fn address(&self, place: Place<'_>, k: u64, j: u64) -> u64 {
        let (n, hb, tokens) = (self.heads, self.hb, self.tokens);
        match place {
            Place::Pages {
                layout,
                pages,
                first_local,
            } => {
                let ps = u64::from(layout.page_size);
                element(
                    layout,
                    pages[(k / ps) as usize] as u64,
                    k % ps,
                    first_local + j,
                )
            }
            Place::Region { chunk: None } => (k * n + j) * hb,
            Place::Region { chunk: Some(g) } => {
                let c = k / g;
                let g_c = g.min(tokens - c * g);
                c * g * n * hb + (j * g_c + k % g) * hb
            }
        }
    }

    /// The elements in an order: `None` is token-major, `Some(g)` head-major in chunks of g.
    fn elements(&self, order: Option<u64>) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity((self.tokens * self.heads) as usize);
        match order {
            None => {
                for k in 0..self.tokens {
                    for j in 0..self.heads {
                        out.push((k, j));
                    }
                }
            }
            Some(g) => {
                let mut c0 = 0;
                while c0 < self.tokens {
                    let c1 = (c0 + g).min(self.tokens);
                    for j in 0..self.heads {
                        for k in c0..c1 {
                            out.push((k, j));
                        }
                    }
                    c0 = c1;
                }
            }
        }
        out
    }

    /// The segments of an order: runs of consecutive elements contiguous on both sides.
    fn segments(&self, order: Option<u64>) -> Vec<MoriSegment> {
        let mut out: Vec<MoriSegment> = Vec::new();
        for (k, j) in self.elements(order) {
            let (s, d) = (self.address(self.src, k, j), self.address(self.dst, k, j));
            if let Some(last) = out.last_mut()
                && last.src_offset + last.length == s
                && last.dst_offset + last.length == d
            {
                last.length += self.hb;
                continue;
            }
            out.push(MoriSegment {
                src_offset: s,
                dst_offset: d,
                length: self.hb,
            });
        }
        out
    }

    /// The segments of every documented order (token-major, then head-major in chunks of
    /// the prefill page size, the decode page size and all tokens) whose segments are fewest,
    /// in that order.
    fn tied_segments(&self, page_sizes: [u32; 2]) -> Vec<Vec<MoriSegment>> {
        let orders = [
            None,
            Some(u64::from(page_sizes[0])),
            Some(u64::from(page_sizes[1])),
            Some(self.tokens.max(1)),
        ];
        let all: Vec<Vec<MoriSegment>> = orders.iter().map(|&o| self.segments(o)).collect();
        let fewest = all.iter().map(Vec::len).min().unwrap_or(0);
        all.into_iter().filter(|s| s.len() == fewest).collect()
    }

    /// The fewest segments among the documented orders, ties to the first listed.
    fn best_segments(&self, page_sizes: [u32; 2]) -> Vec<MoriSegment> {
        self.tied_segments(page_sizes).swap_remove(0)
    }

    /// The rects of `mori_tp_pair_plan`: among the orders whose segments are fewest, the
    /// greedy rects of the one whose rects are fewest, ties to the first listed.
    fn best_rects(&self, page_sizes: [u32; 2]) -> Vec<MoriCopyRect> {
        self.tied_segments(page_sizes)
            .iter()
            .map(|segments| greedy_rects(segments))
            // The first of the minima.
            .min_by_key(Vec::len)
            .unwrap_or_default()
    }
}

/// Every row of every rect lies inside buffers of the given lengths, and a rect of more than
/// one row advances by pitches of at least its width (as `hipMemcpy2DAsync` needs): the rows
/// are where the pitches put them in true integers, never modulo 2^64.
fn check_rect_rows(rects: &[MoriCopyRect], src_len: u128, dst_len: u128, what: &str) {
    for r in rects {
        assert!(r.height >= 1 && r.width >= 1, "{what}: empty rect {r:?}");
        if r.height > 1 {
            assert!(
                r.src_pitch >= r.width && r.dst_pitch >= r.width,
                "{what}: pitch below the width in {r:?}"
            );
        }
        let last = u128::from(r.height - 1);
        let src_end =
            u128::from(r.src_offset) + last * u128::from(r.src_pitch) + u128::from(r.width);
        let dst_end =
            u128::from(r.dst_offset) + last * u128::from(r.dst_pitch) + u128::from(r.width);
        assert!(
            src_end <= src_len && dst_end <= dst_len,
            "{what}: {r:?} ends at ({src_end}, {dst_end}), past buffers of ({src_len}, {dst_len})"
        );
    }
}

/// The documented greedy rects over a segment list.
fn greedy_rects(segments: &[MoriSegment]) -> Vec<MoriCopyRect> {
    let mut rects: Vec<MoriCopyRect> = Vec::new();
    let mut last: Option<(u64, u64)> = None;
    let mut fixed = false;
    for s in segments {
        if let (Some(r), Some((ls, ld))) = (rects.last_mut(), last)
            && r.width == s.length
            && s.src_offset >= ls
            && s.dst_offset >= ld
        {
            let step = (s.src_offset - ls, s.dst_offset - ld);
            if !fixed && step.0 >= s.length && step.1 >= s.length {
                (r.src_pitch, r.dst_pitch, r.height) = (step.0, step.1, 2);
                fixed = true;
                last = Some((s.src_offset, s.dst_offset));
                continue;
            }
            if fixed && step == (r.src_pitch, r.dst_pitch) {
                r.height += 1;
                last = Some((s.src_offset, s.dst_offset));
                continue;
            }
        }
        rects.push(MoriCopyRect {
            src_offset: s.src_offset,
            dst_offset: s.dst_offset,
            src_pitch: s.length,
            dst_pitch: s.length,
            width: s.length,
            height: 1,
        });
        fixed = false;
        last = Some((s.src_offset, s.dst_offset));
    }
    rects
}

/// True when a side's pages hold the `n` moved heads and nothing else, back to back in an
/// order (`head_major`: head-major in chunks of the page size; else token-major), found from
/// the oracle's own segment count: three consecutive whole pages, walked in that order against
/// a dense region of the same order, are one segment exactly when the slice's elements follow
/// each other page after page.
fn full(l: &MoriTpLayout, first_local: u64, n: u64, head_major: bool) -> bool {
    let ps = u64::from(l.page_size);
    let pages = [0, 1, 2];
    let order = head_major.then_some(ps);
    let pair = Pair {
        src: Place::Pages {
            layout: l,
            pages: &pages,
            first_local,
        },
        dst: Place::Region { chunk: order },
        tokens: 3 * ps,
        heads: n,
        hb: l.head_bytes,
    };
    pair.segments(order).len() == 1
}

/// The staging `mori_tp_pair_staging_for` must choose (REFERENCE.md section 11), with "full" from
/// the oracle's segment counts: not SEND, or both sides full token-major, or both full
/// head-major with one page size: NONE; else the prefill side full in some order: DST; else
/// the decode side full in some order: SRC; else BOTH.
fn oracle_staging_for(
    src: &MoriTpLayout,
    dst: &MoriTpLayout,
    firsts: Option<(u64, u64, u64)>,
) -> MoriTpStaging {
    let Some((src_first, dst_first, n)) = firsts else {
        return MORI_TP_STAGING_NONE;
    };
    let [src_token, src_head] = [false, true].map(|hm| full(src, src_first, n, hm));
    let [dst_token, dst_head] = [false, true].map(|hm| full(dst, dst_first, n, hm));
    if (src_token && dst_token) || (src_head && dst_head && src.page_size == dst.page_size) {
        MORI_TP_STAGING_NONE
    } else if src_token || src_head {
        MORI_TP_STAGING_DST
    } else if dst_token || dst_head {
        MORI_TP_STAGING_SRC
    } else {
        MORI_TP_STAGING_BOTH
    }
}

fn library_staging_for(config: &MoriTpPairConfig) -> MoriTpStaging {
    let mut out = 99;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_staging_for(config, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

// ---- layouts and requests ------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Kind {
    Nhd,
    Hnd,
    /// Token-major with gaps between heads, tokens and pages, and an offset.
    PaddedNhd,
    /// Head-major with gaps and an offset.
    PaddedHnd,
    /// Each head holds its own run of pages (vLLM's LHBNC).
    HeadsOutsidePages,
    /// Token-major with a gap after every head but the last, so a token's last head touches
    /// the next token's first while its heads do not touch each other.
    Gapped,
}

const KINDS: [Kind; 6] = [
    Kind::Nhd,
    Kind::Hnd,
    Kind::PaddedNhd,
    Kind::PaddedHnd,
    Kind::HeadsOutsidePages,
    Kind::Gapped,
];

fn library_layout(kind: Kind, h: u32, tp: u32, rank: u32, ps: u32, hb: u64) -> MoriTpLayout {
    let mut out = MoriTpLayout::default();
    // SAFETY: a valid out-pointer.
    let status = unsafe {
        match kind {
            Kind::Hnd | Kind::PaddedHnd | Kind::HeadsOutsidePages => {
                mori_tp_layout_hnd(h, tp, rank, ps, hb, &mut out)
            }
            Kind::Nhd | Kind::PaddedNhd | Kind::Gapped => {
                mori_tp_layout_nhd(h, tp, rank, ps, hb, &mut out)
            }
        }
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

/// A layout of `kind` for one rank, for buffers of `capacity_pages` pages; `pad` adds gaps.
#[allow(clippy::too_many_arguments)] // one per field of the case being built
fn layout(
    kind: Kind,
    h: u32,
    tp: u32,
    rank: u32,
    ps: u32,
    hb: u64,
    capacity_pages: u64,
    pad: u64,
) -> MoriTpLayout {
    let base = library_layout(kind, h, tp, rank, ps, hb);
    let (l, slots) = (u64::from(local_heads(h, tp)), u64::from(ps));
    match kind {
        Kind::Nhd | Kind::Hnd => base,
        Kind::PaddedNhd => {
            let head_stride = hb + pad;
            let token_stride = (l - 1) * head_stride + hb + 2 * pad;
            let offset = 3 * pad;
            let extent = offset + (slots - 1) * token_stride + (l - 1) * head_stride + hb;
            MoriTpLayout {
                head_stride,
                token_stride,
                offset,
                page_stride: extent + pad,
                ..base
            }
        }
        Kind::PaddedHnd => {
            let token_stride = hb + pad;
            let head_stride = (slots - 1) * token_stride + hb + pad;
            let offset = pad;
            let extent = offset + (slots - 1) * token_stride + (l - 1) * head_stride + hb;
            MoriTpLayout {
                head_stride,
                token_stride,
                offset,
                page_stride: extent + 2 * pad,
                ..base
            }
        }
        Kind::HeadsOutsidePages if l > 1 => {
            let page_stride = slots * hb + pad;
            MoriTpLayout {
                token_stride: hb,
                page_stride,
                offset: pad,
                // Every page of the buffer fits in its head's run.
                head_stride: capacity_pages * page_stride + pad,
                ..base
            }
        }
        // With one local head there is nothing to put outside pages.
        Kind::HeadsOutsidePages => base,
        Kind::Gapped => {
            let head_stride = 2 * hb;
            let token_stride = (l - 1) * head_stride + hb;
            MoriTpLayout {
                head_stride,
                token_stride,
                page_stride: slots * token_stride,
                ..base
            }
        }
    }
}

/// Bytes a buffer of `capacity_pages` pages of a layout spans.
fn buffer_len(l: &MoriTpLayout, capacity_pages: u64) -> usize {
    let local = u64::from(local_heads(l.total_kv_heads, l.tp_size));
    let extent = l.offset
        + (u64::from(l.page_size) - 1) * l.token_stride
        + (local - 1) * l.head_stride
        + l.head_bytes;
    ((capacity_pages - 1) * l.page_stride + extent) as usize
}

/// `count` distinct pages out of `capacity`, in runs of random lengths and random order.
fn pages(rng: &mut Rng, count: usize, capacity: usize) -> Vec<i32> {
    let mut all: Vec<i32> = (0..capacity as i32).collect();
    // Shuffle runs of up to 4 pages, so some pages stay consecutive.
    let mut runs: Vec<Vec<i32>> = all
        .chunks(rng.range(1, 4) as usize)
        .map(<[i32]>::to_vec)
        .collect();
    rng.shuffle(&mut runs);
    all = runs.concat();
    all.truncate(count);
    all
}

fn pattern(salt: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| mix(salt ^ (i as u64) << 8) as u8)
        .collect()
}

// ---- one pair, checked end to end ----------------------------------------------------------

struct Case {
    src_layout: MoriTpLayout,
    dst_layout: MoriTpLayout,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
    tokens: u64,
    src_len: usize,
    dst_len: usize,
}

fn request(case: &Case) -> MoriTpRequest {
    MoriTpRequest {
        src_pages: case.src_pages.as_ptr(),
        num_src_pages: case.src_pages.len(),
        dst_pages: case.dst_pages.as_ptr(),
        num_dst_pages: case.dst_pages.len(),
        num_tokens: case.tokens,
    }
}

fn pair_config(case: &Case) -> MoriTpPairConfig {
    let mut out = MoriTpPairConfig::default();
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_config(&case.src_layout, &case.dst_layout, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

fn library_segments(config: &MoriTpPairConfig, r: &MoriTpRequest, mode: u32) -> Vec<MoriSegment> {
    let mut needed = 0;
    // SAFETY: a size query.
    let status = unsafe { mori_tp_pair_segments(config, r, mode, null_mut(), 0, &mut needed) };
    assert!(
        status == MORI_OK || status == MORI_ERR_BUFFER_TOO_SMALL,
        "{}",
        last_error()
    );
    let mut out = vec![MoriSegment::default(); needed];
    let mut written = 0;
    // SAFETY: an array of `needed` entries.
    let status =
        unsafe { mori_tp_pair_segments(config, r, mode, out.as_mut_ptr(), needed, &mut written) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    assert_eq!(written, needed);
    out
}

fn library_rects(config: &MoriTpPairConfig, r: &MoriTpRequest) -> Vec<MoriCopyRect> {
    let mut needed = 0;
    // SAFETY: a size query.
    let status = unsafe { mori_tp_pair_plan(config, r, null_mut(), 0, &mut needed) };
    assert!(
        status == MORI_OK || status == MORI_ERR_BUFFER_TOO_SMALL,
        "{}",
        last_error()
    );
    let mut out = vec![MoriCopyRect::default(); needed];
    let mut written = 0;
    // SAFETY: an array of `needed` entries.
    let status = unsafe { mori_tp_pair_plan(config, r, out.as_mut_ptr(), needed, &mut written) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

fn staging_len(config: &MoriTpPairConfig, tokens: u64) -> usize {
    let mut out = 0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_pair_staging_len(config, tokens, &mut out) },
        MORI_OK
    );
    out as usize
}

fn copy_segments(segments: &[MoriSegment], from: &[u8], to: &mut [u8]) {
    for s in segments {
        let (f, t, n) = (
            s.src_offset as usize,
            s.dst_offset as usize,
            s.length as usize,
        );
        to[t..t + n].copy_from_slice(&from[f..f + n]);
    }
}

fn send(config: &MoriTpPairConfig, case: &Case, src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
    let src_ptrs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    let dst_ptrs: Vec<*mut c_void> = dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    let buffers = MoriKvBuffers {
        src: src_ptrs.as_ptr(),
        dst: dst_ptrs.as_ptr(),
        num_buffers: src.len(),
        src_capacity: case.src_len as u64,
        dst_capacity: case.dst_len as u64,
    };
    let r = request(case);
    // SAFETY: buffers of the stated capacities.
    let status = unsafe { mori_tp_pair_send(config, &buffers, &r, &HOST) };
    assert_eq!(status, MORI_OK, "{}", last_error());
}

/// Checks one pair of one case; returns the number of segments of the direct transfer.
fn check_pair(case: &Case, what: &str) -> usize {
    let config = pair_config(case);
    let (src_l, dst_l) = (&case.src_layout, &case.dst_layout);
    let h = src_l.total_kv_heads;
    let moved = moved_heads(
        h,
        src_l.tp_size,
        src_l.tp_rank,
        dst_l.tp_size,
        dst_l.tp_rank,
    );
    let r = request(case);
    let buffers = 2usize;
    let src: Vec<Vec<u8>> = (0..buffers)
        .map(|b| pattern(0xA0 + b as u64, case.src_len))
        .collect();
    let initial: Vec<Vec<u8>> = (0..buffers)
        .map(|b| pattern(0xD0 + b as u64, case.dst_len))
        .collect();
    let Some(moved) = moved else {
        assert_ne!(config.action, MORI_TP_ACTION_SEND, "{what}");
        assert_eq!(
            library_staging_for(&config),
            MORI_TP_STAGING_NONE,
            "{what}: staging_for of a pair that does not send"
        );
        assert!(library_segments(&config, &r, MORI_TP_STAGING_NONE).is_empty());
        let mut dst = initial.clone();
        send(&config, case, &src, &mut dst);
        assert_eq!(dst, initial, "{what}: a pair that does not send wrote");
        return 0;
    };
    assert_eq!(config.action, MORI_TP_ACTION_SEND, "{what}");
    assert_eq!(
        (config.first_head, config.num_heads),
        (moved.start, moved.len() as u32)
    );
    let src_first = u64::from(moved.start - owned_heads(h, src_l.tp_size, src_l.tp_rank).start);
    let dst_first = u64::from(moved.start - owned_heads(h, dst_l.tp_size, dst_l.tp_rank).start);
    assert_eq!(
        (
            u64::from(config.src_first_local),
            u64::from(config.dst_first_local)
        ),
        (src_first, dst_first)
    );
    let (n, hb, tokens) = (moved.len() as u64, src_l.head_bytes, case.tokens);
    assert_eq!(
        library_staging_for(&config),
        oracle_staging_for(src_l, dst_l, Some((src_first, dst_first, n))),
        "{what}: staging_for"
    );
    let src_place = Place::Pages {
        layout: src_l,
        pages: &case.src_pages,
        first_local: src_first,
    };
    let dst_place = Place::Pages {
        layout: dst_l,
        pages: &case.dst_pages,
        first_local: dst_first,
    };
    let direct = Pair {
        src: src_place,
        dst: dst_place,
        tokens,
        heads: n,
        hb,
    };

    // The destination, element by element.
    let mut want = initial.clone();
    for (s, w) in src.iter().zip(&mut want) {
        for k in 0..tokens {
            for j in 0..n {
                let (a, b) = (
                    direct.address(src_place, k, j) as usize,
                    direct.address(dst_place, k, j) as usize,
                );
                w[b..b + hb as usize].copy_from_slice(&s[a..a + hb as usize]);
            }
        }
    }
    let mut got = initial.clone();
    send(&config, case, &src, &mut got);
    assert!(
        got == want,
        "{what}: mori_tp_pair_send differs from the oracle"
    );

    // Segments and rects.
    let page_sizes = [src_l.page_size, dst_l.page_size];
    let segments = library_segments(&config, &r, MORI_TP_STAGING_NONE);
    assert_eq!(
        segments,
        direct.best_segments(page_sizes),
        "{what}: segments"
    );
    let rects = library_rects(&config, &r);
    assert_eq!(rects, direct.best_rects(page_sizes), "{what}: rects");
    assert!(rects.len() <= segments.len());
    assert!(rects.len() <= greedy_rects(&segments).len());
    check_rect_rows(&rects, case.src_len as u128, case.dst_len as u128, what);
    let rect_bytes: u64 = rects.iter().map(|r| r.width * r.height).sum();
    assert_eq!(rect_bytes, tokens * n * hb * u64::from(tokens > 0));

    // Staging: the region's own layout, the segments of each mode and the composition law.
    let len = staging_len(&config, tokens);
    assert_eq!(len as u64, tokens * n * hb);
    for mode in MODES {
        let stages_src = mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH;
        let stages_dst = mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH;
        // The region's order: head-major when one side is staged and the other is head-major.
        let chunk = |other: &MoriTpLayout| -> Option<u64> {
            (mode != MORI_TP_STAGING_BOTH && head_major(other)).then(|| {
                if heads_outside_pages(other) {
                    tokens.max(1)
                } else {
                    u64::from(other.page_size)
                }
            })
        };
        let staged = Pair {
            src: if stages_src {
                Place::Region {
                    chunk: chunk(dst_l),
                }
            } else {
                src_place
            },
            dst: if stages_dst {
                Place::Region {
                    chunk: chunk(src_l),
                }
            } else {
                dst_place
            },
            tokens,
            heads: n,
            hb,
        };
        let transport = library_segments(&config, &r, mode);
        assert_eq!(
            transport,
            staged.best_segments(page_sizes),
            "{what} mode {mode}: segments"
        );
        check_walked_segments(case, mode, transport.len(), what);
        let region_len = buffers * len;
        let mut src_region = vec![0x11u8; region_len];
        if stages_src {
            let ptrs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
            // SAFETY: buffers and a region of the stated sizes.
            let status = unsafe {
                mori_tp_pair_pack(
                    &config,
                    mode,
                    ptrs.as_ptr(),
                    buffers,
                    case.src_len as u64,
                    &r,
                    src_region.as_mut_ptr().cast(),
                    region_len as u64,
                    &HOST,
                )
            };
            assert_eq!(status, MORI_OK, "{what} pack {mode}: {}", last_error());
            // The region holds the slice in the documented order.
            for (b, s) in src.iter().enumerate() {
                for k in 0..tokens {
                    for j in 0..n {
                        let at = b * len + staged.address(staged.src, k, j) as usize;
                        let from = direct.address(src_place, k, j) as usize;
                        assert_eq!(
                            src_region[at..at + hb as usize],
                            s[from..from + hb as usize],
                            "{what} pack {mode}: region element ({k}, {j})"
                        );
                    }
                }
            }
        }
        let mut dst = initial.clone();
        let mut dst_region = vec![0x22u8; region_len];
        for b in 0..buffers {
            let from: &[u8] = if stages_src {
                &src_region[b * len..(b + 1) * len]
            } else {
                &src[b]
            };
            let to: &mut [u8] = if stages_dst {
                &mut dst_region[b * len..(b + 1) * len]
            } else {
                &mut dst[b]
            };
            copy_segments(&transport, from, to);
        }
        if stages_dst {
            let mut ptrs: Vec<*mut c_void> =
                dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
            // SAFETY: buffers and a region of the stated sizes.
            let status = unsafe {
                mori_tp_pair_unpack(
                    &config,
                    mode,
                    dst_region.as_ptr().cast(),
                    region_len as u64,
                    ptrs.as_mut_ptr(),
                    buffers,
                    case.dst_len as u64,
                    &r,
                    &HOST,
                )
            };
            assert_eq!(status, MORI_OK, "{what} unpack {mode}: {}", last_error());
        }
        assert!(dst == want, "{what} mode {mode}: the composition law fails");
    }
    segments.len()
}

/// The plans' fast segment count (what `mori_tp_pair_segments` sizes its answer by, which
/// skips work where rows cannot touch) equals the count from walking every element, for the
/// transport plan of `mode` and for the pack and unpack plans it implies; the transport's is
/// `transport` (the list the C ABI returned).
fn check_walked_segments(case: &Case, mode: MoriTpStaging, transport: usize, what: &str) {
    let config = mori_tp::pair_config(&case.src_layout, &case.dst_layout).unwrap();
    let request = mori_tp::Request {
        src_pages: &case.src_pages,
        dst_pages: &case.dst_pages,
        num_tokens: case.tokens,
    };
    let staging = [Staging::None, Staging::Src, Staging::Dst, Staging::Both][mode as usize];
    let mut plans = vec![("transfer", PairPlan::transfer(&config, &request, staging))];
    if staging.stages_src() {
        plans.push(("pack", PairPlan::pack(&config, staging, &request)));
    }
    if staging.stages_dst() {
        plans.push(("unpack", PairPlan::unpack(&config, staging, &request)));
    }
    for (name, plan) in plans {
        let plan = plan.unwrap_or_else(|e| panic!("{what} {name} {mode}: {e}"));
        let counted = plan.num_segments().unwrap();
        assert_eq!(
            plan.walked_segments(),
            counted as u64,
            "{what} {name} mode {mode}: counted and walked segments differ"
        );
        if name == "transfer" {
            assert_eq!(counted, transport, "{what} mode {mode}: count");
        }
    }
}

/// A random case for one pair: a layout kind and page size per side, and a request; with the
/// two kinds drawn.
fn random_case(rng: &mut Rng, h: u32, p_tp: u32, p: u32, d_tp: u32, d: u32) -> (Case, [Kind; 2]) {
    // `Rng::range` is inclusive at both ends: every kind, page size and head size can be drawn.
    let mut pick = |len: usize| rng.range(0, len as u64 - 1) as usize;
    let kinds = [KINDS[pick(KINDS.len())], KINDS[pick(KINDS.len())]];
    let page_sizes = [
        PAGE_SIZES[pick(PAGE_SIZES.len())],
        PAGE_SIZES[pick(PAGE_SIZES.len())],
    ];
    const HEAD_BYTES: [u64; 5] = [1, 2, 4, 6, 8];
    let hb = HEAD_BYTES[pick(HEAD_BYTES.len())];
    let max_ps = u64::from(page_sizes[0].max(page_sizes[1]));
    // Empty, whole pages of the larger size, or anything up to two of them.
    let tokens = match rng.range(0, 5) {
        0 => 0,
        1 => max_ps * rng.range(1, 2),
        _ => rng.range(1, 2 * max_ps + 3),
    };
    let case = build_case(
        rng,
        h,
        [(p_tp, p), (d_tp, d)],
        kinds,
        page_sizes,
        hb,
        tokens,
    );
    (case, kinds)
}

fn build_case(
    rng: &mut Rng,
    h: u32,
    ranks: [(u32, u32); 2],
    kinds: [Kind; 2],
    page_sizes: [u32; 2],
    hb: u64,
    tokens: u64,
) -> Case {
    let pad = rng.range(1, 3) * hb;
    let mut sides = ranks
        .iter()
        .zip(kinds)
        .zip(page_sizes)
        .map(|((&(tp, rank), kind), ps)| {
            let count = tokens.div_ceil(u64::from(ps)) as usize;
            let capacity = count + rng.range(1, 3) as usize;
            let layout = layout(kind, h, tp, rank, ps, hb, capacity as u64, pad);
            let list = pages(rng, count, capacity);
            (layout, list, buffer_len(&layout, capacity as u64))
        });
    let (src_layout, src_pages, src_len) = sides.next().unwrap();
    let (dst_layout, dst_pages, dst_len) = sides.next().unwrap();
    Case {
        src_layout,
        dst_layout,
        src_pages,
        dst_pages,
        tokens,
        src_len,
        dst_len,
    }
}

#[test]
fn every_valid_tp_pairing_up_to_16_moves_the_oracles_bytes_in_any_layout() {
    let mut checked = 0;
    // How often each kind was drawn, per side: the sweep must cover every one on both.
    let mut drawn = [[0usize; KINDS.len()]; 2];
    for h in 1..=16u32 {
        for p_tp in (1..=16u32).filter(|&t| valid_tp(h, t)) {
            for d_tp in (1..=16u32).filter(|&t| valid_tp(h, t)) {
                let mut rng = Rng::new(mix(u64::from(h) << 40
                    | u64::from(p_tp) << 20
                    | u64::from(d_tp)));
                // Every decode rank, with its senders and one rank that does not send to it.
                for d in 0..d_tp {
                    for p in 0..p_tp {
                        let sends = moved_heads(h, p_tp, p, d_tp, d).is_some();
                        if !sends && rng.range(0, 7) != 0 {
                            continue;
                        }
                        let (case, kinds) = random_case(&mut rng, h, p_tp, p, d_tp, d);
                        for (side, kind) in kinds.into_iter().enumerate() {
                            drawn[side][kind as usize] += 1;
                        }
                        let what = format!(
                            "H {h} P {p_tp} D {d_tp} pair ({p}, {d}): {:?} -> {:?}, {} tokens",
                            case.src_layout, case.dst_layout, case.tokens
                        );
                        check_pair(&case, &what);
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "only {checked} pairs checked");
    for (side, counts) in ["prefill", "decode"].iter().zip(drawn) {
        for (kind, count) in KINDS.iter().zip(counts) {
            assert!(
                count > 0,
                "the sweep never drew {kind:?} on the {side} side"
            );
        }
    }
}

#[test]
fn every_page_size_pairing_and_layout_mix_with_whole_and_partial_pages() {
    // 8 KV heads, prefill TP 2 -> decode TP 8 and back, every layout kind on each side, every
    // pair of page sizes, requests empty, of whole pages and ending in a partial page.
    let mut rng = Rng::new(7);
    for (p_tp, d_tp) in [(2u32, 8u32), (8, 2), (4, 4)] {
        for (src_kind, dst_kind) in KINDS
            .iter()
            .flat_map(|&a| KINDS.iter().map(move |&b| (a, b)))
        {
            for (src_ps, dst_ps) in PAGE_SIZES
                .iter()
                .flat_map(|&a| PAGE_SIZES.iter().map(move |&b| (a, b)))
            {
                let whole = u64::from(src_ps.max(dst_ps)) * 2;
                for tokens in [0, whole, whole + 1, whole - 1] {
                    let (p, d) = (
                        rng.range(0, u64::from(p_tp) - 1) as u32,
                        rng.range(0, u64::from(d_tp) - 1) as u32,
                    );
                    let case = build_case(
                        &mut rng,
                        8,
                        [(p_tp, p), (d_tp, d)],
                        [src_kind, dst_kind],
                        [src_ps, dst_ps],
                        4,
                        tokens,
                    );
                    let what = format!(
                        "{src_kind:?} {src_ps} -> {dst_kind:?} {dst_ps}, TP {p_tp} -> {d_tp} ({p}, {d}), {tokens} tokens"
                    );
                    check_pair(&case, &what);
                }
            }
        }
    }
}

#[test]
fn head_major_pages_holding_exactly_the_moved_heads_are_one_segment_per_run() {
    // vLLM on ROCm: 8 KV heads, HND, prefill TP 8 (1 head) -> decode TP 8 (1 head), page 16:
    // every page is the slice, so a run of pages is one segment.
    let mut rng = Rng::new(3);
    let case = build_case(
        &mut rng,
        8,
        [(8, 3), (8, 3)],
        [Kind::Hnd, Kind::Hnd],
        [16, 16],
        256,
        16 * 6,
    );
    let config = pair_config(&case);
    let segments = library_segments(&config, &request(&case), MORI_TP_STAGING_NONE);
    let runs = case
        .src_pages
        .windows(2)
        .zip(case.dst_pages.windows(2))
        .filter(|(s, d)| s[1] != s[0] + 1 || d[1] != d[0] + 1)
        .count()
        + 1;
    assert_eq!(segments.len(), runs);
    // HND 4 local heads -> 1 local head (TP 2 -> 8): each head's page run is one segment.
    let case = build_case(
        &mut rng,
        8,
        [(2, 0), (8, 1)],
        [Kind::Hnd, Kind::Hnd],
        [16, 16],
        256,
        16 * 6,
    );
    let config = pair_config(&case);
    let segments = library_segments(&config, &request(&case), MORI_TP_STAGING_NONE);
    assert_eq!(
        segments.len(),
        6,
        "one per page: the prefill page holds 3 other heads"
    );
    // HND 2 local heads -> 4 local heads (TP 4 -> 2): a page's two moved heads are one run on
    // both sides, so one segment per page (token-major order would give two per token).
    let case = build_case(
        &mut rng,
        8,
        [(4, 1), (2, 0)],
        [Kind::Hnd, Kind::Hnd],
        [16, 16],
        256,
        16 * 6,
    );
    let config = pair_config(&case);
    assert_eq!(config.num_heads, 2);
    let segments = library_segments(&config, &request(&case), MORI_TP_STAGING_NONE);
    assert_eq!(segments.len(), 6);
    assert!(segments.iter().all(|s| s.length == 2 * 16 * 256));
}

// ---- agreement with REFERENCE.md sections 4-6 ---------------------------------------------------

fn section4_config(
    h: u32,
    p_tp: u32,
    p: u32,
    d_tp: u32,
    d: u32,
    ps: u32,
    hb: u64,
) -> MoriTpSliceConfig {
    let item = |tp| u64::from(ps) * u64::from(local_heads(h, tp)) * hb;
    let params = MoriTpSliceParams {
        prefill_tp_size: p_tp,
        prefill_tp_rank: p,
        decode_tp_size: d_tp,
        decode_tp_rank: d,
        total_kv_heads: h,
        page_size: ps,
        src_item_len: item(p_tp),
        dst_item_len: item(d_tp),
    };
    let mut out = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    assert_eq!(unsafe { mori_tp_slice_config(&params, &mut out) }, MORI_OK);
    out
}

#[test]
fn on_section_4_layouts_the_pair_functions_agree_with_sections_4_and_5() {
    let mut rng = Rng::new(11);
    for (h, p_tp, d_tp) in [
        (4u32, 2u32, 8u32),
        (8, 8, 2),
        (4, 12, 8),
        (12, 6, 4),
        (1, 4, 2),
        (8, 2, 2),
    ] {
        for ps in [1u32, 16] {
            for p in 0..p_tp {
                for d in 0..d_tp {
                    let hb = 8;
                    let num_pages = rng.range(0, 9) as usize;
                    let capacity = num_pages + 3;
                    let src_pages = pages(&mut rng, num_pages, capacity);
                    let dst_pages = pages(&mut rng, num_pages, capacity);
                    let c4 = section4_config(h, p_tp, p, d_tp, d, ps, hb);
                    let case = Case {
                        src_layout: library_layout(Kind::Nhd, h, p_tp, p, ps, hb),
                        dst_layout: library_layout(Kind::Nhd, h, d_tp, d, ps, hb),
                        src_pages: src_pages.clone(),
                        dst_pages: dst_pages.clone(),
                        tokens: num_pages as u64 * u64::from(ps),
                        src_len: capacity * c4.src_item_len as usize,
                        dst_len: capacity * c4.dst_item_len as usize,
                    };
                    let config = pair_config(&case);
                    let r = request(&case);
                    let what = format!("H {h} TP {p_tp} -> {d_tp} ({p}, {d}) page {ps}");
                    let (mut staging4, mut staging7) = (9, 9);
                    // SAFETY: valid pointers.
                    unsafe {
                        assert_eq!(mori_tp_staging_for(&c4, &mut staging4), MORI_OK);
                        assert_eq!(mori_tp_pair_staging_for(&config, &mut staging7), MORI_OK);
                    }
                    assert_eq!(staging7, staging4, "{what}: staging_for");
                    let mut len4 = 0;
                    // SAFETY: valid pointers.
                    assert_eq!(
                        unsafe { mori_tp_staging_len(&c4, num_pages, &mut len4) },
                        MORI_OK
                    );
                    assert_eq!(staging_len(&config, case.tokens) as u64, len4, "{what}");
                    for mode in MODES {
                        let mut needed = 0;
                        // SAFETY: a size query, then an array of that size.
                        let four = unsafe {
                            mori_tp_plan_transfer(
                                &c4,
                                mode,
                                src_pages.as_ptr(),
                                dst_pages.as_ptr(),
                                num_pages,
                                null_mut(),
                                0,
                                &mut needed,
                            );
                            let mut out = vec![MoriSegment::default(); needed];
                            let status = mori_tp_plan_transfer(
                                &c4,
                                mode,
                                src_pages.as_ptr(),
                                dst_pages.as_ptr(),
                                num_pages,
                                out.as_mut_ptr(),
                                needed,
                                &mut needed,
                            );
                            assert_eq!(status, MORI_OK);
                            out
                        };
                        assert_eq!(
                            library_segments(&config, &r, mode),
                            four,
                            "{what} mode {mode}"
                        );
                    }
                    let mut needed = 0;
                    // SAFETY: a size query.
                    unsafe {
                        mori_tp_plan(
                            &c4,
                            src_pages.as_ptr(),
                            dst_pages.as_ptr(),
                            num_pages,
                            null_mut(),
                            0,
                            &mut needed,
                        )
                    };
                    let rects = library_rects(&config, &r);
                    assert!(
                        rects.len() <= needed,
                        "{what}: {} pair rects, {needed} uniform rects",
                        rects.len()
                    );
                    // The same bytes move: the pair send equals the slice-config send's.
                    let src: Vec<Vec<u8>> = (0..2).map(|b| pattern(b, case.src_len)).collect();
                    let initial: Vec<Vec<u8>> =
                        (0..2).map(|b| pattern(b + 9, case.dst_len)).collect();
                    let mut pair_dst = initial.clone();
                    send(&config, &case, &src, &mut pair_dst);
                    let mut dst4 = initial.clone();
                    let src_ptrs: Vec<*const c_void> =
                        src.iter().map(|b| b.as_ptr().cast()).collect();
                    let dst_ptrs: Vec<*mut c_void> =
                        dst4.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
                    let buffers = MoriKvBuffers {
                        src: src_ptrs.as_ptr(),
                        dst: dst_ptrs.as_ptr(),
                        num_buffers: 2,
                        src_capacity: case.src_len as u64,
                        dst_capacity: case.dst_len as u64,
                    };
                    // SAFETY: buffers of the stated capacities.
                    let status = unsafe {
                        mori_tp_kvcache_send(
                            &c4,
                            &buffers,
                            src_pages.as_ptr(),
                            dst_pages.as_ptr(),
                            num_pages,
                            &HOST,
                        )
                    };
                    assert_eq!(status, MORI_OK);
                    assert!(
                        pair_dst == dst4,
                        "{what}: the pair send differs from the slice-config send's"
                    );
                    check_region_agreement(&config, &c4, &case, &src, &initial, &what);
                }
            }
        }
    }
}

/// On a uniform layout, the pair pack writes the region `mori_tp_kvcache_pack` writes (SRC and
/// BOTH), and the pair unpack of one region leaves the destination as `mori_tp_kvcache_unpack`
/// leaves it (DST and BOTH): the region contents agree, bytes past the region included.
fn check_region_agreement(
    config: &MoriTpPairConfig,
    c4: &MoriTpSliceConfig,
    case: &Case,
    src: &[Vec<u8>],
    initial: &[Vec<u8>],
    what: &str,
) {
    let buffers = src.len();
    let r = request(case);
    let region_len = buffers * staging_len(config, case.tokens);
    // A tail past the region, which neither call may touch.
    let fill = vec![0x5Eu8; region_len + 64];
    let src_ptrs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
    for mode in [MORI_TP_STAGING_SRC, MORI_TP_STAGING_BOTH] {
        let (mut region7, mut region4) = (fill.clone(), fill.clone());
        // SAFETY: buffers and regions of the stated sizes.
        let status = unsafe {
            mori_tp_pair_pack(
                config,
                mode,
                src_ptrs.as_ptr(),
                buffers,
                case.src_len as u64,
                &r,
                region7.as_mut_ptr().cast(),
                region_len as u64,
                &HOST,
            )
        };
        assert_eq!(status, MORI_OK, "{what} pair pack {mode}: {}", last_error());
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_kvcache_pack(
                c4,
                src_ptrs.as_ptr(),
                buffers,
                case.src_len as u64,
                case.src_pages.as_ptr(),
                case.src_pages.len(),
                region4.as_mut_ptr().cast(),
                region_len as u64,
                &HOST,
            )
        };
        assert_eq!(status, MORI_OK, "{what} pack: {}", last_error());
        assert!(
            region7 == region4,
            "{what} mode {mode}: the pair pack's region differs from mori_tp_kvcache_pack's"
        );
        if config.action == MORI_TP_ACTION_SEND && region_len > 0 {
            assert_ne!(
                region7[..region_len],
                fill[..region_len],
                "{what}: packed nothing"
            );
        }
    }
    let region = pattern(0x3D, region_len);
    for mode in [MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH] {
        let (mut dst7, mut dst4) = (initial.to_vec(), initial.to_vec());
        let ptrs7: Vec<*mut c_void> = dst7.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let ptrs4: Vec<*mut c_void> = dst4.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        // SAFETY: buffers and a region of the stated sizes.
        let status = unsafe {
            mori_tp_pair_unpack(
                config,
                mode,
                region.as_ptr().cast(),
                region_len as u64,
                ptrs7.as_ptr(),
                buffers,
                case.dst_len as u64,
                &r,
                &HOST,
            )
        };
        assert_eq!(
            status,
            MORI_OK,
            "{what} pair unpack {mode}: {}",
            last_error()
        );
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_kvcache_unpack(
                c4,
                region.as_ptr().cast(),
                region_len as u64,
                ptrs4.as_ptr(),
                buffers,
                case.dst_len as u64,
                case.dst_pages.as_ptr(),
                case.dst_pages.len(),
                &HOST,
            )
        };
        assert_eq!(status, MORI_OK, "{what} unpack: {}", last_error());
        assert!(
            dst7 == dst4,
            "{what} mode {mode}: the pair unpack differs from mori_tp_kvcache_unpack"
        );
        if config.action == MORI_TP_ACTION_SEND && region_len > 0 {
            assert!(dst7 != initial, "{what}: unpacked nothing");
        }
    }
}

// ---- edge cases: any stride a side ignores, strides at the top of 64 bits, work -------------

/// The places of a case's two sides, its moved heads and page sizes, as the oracle needs them;
/// `None` for a pair that does not send.
fn direct_pair(case: &Case) -> Option<Pair<'_>> {
    let (src_l, dst_l) = (&case.src_layout, &case.dst_layout);
    let h = src_l.total_kv_heads;
    let moved = moved_heads(
        h,
        src_l.tp_size,
        src_l.tp_rank,
        dst_l.tp_size,
        dst_l.tp_rank,
    )?;
    let first =
        |l: &MoriTpLayout| u64::from(moved.start - owned_heads(h, l.tp_size, l.tp_rank).start);
    Some(Pair {
        src: Place::Pages {
            layout: src_l,
            pages: &case.src_pages,
            first_local: first(src_l),
        },
        dst: Place::Pages {
            layout: dst_l,
            pages: &case.dst_pages,
            first_local: first(dst_l),
        },
        tokens: case.tokens,
        heads: moved.len() as u64,
        hb: src_l.head_bytes,
    })
}

/// Bytes a buffer needs for the pages of a case's side, in true integers (the case's own
/// lengths may not fit a buffer that could be allocated here).
fn needed_len(l: &MoriTpLayout, pages: &[i32]) -> u128 {
    let local = u128::from(local_heads(l.total_kv_heads, l.tp_size));
    let extent = u128::from(l.offset)
        + u128::from(l.page_size - 1) * u128::from(l.token_stride)
        + (local - 1) * u128::from(l.head_stride)
        + u128::from(l.head_bytes);
    pages
        .iter()
        .map(|&p| p as u128 * u128::from(l.page_stride) + extent)
        .max()
        .unwrap_or(0)
}

/// Everything of a case that moves no bytes, against the oracle: the segments of every
/// staging mode (and that their fast count equals a walk of every element, for the transfer,
/// pack and unpack plans), and the rects, whose rows must lie inside the pages' buffers at true
/// pitches. For layouts whose buffers could not be allocated.
fn check_plans(case: &Case, what: &str) {
    let config = pair_config(case);
    let r = request(case);
    let Some(direct) = direct_pair(case) else {
        assert!(library_segments(&config, &r, MORI_TP_STAGING_NONE).is_empty());
        assert!(library_rects(&config, &r).is_empty());
        return;
    };
    let (src_l, dst_l) = (&case.src_layout, &case.dst_layout);
    let page_sizes = [src_l.page_size, dst_l.page_size];
    let segments = library_segments(&config, &r, MORI_TP_STAGING_NONE);
    assert_eq!(
        segments,
        direct.best_segments(page_sizes),
        "{what}: segments"
    );
    let rects = library_rects(&config, &r);
    assert_eq!(rects, direct.best_rects(page_sizes), "{what}: rects");
    check_rect_rows(
        &rects,
        needed_len(src_l, &case.src_pages),
        needed_len(dst_l, &case.dst_pages),
        what,
    );
    for mode in MODES {
        let stages = |side| {
            mode == MORI_TP_STAGING_BOTH
                || mode == [MORI_TP_STAGING_SRC, MORI_TP_STAGING_DST][side as usize]
        };
        let chunk = |other: &MoriTpLayout| -> Option<u64> {
            (mode != MORI_TP_STAGING_BOTH && head_major(other)).then(|| {
                if heads_outside_pages(other) {
                    case.tokens.max(1)
                } else {
                    u64::from(other.page_size)
                }
            })
        };
        let staged = Pair {
            src: if stages(0) {
                Place::Region {
                    chunk: chunk(dst_l),
                }
            } else {
                direct.src
            },
            dst: if stages(1) {
                Place::Region {
                    chunk: chunk(src_l),
                }
            } else {
                direct.dst
            },
            ..direct
        };
        let transport = library_segments(&config, &r, mode);
        assert_eq!(
            transport,
            staged.best_segments(page_sizes),
            "{what} mode {mode}: segments"
        );
        check_walked_segments(case, mode, transport.len(), what);
    }
}

/// A case of two layouts given field by field and their pages.
fn case_of(
    src_layout: MoriTpLayout,
    dst_layout: MoriTpLayout,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
    tokens: u64,
) -> Case {
    let len = |l: &MoriTpLayout, pages: &[i32]| {
        usize::try_from(needed_len(l, pages)).unwrap_or(usize::MAX)
    };
    Case {
        src_len: len(&src_layout, &src_pages),
        dst_len: len(&dst_layout, &dst_pages),
        src_layout,
        dst_layout,
        src_pages,
        dst_pages,
        tokens,
    }
}

#[test]
fn a_side_of_one_slot_pages_may_carry_any_token_stride_and_rects_keep_true_pitches() {
    // One head of 4 bytes, one slot per page; the decode side's token stride, which a page of
    // one slot never uses, is 2^64 - 4, and its pages go down: [1, 0]. Row 1 of a rect joining
    // the two tokens would sit at 4 + (2^64 - 4), right only modulo 2^64.
    let one = |token_stride| MoriTpLayout {
        total_kv_heads: 1,
        tp_size: 1,
        tp_rank: 0,
        page_size: 1,
        head_bytes: 4,
        page_stride: 4,
        offset: 0,
        token_stride,
        head_stride: 4,
    };
    let case = case_of(one(4), one(u64::MAX - 3), vec![0, 1], vec![1, 0], 2);
    let config = pair_config(&case);
    let r = request(&case);
    let rect = |src, dst| MoriCopyRect {
        src_offset: src,
        dst_offset: dst,
        src_pitch: 4,
        dst_pitch: 4,
        width: 4,
        height: 1,
    };
    assert_eq!(library_rects(&config, &r), [rect(0, 4), rect(4, 0)]);
    let segments = library_segments(&config, &r, MORI_TP_STAGING_NONE);
    let offsets: Vec<_> = segments
        .iter()
        .map(|s| (s.src_offset, s.dst_offset, s.length))
        .collect();
    assert_eq!(offsets, [(0, 4, 4), (4, 0, 4)]);
    let src = vec![(1u8..=8).collect::<Vec<u8>>()];
    let mut dst = vec![vec![0u8; 8]];
    send(&config, &case, &src, &mut dst);
    assert_eq!(dst[0], [5, 6, 7, 8, 1, 2, 3, 4]);
    check_pair(&case, "page 1, token stride 2^64 - 4");

    // Every layout kind, with each side of one-slot pages given a token stride it ignores,
    // checked end to end (bytes, segments, rects inside the buffers, staging modes).
    let mut rng = Rng::new(41);
    let strides = [0, 1, 3, 1 << 40, 1 << 63, u64::MAX - 3, u64::MAX];
    let mut checked = 0;
    for round in 0..400 {
        let kinds = [0, 1].map(|_| KINDS[rng.range(0, KINDS.len() as u64 - 1) as usize]);
        let page_sizes = [0, 1].map(|_| [1, 1, 3, 16][rng.range(0, 3) as usize]);
        if page_sizes != [1, 1] && rng.range(0, 1) == 0 {
            continue;
        }
        let max_ps = u64::from(page_sizes[0].max(page_sizes[1]));
        let tokens = rng.range(0, 3 * max_ps + 2);
        let (p_tp, d_tp) = [(2u32, 8u32), (8, 2), (4, 4), (8, 8), (1, 1)][rng.range(0, 4) as usize];
        let (p, d) = (
            rng.range(0, u64::from(p_tp) - 1) as u32,
            rng.range(0, u64::from(d_tp) - 1) as u32,
        );
        let hb = [1, 2, 4, 8][rng.range(0, 3) as usize];
        let mut case = build_case(
            &mut rng,
            8,
            [(p_tp, p), (d_tp, d)],
            kinds,
            page_sizes,
            hb,
            tokens,
        );
        for layout in [&mut case.src_layout, &mut case.dst_layout] {
            if layout.page_size == 1 {
                layout.token_stride = strides[rng.range(0, strides.len() as u64 - 1) as usize];
            }
        }
        let what = format!(
            "round {round}: {kinds:?} pages {page_sizes:?}, TP {p_tp} -> {d_tp} ({p}, {d}), \
             {tokens} tokens, token strides {} / {}",
            case.src_layout.token_stride, case.dst_layout.token_stride
        );
        check_pair(&case, &what);
        checked += 1;
    }
    assert!(checked > 150, "only {checked} cases checked");
}

#[test]
fn strides_at_the_top_of_the_64_bit_range_plan_without_overflow() {
    // Heads outside pages: the decode rank's second head holds its run of pages from byte
    // 2^63. The segment writer must not step past the last segment (2^63 + 2^63).
    let src = MoriTpLayout {
        total_kv_heads: 2,
        tp_size: 1,
        tp_rank: 0,
        page_size: 1,
        head_bytes: 16,
        page_stride: 32,
        offset: 0,
        token_stride: 32,
        head_stride: 16,
    };
    let dst = MoriTpLayout {
        page_stride: 16,
        token_stride: 16,
        head_stride: 1 << 63,
        ..src
    };
    let case = case_of(src, dst, vec![0], vec![0], 1);
    let config = pair_config(&case);
    let segments = library_segments(&config, &request(&case), MORI_TP_STAGING_NONE);
    let offsets: Vec<_> = segments
        .iter()
        .map(|s| (s.src_offset, s.dst_offset, s.length))
        .collect();
    assert_eq!(offsets, [(0, 0, 16), (16, 1 << 63, 16)]);
    check_plans(&case, "second head at 2^63");

    // Layouts whose strides and pages reach toward 2^64, mixed on both sides, with pages in
    // any order: every plan equals the oracle's, with no overflow (this build checks).
    let mut rng = Rng::new(43);
    let mut kinds_drawn = [0; 4];
    for round in 0..800 {
        let heads = [1u32, 2, 4][rng.range(0, 2) as usize];
        let (p_tp, d_tp) = [(1u32, 1u32), (1, 2), (2, 1), (2, 4), (4, 2)][rng.range(0, 4) as usize];
        if !valid_tp(heads, p_tp) || !valid_tp(heads, d_tp) {
            continue;
        }
        let hb = [1u64, 4, 16][rng.range(0, 2) as usize];
        // One rank's layout, for buffers of three pages ending at most at 2^64 - 1.
        let mut layout = |tp: u32| -> MoriTpLayout {
            let l = u64::from(local_heads(heads, tp));
            let mut kind = rng.range(0, 3);
            if kind == 2 && l == 1 {
                kind = 3;
            }
            kinds_drawn[kind as usize] += 1;
            let ps = if kind == 3 {
                1
            } else {
                [1u32, 2, 3, 5][rng.range(0, 3) as usize]
            };
            let slots = u64::from(ps);
            let top = u64::MAX - rng.range(0, 64);
            let base = MoriTpLayout {
                total_kv_heads: heads,
                tp_size: tp,
                tp_rank: rng.range(0, u64::from(tp) - 1) as u32,
                page_size: ps,
                head_bytes: hb,
                page_stride: 0,
                offset: 0,
                token_stride: hb,
                head_stride: hb,
            };
            match kind {
                // Token-major, pages 2^62 apart.
                0 => MoriTpLayout {
                    token_stride: l * hb,
                    page_stride: 1 << 62,
                    offset: rng.range(0, 1 << 20),
                    ..base
                },
                // Head-major inside pages, heads 2^60 apart, pages as far apart as fits.
                1 => {
                    let head_stride = if l > 1 { 1 << 60 } else { hb };
                    let extent = (slots - 1) * hb + (l - 1) * head_stride + hb;
                    MoriTpLayout {
                        head_stride,
                        page_stride: (top - extent) / 2,
                        ..base
                    }
                }
                // Heads outside pages, each head's run as long as fits.
                2 => {
                    let page_stride = slots * hb + rng.range(0, 8);
                    MoriTpLayout {
                        page_stride,
                        head_stride: (top - 3 * page_stride) / (l - 1),
                        ..base
                    }
                }
                // Pages of one slot, with any token stride, at the top.
                _ => MoriTpLayout {
                    token_stride: rng.next_u64(),
                    page_stride: (top - l * hb) / 2,
                    ..base
                },
            }
        };
        let (src, dst) = (layout(p_tp), layout(d_tp));
        let tokens = rng.range(0, 3 * u64::from(src.page_size.min(dst.page_size)));
        let mut pages = |l: &MoriTpLayout| {
            let mut all = vec![0, 1, 2];
            rng.shuffle(&mut all);
            all.truncate(tokens.div_ceil(u64::from(l.page_size)) as usize);
            all
        };
        let (src_pages, dst_pages) = (pages(&src), pages(&dst));
        let case = case_of(src, dst, src_pages, dst_pages, tokens);
        let what = format!(
            "round {round}: {src:?} {:?} -> {dst:?} {:?}, {tokens} tokens",
            case.src_pages, case.dst_pages
        );
        check_plans(&case, &what);
    }
    assert!(
        kinds_drawn.iter().all(|&n| n > 50),
        "layout kinds drawn: {kinds_drawn:?}"
    );
}

#[test]
fn hnd_pages_into_nhd_pages_at_one_tp_take_one_rect_per_page_and_head() {
    // 8 KV heads at TP 4 on both sides (2 heads per rank), pages of 16, 4096 tokens. Every
    // order gives one segment per (token, head): 8192. Token-major order groups them into a
    // 2-row rect per token (4096 rects); head-major in chunks of 16 into a 16-row rect per
    // (page, head): 512, which the plan takes. (Pages apart, so that no page's last element
    // touches the next page's first.)
    for (kinds, what) in [
        ([Kind::Hnd, Kind::Nhd], "HND 16 -> NHD 16, TP 4 -> 4"),
        ([Kind::Nhd, Kind::Hnd], "NHD 16 -> HND 16, TP 4 -> 4"),
    ] {
        let [src, dst] = kinds.map(|kind| library_layout(kind, 8, 4, 1, 16, 256));
        let src_pages = (0..256).map(|i| 2 * i).collect();
        let dst_pages = (0..256).map(|i| 3 * i + 1).collect();
        let case = case_of(src, dst, src_pages, dst_pages, 4096);
        let config = pair_config(&case);
        let r = request(&case);
        let segments = library_segments(&config, &r, MORI_TP_STAGING_NONE);
        assert_eq!(segments.len(), 8192, "{what}: segments");
        assert_eq!(
            greedy_rects(&segments).len(),
            4096,
            "{what}: token-major rects"
        );
        let rects = library_rects(&config, &r);
        assert_eq!(rects.len(), 512, "{what}: rects");
        assert!(
            rects.iter().all(|r| (r.width, r.height) == (256, 16)),
            "{what}: a rect per (page, head)"
        );
        check_pair(&case, what);
    }
}

/// The rects of a request through the C ABI, and the steps of work the plans did (the size
/// query's and the filling call's).
fn rects_and_work(config: &MoriTpPairConfig, r: &MoriTpRequest) -> (Vec<MoriCopyRect>, u64) {
    let before = mori_tp::plan::work_steps();
    let rects = library_rects(config, r);
    (rects, mori_tp::plan::work_steps() - before)
}

#[test]
fn a_plans_work_grows_with_its_pages_and_entries_never_with_its_tokens() {
    // Two pages of P slots on each side, P up to 2^30 (2^31 tokens). Each shape's rects do not
    // depend on P; nor may the work of planning them.
    let gapped = |p: u32| MoriTpLayout {
        // Two heads of 2 bytes, 4 apart, in slots of 8: every order gives a segment per
        // element, all 4 bytes apart (one rect).
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
    let kind = |kind: Kind, p: u32| layout(kind, 8, 4, 1, p, 64, 2, 64);
    type Shape = (&'static str, [Kind; 2], [Vec<i32>; 2]);
    let shapes: [Shape; 5] = [
        ("gapped heads", [Kind::Gapped; 2], [vec![0, 1], vec![0, 1]]),
        (
            "HND -> NHD",
            [Kind::Hnd, Kind::Nhd],
            [vec![0, 1], vec![1, 0]],
        ),
        (
            "NHD -> HND",
            [Kind::Nhd, Kind::Hnd],
            [vec![1, 0], vec![0, 1]],
        ),
        (
            "padded HND -> gapped",
            [Kind::PaddedHnd, Kind::Gapped],
            [vec![0, 1], vec![1, 0]],
        ),
        (
            "heads outside pages -> padded NHD",
            [Kind::HeadsOutsidePages, Kind::PaddedNhd],
            [vec![1, 0], vec![0, 1]],
        ),
    ];
    for (name, kinds, [src_pages, dst_pages]) in shapes {
        let mut seen: Option<(usize, u64)> = None;
        for p in [1u32 << 8, 1 << 20, 1 << 30] {
            let (src, dst) = if name == "gapped heads" {
                (gapped(p), gapped(p))
            } else {
                (kind(kinds[0], p), kind(kinds[1], p))
            };
            let case = case_of(
                src,
                dst,
                src_pages.clone(),
                dst_pages.clone(),
                2 * u64::from(p),
            );
            let config = pair_config(&case);
            let r = request(&case);
            let (rects, work) = rects_and_work(&config, &r);
            let what = format!("{name}, pages of {p}");
            if p == 1 << 8 {
                // Small enough for the oracle's element-by-element walk.
                let direct = direct_pair(&case).expect("the pair sends");
                assert_eq!(rects, direct.best_rects([p, p]), "{what}: rects");
            }
            if name == "gapped heads" {
                assert_eq!(
                    rects,
                    [MoriCopyRect {
                        src_offset: 0,
                        dst_offset: 0,
                        src_pitch: 4,
                        dst_pitch: 4,
                        width: 2,
                        height: 4 * u64::from(p),
                    }],
                    "{what}"
                );
            }
            assert!(
                work < 20_000,
                "{what}: {work} steps for {} rects",
                rects.len()
            );
            match seen {
                None => seen = Some((rects.len(), work)),
                Some((count, steps)) => {
                    assert_eq!(rects.len(), count, "{what}: rects");
                    if p == 1 << 30 {
                        // As many steps for 2^31 tokens as for 2^21.
                        assert_eq!(work, steps, "{what}: steps of work");
                    }
                    seen = Some((count, work));
                }
            }
        }
    }
}
