//! Copy plans: a request's elements turned into strided 2D copies (rects), or into the same
//! bytes as contiguous 1D segments for RDMA batch writes, directly or staged.
//!
//! One generator serves both families of the C ABI. A plan walks a request's elements (one head
//! of one token each) between two *sides*, each a page buffer described by a layout, or a dense
//! staging region; see [`walk`](self) for how the walk stays proportional to pages. The
//! uniform functions (one page size, token-major pages, whole pages) are the case where both
//! sides are token-major and share a page size, and keep their results exactly: their rects
//! are the walk's own rows, one per maximal run of pages. Pair plans (any layout, REFERENCE.md
//! section 11) take their segments in the order, among those the reference lists, with the fewest
//! transport segments (the first on a tie), and grow rects greedily from the segments of the
//! order that, among those with the fewest segments, gives the fewest rects.
//!
//! Staging exists for RDMA engines (MORI-IO, Mooncake, NIXL): they take flat
//! `(src, dst, length)` lists and merge nothing across a stride, so a slice narrower than a
//! token slot would cost one segment per token per buffer. Packing it into a dense region
//! first leaves the transport a few large segments. Buffer `b` of a request owns the
//! `staging_len` bytes at `b * staging_len` of the staging region. Because pack, transport and
//! unpack are plans between such sides, their composition leaves every destination byte as one
//! direct send does.

#![forbid(unsafe_code)]

mod choice;
mod entries;
mod memory;
mod pair;
mod stream;
mod uniform;
mod walk;

pub use pair::{PairPlan, pair_plan, pair_segments, pair_staging_for};
pub use uniform::{SlicePlan, plan, plan_segments, plan_transfer, staging_for, staging_len};

use choice::{Ties, fewest_rects};
pub use entries::{CopyRect, OutputEntry, Segment};
pub(crate) use memory::check_staging_capacity;
pub use memory::{RankMemory, check_pair_transfer, check_transfer};

use std::cell::OnceCell;

use crate::error::{Error, Result, checked_usize};
use crate::layout::position_of;
use crate::types::Side;
use stream::{Counter, Merger, Rects, Writer};
use walk::{Geometry, Joiner, Order, Pages, SideGeom};

/// Steps of work the plans built on this thread have done so far: pieces of a request walked,
/// periods of a repeated stretch followed, rows and segments passed on one by one. A test hook
/// (`tests/layouts.rs` checks that a plan's work grows with its pages and entries, never with
/// its tokens); not part of the API.
#[doc(hidden)]
pub fn work_steps() -> u64 {
    walk::work_done()
}

/// The bytes a buffer of one side needs to hold every page of a request: the highest page and
/// where it ends, with the page list to name its position in a message.
#[derive(Clone, Copy, Debug)]
struct Bounds<'a> {
    side: Side,
    pages: Option<&'a [i32]>,
    highest: Option<(u64, u64)>,
}

impl Bounds<'_> {
    /// Position of `page` in the list, looked up only to name it in a message.
    fn position(&self, page: u64) -> usize {
        match self.pages {
            Some(pages) => position_of(pages, page),
            None => page as usize,
        }
    }

    fn needed(&self) -> u64 {
        self.highest.map_or(0, |(_, end)| end)
    }

    fn check(&self, capacity: u64) -> Result<()> {
        match self.highest {
            Some((page, end)) if end > capacity => Err(Error::PagePastCapacity {
                side: self.side,
                page: page as u32,
                position: self.position(page),
                end,
                capacity,
            }),
            _ => Ok(()),
        }
    }
}

/// How a plan makes its rects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RectShape {
    /// The walk's rows, joined: one rect per run of pages (REFERENCE.md section 5).
    Rows,
    /// Grown greedily from the segments (REFERENCE.md section 11).
    Greedy,
}

/// The validated elements of one request, ready to yield segments or rects: what every plan
/// is. Building one checked everything that does not depend on buffers (config, pages, every
/// offset against overflow); after that, producing the plan cannot fail.
#[derive(Clone, Debug)]
pub struct Walk<'a> {
    geometry: Geometry<'a>,
    /// The order of the segments: the first of `ties`.
    order: Order,
    /// The orders whose segments are fewest; the rects' order is chosen among them.
    ties: Ties,
    shape: RectShape,
    sends: bool,
    bytes_per_buffer: u64,
    src: Bounds<'a>,
    dst: Bounds<'a>,
    segments: OnceCell<u64>,
    rects: OnceCell<Vec<CopyRect>>,
}

impl<'a> Walk<'a> {
    /// True when the plan moves bytes.
    pub fn sends(&self) -> bool {
        self.sends
    }

    /// Bytes moved per buffer (per layer K or V).
    pub fn bytes_per_buffer(&self) -> u64 {
        self.bytes_per_buffer
    }

    /// Bytes each source buffer must hold for every page of the request (0 when empty).
    pub fn src_bytes_needed(&self) -> u64 {
        self.src.needed()
    }

    /// Bytes each destination buffer must hold for every page of the request (0 when empty).
    pub fn dst_bytes_needed(&self) -> u64 {
        self.dst.needed()
    }

    /// Checks that every page of the request lies inside buffers of the given capacities.
    pub fn check_capacity(&self, src_capacity: u64, dst_capacity: u64) -> Result<()> {
        self.src.check(src_capacity)?;
        self.dst.check(dst_capacity)
    }

    /// The rects, in order (empty unless the plan sends).
    pub fn rects(&self) -> std::iter::Copied<std::slice::Iter<'_, CopyRect>> {
        self.rect_list().iter().copied()
    }

    /// Number of rects.
    pub fn num_rects(&self) -> usize {
        self.rect_list().len()
    }

    fn rect_list(&self) -> &[CopyRect] {
        self.rects.get_or_init(|| {
            if !self.sends {
                return Vec::new();
            }
            match self.shape {
                RectShape::Rows => {
                    let mut rows = Joiner::new(Vec::new());
                    self.geometry.walk(self.order, &mut rows);
                    rows.finish()
                }
                RectShape::Greedy => {
                    // Greedy rects never continue one another (a rect that could take the
                    // next segment did), so nothing joins them after.
                    let order = fewest_rects(&self.geometry, self.ties.as_slice());
                    let mut merger = Merger::new(Rects::new(Vec::new()));
                    self.geometry.walk(order, &mut merger);
                    merger.finish().finish()
                }
            }
        })
    }

    /// Number of segments: each maximal run of elements contiguous on both sides, in order.
    pub fn num_segments(&self) -> Result<usize> {
        let count = *self.segments.get_or_init(|| {
            if self.sends {
                self.geometry
                    .count(self.order, u64::MAX)
                    .expect("no cap to reach")
            } else {
                0
            }
        });
        checked_usize("segments as usize", count)
    }

    /// Writes every segment into the front of `out` and returns how many it wrote. `out` may
    /// be uninitialised memory (`[MaybeUninit<T>]`): it is only written.
    ///
    /// # Panics
    /// If `out` is shorter than [`Walk::num_segments`].
    pub fn fill_segments<T, S: OutputEntry<T>>(
        &self,
        out: &mut [S],
        convert: impl Fn(Segment) -> T,
    ) -> usize {
        if !self.sends {
            return 0;
        }
        let writer = Writer {
            written: 0,
            put: |i: usize, segment| {
                out.get_mut(i)
                    .expect("fill_segments: output shorter than the plan")
                    .put(convert(segment))
            },
        };
        let mut merger = Merger::new(writer);
        self.geometry.walk(self.order, &mut merger);
        merger.finish().written
    }

    /// The segments, collected.
    pub fn segments(&self) -> Result<Vec<Segment>> {
        let mut segments = vec![Segment::default(); self.num_segments()?];
        let written = self.fill_segments(&mut segments, |segment| segment);
        debug_assert_eq!(written, segments.len());
        Ok(segments)
    }

    /// The segments counted by walking every element, without the shortcuts of
    /// [`Walk::num_segments`]; `tests/layouts.rs` checks the two agree on every pair plan.
    #[doc(hidden)]
    pub fn walked_segments(&self) -> u64 {
        let mut merger = Merger::new(Counter::default());
        if self.sends {
            self.geometry.walk(self.order, &mut merger);
        }
        merger.finish().0
    }
}

/// Where the highest page's slice starts on a side (see [`SideGeom::reach`]), saturating.
fn reach(highest: u64, page_stride: u64, base: u64) -> u64 {
    highest.saturating_mul(page_stride).saturating_add(base)
}

/// A staging region of `tokens` tokens of `heads` heads, token-major or head-major in chunks of
/// `G` tokens (REFERENCE.md sections 6 and 11). A token-major region is cut into pages of `page_size`
/// tokens (the unstaged side's, so that both sides change page together); its addresses do not
/// depend on it.
fn region(
    tokens: u64,
    heads: u64,
    hb: u64,
    head_major: Option<u64>,
    page_size: u64,
) -> SideGeom<'static> {
    let slice = heads * hb;
    // The highest position of a region cut into pages of `page_size` tokens.
    let highest = |page_size: u64| tokens.div_ceil(page_size).saturating_sub(1);
    match head_major {
        None => {
            let page_size = page_size.max(1);
            SideGeom {
                pages: Pages::Dense,
                page_size,
                page_stride: page_size * slice,
                base: 0,
                token_stride: slice,
                head_stride: hb,
                last_head_stride: None,
                reach: reach(highest(page_size), page_size * slice, 0),
            }
        }
        Some(g) => {
            let g = g.max(1);
            let partial = tokens % g;
            SideGeom {
                pages: Pages::Dense,
                page_size: g,
                page_stride: g * slice,
                base: 0,
                token_stride: hb,
                head_stride: g * hb,
                last_head_stride: (partial != 0).then_some((tokens / g, partial * hb)),
                reach: reach(highest(g), g * slice, 0),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::choice::{count_fewest, head_major_orders};
    use super::*;
    use crate::layout::Request;
    use crate::layout::{Layout, pair_config};
    use crate::types::Staging;
    use mori_tp_testkit::Rng;

    fn pick<T: Copy>(rng: &mut Rng, items: &[T]) -> T {
        items[rng.range(0, items.len() as u64 - 1) as usize]
    }

    /// The orders as they were chosen before the layouts could prove anything: token-major
    /// counted to the end, then every head-major order up to a tie with the best so far.
    fn fewest_segments_counted(geometry: &Geometry<'_>, page_sizes: [u64; 2]) -> (Ties, u64) {
        let (orders, len) = head_major_orders(geometry.tokens, page_sizes);
        let len = if geometry.heads <= 1 { 0 } else { len };
        count_fewest(geometry, &orders[..len], |_, _| false)
    }

    /// Both sides' address of element `(k, j)`, from the definition of a side.
    fn address(side: &SideGeom<'_>, k: u64, j: u64) -> u64 {
        let position = k / side.page_size;
        let page = match side.pages {
            Pages::List(pages) => pages[position as usize] as u64,
            Pages::Dense => position,
        };
        let head_stride = match side.last_head_stride {
            Some((last, stride)) if last == position => stride,
            _ => side.head_stride,
        };
        page * side.page_stride
            + side.base
            + (k % side.page_size) * side.token_stride
            + j * head_stride
    }

    /// The elements of `order`, one by one.
    fn elements(g: &Geometry<'_>, order: Order) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        match order {
            Order::TokenMajor => {
                for k in 0..g.tokens {
                    out.extend((0..g.heads).map(|j| (k, j)));
                }
            }
            Order::HeadMajor(chunk) => {
                for c0 in (0..g.tokens).step_by(chunk as usize) {
                    let c1 = (c0 + chunk).min(g.tokens);
                    for j in 0..g.heads {
                        out.extend((c0..c1).map(|k| (k, j)));
                    }
                }
            }
        }
        out
    }

    /// The segments of `order` counted element by element: a new one wherever an element does
    /// not start where the last one ended on both sides.
    fn brute_segments(g: &Geometry<'_>, order: Order) -> u64 {
        let mut segments = 0;
        let mut end = None;
        for (k, j) in elements(g, order) {
            let at = (address(&g.src, k, j), address(&g.dst, k, j));
            if end != Some(at) {
                segments += 1;
            }
            end = Some((at.0 + g.head_bytes, at.1 + g.head_bytes));
        }
        segments
    }

    /// A side with arbitrary strides (overlapping and interleaving elements included), listed
    /// pages (repeats included) or a dense region, whose head strides may differ on its last
    /// page: more than any valid layout, so that the floors are checked beyond what layouts
    /// allow.
    fn raw_side<'a>(
        rng: &mut Rng,
        pages: &'a mut Vec<i32>,
        tokens: u64,
        heads: u64,
        hb: u64,
    ) -> SideGeom<'a> {
        let page_size = rng.range(1, 4);
        let any = rng.range(0, 20);
        let token_stride = pick(
            rng,
            &[0, hb, 2 * hb, heads * hb, heads * hb + 1, 3 * hb + 1, any],
        );
        let any = rng.range(0, 20);
        let head_stride = pick(rng, &[hb, 2 * hb, page_size * hb, 0, any]);
        let any = rng.range(0, 40);
        let run = (page_size - 1) * token_stride + hb;
        let page_stride = pick(
            rng,
            &[
                0,
                run,
                2 * run,
                page_size * heads * hb,
                page_size * token_stride,
                any,
            ],
        );
        let positions = tokens.div_ceil(page_size);
        let dense = rng.range(0, 3) == 0;
        *pages = (0..positions).map(|_| rng.range(0, 4) as i32).collect();
        let highest = if dense {
            positions.saturating_sub(1)
        } else {
            pages.iter().max().map_or(0, |&p| p as u64)
        };
        let base = rng.range(0, 8);
        SideGeom {
            pages: if dense {
                Pages::Dense
            } else {
                Pages::List(pages)
            },
            page_size,
            page_stride,
            base,
            token_stride,
            head_stride,
            last_head_stride: (dense && positions > 0 && rng.range(0, 1) == 0)
                .then(|| (positions - 1, rng.range(0, 3 * hb))),
            reach: highest * page_stride + base,
        }
    }

    #[test]
    fn the_floors_and_ceilings_bound_the_segments_counted_element_by_element() {
        let mut rng = Rng::new(4077);
        let mut floors = 0;
        for case in 0..100_000 {
            let tokens = rng.range(0, 12);
            let heads = rng.range(1, 4);
            let hb = rng.range(1, 4);
            let (mut src_pages, mut dst_pages) = (Vec::new(), Vec::new());
            let src = raw_side(&mut rng, &mut src_pages, tokens, heads, hb);
            let dst = raw_side(&mut rng, &mut dst_pages, tokens, heads, hb);
            let g = Geometry {
                src,
                dst,
                tokens,
                heads,
                head_bytes: hb,
            };
            let what = format!("case {case}: {g:?}");
            assert!(
                g.token_major_ceiling() >= brute_segments(&g, Order::TokenMajor),
                "{what}"
            );
            let page_sizes = [g.src.page_size, g.dst.page_size];
            let (orders, len) = head_major_orders(tokens, page_sizes);
            if !g.head_runs_broken() {
                continue;
            }
            for &order in &orders[..len] {
                let floor = g.head_major_floor(g.chunk_len(order));
                assert!(floor <= brute_segments(&g, order), "{what}, {order:?}");
                floors += u64::from(floor > 0);
            }
        }
        assert!(floors > 10_000, "only {floors} floors above 0");
    }

    #[test]
    fn head_runs_are_compared_in_true_integers() {
        // Heads of 2^62 bytes in slots 3 * 2^62 apart: a page's last slot ends 2^64 past its
        // first, a multiple of a page stride of 2^62 but not of 3 (where the wrapped sum, 0,
        // would be a multiple of both).
        let side = |page_stride: u64, token_stride: u64| SideGeom {
            pages: Pages::Dense,
            page_size: 2,
            page_stride,
            base: 0,
            token_stride,
            head_stride: 1 << 62,
            last_head_stride: None,
            reach: 0,
        };
        let geometry = |src: SideGeom<'static>| Geometry {
            src,
            // Slots one head apart: never breaks a head run.
            dst: side(1 << 63, 1 << 62),
            tokens: 4,
            heads: 2,
            head_bytes: 1 << 62,
        };
        assert!(!geometry(side(1 << 62, 3 << 62)).head_runs_broken());
        assert!(geometry(side(3, 3 << 62)).head_runs_broken());
    }

    /// A layout of one of the kinds the layout tests use (NHD, HND, padded, heads outside pages,
    /// gapped heads) or with random strides, when those are valid.
    fn random_layout(rng: &mut Rng, side: Side, h: u32, tp: u32, ps: u32, hb: u64) -> Layout {
        let rank = rng.range(0, u64::from(tp) - 1) as u32;
        let nhd = Layout::nhd(h, tp, rank, ps, hb).expect("a valid NHD layout");
        let hnd = Layout::hnd(h, tp, rank, ps, hb).expect("a valid HND layout");
        let local = nhd.token_stride / hb;
        let slots = u64::from(ps);
        let pad = rng.range(1, 2 * hb);
        let layout = match rng.range(0, 6) {
            0 => nhd,
            1 => hnd,
            2 => {
                let head_stride = hb + pad;
                let token_stride = (local - 1) * head_stride + hb + pick(rng, &[0, 2 * pad]);
                Layout {
                    head_stride,
                    token_stride,
                    offset: 3 * pad,
                    page_stride: 3 * pad + slots * token_stride + pad,
                    ..nhd
                }
            }
            3 => {
                let page_stride = slots * hb + pad;
                Layout {
                    token_stride: hb,
                    page_stride,
                    offset: pad,
                    head_stride: 8 * page_stride + pad,
                    ..hnd
                }
            }
            4 => {
                let head_stride = 2 * hb;
                let token_stride = (local - 1) * head_stride + hb;
                Layout {
                    head_stride,
                    token_stride,
                    page_stride: slots * token_stride,
                    ..nhd
                }
            }
            _ => Layout {
                offset: rng.range(0, 3),
                token_stride: rng.range(hb, (local + 2) * hb),
                head_stride: rng.range(hb, (slots + 2) * hb),
                page_stride: rng.range(0, (slots + 1) * (local + 1) * hb + 4),
                ..nhd
            },
        };
        if layout.check(side).is_ok() {
            layout
        } else {
            nhd
        }
    }

    /// How a plan's orders were chosen.
    #[derive(Debug, Default)]
    struct Paths {
        /// Token-major proven the only order with the fewest segments, nothing counted.
        proven: u64,
        /// Counted, with a head-major order skipped as its floor was above the best count.
        skipped: u64,
        /// Counted, every order.
        counted: u64,
    }

    /// Checks a plan's orders, segments and rects against those the counting path gives.
    fn check_against_counting(
        walk: &Walk<'_>,
        page_sizes: [u64; 2],
        paths: &mut Paths,
        what: &str,
    ) {
        if !walk.sends() {
            return;
        }
        let g = &walk.geometry;
        let (ties, count) = fewest_segments_counted(g, page_sizes);
        assert_eq!(walk.ties.as_slice(), ties.as_slice(), "{what}");
        assert_eq!(walk.order, ties.first(), "{what}");
        if walk.segments.get().is_none() {
            paths.proven += u64::from(g.heads > 1);
        } else {
            let (orders, len) = head_major_orders(g.tokens, page_sizes);
            let skipped = g.head_runs_broken()
                && orders[..len]
                    .iter()
                    .any(|&order| g.head_major_floor(g.chunk_len(order)) > count);
            if skipped && g.heads > 1 {
                paths.skipped += 1;
            } else {
                paths.counted += 1;
            }
        }
        assert_eq!(walk.num_segments().unwrap() as u64, count, "{what}");
        // The plan the counting path made, with nothing computed yet.
        let counted = Walk {
            order: ties.first(),
            ties,
            segments: OnceCell::from(count),
            rects: OnceCell::new(),
            ..walk.clone()
        };
        assert_eq!(
            walk.rects().collect::<Vec<_>>(),
            counted.rects().collect::<Vec<_>>(),
            "{what}"
        );
        assert_eq!(
            walk.segments().unwrap(),
            counted.segments().unwrap(),
            "{what}"
        );
    }

    #[test]
    fn pair_plans_choose_the_orders_rects_and_segments_that_counting_every_order_chooses() {
        let mut rng = Rng::new(2026);
        let mut paths = Paths::default();
        let mut plans = 0;
        while plans < 40_000 {
            let h = pick(&mut rng, &[1, 2, 3, 4, 6, 8]);
            let hb = pick(&mut rng, &[1, 2, 4]);
            let ps = [
                pick(&mut rng, &[1, 2, 3, 4, 16]),
                pick(&mut rng, &[1, 2, 3, 4, 16]),
            ];
            let ps = if rng.range(0, 1) == 0 {
                [ps[0], ps[0]]
            } else {
                ps
            };
            let tp = [rng.range(1, 8) as u32, rng.range(1, 8) as u32];
            if Layout::nhd(h, tp[0], 0, ps[0], hb).is_err()
                || Layout::nhd(h, tp[1], 0, ps[1], hb).is_err()
            {
                continue;
            }
            let src = random_layout(&mut rng, Side::Prefill, h, tp[0], ps[0], hb);
            let dst = random_layout(&mut rng, Side::Decode, h, tp[1], ps[1], hb);
            let Ok(config) = pair_config(&src, &dst) else {
                continue;
            };
            let page_sizes = [u64::from(ps[0]), u64::from(ps[1])];
            for _ in 0..4 {
                let tokens = match rng.range(0, 2) {
                    // Whole pages of the prefill side.
                    0 => rng.range(0, 4) * page_sizes[0],
                    _ => rng.range(0, 40),
                };
                let list = |rng: &mut Rng, page_size: u64| -> Vec<i32> {
                    (0..tokens.div_ceil(page_size))
                        .map(|_| rng.range(0, 7) as i32)
                        .collect()
                };
                let (src_pages, dst_pages) =
                    (list(&mut rng, page_sizes[0]), list(&mut rng, page_sizes[1]));
                let request = Request {
                    src_pages: &src_pages,
                    dst_pages: &dst_pages,
                    num_tokens: tokens,
                };
                let what = format!("{src:?} -> {dst:?}, {tokens} tokens, {request:?}");
                for staging in [Staging::None, Staging::Src, Staging::Dst, Staging::Both] {
                    // Pages past a run of heads outside pages are refused; so is nothing else.
                    let Ok(plan) = PairPlan::transfer(&config, &request, staging) else {
                        continue;
                    };
                    check_against_counting(&plan, page_sizes, &mut paths, &what);
                    plans += 1;
                    if staging.stages_src() {
                        let plan = PairPlan::pack(&config, staging, &request).unwrap();
                        check_against_counting(&plan, page_sizes, &mut paths, &what);
                    }
                    if staging.stages_dst() {
                        let plan = PairPlan::unpack(&config, staging, &request).unwrap();
                        check_against_counting(&plan, page_sizes, &mut paths, &what);
                    }
                }
            }
        }
        // Every path was taken, often.
        assert!(
            paths.proven > 500 && paths.skipped > 500 && paths.counted > 500,
            "{paths:?}"
        );
    }

    #[test]
    fn on_section_4_layouts_a_pair_plan_counts_no_segments() {
        let mut rng = Rng::new(44);
        let mut proven = 0;
        for _ in 0..2000 {
            let hb = pick(&mut rng, &[2, 256]);
            let ps = pick(&mut rng, &[1, 3, 16, 64]);
            let tp = [pick(&mut rng, &[1, 2, 4, 8]), pick(&mut rng, &[1, 2, 4, 8])];
            let ranks = tp.map(|tp| rng.range(0, u64::from(tp) - 1) as u32);
            let src = Layout::nhd(8, tp[0], ranks[0], ps, hb).unwrap();
            let dst = Layout::nhd(8, tp[1], ranks[1], ps, hb).unwrap();
            let config = pair_config(&src, &dst).unwrap();
            let pages = rng.range(1, 20) as usize;
            let request = Request {
                src_pages: &(0..pages as i32).rev().collect::<Vec<_>>(),
                dst_pages: &(0..pages as i32).collect::<Vec<_>>(),
                num_tokens: pages as u64 * u64::from(ps),
            };
            let plan = PairPlan::transfer(&config, &request, Staging::None).unwrap();
            if !plan.sends() || request.num_tokens < 2 {
                continue;
            }
            assert_eq!(
                plan.segments.get(),
                None,
                "{tp:?} {ranks:?}, page size {ps}, {pages} pages: counted"
            );
            assert_eq!(plan.order, Order::TokenMajor);
            proven += 1;
        }
        assert!(proven > 500, "{proven}");
    }
}
