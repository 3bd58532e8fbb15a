//! Copy backends: engines that perform one strided 2D copy at a time.
//!
//! An engine knows rects and pointers, nothing of heads or TP: the plan decides what to copy, the
//! engine only how. The host engine is always built; the HIP engine's marshalling is always built
//! too (see [`hip`]), but only the `hip` feature links it to the real HIP runtime.

use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::plan::CopyRect;

mod host;
pub use host::HostEngine;

// Rust-side engine internals, not C API: cbindgen must not copy them into the header.
/// cbindgen:ignore
pub mod hip;

/// Performs the rects of a plan on one pair of base pointers at a time.
pub trait CopyEngine {
    /// Short name for messages ("host", "hip").
    fn name(&self) -> &'static str;

    /// Copies `rect` from `src_base` to `dst_base`.
    ///
    /// # Safety
    /// Every row of the rect must be readable at `src_base + src_offset + r * src_pitch` and
    /// writable at `dst_base + dst_offset + r * dst_pitch` for `width` bytes, for the whole time
    /// the engine may touch it (until [`CopyEngine::finish`] for asynchronous engines).
    unsafe fn copy_rect(
        &mut self,
        dst_base: *mut u8,
        src_base: *const u8,
        rect: &CopyRect,
    ) -> Result<()>;

    /// Called once before the first rect with the bytes the whole send will write, so an engine
    /// can pick its strategy (the host engine bypasses the caches for large sends).
    fn prepare(&mut self, _total_bytes: u64) {}

    /// Called once after the last rect, or after the rect that failed: the host engine orders
    /// its streaming stores, the HIP engine waits for its stream when asked to.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Which engine `mori_send_kvcache` should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// HIP when built with it and a device is present, else host.
    Auto,
    /// CPU copies.
    Host,
    /// `hipMemcpy2DAsync` on the caller's stream.
    Hip,
}

/// Options of one send, as the C ABI's `MoriSendOptions` carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendOptions {
    /// Requested backend.
    pub backend: Backend,
    /// Wait for the copies to finish before returning (HIP; host copies always have).
    pub synchronize: bool,
    /// `hipStream_t` for HIP; must be NULL for the host backend.
    pub stream: *mut c_void,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            backend: Backend::Auto,
            synchronize: false,
            stream: std::ptr::null_mut(),
        }
    }
}

/// True when the HIP engine is compiled in and the runtime reports at least one device.
pub fn hip_device_present() -> bool {
    hip::device_present().is_ok()
}

/// Resolves `options` to an engine, or says why the requested backend cannot run.
pub fn open_engine(options: &SendOptions) -> Result<Box<dyn CopyEngine>> {
    let use_hip = match options.backend {
        Backend::Auto => hip_device_present(),
        Backend::Host => false,
        Backend::Hip => true,
    };
    if use_hip {
        return hip::open(options);
    }
    if !options.stream.is_null() {
        let why = if options.backend == Backend::Auto {
            "AUTO chose the host backend because no HIP device is available, and host copies \
             take no stream"
        } else {
            "the host backend runs on the CPU and takes no stream"
        };
        return Err(Error::InvalidArgument(format!(
            "options.stream is {:p} but {why} (pass NULL, or request MORI_BACKEND_HIP)",
            options.stream
        )));
    }
    Ok(Box::new(HostEngine::default()))
}
