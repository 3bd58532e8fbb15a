//! Host memory for a staging pool, straight from the operating system (libc): an anonymous
//! mapping aligned to 2 MiB, advised to use transparent huge pages, locked in RAM where the
//! process may lock it, and populated before the pool hands out a slot, so that neither a
//! transfer engine's registration nor the first request pays for page faults.

use std::ffi::c_void;

use super::{MemoryReport, PoolMemory, PoolMemoryKind};
use crate::error::{Error, Result};

/// The size of a transparent huge page on x86-64 and of the alignment that lets the kernel use
/// them (other architectures may use other sizes; a smaller alignment only costs huge pages).
const HUGE_PAGE: usize = 2 << 20;

/// An anonymous private mapping, unmapped on drop.
#[derive(Debug)]
pub struct HostMemory {
    base: usize,
    len: usize,
    huge_pages: bool,
    lock_errno: i32,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

impl HostMemory {
    /// Maps `len` bytes (`len > 0`): mmap, then `madvise(MADV_HUGEPAGE)`, then `mlock` (which
    /// also populates), or where that is refused `madvise(MADV_POPULATE_WRITE)` (Linux 5.14),
    /// or touching every page. `MAP_POPULATE` is not used because it faults the pages in during
    /// mmap, before madvise can ask for huge ones.
    pub fn map(len: u64) -> Result<Self> {
        let refused = |call, errno| Error::PoolMemory {
            call,
            bytes: len,
            errno,
        };
        if len == 0 || len > (isize::MAX as u64) - HUGE_PAGE as u64 {
            return Err(refused("mmap", libc::EINVAL));
        }
        let len = len as usize;
        // Over-map by one huge page and trim, so that the region starts on a huge page.
        let padded = if len >= HUGE_PAGE {
            len + HUGE_PAGE
        } else {
            len
        };
        // SAFETY: an anonymous private mapping at an address of the kernel's choice; no
        // existing memory is touched.
        let mapped = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                padded,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(refused("mmap", errno()));
        }
        let start = mapped as usize;
        let base = if padded > len {
            let base = start.next_multiple_of(HUGE_PAGE);
            // SAFETY: both ranges lie inside the mapping just made, outside [base, base + len).
            unsafe {
                if base > start {
                    libc::munmap(mapped, base - start);
                }
                let end = base + len;
                if start + padded > end {
                    libc::munmap(end as *mut c_void, start + padded - end);
                }
            }
            base
        } else {
            start
        };
        let mut memory = HostMemory {
            base,
            len,
            huge_pages: false,
            lock_errno: 0,
        };
        memory.prepare();
        Ok(memory)
    }

    /// Huge pages, locking and population: each a best effort, reported by [`PoolMemory::report`].
    fn prepare(&mut self) {
        let ptr = self.base as *mut c_void;
        #[cfg(target_os = "linux")]
        {
            // SAFETY: advice on the mapping this value owns.
            self.huge_pages = unsafe { libc::madvise(ptr, self.len, libc::MADV_HUGEPAGE) } == 0;
        }
        // SAFETY: locks the pages of the mapping this value owns (and faults them in).
        if unsafe { libc::mlock(ptr, self.len) } == 0 {
            return;
        }
        self.lock_errno = errno();
        log::info!(
            "mori-tp staging pool: mlock of {} bytes refused (errno {}: {}); the pool is \
             populated but not locked, and the kernel may swap it out (raise RLIMIT_MEMLOCK, \
             `ulimit -l`, or grant CAP_IPC_LOCK to lock it)",
            self.len,
            self.lock_errno,
            std::io::Error::from_raw_os_error(self.lock_errno)
        );
        #[cfg(target_os = "linux")]
        {
            // MADV_POPULATE_WRITE (Linux 5.14) faults every page in writable in one call; older
            // kernels refuse it with EINVAL.
            // SAFETY: advice on the mapping this value owns.
            if unsafe { libc::madvise(ptr, self.len, libc::MADV_POPULATE_WRITE) } == 0 {
                return;
            }
        }
        // SAFETY: page size from the system; every write lies inside the mapping.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        for offset in (0..self.len).step_by(page) {
            // SAFETY: inside the mapping, which is readable and writable; volatile so that the
            // write of the zero already there is not optimised away.
            unsafe { std::ptr::write_volatile((self.base + offset) as *mut u8, 0) };
        }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping this value owns; nothing refers to it once the pool is gone.
        unsafe { libc::munmap(self.base as *mut c_void, self.len) };
    }
}

impl PoolMemory for HostMemory {
    fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }

    fn size(&self) -> u64 {
        self.len as u64
    }

    fn report(&self) -> MemoryReport {
        MemoryReport {
            kind: PoolMemoryKind::Host,
            locked: self.lock_errno == 0,
            lock_errno: self.lock_errno,
            huge_pages: self.huge_pages,
        }
    }
}
