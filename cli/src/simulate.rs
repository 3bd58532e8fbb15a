//! `mori-tp simulate`: one request of a deployment, moved in host memory through the library's
//! Rust API (`slice_config`, `Plan`, `send_host`, or the HIP engine), then every decode byte
//! checked.
//!
//! Every prefill rank's buffers are filled with bytes that identify (buffer, page, token, head,
//! byte): each 8-byte word is a bijective hash of its unique coordinates, so a copy from the wrong
//! head, page, token, layer or offset cannot go unnoticed. Decode buffers start as a sentinel.

use std::time::{Duration, Instant};

use mori_tp::backend::open_engine;
use mori_tp::{
    Action, Backend, CopyEngine, KvBuffers, Plan, SendOptions, SendReport, SliceConfig, send,
    send_host,
};
use mori_tp_testkit::{Request, RunLengths, fragmented_request, mix};

use crate::layout::{Layout, grouped, heads_text, human_bytes, labelled};

/// What every decode byte holds before the transfer.
pub const SENTINEL: u8 = 0xEE;

/// Host memory a simulation may allocate before it refuses.
const MEMORY_LIMIT: u64 = 4 << 30;

/// The copy backend `simulate` moves the bytes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// CPU copies (the library's host engine)
    Host,
    /// hipMemcpy2DAsync on the null stream (the buffers stay in host memory)
    Hip,
}

/// The knobs of a simulation.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Tokens in the request (rounded up to whole pages).
    pub tokens: u32,
    /// Layers simulated at most: every layer moves the same way, so more only cost memory.
    pub layers_limit: u32,
    /// Seed of the page layout and the data.
    pub seed: u64,
    /// Probability that a page starts a new run (0: one contiguous run, 1: no adjacent pages).
    pub fragmentation: f64,
    /// How the bytes move.
    pub backend: BackendArg,
}

/// The bytes every prefill rank holds: each 8-byte word of a head is `mix(seed ^ key)` where
/// `key` numbers (buffer, page, token, head, word) uniquely, so every word in the deployment is
/// distinct and names where it belongs.
#[derive(Clone, Copy, Debug)]
struct Pattern {
    seed: u64,
    pages: u64,
    page_size: u64,
    heads: u64,
    words_per_head: u64,
}

impl Pattern {
    /// Writes the bytes of `head` of `token` of `page` of `buffer` into `out`.
    fn head(&self, buffer: usize, page: u64, token: u64, head: u32, out: &mut [u8]) {
        let key = (((buffer as u64 * self.pages + page) * self.page_size + token) * self.heads
            + u64::from(head))
            * self.words_per_head;
        for (word, chunk) in out.chunks_mut(8).enumerate() {
            let value = mix(self.seed ^ (key + word as u64)).to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    }
}

/// What the sends did.
#[derive(Clone, Debug, Default)]
pub struct SendStats {
    /// (decode rank, prefill rank, first head, heads) of every sending pair.
    pub senders: Vec<(u32, u32, u32, u32)>,
    /// Pairs the library marked as replicas (nothing to send).
    pub replicas_skipped: u32,
    /// Strided 2D copies issued: rects of each pair's plan times buffers.
    pub copies: u64,
    /// Copies a planner issuing one per token per pair per buffer would need.
    pub per_token_copies: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Time spent inside the library's send.
    pub elapsed: Duration,
}

/// What the check of every decode byte found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verification {
    /// Decode bytes compared.
    pub bytes_checked: u64,
    /// Bytes that were not what they should be.
    pub bytes_wrong: u64,
    /// The first few wrong places, described.
    pub first_wrong: Vec<String>,
    /// Bytes of requested pages the decode ranks own (each must be written once).
    pub bytes_owned: u64,
}

/// A deployment's buffers in host memory.
pub struct Simulation<'a> {
    layout: &'a Layout,
    /// Layers simulated.
    pub layers: u32,
    pub request: Request,
    pattern: Pattern,
    /// `src[p][b]`: buffer `b` of prefill rank `p` (K of each layer, then V of each layer).
    src: Vec<Vec<Vec<u8>>>,
    /// `dst[d][b]`: buffer `b` of decode rank `d`.
    dst: Vec<Vec<Vec<u8>>>,
    /// The HIP engine, when `--backend hip` asked for it; host copies need none.
    engine: Option<Box<dyn CopyEngine>>,
}

impl<'a> Simulation<'a> {
    /// Allocates and fills every rank's buffers, or says why it would take too much memory.
    pub fn new(layout: &'a Layout, options: &Options) -> Result<Self, SimError> {
        let page_size = u64::from(layout.page_size);
        let pages = u64::from(options.tokens).div_ceil(page_size);
        let pages = usize::try_from(pages).expect("at most 2^32 pages");
        let layers = layout.model.layers.min(options.layers_limit);
        let buffers = layout.buffers(layers);
        // The request's page counts bound the capacities: each run adds at most 2 free pages.
        let worst_pages = 3 * pages as u128 + 3;
        let memory = u128::from(buffers)
            * worst_pages
            * (u128::from(layout.prefill_tp()) * u128::from(layout.src_item_len)
                + u128::from(layout.decode_tp()) * u128::from(layout.dst_item_len));
        if memory > u128::from(MEMORY_LIMIT) || worst_pages > i32::MAX as u128 {
            return Err(SimError::TooLarge(format!(
                "simulating {} tokens over {layers} layers of {} prefill and {} decode ranks could \
                 need up to {} of host memory (limit {}); lower --tokens or --layers-limit",
                options.tokens,
                layout.prefill_tp(),
                layout.decode_tp(),
                human_bytes(u64::try_from(memory).unwrap_or(u64::MAX)),
                human_bytes(MEMORY_LIMIT),
            )));
        }
        // Before allocating: a backend that cannot run here is refused at once.
        let engine = match options.backend {
            BackendArg::Host => None,
            BackendArg::Hip => Some(
                open_engine(&SendOptions {
                    backend: Backend::Hip,
                    synchronize: true,
                    stream: std::ptr::null_mut(),
                })
                .map_err(|e| SimError::Backend(e.to_string()))?,
            ),
        };
        let request = fragmented_request(
            options.seed,
            pages,
            RunLengths::Chance(options.fragmentation),
        );
        let pattern = Pattern {
            seed: mix(options.seed ^ 0x6D6F_7269_2D74_7000),
            pages: request.src_capacity_pages as u64,
            page_size,
            heads: u64::from(layout.model.kv_heads),
            words_per_head: layout.bytes_per_head.div_ceil(8),
        };
        let buffers = buffers as usize;
        let prefill = layout.topology.prefill();
        let bph = layout.bytes_per_head as usize;
        let src = (0..layout.prefill_tp())
            .map(|p| {
                let heads = prefill.owned_heads(p);
                (0..buffers)
                    .map(|b| {
                        let len = request.src_capacity_pages as u64 * layout.src_item_len;
                        let mut buffer = vec![0u8; len as usize];
                        // Token-major pages: the token slots follow each other, heads inside.
                        let tokens = buffer.chunks_exact_mut(heads.len() * bph);
                        for (slot, token) in tokens.enumerate() {
                            let (page, t) = (slot as u64 / page_size, slot as u64 % page_size);
                            for (head, bytes) in heads.clone().zip(token.chunks_exact_mut(bph)) {
                                pattern.head(b, page, t, head, bytes);
                            }
                        }
                        buffer
                    })
                    .collect()
            })
            .collect();
        let dst_len = (request.dst_capacity_pages as u64 * layout.dst_item_len) as usize;
        let dst = (0..layout.decode_tp())
            .map(|_| vec![vec![SENTINEL; dst_len]; buffers])
            .collect();
        Ok(Simulation {
            layout,
            layers,
            request,
            pattern,
            src,
            dst,
            engine,
        })
    }

    /// Buffers per rank.
    pub fn buffers(&self) -> usize {
        self.src.first().map_or(0, Vec::len)
    }

    /// Host memory held by all ranks' buffers.
    pub fn memory(&self) -> u64 {
        let total = |ranks: &[Vec<Vec<u8>>]| -> u64 {
            ranks.iter().flatten().map(|b| b.len() as u64).sum()
        };
        total(&self.src) + total(&self.dst)
    }

    /// Sends one pair's slice of every buffer with the chosen backend, following the plan the
    /// library makes of `config` and the request; returns what moved and the time it took.
    pub fn send_pair(
        &mut self,
        p: u32,
        d: u32,
        config: &SliceConfig,
    ) -> mori_tp::Result<(SendReport, Duration)> {
        let r = &self.request;
        let plan = Plan::new(config, &r.src_pages, &r.dst_pages)?;
        let src: Vec<&[u8]> = self.src[p as usize].iter().map(Vec::as_slice).collect();
        let mut dst: Vec<&mut [u8]> = self.dst[d as usize]
            .iter_mut()
            .map(Vec::as_mut_slice)
            .collect();
        let start = Instant::now();
        let report = match &mut self.engine {
            None => send_host(&plan, &src, &mut dst)?,
            Some(engine) => {
                let src_ptrs: Vec<*const u8> = src.iter().map(|b| b.as_ptr()).collect();
                let dst_ptrs: Vec<*mut u8> = dst.iter_mut().map(|b| b.as_mut_ptr()).collect();
                let buffers = KvBuffers {
                    src: &src_ptrs,
                    dst: &dst_ptrs,
                    src_capacity: src[0].len() as u64,
                    dst_capacity: dst[0].len() as u64,
                };
                // SAFETY: every pointer comes from a live buffer of exactly the stated capacity
                // (all of a side's buffers have one length), the decode buffers are borrowed
                // mutably and apart from the prefill ones, and the engine synchronizes before
                // `send` returns, so no copy outlives the borrows.
                unsafe { send(&plan, &buffers, engine.as_mut())? }
            }
        };
        Ok((report, start.elapsed()))
    }

    /// Every pair the library says sends: its slice, its plan, and the copies.
    pub fn send_all(&mut self) -> Result<SendStats, String> {
        let mut stats = SendStats::default();
        let buffers = self.buffers() as u64;
        let tokens = self.request.src_pages.len() as u64 * u64::from(self.layout.page_size);
        for d in 0..self.layout.decode_tp() {
            for p in 0..self.layout.prefill_tp() {
                let failed =
                    |e: mori_tp::Error| format!("prefill rank {p} -> decode rank {d}: {e}");
                let config = self.layout.slice_config(p, d).map_err(failed)?;
                match config.action {
                    Action::Send => {}
                    Action::SkipReplica => {
                        stats.replicas_skipped += 1;
                        continue;
                    }
                    Action::NotPaired => continue,
                }
                let (report, elapsed) = self.send_pair(p, d, &config).map_err(failed)?;
                stats.copies += report.copies as u64;
                stats.per_token_copies += tokens * buffers;
                stats.bytes += report.bytes;
                stats
                    .senders
                    .push((d, p, config.first_head, config.num_heads));
                stats.elapsed += elapsed;
            }
        }
        Ok(stats)
    }

    /// `layer 3 V`: the contract orders buffers K of each layer, then V of each layer.
    fn buffer_name(&self, buffer: usize) -> String {
        let layers = self.layers as usize;
        match (
            self.layout.model.attention.buffers_per_layer(),
            buffer / layers,
        ) {
            (1, _) => format!("layer {buffer} latent"),
            (_, 0) => format!("layer {buffer} K"),
            _ => format!("layer {} V", buffer - layers),
        }
    }

    /// Checks every byte of every decode buffer: the pages of the request hold, for each head
    /// the rank owns, exactly the bytes of the source page paired with it; every other page still
    /// holds the sentinel.
    pub fn verify(&self) -> Verification {
        const SHOWN: usize = 5;
        let layout = self.layout;
        let page_size = u64::from(layout.page_size);
        let item = layout.dst_item_len as usize;
        let bph = layout.bytes_per_head as usize;
        let mut source_of = vec![None; self.request.dst_capacity_pages];
        for (&s, &d) in self.request.src_pages.iter().zip(&self.request.dst_pages) {
            source_of[d as usize] = Some(s as u64);
        }
        let mut v = Verification::default();
        let mut expected = vec![0u8; bph];
        let report = |v: &mut Verification, wrong: u64, place: String| {
            v.bytes_wrong += wrong;
            if v.first_wrong.len() < SHOWN {
                v.first_wrong.push(place);
            }
        };
        for (d, buffers) in self.dst.iter().enumerate() {
            let owned = layout.topology.decode().owned_heads(d as u32);
            for (b, buffer) in buffers.iter().enumerate() {
                v.bytes_checked += buffer.len() as u64;
                for (page, bytes) in buffer.chunks_exact(item).enumerate() {
                    let where_ =
                        || format!("decode rank {d}, {}, page {page}", self.buffer_name(b));
                    let Some(src_page) = source_of[page] else {
                        let wrong = bytes.iter().filter(|&&x| x != SENTINEL).count() as u64;
                        if wrong > 0 {
                            let at = bytes.iter().position(|&x| x != SENTINEL).unwrap_or(0);
                            report(
                                &mut v,
                                wrong,
                                format!(
                                    "{} (not in the request): {wrong} bytes overwritten, the \
                                     first at byte {at} (0x{:02x}, sentinel 0x{SENTINEL:02x})",
                                    where_(),
                                    bytes[at]
                                ),
                            );
                        }
                        continue;
                    };
                    v.bytes_owned += item as u64;
                    let slots = bytes.chunks_exact(item / page_size as usize);
                    for (t, token) in slots.enumerate() {
                        for (head, got) in owned.clone().zip(token.chunks_exact(bph)) {
                            self.pattern
                                .head(b, src_page, t as u64, head, &mut expected);
                            if got == expected.as_slice() {
                                continue;
                            }
                            let wrong = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
                            let at = got.iter().zip(&expected).position(|(a, b)| a != b);
                            let at = at.unwrap_or(0);
                            report(
                                &mut v,
                                wrong as u64,
                                format!(
                                    "{} token {t} head {head} (from prefill page {src_page}): \
                                     {wrong} of {bph} bytes wrong, the first at byte {at} \
                                     (0x{:02x}, expected 0x{:02x})",
                                    where_(),
                                    got[at],
                                    expected[at]
                                ),
                            );
                        }
                    }
                }
            }
        }
        v
    }

    /// A decode buffer, for tests that damage it on purpose.
    #[cfg(test)]
    fn dst_mut(&mut self, d: usize, b: usize) -> &mut Vec<u8> {
        &mut self.dst[d][b]
    }
}

/// A note on what makes a layout interesting, from the library's view of both sides.
fn layout_note(layout: &Layout) -> Option<String> {
    let (prefill, decode) = (layout.topology.prefill(), layout.topology.decode());
    let heads = layout.model.kv_heads;
    if decode.replication() > 1 && prefill.replication() == 1 {
        Some(format!(
            "decode TP {} exceeds the {heads} KV heads while prefill TP {} does not: the layout in \
             which today's stacks send decode ranks the wrong heads",
            decode.tp_size(),
            prefill.tp_size()
        ))
    } else if prefill.replication() > 1 {
        Some(format!(
            "prefill TP {} exceeds the {heads} KV head{}: each head lives on {} prefill ranks, and \
             exactly one of them may send it",
            prefill.tp_size(),
            if heads == 1 { "" } else { "s" },
            prefill.replication()
        ))
    } else {
        None
    }
}

/// Why a simulation could not run to its verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimError {
    /// The request would take too much host memory.
    TooLarge(String),
    /// The requested backend cannot run here (the library's message).
    Backend(String),
    /// A library call failed.
    Library(String),
}

/// Runs the whole simulation and returns its report, and whether every byte was right.
pub fn run(layout: &Layout, options: &Options) -> Result<(String, bool), SimError> {
    let mut sim = Simulation::new(layout, options)?;
    let stats = sim.send_all().map_err(SimError::Library)?;
    let v = sim.verify();
    let r = &sim.request;
    let pages = r.src_pages.len() as u64;
    let tokens = pages * u64::from(layout.page_size);

    let plural =
        |n: u64, word: &str| format!("{} {word}{}", grouped(n), if n == 1 { "" } else { "s" });
    let mut out = format!(
        "Simulating one request of {} from prefill TP {} to decode TP {}, in host memory\n",
        layout.model.name,
        layout.prefill_tp(),
        layout.decode_tp()
    );
    out += &crate::plan::header(layout);
    if let Some(note) = layout_note(layout) {
        out += &labelled("note:", &note);
    }
    out += &labelled(
        "request:",
        &format!(
            "{} on {} in {} of adjacent pages (fragmentation {}, seed {})",
            plural(tokens, "token"),
            plural(pages, "page"),
            plural(r.runs() as u64, "run"),
            options.fragmentation,
            options.seed,
        ),
    );
    out += &labelled(
        "memory:",
        &format!(
            "{} of {} layers (--layers-limit {}): {} buffers per rank on {} prefill + {} decode \
             ranks, {}",
            sim.layers,
            layout.model.layers,
            options.layers_limit,
            sim.buffers(),
            layout.prefill_tp(),
            layout.decode_tp(),
            human_bytes(sim.memory()),
        ),
    );
    if stats.senders.len() <= 16 {
        let senders: Vec<String> = stats
            .senders
            .iter()
            .map(|&(d, p, first, n)| format!("d{d}<-p{p} {}", heads_text(first..first + n)))
            .collect();
        out += &labelled(
            "senders:",
            &format!("(decode <- prefill rank) {}", senders.join(", ")),
        );
    }
    out += &labelled(
        "sent:",
        &format!(
            "{} with {}; {} skipped as replicas",
            plural(stats.senders.len() as u64, "pair"),
            match options.backend {
                BackendArg::Host => "the library's host engine (send_host)",
                BackendArg::Hip => "the library's HIP engine (hipMemcpy2DAsync, host buffers)",
            },
            plural(u64::from(stats.replicas_skipped), "pair"),
        ),
    );
    out += &labelled(
        "copies:",
        &format!(
            "{} strided 2D copies; a per-token plan would issue {} ({:.1}x more)",
            grouped(stats.copies),
            grouped(stats.per_token_copies),
            stats.per_token_copies as f64 / stats.copies.max(1) as f64,
        ),
    );
    let secs = stats.elapsed.as_secs_f64();
    out += &labelled(
        "moved:",
        &format!(
            "{} in {:.1} ms ({:.2} GB/s)",
            human_bytes(stats.bytes),
            secs * 1e3,
            if secs > 0.0 {
                stats.bytes as f64 / secs / 1e9
            } else {
                0.0
            },
        ),
    );
    let once = stats.bytes == v.bytes_owned;
    let ok = v.bytes_wrong == 0 && once;
    if ok {
        out += &labelled(
            "verified:",
            &format!(
                "all {} decode bytes. Each decode rank's requested pages hold exactly the source \
                 bytes of the heads it owns, every other byte still holds the sentinel, and bytes \
                 moved = bytes owned, so no head was sent twice.",
                grouped(v.bytes_checked),
            ),
        );
        out += "OK\n";
    } else {
        out += &format!(
            "MISMATCH: {} of {} decode bytes wrong\n",
            grouped(v.bytes_wrong),
            grouped(v.bytes_checked)
        );
        for place in &v.first_wrong {
            out += &format!("  {place}\n");
        }
        if !once {
            out += &format!(
                "  {} bytes moved, but the decode ranks own {} bytes of the requested pages\n",
                grouped(stats.bytes),
                grouped(v.bytes_owned)
            );
        }
    }
    Ok((out, ok))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Dtype, preset_by_name};

    fn layout(model: &str, page_size: u32, prefill: u32, decode: u32) -> Layout {
        let model = preset_by_name(model).expect("a preset").into();
        Layout::new(model, Dtype::Fp8, page_size, prefill, decode).expect("a valid layout")
    }

    fn options() -> Options {
        Options {
            tokens: 40,
            layers_limit: 2,
            seed: 7,
            fragmentation: 0.3,
            backend: BackendArg::Host,
        }
    }

    #[test]
    fn a_correct_transfer_verifies_and_moves_each_owned_byte_once() {
        let l = layout("qwen2.5-7b", 4, 2, 8);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        let stats = sim.send_all().unwrap();
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 0, "{:?}", v.first_wrong);
        assert_eq!(stats.bytes, v.bytes_owned);
        assert!(v.bytes_owned > 0);
    }

    #[test]
    fn one_damaged_byte_is_found_and_located() {
        let l = layout("llama-3.1-8b", 2, 16, 4);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all().unwrap();
        let page = sim.request.dst_pages[5] as usize;
        let offset = page * l.dst_item_len as usize + 3;
        sim.dst_mut(1, 2)[offset] ^= 0x40;
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 1);
        assert!(
            v.first_wrong[0].starts_with(&format!("decode rank 1, layer 0 V, page {page} token 0")),
            "{:?}",
            v.first_wrong
        );
    }

    #[test]
    fn a_write_outside_the_request_is_found() {
        let l = layout("qwen2.5-7b", 1, 4, 4);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all().unwrap();
        let free = (0..sim.request.dst_capacity_pages as i32)
            .find(|p| !sim.request.dst_pages.contains(p))
            .expect("a free page between runs") as usize;
        sim.dst_mut(0, 0)[free * l.dst_item_len as usize] = 0;
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 1);
        assert!(v.first_wrong[0].contains("not in the request"));
    }

    #[test]
    fn sending_a_rank_another_ranks_head_is_caught() {
        // Decode TP 8 over 4 heads: ranks 0-1 own head 0, ranks 2-3 head 1. Sending decode rank 2
        // the slice meant for decode rank 0 delivers head 0 where head 1 belongs, the very bug
        // of today's stacks; the data names the head, so the check fails.
        let l = layout("qwen2.5-7b", 4, 2, 8);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all().unwrap();
        let wrong = l.slice_config(0, 0).unwrap();
        sim.send_pair(0, 2, &wrong).unwrap();
        let v = sim.verify();
        assert!(v.bytes_wrong > 0);
        assert!(
            v.first_wrong[0].contains("decode rank 2"),
            "{:?}",
            v.first_wrong
        );
        assert!(v.first_wrong[0].contains("head 1"), "{:?}", v.first_wrong);
    }

    #[test]
    fn a_missing_sender_is_caught() {
        let l = layout("deepseek-v3", 1, 4, 2);
        let sim = Simulation::new(&l, &options()).unwrap();
        // Nothing sent: every owned byte still holds the sentinel.
        let v = sim.verify();
        assert!(v.bytes_wrong > 0);
        assert!(
            v.first_wrong[0].contains("layer 0 latent"),
            "{:?}",
            v.first_wrong
        );
    }

    #[test]
    fn too_much_memory_is_refused_before_allocating() {
        let l = layout("llama-3.1-70b", 16, 8, 8);
        let options = Options {
            tokens: 4_000_000,
            layers_limit: 80,
            ..options()
        };
        let Err(SimError::TooLarge(err)) = Simulation::new(&l, &options) else {
            panic!("not refused for its size");
        };
        assert!(err.contains("--layers-limit"), "{err}");
    }
}
