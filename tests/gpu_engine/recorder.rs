//! A recording stand-in for libamdhip64: it logs every call with its exact arguments and performs
//! it on host memory, as strictly as a GPU would: hipMemcpy2D's rules for copies; for kernel
//! launches the function must be loaded on the stream's device, the table must lie in that
//! device's hipMalloc'd memory and every row of every (buffer, rect) in the registered buffers,
//! and then the kernel's own source runs on the CPU (tests/kernel/cpu_launch.cpp, built with
//! `c++ -shared` and loaded with dlopen). Uploads must come from pinned (hipHostMalloc'd)
//! memory, events must belong to the stream's device, and a function looked up on another
//! device than its module's panics, as clr aborts there. Failures are injected by name.
//!
//! It keeps clr's graph-capture rules (ROCm/clr, hipamd/src): while another thread captures in
//! the global mode, hipMalloc, hipHostMalloc and hipFree (`CHECK_STREAM_CAPTURE_SUPPORTED`,
//! hip_internal.hpp, used in hip_memory.cpp) and hipStreamSynchronize and hipEventSynchronize
//! (`Stream::StreamCaptureOngoing`, hip_stream.cpp) from a thread not in the relaxed mode return
//! hipErrorStreamCaptureUnsupported and invalidate that capture; hipEventQuery and
//! hipEventSynchronize of an event last recorded on a stream that is capturing now invalidate
//! that capture and return hipErrorCapturedEvent (hip_event.cpp, `ihipEventQuery` and
//! `hipEventSynchronize`); hipStreamWaitEvent on such an event returns
//! hipErrorStreamCaptureIsolation (hip_stream.cpp, `hipStreamWaitEvent_common`). And it knows
//! which stream's progress each event and stream waits for: a stream can be blocked (as by
//! hipStreamWaitValue32 on a flag nobody raised yet), and then hipEventQuery of every event
//! recorded behind it, or behind a hipStreamWaitEvent for it, says not ready; a
//! hipEventSynchronize of such an event, which would never return, returns [`WOULD_HANG`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::process::Command;
use std::ptr::without_provenance_mut;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use super::common;
use mori_tp::gpu_runtime::{
    Api, BLOCK_THREADS, CaptureMode, GpuRuntime, GpuStatus, HIP_API, HIP_MEMCPY_DEFAULT,
    INLINE_TABLE_BYTES, KernelArgs, KernelArgsOf, KernelCache, KernelImage, KernelLaunch,
    Memcpy2dAsync, PointerInfo, WIDE_KERNEL_NAME, WideKernelArgs, WideKernelLaunch, decode,
    inline_bytes,
};

/// `hipErrorInvalidMemcpyDirection` (hip/hip_runtime_api.h).
pub const INVALID_MEMCPY_DIRECTION: GpuStatus = GpuStatus(21);
/// `hipErrorInvalidDeviceFunction`.
pub const INVALID_DEVICE_FUNCTION: GpuStatus = GpuStatus(98);
/// `hipErrorInvalidHandle` (`hipErrorInvalidResourceHandle` is the same value).
pub const INVALID_RESOURCE_HANDLE: GpuStatus = GpuStatus(400);
/// `hipErrorIllegalAddress`.
pub const ILLEGAL_ADDRESS: GpuStatus = GpuStatus(700);
/// `hipErrorStreamCaptureIsolation`.
pub const CAPTURE_ISOLATION: GpuStatus = GpuStatus(905);
/// What the recorder returns for a host wait that would never end (the stream it waits for is
/// blocked); not a HIP status.
pub const WOULD_HANG: GpuStatus = GpuStatus(77_777);

/// A blocked stream and the generation of its block: what an event or a stream waits for.
type Dependency = (usize, u64);

/// One runtime call as the engine made it.
// A launch carries the kernel's whole 4 KiB argument (its table may be inside); the log is a
// test's, and comparing it by value keeps the expected calls plain.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    DeviceCount,
    GetDevice,
    SetDevice(i32),
    /// `hipThreadExchangeStreamCaptureMode` with the mode asked for.
    ExchangeCaptureMode(CaptureMode),
    CanAccessPeer {
        device: i32,
        peer: i32,
    },
    StreamCreate {
        returned: usize,
    },
    StreamWaitEvent {
        stream: *mut c_void,
        event: *mut c_void,
    },
    EventQuery {
        event: *mut c_void,
    },
    StreamGetDevice(*mut c_void),
    IsCapturing(*mut c_void),
    Memcpy2d(Memcpy2dAsync),
    Synchronize(*mut c_void),
    ModuleLoad {
        bytes: usize,
    },
    GetFunction {
        module: *mut c_void,
    },
    ModuleUnload {
        module: *mut c_void,
    },
    /// `returned` is the allocation the recorder handed out (0 when it failed).
    Malloc {
        size: usize,
        returned: usize,
    },
    Free {
        pointer: *mut c_void,
    },
    HostMalloc {
        size: usize,
        returned: usize,
    },
    EventCreate {
        returned: usize,
    },
    EventRecord {
        event: *mut c_void,
        stream: *mut c_void,
    },
    EventSynchronize {
        event: *mut c_void,
    },
    PointerInfo {
        pointer: *const c_void,
    },
    AddressRange {
        pointer: *mut c_void,
    },
    MemcpyHostToDevice {
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        stream: *mut c_void,
    },
    Launch(KernelLaunch),
    /// A launch of the wide entry: its argument's header fields that tell launches apart.
    LaunchWide {
        function: *mut c_void,
        grid: (u32, u32),
        stream: *mut c_void,
        table: u64,
        table_bytes: u32,
    },
}

impl Call {
    /// The HIP function's name.
    pub fn name(&self) -> &'static str {
        match self {
            Call::DeviceCount => "hipGetDeviceCount",
            Call::GetDevice => "hipGetDevice",
            Call::SetDevice(_) => "hipSetDevice",
            Call::ExchangeCaptureMode(_) => "hipThreadExchangeStreamCaptureMode",
            Call::CanAccessPeer { .. } => "hipDeviceCanAccessPeer",
            Call::StreamCreate { .. } => "hipStreamCreateWithFlags",
            Call::StreamWaitEvent { .. } => "hipStreamWaitEvent",
            Call::EventQuery { .. } => "hipEventQuery",
            Call::StreamGetDevice(_) => "hipStreamGetDevice",
            Call::IsCapturing(_) => "hipStreamIsCapturing",
            Call::Memcpy2d(_) => "hipMemcpy2DAsync",
            Call::Synchronize(_) => "hipStreamSynchronize",
            Call::ModuleLoad { .. } => "hipModuleLoadData",
            Call::GetFunction { .. } => "hipModuleGetFunction",
            Call::ModuleUnload { .. } => "hipModuleUnload",
            Call::Malloc { .. } => "hipMalloc",
            Call::Free { .. } => "hipFree",
            Call::HostMalloc { .. } => "hipHostMalloc",
            Call::EventCreate { .. } => "hipEventCreateWithFlags",
            Call::EventRecord { .. } => "hipEventRecord",
            Call::EventSynchronize { .. } => "hipEventSynchronize",
            Call::PointerInfo { .. } => "hipPointerGetAttributes",
            Call::AddressRange { .. } => "hipMemGetAddressRange",
            Call::MemcpyHostToDevice { .. } => "hipMemcpyAsync",
            Call::Launch(_) | Call::LaunchWide { .. } => "hipModuleLaunchKernel",
        }
    }
}

/// The names of `calls`, in order.
pub fn names(calls: &[Call]) -> Vec<&'static str> {
    calls.iter().map(Call::name).collect()
}

/// What the recorder's hipStreamCreateWithFlags hands out for its n-th stream.
pub fn created_handle(n: usize) -> *mut c_void {
    without_provenance_mut(0x57e0_0000 + 0x100 * n)
}

/// The index of a stream `created_handle` made (a huge number for any other stream).
fn created_index(stream: *mut c_void) -> usize {
    let at = (stream as usize).wrapping_sub(0x57e0_0000);
    if at % 0x100 == 0 {
        at / 0x100
    } else {
        usize::MAX
    }
}

/// What the recorder's hipModuleLoadData hands out for its n-th module (and
/// hipModuleGetFunction for its function): distinct per load, so that a stale one shows.
pub fn module_handle(n: usize) -> *mut c_void {
    without_provenance_mut(0x6d6f_6400 + 0x100 * n)
}
pub fn function_handle(n: usize) -> *mut c_void {
    without_provenance_mut(0xf00d_0000 + 0x100 * n)
}

/// The image the recorder "loads": its bytes are not run, the kernel's CPU build is.
pub const TEST_IMAGE: KernelImage = KernelImage {
    bytes: b"__CLANG_OFFLOAD_BUNDLE__ (the recorder runs the CPU build)",
    targets: "gfx-test",
};

/// The wide entry's image, for a recorder with a wide argument (`wide_room`).
pub const TEST_WIDE_IMAGE: KernelImage = KernelImage {
    bytes: b"(the recorder's wide entry: it runs the CPU build)",
    targets: "sm-test",
};

/// `tests/kernel/cpu_launch.cpp`'s entry points.
type CpuLaunch = unsafe extern "C" fn(u32, u32, u32, u32, u32, u32, *const KernelArgs, u64);
type CpuLaunchWide = unsafe extern "C" fn(u32, u32, u32, u32, u32, u32, *const WideKernelArgs, u64);
type CpuLanes = unsafe extern "C" fn(*mut u64, *mut u64);

/// The copy kernel's own source built for the CPU and loaded, once per test process.
#[derive(Clone, Copy, Debug)]
pub struct CpuKernel {
    launch: CpuLaunch,
    launch_wide: CpuLaunchWide,
    lanes: CpuLanes,
}

impl CpuKernel {
    /// The (thread, step) slots of the last launch on this thread, and how many moved bytes.
    pub fn lanes(&self) -> (u64, u64) {
        let (mut slots, mut active) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { (self.lanes)(&mut slots, &mut active) };
        (slots, active)
    }
}

/// The CPU kernel; Err says why it cannot be built or loaded.
pub fn cpu_kernel() -> Result<CpuKernel, String> {
    static KERNEL: OnceLock<Result<(usize, usize, usize), String>> = OnceLock::new();
    let addresses = KERNEL.get_or_init(|| {
        let library = common::scratch(&["cpu-kernel"])
            .join(format!("libcpu_copy_kernel.{}.so", std::process::id()));
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
            .arg(common::root().join("tests/kernel/cpu_launch.cpp"))
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
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW) };
        let symbol = |name: &CStr| {
            if handle.is_null() {
                return 0;
            }
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            unsafe { libc::dlsym(handle, name.as_ptr()) as usize }
        };
        let launch = symbol(c"mori_cpu_copy_kernel_launch");
        let lanes = symbol(c"mori_cpu_copy_kernel_lanes");
        let launch_wide = symbol(c"mori_cpu_copy_kernel_wide_launch");
        if launch == 0 || lanes == 0 || launch_wide == 0 {
            // SAFETY: dlerror returns NULL or a NUL-terminated message.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "a symbol is missing".into()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(format!("cannot load {}: {why}", library.display()));
        }
        Ok((launch, lanes, launch_wide))
    });
    match addresses {
        // SAFETY: the addresses of the three entry points, whose C signatures these are.
        Ok((launch, lanes, launch_wide)) => Ok(unsafe {
            CpuKernel {
                launch: std::mem::transmute::<usize, CpuLaunch>(*launch),
                launch_wide: std::mem::transmute::<usize, CpuLaunchWide>(*launch_wide),
                lanes: std::mem::transmute::<usize, CpuLanes>(*lanes),
            }
        }),
        Err(why) => Err(why.clone()),
    }
}

/// The CPU kernel, or None after saying why a kernel test skips (a failure under
/// MORI_TP_REQUIRE_TOOLS=1).
pub fn cpu_kernel_or_skip(test: &str) -> Option<CpuKernel> {
    match cpu_kernel() {
        Ok(kernel) => Some(kernel),
        Err(why) => {
            common::skip_missing(test, "MORI_TP_REQUIRE_TOOLS", &why);
            None
        }
    }
}

/// A host memory range: (first address, length).
pub type Region = (usize, usize);

fn inside(regions: &[Region], start: usize, len: usize) -> bool {
    regions
        .iter()
        .any(|&(base, size)| start >= base && start + len <= base + size)
}

/// A hipMalloc'd (device) or hipHostMalloc'd (pinned) allocation: host memory, 8-byte aligned.
#[derive(Debug)]
pub struct Allocation {
    device: i32,
    /// The size asked for (what hipMemGetAddressRange reports).
    size: usize,
    words: Box<[u64]>,
}

impl Allocation {
    fn base(&self) -> usize {
        self.words.as_ptr() as usize
    }

    fn holds(&self, start: usize, len: usize) -> bool {
        start >= self.base() && start + len <= self.base() + self.words.len() * 8
    }
}

/// A loaded module: the device it was loaded on, and whether a reset has invalidated it.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    device: i32,
    live: bool,
    /// Loaded from [`TEST_WIDE_IMAGE`]: its function is the wide entry.
    wide: bool,
}

/// Records every call; replays it on host memory, refusing what a GPU would refuse, without
/// doing anything.
#[derive(Debug)]
pub struct Recorder {
    /// Every call so far, shared so that a test can read it after handing the recorder away.
    pub calls: Rc<RefCell<Vec<Call>>>,
    /// What hipGetDeviceCount answers.
    pub devices: Result<i32, GpuStatus>,
    /// Fail the n-th hipMemcpy2DAsync (counting from 0) with this status, copying nothing.
    pub fail_copy: Option<(usize, GpuStatus)>,
    pub sync_status: GpuStatus,
    /// Buffers the copies and the kernel may read and write.
    pub readable: Vec<Region>,
    pub writable: Vec<Region>,
    /// What hipPointerGetAttributes calls device memory besides the runtime's own allocations
    /// (the test's buffers); it knows nothing else (pageable host memory).
    pub device_memory: Vec<Region>,
    /// Host memory registered with hipHostRegister, and the address devices see it at.
    pub registered: Vec<(Region, usize)>,
    /// The calling thread's current device (hipGetDevice; hipSetDevice changes it).
    pub current: RefCell<i32>,
    /// The device every non-NULL stream belongs to.
    pub stream_home: Cell<i32>,
    /// Whether the runtime exports hipStreamGetDevice (HIP 5.6 and later: hipamd rocm-5.6.0).
    pub has_stream_get_device: bool,
    /// Whether every non-NULL stream is capturing a graph.
    pub capturing: Cell<bool>,
    /// Whether a kernel launch on a capturing stream is captured (HIP 5.3 and later); HIP 5.2
    /// would run it at once and leave it out of the graph, which the recorder refuses to do.
    pub captures_launches: bool,
    /// What `resident_blocks` answers (the device's SM count times the kernel's occupancy);
    /// None: the runtime cannot say.
    pub resident: Option<u32>,
    /// What `inline_table_bytes` answers: INLINE_TABLE_BYTES (the default: no wide entry, as
    /// HIP), or more for a runtime with the wide entry ([`TEST_WIDE_IMAGE`], as CUDA 12.1+).
    pub wide_room: usize,
    /// Fail every load of the wide entry's image with this status.
    pub wide_load_status: Option<GpuStatus>,
    /// Streams capturing a graph, each (besides every stream with `capturing`).
    pub captures: RefCell<Vec<usize>>,
    /// Captures invalidated by a call the runtime refused or answered with
    /// hipErrorCapturedEvent: the stream, or 0 for another thread's global-mode capture.
    pub invalidated: RefCell<Vec<usize>>,
    /// Another thread captures a graph in the global mode.
    pub global_capture_elsewhere: Cell<bool>,
    /// The calling thread's capture mode.
    pub capture_mode: Cell<CaptureMode>,
    /// What hipDeviceCanAccessPeer answers for two different devices.
    pub peer_access: Cell<bool>,
    /// Streams made with hipStreamCreateWithFlags: the device of each (handle index + 1).
    pub streams: RefCell<Vec<i32>>,
    /// Blocked streams and the generation of each block.
    pub blocked: RefCell<HashMap<usize, u64>>,
    pub generation: Cell<u64>,
    /// What work enqueued on a stream now waits for (its hipStreamWaitEvent calls).
    pub stream_waits: RefCell<HashMap<usize, Vec<Dependency>>>,
    /// Per event: the stream of its last record, and what that record waits for.
    pub event_records: RefCell<HashMap<usize, (usize, Vec<Dependency>)>>,
    /// Fail every call of this name with this status.
    pub fail_call: Cell<Option<(&'static str, GpuStatus)>>,
    /// The kernel state, shared between recorders to test the cache.
    pub cache: Arc<KernelCache>,
    pub device_allocations: RefCell<Vec<Allocation>>,
    pub host_allocations: RefCell<Vec<Allocation>>,
    /// Events by handle (index + 1): the device each was created on.
    pub events: RefCell<Vec<i32>>,
    pub modules: RefCell<Vec<Module>>,
    /// The generation of the caller's device memory (`device_memory`): a test raises it to
    /// model the buffers freed and their addresses reused by new allocations, which
    /// hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_BUFFER_ID) then tells apart.
    pub memory_generation: Cell<u64>,
    /// hipPointerGetAttribute(BUFFER_ID) calls (not in `calls`: a lookup that every kernel call
    /// makes per base, which would lengthen every recorded call list).
    pub allocation_id_asks: Cell<usize>,
    /// The device each hipPointerGetAttributes was asked for (where a kernel would use the
    /// memory; CUDA asks in that device's primary context).
    pub pointer_info_devices: RefCell<Vec<i32>>,
}

impl Recorder {
    pub fn new(src: &[&[u8]], dst: &mut [&mut [u8]]) -> Self {
        let readable: Vec<Region> = src.iter().map(|b| (b.as_ptr() as usize, b.len())).collect();
        let writable: Vec<Region> = dst
            .iter_mut()
            .map(|b| (b.as_mut_ptr() as usize, b.len()))
            .collect();
        Recorder {
            calls: Rc::new(RefCell::new(Vec::new())),
            devices: Ok(1),
            fail_copy: None,
            sync_status: GpuStatus::SUCCESS,
            device_memory: readable.iter().chain(&writable).copied().collect(),
            readable,
            writable,
            registered: Vec::new(),
            current: RefCell::new(0),
            stream_home: Cell::new(0),
            has_stream_get_device: true,
            capturing: Cell::new(false),
            captures_launches: true,
            resident: None,
            wide_room: INLINE_TABLE_BYTES,
            wide_load_status: None,
            captures: RefCell::new(Vec::new()),
            invalidated: RefCell::new(Vec::new()),
            global_capture_elsewhere: Cell::new(false),
            capture_mode: Cell::new(CaptureMode::GLOBAL),
            peer_access: Cell::new(true),
            streams: RefCell::new(Vec::new()),
            blocked: RefCell::new(HashMap::new()),
            generation: Cell::new(0),
            stream_waits: RefCell::new(HashMap::new()),
            event_records: RefCell::new(HashMap::new()),
            fail_call: Cell::new(None),
            cache: Arc::new(KernelCache::new()),
            device_allocations: RefCell::new(Vec::new()),
            host_allocations: RefCell::new(Vec::new()),
            events: RefCell::new(Vec::new()),
            modules: RefCell::new(Vec::new()),
            memory_generation: Cell::new(0),
            allocation_id_asks: Cell::new(0),
            pointer_info_devices: RefCell::new(Vec::new()),
        }
    }

    /// `hipEventSynchronize(event)` as clr answers it (the engine never waits for an event: a
    /// test checks what the runtime would refuse).
    ///
    /// # Safety
    /// None: the recorder only looks the event up.
    pub unsafe fn event_synchronize(&self, event: *mut c_void) -> Result<(), GpuStatus> {
        self.record(Call::EventSynchronize { event })?;
        self.check_event(event)?;
        self.event_outside_capture(event)?;
        self.capture_allows()?;
        if !self.event_passed(event) {
            return Err(WOULD_HANG);
        }
        Ok(())
    }

    /// Records `call`; the injected status when `call` is the one to fail.
    fn record(&self, call: Call) -> Result<(), GpuStatus> {
        let name = call.name();
        self.calls.borrow_mut().push(call);
        match self.fail_call.get() {
            Some((fail, status)) if fail == name => Err(status),
            _ => Ok(()),
        }
    }

    /// What hipDeviceReset does to `device`: its memory is gone, and so are its modules.
    pub fn reset_device(&self, device: i32) {
        self.device_allocations
            .borrow_mut()
            .retain(|a| a.device != device);
        for module in self.modules.borrow_mut().iter_mut() {
            if module.device == device {
                module.live = false;
            }
        }
    }

    /// What hipDeviceReset does to `device`, after which the caller allocates `size` bytes and
    /// the allocator hands out the address of the device's first freed allocation again: the
    /// runtime's modules are gone, and that address is the start of the caller's allocation.
    /// Returns the address.
    pub fn reset_device_and_reuse_address(&self, device: i32, size: usize) -> usize {
        let mut allocations = self.device_allocations.borrow_mut();
        let at = allocations
            .iter()
            .position(|a| a.device == device)
            .expect("the device has an allocation");
        // The caller's allocation keeps the freed one's memory (and so its address).
        let mut reused = allocations.swap_remove(at);
        allocations.retain(|a| a.device != device);
        // What the runtime reports for the caller's allocation (its memory here stays the freed
        // one's: the test only checks that nothing writes it).
        reused.size = size;
        let address = reused.base();
        allocations.push(reused);
        drop(allocations);
        for module in self.modules.borrow_mut().iter_mut() {
            if module.device == device {
                module.live = false;
            }
        }
        address
    }

    /// Live hipMalloc'd and hipHostMalloc'd allocations.
    pub fn live_allocations(&self) -> (usize, usize) {
        (
            self.device_allocations.borrow().len(),
            self.host_allocations.borrow().len(),
        )
    }

    /// The device of `stream`'s work.
    fn stream_device_of(&self, stream: *mut c_void) -> i32 {
        if stream.is_null() {
            return *self.current.borrow();
        }
        match self.streams.borrow().get(created_index(stream)) {
            Some(&device) => device,
            None => self.stream_home.get(),
        }
    }

    /// Whether `stream` is capturing a graph.
    pub fn stream_captures(&self, stream: usize) -> bool {
        stream != 0 && (self.capturing.get() || self.captures.borrow().contains(&stream))
    }

    /// Blocks `stream`, as a hipStreamWaitValue32 for a flag nobody raised yet does: nothing
    /// enqueued on it from now on finishes until [`Recorder::release_stream`].
    pub fn block_stream(&self, stream: usize) {
        self.generation.set(self.generation.get() + 1);
        self.blocked
            .borrow_mut()
            .insert(stream, self.generation.get());
    }

    /// Lets `stream` run again.
    pub fn release_stream(&self, stream: usize) {
        self.blocked.borrow_mut().remove(&stream);
    }

    /// What work enqueued on `stream` now waits for.
    fn dependencies_of(&self, stream: usize) -> Vec<Dependency> {
        let mut deps = self
            .stream_waits
            .borrow()
            .get(&stream)
            .cloned()
            .unwrap_or_default();
        if let Some(&generation) = self.blocked.borrow().get(&stream) {
            deps.push((stream, generation));
        }
        deps
    }

    /// Whether everything `deps` waits for has run.
    fn passed(&self, deps: &[Dependency]) -> bool {
        let blocked = self.blocked.borrow();
        deps.iter()
            .all(|(stream, g)| blocked.get(stream) != Some(g))
    }

    /// clr's `CHECK_STREAM_CAPTURE_SUPPORTED` and `StreamCaptureOngoing` for a call that is
    /// unsafe during capture: refused, invalidating the other thread's capture, unless the
    /// thread is in the relaxed mode.
    fn capture_allows(&self) -> Result<(), GpuStatus> {
        if self.global_capture_elsewhere.get() && self.capture_mode.get() != CaptureMode::RELAXED {
            self.invalidated.borrow_mut().push(0);
            return Err(GpuStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// clr's check of a queried or waited-for event: one last recorded on a capturing stream
    /// invalidates that capture (hipErrorCapturedEvent).
    fn event_outside_capture(&self, event: *mut c_void) -> Result<(), GpuStatus> {
        let stream = self
            .event_records
            .borrow()
            .get(&(event as usize))
            .map(|r| r.0);
        match stream {
            Some(stream) if self.stream_captures(stream) => {
                self.invalidated.borrow_mut().push(stream);
                Err(GpuStatus::ERROR_CAPTURED_EVENT)
            }
            _ => Ok(()),
        }
    }

    /// Whether the work before `event`'s last record has run.
    fn event_passed(&self, event: *mut c_void) -> bool {
        let deps = self
            .event_records
            .borrow()
            .get(&(event as usize))
            .map(|r| r.1.clone())
            .unwrap_or_default();
        self.passed(&deps)
    }

    fn check_event(&self, event: *mut c_void) -> Result<(), GpuStatus> {
        match self
            .events
            .borrow()
            .get((event as usize).wrapping_sub(0xe7e0_0001))
        {
            Some(_) => Ok(()),
            None => Err(INVALID_RESOURCE_HANDLE),
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
    fn rows_inside(
        regions: &[Region],
        start: usize,
        pitch: usize,
        width: usize,
        rows: usize,
    ) -> bool {
        (0..rows).all(|r| inside(regions, start + r * pitch, width))
    }

    /// What a GPU needs before running the kernel on `device`: the table inside that device's
    /// memory (unless it travels inside the argument) and every row of every (buffer, rect) it
    /// describes inside the registered buffers.
    fn kernel_memory_ok<const WORDS: usize>(&self, a: &KernelArgsOf<WORDS>, device: i32) -> bool {
        let len = a.table_bytes as usize;
        let table = if a.table == 0 {
            if len > 8 * WORDS {
                return false;
            }
            inline_bytes(a)
        } else {
            let on_device = self
                .device_allocations
                .borrow()
                .iter()
                .any(|al| al.device == device && al.holds(a.table as usize, len));
            if !on_device {
                return false;
            }
            // SAFETY: the table lies inside a live allocation (checked above).
            unsafe { std::slice::from_raw_parts(a.table as *const u8, len) }.to_vec()
        };
        let Some(rects) = decode(a, &table) else {
            return false;
        };
        rects.iter().all(|t| {
            let r = &t.rect;
            let rows = |base: u64, offset: u64, pitch: u64, regions: &[Region]| {
                Self::rows_inside(
                    regions,
                    (base + offset) as usize,
                    pitch as usize,
                    r.width as usize,
                    r.height as usize,
                )
            };
            rows(t.src_base, r.src_offset, r.src_pitch, &self.readable)
                && rows(t.dst_base, r.dst_offset, r.dst_pitch, &self.writable)
        })
    }

    /// A new allocation of `size` bytes in `list`; its address.
    fn allocate(list: &RefCell<Vec<Allocation>>, device: i32, size: usize) -> usize {
        let allocation = Allocation {
            device,
            size,
            words: vec![0u64; size.div_ceil(8).max(1)].into_boxed_slice(),
        };
        let base = allocation.base();
        list.borrow_mut().push(allocation);
        base
    }

    /// Frees the allocation at `pointer` in `list`.
    fn release(list: &RefCell<Vec<Allocation>>, pointer: *mut c_void) -> Result<(), GpuStatus> {
        let mut list = list.borrow_mut();
        let index = list
            .iter()
            .position(|a| a.base() == pointer as usize)
            .ok_or(GpuStatus::ERROR_INVALID_VALUE)?;
        list.swap_remove(index);
        Ok(())
    }
}

impl GpuRuntime for Recorder {
    fn api(&self) -> &'static Api {
        &HIP_API
    }

    fn device_count(&self) -> Result<i32, GpuStatus> {
        self.calls.borrow_mut().push(Call::DeviceCount);
        self.devices
    }

    fn current_device(&self) -> Result<i32, GpuStatus> {
        self.record(Call::GetDevice)?;
        Ok(*self.current.borrow())
    }

    fn set_device(&self, device: i32) -> Result<(), GpuStatus> {
        self.record(Call::SetDevice(device))?;
        match self.devices {
            Ok(count) if (0..count).contains(&device) => {
                *self.current.borrow_mut() = device;
                Ok(())
            }
            _ => Err(GpuStatus::ERROR_INVALID_DEVICE),
        }
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, GpuStatus> {
        self.record(Call::ExchangeCaptureMode(mode))?;
        Ok(self.capture_mode.replace(mode))
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool, GpuStatus> {
        self.record(Call::CanAccessPeer { device, peer })?;
        match self.devices {
            Ok(count) if (0..count).contains(&device) && (0..count).contains(&peer) => {
                Ok(device != peer && self.peer_access.get())
            }
            _ => Err(GpuStatus::ERROR_INVALID_DEVICE),
        }
    }

    fn stream_create(&self) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::StreamCreate { returned: 0 })?;
        let mut streams = self.streams.borrow_mut();
        streams.push(*self.current.borrow());
        let returned = created_handle(streams.len() - 1);
        if let Some(Call::StreamCreate { returned: r }) = self.calls.borrow_mut().last_mut() {
            *r = returned as usize;
        }
        Ok(returned)
    }

    unsafe fn stream_wait_event(
        &self,
        stream: *mut c_void,
        event: *mut c_void,
    ) -> Result<(), GpuStatus> {
        self.record(Call::StreamWaitEvent { stream, event })?;
        self.check_event(event)?;
        let record = self.event_records.borrow().get(&(event as usize)).cloned();
        let Some((recorded_on, deps)) = record else {
            return Ok(()); // never recorded: nothing to wait for
        };
        if self.stream_captures(recorded_on) {
            return Err(CAPTURE_ISOLATION);
        }
        self.stream_waits
            .borrow_mut()
            .entry(stream as usize)
            .or_default()
            .extend(deps);
        Ok(())
    }

    unsafe fn event_query(&self, event: *mut c_void) -> Result<bool, GpuStatus> {
        self.record(Call::EventQuery { event })?;
        self.check_event(event)?;
        self.event_outside_capture(event)?;
        Ok(self.event_passed(event))
    }

    unsafe fn stream_device(&self, stream: *mut c_void) -> Result<Option<i32>, GpuStatus> {
        if !self.has_stream_get_device {
            return Ok(None);
        }
        self.record(Call::StreamGetDevice(stream))?;
        Ok(Some(self.stream_device_of(stream)))
    }

    unsafe fn stream_is_capturing(&self, stream: *mut c_void) -> Result<bool, GpuStatus> {
        self.record(Call::IsCapturing(stream))?;
        Ok(self.stream_captures(stream as usize))
    }

    unsafe fn memcpy_2d_async(&self, a: Memcpy2dAsync) -> Result<(), GpuStatus> {
        let index = self.copies();
        self.calls.borrow_mut().push(Call::Memcpy2d(a));
        if let Some((_, status)) = self.fail_copy.filter(|&(n, _)| n == index) {
            return Err(status);
        }
        if a.kind != HIP_MEMCPY_DEFAULT && !(0..=3).contains(&a.kind) {
            return Err(INVALID_MEMCPY_DIRECTION);
        }
        // hipMemcpy2D: non-NULL pointers, width at most each pitch (hipErrorInvalidValue stands
        // in for every refused argument).
        if a.dst.is_null() || a.src.is_null() || a.width > a.dpitch || a.width > a.spitch {
            return Err(GpuStatus::ERROR_INVALID_VALUE);
        }
        if !Self::rows_inside(&self.readable, a.src as usize, a.spitch, a.width, a.height)
            || !Self::rows_inside(&self.writable, a.dst as usize, a.dpitch, a.width, a.height)
        {
            return Err(GpuStatus::ERROR_INVALID_VALUE);
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
        Ok(())
    }

    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> Result<(), GpuStatus> {
        self.calls.borrow_mut().push(Call::Synchronize(stream));
        if self.stream_captures(stream as usize) {
            self.invalidated.borrow_mut().push(stream as usize);
            return Err(GpuStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.capture_allows()?;
        if !self.passed(&self.dependencies_of(stream as usize)) {
            return Err(WOULD_HANG);
        }
        self.sync_status.result()
    }

    fn error_name(&self, status: GpuStatus) -> String {
        // What hipGetErrorName answers for these codes; anything else is "hipErrorUnknown".
        match status.0 {
            0 => "hipSuccess",
            1 => "hipErrorInvalidValue",
            2 => "hipErrorOutOfMemory",
            21 => "hipErrorInvalidMemcpyDirection",
            100 => "hipErrorNoDevice",
            101 => "hipErrorInvalidDevice",
            209 => "hipErrorNoBinaryForGpu",
            98 => "hipErrorInvalidDeviceFunction",
            400 => "hipErrorInvalidHandle",
            500 => "hipErrorNotFound",
            700 => "hipErrorIllegalAddress",
            600 => "hipErrorNotReady",
            900 => "hipErrorStreamCaptureUnsupported",
            905 => "hipErrorStreamCaptureIsolation",
            907 => "hipErrorCapturedEvent",
            77_777 => "the recorder's wait that would never end",
            _ => "hipErrorUnknown",
        }
        .into()
    }

    fn kernel_image(&self) -> KernelImage {
        TEST_IMAGE
    }

    fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }

    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::ModuleLoad { bytes: image.len() })?;
        let wide = std::ptr::eq(image.as_ptr(), TEST_WIDE_IMAGE.bytes.as_ptr());
        if let (true, Some(status)) = (wide, self.wide_load_status) {
            return Err(status);
        }
        let mut modules = self.modules.borrow_mut();
        modules.push(Module {
            device: *self.current.borrow(),
            live: true,
            wide,
        });
        Ok(module_handle(modules.len() - 1))
    }

    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::GetFunction { module })?;
        let modules = self.modules.borrow();
        let Some(n) = (0..modules.len()).find(|&n| module_handle(n) == module) else {
            return Err(INVALID_RESOURCE_HANDLE);
        };
        // clr: "Device mismatch from where this module is loaded" aborts the process.
        assert_eq!(
            modules[n].device,
            *self.current.borrow(),
            "hipModuleGetFunction on another device than the module's"
        );
        // hipErrorNotFound for any other name.
        let entry = if modules[n].wide {
            WIDE_KERNEL_NAME
        } else {
            c"mori_copy_kernel"
        };
        if name != entry {
            return Err(GpuStatus(500));
        }
        Ok(function_handle(n))
    }

    unsafe fn module_unload(&self, module: *mut c_void) -> Result<(), GpuStatus> {
        self.record(Call::ModuleUnload { module })?;
        let mut modules = self.modules.borrow_mut();
        match (0..modules.len()).find(|&n| module_handle(n) == module) {
            Some(n) if modules[n].live => {
                modules[n].live = false;
                Ok(())
            }
            _ => Err(INVALID_RESOURCE_HANDLE),
        }
    }

    fn malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::Malloc { size, returned: 0 })?;
        self.capture_allows()?;
        let returned = Self::allocate(&self.device_allocations, *self.current.borrow(), size);
        if let Some(Call::Malloc { returned: r, .. }) = self.calls.borrow_mut().last_mut() {
            *r = returned;
        }
        Ok(without_provenance_mut(returned))
    }

    unsafe fn free(&self, pointer: *mut c_void) -> Result<(), GpuStatus> {
        self.record(Call::Free { pointer })?;
        self.capture_allows()?;
        // clr's ihipFree waits for every stream of the device first.
        if !self.blocked.borrow().is_empty() {
            return Err(WOULD_HANG);
        }
        Self::release(&self.device_allocations, pointer)
    }

    fn host_malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::HostMalloc { size, returned: 0 })?;
        self.capture_allows()?;
        let returned = Self::allocate(&self.host_allocations, -1, size);
        if let Some(Call::HostMalloc { returned: r, .. }) = self.calls.borrow_mut().last_mut() {
            *r = returned;
        }
        Ok(without_provenance_mut(returned))
    }

    fn event_create(&self) -> Result<*mut c_void, GpuStatus> {
        self.record(Call::EventCreate { returned: 0 })?;
        let mut events = self.events.borrow_mut();
        events.push(*self.current.borrow());
        let returned = 0xe7e0_0000 + events.len();
        if let Some(Call::EventCreate { returned: r }) = self.calls.borrow_mut().last_mut() {
            *r = returned;
        }
        Ok(without_provenance_mut(returned))
    }

    unsafe fn event_record(
        &self,
        event: *mut c_void,
        stream: *mut c_void,
    ) -> Result<(), GpuStatus> {
        self.record(Call::EventRecord { event, stream })?;
        // An event records only on a stream of its own device; on a capturing stream the
        // record is captured before that check (hipEventRecord_common, STREAM_CAPTURE first).
        let captured = self.stream_captures(stream as usize);
        match self
            .events
            .borrow()
            .get((event as usize).wrapping_sub(0xe7e0_0001))
        {
            Some(&device) if captured || device == self.stream_device_of(stream) => {}
            _ => return Err(INVALID_RESOURCE_HANDLE),
        }
        // clr: the event remembers the stream of its last record (hip_event.cpp).
        let deps = self.dependencies_of(stream as usize);
        self.event_records
            .borrow_mut()
            .insert(event as usize, (stream as usize, deps));
        Ok(())
    }

    fn pointer_info(&self, pointer: *const c_void, device: i32) -> Result<PointerInfo, GpuStatus> {
        self.pointer_info_devices.borrow_mut().push(device);
        self.record(Call::PointerInfo { pointer })?;
        let at = pointer as usize;
        let device_memory = |device| PointerInfo {
            device,
            device_pointer: pointer.cast_mut(),
            host_pointer: std::ptr::null_mut(),
        };
        if let Some(a) = self
            .device_allocations
            .borrow()
            .iter()
            .find(|a| a.holds(at, 1))
        {
            return Ok(device_memory(a.device));
        }
        if self
            .host_allocations
            .borrow()
            .iter()
            .any(|a| a.holds(at, 1))
        {
            return Ok(PointerInfo {
                device: *self.current.borrow(),
                device_pointer: pointer.cast_mut(),
                host_pointer: pointer.cast_mut(),
            });
        }
        for &((base, len), alias) in &self.registered {
            if (base..base + len).contains(&at) {
                return Ok(PointerInfo {
                    device: *self.current.borrow(),
                    device_pointer: without_provenance_mut(alias + (at - base)),
                    host_pointer: pointer.cast_mut(),
                });
            }
        }
        if inside(&self.device_memory, at, 1) {
            return Ok(device_memory(self.stream_home.get()));
        }
        // Unknown to the runtime: pageable host memory.
        Err(GpuStatus::ERROR_INVALID_VALUE)
    }

    fn allocation_id(
        &self,
        pointer: *const c_void,
        _device: i32,
    ) -> Result<Option<u64>, GpuStatus> {
        self.allocation_id_asks
            .set(self.allocation_id_asks.get() + 1);
        let at = pointer as usize;
        if let Some(a) = self
            .device_allocations
            .borrow()
            .iter()
            .find(|a| a.holds(at, 1))
        {
            return Ok(Some(a.base() as u64));
        }
        // The caller's device memory: one id per region and generation.
        match (0..self.device_memory.len()).find(|&i| inside(&self.device_memory[i..=i], at, 1)) {
            Some(i) => Ok(Some((self.memory_generation.get() << 32) | (i as u64 + 1))),
            // clr answers hipErrorInvalidValue for memory without a memory object.
            None => Err(GpuStatus::ERROR_INVALID_VALUE),
        }
    }

    fn address_range(&self, pointer: *mut c_void) -> Result<(usize, usize), GpuStatus> {
        self.record(Call::AddressRange { pointer })?;
        self.device_allocations
            .borrow()
            .iter()
            .find(|a| a.holds(pointer as usize, 1))
            .map(|a| (a.base(), a.size))
            // hipErrorNotFound, as clr answers for an address it does not know.
            .ok_or(GpuStatus(500))
    }

    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        stream: *mut c_void,
    ) -> Result<(), GpuStatus> {
        self.record(Call::MemcpyHostToDevice {
            dst,
            src,
            size,
            stream,
        })?;
        let device = self.device_allocations.borrow();
        let host = self.host_allocations.borrow();
        // Only a pinned source is read by the copy engine in stream order; the engine stages
        // every upload there.
        if !device.iter().any(|a| a.holds(dst as usize, size))
            || !host.iter().any(|a| a.holds(src as usize, size))
        {
            return Err(GpuStatus::ERROR_INVALID_VALUE);
        }
        // SAFETY: both ranges lie inside live allocations (checked above), which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), dst.cast::<u8>(), size) };
        Ok(())
    }

    fn captures_kernel_launches(&self) -> bool {
        self.captures_launches
    }

    unsafe fn resident_blocks(&self, _function: *mut c_void) -> Option<u32> {
        self.resident
    }

    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> Result<(), GpuStatus> {
        self.record(Call::Launch(*launch))?;
        let device = self.launchable(launch, false)?;
        if !self.kernel_memory_ok(&launch.args, device) {
            return Err(ILLEGAL_ADDRESS);
        }
        let kernel = cpu_kernel().expect("kernel tests check for the CPU kernel first");
        let seed = self.calls.borrow().len() as u64;
        let (x, y) = launch.grid;
        // SAFETY: every address the kernel touches was checked above.
        unsafe { (kernel.launch)(x, y, 1, launch.block, 1, 1, &launch.args, seed) };
        Ok(())
    }

    fn inline_table_bytes(&self, _device: i32) -> usize {
        self.wide_room
    }

    fn wide_kernel_image(&self) -> Option<KernelImage> {
        (self.wide_room > INLINE_TABLE_BYTES).then_some(TEST_WIDE_IMAGE)
    }

    unsafe fn launch_kernel_wide(&self, launch: &WideKernelLaunch) -> Result<(), GpuStatus> {
        self.record(Call::LaunchWide {
            function: launch.function,
            grid: launch.grid,
            stream: launch.stream,
            table: launch.args.table,
            table_bytes: launch.args.table_bytes,
        })?;
        assert!(
            self.wide_room > INLINE_TABLE_BYTES,
            "a wide launch on a runtime without the wide entry"
        );
        let device = self.launchable(launch, true)?;
        if !self.kernel_memory_ok(&*launch.args, device) {
            return Err(ILLEGAL_ADDRESS);
        }
        let kernel = cpu_kernel().expect("kernel tests check for the CPU kernel first");
        let seed = self.calls.borrow().len() as u64;
        let (x, y) = launch.grid;
        // SAFETY: every address the kernel touches was checked above.
        unsafe { (kernel.launch_wide)(x, y, 1, launch.block, 1, 1, &*launch.args, seed) };
        Ok(())
    }
}

impl Recorder {
    /// What a launch of `launch.function` (the wide entry when `wide`) needs before it runs:
    /// the stream's device, or the status the runtime refuses it with.
    fn launchable<A>(&self, launch: &KernelLaunch<A>, wide: bool) -> Result<i32, GpuStatus> {
        let device = self.stream_device_of(launch.stream);
        let modules = self.modules.borrow();
        let Some(n) = (0..modules.len()).find(|&n| function_handle(n) == launch.function) else {
            return Err(INVALID_RESOURCE_HANDLE);
        };
        if !modules[n].live {
            return Err(INVALID_RESOURCE_HANDLE);
        }
        // The argument must be the entry's: the wide one's 32 KiB to the wide function only.
        if modules[n].wide != wide {
            return Err(GpuStatus::ERROR_INVALID_VALUE);
        }
        // clr: the function has no kernel for the stream's device.
        if modules[n].device != device {
            return Err(GpuStatus::ERROR_INVALID_DEVICE);
        }
        if self.stream_captures(launch.stream as usize) {
            assert!(
                self.captures_launches,
                "a kernel launch on a capturing stream of a runtime that runs it at once and \
                 leaves it out of the graph (HIP 5.2)"
            );
            // ihipGraphAddKernelNode checks a captured launch's function against the current
            // device: hipErrorInvalidDeviceFunction.
            if modules[n].device != *self.current.borrow() {
                return Err(INVALID_DEVICE_FUNCTION);
            }
        }
        // hipErrorInvalidConfiguration.
        if launch.grid.0 == 0 || launch.grid.1 == 0 || launch.block > BLOCK_THREADS {
            return Err(GpuStatus(9));
        }
        Ok(device)
    }
}
