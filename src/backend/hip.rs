//! The HIP copy engine: one `hipMemcpy2DAsync` per (buffer, rect), or with
//! `SendOptions::copy_kernel` one launch of the copy kernel for the whole call, on the caller's
//! stream.
//!
//! The few runtime functions the engine calls sit behind
//! [`HipRuntime`](crate::backend::hip::HipRuntime), so that the argument marshalling is the same
//! code whether the runtime is the real `libamdhip64` (`LibHip`, the only implementation in the
//! library, built with the `hip` feature) or a recording stand-in that a test supplies to run the
//! byte-exact transfer tests on any machine.
//!
//! The engine never calls `hipSetDevice`: a copy runs on the device of the caller's stream (for
//! the NULL stream, the caller's current device), and `hipGetDeviceCount` does not change the
//! current device, so the caller's device selection is left exactly as it was. The copy kernel
//! is loaded (`hipModuleLoadData`) once per device, on the caller's current device, and kept for
//! the life of the process; its launch therefore needs the stream to belong to that device, as
//! any kernel launch does.
//!
//! A kernel call is, in order on the stream: `hipMallocAsync` of the table (rects and buffer
//! bases, see [`copy_kernel`](crate::backend::copy_kernel)), one `hipMemcpyAsync` uploading it, one
//! `hipModuleLaunchKernel`, `hipFreeAsync` of the table, then `hipStreamSynchronize` only when
//! asked. The upload's source is pageable host memory, which HIP copies before
//! `hipMemcpyAsync` returns, so the table may be dropped right after.

use std::ffi::{CStr, c_void};
use std::sync::Mutex;

use super::copy_kernel::{BLOCK_THREADS, KERNEL_NAME, KernelArgs, KernelTable};
use super::{CopyEngine, CopyJob, SendOptions};
use crate::error::{Error, Result};
use crate::plan::CopyRect;

/// A `hipError_t` exactly as the runtime returns it, kept as an integer: a newer runtime may
/// return a code that no enum compiled into this library lists, and an unlisted value in a Rust
/// enum would be undefined behaviour.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HipStatus(pub i32);

impl HipStatus {
    // Values from `hipError_t` in hip/hip_runtime_api.h (HIP 5.2; unchanged since).
    /// `hipSuccess`.
    pub const SUCCESS: HipStatus = HipStatus(0);
    /// `hipErrorInvalidValue`: an argument is out of range.
    pub const ERROR_INVALID_VALUE: HipStatus = HipStatus(1);
    /// `hipErrorNoDevice`: `hipGetDeviceCount` found no device.
    pub const ERROR_NO_DEVICE: HipStatus = HipStatus(100);
    /// `hipErrorInvalidDevice`: what other calls return when there is no device.
    pub const ERROR_INVALID_DEVICE: HipStatus = HipStatus(101);

    /// True for `hipSuccess`.
    pub fn is_success(self) -> bool {
        self == HipStatus::SUCCESS
    }
}

/// `hipMemcpyDefault` from `hipMemcpyKind` (hip/driver_types.h): the runtime infers the
/// direction from the pointers (unified virtual addressing), so device, peer-device and host
/// memory are all legal on either side.
pub const HIP_MEMCPY_DEFAULT: i32 = 4;

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

/// `hipMemcpyHostToDevice` from `hipMemcpyKind`: the kernel table's upload.
pub const HIP_MEMCPY_HOST_TO_DEVICE: i32 = 1;

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

/// The copy kernel's function per device, loaded at most once per device and kept for the life
/// of the process (a module is never unloaded: a stream may still run the kernel).
#[derive(Debug, Default)]
pub struct KernelCache {
    /// (device, `hipFunction_t` as an address).
    loaded: Mutex<Vec<(i32, usize)>>,
}

impl KernelCache {
    /// An empty cache.
    pub const fn new() -> Self {
        KernelCache {
            loaded: Mutex::new(Vec::new()),
        }
    }

    /// The function cached for `device`, or the one `load` returns, which is cached when it
    /// succeeds. Loads for different threads are serialised: they are rare and cheap to wait for.
    fn get_or_load(
        &self,
        device: i32,
        load: impl FnOnce() -> Result<*mut c_void>,
    ) -> Result<*mut c_void> {
        let mut loaded = self
            .loaded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&(_, function)) = loaded.iter().find(|(d, _)| *d == device) {
            return Ok(function as *mut c_void);
        }
        let function = load()?;
        loaded.push((device, function as usize));
        Ok(function)
    }
}

/// The HIP runtime functions the engine uses. `LibHip` calls `libamdhip64`; tests supply a
/// runtime that records the calls and performs them on host memory.
pub trait HipRuntime {
    /// `hipGetDeviceCount`: the number of devices, or the status it failed with.
    fn device_count(&self) -> Result<i32, HipStatus>;

    /// `hipMemcpy2DAsync` with `args`.
    ///
    /// # Safety
    /// Every row of the copy must be readable at `src + r * spitch` and writable at
    /// `dst + r * dpitch` for `width` bytes until the stream has run the copy, and `stream`
    /// must be NULL or a live stream.
    unsafe fn memcpy_2d_async(&self, args: Memcpy2dAsync) -> HipStatus;

    /// `hipStreamSynchronize(stream)`.
    ///
    /// # Safety
    /// `stream` must be NULL or a live stream.
    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> HipStatus;

    /// `hipGetErrorName(status)`, e.g. "hipErrorInvalidValue".
    fn error_name(&self, status: HipStatus) -> String;

    /// `hipGetDevice`: the calling thread's current device.
    fn current_device(&self) -> Result<i32, HipStatus>;

    /// The copy kernel's code objects this runtime loads.
    fn kernel_image(&self) -> KernelImage;

    /// Where this runtime keeps the copy kernel's function per device.
    fn kernel_cache(&self) -> &KernelCache;

    /// `hipModuleLoadData(&module, image)` on the current device: the module, or the status.
    ///
    /// # Safety
    /// `image` must be a code object or offload bundle as hipcc writes it.
    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, HipStatus>;

    /// `hipModuleGetFunction(&function, module, name)`.
    ///
    /// # Safety
    /// `module` must be a loaded module.
    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, HipStatus>;

    /// `hipMallocAsync(&pointer, size, stream)`: device memory, usable in stream order.
    ///
    /// # Safety
    /// `stream` must be NULL or a live stream.
    unsafe fn malloc_async(
        &self,
        size: usize,
        stream: *mut c_void,
    ) -> Result<*mut c_void, HipStatus>;

    /// `hipMemcpyAsync(dst, src.as_ptr(), src.len(), hipMemcpyHostToDevice, stream)`.
    ///
    /// # Safety
    /// `dst` must be device memory of at least `src.len()` bytes, live until the stream has run
    /// the copy; `stream` NULL or live.
    unsafe fn memcpy_host_to_device_async(
        &self,
        dst: *mut c_void,
        src: &[u8],
        stream: *mut c_void,
    ) -> HipStatus;

    /// `hipModuleLaunchKernel` of the copy kernel as `launch` describes.
    ///
    /// # Safety
    /// `launch.function` must be the copy kernel on the stream's device, and every address the
    /// table behind `launch.args` names must stay valid until the stream has run the kernel.
    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> HipStatus;

    /// `hipFreeAsync(pointer, stream)`.
    ///
    /// # Safety
    /// `pointer` must come from [`HipRuntime::malloc_async`] and not be freed yet.
    unsafe fn free_async(&self, pointer: *mut c_void, stream: *mut c_void) -> HipStatus;

    /// `hipMalloc(&pointer, size)` on the current device: a device staging pool's region.
    fn malloc(&self, size: usize) -> Result<*mut c_void, HipStatus>;

    /// `hipFree(pointer)`.
    ///
    /// # Safety
    /// `pointer` must come from [`HipRuntime::malloc`], not be freed yet, and no stream may
    /// still use it.
    unsafe fn free(&self, pointer: *mut c_void) -> HipStatus;
}

/// "hipErrorNoDevice (100)": the runtime's name for a status and its number, which stays
/// meaningful when a newer runtime returns a code this library has never heard of.
pub(crate) fn describe<R: HipRuntime>(runtime: &R, status: HipStatus) -> String {
    format!("{} ({})", runtime.error_name(status), status.0)
}

/// Ok with the device count when the runtime has at least one device, else why not.
pub(crate) fn require_device<R: HipRuntime>(runtime: &R) -> Result<i32> {
    match runtime.device_count() {
        Ok(count) if count > 0 => Ok(count),
        Ok(count) => Err(Error::BackendUnavailable {
            reason: format!(
                "the HIP backend needs a HIP device, but hipGetDeviceCount reports {count}"
            ),
        }),
        Err(status) => Err(Error::BackendUnavailable {
            reason: format!(
                "the HIP backend needs a HIP device, but hipGetDeviceCount returned {} (no \
                 usable AMD GPU, or no driver access to one)",
                describe(runtime, status)
            ),
        }),
    }
}

/// A byte count or offset of a validated rect as `size_t`: lossless, because the job checked
/// every capacity against `isize::MAX` and every rect lies inside its buffers.
fn size(value: u64) -> usize {
    value as usize
}

/// Issues one `hipMemcpy2DAsync` per (buffer, rect), or one copy-kernel launch per call, on one
/// stream and, when asked, waits for the stream before returning.
#[derive(Debug)]
pub struct HipEngine<R: HipRuntime> {
    runtime: R,
    stream: *mut c_void,
    synchronize: bool,
    copy_kernel: bool,
}

impl<R: HipRuntime> HipEngine<R> {
    /// An engine on `runtime` for `options.stream`, `options.synchronize` and
    /// `options.copy_kernel`; refuses with [`Error::BackendUnavailable`] when the runtime has no
    /// device. `options.backend` is not consulted: choosing the backend is
    /// [`super::open_engine`]'s job.
    pub fn new(runtime: R, options: &SendOptions) -> Result<Self> {
        require_device(&runtime)?;
        Ok(HipEngine {
            runtime,
            stream: options.stream,
            synchronize: options.synchronize,
            copy_kernel: options.copy_kernel,
        })
    }

    /// The runtime the engine calls (a test reads its record here).
    pub fn runtime(&self) -> &R {
        &self.runtime
    }
}

impl<R: HipRuntime> HipEngine<R> {
    /// Issues one `hipMemcpy2DAsync` for `rect` between two bases.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`].
    unsafe fn copy_rect(
        &self,
        dst_base: *mut u8,
        src_base: *const u8,
        rect: &CopyRect,
    ) -> Result<()> {
        // wrapping_add: the bases are usually device addresses, which Rust knows nothing of;
        // the job validated that every offset lies inside its buffer.
        let args = Memcpy2dAsync {
            dst: dst_base.wrapping_add(size(rect.dst_offset)).cast(),
            dpitch: size(rect.dst_pitch),
            src: src_base.wrapping_add(size(rect.src_offset)).cast(),
            spitch: size(rect.src_pitch),
            width: size(rect.width),
            height: size(rect.height),
            kind: HIP_MEMCPY_DEFAULT,
            stream: self.stream,
        };
        // SAFETY: the caller guarantees every row of the rect is addressable until the stream
        // has run it; the stream is the caller's, as documented on MoriSendOptions.
        let status = unsafe { self.runtime.memcpy_2d_async(args) };
        if status.is_success() {
            return Ok(());
        }
        Err(self.gpu_error(
            "hipMemcpy2DAsync",
            status,
            format!(
                "hipMemcpy2DAsync(dst {:p}, dpitch {}, src {:p}, spitch {}, width {}, height {}, \
                 hipMemcpyDefault, stream {:p}) returned {}",
                args.dst,
                args.dpitch,
                args.src,
                args.spitch,
                args.width,
                args.height,
                args.stream,
                describe(&self.runtime, status)
            ),
        ))
    }

    /// Waits for the stream when the caller asked to synchronize.
    fn finish(&self) -> Result<()> {
        if !self.synchronize {
            return Ok(());
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        let status = unsafe { self.runtime.stream_synchronize(self.stream) };
        if status.is_success() {
            return Ok(());
        }
        Err(self.gpu_error(
            "hipStreamSynchronize",
            status,
            format!(
                "hipStreamSynchronize(stream {:p}) returned {} (a copy on the stream failed, or \
                 earlier work on it did)",
                self.stream,
                describe(&self.runtime, status)
            ),
        ))
    }

    /// The copy kernel on the current device: from the cache, or loaded now.
    fn kernel_function(&self) -> Result<*mut c_void> {
        let device = self.runtime.current_device().map_err(|status| {
            let message = format!(
                "hipGetDevice returned {} (the copy kernel is loaded per device)",
                describe(&self.runtime, status)
            );
            self.gpu_error("hipGetDevice", status, message)
        })?;
        self.runtime.kernel_cache().get_or_load(device, || {
            let image = self.runtime.kernel_image();
            // SAFETY: the image is the kernel bundle build.rs embedded (or the test runtime's).
            let module = unsafe { self.runtime.module_load_data(image.bytes) }.map_err(|status| {
                let message = format!(
                    "hipModuleLoadData(copy kernel, {} bytes) on device {device} returned {} (this \
                     libmori_tp's copy kernel holds code objects for {}; a GPU of another \
                     target needs a build with a hipcc that knows it, see MORI_TP_HIP_ARCHS)",
                    image.bytes.len(),
                    describe(&self.runtime, status),
                    image.targets
                );
                self.gpu_error("hipModuleLoadData", status, message)
            })?;
            // SAFETY: `module` was just loaded.
            unsafe { self.runtime.module_get_function(module, KERNEL_NAME) }.map_err(|status| {
                let message = format!(
                    "hipModuleGetFunction({:?}) on device {device} returned {}",
                    KERNEL_NAME,
                    describe(&self.runtime, status)
                );
                self.gpu_error("hipModuleGetFunction", status, message)
            })
        })
    }

    /// The whole job as one kernel launch: allocate and upload the table, launch, free the
    /// table (all in stream order), then wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`]; every buffer must also be memory the kernel can address
    /// (device memory, a peer's with access enabled, or host memory mapped into the device).
    unsafe fn run_kernel(&self, job: &CopyJob<'_>) -> Result<()> {
        let table = KernelTable::new(job)?;
        let (grid_x, grid_y) = table.grid();
        if grid_x == 0 {
            return self.finish();
        }
        let function = self.kernel_function()?;
        let bytes = table.bytes();
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        let device_table =
            unsafe { self.runtime.malloc_async(bytes.len(), self.stream) }.map_err(|status| {
                let message = format!(
                    "hipMallocAsync({} bytes for the copy kernel's table, stream {:p}) returned {}",
                    bytes.len(),
                    self.stream,
                    describe(&self.runtime, status)
                );
                self.gpu_error("hipMallocAsync", status, message)
            })?;
        let launch = KernelLaunch {
            function,
            grid: (grid_x, grid_y),
            block: BLOCK_THREADS,
            stream: self.stream,
            args: table.args(device_table as u64),
        };
        // SAFETY: the table allocation holds `bytes.len()` bytes and lives until the free below,
        // which the stream orders after the launch; the caller vouches for the buffers.
        let issued = unsafe { self.upload_and_launch(device_table, bytes, &launch) };
        // SAFETY: allocated above, freed once, in stream order after its last use.
        let freed = unsafe { self.runtime.free_async(device_table, self.stream) };
        let result = issued.and_then(|()| {
            if freed.is_success() {
                return Ok(());
            }
            let message = format!(
                "hipFreeAsync({device_table:p}, stream {:p}) returned {}",
                self.stream,
                describe(&self.runtime, freed)
            );
            Err(self.gpu_error("hipFreeAsync", freed, message))
        });
        match result {
            Ok(()) => self.finish(),
            Err(error) => Err(self.also_finish(error)),
        }
    }

    /// `hipMemcpyAsync` of the table, then the launch.
    ///
    /// # Safety
    /// As for [`HipEngine::run_kernel`], with `device_table` holding `bytes.len()` bytes.
    unsafe fn upload_and_launch(
        &self,
        device_table: *mut c_void,
        bytes: &[u8],
        launch: &KernelLaunch,
    ) -> Result<()> {
        // SAFETY: as the caller guarantees.
        let status = unsafe {
            self.runtime
                .memcpy_host_to_device_async(device_table, bytes, self.stream)
        };
        if !status.is_success() {
            let message = format!(
                "hipMemcpyAsync({device_table:p}, copy kernel table, {} bytes, \
                 hipMemcpyHostToDevice, stream {:p}) returned {}",
                bytes.len(),
                self.stream,
                describe(&self.runtime, status)
            );
            return Err(self.gpu_error("hipMemcpyAsync", status, message));
        }
        // SAFETY: as the caller guarantees.
        let status = unsafe { self.runtime.launch_kernel(launch) };
        if status.is_success() {
            return Ok(());
        }
        let args = &launch.args;
        let message = format!(
            "hipModuleLaunchKernel(mori_copy_kernel, grid ({}, {}, 1), block ({}, 1, 1), stream \
             {:p}) returned {} ({} buffers x {} rects, {} rows per buffer)",
            launch.grid.0,
            launch.grid.1,
            launch.block,
            launch.stream,
            describe(&self.runtime, status),
            args.num_buffers,
            args.num_rects,
            args.total_rows
        );
        Err(self.gpu_error("hipModuleLaunchKernel", status, message))
    }

    /// After a failure: wait for what was issued when the caller asked to synchronize (they may
    /// free the buffers as soon as we return), naming a failing wait too.
    fn also_finish(&self, error: Error) -> Error {
        let Error::Gpu {
            call,
            status,
            mut message,
        } = error
        else {
            return error;
        };
        if let Err(Error::Gpu { message: also, .. }) = self.finish() {
            message = format!("{message}; then {also}");
        }
        Error::Gpu {
            call,
            status,
            message,
        }
    }

    fn gpu_error(&self, call: &'static str, status: HipStatus, message: String) -> Error {
        Error::Gpu {
            call,
            status: status.0,
            message,
        }
    }
}

impl<R: HipRuntime> CopyEngine for HipEngine<R> {
    fn name(&self) -> &'static str {
        "hip"
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        if self.copy_kernel {
            // SAFETY: as the caller guarantees for the whole job.
            return unsafe { self.run_kernel(job) };
        }
        let (buffers, rects) = (job.num_buffers(), job.num_rects());
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (index, rect) in job.rects().enumerate() {
                // SAFETY: as the caller guarantees for the whole job.
                let Err(error) = (unsafe { self.copy_rect(dst, src, &rect) }) else {
                    continue;
                };
                let Error::Gpu {
                    call,
                    status,
                    message,
                } = error
                else {
                    return Err(error);
                };
                let message = format!(
                    "{message} (buffer {buffer} of {buffers}, rect {index} of {rects}: {rect:?})"
                );
                return Err(self.also_finish(Error::Gpu {
                    call,
                    status,
                    message,
                }));
            }
        }
        self.finish()
    }
}

#[cfg(feature = "hip")]
pub use lib_hip::LibHip;

/// The real runtime: `libamdhip64`, linked through the `hip-sys` crate.
#[cfg(feature = "hip")]
mod lib_hip {
    use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
    use std::ptr::null_mut;
    use std::sync::OnceLock;

    // Only the link directive of hip-sys (libamdhip64) is used; its bindings return a Rust enum.
    use hip_sys as _;

    use super::super::copy_kernel::{ARCHS, IMAGE, KernelArgs};
    use super::{
        HIP_MEMCPY_HOST_TO_DEVICE, HipRuntime, HipStatus, KernelCache, KernelImage, KernelLaunch,
        Memcpy2dAsync,
    };

    // Signatures from hip/hip_runtime_api.h, with hipError_t and hipMemcpyKind (C enums, int
    // sized) as integers and hipStream_t as an opaque pointer.
    unsafe extern "C" {
        fn hipGetDeviceCount(count: *mut c_int) -> HipStatus;
        fn hipMemcpy2DAsync(
            dst: *mut c_void,
            dpitch: usize,
            src: *const c_void,
            spitch: usize,
            width: usize,
            height: usize,
            kind: c_int,
            stream: *mut c_void,
        ) -> HipStatus;
        fn hipStreamSynchronize(stream: *mut c_void) -> HipStatus;
        fn hipGetErrorName(status: HipStatus) -> *const c_char;
        fn hipGetDevice(device: *mut c_int) -> HipStatus;
        fn hipModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> HipStatus;
        fn hipModuleGetFunction(
            function: *mut *mut c_void,
            module: *mut c_void,
            name: *const c_char,
        ) -> HipStatus;
        fn hipMallocAsync(pointer: *mut *mut c_void, size: usize, stream: *mut c_void)
        -> HipStatus;
        fn hipMemcpyAsync(
            dst: *mut c_void,
            src: *const c_void,
            size: usize,
            kind: c_int,
            stream: *mut c_void,
        ) -> HipStatus;
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
        ) -> HipStatus;
        fn hipFreeAsync(pointer: *mut c_void, stream: *mut c_void) -> HipStatus;
        fn hipMalloc(pointer: *mut *mut c_void, size: usize) -> HipStatus;
        fn hipFree(pointer: *mut c_void) -> HipStatus;
    }

    // HIP_LAUNCH_PARAM_* (hip/hip_runtime_api.h): markers of hipModuleLaunchKernel's `extra`.
    const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
    const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;
    const LAUNCH_PARAM_END: usize = 3;

    /// The copy kernel's function per device, for the whole process.
    static KERNELS: KernelCache = KernelCache::new();

    /// An out-pointer call's result: the value on success, else the status.
    fn out<T>(status: HipStatus, value: T) -> Result<T, HipStatus> {
        if status.is_success() {
            Ok(value)
        } else {
            Err(status)
        }
    }

    /// `libamdhip64`. The device count is read once per process: devices do not come and go
    /// under a running HIP program, and AUTO asks on every send.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct LibHip;

    impl HipRuntime for LibHip {
        fn device_count(&self) -> Result<i32, HipStatus> {
            static COUNT: OnceLock<Result<i32, HipStatus>> = OnceLock::new();
            *COUNT.get_or_init(|| {
                let mut count: c_int = 0;
                // SAFETY: `count` is a valid out-pointer for the duration of the call.
                let status = unsafe { hipGetDeviceCount(&mut count) };
                if status.is_success() {
                    Ok(count)
                } else {
                    Err(status)
                }
            })
        }

        unsafe fn memcpy_2d_async(&self, a: Memcpy2dAsync) -> HipStatus {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe {
                hipMemcpy2DAsync(
                    a.dst, a.dpitch, a.src, a.spitch, a.width, a.height, a.kind, a.stream,
                )
            }
        }

        unsafe fn stream_synchronize(&self, stream: *mut c_void) -> HipStatus {
            // SAFETY: forwarded from the caller, as the trait documents.
            unsafe { hipStreamSynchronize(stream) }
        }

        fn error_name(&self, status: HipStatus) -> String {
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

        fn current_device(&self) -> Result<i32, HipStatus> {
            let mut device: c_int = 0;
            // SAFETY: `device` is a valid out-pointer for the duration of the call.
            let status = unsafe { hipGetDevice(&mut device) };
            out(status, device)
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

        unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, HipStatus> {
            let mut module = null_mut();
            // SAFETY: a valid out-pointer; the image is as the caller guarantees.
            let status = unsafe { hipModuleLoadData(&mut module, image.as_ptr().cast()) };
            out(status, module)
        }

        unsafe fn module_get_function(
            &self,
            module: *mut c_void,
            name: &CStr,
        ) -> Result<*mut c_void, HipStatus> {
            let mut function = null_mut();
            // SAFETY: a valid out-pointer and NUL-terminated name; the module as guaranteed.
            let status = unsafe { hipModuleGetFunction(&mut function, module, name.as_ptr()) };
            out(status, function)
        }

        unsafe fn malloc_async(
            &self,
            size: usize,
            stream: *mut c_void,
        ) -> Result<*mut c_void, HipStatus> {
            let mut pointer = null_mut();
            // SAFETY: a valid out-pointer; the stream as the caller guarantees.
            let status = unsafe { hipMallocAsync(&mut pointer, size, stream) };
            out(status, pointer)
        }

        unsafe fn memcpy_host_to_device_async(
            &self,
            dst: *mut c_void,
            src: &[u8],
            stream: *mut c_void,
        ) -> HipStatus {
            // SAFETY: forwarded from the caller; `src` is live for the call, and HIP has read
            // pageable host memory before hipMemcpyAsync returns.
            unsafe {
                hipMemcpyAsync(
                    dst,
                    src.as_ptr().cast(),
                    src.len(),
                    HIP_MEMCPY_HOST_TO_DEVICE,
                    stream,
                )
            }
        }

        unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> HipStatus {
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
        }

        unsafe fn free_async(&self, pointer: *mut c_void, stream: *mut c_void) -> HipStatus {
            // SAFETY: forwarded from the caller.
            unsafe { hipFreeAsync(pointer, stream) }
        }

        fn malloc(&self, size: usize) -> Result<*mut c_void, HipStatus> {
            let mut pointer = null_mut();
            // SAFETY: a valid out-pointer for the duration of the call.
            let status = unsafe { hipMalloc(&mut pointer, size) };
            out(status, pointer)
        }

        unsafe fn free(&self, pointer: *mut c_void) -> HipStatus {
            // SAFETY: forwarded from the caller.
            unsafe { hipFree(pointer) }
        }
    }
}

/// Ok when the HIP engine can run: built in, and the runtime reports a device.
#[cfg(feature = "hip")]
pub(super) fn device_present() -> Result<()> {
    require_device(&LibHip).map(|_| ())
}

/// The HIP engine on `libamdhip64` for `options`.
#[cfg(feature = "hip")]
pub(super) fn open(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    Ok(Box::new(HipEngine::new(LibHip, options)?))
}

/// Without the `hip` feature the HIP backend is a clear refusal, never a silent host fallback.
#[cfg(not(feature = "hip"))]
fn not_built() -> Error {
    Error::BackendUnavailable {
        reason: "the HIP backend is not built in: this libmori_tp was compiled without the `hip` \
                 cargo feature (rebuild with `cargo build --release --features hip`)"
            .into(),
    }
}

#[cfg(not(feature = "hip"))]
pub(super) fn device_present() -> Result<()> {
    Err(not_built())
}

#[cfg(not(feature = "hip"))]
pub(super) fn open(_options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    Err(not_built())
}
