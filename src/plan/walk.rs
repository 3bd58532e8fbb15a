//! The one generator: the elements of a request, walked in one of the orders of REFERENCE.md
//! section 11, as rows of strided copies; and how many transport segments each order gives,
//! counted without walking every element.
//!
//! An element is one head of one token: `head_bytes` bytes at a side's address
//! `addr(k, j)` for token `k < N` and moved head `j < n`. Both sides are cut into *pieces*:
//! token ranges in which neither side changes page, so that inside a piece each side's
//! address is affine in `(k, j)`. A request has at most one piece per page of either side,
//! which is what bounds the cost of a plan by its pages and its entries, never by tokens
//! times heads. Inside a piece, the rows of a stretch that repeats at a constant step (a
//! token's heads when they have gaps, token after token; a chunk's run of head 0, head after
//! head) are handed on once with their count ([`RowSink::repeat`]), so that the sinks of
//! `stream` can pass on or extend whole repetitions at once.
//!
//! Arithmetic: every address of an element of a request was checked to fit in `u64` when the
//! plan was built, so sums that land on an element, or just past one, cannot wrap and are
//! written plainly. Where a sum may not be such an address (whether the next row continues a
//! run of rows, with a pitch that a side ignores, such as the token stride of a page of one
//! slot), it is computed in `u128`, where a sum past 2^64 never equals an address.

use std::cell::Cell;

use crate::plan::CopyRect;

thread_local! {
    /// Steps of work done by the plans of this thread (see [`work`]).
    static WORK: Cell<u64> = const { Cell::new(0) };
}

/// Counts `steps` units of work: pieces walked, rows handed to a sink of rows or runs to a sink
/// of segment runs, periods of a repetition followed one by one. Everything whose number could
/// grow with the tokens of a request counts here, so that a test can check that a plan's work
/// is bounded by its pages and its entries. The hot paths count in a field of their own and
/// add it here once (a thread-local costs a call in a shared library).
#[inline]
pub(crate) fn work(steps: u64) {
    WORK.with(|w| w.set(w.get().wrapping_add(steps)));
}

/// The steps [`work`] counted on this thread so far.
pub(crate) fn work_done() -> u64 {
    WORK.with(Cell::get)
}

/// `row` moved `i` steps of `step` on both sides: a row of a period that the walk repeats,
/// whose every repetition lies on elements of the request (so the sums cannot wrap).
#[inline]
pub(crate) fn shifted_row(row: &CopyRect, i: u64, step: (u64, u64)) -> CopyRect {
    CopyRect {
        src_offset: row.src_offset + i * step.0,
        dst_offset: row.dst_offset + i * step.1,
        ..*row
    }
}

/// True when a run of `rows` rows starting at `offset` with `pitch` puts its next row at `at`,
/// in true integers (`u128`, which these sums cannot overflow): a sum past 2^64 is no address
/// of a request, and a wrapped one must never look like a continuation.
#[inline]
fn lands_on(offset: u64, rows: u64, pitch: u64, at: u64) -> bool {
    u128::from(offset) + u128::from(rows) * u128::from(pitch) == u128::from(at)
}

/// True when `row` continues `run`: the same width and pitches, and its first row where the
/// pitches put the run's next one on both sides, so that the joined rows advance by the true
/// pitches.
#[inline]
fn continues(run: &CopyRect, row: &CopyRect) -> bool {
    run.width == row.width
        && run.src_pitch == row.src_pitch
        && run.dst_pitch == row.dst_pitch
        && lands_on(run.src_offset, run.height, run.src_pitch, row.src_offset)
        && lands_on(run.dst_offset, run.height, run.dst_pitch, row.dst_offset)
}

/// The page each position of a request visits on one side.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Pages<'a> {
    /// The caller's page indices, already checked to be non-negative and in bounds.
    List(&'a [i32]),
    /// Position `i` is page `i`: a staging region.
    Dense,
}

impl Pages<'_> {
    #[inline]
    fn at(&self, position: u64) -> u64 {
        match self {
            // Non-negative, checked when the plan was built.
            Pages::List(pages) => pages[position as usize] as u64,
            Pages::Dense => position,
        }
    }
}

/// Where one side's elements lie: element `(k, j)` is at
/// `page(k / page_size) * page_stride + base + (k % page_size) * token_stride + j * head_stride`,
/// where `base` already includes the first moved head. Every address of a request was checked
/// to fit in `u64` when the plan was built, so the arithmetic here cannot wrap.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SideGeom<'a> {
    pub pages: Pages<'a>,
    pub page_size: u64,
    pub page_stride: u64,
    pub base: u64,
    pub token_stride: u64,
    pub head_stride: u64,
    /// A head-major staging region's last chunk, when partial: (its position, its head
    /// stride). Every other page has `head_stride`.
    pub last_head_stride: Option<(u64, u64)>,
    /// At least the start of the highest page's slice (`highest * page_stride + base`; 0 for
    /// a request without pages): no row of the side starts past it plus a page's rows.
    pub reach: u64,
}

impl SideGeom<'_> {
    /// The head stride of the page at `position`.
    #[inline]
    fn head_stride_at(&self, position: u64) -> u64 {
        match self.last_head_stride {
            Some((last, stride)) if last == position => stride,
            _ => self.head_stride,
        }
    }

    /// True when, on this side, head `j` of token `k + 1` never starts where head `j` of token
    /// `k` ends, whatever the pages listed (repeated ones included): then no two elements of
    /// one head's run of a head-major chunk are ever one segment.
    ///
    /// The step from token `k` to token `k + 1` is the token stride within a page, and from
    /// the last slot of a page to the first of the next page listed, `(q - p) * page_stride -
    /// (page_size - 1) * token_stride` for some whole `q - p` (any sign, 0 included); the head
    /// stride cancels out as every page has the same one (a region's partial last chunk, which
    /// has its own, is left out). So the side breaks every head run when the token stride is not
    /// `head_bytes` (or pages hold one slot) and no multiple of the page stride is `(page_size -
    /// 1) * token_stride + head_bytes`. Addresses are true integers (they were checked to fit in
    /// `u64`), so the comparison is too.
    fn breaks_head_runs(&self, head_bytes: u64) -> bool {
        if head_bytes == 0 || self.last_head_stride.is_some() {
            return false;
        }
        if self.page_size > 1 && self.token_stride == head_bytes {
            return false;
        }
        if self.page_stride == 0 {
            return true;
        }
        match (self.page_size - 1)
            .checked_mul(self.token_stride)
            .and_then(|slots| slots.checked_add(head_bytes))
        {
            Some(across) => across % self.page_stride != 0,
            None => {
                let across = u128::from(self.page_size - 1) * u128::from(self.token_stride)
                    + u128::from(head_bytes);
                across % u128::from(self.page_stride) != 0
            }
        }
    }

    /// True when this side holds each token's moved heads back to back on every page.
    fn heads_back_to_back(&self, head_bytes: u64) -> bool {
        self.head_stride == head_bytes && self.last_head_stride.is_none()
    }
}

/// Both sides of a request: `tokens` tokens of `heads` moved heads of `head_bytes` bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry<'a> {
    pub src: SideGeom<'a>,
    pub dst: SideGeom<'a>,
    pub tokens: u64,
    pub heads: u64,
    pub head_bytes: u64,
}

/// An order of a request's elements (REFERENCE.md section 11): token-major (token outer, head
/// inner), or head-major in chunks of `G` tokens (chunk outer, then head, then token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Order {
    /// `k` outer, `j` inner.
    TokenMajor,
    /// Chunk `k div G` outer, then `j`, then `k mod G`.
    HeadMajor(u64),
}

/// Receives a stream of copies, in order.
pub(crate) trait RowSink {
    /// `row.height` rows of `row.width` bytes at the row's pitches.
    fn rows(&mut self, row: CopyRect);

    /// The rows of `period`, then `times - 1` more copies of them, copy `i` shifted by
    /// `i * step` on both sides. Every row of every copy lies on elements of the request.
    fn repeat(&mut self, period: &[CopyRect], times: u64, step: (u64, u64)) {
        let mut i = 0;
        while i < times && !self.full() {
            for row in period {
                self.rows(shifted_row(row, i, step));
            }
            i += 1;
        }
        work(i * period.len() as u64);
    }

    /// True when the sink needs nothing more (a capped count that reached its cap): the walk
    /// may stop early.
    fn full(&self) -> bool {
        false
    }
}

/// Joins consecutive rows that continue one another (same width and pitches, the next row
/// where the pitches put it) before passing them on, so that a run of pages that keeps its
/// stride is one rect.
pub(crate) struct Joiner<S: RowSink> {
    pending: Option<CopyRect>,
    /// Rows taken, for [`work`].
    steps: u64,
    pub sink: S,
}

impl<S: RowSink> Joiner<S> {
    pub fn new(sink: S) -> Self {
        Joiner {
            pending: None,
            steps: 0,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        work(self.steps);
        if let Some(pending) = self.pending.take() {
            self.sink.rows(pending);
        }
        self.sink
    }
}

impl<S: RowSink> RowSink for Joiner<S> {
    fn rows(&mut self, row: CopyRect) {
        self.steps += 1;
        if let Some(pending) = &mut self.pending {
            if continues(pending, &row) {
                pending.height += row.height;
                return;
            }
            self.sink.rows(*pending);
        }
        self.pending = Some(row);
    }

    fn full(&self) -> bool {
        self.sink.full()
    }
}

impl RowSink for Vec<CopyRect> {
    fn rows(&mut self, row: CopyRect) {
        self.push(row);
    }
}

/// Tokens `[a, b)` in which neither side changes page: where head 0 of token `a` lies on each
/// side, and each side's head stride there (every address of the piece is affine from these).
#[derive(Clone, Copy, Debug)]
struct Piece {
    a: u64,
    b: u64,
    src: u64,
    dst: u64,
    hs_src: u64,
    hs_dst: u64,
}

/// A side's place in the walk: the page position and the slot within it.
#[derive(Clone, Copy, Debug)]
struct Cursor {
    position: u64,
    slot: u64,
}

impl SideGeom<'_> {
    fn cursor(&self, k: u64) -> Cursor {
        Cursor {
            position: k / self.page_size,
            slot: k % self.page_size,
        }
    }

    /// Where head 0 of the cursor's token lies, and the head stride of its page.
    #[inline]
    fn place(&self, c: Cursor) -> (u64, u64) {
        (
            self.pages.at(c.position) * self.page_stride + self.base + c.slot * self.token_stride,
            self.head_stride_at(c.position),
        )
    }

    /// Moves the cursor `len` tokens on, within its page or to the next page's start.
    #[inline]
    fn advance(&self, c: &mut Cursor, len: u64) {
        c.slot += len;
        if c.slot == self.page_size {
            c.position += 1;
            c.slot = 0;
        }
    }
}

/// The pieces of tokens `[from, to)`, found without a division per piece.
struct Pieces<'g, 'a> {
    geometry: &'g Geometry<'a>,
    k: u64,
    to: u64,
    src: Cursor,
    dst: Cursor,
    /// Pieces yielded, for [`work`].
    steps: u64,
}

impl Drop for Pieces<'_, '_> {
    fn drop(&mut self) {
        work(self.steps);
    }
}

impl Iterator for Pieces<'_, '_> {
    type Item = Piece;

    #[inline]
    fn next(&mut self) -> Option<Piece> {
        if self.k >= self.to {
            return None;
        }
        let g = self.geometry;
        self.steps += 1;
        let len = (g.src.page_size - self.src.slot)
            .min(g.dst.page_size - self.dst.slot)
            .min(self.to - self.k);
        let (src, hs_src) = g.src.place(self.src);
        let (dst, hs_dst) = g.dst.place(self.dst);
        let piece = Piece {
            a: self.k,
            b: self.k + len,
            src,
            dst,
            hs_src,
            hs_dst,
        };
        self.k += len;
        g.src.advance(&mut self.src, len);
        g.dst.advance(&mut self.dst, len);
        Some(piece)
    }
}

impl Piece {
    /// Both sides' address of element `(k, j)` of the piece.
    #[inline]
    fn at(&self, g: &Geometry<'_>, k: u64, j: u64) -> (u64, u64) {
        let t = k - self.a;
        (
            self.src + t * g.src.token_stride + j * self.hs_src,
            self.dst + t * g.dst.token_stride + j * self.hs_dst,
        )
    }

    /// Both sides' address just past element `(k, j)`.
    #[inline]
    fn end_of(&self, g: &Geometry<'_>, k: u64, j: u64) -> (u64, u64) {
        let (src, dst) = self.at(g, k, j);
        (src + g.head_bytes, dst + g.head_bytes)
    }
}

impl<'a> Geometry<'a> {
    /// The token-major walk as one row of tokens per page, when that is what it is: both sides
    /// change page together (one page size) and hold a token's moved heads back to back on
    /// every page. The common case (REFERENCE.md section 4's configs, and any two token-major layouts of one page
    /// size) then runs as one tight pass over the pages.
    fn page_rows(&self) -> Option<PageRows<'_, 'a>> {
        let adjacent = |side: &SideGeom<'_>| {
            self.heads == 1
                || (side.head_stride == self.head_bytes
                    && side
                        .last_head_stride
                        .is_none_or(|(_, stride)| stride == self.head_bytes))
        };
        (self.src.page_size == self.dst.page_size && adjacent(&self.src) && adjacent(&self.dst))
            .then_some(PageRows { geometry: self })
    }

    /// The pieces of tokens `[from, to)`: ranges in which neither side changes page.
    fn pieces(&self, from: u64, to: u64) -> Pieces<'_, 'a> {
        Pieces {
            geometry: self,
            k: from,
            to,
            src: self.src.cursor(from),
            dst: self.dst.cursor(from),
            steps: 0,
        }
    }

    /// The chunks of an order: token ranges walked head by head (one token each for
    /// token-major).
    pub fn chunk_len(&self, order: Order) -> u64 {
        match order {
            Order::TokenMajor => 1,
            Order::HeadMajor(g) => g.max(1),
        }
    }

    /// True when both sides hold the moved heads of a token back to back (or one head moves).
    #[inline]
    fn heads_adjacent(&self, p: &Piece) -> bool {
        self.heads == 1 || (p.hs_src == self.head_bytes && p.hs_dst == self.head_bytes)
    }

    /// The row of a piece's tokens in token-major order when a token's moved heads are back to
    /// back on both sides: each token is one row.
    #[inline]
    fn token_rows(&self, p: &Piece) -> CopyRect {
        CopyRect {
            src_offset: p.src,
            dst_offset: p.dst,
            src_pitch: self.src.token_stride,
            dst_pitch: self.dst.token_stride,
            width: self.heads * self.head_bytes,
            height: p.b - p.a,
        }
    }

    /// The rows of a piece in token-major order.
    fn token_major_piece(&self, p: &Piece, sink: &mut impl RowSink) {
        if self.heads_adjacent(p) {
            sink.rows(self.token_rows(p));
            return;
        }
        // Each token's heads are a run of rows one head stride apart, and token after token
        // that run repeats one token stride on.
        let first = CopyRect {
            src_offset: p.src,
            dst_offset: p.dst,
            src_pitch: p.hs_src,
            dst_pitch: p.hs_dst,
            width: self.head_bytes,
            height: self.heads,
        };
        sink.repeat(
            &[first],
            p.b - p.a,
            (self.src.token_stride, self.dst.token_stride),
        );
    }

    /// The rows of head `j` over a piece.
    #[inline]
    fn head_run_piece(&self, p: &Piece, j: u64) -> CopyRect {
        let (src, dst) = p.at(self, p.a, j);
        CopyRect {
            src_offset: src,
            dst_offset: dst,
            src_pitch: self.src.token_stride,
            dst_pitch: self.dst.token_stride,
            width: self.head_bytes,
            height: p.b - p.a,
        }
    }

    /// Head 0's rows over the chunk `[c0, c1)`, joined into `rows`, with both head strides, or
    /// `None` when the head strides change inside the chunk (a staging region's partial last
    /// chunk), so that head `j`'s rows are not head 0's shifted by `j` head strides.
    fn head_template(&self, c0: u64, c1: u64, rows: &mut Vec<CopyRect>) -> Option<(u64, u64)> {
        rows.clear();
        let mut strides = None;
        let mut joiner = Joiner::new(std::mem::take(rows));
        for p in self.pieces(c0, c1) {
            match strides {
                None => strides = Some((p.hs_src, p.hs_dst)),
                Some(s) if s != (p.hs_src, p.hs_dst) => {
                    *rows = joiner.finish();
                    return None;
                }
                Some(_) => {}
            }
            joiner.rows(self.head_run_piece(&p, 0));
        }
        *rows = joiner.finish();
        strides
    }

    /// Walks every element in `order`, passing rows to `sink`.
    pub fn walk(&self, order: Order, sink: &mut impl RowSink) {
        if self.tokens == 0 || self.heads == 0 {
            return;
        }
        if order == Order::TokenMajor {
            if let Some(pages) = self.page_rows() {
                pages.walk(sink);
                return;
            }
            for p in self.pieces(0, self.tokens) {
                if sink.full() {
                    return;
                }
                self.token_major_piece(&p, sink);
            }
            return;
        }
        let g = self.chunk_len(order);
        let mut template = Vec::new();
        let mut c0 = 0;
        while c0 < self.tokens {
            if sink.full() {
                return;
            }
            let c1 = (c0 + g).min(self.tokens);
            self.head_major_chunk(c0, c1, &mut template, sink);
            c0 = c1;
        }
    }

    fn head_major_chunk(
        &self,
        c0: u64,
        c1: u64,
        template: &mut Vec<CopyRect>,
        sink: &mut impl RowSink,
    ) {
        let Some((hs_src, hs_dst)) = self.head_template(c0, c1, template) else {
            for j in 0..self.heads {
                for p in self.pieces(c0, c1) {
                    sink.rows(self.head_run_piece(&p, j));
                }
            }
            return;
        };
        if let [row] = template[..]
            && (row.height == 1 || row.is_contiguous())
        {
            // Each head's run of the chunk is one block: the heads are the rows.
            sink.rows(CopyRect {
                src_offset: row.src_offset,
                dst_offset: row.dst_offset,
                src_pitch: hs_src,
                dst_pitch: hs_dst,
                width: row.bytes(),
                height: self.heads,
            });
            return;
        }
        // Head j's rows are head 0's, j head strides on.
        sink.repeat(template, self.heads, (hs_src, hs_dst));
    }

    /// The segments of head 0's run over the chunk `[c0, c1)` with both head strides; or that
    /// the chunk is sure to reach `room` segments (the run was not finished); or that the head
    /// strides change inside the chunk.
    fn head_tally(&self, c0: u64, c1: u64, room: u64) -> HeadRun {
        let mut joiner = Joiner::new(Tally::default());
        let mut strides = None;
        for p in self.pieces(c0, c1) {
            match strides {
                None => strides = Some((p.hs_src, p.hs_dst)),
                Some(s) if s != (p.hs_src, p.hs_dst) => return HeadRun::Varying,
                Some(_) => {}
            }
            joiner.rows(self.head_run_piece(&p, 0));
            // Segments only grow as rows are added; the row the joiner still holds adds its own,
            // less one if it joins the last segment counted.
            let pending = joiner.pending.map_or(0, |row| Tally::of(&row).segments);
            let run = (joiner.sink.segments + pending).saturating_sub(1);
            if self.heads.saturating_mul(run).saturating_sub(self.heads) >= room {
                return HeadRun::AtCap;
            }
        }
        match strides {
            Some(strides) => HeadRun::Uniform(joiner.finish(), strides),
            None => HeadRun::Varying,
        }
    }

    /// At most the transport segments of token-major order, from the layouts alone: a token
    /// per segment when both sides hold a token's moved heads back to back (or one head moves),
    /// else an element per segment.
    pub fn token_major_ceiling(&self) -> u64 {
        if self.heads <= 1
            || (self.src.heads_back_to_back(self.head_bytes)
                && self.dst.heads_back_to_back(self.head_bytes))
        {
            self.tokens
        } else {
            // Saturated, it still bounds a count, which is a `u64`.
            self.tokens.saturating_mul(self.heads)
        }
    }

    /// True when one side or the other breaks every head run ([`SideGeom::breaks_head_runs`]):
    /// no step along one head's run of a head-major chunk joins two elements into a segment.
    pub fn head_runs_broken(&self) -> bool {
        self.src.breaks_head_runs(self.head_bytes) || self.dst.breaks_head_runs(self.head_bytes)
    }

    /// At least the transport segments of head-major order in chunks of `g` tokens when the
    /// head runs are broken ([`Geometry::head_runs_broken`]): then only the `n - 1` steps from
    /// one head to the next inside a chunk and the step into each chunk after the first can
    /// join two elements. Of the `n * N - 1` steps of the order, at most `n * chunks - 1` join,
    /// so at least `n * (N - chunks) + 1` segments remain.
    pub fn head_major_floor(&self, g: u64) -> u64 {
        if self.tokens == 0 {
            return 0;
        }
        let chunks = self.tokens.div_ceil(g.max(1));
        // The count is a `u64`, so a floor past it cannot be, and saturating stays a floor.
        self.heads
            .saturating_mul(self.tokens - chunks)
            .saturating_add(1)
    }

    /// The transport segments of `order`, or `None` as soon as they reach `cap`: the count of
    /// [`Geometry::walk`]'s rows after merging, found in time proportional to the pieces.
    pub fn count(&self, order: Order, cap: u64) -> Option<u64> {
        let mut total = Tally::default();
        if self.tokens == 0 || self.heads == 0 {
            return Some(0);
        }
        let n = self.heads;
        if order == Order::TokenMajor {
            if let Some(pages) = self.page_rows() {
                return pages.count(cap);
            }
            for p in self.pieces(0, self.tokens) {
                if self.heads_adjacent(&p) {
                    total.append(Tally::of(&self.token_rows(&p)));
                } else {
                    // n segments per token (its heads never touch), the last head of a token
                    // joining the first of the next when both sides put them back to back.
                    let m = p.b - p.a;
                    let next_token_joins =
                        m > 1 && touches(p.end_of(self, p.a, n - 1), p.at(self, p.a + 1, 0));
                    total.append(Tally {
                        segments: m * n - (m - 1) * u64::from(next_token_joins),
                        first: (p.src, p.dst),
                        last_end: p.end_of(self, p.b - 1, n - 1),
                    });
                }
                if total.segments >= cap {
                    return None;
                }
            }
            return Some(total.segments);
        }
        let g = self.chunk_len(order);
        let mut template = Vec::new();
        let mut c0 = 0;
        while c0 < self.tokens {
            let c1 = (c0 + g).min(self.tokens);
            // Every head of a chunk has as many segments as head 0's run; the n runs join at
            // most n - 1 times among themselves and once with the previous chunk. Stop
            // building the run once n of them reach the cap even so.
            let room = cap.saturating_sub(total.segments);
            match self.head_tally(c0, c1, room) {
                HeadRun::AtCap => return None,
                HeadRun::Uniform(head, (hs_src, hs_dst)) => {
                    // Head j + 1 starts one head stride after head j.
                    let next = (head.first.0 + hs_src, head.first.1 + hs_dst);
                    let heads_join = touches(head.last_end, next);
                    let shift = n - 1;
                    total.append(Tally {
                        segments: n * head.segments - shift * u64::from(heads_join),
                        first: head.first,
                        last_end: (
                            head.last_end.0 + shift * hs_src,
                            head.last_end.1 + shift * hs_dst,
                        ),
                    });
                }
                HeadRun::Varying => {
                    let mut rows = Vec::new();
                    self.head_major_chunk(c0, c1, &mut template, &mut rows);
                    let mut chunk = Tally::default();
                    chunk.add_rows(&rows);
                    total.append(chunk);
                }
            }
            if total.segments >= cap {
                return None;
            }
            c0 = c1;
        }
        Some(total.segments)
    }
}

/// The token-major walk of a geometry whose sides change page together and hold each token's
/// moved heads back to back: page `i`'s tokens are one run of rows of `n * head_bytes` bytes.
struct PageRows<'g, 'a> {
    geometry: &'g Geometry<'a>,
}

impl PageRows<'_, '_> {
    /// Runs `f` with each side's pages as an iterator of page indices, so that the hot loops
    /// below are compiled once per kind of side and test no enum inside.
    #[inline]
    fn with_pages<R>(&self, f: impl PageLoop<R>) -> R {
        let g = self.geometry;
        fn listed(pages: &[i32]) -> impl Iterator<Item = u64> + '_ {
            pages.iter().map(|&p| p as u64)
        }
        let dense = |len: usize| 0..len as u64;
        let pages = g.tokens.div_ceil(g.src.page_size) as usize;
        match (g.src.pages, g.dst.pages) {
            (Pages::List(s), Pages::List(d)) => f.run(listed(s), listed(d)),
            (Pages::List(s), Pages::Dense) => f.run(listed(s), dense(pages)),
            (Pages::Dense, Pages::List(d)) => f.run(dense(pages), listed(d)),
            (Pages::Dense, Pages::Dense) => f.run(dense(pages), dense(pages)),
        }
    }

    /// Segments: per page one block when rows are back to back on both sides, else one per
    /// row; a page's last segment joins the next page's first when they touch.
    fn count(&self, cap: u64) -> Option<u64> {
        let g = self.geometry;
        let (row, _) = page_shape(g);
        // Rows that are not one block are a segment each, and a listed side whose pages are
        // longer than a page's rows (page_stride > (page_size - 1) * token_stride + width) never
        // lets the last row of one page touch the first of another: then every token is a
        // segment, with no pass over the pages.
        let apart = |side: &SideGeom<'_>| {
            matches!(side.pages, Pages::List(_))
                && side.page_stride > (side.page_size - 1) * side.token_stride + row.width
        };
        if !row.is_contiguous() && (apart(&g.src) || apart(&g.dst)) {
            return (g.tokens < cap).then_some(g.tokens);
        }
        self.with_pages(CountPages {
            geometry: self.geometry,
            cap,
        })
    }

    /// The rows, joined where a page continues the last one's stride.
    fn walk(&self, sink: &mut impl RowSink) {
        self.with_pages(WalkPages {
            geometry: self.geometry,
            sink,
        })
    }
}

/// A loop over the pages of a [`PageRows`], given each side's page indices in request order.
trait PageLoop<R> {
    fn run(self, src: impl Iterator<Item = u64>, dst: impl Iterator<Item = u64>) -> R;
}

/// What every page row shares (its height is the page size; the last page's may be less),
/// and how many tokens the last page holds.
fn page_shape(g: &Geometry<'_>) -> (CopyRect, u64) {
    let ps = g.src.page_size;
    let row = CopyRect {
        src_offset: 0,
        dst_offset: 0,
        src_pitch: g.src.token_stride,
        dst_pitch: g.dst.token_stride,
        width: g.heads * g.head_bytes,
        height: ps,
    };
    (row, g.tokens - (g.tokens - 1) / ps * ps)
}

/// Each page's first row on both sides and its height, the last page's height its own.
#[inline]
fn page_starts<'g>(
    g: &'g Geometry<'_>,
    src: impl Iterator<Item = u64> + 'g,
    dst: impl Iterator<Item = u64> + 'g,
) -> impl Iterator<Item = (u64, u64, u64)> + 'g {
    let (row, last) = page_shape(g);
    let pages = g.tokens.div_ceil(g.src.page_size);
    let (s, d) = (g.src, g.dst);
    src.zip(dst).zip(1..=pages).map(move |((sp, dp), n)| {
        let height = if n == pages { last } else { row.height };
        (
            sp * s.page_stride + s.base,
            dp * d.page_stride + d.base,
            height,
        )
    })
}

struct CountPages<'g, 'a> {
    geometry: &'g Geometry<'a>,
    cap: u64,
}

impl PageLoop<Option<u64>> for CountPages<'_, '_> {
    #[inline]
    fn run(self, src: impl Iterator<Item = u64>, dst: impl Iterator<Item = u64>) -> Option<u64> {
        let (row, _) = page_shape(self.geometry);
        let block = row.is_contiguous();
        let (mut segments, mut end) = (0u64, (u64::MAX, u64::MAX));
        for (src, dst, height) in page_starts(self.geometry, src, dst) {
            let here = if block || height == 1 { 1 } else { height };
            segments += here - u64::from(end == (src, dst));
            let rows = height - 1;
            end = (
                src + rows * row.src_pitch + row.width,
                dst + rows * row.dst_pitch + row.width,
            );
            if segments >= self.cap {
                return None;
            }
        }
        Some(segments)
    }
}

struct WalkPages<'g, 'a, S> {
    geometry: &'g Geometry<'a>,
    sink: S,
}

impl<S: RowSink> PageLoop<()> for WalkPages<'_, '_, S> {
    #[inline]
    fn run(self, src: impl Iterator<Item = u64>, dst: impl Iterator<Item = u64>) {
        // Every row has the same width and pitches: a page continues the pending run where its
        // pitches put the next row. A page of one slot may carry any token stride, so that
        // place may lie past 2^64, where a wrapped sum must never match a page: it is compared
        // in u128, unless no run can reach past 2^64 on either side (its next row is at most
        // a whole page's rows after the highest page's start), as in every usual layout.
        let g = self.geometry;
        let (row, _) = page_shape(g);
        let within = |side: &SideGeom<'_>, pitch: u64| -> bool {
            pitch
                .checked_mul(row.height)
                .and_then(|rows| side.reach.checked_add(rows))
                .is_some()
        };
        if within(&g.src, row.src_pitch) && within(&g.dst, row.dst_pitch) {
            self.join_pages(src, dst, |offset, rows, pitch, at| {
                offset + rows * pitch == at
            });
        } else {
            self.join_pages(src, dst, lands_on);
        }
    }
}

impl<S: RowSink> WalkPages<'_, '_, S> {
    /// Passes on each run of pages that continue one another as one row; `lands_on` says
    /// whether a run of rows puts its next row at a page's start.
    #[inline]
    fn join_pages(
        mut self,
        src: impl Iterator<Item = u64>,
        dst: impl Iterator<Item = u64>,
        lands_on: impl Fn(u64, u64, u64, u64) -> bool,
    ) {
        let (row, _) = page_shape(self.geometry);
        let mut pending: Option<CopyRect> = None;
        for (src, dst, height) in page_starts(self.geometry, src, dst) {
            if let Some(p) = &mut pending {
                if lands_on(p.src_offset, p.height, p.src_pitch, src)
                    && lands_on(p.dst_offset, p.height, p.dst_pitch, dst)
                {
                    p.height += height;
                    continue;
                }
                self.sink.rows(*p);
            }
            pending = Some(CopyRect {
                src_offset: src,
                dst_offset: dst,
                height,
                ..row
            });
        }
        if let Some(p) = pending {
            self.sink.rows(p);
        }
    }
}

impl<S: RowSink> RowSink for &mut S {
    fn rows(&mut self, row: CopyRect) {
        (**self).rows(row);
    }

    fn repeat(&mut self, period: &[CopyRect], times: u64, step: (u64, u64)) {
        (**self).repeat(period, times, step);
    }

    fn full(&self) -> bool {
        (**self).full()
    }
}

/// Head 0's run over a chunk, as [`Geometry::count`] needs it.
enum HeadRun {
    /// Its segments, and both head strides, the same over the whole chunk.
    Uniform(Tally, (u64, u64)),
    /// It reached the segments the count had room for.
    AtCap,
    /// The head strides change inside the chunk.
    Varying,
}

impl RowSink for Tally {
    fn rows(&mut self, row: CopyRect) {
        self.append(Tally::of(&row));
    }
}

/// True when a segment ending at `end` (both sides) continues into one starting at `start`.
#[inline]
fn touches(end: (u64, u64), start: (u64, u64)) -> bool {
    end == start
}

/// Segments of a stretch of the walk: how many, where the first starts and the last ends.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    segments: u64,
    first: (u64, u64),
    last_end: (u64, u64),
}

impl Tally {
    /// Appends the stretch that follows this one.
    fn append(&mut self, next: Tally) {
        if next.segments == 0 {
            return;
        }
        if self.segments == 0 {
            *self = next;
            return;
        }
        self.segments += next.segments;
        if touches(self.last_end, next.first) {
            self.segments -= 1;
        }
        self.last_end = next.last_end;
    }

    /// One run of rows: a contiguous run (or one row) is one segment, any other `height`.
    fn of(row: &CopyRect) -> Tally {
        let last = row.height - 1;
        Tally {
            segments: if row.height == 1 || row.is_contiguous() {
                1
            } else {
                row.height
            },
            first: (row.src_offset, row.dst_offset),
            last_end: (
                row.src_offset + last * row.src_pitch + row.width,
                row.dst_offset + last * row.dst_pitch + row.width,
            ),
        }
    }

    /// Appends runs of rows.
    fn add_rows(&mut self, rows: &[CopyRect]) {
        for row in rows {
            self.append(Tally::of(row));
        }
    }
}
