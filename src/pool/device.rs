//! Device memory for a staging pool: one `hipMalloc` for the pool's life, one `hipFree` when
//! it is dropped, through the same [`HipRuntime`] the copy engine uses, both in the relaxed
//! capture mode (so that neither breaks another thread's graph capture).

use std::ffi::c_void;

use super::{MemoryReport, PoolMemory, PoolMemoryKind};
use crate::backend::hip::{Context, HipResult, HipRuntime, Relaxed, describe, require_device};
use crate::error::{Error, Result};

/// Bytes allocated beyond the pool's size, so that the allocation has a size no caller asks for
/// (a round size and a bit): after a `hipDeviceReset` has freed it, an allocation of the
/// caller's that takes its address has another size, and the drop does not free it.
pub(crate) const POOL_TAIL_BYTES: u64 = 192;

/// `len` bytes of device memory on the current device of the thread that made it.
// Without the `hip` feature only the tests (on a recording runtime) make one.
#[derive(Debug)]
pub(crate) struct DeviceMemory<R: HipRuntime> {
    runtime: R,
    base: usize,
    len: u64,
    /// The allocation's size as `hipMemGetAddressRange` reported it: what the drop compares.
    allocated: usize,
}

#[cfg_attr(not(any(feature = "hip", test)), expect(dead_code))]
impl<R: HipRuntime> DeviceMemory<R> {
    /// `hipMalloc(len + POOL_TAIL_BYTES)` on `runtime`, after checking that it has a device.
    pub(crate) fn new(runtime: R, len: u64) -> Result<Self> {
        require_device(&runtime)?;
        let too_big = || Error::PoolMemory {
            call: "hipMalloc",
            bytes: len,
            errno: libc::EINVAL,
        };
        let bytes = len
            .checked_add(POOL_TAIL_BYTES)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or_else(too_big)?;
        let relaxed = Relaxed::enter(&runtime)?;
        let base = runtime.malloc(bytes).or_gpu(&runtime, "hipMalloc", || {
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
}

#[cfg(test)]
impl<R: HipRuntime> DeviceMemory<R> {
    /// The runtime the memory came from (a test reads its record here).
    pub(crate) fn runtime(&self) -> &R {
        &self.runtime
    }
}

impl<R: HipRuntime> Drop for DeviceMemory<R> {
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
                "mori-tp staging pool: the device memory at {:#x} is gone (hipDeviceReset?); not \
                 freeing it",
                self.base
            );
            return;
        }
        // SAFETY: the allocation this value owns, still the runtime's, freed once; the pool
        // refuses to close while slots (and so the transfers that use them) are live.
        if let Err(status) = unsafe { self.runtime.free(self.base as *mut c_void) } {
            log::warn!(
                "mori-tp staging pool: hipFree({:#x}) returned {}",
                self.base,
                describe(&self.runtime, status)
            );
        }
    }
}

impl<R: HipRuntime> PoolMemory for DeviceMemory<R> {
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

/// Device memory from `libamdhip64`.
#[cfg(feature = "hip")]
pub(super) fn open(len: u64) -> Result<Box<dyn PoolMemory + Send + Sync>> {
    Ok(Box::new(DeviceMemory::new(
        crate::backend::hip::LibHip,
        len,
    )?))
}

/// Without the `hip` feature a device pool is a clear refusal, never host memory in disguise.
#[cfg(not(feature = "hip"))]
pub(super) fn open(_len: u64) -> Result<Box<dyn PoolMemory + Send + Sync>> {
    Err(Error::BackendUnavailable {
        reason: "a device staging pool needs the HIP backend, which is not built in: this \
                 libmori_tp was compiled without the `hip` cargo feature (rebuild with \
                 `cargo build --release --features hip`)"
            .into(),
    })
}
