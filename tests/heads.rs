//! mori_tp_rank_heads and mori_tp_head_sender, the C exports of the ownership rule
//! (REFERENCE.md section 3), against the tests' own restatement of the rule and against
//! mori_tp_slice_config's actions over every valid (H, P, D) with H up to 64 and P, D up to 32;
//! their refusals (code, message, nothing written) and NULL outputs.

mod common;

use std::ffi::CStr;
use std::ptr::null_mut;

use common::{HEAD_COUNTS, owned_heads, valid_tp};
use mori_tp::ffi::*;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn valid_layouts() -> impl Iterator<Item = (u32, u32, u32)> {
    HEAD_COUNTS
        .into_iter()
        .flat_map(|h| (1..=32u32).flat_map(move |p| (1..=32u32).map(move |d| (h, p, d))))
        .filter(|&(h, p, d)| valid_tp(h, p) && valid_tp(h, d))
}

fn rank_heads(h: u32, tp: u32, rank: u32) -> Result<(u32, u32), MoriStatus> {
    let (mut first, mut num) = (u32::MAX, u32::MAX);
    // SAFETY: both outputs are valid u32s.
    let status = unsafe { mori_tp_rank_heads(h, tp, rank, &mut first, &mut num) };
    if status == MORI_OK {
        Ok((first, num))
    } else {
        assert_eq!((first, num), (u32::MAX, u32::MAX), "written on failure");
        Err(status)
    }
}

fn head_sender(h: u32, p_tp: u32, d_tp: u32, d: u32, head: u32) -> Result<u32, MoriStatus> {
    let mut sender = u32::MAX;
    // SAFETY: the output is a valid u32.
    let status = unsafe { mori_tp_head_sender(h, p_tp, d_tp, d, head, &mut sender) };
    if status == MORI_OK {
        Ok(sender)
    } else {
        assert_eq!(sender, u32::MAX, "written on failure");
        Err(status)
    }
}

/// The prefill rank whose mori_tp_slice_config for (p, d) is SEND with `head` among its heads.
fn senders_by_slice_config(h: u32, p_tp: u32, d_tp: u32, d: u32) -> Vec<(u32, u32)> {
    let item = |tp| 2 * owned_heads(h, tp, 0).len() as u64 * 6;
    let mut found = Vec::new();
    for p in 0..p_tp {
        let params = MoriTpSliceParams {
            prefill_tp_size: p_tp,
            prefill_tp_rank: p,
            decode_tp_size: d_tp,
            decode_tp_rank: d,
            total_kv_heads: h,
            page_size: 2,
            src_item_len: item(p_tp),
            dst_item_len: item(d_tp),
        };
        let mut out = std::mem::MaybeUninit::<MoriTpSliceConfig>::zeroed();
        // SAFETY: valid params and output.
        assert_eq!(
            unsafe { mori_tp_slice_config(&params, out.as_mut_ptr()) },
            MORI_OK
        );
        // SAFETY: written on MORI_OK.
        let c = unsafe { out.assume_init() };
        if c.action == MORI_TP_ACTION_SEND {
            found.extend((c.first_head..c.first_head + c.num_heads).map(|head| (head, p)));
        }
    }
    found.sort();
    found
}

#[test]
fn rank_heads_is_the_rule_for_every_valid_size_and_refuses_the_rest() {
    for h in HEAD_COUNTS {
        for tp in 1..=32u32 {
            for rank in 0..tp {
                let got = rank_heads(h, tp, rank);
                if valid_tp(h, tp) {
                    let want = owned_heads(h, tp, rank);
                    assert_eq!(got, Ok((want.start, want.end - want.start)), "H={h} T={tp}");
                } else {
                    assert_eq!(got, Err(MORI_ERR_TOPOLOGY), "H={h} T={tp}");
                    let message = last_error();
                    assert!(
                        message.contains(&format!("tp_size {tp} and total_kv_heads {h}"))
                            && !message.contains("side"),
                        "{message}"
                    );
                }
            }
        }
    }
}

#[test]
fn head_sender_names_the_one_sending_pair_of_slice_config() {
    let mut layouts = 0;
    for (h, p_tp, d_tp) in valid_layouts() {
        layouts += 1;
        for d in 0..d_tp {
            let held = owned_heads(h, d_tp, d);
            let got: Vec<(u32, u32)> = held
                .clone()
                .map(|head| (head, head_sender(h, p_tp, d_tp, d, head).unwrap()))
                .collect();
            assert_eq!(
                got,
                senders_by_slice_config(h, p_tp, d_tp, d),
                "H={h} P={p_tp} D={d_tp} d={d}"
            );
            // Every head the rank does not hold is refused, naming the rank and its heads.
            for head in (0..h).filter(|x| !held.contains(x)) {
                assert_eq!(
                    head_sender(h, p_tp, d_tp, d, head),
                    Err(MORI_ERR_INVALID_ARGUMENT)
                );
                let want = format!(
                    "decode side: tp_rank {d} holds heads {}..{}, not head {head}",
                    held.start,
                    held.end - 1
                );
                assert!(last_error().contains(&want), "{}", last_error());
            }
        }
    }
    assert!(layouts > 1000, "only {layouts} layouts");
}

#[test]
fn refusals_have_their_codes_and_messages_and_write_nothing() {
    for (call, status, message) in [
        (
            (8, 0, 4, 0, 0),
            MORI_ERR_INVALID_ARGUMENT,
            "prefill side: tp_size is 0",
        ),
        (
            (8, 3, 4, 0, 0),
            MORI_ERR_TOPOLOGY,
            "prefill side: tp_size 3 and total_kv_heads 8",
        ),
        (
            (8, 4, 5, 0, 0),
            MORI_ERR_TOPOLOGY,
            "decode side: tp_size 5 and total_kv_heads 8",
        ),
        ((0, 4, 4, 0, 0), MORI_ERR_TOPOLOGY, "total_kv_heads is 0"),
        (
            (8, 4, 4, 4, 0),
            MORI_ERR_INVALID_ARGUMENT,
            "decode side: tp_rank 4 is out of range",
        ),
        (
            (8, 4, 4, 0, 8),
            MORI_ERR_INVALID_ARGUMENT,
            "head 8 is out of range for total_kv_heads 8",
        ),
    ] {
        let (h, p, d_tp, d, head) = call;
        assert_eq!(head_sender(h, p, d_tp, d, head), Err(status), "{message}");
        let text = last_error();
        assert!(
            text.starts_with("mori_tp_head_sender: ") && text.contains(message),
            "{text}"
        );
    }
    for (call, status, message) in [
        (
            (8, 0, 0),
            MORI_ERR_INVALID_ARGUMENT,
            "invalid argument: tp_size is 0",
        ),
        ((0, 4, 0), MORI_ERR_TOPOLOGY, "total_kv_heads is 0"),
        (
            (8, 3, 0),
            MORI_ERR_TOPOLOGY,
            "tp_size 3 and total_kv_heads 8 divide neither way",
        ),
        (
            (8, 4, 4),
            MORI_ERR_INVALID_ARGUMENT,
            "tp_rank 4 is out of range for tp_size 4",
        ),
    ] {
        let (h, tp, rank) = call;
        assert_eq!(rank_heads(h, tp, rank), Err(status), "{message}");
        let text = last_error();
        assert!(
            text.starts_with("mori_tp_rank_heads: ")
                && text.contains(message)
                && !text.contains("side"),
            "{text}"
        );
    }
}

#[test]
fn null_outputs_are_refused_and_the_other_output_is_left_alone() {
    let mut value = 7u32;
    // SAFETY: NULL is refused before anything is written.
    unsafe {
        assert_eq!(
            mori_tp_rank_heads(8, 2, 0, null_mut(), &mut value),
            MORI_ERR_NULL_POINTER
        );
        assert!(
            last_error().contains("first_head is NULL"),
            "{}",
            last_error()
        );
        assert_eq!(
            mori_tp_rank_heads(8, 2, 0, &mut value, null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert!(
            last_error().contains("num_heads is NULL"),
            "{}",
            last_error()
        );
        assert_eq!(value, 7);
        assert_eq!(
            mori_tp_head_sender(8, 2, 4, 0, 0, null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert!(
            last_error().contains("prefill_tp_rank is NULL"),
            "{}",
            last_error()
        );
    }
}
