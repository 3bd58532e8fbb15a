//! From the walk's rows to what callers get: transport segments (each maximal run of elements
//! contiguous on both sides is one) and the 2D rects of a pair plan (each run of equal-length
//! segments whose offsets advance by one constant pair of pitches is one rect).
//!
//! Segments travel as arithmetic runs ([`SegRun`]: `count` segments of `len` bytes, each
//! `src_step`/`dst_step` after the last), so that a run of pages costs one entry here however
//! many tokens it holds. A walk that repeats one stretch of rows at a constant step (the tokens
//! of a page whose heads have gaps, the heads of a head-major chunk) hands it over once, with
//! the number of repetitions ([`RowSink::repeat`]); [`Merger`] and [`Rects`] follow it period by
//! period only until their state repeats one step on, then pass on the rest in one call (or
//! grow their pending run or rect by the rest at once). Either way a stretch costs time in what
//! it emits, not in its repetitions.
//!
//! Addresses: every element of a plan was checked to end inside a buffer of `u64` bytes, so a
//! sum that lands on an element, or just past one, cannot wrap. Sums whose result may not be
//! such an address (a step past the last segment of a run, a candidate for the next period's
//! state) are never formed, or formed with checked arithmetic.

use super::walk::{RowSink, shifted_row, work};
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

    /// Where segment `i < count` starts.
    fn segment(&self, i: u64) -> (u64, u64) {
        (self.src + i * self.src_step, self.dst + i * self.dst_step)
    }

    fn last(&self) -> (u64, u64) {
        self.segment(self.count - 1)
    }

    /// The run without its first segment (`count > 1`).
    fn rest(&self) -> SegRun {
        let (src, dst) = self.segment(1);
        SegRun {
            src,
            dst,
            count: self.count - 1,
            ..*self
        }
    }

    /// The run `i` periods of `step` on, for a period the walk repeats (a real address).
    fn shifted(&self, i: u64, step: (u64, u64)) -> SegRun {
        SegRun {
            src: self.src + i * step.0,
            dst: self.dst + i * step.1,
            ..*self
        }
    }

    /// The run `times` steps on, or `None` where that is not a `u64` address.
    fn checked_shift(&self, times: u64, step: (u64, u64)) -> Option<SegRun> {
        Some(SegRun {
            src: shift(self.src, times, step.0)?,
            dst: shift(self.dst, times, step.1)?,
            ..*self
        })
    }
}

/// `value + times * step`, or `None` where it does not fit in `u64`.
fn shift(value: u64, times: u64, step: u64) -> Option<u64> {
    value.checked_add(times.checked_mul(step)?)
}

/// True when `next` is `prev` with every entry one `step` on (`move_by` moves an entry).
fn one_step_on<T: Copy + PartialEq>(
    prev: &[T],
    next: &[T],
    step: (u64, u64),
    move_by: impl Fn(&T, u64, (u64, u64)) -> Option<T>,
) -> bool {
    prev.len() == next.len()
        && prev
            .iter()
            .zip(next)
            .all(|(p, n)| move_by(p, 1, step).as_ref() == Some(n))
}

/// Receives merged segment runs, in order.
pub(crate) trait SegSink {
    fn run(&mut self, run: SegRun);

    /// `period`, then `times - 1` more copies of it, copy `i` shifted by `i * step` on both
    /// sides; every address of every copy is real.
    fn repeat(&mut self, period: &[SegRun], times: u64, step: (u64, u64)) {
        let mut i = 0;
        while i < times && !self.full() {
            for run in period {
                self.run(run.shifted(i, step));
            }
            i += 1;
        }
        work(i * period.len() as u64);
    }

    /// True when the sink needs nothing more: a capped count that reached its cap.
    fn full(&self) -> bool {
        false
    }
}

/// Turns rows into segment runs and merges segments that touch across rows.
pub(crate) struct Merger<S: SegSink> {
    pending: Option<SegRun>,
    /// Rows taken and periods followed, for [`work`].
    steps: u64,
    pub sink: S,
}

impl<S: SegSink> Merger<S> {
    pub fn new(sink: S) -> Self {
        Merger {
            pending: None,
            steps: 0,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        work(self.steps);
        if let Some(pending) = self.pending.take() {
            self.sink.run(pending);
        }
        self.sink
    }

    /// Takes one row: passes on through `emit` every run the row completes, and keeps in
    /// `pending` the run that the next row may still continue.
    fn merge(pending: &mut Option<SegRun>, row: &CopyRect, emit: &mut impl FnMut(SegRun)) {
        let next = SegRun::of_rows(row);
        let Some(p) = *pending else {
            *pending = Some(next);
            return;
        };
        let (src, dst) = p.last();
        if src + p.len != next.src || dst + p.len != next.dst {
            emit(p);
            *pending = Some(next);
            return;
        }
        // The pending run's last segment and the next run's first are one segment.
        if p.count > 1 {
            emit(SegRun {
                count: p.count - 1,
                ..p
            });
        }
        let joined = SegRun::single(src, dst, p.len + next.len);
        if next.count == 1 {
            // It may touch what comes next as well.
            *pending = Some(joined);
        } else {
            // Within a run segments never touch, so the joined one ends here.
            emit(joined);
            *pending = Some(next.rest());
        }
    }
}

impl<S: SegSink> RowSink for Merger<S> {
    fn rows(&mut self, row: CopyRect) {
        self.steps += 1;
        let sink = &mut self.sink;
        Self::merge(&mut self.pending, &row, &mut |run| sink.run(run));
    }

    /// Merges period after period until one passes on the runs of the one before, one step on,
    /// and leaves the pending run one step on too: from there every period does the same, so
    /// the rest goes to the sink as one repetition. A period that passes on nothing and ends
    /// where the next one starts makes the pending segment longer by a step per period.
    fn repeat(&mut self, period: &[CopyRect], times: u64, step: (u64, u64)) {
        let Some(first) = period.first() else {
            return;
        };
        let mut out: Vec<SegRun> = Vec::new();
        let mut before: Option<(Vec<SegRun>, Option<SegRun>)> = None;
        for i in 0..times {
            if self.sink.full() {
                return;
            }
            self.steps += period.len() as u64;
            out.clear();
            for row in period {
                Self::merge(&mut self.pending, &shifted_row(row, i, step), &mut |run| {
                    out.push(run)
                });
            }
            for &run in &out {
                self.sink.run(run);
            }
            let left = times - 1 - i;
            if left == 0 {
                return;
            }
            if out.is_empty()
                && let Some(p) = &mut self.pending
            {
                // The period joined the pending segment. When that now ends where the next
                // period starts, the two sides advance by the same step, which is the period's
                // bytes: every later period joins it in the same way.
                let next = shifted_row(first, i + 1, step);
                if p.count == 1
                    && (p.src + p.len, p.dst + p.len) == (next.src_offset, next.dst_offset)
                {
                    p.len += left * step.0;
                    return;
                }
            }
            if let Some((prev_out, prev_pending)) = &before
                && one_step_on(prev_out, &out, step, SegRun::checked_shift)
                && match (prev_pending, &self.pending) {
                    (Some(p), Some(n)) => p.checked_shift(1, step).as_ref() == Some(n),
                    (None, None) => true,
                    _ => false,
                }
            {
                let next: Option<Vec<SegRun>> =
                    out.iter().map(|r| r.checked_shift(1, step)).collect();
                let pending = match self.pending {
                    None => Some(None),
                    Some(p) => p.checked_shift(left, step).map(Some),
                };
                if let (Some(next), Some(pending)) = (next, pending) {
                    self.sink.repeat(&next, left, step);
                    self.pending = pending;
                    return;
                }
            }
            before = Some((out.clone(), self.pending));
        }
    }

    fn full(&self) -> bool {
        self.sink.full()
    }
}

/// Counts segments.
#[derive(Debug, Default)]
pub(crate) struct Counter(pub u64);

impl SegSink for Counter {
    fn run(&mut self, run: SegRun) {
        self.0 += run.count;
    }

    fn repeat(&mut self, period: &[SegRun], times: u64, _step: (u64, u64)) {
        let per: u64 = period.iter().map(|run| run.count).sum();
        self.0 += times * per;
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
            // Wrapping on purpose: the step after the last segment may pass 2^64 (a head at
            // 2^63), and that value is never used.
            src = src.wrapping_add(run.src_step);
            dst = dst.wrapping_add(run.dst_step);
        }
    }
}

/// The rect being grown: its first segment, width, rows so far, pitches once a second
/// segment fixed them, and where its last segment starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

    /// The same rect `times` steps on, or `None` where that is not a `u64` address.
    fn checked_shift(&self, times: u64, step: (u64, u64)) -> Option<Growing> {
        Some(Growing {
            src: shift(self.src, times, step.0)?,
            dst: shift(self.dst, times, step.1)?,
            last: (
                shift(self.last.0, times, step.0)?,
                shift(self.last.1, times, step.1)?,
            ),
            ..*self
        })
    }
}

/// A rect `times` steps on, or `None` where that is not a `u64` address.
fn checked_shift_rect(rect: &CopyRect, times: u64, step: (u64, u64)) -> Option<CopyRect> {
    Some(CopyRect {
        src_offset: shift(rect.src_offset, times, step.0)?,
        dst_offset: shift(rect.dst_offset, times, step.1)?,
        ..*rect
    })
}

/// Pitches that `hipMemcpy2DAsync` takes for rows of `len` bytes: both at least `len`.
fn valid_pitches(len: u64, (src, dst): (u64, u64)) -> bool {
    src >= len && dst >= len
}

/// The advance from `from` to `to` on both sides, when neither goes back: a true,
/// non-negative step, never one that wraps.
fn advance(from: (u64, u64), to: (u64, u64)) -> Option<(u64, u64)> {
    Some((to.0.checked_sub(from.0)?, to.1.checked_sub(from.1)?))
}

/// Grows rects greedily from the front (REFERENCE.md section 11): a rect takes the next segment
/// while it keeps the rect's width and, after the second, both pitches; the second segment
/// fixes the pitches when they are at least the width. Every pitch is the true advance from
/// one row to the next on its side, never negative.
pub(crate) struct Rects<S: RowSink> {
    growing: Option<Growing>,
    /// Segments taken one by one and periods followed, for [`work`].
    steps: u64,
    pub sink: S,
}

impl<S: RowSink> Rects<S> {
    pub fn new(sink: S) -> Self {
        Rects {
            growing: None,
            steps: 0,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        work(self.steps);
        if let Some(growing) = self.growing.take() {
            self.sink.rows(growing.rect());
        }
        self.sink
    }

    /// Takes one segment.
    fn segment(
        growing: &mut Option<Growing>,
        at: (u64, u64),
        len: u64,
        emit: &mut impl FnMut(CopyRect),
    ) {
        if let Some(g) = growing
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
        if let Some(done) = growing.take() {
            emit(done.rect());
        }
        *growing = Some(Growing::new(at.0, at.1, len));
    }

    /// Takes one run of segments; `steps` counts the segments it takes one by one.
    fn take(
        growing: &mut Option<Growing>,
        run: SegRun,
        steps: &mut u64,
        emit: &mut impl FnMut(CopyRect),
    ) {
        Self::segment(growing, (run.src, run.dst), run.len, emit);
        if run.count == 1 {
            return;
        }
        let step = (run.src_step, run.dst_step);
        let g = growing.as_mut().expect("a segment was just taken");
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
                    Self::segment(growing, (rest.src, rest.dst), rest.len, emit);
                    let g = growing.as_mut().expect("a segment was just taken");
                    if rest.count > 1 {
                        g.pitches = Some(step);
                    }
                    g.height = rest.count;
                    g.last = rest.last();
                } else {
                    *steps += rest.count;
                    for i in 0..rest.count {
                        Self::segment(growing, rest.segment(i), rest.len, emit);
                    }
                }
                return;
            }
        }
        let g = growing.as_mut().expect("a segment was just taken");
        g.height += run.count - 1;
        g.last = run.last();
    }
}

impl<S: RowSink> SegSink for Rects<S> {
    fn run(&mut self, run: SegRun) {
        // (Each run comes from a row the Merger counted, or from a period counted below.)
        let sink = &mut self.sink;
        Self::take(&mut self.growing, run, &mut self.steps, &mut |rect| {
            sink.rows(rect)
        });
    }

    /// Grows rects period after period until one emits the rects of the one before, one step
    /// on, and leaves the growing rect one step on too (from there every period does the
    /// same), or until a rect whose pitches were fixed before a period took all of it (from
    /// there it takes every later period as well, each starting one pitch after the last).
    fn repeat(&mut self, period: &[SegRun], times: u64, step: (u64, u64)) {
        if period.is_empty() {
            return;
        }
        let mut out: Vec<CopyRect> = Vec::new();
        let mut before: Option<(Vec<CopyRect>, Option<Growing>)> = None;
        for i in 0..times {
            if self.sink.full() {
                return;
            }
            self.steps += period.len() as u64;
            out.clear();
            let start = self.growing;
            for run in period {
                Self::take(
                    &mut self.growing,
                    run.shifted(i, step),
                    &mut self.steps,
                    &mut |rect| out.push(rect),
                );
            }
            for &rect in &out {
                self.sink.rows(rect);
            }
            let left = times - 1 - i;
            if left == 0 {
                return;
            }
            // Period i >= 1 started one pitch after period i - 1's last segment, so period
            // i + 1 starts one pitch after period i's.
            if out.is_empty()
                && i >= 1
                && let (Some(s), Some(g)) = (start, &mut self.growing)
                && s.pitches.is_some()
            {
                let per = g.height - s.height;
                g.height += left * per;
                g.last = (g.last.0 + left * step.0, g.last.1 + left * step.1);
                return;
            }
            if let Some((prev_out, prev_growing)) = &before
                && one_step_on(prev_out, &out, step, checked_shift_rect)
                && match (prev_growing, &self.growing) {
                    (Some(p), Some(n)) => p.checked_shift(1, step).as_ref() == Some(n),
                    (None, None) => true,
                    _ => false,
                }
            {
                let next: Option<Vec<CopyRect>> =
                    out.iter().map(|r| checked_shift_rect(r, 1, step)).collect();
                let growing = match self.growing {
                    None => Some(None),
                    Some(g) => g.checked_shift(left, step).map(Some),
                };
                if let (Some(next), Some(growing)) = (next, growing) {
                    self.sink.repeat(&next, left, step);
                    self.growing = growing;
                    return;
                }
            }
            before = Some((out.clone(), self.growing));
        }
    }

    fn full(&self) -> bool {
        self.sink.full()
    }
}

/// Counts the rects a plan would have, up to a cap: the count is exact below the cap, and at
/// least the cap otherwise.
#[derive(Debug)]
pub(crate) struct RectCount {
    pub count: u64,
    pub cap: u64,
}

impl RowSink for RectCount {
    fn rows(&mut self, _row: CopyRect) {
        self.count += 1;
    }

    fn repeat(&mut self, period: &[CopyRect], times: u64, _step: (u64, u64)) {
        self.count = self
            .count
            .saturating_add((period.len() as u64).saturating_mul(times));
    }

    fn full(&self) -> bool {
        self.count >= self.cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::walk::shifted_row;
    use mori_tp_testkit::Rng;

    /// A row at small offsets: any width, height, pitch and position, as the sinks must merge
    /// and group whatever the walk hands them.
    fn random_row(rng: &mut Rng) -> CopyRect {
        let width = [2, 4, 8][rng.range(0, 2) as usize];
        CopyRect {
            src_offset: 1000 + rng.range(0, 64) * 2,
            dst_offset: 1000 + rng.range(0, 64) * 2,
            src_pitch: [2, 4, 8, 12, 16][rng.range(0, 4) as usize],
            dst_pitch: [2, 4, 8, 12, 16][rng.range(0, 4) as usize],
            width,
            height: rng.range(1, 3),
        }
    }

    /// Rows that continue one another now and then (so that runs touch and merge), else jump.
    fn random_rows(rng: &mut Rng, fewest: u64, most: u64) -> Vec<CopyRect> {
        let count = rng.range(fewest, most);
        let mut rows: Vec<CopyRect> = Vec::new();
        for _ in 0..count {
            let mut row = random_row(rng);
            if let Some(last) = rows.last()
                && rng.range(0, 2) > 0
            {
                let end = |offset: u64, pitch: u64| offset + (last.height - 1) * pitch + last.width;
                row.src_offset = end(last.src_offset, last.src_pitch);
                row.dst_offset = end(last.dst_offset, last.dst_pitch);
            }
            rows.push(row);
        }
        rows
    }

    /// Segments and rects of `prefix`, `times` repetitions of `period` one `step` apart, and
    /// `suffix`: handed over as one repetition, or row by row.
    fn through_sinks(
        prefix: &[CopyRect],
        period: &[CopyRect],
        times: u64,
        step: (u64, u64),
        suffix: &[CopyRect],
        repeated: bool,
    ) -> (Vec<CopyRect>, u64) {
        let mut rects = Merger::new(Rects::new(Vec::new()));
        let mut counter = Merger::new(Counter::default());
        for row in prefix {
            rects.rows(*row);
            counter.rows(*row);
        }
        if repeated {
            rects.repeat(period, times, step);
            counter.repeat(period, times, step);
        } else {
            for i in 0..times {
                for row in period {
                    rects.rows(shifted_row(row, i, step));
                    counter.rows(shifted_row(row, i, step));
                }
            }
        }
        for row in suffix {
            rects.rows(*row);
            counter.rows(*row);
        }
        (rects.finish().finish(), counter.finish().0)
    }

    #[test]
    fn a_repetition_handed_over_at_once_gives_what_its_rows_give_one_by_one() {
        let mut rng = Rng::new(37);
        let mut extrapolated = 0;
        for case in 0..40_000 {
            let mut prefix = random_rows(&mut rng, 0, 2);
            let period = random_rows(&mut rng, 1, 3);
            if rng.range(0, 2) == 0 {
                // Rows that a rect of the period's first width takes at some pitch just before
                // the period, which it may then continue.
                let d = (rng.range(0, 40), rng.range(0, 40));
                let first = period[0];
                prefix = (1..=2)
                    .rev()
                    .map(|k| CopyRect {
                        src_offset: first.src_offset - k * d.0,
                        dst_offset: first.dst_offset - k * d.1,
                        height: 1,
                        ..first
                    })
                    .collect();
            }
            let times = rng.range(0, 40);
            // Steps that make periods touch (the period's own span) as well as arbitrary ones.
            let span = |offset: fn(&CopyRect) -> u64, pitch: fn(&CopyRect) -> u64| {
                let first = offset(&period[0]);
                let last = period.last().unwrap();
                (offset(last) + (last.height - 1) * pitch(last) + last.width).saturating_sub(first)
            };
            let step = match rng.range(0, 3) {
                0 => (
                    span(|r| r.src_offset, |r| r.src_pitch),
                    span(|r| r.dst_offset, |r| r.dst_pitch),
                ),
                1 => {
                    let s = rng.range(0, 6) * 4;
                    (s, s)
                }
                _ => (rng.range(0, 300), rng.range(0, 300)),
            };
            let suffix = random_rows(&mut rng, 0, 2);
            let before = crate::plan::walk::work_done();
            let fast = through_sinks(&prefix, &period, times, step, &suffix, true);
            let work = crate::plan::walk::work_done() - before;
            let slow = through_sinks(&prefix, &period, times, step, &suffix, false);
            assert_eq!(
                fast, slow,
                "case {case}: prefix {prefix:?}, period {period:?} x {times} step {step:?}, \
                 suffix {suffix:?}"
            );
            if times > 8 && work < times * period.len() as u64 {
                extrapolated += 1;
            }
        }
        // The shortcut was taken, not only the period-by-period path.
        assert!(
            extrapolated > 1000,
            "only {extrapolated} repetitions extrapolated"
        );
    }

    /// Rects of `prefix`, then `times` repetitions of `period` one `step` apart: as one
    /// repetition, or run by run.
    fn rects_of(
        prefix: &[SegRun],
        period: &[SegRun],
        times: u64,
        step: (u64, u64),
        repeated: bool,
    ) -> Vec<CopyRect> {
        let mut rects = Rects::new(Vec::new());
        for run in prefix {
            rects.run(*run);
        }
        if repeated {
            rects.repeat(period, times, step);
        } else {
            for i in 0..times {
                for run in period {
                    rects.run(run.shifted(i, step));
                }
            }
        }
        rects.finish()
    }

    #[test]
    fn rects_of_a_repetition_handed_over_at_once_are_those_of_its_runs_one_by_one() {
        let mut rng = Rng::new(31);
        let mut extrapolated = 0;
        for case in 0..40_000 {
            let run = |rng: &mut Rng| {
                let count = rng.range(1, 3);
                SegRun {
                    src: 1000 + rng.range(0, 64) * 2,
                    dst: 1000 + rng.range(0, 64) * 2,
                    len: [2, 4, 8][rng.range(0, 2) as usize],
                    count,
                    src_step: if count > 1 { rng.range(1, 8) * 2 } else { 0 },
                    dst_step: if count > 1 { rng.range(1, 8) * 2 } else { 0 },
                }
            };
            let period: Vec<SegRun> = (0..rng.range(1, 3)).map(|_| run(&mut rng)).collect();
            // Segments of the period's first width, at a pitch that reaches the period, which a
            // rect may then carry into it; or any run.
            let first = period[0];
            let d = (rng.range(0, 40), rng.range(0, 40));
            let prefix: Vec<SegRun> = match rng.range(0, 2) {
                0 => (1..=2)
                    .rev()
                    .map(|k| SegRun::single(first.src - k * d.0, first.dst - k * d.1, first.len))
                    .collect(),
                1 => vec![run(&mut rng)],
                _ => Vec::new(),
            };
            let times = rng.range(0, 40);
            let step = match rng.range(0, 2) {
                0 => d,
                1 => (rng.range(0, 10) * 4, rng.range(0, 10) * 4),
                _ => (rng.range(0, 300), rng.range(0, 300)),
            };
            let before = crate::plan::walk::work_done();
            let fast = rects_of(&prefix, &period, times, step, true);
            let work = crate::plan::walk::work_done() - before;
            let slow = rects_of(&prefix, &period, times, step, false);
            assert_eq!(
                fast, slow,
                "case {case}: prefix {prefix:?}, period {period:?} x {times} step {step:?}"
            );
            if times > 8 && work < times * period.len() as u64 {
                extrapolated += 1;
            }
        }
        assert!(
            extrapolated > 1000,
            "only {extrapolated} repetitions extrapolated"
        );
    }
}
