//! The HIP backend through the C ABI, on whatever runtime this build links: none (built without
//! the `hip` feature), libamdhip64 with no device (it answers hipErrorNoDevice), or a real GPU.
//! Requesting HIP never crashes: it either refuses with MORI_ERR_BACKEND_UNAVAILABLE and a
//! message that says why, or moves the bytes exactly; AUTO always moves them.
//!
//! MORI_TP_REQUIRE_HIP=1 (CI's `--features hip` run) makes a build without the feature a
//! failure; MORI_TP_REQUIRE_HIP_DEVICE=1 (a GPU runner) makes a missing device a failure.

mod common;

use std::process::Command;
use std::ptr::null_mut;

use common::{Sender, fragmented_request, odd_deployments, required, transfer};
use mori_tp::backend::hip_device_present;
use mori_tp::ffi::*;

/// A sender that goes through mori_send_kvcache with `options` and must return MORI_OK.
fn ffi_sender(options: Option<MoriSendOptions>) -> Box<Sender<'static>> {
    Box::new(move |plan, request, src, dst| {
        let config = MoriTpSliceConfig::from(plan.config());
        let src_ptrs: Vec<*const std::ffi::c_void> =
            src.iter().map(|b| b.as_ptr().cast()).collect();
        let dst_ptrs: Vec<*mut std::ffi::c_void> =
            dst.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let buffers = MoriKvBuffers {
            src: src_ptrs.as_ptr(),
            dst: dst_ptrs.as_ptr(),
            num_buffers: src_ptrs.len(),
            src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
        };
        let options_ptr = options.as_ref().map_or(std::ptr::null(), |o| o as *const _);
        // SAFETY: every pointer comes from a live slice or vector that outlives the call, and
        // the copies are complete on return (host backend, or HIP with MORI_SEND_SYNCHRONIZE).
        let status = unsafe {
            mori_send_kvcache(
                &config,
                &buffers,
                request.src_pages.as_ptr(),
                request.dst_pages.as_ptr(),
                request.src_pages.len(),
                options_ptr,
            )
        };
        assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
        None
    })
}

/// Prints why a test that needs a HIP device does nothing here, or fails when one is required.
fn skip_without_device(test: &str) -> bool {
    if hip_device_present() {
        return false;
    }
    common::skip_missing(
        test,
        "MORI_TP_REQUIRE_HIP_DEVICE",
        "no HIP device (or built without the `hip` feature)",
    );
    true
}

#[test]
fn ci_that_requires_hip_gets_a_build_with_the_hip_backend() {
    let built_with_hip = cfg!(feature = "hip");
    if built_with_hip {
        return;
    }
    if required("MORI_TP_REQUIRE_HIP") {
        panic!("MORI_TP_REQUIRE_HIP=1 but this test was built without `--features hip`");
    }
    eprintln!("note: built without the `hip` feature; the HIP runtime is not linked");
}

#[test]
fn requesting_hip_without_a_device_is_backend_unavailable_and_writes_nothing() {
    if hip_device_present() {
        // Not a missing tool: this machine simply cannot show the refusal.
        common::skip(
            "requesting_hip_without_a_device_is_backend_unavailable",
            "a HIP device is present, so MORI_BACKEND_HIP is available",
        );
        return;
    }
    for flags in [0, MORI_SEND_SYNCHRONIZE] {
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags,
            stream: null_mut(),
        };
        let (status, message, unchanged) = crate::common::small_send(&options);
        assert_eq!(status, MORI_ERR_BACKEND_UNAVAILABLE, "{message}");
        assert!(
            message.starts_with("mori_send_kvcache: backend unavailable: "),
            "{message}"
        );
        if cfg!(feature = "hip") {
            // "... hipGetDeviceCount returned hipErrorNoDevice (100) ..." or "... reports 0".
            assert!(
                message.contains("needs a HIP device, but hipGetDeviceCount"),
                "{message}"
            );
            let named = message.contains("reports 0")
                || message
                    .split("returned hip")
                    .nth(1)
                    .and_then(|rest| rest.split_once(" (")?.1.split_once(')'))
                    .is_some_and(|(code, _)| code.parse::<i32>().is_ok());
            assert!(
                named,
                "the message names the HIP error and its number: {message}"
            );
        } else {
            assert!(
                message.contains("without the `hip` cargo feature"),
                "{message}"
            );
        }
        assert!(unchanged, "a refused call writes nothing");
    }
}

#[test]
fn auto_moves_every_byte_with_or_without_a_device() {
    // Without a device AUTO is the host backend; with one it is HIP on pageable host memory
    // (legal with hipMemcpyDefault, and synchronous). Either way the bytes must land.
    for options in [
        None,
        Some(MoriSendOptions {
            backend: MORI_BACKEND_AUTO,
            flags: MORI_SEND_SYNCHRONIZE,
            stream: null_mut(),
        }),
    ] {
        odd_deployments(&mut *ffi_sender(options));
        let request = fragmented_request(42, 4);
        transfer(8, 256, 4, 2, 8, 16, &request, &mut *ffi_sender(options));
    }
}

#[test]
fn the_real_runtime_moves_host_memory_byte_exact_when_a_device_is_present() {
    if skip_without_device("the_real_runtime_moves_host_memory_byte_exact") {
        return;
    }
    let options = Some(MoriSendOptions {
        backend: MORI_BACKEND_HIP,
        flags: MORI_SEND_SYNCHRONIZE,
        stream: null_mut(),
    });
    odd_deployments(&mut *ffi_sender(options));
    for (heads, bph, p_tp, d_tp) in [(4, 256, 2, 8), (8, 128, 8, 2), (1, 1152, 4, 2)] {
        let request = fragmented_request(u64::from(heads * 100 + p_tp * 10 + d_tp), 6);
        transfer(
            heads,
            bph,
            4,
            p_tp,
            d_tp,
            16,
            &request,
            &mut *ffi_sender(options),
        );
    }
}

/// Set in the environment of the child processes below.
const CHILD: &str = "MORI_TP_FAKE_HIP_CHILD";

/// Runs `fake_runtime_child` in a child process whose HIP runtime functions are those of
/// tests/fake_hip (LD_PRELOAD): host memory behind hipMalloc, copies done at once, strict about
/// bounds and pitches, defined against HIP's own prototypes. That drives the library's real
/// extern declarations of libamdhip64 (argument order, integer statuses, hipGetErrorName) with a
/// device present, on machines without one.
#[test]
fn the_real_hip_bindings_work_against_a_stand_in_runtime_with_a_device() {
    let built_with_hip = cfg!(feature = "hip");
    let test = "the_real_hip_bindings_work_against_a_stand_in_runtime";
    if !built_with_hip {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_HIP",
            "built without the `hip` feature",
        );
        return;
    }
    let fake = match common::build_fake_hip() {
        Ok(path) => path,
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_HIP", &why);
            return;
        }
    };
    // Everything works; every hipMemcpy2DAsync fails; every kernel launch fails.
    for injected in [
        None,
        Some(("FAKE_HIP_COPY_STATUS", "999")),
        Some(("FAKE_HIP_LAUNCH_STATUS", "999")),
    ] {
        let env: Vec<(&str, &str)> = injected.into_iter().collect();
        let (passed, text) = run_child(&fake, "fake_runtime_child", &env);
        assert!(passed, "{injected:?}:\n{text}");
    }
}

/// Runs the ignored test `test` of this executable in a child process over the stand-in runtime
/// `fake`, with `env` on top of a clean FAKE_HIP_* environment; whether it passed, and its output.
fn run_child(fake: &std::path::Path, test: &str, env: &[(&str, &str)]) -> (bool, String) {
    let exe = std::env::current_exe().expect("test executable path");
    let mut child = Command::new(&exe);
    child
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env("LD_PRELOAD", fake)
        .env(CHILD, "1");
    for var in [
        "FAKE_HIP_DEVICES",
        "FAKE_HIP_COPY_STATUS",
        "FAKE_HIP_LAUNCH_STATUS",
        "FAKE_HIP_MALLOC_STATUS",
        "FAKE_HIP_MALLOC_ASYNC_STATUS",
        "FAKE_HIP_NO_PEER",
        "FAKE_HIP_HANG_MS",
        SCENARIO,
    ] {
        child.env_remove(var);
    }
    child.envs(env.iter().copied());
    let output = child.output().expect("run the child test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success() && text.contains("1 passed"), text)
}

/// Which of `fake_runtime_scenario`'s checks a child runs.
const SCENARIO: &str = "MORI_TP_FAKE_HIP_SCENARIO";

/// The copy-kernel path over the stand-in runtime in the situations a first GPU deployment meets
/// (issue 24), each in its own process: a stream on a second GPU (with and without
/// hipStreamGetDevice), graph capture, an allocator that refuses, a device reset, and pinned and
/// registered host memory.
#[test]
fn the_kernel_path_handles_other_devices_capture_refusing_allocators_resets_and_host_memory() {
    let test = "the_kernel_path_handles_other_devices_capture_...";
    if !cfg!(feature = "hip") {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_HIP",
            "built without the `hip` feature",
        );
        return;
    }
    let fakes = common::build_fake_hip().and_then(|f| Ok((f, common::build_fake_hip_5_2()?)));
    let (fake, fake_5_2) = match fakes {
        Ok(fakes) => fakes,
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_HIP", &why);
            return;
        }
    };
    for (scenario, runtime, env) in [
        ("multi_gpu", &fake, &[("FAKE_HIP_DEVICES", "2")][..]),
        ("multi_gpu_5_2", &fake_5_2, &[("FAKE_HIP_DEVICES", "2")][..]),
        ("capture", &fake, &[][..]),
        ("capture_uploaded", &fake, &[][..]),
        ("capture_5_2", &fake_5_2, &[][..]),
        ("inline_table", &fake, &[][..]),
        (
            "allocator",
            &fake,
            &[("FAKE_HIP_MALLOC_ASYNC_STATUS", "2")][..],
        ),
        ("reset", &fake, &[][..]),
        ("host_memory", &fake, &[][..]),
        ("pair", &fake, &[][..]),
        ("capture_elsewhere", &fake, &[][..]),
        ("capture_same_thread", &fake, &[][..]),
        ("blocked_stream", &fake, &[("FAKE_HIP_HANG_MS", "500")][..]),
        (
            "no_peer",
            &fake,
            &[("FAKE_HIP_DEVICES", "2"), ("FAKE_HIP_NO_PEER", "1")][..],
        ),
        ("paths", &fake, &[][..]),
        ("pool_reset", &fake, &[][..]),
    ] {
        let mut env = env.to_vec();
        env.push((SCENARIO, scenario));
        let (passed, text) = run_child(runtime, "fake_runtime_scenario", &env);
        assert!(passed, "{scenario}:\n{text}");
    }
}

#[test]
#[ignore = "run by the_kernel_path_handles_other_devices_capture_..."]
fn fake_runtime_scenario() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        eprintln!("skipped: runs only as a child of the stand-in runtime test");
        return;
    };
    #[cfg(feature = "hip")]
    device::scenario(&scenario);
    #[cfg(not(feature = "hip"))]
    panic!("{scenario}: built without the `hip` feature");
}

#[test]
#[ignore = "run by the_real_hip_bindings_work_against_a_stand_in_runtime_with_a_device"]
fn fake_runtime_child() {
    if std::env::var_os(CHILD).is_none() {
        eprintln!("skipped: runs only as a child of the stand-in runtime test");
        return;
    }
    assert!(
        hip_device_present(),
        "the stand-in runtime reports a device"
    );
    let sync = MoriSendOptions {
        backend: MORI_BACKEND_HIP,
        flags: MORI_SEND_SYNCHRONIZE,
        stream: null_mut(),
    };
    if let Ok(code) = std::env::var("FAKE_HIP_LAUNCH_STATUS") {
        #[cfg(feature = "hip")]
        device::a_failing_launch_is_reported_and_writes_nothing(&code);
        #[cfg(not(feature = "hip"))]
        let _ = code;
        return;
    }
    match std::env::var("FAKE_HIP_COPY_STATUS") {
        Ok(code) => {
            // Every hipMemcpy2DAsync fails with `code`: the first copy's failure is reported.
            let (status, message, unchanged) = crate::common::small_send(&sync);
            assert_eq!(status, MORI_ERR_GPU, "{message}");
            for part in [
                "mori_send_kvcache: GPU error: hipMemcpy2DAsync(",
                &format!("returned hipErrorUnknown ({code})"),
                "(buffer 0 of 2, rect 0 of 2",
            ] {
                assert!(message.contains(part), "{message:?} lacks {part:?}");
            }
            assert!(unchanged, "the failing copy wrote nothing");
        }
        Err(_) => {
            let (status, message, unchanged) = crate::common::small_send(&sync);
            assert_eq!((status, unchanged), (MORI_OK, false), "{message}");
            // AUTO chose HIP: it takes a stream, which the host backend refuses.
            #[cfg(feature = "hip")]
            {
                let auto = MoriSendOptions {
                    backend: MORI_BACKEND_AUTO,
                    flags: MORI_SEND_SYNCHRONIZE,
                    stream: device::stream_on(0),
                };
                let (status, message, _) = crate::common::small_send(&auto);
                assert_eq!(status, MORI_OK, "{message}");
            }
            // Every byte, through libamdhip64's entry points.
            odd_deployments(&mut *ffi_sender(Some(sync)));
            let request = fragmented_request(7, 5);
            transfer(8, 128, 4, 2, 8, 16, &request, &mut *ffi_sender(Some(sync)));
            #[cfg(feature = "hip")]
            device::the_copy_kernel_moves_device_memory_byte_exact();
        }
    }
}

/// The copy-kernel path through the library's real bindings (hipGetDevice, hipModuleLoadData
/// of the embedded bundle, hipModuleGetFunction, hipMallocAsync, hipMemcpyAsync,
/// hipModuleLaunchKernel, hipFreeAsync), on the stand-in runtime, which runs the kernel's own
/// source on the CPU and, like a GPU, only touches device memory.
#[cfg(feature = "hip")]
mod device {
    use std::ffi::c_void;
    use std::ptr::null_mut;

    use super::*;

    // hip/hip_runtime_api.h (all in HIP 5.2); resolved to tests/fake_hip in the child.
    unsafe extern "C" {
        fn hipMalloc(pointer: *mut *mut c_void, size: usize) -> i32;
        fn hipFree(pointer: *mut c_void) -> i32;
        fn hipMemcpy(dst: *mut c_void, src: *const c_void, size: usize, kind: i32) -> i32;
        fn hipGetDevice(device: *mut i32) -> i32;
        fn hipSetDevice(device: i32) -> i32;
        fn hipDeviceEnablePeerAccess(peer: i32, flags: u32) -> i32;
        fn hipDeviceReset() -> i32;
        fn hipStreamCreate(stream: *mut *mut c_void) -> i32;
        fn hipStreamDestroy(stream: *mut c_void) -> i32;
        fn hipStreamBeginCapture(stream: *mut c_void, mode: i32) -> i32;
        fn hipStreamEndCapture(stream: *mut c_void, graph: *mut *mut c_void) -> i32;
        fn hipGraphInstantiate(
            exec: *mut *mut c_void,
            graph: *mut c_void,
            error_node: *mut *mut c_void,
            log: *mut i8,
            log_size: usize,
        ) -> i32;
        fn hipGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> i32;
        fn hipGraphExecDestroy(exec: *mut c_void) -> i32;
        fn hipGraphDestroy(graph: *mut c_void) -> i32;
        fn hipStreamSynchronize(stream: *mut c_void) -> i32;
        fn hipHostMalloc(pointer: *mut *mut c_void, size: usize, flags: u32) -> i32;
        fn hipHostFree(pointer: *mut c_void) -> i32;
        fn hipHostRegister(pointer: *mut c_void, size: usize, flags: u32) -> i32;
        fn hipHostUnregister(pointer: *mut c_void) -> i32;
        fn hipHostGetDevicePointer(device: *mut *mut c_void, host: *mut c_void, flags: u32) -> i32;
        fn hipStreamWaitValue32(
            stream: *mut c_void,
            pointer: *mut c_void,
            value: u32,
            flags: u32,
            mask: u32,
        ) -> i32;
    }
    /// `hipStreamCaptureModeRelaxed`.
    const CAPTURE_RELAXED: i32 = 2;
    /// `hipErrorStreamCaptureInvalidated`.
    const CAPTURE_INVALIDATED: i32 = 901;
    const HOST_TO_DEVICE: i32 = 1;
    const DEVICE_TO_HOST: i32 = 2;
    /// `hipStreamCaptureModeGlobal`.
    const CAPTURE_GLOBAL: i32 = 0;

    /// A hipMalloc'd copy of host bytes, freed on drop.
    struct DeviceBuffer {
        pointer: *mut c_void,
        len: usize,
    }

    impl DeviceBuffer {
        fn from_host(bytes: &[u8]) -> Self {
            let mut pointer = null_mut();
            // SAFETY: a valid out-pointer; the copy reads `bytes` whole.
            unsafe {
                assert_eq!(hipMalloc(&mut pointer, bytes.len()), 0);
                assert_eq!(
                    hipMemcpy(pointer, bytes.as_ptr().cast(), bytes.len(), HOST_TO_DEVICE),
                    0
                );
            }
            DeviceBuffer {
                pointer,
                len: bytes.len(),
            }
        }

        fn write(&self, bytes: &[u8]) {
            assert_eq!(bytes.len(), self.len);
            // SAFETY: both sides hold `len` bytes.
            let status = unsafe {
                hipMemcpy(
                    self.pointer,
                    bytes.as_ptr().cast(),
                    self.len,
                    HOST_TO_DEVICE,
                )
            };
            assert_eq!(status, 0);
        }

        fn to_host(&self, out: &mut [u8]) {
            assert_eq!(out.len(), self.len);
            // SAFETY: both sides hold `len` bytes.
            let status = unsafe {
                hipMemcpy(
                    out.as_mut_ptr().cast(),
                    self.pointer,
                    self.len,
                    DEVICE_TO_HOST,
                )
            };
            assert_eq!(status, 0);
        }
    }

    impl Drop for DeviceBuffer {
        fn drop(&mut self) {
            // SAFETY: allocated by hipMalloc, freed once.
            unsafe { hipFree(self.pointer) };
        }
    }

    fn kernel_options() -> MoriSendOptions {
        MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            stream: null_mut(),
        }
    }

    /// Runs `f` with `device` current, then makes the caller's device current again.
    fn on_device<T>(device: i32, f: impl FnOnce() -> T) -> T {
        let mut current = -1;
        // SAFETY: valid out-pointer; the devices exist in the stand-in.
        unsafe {
            assert_eq!(hipGetDevice(&mut current), 0);
            assert_eq!(hipSetDevice(device), 0);
        }
        let result = f();
        // SAFETY: as above.
        assert_eq!(unsafe { hipSetDevice(current) }, 0);
        result
    }

    fn current_device() -> i32 {
        let mut device = -1;
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { hipGetDevice(&mut device) }, 0);
        device
    }

    /// A stream of `device`.
    pub(super) fn stream_on(device: i32) -> *mut c_void {
        on_device(device, || {
            let mut stream = null_mut();
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { hipStreamCreate(&mut stream) }, 0);
            stream
        })
    }

    /// Where a [`Mirror`] keeps its bytes.
    #[derive(Clone, Copy, Debug)]
    enum Memory {
        /// hipMalloc'd on this device.
        Device(i32),
        /// hipHostMalloc'd: kernels reach it at its host address.
        Pinned,
        /// Host memory registered with hipHostRegister, handed out at the address
        /// hipHostGetDevicePointer returns (or at its host address when `host_address`).
        Registered { host_address: bool },
    }

    /// A copy of host bytes in `memory`, freed on drop; `pointer` is what a send is given.
    struct Mirror {
        memory: Memory,
        pointer: *mut c_void,
        /// The allocation: a DeviceBuffer, the pinned block, or the registered host bytes.
        device: Option<DeviceBuffer>,
        host: Vec<u8>,
        len: usize,
    }

    impl Mirror {
        fn new(memory: Memory, bytes: &[u8]) -> Self {
            let mut mirror = Mirror {
                memory,
                pointer: null_mut(),
                device: None,
                host: Vec::new(),
                len: bytes.len(),
            };
            match memory {
                Memory::Device(device) => {
                    let buffer = on_device(device, || DeviceBuffer::from_host(bytes));
                    mirror.pointer = buffer.pointer;
                    mirror.device = Some(buffer);
                }
                Memory::Pinned => {
                    // SAFETY: a valid out-pointer; the block holds `len` bytes afterwards.
                    unsafe {
                        assert_eq!(hipHostMalloc(&mut mirror.pointer, bytes.len().max(1), 0), 0);
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            mirror.pointer.cast(),
                            bytes.len(),
                        );
                    }
                }
                Memory::Registered { host_address } => {
                    mirror.host = bytes.to_vec();
                    let host = mirror.host.as_mut_ptr().cast();
                    // SAFETY: live host bytes of that length, unregistered on drop.
                    unsafe {
                        assert_eq!(hipHostRegister(host, bytes.len(), 0), 0);
                        assert_eq!(hipHostGetDevicePointer(&mut mirror.pointer, host, 0), 0);
                    }
                    if host_address {
                        mirror.pointer = host;
                    }
                }
            }
            mirror
        }

        fn read(&self, out: &mut [u8]) {
            assert_eq!(out.len(), self.len);
            match (&self.device, self.memory) {
                (Some(device), _) => device.to_host(out),
                (None, Memory::Pinned) => {
                    // SAFETY: the pinned block holds `len` bytes; the send has completed.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.pointer.cast(),
                            out.as_mut_ptr(),
                            self.len,
                        )
                    }
                }
                (None, _) => out.copy_from_slice(&self.host),
            }
        }
    }

    impl Drop for Mirror {
        fn drop(&mut self) {
            // SAFETY: each allocated above, released once (device buffers drop themselves).
            unsafe {
                match self.memory {
                    Memory::Device(_) => {}
                    Memory::Pinned => {
                        hipHostFree(self.pointer);
                    }
                    Memory::Registered { .. } => {
                        hipHostUnregister(self.host.as_mut_ptr().cast());
                    }
                }
            }
        }
    }

    /// A sender that mirrors the sources into `src` memory and the destinations into `dst`
    /// memory, sends with `options` (which must synchronize) and copies the destinations back;
    /// the status must be MORI_OK.
    fn mirrored_sender(
        src_in: Memory,
        dst_in: Memory,
        options: MoriSendOptions,
    ) -> Box<Sender<'static>> {
        Box::new(move |plan, request, src, dst| {
            let config = MoriTpSliceConfig::from(plan.config());
            let src_copies: Vec<Mirror> = src.iter().map(|b| Mirror::new(src_in, b)).collect();
            let dst_copies: Vec<Mirror> = dst.iter().map(|b| Mirror::new(dst_in, b)).collect();
            let src_ptrs: Vec<*const c_void> =
                src_copies.iter().map(|b| b.pointer.cast_const()).collect();
            let dst_ptrs: Vec<*mut c_void> = dst_copies.iter().map(|b| b.pointer).collect();
            let buffers = MoriKvBuffers {
                src: src_ptrs.as_ptr(),
                dst: dst_ptrs.as_ptr(),
                num_buffers: src_ptrs.len(),
                src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
                dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            };
            // SAFETY: buffers of the stated capacities, synchronised before return.
            let status = unsafe {
                mori_send_kvcache(
                    &config,
                    &buffers,
                    request.src_pages.as_ptr(),
                    request.dst_pages.as_ptr(),
                    request.src_pages.len(),
                    &options,
                )
            };
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            for (copy, host) in dst_copies.iter().zip(dst.iter_mut()) {
                copy.read(host);
            }
            None
        })
    }

    /// A sender through device memory of device 0.
    fn device_sender(options: MoriSendOptions) -> Box<Sender<'static>> {
        mirrored_sender(Memory::Device(0), Memory::Device(0), options)
    }

    /// One small send (as `small_send`: 8 heads of 16 bytes, 2 -> 4, pair (1, 3), pages 0, 1,
    /// 3, one buffer pair) of source bytes 7 into destination bytes 9, in `memory`: the status,
    /// the message (if it failed) and the destination after.
    fn small_send_in(memory: Memory, options: MoriSendOptions) -> (MoriStatus, String, Vec<u8>) {
        let src = Mirror::new(memory, &[7u8; 4 * 64]);
        let dst = Mirror::new(memory, &[9u8; 4 * 32]);
        // SAFETY: buffers of the stated sizes; the options synchronize.
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(&[src.pointer.cast_const()], &[dst.pointer], &options)
        };
        let mut after = vec![0u8; 4 * 32];
        dst.read(&mut after);
        (status, message, after)
    }

    /// What `small_send_in` leaves in the destination when it succeeds: decode rank 3 holds
    /// heads 6 and 7, the second half of each prefill token, of pages 0, 1 and 3.
    fn small_send_result(source: u8) -> Vec<u8> {
        let mut want = vec![9u8; 4 * 32];
        for page in [0, 1, 3] {
            want[page * 32..page * 32 + 32].fill(source);
        }
        want
    }

    /// `fake_hip_stat(name)` of the stand-in runtime this child runs over.
    pub(super) fn stat(name: &str) -> i64 {
        // SAFETY: dlsym with a NUL-terminated name.
        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"fake_hip_stat".as_ptr()) };
        assert!(
            !symbol.is_null(),
            "the stand-in runtime exports fake_hip_stat"
        );
        // SAFETY: fake_hip_stat's C signature is `long (const char *)` (long is 64-bit on the
        // Linux targets the stand-in builds for).
        let stat: unsafe extern "C" fn(*const std::ffi::c_char) -> i64 =
            unsafe { std::mem::transmute(symbol) };
        let name = std::ffi::CString::new(name).expect("no NUL");
        // SAFETY: a NUL-terminated name.
        let value: i64 = unsafe { stat(name.as_ptr()) };
        assert!(value >= 0, "fake_hip_stat does not count {name:?}");
        value
    }

    pub(super) fn scenario(name: &str) {
        match name {
            "multi_gpu" => multi_gpu(),
            "multi_gpu_5_2" => multi_gpu_without_stream_get_device(),
            "capture" => capture(),
            "capture_uploaded" => capture_uploaded(),
            "capture_5_2" => capture_on_hip_5_2(),
            "inline_table" => inline_table(),
            "allocator" => allocator(),
            "reset" => reset(),
            "host_memory" => host_memory(),
            "pair" => pair(),
            "capture_elsewhere" => capture_elsewhere(),
            "capture_same_thread" => capture_same_thread(),
            "blocked_stream" => blocked_stream(),
            "no_peer" => no_peer(),
            "paths" => paths(),
            "pool_reset" => pool_reset(),
            other => panic!("unknown scenario {other}"),
        }
    }

    /// A layout made by `mori_tp_layout_hnd` (`hnd`) or `mori_tp_layout_nhd`.
    fn layout(
        hnd: bool,
        heads: u32,
        tp: u32,
        rank: u32,
        page_size: u32,
        bytes: u64,
    ) -> MoriTpLayout {
        // SAFETY: an all-zero MoriTpLayout is valid (integers only); the call fills it.
        let mut out: MoriTpLayout = unsafe { std::mem::zeroed() };
        let make = if hnd {
            mori_tp_layout_hnd
        } else {
            mori_tp_layout_nhd
        };
        // SAFETY: a valid out-pointer.
        let status = unsafe { make(heads, tp, rank, page_size, bytes, &mut out) };
        assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
        out
    }

    /// Bytes `i` of a buffer with `salt`.
    fn patterned(len: usize, salt: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ salt)
            .collect()
    }

    /// Issue 19: pair send, pack (SRC, BOTH) and unpack (DST, BOTH) through the C ABI with
    /// MORI_BACKEND_HIP in device memory, per rect, with the copy kernel and with flags 0, leave every byte
    /// (untouched ones included) as MORI_BACKEND_HOST leaves it in host memory: a mixed NHD ->
    /// HND pair and the reverse, page sizes that differ, partial last pages on both sides.
    fn pair() {
        let host = MoriSendOptions {
            backend: MORI_BACKEND_HOST,
            flags: 0,
            stream: null_mut(),
        };
        let hip_paths = [
            ("per rect", MORI_SEND_SYNCHRONIZE | MORI_SEND_MEMCPY2D),
            ("copy kernel", MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL),
            ("flags 0 (the kernel)", MORI_SEND_SYNCHRONIZE),
        ];
        const BUFFERS: usize = 2;
        for (name, prefill, decode, tokens, capacity_pages) in [
            (
                "NHD TP 2 pages of 16 -> HND TP 4 pages of 64, 173 tokens",
                layout(false, 8, 2, 1, 16, 32),
                layout(true, 8, 4, 2, 64, 32),
                173u64,
                [14usize, 5usize],
            ),
            (
                "HND TP 8 pages of 64 -> NHD TP 2 pages of 16, 100 tokens of 24-byte heads",
                layout(true, 8, 8, 3, 64, 24),
                layout(false, 8, 2, 0, 16, 24),
                100,
                [4, 9],
            ),
        ] {
            assert!(tokens % u64::from(prefill.page_size) != 0);
            assert!(
                tokens % u64::from(decode.page_size) != 0,
                "partial last pages"
            );
            // SAFETY: an all-zero config is valid (integers and layouts); the call fills it.
            let mut config: MoriTpPairConfig = unsafe { std::mem::zeroed() };
            // SAFETY: valid pointers.
            let status = unsafe { mori_tp_pair_config(&prefill, &decode, &mut config) };
            assert_eq!(status, MORI_OK, "{name}: {}", crate::common::last_error());
            // Pages in a rotated order with a break, so runs of pages and jumps both occur.
            let pages = |page_size: u32, capacity: usize| -> Vec<i32> {
                let mut all: Vec<i32> = (0..capacity as i32).collect();
                all.rotate_left(capacity / 3);
                all.truncate(tokens.div_ceil(u64::from(page_size)) as usize);
                all
            };
            let (src_pages, dst_pages) = (
                pages(prefill.page_size, capacity_pages[0]),
                pages(decode.page_size, capacity_pages[1]),
            );
            let request = MoriTpRequest {
                src_pages: src_pages.as_ptr(),
                num_src_pages: src_pages.len(),
                dst_pages: dst_pages.as_ptr(),
                num_dst_pages: dst_pages.len(),
                num_tokens: tokens,
            };
            let src_len = capacity_pages[0] * prefill.page_stride as usize;
            let dst_len = capacity_pages[1] * decode.page_stride as usize;
            let src: Vec<Vec<u8>> = (0..BUFFERS).map(|b| patterned(src_len, b as u8)).collect();
            let initial: Vec<Vec<u8>> = (0..BUFFERS)
                .map(|b| patterned(dst_len, 0x80 | b as u8))
                .collect();
            let mut staging_len = 0u64;
            // SAFETY: valid pointers.
            let status = unsafe { mori_tp_pair_staging_len(&config, tokens, &mut staging_len) };
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            let region_len = staging_len as usize * BUFFERS;
            assert!(region_len > 0);

            // The host backend's bytes, in host memory: the reference.
            let mut want_sent = initial.clone();
            let src_ptrs: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
            let sent_ptrs: Vec<*mut c_void> = want_sent
                .iter_mut()
                .map(|b| b.as_mut_ptr().cast())
                .collect();
            let buffers = MoriKvBuffers {
                src: src_ptrs.as_ptr(),
                dst: sent_ptrs.as_ptr(),
                num_buffers: BUFFERS,
                src_capacity: src_len as u64,
                dst_capacity: dst_len as u64,
            };
            // SAFETY: live buffers of the stated capacities; the host backend is synchronous.
            let status = unsafe { mori_send_kvcache_pair(&config, &buffers, &request, &host) };
            assert_eq!(
                status,
                MORI_OK,
                "{name}: host send: {}",
                crate::common::last_error()
            );
            assert_ne!(want_sent, initial, "{name}: the pair moves bytes");
            let region_in = patterned(region_len, 0x33);
            let mut want_packed = Vec::new();
            for mode in [MORI_TP_STAGING_SRC, MORI_TP_STAGING_BOTH] {
                let mut region = vec![0x5au8; region_len];
                // SAFETY: as above.
                let status = unsafe {
                    mori_pack_kvcache_pair(
                        &config,
                        mode,
                        src_ptrs.as_ptr(),
                        BUFFERS,
                        src_len as u64,
                        &request,
                        region.as_mut_ptr().cast(),
                        region_len as u64,
                        &host,
                    )
                };
                assert_eq!(
                    status,
                    MORI_OK,
                    "{name}: host pack {mode}: {}",
                    crate::common::last_error()
                );
                want_packed.push((mode, region));
            }
            let mut want_unpacked = Vec::new();
            for mode in [MORI_TP_STAGING_DST, MORI_TP_STAGING_BOTH] {
                let mut out = initial.clone();
                let out_ptrs: Vec<*mut c_void> =
                    out.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
                // SAFETY: as above.
                let status = unsafe {
                    mori_unpack_kvcache_pair(
                        &config,
                        mode,
                        region_in.as_ptr().cast(),
                        region_len as u64,
                        out_ptrs.as_ptr(),
                        BUFFERS,
                        dst_len as u64,
                        &request,
                        &host,
                    )
                };
                assert_eq!(
                    status,
                    MORI_OK,
                    "{name}: host unpack {mode}: {}",
                    crate::common::last_error()
                );
                want_unpacked.push((mode, out));
            }

            for (path, flags) in hip_paths {
                let hip = MoriSendOptions {
                    backend: MORI_BACKEND_HIP,
                    flags,
                    stream: stream_on(0),
                };
                let launches = stat("kernel_launches");
                let copies = stat("memcpy2d_calls");
                let src_dev: Vec<Mirror> = src
                    .iter()
                    .map(|b| Mirror::new(Memory::Device(0), b))
                    .collect();
                let src_dev_ptrs: Vec<*const c_void> =
                    src_dev.iter().map(|b| b.pointer.cast_const()).collect();
                // Send.
                let dst_dev: Vec<Mirror> = initial
                    .iter()
                    .map(|b| Mirror::new(Memory::Device(0), b))
                    .collect();
                let dst_dev_ptrs: Vec<*mut c_void> = dst_dev.iter().map(|b| b.pointer).collect();
                let buffers = MoriKvBuffers {
                    src: src_dev_ptrs.as_ptr(),
                    dst: dst_dev_ptrs.as_ptr(),
                    num_buffers: BUFFERS,
                    src_capacity: src_len as u64,
                    dst_capacity: dst_len as u64,
                };
                // SAFETY: device buffers of the stated capacities; the options synchronize.
                let status = unsafe { mori_send_kvcache_pair(&config, &buffers, &request, &hip) };
                assert_eq!(
                    status,
                    MORI_OK,
                    "{name}: {path} send: {}",
                    crate::common::last_error()
                );
                let mut got = initial.clone();
                for (copy, out) in dst_dev.iter().zip(&mut got) {
                    copy.read(out);
                }
                assert!(
                    got == want_sent,
                    "{name}: {path} send differs from the host's"
                );
                // Pack.
                for (mode, want) in &want_packed {
                    let region = Mirror::new(Memory::Device(0), &vec![0x5au8; region_len]);
                    // SAFETY: as above.
                    let status = unsafe {
                        mori_pack_kvcache_pair(
                            &config,
                            *mode,
                            src_dev_ptrs.as_ptr(),
                            BUFFERS,
                            src_len as u64,
                            &request,
                            region.pointer,
                            region_len as u64,
                            &hip,
                        )
                    };
                    assert_eq!(
                        status,
                        MORI_OK,
                        "{name}: {path} pack {mode}: {}",
                        crate::common::last_error()
                    );
                    let mut got = vec![0u8; region_len];
                    region.read(&mut got);
                    assert!(
                        &got == want,
                        "{name}: {path} pack {mode} differs from the host's"
                    );
                }
                // Unpack.
                let region = Mirror::new(Memory::Device(0), &region_in);
                for (mode, want) in &want_unpacked {
                    let dst_dev: Vec<Mirror> = initial
                        .iter()
                        .map(|b| Mirror::new(Memory::Device(0), b))
                        .collect();
                    let dst_dev_ptrs: Vec<*mut c_void> =
                        dst_dev.iter().map(|b| b.pointer).collect();
                    // SAFETY: as above.
                    let status = unsafe {
                        mori_unpack_kvcache_pair(
                            &config,
                            *mode,
                            region.pointer.cast_const(),
                            region_len as u64,
                            dst_dev_ptrs.as_ptr(),
                            BUFFERS,
                            dst_len as u64,
                            &request,
                            &hip,
                        )
                    };
                    assert_eq!(
                        status,
                        MORI_OK,
                        "{name}: {path} unpack {mode}: {}",
                        crate::common::last_error()
                    );
                    let mut got = initial.clone();
                    for (copy, out) in dst_dev.iter().zip(&mut got) {
                        copy.read(out);
                    }
                    assert!(
                        &got == want,
                        "{name}: {path} unpack {mode} differs from the host's"
                    );
                }
                // Five calls: per rect only hipMemcpy2DAsync, with the kernel (asked for, or by
                // flags 0) one launch each.
                let (launched, copied) = (
                    stat("kernel_launches") - launches,
                    stat("memcpy2d_calls") - copies,
                );
                if flags & MORI_SEND_MEMCPY2D == 0 {
                    assert_eq!((launched, copied), (5, 0), "{name}: {path}");
                } else {
                    assert!(
                        launched == 0 && copied >= 5 * BUFFERS as i64,
                        "{name}: {path}: {copied}"
                    );
                }
            }
        }
    }

    /// Issue 24.1: one thread drives two GPUs by stream. With device 0 current, a stream and
    /// buffers of device 1 get the kernel loaded on device 1; device 0 stays current. A kernel
    /// on device 0 reads device 1's memory once peer access is enabled.
    fn multi_gpu() {
        assert_eq!(current_device(), 0);
        let stream = stream_on(1);
        let on_1 = MoriSendOptions {
            stream,
            ..kernel_options()
        };
        let (status, message, after) = small_send_in(Memory::Device(1), on_1);
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        odd_deployments(&mut *mirrored_sender(
            Memory::Device(1),
            Memory::Device(1),
            on_1,
        ));
        let request = fragmented_request(3, 5);
        transfer(
            8,
            128,
            4,
            2,
            8,
            16,
            &request,
            &mut *mirrored_sender(Memory::Device(1), Memory::Device(1), on_1),
        );
        assert_eq!(
            current_device(),
            0,
            "the caller's current device is left as it was"
        );
        // SAFETY: device 1 exists; peer access from the current device 0.
        assert_eq!(unsafe { hipDeviceEnablePeerAccess(1, 0) }, 0);
        transfer(
            8,
            128,
            4,
            2,
            8,
            16,
            &request,
            &mut *mirrored_sender(Memory::Device(1), Memory::Device(0), kernel_options()),
        );
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// HIP 5.2 has no hipStreamGetDevice: the stream is taken to belong to the current device,
    /// which an event of that device recorded on it confirms, and a stream of another device is
    /// refused with a message that says so before anything is uploaded or launched. With the
    /// stream's device current it works.
    fn multi_gpu_without_stream_get_device() {
        let stream = stream_on(1);
        let on_1 = MoriSendOptions {
            stream,
            ..kernel_options()
        };
        let (status, message, after) = small_send_in(Memory::Device(1), on_1);
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "hipEventRecord(an event of the current device 0, stream 0x",
            "hipErrorInvalidHandle (400)",
            "this HIP runtime has no hipStreamGetDevice",
            "make the stream's device current",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(after, vec![9u8; 4 * 32], "a refused call writes nothing");
        on_device(1, || {
            let (status, message, after) = small_send_in(Memory::Device(1), on_1);
            assert_eq!(
                (status, after),
                (MORI_OK, small_send_result(7)),
                "{message}"
            );
        });
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// Captures `send` (which must enqueue on `stream` and return MORI_OK) into a graph, then
    /// replays it once for each of the source bytes 5 and 6 written into `src` before the
    /// replay, checking that `dst` then holds `want(source)`. Returns the stand-in's
    /// `captured_launches`, `memcpy2d_calls` and `kernel_launches` of the capture and of the
    /// replays.
    fn capture_and_replay(
        stream: *mut c_void,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        send: impl FnOnce() -> (MoriStatus, String),
        want: impl Fn(u8) -> Vec<u8>,
    ) -> ([i64; 3], [i64; 3]) {
        let counts = || {
            [
                stat("captured_launches"),
                stat("memcpy2d_calls"),
                stat("kernel_launches"),
            ]
        };
        let (mut graph, mut exec) = (null_mut(), null_mut());
        let before = counts();
        // SAFETY: live stream; the graph and its instance are destroyed below.
        unsafe {
            assert_eq!(hipStreamBeginCapture(stream, CAPTURE_GLOBAL), 0);
            let (status, message) = send();
            assert_eq!(status, MORI_OK, "{message}");
            assert_eq!(hipStreamEndCapture(stream, &mut graph), 0);
            assert_eq!(
                hipGraphInstantiate(&mut exec, graph, null_mut(), null_mut(), 0),
                0
            );
        }
        let captured = counts();
        let launches = stat("graph_launches");
        for source in [5u8, 6] {
            src.write(&vec![source; src.len]);
            // SAFETY: the instance and stream above.
            unsafe {
                assert_eq!(hipGraphLaunch(exec, stream), 0, "the graph replays");
                assert_eq!(hipStreamSynchronize(stream), 0);
            }
            let mut after = vec![0u8; dst.len];
            dst.to_host(&mut after);
            assert!(after == want(source), "replay of source bytes {source}");
        }
        assert_eq!(stat("graph_launches"), launches + 2);
        let replayed = counts();
        // SAFETY: made above, destroyed once.
        unsafe {
            hipGraphExecDestroy(exec);
            hipGraphDestroy(graph);
        }
        let delta = |a: [i64; 3], b: [i64; 3]| [b[0] - a[0], b[1] - a[1], b[2] - a[2]];
        (delta(before, captured), delta(captured, replayed))
    }

    /// Issue 24.3: a send with MORI_SEND_COPY_KERNEL captured into a graph copies, at every
    /// replay, what the source holds then: the capture holds only copies of caller memory. Its
    /// table is inside the kernel's argument, so the graph holds the kernel launch itself (one
    /// kernel node, with its own copy of the argument), run once per replay.
    fn capture() {
        let stream = stream_on(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        // Capturing: no MORI_SEND_SYNCHRONIZE (a capturing stream cannot be waited for).
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_COPY_KERNEL,
            stream,
        };
        let uploads = stat("memcpy_async_calls");
        let (captured, replayed) = capture_and_replay(
            stream,
            &src,
            &dst,
            // SAFETY: live stream and device buffers, alive until the graph has run.
            || unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.pointer.cast_const()],
                    &[dst.pointer],
                    &options,
                )
            },
            small_send_result,
        );
        assert_eq!(captured, [1, 0, 0], "one launch captured, nothing run");
        assert_eq!(replayed, [0, 0, 2], "the kernel runs at each replay");
        assert_eq!(stat("memcpy_async_calls"), uploads, "no table upload");
        assert_eq!(stat("uncaptured_launches"), 0);
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    use crate::common::{UPLOADED_PAGES, uploaded_result};

    /// [`crate::common::send_uploaded`] between two device buffers of `2 * UPLOADED_PAGES`
    /// pages (64 and 32 bytes).
    ///
    /// # Safety
    /// The buffers must stay until the copies are complete.
    unsafe fn send_uploaded(
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        options: &MoriSendOptions,
    ) -> (MoriStatus, String) {
        // SAFETY: as the caller guarantees.
        unsafe { crate::common::send_uploaded(src.pointer.cast_const(), dst.pointer, options) }
    }

    /// A table too big for the kernel's argument is uploaded before the launch; on a capturing
    /// stream that upload would be replayed from a table buffer later calls reuse, so the
    /// capture gets the per-rect copies, also with MORI_SEND_COPY_KERNEL. Outside a capture the
    /// same send is one upload and one launch.
    fn capture_uploaded() {
        let stream = stream_on(0);
        let pages = 2 * UPLOADED_PAGES;
        let src = DeviceBuffer::from_host(&vec![7u8; pages * 64]);
        let dst = DeviceBuffer::from_host(&vec![9u8; pages * 32]);
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_COPY_KERNEL,
            stream,
        };
        let uploads = stat("memcpy_async_calls");
        let (captured, replayed) = capture_and_replay(
            stream,
            &src,
            &dst,
            // SAFETY: device buffers of that many pages, alive until the graph has run.
            || unsafe { send_uploaded(&src, &dst, &options) },
            uploaded_result,
        );
        let copies = UPLOADED_PAGES as i64;
        assert_eq!(captured, [0, copies, 0], "per-rect copies captured");
        assert_eq!(replayed, [0, 0, 0], "no kernel in the graph");
        assert_eq!(stat("memcpy_async_calls"), uploads, "no upload captured");
        // Not capturing: one upload of the table, one launch.
        let launches = stat("kernel_launches");
        dst.write(&vec![9u8; pages * 32]);
        let sync = MoriSendOptions {
            flags: MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE,
            ..options
        };
        // SAFETY: as above; the options synchronize.
        let (status, message) = unsafe { send_uploaded(&src, &dst, &sync) };
        assert_eq!(status, MORI_OK, "{message}");
        let mut after = vec![0u8; pages * 32];
        dst.to_host(&mut after);
        assert!(after == uploaded_result(6));
        assert_eq!(stat("memcpy_async_calls"), uploads + 1, "one table upload");
        assert_eq!(stat("kernel_launches"), launches + 1);
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// HIP 5.2 runs hipModuleLaunchKernel on a capturing stream at once and leaves it out of
    /// the graph (a replay would copy nothing): there even a table inside the argument gets the
    /// per-rect copies on a capturing stream, and no launch escapes the capture.
    fn capture_on_hip_5_2() {
        let stream = current_device_stream();
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_COPY_KERNEL,
            stream,
        };
        let (captured, replayed) = capture_and_replay(
            stream,
            &src,
            &dst,
            // SAFETY: live stream and device buffers, alive until the graph has run.
            || unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.pointer.cast_const()],
                    &[dst.pointer],
                    &options,
                )
            },
            small_send_result,
        );
        assert_eq!(captured, [0, 2, 0], "two per-rect copies captured");
        assert_eq!(replayed, [0, 0, 0]);
        assert_eq!(
            stat("uncaptured_launches"),
            0,
            "no launch ran outside the graph"
        );
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// A stream of the current device (HIP 5.2 cannot say a stream's device).
    fn current_device_stream() -> *mut c_void {
        stream_on(current_device())
    }

    /// A table inside the kernel's argument: the first kernel send of the process loads the
    /// kernel and allocates its reset sentinel (one hipMalloc), and nothing else of the
    /// library's: no table buffer (hipMalloc, hipHostMalloc), no upload (hipMemcpyAsync), no
    /// lane (relay stream, events). Later sends make none of those calls either.
    fn inline_table() {
        let stream = stream_on(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_COPY_KERNEL | MORI_SEND_SYNCHRONIZE,
            stream,
        };
        let made = || {
            [
                "device_mallocs",
                "host_mallocs",
                "memcpy_async_calls",
                "events_created",
                "streams_created",
                "kernel_launches",
            ]
            .map(stat)
        };
        for send in 0..3 {
            let before = made();
            dst.write(&[9u8; 4 * 32]);
            // SAFETY: device buffers of the stated sizes; the options synchronize.
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.pointer.cast_const()],
                    &[dst.pointer],
                    &options,
                )
            };
            assert_eq!(status, MORI_OK, "{message}");
            let after = made();
            let delta: Vec<i64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
            let sentinel = i64::from(send == 0);
            assert_eq!(delta, [sentinel, 0, 0, 0, 0, 1], "send {send}");
            let mut got = vec![0u8; 4 * 32];
            dst.to_host(&mut got);
            assert_eq!(got, small_send_result(7), "send {send}");
        }
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// Issue 24.2: the kernel path never uses hipMallocAsync (refused here, as some ROCm
    /// versions do); a refusing hipMalloc is a GPU error naming it that writes nothing and is
    /// not remembered: the next call allocates again.
    fn allocator() {
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let send = || {
            // SAFETY: device buffers of the stated sizes; the options synchronize.
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.pointer.cast_const()],
                    &[dst.pointer],
                    &kernel_options(),
                )
            };
            let mut after = vec![0u8; 4 * 32];
            dst.to_host(&mut after);
            (status, message, after)
        };
        // SAFETY: this child runs one test on one thread; the stand-in reads it per call.
        unsafe { std::env::set_var("FAKE_HIP_MALLOC_STATUS", "2") };
        let (status, message, after) = send();
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        assert!(
            message.contains(
                "hipMalloc(4288 bytes for the copy kernel's reset check on device 0) returned \
                 hipErrorOutOfMemory (2)"
            ),
            "{message}"
        );
        assert_eq!(after, vec![9u8; 4 * 32]);
        // SAFETY: as above.
        unsafe { std::env::remove_var("FAKE_HIP_MALLOC_STATUS") };
        let (status, message, after) = send();
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        let request = fragmented_request(5, 4);
        transfer(
            8,
            128,
            4,
            2,
            8,
            16,
            &request,
            &mut *device_sender(kernel_options()),
        );
    }

    /// Issue 24.6: hipDeviceReset frees the kernel's table buffers and invalidates its module;
    /// the next call notices and loads the kernel again.
    fn reset() {
        let request = fragmented_request(9, 4);
        transfer(
            8,
            128,
            4,
            2,
            8,
            16,
            &request,
            &mut *device_sender(kernel_options()),
        );
        let loads = stat("module_loads");
        // SAFETY: no buffer of this test is alive across the reset.
        assert_eq!(unsafe { hipDeviceReset() }, 0);
        transfer(
            8,
            128,
            4,
            2,
            8,
            16,
            &request,
            &mut *device_sender(kernel_options()),
        );
        assert_eq!(
            stat("module_loads"),
            loads + 1,
            "loaded once more after the reset"
        );
    }

    /// Issue 24.4: pinned host memory is reached at its host address; registered host memory at
    /// the address hipHostGetDevicePointer returns, while its host address is refused before
    /// anything is launched, naming the address to use.
    fn host_memory() {
        let request = fragmented_request(13, 5);
        for memory in [
            Memory::Pinned,
            Memory::Registered {
                host_address: false,
            },
        ] {
            transfer(
                8,
                128,
                4,
                2,
                8,
                16,
                &request,
                &mut *mirrored_sender(memory, memory, kernel_options()),
            );
            let (status, message, after) = small_send_in(memory, kernel_options());
            assert_eq!(
                (status, after),
                (MORI_OK, small_send_result(7)),
                "{memory:?}: {message}"
            );
        }
        let (status, message, after) =
            small_send_in(Memory::Registered { host_address: true }, kernel_options());
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        assert!(
            message.contains("hipPointerGetAttributes(source buffer 0, ")
                && message.contains("registered with hipHostRegister, which devices address at 0x")
                && message.contains("hipHostGetDevicePointer"),
            "{message}"
        );
        assert_eq!(after, vec![9u8; 4 * 32], "a refused call writes nothing");
        // The per-rect path copies host memory at its host address, asked for or (flags 0) by
        // the library's choice.
        for flags in [MORI_SEND_MEMCPY2D, 0] {
            let per_rect = MoriSendOptions {
                flags: MORI_SEND_SYNCHRONIZE | flags,
                ..kernel_options()
            };
            let (status, message, after) =
                small_send_in(Memory::Registered { host_address: true }, per_rect);
            assert_eq!(
                (status, after),
                (MORI_OK, small_send_result(7)),
                "flags {flags}: {message}"
            );
        }
    }

    /// A stream of device 0 capturing a graph in `mode` on another thread while `f` runs on
    /// this one; what hipStreamEndCapture returned.
    fn while_another_thread_captures(mode: i32, f: impl FnOnce()) -> i32 {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let other = std::sync::Arc::clone(&barrier);
        let capturer = std::thread::spawn(move || {
            let stream = stream_on(0);
            let mut graph = null_mut();
            // SAFETY: a live stream; the graph is destroyed below.
            unsafe {
                assert_eq!(hipStreamBeginCapture(stream, mode), 0);
                other.wait(); // capturing
                other.wait(); // the other thread is done
                let status = hipStreamEndCapture(stream, &mut graph);
                if !graph.is_null() {
                    hipGraphDestroy(graph);
                }
                hipStreamDestroy(stream);
                status
            }
        });
        barrier.wait();
        f();
        barrier.wait();
        capturer.join().expect("the capturing thread")
    }

    /// Issue 35.1: another thread captures a graph in the global mode (PyTorch's default) while
    /// this thread sends on its own stream, which does not capture: the first kernel send (which
    /// allocates), later ones, with and without MORI_SEND_SYNCHRONIZE (a hipStreamSynchronize),
    /// flags 0 and MORI_SEND_MEMCPY2D, and a device pool made and destroyed (hipMalloc,
    /// hipFree). Every call succeeds and no capture is invalidated (the runtime refuses those
    /// calls from a thread in the global mode, and invalidates the capture, as clr does).
    fn capture_elsewhere() {
        let stream = stream_on(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let send = |flags: u32| {
            let options = MoriSendOptions {
                backend: MORI_BACKEND_HIP,
                flags,
                stream,
            };
            // SAFETY: device buffers of the stated sizes, alive until the stream has run the
            // copies (it is synchronized before they are dropped).
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.pointer.cast_const()],
                    &[dst.pointer],
                    &options,
                )
            };
            assert_eq!(status, MORI_OK, "flags {flags:#x}: {message}");
        };
        let sync = MORI_SEND_SYNCHRONIZE;
        for flags in [
            MORI_SEND_COPY_KERNEL,
            MORI_SEND_COPY_KERNEL,
            MORI_SEND_COPY_KERNEL | sync,
            0,
            sync,
            MORI_SEND_MEMCPY2D | sync,
        ] {
            let ended = while_another_thread_captures(CAPTURE_GLOBAL, || send(flags));
            assert_eq!(
                ended, 0,
                "flags {flags:#x}: the other thread's capture survives"
            );
        }
        let ended = while_another_thread_captures(CAPTURE_GLOBAL, || {
            let options = MoriTpPoolOptions {
                capacity: 1 << 20,
                min_slot: 0,
                memory: MORI_TP_POOL_DEVICE,
                flags: 0,
            };
            let mut pool = 0;
            // SAFETY: valid pointers.
            assert_eq!(unsafe { mori_tp_pool_create(&options, &mut pool) }, MORI_OK);
            assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
        });
        assert_eq!(ended, 0, "a device pool's life leaves the capture alone");
        assert_eq!(stat("invalidated_captures"), 0);
        // SAFETY: the stream made above.
        assert_eq!(unsafe { hipStreamSynchronize(stream) }, 0);
        let mut after = vec![0u8; 4 * 32];
        dst.to_host(&mut after);
        assert_eq!(after, small_send_result(7));
        // The stand-in enforces the rule: this thread's own hipMalloc in the global mode is
        // refused, and invalidates the capture.
        let ended = while_another_thread_captures(CAPTURE_GLOBAL, || {
            let mut p = null_mut();
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { hipMalloc(&mut p, 64) }, 900);
        });
        assert_eq!(ended, CAPTURE_INVALIDATED);
        assert_eq!(stat("invalidated_captures"), 1);
        // SAFETY: created above.
        unsafe { hipStreamDestroy(stream) };
    }

    /// Issue 35.1, one thread: kernel sends of uploaded tables on S, then S captures a graph
    /// (relaxed mode), gets a send (the per-rect copies), and kernel sends on T follow. Nothing the library does on T
    /// touches an event last recorded on S (which would invalidate S's capture), and S's graph
    /// replays the copies.
    fn capture_same_thread() {
        let (s, t) = (stream_on(0), stream_on(0));
        // Tables too big for the kernel's argument: each kernel send takes a table buffer pair
        // and fences it with events on its stream.
        let pages = 2 * UPLOADED_PAGES;
        let src = DeviceBuffer::from_host(&vec![7u8; pages * 64]);
        let dst = DeviceBuffer::from_host(&vec![9u8; pages * 32]);
        let send = |stream| {
            let options = MoriSendOptions {
                backend: MORI_BACKEND_HIP,
                flags: MORI_SEND_COPY_KERNEL,
                stream,
            };
            // SAFETY: device buffers alive until both streams are synchronized below.
            let (status, message) = unsafe { send_uploaded(&src, &dst, &options) };
            assert_eq!(status, MORI_OK, "{message}");
        };
        for _ in 0..4 {
            send(s);
        }
        let launches = stat("kernel_launches");
        let (mut graph, mut exec) = (null_mut(), null_mut());
        // SAFETY: live streams and buffers; the graph and its instance are destroyed below.
        unsafe {
            assert_eq!(hipStreamBeginCapture(s, CAPTURE_RELAXED), 0);
            send(s);
            for _ in 0..6 {
                send(t);
            }
            assert_eq!(
                hipStreamEndCapture(s, &mut graph),
                0,
                "S's capture survives"
            );
            assert_eq!(
                hipGraphInstantiate(&mut exec, graph, null_mut(), null_mut(), 0),
                0
            );
            dst.write(&vec![9u8; pages * 32]);
            assert_eq!(hipGraphLaunch(exec, s), 0);
            assert_eq!(hipStreamSynchronize(s), 0);
            assert_eq!(hipStreamSynchronize(t), 0);
        }
        assert_eq!(
            stat("kernel_launches"),
            launches + 6,
            "T's sends ran the kernel"
        );
        assert_eq!(stat("invalidated_captures"), 0);
        let mut after = vec![0u8; pages * 32];
        dst.to_host(&mut after);
        assert!(after == uploaded_result(7), "the replayed copies");
        // SAFETY: made above, destroyed once.
        unsafe {
            hipGraphExecDestroy(exec);
            hipGraphDestroy(graph);
            hipStreamDestroy(s);
            hipStreamDestroy(t);
        }
    }

    /// Issue 35.2: stream S waits for a flag that this thread raises only at the end, with one
    /// kernel send queued behind the wait. Sends on stream T (small, then one of 1500 rects that
    /// outgrows the first table buffers, with flags 0 and with the kernel) never wait for S: no
    /// wait of the stand-in runs past FAKE_HIP_HANG_MS.
    fn blocked_stream() {
        static FLAG: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let (s, t) = (stream_on(0), stream_on(0));
        let small_src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let small_dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        const PAGES: usize = 1500;
        let big_src = DeviceBuffer::from_host(&patterned(2 * PAGES * 16, 3));
        let big_dst = DeviceBuffer::from_host(&vec![0u8; 2 * PAGES * 16]);
        let small = |stream, flags| {
            let options = MoriSendOptions {
                backend: MORI_BACKEND_HIP,
                flags,
                stream,
            };
            // SAFETY: device buffers alive until the streams are synchronized below.
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[small_src.pointer.cast_const()],
                    &[small_dst.pointer],
                    &options,
                )
            };
            assert_eq!(status, MORI_OK, "{message}");
        };
        // SAFETY: a live stream; the flag outlives it.
        let waits = unsafe { hipStreamWaitValue32(s, FLAG.as_ptr().cast(), 1, 0, u32::MAX) };
        assert_eq!(waits, 0);
        small(s, MORI_SEND_COPY_KERNEL);
        for flags in [MORI_SEND_COPY_KERNEL, 0, MORI_SEND_COPY_KERNEL, 0] {
            small(t, flags);
        }
        let params = MoriTpSliceParams {
            prefill_tp_size: 1,
            prefill_tp_rank: 0,
            decode_tp_size: 1,
            decode_tp_rank: 0,
            total_kv_heads: 1,
            page_size: 1,
            src_item_len: 16,
            dst_item_len: 16,
        };
        let mut config = MoriTpSliceConfig::default();
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { mori_tp_slice_config(&params, &mut config) },
            MORI_OK
        );
        let pages: Vec<i32> = (0..PAGES as i32).map(|i| 2 * i).collect();
        for flags in [0, MORI_SEND_COPY_KERNEL] {
            let buffers = MoriKvBuffers {
                src: &big_src.pointer.cast_const(),
                dst: &big_dst.pointer,
                num_buffers: 1,
                src_capacity: (2 * PAGES * 16) as u64,
                dst_capacity: (2 * PAGES * 16) as u64,
            };
            let options = MoriSendOptions {
                backend: MORI_BACKEND_HIP,
                flags,
                stream: t,
            };
            // SAFETY: device buffers of the stated capacities, alive until T is synchronized.
            let status = unsafe {
                mori_send_kvcache(
                    &config,
                    &buffers,
                    pages.as_ptr(),
                    pages.as_ptr(),
                    PAGES,
                    &options,
                )
            };
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
        }
        // SAFETY: T's own work does not wait for S.
        assert_eq!(unsafe { hipStreamSynchronize(t) }, 0);
        assert_eq!(stat("hangs"), 0, "nothing waited for S");
        FLAG.store(1, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: the flag is raised.
        assert_eq!(unsafe { hipStreamSynchronize(s) }, 0);
        let (mut got, want) = (vec![0u8; 2 * PAGES * 16], patterned(2 * PAGES * 16, 3));
        big_dst.to_host(&mut got);
        for page in 0..2 * PAGES {
            let bytes = page * 16..page * 16 + 16;
            let expected = if page % 2 == 0 {
                &want[bytes.clone()]
            } else {
                &[0u8; 16][..]
            };
            assert_eq!(&got[bytes], expected, "page {page}");
        }
        // SAFETY: made above.
        unsafe {
            hipStreamDestroy(s);
            hipStreamDestroy(t);
        }
    }

    /// Issue 35.3: device 1's memory that device 0 can never reach (hipDeviceCanAccessPeer says
    /// no) is refused for the kernel before anything is launched, naming both devices; flags 0
    /// take the per-rect copies instead, which need no peer access.
    fn no_peer() {
        let kernel = kernel_options();
        let (status, message, after) = small_send_in(Memory::Device(1), kernel);
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        assert!(
            message.contains("memory of device 1, which a kernel on device 0 cannot reach")
                && message.contains("hipDeviceCanAccessPeer"),
            "{message}"
        );
        assert_eq!(after, vec![9u8; 4 * 32], "a refused call writes nothing");
        let (launches, copies) = (stat("kernel_launches"), stat("memcpy2d_calls"));
        let auto = MoriSendOptions {
            flags: MORI_SEND_SYNCHRONIZE,
            ..kernel
        };
        let (status, message, after) = small_send_in(Memory::Device(1), auto);
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        assert_eq!(stat("kernel_launches"), launches);
        assert_eq!(stat("memcpy2d_calls"), copies + 2);
    }

    /// Issue 31.2 through the real bindings: flags 0 give one kernel launch for a call of two or
    /// more (buffer, rect) copies (send, pack and unpack alike) and one hipMemcpy2DAsync for a
    /// call of one; MORI_SEND_MEMCPY2D gives one hipMemcpy2DAsync per (buffer, rect); both
    /// flags at once are refused.
    fn paths() {
        let count = || (stat("kernel_launches"), stat("memcpy2d_calls"));
        let sync = |flags| MoriSendOptions {
            backend: MORI_BACKEND_HIP,
            flags: MORI_SEND_SYNCHRONIZE | flags,
            stream: null_mut(),
        };
        for (flags, launches, copies) in [(0, 1, 0), (MORI_SEND_MEMCPY2D, 0, 2)] {
            let before = count();
            let (status, message, after) = small_send_in(Memory::Device(0), sync(flags));
            assert_eq!(
                (status, after),
                (MORI_OK, small_send_result(7)),
                "{message}"
            );
            assert_eq!(
                count(),
                (before.0 + launches, before.1 + copies),
                "flags {flags:#x}: 1 buffer x 2 rects"
            );
        }
        // One page: one rect of one buffer, one copy.
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let config = crate::common::config_2_to_4();
        let buffers = MoriKvBuffers {
            src: &src.pointer.cast_const(),
            dst: &dst.pointer,
            num_buffers: 1,
            src_capacity: 4 * 64,
            dst_capacity: 4 * 32,
        };
        let before = count();
        // SAFETY: device buffers of the stated capacities; the options synchronize.
        let status = unsafe { mori_send_kvcache(&config, &buffers, &2, &1, 1, &sync(0)) };
        assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
        assert_eq!(
            count(),
            (before.0, before.1 + 1),
            "one copy: hipMemcpy2DAsync"
        );
        // Pack and unpack: one launch each with flags 0.
        let mut staging_len = 0u64;
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { mori_tp_staging_len(&config, 3, &mut staging_len) },
            MORI_OK
        );
        let region = DeviceBuffer::from_host(&vec![0u8; staging_len as usize]);
        let pages = [0, 1, 3];
        let before = count();
        // SAFETY: device buffers and region of the stated sizes; the options synchronize.
        unsafe {
            let status = mori_pack_kvcache(
                &config,
                &src.pointer.cast_const(),
                1,
                4 * 64,
                pages.as_ptr(),
                3,
                region.pointer,
                staging_len,
                &sync(0),
            );
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            let status = mori_unpack_kvcache(
                &config,
                region.pointer,
                staging_len,
                &dst.pointer,
                1,
                4 * 32,
                pages.as_ptr(),
                3,
                &sync(0),
            );
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
        }
        assert_eq!(
            count(),
            (before.0 + 2, before.1),
            "pack and unpack: one launch each"
        );
        let (status, message, _) = small_send_in(
            Memory::Device(0),
            sync(MORI_SEND_COPY_KERNEL | MORI_SEND_MEMCPY2D),
        );
        assert_eq!(status, MORI_ERR_INVALID_ARGUMENT, "{message}");
        assert!(
            message.contains("sets both MORI_SEND_COPY_KERNEL"),
            "{message}"
        );
    }

    /// Issue 35.3: a device pool destroyed after hipDeviceReset does not free its memory again
    /// (the reset freed it; by now it may be a new allocation's: the unit tests check that case
    /// on the recording runtime, whose allocator hands addresses out again). And a kernel send
    /// after the reset loads the kernel again (the reset also destroyed the library's relay
    /// streams, which it then no longer uses).
    fn pool_reset() {
        let options = MoriTpPoolOptions {
            capacity: 1 << 16,
            min_slot: 0,
            memory: MORI_TP_POOL_DEVICE,
            flags: 0,
        };
        let (status, message, _) = small_send_in(Memory::Device(0), kernel_options());
        assert_eq!(status, MORI_OK, "{message}");
        let mut pool = 0;
        // SAFETY: valid pointers.
        assert_eq!(unsafe { mori_tp_pool_create(&options, &mut pool) }, MORI_OK);
        // SAFETY: no buffer of this test is alive across the reset.
        assert_eq!(unsafe { hipDeviceReset() }, 0);
        assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
        assert_eq!(
            stat("bad_frees"),
            0,
            "no hipFree of memory the reset freed (it may be a new allocation's by now)"
        );
        let loads = stat("module_loads");
        let (status, message, after) = small_send_in(Memory::Device(0), kernel_options());
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        assert_eq!(stat("module_loads"), loads + 1);
    }

    pub(super) fn the_copy_kernel_moves_device_memory_byte_exact() {
        odd_deployments(&mut *device_sender(kernel_options()));
        for (heads, bph, p_tp, d_tp) in [
            (4, 256, 2, 8),
            (8, 128, 8, 2),
            (12, 72, 6, 4),
            (1, 1152, 4, 2),
        ] {
            let request = fragmented_request(u64::from(heads * 100 + p_tp * 10 + d_tp), 6);
            transfer(
                heads,
                bph,
                4,
                p_tp,
                d_tp,
                16,
                &request,
                &mut *device_sender(kernel_options()),
            );
        }
        pack_and_unpack_match_a_direct_send();
        // Pageable host memory is not memory a kernel reaches: a GPU would fault and abort the
        // process, so the library asks the runtime about each buffer first and refuses it,
        // writing nothing (the stand-in, like HIP 5, does not know pageable memory).
        let (status, message, unchanged) = crate::common::small_send(&kernel_options());
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        assert!(
            message.contains("hipPointerGetAttributes(source buffer 0, ")
                && message.contains("hipErrorInvalidValue (1)")
                && message.contains("pageable host memory"),
            "{message}"
        );
        assert!(unchanged);
        // Every table went up from pinned memory: none of the uploads that HIP performs
        // synchronously, waiting for the stream.
        assert_eq!(stat("pageable_async_copies"), 0);
    }

    pub(super) fn a_failing_launch_is_reported_and_writes_nothing(code: &str) {
        let (status, message, after) = small_send_in(Memory::Device(0), kernel_options());
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "mori_send_kvcache: GPU error: hipModuleLaunchKernel(mori_copy_kernel, grid (1, 1, 1)",
            &format!("returned hipErrorUnknown ({code})"),
            "(1 buffers x 2 rects, 3 rows per buffer)",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(after, vec![9u8; 4 * 32], "a failed launch writes nothing");
    }

    /// Pack on the prefill side and unpack on the decode side, both through the kernel on
    /// device memory, leave the decode buffers as one host send does.
    fn pack_and_unpack_match_a_direct_send() {
        let request = fragmented_request(11, 5);
        let (heads, bph, p_tp, d_tp, page_size) = (4u32, 256usize, 2u32, 8u32, 16usize);
        let src = common::SideBuffers::identified(
            heads,
            p_tp,
            page_size,
            bph,
            request.src_capacity_pages,
            4,
        );
        let dst = common::SideBuffers::sentinel(
            heads,
            d_tp,
            page_size,
            bph,
            request.dst_capacity_pages,
            4,
        );
        let host = MoriSendOptions {
            backend: MORI_BACKEND_HOST,
            flags: 0,
            stream: null_mut(),
        };
        for (p, d) in [(0, 0), (0, 3), (1, 5)] {
            let params = MoriTpSliceParams {
                prefill_tp_size: p_tp,
                prefill_tp_rank: p,
                decode_tp_size: d_tp,
                decode_tp_rank: d,
                total_kv_heads: heads,
                page_size: page_size as u32,
                src_item_len: src.item_len() as u64,
                dst_item_len: dst.item_len() as u64,
            };
            let mut config = MoriTpSliceConfig::default();
            // SAFETY: valid pointers.
            assert_eq!(
                unsafe { mori_tp_slice_config(&params, &mut config) },
                MORI_OK
            );
            let n = request.src_pages.len();
            let mut staging_len = 0u64;
            // SAFETY: valid pointers.
            assert_eq!(
                unsafe { mori_tp_staging_len(&config, n, &mut staging_len) },
                MORI_OK
            );
            let region = (staging_len * 4) as usize;

            // Expected: a direct host send.
            let mut want = dst.ranks[d as usize].clone();
            {
                let mut want_slices: Vec<&mut [u8]> =
                    want.iter_mut().map(Vec::as_mut_slice).collect();
                let src_slices: Vec<&[u8]> =
                    src.ranks[p as usize].iter().map(Vec::as_slice).collect();
                let srcs: Vec<*const c_void> =
                    src_slices.iter().map(|b| b.as_ptr().cast()).collect();
                let dsts: Vec<*mut c_void> = want_slices
                    .iter_mut()
                    .map(|b| b.as_mut_ptr().cast())
                    .collect();
                let buffers = MoriKvBuffers {
                    src: srcs.as_ptr(),
                    dst: dsts.as_ptr(),
                    num_buffers: 4,
                    src_capacity: src_slices[0].len() as u64,
                    dst_capacity: want_slices[0].len() as u64,
                };
                // SAFETY: live host buffers.
                let status = unsafe {
                    mori_send_kvcache(
                        &config,
                        &buffers,
                        request.src_pages.as_ptr(),
                        request.dst_pages.as_ptr(),
                        n,
                        &host,
                    )
                };
                assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            }

            let src_dev: Vec<DeviceBuffer> = src.ranks[p as usize]
                .iter()
                .map(|b| DeviceBuffer::from_host(b))
                .collect();
            let dst_dev: Vec<DeviceBuffer> = dst.ranks[d as usize]
                .iter()
                .map(|b| DeviceBuffer::from_host(b))
                .collect();
            let staging = DeviceBuffer::from_host(&vec![0u8; region.max(1)]);
            let srcs: Vec<*const c_void> = src_dev.iter().map(|b| b.pointer.cast_const()).collect();
            let dsts: Vec<*mut c_void> = dst_dev.iter().map(|b| b.pointer).collect();
            // SAFETY: device buffers and region of the stated sizes.
            let status = unsafe {
                mori_pack_kvcache(
                    &config,
                    srcs.as_ptr(),
                    4,
                    src_dev[0].len as u64,
                    request.src_pages.as_ptr(),
                    n,
                    staging.pointer,
                    region as u64,
                    &kernel_options(),
                )
            };
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            // SAFETY: as above.
            let status = unsafe {
                mori_unpack_kvcache(
                    &config,
                    staging.pointer,
                    region as u64,
                    dsts.as_ptr(),
                    4,
                    dst_dev[0].len as u64,
                    request.dst_pages.as_ptr(),
                    n,
                    &kernel_options(),
                )
            };
            assert_eq!(status, MORI_OK, "{}", crate::common::last_error());
            for (device, want) in dst_dev.iter().zip(&want) {
                let mut got = vec![0u8; want.len()];
                device.to_host(&mut got);
                assert_eq!(&got, want, "pair ({p}, {d}) through pack + unpack");
            }
        }
    }
}
