//! The HIP engine's own code path on any machine: a recording runtime stands in for
//! libamdhip64, logs every call with its exact arguments, and performs each hipMemcpy2DAsync on
//! host memory with hipMemcpy2D's semantics. The byte-exact whole-transfer tests run through it,
//! and every recorded call is checked against the plan; failures are injected to check how HIP
//! errors and a missing device reach the caller.

mod common;

use std::cell::RefCell;
use std::ffi::c_void;
use std::ptr::{null_mut, without_provenance_mut};

use common::{
    MODELS, Request, Sender, SideBuffers, every_model_deployment, odd_deployments, transfer,
};
use mori_tp::backend::hip::{HIP_MEMCPY_DEFAULT, HipEngine, HipRuntime, HipStatus, Memcpy2dAsync};
use mori_tp::{
    Backend, CopyEngine, Error, KvBuffers, Plan, SendOptions, SendReport, SliceParams, send,
    slice_config,
};

/// `hipErrorInvalidMemcpyDirection` (hip/hip_runtime_api.h).
const INVALID_MEMCPY_DIRECTION: HipStatus = HipStatus(21);

/// One runtime call as the engine made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    DeviceCount,
    Memcpy2d(Memcpy2dAsync),
    Synchronize(*mut c_void),
}

/// A host memory range the replay may touch: (first address, length).
type Region = (usize, usize);

/// Records every call; replays copies on host memory, refusing what hipMemcpy2D refuses and any
/// row outside the registered buffers (where a GPU would fault), without copying anything.
#[derive(Debug)]
struct Recorder {
    calls: RefCell<Vec<Call>>,
    devices: Result<i32, HipStatus>,
    /// Fail the n-th hipMemcpy2DAsync (counting from 0) with this status, copying nothing.
    fail_copy: Option<(usize, HipStatus)>,
    sync_status: HipStatus,
    readable: Vec<Region>,
    writable: Vec<Region>,
}

impl Recorder {
    fn new(src: &[&[u8]], dst: &mut [&mut [u8]]) -> Self {
        Recorder {
            calls: RefCell::new(Vec::new()),
            devices: Ok(1),
            fail_copy: None,
            sync_status: HipStatus::SUCCESS,
            readable: src.iter().map(|b| (b.as_ptr() as usize, b.len())).collect(),
            writable: dst
                .iter_mut()
                .map(|b| (b.as_mut_ptr() as usize, b.len()))
                .collect(),
        }
    }

    fn copies(&self) -> usize {
        self.calls
            .borrow()
            .iter()
            .filter(|c| matches!(c, Call::Memcpy2d(_)))
            .count()
    }

    /// Every row `[start + r * pitch, + width)` lies inside one of `regions`.
    fn rows_inside(regions: &[Region], start: usize, pitch: usize, a: &Memcpy2dAsync) -> bool {
        (0..a.height).all(|r| {
            let row = start + r * pitch;
            regions
                .iter()
                .any(|&(base, len)| row >= base && row + a.width <= base + len)
        })
    }
}

impl HipRuntime for Recorder {
    fn device_count(&self) -> Result<i32, HipStatus> {
        self.calls.borrow_mut().push(Call::DeviceCount);
        self.devices
    }

    unsafe fn memcpy_2d_async(&self, a: Memcpy2dAsync) -> HipStatus {
        let index = self.copies();
        self.calls.borrow_mut().push(Call::Memcpy2d(a));
        if let Some((_, status)) = self.fail_copy.filter(|&(n, _)| n == index) {
            return status;
        }
        if a.kind != HIP_MEMCPY_DEFAULT && !(0..=3).contains(&a.kind) {
            return INVALID_MEMCPY_DIRECTION;
        }
        // hipMemcpy2D: non-NULL pointers, width at most each pitch (hipErrorInvalidValue stands
        // in for every refused argument).
        if a.dst.is_null() || a.src.is_null() || a.width > a.dpitch || a.width > a.spitch {
            return HipStatus::ERROR_INVALID_VALUE;
        }
        if !Self::rows_inside(&self.readable, a.src as usize, a.spitch, &a)
            || !Self::rows_inside(&self.writable, a.dst as usize, a.dpitch, &a)
        {
            return HipStatus::ERROR_INVALID_VALUE;
        }
        for r in 0..a.height {
            // SAFETY: every row was checked to lie inside a live buffer registered above.
            unsafe {
                std::ptr::copy(
                    a.src.cast::<u8>().add(r * a.spitch),
                    a.dst.cast::<u8>().add(r * a.dpitch),
                    a.width,
                )
            };
        }
        HipStatus::SUCCESS
    }

    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> HipStatus {
        self.calls.borrow_mut().push(Call::Synchronize(stream));
        self.sync_status
    }

    fn error_name(&self, status: HipStatus) -> String {
        // What hipGetErrorName answers for these codes; anything else is "hipErrorUnknown".
        match status.0 {
            0 => "hipSuccess",
            1 => "hipErrorInvalidValue",
            21 => "hipErrorInvalidMemcpyDirection",
            100 => "hipErrorNoDevice",
            101 => "hipErrorInvalidDevice",
            _ => "hipErrorUnknown",
        }
        .into()
    }
}

fn options(synchronize: bool, stream: *mut c_void) -> SendOptions {
    SendOptions {
        backend: Backend::Hip,
        synchronize,
        copy_kernel: false,
        stream,
    }
}

/// Sends `plan` through a HipEngine on `runtime`; returns the result and the recorded calls.
fn hip_send(
    plan: &Plan<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    runtime: Recorder,
    options: &SendOptions,
) -> (mori_tp::Result<SendReport>, Vec<Call>) {
    let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let buffers = KvBuffers {
        src: &src_ptrs,
        dst: &dst_ptrs,
        src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
        dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
    };
    let mut engine = HipEngine::new(runtime, options).expect("the recorder has a device");
    assert_eq!(engine.name(), "hip");
    // SAFETY: the pointers come from live slices at least as long as the capacities, and the
    // recorder refuses any row outside them.
    let result = unsafe { send(plan, &buffers, &mut engine) };
    let calls = engine.runtime().calls.borrow().clone();
    (result, calls)
}

/// The calls the contract prescribes: the device check, one hipMemcpy2DAsync per (buffer,
/// rect) in that order with the rect's own numbers, then hipStreamSynchronize only if asked.
fn expected_calls(
    plan: &Plan<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    options: &SendOptions,
) -> Vec<Call> {
    let mut calls = vec![Call::DeviceCount];
    if !plan.sends() {
        return calls;
    }
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        for rect in plan.rects() {
            calls.push(Call::Memcpy2d(Memcpy2dAsync {
                dst: d.as_mut_ptr().wrapping_add(rect.dst_offset as usize).cast(),
                dpitch: rect.dst_pitch as usize,
                src: s.as_ptr().wrapping_add(rect.src_offset as usize).cast(),
                spitch: rect.src_pitch as usize,
                width: rect.width as usize,
                height: rect.height as usize,
                kind: 4, // hipMemcpyDefault
                stream: options.stream,
            }));
        }
    }
    if options.synchronize {
        calls.push(Call::Synchronize(options.stream));
    }
    calls
}

/// A sender for the transfer tests: every send goes through the HIP engine, alternating the
/// flag and between the null stream and a caller's stream, and its calls must be exactly the
/// prescribed ones.
fn checked_hip_sender() -> Box<Sender<'static>> {
    let mut sends = 0usize;
    Box::new(move |plan, _, src, dst| {
        sends += 1;
        let stream = if sends % 3 == 0 {
            null_mut()
        } else {
            without_provenance_mut(0x5eed_0000 + sends * 0x100)
        };
        let options = options(sends % 2 == 0, stream);
        let expected = expected_calls(plan, src, dst, &options);
        let runtime = Recorder::new(src, dst);
        let (result, calls) = hip_send(plan, src, dst, runtime, &options);
        let report = result.expect("the recording runtime accepts every planned copy");
        assert_eq!(calls, expected, "HIP calls for {:?}", plan.config());
        Some(report)
    })
}

#[test]
fn every_model_tp_pair_page_size_and_dtype_lands_byte_exact_through_the_hip_engine() {
    let deployments = every_model_deployment(&mut *checked_hip_sender());
    assert_eq!(deployments, MODELS.len() * 2 * 2 * 25);
}

#[test]
fn non_integer_ratios_and_replication_land_byte_exact_through_the_hip_engine() {
    odd_deployments(&mut *checked_hip_sender());
}

#[test]
fn a_run_contiguous_on_both_sides_is_one_hip_copy_per_buffer() {
    let request = Request {
        src_pages: (10..20).collect(),
        dst_pages: (3..13).collect(),
        src_capacity_pages: 20,
        dst_capacity_pages: 13,
    };
    let outcome = transfer(4, 256, 4, 2, 8, 16, &request, &mut *checked_hip_sender());
    assert_eq!(
        outcome.copies,
        8 * 4,
        "one hipMemcpy2DAsync per buffer per decode rank"
    );
}

/// Llama-style pair (8 heads of 256 bytes, prefill TP 2 -> decode TP 4, ranks 1 -> 3) with a
/// request of three runs, over four buffers.
struct Fixture {
    src: SideBuffers,
    dst: SideBuffers,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            src: SideBuffers::identified(8, 2, 4, 256, 12, 4),
            dst: SideBuffers::sentinel(8, 4, 4, 256, 10, 4),
            src_pages: vec![0, 1, 5, 9, 10],
            dst_pages: vec![7, 8, 2, 0, 1],
        }
    }

    fn params(&self, prefill_rank: u32) -> SliceParams {
        SliceParams {
            prefill_tp_size: 2,
            prefill_tp_rank: prefill_rank,
            decode_tp_size: 4,
            decode_tp_rank: 3,
            total_kv_heads: 8,
            page_size: 4,
            src_item_len: self.src.item_len() as u64,
            dst_item_len: self.dst.item_len() as u64,
        }
    }

    /// Runs `runtime` (built on this fixture's buffers by `make`) for prefill rank `p`.
    fn run(
        &mut self,
        p: u32,
        options: &SendOptions,
        make: impl FnOnce(Recorder) -> Recorder,
    ) -> (mori_tp::Result<SendReport>, Vec<Call>) {
        let config = slice_config(&self.params(p)).unwrap();
        let plan = Plan::new(&config, &self.src_pages, &self.dst_pages).unwrap();
        let src: Vec<&[u8]> = self.src.ranks[p as usize]
            .iter()
            .map(Vec::as_slice)
            .collect();
        let mut dst: Vec<&mut [u8]> = self.dst.ranks[3]
            .iter_mut()
            .map(Vec::as_mut_slice)
            .collect();
        let runtime = make(Recorder::new(&src, &mut dst));
        hip_send(&plan, &src, &mut dst, runtime, options)
    }
}

fn gpu_message(result: mori_tp::Result<SendReport>) -> String {
    match result {
        Err(Error::Gpu { message, .. }) => message,
        other => panic!("expected Error::Gpu, got {other:?}"),
    }
}

#[test]
fn a_failing_copy_is_a_gpu_error_naming_the_hip_error_the_buffer_and_the_rect() {
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    let stream = without_provenance_mut(0xabc000);
    // Three rects per buffer: the sixth copy is buffer 1, rect 2.
    let (result, calls) = f.run(1, &options(false, stream), |mut r| {
        r.fail_copy = Some((5, HipStatus::ERROR_INVALID_VALUE));
        r
    });
    let message = gpu_message(result);
    for part in [
        "hipMemcpy2DAsync(",
        "returned hipErrorInvalidValue (1)",
        "buffer 1 of 4, rect 2 of 3",
        "width 512, height 8",
        "stream 0xabc000",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert_eq!(
        calls.len(),
        1 + 6,
        "the device check, then copies up to the failing one"
    );
    assert!(
        !calls.contains(&Call::Synchronize(stream)),
        "no flag, no wait"
    );
    // What was issued before the failure landed; later buffers were never touched.
    assert_ne!(f.dst.ranks[3][0], initial[0]);
    assert_eq!(f.dst.ranks[3][2..], initial[2..]);
}

#[test]
fn a_failing_copy_with_synchronize_still_waits_for_the_copies_already_issued() {
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0xabc000);
    let (result, calls) = f.run(1, &options(true, stream), |mut r| {
        r.fail_copy = Some((1, HipStatus(709)));
        r
    });
    let message = gpu_message(result);
    assert!(
        message.contains("hipErrorUnknown (709)") && message.contains("buffer 0 of 4, rect 1 of 3"),
        "{message:?}"
    );
    assert_eq!(calls.len(), 1 + 2 + 1);
    assert_eq!(calls.last(), Some(&Call::Synchronize(stream)));
}

#[test]
fn an_unknown_status_from_a_newer_runtime_keeps_its_number() {
    let mut f = Fixture::new();
    let (result, _) = f.run(1, &options(false, null_mut()), |mut r| {
        r.fail_copy = Some((0, HipStatus(123_456)));
        r
    });
    let message = gpu_message(result);
    assert!(
        message.contains("returned hipErrorUnknown (123456)"),
        "{message:?}"
    );
}

#[test]
fn a_failing_synchronize_is_a_gpu_error_after_every_copy_was_issued() {
    let mut f = Fixture::new();
    let (result, calls) = f.run(1, &options(true, null_mut()), |mut r| {
        r.sync_status = HipStatus(719); // hipErrorLaunchFailure
        r
    });
    let message = gpu_message(result);
    assert!(
        message.contains("hipStreamSynchronize(stream 0x0) returned hipErrorUnknown (719)"),
        "{message:?}"
    );
    assert_eq!(
        calls.len(),
        1 + 12 + 1,
        "4 buffers x 3 rects, then the wait"
    );
}

#[test]
fn a_refused_request_issues_no_hip_call() {
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    f.dst_pages[4] = 10; // one page past the 10-page destination buffers
    let (result, calls) = f.run(1, &options(true, null_mut()), |r| r);
    assert!(
        matches!(
            &result,
            Err(Error::PagePastCapacity {
                page: 10,
                position: 4,
                ..
            })
        ),
        "{result:?}"
    );
    assert_eq!(calls, vec![Call::DeviceCount]);
    assert_eq!(f.dst.ranks[3], initial);
}

#[test]
fn a_pair_that_does_not_send_issues_no_hip_call_even_with_synchronize() {
    let mut f = Fixture::new();
    // Decode rank 3 owns heads 6 and 7, which prefill rank 0 does not hold.
    let (result, calls) = f.run(0, &options(true, null_mut()), |r| r);
    assert_eq!(result, Ok(SendReport::default()));
    assert_eq!(calls, vec![Call::DeviceCount]);
}

#[test]
fn no_device_is_backend_unavailable_naming_what_the_runtime_said() {
    let runtime = |devices| Recorder {
        devices,
        ..Recorder::new(&[], &mut [])
    };
    let opts = options(false, null_mut());
    for (devices, says) in [
        (
            Err(HipStatus::ERROR_NO_DEVICE),
            "hipGetDeviceCount returned hipErrorNoDevice (100)",
        ),
        (Ok(0), "hipGetDeviceCount reports 0"),
    ] {
        match HipEngine::new(runtime(devices), &opts) {
            Err(Error::BackendUnavailable { reason: message }) => {
                assert!(message.contains(says), "{message:?} lacks {says:?}");
                assert!(message.contains("needs a HIP device"), "{message:?}");
            }
            other => panic!("{devices:?}: expected BackendUnavailable, got {other:?}"),
        }
    }
}

#[test]
fn the_recording_runtime_refuses_what_hipmemcpy2d_refuses() {
    let (src, mut dst) = (vec![1u8; 64], vec![0u8; 64]);
    let recorder = Recorder::new(&[&src], &mut [&mut dst]);
    let good = Memcpy2dAsync {
        dst: dst.as_mut_ptr().cast(),
        dpitch: 16,
        src: src.as_ptr().cast(),
        spitch: 16,
        width: 8,
        height: 4,
        kind: HIP_MEMCPY_DEFAULT,
        stream: null_mut(),
    };
    let refused = [
        Memcpy2dAsync { width: 17, ..good },
        Memcpy2dAsync { spitch: 4, ..good },
        Memcpy2dAsync { height: 5, ..good },
        Memcpy2dAsync {
            dst: null_mut(),
            ..good
        },
    ];
    for args in refused {
        // SAFETY: the recorder checks every row against the registered buffers.
        let status = unsafe { recorder.memcpy_2d_async(args) };
        assert_eq!(status, HipStatus::ERROR_INVALID_VALUE, "{args:?}");
    }
    // SAFETY: as above.
    let status = unsafe { recorder.memcpy_2d_async(Memcpy2dAsync { kind: 9, ..good }) };
    assert_eq!(status, INVALID_MEMCPY_DIRECTION);
    assert!(dst.iter().all(|&b| b == 0), "a refused call copies nothing");
    // SAFETY: as above.
    assert_eq!(
        unsafe { recorder.memcpy_2d_async(good) },
        HipStatus::SUCCESS
    );
    let rows: Vec<u8> = (0..64).map(|i| u8::from(i % 16 < 8)).collect();
    assert_eq!(dst, rows, "rows of width 8 at pitch 16");
}
