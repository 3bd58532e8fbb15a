//! The staging pool through the C ABI: create, alloc (waiting and not), free, info, destroy;
//! every misuse refused with its code and a message with the numbers, and nothing changed;
//! handles that are dead stay dead; backpressure between threads instead of failure.

use std::ffi::CStr;
use std::ptr::null_mut;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use mori_tp::ffi::*;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn assert_refused(status: MoriStatus, code: MoriStatus, parts: &[&str]) {
    let message = last_error();
    assert_eq!(status, code, "{message}");
    for part in parts {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
}

fn options(capacity: u64, min_slot: u64) -> MoriTpPoolOptions {
    MoriTpPoolOptions {
        capacity,
        min_slot,
        memory: MORI_TP_POOL_HOST,
        flags: 0,
    }
}

fn create(capacity: u64, min_slot: u64) -> MoriTpPool {
    let mut pool = 0;
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pool_create(&options(capacity, min_slot), &mut pool) };
    assert_eq!(status, MORI_OK, "{}", last_error());
    assert_ne!(pool, 0);
    pool
}

fn info(pool: MoriTpPool) -> MoriTpPoolInfo {
    let mut out = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_pool_info(pool, out.as_mut_ptr()) },
        MORI_OK
    );
    // SAFETY: written on MORI_OK.
    unsafe { out.assume_init() }
}

/// The process's locked memory (`VmLck` of /proc/self/status), in bytes.
fn locked_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmLck:"))
        .expect("a VmLck line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("VmLck: <n> kB");
    kib * 1024
}

fn try_alloc(pool: MoriTpPool, size: u64) -> Result<MoriTpSlot, MoriStatus> {
    let mut slot = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointers.
    match unsafe { mori_tp_pool_try_alloc(pool, size, slot.as_mut_ptr()) } {
        // SAFETY: written on MORI_OK.
        MORI_OK => Ok(unsafe { slot.assume_init() }),
        status => Err(status),
    }
}

fn alloc(pool: MoriTpPool, size: u64, timeout_ms: u64) -> Result<MoriTpSlot, MoriStatus> {
    let mut slot = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointers.
    match unsafe { mori_tp_pool_alloc(pool, size, timeout_ms, slot.as_mut_ptr()) } {
        // SAFETY: written on MORI_OK.
        MORI_OK => Ok(unsafe { slot.assume_init() }),
        status => Err(status),
    }
}

#[test]
fn a_host_pool_hands_out_disjoint_writable_slots_inside_its_region() {
    let pool = create(4 << 20, 0);
    let region = info(pool);
    assert_eq!(region.memory, MORI_TP_POOL_HOST);
    assert_eq!((region.capacity, region.min_slot), (4 << 20, 64 << 10));
    assert_eq!(
        region.base as usize % (2 << 20),
        0,
        "aligned for huge pages"
    );
    // Every page is resident once create returns (mlock, or the populate that replaces it).
    let (base, len) = (region.base, region.capacity as usize);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: [base, base + len) is the pool's live mapping; the vector has a byte per page.
    assert_eq!(
        unsafe { libc::mincore(base, len, resident.as_mut_ptr()) },
        0
    );
    let absent = resident.iter().filter(|&&r| r & 1 == 0).count();
    assert_eq!(
        absent,
        0,
        "{absent} of {} pages not resident",
        resident.len()
    );
    // Locked as reported: the kernel counts the region in VmLck; else the errno says why not.
    if region.flags & MORI_TP_POOL_LOCKED != 0 {
        assert_eq!(region.lock_errno, 0);
        assert!(
            locked_bytes() >= region.capacity,
            "reported locked, but VmLck is {} bytes",
            locked_bytes()
        );
    } else {
        assert!(
            [libc::EPERM, libc::ENOMEM, libc::EAGAIN].contains(&region.lock_errno),
            "not locked, errno {}",
            region.lock_errno
        );
    }
    let slots: Vec<MoriTpSlot> = [100_000, 1 << 20, 1, 700_000]
        .iter()
        .map(|&size| try_alloc(pool, size).unwrap())
        .collect();
    let base = region.base as usize;
    for (i, slot) in slots.iter().enumerate() {
        assert_eq!(slot.address as usize, base + slot.offset as usize);
        assert_eq!(slot.size % (64 << 10), 0);
        assert!(slot.offset + slot.size <= region.capacity);
        // SAFETY: the slot lies inside the pool's live host mapping.
        unsafe { std::ptr::write_bytes(slot.address.cast::<u8>(), i as u8, slot.size as usize) };
        for other in &slots[..i] {
            assert!(
                slot.offset + slot.size <= other.offset || other.offset + other.size <= slot.offset
            );
        }
    }
    let used = info(pool);
    assert_eq!(used.live_slots, 4);
    assert_eq!(used.live_bytes, slots.iter().map(|s| s.size).sum::<u64>());
    assert_eq!(used.free_bytes, used.capacity - used.live_bytes);
    for slot in &slots {
        assert_eq!(mori_tp_pool_free(pool, slot.offset), MORI_OK);
    }
    assert_eq!(info(pool).largest_free, 4 << 20);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

/// Full now, or still full after the wait: MORI_ERR_POOL_FULL (worth retrying), a code of its
/// own; a slot the pool can never hold: MORI_ERR_BUFFER_TOO_SMALL, at once.
#[test]
fn a_full_pool_answers_pool_full_at_once_or_after_the_timeout() {
    assert_eq!(MORI_ERR_POOL_FULL, 11, "the next free status value");
    // SAFETY: a static string.
    let name = unsafe { CStr::from_ptr(mori_tp_status_name(MORI_ERR_POOL_FULL)) };
    assert_eq!(name, c"MORI_ERR_POOL_FULL");
    let pool = create(1 << 20, 64 << 10);
    let whole = try_alloc(pool, 1 << 20).unwrap();
    assert_refused(
        try_alloc(pool, 4096).unwrap_err(),
        MORI_ERR_POOL_FULL,
        &[
            "mori_tp_pool_try_alloc: staging pool full",
            "a slot of 4096 bytes needs a free block of 65536 bytes",
            "1 live slots hold 1048576 of 1048576 bytes",
        ],
    );
    assert_refused(
        alloc(pool, 4096, 20).unwrap_err(),
        MORI_ERR_POOL_FULL,
        &[
            "mori_tp_pool_alloc: staging pool full",
            "still full after waiting",
        ],
    );
    // A slot larger than the pool is refused without waiting for the (long) timeout.
    assert_refused(
        alloc(pool, 2 << 20, 600_000).unwrap_err(),
        MORI_ERR_BUFFER_TOO_SMALL,
        &[
            "larger than the pool's capacity of 1048576 bytes",
            "can never be granted",
        ],
    );
    assert_refused(
        try_alloc(pool, 2 << 20).unwrap_err(),
        MORI_ERR_BUFFER_TOO_SMALL,
        &["can never be granted"],
    );
    assert_eq!(mori_tp_pool_free(pool, whole.offset), MORI_OK);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

#[test]
fn a_waiting_alloc_is_served_when_another_thread_frees() {
    let pool = create(1 << 20, 64 << 10);
    let whole = try_alloc(pool, 1 << 20).unwrap();
    let returned = Arc::new(AtomicBool::new(false));
    let waiter = thread::spawn({
        let returned = Arc::clone(&returned);
        move || {
            let slot = alloc(pool, 512 << 10, 120_000).map(|slot| (slot.offset, slot.size));
            returned.store(true, Ordering::SeqCst);
            slot
        }
    });
    // The pool reports the call waiting (it found the pool full and sleeps until a free):
    // proof that it blocked, whatever the scheduling. Bounded so that a bug cannot hang.
    let deadline = Instant::now() + Duration::from_secs(120);
    while info(pool).waiters == 0 {
        assert!(Instant::now() < deadline, "alloc never waited");
        thread::yield_now();
    }
    assert_eq!(info(pool).waiters, 1);
    assert_eq!(info(pool).live_slots, 1, "the pool is still full");
    assert!(
        !returned.load(Ordering::SeqCst),
        "alloc returned while the pool was full"
    );
    assert_eq!(mori_tp_pool_free(pool, whole.offset), MORI_OK);
    let (offset, size) = waiter.join().unwrap().expect("served by the free");
    assert_eq!((offset, size), (0, 512 << 10), "the freed space");
    assert_eq!(info(pool).waiters, 0);
    assert_eq!(mori_tp_pool_free(pool, offset), MORI_OK);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

#[test]
fn misuse_of_slots_is_refused_and_changes_nothing() {
    let pool = create(1 << 20, 64 << 10);
    let slot = try_alloc(pool, 200_000).unwrap();
    let before = info(pool);
    for (offset, part) in [
        (
            slot.offset + 65536,
            "lies inside the live slot at offset 0 of 262144 bytes",
        ),
        (
            slot.offset + 3,
            "lies inside the live slot at offset 0 of 262144 bytes",
        ),
        (1 << 20, "past the pool's capacity 1048576"),
        (u64::MAX, "past the pool's capacity"),
        (512 << 10, "lies in free space"),
    ] {
        assert_refused(
            mori_tp_pool_free(pool, offset),
            MORI_ERR_INVALID_ARGUMENT,
            &[
                "mori_tp_pool_free: invalid argument: staging pool: no slot starts",
                part,
            ],
        );
        assert_eq!(info(pool), before);
    }
    assert_eq!(mori_tp_pool_free(pool, slot.offset), MORI_OK);
    assert_refused(
        mori_tp_pool_free(pool, slot.offset),
        MORI_ERR_INVALID_ARGUMENT,
        &["offset 0 was a slot of 262144 bytes that is already free (a double free)"],
    );
    assert_refused(
        try_alloc(pool, 0).unwrap_err(),
        MORI_ERR_INVALID_ARGUMENT,
        &["a slot of 0 bytes"],
    );
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

#[test]
fn a_pool_with_live_slots_is_not_destroyed_and_a_destroyed_handle_stays_dead() {
    let pool = create(1 << 20, 64 << 10);
    let slot = try_alloc(pool, 100).unwrap();
    assert_refused(
        mori_tp_pool_destroy(pool),
        MORI_ERR_INVALID_ARGUMENT,
        &["1 slots (65536 bytes, the first at offset 0) are still allocated"],
    );
    // Still usable after the refusal.
    assert_eq!(info(pool).live_slots, 1);
    assert_eq!(mori_tp_pool_free(pool, slot.offset), MORI_OK);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
    let dead = format!("pool {pool} is not a live staging pool");
    assert_refused(
        mori_tp_pool_destroy(pool),
        MORI_ERR_INVALID_ARGUMENT,
        &[&dead],
    );
    assert_refused(
        try_alloc(pool, 1).unwrap_err(),
        MORI_ERR_INVALID_ARGUMENT,
        &[&dead],
    );
    assert_refused(
        alloc(pool, 1, 10).unwrap_err(),
        MORI_ERR_INVALID_ARGUMENT,
        &[&dead],
    );
    assert_refused(
        mori_tp_pool_free(pool, 0),
        MORI_ERR_INVALID_ARGUMENT,
        &[&dead],
    );
    let mut out = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pool_info(pool, out.as_mut_ptr()) };
    assert_refused(status, MORI_ERR_INVALID_ARGUMENT, &[&dead]);
    // Handles are never reused: a new pool gets a new one, and 0 and made-up ones are refused.
    let next = create(1 << 20, 64 << 10);
    assert_ne!(next, pool);
    for forged in [0, u64::MAX, next + 1_000_000] {
        assert_eq!(mori_tp_pool_free(forged, 0), MORI_ERR_INVALID_ARGUMENT);
    }
    assert_eq!(mori_tp_pool_destroy(next), MORI_OK);
}

#[test]
fn bad_options_are_refused_with_their_values() {
    let mut pool = 0;
    for (options, code, part) in [
        (options(0, 4096), MORI_ERR_INVALID_ARGUMENT, "capacity is 0"),
        (
            options(1 << 20, 3000),
            MORI_ERR_INVALID_ARGUMENT,
            "min_slot must be a power of two (capacity 1048576, min_slot 3000)",
        ),
        (
            options(100_000, 4096),
            MORI_ERR_INVALID_ARGUMENT,
            "capacity must be a multiple of min_slot",
        ),
        (
            MoriTpPoolOptions {
                memory: 7,
                ..options(1 << 20, 4096)
            },
            MORI_ERR_INVALID_ARGUMENT,
            "options.memory 7 is not a MoriTpPoolMemory (0 HOST, 1 DEVICE)",
        ),
        (
            MoriTpPoolOptions {
                flags: 1,
                ..options(1 << 20, 4096)
            },
            MORI_ERR_INVALID_ARGUMENT,
            "options.flags 1",
        ),
        (
            options(1 << 62, 4096),
            MORI_ERR_INVALID_ARGUMENT,
            "staging pool: mmap of 4611686018427387904 bytes failed with errno",
        ),
    ] {
        // SAFETY: valid pointers.
        let status = unsafe { mori_tp_pool_create(&options, &mut pool) };
        assert_refused(status, code, &["mori_tp_pool_create", part]);
        assert_eq!(pool, 0, "out_pool written on failure");
    }
    // SAFETY: NULL arguments are refused.
    unsafe {
        assert_eq!(
            mori_tp_pool_create(std::ptr::null(), &mut pool),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            mori_tp_pool_create(&options(1 << 20, 4096), null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            mori_tp_pool_try_alloc(1, 1, null_mut()),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(mori_tp_pool_info(1, null_mut()), MORI_ERR_NULL_POINTER);
    }
}

#[cfg(not(any(feature = "hip", feature = "cuda")))]
#[test]
fn a_device_pool_without_a_gpu_backend_is_backend_unavailable() {
    let mut pool = 0;
    let device = MoriTpPoolOptions {
        memory: MORI_TP_POOL_DEVICE,
        ..options(1 << 20, 4096)
    };
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pool_create(&device, &mut pool) };
    assert_refused(
        status,
        MORI_ERR_BACKEND_UNAVAILABLE,
        &[
            "a device staging pool needs a GPU: no GPU backend is built in",
            "--features hip",
            "--features cuda",
        ],
    );
}

#[cfg(any(feature = "hip", feature = "cuda"))]
#[test]
fn a_device_pool_is_device_memory_or_a_clear_no_device() {
    let mut pool = 0;
    let device = MoriTpPoolOptions {
        memory: MORI_TP_POOL_DEVICE,
        ..options(1 << 20, 4096)
    };
    // SAFETY: valid pointers.
    let status = unsafe { mori_tp_pool_create(&device, &mut pool) };
    if !mori_tp::backend::hip_device_present() && !mori_tp::backend::cuda_device_present() {
        // Each backend built in says why it has no device.
        let mut why = vec!["a device staging pool needs a GPU: "];
        if cfg!(feature = "hip") {
            why.push("the HIP backend needs a HIP device");
        }
        if cfg!(feature = "cuda") {
            why.push("CUDA");
        }
        assert_refused(status, MORI_ERR_BACKEND_UNAVAILABLE, &why);
        return;
    }
    assert_eq!(status, MORI_OK, "{}", last_error());
    let region = info(pool);
    assert_eq!(
        (region.memory, region.capacity),
        (MORI_TP_POOL_DEVICE, 1 << 20)
    );
    let slot = try_alloc(pool, 5000).unwrap();
    assert_eq!(
        slot.address as usize,
        region.base as usize + slot.offset as usize
    );
    assert_eq!(mori_tp_pool_free(pool, slot.offset), MORI_OK);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

#[test]
fn threads_share_one_pool_with_backpressure_and_no_slot_shared() {
    // 8 threads, each wanting up to 3/8 of the pool at once: they must wait for each other, and
    // every byte a thread writes into its slot must still be its own when it frees the slot.
    let pool = create(8 << 20, 64 << 10);
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            thread::spawn(move || {
                for round in 0..30u64 {
                    let size = (64 << 10) * (1 + (round * 5 + t as u64) % 48);
                    let slot = alloc(pool, size, 120_000)
                        .unwrap_or_else(|status| panic!("{status}: {}", last_error()));
                    // SAFETY: the slot is this thread's alone until it frees it.
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(
                            slot.address.cast::<u8>(),
                            slot.size as usize,
                        )
                    };
                    bytes.fill(t + 1);
                    thread::sleep(Duration::from_micros(200));
                    assert!(bytes.iter().all(|&b| b == t + 1), "a slot was shared");
                    assert_eq!(mori_tp_pool_free(pool, slot.offset), MORI_OK);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(info(pool).live_slots, 0);
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}

#[test]
fn try_alloc_takes_the_smallest_free_block_that_fits_not_the_lowest() {
    // mori_tp_pool_try_alloc's documentation: with free units [0, 8) and [9, 11), a 2-unit slot
    // starts at unit 9 (best fit), not at unit 0 (the lowest block that fits).
    let unit = 64u64 << 10;
    let pool = create(16 * unit, unit);
    let a = try_alloc(pool, 8 * unit).unwrap();
    let b = try_alloc(pool, unit).unwrap();
    let c = try_alloc(pool, 2 * unit).unwrap();
    let d = try_alloc(pool, 5 * unit).unwrap();
    assert_eq!(
        [a.offset, b.offset, c.offset, d.offset],
        [0, 8 * unit, 9 * unit, 11 * unit]
    );
    assert_eq!(mori_tp_pool_free(pool, a.offset), MORI_OK);
    assert_eq!(mori_tp_pool_free(pool, c.offset), MORI_OK);
    let slot = try_alloc(pool, 2 * unit).unwrap();
    assert_eq!(slot.offset, 9 * unit, "the 2-unit hole is the best fit");
    let e = try_alloc(pool, 6 * unit).unwrap();
    assert_eq!(e.offset, 0, "the one free block left that holds 6 units");
    for live in [b, d, slot, e] {
        assert_eq!(mori_tp_pool_free(pool, live.offset), MORI_OK);
    }
    assert_eq!(mori_tp_pool_destroy(pool), MORI_OK);
}
