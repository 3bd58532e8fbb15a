//! The CUDA backend through the C ABI, on every machine: over tests/fake_cuda (a host-memory
//! libcuda.so.1 with the driver's context, stream, event and capture rules), which this test
//! builds and puts first on the loader's path of child processes, so that the library's real CUDA
//! runtime (the loader, the symbol look-ups, the context handling, the argument
//! marshalling) runs end to end; and without any driver, where requesting CUDA must be refused
//! and AUTO must copy on the host.
//!
//! MORI_TP_REQUIRE_CUDA=1 (CI's `--features cuda` run) makes a build without the feature, or a
//! missing C++ compiler, a failure instead of a skip.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::null_mut;

use mori_tp::ffi::*;

/// Whether the library could load a CUDA driver in this process (a real one, on a machine with
/// an NVIDIA driver).
fn a_real_driver_is_installed() -> bool {
    ["libcuda.so", "libcuda.so.1"].iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL");
        // SAFETY: dlopen with a NUL-terminated name; the handle is closed at once.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            // SAFETY: the handle just opened.
            unsafe { libc::dlclose(handle) };
        }
        !handle.is_null()
    })
}

#[test]
fn without_the_feature_or_a_driver_cuda_is_refused_and_auto_copies_on_the_host() {
    if std::env::var_os(SCENARIO).is_some() {
        return; // a child of the stand-in test runs its scenario only
    }
    if !cfg!(feature = "cuda") && common::required("MORI_TP_REQUIRE_CUDA") {
        panic!("MORI_TP_REQUIRE_CUDA=1 but this test was built without `--features cuda`");
    }
    if cfg!(feature = "cuda") && a_real_driver_is_installed() {
        common::skip(
            "without_the_feature_or_a_driver_cuda_is_refused",
            "a CUDA driver is installed here, so MORI_BACKEND_CUDA may be available",
        );
        return;
    }
    for flags in [0, MORI_SEND_SYNCHRONIZE, MORI_SEND_COPY_KERNEL] {
        let cuda = MoriSendOptions {
            backend: MORI_BACKEND_CUDA,
            flags,
            stream: null_mut(),
        };
        let (status, message, unchanged) = crate::common::small_send(&cuda);
        assert_eq!(status, MORI_ERR_BACKEND_UNAVAILABLE, "{message}");
        assert!(unchanged, "a refused call writes nothing");
        let why = if cfg!(feature = "cuda") {
            "backend unavailable: the CUDA backend needs the CUDA driver: the CUDA driver library \
             was not found (tried libcuda.so.1, libcuda.so)"
        } else {
            "backend unavailable: the CUDA backend is not built in: this libmori_tp was compiled \
             without the `cuda` cargo feature (rebuild with `cargo build --release --features \
             cuda`)"
        };
        assert!(message.contains(why), "{message}");
    }
    assert!(!mori_tp::backend::cuda_device_present());
    if !mori_tp::backend::hip_device_present() {
        let auto = MoriSendOptions {
            backend: MORI_BACKEND_AUTO,
            flags: 0,
            stream: null_mut(),
        };
        let (status, message, unchanged) = crate::common::small_send(&auto);
        assert_eq!((status, unchanged), (MORI_OK, false), "{message}");
    }
}

/// Set in the environment of the child processes: which scenario to run.
const SCENARIO: &str = "MORI_TP_FAKE_CUDA_SCENARIO";

/// tests/fake_cuda built as `libcuda.so.1` (with a `libcuda.so` link to it) in a folder of its
/// own for `variant` (preprocessor `defines`): the folder, for the children's LD_LIBRARY_PATH.
fn build_fake_cuda(variant: &str, defines: &[&str]) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = common::scratch(&["fake_cuda", variant]);
    let partial = out.join(format!("libcuda.so.1.{}", std::process::id()));
    let output = Command::new("c++")
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
        ])
        .args(defines)
        .arg(root.join("tests/fake_cuda/fake_cuda.cpp"))
        .arg("-o")
        .arg(&partial)
        .output()
        .map_err(|e| format!("cannot run c++ ({e}): a C++ compiler is needed"))?;
    if !output.status.success() {
        return Err(format!(
            "c++ could not build tests/fake_cuda/fake_cuda.cpp:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    std::fs::rename(&partial, out.join("libcuda.so.1")).map_err(|e| e.to_string())?;
    let link = out.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link).map_err(|e| e.to_string())?;
    Ok(out)
}

/// Runs the ignored test `fake_cuda_scenario` of this executable in a child process whose loader
/// finds `driver`'s libcuda.so.1 first, with `env` on top of a clean FAKE_CUDA_* environment:
/// whether it passed, and its output.
fn run_child(driver: &Path, scenario: &str, env: &[(&str, &str)]) -> (bool, String) {
    let exe = std::env::current_exe().expect("test executable path");
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", driver.display()),
        _ => driver.display().to_string(),
    };
    let mut child = Command::new(&exe);
    child
        .args(["--exact", "fake_cuda_scenario", "--ignored", "--nocapture"])
        .env("LD_LIBRARY_PATH", path)
        .env(SCENARIO, scenario);
    for var in [
        "FAKE_CUDA_DEVICES",
        "FAKE_CUDA_COPY_STATUS",
        "FAKE_CUDA_LAUNCH_STATUS",
        "FAKE_CUDA_NO_PEER",
        "FAKE_CUDA_HANG_MS",
        "FAKE_CUDA_MODULE_LOAD_STATUS",
        "FAKE_CUDA_MODULE_LOAD_FAILS",
        "FAKE_CUDA_MAX_PITCH",
        "FAKE_CUDA_LAUNCH_SLEEP_MS",
        "FAKE_CUDA_DRIVER_VERSION",
        "FAKE_CUDA_WIDE_LOAD_STATUS",
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

/// Every path of the CUDA backend over the stand-in driver, each scenario in its own process:
/// the bytes of every path (per rect, the kernel, the library's choice; pack and unpack; the
/// pair functions; a device pool), no device, a driver without a function the library needs,
/// graph capture on this and other threads, streams of a second device and of a context of the
/// caller's own, host memory of each kind, and failing copies and launches.
#[test]
fn the_cuda_backend_runs_over_a_stand_in_driver() {
    let test = "the_cuda_backend_runs_over_a_stand_in_driver";
    if std::env::var_os(SCENARIO).is_some() {
        return;
    }
    if !cfg!(feature = "cuda") {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_CUDA",
            "built without the `cuda` feature",
        );
        return;
    }
    let drivers = build_fake_cuda("driver", &[]).and_then(|driver| {
        Ok((
            driver,
            build_fake_cuda("no_capture_mode", &["-DFAKE_CUDA_NO_CAPTURE_MODE"])?,
        ))
    });
    let (driver, old_driver) = match drivers {
        Ok(drivers) => drivers,
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_CUDA", &why);
            return;
        }
    };
    for (scenario, runtime, env) in [
        ("bytes", &driver, &[][..]),
        ("no_device", &driver, &[("FAKE_CUDA_DEVICES", "0")][..]),
        ("old_driver", &old_driver, &[][..]),
        ("capture", &driver, &[][..]),
        ("inline_table", &driver, &[][..]),
        ("two_devices", &driver, &[("FAKE_CUDA_DEVICES", "2")][..]),
        ("contexts", &driver, &[][..]),
        ("host_memory", &driver, &[][..]),
        (
            "failing_copy",
            &driver,
            &[("FAKE_CUDA_COPY_STATUS", "999")][..],
        ),
        (
            "failing_launch",
            &driver,
            &[("FAKE_CUDA_LAUNCH_STATUS", "999")][..],
        ),
        ("held_stream", &driver, &[("FAKE_CUDA_HANG_MS", "2000")][..]),
        (
            "load_failure",
            &driver,
            &[
                ("FAKE_CUDA_MODULE_LOAD_STATUS", "2"),
                ("FAKE_CUDA_MODULE_LOAD_FAILS", "2"),
            ][..],
        ),
        ("reused_address", &driver, &[][..]),
        ("null_stream_contexts", &driver, &[][..]),
        ("max_pitch", &driver, &[("FAKE_CUDA_MAX_PITCH", "48")][..]),
        (
            "fork",
            &driver,
            &[("FAKE_CUDA_LAUNCH_SLEEP_MS", "1500")][..],
        ),
        ("wide_table", &driver, &[][..]),
        (
            "wide_table",
            &driver,
            &[("FAKE_CUDA_DRIVER_VERSION", "12010")][..],
        ),
        (
            "wide_table_old_driver",
            &driver,
            &[("FAKE_CUDA_DRIVER_VERSION", "12000")][..],
        ),
        (
            "wide_load_failure",
            &driver,
            &[("FAKE_CUDA_WIDE_LOAD_STATUS", "218")][..],
        ),
    ] {
        let (passed, text) = run_child(runtime, scenario, env);
        assert!(passed, "{scenario}:\n{text}");
    }
}

/// hip/driver_cases.cpp (the device check's driver_cases step: a held stream, a second thread,
/// graph capture with another thread sending, a cuCtxCreate context, CU_STREAM_PER_THREAD) built
/// with the host compiler against this build's libmori_tp.so and run over the stand-in driver.
#[test]
fn the_device_checks_driver_cases_pass_over_the_stand_in_driver() {
    let test = "the_device_checks_driver_cases_pass_over_the_stand_in_driver";
    if std::env::var_os(SCENARIO).is_some() {
        return;
    }
    if !cfg!(feature = "cuda") {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_CUDA",
            "built without the `cuda` feature",
        );
        return;
    }
    let driver = match build_fake_cuda("driver_for_cases", &[]) {
        Ok(driver) => driver,
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_CUDA", &why);
            return;
        }
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = std::env::current_exe().expect("test executable path");
    let library = exe
        .parent()
        .expect("target/<profile>/deps")
        .join("libmori_tp.so");
    assert!(
        library.is_file(),
        "cargo did not build {}",
        library.display()
    );
    let out = common::scratch(&["driver_cases"]);
    std::fs::create_dir_all(&out).expect("scratch");
    // The library's SONAME (libmori_tp.so.<ABI>) is what the program's loader asks for.
    let soname = out.join(format!("libmori_tp.so.{MORI_TP_ABI_VERSION}"));
    let _ = std::fs::remove_file(&soname);
    std::os::unix::fs::symlink(&library, &soname).expect("symlink the library");
    let program = out.join(format!("driver_cases.{}", std::process::id()));
    let built = Command::new("c++")
        .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-I{}", root.join("include").display()))
        .arg(root.join("hip/driver_cases.cpp"))
        .arg(&library)
        .args(["-ldl", "-pthread", "-o"])
        .arg(&program)
        .output()
        .expect("run c++");
    assert!(
        built.status.success(),
        "c++ hip/driver_cases.cpp:
{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let path = format!("{}:{}", driver.display(), out.display());
    let run = Command::new(&program)
        .env("LD_LIBRARY_PATH", path)
        .env("FAKE_CUDA_HANG_MS", "2000")
        .output()
        .expect("run driver_cases");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let _ = std::fs::remove_file(&program);
    assert!(
        run.status.success(),
        "driver_cases over the stand-in:
{text}"
    );
    for case in [
        "held_stream",
        "second_thread",
        "graph_capture",
        "non_primary_context",
        "per_thread_stream",
    ] {
        assert!(
            text.contains(&format!("PASS {case}:")),
            "{case}:
{text}"
        );
    }
}

#[test]
#[ignore = "run by the_cuda_backend_runs_over_a_stand_in_driver"]
fn fake_cuda_scenario() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        eprintln!("skipped: runs only as a child of the stand-in driver test");
        return;
    };
    #[cfg(feature = "cuda")]
    driver::scenario(&scenario);
    #[cfg(not(feature = "cuda"))]
    panic!("{scenario}: built without the `cuda` feature");
}

#[cfg(feature = "cuda")]
mod driver {
    use std::ffi::{c_char, c_int, c_uint, c_void};
    use std::ptr::null_mut;

    use super::*;
    use common::{Sender, fragmented_request, odd_deployments, transfer};

    type Ctx = *mut c_void;
    type Stream = *mut c_void;

    /// The stand-in driver's functions the scenarios call, from the libcuda.so.1 the child's
    /// loader finds (the stand-in: the parent put it first on LD_LIBRARY_PATH).
    struct Cu {
        primary_ctx_retain: unsafe extern "C" fn(*mut Ctx, c_int) -> c_int,
        ctx_set_current: unsafe extern "C" fn(Ctx) -> c_int,
        ctx_get_current: unsafe extern "C" fn(*mut Ctx) -> c_int,
        ctx_create: unsafe extern "C" fn(*mut Ctx, c_uint, c_int) -> c_int,
        ctx_enable_peer_access: unsafe extern "C" fn(Ctx, c_uint) -> c_int,
        mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int,
        mem_free: unsafe extern "C" fn(u64) -> c_int,
        mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int,
        mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int,
        memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
        memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
        stream_create: unsafe extern "C" fn(*mut Stream, c_uint) -> c_int,
        stream_synchronize: unsafe extern "C" fn(Stream) -> c_int,
        begin_capture: unsafe extern "C" fn(Stream, c_int) -> c_int,
        end_capture: unsafe extern "C" fn(Stream, *mut *mut c_void) -> c_int,
        instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int,
        graph_launch: unsafe extern "C" fn(*mut c_void, Stream) -> c_int,
        stream_wait_value: unsafe extern "C" fn(Stream, u64, u32, c_uint) -> c_int,
        stat: unsafe extern "C" fn(*const c_char) -> i64,
    }

    /// A function pointer of type `F` at `address`.
    ///
    /// # Safety
    /// `address` must be a function whose C signature `F` is.
    unsafe fn function<F: Copy>(address: *mut c_void) -> F {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: a function pointer of the same size, as the caller guarantees.
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) }
    }

    fn cu() -> &'static Cu {
        static CU: std::sync::OnceLock<Cu> = std::sync::OnceLock::new();
        CU.get_or_init(|| {
            // SAFETY: dlopen and dlsym with NUL-terminated names; every symbol is the stand-in's
            // function of that name, whose signature (cuda.h's) is the field's.
            unsafe {
                let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
                assert!(
                    !handle.is_null(),
                    "the child finds the stand-in libcuda.so.1"
                );
                let get = |name: &std::ffi::CStr| {
                    let symbol = libc::dlsym(handle, name.as_ptr());
                    assert!(!symbol.is_null(), "the stand-in exports {name:?}");
                    symbol
                };
                macro_rules! f {
                    ($name:literal) => {
                        function(get($name))
                    };
                }
                let init: unsafe extern "C" fn(c_uint) -> c_int = f!(c"cuInit");
                let _ = init(0);
                Cu {
                    primary_ctx_retain: f!(c"cuDevicePrimaryCtxRetain"),
                    ctx_set_current: f!(c"cuCtxSetCurrent"),
                    ctx_get_current: f!(c"cuCtxGetCurrent"),
                    ctx_create: f!(c"cuCtxCreate_v2"),
                    ctx_enable_peer_access: f!(c"cuCtxEnablePeerAccess"),
                    mem_alloc: f!(c"cuMemAlloc_v2"),
                    mem_free: f!(c"cuMemFree_v2"),
                    mem_host_alloc: f!(c"cuMemHostAlloc"),
                    mem_host_register: f!(c"cuMemHostRegister_v2"),
                    memcpy_htod: f!(c"cuMemcpyHtoD_v2"),
                    memcpy_dtoh: f!(c"cuMemcpyDtoH_v2"),
                    stream_create: f!(c"cuStreamCreate"),
                    stream_synchronize: f!(c"cuStreamSynchronize"),
                    begin_capture: f!(c"cuStreamBeginCapture_v2"),
                    end_capture: f!(c"cuStreamEndCapture"),
                    instantiate: f!(c"cuGraphInstantiateWithFlags"),
                    graph_launch: f!(c"cuGraphLaunch"),
                    stream_wait_value: f!(c"cuStreamWaitValue32"),
                    stat: f!(c"fake_cuda_stat"),
                }
            }
        })
    }

    /// `fake_cuda_stat(name)`.
    fn stat(name: &std::ffi::CStr) -> i64 {
        // SAFETY: a NUL-terminated name.
        let value = unsafe { (cu().stat)(name.as_ptr()) };
        assert!(value >= 0, "fake_cuda_stat does not count {name:?}");
        value
    }

    /// Makes `device`'s primary context current on this thread (as the CUDA runtime's
    /// cudaSetDevice does).
    fn use_device(device: c_int) -> Ctx {
        let mut ctx = null_mut();
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!((cu().primary_ctx_retain)(&mut ctx, device), 0);
            assert_eq!((cu().ctx_set_current)(ctx), 0);
        }
        ctx
    }

    fn current_context() -> Ctx {
        let mut ctx = null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { (cu().ctx_get_current)(&mut ctx) }, 0);
        ctx
    }

    fn new_stream() -> Stream {
        new_stream_with(0)
    }

    /// A stream with `flags` (CU_STREAM_NON_BLOCKING = 1: one whose capture does not forbid
    /// the test's synchronous copies, which use the legacy stream).
    fn new_stream_with(flags: c_uint) -> Stream {
        let mut stream = null_mut();
        // SAFETY: a valid out-pointer; a context is current.
        assert_eq!(unsafe { (cu().stream_create)(&mut stream, flags) }, 0);
        stream
    }

    /// Device memory of the current context holding `bytes`.
    struct DeviceBuffer {
        pointer: u64,
        len: usize,
    }

    impl DeviceBuffer {
        fn from_host(bytes: &[u8]) -> Self {
            let mut pointer = 0;
            // SAFETY: a valid out-pointer, then a copy of `bytes` into the new allocation.
            unsafe {
                assert_eq!((cu().mem_alloc)(&mut pointer, bytes.len().max(1)), 0);
                assert_eq!(
                    (cu().memcpy_htod)(pointer, bytes.as_ptr().cast(), bytes.len()),
                    0
                );
            }
            DeviceBuffer {
                pointer,
                len: bytes.len(),
            }
        }

        fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            // SAFETY: `len` bytes of this allocation into `out`.
            assert_eq!(
                unsafe { (cu().memcpy_dtoh)(out.as_mut_ptr().cast(), self.pointer, self.len) },
                0
            );
            out
        }

        fn ptr(&self) -> *mut c_void {
            self.pointer as usize as *mut c_void
        }
    }

    impl Drop for DeviceBuffer {
        fn drop(&mut self) {
            // SAFETY: the allocation this value owns.
            unsafe { (cu().mem_free)(self.pointer) };
        }
    }

    /// A sender that mirrors the host buffers into device memory of the current context, sends
    /// through mori_send_kvcache with `options`, and reads the destination back.
    fn device_sender(options: MoriSendOptions) -> Box<Sender<'static>> {
        Box::new(move |plan, request, src, dst| {
            let config = MoriTpSliceConfig::from(plan.config());
            let src_dev: Vec<DeviceBuffer> =
                src.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let dst_dev: Vec<DeviceBuffer> =
                dst.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let src_ptrs: Vec<*const c_void> =
                src_dev.iter().map(|b| b.ptr().cast_const()).collect();
            let dst_ptrs: Vec<*mut c_void> = dst_dev.iter().map(|b| b.ptr()).collect();
            let buffers = MoriKvBuffers {
                src: src_ptrs.as_ptr(),
                dst: dst_ptrs.as_ptr(),
                num_buffers: src_ptrs.len(),
                src_capacity: src.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
                dst_capacity: dst.iter().map(|b| b.len()).min().unwrap_or(0) as u64,
            };
            // SAFETY: device buffers of the stated capacities, live until the copies are done
            // (the options synchronize).
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
            for (host, device) in dst.iter_mut().zip(&dst_dev) {
                host.copy_from_slice(&device.read());
            }
            None
        })
    }

    fn options(backend: MoriBackend, flags: u32, stream: Stream) -> MoriSendOptions {
        MoriSendOptions {
            backend,
            flags,
            stream,
        }
    }

    /// What the small send leaves in a destination of 9s from a source of `source` bytes.
    fn small_send_result(source: u8) -> Vec<u8> {
        let mut want = vec![9u8; 4 * 32];
        for page in [0, 1, 3] {
            want[page * 32..page * 32 + 32].fill(source);
        }
        want
    }

    /// The small send of 7s into 9s in device memory of the current context with `options`:
    /// status, message, destination after.
    fn small_device_send(options: &MoriSendOptions) -> (MoriStatus, String, Vec<u8>) {
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        // SAFETY: device buffers of the stated sizes.
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(&[src.ptr().cast_const()], &[dst.ptr()], options)
        };
        if status == MORI_OK && options.flags & MORI_SEND_SYNCHRONIZE == 0 {
            // SAFETY: the caller's stream.
            assert_eq!(unsafe { (cu().stream_synchronize)(options.stream) }, 0);
        }
        (status, message, dst.read())
    }

    use common::{UPLOADED_PAGES, uploaded_result};

    /// [`common::send_uploaded`] between `src` and `dst` of [`uploaded_buffers`].
    ///
    /// # Safety
    /// The buffers must stay until the copies are complete.
    unsafe fn uploaded_send(
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        options: &MoriSendOptions,
    ) -> (MoriStatus, String) {
        // SAFETY: device buffers of the sizes send_uploaded needs; kept as the caller guarantees.
        unsafe { common::send_uploaded(src.ptr().cast_const(), dst.ptr(), options) }
    }

    /// Device buffers for an [`uploaded_send`]: sources of `source` bytes, destinations of 9s.
    fn uploaded_buffers(source: u8) -> (DeviceBuffer, DeviceBuffer) {
        let pages = 2 * UPLOADED_PAGES;
        (
            DeviceBuffer::from_host(&vec![source; pages * 64]),
            DeviceBuffer::from_host(&vec![9u8; pages * 32]),
        )
    }

    /// `fake_cuda_stat` of each of `names`.
    fn stats<const N: usize>(names: [&std::ffi::CStr; N]) -> [i64; N] {
        names.map(stat)
    }

    /// A table inside the kernel's argument: the first kernel send of the process loads the
    /// kernel and allocates its reset sentinel (one cuMemAlloc), and nothing else of the
    /// library's: no table buffer (cuMemAlloc, cuMemHostAlloc), no upload (cuMemcpyHtoDAsync,
    /// not even of 0 bytes), no lane (relay stream, events). Later sends make none of those
    /// calls either. A table too big for the argument is one upload and one launch.
    fn inline_table() {
        use_device(0);
        let stream = new_stream();
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let made = || {
            stats([
                c"mem_allocs",
                c"host_allocs",
                c"htod_copies",
                c"events_created",
                c"streams_created",
                c"kernel_launches",
            ])
        };
        let kernel = options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            stream,
        );
        for send in 0..3 {
            let before = made();
            // SAFETY: device buffers of the stated sizes; the options synchronize.
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(&[src.ptr().cast_const()], &[dst.ptr()], &kernel)
            };
            assert_eq!(status, MORI_OK, "{message}");
            let after = made();
            let delta: Vec<i64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
            let sentinel = i64::from(send == 0);
            assert_eq!(delta, [sentinel, 0, 0, 0, 0, 1], "send {send}");
            assert_eq!(dst.read(), small_send_result(7), "send {send}");
        }
        let (big_src, big_dst) = uploaded_buffers(7);
        let [uploads, launches] = stats([c"htod_copies", c"kernel_launches"]);
        // SAFETY: buffers of an uploaded send; the options synchronize.
        let (status, message) = unsafe { uploaded_send(&big_src, &big_dst, &kernel) };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(big_dst.read(), uploaded_result(7));
        assert_eq!(
            stats([c"htod_copies", c"kernel_launches"]),
            [uploads + 1, launches + 1],
            "one table upload, one launch"
        );
    }

    pub(super) fn scenario(name: &str) {
        match name {
            "bytes" => bytes(),
            "no_device" => no_device(),
            "old_driver" => old_driver(),
            "capture" => capture(),
            "inline_table" => inline_table(),
            "two_devices" => two_devices(),
            "contexts" => contexts(),
            "host_memory" => host_memory(),
            "failing_copy" => failing_copy(),
            "failing_launch" => failing_launch(),
            "held_stream" => held_stream(),
            "load_failure" => load_failure(),
            "reused_address" => reused_address(),
            "null_stream_contexts" => null_stream_contexts(),
            "max_pitch" => max_pitch(),
            "fork" => fork(),
            "wide_table" => wide_table(),
            "wide_table_old_driver" => wide_table_old_driver(),
            "wide_load_failure" => wide_load_failure(),
            other => panic!("unknown scenario {other}"),
        }
    }

    /// Every path moves every byte as the host backend does: per rect, the kernel and the
    /// library's choice; pack and unpack through device staging and through a device pool; the
    /// pair functions across layouts with a partial last page.
    fn bytes() {
        assert!(mori_tp::backend::cuda_device_present());
        assert_eq!(
            mori_tp::backend::resolve(mori_tp::Backend::Auto),
            if mori_tp::backend::hip_device_present() {
                mori_tp::Backend::Hip
            } else {
                mori_tp::Backend::Cuda
            }
        );
        // A thread with no current context is on device 0 (as the CUDA runtime's are): the
        // library makes device 0's primary context current for its calls and gives the thread
        // its state back.
        assert!(current_context().is_null());
        let (status, message, after) = small_device_send_without_context();
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        assert!(
            current_context().is_null(),
            "the thread has no context again"
        );
        use_device(0);
        for flags in [MORI_SEND_MEMCPY2D, MORI_SEND_COPY_KERNEL, 0] {
            let sync = options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, null_mut());
            let (launches, copies) = (stat(c"kernel_launches"), stat(c"memcpy2d_calls"));
            odd_deployments(&mut *device_sender(sync));
            let request = fragmented_request(7, 5);
            transfer(8, 128, 4, 2, 8, 16, &request, &mut *device_sender(sync));
            let (launched, copied) = (
                stat(c"kernel_launches") > launches,
                stat(c"memcpy2d_calls") > copies,
            );
            match flags {
                MORI_SEND_MEMCPY2D => assert_eq!((launched, copied), (false, true)),
                MORI_SEND_COPY_KERNEL => assert_eq!((launched, copied), (true, false)),
                _ => assert!(
                    launched,
                    "flags 0 launch the kernel for calls of many copies"
                ),
            }
        }
        // AUTO is CUDA here: it takes a stream, which the host backend would refuse.
        let stream = new_stream();
        let (status, message, after) =
            small_device_send(&options(MORI_BACKEND_AUTO, MORI_SEND_COPY_KERNEL, stream));
        assert_eq!(
            (status, after),
            (MORI_OK, small_send_result(7)),
            "{message}"
        );
        // Two streams, the kernel on both, interleaved, without waiting in between.
        let other = new_stream();
        for round in 0..6u8 {
            let on = if round % 2 == 0 { stream } else { other };
            let (status, message, after) =
                small_device_send(&options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, on));
            assert_eq!(
                (status, after),
                (MORI_OK, small_send_result(7)),
                "{message}"
            );
        }
        pack_unpack_and_pool();
        pair_layouts();
        assert_eq!(stat(c"module_loads"), 1, "the kernel loads once per device");
        assert_eq!(stat(c"invalidated_captures"), 0);
    }

    /// The small send from a thread with no current context (device memory allocated with
    /// device 0's primary context pushed, which is popped again).
    fn small_device_send_without_context() -> (MoriStatus, String, Vec<u8>) {
        let ctx = use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        // SAFETY: leaves the thread without a current context.
        assert_eq!(unsafe { (cu().ctx_set_current)(null_mut()) }, 0);
        let sync = options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            null_mut(),
        );
        // SAFETY: device buffers of the stated sizes.
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(&[src.ptr().cast_const()], &[dst.ptr()], &sync)
        };
        assert!(current_context().is_null());
        // SAFETY: a retained primary context, for the read and the frees.
        assert_eq!(unsafe { (cu().ctx_set_current)(ctx) }, 0);
        let after = dst.read();
        drop((src, dst));
        // SAFETY: as above.
        assert_eq!(unsafe { (cu().ctx_set_current)(null_mut()) }, 0);
        (status, message, after)
    }

    /// Pack (kernel) into device staging, then unpack (kernel) into device buffers, leaves what
    /// a host send leaves; the same through a slot of a device pool, whose memory is the
    /// driver's device memory.
    fn pack_unpack_and_pool() {
        let config = crate::common::config_2_to_4();
        let pages = [0i32, 1, 3];
        let mut staging_len = 0;
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { mori_tp_staging_len(&config, 3, &mut staging_len) },
            MORI_OK
        );
        let src_host: Vec<u8> = (0..4 * 64).map(|i| (i * 7 + 1) as u8).collect();
        let src = DeviceBuffer::from_host(&src_host);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let mut pool = 0;
        let pool_options = MoriTpPoolOptions {
            capacity: 1 << 20,
            min_slot: 4096,
            memory: MORI_TP_POOL_DEVICE,
            flags: 0,
        };
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { mori_tp_pool_create(&pool_options, &mut pool) },
            MORI_OK,
            "{}",
            crate::common::last_error()
        );
        let mut info = std::mem::MaybeUninit::<MoriTpPoolInfo>::uninit();
        // SAFETY: valid pointers; the info is written on success.
        assert_eq!(
            unsafe { mori_tp_pool_info(pool, info.as_mut_ptr()) },
            MORI_OK
        );
        // SAFETY: written above.
        let info = unsafe { info.assume_init() };
        let separate = DeviceBuffer::from_host(&vec![0u8; staging_len as usize]);
        for (staging, what) in [
            (separate.ptr(), "device staging"),
            (info.base, "a device pool"),
        ] {
            let kernel = options(
                MORI_BACKEND_CUDA,
                MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                null_mut(),
            );
            let srcs = [src.ptr().cast_const()];
            let dsts = [dst.ptr()];
            // SAFETY: device buffers and staging of the stated sizes; the options synchronize.
            unsafe {
                assert_eq!(
                    mori_pack_kvcache(
                        &config,
                        srcs.as_ptr(),
                        1,
                        4 * 64,
                        pages.as_ptr(),
                        3,
                        staging,
                        staging_len,
                        &kernel
                    ),
                    MORI_OK,
                    "{what}: {}",
                    crate::common::last_error()
                );
                assert_eq!(
                    mori_unpack_kvcache(
                        &config,
                        staging,
                        staging_len,
                        dsts.as_ptr(),
                        1,
                        4 * 32,
                        pages.as_ptr(),
                        3,
                        &kernel
                    ),
                    MORI_OK,
                    "{what}: {}",
                    crate::common::last_error()
                );
            }
            let mut want = vec![9u8; 4 * 32];
            let mut host_dst = want.clone();
            let host = options(MORI_BACKEND_HOST, 0, null_mut());
            // SAFETY: host buffers of the stated sizes.
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src_host.as_ptr().cast()],
                    &[host_dst.as_mut_ptr().cast()],
                    &host,
                )
            };
            assert_eq!(status, MORI_OK, "{message}");
            want.copy_from_slice(&host_dst);
            assert_eq!(dst.read(), want, "pack + unpack through {what}");
        }
        assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
    }

    /// Prefill NHD with pages of 16 (TP 2) -> decode HND with pages of 64 (TP 4), 173 tokens
    /// (both last pages partial): send, pack and unpack of the pair functions, per rect and with
    /// the kernel, against the host backend on host copies.
    fn pair_layouts() {
        let (mut prefill, mut decode) = (MoriTpLayout::default(), MoriTpLayout::default());
        let mut config = MoriTpPairConfig::default();
        // SAFETY: valid pointers.
        unsafe {
            assert_eq!(mori_tp_layout_nhd(8, 2, 1, 16, 32, &mut prefill), MORI_OK);
            assert_eq!(mori_tp_layout_hnd(8, 4, 2, 64, 32, &mut decode), MORI_OK);
            assert_eq!(mori_tp_pair_config(&prefill, &decode, &mut config), MORI_OK);
        }
        let tokens = 173u64;
        let src_pages: Vec<i32> = vec![4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0];
        let dst_pages: Vec<i32> = vec![3, 1, 0];
        let request = MoriTpRequest {
            src_pages: src_pages.as_ptr(),
            num_src_pages: src_pages.len(),
            dst_pages: dst_pages.as_ptr(),
            num_dst_pages: dst_pages.len(),
            num_tokens: tokens,
        };
        let src_len = 14 * prefill.page_stride;
        let dst_len = 4 * decode.page_stride;
        let src: Vec<Vec<u8>> = (0..2u64)
            .map(|b| (0..src_len).map(|i| (i * 131 + b * 7 + 1) as u8).collect())
            .collect();
        let dst: Vec<Vec<u8>> = (0..2u64)
            .map(|b| {
                (0..dst_len)
                    .map(|i| (i * 29 + b * 3 + 0x80) as u8)
                    .collect()
            })
            .collect();
        for flags in [MORI_SEND_MEMCPY2D, MORI_SEND_COPY_KERNEL] {
            let mut want = dst.clone();
            let host_src: Vec<*const c_void> = src.iter().map(|b| b.as_ptr().cast()).collect();
            let host_dst: Vec<*mut c_void> =
                want.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
            let dev_src: Vec<DeviceBuffer> =
                src.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let dev_dst: Vec<DeviceBuffer> =
                dst.iter().map(|b| DeviceBuffer::from_host(b)).collect();
            let dev_src_ptrs: Vec<*const c_void> =
                dev_src.iter().map(|b| b.ptr().cast_const()).collect();
            let dev_dst_ptrs: Vec<*mut c_void> = dev_dst.iter().map(|b| b.ptr()).collect();
            let host_kv = MoriKvBuffers {
                src: host_src.as_ptr(),
                dst: host_dst.as_ptr(),
                num_buffers: 2,
                src_capacity: src_len,
                dst_capacity: dst_len,
            };
            let dev_kv = MoriKvBuffers {
                src: dev_src_ptrs.as_ptr(),
                dst: dev_dst_ptrs.as_ptr(),
                num_buffers: 2,
                src_capacity: src_len,
                dst_capacity: dst_len,
            };
            let host = options(MORI_BACKEND_HOST, 0, null_mut());
            let cuda = options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, null_mut());
            // SAFETY: buffers of the stated capacities; the options synchronize.
            unsafe {
                assert_eq!(
                    mori_send_kvcache_pair(&config, &host_kv, &request, &host),
                    MORI_OK
                );
                assert_eq!(
                    mori_send_kvcache_pair(&config, &dev_kv, &request, &cuda),
                    MORI_OK,
                    "{}",
                    crate::common::last_error()
                );
            }
            for (b, device) in dev_dst.iter().enumerate() {
                assert_eq!(
                    device.read(),
                    want[b],
                    "pair send, flags {flags:#x}, buffer {b}"
                );
            }
        }
    }

    /// No device: MORI_BACKEND_CUDA refused with what cuInit said, AUTO copies on the host, a
    /// device pool refused.
    fn no_device() {
        assert!(!mori_tp::backend::cuda_device_present());
        let (status, message, unchanged) = crate::common::small_send(&options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE,
            null_mut(),
        ));
        assert_eq!(status, MORI_ERR_BACKEND_UNAVAILABLE, "{message}");
        assert!(
            message.contains(
                "the CUDA backend needs a CUDA device, but cuDeviceGetCount returned \
                 CUDA_ERROR_NO_DEVICE (100) (no NVIDIA GPU, or no driver access to one)"
            ),
            "{message}"
        );
        assert!(unchanged);
        if !mori_tp::backend::hip_device_present() {
            let (status, message, unchanged) =
                crate::common::small_send(&options(MORI_BACKEND_AUTO, 0, null_mut()));
            assert_eq!((status, unchanged), (MORI_OK, false), "{message}");
        }
        let mut pool = 0;
        let device = MoriTpPoolOptions {
            capacity: 1 << 20,
            min_slot: 4096,
            memory: MORI_TP_POOL_DEVICE,
            flags: 0,
        };
        // SAFETY: valid pointers.
        let status = unsafe { mori_tp_pool_create(&device, &mut pool) };
        assert_eq!(status, MORI_ERR_BACKEND_UNAVAILABLE);
        assert!(
            crate::common::last_error().contains("CUDA_ERROR_NO_DEVICE"),
            "{}",
            crate::common::last_error()
        );
    }

    /// A driver without a function the library uses is refused by name, not a panic.
    fn old_driver() {
        let (status, message, unchanged) =
            crate::common::small_send(&options(MORI_BACKEND_CUDA, 0, null_mut()));
        assert_eq!(status, MORI_ERR_BACKEND_UNAVAILABLE, "{message}");
        assert!(
            message.contains(
                "the CUDA driver lacks cuThreadExchangeStreamCaptureMode (mori-tp needs a driver \
                 of CUDA 11.4 or later)"
            ),
            "{message}"
        );
        assert!(unchanged);
    }

    /// Graph capture: the library's calls never break another thread's global capture (cold,
    /// when its first kernel call allocates); a capturing stream gets the per-rect copies, which
    /// replay with the graph; a synchronizing call on it is refused before anything is enqueued;
    /// kernel sends on one stream, then a capture of it, then a kernel send on another stream
    /// (issue 35's second case) leave the capture valid.
    fn capture() {
        use_device(0);
        // The stand-in enforces the rule the library must respect: a global-mode thread's
        // cuMemAlloc during another thread's global capture is refused and breaks the capture.
        let (refused, ended) = with_capture_elsewhere(|| {
            let mut p = 0;
            // SAFETY: a valid out-pointer.
            unsafe { (cu().mem_alloc)(&mut p, 64) }
        });
        assert_eq!((refused, ended), (900, 901), "the stand-in's capture rule");
        // The library's first kernel calls while another thread captures: the module load and
        // reset sentinel (a table inside the argument), then a table buffer pair, a relay
        // stream and events (an uploaded table).
        // (The test's own buffers are allocated first: its thread is in the global mode.)
        let stream = new_stream();
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let (src_at, dst_at, handle) = (src.ptr() as usize, dst.ptr() as usize, stream as usize);
        let (sent, ended) = with_capture_elsewhere(move || {
            let kernel = options(
                MORI_BACKEND_CUDA,
                MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                handle as Stream,
            );
            // SAFETY: device buffers of the stated sizes; the options synchronize.
            unsafe {
                crate::common::send_pages_0_1_3(
                    &[src_at as *const c_void],
                    &[dst_at as *mut c_void],
                    &kernel,
                )
            }
        });
        assert_eq!((sent.0, ended), (MORI_OK, 0), "{}", sent.1);
        assert_eq!(dst.read(), small_send_result(7));
        assert_eq!(
            stat(c"module_loads"),
            1,
            "the first kernel call ran during the capture"
        );
        let (big_src, big_dst) = uploaded_buffers(7);
        let (big_src_at, big_dst_at) = (big_src.ptr() as usize, big_dst.ptr() as usize);
        let made = stats([c"host_allocs", c"streams_created"]);
        let (sent, ended) = with_capture_elsewhere(move || {
            let kernel = options(
                MORI_BACKEND_CUDA,
                MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                handle as Stream,
            );
            let (src, dst) = (
                DeviceBuffer {
                    pointer: big_src_at as u64,
                    len: 0,
                },
                DeviceBuffer {
                    pointer: big_dst_at as u64,
                    len: 0,
                },
            );
            // SAFETY: buffers of an uploaded send (only their addresses are taken here, and
            // they are not freed: forgotten below); the options synchronize.
            let sent = unsafe { uploaded_send(&src, &dst, &kernel) };
            std::mem::forget((src, dst));
            sent
        });
        assert_eq!((sent.0, ended), (MORI_OK, 0), "{}", sent.1);
        assert_eq!(big_dst.read(), uploaded_result(7));
        assert_eq!(
            stats([c"host_allocs", c"streams_created"]),
            [made[0] + 1, made[1] + 2],
            "a table buffer pair and a relay stream made during the capture (and the capturing \
             thread's own stream)"
        );
        // Synchronize on a capturing stream: refused before anything is enqueued.
        let capturing = new_stream_with(1);
        let src = DeviceBuffer::from_host(&[5u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        // SAFETY: a live stream of the current context.
        assert_eq!(unsafe { (cu().begin_capture)(capturing, 2) }, 0);
        for flags in [MORI_SEND_COPY_KERNEL, 0] {
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.ptr().cast_const()],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, capturing),
                )
            };
            assert_eq!(status, MORI_ERR_GPU, "{message}");
            for part in [
                "cuStreamIsCapturing(stream ",
                "returned CU_STREAM_CAPTURE_STATUS_ACTIVE",
                "with cuStreamSynchronize",
                "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900)",
            ] {
                assert!(message.contains(part), "{message:?} lacks {part:?}");
            }
        }
        // Without synchronize: a table inside the kernel's argument is captured as the launch
        // (a kernel node holding its own copy of the argument), with no upload; a table too
        // big for the argument gets the per-rect copies (a captured upload would be replayed
        // from a table buffer later calls reuse). Both replay with what the sources hold then.
        let counts = || {
            stats([
                c"captured_launches",
                c"memcpy2d_calls",
                c"kernel_launches",
                c"htod_copies",
            ])
        };
        let before = counts();
        // SAFETY: device buffers of the stated sizes.
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(
                &[src.ptr().cast_const()],
                &[dst.ptr()],
                &options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, capturing),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        let (big_src, big_dst) = uploaded_buffers(5);
        // SAFETY: buffers of an uploaded send, alive until the graph has run.
        let (status, message) = unsafe {
            uploaded_send(
                &big_src,
                &big_dst,
                &options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, capturing),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(dst.read(), vec![9u8; 4 * 32], "captured, not run");
        let captured = counts();
        let delta = |a: [i64; 4], b: [i64; 4]| [b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3] - a[3]];
        assert_eq!(
            delta(before, captured),
            [1, UPLOADED_PAGES as i64, 0, 0],
            "one launch and the big table's per-rect copies captured; nothing run or uploaded"
        );
        let mut graph = null_mut();
        let mut exec = null_mut();
        // SAFETY: the capture begun above; a live stream.
        unsafe {
            assert_eq!((cu().end_capture)(capturing, &mut graph), 0);
            assert_eq!((cu().instantiate)(&mut exec, graph, 0), 0);
        }
        for source in [5u8, 6] {
            // The graph reads the sources the capture named: write them in place.
            // SAFETY: both allocations hold that many bytes.
            unsafe {
                assert_eq!(
                    (cu().memcpy_htod)(src.pointer, [source; 4 * 64].as_ptr().cast(), 4 * 64),
                    0
                );
                let big = vec![source; 2 * UPLOADED_PAGES * 64];
                assert_eq!(
                    (cu().memcpy_htod)(big_src.pointer, big.as_ptr().cast(), big.len()),
                    0
                );
            }
            let replayed = counts();
            // SAFETY: the instance above; a live stream.
            unsafe {
                assert_eq!((cu().graph_launch)(exec, stream), 0);
                assert_eq!((cu().stream_synchronize)(stream), 0);
            }
            assert_eq!(
                dst.read(),
                small_send_result(source),
                "the graph replays the launch"
            );
            assert_eq!(big_dst.read(), uploaded_result(source), "and the copies");
            assert_eq!(
                delta(replayed, counts()),
                [0, 0, 1, 0],
                "the kernel runs once per replay"
            );
        }
        // Issue 35, same thread: kernel sends of uploaded tables (each fenced with events on
        // its stream) on S, then S captures (relaxed), then such a kernel send on T.
        let s = new_stream_with(1);
        let t = new_stream();
        let (big_src, big_dst) = uploaded_buffers(7);
        for _ in 0..4 {
            // SAFETY: buffers of an uploaded send; S is synchronized below.
            let (status, message) = unsafe {
                uploaded_send(
                    &big_src,
                    &big_dst,
                    &options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, s),
                )
            };
            assert_eq!(status, MORI_OK, "{message}");
        }
        // SAFETY: a live stream.
        assert_eq!(unsafe { (cu().stream_synchronize)(s) }, 0);
        // SAFETY: a live stream.
        assert_eq!(unsafe { (cu().begin_capture)(s, 2) }, 0);
        let (t_src, t_dst) = uploaded_buffers(7);
        let uploads = stat(c"htod_copies");
        // SAFETY: buffers of an uploaded send; the options synchronize.
        let (status, message) = unsafe {
            uploaded_send(
                &t_src,
                &t_dst,
                &options(
                    MORI_BACKEND_CUDA,
                    MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                    t,
                ),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(t_dst.read(), uploaded_result(7));
        assert_eq!(stat(c"htod_copies"), uploads + 1, "T's table was uploaded");
        let mut graph = null_mut();
        // SAFETY: the capture begun above.
        assert_eq!(unsafe { (cu().end_capture)(s, &mut graph) }, 0);
        assert_eq!(
            stat(c"invalidated_captures"),
            1,
            "only the stand-in's own check"
        );
    }

    /// Runs `f` on this thread while another thread captures a stream in the global mode:
    /// what `f` returned, and what that thread's cuStreamEndCapture returned.
    fn with_capture_elsewhere<T: Send>(f: impl FnOnce() -> T + Send) -> (T, c_int) {
        let (began_tx, began_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let capturer = scope.spawn(move || {
                use_device(0);
                let stream = new_stream();
                // SAFETY: a live stream; global mode (0), this thread's default.
                assert_eq!(unsafe { (cu().begin_capture)(stream, 0) }, 0);
                began_tx.send(()).unwrap();
                // Ends when `f` returns, or panics (the sender is dropped either way).
                let _ = done_rx.recv();
                let mut graph = null_mut();
                // SAFETY: the capture begun above.
                unsafe { (cu().end_capture)(stream, &mut graph) }
            });
            began_rx.recv().unwrap();
            let result = {
                let _done = done_tx;
                f()
            };
            (result, capturer.join().unwrap())
        })
    }

    /// A stream of device 1 while device 0 is current: the kernel loads in device 1's primary
    /// context, the bytes land, and the thread keeps device 0 (or no context) current. Memory of
    /// device 0 reaches a device-1 kernel only with peer access, which the library cannot see:
    /// flags 0 take the per-rect copies for it, the kernel flag launches.
    fn two_devices() {
        let zero = use_device(0);
        let one = use_device(1);
        let stream = new_stream();
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        // SAFETY: a retained primary context.
        assert_eq!(unsafe { (cu().ctx_set_current)(zero) }, 0);
        for flags in [MORI_SEND_COPY_KERNEL, MORI_SEND_MEMCPY2D, 0] {
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[src.ptr().cast_const()],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, stream),
                )
            };
            assert_eq!(status, MORI_OK, "flags {flags:#x}: {message}");
            assert_eq!(current_context(), zero, "device 0 stays current");
        }
        // SAFETY: leaves the thread without a current context, then sends.
        assert_eq!(unsafe { (cu().ctx_set_current)(null_mut()) }, 0);
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(
                &[src.ptr().cast_const()],
                &[dst.ptr()],
                &options(
                    MORI_BACKEND_CUDA,
                    MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                    stream,
                ),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        assert!(current_context().is_null(), "no context again");
        // SAFETY: a retained primary context.
        assert_eq!(unsafe { (cu().ctx_set_current)(one) }, 0);
        assert_eq!(dst.read(), small_send_result(7));
        // Device 0's memory on device 1's stream, with peer access enabled from device 1.
        // SAFETY: a retained primary context.
        assert_eq!(unsafe { (cu().ctx_set_current)(zero) }, 0);
        let far = DeviceBuffer::from_host(&[6u8; 4 * 64]);
        // SAFETY: as above.
        unsafe {
            assert_eq!((cu().ctx_set_current)(one), 0);
            assert_eq!((cu().ctx_enable_peer_access)(zero, 0), 0);
        }
        let launches = stat(c"kernel_launches");
        for flags in [0, MORI_SEND_COPY_KERNEL] {
            let (status, message) = unsafe {
                crate::common::send_pages_0_1_3(
                    &[far.ptr().cast_const()],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, stream),
                )
            };
            assert_eq!(status, MORI_OK, "flags {flags:#x}: {message}");
            assert_eq!(dst.read(), small_send_result(6));
        }
        assert_eq!(
            stat(c"kernel_launches"),
            launches + 1,
            "only the kernel flag launched"
        );
    }

    /// A stream of a context the caller made (cuCtxCreate): the kernel is refused with a message
    /// that says why and what works; the per-rect copies work.
    fn contexts() {
        use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let mut own = null_mut();
        // SAFETY: a valid out-pointer; cuCtxCreate makes the new context current.
        assert_eq!(unsafe { (cu().ctx_create)(&mut own, 0, 0) }, 0);
        let stream = new_stream();
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(
                &[src.ptr().cast_const()],
                &[dst.ptr()],
                &options(
                    MORI_BACKEND_CUDA,
                    MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                    stream,
                ),
            )
        };
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "cuStreamGetCtx(stream ",
            "CUDA_ERROR_INVALID_CONTEXT (201)",
            "primary context",
            "MORI_SEND_MEMCPY2D",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(dst.read(), vec![9u8; 4 * 32], "refused before anything ran");
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(
                &[src.ptr().cast_const()],
                &[dst.ptr()],
                &options(
                    MORI_BACKEND_CUDA,
                    MORI_SEND_SYNCHRONIZE | MORI_SEND_MEMCPY2D,
                    stream,
                ),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(current_context(), own, "the caller's context stays current");
        assert_eq!(dst.read(), small_send_result(7));
    }

    /// Pages of a [`common::send_spread`] whose table (about 20 KB) is too big for the kernel's
    /// 4 KiB argument and fits in the wide entry's 32,696 bytes.
    const WIDE_PAGES: usize = 2500;

    /// What a send changed: (htod_copies, kernel_launches, wide_launches, module_loads,
    /// mem_allocs, host_allocs) of the stand-in.
    fn wide_stats() -> [i64; 6] {
        stats([
            c"htod_copies",
            c"kernel_launches",
            c"wide_launches",
            c"module_loads",
            c"mem_allocs",
            c"host_allocs",
        ])
    }

    /// A [`common::send_spread`] of `pages` pages from device memory of 7s into 9s with the
    /// kernel, synchronized, on `stream`: the stand-in's [`wide_stats`] it changed. Every byte
    /// is checked.
    fn spread_kernel_send(pages: usize, stream: Stream) -> [i64; 6] {
        let src = DeviceBuffer::from_host(&vec![7u8; 2 * pages * 64]);
        let dst = DeviceBuffer::from_host(&vec![9u8; 2 * pages * 32]);
        let kernel = options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            stream,
        );
        let before = wide_stats();
        // SAFETY: device buffers of the sizes send_spread needs; the options synchronize.
        let (status, message) =
            unsafe { common::send_spread(src.ptr().cast_const(), dst.ptr(), pages, &kernel) };
        let after = wide_stats();
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(dst.read(), common::spread_result(7, pages), "{pages} pages");
        std::array::from_fn(|i| after[i] - before[i])
    }

    /// Issue 45.8: on a CUDA 12.1+ driver a table too big for the 4 KiB argument but within
    /// 32,696 bytes travels inside the wide entry's argument: no upload, no table buffer, the
    /// wide function launched (its module loaded once, on the first such table), every byte
    /// right; a table beyond the wide room is uploaded as before; small tables keep the main
    /// entry.
    fn wide_table() {
        use_device(0);
        let stream = new_stream();
        // (htod, launches, wide launches, module loads, cuMemAlloc, cuMemHostAlloc)
        let first = spread_kernel_send(WIDE_PAGES, stream);
        // The main module and the wide one are loaded, the reset sentinel allocated.
        assert_eq!(first, [0, 1, 1, 2, 1, 0], "the first wide send");
        for send in 0..3 {
            assert_eq!(
                spread_kernel_send(WIDE_PAGES, stream),
                [0, 1, 1, 0, 0, 0],
                "wide send {send}: the launch alone"
            );
        }
        // A small table: the main entry, inside its 4 KiB argument.
        assert_eq!(spread_kernel_send(4, stream), [0, 1, 0, 0, 0, 0]);
        // Beyond the wide room: one upload (a table buffer pair the first time), the main
        // entry.
        let uploaded = spread_kernel_send(common::UPLOADED_PAGES, stream);
        assert_eq!(
            [uploaded[0], uploaded[1], uploaded[2], uploaded[3]],
            [1, 1, 0, 0],
            "{uploaded:?}"
        );
        let c = counters();
        assert_eq!(
            (c.kernel_launches, c.load_failures, c.fallbacks),
            (6, 0, 0),
            "{c:?}"
        );
        assert_eq!(stat(c"module_load_failures"), 0);
        // A capturing stream: such a table is captured as one launch of the wide entry (a
        // kernel node that owns its 32 KiB argument), not as per-rect copies, and every replay
        // copies what the sources hold then.
        let (captured, memcpys) = capture_spread(WIDE_PAGES, stream);
        assert_eq!((captured, memcpys), (1, 0), "one captured launch");
        assert_eq!(counters().fallbacks, 0);
    }

    /// Captures a [`common::send_spread`] of `pages` pages with MORI_SEND_COPY_KERNEL on a
    /// capturing stream (relaxed mode), then replays the graph on `stream` twice with new source
    /// bytes, checking every byte and that a replay runs the wide entry once when the capture
    /// held a launch: (launches captured, per-rect copies captured).
    fn capture_spread(pages: usize, stream: Stream) -> (i64, i64) {
        let capturing = new_stream_with(1);
        let src = DeviceBuffer::from_host(&vec![5u8; 2 * pages * 64]);
        let dst = DeviceBuffer::from_host(&vec![9u8; 2 * pages * 32]);
        let counts = || {
            stats([
                c"captured_launches",
                c"memcpy2d_calls",
                c"htod_copies",
                c"wide_launches",
            ])
        };
        let before = counts();
        // SAFETY: a live stream of the current context.
        assert_eq!(unsafe { (cu().begin_capture)(capturing, 2) }, 0);
        // SAFETY: device buffers of the sizes send_spread needs, alive until the graph has run.
        let (status, message) = unsafe {
            common::send_spread(
                src.ptr().cast_const(),
                dst.ptr(),
                pages,
                &options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, capturing),
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        let after = counts();
        assert_eq!(dst.read(), vec![9u8; 2 * pages * 32], "captured, not run");
        assert_eq!(after[2] - before[2], 0, "nothing uploaded while capturing");
        assert_eq!(after[3] - before[3], 0, "nothing run while capturing");
        let mut graph = null_mut();
        let mut exec = null_mut();
        // SAFETY: the capture begun above; a live stream.
        unsafe {
            assert_eq!((cu().end_capture)(capturing, &mut graph), 0);
            assert_eq!((cu().instantiate)(&mut exec, graph, 0), 0);
        }
        let launched = after[0] - before[0];
        for source in [6u8, 8] {
            let bytes = vec![source; 2 * pages * 64];
            // SAFETY: the allocation holds that many bytes.
            unsafe {
                assert_eq!(
                    (cu().memcpy_htod)(src.pointer, bytes.as_ptr().cast(), bytes.len()),
                    0
                );
            }
            let wide = stat(c"wide_launches");
            // SAFETY: the instance above; a live stream.
            unsafe {
                assert_eq!((cu().graph_launch)(exec, stream), 0);
                assert_eq!((cu().stream_synchronize)(stream), 0);
            }
            assert_eq!(dst.read(), common::spread_result(source, pages), "replayed");
            assert_eq!(
                stat(c"wide_launches") - wide,
                launched,
                "wide launches per replay"
            );
        }
        (launched, after[1] - before[1])
    }

    /// Issue 45.8 on a driver older than CUDA 12.1: the wide entry is never loaded (its PTX ISA
    /// 8.1 would be refused, and a launch with more than 4 KiB of argument too), and the table
    /// is uploaded as before, every byte right.
    fn wide_table_old_driver() {
        use_device(0);
        let stream = new_stream();
        let first = spread_kernel_send(WIDE_PAGES, stream);
        assert_eq!(
            [first[0], first[1], first[2], first[3]],
            [1, 1, 0, 1],
            "one upload, the main module alone: {first:?}"
        );
        assert_eq!(
            spread_kernel_send(WIDE_PAGES, stream),
            [1, 1, 0, 0, 0, 0],
            "uploaded again"
        );
        let c = counters();
        assert_eq!(
            (c.kernel_launches, c.load_failures, c.fallbacks),
            (2, 0, 0),
            "{c:?}"
        );
        assert_eq!(
            stat(c"module_load_failures"),
            0,
            "nothing loaded that fails"
        );
        // A capturing stream: the table does not fit in the 4 KiB argument, so the call takes
        // the per-rect copies, as any uploaded table does while capturing.
        assert_eq!(
            capture_spread(WIDE_PAGES, stream),
            (0, WIDE_PAGES as i64),
            "per-rect copies captured"
        );
        let c = counters();
        assert_eq!((c.fallbacks, c.fallbacks_capture), (1, 1), "{c:?}");
    }

    /// Issue 45.8: when the wide entry's module does not load (here the stand-in refuses it as
    /// CUDA_ERROR_INVALID_PTX), its tables are uploaded instead, the failure counted once in
    /// load_failures (not retried, and not a per-rect fallback), every byte right.
    fn wide_load_failure() {
        use_device(0);
        let stream = new_stream();
        for send in 0..3 {
            let made = spread_kernel_send(WIDE_PAGES, stream);
            assert_eq!(
                [made[0], made[1], made[2]],
                [1, 1, 0],
                "send {send}: uploaded, the main entry: {made:?}"
            );
        }
        let c = counters();
        assert_eq!(
            (c.kernel_launches, c.load_failures, c.fallbacks),
            (3, 1, 0),
            "{c:?}"
        );
        assert_eq!(stat(c"module_load_failures"), 1, "tried once");
        assert_eq!(stat(c"module_loads"), 1, "the main module only");
        // A capturing stream: the wide entry is not there and an upload cannot be captured, so
        // the per-rect copies.
        assert_eq!(
            capture_spread(WIDE_PAGES, stream),
            (0, WIDE_PAGES as i64),
            "per-rect copies captured"
        );
        let c = counters();
        assert_eq!(
            (c.fallbacks, c.fallbacks_capture, c.load_failures),
            (1, 1, 1),
            "{c:?}"
        );
    }

    /// mori_tp_gpu_counters_get(MORI_BACKEND_CUDA).
    fn counters() -> MoriTpGpuCounters {
        let mut out = MoriTpGpuCounters::default();
        // SAFETY: a valid out-pointer.
        assert_eq!(
            unsafe { mori_tp_gpu_counters_get(MORI_BACKEND_CUDA, &mut out) },
            MORI_OK
        );
        out
    }

    /// Issue 45.1 (R1): a stream held by cuStreamWaitValue32 on a flag this thread raises later
    /// gets 40 uploaded-table sends with MORI_SEND_COPY_KERNEL. None waits (on a GPU a wait for
    /// the stream would never end; the stand-in counts it as a hang): the first 32 take a table
    /// buffer pair each, the rest the per-rect copies, counted; every byte lands once the flag
    /// is raised.
    fn held_stream() {
        use_device(0);
        let source: Vec<u8> = (0..2 * common::UPLOADED_PAGES * 64).map(|_| 7u8).collect();
        let src = DeviceBuffer::from_host(&source);
        let dst = DeviceBuffer::from_host(&vec![9u8; 2 * common::UPLOADED_PAGES * 32]);
        let stream = new_stream();
        let flag: Box<std::sync::atomic::AtomicU32> = Box::new(0.into());
        // SAFETY: the flag outlives the stream's wait (raised and waited for below).
        assert_eq!(
            unsafe { (cu().stream_wait_value)(stream, flag.as_ptr() as u64, 1, 0) },
            0
        );
        let kernel = options(MORI_BACKEND_CUDA, MORI_SEND_COPY_KERNEL, stream);
        let copies = stat(c"memcpy2d_calls");
        for i in 0..40 {
            // SAFETY: device buffers of the sizes send_uploaded needs, alive until the stream
            // ran (synchronized below).
            let (status, message) =
                unsafe { common::send_uploaded(src.ptr().cast_const(), dst.ptr(), &kernel) };
            assert_eq!(status, MORI_OK, "send {i}: {message}");
        }
        assert_eq!(stat(c"hangs"), 0, "no call waited for the held stream");
        assert_eq!(
            stat(c"memcpy2d_calls") - copies,
            8 * common::UPLOADED_PAGES as i64,
            "sends 33 to 40 took the per-rect copies"
        );
        let c = counters();
        assert_eq!((c.fallbacks, c.fallbacks_busy), (8, 8), "{c:?}");
        flag.store(1, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: the caller's stream.
        assert_eq!(unsafe { (cu().stream_synchronize)(stream) }, 0);
        assert_eq!(dst.read(), common::uploaded_result(7));
    }

    /// Issue 45.2 (R2): the first two loads of the kernel fail with CUDA_ERROR_OUT_OF_MEMORY. The
    /// error names the cause with its hint and the JIT's log; flags 0 then take the per-rect
    /// copies (counted); the next call loads the kernel and launches it.
    fn load_failure() {
        use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let send = |flags| {
            // SAFETY: device buffers of the sizes send_pages_0_1_3 needs; the send synchronizes.
            unsafe {
                common::send_pages_0_1_3(
                    &[src.ptr().cast_const()],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, null_mut()),
                )
            }
        };
        let (status, message) = send(MORI_SEND_COPY_KERNEL);
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "cuModuleLoadDataEx(copy kernel",
            "CUDA_ERROR_OUT_OF_MEMORY (2)",
            "memory is full",
            "the driver's log: fake_cuda: load failure 2",
            "again on the next call",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert!(!message.contains("update the NVIDIA driver"), "{message}");
        let launches = stat(c"kernel_launches");
        let (status, message) = send(0);
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(stat(c"kernel_launches"), launches, "per-rect copies");
        assert_eq!(dst.read(), small_send_result(7));
        let (status, message) = send(MORI_SEND_COPY_KERNEL);
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(
            stat(c"kernel_launches"),
            launches + 1,
            "loaded and launched"
        );
        let c = counters();
        assert_eq!(
            (c.load_failures, c.fallbacks_unloadable, c.kernel_launches),
            (2, 1, 1),
            "{c:?}"
        );
        assert_eq!(stat(c"module_load_failures"), 2);
    }

    /// Issue 45.3 (R3): a device buffer is sent from, freed, and its address mapped as pageable
    /// host memory (an address reused): flags 0 classify the base again by its allocation's
    /// identity (CU_POINTER_ATTRIBUTE_BUFFER_ID) and take the per-rect copies, where a stale
    /// entry would launch the kernel on memory it cannot reach.
    fn reused_address() {
        use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let send = |src: *const c_void| {
            // SAFETY: buffers of the sizes send_pages_0_1_3 needs; the send synchronizes.
            unsafe {
                common::send_pages_0_1_3(
                    &[src],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE, null_mut()),
                )
            }
        };
        let launches = stat(c"kernel_launches");
        assert_eq!(send(src.ptr().cast_const()).0, MORI_OK);
        assert_eq!(
            stat(c"kernel_launches"),
            launches + 1,
            "the kernel, on device memory"
        );
        let address = src.pointer;
        drop(src);
        // SAFETY: maps fresh anonymous memory at the freed allocation's address (the stand-in
        // never hands it out again; it left the range reserved without access).
        let host = unsafe {
            libc::mmap(
                address as usize as *mut c_void,
                4 * 64,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(host as usize as u64, address, "mapped at the old address");
        // SAFETY: 256 bytes just mapped.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 5, 4 * 64) };
        let copies = stat(c"memcpy2d_calls");
        let (status, message) = send(host.cast_const());
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(
            stat(c"kernel_launches"),
            launches + 1,
            "no launch on host memory"
        );
        assert!(stat(c"memcpy2d_calls") > copies, "the per-rect copies");
        assert_eq!(dst.read(), small_send_result(5));
        assert_eq!(counters().fallbacks_memory, 1);
    }

    /// Issue 45.4 (R4) and 45.6: the NULL stream with a cuCtxCreate context current, and that
    /// context's own stream, are checked before anything is enqueued: flags 0 take the
    /// per-rect copies (counted), MORI_SEND_COPY_KERNEL is refused naming the context. After 33
    /// such sends the kernel path of uploaded tables is intact for the primary context.
    fn null_stream_contexts() {
        let primary = use_device(0);
        let src = DeviceBuffer::from_host(&vec![7u8; 2 * common::UPLOADED_PAGES * 64]);
        let dst = DeviceBuffer::from_host(&vec![9u8; 2 * common::UPLOADED_PAGES * 32]);
        let mut own = null_mut();
        // SAFETY: a valid out-pointer; cuCtxCreate makes the new context current.
        assert_eq!(unsafe { (cu().ctx_create)(&mut own, 0, 0) }, 0);
        let own_stream = new_stream();
        let launches = stat(c"kernel_launches");
        for stream in [null_mut(), own_stream] {
            for i in 0..33 {
                let flags0 = options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE, stream);
                // SAFETY: device buffers of the sizes send_uploaded needs; it synchronizes.
                let (status, message) =
                    unsafe { common::send_uploaded(src.ptr().cast_const(), dst.ptr(), &flags0) };
                assert_eq!(status, MORI_OK, "stream {stream:p}, send {i}: {message}");
            }
            let kernel = options(
                MORI_BACKEND_CUDA,
                MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                stream,
            );
            // SAFETY: as above.
            let (status, message) =
                unsafe { common::send_uploaded(src.ptr().cast_const(), dst.ptr(), &kernel) };
            assert_eq!(status, MORI_ERR_GPU, "{message}");
            for part in [
                "CUDA_ERROR_INVALID_CONTEXT (201)",
                "cuCtxCreate",
                "before anything was enqueued",
            ] {
                assert!(message.contains(part), "{message:?} lacks {part:?}");
            }
        }
        assert_eq!(
            stat(c"kernel_launches"),
            launches,
            "no launch in the foreign context"
        );
        assert_eq!(dst.read(), common::uploaded_result(7));
        assert_eq!(counters().fallbacks_context, 66);
        assert_eq!(current_context(), own, "the caller's context stays current");
        // SAFETY: the primary context, retained by use_device.
        assert_eq!(unsafe { (cu().ctx_set_current)(primary) }, 0);
        let stream = new_stream();
        let kernel = options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            stream,
        );
        let copies = stat(c"memcpy2d_calls");
        // SAFETY: as above.
        let (status, message) =
            unsafe { common::send_uploaded(src.ptr().cast_const(), dst.ptr(), &kernel) };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(stat(c"kernel_launches"), launches + 1, "the kernel ran");
        assert_eq!(stat(c"memcpy2d_calls"), copies, "no per-rect copy");
    }

    /// Issue 45.6: the per-rect path checks the device's maximum pitch
    /// (CU_DEVICE_ATTRIBUTE_MAX_PITCH, 48 here) before anything is enqueued: a pitch of 64 is
    /// refused naming the rect, its pitches and the limit, and nothing is written; the kernel
    /// has no such limit.
    fn max_pitch() {
        use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let send = |flags| {
            // SAFETY: device buffers of the sizes send_pages_0_1_3 needs; the send synchronizes.
            unsafe {
                common::send_pages_0_1_3(
                    &[src.ptr().cast_const()],
                    &[dst.ptr()],
                    &options(MORI_BACKEND_CUDA, MORI_SEND_SYNCHRONIZE | flags, null_mut()),
                )
            }
        };
        let copies = stat(c"memcpy2d_calls");
        let (status, message) = send(MORI_SEND_MEMCPY2D);
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "cuMemcpy2DAsync(dpitch 32, spitch 64,",
            "largest 2D-copy pitch, 48 bytes",
            "before anything was enqueued",
            "MORI_SEND_COPY_KERNEL",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(stat(c"memcpy2d_calls"), copies, "nothing enqueued");
        assert_eq!(dst.read(), vec![9u8; 4 * 32], "nothing written");
        let (status, message) = send(MORI_SEND_COPY_KERNEL);
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(dst.read(), small_send_result(7));
    }

    /// Issue 45.5 (R5): a child forked while another thread of the parent is inside a send (the
    /// stand-in holds its cuLaunchKernel for 1.5 s, with the device's state locked) gets
    /// MORI_ERR_BACKEND_UNAVAILABLE naming the fork at once, instead of waiting for good on
    /// the parent's lock.
    fn fork() {
        use_device(0);
        let src = DeviceBuffer::from_host(&[7u8; 4 * 64]);
        let dst = DeviceBuffer::from_host(&[9u8; 4 * 32]);
        let (s, d) = (src.pointer, dst.pointer);
        let send = move || {
            // SAFETY: device buffers of the sizes send_pages_0_1_3 needs; the send synchronizes.
            unsafe {
                common::send_pages_0_1_3(
                    &[s as usize as *const c_void],
                    &[d as usize as *mut c_void],
                    &options(
                        MORI_BACKEND_CUDA,
                        MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                        null_mut(),
                    ),
                )
            }
        };
        assert_eq!(send().0, MORI_OK, "the parent's first send");
        // An uploaded table: the device's state stays locked across the launch.
        let big_src = DeviceBuffer::from_host(&vec![7u8; 2 * common::UPLOADED_PAGES * 64]);
        let big_dst = DeviceBuffer::from_host(&vec![9u8; 2 * common::UPLOADED_PAGES * 32]);
        let (bs, bd) = (big_src.pointer, big_dst.pointer);
        let inside = std::thread::spawn(move || {
            let kernel = options(
                MORI_BACKEND_CUDA,
                MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
                null_mut(),
            );
            // SAFETY: device buffers of the sizes send_uploaded needs; it synchronizes.
            unsafe {
                common::send_uploaded(
                    bs as usize as *const c_void,
                    bd as usize as *mut c_void,
                    &kernel,
                )
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(500));
        // SAFETY: the child only calls the library and async-signal-safe functions, and exits
        // with _exit.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            // SAFETY: alarm and _exit are async-signal-safe.
            unsafe { libc::alarm(5) };
            let (status, message) = send();
            let ok = status == MORI_ERR_BACKEND_UNAVAILABLE
                && message.contains("forked")
                && message.contains("spawn");
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 3 }) };
        }
        let mut status = 0;
        // SAFETY: the child just forked.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child's send must fail at once with the fork named (status {status:#x}: a \
             signal 14 is its alarm, a deadlock)"
        );
        assert_eq!(inside.join().expect("the parent's thread").0, MORI_OK);
        assert_eq!(big_dst.read(), common::uploaded_result(7));
        assert_eq!(dst.read(), small_send_result(7));
    }

    /// Pageable host memory: the kernel is refused (it would fault), flags 0 take the per-rect
    /// copies; pinned (cuMemHostAlloc) and registered (cuMemHostRegister) memory take the
    /// kernel at their host addresses (unified addressing).
    fn host_memory() {
        use_device(0);
        let kernel = options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            null_mut(),
        );
        let (status, message, unchanged) = crate::common::small_send(&kernel);
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "cuPointerGetAttributes(source buffer 0, ",
            "host memory that no device can address (not pinned)",
            "CUDA_ERROR_INVALID_VALUE (1)",
            "cuMemHostAlloc'd memory or a cuMemHostGetDevicePointer address",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert!(unchanged);
        let launches = stat(c"kernel_launches");
        let (status, message, unchanged) = crate::common::small_send(&options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE,
            null_mut(),
        ));
        assert_eq!((status, unchanged), (MORI_OK, false), "{message}");
        assert_eq!(
            stat(c"kernel_launches"),
            launches,
            "flags 0: per-rect copies"
        );
        // Pinned and registered host memory.
        let mut pinned_src = null_mut();
        let mut pinned_dst = null_mut();
        // SAFETY: valid out-pointers, then the blocks filled within their sizes.
        unsafe {
            assert_eq!((cu().mem_host_alloc)(&mut pinned_src, 4 * 64, 0), 0);
            assert_eq!((cu().mem_host_alloc)(&mut pinned_dst, 4 * 32, 0), 0);
            std::ptr::write_bytes(pinned_src.cast::<u8>(), 4, 4 * 64);
            std::ptr::write_bytes(pinned_dst.cast::<u8>(), 9, 4 * 32);
        }
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(&[pinned_src.cast_const()], &[pinned_dst], &kernel)
        };
        assert_eq!(status, MORI_OK, "{message}");
        // SAFETY: the pinned block of 4 * 32 bytes.
        let after = unsafe { std::slice::from_raw_parts(pinned_dst.cast::<u8>(), 4 * 32) };
        assert_eq!(after, small_send_result(4).as_slice());
        let src = vec![3u8; 4 * 64];
        let mut dst = vec![9u8; 4 * 32];
        // SAFETY: live host bytes, registered for the rest of the process.
        unsafe {
            assert_eq!(
                (cu().mem_host_register)(src.as_ptr().cast_mut().cast(), src.len(), 0),
                0
            );
            assert_eq!(
                (cu().mem_host_register)(dst.as_mut_ptr().cast(), dst.len(), 0),
                0
            );
        }
        let (status, message) = unsafe {
            crate::common::send_pages_0_1_3(
                &[src.as_ptr().cast()],
                &[dst.as_mut_ptr().cast()],
                &kernel,
            )
        };
        assert_eq!(status, MORI_OK, "{message}");
        assert_eq!(dst, small_send_result(3));
    }

    fn failing_copy() {
        use_device(0);
        let (status, message, after) = small_device_send(&options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_MEMCPY2D,
            null_mut(),
        ));
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "mori_send_kvcache: GPU error: cuMemcpy2DAsync(dst ",
            "CU_MEMORYTYPE_UNIFIED, stream 0x0) returned an unnamed CUDA error (999)",
            "(buffer 0 of 1, rect 0 of 2",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(after, vec![9u8; 4 * 32], "the failing copy wrote nothing");
    }

    fn failing_launch() {
        use_device(0);
        let (status, message, after) = small_device_send(&options(
            MORI_BACKEND_CUDA,
            MORI_SEND_SYNCHRONIZE | MORI_SEND_COPY_KERNEL,
            null_mut(),
        ));
        assert_eq!(status, MORI_ERR_GPU, "{message}");
        for part in [
            "mori_send_kvcache: GPU error: cuLaunchKernel(mori_copy_kernel, grid (1, 1, 1)",
            "returned an unnamed CUDA error (999)",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(after, vec![9u8; 4 * 32], "a failed launch writes nothing");
    }
}
