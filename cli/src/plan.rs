//! `mori-tp plan`: which prefill rank sends which heads to each decode rank, at which offsets,
//! and what each decode rank receives; every number comes from the library's slice configs.

use std::fmt::Write as _;

use mori_tp::{Action, Pairing, SliceConfig};
use serde_json::{Value, json};

use crate::layout::{Layout, LayoutError, grouped, heads_text, human_bytes};
use crate::model::Attention;

/// One (prefill rank, decode rank) pair that shares heads.
struct Pair {
    prefill_rank: u32,
    decode_rank: u32,
    config: SliceConfig,
    pairing: Pairing,
    /// For a replica: the prefill rank that sends the shared heads instead.
    sent_by: u32,
}

/// The pairs of a layout that share heads, decode rank by decode rank, and their slices.
fn pairs(layout: &Layout) -> Result<Vec<Pair>, LayoutError> {
    let topology = &layout.topology;
    let mut pairs = Vec::new();
    for d in 0..layout.decode_tp() {
        for p in 0..layout.prefill_tp() {
            let config = layout.slice_config(p, d).map_err(|e| LayoutError {
                summary: format!("prefill rank {p} -> decode rank {d}:"),
                problems: vec![e.to_string()],
            })?;
            // Both ranks are below their TP sizes, and d owns the heads it shares with p.
            let pairing = topology.pairing(p, d).expect("ranks in range");
            if pairing.action == Action::NotPaired {
                continue;
            }
            let sent_by = topology
                .sender(d, pairing.shared_heads.start)
                .expect("d owns its shared heads");
            pairs.push(Pair {
                prefill_rank: p,
                decode_rank: d,
                config,
                pairing,
                sent_by,
            });
        }
    }
    Ok(pairs)
}

/// What one decode rank receives.
struct Received {
    /// Bytes per token per buffer: the sum of the widths of its senders.
    per_token_per_buffer: u64,
    /// Bytes per token over every buffer of every layer.
    per_token: u64,
    /// Bytes per request of `tokens` tokens (whole pages).
    per_request: u64,
}

fn received(layout: &Layout, pairs: &[Pair], d: u32, request_tokens: u64) -> Received {
    let per_token_per_buffer: u64 = pairs
        .iter()
        .filter(|pair| pair.decode_rank == d && pair.config.action == Action::Send)
        .map(|pair| pair.config.heads_bytes_per_token_to_send)
        .sum();
    let per_token = per_token_per_buffer.saturating_mul(layout.buffers(layout.model.layers));
    Received {
        per_token_per_buffer,
        per_token,
        per_request: per_token.saturating_mul(request_tokens),
    }
}

/// Tokens a request of `tokens` occupies: whole pages move.
fn request_tokens(layout: &Layout, tokens: u32) -> u64 {
    u64::from(tokens).div_ceil(u64::from(layout.page_size)) * u64::from(layout.page_size)
}

fn action_name(action: Action) -> &'static str {
    match action {
        Action::Send => "send",
        Action::SkipReplica => "skip_replica",
        Action::NotPaired => "not_paired",
    }
}

/// The plan as one JSON object.
pub fn json(layout: &Layout, tokens: u32) -> Result<Value, LayoutError> {
    let pairs = pairs(layout)?;
    let model = &layout.model;
    let request = request_tokens(layout, tokens);
    let pair_values: Vec<Value> = pairs
        .iter()
        .map(|pair| {
            let c = &pair.config;
            let mut value = json!({
                "prefill_rank": pair.prefill_rank,
                "decode_rank": pair.decode_rank,
                "action": action_name(c.action),
                "first_head": c.first_head,
                "num_heads": c.num_heads,
                "src_head_slice_offset": c.src_head_slice_offset,
                "dst_head_slice_offset": c.dst_head_slice_offset,
                "heads_bytes_per_token_to_send": c.heads_bytes_per_token_to_send,
                "bytes_per_token_src": c.bytes_per_token_src,
                "bytes_per_token_dst": c.bytes_per_token_dst,
                "shared_heads": [pair.pairing.shared_heads.start, pair.pairing.shared_heads.end],
            });
            if c.action == Action::SkipReplica {
                value["sent_by"] = json!(pair.sent_by);
            }
            value
        })
        .collect();
    let decode_ranks: Vec<Value> = (0..layout.decode_tp())
        .map(|d| {
            let heads = layout
                .topology
                .decode()
                .owned_heads(d)
                .expect("rank in range");
            let r = received(layout, &pairs, d, request);
            json!({
                "decode_rank": d,
                "heads": [heads.start, heads.end],
                "bytes_per_token_per_buffer": r.per_token_per_buffer,
                "bytes_per_token": r.per_token,
                "bytes_per_request": r.per_request,
            })
        })
        .collect();
    Ok(json!({
        "model": {
            "name": model.name,
            "attention": model.attention.label(),
            "kv_heads": model.kv_heads,
            "head_dim": model.head_dim,
            "layers": model.layers,
            "buffers_per_layer": model.attention.buffers_per_layer(),
            "dtype": layout.dtype.to_string(),
            "bytes_per_head": layout.bytes_per_head,
        },
        "prefill_tp": layout.prefill_tp(),
        "decode_tp": layout.decode_tp(),
        "page_size": layout.page_size,
        "src_item_len": layout.src_item_len,
        "dst_item_len": layout.dst_item_len,
        "request_tokens": request,
        "pairs": pair_values,
        "decode_ranks": decode_ranks,
    }))
}

/// The model and both sides, in a few lines (shared with `simulate`).
pub fn header(layout: &Layout) -> String {
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
    let _ = writeln!(
        out,
        "model:    {}: {} KV head{} x head_dim {}, {kind}, {} layers",
        m.name,
        m.kv_heads,
        if m.kv_heads == 1 { "" } else { "s" },
        m.head_dim,
        m.layers,
    );
    let _ = writeln!(
        out,
        "cache:    {}, {} B per head, pages of {} token{}",
        layout.dtype,
        layout.bytes_per_head,
        layout.page_size,
        if layout.page_size == 1 { "" } else { "s" },
    );
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

/// The plan for people.
pub fn text(layout: &Layout, tokens: u32) -> Result<String, LayoutError> {
    let pairs = pairs(layout)?;
    let request = request_tokens(layout, tokens);
    let sends = pairs
        .iter()
        .filter(|p| p.config.action == Action::Send)
        .count();
    let skips = pairs.len() - sends;
    let total = u64::from(layout.prefill_tp()) * u64::from(layout.decode_tp());
    let buffers = layout.buffers(layout.model.layers);

    let mut out = header(layout);
    let _ = writeln!(
        out,
        "valid layout: {sends} pair{} send, {skips} skip as replicas, {} share no head\n",
        if sends == 1 { "" } else { "s" },
        total - pairs.len() as u64,
    );
    for d in 0..layout.decode_tp() {
        let owned = layout
            .topology
            .decode()
            .owned_heads(d)
            .expect("rank in range");
        let _ = writeln!(out, "decode rank {d}, {}:", heads_text(owned));
        for pair in pairs.iter().filter(|p| p.decode_rank == d) {
            let c = &pair.config;
            let p = pair.prefill_rank;
            if c.action == Action::Send {
                let width = c.heads_bytes_per_token_to_send;
                let _ = writeln!(
                    out,
                    "  prefill rank {p} sends {}: bytes [{}, {}) of each {} B token -> [{}, {}) of \
                     each {} B token",
                    heads_text(c.first_head..c.first_head + c.num_heads),
                    c.src_head_slice_offset,
                    c.src_head_slice_offset + width,
                    c.bytes_per_token_src,
                    c.dst_head_slice_offset,
                    c.dst_head_slice_offset + width,
                    c.bytes_per_token_dst,
                );
            } else {
                let _ = writeln!(
                    out,
                    "  prefill rank {p} skips {} (a replica: prefill rank {} sends it)",
                    heads_text(pair.pairing.shared_heads.clone()),
                    pair.sent_by
                );
            }
        }
        let r = received(layout, &pairs, d, request);
        let _ = writeln!(
            out,
            "  receives {} B per token ({} B x {buffers} buffers), {} per {}-token request",
            grouped(r.per_token),
            grouped(r.per_token_per_buffer),
            human_bytes(r.per_request),
            grouped(request),
        );
    }
    Ok(out)
}
