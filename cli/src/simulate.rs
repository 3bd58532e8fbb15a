//! `mori-tp simulate`: one request of a deployment, moved in host memory through the library's
//! Rust API (`slice_config`, `Plan`, `send_host_with` on the host or the HIP engine), then every
//! decode byte checked.
//!
//! Every prefill rank's buffers are filled with bytes that identify (buffer, page, token, head,
//! byte): each 8-byte word is a bijective hash of its unique coordinates, so a copy from the wrong
//! head, page, token, layer or offset cannot go unnoticed. Decode buffers start as a sentinel.

use std::time::{Duration, Instant};

use mori_tp::backend::open_host_copies;
use mori_tp::{
    Backend, Error, HostCopies, Plan, SendReport, SliceConfig, Staging, pack_host_with,
    plan_transfer, send_host_with, staging_for, staging_len, unpack_host_with,
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
    pub replicas_skipped: u64,
    /// Strided 2D copies issued: rects of each pair's plan times buffers.
    pub copies: u64,
    /// Copies (or RDMA segments) a planner issuing one per token per pair per buffer would need.
    pub per_token_copies: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Time spent inside the library's send.
    pub elapsed: Duration,
    /// Segments an RDMA engine gets for the direct transfer (pages to pages), over all pairs
    /// and buffers.
    pub direct_segments: u64,
    /// Segments an RDMA engine gets with the staging `staging_for` chooses.
    pub staged_segments: u64,
    /// Sending pairs per staging mode, in the order of [`Staging::ALL`].
    pub staging_modes: [u64; 4],
    /// Staging bytes per request over all pairs: each staged side's region.
    pub staging_bytes: u64,
    /// Time spent packing, moving the segments and unpacking.
    pub staged_elapsed: Duration,
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
    /// `dst[d][b]`: buffer `b` of decode rank `d`, written by the direct transfer.
    dst: Vec<Vec<Vec<u8>>>,
    /// The same, written by the staged transfer (pack, segments, unpack).
    dst_staged: Vec<Vec<Vec<u8>>>,
    /// The engine the copies run on: the host engine, or HIP's synchronized per-rect copies.
    engine: Box<dyn HostCopies>,
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
        // Prefill buffers, decode buffers twice (direct and staged), and one pair's staging
        // regions, each at most a page's slot per page and buffer.
        let item = u128::from(layout.src_item_len.max(layout.dst_item_len));
        let memory = u128::from(buffers)
            * worst_pages
            * (u128::from(layout.prefill_tp()) * u128::from(layout.src_item_len)
                + 2 * u128::from(layout.decode_tp()) * u128::from(layout.dst_item_len)
                + 2 * item);
        if memory > u128::from(MEMORY_LIMIT) || worst_pages > i32::MAX as u128 {
            return Err(SimError::TooLarge(format!(
                "simulating {} tokens over {layers} layers of {} prefill and {} decode ranks could \
                 need up to {} of host memory (limit {}); lower --tokens, --layers-limit or the \
                 TP sizes",
                options.tokens,
                layout.prefill_tp(),
                layout.decode_tp(),
                human_bytes(u64::try_from(memory).unwrap_or(u64::MAX)),
                human_bytes(MEMORY_LIMIT),
            )));
        }
        // Before allocating: a backend that cannot run here is refused at once.
        let engine = open_host_copies(match options.backend {
            BackendArg::Host => Backend::Host,
            BackendArg::Hip => Backend::Hip,
        })
        .map_err(|e| match e {
            Error::BackendUnavailable { .. } => SimError::Backend(e.to_string()),
            other => SimError::Library(other.to_string()),
        })?;
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
        let bph = layout.bytes_per_head as usize;
        let src = (0..layout.prefill_tp())
            .map(|p| {
                let heads = layout.prefill_heads(p);
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
        let dst: Vec<Vec<Vec<u8>>> = (0..layout.decode_tp())
            .map(|_| vec![vec![SENTINEL; dst_len]; buffers])
            .collect();
        Ok(Simulation {
            layout,
            layers,
            request,
            pattern,
            src,
            dst_staged: dst.clone(),
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
        total(&self.src) + total(&self.dst) + total(&self.dst_staged)
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
        let report = send_host_with(&plan, &src, &mut dst, self.engine.as_mut())?;
        Ok((report, start.elapsed()))
    }

    /// One pair's staged transfer, as an RDMA connector would run it: the prefill rank packs
    /// (when `staging_for` stages its side), the transport copies every segment of
    /// `plan_transfer` for every buffer (done here in host memory), the decode rank unpacks
    /// (when its side is staged), into the staged decode buffers. Returns the staging, the
    /// segments per buffer and the staging bytes of both sides.
    pub fn stage_pair(
        &mut self,
        p: u32,
        d: u32,
        config: &SliceConfig,
    ) -> Result<(Staging, u64, u64), String> {
        let r = &self.request;
        let buffers = self.src[p as usize].len();
        let staging = staging_for(config).map_err(|e| e.to_string())?;
        let segments = plan_transfer(config, staging, &r.src_pages, &r.dst_pages)
            .map_err(|e| e.to_string())?;
        let len = staging_len(config, r.src_pages.len()).map_err(|e| e.to_string())? as usize;
        let region = |stage: bool, fill: u8| vec![fill; if stage { buffers * len } else { 0 }];
        // A sentinel in the decode region too, so an unpack of bytes never moved would show.
        let mut src_region = region(staging.stages_src(), 0);
        let mut dst_region = region(staging.stages_dst(), SENTINEL);
        let src: Vec<&[u8]> = self.src[p as usize].iter().map(Vec::as_slice).collect();
        let dst = &mut self.dst_staged[d as usize];
        if staging.stages_src() {
            pack_host_with(
                config,
                &src,
                &r.src_pages,
                &mut src_region,
                self.engine.as_mut(),
            )
            .map_err(|e| format!("pack: {e}"))?;
        }
        // The transport: the same segment list on every buffer, from the packed region or the
        // pages, into the decode region or the pages.
        for b in 0..buffers {
            let from: &[u8] = if staging.stages_src() {
                &src_region[b * len..(b + 1) * len]
            } else {
                src[b]
            };
            let to: &mut [u8] = if staging.stages_dst() {
                &mut dst_region[b * len..(b + 1) * len]
            } else {
                &mut dst[b]
            };
            for (i, s) in segments.iter().enumerate() {
                let (from_at, to_at) = (s.src_offset as usize, s.dst_offset as usize);
                let n = s.length as usize;
                let (Some(bytes), true) = (from.get(from_at..from_at + n), to_at + n <= to.len())
                else {
                    return Err(format!(
                        "plan_transfer segment {i} of {} ({s:?}) leaves buffer {b} ({} source, {}                          destination bytes)",
                        segments.len(),
                        from.len(),
                        to.len()
                    ));
                };
                to[to_at..to_at + n].copy_from_slice(bytes);
            }
        }
        if staging.stages_dst() {
            let mut dst_bufs: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
            unpack_host_with(
                config,
                &dst_region,
                &mut dst_bufs,
                &r.dst_pages,
                self.engine.as_mut(),
            )
            .map_err(|e| format!("unpack: {e}"))?;
        }
        let staged_bytes = (src_region.len() + dst_region.len()) as u64;
        Ok((staging, segments.len() as u64, staged_bytes))
    }

    /// Every pair the library says sends, moved twice: directly (its plan's strided copies) into
    /// the decode buffers, and staged (pack, segments, unpack) into the staged decode buffers.
    pub fn send_all(&mut self, tokens: u32) -> Result<SendStats, String> {
        let mut stats = SendStats::default();
        let buffers = self.buffers() as u64;
        let request_tokens = self.request.src_pages.len() as u64 * u64::from(self.layout.page_size);
        let layout = self.layout;
        for rank in crate::plan::decode_ranks(layout, tokens) {
            let rank = rank.map_err(|e| e.to_string())?;
            for pair in &rank.pairs {
                let (p, d, config) = (pair.prefill_rank, pair.decode_rank, &pair.config);
                if !pair.sends() {
                    stats.replicas_skipped += 1;
                    continue;
                }
                let failed = |e: String| format!("prefill rank {p} -> decode rank {d}: {e}");
                let (report, elapsed) = self
                    .send_pair(p, d, config)
                    .map_err(|e| failed(e.to_string()))?;
                stats.copies += report.copies as u64;
                stats.per_token_copies += request_tokens * buffers;
                stats.bytes += report.bytes;
                stats
                    .senders
                    .push((d, p, config.first_head, config.num_heads));
                stats.elapsed += elapsed;
                let r = &self.request;
                let direct = Plan::new(config, &r.src_pages, &r.dst_pages)
                    .and_then(|plan| plan.num_segments())
                    .map_err(|e| failed(e.to_string()))?;
                stats.direct_segments += direct as u64 * buffers;

                let start = Instant::now();
                let (staging, segments, staged_bytes) =
                    self.stage_pair(p, d, config).map_err(failed)?;
                stats.staged_elapsed += start.elapsed();
                stats.staged_segments += segments * buffers;
                stats.staging_bytes += staged_bytes;
                let mode = Staging::ALL.iter().position(|&m| m == staging);
                stats.staging_modes[mode.expect("one of the modes")] += 1;
            }
        }
        Ok(stats)
    }

    /// `layer 3 V`: buffers are K of each layer, then V of each layer (the header's order).
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

    /// Checks every byte of every decode buffer the direct transfer wrote.
    pub fn verify(&self) -> Verification {
        self.verify_buffers(&self.dst)
    }

    /// Checks every byte of every decode buffer the staged transfer wrote.
    pub fn verify_staged(&self) -> Verification {
        self.verify_buffers(&self.dst_staged)
    }

    /// Checks every byte of every decode buffer: the pages of the request hold, for each head
    /// the rank owns, exactly the bytes of the source page paired with it; every other page still
    /// holds the sentinel.
    fn verify_buffers(&self, dst: &[Vec<Vec<u8>>]) -> Verification {
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
        for (d, buffers) in dst.iter().enumerate() {
            let owned = layout.decode_heads(d as u32);
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

    /// A decode buffer of the staged transfer, for tests that damage it on purpose.
    #[cfg(test)]
    fn dst_staged_mut(&mut self, d: usize, b: usize) -> &mut Vec<u8> {
        &mut self.dst_staged[d][b]
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

/// A staging mode in words: who packs and who unpacks.
pub fn staging_words(staging: Staging) -> &'static str {
    match staging {
        Staging::None => "no staging (pages to pages)",
        Staging::Src => "src staging (prefill packs)",
        Staging::Dst => "dst staging (decode unpacks)",
        Staging::Both => "both sides staged (prefill packs, decode unpacks)",
    }
}

/// Runs the whole simulation and returns its report, and whether every byte was right.
pub fn run(layout: &Layout, options: &Options) -> Result<(String, bool), SimError> {
    let mut sim = Simulation::new(layout, options)?;
    let stats = sim.send_all(options.tokens).map_err(SimError::Library)?;
    let v = sim.verify();
    let staged = sim.verify_staged();
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
            plural(stats.replicas_skipped, "pair"),
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
    out += &labelled(
        "segments:",
        &format!(
            "an RDMA engine (MORI-IO, Mooncake, NIXL) would get {} per-token segments, {} direct \
             (mori_tp_plan_segments: pages to pages), {} staged (mori_tp_plan_transfer with \
             staging_for's choice)",
            grouped(stats.per_token_copies),
            grouped(stats.direct_segments),
            grouped(stats.staged_segments),
        ),
    );
    let modes: Vec<String> = Staging::ALL
        .iter()
        .zip(stats.staging_modes)
        .filter(|&(_, n)| n > 0)
        .map(|(&mode, n)| format!("{} on {}", staging_words(mode), plural(n, "pair")))
        .collect();
    out += &labelled(
        "staging:",
        &format!(
            "{}; {} of staging per request; pack, segments and unpack took {:.1} ms",
            modes.join(", "),
            human_bytes(stats.staging_bytes),
            stats.staged_elapsed.as_secs_f64() * 1e3,
        ),
    );
    let once = stats.bytes == v.bytes_owned;
    let ok = v.bytes_wrong == 0 && once && staged.bytes_wrong == 0;
    if ok {
        out += &labelled(
            "verified:",
            &format!(
                "all {} decode bytes, twice: after the direct copies and after the staged path \
                 (pack, segments, unpack). Each decode rank's requested pages hold exactly the \
                 source bytes of the heads it owns, every other byte still holds the sentinel, \
                 and bytes moved = bytes owned, so no head was sent twice.",
                grouped(v.bytes_checked),
            ),
        );
        out += "OK\n";
    } else {
        for (path, v) in [("direct", &v), ("staged", &staged)] {
            if v.bytes_wrong == 0 {
                continue;
            }
            out += &format!(
                "MISMATCH ({path}): {} of {} decode bytes wrong\n",
                grouped(v.bytes_wrong),
                grouped(v.bytes_checked)
            );
            for place in &v.first_wrong {
                out += &format!("  {place}\n");
            }
        }
        if !once {
            out += &format!(
                "MISMATCH: {} bytes moved, but the decode ranks own {} bytes of the requested \
                 pages\n",
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
        let stats = sim.send_all(options().tokens).unwrap();
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 0, "{:?}", v.first_wrong);
        assert_eq!(stats.bytes, v.bytes_owned);
        assert!(v.bytes_owned > 0);
    }

    #[test]
    fn every_staging_mode_verifies_with_the_segments_its_mode_promises() {
        // (model, P, D, the staging of every sending pair, segments per pair and buffer)
        let l = |m, p, d| layout(m, 4, p, d);
        let runs = |sim: &Simulation| sim.request.runs() as u64;
        let custom = Layout::new(
            crate::model::Model {
                name: "12 heads".into(),
                kv_heads: 12,
                head_dim: 40,
                layers: 2,
                attention: crate::model::Attention::KeyValue,
                torch_dtype: None,
            },
            Dtype::Fp8,
            4,
            6,
            4,
        )
        .unwrap();
        for (layout, modes) in [
            // Narrower decode slots: the prefill rank packs.
            (l("qwen2.5-7b", 2, 8), [0, 8, 0, 0]),
            // Narrower prefill slots: the decode rank unpacks.
            (l("llama-3.1-8b", 8, 2), [0, 0, 8, 0]),
            // Whole tokens: no staging.
            (l("llama-3.1-8b", 2, 2), [2, 0, 0, 0]),
            // 12 heads, 6 -> 4: two-head slices into three-head slots (dst), and one-head
            // slices out of two-head slots into three-head slots (both).
            (custom, [0, 0, 4, 4]),
        ] {
            let mut sim = Simulation::new(&layout, &options()).unwrap();
            let stats = sim.send_all(options().tokens).unwrap();
            assert_eq!(stats.staging_modes, modes, "{}", layout.model.name);
            let v = sim.verify_staged();
            assert_eq!(
                v.bytes_wrong, 0,
                "{}: {:?}",
                layout.model.name, v.first_wrong
            );
            assert_eq!(v.bytes_owned, sim.verify().bytes_owned);
            // A segment per run and buffer, except with both sides staged: one per buffer.
            let buffers = sim.buffers() as u64;
            let per_pair = modes[0] + modes[1] + modes[2];
            assert_eq!(
                stats.staged_segments,
                (per_pair * runs(&sim) + modes[3]) * buffers,
                "{}",
                layout.model.name
            );
        }
    }

    #[test]
    fn a_damaged_byte_of_the_staged_path_is_found() {
        let l = layout("qwen2.5-7b", 4, 2, 8);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all(options().tokens).unwrap();
        let page = sim.request.dst_pages[2] as usize;
        sim.dst_staged_mut(3, 1)[page * l.dst_item_len as usize] ^= 1;
        assert_eq!(sim.verify().bytes_wrong, 0);
        let v = sim.verify_staged();
        assert_eq!(v.bytes_wrong, 1);
        assert!(
            v.first_wrong[0].starts_with("decode rank 3, layer 1 K"),
            "{:?}",
            v.first_wrong
        );
    }

    #[test]
    fn one_damaged_byte_is_found_and_located() {
        let l = layout("llama-3.1-8b", 2, 16, 4);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all(options().tokens).unwrap();
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
        sim.send_all(options().tokens).unwrap();
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
        sim.send_all(options().tokens).unwrap();
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
