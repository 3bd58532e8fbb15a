//! The HIP engine's own code path on any machine: a recording runtime stands in for
//! libamdhip64, logs every call with its exact arguments, and performs each hipMemcpy2DAsync on
//! host memory with hipMemcpy2D's semantics. The byte-exact whole-transfer tests run through it,
//! and every recorded call is checked against the plan; failures are injected to check how HIP
//! errors and a missing device reach the caller.
//!
//! The copy-kernel path (`SendOptions::copy_kernel`) runs the same way: the recorder's
//! `hipModuleLaunchKernel` runs the kernel's own source (hip/copy_kernel.hip), compiled for the
//! CPU through hip/cpu_shim.hpp with `c++ -shared` when the tests start and loaded with dlopen.
//! Those tests need a C++ compiler; without one they say so and skip, unless
//! MORI_TP_REQUIRE_TOOLS=1 (CI), which makes a missing compiler a failure.

mod common;

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::{null_mut, without_provenance_mut};
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use common::{
    MODELS, Request, Sender, SideBuffers, every_model_deployment, odd_deployments, transfer,
};
use mori_tp::backend::copy_kernel::{BLOCK_THREADS, KernelArgs, MAX_GRID_X, MAX_GRID_Y};
use mori_tp::backend::hip::{
    HIP_MEMCPY_DEFAULT, HipEngine, HipRuntime, HipStatus, KernelCache, KernelImage, KernelLaunch,
    Memcpy2dAsync,
};
use mori_tp::pool::{DeviceMemory, PoolMemory, PoolMemoryKind, StagingPool};
use mori_tp::{
    Backend, CopyEngine, Error, KvBuffers, Plan, SendOptions, SendReport, SliceConfig, SliceParams,
    pack, pack_host, send, slice_config, unpack, unpack_host,
};

/// `hipErrorInvalidMemcpyDirection` (hip/hip_runtime_api.h).
const INVALID_MEMCPY_DIRECTION: HipStatus = HipStatus(21);

/// One runtime call as the engine made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    DeviceCount,
    Memcpy2d(Memcpy2dAsync),
    Synchronize(*mut c_void),
    GetDevice,
    ModuleLoad {
        bytes: usize,
    },
    GetFunction {
        module: *mut c_void,
    },
    /// `returned` is the allocation the recorder handed out (0 when it failed).
    MallocAsync {
        size: usize,
        stream: *mut c_void,
        returned: usize,
    },
    MemcpyHostToDevice {
        dst: *mut c_void,
        size: usize,
        stream: *mut c_void,
    },
    Launch(KernelLaunch),
    FreeAsync {
        pointer: *mut c_void,
        stream: *mut c_void,
    },
    /// `returned` as for `MallocAsync`.
    Malloc {
        size: usize,
        returned: usize,
    },
    Free {
        pointer: *mut c_void,
    },
}

/// What the recorder's hipModuleLoadData and hipModuleGetFunction hand out.
const MODULE: *mut c_void = without_provenance_mut(0x6d6f_6400);
const FUNCTION: *mut c_void = without_provenance_mut(0xf00d_0000);
/// The image the recorder "loads": its bytes are not run, the kernel's CPU build is.
const TEST_IMAGE: KernelImage = KernelImage {
    bytes: b"__CLANG_OFFLOAD_BUNDLE__ (the recorder runs the CPU build)",
    targets: "gfx-test",
};

/// `tests/kernel/cpu_launch.cpp`'s entry point: launches the kernel's CPU build.
type CpuLaunch = unsafe extern "C" fn(u32, u32, u32, u32, u32, u32, *const KernelArgs, u64);

unsafe extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *const c_char;
}

/// `RTLD_NOW` (dlfcn.h).
const RTLD_NOW: c_int = 2;

/// The copy kernel's own source built for the CPU and loaded, once per test process; Err says
/// why it cannot be.
fn cpu_kernel() -> Result<CpuLaunch, String> {
    static KERNEL: OnceLock<Result<usize, String>> = OnceLock::new();
    let address = KERNEL.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cpu-kernel");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let library = dir.join(format!("libcpu_copy_kernel.{}.so", std::process::id()));
        let output = Command::new("c++")
            .args([
                "-std=c++17",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-shared",
                "-fPIC",
            ])
            .arg(root.join("tests/kernel/cpu_launch.cpp"))
            .arg("-o")
            .arg(&library)
            .output()
            .map_err(|e| format!("cannot run c++ ({e}): the kernel's CPU build needs one"))?;
        if !output.status.success() {
            return Err(format!(
                "c++ could not build tests/kernel/cpu_launch.cpp:\n{}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let path = CString::new(library.to_string_lossy().into_owned()).expect("no NUL");
        // SAFETY: a NUL-terminated path; the library has no constructors that need anything.
        let handle = unsafe { dlopen(path.as_ptr(), RTLD_NOW) };
        let symbol = if handle.is_null() {
            null_mut()
        } else {
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            unsafe { dlsym(handle, c"mori_cpu_copy_kernel_launch".as_ptr()) }
        };
        if symbol.is_null() {
            // SAFETY: dlerror returns NULL or a NUL-terminated message.
            let why = unsafe { dlerror() };
            let why = if why.is_null() {
                "unknown".into()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(format!("cannot load {}: {why}", library.display()));
        }
        Ok(symbol as usize)
    });
    match address {
        // SAFETY: the address of mori_cpu_copy_kernel_launch, whose C signature is CpuLaunch.
        Ok(address) => Ok(unsafe { std::mem::transmute::<usize, CpuLaunch>(*address) }),
        Err(why) => Err(why.clone()),
    }
}

/// The CPU kernel, or None after saying why a kernel test skips (a failure under
/// MORI_TP_REQUIRE_TOOLS=1).
fn cpu_kernel_or_skip(test: &str) -> Option<CpuLaunch> {
    match cpu_kernel() {
        Ok(kernel) => Some(kernel),
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_TOOLS", &why);
            None
        }
    }
}

/// A host memory range the replay may touch: (first address, length).
type Region = (usize, usize);

/// Records every call; replays copies on host memory, refusing what hipMemcpy2D refuses and any
/// row outside the registered buffers (where a GPU would fault), without copying anything.
#[derive(Debug)]
struct Recorder {
    /// Shared, so that a test can read the calls of a runtime that something else owns.
    calls: Rc<RefCell<Vec<Call>>>,
    devices: Result<i32, HipStatus>,
    /// Fail the n-th hipMemcpy2DAsync (counting from 0) with this status, copying nothing.
    fail_copy: Option<(usize, HipStatus)>,
    sync_status: HipStatus,
    readable: Vec<Region>,
    writable: Vec<Region>,
    /// What hipGetDevice answers.
    device: Result<i32, HipStatus>,
    /// Fail the first call of this name (a kernel-path call) with this status.
    fail_call: Option<(&'static str, HipStatus)>,
    /// The kernel functions "loaded", shared between recorders to test the cache.
    cache: Arc<KernelCache>,
    /// Live hipMallocAsync allocations (host memory, 8-byte aligned).
    allocations: RefCell<Vec<Box<[u64]>>>,
}

impl Recorder {
    fn new(src: &[&[u8]], dst: &mut [&mut [u8]]) -> Self {
        Recorder {
            calls: Rc::new(RefCell::new(Vec::new())),
            devices: Ok(1),
            fail_copy: None,
            sync_status: HipStatus::SUCCESS,
            readable: src.iter().map(|b| (b.as_ptr() as usize, b.len())).collect(),
            writable: dst
                .iter_mut()
                .map(|b| (b.as_mut_ptr() as usize, b.len()))
                .collect(),
            device: Ok(0),
            fail_call: None,
            cache: Arc::new(KernelCache::new()),
            allocations: RefCell::new(Vec::new()),
        }
    }

    /// Records `call`; the injected status when `name` is the call to fail.
    fn record(&self, call: Call, name: &str) -> Option<HipStatus> {
        self.calls.borrow_mut().push(call);
        self.fail_call
            .filter(|(fail, _)| *fail == name)
            .map(|(_, status)| status)
    }

    /// A new allocation of `size` bytes (host memory, 8-byte aligned); its address.
    fn allocate(&self, size: usize) -> usize {
        let allocation = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        let returned = allocation.as_ptr() as usize;
        self.allocations.borrow_mut().push(allocation);
        returned
    }

    /// Frees a live allocation, as hipFree and hipFreeAsync do; any other pointer is refused.
    fn release(&self, pointer: *mut c_void) -> HipStatus {
        let mut allocations = self.allocations.borrow_mut();
        match allocations
            .iter()
            .position(|a| std::ptr::eq(a.as_ptr().cast::<c_void>(), pointer))
        {
            Some(index) => {
                allocations.swap_remove(index);
                HipStatus::SUCCESS
            }
            None => HipStatus::ERROR_INVALID_VALUE,
        }
    }

    /// The live allocation that holds `[start, start + len)`.
    fn allocation_holds(&self, start: usize, len: usize) -> bool {
        self.allocations.borrow().iter().any(|a| {
            let base = a.as_ptr() as usize;
            start >= base && start + len <= base + a.len() * 8
        })
    }

    /// What a GPU needs before running the kernel: the table inside an allocation and every row
    /// of every (buffer, rect) inside the registered buffers.
    fn kernel_memory_ok(&self, a: &KernelArgs) -> bool {
        let (rects, buffers) = (a.num_rects as usize, a.num_buffers as usize);
        if !self.allocation_holds(a.rects as usize, rects * 64)
            || !self.allocation_holds(a.src_bases as usize, buffers * 8)
            || !self.allocation_holds(a.dst_bases as usize, buffers * 8)
        {
            return false;
        }
        // SAFETY: the three tables lie inside live allocations (checked above).
        let (table, src, dst) = unsafe {
            (
                std::slice::from_raw_parts(a.rects as *const [u64; 8], rects),
                std::slice::from_raw_parts(a.src_bases as *const u64, buffers),
                std::slice::from_raw_parts(a.dst_bases as *const u64, buffers),
            )
        };
        let inside = |regions: &[Region], start: u64, pitch: u64, width: u64, height: u64| {
            (0..height).all(|r| {
                let row = (start + r * pitch) as usize;
                regions
                    .iter()
                    .any(|&(base, len)| row >= base && row + width as usize <= base + len)
            })
        };
        src.iter().zip(dst).all(|(&s, &d)| {
            table.iter().all(|r| {
                let [
                    src_offset,
                    dst_offset,
                    src_pitch,
                    dst_pitch,
                    width,
                    height,
                    ..,
                ] = *r;
                inside(&self.readable, s + src_offset, src_pitch, width, height)
                    && inside(&self.writable, d + dst_offset, dst_pitch, width, height)
            })
        })
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
            209 => "hipErrorNoBinaryForGpu",
            700 => "hipErrorIllegalAddress",
            _ => "hipErrorUnknown",
        }
        .into()
    }

    fn current_device(&self) -> Result<i32, HipStatus> {
        match self.record(Call::GetDevice, "hipGetDevice") {
            Some(status) => Err(status),
            None => self.device,
        }
    }

    fn kernel_image(&self) -> KernelImage {
        TEST_IMAGE
    }

    fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }

    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, HipStatus> {
        let call = Call::ModuleLoad { bytes: image.len() };
        match self.record(call, "hipModuleLoadData") {
            Some(status) => Err(status),
            None => Ok(MODULE),
        }
    }

    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, HipStatus> {
        if let Some(status) = self.record(Call::GetFunction { module }, "hipModuleGetFunction") {
            return Err(status);
        }
        // hipErrorNotFound for any other module or name.
        if module != MODULE || name != c"mori_copy_kernel" {
            return Err(HipStatus(500));
        }
        Ok(FUNCTION)
    }

    unsafe fn malloc_async(
        &self,
        size: usize,
        stream: *mut c_void,
    ) -> Result<*mut c_void, HipStatus> {
        if self
            .fail_call
            .is_some_and(|(name, _)| name == "hipMallocAsync")
        {
            let call = Call::MallocAsync {
                size,
                stream,
                returned: 0,
            };
            return Err(self.record(call, "hipMallocAsync").expect("injected"));
        }
        let returned = self.allocate(size);
        self.record(
            Call::MallocAsync {
                size,
                stream,
                returned,
            },
            "",
        );
        Ok(without_provenance_mut(returned))
    }

    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: &[u8],
        stream: *mut c_void,
    ) -> HipStatus {
        let call = Call::MemcpyHostToDevice {
            dst,
            size: src.len(),
            stream,
        };
        if let Some(status) = self.record(call, "hipMemcpyAsync") {
            return status;
        }
        if !self.allocation_holds(dst as usize, src.len()) {
            return HipStatus::ERROR_INVALID_VALUE;
        }
        let mut allocations = self.allocations.borrow_mut();
        let target = allocations
            .iter_mut()
            .find(|a| {
                let base = a.as_ptr() as usize;
                (base..base + a.len() * 8).contains(&(dst as usize))
            })
            .expect("checked above");
        let at = dst as usize - target.as_ptr() as usize;
        // SAFETY: the allocation holds [at, at + len) (checked above).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(target.as_mut_ptr().cast::<u8>(), target.len() * 8)
        };
        bytes[at..at + src.len()].copy_from_slice(src);
        HipStatus::SUCCESS
    }

    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> HipStatus {
        if let Some(status) = self.record(Call::Launch(*launch), "hipModuleLaunchKernel") {
            return status;
        }
        // hipErrorInvalidResourceHandle, hipErrorInvalidConfiguration, hipErrorIllegalAddress.
        if launch.function != FUNCTION {
            return HipStatus(400);
        }
        if launch.grid.0 == 0 || launch.grid.1 == 0 || launch.block > BLOCK_THREADS {
            return HipStatus(9);
        }
        if !self.kernel_memory_ok(&launch.args) {
            return HipStatus(700);
        }
        let kernel = cpu_kernel().expect("kernel tests check for the CPU kernel first");
        let seed = self.calls.borrow().len() as u64;
        let (x, y) = launch.grid;
        // SAFETY: every address the kernel touches was checked above.
        unsafe { kernel(x, y, 1, launch.block, 1, 1, &launch.args, seed) };
        HipStatus::SUCCESS
    }

    unsafe fn free_async(&self, pointer: *mut c_void, stream: *mut c_void) -> HipStatus {
        if let Some(status) = self.record(Call::FreeAsync { pointer, stream }, "hipFreeAsync") {
            return status;
        }
        self.release(pointer)
    }

    fn malloc(&self, size: usize) -> Result<*mut c_void, HipStatus> {
        if self.fail_call.is_some_and(|(name, _)| name == "hipMalloc") {
            let call = Call::Malloc { size, returned: 0 };
            return Err(self.record(call, "hipMalloc").expect("injected"));
        }
        let returned = self.allocate(size);
        self.record(Call::Malloc { size, returned }, "");
        Ok(without_provenance_mut(returned))
    }

    unsafe fn free(&self, pointer: *mut c_void) -> HipStatus {
        if let Some(status) = self.record(Call::Free { pointer }, "hipFree") {
            return status;
        }
        self.release(pointer)
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

fn kernel_options(synchronize: bool, stream: *mut c_void) -> SendOptions {
    SendOptions {
        copy_kernel: true,
        ..options(synchronize, stream)
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

/// The calls the header documents: the device check, one hipMemcpy2DAsync per (buffer,
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

// ---- The copy-kernel path ----

/// The rows-per-tile and grid rule of hip/copy_kernel.h, restated: tiles of
/// clamp(16384 / width, 1, 1024) rows, grid x over tiles and y over buffers, both capped.
fn expected_geometry(rows: u64, width: u64, buffers: u64) -> (u64, (u32, u32)) {
    let rows_per_block = (16_384 / width.max(1)).clamp(1, 1024);
    let x = rows.div_ceil(rows_per_block).min(u64::from(MAX_GRID_X)) as u32;
    let y = buffers.min(u64::from(MAX_GRID_Y)) as u32;
    (rows_per_block, (x, y))
}

/// The calls a kernel send must make: the device check, hipGetDevice, the module load and
/// function lookup when `load` (first use on the device), then on the stream: one allocation of
/// the table (64 bytes per rect, 16 per buffer), one upload of it, one launch, the free, and
/// hipStreamSynchronize only if asked. `table` is the allocation the recorder handed out.
fn expected_kernel_calls(
    plan: &Plan<'_>,
    src: &[*const u8],
    options: &SendOptions,
    load: bool,
    table: usize,
) -> Vec<Call> {
    let mut calls = vec![Call::DeviceCount];
    let rects: Vec<_> = plan.rects().collect();
    if !plan.sends() || rects.is_empty() || src.is_empty() {
        return calls;
    }
    calls.push(Call::GetDevice);
    if load {
        calls.push(Call::ModuleLoad {
            bytes: TEST_IMAGE.bytes.len(),
        });
        calls.push(Call::GetFunction { module: MODULE });
    }
    let (num_rects, num_buffers) = (rects.len(), src.len());
    let size = 64 * num_rects + 16 * num_buffers;
    let stream = options.stream;
    let rows: u64 = rects.iter().map(|r| r.height).sum();
    let width = rects.iter().map(|r| r.width).max().unwrap_or(0);
    let (rows_per_block, grid) = expected_geometry(rows, width, num_buffers as u64);
    calls.push(Call::MallocAsync {
        size,
        stream,
        returned: table,
    });
    calls.push(Call::MemcpyHostToDevice {
        dst: without_provenance_mut(table),
        size,
        stream,
    });
    let rect_bytes = 64 * num_rects as u64;
    calls.push(Call::Launch(KernelLaunch {
        function: FUNCTION,
        grid,
        block: 256,
        stream,
        args: KernelArgs {
            rects: table as u64,
            src_bases: table as u64 + rect_bytes,
            dst_bases: table as u64 + rect_bytes + 8 * num_buffers as u64,
            num_rects: num_rects as u64,
            num_buffers: num_buffers as u64,
            total_rows: rows,
            rows_per_block,
        },
    }));
    calls.push(Call::FreeAsync {
        pointer: without_provenance_mut(table),
        stream,
    });
    if options.synchronize {
        calls.push(Call::Synchronize(stream));
    }
    calls
}

/// The table the recorder allocated in `calls` (0 if none).
fn table_of(calls: &[Call]) -> usize {
    calls
        .iter()
        .find_map(|c| match c {
            Call::MallocAsync { returned, .. } => Some(*returned),
            _ => None,
        })
        .unwrap_or(0)
}

/// Runs `job` (a send, pack or unpack, given the engine) through a kernel engine on `runtime`;
/// returns the result, the recorded calls and the uploaded table's bytes as the kernel read it.
fn kernel_run(
    runtime: Recorder,
    options: &SendOptions,
    job: impl FnOnce(&mut HipEngine<Recorder>) -> mori_tp::Result<SendReport>,
) -> (mori_tp::Result<SendReport>, Vec<Call>) {
    let mut engine = HipEngine::new(runtime, options).expect("the recorder has a device");
    let result = job(&mut engine);
    let runtime = engine.runtime();
    if runtime
        .fail_call
        .is_none_or(|(call, _)| call != "hipFreeAsync")
    {
        assert!(
            runtime.allocations.borrow().is_empty(),
            "every table allocation was freed"
        );
    }
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
        let expected = expected_kernel_calls(plan, &src_ptrs, &options, true, table_of(&calls));
        assert_eq!(calls, expected, "HIP calls for {:?}", plan.config());
        Some(report)
    })
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
    let sends = usize::from(staging_len > 0);
    assert_eq!((launches, uploads), (sends, sends), "{calls:?}");

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

/// The fixture's pair (1 -> 3) through the kernel with `make` adjusting the recorder.
fn kernel_fixture_run(
    f: &mut Fixture,
    options: &SendOptions,
    make: impl FnOnce(Recorder) -> Recorder,
) -> (mori_tp::Result<SendReport>, Vec<Call>) {
    let config = slice_config(&f.params(1)).unwrap();
    let plan = Plan::new(&config, &f.src_pages, &f.dst_pages).unwrap();
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
    // SAFETY: live slices; the recorder checks every row before running the kernel.
    kernel_run(runtime, options, |engine| unsafe {
        send(&plan, &buffers, engine)
    })
}

fn names(calls: &[Call]) -> Vec<&'static str> {
    calls
        .iter()
        .map(|c| match c {
            Call::DeviceCount => "hipGetDeviceCount",
            Call::Memcpy2d(_) => "hipMemcpy2DAsync",
            Call::Synchronize(_) => "hipStreamSynchronize",
            Call::GetDevice => "hipGetDevice",
            Call::ModuleLoad { .. } => "hipModuleLoadData",
            Call::GetFunction { .. } => "hipModuleGetFunction",
            Call::MallocAsync { .. } => "hipMallocAsync",
            Call::MemcpyHostToDevice { .. } => "hipMemcpyAsync",
            Call::Launch(_) => "hipModuleLaunchKernel",
            Call::FreeAsync { .. } => "hipFreeAsync",
            Call::Malloc { .. } => "hipMalloc",
            Call::Free { .. } => "hipFree",
        })
        .collect()
}

#[test]
fn the_kernel_is_loaded_once_per_device_and_reused() {
    if cpu_kernel_or_skip("the_kernel_is_loaded_once_per_device_and_reused").is_none() {
        return;
    }
    let cache = Arc::new(KernelCache::new());
    let mut f = Fixture::new();
    let opts = kernel_options(false, null_mut());
    let mut loads = Vec::new();
    for device in [0, 0, 1, 0, 1] {
        let shared = cache.clone();
        let (result, calls) = kernel_fixture_run(&mut f, &opts, |r| Recorder {
            cache: shared,
            device: Ok(device),
            ..r
        });
        result.unwrap();
        loads.push(names(&calls).contains(&"hipModuleLoadData"));
    }
    assert_eq!(loads, [true, false, true, false, false]);
}

#[test]
fn a_failing_launch_is_a_gpu_error_that_still_frees_the_table_and_waits_when_asked() {
    if cpu_kernel_or_skip("a_failing_launch_...").is_none() {
        return;
    }
    let mut f = Fixture::new();
    let initial = f.dst.ranks[3].clone();
    let stream = without_provenance_mut(0xabc000);
    let (result, calls) = kernel_fixture_run(&mut f, &kernel_options(true, stream), |r| Recorder {
        fail_call: Some(("hipModuleLaunchKernel", HipStatus(98))),
        ..r
    });
    let message = gpu_message(result);
    for part in [
        "hipModuleLaunchKernel(mori_copy_kernel, grid (",
        "block (256, 1, 1), stream 0xabc000",
        "returned hipErrorUnknown (98)",
        "(4 buffers x 3 rects, 20 rows per buffer)",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert_eq!(
        names(&calls),
        [
            "hipGetDeviceCount",
            "hipGetDevice",
            "hipModuleLoadData",
            "hipModuleGetFunction",
            "hipMallocAsync",
            "hipMemcpyAsync",
            "hipModuleLaunchKernel",
            "hipFreeAsync",
            "hipStreamSynchronize",
        ]
    );
    assert_eq!(f.dst.ranks[3], initial, "a failed launch writes nothing");
}

#[test]
fn each_failing_kernel_path_call_is_named_and_issues_nothing_after_it_but_the_free() {
    if cpu_kernel_or_skip("each_failing_kernel_path_call_...").is_none() {
        return;
    }
    for (call, then) in [
        ("hipGetDevice", &[][..]),
        ("hipModuleLoadData", &[][..]),
        ("hipModuleGetFunction", &[][..]),
        ("hipMallocAsync", &[][..]),
        ("hipMemcpyAsync", &["hipFreeAsync"][..]),
        ("hipFreeAsync", &[][..]),
    ] {
        let mut f = Fixture::new();
        let (result, calls) =
            kernel_fixture_run(&mut f, &kernel_options(false, null_mut()), |r| Recorder {
                fail_call: Some((call, HipStatus(123_456))),
                ..r
            });
        match result {
            Err(Error::Gpu {
                call: failed,
                status,
                message,
            }) => {
                assert_eq!((failed, status), (call, 123_456), "{message}");
                assert!(
                    message.starts_with(call) && message.contains("hipErrorUnknown (123456)"),
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
    }
}

#[test]
fn a_failed_load_is_not_cached() {
    if cpu_kernel_or_skip("a_failed_load_is_not_cached").is_none() {
        return;
    }
    let cache = Arc::new(KernelCache::new());
    let mut f = Fixture::new();
    let opts = kernel_options(false, null_mut());
    let shared = cache.clone();
    let (result, _) = kernel_fixture_run(&mut f, &opts, |r| Recorder {
        cache: shared,
        fail_call: Some(("hipModuleLoadData", HipStatus(209))),
        ..r
    });
    assert!(gpu_message(result).contains("hipErrorNoBinaryForGpu (209)"));
    let (result, calls) = kernel_fixture_run(&mut f, &opts, |r| Recorder { cache, ..r });
    result.unwrap();
    assert!(names(&calls).contains(&"hipModuleLoadData"));
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
    assert_eq!(f.dst.ranks[3], initial);
}

#[test]
fn the_rust_table_layout_and_grid_rule_match_the_c_header() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("hip/copy_kernel.h"))
            .expect("hip/copy_kernel.h");
    let define = |name: &str| -> u64 {
        let line = header
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} is not defined"));
        line.split_whitespace()
            .nth(2)
            .unwrap()
            .trim_end_matches('u')
            .parse()
            .unwrap()
    };
    use mori_tp::backend::copy_kernel as k;
    assert_eq!(
        define("MORI_COPY_BLOCK_THREADS"),
        u64::from(k::BLOCK_THREADS)
    );
    assert_eq!(define("MORI_COPY_MAX_GRID_X"), u64::from(k::MAX_GRID_X));
    assert_eq!(define("MORI_COPY_MAX_GRID_Y"), u64::from(k::MAX_GRID_Y));
    assert_eq!(define("MORI_COPY_TILE_BYTES"), k::TILE_BYTES);
    assert_eq!(
        define("MORI_COPY_MAX_ROWS_PER_BLOCK"),
        k::MAX_ROWS_PER_BLOCK
    );
    assert!(header.contains(&format!(
        "#define MORI_COPY_KERNEL_NAME \"{}\"",
        k::KERNEL_NAME.to_str().unwrap()
    )));
    // The struct fields, in order, as the header declares them.
    // The struct fields, in order, as the header declares them (one per line).
    let fields = |name: &str| -> Vec<String> {
        let start = header.find(&format!("typedef struct {name} {{")).unwrap();
        let body = &header[start..start + header[start..].find('}').unwrap()];
        body.lines()
            .skip(1)
            .filter_map(|l| {
                let decl = l.split("/*").next().unwrap().trim().trim_end_matches(';');
                let field = decl.rsplit(' ').next()?.trim_start_matches('*');
                (!field.is_empty()).then(|| field.to_string())
            })
            .collect()
    };
    // Every field is 8 bytes, so the header's order fixes each offset.
    use std::mem::offset_of;
    let rect_offsets = [
        ("src_offset", offset_of!(k::KernelRect, src_offset)),
        ("dst_offset", offset_of!(k::KernelRect, dst_offset)),
        ("src_pitch", offset_of!(k::KernelRect, src_pitch)),
        ("dst_pitch", offset_of!(k::KernelRect, dst_pitch)),
        ("width", offset_of!(k::KernelRect, width)),
        ("height", offset_of!(k::KernelRect, height)),
        ("first_row", offset_of!(k::KernelRect, first_row)),
        ("reserved", offset_of!(k::KernelRect, reserved)),
    ];
    let args_offsets = [
        ("rects", offset_of!(KernelArgs, rects)),
        ("src_bases", offset_of!(KernelArgs, src_bases)),
        ("dst_bases", offset_of!(KernelArgs, dst_bases)),
        ("num_rects", offset_of!(KernelArgs, num_rects)),
        ("num_buffers", offset_of!(KernelArgs, num_buffers)),
        ("total_rows", offset_of!(KernelArgs, total_rows)),
        ("rows_per_block", offset_of!(KernelArgs, rows_per_block)),
    ];
    for (name, offsets) in [
        ("MoriCopyKernelRect", &rect_offsets[..]),
        ("MoriCopyKernelArgs", &args_offsets[..]),
    ] {
        let declared = fields(name);
        assert_eq!(declared.len(), offsets.len(), "{name}: {declared:?}");
        for (index, (field, (rust, offset))) in declared.iter().zip(offsets).enumerate() {
            assert_eq!((field.as_str(), *offset), (*rust, 8 * index), "{name}");
        }
    }
    for (rows, width, buffers) in [(1000, 256, 70_000), (1 << 40, 1, 3), (7, 20_000, 2)] {
        let (rpb, grid) = expected_geometry(rows, width, buffers);
        assert_eq!(k::rows_per_block(width), rpb);
        assert_eq!(k::grid(rows, rpb, buffers), grid);
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
    let malloc = Call::Malloc {
        size: 1 << 20,
        returned: base,
    };
    // Slots are carved on the host, without runtime calls.
    assert_eq!(*calls.borrow(), [Call::DeviceCount, malloc]);
    drop(pool);
    let free = Call::Free {
        pointer: without_provenance_mut(base),
    };
    assert_eq!(*calls.borrow(), [Call::DeviceCount, malloc, free]);
}

#[test]
fn a_failing_hipmalloc_is_a_gpu_error_naming_the_size_and_status() {
    let mut recorder = pool_recorder();
    recorder.fail_call = Some(("hipMalloc", HipStatus(2)));
    let error = DeviceMemory::new(recorder, 1 << 30).unwrap_err();
    let Error::Gpu {
        call,
        status,
        message,
    } = &error
    else {
        panic!("{error}");
    };
    assert_eq!((*call, *status), ("hipMalloc", 2));
    assert!(
        message.contains("hipMalloc(1073741824 bytes) for a staging pool returned"),
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
