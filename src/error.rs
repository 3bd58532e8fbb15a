//! The one error type of the crate.
//!
//! Each variant is one status class of the C ABI (`MORI_ERR_*`), one to one, so the FFI layer maps
//! a variant to its code without looking inside. The payload is the human message: it names the
//! side, the field and the numbers involved, because "invalid layout" alone sends an operator
//! hunting through two engines' configs.

use std::fmt;

/// Which engine of the disaggregated pair a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The engine that computes the KV cache and sends it (`src`).
    Prefill,
    /// The engine that receives the KV cache (`dst`).
    Decode,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill side",
            Side::Decode => "decode side",
        })
    }
}

/// Everything that can go wrong, one variant per `MORI_ERR_*` status class.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A required pointer is NULL (C ABI only). Names the argument.
    #[error("null pointer: {0}")]
    NullPointer(String),
    /// A field is out of range, an enum or flag value is unknown, or config fields disagree.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The KV head count and a TP size divide neither way, or there are no heads.
    #[error("invalid topology: {0}")]
    Topology(String),
    /// The byte layout of a page cannot be split into the heads it should hold, or the two sides
    /// disagree on the bytes of one head (dtype or head_dim differ).
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    /// A head slice would not fit inside its token slot.
    #[error("slice overflow: {0}")]
    SliceOverflow(String),
    /// A page index is negative, or its page ends past the buffer (or past `u64`).
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// The caller's output array holds fewer entries than the result needs.
    #[error(
        "buffer too small: the result needs {needed} entries, the output array holds {capacity}"
    )]
    BufferTooSmall {
        /// Entries the result needs.
        needed: usize,
        /// Entries the caller's array holds.
        capacity: usize,
    },
    /// The requested copy backend is not compiled in, or it has no device.
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),
    /// The GPU runtime returned an error.
    #[error("GPU error: {0}")]
    Gpu(String),
    /// A bug: an internal panic caught at the C boundary.
    #[error("internal error: {0}")]
    Panic(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
