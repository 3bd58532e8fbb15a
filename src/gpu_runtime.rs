//! The GPU engine's runtime interface: the [`GpuRuntime`] trait the engine calls instead of
//! libamdhip64 or libcuda, the values that cross it, the engine itself, the copy kernel's
//! argument and table, and a staging pool's device memory.
//!
//! Public only so that the integration tests (`tests/gpu_engine.rs`, on a recording stand-in
//! runtime) and a downstream runtime model can drive the engine on a stand-in runtime. It is not
//! part of the API: not covered by semver, hidden from the documentation, and not part of the C
//! ABI (cbindgen skips it). Every item lives in `backend` or `pool`; this module only re-exports
//! them, and nothing in the library imports through it.

pub use crate::backend::copy_kernel::{
    BLOCK_THREADS, INLINE_TABLE_BYTES, KernelArgs, KernelArgsOf, KernelTable, TableRect,
    WIDE_ARGS_BYTES, WIDE_INLINE_TABLE_BYTES, WIDE_KERNEL_NAME, WideKernelArgs, block_limit,
    decode, inline_bytes,
};
pub use crate::backend::gpu::device::KernelCache;
pub use crate::backend::gpu::engine::GpuEngine;
pub use crate::backend::gpu::runtime::{
    Api, CaptureMode, GpuRuntime, GpuStatus, HIP_API, HIP_MEMCPY_DEFAULT, KernelImage,
    KernelLaunch, MAX_LANES, MAX_TABLE_SLOTS, MIN_TABLE_BYTES, Memcpy2dAsync, PointerInfo,
    RESET_SENTINEL_BYTES, WideKernelLaunch,
};
pub use crate::pool::device::{DeviceMemory, POOL_TAIL_BYTES};
