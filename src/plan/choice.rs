//! Which order a pair plan walks its elements in: among token-major and the head-major orders
//! of REFERENCE.md section 11, the ones with the fewest segments, and among those the one with
//! the fewest rects; counted without walking every element where the layouts prove the answer.

#![forbid(unsafe_code)]

use super::stream::{Merger, RectCount, Rects};
use super::walk::{Geometry, Order};

/// The orders whose segments are fewest, in the reference's list order (token-major, then
/// head-major in chunks of the prefill page size, the decode page size, all tokens): the first
/// is the order of a plan's segments; its rects come from the one of them with the fewest.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ties {
    orders: [Order; 4],
    len: usize,
}

impl Ties {
    pub(super) fn one(order: Order) -> Ties {
        Ties {
            orders: [order; 4],
            len: 1,
        }
    }

    pub(super) fn push(&mut self, order: Order) {
        self.orders[self.len] = order;
        self.len += 1;
    }

    pub(super) fn first(&self) -> Order {
        self.orders[0]
    }

    pub(super) fn as_slice(&self) -> &[Order] {
        &self.orders[..self.len]
    }
}

/// The head-major orders a pair plan weighs against token-major: in chunks of the prefill
/// layout's page size, the decode layout's page size and all tokens (whether or not a side is
/// staged), in that list's order. Orders that walk the elements as an earlier one does (G >= N
/// is one chunk of all tokens; G = 1 is token-major) are left out.
pub(super) fn head_major_orders(tokens: u64, page_sizes: [u64; 2]) -> ([Order; 3], usize) {
    let mut orders = [Order::TokenMajor; 3];
    let mut len = 0;
    let mut tried = [1u64; 4];
    for (i, g) in [page_sizes[0], page_sizes[1], tokens]
        .into_iter()
        .enumerate()
    {
        let g = g.min(tokens).max(1);
        if tried[..=i].contains(&g) {
            continue;
        }
        tried[i + 1] = g;
        orders[len] = Order::HeadMajor(g);
        len += 1;
    }
    (orders, len)
}

/// The orders with the fewest segments among token-major and [`head_major_orders`], in that
/// list's order, and their segments when they were counted (`None`: they are token-major's,
/// counted when asked for).
///
/// What the layouts prove is not counted: with one head every order walks the same elements
/// in the same order, and a head-major order whose floor ([`Geometry::head_major_floor`]) is
/// above token-major's ceiling ([`Geometry::token_major_ceiling`]), or above the fewest
/// segments counted so far, has more segments than the best order. On uniform layouts (NHD
/// pages on both sides, one page size) with `n >= 2` moved heads, token-major has at most `N`
/// segments and head-major in chunks of `G` at least `n * (N - ceil(N / G)) + 1`, which is more
/// for every `G` of 3 or more and `N >= 2` (and for `G = 2` unless `n = 2` and `N` is odd):
/// then the order is token-major without a count, and a rect plan walks its request once.
pub(super) fn fewest_segments(
    geometry: &Geometry<'_>,
    page_sizes: [u64; 2],
) -> (Ties, Option<u64>) {
    let ties = Ties::one(Order::TokenMajor);
    if geometry.heads <= 1 {
        return (ties, None);
    }
    let (orders, len) = head_major_orders(geometry.tokens, page_sizes);
    let orders = &orders[..len];
    // Each order's floor, 0 where the layouts prove none.
    let mut floors = [0u64; 3];
    if geometry.head_runs_broken() {
        for (floor, &order) in floors.iter_mut().zip(orders) {
            *floor = geometry.head_major_floor(geometry.chunk_len(order));
        }
    }
    let ceiling = geometry.token_major_ceiling();
    if floors[..len].iter().all(|&floor| floor > ceiling) {
        return (ties, None);
    }
    let (ties, best) = count_fewest(geometry, orders, |i, best| floors[i] > best);
    (ties, Some(best))
}

/// Counts token-major, then each of `orders` up to a tie with the best so far, skipping order
/// `i` when `beaten(i, best)` proves it has more segments than `best`: the orders with the
/// fewest segments, in list order, and their segments.
pub(super) fn count_fewest(
    geometry: &Geometry<'_>,
    orders: &[Order],
    beaten: impl Fn(usize, u64) -> bool,
) -> (Ties, u64) {
    let mut ties = Ties::one(Order::TokenMajor);
    let mut best = geometry
        .count(Order::TokenMajor, u64::MAX)
        .expect("no cap to reach");
    for (i, &order) in orders.iter().enumerate() {
        if beaten(i, best) {
            continue;
        }
        // Counted up to a tie with the best so far.
        match geometry.count(order, best.saturating_add(1)) {
            Some(count) if count < best => {
                (ties, best) = (Ties::one(order), count);
            }
            Some(_) => ties.push(order),
            None => {}
        }
    }
    (ties, best)
}

/// The greedy rects of `order`, counted up to `cap`: `None` once they reach it.
fn count_rects(geometry: &Geometry<'_>, order: Order, cap: u64) -> Option<u64> {
    let mut merger = Merger::new(Rects::new(RectCount { count: 0, cap }));
    geometry.walk(order, &mut merger);
    let count = merger.finish().finish().count;
    (count < cap).then_some(count)
}

/// The order, among `ties` (the orders with the fewest segments, in the reference's list
/// order), whose greedy rects are fewest; the first of them on a tie (REFERENCE.md section 11).
///
/// Each order is counted up to a cap that starts small and grows fourfold until some order
/// comes in under it, and a later order of a round only up to the best count so far. So
/// choosing costs time in the rects of the order chosen (and the pages walked), never in
/// those of an order with many more: an order whose rects are one per token stops at the cap.
pub(super) fn fewest_rects(geometry: &Geometry<'_>, ties: &[Order]) -> Order {
    if let [order] = ties {
        return *order;
    }
    let mut cap: u64 = 256;
    loop {
        let mut best: Option<(Order, u64)> = None;
        for &order in ties {
            let limit = best.map_or(cap, |(_, count)| count);
            if let Some(count) = count_rects(geometry, order, limit) {
                best = Some((order, count));
            }
        }
        if let Some((order, _)) = best {
            return order;
        }
        cap = cap.saturating_mul(4);
    }
}
