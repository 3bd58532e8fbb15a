//! The staging pool's allocator: a binary buddy allocator over units of `min_slot` bytes whose
//! slots are trimmed to the units they need.
//!
//! A slot of `n` units is carved from the lowest free block of `2^k >= n` units (splitting a
//! larger block if needed), and the block's unused tail goes straight back to the free lists as
//! the aligned blocks that make it up, as Linux's `alloc_pages_exact` does. So a slot wastes less
//! than one unit (internal fragmentation below `min_slot` bytes), starts on a multiple of its
//! block size, and frees as the blocks of its binary decomposition, each merging with its free
//! buddy as usual.
//!
//! The bound on external fragmentation that follows: an aligned block of `B = 2^k` units is
//! unusable only while a live slot overlaps it, a slot of `s` units overlaps at most
//! `max(1, s / B)` aligned `B`-blocks (it starts on a multiple of `min(B, 2^ceil(log2 s))`), so a
//! request of `B` units succeeds whenever `live_slots + live_units / B` is below the number of
//! aligned `B`-blocks in the region (`capacity / B` for a power-of-two capacity). Slots of one
//! size class never fragment at all.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

/// Why an allocation or a free was refused, in units; [`super::StagingPool`] turns these into
/// [`crate::Error`]s with bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No free block can hold the slot now.
    Full,
    /// No block of the region can ever hold the slot.
    TooLarge,
    /// The offset was a slot that is already free.
    DoubleFree { units: u64 },
    /// No slot starts at the offset; `inside` is the live slot that contains it, if one does.
    NotASlot { inside: Option<(u64, u64)> },
}

/// Free blocks per order, live slots and recently freed slots, all in units.
#[derive(Debug)]
pub(crate) struct Buddy {
    units: u64,
    /// `free[j]`: starts of the free blocks of `2^j` units, lowest first.
    free: Vec<BTreeSet<u64>>,
    /// Live slots: start -> units.
    live: BTreeMap<u64, u64>,
    /// Slots freed since their space was last handed out: start -> units. Tells a double free
    /// from an offset that never was a slot.
    freed: BTreeMap<u64, u64>,
    live_units: u64,
}

/// `ceil(log2(n))` for `n >= 1`.
fn order_of(n: u64) -> u32 {
    if n.is_power_of_two() {
        n.trailing_zeros()
    } else {
        u64::BITS - n.leading_zeros()
    }
}

impl Buddy {
    /// A region of `units` units (at least 1), all free: its binary decomposition, largest block
    /// first, so that every block is aligned to its size.
    pub(crate) fn new(units: u64) -> Self {
        debug_assert!(units > 0);
        let orders = (u64::BITS - units.leading_zeros()) as usize;
        let mut buddy = Buddy {
            units,
            free: vec![BTreeSet::new(); orders],
            live: BTreeMap::new(),
            freed: BTreeMap::new(),
            live_units: 0,
        };
        let mut start = 0;
        for order in (0..orders).rev() {
            if units & (1 << order) != 0 {
                buddy.free[order].insert(start);
                start += 1 << order;
            }
        }
        buddy
    }

    /// The lowest free start for a slot of `n >= 1` units.
    pub(crate) fn alloc(&mut self, n: u64) -> Result<u64, Refusal> {
        let order = order_of(n) as usize;
        // The largest block is the first of the decomposition: 2^(orders - 1) units.
        if order >= self.free.len() {
            return Err(Refusal::TooLarge);
        }
        let Some(mut have) = (order..self.free.len()).find(|&j| !self.free[j].is_empty()) else {
            return Err(Refusal::Full);
        };
        let start = self.free[have].pop_first().expect("a non-empty free list");
        while have > order {
            have -= 1;
            self.free[have].insert(start + (1 << have));
        }
        // The block's tail beyond the slot goes back as aligned blocks.
        let end = start + (1 << order);
        let mut at = start + n;
        while at < end {
            let size = largest_block_at(at, end);
            self.release(at, size.trailing_zeros() as usize);
            at += size;
        }
        let stale: Vec<u64> = self
            .freed
            .range(start..start + n)
            .map(|(&s, _)| s)
            .collect();
        for s in stale {
            self.freed.remove(&s);
        }
        self.live.insert(start, n);
        self.live_units += n;
        Ok(start)
    }

    /// Frees the slot that starts at `start`.
    pub(crate) fn free(&mut self, start: u64) -> Result<u64, Refusal> {
        let Some(n) = self.live.remove(&start) else {
            if let Some(&units) = self.freed.get(&start) {
                return Err(Refusal::DoubleFree { units });
            }
            let inside = self
                .live
                .range(..start)
                .next_back()
                .filter(|&(&s, &len)| start < s + len)
                .map(|(&s, &len)| (s, len));
            return Err(Refusal::NotASlot { inside });
        };
        let end = start + n;
        let mut at = start;
        while at < end {
            let size = largest_block_at(at, end);
            self.release(at, size.trailing_zeros() as usize);
            at += size;
        }
        self.freed.insert(start, n);
        self.live_units -= n;
        Ok(n)
    }

    /// Returns the block of `2^order` units at `start` to the free lists, merged with its free
    /// buddies.
    fn release(&mut self, mut start: u64, mut order: usize) {
        while order + 1 < self.free.len() {
            let size = 1u64 << order;
            let buddy = start ^ size;
            // A buddy past the region's end belongs to no block; one inside it is free at this
            // order only if it is this block's real buddy (the decomposition puts smaller blocks
            // after larger ones, so no foreign block of this order starts there).
            if buddy + size > self.units || !self.free[order].remove(&buddy) {
                break;
            }
            start = start.min(buddy);
            order += 1;
        }
        self.free[order].insert(start);
    }

    /// Units held by live slots.
    pub(crate) fn live_units(&self) -> u64 {
        self.live_units
    }

    /// Live slots.
    pub(crate) fn live_slots(&self) -> usize {
        self.live.len()
    }

    /// The largest slot an allocation would get now, in units.
    pub(crate) fn largest_free(&self) -> u64 {
        self.free
            .iter()
            .rposition(|list| !list.is_empty())
            .map_or(0, |order| 1 << order)
    }

    /// The live slots, lowest first: (start, units).
    pub(crate) fn slots(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.live.iter().map(|(&s, &n)| (s, n))
    }
}

/// The largest aligned block that starts at `at` and ends at or before `end` (`at < end`).
fn largest_block_at(at: u64, end: u64) -> u64 {
    let aligned = if at == 0 {
        u64::MAX
    } else {
        1u64 << at.trailing_zeros()
    };
    let fits = 1u64 << (u64::BITS - 1 - (end - at).leading_zeros());
    aligned.min(fits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit is in exactly one free block or one live slot, blocks are aligned to their
    /// size, and no two free buddies are left unmerged.
    fn check(buddy: &Buddy) {
        let mut owner = vec![0u8; buddy.units as usize];
        for (order, list) in buddy.free.iter().enumerate() {
            let size = 1u64 << order;
            for &start in list {
                assert_eq!(
                    start % size,
                    0,
                    "free block {start} of order {order} misaligned"
                );
                assert!(start + size <= buddy.units);
                for unit in start..start + size {
                    assert_eq!(owner[unit as usize], 0, "unit {unit} free twice");
                    owner[unit as usize] = 1;
                }
                let partner = start ^ size;
                assert!(
                    order + 1 == buddy.free.len() || !list.contains(&partner),
                    "free buddies {start} and {partner} of order {order} not merged"
                );
            }
        }
        for (start, units) in buddy.slots() {
            assert_eq!(start % (1 << order_of(units)), 0, "slot {start} misaligned");
            for unit in start..start + units {
                assert_eq!(owner[unit as usize], 0, "unit {unit} both live and free");
                owner[unit as usize] = 2;
            }
        }
        assert!(owner.iter().all(|&o| o != 0), "a unit is lost");
        let live: u64 = buddy.slots().map(|(_, n)| n).sum();
        assert_eq!(live, buddy.live_units());
    }

    #[test]
    fn a_fresh_region_is_its_binary_decomposition_and_frees_back_to_it() {
        for units in [1, 2, 3, 5, 6, 7, 12, 13, 64, 100] {
            let mut buddy = Buddy::new(units);
            check(&buddy);
            let mut starts = Vec::new();
            while let Ok(start) = buddy.alloc(1) {
                starts.push(start);
                check(&buddy);
            }
            assert_eq!(starts.len() as u64, units, "every unit can be handed out");
            for start in starts.into_iter().rev() {
                buddy.free(start).unwrap();
                check(&buddy);
            }
            assert_eq!(buddy.largest_free(), 1 << (63 - units.leading_zeros()));
        }
    }

    #[test]
    fn a_slot_wastes_no_unit_and_its_tail_is_free_at_once() {
        let mut buddy = Buddy::new(64);
        let start = buddy.alloc(37).unwrap();
        assert_eq!(start, 0);
        check(&buddy);
        assert_eq!(buddy.live_units(), 37);
        // The tail [37, 64) is free: a slot of 16 fits at 48, one of 8 at 40.
        assert_eq!(buddy.alloc(16), Ok(48));
        assert_eq!(buddy.alloc(8), Ok(40));
        assert_eq!(buddy.alloc(3), Err(Refusal::Full));
        assert_eq!(buddy.alloc(2), Ok(38));
        assert_eq!(buddy.alloc(1), Ok(37));
        assert_eq!(buddy.largest_free(), 0);
        check(&buddy);
    }

    #[test]
    fn slots_of_one_size_fill_the_whole_region() {
        let mut buddy = Buddy::new(96);
        let starts: Vec<u64> = (0..12).map(|_| buddy.alloc(8).unwrap()).collect();
        assert_eq!(buddy.alloc(1), Err(Refusal::Full));
        let mut sorted = starts.clone();
        sorted.sort();
        assert_eq!(sorted, (0..12).map(|i| i * 8).collect::<Vec<_>>());
        check(&buddy);
    }

    #[test]
    fn a_slot_larger_than_the_largest_block_can_never_fit() {
        let mut buddy = Buddy::new(12);
        assert_eq!(buddy.alloc(9), Err(Refusal::TooLarge));
        assert_eq!(buddy.alloc(8), Ok(0));
        assert_eq!(buddy.alloc(5), Err(Refusal::Full));
        assert_eq!(buddy.alloc(4), Ok(8));
    }

    #[test]
    fn misuse_is_told_apart() {
        let mut buddy = Buddy::new(32);
        let a = buddy.alloc(5).unwrap();
        let b = buddy.alloc(3).unwrap();
        assert_eq!(
            buddy.free(a + 1),
            Err(Refusal::NotASlot {
                inside: Some((a, 5))
            })
        );
        assert_eq!(buddy.free(30), Err(Refusal::NotASlot { inside: None }));
        buddy.free(b).unwrap();
        assert_eq!(buddy.free(b), Err(Refusal::DoubleFree { units: 3 }));
        // Once the space is handed out again, the old record no longer claims it.
        let c = buddy.alloc(8).unwrap();
        assert!(c <= b && b < c + 8);
        if c != b {
            assert_eq!(
                buddy.free(b),
                Err(Refusal::NotASlot {
                    inside: Some((c, 8))
                })
            );
        }
        check(&buddy);
    }

    #[test]
    fn the_fragmentation_bound_holds_under_a_random_mix() {
        // A request of B units must succeed whenever live_slots + live_units / B is below the
        // region's aligned B-blocks (power-of-two region: units / B).
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let units = 1024;
        let mut buddy = Buddy::new(units);
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..20_000 {
            if !live.is_empty() && next() % 3 == 0 {
                let at = (next() % live.len() as u64) as usize;
                buddy.free(live.swap_remove(at)).unwrap();
                continue;
            }
            let n = 1 + next() % 70;
            let block = 1u64 << order_of(n);
            let blocked = buddy.live_slots() as u64 + buddy.live_units().div_ceil(block);
            match buddy.alloc(n) {
                Ok(start) => live.push(start),
                Err(refusal) => assert!(
                    blocked >= units / block,
                    "{refusal:?} for {n} units with {} slots holding {} units",
                    buddy.live_slots(),
                    buddy.live_units()
                ),
            }
        }
        check(&buddy);
    }
}
