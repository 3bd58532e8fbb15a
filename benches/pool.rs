//! The staging pool's fragmentation under a realistic mix of requests, against a binary buddy
//! allocator on the same mix, and its alloc/free rate with one and four threads
//! (`cargo bench --bench pool`). Prints Markdown tables; the numbers are ratios and rates of
//! this one run (BENCHMARKS.md records them).
//!
//! The mix: requests of 256 to 32768 tokens (log-uniform, as prompt lengths spread), 16 buffers
//! (8 layers, K and V), slices of 256, 512 or 1024 bytes per token: 1 MiB to 512 MiB. Requests
//! arrive until one does not fit, then one or two live ones, chosen at random, finish; so the
//! pool runs at the edge of full, which is where fragmentation shows. At each refusal the table
//! records how full the pool was, and whether the free bytes would have held the request as one
//! block (a refusal caused by fragmentation rather than by a full pool).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use mori_tp::pool::{MemoryReport, PoolMemory, PoolMemoryKind, StagingPool};

/// A binary buddy allocator in units, with slots trimmed to the units they need (the tail of
/// each power-of-two block goes back at once): the design the pool did not take, for comparison.
struct Buddy {
    units: u64,
    free: Vec<std::collections::BTreeSet<u64>>,
    live: std::collections::HashMap<u64, u64>,
}

impl Buddy {
    fn new(units: u64) -> Self {
        let orders = (u64::BITS - units.leading_zeros()) as usize;
        let mut buddy = Buddy {
            units,
            free: vec![Default::default(); orders],
            live: Default::default(),
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

    fn release_range(&mut self, mut at: u64, end: u64) {
        while at < end {
            let aligned = if at == 0 {
                u64::MAX
            } else {
                1 << at.trailing_zeros()
            };
            let size = aligned.min(1 << (63 - (end - at).leading_zeros()));
            let (mut start, mut order) = (at, size.trailing_zeros() as usize);
            while order + 1 < self.free.len() {
                let partner = start ^ (1 << order);
                if partner + (1 << order) > self.units || !self.free[order].remove(&partner) {
                    break;
                }
                start = start.min(partner);
                order += 1;
            }
            self.free[order].insert(start);
            at += size;
        }
    }

    fn alloc(&mut self, n: u64) -> Option<u64> {
        let order = (u64::BITS - (n - 1).leading_zeros()) as usize;
        let mut have = (order..self.free.len()).find(|&j| !self.free[j].is_empty())?;
        let start = self.free[have].pop_first()?;
        while have > order {
            have -= 1;
            self.free[have].insert(start + (1 << have));
        }
        self.release_range(start + n, start + (1 << order));
        self.live.insert(start, n);
        Some(start)
    }

    fn free(&mut self, start: u64) {
        let n = self.live.remove(&start).expect("a live slot");
        self.release_range(start, start + n);
    }
}

/// Address space without memory: the allocator never touches its region.
struct Unbacked(u64);

impl PoolMemory for Unbacked {
    fn base(&self) -> *mut u8 {
        std::ptr::NonNull::dangling().as_ptr()
    }

    fn size(&self) -> u64 {
        self.0
    }

    fn report(&self) -> MemoryReport {
        MemoryReport {
            kind: PoolMemoryKind::Host,
            locked: false,
            lock_errno: 0,
            huge_pages: false,
        }
    }
}

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Bytes of one request of the mix.
fn request_bytes(rng: &mut Rng) -> u64 {
    let tokens = (256f64 * 128f64.powf(rng.unit())) as u64;
    let width = [256, 512, 1024][(rng.next() % 3) as usize];
    tokens * 16 * width
}

#[derive(Default)]
struct Mix {
    refusals: u64,
    fragmentation_refusals: u64,
    full_at_refusal: Vec<f64>,
    requested: u64,
    granted: u64,
    grants: u64,
}

impl Mix {
    fn quantile(&mut self, q: f64) -> f64 {
        self.full_at_refusal.sort_by(f64::total_cmp);
        self.full_at_refusal[((self.full_at_refusal.len() - 1) as f64 * q) as usize]
    }
}

/// Runs the mix on an allocator given as (alloc units -> start, free start), in units.
fn mix(
    units: u64,
    operations: usize,
    seed: u64,
    unit: u64,
    mut alloc: impl FnMut(u64) -> Option<u64>,
    mut free: impl FnMut(u64),
) -> Mix {
    let mut rng = Rng(seed);
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut used = 0;
    let mut out = Mix::default();
    for _ in 0..operations {
        let size = request_bytes(&mut rng);
        let n = size.div_ceil(unit);
        if let Some(start) = alloc(n) {
            out.requested += size;
            out.granted += n * unit;
            out.grants += 1;
            used += n;
            live.push((start, n));
            continue;
        }
        out.refusals += 1;
        out.full_at_refusal.push(used as f64 / units as f64);
        if units - used >= n {
            out.fragmentation_refusals += 1;
        }
        // Requests finish in any order: one or two at random.
        for _ in 0..1 + rng.next() % 2 {
            if live.is_empty() {
                break;
            }
            let (start, n) = live.swap_remove((rng.next() % live.len() as u64) as usize);
            used -= n;
            free(start);
        }
    }
    out
}

fn rate(threads: usize, per_thread: usize) -> f64 {
    let pool = Arc::new(StagingPool::new(Unbacked(1 << 30), 64 << 10).unwrap());
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 + t as u64);
                for _ in 0..per_thread {
                    let size = (64 << 10) * (1 + rng.next() % 64);
                    let slot = pool.alloc(size, Duration::from_secs(60)).unwrap();
                    pool.free(slot.offset).unwrap();
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    (threads * per_thread) as f64 / start.elapsed().as_secs_f64()
}

/// Arrivals per row of the fragmentation table, and alloc/free pairs per rate measurement:
/// `--quick` (benches/regenerate's check that the command works) takes a tenth.
fn sizes() -> (usize, usize) {
    if std::env::args().any(|a| a == "--quick") {
        (10_000, 20_000)
    } else {
        (100_000, 200_000)
    }
}

fn main() {
    const UNIT: u64 = 64 << 10;
    let (arrivals, pairs) = sizes();
    // benches/regenerate pastes what follows this line into BENCHMARKS.md.
    println!("== results ==\n");
    println!(
        "Fragmentation under the mix ({arrivals} arrivals per row, 64 KiB units; \"refused while \
         free\": refusals where the free bytes would have held the request):\n"
    );
    println!(
        "| pool | allocator | grants | refusals | refused while free | pool full at a refusal: median / 10th percentile | granted / requested bytes |"
    );
    println!("|---|---|---:|---:|---:|---|---:|");
    for capacity in [1u64 << 30, 4 << 30, 16 << 30] {
        let units = capacity / UNIT;
        let pool = StagingPool::new(Unbacked(capacity), UNIT).expect("a valid shape");
        let best_fit = mix(
            units,
            arrivals,
            0x5EED,
            UNIT,
            |n| pool.try_alloc(n * UNIT).ok().map(|slot| slot.offset / UNIT),
            |start| {
                pool.free(start * UNIT).expect("a live slot");
            },
        );
        let buddy = std::cell::RefCell::new(Buddy::new(units));
        let buddy = mix(
            units,
            arrivals,
            0x5EED,
            UNIT,
            |n| buddy.borrow_mut().alloc(n),
            |start| buddy.borrow_mut().free(start),
        );
        for (name, mut m) in [("mori-tp (best fit)", best_fit), ("buddy", buddy)] {
            let (median, low) = (m.quantile(0.5), m.quantile(0.1));
            println!(
                "| {} GiB | {name} | {} | {} | {:.0}% | {:.2} / {:.2} | {:.4} |",
                capacity >> 30,
                m.grants,
                m.refusals,
                100.0 * m.fragmentation_refusals as f64 / m.refusals.max(1) as f64,
                median,
                low,
                m.granted as f64 / m.requested as f64
            );
        }
    }
    println!(
        "\nalloc + free pairs (slots of 64 KiB to 4 MiB, 1 GiB pool, one mutex; {pairs} pairs \
         per row):\n"
    );
    println!("| threads | million pairs/s |");
    println!("|---:|---:|");
    for threads in [1, 4] {
        println!(
            "| {threads} | {:.2} |",
            rate(threads, pairs / threads) / 1e6
        );
    }
}
