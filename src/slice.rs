//! The math: which heads each rank owns, which prefill rank sends which head, and the byte slice
//! a (prefill rank, decode rank) pair moves inside every token.
//!
//! Everything here is pure integer arithmetic on the numbers of `CONTRACT.md` sections 2 and 3.
//! Nothing knows about C, GPUs or buffers.

use std::ops::Range;

use crate::error::{Error, Result, Side};

/// What a (prefill rank, decode rank) pair does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The two ranks share no head.
    NotPaired,
    /// The prefill rank is the designated sender of the heads it shares with the decode rank.
    Send,
    /// The ranks share heads, but another prefill rank (a replica) sends them.
    SkipReplica,
}

/// One side's tensor-parallel sharding of the model's KV heads, already validated.
///
/// With `T <= H` each rank owns `H/T` consecutive heads; with `T > H` each head is replicated on
/// `T/H` consecutive ranks and each rank owns exactly one head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpSide {
    side: Side,
    tp_size: u32,
    total_kv_heads: u32,
}

impl TpSide {
    /// Validates `tp_size` against the model's `total_kv_heads`: they must divide one way or the
    /// other, and neither may be zero.
    pub fn new(side: Side, tp_size: u32, total_kv_heads: u32) -> Result<Self> {
        if tp_size == 0 {
            return Err(Error::InvalidArgument(format!("{side}: tp_size is 0")));
        }
        if total_kv_heads == 0 {
            return Err(Error::Topology(
                "total_kv_heads is 0 (use 1 for MLA and MQA models)".into(),
            ));
        }
        if total_kv_heads % tp_size != 0 && tp_size % total_kv_heads != 0 {
            let (below, above) = nearest_valid_tp_sizes(tp_size, total_kv_heads);
            return Err(Error::Topology(format!(
                "{side}: tp_size {tp_size} and total_kv_heads {total_kv_heads} divide neither way \
                 (one must be a multiple of the other; nearest valid tp sizes: {below} and {above})"
            )));
        }
        Ok(TpSide {
            side,
            tp_size,
            total_kv_heads,
        })
    }

    /// Which engine this is.
    pub fn side(&self) -> Side {
        self.side
    }

    /// `T`.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// `H`.
    pub fn total_kv_heads(&self) -> u32 {
        self.total_kv_heads
    }

    /// Heads held by one rank: `max(1, H/T)`.
    pub fn heads_per_rank(&self) -> u32 {
        (self.total_kv_heads / self.tp_size).max(1)
    }

    /// Ranks holding a copy of each head: `max(1, T/H)`.
    pub fn replication(&self) -> u32 {
        (self.tp_size / self.total_kv_heads).max(1)
    }

    /// The global heads rank `rank` owns, in the order they sit inside a token.
    pub fn owned_heads(&self, rank: u32) -> Range<u32> {
        debug_assert!(rank < self.tp_size);
        let first = rank / self.replication() * self.heads_per_rank();
        first..first + self.heads_per_rank()
    }

    /// The lowest rank that owns `head`: `first(T, h)`.
    pub fn first_owner(&self, head: u32) -> u32 {
        debug_assert!(head < self.total_kv_heads);
        head / self.heads_per_rank() * self.replication()
    }

    /// Checks `rank < T`.
    pub fn check_rank(&self, rank: u32) -> Result<()> {
        if rank < self.tp_size {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{}: tp_rank {rank} is out of range for tp_size {} (ranks are 0..{})",
                self.side,
                self.tp_size,
                self.tp_size - 1
            )))
        }
    }
}

/// The valid TP sizes just below and just above an invalid `tp_size` for `heads` KV heads.
///
/// Valid sizes are the multiples of `heads` (above it) and its divisors (below it). Computed
/// directly, in at most `sqrt(heads)` steps, so absurd inputs cannot stall an error message.
pub fn nearest_valid_tp_sizes(tp_size: u32, heads: u32) -> (u32, u32) {
    if heads == 0 {
        return (1, 1);
    }
    if tp_size > heads {
        let below = tp_size / heads * heads;
        return (below, below.checked_add(heads).unwrap_or(below));
    }
    let (mut below, mut above) = (1, heads);
    let mut i = 1u32;
    while u64::from(i) * u64::from(i) <= u64::from(heads) {
        if heads % i == 0 {
            for divisor in [i, heads / i] {
                if divisor < tp_size {
                    below = below.max(divisor);
                } else if divisor > tp_size {
                    above = above.min(divisor);
                }
            }
        }
        i += 1;
    }
    (below, above)
}

/// Both sides of a deployment: the model's KV heads sharded over prefill and decode TP ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Topology {
    prefill: TpSide,
    decode: TpSide,
}

/// The heads a (prefill rank, decode rank) pair shares and what the pair does with them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// What the pair does.
    pub action: Action,
    /// The global heads both ranks own (empty for [`Action::NotPaired`]).
    pub shared_heads: Range<u32>,
}

impl Topology {
    /// Validates both TP sizes against `total_kv_heads`.
    pub fn new(total_kv_heads: u32, prefill_tp_size: u32, decode_tp_size: u32) -> Result<Self> {
        // Zero sizes first, so "tp_size is 0" wins over a topology message about the same value.
        for (side, tp_size) in [
            (Side::Prefill, prefill_tp_size),
            (Side::Decode, decode_tp_size),
        ] {
            if tp_size == 0 {
                return Err(Error::InvalidArgument(format!("{side}: tp_size is 0")));
            }
        }
        Ok(Topology {
            prefill: TpSide::new(Side::Prefill, prefill_tp_size, total_kv_heads)?,
            decode: TpSide::new(Side::Decode, decode_tp_size, total_kv_heads)?,
        })
    }

    /// The prefill side (`P`).
    pub fn prefill(&self) -> &TpSide {
        &self.prefill
    }

    /// The decode side (`D`).
    pub fn decode(&self) -> &TpSide {
        &self.decode
    }

    /// The one prefill rank that sends `head` to `decode_rank` (which must own it).
    ///
    /// `sender(d, h) = first(P, h) + (j * rS) / rD` with `j = d - first(D, h)`: the `rD` decode
    /// replicas of a head spread evenly over its `rS` prefill replicas.
    pub fn sender(&self, decode_rank: u32, head: u32) -> u32 {
        debug_assert!(self.decode.owned_heads(decode_rank).contains(&head));
        let j = u64::from(decode_rank - self.decode.first_owner(head));
        let spread =
            j * u64::from(self.prefill.replication()) / u64::from(self.decode.replication());
        // spread < rS <= P, so the narrowing cannot truncate.
        self.prefill.first_owner(head) + spread as u32
    }

    /// What prefill rank `p` and decode rank `d` do, and which heads they share.
    ///
    /// The sender of a shared head is a function of the pair, and when either side owns a single
    /// head the shared range is at most one head; otherwise no side replicates and every shared
    /// head goes from its only owner. So a pair sends all of its shared heads or none of them.
    pub fn pairing(&self, prefill_rank: u32, decode_rank: u32) -> Pairing {
        let src = self.prefill.owned_heads(prefill_rank);
        let dst = self.decode.owned_heads(decode_rank);
        let shared = src.start.max(dst.start)..src.end.min(dst.end);
        if shared.is_empty() {
            return Pairing {
                action: Action::NotPaired,
                shared_heads: 0..0,
            };
        }
        let action = if self.sender(decode_rank, shared.start) == prefill_rank {
            Action::Send
        } else {
            Action::SkipReplica
        };
        debug_assert!(
            shared
                .clone()
                .all(|h| (self.sender(decode_rank, h) == prefill_rank) == (action == Action::Send))
        );
        Pairing {
            action,
            shared_heads: shared,
        }
    }
}

/// The inputs of [`slice_config`], field for field those of `MoriTpSliceParams`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SliceParams {
    /// `P`.
    pub prefill_tp_size: u32,
    /// `p`, below `P`.
    pub prefill_tp_rank: u32,
    /// `D`.
    pub decode_tp_size: u32,
    /// `d`, below `D`.
    pub decode_tp_rank: u32,
    /// `H`: the model's KV heads before TP (1 for MLA and MQA).
    pub total_kv_heads: u32,
    /// Tokens per page, the same on both sides.
    pub page_size: u32,
    /// Bytes of one page of one layer buffer on the prefill rank.
    pub src_item_len: u64,
    /// Bytes of one page of one layer buffer on the decode rank.
    pub dst_item_len: u64,
}

/// What one (prefill rank, decode rank) pair moves inside each token, field for field
/// `MoriTpSliceConfig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceConfig {
    /// What the pair does.
    pub action: Action,
    /// Tokens per page.
    pub page_size: u32,
    /// Global index of the first head moved (0 unless `Send`).
    pub first_head: u32,
    /// Heads moved per token (0 unless `Send`).
    pub num_heads: u32,
    /// Bytes of one source page.
    pub src_item_len: u64,
    /// Bytes of one destination page.
    pub dst_item_len: u64,
    /// Bytes of one source token: the source row pitch.
    pub bytes_per_token_src: u64,
    /// Bytes of one destination token: the destination row pitch.
    pub bytes_per_token_dst: u64,
    /// Byte offset of the slice inside a source token (0 unless `Send`).
    pub src_head_slice_offset: u64,
    /// Byte offset of the slice inside a destination token (0 unless `Send`).
    pub dst_head_slice_offset: u64,
    /// Slice width in bytes (0 unless `Send`).
    pub heads_bytes_per_token_to_send: u64,
}

/// Bytes of one token of one side: `item_len / page_size`, which must divide exactly.
fn bytes_per_token(side: Side, item_len: u64, page_size: u32) -> Result<u64> {
    let field = match side {
        Side::Prefill => "src_item_len",
        Side::Decode => "dst_item_len",
    };
    if item_len == 0 {
        return Err(Error::InvalidArgument(format!("{side}: {field} is 0")));
    }
    if page_size == 0 {
        return Err(Error::InvalidArgument("page_size is 0".into()));
    }
    if item_len % u64::from(page_size) != 0 {
        return Err(Error::LayoutMismatch(format!(
            "{side}: {field} {item_len} is not a multiple of page_size {page_size}"
        )));
    }
    Ok(item_len / u64::from(page_size))
}

/// Bytes of one head of one side: bytes per token split over the heads the rank holds.
fn bytes_per_head(tp: &TpSide, bytes_per_token: u64) -> Result<u64> {
    let heads = u64::from(tp.heads_per_rank());
    if bytes_per_token % heads != 0 {
        return Err(Error::LayoutMismatch(format!(
            "{}: bytes_per_token {bytes_per_token} is not a multiple of the {heads} heads per rank \
             (tp_size {}, total_kv_heads {})",
            tp.side(),
            tp.tp_size(),
            tp.total_kv_heads()
        )));
    }
    Ok(bytes_per_token / heads)
}

/// The slice a (prefill rank, decode rank) pair moves, or why the layout is invalid.
///
/// Validates, in this order: zero fields and ranks (`InvalidArgument`), the head/TP divisibility
/// of both sides (`Topology`), then the byte layout of both sides and that both agree on the bytes
/// of one head (`LayoutMismatch`). Pure: no allocation on success, no I/O.
pub fn slice_config(params: &SliceParams) -> Result<SliceConfig> {
    if params.page_size == 0 {
        return Err(Error::InvalidArgument("page_size is 0".into()));
    }
    let topology = Topology::new(
        params.total_kv_heads,
        params.prefill_tp_size,
        params.decode_tp_size,
    )?;
    topology.prefill().check_rank(params.prefill_tp_rank)?;
    topology.decode().check_rank(params.decode_tp_rank)?;

    let bpt_src = bytes_per_token(Side::Prefill, params.src_item_len, params.page_size)?;
    let bpt_dst = bytes_per_token(Side::Decode, params.dst_item_len, params.page_size)?;
    let bph_src = bytes_per_head(topology.prefill(), bpt_src)?;
    let bph_dst = bytes_per_head(topology.decode(), bpt_dst)?;
    if bph_src != bph_dst {
        return Err(Error::LayoutMismatch(format!(
            "decode side: bytes_per_head {bph_dst} != prefill side bytes_per_head {bph_src} \
             (dtype or head_dim differ; bytes_per_token {bpt_dst} / {} heads vs {bpt_src} / {} heads)",
            topology.decode().heads_per_rank(),
            topology.prefill().heads_per_rank()
        )));
    }

    let pairing = topology.pairing(params.prefill_tp_rank, params.decode_tp_rank);
    let mut config = SliceConfig {
        action: pairing.action,
        page_size: params.page_size,
        first_head: 0,
        num_heads: 0,
        src_item_len: params.src_item_len,
        dst_item_len: params.dst_item_len,
        bytes_per_token_src: bpt_src,
        bytes_per_token_dst: bpt_dst,
        src_head_slice_offset: 0,
        dst_head_slice_offset: 0,
        heads_bytes_per_token_to_send: 0,
    };
    if pairing.action == Action::Send {
        let heads = pairing.shared_heads;
        let src_first = topology.prefill().owned_heads(params.prefill_tp_rank).start;
        let dst_first = topology.decode().owned_heads(params.decode_tp_rank).start;
        // Every product below is at most bytes_per_token, which fits in u64.
        config.first_head = heads.start;
        config.num_heads = heads.len() as u32;
        config.src_head_slice_offset = u64::from(heads.start - src_first) * bph_src;
        config.dst_head_slice_offset = u64::from(heads.start - dst_first) * bph_src;
        config.heads_bytes_per_token_to_send = u64::from(config.num_heads) * bph_src;
    }
    debug_assert_eq!(config.validate(), Ok(()));
    Ok(config)
}

impl SliceConfig {
    /// Re-validates a config that may have been edited by hand (or arrived from another process)
    /// before anything is computed from it.
    ///
    /// Checks that the redundant fields agree (`item_len == page_size * bytes_per_token`, width a
    /// whole number of heads, offsets on head boundaries, zeros when not `Send`) and that the
    /// slice fits inside both token slots.
    pub fn validate(&self) -> Result<()> {
        let bpt_src = bytes_per_token(Side::Prefill, self.src_item_len, self.page_size)?;
        let bpt_dst = bytes_per_token(Side::Decode, self.dst_item_len, self.page_size)?;
        for (side, stated, derived) in [
            (Side::Prefill, self.bytes_per_token_src, bpt_src),
            (Side::Decode, self.bytes_per_token_dst, bpt_dst),
        ] {
            if stated != derived {
                let (pitch, item) = match side {
                    Side::Prefill => ("bytes_per_token_src", "src_item_len"),
                    Side::Decode => ("bytes_per_token_dst", "dst_item_len"),
                };
                return Err(Error::InvalidArgument(format!(
                    "inconsistent config: {pitch} {stated} but {item} / page_size = {derived}"
                )));
            }
        }
        let width = self.heads_bytes_per_token_to_send;
        if self.action != Action::Send {
            if self.num_heads != 0
                || width != 0
                || self.first_head != 0
                || self.src_head_slice_offset != 0
                || self.dst_head_slice_offset != 0
            {
                return Err(Error::InvalidArgument(format!(
                    "inconsistent config: action {:?} moves nothing, but first_head {}, num_heads \
                     {}, src_head_slice_offset {}, dst_head_slice_offset {}, \
                     heads_bytes_per_token_to_send {width} are not all 0",
                    self.action,
                    self.first_head,
                    self.num_heads,
                    self.src_head_slice_offset,
                    self.dst_head_slice_offset
                )));
            }
            return Ok(());
        }
        if self.num_heads == 0 || width == 0 {
            return Err(Error::InvalidArgument(format!(
                "inconsistent config: action Send with num_heads {} and \
                 heads_bytes_per_token_to_send {width} (both must be non-zero)",
                self.num_heads
            )));
        }
        for (side, offset, pitch) in [
            (Side::Prefill, self.src_head_slice_offset, bpt_src),
            (Side::Decode, self.dst_head_slice_offset, bpt_dst),
        ] {
            if offset.checked_add(width).is_none_or(|end| end > pitch) {
                return Err(Error::SliceOverflow(format!(
                    "{side}: head slice at offset {offset} of width {width} ends past the \
                     {pitch}-byte token slot"
                )));
            }
        }
        if width % u64::from(self.num_heads) != 0 {
            return Err(Error::InvalidArgument(format!(
                "inconsistent config: heads_bytes_per_token_to_send {width} is not a multiple of \
                 num_heads {}",
                self.num_heads
            )));
        }
        let bph = width / u64::from(self.num_heads);
        for (name, offset) in [
            ("src_head_slice_offset", self.src_head_slice_offset),
            ("dst_head_slice_offset", self.dst_head_slice_offset),
        ] {
            if offset % bph != 0 {
                return Err(Error::InvalidArgument(format!(
                    "inconsistent config: {name} {offset} is not a multiple of bytes_per_head \
                     {bph} (heads_bytes_per_token_to_send {width} / num_heads {})",
                    self.num_heads
                )));
            }
        }
        Ok(())
    }

    /// True when a source row, a destination row and the slice are the same bytes: each run of
    /// pages is then one contiguous block on both sides.
    pub fn is_contiguous(&self) -> bool {
        self.heads_bytes_per_token_to_send == self.bytes_per_token_src
            && self.heads_bytes_per_token_to_send == self.bytes_per_token_dst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_valid_tp_sizes_are_the_neighbouring_divisors_or_multiples() {
        assert_eq!(nearest_valid_tp_sizes(3, 8), (2, 4));
        assert_eq!(nearest_valid_tp_sizes(8, 12), (6, 12));
        assert_eq!(nearest_valid_tp_sizes(5, 12), (4, 6));
        assert_eq!(nearest_valid_tp_sizes(12, 8), (8, 16));
        assert_eq!(nearest_valid_tp_sizes(3, 2), (2, 4));
        // A prime head count just above a huge TP size: no search through billions of sizes.
        assert_eq!(
            nearest_valid_tp_sizes(4_294_967_290, 4_294_967_291),
            (1, 4_294_967_291)
        );
        // No valid size above u32::MAX - 1: both neighbours are the one below.
        assert_eq!(
            nearest_valid_tp_sizes(u32::MAX, 2),
            (u32::MAX - 1, u32::MAX - 1)
        );
        // Every answer is valid, and nothing valid lies strictly between it and tp_size.
        for heads in 1..=64u32 {
            for tp in 1..=200u32 {
                let valid = |t: u32| heads % t == 0 || t % heads == 0;
                if valid(tp) {
                    continue;
                }
                let (below, above) = nearest_valid_tp_sizes(tp, heads);
                assert!(valid(below) && valid(above) && below < tp && tp < above);
                assert!(
                    (below + 1..above).all(|t| t == tp || !valid(t)),
                    "H={heads} T={tp}"
                );
            }
        }
    }
}
