//! The math: which heads each rank owns, which prefill rank sends which head, and the byte slice
//! a (prefill rank, decode rank) pair moves inside every token.
//!
//! Everything here is pure integer arithmetic on the numbers of `REFERENCE.md` sections 2 to 4.
//! Nothing knows about C, GPUs or buffers.

#![forbid(unsafe_code)]

use std::ops::Range;

use crate::error::{Error, Result};
use crate::types::{Action, Side};

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
            return Err(Error::ZeroTpSize { side });
        }
        if total_kv_heads == 0 {
            return Err(Error::ZeroKvHeads);
        }
        if total_kv_heads % tp_size != 0 && tp_size % total_kv_heads != 0 {
            let (nearest_below, nearest_above) = nearest_valid_tp_sizes(tp_size, total_kv_heads);
            return Err(Error::IndivisibleTp {
                side,
                tp_size,
                total_kv_heads,
                nearest_below,
                nearest_above,
            });
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

    /// The global heads rank `rank` owns, in the order they sit inside a token; `None` when
    /// `rank` is not below `T`.
    pub fn owned_heads(&self, rank: u32) -> Option<Range<u32>> {
        (rank < self.tp_size).then(|| self.heads_of(rank))
    }

    /// [`TpSide::owned_heads`] for a rank already known to be below `T`. Every product stays
    /// below `max(H, T)`, so nothing wraps.
    fn heads_of(&self, rank: u32) -> Range<u32> {
        let first = rank / self.replication() * self.heads_per_rank();
        first..first + self.heads_per_rank()
    }

    /// The lowest rank that owns `head`, `first(T, h)`; `None` when `head` is not below `H`.
    pub fn first_owner(&self, head: u32) -> Option<u32> {
        (head < self.total_kv_heads).then(|| self.first_owner_of(head))
    }

    /// [`TpSide::first_owner`] for a head already known to be below `H`: the result is below
    /// `T`, so nothing wraps.
    fn first_owner_of(&self, head: u32) -> u32 {
        head / self.heads_per_rank() * self.replication()
    }

    /// Checks `rank < T`.
    pub fn check_rank(&self, rank: u32) -> Result<()> {
        if rank < self.tp_size {
            Ok(())
        } else {
            Err(Error::RankOutOfRange {
                side: self.side,
                rank,
                tp_size: self.tp_size,
            })
        }
    }
}

/// The valid TP sizes just below and just above an invalid `tp_size` for `heads` KV heads; the
/// one above is `None` when no valid size above `tp_size` fits in `u32`.
///
/// Valid sizes are the multiples of `heads` (above it) and its divisors (below it). Computed
/// directly, in at most `sqrt(heads)` steps, so absurd inputs cannot stall an error message.
/// With `heads == 0` nothing is valid, and the answer is `(0, None)`.
pub fn nearest_valid_tp_sizes(tp_size: u32, heads: u32) -> (u32, Option<u32>) {
    if heads == 0 {
        return (0, None);
    }
    if tp_size > heads {
        let below = tp_size / heads * heads;
        return (below, below.checked_add(heads));
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
    (below, Some(above))
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
                return Err(Error::ZeroTpSize { side });
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

    /// The one prefill rank that sends `head` to `decode_rank`; `None` when `decode_rank` is
    /// not a decode rank or does not own `head`.
    ///
    /// `sender(d, h) = first(P, h) + (j * rS) / rD` with `j = d - first(D, h)`: the `rD` decode
    /// replicas of a head spread evenly over its `rS` prefill replicas.
    pub fn sender(&self, decode_rank: u32, head: u32) -> Option<u32> {
        let owns = self.decode.owned_heads(decode_rank)?.contains(&head);
        owns.then(|| self.sender_of(decode_rank, head))
    }

    /// [`Topology::sender`] for a decode rank known to own `head`.
    fn sender_of(&self, decode_rank: u32, head: u32) -> u32 {
        // d owns h, so d >= first(D, h) and j < rD.
        let j = u64::from(decode_rank - self.decode.first_owner_of(head));
        let spread =
            j * u64::from(self.prefill.replication()) / u64::from(self.decode.replication());
        // spread < rS, and first(P, h) + rS <= P, so neither the narrowing nor the sum wraps.
        self.prefill.first_owner_of(head) + spread as u32
    }

    /// What prefill rank `p` and decode rank `d` do, and which heads they share; refused when
    /// either rank is out of range.
    ///
    /// The sender of a shared head is a function of the pair, and when either side owns a single
    /// head the shared range is at most one head; otherwise no side replicates and every shared
    /// head goes from its only owner. So a pair sends all of its shared heads or none of them.
    pub fn pairing(&self, prefill_rank: u32, decode_rank: u32) -> Result<Pairing> {
        self.prefill.check_rank(prefill_rank)?;
        self.decode.check_rank(decode_rank)?;
        let src = self.prefill.heads_of(prefill_rank);
        let dst = self.decode.heads_of(decode_rank);
        let shared = src.start.max(dst.start)..src.end.min(dst.end);
        if shared.is_empty() {
            return Ok(Pairing {
                action: Action::NotPaired,
                shared_heads: 0..0,
            });
        }
        let action = if self.sender_of(decode_rank, shared.start) == prefill_rank {
            Action::Send
        } else {
            Action::SkipReplica
        };
        debug_assert!(
            shared
                .clone()
                .all(|h| (self.sender_of(decode_rank, h) == prefill_rank)
                    == (action == Action::Send))
        );
        Ok(Pairing {
            action,
            shared_heads: shared,
        })
    }
}

/// The heads rank `tp_rank` of a side of TP size `tp_size` holds: what mori_tp_rank_heads
/// answers. The arguments belong to no side, so its refusals name none.
pub fn rank_heads(total_kv_heads: u32, tp_size: u32, tp_rank: u32) -> Result<Range<u32>> {
    let in_call = |error| Error::LayoutArguments {
        error: Box::new(error),
    };
    let side = TpSide::new(Side::Prefill, tp_size, total_kv_heads).map_err(in_call)?;
    side.check_rank(tp_rank).map_err(in_call)?;
    Ok(side.heads_of(tp_rank))
}

/// The prefill rank that sends `head` to decode rank `decode_tp_rank`: what mori_tp_head_sender
/// answers. Refused when the sizes do not fit `total_kv_heads`, the rank is not below `D`, `head`
/// is not below `H` or the decode rank does not hold `head`.
pub fn head_sender(
    total_kv_heads: u32,
    prefill_tp_size: u32,
    decode_tp_size: u32,
    decode_tp_rank: u32,
    head: u32,
) -> Result<u32> {
    let topology = Topology::new(total_kv_heads, prefill_tp_size, decode_tp_size)?;
    topology.decode.check_rank(decode_tp_rank)?;
    if head >= total_kv_heads {
        return Err(Error::HeadOutOfRange {
            head,
            total_kv_heads,
        });
    }
    let held = topology.decode.heads_of(decode_tp_rank);
    if !held.contains(&head) {
        return Err(Error::HeadNotHeld {
            side: Side::Decode,
            rank: decode_tp_rank,
            head,
            first: held.start,
            last: held.end - 1,
        });
    }
    Ok(topology.sender_of(decode_tp_rank, head))
}

/// Inputs of mori_tp_slice_config: one (prefill rank, decode rank) pair of a deployment.
///
/// Per layer there is one K and one V buffer (MLA: one latent buffer); a buffer is an array of
/// pages of item_len bytes; a page holds page_size tokens, token-major; inside a token the
/// rank's heads are contiguous, in global head order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SliceParams {
    /// P: tensor-parallel size of the prefill engine (> 0).
    pub prefill_tp_size: u32,
    /// p: the sending prefill rank, < P.
    pub prefill_tp_rank: u32,
    /// D: tensor-parallel size of the decode engine (> 0).
    pub decode_tp_size: u32,
    /// d: the receiving decode rank, < D.
    pub decode_tp_rank: u32,
    /// H: the model's KV heads before TP (num_key_value_heads); 1 for MLA and MQA.
    /// Each TP size must divide H or be a multiple of it.
    pub total_kv_heads: u32,
    /// Tokens per page, the same on both sides (> 0).
    pub page_size: u32,
    /// Bytes of one page of one layer buffer on rank p (page_size * heads on p * bytes per head).
    pub src_item_len: u64,
    /// Bytes of one page of one layer buffer on rank d.
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
    if item_len == 0 {
        return Err(Error::ZeroItemLen { side });
    }
    if page_size == 0 {
        return Err(Error::ZeroPageSize);
    }
    if item_len % u64::from(page_size) != 0 {
        return Err(Error::ItemLenNotWholeTokens {
            side,
            item_len,
            page_size,
        });
    }
    Ok(item_len / u64::from(page_size))
}

/// Bytes of one head of one side: bytes per token split over the heads the rank holds.
fn bytes_per_head(tp: &TpSide, bytes_per_token: u64) -> Result<u64> {
    let heads = tp.heads_per_rank();
    if bytes_per_token % u64::from(heads) != 0 {
        return Err(Error::TokenNotWholeHeads {
            side: tp.side(),
            bytes_per_token,
            heads_per_rank: heads,
            tp_size: tp.tp_size(),
            total_kv_heads: tp.total_kv_heads(),
        });
    }
    Ok(bytes_per_token / u64::from(heads))
}

/// The slice a (prefill rank, decode rank) pair moves, or why the layout is invalid.
///
/// Validates in three stages and reports the first failure of the first failing stage:
/// 1. fields out of range ([`ErrorClass::InvalidArgument`](crate::ErrorClass)): `page_size`,
///    the TP sizes and the item lengths must be non-zero, each rank below its TP size;
/// 2. the head/TP divisibility of the prefill side, then of the decode side
///    ([`ErrorClass::Topology`](crate::ErrorClass));
/// 3. the byte layout of the prefill side, then of the decode side, then that both agree on the
///    bytes of one head ([`ErrorClass::LayoutMismatch`](crate::ErrorClass)).
///
/// Pure: no allocation on success, no I/O.
pub fn slice_config(params: &SliceParams) -> Result<SliceConfig> {
    if params.page_size == 0 {
        return Err(Error::ZeroPageSize);
    }
    for (side, tp_size, rank, item_len) in [
        (
            Side::Prefill,
            params.prefill_tp_size,
            params.prefill_tp_rank,
            params.src_item_len,
        ),
        (
            Side::Decode,
            params.decode_tp_size,
            params.decode_tp_rank,
            params.dst_item_len,
        ),
    ] {
        if tp_size == 0 {
            return Err(Error::ZeroTpSize { side });
        }
        if item_len == 0 {
            return Err(Error::ZeroItemLen { side });
        }
        if rank >= tp_size {
            return Err(Error::RankOutOfRange {
                side,
                rank,
                tp_size,
            });
        }
    }
    let topology = Topology::new(
        params.total_kv_heads,
        params.prefill_tp_size,
        params.decode_tp_size,
    )?;

    let bpt_src = bytes_per_token(Side::Prefill, params.src_item_len, params.page_size)?;
    let bph_src = bytes_per_head(topology.prefill(), bpt_src)?;
    let bpt_dst = bytes_per_token(Side::Decode, params.dst_item_len, params.page_size)?;
    let bph_dst = bytes_per_head(topology.decode(), bpt_dst)?;
    if bph_src != bph_dst {
        return Err(Error::BytesPerHeadMismatch {
            prefill_bytes_per_head: bph_src,
            decode_bytes_per_head: bph_dst,
            prefill_bytes_per_token: bpt_src,
            decode_bytes_per_token: bpt_dst,
            prefill_heads_per_rank: topology.prefill().heads_per_rank(),
            decode_heads_per_rank: topology.decode().heads_per_rank(),
        });
    }

    let pairing = topology.pairing(params.prefill_tp_rank, params.decode_tp_rank)?;
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
        let src_first = topology.prefill().heads_of(params.prefill_tp_rank).start;
        let dst_first = topology.decode().heads_of(params.decode_tp_rank).start;
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

/// A [`SliceConfig`] that passed validation: only [`SliceConfig::checked`] makes one, so every
/// function that takes it skips the checks a caller's config needs. Reads as a `SliceConfig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValidConfig(SliceConfig);

impl std::ops::Deref for ValidConfig {
    type Target = SliceConfig;

    fn deref(&self) -> &SliceConfig {
        &self.0
    }
}

/// A config on its way into the plan functions: a caller's [`SliceConfig`], validated on the
/// way in, or a [`ValidConfig`], taken as it is.
pub trait IntoValid {
    /// The validated config, or why it is invalid.
    fn into_valid(self) -> Result<ValidConfig>;
}

impl IntoValid for &SliceConfig {
    fn into_valid(self) -> Result<ValidConfig> {
        self.checked()
    }
}

impl IntoValid for &ValidConfig {
    fn into_valid(self) -> Result<ValidConfig> {
        Ok(*self)
    }
}

impl SliceConfig {
    /// Re-validates a config that may have been edited by hand (or arrived from another process)
    /// before anything is computed from it.
    ///
    /// Checks that the redundant fields agree (`item_len == page_size * bytes_per_token`, width a
    /// whole number of heads, offsets on head boundaries, zeros when not `Send`) and that the
    /// slice fits inside both token slots.
    pub fn validate(&self) -> Result<()> {
        self.checked().map(|_| ())
    }

    /// [`SliceConfig::validate`], keeping the proof: the config as a [`ValidConfig`].
    pub fn checked(&self) -> Result<ValidConfig> {
        let bpt_src = bytes_per_token(Side::Prefill, self.src_item_len, self.page_size)?;
        let bpt_dst = bytes_per_token(Side::Decode, self.dst_item_len, self.page_size)?;
        for (side, stated, derived) in [
            (Side::Prefill, self.bytes_per_token_src, bpt_src),
            (Side::Decode, self.bytes_per_token_dst, bpt_dst),
        ] {
            if stated != derived {
                return Err(Error::InconsistentBytesPerToken {
                    side,
                    stated,
                    derived,
                });
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
                return Err(Error::NonSendingSliceFields {
                    action: self.action,
                    first_head: self.first_head,
                    num_heads: self.num_heads,
                    src_head_slice_offset: self.src_head_slice_offset,
                    dst_head_slice_offset: self.dst_head_slice_offset,
                    width,
                });
            }
            return Ok(ValidConfig(*self));
        }
        if self.num_heads == 0 || width == 0 {
            return Err(Error::EmptySendingSlice {
                num_heads: self.num_heads,
                width,
            });
        }
        for (side, offset, bytes_per_token) in [
            (Side::Prefill, self.src_head_slice_offset, bpt_src),
            (Side::Decode, self.dst_head_slice_offset, bpt_dst),
        ] {
            if offset
                .checked_add(width)
                .is_none_or(|end| end > bytes_per_token)
            {
                return Err(Error::SliceOverflow {
                    side,
                    offset,
                    width,
                    bytes_per_token,
                });
            }
        }
        if width % u64::from(self.num_heads) != 0 {
            return Err(Error::WidthNotWholeHeads {
                width,
                num_heads: self.num_heads,
            });
        }
        let bytes_per_head = width / u64::from(self.num_heads);
        for (side, offset) in [
            (Side::Prefill, self.src_head_slice_offset),
            (Side::Decode, self.dst_head_slice_offset),
        ] {
            if offset % bytes_per_head != 0 {
                return Err(Error::OffsetNotOnHead {
                    side,
                    offset,
                    bytes_per_head,
                    width,
                    num_heads: self.num_heads,
                });
            }
        }
        Ok(ValidConfig(*self))
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
    fn the_public_math_answers_none_or_an_error_for_input_outside_the_layout() {
        // Total functions: out-of-range input gets None or an error in every build, never a
        // wrapped or wrong answer (they used to rely on debug_assert).
        let topology = Topology::new(4, 2, 8).unwrap();
        let (prefill, decode) = (topology.prefill(), topology.decode());
        assert_eq!(decode.owned_heads(7), Some(3..4));
        assert_eq!(decode.owned_heads(8), None);
        assert_eq!(prefill.owned_heads(u32::MAX), None);
        assert_eq!(prefill.first_owner(3), Some(1));
        assert_eq!(prefill.first_owner(4), None);
        assert_eq!(decode.first_owner(u32::MAX), None);
        assert_eq!(topology.sender(5, 2), Some(1));
        assert_eq!(
            topology.sender(5, 3),
            None,
            "decode rank 5 does not own head 3"
        );
        assert_eq!(topology.sender(8, 0), None, "no decode rank 8");
        assert_eq!(
            topology.pairing(2, 0),
            Err(Error::RankOutOfRange {
                side: Side::Prefill,
                rank: 2,
                tp_size: 2
            })
        );
        assert_eq!(
            topology.pairing(0, 8),
            Err(Error::RankOutOfRange {
                side: Side::Decode,
                rank: 8,
                tp_size: 8
            })
        );
    }

    #[test]
    fn nearest_valid_tp_sizes_are_the_neighbouring_divisors_or_multiples() {
        assert_eq!(nearest_valid_tp_sizes(3, 8), (2, Some(4)));
        assert_eq!(nearest_valid_tp_sizes(8, 12), (6, Some(12)));
        assert_eq!(nearest_valid_tp_sizes(5, 12), (4, Some(6)));
        assert_eq!(nearest_valid_tp_sizes(12, 8), (8, Some(16)));
        assert_eq!(nearest_valid_tp_sizes(3, 2), (2, Some(4)));
        // A prime head count just above a huge TP size: no search through billions of sizes.
        assert_eq!(
            nearest_valid_tp_sizes(4_294_967_290, 4_294_967_291),
            (1, Some(4_294_967_291))
        );
        // No valid size above u32::MAX - 1 fits in u32: only the one below is named.
        assert_eq!(nearest_valid_tp_sizes(u32::MAX, 2), (u32::MAX - 1, None));
        // Every answer is valid, and nothing valid lies strictly between it and tp_size.
        for heads in 1..=64u32 {
            for tp in 1..=200u32 {
                let valid = |t: u32| heads % t == 0 || t % heads == 0;
                if valid(tp) {
                    continue;
                }
                let (below, above) = nearest_valid_tp_sizes(tp, heads);
                let above = above.unwrap();
                assert!(valid(below) && valid(above) && below < tp && tp < above);
                assert!(
                    (below + 1..above).all(|t| t == tp || !valid(t)),
                    "H={heads} T={tp}"
                );
            }
        }
    }
}
