//! Every refusal class of the core, each with a message that names the offending values.

use mori_tp::{Action, Error, Plan, SliceParams, slice_config};

/// Llama-3.1-8B-like: 8 KV heads, head_dim 128, bf16, page size 16, prefill TP 2, decode TP 4.
fn good() -> SliceParams {
    SliceParams {
        prefill_tp_size: 2,
        prefill_tp_rank: 1,
        decode_tp_size: 4,
        decode_tp_rank: 3,
        total_kv_heads: 8,
        page_size: 16,
        src_item_len: 16 * 4 * 256,
        dst_item_len: 16 * 2 * 256,
    }
}

fn refusal(params: SliceParams) -> Error {
    slice_config(&params).expect_err("the layout must be refused")
}

fn assert_names(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            message.contains(part),
            "message {message:?} does not mention {part:?}"
        );
    }
}

#[test]
fn the_good_layout_is_accepted() {
    let c = slice_config(&good()).unwrap();
    assert_eq!((c.action, c.first_head, c.num_heads), (Action::Send, 6, 2));
}

#[test]
fn zero_fields_and_out_of_range_ranks_are_invalid_arguments() {
    let cases: [(SliceParams, &[&str]); 6] = [
        (
            SliceParams {
                prefill_tp_size: 0,
                ..good()
            },
            &["prefill side", "tp_size is 0"],
        ),
        (
            SliceParams {
                decode_tp_size: 0,
                ..good()
            },
            &["decode side", "tp_size is 0"],
        ),
        (
            SliceParams {
                page_size: 0,
                ..good()
            },
            &["page_size is 0"],
        ),
        (
            SliceParams {
                dst_item_len: 0,
                ..good()
            },
            &["decode side", "dst_item_len is 0"],
        ),
        (
            SliceParams {
                prefill_tp_rank: 2,
                ..good()
            },
            &["prefill side", "tp_rank 2", "tp_size 2"],
        ),
        (
            SliceParams {
                decode_tp_rank: 7,
                ..good()
            },
            &["decode side", "tp_rank 7", "tp_size 4"],
        ),
    ];
    for (params, parts) in cases {
        match refusal(params) {
            Error::InvalidArgument(message) => assert_names(&message, parts),
            other => panic!("{params:?}: expected InvalidArgument, got {other:?}"),
        }
    }
}

#[test]
fn heads_and_tp_sizes_that_divide_neither_way_are_topology_errors() {
    match refusal(SliceParams {
        prefill_tp_size: 3,
        prefill_tp_rank: 0,
        ..good()
    }) {
        Error::Topology(m) => assert_names(
            &m,
            &["prefill side", "tp_size 3", "total_kv_heads 8", "2 and 4"],
        ),
        other => panic!("expected Topology, got {other:?}"),
    }
    // 12 heads, decode TP 8: 8 neither divides 12 nor is a multiple of it; 6 and 12 are valid.
    match refusal(SliceParams {
        total_kv_heads: 12,
        decode_tp_size: 8,
        ..good()
    }) {
        Error::Topology(m) => assert_names(
            &m,
            &["decode side", "tp_size 8", "total_kv_heads 12", "6 and 12"],
        ),
        other => panic!("expected Topology, got {other:?}"),
    }
    match refusal(SliceParams {
        total_kv_heads: 0,
        ..good()
    }) {
        Error::Topology(m) => assert_names(&m, &["total_kv_heads is 0"]),
        other => panic!("expected Topology, got {other:?}"),
    }
}

#[test]
fn byte_layouts_that_do_not_split_into_equal_heads_are_layout_mismatches() {
    let cases: [(SliceParams, &[&str]); 3] = [
        (
            SliceParams {
                src_item_len: 16 * 4 * 256 + 8,
                ..good()
            },
            &["prefill side", "src_item_len 16392", "page_size 16"],
        ),
        (
            // 16 * 2 * 256 + 16 bytes: 513 bytes per token cannot hold 2 equal heads.
            SliceParams {
                dst_item_len: 16 * 513,
                ..good()
            },
            &["decode side", "bytes_per_token 513", "2 heads per rank"],
        ),
        (
            // The decode side stores fp8 (128 bytes per head) against the prefill's bf16.
            SliceParams {
                dst_item_len: 16 * 2 * 128,
                ..good()
            },
            &[
                "decode side: bytes_per_head 128 != prefill side bytes_per_head 256",
                "dtype",
            ],
        ),
    ];
    for (params, parts) in cases {
        match refusal(params) {
            Error::LayoutMismatch(message) => assert_names(&message, parts),
            other => panic!("{params:?}: expected LayoutMismatch, got {other:?}"),
        }
    }
}

#[test]
fn hand_edited_configs_whose_slice_leaves_the_token_are_slice_overflows() {
    let c = slice_config(&good()).unwrap();
    let mut wide = c;
    wide.heads_bytes_per_token_to_send = c.bytes_per_token_dst + 256;
    wide.num_heads = (wide.heads_bytes_per_token_to_send / 256) as u32;
    let mut shifted = c;
    shifted.dst_head_slice_offset = c.bytes_per_token_dst - 256;
    for (config, parts) in [
        (
            wide,
            &[
                "prefill side",
                "offset 512",
                "width 768",
                "1024-byte token slot",
            ][..],
        ),
        (
            shifted,
            &[
                "decode side",
                "offset 256",
                "width 512",
                "512-byte token slot",
            ][..],
        ),
    ] {
        match Plan::new(&config, &[0], &[0]).map(|_| ()) {
            Err(Error::SliceOverflow(message)) => assert_names(&message, parts),
            other => panic!("{config:?}: expected SliceOverflow, got {other:?}"),
        }
    }
}

#[test]
fn negative_pages_pages_past_capacity_and_overflowing_offsets_are_out_of_bounds() {
    let c = slice_config(&good()).unwrap();
    match Plan::new(&c, &[0, 1, -3], &[0, 1, 2]).map(|_| ()) {
        Err(Error::OutOfBounds(m)) => assert_names(&m, &["prefill side", "-3", "position 2"]),
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    let plan = Plan::new(&c, &[0, 1, 2], &[4, 9, 5]).unwrap();
    // Ten destination pages end at 10 * 8192 bytes; one byte less cuts page 9 short.
    assert_eq!(plan.check_capacity(3 * 16384, 10 * 8192), Ok(()));
    match plan.check_capacity(3 * 16384, 10 * 8192 - 1) {
        Err(Error::OutOfBounds(m)) => assert_names(
            &m,
            &["decode side", "page 9", "position 1", "81920", "81919"],
        ),
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    let mut huge = c;
    huge.src_item_len = 1 << 40;
    huge.bytes_per_token_src = huge.src_item_len / 16;
    match Plan::new(&huge, &[i32::MAX], &[0]).map(|_| ()) {
        Err(Error::OutOfBounds(m)) => assert_names(&m, &["page 2147483647", "overflows u64"]),
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
}

#[test]
fn hand_edited_configs_with_disagreeing_fields_are_invalid_arguments() {
    let c = slice_config(&good()).unwrap();
    let mut pitch = c;
    pitch.bytes_per_token_src += 1;
    let mut skip_with_width = slice_config(&SliceParams {
        prefill_tp_rank: 0,
        ..good()
    })
    .unwrap();
    assert_eq!(skip_with_width.action, Action::NotPaired);
    skip_with_width.heads_bytes_per_token_to_send = 256;
    let mut off_head = c;
    off_head.src_head_slice_offset = 100;
    for (config, parts) in [
        (
            pitch,
            &[
                "bytes_per_token_src 1025",
                "src_item_len / page_size = 1024",
            ][..],
        ),
        (
            skip_with_width,
            &["NotPaired", "heads_bytes_per_token_to_send 256"][..],
        ),
        (
            off_head,
            &["src_head_slice_offset 100", "bytes_per_head 256"][..],
        ),
    ] {
        match config.validate() {
            Err(Error::InvalidArgument(message)) => assert_names(&message, parts),
            other => panic!("{config:?}: expected InvalidArgument, got {other:?}"),
        }
    }
}
