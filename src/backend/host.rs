//! The host engine: strided copies on the CPU.
//!
//! A large send is bound by memory bandwidth. Plain stores first read every destination cache
//! line they write (read-for-ownership), so a strided copy would move three bytes over the memory
//! bus for every two a streaming `memcpy` moves. Above [`STREAMING_THRESHOLD`] the engine writes
//! whole blocks, and rows that leave gaps in the destination, with non-temporal (streaming)
//! stores on x86_64, as glibc's `memcpy` does for large blocks; rows back to back in the
//! destination, and smaller sends, keep plain copies (see [`streams_rect`] for why).

use crate::error::Result;
use crate::plan::CopyRect;

use super::{CopyEngine, CopyJob};

/// Sends that write at least this many bytes use streaming stores: beyond it the destination
/// would not stay in a last-level cache slice anyway.
pub(crate) const STREAMING_THRESHOLD: u64 = 4 << 20;

/// Rows with gaps that do not start and end on cache lines stream from this width on.
const STREAMING_MIN_UNALIGNED_ROW: u64 = 256;

/// Whether a rect whose destination starts at `dst` (its buffer's base plus its offset) is
/// written with streaming stores in a streaming call: a contiguous rect (one long block), or rows
/// that leave gaps in the destination and either lie on whole 64-byte lines or are at least
/// [`STREAMING_MIN_UNALIGNED_ROW`] wide. Rows back to back in the destination (a pack, a strided
/// source) are written plainly. Measured side by side on 2026-12-01 (benches/host_ab; BENCHMARKS.md
/// has the latest run), against a per-row `memcpy` loop: streaming ran 1.3-2.5x into rows with gaps on whole lines from 64 B up;
/// into other rows with gaps level with plain copies at 256 B (0.9-1.25x), 1.4-2.1x from 512 B,
/// but 0.24-0.84x below 256 B (their partial lines are flushed half-written); into rows back to
/// back 0.7-1.0x, where plain copies ran at 1.0-1.2x.
fn streams_rect(rect: &CopyRect, dst: *const u8) -> bool {
    let on_lines = (dst as usize | rect.dst_pitch as usize | rect.width as usize) % 64 == 0;
    rect.is_contiguous()
        || (rect.dst_pitch > rect.width && (on_lines || rect.width >= STREAMING_MIN_UNALIGNED_ROW))
}

/// CPU copies, synchronous. A contiguous rect is one copy, any other rect one per row.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostEngine {
    streaming: bool,
}

impl HostEngine {
    /// An engine that streams regardless of the send's size (for tests and benchmarks).
    pub fn streaming() -> Self {
        HostEngine { streaming: true }
    }
}

impl CopyEngine for HostEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        let streaming = self.streams(job.total_bytes()).then(streaming::best);
        for (src, dst) in job.buffers() {
            for rect in job.rects() {
                // SAFETY: the caller guarantees every row of every rect is in bounds.
                unsafe { copy_rect(dst, src, &rect, streaming) };
            }
        }
        if streaming.is_some() {
            streaming::fence();
        }
        Ok(())
    }
}

impl HostEngine {
    /// True when a call writing `total_bytes` uses streaming stores.
    fn streams(&self, total_bytes: u64) -> bool {
        self.streaming || total_bytes >= STREAMING_THRESHOLD
    }
}

/// Copies one rect: one copy when it is contiguous, else one per row; with `streaming` (the
/// call's streaming copy, in a streaming call) for the rects [`streams_rect`] picks.
///
/// # Safety
/// Every row of the rect readable at `src_base` and writable at `dst_base` offsets.
unsafe fn copy_rect(
    dst_base: *mut u8,
    src_base: *const u8,
    rect: &CopyRect,
    streaming: Option<streaming::Copy>,
) {
    // The job validated every offset against capacities that fit in isize, so the
    // conversions to usize are lossless.
    let (mut src, mut dst) = (rect.src_offset as usize, rect.dst_offset as usize);
    let (rows, len) = if rect.is_contiguous() {
        (1, rect.bytes() as usize)
    } else {
        (rect.height, rect.width as usize)
    };
    let stream = streaming.filter(|_| streams_rect(rect, dst_base.wrapping_add(dst)));
    for _ in 0..rows {
        // SAFETY: the caller guarantees each row is in bounds.
        unsafe { copy_row(src_base.add(src), dst_base.add(dst), len, stream) };
        src += rect.src_pitch as usize;
        dst += rect.dst_pitch as usize;
    }
}

/// Copies one row, with `stream` when given; overlapping rows (a caller passing the same buffer
/// twice) take `memmove`.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes.
unsafe fn copy_row(src: *const u8, dst: *mut u8, len: usize, stream: Option<streaming::Copy>) {
    let disjoint =
        src.wrapping_add(len) <= dst.cast_const() || dst.wrapping_add(len).cast_const() <= src;
    match stream {
        // SAFETY: as the caller guarantees, and the ranges do not overlap.
        Some(copy) if disjoint => unsafe { copy(src, dst, len) },
        // SAFETY: as the caller guarantees; `copy` is memmove.
        _ => unsafe { std::ptr::copy(src, dst, len) },
    }
}

#[cfg(target_arch = "x86_64")]
mod streaming {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128, _mm256_loadu_si256,
        _mm256_stream_si256, _mm256_zeroupper,
    };

    /// A streaming copy of `len` bytes from `src` to `dst`, two disjoint ranges.
    pub(super) type Copy = unsafe fn(src: *const u8, dst: *mut u8, len: usize);

    /// The widest streaming copy this CPU has: 32-byte stores with AVX (10-15% faster than
    /// 16-byte ones on whole blocks, benches/host_ab on 2026-12-01), else SSE2's 16-byte stores.
    pub(super) fn best() -> Copy {
        if std::is_x86_feature_detected!("avx") {
            copy_avx
        } else {
            copy_sse2
        }
    }

    /// Copies `len` bytes: plainly up to the first 16-byte boundary of `dst` and after the last
    /// one, through `body` (which gets that many 16-byte pieces, 16-byte aligned in `dst`) in
    /// between.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes, the two ranges disjoint; `body` copies
    /// `n * 16` bytes.
    #[inline(always)]
    unsafe fn split(
        src: *const u8,
        dst: *mut u8,
        len: usize,
        body: impl FnOnce(*const u8, *mut u8, usize),
    ) {
        let head = dst.align_offset(16).min(len);
        let pieces = (len - head) / 16;
        let tail = head + 16 * pieces;
        // SAFETY: head, body and tail partition the caller's ranges. (Aligned rows have neither
        // head nor tail; the checks spare them two empty `memcpy` calls.)
        unsafe {
            if head > 0 {
                std::ptr::copy_nonoverlapping(src, dst, head);
            }
            body(src.add(head), dst.add(head), pieces);
            if tail < len {
                std::ptr::copy_nonoverlapping(src.add(tail), dst.add(tail), len - tail);
            }
        }
    }

    /// [`split`] with AVX's 32-byte streaming stores, and a 16-byte one at either end where the
    /// pieces do not start or end on 32 bytes.
    ///
    /// # Safety
    /// As [`split`]; the CPU has AVX.
    #[target_feature(enable = "avx")]
    unsafe fn copy_avx(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY (whole function): `split` hands over whole pieces, 16-byte aligned in `dst`,
        // and one piece first moves the rest onto 32 bytes; loads are unaligned loads.
        unsafe {
            let piece = |s: *const u8, d: *mut u8| {
                _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()))
            };
            split(src, dst, len, |mut s, mut d, mut n| {
                if n > 0 && d.align_offset(32) != 0 {
                    piece(s, d);
                    (s, d, n) = (s.add(16), d.add(16), n - 1);
                }
                // Two 32-byte stores per line (one store per iteration ran 5-8% slower).
                let (lines, rest) = (n / 4, n % 4);
                for i in 0..lines {
                    let (s, d) = (s.add(64 * i), d.add(64 * i));
                    let a = _mm256_loadu_si256(s.cast::<__m256i>());
                    let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
                    _mm256_stream_si256(d.cast::<__m256i>(), a);
                    _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
                }
                let (s, d) = (s.add(64 * lines), d.add(64 * lines));
                if rest >= 2 {
                    let v = _mm256_loadu_si256(s.cast::<__m256i>());
                    _mm256_stream_si256(d.cast::<__m256i>(), v);
                }
                if rest % 2 == 1 {
                    // std encodes the 16-byte store without VEX: clear the upper halves first,
                    // as older Intel cores stall on legacy SSE after 256-bit code.
                    _mm256_zeroupper();
                    piece(s.add(32 * (rest / 2)), d.add(32 * (rest / 2)));
                }
            })
        }
    }

    /// [`split`] with SSE2's 16-byte streaming stores (the x86_64 baseline).
    ///
    /// # Safety
    /// As [`split`].
    pub(super) unsafe fn copy_sse2(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY (whole function): `split` hands over whole pieces, 16-byte aligned in `dst`.
        unsafe {
            split(src, dst, len, |s, d, n| {
                for i in 0..n {
                    let v = _mm_loadu_si128(s.add(16 * i).cast::<__m128i>());
                    _mm_stream_si128(d.add(16 * i).cast::<__m128i>(), v);
                }
            })
        }
    }

    /// Orders the streaming stores before anything the caller does next (they are weakly
    /// ordered), so whoever reads the destination sees every byte.
    pub(super) fn fence() {
        // SAFETY: SSE is part of the x86_64 baseline.
        unsafe { _mm_sfence() }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod streaming {
    /// A copy of `len` bytes from `src` to `dst`, two disjoint ranges.
    pub(super) type Copy = unsafe fn(src: *const u8, dst: *mut u8, len: usize);

    /// Plain copies where no streaming stores are wired up.
    pub(super) fn best() -> Copy {
        copy_plain
    }

    /// `copy_nonoverlapping`, as a [`Copy`].
    unsafe fn copy_plain(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }

    pub(super) fn fence() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zeroed-to-0xEE buffer of `len` bytes starting `offset` bytes past a cache line.
    struct Lined {
        bytes: Vec<u8>,
        start: usize,
        len: usize,
    }

    impl Lined {
        fn new(len: usize, offset: usize) -> Self {
            let bytes = vec![0xEEu8; len + 128];
            let start = bytes.as_ptr().align_offset(64) + offset;
            Lined { bytes, start, len }
        }

        fn slice(&mut self) -> &mut [u8] {
            &mut self.bytes[self.start..self.start + self.len]
        }
    }

    /// Copies `rect` into a fresh buffer starting `line_offset` bytes past a cache line, with
    /// `streaming` or plainly, and returns the destination.
    fn run(
        streaming: Option<streaming::Copy>,
        rect: &CopyRect,
        src: &[u8],
        dst_len: usize,
        line_offset: usize,
    ) -> Vec<u8> {
        let mut dst = Lined::new(dst_len, line_offset);
        // SAFETY: the tests size the buffers to hold every row.
        unsafe { copy_rect(dst.slice().as_mut_ptr(), src.as_ptr(), rect, streaming) };
        streaming::fence();
        dst.slice().to_vec()
    }

    /// Every streaming copy this CPU can run: SSE2 always, AVX where present.
    fn streaming_copies() -> Vec<(&'static str, streaming::Copy)> {
        let mut copies: Vec<(&'static str, streaming::Copy)> = vec![("best", streaming::best())];
        #[cfg(target_arch = "x86_64")]
        copies.push(("sse2", streaming::copy_sse2));
        copies
    }

    #[test]
    fn every_streaming_copy_is_exact_for_every_length_and_line_offset() {
        let src: Vec<u8> = (0..4096).map(|i| (i * 13 + i / 7) as u8).collect();
        let lengths = (0..200).chain([255, 256, 257, 511, 512, 513, 1023, 1024, 1025]);
        for len in lengths {
            // Destination offsets from a line boundary: aligned, inside the first 16 bytes, at
            // 16, 32 and 48 (SSE2 and AVX store boundaries), one short of the next line.
            let offsets = [
                (0, 0),
                (1, 0),
                (0, 1),
                (3, 7),
                (15, 9),
                (8, 16),
                (0, 32),
                (7, 48),
                (0, 63),
            ];
            for (s, d) in offsets {
                for (name, copy) in streaming_copies() {
                    let mut dst = Lined::new(2048, d);
                    // SAFETY: both ranges lie inside their buffers and do not overlap.
                    unsafe { copy(src.as_ptr().add(s), dst.slice().as_mut_ptr(), len) };
                    streaming::fence();
                    let mut want = vec![0xEEu8; 2048];
                    want[..len].copy_from_slice(&src[s..s + len]);
                    assert!(
                        dst.slice() == want,
                        "{name}: len {len}, src +{s}, dst {d} past a line"
                    );
                }
            }
        }
    }

    #[test]
    fn streaming_covers_blocks_rows_with_gaps_on_lines_and_wide_rows_with_gaps() {
        let rect = |width, src_pitch, dst_pitch| CopyRect {
            src_offset: 0,
            dst_offset: 0,
            src_pitch,
            dst_pitch,
            width,
            height: 4,
        };
        let mut buffer = Lined::new(64, 0);
        let line = buffer.slice().as_ptr();
        let off = line.wrapping_add(16);
        assert!(
            streams_rect(&rect(100, 100, 100), off),
            "a contiguous block, anywhere"
        );
        for width in [64, 128, 256, 448, 512, 4096] {
            assert!(
                streams_rect(&rect(width, width, 2 * width), line),
                "{width} B on lines"
            );
            assert!(
                !streams_rect(&rect(width, 2 * width, width), line),
                "{width} B back to back"
            );
        }
        // Off lines: from its start, its pitch or its width, rows with gaps stream from 256 B.
        for width in [64, 128, 192, 240] {
            assert!(
                !streams_rect(&rect(width, width, 2 * width), off),
                "{width} B at +16"
            );
            assert!(
                !streams_rect(&rect(width, width, width + 16), line),
                "pitch {}",
                width + 16
            );
            assert!(
                !streams_rect(&rect(width + 8, 0, 2 * width), line),
                "width {}",
                width + 8
            );
        }
        assert!(!streams_rect(&rect(255, 255, 512), line), "255 B rows");
        for width in [256, 257, 448, 512, 1000, 4099] {
            assert!(
                streams_rect(&rect(width, width, 2 * width + 16), off),
                "{width} B at +16"
            );
            assert!(
                !streams_rect(&rect(width, 2 * width, width), off),
                "{width} B back to back"
            );
        }
    }

    #[test]
    fn large_calls_switch_to_streaming_and_small_ones_do_not() {
        let engine = HostEngine::default();
        assert!(!engine.streams(STREAMING_THRESHOLD - 1));
        assert!(engine.streams(STREAMING_THRESHOLD));
        assert!(HostEngine::streaming().streams(0));
    }

    fn reference(rect: &CopyRect, src: &[u8], dst_len: usize) -> Vec<u8> {
        let mut dst = vec![0xEEu8; dst_len];
        for r in 0..rect.height as usize {
            let s = rect.src_offset as usize + r * rect.src_pitch as usize;
            let d = rect.dst_offset as usize + r * rect.dst_pitch as usize;
            dst[d..d + rect.width as usize].copy_from_slice(&src[s..s + rect.width as usize]);
        }
        dst
    }

    #[test]
    fn streaming_and_plain_copies_agree_for_every_alignment_width_and_pitch() {
        let src: Vec<u8> = (0..160 * 1024).map(|i| (i * 7 + i / 251) as u8).collect();
        let widths = [
            1u64, 15, 16, 63, 64, 65, 127, 128, 129, 200, 256, 511, 512, 513, 1000, 4096, 4099,
        ];
        for width in widths {
            // Destination rows with gaps (on lines where the width allows), back to back, and
            // one block.
            let shapes = [
                (2 * width + 3, width + 5),
                (2 * width + 3, 2 * width),
                (2 * width + 3, width),
                (width, width),
            ];
            for (src_pitch, dst_pitch) in shapes {
                let offsets = [
                    (0u64, 0u64),
                    (1, 3),
                    (17, 8),
                    (5, 0),
                    (0, 64),
                    (0, 9),
                    (0, 32),
                ];
                for (src_offset, dst_offset) in offsets {
                    let rect = CopyRect {
                        src_offset,
                        dst_offset,
                        src_pitch,
                        dst_pitch,
                        width,
                        height: 11,
                    };
                    let len = (dst_offset + 11 * dst_pitch) as usize;
                    let want = reference(&rect, &src, len);
                    for line_offset in [0, 16] {
                        assert_eq!(run(None, &rect, &src, len, line_offset), want, "{rect:?}");
                        for (name, copy) in streaming_copies() {
                            let got = run(Some(copy), &rect, &src, len, line_offset);
                            assert!(got == want, "{name}, +{line_offset}: {rect:?}");
                        }
                    }
                }
            }
        }
    }

    /// Sends through the public API, just under and at the streaming threshold, into rows with
    /// gaps (TP 8 -> 4), rows back to back (4 -> 8) and whole tokens (4 -> 4), with rows of
    /// whole lines and rows that end mid-line, into buffers on a line and 16 bytes past one,
    /// byte for byte against a per-row reference.
    #[test]
    fn sends_just_under_and_at_the_streaming_threshold_land_byte_exact() {
        use crate::{SliceParams, SlicePlan, send_host, slice_config};
        let (heads, page, buffers) = (8u32, 16usize, 2usize);
        for (p_tp, d_tp) in [(8u32, 4u32), (4, 8), (4, 4)] {
            for head in [64usize, 200] {
                let item = |tp: u32| page * head * (heads / tp) as usize;
                let config = slice_config(&SliceParams {
                    prefill_tp_size: p_tp,
                    prefill_tp_rank: 1,
                    decode_tp_size: d_tp,
                    decode_tp_rank: (heads / p_tp) / (heads / d_tp),
                    total_kv_heads: heads,
                    page_size: page as u32,
                    src_item_len: item(p_tp) as u64,
                    dst_item_len: item(d_tp) as u64,
                })
                .unwrap();
                let width = config.heads_bytes_per_token_to_send as usize;
                let per_page = (page * width * buffers) as u64;
                let at = STREAMING_THRESHOLD.div_ceil(per_page) as usize;
                for (pages, line_offset) in [(at - 1, 0), (at, 0), (at, 16)] {
                    assert_eq!(
                        (pages as u64 * per_page) >= STREAMING_THRESHOLD,
                        pages == at,
                        "the two sizes straddle the threshold"
                    );
                    // Runs of 7 source pages and of 5 destination pages, a free page after each.
                    let src_pages: Vec<i32> = (0..pages as i32).map(|i| i + i / 7).collect();
                    let dst_pages: Vec<i32> = (0..pages as i32).map(|i| i + i / 5).collect();
                    let src_len = item(p_tp) * (pages + pages / 7 + 1);
                    let dst_len = item(d_tp) * (pages + pages / 5 + 1);
                    let src: Vec<Vec<u8>> = (0..buffers)
                        .map(|b| {
                            (0..src_len)
                                .map(|i| (i * 31 + i / 4093 + b) as u8)
                                .collect()
                        })
                        .collect();
                    let mut want = vec![vec![0xEEu8; dst_len]; buffers];
                    for (b, want) in want.iter_mut().enumerate() {
                        for (&s, &d) in src_pages.iter().zip(&dst_pages) {
                            for t in 0..page {
                                let s = s as usize * item(p_tp)
                                    + t * config.bytes_per_token_src as usize
                                    + config.src_head_slice_offset as usize;
                                let d = d as usize * item(d_tp)
                                    + t * config.bytes_per_token_dst as usize
                                    + config.dst_head_slice_offset as usize;
                                want[d..d + width].copy_from_slice(&src[b][s..s + width]);
                            }
                        }
                    }
                    let mut dst: Vec<Lined> = (0..buffers)
                        .map(|_| Lined::new(dst_len, line_offset))
                        .collect();
                    let plan = SlicePlan::new(&config, &src_pages, &dst_pages).unwrap();
                    let src_refs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
                    let mut dst_refs: Vec<&mut [u8]> = dst.iter_mut().map(Lined::slice).collect();
                    send_host(&plan, &src_refs, &mut dst_refs).unwrap();
                    assert!(
                        dst.iter_mut()
                            .zip(&want)
                            .all(|(d, w)| d.slice() == w.as_slice()),
                        "TP {p_tp} -> {d_tp}, {head} B heads, {pages} pages, +{line_offset}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_overlapping_its_destination_is_copied_like_memmove() {
        let mut buf: Vec<u8> = (0..=255).collect();
        let expected: Vec<u8> = {
            let mut b = buf.clone();
            b.copy_within(0..128, 64);
            b
        };
        let base = buf.as_mut_ptr();
        // SAFETY: both ranges lie inside `buf`.
        unsafe { copy_row(base, base.add(64), 128, Some(streaming::best())) };
        streaming::fence();
        assert_eq!(buf, expected);
    }
}
