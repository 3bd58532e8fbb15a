//! Helpers shared by the integration tests: an independent statement of REFERENCE.md's head
//! ownership, deterministic fragmented requests, and KV buffers whose bytes identify what they
//! hold.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{Read, Write};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use mori_tp::{Action, SendReport, SliceParams, SlicePlan, slice_config};

/// The checkout.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The shared library this `cargo test` built. The test binary is
/// `target/<profile>/deps/<name>-<hash>`; cargo test writes the cdylib beside it in `deps/` and
/// copies it up to `target/<profile>/` only on `cargo build`, so `deps/` comes first.
pub fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let deps_dir = exe.parent().expect("the test binary lives in a folder");
    let name = format!(
        "{}mori_tp{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let in_deps = deps_dir.join(&name);
    match deps_dir.parent() {
        Some(profile_dir) if !in_deps.is_file() => profile_dir.join(&name),
        _ => in_deps,
    }
}

/// Runs `command` to completion, killing it after `limit`; stdout and stderr together.
pub fn run_bounded(mut command: Command, limit: Duration) -> (Output, String) {
    let mut child = match command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
            "{:?} is not installed, and these tests need it (python3: Debian's apt-get \
             install python3)",
            command.get_program()
        ),
        Err(error) => panic!("cannot run {:?}: {error}", command.get_program()),
    };
    // Drained on threads: an engine that logs a lot must not block on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() > deadline {
            // Its decode child dies with it (PR_SET_PDEATHSIG).
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} ran past {limit:?} and was killed");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let output = Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, report)
}

/// Runs `command` to completion and returns its stdout and stderr; fails the test, with both,
/// when the command cannot start or exits unsuccessfully.
pub fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{text}",
        output.status
    );
    text
}

/// A fresh-enough folder for a test's build outputs, `target/<profile>/deps/<parts...>`, created.
pub fn scratch(parts: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let mut dir = exe.parent().expect("target/<profile>/deps").to_path_buf();
    dir.extend(parts);
    std::fs::create_dir_all(&dir).expect("create the scratch folder");
    dir
}

/// The libmori_tp.a this `cargo test` built, with this run's features, next to the test
/// executables in target/<profile>/deps.
pub fn built_static_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let lib = exe
        .parent()
        .expect("target/<profile>/deps")
        .join("libmori_tp.a");
    assert!(lib.is_file(), "cargo did not build {}", lib.display());
    lib
}

/// The system libraries a C program links next to libmori_tp.a (from
/// `cargo rustc --lib -- --print native-static-libs`, less `-lgcc_s`: the compiler driver links
/// the unwinder itself, libgcc_s, or libgcc_eh under `-static`, where `-lgcc_s` cannot link);
/// docs/src/guides/link-c.md lists exactly these.
pub const STATIC_LIBS: &str = "-lpthread -ldl -lm -lrt -lutil";

/// What a shared object that links libmori_tp.a adds so that it does not re-export the
/// library's symbols (mori_tp::static and mori_tp-static.pc carry it); docs/src/guides/link-c.md shows it.
pub const EXCLUDE_LIBS: &str = "-Wl,--exclude-libs,libmori_tp.a";

/// With the HIP backend built in (`--features hip`), a program that links libmori_tp also links
/// libamdhip64: from the HIP install `hipconfig -p` names (what hip-sys linked against), else the
/// linker's default paths.
pub fn hip_link() -> Vec<String> {
    if !cfg!(feature = "hip") {
        return Vec::new();
    }
    let mut args = Vec::new();
    let prefix = Command::new("hipconfig").arg("-p").output().ok();
    if let Some(output) = prefix.filter(|o| o.status.success()) {
        let lib = Path::new(String::from_utf8_lossy(&output.stdout).trim()).join("lib");
        args.push(format!("-L{}", lib.display()));
        args.push(format!("-Wl,-rpath,{}", lib.display()));
    }
    args.push("-lamdhip64".into());
    args
}

/// True when the environment variable `var` is set to anything but "" or "0": CI sets
/// MORI_TP_REQUIRE_TOOLS=1 after installing every tool, MORI_TP_REQUIRE_HIP=1 for the HIP build
/// and a GPU runner MORI_TP_REQUIRE_HIP_DEVICE=1, so that nothing skips there.
pub fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Reports that `test` skips because `why`. libtest hides what a passing test prints with
/// `eprintln!`, so the line goes straight to the process's stderr, where `cargo test` shows it.
pub fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "skipped {test}: {why}");
}

/// Skips `test` for a missing tool, or fails it when `required_by` is set (see [`required`]).
pub fn skip_missing(test: &str, required_by: &str, why: &str) {
    assert!(
        !required(required_by),
        "{test}: {required_by} is set, but {why}"
    );
    skip(test, why);
}

/// KV head counts the property tests cover.
pub const HEAD_COUNTS: [u32; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64];

/// REFERENCE.md section 3: a side is valid when H and T divide one way or the other.
pub fn valid_tp(heads: u32, tp: u32) -> bool {
    heads % tp == 0 || tp % heads == 0
}

/// REFERENCE.md section 3, restated independently of the library: the heads rank `r` owns.
pub fn owned_heads(heads: u32, tp: u32, rank: u32) -> Range<u32> {
    if tp <= heads {
        let per = heads / tp;
        rank * per..(rank + 1) * per
    } else {
        let head = rank / (tp / heads);
        head..head + 1
    }
}

/// The heads a rank of a side of TP size `tp` holds (L).
pub fn local_heads(heads: u32, tp: u32) -> u32 {
    if tp <= heads { heads / tp } else { 1 }
}

/// The lowest rank of a side of TP size `tp` that owns head `head`.
pub fn first_owner(heads: u32, tp: u32, head: u32) -> u32 {
    (0..tp)
        .find(|&r| owned_heads(heads, tp, r).contains(&head))
        .expect("every head has an owner")
}

/// The prefill rank that sends head `head` to decode rank `d` (REFERENCE.md section 3).
pub fn sender(heads: u32, p_tp: u32, d_tp: u32, d: u32, head: u32) -> u32 {
    let (rs, rd) = ((p_tp / heads).max(1), (d_tp / heads).max(1));
    let j = d - first_owner(heads, d_tp, head);
    first_owner(heads, p_tp, head) + j * rs / rd
}

/// The heads prefill rank `p` moves to decode rank `d`, when the pair sends.
pub fn moved_heads(heads: u32, p_tp: u32, p: u32, d_tp: u32, d: u32) -> Option<Range<u32>> {
    let (src, dst) = (owned_heads(heads, p_tp, p), owned_heads(heads, d_tp, d));
    let shared = src.start.max(dst.start)..src.end.min(dst.end);
    (!shared.is_empty() && sender(heads, p_tp, d_tp, d, shared.start) == p).then_some(shared)
}

pub use mori_tp_testkit::Request;

/// A fragmented request of `runs` runs of 1 to 4 pages, each run contiguous on both sides, the
/// runs in a shuffled order with free pages between them, independently on each side: the
/// generator the benchmarks and the CLI share (crates/testkit).
pub fn fragmented_request(seed: u64, runs: usize) -> Request {
    mori_tp_testkit::fragmented_runs(seed, runs, 4)
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

/// A model's KV geometry: heads, elements per head, and whether V has its own buffers.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub name: &'static str,
    pub kv_heads: u32,
    pub head_dim: usize,
    pub separate_v: bool,
}

pub const MODELS: [Model; 8] = [
    Model {
        name: "llama-3.1-8b",
        kv_heads: 8,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "llama-3.1-70b",
        kv_heads: 8,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen2.5-7b",
        kv_heads: 4,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen3-30b-a3b",
        kv_heads: 4,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "qwen2.5-1.5b",
        kv_heads: 2,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "glm-4-9b",
        kv_heads: 2,
        head_dim: 128,
        separate_v: true,
    },
    Model {
        name: "gpt-oss-120b",
        kv_heads: 8,
        head_dim: 64,
        separate_v: true,
    },
    // MLA: one latent "head" of kv_lora_rank 512 + qk_rope_head_dim 64 elements, no V buffer.
    Model {
        name: "deepseek-v3",
        kv_heads: 1,
        head_dim: 576,
        separate_v: false,
    },
];

pub const TP_SIZES: [u32; 5] = [1, 2, 4, 8, 16];
/// bf16 and fp8.
pub const DTYPE_BYTES: [usize; 2] = [2, 1];
pub const PAGE_SIZES: [usize; 2] = [1, 16];
pub const LAYERS: usize = 2;

/// (H, P, D): non-integer ratios, both sides replicated, MQA with odd TP sizes.
pub const ODD_DEPLOYMENTS: [(u32, u32, u32); 6] = [
    (12, 6, 4),
    (12, 4, 6),
    (4, 12, 8),
    (3, 6, 12),
    (2, 6, 4),
    (1, 3, 5),
];

/// How a test moves the bytes of one plan (made from `request`'s pages) from `src[i]` into
/// `dst[i]`: host copies, the HIP engine on a recording runtime, or the C ABI. It checks what it
/// can about its own path and returns the report, or None where the path gives none (the C ABI).
pub type Sender<'a> =
    dyn FnMut(&SlicePlan<'_>, &Request, &[&[u8]], &mut [&mut [u8]]) -> Option<SendReport> + 'a;

pub struct Outcome {
    /// Copies the sender reported (0 from a sender that reports none).
    pub copies: usize,
    pub pages: usize,
}

/// Runs every (prefill rank, decode rank) pair of one deployment through `send` and checks
/// every decode byte.
#[allow(clippy::too_many_arguments)] // one deployment's geometry, named at each call site
pub fn transfer(
    heads: u32,
    bytes_per_head: usize,
    num_buffers: usize,
    p_tp: u32,
    d_tp: u32,
    page_size: usize,
    request: &Request,
    send: &mut Sender<'_>,
) -> Outcome {
    let src = SideBuffers::identified(
        heads,
        p_tp,
        page_size,
        bytes_per_head,
        request.src_capacity_pages,
        num_buffers,
    );
    let initial = SideBuffers::sentinel(
        heads,
        d_tp,
        page_size,
        bytes_per_head,
        request.dst_capacity_pages,
        num_buffers,
    );
    let mut dst = initial.ranks.clone();
    let mut copies = 0;
    for p in 0..p_tp {
        for d in 0..d_tp {
            let config = slice_config(&SliceParams {
                prefill_tp_size: p_tp,
                prefill_tp_rank: p,
                decode_tp_size: d_tp,
                decode_tp_rank: d,
                total_kv_heads: heads,
                page_size: page_size as u32,
                src_item_len: src.item_len() as u64,
                dst_item_len: initial.item_len() as u64,
            })
            .unwrap();
            let plan = SlicePlan::new(&config, &request.src_pages, &request.dst_pages).unwrap();
            let src_bufs: Vec<&[u8]> = src.ranks[p as usize].iter().map(Vec::as_slice).collect();
            let mut dst_bufs: Vec<&mut [u8]> =
                dst[d as usize].iter_mut().map(Vec::as_mut_slice).collect();
            if let Some(report) = send(&plan, request, &src_bufs, &mut dst_bufs) {
                if config.action == Action::Send {
                    assert_eq!(report.copies, plan.num_rects() * num_buffers);
                } else {
                    assert_eq!(report.copies, 0);
                }
                copies += report.copies;
            }
        }
    }
    let expected = expected_decode(&initial, request);
    for d in 0..d_tp as usize {
        for b in 0..num_buffers {
            if dst[d][b] != expected[d][b] {
                let at = dst[d][b]
                    .iter()
                    .zip(&expected[d][b])
                    .position(|(a, e)| a != e)
                    .unwrap();
                panic!(
                    "decode rank {d} buffer {b}: first wrong byte at {at} (page {}, byte {} of \
                     the page)",
                    at / initial.item_len(),
                    at % initial.item_len()
                );
            }
        }
    }
    Outcome {
        copies,
        pages: request.src_pages.len(),
    }
}

/// Every model x dtype x page size x (P, D) of the tables above, through `send`, byte for byte;
/// returns the number of deployments run.
pub fn every_model_deployment(send: &mut Sender<'_>) -> usize {
    let mut deployments = 0;
    for (m, model) in MODELS.iter().enumerate() {
        let num_buffers = if model.separate_v { 2 * LAYERS } else { LAYERS };
        for &dtype in &DTYPE_BYTES {
            for &page_size in &PAGE_SIZES {
                for &p_tp in &TP_SIZES {
                    for &d_tp in &TP_SIZES {
                        assert!(valid_tp(model.kv_heads, p_tp) && valid_tp(model.kv_heads, d_tp));
                        let seed = (m as u64) << 32 | u64::from(p_tp) << 16 | u64::from(d_tp);
                        let runs = if page_size == 1 { 7 } else { 3 };
                        let request = fragmented_request(seed ^ page_size as u64, runs);
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            transfer(
                                model.kv_heads,
                                model.head_dim * dtype,
                                num_buffers,
                                p_tp,
                                d_tp,
                                page_size,
                                &request,
                                &mut *send,
                            )
                        }));
                        if outcome.is_err() {
                            panic!(
                                "{} dtype_bytes={dtype} page_size={page_size} P={p_tp} D={d_tp} \
                                 {request:?}",
                                model.name
                            );
                        }
                        deployments += 1;
                    }
                }
            }
        }
    }
    deployments
}

/// The deployments of [`ODD_DEPLOYMENTS`] through `send`, byte for byte.
pub fn odd_deployments(send: &mut Sender<'_>) {
    for (h, p_tp, d_tp) in ODD_DEPLOYMENTS {
        let request = fragmented_request(u64::from(h * 1000 + p_tp * 10 + d_tp), 5);
        transfer(h, 12, 2, p_tp, d_tp, 4, &request, send);
    }
}

/// Builds tests/fake_hip/fake_hip.cpp (a host-memory stand-in for libamdhip64's functions, for
/// LD_PRELOAD) with `c++` against the installed HIP headers; Err says what is missing.
pub fn build_fake_hip() -> Result<PathBuf, String> {
    build_fake_hip_variant("libfake_hip.so", &[])
}

/// The stand-in of a HIP 5.2 runtime: without hipStreamGetDevice, which HIP 6.0 added.
pub fn build_fake_hip_5_2() -> Result<PathBuf, String> {
    build_fake_hip_variant("libfake_hip_5_2.so", &["-DFAKE_HIP_5_2"])
}

/// tests/fake_hip built as `name` with the preprocessor `defines`.
fn build_fake_hip_variant(name: &str, defines: &[&str]) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = scratch(&["fake_hip"]);
    // The HIP install hip-sys linked against: `hipconfig -p`, else the compiler's default paths.
    let include = Command::new("hipconfig")
        .arg("-p")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| Path::new(String::from_utf8_lossy(&o.stdout).trim()).join("include"));
    let library = out.join(name);
    // Unique per build, also between tests of one process building at once.
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = out.join(format!("{name}.{}.{build}", std::process::id()));
    let mut compile = Command::new("c++");
    compile.args([
        "-std=c++17",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-shared",
        "-fPIC",
    ]);
    compile.arg("-D__HIP_PLATFORM_AMD__").args(defines);
    if let Some(include) = include {
        compile.arg("-I").arg(include);
    }
    compile
        .arg(root.join("tests/fake_hip/fake_hip.cpp"))
        .arg("-o")
        .arg(&partial);
    let output = compile
        .output()
        .map_err(|e| format!("cannot run c++ ({e}): a C++ compiler is needed"))?;
    if !output.status.success() {
        return Err(format!(
            "c++ could not build tests/fake_hip/fake_hip.cpp (are the HIP headers installed? \
             Debian: libamdhip64-dev):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    std::fs::rename(&partial, &library).map_err(|e| format!("rename: {e}"))?;
    Ok(library)
}

// ---- one small send through the C ABI, for the GPU runtime tests ----------------------------

use mori_tp::ffi::{
    MORI_OK, MoriKvBuffers, MoriSendOptions, MoriStatus, MoriTpSliceConfig, MoriTpSliceParams,
    mori_send_kvcache, mori_tp_slice_config,
};

/// The calling thread's last error message.
pub fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { std::ffi::CStr::from_ptr(mori_tp::ffi::mori_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair (1, 3), one-token pages.
pub fn config_2_to_4() -> MoriTpSliceConfig {
    let params = MoriTpSliceParams {
        prefill_tp_size: 2,
        prefill_tp_rank: 1,
        decode_tp_size: 4,
        decode_tp_rank: 3,
        total_kv_heads: 8,
        page_size: 1,
        src_item_len: 64,
        dst_item_len: 32,
    };
    let mut config = MoriTpSliceConfig::default();
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { mori_tp_slice_config(&params, &mut config) },
        MORI_OK
    );
    config
}

/// One small send: 8 heads of 16 bytes, prefill TP 2 -> decode TP 4, pair (1, 3), one-token
/// pages 0, 1, 3 (two rects), between source buffers of 4 * 64 bytes and destination buffers of
/// 4 * 32 bytes, with `options`. Returns the status and the message (if it failed).
///
/// # Safety
/// `src` and `dst` must hold that many bytes each, where the backend of `options` reaches them,
/// until the copies are complete (on return, or refused, unless the stream runs them later).
pub unsafe fn send_pages_0_1_3(
    src: &[*const std::ffi::c_void],
    dst: &[*mut std::ffi::c_void],
    options: &MoriSendOptions,
) -> (MoriStatus, String) {
    let config = config_2_to_4();
    let buffers = MoriKvBuffers {
        src: src.as_ptr(),
        dst: dst.as_ptr(),
        num_buffers: src.len(),
        src_capacity: 4 * 64,
        dst_capacity: 4 * 32,
    };
    let pages = [0, 1, 3];
    // SAFETY: valid pointers and lengths; the buffers as the caller guarantees.
    let status = unsafe {
        mori_send_kvcache(
            &config,
            &buffers,
            pages.as_ptr(),
            pages.as_ptr(),
            3,
            options,
        )
    };
    let message = if status == MORI_OK {
        String::new()
    } else {
        last_error()
    };
    (status, message)
}

/// [`send_pages_0_1_3`] over host memory, two buffers. Returns the status, the message (if it
/// failed) and whether every destination byte is still what it was.
pub fn small_send(options: &MoriSendOptions) -> (MoriStatus, String, bool) {
    let src = [vec![7u8; 4 * 64], vec![8u8; 4 * 64]];
    let mut dst = [vec![9u8; 4 * 32], vec![9u8; 4 * 32]];
    let srcs = [src[0].as_ptr().cast(), src[1].as_ptr().cast()];
    let [d0, d1] = &mut dst;
    let dsts = [d0.as_mut_ptr().cast(), d1.as_mut_ptr().cast()];
    // SAFETY: host buffers of the stated sizes; the copies are complete on return or refused.
    let (status, message) = unsafe { send_pages_0_1_3(&srcs, &dsts, options) };
    (status, message, dst.iter().flatten().all(|&b| b == 9))
}

/// One-token pages of [`config_2_to_4`] that [`send_uploaded`] moves, none next to another on
/// either side: a rect table too big for the kernel's argument, so a GPU backend uploads it
/// (8 bytes a rect: about 33.7 KB, beyond the 32,696 bytes of the wide entry's argument on CUDA
/// 12.1+ drivers, as well as the 4 KiB one).
pub const UPLOADED_PAGES: usize = 4200;

/// What the destination of a [`send_uploaded`] from source bytes `source` into bytes 9 holds: the
/// second half (heads 6 and 7) of each source token in its destination page.
pub fn uploaded_result(source: u8) -> Vec<u8> {
    spread_result(source, UPLOADED_PAGES)
}

/// Sends the even source pages of `2 * UPLOADED_PAGES` into the odd destination pages, from the
/// last down, one buffer pair with `options`: the status and the message (if it failed).
///
/// # Safety
/// `src` and `dst` must hold `2 * UPLOADED_PAGES` pages (64 and 32 bytes each) where the backend
/// of `options` reaches them, until the copies are complete.
pub unsafe fn send_uploaded(
    src: *const std::ffi::c_void,
    dst: *mut std::ffi::c_void,
    options: &MoriSendOptions,
) -> (MoriStatus, String) {
    // SAFETY: as the caller guarantees.
    unsafe { send_spread(src, dst, UPLOADED_PAGES, options) }
}

/// What the destination of a [`send_spread`] of `pages` pages from source bytes `source` into
/// bytes 9 holds.
pub fn spread_result(source: u8, pages: usize) -> Vec<u8> {
    let mut want = vec![9u8; 2 * pages * 32];
    for p in 0..pages {
        let page = 2 * pages - 1 - 2 * p;
        want[page * 32..page * 32 + 32].fill(source);
    }
    want
}

/// [`send_uploaded`] of `pages` pages (a rect each, none next to another: a table of about 8
/// bytes a page): the even source pages of `2 * pages` into the odd destination pages, from the
/// last down.
///
/// # Safety
/// `src` and `dst` must hold `2 * pages` pages (64 and 32 bytes each) where the backend of
/// `options` reaches them, until the copies are complete.
pub unsafe fn send_spread(
    src: *const std::ffi::c_void,
    dst: *mut std::ffi::c_void,
    pages: usize,
    options: &MoriSendOptions,
) -> (MoriStatus, String) {
    let config = config_2_to_4();
    let total = 2 * pages;
    let src_pages: Vec<i32> = (0..pages as i32).map(|p| 2 * p).collect();
    let dst_pages: Vec<i32> = (0..pages as i32)
        .map(|p| total as i32 - 1 - 2 * p)
        .collect();
    let (srcs, dsts) = ([src], [dst]);
    let buffers = MoriKvBuffers {
        src: srcs.as_ptr(),
        dst: dsts.as_ptr(),
        num_buffers: 1,
        src_capacity: (total * 64) as u64,
        dst_capacity: (total * 32) as u64,
    };
    // SAFETY: valid pointers and lengths; the buffers as the caller guarantees.
    let status = unsafe {
        mori_send_kvcache(
            &config,
            &buffers,
            src_pages.as_ptr(),
            dst_pages.as_ptr(),
            pages,
            options,
        )
    };
    let message = if status == MORI_OK {
        String::new()
    } else {
        last_error()
    };
    (status, message)
}

// ---------------------------------------------------------------------------------------------
// The user documents: README.md and the docs/ book

/// README.md and every page of the docs/ book (docs/src/**/*.md), as (path relative to the
/// repository root, text), README.md first and the pages in path order.
pub fn user_documents() -> Vec<(String, String)> {
    fn pages(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read docs/src") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                pages(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    pages(&root().join("docs/src"), &mut files);
    files.sort();
    let mut out = vec![(
        "README.md".to_string(),
        std::fs::read_to_string(root().join("README.md")).expect("README.md"),
    )];
    for file in files {
        let shown = file
            .strip_prefix(root())
            .expect("under the root")
            .display()
            .to_string();
        out.push((
            shown,
            std::fs::read_to_string(&file).expect("a page of the book"),
        ));
    }
    out
}

/// One fenced block of a Markdown document.
#[derive(Debug, Clone)]
pub struct Fenced {
    /// The document's path, for messages.
    pub document: String,
    /// The line of the opening fence (1-based).
    pub line: usize,
    /// The info string's first word (`c`, `cpp`, `python`, `sh`, `text`, ...).
    pub language: String,
    /// The info string's further words (`runnable`, `output`).
    pub marks: Vec<String>,
    pub text: String,
}

impl Fenced {
    pub fn has(&self, mark: &str) -> bool {
        self.marks.iter().any(|m| m == mark)
    }
}

/// The fenced blocks of a document, in order.
pub fn fenced_blocks(document: &str, text: &str) -> Vec<Fenced> {
    let mut out = Vec::new();
    let mut open: Option<Fenced> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => {
                let mut words = info.split_whitespace().map(str::to_string);
                open = Some(Fenced {
                    document: document.to_string(),
                    line: i + 1,
                    language: words.next().unwrap_or_default(),
                    marks: words.collect(),
                    text: String::new(),
                });
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(block), None) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// The `runnable` blocks of every user document, each with the `text output` block that follows
/// it directly (only blank lines between), if any: what it must print.
pub fn runnable_snippets() -> Vec<(Fenced, Option<String>)> {
    let mut out = Vec::new();
    for (document, text) in user_documents() {
        let blocks = fenced_blocks(&document, &text);
        let lines: Vec<&str> = text.lines().collect();
        for (k, block) in blocks.iter().enumerate() {
            if !block.has("runnable") {
                continue;
            }
            let end = block.line + block.text.lines().count(); // the closing fence, 0-based
            let output = blocks.get(k + 1).filter(|next| {
                next.language == "text"
                    && next.has("output")
                    && lines[end + 1..next.line - 1]
                        .iter()
                        .all(|l| l.trim().is_empty())
            });
            out.push((block.clone(), output.map(|o| o.text.clone())));
        }
    }
    out
}

/// Why MORI-IO's two-process tests cannot run here, or None when they can: they run in the
/// chroot of `hip/mori-io-build.sh` (root, and a build of ROCm/mori 1e3ce4e1 that the script
/// made in target/mori-io/current: `.ci/run` makes it before `cargo test`).
pub fn mori_io_missing() -> Option<String> {
    let ok = root().join("target/mori-io/current/ok");
    if !ok.is_file() {
        return Some(format!(
            "no MORI-IO build ({} is missing): run hip/mori-io-build.sh (as root) with a \
             checkout of ROCm/mori at commit 1e3ce4e1 (branch feature/tcp-backend) in \
             MORI_TP_MORI_SRC",
            ok.display()
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("MORI-IO's build runs in a chroot, which needs root".into());
    }
    None
}

/// `hip/mori-io-build.sh --run args...`: `args` in MORI-IO's chroot, in the checkout.
pub fn mori_io_command(args: &[&str]) -> Command {
    let mut command = Command::new(root().join("hip/mori-io-build.sh"));
    command.arg("--run").args(args).current_dir(root());
    command
}
