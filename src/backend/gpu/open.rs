//! Opening an engine for a backend, the fork guard, and the counters of each runtime.

use super::super::{CopyEngine, SendOptions};
#[cfg(any(feature = "hip", feature = "cuda"))]
use super::call::require_device;
use super::device::GpuCounters;
#[cfg(any(feature = "hip", feature = "cuda"))]
use super::engine::GpuEngine;
use super::fork::refuse_forked_child;
#[cfg(feature = "cuda")]
use super::lib_cuda::{self, LibCuda};
#[cfg(feature = "hip")]
use super::lib_hip::{self, LibHip};
use super::runtime::{Api, CUDA_API, HIP_API};
use crate::error::{Error, Result};

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
pub(in crate::backend) fn gpu_counters(backend: super::super::Backend) -> Result<GpuCounters> {
    match backend {
        #[cfg(feature = "cuda")]
        super::super::Backend::Cuda => Ok(lib_cuda::counters()),
        #[cfg(not(feature = "cuda"))]
        super::super::Backend::Cuda => Err(not_built(&CUDA_API)),
        #[cfg(feature = "hip")]
        super::super::Backend::Hip => Ok(lib_hip::counters()),
        #[cfg(not(feature = "hip"))]
        super::super::Backend::Hip => Err(not_built(&HIP_API)),
        other => Err(Error::BackendUnavailable {
            reason: format!("GPU counters are kept for the HIP and CUDA backends, not {other:?}"),
        }),
    }
}

/// Ok when the HIP engine can run: built in, and the runtime reports a device.
pub(in crate::backend) fn hip_device_present() -> Result<()> {
    refuse_forked_child(&HIP_API)?;
    #[cfg(feature = "hip")]
    return require_device(&LibHip).map(|_| ());
    #[cfg(not(feature = "hip"))]
    Err(not_built(&HIP_API))
}

/// The HIP engine on `libamdhip64` for `options`.
pub(in crate::backend) fn open_hip(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
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
pub(in crate::backend) fn cuda_device_present() -> Result<()> {
    refuse_forked_child(&CUDA_API)?;
    #[cfg(feature = "cuda")]
    return LibCuda::load().and_then(|cuda| require_device(&cuda).map(|_| ()));
    #[cfg(not(feature = "cuda"))]
    Err(not_built(&CUDA_API))
}

/// The CUDA engine on `libcuda.so.1` for `options`.
pub(in crate::backend) fn open_cuda(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    #[cfg(feature = "cuda")]
    return Ok(Box::new(GpuEngine::new(LibCuda::load()?, options)?));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = options;
        Err(not_built(&CUDA_API))
    }
}
