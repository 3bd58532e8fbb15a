//! The staging pool's allocator: address-ordered best fit over units of `min_slot` bytes, with
//! free blocks coalesced on every free.
//!
//! A slot of `n` units takes the front of the smallest free block of at least `n` units (the
//! lowest such block among equals); the rest of the block stays free. A freed slot merges with
//! the free blocks on either side, so free blocks never touch: between two of them lies at least
//! one live slot, and the free space is split into at most `live_slots + 1` blocks.
//!
//! The bounds that follow, by design: a slot wastes less than one unit (internal fragmentation
//! below `min_slot` bytes), and the largest free block holds at least
//! `free_units / (live_slots + 1)` units, so a slot of `n` units is granted whenever
//! `free_units >= (live_slots + 1) * n`. Both operations cost O(log blocks) (two ordered maps).
//! A binary buddy allocator, the other usual choice, starts every slot on an aligned power of
//! two; under the mix of `benches/pool.rs` it refused requests with the pool 64-71% full (the
//! median over the refusals), where this one did at 83-94%.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

/// Why an allocation or a free was refused, in units; [`super::StagingPool`] turns these into
/// [`crate::Error`]s with bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No free block can hold the slot now.
    Full,
    /// The region can never hold the slot.
    TooLarge,
    /// The offset was a slot that is already free.
    DoubleFree { units: u64 },
    /// No slot starts at the offset; `inside` is the live slot that contains it, if one does.
    NotASlot { inside: Option<(u64, u64)> },
}

/// Free blocks (by start and by size), live slots and recently freed slots, all in units.
#[derive(Debug)]
pub(crate) struct Fit {
    units: u64,
    /// Free blocks: start -> units.
    by_start: BTreeMap<u64, u64>,
    /// The same blocks as (units, start), for the best fit.
    by_size: BTreeSet<(u64, u64)>,
    /// Live slots: start -> units.
    live: BTreeMap<u64, u64>,
    /// Slots freed since their space was last handed out: start -> units. Tells a double free
    /// from an offset that never was a slot.
    freed: BTreeMap<u64, u64>,
    live_units: u64,
}

impl Fit {
    /// A region of `units` units (at least 1), all free.
    pub(crate) fn new(units: u64) -> Self {
        debug_assert!(units > 0);
        let mut fit = Fit {
            units,
            by_start: BTreeMap::new(),
            by_size: BTreeSet::new(),
            live: BTreeMap::new(),
            freed: BTreeMap::new(),
            live_units: 0,
        };
        fit.insert_free(0, units);
        fit
    }

    fn insert_free(&mut self, start: u64, units: u64) {
        self.by_start.insert(start, units);
        self.by_size.insert((units, start));
    }

    fn remove_free(&mut self, start: u64, units: u64) {
        self.by_start.remove(&start);
        self.by_size.remove(&(units, start));
    }

    /// The start of a slot of `n >= 1` units: the front of the smallest free block that holds
    /// it.
    pub(crate) fn alloc(&mut self, n: u64) -> Result<u64, Refusal> {
        if n > self.units {
            return Err(Refusal::TooLarge);
        }
        let Some(&(units, start)) = self.by_size.range((n, 0)..).next() else {
            return Err(Refusal::Full);
        };
        self.remove_free(start, units);
        if units > n {
            self.insert_free(start + n, units - n);
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

    /// Frees the slot that starts at `start`; returns its units.
    pub(crate) fn free(&mut self, start: u64) -> Result<u64, Refusal> {
        let Some(n) = self.live.remove(&start) else {
            if let Some(&units) = self.freed.get(&start) {
                return Err(Refusal::DoubleFree { units });
            }
            return Err(Refusal::NotASlot {
                inside: self.slot_holding(start),
            });
        };
        let (mut first, mut units) = (start, n);
        if let Some((&before, &size)) = self.by_start.range(..start).next_back()
            && before + size == start
        {
            self.remove_free(before, size);
            first = before;
            units += size;
        }
        if let Some(&size) = self.by_start.get(&(start + n)) {
            self.remove_free(start + n, size);
            units += size;
        }
        self.insert_free(first, units);
        self.freed.insert(start, n);
        self.live_units -= n;
        Ok(n)
    }

    /// The live slot that contains `unit`, as (start, units).
    pub(crate) fn slot_holding(&self, unit: u64) -> Option<(u64, u64)> {
        self.live
            .range(..=unit)
            .next_back()
            .filter(|&(&s, &len)| unit < s + len)
            .map(|(&s, &len)| (s, len))
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
        self.by_size.last().map_or(0, |&(units, _)| units)
    }

    /// Free blocks.
    pub(crate) fn free_blocks(&self) -> usize {
        self.by_start.len()
    }

    /// The live slots, lowest first: (start, units).
    pub(crate) fn slots(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.live.iter().map(|(&s, &n)| (s, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit is in exactly one free block or one live slot, the two indexes agree, and no
    /// two free blocks touch.
    fn check(fit: &Fit) {
        let mut owner = vec![0u8; fit.units as usize];
        assert_eq!(fit.by_start.len(), fit.by_size.len());
        let mut previous_end = None;
        for (&start, &units) in &fit.by_start {
            assert!(fit.by_size.contains(&(units, start)));
            assert!(units > 0 && start + units <= fit.units);
            assert_ne!(previous_end, Some(start), "free blocks touching at {start}");
            previous_end = Some(start + units);
            for unit in start..start + units {
                owner[unit as usize] = 1;
            }
        }
        for (start, units) in fit.slots() {
            for unit in start..start + units {
                assert_eq!(owner[unit as usize], 0, "unit {unit} both live and free");
                owner[unit as usize] = 2;
            }
        }
        assert!(owner.iter().all(|&o| o != 0), "a unit is lost");
        assert_eq!(fit.slots().map(|(_, n)| n).sum::<u64>(), fit.live_units());
        assert!(fit.free_blocks() <= fit.live_slots() + 1);
    }

    #[test]
    fn every_unit_can_be_handed_out_and_freeing_restores_one_block() {
        for units in [1, 2, 3, 7, 64, 100] {
            let mut fit = Fit::new(units);
            let starts: Vec<u64> = (0..units).map(|_| fit.alloc(1).unwrap()).collect();
            assert_eq!(fit.alloc(1), Err(Refusal::Full));
            check(&fit);
            for (i, start) in starts.into_iter().enumerate() {
                fit.free(start).unwrap();
                if i % 7 == 0 {
                    check(&fit);
                }
            }
            check(&fit);
            assert_eq!((fit.largest_free(), fit.free_blocks()), (units, 1));
        }
    }

    #[test]
    fn the_smallest_block_that_fits_is_used_from_its_front() {
        let mut fit = Fit::new(100);
        let a = fit.alloc(10).unwrap();
        let b = fit.alloc(5).unwrap();
        let c = fit.alloc(20).unwrap();
        let d = fit.alloc(3).unwrap();
        assert_eq!((a, b, c, d), (0, 10, 15, 35));
        fit.free(a).unwrap(); // a hole of 10 at 0
        fit.free(c).unwrap(); // a hole of 20 at 15 (b stays between)
        assert_eq!(fit.alloc(8), Ok(0), "the 10-unit hole is the best fit");
        assert_eq!(
            fit.alloc(12),
            Ok(15),
            "the 20-unit hole: the 2 left at 8 are too small"
        );
        assert_eq!(fit.alloc(62), Ok(38), "the tail");
        assert_eq!(fit.alloc(9), Err(Refusal::Full));
        assert_eq!(fit.alloc(101), Err(Refusal::TooLarge));
        check(&fit);
    }

    #[test]
    fn misuse_is_told_apart() {
        let mut fit = Fit::new(32);
        let a = fit.alloc(5).unwrap();
        let b = fit.alloc(3).unwrap();
        assert_eq!(
            fit.free(a + 1),
            Err(Refusal::NotASlot {
                inside: Some((a, 5))
            })
        );
        assert_eq!(fit.free(30), Err(Refusal::NotASlot { inside: None }));
        fit.free(b).unwrap();
        assert_eq!(fit.free(b), Err(Refusal::DoubleFree { units: 3 }));
        // Once the space is handed out again, the old record no longer claims it.
        let c = fit.alloc(8).unwrap();
        assert_eq!(c, b);
        assert_eq!(fit.free(b), Ok(8));
        check(&fit);
    }

    #[test]
    fn the_fragmentation_bound_holds_under_a_random_mix() {
        // A slot of n units must be granted whenever free_units >= (live_slots + 1) * n.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let units = 1000;
        let mut fit = Fit::new(units);
        let mut live: Vec<u64> = Vec::new();
        for round in 0..20_000 {
            if !live.is_empty() && next() % 3 == 0 {
                let at = (next() % live.len() as u64) as usize;
                fit.free(live.swap_remove(at)).unwrap();
                continue;
            }
            let n = 1 + next() % 70;
            let free = units - fit.live_units();
            match fit.alloc(n) {
                Ok(start) => live.push(start),
                Err(refusal) => assert!(
                    free < (fit.live_slots() as u64 + 1) * n,
                    "{refusal:?} for {n} units with {free} free in {} slots",
                    fit.live_slots()
                ),
            }
            if round % 1000 == 0 {
                check(&fit);
            }
        }
        check(&fit);
    }
}
