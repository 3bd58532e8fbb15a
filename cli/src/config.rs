//! Reading a model from a Hugging Face `config.json`: its KV-cache shape (what the classic plan
//! describes) and its facts (every group of layers and its state, `crate::facts`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::facts::{KvShape, UnitBytes};
use crate::fields::{head_dim_from_hidden, positive, required};
use crate::model::{Attention, Model};

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
    let text = std::fs::read_to_string(&file).map_err(|e| {
        let mut message = format!("cannot read {}: {e}", file.display());
        if !path.exists() {
            message += &missing_config_tip(&name);
        }
        message
    })?;
    from_config_json(&text, &name)
}

/// For a `--config` path that does not exist: the preset or the shipped config it may have
/// meant (a Hugging Face id given as a path).
fn missing_config_tip(name: &str) -> String {
    if let Some(found) = other_case(Path::new(name)) {
        let found = found.display();
        return format!(
            ". {found} exists: paths are case-sensitive, so give --config {found}{}",
            if found.to_string().contains("cli/configs/") {
                " (the config mori-tp ships)"
            } else {
                ""
            }
        );
    }
    if let Ok(choice) = crate::model::parse_model(name) {
        return format!(
            ". {name} is a built-in model: use --model {} (or give the path of its config.json \
             or model directory)",
            choice.preset.name
        );
    }
    match crate::model::shipped_config(name) {
        Some((dir, _)) => format!(
            ". mori-tp ships that model's config.json: --config cli/configs/{dir} (in mori-tp's \
             source tree)"
        ),
        None => ". Give the path of a config.json or of a model directory, or a built-in model \
                  with --model (`mori-tp presets` lists them)"
            .into(),
    }
}

/// The existing path that `path` names in another case (`cli/configs/Llama-3.1-8B` for
/// `cli/configs/llama-3.1-8b`), found one component at a time; `None` when there is none, or
/// more than one, or the path exists as given.
fn other_case(path: &Path) -> Option<std::path::PathBuf> {
    use std::path::Component;
    if path.exists() {
        return None;
    }
    let mut found = std::path::PathBuf::new();
    for component in path.components() {
        let Component::Normal(name) = component else {
            found.push(component);
            continue;
        };
        let here = if found.as_os_str().is_empty() {
            Path::new(".")
        } else {
            &found
        };
        if here.join(name).exists() {
            found.push(name);
            continue;
        }
        let wanted = name.to_str()?;
        let mut matches = std::fs::read_dir(here)
            .ok()?
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|entry| entry.eq_ignore_ascii_case(wanted));
        let only = matches.next()?;
        if matches.next().is_some() {
            return None;
        }
        found.push(only);
    }
    found.exists().then_some(found)
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
        let root_obj = root
            .as_object()
            .ok_or("the top level is not a JSON object")?;
        let mut obj = root_obj;
        let has_layers = |o: &Map<String, Value>| {
            o.get("num_hidden_layers").is_some() || o.get("num_layers").is_some()
        };
        if !has_layers(obj) {
            if let Some(text_config) = obj.get("text_config").and_then(Value::as_object) {
                obj = text_config;
            }
        }
        // transformers 4.56 renamed torch_dtype to dtype; multimodal configs may keep it at the top.
        let torch_dtype = [obj, root_obj]
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
            return with_facts(obj, root_obj, model, Some((rank, rope)));
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
            return with_facts(obj, root_obj, model, None);
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
        with_facts(obj, root_obj, model, None)
    };
    parse().map_err(|e| format!("{name}: {e}"))
}

/// `model` with its facts (`crate::facts::derive`); a model of several groups describes its main
/// group: that group's KV heads, head dimension and layer count.
fn with_facts(
    obj: &Map<String, Value>,
    root: &Map<String, Value>,
    mut model: Model,
    mla: Option<(u32, u32)>,
) -> Result<Model, String> {
    let kv = KvShape {
        kv_heads: model.kv_heads,
        head_dim: model.head_dim,
        layers: model.layers,
        mla,
    };
    let facts = crate::facts::derive(obj, root, &kv)?;
    if facts.is_hybrid() {
        let main = facts.main_group();
        let part = &main.parts[0];
        model.kv_heads = part.units;
        model.head_dim = match part.bytes {
            UnitBytes::Cache(elements) | UnitBytes::Conv(elements) | UnitBytes::State(elements) => {
                elements as u32
            }
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

    /// The families of `crate::facts`, each read from its config fields with the numbers of its
    /// formulas.
    mod families {
        use crate::config::from_config_json;
        use crate::facts::*;
        use crate::model::Attention;

        fn facts(text: &str) -> ModelFacts {
            from_config_json(text, "config.json")
                .expect("a config mori-tp reads")
                .facts
                .expect("a config has facts")
        }

        const BF16: Dtypes = Dtypes {
            cache: 2,
            cache_is_fp8: false,
            conv: 2,
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
                conv: 1,
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
            let v3 =
                facts(r#"{"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}"#);
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
                conv: 2,
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

        /// transformers' `FalconH1Config` fields with the Falcon-H1 0.5B figures (attention and
        /// Mamba2 on every layer, one group), as `python/tests/test_models.py` has them.
        const FALCON_H1: &str = r#"{"model_type": "falcon_h1", "num_hidden_layers": 36,
        "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_n_groups": 1,
        "mamba_d_state": 128, "mamba_d_conv": 4}"#;

        #[test]
        fn falcon_h1_keeps_attention_and_mamba2_on_every_layer_with_one_group() {
            let f = facts(FALCON_H1);
            assert_eq!(f.family, "mamba2");
            let every: Vec<u32> = (0..36).collect();
            for g in &f.groups {
                assert_eq!(g.layers, every, "{}", g.name);
            }
            let conv: Vec<(&str, u32, u64, bool)> = f.groups[1]
                .parts
                .iter()
                .map(|p| (p.name, p.units, p.bytes.bytes(BF16), p.must_divide))
                .collect();
            assert_eq!(
                conv,
                [
                    ("x", 24, 64 * 2, true),
                    ("B", 1, 128 * 2, false),
                    ("C", 1, 128 * 2, false)
                ]
            );
            assert_eq!(f.groups[1].steps(0), Some(3));
            assert_eq!(f.groups[1].steps(2), Some(5));
            assert_eq!(f.groups[2].steps(2), Some(1));
            // mamba_d_head "auto" is mamba_d_ssm / mamba_n_heads; a d_ssm the heads do not make is
            // refused with the numbers.
            let auto =
                facts(&FALCON_H1.replace("\"mamba_d_head\": 64", "\"mamba_d_head\": \"auto\""));
            assert_eq!(unit_bytes(&auto, "conv_state", "x", BF16), 1536 / 24 * 2);
            let err = from_config_json(
                &FALCON_H1.replace("\"mamba_d_ssm\": 1536", "\"mamba_d_ssm\": 1000"),
                "config.json",
            )
            .unwrap_err();
            assert!(err.contains("`mamba_d_ssm` 1000 is not"), "{err}");
        }

        #[test]
        fn granite_4_h_reads_its_layer_types_and_an_auto_head_dim() {
            let types: Vec<&str> = (0..40)
                .map(|i| {
                    if [5, 15, 25, 35].contains(&i) {
                        "attention"
                    } else {
                        "mamba"
                    }
                })
                .collect();
            let text = format!(
                r#"{{"model_type": "granitemoehybrid", "num_hidden_layers": 40, "hidden_size": 1536,
                 "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48,
                 "mamba_d_head": "auto", "mamba_expand": 2, "mamba_n_groups": 1,
                 "mamba_d_state": 128, "mamba_d_conv": 4, "layer_types": {}}}"#,
                serde_json::to_string(&types).unwrap()
            );
            let f = facts(&text);
            assert_eq!(f.groups[0].layers, [5, 15, 25, 35]);
            assert_eq!(f.groups[1].layers.len(), 36);
            // mamba_expand 2 x hidden 1536 over 48 heads: 64 channels a head.
            assert_eq!(unit_bytes(&f, "conv_state", "x", BF16), 64 * 2);
            assert_eq!(unit_bytes(&f, "full_attention", "kv", BF16), 1536 / 12 * 2);
            let err = from_config_json(
                &text.replace("\"mamba\"", "\"linear_attention\""),
                "config.json",
            )
            .unwrap_err();
            assert!(
                err.contains("layer_types") && err.contains("linear_attention"),
                "{err}"
            );
            // A mamba_n_heads config whose layers cannot be told is refused, not read as dense.
            let unknown = text
                .replace("\"model_type\": \"granitemoehybrid\",", "")
                .replace(
                    &format!(
                        ", \"layer_types\": {}",
                        serde_json::to_string(&types).unwrap()
                    ),
                    "",
                );
            let err = from_config_json(&unknown, "config.json").unwrap_err();
            assert!(err.contains("which layers keep which state"), "{err}");
        }

        #[test]
        fn the_ssm_dtype_default_follows_the_config_then_nemotron_h_then_the_conv_state() {
            let nemotron = r#"{"num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "conv_kernel": 4, "mamba_num_heads": 4,
            "mamba_head_dim": 2, "n_groups": 1, "ssm_state_size": 4,
            "hybrid_override_pattern": "M*""#;
            let with = |extra: &str| facts(&format!("{nemotron}{extra}}}"));
            assert_eq!(with("").ssm_default(), SsmDefault::Conv);
            assert_eq!(
                with(r#", "architectures": ["NemotronHForCausalLM"]"#).ssm_default(),
                SsmDefault::NemotronH
            );
            assert_eq!(
            with(r#", "architectures": ["NemotronHForCausalLM"], "mamba_ssm_cache_dtype": "bfloat16""#)
                .ssm_default(),
            SsmDefault::Config("mamba_ssm_cache_dtype", "bfloat16".into())
        );
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
}
