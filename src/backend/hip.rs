//! The HIP copy engine: one `hipMemcpy2DAsync` per rect, on the caller's stream.
//!
//! The few runtime functions the engine calls sit behind
//! [`HipRuntime`](crate::backend::hip::HipRuntime), so that the argument marshalling is the same
//! code whether the runtime is the real `libamdhip64` (`LibHip`, the only implementation in the
//! library, built with the `hip` feature) or a recording stand-in that a test supplies to run the
//! byte-exact transfer tests on any machine.
//!
//! The engine never calls `hipSetDevice`: a copy runs on the device of the caller's stream (for
//! the NULL stream, the caller's current device), and `hipGetDeviceCount` does not change the
//! current device, so the caller's device selection is left exactly as it was.

use std::ffi::c_void;

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
}

/// "hipErrorNoDevice (100)": the runtime's name for a status and its number, which stays
/// meaningful when a newer runtime returns a code this library has never heard of.
fn describe<R: HipRuntime>(runtime: &R, status: HipStatus) -> String {
    format!("{} ({})", runtime.error_name(status), status.0)
}

/// Ok with the device count when the runtime has at least one device, else why not.
fn require_device<R: HipRuntime>(runtime: &R) -> Result<i32> {
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

/// Issues one `hipMemcpy2DAsync` per (buffer, rect) on one stream and, when asked, waits for the
/// stream before returning.
#[derive(Debug)]
pub struct HipEngine<R: HipRuntime> {
    runtime: R,
    stream: *mut c_void,
    synchronize: bool,
}

impl<R: HipRuntime> HipEngine<R> {
    /// An engine on `runtime` for `options.stream` and `options.synchronize`; refuses with
    /// [`Error::BackendUnavailable`] when the runtime has no device. `options.backend` is not
    /// consulted: choosing the backend is [`super::open_engine`]'s job.
    pub fn new(runtime: R, options: &SendOptions) -> Result<Self> {
        require_device(&runtime)?;
        Ok(HipEngine {
            runtime,
            stream: options.stream,
            synchronize: options.synchronize,
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
                let mut message = format!(
                    "{message} (buffer {buffer} of {buffers}, rect {index} of {rects}: {rect:?})"
                );
                // A caller who asked to synchronize may free the buffers as soon as we return,
                // so the copies already issued are waited for even though a later one failed.
                if let Err(Error::Gpu { message: also, .. }) = self.finish() {
                    message = format!("{message}; then {also}");
                }
                return Err(Error::Gpu {
                    call,
                    status,
                    message,
                });
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
    use std::ffi::{CStr, c_char, c_int, c_void};
    use std::sync::OnceLock;

    // Only the link directive of hip-sys (libamdhip64) is used; its bindings return a Rust enum.
    use hip_sys as _;

    use super::{HipRuntime, HipStatus, Memcpy2dAsync};

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
