//! Which model a deployment serves: a built-in preset, a Hugging Face `config.json`, or numbers
//! given on the command line. Only the figures that shape the KV cache matter here: KV heads,
//! head dimension, layers, and whether attention keeps K and V or one MLA latent per layer.

use crate::dtype::Dtype;
use crate::facts::{Dtypes, Group, ModelFacts, Part, Storage, UnitBytes};

/// How a model stores its KV cache, as far as the transfer is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// Multi-head attention: as many KV heads as query heads; separate K and V.
    Mha,
    /// Grouped-query attention: fewer KV heads than query heads; separate K and V.
    Gqa,
    /// Multi-query attention: one KV head; separate K and V.
    Mqa,
    /// Multi-head latent attention (DeepSeek): one latent "head" per token per layer, no V.
    Mla,
    /// Separate K and V, query heads unknown (numbers given on the command line).
    KeyValue,
}

impl Attention {
    /// Short name for output and JSON.
    pub fn label(self) -> &'static str {
        match self {
            Attention::Mha => "MHA",
            Attention::Gqa => "GQA",
            Attention::Mqa => "MQA",
            Attention::Mla => "MLA",
            Attention::KeyValue => "K/V",
        }
    }

    /// KV buffers per layer: K and V, or the single MLA latent buffer.
    pub fn buffers_per_layer(self) -> u32 {
        if self == Attention::Mla { 1 } else { 2 }
    }

    /// The label for a model with separate K and V, from its query and KV head counts.
    pub fn of_heads(query_heads: Option<u32>, kv_heads: u32) -> Attention {
        match query_heads {
            None => Attention::KeyValue,
            Some(_) if kv_heads == 1 => Attention::Mqa,
            Some(q) if q == kv_heads => Attention::Mha,
            Some(_) => Attention::Gqa,
        }
    }
}

/// The KV-cache shape of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    /// Preset name or the config.json path.
    pub name: String,
    /// `H`: KV heads before tensor parallelism (1 for MLA and MQA).
    pub kv_heads: u32,
    /// Elements per KV head (MLA: `kv_lora_rank + qk_rope_head_dim`).
    pub head_dim: u32,
    /// Transformer layers.
    pub layers: u32,
    /// How the cache is stored.
    pub attention: Attention,
    /// The config's `torch_dtype` (newer configs: `dtype`), what `--dtype auto` resolves to.
    pub torch_dtype: Option<String>,
    /// Every group of layers and its state, for a model read from a config.json (None for a
    /// preset or numbers given by hand). For a model of several groups, the fields above
    /// describe its main group (full attention, or the MLA latent): `layers` counts that group's
    /// layers.
    pub facts: Option<ModelFacts>,
}

impl Model {
    /// Bytes of one head of one token of the main group: `head_dim * dtype`, or what the model's
    /// facts say (DeepSeek V3.2's fp8 latent is 656 B, not 576).
    pub fn bytes_per_head(&self, dtype: Dtype) -> u64 {
        match &self.facts {
            Some(facts) => facts.main_group().parts[0]
                .bytes
                .bytes(Dtypes::of(dtype, dtype, dtype)),
            None => u64::from(self.head_dim) * u64::from(dtype.bytes()),
        }
    }
}

/// A built-in model.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Every layer of the model.
    pub layers: u32,
    pub attention: Attention,
    /// For a model whose layers alternate sliding-window and full attention (layer `i` slides
    /// when `i` is even, transformers' `GptOssConfig`): the window in tokens. None: full
    /// attention on every layer.
    pub sliding_window: Option<u32>,
}

impl Preset {
    /// Its layers' kinds in words: `every layer full attention`, or the split of a
    /// sliding-window model.
    pub fn layers_text(&self) -> String {
        match self.sliding_window {
            None => "full attention on every layer".into(),
            Some(window) => format!(
                "{} full-attention layers and {} sliding-window layers of {window} tokens",
                self.layers / 2,
                self.layers - self.layers / 2
            ),
        }
    }

    /// Its groups of layers, for a preset that is not full attention on every layer: what
    /// `plan --config` would derive from the model's config.json.
    fn facts(&self) -> Option<ModelFacts> {
        let window = self.sliding_window?;
        let group = |name, what, layers: Vec<u32>, window| Group {
            name,
            what,
            layers,
            buffers_per_layer: 2,
            storage: Storage::Paged { window },
            parts: vec![Part {
                name: "kv",
                unit: "head",
                units: self.kv_heads,
                bytes: UnitBytes::Cache(u64::from(self.head_dim)),
                must_divide: false,
            }],
        };
        Some(ModelFacts {
            family: "sliding_window",
            total_layers: self.layers,
            groups: vec![
                group(
                    "full_attention",
                    "K and V of every token",
                    (1..self.layers).step_by(2).collect(),
                    None,
                ),
                group(
                    "sliding_attention",
                    "K and V of the last sliding_window tokens",
                    (0..self.layers).step_by(2).collect(),
                    Some(window),
                ),
            ],
            ssm_dtype: None,
            architectures: Vec::new(),
        })
    }
}

/// The built-in models. Every figure comes from the model's public Hugging Face `config.json`:
/// `num_key_value_heads`, `head_dim` (or `hidden_size / num_attention_heads` where the config
/// has no `head_dim`), `num_hidden_layers`; GLM-4 from `multi_query_group_num`, `kv_channels`,
/// `num_layers`; DeepSeek-V3 from `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (one latent head).
/// Every preset is full attention on every layer but gpt-oss-120b, which carries its
/// sliding-window layers (`sliding_window`); the hybrid models with state slots (Qwen3-Next,
/// Nemotron-H, DeepSeek V3.2's indexer) are read from their config.json (`--config`;
/// `cli/configs` ships some, and `--model` names them in its tips).
pub const PRESETS: &[Preset] = &[
    // meta-llama/Llama-3.1-8B: hidden 4096 / 32 heads, 8 KV heads, 32 layers.
    preset("llama-3.1-8b", 8, 128, 32, Attention::Gqa),
    // meta-llama/Llama-3.1-70B: hidden 8192 / 64 heads, 8 KV heads, 80 layers.
    preset("llama-3.1-70b", 8, 128, 80, Attention::Gqa),
    // Qwen/Qwen2.5-1.5B: hidden 1536 / 12 heads, 2 KV heads, 28 layers.
    preset("qwen2.5-1.5b", 2, 128, 28, Attention::Gqa),
    // Qwen/Qwen2.5-7B: hidden 3584 / 28 heads, 4 KV heads, 28 layers.
    preset("qwen2.5-7b", 4, 128, 28, Attention::Gqa),
    // Qwen/Qwen2.5-72B: hidden 8192 / 64 heads, 8 KV heads, 80 layers.
    preset("qwen2.5-72b", 8, 128, 80, Attention::Gqa),
    // Qwen/Qwen3-8B: head_dim 128, 8 KV heads, 36 layers.
    preset("qwen3-8b", 8, 128, 36, Attention::Gqa),
    // Qwen/Qwen3-30B-A3B: head_dim 128, 4 KV heads, 48 layers.
    preset("qwen3-30b-a3b", 4, 128, 48, Attention::Gqa),
    // mistralai/Mixtral-8x7B-v0.1: hidden 4096 / 32 heads, 8 KV heads, 32 layers.
    preset("mixtral-8x7b", 8, 128, 32, Attention::Gqa),
    // THUDM/glm-4-9b: multi_query_group_num 2, kv_channels 128, num_layers 40.
    preset("glm-4-9b", 2, 128, 40, Attention::Gqa),
    // openai/gpt-oss-120b: head_dim 64, 8 KV heads, 36 layers alternating sliding-window (even
    // layers) and full attention, sliding_window 128: huggingface/transformers'
    // `GptOssConfig` (src/transformers/models/gpt_oss/configuration_gpt_oss.py, commit
    // 02b8f42b), whose defaults are gpt-oss-120b's (36 layers, 128 experts) and whose
    // `layer_types` default slides on layer `i` when `(i + 1) % 2` is 1.
    Preset {
        sliding_window: Some(128),
        ..preset("gpt-oss-120b", 8, 64, 36, Attention::Gqa)
    },
    // deepseek-ai/DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64, 61 layers.
    preset("deepseek-v3", 1, 576, 61, Attention::Mla),
];

const fn preset(
    name: &'static str,
    kv_heads: u32,
    head_dim: u32,
    layers: u32,
    attention: Attention,
) -> Preset {
    Preset {
        name,
        kv_heads,
        head_dim,
        layers,
        attention,
        sliding_window: None,
    }
}

/// The preset called exactly `name`, if any.
pub fn preset_by_name(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// Other names of a preset's KV-cache shape, from the models' public config.json files.
const ALIASES: &[(&str, &str)] = &[
    // deepseek-ai/DeepSeek-R1 is a DeepseekV3ForCausalLM: kv_lora_rank 512, qk_rope_head_dim 64,
    // 61 layers, as DeepSeek-V3.
    ("deepseek-r1", "deepseek-v3"),
];

/// Words at the end of a Hugging Face model name that mark a fine-tune, a weight format or a
/// release of the same architecture: the KV cache keeps the base model's shape.
const VARIANT_WORDS: &[&str] = &[
    "instruct", "chat", "base", "it", "hf", "thinking", "fp8", "bf16", "fp16", "awq", "gptq",
    "int4", "int8", "w8a8", "w4a16", "dynamic",
];

/// A release tag: a version such as `v0.1`, or a date such as `2507` or `0324`.
fn is_release_tag(word: &str) -> bool {
    let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    let version = word
        .strip_prefix('v')
        .is_some_and(|rest| rest.contains('.') && rest.split('.').all(digits));
    version || (word.len() == 4 && digits(word))
}

/// A model name as typed (`Qwen2.5-7B`, `meta-llama/Llama-3.1-70B-Instruct`) in the form preset
/// names use: lower case, without the organisation or `Meta-`; then the same with trailing
/// variant words and release tags taken off one at a time, longest first.
fn candidates(name: &str) -> Vec<String> {
    let lower = name.trim().to_ascii_lowercase();
    let base = lower.rsplit('/').next().unwrap_or_default();
    let base = match base.strip_prefix("meta-") {
        Some(rest) if rest.starts_with("llama") => rest,
        _ => base,
    };
    let mut words: Vec<&str> = base.split('-').collect();
    let mut names = vec![words.join("-")];
    while let [rest @ .., last] = words.as_slice() {
        if rest.is_empty() || !(VARIANT_WORDS.contains(last) || is_release_tag(last)) {
            break;
        }
        words.pop();
        names.push(words.join("-"));
    }
    names
}

/// Edits (insertions, deletions, substitutions) that turn `a` into `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// A `--model` value: the preset it names and the name as typed.
#[derive(Clone, Debug)]
pub struct ModelChoice {
    pub preset: &'static Preset,
    pub typed: String,
}

/// The configs that ship with mori-tp (`cli/configs/NAME/config.json` in its source tree), by
/// directory name, with what they hold: `--model` points to them rather than to a preset of
/// another shape. `cli/tests/cli.rs` checks this list against the directory.
pub const SHIPPED_CONFIGS: &[(&str, &str)] = &[
    ("deepseek-v3.2", "MLA and the sparse-attention indexer"),
    ("gemma-3-270m", "full and sliding-window attention"),
    ("gpt-oss-20b", "full and sliding-window attention"),
    ("llama-3.1-8b", "dense attention"),
    ("nemotron-h-8b-base-8k", "Mamba2 and attention"),
    ("qwen3-next-80b-a3b", "full attention and Gated DeltaNet"),
];

/// The shipped config a model name stands for, with the typed name's candidates.
pub fn shipped_config(text: &str) -> Option<&'static (&'static str, &'static str)> {
    let names = candidates(text);
    SHIPPED_CONFIGS
        .iter()
        .find(|(dir, _)| names.iter().any(|n| n == dir))
}

/// Parses `--model`: a preset name in any case, a Hugging Face id of a preset's model or of one
/// of its fine-tunes, or an alias. Unknown names get a tip: the config mori-tp ships for the
/// model, else the closest preset.
pub fn parse_model(text: &str) -> Result<ModelChoice, String> {
    let names = candidates(text);
    for name in &names {
        let target = ALIASES
            .iter()
            .find(|(alias, _)| alias == name)
            .map_or(name.as_str(), |(_, preset)| preset);
        if let Some(preset) = preset_by_name(target) {
            return Ok(ModelChoice {
                preset,
                typed: text.trim().to_string(),
            });
        }
    }
    if let Some((dir, what)) = shipped_config(text) {
        return Err(format!(
            "no built-in model is called that, but mori-tp ships its config.json ({what}): pass \
             --config cli/configs/{dir} (in mori-tp's source tree), which plans every group of \
             its state"
        ));
    }
    let name = names.last().expect("at least the name itself");
    let elsewhere = "describe it with --config (its config.json or its directory) or with \
                     --kv-heads and --head-dim; `mori-tp presets` lists the built-in models";
    let closest = PRESETS
        .iter()
        .map(|p| {
            // A preset's name followed by words this parser does not know is a near miss.
            let extends = name.starts_with(&format!("{}-", p.name));
            (
                if extends {
                    1
                } else {
                    edit_distance(name, p.name)
                },
                p,
            )
        })
        .min_by_key(|(distance, _)| *distance)
        .filter(|(distance, _)| *distance <= (name.len() / 3).max(2));
    Err(match closest {
        Some((_, p)) => format!(
            "no built-in model is called that. Closest: {} ({} KV head{}, head_dim {}, {} \
             layers); if that is its KV-cache shape, pass --model {}, otherwise {elsewhere}",
            p.name,
            p.kv_heads,
            if p.kv_heads == 1 { "" } else { "s" },
            p.head_dim,
            p.layers,
            p.name
        ),
        None => format!(
            "no built-in model is called that (they are {}); {elsewhere}",
            PRESETS
                .iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

impl From<&Preset> for Model {
    /// The preset's model; one with groups describes its main group (full attention): `layers`
    /// counts that group's layers, as a model read from a config.json does.
    fn from(p: &Preset) -> Self {
        let facts = p.facts();
        Model {
            name: p.name.to_string(),
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            layers: facts
                .as_ref()
                .map_or(p.layers, |f| f.main_group().layers.len() as u32),
            attention: p.attention,
            torch_dtype: None,
            facts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_names_are_unique() {
        let mut names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PRESETS.len());
    }
}
