//! A deployment: a model served by a prefill engine of TP size P and a decode engine of TP size D,
//! validated by the library. The byte sizes of pages follow the layout the header describes: a
//! rank's heads sit contiguous inside each token, each `head_dim * dtype` bytes.

use mori_tp::{Error, Side, SliceConfig, SliceParams, Topology, TpSide, slice_config};

use crate::model::{Dtype, Model};

/// The largest TP size `mori-tp` accepts on either side. Output grows with the pairs that share
/// heads (up to P x D for MLA), so a bound keeps every command's time and memory bounded: at
/// 1024 x 1024, `plan --json` lists a million pairs. Real engines stay far below it.
pub const MAX_TP_SIZE: u32 = 1024;

/// A model, a dtype, a page size and both TP sizes, checked by the library.
#[derive(Clone, Debug)]
pub struct Layout {
    pub model: Model,
    pub dtype: Dtype,
    /// Tokens per page, the same on both sides.
    pub page_size: u32,
    /// Both sides' head ownership, from the library.
    pub topology: Topology,
    /// `head_dim * dtype` bytes.
    pub bytes_per_head: u64,
    /// Bytes of one page of one layer buffer on a prefill rank.
    pub src_item_len: u64,
    /// Bytes of one page of one layer buffer on a decode rank.
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

impl Problem {
    /// A problem in the library's words, with its numbers where it is about a TP size.
    fn from_library(error: &Error) -> Problem {
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
    /// (every invalid side is reported, each with the nearest valid sizes), then the byte layout
    /// of a page on each side.
    pub fn new(
        model: Model,
        dtype: Dtype,
        page_size: u32,
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

        let bytes_per_head = u64::from(model.head_dim) * u64::from(dtype.bytes());
        let item_len = |side: &TpSide| {
            bytes_per_head
                .checked_mul(u64::from(side.heads_per_rank()))
                .and_then(|b| b.checked_mul(u64::from(page_size)))
                .ok_or_else(|| LayoutError {
                    summary: summary.clone(),
                    problems: vec![Problem {
                        message: format!(
                            "{}: a page of {page_size} tokens x {} heads x {bytes_per_head} \
                             bytes overflows 64 bits",
                            side.side(),
                            side.heads_per_rank()
                        ),
                        topology: None,
                    }],
                })
        };
        let layout = Layout {
            src_item_len: item_len(topology.prefill())?,
            dst_item_len: item_len(topology.decode())?,
            model,
            dtype,
            page_size,
            topology,
            bytes_per_head,
        };
        // The library has the last word on the byte layout of every pair.
        layout.slice_config(0, 0).map_err(fail)?;
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

    /// The library's inputs for the pair (prefill rank `p`, decode rank `d`).
    pub fn slice_params(&self, p: u32, d: u32) -> SliceParams {
        SliceParams {
            prefill_tp_size: self.prefill_tp(),
            prefill_tp_rank: p,
            decode_tp_size: self.decode_tp(),
            decode_tp_rank: d,
            total_kv_heads: self.model.kv_heads,
            page_size: self.page_size,
            src_item_len: self.src_item_len,
            dst_item_len: self.dst_item_len,
        }
    }

    /// The library's slice for the pair (prefill rank `p`, decode rank `d`).
    pub fn slice_config(&self, p: u32, d: u32) -> mori_tp::Result<SliceConfig> {
        slice_config(&self.slice_params(p, d))
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
