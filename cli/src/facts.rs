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
//! - **Mamba2 hybrid (Nemotron-H)**: `hybrid_override_pattern` has one character per layer: `M`
//!   Mamba2, `*` attention, `-` MLP, `E` MoE (no cache). A Mamba2 layer keeps a conv state of
//!   `conv_kernel - 1` time steps over x (`mamba_num_heads * mamba_head_dim` channels, split by
//!   heads), B and C (`n_groups * ssm_state_size` channels each, split by groups; one group is
//!   held whole when `n_groups == 1`), and an SSM state of `mamba_num_heads` heads of
//!   `mamba_head_dim * ssm_state_size` elements (vLLM `mamba2_state_shape` and
//!   `extra_groups_for_head_shards`; SGLang's `Mamba2StateShape` is the same).
//!
//! What is not here on purpose: where a state's parts lie inside its slot. vLLM keeps a conv
//! state as `(state_len, dim)` or `(dim, state_len)` (`VLLM_SSM_CONV_STATE_LAYOUT`), SGLang as
//! its own shape, and an engine may pad a slot; so the sends and byte counts here do not depend
//! on it, and the byte positions come from the caller (Python: `mori_tp.models.conv_state_layouts`
//! takes the orientation and the slot stride).

use serde_json::{Map, Value};

use crate::model::{positive, required};

/// Where a group's bytes of a request live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Pages of token slots; every token of the request moves (or, with a window, the last
    /// `window` tokens).
    Paged { window: Option<u32> },
    /// One slot per request holding `steps` time steps (a conv state's `kernel - 1`; 1 for an SSM
    /// or recurrent state), whatever the request's length.
    Slot { steps: u32 },
}

/// How many bytes one unit of a part is, per token (paged) or per time step (slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitBytes {
    /// `elements * the cache dtype` (`--dtype`).
    Cache(u64),
    /// `elements * the SSM state dtype` (`--ssm-dtype`).
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
    pub state: u64,
}

impl UnitBytes {
    pub fn bytes(self, dtypes: Dtypes) -> u64 {
        match self {
            UnitBytes::Cache(elements) => elements * dtypes.cache,
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

/// Everything a transfer needs to know about a model's state, by group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFacts {
    /// `dense`, `mla`, `mla_indexer`, `sliding_window`, `gated_deltanet`, `mamba2`.
    pub family: &'static str,
    pub total_layers: u32,
    pub groups: Vec<Group>,
    /// The config's SSM state dtype (`mamba_ssm_cache_dtype` or `mamba_ssm_dtype`), if it names
    /// one.
    pub ssm_dtype: Option<String>,
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

    /// True when some group holds a state slot (its dtype comes from `--ssm-dtype`).
    pub fn has_state(&self) -> bool {
        self.groups
            .iter()
            .flat_map(|g| &g.parts)
            .any(|p| matches!(p.bytes, UnitBytes::State(_)))
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

fn string_list<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<Vec<&'a str>>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| format!("`{key}` holds {v}, expected strings"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(format!("`{key}` is {other}, expected a list of strings")),
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
pub fn derive(obj: &Map<String, Value>, kv: &KvShape) -> Result<ModelFacts, String> {
    let all: Vec<u32> = (0..kv.layers).collect();
    let ssm_dtype = ["mamba_ssm_cache_dtype", "mamba_ssm_dtype"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(Value::as_str))
        .map(str::to_string);
    // A group no layer has (a pattern without attention layers) is left out.
    let facts = |family, mut groups: Vec<Group>| {
        groups.retain(|g| !g.layers.is_empty());
        ModelFacts {
            family,
            total_layers: kv.layers,
            groups,
            ssm_dtype: ssm_dtype.clone(),
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

    if let Some(pattern) = obj.get("hybrid_override_pattern") {
        return mamba2(obj, kv, pattern).map(|groups| facts("mamba2", groups));
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
        bytes: UnitBytes::Cache(elements),
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

fn mamba2(obj: &Map<String, Value>, kv: &KvShape, pattern: &Value) -> Result<Vec<Group>, String> {
    let pattern = pattern
        .as_str()
        .ok_or_else(|| format!("`hybrid_override_pattern` is {pattern}, expected a string"))?;
    if pattern.chars().count() != kv.layers as usize {
        return Err(format!(
            "`hybrid_override_pattern` has {} layers but `num_hidden_layers` is {}",
            pattern.chars().count(),
            kv.layers
        ));
    }
    let mut attention = Vec::new();
    let mut mamba = Vec::new();
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
    let why = "a Mamba2 layer's conv and SSM state";
    let heads = required(obj, "mamba_num_heads", why)?;
    let head_dim = u64::from(required(obj, "mamba_head_dim", why)?);
    let groups = required(obj, "n_groups", why)?;
    let state = u64::from(required(obj, "ssm_state_size", why)?);
    let kernel = required(obj, "conv_kernel", why)?;
    if kernel < 2 {
        return Err(format!(
            "`conv_kernel` is {kernel}: a conv state keeps kernel - 1 time steps"
        ));
    }
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
        bytes: UnitBytes::Cache(state),
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
                    bytes: UnitBytes::Cache(head_dim),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Attention, from_config_json};

    fn facts(text: &str) -> ModelFacts {
        from_config_json(text, "config.json")
            .expect("a config mori-tp reads")
            .facts
            .expect("a config has facts")
    }

    const BF16: Dtypes = Dtypes {
        cache: 2,
        cache_is_fp8: false,
        state: 2,
    };

    fn unit_bytes(f: &ModelFacts, group: &str, part: &str, dtypes: Dtypes) -> u64 {
        let g = f.groups.iter().find(|g| g.name == group).expect(group);
        g.parts
            .iter()
            .find(|p| p.name == part)
            .expect(part)
            .bytes
            .bytes(dtypes)
    }

    #[test]
    fn a_dense_gqa_model_is_one_full_attention_group_on_every_layer() {
        // The fields mori-tp reads of Qwen2.5-7B: 4 KV heads of 3584 / 28 = 128 elements.
        let f = facts(
            r#"{"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                "num_hidden_layers": 28, "sliding_window": 131072, "use_sliding_window": false}"#,
        );
        assert_eq!((f.family, f.total_layers, f.groups.len()), ("dense", 28, 1));
        let g = &f.groups[0];
        assert_eq!(g.layers, (0..28).collect::<Vec<_>>());
        assert_eq!(
            (g.buffers_per_layer, g.storage, g.parts[0].units),
            (2, Storage::Paged { window: None }, 4)
        );
        assert_eq!(unit_bytes(&f, "full_attention", "kv", BF16), 3584 / 28 * 2);
        assert!(!f.is_hybrid());
    }

    #[test]
    fn deepseek_v32_keeps_the_latent_and_a_132_byte_indexer_record_on_every_layer() {
        let text = r#"{"num_hidden_layers": 61, "num_attention_heads": 128,
                       "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                       "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}"#;
        let f = facts(text);
        assert_eq!(f.family, "mla_indexer");
        let names: Vec<&str> = f.groups.iter().map(|g| g.name).collect();
        assert_eq!(names, ["mla_latent", "indexer"]);
        for g in &f.groups {
            assert_eq!(g.layers.len(), 61);
            assert_eq!((g.buffers_per_layer, g.parts[0].units), (1, 1));
        }
        // 128 fp8 bytes + 128 / 128 fp32 scales of 4 bytes, whatever the cache dtype.
        let fp8 = Dtypes {
            cache: 1,
            cache_is_fp8: true,
            state: 1,
        };
        for dtypes in [BF16, fp8] {
            assert_eq!(unit_bytes(&f, "indexer", "index_k", dtypes), 128 + 4);
        }
        // The latent: (512 + 64) bf16 elements, or 512 fp8 + 512 / 128 * 4 scale bytes + 64 bf16.
        assert_eq!(unit_bytes(&f, "mla_latent", "latent", BF16), 576 * 2);
        assert_eq!(unit_bytes(&f, "mla_latent", "latent", fp8), 512 + 16 + 128);
        let model = from_config_json(text, "config.json").unwrap();
        assert_eq!(
            (
                model.kv_heads,
                model.head_dim,
                model.layers,
                model.attention
            ),
            (1, 576, 61, Attention::Mla)
        );
        // DeepSeek V3 (no indexer) keeps its single latent group.
        let v3 = facts(r#"{"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}"#);
        assert_eq!((v3.family, v3.groups.len()), ("mla", 1));
        let odd = from_config_json(
            r#"{"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "index_head_dim": 100}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(
            odd.contains("index_head_dim") && odd.contains("100"),
            "{odd}"
        );
    }

    #[test]
    fn gpt_oss_layer_types_split_full_and_sliding_layers() {
        let types: Vec<&str> = (0..24)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        let text = format!(
            r#"{{"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                 "head_dim": 64, "sliding_window": 128, "layer_types": {}}}"#,
            serde_json::to_string(&types).unwrap()
        );
        let f = facts(&text);
        assert_eq!(f.family, "sliding_window");
        let full = &f.groups[0];
        let sliding = &f.groups[1];
        assert_eq!(full.name, "full_attention");
        assert_eq!(full.layers, (1..24).step_by(2).collect::<Vec<_>>());
        assert_eq!(sliding.layers, (0..24).step_by(2).collect::<Vec<_>>());
        assert_eq!(sliding.storage, Storage::Paged { window: Some(128) });
        assert_eq!(unit_bytes(&f, "sliding_attention", "kv", BF16), 64 * 2);
        // The classic plan describes the full-attention layers.
        let model = from_config_json(&text, "config.json").unwrap();
        assert_eq!((model.kv_heads, model.head_dim, model.layers), (8, 64, 12));
    }

    #[test]
    fn gemma3_without_layer_types_follows_its_sliding_window_pattern() {
        // Gemma 3: every sixth layer is global ((i + 1) % 6 == 0), the rest slide over 1024.
        let f = facts(
            r#"{"model_type": "gemma3", "text_config": {"num_hidden_layers": 62,
                "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                "sliding_window": 1024, "sliding_window_pattern": 6}}"#,
        );
        let full: Vec<u32> = (0..62).filter(|i| (i + 1) % 6 == 0).collect();
        assert_eq!(f.groups[0].layers, full);
        assert_eq!(f.groups[1].layers.len(), 62 - full.len());
        assert_eq!(f.groups[1].storage, Storage::Paged { window: Some(1024) });
        let no_window = from_config_json(
            r#"{"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 256, "sliding_window_pattern": 6}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(no_window.contains("sliding_window"), "{no_window}");
    }

    #[test]
    fn qwen3_next_keeps_a_three_part_conv_state_and_a_recurrent_state_on_linear_layers() {
        // The fields of Qwen3-Next-80B-A3B's config.json.
        let f = facts(
            r#"{"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "linear_value_head_dim": 128}"#,
        );
        assert_eq!(f.family, "gated_deltanet");
        let full: Vec<u32> = (0..48).filter(|i| (i + 1) % 4 == 0).collect();
        let linear: Vec<u32> = (0..48).filter(|i| (i + 1) % 4 != 0).collect();
        let names: Vec<&str> = f.groups.iter().map(|g| g.name).collect();
        assert_eq!(names, ["full_attention", "conv_state", "recurrent_state"]);
        assert_eq!(f.groups[0].layers, full);
        assert_eq!(f.groups[1].layers, linear);
        assert_eq!(f.groups[2].layers, linear);
        // kernel 4 keeps 3 time steps; q and k: 16 key heads of 128, v: 32 value heads of 128.
        assert_eq!(f.groups[1].storage, Storage::Slot { steps: 3 });
        let conv: Vec<(&str, u32)> = f.groups[1]
            .parts
            .iter()
            .map(|p| (p.name, p.units))
            .collect();
        assert_eq!(conv, [("q", 16), ("k", 16), ("v", 32)]);
        assert_eq!(unit_bytes(&f, "conv_state", "v", BF16), 128 * 2);
        let fp32_state = Dtypes {
            cache: 2,
            cache_is_fp8: false,
            state: 4,
        };
        assert_eq!(
            unit_bytes(&f, "recurrent_state", "state", fp32_state),
            128 * 128 * 4
        );
        assert!(f.groups[1].parts.iter().all(|p| p.must_divide));
        assert!(f.has_state());
    }

    #[test]
    fn nemotron_h_reads_its_pattern_x_b_c_and_the_ssm_state() {
        // The fields of Nemotron-H-8B-Base-8K's config.json.
        let pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
        let text = format!(
            r#"{{"num_hidden_layers": 52, "hidden_size": 4096, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "attention_head_dim": 128, "conv_kernel": 4,
                 "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
                 "ssm_state_size": 128, "hybrid_override_pattern": "{pattern}"}}"#
        );
        let f = facts(&text);
        assert_eq!(f.family, "mamba2");
        let at = |c: char| -> Vec<u32> {
            pattern
                .char_indices()
                .filter(|&(_, x)| x == c)
                .map(|(i, _)| i as u32)
                .collect()
        };
        assert_eq!(f.groups[0].layers, at('*'));
        assert_eq!(f.groups[1].layers, at('M'));
        assert_eq!(f.groups[2].layers, at('M'));
        assert_eq!((at('*').len(), at('M').len()), (4, 24));
        assert_eq!(f.groups[1].storage, Storage::Slot { steps: 3 });
        let conv: Vec<(&str, u32, u64)> = f.groups[1]
            .parts
            .iter()
            .map(|p| (p.name, p.units, p.bytes.bytes(BF16)))
            .collect();
        // x: 128 heads of 64 channels; B and C: 8 groups of ssm_state_size 128 channels.
        assert_eq!(
            conv,
            [("x", 128, 64 * 2), ("B", 8, 128 * 2), ("C", 8, 128 * 2)]
        );
        assert_eq!(unit_bytes(&f, "ssm_state", "state", BF16), 64 * 128 * 2);
        assert_eq!(unit_bytes(&f, "full_attention", "kv", BF16), 128 * 2);
        let model = from_config_json(&text, "config.json").unwrap();
        assert_eq!((model.kv_heads, model.head_dim, model.layers), (8, 128, 4));
        // One group is held whole: replicated on every rank, never refused for its TP size.
        let single = text.replace("\"n_groups\": 8", "\"n_groups\": 1");
        let f = facts(&single);
        let b = &f.groups[1].parts[1];
        assert_eq!((b.units, b.must_divide), (1, false));
        let bad = text.replace(pattern, "M*Q");
        let err = from_config_json(&bad, "config.json").unwrap_err();
        assert!(err.contains("hybrid_override_pattern"), "{err}");
    }

    #[test]
    fn layer_types_of_the_wrong_length_or_kind_are_named() {
        let err = from_config_json(
            r#"{"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                "head_dim": 8, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"]}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(
            err.contains("layer_types") && err.contains('2') && err.contains('3'),
            "{err}"
        );
        let err = from_config_json(
            r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                "head_dim": 8, "sliding_window": 16,
                "layer_types": ["sliding_attention", "chunked_attention"]}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(err.contains("chunked_attention"), "{err}");
    }
}
