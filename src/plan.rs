//! Copy plans: a request's page pairs turned into strided 2D copies (rects), or into the same
//! bytes as contiguous 1D segments for RDMA batch writes.
//!
//! A run of page pairs whose indices both go up by one is one rect of `run * page_size` rows, so
//! a request costs one copy per maximal run instead of one per token.

use crate::error::{Error, Result, Side};
use crate::slice::{Action, SliceConfig};

/// One strided 2D copy (`hipMemcpy2DAsync`): `height` rows of `width` bytes, row `r` read at
/// `src_offset + r * src_pitch` and written at `dst_offset + r * dst_pitch`. Offsets are relative
/// to each buffer's base.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CopyRect {
    /// Byte offset of the first source row.
    pub src_offset: u64,
    /// Byte offset of the first destination row.
    pub dst_offset: u64,
    /// Bytes between source rows (bytes per source token).
    pub src_pitch: u64,
    /// Bytes between destination rows (bytes per destination token).
    pub dst_pitch: u64,
    /// Bytes per row (the head slice).
    pub width: u64,
    /// Rows (tokens).
    pub height: u64,
}

impl CopyRect {
    /// True when the rows are back to back on both sides, so the rect is one contiguous block.
    pub fn is_contiguous(&self) -> bool {
        self.width == self.src_pitch && self.width == self.dst_pitch
    }

    /// Bytes the rect moves.
    pub fn bytes(&self) -> u64 {
        self.width * self.height
    }
}

/// One contiguous copy of `length` bytes, offsets relative to each buffer's base.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub length: u64,
}

/// The highest page a request touches on one side, kept to check buffer capacities in O(1) and
/// to name the culprit when one is too small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HighestPage<'a> {
    /// The side's page array, to find the culprit's position for a message.
    pages: &'a [u32],
    /// The page index itself.
    page: u32,
    /// `(page + 1) * item_len`: the bytes a buffer needs to hold that page.
    end: u64,
}

impl HighestPage<'_> {
    fn position(&self) -> usize {
        self.pages.iter().position(|&p| p == self.page).unwrap_or(0)
    }
}

/// A validated request: a slice config and its page pairs, ready to yield rects or segments.
///
/// Construction checks everything that does not depend on the buffers: the config's
/// consistency, that no page index is negative, and that no byte offset overflows `u64`. After
/// that, producing the plan cannot fail.
#[derive(Clone, Debug)]
pub struct Plan<'a> {
    config: SliceConfig,
    src_pages: &'a [u32],
    dst_pages: &'a [u32],
    runs: usize,
    rows: u64,
    src_highest: Option<HighestPage<'a>>,
    dst_highest: Option<HighestPage<'a>>,
}

/// Reinterprets page indices already known to be non-negative.
fn as_unsigned(pages: &[i32]) -> &[u32] {
    // SAFETY: i32 and u32 have the same size and alignment, and every element was checked >= 0,
    // so each reads back as the same value.
    unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<u32>(), pages.len()) }
}

/// One pass over the page pairs: any negative index, the highest page of each side, and the
/// number of places where a run of adjacent pairs breaks. The loop has no early exit and no
/// bounds checks, so it runs at memory speed; positions are only looked up when something fails.
fn scan(src: &[i32], dst: &[i32]) -> (bool, i32, i32, usize) {
    let (mut ored, mut src_max, mut dst_max, mut breaks) = (0i32, 0i32, 0i32, 0usize);
    let (mut prev_src, mut prev_dst) = (i32::MIN, i32::MIN);
    for (&s, &d) in src.iter().zip(dst) {
        ored |= s | d;
        src_max = src_max.max(s);
        dst_max = dst_max.max(d);
        // Wrapping: a negative or i32::MAX predecessor is refused anyway.
        breaks += usize::from(s != prev_src.wrapping_add(1) || d != prev_dst.wrapping_add(1));
        (prev_src, prev_dst) = (s, d);
    }
    (ored < 0, src_max, dst_max, breaks)
}

fn negative_page(side: Side, pages: &[i32]) -> Option<Error> {
    let position = pages.iter().position(|&page| page < 0)?;
    Some(Error::OutOfBounds(format!(
        "{side}: page index {} at position {position} is negative",
        pages[position]
    )))
}

/// The highest page of one side and the bytes a buffer needs to hold it.
fn highest_page(
    side: Side,
    pages: &[u32],
    max: u32,
    item_len: u64,
) -> Result<Option<HighestPage<'_>>> {
    if pages.is_empty() {
        return Ok(None);
    }
    let end = (u64::from(max) + 1).checked_mul(item_len);
    // Positions are only for messages: found lazily, when a check fails.
    let position = || pages.iter().position(|&page| page == max).unwrap_or(0);
    let Some(end) = end else {
        return Err(Error::OutOfBounds(format!(
            "{side}: page {max} at position {} ends at byte ({max} + 1) * item_len {item_len}, \
             which overflows u64",
            position()
        )));
    };
    Ok(Some(HighestPage {
        pages,
        page: max,
        end,
    }))
}

impl<'a> Plan<'a> {
    /// Validates `config` and the page pairs `src_pages[i] -> dst_pages[i]`.
    pub fn new(config: &SliceConfig, src_pages: &'a [i32], dst_pages: &'a [i32]) -> Result<Self> {
        config.validate()?;
        if src_pages.len() != dst_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "{} source pages but {} destination pages (they are paired one to one)",
                src_pages.len(),
                dst_pages.len()
            )));
        }
        let (negative, src_max, dst_max, breaks) = scan(src_pages, dst_pages);
        if negative {
            let error = negative_page(Side::Prefill, src_pages)
                .or_else(|| negative_page(Side::Decode, dst_pages));
            return Err(error.unwrap_or_else(|| Error::Panic("a negative page vanished".into())));
        }
        let (src_pages, dst_pages) = (as_unsigned(src_pages), as_unsigned(dst_pages));
        // Every offset the plan produces lies below the end of the highest page of its side, so
        // checking that one product is enough to rule out overflow everywhere.
        let src_highest = highest_page(
            Side::Prefill,
            src_pages,
            src_max as u32,
            config.src_item_len,
        )?;
        let dst_highest =
            highest_page(Side::Decode, dst_pages, dst_max as u32, config.dst_item_len)?;
        let rows = (src_pages.len() as u64)
            .checked_mul(u64::from(config.page_size))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} pages of {} tokens overflow u64",
                    src_pages.len(),
                    config.page_size
                ))
            })?;
        // The first pair always "breaks" from the sentinel predecessor: one run per break.
        let runs = breaks;
        Ok(Plan {
            config: *config,
            src_pages,
            dst_pages,
            runs,
            rows,
            src_highest,
            dst_highest,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &SliceConfig {
        &self.config
    }

    /// True when the config moves bytes (action `Send`).
    pub fn sends(&self) -> bool {
        self.config.action == Action::Send
    }

    /// Number of rects: one per maximal run of adjacent page pairs, 0 unless the pair sends.
    pub fn num_rects(&self) -> usize {
        if self.sends() { self.runs } else { 0 }
    }

    /// Number of segments: one per rect when rows are contiguous on both sides, else one per row.
    pub fn num_segments(&self) -> Result<usize> {
        if !self.sends() {
            return Ok(0);
        }
        if self.config.is_contiguous() {
            return Ok(self.runs);
        }
        usize::try_from(self.rows).map_err(|_| {
            Error::InvalidArgument(format!("{} segments do not fit in usize", self.rows))
        })
    }

    /// Bytes moved per buffer (per layer K or V).
    pub fn bytes_per_buffer(&self) -> u64 {
        if self.sends() {
            self.rows * self.config.heads_bytes_per_token_to_send
        } else {
            0
        }
    }

    /// Bytes each source buffer must hold for every page of the request (0 when empty).
    pub fn src_bytes_needed(&self) -> u64 {
        self.src_highest.map_or(0, |h| h.end)
    }

    /// Bytes each destination buffer must hold for every page of the request (0 when empty).
    pub fn dst_bytes_needed(&self) -> u64 {
        self.dst_highest.map_or(0, |h| h.end)
    }

    /// Checks that every page of the request lies inside buffers of the given capacities.
    pub fn check_capacity(&self, src_capacity: u64, dst_capacity: u64) -> Result<()> {
        for (side, highest, capacity, name) in [
            (
                Side::Prefill,
                self.src_highest,
                src_capacity,
                "src_capacity",
            ),
            (Side::Decode, self.dst_highest, dst_capacity, "dst_capacity"),
        ] {
            if let Some(h) = highest.filter(|h| h.end > capacity) {
                return Err(Error::OutOfBounds(format!(
                    "{side}: page {} at position {} ends at byte {}, past {name} {capacity}",
                    h.page,
                    h.position(),
                    h.end
                )));
            }
        }
        Ok(())
    }

    /// The rects, one per maximal run, in input order. Empty unless the pair sends.
    pub fn rects(&self) -> Rects<'_> {
        let pages = if self.sends() {
            self.src_pages.len()
        } else {
            0
        };
        Rects {
            plan: self,
            next: 0,
            end: pages,
        }
    }

    /// Writes every segment into the front of `out` and returns how many it wrote: each rect's
    /// rows in order, or the whole rect when it is contiguous on both sides (a loop over
    /// pages and token slots, no per-entry bounds checks).
    ///
    /// # Panics
    /// If `out` is shorter than [`Plan::num_segments`].
    pub fn fill_segments<T>(&self, out: &mut [T], convert: impl Fn(Segment) -> T) -> usize {
        if !self.sends() {
            return 0;
        }
        if self.config.is_contiguous() {
            let mut written = 0;
            for (slot, rect) in out.iter_mut().zip(self.rects()) {
                *slot = convert(Segment {
                    src_offset: rect.src_offset,
                    dst_offset: rect.dst_offset,
                    length: rect.bytes(),
                });
                written += 1;
            }
            assert_eq!(
                written, self.runs,
                "fill_segments: output shorter than the plan"
            );
            return written;
        }
        let c = &self.config;
        let rows = c.page_size as usize;
        let needed = self.src_pages.len() * rows;
        assert!(
            out.len() >= needed,
            "fill_segments: output shorter than the plan"
        );
        let pages = self.src_pages.iter().zip(self.dst_pages);
        for (page_rows, (&s, &d)) in out[..needed].chunks_exact_mut(rows).zip(pages) {
            // No overflow: Plan::new checked the end of the highest page of each side.
            let mut src = u64::from(s) * c.src_item_len + c.src_head_slice_offset;
            let mut dst = u64::from(d) * c.dst_item_len + c.dst_head_slice_offset;
            for slot in page_rows {
                *slot = convert(Segment {
                    src_offset: src,
                    dst_offset: dst,
                    length: c.heads_bytes_per_token_to_send,
                });
                src += c.bytes_per_token_src;
                dst += c.bytes_per_token_dst;
            }
        }
        needed
    }
}

/// Iterator over the rects of a [`Plan`].
#[derive(Clone, Debug)]
pub struct Rects<'p> {
    plan: &'p Plan<'p>,
    next: usize,
    end: usize,
}

impl Iterator for Rects<'_> {
    type Item = CopyRect;

    fn next(&mut self) -> Option<CopyRect> {
        if self.next >= self.end {
            return None;
        }
        let (src, dst) = (self.plan.src_pages, self.plan.dst_pages);
        let start = self.next;
        let mut stop = start + 1;
        while stop < self.end && src[stop] == src[stop - 1] + 1 && dst[stop] == dst[stop - 1] + 1 {
            stop += 1;
        }
        self.next = stop;
        let c = &self.plan.config;
        // No overflow: Plan::new checked the end of the highest page of each side.
        Some(CopyRect {
            src_offset: u64::from(src[start]) * c.src_item_len + c.src_head_slice_offset,
            dst_offset: u64::from(dst[start]) * c.dst_item_len + c.dst_head_slice_offset,
            src_pitch: c.bytes_per_token_src,
            dst_pitch: c.bytes_per_token_dst,
            width: c.heads_bytes_per_token_to_send,
            height: (stop - start) as u64 * u64::from(c.page_size),
        })
    }
}

/// The rects of a request, collected.
pub fn plan(config: &SliceConfig, src_pages: &[i32], dst_pages: &[i32]) -> Result<Vec<CopyRect>> {
    Ok(Plan::new(config, src_pages, dst_pages)?.rects().collect())
}

/// The segments of a request, collected.
pub fn plan_segments(
    config: &SliceConfig,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<Segment>> {
    let plan = Plan::new(config, src_pages, dst_pages)?;
    let mut segments = vec![Segment::default(); plan.num_segments()?];
    plan.fill_segments(&mut segments, |segment| segment);
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 tokens per page; source tokens of 40 bytes, destination tokens of 20; the pair moves the
    /// 20 bytes at offset 20 of each source token into offset 0 of each destination token.
    fn config() -> SliceConfig {
        SliceConfig {
            action: Action::Send,
            page_size: 2,
            first_head: 1,
            num_heads: 1,
            src_item_len: 80,
            dst_item_len: 40,
            bytes_per_token_src: 40,
            bytes_per_token_dst: 20,
            src_head_slice_offset: 20,
            dst_head_slice_offset: 0,
            heads_bytes_per_token_to_send: 20,
        }
    }

    fn rect(src_page: u64, dst_page: u64, pages: u64) -> CopyRect {
        CopyRect {
            src_offset: src_page * 80 + 20,
            dst_offset: dst_page * 40,
            src_pitch: 40,
            dst_pitch: 20,
            width: 20,
            height: pages * 2,
        }
    }

    #[test]
    fn adjacent_pairs_on_both_sides_coalesce_into_one_rect_per_maximal_run() {
        // Runs: 3,4,5 -> 7,8,9 | 9,10 -> 1,2 | 2 -> 3 | 3 -> 5 (source adjacent, destination not).
        let rects = plan(&config(), &[3, 4, 5, 9, 10, 2, 3], &[7, 8, 9, 1, 2, 3, 5]).unwrap();
        assert_eq!(
            rects,
            vec![rect(3, 7, 3), rect(9, 1, 2), rect(2, 3, 1), rect(3, 5, 1)]
        );
        let p = Plan::new(&config(), &[3, 4, 5, 9, 10, 2, 3], &[7, 8, 9, 1, 2, 3, 5]).unwrap();
        assert_eq!(p.num_rects(), 4);
        assert_eq!(p.bytes_per_buffer(), 7 * 2 * 20);
        assert_eq!(
            (p.src_bytes_needed(), p.dst_bytes_needed()),
            (11 * 80, 10 * 40)
        );
    }

    #[test]
    fn a_descending_or_repeated_page_breaks_the_run() {
        let rects = plan(&config(), &[5, 4, 4], &[0, 1, 2]).unwrap();
        assert_eq!(rects, vec![rect(5, 0, 1), rect(4, 1, 1), rect(4, 2, 1)]);
    }

    #[test]
    fn narrow_slices_become_one_segment_per_token_row() {
        let segments = plan_segments(&config(), &[3, 4], &[7, 8]).unwrap();
        let expected: Vec<Segment> = (0..4)
            .map(|row| Segment {
                src_offset: 3 * 80 + 20 + row * 40,
                dst_offset: 7 * 40 + row * 20,
                length: 20,
            })
            .collect();
        assert_eq!(segments, expected);
        assert_eq!(
            Plan::new(&config(), &[3, 4], &[7, 8])
                .unwrap()
                .num_segments(),
            Ok(4)
        );
    }

    #[test]
    fn whole_token_slices_become_one_segment_per_run() {
        let c = SliceConfig {
            src_item_len: 40,
            bytes_per_token_src: 20,
            src_head_slice_offset: 0,
            first_head: 0,
            ..config()
        };
        let segments = plan_segments(&c, &[3, 4, 8], &[7, 8, 9]).unwrap();
        assert_eq!(
            segments,
            vec![
                Segment {
                    src_offset: 120,
                    dst_offset: 280,
                    length: 80
                },
                Segment {
                    src_offset: 320,
                    dst_offset: 360,
                    length: 40
                },
            ]
        );
        assert_eq!(
            Plan::new(&c, &[3, 4, 8], &[7, 8, 9])
                .unwrap()
                .num_segments(),
            Ok(2)
        );
    }

    #[test]
    fn the_fast_segment_loop_yields_exactly_the_rect_rows() {
        let whole = SliceConfig {
            src_item_len: 40,
            bytes_per_token_src: 20,
            src_head_slice_offset: 0,
            first_head: 0,
            ..config()
        };
        let (src, dst) = ([3, 4, 5, 9, 10, 2, 3, 0], [7, 8, 9, 1, 2, 3, 5, 6]);
        for c in [config(), whole] {
            let plan = Plan::new(&c, &src, &dst).unwrap();
            let mut fast = vec![Segment::default(); plan.num_segments().unwrap() + 2];
            let written = plan.fill_segments(&mut fast, |s| s);
            assert_eq!(written, plan.num_segments().unwrap());
            // The reference: every row of every rect, or the whole rect when contiguous.
            let rows: Vec<Segment> = plan
                .rects()
                .flat_map(|r| {
                    let (n, len) = if r.is_contiguous() {
                        (1, r.bytes())
                    } else {
                        (r.height, r.width)
                    };
                    (0..n).map(move |row| Segment {
                        src_offset: r.src_offset + row * r.src_pitch,
                        dst_offset: r.dst_offset + row * r.dst_pitch,
                        length: len,
                    })
                })
                .collect();
            assert_eq!(fast[..written], rows[..]);
            assert_eq!(
                fast[written..],
                [Segment::default(); 2],
                "nothing past the plan"
            );
        }
    }

    #[test]
    fn the_first_negative_page_is_named_whichever_side_it_is_on() {
        let err = |src: &[i32], dst: &[i32]| Plan::new(&config(), src, dst).unwrap_err();
        assert_eq!(
            err(&[0, 1, 2], &[4, -7, 5]),
            Error::OutOfBounds("decode side: page index -7 at position 1 is negative".into())
        );
        assert_eq!(
            err(&[0, i32::MIN, 2], &[4, -7, 5]),
            Error::OutOfBounds(
                "prefill side: page index -2147483648 at position 1 is negative".into()
            )
        );
    }

    #[test]
    fn pairs_that_do_not_send_plan_nothing_but_still_check_their_pages() {
        let skip = SliceConfig {
            action: Action::SkipReplica,
            first_head: 0,
            num_heads: 0,
            src_head_slice_offset: 0,
            heads_bytes_per_token_to_send: 0,
            ..config()
        };
        let p = Plan::new(&skip, &[1, 2], &[3, 4]).unwrap();
        assert_eq!(
            (p.num_rects(), p.num_segments(), p.rects().count()),
            (0, Ok(0), 0)
        );
        assert!(matches!(
            Plan::new(&skip, &[1, -2], &[3, 4]),
            Err(Error::OutOfBounds(_))
        ));
    }

    #[test]
    fn unequal_page_array_lengths_are_refused() {
        let err = Plan::new(&config(), &[1, 2], &[3]).unwrap_err();
        assert_eq!(
            err,
            Error::InvalidArgument(
                "2 source pages but 1 destination pages (they are paired one to one)".into()
            )
        );
    }
}
