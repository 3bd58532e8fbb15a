//! What the sanitizers of the program mori-tp is linked into are told about the pool.
//!
//! The library itself is built without sanitizers (stable Rust has none), but a C or C++
//! program that links it may run under AddressSanitizer or ThreadSanitizer. Their runtimes
//! export a public interface (`sanitizer/asan_interface.h`, `sanitizer/tsan_interface.h`),
//! looked up here once with `dlsym(RTLD_DEFAULT)`; without a sanitizer runtime in the process
//! (or in a fully static program, which has no dynamic symbols) every call below does nothing.
//!
//! - AddressSanitizer: a host pool's free space is poisoned, so that a write past a slot into
//!   free space, or into a slot after it was freed, is reported where it happens
//!   (`use-after-poison`). A slot is unpoisoned whole (its granted bytes) when it is handed out.
//! - ThreadSanitizer: std's `Mutex` and `Condvar` are futex atomics in uninstrumented code, so
//!   the order they impose is invisible, and the runtime would report a slot's bytes written by
//!   the thread that freed it and then by the thread that got it next as a data race (and the
//!   pool's own allocations, made and freed under the lock by different threads, likewise).
//!   Each critical section of the pool's lock and of the C API's pool table therefore ends with
//!   `__tsan_release` and starts with `__tsan_acquire` on the lock's address: the order the
//!   lock really imposes, told to the runtime.

use std::ffi::c_void;
use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

type RangeFn = unsafe extern "C" fn(*const c_void, usize);
type SyncFn = unsafe extern "C" fn(*mut c_void);

/// The sanitizer interface functions present in this process.
struct Runtime {
    poison: Option<RangeFn>,
    unpoison: Option<RangeFn>,
    acquire: Option<SyncFn>,
    release: Option<SyncFn>,
}

fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        fn find(name: &std::ffi::CStr) -> Option<*mut c_void> {
            // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks the symbol
            // up; NULL means absent.
            let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            (!symbol.is_null()).then_some(symbol)
        }
        // SAFETY (each transmute): the symbol, when present, is the sanitizer runtime's
        // function of that name, whose C signature is the one transmuted to (the interface
        // headers named above).
        let range = |f| unsafe { std::mem::transmute::<*mut c_void, RangeFn>(f) };
        let sync = |f| unsafe { std::mem::transmute::<*mut c_void, SyncFn>(f) };
        Runtime {
            poison: find(c"__asan_poison_memory_region").map(range),
            unpoison: find(c"__asan_unpoison_memory_region").map(range),
            acquire: find(c"__tsan_acquire").map(sync),
            release: find(c"__tsan_release").map(sync),
        }
    })
}

/// Whether AddressSanitizer's runtime is in this process (the tests use it to say what they
/// check).
#[cfg(test)]
pub(crate) fn address_sanitizer() -> bool {
    runtime().poison.is_some()
}

/// Marks `[base, base + len)` of a host pool as free space: an instrumented access to it is
/// reported. AddressSanitizer's granularity is 8 bytes: the ends of a range that does not
/// start or end on a multiple of 8 may stay addressable (never the other way round).
pub(crate) fn poison(base: *const u8, len: u64) {
    if let (Some(poison), Ok(len)) = (runtime().poison, usize::try_from(len)) {
        // SAFETY: the runtime only updates its shadow of the range, which lies in a mapping
        // the pool owns.
        unsafe { poison(base.cast(), len) };
    }
}

/// Marks `[base, base + len)` as addressable again: a slot handed out, or the region before
/// it is unmapped.
pub(crate) fn unpoison(base: *const u8, len: u64) {
    if let (Some(unpoison), Ok(len)) = (runtime().unpoison, usize::try_from(len)) {
        // SAFETY: as for `poison`.
        unsafe { unpoison(base.cast(), len) };
    }
}

/// Tells ThreadSanitizer that this thread now holds the lock at `lock`: it sees everything
/// done before the last [`release`] of it.
pub(crate) fn acquire<T>(lock: &T) {
    if let Some(acquire) = runtime().acquire {
        // SAFETY: the runtime only records a synchronization on the address; nothing is read
        // or written there.
        unsafe { acquire(std::ptr::from_ref(lock).cast_mut().cast()) };
    }
}

/// Tells ThreadSanitizer that this thread is about to give up the lock at `lock`.
pub(crate) fn release<T>(lock: &T) {
    if let Some(release) = runtime().release {
        // SAFETY: as for `acquire`.
        unsafe { release(std::ptr::from_ref(lock).cast_mut().cast()) };
    }
}

/// A `Mutex`'s value while it is locked, the lock told to ThreadSanitizer: each critical
/// section starts with [`acquire`] and ends with [`release`] of the lock's address. A poisoned
/// lock is taken as it is (every user keeps its state consistent between statements).
pub(crate) struct Locked<'a, T> {
    lock: &'a Mutex<T>,
    /// Always `Some`, except inside [`Locked::wait_timeout`].
    guard: Option<MutexGuard<'a, T>>,
}

impl<'a, T> Locked<'a, T> {
    pub(crate) fn new(lock: &'a Mutex<T>) -> Self {
        let guard = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        acquire(lock);
        Locked {
            lock,
            guard: Some(guard),
        }
    }

    /// Gives up the lock while waiting on `condvar` for at most `timeout`, then holds it again.
    pub(crate) fn wait_timeout(mut self, condvar: &Condvar, timeout: Duration) -> Self {
        if let Some(guard) = self.guard.take() {
            release(self.lock);
            let guard = condvar
                .wait_timeout(guard, timeout)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            acquire(self.lock);
            self.guard = Some(guard);
        }
        self
    }
}

impl<T> Deref for Locked<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.guard
            .as_deref()
            .expect("the lock is held outside wait_timeout")
    }
}

impl<T> DerefMut for Locked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard
            .as_deref_mut()
            .expect("the lock is held outside wait_timeout")
    }
}

impl<T> Drop for Locked<'_, T> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            // Before the guard (dropped after this) unlocks.
            release(self.lock);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_sanitizer_runtime_every_hook_does_nothing() {
        // cargo's test binaries are not built with a sanitizer: the lookups find nothing, and
        // the calls return without touching the (here unmapped) addresses.
        assert!(!address_sanitizer());
        assert!(runtime().acquire.is_none() && runtime().release.is_none());
        poison(8 as *const u8, 4096);
        unpoison(8 as *const u8, 4096);
        acquire(&0u8);
        release(&0u8);
    }
}
