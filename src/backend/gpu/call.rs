//! A runtime call's failure made an [`Error`] ([`GpuResult::or_gpu`], in one place), and the
//! relaxed capture mode that every engine call runs in ([`Relaxed`]).

use super::runtime::{Api, CaptureMode, GpuRuntime, GpuStatus};
use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};

/// "hipErrorNoDevice (100)": the runtime's name for a status and its number, which stays
/// meaningful when a newer runtime returns a code this library has never heard of.
pub(crate) fn describe<R: GpuRuntime + ?Sized>(runtime: &R, status: GpuStatus) -> String {
    format!("{} ({})", runtime.error_name(status), status.0)
}

/// The words of a failed call's message around its status, `{call}{args} returned
/// {status}{note}`, and the buffer and rect of the job it belongs to.
#[derive(Debug, Default)]
pub(crate) struct Context {
    pub(super) args: String,
    pub(super) note: String,
    pub(super) buffer: Option<usize>,
    pub(super) rect: Option<usize>,
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
    pub(super) fn at(mut self, buffer: usize, rect: Option<usize>) -> Self {
        self.buffer = Some(buffer);
        self.rect = rect;
        self
    }

    /// The error for `call` failing (or refused) with `status`, whose description comes last
    /// but one.
    pub(super) fn error(self, call: &'static str, status: GpuStatus, described: &str) -> Error {
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
pub(crate) trait GpuResult<T> {
    /// The value, or the error naming `call`, its status and what `context` (built only on
    /// failure) says.
    fn or_gpu<R: GpuRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T>;
}

impl<T> GpuResult<T> for Result<T, GpuStatus> {
    fn or_gpu<R: GpuRuntime + ?Sized>(
        self,
        runtime: &R,
        call: &'static str,
        context: impl FnOnce() -> Context,
    ) -> Result<T> {
        self.map_err(|status| context().error(call, status, &describe(runtime, status)))
    }
}

/// Statuses of a load that no retry changes: the image itself does not suit the device
/// (`hipErrorInvalidImage` / `CUDA_ERROR_INVALID_IMAGE` 200, `..NoBinaryForGpu` 209,
/// `..InvalidKernelFile` / `CUDA_ERROR_INVALID_PTX` 218, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`
/// 222; HIP and CUDA share these numbers). Every other failure (out of memory above all) is
/// tried again on a later call.
pub(super) const PERMANENT_LOAD_FAILURES: [i32; 4] = [200, 209, 218, 222];

/// What a failed load of the copy kernel with `status` most likely means, and what to do.
pub(super) fn load_hint(api: &Api, status: GpuStatus) -> String {
    match status.0 {
        2 => "the device's memory is full (the driver needs room to load the module: a KV cache \
              or pool may hold all of it); free some, and mori-tp loads the kernel on a later \
              call"
            .to_string(),
        221 if api.backend == "CUDA" => "the driver's PTX JIT compiler \
              (libnvidia-ptxjitcompiler.so.1) is missing: it ships with the NVIDIA driver, and a \
              container needs the driver's compute libraries mounted (NVIDIA_DRIVER_CAPABILITIES \
              with compute)"
            .to_string(),
        s if PERMANENT_LOAD_FAILURES.contains(&s) => api.kernel_load_note.to_string(),
        _ => format!(
            "an unexpected failure of {}; mori-tp tries again on a later call",
            api.module_load_data
        ),
    }
}

/// Ok with the device count when the runtime has at least one device, else why not.
pub(crate) fn require_device<R: GpuRuntime>(runtime: &R) -> Result<i32> {
    let api = runtime.api();
    match runtime.device_count() {
        Ok(count) if count > 0 => Ok(count),
        Ok(count) => Err(Error::BackendUnavailable {
            reason: format!(
                "the {0} backend needs a {0} device, but {1} reports {count}",
                api.backend, api.device_count
            ),
        }),
        Err(status) => Err(Error::BackendUnavailable {
            reason: format!(
                "the {0} backend needs a {0} device, but {1} returned {2} ({3})",
                api.backend,
                api.device_count,
                describe(runtime, status),
                api.no_device
            ),
        }),
    }
}

/// A byte count or offset of a validated rect as `size_t`: lossless, because the job checked
/// every capacity against `isize::MAX` and every rect lies inside its buffers.
pub(super) fn size(value: u64) -> usize {
    value as usize
}

/// Locks `mutex`, also after a panic elsewhere (the state stays consistent between calls).
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The calling thread's capture mode while the library calls the runtime: relaxed from
/// [`Relaxed::enter`] until the value is dropped, which gives the thread its own mode back.
#[must_use = "the relaxed mode lasts while the value lives"]
pub(crate) struct Relaxed<'a, R: GpuRuntime + ?Sized> {
    pub(super) runtime: &'a R,
    pub(super) previous: CaptureMode,
}

impl<'a, R: GpuRuntime + ?Sized> Relaxed<'a, R> {
    /// Makes the calling thread's capture mode relaxed, so that none of the library's runtime
    /// calls is refused for, or breaks, a graph capture of another thread.
    pub(crate) fn enter(runtime: &'a R) -> Result<Self> {
        let previous = runtime.exchange_capture_mode(CaptureMode::RELAXED).or_gpu(
            runtime,
            runtime.api().exchange_capture_mode,
            || {
                Context::args(format!("({})", CaptureMode::RELAXED.name(runtime.api()))).note(
                    " (mori-tp makes its own runtime calls in the relaxed capture mode, so that \
                     they never break another thread's graph capture)",
                )
            },
        )?;
        Ok(Relaxed { runtime, previous })
    }
}

impl<R: GpuRuntime + ?Sized> Drop for Relaxed<'_, R> {
    fn drop(&mut self) {
        if let Err(status) = self.runtime.exchange_capture_mode(self.previous) {
            log::warn!(
                "mori-tp: restoring the thread's capture mode ({}) with {} returned {}",
                self.previous.name(self.runtime.api()),
                self.runtime.api().exchange_capture_mode,
                describe(self.runtime, status)
            );
        }
    }
}
