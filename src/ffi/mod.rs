//! The C ABI: the types and functions of `include/mori_tp.h`.
//!
//! Thin glue over the safe core: every function runs its body inside `ffi_boundary!`, which catches
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

use std::collections::BTreeSet;
use std::ffi::{c_char, c_void};
use std::panic::catch_unwind;
use std::sync::Mutex;

use crate::plan::{SlicePlan, check_transfer, staging_for, staging_len};
use crate::send::{with_pack_job, with_unpack_job};
use crate::slice::slice_config;
use crate::types::Staging;

mod boundary;
mod convert;
mod pool;
mod types;

use boundary::{ffi_boundary, last_error_ptr};
use convert::*;
pub use pool::*;
pub use types::*;

/// Logs the first config of each distinct layout at debug level: a canary an operator turns on
/// with MORI_TP_LOG=debug to see what each deployment computed.
fn log_first_config_of_layout(params: &MoriTpSliceParams, config: &MoriTpSliceConfig) {
    if !log::log_enabled!(log::Level::Debug) {
        return;
    }
    /// (total_kv_heads, prefill_tp, decode_tp, page_size, src_item_len, dst_item_len)
    type ParamsKey = (u32, u32, u32, u32, u64, u64);
    static SEEN: Mutex<BTreeSet<ParamsKey>> = Mutex::new(BTreeSet::new());
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
///   On failure mori_tp_last_error_message() names the offending values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_slice_config(
    params: *const MoriTpSliceParams,
    out: *mut MoriTpSliceConfig,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
        let params = unsafe { try_ref(params, "params") }?;
        check_out(out, "out")?;
        let config = MoriTpSliceConfig::from(&slice_config(params)?);
        log_first_config_of_layout(params, &config);
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out.write(config) };
        Ok(())
    }
}

/// The heads rank tp_rank of an engine of TP size tp_size holds: *num_heads consecutive global
/// heads from *first_head, in the order they sit inside a token (REFERENCE.md section 3). With
/// tp_size <= total_kv_heads each rank holds total_kv_heads / tp_size heads; with tp_size >
/// total_kv_heads each head is replicated on tp_size / total_kv_heads consecutive ranks and each
/// rank holds one. Pure. The arguments belong to no side, so the messages name none.
///
/// @param[in]  total_kv_heads  H, the model's KV heads (1 for MLA and MQA).
/// @param[in]  tp_size         T, the engine's TP size.
/// @param[in]  tp_rank         The rank (< T).
/// @param[out] first_head      Receives the first head; written only on MORI_OK. Must not be NULL.
/// @param[out] num_heads       Receives the number of heads; written only on MORI_OK. Must not
///                             be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if first_head or num_heads is NULL;
///   MORI_ERR_INVALID_ARGUMENT for tp_size 0, tp_rank >= tp_size, or a misaligned pointer;
///   MORI_ERR_TOPOLOGY if total_kv_heads is 0 or does not divide (or is not divided by) tp_size;
///   MORI_ERR_PANIC on an internal error.
///   On failure mori_tp_last_error_message() names the offending values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_rank_heads(
    total_kv_heads: u32,
    tp_size: u32,
    tp_rank: u32,
    first_head: *mut u32,
    num_heads: *mut u32,
) -> MoriStatus {
    ffi_boundary! {
        check_out(first_head, "first_head")?;
        check_out(num_heads, "num_heads")?;
        let heads = crate::slice::rank_heads(total_kv_heads, tp_size, tp_rank)?;
        // SAFETY: both checked non-NULL and aligned; valid per the caller.
        unsafe {
            first_head.write(heads.start);
            num_heads.write(heads.end - heads.start);
        }
        Ok(())
    }
}

/// The one prefill rank that sends head to decode rank decode_tp_rank, which holds it:
/// sender(d, h) = first(P, h) + (j * rS) / rD (see mori_tp_slice_config; REFERENCE.md section 3).
/// The pair (*prefill_tp_rank, decode_tp_rank) is the one whose mori_tp_slice_config action
/// is MORI_TP_ACTION_SEND for that head; for a MORI_TP_ACTION_SKIP_REPLICA pair it names the
/// rank that sends instead. Pure.
///
/// Checks run in order: both TP sizes non-zero (MORI_ERR_INVALID_ARGUMENT); total_kv_heads
/// against the prefill, then the decode TP size (MORI_ERR_TOPOLOGY); decode_tp_rank below the
/// decode TP size, head below total_kv_heads, the decode rank holding head
/// (MORI_ERR_INVALID_ARGUMENT).
///
/// @param[in]  total_kv_heads   H, the model's KV heads (1 for MLA and MQA).
/// @param[in]  prefill_tp_size  P.
/// @param[in]  decode_tp_size   D.
/// @param[in]  decode_tp_rank   d (< D).
/// @param[in]  head             A global head d holds (see mori_tp_rank_heads).
/// @param[out] prefill_tp_rank  Receives the sending prefill rank; written only on MORI_OK.
///                              Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if prefill_tp_rank is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero TP size, decode_tp_rank >= D, head >= H, a head the
///   decode rank does not hold, or a misaligned pointer;
///   MORI_ERR_TOPOLOGY if total_kv_heads is 0 or does not divide (or is not divided by) a TP
///   size;
///   MORI_ERR_PANIC on an internal error.
///   On failure mori_tp_last_error_message() names the offending values and the side.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_head_sender(
    total_kv_heads: u32,
    prefill_tp_size: u32,
    decode_tp_size: u32,
    decode_tp_rank: u32,
    head: u32,
    prefill_tp_rank: *mut u32,
) -> MoriStatus {
    ffi_boundary! {
        check_out(prefill_tp_rank, "prefill_tp_rank")?;
        let sender = crate::slice::head_sender(
            total_kv_heads,
            prefill_tp_size,
            decode_tp_size,
            decode_tp_rank,
            head,
        )?;
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { prefill_tp_rank.write(sender) };
        Ok(())
    }
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
///   and capacity = 0 this is the answer to a size query, which is not a failure: it leaves
///   mori_tp_last_error_message() as it was);
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
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = SlicePlan::new(&config, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe { write_rects(&plan, out, capacity, out_len) }
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
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = SlicePlan::new(&config, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe { write_segments(&plan, out, capacity, out_len) }
    }
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
/// HIP runs on options->stream either one copy-kernel launch for the whole call (its rect table
/// inside the kernel's argument when it fits, else uploaded before the launch) or one
/// hipMemcpy2DAsync(dst + dst_offset, dst_pitch, src +
/// src_offset, src_pitch, width, height, hipMemcpyDefault, stream) per (buffer, rect):
/// MORI_SEND_COPY_KERNEL asks for the kernel, MORI_SEND_MEMCPY2D for the per-rect copies, and
/// with neither the library launches the kernel when the call has at least 2 (buffer, rect)
/// copies, the kernel loads on the stream's device and every buffer is memory it surely reaches,
/// else issues the per-rect copies (MORI_SEND_COPY_KERNEL says which memory that is). On a
/// stream that is capturing a graph the kernel is launched (and captured) only when its table is
/// inside its argument and the runtime captures launches (CUDA; HIP 5.6 and later), else the
/// per-rect copies are. Then hipStreamSynchronize if
/// MORI_SEND_SYNCHRONIZE is set; without that flag the copies may still be running on return,
/// and the buffers must stay valid until the stream reaches them. The per-rect copies take
/// device memory, a peer device's memory (enable peer access first) or host memory on either
/// side; pageable host memory is legal but makes each copy synchronous and slow; pin it
/// (hipHostMalloc / hipHostRegister) for asynchronous copies. The copies run on the stream's
/// device (the NULL stream: the calling thread's current device); the calling thread's current
/// device and graph-capture mode are left as they were (the library makes the stream's device
/// current only while it loads the kernel or allocates for it there, and runs its own runtime
/// calls in the relaxed capture mode). D2D copies are fastest when width, pitches and offsets
/// are multiples of 16 bytes (docs/src/concepts/alignment.md for real
/// models). AUTO is HIP when the library is
/// built with it and a device is present (the device count is read once per process), else
/// HOST.
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
pub unsafe extern "C" fn mori_tp_kvcache_send(
    config: *const MoriTpSliceConfig,
    buffers: *const MoriKvBuffers,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above; NULLs and
        // misalignment are refused.
        let config = unsafe { config_from_raw(config) }?;
        let raw = unsafe { try_ref(buffers, "buffers") }?;
        let options = unsafe { options_from_raw(options) }?;
        let (src_pages, dst_pages) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = SlicePlan::new(&config, src_pages, dst_pages)?;
        // SAFETY: the caller vouches for the buffers, as documented above.
        unsafe { send_raw(&plan, raw, &options) }
    }
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
    ffi_boundary! {
        check_out(out_staging, "out_staging")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let staging = staging_for(&config)?.to_c();
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_staging.write(staging) };
        Ok(())
    }
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
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let len = staging_len(&config, num_pages)?;
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_len.write(len) };
        Ok(())
    }
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
/// The full sequence, which leaves every decode byte exactly as one mori_tp_kvcache_send does:
/// the prefill rank calls mori_tp_kvcache_pack if the prefill side is staged (SRC, BOTH); the
/// transport copies every segment for every buffer; the decode rank calls mori_tp_kvcache_unpack if
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
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        let staging = Staging::from_c(staging, "staging")?;
        // SAFETY: the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let plan = SlicePlan::transfer(&config, staging, src, dst)?;
        // SAFETY: as above; out_len checked.
        unsafe { write_segments(&plan, out, capacity, out_len) }
    }
}

/// Checks one transfer against the memory both ranks registered, before a transfer engine gets
/// its segments: an engine copies whatever it is given, so a page past a buffer's end or a
/// staging region too small would corrupt a neighbouring registration instead of failing.
/// Call it on the prefill rank (the initiator) with the decode rank's memory from the
/// handshake, right before mori_tp_plan_transfer.
///
/// It checks, in this order: the config and page lists as mori_tp_plan_transfer does; that both
/// ranks have the same number of buffers (they are paired one to one); that every page ends
/// within its side's buffer capacity, whether or not that side is staged; and that each staged
/// side's staging_capacity holds num_buffers * staging_len bytes (mori_tp_staging_len).
///
/// @param[in] config     A config from mori_tp_slice_config (re-validated). Must not be NULL.
/// @param[in] staging    A MoriTpStaging: the sides the transfer stages.
/// @param[in] src_pages  num_pages prefill page indices. NULL only if num_pages = 0.
/// @param[in] dst_pages  num_pages decode page indices. NULL only if num_pages = 0.
/// @param[in] num_pages  Number of page pairs.
/// @param[in] prefill    The prefill rank's buffers and staging region. Must not be NULL.
/// @param[in] decode     The decode rank's, likewise. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config, prefill or decode is NULL, or a NULL array has a
///   non-zero length;
///   MORI_ERR_INVALID_ARGUMENT for an unknown staging value or action, inconsistent config
///   fields, buffer counts that differ, a misaligned pointer, or a size that overflows 64 bits;
///   MORI_ERR_LAYOUT_MISMATCH, MORI_ERR_SLICE_OVERFLOW as for mori_tp_plan;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index or a page that ends past its side's
///   capacity;
///   MORI_ERR_BUFFER_TOO_SMALL if a staged side's staging_capacity is below
///   num_buffers * staging_len (the message names the side and both numbers);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_check_transfer(
    config: *const MoriTpSliceConfig,
    staging: u32,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    prefill: *const MoriTpMemory,
    decode: *const MoriTpMemory,
) -> MoriStatus {
    ffi_boundary! {
        let staging = Staging::from_c(staging, "staging")?;
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let (src, dst) = unsafe { pages_from_raw(src_pages, dst_pages, num_pages) }?;
        let prefill = unsafe { try_ref(prefill, "prefill") }?;
        let decode = unsafe { try_ref(decode, "decode") }?;
        check_transfer(&config, staging, src, dst, prefill, decode)?;
        Ok(())
    }
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
/// Backends, stream and flags as for mori_tp_kvcache_send (the HIP backend: one copy-kernel launch,
/// or one hipMemcpy2DAsync per (buffer, rect), as the flags and the call choose).
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
///   MORI_ERR_BACKEND_UNAVAILABLE, MORI_ERR_GPU, MORI_ERR_PANIC as for mori_tp_kvcache_send.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_kvcache_pack(
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
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let options = unsafe { options_from_raw(options) }?;
        let src = unsafe { try_slice(src, num_buffers, "src") }?;
        let pages = unsafe { try_slice(src_pages, num_pages, "src_pages") }?;
        let src = as_byte_pointers(src);
        let plan = SlicePlan::pack(&config, pages)?;
        with_pack_job(
            &plan,
            src,
            src_capacity,
            staging.cast(),
            staging_capacity,
            // The backend opens only now, with everything checked.
            run_job(&options),
        )?;
        Ok(())
    }
}

/// Decode side of a staged transfer: copies the staging region into the slice of every token of
/// every buffer, once the transport has written the region (all segments of
/// mori_tp_plan_transfer with MORI_TP_STAGING_DST or MORI_TP_STAGING_BOTH). Buffer b's slices
/// are read from staging + b * staging_len, token by token in request order.
///
/// Validation, refusals, backends, stream and flags as for mori_tp_kvcache_pack, with the roles
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
/// @return the codes of mori_tp_kvcache_pack, with dst in place of src.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_kvcache_unpack(
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
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { config_from_raw(config) }?;
        let options = unsafe { options_from_raw(options) }?;
        let dst = unsafe { try_slice(dst, num_buffers, "dst") }?;
        let pages = unsafe { try_slice(dst_pages, num_pages, "dst_pages") }?;
        let plan = SlicePlan::unpack(&config, pages)?;
        with_unpack_job(
            &plan,
            staging.cast(),
            staging_capacity,
            as_mut_byte_pointers(dst),
            dst_capacity,
            run_job(&options),
        )?;
        Ok(())
    }
}

/// A static, NUL-terminated name for a status code ("MORI_OK", "MORI_ERR_TOPOLOGY", ...);
/// unknown codes get "MORI_ERR_UNKNOWN". Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_status_name(status: MoriStatus) -> *const c_char {
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
        MORI_ERR_POOL_FULL => c"MORI_ERR_POOL_FULL",
        _ => c"MORI_ERR_UNKNOWN",
    };
    name.as_ptr()
}

/// A static, NUL-terminated name for a MoriTpAction value, the name of its macro
/// ("MORI_TP_ACTION_SEND", ...): for logs and messages. Values the ABI does not define get
/// "MORI_TP_ACTION_UNKNOWN" (no macro has that name). Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_action_name(action: u32) -> *const c_char {
    let name = match action {
        MORI_TP_ACTION_NOT_PAIRED => c"MORI_TP_ACTION_NOT_PAIRED",
        MORI_TP_ACTION_SEND => c"MORI_TP_ACTION_SEND",
        MORI_TP_ACTION_SKIP_REPLICA => c"MORI_TP_ACTION_SKIP_REPLICA",
        _ => c"MORI_TP_ACTION_UNKNOWN",
    };
    name.as_ptr()
}

/// A static, NUL-terminated name for a MoriTpStaging value ("MORI_TP_STAGING_NONE",
/// "MORI_TP_STAGING_SRC", "MORI_TP_STAGING_DST", "MORI_TP_STAGING_BOTH"); other values get
/// "MORI_TP_STAGING_UNKNOWN". Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_staging_name(staging: u32) -> *const c_char {
    let name = match staging {
        MORI_TP_STAGING_NONE => c"MORI_TP_STAGING_NONE",
        MORI_TP_STAGING_SRC => c"MORI_TP_STAGING_SRC",
        MORI_TP_STAGING_DST => c"MORI_TP_STAGING_DST",
        MORI_TP_STAGING_BOTH => c"MORI_TP_STAGING_BOTH",
        _ => c"MORI_TP_STAGING_UNKNOWN",
    };
    name.as_ptr()
}

/// A static, NUL-terminated name for a MoriBackend value ("MORI_BACKEND_AUTO",
/// "MORI_BACKEND_HOST", "MORI_BACKEND_HIP", "MORI_BACKEND_CUDA"); other values get "MORI_BACKEND_UNKNOWN". The name
/// says nothing of whether the backend is built in or has a device. Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_backend_name(backend: u32) -> *const c_char {
    let name = match backend {
        MORI_BACKEND_AUTO => c"MORI_BACKEND_AUTO",
        MORI_BACKEND_HOST => c"MORI_BACKEND_HOST",
        MORI_BACKEND_HIP => c"MORI_BACKEND_HIP",
        MORI_BACKEND_CUDA => c"MORI_BACKEND_CUDA",
        _ => c"MORI_BACKEND_UNKNOWN",
    };
    name.as_ptr()
}

/// The message of the last failing mori-tp call on this thread ("" if none has failed), for
/// example "mori_tp_slice_config: layout mismatch: decode side: bytes_per_head 128 != prefill
/// side bytes_per_head 256 (dtype or head_dim differ; ...)". Successful calls leave it alone,
/// and so do size queries (out = NULL, capacity = 0 answered with MORI_ERR_BUFFER_TOO_SMALL),
/// which are not failures. Never NULL; owned by the library and valid until the next failing
/// call on this thread (a size query does not end it); copy it to keep it. While the thread is
/// exiting (from a thread_local destructor that runs after mori-tp's own) the message may be
/// lost, and this returns "".
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_last_error_message() -> *const c_char {
    catch_unwind(last_error_ptr)
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// The library version ("0.1.0"), a static NUL-terminated string. Never NULL; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// What the GPU backend `backend` (MORI_BACKEND_CUDA or MORI_BACKEND_HIP) did in this process:
/// its copy-kernel launches, and how many calls took the per-rect copies instead of the kernel,
/// in all and per reason (MoriTpGpuCounters). Reading them loads no driver and needs no device: a
/// backend built in but never used reads all zeros.
///
/// @param[in]  backend  MORI_BACKEND_CUDA or MORI_BACKEND_HIP.
/// @param[out] out      Receives the counters; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if out is NULL;
///   MORI_ERR_INVALID_ARGUMENT if backend is not MORI_BACKEND_CUDA or MORI_BACKEND_HIP, or out
///   is misaligned;
///   MORI_ERR_BACKEND_UNAVAILABLE if that backend is not built into this library;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_gpu_counters_get(
    backend: u32,
    out: *mut MoriTpGpuCounters,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out, "out")?;
        let backend = match backend {
            MORI_BACKEND_CUDA => crate::backend::Backend::Cuda,
            MORI_BACKEND_HIP => crate::backend::Backend::Hip,
            value => {
                return Err(boundary::Failure::UnknownValue {
                    field: "backend",
                    value,
                    allowed: format!(
                        "the GPU backends ({MORI_BACKEND_HIP} HIP, {MORI_BACKEND_CUDA} CUDA)"
                    ),
                }
                )
            }
        };
        let c = crate::backend::gpu_counters(backend)?;
        let counters = MoriTpGpuCounters {
            kernel_launches: c.kernel_launches,
            fallbacks: c.fallbacks,
            fallbacks_unloadable: c.fallbacks_unloadable,
            fallbacks_busy: c.fallbacks_busy,
            fallbacks_context: c.fallbacks_context,
            fallbacks_capture: c.fallbacks_capture,
            fallbacks_memory: c.fallbacks_memory,
            load_failures: c.load_failures,
        };
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out.write(counters) };
        Ok(())
    }
}

/// MORI_TP_ABI_VERSION of the library actually loaded; a program should refuse to run if it
/// differs from the MORI_TP_ABI_VERSION it was compiled against.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_abi_version() -> u32 {
    MORI_TP_ABI_VERSION
}

// The pair functions (any page layout, REFERENCE.md section 11), after the functions above.
mod pair;
pub use pair::*;

// Requests of several groups and pipeline layer maps, after the pair functions (which they build
// on).
mod groups;
pub use groups::*;

// The names before the mori_tp_ prefix, forwarding to the functions above; last in the header.
mod aliases;
pub use aliases::*;
