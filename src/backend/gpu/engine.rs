//! The engine that runs a call ([`GpuEngine`]): the per-rect copies, the kernel launch, the wait.
//! What a kernel call may do on its device is chosen in the `launch` module, a second `impl`
//! block of the same type.

use std::ffi::{CStr, c_void};

use super::super::copy_kernel::{
    BLOCK_THREADS, KERNEL_NAME, KernelTable, WIDE_KERNEL_NAME, block_limit,
};
use super::super::{CopyEngine, CopyJob, CopyPath, SendOptions};
use super::call::{Context, GpuResult, Relaxed, describe, lock, require_device, size};
use super::device::{Fallback, Kernel, LaunchChoice, LaunchDevice};
use super::fork::{arm_fork_guard, refuse_forked_child};
use super::runtime::{
    Api, GpuRuntime, GpuStatus, HIP_MEMCPY_DEFAULT, KernelLaunch, Memcpy2dAsync, WideKernelLaunch,
};
use crate::error::{Error, Result};

/// Issues one copy-kernel launch per call or one `hipMemcpy2DAsync` per (buffer, rect), on one
/// stream and, when asked, waits for the stream before returning.
#[derive(Debug)]
pub struct GpuEngine<R: GpuRuntime> {
    pub(super) runtime: R,
    pub(super) stream: *mut c_void,
    pub(super) synchronize: bool,
    pub(super) path: CopyPath,
    pub(super) max_blocks: u32,
}

impl<R: GpuRuntime> GpuEngine<R> {
    /// An engine on `runtime` for `options.stream`, `options.synchronize` and `options.path`;
    /// refuses with [`Error::BackendUnavailable`] when the runtime has no device.
    /// `options.backend` is not consulted: choosing the backend is [`super::open_engine`]'s job.
    pub fn new(runtime: R, options: &SendOptions) -> Result<Self> {
        refuse_forked_child(runtime.api())?;
        require_device(&runtime)?;
        arm_fork_guard();
        Ok(GpuEngine {
            runtime,
            stream: options.stream,
            synchronize: options.synchronize,
            path: options.path,
            max_blocks: options.max_blocks,
        })
    }

    /// The runtime the engine calls (a test reads its record here).
    pub fn runtime(&self) -> &R {
        &self.runtime
    }

    /// The engine for another stream, path or wait on the same runtime (a test sends on several
    /// streams through one recorder).
    pub fn set_options(&mut self, options: &SendOptions) {
        self.stream = options.stream;
        self.synchronize = options.synchronize;
        self.path = options.path;
        self.max_blocks = options.max_blocks;
    }

    /// The names of the runtime's calls, for messages.
    pub(super) fn api(&self) -> &'static Api {
        self.runtime.api()
    }

    /// The caller's stream as a lane key.
    pub(super) fn stream_key(&self) -> usize {
        self.stream as usize
    }

    /// True when the caller asked for the kernel (`MORI_SEND_COPY_KERNEL`), so that what keeps
    /// it from running is an error rather than a reason for the per-rect copies.
    pub(super) fn kernel_required(&self) -> bool {
        self.path == CopyPath::Kernel
    }

    /// One `hipMemcpy2DAsync` per (buffer, rect), then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`].
    pub(super) unsafe fn run_rects(&self, job: &CopyJob<'_>) -> Result<()> {
        let (buffers, rects) = (job.num_buffers(), job.num_rects());
        self.check_pitches(job)?;
        for (buffer, (src, dst)) in job.buffers().enumerate() {
            for (index, rect) in job.rects().enumerate() {
                // wrapping_add: the bases are usually device addresses, which Rust knows nothing
                // of; the job validated that every offset lies inside its buffer.
                let args = Memcpy2dAsync {
                    dst: dst.wrapping_add(size(rect.dst_offset)).cast(),
                    dpitch: size(rect.dst_pitch),
                    src: src.wrapping_add(size(rect.src_offset)).cast(),
                    spitch: size(rect.src_pitch),
                    width: size(rect.width),
                    height: size(rect.height),
                    kind: HIP_MEMCPY_DEFAULT,
                    stream: self.stream,
                };
                // SAFETY: the caller guarantees every row of the rect is addressable until the
                // stream has run it; the stream is the caller's, as documented on
                // MoriSendOptions.
                unsafe { self.runtime.memcpy_2d_async(args) }
                    .or_gpu(&self.runtime, self.api().memcpy_2d_async, || {
                        Context::args(format!(
                            "(dst {:p}, dpitch {}, src {:p}, spitch {}, width {}, height {}, \
                             {}, stream {:p})",
                            args.dst,
                            args.dpitch,
                            args.src,
                            args.spitch,
                            args.width,
                            args.height,
                            self.api().memcpy_2d_kind,
                            args.stream
                        ))
                        .note(format!(
                            " (buffer {buffer} of {buffers}, rect {index} of {rects}: {rect:?})"
                        ))
                        .at(buffer, Some(index))
                    })
                    .map_err(|error| self.also_finish(error))?;
            }
        }
        self.finish()
    }

    /// Refuses, before anything is enqueued, a job with a rect whose pitch the runtime's 2D
    /// copy does not take (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`), naming the rect, its pitches and
    /// the limit.
    pub(super) fn check_pitches(&self, job: &CopyJob<'_>) -> Result<()> {
        let Some(max) =
            self.runtime
                .max_pitch()
                .or_gpu(&self.runtime, self.api().memcpy_2d_async, || {
                    Context::default().note(" (asking the device's largest 2D-copy pitch)")
                })?
        else {
            return Ok(());
        };
        let over = job
            .rects()
            .enumerate()
            .find(|(_, rect)| size(rect.src_pitch) > max || size(rect.dst_pitch) > max);
        let Some((index, rect)) = over else {
            return Ok(());
        };
        let refused = GpuStatus::ERROR_INVALID_VALUE;
        Err(Context::args(format!(
            "(dpitch {}, spitch {}, width {}, height {})",
            rect.dst_pitch, rect.src_pitch, rect.width, rect.height
        ))
        .note(format!(
            ": rect {index} of {} has a pitch above the device's largest 2D-copy pitch, {max} \
             bytes (the driver's maximum pitch attribute), which the per-rect copies cannot \
             take; refused as {} before anything was enqueued: send with \
             MORI_SEND_COPY_KERNEL (the kernel has no such limit)",
            job.num_rects(),
            describe(&self.runtime, refused)
        ))
        .at(0, Some(index))
        .error(self.api().memcpy_2d_async, refused, self.api().success))
    }

    /// Waits for the stream when the caller asked to synchronize.
    pub(super) fn finish(&self) -> Result<()> {
        if !self.synchronize {
            return Ok(());
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        unsafe { self.runtime.stream_synchronize(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_synchronize,
            || {
                Context::args(format!("(stream {:p})", self.stream))
                    .note(" (a copy on the stream failed, or earlier work on it did)")
            },
        )
    }

    /// After a failure: wait for what was issued when the caller asked to synchronize (they may
    /// free the buffers as soon as we return), naming a failing wait too. The error keeps its
    /// fields.
    pub(super) fn also_finish(&self, mut error: Error) -> Error {
        if let (Error::Gpu { message, .. }, Err(Error::Gpu { message: also, .. })) =
            (&mut error, self.finish())
        {
            message.push_str("; then ");
            message.push_str(&also);
        }
        error
    }

    /// True when the caller's stream is capturing a graph (the NULL stream never is).
    pub(super) fn stream_is_capturing(&self) -> Result<bool> {
        if self.stream.is_null() {
            return Ok(false);
        }
        // SAFETY: the caller's live stream, as documented on MoriSendOptions.
        unsafe { self.runtime.stream_is_capturing(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_is_capturing,
            || Context::args(format!("(stream {:p})", self.stream)),
        )
    }

    /// With `synchronize`: whether the stream is capturing, refusing a capturing one before
    /// anything is enqueued, since the wait at the end (`hipStreamSynchronize`) is not allowed
    /// during capture (the runtime fails it and the capture with it). `None` without
    /// `synchronize` (nothing asked).
    pub(super) fn refuse_synchronize_while_capturing(&self) -> Result<Option<bool>> {
        if !self.synchronize {
            return Ok(None);
        }
        if !self.stream_is_capturing()? {
            return Ok(Some(false));
        }
        let refused = GpuStatus::ERROR_STREAM_CAPTURE_UNSUPPORTED;
        Err(Context::args(format!("(stream {:p})", self.stream))
            .note(format!(
                ": the stream is capturing a graph, and MORI_SEND_SYNCHRONIZE would end the call \
                 with {}, which a capturing stream does not allow (it fails, and the capture \
                 with it); refused as {} before anything was enqueued: send without \
                 MORI_SEND_SYNCHRONIZE while capturing, and wait for the graph's launch instead",
                self.api().stream_synchronize,
                describe(&self.runtime, refused)
            ))
            .error(
                self.api().stream_is_capturing,
                refused,
                self.api().capture_status_active,
            ))
    }

    /// The device the kernel runs on: the stream's.
    pub(super) fn launch_device(&self) -> Result<LaunchDevice> {
        let current =
            self.runtime
                .current_device()
                .or_gpu(&self.runtime, self.api().get_device, || {
                    Context::default().note(" (the copy kernel is loaded per device)")
                })?;
        if self.stream.is_null() {
            return Ok(LaunchDevice {
                device: current,
                current,
                assumed: false,
            });
        }
        // SAFETY: the caller's live stream, as documented on MoriSendOptions.
        let device = unsafe { self.runtime.stream_device(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_get_device,
            || {
                Context::args(format!("(stream {:p})", self.stream))
                    .note(self.api().stream_get_device_note)
            },
        )?;
        Ok(LaunchDevice {
            device: device.unwrap_or(current),
            current,
            assumed: device.is_none(),
        })
    }

    /// `f` with `at.device` current: the caller's current device when it is that one, else
    /// switched to for `f` (a module loads, and memory, streams and events are created, for the
    /// current device) and switched back, whatever `f` returned.
    pub(super) fn on_device<T>(
        &self,
        at: LaunchDevice,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if at.device == at.current {
            return f();
        }
        let switch = |to: i32, why: &'static str| {
            self.runtime
                .set_device(to)
                .or_gpu(&self.runtime, self.api().set_device, || {
                    Context::args(format!("({to})")).note(format!(" ({why})"))
                })
        };
        switch(
            at.device,
            "to set up the copy kernel on the stream's device",
        )?;
        let done = f();
        let restored = switch(at.current, "back to the caller's current device");
        // A failed restore matters more: the caller's device selection is wrong.
        restored.and(done)
    }
    /// The whole job as one kernel launch on the stream's device, or as per-rect copies where
    /// the launch could not be replayed from a graph (a capturing stream, when the table must be
    /// uploaded or the runtime does not capture kernel launches) and, without
    /// `MORI_SEND_COPY_KERNEL`, wherever the kernel cannot surely run; then the wait when asked.
    ///
    /// # Safety
    /// As for [`CopyEngine::run`]; with [`CopyPath::Kernel`], every buffer must also be memory
    /// the kernel can address (device memory, a peer's with access enabled, or host memory
    /// mapped into the device). `capturing` is whether the stream is capturing, when already
    /// asked.
    pub(super) unsafe fn run_kernel(
        &self,
        job: &CopyJob<'_>,
        capturing: Option<bool>,
    ) -> Result<()> {
        let table = KernelTable::new(job)?;
        let (grid_x, _) = table.grid();
        if grid_x == 0 {
            return self.finish();
        }
        let capturing = match capturing {
            Some(capturing) => capturing,
            None => self.stream_is_capturing()?,
        };
        let per_rect = |kind: Fallback, why: &str| {
            self.runtime
                .kernel_cache()
                .fall_back(kind, self.api(), self.stream, why);
            // SAFETY: as the caller guarantees.
            unsafe { self.run_rects(job) }
        };
        if capturing {
            // A captured upload would keep reading the table buffer at every replay, long after
            // this call reused it; copy nodes keep nothing of the call. A launch whose table is
            // inside its argument keeps nothing of the library's either, where the runtime copies
            // the argument into the graph's node.
            // (A table for the wide entry may fit; whether it loads is known below.)
            if !table.is_inline() && !self.may_go_wide(&table)? {
                return per_rect(
                    Fallback::Capture,
                    &format!(
                        "the stream is capturing a graph, and the table ({} bytes) does not fit in \
                     the kernel's argument",
                        table.table_len()
                    ),
                );
            }
            if !self.runtime.captures_kernel_launches() {
                return per_rect(
                    Fallback::Capture,
                    "the stream is capturing a graph, and this runtime does not capture kernel \
                     launches (HIP before 5.3)",
                );
            }
        }
        // SAFETY: the caller's stream, as documented on MoriSendOptions.
        let foreign = unsafe { self.runtime.foreign_context(self.stream) }.or_gpu(
            &self.runtime,
            self.api().stream_get_device,
            || Context::args(format!("(stream {:p})", self.stream)),
        )?;
        if foreign {
            let why = format!(
                "stream {:p} belongs to a context made with cuCtxCreate (or is the NULL stream \
                 while such a context is current), not to its device's primary context, where \
                 the copy kernel is loaded",
                self.stream
            );
            if !self.kernel_required() {
                return per_rect(Fallback::Context, &why);
            }
            let refused = GpuStatus(201);
            return Err(Context::args(format!("(stream {:p})", self.stream))
                .note(format!(
                    ": {why}; MORI_SEND_COPY_KERNEL refused as {} before anything was enqueued: \
                     send with flags 0 or MORI_SEND_MEMCPY2D (the per-rect copies), or on a \
                     stream of the primary context (as the CUDA runtime, PyTorch and CuPy make \
                     them)",
                    describe(&self.runtime, refused)
                ))
                .error(self.api().stream_get_device, refused, self.api().success));
        }
        let at = self.launch_device()?;
        if capturing && at.assumed {
            // The stream's device cannot be confirmed: an event recorded on a capturing stream
            // is captured before the runtime's check of its device (hipEventRecord_common,
            // hipamd src/hip_event.cpp), so the probe would pass for any stream.
            return per_rect(
                Fallback::Capture,
                "the stream is capturing a graph, and this runtime cannot say which device the \
                 stream belongs to",
            );
        }
        let kernel = match self.device_kernel(at)? {
            Kernel::Ready(kernel) => kernel,
            Kernel::Unloadable(error) if !self.kernel_required() => {
                return per_rect(Fallback::Unloadable, &error.to_string());
            }
            Kernel::Unloadable(error) => return Err(error),
        };
        let mut state = lock(&kernel);
        if at.assumed {
            match self.probe_stream_device(&mut state, at) {
                Ok(()) => {}
                Err(error) if !self.kernel_required() => {
                    drop(state);
                    return per_rect(Fallback::Memory, &error.to_string());
                }
                Err(error) => return Err(error),
            }
        }
        if !self.check_reachable(&mut state, at, job)? {
            drop(state);
            return per_rect(
                Fallback::Memory,
                "a buffer is memory the kernel may not reach",
            );
        }
        let limit = block_limit(self.max_blocks, state.resident);
        if table.is_inline() {
            let function = state.function;
            drop(state);
            // SAFETY: as the caller guarantees.
            return unsafe { self.launch_inline(&table, function, limit, at, capturing) };
        }
        // A table too big for the 4 KiB argument: inside the wide entry's where the runtime has
        // one (CUDA 12.1+), else uploaded.
        if let Some(function) = self.wide_function(&mut state, at, &table)? {
            drop(state);
            // SAFETY: as the caller guarantees.
            return unsafe { self.launch_wide(&table, function, limit, at, capturing) };
        }
        if capturing {
            drop(state);
            return per_rect(
                Fallback::Capture,
                &format!(
                    "the stream is capturing a graph, the table ({} bytes) does not fit in the \
                     kernel's 4 KiB argument, and the wide entry did not load on device {}",
                    table.table_len(),
                    at.device
                ),
            );
        }
        let bytes = table.byte_len();
        let plan = self.choose_launch(&mut state, at, bytes)?;
        let (lane, slot) = match plan {
            LaunchChoice::Launch { lane, slot } => (lane, slot),
            LaunchChoice::PerRect(kind, why) => {
                drop(state);
                return per_rect(kind, &why);
            }
        };
        let pair = state.slots[slot];
        // SAFETY: the pair's pinned buffer holds `capacity >= bytes` bytes, and nothing reads it
        // (it is idle, and reserved to this call while the state is locked).
        table.write_to(unsafe { std::slice::from_raw_parts_mut(pair.host as *mut u8, bytes) });
        let launch = self.launch_of(&table, state.function, pair.device as u64, limit);
        // SAFETY: both buffers hold `bytes` bytes and stay untouched until the pair's fence,
        // recorded below, has passed.
        unsafe {
            self.runtime.memcpy_host_to_device_async(
                pair.device as *mut c_void,
                pair.host as *const c_void,
                bytes,
                self.stream,
            )
        }
        .or_gpu(&self.runtime, self.api().memcpy_htod_async, || {
            Context::args(format!(
                "({:#x}, copy kernel table {:#x}, {bytes} bytes{}, stream {:p})",
                pair.device,
                pair.host,
                self.api().memcpy_htod_kind,
                self.stream
            ))
        })
        .map_err(|error| self.also_finish(error))?;
        // SAFETY: the function was loaded on the stream's device; the caller vouches for the
        // buffers, and the table stays until the fence below has passed.
        let launched = unsafe { self.runtime.launch_kernel(&launch) };
        // Fenced even when the launch failed: the upload may still be reading the pair.
        let fenced = self.fence(&mut state, lane, slot);
        drop(state);
        self.launched(launched, KERNEL_NAME, &launch, &table, at)
            .and(fenced)
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }

    /// The launch of `function` (the copy kernel on the stream's device) for `table`, whose
    /// uploaded bytes are at device address `uploaded` (unused for a table inside the argument),
    /// on at most `limit` blocks (0: no limit; the budget and the persistent grid, see
    /// [`block_limit`]).
    pub(super) fn launch_of(
        &self,
        table: &KernelTable,
        function: usize,
        uploaded: u64,
        limit: u32,
    ) -> KernelLaunch {
        let (args, grid) = table.launch(uploaded, limit);
        KernelLaunch {
            function: function as *mut c_void,
            grid,
            block: BLOCK_THREADS,
            stream: self.stream,
            args,
        }
    }

    /// A table inside the kernel's argument: the launch alone, with no table buffer, upload,
    /// lane or fence (the runtime copies the argument during the call, or into the graph's node
    /// while the stream captures), then the wait when asked. While capturing, the stream's
    /// device is current for the launch: HIP checks a captured launch's function against the
    /// current device (`ihipGraphAddKernelNode`).
    ///
    /// # Safety
    /// As for [`GpuEngine::run_kernel`]; `function` is the copy kernel loaded on `at.device`.
    pub(super) unsafe fn launch_inline(
        &self,
        table: &KernelTable,
        function: usize,
        limit: u32,
        at: LaunchDevice,
        capturing: bool,
    ) -> Result<()> {
        let launch = self.launch_of(table, function, 0, limit);
        // SAFETY: the function was loaded on the stream's device; the argument holds the whole
        // table, and the caller vouches for the buffers.
        let launched = self.on_launch_device(at, capturing, || unsafe {
            self.runtime.launch_kernel(&launch)
        })?;
        self.launched(launched, KERNEL_NAME, &launch, table, at)
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }

    /// Runs `launch_here` where a launch of an inline table goes: on the stream's device when a
    /// capture made elsewhere needs it current, else as things are. Its status is the caller's
    /// to report; a failure to make the device current is reported (and the call finished) here.
    fn on_launch_device(
        &self,
        at: LaunchDevice,
        capturing: bool,
        launch_here: impl FnOnce() -> std::result::Result<(), GpuStatus>,
    ) -> Result<std::result::Result<(), GpuStatus>> {
        if capturing && at.device != at.current {
            self.on_device(at, || Ok(launch_here()))
                .map_err(|error| self.also_finish(error))
        } else {
            Ok(launch_here())
        }
    }

    /// Whether a capturing stream's table too big for the 4 KiB argument may still travel inside
    /// the wide entry's (the runtime has one and the stream's device takes it): only then is the
    /// stream's device asked here.
    fn may_go_wide(&self, table: &KernelTable) -> Result<bool> {
        if !table.fits_wide() || self.runtime.wide_kernel_image().is_none() {
            return Ok(false);
        }
        let at = self.launch_device()?;
        Ok(self.wants_wide(table, at.device))
    }

    /// A table inside the wide entry's argument (CUDA 12.1+): as [`GpuEngine::launch_inline`],
    /// the launch alone, of `function`, the wide entry loaded on `at.device`.
    ///
    /// # Safety
    /// As for [`GpuEngine::launch_inline`].
    pub(super) unsafe fn launch_wide(
        &self,
        table: &KernelTable,
        function: usize,
        limit: u32,
        at: LaunchDevice,
        capturing: bool,
    ) -> Result<()> {
        let (args, grid) = table
            .launch_wide(limit)
            .expect("wide_function checked that the table fits");
        let launch: WideKernelLaunch = KernelLaunch {
            function: function as *mut c_void,
            grid,
            block: BLOCK_THREADS,
            stream: self.stream,
            args,
        };
        // SAFETY: the wide entry was loaded on the stream's device; the argument holds the
        // whole table, and the caller vouches for the buffers.
        let launched = self.on_launch_device(at, capturing, || unsafe {
            self.runtime.launch_kernel_wide(&launch)
        })?;
        self.launched(launched, WIDE_KERNEL_NAME, &launch, table, at)
            .map_err(|error| self.also_finish(error))?;
        self.finish()
    }

    /// A launch of `entry` (the kernel's symbol)'s status as the crate's result, naming the
    /// entry, grid, stream and table on failure.
    pub(super) fn launched<A>(
        &self,
        launched: Result<(), GpuStatus>,
        entry: &CStr,
        launch: &KernelLaunch<A>,
        table: &KernelTable,
        at: LaunchDevice,
    ) -> Result<()> {
        if launched.is_ok() {
            self.runtime.kernel_cache().launched();
        }
        launched.or_gpu(&self.runtime, self.api().launch_kernel, || {
            let note = format!(
                " ({} buffers x {} rects, {} rows per buffer)",
                table.num_buffers(),
                table.num_rects(),
                table.rows_per_buffer()
            );
            Context::args(format!(
                "({}, grid ({}, {}, 1), block ({}, 1, 1), stream {:p}) on device {}",
                entry.to_string_lossy(),
                launch.grid.0,
                launch.grid.1,
                launch.block,
                launch.stream,
                at.device
            ))
            .note(note)
        })
    }
}

impl<R: GpuRuntime> CopyEngine for GpuEngine<R> {
    fn name(&self) -> &'static str {
        self.api().engine
    }

    unsafe fn run(&mut self, job: &CopyJob<'_>) -> Result<()> {
        refuse_forked_child(self.api())?;
        let _relaxed = Relaxed::enter(&self.runtime)?;
        let capturing = self.refuse_synchronize_while_capturing()?;
        let kernel = match self.path {
            CopyPath::Kernel => true,
            CopyPath::Memcpy2d => false,
            CopyPath::Auto => {
                job.num_buffers().saturating_mul(job.num_rects())
                    >= super::super::AUTO_KERNEL_MIN_COPIES
            }
        };
        if kernel {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_kernel(job, capturing) }
        } else {
            // SAFETY: as the caller guarantees for the whole job.
            unsafe { self.run_rects(job) }
        }
    }
}
