//! The launch choice of a kernel call: the kernel loaded on the stream's device, the buffers it
//! can reach, the lane and table buffers it takes, and their fence ([`LaunchChoice`]). An `impl`
//! block of [`GpuEngine`], which `engine` calls once it has the call's device.

use std::collections::HashMap;
use std::ffi::c_void;

use super::super::CopyJob;
use super::super::copy_kernel::{KERNEL_NAME, KernelTable, WIDE_KERNEL_NAME};
use super::call::{Context, GpuResult, describe, load_hint, lock};
use super::device::{
    DeviceKernel, Fallback, Kernel, Lane, LaunchChoice, LaunchDevice, MAX_REMEMBERED_BASES, Reach,
    Spares, TableBuffers, Wide,
};
use super::engine::GpuEngine;
use super::runtime::{
    GpuRuntime, GpuStatus, MAX_LANES, MAX_TABLE_SLOTS, MIN_TABLE_BYTES, RESET_SENTINEL_BYTES,
};
use crate::error::Result;

impl<R: GpuRuntime> GpuEngine<R> {
    /// Loads the kernel on the current device, `device`; unloads the module again when the
    /// function is not in it.
    pub(super) fn load_here(&self, device: i32) -> Result<DeviceKernel> {
        let image = self.runtime.kernel_image();
        // SAFETY: the image is the kernel bundle build.rs embedded (or the test runtime's).
        let module = unsafe { self.runtime.module_load_data(image.bytes) }.map_err(|status| {
            let log = self.runtime.module_load_log();
            let log = log.trim();
            let log = if log.is_empty() {
                String::new()
            } else {
                format!("; the driver's log: {log}")
            };
            Context::args(format!(
                "(copy kernel, {} bytes) on device {device}",
                image.bytes.len()
            ))
            .note(format!(
                " (this libmori_tp's copy kernel holds {} {}; {}{log})",
                self.api().kernel_image_what,
                image.targets,
                load_hint(self.api(), status)
            ))
            .error(
                self.api().module_load_data,
                status,
                &describe(&self.runtime, status),
            )
        })?;
        // SAFETY: `module` was just loaded, on the current device.
        let function = unsafe { self.runtime.module_get_function(module, KERNEL_NAME) };
        let function = function.or_gpu(&self.runtime, self.api().module_get_function, || {
            Context::args(format!("({KERNEL_NAME:?}) on device {device}"))
        });
        match function {
            Ok(function) => Ok(DeviceKernel {
                function: function as usize,
                // SAFETY: the function just looked up, on the current device.
                resident: unsafe { self.runtime.resident_blocks(function) },
                sentinel: None,
                slots: Vec::new(),
                broken: Vec::new(),
                lanes: Vec::new(),
                spares: Spares::default(),
                calls: 0,
                known: HashMap::new(),
                probe: None,
                wide: Wide::Untried,
            }),
            Err(error) => {
                // SAFETY: loaded above, on this device; nothing runs it.
                unsafe { self.unload_after_failed_lookup(module) };
                Err(error)
            }
        }
    }

    /// Unloads `module`, whose function could not be found, logging (not returning) a failure:
    /// the lookup's error is the one the caller reports.
    ///
    /// # Safety
    /// `module` was loaded on the current device and nothing runs it.
    unsafe fn unload_after_failed_lookup(&self, module: *mut c_void) {
        // SAFETY: as the caller guarantees.
        if let Err(status) = unsafe { self.runtime.module_unload(module) } {
            log::warn!(
                "{} after a failed {} returned {}",
                self.api().module_unload,
                self.api().module_get_function,
                describe(&self.runtime, status)
            );
        }
    }

    /// True when `table` is too big for the 4 KiB argument but the runtime takes it inside the
    /// wide entry's argument on `device` ([`GpuRuntime::inline_table_bytes`]).
    pub(super) fn wants_wide(&self, table: &KernelTable, device: i32) -> bool {
        !table.is_inline()
            && table.fits_wide()
            && self.runtime.wide_kernel_image().is_some()
            && table.table_len() <= self.runtime.inline_table_bytes(device)
    }

    /// The wide entry's function on `at.device` for `table` when the table travels inside its
    /// argument ([`GpuEngine::wants_wide`]), loaded now on first use; None when it does not, or
    /// when the wide entry did not load on the device (logged and counted once: the table is
    /// uploaded instead).
    pub(super) fn wide_function(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        table: &KernelTable,
    ) -> Result<Option<usize>> {
        if !self.wants_wide(table, at.device) {
            return Ok(None);
        }
        match state.wide {
            Wide::Ready(function) => return Ok(Some(function)),
            Wide::Failed => return Ok(None),
            Wide::Untried => {}
        }
        let loaded = self.on_device(at, || Ok(self.load_wide_here(at.device)))?;
        state.wide = match loaded {
            Ok(function) => Wide::Ready(function),
            Err(error) => {
                self.runtime
                    .kernel_cache()
                    .wide_load_failed(at.device, self.api(), &error);
                Wide::Failed
            }
        };
        Ok(match state.wide {
            Wide::Ready(function) => Some(function),
            _ => None,
        })
    }

    /// Loads the wide entry's module on the current device, `device`, and looks its function
    /// up (the module stays loaded for the process, as the main one does).
    fn load_wide_here(&self, device: i32) -> Result<usize> {
        let Some(image) = self.runtime.wide_kernel_image() else {
            return Err(crate::error::Error::BackendUnavailable {
                reason: "this runtime has no wide copy kernel".into(),
            });
        };
        // SAFETY: the wide image build.rs embedded (or the test runtime's).
        let module = unsafe { self.runtime.module_load_data(image.bytes) }.map_err(|status| {
            let log = self.runtime.module_load_log();
            let log = log.trim();
            Context::args(format!(
                "(wide copy kernel, {} bytes) on device {device}",
                image.bytes.len()
            ))
            .note(format!(
                " (the wide entry holds {} {}{}{log})",
                self.api().kernel_image_what,
                image.targets,
                if log.is_empty() {
                    ""
                } else {
                    "; the driver's log: "
                }
            ))
            .error(
                self.api().module_load_data,
                status,
                &describe(&self.runtime, status),
            )
        })?;
        // SAFETY: `module` was just loaded, on the current device.
        let function = unsafe { self.runtime.module_get_function(module, WIDE_KERNEL_NAME) };
        match function.or_gpu(&self.runtime, self.api().module_get_function, || {
            Context::args(format!("({WIDE_KERNEL_NAME:?}) on device {device}"))
        }) {
            Ok(function) => Ok(function as usize),
            Err(error) => {
                // SAFETY: loaded above, on this device; nothing runs it.
                unsafe { self.unload_after_failed_lookup(module) };
                Err(error)
            }
        }
    }

    /// The device's kernel, loaded now if need be, with its reset sentinel allocated, or checked
    /// to be alive: `hipDeviceReset` frees every allocation of the device (the sentinel, the
    /// table buffers), destroys its streams (the relays) and invalidates the module, so a dead
    /// sentinel makes the engine forget the state and load afresh.
    pub(super) fn device_kernel(&self, at: LaunchDevice) -> Result<Kernel> {
        let cache = self.runtime.kernel_cache();
        // Only the load's own failure is cached: a failed hipSetDevice around it (to the
        // stream's device, or back) is returned, and the next call tries again. A failed switch
        // back after a good load returns its error with the kernel cached.
        let load = || match cache.cached(at.device) {
            Some(cached) => Ok(cached),
            None => self.on_device(at, || {
                Ok(cache.get_or_load(at.device, self.api(), || self.load_here(at.device)))
            }),
        };
        for _ in 0..2 {
            let kernel = match load()? {
                Kernel::Ready(kernel) => kernel,
                unloadable => return Ok(unloadable),
            };
            let mut state = lock(&kernel);
            let Some((base, allocated)) = state.sentinel else {
                // Allocated under the state's lock: one sentinel per state. Its failure is
                // returned, not cached; the next call allocates again.
                state.sentinel = Some(self.on_device(at, || self.allocate_sentinel(at.device))?);
                drop(state);
                return Ok(Kernel::Ready(kernel));
            };
            // After hipDeviceReset the runtime no longer knows the sentinel, or knows the
            // address as part of an allocation of another size.
            let alive = self
                .runtime
                .address_range(base as *mut c_void)
                .is_ok_and(|range| range == (base, allocated));
            if alive {
                drop(state);
                return Ok(Kernel::Ready(kernel));
            }
            drop(state);
            log::debug!(
                "device {}: the copy kernel's reset sentinel is gone ({}?); loading the kernel \
                 again",
                at.device,
                self.api().device_reset
            );
            cache.forget(at.device, &kernel);
        }
        unreachable!("a state loaded afresh has no sentinel yet")
    }

    /// The reset sentinel of `device`, the current device: its address and the size the runtime
    /// reports for it. Kept (not freed) when the size cannot be read.
    pub(super) fn allocate_sentinel(&self, device: i32) -> Result<(usize, usize)> {
        let base = self.runtime.malloc(RESET_SENTINEL_BYTES).or_gpu(
            &self.runtime,
            self.api().malloc,
            || {
                Context::args(format!(
                    "({RESET_SENTINEL_BYTES} bytes for the copy kernel's reset check on device \
                     {device})"
                ))
            },
        )?;
        let (_, allocated) = self.runtime.address_range(base).or_gpu(
            &self.runtime,
            self.api().address_range,
            || Context::args(format!("({base:p})")).note(" (the copy kernel's reset sentinel)"),
        )?;
        Ok((base as usize, allocated))
    }
    /// Where the runtime has no `hipStreamGetDevice`: records the device's probe event on the
    /// stream, which the runtime refuses (`hipErrorInvalidHandle`) when the stream belongs to
    /// another device, so that such a stream is refused before anything is allocated or issued
    /// for it, instead of failing at the launch.
    pub(super) fn probe_stream_device(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
    ) -> Result<()> {
        let event = match state.probe {
            Some(event) => event,
            None => {
                // The current device is `at.device` (assumed), so the event is that device's.
                let event = self.runtime.event_create().or_gpu(
                    &self.runtime,
                    self.api().event_create,
                    || {
                        Context::args(format!("({})", self.api().event_disable_timing)).note(
                            format!(" (the stream check's event on device {})", at.device),
                        )
                    },
                )? as usize;
                state.probe = Some(event);
                event
            }
        };
        // SAFETY: the device's probe event, never destroyed, and the caller's live stream.
        unsafe { self.runtime.event_record(event as *mut c_void, self.stream) }.or_gpu(
            &self.runtime,
            self.api().event_record,
            || {
                Context::args(format!(
                    "(an event of the current device {}, stream {:p})",
                    at.current, self.stream
                ))
                .note(format!(
                    ": this HIP runtime has no hipStreamGetDevice, so mori-tp checks that the \
                     stream belongs to the current device {} by recording an event of that \
                     device on it, which the runtime refuses for a stream of another device; \
                     with MORI_SEND_COPY_KERNEL, make the stream's device current",
                    at.current
                ))
            },
        )
    }

    /// Whether the kernel can reach every buffer of `job`: `Ok(true)` when it can, `Ok(false)`
    /// when [`CopyPath::Auto`] should take the per-rect copies instead, and with
    /// `MORI_SEND_COPY_KERNEL` an error naming the buffer. A base found to be device memory is
    /// remembered with its allocation's identity ([`GpuRuntime::allocation_id`]) and classified
    /// again when that identity changed (the address was freed and reused, for host memory or
    /// another device's) or cannot be told; host memory is asked about on every call.
    pub(super) fn check_reachable(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        job: &CopyJob<'_>,
    ) -> Result<bool> {
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (side, base) in [("source", src as usize), ("destination", dst as usize)] {
                // A failure to tell the identity only costs the full check.
                let id = self
                    .runtime
                    .allocation_id(base as *const c_void, at.device)
                    .ok()
                    .flatten();
                let known = id.and_then(|id| {
                    state
                        .known
                        .get(&base)
                        .filter(|(known, _)| *known == id)
                        .map(|&(_, reach)| reach)
                });
                let reach = match known {
                    Some(reach) => Some(reach),
                    None => match self.check_base(at, side, buffer, base) {
                        Ok(reach) => {
                            match (reach, id) {
                                (Some(reach), Some(id)) => {
                                    if state.known.len() >= MAX_REMEMBERED_BASES {
                                        state.known.clear();
                                    }
                                    state.known.insert(base, (id, reach));
                                }
                                _ => {
                                    state.known.remove(&base);
                                }
                            }
                            reach
                        }
                        Err(error) if self.kernel_required() => return Err(error),
                        Err(error) => {
                            log::debug!("per-rect copies: {error}");
                            return Ok(false);
                        }
                    },
                };
                // The library cannot see whether peer access is enabled: without the flag, a
                // peer's memory gets the copies, which need no peer access.
                if reach == Some(Reach::Peer) && !self.kernel_required() {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Ok when the runtime knows `base` as memory a kernel on `at.device` addresses at `base`
    /// itself: `Some` for device memory (the launch device's own, or a peer's this device can
    /// access), `None` for host memory.
    pub(super) fn check_base(
        &self,
        at: LaunchDevice,
        side: &str,
        buffer: usize,
        base: usize,
    ) -> Result<Option<Reach>> {
        let args = || format!("({side} buffer {buffer}, {base:#x})");
        let api = self.api();
        let advice = format!(
            "the copy kernel faults on memory it cannot reach, and the fault aborts the process; \
             pass device memory, {}'d memory or a {} address, or send without \
             MORI_SEND_COPY_KERNEL",
            api.host_malloc, api.host_get_device_pointer
        );
        let info = self
            .runtime
            .pointer_info(base as *const c_void, at.device)
            .or_gpu(&self.runtime, self.api().pointer_attributes, || {
                Context::args(args())
                    .note(format!(
                        ": the {} runtime does not know this memory (pageable host memory?); \
                         {advice}",
                        api.backend
                    ))
                    .at(buffer, None)
            })?;
        let why = if info.device_pointer.is_null() {
            "host memory that no device can address (not pinned)".to_string()
        } else if info.host_pointer as usize == base && info.device_pointer as usize != base {
            format!(
                "host memory registered with {}, which devices address at {:p}",
                api.host_register, info.device_pointer
            )
        } else if !info.host_pointer.is_null() {
            return Ok(None);
        } else if info.device == at.device {
            return Ok(Some(Reach::Local));
        } else {
            let can = self
                .runtime
                .can_access_peer(at.device, info.device)
                .or_gpu(&self.runtime, self.api().can_access_peer, || {
                    Context::args(format!("(device {}, peer {})", at.device, info.device))
                        .note(format!(
                            " (the {side} buffer {buffer} at {base:#x} is device {}'s memory)",
                            info.device
                        ))
                        .at(buffer, None)
                })?;
            if can {
                return Ok(Some(Reach::Peer));
            }
            format!(
                "memory of device {}, which a kernel on device {} cannot reach ({} says no)",
                info.device, at.device, api.can_access_peer
            )
        };
        // The runtime answered, but the kernel would fault: refused as an invalid value.
        let refused = GpuStatus::ERROR_INVALID_VALUE;
        Err(Context::args(args())
            .note(format!(
                ": {why}; refused as {}: {advice}",
                describe(&self.runtime, refused)
            ))
            .at(buffer, None)
            .error(api.pointer_attributes, refused, api.success))
    }

    /// The lane of the caller's stream on this device: its own, a new one, or the least
    /// recently used idle one taken over; `None` when every lane is busy.
    pub(super) fn lane_for(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
    ) -> Result<Option<usize>> {
        let key = self.stream_key();
        if let Some(lane) = state.lanes.iter().position(|l| l.stream == key) {
            return Ok(Some(lane));
        }
        if state.lanes.len() < MAX_LANES {
            let spares = &mut state.spares;
            let (mark, relay) = self.on_device(at, || {
                let mark = match spares.events.pop() {
                    Some(event) => event,
                    None => self.create_event("a lane's mark")?,
                };
                let relay = self.runtime.stream_create().or_gpu(
                    &self.runtime,
                    self.api().stream_create,
                    || {
                        Context::args(format!("({})", self.api().stream_non_blocking)).note(
                            format!(
                                " (the relay stream of stream {:p} on device {})",
                                self.stream, at.device
                            ),
                        )
                    },
                );
                match relay {
                    Ok(relay) => Ok((mark, relay as usize)),
                    Err(error) => {
                        spares.events.push(mark);
                        Err(error)
                    }
                }
            })?;
            state.lanes.push(Lane {
                stream: key,
                relay,
                mark,
                used: 0,
            });
            return Ok(Some(state.lanes.len() - 1));
        }
        let mut order: Vec<usize> = (0..state.lanes.len()).collect();
        order.sort_by_key(|&l| state.lanes[l].used);
        for lane in order {
            let old = state.lanes[lane].stream;
            if self.stream_idle(state, old)? {
                for slot in state.slots.iter_mut().filter(|s| s.stream == Some(old)) {
                    slot.stream = None;
                }
                state.lanes[lane].stream = key;
                return Ok(Some(lane));
            }
        }
        Ok(None)
    }

    /// True when every pair last used by `stream` is idle.
    pub(super) fn stream_idle(&self, state: &DeviceKernel, stream: usize) -> Result<bool> {
        for slot in state.slots.iter().filter(|s| s.stream == Some(stream)) {
            if !self.buffers_idle(slot)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// True when nothing reads `slot` any more: unused, or its `done` event has passed (asked
    /// without waiting; the event was recorded on a relay, which never captures).
    pub(super) fn buffers_idle(&self, slot: &TableBuffers) -> Result<bool> {
        if slot.stream.is_none() {
            return Ok(true);
        }
        // SAFETY: the pair's event, created by this runtime and never destroyed.
        unsafe { self.runtime.event_query(slot.done as *mut c_void) }.or_gpu(
            &self.runtime,
            self.api().event_query,
            || Context::args("(a copy-kernel table buffer's event)"),
        )
    }

    /// An event of the current device, for `what`.
    pub(super) fn create_event(&self, what: &str) -> Result<usize> {
        self.runtime
            .event_create()
            .map(|event| event as usize)
            .or_gpu(&self.runtime, self.api().event_create, || {
                Context::args(format!("({})", self.api().event_disable_timing))
                    .note(format!(" ({what})"))
            })
    }

    /// Where the call can launch: the stream's lane and an idle pair of at least `bytes`, or
    /// why not. In order: an idle pair that is big enough, the least recently used first; a new
    /// pair while the device has fewer than [`MAX_TABLE_SLOTS`]; an idle pair that is too small,
    /// replaced by a bigger one (the small one kept as a spare). When every pair is busy, the
    /// per-rect copies: the call never waits, least of all for its own stream, whose progress
    /// may depend on what the caller does after this call returns (a `cuStreamWaitValue32` on a
    /// flag the calling thread raises later would make such a wait a deadlock). Idleness is only
    /// asked (`hipEventQuery`), never waited for.
    pub(super) fn choose_launch(
        &self,
        state: &mut DeviceKernel,
        at: LaunchDevice,
        bytes: usize,
    ) -> Result<LaunchChoice> {
        let Some(lane) = self.lane_for(state, at)? else {
            let why = format!(
                "all {MAX_LANES} lanes of device {} have copies in flight",
                at.device
            );
            return Ok(LaunchChoice::PerRect(Fallback::Busy, why));
        };
        let mut usable: Vec<usize> = (0..state.slots.len()).collect();
        usable.sort_by_key(|&i| state.slots[i].used);
        let (big, mut small): (Vec<usize>, Vec<usize>) = usable
            .into_iter()
            .partition(|&i| state.slots[i].capacity >= bytes);
        for &slot in &big {
            if self.buffers_idle(&state.slots[slot])? {
                return Ok(LaunchChoice::Launch { lane, slot });
            }
        }
        let capacity = bytes.max(MIN_TABLE_BYTES).next_power_of_two();
        if state.slots.len() < MAX_TABLE_SLOTS {
            let spares = &mut state.spares;
            let (done, device, host, capacity) = self.on_device(at, || {
                let done = match spares.events.pop() {
                    Some(event) => event,
                    None => self.create_event("a table buffer's fence")?,
                };
                match self.allocate_pair(spares, at, capacity) {
                    Ok((device, host, capacity)) => Ok((done, device, host, capacity)),
                    Err(error) => {
                        spares.events.push(done);
                        Err(error)
                    }
                }
            })?;
            let slot = state.slots.len();
            state.slots.push(TableBuffers {
                device,
                host,
                capacity,
                done,
                stream: None,
                used: 0,
            });
            return Ok(LaunchChoice::Launch { lane, slot });
        }
        small.sort_by_key(|&i| state.slots[i].capacity);
        for &slot in &small {
            if self.buffers_idle(&state.slots[slot])? {
                let (device, host, capacity) =
                    self.on_device(at, || self.allocate_pair(&mut state.spares, at, capacity))?;
                let old = state.slots[slot];
                state.spares.device.push((old.device, old.capacity));
                state.spares.host.push((old.host, old.capacity));
                state.slots[slot] = TableBuffers {
                    device,
                    host,
                    capacity,
                    ..old
                };
                return Ok(LaunchChoice::Launch { lane, slot });
            }
        }
        let own = state
            .slots
            .iter()
            .filter(|s| s.stream == Some(self.stream_key()))
            .count();
        let why = format!(
            "all {MAX_TABLE_SLOTS} table buffers of device {} are busy ({own} with this stream's \
             earlier calls, which it has not run yet); mori-tp never waits for a stream's \
             progress inside a call",
            at.device
        );
        Ok(LaunchChoice::PerRect(Fallback::Busy, why))
    }

    /// A table buffer pair of at least `capacity` bytes on the current device `at.device`, from
    /// the spares where one is big enough: its device and host buffers and the bytes both hold.
    /// What was allocated before a failing step is kept as a spare.
    pub(super) fn allocate_pair(
        &self,
        spares: &mut Spares,
        at: LaunchDevice,
        capacity: usize,
    ) -> Result<(usize, usize, usize)> {
        let what = |size: usize| {
            move || {
                Context::args(format!(
                    "({size} bytes for the copy kernel's table on device {})",
                    at.device
                ))
            }
        };
        let device = match Spares::take(&mut spares.device, capacity) {
            Some(spare) => spare,
            None => (
                self.runtime.malloc(capacity).or_gpu(
                    &self.runtime,
                    self.api().malloc,
                    what(capacity),
                )? as usize,
                capacity,
            ),
        };
        let host = match Spares::take(&mut spares.host, capacity) {
            Some(spare) => Ok(spare),
            None => self
                .runtime
                .host_malloc(capacity)
                .map(|host| (host as usize, capacity))
                .or_gpu(&self.runtime, self.api().host_malloc, what(capacity)),
        };
        match host {
            // A spare bigger than asked for lends the pair its size.
            Ok(host) => Ok((device.0, host.0, device.1.min(host.1))),
            Err(error) => {
                spares.device.push(device);
                Err(error)
            }
        }
    }

    /// After the launch on the caller's stream: the lane's mark recorded there, the relay made
    /// to wait for it, and the pair's `done` recorded on the relay. Without its fence nobody can
    /// tell when the pair is idle: it leaves the ring until a later call on the same stream is
    /// fenced (see [`DeviceKernel::broken`]).
    pub(super) fn fence(&self, state: &mut DeviceKernel, lane: usize, slot: usize) -> Result<()> {
        let Lane { relay, mark, .. } = state.lanes[lane];
        let done = state.slots[slot].done;
        // SAFETY: the lane's event and relay and the pair's event, created by this runtime on
        // the stream's device and never destroyed; the caller's live stream.
        let fenced = unsafe { self.runtime.event_record(mark as *mut c_void, self.stream) }
            .or_gpu(&self.runtime, self.api().event_record, || {
                Context::args(format!("(the lane's event, stream {:p})", self.stream))
                    .note(" (the copy-kernel table buffer's fence)")
            })
            .and_then(|()| {
                // SAFETY: as above.
                unsafe {
                    self.runtime
                        .stream_wait_event(relay as *mut c_void, mark as *mut c_void)
                }
                .or_gpu(&self.runtime, self.api().stream_wait_event, || {
                    Context::args(format!(
                        "(relay stream {relay:#x}, the lane's event of stream {:p}, 0)",
                        self.stream
                    ))
                })
            })
            .and_then(|()| {
                // SAFETY: as above.
                unsafe {
                    self.runtime
                        .event_record(done as *mut c_void, relay as *mut c_void)
                }
                .or_gpu(&self.runtime, self.api().event_record, || {
                    Context::args(format!("(a table buffer's event, relay stream {relay:#x})"))
                })
            });
        state.calls += 1;
        let calls = state.calls;
        state.lanes[lane].used = calls;
        let key = self.stream_key();
        let pair = &mut state.slots[slot];
        pair.used = calls;
        pair.stream = Some(key);
        if fenced.is_err() {
            // Out of the ring until a later fence on this stream passes after it.
            let pair = state.slots.swap_remove(slot);
            state.broken.push(pair);
            return fenced;
        }
        // Pairs broken by an earlier call on this stream: their events recorded on the relay
        // now, behind this call's mark, pass when the stream has run the broken calls too.
        let mut at = 0;
        while at < state.broken.len() {
            let pair = state.broken[at];
            if pair.stream != Some(key) {
                at += 1;
                continue;
            }
            // SAFETY: the pair's event and the lane's relay, as above.
            let recorded = unsafe {
                self.runtime
                    .event_record(pair.done as *mut c_void, relay as *mut c_void)
            };
            if recorded.is_err() {
                at += 1;
                continue;
            }
            let mut pair = state.broken.swap_remove(at);
            pair.used = calls;
            state.slots.push(pair);
        }
        fenced
    }
}
