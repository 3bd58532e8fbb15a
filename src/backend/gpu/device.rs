//! What the engine keeps per device: the copy kernel's state ([`DeviceKernel`]: the function,
//! the reset sentinel, the ring of table buffers and the lanes that fence them), the per-runtime
//! cache of it ([`KernelCache`]) with its counters, and the device a call runs on with what it
//! may do there ([`LaunchChoice`]).

use super::call::{PERMANENT_LOAD_FAILURES, lock};
use super::runtime::Api;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// One table buffer pair of a device: pinned host memory the table is written into, device
/// memory it is uploaded to, and the event recorded on a lane's relay stream after the last
/// launch that read them. Addresses and handles as integers, so that the state is `Send`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TableBuffers {
    pub(super) device: usize,
    pub(super) host: usize,
    /// Table bytes both buffers hold.
    pub(super) capacity: usize,
    /// `hipEventRecord`ed on the relay of the lane of `stream` after the pair's last use.
    pub(super) done: usize,
    /// The caller's stream of the pair's last use (None: unused since made or since that
    /// stream's lane was handed on, so idle).
    pub(super) stream: Option<usize>,
    /// When the pair was last used (the device's call counter).
    pub(super) used: u64,
}

/// A caller's stream with table buffers in flight on one device: its relay, a non-blocking
/// stream of the library that waits for the caller's stream and records the pairs' `done`
/// events, and the event the caller's stream records for the relay to wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Lane {
    /// The caller's stream (0: the NULL stream).
    pub(super) stream: usize,
    pub(super) relay: usize,
    pub(super) mark: usize,
    pub(super) used: u64,
}

/// How the kernel reaches a buffer base found to be device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reach {
    /// Memory of the launch's own device.
    Local,
    /// Another device's memory that this device can reach once peer access is enabled
    /// (`hipDeviceCanAccessPeer`), which the library cannot see.
    Peer,
}

/// Buffers the library allocated and no longer uses, kept for later pairs and lanes instead of
/// freed (`hipFree` waits for every stream of the device).
#[derive(Debug, Default)]
pub(super) struct Spares {
    pub(super) device: Vec<(usize, usize)>,
    pub(super) host: Vec<(usize, usize)>,
    pub(super) events: Vec<usize>,
}

impl Spares {
    /// The smallest spare buffer of `list` of at least `size` bytes, taken out.
    pub(super) fn take(list: &mut Vec<(usize, usize)>, size: usize) -> Option<(usize, usize)> {
        let at = (0..list.len())
            .filter(|&i| list[i].1 >= size)
            .min_by_key(|&i| list[i].1)?;
        Some(list.swap_remove(at))
    }
}

/// The copy kernel's state on one device: its function (the module stays loaded for the
/// process), the reset sentinel, the table buffer pairs and lanes, and the buffer bases already
/// found to be device memory. Nothing is ever freed: a stream may still run the kernel, and
/// `hipFree` would wait for every stream of the device.
#[derive(Debug)]
pub struct DeviceKernel {
    pub(super) function: usize,
    /// The reset sentinel's address and the size the runtime reported for it.
    pub(super) sentinel: Option<(usize, usize)>,
    pub(super) slots: Vec<TableBuffers>,
    /// Pairs whose fence could not be recorded, with the stream of that call: nobody can tell
    /// when they are idle, so they are out of the ring (and do not count against
    /// [`MAX_TABLE_SLOTS`]) until a later call on the same stream records its fence: a stream
    /// runs its work in order, so a fence recorded after that call's passes after the broken
    /// call too, and the pair comes back with it.
    pub(super) broken: Vec<TableBuffers>,
    pub(super) lanes: Vec<Lane>,
    pub(super) spares: Spares,
    /// Calls that took a pair (orders the pairs and lanes by last use).
    pub(super) calls: u64,
    /// Bases found to be device memory, with the identity of the allocation they were found in
    /// ([`GpuRuntime::allocation_id`]): a base whose allocation changed is classified again.
    pub(super) known: HashMap<usize, (u64, Reach)>,
    /// An event of this device, recorded on a caller's stream to check that the stream belongs
    /// to the device where the runtime cannot say (no `hipStreamGetDevice`); made on first use.
    pub(super) probe: Option<usize>,
    /// The blocks the device runs at once ([`GpuRuntime::resident_blocks`]): the persistent
    /// grid's limit.
    pub(super) resident: Option<u32>,
    /// The wide entry on this device (CUDA 12.1+), loaded when the first table that needs it
    /// comes.
    pub(super) wide: Wide,
}

/// The wide entry of a device's kernel state ([`GpuRuntime::wide_kernel_image`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wide {
    /// Not loaded yet.
    Untried,
    /// Loaded: `mori_copy_kernel_wide`'s function.
    Ready(usize),
    /// Its load failed (logged and counted in [`GpuCounters::load_failures`]): tables too big for
    /// the 4 KiB argument are uploaded on this device, as with an older driver, and the load is
    /// not tried again while this state lives.
    Failed,
}

/// Base addresses remembered as reachable per device before the set starts over.
pub(super) const MAX_REMEMBERED_BASES: usize = 1 << 16;

/// What the cache holds for a device.
#[derive(Debug)]
pub(super) enum Entry {
    Ready(Arc<Mutex<DeviceKernel>>),
    /// The load failed for a reason that does not change while the process runs (the image has
    /// no code for the device, or no kernel): the error is returned again without retrying.
    Failed(Error),
}

/// The kernel of a device: its state, or why it cannot be loaded there now.
#[derive(Debug)]
pub(super) enum Kernel {
    Ready(Arc<Mutex<DeviceKernel>>),
    Unloadable(Error),
}

impl Entry {
    pub(super) fn kernel(&self) -> Kernel {
        match self {
            Entry::Ready(kernel) => Kernel::Ready(kernel.clone()),
            Entry::Failed(error) => Kernel::Unloadable(error.clone()),
        }
    }
}

/// Why a kernel call took the per-rect copies instead ([`GpuCounters`] counts each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// The kernel could not be loaded on the device (now, or for the process).
    Unloadable,
    /// Every lane or table buffer of the device was busy.
    Busy,
    /// The stream belongs to a context other than its device's primary one (CUDA).
    Context,
    /// The stream is capturing a graph, and the launch could not be captured safely.
    Capture,
    /// A buffer is memory the kernel may not reach, or the stream's device is not known.
    Memory,
}

impl Fallback {
    const ALL: [Fallback; 5] = [
        Fallback::Unloadable,
        Fallback::Busy,
        Fallback::Context,
        Fallback::Capture,
        Fallback::Memory,
    ];
}

/// What one runtime's engines did in this process ([`KernelCache::counters`]): the copy
/// kernel's launches, the calls that took the per-rect copies instead of it (in all and per
/// [`Fallback`]), and the failed loads of the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Copy-kernel launches that the runtime accepted.
    pub kernel_launches: u64,
    /// Calls that chose or asked for the kernel and took the per-rect copies: the sum of the
    /// five below.
    pub fallbacks: u64,
    /// ... because the kernel could not be loaded.
    pub fallbacks_unloadable: u64,
    /// ... because every lane or table buffer of the device was busy.
    pub fallbacks_busy: u64,
    /// ... because the stream is of a context other than its device's primary one.
    pub fallbacks_context: u64,
    /// ... because the stream was capturing a graph.
    pub fallbacks_capture: u64,
    /// ... because a buffer was memory the kernel may not reach (or the stream's device unknown).
    pub fallbacks_memory: u64,
    /// Failed loads of the copy kernel (each retried one counts), its wide entry's included.
    pub load_failures: u64,
}

/// The counters behind [`GpuCounters`], and whether each fallback was logged yet.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) launches: AtomicU64,
    pub(super) fallbacks: [AtomicU64; 5],
    pub(super) logged: [AtomicBool; 5],
    pub(super) load_failures: AtomicU64,
}

/// The copy kernel's state per device, for the life of the process, and its counters.
#[derive(Debug, Default)]
pub struct KernelCache {
    pub(super) devices: Mutex<Vec<(i32, Entry)>>,
    pub(super) counters: Counters,
}

impl KernelCache {
    /// An empty cache.
    pub const fn new() -> Self {
        KernelCache {
            devices: Mutex::new(Vec::new()),
            counters: Counters {
                launches: AtomicU64::new(0),
                fallbacks: [const { AtomicU64::new(0) }; 5],
                logged: [const { AtomicBool::new(false) }; 5],
                load_failures: AtomicU64::new(0),
            },
        }
    }

    /// The counters now.
    pub fn counters(&self) -> GpuCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let per = |f: Fallback| get(&c.fallbacks[f as usize]);
        GpuCounters {
            kernel_launches: get(&c.launches),
            fallbacks: c.fallbacks.iter().map(get).sum(),
            fallbacks_unloadable: per(Fallback::Unloadable),
            fallbacks_busy: per(Fallback::Busy),
            fallbacks_context: per(Fallback::Context),
            fallbacks_capture: per(Fallback::Capture),
            fallbacks_memory: per(Fallback::Memory),
            load_failures: get(&c.load_failures),
        }
    }

    /// Counts one fallback for `why`, and logs the first of each kind as a warning (later ones
    /// at the debug level), so that no path change is silent.
    pub(super) fn fall_back(&self, kind: Fallback, api: &Api, stream: *mut c_void, why: &str) {
        debug_assert!(Fallback::ALL.contains(&kind));
        let c = &self.counters;
        c.fallbacks[kind as usize].fetch_add(1, Ordering::Relaxed);
        if !c.logged[kind as usize].swap(true, Ordering::Relaxed) {
            log::warn!(
                "mori-tp ({}): stream {stream:p} takes the per-rect copies instead of the copy \
                 kernel: {why} (logged once per reason; mori_tp_gpu_counters_get counts every \
                 such call)",
                api.backend
            );
        } else {
            log::debug!("stream {stream:p}: per-rect copies instead of the copy kernel: {why}");
        }
    }

    /// Counts a failed load of the wide entry on `device`, and logs it as a warning: the
    /// device's tables too big for the 4 KiB argument are uploaded instead, so the fallback is
    /// never silent.
    pub(super) fn wide_load_failed(&self, device: i32, api: &Api, error: &Error) {
        self.counters.load_failures.fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "mori-tp ({}): the copy kernel's wide entry (a 32 KiB argument) did not load on \
             device {device}: {error}; tables of 4 to 32 KiB are uploaded on this device instead \
             (one host-to-device copy and a fence each), as with a driver older than CUDA 12.1 \
             (counted in mori_tp_gpu_counters_get's load_failures)",
            api.backend
        );
    }

    /// Counts a launch the runtime accepted.
    pub(super) fn launched(&self) {
        self.counters.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// What is cached for `device`, if anything.
    pub(super) fn cached(&self, device: i32) -> Option<Kernel> {
        lock(&self.devices)
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, entry)| entry.kernel())
    }

    /// The kernel cached for `device`, or the one `load` returns, which is cached. A failure
    /// is cached only when no retry can change it ([`PERMANENT_LOAD_FAILURES`], or a module
    /// without the kernel); any other (out of memory, a missing JIT library) is returned and
    /// the next call loads again. `load` is the load itself (`hipModuleLoadData`,
    /// `hipModuleGetFunction`); what surrounds it (making the device current) stays outside.
    /// Loads are serialised: they are rare.
    pub(super) fn get_or_load(
        &self,
        device: i32,
        api: &Api,
        load: impl FnOnce() -> Result<DeviceKernel>,
    ) -> Kernel {
        let mut devices = lock(&self.devices);
        if let Some((_, entry)) = devices.iter().find(|(d, _)| *d == device) {
            return entry.kernel();
        }
        let entry = match load() {
            Ok(kernel) => Entry::Ready(Arc::new(Mutex::new(kernel))),
            Err(mut error) => {
                self.counters.load_failures.fetch_add(1, Ordering::Relaxed);
                let permanent = match &error {
                    Error::Gpu { call, status, .. } => {
                        *call == api.module_get_function || PERMANENT_LOAD_FAILURES.contains(status)
                    }
                    _ => false,
                };
                if let Error::Gpu { message, .. } = &mut error {
                    message.push_str(if permanent {
                        " (no retry can change this: mori-tp does not load the copy kernel on \
                         this device again in this process)"
                    } else {
                        " (mori-tp tries to load the copy kernel again on the next call)"
                    });
                }
                log::warn!("mori-tp: {error}");
                if !permanent {
                    return Kernel::Unloadable(error);
                }
                Entry::Failed(error)
            }
        };
        let kernel = entry.kernel();
        devices.push((device, entry));
        kernel
    }

    /// Forgets `device`'s state if it is still `stale`, so that the next call loads afresh.
    pub(super) fn forget(&self, device: i32, stale: &Arc<Mutex<DeviceKernel>>) {
        lock(&self.devices).retain(|(d, entry)| {
            !(*d == device && matches!(entry, Entry::Ready(k) if Arc::ptr_eq(k, stale)))
        });
    }
}

/// The device a kernel call runs on, and how the engine knows.
#[derive(Clone, Copy, Debug)]
pub(super) struct LaunchDevice {
    /// The stream's device (the current one for the NULL stream, or when the runtime cannot
    /// say).
    pub(super) device: i32,
    /// The calling thread's current device.
    pub(super) current: i32,
    /// True when the stream is not NULL but the runtime has no `hipStreamGetDevice`, so
    /// `device` is the current device by assumption, which [`GpuEngine::probe_stream_device`]
    /// checks before anything is allocated or issued.
    pub(super) assumed: bool,
}

/// What a kernel call found it can do before anything is allocated or enqueued.
pub(super) enum LaunchChoice {
    /// Launch on the lane at this index with the pair at that index, idle now (the state stays
    /// locked until the fence is recorded).
    Launch { lane: usize, slot: usize },
    /// The per-rect copies, for this reason.
    PerRect(Fallback, String),
}
