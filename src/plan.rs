//! Copy plans: a request's page pairs turned into strided 2D copies (rects), or into the same
//! bytes as contiguous 1D segments for RDMA batch writes, directly or staged.
//!
//! A plan copies between two *sides*. Each side is a [`SideGeometry`] (where the slice of each
//! token lies inside a buffer) and the page each position of the request visits: a caller's page
//! list, or, on a staged side, simply page `i` at position `i` (a dense staging area whose token
//! slot is exactly the slice). So a direct send, a pack (pages to staging), an unpack (staging to
//! pages) and a staged transport plan are the same code with different sides.
//!
//! A run of positions where both sides' pages go up by one is one rect of `run * page_size`
//! rows, so a request costs one copy per maximal run instead of one per token.
//!
//! Staging exists for RDMA engines (MORI-IO, Mooncake, NIXL): they take flat
//! `(src, dst, length)` lists and merge nothing across a stride, so a slice narrower than a
//! token slot would cost one segment per token per buffer. Packing it into a dense area first
//! leaves the transport a few large segments. Buffer `b` of a request owns the `staging_len`
//! bytes at `b * staging_len` of the staging region; token `k` of buffer `b` (token
//! `k % page_size` of the page at position `k / page_size`) is the `width` bytes at
//! `b * staging_len + k * width`. Because pack, transport and unpack are plans between such
//! sides, their composition leaves every destination byte as one direct send does.

#![forbid(unsafe_code)]

use std::mem::MaybeUninit;

use crate::error::{Error, Result, checked_product};
use crate::slice::{IntoValid, SliceConfig, ValidConfig};
use crate::types::{Action, Side, Staging};

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
    /// Bytes between source rows (bytes_per_token_src).
    pub src_pitch: u64,
    /// Bytes between destination rows (bytes_per_token_dst).
    pub dst_pitch: u64,
    /// Bytes per row (heads_bytes_per_token_to_send).
    pub width: u64,
    /// Rows: tokens in the run of pages (run length * page_size).
    pub height: u64,
}

impl CopyRect {
    /// True when the rows are back to back on both sides, so the rect is one contiguous block.
    pub fn is_contiguous(&self) -> bool {
        self.width == self.src_pitch && self.width == self.dst_pitch
    }

    /// Bytes the rect moves. Cannot overflow for a rect of a [`Plan`]: its rows lie inside
    /// pages whose ends were checked to fit in `u64`.
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

/// An entry of an output array that [`Plan::fill_segments`] writes: a plain value, or an
/// uninitialised slot of caller memory (a C array, a numpy `empty` buffer, spare `Vec`
/// capacity), which must only ever be written.
pub trait OutputSlot<T> {
    /// Stores `value`.
    fn put(&mut self, value: T);
}

impl<T> OutputSlot<T> for T {
    fn put(&mut self, value: T) {
        *self = value;
    }
}

impl<T> OutputSlot<T> for MaybeUninit<T> {
    fn put(&mut self, value: T) {
        self.write(value);
    }
}

/// Where the slice of every token of one side lies inside a buffer: page `p` starts at byte
/// `p * item_len`, token `t` of a page `t * bytes_per_token` later, and the slice `slice_offset`
/// bytes into the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SideGeometry {
    /// Bytes of one page.
    pub item_len: u64,
    /// Bytes of one token: the row pitch.
    pub bytes_per_token: u64,
    /// Offset of the slice inside a token.
    pub slice_offset: u64,
}

impl SideGeometry {
    /// Byte offset of the slice of the first token of `page`. No overflow for a page of a
    /// [`Plan`]: the end of its side's highest page was checked.
    fn offset(&self, page: u64) -> u64 {
        page * self.item_len + self.slice_offset
    }
}

impl SliceConfig {
    /// The prefill side's geometry: its pages, tokens and slice offset.
    pub fn src_geometry(&self) -> SideGeometry {
        SideGeometry {
            item_len: self.src_item_len,
            bytes_per_token: self.bytes_per_token_src,
            slice_offset: self.src_head_slice_offset,
        }
    }

    /// The decode side's geometry.
    pub fn dst_geometry(&self) -> SideGeometry {
        SideGeometry {
            item_len: self.dst_item_len,
            bytes_per_token: self.bytes_per_token_dst,
            slice_offset: self.dst_head_slice_offset,
        }
    }

    /// The geometry of a staging area: a token slot exactly as wide as the slice. No overflow
    /// for a validated config: `page_size * width <= page_size * bytes_per_token = item_len`.
    pub fn staged_geometry(&self) -> SideGeometry {
        let width = self.heads_bytes_per_token_to_send;
        SideGeometry {
            item_len: u64::from(self.page_size) * width,
            bytes_per_token: width,
            slice_offset: 0,
        }
    }
}

/// The page each position of a request visits on one side.
#[derive(Clone, Copy, Debug)]
enum Pages<'a> {
    /// The caller's page indices, already checked to be non-negative.
    List(&'a [i32]),
    /// Position `i` is page `i`: a staging area.
    Dense,
}

impl Pages<'_> {
    #[inline]
    fn at(&self, position: usize) -> u64 {
        match self {
            // Non-negative, checked when the plan was built.
            Pages::List(pages) => pages[position] as u64,
            Pages::Dense => position as u64,
        }
    }
}

/// One side of a plan: where it reads or writes, and the bytes a buffer needs to hold every
/// page it touches.
#[derive(Clone, Copy, Debug)]
struct PlanSide<'a> {
    side: Side,
    geometry: SideGeometry,
    pages: Pages<'a>,
    /// The highest page and the byte it ends at, `(page + 1) * item_len`; `None` when empty.
    highest: Option<(u64, u64)>,
}

impl PlanSide<'_> {
    /// Position of the highest page, looked up only to name it in a message.
    fn highest_position(&self, page: u64) -> usize {
        match self.pages {
            Pages::List(pages) => pages.iter().position(|&p| p as u64 == page).unwrap_or(0),
            Pages::Dense => page as usize,
        }
    }
}

/// What one pass over the page lists found: whether any index is negative, the highest index
/// of each list, and the number of places where a run breaks.
struct Scan {
    negative: bool,
    src_max: i32,
    dst_max: i32,
    breaks: usize,
}

/// One pass over the page pairs, counting run breaks on the sides named. The loop has no early
/// exit and no bounds checks, so it runs at memory speed; positions are only looked up when
/// something fails.
fn scan(src: &[i32], dst: &[i32], src_runs: bool, dst_runs: bool) -> Scan {
    // One monomorphised loop per choice of sides, so the hot loop tests no flag.
    let mut scan = match (src_runs, dst_runs) {
        (true, true) => scan_pairs::<true, true>(src, dst),
        (true, false) => scan_pairs::<true, false>(src, dst),
        (false, true) => scan_pairs::<false, true>(src, dst),
        (false, false) => scan_pairs::<false, false>(src, dst),
    };
    if !src_runs && !dst_runs {
        // Both sides dense: the whole request is one run.
        scan.breaks = usize::from(!src.is_empty());
    }
    scan
}

fn scan_pairs<const SRC_RUNS: bool, const DST_RUNS: bool>(src: &[i32], dst: &[i32]) -> Scan {
    let (mut ored, mut src_max, mut dst_max, mut breaks) = (0i32, 0i32, 0i32, 0usize);
    let (mut prev_src, mut prev_dst) = (i32::MIN, i32::MIN);
    for (&s, &d) in src.iter().zip(dst) {
        ored |= s | d;
        src_max = src_max.max(s);
        dst_max = dst_max.max(d);
        // Wrapping: a negative or i32::MAX predecessor is refused anyway. The first position
        // always breaks from the sentinel (a checked side's page is never i32::MIN + 1), so
        // `breaks` counts runs.
        let src_break = SRC_RUNS && s != prev_src.wrapping_add(1);
        let dst_break = DST_RUNS && d != prev_dst.wrapping_add(1);
        breaks += usize::from(src_break | dst_break);
        (prev_src, prev_dst) = (s, d);
    }
    Scan {
        negative: ored < 0,
        src_max,
        dst_max,
        breaks,
    }
}

fn negative_page(side: Side, pages: &[i32]) -> Option<Error> {
    let position = pages.iter().position(|&page| page < 0)?;
    Some(Error::NegativePage {
        side,
        page: pages[position],
        position,
    })
}

/// A validated request: a slice config, its page pairs and which sides are staged, ready to
/// yield rects or segments.
///
/// Construction checks everything that does not depend on the buffers: the config's
/// consistency, that no page index is negative, and that no byte offset or size overflows
/// `u64`. After that, producing the plan cannot fail.
#[derive(Clone, Debug)]
pub struct Plan<'a> {
    config: ValidConfig,
    src: PlanSide<'a>,
    dst: PlanSide<'a>,
    num_pages: usize,
    runs: usize,
    rows: u64,
    bytes_per_buffer: u64,
}

impl<'a> Plan<'a> {
    /// The direct plan: source page `src_pages[i]` to destination page `dst_pages[i]`.
    pub fn new(config: impl IntoValid, src_pages: &'a [i32], dst_pages: &'a [i32]) -> Result<Self> {
        Plan::transfer(config, Staging::None, src_pages, dst_pages)
    }

    /// The transport plan of a staged transfer: each side that `staging` stages is read or
    /// written as a dense staging area (position `i` is staged page `i`) instead of through its
    /// page list. Both page lists are validated all the same, and [`Staging::None`] is
    /// [`Plan::new`].
    pub fn transfer(
        config: impl IntoValid,
        staging: Staging,
        src_pages: &'a [i32],
        dst_pages: &'a [i32],
    ) -> Result<Self> {
        let config = &config.into_valid()?;
        if src_pages.len() != dst_pages.len() {
            return Err(Error::PageCountMismatch {
                src: src_pages.len(),
                dst: dst_pages.len(),
            });
        }
        let (stage_src, stage_dst) = (staging.stages_src(), staging.stages_dst());
        let scan = scan(src_pages, dst_pages, !stage_src, !stage_dst);
        if scan.negative {
            let error = negative_page(Side::Prefill, src_pages)
                .or_else(|| negative_page(Side::Decode, dst_pages));
            // `scan` saw a negative index, so one of the two lists names it.
            return Err(error.expect("a negative page index was seen"));
        }
        let side = |side, pages, max, staged: bool| -> Result<PlanSide<'a>> {
            if staged {
                Plan::dense_side(config, side, src_pages.len())
            } else {
                let geometry = match side {
                    Side::Prefill => config.src_geometry(),
                    Side::Decode => config.dst_geometry(),
                };
                Plan::listed_side(side, geometry, pages, max)
            }
        };
        let src = side(Side::Prefill, src_pages, scan.src_max, stage_src)?;
        let dst = side(Side::Decode, dst_pages, scan.dst_max, stage_dst)?;
        Plan::assemble(config, src, dst, src_pages.len(), scan.breaks)
    }

    /// The pack plan of the prefill rank: source pages into its dense staging area.
    pub fn pack(config: impl IntoValid, src_pages: &'a [i32]) -> Result<Self> {
        Plan::one_list(config, Side::Prefill, src_pages)
    }

    /// The unpack plan of the decode rank: its dense staging area into destination pages.
    pub fn unpack(config: impl IntoValid, dst_pages: &'a [i32]) -> Result<Self> {
        Plan::one_list(config, Side::Decode, dst_pages)
    }

    fn one_list(config: impl IntoValid, side: Side, pages: &'a [i32]) -> Result<Self> {
        let config = &config.into_valid()?;
        let scan = scan(pages, pages, true, false);
        if scan.negative {
            return Err(negative_page(side, pages).expect("a negative page index was seen"));
        }
        let staged = Plan::dense_side(config, side.other(), pages.len())?;
        let listed = match side {
            Side::Prefill => Plan::listed_side(side, config.src_geometry(), pages, scan.src_max)?,
            Side::Decode => Plan::listed_side(side, config.dst_geometry(), pages, scan.src_max)?,
        };
        let (src, dst) = match side {
            Side::Prefill => (listed, staged),
            Side::Decode => (staged, listed),
        };
        Plan::assemble(config, src, dst, pages.len(), scan.breaks)
    }

    /// A side read or written through a page list whose highest index is `max`.
    fn listed_side(
        side: Side,
        geometry: SideGeometry,
        pages: &'a [i32],
        max: i32,
    ) -> Result<PlanSide<'a>> {
        let mut plan_side = PlanSide {
            side,
            geometry,
            pages: Pages::List(pages),
            highest: None,
        };
        if pages.is_empty() {
            return Ok(plan_side);
        }
        // Every offset the plan produces lies below the end of the highest page of its side, so
        // checking that one product rules out overflow everywhere.
        let page = max as u64;
        let end =
            (page + 1)
                .checked_mul(geometry.item_len)
                .ok_or_else(|| Error::PageOffsetOverflow {
                    side,
                    page: max as u32,
                    position: plan_side.highest_position(page),
                    item_len: geometry.item_len,
                })?;
        plan_side.highest = Some((page, end));
        Ok(plan_side)
    }

    /// A staging area of `num_pages` pages on `side`.
    fn dense_side(config: &ValidConfig, side: Side, num_pages: usize) -> Result<PlanSide<'a>> {
        let geometry = config.staged_geometry();
        let highest = match num_pages {
            0 => None,
            n => Some((
                n as u64 - 1,
                checked_product(
                    "staging_len (pages * page bytes)",
                    n as u64,
                    geometry.item_len,
                )?,
            )),
        };
        Ok(PlanSide {
            side,
            geometry,
            pages: Pages::Dense,
            highest,
        })
    }

    fn assemble(
        config: &ValidConfig,
        src: PlanSide<'a>,
        dst: PlanSide<'a>,
        num_pages: usize,
        runs: usize,
    ) -> Result<Self> {
        let rows = checked_product(
            "tokens (pages * page_size)",
            num_pages as u64,
            u64::from(config.page_size),
        )?;
        let bytes_per_buffer = if config.action == Action::Send {
            checked_product(
                "bytes per buffer (tokens * heads_bytes_per_token_to_send)",
                rows,
                config.heads_bytes_per_token_to_send,
            )?
        } else {
            0
        };
        Ok(Plan {
            config: *config,
            src,
            dst,
            num_pages,
            runs,
            rows,
            bytes_per_buffer,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &SliceConfig {
        &self.config
    }

    /// The validated config, for a plan built from it.
    pub fn valid_config(&self) -> &ValidConfig {
        &self.config
    }

    /// True when the config moves bytes (action `Send`).
    pub fn sends(&self) -> bool {
        self.config.action == Action::Send
    }

    /// Page pairs (positions) in the request.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Where the plan reads: the prefill pages, or a staging area.
    pub fn src_geometry(&self) -> &SideGeometry {
        &self.src.geometry
    }

    /// Where the plan writes: the decode pages, or a staging area.
    pub fn dst_geometry(&self) -> &SideGeometry {
        &self.dst.geometry
    }

    /// Number of rects: one per maximal run of adjacent page pairs, 0 unless the pair sends.
    pub fn num_rects(&self) -> usize {
        if self.sends() { self.runs } else { 0 }
    }

    /// True when a row of the slice is a whole token slot on both sides, so each rect is one
    /// contiguous block.
    fn contiguous(&self) -> bool {
        let width = self.config.heads_bytes_per_token_to_send;
        width == self.src.geometry.bytes_per_token && width == self.dst.geometry.bytes_per_token
    }

    /// Number of segments: one per rect when rows are contiguous on both sides, else one per row.
    pub fn num_segments(&self) -> Result<usize> {
        if !self.sends() {
            return Ok(0);
        }
        if self.contiguous() {
            return Ok(self.runs);
        }
        usize::try_from(self.rows).map_err(|_| Error::SizeOverflow {
            quantity: "segments (pages * page_size) as usize",
            lhs: self.num_pages as u64,
            rhs: u64::from(self.config.page_size),
        })
    }

    /// Bytes moved per buffer (per layer K or V): `tokens * heads_bytes_per_token_to_send`.
    pub fn bytes_per_buffer(&self) -> u64 {
        self.bytes_per_buffer
    }

    /// Bytes each source buffer must hold for every page of the request (0 when empty).
    pub fn src_bytes_needed(&self) -> u64 {
        self.src.highest.map_or(0, |(_, end)| end)
    }

    /// Bytes each destination buffer must hold for every page of the request (0 when empty).
    pub fn dst_bytes_needed(&self) -> u64 {
        self.dst.highest.map_or(0, |(_, end)| end)
    }

    /// Checks that every page of the request lies inside buffers of the given capacities.
    pub fn check_capacity(&self, src_capacity: u64, dst_capacity: u64) -> Result<()> {
        for (side, capacity) in [(&self.src, src_capacity), (&self.dst, dst_capacity)] {
            if let Some((page, end)) = side.highest.filter(|&(_, end)| end > capacity) {
                return Err(Error::PagePastCapacity {
                    side: side.side,
                    page: page as u32,
                    position: side.highest_position(page),
                    end,
                    capacity,
                });
            }
        }
        Ok(())
    }

    /// The rects, one per maximal run, in input order. Empty unless the pair sends.
    pub fn rects(&self) -> Rects<'_> {
        Rects {
            plan: self,
            next: 0,
            end: if self.sends() { self.num_pages } else { 0 },
        }
    }

    /// The rect starting at position `start` and ending before `stop`.
    fn rect(&self, start: usize, stop: usize) -> CopyRect {
        let (src, dst) = (&self.src.geometry, &self.dst.geometry);
        CopyRect {
            src_offset: src.offset(self.src.pages.at(start)),
            dst_offset: dst.offset(self.dst.pages.at(start)),
            src_pitch: src.bytes_per_token,
            dst_pitch: dst.bytes_per_token,
            width: self.config.heads_bytes_per_token_to_send,
            height: (stop - start) as u64 * u64::from(self.config.page_size),
        }
    }

    /// Writes every segment into the front of `out` and returns how many it wrote: each rect's
    /// rows in order, or the whole rect when it is contiguous on both sides. `out` may be
    /// uninitialised memory (`[MaybeUninit<T>]`): it is only written.
    ///
    /// # Panics
    /// If `out` is shorter than [`Plan::num_segments`].
    pub fn fill_segments<T, S: OutputSlot<T>>(
        &self,
        out: &mut [S],
        convert: impl Fn(Segment) -> T,
    ) -> usize {
        if !self.sends() {
            return 0;
        }
        if self.contiguous() {
            assert!(
                out.len() >= self.runs,
                "fill_segments: output shorter than the plan"
            );
            for (slot, rect) in out.iter_mut().zip(self.rects()) {
                slot.put(convert(Segment {
                    src_offset: rect.src_offset,
                    dst_offset: rect.dst_offset,
                    length: rect.bytes(),
                }));
            }
            return self.runs;
        }
        let rows = self.config.page_size as usize;
        let needed = self.num_pages * rows;
        assert!(
            out.len() >= needed,
            "fill_segments: output shorter than the plan"
        );
        let (src, dst) = (&self.src.geometry, &self.dst.geometry);
        let length = self.config.heads_bytes_per_token_to_send;
        for (position, page_rows) in out[..needed].chunks_exact_mut(rows).enumerate() {
            let mut src_offset = src.offset(self.src.pages.at(position));
            let mut dst_offset = dst.offset(self.dst.pages.at(position));
            for slot in page_rows {
                slot.put(convert(Segment {
                    src_offset,
                    dst_offset,
                    length,
                }));
                src_offset += src.bytes_per_token;
                dst_offset += dst.bytes_per_token;
            }
        }
        needed
    }

    /// The segments, collected.
    pub fn segments(&self) -> Result<Vec<Segment>> {
        let mut segments = vec![Segment::default(); self.num_segments()?];
        self.fill_segments(&mut segments, |segment| segment);
        Ok(segments)
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
        let start = self.next;
        let stop = self.plan.run_end(start, self.end);
        self.next = stop;
        Some(self.plan.rect(start, stop))
    }
}

/// The end of the run of `pages` that starts at `start`, looking no further than `end`.
fn list_run_end(pages: &[i32], start: usize, end: usize) -> usize {
    let window = &pages[start..end];
    window
        .windows(2)
        .position(|w| w[1] != w[0].wrapping_add(1))
        .map_or(end, |i| start + i + 1)
}

impl Plan<'_> {
    /// The end of the maximal run that starts at position `start` (before `end`): where a listed
    /// side's page stops going up by one. Dense sides never break a run.
    fn run_end(&self, start: usize, end: usize) -> usize {
        match (self.src.pages, self.dst.pages) {
            (Pages::List(src), Pages::List(dst)) => {
                let (src, dst) = (&src[start..end], &dst[start..end]);
                let breaks = src.windows(2).zip(dst.windows(2)).position(|(s, d)| {
                    s[1] != s[0].wrapping_add(1) || d[1] != d[0].wrapping_add(1)
                });
                breaks.map_or(end, |i| start + i + 1)
            }
            (Pages::List(pages), Pages::Dense) | (Pages::Dense, Pages::List(pages)) => {
                list_run_end(pages, start, end)
            }
            (Pages::Dense, Pages::Dense) => end,
        }
    }
}

/// The rects of a request, collected.
pub fn plan(config: impl IntoValid, src_pages: &[i32], dst_pages: &[i32]) -> Result<Vec<CopyRect>> {
    Ok(Plan::new(config, src_pages, dst_pages)?.rects().collect())
}

/// The segments of a request, collected.
pub fn plan_segments(
    config: impl IntoValid,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<Segment>> {
    Plan::new(config, src_pages, dst_pages)?.segments()
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
    Plan::transfer(config, staging, src_pages, dst_pages)?.segments()
}

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
    let plan = Plan::new(config, src_pages, dst_pages)?;
    if prefill.num_buffers != decode.num_buffers {
        return Err(Error::BufferCountMismatch {
            src: prefill.num_buffers,
            dst: decode.num_buffers,
        });
    }
    plan.check_capacity(prefill.capacity, decode.capacity)?;
    let staging_len = plan.bytes_per_buffer();
    for (side, memory) in [(Side::Prefill, prefill), (Side::Decode, decode)] {
        if !staging.stages(side) {
            continue;
        }
        check_staging_capacity(
            side,
            memory.num_buffers,
            staging_len,
            memory.staging_capacity,
        )?;
    }
    Ok(())
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
