//! A deployment: a model served by a prefill engine of TP size P and a decode engine of TP size D,
//! each side with its own page layout (token-major NHD or head-major HND) and page size, validated
//! by the library. Every byte position comes from the library's layouts (`mori_tp::Layout::nhd`,
//! `mori_tp::Layout::hnd`): each head is `head_dim * dtype` bytes.

use mori_tp::{
    Error, PairConfig, Side, SliceConfig, SliceParams, Topology, TpSide, pair_config, slice_config,
};

use std::io;

use crate::dtype::Dtype;
use crate::model::Model;

/// The largest TP size `mori-tp` accepts on either side. Output grows with the pairs that share
/// heads (up to P x D for MLA), so a bound keeps every command's time and memory bounded: at
/// 1024 x 1024, `plan --json` lists a million pairs. Real engines stay far below it.
pub const MAX_TP_SIZE: u32 = 1024;

/// How one side orders the elements (token slot, head) of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PageOrder {
    /// Token-major: each token slot holds the rank's heads back to back (SGLang; vLLM's
    /// FlashAttention layout)
    Nhd,
    /// Head-major: each head holds the page's token slots back to back (vLLM with NIXL, vLLM on
    /// ROCm)
    Hnd,
}

impl PageOrder {
    /// `nhd` or `hnd`, as the flags and `--json` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PageOrder::Nhd => "nhd",
            PageOrder::Hnd => "hnd",
        }
    }

    /// `NHD` or `HND`, for people.
    pub fn label(self) -> &'static str {
        match self {
            PageOrder::Nhd => "NHD",
            PageOrder::Hnd => "HND",
        }
    }
}

/// One side's pages: their order and their token slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Paging {
    pub order: PageOrder,
    /// Token slots per page.
    pub page_size: u32,
}

impl Paging {
    /// Token-major pages of `page_size` slots: the layout of REFERENCE.md sections 2-6.
    #[cfg(test)]
    pub fn nhd(page_size: u32) -> Paging {
        Paging {
            order: PageOrder::Nhd,
            page_size,
        }
    }

    /// Pages a request of `tokens` tokens occupies: `ceil(tokens / page_size)`.
    pub fn pages(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.page_size))
    }

    /// Token slots of the last page a request of `tokens` tokens leaves unused (0: whole pages).
    pub fn unused_slots(&self, tokens: u64) -> u64 {
        self.pages(tokens) * u64::from(self.page_size) - tokens
    }

    /// `HND pages of 16 tokens`.
    pub fn describe(&self) -> String {
        format!(
            "{} pages of {} token{}",
            self.order.label(),
            self.page_size,
            if self.page_size == 1 { "" } else { "s" }
        )
    }
}

/// A model, a dtype, each side's paging and both TP sizes, checked by the library.
#[derive(Clone, Debug)]
pub struct Layout {
    pub model: Model,
    pub dtype: Dtype,
    /// The prefill side's page order and page size.
    pub prefill_paging: Paging,
    /// The decode side's page order and page size.
    pub decode_paging: Paging,
    /// Both sides' head ownership, from the library.
    pub topology: Topology,
    /// `head_dim * dtype` bytes.
    pub bytes_per_head: u64,
    /// Bytes of one page of one layer buffer on a prefill rank (the layout's `page_stride`).
    pub src_item_len: u64,
    /// Bytes of one page of one layer buffer on a decode rank (the layout's `page_stride`).
    pub dst_item_len: u64,
}

/// One reason a layout cannot run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// For people: names the side, the values and what would work.
    pub message: String,
    /// The numbers of a TP size that does not fit the model's KV heads.
    pub topology: Option<TopologyProblem>,
}

/// A TP size that neither divides the model's KV heads nor is a multiple of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyProblem {
    pub side: Side,
    pub tp_size: u32,
    pub kv_heads: u32,
    /// The valid sizes nearest to `tp_size`: the one below and the one above, where each exists.
    pub nearest: Vec<u32>,
}

/// Why a layout cannot run: one problem per side or check that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutError {
    pub summary: String,
    pub problems: Vec<Problem>,
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.summary)?;
        for problem in &self.problems {
            write!(f, "\n  {}", problem.message)?;
        }
        Ok(())
    }
}

/// Why writing a plan (or its groups) stopped.
#[derive(Debug)]
pub enum Failure {
    Layout(LayoutError),
    Io(io::Error),
}

impl From<LayoutError> for Failure {
    fn from(e: LayoutError) -> Self {
        Failure::Layout(e)
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Io(e)
    }
}

impl Problem {
    /// A problem in the library's words, with its numbers where it is about a TP size.
    pub fn from_library(error: &Error) -> Problem {
        let topology = match *error {
            Error::IndivisibleTp {
                side,
                tp_size,
                total_kv_heads,
                nearest_below,
                nearest_above,
            } => Some(TopologyProblem {
                side,
                tp_size,
                kv_heads: total_kv_heads,
                nearest: std::iter::once(nearest_below)
                    .chain(nearest_above)
                    .collect(),
            }),
            _ => None,
        };
        Problem {
            message: error.to_string(),
            topology,
        }
    }
}

impl Layout {
    /// Validates the deployment with the library: both TP sizes against the model's KV heads
    /// (every invalid side is reported, each with the nearest valid sizes), then each side's
    /// page layout (`mori_tp::Layout::nhd` or `hnd`), then the pair config of the two.
    pub fn new(
        model: Model,
        dtype: Dtype,
        prefill_paging: Paging,
        decode_paging: Paging,
        prefill_tp: u32,
        decode_tp: u32,
    ) -> Result<Layout, LayoutError> {
        let summary = format!(
            "{} ({} KV heads) cannot run with prefill TP {prefill_tp} and decode TP {decode_tp}:",
            model.name, model.kv_heads
        );
        let fail = |error: Error| LayoutError {
            summary: summary.clone(),
            problems: vec![Problem::from_library(&error)],
        };
        // Each side on its own, so that both are reported when both are wrong.
        let mut problems: Vec<Problem> = Vec::new();
        for (side, tp_size) in [(Side::Prefill, prefill_tp), (Side::Decode, decode_tp)] {
            if let Err(error) = TpSide::new(side, tp_size, model.kv_heads) {
                let problem = Problem::from_library(&error);
                // Both sides report the same problem for a model without heads.
                if !problems.contains(&problem) {
                    problems.push(problem);
                }
            }
        }
        if !problems.is_empty() {
            return Err(LayoutError { summary, problems });
        }
        let topology = Topology::new(model.kv_heads, prefill_tp, decode_tp).map_err(fail)?;
        let bytes_per_head = model.bytes_per_head(dtype);
        let mut layout = Layout {
            model,
            dtype,
            prefill_paging,
            decode_paging,
            topology,
            bytes_per_head,
            // Set below from the library's layouts.
            src_item_len: 0,
            dst_item_len: 0,
        };
        // Each side's layout as the library builds it (its overflow checks name the factors).
        for side in [Side::Prefill, Side::Decode] {
            let rank_layout = layout.rank_layout(side, 0).map_err(|error| LayoutError {
                summary: summary.clone(),
                problems: vec![Problem {
                    message: format!("{side}: {}: {error}", layout.paging(side).describe()),
                    topology: None,
                }],
            })?;
            match side {
                Side::Prefill => layout.src_item_len = rank_layout.page_stride,
                Side::Decode => layout.dst_item_len = rank_layout.page_stride,
            }
        }
        // The library has the last word on the pair.
        layout.pair_config(0, 0).map_err(fail)?;
        Ok(layout)
    }

    /// `P`.
    pub fn prefill_tp(&self) -> u32 {
        self.topology.prefill().tp_size()
    }

    /// `D`.
    pub fn decode_tp(&self) -> u32 {
        self.topology.decode().tp_size()
    }

    /// One side's paging.
    pub fn paging(&self, side: Side) -> &Paging {
        match side {
            Side::Prefill => &self.prefill_paging,
            Side::Decode => &self.decode_paging,
        }
    }

    /// True for the one layout of REFERENCE.md sections 2-6: token-major pages of one size on
    /// both sides, where the plan reads as it always has.
    pub fn is_classic(&self) -> bool {
        self.prefill_paging.order == PageOrder::Nhd && self.prefill_paging == self.decode_paging
    }

    /// The page size both sides share, if they do.
    pub fn common_page_size(&self) -> Option<u32> {
        (self.prefill_paging.page_size == self.decode_paging.page_size)
            .then_some(self.prefill_paging.page_size)
    }

    /// The heads prefill rank `p` owns (`p` below the prefill TP size).
    pub fn prefill_heads(&self, p: u32) -> std::ops::Range<u32> {
        let side = self.topology.prefill();
        side.owned_heads(p)
            .expect("a prefill rank below its TP size")
    }

    /// The heads decode rank `d` owns (`d` below the decode TP size).
    pub fn decode_heads(&self, d: u32) -> std::ops::Range<u32> {
        let side = self.topology.decode();
        side.owned_heads(d)
            .expect("a decode rank below its TP size")
    }

    /// KV buffers per rank over `layers` layers: K and V of each layer, or one MLA latent.
    pub fn buffers(&self, layers: u32) -> u64 {
        u64::from(layers) * u64::from(self.model.attention.buffers_per_layer())
    }

    /// The library's layout of rank `rank` of `side` (`mori_tp_layout_nhd` or `_hnd`).
    pub fn rank_layout(&self, side: Side, rank: u32) -> mori_tp::Result<mori_tp::Layout> {
        let paging = self.paging(side);
        let tp_size = match side {
            Side::Prefill => self.prefill_tp(),
            Side::Decode => self.decode_tp(),
        };
        let make = match paging.order {
            PageOrder::Nhd => mori_tp::Layout::nhd,
            PageOrder::Hnd => mori_tp::Layout::hnd,
        };
        make(
            self.model.kv_heads,
            tp_size,
            rank,
            paging.page_size,
            self.bytes_per_head,
        )
    }

    /// The library's pair config of (prefill rank `p`, decode rank `d`) from both ranks' layouts.
    pub fn pair_config(&self, p: u32, d: u32) -> mori_tp::Result<PairConfig> {
        pair_config(
            &self.rank_layout(Side::Prefill, p)?,
            &self.rank_layout(Side::Decode, d)?,
        )
    }

    /// The library's uniform inputs for the pair (prefill rank `p`, decode rank `d`): the real
    /// pages for the classic layout, else one token per page (the per-token view: heads, offsets
    /// and widths inside a token-major slot, which do not depend on the page size).
    pub fn slice_params(&self, p: u32, d: u32) -> SliceParams {
        let (page_size, src_item_len, dst_item_len) = match self.common_page_size() {
            Some(page_size) if self.is_classic() => {
                (page_size, self.src_item_len, self.dst_item_len)
            }
            _ => {
                let per_token =
                    |side: &TpSide| u64::from(side.heads_per_rank()) * self.bytes_per_head;
                (
                    1,
                    per_token(self.topology.prefill()),
                    per_token(self.topology.decode()),
                )
            }
        };
        SliceParams {
            prefill_tp_size: self.prefill_tp(),
            prefill_tp_rank: p,
            decode_tp_size: self.decode_tp(),
            decode_tp_rank: d,
            total_kv_heads: self.model.kv_heads,
            page_size,
            src_item_len,
            dst_item_len,
        }
    }

    /// The library's uniform slice for the pair (prefill rank `p`, decode rank `d`): which heads
    /// move and where they sit inside a token-major slot (see [`Layout::slice_params`]).
    pub fn slice_config(&self, p: u32, d: u32) -> mori_tp::Result<SliceConfig> {
        slice_config(&self.slice_params(p, d))
    }

    /// The partial last pages of a request of `tokens` tokens, in words (None: whole pages).
    pub fn partial_pages(&self, tokens: u64) -> Option<String> {
        let (pre, dec) = (&self.prefill_paging, &self.decode_paging);
        let used = |paging: &Paging| {
            format!(
                "{} of {} slots",
                u64::from(paging.page_size) - paging.unused_slots(tokens),
                paging.page_size
            )
        };
        let text = match (pre.unused_slots(tokens) > 0, dec.unused_slots(tokens) > 0) {
            (false, false) => return None,
            (true, true) if pre.page_size == dec.page_size => {
                format!("the last page of each side holds {}", used(pre))
            }
            (true, true) => format!(
                "the last prefill page holds {}, the last decode page {}",
                used(pre),
                used(dec)
            ),
            (true, false) => format!("the last prefill page holds {}", used(pre)),
            (false, true) => format!("the last decode page holds {}", used(dec)),
        };
        Some(text + " (the slots after the last token are never written)")
    }

    /// A one-line description of a side's sharding.
    pub fn describe_side(&self, side: &TpSide) -> String {
        let heads = side.heads_per_rank();
        let mut text = format!("{heads} head{} per rank", if heads == 1 { "" } else { "s" });
        if side.replication() > 1 {
            text += &format!(", each head on {} ranks", side.replication());
        }
        text += &format!(
            " ({} B per token per buffer)",
            u64::from(heads) * self.bytes_per_head
        );
        text
    }
}

/// `text` after a `label` column, wrapped at 100 columns with continuation lines indented.
pub fn labelled(label: &str, text: &str) -> String {
    const WIDTH: usize = 100;
    let indent = 10;
    let mut out = format!("{label:<indent$}");
    let mut column = indent;
    // A unit stays on the line of its number.
    const UNITS: [&str; 7] = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];
    for (i, word) in text.split(' ').enumerate() {
        let unit = UNITS.contains(&word.trim_end_matches([',', ';', ')', '.']));
        if i > 0 && column + 1 + word.len() > WIDTH && !unit {
            out += &format!("\n{:indent$}", "");
            column = indent;
        } else if i > 0 {
            out.push(' ');
            column += 1;
        }
        out += word;
        column += word.len();
    }
    out.push('\n');
    out
}

/// `heads 2-3`, `head 5`.
pub fn heads_text(heads: std::ops::Range<u32>) -> String {
    match heads.len() {
        0 => "no head".into(),
        1 => format!("head {}", heads.start),
        _ => format!("heads {}-{}", heads.start, heads.end - 1),
    }
}

/// `14,336`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `58.7 MB` (decimal units, as GB/s).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_for_people() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(14_336), "14,336");
        assert_eq!(grouped(1_234_567), "1,234,567");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(58_720_256), "58.7 MB");
        assert_eq!(heads_text(3..4), "head 3");
        assert_eq!(heads_text(0..4), "heads 0-3");
        assert_eq!(labelled("note:", "a b"), "note:     a b\n");
        let units = labelled("memory:", &format!("{}365.7 MB here", "w ".repeat(42)));
        assert!(units.contains("365.7 MB\n"), "{units}");
        let long = labelled("x", &"word ".repeat(40));
        assert!(long.lines().all(|line| line.len() <= 100), "{long}");
        assert!(
            long.lines()
                .skip(1)
                .all(|line| line.starts_with("          word"))
        );
    }
}
