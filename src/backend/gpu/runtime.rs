//! The runtime trait the engine calls ([`GpuRuntime`]), its statuses, and each runtime's names
//! ([`Api`]): the level that `LibHip`, `LibCuda` and a test's recorder implement.

use std::ffi::{CStr, c_void};

use super::super::copy_kernel::{INLINE_TABLE_BYTES, KernelArgs, WideKernelArgs};
use super::device::KernelCache;
use crate::error::Result;

/// A `hipError_t` exactly as the runtime returns it, kept as an integer: a newer runtime may
/// return a code that no enum compiled into this library lists, and an unlisted value in a Rust
/// enum would be undefined behaviour.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuStatus(pub i32);

impl GpuStatus {
    // Values from `hipError_t` in hip/hip_runtime_api.h (HIP 5.2; unchanged since).
    /// `hipSuccess`.
    pub const SUCCESS: GpuStatus = GpuStatus(0);
    /// `hipErrorInvalidValue`: an argument is out of range.
    pub const ERROR_INVALID_VALUE: GpuStatus = GpuStatus(1);
    /// `hipErrorNotReady`: what `hipEventQuery` returns while the work before the event's record
    /// has not finished (`CUDA_ERROR_NOT_READY` has the same value).
    pub const ERROR_NOT_READY: GpuStatus = GpuStatus(600);
    /// `hipErrorStreamCaptureUnsupported`: the operation is not allowed while the stream is
    /// capturing a graph (as `hipStreamSynchronize` is not); what a synchronizing call on a
    /// capturing stream is refused as.
    pub const ERROR_STREAM_CAPTURE_UNSUPPORTED: GpuStatus = GpuStatus(900);
    /// `hipErrorNoDevice`: `hipGetDeviceCount` found no device.
    pub const ERROR_NO_DEVICE: GpuStatus = GpuStatus(100);
    /// `hipErrorInvalidDevice`: what other calls return when there is no device, and what a launch
    /// returns when its function is not loaded on the stream's device.
    pub const ERROR_INVALID_DEVICE: GpuStatus = GpuStatus(101);
    /// `hipErrorCapturedEvent`: an event last recorded on a stream that is now capturing was
    /// queried or waited for (and the capture invalidated).
    pub const ERROR_CAPTURED_EVENT: GpuStatus = GpuStatus(907);

    /// `Ok(())` for `hipSuccess`, else `Err(self)`: every runtime call's status goes through here.
    pub fn result(self) -> Result<(), GpuStatus> {
        if self == GpuStatus::SUCCESS {
            Ok(())
        } else {
            Err(self)
        }
    }
}

/// A `hipStreamCaptureMode` (`CUstreamCaptureMode` has the same values): which calls of a thread
/// the runtime refuses while graphs are being captured.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CaptureMode(pub i32);

impl CaptureMode {
    /// `hipStreamCaptureModeGlobal`, every thread's default: refused while any thread captures
    /// in this mode.
    pub const GLOBAL: CaptureMode = CaptureMode(0);
    /// `hipStreamCaptureModeThreadLocal`: refused while this thread captures.
    pub const THREAD_LOCAL: CaptureMode = CaptureMode(1);
    /// `hipStreamCaptureModeRelaxed`: never refused.
    pub const RELAXED: CaptureMode = CaptureMode(2);

    /// `api`'s name of the mode.
    pub fn name(self, api: &Api) -> &'static str {
        match self {
            CaptureMode::GLOBAL => api.capture_modes[0],
            CaptureMode::THREAD_LOCAL => api.capture_modes[1],
            CaptureMode::RELAXED => api.capture_modes[2],
            _ => api.capture_modes[3],
        }
    }
}

/// What a runtime's messages call things: its API's function names, flags and the few words
/// that differ between HIP and CUDA, so that a failure names the call the caller's runtime made
/// (`cuMemAlloc`, not `hipMalloc`). [`HIP_API`] and [`CUDA_API`] are the two.
#[derive(Debug)]
pub struct Api {
    /// "HIP" or "CUDA".
    pub backend: &'static str,
    /// The engine's short name ([`CopyEngine::name`]): "hip" or "cuda".
    pub engine: &'static str,
    /// The cargo feature that builds it.
    pub feature: &'static str,
    /// What the device count is asked with.
    pub device_count: &'static str,
    /// What a device count of 0 or a failure there most likely means.
    pub no_device: &'static str,
    /// The calling thread's current device is read with.
    pub get_device: &'static str,
    /// A device is made current with.
    pub set_device: &'static str,
    /// The thread's capture mode is exchanged with.
    pub exchange_capture_mode: &'static str,
    /// The names of the capture modes Global, ThreadLocal and Relaxed, and of an unknown one.
    pub capture_modes: [&'static str; 4],
    /// The stream's device is asked with.
    pub stream_get_device: &'static str,
    /// What follows a failure of [`Api::stream_get_device`].
    pub stream_get_device_note: &'static str,
    /// Whether a stream captures is asked with.
    pub stream_is_capturing: &'static str,
    /// The status of a capturing stream.
    pub capture_status_active: &'static str,
    /// Peer reachability is asked with.
    pub can_access_peer: &'static str,
    /// The per-rect copy.
    pub memcpy_2d_async: &'static str,
    /// The per-rect copy's direction argument as messages show it.
    pub memcpy_2d_kind: &'static str,
    /// A stream is waited for with.
    pub stream_synchronize: &'static str,
    /// The library's relay streams are made with, and the flag they get.
    pub stream_create: &'static str,
    pub stream_non_blocking: &'static str,
    /// A stream is made to wait for an event with.
    pub stream_wait_event: &'static str,
    /// The copy kernel is loaded, looked up, unloaded and launched with.
    pub module_load_data: &'static str,
    pub module_get_function: &'static str,
    pub module_unload: &'static str,
    pub launch_kernel: &'static str,
    /// What the kernel image holds, before its targets ("code objects for" gfx90a, ...).
    pub kernel_image_what: &'static str,
    /// What a failed load most likely means for this runtime's kernel image.
    pub kernel_load_note: &'static str,
    /// Device memory is allocated and freed with.
    pub malloc: &'static str,
    pub free: &'static str,
    /// Pinned host memory is allocated with.
    pub host_malloc: &'static str,
    /// Events are made with, and the flag they get.
    pub event_create: &'static str,
    pub event_disable_timing: &'static str,
    pub event_record: &'static str,
    pub event_query: &'static str,
    /// What an address is asked about with.
    pub pointer_attributes: &'static str,
    /// The allocation around an address is asked for with.
    pub address_range: &'static str,
    /// The kernel table's upload, and its direction argument as messages show it.
    pub memcpy_htod_async: &'static str,
    pub memcpy_htod_kind: &'static str,
    /// The status name of success.
    pub success: &'static str,
    /// Host memory is registered (pinned in place) with, and its device address asked for with.
    pub host_register: &'static str,
    pub host_get_device_pointer: &'static str,
    /// What resets a device.
    pub device_reset: &'static str,
}

/// HIP's names (libamdhip64).
pub const HIP_API: Api = Api {
    backend: "HIP",
    engine: "hip",
    feature: "hip",
    device_count: "hipGetDeviceCount",
    no_device: "no usable AMD GPU, or no driver access to one",
    get_device: "hipGetDevice",
    set_device: "hipSetDevice",
    exchange_capture_mode: "hipThreadExchangeStreamCaptureMode",
    capture_modes: [
        "hipStreamCaptureModeGlobal",
        "hipStreamCaptureModeThreadLocal",
        "hipStreamCaptureModeRelaxed",
        "an unknown hipStreamCaptureMode",
    ],
    stream_get_device: "hipStreamGetDevice",
    stream_get_device_note: "",
    stream_is_capturing: "hipStreamIsCapturing",
    capture_status_active: "hipStreamCaptureStatusActive",
    can_access_peer: "hipDeviceCanAccessPeer",
    memcpy_2d_async: "hipMemcpy2DAsync",
    memcpy_2d_kind: "hipMemcpyDefault",
    stream_synchronize: "hipStreamSynchronize",
    stream_create: "hipStreamCreateWithFlags",
    stream_non_blocking: "hipStreamNonBlocking",
    stream_wait_event: "hipStreamWaitEvent",
    module_load_data: "hipModuleLoadData",
    module_get_function: "hipModuleGetFunction",
    module_unload: "hipModuleUnload",
    launch_kernel: "hipModuleLaunchKernel",
    kernel_image_what: "code objects for",
    kernel_load_note: "a GPU of another target needs a build with a hipcc that knows it, see \
                       MORI_TP_HIP_ARCHS",
    malloc: "hipMalloc",
    free: "hipFree",
    host_malloc: "hipHostMalloc",
    event_create: "hipEventCreateWithFlags",
    event_disable_timing: "hipEventDisableTiming",
    event_record: "hipEventRecord",
    event_query: "hipEventQuery",
    pointer_attributes: "hipPointerGetAttributes",
    address_range: "hipMemGetAddressRange",
    memcpy_htod_async: "hipMemcpyAsync",
    memcpy_htod_kind: ", hipMemcpyHostToDevice",
    success: "hipSuccess",
    host_register: "hipHostRegister",
    host_get_device_pointer: "hipHostGetDevicePointer",
    device_reset: "hipDeviceReset",
};

/// The CUDA driver API's names (libcuda.so.1). Where the driver exports a function under a
/// versioned symbol (`cuMemAlloc_v2`), messages use the name cuda.h gives it.
pub const CUDA_API: Api = Api {
    backend: "CUDA",
    engine: "cuda",
    feature: "cuda",
    device_count: "cuDeviceGetCount",
    no_device: "no NVIDIA GPU, or no driver access to one",
    get_device: "cuCtxGetDevice",
    set_device: "cuCtxSetCurrent",
    exchange_capture_mode: "cuThreadExchangeStreamCaptureMode",
    capture_modes: [
        "CU_STREAM_CAPTURE_MODE_GLOBAL",
        "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
        "CU_STREAM_CAPTURE_MODE_RELAXED",
        "an unknown CUstreamCaptureMode",
    ],
    stream_get_device: "cuStreamGetCtx",
    stream_get_device_note: " (the CUDA backend's copy kernel runs on streams of a device's \
                             primary context, as the CUDA runtime, PyTorch and CuPy make them; a \
                             stream of a context made with cuCtxCreate needs MORI_SEND_MEMCPY2D)",
    stream_is_capturing: "cuStreamIsCapturing",
    capture_status_active: "CU_STREAM_CAPTURE_STATUS_ACTIVE",
    can_access_peer: "cuDeviceCanAccessPeer",
    memcpy_2d_async: "cuMemcpy2DAsync",
    memcpy_2d_kind: "CU_MEMORYTYPE_UNIFIED",
    stream_synchronize: "cuStreamSynchronize",
    stream_create: "cuStreamCreate",
    stream_non_blocking: "CU_STREAM_NON_BLOCKING",
    stream_wait_event: "cuStreamWaitEvent",
    module_load_data: "cuModuleLoadDataEx",
    module_get_function: "cuModuleGetFunction",
    module_unload: "cuModuleUnload",
    launch_kernel: "cuLaunchKernel",
    kernel_image_what: "PTX for",
    kernel_load_note: "the driver JIT-compiles the PTX for the GPU and refuses it when it is \
                       older than the PTX's ISA version: update the NVIDIA driver, or build \
                       with an older MORI_TP_PTX_ARCH",
    malloc: "cuMemAlloc",
    free: "cuMemFree",
    host_malloc: "cuMemHostAlloc",
    event_create: "cuEventCreate",
    event_disable_timing: "CU_EVENT_DISABLE_TIMING",
    event_record: "cuEventRecord",
    event_query: "cuEventQuery",
    pointer_attributes: "cuPointerGetAttributes",
    address_range: "cuMemGetAddressRange",
    memcpy_htod_async: "cuMemcpyHtoDAsync",
    memcpy_htod_kind: "",
    success: "CUDA_SUCCESS",
    host_register: "cuMemHostRegister",
    host_get_device_pointer: "cuMemHostGetDevicePointer",
    device_reset: "cudaDeviceReset",
};

/// `hipMemcpyDefault` from `hipMemcpyKind` (hip/driver_types.h): the runtime infers the
/// direction from the pointers (unified virtual addressing), so device, peer-device and host
/// memory are all legal on either side.
pub const HIP_MEMCPY_DEFAULT: i32 = 4;

/// `hipMemcpyHostToDevice` from `hipMemcpyKind`: the kernel table's upload.
#[cfg_attr(not(feature = "hip"), allow(dead_code))]
pub const HIP_MEMCPY_HOST_TO_DEVICE: i32 = 1;

/// Table buffer pairs per device, at most: beyond them a call waits for a pair its own stream
/// used, so the host runs at most that many kernel calls ahead of the GPU on one device.
pub const MAX_TABLE_SLOTS: usize = 32;

/// Lanes (streams with table buffers in flight) per device, at most.
pub const MAX_LANES: usize = 16;

/// The smallest table buffer: 1000 rects and their bases fit. Pairs are powers of two.
pub const MIN_TABLE_BYTES: usize = 64 * 1024;

/// Bytes of the reset sentinel, the device allocation whose survival shows that the device was
/// not reset since the kernel state was made: a size no caller asks for (a page and a bit), so
/// that an allocation that takes its address after a `hipDeviceReset` has another size.
pub const RESET_SENTINEL_BYTES: usize = 4096 + 192;
/// The arguments of one `hipMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind,
/// stream)`, in that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memcpy2dAsync {
    /// First destination row.
    pub dst: *mut c_void,
    /// Bytes between destination rows.
    pub dpitch: usize,
    /// First source row.
    pub src: *const c_void,
    /// Bytes between source rows.
    pub spitch: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// A `hipMemcpyKind`; the engine always passes [`HIP_MEMCPY_DEFAULT`].
    pub kind: i32,
    /// `hipStream_t`; NULL is the null stream.
    pub stream: *mut c_void,
}

/// The arguments of one `hipModuleLaunchKernel` of the copy kernel: `function` on a grid of
/// `(grid.0, grid.1, 1)` blocks of `(block, 1, 1)` threads, no dynamic shared memory, on
/// `stream`, with `args` as the kernel's whole argument buffer: a [`KernelArgs`], or for the
/// wide entry ([`GpuRuntime::launch_kernel_wide`]) a boxed [`WideKernelArgs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLaunch<A = KernelArgs> {
    /// `hipFunction_t` of the copy kernel.
    pub function: *mut c_void,
    /// Blocks in x (tiles of rows) and y (buffers).
    pub grid: (u32, u32),
    /// Threads per block ([`BLOCK_THREADS`]).
    pub block: u32,
    /// `hipStream_t`; NULL is the null stream.
    pub stream: *mut c_void,
    /// The kernel's argument.
    pub args: A,
}

/// A launch of the wide entry: its 32,760-byte argument, boxed.
pub type WideKernelLaunch = KernelLaunch<Box<WideKernelArgs>>;

/// The code objects a runtime loads for the copy kernel, and the GPU targets they cover (for
/// messages when the device is not among them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelImage {
    /// A clang offload bundle (or code object) for `hipModuleLoadData`.
    pub bytes: &'static [u8],
    /// The targets it holds, e.g. "gfx90a,gfx942,gfx950".
    pub targets: &'static str,
}

/// What `hipPointerGetAttributes` says about an address, in the fields that mean the same in
/// every HIP version (the memory type's numbering changed in HIP 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    /// The device the memory belongs to.
    pub device: i32,
    /// The address a kernel uses for it; NULL when no device can address it.
    pub device_pointer: *mut c_void,
    /// The address the host uses for it; NULL for device memory.
    pub host_pointer: *mut c_void,
}

/// The HIP runtime functions the engine uses. `LibHip` calls `libamdhip64`; the unit tests
/// supply a runtime that records the calls and performs them on host memory. Every call returns
/// its status as `Err` when it is not `hipSuccess`. Each has a CUDA driver API counterpart
/// (named on each), so that a CUDA runtime can implement the same trait.
pub trait GpuRuntime {
    /// The names this runtime's calls have in messages.
    fn api(&self) -> &'static Api;

    /// `hipGetDeviceCount` (`cuDeviceGetCount`): the number of devices.
    fn device_count(&self) -> Result<i32, GpuStatus>;

    /// `hipGetDevice`: the calling thread's current device.
    fn current_device(&self) -> Result<i32, GpuStatus>;

    /// `hipSetDevice(device)`.
    fn set_device(&self, device: i32) -> Result<(), GpuStatus>;

    /// `hipThreadExchangeStreamCaptureMode(&mode)` (`cuThreadExchangeStreamCaptureMode`): makes
    /// `mode` the calling thread's capture mode and returns the one it replaces.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, GpuStatus>;

    /// `hipStreamGetDevice(stream)`, or `Ok(None)` when the runtime has no such function (HIP
    /// 5.2 does not).
    ///
    /// # Safety
    /// `stream` must be a live stream (not NULL).
    unsafe fn stream_device(&self, stream: *mut c_void) -> Result<Option<i32>, GpuStatus>;

    /// `hipStreamIsCapturing(stream)`: true unless the status is `hipStreamCaptureStatusNone`.
    ///
    /// # Safety
    /// `stream` must be a live stream (not NULL).
    unsafe fn stream_is_capturing(&self, stream: *mut c_void) -> Result<bool, GpuStatus>;

    /// `hipDeviceCanAccessPeer(&can, device, peer)` (`cuDeviceCanAccessPeer`): whether kernels
    /// on `device` can ever reach `peer`'s memory (once peer access is enabled).
    fn can_access_peer(&self, device: i32, peer: i32) -> Result<bool, GpuStatus>;

    /// `hipMemcpy2DAsync` with `args`.
    ///
    /// # Safety
    /// Every row of the copy must be readable at `src + r * spitch` and writable at
    /// `dst + r * dpitch` for `width` bytes until the stream has run the copy, and `stream`
    /// must be NULL or a live stream.
    unsafe fn memcpy_2d_async(&self, args: Memcpy2dAsync) -> Result<(), GpuStatus>;

    /// `hipStreamSynchronize(stream)`.
    ///
    /// # Safety
    /// `stream` must be NULL or a live stream.
    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> Result<(), GpuStatus>;

    /// `hipStreamCreateWithFlags(&stream, hipStreamNonBlocking)` (`cuStreamCreate` with
    /// `CU_STREAM_NON_BLOCKING`) on the current device: a stream that does not synchronize with
    /// the NULL stream.
    fn stream_create(&self) -> Result<*mut c_void, GpuStatus>;

    /// `hipStreamWaitEvent(stream, event, 0)` (`cuStreamWaitEvent`): work enqueued on `stream`
    /// after this call waits for the work before `event`'s last record.
    ///
    /// # Safety
    /// `stream` must be a live stream, `event` a live event.
    unsafe fn stream_wait_event(
        &self,
        stream: *mut c_void,
        event: *mut c_void,
    ) -> Result<(), GpuStatus>;

    /// `hipGetErrorName(status)`, e.g. "hipErrorInvalidValue".
    fn error_name(&self, status: GpuStatus) -> String;

    /// The copy kernel's code objects this runtime loads.
    fn kernel_image(&self) -> KernelImage;

    /// Where this runtime keeps the copy kernel's state per device.
    fn kernel_cache(&self) -> &KernelCache;

    /// `hipModuleLoadData(&module, image)` on the current device.
    ///
    /// # Safety
    /// `image` must be a code object or offload bundle as hipcc writes it.
    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, GpuStatus>;

    /// `hipModuleGetFunction(&function, module, name)`.
    ///
    /// # Safety
    /// `module` must be a loaded module, loaded on the current device.
    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, GpuStatus>;

    /// `hipModuleUnload(module)`.
    ///
    /// # Safety
    /// `module` must be a loaded module no stream still runs a kernel of.
    unsafe fn module_unload(&self, module: *mut c_void) -> Result<(), GpuStatus>;

    /// `hipMalloc(&pointer, size)` on the current device.
    fn malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus>;

    /// `hipFree(pointer)`.
    ///
    /// # Safety
    /// `pointer` must come from [`GpuRuntime::malloc`], not be freed yet, and no stream may
    /// still use it.
    unsafe fn free(&self, pointer: *mut c_void) -> Result<(), GpuStatus>;

    /// `hipHostMalloc(&pointer, size, hipHostMallocDefault)`: pinned host memory (never freed:
    /// `hipHostFree` waits for every stream of the device, as `hipFree` does).
    fn host_malloc(&self, size: usize) -> Result<*mut c_void, GpuStatus>;

    /// `hipEventCreateWithFlags(&event, hipEventDisableTiming)` on the current device.
    fn event_create(&self) -> Result<*mut c_void, GpuStatus>;

    /// `hipEventRecord(event, stream)`.
    ///
    /// # Safety
    /// `event` must be a live event, `stream` NULL or a live stream.
    unsafe fn event_record(&self, event: *mut c_void, stream: *mut c_void)
    -> Result<(), GpuStatus>;

    /// `hipEventQuery(event)` (`cuEventQuery`) without waiting: `Ok(true)` once the work before
    /// its last record has finished (or it was never recorded), `Ok(false)` while it has not
    /// (`hipErrorNotReady`).
    ///
    /// # Safety
    /// `event` must be a live event.
    unsafe fn event_query(&self, event: *mut c_void) -> Result<bool, GpuStatus>;

    /// `hipPointerGetAttributes(&attributes, pointer)`, asked where a kernel on `device` would
    /// use the memory (CUDA: in `device`'s primary context, since
    /// `CU_POINTER_ATTRIBUTE_DEVICE_POINTER` is the address "through which ptr may be accessed by
    /// kernels running in the current CUcontext", Driver API reference, cuPointerGetAttribute).
    fn pointer_info(&self, pointer: *const c_void, device: i32) -> Result<PointerInfo, GpuStatus>;

    /// The identity of the allocation that holds `pointer`, unique within the process for the
    /// allocation's life (CUDA: `CU_POINTER_ATTRIBUTE_BUFFER_ID`, asked as for
    /// [`GpuRuntime::pointer_info`]), so that an address freed and reused for other memory is
    /// told apart from the allocation the engine classified. `Ok(None)` where the runtime has
    /// none or does not know the memory: the engine then asks [`GpuRuntime::pointer_info`]
    /// about the base on every call (the HIP runtime does this).
    fn allocation_id(&self, pointer: *const c_void, device: i32) -> Result<Option<u64>, GpuStatus> {
        let _ = (pointer, device);
        Ok(None)
    }

    /// What the runtime's compiler wrote about this thread's last failed
    /// [`GpuRuntime::module_load_data`] (CUDA: the JIT's error and info logs,
    /// `CU_JIT_ERROR_LOG_BUFFER` and `CU_JIT_INFO_LOG_BUFFER` of `cuModuleLoadDataEx`); empty when
    /// it wrote nothing.
    fn module_load_log(&self) -> String {
        String::new()
    }

    /// True when the library's copy kernel cannot run on `stream` (NULL: the thread's default
    /// stream) because the stream belongs to a context other than its device's primary one,
    /// where the kernel is loaded (CUDA: a context made with `cuCtxCreate`, or the NULL stream
    /// while such a context is current). HIP has no such contexts.
    ///
    /// # Safety
    /// `stream` must be NULL or a live stream.
    unsafe fn foreign_context(&self, stream: *mut c_void) -> Result<bool, GpuStatus> {
        let _ = stream;
        Ok(false)
    }

    /// The largest pitch a 2D copy takes on the current device (CUDA:
    /// `CU_DEVICE_ATTRIBUTE_MAX_PITCH`; "cuMemcpy2D() returns an error if any pitch is greater
    /// than the maximum allowed"), or `Ok(None)` where the runtime states none.
    fn max_pitch(&self) -> Result<Option<usize>, GpuStatus> {
        Ok(None)
    }

    /// `hipMemGetAddressRange(&base, &size, pointer)` (`cuMemGetAddressRange`): the device
    /// allocation that holds `pointer`, as its base address and size.
    fn address_range(&self, pointer: *mut c_void) -> Result<(usize, usize), GpuStatus>;

    /// `hipMemcpyAsync(dst, src, size, hipMemcpyHostToDevice, stream)`.
    ///
    /// # Safety
    /// `dst` must be device memory of at least `size` bytes and `src` pinned host memory of at
    /// least `size` bytes, both unchanged until the stream has run the copy; `stream` NULL or
    /// live.
    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        stream: *mut c_void,
    ) -> Result<(), GpuStatus>;

    /// `hipModuleLaunchKernel` of the copy kernel as `launch` describes.
    ///
    /// # Safety
    /// `launch.function` must be the copy kernel on the stream's device, and every address the
    /// table behind `launch.args` names must stay valid until the stream has run the kernel.
    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> Result<(), GpuStatus>;

    /// The most table bytes a launch on `device` can carry inside its argument: [`INLINE_TABLE_BYTES`]
    /// (the 4 KiB argument, the default, and HIP's), or more where the runtime has a wide entry
    /// ([`GpuRuntime::wide_kernel_image`]) and the driver and device take its argument (CUDA:
    /// [`WIDE_INLINE_TABLE_BYTES`](super::super::copy_kernel::WIDE_INLINE_TABLE_BYTES) on a
    /// 12.1+ driver and compute capability 7.0+). The engine loads the wide entry when the first
    /// table too big for the 4 KiB argument but within this comes.
    fn inline_table_bytes(&self, device: i32) -> usize {
        let _ = device;
        INLINE_TABLE_BYTES
    }

    /// The module of the wide entry (`mori_copy_kernel_wide`, whose argument is a
    /// [`WideKernelArgs`]), for [`GpuRuntime::module_load_data`] on the current device; None
    /// where the runtime has none (HIP, whose argument stays 4 KiB).
    fn wide_kernel_image(&self) -> Option<KernelImage> {
        None
    }

    /// `launch_kernel` of the wide entry: `launch.function` is `mori_copy_kernel_wide`, and the
    /// argument buffer is the whole [`WideKernelArgs`]. A runtime without a wide entry refuses
    /// with `hipErrorInvalidValue` (the engine never asks it).
    ///
    /// # Safety
    /// As for [`GpuRuntime::launch_kernel`], with the wide entry loaded on the stream's device.
    unsafe fn launch_kernel_wide(&self, launch: &WideKernelLaunch) -> Result<(), GpuStatus> {
        let _ = launch;
        Err(GpuStatus::ERROR_INVALID_VALUE)
    }

    /// Whether [`GpuRuntime::launch_kernel`] on a stream that is capturing a graph adds a kernel
    /// node to that graph which holds its own copy of the launch's argument, so that every
    /// replay runs the kernel with the argument of the captured call and nothing of the
    /// library's. The CUDA driver captures every `cuLaunchKernel` so (a kernel node owns its
    /// argument values: `cuGraphKernelNodeGetParams`). HIP captures `hipModuleLaunchKernel` from
    /// 5.3 on, copying the `extra` argument buffer into the node (hipamd `rocm-5.3.0`,
    /// `capturehipModuleLaunchKernel` in src/hip_graph.cpp, `hipGraphKernelNode::copyParams`
    /// in src/hip_graph_internal.hpp; clr keeps both); HIP 5.2 has no capture path there and
    /// runs the kernel at once, outside the graph. When false, a capturing stream gets the
    /// per-rect copies.
    fn captures_kernel_launches(&self) -> bool;

    /// The blocks of the copy kernel (`function`, loaded on the current device, blocks of
    /// [`BLOCK_THREADS`] threads) the current device runs at once: its multiprocessor count
    /// times `cuOccupancyMaxActiveBlocksPerMultiprocessor` (HIP:
    /// `hipModuleOccupancyMaxActiveBlocksPerMultiprocessor`), the persistent grid's size. Asked
    /// once per device, when the kernel loads; None where the runtime cannot say (then only the
    /// caller's budget limits the grid).
    ///
    /// # Safety
    /// `function` must be the copy kernel, loaded on the current device.
    unsafe fn resident_blocks(&self, function: *mut c_void) -> Option<u32> {
        let _ = function;
        None
    }
}
