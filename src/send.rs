//! The executors: a send, a pack and an unpack, each validated against its buffers (and its
//! staging region) before an engine runs it.
//!
//! Validation is complete before the first byte moves and before a backend is opened, so a
//! refused request leaves every destination buffer exactly as it was, and gets the same error on
//! every machine.

use crate::backend::{
    CopyEngine, CopyJob, HostCopies, HostEngine, KvBuffers, SendReport, check_capacity_fits,
    first_null,
};
use crate::error::{Error, Result};
use crate::plan::{SlicePlan, Walk, check_staging_capacity};
use crate::slice::IntoValid;
use crate::types::Side;

/// Copies every rect of `plan` (a uniform [`crate::SlicePlan`] or a [`crate::PairPlan`] of
/// [`crate::Staging::None`]) for every buffer pair with `engine`, after validating `buffers`.
///
/// A plan whose pair does not send still validates its buffers, then moves nothing.
///
/// # Safety
/// Each `buffers.src[i]` must be valid for reads of `src_capacity` bytes and each
/// `buffers.dst[i]` valid for writes of `dst_capacity` bytes, in the memory space `engine`
/// addresses, until the engine has finished.
pub unsafe fn send(
    plan: &Walk<'_>,
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
pub fn send_host(plan: &Walk<'_>, src: &[&[u8]], dst: &mut [&mut [u8]]) -> Result<SendReport> {
    send_host_with(plan, src, dst, &mut HostEngine::default())
}

/// [`send_host`] with another engine that copies host memory synchronously
/// ([`crate::backend::open_host_copies`]: the host engine, or HIP's `hipMemcpy2DAsync`).
pub fn send_host_with(
    plan: &Walk<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    engine: &mut dyn HostCopies,
) -> Result<SendReport> {
    let (src_ptrs, src_capacity) = host_sources(src);
    let (dst_ptrs, dst_capacity) = host_destinations(dst);
    let buffers = KvBuffers {
        src: &src_ptrs,
        dst: &dst_ptrs,
        src_capacity,
        dst_capacity,
    };
    // SAFETY: every pointer comes from a live slice at least as long as its side's capacity, the
    // `&mut` slices cannot alias each other or the sources, and a HostCopies engine reaches host
    // memory and has finished before it returns, while the borrows still hold.
    unsafe { send(plan, &buffers, engine) }
}

/// Refuses a staging region that overlaps any of the page buffers it is copied with.
pub(crate) fn check_no_overlap(
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

/// The base of each buffer's part of a staging region, after checking that the region holds
/// `num_buffers * staging_len` bytes.
fn staging_bases(
    side: Side,
    region: *mut u8,
    capacity: u64,
    num_buffers: usize,
    staging_len: u64,
) -> Result<Vec<*mut u8>> {
    check_staging_capacity(side, num_buffers, staging_len, capacity)?;
    // wrapping_add: the region may be device memory, which Rust knows nothing of; every offset
    // is below `needed <= capacity`.
    Ok((0..num_buffers)
        .map(|b| region.wrapping_add(b * staging_len as usize))
        .collect())
}

/// The validated parts of a staging region: its per-buffer bases.
fn staging_region(
    plan: &Walk<'_>,
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
    let (side, buffers, buffer_capacity) = pages;
    let bases = staging_bases(side, region, capacity, num_buffers, staging_len)?;
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

/// Validates a pack and hands its job to `run`: `plan` (a pack plan: pages into a staging
/// region) from the source buffers into the region (buffer `b` at `staging + b * staging_len`).
/// Nothing runs unless everything is valid.
pub(crate) fn with_pack_job<R>(
    plan: &Walk<'_>,
    src: &[*const u8],
    src_capacity: u64,
    staging: *mut u8,
    staging_capacity: u64,
    run: impl FnOnce(&CopyJob<'_>) -> Result<R>,
) -> Result<R> {
    let dst = staging_region(
        plan,
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
    run(&CopyJob::new(plan, &buffers)?)
}

/// Validates an unpack and hands its job to `run`: `plan` (an unpack plan: a staging region
/// into pages) from the region (buffer `b` at `staging + b * staging_len`) into the
/// destination buffers.
pub(crate) fn with_unpack_job<R>(
    plan: &Walk<'_>,
    staging: *const u8,
    staging_capacity: u64,
    dst: &[*mut u8],
    dst_capacity: u64,
    run: impl FnOnce(&CopyJob<'_>) -> Result<R>,
) -> Result<R> {
    let dst_const: Vec<*const u8> = dst.iter().map(|&p| p.cast_const()).collect();
    let src: Vec<*const u8> = staging_region(
        plan,
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
    run(&CopyJob::new(plan, &buffers)?)
}

/// Prefill side of a staged transfer: copies the slice of every token of every buffer into the
/// staging region (buffer `b` at `staging + b * staging_len`), after validating everything.
///
/// # Safety
/// Each `src[i]` must be readable for `src_capacity` bytes and `staging` writable for
/// `staging_capacity` bytes, in the memory space `engine` addresses, until the engine has
/// finished.
pub unsafe fn pack(
    config: impl IntoValid,
    src: &[*const u8],
    src_capacity: u64,
    src_pages: &[i32],
    staging: *mut u8,
    staging_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    let plan = SlicePlan::pack(config, src_pages)?;
    // SAFETY: forwarded from the caller.
    unsafe { pack_into(&plan, src, src_capacity, staging, staging_capacity, engine) }
}

/// [`pack`] of any pack plan (a uniform [`SlicePlan::pack`] or a [`crate::PairPlan::pack`]).
///
/// # Safety
/// As for [`pack`].
pub unsafe fn pack_into(
    plan: &Walk<'_>,
    src: &[*const u8],
    src_capacity: u64,
    staging: *mut u8,
    staging_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    with_pack_job(
        plan,
        src,
        src_capacity,
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
    config: impl IntoValid,
    staging: *const u8,
    staging_capacity: u64,
    dst: &[*mut u8],
    dst_capacity: u64,
    dst_pages: &[i32],
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    let plan = SlicePlan::unpack(config, dst_pages)?;
    // SAFETY: forwarded from the caller.
    unsafe { unpack_from(&plan, staging, staging_capacity, dst, dst_capacity, engine) }
}

/// [`unpack`] of any unpack plan (a uniform [`SlicePlan::unpack`] or a
/// [`crate::PairPlan::unpack`]).
///
/// # Safety
/// As for [`unpack`].
pub unsafe fn unpack_from(
    plan: &Walk<'_>,
    staging: *const u8,
    staging_capacity: u64,
    dst: &[*mut u8],
    dst_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    with_unpack_job(
        plan,
        staging,
        staging_capacity,
        dst,
        dst_capacity,
        // SAFETY: forwarded from the caller; the engine only reads the region.
        |job| unsafe { job.run(engine) },
    )
}

/// Safe host-memory pack: `staging` receives buffer `b`'s slice at `b * staging_len`.
pub fn pack_host(
    config: impl IntoValid,
    src: &[&[u8]],
    src_pages: &[i32],
    staging: &mut [u8],
) -> Result<SendReport> {
    pack_host_with(config, src, src_pages, staging, &mut HostEngine::default())
}

/// [`pack_host`] with another engine that copies host memory synchronously.
pub fn pack_host_with(
    config: impl IntoValid,
    src: &[&[u8]],
    src_pages: &[i32],
    staging: &mut [u8],
    engine: &mut dyn HostCopies,
) -> Result<SendReport> {
    let plan = SlicePlan::pack(config, src_pages)?;
    pack_into_host(&plan, src, staging, engine)
}

/// Safe host-memory pack of any pack plan, on an engine that copies host memory synchronously.
pub fn pack_into_host(
    plan: &Walk<'_>,
    src: &[&[u8]],
    staging: &mut [u8],
    engine: &mut dyn HostCopies,
) -> Result<SendReport> {
    let (src_ptrs, src_capacity) = host_sources(src);
    // SAFETY: live slices; `staging` is a `&mut` and cannot alias the sources; the engine has
    // finished before it returns.
    unsafe {
        pack_into(
            plan,
            &src_ptrs,
            src_capacity,
            staging.as_mut_ptr(),
            staging.len() as u64,
            engine,
        )
    }
}

/// Safe host-memory unpack: buffer `b`'s slice comes from `staging` at `b * staging_len`.
pub fn unpack_host(
    config: impl IntoValid,
    staging: &[u8],
    dst: &mut [&mut [u8]],
    dst_pages: &[i32],
) -> Result<SendReport> {
    unpack_host_with(config, staging, dst, dst_pages, &mut HostEngine::default())
}

/// [`unpack_host`] with another engine that copies host memory synchronously.
pub fn unpack_host_with(
    config: impl IntoValid,
    staging: &[u8],
    dst: &mut [&mut [u8]],
    dst_pages: &[i32],
    engine: &mut dyn HostCopies,
) -> Result<SendReport> {
    let plan = SlicePlan::unpack(config, dst_pages)?;
    unpack_from_host(&plan, staging, dst, engine)
}

/// Safe host-memory unpack of any unpack plan, on an engine that copies host memory
/// synchronously.
pub fn unpack_from_host(
    plan: &Walk<'_>,
    staging: &[u8],
    dst: &mut [&mut [u8]],
    engine: &mut dyn HostCopies,
) -> Result<SendReport> {
    let (dst_ptrs, dst_capacity) = host_destinations(dst);
    // SAFETY: live slices; the `&mut` destinations cannot alias `staging` or each other; the
    // engine has finished before it returns.
    unsafe {
        unpack_from(
            plan,
            staging.as_ptr(),
            staging.len() as u64,
            &dst_ptrs,
            dst_capacity,
            engine,
        )
    }
}
