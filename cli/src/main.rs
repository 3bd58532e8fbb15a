//! `mori-tp`: check, explain and simulate the KV-cache transfer between a prefill engine and a
//! decode engine that run different tensor-parallel sizes, with the mori-tp library.
//!
//! Every slice, plan and copy comes from the library's Rust API; this binary only chooses the
//! model, formats and verifies.

mod config;
mod dtype;
mod facts;
mod fields;
mod group_plan;
mod layout;
mod model;
mod plan;
mod simulate;
mod svg;

use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};

use crate::config::read_config;
use crate::dtype::{DTYPE_SPELLINGS, Dtype, DtypeArg, parse_dtype};
use crate::facts::SsmDefault;
use crate::group_plan::StateDtypes;
use crate::layout::{Layout, LayoutError, MAX_TP_SIZE, PageOrder, Paging};
use crate::model::{Attention, Model, ModelChoice, PRESETS, parse_model};
use crate::simulate::BackendArg;

/// The deployment `mori-tp` without a command simulates (`cargo run --release`). `plan` and
/// `simulate` assume nothing: they need the model and both TP sizes.
const DEFAULT_DEPLOYMENT: [&str; 6] = [
    "--model",
    "qwen2.5-7b",
    "--prefill-tp",
    "2",
    "--decode-tp",
    "8",
];

const ABOUT: &str = "Check, explain and simulate moving an LLM's KV cache between a prefill \
                     engine and a decode engine that use different tensor-parallel sizes";

const LONG_ABOUT: &str = "\
Check, explain and simulate moving an LLM's KV cache between a prefill engine and a decode engine
that use different tensor-parallel (TP) sizes.

In disaggregated serving, a prefill engine computes a prompt's KV cache and ships it to a decode
engine. Each engine splits the model's KV heads over its TP ranks (a model with 4 KV heads on TP 2
puts 2 heads on each rank; on TP 8 each head is copied onto 2 ranks). So every decode rank must
receive exactly the heads it owns, from the right prefill rank, at the right byte offsets, for
every token of every layer. mori-tp computes that, refuses layouts that cannot work, and copies
the bytes with one strided 2D copy per run of pages.

With no command, mori-tp runs `simulate` on a deployment that older SGLang releases get wrong:
qwen2.5-7b (4 KV heads) with prefill TP 2 and decode TP 8.";

const AFTER_HELP: &str = "\
Examples:
  mori-tp                                          simulate the default deployment
  mori-tp presets                                  list the built-in models
  mori-tp plan --model llama-3.1-70b --prefill-tp 16 --decode-tp 4
  mori-tp plan --model meta-llama/Llama-3.1-8B-Instruct --prefill-tp 2 --decode-tp 8 \
      --svg /tmp/layout.svg
  mori-tp plan --config path/to/model-dir --prefill-tp 8 --decode-tp 2 --json
  mori-tp plan --config cli/configs/nemotron-h-8b-base-8k --prefill-tp 2 --decode-tp 4
  mori-tp plan --config cli/configs/qwen3-next-80b-a3b --prefill-tp 2 --decode-tp 4 \
      --dtype fp8 --num-speculative-tokens 2
  mori-tp simulate --model deepseek-v3 --prefill-tp 8 --decode-tp 4 --page-size 64
  mori-tp simulate --model llama-3.1-8b --prefill-tp 8 --decode-tp 2 --prefill-layout hnd \
      --decode-layout nhd --prefill-page-size 16 --decode-page-size 64 --tokens 1000

`plan` and `simulate` need the model (--model, --config or --kv-heads with --head-dim) and both
TP sizes (--prefill-tp, --decode-tp): they check the deployment you describe, never a default.

Exit status: 0 success; 1 simulate found a wrong byte (or a copy failed); 2 bad usage or an
unreadable config.json; 3 the layout cannot work (the message names the values and the nearest
valid TP sizes); 4 the requested copy backend cannot run on this machine. A closed stdout or
stderr (`mori-tp plan | head`) changes none of these: what cannot be written is dropped.";

#[derive(Parser, Debug)]
#[command(name = "mori-tp", version, about = ABOUT, long_about = LONG_ABOUT, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check a layout and show which prefill rank sends which KV heads to each decode rank
    #[command(
        long_about = "Check a layout and show, for each decode rank, which prefill rank sends it \
                      which KV heads, at which byte offsets inside each token, which prefill \
                      ranks skip because another replica sends the same head, which staging an \
                      RDMA connector should use for each sending pair (pair_staging_for: who \
                      packs, who unpacks, the staging bytes per request) and the segments an RDMA \
                      engine gets per buffer with it and without it (for the request's pages \
                      back to back), and how many bytes the decode rank receives per token and \
                      per request.\n\n\
                      Each engine has its own page layout (--prefill-layout, --decode-layout: nhd \
                      token-major or hnd head-major) and page size (--prefill-page-size, \
                      --decode-page-size; --page-size sets both). A request of --tokens N tokens \
                      may end in a partly used page; the plan says so.\n\n\
                      A layout works only if each TP size divides the model's KV head count or \
                      is a multiple of it; otherwise mori-tp exits with status 3 and names the \
                      nearest valid TP sizes (with --json, as a JSON error object on stdout)."
    )]
    Plan(PlanArgs),
    /// Move one request's KV cache in host memory through the library and verify every byte
    #[command(
        long_about = "Move one request's KV cache in host memory through the library and verify \
                      every byte.\n\n\
                      Allocates the KV buffers of every prefill and decode rank in each side's \
                      page layout and page size, fills the prefill side with bytes that identify \
                      their layer buffer, page, slot and head (written where the layout puts \
                      that head: head-major pages keep a head's tokens together), and the decode \
                      side with a sentinel. Then, for every pair the library says must send, \
                      plans a fragmented list of pages on each side and copies the request's \
                      --tokens tokens with the library's host engine (or its HIP or CUDA engine \
                      with --backend hip or cuda), and checks every decode byte: the slots of the request's \
                      tokens must hold exactly the heads each decode rank owns, everything else \
                      (other pages, the slots after the last token of a partial last page) must \
                      be untouched. Then moves every pair again the way an RDMA connector would \
                      with staging: pack, copy the segments of pair_segments, unpack, into a \
                      second set of decode buffers, checked the same way. Prints the copies issued, compared with a per-token \
                      copy plan, the segments an RDMA engine would get (per token, direct, \
                      staged), the bytes moved and the copy speed. Exits with status 1 on any \
                      wrong byte.\n\n\
                      Only the first --layers-limit layers are simulated (every layer moves the \
                      same way) to keep memory modest."
    )]
    Simulate(SimulateArgs),
    /// List the built-in models and the KV-cache figures mori-tp uses for them
    Presets {
        /// Print one JSON array instead of a table
        #[arg(long)]
        json: bool,
    },
}

/// A whole number from `min` to `max`, with messages about the value: negative numbers,
/// fractions, words and values past the limit each get their own.
fn whole_number(
    what: &'static str,
    min: u64,
    max: u64,
) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |text: &str| {
        let text = text.trim();
        let range = format!("{what} is a whole number from {min} to {max}");
        if let Ok(n) = text.parse::<i128>() {
            return if n < 0 {
                Err(format!("{n} is negative: {range}"))
            } else if n < i128::from(min) {
                Err(format!("{n} is too small: {range}"))
            } else if n > i128::from(max) {
                Err(format!("{n} is too large: {range}"))
            } else {
                Ok(n as u64)
            };
        }
        if text.parse::<f64>().is_ok() {
            return Err(format!("{text} is not a whole number: {range}"));
        }
        Err(format!("`{text}` is not a number: {range}"))
    }
}

/// [`whole_number`] for `u32` arguments from `min` to `max`.
fn whole_number_u32(
    what: &'static str,
    min: u32,
    max: u32,
) -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync + 'static {
    let parse = whole_number(what, u64::from(min), u64::from(max));
    move |text: &str| parse(text).map(|n| n as u32)
}

/// [`whole_number`] for `u32` arguments.
fn count(
    what: &'static str,
    max: u32,
) -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync + 'static {
    let parse = whole_number(what, 1, u64::from(max));
    move |text: &str| parse(text).map(|n| n as u32)
}

/// Which model, and how each engine is laid out.
#[derive(Args, Debug)]
struct DeploymentArgs {
    /// Built-in model, by preset name or Hugging Face id, in any case
    /// (meta-llama/Llama-3.1-70B-Instruct is llama-3.1-70b); `mori-tp presets` lists them
    /// (one of --model, --config or --kv-heads is required)
    #[arg(
        long,
        value_name = "NAME",
        value_parser = parse_model,
        conflicts_with_all = ["config", "kv_heads"],
        help_heading = "Model"
    )]
    model: Option<ModelChoice>,

    /// Read the model from a Hugging Face config.json, or from the config.json in a model
    /// directory (KV heads, head dim, layers, torch_dtype; GQA, MLA and GLM configs, and the
    /// groups of hybrid models: sliding-window layers, Gated DeltaNet and Mamba2 states,
    /// DeepSeek V3.2's indexer; cli/configs holds examples)
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with = "kv_heads",
        help_heading = "Model"
    )]
    config: Option<PathBuf>,

    /// Describe the model by hand: KV heads before tensor parallelism (num_key_value_heads; 1 for
    /// MLA and MQA)
    #[arg(
        long,
        value_name = "N",
        requires = "head_dim",
        allow_negative_numbers = true,
        value_parser = count("a KV head count", u32::MAX),
        help_heading = "Model"
    )]
    kv_heads: Option<u32>,

    /// With --kv-heads: elements per KV head (MLA: kv_lora_rank + qk_rope_head_dim)
    #[arg(
        long,
        value_name = "N",
        requires = "kv_heads",
        allow_negative_numbers = true,
        value_parser = count("a head dimension", u32::MAX),
        help_heading = "Model"
    )]
    head_dim: Option<u32>,

    /// With --kv-heads 1 --head-dim N (a model described by hand): the model caches one MLA
    /// latent per layer instead of K and V (presets and configs know their attention already)
    #[arg(long, help_heading = "Model")]
    mla: bool,

    /// Number of layers; overrides the preset's or config's [default with --kv-heads: 1, with a
    /// note saying so]
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = count("a layer count", u32::MAX),
        help_heading = "Model"
    )]
    layers: Option<u32>,

    /// Element type of the KV cache (both engines; vLLM's --kv-cache-dtype), as mori-tp,
    /// PyTorch, vLLM or SGLang spell it: bf16 (bfloat16), fp16 (float16, half), fp8, fp8_e4m3
    /// (float8_e4m3fn, ..fnuz), fp8_e5m2 (float8_e5m2), fp32 (float32, float), or auto: the
    /// config.json's torch_dtype. Mamba2 and Gated DeltaNet states keep their own dtypes
    /// (--mamba-cache-dtype, --mamba-ssm-cache-dtype) [default: auto with --config, else bf16]
    #[arg(
        long,
        value_name = "DTYPE",
        value_parser = parse_dtype,
        help_heading = "Layout"
    )]
    dtype: Option<DtypeArg>,

    /// Element type of Mamba2 and Gated DeltaNet conv states, as vLLM's --mamba-cache-dtype
    /// (models read with --config that keep them) [default: auto, the model's dtype (the
    /// config's torch_dtype, else bf16), never the KV cache's; SGLang keeps them in bf16 unless
    /// SGLANG_MAMBA_CONV_DTYPE says otherwise]
    #[arg(
        long,
        value_name = "DTYPE",
        value_parser = parse_dtype,
        help_heading = "Layout"
    )]
    mamba_cache_dtype: Option<DtypeArg>,

    /// Element type of Mamba2 SSM and Gated DeltaNet recurrent states, as vLLM's
    /// --mamba-ssm-cache-dtype (also spelled --ssm-dtype) [default: auto, as vLLM chooses: the
    /// config's mamba_ssm_cache_dtype or mamba_ssm_dtype, else fp32 for Nemotron-H, else the conv
    /// state's dtype; SGLang keeps them in fp32 unless SGLANG_MAMBA_SSM_DTYPE or the config's
    /// mamba_ssm_dtype says otherwise]
    #[arg(
        long,
        visible_alias = "ssm-dtype",
        value_name = "DTYPE",
        value_parser = parse_dtype,
        help_heading = "Layout"
    )]
    mamba_ssm_cache_dtype: Option<DtypeArg>,

    /// Speculative tokens the engines run with (vLLM's --speculative-config
    /// num_speculative_tokens, such as Qwen3-Next's MTP): vLLM keeps a Mamba2 or Gated DeltaNet
    /// conv state of conv_kernel - 1 + N time steps (SGLang keeps them apart: give 0 for SGLang)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        allow_negative_numbers = true,
        value_parser = whole_number_u32("a speculative token count", 0, 1 << 16),
        help_heading = "Layout"
    )]
    num_speculative_tokens: u32,

    /// Tokens per KV-cache page, both engines [default: 1]
    #[arg(
        long,
        value_name = "TOKENS",
        allow_negative_numbers = true,
        value_parser = count("a page size", u32::MAX),
        help_heading = "Layout"
    )]
    page_size: Option<u32>,

    /// Tokens per KV-cache page of the prefill engine, where it differs from the decode engine's
    /// [default: --page-size]
    #[arg(
        long,
        value_name = "TOKENS",
        allow_negative_numbers = true,
        value_parser = count("a page size", u32::MAX),
        help_heading = "Layout"
    )]
    prefill_page_size: Option<u32>,

    /// Tokens per KV-cache page of the decode engine [default: --page-size]
    #[arg(
        long,
        value_name = "TOKENS",
        allow_negative_numbers = true,
        value_parser = count("a page size", u32::MAX),
        help_heading = "Layout"
    )]
    decode_page_size: Option<u32>,

    /// Page layout of the prefill engine, in any case: nhd or hnd, as that engine keeps its
    /// pages (SGLang: nhd; vLLM: nhd with FlashAttention on CUDA, hnd with NIXL and on ROCm)
    #[arg(
        long,
        value_name = "LAYOUT",
        value_enum,
        ignore_case = true,
        default_value_t = PageOrder::Nhd,
        help_heading = "Layout"
    )]
    prefill_layout: PageOrder,

    /// Page layout of the decode engine, in any case: nhd or hnd, as that engine keeps its pages
    #[arg(
        long,
        value_name = "LAYOUT",
        value_enum,
        ignore_case = true,
        default_value_t = PageOrder::Nhd,
        help_heading = "Layout"
    )]
    decode_layout: PageOrder,

    /// Tensor-parallel size of the prefill engine (the sender), 1 to 1024 (required)
    #[arg(
        long,
        value_name = "P",
        allow_negative_numbers = true,
        value_parser = count("a TP size", MAX_TP_SIZE),
        help_heading = "Layout"
    )]
    prefill_tp: Option<u32>,

    /// Tensor-parallel size of the decode engine (the receiver), 1 to 1024 (required)
    #[arg(
        long,
        value_name = "D",
        allow_negative_numbers = true,
        value_parser = count("a TP size", MAX_TP_SIZE),
        help_heading = "Layout"
    )]
    decode_tp: Option<u32>,

    /// Tokens in one request; the last page of a side may be partly used (its slots after the
    /// request's tokens are never written)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        allow_negative_numbers = true,
        value_parser = count("a token count", u32::MAX),
        help_heading = "Layout"
    )]
    tokens: u32,
}

#[derive(Args, Debug)]
struct PlanArgs {
    #[command(flatten)]
    deployment: DeploymentArgs,

    /// Print one JSON object instead of text: {"model", "prefill_tp", "decode_tp", ...,
    /// "prefill_layout", "decode_layout", "prefill_page_size", "decode_page_size", ..., "pairs":
    /// [one per pair that shares a head; sending pairs carry "staging": "none", "src", "dst" or
    /// "both", "staging_bytes_per_request", "segments_per_buffer",
    /// "direct_segments_per_buffer", "segments_per_request", "direct_segments_per_request" (per
    /// buffer times the request's buffers), and both ranks' layouts], "decode_ranks": [one per decode
    /// rank]}; with --config (or a preset of several groups) also "groups": [every group of
    /// layers, its parts, its pairs that send, its "replicas" (runs of prefill ranks that only
    /// skip) and what each decode rank receives of it]. Head ranges are half-open [first, end):
    /// "shared_heads": [2, 4] means heads 2 and 3. On a layout that cannot work, prints
    /// {"error": {...}} instead, with the same exit status.
    #[arg(long)]
    json: bool,

    /// Also draw the layout as an SVG picture into FILE (`-`: to stdout, instead of the plan):
    /// prefill ranks p0.. and decode ranks d0.. with their heads, an arrow per sending pair
    /// labelled with its heads, replicas that skip as dashed lines (readable up to TP 32 a side;
    /// drawn up to 128)
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct SimulateArgs {
    #[command(flatten)]
    deployment: DeploymentArgs,

    /// Simulate at most this many layers (every layer moves the same way; more only costs memory)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4,
        allow_negative_numbers = true,
        value_parser = count("a layer count", u32::MAX)
    )]
    layers_limit: u32,

    /// Seed of the page layout and of the data
    #[arg(
        long,
        value_name = "S",
        default_value_t = 1,
        allow_negative_numbers = true,
        value_parser = whole_number("a seed", 0, u64::MAX)
    )]
    seed: u64,

    /// Chance that a page starts a new run of adjacent pages: 0 = the request is one contiguous
    /// run, 1 = no two pages are adjacent
    #[arg(
        long,
        value_name = "F",
        default_value_t = 0.1,
        allow_negative_numbers = true,
        value_parser = fraction
    )]
    fragmentation: f64,

    /// How the bytes move: the library's host engine, or its HIP or CUDA engine
    /// (hipMemcpy2DAsync, cuMemcpy2DAsync; the buffers stay in host memory, so this checks that
    /// path end to end on a machine with an AMD GPU and a build with --features hip, or an NVIDIA
    /// GPU and --features cuda)
    #[arg(long, value_enum, default_value_t = BackendArg::Host)]
    backend: BackendArg,
}

fn fraction(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        Ok(f) => Err(format!("{f} is outside 0 to 1: it is a chance")),
        Err(_) => Err(format!("`{text}` is not a number from 0 to 1")),
    }
}

/// What `plan` and `simulate` were not told: the model, a TP size. They assume none of them (a
/// plan of a deployment nobody described would look like an answer), so each missing one is
/// named, with the flags that give it.
fn missing_deployment(args: &DeploymentArgs) -> Option<String> {
    let mut missing = Vec::new();
    if args.model.is_none() && args.config.is_none() && args.kv_heads.is_none() {
        missing.push(
            "the model (--model NAME, a preset or Hugging Face id that `mori-tp presets` lists; \
             --config PATH, a config.json or model directory; or --kv-heads N --head-dim N)"
                .to_string(),
        );
    }
    for (value, flag, engine) in [
        (args.prefill_tp, "--prefill-tp P", "prefill"),
        (args.decode_tp, "--decode-tp D", "decode"),
    ] {
        if value.is_none() {
            missing.push(format!(
                "{flag} (the {engine} engine's tensor-parallel size)"
            ));
        }
    }
    (!missing.is_empty()).then(|| {
        format!(
            "give {}: mori-tp assumes no model and no TP size",
            missing.join(", and ")
        )
    })
}

/// A failure and the exit status it maps to.
enum Failure {
    /// 1: simulate found a wrong byte (the report, for stdout).
    Mismatch(String),
    /// 1: a library call failed, or the output could not be written.
    Failed(String),
    /// 2: bad input the argument parser could not catch (an unreadable config.json).
    Usage(String),
    /// 3: the layout cannot work.
    Layout(LayoutError),
    /// 4: the requested backend cannot run here.
    Backend(String),
    /// 1: stdout could not be written (a closed pipe ends the program quietly instead).
    Output(io::Error),
}

impl Failure {
    fn exit_status(&self) -> u8 {
        match self {
            Failure::Mismatch(_) | Failure::Failed(_) | Failure::Output(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Layout(_) => 3,
            Failure::Backend(_) => 4,
        }
    }

    /// The message for stderr.
    fn message(&self) -> String {
        match self {
            Failure::Mismatch(_) => {
                "the simulated transfer put wrong bytes on the decode side".into()
            }
            Failure::Failed(m) | Failure::Usage(m) | Failure::Backend(m) => m.clone(),
            Failure::Layout(e) => e.to_string(),
            Failure::Output(e) => format!("cannot write the output: {e}"),
        }
    }

    /// The error as one JSON object, for `--json` readers.
    fn json(&self) -> Value {
        let kind = match self {
            Failure::Mismatch(_) => "mismatch",
            Failure::Failed(_) | Failure::Output(_) => "failed",
            Failure::Usage(_) => "usage",
            Failure::Layout(_) => "invalid_layout",
            Failure::Backend(_) => "backend_unavailable",
        };
        let mut error = json!({
            "exit_status": self.exit_status(),
            "kind": kind,
            "message": self.message(),
        });
        if let Failure::Layout(e) = self {
            let problems: Vec<Value> = e
                .problems
                .iter()
                .map(|problem| {
                    let mut value = json!({ "message": problem.message });
                    if let Some(t) = &problem.topology {
                        value["side"] = json!(match t.side {
                            mori_tp::Side::Prefill => "prefill",
                            mori_tp::Side::Decode => "decode",
                        });
                        value["tp_size"] = json!(t.tp_size);
                        value["kv_heads"] = json!(t.kv_heads);
                        value["nearest_valid_tp_sizes"] = json!(t.nearest);
                    }
                    value
                })
                .collect();
            error["summary"] = json!(e.summary);
            error["problems"] = json!(problems);
        }
        json!({ "error": error })
    }
}

impl From<LayoutError> for Failure {
    fn from(e: LayoutError) -> Self {
        Failure::Layout(e)
    }
}

impl From<layout::Failure> for Failure {
    fn from(e: layout::Failure) -> Self {
        match e {
            layout::Failure::Layout(e) => Failure::Layout(e),
            layout::Failure::Io(e) => Failure::Output(e),
        }
    }
}

impl DeploymentArgs {
    /// The model, and notes about assumptions made for it.
    fn model(&self, notes: &mut Vec<String>) -> Result<Model, Failure> {
        if self.mla && self.kv_heads.is_none() {
            let given = match (&self.model, &self.config) {
                (Some(choice), _) => Some(format!(
                    "--model {} already says its attention ({})",
                    choice.typed,
                    choice.preset.attention.label()
                )),
                (None, Some(path)) => Some(format!(
                    "--config {} says its attention from its config.json (kv_lora_rank for MLA)",
                    path.display()
                )),
                (None, None) => None,
            };
            return Err(Failure::Usage(match given {
                Some(given) => format!(
                    "--mla describes a model given by hand (--kv-heads 1 --head-dim N --mla); \
                     {given}: leave out --mla"
                ),
                None => "--mla describes a model given by hand: add --kv-heads 1 and --head-dim \
                         N (kv_lora_rank + qk_rope_head_dim, 576 for DeepSeek-V3)"
                    .into(),
            }));
        }
        let mut model = if let Some(path) = &self.config {
            read_config(path).map_err(Failure::Usage)?
        } else if let (Some(kv_heads), Some(head_dim)) = (self.kv_heads, self.head_dim) {
            if self.mla && kv_heads != 1 {
                return Err(Failure::Usage(format!(
                    "--mla caches one latent head per token per layer, so --kv-heads must be 1, \
                     not {kv_heads} (leave out --mla for a model with {kv_heads} KV heads and \
                     separate K and V)"
                )));
            }
            if self.layers.is_none() {
                notes.push(
                    "--kv-heads without --layers assumes 1 layer: the per-token and per-request \
                     totals cover one layer (give --layers N for the whole model)"
                        .into(),
                );
            }
            Model {
                name: "custom model".into(),
                kv_heads,
                head_dim,
                layers: 1,
                attention: if self.mla {
                    Attention::Mla
                } else {
                    Attention::KeyValue
                },
                torch_dtype: None,
                facts: None,
            }
        } else if let Some(choice) = &self.model {
            if !choice.typed.eq_ignore_ascii_case(choice.preset.name) {
                let p = choice.preset;
                notes.push(format!(
                    "{} has the KV-cache shape of the {} preset: {} KV head{}, head_dim {}, {} \
                     layers",
                    choice.typed,
                    p.name,
                    p.kv_heads,
                    if p.kv_heads == 1 { "" } else { "s" },
                    p.head_dim,
                    p.layers
                ));
            }
            choice.preset.into()
        } else {
            return Err(Failure::Usage(missing_deployment(self).unwrap_or_default()));
        };
        if let Some(layers) = self.layers {
            match &mut model.facts {
                Some(facts) if facts.is_hybrid() => {
                    return Err(Failure::Usage(format!(
                        "--layers {layers}: {} has {} groups of layers ({}), each with its own \
                         layers from the config; leave out --layers",
                        model.name,
                        facts.groups.len(),
                        facts
                            .groups
                            .iter()
                            .map(|g| g.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                Some(facts) => {
                    facts.total_layers = layers;
                    facts.groups[0].layers = (0..layers).collect();
                }
                None => {}
            }
            model.layers = layers;
        }
        Ok(model)
    }

    /// The conv state's and the SSM state's dtypes, as vLLM chooses them: the conv state in
    /// --mamba-cache-dtype, else the model's dtype (never the KV cache's); the SSM state in
    /// --mamba-ssm-cache-dtype, else the config's, else fp32 for Nemotron-H, else the conv
    /// state's. A default that differs from what SGLang would choose gets a note.
    fn state_dtypes(&self, model: &Model, notes: &mut Vec<String>) -> Result<StateDtypes, Failure> {
        let model_dtype = match model.torch_dtype.as_deref().map(Dtype::parse) {
            Some(Some(dtype)) => dtype,
            _ => Dtype::Bf16,
        };
        let Some(facts) = model.facts.as_ref().filter(|f| f.has_state()) else {
            return Ok(StateDtypes {
                conv: model_dtype,
                ssm: model_dtype,
            });
        };
        let conv = match self.mamba_cache_dtype {
            Some(DtypeArg::Is(dtype)) => dtype,
            Some(DtypeArg::Auto) | None => model_dtype,
        };
        let ssm = match (self.mamba_ssm_cache_dtype, facts.ssm_default()) {
            (Some(DtypeArg::Is(dtype)), _) => dtype,
            (_, SsmDefault::Config(field, text)) => Dtype::parse(&text).ok_or_else(|| {
                Failure::Usage(format!(
                    "{}'s {field} \"{text}\" is not a dtype mori-tp knows; give \
                     --mamba-ssm-cache-dtype ({DTYPE_SPELLINGS})",
                    model.name,
                ))
            })?,
            (_, SsmDefault::NemotronH) => Dtype::Fp32,
            (_, SsmDefault::Conv) => conv,
        };
        if self.mamba_cache_dtype.is_none() || self.mamba_ssm_cache_dtype.is_none() {
            let ssm_from = match facts.ssm_default() {
                SsmDefault::Config(field, _) => format!("the config's {field}"),
                SsmDefault::NemotronH => "vLLM's Nemotron-H default".into(),
                SsmDefault::Conv => "the conv state's".into(),
            };
            notes.push(format!(
                "{}'s states are taken as vLLM keeps them: conv state {conv}{}, SSM state \
                 {ssm}{}; SGLang keeps the conv state in bf16 and the SSM state in fp32 (or the \
                 config's mamba_ssm_dtype): give --mamba-cache-dtype and \
                 --mamba-ssm-cache-dtype to say which",
                model.name,
                if self.mamba_cache_dtype.is_none() {
                    " (the model's dtype)".to_string()
                } else {
                    String::new()
                },
                if self.mamba_ssm_cache_dtype.is_none() {
                    format!(" ({ssm_from})")
                } else {
                    String::new()
                },
            ));
        }
        Ok(StateDtypes { conv, ssm })
    }

    /// The plan of every group, for a model read from a config.json or a preset of several
    /// groups: the checks `plan` and `simulate` share.
    fn groups(
        &self,
        layout: &Layout,
        notes: &mut Vec<String>,
    ) -> Result<Option<group_plan::GroupsPlan>, Failure> {
        let Some(facts) = &layout.model.facts else {
            return Ok(None);
        };
        let states = self.state_dtypes(&layout.model, notes)?;
        if self.num_speculative_tokens > 0 && !facts.groups.iter().any(|g| g.name == "conv_state") {
            notes.push(format!(
                "--num-speculative-tokens {} changes only a conv state's time steps, and {} has \
                 none",
                self.num_speculative_tokens, layout.model.name
            ));
        }
        Ok(Some(group_plan::GroupsPlan::new(
            facts,
            layout,
            states,
            self.tokens,
            self.num_speculative_tokens,
        )?))
    }

    /// The KV-cache dtype: as given, or the config's own for `auto` (the default with --config).
    fn dtype(&self, model: &Model, notes: &mut Vec<String>) -> Result<Dtype, Failure> {
        let from_config = model.torch_dtype.as_deref();
        match (self.dtype, from_config) {
            (Some(DtypeArg::Is(dtype)), _) => Ok(dtype),
            (Some(DtypeArg::Auto) | None, Some(text)) => match Dtype::parse(text) {
                Some(dtype) => Ok(dtype),
                None if self.dtype.is_none() => {
                    notes.push(format!(
                        "{}'s torch_dtype \"{text}\" is not a KV-cache dtype; assuming bf16 \
                         (give --dtype)",
                        model.name
                    ));
                    Ok(Dtype::Bf16)
                }
                None => Err(Failure::Usage(format!(
                    "--dtype auto: {}'s torch_dtype \"{text}\" is not a KV-cache dtype; name one: \
                     {}",
                    model.name, DTYPE_SPELLINGS
                ))),
            },
            (None, None) => Ok(Dtype::Bf16),
            (Some(DtypeArg::Auto), None) => Err(Failure::Usage(format!(
                "--dtype auto takes the dtype from the model's config.json (torch_dtype), and {} \
                 {}; name the dtype instead, e.g. --dtype bf16",
                model.name,
                if self.config.is_some() {
                    "has no torch_dtype"
                } else {
                    "does not come from a config.json"
                }
            ))),
        }
    }

    /// One side's page size: its own flag, else --page-size, else 1. A side's flag that
    /// disagrees with --page-size is refused rather than silently winning.
    fn page_size(&self, flag: &str, own: Option<u32>) -> Result<u32, Failure> {
        match (self.page_size, own) {
            (Some(both), Some(one)) if both != one => Err(Failure::Usage(format!(
                "--page-size {both} sets both engines' page size, but --{flag} {one} says \
                 otherwise; give --page-size alone, or --prefill-page-size and \
                 --decode-page-size"
            ))),
            (_, Some(size)) | (Some(size), None) => Ok(size),
            (None, None) => Ok(1),
        }
    }

    fn layout(&self, notes: &mut Vec<String>) -> Result<Layout, Failure> {
        let prefill = Paging {
            order: self.prefill_layout,
            page_size: self.page_size("prefill-page-size", self.prefill_page_size)?,
        };
        let decode = Paging {
            order: self.decode_layout,
            page_size: self.page_size("decode-page-size", self.decode_page_size)?,
        };
        let model = self.model(notes)?;
        if let Some(message) = missing_deployment(self) {
            return Err(Failure::Usage(message));
        }
        let dtype = self.dtype(&model, notes)?;
        Ok(Layout::new(
            model,
            dtype,
            prefill,
            decode,
            self.prefill_tp.expect("checked by missing_deployment"),
            self.decode_tp.expect("checked by missing_deployment"),
        )?)
    }
}

fn presets(json: bool) -> String {
    if json {
        let list: Vec<serde_json::Value> = PRESETS
            .iter()
            .map(|p| {
                serde_json::json!({
                    "name": p.name,
                    "kv_heads": p.kv_heads,
                    "head_dim": p.head_dim,
                    "layers": p.layers,
                    "attention": p.attention.label(),
                    "buffers_per_layer": p.attention.buffers_per_layer(),
                    "sliding_window": p.sliding_window,
                    "layer_kinds": p.layers_text(),
                })
            })
            .collect();
        return serde_json::Value::Array(list).to_string() + "\n";
    }
    let mut out = format!(
        "{:<16} {:>8} {:>8} {:>6}  {}\n",
        "model", "KV heads", "head_dim", "layers", "attention"
    );
    for p in PRESETS {
        let note = if p.attention == Attention::Mla {
            " (one latent head per token, no separate V)"
        } else {
            " (K and V)"
        };
        out += &format!(
            "{:<16} {:>8} {:>8} {:>6}  {}{note}; {}\n",
            p.name,
            p.kv_heads,
            p.head_dim,
            p.layers,
            p.attention.label(),
            p.layers_text()
        );
    }
    out += "\nA TP size works for a model if it divides the KV heads or is a multiple of them.\n\
            --model also takes these models' Hugging Face ids (meta-llama/Llama-3.1-8B-Instruct).\n\
            Models with state slots (Mamba2, Gated DeltaNet) or an indexer are read from their\n\
            config.json with --config; cli/configs in mori-tp's source tree ships:\n";
    for (dir, what) in model::SHIPPED_CONFIGS {
        out += &format!("  cli/configs/{dir:<24} {what}\n");
    }
    out
}

fn plan(args: &PlanArgs, out: &mut dyn Write, notes: &mut Vec<String>) -> Result<(), Failure> {
    // `--svg -` writes the picture to stdout instead of the plan.
    let svg_to_stdout = args.svg.as_deref() == Some(std::path::Path::new("-"));
    if svg_to_stdout && args.json {
        return Err(Failure::Usage(
            "--svg - writes the picture to stdout, where --json writes the plan: give --svg a \
             file, or leave out --json"
                .into(),
        ));
    }
    let layout = args.deployment.layout(notes)?;
    let tokens = args.deployment.tokens;
    let groups = args.deployment.groups(&layout, notes)?;
    if let Some(path) = &args.svg {
        let panels = match groups.as_ref().filter(|g| g.facts.is_hybrid()) {
            Some(groups) => groups.panels(&layout)?,
            None => Vec::new(),
        };
        let picture = if panels.len() > 1 {
            svg::render_groups(&panels, tokens)
        } else {
            svg::render(&layout, tokens)
        };
        let picture = picture.map_err(|e| match e {
            svg::Refusal::Layout(e) => Failure::Layout(e),
            svg::Refusal::TooLarge(message) => Failure::Usage(message),
        })?;
        if svg_to_stdout {
            return out.write_all(picture.as_bytes()).map_err(Failure::Output);
        }
        std::fs::write(path, picture)
            .map_err(|e| Failure::Usage(format!("cannot write {}: {e}", path.display())))?;
        notes.push(format!("drew the layout into {}", path.display()));
    }
    if args.json {
        plan::write_json(&layout, tokens, groups.as_ref(), out)?;
    } else {
        plan::write_text(&layout, tokens, out)?;
        if let Some(groups) = groups.as_ref().filter(|g| g.facts.is_hybrid()) {
            groups.write_text(out)?;
        }
    }
    Ok(())
}

fn simulate(
    args: &SimulateArgs,
    out: &mut dyn Write,
    notes: &mut Vec<String>,
) -> Result<(), Failure> {
    let layout = args.deployment.layout(notes)?;
    // The checks `plan` applies to every group (TP sizes the engines cannot split a part by),
    // so that `simulate` never says OK for a deployment `plan` refuses.
    args.deployment.groups(&layout, &mut Vec::new())?;
    if let Some(facts) = layout.model.facts.as_ref().filter(|f| f.is_hybrid()) {
        notes.push(format!(
            "simulate moves {}'s {} group ({} of its {} layers); `plan` lists every group",
            layout.model.name,
            facts.main_group().name,
            layout.model.layers,
            facts.total_layers
        ));
    }
    let options = simulate::Options {
        tokens: args.deployment.tokens,
        layers_limit: args.layers_limit,
        seed: args.seed,
        fragmentation: args.fragmentation,
        backend: args.backend,
    };
    let (report, ok) = simulate::run(&layout, &options).map_err(|e| match e {
        simulate::SimError::TooLarge(message) => Failure::Usage(message),
        simulate::SimError::Backend(message) => Failure::Backend(message),
        simulate::SimError::Library(message) => Failure::Failed(message),
    })?;
    if !ok {
        return Err(Failure::Mismatch(report));
    }
    out.write_all(report.as_bytes()).map_err(Failure::Output)
}

/// Runs `command`, writing its output to `out`; notes (assumptions, files written) are collected
/// for stderr.
fn run(command: &Command, out: &mut dyn Write, notes: &mut Vec<String>) -> Result<(), Failure> {
    match command {
        Command::Presets { json } => out
            .write_all(presets(*json).as_bytes())
            .map_err(Failure::Output),
        Command::Plan(args) => plan(args, out, notes),
        Command::Simulate(args) => simulate(args, out, notes),
    }
}

/// True when `--json` was asked for: errors then also go to stdout as JSON.
fn wants_json(command: &Command) -> bool {
    matches!(command, Command::Plan(PlanArgs { json: true, .. }))
}

/// A closed stdout (`mori-tp plan | head`) ends the program quietly, as it does for other tools.
fn broken_pipe(failure: &Failure) -> bool {
    matches!(failure, Failure::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
}

/// Writes a line to stderr, dropping it when stderr is closed: a note or an error message that
/// cannot be read must not turn the documented exit status into a panic.
fn to_stderr(line: &str) {
    let _ = writeln!(io::stderr().lock(), "{line}");
}

fn main() -> ExitCode {
    let command = match Cli::try_parse() {
        Ok(cli) => cli.command.unwrap_or_else(|| {
            // No command: the default simulation, with every default of `simulate`.
            Cli::parse_from(
                ["mori-tp", "simulate"]
                    .into_iter()
                    .chain(DEFAULT_DEPLOYMENT),
            )
            .command
            .expect("simulate parses")
        }),
        Err(error) => {
            let usage = !matches!(
                error.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            );
            // A script that asked for JSON gets its error as JSON too.
            if usage && std::env::args().any(|a| a == "--json") {
                let message = error.render().to_string();
                let value = json!({ "error": {
                    "exit_status": 2,
                    "kind": "usage",
                    "message": message.trim_end(),
                }});
                let _ = writeln!(io::stdout().lock(), "{value:#}");
            }
            // clap's own printing ignores a closed stream; its exit status is 2 for usage.
            let _ = error.print();
            return ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2));
        }
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut notes = Vec::new();
    let result =
        run(&command, &mut out, &mut notes).and_then(|()| out.flush().map_err(Failure::Output));
    for note in &notes {
        to_stderr(&format!("note: {note}"));
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) if broken_pipe(&failure) => ExitCode::SUCCESS,
        Err(failure) => {
            if let Failure::Mismatch(report) = &failure {
                let _ = out.write_all(report.as_bytes());
            } else if wants_json(&command) {
                let _ = writeln!(out, "{:#}", failure.json());
            }
            let _ = out.flush();
            to_stderr(&format!("error: {}", failure.message()));
            ExitCode::from(failure.exit_status())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_argument_definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn numbers_get_messages_about_their_value() {
        let tp = count("a TP size", 1024);
        assert_eq!(tp("8"), Ok(8));
        assert_eq!(tp(" 1024 "), Ok(1024));
        for (text, says) in [
            ("-2", "-2 is negative"),
            ("0", "0 is too small"),
            ("1025", "1025 is too large"),
            ("99999999999999999999", "too large"),
            ("2.5", "2.5 is not a whole number"),
            ("two", "`two` is not a number"),
        ] {
            let message = tp(text).unwrap_err();
            assert!(message.contains(says), "{text}: {message}");
            assert!(message.contains("from 1 to 1024"), "{text}: {message}");
        }
        assert!(fraction("-0.5").unwrap_err().contains("outside 0 to 1"));
        assert!(
            whole_number("a seed", 0, u64::MAX)("-1")
                .unwrap_err()
                .contains("negative")
        );
    }
}
