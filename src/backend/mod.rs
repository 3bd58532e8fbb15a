//! Copy backends: engines that perform the strided 2D copies of a whole call, and the validated
//! job they take.
//!
//! An engine knows rects and pointers, nothing of heads or TP: the plan decides what to copy, the
//! engine only how. The host engine is always built; the HIP engine's marshalling is always built
//! too (its unit tests run it on a recording runtime anywhere), but only the `hip` feature links
//! it to the real HIP runtime.

use std::ffi::c_void;

use crate::error::{Error, Result};

mod host;
mod job;
pub use host::HostEngine;
pub use job::{CopyJob, KvBuffers, SendReport};
pub(crate) use job::{check_capacity_fits, first_null};

// Engine internals, neither Rust nor C API (cbindgen must not copy them into the header).
// Without the `hip` feature only their unit tests use them.
/// cbindgen:ignore
#[cfg_attr(not(feature = "hip"), allow(dead_code))]
pub(crate) mod copy_kernel;
/// cbindgen:ignore
#[cfg_attr(not(feature = "hip"), allow(dead_code))]
pub(crate) mod hip;

/// Performs a whole [`CopyJob`]: every rect of a plan on every buffer pair of a call.
///
/// An engine gets the whole call at once so that it can choose how to issue it: the host engine
/// loops, the HIP engine issues one `hipMemcpy2DAsync` per (buffer, rect) or a single kernel
/// launch for everything.
pub trait CopyEngine {
    /// Short name for messages ("host", "hip").
    fn name(&self) -> &'static str;

    /// Copies every rect of `job` from each source buffer to its destination buffer. On error,
    /// copies issued before the failure may have landed; an asynchronous engine that was asked
    /// to synchronize has waited for them before returning.
    ///
    /// # Safety
    /// For every buffer pair and rect, every row must be readable at
    /// `src + src_offset + r * src_pitch` and writable at `dst + dst_offset + r * dst_pitch` for
    /// `width` bytes, in memory the engine can address, for the whole time the engine may touch
    /// it (for asynchronous engines, until the caller's stream has run the copies).
    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()>;
}

/// An engine that copies ordinary host memory and has finished every copy when
/// [`CopyEngine::run`] returns, so that the safe slice functions ([`crate::send_host_with`] and
/// its pack and unpack siblings) can lend it borrowed buffers.
///
/// # Safety
/// An implementor guarantees both: `run` reaches host memory through the pointers it is given,
/// and no copy is still in flight once `run` has returned.
pub unsafe trait HostCopies: CopyEngine {}

// SAFETY: CPU copies of host memory, synchronous.
unsafe impl HostCopies for HostEngine {}

/// An engine opened with `synchronize` and without the copy kernel: `hipMemcpyDefault` copies
/// reach pageable host memory, and the stream is drained before `run` returns.
struct Synchronized(Box<dyn CopyEngine>);

impl CopyEngine for Synchronized {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.run(job) }
    }
}

// SAFETY: opened by `open_host_copies` only: per-rect hipMemcpy2DAsync with hipMemcpyDefault
// (which takes host memory on either side) on the NULL stream, synchronized before returning.
unsafe impl HostCopies for Synchronized {}

/// `backend` for host memory: the host engine, or the HIP engine's per-rect copies on the NULL
/// stream, waited for before each call returns (AUTO: HIP when a device is present).
pub fn open_host_copies(backend: Backend) -> Result<Box<dyn HostCopies>> {
    if !uses_hip(backend) {
        return Ok(Box::new(HostEngine::default()));
    }
    let options = SendOptions {
        backend,
        synchronize: true,
        copy_kernel: false,
        stream: std::ptr::null_mut(),
    };
    Ok(Box::new(Synchronized(hip::open(&options)?)))
}

/// Which engine `mori_send_kvcache` should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// HIP when built with it and a device is present, else host.
    Auto,
    /// CPU copies.
    Host,
    /// `hipMemcpy2DAsync` per rect, or one copy-kernel launch, on the caller's stream.
    Hip,
}

/// Options of one send, pack or unpack, as the C ABI's `MoriSendOptions` carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendOptions {
    /// Requested backend.
    pub backend: Backend,
    /// Wait for the copies to finish before returning (HIP; host copies always have).
    pub synchronize: bool,
    /// HIP: run the whole call as one copy-kernel launch instead of one `hipMemcpy2DAsync` per
    /// (buffer, rect). The host engine ignores it.
    pub copy_kernel: bool,
    /// `hipStream_t` for HIP; must be NULL for the host backend.
    pub stream: *mut c_void,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            backend: Backend::Auto,
            synchronize: false,
            copy_kernel: false,
            stream: std::ptr::null_mut(),
        }
    }
}

/// True when the HIP engine is compiled in and the runtime reports at least one device.
pub fn hip_device_present() -> bool {
    hip::device_present().is_ok()
}

/// True when `backend` resolves to the HIP engine (AUTO: when a device is present).
fn uses_hip(backend: Backend) -> bool {
    match backend {
        Backend::Auto => hip_device_present(),
        Backend::Host => false,
        Backend::Hip => true,
    }
}

/// Resolves `options` to an engine, or says why the requested backend cannot run.
pub fn open_engine(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    if uses_hip(options.backend) {
        return hip::open(options);
    }
    if !options.stream.is_null() {
        return Err(Error::StreamWithHostBackend {
            stream: options.stream as usize,
            auto_fallback: options.backend == Backend::Auto,
        });
    }
    Ok(Box::new(HostEngine::default()))
}
