//! The HIP engine's own code path on any machine: a recording runtime (`recorder`) stands in for
//! libamdhip64, logs every call with its exact arguments, and performs each call on host memory
//! as strictly as a GPU would. The byte-exact whole-transfer tests run through it on both paths,
//! every recorded call is checked against the plan, and failures are injected to check how HIP
//! errors, a missing device, a second GPU, graph capture, a refusing allocator, memory the kernel
//! cannot reach and a device reset reach the caller.
//!
//! The copy-kernel path runs the kernel's own source (hip/copy_kernel.hip), compiled for the CPU
//! through hip/cpu_shim.hpp with `c++ -shared` when the tests start and loaded with dlopen. Those
//! tests need a C++ compiler; without one they say so and skip, unless MORI_TP_REQUIRE_TOOLS=1
//! (CI), which makes a missing compiler a failure.
//!
//! The engine's runtime trait and the internals these tests drive come from
//! `mori_tp::gpu_runtime`, a hidden module outside the API; tests/common holds the helpers
//! shared with the other integration tests.

mod common;
#[path = "gpu_engine/recorder.rs"]
mod recorder;
#[path = "gpu_engine/table.rs"]
mod table;

use std::collections::HashSet;
use std::ffi::c_void;
use std::ptr::{null_mut, without_provenance_mut};
use std::rc::Rc;

use common::{
    MODELS, Request, Sender, SideBuffers, every_model_deployment, odd_deployments, transfer,
};
use mori_tp::gpu_runtime::{
    CaptureMode, DeviceMemory, GpuEngine, GpuRuntime, GpuStatus, HIP_MEMCPY_DEFAULT, KernelLaunch,
    KernelTable, MAX_LANES, MAX_TABLE_SLOTS, MIN_TABLE_BYTES, Memcpy2dAsync, POOL_TAIL_BYTES,
    RESET_SENTINEL_BYTES, WIDE_INLINE_TABLE_BYTES,
};
use mori_tp::pool::{PoolMemory, PoolMemoryKind, StagingPool};
use mori_tp::{
    Backend, CopyEngine, CopyPath, Error, KvBuffers, SendOptions, SendReport, SliceConfig,
    SliceParams, SlicePlan, Walk, pack, pack_host, send, slice_config, unpack, unpack_host,
};
use recorder::{
    Call, ILLEGAL_ADDRESS, INVALID_MEMCPY_DIRECTION, INVALID_RESOURCE_HANDLE, Recorder, TEST_IMAGE,
    TEST_WIDE_IMAGE, cpu_kernel_or_skip, function_handle, module_handle, names,
};

/// `MORI_SEND_MEMCPY2D`: one hipMemcpy2DAsync per (buffer, rect).
fn options(synchronize: bool, stream: *mut c_void) -> SendOptions {
    SendOptions {
        backend: Backend::Hip,
        synchronize,
        path: CopyPath::Memcpy2d,
        max_blocks: 0,
        stream,
    }
}

/// `MORI_SEND_COPY_KERNEL`.
fn kernel_options(synchronize: bool, stream: *mut c_void) -> SendOptions {
    SendOptions {
        path: CopyPath::Kernel,
        ..options(synchronize, stream)
    }
}

/// Flags 0: the engine's choice.
fn auto_options(synchronize: bool, stream: *mut c_void) -> SendOptions {
    SendOptions {
        path: CopyPath::Auto,
        ..options(synchronize, stream)
    }
}

/// The calls that put the thread into the relaxed capture mode and give it its mode back.
const RELAXED: Call = Call::ExchangeCaptureMode(CaptureMode::RELAXED);
const RESTORED: Call = Call::ExchangeCaptureMode(CaptureMode::GLOBAL);

/// Sends `plan` through a GpuEngine on `runtime`; returns the result and the recorded calls.
fn hip_send(
    plan: &Walk<'_>,
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
    let mut engine = GpuEngine::new(runtime, options).expect("the recorder has a device");
    assert_eq!(engine.name(), "hip");
    // SAFETY: the pointers come from live slices at least as long as the capacities, and the
    // recorder refuses any row outside them.
    let result = unsafe { send(plan, &buffers, &mut engine) };
    let calls = engine.runtime().calls.borrow().clone();
    (result, calls)
}

/// The calls the header documents: the device check, the relaxed capture mode, with synchronize
/// on a caller's stream the capture check, one hipMemcpy2DAsync per (buffer, rect) in that order
/// with the rect's own numbers, hipStreamSynchronize only if asked, and the thread's mode back.
fn expected_calls(
    plan: &Walk<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    options: &SendOptions,
) -> Vec<Call> {
    let src: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let dst: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
    expected_rect_calls(plan, &src, &dst, options)
}

/// [`expected_calls`] for buffers at these bases (a staging region's are inside one slice).
fn expected_rect_calls(
    plan: &Walk<'_>,
    src: &[*const u8],
    dst: &[*mut u8],
    options: &SendOptions,
) -> Vec<Call> {
    let mut calls = vec![Call::DeviceCount];
    if !plan.sends() {
        return calls;
    }
    calls.push(RELAXED);
    if options.synchronize && !options.stream.is_null() {
        calls.push(Call::IsCapturing(options.stream));
    }
    for (&s, &d) in src.iter().zip(dst) {
        for rect in plan.rects() {
            calls.push(Call::Memcpy2d(Memcpy2dAsync {
                dst: d.wrapping_add(rect.dst_offset as usize).cast(),
                dpitch: rect.dst_pitch as usize,
                src: s.wrapping_add(rect.src_offset as usize).cast(),
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
    calls.push(RESTORED);
    calls
}

/// The stream of the `sends`-th send of a checked sender: the null stream every third send, a
/// caller's (fake, distinct) stream otherwise, so both kinds reach the runtime.
fn stream_for_send(sends: usize) -> *mut c_void {
    if sends % 3 == 0 {
        null_mut()
    } else {
        without_provenance_mut(0x5eed_0000 + sends * 0x100)
    }
}

/// A sender for the transfer tests: every send goes through the HIP engine, alternating the
/// flag and between the null stream and a caller's stream, and its calls must be exactly the
/// prescribed ones.
fn checked_hip_sender() -> Box<Sender<'static>> {
    let mut sends = 0usize;
    Box::new(move |plan, _, src, dst| {
        sends += 1;
        let stream = stream_for_send(sends);
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
/// request of three runs, over four buffers: a table that travels inside the kernel's argument.
/// [`Fixture::uploaded`] has one whose table must be uploaded.
struct Fixture {
    src: SideBuffers,
    dst: SideBuffers,
    src_pages: Vec<i32>,
    dst_pages: Vec<i32>,
    page_size: u32,
}

/// Pages of [`Fixture::uploaded`]'s request: each its own rect.
const UPLOADED_PAGES: usize = 550;

impl Fixture {
    fn new() -> Self {
        Fixture {
            src: SideBuffers::identified(8, 2, 4, 256, 12, 4),
            dst: SideBuffers::sentinel(8, 4, 4, 256, 10, 4),
            src_pages: vec![0, 1, 5, 9, 10],
            dst_pages: vec![7, 8, 2, 0, 1],
            page_size: 4,
        }
    }

    /// The same pair with one-token pages and a request of [`UPLOADED_PAGES`] pages none of
    /// which is next to another on either side: 550 rects, whose table (more than
    /// `INLINE_TABLE_BYTES`) is uploaded into a table buffer pair before the launch.
    fn uploaded() -> Self {
        let capacity = 2 * UPLOADED_PAGES;
        let f = Fixture {
            src: SideBuffers::identified(8, 2, 1, 256, capacity, 4),
            dst: SideBuffers::sentinel(8, 4, 1, 256, capacity, 4),
            src_pages: (0..UPLOADED_PAGES as i32).map(|p| 2 * p).collect(),
            dst_pages: (0..UPLOADED_PAGES as i32)
                .map(|p| capacity as i32 - 1 - 2 * p)
                .collect(),
            page_size: 1,
        };
        let config = slice_config(&f.params(1)).unwrap();
        let plan = SlicePlan::new(&config, &f.src_pages, &f.dst_pages).unwrap();
        let bases = [(0x1000u64, 0x2000u64); 4];
        let table = KernelTable::build(plan.rects(), &bases).expect("a table");
        assert!(!table.is_inline(), "the fixture's table is uploaded");
        f
    }

    fn params(&self, prefill_rank: u32) -> SliceParams {
        SliceParams {
            prefill_tp_size: 2,
            prefill_tp_rank: prefill_rank,
            decode_tp_size: 4,
            decode_tp_rank: 3,
            total_kv_heads: 8,
            page_size: self.page_size,
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
        let plan = SlicePlan::new(&config, &self.src_pages, &self.dst_pages).unwrap();
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
        r.fail_copy = Some((5, GpuStatus::ERROR_INVALID_VALUE));
        r
    });
    assert!(
        matches!(
            result,
            Err(Error::Gpu {
                call: "hipMemcpy2DAsync",
                status: 1,
                buffer: Some(1),
                rect: Some(2),
                ..
            })
        ),
        "the buffer and rect are fields of the error: {result:?}"
    );
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
        1 + 1 + 6 + 1,
        "the device check, the relaxed mode, the copies up to the failing one, the mode back"
    );
    assert_eq!((calls[1], calls[8]), (RELAXED, RESTORED));
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
        r.fail_copy = Some((1, GpuStatus(709)));
        r
    });
    assert!(
        matches!(
            result,
            Err(Error::Gpu {
                buffer: Some(0),
                rect: Some(1),
                ..
            })
        ),
        "waiting afterwards keeps the buffer and rect: {result:?}"
    );
    let message = gpu_message(result);
    assert!(
        message.contains("hipErrorUnknown (709)") && message.contains("buffer 0 of 4, rect 1 of 3"),
        "{message:?}"
    );
    // The device check, the relaxed mode, the capture check, two copies, the wait, the mode.
    assert_eq!(calls.len(), 1 + 1 + 1 + 2 + 1 + 1);
    assert_eq!(calls[2], Call::IsCapturing(stream));
    assert_eq!(calls[5..], [Call::Synchronize(stream), RESTORED]);
}

#[test]
fn an_unknown_status_from_a_newer_runtime_keeps_its_number() {
    let mut f = Fixture::new();
    let (result, _) = f.run(1, &options(false, null_mut()), |mut r| {
        r.fail_copy = Some((0, GpuStatus(123_456)));
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
        r.sync_status = GpuStatus(719); // hipErrorLaunchFailure
        r
    });
    let message = gpu_message(result);
    assert!(
        message.contains("hipStreamSynchronize(stream 0x0) returned hipErrorUnknown (719)"),
        "{message:?}"
    );
    assert_eq!(
        calls.len(),
        1 + 1 + 12 + 1 + 1,
        "4 buffers x 3 rects, then the wait, in the relaxed mode"
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
            Err(GpuStatus::ERROR_NO_DEVICE),
            "hipGetDeviceCount returned hipErrorNoDevice (100)",
        ),
        (Ok(0), "hipGetDeviceCount reports 0"),
    ] {
        match GpuEngine::new(runtime(devices), &opts) {
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
        assert_eq!(status, Err(GpuStatus::ERROR_INVALID_VALUE), "{args:?}");
    }
    // SAFETY: as above.
    let status = unsafe { recorder.memcpy_2d_async(Memcpy2dAsync { kind: 9, ..good }) };
    assert_eq!(status, Err(INVALID_MEMCPY_DIRECTION));
    assert!(dst.iter().all(|&b| b == 0), "a refused call copies nothing");
    // SAFETY: as above.
    assert_eq!(unsafe { recorder.memcpy_2d_async(good) }, Ok(()));
    let rows: Vec<u8> = (0..64).map(|i| u8::from(i % 16 < 8)).collect();
    assert_eq!(dst, rows, "rows of width 8 at pitch 16");
}

// ---- The copy-kernel path ----

/// What the recorder handed out in `calls`: the reset sentinel, the first table buffer and its
/// pinned twin, the first lane's event and relay stream, and the first pair's event.
#[derive(Clone, Copy, Debug, Default)]
struct Handed {
    sentinel: usize,
    table: usize,
    host: usize,
    mark: usize,
    relay: usize,
    done: usize,
}

fn handed(calls: &[Call]) -> Handed {
    let mut handed = Handed::default();
    for call in calls {
        match *call {
            Call::Malloc { size, returned } if size == RESET_SENTINEL_BYTES => {
                handed.sentinel = returned;
            }
            Call::Malloc { returned, .. } if handed.table == 0 => handed.table = returned,
            Call::HostMalloc { returned, .. } if handed.host == 0 => handed.host = returned,
            Call::StreamCreate { returned } if handed.relay == 0 => handed.relay = returned,
            Call::EventCreate { returned } if handed.mark == 0 => handed.mark = returned,
            Call::EventCreate { returned } if handed.done == 0 => handed.done = returned,
            _ => {}
        }
    }
    handed
}

/// The fence of a kernel call on `stream`: the lane's event recorded there, the relay waiting for
/// it, the pair's event recorded on the relay.
fn fence_calls(stream: *mut c_void, mark: usize, relay: usize, done: usize) -> [Call; 3] {
    [
        Call::EventRecord {
            event: without_provenance_mut(mark),
            stream,
        },
        Call::StreamWaitEvent {
            stream: without_provenance_mut(relay),
            event: without_provenance_mut(mark),
        },
        Call::EventRecord {
            event: without_provenance_mut(done),
            stream: without_provenance_mut(relay),
        },
    ]
}

/// The calls a kernel send on a fresh runtime must make: the device check; the relaxed capture
/// mode; for a caller's stream the capture check; hipGetDevice (and the stream's device); the
/// load on that device and its reset sentinel (its size read back); each buffer base checked
/// once; then, for a table inside the kernel's argument, the launch alone; for an uploaded one,
/// the stream's lane (an event and a relay stream), the first table buffer pair and its event,
/// on the stream one upload of the table's `byte_len` bytes from the pinned buffer and one
/// launch with the table's argument and grid, and the fence; hipStreamSynchronize only if
/// asked; the thread's capture mode back.
fn expected_kernel_calls(
    plan: &Walk<'_>,
    src: &[*const u8],
    dst: &[*mut u8],
    options: &SendOptions,
    handed: Handed,
) -> Vec<Call> {
    let mut calls = vec![Call::DeviceCount];
    let rects: Vec<_> = plan.rects().collect();
    if !plan.sends() || rects.is_empty() || src.is_empty() {
        return calls;
    }
    calls.push(RELAXED);
    let stream = options.stream;
    if !stream.is_null() {
        calls.push(Call::IsCapturing(stream));
    }
    calls.push(Call::GetDevice);
    if !stream.is_null() {
        calls.push(Call::StreamGetDevice(stream));
    }
    calls.push(Call::ModuleLoad {
        bytes: TEST_IMAGE.bytes.len(),
    });
    calls.push(Call::GetFunction {
        module: module_handle(0),
    });
    calls.push(Call::Malloc {
        size: RESET_SENTINEL_BYTES,
        returned: handed.sentinel,
    });
    calls.push(Call::AddressRange {
        pointer: without_provenance_mut(handed.sentinel),
    });
    let mut seen = HashSet::new();
    for (&s, &d) in src.iter().zip(dst) {
        for base in [s as usize, d as usize] {
            if seen.insert(base) {
                calls.push(Call::PointerInfo {
                    pointer: without_provenance_mut::<c_void>(base),
                });
            }
        }
    }
    // The table the engine must launch with (src/backend/copy_kernel.rs checks its bytes
    // against the C++ builder and the kernel): inside the argument when it fits, else uploaded
    // (byte_len bytes).
    let bases: Vec<(u64, u64)> = src
        .iter()
        .zip(dst)
        .map(|(&s, &d)| (s as u64, d as u64))
        .collect();
    let table = KernelTable::build(rects.iter().copied(), &bases).expect("a table");
    if table.is_inline() {
        calls.push(Call::Launch(KernelLaunch {
            function: function_handle(0),
            grid: table.grid(),
            block: 256,
            stream,
            args: table.args(0),
        }));
        if options.synchronize {
            calls.push(Call::Synchronize(stream));
        }
        calls.push(RESTORED);
        return calls;
    }
    calls.push(Call::EventCreate {
        returned: handed.mark,
    });
    calls.push(Call::StreamCreate {
        returned: handed.relay,
    });
    calls.push(Call::EventCreate {
        returned: handed.done,
    });
    let size = table.byte_len();
    let capacity = size.max(MIN_TABLE_BYTES).next_power_of_two();
    calls.push(Call::Malloc {
        size: capacity,
        returned: handed.table,
    });
    calls.push(Call::HostMalloc {
        size: capacity,
        returned: handed.host,
    });
    calls.push(Call::MemcpyHostToDevice {
        dst: without_provenance_mut(handed.table),
        src: without_provenance_mut::<c_void>(handed.host),
        size,
        stream,
    });
    calls.push(Call::Launch(KernelLaunch {
        function: function_handle(0),
        grid: table.grid(),
        block: 256,
        stream,
        args: table.args(handed.table as u64),
    }));
    calls.extend(fence_calls(stream, handed.mark, handed.relay, handed.done));
    if options.synchronize {
        calls.push(Call::Synchronize(stream));
    }
    calls.push(RESTORED);
    calls
}

/// Runs `job` (a send, pack or unpack, given the engine) through a kernel engine on `runtime`;
/// returns the result and the recorded calls. Whatever happened, the runtime holds no more
/// device or pinned memory than the kernel state's table buffers.
fn kernel_run(
    runtime: Recorder,
    options: &SendOptions,
    job: impl FnOnce(&mut GpuEngine<Recorder>) -> mori_tp::Result<SendReport>,
) -> (mori_tp::Result<SendReport>, Vec<Call>) {
    let mut engine = GpuEngine::new(runtime, options).expect("the recorder has a device");
    let result = job(&mut engine);
    let runtime = engine.runtime();
    let (device, host) = runtime.live_allocations();
    assert!(
        device <= MAX_TABLE_SLOTS + 1 && host <= MAX_TABLE_SLOTS,
        "{device} device and {host} pinned allocations: only the table buffers and the reset \
         sentinel stay"
    );
    let calls = runtime.calls.borrow().clone();
    (result, calls)
}

/// A sender for the transfer tests through the copy kernel: alternating the flag and streams as
/// the per-rect sender does, and checking every call.
fn checked_kernel_sender() -> Box<Sender<'static>> {
    let mut sends = 0usize;
    Box::new(move |plan, _, src, dst| {
        sends += 1;
        let stream = stream_for_send(sends);
        let options = kernel_options(sends % 2 == 0, stream);
        let runtime = Recorder::new(src, dst);
        let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
        let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let buffers = KvBuffers {
            src: &src_ptrs,
            dst: &dst_ptrs,
            src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
        };
        // SAFETY: live slices at least as long as the capacities; the recorder checks every row
        // the kernel would touch before running it.
        let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
            send(plan, &buffers, engine)
        });
        let report = result.expect("the recording runtime accepts the kernel launch");
        let expected = expected_kernel_calls(plan, &src_ptrs, &dst_ptrs, &options, handed(&calls));
        assert_eq!(calls, expected, "HIP calls for {:?}", plan.config());
        Some(report)
    })
}

/// A sender through flags 0 (the engine's choice): calls with at least two (buffer, rect) copies
/// must make exactly a kernel call's calls, the others exactly the per-rect copies'.
fn checked_auto_sender(kernel_calls: Rc<std::cell::Cell<(usize, usize)>>) -> Box<Sender<'static>> {
    let mut sends = 0usize;
    Box::new(move |plan, _, src, dst| {
        sends += 1;
        let stream = stream_for_send(sends);
        let options = auto_options(sends % 2 == 0, stream);
        let runtime = Recorder::new(src, dst);
        let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
        let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let buffers = KvBuffers {
            src: &src_ptrs,
            dst: &dst_ptrs,
            src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
        };
        // SAFETY: live slices at least as long as the capacities; the recorder checks every row
        // either path touches.
        let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
            send(plan, &buffers, engine)
        });
        let report = result.expect("the recording runtime accepts the call");
        let copies = src.len() * plan.rects().count();
        let expected = if copies >= mori_tp::AUTO_KERNEL_MIN_COPIES {
            expected_kernel_calls(plan, &src_ptrs, &dst_ptrs, &options, handed(&calls))
        } else {
            expected_rect_calls(plan, &src_ptrs, &dst_ptrs, &options)
        };
        assert_eq!(calls, expected, "HIP calls for {:?}", plan.config());
        if plan.sends() && copies > 0 {
            let (kernel, rects) = kernel_calls.get();
            kernel_calls.set(if copies >= 2 {
                (kernel + 1, rects)
            } else {
                (kernel, rects + 1)
            });
        }
        Some(report)
    })
}

/// Issue 31.2: with flags 0 a call of at least two (buffer, rect) copies is one kernel launch
/// (one upload, one launch), a call of one copy is one hipMemcpy2DAsync; both land byte for
/// byte.
#[test]
fn flags_0_launch_the_kernel_for_two_copies_or_more_and_copy_a_single_rect_directly() {
    if cpu_kernel_or_skip("flags_0_launch_the_kernel_...").is_none() {
        return;
    }
    let counts = Rc::new(std::cell::Cell::new((0, 0)));
    odd_deployments(&mut *checked_auto_sender(Rc::clone(&counts)));
    // One run of pages, one buffer: one rect, one copy.
    let request = Request {
        src_pages: (2..6).collect(),
        dst_pages: (0..4).collect(),
        src_capacity_pages: 6,
        dst_capacity_pages: 4,
    };
    transfer(
        4,
        256,
        1,
        2,
        2,
        16,
        &request,
        &mut *checked_auto_sender(Rc::clone(&counts)),
    );
    let (kernel, per_rect) = counts.get();
    assert!(
        kernel > 0 && per_rect > 0,
        "both paths ran: {kernel}, {per_rect}"
    );
}

/// Issue 31.2: flags 0 fall back to the per-rect copies, without an error, wherever the kernel
/// cannot surely run: memory it may not reach (pageable host memory, host memory registered and
/// passed at its host address, another device's memory, which needs peer access the library
/// cannot see), a device without a code object, and (HIP 5.2) a stream of another device. With
/// MORI_SEND_COPY_KERNEL each of these is an error, except another device's memory that this one
/// can reach, which is launched.
#[test]
fn flags_0_take_the_per_rect_copies_where_the_kernel_cannot_surely_run() {
    if cpu_kernel_or_skip("flags_0_take_the_per_rect_copies_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    type Adjust = fn(Recorder) -> Recorder;
    let cases: [(&str, Adjust, bool, Option<&str>); 6] = [
        (
            "pageable",
            |mut r| {
                r.device_memory.pop();
                r
            },
            false,
            Some("hipPointerGetAttributes"),
        ),
        (
            "registered at its host address",
            |mut r| {
                let (base, len) = r.device_memory.pop().unwrap();
                r.registered.push(((base, len), 0x7000_0000_0000));
                r
            },
            false,
            Some("hipPointerGetAttributes"),
        ),
        (
            "a peer's memory it can reach",
            |r| {
                r.stream_home.set(1);
                Recorder {
                    devices: Ok(2),
                    ..r
                }
            },
            false,
            None,
        ),
        (
            "a peer's memory it cannot reach",
            |r| {
                r.stream_home.set(1);
                r.peer_access.set(false);
                Recorder {
                    devices: Ok(2),
                    ..r
                }
            },
            false,
            Some("hipPointerGetAttributes"),
        ),
        (
            "no code object",
            |r| {
                r.fail_call.set(Some(("hipModuleLoadData", GpuStatus(209))));
                r
            },
            false,
            Some("hipModuleLoadData"),
        ),
        (
            "HIP 5.2, a stream of another device",
            |r| Recorder {
                has_stream_get_device: false,
                ..stream_on_device_1(r)
            },
            true,
            Some("hipEventRecord"),
        ),
    ];
    for (case, adjust, on_a_stream, kernel_error) in cases {
        let stream = if on_a_stream {
            without_provenance_mut(0xde73_0000)
        } else {
            null_mut()
        };
        let mut f = Fixture::new();
        let (result, calls) = kernel_fixture_run(&mut f, &auto_options(true, stream), adjust);
        assert_eq!(result.map(|r| r.copies), Ok(12), "{case}");
        let n = names(&calls);
        assert!(!n.contains(&"hipModuleLaunchKernel"), "{case}: {n:?}");
        assert_eq!(
            n.iter().filter(|c| **c == "hipMemcpy2DAsync").count(),
            12,
            "{case}: {n:?}"
        );
        assert_eq!(f.dst.ranks[3], want, "{case}");

        let mut f = Fixture::new();
        let initial = f.dst.ranks[3].clone();
        let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(true, stream), adjust);
        match kernel_error {
            Some(call) => {
                let (failed, _, message, _) = gpu_error(result);
                assert_eq!(failed, call, "{case}: {message}");
                assert_eq!(f.dst.ranks[3], initial, "{case}: nothing written");
                if case.starts_with("a peer") {
                    assert!(
                        message.contains(
                            "memory of device 1, which a kernel on device 0 cannot reach"
                        ),
                        "{message}"
                    );
                }
            }
            None => {
                assert!(result.is_ok(), "{case}: {result:?}");
                assert!(names(&calls).contains(&"hipModuleLaunchKernel"), "{case}");
                assert!(
                    calls.contains(&Call::CanAccessPeer { device: 0, peer: 1 }),
                    "{case}: {calls:?}"
                );
                assert_eq!(f.dst.ranks[3], want, "{case}");
            }
        }
    }
}

/// Issue 31.2: MORI_SEND_MEMCPY2D is one hipMemcpy2DAsync per (buffer, rect) even where flags 0
/// would launch the kernel.
#[test]
fn memcpy2d_is_one_copy_per_buffer_and_rect() {
    let mut f = Fixture::new();
    let (result, calls) = f.run(1, &options(false, null_mut()), |r| r);
    assert_eq!(result.map(|r| r.copies), Ok(12));
    let n = names(&calls);
    assert_eq!(n.iter().filter(|c| **c == "hipMemcpy2DAsync").count(), 12);
    assert!(!n.contains(&"hipModuleLaunchKernel") && !n.contains(&"hipModuleLoadData"));
}

#[test]
fn every_model_tp_pair_page_size_and_dtype_lands_byte_exact_through_one_kernel_launch() {
    if cpu_kernel_or_skip("every_model_..._through_one_kernel_launch").is_none() {
        return;
    }
    let deployments = every_model_deployment(&mut *checked_kernel_sender());
    assert_eq!(deployments, MODELS.len() * 2 * 2 * 25);
}

#[test]
fn non_integer_ratios_and_replication_land_byte_exact_through_one_kernel_launch() {
    if cpu_kernel_or_skip("non_integer_ratios_..._through_one_kernel_launch").is_none() {
        return;
    }
    odd_deployments(&mut *checked_kernel_sender());
}

#[test]
fn odd_widths_and_unaligned_buffers_land_byte_exact_through_one_kernel_launch() {
    if cpu_kernel_or_skip("odd_widths_..._through_one_kernel_launch").is_none() {
        return;
    }
    // Heads of 1, 3, 6 and 72 bytes: byte, 2-byte-aligned and 8-byte paths of the kernel.
    for (heads, bytes_per_head, p_tp, d_tp) in
        [(4, 1, 2, 8), (8, 3, 4, 8), (4, 6, 4, 2), (12, 72, 6, 4)]
    {
        let request = common::fragmented_request(u64::from(heads * 31 + bytes_per_head), 6);
        for page_size in [1, 16] {
            transfer(
                heads,
                bytes_per_head as usize,
                3,
                p_tp,
                d_tp,
                page_size,
                &request,
                &mut *checked_kernel_sender(),
            );
        }
    }
}

/// Pack, then unpack, through the kernel, each against the host engine's bytes, for layouts
/// whose slice is narrower than the token slot on one side or both.
#[test]
fn pack_and_unpack_through_one_kernel_launch_match_the_host_engine() {
    if cpu_kernel_or_skip("pack_and_unpack_through_one_kernel_launch").is_none() {
        return;
    }
    for (heads, bytes_per_head, p_tp, d_tp, page_size) in [
        (4, 256, 2, 8, 16),
        (8, 128, 8, 2, 1),
        (12, 72, 6, 4, 4),
        (1, 1152, 8, 4, 16),
    ] {
        let request = common::fragmented_request(u64::from(heads * 7 + p_tp), 5);
        let src = SideBuffers::identified(
            heads,
            p_tp,
            page_size,
            bytes_per_head,
            request.src_capacity_pages,
            4,
        );
        let dst = SideBuffers::sentinel(
            heads,
            d_tp,
            page_size,
            bytes_per_head,
            request.dst_capacity_pages,
            4,
        );
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
                    dst_item_len: dst.item_len() as u64,
                })
                .unwrap();
                pack_unpack_pair(
                    &config,
                    &src.ranks[p as usize],
                    &dst.ranks[d as usize],
                    &request,
                );
            }
        }
    }
}

/// One pair's pack and unpack through the kernel and through the host engine.
fn pack_unpack_pair(config: &SliceConfig, src: &[Vec<u8>], dst: &[Vec<u8>], request: &Request) {
    let staging_len = mori_tp::staging_len(config, request.src_pages.len()).unwrap() as usize;
    let src_slices: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
    // Host: the reference bytes.
    let mut host_staging = vec![0x5au8; staging_len * src.len()];
    pack_host(config, &src_slices, &request.src_pages, &mut host_staging).unwrap();
    let mut host_dst = dst.to_vec();
    let mut host_dst_slices: Vec<&mut [u8]> = host_dst.iter_mut().map(Vec::as_mut_slice).collect();
    unpack_host(
        config,
        &host_staging,
        &mut host_dst_slices,
        &request.dst_pages,
    )
    .unwrap();

    // Kernel: pack.
    let mut staging = vec![0x5au8; host_staging.len()];
    let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let capacity = src.iter().map(Vec::len).min().unwrap() as u64;
    let stream = without_provenance_mut(0x57a6_0000);
    let options = kernel_options(true, stream);
    let runtime = Recorder::new(&src_slices, &mut [staging.as_mut_slice()]);
    let staging_ptr = staging.as_mut_ptr();
    let staging_capacity = staging.len() as u64;
    // SAFETY: live buffers of the stated capacities; the recorder checks every kernel row.
    let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
        pack(
            config,
            &src_ptrs,
            capacity,
            &request.src_pages,
            staging_ptr,
            staging_capacity,
            engine,
        )
    });
    result.expect("kernel pack");
    assert_eq!(staging, host_staging, "packed bytes of {config:?}");
    let launches = calls
        .iter()
        .filter(|c| matches!(c, Call::Launch(_)))
        .count();
    let uploads = calls
        .iter()
        .filter(|c| matches!(c, Call::MemcpyHostToDevice { .. }))
        .count();
    // One upload per launch whose table is not inside its argument.
    let uploaded = calls
        .iter()
        .filter(|c| matches!(c, Call::Launch(l) if l.args.table != 0))
        .count();
    let sends = usize::from(staging_len > 0);
    assert_eq!((launches, uploads), (sends, uploaded), "{calls:?}");

    // Kernel: unpack.
    let mut out = dst.to_vec();
    let mut out_slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    let dst_ptrs: Vec<*mut u8> = out_slices.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let dst_capacity = out_slices.iter().map(|b| b.len()).min().unwrap() as u64;
    let runtime = Recorder::new(&[staging.as_slice()], &mut out_slices);
    // SAFETY: as above.
    let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
        unpack(
            config,
            staging.as_ptr(),
            staging_capacity,
            &dst_ptrs,
            dst_capacity,
            &request.dst_pages,
            engine,
        )
    });
    result.expect("kernel unpack");
    assert_eq!(out, host_dst, "unpacked bytes of {config:?}");
    let launches = calls
        .iter()
        .filter(|c| matches!(c, Call::Launch(_)))
        .count();
    assert_eq!(launches, sends, "{calls:?}");
}

/// Sends the fixture's pair (1 -> 3) through the kernel `sends` times on one engine, on a
/// recorder `make` adjusted; `before(i, runtime)` runs before send i. Returns each send's result
/// and the calls it made.
fn kernel_fixture_sends(
    f: &mut Fixture,
    options: &SendOptions,
    make: impl FnOnce(Recorder) -> Recorder,
    sends: usize,
    before: impl FnMut(usize, &Recorder),
) -> Vec<(mori_tp::Result<SendReport>, Vec<Call>)> {
    fixture_sends_with(f, &vec![*options; sends], make, before)
}

/// As [`kernel_fixture_sends`], send i with `options[i]` (its stream, path and wait), all on one
/// engine and one recorder.
fn fixture_sends_with(
    f: &mut Fixture,
    options: &[SendOptions],
    make: impl FnOnce(Recorder) -> Recorder,
    mut before: impl FnMut(usize, &Recorder),
) -> Vec<(mori_tp::Result<SendReport>, Vec<Call>)> {
    let config = slice_config(&f.params(1)).unwrap();
    let plan = SlicePlan::new(&config, &f.src_pages, &f.dst_pages).unwrap();
    let src: Vec<&[u8]> = f.src.ranks[1].iter().map(Vec::as_slice).collect();
    let mut dst: Vec<&mut [u8]> = f.dst.ranks[3].iter_mut().map(Vec::as_mut_slice).collect();
    let runtime = make(Recorder::new(&src, &mut dst));
    let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let buffers = KvBuffers {
        src: &src_ptrs,
        dst: &dst_ptrs,
        src_capacity: src[0].len() as u64,
        dst_capacity: dst[0].len() as u64,
    };
    let mut engine = GpuEngine::new(runtime, &options[0]).expect("the recorder has a device");
    let mut results = Vec::new();
    for (i, options) in options.iter().enumerate() {
        engine.set_options(options);
        before(i, engine.runtime());
        // The first send's calls include the engine's device check.
        let from = if i == 0 {
            0
        } else {
            engine.runtime().calls.borrow().len()
        };
        // SAFETY: live slices; the recorder checks every row before running the kernel.
        let result = unsafe { send(&plan, &buffers, &mut engine) };
        let calls = engine.runtime().calls.borrow()[from..].to_vec();
        results.push((result, calls));
    }
    let (device, host) = engine.runtime().live_allocations();
    let devices = engine.runtime().devices.unwrap_or(1) as usize;
    let pairs = MAX_TABLE_SLOTS * devices;
    assert!(
        device <= pairs + devices && host <= pairs,
        "only table buffers and reset sentinels stay"
    );
    results
}

/// The fixture's pair (1 -> 3) through the kernel once, on a recorder `make` adjusted.
fn kernel_fixture_run(
    f: &mut Fixture,
    options: &SendOptions,
    make: impl FnOnce(Recorder) -> Recorder,
) -> (mori_tp::Result<SendReport>, Vec<Call>) {
    kernel_fixture_sends(f, options, make, 1, |_, _| {})
        .pop()
        .expect("one send")
}

/// What the fixture's decode rank 3 holds after one host send of pair (1, 3).
fn fixture_sent_by_host() -> Vec<Vec<u8>> {
    fixture_sent_by_host_of(Fixture::new())
}

/// What `f`'s decode rank 3 holds after one host send of pair (1, 3).
fn fixture_sent_by_host_of(mut f: Fixture) -> Vec<Vec<u8>> {
    let config = slice_config(&f.params(1)).unwrap();
    let plan = SlicePlan::new(&config, &f.src_pages, &f.dst_pages).unwrap();
    let src: Vec<&[u8]> = f.src.ranks[1].iter().map(Vec::as_slice).collect();
    let mut dst: Vec<&mut [u8]> = f.dst.ranks[3].iter_mut().map(Vec::as_mut_slice).collect();
    mori_tp::send_host(&plan, &src, &mut dst).expect("host send");
    f.dst.ranks[3].clone()
}

fn gpu_error(result: mori_tp::Result<SendReport>) -> (&'static str, i32, String, Option<usize>) {
    match result {
        Err(Error::Gpu {
            call,
            status,
            message,
            buffer,
            ..
        }) => (call, status, message, buffer),
        other => panic!("expected Error::Gpu, got {other:?}"),
    }
}

#[test]
fn the_kernel_is_loaded_once_per_device_and_reused() {
    if cpu_kernel_or_skip("the_kernel_is_loaded_once_per_device_and_reused").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let devices = [0, 0, 1, 0, 1];
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, null_mut()),
        |r| Recorder {
            devices: Ok(2),
            ..r
        },
        devices.len(),
        |i, r| *r.current.borrow_mut() = devices[i],
    );
    let loads: Vec<bool> = runs
        .into_iter()
        .map(|(result, calls)| {
            result.unwrap();
            names(&calls).contains(&"hipModuleLoadData")
        })
        .collect();
    assert_eq!(loads, [true, false, true, false, false]);
}

#[test]
fn a_failing_launch_is_a_gpu_error_that_still_fences_the_table_and_waits_when_asked() {
    if cpu_kernel_or_skip("a_failing_launch_...").is_none() {
        return;
    }
    let mut f = Fixture::uploaded();
    let initial = f.dst.ranks[3].clone();
    let stream = without_provenance_mut(0xabc000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(true, stream), |r| {
        r.fail_call
            .set(Some(("hipModuleLaunchKernel", GpuStatus(98))));
        r
    });
    let message = gpu_message(result);
    for part in [
        "hipModuleLaunchKernel(mori_copy_kernel, grid (",
        "block (256, 1, 1), stream 0xabc000",
        "returned hipErrorInvalidDeviceFunction (98)",
        "(4 buffers x 550 rects, 550 rows per buffer)",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    // The upload was issued before the launch failed: the table buffer's fence is recorded all
    // the same, so that nobody rewrites the buffer while the upload may still read it.
    let n = names(&calls);
    let launch = n
        .iter()
        .position(|c| *c == "hipModuleLaunchKernel")
        .unwrap();
    assert_eq!(
        n[launch - 1..],
        [
            "hipMemcpyAsync",
            "hipModuleLaunchKernel",
            "hipEventRecord",
            "hipStreamWaitEvent",
            "hipEventRecord",
            "hipStreamSynchronize",
            "hipThreadExchangeStreamCaptureMode",
        ]
    );
    assert_eq!(f.dst.ranks[3], initial, "a failed launch writes nothing");
}

/// A table inside the kernel's argument has no table buffer to fence: a failed launch is
/// followed by the wait when asked and the thread's capture mode, nothing else.
#[test]
fn a_failing_launch_of_an_inline_table_is_a_gpu_error_and_waits_when_asked() {
    if cpu_kernel_or_skip("a_failing_launch_of_an_inline_table_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    let stream = without_provenance_mut(0xabc000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(true, stream), |r| {
        r.fail_call
            .set(Some(("hipModuleLaunchKernel", GpuStatus(98))));
        r
    });
    let message = gpu_message(result);
    for part in [
        "hipModuleLaunchKernel(mori_copy_kernel, grid (",
        "block (256, 1, 1), stream 0xabc000",
        "returned hipErrorInvalidDeviceFunction (98)",
        "(4 buffers x 3 rects, 20 rows per buffer)",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    let n = names(&calls);
    let launch = n
        .iter()
        .position(|c| *c == "hipModuleLaunchKernel")
        .unwrap();
    assert_eq!(
        n[launch - 1..],
        [
            "hipPointerGetAttributes",
            "hipModuleLaunchKernel",
            "hipStreamSynchronize",
            "hipThreadExchangeStreamCaptureMode",
        ]
    );
    assert_eq!(f.dst.ranks[3], initial, "a failed launch writes nothing");
}

#[test]
fn each_failing_kernel_path_call_is_named_and_issues_nothing_after_it_but_its_cleanup() {
    if cpu_kernel_or_skip("each_failing_kernel_path_call_...").is_none() {
        return;
    }
    // After a failure: its cleanup (nothing is freed: what was made is kept for the next call),
    // and the thread's capture mode given back (unless it was the exchange that failed).
    let mode = "hipThreadExchangeStreamCaptureMode";
    let fence = [
        "hipEventRecord",
        "hipStreamWaitEvent",
        "hipEventRecord",
        mode,
    ];
    for (call, then) in [
        (mode, &[][..]),
        ("hipStreamIsCapturing", &[mode][..]),
        ("hipGetDevice", &[mode][..]),
        ("hipStreamGetDevice", &[mode][..]),
        ("hipModuleLoadData", &[mode][..]),
        ("hipModuleGetFunction", &["hipModuleUnload", mode][..]),
        ("hipMalloc", &[mode][..]),
        ("hipMemGetAddressRange", &[mode][..]),
        ("hipPointerGetAttributes", &[mode][..]),
        ("hipEventCreateWithFlags", &[mode][..]),
        ("hipStreamCreateWithFlags", &[mode][..]),
        ("hipHostMalloc", &[mode][..]),
        ("hipMemcpyAsync", &[mode][..]),
        ("hipModuleLaunchKernel", &fence[..]),
        ("hipEventRecord", &[mode][..]),
        ("hipStreamWaitEvent", &[mode][..]),
    ] {
        // The uploaded table's call makes every one of those calls.
        let mut f = Fixture::uploaded();
        let initial = f.dst.ranks[3].clone();
        let stream = without_provenance_mut(0x5700_0000);
        let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
            r.fail_call.set(Some((call, GpuStatus(123_456))));
            r
        });
        match result {
            Err(Error::Gpu {
                call: failed,
                status,
                message,
                ..
            }) => {
                assert_eq!((failed, status), (call, 123_456), "{message}");
                assert!(
                    message.starts_with(call)
                        && message.contains("hipErrorUnknown (123456)")
                        && !message.contains("  "),
                    "{message}"
                );
                if call == "hipModuleLoadData" {
                    assert!(
                        message.contains("holds code objects for gfx-test"),
                        "{message}"
                    );
                }
            }
            other => panic!("{call}: expected a GPU error, got {other:?}"),
        }
        let names = names(&calls);
        let at = names
            .iter()
            .position(|n| *n == call)
            .expect("the call was made");
        assert_eq!(&names[at + 1..], then, "{call}: {names:?}");
        if !["hipEventRecord", "hipStreamWaitEvent"].contains(&call) {
            assert_eq!(f.dst.ranks[3], initial, "{call}: nothing launched");
        }
    }
    // A table inside the kernel's argument: the calls up to the launch fail as above; the
    // table buffer pair's, the lane's and the fence's are never made.
    for call in [
        "hipEventCreateWithFlags",
        "hipStreamCreateWithFlags",
        "hipHostMalloc",
        "hipMemcpyAsync",
        "hipEventRecord",
        "hipStreamWaitEvent",
        "hipModuleLaunchKernel",
    ] {
        let mut f = Fixture::new();
        let stream = without_provenance_mut(0x5700_0000);
        let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
            r.fail_call.set(Some((call, GpuStatus(123_456))));
            r
        });
        let names = names(&calls);
        if call == "hipModuleLaunchKernel" {
            let (failed, ..) = gpu_error(result);
            assert_eq!(failed, call);
            assert_eq!(names.last(), Some(&mode), "{names:?}");
        } else {
            result.unwrap_or_else(|e| panic!("{call} is not made for an inline table: {e}"));
            assert!(!names.contains(&call), "{call}: {names:?}");
        }
    }
}

#[test]
fn a_failed_load_is_cached_and_reported_again_without_a_retry() {
    if cpu_kernel_or_skip("a_failed_load_is_cached_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, null_mut()),
        |r| r,
        2,
        |i, r| {
            r.fail_call
                .set((i == 0).then_some(("hipModuleLoadData", GpuStatus(209))))
        },
    );
    let mut messages = Vec::new();
    for (i, (result, calls)) in runs.into_iter().enumerate() {
        let (call, status, message, _) = gpu_error(result);
        assert_eq!((call, status), ("hipModuleLoadData", 209), "send {i}");
        assert!(
            message.contains("hipErrorNoBinaryForGpu (209)")
                && message.contains("MORI_TP_HIP_ARCHS")
                && message.contains("does not load the copy kernel on this device again"),
            "{message}"
        );
        assert_eq!(
            names(&calls).contains(&"hipModuleLoadData"),
            i == 0,
            "send {i} loads: {calls:?}"
        );
        messages.push(message);
    }
    assert_eq!(messages[0], messages[1]);
}

/// Issue 45.2 (R2): a load that failed for a reason a retry can change (out of memory) is not
/// cached: the error names the cause with its own hint, the next call loads again and
/// launches, and the counters show the failure and the per-rect fallback of flags 0.
#[test]
fn a_transient_load_failure_is_retried_on_the_next_call() {
    if cpu_kernel_or_skip("a_transient_load_failure_is_retried_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let cache = std::cell::RefCell::new(None);
    let mut sends = vec![kernel_options(false, null_mut()); 2];
    sends.insert(1, auto_options(false, null_mut()));
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| r,
        |i, r| {
            *cache.borrow_mut() = Some(r.cache.clone());
            r.fail_call
                .set((i < 2).then_some(("hipModuleLoadData", GpuStatus(2))));
        },
    );
    let (call, status, message, _) = gpu_error(runs[0].0.clone());
    assert_eq!((call, status), ("hipModuleLoadData", 2));
    assert!(
        message.contains("memory is full") && message.contains("again on the next call"),
        "{message}"
    );
    // Flags 0 while the load still fails: loaded again, then the per-rect copies.
    let (result, calls) = &runs[1];
    assert!(result.is_ok(), "{result:?}");
    let n = names(calls);
    assert!(
        n.contains(&"hipModuleLoadData") && !n.contains(&"hipModuleLaunchKernel"),
        "{n:?}"
    );
    // The driver loads now: the kernel runs.
    let (result, calls) = &runs[2];
    assert!(result.is_ok(), "{result:?}");
    let n = names(calls);
    assert!(
        n.contains(&"hipModuleLoadData") && n.contains(&"hipModuleLaunchKernel"),
        "{n:?}"
    );
    let counters = cache.borrow().as_ref().expect("the cache").counters();
    assert_eq!(
        (
            counters.load_failures,
            counters.fallbacks_unloadable,
            counters.kernel_launches
        ),
        (2, 1, 1),
        "{counters:?}"
    );
}

#[test]
fn a_module_without_the_kernel_is_unloaded_again() {
    if cpu_kernel_or_skip("a_module_without_the_kernel_is_unloaded_again").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, null_mut()), |r| {
        r.fail_call
            .set(Some(("hipModuleGetFunction", GpuStatus(500))));
        r
    });
    assert!(gpu_message(result).contains("hipErrorNotFound (500)"));
    assert!(
        calls.contains(&Call::ModuleUnload {
            module: module_handle(0)
        }),
        "the module is not leaked: {calls:?}"
    );
}

#[test]
fn the_recording_runtime_refuses_a_launch_that_would_touch_unregistered_memory() {
    if cpu_kernel_or_skip("the_recording_runtime_refuses_a_launch_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    // The last destination buffer is not memory the recorder lets the kernel write.
    let (result, calls) =
        kernel_fixture_run(&mut f, &kernel_options(false, null_mut()), |mut r| {
            r.writable.pop();
            r
        });
    assert!(names(&calls).contains(&"hipModuleLaunchKernel"));
    assert!(
        gpu_message(result).contains("hipErrorIllegalAddress (700)"),
        "a launch outside the buffers is refused"
    );
    assert_eq!(ILLEGAL_ADDRESS, GpuStatus(700));
    assert_eq!(f.dst.ranks[3], initial);
}

// ---- Issue 24: what the first GPU deployments would hit ----

/// A recorder with two devices whose streams belong to device 1 (device 0 is current).
fn stream_on_device_1(r: Recorder) -> Recorder {
    r.stream_home.set(1);
    Recorder {
        devices: Ok(2),
        ..r
    }
}

/// The device current at each of `calls`, starting with `device`.
fn current_during(calls: &[Call], mut device: i32) -> Vec<i32> {
    calls
        .iter()
        .map(|call| {
            let now = device;
            if let Call::SetDevice(to) = call {
                device = *to;
            }
            now
        })
        .collect()
}

#[test]
fn a_stream_on_another_device_than_the_current_one_gets_the_kernel_loaded_there() {
    if cpu_kernel_or_skip("a_stream_on_another_device_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0xde71_0000);
    let asked = std::cell::RefCell::new(Vec::new());
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(true, stream),
        stream_on_device_1,
        3,
        |_, r| {
            // Issue 45.6: the buffers are asked about for the launch device (1), not the
            // current one (0), on every send so far.
            asked.replace(r.pointer_info_devices.borrow().clone());
        },
    );
    for (result, _) in &runs {
        assert!(result.is_ok(), "{result:?}");
    }
    let asked = asked.into_inner();
    assert!(
        !asked.is_empty() && asked.iter().all(|&d| d == 1),
        "{asked:?}"
    );
    // Loaded, and its sentinel, lane (event, relay stream), table buffer pair and event made,
    // with device 1 current; then back to 0.
    let first = &runs[0].1;
    let current = current_during(first, 0);
    for (call, device) in first.iter().zip(&current) {
        let made_for_the_device = matches!(
            call,
            Call::ModuleLoad { .. }
                | Call::GetFunction { .. }
                | Call::Malloc { .. }
                | Call::HostMalloc { .. }
                | Call::EventCreate { .. }
                | Call::StreamCreate { .. }
        );
        if made_for_the_device {
            assert_eq!(*device, 1, "{call:?} with device 1 current: {first:?}");
        }
    }
    assert_eq!(first.last(), Some(&RESTORED));
    let last_switch = first.iter().rposition(|c| matches!(c, Call::SetDevice(_)));
    assert_eq!(first[last_switch.unwrap()], Call::SetDevice(0));
    // Once the lane and a pair exist, a call finds everything on device 1 and switches nothing.
    for (_, calls) in &runs[1..] {
        let n = names(calls);
        for never in [
            "hipSetDevice",
            "hipModuleLoadData",
            "hipMalloc",
            "hipHostMalloc",
        ] {
            assert!(!n.contains(&never), "{n:?}");
        }
    }
    assert_eq!(f.dst.ranks[3], want);
}

#[test]
fn without_hip_stream_get_device_a_stream_on_another_device_is_refused_before_anything_is_allocated()
 {
    if cpu_kernel_or_skip("without_hip_stream_get_device_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0xde71_0000);
    // Three sends with device 0 current, then one with the stream's device 1 current.
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, stream),
        |r| Recorder {
            has_stream_get_device: false,
            ..stream_on_device_1(r)
        },
        4,
        |i, r| {
            if i == 3 {
                let (device, host) = r.live_allocations();
                assert_eq!(
                    (device, host),
                    (1, 0),
                    "the refused sends allocated nothing but the reset sentinel"
                );
                *r.current.borrow_mut() = 1;
            }
        },
    );
    for (i, (result, calls)) in runs.iter().take(3).enumerate() {
        let (call, status, message, _) = gpu_error(result.clone());
        assert_eq!(
            (call, status),
            ("hipEventRecord", 400),
            "send {i}: {message}"
        );
        for part in [
            "hipEventRecord(an event of the current device 0, stream 0xde710000) returned \
             hipErrorInvalidHandle (400)",
            "this HIP runtime has no hipStreamGetDevice",
            "make the stream's device current",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        let n = names(calls);
        assert!(
            calls
                .iter()
                .all(|c| !matches!(c, Call::Malloc { size, .. } if *size != RESET_SENTINEL_BYTES)),
            "send {i}: no table buffer: {n:?}"
        );
        for never in [
            "hipSetDevice",
            "hipHostMalloc",
            "hipMemcpyAsync",
            "hipModuleLaunchKernel",
        ] {
            assert!(!n.contains(&never), "send {i}: {n:?}");
        }
        // The probe event is made once, with the kernel's state.
        assert_eq!(
            n.contains(&"hipEventCreateWithFlags"),
            i == 0,
            "send {i}: {n:?}"
        );
    }
    let (result, calls) = &runs[3];
    assert!(result.is_ok(), "{result:?}");
    // The stream's device is current: loaded there, checked, sent.
    let n = names(calls);
    let probe = n.iter().position(|c| *c == "hipEventRecord").unwrap();
    assert!(
        n[..probe].contains(&"hipModuleLoadData")
            && n[probe + 1..].contains(&"hipModuleLaunchKernel"),
        "{n:?}"
    );
    assert_eq!(f.dst.ranks[3], want);
}

/// The calls of a kernel call whose table is inside the argument, on `stream` of the current
/// device 0 with hipStreamGetDevice, of the fixture's four buffer pairs, on a fresh recorder.
fn inline_call_names() -> Vec<&'static str> {
    let mut expected = vec![
        "hipGetDeviceCount",
        "hipThreadExchangeStreamCaptureMode",
        "hipStreamIsCapturing",
        "hipGetDevice",
        "hipStreamGetDevice",
        "hipModuleLoadData",
        "hipModuleGetFunction",
        "hipMalloc",
        "hipMemGetAddressRange",
    ];
    expected.extend(["hipPointerGetAttributes"; 8]);
    expected.extend([
        "hipModuleLaunchKernel",
        "hipThreadExchangeStreamCaptureMode",
    ]);
    expected
}

/// A table inside the kernel's argument needs nothing but the launch: no table buffer pair, no
/// upload, no lane (relay stream and event), no fence; the reset sentinel is the one
/// allocation. The launch's argument holds the table (its address is 0).
#[test]
fn an_inline_table_is_one_launch_with_no_upload_allocation_or_event() {
    if cpu_kernel_or_skip("an_inline_table_is_one_launch_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0x1a1e_0000);
    let runs = kernel_fixture_sends(&mut f, &kernel_options(false, stream), |r| r, 3, |_, _| {});
    let (result, calls) = &runs[0];
    assert_eq!(result.as_ref().map(|r| r.copies), Ok(12));
    assert_eq!(names(calls), inline_call_names(), "{calls:?}");
    let Some(Call::Launch(launch)) = calls.iter().find(|c| matches!(c, Call::Launch(_))) else {
        unreachable!("a launch");
    };
    assert_eq!(
        launch.args.table, 0,
        "the table travels inside the argument"
    );
    assert!(launch.args.table_bytes > 0);
    // Later calls: the capture check, the device, the reset check, the launch.
    for (result, calls) in &runs[1..] {
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(
            names(calls),
            [
                "hipThreadExchangeStreamCaptureMode",
                "hipStreamIsCapturing",
                "hipGetDevice",
                "hipStreamGetDevice",
                "hipMemGetAddressRange",
                "hipModuleLaunchKernel",
                "hipThreadExchangeStreamCaptureMode",
            ]
        );
    }
    assert_eq!(f.dst.ranks[3], want);
}

/// A table too big for the kernel's argument keeps the table buffer path: the lane, the pair,
/// one upload of the table's bytes from pinned memory, the launch with the pair's device address
/// in its argument, and the fence, exactly as `expected_kernel_calls` lists them.
#[test]
fn an_uploaded_table_is_one_upload_one_launch_and_the_fence() {
    if cpu_kernel_or_skip("an_uploaded_table_is_one_upload_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0x0b1e_0000);
    let options = kernel_options(true, stream);
    let config = slice_config(&f.params(1)).unwrap();
    let (src_pages, dst_pages) = (f.src_pages.clone(), f.dst_pages.clone());
    let plan = SlicePlan::new(&config, &src_pages, &dst_pages).unwrap();
    let src: Vec<*const u8> = f.src.ranks[1].iter().map(|b| b.as_ptr()).collect();
    let dst: Vec<*mut u8> = f.dst.ranks[3].iter_mut().map(|b| b.as_mut_ptr()).collect();
    let (result, calls) = kernel_fixture_run(&mut f, &options, |r| r);
    assert_eq!(result.unwrap().copies, 4 * UPLOADED_PAGES);
    assert_eq!(
        calls,
        expected_kernel_calls(&plan, &src, &dst, &options, handed(&calls))
    );
    let Some(Call::Launch(launch)) = calls.iter().find(|c| matches!(c, Call::Launch(_))) else {
        unreachable!("a launch");
    };
    assert_eq!(launch.args.table as usize, handed(&calls).table);
    assert!(calls.iter().any(
        |c| matches!(c, Call::MemcpyHostToDevice { size, .. } if *size == launch.args.table_bytes as usize)
    ));
    assert_eq!(f.dst.ranks[3], want);
}

/// The fixture's uploaded table (4.5 KB: too big for the 4 KiB argument) through the kernel on a
/// recorder with a wide entry (as CUDA 12.1+), `sends` times on one engine, the recorder's
/// wide load failing with `wide_load` when given: the calls of each send, the kernel cache
/// (its counters), and whether the destination holds what the host backend writes.
fn wide_fixture_sends(
    sends: usize,
    capturing: bool,
    wide_load: Option<GpuStatus>,
) -> (
    Vec<Vec<Call>>,
    std::sync::Arc<mori_tp::gpu_runtime::KernelCache>,
    bool,
) {
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0x3276_0000);
    let cache = std::sync::Arc::new(mori_tp::gpu_runtime::KernelCache::new());
    let shared = cache.clone();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, stream),
        move |mut r| {
            r.wide_room = WIDE_INLINE_TABLE_BYTES;
            r.wide_load_status = wide_load;
            r.capturing.set(capturing);
            r.cache = shared;
            r
        },
        sends,
        |_, _| {},
    );
    let calls = runs
        .into_iter()
        .map(|(result, calls)| {
            assert_eq!(result.expect("the send").copies, 4 * UPLOADED_PAGES);
            calls
        })
        .collect();
    (calls, cache, f.dst.ranks[3] == want)
}

/// The table's bytes of the fixture's uploaded table (its length as the launch must carry it).
fn uploaded_table_len() -> usize {
    let f = Fixture::uploaded();
    let config = slice_config(&f.params(1)).unwrap();
    let plan = SlicePlan::new(&config, &f.src_pages, &f.dst_pages).unwrap();
    let bases = [(0x1000u64, 0x2000u64); 4];
    KernelTable::build(plan.rects(), &bases)
        .expect("a table")
        .table_len()
}

/// Issue 45.8: on a runtime with the wide entry (CUDA 12.1+) a table too big for the 4 KiB
/// argument travels inside the wide one: the first send loads the wide module beside the main
/// one and launches it alone (no table buffer, upload, lane or fence), a later send is the
/// launch alone, and the bytes are the host backend's.
#[test]
fn a_table_within_the_wide_room_is_one_wide_launch_with_no_upload() {
    if cpu_kernel_or_skip("a_table_within_the_wide_room_...").is_none() {
        return;
    }
    let (calls, cache, right) = wide_fixture_sends(2, false, None);
    let counters = cache.counters();
    assert!(right, "the bytes of the host backend");
    let wide_launch = |calls: &[Call]| {
        calls
            .iter()
            .filter_map(|c| match c {
                Call::LaunchWide {
                    table, table_bytes, ..
                } => Some((*table, *table_bytes as usize)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    for (send, calls) in calls.iter().enumerate() {
        assert_eq!(
            wide_launch(calls),
            [(0, uploaded_table_len())],
            "send {send}: one wide launch with the table inside"
        );
        let n = names(calls);
        for absent in [
            "hipMemcpyAsync",
            "hipHostMalloc",
            "hipStreamCreateWithFlags",
        ] {
            assert!(!n.contains(&absent), "send {send}: {absent} in {n:?}");
        }
        assert!(!calls.iter().any(|c| matches!(c, Call::Launch(_))), "{n:?}");
    }
    let loads = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::ModuleLoad { .. }))
            .count()
    };
    assert_eq!(loads(&calls[0]), 2, "the main module and the wide one");
    assert_eq!(loads(&calls[1]), 0, "both stay loaded");
    assert_eq!(
        (
            counters.kernel_launches,
            counters.load_failures,
            counters.fallbacks
        ),
        (2, 0, 0),
        "{counters:?}"
    );
}

/// Issue 45.8: a capturing stream's table within the wide room is captured as one wide launch
/// (its node owns the argument), not as per-rect copies.
#[test]
fn a_capturing_stream_captures_a_wide_table_as_one_launch() {
    if cpu_kernel_or_skip("a_capturing_stream_captures_a_wide_table_...").is_none() {
        return;
    }
    let (calls, cache, right) = wide_fixture_sends(1, true, None);
    let counters = cache.counters();
    assert!(right);
    let n = names(&calls[0]);
    assert!(
        calls[0]
            .iter()
            .any(|c| matches!(c, Call::LaunchWide { table: 0, .. })),
        "{n:?}"
    );
    assert!(
        !n.contains(&"hipMemcpy2DAsync") && !n.contains(&"hipMemcpyAsync"),
        "{n:?}"
    );
    assert_eq!(counters.fallbacks, 0, "{counters:?}");
}

/// Issue 45.8: when the wide entry does not load, the failure is counted once (not retried) and
/// the device's tables are uploaded as on a runtime without it; while capturing, such a table
/// then takes the per-rect copies (a captured upload could not be replayed).
#[test]
fn a_wide_entry_that_does_not_load_leaves_tables_uploaded_and_is_counted_once() {
    if cpu_kernel_or_skip("a_wide_entry_that_does_not_load_...").is_none() {
        return;
    }
    let (calls, cache, right) = wide_fixture_sends(3, false, Some(GpuStatus(218)));
    let counters = cache.counters();
    assert!(right, "the bytes of the host backend");
    for (send, calls) in calls.iter().enumerate() {
        let n = names(calls);
        assert!(
            n.contains(&"hipMemcpyAsync"),
            "send {send}: uploaded: {n:?}"
        );
        assert!(
            calls
                .iter()
                .any(|c| matches!(c, Call::Launch(l) if l.args.table != 0)),
            "send {send}: the main entry with the uploaded table: {n:?}"
        );
        assert!(
            !calls.iter().any(|c| matches!(c, Call::LaunchWide { .. })),
            "{n:?}"
        );
    }
    let wide_loads: usize = calls
        .iter()
        .flatten()
        .filter(
            |c| matches!(c, Call::ModuleLoad { bytes } if *bytes == TEST_WIDE_IMAGE.bytes.len()),
        )
        .count();
    assert_eq!(wide_loads, 1, "tried once");
    assert_eq!(
        (
            counters.kernel_launches,
            counters.load_failures,
            counters.fallbacks
        ),
        (3, 1, 0),
        "{counters:?}"
    );
    let (calls, cache, right) = wide_fixture_sends(1, true, Some(GpuStatus(218)));
    let counters = cache.counters();
    assert!(right);
    let n = names(&calls[0]);
    assert!(
        n.contains(&"hipMemcpy2DAsync") && !n.contains(&"hipModuleLaunchKernel"),
        "{n:?}"
    );
    assert_eq!(
        (counters.fallbacks_capture, counters.load_failures),
        (1, 1),
        "{counters:?}"
    );
}

/// On a runtime without the wide entry (HIP, the recorder's default) the same table is
/// uploaded, and nothing of a wide entry is asked for or loaded.
#[test]
fn without_a_wide_entry_the_table_is_uploaded() {
    if cpu_kernel_or_skip("without_a_wide_entry_the_table_is_uploaded").is_none() {
        return;
    }
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0x3277_0000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| r);
    assert!(result.is_ok(), "{result:?}");
    assert!(!calls.iter().any(|c| matches!(c, Call::LaunchWide { .. })));
    assert_eq!(
        calls
            .iter()
            .filter(|c| matches!(c, Call::ModuleLoad { .. }))
            .count(),
        1,
        "the main module only"
    );
    assert!(names(&calls).contains(&"hipMemcpyAsync"));
}

/// An uploaded table on a capturing stream gets the per-rect copies: a captured upload would
/// keep reading the table buffer at every replay, long after this call reused it, while copy
/// nodes keep nothing of the call. With MORI_SEND_COPY_KERNEL too.
#[test]
fn a_capturing_stream_with_an_uploaded_table_gets_per_rect_copies() {
    if cpu_kernel_or_skip("a_capturing_stream_with_an_uploaded_table_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0xca97_0000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
        r.capturing.set(true);
        r
    });
    let copies = 4 * UPLOADED_PAGES;
    assert_eq!(result.unwrap().copies, copies);
    let mut expected = vec![
        "hipGetDeviceCount",
        "hipThreadExchangeStreamCaptureMode",
        "hipStreamIsCapturing",
    ];
    expected.extend(vec!["hipMemcpy2DAsync"; copies]);
    expected.push("hipThreadExchangeStreamCaptureMode");
    assert_eq!(names(&calls), expected, "no table, no upload, no launch");
    assert_eq!(f.dst.ranks[3], want);
}

/// A table inside the kernel's argument on a capturing stream gets the kernel: the launch is
/// the graph's kernel node, which holds its own copy of the argument (HIP 5.3 and later, and
/// CUDA), and nothing of the library's is read at a replay.
#[test]
fn a_capturing_stream_with_an_inline_table_gets_the_launch_alone() {
    if cpu_kernel_or_skip("a_capturing_stream_with_an_inline_table_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0xca97_0000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
        r.capturing.set(true);
        r
    });
    assert_eq!(result.unwrap().copies, 12);
    assert_eq!(names(&calls), inline_call_names(), "{calls:?}");
    assert_eq!(f.dst.ranks[3], want);
}

/// HIP 5.2 runs hipModuleLaunchKernel on a capturing stream at once and leaves it out of the
/// graph: there, a capturing stream gets the per-rect copies whatever the table (the recorder
/// panics at a launch a capture would lose).
#[test]
fn a_runtime_that_does_not_capture_launches_gets_per_rect_copies_while_capturing() {
    if cpu_kernel_or_skip("a_runtime_that_does_not_capture_launches_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0xca97_0000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
        r.capturing.set(true);
        Recorder {
            captures_launches: false,
            ..r
        }
    });
    assert_eq!(result.unwrap().copies, 12);
    let mut expected = vec![
        "hipGetDeviceCount",
        "hipThreadExchangeStreamCaptureMode",
        "hipStreamIsCapturing",
    ];
    expected.extend(["hipMemcpy2DAsync"; 12]);
    expected.push("hipThreadExchangeStreamCaptureMode");
    assert_eq!(names(&calls), expected);
    assert_eq!(f.dst.ranks[3], want);
}

/// On a capturing stream of device 1 with device 0 current, the launch is made with device 1
/// current (HIP checks a captured launch's function against the current device, and refuses
/// a function of another device's module), and device 0 is current again after it.
#[test]
fn a_capturing_stream_on_another_device_gets_the_launch_with_its_device_current() {
    if cpu_kernel_or_skip("a_capturing_stream_on_another_device_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let stream = without_provenance_mut(0xca97_0000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
        r.capturing.set(true);
        stream_on_device_1(r)
    });
    assert_eq!(result.unwrap().copies, 12, "{calls:?}");
    let launch = calls
        .iter()
        .position(|c| matches!(c, Call::Launch(_)))
        .expect("a launch");
    assert_eq!(
        calls[launch - 1..launch + 2],
        [Call::SetDevice(1), calls[launch], Call::SetDevice(0)]
    );
    assert_eq!(current_during(&calls, 0)[launch], 1);
    assert_eq!(calls.last(), Some(&RESTORED));
    assert_eq!(f.dst.ranks[3], want);
}

/// Without hipStreamGetDevice (HIP 5.2 to 5.5) the stream's device is confirmed by recording an
/// event of the current device on it, which a capturing stream captures without that check: a
/// capturing stream gets the per-rect copies, even one of the current device.
#[test]
fn without_hip_stream_get_device_a_capturing_stream_gets_per_rect_copies() {
    if cpu_kernel_or_skip("without_hip_stream_get_device_a_capturing_stream_...").is_none() {
        return;
    }
    for home in [0, 1] {
        let want = fixture_sent_by_host();
        let mut f = Fixture::new();
        let stream = without_provenance_mut(0xca97_0000);
        let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(false, stream), |r| {
            r.capturing.set(true);
            r.stream_home.set(home);
            Recorder {
                has_stream_get_device: false,
                devices: Ok(2),
                ..r
            }
        });
        assert_eq!(result.as_ref().map(|r| r.copies), Ok(12), "{calls:?}");
        let n = names(&calls);
        for never in ["hipEventRecord", "hipModuleLaunchKernel"] {
            assert!(!n.contains(&never), "stream of device {home}: {n:?}");
        }
        assert_eq!(n.iter().filter(|c| **c == "hipMemcpy2DAsync").count(), 12);
        assert_eq!(f.dst.ranks[3], want);
    }
}

/// The recorder keeps clr's rule: while another thread captures in the global mode, hipMalloc,
/// hipHostMalloc, hipFree, hipStreamSynchronize and hipEventSynchronize of a thread in the global
/// mode are refused, and the capture is invalidated; in the relaxed mode they are not.
#[test]
fn the_recording_runtime_refuses_unsafe_calls_during_another_threads_global_capture() {
    let recorder = pool_recorder();
    recorder.global_capture_elsewhere.set(true);
    let event = recorder.event_create().unwrap();
    let refused = GpuStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED;
    assert_eq!(recorder.malloc(64), Err(refused));
    assert_eq!(recorder.host_malloc(64), Err(refused));
    // SAFETY: the recorder's own event; the NULL stream.
    unsafe {
        assert_eq!(recorder.stream_synchronize(null_mut()), Err(refused));
        assert_eq!(recorder.event_synchronize(event), Err(refused));
    }
    assert_eq!(recorder.invalidated.borrow().len(), 4);
    assert_eq!(
        recorder.exchange_capture_mode(CaptureMode::RELAXED),
        Ok(CaptureMode::GLOBAL)
    );
    let pointer = recorder.malloc(64).expect("allowed when relaxed");
    // SAFETY: as above; the allocation made just now.
    unsafe {
        assert_eq!(recorder.stream_synchronize(null_mut()), Ok(()));
        assert_eq!(recorder.event_synchronize(event), Ok(()));
        assert_eq!(recorder.free(pointer), Ok(()));
    }
}

/// Issue 35.1: while another thread captures a graph in the global mode (PyTorch's default),
/// kernel sends on streams that do not capture (the first ones allocate the kernel's sentinel,
/// lane and table buffers; with MORI_SEND_SYNCHRONIZE they wait for the stream), per-rect sends
/// and a device pool's life neither fail nor invalidate that capture, and the thread's own mode
/// is given back after each.
#[test]
fn nothing_breaks_another_threads_global_capture() {
    if cpu_kernel_or_skip("nothing_breaks_another_threads_global_capture").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let mut sends = Vec::new();
    for stream in [null_mut(), without_provenance_mut(0x7ab2_0000)] {
        for synchronize in [false, true] {
            sends.push(kernel_options(synchronize, stream));
            sends.push(auto_options(synchronize, stream));
            sends.push(options(synchronize, stream));
        }
    }
    let invalidated = std::cell::RefCell::new(Vec::new());
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| {
            r.global_capture_elsewhere.set(true);
            r
        },
        |_, r| {
            invalidated
                .borrow_mut()
                .extend(r.invalidated.borrow().iter().copied());
            assert_eq!(
                r.capture_mode.get(),
                CaptureMode::GLOBAL,
                "the mode came back"
            );
        },
    );
    for (i, (result, calls)) in runs.iter().enumerate() {
        assert!(result.is_ok(), "send {i}: {result:?}");
        assert_eq!(calls.last(), Some(&RESTORED), "send {i}");
    }
    assert!(
        invalidated.borrow().is_empty(),
        "{:?}",
        invalidated.borrow()
    );
    assert!(names(&runs[0].1).contains(&"hipMalloc"));
    assert_eq!(f.dst.ranks[3], want);

    let recorder = pool_recorder();
    recorder.global_capture_elsewhere.set(true);
    let memory = DeviceMemory::new(recorder, 1 << 16).expect("allocated while relaxed");
    let calls = Rc::clone(&memory.runtime().calls);
    let invalidated = Rc::new(std::cell::Cell::new(usize::MAX));
    invalidated.set(memory.runtime().invalidated.borrow().len());
    drop(memory);
    assert!(
        calls.borrow().contains(&Call::Free {
            pointer: without_provenance_mut(
                calls
                    .borrow()
                    .iter()
                    .find_map(|c| match c {
                        Call::Malloc { returned, .. } => Some(*returned),
                        _ => None,
                    })
                    .unwrap()
            )
        })
    );
    assert_eq!(invalidated.get(), 0);
}

/// Issue 35.1, same thread: after kernel sends on S, S captures a graph (relaxed mode); a kernel
/// send on T then neither waits for nor asks about an event last recorded on S (clr invalidates
/// S's capture and fails the call with hipErrorCapturedEvent), and S's own send gets the
/// per-rect copies.
#[test]
fn a_kernel_send_on_one_stream_leaves_another_streams_capture_alone() {
    if cpu_kernel_or_skip("a_kernel_send_on_one_stream_leaves_...").is_none() {
        return;
    }
    let mut f = Fixture::uploaded();
    let (s, t) = (0x5200_0000usize, 0x7200_0000usize);
    let mut sends = vec![kernel_options(false, without_provenance_mut(s)); 5];
    sends.extend([kernel_options(false, without_provenance_mut(t)); MAX_TABLE_SLOTS + 2]);
    let last = sends.len() - 1;
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| r,
        |i, r| {
            if i == 4 {
                r.captures.borrow_mut().push(s);
            }
            assert!(r.invalidated.borrow().is_empty(), "before send {i}");
            if i == last {
                r.captures.borrow_mut().clear();
            }
        },
    );
    for (i, (result, calls)) in runs.iter().enumerate() {
        assert!(result.is_ok(), "send {i}: {result:?}");
        let n = names(calls);
        assert!(!n.contains(&"hipEventSynchronize"), "send {i}: {n:?}");
        if i == 4 {
            assert!(!n.contains(&"hipModuleLaunchKernel"), "{n:?}");
        }
    }
}

/// `hipStreamSynchronize` is not allowed on a capturing stream, so MORI_SEND_SYNCHRONIZE there
/// is refused on both paths, after the capture check and before anything is enqueued, with
/// what to do instead; without it the same capturing send goes through.
#[test]
fn synchronize_on_a_capturing_stream_is_refused_before_anything_is_enqueued() {
    let want = fixture_sent_by_host();
    let stream = without_provenance_mut(0xca97_1000);
    for kernel in [false, true] {
        let mut f = Fixture::new();
        let initial = f.dst.ranks[3].clone();
        let options = if kernel {
            kernel_options(true, stream)
        } else {
            options(true, stream)
        };
        let (result, calls) = kernel_fixture_run(&mut f, &options, |r| {
            r.capturing.set(true);
            r
        });
        let (call, status, message, buffer) = gpu_error(result);
        assert_eq!(
            (call, status, buffer),
            ("hipStreamIsCapturing", 900, None),
            "kernel {kernel}: {message}"
        );
        for part in [
            "hipStreamIsCapturing(stream 0xca971000)",
            "the stream is capturing a graph",
            "hipStreamSynchronize",
            "hipErrorStreamCaptureUnsupported (900)",
            "before anything was enqueued",
            "without MORI_SEND_SYNCHRONIZE",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(
            calls,
            [
                Call::DeviceCount,
                RELAXED,
                Call::IsCapturing(stream),
                RESTORED
            ],
            "kernel {kernel}: nothing enqueued, no wait"
        );
        assert_eq!(f.dst.ranks[3], initial, "kernel {kernel}: nothing written");

        // Without MORI_SEND_SYNCHRONIZE the capturing stream gets its (per-rect) copies.
        let (result, calls) = kernel_fixture_run(
            &mut f,
            &SendOptions {
                synchronize: false,
                ..options
            },
            |r| {
                r.capturing.set(true);
                r
            },
        );
        assert_eq!(result.unwrap().copies, 12, "kernel {kernel}");
        assert!(!names(&calls).contains(&"hipStreamSynchronize"));
        assert_eq!(f.dst.ranks[3], want, "kernel {kernel}");
    }
}

/// Making the stream's device current is not part of the load: when that hipSetDevice fails
/// (a transient failure), the next call switches and loads, where a failed load itself is
/// cached (a_failed_load_is_cached_and_reported_again_without_a_retry).
#[test]
fn a_failed_switch_to_the_streams_device_is_not_cached_as_a_failed_load() {
    if cpu_kernel_or_skip("a_failed_switch_to_the_streams_device_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    let stream = without_provenance_mut(0xde72_0000);
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(true, stream),
        stream_on_device_1,
        2,
        |i, r| {
            if i == 0 {
                r.fail_call.set(Some(("hipSetDevice", GpuStatus(2))));
            } else {
                r.fail_call.set(None);
                assert_eq!(
                    *r.current.borrow(),
                    0,
                    "the current device is left as it was"
                );
            }
        },
    );
    let (call, status, message, _) = gpu_error(runs[0].0.clone());
    assert_eq!((call, status), ("hipSetDevice", 2), "{message}");
    assert!(
        message.contains("hipSetDevice(1) returned hipErrorOutOfMemory (2)")
            && !message.contains("does not retry"),
        "{message}"
    );
    assert!(
        !names(&runs[0].1).contains(&"hipModuleLoadData"),
        "{:?}",
        runs[0].1
    );
    let (result, calls) = &runs[1];
    assert!(result.is_ok(), "the next call loads the kernel: {result:?}");
    let n = names(calls);
    assert!(
        n.contains(&"hipModuleLoadData") && n.contains(&"hipModuleLaunchKernel"),
        "{n:?}"
    );
    assert_ne!(initial, want);
    assert_eq!(f.dst.ranks[3], want);
}

#[test]
fn a_table_buffer_pair_is_reused_once_its_fence_on_the_relay_has_passed_without_a_wait() {
    if cpu_kernel_or_skip("a_table_buffer_pair_is_reused_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0x7ab1_0000);
    let runs = kernel_fixture_sends(&mut f, &kernel_options(false, stream), |r| r, 4, |_, _| {});
    let first = handed(&runs[0].1);
    for (i, (result, calls)) in runs.iter().enumerate().skip(1) {
        assert!(result.is_ok(), "send {i}: {result:?}");
        // Steady state: the reset check, the pair's fence asked about (passed), upload, launch,
        // the fence. No allocation, no free, no wait.
        let mut want_calls = vec![
            RELAXED,
            Call::IsCapturing(stream),
            Call::GetDevice,
            Call::StreamGetDevice(stream),
            Call::AddressRange {
                pointer: without_provenance_mut(first.sentinel),
            },
            Call::EventQuery {
                event: without_provenance_mut(first.done),
            },
        ];
        let upload = calls
            .iter()
            .position(|c| matches!(c, Call::MemcpyHostToDevice { .. }))
            .expect("an upload");
        assert_eq!(calls[..upload], want_calls, "send {i}");
        assert!(
            matches!(calls[upload], Call::MemcpyHostToDevice { dst, .. } if dst as usize == first.table)
        );
        assert!(matches!(calls[upload + 1], Call::Launch(_)));
        want_calls = fence_calls(stream, first.mark, first.relay, first.done).to_vec();
        want_calls.push(RESTORED);
        assert_eq!(calls[upload + 2..], want_calls, "send {i}");
    }
    assert_eq!(f.dst.ranks[3], want);
}

/// Issue 35.2: a stream that runs behind (blocked by a wait for a flag) never makes a call on
/// another stream wait: each stream's calls take pairs whose fences passed, and a stream's
/// fence (on its own relay) waits for that stream only.
#[test]
fn a_blocked_stream_never_makes_a_call_on_another_stream_wait() {
    if cpu_kernel_or_skip("a_blocked_stream_never_makes_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let (s, t) = (0x5000_0000usize, 0x7000_0000usize);
    // One send on S behind its wait, then many on T, then S runs again and sends.
    let mut sends = vec![kernel_options(false, without_provenance_mut(s))];
    sends.extend([kernel_options(false, without_provenance_mut(t)); 12]);
    sends.push(kernel_options(false, without_provenance_mut(s)));
    let last = sends.len() - 1;
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| r,
        |i, r| match i {
            0 => r.block_stream(s),
            i if i == last => r.release_stream(s),
            _ => {}
        },
    );
    let mut relays = HashSet::new();
    for (i, (result, calls)) in runs.iter().enumerate() {
        assert!(result.is_ok(), "send {i}: {result:?}");
        let n = names(calls);
        for never in ["hipEventSynchronize", "hipStreamSynchronize", "hipFree"] {
            assert!(!n.contains(&never), "send {i}: {n:?}");
        }
        for call in calls {
            if let Call::StreamWaitEvent { stream, .. } = call {
                relays.insert(*stream as usize);
            }
        }
        // T's calls share one pair (its fence passes at once); S's pair stays busy meanwhile.
        let pairs = calls
            .iter()
            .filter(|c| matches!(c, Call::HostMalloc { .. }))
            .count();
        assert_eq!(pairs, usize::from(i <= 1), "send {i}: {n:?}");
    }
    assert_eq!(relays.len(), 2, "a relay stream per caller's stream");
    assert_eq!(f.dst.ranks[3], want);
}

/// A device has at most MAX_LANES lanes (relay streams): a new stream takes over the least
/// recently used lane whose pairs are all idle, and gets the per-rect copies (no wait) while
/// every lane has copies in flight.
#[test]
fn a_new_stream_takes_over_an_idle_lane_or_gets_the_per_rect_copies() {
    if cpu_kernel_or_skip("a_new_stream_takes_over_an_idle_lane_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let stream = |n: usize| without_provenance_mut::<c_void>(0x6000_0000 + 0x1000 * n);
    let mut sends: Vec<SendOptions> = (0..MAX_LANES)
        .map(|n| kernel_options(false, stream(n)))
        .collect();
    let extra = kernel_options(false, stream(MAX_LANES));
    sends.extend([extra, extra]);
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| r,
        |i, r| {
            if i < MAX_LANES {
                r.block_stream(stream(i) as usize);
            }
            if i == MAX_LANES + 1 {
                r.release_stream(stream(3) as usize);
            }
        },
    );
    for (i, (result, _)) in runs.iter().enumerate() {
        assert!(result.is_ok(), "send {i}: {result:?}");
    }
    let relays: usize = runs
        .iter()
        .map(|(_, c)| {
            names(c)
                .iter()
                .filter(|n| **n == "hipStreamCreateWithFlags")
                .count()
        })
        .sum();
    assert_eq!(relays, MAX_LANES, "one relay per lane, never more");
    let busy = names(&runs[MAX_LANES].1);
    assert!(
        !busy.contains(&"hipModuleLaunchKernel") && !busy.contains(&"hipEventSynchronize"),
        "{busy:?}"
    );
    let took_over = &runs[MAX_LANES + 1].1;
    assert!(names(took_over).contains(&"hipModuleLaunchKernel"));
    let relay_of_3 = runs[3].1.iter().find_map(|c| match c {
        Call::StreamCreate { returned } => Some(*returned),
        _ => None,
    });
    assert!(
        took_over.iter().any(|c| matches!(c,
            Call::StreamWaitEvent { stream, .. } if Some(*stream as usize) == relay_of_3)),
        "stream 3's idle lane, taken over: {took_over:?}"
    );
    assert_eq!(f.dst.ranks[3], want);
}

/// Issue 45.1 (R1): the host runs at most MAX_TABLE_SLOTS uploaded-table kernel calls ahead of
/// the GPU on a device; past them a call never waits, not even for its own stream (whose progress
/// may hang on what the caller does next): it takes the per-rect copies, counted and logged, and
/// so does a call on another stream.
#[test]
fn past_every_pair_a_call_takes_the_per_rect_copies_without_a_wait() {
    if cpu_kernel_or_skip("past_every_pair_a_call_takes_...").is_none() {
        return;
    }
    let mut f = Fixture::uploaded();
    let (s, t) = (0x5100_0000usize, 0x7100_0000usize);
    let mut sends = vec![kernel_options(false, without_provenance_mut(s)); MAX_TABLE_SLOTS + 1];
    sends.push(kernel_options(false, without_provenance_mut(t)));
    let cache = std::cell::RefCell::new(None);
    let runs = fixture_sends_with(
        &mut f,
        &sends,
        |r| r,
        |i, r| {
            if i == 0 {
                r.block_stream(s);
                *cache.borrow_mut() = Some(r.cache.clone());
            }
        },
    );
    let allocations = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::HostMalloc { .. }))
            .count()
    };
    for (i, (result, calls)) in runs.iter().take(MAX_TABLE_SLOTS).enumerate() {
        assert!(result.is_ok(), "send {i}: {result:?}");
        assert_eq!(allocations(calls), 1, "send {i}: a pair of its own");
    }
    let copies = 4 * UPLOADED_PAGES;
    for (i, (result, calls)) in runs.iter().enumerate().skip(MAX_TABLE_SLOTS) {
        assert_eq!(
            result.as_ref().map(|r| r.copies),
            Ok(copies),
            "send {i}: {result:?}"
        );
        let n = names(calls);
        assert!(
            !n.contains(&"hipEventSynchronize") && !n.contains(&"hipModuleLaunchKernel"),
            "send {i}: {n:?}"
        );
        assert_eq!(
            n.iter().filter(|c| **c == "hipMemcpy2DAsync").count(),
            copies,
            "send {i}: {n:?}"
        );
        assert_eq!(
            allocations(calls),
            0,
            "send {i}: nothing allocated past the limit"
        );
        assert_eq!(
            calls.last(),
            Some(&RESTORED),
            "the caller's mode comes back"
        );
    }
    let counters = cache
        .borrow()
        .as_ref()
        .expect("the recorder's cache")
        .counters();
    assert_eq!(
        (
            counters.kernel_launches,
            counters.fallbacks,
            counters.fallbacks_busy
        ),
        (MAX_TABLE_SLOTS as u64, 2, 2),
        "{counters:?}"
    );
}

/// Issue 45.4 (R4): a pair whose fence failed leaves the ring (so it does not count against
/// MAX_TABLE_SLOTS), and comes back when the next call on the same stream is fenced: its event
/// is recorded on the relay behind that call's mark.
#[test]
fn a_pair_whose_fence_failed_comes_back_with_the_streams_next_fence() {
    if cpu_kernel_or_skip("a_pair_whose_fence_failed_...").is_none() {
        return;
    }
    let mut f = Fixture::uploaded();
    let stream = without_provenance_mut(0x6b0b_0000);
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, stream),
        |r| r,
        3,
        |i, r| {
            r.fail_call
                .set((i == 0).then_some(("hipStreamWaitEvent", GpuStatus(719))));
        },
    );
    let (call, status, message, _) = gpu_error(runs[0].0.clone());
    assert_eq!((call, status), ("hipStreamWaitEvent", 719), "{message}");
    let first = handed(&runs[0].1);
    // Send 1: the broken pair is out of the ring, so a new pair is made; after its fence the
    // broken pair's event is recorded on the relay, behind the mark.
    let (result, calls) = &runs[1];
    assert!(result.is_ok(), "{result:?}");
    let second = handed(calls);
    assert!(
        second.host != 0 && second.host != first.host,
        "a new pair: {calls:?}"
    );
    // The one event this send makes is its new pair's (handed() reads it as a mark).
    let mut fence = fence_calls(stream, first.mark, first.relay, second.mark).to_vec();
    fence.push(Call::EventRecord {
        event: without_provenance_mut(first.done),
        stream: without_provenance_mut(first.relay),
    });
    fence.push(RESTORED);
    assert_eq!(calls[calls.len() - fence.len()..], fence[..], "{calls:?}");
    // Send 2: both pairs are idle, nothing is allocated.
    let (result, calls) = &runs[2];
    assert!(result.is_ok(), "{result:?}");
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c, Call::HostMalloc { .. } | Call::Malloc { .. })),
        "{calls:?}"
    );
}

/// Issue 35.2 (growth): a table that outgrows every idle pair gets a new, bigger pair; nothing is
/// freed (hipFree waits for every stream of the device, here one that is blocked), nothing
/// waited for. At the device's limit of pairs, the smallest idle pair is replaced and kept as a
/// spare, still without a free.
#[test]
fn a_table_that_outgrows_every_pair_gets_a_bigger_one_and_nothing_is_freed() {
    if cpu_kernel_or_skip("a_table_that_outgrows_...").is_none() {
        return;
    }
    // One 16-byte head, TP 1 -> 1, page size 1: a page of every other slot is one rect, so
    // 9000 pages make a table of 16 bytes of bases, one 48-byte run and 9000 8-byte rect
    // entries (72064 bytes), past the first pair's 65536 bytes. 600 pages (4864 bytes) are
    // past the kernel's argument too, but within that first pair.
    let config = slice_config(&SliceParams {
        prefill_tp_size: 1,
        prefill_tp_rank: 0,
        decode_tp_size: 1,
        decode_tp_rank: 0,
        total_kv_heads: 1,
        page_size: 1,
        src_item_len: 16,
        dst_item_len: 16,
    })
    .unwrap();
    let pages = |n: i32| -> Vec<i32> { (0..n).map(|i| 2 * i).collect() };
    let (small, big) = (pages(600), pages(9000));
    let bigger = (16 + 48 + 8 * 9000usize).next_power_of_two();
    let src: Vec<u8> = (0..34_000 * 16).map(|i| i as u8).collect();
    let mut dst = vec![0u8; 34_000 * 16];
    let (src_ptr, dst_ptr) = (src.as_ptr(), dst.as_mut_ptr());
    let runtime = Recorder::new(&[&src], &mut [&mut dst]);
    // Someone else's stream, blocked for the whole test.
    runtime.block_stream(0x0b10_c000);
    let mut engine = GpuEngine::new(runtime, &kernel_options(false, null_mut())).expect("a device");
    let send_pages = |engine: &mut GpuEngine<Recorder>, pages: &[i32]| {
        let plan = SlicePlan::new(&config, pages, pages).unwrap();
        let buffers = KvBuffers {
            src: &[src_ptr],
            dst: &[dst_ptr],
            src_capacity: 34_000 * 16,
            dst_capacity: 34_000 * 16,
        };
        let from = engine.runtime().calls.borrow().len();
        // SAFETY: live buffers of the stated capacities; the recorder checks every row.
        unsafe { send(&plan, &buffers, engine) }.expect("send");
        engine.runtime().calls.borrow()[from..].to_vec()
    };
    for _ in 0..4 {
        send_pages(&mut engine, &small);
    }
    let grown = send_pages(&mut engine, &big);
    let made: Vec<Call> = grown
        .iter()
        .copied()
        .filter(|c| matches!(c, Call::Malloc { .. } | Call::HostMalloc { .. }))
        .collect();
    let new = handed(&grown);
    assert_eq!(
        made,
        [
            Call::Malloc {
                size: bigger,
                returned: new.table
            },
            Call::HostMalloc {
                size: bigger,
                returned: new.host
            },
        ],
        "{grown:?}"
    );
    for never in ["hipFree", "hipEventSynchronize", "hipStreamSynchronize"] {
        assert!(!names(&grown).contains(&never), "{grown:?}");
    }
    // The small pair is still there and still taken for small tables: no allocation.
    let again = send_pages(&mut engine, &small);
    assert!(!names(&again).contains(&"hipMalloc"), "{again:?}");
    // Fill the device's pairs: small calls on a stream that does not run meanwhile.
    let behind = without_provenance_mut(0x5eed_5000);
    engine.set_options(&kernel_options(false, behind));
    engine.runtime().block_stream(behind as usize);
    for _ in 0..MAX_TABLE_SLOTS {
        send_pages(&mut engine, &small);
    }
    engine.runtime().release_stream(behind as usize);
    let (device, host) = engine.runtime().live_allocations();
    assert_eq!(
        (device, host),
        (MAX_TABLE_SLOTS + 1, MAX_TABLE_SLOTS),
        "every pair made, and the reset sentinel"
    );
    // A table bigger than any pair (17000 rects: 136064 bytes): the smallest idle pair is
    // replaced, and kept.
    let huge = pages(17_000);
    let replaced = send_pages(&mut engine, &huge);
    for never in ["hipFree", "hipEventSynchronize"] {
        assert!(!names(&replaced).contains(&never), "{replaced:?}");
    }
    assert!(names(&replaced).contains(&"hipMalloc"), "{replaced:?}");
    assert_eq!(
        engine.runtime().live_allocations(),
        (MAX_TABLE_SLOTS + 2, MAX_TABLE_SLOTS + 1),
        "the replaced pair stays allocated, as a spare"
    );
    for (i, byte) in dst.iter().enumerate() {
        let (page, at) = (i / 16, i % 16);
        let want = if page % 2 == 0 && page < 34_000 {
            src[i]
        } else {
            0
        };
        assert_eq!(*byte, want, "byte {at} of page {page}");
    }
}

#[test]
fn a_refusing_allocator_is_a_gpu_error_naming_hip_malloc_that_writes_nothing() {
    if cpu_kernel_or_skip("a_refusing_allocator_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(true, null_mut()), |r| {
        r.fail_call.set(Some(("hipMalloc", GpuStatus(2))));
        r
    });
    let (call, status, message, _) = gpu_error(result);
    assert_eq!((call, status), ("hipMalloc", 2));
    assert!(
        message.contains(
            "hipMalloc(4288 bytes for the copy kernel's reset check on device 0) returned \
             hipErrorOutOfMemory (2)"
        ),
        "{message}"
    );
    assert!(!names(&calls).contains(&"hipModuleLaunchKernel"));
    assert_eq!(f.dst.ranks[3], initial);
}

#[test]
fn memory_the_kernel_cannot_reach_is_refused_before_anything_is_allocated() {
    if cpu_kernel_or_skip("memory_the_kernel_cannot_reach_...").is_none() {
        return;
    }
    // Pageable host memory (unknown to the runtime), and host memory registered with
    // hipHostRegister passed by its host address while devices see it elsewhere.
    for pageable in [true, false] {
        let mut f = Fixture::new();
        let initial = f.dst.ranks[3].clone();
        let target = f.dst.ranks[3][2].as_ptr() as usize;
        let len = f.dst.ranks[3][2].len();
        let (result, calls) =
            kernel_fixture_run(&mut f, &kernel_options(false, null_mut()), |mut r| {
                r.device_memory.retain(|&(base, _)| base != target);
                if !pageable {
                    r.registered.push(((target, len), 0x7000_0000_0000));
                }
                r
            });
        let (call, status, message, buffer) = gpu_error(result);
        assert_eq!(
            (call, status, buffer),
            ("hipPointerGetAttributes", 1, Some(2))
        );
        let says = if pageable {
            "(destination buffer 2, "
        } else {
            "which devices address at 0x700000000000"
        };
        assert!(
            message.contains(says) && message.contains("without MORI_SEND_COPY_KERNEL"),
            "{message}"
        );
        // Only the reset sentinel, made with the kernel's load: no table buffer, no launch.
        let n = names(&calls);
        assert!(
            calls
                .iter()
                .all(|c| !matches!(c, Call::Malloc { size, .. } if *size != RESET_SENTINEL_BYTES))
                && !n.contains(&"hipHostMalloc")
                && !n.contains(&"hipModuleLaunchKernel"),
            "{n:?}"
        );
        assert_eq!(f.dst.ranks[3], initial);
    }
}

#[test]
fn each_buffer_base_is_checked_once() {
    if cpu_kernel_or_skip("each_buffer_base_is_checked_once").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, null_mut()),
        |r| r,
        2,
        |_, _| {},
    );
    let checks = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::PointerInfo { .. }))
            .count()
    };
    // Four buffer pairs: eight bases, then none (the reset check asks hipMemGetAddressRange).
    assert_eq!((checks(&runs[0].1), checks(&runs[1].1)), (8, 0));
}

/// Issue 45.3 (R3): a remembered base is classified again once its allocation's identity
/// (HIP_POINTER_ATTRIBUTE_BUFFER_ID) changed: the address was freed and reused.
#[test]
fn a_base_whose_allocation_changed_is_checked_again() {
    if cpu_kernel_or_skip("a_base_whose_allocation_changed_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(false, null_mut()),
        |r| r,
        3,
        |i, r| {
            if i == 2 {
                r.memory_generation.set(1);
            }
        },
    );
    let checks = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::PointerInfo { .. }))
            .count()
    };
    let counts: Vec<usize> = runs.iter().map(|(_, calls)| checks(calls)).collect();
    assert_eq!(counts, [8, 0, 8]);
}

#[test]
fn after_a_device_reset_the_kernel_is_loaded_again() {
    if cpu_kernel_or_skip("after_a_device_reset_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(true, null_mut()),
        |r| r,
        2,
        |i, r| {
            if i == 1 {
                r.reset_device(0);
            }
        },
    );
    for (result, _) in &runs {
        assert!(result.is_ok(), "{result:?}");
    }
    let second = names(&runs[1].1);
    assert!(
        second.contains(&"hipModuleLoadData") && second.contains(&"hipMalloc"),
        "{second:?}"
    );
    let launch = runs[1].1.iter().find_map(|c| match c {
        Call::Launch(l) => Some(l.function),
        _ => None,
    });
    assert_eq!(
        launch,
        Some(function_handle(1)),
        "the new module's function"
    );
    assert_eq!(f.dst.ranks[3], want);
    assert_eq!(INVALID_RESOURCE_HANDLE, GpuStatus(400));
}

#[test]
fn after_a_device_reset_an_allocation_at_the_old_sentinels_address_is_left_alone() {
    if cpu_kernel_or_skip("after_a_device_reset_an_allocation_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host_of(Fixture::uploaded());
    let mut f = Fixture::uploaded();
    let reused = std::cell::Cell::new(0usize);
    // Between the two sends the device is reset and the caller's next allocation (64 KiB, a
    // size callers ask for) gets the address of the kernel's reset sentinel.
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(true, null_mut()),
        |r| r,
        2,
        |i, r| {
            if i == 1 {
                reused.set(r.reset_device_and_reuse_address(0, MIN_TABLE_BYTES));
            }
        },
    );
    for (result, _) in &runs {
        assert!(result.is_ok(), "{result:?}");
    }
    let (first, second) = (&runs[0].1, &runs[1].1);
    assert_eq!(handed(first).sentinel, reused.get());
    // The second send sees an allocation of another size there: it loads the kernel again and
    // uploads its table into a new buffer, never into the caller's memory.
    let n = names(second);
    assert!(
        n.contains(&"hipModuleLoadData") && n.contains(&"hipMalloc"),
        "{n:?}"
    );
    let uploads: Vec<usize> = second
        .iter()
        .filter_map(|c| match c {
            Call::MemcpyHostToDevice { dst, .. } => Some(*dst as usize),
            _ => None,
        })
        .collect();
    assert_eq!(uploads, [handed(second).table]);
    assert_ne!(uploads[0], reused.get());
    assert_eq!(f.dst.ranks[3], want);
}

/// Issue 35.3: the reset check does not depend on a table buffer: after a first call that was
/// refused before any was made (pageable memory), a hipDeviceReset is still noticed, and the next
/// call loads the kernel again instead of launching the dead module's function.
#[test]
fn a_reset_after_a_call_that_made_no_table_buffer_is_noticed() {
    if cpu_kernel_or_skip("a_reset_after_a_call_that_made_no_table_buffer_...").is_none() {
        return;
    }
    let want = fixture_sent_by_host();
    let mut f = Fixture::new();
    let runs = kernel_fixture_sends(
        &mut f,
        &kernel_options(true, null_mut()),
        |r| r,
        2,
        |i, r| {
            if i == 0 {
                // The runtime does not know the first buffer: refused before any table buffer.
                r.fail_call
                    .set(Some(("hipPointerGetAttributes", GpuStatus(1))));
            } else {
                r.fail_call.set(None);
                assert_eq!(r.live_allocations(), (1, 0), "only the sentinel");
                r.reset_device(0);
            }
        },
    );
    let (call, _, message, _) = gpu_error(runs[0].0.clone());
    assert_eq!(call, "hipPointerGetAttributes", "{message}");
    assert!(runs[1].0.is_ok(), "{:?}", runs[1].0);
    let second = &runs[1].1;
    assert!(names(second).contains(&"hipModuleLoadData"), "{second:?}");
    let launch = second.iter().find_map(|c| match c {
        Call::Launch(l) => Some(l.function),
        _ => None,
    });
    assert_eq!(
        launch,
        Some(function_handle(1)),
        "the new module's function"
    );
    assert_eq!(f.dst.ranks[3], want);
}

#[test]
fn one_row_rects_keep_every_lane_of_the_kernel_busy() {
    let Some(kernel) = cpu_kernel_or_skip("one_row_rects_keep_every_lane_...") else {
        return;
    };
    // Page size 1 and runs of one page: every rect is one 256-byte row, the shape that left 15
    // of 16 lane groups idle when each rect was copied on its own.
    let request = Request {
        src_pages: (0..64).map(|i| 2 * i).collect(),
        dst_pages: (0..64).map(|i| 3 * i + 1).collect(),
        src_capacity_pages: 128,
        dst_capacity_pages: 192,
    };
    let mut utilisation = Vec::new();
    let mut sender = checked_kernel_sender();
    let mut measuring =
        |plan: &SlicePlan<'_>, request: &Request, src: &[&[u8]], dst: &mut [&mut [u8]]| {
            let report = sender(plan, request, src, dst);
            if plan.sends() {
                assert_eq!(plan.num_rects(), 64, "one rect per page");
                let (slots, active) = kernel.lanes();
                utilisation.push(active as f64 / slots as f64);
            }
            report
        };
    transfer(8, 256, 1, 2, 8, 1, &request, &mut measuring);
    assert!(!utilisation.is_empty());
    for u in &utilisation {
        assert!(*u >= 0.999, "active-lane utilisation {u}: {utilisation:?}");
    }
}

/// A recorder with a device and no buffers: for the staging pool's device memory.
fn pool_recorder() -> Recorder {
    Recorder::new(&[], &mut [])
}

#[test]
fn a_device_pool_is_one_hipmalloc_for_its_life_and_one_hipfree_at_the_end() {
    let recorder = pool_recorder();
    let calls = Rc::clone(&recorder.calls);
    let memory = DeviceMemory::new(recorder, 1 << 20).expect("the recorder has a device");
    let base = memory.base() as usize;
    let pool = StagingPool::new(memory, 4096).unwrap();
    let info = pool.info();
    assert_eq!(info.memory.kind, PoolMemoryKind::Device);
    assert_eq!((info.base as usize, info.capacity), (base, 1 << 20));
    let a = pool.try_alloc(10_000).unwrap();
    let b = pool.try_alloc(4096).unwrap();
    for slot in [a, b] {
        assert_eq!(slot.address as usize, base + slot.offset as usize);
        assert!(slot.offset + slot.size <= 1 << 20);
    }
    pool.free(a.offset).unwrap();
    pool.free(b.offset).unwrap();
    // In the relaxed capture mode: the allocation (a size no caller asks for) and its size read
    // back.
    let at = without_provenance_mut(base);
    let made = [
        Call::DeviceCount,
        RELAXED,
        Call::Malloc {
            size: (1 << 20) + POOL_TAIL_BYTES as usize,
            returned: base,
        },
        Call::AddressRange { pointer: at },
        RESTORED,
    ];
    // Slots are carved on the host, without runtime calls.
    assert_eq!(*calls.borrow(), made);
    drop(pool);
    let freed = [
        RELAXED,
        Call::AddressRange { pointer: at },
        Call::Free { pointer: at },
        RESTORED,
    ];
    assert_eq!(calls.borrow()[made.len()..], freed);
}

/// Issue 35.3: after a hipDeviceReset has freed the pool's memory, dropping the pool frees
/// nothing: not the address the runtime no longer knows, nor a caller's allocation that took the
/// address since (a size callers ask for).
#[test]
fn a_device_pool_dropped_after_a_reset_frees_nothing() {
    for reuse in [false, true] {
        let memory = DeviceMemory::new(pool_recorder(), 1 << 16).expect("a device");
        let calls = Rc::clone(&memory.runtime().calls);
        if reuse {
            memory.runtime().reset_device_and_reuse_address(0, 1 << 16);
        } else {
            memory.runtime().reset_device(0);
        }
        let before = calls.borrow().len();
        drop(memory);
        let after = calls.borrow()[before..].to_vec();
        assert!(
            !names(&after).contains(&"hipFree"),
            "reuse {reuse}: {after:?}"
        );
        assert_eq!(after.last(), Some(&RESTORED));
    }
}

#[test]
fn a_failing_hipmalloc_is_a_gpu_error_naming_the_size_and_status() {
    let recorder = pool_recorder();
    recorder.fail_call.set(Some(("hipMalloc", GpuStatus(2))));
    let error = DeviceMemory::new(recorder, 1 << 30).unwrap_err();
    let Error::Gpu {
        call,
        status,
        message,
        buffer: None,
        rect: None,
    } = &error
    else {
        panic!("{error}");
    };
    assert_eq!((*call, *status), ("hipMalloc", 2));
    assert!(
        message.contains(
            "hipMalloc(1073741824 bytes) returned hipErrorOutOfMemory (2) for a staging pool"
        ),
        "{message}"
    );
}

#[test]
fn a_device_pool_without_a_device_is_backend_unavailable() {
    let mut recorder = pool_recorder();
    recorder.devices = Ok(0);
    let error = DeviceMemory::new(recorder, 4096).unwrap_err();
    assert!(matches!(error, Error::BackendUnavailable { .. }), "{error}");
}

// ---- a request of several groups --------------------------------------------------------------

/// Three groups of one pair (8 KV heads, TP 2 rank 0 -> TP 4 rank 1: heads 2 and 3): HND KV
/// pages, a per-token record (H = 1: prefill rank 0 sends it to decode ranks 0 and 1), and a
/// group whose prefill rank holds nothing of the decode rank's (4 heads, TP 2 rank 1 -> TP 4
/// rank 1: NOT_PAIRED). Each group has two buffers of its own.
struct HipGroups {
    configs: Vec<mori_tp::PairConfig>,
    pages: Vec<(Vec<i32>, Vec<i32>, u64)>,
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
}

fn hip_groups() -> HipGroups {
    use mori_tp::{Layout, pair_config};
    let kv = pair_config(
        &Layout::hnd(8, 2, 0, 4, 16).unwrap(),
        &Layout::hnd(8, 4, 1, 8, 16).unwrap(),
    )
    .unwrap();
    let record = pair_config(
        &Layout::nhd(1, 2, 0, 4, 12).unwrap(),
        &Layout::nhd(1, 4, 1, 4, 12).unwrap(),
    )
    .unwrap();
    let none = pair_config(
        &Layout::nhd(4, 2, 1, 4, 8).unwrap(),
        &Layout::nhd(4, 4, 1, 4, 8).unwrap(),
    )
    .unwrap();
    assert_eq!(none.action(), mori_tp::Action::NotPaired);
    let fill = |seed: u64| {
        (0..2048)
            .map(|i| (i as u64 * 31 + seed) as u8)
            .collect::<Vec<u8>>()
    };
    HipGroups {
        configs: vec![kv, record, none],
        pages: vec![
            (vec![3, 0, 1], vec![1, 0], 10),
            (vec![2, 0, 1], vec![0, 3, 2], 10),
            (vec![0], vec![1], 3),
        ],
        src: (0..6).map(fill).collect(),
        dst: (0..6).map(|b| fill(100 + b)).collect(),
    }
}

/// The Rust groups of `h`, group `g` on buffers 2g and 2g + 1.
fn rust_groups<'a>(
    h: &'a HipGroups,
    src: &'a [*const u8],
    dst: &'a [*mut u8],
) -> Vec<mori_tp::Group<'a>> {
    (0..3)
        .map(|g| {
            let (s, d, tokens) = &h.pages[g];
            let mut group = mori_tp::Group::new(
                &h.configs[g],
                mori_tp::Request {
                    src_pages: s,
                    dst_pages: d,
                    num_tokens: *tokens,
                },
                2,
            );
            group.staging = mori_tp::Staging::None;
            group.buffers.src = &src[2 * g..2 * g + 2];
            group.buffers.dst = &dst[2 * g..2 * g + 2];
            group.buffers.src_capacity = 2048;
            group.buffers.dst_capacity = 2048;
            group
        })
        .collect()
}

#[test]
fn a_request_of_groups_runs_one_kernel_launch_per_group_that_moves_bytes() {
    if cpu_kernel_or_skip("a_request_of_groups_runs_one_kernel_launch_per_group").is_none() {
        return;
    }
    let h = hip_groups();
    let src_ptrs: Vec<*const u8> = h.src.iter().map(|b| b.as_ptr()).collect();
    // What the host engine leaves.
    let mut want = h.dst.clone();
    let want_ptrs: Vec<*mut u8> = want.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let groups = rust_groups(&h, &src_ptrs, &want_ptrs);
    let plan = mori_tp::GroupsPlan::new(&groups).unwrap();
    // SAFETY: live vectors of 2048 bytes, the capacity stated.
    unsafe { mori_tp::send_groups(&plan, &mut mori_tp::HostEngine::default()) }.unwrap();
    let mut dst = h.dst.clone();
    let srcs: Vec<&[u8]> = h.src.iter().map(Vec::as_slice).collect();
    let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
    let runtime = Recorder::new(&srcs, &mut dsts);
    let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let groups = rust_groups(&h, &src_ptrs, &dst_ptrs);
    let plan = mori_tp::GroupsPlan::new(&groups).unwrap();
    let options = kernel_options(true, null_mut());
    // SAFETY: as above; the recorder refuses any row outside the buffers.
    let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
        mori_tp::send_groups(&plan, engine)
    });
    result.unwrap();
    assert_eq!(
        dst, want,
        "the kernel's bytes differ from the host engine's"
    );
    let names = names(&calls);
    // Two groups move bytes, each one launch; the group that is not paired issues nothing.
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "hipModuleLaunchKernel")
            .count(),
        2,
        "{names:?}"
    );
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "hipStreamSynchronize")
            .count(),
        2,
        "{names:?}"
    );
}

// ---- any page layout (REFERENCE.md section 11) through both HIP paths ---------------------------

/// A pair of layouts (REFERENCE.md section 11) and a request over them, with the pages each
/// side's buffers hold.
struct LayoutCase {
    name: &'static str,
    src: mori_tp::Layout,
    dst: mori_tp::Layout,
    tokens: u64,
    /// Pages each buffer holds on the prefill and the decode side.
    capacity_pages: [i32; 2],
}

/// A prefill layout whose heads hold their own runs of `pages` pages (vLLM's LHBNC): token-major
/// within a page, each local head `pages` pages further on.
fn heads_outside_pages(
    h: u32,
    tp: u32,
    rank: u32,
    ps: u32,
    hb: u64,
    pages: u64,
) -> mori_tp::Layout {
    let page_stride = u64::from(ps) * hb;
    mori_tp::Layout {
        token_stride: hb,
        page_stride,
        head_stride: pages * page_stride,
        ..mori_tp::Layout::nhd(h, tp, rank, ps, hb).unwrap()
    }
}

/// `layout` with its slots `offset` bytes into each page and `pad` spare bytes after them.
fn padded(layout: mori_tp::Layout, offset: u64, pad: u64) -> mori_tp::Layout {
    mori_tp::Layout {
        offset,
        page_stride: layout.page_stride + offset + pad,
        ..layout
    }
}

/// Head-major, token-major, mixed, page sizes that differ, partial last pages, padded and
/// offset pages, heads outside pages, odd head widths, and a pair that does not send.
fn layout_cases() -> Vec<LayoutCase> {
    use mori_tp::Layout;
    vec![
        LayoutCase {
            name: "HND TP 2 -> 8, pages of 16, a partial last page",
            src: Layout::hnd(8, 2, 0, 16, 32).unwrap(),
            dst: Layout::hnd(8, 8, 1, 16, 32).unwrap(),
            tokens: 40,
            capacity_pages: [7, 6],
        },
        LayoutCase {
            name: "NHD TP 2 -> HND TP 4, pages of 16 -> 64, a partial last page",
            src: Layout::nhd(8, 2, 1, 16, 32).unwrap(),
            dst: Layout::hnd(8, 4, 2, 64, 32).unwrap(),
            tokens: 173,
            capacity_pages: [14, 5],
        },
        LayoutCase {
            name: "HND TP 8 -> NHD TP 2, pages of 64 -> 16, 24-byte heads",
            src: Layout::hnd(8, 8, 3, 64, 24).unwrap(),
            dst: Layout::nhd(8, 2, 0, 16, 24).unwrap(),
            tokens: 100,
            capacity_pages: [4, 9],
        },
        LayoutCase {
            name: "padded, offset NHD -> padded, offset HND, TP 4 -> 4",
            src: padded(Layout::nhd(8, 4, 1, 16, 32).unwrap(), 48, 80),
            dst: padded(Layout::hnd(8, 4, 1, 16, 32).unwrap(), 16, 8),
            tokens: 50,
            capacity_pages: [6, 6],
        },
        LayoutCase {
            name: "heads outside pages TP 2 -> NHD TP 4",
            src: heads_outside_pages(8, 2, 0, 16, 32, 8),
            dst: Layout::nhd(8, 4, 1, 16, 32).unwrap(),
            tokens: 70,
            capacity_pages: [8, 8],
        },
        LayoutCase {
            name: "a pair that shares no head",
            src: Layout::hnd(8, 8, 0, 16, 32).unwrap(),
            dst: Layout::hnd(8, 8, 1, 16, 32).unwrap(),
            tokens: 40,
            capacity_pages: [4, 4],
        },
    ]
}

/// `count` distinct pages below `capacity`: a rotation of 0..capacity, so runs of consecutive
/// pages with a break where the rotation wraps.
fn rotated_pages(count: u64, capacity: i32) -> Vec<i32> {
    let mut pages: Vec<i32> = (0..capacity).collect();
    pages.rotate_left(capacity as usize / 3);
    pages.truncate(count as usize);
    pages
}

/// Bytes a buffer of `pages` pages of `layout` needs (every element of every page inside).
fn layout_capacity(layout: &mori_tp::Layout, pages: i32) -> usize {
    let local = if layout.tp_size <= layout.total_kv_heads {
        layout.total_kv_heads / layout.tp_size
    } else {
        1
    };
    let pages_end = pages as u64 * layout.page_stride;
    let heads_end = layout.offset + u64::from(local) * layout.head_stride;
    pages_end.max(heads_end) as usize
}

fn patterned(len: usize, salt: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(salt * 97) as u8
                ^ 0x3c
        })
        .collect()
}

#[test]
fn any_page_layout_lands_byte_exact_through_both_hip_paths_with_the_planned_calls() {
    let kernel = cpu_kernel_or_skip("any_page_layout_..._through_both_hip_paths").is_some();
    const BUFFERS: usize = 3;
    for case in layout_cases() {
        let config = mori_tp::pair_config(&case.src, &case.dst).unwrap();
        let src_pages = rotated_pages(
            case.tokens.div_ceil(u64::from(case.src.page_size)),
            case.capacity_pages[0],
        );
        let dst_pages = rotated_pages(
            case.tokens.div_ceil(u64::from(case.dst.page_size)),
            case.capacity_pages[1],
        );
        let request = mori_tp::Request {
            src_pages: &src_pages,
            dst_pages: &dst_pages,
            num_tokens: case.tokens,
        };
        let src_len = layout_capacity(&case.src, case.capacity_pages[0]);
        let dst_len = layout_capacity(&case.dst, case.capacity_pages[1]);
        let src: Vec<Vec<u8>> = (0..BUFFERS).map(|b| patterned(src_len, b as u64)).collect();
        let initial: Vec<Vec<u8>> = (0..BUFFERS)
            .map(|b| patterned(dst_len, 100 + b as u64))
            .collect();
        let src_slices: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
        let plan = mori_tp::PairPlan::transfer(&config, &request, mori_tp::Staging::None).unwrap();

        // The host engine's bytes are the reference (tests/layouts.rs checks them against an
        // element-by-element oracle).
        let mut want = initial.clone();
        let mut want_slices: Vec<&mut [u8]> = want.iter_mut().map(Vec::as_mut_slice).collect();
        mori_tp::send_host(&plan, &src_slices, &mut want_slices).unwrap();
        assert_eq!(
            want != initial,
            config.sends(),
            "{}: the host send moves bytes exactly when the pair sends",
            case.name
        );

        for (i, synchronize) in [false, true].into_iter().enumerate() {
            let stream = stream_for_send(i + 1);
            // Per rect: one hipMemcpy2DAsync per (buffer, rect of the pair plan).
            let mut got = initial.clone();
            let mut got_slices: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            let options = options(synchronize, stream);
            let expected = expected_calls(&plan, &src_slices, &mut got_slices, &options);
            let runtime = Recorder::new(&src_slices, &mut got_slices);
            let (result, calls) = hip_send(&plan, &src_slices, &mut got_slices, runtime, &options);
            result.unwrap_or_else(|e| panic!("{}: per-rect send: {e}", case.name));
            assert_eq!(calls, expected, "{}: per-rect HIP calls", case.name);
            assert!(
                got == want,
                "{}: per-rect bytes differ from the host's",
                case.name
            );
            if !kernel {
                continue;
            }
            // The copy kernel: one launch for every buffer and rect.
            let mut got = initial.clone();
            let mut got_slices: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
            let dst_ptrs: Vec<*mut u8> = got_slices.iter_mut().map(|b| b.as_mut_ptr()).collect();
            let buffers = KvBuffers {
                src: &src_ptrs,
                dst: &dst_ptrs,
                src_capacity: src_len as u64,
                dst_capacity: dst_len as u64,
            };
            let options = kernel_options(synchronize, stream);
            let runtime = Recorder::new(&src_slices, &mut got_slices);
            // SAFETY: live buffers of the stated capacities; the recorder checks every row.
            let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
                send(&plan, &buffers, engine)
            });
            result.unwrap_or_else(|e| panic!("{}: kernel send: {e}", case.name));
            let expected =
                expected_kernel_calls(&plan, &src_ptrs, &dst_ptrs, &options, handed(&calls));
            assert_eq!(calls, expected, "{}: kernel HIP calls", case.name);
            assert!(
                got == want,
                "{}: kernel bytes differ from the host's",
                case.name
            );
        }
        layout_pack_unpack_through_hip(&case, &config, &request, &src, &initial, false);
        if kernel {
            layout_pack_unpack_through_hip(&case, &config, &request, &src, &initial, true);
        }
    }
}

/// Pack (SRC, BOTH) and unpack (DST, BOTH) of one layout case through the HIP engine, per rect
/// (`kernel` false: one hipMemcpy2DAsync per (buffer, rect), every call checked) or through the
/// kernel (one launch), against the host engine's region and pages.
fn layout_pack_unpack_through_hip(
    case: &LayoutCase,
    config: &mori_tp::PairConfig,
    request: &mori_tp::Request<'_>,
    src: &[Vec<u8>],
    initial: &[Vec<u8>],
    kernel: bool,
) {
    let path = if kernel { "kernel" } else { "per-rect" };
    let staging_len = config.staging_len(request.num_tokens).unwrap() as usize;
    let region_len = staging_len * src.len();
    let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
    let src_slices: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
    let src_capacity = src[0].len() as u64;
    let stream = without_provenance_mut(0x1a70_0000);
    let options = if kernel {
        kernel_options(true, stream)
    } else {
        options(true, stream)
    };
    let launches = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::Launch(_)))
            .count()
    };
    // The region's buffer bases, as the pack writes and the unpack reads them.
    let bases = |region: *mut u8| -> Vec<*mut u8> {
        (0..src.len())
            .map(|b| region.wrapping_add(b * staging_len))
            .collect()
    };
    // Per rect: exactly the plan's copies; through the kernel: one launch when bytes move.
    let check_calls =
        |what: &str, plan: &Walk<'_>, from: &[*const u8], to: &[*mut u8], calls: &[Call]| {
            if kernel {
                assert_eq!(
                    launches(calls),
                    usize::from(staging_len > 0),
                    "{}: {what}: {calls:?}",
                    case.name
                );
            } else {
                let expected = expected_rect_calls(plan, from, to, &options);
                assert_eq!(
                    calls,
                    &expected[..],
                    "{}: {what}: per-rect calls",
                    case.name
                );
                assert_eq!(
                    expected.len() > 3,
                    staging_len > 0,
                    "{}: {what}: copies exactly when bytes move",
                    case.name
                );
            }
        };
    for mode in [mori_tp::Staging::Src, mori_tp::Staging::Both] {
        let plan = mori_tp::PairPlan::pack(config, mode, request).unwrap();
        let mut want = vec![0x5au8; region_len.max(1)];
        let mut host = mori_tp::HostEngine::default();
        // SAFETY: live buffers of the stated capacities.
        unsafe {
            mori_tp::pack_into(
                &plan,
                &src_ptrs,
                src_capacity,
                want.as_mut_ptr(),
                region_len as u64,
                &mut host,
            )
        }
        .unwrap();
        let mut got = vec![0x5au8; region_len.max(1)];
        let got_ptr = got.as_mut_ptr();
        let runtime = Recorder::new(&src_slices, &mut [got.as_mut_slice()]);
        // SAFETY: as above; the recorder checks every row the copies or the kernel touch.
        let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
            mori_tp::pack_into(
                &plan,
                &src_ptrs,
                src_capacity,
                got_ptr,
                region_len as u64,
                engine,
            )
        });
        result.unwrap_or_else(|e| panic!("{}: {path} pack {mode:?}: {e}", case.name));
        assert!(
            got == want,
            "{}: packed region ({path}, {mode:?}) differs from the host's",
            case.name
        );
        check_calls(
            &format!("pack {mode:?}"),
            &plan,
            &src_ptrs,
            &bases(got_ptr),
            &calls,
        );
    }
    // A region as the transport would have left it, unpacked onto the decode pages.
    let mut region = patterned(region_len.max(1), 7);
    let region_bases: Vec<*const u8> = bases(region.as_mut_ptr())
        .into_iter()
        .map(|b| b.cast_const())
        .collect();
    for mode in [mori_tp::Staging::Dst, mori_tp::Staging::Both] {
        let plan = mori_tp::PairPlan::unpack(config, mode, request).unwrap();
        let mut want = initial.to_vec();
        let want_ptrs: Vec<*mut u8> = want.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let dst_capacity = initial[0].len() as u64;
        let mut host = mori_tp::HostEngine::default();
        // SAFETY: live buffers of the stated capacities.
        unsafe {
            mori_tp::unpack_from(
                &plan,
                region.as_ptr(),
                region_len as u64,
                &want_ptrs,
                dst_capacity,
                &mut host,
            )
        }
        .unwrap();
        let mut got = initial.to_vec();
        let mut got_slices: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
        let got_ptrs: Vec<*mut u8> = got_slices.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let runtime = Recorder::new(&[region.as_slice()], &mut got_slices);
        // SAFETY: as above.
        let (result, calls) = kernel_run(runtime, &options, |engine| unsafe {
            mori_tp::unpack_from(
                &plan,
                region.as_ptr(),
                region_len as u64,
                &got_ptrs,
                dst_capacity,
                engine,
            )
        });
        result.unwrap_or_else(|e| panic!("{}: {path} unpack {mode:?}: {e}", case.name));
        assert!(
            got == want,
            "{}: unpacked pages ({path}, {mode:?}) differ from the host's",
            case.name
        );
        assert_eq!(
            want != initial,
            config.sends(),
            "{}: unpack {mode:?} moves bytes",
            case.name
        );
        check_calls(
            &format!("unpack {mode:?}"),
            &plan,
            &region_bases,
            &got_ptrs,
            &calls,
        );
    }
}

/// The SM budget and the persistent grid: every launch stays within the smaller of the caller's
/// budget (1, a few blocks, more than the device runs at once, none) and the device's resident
/// blocks, for an inline and an uploaded table, and the bytes stay the host engine's.
#[test]
fn a_block_budget_and_the_persistent_grid_bound_every_launch_and_the_bytes_stay_right() {
    if cpu_kernel_or_skip("a_block_budget_and_the_persistent_grid_bound_every_launch_...").is_none()
    {
        return;
    }
    for uploaded in [false, true] {
        for resident in [None, Some(6)] {
            for budget in [0, 1, 2, 3, 5, 64, 70_000] {
                let make = || {
                    if uploaded {
                        Fixture::uploaded()
                    } else {
                        Fixture::new()
                    }
                };
                let want = fixture_sent_by_host_of(make());
                let mut f = make();
                let options = SendOptions {
                    max_blocks: budget,
                    ..kernel_options(true, null_mut())
                };
                let (result, calls) =
                    kernel_fixture_run(&mut f, &options, |r| Recorder { resident, ..r });
                let what = format!("uploaded {uploaded}, resident {resident:?}, budget {budget}");
                result.unwrap_or_else(|e| panic!("{what}: {e}"));
                let launches: Vec<KernelLaunch> = calls
                    .iter()
                    .filter_map(|c| match c {
                        Call::Launch(l) => Some(*l),
                        _ => None,
                    })
                    .collect();
                assert_eq!(launches.len(), 1, "{what}");
                let (x, y) = launches[0].grid;
                let limit = mori_tp::gpu_runtime::block_limit(budget, resident);
                if limit != 0 {
                    assert!(
                        u64::from(x) * u64::from(y) <= u64::from(limit),
                        "{what}: grid ({x}, {y})"
                    );
                }
                assert!(x >= 1 && y >= 1, "{what}");
                if budget == 1 {
                    assert_eq!((x, y), (1, 1), "{what}");
                }
                assert_eq!(f.dst.ranks[3], want, "{what}: bytes");
            }
        }
    }
}
