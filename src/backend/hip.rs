//! The HIP copy engine: one `hipMemcpy2DAsync` per (buffer, rect), or with
//! `SendOptions::copy_kernel` one launch of the copy kernel for the whole call, on the caller's
//! stream.
//!
//! The runtime functions the engine calls sit behind [`HipRuntime`], so that the argument
//! marshalling is the same code whether the runtime is the real `libamdhip64` (`LibHip`, the
//! only implementation in the library, built with the `hip` feature) or the recording stand-in
//! of the unit tests, which runs the byte-exact transfer tests on any machine. Every runtime
//! call returns `Result<T, HipStatus>`, and [`HipResult::or_gpu`] is the one place that turns a
//! failed call into [`Error::Gpu`] (cudarc's split between its `result` layer and the errors its
//! safe layer reports).
//!
//! The engine never leaves the caller's current device changed: a copy runs on the device of the
//! caller's stream (for the NULL stream, the caller's current device). The copy kernel is loaded
//! once per device, for the stream's device (`hipStreamGetDevice`, resolved at run time because
//! HIP 5.2 lacks it; without it, the current device, which an event of that device recorded on
//! the stream confirms): `hipModuleLoadData` loads for the current device only, and a launch
//! runs on the stream's device, so when the two differ the engine makes the stream's device
//! current for the load and switches back.
//!
//! A kernel call is, in order: the capture check (a capturing stream gets the per-rect copies,
//! whose graph nodes keep nothing of the call), the device's kernel state (loaded once; checked
//! to have survived a `hipDeviceReset`), without `hipStreamGetDevice` the stream's device
//! checked, the buffers the kernel cannot reach refused (device memory checked once per base
//! with `hipPointerGetAttributes`, host memory on every call), then on the stream: one
//! `hipMemcpyAsync` of the table from pinned host memory into a device buffer, the launch, and
//! `hipEventRecord` of the buffer pair's event, so that the next call that takes the pair waits
//! for this one. There are [`TABLE_SLOTS`] such pairs per device, grown when a table outgrows
//! them.
//!
//! With `synchronize`, either path first asks whether the stream is capturing a graph and
//! refuses a capturing one before anything is enqueued: the call would end with
//! `hipStreamSynchronize`, which is not allowed during capture.

use std::collections::HashSet;
use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

use super::copy_kernel::{BLOCK_THREADS, KERNEL_NAME, KernelArgs, KernelTable};
use super::{CopyEngine, CopyJob, SendOptions};
use crate::error::{Error, Result};

#[cfg(feature = "hip")]
mod lib_hip;
#[cfg(feature = "hip")]
pub use lib_hip::LibHip;

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
    /// `hipErrorStreamCaptureUnsupported`: the operation is not allowed while the stream is
    /// capturing a graph (as `hipStreamSynchronize` is not); what a synchronizing call on a
    /// capturing stream is refused as.
    pub const ERROR_STREAM_CAPTURE_UNSUPPORTED: HipStatus = HipStatus(900);
    /// `hipErrorNoDevice`: `hipGetDeviceCount` found no device.
    #[cfg(test)]
    pub const ERROR_NO_DEVICE: HipStatus = HipStatus(100);
    /// `hipErrorInvalidDevice`: what other calls return when there is no device, and what a launch
    /// returns when its function is not loaded on the stream's device.
    #[cfg(test)]
    pub const ERROR_INVALID_DEVICE: HipStatus = HipStatus(101);

    /// `Ok(())` for `hipSuccess`, else `Err(self)`: every runtime call's status goes through here.
    pub fn result(self) -> Result<(), HipStatus> {
        if self == HipStatus::SUCCESS {
            Ok(())
        } else {
            Err(self)
        }
    }
}

/// `hipMemcpyDefault` from `hipMemcpyKind` (hip/driver_types.h): the runtime infers the
/// direction from the pointers (unified virtual addressing), so device, peer-device and host
/// memory are all legal on either side.
pub const HIP_MEMCPY_DEFAULT: i32 = 4;

/// `hipMemcpyHostToDevice` from `hipMemcpyKind`: the kernel table's upload.
pub const HIP_MEMCPY_HOST_TO_DEVICE: i32 = 1;

/// Table buffers per device: a call waits for the call that used its pair [`TABLE_SLOTS`] calls
/// earlier, so the host runs at most that many kernel calls ahead of the GPU on one device.
pub const TABLE_SLOTS: usize = 4;

/// The smallest table buffer: 1000 rects and their bases fit.
pub const MIN_TABLE_BYTES: usize = 64 * 1024;

/// Bytes each device table buffer is allocated beyond its table room, so that its size is one
/// no caller asks for (a power of two and a bit): after `hipDeviceReset` frees the buffer, an
/// allocation that takes its address has another size, and the reset check does not mistake
/// it for the buffer.
pub const TABLE_TAIL_BYTES: usize = 192;

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
/// its status as `Err` when it is not `hipSuccess`.
pub trait HipRuntime {
    /// `hipGetDeviceCount`: the number of devices.
    fn device_count(&self) -> Result<i32, HipStatus>;

    /// `hipGetDevice`: the calling thread's current device.
    fn current_device(&self) -> Result<i32, HipStatus>;

    /// `hipSetDevice(device)`.
    fn set_device(&self, device: i32) -> Result<(), HipStatus>;

    /// `hipStreamGetDevice(stream)`, or `Ok(None)` when the runtime has no such function (HIP
    /// 5.2 does not).
    ///
    /// # Safety
    /// `stream` must be a live stream (not NULL).
    unsafe fn stream_device(&self, stream: *mut c_void) -> Result<Option<i32>, HipStatus>;

    /// `hipStreamIsCapturing(stream)`: true unless the status is `hipStreamCaptureStatusNone`.
    ///
    /// # Safety
    /// `stream` must be a live stream (not NULL).
    unsafe fn stream_is_capturing(&self, stream: *mut c_void) -> Result<bool, HipStatus>;

    /// `hipMemcpy2DAsync` with `args`.
    ///
    /// # Safety
    /// Every row of the copy must be readable at `src + r * spitch` and writable at
    /// `dst + r * dpitch` for `width` bytes until the stream has run the copy, and `stream`
    /// must be NULL or a live stream.
    unsafe fn memcpy_2d_async(&self, args: Memcpy2dAsync) -> Result<(), HipStatus>;

    /// `hipStreamSynchronize(stream)`.
    ///
    /// # Safety
    /// `stream` must be NULL or a live stream.
    unsafe fn stream_synchronize(&self, stream: *mut c_void) -> Result<(), HipStatus>;

    /// `hipGetErrorName(status)`, e.g. "hipErrorInvalidValue".
    fn error_name(&self, status: HipStatus) -> String;

    /// The copy kernel's code objects this runtime loads.
    fn kernel_image(&self) -> KernelImage;

    /// Where this runtime keeps the copy kernel's state per device.
    fn kernel_cache(&self) -> &KernelCache;

    /// `hipModuleLoadData(&module, image)` on the current device.
    ///
    /// # Safety
    /// `image` must be a code object or offload bundle as hipcc writes it.
    unsafe fn module_load_data(&self, image: &[u8]) -> Result<*mut c_void, HipStatus>;

    /// `hipModuleGetFunction(&function, module, name)`.
    ///
    /// # Safety
    /// `module` must be a loaded module, loaded on the current device.
    unsafe fn module_get_function(
        &self,
        module: *mut c_void,
        name: &CStr,
    ) -> Result<*mut c_void, HipStatus>;

    /// `hipModuleUnload(module)`.
    ///
    /// # Safety
    /// `module` must be a loaded module no stream still runs a kernel of.
    unsafe fn module_unload(&self, module: *mut c_void) -> Result<(), HipStatus>;

    /// `hipMalloc(&pointer, size)` on the current device.
    fn malloc(&self, size: usize) -> Result<*mut c_void, HipStatus>;

    /// `hipFree(pointer)`.
    ///
    /// # Safety
    /// `pointer` must come from [`HipRuntime::malloc`], not be freed yet, and no stream may
    /// still use it.
    unsafe fn free(&self, pointer: *mut c_void) -> Result<(), HipStatus>;

    /// `hipHostMalloc(&pointer, size, hipHostMallocDefault)`: pinned host memory.
    fn host_malloc(&self, size: usize) -> Result<*mut c_void, HipStatus>;

    /// `hipHostFree(pointer)`.
    ///
    /// # Safety
    /// As for [`HipRuntime::free`], for [`HipRuntime::host_malloc`]'s memory.
    unsafe fn host_free(&self, pointer: *mut c_void) -> Result<(), HipStatus>;

    /// `hipEventCreateWithFlags(&event, hipEventDisableTiming)`.
    fn event_create(&self) -> Result<*mut c_void, HipStatus>;

    /// `hipEventRecord(event, stream)`.
    ///
    /// # Safety
    /// `event` must be a live event, `stream` NULL or a live stream.
    unsafe fn event_record(&self, event: *mut c_void, stream: *mut c_void)
    -> Result<(), HipStatus>;

    /// `hipEventSynchronize(event)`: waits for the work before its last record.
    ///
    /// # Safety
    /// `event` must be a live event.
    unsafe fn event_synchronize(&self, event: *mut c_void) -> Result<(), HipStatus>;

    /// `hipPointerGetAttributes(&attributes, pointer)`.
    fn pointer_info(&self, pointer: *const c_void) -> Result<PointerInfo, HipStatus>;

    /// `hipMemGetAddressRange(&base, &size, pointer)`: the device allocation that holds
    /// `pointer`, as its base address and size.
    fn address_range(&self, pointer: *mut c_void) -> Result<(usize, usize), HipStatus>;

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
    ) -> Result<(), HipStatus>;

    /// `hipModuleLaunchKernel` of the copy kernel as `launch` describes.
    ///
    /// # Safety
    /// `launch.function` must be the copy kernel on the stream's device, and every address the
    /// table behind `launch.args` names must stay valid until the stream has run the kernel.
    unsafe fn launch_kernel(&self, launch: &KernelLaunch) -> Result<(), HipStatus>;
}

/// "hipErrorNoDevice (100)": the runtime's name for a status and its number, which stays
/// meaningful when a newer runtime returns a code this library has never heard of.
pub(crate) fn describe<R: HipRuntime + ?Sized>(runtime: &R, status: HipStatus) -> String {
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
    fn error(self, call: &'static str, status: HipStatus, described: &str) -> Error {
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
pub(crate) trait HipResult<T> {
    /// The value, or the error naming `call`, its status and what `context` (built only on
    /// failure) says.
    fn or_gpu<R: HipRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T>;
}

impl<T> HipResult<T> for Result<T, HipStatus> {
    fn or_gpu<R: HipRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T> {
        self.map_err(|status| context().error(call, status, &describe(runtime, status)))
    }
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

/// Locks `mutex`, also after a panic elsewhere (the state stays consistent between calls).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One table buffer pair of a device: pinned host memory the table is written into, device
/// memory it is uploaded to, and the event recorded after the last launch that read them.
/// Addresses as integers, so that the cache is `Send`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    device: usize,
    host: usize,
    /// Table bytes both buffers hold (the device buffer has [`TABLE_TAIL_BYTES`] more).
    capacity: usize,
    /// The device buffer's size as `hipMemGetAddressRange` reported it after the allocation:
    /// what the reset check compares.
    allocated: usize,
    event: usize,
}

/// The copy kernel's state on one device: its function (the module stays loaded for the
/// process), the table buffers, and the buffer bases already found to be device memory. Nothing
/// is ever freed but a table pair being replaced: a stream may still run the kernel.
#[derive(Debug)]
pub struct DeviceKernel {
    function: usize,
    slots: [Option<Slot>; TABLE_SLOTS],
    next: usize,
    reachable: HashSet<usize>,
    /// An event of this device, recorded on a caller's stream to check that the stream belongs
    /// to the device where the runtime cannot say (no `hipStreamGetDevice`); made on first use.
    probe: Option<usize>,
}

/// Base addresses remembered as reachable per device before the set starts over.
const MAX_REMEMBERED_BASES: usize = 1 << 16;

/// What the cache holds for a device.
#[derive(Debug)]
enum Entry {
    Ready(Arc<Mutex<DeviceKernel>>),
    /// The load failed; the error is returned again without retrying (the kernel bundle does
    /// not change while the process runs).
    Failed(Error),
}

/// The copy kernel's state per device, for the life of the process.
#[derive(Debug, Default)]
pub struct KernelCache {
    devices: Mutex<Vec<(i32, Entry)>>,
}

impl KernelCache {
    /// An empty cache.
    pub const fn new() -> Self {
        KernelCache {
            devices: Mutex::new(Vec::new()),
        }
    }

    /// What is cached for `device`, if anything: its state, or the failure of its load.
    fn cached(&self, device: i32) -> Option<Result<Arc<Mutex<DeviceKernel>>>> {
        lock(&self.devices)
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, entry)| match entry {
                Entry::Ready(kernel) => Ok(kernel.clone()),
                Entry::Failed(error) => Err(error.clone()),
            })
    }

    /// The state cached for `device`, or the one `load` returns, which is cached; so is a
    /// failure, which later calls get again. `load` is the load itself (`hipModuleLoadData`,
    /// `hipModuleGetFunction`), whose failure does not change while the process runs; what
    /// surrounds it (making the device current) stays outside, so that a failure there is not
    /// cached. Loads are serialised: they are rare.
    fn get_or_load(
        &self,
        device: i32,
        load: impl FnOnce() -> Result<DeviceKernel>,
    ) -> Result<Arc<Mutex<DeviceKernel>>> {
        let mut devices = lock(&self.devices);
        match devices.iter().find(|(d, _)| *d == device) {
            Some((_, Entry::Ready(kernel))) => return Ok(kernel.clone()),
            Some((_, Entry::Failed(error))) => return Err(error.clone()),
            None => {}
        }
        let entry = match load() {
            Ok(kernel) => Entry::Ready(Arc::new(Mutex::new(kernel))),
            Err(mut error) => {
                if let Error::Gpu { message, .. } = &mut error {
                    message.push_str(
                        " (mori-tp loads the copy kernel once per device per process and does \
                         not retry)",
                    );
                }
                Entry::Failed(error)
            }
        };
        let result = match &entry {
            Entry::Ready(kernel) => Ok(kernel.clone()),
            Entry::Failed(error) => Err(error.clone()),
        };
        devices.push((device, entry));
        result
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
    /// `device` is the current device by assumption, which [`HipEngine::probe_stream_device`]
    /// checks before anything is allocated or issued.
    assumed: bool,
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
    #[cfg(test)]
    pub(crate) fn runtime(&self) -> &R {
        &self.runtime
    }

    /// One `hipMemcpy2DAsync` per (buffer, rect), then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`].
    unsafe fn run_rects(&self, job: &CopyJob<'_>) -> Result<()> {
        let (buffers, rects) = (job.num_buffers(), job.num_rects());
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
                    .or_gpu(&self.runtime, "hipMemcpy2DAsync", || {
                        Context::args(format!(
                            "(dst {:p}, dpitch {}, src {:p}, spitch {}, width {}, height {}, \
                             hipMemcpyDefault, stream {:p})",
                            args.dst,
                            args.dpitch,
                            args.src,
                            args.spitch,
                            args.width,
                            args.height,
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

    /// Waits for the stream when the caller asked to synchronize.
    fn finish(&self) -> Result<()> {
        if !self.synchronize {
            return Ok(());
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        unsafe { self.runtime.stream_synchronize(self.stream) }.or_gpu(
            &self.runtime,
            "hipStreamSynchronize",
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
            "hipStreamIsCapturing",
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
        let refused = HipStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED;
        Err(Context::args(format!("(stream {:p})", self.stream))
            .note(format!(
                ": the stream is capturing a graph, and MORI_SEND_SYNCHRONIZE would end the call \
                 with hipStreamSynchronize, which a capturing stream does not allow (it fails, \
                 and the capture with it); refused as {} before anything was enqueued: send \
                 without MORI_SEND_SYNCHRONIZE while capturing, and wait for the graph's launch \
                 instead",
                describe(&self.runtime, refused)
            ))
            .error(
                "hipStreamIsCapturing",
                refused,
                "hipStreamCaptureStatusActive",
            ))
    }

    /// The device the kernel runs on: the stream's.
    fn launch_device(&self) -> Result<LaunchDevice> {
        let current =
            self.runtime
                .current_device()
                .or_gpu(&self.runtime, "hipGetDevice", || {
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
            "hipStreamGetDevice",
            || Context::args(format!("(stream {:p})", self.stream)),
        )?;
        Ok(LaunchDevice {
            device: device.unwrap_or(current),
            current,
            assumed: device.is_none(),
        })
    }

    /// `f` with `at.device` current: the caller's current device when it is that one, else
    /// switched to for `f` (a module loads, and memory and events are created, for the current
    /// device) and switched back, whatever `f` returned.
    fn on_device<T>(&self, at: LaunchDevice, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if at.device == at.current {
            return f();
        }
        let switch = |to: i32, why: &'static str| {
            self.runtime
                .set_device(to)
                .or_gpu(&self.runtime, "hipSetDevice", || {
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
        let module = unsafe { self.runtime.module_load_data(image.bytes) }.or_gpu(
            &self.runtime,
            "hipModuleLoadData",
            || {
                Context::args(format!(
                    "(copy kernel, {} bytes) on device {device}",
                    image.bytes.len()
                ))
                .note(format!(
                    " (this libmori_tp's copy kernel holds code objects for {}; a GPU of \
                     another target needs a build with a hipcc that knows it, see \
                     MORI_TP_HIP_ARCHS)",
                    image.targets
                ))
            },
        )?;
        // SAFETY: `module` was just loaded, on the current device.
        let function = unsafe { self.runtime.module_get_function(module, KERNEL_NAME) };
        let function = function.or_gpu(&self.runtime, "hipModuleGetFunction", || {
            Context::args(format!("({KERNEL_NAME:?}) on device {device}"))
        });
        match function {
            Ok(function) => Ok(DeviceKernel {
                function: function as usize,
                slots: [None; TABLE_SLOTS],
                next: 0,
                reachable: HashSet::new(),
                probe: None,
            }),
            Err(error) => {
                // SAFETY: loaded above, on this device; nothing runs it.
                if let Err(status) = unsafe { self.runtime.module_unload(module) } {
                    log::warn!(
                        "hipModuleUnload after a failed hipModuleGetFunction returned {}",
                        describe(&self.runtime, status)
                    );
                }
                Err(error)
            }
        }
    }

    /// The device's kernel state, loaded now if need be, and loaded afresh when the device was
    /// reset since (`hipDeviceReset` frees the table buffers and invalidates the module).
    fn device_kernel(&self, at: LaunchDevice) -> Result<Arc<Mutex<DeviceKernel>>> {
        let cache = self.runtime.kernel_cache();
        // Only the load's own failure is cached: a failed hipSetDevice around it (to the
        // stream's device, or back) is returned, and the next call tries again. A failed switch
        // back after a good load returns its error with the kernel cached.
        let load = || match cache.cached(at.device) {
            Some(cached) => cached,
            None => self.on_device(at, || {
                cache.get_or_load(at.device, || self.load_here(at.device))
            }),
        };
        let kernel = load()?;
        let first = lock(&kernel).slots[0];
        let Some(first) = first else {
            return Ok(kernel);
        };
        // After hipDeviceReset the runtime no longer knows the buffer, or knows the address as
        // part of an allocation of another size.
        let alive = self
            .runtime
            .address_range(first.device as *mut c_void)
            .is_ok_and(|range| range == (first.device, first.allocated));
        if alive {
            return Ok(kernel);
        }
        log::debug!(
            "device {}: the copy kernel's table buffer is gone (hipDeviceReset?); loading the \
             kernel again",
            at.device
        );
        cache.forget(at.device, &kernel);
        load()
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
                    "hipEventCreateWithFlags",
                    || {
                        Context::args("(hipEventDisableTiming)").note(format!(
                            " (the stream check's event on device {})",
                            at.device
                        ))
                    },
                )? as usize;
                state.probe = Some(event);
                event
            }
        };
        // SAFETY: the device's probe event, never destroyed, and the caller's live stream.
        unsafe { self.runtime.event_record(event as *mut c_void, self.stream) }.or_gpu(
            &self.runtime,
            "hipEventRecord",
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

    /// Refuses a buffer base the kernel cannot reach. A base found to be device memory is not
    /// asked about again (a device address is not reused for host memory); host memory is
    /// asked about on every call, since its address may come back as pageable memory.
    fn check_reachable(&self, state: &mut DeviceKernel, job: &CopyJob<'_>) -> Result<()> {
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (side, base) in [("source", src as usize), ("destination", dst as usize)] {
                if state.reachable.contains(&base) {
                    continue;
                }
                if self.check_base(side, buffer, base)? {
                    if state.reachable.len() >= MAX_REMEMBERED_BASES {
                        state.reachable.clear();
                    }
                    state.reachable.insert(base);
                }
            }
        }
        Ok(())
    }

    /// Ok when the runtime knows `base` as memory a kernel addresses at `base` itself: `true`
    /// for device memory, `false` for host memory.
    fn check_base(&self, side: &str, buffer: usize, base: usize) -> Result<bool> {
        let args = || format!("({side} buffer {buffer}, {base:#x})");
        let advice = "the copy kernel faults on memory it cannot reach, and the fault aborts the \
                      process; pass device memory, hipHostMalloc'd memory or a \
                      hipHostGetDevicePointer address, or send without MORI_SEND_COPY_KERNEL";
        let info = self.runtime.pointer_info(base as *const c_void).or_gpu(
            &self.runtime,
            "hipPointerGetAttributes",
            || {
                Context::args(args())
                    .note(format!(
                        ": the HIP runtime does not know this memory (pageable host memory?); \
                         {advice}"
                    ))
                    .at(buffer, None)
            },
        )?;
        let why = if info.device_pointer.is_null() {
            "host memory that no device can address (not pinned)".to_string()
        } else if info.host_pointer as usize == base && info.device_pointer as usize != base {
            format!(
                "host memory registered with hipHostRegister, which devices address at {:p}",
                info.device_pointer
            )
        } else {
            return Ok(info.host_pointer.is_null());
        };
        // The runtime answered, but the kernel would fault: refused as an invalid value.
        let refused = HipStatus::ERROR_INVALID_VALUE;
        Err(Context::args(args())
            .note(format!(
                ": {why}; refused as {}: {advice}",
                describe(&self.runtime, refused)
            ))
            .at(buffer, None)
            .error("hipPointerGetAttributes", refused, "hipSuccess"))
    }

    /// A table pair of at least `bytes` bytes, idle: the next in turn, waited for, and grown
    /// (or allocated on first use) as needed.
    fn take_slot(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        bytes: usize,
    ) -> Result<(usize, Slot)> {
        let device = at.device;
        let index = state.next % TABLE_SLOTS;
        state.next = state.next.wrapping_add(1);
        let mut event = None;
        if let Some(slot) = state.slots[index] {
            // SAFETY: the slot's event, created by this runtime and never destroyed.
            unsafe { self.runtime.event_synchronize(slot.event as *mut c_void) }.or_gpu(
                &self.runtime,
                "hipEventSynchronize",
                || {
                    Context::args(format!("(table buffer {index} of device {device})"))
                        .note(" (waiting for the last kernel call that used this table buffer)")
                },
            )?;
            if slot.capacity >= bytes {
                return Ok((index, slot));
            }
            // Idle now (the wait above): replace the pair, keep the event.
            state.slots[index] = None;
            // SAFETY: allocated by this runtime, idle, and forgotten above.
            let freed = unsafe { self.runtime.free(slot.device as *mut c_void) }
                .and(unsafe { self.runtime.host_free(slot.host as *mut c_void) });
            if let Err(status) = freed {
                log::warn!(
                    "freeing an outgrown copy-kernel table buffer returned {}",
                    describe(&self.runtime, status)
                );
            }
            event = Some(slot.event);
        }
        let capacity = bytes.max(MIN_TABLE_BYTES).next_power_of_two();
        let slot = self.on_device(at, || self.allocate_slot(device, capacity, event))?;
        state.slots[index] = Some(slot);
        Ok((index, slot))
    }

    /// A new table pair of `capacity` bytes on the current device, with `event` or a new one;
    /// nothing stays allocated when a step fails.
    fn allocate_slot(&self, device: i32, capacity: usize, event: Option<usize>) -> Result<Slot> {
        let what = |size: usize| {
            move || {
                Context::args(format!(
                    "({size} bytes for the copy kernel's table on device {device})"
                ))
            }
        };
        let size = capacity + TABLE_TAIL_BYTES;
        let device_buffer =
            self.runtime
                .malloc(size)
                .or_gpu(&self.runtime, "hipMalloc", what(size))?;
        // SAFETY (each cleanup below): allocated here, never used, freed once.
        let free_device = || unsafe {
            let _ = self.runtime.free(device_buffer);
        };
        let allocated = match self.runtime.address_range(device_buffer).or_gpu(
            &self.runtime,
            "hipMemGetAddressRange",
            || {
                Context::args(format!("({device_buffer:p})"))
                    .note(" (the copy kernel's new table buffer)")
            },
        ) {
            Ok((_, allocated)) => allocated,
            Err(error) => {
                free_device();
                return Err(error);
            }
        };
        let host = match self.runtime.host_malloc(capacity).or_gpu(
            &self.runtime,
            "hipHostMalloc",
            what(capacity),
        ) {
            Ok(host) => host,
            Err(error) => {
                free_device();
                return Err(error);
            }
        };
        let event = match event {
            Some(event) => Ok(event),
            None => self
                .runtime
                .event_create()
                .map(|event| event as usize)
                .or_gpu(&self.runtime, "hipEventCreateWithFlags", || {
                    Context::args("(hipEventDisableTiming)")
                }),
        };
        match event {
            Ok(event) => Ok(Slot {
                device: device_buffer as usize,
                host: host as usize,
                capacity,
                allocated,
                event,
            }),
            Err(error) => {
                free_device();
                // SAFETY: allocated above, never used.
                let _ = unsafe { self.runtime.host_free(host) };
                Err(error)
            }
        }
    }

    /// The whole job as one kernel launch on the stream's device, or as per-rect copies while
    /// the stream is capturing a graph; then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`]; every buffer must also be memory the kernel can address
    /// (device memory, a peer's with access enabled, or host memory mapped into the device).
    /// `capturing` is whether the stream is capturing, when already asked.
    unsafe fn run_kernel(&self, job: &CopyJob<'_>, capturing: Option<bool>) -> Result<()> {
        let table = KernelTable::new(job)?;
        let (grid_x, grid_y) = table.grid();
        if grid_x == 0 {
            return self.finish();
        }
        let capturing = match capturing {
            Some(capturing) => capturing,
            None => self.stream_is_capturing()?,
        };
        if capturing {
            // A captured upload would keep reading the table buffer at every replay, long after
            // this call reused it; copy nodes keep nothing of the call.
            log::debug!(
                "stream {:p} is capturing: per-rect copies instead of the copy kernel",
                self.stream
            );
            // SAFETY: as the caller guarantees.
            return unsafe { self.run_rects(job) };
        }
        let at = self.launch_device()?;
        let kernel = self.device_kernel(at)?;
        let mut state = lock(&kernel);
        if at.assumed {
            self.probe_stream_device(&mut state, at)?;
        }
        self.check_reachable(&mut state, job)?;
        let bytes = table.byte_len();
        let (index, slot) = self.take_slot(&mut state, at, bytes)?;
        // SAFETY: the slot's pinned buffer holds `capacity >= bytes` bytes, and nothing reads it
        // (its event was waited for).
        table.write_to(unsafe { std::slice::from_raw_parts_mut(slot.host as *mut u8, bytes) });
        let launch = KernelLaunch {
            function: state.function as *mut c_void,
            grid: (grid_x, grid_y),
            block: BLOCK_THREADS,
            stream: self.stream,
            args: table.args(slot.device as u64),
        };
        // SAFETY: both buffers hold `bytes` bytes and stay untouched until the slot's event,
        // recorded below, has passed.
        unsafe {
            self.runtime.memcpy_host_to_device_async(
                slot.device as *mut c_void,
                slot.host as *const c_void,
                bytes,
                self.stream,
            )
        }
        .or_gpu(&self.runtime, "hipMemcpyAsync", || {
            Context::args(format!(
                "({:#x}, copy kernel table {:#x}, {bytes} bytes, hipMemcpyHostToDevice, stream \
                 {:p})",
                slot.device, slot.host, self.stream
            ))
        })
        .map_err(|error| self.also_finish(error))?;
        // SAFETY: the function was loaded on the stream's device; the caller vouches for the
        // buffers, and the table stays until the event below has passed.
        let launched = unsafe { self.runtime.launch_kernel(&launch) };
        // Recorded even when the launch failed: the upload may still be reading the slot.
        // SAFETY: the slot's event and the caller's stream.
        let recorded = unsafe {
            self.runtime
                .event_record(slot.event as *mut c_void, self.stream)
        };
        if recorded.is_err() {
            // Without its event nobody can tell when the slot is idle: never reuse it.
            state.slots[index] = None;
        }
        drop(state);
        launched
            .or_gpu(&self.runtime, "hipModuleLaunchKernel", || {
                let note = format!(
                    " ({} buffers x {} rects, {} rows per buffer)",
                    table.num_buffers(),
                    table.num_rects(),
                    table.rows_per_buffer()
                );
                Context::args(format!(
                    "(mori_copy_kernel, grid ({}, {}, 1), block ({}, 1, 1), stream {:p}) on \
                     device {}",
                    launch.grid.0, launch.grid.1, launch.block, launch.stream, at.device
                ))
                .note(note)
            })
            .and_then(|()| {
                recorded.or_gpu(&self.runtime, "hipEventRecord", || {
                    Context::args(format!("(table buffer {index}, stream {:p})", self.stream))
                })
            })
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }
}

impl<R: HipRuntime> CopyEngine for HipEngine<R> {
    fn name(&self) -> &'static str {
        "hip"
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        let capturing = self.refuse_synchronize_while_capturing()?;
        if self.copy_kernel {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_kernel(job, capturing) }
        } else {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_rects(job) }
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
