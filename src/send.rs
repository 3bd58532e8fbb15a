//! Executing a plan: every rect on every (K/V, layer) buffer pair, after every check has passed.
//!
//! Validation is complete before the first byte moves, so a refused request leaves every
//! destination buffer exactly as it was.

use crate::backend::{CopyEngine, HostEngine};
use crate::error::{Error, Result};
use crate::plan::Plan;

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

/// What a send did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendReport {
    /// Copies issued: rects per buffer times buffers.
    pub copies: usize,
    /// Bytes moved over all buffers.
    pub bytes: u64,
}

impl KvBuffers<'_> {
    /// Checks pointer counts, NULL entries and capacities against `plan`.
    pub fn validate(&self, plan: &Plan<'_>) -> Result<()> {
        if self.src.len() != self.dst.len() {
            return Err(Error::InvalidArgument(format!(
                "{} source buffers but {} destination buffers (they are paired one to one)",
                self.src.len(),
                self.dst.len()
            )));
        }
        if let Some(i) = self.src.iter().position(|p| p.is_null()) {
            return Err(Error::NullPointer(format!("buffers.src[{i}] is NULL")));
        }
        if let Some(i) = self.dst.iter().position(|p| p.is_null()) {
            return Err(Error::NullPointer(format!("buffers.dst[{i}] is NULL")));
        }
        // Offsets below the capacities then fit in isize, as pointer arithmetic requires.
        for (name, capacity) in [
            ("src_capacity", self.src_capacity),
            ("dst_capacity", self.dst_capacity),
        ] {
            if capacity > isize::MAX as u64 {
                return Err(Error::InvalidArgument(format!(
                    "{name} {capacity} exceeds the address space ({} bytes)",
                    isize::MAX
                )));
            }
        }
        plan.check_capacity(self.src_capacity, self.dst_capacity)
    }
}

/// Copies every rect of `plan` for every buffer pair with `engine`, after validating `buffers`.
///
/// A plan whose pair does not send still validates its buffers, then moves nothing.
///
/// # Safety
/// Each `buffers.src[i]` must be valid for reads of `src_capacity` bytes and each
/// `buffers.dst[i]` valid for writes of `dst_capacity` bytes, in the memory space `engine`
/// addresses, until the engine has finished.
pub unsafe fn send(
    plan: &Plan<'_>,
    buffers: &KvBuffers<'_>,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    buffers.validate(plan)?;
    let mut report = SendReport::default();
    if !plan.sends() {
        return Ok(report);
    }
    engine.prepare(
        plan.bytes_per_buffer()
            .saturating_mul(buffers.src.len() as u64),
    );
    for (buffer, (&src, &dst)) in buffers.src.iter().zip(buffers.dst).enumerate() {
        for (index, rect) in plan.rects().enumerate() {
            // SAFETY: `validate` checked every page of the plan against the capacities the
            // caller vouches for, and every rect lies inside its pages.
            if let Err(error) = unsafe { engine.copy_rect(dst, src, &rect) } {
                let error = match error {
                    Error::Gpu(msg) => Error::Gpu(format!(
                        "{msg} (buffer {buffer} of {}, rect {index} of {}: {rect:?})",
                        buffers.src.len(),
                        plan.num_rects()
                    )),
                    other => other,
                };
                // A caller who asked to synchronize may free the buffers as soon as we return,
                // so the copies already issued are waited for even though a later one failed.
                return Err(match (error, engine.finish()) {
                    (Error::Gpu(msg), Err(Error::Gpu(also))) => {
                        Error::Gpu(format!("{msg}; then {also}"))
                    }
                    (error, _) => error,
                });
            }
            report.copies += 1;
            report.bytes += rect.bytes();
        }
    }
    engine.finish()?;
    Ok(report)
}

/// Safe host-memory send: copies the plan from each `src[i]` into `dst[i]` on the CPU.
///
/// The capacity of each side is its shortest buffer. Nothing is written if anything is invalid.
pub fn send_host(plan: &Plan<'_>, src: &[&[u8]], dst: &mut [&mut [u8]]) -> Result<SendReport> {
    let capacity = |lens: &mut dyn Iterator<Item = usize>| lens.min().unwrap_or(0) as u64;
    let src_capacity = capacity(&mut src.iter().map(|b| b.len()));
    let dst_capacity = capacity(&mut dst.iter().map(|b| b.len()));
    let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let buffers = KvBuffers {
        src: &src_ptrs,
        dst: &dst_ptrs,
        src_capacity,
        dst_capacity,
    };
    // SAFETY: every pointer comes from a live slice at least as long as its side's capacity, and
    // the `&mut` slices cannot alias each other or the sources.
    unsafe { send(plan, &buffers, &mut HostEngine::default()) }
}
