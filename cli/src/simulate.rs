//! `mori-tp simulate`: one request of a deployment, moved in host memory through the same C entry
//! point a serving engine calls (`mori_send_kvcache`), then every decode byte checked.
//!
//! Every prefill rank's buffers are filled with bytes that identify (buffer, page, token, head,
//! byte): each 8-byte word is a bijective hash of its unique coordinates, so a copy from the wrong
//! head, page, token, layer or offset cannot go unnoticed. Decode buffers start as a sentinel.

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use mori_tp::ffi::{
    MORI_BACKEND_HOST, MORI_ERR_BUFFER_TOO_SMALL, MORI_OK, MORI_SEND_SYNCHRONIZE,
    MORI_TP_ACTION_SEND, MORI_TP_ACTION_SKIP_REPLICA, MoriCopyRect, MoriKvBuffers, MoriSendOptions,
    MoriStatus, MoriTpSliceConfig, MoriTpSliceParams, mori_last_error_message, mori_send_kvcache,
    mori_status_str, mori_tp_plan, mori_tp_slice_config,
};

use crate::layout::{Layout, grouped, heads_text, human_bytes, labelled};

/// What every decode byte holds before the transfer.
pub const SENTINEL: u8 = 0xEE;

/// Host memory a simulation may allocate before it refuses.
const MEMORY_LIMIT: u64 = 4 << 30;

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
}

/// splitmix64's output function: a bijection on u64 that scatters every input bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small deterministic generator, so a run reproduces from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A request: page pairs as a serving engine's page tables would hand them over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub src_pages: Vec<i32>,
    pub dst_pages: Vec<i32>,
    /// Runs of pages adjacent on both sides.
    pub runs: usize,
    pub src_capacity_pages: u64,
    pub dst_capacity_pages: u64,
}

/// `pages` page pairs split into runs (a page starts a new run with probability
/// `fragmentation`), laid out in a different shuffled order on each side with free pages between
/// runs, as an allocator that has been running for a while hands them out.
pub fn fragmented_request(pages: u32, fragmentation: f64, seed: u64) -> Request {
    let mut rng = Rng(seed);
    let mut run_lengths = vec![1u64];
    for _ in 1..pages {
        if rng.unit() < fragmentation {
            run_lengths.push(1);
        } else {
            *run_lengths.last_mut().expect("one run at least") += 1;
        }
    }
    // Places the runs in shuffled order, one or two free pages apart (so no two runs touch),
    // and returns each run's first page and the pages the buffer needs.
    let place = |rng: &mut Rng| {
        let mut order: Vec<usize> = (0..run_lengths.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut starts = vec![0u64; run_lengths.len()];
        let mut next = rng.below(3) as u64;
        for &run in &order {
            starts[run] = next;
            next += run_lengths[run] + 1 + rng.below(2) as u64;
        }
        (starts, next)
    };
    let (src_starts, src_capacity_pages) = place(&mut rng);
    let (dst_starts, dst_capacity_pages) = place(&mut rng);
    let expand = |starts: &[u64]| -> Vec<i32> {
        starts
            .iter()
            .zip(&run_lengths)
            .flat_map(|(&start, &len)| (start..start + len).map(|page| page as i32))
            .collect()
    };
    Request {
        src_pages: expand(&src_starts),
        dst_pages: expand(&dst_starts),
        runs: run_lengths.len(),
        src_capacity_pages,
        dst_capacity_pages,
    }
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
    /// Time spent inside `mori_send_kvcache`.
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
}

/// The status name and message of a failed C call.
fn ffi_failure(function: &str, status: MoriStatus) -> String {
    // SAFETY: both functions return static or thread-local NUL-terminated strings.
    let (name, message) = unsafe {
        (
            CStr::from_ptr(mori_status_str(status)).to_string_lossy(),
            CStr::from_ptr(mori_last_error_message()).to_string_lossy(),
        )
    };
    format!("{function} returned {name} ({status}): {message}")
}

impl<'a> Simulation<'a> {
    /// Allocates and fills every rank's buffers, or says why it would take too much memory.
    pub fn new(layout: &'a Layout, options: &Options) -> Result<Self, String> {
        let page_size = u64::from(layout.page_size);
        let pages = u64::from(options.tokens).div_ceil(page_size);
        let pages = u32::try_from(pages).map_err(|_| "too many pages".to_string())?;
        let layers = layout.model.layers.min(options.layers_limit);
        let buffers = layout.buffers(layers);
        // The request's page counts bound the capacities: each run adds at most 2 free pages.
        let worst_pages = 3 * u128::from(pages) + 3;
        let memory = u128::from(buffers)
            * worst_pages
            * (u128::from(layout.prefill_tp()) * u128::from(layout.src_item_len)
                + u128::from(layout.decode_tp()) * u128::from(layout.dst_item_len));
        if memory > u128::from(MEMORY_LIMIT) || worst_pages > i32::MAX as u128 {
            return Err(format!(
                "simulating {} tokens over {layers} layers of {} prefill and {} decode ranks could \
                 need up to {} of host memory (limit {}); lower --tokens or --layers-limit",
                options.tokens,
                layout.prefill_tp(),
                layout.decode_tp(),
                human_bytes(u64::try_from(memory).unwrap_or(u64::MAX)),
                human_bytes(MEMORY_LIMIT),
            ));
        }
        let request = fragmented_request(pages, options.fragmentation, options.seed);
        let pattern = Pattern {
            seed: mix(options.seed ^ 0x6D6F_7269_2D74_7000),
            pages: request.src_capacity_pages,
            page_size,
            heads: u64::from(layout.model.kv_heads),
            words_per_head: layout.bytes_per_head.div_ceil(8),
        };
        let buffers = buffers as usize;
        let prefill = layout.topology.prefill();
        let bph = layout.bytes_per_head as usize;
        let src = (0..layout.prefill_tp())
            .map(|p| {
                let heads = prefill.owned_heads(p).expect("rank in range");
                (0..buffers)
                    .map(|b| {
                        let len = request.src_capacity_pages * layout.src_item_len;
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
        let dst_len = (request.dst_capacity_pages * layout.dst_item_len) as usize;
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

    /// The config the library computes for a pair, through the C ABI.
    fn slice_config(&self, p: u32, d: u32) -> Result<MoriTpSliceConfig, String> {
        let params = self.layout.slice_params(p, d);
        let params = MoriTpSliceParams {
            prefill_tp_size: params.prefill_tp_size,
            prefill_tp_rank: params.prefill_tp_rank,
            decode_tp_size: params.decode_tp_size,
            decode_tp_rank: params.decode_tp_rank,
            total_kv_heads: params.total_kv_heads,
            page_size: params.page_size,
            src_item_len: params.src_item_len,
            dst_item_len: params.dst_item_len,
        };
        let mut config = MoriTpSliceConfig::default();
        // SAFETY: both pointers come from live references.
        let status = unsafe { mori_tp_slice_config(&params, &mut config) };
        if status != MORI_OK {
            return Err(ffi_failure("mori_tp_slice_config", status));
        }
        Ok(config)
    }

    /// The rects the library plans for a config and this request, through the C ABI.
    fn rects(&self, config: &MoriTpSliceConfig) -> Result<Vec<MoriCopyRect>, String> {
        let r = &self.request;
        let plan = |out: &mut [MoriCopyRect], len: &mut usize| {
            let out_ptr = if out.is_empty() {
                std::ptr::null_mut()
            } else {
                out.as_mut_ptr()
            };
            // SAFETY: the page arrays hold `len()` entries each and `out` holds `out.len()`.
            unsafe {
                mori_tp_plan(
                    config,
                    r.src_pages.as_ptr(),
                    r.dst_pages.as_ptr(),
                    r.src_pages.len(),
                    out_ptr,
                    out.len(),
                    len,
                )
            }
        };
        let mut needed = 0;
        let status = plan(&mut [], &mut needed);
        if status != MORI_OK && status != MORI_ERR_BUFFER_TOO_SMALL {
            return Err(ffi_failure("mori_tp_plan", status));
        }
        let mut rects = vec![MoriCopyRect::default(); needed];
        let status = plan(&mut rects, &mut needed);
        if status != MORI_OK {
            return Err(ffi_failure("mori_tp_plan", status));
        }
        Ok(rects)
    }

    /// Sends one pair's slice of every buffer with `mori_send_kvcache` (host backend), using the
    /// given config, and returns the time the call took.
    pub fn send_pair(
        &mut self,
        p: u32,
        d: u32,
        config: &MoriTpSliceConfig,
    ) -> Result<Duration, String> {
        let src: Vec<*const c_void> = self.src[p as usize]
            .iter()
            .map(|b| b.as_ptr().cast())
            .collect();
        let dst: Vec<*mut c_void> = self.dst[d as usize]
            .iter_mut()
            .map(|b| b.as_mut_ptr().cast())
            .collect();
        let capacity = |ranks: &[Vec<Vec<u8>>]| ranks[0][0].len() as u64;
        let buffers = MoriKvBuffers {
            src: src.as_ptr(),
            dst: dst.as_ptr(),
            num_buffers: src.len(),
            src_capacity: capacity(&self.src),
            dst_capacity: capacity(&self.dst),
        };
        let options = MoriSendOptions {
            backend: MORI_BACKEND_HOST,
            flags: MORI_SEND_SYNCHRONIZE,
            stream: std::ptr::null_mut(),
        };
        let r = &self.request;
        let start = Instant::now();
        // SAFETY: every pointer comes from a live Vec of exactly the stated capacity; the decode
        // buffers are borrowed mutably and are distinct from the prefill ones.
        let status = unsafe {
            mori_send_kvcache(
                config,
                &buffers,
                r.src_pages.as_ptr(),
                r.dst_pages.as_ptr(),
                r.src_pages.len(),
                &options,
            )
        };
        let elapsed = start.elapsed();
        if status != MORI_OK {
            return Err(ffi_failure(
                &format!("prefill rank {p} -> decode rank {d}: mori_send_kvcache"),
                status,
            ));
        }
        Ok(elapsed)
    }

    /// Every pair the library says sends: config, plan and send, all through the C ABI.
    pub fn send_all(&mut self) -> Result<SendStats, String> {
        let mut stats = SendStats::default();
        let buffers = self.buffers() as u64;
        let tokens = self.request.src_pages.len() as u64 * u64::from(self.layout.page_size);
        for d in 0..self.layout.decode_tp() {
            for p in 0..self.layout.prefill_tp() {
                let config = self.slice_config(p, d)?;
                match config.action {
                    MORI_TP_ACTION_SEND => {}
                    MORI_TP_ACTION_SKIP_REPLICA => {
                        stats.replicas_skipped += 1;
                        continue;
                    }
                    _ => continue,
                }
                let rects = self.rects(&config)?;
                stats.copies += rects.len() as u64 * buffers;
                stats.per_token_copies += tokens * buffers;
                stats.bytes += rects.iter().map(|r| r.width * r.height).sum::<u64>() * buffers;
                stats
                    .senders
                    .push((d, p, config.first_head, config.num_heads));
                stats.elapsed += self.send_pair(p, d, &config)?;
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
        let mut source_of = vec![None; self.request.dst_capacity_pages as usize];
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
            let owned = layout
                .topology
                .decode()
                .owned_heads(d as u32)
                .expect("rank in range");
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
    /// A library call failed.
    Library(String),
}

/// Runs the whole simulation and returns its report, and whether every byte was right.
pub fn run(layout: &Layout, options: &Options) -> Result<(String, bool), SimError> {
    let mut sim = Simulation::new(layout, options).map_err(SimError::TooLarge)?;
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
            plural(r.runs as u64, "run"),
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
            "{} through mori_send_kvcache (host backend); {} skipped as replicas",
            plural(stats.senders.len() as u64, "pair"),
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
        }
    }

    #[test]
    fn fragmented_requests_pair_every_page_once_in_runs_that_never_touch() {
        for (pages, fragmentation) in [(1, 0.5), (50, 0.0), (50, 0.2), (50, 1.0)] {
            let r = fragmented_request(pages, fragmentation, 3);
            assert_eq!(r.src_pages.len(), pages as usize);
            for (side, capacity) in [
                (&r.src_pages, r.src_capacity_pages),
                (&r.dst_pages, r.dst_capacity_pages),
            ] {
                let mut sorted = side.clone();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), pages as usize, "a page used twice");
                assert!(sorted.iter().all(|&p| p >= 0 && (p as u64) < capacity));
            }
            let breaks = (1..pages as usize)
                .filter(|&i| {
                    r.src_pages[i] != r.src_pages[i - 1] + 1
                        || r.dst_pages[i] != r.dst_pages[i - 1] + 1
                })
                .count();
            assert_eq!(breaks + 1, r.runs);
        }
        assert_eq!(fragmented_request(50, 0.0, 3).runs, 1);
        assert_eq!(fragmented_request(50, 1.0, 3).runs, 50);
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
        let wrong = sim.slice_config(0, 0).unwrap();
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
        let err = Simulation::new(&l, &options).err().expect("refused");
        assert!(err.contains("--layers-limit"), "{err}");
    }
}
