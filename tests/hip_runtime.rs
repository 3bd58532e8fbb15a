//! The HIP backend through the C ABI, on whatever runtime this build links: none (built without
//! the `hip` feature), libamdhip64 with no device (it answers hipErrorNoDevice), or a real GPU.
//! Requesting HIP never crashes: it either refuses with MORI_ERR_BACKEND_UNAVAILABLE and a
//! message that says why, or moves the bytes exactly; AUTO always moves them.
//!
//! MORI_TP_REQUIRE_HIP=1 (CI's `--features hip` run) makes a build without the feature a
//! failure; MORI_TP_REQUIRE_HIP_DEVICE=1 (a GPU runner) makes a missing device a failure.

mod common;

use std::ffi::CStr;
use std::process::Command;
use std::ptr::null_mut;

use common::{Sender, fragmented_request, odd_deployments, transfer};
use mori_tp::backend::hip_device_present;
use mori_tp::ffi::*;

use common::required;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

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
        assert_eq!(status, MORI_OK, "{}", last_error());
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

/// 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair (1, 3), one-token pages.
fn config_2_to_4() -> MoriTpSliceConfig {
    let params = MoriTpSliceParams {
        prefill_tp_size: 2,
        prefill_tp_rank: 1,
        decode_tp_size: 4,
        decode_tp_rank: 3,
        total_kv_heads: 8,
        page_size: 1,
        src_item_len: 64,
        dst_item_len: 32,
    };
    let mut config = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_slice_config(&params, &mut config) },
        MORI_OK
    );
    config
}

/// One small send over host memory: 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair
/// (1, 3), one-token pages 0, 1, 3 (two rects), two buffers. Returns the status, the message
/// (if it failed) and whether every destination byte is still what it was.
fn small_send(options: &MoriSendOptions) -> (MoriStatus, String, bool) {
    let src = [vec![7u8; 4 * 64], vec![8u8; 4 * 64]];
    let mut dst = [vec![9u8; 4 * 32], vec![9u8; 4 * 32]];
    let config = config_2_to_4();
    let srcs = [src[0].as_ptr().cast(), src[1].as_ptr().cast()];
    let [d0, d1] = &mut dst;
    let dsts = [d0.as_mut_ptr().cast(), d1.as_mut_ptr().cast()];
    let buffers = MoriKvBuffers {
        src: srcs.as_ptr(),
        dst: dsts.as_ptr(),
        num_buffers: 2,
        src_capacity: 4 * 64,
        dst_capacity: 4 * 32,
    };
    let pages = [0, 1, 3];
    // SAFETY: valid pointers and lengths; the copies are complete on return or refused.
    let status = unsafe {
        mori_send_kvcache(
            &config,
            &buffers,
            pages.as_ptr(),
            pages.as_ptr(),
            3,
            options,
        )
    };
    let message = if status == MORI_OK {
        String::new()
    } else {
        last_error()
    };
    (status, message, dst.iter().flatten().all(|&b| b == 9))
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
        let (status, message, unchanged) = small_send(&options);
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
    let exe = std::env::current_exe().expect("test executable path");
    // Everything works; every hipMemcpy2DAsync fails; every kernel launch fails.
    for injected in [
        None,
        Some(("FAKE_HIP_COPY_STATUS", "999")),
        Some(("FAKE_HIP_LAUNCH_STATUS", "999")),
    ] {
        let mut child = Command::new(&exe);
        child
            .args(["--exact", "fake_runtime_child", "--ignored", "--nocapture"])
            .env("LD_PRELOAD", &fake)
            .env(CHILD, "1")
            .env_remove("FAKE_HIP_DEVICES")
            .env_remove("FAKE_HIP_COPY_STATUS")
            .env_remove("FAKE_HIP_LAUNCH_STATUS");
        if let Some((var, status)) = injected {
            child.env(var, status);
        }
        let output = child.output().expect("run the child test");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            output.status.success() && text.contains("1 passed"),
            "{injected:?}:\n{text}"
        );
    }
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
            let (status, message, unchanged) = small_send(&sync);
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
            let (status, message, unchanged) = small_send(&sync);
            assert_eq!((status, unchanged), (MORI_OK, false), "{message}");
            // AUTO chose HIP: it takes a stream, which the host backend refuses.
            let mut fake_stream = 0u8;
            let auto = MoriSendOptions {
                backend: MORI_BACKEND_AUTO,
                flags: MORI_SEND_SYNCHRONIZE,
                stream: (&raw mut fake_stream).cast(),
            };
            let (status, message, _) = small_send(&auto);
            assert_eq!(status, MORI_OK, "{message}");
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

    // hip/hip_runtime_api.h; resolved to tests/fake_hip in the child.
    unsafe extern "C" {
        fn hipMalloc(pointer: *mut *mut c_void, size: usize) -> i32;
        fn hipFree(pointer: *mut c_void) -> i32;
        fn hipMemcpy(dst: *mut c_void, src: *const c_void, size: usize, kind: i32) -> i32;
    }
    const HOST_TO_DEVICE: i32 = 1;
    const DEVICE_TO_HOST: i32 = 2;

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

    /// A sender that mirrors the buffers into device memory, sends with `options` and copies
    /// the destinations back; the status must be `want` (on failure, with the message parts).
    fn device_sender(options: MoriSendOptions) -> Box<Sender<'static>> {
        Box::new(move |plan, request, src, dst| {
            let config = MoriTpSliceConfig::from(plan.config());
            let src_dev: Vec<DeviceBuffer> =
                src.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let dst_dev: Vec<DeviceBuffer> =
                dst.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let src_ptrs: Vec<*const c_void> =
                src_dev.iter().map(|b| b.pointer.cast_const()).collect();
            let dst_ptrs: Vec<*mut c_void> = dst_dev.iter().map(|b| b.pointer).collect();
            let buffers = MoriKvBuffers {
                src: src_ptrs.as_ptr(),
                dst: dst_ptrs.as_ptr(),
                num_buffers: src_ptrs.len(),
                src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
                dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            };
            // SAFETY: device buffers of the stated capacities, synchronised before return.
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
            assert_eq!(status, MORI_OK, "{}", last_error());
            for (device, host) in dst_dev.iter().zip(dst.iter_mut()) {
                device.to_host(host);
            }
            None
        })
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
        // Pageable host memory is not device memory: a GPU kernel would fault on it, and the
        // stand-in refuses the launch as hipErrorIllegalAddress, writing nothing.
        let (status, message, unchanged) = small_send(&kernel_options());
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        assert!(
            message.contains("hipModuleLaunchKernel(mori_copy_kernel")
                && message.contains("hipErrorIllegalAddress (700)"),
            "{message}"
        );
        assert!(unchanged);
    }

    pub(super) fn a_failing_launch_is_reported_and_writes_nothing(code: &str) {
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let initial = [9u8; 4 * 32];
        let dst = DeviceBuffer::from_host(&initial);
        let config = super::config_2_to_4();
        let srcs = [src.pointer.cast_const()];
        let dsts = [dst.pointer];
        let buffers = MoriKvBuffers {
            src: srcs.as_ptr(),
            dst: dsts.as_ptr(),
            num_buffers: 1,
            src_capacity: 4 * 64,
            dst_capacity: 4 * 32,
        };
        let pages = [0, 1, 3];
        // SAFETY: device buffers of the stated capacities.
        let status = unsafe {
            mori_send_kvcache(
                &config,
                &buffers,
                pages.as_ptr(),
                pages.as_ptr(),
                3,
                &kernel_options(),
            )
        };
        let message = last_error();
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "mori_send_kvcache: GPU error: hipModuleLaunchKernel(mori_copy_kernel, grid (1, 1, 1)",
            &format!("returned hipErrorUnknown ({code})"),
            "(1 buffers x 2 rects, 3 rows per buffer)",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        let mut after = [0u8; 4 * 32];
        dst.to_host(&mut after);
        assert_eq!(after, initial, "a failed launch writes nothing");
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
                assert_eq!(status, MORI_OK, "{}", last_error());
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
            assert_eq!(status, MORI_OK, "{}", last_error());
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
            assert_eq!(status, MORI_OK, "{}", last_error());
            for (device, want) in dst_dev.iter().zip(&want) {
                let mut got = vec![0u8; want.len()];
                device.to_host(&mut got);
                assert_eq!(&got, want, "pair ({p}, {d}) through pack + unpack");
            }
        }
    }
}
