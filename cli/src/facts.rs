//! Model facts from a Hugging Face `config.json`: which layers keep which kind of state, in how
//! many units each TP side shards, how many bytes a unit is, and whether it is paged per token or
//! held in one slot per request. The families and the formula of each, with where it comes from:
//!
//! - **Dense GQA, MHA, MQA (Llama, Qwen, GLM)**: one group, `full_attention`, on every layer; K
//!   and V buffers of `num_key_value_heads` heads of `head_dim` elements per token.
//! - **MLA (DeepSeek V3)**: one group, `mla_latent`: one latent "head" of `kv_lora_rank +
//!   qk_rope_head_dim` elements per token per layer, held whole by every rank.
//! - **MLA plus indexer (DeepSeek V3.2, `index_head_dim`)**: the latent group, and `indexer` on
//!   every layer: one record per token of `index_head_dim` fp8 bytes plus one fp32 scale per 128
//!   of them (SGLang `NSATokenToKVPool`: `quant_block_size = 128`, a page of `page_size *
//!   index_head_dim` key bytes then `page_size * index_head_dim / 128 * 4` scale bytes), 132 B
//!   for 128, held whole by every rank. With an fp8 cache the latent is 656 B per token: 512 fp8
//!   bytes, four fp32 scales and 64 bf16 rope elements (vLLM `fp8_ds_mla`; SGLang stores the same
//!   656 B when `NSA_KV_CACHE_STORE_FP8`).
//! - **Sliding window (gpt-oss, Gemma 3)**: `layer_types` names each layer `full_attention` or
//!   `sliding_attention`; without it, Gemma 3's `sliding_window_pattern` makes layer `i` full
//!   when `(i + 1) % pattern == 0` (transformers `Gemma3TextConfig`). Both groups hold the same
//!   K and V heads; the sliding group needs only the last `sliding_window` tokens.
//! - **Qwen3-Next (full attention plus Gated DeltaNet)**: `layer_types`, or else layer `i` is
//!   full when `(i + 1) % full_attention_interval == 0` (transformers `Qwen3NextConfig`). A
//!   linear-attention layer keeps a conv state of `linear_conv_kernel_dim - 1` time steps over
//!   `2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads *
//!   linear_value_head_dim` channels (q, k, v; q and k split by key heads, v by value heads) and
//!   a recurrent state of `linear_num_value_heads` heads of `linear_value_head_dim *
//!   linear_key_head_dim` elements (vLLM `MambaStateShapeCalculator.gated_delta_net_state_shape`).
//! - **Mamba2 hybrids**: Nemotron-H's `hybrid_override_pattern` has one character per layer: `M`
//!   Mamba2, `*` attention, `-` MLP, `E` MoE (no cache); Granite-4.0-H's `layer_types` names
//!   each layer `mamba` or `attention`; Falcon-H1 (`model_type` falcon_h1) keeps attention and
//!   Mamba2 side by side on every layer. A Mamba2 layer keeps a conv state of
//!   `conv_kernel - 1 + num_spec` time steps (`num_spec`: the engine's speculative tokens) over
//!   x (`mamba_num_heads * mamba_head_dim` channels, split by heads), B and C
//!   (`n_groups * ssm_state_size` channels each, split by groups; one group is held whole when
//!   `n_groups == 1`), and an SSM state of `mamba_num_heads` heads of `mamba_head_dim * ssm_state_size`
//!   elements (vLLM `mamba2_state_shape` and `extra_groups_for_head_shards`; SGLang's
//!   `Mamba2StateShape` is the same without `num_spec`). Granite-4.0-H and Falcon-H1 spell the
//!   fields `mamba_n_heads`, `mamba_d_head`, `mamba_n_groups`, `mamba_d_state`, `mamba_d_conv`.
//!
//! The dtypes, as vLLM names them: the conv state in `mamba_cache_dtype` (default: the model's
//! dtype, not the KV cache's), the SSM state in `mamba_ssm_cache_dtype` (default: the config's,
//! else fp32 for Nemotron-H, else the conv state's); see [`ModelFacts::ssm_default`].
//!
//! What is not here on purpose: where a state's parts lie inside its slot. vLLM keeps a conv
//! state as `(state_len, dim)` or `(dim, state_len)` (`VLLM_SSM_CONV_STATE_LAYOUT`), SGLang as
//! its own shape, and an engine may pad a slot; so the sends and byte counts here do not depend
//! on it, and the byte positions come from the caller (Python: `mori_tp.models.conv_state_layouts`
//! takes the orientation and the slot stride).

use serde_json::{Map, Value};

use crate::dtype::Dtype;
use crate::fields::{positive, required, string_list};

/// Where a group's bytes of a request live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Pages of token slots; every token of the request moves (or, with a window, the last
    /// `window` tokens).
    Paged { window: Option<u32> },
    /// One slot per request holding `steps` time steps (a conv state's `kernel - 1`, to which
    /// [`Group::steps`] adds the speculative tokens; 1 for an SSM or recurrent state), whatever
    /// the request's length.
    Slot { steps: u32 },
}

/// How many bytes one unit of a part is, per token (paged) or per time step (slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitBytes {
    /// `elements * the KV-cache dtype` (`--dtype`).
    Cache(u64),
    /// `elements * the conv state dtype` (`--mamba-cache-dtype`).
    Conv(u64),
    /// `elements * the SSM state dtype` (`--mamba-ssm-cache-dtype`).
    State(u64),
    /// A fixed record whatever the dtype (the indexer's fp8 keys and fp32 scales).
    Fixed(u64),
    /// The MLA latent: `(rank + rope) * dtype`, or with fp8 `rank + rank / 128 * 4 + rope * 2`.
    MlaLatent { rank: u64, rope: u64 },
}

/// Bytes of a dtype, for [`UnitBytes::bytes`].
#[derive(Clone, Copy, Debug)]
pub struct Dtypes {
    pub cache: u64,
    pub cache_is_fp8: bool,
    pub conv: u64,
    pub state: u64,
}

impl Dtypes {
    /// The bytes of a KV-cache dtype, a conv state dtype and an SSM state dtype.
    pub fn of(cache: Dtype, conv: Dtype, state: Dtype) -> Dtypes {
        Dtypes {
            cache: u64::from(cache.bytes()),
            cache_is_fp8: cache.bytes() == 1,
            conv: u64::from(conv.bytes()),
            state: u64::from(state.bytes()),
        }
    }
}

impl UnitBytes {
    pub fn bytes(self, dtypes: Dtypes) -> u64 {
        match self {
            UnitBytes::Cache(elements) => elements * dtypes.cache,
            UnitBytes::Conv(elements) => elements * dtypes.conv,
            UnitBytes::State(elements) => elements * dtypes.state,
            UnitBytes::Fixed(bytes) => bytes,
            UnitBytes::MlaLatent { rank, rope } if dtypes.cache_is_fp8 => {
                rank + rank / FP8_SCALE_BLOCK * 4 + rope * 2
            }
            UnitBytes::MlaLatent { rank, rope } => (rank + rope) * dtypes.cache,
        }
    }
}

/// Elements sharing one fp32 scale in the fp8 indexer and latent (SGLang `quant_block_size`).
pub const FP8_SCALE_BLOCK: u64 = 128;

/// One part of a group: units sharded over TP ranks as KV heads are (or held whole when there is
/// one unit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// `kv`, `latent`, `index_k`, `x`, `B`, `C`, `q`, `k`, `v`, `state`.
    pub name: &'static str,
    /// What a unit is, for people: `head`, `group`, `record`.
    pub unit: &'static str,
    /// `H`: units before TP.
    pub units: u32,
    pub bytes: UnitBytes,
    /// The engines split this part only evenly (`units % tp == 0`), never replicating a unit
    /// over several ranks (Mamba2 heads and groups, Gated DeltaNet heads: vLLM's `divide`).
    pub must_divide: bool,
}

/// Layers that keep the same kind of state in the same shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// `full_attention`, `sliding_attention`, `mla_latent`, `indexer`, `conv_state`,
    /// `ssm_state`, `recurrent_state`.
    pub name: &'static str,
    /// What it holds, for people.
    pub what: &'static str,
    /// Global layer indices.
    pub layers: Vec<u32>,
    /// Buffers per layer: K and V, or one.
    pub buffers_per_layer: u32,
    pub storage: Storage,
    pub parts: Vec<Part>,
}

impl Group {
    /// A slot's time steps with `num_spec` speculative tokens: vLLM sizes a conv state
    /// `conv_kernel - 1 + num_spec` rows (Mamba2 and Gated DeltaNet alike); an SSM or recurrent
    /// state keeps one. None for a paged group.
    pub fn steps(&self, num_spec: u32) -> Option<u32> {
        match self.storage {
            Storage::Slot { steps } if self.name == "conv_state" => Some(steps + num_spec),
            Storage::Slot { steps } => Some(steps),
            Storage::Paged { .. } => None,
        }
    }
}

/// Where the SSM state's dtype comes from when the engine is not told one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SsmDefault {
    /// The config names it (`mamba_ssm_cache_dtype` or `mamba_ssm_dtype`: the field and its
    /// text).
    Config(&'static str, String),
    /// vLLM's Nemotron-H default: fp32 (`NemotronHForCausalLMConfig`, vLLM PR #39032).
    NemotronH,
    /// The conv state's dtype (vLLM's `MambaStateDtypeCalculator` for `auto`).
    Conv,
}

/// The architectures vLLM's Nemotron-H SSM dtype hook applies to.
const NEMOTRON_H_ARCHITECTURES: &[&str] = &[
    "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM",
    "NemotronH_Nano_VL_V2",
];

/// Everything a transfer needs to know about a model's state, by group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFacts {
    /// `dense`, `mla`, `mla_indexer`, `sliding_window`, `gated_deltanet`, `mamba2`.
    pub family: &'static str,
    pub total_layers: u32,
    pub groups: Vec<Group>,
    /// The config's SSM state dtype (`mamba_ssm_cache_dtype` or `mamba_ssm_dtype`: the field and
    /// its text), if it names one.
    pub ssm_dtype: Option<(&'static str, String)>,
    /// The config's `architectures`.
    pub architectures: Vec<String>,
}

impl ModelFacts {
    /// More than one kind of state: the plan prints every group.
    pub fn is_hybrid(&self) -> bool {
        self.groups.len() > 1
    }

    /// The group the classic plan describes: the first paged group (full attention or the MLA
    /// latent).
    pub fn main_group(&self) -> &Group {
        self.groups
            .iter()
            .find(|g| matches!(g.storage, Storage::Paged { window: None }))
            .unwrap_or(&self.groups[0])
    }

    /// True when some group holds a state slot (Mamba2 or Gated DeltaNet).
    pub fn has_state(&self) -> bool {
        self.groups
            .iter()
            .flat_map(|g| &g.parts)
            .any(|p| matches!(p.bytes, UnitBytes::State(_) | UnitBytes::Conv(_)))
    }

    /// Where the SSM state's dtype comes from when the engine names none (vLLM's rule).
    pub fn ssm_default(&self) -> SsmDefault {
        if let Some((field, text)) = &self.ssm_dtype {
            SsmDefault::Config(field, text.clone())
        } else if self
            .architectures
            .iter()
            .any(|a| NEMOTRON_H_ARCHITECTURES.contains(&a.as_str()))
        {
            SsmDefault::NemotronH
        } else {
            SsmDefault::Conv
        }
    }
}

/// The KV shape `model.rs` already read: what dense and MLA groups are made of.
pub struct KvShape {
    pub kv_heads: u32,
    pub head_dim: u32,
    pub layers: u32,
    /// `(kv_lora_rank, qk_rope_head_dim)` for MLA.
    pub mla: Option<(u32, u32)>,
}

fn kv_group(name: &'static str, what: &'static str, layers: Vec<u32>, kv: &KvShape) -> Group {
    Group {
        name,
        what,
        layers,
        buffers_per_layer: 2,
        storage: Storage::Paged { window: None },
        parts: vec![Part {
            name: "kv",
            unit: "head",
            units: kv.kv_heads,
            bytes: UnitBytes::Cache(u64::from(kv.head_dim)),
            must_divide: false,
        }],
    }
}

/// Each layer's type: `layer_types` as given (checked against the layer count), or the pattern
/// rule that transformers applies when a config leaves it out.
fn layer_types(
    obj: &Map<String, Value>,
    layers: u32,
    fallback: Option<(&str, u32, &'static str, &'static str)>,
) -> Result<Option<Vec<String>>, String> {
    if let Some(types) = string_list(obj, "layer_types")? {
        if types.len() != layers as usize {
            return Err(format!(
                "`layer_types` lists {} layers but `num_hidden_layers` is {layers}",
                types.len()
            ));
        }
        return Ok(Some(types.into_iter().map(str::to_string).collect()));
    }
    Ok(fallback.map(|(_, every, full, other)| {
        (0..layers)
            .map(|i| if (i + 1) % every == 0 { full } else { other }.to_string())
            .collect()
    }))
}

fn indices(types: &[String], name: &str) -> Vec<u32> {
    types
        .iter()
        .enumerate()
        .filter(|(_, t)| t.as_str() == name)
        .map(|(i, _)| i as u32)
        .collect()
}

/// The model facts of a config whose KV shape `kv` was read already.
pub fn derive(
    obj: &Map<String, Value>,
    root: &Map<String, Value>,
    kv: &KvShape,
) -> Result<ModelFacts, String> {
    let all: Vec<u32> = (0..kv.layers).collect();
    let ssm_dtype = ["mamba_ssm_cache_dtype", "mamba_ssm_dtype"]
        .into_iter()
        .find_map(|k| Some((k, obj.get(k)?.as_str()?.to_string())));
    let architectures: Vec<String> = [root, obj]
        .iter()
        .find_map(|o| o.get("architectures")?.as_array())
        .map(|list| {
            list.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    // A group no layer has (a pattern without attention layers) is left out.
    let facts = |family, mut groups: Vec<Group>| {
        groups.retain(|g| !g.layers.is_empty());
        ModelFacts {
            family,
            total_layers: kv.layers,
            groups,
            ssm_dtype: ssm_dtype.clone(),
            architectures: architectures.clone(),
        }
    };

    if let Some((rank, rope)) = kv.mla {
        let index = positive(obj, "index_head_dim")?;
        let latent = |bytes| Group {
            name: "mla_latent",
            what: "MLA latent (kv_lora_rank + qk_rope_head_dim), one per token",
            layers: all.clone(),
            buffers_per_layer: 1,
            storage: Storage::Paged { window: None },
            parts: vec![Part {
                name: "latent",
                unit: "head",
                units: 1,
                bytes,
                must_divide: false,
            }],
        };
        let Some(index_dim) = index else {
            return Ok(facts(
                "mla",
                vec![latent(UnitBytes::Cache(u64::from(rank) + u64::from(rope)))],
            ));
        };
        if u64::from(index_dim) % FP8_SCALE_BLOCK != 0 {
            return Err(format!(
                "`index_head_dim` {index_dim} is not a multiple of {FP8_SCALE_BLOCK}, the \
                 elements that share one fp32 scale in the fp8 indexer cache"
            ));
        }
        let record = u64::from(index_dim) + u64::from(index_dim) / FP8_SCALE_BLOCK * 4;
        return Ok(facts(
            "mla_indexer",
            vec![
                latent(UnitBytes::MlaLatent {
                    rank: u64::from(rank),
                    rope: u64::from(rope),
                }),
                Group {
                    name: "indexer",
                    what: "indexer keys, fp8 with one fp32 scale per 128, one record per token",
                    layers: all,
                    buffers_per_layer: 1,
                    storage: Storage::Paged { window: None },
                    parts: vec![Part {
                        name: "index_k",
                        unit: "record",
                        units: 1,
                        bytes: UnitBytes::Fixed(record),
                        must_divide: false,
                    }],
                },
            ],
        ));
    }

    if obj.contains_key("hybrid_override_pattern") || obj.contains_key("mamba_n_heads") {
        return mamba2(obj, kv).map(|groups| facts("mamba2", groups));
    }

    let linear = obj.get("linear_conv_kernel_dim").is_some()
        || string_list(obj, "layer_types")?.is_some_and(|t| t.contains(&"linear_attention"));
    if linear {
        let interval = positive(obj, "full_attention_interval")?;
        let types = layer_types(
            obj,
            kv.layers,
            interval.map(|n| {
                (
                    "full_attention_interval",
                    n,
                    "full_attention",
                    "linear_attention",
                )
            }),
        )?
        .ok_or("a Gated DeltaNet model needs `layer_types` or `full_attention_interval`")?;
        return gated_deltanet(obj, kv, &types).map(|groups| facts("gated_deltanet", groups));
    }

    let pattern = match positive(obj, "sliding_window_pattern")? {
        Some(n) => Some(n),
        None => positive(obj, "_sliding_window_pattern")?,
    };
    let types = layer_types(
        obj,
        kv.layers,
        pattern.map(|n| {
            (
                "sliding_window_pattern",
                n,
                "full_attention",
                "sliding_attention",
            )
        }),
    )?;
    if let Some(types) = types.filter(|t| t.iter().any(|t| t == "sliding_attention")) {
        let window = required(
            obj,
            "sliding_window",
            "its sliding_attention layers keep this many tokens",
        )?;
        for t in &types {
            if t != "full_attention" && t != "sliding_attention" {
                return Err(format!(
                    "`layer_types` names a layer `{t}`; mori-tp knows full_attention and \
                     sliding_attention here"
                ));
            }
        }
        let mut groups = vec![];
        let full = indices(&types, "full_attention");
        if !full.is_empty() {
            groups.push(kv_group(
                "full_attention",
                "K and V of every token",
                full,
                kv,
            ));
        }
        let mut sliding = kv_group(
            "sliding_attention",
            "K and V of the last sliding_window tokens",
            indices(&types, "sliding_attention"),
            kv,
        );
        sliding.storage = Storage::Paged {
            window: Some(window),
        };
        groups.push(sliding);
        return Ok(facts("sliding_window", groups));
    }

    Ok(facts(
        "dense",
        vec![kv_group(
            "full_attention",
            "K and V of every token",
            all,
            kv,
        )],
    ))
}

fn gated_deltanet(
    obj: &Map<String, Value>,
    kv: &KvShape,
    types: &[String],
) -> Result<Vec<Group>, String> {
    let why = "a Gated DeltaNet layer's conv and recurrent state";
    let k_heads = required(obj, "linear_num_key_heads", why)?;
    let v_heads = required(obj, "linear_num_value_heads", why)?;
    let k_dim = u64::from(required(obj, "linear_key_head_dim", why)?);
    let v_dim = u64::from(required(obj, "linear_value_head_dim", why)?);
    let kernel = required(obj, "linear_conv_kernel_dim", why)?;
    if kernel < 2 {
        return Err(format!(
            "`linear_conv_kernel_dim` is {kernel}: a conv state keeps kernel - 1 time steps"
        ));
    }
    for t in types {
        if t != "full_attention" && t != "linear_attention" {
            return Err(format!(
                "`layer_types` names a layer `{t}`; a Qwen3-Next model has full_attention and \
                 linear_attention layers"
            ));
        }
    }
    let linear = indices(types, "linear_attention");
    let part = |name, units, elements| Part {
        name,
        unit: "head",
        units,
        bytes: UnitBytes::Conv(elements),
        must_divide: true,
    };
    Ok(vec![
        kv_group(
            "full_attention",
            "K and V of every token",
            indices(types, "full_attention"),
            kv,
        ),
        Group {
            name: "conv_state",
            what: "Gated DeltaNet conv1d state of q, k and v",
            layers: linear.clone(),
            buffers_per_layer: 1,
            storage: Storage::Slot { steps: kernel - 1 },
            parts: vec![
                part("q", k_heads, k_dim),
                part("k", k_heads, k_dim),
                part("v", v_heads, v_dim),
            ],
        },
        Group {
            name: "recurrent_state",
            what: "Gated DeltaNet recurrent state, per value head",
            layers: linear,
            buffers_per_layer: 1,
            storage: Storage::Slot { steps: 1 },
            parts: vec![Part {
                name: "state",
                unit: "head",
                units: v_heads,
                bytes: UnitBytes::State(v_dim * k_dim),
                must_divide: true,
            }],
        },
    ])
}

/// A Mamba2 hybrid's fields, as Nemotron-H names them and as Falcon-H1 and Granite-4.0-H do:
/// heads, head dimension, groups, state size, conv kernel.
const NEMOTRON_H_FIELDS: [&str; 5] = [
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "ssm_state_size",
    "conv_kernel",
];
const MAMBA_N_FIELDS: [&str; 5] = [
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
];

/// (attention layers, Mamba2 layers): Nemotron-H's `hybrid_override_pattern`; else
/// `layer_types` (Granite-4.0-H: `mamba`, `attention`; `hybrid`: both, as Falcon-H1's
/// `layers_block_type`); else Falcon-H1's parallel hybrid (attention and Mamba2 side by side on
/// every layer) or Granite-4.0-H's default (every layer Mamba2), by `model_type`.
fn mamba2_layers(obj: &Map<String, Value>, layers: u32) -> Result<(Vec<u32>, Vec<u32>), String> {
    if let Some(pattern) = obj.get("hybrid_override_pattern") {
        let pattern = pattern
            .as_str()
            .ok_or_else(|| format!("`hybrid_override_pattern` is {pattern}, expected a string"))?;
        if pattern.chars().count() != layers as usize {
            return Err(format!(
                "`hybrid_override_pattern` has {} layers but `num_hidden_layers` is {layers}",
                pattern.chars().count()
            ));
        }
        let (mut attention, mut mamba) = (Vec::new(), Vec::new());
        for (i, c) in pattern.chars().enumerate() {
            match c {
                'M' => mamba.push(i as u32),
                '*' => attention.push(i as u32),
                '-' | 'E' => {}
                other => {
                    return Err(format!(
                        "`hybrid_override_pattern` has `{other}` at layer {i}; mori-tp knows M \
                         (Mamba2), * (attention), - (MLP) and E (MoE)"
                    ));
                }
            }
        }
        return Ok((attention, mamba));
    }
    if let Some(types) = layer_types(obj, layers, None)? {
        if let Some(t) = types
            .iter()
            .find(|t| !matches!(t.as_str(), "mamba" | "attention" | "hybrid"))
        {
            return Err(format!(
                "`layer_types` names a layer `{t}`; a Mamba2 hybrid with `mamba_n_heads` has \
                 mamba, attention and hybrid (both) layers"
            ));
        }
        let of = |kinds: [&str; 2]| -> Vec<u32> {
            (0..layers)
                .filter(|&i| kinds.contains(&types[i as usize].as_str()))
                .collect()
        };
        return Ok((of(["attention", "hybrid"]), of(["mamba", "hybrid"])));
    }
    let every: Vec<u32> = (0..layers).collect();
    match obj.get("model_type").and_then(Value::as_str) {
        // transformers' layers_block_type: every layer "hybrid".
        Some("falcon_h1") => Ok((every.clone(), every)),
        // No layer_types: every layer Mamba2.
        Some("granitemoehybrid") => Ok((Vec::new(), every)),
        _ => Err(
            "a Mamba2 hybrid with `mamba_n_heads` needs `layer_types` or a `model_type` \
                  mori-tp knows (falcon_h1, granitemoehybrid) to say which layers keep which \
                  state"
                .into(),
        ),
    }
}

/// `mamba_d_head`, or for `"auto"` (transformers' Falcon-H1 and Granite-4.0-H configs) the
/// Mamba2 intermediate size (`mamba_d_ssm`, else `mamba_expand * hidden_size`) over the heads.
fn mamba_head_dim(
    obj: &Map<String, Value>,
    key: &str,
    heads: u32,
    why: &str,
) -> Result<u32, String> {
    if obj.get(key).and_then(Value::as_str) != Some("auto") {
        return required(obj, key, why);
    }
    let auto = format!("`{key}` is auto");
    let intermediate = match positive(obj, "mamba_d_ssm")? {
        Some(d) => u64::from(d),
        None => {
            u64::from(required(obj, "mamba_expand", &auto)?)
                * u64::from(required(obj, "hidden_size", &auto)?)
        }
    };
    if intermediate % u64::from(heads) != 0 {
        return Err(format!(
            "{auto}, and the Mamba2 intermediate size {intermediate} is not a multiple of the \
             {heads} heads"
        ));
    }
    u32::try_from(intermediate / u64::from(heads))
        .map_err(|_| format!("{auto}, and its head dimension overflows 32 bits"))
}

fn mamba2(obj: &Map<String, Value>, kv: &KvShape) -> Result<Vec<Group>, String> {
    let (attention, mamba) = mamba2_layers(obj, kv.layers)?;
    let [heads_key, dim_key, groups_key, state_key, kernel_key] =
        if obj.contains_key("hybrid_override_pattern") {
            NEMOTRON_H_FIELDS
        } else {
            MAMBA_N_FIELDS
        };
    let why = "a Mamba2 layer's conv and SSM state";
    let heads = required(obj, heads_key, why)?;
    let head_dim = mamba_head_dim(obj, dim_key, heads, why)?;
    let groups = required(obj, groups_key, why)?;
    let state = u64::from(required(obj, state_key, why)?);
    let kernel = required(obj, kernel_key, why)?;
    if kernel < 2 {
        return Err(format!(
            "`{kernel_key}` is {kernel}: a conv state keeps kernel - 1 time steps"
        ));
    }
    // Falcon-H1 names x's channels (the Mamba2 intermediate size) too: they are the heads'.
    let x_channels = u64::from(heads) * u64::from(head_dim);
    if let Some(d_ssm) = positive(obj, "mamba_d_ssm")? {
        if u64::from(d_ssm) != x_channels {
            return Err(format!(
                "`mamba_d_ssm` {d_ssm} is not `{heads_key}` {heads} x `{dim_key}` {head_dim} = \
                 {x_channels}: x's channels split by heads"
            ));
        }
    }
    if groups > 1 && heads % groups != 0 {
        return Err(format!(
            "`{heads_key}` {heads} is not a multiple of `{groups_key}` {groups}: each group \
             serves whole heads"
        ));
    }
    let head_dim = u64::from(head_dim);
    // Nemotron-H names the attention head size `attention_head_dim` (later releases: head_dim).
    let attention_dim = match positive(obj, "attention_head_dim")? {
        Some(d) => d,
        None => kv.head_dim,
    };
    let attention_kv = KvShape {
        kv_heads: kv.kv_heads,
        head_dim: attention_dim,
        layers: kv.layers,
        mla: None,
    };
    let bc = |name| Part {
        name,
        unit: "group",
        units: groups,
        bytes: UnitBytes::Conv(state),
        must_divide: groups > 1,
    };
    Ok(vec![
        kv_group(
            "full_attention",
            "K and V of every token",
            attention,
            &attention_kv,
        ),
        Group {
            name: "conv_state",
            what: "Mamba2 conv1d state of x, B and C",
            layers: mamba.clone(),
            buffers_per_layer: 1,
            storage: Storage::Slot { steps: kernel - 1 },
            parts: vec![
                Part {
                    name: "x",
                    unit: "head",
                    units: heads,
                    bytes: UnitBytes::Conv(head_dim),
                    must_divide: true,
                },
                bc("B"),
                bc("C"),
            ],
        },
        Group {
            name: "ssm_state",
            what: "Mamba2 SSM state, per head",
            layers: mamba,
            buffers_per_layer: 1,
            storage: Storage::Slot { steps: 1 },
            parts: vec![Part {
                name: "state",
                unit: "head",
                units: heads,
                bytes: UnitBytes::State(head_dim * state),
                must_divide: true,
            }],
        },
    ])
}
