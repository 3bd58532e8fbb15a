//! Device memory for a staging pool: one `hipMalloc` for the pool's life, one `hipFree` when
//! it is dropped, through the same [`HipRuntime`] the copy engine uses.

use std::ffi::c_void;

use super::{MemoryReport, PoolMemory, PoolMemoryKind};
use crate::backend::hip::{Context, HipResult, HipRuntime, describe, require_device};
use crate::error::{Error, Result};

/// `len` bytes of device memory on the current device of the thread that made it.
// Without the `hip` feature only the tests (on a recording runtime) make one.
#[derive(Debug)]
pub(crate) struct DeviceMemory<R: HipRuntime> {
    runtime: R,
    base: usize,
    len: u64,
}

#[cfg_attr(not(any(feature = "hip", test)), expect(dead_code))]
impl<R: HipRuntime> DeviceMemory<R> {
    /// `hipMalloc(len)` on `runtime`, after checking that it has a device.
    pub(crate) fn new(runtime: R, len: u64) -> Result<Self> {
        require_device(&runtime)?;
        let bytes = usize::try_from(len).map_err(|_| Error::PoolMemory {
            call: "hipMalloc",
            bytes: len,
            errno: libc::EINVAL,
        })?;
        let base = runtime.malloc(bytes).or_gpu(&runtime, "hipMalloc", || {
            Context::args(format!("({len} bytes)")).note(" for a staging pool")
        })?;
        Ok(DeviceMemory {
            runtime,
            base: base as usize,
            len,
        })
    }
}

impl<R: HipRuntime> Drop for DeviceMemory<R> {
    fn drop(&mut self) {
        // SAFETY: the allocation this value owns, freed once; the pool refuses to close while
        // slots (and so the transfers that use them) are live.
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
