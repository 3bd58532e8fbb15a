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

mod stream;
mod walk;

use std::cell::OnceCell;
use std::mem::MaybeUninit;
use std::ops::Deref;

use crate::error::{Error, Result, checked_product, checked_usize};
use crate::layout::{PairConfig, Request, ValidLayout};
use crate::slice::{IntoValid, SliceConfig, ValidConfig};
use crate::types::{Action, Side, Staging};
use stream::{Counter, Merger, RectCount, Rects, Writer};
use walk::{Geometry, Joiner, Order, Pages, SideGeom};

/// Steps of work the plans built on this thread have done so far: pieces of a request walked,
/// periods of a repeated stretch followed, rows and segments passed on one by one. A test hook
/// (`tests/layouts.rs` checks that a plan's work grows with its pages and entries, never with
/// its tokens); not part of the API.
#[doc(hidden)]
pub fn work_steps() -> u64 {
    walk::work_done()
}

/// One strided 2D copy, exactly the arguments of one hipMemcpy2DAsync: height rows of width
/// bytes, row r read at src_offset + r * src_pitch and written at dst_offset + r * dst_pitch.
/// Offsets are relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CopyRect {
    /// Byte offset of the first source row.
    pub src_offset: u64,
    /// Byte offset of the first destination row.
    pub dst_offset: u64,
    /// Bytes between source rows (bytes_per_token_src for mori_tp_plan).
    pub src_pitch: u64,
    /// Bytes between destination rows (bytes_per_token_dst for mori_tp_plan).
    pub dst_pitch: u64,
    /// Bytes per row (heads_bytes_per_token_to_send for mori_tp_plan).
    pub width: u64,
    /// Rows (for mori_tp_plan: tokens in the run of pages, run length * page_size).
    pub height: u64,
}

impl CopyRect {
    /// True when the rows are back to back on both sides, so the rect is one contiguous block.
    pub fn is_contiguous(&self) -> bool {
        self.width == self.src_pitch && self.width == self.dst_pitch
    }

    /// Bytes the rect moves. Cannot overflow for a rect of a plan: its rows lie inside pages
    /// whose ends were checked to fit in `u64`.
    pub fn bytes(&self) -> u64 {
        self.width * self.height
    }
}

/// One contiguous copy, for RDMA batch writes; offsets relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub length: u64,
}

/// An entry of an output array that [`Walk::fill_segments`] writes: a plain value, or an
/// uninitialised slot of caller memory (a C array, a numpy `empty` buffer, spare `Vec`
/// capacity), which must only ever be written.
pub trait OutputEntry<T> {
    /// Stores `value`.
    fn put(&mut self, value: T);
}

impl<T> OutputEntry<T> for T {
    fn put(&mut self, value: T) {
        *self = value;
    }
}

impl<T> OutputEntry<T> for MaybeUninit<T> {
    fn put(&mut self, value: T) {
        self.write(value);
    }
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
            Some(pages) => pages.iter().position(|&p| p as u64 == page).unwrap_or(0),
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

/// The highest index of a page list, after refusing a negative one (the lowest position).
fn highest_page(side: Side, pages: &[i32]) -> Result<Option<i32>> {
    // No early exit and no bounds checks: the loop runs at memory speed.
    let (ored, max) = pages
        .iter()
        .fold((0i32, i32::MIN), |(ored, max), &p| (ored | p, max.max(p)));
    if ored < 0 {
        let position = pages.iter().position(|&p| p < 0).unwrap_or(0);
        return Err(Error::NegativePage {
            side,
            page: pages[position],
            position,
        });
    }
    Ok((!pages.is_empty()).then_some(max))
}

/// How a plan makes its rects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RectShape {
    /// The walk's rows, joined: one rect per run of pages (REFERENCE.md section 5).
    Rows,
    /// Grown greedily from the segments (REFERENCE.md section 11).
    Greedy,
}

/// The orders whose segments are fewest, in the reference's list order (token-major, then
/// head-major in chunks of the prefill page size, the decode page size, all tokens): the first
/// is the order of a plan's segments; its rects come from the one of them with the fewest.
#[derive(Clone, Copy, Debug)]
struct Ties {
    orders: [Order; 4],
    len: usize,
}

impl Ties {
    fn one(order: Order) -> Ties {
        Ties {
            orders: [order; 4],
            len: 1,
        }
    }

    fn push(&mut self, order: Order) {
        self.orders[self.len] = order;
        self.len += 1;
    }

    fn first(&self) -> Order {
        self.orders[0]
    }

    fn as_slice(&self) -> &[Order] {
        &self.orders[..self.len]
    }
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

// ---- REFERENCE.md sections 4-6: one page size, token-major pages --------------------------------

/// A uniform plan: a slice config and its page pairs, direct or with staged sides.
#[derive(Clone, Debug)]
pub struct SlicePlan<'a> {
    walk: Walk<'a>,
    config: ValidConfig,
    num_pages: usize,
}

impl<'a> Deref for SlicePlan<'a> {
    type Target = Walk<'a>;

    fn deref(&self) -> &Walk<'a> {
        &self.walk
    }
}

/// Where the highest page's slice starts on a side (see [`SideGeom::reach`]), saturating.
fn reach(highest: u64, page_stride: u64, base: u64) -> u64 {
    highest.saturating_mul(page_stride).saturating_add(base)
}

/// A uniform side: token-major pages of `item_len` bytes, the slice at `slice_offset`;
/// `highest` is the highest page index.
fn slice_side(
    pages: &[i32],
    highest: u64,
    page_size: u32,
    item_len: u64,
    bpt: u64,
    offset: u64,
    hb: u64,
) -> SideGeom<'_> {
    SideGeom {
        pages: Pages::List(pages),
        page_size: u64::from(page_size),
        page_stride: item_len,
        base: offset,
        token_stride: bpt,
        head_stride: hb,
        last_head_stride: None,
        reach: reach(highest, item_len, offset),
    }
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

impl<'a> SlicePlan<'a> {
    /// The direct plan: source page `src_pages[i]` to destination page `dst_pages[i]`.
    pub fn new(config: impl IntoValid, src_pages: &'a [i32], dst_pages: &'a [i32]) -> Result<Self> {
        SlicePlan::transfer(config, Staging::None, src_pages, dst_pages)
    }

    /// The transport plan of a staged transfer: each side that `staging` stages is read or
    /// written as a dense staging region instead of through its page list. Both page lists are
    /// validated all the same, and [`Staging::None`] is [`SlicePlan::new`].
    pub fn transfer(
        config: impl IntoValid,
        staging: Staging,
        src_pages: &'a [i32],
        dst_pages: &'a [i32],
    ) -> Result<Self> {
        let config = config.into_valid()?;
        if src_pages.len() != dst_pages.len() {
            return Err(Error::PageCountMismatch {
                src: src_pages.len(),
                dst: dst_pages.len(),
            });
        }
        let src_max = highest_page(Side::Prefill, src_pages)?;
        let dst_max = highest_page(Side::Decode, dst_pages)?;
        SlicePlan::build(
            config,
            [
                (src_pages, src_max, staging.stages_src()),
                (dst_pages, dst_max, staging.stages_dst()),
            ],
        )
    }

    /// The pack plan of the prefill rank: source pages into its dense staging region.
    pub fn pack(config: impl IntoValid, src_pages: &'a [i32]) -> Result<Self> {
        let config = config.into_valid()?;
        let max = highest_page(Side::Prefill, src_pages)?;
        SlicePlan::build(config, [(src_pages, max, false), (src_pages, max, true)])
    }

    /// The unpack plan of the decode rank: its dense staging region into destination pages.
    pub fn unpack(config: impl IntoValid, dst_pages: &'a [i32]) -> Result<Self> {
        let config = config.into_valid()?;
        let max = highest_page(Side::Decode, dst_pages)?;
        SlicePlan::build(config, [(dst_pages, max, true), (dst_pages, max, false)])
    }

    /// The plan between two sides, each (its page list, its highest page, staged).
    fn build(config: ValidConfig, sides: [(&'a [i32], Option<i32>, bool); 2]) -> Result<Self> {
        let c = &config;
        let num_pages = sides[0].0.len();
        let tokens = checked_product(
            "tokens (pages * page_size)",
            num_pages as u64,
            u64::from(c.page_size),
        );
        let sends = c.action == Action::Send;
        let hb = if sends {
            c.heads_bytes_per_token_to_send / u64::from(c.num_heads)
        } else {
            0
        };
        let mut geoms = Vec::with_capacity(2);
        let mut bounds = Vec::with_capacity(2);
        for (side, (pages, max, staged)) in [Side::Prefill, Side::Decode].into_iter().zip(sides) {
            let (item_len, bpt, offset) = match side {
                Side::Prefill => (
                    c.src_item_len,
                    c.bytes_per_token_src,
                    c.src_head_slice_offset,
                ),
                Side::Decode => (
                    c.dst_item_len,
                    c.bytes_per_token_dst,
                    c.dst_head_slice_offset,
                ),
            };
            if staged {
                // The region's staging_len: pages * page_size * width.
                let staged_item = u64::from(c.page_size) * c.heads_bytes_per_token_to_send;
                let end = checked_product(
                    "staging_len (pages * page bytes)",
                    num_pages as u64,
                    staged_item,
                )?;
                bounds.push(Bounds {
                    side,
                    pages: None,
                    highest: (num_pages > 0).then(|| (num_pages as u64 - 1, end)),
                });
                geoms.push(None);
                continue;
            }
            let highest = match max {
                None => None,
                Some(page) => {
                    let end = (page as u64 + 1).checked_mul(item_len).ok_or_else(|| {
                        let bounds = Bounds {
                            side,
                            pages: Some(pages),
                            highest: None,
                        };
                        Error::PageOffsetOverflow {
                            side,
                            page: page as u32,
                            position: bounds.position(page as u64),
                            item_len,
                        }
                    })?;
                    Some((page as u64, end))
                }
            };
            bounds.push(Bounds {
                side,
                pages: Some(pages),
                highest,
            });
            geoms.push(Some(slice_side(
                pages,
                max.map_or(0, |page| page as u64),
                c.page_size,
                item_len,
                bpt,
                offset,
                hb,
            )));
        }
        let tokens = tokens?;
        let bytes_per_buffer = if sends {
            checked_product(
                "bytes per buffer (tokens * heads_bytes_per_token_to_send)",
                tokens,
                c.heads_bytes_per_token_to_send,
            )?
        } else {
            0
        };
        let heads = if sends { u64::from(c.num_heads) } else { 0 };
        let page_size = u64::from(c.page_size);
        let [src, dst] = [geoms[0], geoms[1]]
            .map(|g| g.unwrap_or_else(|| region(tokens, heads, hb, None, page_size)));
        let walk = Walk {
            geometry: Geometry {
                src,
                dst,
                tokens,
                heads,
                head_bytes: hb,
            },
            // Token-major is the order with the fewest segments for uniform sides (REFERENCE.md
            // section 11's agreement), so no other is counted.
            order: Order::TokenMajor,
            ties: Ties::one(Order::TokenMajor),
            shape: RectShape::Rows,
            sends,
            bytes_per_buffer,
            src: bounds[0],
            dst: bounds[1],
            segments: OnceCell::new(),
            rects: OnceCell::new(),
        };
        Ok(SlicePlan {
            walk,
            config,
            num_pages,
        })
    }

    /// The plan's config.
    pub fn config(&self) -> &SliceConfig {
        &self.config
    }

    /// The validated config.
    pub fn valid_config(&self) -> &ValidConfig {
        &self.config
    }

    /// Page pairs (positions) in the request.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// The plan as a walk, for a job.
    pub fn walk(&self) -> &Walk<'a> {
        &self.walk
    }
}

/// The rects of a request, collected.
pub fn plan(config: impl IntoValid, src_pages: &[i32], dst_pages: &[i32]) -> Result<Vec<CopyRect>> {
    Ok(SlicePlan::new(config, src_pages, dst_pages)?
        .rects()
        .collect())
}

/// The segments of a request, collected.
pub fn plan_segments(
    config: impl IntoValid,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<Segment>> {
    SlicePlan::new(config, src_pages, dst_pages)?.segments()
}

/// The staging that minimises transport segments without a copy that merges nothing: stage each
/// side whose token slot is wider than the slice. Depends on the config alone, so both ranks
/// agree without exchanging pages; [`Staging::None`] for a pair that does not send.
///
/// With it, the transport moves one segment per maximal run of pages (per buffer) or, when both
/// sides are staged, one segment per buffer; never one per token.
pub fn staging_for(config: impl IntoValid) -> Result<Staging> {
    let config = config.into_valid()?;
    if config.action != Action::Send {
        return Ok(Staging::None);
    }
    let width = config.heads_bytes_per_token_to_send;
    Ok(Staging::from_sides(
        config.bytes_per_token_src > width,
        config.bytes_per_token_dst > width,
    ))
}

/// Bytes one buffer stages for a request of `num_pages` page pairs:
/// `num_pages * page_size * heads_bytes_per_token_to_send` (0 for a pair that does not send).
pub fn staging_len(config: impl IntoValid, num_pages: usize) -> Result<u64> {
    let config = config.into_valid()?;
    if config.action != Action::Send {
        return Ok(0);
    }
    let tokens = checked_product(
        "tokens (pages * page_size)",
        num_pages as u64,
        u64::from(config.page_size),
    )?;
    checked_product(
        "staging_len (tokens * heads_bytes_per_token_to_send)",
        tokens,
        config.heads_bytes_per_token_to_send,
    )
}

/// The transport's segments for `staging`: offsets relative to each buffer's base, which is its
/// page buffer on an unstaged side and `region + b * staging_len` on a staged side. The same list
/// serves every buffer. [`Staging::None`] gives [`plan_segments`].
pub fn plan_transfer(
    config: impl IntoValid,
    staging: Staging,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<Segment>> {
    SlicePlan::transfer(config, staging, src_pages, dst_pages)?.segments()
}

// ---- REFERENCE.md section 11: any layout, page sizes that differ, partial pages -----------------

/// A pair plan (REFERENCE.md section 11): a pair config and a request, between page buffers, or
/// with staged sides read or written as their staging regions.
#[derive(Clone, Debug)]
pub struct PairPlan<'a> {
    walk: Walk<'a>,
    config: &'a PairConfig,
}

impl<'a> Deref for PairPlan<'a> {
    type Target = Walk<'a>;

    fn deref(&self) -> &Walk<'a> {
        &self.walk
    }
}

/// True when a layout holds the moved heads of a page head-major: more than one slot, heads
/// further apart than slots.
fn head_major(layout: &ValidLayout) -> bool {
    layout.layout().page_size > 1 && layout.layout().head_stride > layout.layout().token_stride
}

/// The order of the staging region that replaces `staged` under `staging` (REFERENCE.md section 11):
/// head-major in chunks of the unstaged side's page size (or of all `tokens` when that side's
/// heads hold their own pages) exactly when one side is staged and the other is head-major;
/// token-major otherwise. `None` is token-major.
fn region_order(config: &PairConfig, staging: Staging, staged: Side, tokens: u64) -> Option<u64> {
    if staging == Staging::Both {
        return None;
    }
    let other = config.side(staged.other());
    if !head_major(other) {
        return None;
    }
    Some(match other.nesting() {
        crate::layout::Nesting::HeadsOutsidePages => tokens,
        crate::layout::Nesting::PagesOutsideHeads => u64::from(other.layout().page_size),
    })
}

/// A listed side of a pair plan: its geometry and its bounds.
fn layout_side<'a>(
    config: &PairConfig,
    side: Side,
    pages: &'a [i32],
) -> Result<(SideGeom<'a>, Bounds<'a>)> {
    let valid = config.side(side);
    let layout = valid.layout();
    let highest = match highest_page(side, pages)? {
        None => None,
        Some(max) => {
            let position = || pages.iter().position(|&p| p == max).unwrap_or(0);
            Some((max as u64, valid.check_page(max, position, None)?))
        }
    };
    // The first moved head; every element lies inside its page's extent, checked above.
    let base = layout.offset + u64::from(config.first_local(side)) * layout.head_stride;
    let geometry = SideGeom {
        pages: Pages::List(pages),
        page_size: u64::from(layout.page_size),
        page_stride: layout.page_stride,
        base,
        token_stride: layout.token_stride,
        head_stride: layout.head_stride,
        last_head_stride: None,
        reach: reach(
            highest.map_or(0, |(page, _)| page),
            layout.page_stride,
            base,
        ),
    };
    Ok((
        geometry,
        Bounds {
            side,
            pages: Some(pages),
            highest,
        },
    ))
}

impl<'a> PairPlan<'a> {
    /// The transport plan of `request` with `staging`: pages to pages for [`Staging::None`],
    /// else each staged side replaced by its staging region. Both page lists are validated
    /// whether staged or not.
    pub fn transfer(
        config: &'a PairConfig,
        request: &Request<'a>,
        staging: Staging,
    ) -> Result<Self> {
        PairPlan::build(
            config,
            request,
            [staging.stages_src(), staging.stages_dst()],
            staging,
        )
    }

    /// The prefill rank's pack for `mode` (SRC or BOTH): its pages into its staging region.
    pub fn pack(config: &'a PairConfig, mode: Staging, request: &Request<'a>) -> Result<Self> {
        if !mode.stages_src() {
            return Err(Error::StagingModeNotAllowed {
                function: "pack",
                mode,
                allowed: "SRC or BOTH",
            });
        }
        PairPlan::build(config, request, [false, true], mode)
    }

    /// The decode rank's unpack for `mode` (DST or BOTH): its staging region into its pages.
    pub fn unpack(config: &'a PairConfig, mode: Staging, request: &Request<'a>) -> Result<Self> {
        if !mode.stages_dst() {
            return Err(Error::StagingModeNotAllowed {
                function: "unpack",
                mode,
                allowed: "DST or BOTH",
            });
        }
        PairPlan::build(config, request, [true, false], mode)
    }

    /// The plan whose source and destination are regions where `regions` says so. A pack's
    /// destination is the prefill side's region, an unpack's source the decode side's.
    fn build(
        config: &'a PairConfig,
        request: &Request<'a>,
        regions: [bool; 2],
        staging: Staging,
    ) -> Result<Self> {
        request.check_counts(config)?;
        let tokens = request.num_tokens;
        let (src_geom, src_bounds) = layout_side(config, Side::Prefill, request.src_pages)?;
        let (dst_geom, dst_bounds) = layout_side(config, Side::Decode, request.dst_pages)?;
        let sends = config.sends();
        let staging_len = if sends {
            config.staging_len(tokens)?
        } else {
            0
        };
        let heads = u64::from(config.num_heads());
        let hb = config.src().layout().head_bytes;
        // Which side each end of the plan is: a pack writes the prefill side's region, an
        // unpack reads the decode side's; a transfer's regions replace their own sides.
        let region_of = |end: Side, replaced: Side| -> (SideGeom<'static>, Bounds<'a>) {
            let order = region_order(config, staging, replaced, tokens);
            let bounds = Bounds {
                side: end,
                pages: None,
                highest: (staging_len > 0).then_some((0, staging_len)),
            };
            // Pages as long as the other side's, so both change page together.
            let page_size = u64::from(config.side(replaced.other()).layout().page_size);
            (region(tokens, heads, hb, order, page_size), bounds)
        };
        let transfer = regions == [staging.stages_src(), staging.stages_dst()];
        let (src, src_bounds) = match (regions[0], transfer) {
            (false, _) => (src_geom, src_bounds),
            (true, true) => region_of(Side::Prefill, Side::Prefill),
            (true, false) => region_of(Side::Prefill, Side::Decode), // an unpack
        };
        let (dst, dst_bounds) = match (regions[1], transfer) {
            (false, _) => (dst_geom, dst_bounds),
            (true, true) => region_of(Side::Decode, Side::Decode),
            (true, false) => region_of(Side::Decode, Side::Prefill), // a pack
        };
        let geometry = Geometry {
            src,
            dst,
            tokens,
            heads,
            head_bytes: hb,
        };
        let segments = OnceCell::new();
        let ties = if sends {
            let page_sizes = [Side::Prefill, Side::Decode]
                .map(|side| u64::from(config.side(side).layout().page_size));
            let (ties, count) = fewest_segments(&geometry, page_sizes);
            if let Some(count) = count {
                let _ = segments.set(count);
            }
            ties
        } else {
            Ties::one(Order::TokenMajor)
        };
        Ok(PairPlan {
            walk: Walk {
                geometry,
                order: ties.first(),
                ties,
                shape: RectShape::Greedy,
                sends,
                bytes_per_buffer: staging_len,
                src: src_bounds,
                dst: dst_bounds,
                segments,
                rects: OnceCell::new(),
            },
            config,
        })
    }

    /// The plan's pair config.
    pub fn config(&self) -> &PairConfig {
        self.config
    }

    /// The plan as a walk, for a job.
    pub fn walk(&self) -> &Walk<'a> {
        &self.walk
    }
}

/// The head-major orders a pair plan weighs against token-major: in chunks of the prefill
/// layout's page size, the decode layout's page size and all tokens (whether or not a side is
/// staged), in that list's order. Orders that walk the elements as an earlier one does (G >= N
/// is one chunk of all tokens; G = 1 is token-major) are left out.
fn head_major_orders(tokens: u64, page_sizes: [u64; 2]) -> ([Order; 3], usize) {
    let mut orders = [Order::TokenMajor; 3];
    let mut len = 0;
    let mut tried = [1u64; 4];
    for (i, g) in [page_sizes[0], page_sizes[1], tokens]
        .into_iter()
        .enumerate()
    {
        let g = g.min(tokens).max(1);
        if tried[..=i].contains(&g) {
            continue;
        }
        tried[i + 1] = g;
        orders[len] = Order::HeadMajor(g);
        len += 1;
    }
    (orders, len)
}

/// The orders with the fewest segments among token-major and [`head_major_orders`], in that
/// list's order, and their segments when they were counted (`None`: they are token-major's,
/// counted when asked for).
///
/// What the layouts prove is not counted: with one head every order walks the same elements
/// in the same order, and a head-major order whose floor ([`Geometry::head_major_floor`]) is
/// above token-major's ceiling ([`Geometry::token_major_ceiling`]), or above the fewest
/// segments counted so far, has more segments than the best order. On uniform layouts (NHD
/// pages on both sides, one page size) with `n >= 2` moved heads, token-major has at most `N`
/// segments and head-major in chunks of `G` at least `n * (N - ceil(N / G)) + 1`, which is more
/// for every `G` of 3 or more and `N >= 2` (and for `G = 2` unless `n = 2` and `N` is odd):
/// then the order is token-major without a count, and a rect plan walks its request once.
fn fewest_segments(geometry: &Geometry<'_>, page_sizes: [u64; 2]) -> (Ties, Option<u64>) {
    let ties = Ties::one(Order::TokenMajor);
    if geometry.heads <= 1 {
        return (ties, None);
    }
    let (orders, len) = head_major_orders(geometry.tokens, page_sizes);
    let orders = &orders[..len];
    // Each order's floor, 0 where the layouts prove none.
    let mut floors = [0u64; 3];
    if geometry.head_runs_broken() {
        for (floor, &order) in floors.iter_mut().zip(orders) {
            *floor = geometry.head_major_floor(geometry.chunk_len(order));
        }
    }
    let ceiling = geometry.token_major_ceiling();
    if floors[..len].iter().all(|&floor| floor > ceiling) {
        return (ties, None);
    }
    let (ties, best) = count_fewest(geometry, orders, |i, best| floors[i] > best);
    (ties, Some(best))
}

/// Counts token-major, then each of `orders` up to a tie with the best so far, skipping order
/// `i` when `beaten(i, best)` proves it has more segments than `best`: the orders with the
/// fewest segments, in list order, and their segments.
fn count_fewest(
    geometry: &Geometry<'_>,
    orders: &[Order],
    beaten: impl Fn(usize, u64) -> bool,
) -> (Ties, u64) {
    let mut ties = Ties::one(Order::TokenMajor);
    let mut best = geometry
        .count(Order::TokenMajor, u64::MAX)
        .expect("no cap to reach");
    for (i, &order) in orders.iter().enumerate() {
        if beaten(i, best) {
            continue;
        }
        // Counted up to a tie with the best so far.
        match geometry.count(order, best.saturating_add(1)) {
            Some(count) if count < best => {
                (ties, best) = (Ties::one(order), count);
            }
            Some(_) => ties.push(order),
            None => {}
        }
    }
    (ties, best)
}

/// The greedy rects of `order`, counted up to `cap`: `None` once they reach it.
fn count_rects(geometry: &Geometry<'_>, order: Order, cap: u64) -> Option<u64> {
    let mut merger = Merger::new(Rects::new(RectCount { count: 0, cap }));
    geometry.walk(order, &mut merger);
    let count = merger.finish().finish().count;
    (count < cap).then_some(count)
}

/// The order, among `ties` (the orders with the fewest segments, in the reference's list
/// order), whose greedy rects are fewest; the first of them on a tie (REFERENCE.md section 11).
///
/// Each order is counted up to a cap that starts small and grows fourfold until some order
/// comes in under it, and a later order of a round only up to the best count so far. So
/// choosing costs time in the rects of the order chosen (and the pages walked), never in
/// those of an order with many more: an order whose rects are one per token stops at the cap.
fn fewest_rects(geometry: &Geometry<'_>, ties: &[Order]) -> Order {
    if let [order] = ties {
        return *order;
    }
    let mut cap: u64 = 256;
    loop {
        let mut best: Option<(Order, u64)> = None;
        for &order in ties {
            let limit = best.map_or(cap, |(_, count)| count);
            if let Some(count) = count_rects(geometry, order, limit) {
                best = Some((order, count));
            }
        }
        if let Some((order, _)) = best {
            return order;
        }
        cap = cap.saturating_mul(4);
    }
}

/// The staging that gives the transport the fewest segments for a pair (REFERENCE.md section 11):
/// a side is *full* in an order when its pages hold the slice and nothing else, back to back in
/// that order. Not SEND: NONE. Both sides full token-major, or both full head-major with one
/// page size: NONE. Else the prefill side full in some order: DST; else the decode side: SRC;
/// else BOTH. Depends on the config alone.
pub fn pair_staging_for(config: &PairConfig) -> Staging {
    if !config.sends() {
        return Staging::None;
    }
    let n = u64::from(config.num_heads());
    let full = |side: Side, head_major: bool| -> bool {
        let l = config.side(side).layout();
        let ps = u64::from(l.page_size);
        let hb = l.head_bytes;
        let back_to_back = l.page_stride == ps * n * hb;
        back_to_back
            && if head_major {
                (ps == 1 || l.token_stride == hb) && (n == 1 || l.head_stride == ps * hb)
            } else {
                (n == 1 || l.head_stride == hb) && (ps == 1 || l.token_stride == n * hb)
            }
    };
    let same_page_size = config.src().layout().page_size == config.dst().layout().page_size;
    let (src_tm, src_hm) = (full(Side::Prefill, false), full(Side::Prefill, true));
    let (dst_tm, dst_hm) = (full(Side::Decode, false), full(Side::Decode, true));
    if (src_tm && dst_tm) || (src_hm && dst_hm && same_page_size) {
        Staging::None
    } else if src_tm || src_hm {
        Staging::Dst
    } else if dst_tm || dst_hm {
        Staging::Src
    } else {
        Staging::Both
    }
}

/// The transport's segments of a pair request with `staging`, collected.
pub fn pair_segments(
    config: &PairConfig,
    request: &Request<'_>,
    staging: Staging,
) -> Result<Vec<Segment>> {
    PairPlan::transfer(config, request, staging)?.segments()
}

/// The page-to-page rects of a pair request, collected.
pub fn pair_plan(config: &PairConfig, request: &Request<'_>) -> Result<Vec<CopyRect>> {
    Ok(PairPlan::transfer(config, request, Staging::None)?
        .rects()
        .collect())
}

// ---- both families: a transfer against the memory both ranks registered -------------------

/// One rank's memory for a request, as an engine registered it: how many page buffers, the
/// bytes in each, and the bytes of the staging region (or slot) the request may use.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RankMemory {
    /// Page buffers (K of each layer, then V of each layer; MLA: one latent buffer per layer).
    pub num_buffers: usize,
    /// Bytes in each page buffer: every page of the request must end at or before it.
    pub capacity: u64,
    /// Bytes of the staging region the request uses on this rank (0: none). A staged side
    /// needs num_buffers * staging_len.
    pub staging_capacity: u64,
}

/// Checks a walk's direct plan against both ranks' memory.
fn check_memory(
    direct: &Walk<'_>,
    staging: Staging,
    prefill: &RankMemory,
    decode: &RankMemory,
) -> Result<()> {
    if prefill.num_buffers != decode.num_buffers {
        return Err(Error::BufferCountMismatch {
            src: prefill.num_buffers,
            dst: decode.num_buffers,
        });
    }
    direct.check_capacity(prefill.capacity, decode.capacity)?;
    let staging_len = direct.bytes_per_buffer();
    for (side, memory) in [(Side::Prefill, prefill), (Side::Decode, decode)] {
        if staging.stages(side) {
            check_staging_capacity(
                side,
                memory.num_buffers,
                staging_len,
                memory.staging_capacity,
            )?;
        }
    }
    Ok(())
}

/// Checks a transfer against the memory of both ranks before an engine is handed its
/// segments, which it would copy outside a buffer instead of failing: the ranks pair their
/// buffers one to one, every page ends within its side's buffers (staged or not), and each
/// staged side's region holds `num_buffers * staging_len` bytes.
pub fn check_transfer(
    config: impl IntoValid,
    staging: Staging,
    src_pages: &[i32],
    dst_pages: &[i32],
    prefill: &RankMemory,
    decode: &RankMemory,
) -> Result<()> {
    let plan = SlicePlan::new(config, src_pages, dst_pages)?;
    check_memory(&plan, staging, prefill, decode)
}

/// [`check_transfer`] for a pair request.
pub fn check_pair_transfer(
    config: &PairConfig,
    request: &Request<'_>,
    staging: Staging,
    prefill: &RankMemory,
    decode: &RankMemory,
) -> Result<()> {
    let plan = PairPlan::transfer(config, request, Staging::None)?;
    check_memory(&plan, staging, prefill, decode)
}

/// Checks that a staging region of `capacity` bytes holds `num_buffers * staging_len`.
pub(crate) fn check_staging_capacity(
    side: Side,
    num_buffers: usize,
    staging_len: u64,
    capacity: u64,
) -> Result<()> {
    let needed = checked_product(
        "staging bytes (num_buffers * staging_len)",
        num_buffers as u64,
        staging_len,
    )?;
    if capacity < needed {
        return Err(Error::StagingTooSmall {
            side,
            needed,
            capacity,
            num_buffers,
            staging_len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, pair_config};
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
