//! The C types and constants of `include/mori_tp.h`: status codes, enum values, flags and the
//! `#[repr(C)]` structs (the plan's rects and segments are the core's own types, renamed for C).

use std::ffi::c_void;

pub use crate::group::{GroupInfo, GroupsTotal};
pub use crate::layout::Layout;
pub use crate::pipeline::LayerRange;
pub use crate::plan::{CopyRect, RankMemory, Segment};
pub use crate::slice::SliceParams;

/// Status code returned by every fallible mori-tp function: MORI_OK (0) or one of the
/// MORI_ERR_* values. The numbers never change; new codes only get added.
pub type MoriStatus = i32;
/// Success.
pub const MORI_OK: MoriStatus = 0;
/// A required pointer argument (or an entry of a pointer array) is NULL.
pub const MORI_ERR_NULL_POINTER: MoriStatus = 1;
/// A field is out of range: zero TP size, page size or item length; rank >= TP size; unknown
/// enum or flag value; inconsistent config fields; a misaligned pointer; a size that overflows
/// 64 bits; a staging region that overlaps a page buffer; a staging pool handle that is not live,
/// a freed offset that starts no live slot, a pool destroyed with live slots.
pub const MORI_ERR_INVALID_ARGUMENT: MoriStatus = 2;
/// total_kv_heads and a TP size divide neither way, or total_kv_heads is 0.
pub const MORI_ERR_TOPOLOGY: MoriStatus = 3;
/// An item length is not a multiple of the page size, bytes per token is not a multiple of the
/// heads per rank, or the two sides disagree on bytes per head (dtype or head_dim differ).
pub const MORI_ERR_LAYOUT_MISMATCH: MoriStatus = 4;
/// A head slice would not fit inside its source or destination token slot.
pub const MORI_ERR_SLICE_OVERFLOW: MoriStatus = 5;
/// A page index is negative, or its page ends past the buffer capacity (or past 2^64 bytes).
pub const MORI_ERR_OUT_OF_BOUNDS: MoriStatus = 6;
/// The caller's output array is too small (*out_len holds the entries needed), a staging
/// region holds fewer bytes than the request needs, or a slot larger than its staging pool's
/// capacity is asked for (no wait can grant it). A pool that is only full now answers
/// MORI_ERR_POOL_FULL instead.
pub const MORI_ERR_BUFFER_TOO_SMALL: MoriStatus = 7;
/// The requested copy backend is not built in, or it has no device.
pub const MORI_ERR_BACKEND_UNAVAILABLE: MoriStatus = 8;
/// The GPU runtime returned an error; the message names the HIP error, buffer and rect.
pub const MORI_ERR_GPU: MoriStatus = 9;
/// An internal error (a bug in mori-tp) was caught at the boundary; please report the message.
/// The process's Rust panic hook (by default: a message on stderr) runs before this is returned;
/// mori-tp installs no hook of its own.
pub const MORI_ERR_PANIC: MoriStatus = 10;
/// A staging pool has no free block for the slot now (mori_tp_pool_try_alloc), or still had
/// none when the wait ended (mori_tp_pool_alloc's timeout_ms): worth retrying once other
/// requests free their slots. The message names the block needed, the largest free block, the
/// live slots and their bytes, and how long the call waited. (Before this code was added, a
/// full pool answered MORI_ERR_BUFFER_TOO_SMALL.) A slot larger than the pool is still
/// MORI_ERR_BUFFER_TOO_SMALL: no retry can grant it.
pub const MORI_ERR_POOL_FULL: MoriStatus = 11;

/// What a (prefill rank, decode rank) pair does; the type of MoriTpSliceConfig.action.
pub type MoriTpAction = u32;
/// The two ranks share no KV head: nothing to move.
pub const MORI_TP_ACTION_NOT_PAIRED: MoriTpAction = 0u32;
/// The prefill rank sends the heads it shares with the decode rank.
pub const MORI_TP_ACTION_SEND: MoriTpAction = 1u32;
/// The ranks share heads, but another prefill rank (a replica) is their sender: nothing to move.
pub const MORI_TP_ACTION_SKIP_REPLICA: MoriTpAction = 2u32;

/// Which copy engine mori_tp_kvcache_send uses; the type of MoriSendOptions.backend.
pub type MoriBackend = u32;
/// HIP when the library is built with it and an AMD GPU is present, else CUDA when it is built
/// with it and an NVIDIA GPU is present, the host otherwise.
pub const MORI_BACKEND_AUTO: MoriBackend = 0u32;
/// CPU copies (memmove), synchronous. Both sides must be host memory.
pub const MORI_BACKEND_HOST: MoriBackend = 1u32;
/// The copy kernel or hipMemcpy2DAsync on the caller's stream (library built with the `hip`
/// feature); see MORI_SEND_COPY_KERNEL for which runs when.
pub const MORI_BACKEND_HIP: MoriBackend = 2u32;
/// The same on NVIDIA GPUs over the CUDA driver API (cuLaunchKernel of the copy kernel as PTX,
/// or cuMemcpy2DAsync), on the caller's stream (a cudaStream_t / CUstream); library built with
/// the `cuda` feature, libcuda.so.1 loaded when first used. Every flag means for it what it
/// means for MORI_BACKEND_HIP, with the CUDA driver's counterpart of each HIP call.
pub const MORI_BACKEND_CUDA: MoriBackend = 3u32;

/// MoriSendOptions.flags bit: wait (hipStreamSynchronize, cuStreamSynchronize) for the copies
/// before returning.
/// Host copies are always complete on return. On a stream that is capturing a graph the wait is
/// not allowed, so such a call is refused with MORI_ERR_GPU before anything is enqueued: capture
/// without this flag, and synchronize after launching the graph.
pub const MORI_SEND_SYNCHRONIZE: u32 = 1u32;
/// MoriSendOptions.flags bit: the HIP backend runs the whole call (every buffer, every rect) as
/// one copy-kernel launch, even where flags 0 would take the per-rect copies, and refuses
/// (MORI_ERR_GPU, nothing written) what keeps the kernel from
/// running: memory it cannot reach, a device without a code object. Without MORI_SEND_COPY_KERNEL
/// and MORI_SEND_MEMCPY2D (flags 0) the HIP backend launches the kernel by itself when the call
/// has at least 2 (buffer, rect) copies, the kernel loads on the stream's device, and every
/// buffer is memory a kernel there surely reaches (that device's memory, hipHostMalloc'd memory,
/// hipHostRegister'd memory at the address hipHostGetDevicePointer returns); otherwise it
/// issues the per-rect copies (MORI_SEND_MEMCPY2D).
///
/// The launch's argument (4 KiB) carries the call's rect table when the table fits in its 4032
/// bytes (calls of up to a few hundred rects): then the launch is the only call on the stream.
/// A bigger table is uploaded first, and on the stream, in order, go: hipMemcpyAsync of the
/// table from pinned host memory into a device buffer the library keeps per device,
/// hipModuleLaunchKernel, then the buffer's fence: hipEventRecord of an event of the library on
/// the stream, which a stream of the library waits for (hipStreamWaitEvent) before recording the
/// buffer's own event; a call that finds every table buffer (32) or lane (16 streams) of the
/// device busy with other streams' copies gets the per-rect copies. On a stream that is
/// capturing a graph, a launch whose table is inside its argument is captured as the graph's
/// kernel node, which keeps its own copy of the argument, so a replay reads nothing of the
/// library's (CUDA, and HIP 5.6 and later, whose runtime captures hipModuleLaunchKernel and has
/// hipStreamGetDevice); with an uploaded table (a replay would read the table buffer after
/// later calls reused it), and with HIP before 5.6, a capturing stream gets the per-rect copies
/// with either flag, whose copy nodes keep nothing of the call. The library never waits
/// for another stream, never frees or synchronizes while sending, and makes its runtime calls in
/// the relaxed capture mode (hipThreadExchangeStreamCaptureMode, restored before it returns), so
/// that it never breaks another thread's graph capture. Every buffer (and a staging region) must
/// be memory a kernel on the stream's device reaches: its device memory, a peer device's memory
/// with peer access enabled, hipHostMalloc'd memory, or hipHostRegister'd memory at the address
/// hipHostGetDevicePointer returns. A kernel that touches other memory aborts the process (in
/// the HSA runtime), so the library first asks hipPointerGetAttributes about each buffer and
/// refuses with MORI_ERR_GPU, writing nothing, what it can tell the kernel cannot reach
/// (pageable host memory; registered memory at its host address; another device's memory that
/// hipDeviceCanAccessPeer says this device cannot reach); whether peer access is enabled it
/// cannot see. The kernel is loaded for the stream's device, once per device (found with
/// hipStreamGetDevice; with HIP 5.2, which lacks it, the stream must belong to the calling
/// thread's current device, and a stream of another device is refused with MORI_ERR_GPU before
/// anything is issued; flags 0 takes the per-rect copies there). The kernel copies in no
/// particular order: a destination byte written twice in one call (a repeated destination page
/// or buffer), or one that is also a source byte, may end as either copy leaves it, where the
/// per-rect path leaves the last copy's. The host backend ignores the flag (its result is the
/// same).
pub const MORI_SEND_COPY_KERNEL: u32 = 2u32;
/// MoriSendOptions.flags bit: the HIP backend issues one hipMemcpy2DAsync(dst + dst_offset,
/// dst_pitch, src + src_offset, src_pitch, width, height, hipMemcpyDefault, stream) per (buffer,
/// rect), in buffer-then-rect order, and nothing else on the stream. Every kind of memory works
/// (pageable host memory makes each copy synchronous), but each copy costs a runtime call, so a
/// fragmented request is far slower than one kernel launch (BENCHMARKS.md). Not together with
/// MORI_SEND_COPY_KERNEL (MORI_ERR_INVALID_ARGUMENT). The host backend ignores the flag.
pub const MORI_SEND_MEMCPY2D: u32 = 4u32;

/// MoriSendOptions.flags bits 16-31: the SM budget, the most blocks of the copy kernel one call
/// may launch (0: no budget). Set it as `flags |= blocks << MORI_SEND_MAX_BLOCKS_SHIFT` with
/// 1 <= blocks <= 65535 (MORI_SEND_MAX_BLOCKS_LIMIT). A pack or unpack that overlaps compute (an
/// attention kernel on another stream) then occupies at most that many blocks, of
/// 256 threads each, and leaves the other SMs or CUs to the compute;
/// the kernel strides over the rest, so the bytes are the same for any budget. Without a budget
/// the grid is the persistent one: at most the blocks the device runs at once (its SM or CU
/// count times the kernel's occupancy, asked once per device with
/// cuOccupancyMaxActiveBlocksPerMultiprocessor or hipModuleOccupancyMaxActiveBlocksPerMultiprocessor);
/// a budget above that changes nothing. The budget bounds the copy kernel only: with
/// MORI_SEND_MEMCPY2D it is refused (MORI_ERR_INVALID_ARGUMENT, the runtime's per-rect copies use
/// copy engines or blit kernels it cannot bound); where flags 0 takes the per-rect copies it does
/// not apply. The host backend ignores it.
pub const MORI_SEND_MAX_BLOCKS_SHIFT: u32 = 16u32;
/// The bits of MoriSendOptions.flags that hold the block budget (see MORI_SEND_MAX_BLOCKS_SHIFT).
pub const MORI_SEND_MAX_BLOCKS_MASK: u32 = 0xFFFF_0000u32;
/// The largest block budget the flags hold.
pub const MORI_SEND_MAX_BLOCKS_LIMIT: u32 = 65535u32;

/// Which sides of a transfer go through a staging region; see mori_tp_plan_transfer.
pub type MoriTpStaging = u32;
/// Pages to pages: the transport copies straight between the page buffers.
pub const MORI_TP_STAGING_NONE: MoriTpStaging = 0u32;
/// The prefill rank packs into its staging region (mori_tp_kvcache_pack); the transport copies
/// from it into the decode pages.
pub const MORI_TP_STAGING_SRC: MoriTpStaging = 1u32;
/// The transport copies from the prefill pages into a staging region on the decode rank, which
/// unpacks it (mori_tp_kvcache_unpack).
pub const MORI_TP_STAGING_DST: MoriTpStaging = 2u32;
/// Both ranks stage: one transport segment per buffer.
pub const MORI_TP_STAGING_BOTH: MoriTpStaging = 3u32;

/// A staging pool: a handle from mori_tp_pool_create, valid until mori_tp_pool_destroy. Handles
/// are never reused, so a destroyed (or made-up) handle is refused with
/// MORI_ERR_INVALID_ARGUMENT instead of touching freed memory. 0 is never a pool.
pub type MoriTpPool = u64;

/// Where a staging pool's region lives; the type of MoriTpPoolOptions.memory.
pub type MoriTpPoolMemory = u32;
/// Host memory from mmap: aligned to 2 MiB, transparent huge pages requested, locked in RAM
/// (mlock) where the process may lock it, and populated before the pool is returned.
pub const MORI_TP_POOL_HOST: MoriTpPoolMemory = 0u32;
/// Device memory from one hipMalloc on the calling thread's current device (library built with
/// the `hip` feature).
pub const MORI_TP_POOL_DEVICE: MoriTpPoolMemory = 1u32;

/// MoriTpPoolInfo.flags bit: the region is locked in RAM (host memory that mlock accepted, or
/// device memory).
pub const MORI_TP_POOL_LOCKED: u32 = 1u32;
/// MoriTpPoolInfo.flags bit: the kernel accepted madvise(MADV_HUGEPAGE) for the region.
pub const MORI_TP_POOL_HUGE_PAGES: u32 = 2u32;

/// The ABI version this header describes; compare with mori_tp_abi_version() at start-up.
pub const MORI_TP_ABI_VERSION: u32 = 1;

/// The library version this header comes from, MAJOR.MINOR.PATCH as mori_tp_version() spells it:
/// for compile-time checks (`#if MORI_TP_VERSION_MINOR >= 2`). The ABI version, not this one,
/// names the shared library (libmori_tp.so.1). The version macros are plain decimal numbers
/// (int), so that they can be stringized; the enum and flag values are unsigned (`1u`),
/// the type of the uint32_t fields that hold them.
pub const MORI_TP_VERSION_MAJOR: u32 = 0;
/// See MORI_TP_VERSION_MAJOR.
pub const MORI_TP_VERSION_MINOR: u32 = 1;
/// See MORI_TP_VERSION_MAJOR.
pub const MORI_TP_VERSION_PATCH: u32 = 0;
/// The three version numbers in one: MAJOR * 1000000 + MINOR * 1000 + PATCH (0.1.0 is 1000,
/// 1.2.3 would be 1002003), for one comparison (`#if MORI_TP_VERSION >= 2000`: 0.2.0 or later).
pub const MORI_TP_VERSION: u32 =
    MORI_TP_VERSION_MAJOR * 1_000_000 + MORI_TP_VERSION_MINOR * 1_000 + MORI_TP_VERSION_PATCH;

/// The inputs of mori_tp_slice_config (the Rust type is [`SliceParams`]).
/// cbindgen:ignore
pub type MoriTpSliceParams = SliceParams;

/// What one (prefill rank, decode rank) pair moves inside every token; filled by
/// mori_tp_slice_config and consumed by the plan and send functions (which re-validate it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpSliceConfig {
    /// A MoriTpAction: MORI_TP_ACTION_SEND, MORI_TP_ACTION_SKIP_REPLICA or
    /// MORI_TP_ACTION_NOT_PAIRED. Only SEND moves bytes.
    pub action: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Global index of the first KV head moved (0 when not SEND).
    pub first_head: u32,
    /// KV heads moved per token (0 when not SEND).
    pub num_heads: u32,
    /// Bytes of one source page (= page_size * bytes_per_token_src).
    pub src_item_len: u64,
    /// Bytes of one destination page (= page_size * bytes_per_token_dst).
    pub dst_item_len: u64,
    /// Bytes of one source token: the source row pitch.
    pub bytes_per_token_src: u64,
    /// Bytes of one destination token: the destination row pitch.
    pub bytes_per_token_dst: u64,
    /// Byte offset of the slice inside a source token (0 when not SEND).
    pub src_head_slice_offset: u64,
    /// Byte offset of the slice inside a destination token (0 when not SEND).
    pub dst_head_slice_offset: u64,
    /// Slice width in bytes: num_heads * bytes per head (0 when not SEND).
    pub heads_bytes_per_token_to_send: u64,
}

/// One strided 2D copy (the Rust type is [`CopyRect`], which C knows as this name).
/// cbindgen:ignore
pub type MoriCopyRect = CopyRect;

/// One contiguous copy (the Rust type is [`Segment`], which C knows as this name).
/// cbindgen:ignore
pub type MoriSegment = Segment;

/// One rank's memory for a request (the Rust type is [`RankMemory`]).
/// cbindgen:ignore
pub type MoriTpMemory = RankMemory;

/// The buffers of one transfer: src[i] on the prefill rank is copied into dst[i] on the decode
/// rank, for i in [0, num_buffers).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriKvBuffers {
    /// num_buffers base pointers on the prefill rank: K of each layer, then V of each layer
    /// (MLA: one latent buffer per layer). No entry may be NULL.
    pub src: *const *const c_void,
    /// The matching buffers on the decode rank, in the same order. No entry may be NULL.
    pub dst: *const *mut c_void,
    /// Number of entries in src and in dst. src and dst may be NULL when it is 0.
    pub num_buffers: usize,
    /// Bytes in each src buffer: every source page must end at or before it.
    pub src_capacity: u64,
    /// Bytes in each dst buffer: every destination page must end at or before it.
    pub dst_capacity: u64,
}

/// How mori_tp_kvcache_send, mori_tp_kvcache_pack and mori_tp_kvcache_unpack run. Pass NULL for the
/// defaults: AUTO backend, no flags, NULL stream.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriSendOptions {
    /// A MoriBackend: MORI_BACKEND_AUTO, MORI_BACKEND_HOST, MORI_BACKEND_HIP or MORI_BACKEND_CUDA.
    pub backend: u32,
    /// Zero or more of MORI_SEND_SYNCHRONIZE, MORI_SEND_COPY_KERNEL and MORI_SEND_MEMCPY2D (not
    /// both of the last two), and a block budget in bits 16-31 (MORI_SEND_MAX_BLOCKS_SHIFT);
    /// other bits are refused. 0 lets the HIP backend choose its copy path (see
    /// MORI_SEND_COPY_KERNEL).
    pub flags: u32,
    /// hipStream_t for the HIP backend, cudaStream_t (CUstream) for the CUDA backend; NULL = the
    /// null stream. Must be NULL for the host backend (including when AUTO falls back to the
    /// host).
    pub stream: *mut c_void,
}

/// One rank's page layout (the Rust type is [`Layout`]).
/// cbindgen:ignore
pub type MoriTpLayout = Layout;

/// What a prefill rank and a decode rank agree on for a transfer between any two layouts:
/// filled by mori_tp_pair_config from the two layouts the ranks exchange at handshake, and
/// consumed by the mori_tp_pair_* functions, which derive it again from src and dst and refuse
/// (MORI_ERR_INVALID_ARGUMENT) one whose other fields differ or whose reserved is not 0.
/// 136 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpPairConfig {
    /// A MoriTpAction, by the ownership rule: only MORI_TP_ACTION_SEND moves bytes.
    pub action: u32,
    /// Global index of the first head moved (0 unless SEND).
    pub first_head: u32,
    /// n: heads moved per token (0 unless SEND).
    pub num_heads: u32,
    /// Local index of first_head on the prefill rank (0 unless SEND).
    pub src_first_local: u32,
    /// Local index of first_head on the decode rank (0 unless SEND).
    pub dst_first_local: u32,
    /// 0.
    pub reserved: u32,
    /// The prefill rank's layout, as given.
    pub src: Layout,
    /// The decode rank's layout, as given.
    pub dst: Layout,
}

/// One request: tokens 0 .. num_tokens - 1 of a sequence. Token k is slot k % page_size of page
/// pages[k / page_size] on each side, with that side's page size, so each side lists
/// ceil(num_tokens / page_size) pages. Only tokens below num_tokens move: the slots after them
/// in a partial last page are never written.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriTpRequest {
    /// ceil(num_tokens / src.page_size) page indices on the prefill rank (int32, >= 0).
    /// NULL only if num_src_pages is 0.
    pub src_pages: *const i32,
    /// Entries in src_pages.
    pub num_src_pages: usize,
    /// ceil(num_tokens / dst.page_size) page indices on the decode rank. NULL only if
    /// num_dst_pages is 0.
    pub dst_pages: *const i32,
    /// Entries in dst_pages.
    pub num_dst_pages: usize,
    /// N: the request's tokens; 0 is an empty request.
    pub num_tokens: u64,
}

/// How mori_tp_pool_create makes a staging pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpPoolOptions {
    /// Bytes of the region: a non-zero multiple of min_slot. A power of two times min_slot lets
    /// one slot take the whole region.
    pub capacity: u64,
    /// The slot unit: a power of two; every slot is a multiple of it. 0 = 65536.
    pub min_slot: u64,
    /// A MoriTpPoolMemory: MORI_TP_POOL_HOST or MORI_TP_POOL_DEVICE.
    pub memory: u32,
    /// 0 (reserved; other values are refused).
    pub flags: u32,
}

/// One slot of a staging pool, from mori_tp_pool_alloc or mori_tp_pool_try_alloc.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoriTpSlot {
    /// Bytes from the region's first byte: what a peer adds to the base it registered. Pass it
    /// to mori_tp_pool_free.
    pub offset: u64,
    /// Bytes granted: the size asked for, rounded up to a multiple of min_slot.
    pub size: u64,
    /// The slot's first byte: the region's base + offset (a device address for device pools).
    pub address: *mut c_void,
}

/// A staging pool's region and counters at one moment (mori_tp_pool_info).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoriTpPoolInfo {
    /// The region's first byte: register [base, base + capacity) with the transfer engine once.
    pub base: *mut c_void,
    /// Bytes in the region.
    pub capacity: u64,
    /// The slot unit.
    pub min_slot: u64,
    /// Slots allocated and not yet freed.
    pub live_slots: u64,
    /// Bytes those slots hold.
    pub live_bytes: u64,
    /// capacity - live_bytes.
    pub free_bytes: u64,
    /// The largest slot mori_tp_pool_try_alloc would grant now; below free_bytes when the free
    /// space is split.
    pub largest_free: u64,
    /// The free blocks free_bytes is split into (at most live_slots + 1).
    pub free_blocks: u64,
    /// The MoriTpPoolMemory of the region.
    pub memory: u32,
    /// MORI_TP_POOL_LOCKED and MORI_TP_POOL_HUGE_PAGES bits.
    pub flags: u32,
    /// The errno mlock failed with (EPERM: not permitted; ENOMEM or EAGAIN: past
    /// RLIMIT_MEMLOCK), or 0 when the region is locked (always 0 for device memory).
    pub lock_errno: i32,
    /// Calls of mori_tp_pool_alloc waiting now for a slot to be freed (the pool was full for
    /// them). Formerly a reserved field that read 0; the layout is unchanged.
    pub waiters: u32,
}

/// What one GPU backend's engines did in this process (mori_tp_gpu_counters_get): copy-kernel
/// launches, and the calls that chose or asked for the kernel but took the per-rect copies
/// (cuMemcpy2DAsync / hipMemcpy2DAsync per rect, far slower for many small rects), in all and
/// per reason. Each reason is also logged once (a warning) when it first happens.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoriTpGpuCounters {
    /// Copy-kernel launches the runtime accepted.
    pub kernel_launches: u64,
    /// Calls that took the per-rect copies instead of the kernel: the sum of the five below.
    pub fallbacks: u64,
    /// ... because the kernel could not be loaded on the device (the error says why; a
    /// transient failure such as out of memory is retried on the next call).
    pub fallbacks_unloadable: u64,
    /// ... because every lane or table buffer of the device was busy (the host ran that many
    /// calls ahead of the GPU; no call waits for the GPU instead).
    pub fallbacks_busy: u64,
    /// ... because the stream belongs to a context other than its device's primary one (a
    /// cuCtxCreate context, or the NULL stream while one is current).
    pub fallbacks_context: u64,
    /// ... because the stream was capturing a graph and the table did not fit in the kernel's
    /// argument (or the runtime does not capture launches).
    pub fallbacks_capture: u64,
    /// ... because a buffer was memory the kernel may not reach (pageable host memory, a peer
    /// without MORI_SEND_COPY_KERNEL), or the stream's device could not be confirmed.
    pub fallbacks_memory: u64,
    /// Failed loads of the copy kernel (each retry that failed counts), its wide entry's (CUDA
    /// 12.1+: tables of 4 to 32 KiB inside the argument) included: after one, that device's such
    /// tables are uploaded instead.
    pub load_failures: u64,
}

/// Where one group sits in its request (the Rust type is [`GroupInfo`]).
/// cbindgen:ignore
pub type MoriTpGroupInfo = GroupInfo;

/// What a whole request of groups needs (the Rust type is [`GroupsTotal`]).
/// cbindgen:ignore
pub type MoriTpGroupsTotal = GroupsTotal;

/// The layers two pipeline stages share (the Rust type is [`LayerRange`]).
/// cbindgen:ignore
pub type MoriTpLayerRange = LayerRange;

/// One group of a request of several groups: one kind of state a sequence carries between a
/// prefill rank and a decode rank (the full-attention KV of some layers, the sliding-window KV
/// of others, a per-token record, a scale buffer, one part of a per-request state slot), with
/// its own pair config, pages, staging mode and buffers. The mori_tp_groups_*
/// functions take an array of them and treat it as one request.
///
/// A state slot is a group of one page per side: request.src_pages and request.dst_pages are
/// the slot index, the layouts' page_stride is the slot stride and their offset is where this
/// part starts inside the slot (page_size = state rows moved as token slots, or 1), and
/// request.num_tokens is the rows moved (page_size, or 1). A sliding window is a group whose
/// request covers only the window's tokens, with first_token the window's first token in the
/// sequence. 232 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoriTpGroup {
    /// The group's pair config, from mori_tp_pair_config of its two layouts (derived again and
    /// refused if edited, as by every mori_tp_pair_* function).
    pub config: MoriTpPairConfig,
    /// A MoriTpStaging: how the group's bytes move through a transfer engine, usually
    /// mori_tp_pair_staging_for(&config). Both ranks must use the same. A state-slot part that
    /// is one run of bytes on both sides (a DS conv state part, an SSM state) is one segment
    /// per buffer unstaged, where that function may answer BOTH: give it MORI_TP_STAGING_NONE.
    pub staging: u32,
    /// 0.
    pub reserved: u32,
    /// Where the request's token 0 sits in the sequence: 0 for a group that holds the whole
    /// sequence or a state slot; a sliding window's first token otherwise. It must be a
    /// multiple of both layouts' page_size, so that the window's first page starts with it
    /// (round a window's start down to a multiple of both page sizes: that moves at most that
    /// many tokens more). It moves no byte: token k of the request is token first_token + k of
    /// the sequence.
    pub first_token: u64,
    /// The group's tokens and page lists, as for mori_tp_pair_segments.
    pub request: MoriTpRequest,
    /// The group's num_buffers buffers on each rank and their capacities. The pointer arrays
    /// are read only by the functions that copy through them: mori_tp_groups_send reads
    /// src and dst; mori_tp_groups_pack reads src of each group whose staging is SRC or
    /// BOTH; mori_tp_groups_unpack reads dst of each group whose staging is DST or BOTH.
    /// Elsewhere they may be NULL. Groups may share buffers (the parts of one state slot, or
    /// a KV page and its scales): each group writes only its own elements.
    pub buffers: MoriKvBuffers,
}
