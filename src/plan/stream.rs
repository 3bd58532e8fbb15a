//! From the walk's rows to what callers get: transport segments (each maximal run of elements
//! contiguous on both sides is one) and the 2D rects of a pair plan (each run of equal-length
//! segments whose offsets advance by one constant pair of pitches is one rect).
//!
//! Segments travel as arithmetic runs ([`SegRun`]: `count` segments of `len` bytes, each
//! `src_step`/`dst_step` after the last), so that a run of pages costs one entry here however
//! many tokens it holds.

use super::walk::RowSink;
use crate::plan::{CopyRect, Segment};

/// `count` segments of `len` bytes, segment `i` at `src + i * src_step` and
/// `dst + i * dst_step`. Consecutive segments of one run never touch on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegRun {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub count: u64,
    pub src_step: u64,
    pub dst_step: u64,
}

impl SegRun {
    fn single(src: u64, dst: u64, len: u64) -> SegRun {
        SegRun {
            src,
            dst,
            len,
            count: 1,
            src_step: 0,
            dst_step: 0,
        }
    }

    /// The run's segments of a run of rows: one block when the rows are back to back on both
    /// sides (or there is one row), else one segment per row.
    fn of_rows(row: &CopyRect) -> SegRun {
        if row.height == 1 || row.is_contiguous() {
            SegRun::single(row.src_offset, row.dst_offset, row.bytes())
        } else {
            SegRun {
                src: row.src_offset,
                dst: row.dst_offset,
                len: row.width,
                count: row.height,
                src_step: row.src_pitch,
                dst_step: row.dst_pitch,
            }
        }
    }

    fn last(&self) -> (u64, u64) {
        let i = self.count - 1;
        (self.src + i * self.src_step, self.dst + i * self.dst_step)
    }

    /// The run without its first segment (`count > 1`).
    fn rest(&self) -> SegRun {
        SegRun {
            src: self.src + self.src_step,
            dst: self.dst + self.dst_step,
            count: self.count - 1,
            ..*self
        }
    }
}

/// Receives merged segment runs, in order.
pub(crate) trait SegSink {
    fn run(&mut self, run: SegRun);
}

/// Turns rows into segment runs and merges segments that touch across rows.
pub(crate) struct Merger<S: SegSink> {
    pending: Option<SegRun>,
    pub sink: S,
}

impl<S: SegSink> Merger<S> {
    pub fn new(sink: S) -> Self {
        Merger {
            pending: None,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        if let Some(pending) = self.pending.take() {
            self.sink.run(pending);
        }
        self.sink
    }
}

impl<S: SegSink> RowSink for Merger<S> {
    fn rows(&mut self, row: CopyRect) {
        let next = SegRun::of_rows(&row);
        let Some(pending) = self.pending else {
            self.pending = Some(next);
            return;
        };
        let (src, dst) = pending.last();
        if src + pending.len != next.src || dst + pending.len != next.dst {
            self.sink.run(pending);
            self.pending = Some(next);
            return;
        }
        // The pending run's last segment and the next run's first are one segment.
        if pending.count > 1 {
            self.sink.run(SegRun {
                count: pending.count - 1,
                ..pending
            });
        }
        let joined = SegRun::single(src, dst, pending.len + next.len);
        if next.count == 1 {
            // It may touch what comes next as well.
            self.pending = Some(joined);
        } else {
            // Within a run segments never touch, so the joined one ends here.
            self.sink.run(joined);
            self.pending = Some(next.rest());
        }
    }
}

/// Counts segments.
#[derive(Debug, Default)]
pub(crate) struct Counter(pub u64);

impl SegSink for Counter {
    fn run(&mut self, run: SegRun) {
        self.0 += run.count;
    }
}

/// Writes segments into the front of an output array, through `put`.
pub(crate) struct Writer<F: FnMut(usize, Segment)> {
    pub written: usize,
    pub put: F,
}

impl<F: FnMut(usize, Segment)> SegSink for Writer<F> {
    fn run(&mut self, run: SegRun) {
        let (mut src, mut dst) = (run.src, run.dst);
        for _ in 0..run.count {
            (self.put)(
                self.written,
                Segment {
                    src_offset: src,
                    dst_offset: dst,
                    length: run.len,
                },
            );
            self.written += 1;
            src += run.src_step;
            dst += run.dst_step;
        }
    }
}

/// The rect being grown: its first segment, width, rows so far, pitches once a second
/// segment fixed them, and where its last segment starts.
#[derive(Clone, Copy, Debug)]
struct Growing {
    src: u64,
    dst: u64,
    width: u64,
    height: u64,
    pitches: Option<(u64, u64)>,
    last: (u64, u64),
}

impl Growing {
    fn new(src: u64, dst: u64, width: u64) -> Growing {
        Growing {
            src,
            dst,
            width,
            height: 1,
            pitches: None,
            last: (src, dst),
        }
    }

    fn rect(&self) -> CopyRect {
        let (src_pitch, dst_pitch) = self.pitches.unwrap_or((self.width, self.width));
        CopyRect {
            src_offset: self.src,
            dst_offset: self.dst,
            src_pitch,
            dst_pitch,
            width: self.width,
            height: self.height,
        }
    }
}

/// Pitches that `hipMemcpy2DAsync` takes for rows of `len` bytes: both at least `len`.
fn valid_pitches(len: u64, (src, dst): (u64, u64)) -> bool {
    src >= len && dst >= len
}

/// The advance from `from` to `to` on both sides, when neither goes back.
fn advance(from: (u64, u64), to: (u64, u64)) -> Option<(u64, u64)> {
    Some((to.0.checked_sub(from.0)?, to.1.checked_sub(from.1)?))
}

/// Grows rects greedily from the front (CONTRACT section 7): a rect takes the next segment
/// while it keeps the rect's width and, after the second, both pitches; the second segment
/// fixes the pitches when they are at least the width.
pub(crate) struct Rects<S: RowSink> {
    growing: Option<Growing>,
    pub sink: S,
}

impl<S: RowSink> Rects<S> {
    pub fn new(sink: S) -> Self {
        Rects {
            growing: None,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        if let Some(growing) = self.growing.take() {
            self.sink.rows(growing.rect());
        }
        self.sink
    }

    /// Takes one segment.
    fn segment(&mut self, at: (u64, u64), len: u64) {
        if let Some(g) = &mut self.growing
            && g.width == len
            && let Some(step) = advance(g.last, at)
        {
            match g.pitches {
                None if valid_pitches(len, step) => {
                    g.pitches = Some(step);
                    g.height = 2;
                    g.last = at;
                    return;
                }
                Some(pitches) if pitches == step => {
                    g.height += 1;
                    g.last = at;
                    return;
                }
                _ => {}
            }
        }
        if let Some(done) = self.growing.take() {
            self.sink.rows(done.rect());
        }
        self.growing = Some(Growing::new(at.0, at.1, len));
    }
}

impl<S: RowSink> SegSink for Rects<S> {
    fn run(&mut self, run: SegRun) {
        self.segment((run.src, run.dst), run.len);
        if run.count == 1 {
            return;
        }
        let step = (run.src_step, run.dst_step);
        let g = self.growing.as_mut().expect("a segment was just taken");
        match g.pitches {
            // The rest continues the rect.
            Some(pitches) if pitches == step => {}
            // The first segment started the rect; the rest fixes its pitches.
            None if valid_pitches(run.len, step) => g.pitches = Some(step),
            // The rect ends at the first segment; the rest is a rect of its own, or segments
            // one by one when its step cannot be a pitch.
            _ => {
                let rest = run.rest();
                if valid_pitches(run.len, step) || rest.count == 1 {
                    self.segment((rest.src, rest.dst), rest.len);
                    let g = self.growing.as_mut().expect("a segment was just taken");
                    if rest.count > 1 {
                        g.pitches = Some(step);
                    }
                    g.height = rest.count;
                    g.last = rest.last();
                } else {
                    let (mut src, mut dst) = (rest.src, rest.dst);
                    for _ in 0..rest.count {
                        self.segment((src, dst), rest.len);
                        src += step.0;
                        dst += step.1;
                    }
                }
                return;
            }
        }
        let g = self.growing.as_mut().expect("a segment was just taken");
        g.height += run.count - 1;
        g.last = run.last();
    }
}
