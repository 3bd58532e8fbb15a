//! Copy backends: engines that perform the strided 2D copies of a whole call, and the validated
//! job they take.
//!
//! An engine knows rects and pointers, nothing of heads or TP: the plan decides what to copy, the
//! engine only how. The host engine is always built; the GPU engine is always built too (its unit
//! tests run it on a recording runtime anywhere), but only the `hip` feature links it to the
//! real HIP runtime, and only the `cuda` feature loads the CUDA driver.

use std::ffi::c_void;

use crate::error::{Error, Result};

mod host;
mod job;
pub use host::HostEngine;
pub use job::{CopyJob, KvBuffers, SendReport};
pub(crate) use job::{check_capacity_fits, first_null};

// Engine internals, neither Rust nor C API (cbindgen must not copy them into the header).
// Without a GPU feature only their unit tests use them.
/// cbindgen:ignore
#[cfg_attr(not(any(feature = "hip", feature = "cuda")), allow(dead_code))]
pub(crate) mod copy_kernel;
/// cbindgen:ignore
#[cfg_attr(not(any(feature = "hip", feature = "cuda")), allow(dead_code))]
pub(crate) mod gpu;

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
/// (CUDA: `CU_MEMORYTYPE_UNIFIED`) reach pageable host memory, and the stream is drained before
/// `run` returns.
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
// (cuMemcpy2DAsync with CU_MEMORYTYPE_UNIFIED; either takes host memory on either side) on the
// NULL stream, synchronized before returning.
unsafe impl HostCopies for Synchronized {}

/// `backend` for host memory: the host engine, or a GPU engine's per-rect copies on the NULL
/// stream, waited for before each call returns (AUTO: as [`Backend::Auto`] resolves).
pub fn open_host_copies(backend: Backend) -> Result<Box<dyn HostCopies>> {
    let resolved = resolve(backend);
    if resolved == Backend::Host {
        return Ok(Box::new(HostEngine::default()));
    }
    let options = SendOptions {
        backend: resolved,
        synchronize: true,
        path: CopyPath::Memcpy2d,
        max_blocks: 0,
        stream: std::ptr::null_mut(),
    };
    Ok(Box::new(Synchronized(open_gpu(resolved, &options)?)))
}

/// Which engine `mori_tp_kvcache_send` should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// HIP when built with it and an AMD GPU is present, else CUDA when built with it and an
    /// NVIDIA GPU is present, else host.
    Auto,
    /// CPU copies.
    Host,
    /// One copy-kernel launch, or `hipMemcpy2DAsync` per (buffer, rect), on the caller's stream.
    Hip,
    /// The same over the CUDA driver API (`cuLaunchKernel`, `cuMemcpy2DAsync`).
    Cuda,
}

/// How a GPU engine (HIP or CUDA) issues a call (the host engine ignores it): the choice of
/// `MORI_SEND_COPY_KERNEL`, `MORI_SEND_MEMCPY2D` or neither (REFERENCE.md section 7).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CopyPath {
    /// Neither flag: one copy-kernel launch when the call has at least
    /// [`AUTO_KERNEL_MIN_COPIES`] (buffer, rect) copies and the kernel can run it (its code
    /// object loads on the stream's device, the stream is not capturing, every buffer is memory
    /// a kernel surely reaches); else one `hipMemcpy2DAsync` per (buffer, rect).
    #[default]
    Auto,
    /// `MORI_SEND_COPY_KERNEL`: the copy kernel (a capturing stream still gets the per-rect
    /// copies), and a refusal for memory the kernel cannot reach or a device it cannot load on.
    Kernel,
    /// `MORI_SEND_MEMCPY2D`: one `hipMemcpy2DAsync` per (buffer, rect).
    Memcpy2d,
}

/// The fewest (buffer, rect) copies for which [`CopyPath::Auto`] launches the kernel: a single
/// copy is one `hipMemcpy2DAsync`, cheaper than a table upload and a launch.
/// cbindgen:ignore
pub const AUTO_KERNEL_MIN_COPIES: usize = 2;

/// Options of one send, pack or unpack, as the C ABI's `MoriSendOptions` carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendOptions {
    /// Requested backend.
    pub backend: Backend,
    /// Wait for the copies to finish before returning (HIP; host copies always have).
    pub synchronize: bool,
    /// HIP: the copy kernel, one `hipMemcpy2DAsync` per (buffer, rect), or the engine's choice.
    /// The host engine ignores it.
    pub path: CopyPath,
    /// The SM budget: the most blocks one launch of the copy kernel may use (0: no budget, the
    /// persistent grid of the device's resident blocks). The per-rect copies and the host engine
    /// ignore it (the C ABI refuses it together with `MORI_SEND_MEMCPY2D`).
    pub max_blocks: u32,
    /// `hipStream_t` for HIP; must be NULL for the host backend.
    pub stream: *mut c_void,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            backend: Backend::Auto,
            synchronize: false,
            path: CopyPath::Auto,
            max_blocks: 0,
            stream: std::ptr::null_mut(),
        }
    }
}

/// The counters of `backend`'s GPU engines in this process (zeros before its first use), or
/// [`crate::Error::BackendUnavailable`] when it is not built in or not a GPU backend.
pub fn gpu_counters(backend: Backend) -> crate::Result<gpu::GpuCounters> {
    gpu::gpu_counters(backend)
}

/// True when the HIP engine is compiled in and the runtime reports at least one device.
pub fn hip_device_present() -> bool {
    gpu::hip_device_present().is_ok()
}

/// True when the CUDA engine is compiled in, libcuda.so.1 loads with every function the engine
/// uses, and the driver reports at least one device.
pub fn cuda_device_present() -> bool {
    gpu::cuda_device_present().is_ok()
}

/// The engine `backend` runs on: itself, or for AUTO, HIP when an AMD GPU is present, else CUDA
/// when an NVIDIA GPU is present, else host.
pub fn resolve(backend: Backend) -> Backend {
    match backend {
        Backend::Auto if hip_device_present() => Backend::Hip,
        Backend::Auto if cuda_device_present() => Backend::Cuda,
        Backend::Auto => Backend::Host,
        other => other,
    }
}

/// The GPU engine of `backend` (HIP or CUDA) for `options`.
fn open_gpu(backend: Backend, options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    match backend {
        Backend::Cuda => gpu::open_cuda(options),
        _ => gpu::open_hip(options),
    }
}

/// Resolves `options` to an engine, or says why the requested backend cannot run.
pub fn open_engine(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    let resolved = resolve(options.backend);
    if resolved != Backend::Host {
        return open_gpu(resolved, options);
    }
    if !options.stream.is_null() {
        return Err(Error::StreamWithHostBackend {
            stream: options.stream as usize,
            auto_fallback: options.backend == Backend::Auto,
        });
    }
    Ok(Box::new(HostEngine::default()))
}
