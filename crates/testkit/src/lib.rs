//! Deterministic inputs shared by mori-tp's tests, benchmarks and the `mori-tp simulate` command:
//! one seeded generator (splitmix64) and one generator of fragmented requests, so that a failure
//! anywhere reproduces from its seed alone and every consumer exercises the same page layouts.
//!
//! The crate knows nothing of mori-tp (it does not depend on it): a request is two page lists and
//! the page counts their buffers need, exactly what a serving engine's page tables hand over.

/// splitmix64's output function: a bijection on `u64` that scatters every input bit, so distinct
/// keys give distinct, unrelated-looking words.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
/// tiny, fast and fully determined by its seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The generator whose whole output follows from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi` (`lo <= hi`); the modulo bias is irrelevant at the sizes used here.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "empty range {lo}..={hi}");
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.next_u64() % span,
            None => self.next_u64(),
        }
    }

    /// Uniform in `[0, 1)`, from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Fisher-Yates: every order equally likely.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.range(0, i as u64) as usize;
            items.swap(i, j);
        }
    }
}

/// A request: page `src_pages[i]` of the prefill side pairs with page `dst_pages[i]` of the decode
/// side, and the page counts each side's buffers need to hold them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub src_pages: Vec<i32>,
    pub dst_pages: Vec<i32>,
    pub src_capacity_pages: usize,
    pub dst_capacity_pages: usize,
}

impl Request {
    /// Maximal runs: stretches of pairs where both page indices go up by one.
    pub fn runs(&self) -> usize {
        let pairs: Vec<(i32, i32)> = self
            .src_pages
            .iter()
            .copied()
            .zip(self.dst_pages.iter().copied())
            .collect();
        let breaks = pairs
            .windows(2)
            .filter(|w| w[1].0 != w[0].0.wrapping_add(1) || w[1].1 != w[0].1.wrapping_add(1))
            .count();
        if pairs.is_empty() { 0 } else { breaks + 1 }
    }
}

/// How a fragmented request splits its pages into runs of adjacent pages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RunLengths {
    /// Each page after the first starts a new run with this probability: 0 gives one run, 1 gives
    /// a run per page, `f` gives runs of `1/f` pages on average.
    Chance(f64),
    /// Runs of 1 to `max` pages, uniformly (the last one cut short to fit).
    UpTo(usize),
}

/// `pages` page pairs split into runs as `lengths` says, laid out on each side in its own
/// shuffled order with one or two free pages between runs, as a paged allocator that has been
/// running for a while hands them out. Runs never touch, so [`Request::runs`] is exactly the
/// number of runs drawn, and every page is used once per side.
pub fn fragmented_request(seed: u64, pages: usize, lengths: RunLengths) -> Request {
    let mut rng = Rng::new(seed);
    let mut runs: Vec<usize> = Vec::new();
    match lengths {
        RunLengths::Chance(chance) => {
            for page in 0..pages {
                match runs.last_mut() {
                    Some(last) if page > 0 && rng.unit() >= chance => *last += 1,
                    _ => runs.push(1),
                }
            }
        }
        RunLengths::UpTo(max) => {
            let mut left = pages;
            while left > 0 {
                let len = (rng.range(1, max.max(1) as u64) as usize).min(left);
                runs.push(len);
                left -= len;
            }
        }
    }
    laid_out(&mut rng, &runs)
}

/// `runs` runs of 1 to `max_run` pages each (uniformly), laid out as [`fragmented_request`]
/// lays them out: for tests that care about the number of runs rather than of pages.
pub fn fragmented_runs(seed: u64, runs: usize, max_run: usize) -> Request {
    let mut rng = Rng::new(seed);
    let lengths: Vec<usize> = (0..runs)
        .map(|_| rng.range(1, max_run.max(1) as u64) as usize)
        .collect();
    laid_out(&mut rng, &lengths)
}

/// The request whose runs have these lengths, each side in its own shuffled order.
fn laid_out(rng: &mut Rng, runs: &[usize]) -> Request {
    let (src_starts, src_capacity_pages) = place(rng, runs);
    let (dst_starts, dst_capacity_pages) = place(rng, runs);
    let expand = |starts: &[usize]| -> Vec<i32> {
        starts
            .iter()
            .zip(runs)
            .flat_map(|(&start, &len)| (start..start + len).map(|page| page as i32))
            .collect()
    };
    Request {
        src_pages: expand(&src_starts),
        dst_pages: expand(&dst_starts),
        src_capacity_pages,
        dst_capacity_pages,
    }
}

/// Places runs in a shuffled order, the first 0 to 2 pages in, one or two free pages after each;
/// returns each run's first page (in the original run order) and the pages needed to hold them.
fn place(rng: &mut Rng, runs: &[usize]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    rng.shuffle(&mut order);
    let mut starts = vec![0; runs.len()];
    let mut next = rng.range(0, 2) as usize;
    for &run in &order {
        starts[run] = next;
        next += runs[run] + rng.range(1, 2) as usize;
    }
    (starts, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // The first outputs of the reference C code (Vigna, prng.di.unimi.it/splitmix64.c) for
        // seed 0, as that code prints them.
        let mut rng = Rng::new(0);
        let expected = [
            0xE220_A839_7B1D_CDAF,
            0x6E78_9E6A_A1B9_65F4,
            0x06C4_5D18_8009_454F,
        ];
        for want in expected {
            assert_eq!(rng.next_u64(), want);
        }
    }

    #[test]
    fn ranges_and_units_stay_inside_their_bounds_and_shuffles_permute() {
        let mut rng = Rng::new(5);
        for _ in 0..1000 {
            assert!((3..=5).contains(&rng.range(3, 5)));
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_eq!(rng.range(7, 7), 7);
        let _ = rng.range(0, u64::MAX);
        let mut items: Vec<u32> = (0..50).collect();
        rng.shuffle(&mut items);
        assert_ne!(items, (0..50).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..50).collect::<Vec<_>>());
    }

    /// Every page used once per side, inside the capacity, in the stated number of runs.
    fn check(r: &Request, pages: usize) {
        assert_eq!(r.src_pages.len(), pages);
        assert_eq!(r.dst_pages.len(), pages);
        for (side, capacity) in [
            (&r.src_pages, r.src_capacity_pages),
            (&r.dst_pages, r.dst_capacity_pages),
        ] {
            let mut sorted = side.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), pages, "a page used twice: {r:?}");
            assert!(sorted.iter().all(|&p| p >= 0 && (p as usize) < capacity));
            // One or two free pages per run at most, plus two before the first.
            assert!(capacity <= pages + 2 * r.runs() + 2, "{r:?}");
        }
    }

    #[test]
    fn chance_zero_is_one_run_and_chance_one_a_run_per_page() {
        for seed in 0..20 {
            let one = fragmented_request(seed, 40, RunLengths::Chance(0.0));
            check(&one, 40);
            assert_eq!(one.runs(), 1);
            let all = fragmented_request(seed, 40, RunLengths::Chance(1.0));
            check(&all, 40);
            assert_eq!(all.runs(), 40);
            let some = fragmented_request(seed, 400, RunLengths::Chance(0.1));
            check(&some, 400);
            assert!((10..=80).contains(&some.runs()), "{}", some.runs());
        }
    }

    #[test]
    fn up_to_draws_runs_no_longer_than_the_maximum() {
        for seed in 0..20 {
            let r = fragmented_request(seed, 100, RunLengths::UpTo(4));
            check(&r, 100);
            assert!(r.runs() >= 25, "runs of at most 4 pages: {}", r.runs());
            let mut run = 1;
            for i in 1..r.src_pages.len() {
                if r.src_pages[i] == r.src_pages[i - 1] + 1 {
                    run += 1;
                    assert!(run <= 4);
                } else {
                    run = 1;
                }
            }
        }
    }

    #[test]
    fn fragmented_runs_draws_exactly_that_many_runs() {
        for seed in 0..20 {
            let r = fragmented_runs(seed, 7, 4);
            assert_eq!(r.runs(), 7);
            let pages = r.src_pages.len();
            assert!((7..=28).contains(&pages), "{pages}");
            check(&r, pages);
        }
        assert_eq!(fragmented_runs(1, 0, 4).runs(), 0);
    }

    #[test]
    fn runs_appear_in_a_different_order_on_each_side() {
        let r = fragmented_request(3, 200, RunLengths::UpTo(4));
        let order = |pages: &[i32]| pages.windows(2).filter(|w| w[1] < w[0]).count();
        assert!(order(&r.src_pages) > 0 && order(&r.dst_pages) > 0, "{r:?}");
        assert_ne!(r.src_pages, r.dst_pages);
    }

    #[test]
    fn the_same_seed_gives_the_same_request_and_an_empty_one_is_empty() {
        let a = fragmented_request(9, 64, RunLengths::Chance(0.3));
        assert_eq!(a, fragmented_request(9, 64, RunLengths::Chance(0.3)));
        assert_ne!(a, fragmented_request(10, 64, RunLengths::Chance(0.3)));
        let empty = fragmented_request(9, 0, RunLengths::UpTo(4));
        assert!(empty.src_pages.is_empty() && empty.runs() == 0);
    }
}
