//! The staging pool's C functions: a handle registry over [`StagingPool`].
//!
//! A `MoriTpPool` is an id looked up in a process-wide table, never a pointer: ids are never
//! reused, so a destroyed or made-up handle is refused with MORI_ERR_INVALID_ARGUMENT instead of
//! reaching freed memory. A call that is running (a waiting alloc) holds its own reference to
//! the pool, so a concurrent destroy ends its wait instead of freeing the region under it.
#![allow(rustdoc::broken_intra_doc_links)] // "[in]"/"[out]" are header conventions, not links.
#![allow(clippy::missing_safety_doc)] // The header's @param lines are the safety contract.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::boundary::{Failure, Result, ffi_boundary};
use super::convert::{CEnum, check_out, try_ref};
use super::types::*;
use crate::pool::sanitizer::Locked;
use crate::pool::{DEFAULT_MIN_SLOT, PoolMemoryKind, Slot, StagingPool};

/// The live pools by handle.
static POOLS: Mutex<BTreeMap<u64, Arc<StagingPool>>> = Mutex::new(BTreeMap::new());
/// The next handle; 0 is never one.
static NEXT_POOL: AtomicU64 = AtomicU64::new(1);

/// The table, locked (told to ThreadSanitizer: the pools are made, shared and dropped by
/// different threads under this lock). It is consistent between statements: a panic elsewhere
/// cannot corrupt it.
fn pools() -> Locked<'static, BTreeMap<u64, Arc<StagingPool>>> {
    Locked::new(&POOLS)
}

/// The live pool behind `handle`.
fn live_pool(handle: MoriTpPool) -> Result<Arc<StagingPool>> {
    pools()
        .get(&handle)
        .cloned()
        .ok_or(Failure::UnknownPool(handle))
}

impl From<Slot> for MoriTpSlot {
    fn from(slot: Slot) -> Self {
        MoriTpSlot {
            offset: slot.offset,
            size: slot.size,
            address: slot.address.cast(),
        }
    }
}

/// Creates a staging pool: one region of options->capacity bytes, carved into slots per
/// request. Register the whole region with the transfer engine once (mori_tp_pool_info gives
/// its base), then give each request a slot and tell the peer its offset.
///
/// Host memory (MORI_TP_POOL_HOST) is an anonymous mmap aligned to 2 MiB, advised to use
/// transparent huge pages (madvise MADV_HUGEPAGE), locked in RAM with mlock where the process
/// may lock it, and populated before this returns; where mlock is refused (RLIMIT_MEMLOCK,
/// `ulimit -l`, without CAP_IPC_LOCK) the pool still works, unlocked, and mori_tp_pool_info
/// reports the errno. Device memory (MORI_TP_POOL_DEVICE) is one hipMalloc on the calling
/// thread's current device, freed by mori_tp_pool_destroy.
///
/// Slots are multiples of options->min_slot bytes, each taken from the front of the smallest
/// free block that holds it (lowest address first), and a freed slot merges with the free space
/// on either side. So a slot wastes less than min_slot bytes, the free space is split into at
/// most live_slots + 1 blocks, and a slot of S bytes is granted whenever free_bytes >=
/// (live_slots + 1) * S (rounded to min_slot).
///
/// In a program built with AddressSanitizer, a host pool's free space is poisoned: a write past
/// a slot into free space, or into a slot after mori_tp_pool_free, is reported where it
/// happens (a slot's granted bytes are all addressable; slots are adjacent, so a write into the
/// next live slot is not caught). In one built with ThreadSanitizer, the pool's locks are made
/// visible to it (__tsan_acquire, __tsan_release), so slots reused or handed between threads
/// report no race. Both runtimes are found at run time; without them nothing changes.
///
/// @param[in]  options   Capacity, slot unit, memory kind. Must not be NULL.
/// @param[out] out_pool  Receives the pool's handle; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if options or out_pool is NULL;
///   MORI_ERR_INVALID_ARGUMENT for a zero capacity, a min_slot that is not a power of two, a
///   capacity that is not a multiple of min_slot, an unknown memory kind, non-zero flags, a
///   misaligned pointer, or host memory the system refuses to map (the message names the errno);
///   MORI_ERR_BACKEND_UNAVAILABLE for device memory without the HIP backend or without a device;
///   MORI_ERR_GPU if hipMalloc fails (the message names the HIP error);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pool_create(
    options: *const MoriTpPoolOptions,
    out_pool: *mut MoriTpPool,
) -> MoriStatus {
    ffi_boundary! {
        // SAFETY: valid or NULL per the caller; NULL and misalignment are refused.
        let options = unsafe { try_ref(options, "options") }?;
        check_out(out_pool, "out_pool")?;
        let memory = PoolMemoryKind::from_c(options.memory, "options.memory")?;
        if options.flags != 0 {
            return Err(Failure::UnknownValue {
                field: "options.flags",
                value: options.flags,
                allowed: "valid value (no pool flags are defined yet: pass 0)".into(),
            });
        }
        let min_slot = match options.min_slot {
            0 => DEFAULT_MIN_SLOT,
            min_slot => min_slot,
        };
        let pool = match memory {
            PoolMemoryKind::Host => StagingPool::host(options.capacity, min_slot),
            PoolMemoryKind::Device => StagingPool::device(options.capacity, min_slot),
        }?;
        let handle = NEXT_POOL.fetch_add(1, Ordering::Relaxed);
        pools().insert(handle, Arc::new(pool));
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_pool.write(handle) };
        Ok(())
    }
}

/// Takes a slot of at least size bytes without waiting: MORI_ERR_POOL_FULL at once when no
/// free block can hold it now (the pool is full for this size; retry after a free, or use
/// mori_tp_pool_alloc to wait). The slot is the front of the smallest free block that holds it,
/// the lowest such block among equals (best fit, as mori_tp_pool_create says): with free units
/// [0, 8) and [9, 11), a 2-unit slot starts at unit 9.
///
/// @param[in]  pool      A live pool.
/// @param[in]  size      Bytes needed (> 0), e.g. num_buffers * mori_tp_staging_len.
/// @param[out] out_slot  Receives the slot; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if out_slot is NULL;
///   MORI_ERR_INVALID_ARGUMENT if pool is not a live pool (destroyed or never created), size is
///   0, or out_slot is misaligned;
///   MORI_ERR_POOL_FULL if the pool is full for this size now (the message names the block
///   needed, the largest free block, the live slots and their bytes): retry after a free;
///   MORI_ERR_BUFFER_TOO_SMALL if size exceeds the pool's capacity, which no wait or retry can
///   fix (the message says so);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pool_try_alloc(
    pool: MoriTpPool,
    size: u64,
    out_slot: *mut MoriTpSlot,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_slot, "out_slot")?;
        let slot = live_pool(pool)?.try_alloc(size)?;
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_slot.write(slot.into()) };
        Ok(())
    }
}

/// Takes a slot of at least size bytes, waiting up to timeout_ms milliseconds while the pool is
/// full for it (backpressure: the call returns as soon as other threads free enough space). A
/// size larger than the pool's capacity is refused at once. A concurrent
/// mori_tp_pool_destroy ends the wait with MORI_ERR_INVALID_ARGUMENT. Waiters are not served in
/// order: whichever fits first after a free gets the space.
///
/// @param[in]  pool        A live pool.
/// @param[in]  size        Bytes needed (> 0).
/// @param[in]  timeout_ms  The longest wait, in milliseconds (0: like mori_tp_pool_try_alloc).
/// @param[out] out_slot    Receives the slot; written only on MORI_OK. Must not be NULL.
///
/// @return the codes of mori_tp_pool_try_alloc; MORI_ERR_POOL_FULL once the pool stayed full
///   for timeout_ms (the message says how long it waited; worth retrying, unlike
///   MORI_ERR_BUFFER_TOO_SMALL for a size above the capacity, which is refused at once);
///   MORI_ERR_INVALID_ARGUMENT also when the pool was destroyed during the wait.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pool_alloc(
    pool: MoriTpPool,
    size: u64,
    timeout_ms: u64,
    out_slot: *mut MoriTpSlot,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_slot, "out_slot")?;
        let slot = live_pool(pool)?.alloc(size, Duration::from_millis(timeout_ms))?;
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_slot.write(slot.into()) };
        Ok(())
    }
}

/// Returns a slot to its pool. Call it once the slot's request is over on this rank (packed and
/// written, or received and unpacked), and only once: the engine must be done with the bytes.
///
/// @param[in] pool    A live pool.
/// @param[in] offset  The slot's offset (MoriTpSlot.offset).
///
/// @return MORI_OK;
///   MORI_ERR_INVALID_ARGUMENT if pool is not a live pool, if offset was a slot that is already
///   free (a double free), or if no slot starts at offset (the message says whether it lies
///   inside a live slot, in free space or past the capacity); nothing changes then;
///   MORI_ERR_PANIC on an internal error. A double free is caught only while the space is still
///   free: once it has been granted again, the offset names the new slot, which a stale second
///   free would return (as with free(3)).
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_pool_free(pool: MoriTpPool, offset: u64) -> MoriStatus {
    ffi_boundary! {
        live_pool(pool)?.free(offset)?;
        Ok(())
    }
}

/// The pool's region and counters now: its base and capacity (what to register with the
/// engine), how its memory was prepared, and the live slots, live bytes, free bytes and largest
/// free slot (free_bytes - largest_free is space that only smaller slots can use).
///
/// @param[in]  pool      A live pool.
/// @param[out] out_info  Receives the state; written only on MORI_OK. Must not be NULL.
///
/// @return MORI_OK;
///   MORI_ERR_NULL_POINTER if out_info is NULL;
///   MORI_ERR_INVALID_ARGUMENT if pool is not a live pool or out_info is misaligned;
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_tp_pool_info(
    pool: MoriTpPool,
    out_info: *mut MoriTpPoolInfo,
) -> MoriStatus {
    ffi_boundary! {
        check_out(out_info, "out_info")?;
        let info = live_pool(pool)?.info();
        let memory = info.memory;
        let flags = if memory.locked { MORI_TP_POOL_LOCKED } else { 0 }
            | if memory.huge_pages { MORI_TP_POOL_HUGE_PAGES } else { 0 };
        let out = MoriTpPoolInfo {
            base: info.base.cast(),
            capacity: info.capacity,
            min_slot: info.min_slot,
            live_slots: info.live_slots as u64,
            live_bytes: info.live_bytes,
            free_bytes: info.free_bytes,
            largest_free: info.largest_free,
            free_blocks: info.free_blocks as u64,
            memory: memory.kind.to_c(),
            flags,
            lock_errno: memory.lock_errno,
            waiters: u32::try_from(info.waiters).unwrap_or(u32::MAX),
        };
        // SAFETY: checked non-NULL and aligned; valid per the caller.
        unsafe { out_info.write(out) };
        Ok(())
    }
}

/// Destroys a pool and frees its region (munmap, or hipFree for device memory). Refused while
/// slots are live, because an engine may still be writing into them: free every slot first
/// (and deregister the region from the engine). Calls waiting in mori_tp_pool_alloc on this
/// pool return MORI_ERR_INVALID_ARGUMENT. After MORI_OK the handle is invalid for good.
///
/// @param[in] pool  A live pool.
///
/// @return MORI_OK;
///   MORI_ERR_INVALID_ARGUMENT if pool is not a live pool (destroyed already, or never
///   created), or if slots are still live (the message names how many, their bytes and the
///   first offset; the pool stays usable);
///   MORI_ERR_PANIC on an internal error.
#[unsafe(no_mangle)]
pub extern "C" fn mori_tp_pool_destroy(pool: MoriTpPool) -> MoriStatus {
    ffi_boundary! {
        // The table stays locked from the check to the removal: no one can look the pool up
        // in between, and calls already holding it see it closed.
        let mut table = pools();
        let live = table.get(&pool).ok_or(Failure::UnknownPool(pool))?;
        live.close()?;
        // The region is freed when the last call still holding the pool returns.
        table.remove(&pool);
        Ok(())
    }
}
