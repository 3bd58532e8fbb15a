//! The real HIP runtime: `libamdhip64`, linked through the `hip-sys` crate (see REFERENCE.md for why
//! only its link line is used).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::OnceLock;

// Only the link directive of hip-sys (libamdhip64) is used; its bindings return a Rust enum.
use hip_sys as _;

use super::super::copy_kernel::{ARCHS, BLOCK_THREADS, IMAGE, KernelArgs};
use super::device::KernelCache;
use super::runtime::{
    Api, CaptureMode, GpuRuntime, GpuStatus, HIP_API, HIP_MEMCPY_HOST_TO_DEVICE, KernelImage,
    KernelLaunch, Memcpy2dAsync, PointerInfo,
};

/// `hipPointerAttribute_t` (hip/hip_runtime_api.h): the same layout in HIP 5 and 6, whose first
/// field is named and numbered differently (`memoryType` / `type`), so it is not read.
#[repr(C)]
struct PointerAttributes {
    memory_type: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    is_managed: c_int,
    allocation_flags: c_uint,
}

// Signatures from hip/hip_runtime_api.h, with hipError_t and the other C enums (int sized) as
// integers and every handle as an opaque pointer. All are exported by HIP 5.2 and later
// (hipThreadExchangeStreamCaptureMode since HIP 5.0); what only newer runtimes have is looked up
// at run time (`optional`).
/// `HIP_POINTER_ATTRIBUTE_BUFFER_ID` (hipPointer_attribute, hip/driver_types.h): a process-unique
/// identity of an allocation.
const HIP_POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;

unsafe extern "C" {
    fn hipGetDeviceCount(count: *mut c_int) -> GpuStatus;
    fn hipRuntimeGetVersion(version: *mut c_int) -> GpuStatus;
    fn hipGetDevice(device: *mut c_int) -> GpuStatus;
    fn hipSetDevice(device: c_int) -> GpuStatus;
    fn hipThreadExchangeStreamCaptureMode(mode: *mut c_int) -> GpuStatus;
    fn hipStreamIsCapturing(stream: *mut c_void, status: *mut c_int) -> GpuStatus;
    fn hipDeviceCanAccessPeer(can: *mut c_int, device: c_int, peer: c_int) -> GpuStatus;
    fn hipStreamCreateWithFlags(stream: *mut *mut c_void, flags: c_uint) -> GpuStatus;
    fn hipStreamWaitEvent(stream: *mut c_void, event: *mut c_void, flags: c_uint) -> GpuStatus;
    fn hipEventQuery(event: *mut c_void) -> GpuStatus;
    fn hipMemcpy2DAsync(
        dst: *mut c_void,
        dpitch: usize,
        src: *const c_void,
        spitch: usize,
        width: usize,
        height: usize,
        kind: c_int,
        stream: *mut c_void,
    ) -> GpuStatus;
    fn hipStreamSynchronize(stream: *mut c_void) -> GpuStatus;
    fn hipGetErrorName(status: GpuStatus) -> *const c_char;
    fn hipModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> GpuStatus;
    fn hipModuleGetFunction(
        function: *mut *mut c_void,
        module: *mut c_void,
        name: *const c_char,
    ) -> GpuStatus;
    fn hipModuleUnload(module: *mut c_void) -> GpuStatus;
    fn hipMalloc(pointer: *mut *mut c_void, size: usize) -> GpuStatus;
    fn hipFree(pointer: *mut c_void) -> GpuStatus;
    fn hipHostMalloc(pointer: *mut *mut c_void, size: usize, flags: c_uint) -> GpuStatus;
    fn hipEventCreateWithFlags(event: *mut *mut c_void, flags: c_uint) -> GpuStatus;
    fn hipEventRecord(event: *mut c_void, stream: *mut c_void) -> GpuStatus;
    fn hipPointerGetAttributes(
        attributes: *mut PointerAttributes,
        pointer: *const c_void,
    ) -> GpuStatus;
    // HIP 5.0 and later (hip_runtime_api.h).
    fn hipPointerGetAttribute(
        data: *mut c_void,
        attribute: c_int,
        pointer: *mut c_void,
    ) -> GpuStatus;
    fn hipMemGetAddressRange(
        base: *mut *mut c_void,
        size: *mut usize,
        pointer: *mut c_void,
    ) -> GpuStatus;
    fn hipMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        kind: c_int,
        stream: *mut c_void,
    ) -> GpuStatus;
    #[allow(clippy::too_many_arguments)] // HIP's signature
    fn hipModuleLaunchKernel(
        function: *mut c_void,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: *mut c_void,
        kernel_params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> GpuStatus;
}

// HIP_LAUNCH_PARAM_* (hip/hip_runtime_api.h): markers of hipModuleLaunchKernel's `extra`.
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;
const LAUNCH_PARAM_END: usize = 3;
/// `hipHostMallocDefault`.
const HOST_MALLOC_DEFAULT: c_uint = 0;
/// `hipEventDisableTiming`: the events only order, they time nothing.
const EVENT_DISABLE_TIMING: c_uint = 2;
/// `hipStreamCaptureStatusNone`.
const CAPTURE_STATUS_NONE: c_int = 0;
/// `hipStreamNonBlocking`: the library's relay streams do not synchronize with the NULL stream.
const STREAM_NON_BLOCKING: c_uint = 1;

/// `hipStreamGetDevice(stream, &device)`: HIP 5.6 and later (hipamd rocm-5.6.0).
type StreamGetDevice = unsafe extern "C" fn(*mut c_void, *mut c_int) -> GpuStatus;

/// The copy kernel's state per device, for the whole process.
static KERNELS: KernelCache = KernelCache::new();

/// The counters of this runtime's engines.
pub(super) fn counters() -> super::GpuCounters {
    KERNELS.counters()
}

/// The function `name` of the library this one's HIP calls go to (libamdhip64, or a stand-in
/// preloaded in its place), found at run time; None where that library lacks it.
fn optional(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dladdr, dlopen with RTLD_NOLOAD (it only finds an already loaded library, which
    // stays loaded: this library links it) and dlsym are given valid, NUL-terminated arguments.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let linked = hipGetDevice as *const c_void;
        if libc::dladdr(linked, &mut info) != 0 && !info.dli_fname.is_null() {
            let handle = libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if !handle.is_null() {
                let symbol = libc::dlsym(handle, name.as_ptr());
                libc::dlclose(handle);
                return (!symbol.is_null()).then_some(symbol);
            }
        }
        let symbol = libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        (!symbol.is_null()).then_some(symbol)
    }
}

/// `hipDeviceAttributeMultiprocessorCount` (hip/hip_runtime_api.h of HIP 5.2: the 64th entry of
/// the CUDA-compatible block that starts at 0, an order clr keeps).
const ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 63;

/// `hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function, block, 0)`.
type Occupancy = unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, usize) -> GpuStatus;
/// `hipDeviceGetAttribute(&value, attribute, device)`.
type DeviceAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> GpuStatus;

/// The copy kernel's resident blocks on the current device: CUs times the occupancy at
/// [`BLOCK_THREADS`] threads a block; None where the runtime lacks either call or fails it.
///
/// # Safety
/// `function` must be the copy kernel, loaded on the current device.
unsafe fn resident_blocks(function: *mut c_void) -> Option<u32> {
    static FUNCTIONS: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    let (occupancy, attribute) = (*FUNCTIONS.get_or_init(|| {
        Some((
            optional(c"hipModuleOccupancyMaxActiveBlocksPerMultiprocessor")? as usize,
            optional(c"hipDeviceGetAttribute")? as usize,
        ))
    }))?;
    // SAFETY: the addresses of those two functions, whose C signatures these are.
    let (occupancy, attribute) = unsafe {
        (
            std::mem::transmute::<usize, Occupancy>(occupancy),
            std::mem::transmute::<usize, DeviceAttribute>(attribute),
        )
    };
    let (mut device, mut units, mut blocks) = (0, 0, 0);
    // SAFETY: valid out-pointers; the function is the caller's, on the current device.
    unsafe {
        (hipGetDevice(&mut device) == GpuStatus::SUCCESS).then_some(())?;
        (attribute(&mut units, ATTRIBUTE_MULTIPROCESSOR_COUNT, device) == GpuStatus::SUCCESS)
            .then_some(())?;
        (occupancy(&mut blocks, function, BLOCK_THREADS as c_int, 0) == GpuStatus::SUCCESS)
            .then_some(())?;
    }
    let resident = u32::try_from(units)
        .ok()?
        .checked_mul(u32::try_from(blocks).ok()?)?;
    (resident > 0).then_some(resident)
}

/// `hipStreamGetDevice`, looked up once.
fn stream_get_device() -> Option<StreamGetDevice> {
    static FUNCTION: OnceLock<Option<usize>> = OnceLock::new();
    let address = (*FUNCTION.get_or_init(|| optional(c"hipStreamGetDevice").map(|f| f as usize)))?;
    // SAFETY: the address of hipStreamGetDevice, whose C signature is StreamGetDevice.
    Some(unsafe { std::mem::transmute::<usize, StreamGetDevice>(address) })
}

/// The first `HIP_VERSION` (major * 10000000 + minor * 100000 + patch, as hipRuntimeGetVersion
/// returns it) whose hipModuleLaunchKernel is captured into a graph: 5.3 (hipamd rocm-5.3.0,
/// `STREAM_CAPTURE(hipModuleLaunchKernel, ...)` in src/hip_module.cpp).
pub const FIRST_CAPTURING_HIP_VERSION: i32 = 50_300_000;

/// An out-pointer call's result: the value on success, else the status.
fn out<T>(status: GpuStatus, value: T) -> Result<T, GpuStatus> {
    status.result().map(|()| value)
}

/// `libamdhip64`. The device count is read once per process: devices do not come and go
/// under a running HIP program, and AUTO asks on every send.
#[derive(Clone, Copy, Debug, Default)]
pub struct LibHip;

impl GpuRuntime for LibHip {
    fn api(&self) -> &'static Api {
        &HIP_API
    }

    fn device_count(&self) -> Result<i32, GpuStatus> {
        static COUNT: OnceLock<Result<i32, GpuStatus>> = OnceLock::new();
        *COUNT.get_or_init(|| {
            let mut count: c_int = 0;
            // SAFETY: `count` is a valid out-pointer for the duration of the call.
            out(unsafe { hipGetDeviceCount(&mut count) }, count)
        })
    }

    fn current_device(&self) -> Result<i32, GpuStatus> {
        let mut device: c_int = 0;
        // SAFETY: `device` is a valid out-pointer for the duration of the call.
        out(unsafe { hipGetDevice(&mut device) }, device)
    }

    fn set_device(&self, device: i32) -> Result<(), GpuStatus> {
        // SAFETY: any value is legal (a bad one is refused with a status).
        unsafe { hipSetDevice(device) }.result()
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, GpuStatus> {
        let mut mode: c_int = mode.0;
        // SAFETY: a valid in/out pointer (any value is checked by the runtime).
        out(
            unsafe { hipThreadExchangeStreamCaptureMode(&mut mode) },
            mode,
        )
        .map(CaptureMode)
    }

    unsafe fn stream_device(&self, stream: *mut c_void) -> Result<Option<i32>, GpuStatus> {
        let Some(get) = stream_get_device() else {
            return Ok(None);
        };
        let mut device: c_int = 0;
        // SAFETY: a valid out-pointer; the stream as the caller guarantees.
        out(unsafe { get(stream, &mut device) }, Some(device))
    }

    unsafe fn stream_is_capturing(&self, stream: *mut c_void) -> Result<bool, GpuStatus> {
        let mut status: c_int = CAPTURE_STATUS_NONE;
        // SAFETY: a valid out-pointer; the stream as the caller guarantees.
        out(unsafe { hipStreamIsCapturing(stream, &mut status) }, status)
            .map(|status| status != CAPTURE_STATUS_NONE)
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool, GpuStatus> {
        let mut can: c_int = 0;
        // SAFETY: a valid out-pointer; bad device numbers are refused with a status.
        out(
            unsafe { hipDeviceCanAccessPeer(&mut can, device, peer) },
            can != 0,
        )
    }

    unsafe fn memcpy_2d_async(&self, a: Memcpy2dAsync) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe {
            hipMemcpy2DAsync(
                a.dst, a.dpitch, a.src, a.spitch, a.width, a.height, a.kind, a.stream,
            )
        }
        .result()
    }

    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipStreamSynchronize(stream) }.result()
    }

    fn stream_create(&self) -> Result<*mut c_void, GpuStatus> {
        let mut stream = null_mut();
        // SAFETY: a valid out-pointer.
        out(
            unsafe { hipStreamCreateWithFlags(&mut stream, STREAM_NON_BLOCKING) },
            stream,
        )
    }

    unsafe fn stream_wait_event(
        &self,
        stream: *mut c_void,
        event: *mut c_void,
    ) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipStreamWaitEvent(stream, event, 0) }.result()
    }

    fn error_name(&self, status: GpuStatus) -> String {
        // SAFETY: hipGetErrorName takes any value (unknown ones get "hipErrorUnknown") and
        // returns NULL or a static NUL-terminated string.
        let name = unsafe { hipGetErrorName(status) };
        if name.is_null() {
            return "an unnamed HIP error".into();
        }
        // SAFETY: non-NULL, static and NUL-terminated, as above.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    fn kernel_image(&self) -> KernelImage {
        KernelImage {
            bytes: IMAGE,
            targets: ARCHS,
        }
    }

    fn kernel_cache(&self) -> &KernelCache {
        &KERNELS
    }

    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, GpuStatus> {
        let mut module = null_mut();
        // SAFETY: a valid out-pointer; the image is as the caller guarantees.
        let status = unsafe { hipModuleLoadData(&mut module, image.as_ptr().cast()) };
        out(status, module)
    }

    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, GpuStatus> {
        let mut function = null_mut();
        // SAFETY: a valid out-pointer and NUL-terminated name; the module as guaranteed.
        let status = unsafe { hipModuleGetFunction(&mut function, module, name.as_ptr()) };
        out(status, function)
    }

    unsafe fn module_unload(&self, module: *mut c_void) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipModuleUnload(module) }.result()
    }

    fn malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus> {
        let mut pointer = null_mut();
        // SAFETY: a valid out-pointer.
        out(unsafe { hipMalloc(&mut pointer, size) }, pointer)
    }

    unsafe fn free(&self, pointer: *mut c_void) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipFree(pointer) }.result()
    }

    fn host_malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus> {
        let mut pointer = null_mut();
        // SAFETY: a valid out-pointer.
        out(
            unsafe { hipHostMalloc(&mut pointer, size, HOST_MALLOC_DEFAULT) },
            pointer,
        )
    }

    fn event_create(&self) -> Result<*mut c_void, GpuStatus> {
        let mut event = null_mut();
        // SAFETY: a valid out-pointer.
        out(
            unsafe { hipEventCreateWithFlags(&mut event, EVENT_DISABLE_TIMING) },
            event,
        )
    }

    unsafe fn event_record(
        &self,
        event: *mut c_void,
        stream: *mut c_void,
    ) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipEventRecord(event, stream) }.result()
    }

    unsafe fn event_query(&self, event: *mut c_void) -> Result<bool, GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        match unsafe { hipEventQuery(event) } {
            GpuStatus::ERROR_NOT_READY => Ok(false),
            status => status.result().map(|()| true),
        }
    }

    fn allocation_id(
        &self,
        pointer: *const c_void,
        _device: i32,
    ) -> Result<Option<u64>, GpuStatus> {
        // A u64 zeroed first: whether the runtime writes 4 or 8 bytes, the value reads right.
        let mut id: u64 = 0;
        // SAFETY: a valid out-pointer of 8 bytes; the runtime only looks the address up.
        let status = unsafe {
            hipPointerGetAttribute(
                (&raw mut id).cast(),
                HIP_POINTER_ATTRIBUTE_BUFFER_ID,
                pointer.cast_mut(),
            )
        };
        out(status, ()).map(|()| (id != 0).then_some(id))
    }

    fn pointer_info(&self, pointer: *const c_void, _device: i32) -> Result<PointerInfo, GpuStatus> {
        let mut attributes = PointerAttributes {
            memory_type: 0,
            device: 0,
            device_pointer: null_mut(),
            host_pointer: null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: a valid out-pointer; the runtime only looks the address up.
        let status = unsafe { hipPointerGetAttributes(&mut attributes, pointer) };
        out(status, ()).map(|()| PointerInfo {
            device: attributes.device,
            device_pointer: attributes.device_pointer,
            host_pointer: attributes.host_pointer,
        })
    }

    fn address_range(&self, pointer: *mut c_void) -> Result<(usize, usize), GpuStatus> {
        let (mut base, mut size) = (null_mut(), 0usize);
        // SAFETY: valid out-pointers; the runtime only looks the address up.
        let status = unsafe { hipMemGetAddressRange(&mut base, &mut size, pointer) };
        out(status, (base as usize, size))
    }

    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        stream: *mut c_void,
    ) -> Result<(), GpuStatus> {
        // SAFETY: forwarded from the caller, as the trait documents.
        unsafe { hipMemcpyAsync(dst, src, size, HIP_MEMCPY_HOST_TO_DEVICE, stream) }.result()
    }

    fn captures_kernel_launches(&self) -> bool {
        static CAPTURES: OnceLock<bool> = OnceLock::new();
        *CAPTURES.get_or_init(|| {
            let mut version: c_int = 0;
            // SAFETY: a valid out-pointer.
            let status = unsafe { hipRuntimeGetVersion(&mut version) };
            // A runtime that cannot say is taken to be one that does not capture.
            status == GpuStatus::SUCCESS && version >= FIRST_CAPTURING_HIP_VERSION
        })
    }

    unsafe fn resident_blocks(&self, function: *mut c_void) -> Option<u32> {
        // SAFETY: forwarded from the caller.
        unsafe { resident_blocks(function) }
    }

    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> Result<(), GpuStatus> {
        // The argument struct is the kernel's whole argument buffer, passed through `extra`
        // (which every HIP version implements; HIP 5.2's header says kernelParams is not).
        // HIP copies it during the call.
        let mut args: KernelArgs = launch.args;
        let mut size = std::mem::size_of::<KernelArgs>();
        let mut extra = [
            std::ptr::without_provenance_mut(LAUNCH_PARAM_BUFFER_POINTER),
            (&raw mut args).cast(),
            std::ptr::without_provenance_mut(LAUNCH_PARAM_BUFFER_SIZE),
            (&raw mut size).cast(),
            std::ptr::without_provenance_mut(LAUNCH_PARAM_END),
        ];
        // SAFETY: forwarded from the caller; `extra` and what it points to outlive the call.
        unsafe {
            hipModuleLaunchKernel(
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
    }
}
