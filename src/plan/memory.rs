//! A transfer checked against the memory both ranks registered, before an engine gets its
//! segments.

#![forbid(unsafe_code)]

use super::{PairPlan, SlicePlan, Walk};
use crate::error::{Error, Result, checked_product};
use crate::layout::{PairConfig, Request};
use crate::slice::IntoValid;
use crate::types::{Side, Staging};

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
