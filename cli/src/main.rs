//! `mori-tp`: check, explain and simulate the KV-cache transfer between a prefill engine and a
//! decode engine that run different tensor-parallel sizes, with the mori-tp library.
//!
//! Every slice, plan and copy comes from the library (`simulate` goes through the C entry point
//! `mori_send_kvcache`); this binary only chooses the model, formats and verifies.

mod layout;
mod model;
mod plan;
mod simulate;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::PossibleValuesParser;
use clap::{Args, Parser, Subcommand};

use crate::layout::Layout;
use crate::model::{Attention, Dtype, Model, PRESETS, from_config_json, preset_by_name};

/// The deployment `mori-tp` (and every command) uses when told nothing else.
const DEFAULT_MODEL: &str = "qwen2.5-7b";

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

With no command, mori-tp runs `simulate` on a deployment that today's serving stacks get wrong:
qwen2.5-7b (4 KV heads) with prefill TP 2 and decode TP 8.";

const AFTER_HELP: &str = "\
Examples:
  mori-tp                                          simulate the default deployment
  mori-tp presets                                  list the built-in models
  mori-tp plan --model llama-3.1-70b --prefill-tp 16 --decode-tp 4
  mori-tp plan --config path/to/config.json --prefill-tp 8 --decode-tp 2 --json
  mori-tp simulate --model deepseek-v3 --prefill-tp 8 --decode-tp 4 --page-size 64

Exit status: 0 success; 1 simulate found a wrong byte (or a copy failed); 2 bad usage or an
unreadable config.json; 3 the layout cannot work (the message names the values and the nearest
valid TP sizes).";

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
                      ranks skip because another replica sends the same head, and how many bytes \
                      the decode rank receives per token and per request.\n\n\
                      A layout works only if each TP size divides the model's KV head count or \
                      is a multiple of it; otherwise mori-tp exits with status 3 and names the \
                      nearest valid TP sizes."
    )]
    Plan(PlanArgs),
    /// Move one request's KV cache in host memory through the library and verify every byte
    #[command(
        long_about = "Move one request's KV cache in host memory through the library and verify \
                      every byte.\n\n\
                      Allocates the KV buffers of every prefill and decode rank, fills the \
                      prefill side with bytes that identify their layer buffer, page, token and \
                      head, and the decode side with a sentinel. Then, for every pair the library \
                      says must send, calls mori_send_kvcache (the C entry point serving engines \
                      call) with a fragmented list of pages, and checks every decode byte: the \
                      requested pages must hold exactly the heads each decode rank owns, \
                      everything else must be untouched. Prints the copies issued, compared with \
                      a per-token copy plan, the bytes moved and the copy speed. Exits with \
                      status 1 on any wrong byte.\n\n\
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

/// Which model, and how each engine is laid out.
#[derive(Args, Debug)]
struct DeploymentArgs {
    /// Built-in model [default: qwen2.5-7b unless --config or --kv-heads is given]
    #[arg(
        long,
        value_name = "NAME",
        value_parser = PossibleValuesParser::new(PRESETS.iter().map(|p| p.name)),
        conflicts_with_all = ["config", "kv_heads"],
        help_heading = "Model"
    )]
    model: Option<String>,

    /// Read the model from a Hugging Face config.json (KV heads, head dim, layers; GQA, MLA and
    /// GLM configs are understood)
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
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Model"
    )]
    kv_heads: Option<u32>,

    /// With --kv-heads: elements per KV head (MLA: kv_lora_rank + qk_rope_head_dim)
    #[arg(
        long,
        value_name = "N",
        requires = "kv_heads",
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Model"
    )]
    head_dim: Option<u32>,

    /// With --kv-heads: the model caches one MLA latent per layer instead of K and V
    #[arg(long, requires = "kv_heads", help_heading = "Model")]
    mla: bool,

    /// Number of layers; overrides the preset's or config's [default with --kv-heads: 1]
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Model"
    )]
    layers: Option<u32>,

    /// Element type of the KV cache (both engines)
    #[arg(long, value_enum, default_value_t = Dtype::Bf16, help_heading = "Layout")]
    dtype: Dtype,

    /// Tokens per KV-cache page (both engines)
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Layout"
    )]
    page_size: u32,

    /// Tensor-parallel size of the prefill engine (the sender)
    #[arg(
        long,
        value_name = "P",
        default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Layout"
    )]
    prefill_tp: u32,

    /// Tensor-parallel size of the decode engine (the receiver)
    #[arg(
        long,
        value_name = "D",
        default_value_t = 8,
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Layout"
    )]
    decode_tp: u32,

    /// Tokens in one request (rounded up to whole pages)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Layout"
    )]
    tokens: u32,
}

#[derive(Args, Debug)]
struct PlanArgs {
    #[command(flatten)]
    deployment: DeploymentArgs,

    /// Print one JSON object instead of text: {"model", "prefill_tp", "decode_tp", "pairs": [...],
    /// ...}; pairs that share no head are left out
    #[arg(long)]
    json: bool,
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
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    layers_limit: u32,

    /// Seed of the page layout and of the data
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,

    /// Chance that a page starts a new run of adjacent pages: 0 = the request is one contiguous
    /// run, 1 = no two pages are adjacent
    #[arg(long, value_name = "F", default_value_t = 0.1, value_parser = fraction)]
    fragmentation: f64,
}

fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{text} is not a number from 0 to 1")),
    }
}

/// A failure and the exit status it maps to.
enum Failure {
    /// 1: simulate found a wrong byte (the report, for stdout).
    Mismatch(String),
    /// 1: a library call failed.
    Failed(String),
    /// 2: bad input the argument parser could not catch (an unreadable config.json).
    Usage(String),
    /// 3: the layout cannot work.
    Layout(String),
}

impl DeploymentArgs {
    fn model(&self) -> Result<Model, Failure> {
        let mut model = if let Some(path) = &self.config {
            let name = path.display().to_string();
            let text = std::fs::read_to_string(path)
                .map_err(|e| Failure::Usage(format!("cannot read {name}: {e}")))?;
            from_config_json(&text, &name).map_err(Failure::Usage)?
        } else if let (Some(kv_heads), Some(head_dim)) = (self.kv_heads, self.head_dim) {
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
            }
        } else {
            let name = self.model.as_deref().unwrap_or(DEFAULT_MODEL);
            preset_by_name(name).expect("clap checked the name").into()
        };
        if let Some(layers) = self.layers {
            model.layers = layers;
        }
        Ok(model)
    }

    fn layout(&self) -> Result<Layout, Failure> {
        Layout::new(
            self.model()?,
            self.dtype,
            self.page_size,
            self.prefill_tp,
            self.decode_tp,
        )
        .map_err(|e| Failure::Layout(e.to_string()))
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
            "{:<16} {:>8} {:>8} {:>6}  {}{note}\n",
            p.name,
            p.kv_heads,
            p.head_dim,
            p.layers,
            p.attention.label()
        );
    }
    out += "\nA TP size works for a model if it divides the KV heads or is a multiple of them.\n";
    out
}

fn run(command: Command) -> Result<String, Failure> {
    match command {
        Command::Presets { json } => Ok(presets(json)),
        Command::Plan(args) => {
            let layout = args.deployment.layout()?;
            let tokens = args.deployment.tokens;
            let result = if args.json {
                plan::json(&layout, tokens).map(|v| format!("{v:#}\n"))
            } else {
                plan::text(&layout, tokens)
            };
            result.map_err(|e| Failure::Layout(e.to_string()))
        }
        Command::Simulate(args) => {
            let layout = args.deployment.layout()?;
            let options = simulate::Options {
                tokens: args.deployment.tokens,
                layers_limit: args.layers_limit,
                seed: args.seed,
                fragmentation: args.fragmentation,
            };
            let (report, ok) = simulate::run(&layout, &options).map_err(|e| match e {
                simulate::SimError::TooLarge(message) => Failure::Usage(message),
                simulate::SimError::Library(message) => Failure::Failed(message),
            })?;
            if ok {
                Ok(report)
            } else {
                Err(Failure::Mismatch(report))
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let command = cli.command.unwrap_or_else(|| {
        // No command: the default simulation, with every default of `simulate`.
        Cli::parse_from(["mori-tp", "simulate"])
            .command
            .expect("simulate parses")
    });
    match run(command) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(Failure::Mismatch(report)) => {
            print!("{report}");
            eprintln!("error: the simulated transfer put wrong bytes on the decode side");
            ExitCode::from(1)
        }
        Err(Failure::Failed(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Layout(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(3)
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
}
