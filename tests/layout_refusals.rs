//! Every refusal of CONTRACT section 7 through the C ABI: its status code, a message that names
//! the values, and nothing written (output structs, output arrays, destination buffers and
//! staging regions are checked untouched after each refused call).

use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};

use mori_tp::ffi::*;

const HOST: MoriSendOptions = MoriSendOptions {
    backend: MORI_BACKEND_HOST,
    flags: 0,
    stream: null_mut(),
};

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts a status and that the message holds every part.
#[track_caller]
fn refused(status: MoriStatus, code: MoriStatus, parts: &[&str]) {
    let message = last_error();
    assert_eq!(
        status,
        code,
        "got {:?}: {message}",
        // SAFETY: a static string.
        unsafe { CStr::from_ptr(mori_status_str(status)) }
    );
    for part in parts {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
}

fn nhd(h: u32, tp: u32, rank: u32, ps: u32, hb: u64) -> MoriTpLayout {
    let mut out = MoriTpLayout::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { mori_tp_layout_nhd(h, tp, rank, ps, hb, &mut out) },
        MORI_OK
    );
    out
}

fn hnd(h: u32, tp: u32, rank: u32, ps: u32, hb: u64) -> MoriTpLayout {
    let mut out = MoriTpLayout::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { mori_tp_layout_hnd(h, tp, rank, ps, hb, &mut out) },
        MORI_OK
    );
    out
}

/// The pair config of two layouts, or the status and what the out struct holds afterwards.
fn pair(src: &MoriTpLayout, dst: &MoriTpLayout) -> (MoriStatus, MoriTpPairConfig) {
    let sentinel = MoriTpPairConfig {
        reserved: 0xABCD,
        ..MoriTpPairConfig::default()
    };
    let mut out = sentinel;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_config(src, dst, &mut out) };
    if status != MORI_OK {
        assert_eq!(
            out, sentinel,
            "a refused mori_tp_pair_config wrote its output"
        );
    }
    (status, out)
}

#[test]
fn layouts_with_zero_sizes_or_a_rank_out_of_range_are_invalid_arguments() {
    let mut out = MoriTpLayout {
        offset: 77,
        ..MoriTpLayout::default()
    };
    // SAFETY (every call below): a valid out-pointer.
    let status = unsafe { mori_tp_layout_nhd(8, 0, 0, 16, 256, &mut out) };
    refused(status, MORI_ERR_INVALID_ARGUMENT, &[": tp_size is 0"]);
    let status = unsafe { mori_tp_layout_hnd(8, 2, 0, 0, 256, &mut out) };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["layout page_size is 0"],
    );
    let status = unsafe { mori_tp_layout_nhd(8, 2, 0, 16, 0, &mut out) };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["layout head_bytes is 0"],
    );
    let status = unsafe { mori_tp_layout_hnd(8, 2, 2, 16, 256, &mut out) };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["mori_tp_layout_hnd: invalid argument: tp_rank 2 is out of range for tp_size 2"],
    );
    // SAFETY: as above.
    let status = unsafe { mori_tp_layout_nhd(8, 3, 0, 16, 256, &mut out) };
    refused(
        status,
        MORI_ERR_TOPOLOGY,
        &["tp_size 3", "total_kv_heads 8"],
    );
    // SAFETY: as above.
    let status = unsafe { mori_tp_layout_nhd(0, 1, 0, 16, 256, &mut out) };
    refused(status, MORI_ERR_TOPOLOGY, &["total_kv_heads is 0"]);
    // A page stride that does not fit in 64 bits: the factors are named.
    // SAFETY: as above.
    let status = unsafe { mori_tp_layout_nhd(8, 1, 0, 1 << 20, 1 << 44, &mut out) };
    refused(status, MORI_ERR_INVALID_ARGUMENT, &["overflows 64 bits"]);
    // SAFETY: NULL out.
    let status = unsafe { mori_tp_layout_nhd(8, 1, 0, 16, 256, null_mut()) };
    refused(status, MORI_ERR_NULL_POINTER, &["out is NULL"]);
    assert_eq!(out.offset, 77, "a refused call wrote its output");
}

#[test]
fn overlapping_interleaved_or_overflowing_layouts_are_refused_naming_the_fields() {
    let good = nhd(8, 2, 0, 16, 128);
    let dst = nhd(8, 2, 0, 16, 128);
    let huge_offset = (u64::MAX - 100).to_string();
    let cases = [
        (
            MoriTpLayout {
                head_stride: 64,
                ..good
            },
            MORI_ERR_LAYOUT_MISMATCH,
            vec!["prefill side", "head_stride 64 is below head_bytes 128"],
        ),
        (
            MoriTpLayout {
                token_stride: 256,
                ..good
            },
            MORI_ERR_LAYOUT_MISMATCH,
            vec![
                "token_stride 256",
                "(4 - 1) * head_stride 128",
                "interleave",
            ],
        ),
        (
            MoriTpLayout {
                page_stride: good.page_stride - 1,
                ..good
            },
            MORI_ERR_LAYOUT_MISMATCH,
            vec!["extent 8192", "past page_stride 8191"],
        ),
        (
            MoriTpLayout {
                offset: u64::MAX - 100,
                ..good
            },
            MORI_ERR_INVALID_ARGUMENT,
            vec!["overflows 64 bits", huge_offset.as_str()],
        ),
        (
            MoriTpLayout {
                token_stride: u64::MAX / 4,
                page_stride: u64::MAX,
                ..good
            },
            MORI_ERR_INVALID_ARGUMENT,
            vec!["(page_size - 1) * token_stride", "15 * 4611686018427387903"],
        ),
    ];
    for (layout, code, parts) in cases {
        let (status, _) = pair(&layout, &dst);
        refused(status, code, &parts);
    }
    // The decode side is named as such.
    let bad = MoriTpLayout {
        head_stride: 1,
        ..dst
    };
    let (status, _) = pair(&good, &bad);
    refused(status, MORI_ERR_LAYOUT_MISMATCH, &["decode side"]);
}

#[test]
fn sides_of_different_models_or_dtypes_are_refused() {
    let (status, _) = pair(&nhd(8, 2, 0, 16, 128), &nhd(4, 2, 0, 16, 128));
    refused(
        status,
        MORI_ERR_TOPOLOGY,
        &["total_kv_heads 8", "total_kv_heads 4"],
    );
    let (status, _) = pair(&nhd(8, 2, 0, 16, 256), &hnd(8, 8, 0, 16, 128));
    refused(
        status,
        MORI_ERR_LAYOUT_MISMATCH,
        &[
            "head_bytes 128 != prefill side head_bytes 256",
            "dtype or head_dim",
        ],
    );
}

struct Fixture {
    config: MoriTpPairConfig,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
    tokens: u64,
}

impl Fixture {
    /// 8 heads, prefill TP 2 HND page 16 -> decode TP 8 NHD page 64, pair (0, 1): 40 tokens,
    /// 3 prefill pages and 1 decode page.
    fn new() -> Fixture {
        let (status, config) = pair(&hnd(8, 2, 0, 16, 32), &nhd(8, 8, 1, 64, 32));
        assert_eq!(status, MORI_OK);
        assert_eq!(config.action, MORI_TP_ACTION_SEND);
        Fixture {
            config,
            src_pages: vec![4, 0, 2],
            dst_pages: vec![1],
            tokens: 40,
        }
    }

    fn request(&self) -> MoriTpRequest {
        MoriTpRequest {
            src_pages: self.src_pages.as_ptr(),
            num_src_pages: self.src_pages.len(),
            dst_pages: self.dst_pages.as_ptr(),
            num_dst_pages: self.dst_pages.len(),
            num_tokens: self.tokens,
        }
    }

    /// Every request-taking function on (config, request): each status with the state of its
    /// outputs checked untouched on failure.
    fn statuses(
        &self,
        config: &MoriTpPairConfig,
        r: &MoriTpRequest,
    ) -> Vec<(&'static str, MoriStatus)> {
        let mut results = Vec::new();
        let mut segments = [MoriSegment {
            length: 7,
            ..MoriSegment::default()
        }; 64];
        let mut len = 12345usize;
        // SAFETY (every call): valid arrays of the stated sizes.
        let status = unsafe {
            mori_tp_pair_segments(
                config,
                r,
                MORI_TP_STAGING_SRC,
                segments.as_mut_ptr(),
                64,
                &mut len,
            )
        };
        if status != MORI_OK {
            assert_eq!(len, 12345, "a refused call wrote *out_len");
            assert!(
                segments.iter().all(|s| s.length == 7),
                "a refused call wrote segments"
            );
        }
        results.push(("mori_tp_pair_segments", status));
        let mut rects = [MoriCopyRect {
            width: 9,
            ..MoriCopyRect::default()
        }; 64];
        // SAFETY: as above.
        let status = unsafe { mori_tp_pair_plan(config, r, rects.as_mut_ptr(), 64, &mut len) };
        if status != MORI_OK {
            assert!(
                rects.iter().all(|x| x.width == 9),
                "a refused call wrote rects"
            );
        }
        results.push(("mori_tp_pair_plan", status));
        let src = vec![0x5Au8; 8 * 16 * 4 * 32];
        let before = vec![0xC3u8; 2 * 64 * 32];
        let mut dst = before.clone();
        let src_ptrs = [src.as_ptr().cast::<c_void>()];
        let dst_ptrs = [dst.as_mut_ptr().cast::<c_void>()];
        let buffers = MoriKvBuffers {
            src: src_ptrs.as_ptr(),
            dst: dst_ptrs.as_ptr(),
            num_buffers: 1,
            src_capacity: src.len() as u64,
            dst_capacity: dst.len() as u64,
        };
        // SAFETY: buffers of the stated capacities.
        let status = unsafe { mori_send_kvcache_pair(config, &buffers, r, &HOST) };
        results.push(("mori_send_kvcache_pair", status));
        // One moved head of 32 bytes per token.
        let mut region = vec![0x3Cu8; r.num_tokens as usize * 32];
        // SAFETY: as above.
        let status = unsafe {
            mori_pack_kvcache_pair(
                config,
                MORI_TP_STAGING_SRC,
                src_ptrs.as_ptr(),
                1,
                src.len() as u64,
                r,
                region.as_mut_ptr().cast(),
                region.len() as u64,
                &HOST,
            )
        };
        if status != MORI_OK {
            assert!(
                region.iter().all(|&b| b == 0x3C),
                "a refused pack wrote the region"
            );
        }
        results.push(("mori_pack_kvcache_pair", status));
        // SAFETY: as above.
        let status = unsafe {
            mori_unpack_kvcache_pair(
                config,
                MORI_TP_STAGING_BOTH,
                region.as_ptr().cast(),
                region.len() as u64,
                dst_ptrs.as_ptr(),
                1,
                dst.len() as u64,
                r,
                &HOST,
            )
        };
        results.push(("mori_unpack_kvcache_pair", status));
        if results.iter().any(|&(_, s)| s != MORI_OK) {
            assert!(
                dst == before,
                "a refused call wrote the destination: {results:?}"
            );
        }
        let memory = MoriTpMemory {
            num_buffers: 1,
            capacity: 1 << 20,
            staging_capacity: 1 << 20,
        };
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_check_pair_transfer(config, r, MORI_TP_STAGING_NONE, &memory, &memory)
        };
        results.push(("mori_tp_check_pair_transfer", status));
        results
    }
}

#[test]
fn a_valid_request_passes_every_function() {
    let f = Fixture::new();
    for (function, status) in f.statuses(&f.config, &f.request()) {
        assert_eq!(status, MORI_OK, "{function}: {}", last_error());
    }
}

#[test]
fn an_edited_pair_config_or_a_reserved_field_is_refused_by_every_function() {
    let f = Fixture::new();
    let r = f.request();
    let edits = [
        (
            MoriTpPairConfig {
                num_heads: 2,
                ..f.config
            },
            "num_heads 2, but the two layouts give 1",
        ),
        (
            MoriTpPairConfig {
                src_first_local: 0,
                ..f.config
            },
            "src_first_local 0, but the two layouts give 1",
        ),
        (
            MoriTpPairConfig {
                action: MORI_TP_ACTION_SKIP_REPLICA,
                ..f.config
            },
            "action 2",
        ),
        (
            MoriTpPairConfig {
                reserved: 1,
                ..f.config
            },
            "reserved 1",
        ),
    ];
    for (config, part) in edits {
        for (function, status) in f.statuses(&config, &r) {
            assert_eq!(status, MORI_ERR_INVALID_ARGUMENT, "{function}");
            if function != "mori_tp_check_pair_transfer" {
                continue;
            }
            assert!(last_error().contains(part), "{}", last_error());
        }
    }
    // A config whose layout was edited into an invalid one is refused as that layout is.
    let broken = MoriTpPairConfig {
        src: MoriTpLayout {
            page_stride: 1,
            ..f.config.src
        },
        ..f.config
    };
    for (function, status) in f.statuses(&broken, &r) {
        assert_eq!(status, MORI_ERR_LAYOUT_MISMATCH, "{function}");
    }
}

#[test]
fn page_counts_other_than_ceil_n_over_page_size_are_refused() {
    let f = Fixture::new();
    for (tokens, src, dst, part) in [
        (
            40u64,
            2usize,
            1usize,
            "prefill side: 2 pages for 40 tokens of page_size 16",
        ),
        (
            40,
            3,
            0,
            "decode side: 0 pages for 40 tokens of page_size 64",
        ),
        (48, 3, 1, ""),
        (
            49,
            3,
            1,
            "prefill side: 3 pages for 49 tokens of page_size 16 (a request of N tokens lists ceil(N / page_size) = 4 pages)",
        ),
        (0, 1, 0, "prefill side: 1 pages for 0 tokens"),
    ] {
        let r = MoriTpRequest {
            num_src_pages: src,
            num_dst_pages: dst,
            num_tokens: tokens,
            ..f.request()
        };
        for (function, status) in f.statuses(&f.config, &r) {
            if part.is_empty() {
                assert_eq!(status, MORI_OK, "{function}: {}", last_error());
            } else {
                refused(status, MORI_ERR_INVALID_ARGUMENT, &[part]);
            }
        }
    }
    // An empty request is fine, and moves nothing.
    let empty = MoriTpRequest {
        num_src_pages: 0,
        num_dst_pages: 0,
        num_tokens: 0,
        ..f.request()
    };
    for (function, status) in f.statuses(&f.config, &empty) {
        assert_eq!(status, MORI_OK, "{function}: {}", last_error());
    }
}

#[test]
fn negative_pages_pages_past_capacity_and_null_page_arrays_write_nothing() {
    let mut f = Fixture::new();
    f.src_pages[1] = -3;
    for (_, status) in f.statuses(&f.config, &f.request()) {
        refused(
            status,
            MORI_ERR_OUT_OF_BOUNDS,
            &["prefill side: page index -3 at position 1"],
        );
    }
    let mut f = Fixture::new();
    // The fixture's decode buffer holds 2 pages of 64 slots of 32 bytes.
    f.dst_pages[0] = 2;
    let r = f.request();
    let statuses = f.statuses(&f.config, &r);
    for (function, status) in statuses {
        match function {
            // Capacities are known only where buffers are.
            "mori_tp_pair_segments" | "mori_tp_pair_plan" | "mori_pack_kvcache_pair" => {
                assert_eq!(status, MORI_OK)
            }
            "mori_tp_check_pair_transfer" => assert_eq!(status, MORI_OK),
            _ => refused(
                status,
                MORI_ERR_OUT_OF_BOUNDS,
                &["decode side: page 2 at position 0 ends at byte 6144, past dst_capacity 4096"],
            ),
        }
    }
    let f = Fixture::new();
    let r = MoriTpRequest {
        src_pages: null(),
        ..f.request()
    };
    for (_, status) in f.statuses(&f.config, &r) {
        refused(
            status,
            MORI_ERR_NULL_POINTER,
            &["request.src_pages is NULL but its length is 3"],
        );
    }
    // SAFETY: a NULL request.
    let status = unsafe { mori_tp_pair_plan(&f.config, null(), null_mut(), 0, &mut 0) };
    refused(status, MORI_ERR_NULL_POINTER, &["request is NULL"]);
}

#[test]
fn a_page_past_its_heads_run_is_out_of_bounds() {
    // Heads outside pages: 2 local heads, each a run of 4 pages of 16 slots of 8 bytes.
    let src = MoriTpLayout {
        total_kv_heads: 2,
        tp_size: 1,
        tp_rank: 0,
        page_size: 16,
        head_bytes: 8,
        page_stride: 128,
        offset: 0,
        token_stride: 8,
        head_stride: 512,
    };
    let dst = nhd(2, 1, 0, 16, 8);
    let (status, config) = pair(&src, &dst);
    assert_eq!(status, MORI_OK, "{}", last_error());
    let (src_pages, dst_pages) = ([3, 4], [0, 1]);
    let r = MoriTpRequest {
        src_pages: src_pages.as_ptr(),
        num_src_pages: 2,
        dst_pages: dst_pages.as_ptr(),
        num_dst_pages: 2,
        num_tokens: 32,
    };
    let mut len = 0;
    // SAFETY: a size query.
    let status = unsafe { mori_tp_pair_segments(&config, &r, 0, null_mut(), 0, &mut len) };
    refused(
        status,
        MORI_ERR_OUT_OF_BOUNDS,
        &["prefill side: page 4 at position 1", "past head_stride 512"],
    );
}

#[test]
fn pack_and_unpack_take_only_their_staging_modes_and_check_the_region() {
    let f = Fixture::new();
    let r = f.request();
    let src = vec![1u8; 8 * 16 * 4 * 32];
    let src_ptrs = [src.as_ptr().cast::<c_void>()];
    let mut region = vec![0x77u8; 40 * 32];
    for (mode, code) in [
        (MORI_TP_STAGING_NONE, MORI_ERR_INVALID_ARGUMENT),
        (MORI_TP_STAGING_DST, MORI_ERR_INVALID_ARGUMENT),
        (9, MORI_ERR_INVALID_ARGUMENT),
    ] {
        // SAFETY: buffers of the stated sizes.
        let status = unsafe {
            mori_pack_kvcache_pair(
                &f.config,
                mode,
                src_ptrs.as_ptr(),
                1,
                src.len() as u64,
                &r,
                region.as_mut_ptr().cast(),
                region.len() as u64,
                &HOST,
            )
        };
        refused(status, code, &["staging"]);
    }
    assert!(last_error().contains("staging_mode 9 is not a MoriTpStaging"));
    // SAFETY: as above.
    let status = unsafe {
        mori_pack_kvcache_pair(
            &f.config,
            MORI_TP_STAGING_DST,
            src_ptrs.as_ptr(),
            1,
            src.len() as u64,
            &r,
            region.as_mut_ptr().cast(),
            region.len() as u64,
            &HOST,
        )
    };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["pack takes staging mode SRC or BOTH, not Dst"],
    );
    // One byte short: both numbers named, nothing written.
    // SAFETY: as above; the capacity is one byte below the region's.
    let status = unsafe {
        mori_pack_kvcache_pair(
            &f.config,
            MORI_TP_STAGING_SRC,
            src_ptrs.as_ptr(),
            1,
            src.len() as u64,
            &r,
            region.as_mut_ptr().cast(),
            region.len() as u64 - 1,
            &HOST,
        )
    };
    refused(
        status,
        MORI_ERR_BUFFER_TOO_SMALL,
        &["staging_capacity 1279 is below the 1280 bytes"],
    );
    assert!(region.iter().all(|&b| b == 0x77));
    // A region that overlaps the source buffer.
    let mut shared = vec![0u8; src.len() + 1280];
    let base = shared.as_mut_ptr();
    let ptrs = [base.cast_const().cast::<c_void>()];
    // SAFETY: the region lies inside the same allocation, 1000 bytes in.
    let status = unsafe {
        mori_pack_kvcache_pair(
            &f.config,
            MORI_TP_STAGING_SRC,
            ptrs.as_ptr(),
            1,
            src.len() as u64,
            &r,
            base.add(1000).cast(),
            1280,
            &HOST,
        )
    };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["overlaps source buffer 0"],
    );
    // Unpack refuses SRC.
    let dst_ptrs = [shared.as_mut_ptr().cast::<c_void>()];
    // SAFETY: as above.
    let status = unsafe {
        mori_unpack_kvcache_pair(
            &f.config,
            MORI_TP_STAGING_SRC,
            region.as_ptr().cast(),
            region.len() as u64,
            dst_ptrs.as_ptr(),
            1,
            4096,
            &r,
            &HOST,
        )
    };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["unpack takes staging mode DST or BOTH, not Src"],
    );
}
