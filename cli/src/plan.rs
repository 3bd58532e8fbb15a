//! `mori-tp plan`: which prefill rank sends which heads to each decode rank, at which offsets,
//! and what each decode rank receives; every number comes from the library's slice and pair
//! configs, and each sending pair's staging and segment counts from its pair plans.
//!
//! The plan is produced one decode rank at a time, visiting only the prefill ranks that share a
//! head with it, so time and memory grow with the pairs printed, never with P x D beyond them.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, Write};
use std::ops::Range;

use mori_tp::{
    Action, PairConfig, PairPlan, Request, SliceConfig, Staging, ValidLayout, pair_staging_for,
};
use serde_json::{Value, json};

use crate::layout::{Failure, Layout, LayoutError, grouped, heads_text, human_bytes};
use crate::model::Attention;

/// The most pages a side may have for `plan` to count segments: each side's page list is held
/// in memory (4 bytes a page) and walked. Past it the counts are left out, with a note.
pub const MAX_COUNTED_PAGES: u64 = 1 << 22;

/// One (prefill rank, decode rank) pair that shares heads.
#[derive(Clone, Debug)]
pub struct Pair {
    pub prefill_rank: u32,
    pub decode_rank: u32,
    /// The library's uniform slice: heads, and offsets and widths inside a token-major slot
    /// (see [`Layout::slice_config`]).
    pub config: SliceConfig,
    /// The global heads both ranks own.
    pub shared_heads: Range<u32>,
    /// The prefill rank that sends the shared heads (this one, for a sending pair).
    pub sent_by: u32,
    /// The staging an RDMA connector should use (`pair_staging_for`; none for a replica).
    pub staging: Staging,
    /// Bytes of one staging region for a request, over every buffer of every layer: what each
    /// staged side sets aside (0 for a replica).
    pub staging_bytes: u64,
    /// For a sending pair: the library's pair config of both ranks' layouts and what its plans
    /// give the transport.
    pub send: Option<Sending>,
}

/// A sending pair's config and segment counts.
#[derive(Clone, Debug)]
pub struct Sending {
    pub pair: PairConfig,
    /// Segments per buffer for the request on back-to-back pages (None past
    /// [`MAX_COUNTED_PAGES`]).
    pub segments: Option<SegmentCounts>,
    /// Buffers of the request (K and V, or one latent, per layer): a request's segment list
    /// is `segments` for each of them.
    pub buffers: u64,
}

/// The segments an RDMA engine gets per buffer for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentCounts {
    /// With the staging `pair_staging_for` picks (`pair_segments` of that mode).
    pub staged: u64,
    /// Pages to pages, unstaged (`pair_segments` of NONE).
    pub direct: u64,
}

impl Pair {
    /// True for the pair that moves the shared heads; false for a replica that skips.
    pub fn sends(&self) -> bool {
        self.config.action == Action::Send
    }

    /// The heads this pair moves (empty for a replica).
    pub fn heads(&self) -> Range<u32> {
        self.config.first_head..self.config.first_head + self.config.num_heads
    }
}

/// One decode rank: the heads it owns, every prefill rank that shares one, and what it receives.
#[derive(Clone, Debug)]
pub struct DecodeRank {
    pub rank: u32,
    pub heads: Range<u32>,
    /// Pairs in prefill rank order.
    pub pairs: Vec<Pair>,
    /// Bytes per token per buffer: the sum of the widths of its senders.
    pub per_token_per_buffer: u64,
    /// Bytes per token over every buffer of every layer.
    pub per_token: u64,
    /// Bytes per request of N tokens (only the request's tokens move, whatever the pages).
    pub per_request: u64,
}

/// The request `plan` counts segments for: N tokens on pages `0, 1, ...` of each side, back to
/// back, so each pair's counts are the fewest its layouts allow (each further run of pages adds
/// its own segments). The counts depend only on the shape of a pair (heads moved, their first
/// local index on each side), so each shape is counted once.
struct Counter {
    tokens: u64,
    /// Page lists, or None when a side has more than [`MAX_COUNTED_PAGES`].
    pages: Option<(Vec<i32>, Vec<i32>)>,
    counted: HashMap<(u32, u32, u32), SegmentCounts>,
}

impl Counter {
    fn new(layout: &Layout, tokens: u64) -> Counter {
        let (src, dst) = (
            layout.prefill_paging.pages(tokens),
            layout.decode_paging.pages(tokens),
        );
        let back_to_back = |n: u64| (0..n as i32).collect::<Vec<i32>>();
        Counter {
            tokens,
            pages: (src.max(dst) <= MAX_COUNTED_PAGES)
                .then(|| (back_to_back(src), back_to_back(dst))),
            counted: HashMap::new(),
        }
    }

    fn count(&mut self, pair: &PairConfig) -> mori_tp::Result<Option<SegmentCounts>> {
        let Some((src_pages, dst_pages)) = &self.pages else {
            return Ok(None);
        };
        let key = (
            pair.num_heads(),
            pair.src_first_local(),
            pair.dst_first_local(),
        );
        if let Some(&counts) = self.counted.get(&key) {
            return Ok(Some(counts));
        }
        let request = Request {
            src_pages,
            dst_pages,
            num_tokens: self.tokens,
        };
        let segments = |staging| -> mori_tp::Result<u64> {
            Ok(PairPlan::transfer(pair, &request, staging)?.num_segments()? as u64)
        };
        let counts = SegmentCounts {
            staged: segments(pair_staging_for(pair))?,
            direct: segments(Staging::None)?,
        };
        self.counted.insert(key, counts);
        Ok(Some(counts))
    }
}

/// Decode rank `d` with its pairs and totals.
fn decode_rank(
    layout: &Layout,
    d: u32,
    tokens: u32,
    counter: &mut Counter,
) -> Result<DecodeRank, LayoutError> {
    let topology = &layout.topology;
    let prefill = topology.prefill();
    // The library answers None or Err only for ranks and heads outside the layout; every rank
    // and head here comes from it.
    const IN_RANGE: &str = "ranks below their TP sizes, heads below the model's";
    let heads = layout.decode_heads(d);
    // The prefill ranks owning any of these heads are consecutive: from the first owner of the
    // first head to the last replica of the last one.
    let first = prefill.first_owner(heads.start).expect(IN_RANGE);
    let last = prefill.first_owner(heads.end - 1).expect(IN_RANGE) + prefill.replication() - 1;
    let buffers = layout.buffers(layout.model.layers);
    let mut pairs = Vec::new();
    for p in first..=last {
        let pairing = topology.pairing(p, d).expect(IN_RANGE);
        if pairing.action == Action::NotPaired {
            continue;
        }
        let fail = |e: mori_tp::Error| LayoutError {
            summary: format!("prefill rank {p} -> decode rank {d}:"),
            problems: vec![crate::layout::Problem::from_library(&e)],
        };
        let config = layout.slice_config(p, d).map_err(fail)?;
        let (mut staging, mut staging_bytes, mut send) = (Staging::None, 0, None);
        if config.action == Action::Send {
            let pair = layout.pair_config(p, d).map_err(fail)?;
            staging = pair_staging_for(&pair);
            let per_buffer = pair.staging_len(u64::from(tokens)).map_err(fail)?;
            staging_bytes = per_buffer.saturating_mul(buffers);
            let segments = counter.count(&pair).map_err(fail)?;
            send = Some(Sending {
                pair,
                segments,
                buffers,
            });
        }
        pairs.push(Pair {
            prefill_rank: p,
            decode_rank: d,
            config,
            staging,
            staging_bytes,
            send,
            sent_by: topology
                .sender(d, pairing.shared_heads.start)
                .expect(IN_RANGE),
            shared_heads: pairing.shared_heads,
        });
    }
    let per_token_per_buffer: u64 = pairs
        .iter()
        .filter(|pair| pair.sends())
        .map(|pair| pair.config.heads_bytes_per_token_to_send)
        .sum();
    let per_token = per_token_per_buffer.saturating_mul(buffers);
    Ok(DecodeRank {
        rank: d,
        heads,
        pairs,
        per_token_per_buffer,
        per_token,
        per_request: per_token.saturating_mul(u64::from(tokens)),
    })
}

/// Every decode rank in order, computed as the iterator advances.
pub fn decode_ranks(
    layout: &Layout,
    tokens: u32,
) -> impl Iterator<Item = Result<DecodeRank, LayoutError>> + '_ {
    let mut counter = Counter::new(layout, u64::from(tokens));
    (0..layout.decode_tp()).map(move |d| decode_rank(layout, d, tokens, &mut counter))
}

/// What an RDMA connector does for a sending pair with its staging, in words: who packs, who
/// unpacks, and the staging bytes per request. For the classic layout (token-major pages of one
/// size), each side `staging_for` leaves alone has a token slot exactly as wide as the slice, so
/// its runs of pages are contiguous: a segment per run.
fn staging_text(layout: &Layout, pair: &Pair) -> String {
    let (p, d) = (pair.prefill_rank, pair.decode_rank);
    let bytes = human_bytes(pair.staging_bytes);
    if !layout.is_classic() {
        return match pair.staging {
            Staging::None => "RDMA staging none: pages to pages on both sides".into(),
            Staging::Src => format!("RDMA staging src: prefill rank {p} packs {bytes} per request"),
            Staging::Dst => {
                format!(
                    "RDMA staging dst: segments into {bytes} per request; decode rank {d} unpacks"
                )
            }
            Staging::Both => format!(
                "RDMA staging both: prefill rank {p} packs {bytes} per request, decode rank {d} \
                 unpacks"
            ),
        };
    }
    match pair.staging {
        Staging::None => {
            "RDMA staging none: the slice is the whole token on both sides; a segment per run"
                .into()
        }
        Staging::Src => format!(
            "RDMA staging src: prefill rank {p} packs {bytes} per request; a segment per run"
        ),
        Staging::Dst => format!(
            "RDMA staging dst: a segment per run into {bytes} per request; decode rank {d} unpacks"
        ),
        Staging::Both => format!(
            "RDMA staging both: prefill rank {p} packs {bytes} per request, a segment per buffer, \
             decode rank {d} unpacks"
        ),
    }
}

/// A sending pair's segment counts in words.
fn segments_text(pair: &Pair) -> Option<String> {
    let send = pair.send.as_ref()?;
    let counts = send.segments?;
    let plural = |n: u64| format!("{} segment{}", grouped(n), if n == 1 { "" } else { "s" });
    let per_request = |n: u64| grouped(n.saturating_mul(send.buffers));
    Some(match pair.staging {
        Staging::None => format!(
            "segments per buffer: {} (pages to pages); per request ({} buffers): {}",
            plural(counts.direct),
            send.buffers,
            per_request(counts.direct)
        ),
        staging => format!(
            "segments per buffer: {} with staging {}, {} unstaged; per request ({} buffers): \
             {} and {}",
            plural(counts.staged),
            staging.as_str(),
            grouped(counts.direct),
            send.buffers,
            per_request(counts.staged),
            per_request(counts.direct)
        ),
    })
}

/// `[start, end)` as a JSON pair.
fn range_json(range: &Range<u32>) -> Value {
    json!([range.start, range.end])
}

/// One pair as a JSON object on one line, written field by field: a plan can hold a million
/// pairs, and a `Value` per pair would cost far more than the numbers themselves.
fn write_pair_json(out: &mut dyn Write, pair: &Pair) -> io::Result<()> {
    let c = &pair.config;
    write!(
        out,
        "{{\"prefill_rank\":{},\"decode_rank\":{},\"action\":\"{}\",\"first_head\":{},\
         \"num_heads\":{},\"src_head_slice_offset\":{},\"dst_head_slice_offset\":{},\
         \"heads_bytes_per_token_to_send\":{},\"bytes_per_token_src\":{},\
         \"bytes_per_token_dst\":{},\"shared_heads\":[{},{}]",
        pair.prefill_rank,
        pair.decode_rank,
        c.action.as_str(),
        c.first_head,
        c.num_heads,
        c.src_head_slice_offset,
        c.dst_head_slice_offset,
        c.heads_bytes_per_token_to_send,
        c.bytes_per_token_src,
        c.bytes_per_token_dst,
        pair.shared_heads.start,
        pair.shared_heads.end,
    )?;
    if let Some(send) = &pair.send {
        write!(
            out,
            ",\"staging\":\"{}\",\"staging_bytes_per_request\":{}",
            pair.staging.as_str(),
            pair.staging_bytes
        )?;
        let counts = send.segments;
        let count = |n: Option<u64>| n.map_or(Value::Null, |n| json!(n));
        write!(
            out,
            ",\"src_first_local\":{},\"dst_first_local\":{},\"segments_per_buffer\":{},\
             \"direct_segments_per_buffer\":{},\"segments_per_request\":{},\
             \"direct_segments_per_request\":{},\"src_layout\":{},\"dst_layout\":{}",
            send.pair.src_first_local(),
            send.pair.dst_first_local(),
            count(counts.map(|c| c.staged)),
            count(counts.map(|c| c.direct)),
            count(counts.map(|c| c.staged.saturating_mul(send.buffers))),
            count(counts.map(|c| c.direct.saturating_mul(send.buffers))),
            layout_json(send.pair.src().layout()),
            layout_json(send.pair.dst().layout()),
        )?;
    } else {
        write!(out, ",\"sent_by\":{}", pair.sent_by)?;
    }
    out.write_all(b"}")
}

/// A rank's layout with the fields and field order of `MoriTpLayout`.
fn layout_json(l: &mori_tp::Layout) -> Value {
    json!({
        "total_kv_heads": l.total_kv_heads,
        "tp_size": l.tp_size,
        "tp_rank": l.tp_rank,
        "page_size": l.page_size,
        "head_bytes": l.head_bytes,
        "page_stride": l.page_stride,
        "offset": l.offset,
        "token_stride": l.token_stride,
        "head_stride": l.head_stride,
    })
}

fn decode_rank_json(rank: &DecodeRank) -> Value {
    json!({
        "decode_rank": rank.rank,
        "heads": range_json(&rank.heads),
        "bytes_per_token_per_buffer": rank.per_token_per_buffer,
        "bytes_per_token": rank.per_token,
        "bytes_per_request": rank.per_request,
    })
}

/// The fields of the plan's JSON object that come before the pairs.
fn json_head(layout: &Layout, tokens: u32) -> Vec<(&'static str, Value)> {
    let model = &layout.model;
    let n = u64::from(tokens);
    let (pre, dec) = (&layout.prefill_paging, &layout.decode_paging);
    let mut model_json = json!({
        "name": model.name,
        "attention": model.attention.label(),
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "layers": model.layers,
        "buffers_per_layer": model.attention.buffers_per_layer(),
        "dtype": layout.dtype.to_string(),
        "bytes_per_head": layout.bytes_per_head,
    });
    // A model read from a config.json: its family and every layer (`layers` counts the main
    // group's, which the pairs describe; "groups" describes them all).
    if let Some(facts) = &model.facts {
        model_json["family"] = json!(facts.family);
        model_json["total_layers"] = json!(facts.total_layers);
        model_json["main_group"] = json!(facts.main_group().name);
    }
    vec![
        ("model", model_json),
        ("prefill_tp", json!(layout.prefill_tp())),
        ("decode_tp", json!(layout.decode_tp())),
        // null when the sides' page sizes differ: see prefill_page_size and decode_page_size.
        ("page_size", json!(layout.common_page_size())),
        ("src_item_len", json!(layout.src_item_len)),
        ("dst_item_len", json!(layout.dst_item_len)),
        ("request_tokens", json!(n)),
        ("prefill_layout", json!(pre.order.as_str())),
        ("decode_layout", json!(dec.order.as_str())),
        ("prefill_page_size", json!(pre.page_size)),
        ("decode_page_size", json!(dec.page_size)),
        ("prefill_pages", json!(pre.pages(n))),
        ("decode_pages", json!(dec.pages(n))),
        (
            "partial_last_page",
            json!(pre.unused_slots(n) > 0 || dec.unused_slots(n) > 0),
        ),
    ]
}

/// Writes the plan as one JSON object: the layout's fields, then `"pairs"` and `"decode_ranks"`
/// with one element per line, streamed as they are computed. The layout must be valid.
pub fn write_json(
    layout: &Layout,
    tokens: u32,
    groups: Option<&crate::group_plan::GroupsPlan>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    out.write_all(b"{\n")?;
    for (key, value) in json_head(layout, tokens) {
        writeln!(out, "  {}: {value},", json!(key))?;
    }
    out.write_all(b"  \"pairs\": [")?;
    let mut ranks = Vec::with_capacity(layout.decode_tp() as usize);
    let mut first = true;
    for rank in decode_ranks(layout, tokens) {
        let rank = rank?;
        for pair in &rank.pairs {
            out.write_all(if first { b"\n    " } else { b",\n    " })?;
            write_pair_json(out, pair)?;
            first = false;
        }
        ranks.push(decode_rank_json(&rank));
    }
    out.write_all(b"\n  ],\n  \"decode_ranks\": [")?;
    for (i, rank) in ranks.iter().enumerate() {
        let separator = if i == 0 { "\n" } else { ",\n" };
        write!(out, "{separator}    {rank}")?;
    }
    out.write_all(b"\n  ]")?;
    if let Some(groups) = groups {
        out.write_all(b",\n  \"groups\": ")?;
        groups.write_json(out)?;
    }
    out.write_all(b"\n}\n")?;
    Ok(())
}

/// What follows the header about a model of several groups: `plan` prints every group below
/// it, `simulate` moves the main group only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtherGroups {
    Below,
    NotSimulated,
}

/// The model and both sides, in a few lines (shared with `simulate`).
pub fn header(layout: &Layout, others: OtherGroups) -> String {
    let m = &layout.model;
    let storage = if m.attention.buffers_per_layer() == 1 {
        "one latent buffer per layer"
    } else {
        "K and V buffers per layer"
    };
    let mut out = String::new();
    let kind = match m.attention {
        Attention::KeyValue => storage.to_string(),
        other => format!("{} ({storage})", other.label()),
    };
    let layers = match &m.facts {
        Some(facts) if facts.is_hybrid() => format!(
            "{} of {} layers (the {} group; {})",
            m.layers,
            facts.total_layers,
            facts.main_group().name,
            match others {
                OtherGroups::Below => "all groups below",
                OtherGroups::NotSimulated =>
                    "`plan` lists every group, this simulation moves \
                                            this one",
            }
        ),
        _ => format!("{} layer{}", m.layers, if m.layers == 1 { "" } else { "s" }),
    };
    let _ = writeln!(
        out,
        "model:    {}: {} KV head{} x head_dim {}, {kind}, {layers}",
        m.name,
        m.kv_heads,
        if m.kv_heads == 1 { "" } else { "s" },
        m.head_dim,
    );
    if layout.is_classic() {
        let page_size = layout.prefill_paging.page_size;
        let _ = writeln!(
            out,
            "cache:    {}, {} B per head, pages of {} token{}",
            layout.dtype,
            layout.bytes_per_head,
            page_size,
            if page_size == 1 { "" } else { "s" },
        );
    } else {
        let _ = writeln!(
            out,
            "cache:    {}, {} B per head; prefill {}, decode {}",
            layout.dtype,
            layout.bytes_per_head,
            layout.prefill_paging.describe(),
            layout.decode_paging.describe(),
        );
    }
    let _ = writeln!(
        out,
        "prefill:  TP {}, {}",
        layout.prefill_tp(),
        layout.describe_side(layout.topology.prefill())
    );
    let _ = writeln!(
        out,
        "decode:   TP {}, {}",
        layout.decode_tp(),
        layout.describe_side(layout.topology.decode())
    );
    out
}

/// `rank 3`, `ranks 1-7`.
fn ranks_text(ranks: &Range<u32>) -> String {
    if ranks.len() == 1 {
        format!("rank {}", ranks.start)
    } else {
        format!("ranks {}-{}", ranks.start, ranks.end - 1)
    }
}

/// Where `n` heads from local head `first` lie in a rank's pages: `[0, 512) of each 1024 B
/// token` (token-major: the heads of a slot are back to back) or `[4096, 8192) of each 16384 B
/// head-major page` (each head's slots are back to back).
fn slice_place(valid: &ValidLayout, first: u32, n: u32) -> String {
    let l = valid.layout();
    let start = l.offset + u64::from(first) * l.head_stride;
    if l.page_size > 1 && l.head_stride > l.token_stride {
        let end = start + u64::from(n) * l.head_stride;
        format!(
            "[{start}, {end}) of each {} B head-major page",
            l.page_stride
        )
    } else {
        let end = start + u64::from(n) * l.head_bytes;
        let token = u64::from(valid.local_heads()) * l.head_bytes;
        format!("[{start}, {end}) of each {token} B token")
    }
}

/// The request the plan's totals and segment counts are for, in one line.
fn request_text(layout: &Layout, tokens: u32) -> String {
    let n = u64::from(tokens);
    let (pre, dec) = (&layout.prefill_paging, &layout.decode_paging);
    let pages = |paging: &crate::layout::Paging, name: &str| {
        let count = paging.pages(n);
        let s = if count == 1 { "" } else { "s" };
        format!("{} {name}page{s} of {}", grouped(count), paging.page_size)
    };
    let mut text = format!("{} tokens on ", grouped(n));
    if pre.page_size == dec.page_size {
        text += &pages(pre, "");
        text += " a side";
    } else {
        text += &format!("{} and {}", pages(pre, "prefill "), pages(dec, "decode "));
    }
    if let Some(partial) = layout.partial_pages(n) {
        text += "; ";
        text += &partial;
    }
    if pre.pages(n).max(dec.pages(n)) <= MAX_COUNTED_PAGES {
        text += "; segments counted with the pages back to back";
    } else {
        text += &format!(
            "; segments not counted past {} pages a side",
            grouped(MAX_COUNTED_PAGES)
        );
    }
    crate::layout::labelled("request:", &text)
}

/// One decode rank's lines: each sender, the replicas that skip (consecutive prefill ranks that
/// skip the same heads for the same sender on one line), and what it receives.
fn rank_text(layout: &Layout, rank: &DecodeRank, tokens: u32) -> String {
    let mut out = format!(
        "decode rank {}, {}:\n",
        rank.rank,
        heads_text(rank.heads.clone())
    );
    let mut i = 0;
    while i < rank.pairs.len() {
        let pair = &rank.pairs[i];
        let c = &pair.config;
        let p = pair.prefill_rank;
        if let Some(send) = &pair.send {
            let _ = writeln!(
                out,
                "  prefill rank {p} sends {}: bytes {} -> {}",
                heads_text(pair.heads()),
                slice_place(send.pair.src(), send.pair.src_first_local(), c.num_heads),
                slice_place(send.pair.dst(), send.pair.dst_first_local(), c.num_heads),
            );
            let _ = writeln!(out, "    {}", staging_text(layout, pair));
            if let Some(segments) = segments_text(pair) {
                let _ = writeln!(out, "    {segments}");
            }
            i += 1;
            continue;
        }
        let same = |other: &Pair| {
            !other.sends()
                && other.shared_heads == pair.shared_heads
                && other.sent_by == pair.sent_by
        };
        let mut end = i + 1;
        while end < rank.pairs.len()
            && same(&rank.pairs[end])
            && rank.pairs[end].prefill_rank == rank.pairs[end - 1].prefill_rank + 1
        {
            end += 1;
        }
        let ranks = p..rank.pairs[end - 1].prefill_rank + 1;
        let _ = writeln!(
            out,
            "  prefill {} skip{} {} (replica{}: prefill rank {} sends it)",
            ranks_text(&ranks),
            if ranks.len() == 1 { "s" } else { "" },
            heads_text(pair.shared_heads.clone()),
            if ranks.len() == 1 { "" } else { "s" },
            pair.sent_by
        );
        i = end;
    }
    let _ = writeln!(
        out,
        "  receives {} B per token ({} B x {} buffers), {} per {}-token request",
        grouped(rank.per_token),
        grouped(rank.per_token_per_buffer),
        layout.buffers(layout.model.layers),
        human_bytes(rank.per_request),
        grouped(u64::from(tokens)),
    );
    out
}

/// Writes the plan for people: the header, the counts, then each decode rank as it is computed.
pub fn write_text(layout: &Layout, tokens: u32, out: &mut dyn Write) -> Result<(), Failure> {
    // The counts come first but need every pair; a first pass counts without keeping them.
    let (mut sends, mut skips) = (0u64, 0u64);
    for rank in decode_ranks(layout, tokens) {
        for pair in rank?.pairs {
            if pair.sends() {
                sends += 1;
            } else {
                skips += 1;
            }
        }
    }
    let total = u64::from(layout.prefill_tp()) * u64::from(layout.decode_tp());
    out.write_all(header(layout, OtherGroups::Below).as_bytes())?;
    out.write_all(request_text(layout, tokens).as_bytes())?;
    writeln!(
        out,
        "valid layout: {sends} pair{} send, {skips} skip as replicas, {} share no head\n",
        if sends == 1 { "" } else { "s" },
        total - sends - skips,
    )?;
    for rank in decode_ranks(layout, tokens) {
        out.write_all(rank_text(layout, &rank?, tokens).as_bytes())?;
    }
    Ok(())
}
