//! Device memory for a staging pool: one `hipMalloc` (CUDA: `cuMemAlloc`) for the pool's life,
//! one `hipFree` (`cuMemFree`) when it is dropped, through the same [`GpuRuntime`] the copy
//! engine uses, both in the relaxed capture mode (so that neither breaks another thread's graph
//! capture).

use std::ffi::c_void;

use super::{MemoryReport, PoolMemory, PoolMemoryKind};
use crate::backend::gpu::{Context, GpuResult, GpuRuntime, Relaxed, describe, require_device};
use crate::error::{Error, Result};

/// Bytes allocated beyond the pool's size, so that the allocation has a size no caller asks for
/// (a round size and a bit): after a `hipDeviceReset` has freed it, an allocation of the
/// caller's that takes its address has another size, and the drop does not free it.
pub const POOL_TAIL_BYTES: u64 = 192;

/// `len` bytes of device memory on the current device of the thread that made it.
// Without a GPU feature only the tests (on a recording runtime) make one.
#[derive(Debug)]
pub struct DeviceMemory<R: GpuRuntime> {
    runtime: R,
    base: usize,
    len: u64,
    /// The allocation's size as `hipMemGetAddressRange` reported it: what the drop compares.
    allocated: usize,
}

impl<R: GpuRuntime> DeviceMemory<R> {
    /// `hipMalloc(len + POOL_TAIL_BYTES)` on `runtime`, after checking that it has a device.
    pub fn new(runtime: R, len: u64) -> Result<Self> {
        require_device(&runtime)?;
        let too_big = || Error::PoolMemory {
            call: runtime.api().malloc,
            bytes: len,
            errno: libc::EINVAL,
        };
        let bytes = len
            .checked_add(POOL_TAIL_BYTES)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or_else(too_big)?;
        let relaxed = Relaxed::enter(&runtime)?;
        let base = runtime
            .malloc(bytes)
            .or_gpu(&runtime, runtime.api().malloc, || {
                Context::args(format!("({len} bytes)")).note(format!(
                    " for a staging pool (and {POOL_TAIL_BYTES} bytes of the library's)"
                ))
            })?;
        // Unreadable: the pool still works, and its drop leaves the memory to the process.
        let allocated =
            runtime.address_range(base).map_or(
                0,
                |(start, size)| if start == base as usize { size } else { 0 },
            );
        drop(relaxed);
        Ok(DeviceMemory {
            runtime,
            base: base as usize,
            len,
            allocated,
        })
    }

    /// The runtime the memory came from (a test reads its record here).
    pub fn runtime(&self) -> &R {
        &self.runtime
    }
}

impl<R: GpuRuntime> Drop for DeviceMemory<R> {
    /// `hipFree`, which waits for every stream of the device (clr's `ihipFree`), unless a
    /// `hipDeviceReset` has freed the memory already: the runtime no longer knows it, or knows
    /// its address as part of an allocation of another size (the caller's, which is left alone).
    fn drop(&mut self) {
        let Ok(_relaxed) = Relaxed::enter(&self.runtime) else {
            log::warn!(
                "mori-tp staging pool: could not make the capture mode relaxed; {:#x} stays \
                 allocated",
                self.base
            );
            return;
        };
        let ours = self
            .runtime
            .address_range(self.base as *mut c_void)
            .is_ok_and(|range| self.allocated != 0 && range == (self.base, self.allocated));
        if !ours {
            log::warn!(
                "mori-tp staging pool: the device memory at {:#x} is gone ({}?); not freeing it",
                self.base,
                self.runtime.api().device_reset
            );
            return;
        }
        // SAFETY: the allocation this value owns, still the runtime's, freed once; the pool
        // refuses to close while slots (and so the transfers that use them) are live.
        if let Err(status) = unsafe { self.runtime.free(self.base as *mut c_void) } {
            log::warn!(
                "mori-tp staging pool: {}({:#x}) returned {}",
                self.runtime.api().free,
                self.base,
                describe(&self.runtime, status)
            );
        }
    }
}

impl<R: GpuRuntime> PoolMemory for DeviceMemory<R> {
    fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }

    fn size(&self) -> u64 {
        self.len
    }

    fn report(&self) -> MemoryReport {
        MemoryReport {
            kind: PoolMemoryKind::Device,
            locked: true,
            lock_errno: 0,
            huge_pages: false,
        }
    }
}

/// What a backend's refusal says, without the "backend unavailable: " its display adds.
#[cfg(any(feature = "hip", feature = "cuda"))]
fn reason(error: Error) -> String {
    match error {
        Error::BackendUnavailable { reason } => reason,
        other => other.to_string(),
    }
}

/// Device memory of the calling thread's current device: from `libamdhip64` when the HIP
/// backend is built in and has a device, else from the CUDA driver when the CUDA backend is built
/// in and has one. Without either a device pool is a clear refusal, never host memory in
/// disguise.
pub(super) fn open(len: u64) -> Result<Box<dyn PoolMemory + Send + Sync>> {
    #[cfg(not(any(feature = "hip", feature = "cuda")))]
    let _ = len;
    let mut why: Vec<String> = Vec::new();
    #[cfg(feature = "hip")]
    match require_device(&crate::backend::gpu::LibHip) {
        Ok(_) => {
            return Ok(Box::new(DeviceMemory::new(
                crate::backend::gpu::LibHip,
                len,
            )?));
        }
        Err(error) => why.push(reason(error)),
    }
    #[cfg(feature = "cuda")]
    match crate::backend::gpu::LibCuda::load() {
        Ok(cuda) => match require_device(&cuda) {
            Ok(_) => return Ok(Box::new(DeviceMemory::new(cuda, len)?)),
            Err(error) => why.push(reason(error)),
        },
        Err(error) => why.push(reason(error)),
    }
    if why.is_empty() {
        why.push(
            "no GPU backend is built in: this libmori_tp was compiled without the `hip` and \
             `cuda` cargo features (rebuild with `cargo build --release --features hip` for AMD \
             GPUs, `--features cuda` for NVIDIA GPUs)"
                .into(),
        );
    }
    Err(Error::BackendUnavailable {
        reason: format!("a device staging pool needs a GPU: {}", why.join("; ")),
    })
}
