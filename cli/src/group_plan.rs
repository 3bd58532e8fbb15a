//! `plan --config` for a model of several groups: for every group and part, which prefill rank
//! sends which units to each decode rank (the library's topology (REFERENCE.md section 3) and its
//! pair config of both ranks' layouts), and the bytes each pair and each decode rank moves per
//! token and per request.
//!
//! A paged part's layouts are the deployment's (`--prefill-layout`, `--decode-layout` and the
//! page sizes). A slot part's layout is the engine's and is not known here; its pair configs are
//! built on one page per slot holding each unit's bytes of the slot whole, which fixes the
//! action, the units and the local indices (they depend only on `H` and the TP sizes) and the
//! byte counts, and nothing else: the output says so.

use std::collections::BTreeMap;
use std::ops::Range;

use mori_tp::{Action, Side, Topology, TpSide, pair_config};

use crate::dtype::Dtype;
use crate::facts::{Dtypes, Group, ModelFacts, Part, Storage, UnitBytes};
use crate::layout::{Failure, Layout, LayoutError, PageOrder, Paging, Problem};

/// One part of one pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartPair {
    /// Index into the group's parts.
    pub part: usize,
    pub action: Action,
    /// The units both ranks own.
    pub shared: Range<u32>,
    /// The prefill rank that sends `shared`.
    pub sent_by: u32,
    /// From the library's pair config (zeros unless SEND).
    pub first_unit: u32,
    pub num_units: u32,
    pub src_first_local: u32,
    pub dst_first_local: u32,
    /// Bytes moved per token over the group's layers and buffers (paged parts; None for slots).
    pub bytes_per_token: Option<u64>,
    /// Bytes moved per request (0 for a replica).
    pub bytes_per_request: u64,
}

/// One (prefill rank, decode rank) pair of a group: its parts that share units.
#[derive(Clone, Debug)]
pub struct GroupPair {
    pub prefill_rank: u32,
    pub decode_rank: u32,
    pub parts: Vec<PartPair>,
}

/// What one decode rank receives of a group.
#[derive(Clone, Debug)]
pub struct GroupRank {
    pub decode_rank: u32,
    /// The units it owns, per part.
    pub owned: Vec<Range<u32>>,
    pub pairs: Vec<GroupPair>,
    pub bytes_per_token: Option<u64>,
    pub bytes_per_request: u64,
}

/// A part with its sides checked.
#[derive(Clone, Debug)]
pub struct PartSetup {
    pub part: Part,
    pub topology: Topology,
    pub unit_bytes: u64,
}

/// A group ready to plan.
#[derive(Clone, Debug)]
pub struct GroupSetup {
    pub group: Group,
    pub parts: Vec<PartSetup>,
    /// The tokens of a request that move (paged: N, or the window's last tokens).
    pub tokens_moved: Option<u64>,
    /// A slot's time steps, speculative tokens included (None for a paged group).
    pub steps: Option<u32>,
    /// `bf16`, `fp32`, `fp8 + fp32 scales`, per part.
    pub dtype_names: Vec<String>,
}

/// Every group of a hybrid model, checked against both TP sizes.
#[derive(Clone, Debug)]
pub struct GroupsPlan {
    pub facts: ModelFacts,
    pub groups: Vec<GroupSetup>,
    pub prefill: Paging,
    pub decode: Paging,
    pub tokens: u32,
}

/// The dtypes of a deployment: the KV cache's (`--dtype`), the conv state's
/// (`--mamba-cache-dtype`) and the SSM state's (`--mamba-ssm-cache-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateDtypes {
    pub conv: Dtype,
    pub ssm: Dtype,
}

/// The name a part's dtype goes by.
fn dtype_name(bytes: UnitBytes, cache: Dtype, states: StateDtypes) -> String {
    match bytes {
        UnitBytes::Cache(_) => cache.to_string(),
        UnitBytes::Conv(_) => states.conv.to_string(),
        UnitBytes::State(_) => states.ssm.to_string(),
        UnitBytes::Fixed(_) => "fp8+fp32_scales".into(),
        UnitBytes::MlaLatent { .. } if cache.bytes() == 1 => "fp8_ds_mla".into(),
        UnitBytes::MlaLatent { .. } => cache.to_string(),
    }
}

/// The tokens a sliding window of `window` moves out of a `tokens`-token sequence: the library
/// takes a window's first token only on a page of both sides (REFERENCE.md section 15), so the
/// window starts at `tokens - window` rounded down to a multiple of both page sizes, and moves
/// up to `lcm - 1` tokens more than `window`. Pages of 16 and 64, 1000 tokens, a window of 128:
/// from token 832, 168 tokens.
pub fn window_tokens(tokens: u32, window: u32, prefill_page: u32, decode_page: u32) -> u64 {
    let (a, b) = (
        u64::from(prefill_page.max(1)),
        u64::from(decode_page.max(1)),
    );
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    let lcm = a / x * b;
    let start = u64::from(tokens.saturating_sub(window));
    u64::from(tokens) - start / lcm * lcm
}

impl GroupsPlan {
    /// Checks every part's units against both TP sizes: by REFERENCE.md section 3 (the library),
    /// and for the parts engines split only evenly, `units % tp == 0`. Every problem is reported. A conv
    /// state keeps `kernel - 1 + num_spec` time steps.
    pub fn new(
        facts: &ModelFacts,
        layout: &Layout,
        states: StateDtypes,
        tokens: u32,
        num_spec: u32,
    ) -> Result<GroupsPlan, LayoutError> {
        let (p_size, d_size) = (layout.prefill_tp(), layout.decode_tp());
        let dtypes = Dtypes::of(layout.dtype, states.conv, states.ssm);
        let mut problems = Vec::new();
        let mut groups = Vec::new();
        for group in &facts.groups {
            let mut parts = Vec::new();
            for part in &group.parts {
                for (side, tp) in [(Side::Prefill, p_size), (Side::Decode, d_size)] {
                    if part.must_divide && part.units % tp != 0 {
                        problems.push(Problem {
                            message: format!(
                                "{side}: TP {tp} does not divide the {} {} {}s of {}: vLLM and \
                                 SGLang split them only evenly",
                                part.units, part.name, part.unit, group.name
                            ),
                            topology: None,
                        });
                    }
                }
                match Topology::new(part.units, p_size, d_size) {
                    Ok(topology) => parts.push(PartSetup {
                        part: part.clone(),
                        topology,
                        unit_bytes: part.bytes.bytes(dtypes),
                    }),
                    Err(e) => {
                        let problem = Problem::from_library(&e);
                        if !problems.contains(&problem) {
                            problems.push(problem);
                        }
                    }
                }
            }
            let tokens_moved = match group.storage {
                Storage::Paged { window: None } => Some(u64::from(tokens)),
                Storage::Paged { window: Some(w) } => Some(window_tokens(
                    tokens,
                    w,
                    layout.prefill_paging.page_size,
                    layout.decode_paging.page_size,
                )),
                Storage::Slot { .. } => None,
            };
            let dtype_names = group
                .parts
                .iter()
                .map(|p| dtype_name(p.bytes, layout.dtype, states))
                .collect();
            groups.push(GroupSetup {
                group: group.clone(),
                parts,
                tokens_moved,
                steps: group.steps(num_spec),
                dtype_names,
            });
        }
        if !problems.is_empty() {
            return Err(LayoutError {
                summary: format!(
                    "{} cannot run with prefill TP {p_size} and decode TP {d_size}:",
                    layout.model.name
                ),
                problems,
            });
        }
        let plan = GroupsPlan {
            facts: facts.clone(),
            groups,
            prefill: layout.prefill_paging,
            decode: layout.decode_paging,
            tokens,
        };
        // The library checks every part's layouts once, on rank 0 of each side.
        for g in 0..plan.groups.len() {
            for p in 0..plan.groups[g].parts.len() {
                plan.pair(g, p, 0, 0).map_err(|e| LayoutError {
                    summary: format!(
                        "{}: the {} part of {}:",
                        layout.model.name,
                        plan.groups[g].parts[p].part.name,
                        plan.groups[g].group.name
                    ),
                    problems: vec![Problem::from_library(&e)],
                })?;
            }
        }
        Ok(plan)
    }

    /// One layout per unit count among the parts (in the order they first appear), with a
    /// caption naming the groups and parts that shard that way: what `--svg` draws, one panel
    /// each. A part's units move like KV heads of the same count, so a panel is the classic
    /// picture of that many heads.
    pub fn panels(&self, layout: &Layout) -> Result<Vec<(String, Layout)>, LayoutError> {
        let mut counts: Vec<(u32, Vec<String>)> = Vec::new();
        for setup in &self.groups {
            for p in &setup.parts {
                // `full_attention kv heads`, `conv_state B groups`: what the units are.
                let name = format!("{} {} {}s", setup.group.name, p.part.name, p.part.unit);
                match counts.iter_mut().find(|(units, _)| *units == p.part.units) {
                    Some((_, names)) => names.push(name),
                    None => counts.push((p.part.units, vec![name])),
                }
            }
        }
        counts
            .into_iter()
            .map(|(units, names)| {
                let model = crate::model::Model {
                    name: layout.model.name.clone(),
                    kv_heads: units,
                    head_dim: 1,
                    layers: 1,
                    attention: crate::model::Attention::KeyValue,
                    torch_dtype: None,
                    facts: None,
                };
                let caption = format!(
                    "{units} unit{} ({})",
                    if units == 1 { "" } else { "s" },
                    names.join(", ")
                );
                let panel = Layout::new(
                    model,
                    Dtype::Fp8,
                    layout.prefill_paging,
                    layout.decode_paging,
                    layout.prefill_tp(),
                    layout.decode_tp(),
                )?;
                Ok((caption, panel))
            })
            .collect()
    }

    pub fn decode_tp(&self) -> u32 {
        self.groups[0].parts[0].topology.decode().tp_size()
    }

    /// The library's layout of a part on one rank: the deployment's paging for a paged part; for
    /// a slot, one page per slot holding each unit's bytes of the slot whole.
    pub fn rank_layout(
        &self,
        group: usize,
        part: usize,
        side: Side,
        rank: u32,
    ) -> mori_tp::Result<mori_tp::Layout> {
        let g = &self.groups[group];
        let setup = &g.parts[part];
        let topology = &setup.topology;
        let tp = match side {
            Side::Prefill => topology.prefill().tp_size(),
            Side::Decode => topology.decode().tp_size(),
        };
        let units = setup.part.units;
        match g.group.storage {
            Storage::Paged { .. } => {
                let paging = match side {
                    Side::Prefill => self.prefill,
                    Side::Decode => self.decode,
                };
                let make = match paging.order {
                    PageOrder::Nhd => mori_tp::Layout::nhd,
                    PageOrder::Hnd => mori_tp::Layout::hnd,
                };
                make(units, tp, rank, paging.page_size, setup.unit_bytes)
            }
            Storage::Slot { .. } => {
                let steps = g.steps.expect("a slot has time steps");
                mori_tp::Layout::nhd(units, tp, rank, 1, setup.unit_bytes * u64::from(steps))
            }
        }
    }

    /// Part `part` of group `group` between prefill rank `p` and decode rank `d`.
    fn pair(&self, group: usize, part: usize, p: u32, d: u32) -> mori_tp::Result<PartPair> {
        let g = &self.groups[group];
        let setup = &g.parts[part];
        let pairing = setup.topology.pairing(p, d)?;
        let config = pair_config(
            &self.rank_layout(group, part, Side::Prefill, p)?,
            &self.rank_layout(group, part, Side::Decode, d)?,
        )?;
        debug_assert_eq!(config.action(), pairing.action);
        let sends = config.action() == Action::Send;
        let per_layer_unit =
            setup.unit_bytes * u64::from(g.group.buffers_per_layer) * g.group.layers.len() as u64;
        let moved = if sends {
            u64::from(config.num_heads()) * per_layer_unit
        } else {
            0
        };
        let (bytes_per_token, bytes_per_request) = match g.group.storage {
            Storage::Paged { .. } => (
                Some(moved),
                moved * g.tokens_moved.expect("paged groups move tokens"),
            ),
            Storage::Slot { .. } => (
                None,
                moved * u64::from(g.steps.expect("a slot has time steps")),
            ),
        };
        let sent_by = if pairing.action == Action::NotPaired {
            0
        } else {
            setup
                .topology
                .sender(d, pairing.shared_heads.start)
                .expect("a shared unit has a sender")
        };
        Ok(PartPair {
            part,
            action: config.action(),
            shared: pairing.shared_heads,
            sent_by,
            first_unit: config.first_head(),
            num_units: config.num_heads(),
            src_first_local: config.src_first_local(),
            dst_first_local: config.dst_first_local(),
            bytes_per_token,
            bytes_per_request,
        })
    }

    /// The prefill ranks that share a unit of `part` with decode rank `d`: consecutive, from the
    /// first owner of its first unit to the last replica of its last one.
    fn sharing(side: &TpSide, prefill: &TpSide, d: u32) -> Range<u32> {
        const IN_RANGE: &str = "ranks below their TP sizes, units below the part's";
        let owned = side.owned_heads(d).expect(IN_RANGE);
        let first = prefill.first_owner(owned.start).expect(IN_RANGE);
        let last = prefill.first_owner(owned.end - 1).expect(IN_RANGE) + prefill.replication() - 1;
        first..last + 1
    }

    /// What decode rank `d` receives of group `group`, pair by pair in prefill rank order.
    pub fn rank(&self, group: usize, d: u32) -> mori_tp::Result<GroupRank> {
        let g = &self.groups[group];
        let mut by_prefill: BTreeMap<u32, Vec<PartPair>> = BTreeMap::new();
        let mut owned = Vec::new();
        for (i, setup) in g.parts.iter().enumerate() {
            let (prefill, decode) = (setup.topology.prefill(), setup.topology.decode());
            owned.push(
                decode
                    .owned_heads(d)
                    .expect("a decode rank below its TP size"),
            );
            for p in Self::sharing(decode, prefill, d) {
                let pair = self.pair(group, i, p, d)?;
                if pair.action != Action::NotPaired {
                    by_prefill.entry(p).or_default().push(pair);
                }
            }
        }
        let pairs: Vec<GroupPair> = by_prefill
            .into_iter()
            .map(|(p, parts)| GroupPair {
                prefill_rank: p,
                decode_rank: d,
                parts,
            })
            .collect();
        let parts = pairs.iter().flat_map(|pair| &pair.parts);
        let bytes_per_token = match g.group.storage {
            Storage::Paged { .. } => Some(parts.clone().filter_map(|p| p.bytes_per_token).sum()),
            Storage::Slot { .. } => None,
        };
        let bytes_per_request = parts.map(|p| p.bytes_per_request).sum();
        Ok(GroupRank {
            decode_rank: d,
            owned,
            pairs,
            bytes_per_token,
            bytes_per_request,
        })
    }

    /// Every decode rank of a group, computed as the iterator advances.
    pub fn ranks(&self, group: usize) -> impl Iterator<Item = mori_tp::Result<GroupRank>> + '_ {
        (0..self.decode_tp()).map(move |d| self.rank(group, d))
    }
}

/// A group's sum over a pair's parts.
pub fn pair_bytes(pair: &GroupPair) -> (Option<u64>, u64) {
    let per_token = pair
        .parts
        .iter()
        .map(|p| p.bytes_per_token)
        .try_fold(0u64, |sum, b| b.map(|b| sum + b));
    (
        per_token,
        pair.parts.iter().map(|p| p.bytes_per_request).sum(),
    )
}

/// `layers 0-2, 4-6 and 8 (7 layers)`.
pub fn layers_text(layers: &[u32]) -> String {
    let mut runs: Vec<Range<u32>> = Vec::new();
    for &l in layers {
        match runs.last_mut() {
            Some(run) if run.end == l => run.end = l + 1,
            _ => runs.push(l..l + 1),
        }
    }
    let shown: Vec<String> = runs
        .iter()
        .map(|r| {
            if r.len() == 1 {
                r.start.to_string()
            } else {
                format!("{}-{}", r.start, r.end - 1)
            }
        })
        .collect();
    let list = match shown.as_slice() {
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
        [] => String::new(),
    };
    let s = if layers.len() == 1 { "" } else { "s" };
    let word = if layers.len() == 1 { "layer" } else { "layers" };
    format!("{word} {list} ({} layer{s})", layers.len())
}

/// `x heads 0-15`, `B group 3`, `index_k record 0`.
fn units_text(part: &Part, units: &Range<u32>) -> String {
    match units.len() {
        1 => format!("{} {} {}", part.name, part.unit, units.start),
        n => format!(
            "{} {}s {}-{}",
            part.name,
            part.unit,
            units.start,
            units.start + n as u32 - 1
        ),
    }
}

/// The per-token and per-request bytes of a pair or a rank, for people.
fn bytes_text(per_token: Option<u64>, per_request: u64, tokens: u32, moved: Option<u64>) -> String {
    use crate::layout::{grouped, human_bytes};
    match (per_token, moved) {
        (Some(t), Some(m)) if m < u64::from(tokens) => format!(
            "{} B per token, {} per request (its last {} tokens)",
            grouped(t),
            human_bytes(per_request),
            grouped(m)
        ),
        (Some(t), _) => format!(
            "{} B per token, {} per {}-token request",
            grouped(t),
            human_bytes(per_request),
            grouped(u64::from(tokens))
        ),
        (None, _) => format!("{} per request", human_bytes(per_request)),
    }
}

/// A run of consecutive prefill ranks whose pairs with one decode rank only skip, each the same
/// units of the same parts for the same senders: what the text prints on one line and the JSON
/// writes as one `replicas` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaRun {
    pub decode_rank: u32,
    pub prefill_ranks: Range<u32>,
    /// Each skipped part: its index, the units, the prefill rank that sends them.
    pub parts: Vec<(usize, Range<u32>, u32)>,
}

/// The runs of skipping pairs among a decode rank's pairs (in prefill rank order). Pairs that
/// send some part are not in a run; their skipped parts go with them.
pub fn replica_runs(rank: &GroupRank) -> Vec<ReplicaRun> {
    let mut runs: Vec<ReplicaRun> = Vec::new();
    for pair in &rank.pairs {
        if pair.parts.iter().any(|p| p.action == Action::Send) {
            continue;
        }
        let parts: Vec<(usize, Range<u32>, u32)> = pair
            .parts
            .iter()
            .map(|p| (p.part, p.shared.clone(), p.sent_by))
            .collect();
        match runs.last_mut() {
            Some(run) if run.prefill_ranks.end == pair.prefill_rank && run.parts == parts => {
                run.prefill_ranks.end += 1;
            }
            _ => runs.push(ReplicaRun {
                decode_rank: rank.decode_rank,
                prefill_ranks: pair.prefill_rank..pair.prefill_rank + 1,
                parts,
            }),
        }
    }
    runs
}

/// `prefill rank 3 skips B group 0 (replica: prefill rank 0 sends it)`, `prefill ranks 1-7 skip
/// B group 0, C group 0 (replicas: prefill rank 0 sends them)`.
fn skips_text(
    setup: &GroupSetup,
    ranks: &Range<u32>,
    parts: &[(usize, Range<u32>, u32)],
) -> String {
    let who = if ranks.len() == 1 {
        format!("prefill rank {} skips", ranks.start)
    } else {
        format!("prefill ranks {}-{} skip", ranks.start, ranks.end - 1)
    };
    let replicas = if ranks.len() == 1 {
        "replica"
    } else {
        "replicas"
    };
    let units: Vec<String> = parts
        .iter()
        .map(|(i, units, _)| units_text(&setup.parts[*i].part, units))
        .collect();
    let senders: Vec<u32> = parts.iter().map(|&(_, _, s)| s).collect();
    if senders.iter().all(|&s| s == senders[0]) {
        format!(
            "{who} {} ({replicas}: prefill rank {} sends {})",
            units.join(", "),
            senders[0],
            if units.len() == 1 { "it" } else { "them" }
        )
    } else {
        let each: Vec<String> = units
            .iter()
            .zip(&senders)
            .map(|(u, s)| format!("prefill rank {s} sends {u}"))
            .collect();
        format!(
            "{who} {} ({replicas}: {})",
            units.join(", "),
            each.join(", ")
        )
    }
}

impl GroupsPlan {
    /// The groups for people: each group's layers, storage and parts, then every decode rank's
    /// senders and the bytes of each pair and of the rank; the replicas that skip are condensed
    /// as the main plan condenses them (consecutive prefill ranks that skip the same units for
    /// the same senders on one line).
    pub fn write_text(&self, out: &mut dyn std::io::Write) -> Result<(), Failure> {
        use std::fmt::Write as _;
        let fail = |e: mori_tp::Error| LayoutError {
            summary: "a group's pair:".into(),
            problems: vec![Problem::from_library(&e)],
        };
        let main = self.facts.main_group().name;
        out.write_all(b"\n")?;
        out.write_all(
            crate::layout::labelled(
                "groups:",
                &format!(
                    "{} kinds of state over {} layers ({}); what each decode rank receives of \
                     each",
                    self.groups.len(),
                    self.facts.total_layers,
                    family_text(self.facts.family)
                ),
            )
            .as_bytes(),
        )?;
        for (g, setup) in self.groups.iter().enumerate() {
            let group = &setup.group;
            let mut text = String::new();
            let storage = match (group.storage, setup.steps) {
                (Storage::Paged { window: None }, _) => "paged".to_string(),
                (Storage::Paged { window: Some(w) }, _) => {
                    format!("paged, the last {w} tokens (sliding_window)")
                }
                (Storage::Slot { steps: base }, Some(steps)) if steps != base => format!(
                    "one slot per request of {steps} time steps ({base} + {} speculative \
                     token{})",
                    steps - base,
                    if steps - base == 1 { "" } else { "s" }
                ),
                (Storage::Slot { steps }, _) => format!(
                    "one slot per request of {steps} time step{}",
                    if steps == 1 { "" } else { "s" }
                ),
            };
            text += &crate::layout::labelled(
                "group",
                &format!(
                    "{} ({}): {}; {}; {} buffer{} per layer",
                    group.name,
                    group.what,
                    layers_text(&group.layers),
                    storage,
                    group.buffers_per_layer,
                    if group.buffers_per_layer == 1 {
                        ""
                    } else {
                        "s"
                    }
                ),
            );
            let step = match group.storage {
                Storage::Paged { .. } => "per token",
                Storage::Slot { .. } => "per time step",
            };
            let parts: Vec<String> = setup
                .parts
                .iter()
                .zip(&setup.dtype_names)
                .map(|(p, dtype)| {
                    let units = p.part.units;
                    let held = if units == 1 {
                        "held whole by every rank"
                    } else {
                        "sharded"
                    };
                    format!(
                        "{} {} {}{} x {} B {step} ({dtype}), {held}",
                        p.part.name,
                        units,
                        p.part.unit,
                        if units == 1 { "" } else { "s" },
                        crate::layout::grouped(p.unit_bytes)
                    )
                })
                .collect();
            text += &crate::layout::labelled("  parts:", &parts.join("; "));
            let first_slot = self
                .groups
                .iter()
                .position(|g| matches!(g.group.storage, Storage::Slot { .. }));
            if first_slot == Some(g) {
                text += &crate::layout::labelled(
                    "  slot:",
                    "where each part lies in a state slot is the engine's (vLLM keeps a conv \
                     state as (state_len, dim) or (dim, state_len), SGLang as its own shape; a \
                     slot may be padded) and is not guessed here: the sends and bytes of every \
                     slot group below do not depend on it; Python's mori_tp.models takes the \
                     engine's strides",
                );
            }
            if group.name == main {
                text += &crate::layout::labelled("  pairs:", "the plan above is this group's");
                out.write_all(text.as_bytes())?;
                continue;
            }
            out.write_all(text.as_bytes())?;
            for rank in self.ranks(g) {
                let rank = rank.map_err(fail)?;
                let owned: Vec<String> = setup
                    .parts
                    .iter()
                    .zip(&rank.owned)
                    .map(|(p, r)| units_text(&p.part, r))
                    .collect();
                let mut text = format!(
                    "  decode rank {}, {}:\n",
                    rank.decode_rank,
                    owned.join(", ")
                );
                // Sending pairs one by one, each with the parts it skips; then the runs of pairs
                // that only skip.
                let mut mixed: Vec<ReplicaRun> = Vec::new();
                for pair in &rank.pairs {
                    let sends: Vec<String> = pair
                        .parts
                        .iter()
                        .filter(|p| p.action == Action::Send)
                        .map(|p| {
                            let part = &setup.parts[p.part].part;
                            units_text(part, &(p.first_unit..p.first_unit + p.num_units))
                        })
                        .collect();
                    if sends.is_empty() {
                        continue;
                    }
                    let (t, r) = pair_bytes(pair);
                    let _ = writeln!(
                        text,
                        "    prefill rank {} sends {}: {}",
                        pair.prefill_rank,
                        sends.join(", "),
                        bytes_text(t, r, self.tokens, setup.tokens_moved)
                    );
                    let skipped: Vec<(usize, Range<u32>, u32)> = pair
                        .parts
                        .iter()
                        .filter(|p| p.action == Action::SkipReplica)
                        .map(|p| (p.part, p.shared.clone(), p.sent_by))
                        .collect();
                    if skipped.is_empty() {
                        continue;
                    }
                    match mixed.last_mut() {
                        Some(run)
                            if run.prefill_ranks.end == pair.prefill_rank
                                && run.parts == skipped =>
                        {
                            run.prefill_ranks.end += 1;
                        }
                        _ => mixed.push(ReplicaRun {
                            decode_rank: rank.decode_rank,
                            prefill_ranks: pair.prefill_rank..pair.prefill_rank + 1,
                            parts: skipped,
                        }),
                    }
                }
                for run in mixed.iter().chain(&replica_runs(&rank)) {
                    let _ = writeln!(
                        text,
                        "    {}",
                        skips_text(setup, &run.prefill_ranks, &run.parts)
                    );
                }
                let _ = writeln!(
                    text,
                    "    receives {}",
                    bytes_text(
                        rank.bytes_per_token,
                        rank.bytes_per_request,
                        self.tokens,
                        setup.tokens_moved
                    )
                );
                out.write_all(text.as_bytes())?;
            }
        }
        Ok(())
    }

    /// The groups as the value of the plan's `"groups"` field: one object per group, its pairs
    /// that send one per line (each with every part it shares, those it skips included), then
    /// its `replicas`: the runs of pairs that only skip, condensed as [`replica_runs`] makes
    /// them; streamed as they are computed.
    pub fn write_json(&self, out: &mut dyn std::io::Write) -> Result<(), Failure> {
        use serde_json::{Value, json};
        let fail = |e: mori_tp::Error| LayoutError {
            summary: "a group's pair:".into(),
            problems: vec![Problem::from_library(&e)],
        };
        let range = |r: &Range<u32>| json!([r.start, r.end]);
        out.write_all(b"[")?;
        for (g, setup) in self.groups.iter().enumerate() {
            let group = &setup.group;
            let (storage, window) = match group.storage {
                Storage::Paged { window } => ("paged", window),
                Storage::Slot { .. } => ("slot", None),
            };
            let parts: Vec<Value> = setup
                .parts
                .iter()
                .zip(&setup.dtype_names)
                .map(|(p, dtype)| {
                    json!({
                        "name": p.part.name,
                        "unit": p.part.unit,
                        "units": p.part.units,
                        "unit_bytes": p.unit_bytes,
                        "dtype": dtype,
                        "held_whole": p.part.units == 1,
                        "must_divide": p.part.must_divide,
                    })
                })
                .collect();
            let head = json!({
                "name": group.name,
                "layers": group.layers,
                "buffers_per_layer": group.buffers_per_layer,
                "storage": storage,
                "window": window,
                "slot_steps": setup.steps,
                "tokens_moved": setup.tokens_moved,
                "parts": parts,
            });
            let head = head.to_string();
            // The object without its closing brace, so the pairs follow it.
            write!(
                out,
                "{}\n    {},\n    \"pairs\": [",
                if g == 0 { "\n  " } else { ",\n  " },
                &head[..head.len() - 1]
            )?;
            let mut ranks = Vec::new();
            let mut runs = Vec::new();
            let mut first = true;
            for rank in self.ranks(g) {
                let rank = rank.map_err(fail)?;
                for pair in &rank.pairs {
                    if !pair.parts.iter().any(|p| p.action == Action::Send) {
                        continue;
                    }
                    let (t, r) = pair_bytes(pair);
                    let parts: Vec<Value> = pair
                        .parts
                        .iter()
                        .map(|p| {
                            json!({
                                "part": setup.parts[p.part].part.name,
                                "action": p.action.as_str(),
                                "shared_units": range(&p.shared),
                                "sent_by": p.sent_by,
                                "first_unit": p.first_unit,
                                "num_units": p.num_units,
                                "src_first_local": p.src_first_local,
                                "dst_first_local": p.dst_first_local,
                                "bytes_per_token": p.bytes_per_token,
                                "bytes_per_request": p.bytes_per_request,
                            })
                        })
                        .collect();
                    let value = json!({
                        "prefill_rank": pair.prefill_rank,
                        "decode_rank": pair.decode_rank,
                        "bytes_per_token": t,
                        "bytes_per_request": r,
                        "parts": parts,
                    });
                    write!(out, "{}      {value}", if first { "\n" } else { ",\n" })?;
                    first = false;
                }
                for run in replica_runs(&rank) {
                    let parts: Vec<Value> = run
                        .parts
                        .iter()
                        .map(|(i, shared, sent_by)| {
                            json!({
                                "part": setup.parts[*i].part.name,
                                "shared_units": range(shared),
                                "sent_by": sent_by,
                            })
                        })
                        .collect();
                    runs.push(json!({
                        "decode_rank": run.decode_rank,
                        "prefill_ranks": range(&run.prefill_ranks),
                        "parts": parts,
                    }));
                }
                let owned: serde_json::Map<String, Value> = setup
                    .parts
                    .iter()
                    .zip(&rank.owned)
                    .map(|(p, r)| (p.part.name.to_string(), range(r)))
                    .collect();
                ranks.push(json!({
                    "decode_rank": rank.decode_rank,
                    "owned_units": owned,
                    "bytes_per_token": rank.bytes_per_token,
                    "bytes_per_request": rank.bytes_per_request,
                }));
            }
            out.write_all(b"\n    ],\n    \"replicas\": [")?;
            for (i, run) in runs.iter().enumerate() {
                write!(out, "{}      {run}", if i == 0 { "\n" } else { ",\n" })?;
            }
            out.write_all(b"\n    ],\n    \"decode_ranks\": [")?;
            for (i, rank) in ranks.iter().enumerate() {
                write!(out, "{}      {rank}", if i == 0 { "\n" } else { ",\n" })?;
            }
            out.write_all(b"\n    ]}")?;
        }
        out.write_all(b"\n  ]")?;
        Ok(())
    }
}

/// A family for people.
pub fn family_text(family: &str) -> &'static str {
    match family {
        "dense" => "dense attention",
        "mla" => "multi-head latent attention",
        "mla_indexer" => "MLA with a sparse-attention indexer",
        "sliding_window" => "full and sliding-window attention",
        "gated_deltanet" => "full attention and Gated DeltaNet",
        "mamba2" => "Mamba2 and attention",
        _ => "other",
    }
}
