//! Helpers shared by the integration tests: an independent statement of the contract's head
//! ownership, deterministic fragmented requests, and KV buffers whose bytes identify what they
//! hold.
#![allow(dead_code)] // each test binary uses a different subset

use std::ops::Range;

/// KV head counts the property tests cover.
pub const HEAD_COUNTS: [u32; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64];

/// Contract section 3: a side is valid when H and T divide one way or the other.
pub fn valid_tp(heads: u32, tp: u32) -> bool {
    heads % tp == 0 || tp % heads == 0
}

/// Contract section 3, restated independently of the library: the heads rank `r` owns.
pub fn owned_heads(heads: u32, tp: u32, rank: u32) -> Range<u32> {
    if tp <= heads {
        let per = heads / tp;
        rank * per..(rank + 1) * per
    } else {
        let head = rank / (tp / heads);
        head..head + 1
    }
}

/// splitmix64: a tiny deterministic generator, so failures reproduce from the seed alone.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.range(0, i as u64) as usize;
            items.swap(i, j);
        }
    }
}

/// A request: page pairs plus the page counts each side's buffers hold.
#[derive(Clone, Debug)]
pub struct Request {
    pub src_pages: Vec<i32>,
    pub dst_pages: Vec<i32>,
    pub src_capacity_pages: usize,
    pub dst_capacity_pages: usize,
}

/// Lays runs of the given lengths out in a shuffled order with random gaps; returns each run's
/// first page (in the original run order) and the pages needed to hold them all.
fn lay_out(rng: &mut Rng, runs: &[usize]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    rng.shuffle(&mut order);
    let mut starts = vec![0; runs.len()];
    let mut next = rng.range(0, 2) as usize;
    for &run in &order {
        starts[run] = next;
        next += runs[run] + rng.range(0, 2) as usize;
    }
    (starts, next + 1)
}

/// A fragmented request of `runs` runs of 1..=4 pages: each run is contiguous on both sides,
/// the runs sit in shuffled order with gaps, independently on each side.
pub fn fragmented_request(seed: u64, runs: usize) -> Request {
    let mut rng = Rng::new(seed);
    let lengths: Vec<usize> = (0..runs).map(|_| rng.range(1, 4) as usize).collect();
    let (src_starts, src_capacity_pages) = lay_out(&mut rng, &lengths);
    let (dst_starts, dst_capacity_pages) = lay_out(&mut rng, &lengths);
    let mut request = Request {
        src_pages: Vec::new(),
        dst_pages: Vec::new(),
        src_capacity_pages,
        dst_capacity_pages,
    };
    for (run, &len) in lengths.iter().enumerate() {
        for k in 0..len {
            request.src_pages.push((src_starts[run] + k) as i32);
            request.dst_pages.push((dst_starts[run] + k) as i32);
        }
    }
    request
}

/// The bytes of one head of one token: the first 8 identify (buffer, page, token, global head),
/// the rest are a ramp, so a misplaced or shifted copy cannot go unnoticed.
pub fn head_bytes(out: &mut [u8], buffer: usize, page: usize, token: usize, head: u32) {
    let key = (buffer as u64) << 48 | (page as u64) << 28 | (token as u64) << 12 | u64::from(head);
    let n = out.len().min(8);
    out[..n].copy_from_slice(&key.to_le_bytes()[..n]);
    let len = out.len();
    out[n..].copy_from_slice(&RAMP[n..len]);
}

/// `RAMP[i] == i as u8`: filled with one copy instead of a per-byte loop (the tests run unoptimised).
static RAMP: [u8; 1 << 16] = {
    let mut ramp = [0u8; 1 << 16];
    let mut i = 0;
    while i < ramp.len() {
        ramp[i] = i as u8;
        i += 1;
    }
    ramp
};

/// One side of a deployment: per rank, `num_buffers` buffers of `capacity_pages` pages.
pub struct SideBuffers {
    pub heads: u32,
    pub tp: u32,
    pub page_size: usize,
    pub bytes_per_head: usize,
    pub capacity_pages: usize,
    /// `ranks[r][b]` is buffer `b` of rank `r`.
    pub ranks: Vec<Vec<Vec<u8>>>,
}

impl SideBuffers {
    pub fn heads_per_rank(&self) -> usize {
        owned_heads(self.heads, self.tp, 0).len()
    }

    pub fn bytes_per_token(&self) -> usize {
        self.heads_per_rank() * self.bytes_per_head
    }

    pub fn item_len(&self) -> usize {
        self.page_size * self.bytes_per_token()
    }

    /// Buffers whose every head slot holds its identifying bytes.
    pub fn identified(
        heads: u32,
        tp: u32,
        page_size: usize,
        bytes_per_head: usize,
        capacity_pages: usize,
        num_buffers: usize,
    ) -> Self {
        let mut side = SideBuffers {
            heads,
            tp,
            page_size,
            bytes_per_head,
            capacity_pages,
            ranks: Vec::new(),
        };
        let len = capacity_pages * side.item_len();
        for rank in 0..tp {
            let owned = owned_heads(heads, tp, rank);
            let buffers = (0..num_buffers)
                .map(|b| {
                    let mut buf = vec![0u8; len];
                    for (slot, chunk) in buf.chunks_exact_mut(bytes_per_head).enumerate() {
                        let (token_index, k) = (slot / owned.len(), slot % owned.len());
                        let (page, token) = (token_index / page_size, token_index % page_size);
                        head_bytes(chunk, b, page, token, owned.start + k as u32);
                    }
                    buf
                })
                .collect();
            side.ranks.push(buffers);
        }
        side
    }

    /// Buffers filled with a pattern that depends on rank, buffer and position, and on no head.
    pub fn sentinel(
        heads: u32,
        tp: u32,
        page_size: usize,
        bytes_per_head: usize,
        capacity_pages: usize,
        num_buffers: usize,
    ) -> Self {
        let mut side = SideBuffers {
            heads,
            tp,
            page_size,
            bytes_per_head,
            capacity_pages,
            ranks: Vec::new(),
        };
        let len = capacity_pages * side.item_len();
        for rank in 0..tp as usize {
            let buffers = (0..num_buffers)
                .map(|b| {
                    // A prime period never lines up with head or token boundaries.
                    let period: Vec<u8> = (0..251)
                        .map(|i| (0xA5 ^ (rank * 7) ^ (b * 13) ^ (i * 31)) as u8)
                        .collect();
                    let mut buf = vec![0u8; len];
                    for chunk in buf.chunks_mut(period.len()) {
                        chunk.copy_from_slice(&period[..chunk.len()]);
                    }
                    buf
                })
                .collect();
            side.ranks.push(buffers);
        }
        side
    }
}

/// What every decode buffer must hold after the transfer: its sentinel bytes everywhere except
/// the owned heads of the requested pages, which hold the source's identifying bytes.
pub fn expected_decode(initial: &SideBuffers, request: &Request) -> Vec<Vec<Vec<u8>>> {
    let bph = initial.bytes_per_head;
    let (item, bpt) = (initial.item_len(), initial.bytes_per_token());
    let mut expected = initial.ranks.clone();
    for (rank, buffers) in expected.iter_mut().enumerate() {
        let owned = owned_heads(initial.heads, initial.tp, rank as u32);
        for (b, buf) in buffers.iter_mut().enumerate() {
            for (&src_page, &dst_page) in request.src_pages.iter().zip(&request.dst_pages) {
                for token in 0..initial.page_size {
                    for (k, head) in owned.clone().enumerate() {
                        let at = dst_page as usize * item + token * bpt + k * bph;
                        head_bytes(&mut buf[at..at + bph], b, src_page as usize, token, head);
                    }
                }
            }
        }
    }
    expected
}
