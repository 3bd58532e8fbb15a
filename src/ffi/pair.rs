//! The C ABI of any page layout (REFERENCE.md section 11): layouts, pair configs, requests of
//! tokens, and their segments, plans, staging, send, pack and unpack.

use std::ffi::c_void;

use super::boundary::ffi_boundary;
use super::convert::*;
use super::types::*;
use crate::layout::{Layout, pair_config};
use crate::plan::{PairPlan, check_pair_transfer, pair_staging_for};
use crate::send::{with_pack_job, with_unpack_job};
use crate::types::Staging;

/// Fills the token-major (NHD) layout of one rank, offset 0, as SGLang and vLLM's
/// FlashAttention layout keep KV: head_stride = head_bytes, token_stride = L * head_bytes,
/// page_stride = page_size * L * head_bytes, where L is the rank's local heads (H / tp_size when
/// tp_size <= H, else 1).
///
/// @param[in]  total_kv_heads  H: the model's KV heads (1 for MLA or MQA).
/// @param[in]  tp_size         The rank's side's TP size (> 0; divides H or is a multiple).
/// @param[in]  tp_rank         The rank, < tp_size.
/// @param[in]  page_size       Token slots per page (> 0).
/// @param[in]  head_bytes      head_dim * dtype bytes (> 0).
/// @param[out] out             Receives the layout; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if out is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero tp_size, page_size or head_bytes, tp_rank >= tp_size,
///   a misaligned out, or a page stride that overflows 64 bits;
///   MORI_ERR_TOPOLOGY if total_kv_heads is 0 or H and tp_size divide neither way;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_layout_nhd(
    total_kv_heads: u32,
    tp_size: u32,
    tp_rank: u32,
    page_size: u32,
    head_bytes: u64,
    out: *mut MoriTpLayout,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY: the caller's pointer, as documented above.
        unsafe { write_out(out, Layout::nhd(total_kv_heads, tp_size, tp_rank, page_size, head_bytes)?) }
    }
}

/// Fills the head-major (HND) layout of one rank, offset 0, as vLLM keeps KV with NIXL and on
/// ROCm: token_stride = head_bytes, head_stride = page_size * head_bytes, page_stride =
/// L * page_size * head_bytes.
///
/// Parameters and return codes as for mori_tp_layout_nhd.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_layout_hnd(
    total_kv_heads: u32,
    tp_size: u32,
    tp_rank: u32,
    page_size: u32,
    head_bytes: u64,
    out: *mut MoriTpLayout,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY: the caller's pointer, as documented above.
        unsafe { write_out(out, Layout::hnd(total_kv_heads, tp_size, tp_rank, page_size, head_bytes)?) }
    }
}

/// Derives what a prefill rank and a decode rank move between their layouts: the action and
/// the heads by the ownership rule (the same as mori_tp_slice_config's), and where the first
/// moved head sits among each rank's local heads. Both layouts are validated (see
/// MoriTpLayout); they must count the same heads and agree on head_bytes. Page sizes, strides
/// and offsets may differ.
///
/// @param[in]  prefill  The prefill rank's layout. Must not be NULL.
/// @param[in]  decode   The decode rank's layout. Must not be NULL.
/// @param[out] out      Receives the pair config; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if an argument is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero size, a rank out of range, a misaligned pointer or a
///   layout whose extent overflows 64 bits (the message names the factors);
///   MORI_ERR_TOPOLOGY if a side's H and TP size divide neither way, H is 0, or the two
///   layouts' total_kv_heads differ;
///   MORI_ERR_LAYOUT_MISMATCH if a layout's elements or pages overlap (the message names the
///   fields), or the two head_bytes differ (dtype or head_dim);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_config(
    prefill: *const MoriTpLayout,
    decode: *const MoriTpLayout,
    out: *mut MoriTpPairConfig,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (both blocks): the caller's pointers, as documented above.
        let prefill = unsafe { try_ref(prefill, "prefill") }?;
        let decode = unsafe { try_ref(decode, "decode") }?;
        check_out(out, "out")?;
        let config = MoriTpPairConfig::from(&pair_config(prefill, decode)?);
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out.write(config) };
        Ok(())
    }
}

/// The transport's segments for one request and staging mode: what an RDMA engine copies, for
/// every buffer, between the prefill and the decode rank.
///
/// The elements of a request (one head of one token, head_bytes each) can be taken token-major
/// (token outer, head inner) or head-major in chunks of G tokens (chunk outer, then head, then
/// token) for G = the prefill page size, the decode page size and num_tokens; each run of
/// consecutive elements contiguous on both sides is one segment. The list returned is that of
/// the order with the fewest segments, in that order (on a tie the first of token-major, then G
/// = prefill page size, decode page size, num_tokens). So an HND page holding exactly the moved
/// heads is one segment, and a run of such pages one segment too.
///
/// Offsets are relative to each buffer's base: on an unstaged side its page buffer, on a staged
/// side region + b * staging_len (mori_tp_pair_staging_len) of that rank's staging region. A
/// staged side's region holds the slice densely: token-major (element (k, j) at
/// (k * n + j) * head_bytes), or, when the mode is SRC or DST and the unstaged side is
/// head-major (page_size > 1 and head_stride > token_stride), head-major in chunks of that
/// side's page size G (num_tokens when its heads hold their own pages): chunk c = k / G starts
/// at c * G * n * head_bytes, and inside it element (k, j) is at (j * g_c + k % G) * head_bytes
/// with g_c = min(G, num_tokens - c * G). MORI_TP_STAGING_BOTH gives one segment per buffer.
/// The same list applies to every buffer. A config that is not SEND gives an empty list, after
/// the same checks.
///
/// @param[in]  config     A pair config from mori_tp_pair_config (derived again from its
///                        layouts). Must not be NULL.
/// @param[in]  request    The request; both page lists are checked, staged or not. Must not be
///                        NULL.
/// @param[in]  staging    A MoriTpStaging (see mori_tp_pair_staging_for).
/// @param[out] out        Array of capacity segments; NULL only if capacity = 0. Written only on
///                        MORI_OK. May be uninitialised memory; must not overlap the inputs.
/// @param[in]  capacity   Entries out can hold.
/// @param[out] out_len    Receives the number of segments needed, on MORI_OK and on
///                        MORI_ERR_BUFFER_TOO_SMALL. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if config, request or out_len is NULL, or a NULL array has a
///   non-zero length;
///   MORI_ERR_INVALID_ARGUMENT for an unknown staging value, a config whose fields differ from
///   its layouts' or whose reserved is not 0, page counts other than ceil(num_tokens /
///   page_size), a misaligned pointer, or a size that overflows 64 bits;
///   MORI_ERR_TOPOLOGY, MORI_ERR_LAYOUT_MISMATCH for an invalid layout (as for
///   mori_tp_pair_config);
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index, a page whose end overflows 64 bits, or,
///   with heads outside pages, a page past its head's run;
///   MORI_ERR_BUFFER_TOO_SMALL if capacity < *out_len (nothing written to out; with out = NULL
///   and capacity = 0 this is the answer to a size query);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_segments(
    config: *const MoriTpPairConfig,
    request: *const MoriTpRequest,
    staging: u32,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let request = unsafe { request_from_raw(request) }?;
        let staging = Staging::from_c(staging, "staging")?;
        let plan = PairPlan::transfer(&config, &request, staging)?;
        unsafe { write_segments(&plan, out, capacity, out_len) }
    }
}

/// The page-to-page 2D copies of one request (one hipMemcpy2DAsync each). The segments of an
/// order (as mori_tp_pair_segments defines them, with MORI_TP_STAGING_NONE) are grouped
/// greedily from the front into rects: a rect grows while the next segment has its width and
/// the source and destination offsets advance by the rect's two pitches; its second segment
/// fixes the pitches when both advances are at least the width. A rect of one segment has
/// pitches equal to its width. Pitches are the true advances between rows, never negative and
/// never taken modulo 2^64: a token stride that pages of one slot ignore is not a pitch unless
/// rows really lie that far apart.
///
/// The order used is, among the orders whose segments are fewest, the one whose rects are
/// fewest; on a tie the first of token-major, then G = prefill page size, decode page size,
/// num_tokens. (Every such order moves the same bytes as the same number of segments; fewer
/// rects are fewer hipMemcpy2DAsync calls and a smaller copy-kernel table. HND pages of 16 into
/// NHD pages of 16 at one TP size with 2 heads per rank: 512 rects for 4096 tokens, where
/// token-major order would give 4096.) So a plan never has more rects than the request has
/// segments, and on uniform layouts never more than mori_tp_plan (it may join runs of pages
/// whose offsets advance evenly). Building it costs time in the request's pages and the rects
/// it returns, not in its tokens.
///
/// Parameters, size query and return codes as for mori_tp_pair_segments, with MoriCopyRect
/// entries and no staging argument.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_plan(
    config: *const MoriTpPairConfig,
    request: *const MoriTpRequest,
    out: *mut MoriCopyRect,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let request = unsafe { request_from_raw(request) }?;
        let plan = PairPlan::transfer(&config, &request, Staging::None)?;
        unsafe { write_rects(&plan, out, capacity, out_len) }
    }
}

/// The staging that gives the transport the fewest segments for a pair, from the config alone
/// (so both ranks agree without exchanging pages). A side is full in an order when its pages
/// hold the moved heads and nothing else, back to back in that order: page_stride ==
/// page_size * n * head_bytes, and token-major: n == 1 or head_stride == head_bytes, and
/// page_size == 1 or token_stride == n * head_bytes; head-major: page_size == 1 or
/// token_stride == head_bytes, and n == 1 or head_stride == page_size * head_bytes.
/// Not SEND: NONE. Both sides full token-major, or both full head-major with one page size:
/// NONE. Otherwise the prefill side full in some order: DST; else the decode side full in some
/// order: SRC; else BOTH. On uniform layouts this is mori_tp_staging_for's answer.
///
/// @param[in]  config       A pair config (derived again from its layouts). Must not be NULL.
/// @param[out] out_staging  Receives a MoriTpStaging; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if an argument is NULL;
///   MORI_ERR_INVALID_ARGUMENT, MORI_ERR_TOPOLOGY, MORI_ERR_LAYOUT_MISMATCH for a config as
///   mori_tp_pair_segments refuses it;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_staging_for(
    config: *const MoriTpPairConfig,
    out_staging: *mut u32,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_staging, "out_staging")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let staging = pair_staging_for(&config).to_c();
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_staging.write(staging) };
        Ok(())
    }
}

/// Bytes one buffer stages for a request of num_tokens tokens: staging_len = num_tokens * n *
/// head_bytes (0 unless SEND). A staging region for num_buffers buffers holds num_buffers *
/// staging_len bytes; buffer b's part starts at b * staging_len.
///
/// @param[in]  config      A pair config (derived again from its layouts). Must not be NULL.
/// @param[in]  num_tokens  N.
/// @param[out] out_len     Receives staging_len; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if an argument is NULL;
///   MORI_ERR_INVALID_ARGUMENT if staging_len overflows 64 bits, or for a config as
///   mori_tp_pair_segments refuses it;
///   MORI_ERR_TOPOLOGY, MORI_ERR_LAYOUT_MISMATCH for an invalid layout;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_staging_len(
    config: *const MoriTpPairConfig,
    num_tokens: u64,
    out_len: *mut u64,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY: the caller's pointer, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let len = if config.sends() {
            config.staging_len(num_tokens)?
        } else {
            0
        };
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_len.write(len) };
        Ok(())
    }
}

/// Checks one pair transfer against the memory both ranks registered, before a transfer engine
/// gets its segments, as mori_tp_check_transfer does for uniform configs: the config and
/// request as mori_tp_pair_segments checks them; both ranks have the same number of buffers;
/// every page (staged side or not) ends within its side's capacity (p * page_stride + extent);
/// each staged side's staging_capacity holds num_buffers * staging_len bytes.
///
/// @param[in] config   A pair config (derived again from its layouts). Must not be NULL.
/// @param[in] request  The request. Must not be NULL.
/// @param[in] staging  A MoriTpStaging: the sides the transfer stages.
/// @param[in] prefill  The prefill rank's buffers and staging region. Must not be NULL.
/// @param[in] decode   The decode rank's, likewise. Must not be NULL.
///
/// @return MORI_OK; the codes of mori_tp_pair_segments (but MORI_ERR_BUFFER_TOO_SMALL), and
///   MORI_ERR_INVALID_ARGUMENT if the buffer counts differ;
///   MORI_ERR_OUT_OF_BOUNDS for a page that ends past its side's capacity;
///   MORI_ERR_BUFFER_TOO_SMALL if a staged side's staging_capacity is below num_buffers *
///   staging_len (the message names the side and both numbers).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_check_pair_transfer(
    config: *const MoriTpPairConfig,
    request: *const MoriTpRequest,
    staging: u32,
    prefill: *const MoriTpMemory,
    decode: *const MoriTpMemory,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let request = unsafe { request_from_raw(request) }?;
        let staging = Staging::from_c(staging, "staging")?;
        let prefill = unsafe { try_ref(prefill, "prefill") }?;
        let decode = unsafe { try_ref(decode, "decode") }?;
        check_pair_transfer(&config, &request, staging, prefill, decode)?;
        Ok(())
    }
}

/// Copies one request between any two layouts: for every buffer i, every rect of
/// mori_tp_pair_plan from buffers->src[i] to buffers->dst[i]. For every token k < num_tokens and
/// every moved head j < n, the head_bytes bytes of prefill local head src_first_local + j of
/// token k land on decode local head dst_first_local + j of token k; no other destination byte
/// changes (in particular not the slots after num_tokens in a partial last page).
///
/// Validation, backends, stream and flags are those of mori_tp_kvcache_send: everything (config,
/// request, every page against its capacity, overflow, NULLs, options) is checked before a
/// backend is opened and before the first byte moves, so a refused call writes nothing; the
/// HIP backend launches the copy kernel once for the whole call, or issues one hipMemcpy2DAsync
/// per (buffer, rect), as the flags and the call choose (see MORI_SEND_COPY_KERNEL). A config
/// that is not SEND validates and moves nothing.
///
/// @param[in] config    A pair config (derived again from its layouts). Must not be NULL.
/// @param[in] buffers   Source and destination buffers and their capacities: every page must
///                      end (p * page_stride + extent) within them. Must not be NULL.
/// @param[in] request   The request. Must not be NULL.
/// @param[in] options   Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return MORI_OK; the codes of mori_tp_pair_segments (but MORI_ERR_BUFFER_TOO_SMALL) and of
///   mori_tp_kvcache_send (an entry of buffers->src / dst NULL, a capacity beyond the address
///   space, an unknown backend or flag, a stream with the host backend,
///   MORI_ERR_OUT_OF_BOUNDS for a page past its capacity, MORI_ERR_BACKEND_UNAVAILABLE,
///   MORI_ERR_GPU).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_send(
    config: *const MoriTpPairConfig,
    buffers: *const MoriKvBuffers,
    request: *const MoriTpRequest,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let raw = unsafe { try_ref(buffers, "buffers") }?;
        let request = unsafe { request_from_raw(request) }?;
        let options = unsafe { options_from_raw(options) }?;
        let plan = PairPlan::transfer(&config, &request, Staging::None)?;
        // SAFETY: the caller vouches for the buffers, as documented above.
        unsafe { send_raw(&plan, raw, &options) }
    }
}

/// Prefill side of a staged pair transfer: copies the moved heads of every token of every
/// buffer into the staging region, in the region's order for staging_mode (see
/// mori_tp_pair_segments): buffer b at staging + b * staging_len. Call it before the transport
/// copies the segments of mori_tp_pair_segments with the same mode.
///
/// staging_mode fixes the region's order, so both ranks pass the mode of the request: SRC or
/// BOTH (any other value is MORI_ERR_INVALID_ARGUMENT). Everything else as mori_tp_kvcache_pack:
/// validation before the first byte moves, staging_capacity >= num_buffers * staging_len
/// (MORI_ERR_BUFFER_TOO_SMALL naming both), no overlap between the region and a src buffer,
/// backends, stream and flags.
///
/// @param[in]  config            A pair config (derived again from its layouts). Must not be
///                               NULL.
/// @param[in]  staging_mode      MORI_TP_STAGING_SRC or MORI_TP_STAGING_BOTH.
/// @param[in]  src               num_buffers base pointers of the prefill rank's buffers. NULL
///                               only if num_buffers = 0; no entry may be NULL.
/// @param[in]  num_buffers       Number of buffers.
/// @param[in]  src_capacity      Bytes in each src buffer: every prefill page must end within it.
/// @param[in]  request           The request (both page lists are checked). Must not be NULL.
/// @param[out] staging           The staging region. NULL only if staging_capacity is 0.
/// @param[in]  staging_capacity  Bytes in the staging region.
/// @param[in]  options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return the codes of mori_tp_kvcache_pack and of mori_tp_pair_segments (but its
///   MORI_ERR_BUFFER_TOO_SMALL for an output array), and MORI_ERR_INVALID_ARGUMENT for a
///   staging_mode other than SRC or BOTH.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_pack(
    config: *const MoriTpPairConfig,
    staging_mode: u32,
    src: *const *const c_void,
    num_buffers: usize,
    src_capacity: u64,
    request: *const MoriTpRequest,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let mode = Staging::from_c(staging_mode, "staging_mode")?;
        let request = unsafe { request_from_raw(request) }?;
        let options = unsafe { options_from_raw(options) }?;
        let src = unsafe { try_slice(src, num_buffers, "src") }?;
        let plan = PairPlan::pack(&config, mode, &request)?;
        with_pack_job(
            &plan,
            as_byte_pointers(src),
            src_capacity,
            staging.cast(),
            staging_capacity,
            // The backend opens only now, with everything checked.
            run_job(&options),
        )?;
        Ok(())
    }
}

/// Decode side of a staged pair transfer: copies the staging region (buffer b at staging +
/// b * staging_len, in the region's order for staging_mode) onto the moved heads of every token
/// of every buffer, once the transport has written all segments of mori_tp_pair_segments with
/// the same mode.
///
/// staging_mode: MORI_TP_STAGING_DST or MORI_TP_STAGING_BOTH (any other value is
/// MORI_ERR_INVALID_ARGUMENT). Validation, refusals, backends, stream and flags as for
/// mori_tp_pair_pack with the roles swapped: decode pages are checked against
/// dst_capacity, and the region must not overlap a dst buffer.
///
/// @param[in]  config            A pair config (derived again from its layouts). Must not be
///                               NULL.
/// @param[in]  staging_mode      MORI_TP_STAGING_DST or MORI_TP_STAGING_BOTH.
/// @param[in]  staging           The staging region. NULL only if staging_capacity is 0.
/// @param[in]  staging_capacity  Bytes in the staging region.
/// @param[out] dst               num_buffers base pointers of the decode rank's buffers. NULL
///                               only if num_buffers = 0; no entry may be NULL.
/// @param[in]  num_buffers       Number of buffers.
/// @param[in]  dst_capacity      Bytes in each dst buffer: every decode page must end within it.
/// @param[in]  request           The request (both page lists are checked). Must not be NULL.
/// @param[in]  options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return the codes of mori_tp_pair_pack, with dst in place of src.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pair_unpack(
    config: *const MoriTpPairConfig,
    staging_mode: u32,
    staging: *const c_void,
    staging_capacity: u64,
    dst: *const *mut c_void,
    num_buffers: usize,
    dst_capacity: u64,
    request: *const MoriTpRequest,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let config = unsafe { pair_config_from_raw(config) }?;
        let mode = Staging::from_c(staging_mode, "staging_mode")?;
        let request = unsafe { request_from_raw(request) }?;
        let options = unsafe { options_from_raw(options) }?;
        let dst = unsafe { try_slice(dst, num_buffers, "dst") }?;
        let plan = PairPlan::unpack(&config, mode, &request)?;
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
