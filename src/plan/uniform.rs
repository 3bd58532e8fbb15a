//! Uniform plans (REFERENCE.md sections 4 to 6): a slice config and its page pairs, one page
//! size, token-major pages, whole pages; direct, packed, unpacked or staged.

#![forbid(unsafe_code)]

use std::cell::OnceCell;
use std::ops::Deref;

use super::choice::Ties;
use super::walk::{Geometry, Order, Pages, SideGeom};
use super::{Bounds, CopyRect, RectShape, Segment, Walk, reach, region};
use crate::error::{Error, Result, checked_product};
use crate::layout::highest_page;
use crate::slice::{IntoValid, SliceConfig, ValidConfig};
use crate::types::{Action, Side, Staging};

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
