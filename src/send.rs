//! Executing a plan: every rect on every (K/V, layer) buffer pair, after every check has passed.
//!
//! Validation is complete before the first byte moves and before a backend is opened, so a
//! refused request leaves every destination buffer exactly as it was, and gets the same error on
//! every machine.

use crate::backend::{CopyEngine, HostEngine};
use crate::error::{Error, Result, Side};
use crate::plan::{Plan, Rects, checked_product};
use crate::slice::SliceConfig;
use crate::staging::staging_bases;

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
fn check_capacity_fits(field: &'static str, capacity: u64) -> Result<()> {
    if capacity > isize::MAX as u64 {
        return Err(Error::CapacityTooLarge { field, capacity });
    }
    Ok(())
}

/// The index of the first NULL pointer, if any.
fn first_null<T>(pointers: &[*const T]) -> Option<usize> {
    pointers.iter().position(|p| p.is_null())
}

/// A validated call: a plan and the buffer pairs it runs on. Building one checks pointer counts,
/// NULL entries, capacities and the total size; running it cannot fail for a reason the inputs
/// explain (only the backend can still fail).
#[derive(Clone, Copy, Debug)]
pub struct CopyJob<'a> {
    plan: &'a Plan<'a>,
    src: &'a [*const u8],
    dst: &'a [*mut u8],
    total_bytes: u64,
}

impl<'a> CopyJob<'a> {
    /// Validates `buffers` against `plan`.
    pub fn new(plan: &'a Plan<'a>, buffers: &KvBuffers<'a>) -> Result<Self> {
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
    pub fn rects(&self) -> Rects<'a> {
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
    let job = CopyJob::new(plan, buffers)?;
    // SAFETY: forwarded from the caller.
    unsafe { job.run(engine) }
}

/// The capacity of a side of host slices: its shortest buffer (0 for none).
fn shortest(lens: impl Iterator<Item = usize>) -> u64 {
    lens.min().unwrap_or(0) as u64
}

/// Base pointers and capacity of host source slices.
fn host_sources(src: &[&[u8]]) -> (Vec<*const u8>, u64) {
    (
        src.iter().map(|b| b.as_ptr()).collect(),
        shortest(src.iter().map(|b| b.len())),
    )
}

/// Base pointers and capacity of host destination slices.
fn host_destinations(dst: &mut [&mut [u8]]) -> (Vec<*mut u8>, u64) {
    let capacity = shortest(dst.iter().map(|b| b.len()));
    (dst.iter_mut().map(|b| b.as_mut_ptr()).collect(), capacity)
}

/// Safe host-memory send: copies the plan from each `src[i]` into `dst[i]` on the CPU.
///
/// The capacity of each side is its shortest buffer. Nothing is written if anything is invalid.
pub fn send_host(plan: &Plan<'_>, src: &[&[u8]], dst: &mut [&mut [u8]]) -> Result<SendReport> {
    let (src_ptrs, src_capacity) = host_sources(src);
    let (dst_ptrs, dst_capacity) = host_destinations(dst);
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

/// Refuses a staging region that overlaps any of the page buffers it is copied with.
fn check_no_overlap(
    staging: *const u8,
    staging_bytes: u64,
    side: Side,
    buffers: &[*const u8],
    capacity: u64,
) -> Result<()> {
    let (start, end) = (staging as usize, staging as usize + staging_bytes as usize);
    if staging_bytes == 0 {
        return Ok(());
    }
    for (index, &buffer) in buffers.iter().enumerate() {
        let (b_start, b_end) = (buffer as usize, buffer as usize + capacity as usize);
        if capacity != 0 && start < b_end && b_start < end {
            return Err(Error::StagingOverlapsBuffer {
                side,
                index,
                staging: start,
                staging_bytes,
                buffer: b_start,
                capacity,
            });
        }
    }
    Ok(())
}

/// The validated parts of a staging region: its per-buffer bases.
fn staging_region(
    plan: &Plan<'_>,
    region: *mut u8,
    capacity: u64,
    num_buffers: usize,
    pages: (Side, &[*const u8], u64),
) -> Result<Vec<*mut u8>> {
    check_capacity_fits("staging_capacity", capacity)?;
    if region.is_null() && capacity != 0 {
        return Err(Error::NullStaging { capacity });
    }
    // A NULL region of capacity 0 is the empty region (C's `(NULL, 0)`): fine for a request
    // that stages nothing, and refused as too small by `staging_bases` otherwise. Its bases are
    // never dereferenced, but must not read as NULL buffers.
    let region = if region.is_null() {
        std::ptr::NonNull::dangling().as_ptr()
    } else {
        region
    };
    let staging_len = plan.bytes_per_buffer();
    let bases = staging_bases(region, capacity, num_buffers, staging_len)?;
    let (side, buffers, buffer_capacity) = pages;
    if first_null(buffers).is_none() {
        // `CopyJob::new` names a NULL buffer; overlap is only meaningful between real ones.
        check_no_overlap(
            region,
            staging_len * num_buffers as u64,
            side,
            buffers,
            buffer_capacity,
        )?;
    }
    Ok(bases)
}

/// Validates a pack and hands its job to `run`: the source pages into the staging region
/// (buffer `b` at `staging + b * staging_len`). Nothing runs unless everything is valid.
pub(crate) fn with_pack_job<R>(
    config: &SliceConfig,
    src: &[*const u8],
    src_capacity: u64,
    src_pages: &[i32],
    staging: *mut u8,
    staging_capacity: u64,
    run: impl FnOnce(&CopyJob<'_>) -> Result<R>,
) -> Result<R> {
    let plan = Plan::pack(config, src_pages)?;
    let dst = staging_region(
        &plan,
        staging,
        staging_capacity,
        src.len(),
        (Side::Prefill, src, src_capacity),
    )?;
    let buffers = KvBuffers {
        src,
        dst: &dst,
        src_capacity,
        dst_capacity: plan.bytes_per_buffer(),
    };
    run(&CopyJob::new(&plan, &buffers)?)
}

/// Validates an unpack and hands its job to `run`: the staging region (buffer `b` at
/// `staging + b * staging_len`) into the destination pages.
pub(crate) fn with_unpack_job<R>(
    config: &SliceConfig,
    staging: *const u8,
    staging_capacity: u64,
    dst: &[*mut u8],
    dst_capacity: u64,
    dst_pages: &[i32],
    run: impl FnOnce(&CopyJob<'_>) -> Result<R>,
) -> Result<R> {
    let plan = Plan::unpack(config, dst_pages)?;
    let dst_const: Vec<*const u8> = dst.iter().map(|&p| p.cast_const()).collect();
    let src: Vec<*const u8> = staging_region(
        &plan,
        staging.cast_mut(),
        staging_capacity,
        dst.len(),
        (Side::Decode, &dst_const, dst_capacity),
    )?
    .into_iter()
    .map(<*mut u8>::cast_const)
    .collect();
    let buffers = KvBuffers {
        src: &src,
        dst,
        src_capacity: plan.bytes_per_buffer(),
        dst_capacity,
    };
    run(&CopyJob::new(&plan, &buffers)?)
}

/// Prefill side of a staged transfer: copies the slice of every token of every buffer into the
/// staging region (buffer `b` at `staging + b * staging_len`), after validating everything.
///
/// # Safety
/// Each `src[i]` must be readable for `src_capacity` bytes and `staging` writable for
/// `staging_capacity` bytes, in the memory space `engine` addresses, until the engine has
/// finished.
pub unsafe fn pack(
    config: &SliceConfig,
    src: &[*const u8],
    src_capacity: u64,
    src_pages: &[i32],
    staging: *mut u8,
    staging_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    with_pack_job(
        config,
        src,
        src_capacity,
        src_pages,
        staging,
        staging_capacity,
        // SAFETY: forwarded from the caller; each staged buffer lies inside the region.
        |job| unsafe { job.run(engine) },
    )
}

/// Decode side of a staged transfer: copies the staging region into the slice of every token of
/// every buffer, after validating everything.
///
/// # Safety
/// `staging` must be readable for `staging_capacity` bytes and each `dst[i]` writable for
/// `dst_capacity` bytes, in the memory space `engine` addresses, until the engine has finished.
pub unsafe fn unpack(
    config: &SliceConfig,
    staging: *const u8,
    staging_capacity: u64,
    dst: &[*mut u8],
    dst_capacity: u64,
    dst_pages: &[i32],
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    with_unpack_job(
        config,
        staging,
        staging_capacity,
        dst,
        dst_capacity,
        dst_pages,
        // SAFETY: forwarded from the caller; the engine only reads the region.
        |job| unsafe { job.run(engine) },
    )
}

/// Safe host-memory pack: `staging` receives buffer `b`'s slice at `b * staging_len`.
pub fn pack_host(
    config: &SliceConfig,
    src: &[&[u8]],
    src_pages: &[i32],
    staging: &mut [u8],
) -> Result<SendReport> {
    let (src_ptrs, src_capacity) = host_sources(src);
    // SAFETY: live slices; `staging` is a `&mut` and cannot alias the sources.
    unsafe {
        pack(
            config,
            &src_ptrs,
            src_capacity,
            src_pages,
            staging.as_mut_ptr(),
            staging.len() as u64,
            &mut HostEngine::default(),
        )
    }
}

/// Safe host-memory unpack: buffer `b`'s slice comes from `staging` at `b * staging_len`.
pub fn unpack_host(
    config: &SliceConfig,
    staging: &[u8],
    dst: &mut [&mut [u8]],
    dst_pages: &[i32],
) -> Result<SendReport> {
    let (dst_ptrs, dst_capacity) = host_destinations(dst);
    // SAFETY: live slices; the `&mut` destinations cannot alias `staging` or each other.
    unsafe {
        unpack(
            config,
            staging.as_ptr(),
            staging.len() as u64,
            &dst_ptrs,
            dst_capacity,
            dst_pages,
            &mut HostEngine::default(),
        )
    }
}
