//! Property tests of the head-ownership and sender rule over every valid (H, P, D) with
//! H in {1, 2, 3, 4, 6, 8, 12, 16, 32, 64} and P, D in 1..=32.

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{HEAD_COUNTS, owned_heads, valid_tp};
use mori_tp::{Action, SliceConfig, SliceParams, slice_config};

/// Bytes of one head in these tests; any value works, an odd one catches offset mix-ups.
const BPH: u64 = 6;
const PAGE_SIZE: u32 = 3;

fn valid_layouts() -> impl Iterator<Item = (u32, u32, u32)> {
    HEAD_COUNTS
        .into_iter()
        .flat_map(|h| (1..=32u32).flat_map(move |p| (1..=32u32).map(move |d| (h, p, d))))
        .filter(|&(h, p, d)| valid_tp(h, p) && valid_tp(h, d))
}

fn params(h: u32, p_tp: u32, p: u32, d_tp: u32, d: u32) -> SliceParams {
    let item = |tp| u64::from(PAGE_SIZE) * owned_heads(h, tp, 0).len() as u64 * BPH;
    SliceParams {
        prefill_tp_size: p_tp,
        prefill_tp_rank: p,
        decode_tp_size: d_tp,
        decode_tp_rank: d,
        total_kv_heads: h,
        page_size: PAGE_SIZE,
        src_item_len: item(p_tp),
        dst_item_len: item(d_tp),
    }
}

/// Every config of a layout, indexed `[p][d]`.
fn all_configs(h: u32, p_tp: u32, d_tp: u32) -> Vec<Vec<SliceConfig>> {
    (0..p_tp)
        .map(|p| {
            (0..d_tp)
                .map(|d| {
                    slice_config(&params(h, p_tp, p, d_tp, d))
                        .unwrap_or_else(|e| panic!("H={h} P={p_tp} D={d_tp} p={p} d={d}: {e}"))
                })
                .collect()
        })
        .collect()
}

#[test]
fn every_decode_head_is_written_by_exactly_one_prefill_rank() {
    let mut layouts = 0;
    for (h, p_tp, d_tp) in valid_layouts() {
        layouts += 1;
        let configs = all_configs(h, p_tp, d_tp);
        let mut writers: HashMap<(u32, u32), Vec<u32>> = HashMap::new();
        for (p, row) in configs.iter().enumerate() {
            for (d, c) in row.iter().enumerate() {
                if c.action == Action::Send {
                    for head in c.first_head..c.first_head + c.num_heads {
                        writers.entry((d as u32, head)).or_default().push(p as u32);
                    }
                }
            }
        }
        for d in 0..d_tp {
            for head in owned_heads(h, d_tp, d) {
                let senders = writers.remove(&(d, head)).unwrap_or_default();
                assert_eq!(
                    senders.len(),
                    1,
                    "H={h} P={p_tp} D={d_tp}: head {head} of decode rank {d} written by {senders:?}"
                );
            }
        }
        assert!(
            writers.is_empty(),
            "H={h} P={p_tp} D={d_tp}: heads sent to non-owners: {writers:?}"
        );
    }
    // The filter above must not have silently emptied the sweep.
    assert!(layouts > 1000, "only {layouts} layouts checked");
}

#[test]
fn actions_offsets_and_widths_follow_the_owned_heads_of_both_ranks() {
    for (h, p_tp, d_tp) in valid_layouts() {
        for (p, row) in all_configs(h, p_tp, d_tp).iter().enumerate() {
            for (d, c) in row.iter().enumerate() {
                let src = owned_heads(h, p_tp, p as u32);
                let dst = owned_heads(h, d_tp, d as u32);
                let shared = src.start.max(dst.start)..src.end.min(dst.end);
                let at = format!("H={h} P={p_tp} D={d_tp} p={p} d={d}: {c:?}");
                assert_eq!(c.bytes_per_token_src, src.len() as u64 * BPH, "{at}");
                assert_eq!(c.bytes_per_token_dst, dst.len() as u64 * BPH, "{at}");
                match c.action {
                    Action::NotPaired => assert!(shared.is_empty(), "{at}"),
                    Action::SkipReplica => {
                        assert!(!shared.is_empty(), "{at}");
                        assert_eq!(
                            (c.num_heads, c.heads_bytes_per_token_to_send),
                            (0, 0),
                            "{at}"
                        );
                    }
                    Action::Send => {
                        // A sender moves every head the pair shares, from and to its own slot.
                        assert_eq!(c.first_head..c.first_head + c.num_heads, shared, "{at}");
                        let width = u64::from(c.num_heads) * BPH;
                        assert_eq!(c.heads_bytes_per_token_to_send, width, "{at}");
                        assert_eq!(
                            c.src_head_slice_offset,
                            u64::from(shared.start - src.start) * BPH,
                            "{at}"
                        );
                        assert_eq!(
                            c.dst_head_slice_offset,
                            u64::from(shared.start - dst.start) * BPH,
                            "{at}"
                        );
                        assert!(
                            c.src_head_slice_offset + width <= c.bytes_per_token_src,
                            "{at}"
                        );
                        assert!(
                            c.dst_head_slice_offset + width <= c.bytes_per_token_dst,
                            "{at}"
                        );
                    }
                }
            }
        }
    }
}

/// The prefill ranks SGLang's disaggregation pairs with decode rank `d` when P/D or D/P is an
/// integer: `d*P/D` when D >= P; when P > D, the first rank of each replica group (ranks owning
/// the same heads) inside `[d*P/D, (d+1)*P/D)`.
fn sglang_senders(h: u32, p_tp: u32, d_tp: u32, d: u32) -> BTreeSet<u32> {
    if d_tp >= p_tp {
        return BTreeSet::from([d * p_tp / d_tp]);
    }
    let mut firsts: HashMap<u32, u32> = HashMap::new();
    for p in d * p_tp / d_tp..(d + 1) * p_tp / d_tp {
        let group = owned_heads(h, p_tp, p).start;
        firsts.entry(group).or_insert(p);
    }
    firsts.into_values().collect()
}

#[test]
fn integer_tp_ratios_reproduce_sglang_rank_pairing() {
    let mut checked = 0;
    for (h, p_tp, d_tp) in valid_layouts().filter(|&(_, p, d)| p % d == 0 || d % p == 0) {
        let configs = all_configs(h, p_tp, d_tp);
        for d in 0..d_tp {
            let senders: BTreeSet<u32> = (0..p_tp)
                .filter(|&p| configs[p as usize][d as usize].action == Action::Send)
                .collect();
            assert_eq!(
                senders,
                sglang_senders(h, p_tp, d_tp, d),
                "H={h} P={p_tp} D={d_tp} decode rank {d}"
            );
            checked += 1;
        }
    }
    assert!(checked > 1000, "only {checked} decode ranks checked");
}

#[test]
fn non_integer_tp_ratio_h12_p6_d4_splits_heads_across_two_senders() {
    // P=6 owns heads in pairs, D=4 in triples: decode rank 1 (heads 3..6) takes head 3 from
    // prefill rank 1 and heads 4, 5 from prefill rank 2.
    let configs = all_configs(12, 6, 4);
    let c = &configs[1][1];
    assert_eq!((c.action, c.first_head, c.num_heads), (Action::Send, 3, 1));
    assert_eq!((c.src_head_slice_offset, c.dst_head_slice_offset), (BPH, 0));
    let c = &configs[2][1];
    assert_eq!((c.action, c.first_head, c.num_heads), (Action::Send, 4, 2));
    assert_eq!((c.src_head_slice_offset, c.dst_head_slice_offset), (0, BPH));
    assert_eq!(configs[0][1].action, Action::NotPaired);
}

/// The slice arithmetic of the original connector (`../shared/seed`), for the case D >= P: the
/// decode rank `d` pulls from prefill rank `d*P/D` the heads starting at
/// `(d * dst_heads_per_rank) % src_heads_per_rank`.
fn seed_formula_first_head(h: u32, p_tp: u32, d_tp: u32, d: u32) -> u32 {
    let src_heads = (h / p_tp).max(1);
    let dst_heads = (h / d_tp).max(1);
    let p = d * p_tp / d_tp;
    owned_heads(h, p_tp, p).start + (d * dst_heads) % src_heads
}

#[test]
fn prefill_tp_below_heads_below_decode_tp_gets_the_right_heads_where_the_seed_formula_did_not() {
    // 4 KV heads, prefill TP 2, decode TP 8: decode rank 2 owns head 1.
    let (h, p_tp, d_tp, d) = (4, 2, 8, 2);
    assert_eq!(owned_heads(h, d_tp, d), 1..2);
    assert_eq!(
        seed_formula_first_head(h, p_tp, d_tp, d),
        0,
        "the seed formula sends head 0"
    );
    let configs = all_configs(h, p_tp, d_tp);
    let c = &configs[0][d as usize];
    assert_eq!((c.action, c.first_head, c.num_heads), (Action::Send, 1, 1));
    assert_eq!(
        c.src_head_slice_offset, BPH,
        "head 1 sits one head into prefill rank 0's token"
    );
}

#[test]
fn the_worked_examples_of_reference_md_hold() {
    // (H, P, D, decode rank d) -> the (head, sender) pairs the table in REFERENCE.md section 3
    // gives, for every decode rank of each layout.
    type Row = fn(u32) -> Vec<(u32, u32)>;
    let rows: [(u32, u32, u32, Row); 5] = [
        (4, 2, 8, |d| vec![(d / 2, d / 4)]),
        (8, 8, 2, |d| (4 * d..4 * d + 4).map(|h| (h, h)).collect()),
        (8, 16, 4, |d| vec![(2 * d, 4 * d), (2 * d + 1, 4 * d + 2)]),
        (12, 6, 4, |d| {
            (3 * d..3 * d + 3).map(|h| (h, h / 2)).collect()
        }),
        (1, 8, 4, |d| vec![(0, 2 * d)]),
    ];
    for (h, p_tp, d_tp, expected) in rows {
        let topology = mori_tp::Topology::new(h, p_tp, d_tp).unwrap();
        for d in 0..d_tp {
            let heads = topology.decode().owned_heads(d).unwrap();
            let actual: Vec<(u32, u32)> = heads
                .map(|head| (head, topology.sender(d, head).unwrap()))
                .collect();
            assert_eq!(actual, expected(d), "H={h} P={p_tp} D={d_tp} d={d}");
        }
    }
}
