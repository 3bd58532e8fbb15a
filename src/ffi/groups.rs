//! The C ABI of a request of several groups (each a pair config, a request and buffers) and of
//! pipeline-parallel layer maps.

use std::ffi::c_void;

use super::boundary::{Result, ffi_boundary};
use super::convert::*;
use super::types::*;
use crate::backend::{CopyJob, SendOptions, open_engine};
use crate::error::Error;
use crate::group::{
    Group, GroupBuffers, GroupsPlan, run_jobs, with_pack_jobs, with_send_jobs, with_unpack_jobs,
};
use crate::layout::{PairConfig, Request};
use crate::pipeline::shared_layers;
use crate::types::Staging;

/// Which pointer arrays of a group a function reads, given the group's staging.
type Reads = fn(Staging) -> (bool, bool);

const READS_NONE: Reads = |_| (false, false);

/// The groups behind a C array, converted and checked one by one; a failure names its group.
struct RawGroups<'a> {
    configs: Vec<PairConfig>,
    rest: Vec<(Staging, u64, Request<'a>, GroupBuffers<'a>)>,
}

impl RawGroups<'_> {
    fn groups(&self) -> Vec<Group<'_>> {
        self.configs
            .iter()
            .zip(&self.rest)
            .map(
                |(config, &(staging, first_token, request, buffers))| Group {
                    config,
                    staging,
                    first_token,
                    request,
                    buffers,
                },
            )
            .collect()
    }
}

/// A group's pointer array: empty when NULL or not read, else `num_buffers` entries.
///
/// # Safety
/// A non-NULL `pointers` that is read must be valid for `num_buffers` entries.
unsafe fn pointers<'a, P>(
    pointers: *const P,
    num_buffers: usize,
    read: bool,
    name: &'static str,
) -> Result<&'a [P]> {
    if !read || pointers.is_null() {
        return Ok(&[]);
    }
    // SAFETY: valid per the caller, as documented on MoriTpGroup.
    unsafe { try_slice(pointers, num_buffers, name) }
}

/// One group of the C array.
///
/// # Safety
/// As documented on MoriTpGroup.
unsafe fn group_from_raw<'a>(
    raw: &'a MoriTpGroup,
    reads: Reads,
) -> Result<(PairConfig, (Staging, u64, Request<'a>, GroupBuffers<'a>))> {
    // SAFETY (every block below): the caller's pointers, as documented on MoriTpGroup.
    let config = unsafe { pair_config_from_raw(&raw.config) }?;
    let staging = Staging::from_c(raw.staging, "staging")?;
    if raw.reserved != 0 {
        return Err(Error::ReservedNotZero {
            field: "reserved",
            value: raw.reserved,
        }
        .into());
    }
    let request = unsafe { request_from_raw(&raw.request) }?;
    let b = &raw.buffers;
    let (read_src, read_dst) = reads(staging);
    let src: &[*const c_void] = unsafe { pointers(b.src, b.num_buffers, read_src, "buffers.src") }?;
    let dst: &[*mut c_void] = unsafe { pointers(b.dst, b.num_buffers, read_dst, "buffers.dst") }?;
    let buffers = GroupBuffers {
        num_buffers: b.num_buffers,
        src: as_byte_pointers(src),
        dst: as_mut_byte_pointers(dst),
        src_capacity: b.src_capacity,
        dst_capacity: b.dst_capacity,
    };
    Ok((config, (staging, raw.first_token, request, buffers)))
}

/// The groups of a C array.
///
/// # Safety
/// `groups` NULL or valid for `num_groups` entries, each as documented on MoriTpGroup.
unsafe fn groups_from_raw<'a>(
    groups: *const MoriTpGroup,
    num_groups: usize,
    reads: Reads,
) -> Result<RawGroups<'a>> {
    // SAFETY: valid or NULL per the caller; NULL with a length is refused.
    let raw = unsafe { try_slice(groups, num_groups, "groups") }?;
    let mut out = RawGroups {
        configs: Vec::with_capacity(raw.len()),
        rest: Vec::with_capacity(raw.len()),
    };
    for (index, group) in raw.iter().enumerate() {
        // SAFETY: forwarded from the caller.
        let (config, rest) =
            unsafe { group_from_raw(group, reads) }.map_err(|f| f.in_group(index))?;
        out.configs.push(config);
        out.rest.push(rest);
    }
    Ok(out)
}

/// Validates a request of several groups and says where each group sits in it: its range in
/// the request's segment list (mori_tp_groups_segments), the bytes each of its buffers moves,
/// and where its part starts in each side's staging region; and, for the whole request, the
/// segments, bytes and staging bytes per side. Both ranks get the same answer from the same
/// groups (the decode rank sizes its staging slot with total->dst_staging_bytes).
///
/// Each group is checked as the mori_tp_pair_* functions check a pair config and a request
/// (its config derived again from its layouts, its page counts, every page index), its
/// staging value, its reserved field, and its first_token against both page sizes. Only
/// buffers.num_buffers is read from its buffers.
///
/// The staging regions: on each side, the groups that stage it (SRC or BOTH for the prefill
/// side, DST or BOTH for the decode side) each own num_buffers * staging_len bytes, back to
/// back in group order; group g's buffer b is at src_staging_offset + b * staging_len (or
/// dst_staging_offset) of the request's region, laid out as mori_tp_pair_segments documents
/// the region of the group's mode. A group that does not stage a side has offset 0 there and
/// takes no bytes.
///
/// @param[in]  groups      num_groups groups. NULL only if num_groups = 0 (an empty request:
///                         every count 0).
/// @param[in]  num_groups  Groups in the request.
/// @param[out] out         num_groups entries, one per group in order; written only on
///                         MORI_OK. NULL only if num_groups = 0.
/// @param[out] total       Receives the request's totals; written only on MORI_OK. Must not be
///                         NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if total is NULL, groups or out is NULL with num_groups > 0, or a
///   group's page array is NULL with a non-zero count;
///   MORI_ERR_INVALID_ARGUMENT for a group whose config was edited or whose reserved is not 0,
///   an unknown staging value, page counts other than ceil(num_tokens / page_size), a
///   first_token that is not a multiple of both page sizes (the message names both and the
///   start rounded down), a misaligned pointer, or a count that overflows 64 bits;
///   MORI_ERR_TOPOLOGY, MORI_ERR_LAYOUT_MISMATCH for a group's invalid layout;
///   MORI_ERR_OUT_OF_BOUNDS for a negative page index, a page whose end overflows 64 bits or,
///   with heads outside pages, a page past its head's run;
///   MORI_ERR_PANIC on an internal error.
///   The message of a refusal that concerns one group names it after the status's words:
///   "mori_tp_groups_info: invalid argument: group 2: ...".
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_groups_info(
    groups: *const MoriTpGroup,
    num_groups: usize,
    out: *mut MoriTpGroupInfo,
    total: *mut MoriTpGroupsTotal,
) -> MoriStatus {
    ffi_boundary! {
        check_out(total, "total")?;
        // SAFETY (every block below): the caller's pointers, as documented above.
        let slots = unsafe { try_out_slice(out, num_groups, "out") }?;
        let raw = unsafe { groups_from_raw(groups, num_groups, READS_NONE) }?;
        let groups = raw.groups();
        let plan = GroupsPlan::new(&groups)?;
        for (slot, info) in slots.iter_mut().zip(plan.infos()) {
            slot.write(*info);
        }
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { total.write(plan.total()) };
        Ok(())
    }
}

/// The transport's segments of a request of several groups: each group's segments (those of
/// mori_tp_pair_segments for its config, request and staging mode), group after group, in
/// one array. Group g's are entries [first_segment, first_segment + num_segments) of its
/// MoriTpGroupInfo (mori_tp_groups_info). Their offsets are relative to each of the group's
/// buffers' bases: on an unstaged side, the buffer (buffers.src[b] or buffers.dst[b]); on a
/// staged side, region + the group's staging offset + b * staging_len of that rank's staging
/// region for the request. A transfer engine applies group g's segments to each of its
/// buffers; one write of all of them is the whole request.
///
/// The list is one array with per-group ranges, rather than one array per group, so that a
/// request is one size query and one allocation whatever its groups, as for every other plan
/// function, and an engine that writes the whole request in one call gets it in one piece.
///
/// @param[in]  groups      num_groups groups (only buffers.num_buffers is read of their
///                         buffers). NULL only if num_groups = 0.
/// @param[in]  num_groups  Groups in the request.
/// @param[out] out         Array of capacity segments; NULL only if capacity = 0. Written only
///                         on MORI_OK. May be uninitialised memory.
/// @param[in]  capacity    Entries out can hold.
/// @param[out] out_len     Receives the number of segments (total->num_segments), on MORI_OK
///                         and on MORI_ERR_BUFFER_TOO_SMALL. Must not be NULL.
///
/// @return MORI_OK; the codes of mori_tp_groups_info, and MORI_ERR_BUFFER_TOO_SMALL if
///   capacity < *out_len (nothing written to out; out = NULL with capacity = 0 is the size
///   query).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_groups_segments(
    groups: *const MoriTpGroup,
    num_groups: usize,
    out: *mut MoriSegment,
    capacity: usize,
    out_len: *mut usize,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_len, "out_len")?;
        // SAFETY (both blocks): the caller's pointers, as documented above.
        let raw = unsafe { groups_from_raw(groups, num_groups, READS_NONE) }?;
        let groups = raw.groups();
        let plan = GroupsPlan::new(&groups)?;
        let needed = plan.num_segments()?;
        unsafe {
            write_plan(needed, out, capacity, out_len, |slots| {
                plan.fill_segments(slots, |segment| segment);
            })
        }
    }
}

/// Checks a request of several groups against the memory both ranks registered, before a
/// transfer engine gets its segments (an engine copies whatever it is given): each group as
/// mori_tp_groups_info checks it; every page of every group, staged side or not, ends within
/// that side's buffers.src_capacity or buffers.dst_capacity (p * page_stride + extent); and
/// each rank's staging region for the request holds the bytes of the groups that stage its
/// side (total->src_staging_bytes, total->dst_staging_bytes).
///
/// @param[in] groups                num_groups groups (pointer arrays not read). NULL only if
///                                  num_groups = 0.
/// @param[in] num_groups            Groups in the request.
/// @param[in] src_staging_capacity  Bytes of the prefill rank's staging region (or slot) for
///                                  the request.
/// @param[in] dst_staging_capacity  Bytes of the decode rank's.
///
/// @return MORI_OK; the codes of mori_tp_groups_info;
///   MORI_ERR_OUT_OF_BOUNDS for a page that ends past its side's capacity (the message names
///   the group, the page, its position and both numbers);
///   MORI_ERR_BUFFER_TOO_SMALL if a staging capacity is below what the request's groups need
///   on that side (the message names the side and both numbers).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_check_groups_transfer(
    groups: *const MoriTpGroup,
    num_groups: usize,
    src_staging_capacity: u64,
    dst_staging_capacity: u64,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY: the caller's pointers, as documented above.
        let raw = unsafe { groups_from_raw(groups, num_groups, READS_NONE) }?;
        let groups = raw.groups();
        GroupsPlan::new(&groups)?.check_transfer(src_staging_capacity, dst_staging_capacity)?;
        Ok(())
    }
}

/// Copies every group of a request page to page, whatever its staging mode: for each group,
/// what mori_tp_pair_send moves for its config, buffers and request. Every group (config,
/// request, first_token, buffers against pages, NULLs, options) is checked before the first
/// byte moves, so a refused call writes nothing; then the groups are copied in order, each as
/// mori_tp_pair_send copies a pair (one kernel launch per group that moves bytes, or per
/// (buffer, rect) hipMemcpy2DAsync, as the flags and each group choose; MORI_SEND_SYNCHRONIZE
/// waits before the call returns).
///
/// @param[in] groups      num_groups groups; buffers.src and buffers.dst of each must hold
///                        buffers.num_buffers non-NULL pointers (both NULL only if
///                        num_buffers = 0). NULL only if num_groups = 0.
/// @param[in] num_groups  Groups in the request.
/// @param[in] options     Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return MORI_OK; the codes of mori_tp_groups_info and of mori_tp_pair_send (a
///   group's buffer array NULL with num_buffers > 0 or an entry NULL: MORI_ERR_NULL_POINTER;
///   a page past its capacity: MORI_ERR_OUT_OF_BOUNDS; MORI_ERR_BACKEND_UNAVAILABLE;
///   MORI_ERR_GPU), each naming the group.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_groups_send(
    groups: *const MoriTpGroup,
    num_groups: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let options = unsafe { options_from_raw(options) }?;
        let raw = unsafe { groups_from_raw(groups, num_groups, |_| (true, true)) }?;
        let groups = raw.groups();
        let plan = GroupsPlan::new(&groups)?;
        Ok(with_send_jobs(&plan, run_group_jobs(&options))?)
    }
}

/// The last step of a send, pack or unpack of groups whose jobs are valid: open the backend
/// `options` asks for and run every job on it, group after group.
fn run_group_jobs(
    options: &SendOptions,
) -> impl FnOnce(&[(usize, CopyJob<'_>)]) -> crate::error::Result<()> + '_ {
    move |jobs| {
        let mut engine = open_engine(options)?;
        // SAFETY: the exported function's caller vouches for the buffers and the region, as
        // its header documents; every job checked its rects against them.
        unsafe { run_jobs(jobs, engine.as_mut()) }.map(|_| ())
    }
}

/// Prefill side of a staged request of several groups: packs every group whose staging is
/// SRC or BOTH into its part of the request's staging region (group g's buffer b at
/// src_staging_offset + b * staging_len, see mori_tp_groups_info), in the region order of the
/// group's mode, as mori_tp_pair_pack packs a pair. Groups that stage nothing on this side
/// are validated and skipped; their pointer arrays are not read. Call it before the transport
/// writes the segments of mori_tp_groups_segments.
///
/// Everything is checked before the first byte moves: every group; staging_capacity >=
/// total->src_staging_bytes (MORI_ERR_BUFFER_TOO_SMALL naming both); the region's used bytes
/// overlap no packed group's source buffer; backends, stream and flags as for
/// mori_tp_pair_pack (with the kernel, one launch per packed group).
///
/// @param[in]  groups            num_groups groups; buffers.src of each packed group holds
///                               buffers.num_buffers non-NULL pointers. NULL only if
///                               num_groups = 0.
/// @param[in]  num_groups        Groups in the request.
/// @param[out] staging           The prefill rank's staging region for the request (a pool
///                               slot). NULL only if staging_capacity is 0.
/// @param[in]  staging_capacity  Bytes of the region.
/// @param[in]  options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return MORI_OK; the codes of mori_tp_groups_info and of mori_tp_pair_pack, each
///   naming the group it concerns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_groups_pack(
    groups: *const MoriTpGroup,
    num_groups: usize,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let options = unsafe { options_from_raw(options) }?;
        let reads: Reads = |staging| (staging.stages_src(), false);
        let raw = unsafe { groups_from_raw(groups, num_groups, reads) }?;
        let groups = raw.groups();
        let plan = GroupsPlan::new(&groups)?;
        Ok(with_pack_jobs(&plan, staging.cast(), staging_capacity, run_group_jobs(&options))?)
    }
}

/// Decode side of a staged request of several groups: once the transport has written every
/// segment of mori_tp_groups_segments, unpacks every group whose staging is DST or BOTH from
/// its part of the request's staging region (group g's buffer b at dst_staging_offset + b *
/// staging_len) onto its pages, as mori_tp_pair_unpack unpacks a pair. Groups that stage
/// nothing on this side are validated and skipped; their pointer arrays are not read.
///
/// Checks, backends and flags as for mori_tp_groups_pack with the roles swapped:
/// staging_capacity >= total->dst_staging_bytes, no overlap with an unpacked group's
/// destination buffer.
///
/// @param[in] groups            num_groups groups; buffers.dst of each unpacked group holds
///                              buffers.num_buffers non-NULL pointers. NULL only if
///                              num_groups = 0.
/// @param[in] num_groups        Groups in the request.
/// @param[in] staging           The decode rank's staging region for the request. NULL only if
///                              staging_capacity is 0.
/// @param[in] staging_capacity  Bytes of the region.
/// @param[in] options           Backend, flags and stream; NULL = AUTO, no flags, NULL stream.
///
/// @return the codes of mori_tp_groups_pack, with dst in place of src.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_groups_unpack(
    groups: *const MoriTpGroup,
    num_groups: usize,
    staging: *const c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY (every block below): the caller's pointers, as documented above.
        let options = unsafe { options_from_raw(options) }?;
        let reads: Reads = |staging| (false, staging.stages_dst());
        let raw = unsafe { groups_from_raw(groups, num_groups, reads) }?;
        let groups = raw.groups();
        let plan = GroupsPlan::new(&groups)?;
        Ok(with_unpack_jobs(&plan, staging.cast(), staging_capacity, run_group_jobs(&options))?)
    }
}

/// The layers a prefill pipeline stage and a decode pipeline stage share, when the two engines
/// split the model's layers into pipeline stages differently (uneven splits included).
///
/// A partition lists the layers of each stage in order: {10, 12, 10} is layers 0-9 on stage 0,
/// 10-21 on stage 1, 22-31 on stage 2 (the lists vLLM's VLLM_PP_LAYER_PARTITION and SGLang's
/// SGLANG_PP_LAYER_PARTITION take). The stages share layers out->first_layer .. first_layer +
/// num_layers - 1; layer first_layer + i is local layer prefill_first_local + i of the prefill
/// stage (its index among that stage's layers, which is how the engine numbers its per-layer KV
/// buffers) and decode_first_local + i of the decode stage. Stages that share no layer give
/// num_layers 0. A prefill stage sends its layers to every decode stage it shares some with.
///
/// @param[in]  prefill_layers  prefill_stages layer counts, one per prefill stage.
/// @param[in]  prefill_stages  Prefill pipeline size (> 0).
/// @param[in]  decode_layers   decode_stages layer counts, one per decode stage.
/// @param[in]  decode_stages   Decode pipeline size (> 0).
/// @param[in]  prefill_stage   The prefill stage, < prefill_stages.
/// @param[in]  decode_stage    The decode stage, < decode_stages.
/// @param[out] out             Receives the shared layers; written only on MORI_OK. Must not
///                             be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if out is NULL, or a layer array is NULL with a non-zero count;
///   MORI_ERR_INVALID_ARGUMENT for an empty partition, a stage of 0 layers, partitions that hold
///   different numbers of layers, a stage out of range or more than 2^32 - 1 layers (the
///   message names the side, the partitions and the numbers), or a misaligned pointer;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pp_layers(
    prefill_layers: *const u32,
    prefill_stages: usize,
    decode_layers: *const u32,
    decode_stages: usize,
    prefill_stage: u32,
    decode_stage: u32,
    out: *mut MoriTpLayerRange,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out, "out")?;
        // SAFETY (every block below): the caller's pointers, as documented above.
        let prefill = unsafe { try_slice(prefill_layers, prefill_stages, "prefill_layers") }?;
        let decode = unsafe { try_slice(decode_layers, decode_stages, "decode_layers") }?;
        let range = shared_layers(prefill, decode, prefill_stage, decode_stage)?;
        unsafe { out.write(range) };
        Ok(())
    }
}
