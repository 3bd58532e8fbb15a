//! The GPU copy engine of the HIP and CUDA backends: one launch of the copy kernel for the whole
//! call, or one 2D copy per (buffer, rect) (`hipMemcpy2DAsync`, `cuMemcpy2DAsync`), on the
//! caller's stream ([`CopyPath`] chooses).
//!
//! The runtime functions the engine calls sit behind [`GpuRuntime`], so that the engine is the
//! same code whether the runtime is the real `libamdhip64` (`LibHip`, built with the `hip`
//! feature), the CUDA driver (`LibCuda`, built with the `cuda` feature, loaded from
//! `libcuda.so.1` when first used), or the recording stand-in of the unit tests, which runs the
//! byte-exact transfer tests on any machine. The trait speaks HIP's terms (a current device,
//! `hipMemcpyDefault`); `LibCuda` maps each to the driver's (the device's primary context,
//! `CU_MEMORYTYPE_UNIFIED`), and [`Api`] gives each runtime's names to the messages. Every
//! runtime call returns `Result<T, GpuStatus>`, and [`GpuResult::or_gpu`] is the one place that
//! turns a failed call into [`Error::Gpu`] (cudarc's split between its `result` layer and the
//! errors its safe layer reports).
//!
//! The rest of this description uses HIP's names; the CUDA driver's are in [`CUDA_API`].
//!
//! **Graph capture of other threads.** While any thread captures a graph in the global mode
//! (PyTorch's default), the runtime refuses `hipMalloc`, `hipHostMalloc`, `hipFree`,
//! `hipHostFree`, `hipStreamSynchronize` and `hipEventSynchronize` from threads in the global
//! mode, and invalidates that capture (clr: `CHECK_STREAM_CAPTURE_SUPPORTED` in
//! hipamd/src/hip_internal.hpp, `Stream::StreamCaptureOngoing` in hip_stream.cpp; CUDA has the
//! same rule). So every call of the engine runs in the relaxed mode
//! (`hipThreadExchangeStreamCaptureMode`), and the caller's mode is restored before it returns.
//!
//! The engine never leaves the caller's current device changed: a copy runs on the device of the
//! caller's stream (for the NULL stream, the caller's current device). The copy kernel is loaded
//! once per device, for the stream's device (`hipStreamGetDevice`, resolved at run time because
//! HIP 5.2 lacks it; without it, the current device, which an event of that device recorded on
//! the stream confirms): `hipModuleLoadData` loads for the current device only, and a launch
//! runs on the stream's device, so when the two differ the engine makes the stream's device
//! current for the load (and for what it allocates there) and switches back.
//!
//! A kernel call is, in order: the capture check (below), the device's kernel state (loaded
//! once; its reset sentinel checked to have survived any `hipDeviceReset`), without
//! `hipStreamGetDevice` the stream's device checked, the buffers the kernel cannot reach refused
//! (device memory checked once per base with `hipPointerGetAttributes`, and another device's
//! memory against `hipDeviceCanAccessPeer`; host memory on every call), then:
//! - a table that fits in the kernel's 4 KiB argument (`KernelTable::is_inline`) travels inside
//!   it: the launch is the only call on the stream, with no table buffer, upload, lane or fence
//!   (the runtime copies the argument during the call);
//! - a bigger table takes the stream's lane and an idle table buffer pair, then on the stream
//!   one `hipMemcpyAsync` of the table from the pair's pinned host memory into its device
//!   buffer, the launch, and the pair's fence (below).
//!
//! **Graph capture of the caller's stream.** A capturing stream's work is recorded into the
//! graph and replayed at every `hipGraphLaunch`, long after the call returned. An uploaded table
//! would be read from its table buffer at every replay, after later calls reused the buffer, so
//! such a call gets the per-rect copies, whose copy nodes keep nothing of the call. A launch
//! whose table is inside its argument keeps nothing of the library's either (the function stays
//! loaded for the process): it is captured as a kernel node that holds its own copy of the
//! argument, where the runtime captures kernel launches ([`GpuRuntime::captures_kernel_launches`]:
//! CUDA, and HIP from 5.3; HIP 5.2 runs `hipModuleLaunchKernel` at once and leaves it out of the
//! graph, so there a capturing stream gets the per-rect copies). While capturing, the launch is
//! made with the stream's device current (HIP checks a captured launch's function against the
//! current device), and a stream whose device the runtime cannot say (no `hipStreamGetDevice`)
//! gets the per-rect copies: the probe event below would be captured without its device check.
//!
//! **Table buffers and fences.** Each (device, stream) has a lane: a non-blocking stream of the
//! library's own (the relay) and an event. After a launch on the caller's stream `S`, the engine
//! records the lane's event on `S`, makes the relay wait for it (`hipStreamWaitEvent`) and
//! records the pair's `done` event on the relay. So `done` passes when `S` has run the call, it
//! depends on nothing but `S`, and it was recorded on a stream that never captures: asking about
//! it (`hipEventQuery`) or waiting for it never touches a capture of `S` (clr records an event's
//! stream at each `hipEventRecord` and invalidates a capture of that stream when the event is
//! queried or waited for, hip_event.cpp). A call takes a pair whose `done` has passed, asking
//! without waiting; else allocates one more, up to [`MAX_TABLE_SLOTS`] per device; only when all
//! are busy does it wait, and then only for a pair its own stream used last, with the device's
//! state unlocked. So no call waits for another stream, and nothing is freed while the process
//! runs: `hipFree` waits for every stream of the device (clr's `ihipFree`), which may never end
//! while another stream waits for something. There are at most [`MAX_LANES`] lanes per device;
//! a new stream takes over the least recently used idle one, or gets the per-rect copies when
//! none is idle.
//!
//! With `synchronize`, either path first asks whether the stream is capturing a graph and
//! refuses a capturing one before anything is enqueued: the call would end with
//! `hipStreamSynchronize`, which is not allowed during capture.

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::copy_kernel::{BLOCK_THREADS, KERNEL_NAME, KernelArgs, KernelTable, block_limit};
use super::{CopyEngine, CopyJob, CopyPath, SendOptions};
use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod lib_cuda;
#[cfg(feature = "hip")]
mod lib_hip;
#[cfg(feature = "cuda")]
pub use lib_cuda::LibCuda;
#[cfg(feature = "hip")]
pub use lib_hip::LibHip;

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
    #[cfg(test)]
    pub const ERROR_NO_DEVICE: GpuStatus = GpuStatus(100);
    /// `hipErrorInvalidDevice`: what other calls return when there is no device, and what a launch
    /// returns when its function is not loaded on the stream's device.
    #[cfg(test)]
    pub const ERROR_INVALID_DEVICE: GpuStatus = GpuStatus(101);
    /// `hipErrorCapturedEvent`: an event last recorded on a stream that is now capturing was
    /// queried or waited for (and the capture invalidated).
    #[cfg(test)]
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
/// `stream`, with `args` as the kernel's whole argument buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    /// `hipFunction_t` of the copy kernel.
    pub function: *mut c_void,
    /// Blocks in x (tiles of rows) and y (buffers).
    pub grid: (u32, u32),
    /// Threads per block ([`BLOCK_THREADS`]).
    pub block: u32,
    /// `hipStream_t`; NULL is the null stream.
    pub stream: *mut c_void,
    /// The kernel's argument.
    pub args: KernelArgs,
}

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

/// "hipErrorNoDevice (100)": the runtime's name for a status and its number, which stays
/// meaningful when a newer runtime returns a code this library has never heard of.
pub(crate) fn describe<R: GpuRuntime + ?Sized>(runtime: &R, status: GpuStatus) -> String {
    format!("{} ({})", runtime.error_name(status), status.0)
}

/// The words of a failed call's message around its status, `{call}{args} returned
/// {status}{note}`, and the buffer and rect of the job it belongs to.
#[derive(Debug, Default)]
pub(crate) struct Context {
    args: String,
    note: String,
    buffer: Option<usize>,
    rect: Option<usize>,
}

impl Context {
    /// The call's arguments as the message shows them, e.g. "(stream 0x0)".
    pub(crate) fn args(args: impl Into<String>) -> Self {
        Context {
            args: args.into(),
            ..Context::default()
        }
    }

    /// What follows the status, e.g. " (the copy kernel is loaded per device)".
    pub(crate) fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }

    /// The buffer pair, and the rect if any, the failure belongs to.
    fn at(mut self, buffer: usize, rect: Option<usize>) -> Self {
        self.buffer = Some(buffer);
        self.rect = rect;
        self
    }

    /// The error for `call` failing (or refused) with `status`, whose description comes last
    /// but one.
    fn error(self, call: &'static str, status: GpuStatus, described: &str) -> Error {
        Error::Gpu {
            call,
            status: status.0,
            message: format!("{call}{} returned {described}{}", self.args, self.note),
            buffer: self.buffer,
            rect: self.rect,
        }
    }
}

/// A runtime call's result as the crate's: [`Error::Gpu`] when the call failed.
pub(crate) trait GpuResult<T> {
    /// The value, or the error naming `call`, its status and what `context` (built only on
    /// failure) says.
    fn or_gpu<R: GpuRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T>;
}

impl<T> GpuResult<T> for Result<T, GpuStatus> {
    fn or_gpu<R: GpuRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T> {
        self.map_err(|status| context().error(call, status, &describe(runtime, status)))
    }
}

/// What a failed load of the copy kernel with `status` most likely means, and what to do.
fn load_hint(api: &Api, status: GpuStatus) -> String {
    match status.0 {
        2 => "the device's memory is full (the driver needs room to load the module: a KV cache \
              or pool may hold all of it); free some, and mori-tp loads the kernel on a later \
              call"
            .to_string(),
        221 if api.backend == "CUDA" => "the driver's PTX JIT compiler \
              (libnvidia-ptxjitcompiler.so.1) is missing: it ships with the NVIDIA driver, and a \
              container needs the driver's compute libraries mounted (NVIDIA_DRIVER_CAPABILITIES \
              with compute)"
            .to_string(),
        s if PERMANENT_LOAD_FAILURES.contains(&s) => api.kernel_load_note.to_string(),
        _ => format!(
            "an unexpected failure of {}; mori-tp tries again on a later call",
            api.module_load_data
        ),
    }
}

/// Ok with the device count when the runtime has at least one device, else why not.
pub(crate) fn require_device<R: GpuRuntime>(runtime: &R) -> Result<i32> {
    let api = runtime.api();
    match runtime.device_count() {
        Ok(count) if count > 0 => Ok(count),
        Ok(count) => Err(Error::BackendUnavailable {
            reason: format!(
                "the {0} backend needs a {0} device, but {1} reports {count}",
                api.backend, api.device_count
            ),
        }),
        Err(status) => Err(Error::BackendUnavailable {
            reason: format!(
                "the {0} backend needs a {0} device, but {1} returned {2} ({3})",
                api.backend,
                api.device_count,
                describe(runtime, status),
                api.no_device
            ),
        }),
    }
}

/// A byte count or offset of a validated rect as `size_t`: lossless, because the job checked
/// every capacity against `isize::MAX` and every rect lies inside its buffers.
fn size(value: u64) -> usize {
    value as usize
}

/// Locks `mutex`, also after a panic elsewhere (the state stays consistent between calls).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The calling thread's capture mode while the library calls the runtime: relaxed from
/// [`Relaxed::enter`] until the value is dropped, which gives the thread its own mode back.
#[must_use = "the relaxed mode lasts while the value lives"]
pub(crate) struct Relaxed<'a, R: GpuRuntime + ?Sized> {
    runtime: &'a R,
    previous: CaptureMode,
}

impl<'a, R: GpuRuntime + ?Sized> Relaxed<'a, R> {
    /// Makes the calling thread's capture mode relaxed, so that none of the library's runtime
    /// calls is refused for, or breaks, a graph capture of another thread.
    pub(crate) fn enter(runtime: &'a R) -> Result<Self> {
        let previous = runtime.exchange_capture_mode(CaptureMode::RELAXED).or_gpu(
            runtime,
            runtime.api().exchange_capture_mode,
            || {
                Context::args(format!("({})", CaptureMode::RELAXED.name(runtime.api()))).note(
                    " (mori-tp makes its own runtime calls in the relaxed capture mode, so that \
                     they never break another thread's graph capture)",
                )
            },
        )?;
        Ok(Relaxed { runtime, previous })
    }
}

impl<R: GpuRuntime + ?Sized> Drop for Relaxed<'_, R> {
    fn drop(&mut self) {
        if let Err(status) = self.runtime.exchange_capture_mode(self.previous) {
            log::warn!(
                "mori-tp: restoring the thread's capture mode ({}) with {} returned {}",
                self.previous.name(self.runtime.api()),
                self.runtime.api().exchange_capture_mode,
                describe(self.runtime, status)
            );
        }
    }
}

/// One table buffer pair of a device: pinned host memory the table is written into, device
/// memory it is uploaded to, and the event recorded on a lane's relay stream after the last
/// launch that read them. Addresses and handles as integers, so that the state is `Send`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    device: usize,
    host: usize,
    /// Table bytes both buffers hold.
    capacity: usize,
    /// `hipEventRecord`ed on the relay of the lane of `stream` after the pair's last use.
    done: usize,
    /// The caller's stream of the pair's last use (None: unused since made or since that
    /// stream's lane was handed on, so idle).
    stream: Option<usize>,
    /// When the pair was last used (the device's call counter).
    used: u64,
}

/// A caller's stream with table buffers in flight on one device: its relay, a non-blocking
/// stream of the library that waits for the caller's stream and records the pairs' `done`
/// events, and the event the caller's stream records for the relay to wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lane {
    /// The caller's stream (0: the NULL stream).
    stream: usize,
    relay: usize,
    mark: usize,
    used: u64,
}

/// How the kernel reaches a buffer base found to be device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// Memory of the launch's own device.
    Local,
    /// Another device's memory that this device can reach once peer access is enabled
    /// (`hipDeviceCanAccessPeer`), which the library cannot see.
    Peer,
}

/// Buffers the library allocated and no longer uses, kept for later pairs and lanes instead of
/// freed (`hipFree` waits for every stream of the device).
#[derive(Debug, Default)]
struct Spares {
    device: Vec<(usize, usize)>,
    host: Vec<(usize, usize)>,
    events: Vec<usize>,
}

impl Spares {
    /// The smallest spare buffer of `list` of at least `size` bytes, taken out.
    fn take(list: &mut Vec<(usize, usize)>, size: usize) -> Option<(usize, usize)> {
        let at = (0..list.len())
            .filter(|&i| list[i].1 >= size)
            .min_by_key(|&i| list[i].1)?;
        Some(list.swap_remove(at))
    }
}

/// The copy kernel's state on one device: its function (the module stays loaded for the
/// process), the reset sentinel, the table buffer pairs and lanes, and the buffer bases already
/// found to be device memory. Nothing is ever freed: a stream may still run the kernel, and
/// `hipFree` would wait for every stream of the device.
#[derive(Debug)]
pub struct DeviceKernel {
    function: usize,
    /// The reset sentinel's address and the size the runtime reported for it.
    sentinel: Option<(usize, usize)>,
    slots: Vec<Slot>,
    /// Pairs whose fence could not be recorded, with the stream of that call: nobody can tell
    /// when they are idle, so they are out of the ring (and do not count against
    /// [`MAX_TABLE_SLOTS`]) until a later call on the same stream records its fence: a stream
    /// runs its work in order, so a fence recorded after that call's passes after the broken
    /// call too, and the pair comes back with it.
    broken: Vec<Slot>,
    lanes: Vec<Lane>,
    spares: Spares,
    /// Calls that took a pair (orders the pairs and lanes by last use).
    calls: u64,
    /// Bases found to be device memory, with the identity of the allocation they were found in
    /// ([`GpuRuntime::allocation_id`]): a base whose allocation changed is classified again.
    known: HashMap<usize, (u64, Reach)>,
    /// An event of this device, recorded on a caller's stream to check that the stream belongs
    /// to the device where the runtime cannot say (no `hipStreamGetDevice`); made on first use.
    probe: Option<usize>,
    /// The blocks the device runs at once ([`GpuRuntime::resident_blocks`]): the persistent
    /// grid's limit.
    resident: Option<u32>,
}

/// Base addresses remembered as reachable per device before the set starts over.
const MAX_REMEMBERED_BASES: usize = 1 << 16;

/// What the cache holds for a device.
#[derive(Debug)]
enum Entry {
    Ready(Arc<Mutex<DeviceKernel>>),
    /// The load failed for a reason that does not change while the process runs (the image has
    /// no code for the device, or no kernel): the error is returned again without retrying.
    Failed(Error),
}

/// The kernel of a device: its state, or why it cannot be loaded there now.
#[derive(Debug)]
enum Kernel {
    Ready(Arc<Mutex<DeviceKernel>>),
    Unloadable(Error),
}

impl Entry {
    fn kernel(&self) -> Kernel {
        match self {
            Entry::Ready(kernel) => Kernel::Ready(kernel.clone()),
            Entry::Failed(error) => Kernel::Unloadable(error.clone()),
        }
    }
}

/// Why a kernel call took the per-rect copies instead ([`GpuCounters`] counts each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// The kernel could not be loaded on the device (now, or for the process).
    Unloadable,
    /// Every lane or table buffer of the device was busy.
    Busy,
    /// The stream belongs to a context other than its device's primary one (CUDA).
    Context,
    /// The stream is capturing a graph, and the launch could not be captured safely.
    Capture,
    /// A buffer is memory the kernel may not reach, or the stream's device is not known.
    Memory,
}

impl Fallback {
    const ALL: [Fallback; 5] = [
        Fallback::Unloadable,
        Fallback::Busy,
        Fallback::Context,
        Fallback::Capture,
        Fallback::Memory,
    ];
}

/// What one runtime's engines did in this process ([`KernelCache::counters`]): the copy
/// kernel's launches, the calls that took the per-rect copies instead of it (in all and per
/// [`Fallback`]), and the failed loads of the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Copy-kernel launches that the runtime accepted.
    pub kernel_launches: u64,
    /// Calls that chose or asked for the kernel and took the per-rect copies: the sum of the
    /// five below.
    pub fallbacks: u64,
    /// ... because the kernel could not be loaded.
    pub fallbacks_unloadable: u64,
    /// ... because every lane or table buffer of the device was busy.
    pub fallbacks_busy: u64,
    /// ... because the stream is of a context other than its device's primary one.
    pub fallbacks_context: u64,
    /// ... because the stream was capturing a graph.
    pub fallbacks_capture: u64,
    /// ... because a buffer was memory the kernel may not reach (or the stream's device unknown).
    pub fallbacks_memory: u64,
    /// Failed loads of the copy kernel (each retried one counts).
    pub load_failures: u64,
}

/// The counters behind [`GpuCounters`], and whether each fallback was logged yet.
#[derive(Debug, Default)]
struct Counters {
    launches: AtomicU64,
    fallbacks: [AtomicU64; 5],
    logged: [AtomicBool; 5],
    load_failures: AtomicU64,
}

/// The copy kernel's state per device, for the life of the process, and its counters.
#[derive(Debug, Default)]
pub struct KernelCache {
    devices: Mutex<Vec<(i32, Entry)>>,
    counters: Counters,
}

/// Statuses of a load that no retry changes: the image itself does not suit the device
/// (`hipErrorInvalidImage` / `CUDA_ERROR_INVALID_IMAGE` 200, `..NoBinaryForGpu` 209,
/// `..InvalidKernelFile` / `CUDA_ERROR_INVALID_PTX` 218, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`
/// 222; HIP and CUDA share these numbers). Every other failure (out of memory above all) is
/// tried again on a later call.
const PERMANENT_LOAD_FAILURES: [i32; 4] = [200, 209, 218, 222];

impl KernelCache {
    /// An empty cache.
    pub const fn new() -> Self {
        KernelCache {
            devices: Mutex::new(Vec::new()),
            counters: Counters {
                launches: AtomicU64::new(0),
                fallbacks: [const { AtomicU64::new(0) }; 5],
                logged: [const { AtomicBool::new(false) }; 5],
                load_failures: AtomicU64::new(0),
            },
        }
    }

    /// The counters now.
    pub fn counters(&self) -> GpuCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let per = |f: Fallback| get(&c.fallbacks[f as usize]);
        GpuCounters {
            kernel_launches: get(&c.launches),
            fallbacks: c.fallbacks.iter().map(get).sum(),
            fallbacks_unloadable: per(Fallback::Unloadable),
            fallbacks_busy: per(Fallback::Busy),
            fallbacks_context: per(Fallback::Context),
            fallbacks_capture: per(Fallback::Capture),
            fallbacks_memory: per(Fallback::Memory),
            load_failures: get(&c.load_failures),
        }
    }

    /// Counts one fallback for `why`, and logs the first of each kind as a warning (later ones
    /// at the debug level), so that no path change is silent.
    fn fall_back(&self, kind: Fallback, api: &Api, stream: *mut c_void, why: &str) {
        debug_assert!(Fallback::ALL.contains(&kind));
        let c = &self.counters;
        c.fallbacks[kind as usize].fetch_add(1, Ordering::Relaxed);
        if !c.logged[kind as usize].swap(true, Ordering::Relaxed) {
            log::warn!(
                "mori-tp ({}): stream {stream:p} takes the per-rect copies instead of the copy \
                 kernel: {why} (logged once per reason; mori_tp_gpu_counters_get counts every \
                 such call)",
                api.backend
            );
        } else {
            log::debug!("stream {stream:p}: per-rect copies instead of the copy kernel: {why}");
        }
    }

    /// Counts a launch the runtime accepted.
    fn launched(&self) {
        self.counters.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// What is cached for `device`, if anything.
    fn cached(&self, device: i32) -> Option<Kernel> {
        lock(&self.devices)
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, entry)| entry.kernel())
    }

    /// The kernel cached for `device`, or the one `load` returns, which is cached. A failure
    /// is cached only when no retry can change it ([`PERMANENT_LOAD_FAILURES`], or a module
    /// without the kernel); any other (out of memory, a missing JIT library) is returned and
    /// the next call loads again. `load` is the load itself (`hipModuleLoadData`,
    /// `hipModuleGetFunction`); what surrounds it (making the device current) stays outside.
    /// Loads are serialised: they are rare.
    fn get_or_load(
        &self,
        device: i32,
        api: &Api,
        load: impl FnOnce() -> Result<DeviceKernel>,
    ) -> Kernel {
        let mut devices = lock(&self.devices);
        if let Some((_, entry)) = devices.iter().find(|(d, _)| *d == device) {
            return entry.kernel();
        }
        let entry = match load() {
            Ok(kernel) => Entry::Ready(Arc::new(Mutex::new(kernel))),
            Err(mut error) => {
                self.counters.load_failures.fetch_add(1, Ordering::Relaxed);
                let permanent = match &error {
                    Error::Gpu { call, status, .. } => {
                        *call == api.module_get_function || PERMANENT_LOAD_FAILURES.contains(status)
                    }
                    _ => false,
                };
                if let Error::Gpu { message, .. } = &mut error {
                    message.push_str(if permanent {
                        " (no retry can change this: mori-tp does not load the copy kernel on \
                         this device again in this process)"
                    } else {
                        " (mori-tp tries to load the copy kernel again on the next call)"
                    });
                }
                log::warn!("mori-tp: {error}");
                if !permanent {
                    return Kernel::Unloadable(error);
                }
                Entry::Failed(error)
            }
        };
        let kernel = entry.kernel();
        devices.push((device, entry));
        kernel
    }

    /// Forgets `device`'s state if it is still `stale`, so that the next call loads afresh.
    fn forget(&self, device: i32, stale: &Arc<Mutex<DeviceKernel>>) {
        lock(&self.devices).retain(|(d, entry)| {
            !(*d == device && matches!(entry, Entry::Ready(k) if Arc::ptr_eq(k, stale)))
        });
    }
}

/// The device a kernel call runs on, and how the engine knows.
#[derive(Clone, Copy, Debug)]
struct LaunchDevice {
    /// The stream's device (the current one for the NULL stream, or when the runtime cannot
    /// say).
    device: i32,
    /// The calling thread's current device.
    current: i32,
    /// True when the stream is not NULL but the runtime has no `hipStreamGetDevice`, so
    /// `device` is the current device by assumption, which [`GpuEngine::probe_stream_device`]
    /// checks before anything is allocated or issued.
    assumed: bool,
}

/// What a kernel call found it can do before anything is allocated or enqueued.
enum Plan {
    /// Launch on the lane at this index with the pair at that index, idle now (the state stays
    /// locked until the fence is recorded).
    Launch { lane: usize, slot: usize },
    /// The per-rect copies, for this reason.
    PerRect(Fallback, String),
}

/// Issues one copy-kernel launch per call or one `hipMemcpy2DAsync` per (buffer, rect), on one
/// stream and, when asked, waits for the stream before returning.
#[derive(Debug)]
pub struct GpuEngine<R: GpuRuntime> {
    runtime: R,
    stream: *mut c_void,
    synchronize: bool,
    path: CopyPath,
    max_blocks: u32,
}

impl<R: GpuRuntime> GpuEngine<R> {
    /// An engine on `runtime` for `options.stream`, `options.synchronize` and `options.path`;
    /// refuses with [`Error::BackendUnavailable`] when the runtime has no device.
    /// `options.backend` is not consulted: choosing the backend is [`super::open_engine`]'s job.
    pub fn new(runtime: R, options: &SendOptions) -> Result<Self> {
        refuse_forked_child(runtime.api())?;
        require_device(&runtime)?;
        arm_fork_guard();
        Ok(GpuEngine {
            runtime,
            stream: options.stream,
            synchronize: options.synchronize,
            path: options.path,
            max_blocks: options.max_blocks,
        })
    }

    /// The runtime the engine calls (a test reads its record here).
    #[cfg(test)]
    pub(crate) fn runtime(&self) -> &R {
        &self.runtime
    }

    /// The engine for another stream, path or wait on the same runtime (a test sends on several
    /// streams through one recorder).
    #[cfg(test)]
    pub(crate) fn set_options(&mut self, options: &SendOptions) {
        self.stream = options.stream;
        self.synchronize = options.synchronize;
        self.path = options.path;
        self.max_blocks = options.max_blocks;
    }

    /// The names of the runtime's calls, for messages.
    fn api(&self) -> &'static Api {
        self.runtime.api()
    }

    /// The caller's stream as a lane key.
    fn stream_key(&self) -> usize {
        self.stream as usize
    }

    /// True when the caller asked for the kernel (`MORI_SEND_COPY_KERNEL`), so that what keeps
    /// it from running is an error rather than a reason for the per-rect copies.
    fn kernel_required(&self) -> bool {
        self.path == CopyPath::Kernel
    }

    /// One `hipMemcpy2DAsync` per (buffer, rect), then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`].
    unsafe fn run_rects(&self, job: &CopyJob<'_>) -> Result<()> {
        let (buffers, rects) = (job.num_buffers(), job.num_rects());
        self.check_pitches(job)?;
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (index, rect) in job.rects().enumerate() {
                // wrapping_add: the bases are usually device addresses, which Rust knows nothing
                // of; the job validated that every offset lies inside its buffer.
                let args = Memcpy2dAsync {
                    dst: dst.wrapping_add(size(rect.dst_offset)).cast(),
                    dpitch: size(rect.dst_pitch),
                    src: src.wrapping_add(size(rect.src_offset)).cast(),
                    spitch: size(rect.src_pitch),
                    width: size(rect.width),
                    height: size(rect.height),
                    kind: HIP_MEMCPY_DEFAULT,
                    stream: self.stream,
                };
                // SAFETY: the caller guarantees every row of the rect is addressable until the
                // stream has run it; the stream is the caller's, as documented on
                // MoriSendOptions.
                unsafe { self.runtime.memcpy_2d_async(args) }
                    .or_gpu(&self.runtime, self.api().memcpy_2d_async, || {
                        Context::args(format!(
                            "(dst {:p}, dpitch {}, src {:p}, spitch {}, width {}, height {}, \
                             {}, stream {:p})",
                            args.dst,
                            args.dpitch,
                            args.src,
                            args.spitch,
                            args.width,
                            args.height,
                            self.api().memcpy_2d_kind,
                            args.stream
                        ))
                        .note(format!(
                            " (buffer {buffer} of {buffers}, rect {index} of {rects}: {rect:?})"
                        ))
                        .at(buffer, Some(index))
                    })
                    .map_err(|error| self.also_finish(error))?;
            }
        }
        self.finish()
    }

    /// Refuses, before anything is enqueued, a job with a rect whose pitch the runtime's 2D
    /// copy does not take (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`), naming the rect, its pitches and
    /// the limit.
    fn check_pitches(&self, job: &CopyJob<'_>) -> Result<()> {
        let Some(max) =
            self.runtime
                .max_pitch()
                .or_gpu(&self.runtime, self.api().memcpy_2d_async, || {
                    Context::default().note(" (asking the device's largest 2D-copy pitch)")
                })?
        else {
            return Ok(());
        };
        let over = job
            .rects()
            .enumerate()
            .find(|(_, rect)| size(rect.src_pitch) > max || size(rect.dst_pitch) > max);
        let Some((index, rect)) = over else {
            return Ok(());
        };
        let refused = GpuStatus::ERROR_INVALID_VALUE;
        Err(Context::args(format!(
            "(dpitch {}, spitch {}, width {}, height {})",
            rect.dst_pitch, rect.src_pitch, rect.width, rect.height
        ))
        .note(format!(
            ": rect {index} of {} has a pitch above the device's largest 2D-copy pitch, {max} \
             bytes (the driver's maximum pitch attribute), which the per-rect copies cannot \
             take; refused as {} before anything was enqueued: send with \
             MORI_SEND_COPY_KERNEL (the kernel has no such limit)",
            job.num_rects(),
            describe(&self.runtime, refused)
        ))
        .at(0, Some(index))
        .error(self.api().memcpy_2d_async, refused, self.api().success))
    }

    /// Waits for the stream when the caller asked to synchronize.
    fn finish(&self) -> Result<()> {
        if !self.synchronize {
            return Ok(());
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        unsafe { self.runtime.stream_synchronize(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_synchronize,
            || {
                Context::args(format!("(stream {:p})", self.stream))
                    .note(" (a copy on the stream failed, or earlier work on it did)")
            },
        )
    }

    /// After a failure: wait for what was issued when the caller asked to synchronize (they may
    /// free the buffers as soon as we return), naming a failing wait too. The error keeps its
    /// fields.
    fn also_finish(&self, mut error: Error) -> Error {
        if let (Error::Gpu { message, .. }, Err(Error::Gpu { message: also, .. })) =
            (&mut error, self.finish())
        {
            message.push_str("; then ");
            message.push_str(&also);
        }
        error
    }

    /// True when the caller's stream is capturing a graph (the NULL stream never is).
    fn stream_is_capturing(&self) -> Result<bool> {
        if self.stream.is_null() {
            return Ok(false);
        }
        // SAFETY: the caller's live stream, as documented on MoriSendOptions.
        unsafe { self.runtime.stream_is_capturing(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_is_capturing,
            || Context::args(format!("(stream {:p})", self.stream)),
        )
    }

    /// With `synchronize`: whether the stream is capturing, refusing a capturing one before
    /// anything is enqueued, since the wait at the end (`hipStreamSynchronize`) is not allowed
    /// during capture (the runtime fails it and the capture with it). `None` without
    /// `synchronize` (nothing asked).
    fn refuse_synchronize_while_capturing(&self) -> Result<Option<bool>> {
        if !self.synchronize {
            return Ok(None);
        }
        if !self.stream_is_capturing()? {
            return Ok(Some(false));
        }
        let refused = GpuStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED;
        Err(Context::args(format!("(stream {:p})", self.stream))
            .note(format!(
                ": the stream is capturing a graph, and MORI_SEND_SYNCHRONIZE would end the call \
                 with {}, which a capturing stream does not allow (it fails, and the capture \
                 with it); refused as {} before anything was enqueued: send without \
                 MORI_SEND_SYNCHRONIZE while capturing, and wait for the graph's launch instead",
                self.api().stream_synchronize,
                describe(&self.runtime, refused)
            ))
            .error(
                self.api().stream_is_capturing,
                refused,
                self.api().capture_status_active,
            ))
    }

    /// The device the kernel runs on: the stream's.
    fn launch_device(&self) -> Result<LaunchDevice> {
        let current =
            self.runtime
                .current_device()
                .or_gpu(&self.runtime, self.api().get_device, || {
                    Context::default().note(" (the copy kernel is loaded per device)")
                })?;
        if self.stream.is_null() {
            return Ok(LaunchDevice {
                device: current,
                current,
                assumed: false,
            });
        }
        // SAFETY: the caller's live stream, as documented on MoriSendOptions.
        let device = unsafe { self.runtime.stream_device(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_get_device,
            || {
                Context::args(format!("(stream {:p})", self.stream))
                    .note(self.api().stream_get_device_note)
            },
        )?;
        Ok(LaunchDevice {
            device: device.unwrap_or(current),
            current,
            assumed: device.is_none(),
        })
    }

    /// `f` with `at.device` current: the caller's current device when it is that one, else
    /// switched to for `f` (a module loads, and memory, streams and events are created, for the
    /// current device) and switched back, whatever `f` returned.
    fn on_device<T>(&self, at: LaunchDevice, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if at.device == at.current {
            return f();
        }
        let switch = |to: i32, why: &'static str| {
            self.runtime
                .set_device(to)
                .or_gpu(&self.runtime, self.api().set_device, || {
                    Context::args(format!("({to})")).note(format!(" ({why})"))
                })
        };
        switch(
            at.device,
            "to set up the copy kernel on the stream's device",
        )?;
        let done = f();
        let restored = switch(at.current, "back to the caller's current device");
        // A failed restore matters more: the caller's device selection is wrong.
        restored.and(done)
    }

    /// Loads the kernel on the current device, `device`; unloads the module again when the
    /// function is not in it.
    fn load_here(&self, device: i32) -> Result<DeviceKernel> {
        let image = self.runtime.kernel_image();
        // SAFETY: the image is the kernel bundle build.rs embedded (or the test runtime's).
        let module = unsafe { self.runtime.module_load_data(image.bytes) }.map_err(|status| {
            let log = self.runtime.module_load_log();
            let log = log.trim();
            let log = if log.is_empty() {
                String::new()
            } else {
                format!("; the driver's log: {log}")
            };
            Context::args(format!(
                "(copy kernel, {} bytes) on device {device}",
                image.bytes.len()
            ))
            .note(format!(
                " (this libmori_tp's copy kernel holds {} {}; {}{log})",
                self.api().kernel_image_what,
                image.targets,
                load_hint(self.api(), status)
            ))
            .error(
                self.api().module_load_data,
                status,
                &describe(&self.runtime, status),
            )
        })?;
        // SAFETY: `module` was just loaded, on the current device.
        let function = unsafe { self.runtime.module_get_function(module, KERNEL_NAME) };
        let function = function.or_gpu(&self.runtime, self.api().module_get_function, || {
            Context::args(format!("({KERNEL_NAME:?}) on device {device}"))
        });
        match function {
            Ok(function) => Ok(DeviceKernel {
                function: function as usize,
                // SAFETY: the function just looked up, on the current device.
                resident: unsafe { self.runtime.resident_blocks(function) },
                sentinel: None,
                slots: Vec::new(),
                broken: Vec::new(),
                lanes: Vec::new(),
                spares: Spares::default(),
                calls: 0,
                known: HashMap::new(),
                probe: None,
            }),
            Err(error) => {
                // SAFETY: loaded above, on this device; nothing runs it.
                if let Err(status) = unsafe { self.runtime.module_unload(module) } {
                    log::warn!(
                        "{} after a failed {} returned {}",
                        self.api().module_unload,
                        self.api().module_get_function,
                        describe(&self.runtime, status)
                    );
                }
                Err(error)
            }
        }
    }

    /// The device's kernel, loaded now if need be, with its reset sentinel allocated, or checked
    /// to be alive: `hipDeviceReset` frees every allocation of the device (the sentinel, the
    /// table buffers), destroys its streams (the relays) and invalidates the module, so a dead
    /// sentinel makes the engine forget the state and load afresh.
    fn device_kernel(&self, at: LaunchDevice) -> Result<Kernel> {
        let cache = self.runtime.kernel_cache();
        // Only the load's own failure is cached: a failed hipSetDevice around it (to the
        // stream's device, or back) is returned, and the next call tries again. A failed switch
        // back after a good load returns its error with the kernel cached.
        let load = || match cache.cached(at.device) {
            Some(cached) => Ok(cached),
            None => self.on_device(at, || {
                Ok(cache.get_or_load(at.device, self.api(), || self.load_here(at.device)))
            }),
        };
        for _ in 0..2 {
            let kernel = match load()? {
                Kernel::Ready(kernel) => kernel,
                unloadable => return Ok(unloadable),
            };
            let mut state = lock(&kernel);
            let Some((base, allocated)) = state.sentinel else {
                // Allocated under the state's lock: one sentinel per state. Its failure is
                // returned, not cached; the next call allocates again.
                state.sentinel = Some(self.on_device(at, || self.allocate_sentinel(at.device))?);
                drop(state);
                return Ok(Kernel::Ready(kernel));
            };
            // After hipDeviceReset the runtime no longer knows the sentinel, or knows the
            // address as part of an allocation of another size.
            let alive = self
                .runtime
                .address_range(base as *mut c_void)
                .is_ok_and(|range| range == (base, allocated));
            if alive {
                drop(state);
                return Ok(Kernel::Ready(kernel));
            }
            drop(state);
            log::debug!(
                "device {}: the copy kernel's reset sentinel is gone ({}?); loading the kernel \
                 again",
                at.device,
                self.api().device_reset
            );
            cache.forget(at.device, &kernel);
        }
        unreachable!("a state loaded afresh has no sentinel yet")
    }

    /// The reset sentinel of `device`, the current device: its address and the size the runtime
    /// reports for it. Kept (not freed) when the size cannot be read.
    fn allocate_sentinel(&self, device: i32) -> Result<(usize, usize)> {
        let base = self.runtime.malloc(RESET_SENTINEL_BYTES).or_gpu(
            &self.runtime,
            self.api().malloc,
            || {
                Context::args(format!(
                    "({RESET_SENTINEL_BYTES} bytes for the copy kernel's reset check on device \
                     {device})"
                ))
            },
        )?;
        let (_, allocated) = self.runtime.address_range(base).or_gpu(
            &self.runtime,
            self.api().address_range,
            || Context::args(format!("({base:p})")).note(" (the copy kernel's reset sentinel)"),
        )?;
        Ok((base as usize, allocated))
    }
    /// Where the runtime has no `hipStreamGetDevice`: records the device's probe event on the
    /// stream, which the runtime refuses (`hipErrorInvalidHandle`) when the stream belongs to
    /// another device, so that such a stream is refused before anything is allocated or issued
    /// for it, instead of failing at the launch.
    fn probe_stream_device(&self, state: &mut DeviceKernel, at: LaunchDevice) -> Result<()> {
        let event = match state.probe {
            Some(event) => event,
            None => {
                // The current device is `at.device` (assumed), so the event is that device's.
                let event = self.runtime.event_create().or_gpu(
                    &self.runtime,
                    self.api().event_create,
                    || {
                        Context::args(format!("({})", self.api().event_disable_timing)).note(
                            format!(" (the stream check's event on device {})", at.device),
                        )
                    },
                )? as usize;
                state.probe = Some(event);
                event
            }
        };
        // SAFETY: the device's probe event, never destroyed, and the caller's live stream.
        unsafe { self.runtime.event_record(event as *mut c_void, self.stream) }.or_gpu(
            &self.runtime,
            self.api().event_record,
            || {
                Context::args(format!(
                    "(an event of the current device {}, stream {:p})",
                    at.current, self.stream
                ))
                .note(format!(
                    ": this HIP runtime has no hipStreamGetDevice, so mori-tp checks that the \
                     stream belongs to the current device {} by recording an event of that \
                     device on it, which the runtime refuses for a stream of another device; \
                     with MORI_SEND_COPY_KERNEL, make the stream's device current",
                    at.current
                ))
            },
        )
    }

    /// Whether the kernel can reach every buffer of `job`: `Ok(true)` when it can, `Ok(false)`
    /// when [`CopyPath::Auto`] should take the per-rect copies instead, and with
    /// `MORI_SEND_COPY_KERNEL` an error naming the buffer. A base found to be device memory is
    /// remembered with its allocation's identity ([`GpuRuntime::allocation_id`]) and classified
    /// again when that identity changed (the address was freed and reused, for host memory or
    /// another device's) or cannot be told; host memory is asked about on every call.
    fn check_reachable(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        job: &CopyJob<'_>,
    ) -> Result<bool> {
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (side, base) in [("source", src as usize), ("destination", dst as usize)] {
                // A failure to tell the identity only costs the full check.
                let id = self
                    .runtime
                    .allocation_id(base as *const c_void, at.device)
                    .ok()
                    .flatten();
                let known = id.and_then(|id| {
                    state
                        .known
                        .get(&base)
                        .filter(|(known, _)| *known == id)
                        .map(|&(_, reach)| reach)
                });
                let reach = match known {
                    Some(reach) => Some(reach),
                    None => match self.check_base(at, side, buffer, base) {
                        Ok(reach) => {
                            match (reach, id) {
                                (Some(reach), Some(id)) => {
                                    if state.known.len() >= MAX_REMEMBERED_BASES {
                                        state.known.clear();
                                    }
                                    state.known.insert(base, (id, reach));
                                }
                                _ => {
                                    state.known.remove(&base);
                                }
                            }
                            reach
                        }
                        Err(error) if self.kernel_required() => return Err(error),
                        Err(error) => {
                            log::debug!("per-rect copies: {error}");
                            return Ok(false);
                        }
                    },
                };
                // The library cannot see whether peer access is enabled: without the flag, a
                // peer's memory gets the copies, which need no peer access.
                if reach == Some(Reach::Peer) && !self.kernel_required() {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Ok when the runtime knows `base` as memory a kernel on `at.device` addresses at `base`
    /// itself: `Some` for device memory (the launch device's own, or a peer's this device can
    /// access), `None` for host memory.
    fn check_base(
        &self,
        at: LaunchDevice,
        side: &str,
        buffer: usize,
        base: usize,
    ) -> Result<Option<Reach>> {
        let args = || format!("({side} buffer {buffer}, {base:#x})");
        let api = self.api();
        let advice = format!(
            "the copy kernel faults on memory it cannot reach, and the fault aborts the process; \
             pass device memory, {}'d memory or a {} address, or send without \
             MORI_SEND_COPY_KERNEL",
            api.host_malloc, api.host_get_device_pointer
        );
        let info = self
            .runtime
            .pointer_info(base as *const c_void, at.device)
            .or_gpu(&self.runtime, self.api().pointer_attributes, || {
                Context::args(args())
                    .note(format!(
                        ": the {} runtime does not know this memory (pageable host memory?); \
                         {advice}",
                        api.backend
                    ))
                    .at(buffer, None)
            })?;
        let why = if info.device_pointer.is_null() {
            "host memory that no device can address (not pinned)".to_string()
        } else if info.host_pointer as usize == base && info.device_pointer as usize != base {
            format!(
                "host memory registered with {}, which devices address at {:p}",
                api.host_register, info.device_pointer
            )
        } else if !info.host_pointer.is_null() {
            return Ok(None);
        } else if info.device == at.device {
            return Ok(Some(Reach::Local));
        } else {
            let can = self
                .runtime
                .can_access_peer(at.device, info.device)
                .or_gpu(&self.runtime, self.api().can_access_peer, || {
                    Context::args(format!("(device {}, peer {})", at.device, info.device))
                        .note(format!(
                            " (the {side} buffer {buffer} at {base:#x} is device {}'s memory)",
                            info.device
                        ))
                        .at(buffer, None)
                })?;
            if can {
                return Ok(Some(Reach::Peer));
            }
            format!(
                "memory of device {}, which a kernel on device {} cannot reach ({} says no)",
                info.device, at.device, api.can_access_peer
            )
        };
        // The runtime answered, but the kernel would fault: refused as an invalid value.
        let refused = GpuStatus::ERROR_INVALID_VALUE;
        Err(Context::args(args())
            .note(format!(
                ": {why}; refused as {}: {advice}",
                describe(&self.runtime, refused)
            ))
            .at(buffer, None)
            .error(api.pointer_attributes, refused, api.success))
    }

    /// The lane of the caller's stream on this device: its own, a new one, or the least
    /// recently used idle one taken over; `None` when every lane is busy.
    fn lane_for(&self, state: &mut DeviceKernel, at: LaunchDevice) -> Result<Option<usize>> {
        let key = self.stream_key();
        if let Some(lane) = state.lanes.iter().position(|l| l.stream == key) {
            return Ok(Some(lane));
        }
        if state.lanes.len() < MAX_LANES {
            let spares = &mut state.spares;
            let (mark, relay) = self.on_device(at, || {
                let mark = match spares.events.pop() {
                    Some(event) => event,
                    None => self.create_event("a lane's mark")?,
                };
                let relay = self.runtime.stream_create().or_gpu(
                    &self.runtime,
                    self.api().stream_create,
                    || {
                        Context::args(format!("({})", self.api().stream_non_blocking)).note(
                            format!(
                                " (the relay stream of stream {:p} on device {})",
                                self.stream, at.device
                            ),
                        )
                    },
                );
                match relay {
                    Ok(relay) => Ok((mark, relay as usize)),
                    Err(error) => {
                        spares.events.push(mark);
                        Err(error)
                    }
                }
            })?;
            state.lanes.push(Lane {
                stream: key,
                relay,
                mark,
                used: 0,
            });
            return Ok(Some(state.lanes.len() - 1));
        }
        let mut order: Vec<usize> = (0..state.lanes.len()).collect();
        order.sort_by_key(|&l| state.lanes[l].used);
        for lane in order {
            let old = state.lanes[lane].stream;
            if self.stream_idle(state, old)? {
                for slot in state.slots.iter_mut().filter(|s| s.stream == Some(old)) {
                    slot.stream = None;
                }
                state.lanes[lane].stream = key;
                return Ok(Some(lane));
            }
        }
        Ok(None)
    }

    /// True when every pair last used by `stream` is idle.
    fn stream_idle(&self, state: &DeviceKernel, stream: usize) -> Result<bool> {
        for slot in state.slots.iter().filter(|s| s.stream == Some(stream)) {
            if !self.slot_idle(slot)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// True when nothing reads `slot` any more: unused, or its `done` event has passed (asked
    /// without waiting; the event was recorded on a relay, which never captures).
    fn slot_idle(&self, slot: &Slot) -> Result<bool> {
        if slot.stream.is_none() {
            return Ok(true);
        }
        // SAFETY: the pair's event, created by this runtime and never destroyed.
        unsafe { self.runtime.event_query(slot.done as *mut c_void) }.or_gpu(
            &self.runtime,
            self.api().event_query,
            || Context::args("(a copy-kernel table buffer's event)"),
        )
    }

    /// An event of the current device, for `what`.
    fn create_event(&self, what: &str) -> Result<usize> {
        self.runtime
            .event_create()
            .map(|event| event as usize)
            .or_gpu(&self.runtime, self.api().event_create, || {
                Context::args(format!("({})", self.api().event_disable_timing))
                    .note(format!(" ({what})"))
            })
    }

    /// Where the call can launch: the stream's lane and an idle pair of at least `bytes`, or
    /// why not. In order: an idle pair that is big enough, the least recently used first; a new
    /// pair while the device has fewer than [`MAX_TABLE_SLOTS`]; an idle pair that is too small,
    /// replaced by a bigger one (the small one kept as a spare). When every pair is busy, the
    /// per-rect copies: the call never waits, least of all for its own stream, whose progress
    /// may depend on what the caller does after this call returns (a `cuStreamWaitValue32` on a
    /// flag the calling thread raises later would make such a wait a deadlock). Idleness is only
    /// asked (`hipEventQuery`), never waited for.
    fn plan_launch(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        bytes: usize,
    ) -> Result<Plan> {
        let Some(lane) = self.lane_for(state, at)? else {
            let why = format!(
                "all {MAX_LANES} lanes of device {} have copies in flight",
                at.device
            );
            return Ok(Plan::PerRect(Fallback::Busy, why));
        };
        let mut usable: Vec<usize> = (0..state.slots.len()).collect();
        usable.sort_by_key(|&i| state.slots[i].used);
        let (big, mut small): (Vec<usize>, Vec<usize>) = usable
            .into_iter()
            .partition(|&i| state.slots[i].capacity >= bytes);
        for &slot in &big {
            if self.slot_idle(&state.slots[slot])? {
                return Ok(Plan::Launch { lane, slot });
            }
        }
        let capacity = bytes.max(MIN_TABLE_BYTES).next_power_of_two();
        if state.slots.len() < MAX_TABLE_SLOTS {
            let spares = &mut state.spares;
            let (done, device, host, capacity) = self.on_device(at, || {
                let done = match spares.events.pop() {
                    Some(event) => event,
                    None => self.create_event("a table buffer's fence")?,
                };
                match self.allocate_pair(spares, at, capacity) {
                    Ok((device, host, capacity)) => Ok((done, device, host, capacity)),
                    Err(error) => {
                        spares.events.push(done);
                        Err(error)
                    }
                }
            })?;
            let slot = state.slots.len();
            state.slots.push(Slot {
                device,
                host,
                capacity,
                done,
                stream: None,
                used: 0,
            });
            return Ok(Plan::Launch { lane, slot });
        }
        small.sort_by_key(|&i| state.slots[i].capacity);
        for &slot in &small {
            if self.slot_idle(&state.slots[slot])? {
                let (device, host, capacity) =
                    self.on_device(at, || self.allocate_pair(&mut state.spares, at, capacity))?;
                let old = state.slots[slot];
                state.spares.device.push((old.device, old.capacity));
                state.spares.host.push((old.host, old.capacity));
                state.slots[slot] = Slot {
                    device,
                    host,
                    capacity,
                    ..old
                };
                return Ok(Plan::Launch { lane, slot });
            }
        }
        let own = state
            .slots
            .iter()
            .filter(|s| s.stream == Some(self.stream_key()))
            .count();
        let why = format!(
            "all {MAX_TABLE_SLOTS} table buffers of device {} are busy ({own} with this stream's \
             earlier calls, which it has not run yet); mori-tp never waits for a stream's \
             progress inside a call",
            at.device
        );
        Ok(Plan::PerRect(Fallback::Busy, why))
    }

    /// A table buffer pair of at least `capacity` bytes on the current device `at.device`, from
    /// the spares where one is big enough: its device and host buffers and the bytes both hold.
    /// What was allocated before a failing step is kept as a spare.
    fn allocate_pair(
        &self,
        spares: &mut Spares,
        at: LaunchDevice,
        capacity: usize,
    ) -> Result<(usize, usize, usize)> {
        let what = |size: usize| {
            move || {
                Context::args(format!(
                    "({size} bytes for the copy kernel's table on device {})",
                    at.device
                ))
            }
        };
        let device = match Spares::take(&mut spares.device, capacity) {
            Some(spare) => spare,
            None => (
                self.runtime.malloc(capacity).or_gpu(
                    &self.runtime,
                    self.api().malloc,
                    what(capacity),
                )? as usize,
                capacity,
            ),
        };
        let host = match Spares::take(&mut spares.host, capacity) {
            Some(spare) => Ok(spare),
            None => self
                .runtime
                .host_malloc(capacity)
                .map(|host| (host as usize, capacity))
                .or_gpu(&self.runtime, self.api().host_malloc, what(capacity)),
        };
        match host {
            // A spare bigger than asked for lends the pair its size.
            Ok(host) => Ok((device.0, host.0, device.1.min(host.1))),
            Err(error) => {
                spares.device.push(device);
                Err(error)
            }
        }
    }

    /// After the launch on the caller's stream: the lane's mark recorded there, the relay made
    /// to wait for it, and the pair's `done` recorded on the relay. Without its fence nobody can
    /// tell when the pair is idle: it leaves the ring until a later call on the same stream is
    /// fenced (see [`DeviceKernel::broken`]).
    fn fence(&self, state: &mut DeviceKernel, lane: usize, slot: usize) -> Result<()> {
        let Lane { relay, mark, .. } = state.lanes[lane];
        let done = state.slots[slot].done;
        // SAFETY: the lane's event and relay and the pair's event, created by this runtime on
        // the stream's device and never destroyed; the caller's live stream.
        let fenced = unsafe { self.runtime.event_record(mark as *mut c_void, self.stream) }
            .or_gpu(&self.runtime, self.api().event_record, || {
                Context::args(format!("(the lane's event, stream {:p})", self.stream))
                    .note(" (the copy-kernel table buffer's fence)")
            })
            .and_then(|()| {
                // SAFETY: as above.
                unsafe {
                    self.runtime
                        .stream_wait_event(relay as *mut c_void, mark as *mut c_void)
                }
                .or_gpu(&self.runtime, self.api().stream_wait_event, || {
                    Context::args(format!(
                        "(relay stream {relay:#x}, the lane's event of stream {:p}, 0)",
                        self.stream
                    ))
                })
            })
            .and_then(|()| {
                // SAFETY: as above.
                unsafe {
                    self.runtime
                        .event_record(done as *mut c_void, relay as *mut c_void)
                }
                .or_gpu(&self.runtime, self.api().event_record, || {
                    Context::args(format!("(a table buffer's event, relay stream {relay:#x})"))
                })
            });
        state.calls += 1;
        let calls = state.calls;
        state.lanes[lane].used = calls;
        let key = self.stream_key();
        let pair = &mut state.slots[slot];
        pair.used = calls;
        pair.stream = Some(key);
        if fenced.is_err() {
            // Out of the ring until a later fence on this stream passes after it.
            let pair = state.slots.swap_remove(slot);
            state.broken.push(pair);
            return fenced;
        }
        // Pairs broken by an earlier call on this stream: their events recorded on the relay
        // now, behind this call's mark, pass when the stream has run the broken calls too.
        let mut at = 0;
        while at < state.broken.len() {
            let pair = state.broken[at];
            if pair.stream != Some(key) {
                at += 1;
                continue;
            }
            // SAFETY: the pair's event and the lane's relay, as above.
            let recorded = unsafe {
                self.runtime
                    .event_record(pair.done as *mut c_void, relay as *mut c_void)
            };
            if recorded.is_err() {
                at += 1;
                continue;
            }
            let mut pair = state.broken.swap_remove(at);
            pair.used = calls;
            state.slots.push(pair);
        }
        fenced
    }

    /// The whole job as one kernel launch on the stream's device, or as per-rect copies where
    /// the launch could not be replayed from a graph (a capturing stream, when the table must be
    /// uploaded or the runtime does not capture kernel launches) and, without
    /// `MORI_SEND_COPY_KERNEL`, wherever the kernel cannot surely run; then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`]; with [`CopyPath::Kernel`], every buffer must also be memory
    /// the kernel can address (device memory, a peer's with access enabled, or host memory
    /// mapped into the device). `capturing` is whether the stream is capturing, when already
    /// asked.
    unsafe fn run_kernel(&self, job: &CopyJob<'_>, capturing: Option<bool>) -> Result<()> {
        let table = KernelTable::new(job)?;
        let (grid_x, _) = table.grid();
        if grid_x == 0 {
            return self.finish();
        }
        let capturing = match capturing {
            Some(capturing) => capturing,
            None => self.stream_is_capturing()?,
        };
        let per_rect = |kind: Fallback, why: &str| {
            self.runtime
                .kernel_cache()
                .fall_back(kind, self.api(), self.stream, why);
            // SAFETY: as the caller guarantees.
            unsafe { self.run_rects(job) }
        };
        if capturing {
            // A captured upload would keep reading the table buffer at every replay, long after
            // this call reused it; copy nodes keep nothing of the call. A launch whose table is
            // inside its argument keeps nothing of the library's either, where the runtime copies
            // the argument into the graph's node.
            if !table.is_inline() {
                return per_rect(
                    Fallback::Capture,
                    &format!(
                        "the stream is capturing a graph, and the table ({} bytes) does not fit in \
                     the kernel's argument",
                        table.table_len()
                    ),
                );
            }
            if !self.runtime.captures_kernel_launches() {
                return per_rect(
                    Fallback::Capture,
                    "the stream is capturing a graph, and this runtime does not capture kernel \
                     launches (HIP before 5.3)",
                );
            }
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        let foreign = unsafe { self.runtime.foreign_context(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_get_device,
            || Context::args(format!("(stream {:p})", self.stream)),
        )?;
        if foreign {
            let why = format!(
                "stream {:p} belongs to a context made with cuCtxCreate (or is the NULL stream \
                 while such a context is current), not to its device's primary context, where \
                 the copy kernel is loaded",
                self.stream
            );
            if !self.kernel_required() {
                return per_rect(Fallback::Context, &why);
            }
            let refused = GpuStatus(201);
            return Err(Context::args(format!("(stream {:p})", self.stream))
                .note(format!(
                    ": {why}; MORI_SEND_COPY_KERNEL refused as {} before anything was enqueued: \
                     send with flags 0 or MORI_SEND_MEMCPY2D (the per-rect copies), or on a \
                     stream of the primary context (as the CUDA runtime, PyTorch and CuPy make \
                     them)",
                    describe(&self.runtime, refused)
                ))
                .error(self.api().stream_get_device, refused, self.api().success));
        }
        let at = self.launch_device()?;
        if capturing && at.assumed {
            // The stream's device cannot be confirmed: an event recorded on a capturing stream
            // is captured before the runtime's check of its device (hipEventRecord_common,
            // hipamd src/hip_event.cpp), so the probe would pass for any stream.
            return per_rect(
                Fallback::Capture,
                "the stream is capturing a graph, and this runtime cannot say which device the \
                 stream belongs to",
            );
        }
        let kernel = match self.device_kernel(at)? {
            Kernel::Ready(kernel) => kernel,
            Kernel::Unloadable(error) if !self.kernel_required() => {
                return per_rect(Fallback::Unloadable, &error.to_string());
            }
            Kernel::Unloadable(error) => return Err(error),
        };
        let mut state = lock(&kernel);
        if at.assumed {
            match self.probe_stream_device(&mut state, at) {
                Ok(()) => {}
                Err(error) if !self.kernel_required() => {
                    drop(state);
                    return per_rect(Fallback::Memory, &error.to_string());
                }
                Err(error) => return Err(error),
            }
        }
        if !self.check_reachable(&mut state, at, job)? {
            drop(state);
            return per_rect(
                Fallback::Memory,
                "a buffer is memory the kernel may not reach",
            );
        }
        let limit = block_limit(self.max_blocks, state.resident);
        if table.is_inline() {
            let function = state.function;
            drop(state);
            // SAFETY: as the caller guarantees.
            return unsafe { self.launch_inline(&table, function, limit, at, capturing) };
        }
        let bytes = table.byte_len();
        let plan = self.plan_launch(&mut state, at, bytes)?;
        let (lane, slot) = match plan {
            Plan::Launch { lane, slot } => (lane, slot),
            Plan::PerRect(kind, why) => {
                drop(state);
                return per_rect(kind, &why);
            }
        };
        let pair = state.slots[slot];
        // SAFETY: the pair's pinned buffer holds `capacity >= bytes` bytes, and nothing reads it
        // (it is idle, and reserved to this call while the state is locked).
        table.write_to(unsafe { std::slice::from_raw_parts_mut(pair.host as *mut u8, bytes) });
        let launch = self.launch_of(&table, state.function, pair.device as u64, limit);
        // SAFETY: both buffers hold `bytes` bytes and stay untouched until the pair's fence,
        // recorded below, has passed.
        unsafe {
            self.runtime.memcpy_host_to_device_async(
                pair.device as *mut c_void,
                pair.host as *const c_void,
                bytes,
                self.stream,
            )
        }
        .or_gpu(&self.runtime, self.api().memcpy_htod_async, || {
            Context::args(format!(
                "({:#x}, copy kernel table {:#x}, {bytes} bytes{}, stream {:p})",
                pair.device,
                pair.host,
                self.api().memcpy_htod_kind,
                self.stream
            ))
        })
        .map_err(|error| self.also_finish(error))?;
        // SAFETY: the function was loaded on the stream's device; the caller vouches for the
        // buffers, and the table stays until the fence below has passed.
        let launched = unsafe { self.runtime.launch_kernel(&launch) };
        // Fenced even when the launch failed: the upload may still be reading the pair.
        let fenced = self.fence(&mut state, lane, slot);
        drop(state);
        self.launched(launched, &launch, &table, at)
            .and(fenced)
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }

    /// The launch of `function` (the copy kernel on the stream's device) for `table`, whose
    /// uploaded bytes are at device address `uploaded` (unused for a table inside the argument),
    /// on at most `limit` blocks (0: no limit; the budget and the persistent grid, see
    /// [`block_limit`]).
    fn launch_of(
        &self,
        table: &KernelTable,
        function: usize,
        uploaded: u64,
        limit: u32,
    ) -> KernelLaunch {
        let (args, grid) = table.launch(uploaded, limit);
        KernelLaunch {
            function: function as *mut c_void,
            grid,
            block: BLOCK_THREADS,
            stream: self.stream,
            args,
        }
    }

    /// A table inside the kernel's argument: the launch alone, with no table buffer, upload,
    /// lane or fence (the runtime copies the argument during the call, or into the graph's node
    /// while the stream captures), then the wait when asked. While capturing, the stream's
    /// device is current for the launch: HIP checks a captured launch's function against the
    /// current device (`ihipGraphAddKernelNode`).
    ///
    /// # Safety
    /// As for [`GpuEngine::run_kernel`]; `function` is the copy kernel loaded on `at.device`.
    unsafe fn launch_inline(
        &self,
        table: &KernelTable,
        function: usize,
        limit: u32,
        at: LaunchDevice,
        capturing: bool,
    ) -> Result<()> {
        let launch = self.launch_of(table, function, 0, limit);
        // SAFETY: the function was loaded on the stream's device; the argument holds the whole
        // table, and the caller vouches for the buffers.
        let launch_here = || unsafe { self.runtime.launch_kernel(&launch) };
        let launched = if capturing && at.device != at.current {
            self.on_device(at, || Ok(launch_here()))
                .map_err(|error| self.also_finish(error))?
        } else {
            launch_here()
        };
        self.launched(launched, &launch, table, at)
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }

    /// A launch's status as the crate's result, naming the grid, stream and table on failure.
    fn launched(
        &self,
        launched: Result<(), GpuStatus>,
        launch: &KernelLaunch,
        table: &KernelTable,
        at: LaunchDevice,
    ) -> Result<()> {
        if launched.is_ok() {
            self.runtime.kernel_cache().launched();
        }
        launched.or_gpu(&self.runtime, self.api().launch_kernel, || {
            let note = format!(
                " ({} buffers x {} rects, {} rows per buffer)",
                table.num_buffers(),
                table.num_rects(),
                table.rows_per_buffer()
            );
            Context::args(format!(
                "(mori_copy_kernel, grid ({}, {}, 1), block ({}, 1, 1), stream {:p}) on device {}",
                launch.grid.0, launch.grid.1, launch.block, launch.stream, at.device
            ))
            .note(note)
        })
    }
}

impl<R: GpuRuntime> CopyEngine for GpuEngine<R> {
    fn name(&self) -> &'static str {
        self.api().engine
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        refuse_forked_child(self.api())?;
        let _relaxed = Relaxed::enter(&self.runtime)?;
        let capturing = self.refuse_synchronize_while_capturing()?;
        let kernel = match self.path {
            CopyPath::Kernel => true,
            CopyPath::Memcpy2d => false,
            CopyPath::Auto => {
                job.num_buffers().saturating_mul(job.num_rects()) >= super::AUTO_KERNEL_MIN_COPIES
            }
        };
        if kernel {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_kernel(job, capturing) }
        } else {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_rects(job) }
        }
    }
}

/// Set in the child of a `fork` made after this process first made a GPU engine
/// ([`arm_fork_guard`]).
static FORKED: AtomicBool = AtomicBool::new(false);

/// The `pthread_atfork` child handler: only an atomic store, which is async-signal-safe.
extern "C" fn forked_child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Registers [`forked_child`] once per process, when the first GPU engine is made: a child
/// forked later may inherit the engine's locks held by a parent thread that is inside a call
/// (the device state stays locked across the upload, launch and fence), and the GPU driver's
/// state, which neither CUDA nor HIP supports in a forked child.
fn arm_fork_guard() {
    static ARMED: std::sync::Once = std::sync::Once::new();
    ARMED.call_once(|| {
        // SAFETY: a handler that only stores an atomic; no prepare or parent handler.
        let status = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if status != 0 {
            log::warn!("mori-tp: pthread_atfork returned {status}: a forked child is not refused");
        }
    });
}

/// [`Error::BackendUnavailable`] in a child forked after the parent used a GPU engine, before
/// any lock or runtime call (which could block for good on what a parent thread held at the
/// fork).
pub(crate) fn refuse_forked_child(api: &Api) -> Result<()> {
    if !FORKED.load(Ordering::SeqCst) {
        return Ok(());
    }
    // SAFETY: getpid and getppid always succeed.
    let (pid, parent) = unsafe { (libc::getpid(), libc::getppid()) };
    Err(Error::BackendUnavailable {
        reason: format!(
            "the {0} backend cannot be used in this process (pid {pid}): it was forked (parent \
             pid {parent}) after the parent had used the {0} backend, and neither the {0} \
             driver nor mori-tp's GPU state (whose locks a parent thread may have held at the \
             fork) is usable in a forked child; send from the parent, or start workers with \
             spawn or fork+exec before any GPU use",
            api.backend
        ),
    })
}

/// Without its cargo feature a GPU backend is a clear refusal, never a silent host fallback.
#[cfg_attr(all(feature = "hip", feature = "cuda"), allow(dead_code))]
fn not_built(api: &Api) -> Error {
    Error::BackendUnavailable {
        reason: format!(
            "the {} backend is not built in: this libmori_tp was compiled without the `{}` cargo \
             feature (rebuild with `cargo build --release --features {}`)",
            api.backend, api.feature, api.feature
        ),
    }
}

/// The counters of `backend`'s engines (its runtime's [`KernelCache`]).
pub(super) fn gpu_counters(backend: super::Backend) -> Result<GpuCounters> {
    match backend {
        #[cfg(feature = "cuda")]
        super::Backend::Cuda => Ok(lib_cuda::counters()),
        #[cfg(not(feature = "cuda"))]
        super::Backend::Cuda => Err(not_built(&CUDA_API)),
        #[cfg(feature = "hip")]
        super::Backend::Hip => Ok(lib_hip::counters()),
        #[cfg(not(feature = "hip"))]
        super::Backend::Hip => Err(not_built(&HIP_API)),
        other => Err(Error::BackendUnavailable {
            reason: format!("GPU counters are kept for the HIP and CUDA backends, not {other:?}"),
        }),
    }
}

/// Ok when the HIP engine can run: built in, and the runtime reports a device.
pub(super) fn hip_device_present() -> Result<()> {
    refuse_forked_child(&HIP_API)?;
    #[cfg(feature = "hip")]
    return require_device(&LibHip).map(|_| ());
    #[cfg(not(feature = "hip"))]
    Err(not_built(&HIP_API))
}

/// The HIP engine on `libamdhip64` for `options`.
pub(super) fn open_hip(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    #[cfg(feature = "hip")]
    return Ok(Box::new(GpuEngine::new(LibHip, options)?));
    #[cfg(not(feature = "hip"))]
    {
        let _ = options;
        Err(not_built(&HIP_API))
    }
}

/// Ok when the CUDA engine can run: built in, libcuda.so.1 loads with every function the
/// engine uses, and the driver reports a device.
pub(super) fn cuda_device_present() -> Result<()> {
    refuse_forked_child(&CUDA_API)?;
    #[cfg(feature = "cuda")]
    return LibCuda::load().and_then(|cuda| require_device(&cuda).map(|_| ()));
    #[cfg(not(feature = "cuda"))]
    Err(not_built(&CUDA_API))
}

/// The CUDA engine on `libcuda.so.1` for `options`.
pub(super) fn open_cuda(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    #[cfg(feature = "cuda")]
    return Ok(Box::new(GpuEngine::new(LibCuda::load()?, options)?));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = options;
        Err(not_built(&CUDA_API))
    }
}
