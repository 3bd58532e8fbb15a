//! # mori-tp
//!
//! Moves LLM KV cache between a prefill engine and a decode engine that shard attention over
//! different tensor-parallel (TP) sizes, and gets the head arithmetic right for every valid layout.
//!
//! Read top-down; each module imports only the ones above it:
//! - [`types`](mod@types): the vocabulary (which side, a value per side, what a pair does, which
//!   sides are staged).
//! - [`error`](mod@error): the one error type, a variant per refusal with its numbers.
//! - [`slice`](mod@slice): which heads each rank owns, which prefill rank sends which head, and
//!   the byte slice a (prefill rank, decode rank) pair moves inside each token. The math lives
//!   here.
//! - [`layout`](mod@layout): any page layout (token-major, head-major, strided, offset), the
//!   pair config two ranks agree on (each side's geometry derived once), and requests whose page
//!   sizes differ between the sides, checked once into what planning reads.
//! - [`pipeline`](mod@pipeline): which layers a prefill and a decode pipeline stage share when
//!   the engines split the layers differently.
//! - [`plan`](mod@plan): a request's elements as coalesced strided copies (rects) or contiguous
//!   segments, between two sides that are each page buffers or a dense staging region, in the
//!   order with the fewest segments; the staging modes for RDMA engines. By concern: `entries`
//!   (rects, segments, output arrays), `uniform` and `pair` (the two families' plans), `choice`
//!   (which order), `memory` (a transfer against both ranks' memory), `walk` and `stream` (the
//!   one generator and its sinks).
//! - [`backend`]: the validated job of one call and the engines that perform it (host copies,
//!   HIP `hipMemcpy2DAsync` or one copy-kernel launch).
//! - [`pool`]: a staging pool: one region (host memory from mmap, or device memory from HIP)
//!   registered with a transfer engine once, slots handed out per request.
//! - [`send`](mod@send): send, pack and unpack: validate buffers and staging, then run a job.
//! - [`group`](mod@group): a request of several groups (full and sliding-window KV, per-token
//!   records, scales, state slots), each its own pair config and pages, planned and moved as
//!   one request.
//! - [`ffi`]: the C ABI of `include/mori_tp.h`, a thin layer over the above.
//! - `gpu_runtime` (hidden, not API): the GPU engine's runtime interface re-exported, so that
//!   integration tests drive the engine on a stand-in runtime.
//!
//! `REFERENCE.md` explains the model and the promises (ownership, the sender rule, layouts,
//! staging, the ABI conventions); the C header is the reference for C and C++ users.

pub mod backend;
pub mod error;
pub mod ffi;
// Not API: the GPU engine's runtime interface, for the integration tests (tests/gpu_engine.rs)
// and a downstream runtime model; hidden, outside semver, and not C API.
#[doc(hidden)]
/// cbindgen:ignore
pub mod gpu_runtime;
pub mod group;
pub mod layout;
pub mod pipeline;
pub mod plan;
// Rust API: the C ABI's pool functions are in ffi.
/// cbindgen:ignore
pub mod pool;
pub mod send;
pub mod slice;
// Rust API, not C API: cbindgen must not turn these enums into opaque C types (the C ABI's
// values are the MoriTp* integer constants in ffi).
/// cbindgen:ignore
pub mod types;

pub use backend::{
    AUTO_KERNEL_MIN_COPIES, Backend, CopyEngine, CopyJob, CopyPath, HostCopies, HostEngine,
    KvBuffers, SendOptions, SendReport,
};
pub use error::{Error, ErrorClass, Result};
pub use group::{
    Group, GroupBuffers, GroupInfo, GroupsPlan, GroupsTotal, pack_groups, send_groups,
    unpack_groups,
};
pub use layout::{
    CheckedRequest, Layout, Nesting, PageEnd, PairConfig, PairSide, Request, ValidLayout,
    pair_config,
};
pub use pipeline::{LayerRange, shared_layers};
pub use plan::{
    CopyRect, PairPlan, RankMemory, Segment, SlicePlan, Walk, check_pair_transfer, check_transfer,
    pair_plan, pair_segments, pair_staging_for, plan, plan_segments, plan_transfer, staging_for,
    staging_len,
};
pub use pool::{PoolInfo, Slot, StagingPool};
pub use send::{
    pack, pack_host, pack_host_with, pack_into, pack_into_host, send, send_host, send_host_with,
    unpack, unpack_from, unpack_from_host, unpack_host, unpack_host_with,
};
pub use slice::{
    IntoValid, Pairing, SliceConfig, SliceParams, Topology, TpSide, ValidConfig, slice_config,
};
pub use types::{Action, Side, Sides, Staging};
