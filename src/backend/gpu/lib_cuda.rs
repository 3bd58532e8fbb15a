//! The CUDA runtime of the GPU engine: the CUDA driver API (`libcuda.so.1`), loaded when first
//! used, so that building needs no CUDA toolkit and a machine without an NVIDIA driver runs
//! everything else.
//!
//! The library is opened with `dlopen`, `libcuda.so.1` first (the name the driver installs;
//! `libcuda.so` is the development link, often a toolkit's stub that fails every call), then
//! `libcuda.so`. cudarc gives the layout of `CUDA_MEMCPY2D` and the values of the constants. Its function wrappers are not used: they
//! return `CUresult` as a Rust enum, and a driver newer than the bindings may return a code the
//! enum lacks, which would be undefined behaviour (the HIP runtime's functions are declared with
//! integer statuses for the same reason, REFERENCE.md section 10). Every function is looked up
//! once, up front, with an integer return type: a driver that lacks one is refused with
//! [`Error::BackendUnavailable`] naming it, instead of cudarc's panic on first use.
//!
//! The engine speaks HIP's terms; this runtime maps them to the driver's:
//! - the current device is the device of the calling thread's current context; a thread with
//!   no current context is on device 0, as the CUDA runtime's threads are until they choose one;
//! - what the engine makes "on the current device" (the copy kernel's module, table buffers,
//!   relay streams, events, a pool's memory) is made in that device's primary context, the one
//!   the CUDA runtime, PyTorch and CuPy use (`cuDevicePrimaryCtxRetain`, retained once per device
//!   for the life of the process), pushed for the call and popped after it;
//! - every call on a stream runs with the stream's context current (`cuStreamGetCtx`; for the
//!   NULL stream, the current context, else device 0's primary context), since a kernel launch
//!   fails on a stream of another context (CUDA C++ Programming Guide, "Stream and Event
//!   Behavior") and the driver needs a current context for the others;
//! - a stream's device is its context's, and a stream of a context other than its device's
//!   primary one is refused for the copy kernel (whose module lives in the primary context) with
//!   `CUDA_ERROR_INVALID_CONTEXT`: such streams take the per-rect copies (`MORI_SEND_MEMCPY2D`);
//! - `hipSetDevice` is `cuCtxSetCurrent` of the device's primary context, except that switching
//!   back gives the thread exactly the context it had before the engine switched away (which may
//!   be none, or a context of the caller's own);
//! - `hipMemcpyDefault` is `CU_MEMORYTYPE_UNIFIED` on both sides, which takes device, peer and
//!   host memory (pageable host memory makes the copy synchronous);
//! - the kernel's argument goes through `cuLaunchKernel`'s `extra` with the driver's markers
//!   (`CU_LAUNCH_PARAM_END` is 0, where HIP's is 3);
//! - on a CUDA 12.1+ driver (`cuDriverGetVersion`, asked once) and a GPU of compute capability
//!   7.0+, a table of up to 32,696 bytes travels inside the argument of the wide entry
//!   (`mori_copy_kernel_wide`, a PTX module of ISA 8.1 of its own, loaded when the first such
//!   table comes), so it is not uploaded; an older driver keeps the 4 KiB argument and uploads
//!   bigger tables.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys as cu;

use super::super::copy_kernel::{
    BLOCK_THREADS, COPY_KERNEL_CUBINS, COPY_KERNEL_PTX, COPY_KERNEL_WIDE_CUBINS,
    COPY_KERNEL_WIDE_PTX, INLINE_TABLE_BYTES, KernelArgs, PTX_ARCH, WIDE_INLINE_TABLE_BYTES,
    WIDE_PTX_ARCH, WideKernelArgs, pick_cubin,
};
use super::call::lock;
use super::device::KernelCache;
use super::runtime::{
    Api, CUDA_API, CaptureMode, GpuRuntime, GpuStatus, KernelImage, KernelLaunch, Memcpy2dAsync,
    PointerInfo, WideKernelLaunch,
};
use crate::error::{Error, Result};

type Ctx = *mut c_void;
type Stream = *mut c_void;
type DevicePtr = u64;

/// `CUDA_ERROR_INVALID_CONTEXT`: no context is current, or a handle belongs to another context.
const INVALID_CONTEXT: GpuStatus = GpuStatus(cu::cudaError_enum::CUDA_ERROR_INVALID_CONTEXT as i32);
/// `CUDA_ERROR_INVALID_DEVICE`.
const INVALID_DEVICE: GpuStatus = GpuStatus(cu::cudaError_enum::CUDA_ERROR_INVALID_DEVICE as i32);
/// `CUDA_ERROR_INVALID_VALUE`: what `cuGetErrorName` returns for a code it does not know.
const INVALID_VALUE: GpuStatus = GpuStatus(cu::cudaError_enum::CUDA_ERROR_INVALID_VALUE as i32);

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: handles of the current context's default
/// streams, which the engine treats as the NULL stream is treated for the context.
const STREAM_LEGACY: usize = 0x1;
const STREAM_PER_THREAD: usize = 0x2;

// CU_LAUNCH_PARAM_* (cuda.h): the markers of cuLaunchKernel's `extra`. END is 0 (HIP's is 3).
const LAUNCH_PARAM_BUFFER_POINTER: usize = 0x01;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 0x02;
const LAUNCH_PARAM_END: usize = 0x00;

/// `CU_STREAM_NON_BLOCKING`: the relay streams do not synchronize with the NULL stream.
const STREAM_NON_BLOCKING: c_uint = cu::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as c_uint;
/// `CU_EVENT_DISABLE_TIMING`: the events only order.
const EVENT_DISABLE_TIMING: c_uint = cu::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as c_uint;
/// `CU_MEMHOSTALLOC_PORTABLE`: the table buffers are pinned for every context.
const MEMHOSTALLOC_PORTABLE: c_uint = cu::CU_MEMHOSTALLOC_PORTABLE;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_STATUS_NONE: c_int =
    cu::CUstreamCaptureStatus_enum::CU_STREAM_CAPTURE_STATUS_NONE as c_int;
/// The `CUpointer_attribute`s [`LibCuda::pointer_info`] asks for, in order.
const POINTER_ATTRIBUTES: [c_int; 4] = [
    cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_MEMORY_TYPE as c_int,
    cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as c_int,
    cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_POINTER as c_int,
    cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_HOST_POINTER as c_int,
];

/// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: a process-unique identity of an allocation.
const POINTER_BUFFER_ID: c_int =
    cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_BUFFER_ID as c_int;
/// `CU_DEVICE_ATTRIBUTE_MAX_PITCH`: the largest pitch of a 2D copy.
const DEVICE_MAX_PITCH: c_int = cu::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_PITCH as c_int;
// CUjit_option (cuda.h): the logs of cuModuleLoadDataEx.
const JIT_INFO_LOG_BUFFER: c_int = 3;
const JIT_INFO_LOG_BUFFER_SIZE_BYTES: c_int = 4;
const JIT_ERROR_LOG_BUFFER: c_int = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;
/// Bytes of each JIT log kept.
const JIT_LOG_BYTES: usize = 4096;

/// Declares the driver functions the runtime uses, with integer statuses and opaque handles
/// (signatures from cuda.h, as cudarc's bindings give them), and [`Driver::load`], which looks
/// each up under its exported symbol (the `_v2` one where cuda.h maps the name to it).
macro_rules! driver {
    ($($field:ident = $symbol:literal: fn($($arg:ty),*);)*) => {
        /// The driver's functions, looked up once.
        struct Driver {
            $($field: unsafe extern "C" fn($($arg),*) -> GpuStatus,)*
        }

        impl Driver {
            /// Every function, found by `symbol` (an address, from a NUL-terminated name), or the
            /// names of those it lacks.
            ///
            /// # Safety
            /// `symbol` must find the CUDA driver's functions, whose signatures are those above.
            unsafe fn load(
                symbol: impl Fn(&[u8]) -> Option<*mut c_void>,
            ) -> std::result::Result<Driver, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    let $field = symbol(concat!($symbol, "\0").as_bytes())
                        .filter(|address| !address.is_null());
                    if $field.is_none() {
                        missing.push($symbol);
                    }
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok(Driver {
                    $(
                        // SAFETY: the driver's function of that name, whose C signature this is.
                        $field: unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> GpuStatus>(
                                $field.expect("checked above"),
                            )
                        },
                    )*
                })
            }
        }
    };
}

driver! {
    init = "cuInit": fn(c_uint);
    device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut c_int, c_int);
    device_can_access_peer = "cuDeviceCanAccessPeer": fn(*mut c_int, c_int, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut Ctx, c_int);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut Ctx);
    ctx_set_current = "cuCtxSetCurrent": fn(Ctx);
    ctx_push_current = "cuCtxPushCurrent_v2": fn(Ctx);
    ctx_pop_current = "cuCtxPopCurrent_v2": fn(*mut Ctx);
    ctx_get_device = "cuCtxGetDevice": fn(*mut c_int);
    exchange_capture_mode = "cuThreadExchangeStreamCaptureMode": fn(*mut c_int);
    stream_get_ctx = "cuStreamGetCtx": fn(Stream, *mut Ctx);
    stream_is_capturing = "cuStreamIsCapturing": fn(Stream, *mut c_int);
    stream_create = "cuStreamCreate": fn(*mut Stream, c_uint);
    stream_wait_event = "cuStreamWaitEvent": fn(Stream, *mut c_void, c_uint);
    stream_synchronize = "cuStreamSynchronize": fn(Stream);
    memcpy_2d_async = "cuMemcpy2DAsync_v2": fn(*const cu::CUDA_MEMCPY2D, Stream);
    memcpy_htod_async = "cuMemcpyHtoDAsync_v2": fn(DevicePtr, *const c_void, usize, Stream);
    get_error_name = "cuGetErrorName": fn(c_int, *mut *const c_char);
    module_load_data_ex = "cuModuleLoadDataEx": fn(
        *mut *mut c_void, *const c_void, c_uint, *mut c_int, *mut *mut c_void
    );
    device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, c_int);
    module_get_function = "cuModuleGetFunction": fn(*mut *mut c_void, *mut c_void, *const c_char);
    module_unload = "cuModuleUnload": fn(*mut c_void);
    mem_alloc = "cuMemAlloc_v2": fn(*mut DevicePtr, usize);
    mem_free = "cuMemFree_v2": fn(DevicePtr);
    mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    event_create = "cuEventCreate": fn(*mut *mut c_void, c_uint);
    event_record = "cuEventRecord": fn(*mut c_void, Stream);
    event_query = "cuEventQuery": fn(*mut c_void);
    pointer_get_attributes = "cuPointerGetAttributes": fn(c_uint, *mut c_int, *mut *mut c_void, DevicePtr);
    mem_get_address_range = "cuMemGetAddressRange_v2": fn(*mut DevicePtr, *mut usize, DevicePtr);
    launch_kernel = "cuLaunchKernel": fn(
        *mut c_void, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream,
        *mut *mut c_void, *mut *mut c_void
    );
}

/// `cuDeviceGetAttribute(&value, attribute, device)`.
type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> GpuStatus;
/// `cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function, block, dynamic_shared)`.
type Occupancy = unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, usize) -> GpuStatus;
/// `cuDriverGetVersion(&version)` (cudarc's `cuDriverGetVersion`, looked up as the others are).
type DriverGetVersion = unsafe extern "C" fn(*mut c_int) -> GpuStatus;

/// The first driver version (1000 * major + 10 * minor, as `cuDriverGetVersion` says it) that
/// takes kernel parameters beyond 4 KiB: CUDA 12.1 (PTX ISA 8.1; on sm_70 and newer).
const LARGE_PARAMS_DRIVER: i32 = 12010;

/// Driver functions the engine uses when present (for the persistent grid and the choice of a
/// cubin; without them the grid is the table's and the image the PTX).
struct Optional {
    device_get_attribute: Option<DeviceGetAttribute>,
    occupancy: Option<Occupancy>,
    driver_get_version: Option<DriverGetVersion>,
}

impl Optional {
    /// # Safety
    /// `symbol` must find the CUDA driver's functions.
    unsafe fn load(symbol: impl Fn(&[u8]) -> Option<*mut c_void>) -> Optional {
        let find = |name: &[u8]| symbol(name).filter(|a| !a.is_null());
        Optional {
            // SAFETY: the driver's functions of these names, whose C signatures these are.
            device_get_attribute: find(b"cuDeviceGetAttribute\0")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, DeviceGetAttribute>(a) }),
            // SAFETY: as above.
            occupancy: find(b"cuOccupancyMaxActiveBlocksPerMultiprocessor\0")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, Occupancy>(a) }),
            // SAFETY: as above.
            driver_get_version: find(b"cuDriverGetVersion\0")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, DriverGetVersion>(a) }),
        }
    }
}

/// The loaded driver, what `cuInit(0)` returned, and the driver's version (None where it
/// cannot say).
struct Loaded {
    driver: Driver,
    optional: Optional,
    init: std::result::Result<(), GpuStatus>,
    version: Option<i32>,
}

/// The driver, loaded and initialized once per process, or why it cannot be.
fn loaded() -> std::result::Result<&'static Loaded, String> {
    static LOADED: OnceLock<std::result::Result<Loaded, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let Some(library) = open_driver() else {
                return Err(format!(
                    "the CUDA driver library was not found (tried {}): no NVIDIA driver is \
                     installed, or its libcuda.so.1 is not on the loader's path",
                    DRIVER_NAMES.join(", ")
                ));
            };
            let symbol = |name: &[u8]| {
                // SAFETY: a handle dlopen returned, never closed; `name` is NUL-terminated.
                let address = unsafe { libc::dlsym(library, name.as_ptr().cast()) };
                (!address.is_null()).then_some(address)
            };
            // SAFETY: the driver's symbols, whose signatures `driver!` declares.
            let driver = unsafe { Driver::load(symbol) }.map_err(|missing| {
                format!(
                    "the CUDA driver lacks {} (mori-tp needs a driver of CUDA 11.4 or later)",
                    missing.join(", ")
                )
            })?;
            // SAFETY: cuInit takes flags 0.
            let init = unsafe { (driver.init)(0) }.result();
            // SAFETY: as above.
            let optional = unsafe { Optional::load(symbol) };
            // Asked once: the driver's version does not change while the process runs.
            let version = optional.driver_get_version.and_then(|get| {
                let mut version: c_int = 0;
                // SAFETY: a valid out-pointer.
                out(unsafe { get(&mut version) }, version).ok()
            });
            Ok(Loaded {
                driver,
                optional,
                init,
                version,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The names the driver is opened under, in order.
const DRIVER_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The first of [`DRIVER_NAMES`] that `dlopen` opens (kept open for the process), if any.
fn open_driver() -> Option<*mut c_void> {
    DRIVER_NAMES.iter().find_map(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL inside");
        // SAFETY: a NUL-terminated name; the handle is never closed.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        (!handle.is_null()).then_some(handle)
    })
}

/// An out-pointer call's result: the value on success, else the status.
fn out<T>(status: GpuStatus, value: T) -> std::result::Result<T, GpuStatus> {
    status.result().map(|()| value)
}

/// The copy kernel's state per device, for the whole process.
static KERNELS: KernelCache = KernelCache::new();

/// The counters of this runtime's engines.
pub(super) fn counters() -> super::GpuCounters {
    KERNELS.counters()
}

/// Each device's primary context, retained once for the life of the process (address as an
/// integer, so that the list is `Send`).
static PRIMARY: Mutex<Vec<(i32, usize)>> = Mutex::new(Vec::new());

thread_local! {
    /// The JIT's logs of this thread's last failed `cuModuleLoadDataEx`.
    static LOAD_LOG: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    /// The context a thread had when [`LibCuda::set_device`] switched it away to another
    /// device's primary context, and that context's device: switching back to that device
    /// restores exactly it.
    static SWITCHED_FROM: Cell<Option<(usize, i32)>> = const { Cell::new(None) };
}

/// The CUDA driver (`libcuda.so.1`). Made by [`LibCuda::load`], which refuses when the library or
/// one of its functions is missing.
#[derive(Clone, Copy)]
pub struct LibCuda {
    loaded: &'static Loaded,
}

impl std::fmt::Debug for LibCuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LibCuda")
    }
}

impl LibCuda {
    /// The driver, loaded (once per process) from the first of `libcuda.so.1` and `libcuda.so`
    /// that loads, with every function the engine uses; else
    /// [`Error::BackendUnavailable`] saying what is missing. A driver that loaded but failed
    /// `cuInit` (no device, or a driver too old for the GPU) loads: its device count says why.
    pub fn load() -> Result<LibCuda> {
        loaded()
            .map(|loaded| LibCuda { loaded })
            .map_err(|reason| Error::BackendUnavailable {
                reason: format!("the CUDA backend needs the CUDA driver: {reason}"),
            })
    }

    fn driver(&self) -> &'static Driver {
        &self.loaded.driver
    }

    /// `cuDeviceGetAttribute(attribute)` of the current device; None where the driver lacks it
    /// or fails.
    fn attribute_here(&self, attribute: cu::CUdevice_attribute_enum) -> Option<i32> {
        let get = self.loaded.optional.device_get_attribute?;
        let (mut handle, mut value): (c_int, c_int) = (0, 0);
        // SAFETY: valid out-pointers; a bad ordinal or attribute is refused with a status.
        unsafe {
            (self.driver().device_get)(&mut handle, self.current_device().ok()?)
                .result()
                .ok()?;
            get(&mut value, attribute as c_int, handle).result().ok()?;
        }
        Some(value)
    }

    /// The embedded cubin (SASS) for the current device's compute capability: the one of the
    /// same major version and the highest minor version not above the device's (SASS runs on
    /// GPUs of its major version and a minor version at least its own); None without one.
    fn cubin_here(&self) -> Option<(&'static str, &'static [u8])> {
        use cu::CUdevice_attribute_enum as A;
        let major = self.attribute_here(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute_here(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        pick_cubin(u32::try_from(major * 10 + minor).ok()?, &COPY_KERNEL_CUBINS)
    }

    /// `device`'s compute capability * 10 (e.g. 90), asked once per device; None where the
    /// driver cannot say.
    fn compute_capability(&self, device: i32) -> Option<u32> {
        use cu::CUdevice_attribute_enum as A;
        static CAPABILITIES: Mutex<Vec<(i32, Option<u32>)>> = Mutex::new(Vec::new());
        if let Some(&(_, cc)) = lock(&CAPABILITIES).iter().find(|(d, _)| *d == device) {
            return cc;
        }
        let get = self.loaded.optional.device_get_attribute?;
        let mut handle: c_int = 0;
        // SAFETY: a valid out-pointer; a bad ordinal is refused with a status.
        let found = out(
            unsafe { (self.driver().device_get)(&mut handle, device) },
            (),
        );
        let attribute = |attribute: A| {
            let mut value: c_int = 0;
            // SAFETY: a valid out-pointer; a bad attribute is refused with a status.
            out(
                unsafe { get(&mut value, attribute as c_int, handle) },
                value,
            )
            .ok()
        };
        let cc = found.ok().and_then(|()| {
            let major = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            u32::try_from(major * 10 + minor).ok()
        });
        lock(&CAPABILITIES).push((device, cc));
        cc
    }

    /// The embedded cubin of the wide entry for the current device, as [`LibCuda::cubin_here`].
    fn wide_cubin_here(&self) -> Option<(&'static str, &'static [u8])> {
        use cu::CUdevice_attribute_enum as A;
        let major = self.attribute_here(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute_here(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        pick_cubin(
            u32::try_from(major * 10 + minor).ok()?,
            &COPY_KERNEL_WIDE_CUBINS,
        )
    }

    /// The kernel-argument buffer `args` (`size` bytes) launched as `launch` says, through
    /// `extra` with the driver's markers; the driver copies it during the call.
    ///
    /// # Safety
    /// As for [`GpuRuntime::launch_kernel`]; `args` is the whole argument of `launch.function`.
    unsafe fn launch_buffer<A>(
        &self,
        launch: &KernelLaunch<A>,
        args: *mut c_void,
        mut size: usize,
    ) -> std::result::Result<(), GpuStatus> {
        let mut extra = [
            std::ptr::without_provenance_mut(LAUNCH_PARAM_BUFFER_POINTER),
            args,
            std::ptr::without_provenance_mut(LAUNCH_PARAM_BUFFER_SIZE),
            (&raw mut size).cast(),
            std::ptr::without_provenance_mut(LAUNCH_PARAM_END),
        ];
        // A launch runs on the stream's context, which must be current, and the function must
        // be of that context's module (the engine loads it in the stream's device's primary
        // context, and refuses streams of other contexts).
        self.on_stream(launch.stream, || {
            // SAFETY: forwarded from the caller; `extra` and what it points to outlive the call.
            unsafe {
                (self.driver().launch_kernel)(
                    launch.function,
                    launch.grid.0,
                    launch.grid.1,
                    1,
                    launch.block,
                    1,
                    1,
                    0,
                    launch.stream,
                    null_mut(),
                    extra.as_mut_ptr(),
                )
            }
            .result()
        })
    }

    /// The calling thread's current context (NULL: none).
    fn current_context(&self) -> std::result::Result<Ctx, GpuStatus> {
        let mut ctx = null_mut();
        // SAFETY: a valid out-pointer.
        out(unsafe { (self.driver().ctx_get_current)(&mut ctx) }, ctx)
    }

    /// `device`'s primary context, retained on first use and kept for the process.
    fn primary(&self, device: i32) -> std::result::Result<Ctx, GpuStatus> {
        let mut primary = lock(&PRIMARY);
        if let Some(&(_, ctx)) = primary.iter().find(|(d, _)| *d == device) {
            return Ok(ctx as Ctx);
        }
        let mut handle: c_int = 0;
        // SAFETY: valid out-pointers; a bad ordinal is refused with a status.
        out(
            unsafe { (self.driver().device_get)(&mut handle, device) },
            (),
        )?;
        let mut ctx = null_mut();
        // SAFETY: as above, for the device handle just returned.
        out(
            unsafe { (self.driver().primary_ctx_retain)(&mut ctx, handle) },
            (),
        )?;
        primary.push((device, ctx as usize));
        Ok(ctx)
    }

    /// `f` with `ctx` current: directly when it is, else pushed for `f` and popped after.
    fn in_context<T>(
        &self,
        ctx: Ctx,
        f: impl FnOnce() -> std::result::Result<T, GpuStatus>,
    ) -> std::result::Result<T, GpuStatus> {
        if self.current_context()? == ctx {
            return f();
        }
        // SAFETY: a context of this process (a primary context, or a stream's).
        out(unsafe { (self.driver().ctx_push_current)(ctx) }, ())?;
        let done = f();
        let mut popped = null_mut();
        // SAFETY: pops what was pushed above.
        let restored = out(unsafe { (self.driver().ctx_pop_current)(&mut popped) }, ());
        restored.and(done)
    }

    /// The device of `ctx`.
    fn context_device(&self, ctx: Ctx) -> std::result::Result<i32, GpuStatus> {
        self.in_context(ctx, || {
            let mut device: c_int = 0;
            // SAFETY: a valid out-pointer.
            out(
                unsafe { (self.driver().ctx_get_device)(&mut device) },
                device,
            )
        })
    }

    /// The primary context of the current device: where what the engine makes lives.
    fn here(&self) -> std::result::Result<Ctx, GpuStatus> {
        self.primary(self.current_device()?)
    }

    /// The context that owns the allocation holding `pointer` (`CU_POINTER_ATTRIBUTE_CONTEXT`),
    /// else the primary context of the current device: where a call about that allocation runs.
    fn owner_context(&self, pointer: *const c_void) -> std::result::Result<Ctx, GpuStatus> {
        let mut attribute = cu::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_CONTEXT as c_int;
        let mut owner: Ctx = null_mut();
        let mut data: *mut c_void = (&raw mut owner).cast();
        // SAFETY: one attribute with an out-pointer of its type; the driver only looks the
        // address up (and leaves NULL for memory it does not know).
        let status = unsafe {
            (self.driver().pointer_get_attributes)(
                1,
                &mut attribute,
                &mut data,
                pointer as DevicePtr,
            )
        };
        match status.result() {
            Ok(()) if !owner.is_null() => Ok(owner),
            _ => self.here(),
        }
    }

    /// True for the NULL stream and the handles of the current context's default streams.
    fn default_stream(stream: Stream) -> bool {
        matches!(stream as usize, 0 | STREAM_LEGACY | STREAM_PER_THREAD)
    }

    /// The context a call on `stream` runs in: the stream's, or for a default stream the
    /// current context (device 0's primary context when the thread has none).
    fn stream_context(&self, stream: Stream) -> std::result::Result<Ctx, GpuStatus> {
        if Self::default_stream(stream) {
            let ctx = self.current_context()?;
            return if ctx.is_null() {
                self.primary(0)
            } else {
                Ok(ctx)
            };
        }
        let mut ctx = null_mut();
        // SAFETY: a valid out-pointer; the caller's live stream.
        out(
            unsafe { (self.driver().stream_get_ctx)(stream, &mut ctx) },
            ctx,
        )
    }

    /// `f` in `stream`'s context.
    fn on_stream<T>(
        &self,
        stream: Stream,
        f: impl FnOnce() -> std::result::Result<T, GpuStatus>,
    ) -> std::result::Result<T, GpuStatus> {
        let ctx = self.stream_context(stream)?;
        self.in_context(ctx, f)
    }
}

impl GpuRuntime for LibCuda {
    fn api(&self) -> &'static Api {
        &CUDA_API
    }

    fn device_count(&self) -> std::result::Result<i32, GpuStatus> {
        self.loaded.init?;
        static COUNT: OnceLock<std::result::Result<i32, GpuStatus>> = OnceLock::new();
        *COUNT.get_or_init(|| {
            let mut count: c_int = 0;
            // SAFETY: a valid out-pointer.
            out(
                unsafe { (self.driver().device_get_count)(&mut count) },
                count,
            )
        })
    }

    fn current_device(&self) -> std::result::Result<i32, GpuStatus> {
        let ctx = self.current_context()?;
        if ctx.is_null() {
            return Ok(0);
        }
        let mut device: c_int = 0;
        // SAFETY: a valid out-pointer; a context is current.
        out(
            unsafe { (self.driver().ctx_get_device)(&mut device) },
            device,
        )
    }

    fn set_device(&self, device: i32) -> std::result::Result<(), GpuStatus> {
        if device < 0 || device >= self.device_count()? {
            return Err(INVALID_DEVICE);
        }
        if let Some((ctx, from)) = SWITCHED_FROM.get()
            && from == device
        {
            // SAFETY: the context this thread had before the switch (NULL: none).
            out(unsafe { (self.driver().ctx_set_current)(ctx as Ctx) }, ())?;
            SWITCHED_FROM.set(None);
            return Ok(());
        }
        let current = self.current_device()?;
        if current == device {
            return Ok(());
        }
        let ctx = self.current_context()?;
        let primary = self.primary(device)?;
        // SAFETY: the device's primary context, retained.
        out(unsafe { (self.driver().ctx_set_current)(primary) }, ())?;
        if SWITCHED_FROM.get().is_none() {
            SWITCHED_FROM.set(Some((ctx as usize, current)));
        }
        Ok(())
    }

    fn exchange_capture_mode(
        &self,
        mode: CaptureMode,
    ) -> std::result::Result<CaptureMode, GpuStatus> {
        let mut mode: c_int = mode.0;
        // SAFETY: a valid in/out pointer (any value is checked by the driver).
        out(
            unsafe { (self.driver().exchange_capture_mode)(&mut mode) },
            mode,
        )
        .map(CaptureMode)
    }

    unsafe fn stream_device(&self, stream: Stream) -> std::result::Result<Option<i32>, GpuStatus> {
        let ctx = self.stream_context(stream)?;
        let device = self.context_device(ctx)?;
        if ctx != self.primary(device)? {
            // Another context of the device: the copy kernel's module lives in the primary one.
            return Err(INVALID_CONTEXT);
        }
        Ok(Some(device))
    }

    unsafe fn stream_is_capturing(&self, stream: Stream) -> std::result::Result<bool, GpuStatus> {
        let mut status: c_int = CAPTURE_STATUS_NONE;
        self.on_stream(stream, || {
            // SAFETY: a valid out-pointer; the stream as the caller guarantees.
            out(
                unsafe { (self.driver().stream_is_capturing)(stream, &mut status) },
                (),
            )
        })?;
        Ok(status != CAPTURE_STATUS_NONE)
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> std::result::Result<bool, GpuStatus> {
        let (mut handle, mut peer_handle, mut can): (c_int, c_int, c_int) = (0, 0, 0);
        // SAFETY: valid out-pointers; bad ordinals are refused with a status.
        unsafe {
            out((self.driver().device_get)(&mut handle, device), ())?;
            out((self.driver().device_get)(&mut peer_handle, peer), ())?;
            out(
                (self.driver().device_can_access_peer)(&mut can, handle, peer_handle),
                can != 0,
            )
        }
    }

    unsafe fn memcpy_2d_async(&self, a: Memcpy2dAsync) -> std::result::Result<(), GpuStatus> {
        // hipMemcpyDefault: both sides unified addresses (device, peer or host memory).
        let copy = cu::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: a.src as DevicePtr,
            srcArray: null_mut(),
            srcPitch: a.spitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: null_mut(),
            dstDevice: a.dst as DevicePtr,
            dstArray: null_mut(),
            dstPitch: a.dpitch,
            WidthInBytes: a.width,
            Height: a.height,
        };
        self.on_stream(a.stream, || {
            // SAFETY: forwarded from the caller, as the trait documents; `copy` outlives the call.
            unsafe { (self.driver().memcpy_2d_async)(&copy, a.stream) }.result()
        })
    }

    unsafe fn stream_synchronize(&self, stream: Stream) -> std::result::Result<(), GpuStatus> {
        self.on_stream(stream, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().stream_synchronize)(stream) }.result()
        })
    }

    fn stream_create(&self) -> std::result::Result<*mut c_void, GpuStatus> {
        self.in_context(self.here()?, || {
            let mut stream = null_mut();
            // SAFETY: a valid out-pointer.
            out(
                unsafe { (self.driver().stream_create)(&mut stream, STREAM_NON_BLOCKING) },
                stream,
            )
        })
    }

    unsafe fn stream_wait_event(
        &self,
        stream: Stream,
        event: *mut c_void,
    ) -> std::result::Result<(), GpuStatus> {
        self.on_stream(stream, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().stream_wait_event)(stream, event, 0) }.result()
        })
    }

    fn error_name(&self, status: GpuStatus) -> String {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: any value is legal (an unknown one is refused with CUDA_ERROR_INVALID_VALUE);
        // on success the driver points `name` at a static NUL-terminated string.
        let known = unsafe { (self.driver().get_error_name)(status.0, &mut name) };
        if known == INVALID_VALUE || known.result().is_err() || name.is_null() {
            return "an unnamed CUDA error".into();
        }
        // SAFETY: non-NULL, static and NUL-terminated, as above.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    fn kernel_image(&self) -> KernelImage {
        // SASS for this GPU when the build embedded one (no JIT at first use), else the PTX.
        if let Some((targets, bytes)) = self.cubin_here() {
            return KernelImage { bytes, targets };
        }
        KernelImage {
            bytes: COPY_KERNEL_PTX,
            targets: PTX_ARCH,
        }
    }

    unsafe fn resident_blocks(&self, function: *mut c_void) -> Option<u32> {
        let occupancy = self.loaded.optional.occupancy?;
        let units = self.attribute_here(
            cu::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let mut blocks: c_int = 0;
        self.in_context(self.here().ok()?, || {
            // SAFETY: a valid out-pointer; the function as the caller guarantees.
            out(
                unsafe { occupancy(&mut blocks, function, BLOCK_THREADS as c_int, 0) },
                (),
            )
        })
        .ok()?;
        let resident = u32::try_from(units)
            .ok()?
            .checked_mul(u32::try_from(blocks).ok()?)?;
        (resident > 0).then_some(resident)
    }

    fn kernel_cache(&self) -> &KernelCache {
        &KERNELS
    }

    unsafe fn module_load_data(&self, image: &[u8]) -> std::result::Result<*mut c_void, GpuStatus> {
        // PTX is NUL-terminated text: a copy ends with one when the image does not.
        let terminated;
        let image = if image.last() == Some(&0) {
            image
        } else {
            terminated = [image, &[0]].concat();
            &terminated
        };
        let loaded = self.in_context(self.here()?, || {
            let mut module = null_mut();
            let mut info = vec![0u8; JIT_LOG_BYTES];
            let mut error = vec![0u8; JIT_LOG_BYTES];
            let mut options = [
                JIT_INFO_LOG_BUFFER,
                JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                JIT_ERROR_LOG_BUFFER,
                JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            ];
            // Buffers by pointer, sizes by value in the pointer's place (cuda.h's convention).
            let mut values: [*mut c_void; 4] = [
                info.as_mut_ptr().cast(),
                std::ptr::without_provenance_mut(JIT_LOG_BYTES),
                error.as_mut_ptr().cast(),
                std::ptr::without_provenance_mut(JIT_LOG_BYTES),
            ];
            // SAFETY: a valid out-pointer; NUL-terminated PTX, or a cubin; four options with their values,
            // the buffers JIT_LOG_BYTES long and alive for the call.
            let status = unsafe {
                (self.driver().module_load_data_ex)(
                    &mut module,
                    image.as_ptr().cast(),
                    options.len() as c_uint,
                    options.as_mut_ptr(),
                    values.as_mut_ptr(),
                )
            };
            if status.result().is_err() {
                let text = |log: &[u8]| {
                    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                    String::from_utf8_lossy(&log[..end]).trim().to_string()
                };
                let (error, info) = (text(&error), text(&info));
                let log = match (error.is_empty(), info.is_empty()) {
                    (true, true) => String::new(),
                    (false, true) => error,
                    (true, false) => info,
                    (false, false) => format!("{error}; {info}"),
                };
                LOAD_LOG.with(|l| *l.borrow_mut() = log);
            }
            out(status, module)
        });
        match loaded {
            // A cubin the driver refuses: the PTX, which it compiles for the GPU (the wide
            // entry's PTX for one of its cubins).
            Err(status) if image.starts_with(b"\x7fELF") => {
                let wide = COPY_KERNEL_WIDE_CUBINS
                    .iter()
                    .any(|(_, _, cubin)| std::ptr::eq(cubin.as_ptr(), image.as_ptr()));
                log::warn!(
                    "mori-tp: cuModuleLoadData of the copy kernel's {}cubin returned {}; loading \
                     its PTX instead",
                    if wide { "wide entry's " } else { "" },
                    self.error_name(status)
                );
                let ptx = if wide {
                    COPY_KERNEL_WIDE_PTX
                } else {
                    COPY_KERNEL_PTX
                };
                // SAFETY: the embedded PTX, NUL-terminated text.
                unsafe { self.module_load_data(ptx) }
            }
            loaded => loaded,
        }
    }

    fn module_load_log(&self) -> String {
        LOAD_LOG.with(|l| l.borrow().clone())
    }

    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> std::result::Result<*mut c_void, GpuStatus> {
        self.in_context(self.here()?, || {
            let mut function = null_mut();
            // SAFETY: a valid out-pointer and NUL-terminated name; the module as guaranteed.
            let status = unsafe {
                (self.driver().module_get_function)(&mut function, module, name.as_ptr())
            };
            out(status, function)
        })
    }

    unsafe fn module_unload(&self, module: *mut c_void) -> std::result::Result<(), GpuStatus> {
        self.in_context(self.here()?, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().module_unload)(module) }.result()
        })
    }

    fn malloc(&self, size: usize) -> std::result::Result<*mut c_void, GpuStatus> {
        self.in_context(self.here()?, || {
            let mut pointer: DevicePtr = 0;
            // SAFETY: a valid out-pointer.
            out(
                unsafe { (self.driver().mem_alloc)(&mut pointer, size) },
                pointer as usize as *mut c_void,
            )
        })
    }

    unsafe fn free(&self, pointer: *mut c_void) -> std::result::Result<(), GpuStatus> {
        // In the context the memory was allocated in (a pool may be dropped on any thread).
        self.in_context(self.owner_context(pointer)?, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().mem_free)(pointer as DevicePtr) }.result()
        })
    }

    fn host_malloc(&self, size: usize) -> std::result::Result<*mut c_void, GpuStatus> {
        self.in_context(self.here()?, || {
            let mut pointer = null_mut();
            // SAFETY: a valid out-pointer.
            out(
                unsafe {
                    (self.driver().mem_host_alloc)(&mut pointer, size, MEMHOSTALLOC_PORTABLE)
                },
                pointer,
            )
        })
    }

    fn event_create(&self) -> std::result::Result<*mut c_void, GpuStatus> {
        self.in_context(self.here()?, || {
            let mut event = null_mut();
            // SAFETY: a valid out-pointer.
            out(
                unsafe { (self.driver().event_create)(&mut event, EVENT_DISABLE_TIMING) },
                event,
            )
        })
    }

    unsafe fn event_record(
        &self,
        event: *mut c_void,
        stream: Stream,
    ) -> std::result::Result<(), GpuStatus> {
        self.on_stream(stream, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().event_record)(event, stream) }.result()
        })
    }

    unsafe fn event_query(&self, event: *mut c_void) -> std::result::Result<bool, GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        match unsafe { (self.driver().event_query)(event) } {
            GpuStatus::ERROR_NOT_READY => Ok(false),
            status => status.result().map(|()| true),
        }
    }

    fn pointer_info(
        &self,
        pointer: *const c_void,
        device: i32,
    ) -> std::result::Result<PointerInfo, GpuStatus> {
        // cuPointerGetAttributes does not fail for memory the driver does not know: it leaves
        // the defaults (memory type 0, NULL pointers), which read as pageable host memory.
        let mut memory_type: c_uint = 0;
        let mut ordinal: c_int = -1;
        let mut device_pointer: *mut c_void = null_mut();
        let mut host_pointer: *mut c_void = null_mut();
        let mut attributes = POINTER_ATTRIBUTES;
        let mut data: [*mut c_void; 4] = [
            (&raw mut memory_type).cast(),
            (&raw mut ordinal).cast(),
            (&raw mut device_pointer).cast(),
            (&raw mut host_pointer).cast(),
        ];
        self.in_context(self.primary(device)?, || {
            // SAFETY: four attributes, each with an out-pointer of its type.
            unsafe {
                (self.driver().pointer_get_attributes)(
                    attributes.len() as c_uint,
                    attributes.as_mut_ptr(),
                    data.as_mut_ptr(),
                    pointer as DevicePtr,
                )
            }
            .result()
        })?;
        Ok(PointerInfo {
            device: ordinal,
            device_pointer,
            host_pointer,
        })
    }

    fn allocation_id(
        &self,
        pointer: *const c_void,
        device: i32,
    ) -> std::result::Result<Option<u64>, GpuStatus> {
        // 0 (the default left for memory the driver does not know) is no identity.
        let mut id: u64 = 0;
        let mut attribute = POINTER_BUFFER_ID;
        let mut data: *mut c_void = (&raw mut id).cast();
        self.in_context(self.primary(device)?, || {
            // SAFETY: one attribute with an out-pointer of its type (unsigned long long).
            unsafe {
                (self.driver().pointer_get_attributes)(
                    1,
                    &mut attribute,
                    &mut data,
                    pointer as DevicePtr,
                )
            }
            .result()
        })?;
        Ok((id != 0).then_some(id))
    }

    unsafe fn foreign_context(&self, stream: Stream) -> std::result::Result<bool, GpuStatus> {
        let ctx = self.stream_context(stream)?;
        let device = self.context_device(ctx)?;
        Ok(ctx != self.primary(device)?)
    }

    fn max_pitch(&self) -> std::result::Result<Option<usize>, GpuStatus> {
        // Asked once per device (a device attribute does not change).
        static PITCHES: Mutex<Vec<(i32, Option<usize>)>> = Mutex::new(Vec::new());
        let device = self.current_device()?;
        if let Some(&(_, pitch)) = lock(&PITCHES).iter().find(|(d, _)| *d == device) {
            return Ok(pitch);
        }
        let (mut handle, mut pitch): (c_int, c_int) = (0, 0);
        // SAFETY: valid out-pointers; a bad ordinal or attribute is refused with a status.
        unsafe {
            out((self.driver().device_get)(&mut handle, device), ())?;
            out(
                (self.driver().device_get_attribute)(&mut pitch, DEVICE_MAX_PITCH, handle),
                (),
            )?;
        }
        let pitch = usize::try_from(pitch).ok().filter(|&p| p > 0);
        lock(&PITCHES).push((device, pitch));
        Ok(pitch)
    }

    fn address_range(
        &self,
        pointer: *mut c_void,
    ) -> std::result::Result<(usize, usize), GpuStatus> {
        // In the context of the allocation (a device's reset sentinel is checked from whichever
        // device is current).
        self.in_context(self.owner_context(pointer)?, || {
            let (mut base, mut size): (DevicePtr, usize) = (0, 0);
            // SAFETY: valid out-pointers; the driver only looks the address up.
            let status = unsafe {
                (self.driver().mem_get_address_range)(&mut base, &mut size, pointer as DevicePtr)
            };
            out(status, (base as usize, size))
        })
    }

    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        stream: Stream,
    ) -> std::result::Result<(), GpuStatus> {
        self.on_stream(stream, || {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { (self.driver().memcpy_htod_async)(dst as DevicePtr, src, size, stream) }
                .result()
        })
    }

    fn captures_kernel_launches(&self) -> bool {
        // Every driver with stream capture (CUDA 10 on) records cuLaunchKernel on a capturing
        // stream as a kernel node that owns its argument values (cuGraphKernelNodeGetParams:
        // "the argument values it points to, are owned by the node").
        true
    }

    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> std::result::Result<(), GpuStatus> {
        // The argument struct is the kernel's whole argument buffer.
        let mut args: KernelArgs = launch.args;
        // SAFETY: as the caller guarantees; `args` is the main entry's whole argument.
        unsafe {
            self.launch_buffer(
                launch,
                (&raw mut args).cast(),
                std::mem::size_of::<KernelArgs>(),
            )
        }
    }

    fn inline_table_bytes(&self, device: i32) -> usize {
        // Parameters beyond 4 KiB need a 12.1+ driver and sm_70+. A device whose capability
        // the driver does not say runs the main module, whose PTX is for sm_70 or newer, so it
        // is one too.
        let driver = self
            .loaded
            .version
            .is_some_and(|v| v >= LARGE_PARAMS_DRIVER);
        let device_takes = self.compute_capability(device).is_none_or(|cc| cc >= 70);
        if driver && device_takes {
            WIDE_INLINE_TABLE_BYTES
        } else {
            INLINE_TABLE_BYTES
        }
    }

    fn wide_kernel_image(&self) -> Option<KernelImage> {
        // SASS for this GPU when the build embedded one, else the PTX (ISA 8.1).
        if let Some((targets, bytes)) = self.wide_cubin_here() {
            return Some(KernelImage { bytes, targets });
        }
        Some(KernelImage {
            bytes: COPY_KERNEL_WIDE_PTX,
            targets: WIDE_PTX_ARCH,
        })
    }

    unsafe fn launch_kernel_wide(
        &self,
        launch: &WideKernelLaunch,
    ) -> std::result::Result<(), GpuStatus> {
        // The boxed 32,760-byte struct is the wide entry's whole argument buffer, which the
        // driver only reads (and copies during the call).
        let args: *const WideKernelArgs = &*launch.args;
        // SAFETY: as the caller guarantees; `args` is the wide entry's whole argument.
        unsafe {
            self.launch_buffer(
                launch,
                args.cast_mut().cast(),
                std::mem::size_of::<WideKernelArgs>(),
            )
        }
    }
}
