//! Every refusal of the layout functions (REFERENCE.md section 11) through the C ABI: its
//! status code, a message that names the values, and nothing written (output structs, output
//! arrays, destination buffers and staging regions are checked untouched after each refused
//! call).

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
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
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
        unsafe { CStr::from_ptr(mori_tp_status_name(status)) }
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
    // A page stride that does not fit in 64 bits: the product and its factors are named,
    // whether page_size * head_bytes overflows or L times it does.
    for f in [mori_tp_layout_nhd, mori_tp_layout_hnd] {
        // SAFETY: as above.
        let status = unsafe { f(8, 1, 0, 1 << 20, 1 << 44, &mut out) };
        refused(
            status,
            MORI_ERR_INVALID_ARGUMENT,
            &["page_size * head_bytes = 1048576 * 17592186044416 overflows 64 bits"],
        );
        // 2^20 slots of 2^41 bytes fit (2^61); 8 local heads of that page do not.
        // SAFETY: as above.
        let status = unsafe { f(8, 1, 0, 1 << 20, 1 << 41, &mut out) };
        refused(
            status,
            MORI_ERR_INVALID_ARGUMENT,
            &["local heads * page_size * head_bytes = 8 * 2305843009213693952 overflows 64 bits"],
        );
    }
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
        self.outcomes(config, r)
            .into_iter()
            .map(|(function, status, _)| (function, status))
            .collect()
    }

    /// As [`Fixture::statuses`], with each call's message (mori_tp_last_error_message right after
    /// it).
    fn outcomes(
        &self,
        config: &MoriTpPairConfig,
        r: &MoriTpRequest,
    ) -> Vec<(&'static str, MoriStatus, String)> {
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
        results.push(("mori_tp_pair_segments", status, last_error()));
        let mut rects = [MoriCopyRect {
            width: 9,
            ..MoriCopyRect::default()
        }; 64];
        let mut len = 12345usize;
        // SAFETY: as above.
        let status = unsafe { mori_tp_pair_plan(config, r, rects.as_mut_ptr(), 64, &mut len) };
        if status != MORI_OK {
            assert_eq!(len, 12345, "a refused call wrote *out_len");
            assert!(
                rects.iter().all(|x| x.width == 9),
                "a refused call wrote rects"
            );
        }
        results.push(("mori_tp_pair_plan", status, last_error()));
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
        let status = unsafe { mori_tp_pair_send(config, &buffers, r, &HOST) };
        results.push(("mori_tp_pair_send", status, last_error()));
        // One moved head of 32 bytes per token.
        let mut region = vec![0x3Cu8; r.num_tokens as usize * 32];
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_pair_pack(
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
        results.push(("mori_tp_pair_pack", status, last_error()));
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_pair_unpack(
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
        results.push(("mori_tp_pair_unpack", status, last_error()));
        if results.iter().any(|&(_, s, _)| s != MORI_OK) {
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
        results.push(("mori_tp_check_pair_transfer", status, last_error()));
        results
    }
}

/// The two functions that take a config alone, mori_tp_pair_staging_for and
/// mori_tp_pair_staging_len (for `tokens`): each status and message, their outputs checked
/// untouched on failure.
fn config_outcomes(
    config: &MoriTpPairConfig,
    tokens: u64,
) -> Vec<(&'static str, MoriStatus, String)> {
    let mut results = Vec::new();
    let mut staging = 0xDEAD_u32;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_staging_for(config, &mut staging) };
    results.push(("mori_tp_pair_staging_for", status, last_error()));
    if status != MORI_OK {
        assert_eq!(staging, 0xDEAD, "a refused staging_for wrote its output");
    }
    let mut len = 0xBEEF_u64;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pair_staging_len(config, tokens, &mut len) };
    results.push(("mori_tp_pair_staging_len", status, last_error()));
    if status != MORI_OK {
        assert_eq!(len, 0xBEEF, "a refused staging_len wrote its output");
    }
    results
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
    // The fixture's pair moves global head 1: local 1 of 4 on the prefill rank, the decode
    // rank's only head.
    assert_eq!(
        (
            f.config.first_head,
            f.config.num_heads,
            f.config.src_first_local,
            f.config.dst_first_local
        ),
        (1, 1, 1, 0)
    );
    let edits = [
        (
            MoriTpPairConfig {
                num_heads: 2,
                ..f.config
            },
            "inconsistent pair config: num_heads 2, but the two layouts give 1",
        ),
        (
            MoriTpPairConfig {
                first_head: 0,
                ..f.config
            },
            "inconsistent pair config: first_head 0, but the two layouts give 1",
        ),
        (
            MoriTpPairConfig {
                src_first_local: 0,
                ..f.config
            },
            "inconsistent pair config: src_first_local 0, but the two layouts give 1",
        ),
        (
            MoriTpPairConfig {
                dst_first_local: 3,
                ..f.config
            },
            "inconsistent pair config: dst_first_local 3, but the two layouts give 0",
        ),
        (
            MoriTpPairConfig {
                action: MORI_TP_ACTION_SKIP_REPLICA,
                ..f.config
            },
            "inconsistent pair config: action 2, but the two layouts give 1",
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
        let outcomes = f
            .outcomes(&config, &r)
            .into_iter()
            .chain(config_outcomes(&config, f.tokens));
        let mut functions = Vec::new();
        for (function, status, message) in outcomes {
            assert_eq!(status, MORI_ERR_INVALID_ARGUMENT, "{function}: {message}");
            // Each message names the function, the field and both values.
            assert!(
                message.starts_with(&format!("{function}: invalid argument: ")),
                "{message:?}"
            );
            assert!(
                message.contains(part),
                "{function}: {message:?} lacks {part:?}"
            );
            functions.push(function);
        }
        for function in [
            "mori_tp_pair_segments",
            "mori_tp_pair_plan",
            "mori_tp_pair_staging_for",
            "mori_tp_pair_staging_len",
            "mori_tp_pair_send",
            "mori_tp_pair_pack",
            "mori_tp_pair_unpack",
        ] {
            assert!(functions.contains(&function), "{function} not called");
        }
    }
    // A config whose layout was edited into an invalid one is refused as that layout is, by
    // every function, naming the side and the values.
    let broken = MoriTpPairConfig {
        src: MoriTpLayout {
            page_stride: 1,
            ..f.config.src
        },
        ..f.config
    };
    let outcomes = f
        .outcomes(&broken, &r)
        .into_iter()
        .chain(config_outcomes(&broken, f.tokens));
    for (function, status, message) in outcomes {
        assert_eq!(status, MORI_ERR_LAYOUT_MISMATCH, "{function}: {message}");
        for part in ["prefill side", "extent 2048", "past page_stride 1"] {
            assert!(
                message.contains(part),
                "{function}: {message:?} lacks {part:?}"
            );
        }
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
            "mori_tp_pair_segments" | "mori_tp_pair_plan" | "mori_tp_pair_pack" => {
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
    let src_len = src.len() as u64;
    let src_ptrs = [src.as_ptr().cast::<c_void>()];
    let mut region = vec![0x77u8; 40 * 32];
    let region_ptr = region.as_mut_ptr().cast::<c_void>();
    // One pack of this fixture's request; what varies is what each refusal is about.
    let pack = |mode: u32, srcs: &[*const c_void], staging: *mut c_void, capacity: u64| {
        // SAFETY: every pointer is NULL or spans the stated bytes: src_len per source buffer,
        // `capacity` for the staging region (or less, to be refused).
        unsafe {
            mori_tp_pair_pack(
                &f.config,
                mode,
                srcs.as_ptr(),
                srcs.len(),
                src_len,
                &r,
                staging,
                capacity,
                &HOST,
            )
        }
    };
    for mode in [MORI_TP_STAGING_NONE, MORI_TP_STAGING_DST, 9] {
        let status = pack(mode, &src_ptrs, region_ptr, 1280);
        refused(status, MORI_ERR_INVALID_ARGUMENT, &["staging"]);
    }
    assert!(last_error().contains("staging_mode 9 is not a MoriTpStaging"));
    let status = pack(MORI_TP_STAGING_DST, &src_ptrs, region_ptr, 1280);
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["pack takes staging mode SRC or BOTH, not Dst"],
    );
    // One byte short: both numbers named, nothing written.
    let status = pack(MORI_TP_STAGING_SRC, &src_ptrs, region_ptr, 1279);
    refused(
        status,
        MORI_ERR_BUFFER_TOO_SMALL,
        &["staging_capacity 1279 is below the 1280 bytes"],
    );
    // A NULL region said to hold bytes.
    let status = pack(MORI_TP_STAGING_BOTH, &src_ptrs, null_mut(), 1280);
    refused(
        status,
        MORI_ERR_NULL_POINTER,
        &[
            "mori_tp_pair_pack: ",
            "staging is NULL but staging_capacity is 1280",
        ],
    );
    // A NULL source buffer among the buffers.
    let status = pack(MORI_TP_STAGING_SRC, &[null()], region_ptr, 1280);
    refused(
        status,
        MORI_ERR_NULL_POINTER,
        &["mori_tp_pair_pack: ", "src[0] is NULL"],
    );
    assert!(region.iter().all(|&b| b == 0x77), "a refused pack wrote");
    // A region that overlaps the source buffer: 1000 bytes into the same allocation.
    let mut shared = vec![0u8; src.len() + 1280];
    let base = shared.as_mut_ptr();
    // SAFETY: 1000 + 1280 bytes lie inside `shared`.
    let inside = unsafe { base.add(1000) }.cast::<c_void>();
    let status = pack(
        MORI_TP_STAGING_SRC,
        &[base.cast_const().cast()],
        inside,
        1280,
    );
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &["overlaps source buffer 0"],
    );
    // Unpack refuses SRC.
    let dst_ptrs = [base.cast::<c_void>()];
    // SAFETY: the region and a destination buffer of at least the stated sizes.
    let status = unsafe {
        mori_tp_pair_unpack(
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

#[test]
fn heads_outside_pages_whose_page_stride_is_below_a_heads_run_in_a_page_are_refused() {
    // 2 local heads, each its own run (head_stride 512 > page_stride), but a page of 16 slots of
    // 8 bytes spans (16 - 1) * 8 + 8 = 128 bytes of a head, more than page_stride 100: the pages
    // of one head overlap, and the heads do not fit inside a page either.
    let squeezed = MoriTpLayout {
        total_kv_heads: 2,
        tp_size: 1,
        tp_rank: 0,
        page_size: 16,
        head_bytes: 8,
        page_stride: 100,
        offset: 0,
        token_stride: 8,
        head_stride: 512,
    };
    let good = nhd(2, 1, 0, 16, 8);
    for (src, dst, side) in [
        (squeezed, good, "prefill side"),
        (good, squeezed, "decode side"),
    ] {
        let (status, _) = pair(&src, &dst);
        refused(
            status,
            MORI_ERR_LAYOUT_MISMATCH,
            &[
                side,
                "extent 640",
                "page_size 16 - 1",
                "token_stride 8",
                "(2 local heads - 1) * head_stride 512",
                "head_bytes 8",
                "past page_stride 100",
            ],
        );
    }
    // One byte more than the run is a valid heads-outside-pages layout.
    let (status, _) = pair(
        &MoriTpLayout {
            page_stride: 128,
            ..squeezed
        },
        &good,
    );
    assert_eq!(status, MORI_OK, "{}", last_error());
}

#[test]
fn layouts_given_to_pair_config_are_checked_field_by_field_naming_the_side() {
    let good = nhd(8, 2, 0, 16, 128);
    for (bad, code, part) in [
        (
            MoriTpLayout { tp_size: 0, ..good },
            MORI_ERR_INVALID_ARGUMENT,
            ": tp_size is 0",
        ),
        (
            MoriTpLayout {
                page_size: 0,
                ..good
            },
            MORI_ERR_INVALID_ARGUMENT,
            ": layout page_size is 0",
        ),
        (
            MoriTpLayout {
                head_bytes: 0,
                ..good
            },
            MORI_ERR_INVALID_ARGUMENT,
            ": layout head_bytes is 0",
        ),
        (
            MoriTpLayout { tp_rank: 5, ..good },
            MORI_ERR_INVALID_ARGUMENT,
            "tp_rank 5 is out of range for tp_size 2",
        ),
        (
            MoriTpLayout { tp_size: 3, ..good },
            MORI_ERR_TOPOLOGY,
            "tp_size 3",
        ),
    ] {
        let (status, _) = pair(&bad, &good);
        refused(status, code, &["prefill side", part]);
        let (status, _) = pair(&good, &bad);
        refused(status, code, &["decode side", part]);
    }
    let mut out = MoriTpPairConfig {
        reserved: 0xABCD,
        ..MoriTpPairConfig::default()
    };
    // SAFETY (the three calls): NULL in one argument, valid pointers elsewhere.
    let status = unsafe { mori_tp_pair_config(null(), &good, &mut out) };
    refused(status, MORI_ERR_NULL_POINTER, &["prefill is NULL"]);
    let status = unsafe { mori_tp_pair_config(&good, null(), &mut out) };
    refused(status, MORI_ERR_NULL_POINTER, &["decode is NULL"]);
    let status = unsafe { mori_tp_pair_config(&good, &good, null_mut()) };
    refused(status, MORI_ERR_NULL_POINTER, &["out is NULL"]);
    assert_eq!(out.reserved, 0xABCD, "a refused call wrote its output");
}

#[test]
fn pair_segments_refuses_an_unknown_staging_value_and_writes_nothing() {
    let f = Fixture::new();
    let r = f.request();
    for staging in [4u32, 9, u32::MAX] {
        let mut segments = [MoriSegment {
            length: 7,
            ..MoriSegment::default()
        }; 16];
        let mut len = 12345usize;
        // SAFETY: an array of 16 entries.
        let status = unsafe {
            mori_tp_pair_segments(&f.config, &r, staging, segments.as_mut_ptr(), 16, &mut len)
        };
        refused(
            status,
            MORI_ERR_INVALID_ARGUMENT,
            &[
                "mori_tp_pair_segments: ",
                &format!("staging {staging} is not a MoriTpStaging"),
            ],
        );
        assert_eq!(len, 12345, "a refused call wrote *out_len");
        assert!(segments.iter().all(|s| s.length == 7), "wrote segments");
    }
}

#[test]
fn output_arrays_too_small_report_the_count_and_write_no_entry() {
    let f = Fixture::new();
    let r = f.request();
    // The size of each answer, asked with out = NULL and capacity 0.
    let (mut segments_needed, mut rects_needed) = (0usize, 0usize);
    // SAFETY (both): size queries.
    unsafe {
        mori_tp_pair_segments(
            &f.config,
            &r,
            MORI_TP_STAGING_NONE,
            null_mut(),
            0,
            &mut segments_needed,
        );
        mori_tp_pair_plan(&f.config, &r, null_mut(), 0, &mut rects_needed);
    }
    // Three prefill pages of 16 tokens of one head, head-major: a segment (and a rect, the
    // pages being out of order) per prefill page.
    assert_eq!((segments_needed, rects_needed), (3, 3));
    for capacity in [1usize, 2] {
        let mut rects = [MoriCopyRect {
            width: 9,
            ..MoriCopyRect::default()
        }; 4];
        let mut len = 0usize;
        // SAFETY: an array of at least `capacity` entries.
        let status =
            unsafe { mori_tp_pair_plan(&f.config, &r, rects.as_mut_ptr(), capacity, &mut len) };
        refused(
            status,
            MORI_ERR_BUFFER_TOO_SMALL,
            &[
                "mori_tp_pair_plan: ",
                &format!("the result needs 3 entries, the output array holds {capacity}"),
            ],
        );
        assert_eq!(len, 3, "*out_len reports the count needed");
        assert!(
            rects.iter().all(|x| x.width == 9),
            "a short array was written"
        );
        let mut segments = [MoriSegment {
            length: 7,
            ..MoriSegment::default()
        }; 4];
        let mut len = 0usize;
        // SAFETY: as above.
        let status = unsafe {
            mori_tp_pair_segments(
                &f.config,
                &r,
                MORI_TP_STAGING_NONE,
                segments.as_mut_ptr(),
                capacity,
                &mut len,
            )
        };
        refused(
            status,
            MORI_ERR_BUFFER_TOO_SMALL,
            &[
                "mori_tp_pair_segments: ",
                &format!("the result needs 3 entries, the output array holds {capacity}"),
            ],
        );
        assert_eq!(len, 3, "*out_len reports the count needed");
        assert!(
            segments.iter().all(|s| s.length == 7),
            "a short array was written"
        );
    }
    // A NULL array said to hold entries.
    let mut len = 12345usize;
    // SAFETY: NULL out with a capacity.
    let status = unsafe { mori_tp_pair_plan(&f.config, &r, null_mut(), 3, &mut len) };
    refused(status, MORI_ERR_NULL_POINTER, &["out is NULL"]);
    assert_eq!(len, 12345);
    // SAFETY: NULL out_len.
    let status = unsafe { mori_tp_pair_plan(&f.config, &r, null_mut(), 0, null_mut()) };
    refused(status, MORI_ERR_NULL_POINTER, &["out_len is NULL"]);
}

#[test]
fn staging_for_and_staging_len_refuse_nulls_and_overflow_and_write_nothing() {
    let f = Fixture::new();
    // The fixture's answers, for reference: the decode page holds only the moved head, so the
    // decode side is full and the prefill side is staged.
    let outcomes = config_outcomes(&f.config, f.tokens);
    assert!(
        outcomes.iter().all(|&(_, s, _)| s == MORI_OK),
        "{outcomes:?}"
    );
    let mut staging = 0xDEAD_u32;
    // SAFETY (every call below): NULL where the test says, valid pointers elsewhere.
    let status = unsafe { mori_tp_pair_staging_for(null(), &mut staging) };
    refused(
        status,
        MORI_ERR_NULL_POINTER,
        &["mori_tp_pair_staging_for: ", "config is NULL"],
    );
    assert_eq!(staging, 0xDEAD);
    let status = unsafe { mori_tp_pair_staging_for(&f.config, null_mut()) };
    refused(status, MORI_ERR_NULL_POINTER, &["out_staging is NULL"]);
    let mut len = 0xBEEF_u64;
    let status = unsafe { mori_tp_pair_staging_len(null(), 40, &mut len) };
    refused(
        status,
        MORI_ERR_NULL_POINTER,
        &["mori_tp_pair_staging_len: ", "config is NULL"],
    );
    let status = unsafe { mori_tp_pair_staging_len(&f.config, 40, null_mut()) };
    refused(status, MORI_ERR_NULL_POINTER, &["out_len is NULL"]);
    // N * n * head_bytes past 64 bits: the product and its factors are named.
    let status = unsafe { mori_tp_pair_staging_len(&f.config, u64::MAX / 16, &mut len) };
    refused(
        status,
        MORI_ERR_INVALID_ARGUMENT,
        &[
            "mori_tp_pair_staging_len: ",
            "staging_len (tokens * n * head_bytes) = 1152921504606846975 * 32 overflows 64 bits",
        ],
    );
    assert_eq!(len, 0xBEEF, "a refused staging_len wrote its output");
    // The largest N that fits is answered.
    let status = unsafe { mori_tp_pair_staging_len(&f.config, u64::MAX / 32, &mut len) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    assert_eq!(len, u64::MAX / 32 * 32);
}

#[test]
fn a_null_decode_page_array_with_pages_is_refused_by_every_function() {
    let f = Fixture::new();
    let r = MoriTpRequest {
        dst_pages: null(),
        ..f.request()
    };
    for (function, status, message) in f.outcomes(&f.config, &r) {
        assert_eq!(status, MORI_ERR_NULL_POINTER, "{function}: {message}");
        assert!(
            message.contains("request.dst_pages is NULL but its length is 1"),
            "{function}: {message:?}"
        );
    }
    // NULL with no pages is an empty list: the request of 0 tokens passes.
    let empty = MoriTpRequest {
        src_pages: null(),
        num_src_pages: 0,
        dst_pages: null(),
        num_dst_pages: 0,
        num_tokens: 0,
    };
    for (function, status, message) in f.outcomes(&f.config, &empty) {
        assert_eq!(status, MORI_OK, "{function}: {message}");
    }
}

#[test]
fn pack_and_unpack_refuse_a_region_overlapping_a_page_buffer_and_write_nothing() {
    let f = Fixture::new();
    let r = f.request();
    // Prefill buffer: 8 pages of 4 heads of 16 slots of 32 bytes; its region needs 40 * 32.
    let src_len = 8 * 16 * 4 * 32;
    let region_len = 40 * 32u64;
    let mut shared: Vec<u8> = (0..src_len + region_len as usize)
        .map(|i| i as u8)
        .collect();
    let before = shared.clone();
    let base = shared.as_mut_ptr();
    let src_ptrs = [base.cast_const().cast::<c_void>()];
    for at in [0usize, 1000, src_len - 1] {
        // SAFETY: the region lies inside the same allocation, `at` bytes in.
        let (staging, status) = unsafe {
            let staging = base.add(at);
            let status = mori_tp_pair_pack(
                &f.config,
                MORI_TP_STAGING_SRC,
                src_ptrs.as_ptr(),
                1,
                src_len as u64,
                &r,
                staging.cast(),
                region_len,
                &HOST,
            );
            (staging, status)
        };
        refused(
            status,
            MORI_ERR_INVALID_ARGUMENT,
            &[
                "mori_tp_pair_pack: ",
                &format!(
                    "the staging region [{:#x}, +{region_len}) overlaps source buffer 0 [{:#x}, +{src_len})",
                    staging as usize, base as usize
                ),
            ],
        );
        assert!(shared == before, "a refused pack wrote (region at +{at})");
    }
    // Right after the buffer: no overlap, and the pack runs.
    // SAFETY: the region is the allocation's last region_len bytes.
    let status = unsafe {
        mori_tp_pair_pack(
            &f.config,
            MORI_TP_STAGING_SRC,
            src_ptrs.as_ptr(),
            1,
            src_len as u64,
            &r,
            base.add(src_len).cast(),
            region_len,
            &HOST,
        )
    };
    assert_eq!(status, MORI_OK, "{}", last_error());

    // Decode buffer: 2 pages of 64 slots of one 32-byte head.
    let dst_len = 2 * 64 * 32;
    let mut shared: Vec<u8> = (0..dst_len + region_len as usize)
        .map(|i| (i * 7) as u8)
        .collect();
    let before = shared.clone();
    let base = shared.as_mut_ptr();
    let dst_ptrs = [base.cast::<c_void>()];
    for mode in [MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH] {
        for at in [0usize, 100, dst_len - 1] {
            // SAFETY: the region lies inside the same allocation, `at` bytes in.
            let (staging, status) = unsafe {
                let staging = base.add(at).cast_const();
                let status = mori_tp_pair_unpack(
                    &f.config,
                    mode,
                    staging.cast(),
                    region_len,
                    dst_ptrs.as_ptr(),
                    1,
                    dst_len as u64,
                    &r,
                    &HOST,
                );
                (staging, status)
            };
            refused(
                status,
                MORI_ERR_INVALID_ARGUMENT,
                &[
                    "mori_tp_pair_unpack: ",
                    &format!(
                        "the staging region [{:#x}, +{region_len}) overlaps destination buffer 0 [{:#x}, +{dst_len})",
                        staging as usize, base as usize
                    ),
                ],
            );
            assert!(shared == before, "a refused unpack wrote (region at +{at})");
        }
    }
}

#[test]
fn unpack_refuses_modes_it_does_not_take_a_short_region_and_a_null_one() {
    let f = Fixture::new();
    let r = f.request();
    let region = vec![0x42u8; 40 * 32];
    let before = vec![0xC3u8; 2 * 64 * 32];
    let mut dst = before.clone();
    let dst_ptrs = [dst.as_mut_ptr().cast::<c_void>()];
    let unpack = |mode: u32, staging: *const c_void, capacity: u64| {
        // SAFETY: a region of at least `capacity` bytes (or NULL) and a buffer of 4096.
        unsafe {
            mori_tp_pair_unpack(
                &f.config,
                mode,
                staging,
                capacity,
                dst_ptrs.as_ptr(),
                1,
                4096,
                &r,
                &HOST,
            )
        }
    };
    let at = region.as_ptr().cast::<c_void>();
    for (mode, part) in [
        (
            MORI_TP_STAGING_NONE,
            "unpack takes staging mode DST or BOTH, not None",
        ),
        (
            MORI_TP_STAGING_SRC,
            "unpack takes staging mode DST or BOTH, not Src",
        ),
        (4, "staging_mode 4 is not a MoriTpStaging"),
    ] {
        refused(unpack(mode, at, 1280), MORI_ERR_INVALID_ARGUMENT, &[part]);
    }
    for mode in [MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH] {
        refused(
            unpack(mode, at, 1279),
            MORI_ERR_BUFFER_TOO_SMALL,
            &[
                "mori_tp_pair_unpack: ",
                "staging_capacity 1279 is below the 1280 bytes the request needs (1 buffers * staging_len 1280)",
            ],
        );
        refused(
            unpack(mode, null(), 1280),
            MORI_ERR_NULL_POINTER,
            &["staging is NULL but staging_capacity is 1280"],
        );
    }
    assert!(dst == before, "a refused unpack wrote the destination");
    // The same region, whole: the unpack runs.
    assert_eq!(
        unpack(MORI_TP_STAGING_DST, at, 1280),
        MORI_OK,
        "{}",
        last_error()
    );
    assert!(dst != before);
}
