//! A request of several groups: all the state one sequence carries between a prefill rank and
//! a decode rank, planned and moved as one request (REFERENCE.md section 15).
//!
//! A hybrid or quantized model keeps more than one kind of state per sequence: full-attention
//! KV pages, sliding-window KV pages (only those inside the window matter), a per-token record
//! every rank holds whole (DeepSeek V3.2's indexer cache), per-(token, head) scales, and
//! per-request state slots whose parts are sharded differently (a Mamba2 conv state's x, B and
//! C). Each is a *group*: its own pair config (two layouts of [`crate::layout`], so geometry,
//! page size, head count and head bytes may differ by group), its own page list (or, for a
//! state slot, the one slot index), its own staging mode and its own buffers. Nothing here is
//! new arithmetic: a group is a [`PairConfig`] and a [`Request`], and everything the pair
//! functions check and promise holds for each group unchanged. What this module adds is the
//! request around them: one validation of every group before anything moves, one segment list
//! (the groups' lists back to back, with each group's range), one staging region per side (the
//! groups' regions back to back), and send, pack and unpack of all groups in one call.
//!
//! A *state slot* is a group of one page: the request's page lists are the slot index on each
//! side, `page_stride` is the slot stride, and `offset` is where the part starts within the
//! slot, so the layout's bounds apply to it as to any page. A *sliding window* is a group whose
//! request covers only the window's tokens; its `first_token` (the window's first token in the
//! sequence) must be a multiple of both page sizes, so that the window's pages hold its tokens
//! from slot 0.

use std::borrow::Cow;

use crate::backend::{CopyEngine, CopyJob, KvBuffers, SendReport, check_capacity_fits};
use crate::error::{Error, Result, checked_product, checked_usize};
use crate::layout::{PairConfig, Request};
use crate::plan::{OutputEntry, PairPlan, Segment};
use crate::send::check_no_overlap;
use crate::types::{Side, Staging};

/// One group's page buffers on both ranks, as `MoriKvBuffers` carries them: `num_buffers`
/// buffers per rank, paired one to one, and the bytes in each. A function reads only the
/// pointers it copies through (send: both sides; pack: the prefill side of a group that stages
/// it; unpack: the decode side of a group that stages it); the others may be empty.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupBuffers<'a> {
    /// Buffers of the group on each rank.
    pub num_buffers: usize,
    /// The prefill rank's buffer bases: empty, or `num_buffers` of them.
    pub src: &'a [*const u8],
    /// The decode rank's buffer bases, in the same order: empty, or `num_buffers` of them.
    pub dst: &'a [*mut u8],
    /// Bytes in each prefill buffer: every prefill page must end within it.
    pub src_capacity: u64,
    /// Bytes in each decode buffer: every decode page must end within it.
    pub dst_capacity: u64,
}

/// One group of a request (`MoriTpGroup`).
#[derive(Clone, Copy, Debug)]
pub struct Group<'a> {
    /// The group's pair config (its two layouts).
    pub config: &'a PairConfig,
    /// How its bytes move through a transfer engine: the library's choice is
    /// [`crate::pair_staging_for`]; both ranks use the same.
    pub staging: Staging,
    /// Where the request's token 0 sits in the sequence: 0, or a sliding window's first token,
    /// which must be a multiple of both page sizes.
    pub first_token: u64,
    /// The group's tokens and pages (for a state slot: one token slot per state row, and the
    /// slot index on each side).
    pub request: Request<'a>,
    /// Its buffers.
    pub buffers: GroupBuffers<'a>,
}

impl<'a> Group<'a> {
    /// A group of `num_buffers` buffers per rank (pointers and capacities not given yet), with
    /// the library's staging choice for its pair and `first_token` 0.
    pub fn new(config: &'a PairConfig, request: Request<'a>, num_buffers: usize) -> Self {
        Group {
            config,
            staging: crate::plan::pair_staging_for(config),
            first_token: 0,
            request,
            buffers: GroupBuffers {
                num_buffers,
                ..GroupBuffers::default()
            },
        }
    }
}

/// Where one group sits in its request's plan (`MoriTpGroupInfo`). 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupInfo {
    /// Index of the group's first segment in the request's segment list.
    pub first_segment: u64,
    /// The group's segments, each applied to every one of its buffers.
    pub num_segments: u64,
    /// Bytes one of its buffers moves (and stages on a staged side): `num_tokens * n *
    /// head_bytes`, 0 unless its pair sends.
    pub staging_len: u64,
    /// Where its region starts in the prefill rank's staging region for the request (0 unless
    /// its staging is SRC or BOTH): buffer `b` at `src_staging_offset + b * staging_len`.
    pub src_staging_offset: u64,
    /// The same in the decode rank's staging region (0 unless DST or BOTH).
    pub dst_staging_offset: u64,
}

impl GroupInfo {
    /// Where its region starts in `side`'s staging region (a C struct: one field per side).
    pub fn staging_offset(&self, side: Side) -> u64 {
        match side {
            Side::Prefill => self.src_staging_offset,
            Side::Decode => self.dst_staging_offset,
        }
    }
}

/// What a whole request of groups needs (`MoriTpGroupsTotal`). 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupsTotal {
    /// Entries of the request's segment list: every group's segments.
    pub num_segments: u64,
    /// Segments a transfer engine copies: each group's segments times its buffers.
    pub transfer_segments: u64,
    /// Bytes the request moves: each group's `staging_len` times its buffers.
    pub bytes: u64,
    /// Bytes of the prefill rank's staging region for the request: the regions of the groups
    /// whose staging is SRC or BOTH, back to back in group order.
    pub src_staging_bytes: u64,
    /// The same on the decode rank (groups whose staging is DST or BOTH).
    pub dst_staging_bytes: u64,
}

impl GroupsTotal {
    /// Bytes of `side`'s staging region for the request (a C struct: one field per side).
    pub fn staging_bytes(&self, side: Side) -> u64 {
        match side {
            Side::Prefill => self.src_staging_bytes,
            Side::Decode => self.dst_staging_bytes,
        }
    }
}

/// The validated plan of a request of groups: each group's transfer plan (with its staging),
/// its range in the segment list and its place in each side's staging region. Building it
/// checked everything that does not depend on buffer pointers; refusals name the group.
#[derive(Clone, Debug)]
pub struct GroupsPlan<'a> {
    groups: Vec<Group<'a>>,
    plans: Vec<PairPlan<'a>>,
    infos: Vec<GroupInfo>,
    total: GroupsTotal,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Refuses a first token that is not on a page boundary of both sides.
fn check_first_token(group: &Group<'_>) -> Result<()> {
    let (src, dst) = (
        group.config.src().layout().page_size,
        group.config.dst().layout().page_size,
    );
    let (a, b) = (u64::from(src), u64::from(dst));
    let lcm = a / gcd(a, b) * b; // two u32 factors: fits in u64
    if group.first_token % lcm != 0 {
        return Err(Error::WindowNotOnPages {
            first_token: group.first_token,
            src_page_size: src,
            dst_page_size: dst,
            lcm,
            rounded: group.first_token - group.first_token % lcm,
        });
    }
    if group
        .first_token
        .checked_add(group.request.num_tokens)
        .is_none()
    {
        return Err(Error::SumOverflow {
            quantity: "first_token + num_tokens",
            lhs: group.first_token,
            rhs: group.request.num_tokens,
        });
    }
    Ok(())
}

fn sum(quantity: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or(Error::SumOverflow {
        quantity,
        lhs: a,
        rhs: b,
    })
}

impl<'a> GroupsPlan<'a> {
    /// Validates every group (its config, request, first token and staging) and lays out the
    /// request: segment ranges in group order, and each staged group's region after those of
    /// the groups before it that stage the same side. The first refusal names its group.
    pub fn new(groups: &[Group<'a>]) -> Result<Self> {
        let mut plans = Vec::with_capacity(groups.len());
        let mut infos = Vec::with_capacity(groups.len());
        let mut total = GroupsTotal::default();
        for (index, group) in groups.iter().enumerate() {
            let in_group = |error: Error| error.in_group(index);
            check_first_token(group).map_err(in_group)?;
            let plan = PairPlan::transfer(group.config, &group.request, group.staging)
                .map_err(in_group)?;
            let num_segments = plan.num_segments().map_err(in_group)? as u64;
            let staging_len = plan.bytes_per_buffer();
            let buffers = group.buffers.num_buffers as u64;
            let group_bytes = checked_product(
                "bytes of a group (num_buffers * staging_len)",
                buffers,
                staging_len,
            )
            .map_err(in_group)?;
            let group_segments = checked_product(
                "segments of a group (num_buffers * segments)",
                buffers,
                num_segments,
            )
            .map_err(in_group)?;
            let mut info = GroupInfo {
                first_segment: total.num_segments,
                num_segments,
                staging_len,
                ..GroupInfo::default()
            };
            total.num_segments = sum("segments of the request", total.num_segments, num_segments)
                .map_err(in_group)?;
            total.transfer_segments = sum(
                "segments of the transfer",
                total.transfer_segments,
                group_segments,
            )
            .map_err(in_group)?;
            total.bytes =
                sum("bytes of the request", total.bytes, group_bytes).map_err(in_group)?;
            if group.staging.stages_src() {
                info.src_staging_offset = total.src_staging_bytes;
                total.src_staging_bytes = sum(
                    "prefill staging bytes of the request",
                    total.src_staging_bytes,
                    group_bytes,
                )
                .map_err(in_group)?;
            }
            if group.staging.stages_dst() {
                info.dst_staging_offset = total.dst_staging_bytes;
                total.dst_staging_bytes = sum(
                    "decode staging bytes of the request",
                    total.dst_staging_bytes,
                    group_bytes,
                )
                .map_err(in_group)?;
            }
            plans.push(plan);
            infos.push(info);
        }
        Ok(GroupsPlan {
            groups: groups.to_vec(),
            plans,
            infos,
            total,
        })
    }

    /// The groups, as given.
    pub fn groups(&self) -> &[Group<'a>] {
        &self.groups
    }

    /// Each group's place in the request, in group order.
    pub fn infos(&self) -> &[GroupInfo] {
        &self.infos
    }

    /// What the whole request needs.
    pub fn total(&self) -> GroupsTotal {
        self.total
    }

    /// Each group's transfer plan (its staging applied), in group order.
    pub fn plans(&self) -> &[PairPlan<'a>] {
        &self.plans
    }

    /// Entries of the request's segment list.
    pub fn num_segments(&self) -> Result<usize> {
        checked_usize("segments as usize", self.total.num_segments)
    }

    /// Writes every group's segments, group after group, into the front of `out`; returns how
    /// many it wrote. Group `g`'s segments are entries `first_segment .. first_segment +
    /// num_segments` of its [`GroupInfo`]; their offsets are relative to each of its buffers'
    /// bases (a staged side's base is the request's region + the group's staging offset +
    /// `b * staging_len`). `out` may be uninitialised memory.
    ///
    /// # Panics
    /// If `out` is shorter than [`GroupsPlan::num_segments`].
    pub fn fill_segments<T, S: OutputEntry<T>>(
        &self,
        out: &mut [S],
        convert: impl Fn(Segment) -> T,
    ) -> usize {
        let mut written = 0;
        for plan in &self.plans {
            written += plan.fill_segments(&mut out[written..], &convert);
        }
        written
    }

    /// The request's segments, collected.
    pub fn segments(&self) -> Result<Vec<Segment>> {
        let mut out = vec![Segment::default(); self.num_segments()?];
        self.fill_segments(&mut out, |segment| segment);
        Ok(out)
    }

    /// Checks the request against the memory both ranks registered, before a transfer engine
    /// gets its segments: every page of every group (staged side or not) ends within that
    /// side's buffer capacity, and each side's staging region holds the bytes of the groups
    /// that stage it.
    pub fn check_transfer(
        &self,
        src_staging_capacity: u64,
        dst_staging_capacity: u64,
    ) -> Result<()> {
        for (index, (group, plan)) in self.groups.iter().zip(&self.plans).enumerate() {
            // The pages' bounds as the plan checked them: its request, staged sides or not.
            for (side, capacity) in [
                (Side::Prefill, group.buffers.src_capacity),
                (Side::Decode, group.buffers.dst_capacity),
            ] {
                plan.request()
                    .check_capacity(side, capacity)
                    .map_err(|e| e.in_group(index))?;
            }
        }
        for (side, needed, capacity) in [
            (
                Side::Prefill,
                self.total.src_staging_bytes,
                src_staging_capacity,
            ),
            (
                Side::Decode,
                self.total.dst_staging_bytes,
                dst_staging_capacity,
            ),
        ] {
            if capacity < needed {
                return Err(Error::GroupsStagingTooSmall {
                    side,
                    needed,
                    capacity,
                });
            }
        }
        Ok(())
    }
}

/// A side's pointers of a group, checked against its `num_buffers`.
fn side_pointers<P: Copy>(side: Side, pointers: &[P], num_buffers: usize) -> Result<&[P]> {
    if pointers.len() == num_buffers {
        return Ok(pointers);
    }
    if pointers.is_empty() {
        return Err(Error::GroupBuffersMissing { side, num_buffers });
    }
    Err(Error::GroupBufferCount {
        side,
        given: pointers.len(),
        expected: num_buffers,
    })
}

/// One job's inputs, owned here so that every job of a call exists before the first runs.
struct JobParts<'p, 'a> {
    group: usize,
    /// The transfer plan of a [`GroupsPlan`], or one made for the call.
    plan: Cow<'p, PairPlan<'a>>,
    src: Vec<*const u8>,
    dst: Vec<*mut u8>,
    src_capacity: u64,
    dst_capacity: u64,
}

/// Builds every job of a call from its parts (each checked against its buffers), then hands
/// them to `run`: nothing runs unless every group is valid.
fn with_jobs<R>(
    parts: &[JobParts<'_, '_>],
    run: impl FnOnce(&[(usize, CopyJob<'_>)]) -> Result<R>,
) -> Result<R> {
    let mut jobs = Vec::with_capacity(parts.len());
    for part in parts {
        let buffers = KvBuffers {
            src: &part.src,
            dst: &part.dst,
            src_capacity: part.src_capacity,
            dst_capacity: part.dst_capacity,
        };
        let job = CopyJob::new(part.plan.walk(), &buffers).map_err(|e| e.in_group(part.group))?;
        jobs.push((part.group, job));
    }
    run(&jobs)
}

/// Runs validated jobs in group order on `engine`.
///
/// # Safety
/// Every job's pointers valid for their capacities in the memory `engine` reaches, until it
/// has finished.
pub(crate) unsafe fn run_jobs(
    jobs: &[(usize, CopyJob<'_>)],
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    let mut report = SendReport::default();
    for (group, job) in jobs {
        // SAFETY: forwarded from the caller; each job checked its rects against its buffers.
        let done = unsafe { job.run(engine) }.map_err(|e| e.in_group(*group))?;
        report.copies += done.copies;
        report.bytes += done.bytes;
    }
    Ok(report)
}

/// Validates a send of every group page to page and hands its jobs to `run`.
pub(crate) fn with_send_jobs<R>(
    plan: &GroupsPlan<'_>,
    run: impl FnOnce(&[(usize, CopyJob<'_>)]) -> Result<R>,
) -> Result<R> {
    let mut parts = Vec::with_capacity(plan.groups.len());
    for (index, group) in plan.groups.iter().enumerate() {
        let in_group = |error: Error| error.in_group(index);
        let b = &group.buffers;
        let src = side_pointers(Side::Prefill, b.src, b.num_buffers).map_err(in_group)?;
        let dst = side_pointers(Side::Decode, b.dst, b.num_buffers).map_err(in_group)?;
        let direct = if group.staging == Staging::None {
            Cow::Borrowed(&plan.plans[index])
        } else {
            Cow::Owned(
                PairPlan::transfer(group.config, &group.request, Staging::None)
                    .map_err(in_group)?,
            )
        };
        parts.push(JobParts {
            group: index,
            plan: direct,
            src: src.to_vec(),
            dst: dst.to_vec(),
            src_capacity: b.src_capacity,
            dst_capacity: b.dst_capacity,
        });
    }
    with_jobs(&parts, run)
}

/// Copies every group of a request page to page (the pair send for each group, whatever
/// its staging mode): every moved head of every token of every buffer. Every group's buffers
/// are checked against its pages before the first byte moves, so a refused call writes
/// nothing; the copies then run group after group. Groups may share buffers (the parts of one
/// state slot): each writes only its own elements.
///
/// # Safety
/// Each group's `buffers.src[i]` must be readable for `src_capacity` bytes and each
/// `buffers.dst[i]` writable for `dst_capacity` bytes, in the memory space `engine` addresses,
/// until the engine has finished; no destination byte a group writes may be a source byte of
/// the call.
pub unsafe fn send_groups(
    plan: &GroupsPlan<'_>,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    // SAFETY: forwarded from the caller.
    with_send_jobs(plan, |jobs| unsafe { run_jobs(jobs, engine) })
}

/// Checks a request's staging region on `side` and returns its base, which is never NULL
/// (a NULL region of capacity 0 is the empty region, fine when no group stages the side).
fn check_region(
    plan: &GroupsPlan<'_>,
    side: Side,
    region: *mut u8,
    capacity: u64,
) -> Result<*mut u8> {
    check_capacity_fits("staging_capacity", capacity)?;
    if region.is_null() && capacity != 0 {
        return Err(Error::NullStaging { capacity });
    }
    let needed = plan.total.staging_bytes(side);
    if capacity < needed {
        return Err(Error::GroupsStagingTooSmall {
            side,
            needed,
            capacity,
        });
    }
    Ok(if region.is_null() {
        std::ptr::NonNull::dangling().as_ptr()
    } else {
        region
    })
}

/// The bases of group `index`'s buffers in the region of `side`.
fn region_bases(plan: &GroupsPlan<'_>, side: Side, index: usize, region: *mut u8) -> Vec<*mut u8> {
    let info = &plan.infos[index];
    let offset = info.staging_offset(side);
    // wrapping_add: the region may be device memory; every offset is below the region's
    // capacity, checked to fit in isize.
    (0..plan.groups[index].buffers.num_buffers)
        .map(|b| region.wrapping_add((offset + b as u64 * info.staging_len) as usize))
        .collect()
}

/// Prefill side of a staged request: packs every group whose staging is SRC or BOTH into its
/// part of the request's staging region (group `g`'s buffer `b` at `src_staging_offset +
/// b * staging_len`, in the region order of the group's mode). Groups that do not stage the
/// prefill side are validated and skipped, and their pointers are not read. Everything is
/// checked before the first byte moves.
///
/// # Safety
/// Each packed group's `buffers.src[i]` readable for `src_capacity` bytes and `staging`
/// writable for `staging_capacity` bytes, in the memory `engine` addresses, until it finishes.
pub unsafe fn pack_groups(
    plan: &GroupsPlan<'_>,
    staging: *mut u8,
    staging_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    // SAFETY: forwarded from the caller; each group's part lies inside the region (checked).
    with_pack_jobs(plan, staging, staging_capacity, |jobs| unsafe {
        run_jobs(jobs, engine)
    })
}

/// Validates a pack of every group that stages the prefill side and hands its jobs to `run`.
pub(crate) fn with_pack_jobs<R>(
    plan: &GroupsPlan<'_>,
    staging: *mut u8,
    staging_capacity: u64,
    run: impl FnOnce(&[(usize, CopyJob<'_>)]) -> Result<R>,
) -> Result<R> {
    let parts = staged_parts(plan, Side::Prefill, staging, staging_capacity)?;
    with_jobs(&parts, run)
}

/// The jobs of a pack (`side` prefill: pages into the region) or an unpack (decode: the
/// region into pages) of every group that stages `side`, each checked against the region.
fn staged_parts<'p, 'a>(
    plan: &'p GroupsPlan<'a>,
    side: Side,
    staging: *mut u8,
    staging_capacity: u64,
) -> Result<Vec<JobParts<'p, 'a>>> {
    let region = check_region(plan, side, staging, staging_capacity)?;
    let used = plan.total.staging_bytes(side);
    let mut parts = Vec::new();
    for (index, group) in plan.groups.iter().enumerate() {
        if !group.staging.stages(side) {
            continue;
        }
        let in_group = |error: Error| error.in_group(index);
        let (b, info) = (&group.buffers, &plan.infos[index]);
        let src = side_pointers(Side::Prefill, b.src, b.num_buffers);
        let dst = side_pointers(Side::Decode, b.dst, b.num_buffers);
        // The staged side's page buffers, which the region must not overlap.
        let (pages, capacity): (Vec<*const u8>, u64) = match side {
            Side::Prefill => (src.map_err(in_group)?.to_vec(), b.src_capacity),
            Side::Decode => (
                dst.map_err(in_group)?
                    .iter()
                    .map(|&p| p.cast_const())
                    .collect(),
                b.dst_capacity,
            ),
        };
        if !staging.is_null() && crate::backend::first_null(&pages).is_none() {
            check_no_overlap(region, used, side, &pages, capacity).map_err(in_group)?;
        }
        let bases = region_bases(plan, side, index, region);
        let part = match side {
            Side::Prefill => JobParts {
                group: index,
                plan: Cow::Owned(
                    PairPlan::pack(group.config, group.staging, &group.request)
                        .map_err(in_group)?,
                ),
                src: pages,
                dst: bases,
                src_capacity: capacity,
                dst_capacity: info.staging_len,
            },
            Side::Decode => JobParts {
                group: index,
                plan: Cow::Owned(
                    PairPlan::unpack(group.config, group.staging, &group.request)
                        .map_err(in_group)?,
                ),
                src: bases.into_iter().map(<*mut u8>::cast_const).collect(),
                dst: b.dst.to_vec(),
                src_capacity: info.staging_len,
                dst_capacity: capacity,
            },
        };
        parts.push(part);
    }
    Ok(parts)
}

/// Decode side of a staged request: unpacks every group whose staging is DST or BOTH from its
/// part of the request's staging region into its pages, once the transport has written every
/// segment. Groups that do not stage the decode side are validated and skipped. Everything is
/// checked before the first byte moves.
///
/// # Safety
/// `staging` readable for `staging_capacity` bytes and each unpacked group's `buffers.dst[i]`
/// writable for `dst_capacity` bytes, in the memory `engine` addresses, until it finishes.
pub unsafe fn unpack_groups(
    plan: &GroupsPlan<'_>,
    staging: *const u8,
    staging_capacity: u64,
    engine: &mut dyn CopyEngine,
) -> Result<SendReport> {
    // SAFETY: forwarded from the caller; each group's part lies inside the region (checked).
    with_unpack_jobs(plan, staging, staging_capacity, |jobs| unsafe {
        run_jobs(jobs, engine)
    })
}

/// Validates an unpack of every group that stages the decode side and hands its jobs to `run`.
pub(crate) fn with_unpack_jobs<R>(
    plan: &GroupsPlan<'_>,
    staging: *const u8,
    staging_capacity: u64,
    run: impl FnOnce(&[(usize, CopyJob<'_>)]) -> Result<R>,
) -> Result<R> {
    let parts = staged_parts(plan, Side::Decode, staging.cast_mut(), staging_capacity)?;
    with_jobs(&parts, run)
}
