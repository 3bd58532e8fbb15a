//! A request of several groups through the C ABI, against an oracle that copies element by
//! element: every kind of group the reference documents (full-attention KV in HND pages,
//! sliding-window pages, DeepSeek V3.2's per-token indexer record in SGLang's page layout,
//! per-(token, head) scales inline and as their own buffers, a Mamba2 conv state slot of three
//! parts in vLLM's DS and SD layouts, an SSM state slot), in one request per (prefill rank,
//! decode rank) pair, over TP pairs whose ratio goes both ways and KV heads fewer than a TP
//! size. Checked: every destination byte (untouched ones included) after a direct send and
//! after pack, every group's segments applied to every one of its buffers at the offsets
//! mori_tp_groups_info gives, and unpack, in the library's staging modes, each mode forced on
//! every group and a random mix; the segment list against each group's own
//! mori_tp_pair_segments; the staging offsets against the documented rule.

mod common;

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};

use common::{moved_heads, owned_heads};
use mori_tp::ffi::*;
use mori_tp_testkit::{Rng, mix};

const HOST: MoriSendOptions = MoriSendOptions {
    backend: MORI_BACKEND_HOST,
    flags: 0,
    stream: null_mut(),
};

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

// ---- the kinds of group, laid out as the engines lay them out -------------------------------

/// One rank: its side's TP size and its rank.
#[derive(Clone, Copy, Debug)]
struct Rank {
    tp: u32,
    rank: u32,
}

fn nhd(h: u32, at: Rank, page_size: u32, head_bytes: u64) -> MoriTpLayout {
    let mut out = MoriTpLayout::default();
    // SAFETY: a valid out-pointer.
    let status = unsafe { mori_tp_layout_nhd(h, at.tp, at.rank, page_size, head_bytes, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

fn hnd(h: u32, at: Rank, page_size: u32, head_bytes: u64) -> MoriTpLayout {
    let mut out = MoriTpLayout::default();
    // SAFETY: a valid out-pointer.
    let status = unsafe { mori_tp_layout_hnd(h, at.tp, at.rank, page_size, head_bytes, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

/// DeepSeek V3.2's indexer cache as SGLang keeps it (`index_buf_accessor.py`): a page of
/// `page_size` tokens holds every token's 128 fp8 bytes first, then every token's 4-byte fp32
/// scale, 132 bytes per token, the same on every TP rank (H = 1). Two groups on one buffer:
/// the keys and the scales, each a per-token record of its own.
fn indexer_parts(at: Rank, page_size: u32) -> [MoriTpLayout; 2] {
    let (key, scale) = (128u64, 4u64);
    let ps = u64::from(page_size);
    let page_stride = ps * (key + scale);
    let part = |head_bytes: u64, offset: u64| MoriTpLayout {
        total_kv_heads: 1,
        tp_size: at.tp,
        tp_rank: at.rank,
        page_size,
        head_bytes,
        page_stride,
        offset,
        token_stride: head_bytes,
        head_stride: head_bytes,
    };
    [part(key, 0), part(scale, ps * key)]
}

/// A Mamba2 mixer's state, per vLLM (`vllm/model_executor/layers/mamba/mamba_utils.py`,
/// `mamba2_state_shape`): a conv state of `conv_dim / tp` channels by `state_len =
/// conv_kernel - 1` rows, where `conv_dim = n_heads * head_dim + 2 * n_groups * d_state`
/// (x, then B, then C), and an SSM state `(n_heads / tp, head_dim, d_state)`. x splits by heads;
/// B and C by groups, every rank holding the one group when `n_groups == 1` (vLLM's
/// `extra_groups_for_head_shards`; `mamba_mixer2.py` accepts no other split that TP does not
/// divide). Both live in one slot of a per-layer buffer, conv state first, the slot padded
/// (vLLM pads state pages to the attention page size): the strides are the caller's.
#[derive(Clone, Copy, Debug)]
struct Mamba {
    n_heads: u32,
    head_dim: u64,
    n_groups: u32,
    d_state: u64,
    state_len: u32,
    conv_dtype: u64,
    ssm_dtype: u64,
    /// vLLM's VLLM_SSM_CONV_STATE_LAYOUT=DS, (dim, state_len); else SD, (state_len, dim).
    dim_first: bool,
    slot_pad: u64,
}

impl Mamba {
    fn groups_local(&self, tp: u32) -> u64 {
        if self.n_groups % tp == 0 {
            u64::from(self.n_groups / tp)
        } else {
            assert_eq!(self.n_groups, 1, "vLLM replicates only a single group");
            1
        }
    }

    fn x_channels(&self, tp: u32) -> u64 {
        u64::from(self.n_heads / tp) * self.head_dim
    }

    fn conv_dim(&self, tp: u32) -> u64 {
        self.x_channels(tp) + 2 * self.groups_local(tp) * self.d_state
    }

    fn conv_bytes(&self, tp: u32) -> u64 {
        self.conv_dim(tp) * u64::from(self.state_len) * self.conv_dtype
    }

    fn ssm_bytes(&self, tp: u32) -> u64 {
        u64::from(self.n_heads / tp) * self.head_dim * self.d_state * self.ssm_dtype
    }

    fn slot_stride(&self, tp: u32) -> u64 {
        self.conv_bytes(tp) + self.ssm_bytes(tp) + self.slot_pad
    }

    /// Rows moved as token slots of the conv state's one page: state_len (SD) or 1 (DS).
    fn conv_rows(&self) -> u32 {
        if self.dim_first { 1 } else { self.state_len }
    }

    /// The x, B and C parts of rank `at`'s conv state, each a layout of one page per slot.
    fn conv_parts(&self, at: Rank) -> [MoriTpLayout; 3] {
        let slot = self.slot_stride(at.tp);
        let rows = u64::from(self.state_len);
        let dt = self.conv_dtype;
        let (x, g) = (
            self.x_channels(at.tp),
            self.groups_local(at.tp) * self.d_state,
        );
        let part = |units: u32, unit_channels: u64, first_channel: u64| {
            if self.dim_first {
                // A unit is unit_channels channels of rows values each, back to back.
                let head_bytes = unit_channels * rows * dt;
                MoriTpLayout {
                    total_kv_heads: units,
                    tp_size: at.tp,
                    tp_rank: at.rank,
                    page_size: 1,
                    head_bytes,
                    page_stride: slot,
                    offset: first_channel * rows * dt,
                    token_stride: head_bytes,
                    head_stride: head_bytes,
                }
            } else {
                // Row t holds every channel; a unit is unit_channels of them.
                let head_bytes = unit_channels * dt;
                MoriTpLayout {
                    total_kv_heads: units,
                    tp_size: at.tp,
                    tp_rank: at.rank,
                    page_size: self.state_len,
                    head_bytes,
                    page_stride: slot,
                    offset: first_channel * dt,
                    token_stride: self.conv_dim(at.tp) * dt,
                    head_stride: head_bytes,
                }
            }
        };
        [
            part(self.n_heads, self.head_dim, 0),
            part(self.n_groups, self.d_state, x),
            part(self.n_groups, self.d_state, x + g),
        ]
    }

    /// The SSM state of rank `at`: its heads, after the conv state in the slot.
    fn ssm_part(&self, at: Rank) -> MoriTpLayout {
        let head_bytes = self.head_dim * self.d_state * self.ssm_dtype;
        MoriTpLayout {
            total_kv_heads: self.n_heads,
            tp_size: at.tp,
            tp_rank: at.rank,
            page_size: 1,
            head_bytes,
            page_stride: self.slot_stride(at.tp),
            offset: self.conv_bytes(at.tp),
            token_stride: head_bytes,
            head_stride: head_bytes,
        }
    }
}

// ---- a request of groups, and the oracle ------------------------------------------------------

/// One group of a test request: its layouts, pages and tokens, and which buffers of which of
/// the ranks' buffer sets it uses (groups may share buffers).
#[derive(Clone, Debug)]
struct Spec {
    name: &'static str,
    src: MoriTpLayout,
    dst: MoriTpLayout,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
    tokens: u64,
    first_token: u64,
    set: usize,
    buffers: Vec<usize>,
}

/// A request: its groups and each side's buffer sets (every buffer of a set equally long).
struct Case {
    what: String,
    specs: Vec<Spec>,
    src_sets: Vec<Vec<Vec<u8>>>,
    dst_sets: Vec<Vec<Vec<u8>>>,
}

fn pattern(salt: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| mix(salt ^ (i as u64) << 8) as u8)
        .collect()
}

/// `count` distinct pages below `capacity`, in shuffled runs of 1 to 3.
fn pages(rng: &mut Rng, count: usize, capacity: usize) -> Vec<i32> {
    let all: Vec<i32> = (0..capacity as i32).collect();
    let mut runs: Vec<Vec<i32>> = all
        .chunks(rng.range(1, 3) as usize)
        .map(<[i32]>::to_vec)
        .collect();
    rng.shuffle(&mut runs);
    let mut out = runs.concat();
    out.truncate(count);
    out
}

/// Where element (slot, local head) of page `page` lies in a layout.
fn element(l: &MoriTpLayout, page: u64, slot: u64, local: u64) -> usize {
    (page * l.page_stride + l.offset + slot * l.token_stride + local * l.head_stride) as usize
}

/// The oracle: every moved head of every token of every buffer of every group, one by one.
fn oracle(case: &Case) -> Vec<Vec<Vec<u8>>> {
    let mut dst = case.dst_sets.clone();
    for spec in &case.specs {
        let (s, d) = (&spec.src, &spec.dst);
        let h = s.total_kv_heads;
        let Some(moved) = moved_heads(h, s.tp_size, s.tp_rank, d.tp_size, d.tp_rank) else {
            continue;
        };
        let src_first = u64::from(moved.start - owned_heads(h, s.tp_size, s.tp_rank).start);
        let dst_first = u64::from(moved.start - owned_heads(h, d.tp_size, d.tp_rank).start);
        let hb = s.head_bytes as usize;
        let (sp, dp) = (u64::from(s.page_size), u64::from(d.page_size));
        for &b in &spec.buffers {
            for k in 0..spec.tokens {
                for j in 0..moved.len() as u64 {
                    let from = element(
                        s,
                        spec.src_pages[(k / sp) as usize] as u64,
                        k % sp,
                        src_first + j,
                    );
                    let to = element(
                        d,
                        spec.dst_pages[(k / dp) as usize] as u64,
                        k % dp,
                        dst_first + j,
                    );
                    let bytes = &case.src_sets[spec.set][b][from..from + hb];
                    dst[spec.set][b][to..to + hb].copy_from_slice(bytes);
                }
            }
        }
    }
    dst
}

fn pair_config(src: &MoriTpLayout, dst: &MoriTpLayout) -> MoriTpPairConfig {
    let mut out = MoriTpPairConfig::default();
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_config(src, dst, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

fn staging_for(config: &MoriTpPairConfig) -> u32 {
    let mut out = u32::MAX;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_staging_for(config, &mut out) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

/// The C groups of a case, and the pointer arrays they point into (kept alive with them).
struct CGroups {
    groups: Vec<MoriTpGroup>,
    _pointers: Vec<(Vec<*const c_void>, Vec<*mut c_void>)>,
}

impl CGroups {
    /// `staging(g, config)`: group g's staging mode. The pointers are those of `src` and `dst`.
    fn new(
        case: &Case,
        src: &[Vec<Vec<u8>>],
        dst: &mut [Vec<Vec<u8>>],
        staging: &dyn Fn(usize, &MoriTpPairConfig) -> u32,
    ) -> CGroups {
        let mut groups = Vec::new();
        let mut pointers = Vec::new();
        for (g, spec) in case.specs.iter().enumerate() {
            let config = pair_config(&spec.src, &spec.dst);
            let s: Vec<*const c_void> = spec
                .buffers
                .iter()
                .map(|&b| src[spec.set][b].as_ptr().cast())
                .collect();
            let d: Vec<*mut c_void> = spec
                .buffers
                .iter()
                .map(|&b| dst[spec.set][b].as_mut_ptr().cast())
                .collect();
            groups.push(MoriTpGroup {
                config,
                staging: staging(g, &config),
                reserved: 0,
                first_token: spec.first_token,
                request: MoriTpRequest {
                    src_pages: spec.src_pages.as_ptr(),
                    num_src_pages: spec.src_pages.len(),
                    dst_pages: spec.dst_pages.as_ptr(),
                    num_dst_pages: spec.dst_pages.len(),
                    num_tokens: spec.tokens,
                },
                buffers: MoriKvBuffers {
                    src: s.as_ptr(),
                    dst: d.as_ptr(),
                    num_buffers: spec.buffers.len(),
                    src_capacity: src[spec.set][0].len() as u64,
                    dst_capacity: dst[spec.set][0].len() as u64,
                },
            });
            pointers.push((s, d));
        }
        CGroups {
            groups,
            _pointers: pointers,
        }
    }
}

fn info(groups: &[MoriTpGroup]) -> (Vec<MoriTpGroupInfo>, MoriTpGroupsTotal) {
    let mut out = vec![MoriTpGroupInfo::default(); groups.len()];
    let mut total = MoriTpGroupsTotal::default();
    // SAFETY: arrays of groups.len() entries.
    let status =
        unsafe { mori_tp_groups_info(groups.as_ptr(), groups.len(), out.as_mut_ptr(), &mut total) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    (out, total)
}

fn segments(groups: &[MoriTpGroup]) -> Vec<MoriSegment> {
    let mut needed = 0;
    // SAFETY: a size query.
    let status = unsafe {
        mori_tp_groups_segments(groups.as_ptr(), groups.len(), null_mut(), 0, &mut needed)
    };
    assert!(
        status == MORI_OK || status == MORI_ERR_BUFFER_TOO_SMALL,
        "{}",
        last_error()
    );
    let mut out = vec![MoriSegment::default(); needed];
    let mut written = 0;
    // SAFETY: an array of `needed` entries.
    let status = unsafe {
        mori_tp_groups_segments(
            groups.as_ptr(),
            groups.len(),
            out.as_mut_ptr(),
            needed,
            &mut written,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
    assert_eq!(written, needed);
    out
}

fn pair_segments(group: &MoriTpGroup) -> Vec<MoriSegment> {
    let mut needed = 0;
    // SAFETY: a size query, then an array of `needed` entries.
    unsafe {
        mori_tp_pair_segments(
            &group.config,
            &group.request,
            group.staging,
            null_mut(),
            0,
            &mut needed,
        )
    };
    let mut out = vec![MoriSegment::default(); needed];
    let status = unsafe {
        mori_tp_pair_segments(
            &group.config,
            &group.request,
            group.staging,
            out.as_mut_ptr(),
            needed,
            &mut needed,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());
    out
}

fn staged_src(mode: u32) -> bool {
    mode == MORI_TP_STAGING_SRC || mode == MORI_TP_STAGING_BOTH
}

fn staged_dst(mode: u32) -> bool {
    mode == MORI_TP_STAGING_DST || mode == MORI_TP_STAGING_BOTH
}

/// One request of `case` with the modes `staging` chooses: a direct send, then pack, every
/// group's segments on every buffer, and unpack; both against the oracle, byte for byte.
/// Returns the bytes each group moved, by its name.
fn check_request(
    case: &Case,
    label: &str,
    staging: &dyn Fn(usize, &MoriTpPairConfig) -> u32,
) -> Vec<(&'static str, u64)> {
    let what = format!("{} ({label})", case.what);
    let want = oracle(case);

    // A direct send of every group.
    let mut dst = case.dst_sets.clone();
    let c = CGroups::new(case, &case.src_sets, &mut dst, staging);
    // SAFETY: every group's buffers are live vectors of the stated capacities.
    let status = unsafe { mori_tp_groups_send(c.groups.as_ptr(), c.groups.len(), &HOST) };
    assert_eq!(status, MORI_OK, "{what}: {}", last_error());
    assert!(
        dst == want,
        "{what}: the direct send differs from the oracle"
    );

    // Where each group sits: its segments are its own pair's, its regions back to back.
    let (infos, total) = info(&c.groups);
    let all = segments(&c.groups);
    let (mut first, mut src_off, mut dst_off) = (0u64, 0u64, 0u64);
    let (mut transfer, mut bytes) = (0u64, 0u64);
    for (g, (group, info)) in c.groups.iter().zip(&infos).enumerate() {
        let own = pair_segments(group);
        let range = info.first_segment as usize..(info.first_segment + info.num_segments) as usize;
        assert_eq!(info.first_segment, first, "{what}: group {g}");
        assert_eq!(&all[range], &own[..], "{what}: group {g}'s segments");
        let mut len = 0;
        // SAFETY: valid pointers.
        unsafe { mori_tp_pair_staging_len(&group.config, group.request.num_tokens, &mut len) };
        assert_eq!(info.staging_len, len, "{what}: group {g}");
        let group_bytes = len * group.buffers.num_buffers as u64;
        let expect_src = if staged_src(group.staging) {
            src_off
        } else {
            0
        };
        let expect_dst = if staged_dst(group.staging) {
            dst_off
        } else {
            0
        };
        assert_eq!(
            (info.src_staging_offset, info.dst_staging_offset),
            (expect_src, expect_dst),
            "{what}: group {g}'s staging offsets"
        );
        src_off += if staged_src(group.staging) {
            group_bytes
        } else {
            0
        };
        dst_off += if staged_dst(group.staging) {
            group_bytes
        } else {
            0
        };
        first += info.num_segments;
        transfer += info.num_segments * group.buffers.num_buffers as u64;
        bytes += group_bytes;
    }
    assert_eq!(
        total,
        MoriTpGroupsTotal {
            num_segments: first,
            transfer_segments: transfer,
            bytes,
            src_staging_bytes: src_off,
            dst_staging_bytes: dst_off,
        },
        "{what}"
    );
    // SAFETY: valid pointers.
    let checked = unsafe {
        mori_tp_check_groups_transfer(c.groups.as_ptr(), c.groups.len(), src_off, dst_off)
    };
    assert_eq!(checked, MORI_OK, "{what}: {}", last_error());

    // Pack, the transport (each group's segments on each of its buffers), unpack.
    let mut dst = case.dst_sets.clone();
    let c = CGroups::new(case, &case.src_sets, &mut dst, staging);
    let mut src_region = vec![0u8; src_off as usize];
    let mut dst_region = vec![0u8; dst_off as usize];
    // SAFETY: the region holds total.src_staging_bytes; the buffers are live.
    let status = unsafe {
        mori_tp_groups_pack(
            c.groups.as_ptr(),
            c.groups.len(),
            src_region.as_mut_ptr().cast(),
            src_off,
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{what}: {}", last_error());
    for (spec, (group, info)) in case.specs.iter().zip(c.groups.iter().zip(&infos)) {
        let range = info.first_segment as usize..(info.first_segment + info.num_segments) as usize;
        for (i, &b) in spec.buffers.iter().enumerate() {
            let i = i as u64;
            for s in &all[range.clone()] {
                let n = s.length as usize;
                let from = if staged_src(group.staging) {
                    let at =
                        (info.src_staging_offset + i * info.staging_len + s.src_offset) as usize;
                    src_region[at..at + n].to_vec()
                } else {
                    let at = s.src_offset as usize;
                    case.src_sets[spec.set][b][at..at + n].to_vec()
                };
                let to = if staged_dst(group.staging) {
                    let at =
                        (info.dst_staging_offset + i * info.staging_len + s.dst_offset) as usize;
                    &mut dst_region[at..at + n]
                } else {
                    let at = s.dst_offset as usize;
                    &mut dst[spec.set][b][at..at + n]
                };
                to.copy_from_slice(&from);
            }
        }
    }
    // SAFETY: as for the pack.
    let status = unsafe {
        mori_tp_groups_unpack(
            c.groups.as_ptr(),
            c.groups.len(),
            dst_region.as_ptr().cast(),
            dst_off,
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{what}: {}", last_error());
    if dst != want {
        let wrong: Vec<&str> = case
            .specs
            .iter()
            .filter(|spec| {
                spec.buffers
                    .iter()
                    .any(|&b| dst[spec.set][b] != want[spec.set][b])
            })
            .map(|spec| spec.name)
            .collect();
        panic!(
            "{what}: pack, segments and unpack differ from the oracle in the buffers of {wrong:?}"
        );
    }
    case.specs
        .iter()
        .zip(&infos)
        .map(|(spec, info)| (spec.name, info.staging_len * spec.buffers.len() as u64))
        .collect()
}

// ---- the hybrid model of these tests --------------------------------------------------------

/// A hybrid model: two full-attention layers and two sliding-window layers of `kv_heads` KV
/// heads, DeepSeek V3.2's indexer on two layers, two layers of fp8 KV with per-(token, head)
/// scales (inline in one, in their own buffers in the other), and two Mamba2 layers.
#[derive(Clone, Copy, Debug)]
struct Model {
    kv_heads: u32,
    mamba: Mamba,
    /// Page sizes of the KV groups on each side.
    page_sizes: (u32, u32),
    /// The indexer's page size on each side (SGLang: 64 on CUDA, 1 on ROCm).
    indexer_pages: (u32, u32),
    tokens: u64,
    window: u64,
}

const KV_HEAD_BYTES: u64 = 16;

/// The groups of pair (p, d) of `model` at TP `p_tp` -> `d_tp`, and both sides' buffer sets.
fn hybrid(model: &Model, p_tp: u32, p: u32, d_tp: u32, d: u32, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let at = [Rank { tp: p_tp, rank: p }, Rank { tp: d_tp, rank: d }];
    let mut specs = Vec::new();
    // Buffer sets: (buffers, bytes of each) per side.
    let mut shapes: Vec<(usize, [usize; 2])> = Vec::new();
    let ps = [model.page_sizes.0, model.page_sizes.1];
    let n = model.tokens;

    // Full attention, HND, K and V of two layers: every page of the sequence.
    let layouts = [
        hnd(model.kv_heads, at[0], ps[0], KV_HEAD_BYTES),
        hnd(model.kv_heads, at[1], ps[1], KV_HEAD_BYTES),
    ];
    let kv_group = |name: &'static str,
                    layouts: [MoriTpLayout; 2],
                    first_token: u64,
                    set: usize,
                    buffers: usize,
                    rng: &mut Rng,
                    shapes: &mut Vec<(usize, [usize; 2])>| {
        let tokens = n - first_token;
        let counts = [0, 1].map(|s| tokens.div_ceil(u64::from(layouts[s].page_size)));
        let caps = counts.map(|count| count as usize + 3);
        let src_pages = pages(rng, counts[0] as usize, caps[0]);
        let dst_pages = pages(rng, counts[1] as usize, caps[1]);
        shapes.push((
            buffers,
            [0, 1].map(|s| caps[s] * layouts[s].page_stride as usize),
        ));
        Spec {
            name,
            src: layouts[0],
            dst: layouts[1],
            src_pages,
            dst_pages,
            tokens,
            first_token,
            set,
            buffers: (0..buffers).collect(),
        }
    };
    specs.push(kv_group(
        "full attention (HND)",
        layouts,
        0,
        0,
        4,
        &mut rng,
        &mut shapes,
    ));

    // Sliding window, NHD: only the window's pages, from its start rounded down to both pages.
    let lcm = {
        let (a, b) = (u64::from(ps[0]), u64::from(ps[1]));
        let mut g = (a, b);
        while g.1 != 0 {
            g = (g.1, g.0 % g.1);
        }
        a / g.0 * b
    };
    let start = n.saturating_sub(model.window) / lcm * lcm;
    let swa = [
        nhd(model.kv_heads, at[0], ps[0], KV_HEAD_BYTES),
        nhd(model.kv_heads, at[1], ps[1], KV_HEAD_BYTES),
    ];
    specs.push(kv_group(
        "sliding window (NHD)",
        swa,
        start,
        1,
        4,
        &mut rng,
        &mut shapes,
    ));

    // The indexer: keys and scales of every token, two groups on the same two buffers.
    let ips = [model.indexer_pages.0, model.indexer_pages.1];
    let parts = [indexer_parts(at[0], ips[0]), indexer_parts(at[1], ips[1])];
    let counts = [0, 1].map(|s| n.div_ceil(u64::from(ips[s])));
    let caps = [0, 1].map(|s| counts[s] as usize + 2);
    let src_pages = pages(&mut rng, counts[0] as usize, caps[0]);
    let dst_pages = pages(&mut rng, counts[1] as usize, caps[1]);
    let set = shapes.len();
    shapes.push((
        2,
        [0, 1].map(|s| caps[s] * parts[s][0].page_stride as usize),
    ));
    for (i, name) in ["indexer keys (H = 1)", "indexer scales (H = 1)"]
        .into_iter()
        .enumerate()
    {
        specs.push(Spec {
            name,
            src: parts[0][i],
            dst: parts[1][i],
            src_pages: src_pages.clone(),
            dst_pages: dst_pages.clone(),
            tokens: n,
            first_token: 0,
            set,
            buffers: vec![0, 1],
        });
    }

    // fp8 KV with a 4-byte scale after each head (inline), and fp8 KV whose scales are a
    // buffer of their own with the same pages.
    let inline = [
        nhd(model.kv_heads, at[0], ps[0], 8 + 4),
        nhd(model.kv_heads, at[1], ps[1], 8 + 4),
    ];
    let set = shapes.len();
    specs.push(kv_group(
        "fp8 KV, scales inline",
        inline,
        0,
        set,
        2,
        &mut rng,
        &mut shapes,
    ));
    let fp8 = [
        nhd(model.kv_heads, at[0], ps[0], 8),
        nhd(model.kv_heads, at[1], ps[1], 8),
    ];
    let set = shapes.len();
    let kv = kv_group("fp8 KV", fp8, 0, set, 2, &mut rng, &mut shapes);
    let scales = [
        nhd(model.kv_heads, at[0], ps[0], 4),
        nhd(model.kv_heads, at[1], ps[1], 4),
    ];
    let counts = [kv.src_pages.len(), kv.dst_pages.len()];
    let scale_caps = [0, 1].map(|s| shapes[set].1[s] / fp8[s].page_stride as usize);
    shapes.push((
        2,
        [0, 1].map(|s| scale_caps[s] * scales[s].page_stride as usize),
    ));
    assert!(counts[0] <= scale_caps[0] && counts[1] <= scale_caps[1]);
    specs.push(Spec {
        name: "fp8 KV scales (own buffers)",
        src: scales[0],
        dst: scales[1],
        src_pages: kv.src_pages.clone(),
        dst_pages: kv.dst_pages.clone(),
        tokens: n,
        first_token: 0,
        set: set + 1,
        buffers: vec![0, 1],
    });
    specs.push(kv);

    // Mamba2: the conv state's x, B and C and the SSM state of one slot per side, four groups
    // on the two layers' buffers.
    let m = &model.mamba;
    let slots = [rng.range(0, 5) as i32, rng.range(0, 5) as i32];
    let set = shapes.len();
    shapes.push((2, [0, 1].map(|s| 6 * m.slot_stride(at[s].tp) as usize)));
    let conv = [m.conv_parts(at[0]), m.conv_parts(at[1])];
    for (i, name) in [
        "conv state x (by heads)",
        "conv state B (by groups)",
        "conv state C (by groups)",
    ]
    .into_iter()
    .enumerate()
    {
        specs.push(Spec {
            name,
            src: conv[0][i],
            dst: conv[1][i],
            src_pages: vec![slots[0]],
            dst_pages: vec![slots[1]],
            tokens: u64::from(m.conv_rows()),
            first_token: 0,
            set,
            buffers: vec![0, 1],
        });
    }
    specs.push(Spec {
        name: "SSM state (by heads)",
        src: m.ssm_part(at[0]),
        dst: m.ssm_part(at[1]),
        src_pages: vec![slots[0]],
        dst_pages: vec![slots[1]],
        tokens: 1,
        first_token: 0,
        set,
        buffers: vec![0, 1],
    });

    let src_sets = shapes
        .iter()
        .enumerate()
        .map(|(s, &(count, [len, _]))| {
            (0..count)
                .map(|b| pattern(seed ^ (s as u64) << 40 ^ (b as u64) << 32, len))
                .collect()
        })
        .collect();
    let dst_sets = shapes
        .iter()
        .enumerate()
        .map(|(s, &(count, [_, len]))| {
            (0..count)
                .map(|b| pattern(!seed ^ (s as u64) << 40 ^ (b as u64) << 32, len))
                .collect()
        })
        .collect();
    Case {
        what: format!("{model:?} TP {p_tp} -> {d_tp} pair ({p}, {d})"),
        specs,
        src_sets,
        dst_sets,
    }
}

fn models() -> Vec<Model> {
    let mamba = Mamba {
        n_heads: 8,
        head_dim: 4,
        n_groups: 1,
        d_state: 4,
        state_len: 3,
        conv_dtype: 2,
        ssm_dtype: 4,
        dim_first: true,
        slot_pad: 24,
    };
    vec![
        // Page sizes that differ, a partial last page, a window that starts mid-sequence,
        // B and C replicated on every rank (one group), the DS conv layout.
        Model {
            kv_heads: 8,
            mamba,
            page_sizes: (16, 32),
            indexer_pages: (64, 64),
            tokens: 150,
            window: 40,
        },
        // Fewer KV heads than a TP size, groups split by TP, the SD conv layout, the indexer
        // from CUDA's 64-token pages to ROCm's one-token pages.
        Model {
            kv_heads: 2,
            mamba: Mamba {
                n_groups: 4,
                dim_first: false,
                ..mamba
            },
            page_sizes: (32, 16),
            indexer_pages: (64, 1),
            tokens: 97,
            window: 70,
        },
        // Whole pages of one size, a window as long as the sequence.
        Model {
            kv_heads: 4,
            mamba,
            page_sizes: (16, 16),
            indexer_pages: (1, 64),
            tokens: 64,
            window: 64,
        },
    ]
}

const TP_PAIRS: [(u32, u32); 8] = [
    (1, 2),
    (2, 1),
    (2, 4),
    (4, 2),
    (1, 4),
    (4, 1),
    (2, 2),
    (4, 4),
];

#[test]
fn every_kind_of_group_moves_byte_exact_in_one_request_in_every_staging_mode() {
    let mut requests = 0;
    let mut moved: BTreeMap<&str, u64> = BTreeMap::new();
    for (m, model) in models().iter().enumerate() {
        for &(p_tp, d_tp) in &TP_PAIRS {
            for p in 0..p_tp {
                for d in 0..d_tp {
                    let seed = mix((m as u64) << 48
                        | u64::from(p_tp) << 32
                        | u64::from(p) << 16
                        | u64::from(d_tp) << 8
                        | u64::from(d));
                    let case = hybrid(model, p_tp, p, d_tp, d, seed);
                    for (name, bytes) in
                        check_request(&case, "the library's modes", &|_, c| staging_for(c))
                    {
                        *moved.entry(name).or_default() += bytes;
                    }
                    for mode in [
                        MORI_TP_STAGING_NONE,
                        MORI_TP_STAGING_SRC,
                        MORI_TP_STAGING_DST,
                        MORI_TP_STAGING_BOTH,
                    ] {
                        check_request(&case, &format!("every group in mode {mode}"), &|_, _| mode);
                    }
                    let mixed =
                        move |g: usize, _: &MoriTpPairConfig| (mix(seed ^ g as u64) % 4) as u32;
                    check_request(&case, "a random mode per group", &mixed);
                    requests += 6;
                }
            }
        }
    }
    assert!(requests > 300, "{requests} requests");
    // Every kind of group moved bytes somewhere (a pair that shares nothing moves none).
    assert_eq!(moved.len(), 11, "{moved:?}");
    assert!(moved.values().all(|&bytes| bytes > 0), "{moved:?}");
}

// ---- refusals: the status, the message with its group and numbers, nothing written --------

/// Two groups of one pair (4 KV heads, TP 2 -> 2, ranks 0 and 0): group 0 token-major pages of
/// 16 on both sides, 40 tokens, staged BOTH; group 1 a window of 20 tokens from token 32, pages
/// of 16 (token-major) to 32 (head-major), staged DST. Two buffers of 1536 bytes each per group
/// and side.
struct Fixture {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    src_ptrs: Vec<Vec<*const c_void>>,
    dst_ptrs: Vec<Vec<*mut c_void>>,
    pages: [[Vec<i32>; 2]; 2],
    configs: [MoriTpPairConfig; 2],
}

const BUFFER: usize = 1536;

impl Fixture {
    fn new() -> Fixture {
        let at = [Rank { tp: 2, rank: 0 }, Rank { tp: 2, rank: 0 }];
        let mut src: Vec<Vec<u8>> = (0..4).map(|b| pattern(b, BUFFER)).collect();
        let mut dst: Vec<Vec<u8>> = (0..4).map(|b| pattern(0x100 + b, BUFFER)).collect();
        let src_ptrs = src
            .chunks_mut(2)
            .map(|pair| pair.iter().map(|b| b.as_ptr().cast()).collect())
            .collect();
        let dst_ptrs = dst
            .chunks_mut(2)
            .map(|pair| pair.iter_mut().map(|b| b.as_mut_ptr().cast()).collect())
            .collect();
        Fixture {
            src,
            dst,
            src_ptrs,
            dst_ptrs,
            pages: [[vec![2, 0, 5], vec![1, 3, 4]], [vec![1, 4], vec![2]]],
            configs: [
                pair_config(&nhd(4, at[0], 16, 8), &nhd(4, at[1], 16, 8)),
                pair_config(&nhd(4, at[0], 16, 8), &hnd(4, at[1], 32, 8)),
            ],
        }
    }

    fn groups(&self) -> Vec<MoriTpGroup> {
        let group = |g: usize, staging: u32, first_token: u64, tokens: u64| MoriTpGroup {
            config: self.configs[g],
            staging,
            reserved: 0,
            first_token,
            request: MoriTpRequest {
                src_pages: self.pages[g][0].as_ptr(),
                num_src_pages: self.pages[g][0].len(),
                dst_pages: self.pages[g][1].as_ptr(),
                num_dst_pages: self.pages[g][1].len(),
                num_tokens: tokens,
            },
            buffers: MoriKvBuffers {
                src: self.src_ptrs[g].as_ptr(),
                dst: self.dst_ptrs[g].as_ptr(),
                num_buffers: 2,
                src_capacity: BUFFER as u64,
                dst_capacity: BUFFER as u64,
            },
        };
        vec![
            group(0, MORI_TP_STAGING_BOTH, 0, 40),
            group(1, MORI_TP_STAGING_DST, 32, 20),
        ]
    }

    /// Every destination buffer still holds its initial bytes.
    fn untouched(&self) -> bool {
        (0..4).all(|b| self.dst[b as usize] == pattern(0x100 + b, BUFFER))
            && (0..4).all(|b| self.src[b as usize] == pattern(b, BUFFER))
    }
}

/// Runs every group function on `groups` that reads what `edit` broke; each must refuse with
/// `status` and a message containing every one of `parts`, and write nothing.
fn refused(fixture: &Fixture, groups: &[MoriTpGroup], status: MoriStatus, parts: &[&str]) {
    let mut region = vec![0xEEu8; 4096];
    let mut out = vec![MoriTpGroupInfo::default(); groups.len()];
    let mut total = MoriTpGroupsTotal::default();
    let mut segments = vec![MoriSegment::default(); 4096];
    let mut len = 0;
    let (ptr, n) = (groups.as_ptr(), groups.len());
    // SAFETY (every call): arrays of the stated sizes, buffers of the stated capacities.
    let calls: [(&str, MoriStatus); 5] = unsafe {
        [
            (
                "mori_tp_groups_info",
                mori_tp_groups_info(ptr, n, out.as_mut_ptr(), &mut total),
            ),
            (
                "mori_tp_groups_segments",
                mori_tp_groups_segments(ptr, n, segments.as_mut_ptr(), 4096, &mut len),
            ),
            ("mori_tp_groups_send", mori_tp_groups_send(ptr, n, &HOST)),
            (
                "mori_tp_groups_pack",
                mori_tp_groups_pack(ptr, n, region.as_mut_ptr().cast(), 4096, &HOST),
            ),
            (
                "mori_tp_groups_unpack",
                mori_tp_groups_unpack(ptr, n, region.as_ptr().cast(), 4096, &HOST),
            ),
        ]
    };
    // The messages are checked call by call: the last one is what mori_tp_last_error_message
    // holds now, so each call is repeated alone below.
    for (function, got) in calls {
        assert_eq!(got, status, "{function}: {}", last_error());
    }
    for function in 0..5 {
        // SAFETY: as above.
        unsafe {
            match function {
                0 => mori_tp_groups_info(ptr, n, out.as_mut_ptr(), &mut total),
                1 => mori_tp_groups_segments(ptr, n, segments.as_mut_ptr(), 4096, &mut len),
                2 => mori_tp_groups_send(ptr, n, &HOST),
                3 => mori_tp_groups_pack(ptr, n, region.as_mut_ptr().cast(), 4096, &HOST),
                _ => mori_tp_groups_unpack(ptr, n, region.as_ptr().cast(), 4096, &HOST),
            }
        };
        let message = last_error();
        for part in parts {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
    }
    assert!(fixture.untouched(), "a refused call wrote a page buffer");
    assert!(
        region.iter().all(|&b| b == 0xEE),
        "a refused call wrote the staging region"
    );
    assert!(out.iter().all(|i| *i == MoriTpGroupInfo::default()));
    assert_eq!(total, MoriTpGroupsTotal::default());
    assert!(segments.iter().all(|s| *s == MoriSegment::default()));
}

#[test]
fn a_valid_request_lays_its_groups_regions_back_to_back() {
    let fixture = Fixture::new();
    let groups = fixture.groups();
    let (infos, total) = info(&groups);
    // Group 0: 40 tokens x 2 heads x 8 bytes = 640 per buffer, staged on both sides; group 1:
    // 20 tokens, staged on the decode side only, after group 0's 1280 bytes there.
    assert_eq!(
        (
            infos[0].staging_len,
            infos[0].src_staging_offset,
            infos[0].dst_staging_offset
        ),
        (640, 0, 0)
    );
    assert_eq!(
        (
            infos[1].staging_len,
            infos[1].src_staging_offset,
            infos[1].dst_staging_offset
        ),
        (320, 0, 1280)
    );
    assert_eq!(
        (total.src_staging_bytes, total.dst_staging_bytes),
        (1280, 1920)
    );
    assert_eq!(total.bytes, 1920);
    // BOTH is one segment per buffer; group 1's DST segments follow it.
    assert_eq!((infos[0].first_segment, infos[0].num_segments), (0, 1));
    assert_eq!(infos[1].first_segment, 1);
    assert_eq!(segments(&groups).len() as u64, total.num_segments);
    let empty = info(&[]);
    assert_eq!(empty, (vec![], MoriTpGroupsTotal::default()));
}

#[test]
fn a_window_that_does_not_start_on_both_pages_is_refused_with_its_numbers() {
    let fixture = Fixture::new();
    let mut groups = fixture.groups();
    groups[1].first_token = 40;
    refused(
        &fixture,
        &groups,
        MORI_ERR_INVALID_ARGUMENT,
        &[
            "invalid argument: group 1: first_token 40 is not a multiple of both page sizes \
           (prefill page_size 16, decode page_size 32): a window starts on a page of each side; \
           round it down to 32, a multiple of 32",
        ],
    );
    // On both pages it is accepted: 64 is a multiple of 16 and of 32.
    groups[1].first_token = 64;
    info(&groups);
}

/// A change that breaks a request, the status it must get and what its message must say.
type Edit = (
    Box<dyn Fn(&mut [MoriTpGroup])>,
    MoriStatus,
    Vec<&'static str>,
);

#[test]
fn every_field_of_a_group_is_checked_and_its_refusal_names_the_group() {
    let fixture = Fixture::new();
    let base = fixture.groups();
    let edits: Vec<Edit> = vec![
        (
            Box::new(|g| g[1].reserved = 7),
            MORI_ERR_INVALID_ARGUMENT,
            vec!["invalid argument: group 1: reserved is 7, not 0"],
        ),
        (
            Box::new(|g| g[0].staging = 9),
            MORI_ERR_INVALID_ARGUMENT,
            vec!["invalid argument: group 0: staging 9 is not a MoriTpStaging"],
        ),
        (
            Box::new(|g| g[1].config.num_heads += 1),
            MORI_ERR_INVALID_ARGUMENT,
            vec!["invalid argument: group 1: inconsistent pair config: num_heads 3"],
        ),
        (
            Box::new(|g| g[1].config.dst.head_bytes = 4),
            MORI_ERR_LAYOUT_MISMATCH,
            vec!["layout mismatch: group 1: decode side head_bytes 4 != prefill side head_bytes 8"],
        ),
        (
            Box::new(|g| g[1].request.num_src_pages = 1),
            MORI_ERR_INVALID_ARGUMENT,
            vec!["invalid argument: group 1: prefill side: 1 pages for 20 tokens of page_size 16"],
        ),
        (
            Box::new(|g| g[0].request.src_pages = std::ptr::null()),
            MORI_ERR_NULL_POINTER,
            vec!["null pointer: group 0: request.src_pages is NULL but its length is 3"],
        ),
        (
            Box::new(|g| g[1].request.dst_pages = [-1i32].as_ptr()),
            MORI_ERR_OUT_OF_BOUNDS,
            vec!["out of bounds: group 1: decode side: page index -1 at position 0 is negative"],
        ),
        (
            // On both pages, but the window's last token is past 2^64.
            Box::new(|g| g[0].first_token = u64::MAX - 31),
            MORI_ERR_INVALID_ARGUMENT,
            vec!["invalid argument: group 0: ", "first_token + num_tokens"],
        ),
    ];
    for (edit, status, parts) in edits {
        let mut groups = base.clone();
        edit(&mut groups);
        refused(&fixture, &groups, status, &parts);
    }
}

#[test]
fn a_bad_group_after_good_ones_stops_the_whole_request_before_any_byte_moves() {
    let fixture = Fixture::new();
    let mut groups = fixture.groups();
    // Group 1's decode pages end past its buffers: group 0, valid, must not move either.
    groups[1].buffers.dst_capacity = 1000;
    let message = |f: &dyn Fn() -> MoriStatus, status: MoriStatus| {
        assert_eq!(f(), status, "{}", last_error());
        last_error()
    };
    let (ptr, n) = (groups.as_ptr(), groups.len());
    // SAFETY: the fixture's buffers, of BUFFER bytes (the capacity stated is smaller).
    let sent = message(
        &|| unsafe { mori_tp_groups_send(ptr, n, &HOST) },
        MORI_ERR_OUT_OF_BOUNDS,
    );
    assert!(
        sent.starts_with(
            "mori_tp_groups_send: out of bounds: group 1: decode side: page 2 at \
                          position 0 ends at byte 1536, past dst_capacity 1000"
        ),
        "{sent}"
    );
    let mut region = vec![0u8; 1920];
    // SAFETY: as above; the region holds the request's 1920 decode staging bytes.
    let unpacked = message(
        &|| unsafe { mori_tp_groups_unpack(ptr, n, region.as_ptr().cast(), 1920, &HOST) },
        MORI_ERR_OUT_OF_BOUNDS,
    );
    assert!(
        unpacked.contains("group 1: decode side: page 2"),
        "{unpacked}"
    );
    // SAFETY: valid pointers.
    let checked = message(
        &|| unsafe { mori_tp_check_groups_transfer(ptr, n, 1280, 1920) },
        MORI_ERR_OUT_OF_BOUNDS,
    );
    assert!(
        checked.contains("group 1: decode side: page 2"),
        "{checked}"
    );
    // A pack reads only the prefill side: group 1 stages nothing there, so it packs group 0.
    // SAFETY: as above.
    let packed = unsafe { mori_tp_groups_pack(ptr, n, region.as_mut_ptr().cast(), 1280, &HOST) };
    assert_eq!(packed, MORI_OK, "{}", last_error());
    assert!(fixture.untouched());
    assert!(region[..1280].iter().any(|&b| b != 0));
    region.fill(0);

    // A NULL buffer array where it is read, and a NULL entry.
    let mut groups = fixture.groups();
    groups[1].buffers.dst = std::ptr::null();
    let (ptr, n) = (groups.as_ptr(), groups.len());
    // SAFETY: as above.
    let sent = message(
        &|| unsafe { mori_tp_groups_send(ptr, n, &HOST) },
        MORI_ERR_NULL_POINTER,
    );
    assert!(
        sent.contains(
            "null pointer: group 1: decode side: the group's buffer pointers are not \
                       given (NULL or empty) but num_buffers is 2"
        ),
        "{sent}"
    );
    let nulls: Vec<*const c_void> = vec![fixture.src_ptrs[0][0], std::ptr::null()];
    let mut groups = fixture.groups();
    groups[0].buffers.src = nulls.as_ptr();
    let (ptr, n) = (groups.as_ptr(), groups.len());
    let base = region.as_mut_ptr();
    // SAFETY: as above.
    let packed = message(
        &|| unsafe { mori_tp_groups_pack(ptr, n, base.cast(), 1280, &HOST) },
        MORI_ERR_NULL_POINTER,
    );
    assert!(
        packed.contains("null pointer: group 0: buffers.src[1] is NULL"),
        "{packed}"
    );
    assert!(fixture.untouched());
    assert!(region.iter().all(|&b| b == 0));
}

#[test]
fn staging_regions_too_small_null_or_overlapping_are_refused() {
    let fixture = Fixture::new();
    let groups = fixture.groups();
    let (ptr, n) = (groups.as_ptr(), groups.len());
    let mut region = vec![0u8; 2048];
    let expect = |status: MoriStatus, got: MoriStatus, part: &str| {
        assert_eq!(got, status, "{}", last_error());
        let message = last_error();
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    };
    // SAFETY (every call): the fixture's buffers; a region of 2048 bytes (capacities stated
    // within it), or NULL.
    unsafe {
        expect(
            MORI_ERR_BUFFER_TOO_SMALL,
            mori_tp_groups_pack(ptr, n, region.as_mut_ptr().cast(), 1279, &HOST),
            "buffer too small: prefill side: staging_capacity 1279 is below the 1280 bytes",
        );
        expect(
            MORI_ERR_BUFFER_TOO_SMALL,
            mori_tp_groups_unpack(ptr, n, region.as_ptr().cast(), 1919, &HOST),
            "buffer too small: decode side: staging_capacity 1919 is below the 1920 bytes",
        );
        expect(
            MORI_ERR_BUFFER_TOO_SMALL,
            mori_tp_check_groups_transfer(ptr, n, 1280, 1919),
            "decode side: staging_capacity 1919 is below the 1920 bytes",
        );
        expect(
            MORI_ERR_NULL_POINTER,
            mori_tp_groups_unpack(ptr, n, null(), 1920, &HOST),
            "staging is NULL but staging_capacity is 1920",
        );
        // The region starts inside group 0's second source buffer.
        let inside = fixture.src[1].as_ptr().cast_mut().add(100).cast();
        expect(
            MORI_ERR_INVALID_ARGUMENT,
            mori_tp_groups_pack(ptr, n, inside, 1280, &HOST),
            "invalid argument: group 0: the staging region",
        );
        assert!(fixture.untouched());
        assert!(region.iter().all(|&b| b == 0));
        // Unknown send flags are the call's, not a group's.
        let bad = MoriSendOptions {
            flags: 0x80,
            ..HOST
        };
        expect(
            MORI_ERR_INVALID_ARGUMENT,
            mori_tp_groups_send(ptr, n, &bad),
            "options.flags 0x80 has unknown bits 0x80",
        );
    }
}

#[test]
fn the_arrays_of_the_group_functions_follow_the_abi_conventions() {
    let fixture = Fixture::new();
    let groups = fixture.groups();
    let (ptr, n) = (groups.as_ptr(), groups.len());
    let mut total = MoriTpGroupsTotal::default();
    let mut len = usize::MAX;
    // SAFETY (every call): NULL arrays with non-zero lengths are refused before any access.
    unsafe {
        assert_eq!(
            mori_tp_groups_info(null(), 2, null_mut(), &mut total),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            mori_tp_groups_info(ptr, n, null_mut(), &mut total),
            MORI_ERR_NULL_POINTER
        );
        assert!(
            last_error().contains("out is NULL but its length is 2"),
            "{}",
            last_error()
        );
        let mut out = [MoriTpGroupInfo::default(); 2];
        assert_eq!(
            mori_tp_groups_info(ptr, n, out.as_mut_ptr(), null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            mori_tp_groups_segments(null(), 1, null_mut(), 0, &mut len),
            MORI_ERR_NULL_POINTER
        );
        assert!(last_error().contains("groups is NULL but its length is 1"));
        // The size query, then an array one entry short: *out_len says how many, nothing else
        // is written.
        assert_eq!(
            mori_tp_groups_segments(ptr, n, null_mut(), 0, &mut len),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        let needed = len;
        let mut short = vec![MoriSegment::default(); needed - 1];
        assert_eq!(
            mori_tp_groups_segments(ptr, n, short.as_mut_ptr(), needed - 1, &mut len),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(len, needed);
        assert!(short.iter().all(|s| *s == MoriSegment::default()));
        // An empty request: nothing to plan, move or check.
        assert_eq!(
            mori_tp_groups_segments(null(), 0, null_mut(), 0, &mut len),
            MORI_OK
        );
        assert_eq!(len, 0);
        assert_eq!(mori_tp_groups_send(null(), 0, &HOST), MORI_OK);
        assert_eq!(
            mori_tp_groups_pack(null(), 0, null_mut(), 0, &HOST),
            MORI_OK
        );
        assert_eq!(mori_tp_check_groups_transfer(null(), 0, 0, 0), MORI_OK);
    }
}
