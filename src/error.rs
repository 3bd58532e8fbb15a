//! The one error type of the crate.
//!
//! Every variant carries the numbers that explain it, so a Rust caller (the CLI, a connector)
//! can act on a refusal without parsing text; [`Error::class`] groups the variants into the status
//! classes of the C ABI (`MORI_ERR_*`). The message (`Display`) names the side, the field and the
//! numbers, because "invalid layout" alone sends an operator hunting through two engines' configs.
//! Conditions only a C caller can create (a NULL argument, a short output array, a caught panic)
//! are not here: the FFI layer adds them.

#![forbid(unsafe_code)]

use crate::types::{Action, Side};

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
    /// `MORI_ERR_POOL_FULL`: a staging pool has no free block for a slot now; worth retrying
    /// after other slots are freed.
    PoolFull,
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
            ErrorClass::PoolFull => "staging pool full",
        }
    }
}

/// Everything that can go wrong in the safe core, with the numbers that explain it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- the layout (slice_config) ----
    /// A TP size is 0.
    #[error("invalid argument: {side}: tp_size is 0")]
    ZeroTpSize {
        /// Which engine.
        side: Side,
    },
    /// A rank is not below its side's TP size.
    #[error("invalid argument: {side}: tp_rank {rank} is out of range for tp_size {tp_size} (ranks are 0..{})", .tp_size.saturating_sub(1))]
    RankOutOfRange {
        /// Which engine.
        side: Side,
        /// The rank given.
        rank: u32,
        /// The side's TP size.
        tp_size: u32,
    },
    /// A head is not below the model's KV heads.
    #[error("invalid argument: head {head} is out of range for total_kv_heads {total_kv_heads} (heads are 0..{})", .total_kv_heads.saturating_sub(1))]
    HeadOutOfRange {
        /// The head given.
        head: u32,
        /// The model's KV heads.
        total_kv_heads: u32,
    },
    /// A rank does not hold the head it was asked about.
    #[error(
        "invalid argument: {side}: tp_rank {rank} holds heads {first}..{last}, not head {head}"
    )]
    HeadNotHeld {
        /// Which engine.
        side: Side,
        /// The rank given.
        rank: u32,
        /// The head given.
        head: u32,
        /// The first head the rank holds.
        first: u32,
        /// The last head the rank holds.
        last: u32,
    },
    /// `page_size` is 0.
    #[error("invalid argument: page_size is 0")]
    ZeroPageSize,
    /// An item length is 0.
    #[error("invalid argument: {side}: {} is 0", .side.item_len_field())]
    ZeroItemLen {
        /// Which engine.
        side: Side,
    },
    /// `total_kv_heads` is 0 (MLA and MQA models have 1).
    #[error("invalid topology: total_kv_heads is 0 (use 1 for MLA and MQA models)")]
    ZeroKvHeads,
    /// The model's KV heads and a TP size divide neither way.
    #[error("invalid topology: {side}: tp_size {tp_size} and total_kv_heads {total_kv_heads} divide neither way (one must be a multiple of the other; {})", nearest(.nearest_below, .nearest_above))]
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
    #[error("layout mismatch: {side}: {} {item_len} is not a multiple of page_size {page_size}", .side.item_len_field())]
    ItemLenNotWholeTokens {
        /// Which engine.
        side: Side,
        /// The side's item length.
        item_len: u64,
        /// Tokens per page.
        page_size: u32,
    },
    /// A side's token is not a whole number of the heads its rank holds.
    #[error(
        "layout mismatch: {side}: bytes_per_token {bytes_per_token} is not a multiple of the {heads_per_rank} heads per rank (tp_size {tp_size}, total_kv_heads {total_kv_heads})"
    )]
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
    #[error(
        "layout mismatch: decode side: bytes_per_head {decode_bytes_per_head} != prefill side bytes_per_head {prefill_bytes_per_head} (dtype or head_dim differ; bytes_per_token {decode_bytes_per_token} / {decode_heads_per_rank} heads vs {prefill_bytes_per_token} / {prefill_heads_per_rank} heads)"
    )]
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
    #[error("invalid argument: inconsistent config: {} {stated} but {} / page_size = {derived}", .side.bytes_per_token_field(), .side.item_len_field())]
    InconsistentBytesPerToken {
        /// Which engine.
        side: Side,
        /// The config's `bytes_per_token_*`.
        stated: u64,
        /// `item_len / page_size`.
        derived: u64,
    },
    /// A pair that does not send has non-zero slice fields.
    #[error(
        "invalid argument: inconsistent config: action {action:?} moves nothing, but first_head {first_head}, num_heads {num_heads}, src_head_slice_offset {src_head_slice_offset}, dst_head_slice_offset {dst_head_slice_offset}, heads_bytes_per_token_to_send {width} are not all 0"
    )]
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
    #[error(
        "invalid argument: inconsistent config: action Send with num_heads {num_heads} and heads_bytes_per_token_to_send {width} (both must be non-zero)"
    )]
    EmptySendingSlice {
        /// `num_heads`.
        num_heads: u32,
        /// `heads_bytes_per_token_to_send`.
        width: u64,
    },
    /// The slice width is not a whole number of heads.
    #[error(
        "invalid argument: inconsistent config: heads_bytes_per_token_to_send {width} is not a multiple of num_heads {num_heads}"
    )]
    WidthNotWholeHeads {
        /// `heads_bytes_per_token_to_send`.
        width: u64,
        /// `num_heads`.
        num_heads: u32,
    },
    /// A slice offset does not start on a head boundary.
    #[error("invalid argument: inconsistent config: {} {offset} is not a multiple of bytes_per_head {bytes_per_head} (heads_bytes_per_token_to_send {width} / num_heads {num_heads})", .side.slice_offset_field())]
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
    #[error(
        "slice overflow: {side}: head slice at offset {offset} of width {width} ends past the {bytes_per_token}-byte token slot"
    )]
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

    // ---- a layout and a pair of layouts (REFERENCE.md section 11) ----
    /// A layout's page size or head bytes is 0.
    #[error("invalid argument: {side}: layout {field} is 0")]
    ZeroLayoutField {
        /// Which engine.
        side: Side,
        /// `"page_size"` or `"head_bytes"`.
        field: &'static str,
    },
    /// A sum computed from the caller's numbers does not fit in 64 bits.
    #[error("invalid argument: {quantity} = {lhs} + {rhs} overflows 64 bits")]
    SumOverflow {
        /// What was being computed.
        quantity: &'static str,
        /// Its first term.
        lhs: u64,
        /// Its second term.
        rhs: u64,
    },
    /// Two elements of a page overlap: a stride is below `head_bytes`.
    #[error(
        "layout mismatch: {side}: {field} {stride} is below head_bytes {head_bytes}, so \
         neighbouring elements of a page overlap"
    )]
    ElementsOverlap {
        /// Which engine.
        side: Side,
        /// `"token_stride"` or `"head_stride"`.
        field: &'static str,
        /// The stride given.
        stride: u64,
        /// Bytes of one head.
        head_bytes: u64,
    },
    /// The two dimensions of a page interleave: the outer stride does not clear the inner
    /// dimension.
    #[error(
        "layout mismatch: {side}: {outer} {outer_stride} is below ({inner_count} - 1) * \
         {inner} {inner_stride} + head_bytes {head_bytes}, so the elements of a page interleave"
    )]
    ElementsInterleave {
        /// Which engine.
        side: Side,
        /// The larger stride's field.
        outer: &'static str,
        /// The larger stride.
        outer_stride: u64,
        /// The smaller stride's field.
        inner: &'static str,
        /// The smaller stride.
        inner_stride: u64,
        /// Elements along the smaller stride.
        inner_count: u64,
        /// Bytes of one head.
        head_bytes: u64,
    },
    /// Pages overlap: a page's extent passes `page_stride`, and the heads do not hold pages of
    /// their own either.
    #[error(
        "layout mismatch: {side}: a page's extent {extent} (offset {offset} + (page_size \
         {page_size} - 1) * token_stride {token_stride} + ({local_heads} local heads - 1) * \
         head_stride {head_stride} + head_bytes {head_bytes}) is past page_stride \
         {page_stride}, so pages overlap (and head_stride does not give each head a run of \
         pages of its own)"
    )]
    PagesOverlap {
        /// Which engine.
        side: Side,
        /// `offset + (page_size-1)*token_stride + (L-1)*head_stride + head_bytes`.
        extent: u64,
        /// The stride given.
        page_stride: u64,
        /// The layout's offset.
        offset: u64,
        /// The layout's token stride.
        token_stride: u64,
        /// The layout's head stride.
        head_stride: u64,
        /// Slots per page.
        page_size: u32,
        /// L.
        local_heads: u32,
        /// Bytes of one head.
        head_bytes: u64,
    },
    /// The two layouts count different heads.
    #[error(
        "invalid topology: prefill side total_kv_heads {prefill} != decode side \
         total_kv_heads {decode} (the two sides describe different models)"
    )]
    KvHeadsDiffer {
        /// The prefill layout's H.
        prefill: u32,
        /// The decode layout's H.
        decode: u32,
    },
    /// The two layouts disagree on the bytes of one head.
    #[error(
        "layout mismatch: decode side head_bytes {decode} != prefill side head_bytes \
         {prefill} (dtype or head_dim differ)"
    )]
    HeadBytesDiffer {
        /// The prefill layout's head bytes.
        prefill: u64,
        /// The decode layout's head bytes.
        decode: u64,
    },
    /// A pair config's fields differ from what its two layouts give.
    #[error(
        "invalid argument: inconsistent pair config: {field} {stated}, but the two layouts give \
         {derived}"
    )]
    PairConfigEdited {
        /// The field.
        field: &'static str,
        /// Its value in the config.
        stated: u32,
        /// Its value derived from the layouts.
        derived: u32,
    },
    /// A request lists a number of pages other than `ceil(N / page_size)`.
    #[error(
        "invalid argument: {side}: {count} pages for {num_tokens} tokens of page_size \
         {page_size} (a request of N tokens lists ceil(N / page_size) = {expected} pages)"
    )]
    PageCountForTokens {
        /// Which engine.
        side: Side,
        /// Pages given.
        count: usize,
        /// N.
        num_tokens: u64,
        /// The side's page size.
        page_size: u32,
        /// `ceil(N / page_size)`.
        expected: u64,
    },
    /// A page's end, `page * page_stride + extent`, does not fit in `u64`.
    #[error(
        "out of bounds: {side}: page {page} at position {position} ends at byte {page} * \
         page_stride {page_stride} + extent {extent}, which overflows u64"
    )]
    PageEndOverflow {
        /// Which engine.
        side: Side,
        /// The index.
        page: u32,
        /// Its position in the list.
        position: usize,
        /// The layout's page stride.
        page_stride: u64,
        /// The layout's page extent.
        extent: u64,
    },
    /// With heads outside pages, a page runs into the next head's pages.
    #[error(
        "out of bounds: {side}: page {page} at position {position} ends at byte {end} of its \
         head's run, past head_stride {head_stride} (where the next head's pages start)"
    )]
    PagePastHeadRun {
        /// Which engine.
        side: Side,
        /// The index.
        page: u32,
        /// Its position in the list.
        position: usize,
        /// `page * page_stride + (page_size - 1) * token_stride + head_bytes`.
        end: u64,
        /// The layout's head stride.
        head_stride: u64,
    },
    /// A staging mode that a pack or an unpack cannot take.
    #[error(
        "invalid argument: {function} takes staging mode {allowed}, not {mode:?} (both ranks \
         pass the mode of the request)"
    )]
    StagingModeNotAllowed {
        /// `"pack"` or `"unpack"`.
        function: &'static str,
        /// The mode given.
        mode: crate::types::Staging,
        /// The modes it takes.
        allowed: &'static str,
    },

    /// The arguments of a layout constructor (`Layout::nhd`, `Layout::hnd`) or of
    /// `rank_heads`, which belong to no side: `error` is the refusal, its message without a side.
    #[error("{}", without_side(.error))]
    LayoutArguments {
        /// The refusal, as it reads for a prefill layout.
        error: Box<Error>,
    },

    // ---- a request (page lists, buffers) ----
    /// The two page lists differ in length.
    #[error(
        "invalid argument: {src} source pages but {dst} destination pages (they are paired one to one)"
    )]
    PageCountMismatch {
        /// Source pages.
        src: usize,
        /// Destination pages.
        dst: usize,
    },
    /// A page index is negative.
    #[error("out of bounds: {side}: page index {page} at position {position} is negative")]
    NegativePage {
        /// Which engine's list.
        side: Side,
        /// The index.
        page: i32,
        /// Its position in the list.
        position: usize,
    },
    /// A page's end, `(page + 1) * item_len`, does not fit in `u64`.
    #[error(
        "out of bounds: {side}: page {page} at position {position} ends at byte ({page} + 1) * item_len {item_len}, which overflows u64"
    )]
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
    #[error("out of bounds: {side}: page {page} at position {position} ends at byte {end}, past {} {capacity}", .side.capacity_field())]
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
    #[error("invalid argument: {quantity} = {lhs} * {rhs} overflows 64 bits")]
    SizeOverflow {
        /// What was being computed.
        quantity: &'static str,
        /// Its first factor.
        lhs: u64,
        /// Its second factor.
        rhs: u64,
    },
    /// A call's copy-kernel table would need a count beyond its 32-bit field (4 GiB of table,
    /// or 2^32 tiles, rects or buffers); the per-rect copies have no such limit.
    #[error(
        "invalid argument: the copy kernel's table would hold {count} {what}, more than its 32-bit fields allow ({}); the per-rect copies (flags without MORI_SEND_COPY_KERNEL) have no such limit",
        u32::MAX
    )]
    KernelTableTooLarge {
        /// What is counted: `"bytes"`, `"tiles"`, `"rects"` or `"buffers"`.
        what: &'static str,
        /// How many the table would need.
        count: u64,
    },
    /// The two buffer arrays differ in length.
    #[error(
        "invalid argument: {src} source buffers but {dst} destination buffers (they are paired one to one)"
    )]
    BufferCountMismatch {
        /// Source buffers.
        src: usize,
        /// Destination buffers.
        dst: usize,
    },
    /// A buffer base pointer is NULL.
    #[error("null pointer: buffers.{}[{index}] is NULL", .side.buffers_field())]
    NullBuffer {
        /// Which engine's buffers.
        side: Side,
        /// Its index.
        index: usize,
    },
    /// A capacity exceeds the address space.
    #[error(
        "invalid argument: {field} {capacity} exceeds the address space ({} bytes)",
        isize::MAX
    )]
    CapacityTooLarge {
        /// Which capacity: `"src_capacity"`, `"dst_capacity"` or `"staging_capacity"`.
        field: &'static str,
        /// The capacity given.
        capacity: u64,
    },
    /// The staging region is NULL but said to hold bytes.
    #[error("null pointer: staging is NULL but staging_capacity is {capacity}")]
    NullStaging {
        /// The capacity given with it.
        capacity: u64,
    },
    /// The staging region holds fewer bytes than the request needs.
    #[error(
        "buffer too small: {side}: staging_capacity {capacity} is below the {needed} bytes the request needs ({num_buffers} buffers * staging_len {staging_len})"
    )]
    StagingTooSmall {
        /// Whose staging region.
        side: Side,
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
    #[error("invalid argument: the staging region [{staging:#x}, +{staging_bytes}) overlaps {} buffer {index} [{buffer:#x}, +{capacity}) (staging must be separate memory)", .side.buffer_role())]
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

    // ---- a request of several groups ----
    /// A refusal that concerns one group of a request of several groups: `error` says what,
    /// `group` (its index in the request's list) says where.
    #[error("{}", in_group(*.group, .error))]
    InGroup {
        /// The group's index in the request.
        group: usize,
        /// The refusal, as it reads for a request of that group alone.
        error: Box<Error>,
    },
    /// A group's first token (a sliding window's start) is not on a page boundary of both
    /// sides, so its pages could not hold its tokens from slot 0.
    #[error(
        "invalid argument: first_token {first_token} is not a multiple of both page sizes \
         (prefill page_size {src_page_size}, decode page_size {dst_page_size}): a window starts \
         on a page of each side; round it down to {rounded}, a multiple of {lcm}"
    )]
    WindowNotOnPages {
        /// The group's first token.
        first_token: u64,
        /// The prefill layout's page size.
        src_page_size: u32,
        /// The decode layout's page size.
        dst_page_size: u32,
        /// The least common multiple of the page sizes.
        lcm: u64,
        /// `first_token` rounded down to a multiple of `lcm`.
        rounded: u64,
    },
    /// A reserved field is not 0.
    #[error("invalid argument: {field} is {value}, not 0 (reserved)")]
    ReservedNotZero {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// A group's buffers on one side are not as many as the group says.
    #[error(
        "invalid argument: {side}: {given} buffers given for a group of num_buffers {expected}"
    )]
    GroupBufferCount {
        /// Which engine.
        side: Side,
        /// Buffers given.
        given: usize,
        /// The group's num_buffers.
        expected: usize,
    },
    /// A group's buffers on one side are needed but not given.
    #[error(
        "null pointer: {side}: the group's buffer pointers are not given (NULL or empty) but \
         num_buffers is {num_buffers}"
    )]
    GroupBuffersMissing {
        /// Which engine.
        side: Side,
        /// The group's num_buffers.
        num_buffers: usize,
    },
    /// A request's staging region holds fewer bytes than its groups that stage that side.
    #[error(
        "buffer too small: {side}: staging_capacity {capacity} is below the {needed} bytes the \
         request's groups need on this side (the regions of the groups that stage it, back to \
         back)"
    )]
    GroupsStagingTooSmall {
        /// Whose staging region.
        side: Side,
        /// The sum of the staging groups' `num_buffers * staging_len`.
        needed: u64,
        /// The region's capacity.
        capacity: u64,
    },

    // ---- pipeline parallelism ----
    /// A pipeline partition lists no stage.
    #[error(
        "invalid argument: {side}: the pipeline partition is empty (give the layers of each stage)"
    )]
    EmptyPartition {
        /// Which engine.
        side: Side,
    },
    /// A pipeline stage holds no layer.
    #[error(
        "invalid argument: {side}: stage {stage} of the pipeline partition {partition:?} holds \
         no layer (every stage holds at least one)"
    )]
    ZeroLayerStage {
        /// Which engine.
        side: Side,
        /// The stage.
        stage: usize,
        /// The partition: layers per stage.
        partition: Vec<u32>,
    },
    /// A pipeline partition holds more layers than a `u32` counts.
    #[error(
        "invalid argument: {side}: the pipeline partition holds {layers} layers, more than 4294967295"
    )]
    PartitionTooLarge {
        /// Which engine.
        side: Side,
        /// Its layers.
        layers: u64,
    },
    /// The two pipeline partitions split different numbers of layers.
    #[error(
        "invalid argument: the prefill pipeline partition {prefill_partition:?} holds {prefill} \
         layers but the decode partition {decode_partition:?} holds {decode} (both split the \
         model's layers)"
    )]
    PartitionsDiffer {
        /// Layers of the prefill partition.
        prefill: u64,
        /// Layers of the decode partition.
        decode: u64,
        /// The prefill partition.
        prefill_partition: Vec<u32>,
        /// The decode partition.
        decode_partition: Vec<u32>,
    },
    /// A pipeline stage is not below its side's number of stages.
    #[error(
        "invalid argument: {side}: pipeline stage {stage} is out of range for {stages} stages \
         (stages are 0..{})", .stages.saturating_sub(1)
    )]
    StageOutOfRange {
        /// Which engine.
        side: Side,
        /// The stage given.
        stage: u32,
        /// Stages of that side's partition.
        stages: usize,
    },

    // ---- the staging pool ----
    /// A pool's capacity or slot unit is unusable.
    #[error("invalid argument: staging pool: {reason} (capacity {capacity}, min_slot {min_slot})")]
    PoolShape {
        /// What is wrong, in words.
        reason: &'static str,
        /// The capacity asked for.
        capacity: u64,
        /// The slot unit asked for.
        min_slot: u64,
    },
    /// The operating system refused the pool's memory.
    #[error("invalid argument: staging pool: {call} of {bytes} bytes failed with errno {errno} ({})", std::io::Error::from_raw_os_error(*.errno))]
    PoolMemory {
        /// The system call that failed (`"mmap"`).
        call: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// Its `errno`.
        errno: i32,
    },
    /// A slot of 0 bytes was asked for.
    #[error("invalid argument: staging pool: a slot of 0 bytes")]
    ZeroSlot,
    /// The pool can never hold a slot this large.
    #[error(
        "buffer too small: staging pool: a slot of {size} bytes is larger than the pool's capacity of {capacity} bytes; it can never be granted"
    )]
    SlotLargerThanPool {
        /// Bytes asked for.
        size: u64,
        /// The pool's capacity.
        capacity: u64,
    },
    /// The pool has no free block for the slot now (after waiting `waited_ms`, if it waited).
    #[error(
        "staging pool full: a slot of {size} bytes needs a free block of {block} bytes, the largest free block is {largest_free} bytes ({live_slots} live slots hold {live_bytes} of {capacity} bytes){}",
        waited(.waited_ms)
    )]
    PoolFull {
        /// Bytes asked for.
        size: u64,
        /// The block it needs: `size` rounded up to a multiple of min_slot.
        block: u64,
        /// The largest block free now.
        largest_free: u64,
        /// Slots in use.
        live_slots: usize,
        /// Bytes they hold.
        live_bytes: u64,
        /// The pool's capacity.
        capacity: u64,
        /// Milliseconds waited for a free block (`None`: the call does not wait).
        waited_ms: Option<u64>,
    },
    /// An offset that was a slot is freed again.
    #[error(
        "invalid argument: staging pool: offset {offset} was a slot of {size} bytes that is already free (a double free)"
    )]
    SlotDoubleFree {
        /// The offset freed.
        offset: u64,
        /// The slot's bytes when it was live.
        size: u64,
    },
    /// An offset where no slot starts is freed.
    #[error("invalid argument: staging pool: no slot starts at offset {offset} ({})", not_a_slot(*.offset, .inside, *.capacity))]
    NotASlot {
        /// The offset freed.
        offset: u64,
        /// The live slot that contains it, as (offset, bytes), if one does.
        inside: Option<(u64, u64)>,
        /// The pool's capacity.
        capacity: u64,
    },
    /// A pool is destroyed while slots are live.
    #[error(
        "invalid argument: staging pool: {live_slots} slots ({live_bytes} bytes, the first at offset {first}) are still allocated; free them before destroying the pool (an engine may still be writing into them)"
    )]
    PoolInUse {
        /// Slots in use.
        live_slots: usize,
        /// Bytes they hold.
        live_bytes: u64,
        /// The lowest live offset.
        first: u64,
    },
    /// The pool was destroyed while the call waited for a slot.
    #[error("invalid argument: staging pool: destroyed while waiting for a slot of {size} bytes")]
    PoolClosed {
        /// Bytes asked for.
        size: u64,
    },

    // ---- backends ----
    /// A stream was passed to the host backend, which takes none.
    #[error("invalid argument: options.stream is {stream:#x} but {} (pass NULL, or request MORI_BACKEND_HIP or MORI_BACKEND_CUDA)", host_stream_reason(.auto_fallback))]
    StreamWithHostBackend {
        /// The stream given.
        stream: usize,
        /// True when AUTO fell back to the host backend for want of a GPU.
        auto_fallback: bool,
    },
    /// The requested copy backend is not compiled in, or it has no device.
    #[error("backend unavailable: {reason}")]
    BackendUnavailable {
        /// Why, in words (what the runtime said).
        reason: String,
    },
    /// The GPU runtime returned an error.
    #[error("GPU error: {message}")]
    Gpu {
        /// The runtime function that failed (`"hipMemcpy2DAsync"`, ...).
        call: &'static str,
        /// The runtime's status number.
        status: i32,
        /// The call, the runtime's error name and where in the transfer it happened.
        message: String,
        /// The buffer pair the failure belongs to, when it belongs to one.
        buffer: Option<usize>,
        /// The rect whose copy failed (per-rect copies).
        rect: Option<usize>,
    },
}

impl Error {
    /// The C status class of this error.
    pub fn class(&self) -> ErrorClass {
        use Error::*;
        match self {
            LayoutArguments { error } | InGroup { error, .. } => error.class(),
            ZeroTpSize { .. }
            | RankOutOfRange { .. }
            | HeadOutOfRange { .. }
            | HeadNotHeld { .. }
            | ZeroPageSize
            | ZeroItemLen { .. }
            | InconsistentBytesPerToken { .. }
            | NonSendingSliceFields { .. }
            | EmptySendingSlice { .. }
            | WidthNotWholeHeads { .. }
            | OffsetNotOnHead { .. }
            | PageCountMismatch { .. }
            | SizeOverflow { .. }
            | KernelTableTooLarge { .. }
            | BufferCountMismatch { .. }
            | CapacityTooLarge { .. }
            | StagingOverlapsBuffer { .. }
            | StreamWithHostBackend { .. }
            | ZeroLayoutField { .. }
            | SumOverflow { .. }
            | PairConfigEdited { .. }
            | PageCountForTokens { .. }
            | StagingModeNotAllowed { .. }
            | PoolShape { .. }
            | PoolMemory { .. }
            | ZeroSlot
            | SlotDoubleFree { .. }
            | NotASlot { .. }
            | PoolInUse { .. }
            | PoolClosed { .. }
            | WindowNotOnPages { .. }
            | ReservedNotZero { .. }
            | GroupBufferCount { .. }
            | EmptyPartition { .. }
            | ZeroLayerStage { .. }
            | PartitionTooLarge { .. }
            | PartitionsDiffer { .. }
            | StageOutOfRange { .. } => ErrorClass::InvalidArgument,
            ZeroKvHeads | IndivisibleTp { .. } | KvHeadsDiffer { .. } => ErrorClass::Topology,
            ItemLenNotWholeTokens { .. }
            | TokenNotWholeHeads { .. }
            | BytesPerHeadMismatch { .. }
            | ElementsOverlap { .. }
            | ElementsInterleave { .. }
            | PagesOverlap { .. }
            | HeadBytesDiffer { .. } => ErrorClass::LayoutMismatch,
            SliceOverflow { .. } => ErrorClass::SliceOverflow,
            NegativePage { .. }
            | PageOffsetOverflow { .. }
            | PagePastCapacity { .. }
            | PageEndOverflow { .. }
            | PagePastHeadRun { .. } => ErrorClass::OutOfBounds,
            NullBuffer { .. } | NullStaging { .. } | GroupBuffersMissing { .. } => {
                ErrorClass::NullPointer
            }
            StagingTooSmall { .. } | GroupsStagingTooSmall { .. } | SlotLargerThanPool { .. } => {
                ErrorClass::BufferTooSmall
            }
            PoolFull { .. } => ErrorClass::PoolFull,
            BackendUnavailable { .. } => ErrorClass::BackendUnavailable,
            Gpu { .. } => ErrorClass::Gpu,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `a * b`, or an [`Error::SizeOverflow`] naming `quantity` and both factors.
pub(crate) fn checked_product(quantity: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or(Error::SizeOverflow {
        quantity,
        lhs: a,
        rhs: b,
    })
}

/// `value` as a `usize`, or an [`Error::SizeOverflow`] naming `quantity` (on targets whose
/// `usize` is narrower than 64 bits).
pub(crate) fn checked_usize(quantity: &'static str, value: u64) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::SizeOverflow {
        quantity,
        lhs: value,
        rhs: 1,
    })
}

/// The end of [`Error::IndivisibleTp`]'s message: the valid sizes around the one refused.
fn nearest(below: &u32, above: &Option<u32>) -> String {
    match above {
        Some(above) => format!("nearest valid tp sizes: {below} and {above}"),
        None => format!("nearest valid tp size: {below}"),
    }
}

/// The end of [`Error::PoolFull`]'s message: how long the call waited.
fn waited(waited_ms: &Option<u64>) -> String {
    match waited_ms {
        Some(ms) => format!("; still full after waiting {ms} ms"),
        None => String::new(),
    }
}

/// Where a freed offset that starts no slot lies.
fn not_a_slot(offset: u64, inside: &Option<(u64, u64)>, capacity: u64) -> String {
    match inside {
        Some((start, size)) => {
            format!("it lies inside the live slot at offset {start} of {size} bytes")
        }
        None if offset >= capacity => format!("it is past the pool's capacity {capacity}"),
        None => "it lies in free space".into(),
    }
}

/// Why [`Error::StreamWithHostBackend`] refused a stream.
fn host_stream_reason(auto_fallback: &bool) -> &'static str {
    if *auto_fallback {
        "AUTO chose the host backend because no GPU is available (no HIP device, no CUDA device), \
         and host copies take no stream"
    } else {
        "the host backend runs on the CPU and takes no stream"
    }
}

/// A refusal's message without its "prefill side: " (a layout constructor's arguments).
fn without_side(error: &Error) -> String {
    error.to_string().replacen("prefill side: ", "", 1)
}

/// An error's message with `group {group}: ` after its class label: the refusal of one group
/// of a request of several groups.
fn in_group(group: usize, error: &Error) -> String {
    with_group(group, error.class().label(), &error.to_string())
}

/// `message` (which starts with `label: `) with `group {group}: ` after the label.
pub(crate) fn with_group(group: usize, label: &str, message: &str) -> String {
    match message
        .strip_prefix(label)
        .and_then(|rest| rest.strip_prefix(": "))
    {
        Some(rest) => format!("{label}: group {group}: {rest}"),
        None => format!("group {group}: {message}"),
    }
}

impl Error {
    /// This error as the refusal of group `group` of a request of several groups.
    pub fn in_group(self, group: usize) -> Error {
        Error::InGroup {
            group,
            error: Box::new(self),
        }
    }
}
