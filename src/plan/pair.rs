//! Pair plans (REFERENCE.md section 11): any layout, page sizes that differ, partial pages.
//! A plan reads what validation derived (the config's sides, the checked request) and never
//! validates again.

#![forbid(unsafe_code)]

use std::cell::OnceCell;
use std::ops::Deref;

use super::choice::{Ties, fewest_segments};
use super::walk::{Geometry, Order, Pages, SideGeom};
use super::{Bounds, CopyRect, RectShape, Segment, Walk, reach, region};
use crate::error::{Error, Result};
use crate::layout::{CheckedRequest, Nesting, PairConfig, PairSide, Request, ValidLayout};
use crate::types::{Side, Staging};

/// A pair plan (REFERENCE.md section 11): a pair config and a request, between page buffers, or
/// with staged sides read or written as their staging regions.
#[derive(Clone, Debug)]
pub struct PairPlan<'a> {
    walk: Walk<'a>,
    config: &'a PairConfig,
    request: CheckedRequest<'a>,
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
        Nesting::HeadsOutsidePages => tokens,
        Nesting::PagesOutsideHeads => u64::from(other.layout().page_size),
    })
}

/// A listed side of a pair plan: its geometry and its bounds, read from the config's side and
/// the checked request.
fn layout_side<'a>(
    side: Side,
    pair: &PairSide,
    request: &CheckedRequest<'a>,
) -> (SideGeom<'a>, Bounds<'a>) {
    let layout = pair.layout().layout();
    let pages = request.pages(side);
    let highest = request
        .highest(side)
        .map(|high| (u64::from(high.page), high.end));
    let geometry = SideGeom {
        pages: Pages::List(pages),
        page_size: u64::from(layout.page_size),
        page_stride: layout.page_stride,
        base: pair.base(),
        token_stride: layout.token_stride,
        head_stride: layout.head_stride,
        last_head_stride: None,
        reach: reach(
            highest.map_or(0, |(page, _)| page),
            layout.page_stride,
            pair.base(),
        ),
    };
    (
        geometry,
        Bounds {
            side,
            pages: Some(pages),
            highest,
        },
    )
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
        let request = request.check(config)?;
        let tokens = request.num_tokens();
        let sides = config.sides();
        let (src_geom, src_bounds) = layout_side(Side::Prefill, &sides.prefill, &request);
        let (dst_geom, dst_bounds) = layout_side(Side::Decode, &sides.decode, &request);
        let sends = config.sends();
        let staging_len = request.staging_len();
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
            request,
        })
    }

    /// The plan's pair config.
    pub fn config(&self) -> &PairConfig {
        self.config
    }

    /// The plan's request, as checked against the config.
    pub fn request(&self) -> &CheckedRequest<'a> {
        &self.request
    }

    /// The plan as a walk, for a job.
    pub fn walk(&self) -> &Walk<'a> {
        &self.walk
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
