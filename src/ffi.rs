//! The C ABI: the types and functions of `include/mori_tp.h`.
//!
//! Thin glue over the safe core: every function runs its body inside `boundary`, which catches
//! panics, maps the core's [`Error`] (or a condition only C can create: a NULL argument, a short
//! output array, a misaligned pointer, an unknown enum value) to a status code and stores its
//! message as this thread's last error. Pointers are checked before use, outputs are written
//! only on success, and a request is validated completely before a backend is opened.
//!
//! The doc comments below are copied into the header by cbindgen: they are the C API reference,
//! written for a C or C++ programmer who never reads the Rust. Each function's pointer rules are
//! stated there in C terms (its `@param` lines), which is why the `unsafe extern` functions carry
//! no Rust `# Safety` heading: it would land in the C header.
#![allow(rustdoc::broken_intra_doc_links)] // "[in]"/"[out]" are header conventions, not links.
#![allow(clippy::missing_safety_doc)] // The header's @param lines are the safety contract.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ffi::{CString, c_char, c_void};
use std::fmt;
use std::mem::MaybeUninit;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, Once};

use crate::backend::{Backend, SendOptions, open_engine};
use crate::error::{Error, ErrorClass};
use crate::plan::{CopyRect, Plan, Segment};
use crate::send::{CopyJob, KvBuffers, with_pack_job, with_unpack_job};
use crate::slice::{Action, SliceConfig, SliceParams, slice_config};
use crate::staging::{Staging, staging_for, staging_len};

/// Status code returned by every fallible mori-tp function: MORI_OK (0) or one of the
/// MORI_ERR_* values. The numbers never change; new codes only get added.
pub type MoriStatus = i32;
/// Success.
pub const MORI_OK: MoriStatus = 0;
/// A required pointer argument (or an entry of a pointer array) is NULL.
pub const MORI_ERR_NULL_POINTER: MoriStatus = 1;
/// A field is out of range: zero TP size, page size or item length; rank >= TP size; unknown
/// enum or flag value; inconsistent config fields; a misaligned pointer; a size that overflows
/// 64 bits; a staging region that overlaps a page buffer.
pub const MORI_ERR_INVALID_ARGUMENT: MoriStatus = 2;
/// total_kv_heads and a TP size divide neither way, or total_kv_heads is 0.
pub const MORI_ERR_TOPOLOGY: MoriStatus = 3;
/// An item length is not a multiple of the page size, bytes per token is not a multiple of the
/// heads per rank, or the two sides disagree on bytes per head (dtype or head_dim differ).
pub const MORI_ERR_LAYOUT_MISMATCH: MoriStatus = 4;
/// A head slice would not fit inside its source or destination token slot.
pub const MORI_ERR_SLICE_OVERFLOW: MoriStatus = 5;
/// A page index is negative, or its page ends past the buffer capacity (or past 2^64 bytes).
pub const MORI_ERR_OUT_OF_BOUNDS: MoriStatus = 6;
/// The caller's output array is too small (*out_len holds the entries needed), or a staging
/// region holds fewer bytes than the request needs.
pub const MORI_ERR_BUFFER_TOO_SMALL: MoriStatus = 7;
/// The requested copy backend is not built in, or it has no device.
pub const MORI_ERR_BACKEND_UNAVAILABLE: MoriStatus = 8;
/// The GPU runtime returned an error; the message names the HIP error, buffer and rect.
pub const MORI_ERR_GPU: MoriStatus = 9;
/// An internal error (a bug in mori-tp) was caught at the boundary; please report the message.
/// The process's Rust panic hook (by default: a message on stderr) runs before this is returned;
/// mori-tp installs no hook of its own.
pub const MORI_ERR_PANIC: MoriStatus = 10;

/// What a (prefill rank, decode rank) pair does; the type of MoriTpSliceConfig.action.
pub type MoriTpAction = u32;
/// The two ranks share no KV head: nothing to move.
pub const MORI_TP_ACTION_NOT_PAIRED: MoriTpAction = 0;
/// The prefill rank sends the heads it shares with the decode rank.
pub const MORI_TP_ACTION_SEND: MoriTpAction = 1;
/// The ranks share heads, but another prefill rank (a replica) is their sender: nothing to move.
pub const MORI_TP_ACTION_SKIP_REPLICA: MoriTpAction = 2;

/// Which copy engine mori_send_kvcache uses; the type of MoriSendOptions.backend.
pub type MoriBackend = u32;
/// HIP when the library is built with it and a HIP device is present, the host otherwise.
pub const MORI_BACKEND_AUTO: MoriBackend = 0;
/// CPU copies (memmove), synchronous. Both sides must be host memory.
pub const MORI_BACKEND_HOST: MoriBackend = 1;
/// hipMemcpy2DAsync on the caller's stream (library built with the `hip` feature).
pub const MORI_BACKEND_HIP: MoriBackend = 2;

/// MoriSendOptions.flags bit: wait (hipStreamSynchronize) for the copies before returning.
/// Host copies are always complete on return.
pub const MORI_SEND_SYNCHRONIZE: u32 = 1;
/// MoriSendOptions.flags bit: the HIP backend runs the whole call (every buffer, every rect) as
/// one copy-kernel launch, plus at most one upload of the rect table, instead of one
/// hipMemcpy2DAsync per (buffer, rect). On the stream, in order: hipMallocAsync of the table,
/// hipMemcpyAsync of it, hipModuleLaunchKernel, hipFreeAsync. Every buffer (and a staging
/// region) must then be memory the kernel can address: device memory, a peer device's memory
/// with peer access enabled, or host memory mapped into the device (hipHostMalloc); pageable
/// host memory is not (the GPU faults). The kernel is loaded once per device, on the calling
/// thread's current device, so the stream must belong to that device. The kernel copies in no
/// particular order: a destination byte written twice in one call (a repeated destination page
/// or buffer), or one that is also a source byte, may end as either copy leaves it, where the
/// per-rect path leaves the last copy's. The host backend ignores the flag (its result is the
/// same).
pub const MORI_SEND_COPY_KERNEL: u32 = 2;

/// Which sides of a transfer go through a staging region; see mori_tp_plan_transfer.
pub type MoriTpStaging = u32;
/// Pages to pages: the transport copies straight between the page buffers.
pub const MORI_TP_STAGING_NONE: MoriTpStaging = 0;
/// The prefill rank packs into its staging region (mori_pack_kvcache); the transport copies
/// from it into the decode pages.
pub const MORI_TP_STAGING_SRC: MoriTpStaging = 1;
/// The transport copies from the prefill pages into a staging region on the decode rank, which
/// unpacks it (mori_unpack_kvcache).
pub const MORI_TP_STAGING_DST: MoriTpStaging = 2;
/// Both ranks stage: one transport segment per buffer.
pub const MORI_TP_STAGING_BOTH: MoriTpStaging = 3;

/// The ABI version this header describes; compare with mori_abi_version() at start-up.
pub const MORI_TP_ABI_VERSION: u32 = 1;

/// The library version this header comes from, MAJOR.MINOR.PATCH as mori_version() spells it:
/// for compile-time checks (`#if MORI_TP_VERSION_MINOR >= 2`). The ABI version, not this one,
/// names the shared library (libmori_tp.so.1).
pub const MORI_TP_VERSION_MAJOR: u32 = 0;
/// See MORI_TP_VERSION_MAJOR.
pub const MORI_TP_VERSION_MINOR: u32 = 1;
/// See MORI_TP_VERSION_MAJOR.
pub const MORI_TP_VERSION_PATCH: u32 = 0;

/// Inputs of mori_tp_slice_config: one (prefill rank, decode rank) pair of a deployment.
///
/// Per layer there is one K and one V buffer (MLA: one latent buffer); a buffer is an array of
/// pages of item_len bytes; a page holds page_size tokens, token-major; inside a token the
/// rank's heads are contiguous, in global head order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpSliceParams {
    /// P: tensor-parallel size of the prefill engine (> 0).
    pub prefill_tp_size: u32,
    /// p: the sending prefill rank, < P.
    pub prefill_tp_rank: u32,
    /// D: tensor-parallel size of the decode engine (> 0).
    pub decode_tp_size: u32,
    /// d: the receiving decode rank, < D.
    pub decode_tp_rank: u32,
    /// H: the model's KV heads before TP (num_key_value_heads); 1 for MLA and MQA.
    /// Each TP size must divide H or be a multiple of it.
    pub total_kv_heads: u32,
    /// Tokens per page, the same on both sides (> 0).
    pub page_size: u32,
    /// Bytes of one page of one layer buffer on rank p (page_size * heads on p * bytes per head).
    pub src_item_len: u64,
    /// Bytes of one page of one layer buffer on rank d.
    pub dst_item_len: u64,
}

/// What one (prefill rank, decode rank) pair moves inside every token; filled by
/// mori_tp_slice_config and consumed by the plan and send functions (which re-validate it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpSliceConfig {
    /// A MoriTpAction: MORI_TP_ACTION_SEND, MORI_TP_ACTION_SKIP_REPLICA or
    /// MORI_TP_ACTION_NOT_PAIRED. Only SEND moves bytes.
    pub action: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Global index of the first KV head moved (0 when not SEND).
    pub first_head: u32,
    /// KV heads moved per token (0 when not SEND).
    pub num_heads: u32,
    /// Bytes of one source page (= page_size * bytes_per_token_src).
    pub src_item_len: u64,
    /// Bytes of one destination page (= page_size * bytes_per_token_dst).
    pub dst_item_len: u64,
    /// Bytes of one source token: the source row pitch.
    pub bytes_per_token_src: u64,
    /// Bytes of one destination token: the destination row pitch.
    pub bytes_per_token_dst: u64,
    /// Byte offset of the slice inside a source token (0 when not SEND).
    pub src_head_slice_offset: u64,
    /// Byte offset of the slice inside a destination token (0 when not SEND).
    pub dst_head_slice_offset: u64,
    /// Slice width in bytes: num_heads * bytes per head (0 when not SEND).
    pub heads_bytes_per_token_to_send: u64,
}

/// One strided 2D copy, exactly the arguments of one hipMemcpy2DAsync: height rows of width
/// bytes, row r read at src_offset + r * src_pitch and written at dst_offset + r * dst_pitch.
/// Offsets are relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriCopyRect {
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

/// One contiguous copy, for RDMA batch writes; offsets relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriSegment {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub length: u64,
}

/// The buffers of one transfer: src[i] on the prefill rank is copied into dst[i] on the decode
/// rank, for i in [0, num_buffers).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriKvBuffers {
    /// num_buffers base pointers on the prefill rank: K of each layer, then V of each layer
    /// (MLA: one latent buffer per layer). No entry may be NULL.
    pub src: *const *const c_void,
    /// The matching buffers on the decode rank, in the same order. No entry may be NULL.
    pub dst: *const *mut c_void,
    /// Number of entries in src and in dst. src and dst may be NULL when it is 0.
    pub num_buffers: usize,
    /// Bytes in each src buffer: every source page must end at or before it.
    pub src_capacity: u64,
    /// Bytes in each dst buffer: every destination page must end at or before it.
    pub dst_capacity: u64,
}

/// How mori_send_kvcache, mori_pack_kvcache and mori_unpack_kvcache run. Pass NULL for the
/// defaults: AUTO backend, no flags, NULL stream.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriSendOptions {
    /// A MoriBackend: MORI_BACKEND_AUTO, MORI_BACKEND_HOST or MORI_BACKEND_HIP.
    pub backend: u32,
    /// Zero or more of MORI_SEND_SYNCHRONIZE and MORI_SEND_COPY_KERNEL; other bits are refused.
    pub flags: u32,
    /// hipStream_t for the HIP backend; NULL = the null stream. Must be NULL for the host backend
    /// (including when AUTO falls back to the host).
    pub stream: *mut c_void,
}

/// Why an exported function failed: a core [`Error`], or a condition only a C caller can create.
#[derive(Debug)]
enum Failure {
    /// The safe core refused the request.
    Core(Error),
    /// A required pointer argument is NULL.
    NullArgument(&'static str),
    /// An array pointer is NULL but its length is not 0.
    NullArray { name: &'static str, len: usize },
    /// A pointer is not aligned for its type.
    Misaligned {
        name: &'static str,
        address: usize,
        align: usize,
    },
    /// An array's byte size exceeds the address space.
    ArrayTooLong { name: &'static str, len: usize },
    /// An enum field holds a value the ABI does not define.
    UnknownValue {
        field: &'static str,
        value: u32,
        allowed: &'static str,
    },
    /// A flags field has bits the ABI does not define.
    UnknownFlags { flags: u32, unknown: u32 },
    /// The caller's output array holds fewer entries than the result needs.
    BufferTooSmall {
        needed: usize,
        capacity: usize,
        /// `out == NULL && capacity == 0`: the caller asked for the size, nothing failed.
        size_query: bool,
    },
    /// A panic (a bug) was caught at the boundary.
    Panic(String),
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure::Core(error)
    }
}

type Result<T, E = Failure> = std::result::Result<T, E>;

impl Failure {
    fn status(&self) -> MoriStatus {
        match self {
            Failure::Core(error) => match error.class() {
                ErrorClass::NullPointer => MORI_ERR_NULL_POINTER,
                ErrorClass::InvalidArgument => MORI_ERR_INVALID_ARGUMENT,
                ErrorClass::Topology => MORI_ERR_TOPOLOGY,
                ErrorClass::LayoutMismatch => MORI_ERR_LAYOUT_MISMATCH,
                ErrorClass::SliceOverflow => MORI_ERR_SLICE_OVERFLOW,
                ErrorClass::OutOfBounds => MORI_ERR_OUT_OF_BOUNDS,
                ErrorClass::BufferTooSmall => MORI_ERR_BUFFER_TOO_SMALL,
                ErrorClass::BackendUnavailable => MORI_ERR_BACKEND_UNAVAILABLE,
                ErrorClass::Gpu => MORI_ERR_GPU,
            },
            Failure::NullArgument(_) | Failure::NullArray { .. } => MORI_ERR_NULL_POINTER,
            Failure::Misaligned { .. }
            | Failure::ArrayTooLong { .. }
            | Failure::UnknownValue { .. }
            | Failure::UnknownFlags { .. } => MORI_ERR_INVALID_ARGUMENT,
            Failure::BufferTooSmall { .. } => MORI_ERR_BUFFER_TOO_SMALL,
            Failure::Panic(_) => MORI_ERR_PANIC,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Core(error) => error.fmt(f),
            Failure::NullArgument(name) => write!(f, "null pointer: {name} is NULL"),
            Failure::NullArray { name, len } => {
                write!(f, "null pointer: {name} is NULL but its length is {len}")
            }
            Failure::Misaligned {
                name,
                address,
                align,
            } => write!(
                f,
                "invalid argument: {name} ({address:#x}) is not aligned to {align} bytes"
            ),
            Failure::ArrayTooLong { name, len } => {
                write!(f, "invalid argument: {name} length {len} is too large")
            }
            Failure::UnknownValue {
                field,
                value,
                allowed,
            } => write!(f, "invalid argument: {field} {value} is not a {allowed}"),
            Failure::UnknownFlags { flags, unknown } => write!(
                f,
                "invalid argument: options.flags {flags:#x} has unknown bits {unknown:#x} (only \
                 MORI_SEND_SYNCHRONIZE = 0x1 and MORI_SEND_COPY_KERNEL = 0x2 are defined)"
            ),
            Failure::BufferTooSmall {
                needed, capacity, ..
            } => write!(
                f,
                "buffer too small: the result needs {needed} entries, the output array holds \
                 {capacity}"
            ),
            Failure::Panic(message) => write!(f, "internal error: {message}"),
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores this thread's last error. During thread teardown, after the slot has been destroyed
/// (a C++ `thread_local` destructor calling mori-tp), the message is dropped: the status code
/// still reaches the caller.
fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = message;
        }
    });
}

/// Initialises `env_logger` once, and only when `MORI_TP_LOG` is set: the library never prints
/// unless an operator asks it to.
fn init_logging() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if let Ok(filters) = std::env::var("MORI_TP_LOG") {
            // A host program that already installed a logger keeps it.
            let _ = env_logger::Builder::new()
                .parse_filters(&filters)
                .try_init();
        }
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".into())
}

/// Runs an exported function's body: no panic unwinds into C, every failure becomes its status
/// code and this thread's last error message. Everything, the logging set-up and the message
/// store included, runs under `catch_unwind`, and nothing here can abort: a call made while its
/// thread is being torn down still returns its status.
fn boundary(function: &str, body: impl FnOnce() -> Result<()>) -> MoriStatus {
    let run = AssertUnwindSafe(|| {
        init_logging();
        let failure = match body() {
            Ok(()) => return MORI_OK,
            Err(failure) => failure,
        };
        let message = format!("{function}: {failure}");
        if matches!(
            failure,
            Failure::BufferTooSmall {
                size_query: true,
                ..
            }
        ) {
            log::trace!("{message} (a size query)");
        } else {
            log::debug!("{message}");
        }
        set_last_error(message);
        failure.status()
    });
    match catch_unwind(run) {
        Ok(status) => status,
        Err(payload) => {
            // Storing the message may itself fail during teardown: contain that too.
            let message = format!(
                "{function}: {}",
                Failure::Panic(panic_message(payload.as_ref()))
            );
            let _ = catch_unwind(AssertUnwindSafe(|| set_last_error(message)));
            MORI_ERR_PANIC
        }
    }
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
unsafe fn try_ref<'a, T>(ptr: *const T, name: &'static str) -> Result<&'a T> {
    if ptr.is_null() {
        return Err(Failure::NullArgument(name));
    }
    check_aligned(ptr, name)?;
    // SAFETY: non-NULL and aligned; valid per the caller.
    Ok(unsafe { &*ptr })
}

/// Checks an output pointer: non-NULL and aligned. It is written only once everything passed.
fn check_out<T>(ptr: *mut T, name: &'static str) -> Result<()> {
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
unsafe fn try_slice<'a, T>(ptr: *const T, len: usize, name: &'static str) -> Result<&'a [T]> {
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
unsafe fn try_out_slice<'a, T>(
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

impl From<&MoriTpSliceParams> for SliceParams {
    fn from(p: &MoriTpSliceParams) -> Self {
        SliceParams {
            prefill_tp_size: p.prefill_tp_size,
            prefill_tp_rank: p.prefill_tp_rank,
            decode_tp_size: p.decode_tp_size,
            decode_tp_rank: p.decode_tp_rank,
            total_kv_heads: p.total_kv_heads,
            page_size: p.page_size,
            src_item_len: p.src_item_len,
            dst_item_len: p.dst_item_len,
        }
    }
}

impl From<&SliceConfig> for MoriTpSliceConfig {
    fn from(c: &SliceConfig) -> Self {
        MoriTpSliceConfig {
            action: match c.action {
                Action::NotPaired => MORI_TP_ACTION_NOT_PAIRED,
                Action::Send => MORI_TP_ACTION_SEND,
                Action::SkipReplica => MORI_TP_ACTION_SKIP_REPLICA,
            },
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

/// The core's config for a C config; unknown action values are refused.
fn config_from_c(c: &MoriTpSliceConfig) -> Result<SliceConfig> {
    {
        let action = match c.action {
            MORI_TP_ACTION_NOT_PAIRED => Action::NotPaired,
            MORI_TP_ACTION_SEND => Action::Send,
            MORI_TP_ACTION_SKIP_REPLICA => Action::SkipReplica,
            value => {
                return Err(Failure::UnknownValue {
                    field: "config.action",
                    value,
                    allowed: "MoriTpAction (0 NOT_PAIRED, 1 SEND, 2 SKIP_REPLICA)",
                });
            }
        };
        Ok(SliceConfig {
            action,
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
        })
    }
}

impl From<CopyRect> for MoriCopyRect {
    fn from(r: CopyRect) -> Self {
        MoriCopyRect {
            src_offset: r.src_offset,
            dst_offset: r.dst_offset,
            src_pitch: r.src_pitch,
            dst_pitch: r.dst_pitch,
            width: r.width,
            height: r.height,
        }
    }
}

impl From<Segment> for MoriSegment {
    fn from(s: Segment) -> Self {
        MoriSegment {
            src_offset: s.src_offset,
            dst_offset: s.dst_offset,
            length: s.length,
        }
    }
}

/// The core's options for C options; unknown backends and flag bits are refused.
fn options_from_c(o: &MoriSendOptions) -> Result<SendOptions> {
    {
        let backend = match o.backend {
            MORI_BACKEND_AUTO => Backend::Auto,
            MORI_BACKEND_HOST => Backend::Host,
            MORI_BACKEND_HIP => Backend::Hip,
            value => {
                return Err(Failure::UnknownValue {
                    field: "options.backend",
                    value,
                    allowed: "MoriBackend (0 AUTO, 1 HOST, 2 HIP)",
                });
            }
        };
        let known = MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL;
        if o.flags & !known != 0 {
            return Err(Failure::UnknownFlags {
                flags: o.flags,
                unknown: o.flags & !known,
            });
        }
        Ok(SendOptions {
            backend,
            synchronize: o.flags & MORI_SEND_SYNCHRONIZE != 0,
            copy_kernel: o.flags & MORI_SEND_COPY_KERNEL != 0,
            stream: o.stream,
        })
    }
}

fn staging_from_c(value: u32) -> Result<Staging> {
    match value {
        MORI_TP_STAGING_NONE => Ok(Staging::None),
        MORI_TP_STAGING_SRC => Ok(Staging::Src),
        MORI_TP_STAGING_DST => Ok(Staging::Dst),
        MORI_TP_STAGING_BOTH => Ok(Staging::Both),
        value => Err(Failure::UnknownValue {
            field: "staging",
            value,
            allowed: "MoriTpStaging (0 NONE, 1 SRC, 2 DST, 3 BOTH)",
        }),
    }
}

fn staging_to_c(staging: Staging) -> MoriTpStaging {
    match staging {
        Staging::None => MORI_TP_STAGING_NONE,
        Staging::Src => MORI_TP_STAGING_SRC,
        Staging::Dst => MORI_TP_STAGING_DST,
        Staging::Both => MORI_TP_STAGING_BOTH,
    }
}

/// Logs the first config of each distinct layout at debug level: a canary an operator turns on
/// with MORI_TP_LOG=debug to see what each deployment computed.
fn log_first_config_of_layout(params: &MoriTpSliceParams, config: &MoriTpSliceConfig) {
    if !log::log_enabled!(log::Level::Debug) {
        return;
    }
    /// (total_kv_heads, prefill_tp, decode_tp, page_size, src_item_len, dst_item_len)
    type Layout = (u32, u32, u32, u32, u64, u64);
    static SEEN: Mutex<BTreeSet<Layout>> = Mutex::new(BTreeSet::new());
    let layout = (
        params.total_kv_heads,
        params.prefill_tp_size,
        params.decode_tp_size,
        params.page_size,
        params.src_item_len,
        params.dst_item_len,
    );
    let first = SEEN
        .lock()
        .map(|mut seen| seen.insert(layout))
        .unwrap_or(false);
    if first {
        log::debug!(
            "layout total_kv_heads={} prefill_tp={} decode_tp={} page_size={} src_item_len={} \
             dst_item_len={}: first config (prefill rank {}, decode rank {}) = {config:?}",
            params.total_kv_heads,
            params.prefill_tp_size,
            params.decode_tp_size,
            params.page_size,
            params.src_item_len,
            params.dst_item_len,
            params.prefill_tp_rank,
            params.decode_tp_rank
        );
    }
}

/// Computes the slice that prefill rank params->prefill_tp_rank must move to decode rank
/// params->decode_tp_rank, or says exactly why the layout is invalid.
///
/// The prefill rank that sends head h to decode rank d (which owns h) is
/// sender(d, h) = first(P, h) + (j * rS) / rD, with j = d - first(D, h), rS = max(1, P/H),
/// rD = max(1, D/H) and first(T, h) the lowest rank of a side of TP size T that owns h. Every
/// (decode rank, owned head) is written by exactly one prefill rank. Pure: no allocation visible
/// to the caller, no I/O (except the opt-in MORI_TP_LOG debug log).
///
/// Checks run in three stages, and the first failing check of the first failing stage is
/// reported: (1) page_size, both TP sizes and both item lengths non-zero, each rank below its
/// TP size (MORI_ERR_INVALID_ARGUMENT); (2) total_kv_heads against the prefill, then the decode
/// TP size (MORI_ERR_TOPOLOGY); (3) the prefill, then the decode byte layout, then equal bytes
/// per head (MORI_ERR_LAYOUT_MISMATCH).
///
/// @param[in]  params  The pair and the layout of both sides. Must not be NULL.
/// @param[out] out     Receives the config; written only when MORI_OK is returned. Must not be
///                     NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if params or out is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero TP size, page size or item length, a rank >= its
///   TP size, or a misaligned params or out;
///   MORI_ERR_TOPOLOGY if total_kv_heads is 0 or does not divide (or is not divided by) a TP
///   size;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size, bytes per token
///   is not a multiple of the heads per rank, or the two sides' bytes per head differ (dtype or
///   head_dim mismatch);
///   MORI_ERR_PANIC on an internal error.
///   On failure mori_last_error_message() names the offending values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_slice_config(
    params: *const MoriTpSliceParams,
    out: *mut MoriTpSliceConfig,
) -> MoriStatus {
    boundary("mori_tp_slice_config", || {
        // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
        let params = unsafe { try_ref(params, "params") }?;
        check_out(out, "out")?;
        let config = MoriTpSliceConfig::from(&slice_config(&params.into())?);
        log_first_config_of_layout(params, &config);
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out.write(config) };
        Ok(())
    })
}

/// The config behind a C pointer, re-validated.
///
/// # Safety
/// `config` NULL or valid.
unsafe fn config_from_raw(config: *const MoriTpSliceConfig) -> Result<SliceConfig> {
    // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
    let config = config_from_c(unsafe { try_ref(config, "config") }?)?;
    config.validate()?;
    Ok(config)
}

/// The page arrays of a request.
///
/// # Safety
/// Each array NULL or valid for `num_pages` entries.
unsafe fn pages_from_raw<'a>(
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

/// Writes `needed` to `*out_len` and, if the entries fit, lets `fill` write them into `out`.
///
/// # Safety
/// `out` NULL or writable for `capacity` entries; `out_len` non-NULL (checked by the caller),
/// aligned and writable.
unsafe fn write_plan<T>(
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

/// Builds the copy plan of one request: one strided 2D copy (MoriCopyRect) per maximal run of
/// page pairs.
///
/// Page src_pages[i] of the prefill rank goes to page dst_pages[i] of the decode rank. Adjacent
/// pairs where both indices go up by one form a run; a run of n pages becomes ONE rect of
/// n * page_size rows, width heads_bytes_per_token_to_send, pitches bytes_per_token_src /
/// bytes_per_token_dst, offsets start * item_len + head_slice_offset. Rects come in input order.
/// A config whose action is not SEND yields an empty plan (*out_len = 0), after the same checks.
/// Call with out = NULL and capacity = 0 to learn the size, then again with an array that large.
///
/// @param[in]  config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in]  src_pages  num_pages source page indices (int32, >= 0). NULL only if num_pages = 0.
/// @param[in]  dst_pages  num_pages destination page indices (int32, >= 0). NULL only if
///                        num_pages = 0.
/// @param[in]  num_pages  Number of page pairs.
/// @param[out] out        Array of capacity rects; NULL only if capacity = 0. Written only on
///                        MORI_OK. May be uninitialised memory; must not overlap the inputs.
/// @param[in]  capacity   Entries out can hold.
/// @param[out] out_len    Receives the number of rects the plan needs, on MORI_OK and on
///                        MORI_ERR_BUFFER_TOO_SMALL. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or out_len is NULL, or a NULL array has a non-zero length;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, inconsistent config fields, a misaligned
///   pointer, or num_pages * page_size * heads_bytes_per_token_to_send overflowing 64 bits;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index, or one whose byte offset overflows 64 bits;
///   MORI_ERR_BUFFER_TOO_SMALL if capacity < *out_len (nothing written to out; with out = NULL
///   and capacity = 0 this is the answer to a size query);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_plan(
    config: *const MoriTpSliceConfig,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    out: *mut MoriCopyRect,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    boundary("mori_tp_plan", || {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = Plan::new(&config, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe {
            write_plan(plan.num_rects(), out, capacity, out_len, |slots| {
                for (slot, rect) in slots.iter_mut().zip(plan.rects()) {
                    slot.write(rect.into());
                }
            })
        }
    })
}

/// Writes the segments of `plan` as mori_tp_plan_segments does.
///
/// # Safety
/// As for mori_tp_plan_segments.
unsafe fn write_segments(
    plan: &Plan<'_>,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> Result<()> {
    let needed = plan.num_segments()?;
    // SAFETY: forwarded from the caller.
    unsafe {
        write_plan(needed, out, capacity, out_len, |slots| {
            plan.fill_segments(slots, MoriSegment::from);
        })
    }
}

/// Builds the same plan as mori_tp_plan as contiguous 1D copies (MoriSegment), the shape RDMA
/// batch-write APIs take: one segment per row (token) of each rect, except that a rect whose
/// width equals both pitches is contiguous and becomes a single segment.
///
/// Parameters, size query and return codes are those of mori_tp_plan, with MoriSegment entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_plan_segments(
    config: *const MoriTpSliceConfig,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    boundary("mori_tp_plan_segments", || {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = Plan::new(&config, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe { write_segments(&plan, out, capacity, out_len) }
    })
}

/// The options behind a C pointer (NULL: the defaults).
///
/// # Safety
/// `options` NULL or valid.
unsafe fn options_from_raw(options: *const MoriSendOptions) -> Result<SendOptions> {
    if options.is_null() {
        return Ok(SendOptions::default());
    }
    // SAFETY: non-NULL, valid per the caller; misalignment is refused.
    options_from_c(unsafe { try_ref(options, "options") }?)
}

/// Reinterprets a C array of `void *` as the byte pointers the core takes.
fn as_byte_pointers<T, U>(pointers: &[*const T]) -> &[*const U] {
    // SAFETY: pointers to sized types all have the same layout.
    unsafe { std::slice::from_raw_parts(pointers.as_ptr().cast(), pointers.len()) }
}

/// Reinterprets a C array of `void *` as the mutable byte pointers the core takes.
fn as_mut_byte_pointers<T, U>(pointers: &[*mut T]) -> &[*mut U] {
    // SAFETY: pointers to sized types all have the same layout.
    unsafe { std::slice::from_raw_parts(pointers.as_ptr().cast(), pointers.len()) }
}

/// Copies one request's KV cache slice: for every buffer i, every rect of the plan (see
/// mori_tp_plan) from buffers->src[i] to buffers->dst[i].
///
/// Everything (config, options, every page index against both capacities, overflow of every
/// offset and size, NULL pointers) is validated before a backend is opened and before the first
/// byte moves: a refused call writes nothing, and gets the same status on every machine. A
/// config whose action is not SEND passes the same checks, then moves nothing and returns
/// MORI_OK.
///
/// Backends: HOST copies on the CPU and returns when done (both sides must be host memory).
/// HIP issues one hipMemcpy2DAsync(dst + dst_offset, dst_pitch, src + src_offset, src_pitch,
/// width, height, hipMemcpyDefault, stream) per (buffer, rect) on options->stream, or with
/// MORI_SEND_COPY_KERNEL one copy-kernel launch for the whole call, then hipStreamSynchronize if
/// MORI_SEND_SYNCHRONIZE is set; without that flag the copies may still be running on return,
/// and the buffers must stay valid until the stream reaches them. hipMemcpyDefault lets either
/// side be device memory, a peer device's memory (enable peer access first) or host memory.
/// Pageable host memory is legal but makes each copy synchronous and slow; pin it
/// (hipHostMalloc / hipHostRegister) for asynchronous copies. The copies run on the stream's
/// device (the NULL stream: the calling thread's current device); mori-tp never calls
/// hipSetDevice, so the current device is left as it was. D2D copies are fastest when width,
/// pitches and offsets are multiples of 16 bytes (see the README for real models). AUTO is HIP
/// when the library is built with it and a device is present (the device count is read once per
/// process), else HOST.
///
/// @param[in] config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in] buffers    Source and destination buffers and their capacities. Must not be NULL.
/// @param[in] src_pages  num_pages source page indices (int32, >= 0). NULL only if num_pages = 0.
/// @param[in] dst_pages  num_pages destination page indices. NULL only if num_pages = 0.
/// @param[in] num_pages  Number of page pairs.
/// @param[in] options    Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// Each buffers->src[i] must be readable for src_capacity bytes and each buffers->dst[i]
/// writable for dst_capacity bytes, in memory the chosen backend can address, until the copies
/// complete.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or buffers is NULL, a NULL array has a non-zero length, or
///   an entry of buffers->src / buffers->dst is NULL;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, backend or flag bit, inconsistent config
///   fields, a misaligned pointer, a capacity beyond the address space, a size that overflows
///   64 bits, or a non-NULL stream with the host backend;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index or a page that ends past its capacity;
///   MORI_ERR_BACKEND_UNAVAILABLE if HIP is requested but not built in or no device is present;
///   MORI_ERR_GPU if the HIP runtime fails (the message names the HIP call, its error with its
///   number, and the buffer and rect; this is the one failure after which bytes may have moved:
///   copies issued before it may have landed, and with MORI_SEND_SYNCHRONIZE they have completed
///   before the call returns);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_send_kvcache(
    config: *const MoriTpSliceConfig,
    buffers: *const MoriKvBuffers,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    boundary("mori_send_kvcache", || {
        // SAFETY (every block below): the caller's pointers, as documented above; NULLs and
        // misalignment are refused.
        let config = unsafe { config_from_raw(config) }?;
        let raw = unsafe { try_ref(buffers, "buffers") }?;
        let options = unsafe { options_from_raw(options) }?;
        let src = unsafe { try_slice(raw.src, raw.num_buffers, "buffers.src") }?;
        let dst = unsafe { try_slice(raw.dst, raw.num_buffers, "buffers.dst") }?;
        let (src_pages, dst_pages) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = Plan::new(&config, src_pages, dst_pages)?;
        let buffers = KvBuffers {
            src: as_byte_pointers(src),
            dst: as_mut_byte_pointers(dst),
            src_capacity: raw.src_capacity,
            dst_capacity: raw.dst_capacity,
        };
        let job = CopyJob::new(&plan, &buffers)?;
        // Only now, with the request valid, is the backend opened.
        let mut engine = open_engine(&options)?;
        // SAFETY: the caller vouches for the buffers, as documented above; the job checked
        // every rect against them.
        unsafe { job.run(engine.as_mut()) }?;
        Ok(())
    })
}

/// The staging that minimises transport segments for a pair, without a copy that merges
/// nothing: a side is staged when its token slot is wider than the slice
/// (bytes_per_token_src > heads_bytes_per_token_to_send: SRC; bytes_per_token_dst > it: DST;
/// both: BOTH; neither, or a config that is not SEND: NONE). It depends on the config alone, so
/// both ranks compute the same answer without exchanging page lists.
///
/// With it the transport gets one segment per maximal run of pages (per buffer), or one per
/// buffer when both sides are staged, instead of one per token.
///
/// @param[in]  config       A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[out] out_staging  Receives a MoriTpStaging; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or out_staging is NULL;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, inconsistent config fields or a misaligned
///   pointer;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_staging_for(
    config: *const MoriTpSliceConfig,
    out_staging: *mut u32,
) -> MoriStatus {
    boundary("mori_tp_staging_for", || {
        check_out(out_staging, "out_staging")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let staging = staging_to_c(staging_for(&config)?);
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_staging.write(staging) };
        Ok(())
    })
}

/// The bytes one buffer stages for a request of num_pages page pairs:
/// staging_len = num_pages * page_size * heads_bytes_per_token_to_send (0 when the config is not
/// SEND). A staging region for num_buffers buffers holds num_buffers * staging_len bytes; buffer
/// b's part starts at b * staging_len, and token k of the request (token k % page_size of the
/// page at position k / page_size of the page list) is the heads_bytes_per_token_to_send bytes at
/// b * staging_len + k * heads_bytes_per_token_to_send.
///
/// @param[in]  config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in]  num_pages  Number of page pairs in the request.
/// @param[out] out_len    Receives staging_len; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or out_len is NULL;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, inconsistent config fields, a misaligned
///   pointer, or a staging_len that overflows 64 bits;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_staging_len(
    config: *const MoriTpSliceConfig,
    num_pages: usize,
    out_len: *mut u64,
) -> MoriStatus {
    boundary("mori_tp_staging_len", || {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let len = staging_len(&config, num_pages)?;
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_len.write(len) };
        Ok(())
    })
}

/// The transport's segments for a staged transfer: what an RDMA engine copies, for every buffer,
/// between the prefill and the decode rank.
///
/// Offsets are relative to each buffer's base: on an unstaged side its page buffer, on a staged
/// side region + b * staging_len (mori_tp_staging_len) of that rank's staging region. The same
/// list applies to every buffer. A staged side behaves as a side whose token slot is exactly the
/// slice and whose pages are 0, 1, ..., num_pages - 1, and the list is mori_tp_plan_segments of
/// that geometry: MORI_TP_STAGING_NONE gives mori_tp_plan_segments itself; SRC or DST one segment
/// per maximal run of the other side's pages when that side's token slot equals the slice (else
/// one per token); BOTH one segment of staging_len.
///
/// The full sequence, which leaves every decode byte exactly as one mori_send_kvcache does:
/// the prefill rank calls mori_pack_kvcache if the prefill side is staged (SRC, BOTH); the
/// transport copies every segment for every buffer; the decode rank calls mori_unpack_kvcache if
/// the decode side is staged (DST, BOTH) once the transfer has completed.
///
/// @param[in]  config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in]  staging    A MoriTpStaging: which sides are staged (see mori_tp_staging_for).
/// @param[in]  src_pages  num_pages prefill page indices (int32, >= 0), checked even when the
///                        prefill side is staged. NULL only if num_pages = 0.
/// @param[in]  dst_pages  num_pages decode page indices, likewise. NULL only if num_pages = 0.
/// @param[in]  num_pages  Number of page pairs.
/// @param[out] out        Array of capacity segments; NULL only if capacity = 0. Written only on
///                        MORI_OK. May be uninitialised memory; must not overlap the inputs.
/// @param[in]  capacity   Entries out can hold.
/// @param[out] out_len    Receives the number of segments needed, on MORI_OK and on
///                        MORI_ERR_BUFFER_TOO_SMALL. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or out_len is NULL, or a NULL array has a non-zero length;
///   MORI_ERR_INVALID_ARGUMENT for an unknown staging value or action, inconsistent config
///   fields, a misaligned pointer, or a size that overflows 64 bits;
///   MORI_ERR_LAYOUT_MISMATCH, MORI_ERR_SLICE_OVERFLOW, MORI_ERR_OUT_OF_BOUNDS,
///   MORI_ERR_BUFFER_TOO_SMALL, MORI_ERR_PANIC as for mori_tp_plan.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_plan_transfer(
    config: *const MoriTpSliceConfig,
    staging: u32,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    boundary("mori_tp_plan_transfer", || {
        check_out(out_len, "out_len")?;
        let staging = staging_from_c(staging)?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = Plan::transfer(&config, staging, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe { write_segments(&plan, out, capacity, out_len) }
    })
}

/// Prefill side of a staged transfer: copies the slice of every token of every buffer into the
/// staging region. Buffer b's slices land at staging + b * staging_len, token by token in request
/// order (see mori_tp_staging_len). Call it before the transport copies the segments of
/// mori_tp_plan_transfer with MORI_TP_STAGING_SRC or MORI_TP_STAGING_BOTH.
///
/// Everything (config, options, every page index against src_capacity, the staging capacity,
/// overflow, NULL pointers, overlap of the staging region with a source buffer) is validated
/// before a backend is opened and before the first byte moves: a refused call writes nothing.
/// A config that is not SEND passes the same checks, then moves nothing and returns MORI_OK.
/// Backends, stream and flags as for mori_send_kvcache (the HIP backend: one hipMemcpy2DAsync
/// per (buffer, rect), or one copy-kernel launch with MORI_SEND_COPY_KERNEL).
///
/// @param[in]  config            A config from mori_tp_slice_config (re-validated). Must not be
///                               NULL.
/// @param[in]  src               num_buffers base pointers of the prefill rank's buffers (K of
///                               each layer, then V of each layer). NULL only if num_buffers = 0;
///                               no entry may be NULL.
/// @param[in]  num_buffers       Number of buffers.
/// @param[in]  src_capacity      Bytes in each src buffer: every page must end at or before it.
/// @param[in]  src_pages         num_pages page indices (int32, >= 0). NULL only if num_pages = 0.
/// @param[in]  num_pages         Number of pages (the request's page pairs).
/// @param[out] staging           The staging region: at least num_buffers * staging_len bytes,
///                               not overlapping any src buffer. NULL only if staging_capacity
///                               is 0.
/// @param[in]  staging_capacity  Bytes in the staging region.
/// @param[in]  options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config is NULL, a NULL array has a non-zero length, an entry of src
///   is NULL, or staging is NULL with a non-zero staging_capacity;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, backend or flag bit, inconsistent config
///   fields, a misaligned pointer, a capacity beyond the address space, a size that overflows
///   64 bits, a staging region that overlaps a src buffer, or a non-NULL stream with the host
///   backend;
///   MORI_ERR_LAYOUT_MISMATCH, MORI_ERR_SLICE_OVERFLOW as for mori_tp_plan;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index or a page that ends past src_capacity;
///   MORI_ERR_BUFFER_TOO_SMALL if staging_capacity < num_buffers * staging_len (the message
///   names both);
///   MORI_ERR_BACKEND_UNAVAILABLE, MORI_ERR_GPU, MORI_ERR_PANIC as for mori_send_kvcache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_pack_kvcache(
    config: *const MoriTpSliceConfig,
    src: *const *const c_void,
    num_buffers: usize,
    src_capacity: u64,
    src_pages: *const i32,
    num_pages: usize,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    boundary("mori_pack_kvcache", || {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let options = unsafe { options_from_raw(options) }?;
        let src = unsafe { try_slice(src, num_buffers, "src") }?;
        let pages = unsafe { try_slice(src_pages, num_pages, "src_pages") }?;
        let src = as_byte_pointers(src);
        with_pack_job(
            &config,
            src,
            src_capacity,
            pages,
            staging.cast(),
            staging_capacity,
            // SAFETY: the caller vouches for the buffers and the region, as documented above;
            // the job checked every rect against them, and the backend opens only now.
            |job| open_engine(&options).and_then(|mut engine| unsafe { job.run(engine.as_mut()) }),
        )?;
        Ok(())
    })
}

/// Decode side of a staged transfer: copies the staging region into the slice of every token of
/// every buffer, once the transport has written the region (all segments of
/// mori_tp_plan_transfer with MORI_TP_STAGING_DST or MORI_TP_STAGING_BOTH). Buffer b's slices
/// are read from staging + b * staging_len, token by token in request order.
///
/// Validation, refusals, backends, stream and flags as for mori_pack_kvcache, with the roles
/// swapped: dst_pages are checked against dst_capacity, and the staging region must not overlap
/// a dst buffer.
///
/// @param[in]  config            A config from mori_tp_slice_config (re-validated). Must not be
///                               NULL.
/// @param[in]  staging           The staging region: at least num_buffers * staging_len bytes.
///                               NULL only if staging_capacity is 0.
/// @param[in]  staging_capacity  Bytes in the staging region.
/// @param[out] dst               num_buffers base pointers of the decode rank's buffers, in the
///                               prefill side's order. NULL only if num_buffers = 0; no entry may
///                               be NULL.
/// @param[in]  num_buffers       Number of buffers.
/// @param[in]  dst_capacity      Bytes in each dst buffer: every page must end at or before it.
/// @param[in]  dst_pages         num_pages page indices (int32, >= 0). NULL only if num_pages = 0.
/// @param[in]  num_pages         Number of pages (the request's page pairs).
/// @param[in]  options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return the codes of mori_pack_kvcache, with dst in place of src.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_unpack_kvcache(
    config: *const MoriTpSliceConfig,
    staging: *const c_void,
    staging_capacity: u64,
    dst: *const *mut c_void,
    num_buffers: usize,
    dst_capacity: u64,
    dst_pages: *const i32,
    num_pages: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    boundary("mori_unpack_kvcache", || {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let options = unsafe { options_from_raw(options) }?;
        let dst = unsafe { try_slice(dst, num_buffers, "dst") }?;
        let pages = unsafe { try_slice(dst_pages, num_pages, "dst_pages") }?;
        with_unpack_job(
            &config,
            staging.cast(),
            staging_capacity,
            as_mut_byte_pointers(dst),
            dst_capacity,
            pages,
            // SAFETY: as for mori_pack_kvcache.
            |job| open_engine(&options).and_then(|mut engine| unsafe { job.run(engine.as_mut()) }),
        )?;
        Ok(())
    })
}

/// A static, NUL-terminated name for a status code ("MORI_OK", "MORI_ERR_TOPOLOGY", ...);
/// unknown codes get "MORI_ERR_UNKNOWN". Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_status_str(status: MoriStatus) -> *const c_char {
    let name = match status {
        MORI_OK => c"MORI_OK",
        MORI_ERR_NULL_POINTER => c"MORI_ERR_NULL_POINTER",
        MORI_ERR_INVALID_ARGUMENT => c"MORI_ERR_INVALID_ARGUMENT",
        MORI_ERR_TOPOLOGY => c"MORI_ERR_TOPOLOGY",
        MORI_ERR_LAYOUT_MISMATCH => c"MORI_ERR_LAYOUT_MISMATCH",
        MORI_ERR_SLICE_OVERFLOW => c"MORI_ERR_SLICE_OVERFLOW",
        MORI_ERR_OUT_OF_BOUNDS => c"MORI_ERR_OUT_OF_BOUNDS",
        MORI_ERR_BUFFER_TOO_SMALL => c"MORI_ERR_BUFFER_TOO_SMALL",
        MORI_ERR_BACKEND_UNAVAILABLE => c"MORI_ERR_BACKEND_UNAVAILABLE",
        MORI_ERR_GPU => c"MORI_ERR_GPU",
        MORI_ERR_PANIC => c"MORI_ERR_PANIC",
        _ => c"MORI_ERR_UNKNOWN",
    };
    name.as_ptr()
}

/// The message of the last failing mori-tp call on this thread ("" if none has failed), for
/// example "mori_tp_slice_config: layout mismatch: decode side: bytes_per_head 128 != prefill
/// side bytes_per_head 256 (dtype or head_dim differ; ...)". Successful calls leave it alone.
/// Never NULL; owned by the library and valid until the next failing call on this thread; copy
/// it to keep it. While the thread is exiting (from a thread_local destructor that runs after
/// mori-tp's own) the message may be lost, and this returns "".
#[unsafe(no_mangle)]
pub extern "C" fn mori_last_error_message() -> *const c_char {
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|slot| slot.try_borrow().map(|message| message.as_ptr()).ok())
            .ok()
            .flatten()
    })
    .ok()
    .flatten()
    .unwrap_or(c"".as_ptr())
}

/// The library version ("0.1.0"), a static NUL-terminated string. Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// MORI_TP_ABI_VERSION of the library actually loaded; a program should refuse to run if it
/// differs from the MORI_TP_ABI_VERSION it was compiled against.
#[unsafe(no_mangle)]
pub extern "C" fn mori_abi_version() -> u32 {
    MORI_TP_ABI_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Side;
    use std::ffi::CStr;

    fn last_error() -> String {
        // SAFETY: the library always returns a valid NUL-terminated string.
        unsafe { CStr::from_ptr(mori_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_inside_the_boundary_becomes_mori_err_panic_with_its_message() {
        let status = boundary("test_fn", || panic!("boom at {}", 42));
        assert_eq!(status, MORI_ERR_PANIC);
        assert_eq!(last_error(), "test_fn: internal error: boom at 42");
    }

    #[test]
    fn successful_calls_leave_the_last_error_alone() {
        let status = boundary("failing", || Err(Error::ZeroKvHeads.into()));
        assert_eq!(status, MORI_ERR_TOPOLOGY);
        assert_eq!(boundary("ok", || Ok(())), MORI_OK);
        assert_eq!(
            last_error(),
            "failing: invalid topology: total_kv_heads is 0 (use 1 for MLA and MQA models)"
        );
    }

    #[test]
    fn every_status_class_maps_to_its_own_code() {
        let classes = [
            Failure::NullArgument("x"),
            Failure::Core(Error::ZeroPageSize),
            Failure::Core(Error::ZeroKvHeads),
            Failure::Core(Error::ItemLenNotWholeTokens {
                side: Side::Prefill,
                item_len: 3,
                page_size: 2,
            }),
            Failure::Core(Error::SliceOverflow {
                side: Side::Decode,
                offset: 1,
                width: 2,
                bytes_per_token: 2,
            }),
            Failure::Core(Error::NegativePage {
                side: Side::Prefill,
                page: -1,
                position: 0,
            }),
            Failure::BufferTooSmall {
                needed: 1,
                capacity: 0,
                size_query: true,
            },
            Failure::Core(Error::BackendUnavailable { reason: "x".into() }),
            Failure::Core(Error::Gpu {
                call: "hipX",
                status: 1,
                message: "x".into(),
            }),
            Failure::Panic(String::new()),
        ];
        let codes: Vec<MoriStatus> = classes.iter().map(Failure::status).collect();
        assert_eq!(codes, (1..=10).collect::<Vec<_>>());
    }
}
