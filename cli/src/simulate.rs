//! `mori-tp simulate`: one request of a deployment, moved in host memory through the library's
//! Rust API (`pair_config` of both ranks' layouts, `PairPlan`, `send_host_with` on the host or
//! the HIP engine; staged: `pack_into_host`, `pair_segments`, `unpack_from_host`), then every
//! decode byte checked.
//!
//! Every prefill rank's buffers are filled with bytes that identify (buffer, page, slot, head,
//! byte), each head written where its side's layout puts it (token-major: a slot's heads
//! together; head-major: a head's slots together): each 8-byte word is a bijective hash of its
//! unique coordinates, so a copy from the wrong head, page, token, layer or offset cannot go
//! unnoticed. Decode buffers start as a sentinel, which every byte outside the request's tokens
//! (other pages, the slots after the last token of a partial last page) must still hold.

use std::time::{Duration, Instant};

use mori_tp::backend::open_host_copies;
use mori_tp::{
    Backend, Error, HostCopies, PairConfig, PairPlan, SendReport, Side, Staging, pack_into_host,
    pair_segments, pair_staging_for, send_host_with, unpack_from_host,
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
    /// cuMemcpy2DAsync on the null stream (the buffers stay in host memory)
    Cuda,
}

/// The knobs of a simulation.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// N: tokens in the request (the last page of a side may be partial).
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
/// `key` numbers (buffer, page, slot, head, word) uniquely, so every word in the deployment is
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
    /// Writes the bytes of `head` of slot `slot` of `page` of `buffer` into `out`.
    fn head(&self, buffer: usize, page: u64, slot: u64, head: u32, out: &mut [u8]) {
        let key = (((buffer as u64 * self.pages + page) * self.page_size + slot) * self.heads
            + u64::from(head))
            * self.words_per_head;
        for (word, chunk) in out.chunks_mut(8).enumerate() {
            let value = mix(self.seed ^ (key + word as u64)).to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    }
}

/// Where element (slot, local head) of `page` starts in a buffer of layout `l`.
fn element(l: &mori_tp::Layout, page: u64, slot: u64, local: u64) -> usize {
    (page * l.page_stride + l.offset + slot * l.token_stride + local * l.head_stride) as usize
}

/// Maximal runs of consecutive pages in one side's list.
fn runs(pages: &[i32]) -> usize {
    let breaks = pages.windows(2).filter(|w| w[1] != w[0] + 1).count();
    if pages.is_empty() { 0 } else { breaks + 1 }
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
    /// Copies (or RDMA segments) a planner issuing one per token (and per head where a token's
    /// moved heads are not contiguous on a side) per pair per buffer would need.
    pub per_token_copies: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Time spent inside the library's send.
    pub elapsed: Duration,
    /// Segments an RDMA engine gets for the direct transfer (pages to pages), over all pairs
    /// and buffers.
    pub direct_segments: u64,
    /// Segments an RDMA engine gets with the staging `pair_staging_for` chooses.
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
    /// Bytes of the request's tokens the decode ranks own (each must be written once).
    pub bytes_owned: u64,
}

/// A deployment's buffers in host memory.
pub struct Simulation<'a> {
    layout: &'a Layout,
    /// Layers simulated.
    pub layers: u32,
    /// N.
    pub tokens: u64,
    /// Each side's page list and the pages its buffers hold.
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

/// The library's layout of a rank of a valid deployment.
fn rank_layout(layout: &Layout, side: Side, rank: u32) -> mori_tp::Layout {
    layout
        .rank_layout(side, rank)
        .expect("the deployment's layouts were validated")
}

/// A fragmented request of `tokens` tokens: one draw of page pairs where both sides have as
/// many pages, else each side's list drawn on its own.
fn request_for(layout: &Layout, options: &Options, tokens: u64) -> Request {
    let src_pages = layout.prefill_paging.pages(tokens) as usize;
    let dst_pages = layout.decode_paging.pages(tokens) as usize;
    let lengths = RunLengths::Chance(options.fragmentation);
    let both = fragmented_request(options.seed, src_pages, lengths);
    if src_pages == dst_pages {
        return both;
    }
    let decode = fragmented_request(mix(options.seed ^ 0xDEC0DE), dst_pages, lengths);
    Request {
        src_pages: both.src_pages,
        src_capacity_pages: both.src_capacity_pages,
        dst_pages: decode.dst_pages,
        dst_capacity_pages: decode.dst_capacity_pages,
    }
}

impl<'a> Simulation<'a> {
    /// Allocates and fills every rank's buffers, or says why it would take too much memory.
    pub fn new(layout: &'a Layout, options: &Options) -> Result<Self, SimError> {
        let tokens = u64::from(options.tokens);
        let src_pages = layout.prefill_paging.pages(tokens);
        let dst_pages = layout.decode_paging.pages(tokens);
        let layers = layout.model.layers.min(options.layers_limit);
        let buffers = layout.buffers(layers);
        // The request's page counts bound the capacities: each run adds at most 2 free pages.
        let worst = |pages: u64| 3 * u128::from(pages) + 3;
        // Prefill buffers, decode buffers twice (direct and staged), and one pair's staging
        // regions, each at most a page's slot per page and buffer.
        let src_bytes = worst(src_pages) * u128::from(layout.src_item_len);
        let dst_bytes = worst(dst_pages) * u128::from(layout.dst_item_len);
        let memory = u128::from(buffers)
            * (u128::from(layout.prefill_tp()) * src_bytes
                + 2 * u128::from(layout.decode_tp()) * dst_bytes
                + 2 * src_bytes.max(dst_bytes));
        let most_pages = worst(src_pages.max(dst_pages));
        if memory > u128::from(MEMORY_LIMIT) || most_pages > i32::MAX as u128 {
            // Pages are allocated whole: a page larger than the request is the cause, whatever
            // the token count.
            let page = |paging: &crate::layout::Paging| u64::from(paging.page_size);
            let oversized: Vec<String> = [
                ("prefill", &layout.prefill_paging),
                ("decode", &layout.decode_paging),
            ]
            .iter()
            .filter(|(_, paging)| page(paging) > tokens)
            .map(|(side, paging)| format!("{side} pages of {} tokens", grouped(page(paging))))
            .collect();
            let lower = if oversized.is_empty() {
                "lower --tokens, --layers-limit or the TP sizes".to_string()
            } else {
                format!(
                    "the page size is the cause: every buffer holds whole pages, and the \
                     {} are larger than the request; lower --page-size (or \
                     --prefill-page-size, --decode-page-size)",
                    oversized.join(" and ")
                )
            };
            return Err(SimError::TooLarge(format!(
                "simulating {} tokens over {layers} layers of {} prefill and {} decode ranks could \
                 need up to {} of host memory (limit {}); {lower}",
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
            BackendArg::Cuda => Backend::Cuda,
        })
        .map_err(|e| match e {
            Error::BackendUnavailable { .. } => SimError::Backend(e.to_string()),
            other => SimError::Library(other.to_string()),
        })?;
        let request = request_for(layout, options, tokens);
        let pattern = Pattern {
            seed: mix(options.seed ^ 0x6D6F_7269_2D74_7000),
            pages: request.src_capacity_pages as u64,
            page_size: u64::from(layout.prefill_paging.page_size),
            heads: u64::from(layout.model.kv_heads),
            words_per_head: layout.bytes_per_head.div_ceil(8),
        };
        let buffers = buffers as usize;
        let bph = layout.bytes_per_head as usize;
        let src = (0..layout.prefill_tp())
            .map(|p| {
                let l = rank_layout(layout, Side::Prefill, p);
                let heads = layout.prefill_heads(p);
                (0..buffers)
                    .map(|b| {
                        let pages = request.src_capacity_pages as u64;
                        let mut buffer = vec![0u8; (pages * l.page_stride) as usize];
                        // Every element where the layout puts it; dense layouts leave no gap.
                        for page in 0..pages {
                            for slot in 0..u64::from(l.page_size) {
                                for (local, head) in heads.clone().enumerate() {
                                    let at = element(&l, page, slot, local as u64);
                                    let bytes = &mut buffer[at..at + bph];
                                    pattern.head(b, page, slot, head, bytes);
                                }
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
            tokens,
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

    /// Sends one pair's slice of every buffer from prefill rank `p` into decode rank `d` with
    /// the chosen backend, following the plan the library makes of `config` and the request;
    /// returns what moved, the plan's segments per buffer and the time it took.
    pub fn send_pair(
        &mut self,
        p: u32,
        d: u32,
        config: &PairConfig,
    ) -> mori_tp::Result<(SendReport, u64, Duration)> {
        let request = mori_tp::Request {
            src_pages: &self.request.src_pages,
            dst_pages: &self.request.dst_pages,
            num_tokens: self.tokens,
        };
        let plan = PairPlan::transfer(config, &request, Staging::None)?;
        let segments = plan.num_segments()? as u64;
        let src: Vec<&[u8]> = self.src[p as usize].iter().map(Vec::as_slice).collect();
        let mut dst: Vec<&mut [u8]> = self.dst[d as usize]
            .iter_mut()
            .map(Vec::as_mut_slice)
            .collect();
        let start = Instant::now();
        let report = send_host_with(&plan, &src, &mut dst, self.engine.as_mut())?;
        Ok((report, segments, start.elapsed()))
    }

    /// One pair's staged transfer, as an RDMA connector would run it: the prefill rank packs
    /// (when `pair_staging_for` stages its side), the transport copies every segment of
    /// `pair_segments` for every buffer (done here in host memory), the decode rank unpacks
    /// (when its side is staged), into the staged decode buffers. Returns the staging, the
    /// segments per buffer and the staging bytes of both sides.
    pub fn stage_pair(
        &mut self,
        p: u32,
        d: u32,
        config: &PairConfig,
    ) -> Result<(Staging, u64, u64), String> {
        let request = mori_tp::Request {
            src_pages: &self.request.src_pages,
            dst_pages: &self.request.dst_pages,
            num_tokens: self.tokens,
        };
        let buffers = self.src[p as usize].len();
        let staging = pair_staging_for(config);
        let segments = pair_segments(config, &request, staging).map_err(|e| e.to_string())?;
        let len = config.staging_len(self.tokens).map_err(|e| e.to_string())? as usize;
        let region = |stage: bool, fill: u8| vec![fill; if stage { buffers * len } else { 0 }];
        // A sentinel in the decode region too, so an unpack of bytes never moved would show.
        let mut src_region = region(staging.stages_src(), 0);
        let mut dst_region = region(staging.stages_dst(), SENTINEL);
        let src: Vec<&[u8]> = self.src[p as usize].iter().map(Vec::as_slice).collect();
        let dst = &mut self.dst_staged[d as usize];
        if staging.stages_src() {
            PairPlan::pack(config, staging, &request)
                .and_then(|plan| pack_into_host(&plan, &src, &mut src_region, self.engine.as_mut()))
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
                        "pair_segments segment {i} of {} ({s:?}) leaves buffer {b} ({} source, \
                         {} destination bytes)",
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
            PairPlan::unpack(config, staging, &request)
                .and_then(|plan| {
                    unpack_from_host(&plan, &dst_region, &mut dst_bufs, self.engine.as_mut())
                })
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
        let layout = self.layout;
        for rank in crate::plan::decode_ranks(layout, tokens) {
            let rank = rank.map_err(|e| e.to_string())?;
            for pair in &rank.pairs {
                let (p, d) = (pair.prefill_rank, pair.decode_rank);
                let Some(send) = &pair.send else {
                    stats.replicas_skipped += 1;
                    continue;
                };
                let config = &send.pair;
                let failed = |e: String| format!("prefill rank {p} -> decode rank {d}: {e}");
                let (report, direct, elapsed) = self
                    .send_pair(p, d, config)
                    .map_err(|e| failed(e.to_string()))?;
                stats.copies += report.copies as u64;
                stats.per_token_copies += self.tokens * per_token_pieces(config) * buffers;
                stats.bytes += report.bytes;
                stats
                    .senders
                    .push((d, p, config.first_head(), config.num_heads()));
                stats.elapsed += elapsed;
                stats.direct_segments += direct * buffers;

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

    /// Checks every byte of every decode buffer, element by element where the decode layout
    /// puts it: each slot of the request's tokens holds, for each head the rank owns, exactly
    /// the bytes of the prefill slot of the same token; every other slot (pages outside the
    /// request, slots after the last token of a partial last page) still holds the sentinel.
    fn verify_buffers(&self, dst: &[Vec<Vec<u8>>]) -> Verification {
        const SHOWN: usize = 5;
        let layout = self.layout;
        let (src_ps, dst_ps) = (
            u64::from(layout.prefill_paging.page_size),
            u64::from(layout.decode_paging.page_size),
        );
        let bph = layout.bytes_per_head as usize;
        let r = &self.request;
        let mut position = vec![None; r.dst_capacity_pages];
        for (i, &page) in r.dst_pages.iter().enumerate() {
            position[page as usize] = Some(i as u64);
        }
        let mut v = Verification::default();
        let mut expected = vec![0u8; bph];
        let sentinel = vec![SENTINEL; bph];
        let report = |v: &mut Verification, wrong: u64, place: String| {
            v.bytes_wrong += wrong;
            if v.first_wrong.len() < SHOWN {
                v.first_wrong.push(place);
            }
        };
        for (d, buffers) in dst.iter().enumerate() {
            let l = rank_layout(layout, Side::Decode, d as u32);
            let owned = layout.decode_heads(d as u32);
            for (b, buffer) in buffers.iter().enumerate() {
                v.bytes_checked += buffer.len() as u64;
                let mut covered = 0u64;
                for page in 0..r.dst_capacity_pages as u64 {
                    for slot in 0..dst_ps {
                        // The request's token in this slot, if any.
                        let token = position[page as usize]
                            .map(|i| i * dst_ps + slot)
                            .filter(|&k| k < self.tokens);
                        for (local, head) in owned.clone().enumerate() {
                            let at = element(&l, page, slot, local as u64);
                            let got = &buffer[at..at + bph];
                            covered += bph as u64;
                            let want: &[u8] = match token {
                                Some(k) => {
                                    v.bytes_owned += bph as u64;
                                    let src_page = r.src_pages[(k / src_ps) as usize] as u64;
                                    self.pattern
                                        .head(b, src_page, k % src_ps, head, &mut expected);
                                    &expected
                                }
                                None => &sentinel,
                            };
                            if got == want {
                                continue;
                            }
                            let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count();
                            let at = got.iter().zip(want).position(|(a, b)| a != b);
                            let at = at.unwrap_or(0);
                            let place = format!(
                                "decode rank {d}, {}, page {page} slot {slot} head {head}",
                                self.buffer_name(b)
                            );
                            let whose = match (token, position[page as usize]) {
                                (Some(k), _) => format!(
                                    "token {k} (from prefill page {} slot {})",
                                    r.src_pages[(k / src_ps) as usize],
                                    k % src_ps
                                ),
                                (None, Some(_)) => format!(
                                    "after the request's {} tokens, in its partial last page: \
                                     must stay untouched",
                                    self.tokens
                                ),
                                (None, None) => {
                                    "not in the request: must stay untouched".to_string()
                                }
                            };
                            report(
                                &mut v,
                                wrong as u64,
                                format!(
                                    "{place}, {whose}: {wrong} of {bph} bytes wrong, the first \
                                     at byte {at} (0x{:02x}, expected 0x{:02x})",
                                    got[at], want[at]
                                ),
                            );
                        }
                    }
                }
                // NHD and HND pages are dense: their elements are every byte of the buffer.
                debug_assert_eq!(covered, buffer.len() as u64);
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

/// Copies a per-token planner issues per token: one where the moved heads of a token are back
/// to back on both sides, else one per head.
fn per_token_pieces(config: &PairConfig) -> u64 {
    let n = config.num_heads();
    let together = |side: &mori_tp::ValidLayout| {
        n == 1 || side.layout().head_stride == side.layout().head_bytes
    };
    if together(config.src()) && together(config.dst()) {
        1
    } else {
        u64::from(n)
    }
}

/// A note on what makes a layout interesting, from the library's view of both sides.
fn layout_note(layout: &Layout) -> Option<String> {
    let (prefill, decode) = (layout.topology.prefill(), layout.topology.decode());
    let heads = layout.model.kv_heads;
    if decode.replication() > 1 && prefill.replication() == 1 {
        Some(format!(
            "decode TP {} exceeds the {heads} KV heads while prefill TP {} does not: the layout in \
             which older SGLang releases send decode ranks the wrong heads",
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
    let tokens = sim.tokens;

    let plural =
        |n: u64, word: &str| format!("{} {word}{}", grouped(n), if n == 1 { "" } else { "s" });
    let mut out = format!(
        "Simulating one request of {} from prefill TP {} to decode TP {}, in host memory\n",
        layout.model.name,
        layout.prefill_tp(),
        layout.decode_tp()
    );
    out += &crate::plan::header(layout, crate::plan::OtherGroups::NotSimulated);
    if let Some(note) = layout_note(layout) {
        out += &labelled("note:", &note);
    }
    let pages_text = if r.src_pages.len() == r.dst_pages.len() {
        format!(
            "{} in {} of adjacent pages",
            plural(r.src_pages.len() as u64, "page"),
            plural(r.runs() as u64, "run"),
        )
    } else {
        format!(
            "{} prefill {} in {} and {} decode {} in {} of adjacent pages",
            grouped(r.src_pages.len() as u64),
            if r.src_pages.len() == 1 {
                "page"
            } else {
                "pages"
            },
            plural(runs(&r.src_pages) as u64, "run"),
            grouped(r.dst_pages.len() as u64),
            if r.dst_pages.len() == 1 {
                "page"
            } else {
                "pages"
            },
            plural(runs(&r.dst_pages) as u64, "run"),
        )
    };
    let partial = layout.partial_pages(tokens);
    out += &labelled(
        "request:",
        &format!(
            "{} on {pages_text} (fragmentation {}, seed {}){}",
            plural(tokens, "token"),
            options.fragmentation,
            options.seed,
            partial.map_or(String::new(), |text| format!("; {text}")),
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
                BackendArg::Cuda => "the library's CUDA engine (cuMemcpy2DAsync, host buffers)",
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
             (mori_tp_pair_segments: pages to pages), {} staged (mori_tp_pair_segments with \
             mori_tp_pair_staging_for's choice)",
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
                "all {} decode bytes of the {} simulated layers{}, twice: after the direct \
                 copies and after the staged path (pack, segments, unpack). Each decode rank's \
                 slots of the request's tokens hold exactly the source bytes of the heads it \
                 owns, every other byte (other pages, slots after the last token) still holds \
                 the sentinel, and bytes moved = bytes owned, so no head was sent twice.",
                grouped(v.bytes_checked),
                sim.layers,
                if sim.layers < layout.model.layers {
                    format!(
                        " ({} of {}: every layer moves the same way; --layers-limit {} for all)",
                        sim.layers, layout.model.layers, layout.model.layers
                    )
                } else {
                    String::new()
                },
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
                "MISMATCH: {} bytes moved, but the decode ranks own {} bytes of the request's \
                 tokens\n",
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
    use crate::dtype::Dtype;
    use crate::layout::{PageOrder, Paging};
    use crate::model::preset_by_name;

    fn deployment(model: &str, prefill: Paging, decode: Paging, p: u32, d: u32) -> Layout {
        let model = preset_by_name(model).expect("a preset").into();
        Layout::new(model, Dtype::Fp8, prefill, decode, p, d).expect("a valid layout")
    }

    fn layout(model: &str, page_size: u32, prefill: u32, decode: u32) -> Layout {
        let paging = Paging::nhd(page_size);
        deployment(model, paging, paging, prefill, decode)
    }

    fn paging(order: PageOrder, page_size: u32) -> Paging {
        Paging { order, page_size }
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

    /// Sends everything and checks both paths: every byte right, each owned byte moved once.
    fn moves_and_verifies<'a>(
        layout: &'a Layout,
        options: &Options,
    ) -> (Simulation<'a>, SendStats) {
        let mut sim = Simulation::new(layout, options).unwrap();
        let stats = sim.send_all(options.tokens).unwrap();
        for v in [sim.verify(), sim.verify_staged()] {
            assert_eq!(v.bytes_wrong, 0, "{:?}", v.first_wrong);
            assert_eq!(stats.bytes, v.bytes_owned);
            assert!(v.bytes_owned > 0);
        }
        (sim, stats)
    }

    #[test]
    fn a_correct_transfer_verifies_and_moves_each_owned_byte_once() {
        let l = layout("qwen2.5-7b", 4, 2, 8);
        moves_and_verifies(&l, &options());
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
                facts: None,
            },
            Dtype::Fp8,
            Paging::nhd(4),
            Paging::nhd(4),
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
            let (sim, stats) = moves_and_verifies(&layout, &options());
            assert_eq!(stats.staging_modes, modes, "{}", layout.model.name);
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
    fn head_major_pages_hold_each_heads_tokens_together() {
        // Prefill TP 2 over 8 heads: 4 local heads, HND pages of 4 slots of 128 bytes (fp8):
        // local head j of slot t of page p at p * 2048 + j * 512 + t * 128.
        let l = deployment(
            "llama-3.1-8b",
            paging(PageOrder::Hnd, 4),
            Paging::nhd(4),
            2,
            2,
        );
        let sim = Simulation::new(&l, &options()).unwrap();
        let buffer = &sim.src[1][0];
        let mut expected = vec![0u8; 128];
        for (page, slot, local) in [(0u64, 0u64, 0u64), (0, 1, 0), (0, 0, 1), (3, 2, 3)] {
            let at = (page * 2048 + local * 512 + slot * 128) as usize;
            // Rank 1 owns heads 4-7.
            sim.pattern
                .head(0, page, slot, 4 + local as u32, &mut expected);
            assert_eq!(
                &buffer[at..at + 128],
                expected.as_slice(),
                "{page} {slot} {local}"
            );
        }
    }

    #[test]
    fn any_mix_of_layouts_and_page_sizes_verifies_with_partial_last_pages() {
        // vLLM on ROCm (HND) with 8 KV heads, TP 8 -> 2; NHD -> HND; 16 -> 64 and 64 -> 16.
        let hnd = |ps| paging(PageOrder::Hnd, ps);
        let nhd = Paging::nhd;
        for (prefill, decode, p, d) in [
            (hnd(16), hnd(16), 8, 2),
            (nhd(16), hnd(16), 2, 8),
            (hnd(16), nhd(64), 8, 2),
            (nhd(64), hnd(16), 4, 2),
            (hnd(64), hnd(16), 16, 2),
        ] {
            let l = deployment("llama-3.1-8b", prefill, decode, p, d);
            // 150 tokens: partial last pages of 16 (6 of 16) and of 64 (22 of 64).
            let options = Options {
                tokens: 150,
                ..options()
            };
            let (sim, stats) = moves_and_verifies(&l, &options);
            assert_eq!(sim.tokens, 150);
            // Every owned slot of the request's tokens, and no more.
            let owned = 150 * 8 * l.bytes_per_head * sim.buffers() as u64;
            assert_eq!(stats.bytes, owned, "{prefill:?} -> {decode:?}");
            assert!(l.partial_pages(150).is_some());
        }
    }

    #[test]
    fn a_write_into_the_slots_after_the_last_token_is_found() {
        // 38 tokens on HND pages of 16: the third decode page holds tokens 32-37 in slots 0-5.
        let hnd = paging(PageOrder::Hnd, 16);
        let l = deployment("llama-3.1-8b", hnd, hnd, 8, 2);
        let options = Options {
            tokens: 38,
            ..options()
        };
        let (mut sim, _) = moves_and_verifies(&l, &options);
        let page = sim.request.dst_pages[2] as usize;
        // Decode rank 1, local head 2 (head 6), slot 6: the first slot past the request.
        let at = page * l.dst_item_len as usize + 2 * 16 * 128 + 6 * 128;
        assert_eq!(sim.dst_mut(1, 0)[at], SENTINEL);
        sim.dst_mut(1, 0)[at] ^= 1;
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 1);
        assert!(
            v.first_wrong[0].starts_with(&format!(
                "decode rank 1, layer 0 K, page {page} slot 6 head 6, after the request's 38 tokens"
            )),
            "{:?}",
            v.first_wrong
        );
        // The slot before it is token 37's, and damaging it is found as that token's.
        let before = at - 128;
        sim.dst_mut(1, 0)[at] ^= 1;
        sim.dst_mut(1, 0)[before + 5] ^= 0x10;
        let v = sim.verify();
        assert_eq!(v.bytes_wrong, 1);
        assert!(
            v.first_wrong[0].contains(&format!(
                "page {page} slot 5 head 6, token 37 (from prefill page"
            )),
            "{:?}",
            v.first_wrong
        );
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
    fn a_damaged_byte_of_a_head_major_page_is_found_at_its_head_and_slot() {
        let hnd = paging(PageOrder::Hnd, 4);
        let l = deployment("llama-3.1-8b", Paging::nhd(4), hnd, 2, 2);
        let mut sim = Simulation::new(&l, &options()).unwrap();
        sim.send_all(options().tokens).unwrap();
        let page = sim.request.dst_pages[5] as usize;
        // Decode rank 1 owns heads 4-7; local head 3 (head 7), slot 2, byte 9.
        let at = page * l.dst_item_len as usize + 3 * 4 * 128 + 2 * 128 + 9;
        sim.dst_staged_mut(1, 2)[at] ^= 0x40;
        let v = sim.verify_staged();
        assert_eq!(v.bytes_wrong, 1);
        assert!(
            v.first_wrong[0].starts_with(&format!(
                "decode rank 1, layer 0 V, page {page} slot 2 head 7, token 22"
            )),
            "{:?}",
            v.first_wrong
        );
        assert!(
            v.first_wrong[0].contains("first at byte 9"),
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
            v.first_wrong[0].starts_with(&format!("decode rank 1, layer 0 V, page {page} slot 0")),
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
        // of today's stacks; the data names the head, so the check fails. In head-major pages
        // too.
        for order in [PageOrder::Nhd, PageOrder::Hnd] {
            let l = deployment("qwen2.5-7b", paging(order, 4), paging(order, 4), 2, 8);
            let mut sim = Simulation::new(&l, &options()).unwrap();
            sim.send_all(options().tokens).unwrap();
            let wrong = l.pair_config(0, 0).unwrap();
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
