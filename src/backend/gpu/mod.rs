//! The GPU copy engine of the HIP and CUDA backends: one launch of the copy kernel for the whole
//! call, or one 2D copy per (buffer, rect) (`hipMemcpy2DAsync`, `cuMemcpy2DAsync`), on the
//! caller's stream ([`CopyPath`] chooses).
//!
//! The runtime functions the engine calls sit behind [`GpuRuntime`], so that the engine is the
//! same code whether the runtime is the real `libamdhip64` (`LibHip`, built with the `hip`
//! feature), the CUDA driver (`LibCuda`, built with the `cuda` feature, loaded from
//! `libcuda.so.1` when first used), or the recording stand-in of the unit tests, which runs the
//! byte-exact transfer tests on any machine. The trait speaks HIP's terms (a current device,
//! `hipMemcpyDefault`); `LibCuda` maps each to the driver's (the device's primary context,
//! `CU_MEMORYTYPE_UNIFIED`), and [`Api`] gives each runtime's names to the messages. Every
//! runtime call returns `Result<T, GpuStatus>`, and [`GpuResult::or_gpu`] is the one place that
//! turns a failed call into [`Error::Gpu`] (cudarc's split between its `result` layer and the
//! errors its safe layer reports).
//!
//! The rest of this description uses HIP's names; the CUDA driver's are in [`CUDA_API`].
//!
//! **Graph capture of other threads.** While any thread captures a graph in the global mode
//! (PyTorch's default), the runtime refuses `hipMalloc`, `hipHostMalloc`, `hipFree`,
//! `hipHostFree`, `hipStreamSynchronize` and `hipEventSynchronize` from threads in the global
//! mode, and invalidates that capture (clr: `CHECK_STREAM_CAPTURE_SUPPORTED` in
//! hipamd/src/hip_internal.hpp, `Stream::StreamCaptureOngoing` in hip_stream.cpp; CUDA has the
//! same rule). So every call of the engine runs in the relaxed mode
//! (`hipThreadExchangeStreamCaptureMode`), and the caller's mode is restored before it returns.
//!
//! The engine never leaves the caller's current device changed: a copy runs on the device of the
//! caller's stream (for the NULL stream, the caller's current device). The copy kernel is loaded
//! once per device, for the stream's device (`hipStreamGetDevice`, resolved at run time because
//! HIP 5.2 lacks it; without it, the current device, which an event of that device recorded on
//! the stream confirms): `hipModuleLoadData` loads for the current device only, and a launch
//! runs on the stream's device, so when the two differ the engine makes the stream's device
//! current for the load (and for what it allocates there) and switches back.
//!
//! A kernel call is, in order: the capture check (below), the device's kernel state (loaded
//! once; its reset sentinel checked to have survived any `hipDeviceReset`), without
//! `hipStreamGetDevice` the stream's device checked, the buffers the kernel cannot reach refused
//! (device memory checked once per base with `hipPointerGetAttributes`, and another device's
//! memory against `hipDeviceCanAccessPeer`; host memory on every call), then:
//! - a table that fits in the kernel's 4 KiB argument (`KernelTable::is_inline`) travels inside
//!   it: the launch is the only call on the stream, with no table buffer, upload, lane or fence
//!   (the runtime copies the argument during the call);
//! - a table too big for that but within the wide entry's 32,696 bytes travels the same way
//!   inside the wide entry's 32,760-byte argument (`mori_copy_kernel_wide`) where the runtime has
//!   one and the device takes it ([`GpuRuntime::inline_table_bytes`]: CUDA 12.1+ drivers on
//!   sm_70+; HIP stays at 4 KiB). The wide module is loaded on the device when the first such
//!   table comes; if it does not load, the failure is logged and counted (`load_failures`) and
//!   the device's tables are uploaded as below;
//! - a bigger table takes the stream's lane and an idle table buffer pair, then on the stream
//!   one `hipMemcpyAsync` of the table from the pair's pinned host memory into its device
//!   buffer, the launch, and the pair's fence (below).
//!
//! **Graph capture of the caller's stream.** A capturing stream's work is recorded into the
//! graph and replayed at every `hipGraphLaunch`, long after the call returned. An uploaded table
//! would be read from its table buffer at every replay, after later calls reused the buffer, so
//! such a call gets the per-rect copies, whose copy nodes keep nothing of the call. A launch
//! whose table is inside its argument keeps nothing of the library's either (the function stays
//! loaded for the process): it is captured as a kernel node that holds its own copy of the
//! argument, where the runtime captures kernel launches ([`GpuRuntime::captures_kernel_launches`]:
//! CUDA, and HIP from 5.3; HIP 5.2 runs `hipModuleLaunchKernel` at once and leaves it out of the
//! graph, so there a capturing stream gets the per-rect copies). While capturing, the launch is
//! made with the stream's device current (HIP checks a captured launch's function against the
//! current device), and a stream whose device the runtime cannot say (no `hipStreamGetDevice`)
//! gets the per-rect copies: the probe event below would be captured without its device check.
//!
//! **Table buffers and fences.** Each (device, stream) has a lane: a non-blocking stream of the
//! library's own (the relay) and an event. After a launch on the caller's stream `S`, the engine
//! records the lane's event on `S`, makes the relay wait for it (`hipStreamWaitEvent`) and
//! records the pair's `done` event on the relay. So `done` passes when `S` has run the call, it
//! depends on nothing but `S`, and it was recorded on a stream that never captures: asking about
//! it (`hipEventQuery`) or waiting for it never touches a capture of `S` (clr records an event's
//! stream at each `hipEventRecord` and invalidates a capture of that stream when the event is
//! queried or waited for, hip_event.cpp). A call takes a pair whose `done` has passed, asking
//! without waiting; else allocates one more, up to [`MAX_TABLE_SLOTS`] per device; only when all
//! are busy does it wait, and then only for a pair its own stream used last, with the device's
//! state unlocked. So no call waits for another stream, and nothing is freed while the process
//! runs: `hipFree` waits for every stream of the device (clr's `ihipFree`), which may never end
//! while another stream waits for something. There are at most [`MAX_LANES`] lanes per device;
//! a new stream takes over the least recently used idle one, or gets the per-rect copies when
//! none is idle.
//!
//! With `synchronize`, either path first asks whether the stream is capturing a graph and
//! refuses a capturing one before anything is enqueued: the call would end with
//! `hipStreamSynchronize`, which is not allowed during capture.
//!
//! The modules, lowest level first (each imports only those before it, but for `runtime` and
//! `device`, which name each other: the trait hands out the runtime's `KernelCache`):
//! `runtime` (the trait and each runtime's names), `call` (a failed call made an error; the
//! relaxed capture mode), `device` (per-device kernel state, the table-buffer ring and its
//! lanes, the kernel cache and counters, the launch choice), `fork` (the fork guard), `engine`
//! ([`GpuEngine`] and the call it runs), `launch` (a second `impl` block of [`GpuEngine`]: the
//! kernel loaded on the device, the reach checks, the lane and table buffers a call takes,
//! their fence), `open` (an engine for a backend), and `lib_hip` / `lib_cuda` (the real
//! runtimes).

// `device`, `engine` and `runtime` are visible to the crate so that the hidden `gpu_runtime`
// module can re-export what the engine's tests on a recording runtime (tests/gpu_engine.rs)
// reach.
mod call;
pub(crate) mod device;
pub(crate) mod engine;
mod fork;
mod launch;
#[cfg(feature = "cuda")]
mod lib_cuda;
#[cfg(feature = "hip")]
mod lib_hip;
mod open;
pub(crate) mod runtime;

pub(crate) use call::{Context, GpuResult, Relaxed, describe, require_device};
pub use device::GpuCounters;
#[cfg(feature = "cuda")]
pub use lib_cuda::LibCuda;
#[cfg(feature = "hip")]
pub use lib_hip::LibHip;
pub(super) use open::{cuda_device_present, gpu_counters, hip_device_present, open_cuda, open_hip};
pub(crate) use runtime::GpuRuntime;
