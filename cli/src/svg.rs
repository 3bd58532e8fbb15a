//! `mori-tp plan --svg FILE`: the layout as a picture. Prefill ranks `p0..` on the left, decode
//! ranks `d0..` on the right, each with the heads it owns; one arrow per sending pair, labelled
//! with the heads it moves, ending at the decode rank; the replicas that skip as dashed grey
//! lines; prefill ranks that send nothing drawn dashed.
//!
//! Each rank's box is as tall as its arrows need (one 16 px slot per arrow), so arrow ends and
//! their labels never share a slot. The markup carries `data-prefill`/`data-decode` attributes
//! and element ids so that tools and tests can read the picture back.

use std::fmt::Write as _;

use crate::layout::{Layout, LayoutError};
use crate::plan::{DecodeRank, decode_ranks};

/// The most ranks a side may have for `--svg`; past 32 the picture is tall but still correct.
pub const MAX_SVG_TP: u32 = 128;

/// Why no picture was drawn.
#[derive(Debug)]
pub enum Refusal {
    Layout(LayoutError),
    TooLarge(String),
}

const WIDTH: f64 = 1000.0;
const MARGIN: f64 = 24.0;
const BOX_WIDTH: f64 = 150.0;
/// Vertical room per arrow end on a box.
const SLOT: f64 = 16.0;
const MIN_BOX: f64 = 28.0;
const GAP: f64 = 6.0;
const TOP: f64 = 96.0;
/// The straight last stretch of an arrow, where its label sits.
const LABEL_RUN: f64 = 84.0;

/// Colours for heads, cycled: neighbouring heads get clearly different hues.
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
];

fn colour(head: u32) -> &'static str {
    PALETTE[head as usize % PALETTE.len()]
}

/// The arrowhead marker of [`colour`]`(head)`.
fn marker(head: u32) -> usize {
    head as usize % PALETTE.len()
}

/// `h3`, `h0–3` (a half-open range, printed inclusive).
fn heads_label(heads: &std::ops::Range<u32>) -> String {
    if heads.len() == 1 {
        format!("h{}", heads.start)
    } else {
        format!("h{}\u{2013}{}", heads.start, heads.end - 1)
    }
}

/// Text for XML content and attributes.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A rank's box: its top, its height, and the arrow slots used so far.
#[derive(Clone, Copy, Debug)]
struct Slot {
    y: f64,
    height: f64,
    slots: usize,
    used: usize,
}

impl Slot {
    /// The y of the next arrow end on this box, top to bottom.
    fn next(&mut self) -> f64 {
        let y = self.y + (self.used as f64 + 0.5) * self.height / self.slots.max(1) as f64;
        self.used += 1;
        y
    }

    fn centre(&self) -> f64 {
        self.y + self.height / 2.0
    }
}

/// Stacks boxes of the given arrow counts from `TOP`, centred on `middle` when the other column
/// is taller; returns the boxes and the column's height.
fn stack(arrows: &[usize], height: f64) -> (Vec<Slot>, f64) {
    let tall = |n: usize| (n as f64 * SLOT + 8.0).max(MIN_BOX);
    let own: f64 = arrows.iter().map(|&n| tall(n) + GAP).sum::<f64>() - GAP;
    let mut y = TOP + (height - own).max(0.0) / 2.0;
    let boxes = arrows
        .iter()
        .map(|&n| {
            let slot = Slot {
                y,
                height: tall(n),
                slots: n,
                used: 0,
            };
            y += slot.height + GAP;
            slot
        })
        .collect();
    (boxes, own)
}

/// Draws the plan of a valid layout.
pub fn render(layout: &Layout, tokens: u32) -> Result<String, Refusal> {
    let title = format!(
        "{}: prefill TP {} \u{2192} decode TP {}",
        layout.model.name,
        layout.prefill_tp(),
        layout.decode_tp()
    );
    let (body, total_height) = panel(layout, tokens, "", &title, None, "KV head")?;
    let mut svg = String::new();
    open_svg(&mut svg, total_height);
    svg += &body;
    svg += "</svg>\n";
    Ok(svg)
}

/// The document's opening tag and the arrowheads every panel shares.
fn open_svg(svg: &mut String, total_height: f64) {
    let _ = writeln!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{total_height}\" \
         viewBox=\"0 0 {WIDTH} {total_height}\" font-family=\"DejaVu Sans, Verdana, sans-serif\">"
    );
    // One arrowhead per colour: `context-stroke` would be shorter, but not every renderer has it.
    *svg += "<defs>";
    for (i, colour) in PALETTE.iter().enumerate() {
        let _ = write!(
            svg,
            "<marker id=\"arrow{i}\" viewBox=\"0 0 10 10\" refX=\"10\" refY=\"5\" \
             markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0 0 L10 5 L0 10 \
             z\" fill=\"{colour}\"/></marker>"
        );
    }
    *svg += "</defs>\n";
}

/// One panel per kind of sharding of a model of several groups: the parts whose unit counts are
/// equal move alike, so each count gets one panel, titled with the model's name and captioned
/// with the groups and parts it stands for (their units: KV heads, Mamba or DeltaNet heads,
/// groups, records), stacked from the top. Ids inside panel `i` start with `g{i}-`.
pub fn render_groups(panels: &[(String, Layout)], tokens: u32) -> Result<String, Refusal> {
    let mut bodies = Vec::new();
    let mut y = 0.0;
    for (i, (caption, layout)) in panels.iter().enumerate() {
        let title = format!(
            "{}: {caption}: prefill TP {} \u{2192} decode TP {}",
            layout.model.name,
            layout.prefill_tp(),
            layout.decode_tp()
        );
        let units = layout.model.kv_heads;
        let footer = format!(
            "Units are the parts' global indices ({units} of them): h2\u{2013}3 means units 2 and \
             3 (the JSON plan writes [2, 4])."
        );
        let (body, height) = panel(
            layout,
            tokens,
            &format!("g{i}-"),
            &title,
            Some(&footer),
            "unit",
        )?;
        bodies.push((y, height, body));
        y += height;
    }
    let mut svg = String::new();
    open_svg(&mut svg, y);
    for (i, (top, height, body)) in bodies.iter().enumerate() {
        let _ = writeln!(
            svg,
            "<g id=\"g{i}\" class=\"panel\" data-units=\"{}\" transform=\"translate(0 {top})\" \
             data-height=\"{height}\">",
            panels[i].1.model.kv_heads
        );
        svg += body;
        svg += "</g>\n";
    }
    svg += "</svg>\n";
    Ok(svg)
}

/// The picture of one layout without the document around it: its background, title, ranks and
/// arrows, and its height. Element ids start with `prefix`; `footer` replaces the first line
/// under the ranks; `unit` is what the layout's "heads" are (`KV head`, or `unit` for a panel
/// of a model's parts).
fn panel(
    layout: &Layout,
    tokens: u32,
    prefix: &str,
    title: &str,
    footer: Option<&str>,
    unit: &str,
) -> Result<(String, f64), Refusal> {
    let (p_size, d_size) = (layout.prefill_tp(), layout.decode_tp());
    if p_size.max(d_size) > MAX_SVG_TP {
        return Err(Refusal::TooLarge(format!(
            "--svg draws at most {MAX_SVG_TP} ranks a side (prefill TP {p_size}, decode TP \
             {d_size}); the text and --json plans cover up to {}",
            crate::layout::MAX_TP_SIZE
        )));
    }
    let ranks: Vec<DecodeRank> = decode_ranks(layout, tokens)
        .collect::<Result<_, _>>()
        .map_err(Refusal::Layout)?;

    // Arrows per box: sends leaving each prefill rank, sends reaching each decode rank.
    let mut out_arrows = vec![0usize; p_size as usize];
    let in_arrows: Vec<usize> = ranks
        .iter()
        .map(|rank| {
            let sends = rank.pairs.iter().filter(|pair| pair.sends());
            sends
                .inspect(|pair| out_arrows[pair.prefill_rank as usize] += 1)
                .count()
        })
        .collect();
    let tall = |arrows: &[usize]| stack(arrows, 0.0).1;
    let height = tall(&out_arrows).max(tall(&in_arrows));
    let (mut prefill, _) = stack(&out_arrows, height);
    let (mut decode, _) = stack(&in_arrows, height);

    let (sends, skips) = ranks
        .iter()
        .flat_map(|r| &r.pairs)
        .fold(
            (0, 0),
            |(s, k), pair| {
                if pair.sends() { (s + 1, k) } else { (s, k + 1) }
            },
        );
    // A caption line for the page layouts, where they are not the classic token-major ones.
    let layouts = (!layout.is_classic()).then(|| {
        format!(
            "Pages: prefill {}, decode {}; the layouts change where a head's bytes sit, not who \
             sends what.",
            layout.prefill_paging.describe(),
            layout.decode_paging.describe()
        )
    });
    let total_height = TOP + height + MARGIN + 40.0 + if layouts.is_some() { 16.0 } else { 0.0 };
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        "<rect width=\"{WIDTH}\" height=\"{total_height}\" fill=\"white\"/>"
    );
    let model = &layout.model;
    let _ = writeln!(
        svg,
        "<text id=\"{prefix}title\" x=\"{MARGIN}\" y=\"34\" font-size=\"20\" \
         font-weight=\"bold\">{}</text>",
        escape(title)
    );
    let subtitle = format!(
        "{} {unit}{} \u{00b7} {sends} sending pair{} (arrows, labelled with the {unit}s they \
         move) \u{00b7} {skips} replica pair{} skip (dashed)",
        model.kv_heads,
        if model.kv_heads == 1 { "" } else { "s" },
        if sends == 1 { "" } else { "s" },
        if skips == 1 { "" } else { "s" },
    );
    let _ = writeln!(
        svg,
        "<text id=\"{prefix}subtitle\" x=\"{MARGIN}\" y=\"58\" font-size=\"13\" \
         fill=\"#444\">{}</text>",
        escape(&subtitle)
    );
    let (left, right) = (MARGIN + 20.0, WIDTH - MARGIN - 20.0 - BOX_WIDTH);
    for (x, text) in [(left, "prefill ranks"), (right, "decode ranks")] {
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\" \
             fill=\"#444\">{text}</text>",
            x + BOX_WIDTH / 2.0,
            TOP - 12.0
        );
    }

    // Replicas first, underneath everything else. Their lines end at a port just before the
    // arrows' labels, so they never cross a label or an arrowhead.
    let port = right - LABEL_RUN - 10.0;
    let faint = if skips > 200 { 0.3 } else { 0.7 };
    let _ = writeln!(
        svg,
        "<g id=\"{prefix}skips\" stroke=\"#888\" stroke-width=\"1\" stroke-dasharray=\"4 3\" \
         fill=\"none\" \
         opacity=\"{faint}\">"
    );
    for rank in &ranks {
        for pair in rank.pairs.iter().filter(|pair| !pair.sends()) {
            let (p, d) = (pair.prefill_rank as usize, pair.decode_rank as usize);
            let _ = writeln!(
                svg,
                "<path class=\"skip\" data-prefill=\"{p}\" data-decode=\"{d}\" d=\"M{:.1} {:.1} \
                 L{:.1} {:.1}\"><title>p{p} skips {} for d{d}: a replica, p{} sends it</title></path>",
                left + BOX_WIDTH,
                prefill[p].centre(),
                port,
                decode[d].centre(),
                heads_label(&pair.shared_heads),
                pair.sent_by
            );
        }
    }
    svg += "</g>\n";
    for (d, rank) in ranks.iter().enumerate() {
        if rank.pairs.iter().any(|pair| !pair.sends()) {
            let _ = writeln!(
                svg,
                "<circle class=\"port\" cx=\"{port:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"white\" \
                 stroke=\"#888\"/>",
                decode[d].centre()
            );
        }
    }

    // Sends: leave prefill boxes in decode order, reach decode boxes in prefill order.
    let mut arrows = Vec::new();
    for rank in &ranks {
        for pair in rank.pairs.iter().filter(|pair| pair.sends()) {
            let d = pair.decode_rank as usize;
            arrows.push((pair, decode[d].next()));
        }
    }
    let (x1, x2) = (left + BOX_WIDTH, right);
    let _ = writeln!(
        svg,
        "<g id=\"{prefix}sends\" fill=\"none\" stroke-width=\"1.6\">"
    );
    let mut labels = String::new();
    for (pair, y2) in &arrows {
        let (p, d) = (pair.prefill_rank, pair.decode_rank);
        let y1 = prefill[p as usize].next();
        let heads = pair.heads();
        let stroke = colour(heads.start);
        let bend = (x2 - LABEL_RUN - x1 - 20.0) / 2.0;
        let _ = writeln!(
            svg,
            "<path class=\"send\" data-prefill=\"{p}\" data-decode=\"{d}\" stroke=\"{stroke}\" \
             marker-end=\"url(#arrow{})\" d=\"M{x1:.1} {y1:.1} L{:.1} {y1:.1} C{:.1} {y1:.1} {:.1} \
             {y2:.1} {:.1} {y2:.1} L{x2:.1} {y2:.1}\"><title>p{p} sends {} to d{d}</title></path>",
            marker(heads.start),
            x1 + 20.0,
            x1 + 20.0 + bend,
            x2 - LABEL_RUN - bend,
            x2 - LABEL_RUN,
            heads_label(&heads)
        );
        let label = heads_label(&heads);
        let width = 7.5 * label.chars().count() as f64 + 8.0;
        let centre = x2 - LABEL_RUN / 2.0 - 4.0;
        let _ = writeln!(
            labels,
            "<g class=\"send-label\" data-prefill=\"{p}\" data-decode=\"{d}\"><rect x=\"{:.1}\" \
             y=\"{:.1}\" width=\"{width:.1}\" height=\"15\" rx=\"4\" fill=\"white\" \
             stroke=\"{stroke}\" stroke-width=\"0.8\"/><text x=\"{centre:.1}\" y=\"{:.1}\" \
             font-size=\"12\" text-anchor=\"middle\" fill=\"{stroke}\">{}</text></g>",
            centre - width / 2.0,
            y2 - 7.5,
            y2 + 4.2,
            escape(&label)
        );
    }
    svg += "</g>\n";
    svg += &labels;

    // Boxes last, on top of the line ends.
    let idle: Vec<bool> = out_arrows.iter().map(|&n| n == 0).collect();
    for (p, slot) in prefill.iter().enumerate() {
        let heads = layout.prefill_heads(p as u32);
        rank_box(
            &mut svg,
            &format!("p{p}"),
            prefix,
            left,
            slot,
            &heads,
            idle[p],
        );
    }
    for (d, slot) in decode.iter().enumerate() {
        rank_box(
            &mut svg,
            &format!("d{d}"),
            prefix,
            right,
            slot,
            &ranks[d].heads,
            false,
        );
    }
    let footer = footer.map_or_else(
        || {
            "Heads are global KV head indices; h2\u{2013}3 means heads 2 and 3 (the JSON plan \
             writes [2, 4])."
                .to_string()
        },
        escape,
    );
    let _ = writeln!(
        svg,
        "<text x=\"{MARGIN}\" y=\"{:.1}\" font-size=\"11\" fill=\"#666\">{footer}</text>",
        TOP + height + 28.0
    );
    let _ = writeln!(
        svg,
        "<text x=\"{MARGIN}\" y=\"{:.1}\" font-size=\"11\" fill=\"#666\">Dashed: a replica \
         that holds the {unit}s but skips them, because another prefill rank sends them.</text>",
        TOP + height + 44.0
    );
    if let Some(caption) = layouts {
        let _ = writeln!(
            svg,
            "<text id=\"{prefix}layouts\" x=\"{MARGIN}\" y=\"{:.1}\" font-size=\"11\" \
             fill=\"#666\">{}</text>",
            TOP + height + 60.0,
            escape(&caption)
        );
    }
    Ok((svg, total_height))
}

/// One rank: a box with its name and heads, dashed and grey for a replica that sends nothing.
fn rank_box(
    svg: &mut String,
    name: &str,
    prefix: &str,
    x: f64,
    slot: &Slot,
    heads: &std::ops::Range<u32>,
    idle: bool,
) {
    // A prefill rank that sends nothing holds replicas only.
    let note = if idle { "(replica)" } else { "" };
    let (fill, stroke, dash) = if idle {
        ("#f2f2f2", "#999", " stroke-dasharray=\"5 3\"")
    } else {
        ("#eef4fb", "#35597f", "")
    };
    let text_y = slot.y + slot.height / 2.0 + 5.0;
    let _ = writeln!(
        svg,
        "<g class=\"rank\" id=\"{prefix}{name}\"><rect x=\"{x:.1}\" y=\"{:.1}\" \
         width=\"{BOX_WIDTH}\" height=\"{:.1}\" rx=\"5\" fill=\"{fill}\" stroke=\"{stroke}\" stroke-width=\"1.2\"{dash}/>\
         <text class=\"name\" x=\"{:.1}\" y=\"{text_y:.1}\" font-size=\"14\" \
         font-weight=\"bold\">{name}</text><text class=\"heads\" x=\"{:.1}\" y=\"{text_y:.1}\" \
         font-size=\"13\" fill=\"{}\">{}</text><text class=\"note\" x=\"{:.1}\" y=\"{text_y:.1}\" \
         font-size=\"11\" fill=\"#777\">{}</text></g>",
        slot.y,
        slot.height,
        x + 8.0,
        x + 48.0,
        colour(heads.start),
        escape(&heads_label(heads)),
        x + 100.0,
        escape(note),
    );
}
