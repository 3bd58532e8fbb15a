//! The host engine: strided copies on the CPU.
//!
//! A large send is bound by memory bandwidth. Plain stores first read every destination cache
//! line they write (read-for-ownership), so a strided copy would move three bytes over the memory
//! bus for every two a streaming `memcpy` moves. Above [`STREAMING_THRESHOLD`] the engine writes
//! with non-temporal (streaming) stores on x86_64, as glibc's `memcpy` does for large blocks;
//! smaller sends keep plain copies, whose results stay in cache for whoever reads them next.

use crate::error::Result;
use crate::plan::CopyRect;

use super::{CopyEngine, CopyJob};

/// Sends that write at least this many bytes use streaming stores: beyond it the destination
/// would not stay in a last-level cache slice anyway.
pub(crate) const STREAMING_THRESHOLD: u64 = 4 << 20;

/// Strided destination rows narrower than this are copied plainly. Measured on the development
/// VM (BENCHMARKS.md, staging_copy): streaming stores into rows of 128-256 B out of every 2w ran
/// at 0.8x of plain stores, from 512 B at 1.6-2x.
const STREAMING_MIN_ROW: usize = 512;

/// Whether a rect's rows are written with streaming stores in a streaming call: a contiguous
/// rect (one long block), or rows of at least [`STREAMING_MIN_ROW`] bytes that leave gaps in the
/// destination. Rows that are back to back in the destination (a pack, a strided source) are
/// written plainly: the plain copy of a full-line sequential destination ran as fast or faster
/// there (0.99-1.10x of a per-row memcpy loop, against 0.87-1.18x streaming).
fn streams_rect(rect: &CopyRect) -> bool {
    rect.is_contiguous()
        || (rect.dst_pitch > rect.width && rect.width as usize >= STREAMING_MIN_ROW)
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
        let streaming = self.streams(job.total_bytes());
        for (src, dst) in job.buffers() {
            for rect in job.rects() {
                // SAFETY: the caller guarantees every row of every rect is in bounds.
                unsafe { copy_rect(dst, src, &rect, streaming) };
            }
        }
        if streaming {
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

/// Copies one rect: one copy when it is contiguous, else one per row.
///
/// # Safety
/// Every row of the rect readable at `src_base` and writable at `dst_base` offsets.
unsafe fn copy_rect(dst_base: *mut u8, src_base: *const u8, rect: &CopyRect, streaming: bool) {
    // The job validated every offset against capacities that fit in isize, so the
    // conversions to usize are lossless.
    let (mut src, mut dst) = (rect.src_offset as usize, rect.dst_offset as usize);
    let (rows, len) = if rect.is_contiguous() {
        (1, rect.bytes() as usize)
    } else {
        (rect.height, rect.width as usize)
    };
    let stream = streaming && streams_rect(rect);
    for _ in 0..rows {
        // SAFETY: the caller guarantees each row is in bounds.
        unsafe { copy_row(src_base.add(src), dst_base.add(dst), len, stream) };
        src += rect.src_pitch as usize;
        dst += rect.dst_pitch as usize;
    }
}

/// Copies one row; overlapping rows (a caller passing the same buffer twice) take `memmove`.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes.
unsafe fn copy_row(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    let disjoint =
        src.wrapping_add(len) <= dst.cast_const() || dst.wrapping_add(len).cast_const() <= src;
    if stream && disjoint {
        // SAFETY: as the caller guarantees, and the ranges do not overlap.
        unsafe { streaming::copy(src, dst, len) }
    } else {
        // SAFETY: as the caller guarantees; `copy` is memmove.
        unsafe { std::ptr::copy(src, dst, len) }
    }
}

#[cfg(target_arch = "x86_64")]
mod streaming {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Copies `len` bytes, writing the 16-byte-aligned part of `dst` with non-temporal stores.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes, the two ranges disjoint.
    pub(super) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        let head = dst.align_offset(16).min(len);
        // SAFETY (whole function): every access stays inside the caller's ranges; stores through
        // `d` are 16-byte aligned after the head; loads are unaligned loads.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (mut s, mut d, mut left) = (src.add(head), dst.add(head), len - head);
            while left >= 64 {
                let a = _mm_loadu_si128(s.cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
                _mm_stream_si128(d.cast::<__m128i>(), a);
                _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
                (s, d, left) = (s.add(64), d.add(64), left - 64);
            }
            while left >= 16 {
                _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()));
                (s, d, left) = (s.add(16), d.add(16), left - 16);
            }
            std::ptr::copy_nonoverlapping(s, d, left);
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
    /// Plain copy where no streaming stores are wired up.
    pub(super) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }

    pub(super) fn fence() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies `rect` between two fresh buffers with the given engine and returns the result.
    fn run(streaming: bool, rect: &CopyRect, src: &[u8], dst_len: usize) -> Vec<u8> {
        let mut dst = vec![0xEEu8; dst_len];
        // SAFETY: the tests size the buffers to hold every row.
        unsafe { copy_rect(dst.as_mut_ptr(), src.as_ptr(), rect, streaming) };
        streaming::fence();
        dst
    }

    #[test]
    fn the_streaming_row_copy_is_exact_for_every_length_and_alignment() {
        let src: Vec<u8> = (0..4096).map(|i| (i * 13 + i / 7) as u8).collect();
        for len in (0..200).chain([255, 256, 257, 1023, 1024, 1025]) {
            for (s, d) in [(0, 0), (1, 0), (0, 1), (3, 7), (15, 9), (8, 16)] {
                let mut dst = vec![0xEEu8; 2048];
                // SAFETY: both ranges lie inside their buffers and do not overlap.
                unsafe { streaming::copy(src.as_ptr().add(s), dst.as_mut_ptr().add(d), len) };
                streaming::fence();
                let mut want = vec![0xEEu8; 2048];
                want[d..d + len].copy_from_slice(&src[s..s + len]);
                assert_eq!(dst, want, "len {len}, src +{s}, dst +{d}");
            }
        }
    }

    #[test]
    fn streaming_covers_whole_blocks_and_wide_rows_with_gaps_only() {
        let rect = |width, src_pitch, dst_pitch| CopyRect {
            src_offset: 0,
            dst_offset: 0,
            src_pitch,
            dst_pitch,
            width,
            height: 4,
        };
        assert!(streams_rect(&rect(128, 128, 128)), "a contiguous block");
        assert!(
            streams_rect(&rect(512, 512, 1024)),
            "wide rows with gaps (an unpack)"
        );
        assert!(!streams_rect(&rect(256, 256, 512)), "narrow rows with gaps");
        assert!(
            !streams_rect(&rect(1024, 2048, 1024)),
            "back-to-back rows (a pack)"
        );
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
    fn streaming_and_plain_copies_agree_for_every_alignment_and_width() {
        let src: Vec<u8> = (0..128 * 1024).map(|i| (i * 7 + i / 251) as u8).collect();
        for width in [
            1u64, 15, 16, 63, 64, 65, 128, 200, 256, 511, 512, 513, 1000, 4099,
        ] {
            for (src_offset, dst_offset) in [(0u64, 0u64), (1, 3), (17, 8), (5, 0), (0, 9)] {
                let rect = CopyRect {
                    src_offset,
                    dst_offset,
                    src_pitch: 2 * width + 3,
                    dst_pitch: width + 5,
                    width,
                    height: 11,
                };
                let len = (dst_offset + 11 * (width + 5)) as usize;
                let want = reference(&rect, &src, len);
                assert_eq!(run(false, &rect, &src, len), want, "{rect:?}");
                assert_eq!(run(true, &rect, &src, len), want, "{rect:?}");
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
        unsafe { copy_row(base, base.add(64), 128, true) };
        streaming::fence();
        assert_eq!(buf, expected);
    }
}
