//! The one generator: the elements of a request, walked in one of the orders of CONTRACT
//! section 7, as rows of strided copies; and how many transport segments each order gives,
//! counted without walking every element.
//!
//! An element is one head of one token: `head_bytes` bytes at a side's address
//! `addr(k, j)` for token `k < N` and moved head `j < n`. Both sides are cut into *pieces*:
//! token ranges in which neither side changes page, so that inside a piece each side's
//! address is affine in `(k, j)`. A request has at most one piece per page of either side,
//! which is what bounds the cost of a plan by its pages and its entries, never by tokens
//! times heads.

use crate::plan::CopyRect;

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

    /// The address of element `(k, j)`.
    #[inline]
    pub fn addr(&self, k: u64, j: u64) -> u64 {
        let position = k / self.page_size;
        self.pages.at(position) * self.page_stride
            + self.base
            + (k % self.page_size) * self.token_stride
            + j * self.head_stride_at(position)
    }

    /// The next page boundary after token `k`.
    #[inline]
    fn next_boundary(&self, k: u64) -> u64 {
        (k / self.page_size + 1) * self.page_size
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

/// An order of a request's elements (CONTRACT section 7): token-major (token outer, head
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
}

/// Joins consecutive rows that continue one another (same width and pitches, the next row
/// where the pitches put it) before passing them on, so that a run of pages that keeps its
/// stride is one rect.
pub(crate) struct Joiner<S: RowSink> {
    pending: Option<CopyRect>,
    pub sink: S,
}

impl<S: RowSink> Joiner<S> {
    pub fn new(sink: S) -> Self {
        Joiner {
            pending: None,
            sink,
        }
    }

    pub fn finish(mut self) -> S {
        if let Some(pending) = self.pending.take() {
            self.sink.rows(pending);
        }
        self.sink
    }
}

impl<S: RowSink> RowSink for Joiner<S> {
    fn rows(&mut self, row: CopyRect) {
        if let Some(pending) = &mut self.pending {
            if pending.width == row.width
                && pending.src_pitch == row.src_pitch
                && pending.dst_pitch == row.dst_pitch
                && pending.src_offset + pending.height * pending.src_pitch == row.src_offset
                && pending.dst_offset + pending.height * pending.dst_pitch == row.dst_offset
            {
                pending.height += row.height;
                return;
            }
            self.sink.rows(*pending);
        }
        self.pending = Some(row);
    }
}

impl RowSink for Vec<CopyRect> {
    fn rows(&mut self, row: CopyRect) {
        self.push(row);
    }
}

impl<'a> Geometry<'a> {
    /// The pieces of tokens `[from, to)`: ranges in which neither side changes page.
    fn pieces(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut k = from;
        std::iter::from_fn(move || {
            if k >= to {
                return None;
            }
            let end = self
                .src
                .next_boundary(k)
                .min(self.dst.next_boundary(k))
                .min(to);
            let piece = (k, end);
            k = end;
            Some(piece)
        })
    }

    /// The chunks of an order: token ranges walked head by head (one token each for
    /// token-major).
    fn chunk_len(&self, order: Order) -> u64 {
        match order {
            Order::TokenMajor => 1,
            Order::HeadMajor(g) => g.max(1),
        }
    }

    /// Both sides' head strides at the page holding token `k`.
    fn head_strides(&self, k: u64) -> (u64, u64) {
        (
            self.src.head_stride_at(k / self.src.page_size),
            self.dst.head_stride_at(k / self.dst.page_size),
        )
    }

    /// True when both sides hold the moved heads of a token back to back (or one head moves).
    fn heads_adjacent(&self, k: u64) -> bool {
        let (s, d) = self.head_strides(k);
        self.heads == 1 || (s == self.head_bytes && d == self.head_bytes)
    }

    fn at(&self, k: u64, j: u64) -> (u64, u64) {
        (self.src.addr(k, j), self.dst.addr(k, j))
    }

    /// The row of tokens `[a, b)` (one page on each side) in token-major order when a token's
    /// moved heads are back to back on both sides: each token is one row.
    fn token_rows(&self, a: u64, b: u64) -> CopyRect {
        let (src, dst) = self.at(a, 0);
        CopyRect {
            src_offset: src,
            dst_offset: dst,
            src_pitch: self.src.token_stride,
            dst_pitch: self.dst.token_stride,
            width: self.heads * self.head_bytes,
            height: b - a,
        }
    }

    /// The rows of tokens `[a, b)` (one page on each side) in token-major order.
    fn token_major_piece(&self, a: u64, b: u64, sink: &mut impl RowSink) {
        if self.heads_adjacent(a) {
            sink.rows(self.token_rows(a, b));
            return;
        }
        // Each token's heads are a run of rows one head stride apart.
        let (src_pitch, dst_pitch) = self.head_strides(a);
        for k in a..b {
            let (src, dst) = self.at(k, 0);
            sink.rows(CopyRect {
                src_offset: src,
                dst_offset: dst,
                src_pitch,
                dst_pitch,
                width: self.head_bytes,
                height: self.heads,
            });
        }
    }

    /// The rows of head `j` over tokens `[a, b)` (one page on each side).
    fn head_run_piece(&self, a: u64, b: u64, j: u64) -> CopyRect {
        let (src, dst) = self.at(a, j);
        CopyRect {
            src_offset: src,
            dst_offset: dst,
            src_pitch: self.src.token_stride,
            dst_pitch: self.dst.token_stride,
            width: self.head_bytes,
            height: b - a,
        }
    }

    /// Head 0's rows over the chunk `[c0, c1)`, joined, or `None` when the head strides change
    /// inside the chunk (a staging region's partial last chunk), so that head `j`'s rows are
    /// not head 0's shifted by `j` head strides.
    fn head_template(&self, c0: u64, c1: u64) -> Option<(Vec<CopyRect>, (u64, u64))> {
        let strides = self.head_strides(c0);
        if self.head_strides(c1 - 1) != strides {
            return None;
        }
        let mut joiner = Joiner::new(Vec::new());
        for (a, b) in self.pieces(c0, c1) {
            joiner.rows(self.head_run_piece(a, b, 0));
        }
        Some((joiner.finish(), strides))
    }

    /// Walks every element in `order`, passing rows to `sink`.
    pub fn walk(&self, order: Order, sink: &mut impl RowSink) {
        if self.tokens == 0 || self.heads == 0 {
            return;
        }
        if order == Order::TokenMajor {
            for (a, b) in self.pieces(0, self.tokens) {
                self.token_major_piece(a, b, sink);
            }
            return;
        }
        let g = self.chunk_len(order);
        let mut c0 = 0;
        while c0 < self.tokens {
            let c1 = (c0 + g).min(self.tokens);
            self.head_major_chunk(c0, c1, sink);
            c0 = c1;
        }
    }

    fn head_major_chunk(&self, c0: u64, c1: u64, sink: &mut impl RowSink) {
        let Some((template, (hs_src, hs_dst))) = self.head_template(c0, c1) else {
            for j in 0..self.heads {
                for (a, b) in self.pieces(c0, c1) {
                    sink.rows(self.head_run_piece(a, b, j));
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
        for j in 0..self.heads {
            for row in &template {
                sink.rows(CopyRect {
                    src_offset: row.src_offset + j * hs_src,
                    dst_offset: row.dst_offset + j * hs_dst,
                    ..*row
                });
            }
        }
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
            for (a, b) in self.pieces(0, self.tokens) {
                if self.heads_adjacent(a) {
                    total.append(Tally::of(&self.token_rows(a, b)));
                } else {
                    // n segments per token (its heads never touch), the last head of a token
                    // joining the first of the next when both sides put them back to back.
                    let m = b - a;
                    let first = self.at(a, 0);
                    let next_token_joins =
                        m > 1 && touches(self.end_of(a, n - 1), self.at(a + 1, 0));
                    total.append(Tally {
                        segments: m * n - (m - 1) * u64::from(next_token_joins),
                        first,
                        last_end: self.end_of(b - 1, n - 1),
                    });
                }
                if total.segments >= cap {
                    return None;
                }
            }
            return Some(total.segments);
        }
        let g = self.chunk_len(order);
        let mut c0 = 0;
        while c0 < self.tokens {
            let c1 = (c0 + g).min(self.tokens);
            match self.head_template(c0, c1) {
                Some((template, (hs_src, hs_dst))) => {
                    let mut head = Tally::default();
                    head.add_rows(&template);
                    // Head j + 1 starts one head stride after head j.
                    let heads_join = touches(
                        head.last_end,
                        (head.first.0 + hs_src, head.first.1 + hs_dst),
                    );
                    total.append(Tally {
                        segments: n * head.segments - (n - 1) * u64::from(heads_join),
                        first: head.first,
                        last_end: self.end_of(c1 - 1, n - 1),
                    });
                }
                None => {
                    let mut rows = Vec::new();
                    self.head_major_chunk(c0, c1, &mut rows);
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

    /// Both sides' address just past element `(k, j)`.
    fn end_of(&self, k: u64, j: u64) -> (u64, u64) {
        let (src, dst) = self.at(k, j);
        (src + self.head_bytes, dst + self.head_bytes)
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
