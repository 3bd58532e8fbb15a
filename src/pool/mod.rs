//! A staging pool: one region, allocated and registered with a transfer engine once, whose
//! slots are handed out per request and returned afterwards.
//!
//! Host memory comes from the operating system ([`HostMemory`](crate::pool::HostMemory): mmap,
//! huge pages, mlock); device memory from HIP (`device::DeviceMemory`:
//! `hipMalloc`). Slots come from an address-ordered best-fit allocator over `min_slot` units
//! that coalesces free blocks; by design a slot wastes less than one unit, and a slot of `n`
//! units is granted whenever the free units are at least `(live_slots + 1) * n` (the free space
//! is split into at most `live_slots + 1` blocks). The pool is thread-safe:
//! [`StagingPool::try_alloc`] never blocks and says when the pool is full,
//! [`StagingPool::alloc`] waits up to a timeout for a slot to be freed (backpressure instead of
//! failure). Misuse (a double free, an offset that starts no slot, a pool closed while slots are
//! live) is refused with an error that names the offsets.
//!
//! Under a sanitizer of the program the library is linked into (see [`sanitizer`]), a host
//! pool's free space is poisoned for AddressSanitizer, and its lock is made visible to
//! ThreadSanitizer.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

// Visible to the crate so that the hidden `gpu_runtime` module re-exports `DeviceMemory`.
pub(crate) mod device;
mod fit;
mod host;
pub(crate) mod sanitizer;

use fit::{Fit, Refusal};
pub use host::HostMemory;
use sanitizer::Locked;

/// The slot unit the C API uses when the caller passes 0: a slot wastes less than this.
pub const DEFAULT_MIN_SLOT: u64 = 64 << 10;

/// Where a pool's region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolMemoryKind {
    /// Host memory from mmap.
    Host,
    /// Device memory from `hipMalloc` on the caller's current device.
    Device,
}

/// How a pool's region was prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    /// Host or device.
    pub kind: PoolMemoryKind,
    /// Host memory locked in RAM by mlock (device memory: always true).
    pub locked: bool,
    /// The errno mlock failed with (`EPERM`, `ENOMEM` past RLIMIT_MEMLOCK), or 0.
    pub lock_errno: i32,
    /// madvise(MADV_HUGEPAGE) was accepted (transparent huge pages enabled for the region).
    pub huge_pages: bool,
}

/// A pool's region: its first byte and its length, freed when dropped.
pub trait PoolMemory {
    /// The region's first byte (a device address for device memory).
    fn base(&self) -> *mut u8;
    /// Bytes in the region.
    fn size(&self) -> u64;
    /// How the region was prepared.
    fn report(&self) -> MemoryReport;
}

impl PoolMemory for Box<dyn PoolMemory + Send + Sync> {
    fn base(&self) -> *mut u8 {
        self.as_ref().base()
    }

    fn size(&self) -> u64 {
        self.as_ref().size()
    }

    fn report(&self) -> MemoryReport {
        self.as_ref().report()
    }
}

/// One slot of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Bytes from the region's first byte: what the peer's engine adds to the registered base.
    pub offset: u64,
    /// Bytes granted: the size asked for, rounded up to a multiple of `min_slot`.
    pub size: u64,
    /// `base + offset`.
    pub address: *mut u8,
}

/// A pool's state at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    /// The region's first byte.
    pub base: *mut u8,
    /// Bytes in the region.
    pub capacity: u64,
    /// The slot unit.
    pub min_slot: u64,
    /// How the region was prepared.
    pub memory: MemoryReport,
    /// Slots in use.
    pub live_slots: usize,
    /// Bytes they hold.
    pub live_bytes: u64,
    /// `capacity - live_bytes`.
    pub free_bytes: u64,
    /// The largest slot [`StagingPool::try_alloc`] would grant now.
    pub largest_free: u64,
    /// Free blocks the free bytes are split into (at most `live_slots + 1`).
    pub free_blocks: usize,
    /// Calls of [`StagingPool::alloc`] waiting for a slot to be freed now (the pool was full
    /// for them).
    pub waiters: usize,
}

/// Checks a pool's shape before any memory is asked for.
pub fn check_shape(capacity: u64, min_slot: u64) -> Result<()> {
    let refuse = |reason| {
        Err(Error::PoolShape {
            reason,
            capacity,
            min_slot,
        })
    };
    if !min_slot.is_power_of_two() {
        return refuse("min_slot must be a power of two");
    }
    if capacity == 0 {
        return refuse("capacity is 0");
    }
    if capacity % min_slot != 0 {
        return refuse("capacity must be a multiple of min_slot");
    }
    Ok(())
}

#[derive(Debug)]
struct State {
    fit: Fit,
    closed: bool,
    /// Calls of [`StagingPool::alloc`] waiting for a free now.
    waiters: usize,
}

/// A region and the slots handed out from it. Thread-safe when its memory is.
pub struct StagingPool<M: PoolMemory = Box<dyn PoolMemory + Send + Sync>> {
    memory: M,
    shift: u32,
    state: Mutex<State>,
    freed: Condvar,
    /// Host memory: its free space is poisoned for AddressSanitizer.
    poisons: bool,
}

impl StagingPool {
    /// A pool of `capacity` bytes of host memory ([`HostMemory::map`]) in slots of multiples of
    /// `min_slot` bytes (a power of two that divides `capacity`).
    pub fn host(capacity: u64, min_slot: u64) -> Result<Self> {
        check_shape(capacity, min_slot)?;
        let memory: Box<dyn PoolMemory + Send + Sync> = Box::new(HostMemory::map(capacity)?);
        StagingPool::new(memory, min_slot)
    }

    /// A pool of `capacity` bytes of device memory (`hipMalloc` on the calling thread's current
    /// device). Without the `hip` feature, or without a device: [`Error::BackendUnavailable`].
    pub fn device(capacity: u64, min_slot: u64) -> Result<Self> {
        check_shape(capacity, min_slot)?;
        StagingPool::new(device::open(capacity)?, min_slot)
    }
}

impl<M: PoolMemory> StagingPool<M> {
    /// A pool over `memory`, whose length must be a multiple of `min_slot` (a power of two).
    pub fn new(memory: M, min_slot: u64) -> Result<Self> {
        check_shape(memory.size(), min_slot)?;
        let poisons = memory.report().kind == PoolMemoryKind::Host;
        if poisons {
            sanitizer::poison(memory.base(), memory.size());
        }
        Ok(StagingPool {
            shift: min_slot.trailing_zeros(),
            state: Mutex::new(State {
                fit: Fit::new(memory.size() >> min_slot.trailing_zeros()),
                closed: false,
                waiters: 0,
            }),
            freed: Condvar::new(),
            memory,
            poisons,
        })
    }

    /// The region.
    pub fn memory(&self) -> &M {
        &self.memory
    }

    fn lock(&self) -> Locked<'_, State> {
        Locked::new(&self.state)
    }

    fn bytes(&self, units: u64) -> u64 {
        units << self.shift
    }

    /// A slot of at least `size` bytes, or [`Error::PoolFull`] now.
    pub fn try_alloc(&self, size: u64) -> Result<Slot> {
        let mut state = self.lock();
        self.alloc_locked(&mut state, size, None)
    }

    /// A slot of at least `size` bytes; while the pool is full, waits up to `timeout` for slots
    /// to be freed. A slot that can never fit is refused at once.
    pub fn alloc(&self, size: u64, timeout: Duration) -> Result<Slot> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let mut state = self.lock();
        loop {
            let waited = start.elapsed().as_millis() as u64;
            match self.alloc_locked(&mut state, size, Some(waited)) {
                Err(Error::PoolFull { .. }) => {}
                done => return done,
            }
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return self.alloc_locked(&mut state, size, Some(waited));
            }
            state.waiters += 1;
            state = state.wait_timeout(&self.freed, left);
            state.waiters -= 1;
        }
    }

    fn alloc_locked(&self, state: &mut State, size: u64, waited_ms: Option<u64>) -> Result<Slot> {
        if state.closed {
            return Err(Error::PoolClosed { size });
        }
        if size == 0 {
            return Err(Error::ZeroSlot);
        }
        let units = ((size - 1) >> self.shift) + 1;
        match state.fit.alloc(units) {
            Ok(start) => {
                let slot = Slot {
                    offset: self.bytes(start),
                    size: self.bytes(units),
                    // wrapping_add: the region may be device memory.
                    address: self.memory.base().wrapping_add(self.bytes(start) as usize),
                };
                if self.poisons {
                    // Under the lock: a free of the same space cannot poison it in between.
                    sanitizer::unpoison(slot.address, slot.size);
                }
                Ok(slot)
            }
            Err(Refusal::TooLarge) => Err(Error::SlotLargerThanPool {
                size,
                capacity: self.memory.size(),
            }),
            Err(_) => Err(Error::PoolFull {
                size,
                block: self.bytes(units),
                largest_free: self.bytes(state.fit.largest_free()),
                live_slots: state.fit.live_slots(),
                live_bytes: self.bytes(state.fit.live_units()),
                capacity: self.memory.size(),
                waited_ms,
            }),
        }
    }

    /// Returns the slot at `offset`; returns its size.
    pub fn free(&self, offset: u64) -> Result<u64> {
        let mut state = self.lock();
        let refused = |refusal| match refusal {
            Refusal::DoubleFree { units } => Error::SlotDoubleFree {
                offset,
                size: self.bytes(units),
            },
            Refusal::NotASlot { inside } => Error::NotASlot {
                offset,
                inside: inside.map(|(s, n)| (self.bytes(s), self.bytes(n))),
                capacity: self.memory.size(),
            },
            Refusal::Full | Refusal::TooLarge => unreachable!("free refuses neither"),
        };
        if offset % self.bytes(1) != 0 || offset >= self.memory.size() {
            // No slot starts off a unit boundary or past the end: name the slot holding it.
            let inside = (offset < self.memory.size())
                .then(|| state.fit.slot_holding(offset >> self.shift))
                .flatten()
                .map(|(s, n)| (self.bytes(s), self.bytes(n)));
            return Err(Error::NotASlot {
                offset,
                inside,
                capacity: self.memory.size(),
            });
        }
        let units = state.fit.free(offset >> self.shift).map_err(refused)?;
        if self.poisons {
            sanitizer::poison(
                self.memory.base().wrapping_add(offset as usize),
                self.bytes(units),
            );
        }
        drop(state);
        self.freed.notify_all();
        Ok(self.bytes(units))
    }

    /// The pool's counters now.
    pub fn info(&self) -> PoolInfo {
        let state = self.lock();
        let live_bytes = self.bytes(state.fit.live_units());
        PoolInfo {
            base: self.memory.base(),
            capacity: self.memory.size(),
            min_slot: self.bytes(1),
            memory: self.memory.report(),
            live_slots: state.fit.live_slots(),
            live_bytes,
            free_bytes: self.memory.size() - live_bytes,
            largest_free: self.bytes(state.fit.largest_free()),
            free_blocks: state.fit.free_blocks(),
            waiters: state.waiters,
        }
    }

    /// Closes the pool: later allocations fail, and calls waiting for a slot return
    /// [`Error::PoolClosed`]. Refused ([`Error::PoolInUse`]) while slots are live: an engine may
    /// still be writing into them.
    pub fn close(&self) -> Result<()> {
        let mut state = self.lock();
        if let Some((first, _)) = state.fit.slots().next() {
            return Err(Error::PoolInUse {
                live_slots: state.fit.live_slots(),
                live_bytes: self.bytes(state.fit.live_units()),
                first: self.bytes(first),
            });
        }
        state.closed = true;
        drop(state);
        self.freed.notify_all();
        Ok(())
    }
}

impl<M: PoolMemory> Drop for StagingPool<M> {
    fn drop(&mut self) {
        // The last owner may be a thread that did not hold the lock last: taking it once tells
        // ThreadSanitizer that every critical section (and what it allocated) came before the
        // pool's memory is freed.
        drop(self.lock());
        if self.poisons {
            // Before the region is unmapped (the memory field drops after this): memory mapped
            // there later must not start poisoned.
            sanitizer::unpoison(self.memory.base(), self.memory.size());
        }
    }
}

impl<M: PoolMemory> std::fmt::Debug for StagingPool<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StagingPool").field(&self.info()).finish()
    }
}

// SAFETY: the raw pointers are addresses handed to the caller, never dereferenced here.
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Send for PoolInfo {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    fn pool(capacity: u64, min_slot: u64) -> StagingPool {
        StagingPool::host(capacity, min_slot).expect("a small host pool maps")
    }

    #[test]
    fn host_slots_are_writable_disjoint_and_rounded_to_the_unit() {
        let pool = pool(1 << 20, 4096);
        let info = pool.info();
        assert_eq!(info.base as usize % 4096, 0);
        assert_eq!((info.capacity, info.min_slot), (1 << 20, 4096));
        let a = pool.try_alloc(5000).unwrap();
        let b = pool.try_alloc(100).unwrap();
        assert_eq!((a.size, b.size), (8192, 4096));
        assert!(a.offset + a.size <= b.offset || b.offset + b.size <= a.offset);
        // SAFETY: both slots lie inside the live mapping and do not overlap.
        unsafe {
            std::ptr::write_bytes(a.address, 0xA5, a.size as usize);
            std::ptr::write_bytes(b.address, 0x5A, b.size as usize);
            assert_eq!(*a.address.add(a.size as usize - 1), 0xA5);
        }
        assert_eq!(pool.info().live_bytes, 12288);
        pool.free(a.offset).unwrap();
        pool.free(b.offset).unwrap();
        assert_eq!(pool.info().largest_free, 1 << 20);
    }

    #[test]
    fn shapes_that_cannot_work_are_refused_before_mapping() {
        for (capacity, min_slot) in [(0, 4096), (4096, 3000), (12288, 8192), (4096, 0)] {
            let error = StagingPool::host(capacity, min_slot).unwrap_err();
            assert!(matches!(error, Error::PoolShape { .. }), "{error}");
        }
    }

    #[test]
    fn a_full_pool_says_so_with_its_numbers_and_a_too_large_slot_fails_at_once() {
        let pool = pool(64 << 10, 4096);
        let whole = pool.try_alloc(64 << 10).unwrap();
        let full = pool.try_alloc(1).unwrap_err();
        assert_eq!(
            full.to_string(),
            "staging pool full: a slot of 1 bytes needs a free block of 4096 \
             bytes, the largest free block is 0 bytes (1 live slots hold 65536 of 65536 bytes)"
        );
        let start = Instant::now();
        let never = pool.alloc(1 << 20, Duration::from_secs(30)).unwrap_err();
        assert!(matches!(never, Error::SlotLargerThanPool { .. }), "{never}");
        assert!(start.elapsed() < Duration::from_secs(30), "it did not wait");
        let timed_out = pool.alloc(1, Duration::from_millis(20)).unwrap_err();
        assert!(
            timed_out.to_string().contains("still full after waiting"),
            "{timed_out}"
        );
        pool.free(whole.offset).unwrap();
    }

    #[test]
    fn a_waiting_alloc_gets_the_slot_another_thread_frees() {
        let pool = Arc::new(pool(64 << 10, 4096));
        let whole = pool.try_alloc(64 << 10).unwrap();
        let waiter = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.alloc(32 << 10, Duration::from_secs(60)))
        };
        // The waiter cannot succeed before the free below, whatever the scheduling.
        thread::sleep(Duration::from_millis(10));
        pool.free(whole.offset).unwrap();
        let slot = waiter.join().unwrap().expect("the freed space is granted");
        assert_eq!(slot.size, 32 << 10);
        pool.free(slot.offset).unwrap();
    }

    #[test]
    fn closing_is_refused_while_slots_live_and_ends_waits() {
        let pool = Arc::new(pool(64 << 10, 4096));
        let slot = pool.try_alloc(64 << 10).unwrap();
        let refused = pool.close().unwrap_err();
        assert!(
            matches!(refused, Error::PoolInUse { live_slots: 1, .. }),
            "{refused}"
        );
        let waiter = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.alloc(4096, Duration::from_secs(60)))
        };
        pool.free(slot.offset).unwrap();
        // Either the waiter takes the freed space before the close, or the close ends its wait.
        let closed = pool.close();
        match waiter.join().unwrap() {
            Ok(slot) => {
                assert!(closed.is_err(), "closed with a slot live");
                pool.free(slot.offset).unwrap();
                pool.close().unwrap();
            }
            Err(error) => {
                assert!(closed.is_ok());
                assert!(matches!(error, Error::PoolClosed { size: 4096 }), "{error}");
            }
        }
        assert!(matches!(pool.try_alloc(1), Err(Error::PoolClosed { .. })));
    }

    #[test]
    fn double_frees_and_foreign_offsets_are_refused_and_change_nothing() {
        let pool = pool(1 << 20, 4096);
        let a = pool.try_alloc(3 * 4096).unwrap();
        let before = pool.info();
        for (offset, message) in [
            (
                a.offset + 4096,
                "lies inside the live slot at offset 0 of 12288 bytes",
            ),
            (
                a.offset + 1,
                "lies inside the live slot at offset 0 of 12288 bytes",
            ),
            (1 << 20, "past the pool's capacity 1048576"),
            (512 << 10, "lies in free space"),
        ] {
            let error = pool.free(offset).unwrap_err();
            assert!(error.to_string().contains(message), "{offset}: {error}");
        }
        assert_eq!(pool.info(), before);
        pool.free(a.offset).unwrap();
        assert_eq!(
            pool.free(a.offset).unwrap_err().to_string(),
            "invalid argument: staging pool: offset 0 was a slot of 12288 bytes that is already \
             free (a double free)"
        );
    }

    #[test]
    fn many_threads_allocating_and_freeing_never_share_a_byte() {
        let pool = Arc::new(pool(1 << 20, 4096));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    for i in 0..200u64 {
                        let size = 4096 * (1 + (i * 7 + t as u64) % 9);
                        let slot = pool.alloc(size, Duration::from_secs(60)).unwrap();
                        // SAFETY: the slot is this thread's alone until it frees it.
                        let bytes = unsafe {
                            std::slice::from_raw_parts_mut(slot.address, slot.size as usize)
                        };
                        bytes.fill(t);
                        thread::yield_now();
                        assert!(bytes.iter().all(|&b| b == t), "another thread wrote a slot");
                        pool.free(slot.offset).unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(pool.info().live_slots, 0);
    }
}
