//! Every refusal of the core: the variant carries the numbers that explain it (what a Rust caller
//! matches on), its class is the C status class, and the message names the same values.

use mori_tp::{Action, Error, ErrorClass, Side, SliceParams, SlicePlan, slice_config};

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

/// Checks an error's class, its exact variant and the values its message names.
fn assert_refusal(error: Error, class: ErrorClass, expected: &Error, parts: &[&str]) {
    assert_eq!(&error, expected);
    assert_eq!(error.class(), class, "{error:?}");
    let message = error.to_string();
    assert!(
        message.starts_with(class.label()),
        "{message:?} does not start with {:?}",
        class.label()
    );
    assert_names(&message, parts);
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
    let cases: [(SliceParams, Error, &[&str]); 7] = [
        (
            SliceParams {
                prefill_tp_size: 0,
                ..good()
            },
            Error::ZeroTpSize {
                side: Side::Prefill,
            },
            &["prefill side", "tp_size is 0"],
        ),
        (
            SliceParams {
                decode_tp_size: 0,
                ..good()
            },
            Error::ZeroTpSize { side: Side::Decode },
            &["decode side", "tp_size is 0"],
        ),
        (
            SliceParams {
                page_size: 0,
                ..good()
            },
            Error::ZeroPageSize,
            &["page_size is 0"],
        ),
        (
            SliceParams {
                dst_item_len: 0,
                ..good()
            },
            Error::ZeroItemLen { side: Side::Decode },
            &["decode side", "dst_item_len is 0"],
        ),
        (
            SliceParams {
                prefill_tp_rank: 2,
                ..good()
            },
            Error::RankOutOfRange {
                side: Side::Prefill,
                rank: 2,
                tp_size: 2,
            },
            &["prefill side", "tp_rank 2", "tp_size 2"],
        ),
        (
            SliceParams {
                decode_tp_rank: 7,
                ..good()
            },
            Error::RankOutOfRange {
                side: Side::Decode,
                rank: 7,
                tp_size: 4,
            },
            &["decode side", "tp_rank 7", "tp_size 4"],
        ),
        (
            // Range checks come first, as documented: a bad rank wins over a bad topology.
            SliceParams {
                decode_tp_rank: 9,
                total_kv_heads: 3,
                ..good()
            },
            Error::RankOutOfRange {
                side: Side::Decode,
                rank: 9,
                tp_size: 4,
            },
            &["decode side", "tp_rank 9"],
        ),
    ];
    for (params, expected, parts) in cases {
        assert_refusal(
            refusal(params),
            ErrorClass::InvalidArgument,
            &expected,
            parts,
        );
    }
}

#[test]
fn heads_and_tp_sizes_that_divide_neither_way_are_topology_errors() {
    let cases: [(SliceParams, Error, &[&str]); 4] = [
        (
            SliceParams {
                prefill_tp_size: 3,
                prefill_tp_rank: 0,
                ..good()
            },
            Error::IndivisibleTp {
                side: Side::Prefill,
                tp_size: 3,
                total_kv_heads: 8,
                nearest_below: 2,
                nearest_above: Some(4),
            },
            &["prefill side", "tp_size 3", "total_kv_heads 8", "2 and 4"],
        ),
        (
            // 12 heads, decode TP 8: 8 neither divides 12 nor is a multiple of it; 6 and 12 are
            // valid.
            SliceParams {
                total_kv_heads: 12,
                decode_tp_size: 8,
                ..good()
            },
            Error::IndivisibleTp {
                side: Side::Decode,
                tp_size: 8,
                total_kv_heads: 12,
                nearest_below: 6,
                nearest_above: Some(12),
            },
            &["decode side", "tp_size 8", "total_kv_heads 12", "6 and 12"],
        ),
        (
            // No valid size above u32::MAX fits in u32: the message names the one below, once.
            SliceParams {
                decode_tp_size: u32::MAX,
                decode_tp_rank: 0,
                total_kv_heads: 2,
                ..good()
            },
            Error::IndivisibleTp {
                side: Side::Decode,
                tp_size: u32::MAX,
                total_kv_heads: 2,
                nearest_below: u32::MAX - 1,
                nearest_above: None,
            },
            &["nearest valid tp size: 4294967294)"],
        ),
        (
            SliceParams {
                total_kv_heads: 0,
                ..good()
            },
            Error::ZeroKvHeads,
            &["total_kv_heads is 0"],
        ),
    ];
    for (params, expected, parts) in cases {
        assert_refusal(refusal(params), ErrorClass::Topology, &expected, parts);
    }
}

#[test]
fn byte_layouts_that_do_not_split_into_equal_heads_are_layout_mismatches() {
    let cases: [(SliceParams, Error, &[&str]); 3] = [
        (
            SliceParams {
                src_item_len: 16 * 4 * 256 + 8,
                ..good()
            },
            Error::ItemLenNotWholeTokens {
                side: Side::Prefill,
                item_len: 16392,
                page_size: 16,
            },
            &["prefill side", "src_item_len 16392", "page_size 16"],
        ),
        (
            // 16 * 2 * 256 + 16 bytes: 513 bytes per token cannot hold 2 equal heads.
            SliceParams {
                dst_item_len: 16 * 513,
                ..good()
            },
            Error::TokenNotWholeHeads {
                side: Side::Decode,
                bytes_per_token: 513,
                heads_per_rank: 2,
                tp_size: 4,
                total_kv_heads: 8,
            },
            &["decode side", "bytes_per_token 513", "2 heads per rank"],
        ),
        (
            // The decode side stores fp8 (128 bytes per head) against the prefill's bf16.
            SliceParams {
                dst_item_len: 16 * 2 * 128,
                ..good()
            },
            Error::BytesPerHeadMismatch {
                prefill_bytes_per_head: 256,
                decode_bytes_per_head: 128,
                prefill_bytes_per_token: 1024,
                decode_bytes_per_token: 256,
                prefill_heads_per_rank: 4,
                decode_heads_per_rank: 2,
            },
            &[
                "decode side: bytes_per_head 128 != prefill side bytes_per_head 256",
                "dtype",
            ],
        ),
    ];
    for (params, expected, parts) in cases {
        assert_refusal(
            refusal(params),
            ErrorClass::LayoutMismatch,
            &expected,
            parts,
        );
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
    for (config, side, offset, width, bytes_per_token, parts) in [
        (
            wide,
            Side::Prefill,
            512,
            768,
            1024,
            &[
                "prefill side",
                "offset 512",
                "width 768",
                "1024-byte token slot",
            ][..],
        ),
        (
            shifted,
            Side::Decode,
            256,
            512,
            512,
            &[
                "decode side",
                "offset 256",
                "width 512",
                "512-byte token slot",
            ][..],
        ),
    ] {
        let error = SlicePlan::new(&config, &[0], &[0]).map(|_| ()).unwrap_err();
        let expected = Error::SliceOverflow {
            side,
            offset,
            width,
            bytes_per_token,
        };
        assert_refusal(error, ErrorClass::SliceOverflow, &expected, parts);
    }
}

#[test]
fn negative_pages_pages_past_capacity_and_overflowing_offsets_are_out_of_bounds() {
    let c = slice_config(&good()).unwrap();
    assert_refusal(
        SlicePlan::new(&c, &[0, 1, -3], &[0, 1, 2])
            .map(|_| ())
            .unwrap_err(),
        ErrorClass::OutOfBounds,
        &Error::NegativePage {
            side: Side::Prefill,
            page: -3,
            position: 2,
        },
        &["prefill side", "-3", "position 2"],
    );
    let plan = SlicePlan::new(&c, &[0, 1, 2], &[4, 9, 5]).unwrap();
    // Ten destination pages end at 10 * 8192 bytes; one byte less cuts page 9 short.
    assert_eq!(plan.check_capacity(3 * 16384, 10 * 8192), Ok(()));
    assert_refusal(
        plan.check_capacity(3 * 16384, 10 * 8192 - 1).unwrap_err(),
        ErrorClass::OutOfBounds,
        &Error::PagePastCapacity {
            side: Side::Decode,
            page: 9,
            position: 1,
            end: 81920,
            capacity: 81919,
        },
        &["decode side", "page 9", "position 1", "81920", "81919"],
    );
    let mut huge = c;
    huge.src_item_len = 1 << 40;
    huge.bytes_per_token_src = huge.src_item_len / 16;
    assert_refusal(
        SlicePlan::new(&huge, &[i32::MAX], &[0])
            .map(|_| ())
            .unwrap_err(),
        ErrorClass::OutOfBounds,
        &Error::PageOffsetOverflow {
            side: Side::Prefill,
            page: i32::MAX as u32,
            position: 0,
            item_len: 1 << 40,
        },
        &["page 2147483647", "overflows u64"],
    );
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
    for (config, expected, parts) in [
        (
            pitch,
            Error::InconsistentBytesPerToken {
                side: Side::Prefill,
                stated: 1025,
                derived: 1024,
            },
            &[
                "bytes_per_token_src 1025",
                "src_item_len / page_size = 1024",
            ][..],
        ),
        (
            skip_with_width,
            Error::NonSendingSliceFields {
                action: Action::NotPaired,
                first_head: 0,
                num_heads: 0,
                src_head_slice_offset: 0,
                dst_head_slice_offset: 0,
                width: 256,
            },
            &["NotPaired", "heads_bytes_per_token_to_send 256"][..],
        ),
        (
            off_head,
            Error::OffsetNotOnHead {
                side: Side::Prefill,
                offset: 100,
                bytes_per_head: 256,
                width: 512,
                num_heads: 2,
            },
            &["src_head_slice_offset 100", "bytes_per_head 256"][..],
        ),
    ] {
        assert_refusal(
            config.validate().unwrap_err(),
            ErrorClass::InvalidArgument,
            &expected,
            parts,
        );
    }
}
