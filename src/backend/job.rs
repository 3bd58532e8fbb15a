//! A backend's input: one call's plan and the buffer pairs it runs on, validated against each
//! other before any engine sees them.

use crate::error::{Error, Result, checked_product};
use crate::plan::{CopyRect, Walk};
use crate::types::Side;

use super::CopyEngine;

/// The buffers of one request: `src[i]` on the prefill rank is copied into `dst[i]` on the decode
/// rank (K of each layer, then V of each layer; or one latent buffer per layer for MLA).
#[derive(Clone, Copy, Debug)]
pub struct KvBuffers<'a> {
    /// Base pointers of the source buffers.
    pub src: &'a [*const u8],
    /// Base pointers of the destination buffers, in the same order.
    pub dst: &'a [*mut u8],
    /// Bytes in each source buffer.
    pub src_capacity: u64,
    /// Bytes in each destination buffer.
    pub dst_capacity: u64,
}

/// What a send, pack or unpack did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendReport {
    /// (buffer, rect) copies: rects per buffer times buffers.
    pub copies: usize,
    /// Bytes moved over all buffers.
    pub bytes: u64,
}

/// Checks a capacity against the address space, so that offsets below it fit in `isize` as
/// pointer arithmetic requires.
pub(crate) fn check_capacity_fits(field: &'static str, capacity: u64) -> Result<()> {
    if capacity > isize::MAX as u64 {
        return Err(Error::CapacityTooLarge { field, capacity });
    }
    Ok(())
}

/// The index of the first NULL pointer, if any.
pub(crate) fn first_null<T>(pointers: &[*const T]) -> Option<usize> {
    pointers.iter().position(|p| p.is_null())
}

/// A validated call: a plan and the buffer pairs it runs on. Building one checks pointer counts,
/// NULL entries, capacities and the total size; running it cannot fail for a reason the inputs
/// explain (only the backend can still fail).
#[derive(Clone, Copy, Debug)]
pub struct CopyJob<'a> {
    plan: &'a Walk<'a>,
    src: &'a [*const u8],
    dst: &'a [*mut u8],
    total_bytes: u64,
}

impl<'a> CopyJob<'a> {
    /// Validates `buffers` against `plan`.
    pub fn new(plan: &'a Walk<'a>, buffers: &KvBuffers<'a>) -> Result<Self> {
        if buffers.src.len() != buffers.dst.len() {
            return Err(Error::BufferCountMismatch {
                src: buffers.src.len(),
                dst: buffers.dst.len(),
            });
        }
        if let Some(index) = first_null(buffers.src) {
            return Err(Error::NullBuffer {
                side: Side::Prefill,
                index,
            });
        }
        if let Some(index) = buffers.dst.iter().position(|p| p.is_null()) {
            return Err(Error::NullBuffer {
                side: Side::Decode,
                index,
            });
        }
        check_capacity_fits(Side::Prefill.capacity_field(), buffers.src_capacity)?;
        check_capacity_fits(Side::Decode.capacity_field(), buffers.dst_capacity)?;
        plan.check_capacity(buffers.src_capacity, buffers.dst_capacity)?;
        let total_bytes = checked_product(
            "bytes of the call (num_buffers * bytes per buffer)",
            buffers.src.len() as u64,
            plan.bytes_per_buffer(),
        )?;
        Ok(CopyJob {
            plan,
            src: buffers.src,
            dst: buffers.dst,
            total_bytes,
        })
    }

    /// The rects every buffer pair gets, in order.
    pub fn rects(&self) -> std::iter::Copied<std::slice::Iter<'a, CopyRect>> {
        self.plan.rects()
    }

    /// Rects per buffer pair.
    pub fn num_rects(&self) -> usize {
        self.plan.num_rects()
    }

    /// Buffer pairs.
    pub fn num_buffers(&self) -> usize {
        self.src.len()
    }

    /// The (source, destination) base pointers, in order.
    pub fn buffers(&self) -> impl ExactSizeIterator<Item = (*const u8, *mut u8)> + 'a {
        self.src.iter().copied().zip(self.dst.iter().copied())
    }

    /// Bytes the whole call moves.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// True when the call moves nothing (a pair that does not send, no pages or no buffers).
    pub fn is_empty(&self) -> bool {
        self.total_bytes == 0
    }

    fn report(&self) -> SendReport {
        SendReport {
            copies: self.num_rects() * self.num_buffers(),
            bytes: self.total_bytes,
        }
    }

    /// Runs the job on `engine`; an empty job touches nothing.
    ///
    /// # Safety
    /// Each source base must be readable and each destination base writable for the bytes every
    /// rect addresses (its capacity), in the memory space `engine` addresses, until the engine
    /// has finished.
    pub unsafe fn run(&self, engine: &mut dyn CopyEngine) -> Result<SendReport> {
        if !self.is_empty() {
            // SAFETY: forwarded from the caller; the job checked every rect against the
            // capacities the caller vouches for.
            unsafe { engine.run(self) }?;
        }
        Ok(self.report())
    }
}
