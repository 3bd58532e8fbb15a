//! The one error type of the crate.
//!
//! Every variant carries the numbers that explain it, so a Rust caller (the CLI, a connector)
//! can act on a refusal without parsing text; [`Error::class`] groups the variants into the status
//! classes of the C ABI (`MORI_ERR_*`). The message (`Display`) names the side, the field and the
//! numbers, because "invalid layout" alone sends an operator hunting through two engines' configs.
//! Conditions only a C caller can create (a NULL argument, a short output array, a caught panic)
//! are not here: the FFI layer adds them.

#![forbid(unsafe_code)]

use std::fmt;

use crate::slice::Action;

/// Which engine of the disaggregated pair a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The engine that computes the KV cache and sends it (`src`).
    Prefill,
    /// The engine that receives the KV cache (`dst`).
    Decode,
}

impl Side {
    /// The other engine.
    pub fn other(self) -> Side {
        match self {
            Side::Prefill => Side::Decode,
            Side::Decode => Side::Prefill,
        }
    }

    /// The config's name for this side's item length.
    fn item_len_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_item_len",
            Side::Decode => "dst_item_len",
        }
    }

    /// The config's name for this side's bytes per token.
    fn bytes_per_token_field(self) -> &'static str {
        match self {
            Side::Prefill => "bytes_per_token_src",
            Side::Decode => "bytes_per_token_dst",
        }
    }

    /// The config's name for this side's head slice offset.
    fn slice_offset_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_head_slice_offset",
            Side::Decode => "dst_head_slice_offset",
        }
    }

    /// The name of this side's buffer capacity.
    pub(crate) fn capacity_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_capacity",
            Side::Decode => "dst_capacity",
        }
    }

    /// The name of this side's buffer array.
    fn buffers_field(self) -> &'static str {
        match self {
            Side::Prefill => "src",
            Side::Decode => "dst",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill side",
            Side::Decode => "decode side",
        })
    }
}

/// The status classes of the C ABI, one per `MORI_ERR_*` code that the core can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// `MORI_ERR_NULL_POINTER`.
    NullPointer,
    /// `MORI_ERR_INVALID_ARGUMENT`.
    InvalidArgument,
    /// `MORI_ERR_TOPOLOGY`.
    Topology,
    /// `MORI_ERR_LAYOUT_MISMATCH`.
    LayoutMismatch,
    /// `MORI_ERR_SLICE_OVERFLOW`.
    SliceOverflow,
    /// `MORI_ERR_OUT_OF_BOUNDS`.
    OutOfBounds,
    /// `MORI_ERR_BUFFER_TOO_SMALL`.
    BufferTooSmall,
    /// `MORI_ERR_BACKEND_UNAVAILABLE`.
    BackendUnavailable,
    /// `MORI_ERR_GPU`.
    Gpu,
}

impl ErrorClass {
    /// The prefix every message of the class starts with.
    pub fn label(self) -> &'static str {
        match self {
            ErrorClass::NullPointer => "null pointer",
            ErrorClass::InvalidArgument => "invalid argument",
            ErrorClass::Topology => "invalid topology",
            ErrorClass::LayoutMismatch => "layout mismatch",
            ErrorClass::SliceOverflow => "slice overflow",
            ErrorClass::OutOfBounds => "out of bounds",
            ErrorClass::BufferTooSmall => "buffer too small",
            ErrorClass::BackendUnavailable => "backend unavailable",
            ErrorClass::Gpu => "GPU error",
        }
    }
}

/// Everything that can go wrong in the safe core, with the numbers that explain it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    // ---- the layout (slice_config) ----
    /// A TP size is 0.
    ZeroTpSize {
        /// Which engine.
        side: Side,
    },
    /// A rank is not below its side's TP size.
    RankOutOfRange {
        /// Which engine.
        side: Side,
        /// The rank given.
        rank: u32,
        /// The side's TP size.
        tp_size: u32,
    },
    /// `page_size` is 0.
    ZeroPageSize,
    /// An item length is 0.
    ZeroItemLen {
        /// Which engine.
        side: Side,
    },
    /// `total_kv_heads` is 0 (MLA and MQA models have 1).
    ZeroKvHeads,
    /// The model's KV heads and a TP size divide neither way.
    IndivisibleTp {
        /// Which engine.
        side: Side,
        /// The TP size given.
        tp_size: u32,
        /// The model's KV heads.
        total_kv_heads: u32,
        /// The nearest valid TP size below `tp_size`.
        nearest_below: u32,
        /// The nearest valid TP size above `tp_size`, if one fits in `u32`.
        nearest_above: Option<u32>,
    },
    /// A side's item length is not a whole number of tokens.
    ItemLenNotWholeTokens {
        /// Which engine.
        side: Side,
        /// The side's item length.
        item_len: u64,
        /// Tokens per page.
        page_size: u32,
    },
    /// A side's token is not a whole number of the heads its rank holds.
    TokenNotWholeHeads {
        /// Which engine.
        side: Side,
        /// The side's bytes per token.
        bytes_per_token: u64,
        /// Heads a rank of that side holds.
        heads_per_rank: u32,
        /// The side's TP size.
        tp_size: u32,
        /// The model's KV heads.
        total_kv_heads: u32,
    },
    /// The two sides disagree on the bytes of one head: their dtype or head_dim differ.
    BytesPerHeadMismatch {
        /// Bytes of one head on the prefill side.
        prefill_bytes_per_head: u64,
        /// Bytes of one head on the decode side.
        decode_bytes_per_head: u64,
        /// Bytes of one prefill token.
        prefill_bytes_per_token: u64,
        /// Bytes of one decode token.
        decode_bytes_per_token: u64,
        /// Heads a prefill rank holds.
        prefill_heads_per_rank: u32,
        /// Heads a decode rank holds.
        decode_heads_per_rank: u32,
    },

    // ---- a config edited by hand (SliceConfig::validate) ----
    /// A stated bytes per token disagrees with `item_len / page_size`.
    InconsistentBytesPerToken {
        /// Which engine.
        side: Side,
        /// The config's `bytes_per_token_*`.
        stated: u64,
        /// `item_len / page_size`.
        derived: u64,
    },
    /// A pair that does not send has non-zero slice fields.
    NonSendingSliceFields {
        /// The config's action.
        action: Action,
        /// `first_head`.
        first_head: u32,
        /// `num_heads`.
        num_heads: u32,
        /// `src_head_slice_offset`.
        src_head_slice_offset: u64,
        /// `dst_head_slice_offset`.
        dst_head_slice_offset: u64,
        /// `heads_bytes_per_token_to_send`.
        width: u64,
    },
    /// A sending pair moves no head or no byte.
    EmptySendingSlice {
        /// `num_heads`.
        num_heads: u32,
        /// `heads_bytes_per_token_to_send`.
        width: u64,
    },
    /// The slice width is not a whole number of heads.
    WidthNotWholeHeads {
        /// `heads_bytes_per_token_to_send`.
        width: u64,
        /// `num_heads`.
        num_heads: u32,
    },
    /// A slice offset does not start on a head boundary.
    OffsetNotOnHead {
        /// Which engine.
        side: Side,
        /// The offset.
        offset: u64,
        /// `width / num_heads`.
        bytes_per_head: u64,
        /// `heads_bytes_per_token_to_send`.
        width: u64,
        /// `num_heads`.
        num_heads: u32,
    },
    /// A head slice would not fit inside its token slot.
    SliceOverflow {
        /// Which engine.
        side: Side,
        /// The slice offset inside a token.
        offset: u64,
        /// The slice width.
        width: u64,
        /// The token slot it must fit in.
        bytes_per_token: u64,
    },

    // ---- a request (page lists, buffers) ----
    /// The two page lists differ in length.
    PageCountMismatch {
        /// Source pages.
        src: usize,
        /// Destination pages.
        dst: usize,
    },
    /// A page index is negative.
    NegativePage {
        /// Which engine's list.
        side: Side,
        /// The index.
        page: i32,
        /// Its position in the list.
        position: usize,
    },
    /// A page's end, `(page + 1) * item_len`, does not fit in `u64`.
    PageOffsetOverflow {
        /// Which engine's list.
        side: Side,
        /// The index.
        page: u32,
        /// Its position in the list.
        position: usize,
        /// The side's item length.
        item_len: u64,
    },
    /// A page ends past its buffer's capacity.
    PagePastCapacity {
        /// Which engine's list.
        side: Side,
        /// The index.
        page: u32,
        /// Its position in the list.
        position: usize,
        /// The byte at which the page ends.
        end: u64,
        /// The side's buffer capacity.
        capacity: u64,
    },
    /// A size computed from the caller's numbers does not fit in 64 bits (or in `usize`).
    SizeOverflow {
        /// What was being computed.
        quantity: &'static str,
        /// Its first factor.
        lhs: u64,
        /// Its second factor.
        rhs: u64,
    },
    /// The two buffer arrays differ in length.
    BufferCountMismatch {
        /// Source buffers.
        src: usize,
        /// Destination buffers.
        dst: usize,
    },
    /// A buffer base pointer is NULL.
    NullBuffer {
        /// Which engine's buffers.
        side: Side,
        /// Its index.
        index: usize,
    },
    /// A capacity exceeds the address space.
    CapacityTooLarge {
        /// Which capacity: `"src_capacity"`, `"dst_capacity"` or `"staging_capacity"`.
        field: &'static str,
        /// The capacity given.
        capacity: u64,
    },
    /// The staging region is NULL but said to hold bytes.
    NullStaging {
        /// The capacity given with it.
        capacity: u64,
    },
    /// The staging region holds fewer bytes than the request needs.
    StagingTooSmall {
        /// `num_buffers * staging_len`.
        needed: u64,
        /// The region's capacity.
        capacity: u64,
        /// Buffers staged.
        num_buffers: usize,
        /// Bytes staged per buffer.
        staging_len: u64,
    },
    /// The staging region overlaps a page buffer.
    StagingOverlapsBuffer {
        /// Which engine's buffer.
        side: Side,
        /// Its index.
        index: usize,
        /// The region's start address.
        staging: usize,
        /// The region's bytes in use.
        staging_bytes: u64,
        /// The buffer's start address.
        buffer: usize,
        /// The buffer's capacity.
        capacity: u64,
    },

    // ---- backends ----
    /// A stream was passed to the host backend, which takes none.
    StreamWithHostBackend {
        /// The stream given.
        stream: usize,
        /// True when AUTO fell back to the host backend for want of a HIP device.
        auto_fallback: bool,
    },
    /// The requested copy backend is not compiled in, or it has no device.
    BackendUnavailable {
        /// Why, in words (what the runtime said).
        reason: String,
    },
    /// The GPU runtime returned an error.
    Gpu {
        /// The runtime function that failed (`"hipMemcpy2DAsync"`, ...).
        call: &'static str,
        /// The runtime's status number.
        status: i32,
        /// The call, the runtime's error name and where in the transfer it happened.
        message: String,
    },
}

impl Error {
    /// The C status class of this error.
    pub fn class(&self) -> ErrorClass {
        use Error::*;
        match self {
            ZeroTpSize { .. }
            | RankOutOfRange { .. }
            | ZeroPageSize
            | ZeroItemLen { .. }
            | InconsistentBytesPerToken { .. }
            | NonSendingSliceFields { .. }
            | EmptySendingSlice { .. }
            | WidthNotWholeHeads { .. }
            | OffsetNotOnHead { .. }
            | PageCountMismatch { .. }
            | SizeOverflow { .. }
            | BufferCountMismatch { .. }
            | CapacityTooLarge { .. }
            | StagingOverlapsBuffer { .. }
            | StreamWithHostBackend { .. } => ErrorClass::InvalidArgument,
            ZeroKvHeads | IndivisibleTp { .. } => ErrorClass::Topology,
            ItemLenNotWholeTokens { .. }
            | TokenNotWholeHeads { .. }
            | BytesPerHeadMismatch { .. } => ErrorClass::LayoutMismatch,
            SliceOverflow { .. } => ErrorClass::SliceOverflow,
            NegativePage { .. } | PageOffsetOverflow { .. } | PagePastCapacity { .. } => {
                ErrorClass::OutOfBounds
            }
            NullBuffer { .. } | NullStaging { .. } => ErrorClass::NullPointer,
            StagingTooSmall { .. } => ErrorClass::BufferTooSmall,
            BackendUnavailable { .. } => ErrorClass::BackendUnavailable,
            Gpu { .. } => ErrorClass::Gpu,
        }
    }

    /// The message without its class prefix.
    fn detail(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Error::*;
        match self {
            ZeroTpSize { side } => write!(f, "{side}: tp_size is 0"),
            RankOutOfRange {
                side,
                rank,
                tp_size,
            } => write!(
                f,
                "{side}: tp_rank {rank} is out of range for tp_size {tp_size} (ranks are 0..{})",
                tp_size.saturating_sub(1)
            ),
            ZeroPageSize => f.write_str("page_size is 0"),
            ZeroItemLen { side } => write!(f, "{side}: {} is 0", side.item_len_field()),
            ZeroKvHeads => f.write_str("total_kv_heads is 0 (use 1 for MLA and MQA models)"),
            IndivisibleTp {
                side,
                tp_size,
                total_kv_heads,
                nearest_below,
                nearest_above,
            } => {
                write!(
                    f,
                    "{side}: tp_size {tp_size} and total_kv_heads {total_kv_heads} divide neither \
                     way (one must be a multiple of the other; "
                )?;
                match nearest_above {
                    Some(above) => {
                        write!(f, "nearest valid tp sizes: {nearest_below} and {above})")
                    }
                    None => write!(f, "nearest valid tp size: {nearest_below})"),
                }
            }
            ItemLenNotWholeTokens {
                side,
                item_len,
                page_size,
            } => write!(
                f,
                "{side}: {} {item_len} is not a multiple of page_size {page_size}",
                side.item_len_field()
            ),
            TokenNotWholeHeads {
                side,
                bytes_per_token,
                heads_per_rank,
                tp_size,
                total_kv_heads,
            } => write!(
                f,
                "{side}: bytes_per_token {bytes_per_token} is not a multiple of the \
                 {heads_per_rank} heads per rank (tp_size {tp_size}, total_kv_heads \
                 {total_kv_heads})"
            ),
            BytesPerHeadMismatch {
                prefill_bytes_per_head,
                decode_bytes_per_head,
                prefill_bytes_per_token,
                decode_bytes_per_token,
                prefill_heads_per_rank,
                decode_heads_per_rank,
            } => write!(
                f,
                "decode side: bytes_per_head {decode_bytes_per_head} != prefill side \
                 bytes_per_head {prefill_bytes_per_head} (dtype or head_dim differ; \
                 bytes_per_token {decode_bytes_per_token} / {decode_heads_per_rank} heads vs \
                 {prefill_bytes_per_token} / {prefill_heads_per_rank} heads)"
            ),
            InconsistentBytesPerToken {
                side,
                stated,
                derived,
            } => write!(
                f,
                "inconsistent config: {} {stated} but {} / page_size = {derived}",
                side.bytes_per_token_field(),
                side.item_len_field()
            ),
            NonSendingSliceFields {
                action,
                first_head,
                num_heads,
                src_head_slice_offset,
                dst_head_slice_offset,
                width,
            } => write!(
                f,
                "inconsistent config: action {action:?} moves nothing, but first_head \
                 {first_head}, num_heads {num_heads}, src_head_slice_offset \
                 {src_head_slice_offset}, dst_head_slice_offset {dst_head_slice_offset}, \
                 heads_bytes_per_token_to_send {width} are not all 0"
            ),
            EmptySendingSlice { num_heads, width } => write!(
                f,
                "inconsistent config: action Send with num_heads {num_heads} and \
                 heads_bytes_per_token_to_send {width} (both must be non-zero)"
            ),
            WidthNotWholeHeads { width, num_heads } => write!(
                f,
                "inconsistent config: heads_bytes_per_token_to_send {width} is not a multiple \
                 of num_heads {num_heads}"
            ),
            OffsetNotOnHead {
                side,
                offset,
                bytes_per_head,
                width,
                num_heads,
            } => write!(
                f,
                "inconsistent config: {} {offset} is not a multiple of bytes_per_head \
                 {bytes_per_head} (heads_bytes_per_token_to_send {width} / num_heads \
                 {num_heads})",
                side.slice_offset_field()
            ),
            SliceOverflow {
                side,
                offset,
                width,
                bytes_per_token,
            } => write!(
                f,
                "{side}: head slice at offset {offset} of width {width} ends past the \
                 {bytes_per_token}-byte token slot"
            ),
            PageCountMismatch { src, dst } => write!(
                f,
                "{src} source pages but {dst} destination pages (they are paired one to one)"
            ),
            NegativePage {
                side,
                page,
                position,
            } => write!(
                f,
                "{side}: page index {page} at position {position} is negative"
            ),
            PageOffsetOverflow {
                side,
                page,
                position,
                item_len,
            } => write!(
                f,
                "{side}: page {page} at position {position} ends at byte ({page} + 1) * \
                 item_len {item_len}, which overflows u64"
            ),
            PagePastCapacity {
                side,
                page,
                position,
                end,
                capacity,
            } => write!(
                f,
                "{side}: page {page} at position {position} ends at byte {end}, past {} \
                 {capacity}",
                side.capacity_field()
            ),
            SizeOverflow { quantity, lhs, rhs } => {
                write!(f, "{quantity} = {lhs} * {rhs} overflows 64 bits")
            }
            BufferCountMismatch { src, dst } => write!(
                f,
                "{src} source buffers but {dst} destination buffers (they are paired one to one)"
            ),
            NullBuffer { side, index } => {
                write!(f, "buffers.{}[{index}] is NULL", side.buffers_field())
            }
            NullStaging { capacity } => {
                write!(f, "staging is NULL but staging_capacity is {capacity}")
            }
            CapacityTooLarge { field, capacity } => write!(
                f,
                "{field} {capacity} exceeds the address space ({} bytes)",
                isize::MAX
            ),
            StagingTooSmall {
                needed,
                capacity,
                num_buffers,
                staging_len,
            } => write!(
                f,
                "staging_capacity {capacity} is below the {needed} bytes the request needs \
                 ({num_buffers} buffers * staging_len {staging_len})"
            ),
            StagingOverlapsBuffer {
                side,
                index,
                staging,
                staging_bytes,
                buffer,
                capacity,
            } => write!(
                f,
                "the staging region [{staging:#x}, +{staging_bytes}) overlaps {} buffer {index} \
                 [{buffer:#x}, +{capacity}) (staging must be separate memory)",
                match side {
                    Side::Prefill => "source",
                    Side::Decode => "destination",
                }
            ),
            StreamWithHostBackend {
                stream,
                auto_fallback,
            } => {
                let why = if *auto_fallback {
                    "AUTO chose the host backend because no HIP device is available, and host \
                     copies take no stream"
                } else {
                    "the host backend runs on the CPU and takes no stream"
                };
                write!(
                    f,
                    "options.stream is {stream:#x} but {why} (pass NULL, or request \
                     MORI_BACKEND_HIP)"
                )
            }
            BackendUnavailable { reason } => f.write_str(reason),
            Gpu { message, .. } => f.write_str(message),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.class().label())?;
        self.detail(f)
    }
}

impl std::error::Error for Error {}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
