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

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

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
    assert!(
        !required("MORI_TP_REQUIRE_HIP_DEVICE"),
        "{test}: MORI_TP_REQUIRE_HIP_DEVICE=1 but no HIP device is usable"
    );
    eprintln!("skipped {test}: no HIP device (or built without the `hip` feature)");
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

/// One small send over host memory: 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair
/// (1, 3), one-token pages 0, 1, 3 (two rects), two buffers. Returns the status, the message
/// (if it failed) and whether every destination byte is still what it was.
fn small_send(options: &MoriSendOptions) -> (MoriStatus, String, bool) {
    let src = [vec![7u8; 4 * 64], vec![8u8; 4 * 64]];
    let mut dst = [vec![9u8; 4 * 32], vec![9u8; 4 * 32]];
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
        eprintln!("skipped: a HIP device is present, so MORI_BACKEND_HIP is available");
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
    if !built_with_hip {
        eprintln!("skipped: built without the `hip` feature");
        return;
    }
    let fake = match common::build_fake_hip() {
        Ok(path) => path,
        Err(why) => {
            assert!(
                !required("MORI_TP_REQUIRE_HIP"),
                "MORI_TP_REQUIRE_HIP=1 but {why}"
            );
            eprintln!("skipped: {why}");
            return;
        }
    };
    let exe = std::env::current_exe().expect("test executable path");
    for copy_status in [None, Some("999")] {
        let mut child = Command::new(&exe);
        child
            .args(["--exact", "fake_runtime_child", "--ignored", "--nocapture"])
            .env("LD_PRELOAD", &fake)
            .env(CHILD, "1")
            .env_remove("FAKE_HIP_DEVICES")
            .env_remove("FAKE_HIP_COPY_STATUS");
        if let Some(status) = copy_status {
            child.env("FAKE_HIP_COPY_STATUS", status);
        }
        let output = child.output().expect("run the child test");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            output.status.success() && text.contains("1 passed"),
            "FAKE_HIP_COPY_STATUS={copy_status:?}:\n{text}"
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
        }
    }
}
