//! Which model a deployment serves: a built-in preset, a Hugging Face `config.json`, or numbers
//! given on the command line. Only the figures that shape the KV cache matter here: KV heads,
//! head dimension, layers, and whether attention keeps K and V or one MLA latent per layer.

use std::fmt;
use std::path::Path;

use serde_json::{Map, Value};

use crate::facts::{Dtypes, KvShape, ModelFacts, UnitBytes};

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
    fn of_heads(query_heads: Option<u32>, kv_heads: u32) -> Attention {
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
            Some(facts) => facts.main_group().parts[0].bytes.bytes(Dtypes {
                cache: u64::from(dtype.bytes()),
                cache_is_fp8: dtype.bytes() == 1,
                state: u64::from(dtype.bytes()),
            }),
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
    pub layers: u32,
    pub attention: Attention,
}

/// The built-in models. Every figure comes from the model's public Hugging Face `config.json`:
/// `num_key_value_heads`, `head_dim` (or `hidden_size / num_attention_heads` where the config
/// has no `head_dim`), `num_hidden_layers`; GLM-4 from `multi_query_group_num`, `kv_channels`,
/// `num_layers`; DeepSeek-V3 from `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (one latent head).
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
    // openai/gpt-oss-120b: head_dim 64, 8 KV heads, 36 layers.
    preset("gpt-oss-120b", 8, 64, 36, Attention::Gqa),
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

/// Parses `--model`: a preset name in any case, a Hugging Face id of a preset's model or of one
/// of its fine-tunes, or an alias. Unknown names get the closest preset as a tip.
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
    fn from(p: &Preset) -> Self {
        Model {
            name: p.name.to_string(),
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            layers: p.layers,
            attention: p.attention,
            torch_dtype: None,
            facts: None,
        }
    }
}

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp16,
    /// An 8-bit float whose format was not named.
    Fp8,
    Fp8E4m3,
    Fp8E5m2,
    Fp32,
}

/// What `--dtype` says: a type, or `auto` (the model's own, from its config.json).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeArg {
    Auto,
    Is(Dtype),
}

/// The spellings `--dtype` accepts, for messages and help.
pub const DTYPE_SPELLINGS: &str = "bf16 (bfloat16), fp16 (float16, half), fp8, fp8_e4m3 \
                                   (float8_e4m3fn, fp8_e4m3fnuz), fp8_e5m2 (float8_e5m2), fp32 \
                                   (float32, float) or auto";

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8 | Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
            Dtype::Fp32 => 4,
        }
    }

    /// A dtype as mori-tp, PyTorch (`torch.bfloat16`, `float8_e4m3fn`), vLLM and SGLang
    /// (`--dtype half`, `--kv-cache-dtype fp8_e5m2`) spell it, in any case.
    pub fn parse(text: &str) -> Option<Dtype> {
        let lower = text.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Some(match name {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp16" | "float16" | "half" | "f16" => Dtype::Fp16,
            "fp8" | "float8" => Dtype::Fp8,
            // The "fn" and "fnuz" (AMD) variants differ in NaN and zero encodings, not in size.
            "fp8_e4m3" | "fp8e4m3" | "e4m3" | "float8_e4m3fn" | "fp8_e4m3fn"
            | "float8_e4m3fnuz" | "fp8_e4m3fnuz" => Dtype::Fp8E4m3,
            "fp8_e5m2" | "fp8e5m2" | "e5m2" | "float8_e5m2" | "float8_e5m2fnuz"
            | "fp8_e5m2fnuz" => Dtype::Fp8E5m2,
            "fp32" | "float32" | "float" | "f32" => Dtype::Fp32,
            _ => return None,
        })
    }
}

/// Parses `--dtype`.
pub fn parse_dtype(text: &str) -> Result<DtypeArg, String> {
    if text.trim().eq_ignore_ascii_case("auto") {
        return Ok(DtypeArg::Auto);
    }
    Dtype::parse(text)
        .map(DtypeArg::Is)
        .ok_or_else(|| format!("not a KV-cache dtype mori-tp knows; use one of {DTYPE_SPELLINGS}"))
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::Fp32 => "fp32",
        })
    }
}

/// Reads a positive integer field; a missing or `null` field is `None`.
pub(crate) fn positive(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!(
                "`{key}` is {value}, expected a positive integer below 2^32"
            )),
        },
    }
}

pub(crate) fn required(obj: &Map<String, Value>, key: &str, why: &str) -> Result<u32, String> {
    positive(obj, key)?.ok_or_else(|| format!("`{key}` is missing ({why})"))
}

/// `hidden_size / num_attention_heads`, the head dimension of configs without `head_dim`.
pub(crate) fn head_dim_from_hidden(
    obj: &Map<String, Value>,
    fallback_for: &str,
) -> Result<u32, String> {
    let why = format!("needed to derive the head dimension without `{fallback_for}`");
    let hidden = required(obj, "hidden_size", &why)?;
    let heads = required(obj, "num_attention_heads", &why)?;
    if hidden % heads != 0 {
        return Err(format!(
            "`hidden_size` {hidden} is not a multiple of `num_attention_heads` {heads}, so the \
             head dimension is unclear; add `{fallback_for}` to the config"
        ));
    }
    Ok(hidden / heads)
}

/// Reads a model's `config.json`, or the one inside a model directory (a Hugging Face snapshot or
/// checkout); the model is named by the path as given.
pub fn read_config(path: &Path) -> Result<Model, String> {
    let name = path.display().to_string();
    let file = if path.is_dir() {
        let file = path.join("config.json");
        if !file.is_file() {
            return Err(format!(
                "{name} is a directory without a config.json (give the model's directory or its \
                 config.json)"
            ));
        }
        file
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    from_config_json(&text, &name)
}

/// Reads the KV-cache shape from the text of a Hugging Face `config.json`.
///
/// - MLA (DeepSeek) when `kv_lora_rank` is present: one latent head of
///   `kv_lora_rank + qk_rope_head_dim` elements per layer, no separate V (its
///   `num_key_value_heads` describes the attention computation, not the cache, and is ignored).
/// - GLM (ChatGLM, GLM-4): `multi_query_group_num` KV heads (when `multi_query_attention` is not
///   false) of `kv_channels` elements.
/// - Otherwise `num_key_value_heads`, else `num_attention_heads`; `head_dim`, else
///   `kv_channels`, else `hidden_size / num_attention_heads`.
///
/// Layers are `num_hidden_layers` (GLM: `num_layers`). Multimodal configs that keep the language
/// model under `text_config` are read from there.
pub fn from_config_json(text: &str, name: &str) -> Result<Model, String> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| format!("{name} is not valid JSON: {e}"))?;
    let parse = || -> Result<Model, String> {
        let mut obj = root
            .as_object()
            .ok_or("the top level is not a JSON object")?;
        let has_layers = |o: &Map<String, Value>| {
            o.get("num_hidden_layers").is_some() || o.get("num_layers").is_some()
        };
        if !has_layers(obj) {
            if let Some(text_config) = obj.get("text_config").and_then(Value::as_object) {
                obj = text_config;
            }
        }
        // transformers 4.56 renamed torch_dtype to dtype; multimodal configs may keep it at the top.
        let torch_dtype = [obj, root.as_object().expect("checked above")]
            .iter()
            .flat_map(|o| [o.get("torch_dtype"), o.get("dtype")])
            .flatten()
            .find_map(Value::as_str)
            .map(str::to_string);
        let layers = match positive(obj, "num_hidden_layers")? {
            Some(n) => n,
            None => required(obj, "num_layers", "and so is `num_hidden_layers`")?,
        };
        let query_heads = positive(obj, "num_attention_heads")?;

        if let Some(rank) = positive(obj, "kv_lora_rank")? {
            let rope = required(
                obj,
                "qk_rope_head_dim",
                "an MLA model (it has `kv_lora_rank`) caches kv_lora_rank + qk_rope_head_dim",
            )?;
            let head_dim = rank
                .checked_add(rope)
                .ok_or("kv_lora_rank + qk_rope_head_dim overflows 32 bits")?;
            let model = Model {
                name: name.to_string(),
                kv_heads: 1,
                head_dim,
                layers,
                attention: Attention::Mla,
                torch_dtype,
                facts: None,
            };
            return with_facts(obj, model, Some((rank, rope)));
        }

        let glm_groups = positive(obj, "multi_query_group_num")?;
        let multi_query = obj.get("multi_query_attention").and_then(Value::as_bool);
        if let (Some(groups), true) = (glm_groups, multi_query != Some(false)) {
            let head_dim = match positive(obj, "kv_channels")? {
                Some(d) => d,
                None => head_dim_from_hidden(obj, "kv_channels")?,
            };
            let model = Model {
                name: name.to_string(),
                kv_heads: groups,
                head_dim,
                layers,
                attention: Attention::of_heads(query_heads, groups),
                torch_dtype,
                facts: None,
            };
            return with_facts(obj, model, None);
        }

        let kv_heads = match positive(obj, "num_key_value_heads")? {
            Some(h) => h,
            None => required(
                obj,
                "num_attention_heads",
                "and so is `num_key_value_heads`: the KV head count is unknown",
            )?,
        };
        let head_dim = match positive(obj, "head_dim")? {
            Some(d) => d,
            // GLM names it kv_channels.
            None => match positive(obj, "kv_channels")? {
                Some(d) => d,
                // Nemotron-H names it attention_head_dim.
                None => match positive(obj, "attention_head_dim")? {
                    Some(d) => d,
                    None => head_dim_from_hidden(obj, "head_dim")?,
                },
            },
        };
        let model = Model {
            name: name.to_string(),
            kv_heads,
            head_dim,
            layers,
            attention: Attention::of_heads(query_heads, kv_heads),
            torch_dtype,
            facts: None,
        };
        with_facts(obj, model, None)
    };
    parse().map_err(|e| format!("{name}: {e}"))
}

/// `model` with its facts (`crate::facts::derive`); a model of several groups describes its main
/// group: that group's KV heads, head dimension and layer count.
fn with_facts(
    obj: &Map<String, Value>,
    mut model: Model,
    mla: Option<(u32, u32)>,
) -> Result<Model, String> {
    let kv = KvShape {
        kv_heads: model.kv_heads,
        head_dim: model.head_dim,
        layers: model.layers,
        mla,
    };
    let facts = crate::facts::derive(obj, &kv)?;
    if facts.is_hybrid() {
        let main = facts.main_group();
        let part = &main.parts[0];
        model.kv_heads = part.units;
        model.head_dim = match part.bytes {
            UnitBytes::Cache(elements) | UnitBytes::State(elements) => elements as u32,
            UnitBytes::MlaLatent { rank, rope } => (rank + rope) as u32,
            UnitBytes::Fixed(bytes) => bytes as u32,
        };
        model.layers = main.layers.len() as u32;
    }
    model.facts = Some(facts);
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Model, String> {
        from_config_json(text, "config.json")
    }

    #[test]
    fn gqa_config_without_head_dim_derives_it_from_hidden_size() {
        // The shape of Llama-3.1-8B's config.
        let m = parse(
            r#"{"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_hidden_layers": 32, "head_dim": null}"#,
        )
        .unwrap();
        assert_eq!(
            (m.kv_heads, m.head_dim, m.layers, m.attention),
            (8, 128, 32, Attention::Gqa)
        );
    }

    #[test]
    fn an_explicit_head_dim_wins_over_hidden_size() {
        // Qwen3 and gpt-oss state head_dim, which differs from hidden_size / heads.
        let m = parse(
            r#"{"hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "num_hidden_layers": 36}"#,
        )
        .unwrap();
        assert_eq!((m.kv_heads, m.head_dim, m.layers), (8, 64, 36));
    }

    #[test]
    fn a_config_without_kv_heads_is_multi_head_attention() {
        let m =
            parse(r#"{"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12}"#)
                .unwrap();
        assert_eq!(
            (m.kv_heads, m.head_dim, m.attention),
            (12, 64, Attention::Mha)
        );
    }

    #[test]
    fn mla_caches_one_latent_head_and_ignores_num_key_value_heads() {
        // The shape of DeepSeek-V3's config: 128 KV heads in attention, one latent in the cache.
        let m = parse(
            r#"{"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "v_head_dim": 128, "num_hidden_layers": 61}"#,
        )
        .unwrap();
        assert_eq!(
            (m.kv_heads, m.head_dim, m.layers, m.attention),
            (1, 576, 61, Attention::Mla)
        );
        assert_eq!(m.attention.buffers_per_layer(), 1);
    }

    #[test]
    fn mla_without_rope_dim_is_refused_by_name() {
        let err = parse(r#"{"kv_lora_rank": 512, "num_hidden_layers": 61}"#).unwrap_err();
        assert!(err.contains("qk_rope_head_dim"), "{err}");
    }

    #[test]
    fn glm_reads_query_groups_kv_channels_and_num_layers() {
        // The shape of GLM-4-9B's config.
        let m = parse(
            r#"{"hidden_size": 4096, "num_attention_heads": 32, "multi_query_attention": true,
                "multi_query_group_num": 2, "kv_channels": 128, "num_layers": 40}"#,
        )
        .unwrap();
        assert_eq!(
            (m.kv_heads, m.head_dim, m.layers, m.attention),
            (2, 128, 40, Attention::Gqa)
        );
    }

    #[test]
    fn glm_with_multi_query_off_has_one_kv_head_per_query_head() {
        let m = parse(
            r#"{"hidden_size": 4096, "num_attention_heads": 32, "multi_query_attention": false,
                "multi_query_group_num": 2, "kv_channels": 128, "num_layers": 28}"#,
        )
        .unwrap();
        assert_eq!((m.kv_heads, m.head_dim), (32, 128));
    }

    #[test]
    fn a_multimodal_config_is_read_from_its_text_config() {
        let m = parse(
            r#"{"model_type": "llava", "vision_config": {"hidden_size": 1024},
                "text_config": {"hidden_size": 4096, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "num_hidden_layers": 32}}"#,
        )
        .unwrap();
        assert_eq!((m.kv_heads, m.head_dim, m.layers), (8, 128, 32));
    }

    #[test]
    fn missing_or_malformed_fields_are_named() {
        let err = parse(r#"{"num_attention_heads": 32, "hidden_size": 4096}"#).unwrap_err();
        assert!(
            err.contains("num_layers") && err.contains("missing"),
            "{err}"
        );
        let err = parse(
            r#"{"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": -8,
                "head_dim": 64}"#,
        )
        .unwrap_err();
        assert!(
            err.contains("num_key_value_heads") && err.contains("-8"),
            "{err}"
        );
        let err =
            parse(r#"{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}"#)
                .unwrap_err();
        assert!(err.contains("100") && err.contains('3'), "{err}");
        assert!(parse("{not json").unwrap_err().contains("not valid JSON"));
        assert!(parse("[1, 2]").unwrap_err().contains("not a JSON object"));
    }

    #[test]
    fn preset_names_are_unique() {
        let mut names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PRESETS.len());
    }
}
