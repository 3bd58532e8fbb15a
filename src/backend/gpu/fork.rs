//! The fork guard: a child forked after the process made a GPU engine refuses every call.

use super::runtime::Api;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

/// Set in the child of a `fork` made after this process first made a GPU engine
/// ([`arm_fork_guard`]).
static FORKED: AtomicBool = AtomicBool::new(false);

/// The `pthread_atfork` child handler: only an atomic store, which is async-signal-safe.
extern "C" fn forked_child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Registers [`forked_child`] once per process, when the first GPU engine is made: a child
/// forked later may inherit the engine's locks held by a parent thread that is inside a call
/// (the device state stays locked across the upload, launch and fence), and the GPU driver's
/// state, which neither CUDA nor HIP supports in a forked child.
pub(super) fn arm_fork_guard() {
    static ARMED: std::sync::Once = std::sync::Once::new();
    ARMED.call_once(|| {
        // SAFETY: a handler that only stores an atomic; no prepare or parent handler.
        let status = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if status != 0 {
            log::warn!("mori-tp: pthread_atfork returned {status}: a forked child is not refused");
        }
    });
}

/// [`Error::BackendUnavailable`] in a child forked after the parent used a GPU engine, before
/// any lock or runtime call (which could block for good on what a parent thread held at the
/// fork).
pub(crate) fn refuse_forked_child(api: &Api) -> Result<()> {
    if !FORKED.load(Ordering::SeqCst) {
        return Ok(());
    }
    // SAFETY: getpid and getppid always succeed.
    let (pid, parent) = unsafe { (libc::getpid(), libc::getppid()) };
    Err(Error::BackendUnavailable {
        reason: format!(
            "the {0} backend cannot be used in this process (pid {pid}): it was forked (parent \
             pid {parent}) after the parent had used the {0} backend, and neither the {0} \
             driver nor mori-tp's GPU state (whose locks a parent thread may have held at the \
             fork) is usable in a forked child; send from the parent, or start workers with \
             spawn or fork+exec before any GPU use",
            api.backend
        ),
    })
}
