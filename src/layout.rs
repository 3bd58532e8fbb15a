//! Any page layout: where each (token slot, head) of a rank's pages lives, the pair config two
//! such ranks agree on, and a request of tokens whose page sizes may differ between the sides.
//!
//! A rank describes itself with a [`Layout`]: local head `j` of slot `t` of page `p` is the
//! `head_bytes` bytes at `p * page_stride + offset + t * token_stride + j * head_stride`. That
//! covers token-major pages (NHD: SGLang, vLLM's FlashAttention layout), head-major pages (HND:
//! vLLM with NIXL and on ROCm), padded strides, a non-zero offset (one part of a larger
//! record) and heads that each hold their own run of pages. The ownership rule of
//! [`crate::slice`] applies unchanged: the layouts only say where the owned heads are.

#![forbid(unsafe_code)]

use std::ops::Range;

use crate::error::{Error, Result, checked_product};
use crate::slice::{Topology, TpSide};
use crate::types::{Action, Side, Sides};

/// One rank's page layout: where each (token slot, head) of its pages lives. Each rank describes
/// itself and the two exchange these at handshake. With L the rank's local heads (H / tp_size
/// when tp_size <= H, else 1), local head j of slot t of page p of a buffer is the head_bytes
/// bytes at p * page_stride + offset + t * token_stride + j * head_stride.
///
/// Valid (mori_tp_pair_config and every function taking one check it) when tp_size, page_size
/// and head_bytes are non-zero and tp_rank < tp_size (else MORI_ERR_INVALID_ARGUMENT); H and
/// tp_size divide one way or the other (else MORI_ERR_TOPOLOGY); nothing overflows 64 bits (else
/// MORI_ERR_INVALID_ARGUMENT naming the factors); and (else MORI_ERR_LAYOUT_MISMATCH naming the
/// fields) the elements of a page neither overlap nor interleave: of the slot dimension (stride
/// token_stride, count page_size) and the head dimension (stride head_stride, count L), ignoring
/// one whose count is 1, a single stride is >= head_bytes, and with both, the smaller stride s_a
/// (count n_a) is >= head_bytes and the larger is >= (n_a - 1) * s_a + head_bytes; and pages do
/// not overlap, either with pages outside heads (every usual layout: the page's extent
/// offset + (page_size - 1) * token_stride + (L - 1) * head_stride + head_bytes is <=
/// page_stride) or with heads outside pages (L > 1, head_stride > page_stride >=
/// (page_size - 1) * token_stride + head_bytes: each head holds its own run of pages, like
/// vLLM's LHBNC, and a page p of a request is in bounds only while p * page_stride +
/// (page_size - 1) * token_stride + head_bytes <= head_stride). 56 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Layout {
    /// H: the model's sharded units before TP (KV heads; 1 for MLA or MQA, or for a record
    /// every rank holds whole).
    pub total_kv_heads: u32,
    /// This side's TP size.
    pub tp_size: u32,
    /// This rank, < tp_size.
    pub tp_rank: u32,
    /// Token slots per page, >= 1.
    pub page_size: u32,
    /// Bytes of one head of one token slot: head_dim * dtype bytes.
    pub head_bytes: u64,
    /// Bytes from page i to page i + 1 of a buffer.
    pub page_stride: u64,
    /// Bytes from a page's start to slot 0, local head 0.
    pub offset: u64,
    /// Bytes from slot t to slot t + 1 within a page.
    pub token_stride: u64,
    /// Bytes from local head j to local head j + 1 within a slot.
    pub head_stride: u64,
}

/// How the pages of a valid layout avoid each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Nesting {
    /// A page holds all of the rank's heads and ends before the next page starts.
    PagesOutsideHeads,
    /// Each head holds its own run of pages (`head_stride > page_stride`, like vLLM's LHBNC):
    /// a page index is in bounds only while its page ends before the next head's run.
    HeadsOutsidePages,
}

impl Layout {
    /// The token-major layout (NHD) of one rank, offset 0: `head_stride = head_bytes`,
    /// `token_stride = L * head_bytes`, `page_stride = page_size * L * head_bytes`.
    pub fn nhd(
        total_kv_heads: u32,
        tp_size: u32,
        tp_rank: u32,
        page_size: u32,
        head_bytes: u64,
    ) -> Result<Layout> {
        Layout::dense(
            total_kv_heads,
            tp_size,
            tp_rank,
            page_size,
            head_bytes,
            false,
        )
    }

    /// The head-major layout (HND) of one rank, offset 0: `token_stride = head_bytes`,
    /// `head_stride = page_size * head_bytes`, `page_stride = L * page_size * head_bytes`.
    pub fn hnd(
        total_kv_heads: u32,
        tp_size: u32,
        tp_rank: u32,
        page_size: u32,
        head_bytes: u64,
    ) -> Result<Layout> {
        Layout::dense(
            total_kv_heads,
            tp_size,
            tp_rank,
            page_size,
            head_bytes,
            true,
        )
    }

    fn dense(
        total_kv_heads: u32,
        tp_size: u32,
        tp_rank: u32,
        page_size: u32,
        head_bytes: u64,
        head_major: bool,
    ) -> Result<Layout> {
        let mut layout = Layout {
            total_kv_heads,
            tp_size,
            tp_rank,
            page_size,
            head_bytes,
            ..Layout::default()
        };
        // The sizes and topology first, so that a bad H or TP size is named as such. The layout
        // belongs to no side yet, so its refusals name none.
        let in_layout = |error| Error::LayoutArguments {
            error: Box::new(error),
        };
        let local = layout.check_fields(Side::Prefill).map_err(in_layout)?;
        let slot = u64::from(page_size);
        let heads = u64::from(local);
        let page =
            checked_product("page_size * head_bytes", slot, head_bytes).map_err(in_layout)?;
        layout.page_stride = checked_product("local heads * page_size * head_bytes", heads, page)
            .map_err(in_layout)?;
        if head_major {
            (layout.token_stride, layout.head_stride) = (head_bytes, page);
        } else {
            let token = heads * head_bytes; // below page_stride, which fits
            (layout.token_stride, layout.head_stride) = (token, head_bytes);
        }
        Ok(layout)
    }

    /// The non-zero fields, the rank and the topology; the local head count.
    fn check_fields(&self, side: Side) -> Result<u32> {
        if self.tp_size == 0 {
            return Err(Error::ZeroTpSize { side });
        }
        for (field, value) in [
            ("page_size", u64::from(self.page_size)),
            ("head_bytes", self.head_bytes),
        ] {
            if value == 0 {
                return Err(Error::ZeroLayoutField { side, field });
            }
        }
        if self.tp_rank >= self.tp_size {
            return Err(Error::RankOutOfRange {
                side,
                rank: self.tp_rank,
                tp_size: self.tp_size,
            });
        }
        Ok(TpSide::new(side, self.tp_size, self.total_kv_heads)?.heads_per_rank())
    }

    /// Validates the layout of `side` (REFERENCE.md section 11): non-zero sizes and a rank below the
    /// TP size, the topology, no overflow, elements that neither overlap nor interleave, and
    /// pages that do not overlap.
    pub fn check(&self, side: Side) -> Result<ValidLayout> {
        let local = self.check_fields(side)?;
        let hb = self.head_bytes;
        let slots = u64::from(self.page_size);
        let heads = u64::from(local);
        // Dimensions whose count is 1 have no stride to respect.
        let mut dims: Vec<(&'static str, u64, u64)> = [
            ("token_stride", self.token_stride, slots),
            ("head_stride", self.head_stride, heads),
        ]
        .into_iter()
        .filter(|&(_, _, count)| count > 1)
        .collect();
        dims.sort_by_key(|&(_, stride, _)| stride);
        if let Some(&(field, stride, _)) = dims.first()
            && stride < hb
        {
            return Err(Error::ElementsOverlap {
                side,
                field,
                stride,
                head_bytes: hb,
            });
        }
        if let [(inner, s_a, n_a), (outer, s_b, _)] = dims[..] {
            let span = checked_sum(
                "(count - 1) * stride + head_bytes",
                checked_product(inner, n_a - 1, s_a)?,
                hb,
            )?;
            if s_b < span {
                return Err(Error::ElementsInterleave {
                    side,
                    outer,
                    outer_stride: s_b,
                    inner,
                    inner_stride: s_a,
                    inner_count: n_a,
                    head_bytes: hb,
                });
            }
        }
        let slot_span = checked_product(
            "(page_size - 1) * token_stride",
            slots - 1,
            self.token_stride,
        )?;
        let head_span = checked_product(
            "(local heads - 1) * head_stride",
            heads - 1,
            self.head_stride,
        )?;
        let extent = checked_sum(
            "page extent (offset + slots + heads + head_bytes)",
            checked_sum(
                "offset + (page_size - 1) * token_stride",
                self.offset,
                slot_span,
            )?,
            checked_sum(
                "(local heads - 1) * head_stride + head_bytes",
                head_span,
                hb,
            )?,
        )?;
        let run = checked_sum("(page_size - 1) * token_stride + head_bytes", slot_span, hb)?;
        let nesting = if extent <= self.page_stride {
            Nesting::PagesOutsideHeads
        } else if local > 1 && self.head_stride > self.page_stride && self.page_stride >= run {
            Nesting::HeadsOutsidePages
        } else {
            return Err(Error::PagesOverlap {
                side,
                extent,
                page_stride: self.page_stride,
                offset: self.offset,
                token_stride: self.token_stride,
                head_stride: self.head_stride,
                page_size: self.page_size,
                local_heads: local,
                head_bytes: hb,
            });
        };
        let owned = TpSide::new(side, self.tp_size, self.total_kv_heads)?
            .owned_heads(self.tp_rank)
            .expect("the rank was checked against the TP size");
        Ok(ValidLayout {
            layout: *self,
            side,
            owned,
            extent,
            run,
            nesting,
        })
    }
}

fn checked_sum(quantity: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or(Error::SumOverflow {
        quantity,
        lhs: a,
        rhs: b,
    })
}

/// A [`Layout`] that passed [`Layout::check`], with what validation derived.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ValidLayout {
    layout: Layout,
    side: Side,
    owned: Range<u32>,
    extent: u64,
    run: u64,
    nesting: Nesting,
}

impl ValidLayout {
    /// The layout as given.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Which engine.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The global heads this rank holds, in local order.
    pub fn owned_heads(&self) -> Range<u32> {
        self.owned.clone()
    }

    /// L: heads this rank holds.
    pub fn local_heads(&self) -> u32 {
        self.owned.len() as u32
    }

    /// Bytes from a page's start to the end of its last element:
    /// `offset + (page_size - 1) * token_stride + (L - 1) * head_stride + head_bytes`.
    pub fn extent(&self) -> u64 {
        self.extent
    }

    /// How pages avoid each other.
    pub fn nesting(&self) -> Nesting {
        self.nesting
    }

    /// Checks page `page` at `position` of a request's list against a buffer of `capacity`
    /// bytes (`None`: no capacity known yet) and, with heads outside pages, against its head's
    /// run; returns the byte its page ends at.
    fn check_page(
        &self,
        page: i32,
        position_of: impl Fn() -> usize,
        capacity: Option<u64>,
    ) -> Result<u64> {
        let side = self.side;
        if page < 0 {
            return Err(Error::NegativePage {
                side,
                page,
                position: position_of(),
            });
        }
        let page_u = page as u64;
        let overflow = || Error::PageEndOverflow {
            side,
            page: page as u32,
            position: position_of(),
            page_stride: self.layout.page_stride,
            extent: self.extent,
        };
        let start = page_u
            .checked_mul(self.layout.page_stride)
            .ok_or_else(overflow)?;
        let end = start.checked_add(self.extent).ok_or_else(overflow)?;
        if self.nesting == Nesting::HeadsOutsidePages {
            let run_end = start.checked_add(self.run).ok_or_else(overflow)?;
            if run_end > self.layout.head_stride {
                return Err(Error::PagePastHeadRun {
                    side,
                    page: page as u32,
                    position: position_of(),
                    end: run_end,
                    head_stride: self.layout.head_stride,
                });
            }
        }
        if let Some(capacity) = capacity
            && end > capacity
        {
            return Err(Error::PagePastCapacity {
                side,
                page: page as u32,
                position: position_of(),
                end,
                capacity,
            });
        }
        Ok(end)
    }
}

/// One side of a pair config: its validated layout and where the moved heads start among its
/// local heads and in its pages, computed once by [`pair_config`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PairSide {
    layout: ValidLayout,
    first_local: u32,
    base: u64,
}

impl PairSide {
    /// The side's layout, validated.
    pub fn layout(&self) -> &ValidLayout {
        &self.layout
    }

    /// Local index of the first head moved (0 unless the pair sends).
    pub fn first_local(&self) -> u32 {
        self.first_local
    }

    /// Byte of the first moved head in page 0: `offset + first_local * head_stride`, inside
    /// the page's extent (which validation checked to fit).
    pub fn base(&self) -> u64 {
        self.base
    }
}

/// What a prefill rank and a decode rank agree on for a transfer (`MoriTpPairConfig`): made
/// only by [`pair_config`] from the two layouts, so its fields always agree with them. Each
/// side's geometry is computed here, once; planning reads it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PairConfig {
    action: Action,
    first_head: u32,
    num_heads: u32,
    sides: Sides<PairSide>,
}

/// The pair config of a prefill rank and a decode rank, or why their layouts cannot work
/// together: each layout is validated ([`Layout::check`]), then both must count the same
/// heads (`MORI_ERR_TOPOLOGY`) and agree on `head_bytes` (`MORI_ERR_LAYOUT_MISMATCH`: a dtype
/// or head_dim mismatch). Page sizes and strides may differ.
pub fn pair_config(prefill: &Layout, decode: &Layout) -> Result<PairConfig> {
    let layouts = Sides::new(prefill, decode);
    let valid = Sides::try_from_fn(|side| layouts[side].check(side))?;
    if prefill.total_kv_heads != decode.total_kv_heads {
        return Err(Error::KvHeadsDiffer {
            prefill: prefill.total_kv_heads,
            decode: decode.total_kv_heads,
        });
    }
    if prefill.head_bytes != decode.head_bytes {
        return Err(Error::HeadBytesDiffer {
            prefill: prefill.head_bytes,
            decode: decode.head_bytes,
        });
    }
    let topology = Topology::new(prefill.total_kv_heads, prefill.tp_size, decode.tp_size)?;
    let pairing = topology.pairing(prefill.tp_rank, decode.tp_rank)?;
    let sends = pairing.action == Action::Send;
    let shared = if sends { pairing.shared_heads } else { 0..0 };
    let sides = valid.map(|_, layout| {
        let first_local = if sends {
            shared.start - layout.owned.start
        } else {
            0
        };
        // first_local < L, and offset + (L - 1) * head_stride is inside the checked extent.
        let base = layout.layout.offset + u64::from(first_local) * layout.layout.head_stride;
        PairSide {
            layout,
            first_local,
            base,
        }
    });
    Ok(PairConfig {
        action: pairing.action,
        first_head: shared.start,
        num_heads: shared.len() as u32,
        sides,
    })
}

impl PairConfig {
    /// What the pair does.
    pub fn action(&self) -> Action {
        self.action
    }

    /// True when the pair moves bytes.
    pub fn sends(&self) -> bool {
        self.action == Action::Send
    }

    /// Global index of the first head moved (0 unless it sends).
    pub fn first_head(&self) -> u32 {
        self.first_head
    }

    /// n: heads moved per token (0 unless it sends).
    pub fn num_heads(&self) -> u32 {
        self.num_heads
    }

    /// Both sides.
    pub fn sides(&self) -> &Sides<PairSide> {
        &self.sides
    }

    /// One side's layout.
    pub fn side(&self, side: Side) -> &ValidLayout {
        &self.sides[side].layout
    }

    /// The prefill rank's layout, validated (`MoriTpPairConfig.src`).
    pub fn src(&self) -> &ValidLayout {
        self.side(Side::Prefill)
    }

    /// The decode rank's layout, validated (`MoriTpPairConfig.dst`).
    pub fn dst(&self) -> &ValidLayout {
        self.side(Side::Decode)
    }

    /// Local index of the first head moved on the prefill rank (`src_first_local`).
    pub fn src_first_local(&self) -> u32 {
        self.sides.prefill.first_local
    }

    /// Local index of the first head moved on the decode rank (`dst_first_local`).
    pub fn dst_first_local(&self) -> u32 {
        self.sides.decode.first_local
    }

    /// Bytes one buffer stages for `num_tokens` tokens: `N * n * head_bytes` (0 unless it
    /// sends).
    pub fn staging_len(&self, num_tokens: u64) -> Result<u64> {
        // Within a slot: n heads of head_bytes.
        let slice = u64::from(self.num_heads) * self.sides.prefill.layout.layout.head_bytes;
        checked_product("staging_len (tokens * n * head_bytes)", num_tokens, slice)
    }
}

/// A request: tokens `0 .. num_tokens` of one sequence, token `k` in slot `k % page_size` of
/// page `pages[k / page_size]` on each side, with that side's page size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Request<'a> {
    /// `ceil(num_tokens / src.page_size)` pages on the prefill rank.
    pub src_pages: &'a [i32],
    /// `ceil(num_tokens / dst.page_size)` pages on the decode rank.
    pub dst_pages: &'a [i32],
    /// N.
    pub num_tokens: u64,
}

/// The highest page of one side of a checked request and the byte its page ends at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageEnd {
    /// The page index.
    pub page: u32,
    /// `page * page_stride + extent`.
    pub end: u64,
}

/// A [`Request`] checked against a pair config ([`Request::check`]): each side's page count,
/// its pages (none negative, none whose end overflows, none past its head's run) and its
/// highest page, and the bytes each buffer stages. What planning needs of the pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckedRequest<'a> {
    pages: Sides<&'a [i32]>,
    num_tokens: u64,
    highest: Sides<Option<PageEnd>>,
    staging_len: u64,
}

/// The highest index of a page list, after refusing a negative one (the lowest position).
pub(crate) fn highest_page(side: Side, pages: &[i32]) -> Result<Option<i32>> {
    // No early exit and no bounds checks: the loop runs at memory speed.
    let (ored, max) = pages
        .iter()
        .fold((0i32, i32::MIN), |(ored, max), &p| (ored | p, max.max(p)));
    if ored < 0 {
        let position = pages.iter().position(|&p| p < 0).unwrap_or(0);
        return Err(Error::NegativePage {
            side,
            page: pages[position],
            position,
        });
    }
    Ok((!pages.is_empty()).then_some(max))
}

/// Position of `page` in `pages`, looked up only to name it in a message.
pub(crate) fn position_of(pages: &[i32], page: u64) -> usize {
    pages.iter().position(|&p| p as u64 == page).unwrap_or(0)
}

impl<'a> Request<'a> {
    /// One side's page list.
    pub fn pages(&self, side: Side) -> &'a [i32] {
        match side {
            Side::Prefill => self.src_pages,
            Side::Decode => self.dst_pages,
        }
    }

    /// Checks the request against `config`, once: each side lists exactly
    /// `ceil(N / page_size)` pages, none negative, and its highest page ends within 64 bits
    /// (and, with heads outside pages, within its head's run); `staging_len` fits.
    pub fn check(&self, config: &PairConfig) -> Result<CheckedRequest<'a>> {
        for side in Side::BOTH {
            let page_size = config.side(side).layout.page_size;
            let count = self.pages(side).len();
            let expected = self.num_tokens.div_ceil(u64::from(page_size));
            if count as u64 != expected {
                return Err(Error::PageCountForTokens {
                    side,
                    count,
                    num_tokens: self.num_tokens,
                    page_size,
                    expected,
                });
            }
        }
        let pages = Sides::from_fn(|side| self.pages(side));
        let highest = Sides::try_from_fn(|side| -> Result<Option<PageEnd>> {
            let pages = pages[side];
            let Some(max) = highest_page(side, pages)? else {
                return Ok(None);
            };
            let position = || position_of(pages, max as u64);
            let end = config.side(side).check_page(max, position, None)?;
            Ok(Some(PageEnd {
                page: max as u32,
                end,
            }))
        })?;
        let staging_len = if config.sends() {
            config.staging_len(self.num_tokens)?
        } else {
            0
        };
        Ok(CheckedRequest {
            pages,
            num_tokens: self.num_tokens,
            highest,
            staging_len,
        })
    }
}

impl<'a> CheckedRequest<'a> {
    /// One side's page list.
    pub fn pages(&self, side: Side) -> &'a [i32] {
        self.pages[side]
    }

    /// N.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// One side's highest page and where it ends (`None`: no pages).
    pub fn highest(&self, side: Side) -> Option<PageEnd> {
        self.highest[side]
    }

    /// Bytes each buffer stages: `N * n * head_bytes` (0 unless the pair sends).
    pub fn staging_len(&self) -> u64 {
        self.staging_len
    }

    /// Checks that every page of `side` ends within a buffer of `capacity` bytes.
    pub fn check_capacity(&self, side: Side, capacity: u64) -> Result<()> {
        match self.highest[side] {
            Some(PageEnd { page, end }) if end > capacity => Err(Error::PagePastCapacity {
                side,
                page,
                position: position_of(self.pages[side], u64::from(page)),
                end,
                capacity,
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nhd_and_hnd_have_the_strides_of_section_7() {
        // 8 KV heads, TP 2: 4 local heads; page 16; 256-byte heads.
        let nhd = Layout::nhd(8, 2, 1, 16, 256).unwrap();
        assert_eq!(
            (nhd.head_stride, nhd.token_stride, nhd.page_stride),
            (256, 1024, 16 * 1024)
        );
        let hnd = Layout::hnd(8, 2, 1, 16, 256).unwrap();
        assert_eq!(
            (hnd.token_stride, hnd.head_stride, hnd.page_stride),
            (256, 16 * 256, 4 * 16 * 256)
        );
        for layout in [nhd, hnd] {
            let valid = layout.check(Side::Decode).unwrap();
            assert_eq!(valid.owned_heads(), 4..8);
            assert_eq!(valid.extent(), layout.page_stride);
            assert_eq!(valid.nesting(), Nesting::PagesOutsideHeads);
        }
    }

    #[test]
    fn overlapping_or_interleaved_elements_and_pages_are_layout_mismatches() {
        let base = Layout::nhd(4, 1, 0, 4, 16).unwrap();
        let narrow = Layout {
            head_stride: 8,
            ..base
        };
        assert!(matches!(
            narrow.check(Side::Prefill),
            Err(Error::ElementsOverlap {
                field: "head_stride",
                ..
            })
        ));
        // Tokens 32 bytes apart but 4 heads 16 apart: token 1 lands inside token 0's heads.
        let interleaved = Layout {
            token_stride: 32,
            ..base
        };
        assert!(matches!(
            interleaved.check(Side::Prefill),
            Err(Error::ElementsInterleave {
                outer: "token_stride",
                ..
            })
        ));
        let short_page = Layout {
            page_stride: base.page_stride - 1,
            ..base
        };
        assert!(matches!(
            short_page.check(Side::Decode),
            Err(Error::PagesOverlap {
                side: Side::Decode,
                ..
            })
        ));
        for error in [
            narrow.check(Side::Prefill),
            interleaved.check(Side::Prefill),
            short_page.check(Side::Decode),
        ] {
            assert_eq!(
                error.unwrap_err().class(),
                crate::ErrorClass::LayoutMismatch
            );
        }
    }

    #[test]
    fn heads_outside_pages_bound_each_page_by_its_heads_run() {
        // LHBNC: 2 local heads, each a run of 10 pages of 4 slots of 8 bytes.
        let layout = Layout {
            total_kv_heads: 2,
            tp_size: 1,
            tp_rank: 0,
            page_size: 4,
            head_bytes: 8,
            page_stride: 32,
            offset: 0,
            token_stride: 8,
            head_stride: 320,
        };
        let valid = layout.check(Side::Prefill).unwrap();
        assert_eq!(valid.nesting(), Nesting::HeadsOutsidePages);
        assert!(valid.check_page(9, || 0, None).is_ok());
        assert!(matches!(
            valid.check_page(10, || 3, None),
            Err(Error::PagePastHeadRun {
                page: 10,
                position: 3,
                ..
            })
        ));
    }

    #[test]
    fn a_pair_derives_local_heads_and_refuses_sides_that_disagree() {
        // 8 heads, prefill TP 8 (1 head each) -> decode TP 2 (4 heads each): rank 5 sends head
        // 5, the second local head of decode rank 1.
        let src = Layout::hnd(8, 8, 5, 16, 128).unwrap();
        let dst = Layout::nhd(8, 2, 1, 64, 128).unwrap();
        let config = pair_config(&src, &dst).unwrap();
        assert_eq!(config.action(), Action::Send);
        assert_eq!((config.first_head(), config.num_heads()), (5, 1));
        assert_eq!((config.src_first_local(), config.dst_first_local()), (0, 1));
        let fp8 = Layout::nhd(8, 2, 1, 64, 64).unwrap();
        assert!(matches!(
            pair_config(&src, &fp8),
            Err(Error::HeadBytesDiffer {
                prefill: 128,
                decode: 64
            })
        ));
        let other_model = Layout::nhd(4, 2, 1, 64, 128).unwrap();
        assert_eq!(
            pair_config(&src, &other_model).unwrap_err().class(),
            crate::ErrorClass::Topology
        );
    }
}
