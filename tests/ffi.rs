//! The C ABI under bad input: every refusal returns its documented code, sets a message that
//! names the values, and leaves every output and destination byte unchanged. Plus concurrency:
//! many threads at once, each with its own last error.

use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};

use mori_tp::ffi::*;

/// 8 KV heads of 16 bytes, page size 4, prefill TP 2 -> decode TP 4; the pair (1, 3) sends heads
/// 6 and 7: 32 bytes at offset 32 of each 64-byte source token into each 32-byte decode token.
fn params() -> MoriTpSliceParams {
    MoriTpSliceParams {
        prefill_tp_size: 2,
        prefill_tp_rank: 1,
        decode_tp_size: 4,
        decode_tp_rank: 3,
        total_kv_heads: 8,
        page_size: 4,
        src_item_len: 4 * 4 * 16,
        dst_item_len: 4 * 2 * 16,
    }
}

const PAGES: usize = 6;
const BUFFERS: usize = 2;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn assert_message(parts: &[&str]) {
    let message = last_error();
    for part in parts {
        assert!(
            message.contains(part),
            "last error {message:?} does not mention {part:?}"
        );
    }
}

fn config() -> MoriTpSliceConfig {
    let mut out = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_slice_config(&params(), &mut out) },
        MORI_OK
    );
    assert_eq!(
        (out.action, out.first_head, out.num_heads),
        (MORI_TP_ACTION_SEND, 6, 2)
    );
    out
}

/// Source and destination buffers of one rank pair, with the destination's initial bytes kept
/// to prove that a refused call wrote nothing.
struct Fixture {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    initial: Vec<Vec<u8>>,
}

impl Fixture {
    fn new() -> Self {
        let p = params();
        let src = (0..BUFFERS)
            .map(|b| {
                (0..PAGES * p.src_item_len as usize)
                    .map(|i| (i * 7 + b) as u8)
                    .collect()
            })
            .collect();
        let dst: Vec<Vec<u8>> = (0..BUFFERS)
            .map(|b| vec![0xC0 | b as u8; PAGES * p.dst_item_len as usize])
            .collect();
        Fixture {
            src,
            initial: dst.clone(),
            dst,
        }
    }

    fn send_with(
        &mut self,
        config: &MoriTpSliceConfig,
        src_pages: &[i32],
        dst_pages: &[i32],
        src_capacity: u64,
        dst_capacity: u64,
        options: Option<&MoriSendOptions>,
    ) -> MoriStatus {
        assert_eq!(src_pages.len(), dst_pages.len());
        let src: Vec<*const c_void> = self.src.iter().map(|b| b.as_ptr().cast()).collect();
        let dst: Vec<*mut c_void> = self.dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let buffers = MoriKvBuffers {
            src: src.as_ptr(),
            dst: dst.as_ptr(),
            num_buffers: BUFFERS,
            src_capacity,
            dst_capacity,
        };
        // SAFETY: every pointer is valid for the capacities passed (tests that lie about a
        // capacity only ever make it smaller than the real buffer).
        unsafe {
            mori_tp_kvcache_send(
                config,
                &buffers,
                src_pages.as_ptr(),
                dst_pages.as_ptr(),
                src_pages.len(),
                options.map_or(null(), |o| o as *const _),
            )
        }
    }

    fn send(
        &mut self,
        config: &MoriTpSliceConfig,
        src_pages: &[i32],
        dst_pages: &[i32],
    ) -> MoriStatus {
        let (src_cap, dst_cap) = self.capacities();
        self.send_with(config, src_pages, dst_pages, src_cap, dst_cap, None)
    }

    fn capacities(&self) -> (u64, u64) {
        (self.src[0].len() as u64, self.dst[0].len() as u64)
    }

    fn assert_unchanged(&self) {
        assert!(
            self.dst == self.initial,
            "a refused call changed destination bytes"
        );
    }
}

#[test]
fn a_good_send_moves_exactly_the_slice() {
    let mut f = Fixture::new();
    assert_eq!(f.send(&config(), &[4, 1, 2], &[0, 5, 3]), MORI_OK);
    let p = params();
    let (src_item, dst_item) = (p.src_item_len as usize, p.dst_item_len as usize);
    let mut expected = f.initial.clone();
    for (b, buf) in expected.iter_mut().enumerate() {
        for (sp, dp) in [(4, 0), (1, 5), (2, 3)] {
            for t in 0..4 {
                let from = sp * src_item + t * 64 + 32;
                buf[dp * dst_item + t * 32..][..32].copy_from_slice(&f.src[b][from..from + 32]);
            }
        }
    }
    assert!(f.dst == expected);
}

#[test]
fn null_pointers_are_refused_by_every_function() {
    let c = config();
    let pages = [0i32, 1];
    let mut out = MoriTpSliceConfig::default();
    let mut len = 99usize;
    let mut rects = [MoriCopyRect::default(); 4];
    // SAFETY (whole test): each call gets NULL where the test says, valid pointers elsewhere.
    unsafe {
        assert_eq!(
            mori_tp_slice_config(null(), &mut out),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["mori_tp_slice_config", "params is NULL"]);
        assert_eq!(
            mori_tp_slice_config(&params(), null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["out is NULL"]);
        assert_eq!(out, MoriTpSliceConfig::default());

        let plan =
            |config: *const MoriTpSliceConfig,
             src: *const i32,
             dst: *const i32,
             out: *mut MoriCopyRect,
             len: *mut usize| mori_tp_plan(config, src, dst, 2, out, 4, len);
        assert_eq!(
            plan(
                null(),
                pages.as_ptr(),
                pages.as_ptr(),
                rects.as_mut_ptr(),
                &mut len
            ),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["mori_tp_plan", "config is NULL"]);
        assert_eq!(
            plan(&c, null(), pages.as_ptr(), rects.as_mut_ptr(), &mut len),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["src_pages is NULL but its length is 2"]);
        assert_eq!(
            plan(&c, pages.as_ptr(), null(), rects.as_mut_ptr(), &mut len),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["dst_pages is NULL but its length is 2"]);
        assert_eq!(
            plan(&c, pages.as_ptr(), pages.as_ptr(), null_mut(), &mut len),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["out is NULL but its length is 4"]);
        assert_eq!(
            plan(
                &c,
                pages.as_ptr(),
                pages.as_ptr(),
                rects.as_mut_ptr(),
                null_mut()
            ),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["out_len is NULL"]);
        assert_eq!(
            len, 99,
            "out_len is only written on success or BUFFER_TOO_SMALL"
        );
        assert_eq!(rects, [MoriCopyRect::default(); 4]);

        let mut segs = [MoriSegment::default(); 4];
        let status =
            mori_tp_plan_segments(null(), null(), null(), 0, segs.as_mut_ptr(), 4, &mut len);
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        assert_message(&["mori_tp_plan_segments", "config is NULL"]);
        let status = mori_tp_plan_segments(&c, null(), null(), 0, null_mut(), 0, null_mut());
        assert_eq!(status, MORI_ERR_NULL_POINTER);
        assert_message(&["out_len is NULL"]);

        let mut f = Fixture::new();
        assert_eq!(
            mori_tp_kvcache_send(null(), null(), null(), null(), 0, null()),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["mori_tp_kvcache_send", "is NULL"]);
        let buffers = MoriKvBuffers {
            src: null(),
            dst: null(),
            num_buffers: 2,
            src_capacity: 1 << 20,
            dst_capacity: 1 << 20,
        };
        assert_eq!(
            mori_tp_kvcache_send(&c, &buffers, pages.as_ptr(), pages.as_ptr(), 2, null()),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["buffers.src is NULL but its length is 2"]);
        assert_eq!(
            mori_tp_kvcache_send(&c, null(), pages.as_ptr(), pages.as_ptr(), 2, null()),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["buffers is NULL"]);

        // A NULL entry inside the pointer arrays.
        let src = [f.src[0].as_ptr().cast::<c_void>(), null()];
        let dst: Vec<*mut c_void> = f.dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let (src_capacity, dst_capacity) = f.capacities();
        let buffers = MoriKvBuffers {
            src: src.as_ptr(),
            dst: dst.as_ptr(),
            num_buffers: 2,
            src_capacity,
            dst_capacity,
        };
        assert_eq!(
            mori_tp_kvcache_send(&c, &buffers, pages.as_ptr(), pages.as_ptr(), 2, null()),
            MORI_ERR_NULL_POINTER
        );
        assert_message(&["buffers.src[1] is NULL"]);
        f.assert_unchanged();
    }
}

#[test]
fn null_arrays_of_length_zero_are_empty_arrays() {
    let c = config();
    let mut len = 99usize;
    // SAFETY: (NULL, 0) arrays are valid by contract.
    unsafe {
        assert_eq!(
            mori_tp_plan(&c, null(), null(), 0, null_mut(), 0, &mut len),
            MORI_OK
        );
        assert_eq!(len, 0);
        let empty = MoriKvBuffers {
            src: null(),
            dst: null(),
            num_buffers: 0,
            src_capacity: 0,
            dst_capacity: 0,
        };
        assert_eq!(
            mori_tp_kvcache_send(&c, &empty, null(), null(), 0, null()),
            MORI_OK
        );
    }
}

#[test]
fn zero_and_out_of_range_fields_are_invalid_arguments_and_leave_out_alone() {
    let cases: [(MoriTpSliceParams, MoriStatus, &[&str]); 9] = [
        (
            MoriTpSliceParams {
                prefill_tp_size: 0,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["prefill side", "tp_size is 0"],
        ),
        (
            MoriTpSliceParams {
                decode_tp_size: 0,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["decode side", "tp_size is 0"],
        ),
        (
            MoriTpSliceParams {
                page_size: 0,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["page_size is 0"],
        ),
        (
            MoriTpSliceParams {
                src_item_len: 0,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["src_item_len is 0"],
        ),
        (
            MoriTpSliceParams {
                prefill_tp_rank: 2,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["tp_rank 2", "tp_size 2"],
        ),
        (
            MoriTpSliceParams {
                decode_tp_rank: u32::MAX,
                ..params()
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["tp_rank 4294967295"],
        ),
        (
            MoriTpSliceParams {
                total_kv_heads: 0,
                ..params()
            },
            MORI_ERR_TOPOLOGY,
            &["total_kv_heads is 0"],
        ),
        (
            MoriTpSliceParams {
                decode_tp_size: 3,
                decode_tp_rank: 2,
                ..params()
            },
            MORI_ERR_TOPOLOGY,
            &["tp_size 3", "total_kv_heads 8"],
        ),
        (
            MoriTpSliceParams {
                dst_item_len: 4 * 2 * 8,
                ..params()
            },
            MORI_ERR_LAYOUT_MISMATCH,
            &["bytes_per_head 8 != prefill side bytes_per_head 16"],
        ),
    ];
    for (p, code, parts) in cases {
        let sentinel = MoriTpSliceConfig {
            page_size: 12345,
            ..Default::default()
        };
        let mut out = sentinel;
        // SAFETY: valid pointers.
        let status = unsafe { mori_tp_slice_config(&p, &mut out) };
        assert_eq!(status, code, "{p:?}: {}", last_error());
        assert_message(parts);
        assert_eq!(out, sentinel, "out must not be written on failure");
    }
}

#[test]
fn unknown_enum_values_and_flag_bits_are_invalid_arguments() {
    let mut f = Fixture::new();
    let c = config();
    let unknown_action = MoriTpSliceConfig { action: 3, ..c };
    assert_eq!(
        f.send(&unknown_action, &[0], &[0]),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&["config.action 3 is not a MoriTpAction"]);
    let (src_cap, dst_cap) = f.capacities();
    let backend = MoriSendOptions {
        backend: 7,
        flags: 0,
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&backend)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&["options.backend 7 is not a MoriBackend"]);
    let flags = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: 0x19,
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&flags)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&[
        "options.flags 0x19 has unknown bits 0x18",
        "MORI_SEND_MEMCPY2D = 0x4",
    ]);
    // The two path flags ask for different paths: refused, on every backend.
    let both = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: MORI_SEND_COPY_KERNEL | MORI_SEND_MEMCPY2D,
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&both)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&[
        "options.flags 0x6 sets both MORI_SEND_COPY_KERNEL (0x2) and MORI_SEND_MEMCPY2D",
    ]);
    assert_eq!(MORI_SEND_MEMCPY2D, 4);
    // The SM budget (bits 16-31) bounds the kernel: refused with the per-rect copies, naming
    // the flags and the budget; bits just below it are still unknown.
    let budget_memcpy = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: MORI_SEND_MEMCPY2D | (5 << MORI_SEND_MAX_BLOCKS_SHIFT),
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&budget_memcpy)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&[
        "options.flags 0x50004 sets a block budget of 5",
        "MORI_SEND_MEMCPY2D (0x4)",
    ]);
    let below = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: 0x8000 | (1 << MORI_SEND_MAX_BLOCKS_SHIFT),
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&below)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&["options.flags 0x18000 has unknown bits 0x8000"]);
    assert_eq!(
        (
            MORI_SEND_MAX_BLOCKS_MASK,
            MORI_SEND_MAX_BLOCKS_LIMIT << MORI_SEND_MAX_BLOCKS_SHIFT
        ),
        (0xffff_0000, 0xffff_0000)
    );
    // The host backend ignores a budget (1 block, or the largest), as it ignores the path flags.
    for blocks in [1, MORI_SEND_MAX_BLOCKS_LIMIT] {
        let budget = MoriSendOptions {
            backend: MORI_BACKEND_HOST,
            flags: MORI_SEND_COPY_KERNEL | (blocks << MORI_SEND_MAX_BLOCKS_SHIFT),
            stream: null_mut(),
        };
        assert_eq!(
            f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&budget)),
            MORI_OK,
            "budget {blocks}"
        );
    }
    // Those sends moved the page; the refusals below start from the initial bytes again.
    assert!(
        f.dst != f.initial,
        "a budget on the host backend moved nothing"
    );
    let initial = f.initial.clone();
    f.dst.clone_from(&initial);
    let mut fake_stream = 0u8;
    let stream = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: MORI_SEND_SYNCHRONIZE,
        stream: (&raw mut fake_stream).cast(),
    };
    assert_eq!(
        f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&stream)),
        MORI_ERR_INVALID_ARGUMENT
    );
    assert_message(&["options.stream", "host backend", "takes no stream"]);
    let mut len = 0;
    // SAFETY: valid pointers.
    let status =
        unsafe { mori_tp_plan(&unknown_action, null(), null(), 0, null_mut(), 0, &mut len) };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    f.assert_unchanged();
}

// The HIP build has its own tests of device absence (tests/hip_runtime.rs).
#[cfg(not(feature = "hip"))]
#[test]
fn the_hip_backend_without_the_hip_feature_is_unavailable_and_writes_nothing() {
    let mut f = Fixture::new();
    let (src_cap, dst_cap) = f.capacities();
    let hip = MoriSendOptions {
        backend: MORI_BACKEND_HIP,
        flags: 0,
        stream: null_mut(),
    };
    assert_eq!(
        f.send_with(&config(), &[0], &[0], src_cap, dst_cap, Some(&hip)),
        MORI_ERR_BACKEND_UNAVAILABLE
    );
    assert_message(&["backend unavailable", "without the `hip` cargo feature"]);
    f.assert_unchanged();
}

#[test]
fn a_bad_request_gets_the_same_refusal_whatever_backend_it_asks_for() {
    // Validation comes before the backend is opened: a page past capacity is OUT_OF_BOUNDS for
    // HOST, AUTO and HIP alike, on a build with or without HIP and with or without a device.
    let mut f = Fixture::new();
    let (src_cap, dst_cap) = f.capacities();
    for backend in [MORI_BACKEND_HOST, MORI_BACKEND_AUTO, MORI_BACKEND_HIP] {
        let options = MoriSendOptions {
            backend,
            flags: MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            stream: null_mut(),
        };
        let status = f.send_with(
            &config(),
            &[0, 9],
            &[0, 1],
            src_cap,
            dst_cap,
            Some(&options),
        );
        assert_eq!(
            status,
            MORI_ERR_OUT_OF_BOUNDS,
            "backend {backend}: {}",
            last_error()
        );
        assert_message(&["prefill side: page 9 at position 1"]);
    }
    f.assert_unchanged();
}

#[test]
fn misaligned_struct_pointers_are_refused_like_misaligned_arrays() {
    let f = Fixture::new();
    // A config one byte into a larger buffer: readable, but not aligned for MoriTpSliceConfig.
    let mut storage = [0u64; 16];
    let c = config();
    // SAFETY: the copy lands inside `storage`.
    let misaligned = unsafe {
        let at = storage.as_mut_ptr().cast::<u8>().add(1);
        std::ptr::copy_nonoverlapping(
            (&raw const c).cast::<u8>(),
            at,
            size_of::<MoriTpSliceConfig>(),
        );
        at.cast::<MoriTpSliceConfig>()
    };
    let mut len = 5usize;
    let pages = [0, 1];
    // SAFETY: the library refuses the misaligned pointer before reading through it.
    let status = unsafe {
        mori_tp_plan(
            misaligned,
            pages.as_ptr(),
            pages.as_ptr(),
            2,
            null_mut(),
            0,
            &mut len,
        )
    };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert_message(&["config (0x", "is not aligned to 8 bytes"]);
    assert_eq!(len, 5);
    let mut out = [0u64; 16];
    // SAFETY: as above, for the output struct.
    let status =
        unsafe { mori_tp_slice_config(&params(), out.as_mut_ptr().cast::<u8>().add(4).cast()) };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert_message(&["out (0x", "is not aligned"]);
    assert_eq!(out, [0u64; 16]);
    f.assert_unchanged();
}

#[test]
fn sizes_computed_from_valid_looking_input_never_wrap() {
    // 2^24 pairs of page 0 of 1 TiB pages, no buffers: every page fits in 64 bits, but the bytes
    // per buffer (tokens * slice width) do not. Refused with the numbers, in every build.
    let item: u64 = 1 << 40;
    let c = {
        let p = MoriTpSliceParams {
            prefill_tp_size: 1,
            prefill_tp_rank: 0,
            decode_tp_size: 1,
            decode_tp_rank: 0,
            total_kv_heads: 1,
            page_size: 1,
            src_item_len: item,
            dst_item_len: item,
        };
        let mut out = MoriTpSliceConfig::default();
        // SAFETY: valid pointers.
        assert_eq!(unsafe { mori_tp_slice_config(&p, &mut out) }, MORI_OK);
        out
    };
    let pages = vec![0i32; 1 << 24];
    let empty = MoriKvBuffers {
        src: null(),
        dst: null(),
        num_buffers: 0,
        src_capacity: item,
        dst_capacity: item,
    };
    let mut len = 0usize;
    // SAFETY: valid arrays; no buffers.
    unsafe {
        let status = mori_tp_kvcache_send(
            &c,
            &empty,
            pages.as_ptr(),
            pages.as_ptr(),
            pages.len(),
            null(),
        );
        assert_eq!(status, MORI_ERR_INVALID_ARGUMENT, "{}", last_error());
        assert_message(&[
            "bytes per buffer",
            "16777216 * 1099511627776 overflows 64 bits",
        ]);
        let status = mori_tp_plan(
            &c,
            pages.as_ptr(),
            pages.as_ptr(),
            pages.len(),
            null_mut(),
            0,
            &mut len,
        );
        assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
        let status = mori_tp_plan_segments(
            &c,
            pages.as_ptr(),
            pages.as_ptr(),
            pages.len(),
            null_mut(),
            0,
            &mut len,
        );
        assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    }
}

#[test]
fn hand_edited_inconsistent_configs_are_refused_before_any_byte_moves() {
    let c = config();
    let cases: [(MoriTpSliceConfig, MoriStatus, &[&str]); 5] = [
        // Slice wider than the 32-byte decode token.
        (
            MoriTpSliceConfig {
                heads_bytes_per_token_to_send: 48,
                num_heads: 3,
                ..c
            },
            MORI_ERR_SLICE_OVERFLOW,
            &["offset 32 of width 48", "64-byte token slot"],
        ),
        // An offset that pushes the slice out of the destination token.
        (
            MoriTpSliceConfig {
                dst_head_slice_offset: 16,
                ..c
            },
            MORI_ERR_SLICE_OVERFLOW,
            &["decode side", "offset 16 of width 32", "32-byte token slot"],
        ),
        // item length is not page size times bytes per token.
        (
            MoriTpSliceConfig {
                dst_item_len: 256,
                ..c
            },
            MORI_ERR_INVALID_ARGUMENT,
            &["bytes_per_token_dst 32", "dst_item_len / page_size = 64"],
        ),
        (
            MoriTpSliceConfig {
                src_item_len: 250,
                ..c
            },
            MORI_ERR_LAYOUT_MISMATCH,
            &["src_item_len 250 is not a multiple of page_size 4"],
        ),
        (
            MoriTpSliceConfig { page_size: 0, ..c },
            MORI_ERR_INVALID_ARGUMENT,
            &["page_size is 0"],
        ),
    ];
    for (config, code, parts) in cases {
        let mut f = Fixture::new();
        assert_eq!(
            f.send(&config, &[0, 1], &[2, 3]),
            code,
            "{config:?}: {}",
            last_error()
        );
        assert_message(parts);
        f.assert_unchanged();
        let mut rects = [MoriCopyRect::default(); 2];
        let mut len = 77;
        // SAFETY: valid pointers.
        let status = unsafe {
            mori_tp_plan(
                &config,
                [0, 1].as_ptr(),
                [2, 3].as_ptr(),
                2,
                rects.as_mut_ptr(),
                2,
                &mut len,
            )
        };
        assert_eq!(status, code);
        assert_eq!((len, rects), (77, [MoriCopyRect::default(); 2]));
    }
}

#[test]
fn bad_page_indices_and_capacities_are_out_of_bounds_and_write_nothing() {
    let p = params();
    let (src_item, dst_item) = (p.src_item_len, p.dst_item_len);
    let c = config();
    let mut f = Fixture::new();
    let (src_cap, dst_cap) = f.capacities();

    // A negative index, even after good pairs that would have been copied first.
    assert_eq!(f.send(&c, &[0, 1, -1], &[0, 1, 2]), MORI_ERR_OUT_OF_BOUNDS);
    assert_message(&["prefill side", "page index -1 at position 2 is negative"]);
    // One past the capacity: the buffers hold pages 0..6.
    assert_eq!(f.send(&c, &[0, 1, 2], &[0, 1, 6]), MORI_ERR_OUT_OF_BOUNDS);
    assert_message(&[
        "decode side",
        "page 6 at position 2",
        &format!("{}", 7 * dst_item),
        &format!("dst_capacity {dst_cap}"),
    ]);
    // A capacity one byte short of the last page.
    let short = 6 * src_item - 1;
    assert_eq!(
        f.send_with(&c, &[5], &[0], short, dst_cap, None),
        MORI_ERR_OUT_OF_BOUNDS
    );
    assert_message(&[
        "prefill side",
        "page 5 at position 0",
        &format!("{}", 6 * src_item),
        &format!("src_capacity {short}"),
    ]);
    // An index whose byte offset overflows u64: a config with huge (consistent) pages.
    let huge = MoriTpSliceConfig {
        src_item_len: 1 << 40,
        bytes_per_token_src: 1 << 38,
        ..c
    };
    assert_eq!(
        f.send_with(&huge, &[i32::MAX], &[0], src_cap, dst_cap, None),
        MORI_ERR_OUT_OF_BOUNDS
    );
    assert_message(&["page 2147483647", "overflows u64"]);
    f.assert_unchanged();
    assert_eq!(
        f.send(&c, &[0, 1, 5], &[0, 1, 5]),
        MORI_OK,
        "the same pages within bounds work"
    );
}

#[test]
fn a_too_small_plan_output_reports_the_size_needed_and_writes_nothing() {
    let c = config();
    let (src, dst) = ([0i32, 1, 4, 2], [3i32, 4, 0, 5]); // runs: 0,1->3,4 | 4->0 | 2->5
    let mut len = 0usize;
    // SAFETY (whole test): valid pointers with the stated lengths.
    unsafe {
        assert_eq!(
            mori_tp_plan(&c, src.as_ptr(), dst.as_ptr(), 4, null_mut(), 0, &mut len),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(len, 3, "the size query reports the rects needed");
        let mut rects = [MoriCopyRect::default(); 2];
        assert_eq!(
            mori_tp_plan(
                &c,
                src.as_ptr(),
                dst.as_ptr(),
                4,
                rects.as_mut_ptr(),
                2,
                &mut len
            ),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!((len, rects), (3, [MoriCopyRect::default(); 2]));
        let mut rects = [MoriCopyRect::default(); 3];
        assert_eq!(
            mori_tp_plan(
                &c,
                src.as_ptr(),
                dst.as_ptr(),
                4,
                rects.as_mut_ptr(),
                3,
                &mut len
            ),
            MORI_OK
        );
        assert_eq!(rects[0].height, 8);

        let mut segs = [MoriSegment::default(); 15];
        assert_eq!(
            mori_tp_plan_segments(
                &c,
                src.as_ptr(),
                dst.as_ptr(),
                4,
                segs.as_mut_ptr(),
                15,
                &mut len
            ),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(len, 16, "4 pages of 4 tokens, one segment per token row");
        assert_message(&["needs 16 entries", "holds 15"]);
        assert_eq!(segs, [MoriSegment::default(); 15]);
    }
}

#[test]
fn a_size_query_leaves_the_last_message_and_a_pointer_to_it_alone() {
    let c = config();
    let (src, dst) = ([0i32, 1], [3i32, 4]);
    let mut refused = MoriTpSliceConfig::default();
    let mut len = 0usize;
    // SAFETY (whole test): valid pointers with the stated lengths; `kept` is read only while
    // the library promises it is valid (no failing call in between).
    unsafe {
        let bad = MoriTpSliceParams {
            prefill_tp_size: 3,
            ..params()
        };
        assert_eq!(mori_tp_slice_config(&bad, &mut refused), MORI_ERR_TOPOLOGY);
        let kept = mori_tp_last_error_message();
        let before = CStr::from_ptr(kept).to_owned();
        assert_eq!(
            mori_tp_plan(&c, src.as_ptr(), dst.as_ptr(), 2, null_mut(), 0, &mut len),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(len, 1);
        assert_eq!(
            mori_tp_last_error_message(),
            kept,
            "the message was replaced"
        );
        assert_eq!(CStr::from_ptr(kept), before.as_c_str());
        assert_message(&["mori_tp_slice_config: invalid topology"]);
        // An array of capacity 0 that is not NULL is a failure, not a size query.
        let mut rect = MoriCopyRect::default();
        assert_eq!(
            mori_tp_plan(&c, src.as_ptr(), dst.as_ptr(), 2, &mut rect, 0, &mut len),
            MORI_ERR_BUFFER_TOO_SMALL
        );
        assert_message(&["needs 1 entries", "holds 0"]);
    }
}

#[test]
fn misaligned_page_arrays_are_refused() {
    let c = config();
    let storage = [0u32; 4];
    // SAFETY: one byte into a live array, only passed for the library to refuse.
    let misaligned = unsafe { storage.as_ptr().cast::<u8>().add(1) }.cast::<i32>();
    let mut len = 0;
    // SAFETY: the library checks alignment before reading.
    let status = unsafe { mori_tp_plan(&c, misaligned, misaligned, 2, null_mut(), 0, &mut len) };
    assert_eq!(status, MORI_ERR_INVALID_ARGUMENT);
    assert_message(&["src_pages", "not aligned to 4 bytes"]);
}

#[test]
fn status_names_versions_and_abi() {
    let name = |s| {
        unsafe { CStr::from_ptr(mori_tp_status_name(s)) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(name(MORI_OK), "MORI_OK");
    assert_eq!(name(MORI_ERR_SLICE_OVERFLOW), "MORI_ERR_SLICE_OVERFLOW");
    assert_eq!(name(MORI_ERR_PANIC), "MORI_ERR_PANIC");
    assert_eq!(name(11), "MORI_ERR_POOL_FULL");
    assert_eq!(name(12), "MORI_ERR_UNKNOWN");
    assert_eq!(name(-1), "MORI_ERR_UNKNOWN");
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(mori_tp_version()) }
        .to_str()
        .unwrap();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    assert_eq!(mori_tp_abi_version(), MORI_TP_ABI_VERSION);
    assert_eq!(MORI_TP_ABI_VERSION, 1);
    let [major, minor, patch] =
        [0, 1, 2].map(|i| version.split('.').nth(i).unwrap().parse::<u32>().unwrap());
    assert_eq!(MORI_TP_VERSION, major * 1_000_000 + minor * 1_000 + patch);
}

/// The name of every action, staging and backend value: its macro's name; any other value gets
/// the family's UNKNOWN name, never NULL.
#[test]
fn action_staging_and_backend_values_have_static_names() {
    let text = |p: *const std::ffi::c_char| {
        assert!(!p.is_null());
        // SAFETY: a static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    };
    for (value, expected) in [
        (MORI_TP_ACTION_NOT_PAIRED, "MORI_TP_ACTION_NOT_PAIRED"),
        (MORI_TP_ACTION_SEND, "MORI_TP_ACTION_SEND"),
        (MORI_TP_ACTION_SKIP_REPLICA, "MORI_TP_ACTION_SKIP_REPLICA"),
        (3, "MORI_TP_ACTION_UNKNOWN"),
        (u32::MAX, "MORI_TP_ACTION_UNKNOWN"),
    ] {
        assert_eq!(text(mori_tp_action_name(value)), expected);
    }
    for (value, expected) in [
        (MORI_TP_STAGING_NONE, "MORI_TP_STAGING_NONE"),
        (MORI_TP_STAGING_SRC, "MORI_TP_STAGING_SRC"),
        (MORI_TP_STAGING_DST, "MORI_TP_STAGING_DST"),
        (MORI_TP_STAGING_BOTH, "MORI_TP_STAGING_BOTH"),
        (4, "MORI_TP_STAGING_UNKNOWN"),
    ] {
        assert_eq!(text(mori_tp_staging_name(value)), expected);
    }
    for (value, expected) in [
        (MORI_BACKEND_AUTO, "MORI_BACKEND_AUTO"),
        (MORI_BACKEND_HOST, "MORI_BACKEND_HOST"),
        (MORI_BACKEND_HIP, "MORI_BACKEND_HIP"),
        (MORI_BACKEND_CUDA, "MORI_BACKEND_CUDA"),
        (4, "MORI_BACKEND_UNKNOWN"),
    ] {
        assert_eq!(text(mori_tp_backend_name(value)), expected);
    }
    // The same pointer each time: static strings, nothing to free.
    assert_eq!(mori_tp_action_name(1), mori_tp_action_name(1));
}

#[test]
fn the_struct_layouts_are_the_contracts() {
    use std::mem::{offset_of, size_of};
    assert_eq!(size_of::<MoriTpSliceParams>(), 40);
    assert_eq!(offset_of!(MoriTpSliceParams, page_size), 20);
    assert_eq!(offset_of!(MoriTpSliceParams, src_item_len), 24);
    assert_eq!(size_of::<MoriTpSliceConfig>(), 72);
    assert_eq!(offset_of!(MoriTpSliceConfig, src_item_len), 16);
    assert_eq!(
        offset_of!(MoriTpSliceConfig, heads_bytes_per_token_to_send),
        64
    );
    assert_eq!(size_of::<MoriCopyRect>(), 48);
    assert_eq!(size_of::<MoriSegment>(), 24);
    assert_eq!(size_of::<MoriKvBuffers>(), 40);
    assert_eq!(offset_of!(MoriKvBuffers, num_buffers), 16);
    assert_eq!(size_of::<MoriSendOptions>(), 16);
    assert_eq!(offset_of!(MoriSendOptions, stream), 8);
}

#[test]
fn threads_calling_at_once_each_keep_their_own_last_error() {
    let threads: Vec<_> = (0..16u32)
        .map(|i| {
            std::thread::spawn(move || {
                let mut f = Fixture::new();
                let c = config();
                let last_round = 49;
                for round in 0..=last_round {
                    // Every thread fails with numbers of its own, then succeeds, then checks
                    // that its message survived both its success and the other threads' failures.
                    let bad = MoriTpSliceParams {
                        decode_tp_size: 3 + 2 * i,
                        decode_tp_rank: 0,
                        ..params()
                    };
                    let mut out = MoriTpSliceConfig::default();
                    // SAFETY: valid pointers.
                    let status = unsafe { mori_tp_slice_config(&bad, &mut out) };
                    assert_eq!(
                        status, MORI_ERR_TOPOLOGY,
                        "an odd TP size > 1 never fits 8 heads"
                    );
                    let mine = format!("tp_size {} and total_kv_heads 8", 3 + 2 * i);
                    assert_eq!(f.send(&c, &[round % 6, 5 - round % 6], &[1, 2]), MORI_OK);
                    assert!(last_error().contains(&mine), "thread {i}: {}", last_error());
                }
                let p = params();
                for b in 0..BUFFERS {
                    for t in 0..4 {
                        let at = 2 * p.dst_item_len as usize + t * 32;
                        let src_page = (5 - last_round % 6) as usize; // the last send's page 2
                        let from = src_page * p.src_item_len as usize + t * 64 + 32;
                        assert_eq!(f.dst[b][at..at + 32], f.src[b][from..from + 32]);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread failed");
    }
}

#[test]
fn each_path_flag_alone_is_accepted_and_the_host_backend_ignores_it() {
    let c = config();
    for flags in [MORI_SEND_COPY_KERNEL, MORI_SEND_MEMCPY2D] {
        let mut f = Fixture::new();
        let (src_cap, dst_cap) = f.capacities();
        let one = MoriSendOptions {
            backend: MORI_BACKEND_HOST,
            flags,
            stream: null_mut(),
        };
        assert_eq!(
            f.send_with(&c, &[0], &[0], src_cap, dst_cap, Some(&one)),
            MORI_OK,
            "flags {flags:#x}: {}",
            last_error()
        );
        let mut plain = Fixture::new();
        assert_eq!(plain.send(&c, &[0], &[0]), MORI_OK);
        assert!(
            f.dst == plain.dst,
            "flags {flags:#x}: the bytes of a plain host send"
        );
    }
}

/// The names before the mori_tp_ prefix are aliases: each, called with the same arguments as its
/// new name, returns the same status, writes the same bytes and fails with the same message but
/// for the name, on a good call and on refused ones.
#[test]
fn every_name_before_the_prefix_behaves_as_its_mori_tp_name() {
    let c = config();
    let p = params();
    let pages: Vec<i32> = vec![0, 2, 1];
    let staging_len = 3 * u64::from(p.page_size) * c.heads_bytes_per_token_to_send;
    let capacity = staging_len * BUFFERS as u64;
    // A pair config of the same ranks and a request of the same pages.
    let (mut prefill, mut decode) = (MoriTpLayout::default(), MoriTpLayout::default());
    let mut pair = MoriTpPairConfig::default();
    // SAFETY (every block below): valid pointers, buffers as long as the capacities passed.
    unsafe {
        assert_eq!(mori_tp_layout_nhd(8, 2, 1, 4, 16, &mut prefill), MORI_OK);
        assert_eq!(mori_tp_layout_nhd(8, 4, 3, 4, 16, &mut decode), MORI_OK);
        assert_eq!(mori_tp_pair_config(&prefill, &decode, &mut pair), MORI_OK);
    }
    let request = MoriTpRequest {
        src_pages: pages.as_ptr(),
        num_src_pages: pages.len(),
        dst_pages: pages.as_ptr(),
        num_dst_pages: pages.len(),
        num_tokens: 3 * u64::from(p.page_size),
    };
    let host = MoriSendOptions {
        backend: MORI_BACKEND_HOST,
        flags: 0,
        stream: null_mut(),
    };
    let bad_backend = MoriSendOptions {
        backend: 77,
        ..host
    };
    for options in [&host, &bad_backend] {
        for short in [0, 1] {
            // One fixture per name: each call starts from the same bytes.
            let run = |name: &str, which: usize| {
                let mut f = Fixture::new();
                // The highest page, 2, ends at 3 pages: `short` takes a byte off the last.
                let src_cap = f.capacities().0;
                let dst_cap = 3 * p.dst_item_len - short;
                let src: Vec<*const c_void> = f.src.iter().map(|b| b.as_ptr().cast()).collect();
                let dst: Vec<*mut c_void> =
                    f.dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
                let buffers = MoriKvBuffers {
                    src: src.as_ptr(),
                    dst: dst.as_ptr(),
                    num_buffers: BUFFERS,
                    src_capacity: src_cap,
                    dst_capacity: dst_cap,
                };
                let mut region: Vec<u8> = (0..capacity).map(|i| (i * 3) as u8).collect();
                let region_cap = capacity - short;
                let (r, r_const) = (region.as_mut_ptr().cast(), region.as_ptr().cast());
                let group = MoriTpGroup {
                    config: pair,
                    staging: MORI_TP_STAGING_BOTH,
                    reserved: 0,
                    first_token: 0,
                    request,
                    buffers,
                };
                let n = pages.len();
                let pg = pages.as_ptr();
                let status = unsafe {
                    match (name, which) {
                        ("old", 0) => mori_send_kvcache(&c, &buffers, pg, pg, n, options),
                        ("new", 0) => mori_tp_kvcache_send(&c, &buffers, pg, pg, n, options),
                        ("old", 1) => mori_pack_kvcache(
                            &c,
                            src.as_ptr(),
                            BUFFERS,
                            src_cap,
                            pg,
                            n,
                            r,
                            region_cap,
                            options,
                        ),
                        ("new", 1) => mori_tp_kvcache_pack(
                            &c,
                            src.as_ptr(),
                            BUFFERS,
                            src_cap,
                            pg,
                            n,
                            r,
                            region_cap,
                            options,
                        ),
                        ("old", 2) => mori_unpack_kvcache(
                            &c,
                            r_const,
                            region_cap,
                            dst.as_ptr(),
                            BUFFERS,
                            dst_cap,
                            pg,
                            n,
                            options,
                        ),
                        ("new", 2) => mori_tp_kvcache_unpack(
                            &c,
                            r_const,
                            region_cap,
                            dst.as_ptr(),
                            BUFFERS,
                            dst_cap,
                            pg,
                            n,
                            options,
                        ),
                        ("old", 3) => mori_send_kvcache_pair(&pair, &buffers, &request, options),
                        ("new", 3) => mori_tp_pair_send(&pair, &buffers, &request, options),
                        ("old", 4) => mori_pack_kvcache_pair(
                            &pair,
                            MORI_TP_STAGING_BOTH,
                            src.as_ptr(),
                            BUFFERS,
                            src_cap,
                            &request,
                            r,
                            region_cap,
                            options,
                        ),
                        ("new", 4) => mori_tp_pair_pack(
                            &pair,
                            MORI_TP_STAGING_BOTH,
                            src.as_ptr(),
                            BUFFERS,
                            src_cap,
                            &request,
                            r,
                            region_cap,
                            options,
                        ),
                        ("old", 5) => mori_unpack_kvcache_pair(
                            &pair,
                            MORI_TP_STAGING_BOTH,
                            r_const,
                            region_cap,
                            dst.as_ptr(),
                            BUFFERS,
                            dst_cap,
                            &request,
                            options,
                        ),
                        ("new", 5) => mori_tp_pair_unpack(
                            &pair,
                            MORI_TP_STAGING_BOTH,
                            r_const,
                            region_cap,
                            dst.as_ptr(),
                            BUFFERS,
                            dst_cap,
                            &request,
                            options,
                        ),
                        ("old", 6) => mori_send_kvcache_groups(&group, 1, options),
                        ("new", 6) => mori_tp_groups_send(&group, 1, options),
                        ("old", 7) => mori_pack_kvcache_groups(&group, 1, r, region_cap, options),
                        ("new", 7) => mori_tp_groups_pack(&group, 1, r, region_cap, options),
                        ("old", 8) => {
                            mori_unpack_kvcache_groups(&group, 1, r_const, region_cap, options)
                        }
                        ("new", 8) => {
                            mori_tp_groups_unpack(&group, 1, r_const, region_cap, options)
                        }
                        // A NULL argument, through both names.
                        ("old", _) => mori_send_kvcache_pair(null(), &buffers, &request, options),
                        (_, _) => mori_tp_pair_send(null(), &buffers, &request, options),
                    }
                };
                let dst_bytes: Vec<&[u8]> = f.dst.iter().map(Vec::as_slice).collect();
                (
                    status,
                    last_error(),
                    [dst_bytes, vec![region.as_slice()]].concat().concat(),
                )
            };
            let names = [
                ("mori_send_kvcache", "mori_tp_kvcache_send"),
                ("mori_pack_kvcache", "mori_tp_kvcache_pack"),
                ("mori_unpack_kvcache", "mori_tp_kvcache_unpack"),
                ("mori_send_kvcache_pair", "mori_tp_pair_send"),
                ("mori_pack_kvcache_pair", "mori_tp_pair_pack"),
                ("mori_unpack_kvcache_pair", "mori_tp_pair_unpack"),
                ("mori_send_kvcache_groups", "mori_tp_groups_send"),
                ("mori_pack_kvcache_groups", "mori_tp_groups_pack"),
                ("mori_unpack_kvcache_groups", "mori_tp_groups_unpack"),
                ("mori_send_kvcache_pair", "mori_tp_pair_send"),
            ];
            for (which, (old, new)) in names.into_iter().enumerate() {
                let (old_status, old_message, old_bytes) = run("old", which);
                let (new_status, new_message, new_bytes) = run("new", which);
                assert_eq!(old_status, new_status, "{new}: status");
                assert_eq!(old_bytes, new_bytes, "{new}: bytes written");
                if new_status != MORI_OK {
                    // The same message, each naming the function it was called by.
                    assert!(
                        old_message.starts_with(&format!("{old}: ")),
                        "{old_message}"
                    );
                    assert_eq!(
                        old_message.replacen(old, new, 1),
                        new_message,
                        "{new}: message"
                    );
                }
                let expected_ok = options.backend == MORI_BACKEND_HOST && short == 0 && which < 9;
                assert_eq!(
                    new_status == MORI_OK,
                    expected_ok,
                    "{new}: {}",
                    last_error()
                );
            }
        }
    }
    for status in -2..14 {
        // SAFETY: static strings, never NULL.
        let (old, new) = unsafe {
            (
                CStr::from_ptr(mori_status_str(status)),
                CStr::from_ptr(mori_tp_status_name(status)),
            )
        };
        assert_eq!(old, new);
    }
    for backend in 0..6 {
        // SAFETY: static strings, never NULL.
        let (old, new) = unsafe {
            (
                CStr::from_ptr(mori_backend_name(backend)),
                CStr::from_ptr(mori_tp_backend_name(backend)),
            )
        };
        assert_eq!(old, new);
    }
    // SAFETY: static strings, never NULL; the last error is this thread's, unchanged between.
    unsafe {
        assert_eq!(
            CStr::from_ptr(mori_version()),
            CStr::from_ptr(mori_tp_version())
        );
        assert_eq!(
            CStr::from_ptr(mori_last_error_message()),
            CStr::from_ptr(mori_tp_last_error_message())
        );
    }
    assert_eq!(mori_abi_version(), mori_tp_abi_version());
}
