//! Simulates one request of a deployment older SGLang releases get wrong, Qwen2.5-7B (4 KV heads,
//! head_dim 128, bf16) with prefill TP 2 and decode TP 8, in host memory, through the Rust API,
//! and verifies every decode byte.
//!
//! Run: `cargo run --release --example simulate`

use mori_tp::{Action, SliceParams, SlicePlan, send_host, slice_config};

const HEADS: u32 = 4;
const HEAD_BYTES: usize = 128 * 2;
const PAGE_SIZE: usize = 16;
const BUFFERS: usize = 2 * 4; // K and V of 4 layers
const PREFILL_TP: u32 = 2;
const DECODE_TP: u32 = 8;

/// The byte at `offset` of global head `head`, token `token` of source page `page`, buffer `b`.
fn byte(b: usize, page: usize, token: usize, head: u32, offset: usize) -> u8 {
    (b * 131 + page * 31 + token * 7 + head as usize * 17 + offset) as u8
}

fn owned(tp: u32, rank: u32) -> std::ops::Range<u32> {
    if tp <= HEADS {
        rank * HEADS / tp..(rank + 1) * HEADS / tp
    } else {
        let h = rank / (tp / HEADS);
        h..h + 1
    }
}

fn main() {
    // A fragmented request: 8 pages in runs of 3, 1, 2, 2, scattered on both sides.
    let src_pages: Vec<i32> = vec![9, 10, 11, 2, 5, 6, 0, 1];
    let dst_pages: Vec<i32> = vec![4, 5, 6, 12, 0, 1, 8, 9];
    let (src_cap_pages, dst_cap_pages) = (12, 13);

    let item = |tp: u32| PAGE_SIZE * owned(tp, 0).len() * HEAD_BYTES;
    let fill_src = |rank: u32| -> Vec<Vec<u8>> {
        let heads = owned(PREFILL_TP, rank);
        (0..BUFFERS)
            .map(|b| {
                let mut buf = vec![0u8; src_cap_pages * item(PREFILL_TP)];
                for (i, x) in buf.iter_mut().enumerate() {
                    let (page, rest) = (i / item(PREFILL_TP), i % item(PREFILL_TP));
                    let (token, rest) = (
                        rest / (heads.len() * HEAD_BYTES),
                        rest % (heads.len() * HEAD_BYTES),
                    );
                    *x = byte(
                        b,
                        page,
                        token,
                        heads.start + (rest / HEAD_BYTES) as u32,
                        rest % HEAD_BYTES,
                    );
                }
                buf
            })
            .collect()
    };
    let src: Vec<Vec<Vec<u8>>> = (0..PREFILL_TP).map(fill_src).collect();
    let mut dst: Vec<Vec<Vec<u8>>> = (0..DECODE_TP)
        .map(|_| vec![vec![0xEE; dst_cap_pages * item(DECODE_TP)]; BUFFERS])
        .collect();

    let (mut copies, mut bytes) = (0, 0);
    for p in 0..PREFILL_TP {
        for d in 0..DECODE_TP {
            let config = slice_config(&SliceParams {
                prefill_tp_size: PREFILL_TP,
                prefill_tp_rank: p,
                decode_tp_size: DECODE_TP,
                decode_tp_rank: d,
                total_kv_heads: HEADS,
                page_size: PAGE_SIZE as u32,
                src_item_len: item(PREFILL_TP) as u64,
                dst_item_len: item(DECODE_TP) as u64,
            })
            .expect("a valid layout");
            if config.action == Action::Send {
                println!(
                    "prefill rank {p} -> decode rank {d}: head {} at source offset {} B, {} B per token",
                    config.first_head,
                    config.src_head_slice_offset,
                    config.heads_bytes_per_token_to_send
                );
            }
            let plan = SlicePlan::new(&config, &src_pages, &dst_pages).expect("valid pages");
            let s: Vec<&[u8]> = src[p as usize].iter().map(Vec::as_slice).collect();
            let mut t: Vec<&mut [u8]> = dst[d as usize].iter_mut().map(Vec::as_mut_slice).collect();
            let report = send_host(&plan, &s, &mut t).expect("in-bounds request");
            copies += report.copies;
            bytes += report.bytes;
        }
    }

    let mut checked = 0u64;
    for d in 0..DECODE_TP {
        let head = owned(DECODE_TP, d).start;
        for (b, buf) in dst[d as usize].iter().enumerate() {
            for (i, x) in buf.iter().enumerate() {
                let (page, rest) = (i / item(DECODE_TP), i % item(DECODE_TP));
                let (token, offset) = (rest / HEAD_BYTES, rest % HEAD_BYTES);
                let want = match dst_pages.iter().position(|&p| p as usize == page) {
                    Some(k) => byte(b, src_pages[k] as usize, token, head, offset),
                    None => 0xEE,
                };
                assert_eq!(*x, want, "decode rank {d} buffer {b} byte {i}");
                checked += 1;
            }
        }
    }
    println!(
        "verified {checked} decode bytes on {DECODE_TP} ranks: {bytes} bytes moved in {copies} \
         strided copies (a per-token plan would issue {})",
        src_pages.len() * PAGE_SIZE * BUFFERS * DECODE_TP as usize
    );
}
