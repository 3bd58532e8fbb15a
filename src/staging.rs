//! Staged transfers for RDMA engines: pack the slice of every token into a dense staging area,
//! move a few large segments, unpack on the other side.
//!
//! Transfer engines (MORI-IO, Mooncake, NIXL) take flat `(src, dst, length)` lists and merge
//! nothing across a stride. When the slice is narrower than a token slot, a direct plan is one
//! segment per token per buffer. A staged side is a side whose token slot is exactly the slice
//! and whose page list is `0, 1, ..., n - 1` ([`SliceConfig::staged_geometry`]); with that, a
//! pack is a plan from the pages into a staged destination, an unpack a plan from a staged source,
//! and the transport's segments the segments of the plan with the staged sides. The composition
//! pack, transport, unpack therefore leaves every destination byte as one direct send does.
//!
//! Buffer `b` of a request owns the `staging_len` bytes at `b * staging_len` of the staging
//! region; token `k` of buffer `b` (token `k % page_size` of the page at position
//! `k / page_size`) is the `width` bytes at `b * staging_len + k * width`.

#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::plan::{Plan, Segment, checked_product};
use crate::slice::{Action, SliceConfig};

/// Which sides of a transfer go through a staging area (`MoriTpStaging`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Staging {
    /// Pages to pages.
    #[default]
    None,
    /// The prefill rank packs into its staging region; segments go from it to the decode pages.
    Src,
    /// Segments go from the prefill pages into a staging region on the decode rank, which
    /// unpacks it.
    Dst,
    /// Both: one segment per buffer.
    Both,
}

impl Staging {
    /// Every mode, in the order of their C values.
    pub const ALL: [Staging; 4] = [Staging::None, Staging::Src, Staging::Dst, Staging::Both];

    /// The mode that stages the sides named.
    pub fn from_sides(src: bool, dst: bool) -> Staging {
        match (src, dst) {
            (false, false) => Staging::None,
            (true, false) => Staging::Src,
            (false, true) => Staging::Dst,
            (true, true) => Staging::Both,
        }
    }

    /// True when the prefill rank packs.
    pub fn stages_src(self) -> bool {
        matches!(self, Staging::Src | Staging::Both)
    }

    /// True when the decode rank unpacks.
    pub fn stages_dst(self) -> bool {
        matches!(self, Staging::Dst | Staging::Both)
    }
}

/// The staging that minimises transport segments without a copy that merges nothing: stage each
/// side whose token slot is wider than the slice. Depends on the config alone, so both ranks
/// agree without exchanging pages; [`Staging::None`] for a pair that does not send.
///
/// With it, the transport moves one segment per maximal run of pages (per buffer) or, when both
/// sides are staged, one segment per buffer; never one per token.
pub fn staging_for(config: &SliceConfig) -> Result<Staging> {
    config.validate()?;
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
pub fn staging_len(config: &SliceConfig, num_pages: usize) -> Result<u64> {
    config.validate()?;
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
/// serves every buffer. [`Staging::None`] gives [`crate::plan_segments`].
pub fn plan_transfer(
    config: &SliceConfig,
    staging: Staging,
    src_pages: &[i32],
    dst_pages: &[i32],
) -> Result<Vec<Segment>> {
    Plan::transfer(config, staging, src_pages, dst_pages)?.segments()
}

/// The base of each buffer's part of a staging region, after checking that the region holds
/// `num_buffers * staging_len` bytes.
pub(crate) fn staging_bases(
    region: *mut u8,
    capacity: u64,
    num_buffers: usize,
    staging_len: u64,
) -> Result<Vec<*mut u8>> {
    let needed = checked_product(
        "staging bytes (num_buffers * staging_len)",
        num_buffers as u64,
        staging_len,
    )?;
    if capacity < needed {
        return Err(Error::StagingTooSmall {
            needed,
            capacity,
            num_buffers,
            staging_len,
        });
    }
    // wrapping_add: the region may be device memory, which Rust knows nothing of; every offset
    // is below `needed <= capacity`.
    Ok((0..num_buffers)
        .map(|b| region.wrapping_add(b * staging_len as usize))
        .collect())
}
