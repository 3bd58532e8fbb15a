//! # mori-tp
//!
//! Moves LLM KV cache between a prefill engine and a decode engine that shard attention over
//! different tensor-parallel (TP) sizes, and gets the head arithmetic right for every valid layout.
//!
//! Read top-down:
//! - [`slice`](mod@slice): which heads each rank owns, which prefill rank sends which head, and
//!   the byte slice a (prefill rank, decode rank) pair moves inside each token. The math lives
//!   here.
//! - [`plan`](mod@plan): a request's page pairs as coalesced strided copies (rects) or contiguous
//!   segments, between two sides that are each page buffers or a dense staging area.
//! - [`staging`](mod@staging): staged transfers for RDMA engines (pack, one short segment list,
//!   unpack).
//! - [`backend`]: engines that perform a call's rects (host copies, HIP `hipMemcpy2DAsync` or
//!   one copy-kernel launch).
//! - [`send`](mod@send): validation of buffers against a plan, then the copies; pack and unpack.
//! - [`ffi`]: the C ABI of `include/mori_tp.h`, a thin layer over the above.
//!
//! `REFERENCE.md` explains the model and the promises (ownership, the sender rule, layouts,
//! staging, the ABI conventions); the C header is the reference for C and C++ users.

pub mod backend;
pub mod error;
pub mod ffi;
pub mod plan;
pub mod send;
pub mod slice;
// Rust API, not C API: cbindgen must not turn the `Staging` enum into an opaque C type (the C
// ABI's staging values are MoriTpStaging in ffi.rs).
/// cbindgen:ignore
pub mod staging;

pub use backend::{Backend, CopyEngine, HostEngine, SendOptions};
pub use error::{Error, ErrorClass, Result, Side};
pub use plan::{CopyRect, Plan, Segment, SideGeometry, plan, plan_segments};
pub use send::{
    CopyJob, KvBuffers, SendReport, pack, pack_host, send, send_host, unpack, unpack_host,
};
pub use slice::{Action, Pairing, SliceConfig, SliceParams, Topology, TpSide, slice_config};
pub use staging::{Staging, plan_transfer, staging_for, staging_len};
