//! Conversions at the C boundary: raw pointers into checked references and slices, C integers
//! into the core's enums and configs, and results into the caller's output arrays.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use super::boundary::{Failure, Result};
use super::types::*;
use crate::backend::{Backend, CopyJob, CopyPath, KvBuffers, SendOptions, open_engine};
use crate::error::Error;
use crate::layout::{PairConfig, Request, pair_config};
use crate::plan::Walk;
use crate::pool::PoolMemoryKind;
use crate::slice::{SliceConfig, ValidConfig};
use crate::types::{Action, Staging};

/// Writes `value` through an output pointer after checking it: the last step of a function
/// whose out-parameter is written only on success.
///
/// # Safety
/// A non-NULL, aligned `out` must be valid for writes of a `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T) -> Result<()> {
    check_out(out, "out")?;
    // SAFETY: checked non-NULL and aligned; valid per the caller.
    unsafe { out.write(value) };
    Ok(())
}

/// Checks that a pointer is aligned for `T`.
fn check_aligned<T>(ptr: *const T, name: &'static str) -> Result<()> {
    if ptr.is_aligned() {
        Ok(())
    } else {
        Err(Failure::Misaligned {
            name,
            address: ptr as usize,
            align: align_of::<T>(),
        })
    }
}

/// `&*ptr`, or NULL_POINTER / INVALID_ARGUMENT (misaligned) naming the argument.
///
/// # Safety
/// A non-NULL, aligned `ptr` must point to a valid `T`.
pub(crate) unsafe fn try_ref<'a, T>(ptr: *const T, name: &'static str) -> Result<&'a T> {
    if ptr.is_null() {
        return Err(Failure::NullArgument(name));
    }
    check_aligned(ptr, name)?;
    // SAFETY: non-NULL and aligned; valid per the caller.
    Ok(unsafe { &*ptr })
}

/// Checks an output pointer: non-NULL and aligned. It is written only once everything passed.
pub(crate) fn check_out<T>(ptr: *mut T, name: &'static str) -> Result<()> {
    if ptr.is_null() {
        return Err(Failure::NullArgument(name));
    }
    check_aligned(ptr.cast_const(), name)
}

fn check_array<T>(ptr: *const T, len: usize, name: &'static str) -> Result<()> {
    if ptr.is_null() {
        return Err(Failure::NullArray { name, len });
    }
    check_aligned(ptr, name)?;
    if len
        .checked_mul(size_of::<T>())
        .is_none_or(|bytes| bytes > isize::MAX as usize)
    {
        return Err(Failure::ArrayTooLong { name, len });
    }
    Ok(())
}

/// The array `(ptr, len)` as a slice; `(NULL, 0)` is the empty array.
///
/// # Safety
/// A non-NULL `ptr` must point to `len` valid `T`s that outlive the returned slice.
pub(crate) unsafe fn try_slice<'a, T>(
    ptr: *const T,
    len: usize,
    name: &'static str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_array(ptr, len, name)?;
    // SAFETY: checked non-NULL, aligned and small enough; valid per the caller.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The output array `(ptr, capacity)` as uninitialised slots; `(NULL, 0)` is the empty array.
/// The caller's memory may be uninitialised (numpy `empty`, spare `Vec` capacity), so it is
/// only ever written through `MaybeUninit`.
///
/// # Safety
/// A non-NULL `ptr` must point to `capacity` writable `T`s, not aliased by any input, that
/// outlive the returned slice.
pub(crate) unsafe fn try_out_slice<'a, T>(
    ptr: *mut T,
    capacity: usize,
    name: &'static str,
) -> Result<&'a mut [MaybeUninit<T>]> {
    if capacity == 0 {
        return Ok(&mut []);
    }
    check_array(ptr.cast_const(), capacity, name)?;
    // SAFETY: checked non-NULL, aligned and small enough; writable per the caller, and
    // `MaybeUninit<T>` has `T`'s layout and accepts any contents.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast(), capacity) })
}

/// Writes `needed` to `*out_len` and, if the entries fit, lets `fill` write them into `out`.
///
/// # Safety
/// `out` NULL or writable for `capacity` entries; `out_len` non-NULL (checked by the caller),
/// aligned and writable.
pub(crate) unsafe fn write_plan<T>(
    needed: usize,
    out: *mut T,
    capacity: usize,
    out_len: *mut usize,
    fill: impl FnOnce(&mut [MaybeUninit<T>]),
) -> Result<()> {
    // SAFETY: valid or NULL per the caller; NULL with capacity > 0 is refused.
    let slots = unsafe { try_out_slice(out, capacity, "out") }?;
    // SAFETY: checked by the caller of this helper; valid per the C caller.
    unsafe { out_len.write(needed) };
    if needed > capacity {
        return Err(Failure::BufferTooSmall {
            needed,
            capacity,
            size_query: out.is_null() && capacity == 0,
        });
    }
    fill(&mut slots[..needed]);
    Ok(())
}

/// Writes the rects of `plan` as mori_tp_plan does.
///
/// # Safety
/// As for [`write_plan`].
pub(crate) unsafe fn write_rects(
    plan: &Walk<'_>,
    out: *mut MoriCopyRect,
    capacity: usize,
    out_len: *mut usize,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe {
        write_plan(plan.num_rects(), out, capacity, out_len, |slots| {
            for (slot, rect) in slots.iter_mut().zip(plan.rects()) {
                slot.write(rect);
            }
        })
    }
}

/// Validates `raw` against `plan`, then opens the backend `options` asks for and runs every
/// rect on every buffer pair: the body of mori_tp_kvcache_send and mori_tp_pair_send.
///
/// # Safety
/// `raw`'s arrays NULL or valid for `num_buffers` entries, each buffer valid for its capacity in
/// memory the backend can address until the copies complete.
pub(crate) unsafe fn send_raw(
    plan: &Walk<'_>,
    raw: &MoriKvBuffers,
    options: &SendOptions,
) -> Result<()> {
    // SAFETY (both blocks): as the caller guarantees; NULLs and misalignment are refused.
    let src = unsafe { try_slice(raw.src, raw.num_buffers, "buffers.src") }?;
    let dst = unsafe { try_slice(raw.dst, raw.num_buffers, "buffers.dst") }?;
    let buffers = KvBuffers {
        src: as_byte_pointers(src),
        dst: as_mut_byte_pointers(dst),
        src_capacity: raw.src_capacity,
        dst_capacity: raw.dst_capacity,
    };
    let job = CopyJob::new(plan, &buffers)?;
    // Only now, with the request valid, is the backend opened.
    let mut engine = open_engine(options)?;
    // SAFETY: the caller vouches for the buffers; the job checked every rect against them.
    unsafe { job.run(engine.as_mut()) }?;
    Ok(())
}

/// The last step of a pack or an unpack whose job is valid: open the backend `options` asks
/// for and run the job on it.
pub(crate) fn run_job(
    options: &SendOptions,
) -> impl FnOnce(&CopyJob<'_>) -> crate::error::Result<()> + '_ {
    move |job| {
        let mut engine = open_engine(options)?;
        // SAFETY: the exported function's caller vouches for the buffers and the region, as its
        // header documents; the job checked every rect against them.
        unsafe { job.run(engine.as_mut()) }.map(|_| ())
    }
}

/// Writes the segments of `plan` as mori_tp_plan_segments does.
///
/// # Safety
/// As for [`write_plan`].
pub(crate) unsafe fn write_segments(
    plan: &Walk<'_>,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> Result<()> {
    let needed = plan.num_segments()?;
    // SAFETY: forwarded from the caller.
    unsafe {
        write_plan(needed, out, capacity, out_len, |slots| {
            plan.fill_segments(slots, |segment| segment);
        })
    }
}

/// A C enum: its C type's name and every value it defines, the one table both directions of
/// the conversion and the refusal message read.
pub(crate) trait CEnum: Copy + PartialEq + 'static {
    /// The C typedef ("MoriTpAction").
    const C_TYPE: &'static str;
    /// (C value, Rust value, C name without its prefix), in C value order.
    const VALUES: &'static [(u32, Self, &'static str)];

    /// The Rust value of a C value, or a refusal naming `field` and the values allowed.
    fn from_c(value: u32, field: &'static str) -> Result<Self> {
        Self::VALUES
            .iter()
            .find(|(c, ..)| *c == value)
            .map(|&(_, rust, _)| rust)
            .ok_or_else(|| Failure::UnknownValue {
                field,
                value,
                allowed: format!(
                    "{} ({})",
                    Self::C_TYPE,
                    Self::VALUES
                        .iter()
                        .map(|(c, _, name)| format!("{c} {name}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    /// The C value of a Rust value.
    fn to_c(self) -> u32 {
        Self::VALUES
            .iter()
            .find(|(_, rust, _)| *rust == self)
            .map_or(u32::MAX, |&(c, ..)| c)
    }
}

impl CEnum for Action {
    const C_TYPE: &'static str = "MoriTpAction";
    const VALUES: &'static [(u32, Self, &'static str)] = &[
        (MORI_TP_ACTION_NOT_PAIRED, Action::NotPaired, "NOT_PAIRED"),
        (MORI_TP_ACTION_SEND, Action::Send, "SEND"),
        (
            MORI_TP_ACTION_SKIP_REPLICA,
            Action::SkipReplica,
            "SKIP_REPLICA",
        ),
    ];
}

impl CEnum for Backend {
    const C_TYPE: &'static str = "MoriBackend";
    const VALUES: &'static [(u32, Self, &'static str)] = &[
        (MORI_BACKEND_AUTO, Backend::Auto, "AUTO"),
        (MORI_BACKEND_HOST, Backend::Host, "HOST"),
        (MORI_BACKEND_HIP, Backend::Hip, "HIP"),
        (MORI_BACKEND_CUDA, Backend::Cuda, "CUDA"),
    ];
}

impl CEnum for Staging {
    const C_TYPE: &'static str = "MoriTpStaging";
    const VALUES: &'static [(u32, Self, &'static str)] = &[
        (MORI_TP_STAGING_NONE, Staging::None, "NONE"),
        (MORI_TP_STAGING_SRC, Staging::Src, "SRC"),
        (MORI_TP_STAGING_DST, Staging::Dst, "DST"),
        (MORI_TP_STAGING_BOTH, Staging::Both, "BOTH"),
    ];
}

impl CEnum for PoolMemoryKind {
    const C_TYPE: &'static str = "MoriTpPoolMemory";
    const VALUES: &'static [(u32, Self, &'static str)] = &[
        (MORI_TP_POOL_HOST, PoolMemoryKind::Host, "HOST"),
        (MORI_TP_POOL_DEVICE, PoolMemoryKind::Device, "DEVICE"),
    ];
}

impl From<&SliceConfig> for MoriTpSliceConfig {
    fn from(c: &SliceConfig) -> Self {
        MoriTpSliceConfig {
            action: c.action.to_c(),
            page_size: c.page_size,
            first_head: c.first_head,
            num_heads: c.num_heads,
            src_item_len: c.src_item_len,
            dst_item_len: c.dst_item_len,
            bytes_per_token_src: c.bytes_per_token_src,
            bytes_per_token_dst: c.bytes_per_token_dst,
            src_head_slice_offset: c.src_head_slice_offset,
            dst_head_slice_offset: c.dst_head_slice_offset,
            heads_bytes_per_token_to_send: c.heads_bytes_per_token_to_send,
        }
    }
}

/// The config behind a C pointer, validated once here for the whole call.
///
/// # Safety
/// `config` NULL or valid.
pub(crate) unsafe fn config_from_raw(config: *const MoriTpSliceConfig) -> Result<ValidConfig> {
    // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
    let c = unsafe { try_ref(config, "config") }?;
    let config = SliceConfig {
        action: Action::from_c(c.action, "config.action")?,
        page_size: c.page_size,
        first_head: c.first_head,
        num_heads: c.num_heads,
        src_item_len: c.src_item_len,
        dst_item_len: c.dst_item_len,
        bytes_per_token_src: c.bytes_per_token_src,
        bytes_per_token_dst: c.bytes_per_token_dst,
        src_head_slice_offset: c.src_head_slice_offset,
        dst_head_slice_offset: c.dst_head_slice_offset,
        heads_bytes_per_token_to_send: c.heads_bytes_per_token_to_send,
    };
    Ok(config.checked()?)
}

/// The options behind a C pointer (NULL: the defaults); unknown backends and flag bits are
/// refused.
///
/// # Safety
/// `options` NULL or valid.
pub(crate) unsafe fn options_from_raw(options: *const MoriSendOptions) -> Result<SendOptions> {
    if options.is_null() {
        return Ok(SendOptions::default());
    }
    // SAFETY: non-NULL, valid per the caller; misalignment is refused.
    let o = unsafe { try_ref(options, "options") }?;
    let backend = Backend::from_c(o.backend, "options.backend")?;
    let known = MORI_SEND_SYNCHRONIZE
        | MORI_SEND_COPY_KERNEL
        | MORI_SEND_MEMCPY2D
        | MORI_SEND_MAX_BLOCKS_MASK;
    if o.flags & !known != 0 {
        return Err(Failure::UnknownFlags {
            flags: o.flags,
            unknown: o.flags & !known,
        });
    }
    let path = match (
        o.flags & MORI_SEND_COPY_KERNEL != 0,
        o.flags & MORI_SEND_MEMCPY2D != 0,
    ) {
        (false, false) => CopyPath::Auto,
        (true, false) => CopyPath::Kernel,
        (false, true) => CopyPath::Memcpy2d,
        (true, true) => return Err(Failure::ConflictingFlags { flags: o.flags }),
    };
    let max_blocks = (o.flags & MORI_SEND_MAX_BLOCKS_MASK) >> MORI_SEND_MAX_BLOCKS_SHIFT;
    if max_blocks != 0 && path == CopyPath::Memcpy2d {
        return Err(Failure::BudgetWithMemcpy2d {
            flags: o.flags,
            blocks: max_blocks,
        });
    }
    Ok(SendOptions {
        backend,
        synchronize: o.flags & MORI_SEND_SYNCHRONIZE != 0,
        path,
        max_blocks,
        stream: o.stream,
    })
}

/// The page arrays of a request.
///
/// # Safety
/// Each array NULL or valid for `num_pages` entries.
pub(crate) unsafe fn pages_from_raw<'a>(
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
) -> Result<(&'a [i32], &'a [i32])> {
    // SAFETY: valid or NULL per the caller; NULL with a length is refused.
    let src = unsafe { try_slice(src_pages, num_pages, "src_pages") }?;
    // SAFETY: as above.
    let dst = unsafe { try_slice(dst_pages, num_pages, "dst_pages") }?;
    Ok((src, dst))
}

impl From<&PairConfig> for MoriTpPairConfig {
    fn from(c: &PairConfig) -> Self {
        MoriTpPairConfig {
            action: c.action().to_c(),
            first_head: c.first_head(),
            num_heads: c.num_heads(),
            src_first_local: c.src_first_local(),
            dst_first_local: c.dst_first_local(),
            reserved: 0,
            src: *c.src().layout(),
            dst: *c.dst().layout(),
        }
    }
}

/// The pair config behind a C pointer: derived again from its two layouts, and refused when
/// any other field differs from what they give (a config edited by hand, or built by hand).
///
/// # Safety
/// `config` NULL or valid.
pub(crate) unsafe fn pair_config_from_raw(config: *const MoriTpPairConfig) -> Result<PairConfig> {
    // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
    let c = unsafe { try_ref(config, "config") }?;
    let derived = pair_config(&c.src, &c.dst)?;
    let expected = MoriTpPairConfig::from(&derived);
    for (field, stated, derived) in [
        ("action", c.action, expected.action),
        ("first_head", c.first_head, expected.first_head),
        ("num_heads", c.num_heads, expected.num_heads),
        (
            "src_first_local",
            c.src_first_local,
            expected.src_first_local,
        ),
        (
            "dst_first_local",
            c.dst_first_local,
            expected.dst_first_local,
        ),
        ("reserved", c.reserved, 0),
    ] {
        if stated != derived {
            return Err(Error::PairConfigEdited {
                field,
                stated,
                derived,
            }
            .into());
        }
    }
    Ok(derived)
}

/// The request behind a C pointer; its page arrays as slices.
///
/// # Safety
/// `request` NULL or valid, its arrays NULL or valid for their counts.
pub(crate) unsafe fn request_from_raw<'a>(request: *const MoriTpRequest) -> Result<Request<'a>> {
    // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
    let r = unsafe { try_ref(request, "request") }?;
    // SAFETY: as above; a NULL array with a count is refused.
    let src_pages = unsafe { try_slice(r.src_pages, r.num_src_pages, "request.src_pages") }?;
    // SAFETY: as above.
    let dst_pages = unsafe { try_slice(r.dst_pages, r.num_dst_pages, "request.dst_pages") }?;
    Ok(Request {
        src_pages,
        dst_pages,
        num_tokens: r.num_tokens,
    })
}

/// Reinterprets a C array of `void *` as the byte pointers the core takes.
pub(crate) fn as_byte_pointers(pointers: &[*const c_void]) -> &[*const u8] {
    // SAFETY: pointers to sized types all have the same layout.
    unsafe { std::slice::from_raw_parts(pointers.as_ptr().cast(), pointers.len()) }
}

/// Reinterprets a C array of `void *` as the mutable byte pointers the core takes.
pub(crate) fn as_mut_byte_pointers(pointers: &[*mut c_void]) -> &[*mut u8] {
    // SAFETY: pointers to sized types all have the same layout.
    unsafe { std::slice::from_raw_parts(pointers.as_ptr().cast(), pointers.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<E: CEnum + std::fmt::Debug>() {
        for &(c, rust, _) in E::VALUES {
            assert_eq!(E::from_c(c, "f").unwrap(), rust);
            assert_eq!(rust.to_c(), c);
        }
        let unknown = E::VALUES.len() as u32;
        let message = E::from_c(unknown, "f").unwrap_err().to_string();
        assert!(message.contains(E::C_TYPE), "{message}");
    }

    #[test]
    fn every_c_enum_round_trips_and_refuses_the_next_value() {
        round_trips::<Action>();
        round_trips::<Backend>();
        round_trips::<Staging>();
        round_trips::<PoolMemoryKind>();
        assert_eq!(
            Staging::from_c(7, "staging").unwrap_err().to_string(),
            "invalid argument: staging 7 is not a MoriTpStaging (0 NONE, 1 SRC, 2 DST, 3 BOTH)"
        );
    }
}
