//! Whole transfers in host memory, every rank pair, byte for byte: each decode rank must end
//! with exactly its heads of exactly the requested pages, and nothing else may change.

mod common;

use common::{Request, SideBuffers, expected_decode, fragmented_request, valid_tp};
use mori_tp::{Action, Plan, SliceParams, send_host, slice_config};

/// A model's KV geometry: heads, elements per head, and whether V has its own buffers.
#[derive(Clone, Copy, Debug)]
struct Model {
    name: &'static str,
    kv_heads: u32,
    head_dim: usize,
    separate_v: bool,
}

const MODELS: [Model; 8] = [
    Model {
        name: "llama-3.1-8b",
        kv_heads: 8,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "llama-3.1-70b",
        kv_heads: 8,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen2.5-7b",
        kv_heads: 4,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen3-30b-a3b",
        kv_heads: 4,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen2.5-1.5b",
        kv_heads: 2,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "glm-4-9b",
        kv_heads: 2,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "gpt-oss-120b",
        kv_heads: 8,
        head_dim: 64,
        separate_v: true,
    },
    // MLA: one latent "head" of kv_lora_rank 512 + qk_rope_head_dim 64 elements, no V buffer.
    Model {
        name: "deepseek-v3",
        kv_heads: 1,
        head_dim: 576,
        separate_v: false,
    },
];

const TP_SIZES: [u32; 5] = [1, 2, 4, 8, 16];
/// bf16 and fp8.
const DTYPE_BYTES: [usize; 2] = [2, 1];
const PAGE_SIZES: [usize; 2] = [1, 16];
const LAYERS: usize = 2;

struct Outcome {
    copies: usize,
    pages: usize,
}

/// Runs every (prefill rank, decode rank) pair of one deployment and checks every decode byte.
fn transfer(
    heads: u32,
    bytes_per_head: usize,
    num_buffers: usize,
    p_tp: u32,
    d_tp: u32,
    page_size: usize,
    request: &Request,
) -> Outcome {
    let src = SideBuffers::identified(
        heads,
        p_tp,
        page_size,
        bytes_per_head,
        request.src_capacity_pages,
        num_buffers,
    );
    let initial = SideBuffers::sentinel(
        heads,
        d_tp,
        page_size,
        bytes_per_head,
        request.dst_capacity_pages,
        num_buffers,
    );
    let mut dst = initial.ranks.clone();
    let mut copies = 0;
    for p in 0..p_tp {
        for d in 0..d_tp {
            let config = slice_config(&SliceParams {
                prefill_tp_size: p_tp,
                prefill_tp_rank: p,
                decode_tp_size: d_tp,
                decode_tp_rank: d,
                total_kv_heads: heads,
                page_size: page_size as u32,
                src_item_len: src.item_len() as u64,
                dst_item_len: initial.item_len() as u64,
            })
            .unwrap();
            let plan = Plan::new(&config, &request.src_pages, &request.dst_pages).unwrap();
            let src_bufs: Vec<&[u8]> = src.ranks[p as usize].iter().map(Vec::as_slice).collect();
            let mut dst_bufs: Vec<&mut [u8]> =
                dst[d as usize].iter_mut().map(Vec::as_mut_slice).collect();
            let report = send_host(&plan, &src_bufs, &mut dst_bufs).unwrap();
            if config.action == Action::Send {
                assert_eq!(report.copies, plan.num_rects() * num_buffers);
            } else {
                assert_eq!(report.copies, 0);
            }
            copies += report.copies;
        }
    }
    let expected = expected_decode(&initial, request);
    for d in 0..d_tp as usize {
        for b in 0..num_buffers {
            if dst[d][b] != expected[d][b] {
                let at = dst[d][b]
                    .iter()
                    .zip(&expected[d][b])
                    .position(|(a, e)| a != e)
                    .unwrap();
                panic!(
                    "decode rank {d} buffer {b}: first wrong byte at {at} (page {}, byte {} of \
                     the page)",
                    at / initial.item_len(),
                    at % initial.item_len()
                );
            }
        }
    }
    Outcome {
        copies,
        pages: request.src_pages.len(),
    }
}

#[test]
fn every_model_tp_pair_page_size_and_dtype_lands_byte_exact() {
    let mut deployments = 0;
    for (m, model) in MODELS.iter().enumerate() {
        let num_buffers = if model.separate_v { 2 * LAYERS } else { LAYERS };
        for &dtype in &DTYPE_BYTES {
            for &page_size in &PAGE_SIZES {
                for &p_tp in &TP_SIZES {
                    for &d_tp in &TP_SIZES {
                        assert!(valid_tp(model.kv_heads, p_tp) && valid_tp(model.kv_heads, d_tp));
                        let seed = (m as u64) << 32 | u64::from(p_tp) << 16 | u64::from(d_tp);
                        let runs = if page_size == 1 { 7 } else { 3 };
                        let request = fragmented_request(seed ^ page_size as u64, runs);
                        let outcome = std::panic::catch_unwind(|| {
                            transfer(
                                model.kv_heads,
                                model.head_dim * dtype,
                                num_buffers,
                                p_tp,
                                d_tp,
                                page_size,
                                &request,
                            )
                        });
                        if outcome.is_err() {
                            panic!(
                                "{} dtype_bytes={dtype} page_size={page_size} P={p_tp} D={d_tp} \
                                 {request:?}",
                                model.name
                            );
                        }
                        deployments += 1;
                    }
                }
            }
        }
    }
    assert_eq!(deployments, MODELS.len() * 2 * 2 * 25);
}

#[test]
fn non_integer_ratios_and_replication_on_both_sides_land_byte_exact() {
    // (H, P, D): non-integer ratios, both sides replicated, MQA with odd TP sizes.
    for (h, p_tp, d_tp) in [
        (12, 6, 4),
        (12, 4, 6),
        (4, 12, 8),
        (3, 6, 12),
        (2, 6, 4),
        (1, 3, 5),
    ] {
        let request = fragmented_request(u64::from(h * 1000 + p_tp * 10 + d_tp), 5);
        transfer(h, 12, 2, p_tp, d_tp, 4, &request);
    }
}

#[test]
fn a_run_of_pages_contiguous_on_both_sides_is_one_copy_per_buffer() {
    let request = Request {
        src_pages: (10..20).collect(),
        dst_pages: (3..13).collect(),
        src_capacity_pages: 20,
        dst_capacity_pages: 13,
    };
    // Qwen2.5-7B, prefill TP 2, decode TP 8: four heads, two per prefill rank, one per decode
    // pair of ranks. Each decode rank has exactly one sender and one rect per buffer.
    let outcome = transfer(4, 256, 4, 2, 8, 16, &request);
    assert_eq!(outcome.pages, 10);
    assert_eq!(outcome.copies, 8 * 4, "one rect per buffer per decode rank");
}

#[test]
fn an_empty_request_changes_nothing() {
    let request = Request {
        src_pages: vec![],
        dst_pages: vec![],
        src_capacity_pages: 2,
        dst_capacity_pages: 2,
    };
    let outcome = transfer(8, 256, 2, 2, 4, 16, &request);
    assert_eq!(outcome.copies, 0);
}
