//! The C ABI: the types and functions of `include/mori_tp.h`.
//!
//! Thin glue over the safe core: every function runs its body inside `boundary`, which catches
//! panics, maps the core's [`Error`] to a status code and stores its message as this thread's last
//! error. Pointers are checked before use and outputs are written only on success.
//!
//! The doc comments below are copied into the header by cbindgen: they are the C API reference,
//! written for a C or C++ programmer who never reads the Rust.
#![allow(rustdoc::broken_intra_doc_links)] // "[in]"/"[out]" are header conventions, not links.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ffi::{CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, Once};

use crate::backend::{Backend, SendOptions, open_engine};
use crate::error::{Error, Result};
use crate::plan::{CopyRect, Plan, Segment};
use crate::send::{KvBuffers, send};
use crate::slice::{Action, SliceConfig, SliceParams, slice_config};

/// Status code returned by every fallible mori-tp function: MORI_OK (0) or one of the
/// MORI_ERR_* values. The numbers never change; new codes only get added.
pub type MoriStatus = i32;
/// Success.
pub const MORI_OK: MoriStatus = 0;
/// A required pointer argument (or an entry of a pointer array) is NULL.
pub const MORI_ERR_NULL_POINTER: MoriStatus = 1;
/// A field is out of range: zero TP size, page size or item length; rank >= TP size; unknown
/// enum or flag value; inconsistent config fields; a misaligned array.
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
/// The caller's output array is too small; *out_len holds the entries needed.
pub const MORI_ERR_BUFFER_TOO_SMALL: MoriStatus = 7;
/// The requested copy backend is not built in, or it has no device.
pub const MORI_ERR_BACKEND_UNAVAILABLE: MoriStatus = 8;
/// The GPU runtime returned an error; the message names the HIP error, buffer and rect.
pub const MORI_ERR_GPU: MoriStatus = 9;
/// An internal error (a bug in mori-tp) was caught at the boundary; please report the message.
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

/// How mori_send_kvcache runs. Pass NULL for the defaults: AUTO backend, no flags, NULL stream.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriSendOptions {
    /// A MoriBackend: MORI_BACKEND_AUTO, MORI_BACKEND_HOST or MORI_BACKEND_HIP.
    pub backend: u32,
    /// Zero or MORI_SEND_SYNCHRONIZE; other bits are refused.
    pub flags: u32,
    /// hipStream_t for the HIP backend; NULL = the null stream. Must be NULL for the host backend
    /// (including when AUTO falls back to the host).
    pub stream: *mut c_void,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn status_of(error: &Error) -> MoriStatus {
    match error {
        Error::NullPointer(_) => MORI_ERR_NULL_POINTER,
        Error::InvalidArgument(_) => MORI_ERR_INVALID_ARGUMENT,
        Error::Topology(_) => MORI_ERR_TOPOLOGY,
        Error::LayoutMismatch(_) => MORI_ERR_LAYOUT_MISMATCH,
        Error::SliceOverflow(_) => MORI_ERR_SLICE_OVERFLOW,
        Error::OutOfBounds(_) => MORI_ERR_OUT_OF_BOUNDS,
        Error::BufferTooSmall { .. } => MORI_ERR_BUFFER_TOO_SMALL,
        Error::BackendUnavailable(_) => MORI_ERR_BACKEND_UNAVAILABLE,
        Error::Gpu(_) => MORI_ERR_GPU,
        Error::Panic(_) => MORI_ERR_PANIC,
    }
}

fn set_last_error(function: &str, error: &Error) {
    let message = format!("{function}: {error}");
    log::debug!("{message}");
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = message);
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

/// Runs an exported function's body: no panic unwinds into C, every error becomes its status code
/// and this thread's last error message.
pub(crate) fn boundary(function: &str, body: impl FnOnce() -> Result<()>) -> MoriStatus {
    init_logging();
    let error = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return MORI_OK,
        Ok(Err(error)) => error,
        Err(payload) => Error::Panic(panic_message(payload.as_ref())),
    };
    set_last_error(function, &error);
    status_of(&error)
}

/// `&*ptr`, or a NULL_POINTER error naming the argument.
///
/// # Safety
/// A non-NULL `ptr` must point to a valid, aligned `T`.
unsafe fn try_ref<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: non-NULL and valid per the caller.
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::NullPointer(format!("{name} is NULL")))
}

fn check_array<T>(ptr: *const T, len: usize, name: &str) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::NullPointer(format!(
            "{name} is NULL but its length is {len}"
        )));
    }
    if !ptr.is_aligned() {
        return Err(Error::InvalidArgument(format!(
            "{name} ({ptr:p}) is not aligned to {} bytes",
            align_of::<T>()
        )));
    }
    if len
        .checked_mul(size_of::<T>())
        .is_none_or(|bytes| bytes > isize::MAX as usize)
    {
        return Err(Error::InvalidArgument(format!(
            "{name} length {len} is too large"
        )));
    }
    Ok(())
}

/// The array `(ptr, len)` as a slice; `(NULL, 0)` is the empty array.
///
/// # Safety
/// A non-NULL `ptr` must point to `len` valid `T`s that outlive the returned slice.
unsafe fn try_slice<'a, T>(ptr: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_array(ptr, len, name)?;
    // SAFETY: checked non-NULL, aligned and small enough; valid per the caller.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The output array `(ptr, capacity)` as a mutable slice; `(NULL, 0)` is the empty array.
///
/// # Safety
/// A non-NULL `ptr` must point to `capacity` writable `T`s that outlive the returned slice.
unsafe fn try_slice_mut<'a, T>(ptr: *mut T, capacity: usize, name: &str) -> Result<&'a mut [T]> {
    if capacity == 0 {
        return Ok(&mut []);
    }
    check_array(ptr, capacity, name)?;
    // SAFETY: checked non-NULL, aligned and small enough; valid and unaliased per the caller.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, capacity) })
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

impl TryFrom<&MoriTpSliceConfig> for SliceConfig {
    type Error = Error;

    fn try_from(c: &MoriTpSliceConfig) -> Result<Self> {
        let action = match c.action {
            MORI_TP_ACTION_NOT_PAIRED => Action::NotPaired,
            MORI_TP_ACTION_SEND => Action::Send,
            MORI_TP_ACTION_SKIP_REPLICA => Action::SkipReplica,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "config.action {other} is not a MoriTpAction (0 NOT_PAIRED, 1 SEND, \
                     2 SKIP_REPLICA)"
                )));
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

impl TryFrom<&MoriSendOptions> for SendOptions {
    type Error = Error;

    fn try_from(o: &MoriSendOptions) -> Result<Self> {
        let backend = match o.backend {
            MORI_BACKEND_AUTO => Backend::Auto,
            MORI_BACKEND_HOST => Backend::Host,
            MORI_BACKEND_HIP => Backend::Hip,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "options.backend {other} is not a MoriBackend (0 AUTO, 1 HOST, 2 HIP)"
                )));
            }
        };
        if o.flags & !MORI_SEND_SYNCHRONIZE != 0 {
            return Err(Error::InvalidArgument(format!(
                "options.flags {:#x} has unknown bits {:#x} (only MORI_SEND_SYNCHRONIZE = 0x1 is \
                 defined)",
                o.flags,
                o.flags & !MORI_SEND_SYNCHRONIZE
            )));
        }
        Ok(SendOptions {
            backend,
            synchronize: o.flags & MORI_SEND_SYNCHRONIZE != 0,
            stream: o.stream,
        })
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
/// @param[in]  params  The pair and the layout of both sides. Must not be NULL.
/// @param[out] out     Receives the config; written only when MORI_OK is returned.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if params or out is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero TP size, page size or item length, or a rank >= its
///   TP size;
///   MORI_ERR_TOPOLOGY if total_kv_heads is 0 or does not divide (or is not divided by) a TP
///   size;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size, bytes per token
///   is not a multiple of the heads per rank, or the two sides' bytes per head differ (dtype or
///   head_dim mismatch);
///   MORI_ERR_PANIC on an internal error.
///   On failure mori_last_error_message() names the offending values.
///
/// # Safety
/// params and out must be NULL or point to valid, aligned structs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_slice_config(
    params: *const MoriTpSliceParams,
    out: *mut MoriTpSliceConfig,
) -> MoriStatus {
    boundary("mori_tp_slice_config", || {
        // SAFETY: valid or NULL per the caller; NULL is refused.
        let params = unsafe { try_ref(params, "params") }?;
        if out.is_null() {
            return Err(Error::NullPointer("out is NULL".into()));
        }
        let config = MoriTpSliceConfig::from(&slice_config(&params.into())?);
        log_first_config_of_layout(params, &config);
        // SAFETY: non-NULL and valid per the caller.
        unsafe { out.write(config) };
        Ok(())
    })
}

/// Validates the inputs shared by the plan functions and returns the plan.
///
/// # Safety
/// As for mori_tp_plan.
unsafe fn plan_from_raw<'a>(
    config: *const MoriTpSliceConfig,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
) -> Result<Plan<'a>> {
    // SAFETY (all three): valid or NULL per the caller; NULL is refused where it matters.
    let config = SliceConfig::try_from(unsafe { try_ref(config, "config") }?)?;
    let src_pages = unsafe { try_slice(src_pages, num_pages, "src_pages") }?;
    let dst_pages = unsafe { try_slice(dst_pages, num_pages, "dst_pages") }?;
    Plan::new(&config, src_pages, dst_pages)
}

/// Writes `needed` to `*out_len` and, if the entries fit, lets `fill` write them into `out`.
///
/// # Safety
/// As for mori_tp_plan.
unsafe fn write_plan<T>(
    needed: usize,
    out: *mut T,
    capacity: usize,
    out_len: *mut usize,
    fill: impl FnOnce(&mut [T]),
) -> Result<()> {
    // SAFETY: valid or NULL per the caller; NULL with capacity > 0 is refused.
    let out = unsafe { try_slice_mut(out, capacity, "out") }?;
    // SAFETY: checked non-NULL by the caller of this helper; valid per the C caller.
    unsafe { out_len.write(needed) };
    if needed > capacity {
        return Err(Error::BufferTooSmall { needed, capacity });
    }
    fill(&mut out[..needed]);
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
///                        MORI_OK.
/// @param[in]  capacity   Entries out can hold.
/// @param[out] out_len    Receives the number of rects the plan needs, on MORI_OK and on
///                        MORI_ERR_BUFFER_TOO_SMALL. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or out_len is NULL, or a NULL array has a non-zero length;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, inconsistent config fields or a misaligned
///   array;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index, or one whose byte offset overflows 64 bits;
///   MORI_ERR_BUFFER_TOO_SMALL if capacity < *out_len (nothing written to out);
///   MORI_ERR_PANIC on an internal error.
///
/// # Safety
/// Every non-NULL pointer must be valid for its stated length, and out must not overlap the
/// inputs.
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
        if out_len.is_null() {
            return Err(Error::NullPointer("out_len is NULL".into()));
        }
        // SAFETY: the caller's pointers, as documented above.
        let plan = unsafe { plan_from_raw(config, src_pages, dst_pages, num_pages) }?;
        // SAFETY: as above; out_len checked non-NULL.
        unsafe {
            write_plan(plan.num_rects(), out, capacity, out_len, |out| {
                for (slot, rect) in out.iter_mut().zip(plan.rects()) {
                    *slot = rect.into();
                }
            })
        }
    })
}

/// Builds the same plan as mori_tp_plan as contiguous 1D copies (MoriSegment), the shape RDMA
/// batch-write APIs take: one segment per row (token) of each rect, except that a rect whose
/// width equals both pitches is contiguous and becomes a single segment.
///
/// Parameters, size query and return codes are those of mori_tp_plan, with MoriSegment entries.
///
/// # Safety
/// As for mori_tp_plan.
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
        if out_len.is_null() {
            return Err(Error::NullPointer("out_len is NULL".into()));
        }
        // SAFETY: the caller's pointers, as documented above.
        let plan = unsafe { plan_from_raw(config, src_pages, dst_pages, num_pages) }?;
        // SAFETY: as above; out_len checked non-NULL.
        unsafe {
            write_plan(plan.num_segments()?, out, capacity, out_len, |out| {
                plan.fill_segments(out, MoriSegment::from);
            })
        }
    })
}

/// Copies one request's KV cache slice: for every buffer i, every rect of the plan (see
/// mori_tp_plan) from buffers->src[i] to buffers->dst[i].
///
/// All validation (config, options, every page index against both capacities, overflow of every
/// offset, NULL pointers, backend availability) happens before the first byte moves: a failing
/// call writes nothing. A config whose action is not SEND passes the same checks, then moves
/// nothing and returns MORI_OK.
///
/// Backends: HOST copies on the CPU and returns when done (both sides must be host memory).
/// HIP issues one hipMemcpy2DAsync(dst + dst_offset, dst_pitch, src + src_offset, src_pitch,
/// width, height, hipMemcpyDefault, stream) per (buffer, rect) on options->stream, then
/// hipStreamSynchronize if MORI_SEND_SYNCHRONIZE is set; without that flag the copies may still
/// be running on return, and the buffers must stay valid until the stream reaches them.
/// hipMemcpyDefault lets either side be device memory, a peer device's memory (enable peer
/// access first) or host memory. Pageable host memory is legal but makes each copy synchronous
/// and slow; pin it (hipHostMalloc / hipHostRegister) for asynchronous copies. The copies run on
/// the stream's device (the NULL stream: the calling thread's current device); mori-tp never
/// calls hipSetDevice, so the current device is left as it was. D2D copies are fastest when
/// width, pitches and offsets are multiples of 16 bytes (see the README for real models).
/// AUTO is HIP when the library is built with it and a device is present (the device count is
/// read once per process), else HOST.
///
/// @param[in] config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in] buffers    Source and destination buffers and their capacities. Must not be NULL.
/// @param[in] src_pages  num_pages source page indices (int32, >= 0). NULL only if num_pages = 0.
/// @param[in] dst_pages  num_pages destination page indices. NULL only if num_pages = 0.
/// @param[in] num_pages  Number of page pairs.
/// @param[in] options    Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config or buffers is NULL, a NULL array has a non-zero length, or
///   an entry of buffers->src / buffers->dst is NULL;
///   MORI_ERR_INVALID_ARGUMENT for an unknown action, backend or flag bit, inconsistent config
///   fields, a misaligned array, a capacity beyond the address space, or a non-NULL stream with
///   the host backend;
///   MORI_ERR_LAYOUT_MISMATCH if an item length is not a multiple of page_size;
///   MORI_ERR_SLICE_OVERFLOW if the slice does not fit inside a token slot;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index or a page that ends past its capacity;
///   MORI_ERR_BACKEND_UNAVAILABLE if HIP is requested but not built in or no device is present;
///   MORI_ERR_GPU if the HIP runtime fails (the message names the HIP error with its number, and
///   the buffer and rect; copies issued before the failure may have landed, and with
///   MORI_SEND_SYNCHRONIZE they have completed before the call returns);
///   MORI_ERR_PANIC on an internal error.
///
/// # Safety
/// Each buffers->src[i] must be readable for src_capacity bytes and each buffers->dst[i]
/// writable for dst_capacity bytes, in memory the chosen backend can address, until the copies
/// complete.
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
        // SAFETY: the caller's pointers, as documented above; NULLs are refused.
        let raw = unsafe { try_ref(buffers, "buffers") }?;
        let options = match unsafe { options.as_ref() } {
            Some(options) => SendOptions::try_from(options)?,
            None => SendOptions::default(),
        };
        let src = unsafe { try_slice(raw.src, raw.num_buffers, "buffers.src") }?;
        let dst = unsafe { try_slice(raw.dst, raw.num_buffers, "buffers.dst") }?;
        let plan = unsafe { plan_from_raw(config, src_pages, dst_pages, num_pages) }?;
        // SAFETY: `*const c_void` and `*const u8` (and the mut pair) have the same layout.
        let buffers = KvBuffers {
            src: unsafe { std::slice::from_raw_parts(src.as_ptr().cast(), src.len()) },
            dst: unsafe { std::slice::from_raw_parts(dst.as_ptr().cast(), dst.len()) },
            src_capacity: raw.src_capacity,
            dst_capacity: raw.dst_capacity,
        };
        let mut engine = open_engine(&options)?;
        // SAFETY: the caller vouches for the buffers, as documented above; `send` checks them
        // against the plan before the first copy.
        unsafe { send(&plan, &buffers, engine.as_mut()) }?;
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
/// it to keep it.
#[unsafe(no_mangle)]
pub extern "C" fn mori_last_error_message() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
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
        let status = boundary("failing", || Err(Error::Topology("H 3 vs T 2".into())));
        assert_eq!(status, MORI_ERR_TOPOLOGY);
        assert_eq!(boundary("ok", || Ok(())), MORI_OK);
        assert_eq!(last_error(), "failing: invalid topology: H 3 vs T 2");
    }

    #[test]
    fn every_error_variant_maps_to_its_own_status_code() {
        let all = [
            Error::NullPointer(String::new()),
            Error::InvalidArgument(String::new()),
            Error::Topology(String::new()),
            Error::LayoutMismatch(String::new()),
            Error::SliceOverflow(String::new()),
            Error::OutOfBounds(String::new()),
            Error::BufferTooSmall {
                needed: 1,
                capacity: 0,
            },
            Error::BackendUnavailable(String::new()),
            Error::Gpu(String::new()),
            Error::Panic(String::new()),
        ];
        let codes: Vec<MoriStatus> = all.iter().map(status_of).collect();
        assert_eq!(codes, (1..=10).collect::<Vec<_>>());
    }
}
