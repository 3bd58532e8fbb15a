//! Runs the `mori-tp` binary as a user would and checks what it prints and how it exits against
//! the rules of REFERENCE.md (restated here, independently of the program) and against the
//! library itself.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

use mori_tp::{Action, SliceParams, Staging, slice_config, staging_for};
use serde_json::Value;

fn mori_tp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mori-tp"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited, not killed")
}

fn json_of(args: &[&str]) -> Value {
    let out = mori_tp(args);
    assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON value")
}

/// The built-in models, with the figures of their public config.json files (issue 6 lists all
/// but qwen2.5-72b): (name, KV heads, head_dim, layers, attention).
const MODELS: &[(&str, u32, u32, u32, &str)] = &[
    ("llama-3.1-8b", 8, 128, 32, "GQA"),
    ("llama-3.1-70b", 8, 128, 80, "GQA"),
    ("qwen2.5-1.5b", 2, 128, 28, "GQA"),
    ("qwen2.5-7b", 4, 128, 28, "GQA"),
    ("qwen2.5-72b", 8, 128, 80, "GQA"),
    ("qwen3-8b", 8, 128, 36, "GQA"),
    ("qwen3-30b-a3b", 4, 128, 48, "GQA"),
    ("mixtral-8x7b", 8, 128, 32, "GQA"),
    ("glm-4-9b", 2, 128, 40, "GQA"),
    ("gpt-oss-120b", 8, 64, 36, "GQA"),
    ("deepseek-v3", 1, 576, 61, "MLA"),
];

fn heads_of(model: &str) -> u32 {
    MODELS
        .iter()
        .find(|m| m.0 == model)
        .expect("a known model")
        .1
}

/// REFERENCE.md section 3: a TP size works when it divides the KV heads or is a multiple of them.
fn valid_tp(heads: u32, tp: u32) -> bool {
    heads % tp == 0 || tp % heads == 0
}

/// REFERENCE.md section 3, ownership: the heads rank `r` of a side with TP size `t` owns.
fn owned(heads: u32, t: u32, r: u32) -> std::ops::Range<u32> {
    if t <= heads {
        r * heads / t..(r + 1) * heads / t
    } else {
        let h = r / (t / heads);
        h..h + 1
    }
}

/// REFERENCE.md section 3, the sender rule: the one prefill rank that sends head `h` to decode rank `d`.
fn sender(heads: u32, p_size: u32, d_size: u32, d: u32, h: u32) -> u32 {
    let first = |t: u32| (0..t).find(|&r| owned(heads, t, r).contains(&h)).unwrap();
    let (rs, rd) = ((p_size / heads).max(1), (d_size / heads).max(1));
    first(p_size) + (d - first(d_size)) * rs / rd
}

/// The distinct (prefill rank, decode rank) pairs that send under the sender rule.
fn sending_pairs(heads: u32, p_size: u32, d_size: u32) -> Vec<(u32, u32)> {
    let mut pairs: Vec<(u32, u32)> = (0..d_size)
        .flat_map(|d| {
            owned(heads, d_size, d).map(move |h| (sender(heads, p_size, d_size, d, h), d))
        })
        .collect();
    pairs.sort_unstable();
    pairs.dedup();
    pairs
}

fn dtype_bytes(dtype: &str) -> u64 {
    match dtype {
        "fp8" => 1,
        "bf16" | "fp16" => 2,
        "fp32" => 4,
        other => panic!("unknown dtype {other}"),
    }
}

/// A file under this test binary's scratch directory.
fn scratch_file(name: &str, contents: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mori-tp-cli-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn presets_list_every_model_with_its_kv_figures() {
    let list = json_of(&["presets", "--json"]);
    let list = list.as_array().expect("an array");
    for &(name, heads, head_dim, layers, attention) in MODELS {
        let entry = list
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("{name} is not a preset"));
        assert_eq!(entry["kv_heads"], heads, "{name}");
        assert_eq!(entry["head_dim"], head_dim, "{name}");
        assert_eq!(entry["layers"], layers, "{name}");
        assert_eq!(entry["attention"], attention, "{name}");
        let buffers = if attention == "MLA" { 1 } else { 2 };
        assert_eq!(entry["buffers_per_layer"], buffers, "{name}");
    }
    // A new preset must be added above, so that the tests below cover it too.
    assert_eq!(list.len(), MODELS.len(), "presets not listed in MODELS");
    let text = mori_tp(&["presets"]);
    assert_eq!(code(&text), 0);
    for (name, ..) in MODELS {
        assert!(
            stdout(&text).contains(name),
            "{name} missing from the table"
        );
    }
}

#[test]
fn every_preset_plans_exactly_the_tp_sizes_the_divisibility_rule_allows() {
    // 6 and 12 tell 2, 4 and 8 heads apart; 3 is valid for none of the presets but MLA.
    const SIZES: [u32; 8] = [1, 2, 3, 4, 6, 8, 12, 16];
    for &(model, heads, ..) in MODELS {
        for p in SIZES {
            for d in SIZES {
                let (p_text, d_text) = (p.to_string(), d.to_string());
                let args = [
                    "plan",
                    "--model",
                    model,
                    "--prefill-tp",
                    &p_text,
                    "--decode-tp",
                    &d_text,
                ];
                let out = mori_tp(&args);
                if valid_tp(heads, p) && valid_tp(heads, d) {
                    assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
                    assert!(stdout(&out).contains("valid layout"), "{args:?}");
                } else {
                    assert_eq!(code(&out), 3, "{args:?} should be refused");
                    let err = stderr(&out);
                    for (side, t) in [("prefill side", p), ("decode side", d)] {
                        let named =
                            err.contains(&format!("{side}: tp_size {t} and total_kv_heads"));
                        assert_eq!(named, !valid_tp(heads, t), "{args:?}: {err}");
                    }
                }
            }
        }
    }
}

/// Checks a `plan --json` output pair by pair against the library's slice_config, and against
/// the sender rule.
/// The library's uniform slice of pair (p, d) of a model with `heads` KV heads of
/// `bytes_per_head` bytes, token-major pages of `page_size` tokens on both sides.
fn section4_config(
    heads: u32,
    (p_size, p): (u32, u32),
    (d_size, d): (u32, u32),
    page_size: u32,
    bytes_per_head: u64,
) -> mori_tp::SliceConfig {
    let item = |t: u32| u64::from(page_size) * u64::from((heads / t).max(1)) * bytes_per_head;
    slice_config(&SliceParams {
        prefill_tp_size: p_size,
        prefill_tp_rank: p,
        decode_tp_size: d_size,
        decode_tp_rank: d,
        total_kv_heads: heads,
        page_size,
        src_item_len: item(p_size),
        dst_item_len: item(d_size),
    })
    .unwrap()
}

fn check_plan_json(model: &str, p_size: u32, d_size: u32, page_size: u32, dtype: &str) {
    let (heads, head_dim, layers, attention) = MODELS
        .iter()
        .find(|m| m.0 == model)
        .map(|m| (m.1, m.2, m.3, m.4))
        .unwrap();
    let args = [
        "plan".to_string(),
        "--json".into(),
        "--model".into(),
        model.into(),
        "--prefill-tp".into(),
        p_size.to_string(),
        "--decode-tp".into(),
        d_size.to_string(),
        "--page-size".into(),
        page_size.to_string(),
        "--dtype".into(),
        dtype.into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let plan = json_of(&args);
    assert_eq!(plan["prefill_tp"], p_size);
    assert_eq!(plan["decode_tp"], d_size);
    assert_eq!(plan["model"]["kv_heads"], heads);
    assert_eq!(plan["model"]["head_dim"], head_dim);

    let bytes_per_head = u64::from(head_dim) * dtype_bytes(dtype);
    let item = |t: u32| u64::from(page_size) * u64::from((heads / t).max(1)) * bytes_per_head;
    let pairs: BTreeMap<(u64, u64), &Value> = plan["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| {
            let key = (
                pair["prefill_rank"].as_u64().unwrap(),
                pair["decode_rank"].as_u64().unwrap(),
            );
            (key, pair)
        })
        .collect();
    let senders = sending_pairs(heads, p_size, d_size);
    let buffers = u64::from(layers) * if attention == "MLA" { 1 } else { 2 };
    for d in 0..d_size {
        let mut received = 0;
        for p in 0..p_size {
            let lib = section4_config(heads, (p_size, p), (d_size, d), page_size, bytes_per_head);
            let Some(pair) = pairs.get(&(u64::from(p), u64::from(d))) else {
                assert_eq!(lib.action, Action::NotPaired, "pair ({p}, {d}) left out");
                continue;
            };
            let action = match lib.action {
                Action::Send => "send",
                Action::SkipReplica => "skip_replica",
                Action::NotPaired => panic!("pair ({p}, {d}) shares no head but is listed"),
            };
            assert_eq!(pair["action"], action, "({p}, {d})");
            assert_eq!(pair["first_head"], lib.first_head, "({p}, {d})");
            assert_eq!(pair["num_heads"], lib.num_heads, "({p}, {d})");
            assert_eq!(
                pair["src_head_slice_offset"], lib.src_head_slice_offset,
                "({p}, {d})"
            );
            assert_eq!(
                pair["dst_head_slice_offset"], lib.dst_head_slice_offset,
                "({p}, {d})"
            );
            assert_eq!(
                pair["heads_bytes_per_token_to_send"], lib.heads_bytes_per_token_to_send,
                "({p}, {d})"
            );
            assert_eq!(
                action == "send",
                senders.contains(&(p, d)),
                "({p}, {d}) against the sender rule"
            );
            if action == "send" {
                received += lib.heads_bytes_per_token_to_send;
                // Staging: each side whose token slot is wider than the slice, as the library's
                // staging_for says, with its region for the request over every buffer.
                let width = lib.heads_bytes_per_token_to_send;
                let want = match (
                    lib.bytes_per_token_src > width,
                    lib.bytes_per_token_dst > width,
                ) {
                    (false, false) => "none",
                    (true, false) => "src",
                    (false, true) => "dst",
                    (true, true) => "both",
                };
                assert_eq!(pair["staging"], want, "({p}, {d})");
                let named = match staging_for(&lib).unwrap() {
                    Staging::None => "none",
                    Staging::Src => "src",
                    Staging::Dst => "dst",
                    Staging::Both => "both",
                };
                assert_eq!(want, named, "({p}, {d}) against the library");
                let tokens = plan["request_tokens"].as_u64().unwrap();
                assert_eq!(
                    pair["staging_bytes_per_request"],
                    tokens * width * buffers,
                    "({p}, {d})"
                );
            } else {
                assert!(
                    pair.get("staging").is_none(),
                    "({p}, {d}): a replica stages nothing"
                );
            }
        }
        // Every decode rank receives all of its token, once.
        assert_eq!(
            received,
            item(d_size) / u64::from(page_size),
            "decode rank {d}"
        );
        let rank = &plan["decode_ranks"][d as usize];
        assert_eq!(
            rank["bytes_per_token"],
            received * buffers,
            "decode rank {d}"
        );
    }
}

#[test]
fn json_plans_of_replicated_layouts_match_the_library_pair_by_pair() {
    // Prefill replicates heads (P > H): replicas must skip.
    check_plan_json("llama-3.1-8b", 16, 2, 16, "fp8");
    // Decode replicates heads (D > H) while prefill does not: the layout stacks get wrong.
    check_plan_json("qwen2.5-7b", 2, 8, 1, "bf16");
    // Both sides replicate, at different ratios.
    check_plan_json("qwen2.5-1.5b", 4, 16, 4, "fp16");
    // MLA: one latent head, replicated on every rank of both sides.
    check_plan_json("deepseek-v3", 8, 4, 64, "bf16");
}

#[test]
fn a_gqa_config_json_plans_like_the_preset_it_describes() {
    // The fields of Llama-3.1-8B's config.json that matter, without head_dim.
    let path = scratch_file(
        "llama-config.json",
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 32, "intermediate_size": 14336, "torch_dtype": "bfloat16"}"#,
    );
    let path = path.to_str().unwrap();
    let from_config = json_of(&[
        "plan",
        "--decode-tp",
        "8",
        "--json",
        "--config",
        path,
        "--prefill-tp",
        "4",
    ]);
    let model = &from_config["model"];
    assert_eq!(
        (&model["kv_heads"], &model["head_dim"], &model["layers"]),
        (&Value::from(8), &Value::from(128), &Value::from(32))
    );
    assert_eq!(model["attention"], "GQA");
    let from_preset = json_of(&[
        "plan",
        "--decode-tp",
        "8",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "4",
    ]);
    assert_eq!(from_config["pairs"], from_preset["pairs"]);
    assert_eq!(from_config["decode_ranks"], from_preset["decode_ranks"]);
}

#[test]
fn an_mla_config_json_caches_one_latent_head_and_no_v() {
    // DeepSeek-V3's shape: num_key_value_heads describes attention, not the cache.
    let path = scratch_file(
        "deepseek-config.json",
        r#"{"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
            "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 61}"#,
    );
    let path = path.to_str().unwrap();
    let plan = json_of(&[
        "plan",
        "--json",
        "--config",
        path,
        "--prefill-tp",
        "8",
        "--decode-tp",
        "4",
    ]);
    let model = &plan["model"];
    assert_eq!(model["kv_heads"], 1);
    assert_eq!(model["head_dim"], 512 + 64);
    assert_eq!(model["buffers_per_layer"], 1);
    assert_eq!(model["attention"], "MLA");
    let pairs = plan["pairs"].as_array().unwrap();
    // One head on every rank: all 32 pairs share it; one sender per decode rank.
    assert_eq!(pairs.len(), 32);
    let sends: Vec<&Value> = pairs.iter().filter(|p| p["action"] == "send").collect();
    assert_eq!(sends.len(), 4);
    for send in sends {
        assert_eq!(send["heads_bytes_per_token_to_send"], 576 * 2);
    }
    for rank in plan["decode_ranks"].as_array().unwrap() {
        assert_eq!(rank["bytes_per_token"], 576 * 2 * 61);
    }
    let sim = mori_tp(&[
        "simulate",
        "--config",
        path,
        "--prefill-tp",
        "8",
        "--decode-tp",
        "4",
        "--page-size",
        "64",
        "--tokens",
        "500",
        "--layers-limit",
        "2",
    ]);
    assert_eq!(code(&sim), 0, "{}{}", stdout(&sim), stderr(&sim));
}

#[test]
fn a_glm_config_json_uses_query_groups_and_kv_channels() {
    // GLM-4-9B's shape: no num_key_value_heads, no num_hidden_layers.
    let path = scratch_file(
        "glm-config.json",
        r#"{"model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32,
            "multi_query_attention": true, "multi_query_group_num": 2, "kv_channels": 128,
            "num_layers": 40, "padded_vocab_size": 151552}"#,
    );
    let path = path.to_str().unwrap();
    let plan = json_of(&[
        "plan",
        "--json",
        "--config",
        path,
        "--prefill-tp",
        "1",
        "--decode-tp",
        "4",
    ]);
    let model = &plan["model"];
    assert_eq!(
        (&model["kv_heads"], &model["head_dim"], &model["layers"]),
        (&Value::from(2), &Value::from(128), &Value::from(40))
    );
    // Decode TP 4 over 2 heads: each decode rank gets one 256-byte head from prefill rank 0.
    let pairs = plan["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 4);
    for (d, pair) in pairs.iter().enumerate() {
        assert_eq!(pair["action"], "send");
        assert_eq!(pair["first_head"], d / 2);
        assert_eq!(pair["src_head_slice_offset"], (d / 2) * 256);
        assert_eq!(pair["heads_bytes_per_token_to_send"], 256);
    }
    let refused = mori_tp(&[
        "plan",
        "--decode-tp",
        "8",
        "--config",
        path,
        "--prefill-tp",
        "3",
    ]);
    assert_eq!(code(&refused), 3);
    assert!(
        stderr(&refused).contains("tp_size 3 and total_kv_heads 2"),
        "{}",
        stderr(&refused)
    );
}

/// The valid TP sizes just below and above `t` for `heads` KV heads (below is at least 1).
fn nearest_valid(t: u32, heads: u32) -> (u32, u32) {
    let below = (1..t).rev().find(|&s| valid_tp(heads, s)).unwrap_or(1);
    let above = (t + 1..).find(|&s| valid_tp(heads, s)).unwrap();
    (below, above)
}

#[test]
fn an_invalid_layout_exits_3_naming_the_values_and_the_nearest_valid_sizes() {
    for (model, p, d, bad) in [
        ("qwen2.5-7b", 3, 8, 3),
        ("llama-3.1-70b", 8, 12, 12),
        ("glm-4-9b", 2, 5, 5),
    ] {
        let heads = heads_of(model);
        for command in ["plan", "simulate"] {
            let out = mori_tp(&[
                command,
                "--model",
                model,
                "--prefill-tp",
                &p.to_string(),
                "--decode-tp",
                &d.to_string(),
            ]);
            assert_eq!(code(&out), 3, "{command} {model} {p} {d}");
            let err = stderr(&out);
            assert!(err.contains(model), "{err}");
            assert!(
                err.contains(&format!("tp_size {bad} and total_kv_heads {heads}")),
                "{err}"
            );
            let (below, above) = nearest_valid(bad, heads);
            assert!(
                err.contains(&format!("nearest valid tp sizes: {below} and {above}")),
                "{err}"
            );
        }
    }
    // A model described by hand is checked the same way.
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--kv-heads",
        "6",
        "--head-dim",
        "64",
        "--decode-tp",
        "4",
    ]);
    assert_eq!(code(&out), 3);
    assert!(stderr(&out).contains("tp_size 4 and total_kv_heads 6"));
}

#[test]
fn bad_usage_exits_2_without_output() {
    let not_json = scratch_file("not-json.json", "{\"num_hidden_layers\": ");
    let no_heads = scratch_file("no-heads.json", r#"{"num_hidden_layers": 4}"#);
    let cases: Vec<Vec<&str>> = vec![
        vec!["frobnicate"],
        vec!["--tokens", "5"],
        vec!["plan", "--model", "no-such-model"],
        vec!["plan", "--prefill-tp", "0"],
        vec!["plan", "--decode-tp", "two"],
        vec!["plan", "--kv-heads", "8"],
        vec![
            "plan",
            "--model",
            "qwen2.5-7b",
            "--kv-heads",
            "8",
            "--head-dim",
            "64",
        ],
        vec!["plan", "--model", "qwen2.5-7b", "--config", "config.json"],
        vec!["plan", "--dtype", "int3"],
        vec!["simulate", "--fragmentation", "1.5"],
        vec!["plan", "--config", "/no/such/dir/config.json"],
        vec!["plan", "--config", not_json.to_str().unwrap()],
        vec!["plan", "--config", no_heads.to_str().unwrap()],
    ];
    for args in cases {
        let out = mori_tp(&args);
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty(), "{args:?}");
        assert!(!stderr(&out).trim().is_empty(), "{args:?}");
    }
}

/// Runs `simulate`, expects success, and returns its output.
fn simulate(args: &[&str]) -> String {
    let mut all = vec!["simulate"];
    all.extend_from_slice(args);
    let out = mori_tp(&all);
    assert_eq!(code(&out), 0, "{all:?}: {}{}", stdout(&out), stderr(&out));
    stdout(&out)
}

/// The number just before `word` on the line starting with `label`.
fn number_before(output: &str, label: &str, word: &str) -> u64 {
    let line = output
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{output}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| w.starts_with(word))
        .unwrap_or_else(|| panic!("no `{word}` in `{line}`"));
    words[at - 1].replace(',', "").parse().unwrap()
}

#[test]
fn simulate_verifies_small_layouts_and_counts_what_the_rules_predict() {
    // (model arguments, KV heads, P, D); every model here keeps K and V and has 2 layers or more.
    let cases: [(&[&str], u32, u32, u32); 3] = [
        (&["--model", "llama-3.1-8b"], 8, 16, 2),
        (&["--model", "qwen2.5-7b"], 4, 2, 8),
        // A non-integer ratio between the sides (P/D = 3/2).
        (
            &["--kv-heads", "12", "--head-dim", "40", "--layers", "3"],
            12,
            6,
            4,
        ),
    ];
    let (tokens, page_size, layers_limit) = (190u64, 4u64, 2u64);
    for (model, heads, p, d) in cases {
        let (p_text, d_text) = (p.to_string(), d.to_string());
        let mut args = model.to_vec();
        args.extend_from_slice(&[
            "--prefill-tp",
            &p_text,
            "--decode-tp",
            &d_text,
            "--page-size",
            "4",
            "--tokens",
            "190",
            "--layers-limit",
            "2",
            "--fragmentation",
            "0.3",
            "--seed",
            "9",
        ]);
        let out = simulate(&args);
        assert!(out.trim_end().ends_with("OK"), "{out}");
        assert!(out.contains("verified: all"), "{out}");
        let pairs = sending_pairs(heads, p, d).len() as u64;
        assert_eq!(number_before(&out, "sent:", "pair"), pairs, "{out}");
        let pages = tokens.div_ceil(page_size);
        assert_eq!(number_before(&out, "request:", "page"), pages, "{out}");
        // Each sending pair issues one copy per run of pages per buffer (K and V of each layer);
        // a per-token plan, one per token: 190 of them, the last page holding 2 of its 4 slots.
        let buffers = layers_limit * 2;
        let runs = number_before(&out, "request:", "run");
        assert!(runs > 1 && runs < pages, "a fragmented request: {out}");
        assert_eq!(
            number_before(&out, "copies:", "strided"),
            runs * pairs * buffers,
            "{out}"
        );
        assert_eq!(
            number_before(&out, "copies:", "("),
            tokens * pairs * buffers,
            "{out}"
        );
        // An RDMA engine's segments, from the ownership rule's slot and slice widths (in heads): one
        // per token where a slice is narrower than a slot, else one per run; staged, one per
        // run, or one per buffer when both sides are staged.
        let (mut direct, mut staged) = (0, 0);
        for (sp, sd) in sending_pairs(heads, p, d) {
            let (src, dst) = (owned(heads, p, sp), owned(heads, d, sd));
            let width = src.end.min(dst.end) - src.start.max(dst.start);
            let (src_wider, dst_wider) = (src.len() as u32 > width, dst.len() as u32 > width);
            direct += if src_wider || dst_wider { tokens } else { runs };
            staged += if src_wider && dst_wider { 1 } else { runs };
        }
        let line = out.lines().find(|l| l.starts_with("segments:")).unwrap();
        let rest = out
            .lines()
            .skip_while(|l| !l.starts_with("segments:"))
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(line.contains("per-token"), "{out}");
        assert_eq!(
            number_before(&rest, "segments:", "per-token"),
            tokens * pairs * buffers
        );
        assert_eq!(
            number_before(&rest, "segments:", "direct"),
            direct * buffers,
            "{out}"
        );
        assert_eq!(
            number_before(&rest, "segments:", "staged"),
            staged * buffers,
            "{out}"
        );
        assert!(
            out.contains("twice: after the direct copies and after the staged path"),
            "{out}"
        );
    }
}

#[test]
fn with_no_arguments_it_simulates_the_default_deployment() {
    let out = mori_tp(&[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("qwen2.5-7b from prefill TP 2 to decode TP 8"),
        "{text}"
    );
    assert!(text.contains("host engine"), "{text}");
    assert!(text.contains("verified: all"), "{text}");
    assert!(text.trim_end().ends_with("OK"), "{text}");
}

#[test]
fn help_explains_the_tool_to_a_newcomer() {
    let out = mori_tp(&["--help"]);
    assert_eq!(code(&out), 0);
    let text = stdout(&out);
    for needle in [
        "prefill",
        "decode",
        "tensor-parallel",
        "plan",
        "simulate",
        "presets",
        "Exit status",
    ] {
        assert!(text.contains(needle), "--help lacks {needle}:\n{text}");
    }
    let plan = stdout(&mori_tp(&["plan", "--help"]));
    for needle in [
        "--model",
        "--config",
        "--kv-heads",
        "--prefill-tp",
        "--json",
        "--prefill-layout",
        "--decode-layout",
        "--prefill-page-size",
        "--decode-page-size",
        "head-major",
    ] {
        assert!(plan.contains(needle), "plan --help lacks {needle}:\n{plan}");
    }
    assert!(
        plan.contains("half-open"),
        "plan --help must say how head ranges read:\n{plan}"
    );
    let sim = stdout(&mori_tp(&["simulate", "--help"]));
    for needle in [
        "--tokens",
        "--layers-limit",
        "--seed",
        "--fragmentation",
        "--backend",
        "--prefill-layout",
        "--decode-page-size",
        "partial last page",
    ] {
        assert!(
            sim.contains(needle),
            "simulate --help lacks {needle}:\n{sim}"
        );
    }
}

/// `h3`, `h0–3`: the picture's label of a half-open head range.
fn heads_label(heads: std::ops::Range<u32>) -> String {
    if heads.len() == 1 {
        format!("h{}", heads.start)
    } else {
        format!("h{}\u{2013}{}", heads.start, heads.end - 1)
    }
}

/// The numbers of an SVG path's `d`, in order (commands dropped).
fn path_numbers(d: &str) -> Vec<f64> {
    d.split(|c: char| c.is_ascii_alphabetic() || c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or_else(|_| panic!("`{s}` in path `{d}`")))
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Box2 {
    x: f64,
    y: f64,
    width: f64,
    height: f64,
}

impl Box2 {
    fn holds_y(&self, y: f64) -> bool {
        y >= self.y - 0.05 && y <= self.y + self.height + 0.05
    }
}

/// Checks the picture `plan --svg` draws against the JSON plan of the same layout and against
/// the ownership and sender rules: every rank with its heads, one arrow per sending pair from its prefill box to
/// its decode box with its heads as label, one dashed line per replica that skips.
fn check_svg(model_args: &[&str], heads: u32, p_size: u32, d_size: u32) {
    let file = scratch_file(&format!("plan-{heads}-{p_size}-{d_size}.svg"), "");
    std::fs::remove_file(&file).unwrap();
    let (p_text, d_text) = (p_size.to_string(), d_size.to_string());
    let mut args = vec![
        "plan",
        "--json",
        "--prefill-tp",
        &p_text,
        "--decode-tp",
        &d_text,
    ];
    args.extend_from_slice(model_args);
    args.extend_from_slice(&["--svg", file.to_str().unwrap()]);
    let plan = json_of(&args);
    let text = std::fs::read_to_string(&file).expect("the SVG was written");
    let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    let by_id = |id: &str| {
        doc.descendants()
            .find(|n| n.attribute("id") == Some(id))
            .unwrap_or_else(|| panic!("no element `{id}`"))
    };
    let content = |n: roxmltree::Node| n.text().unwrap_or_default().to_string();
    let title = content(by_id("title"));
    let name = plan["model"]["name"].as_str().unwrap();
    assert!(
        title.contains(name)
            && title.contains(&format!("prefill TP {p_size}"))
            && title.contains(&format!("decode TP {d_size}")),
        "{title}"
    );

    // Every rank: a box named p<r> or d<r> showing the heads the ownership rule gives it.
    let mut boxes = BTreeMap::new();
    for (prefix, size) in [("p", p_size), ("d", d_size)] {
        for r in 0..size {
            let id = format!("{prefix}{r}");
            let group = by_id(&id);
            let texts: BTreeMap<String, String> = group
                .children()
                .filter(|n| n.has_tag_name("text"))
                .map(|n| (n.attribute("class").unwrap_or("").to_string(), content(n)))
                .collect();
            assert_eq!(texts["name"], id);
            assert_eq!(texts["heads"], heads_label(owned(heads, size, r)), "{id}");
            let rect = group.children().find(|n| n.has_tag_name("rect")).unwrap();
            let number = |attr: &str| rect.attribute(attr).unwrap().parse::<f64>().unwrap();
            let b = Box2 {
                x: number("x"),
                y: number("y"),
                width: number("width"),
                height: number("height"),
            };
            boxes.insert(id, b);
        }
    }
    assert_eq!(
        doc.descendants()
            .filter(|n| n.attribute("class") == Some("rank"))
            .count() as u32,
        p_size + d_size,
        "ranks drawn"
    );

    let rank_of =
        |n: roxmltree::Node, attr: &str| -> u32 { n.attribute(attr).unwrap().parse().unwrap() };
    // The plan's pairs, by action.
    let mut want_sends = BTreeMap::new();
    let mut want_skips = Vec::new();
    for pair in plan["pairs"].as_array().unwrap() {
        let key = (
            pair["prefill_rank"].as_u64().unwrap() as u32,
            pair["decode_rank"].as_u64().unwrap() as u32,
        );
        let first = pair["first_head"].as_u64().unwrap() as u32;
        let n = pair["num_heads"].as_u64().unwrap() as u32;
        match pair["action"].as_str().unwrap() {
            "send" => {
                want_sends.insert(key, heads_label(first..first + n));
            }
            _ => want_skips.push(key),
        }
    }
    let by_rule: Vec<(u32, u32)> = sending_pairs(heads, p_size, d_size);
    assert_eq!(want_sends.keys().copied().collect::<Vec<_>>(), by_rule);

    // Arrows: one per sending pair, from the right edge of its prefill box to the left edge of
    // its decode box, with an arrowhead, labelled with the pair's heads.
    let mut got_sends = BTreeMap::new();
    for path in doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("send"))
    {
        let (p, d) = (rank_of(path, "data-prefill"), rank_of(path, "data-decode"));
        assert!(
            path.attribute("marker-end").is_some(),
            "p{p}->d{d} has no head"
        );
        let numbers = path_numbers(path.attribute("d").unwrap());
        let (start, end) = (
            (numbers[0], numbers[1]),
            (numbers[numbers.len() - 2], numbers[numbers.len() - 1]),
        );
        let (from, to) = (boxes[&format!("p{p}")], boxes[&format!("d{d}")]);
        assert!(
            (start.0 - (from.x + from.width)).abs() < 0.05 && from.holds_y(start.1),
            "p{p}->d{d} starts at {start:?}, off {from:?}"
        );
        assert!(
            (end.0 - to.x).abs() < 0.05 && to.holds_y(end.1),
            "p{p}->d{d} ends at {end:?}, off {to:?}"
        );
        let label = doc
            .descendants()
            .find(|n| {
                n.attribute("class") == Some("send-label")
                    && n.attribute("data-prefill") == path.attribute("data-prefill")
                    && n.attribute("data-decode") == path.attribute("data-decode")
            })
            .unwrap_or_else(|| panic!("p{p}->d{d} has no label"));
        let label = label.children().find(|n| n.has_tag_name("text")).unwrap();
        assert!(
            got_sends.insert((p, d), content(label)).is_none(),
            "p{p}->d{d} drawn twice"
        );
    }
    assert_eq!(got_sends, want_sends);

    // Replicas: one dashed line per skipping pair, from its prefill box to its decode box's row.
    let mut got_skips = Vec::new();
    for path in doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("skip"))
    {
        let (p, d) = (rank_of(path, "data-prefill"), rank_of(path, "data-decode"));
        let numbers = path_numbers(path.attribute("d").unwrap());
        let (from, to) = (boxes[&format!("p{p}")], boxes[&format!("d{d}")]);
        assert!((numbers[0] - (from.x + from.width)).abs() < 0.05 && from.holds_y(numbers[1]));
        assert!(
            numbers[2] < to.x && to.holds_y(numbers[3]),
            "p{p}..d{d}: {numbers:?}"
        );
        got_skips.push((p, d));
    }
    let dashed = doc
        .descendants()
        .find(|n| n.attribute("id") == Some("skips"))
        .unwrap();
    assert!(
        dashed.attribute("stroke-dasharray").is_some(),
        "replicas are drawn dashed"
    );
    got_skips.sort_unstable();
    want_skips.sort_unstable();
    assert_eq!(got_skips, want_skips);
}

#[test]
fn the_svg_picture_shows_every_rank_and_every_pair_where_the_plan_puts_them() {
    // The layouts of issue 15 (2 -> 8, 8 -> 2, 32 -> 4, 32 -> 32), MLA, and a non-integer ratio.
    check_svg(&["--model", "qwen2.5-7b"], 4, 2, 8);
    check_svg(&["--model", "llama-3.1-8b"], 8, 8, 2);
    check_svg(&["--model", "llama-3.1-70b"], 8, 32, 4);
    check_svg(&["--model", "llama-3.1-70b"], 8, 32, 32);
    check_svg(&["--model", "deepseek-v3"], 1, 8, 4);
    check_svg(
        &["--kv-heads", "12", "--head-dim", "64", "--layers", "2"],
        12,
        6,
        4,
    );
    // Page layouts and page sizes do not change who sends what.
    check_svg(
        &[
            "--model",
            "llama-3.1-70b",
            "--prefill-layout",
            "hnd",
            "--prefill-page-size",
            "16",
            "--decode-page-size",
            "64",
        ],
        8,
        16,
        2,
    );
}

#[test]
fn the_svg_picture_is_refused_past_its_limit_without_writing_a_file() {
    let file = scratch_file("too-large.svg", "");
    std::fs::remove_file(&file).unwrap();
    let out = mori_tp(&[
        "plan",
        "--decode-tp",
        "8",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "256",
        "--svg",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("at most 128 ranks"),
        "{}",
        stderr(&out)
    );
    assert!(!file.exists());
}

#[test]
fn model_names_are_read_as_people_type_them() {
    let plan_of = |model: &str| {
        let out = mori_tp(&[
            "plan",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--json",
            "--model",
            model,
        ]);
        (code(&out), stdout(&out), stderr(&out))
    };
    for (typed, preset) in [
        ("Qwen2.5-7B", "qwen2.5-7b"),
        ("LLAMA-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("deepseek-ai/DeepSeek-V3-0324", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
    ] {
        let (status, out, err) = plan_of(typed);
        assert_eq!(status, 0, "{typed}: {err}");
        let plan: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(plan["model"]["name"], preset, "{typed}");
        // A name that is not the preset's own says which preset it became.
        let noted = err.contains(&format!(
            "note: {typed} has the KV-cache shape of the {preset}"
        ));
        assert_eq!(noted, !typed.eq_ignore_ascii_case(preset), "{typed}: {err}");
    }
    // Unknown ids are refused, with the closest preset as a tip.
    for (typed, tip) in [
        (
            "meta-llama/Llama-3.3-70B-Instruct",
            "Closest: llama-3.1-70b",
        ),
        ("Qwen/Qwen3-32B", "Closest: qwen3-8b"),
        ("THUDM/glm-4-9b-chat-1m", "Closest: glm-4-9b"),
    ] {
        let (status, out, err) = plan_of(typed);
        assert_eq!(status, 2, "{typed}");
        assert!(
            err.contains(tip) && err.contains("--config"),
            "{typed}: {err}"
        );
        assert!(!out.contains("\"pairs\""), "{typed}");
    }
    let (status, _, err) = plan_of("gemma-2-9b");
    assert_eq!(status, 2);
    assert!(
        !err.contains("Closest") && err.contains("deepseek-v3"),
        "{err}"
    );
}

#[test]
fn config_takes_a_model_directory_and_its_torch_dtype() {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mori-tp-cli-tests/Qwen2.5-7B-Instruct");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
            "num_hidden_layers": 28, "torch_dtype": "float16"}"#,
    )
    .unwrap();
    let dir_text = dir.to_str().unwrap();
    let from_dir = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--config",
        dir_text,
    ]);
    assert_eq!(from_dir["model"]["kv_heads"], 4);
    // No --dtype with a config is auto: the config's torch_dtype, as serving engines do.
    assert_eq!(from_dir["model"]["dtype"], "fp16");
    assert_eq!(from_dir["model"]["bytes_per_head"], 128 * 2);
    let file = dir.join("config.json");
    let from_file = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--config",
        file.to_str().unwrap(),
        "--dtype",
        "auto",
    ]);
    assert_eq!(from_file["pairs"], from_dir["pairs"]);
    assert_eq!(from_file["model"]["dtype"], "fp16");
    // A named dtype wins over the config's.
    let fp8 = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--config",
        dir_text,
        "--dtype",
        "fp8_e4m3",
    ]);
    assert_eq!(fp8["model"]["bytes_per_head"], 128);

    let empty =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mori-tp-cli-tests/empty-model-dir");
    std::fs::create_dir_all(&empty).unwrap();
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("empty-model-dir is a directory without a config.json"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn dtypes_are_taken_in_the_spellings_of_serving_engines() {
    for (spelling, bytes, shown) in [
        ("bf16", 2, "bf16"),
        ("bfloat16", 2, "bf16"),
        ("BFloat16", 2, "bf16"),
        ("float16", 2, "fp16"),
        ("half", 2, "fp16"),
        ("fp8", 1, "fp8"),
        ("fp8_e4m3", 1, "fp8_e4m3"),
        ("float8_e4m3fnuz", 1, "fp8_e4m3"),
        ("fp8_e5m2", 1, "fp8_e5m2"),
        ("float32", 4, "fp32"),
        ("float", 4, "fp32"),
    ] {
        let plan = json_of(&[
            "plan",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--json",
            "--model",
            "qwen2.5-7b",
            "--dtype",
            spelling,
        ]);
        assert_eq!(plan["model"]["bytes_per_head"], 128 * bytes, "{spelling}");
        assert_eq!(plan["model"]["dtype"], shown, "{spelling}");
    }
    // auto needs a config to read the dtype from.
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--model",
        "qwen2.5-7b",
        "--dtype",
        "auto",
    ]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("--dtype bf16"), "{}", stderr(&out));
    let out = mori_tp(&["plan", "--dtype", "int3"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("bfloat16"), "{}", stderr(&out));
}

#[test]
fn negative_and_other_bad_numbers_get_a_message_about_the_value() {
    for (args, says) in [
        (vec!["plan", "--prefill-tp", "-2"], "-2 is negative"),
        (vec!["plan", "--decode-tp", "-8"], "-8 is negative"),
        (vec!["plan", "--tokens", "-100"], "-100 is negative"),
        (
            vec!["plan", "--page-size", "2.5"],
            "2.5 is not a whole number",
        ),
        (vec!["simulate", "--seed", "-1"], "-1 is negative"),
        (
            vec!["simulate", "--fragmentation", "-0.5"],
            "outside 0 to 1",
        ),
        (
            vec!["plan", "--kv-heads", "-4", "--head-dim", "64"],
            "-4 is negative",
        ),
    ] {
        let out = mori_tp(&args);
        assert_eq!(code(&out), 2, "{args:?}");
        let err = stderr(&out);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn a_hand_described_model_is_checked_and_its_assumptions_said() {
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--kv-heads",
        "8",
        "--head-dim",
        "64",
        "--mla",
    ]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("--kv-heads must be 1, not 8"),
        "{}",
        stderr(&out)
    );
    let mla = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--kv-heads",
        "1",
        "--head-dim",
        "576",
        "--mla",
        "--layers",
        "61",
    ]);
    assert_eq!(mla["model"]["buffers_per_layer"], 1);

    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--kv-heads",
        "8",
        "--head-dim",
        "64",
    ]);
    assert_eq!(code(&out), 0);
    assert!(stderr(&out).contains("assumes 1 layer"), "{}", stderr(&out));
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--kv-heads",
        "8",
        "--head-dim",
        "64",
        "--layers",
        "32",
    ]);
    assert_eq!(code(&out), 0);
    assert!(!stderr(&out).contains("assumes"), "{}", stderr(&out));
}

#[test]
fn huge_tp_sizes_are_refused_at_once_and_the_limit_runs_in_bounded_output() {
    for size in ["65536", "4294967295", "1025"] {
        for side in ["--prefill-tp", "--decode-tp"] {
            let out = mori_tp(&["plan", "--model", "qwen2.5-7b", side, size]);
            assert_eq!(code(&out), 2, "{side} {size}");
            assert!(stderr(&out).contains("from 1 to 1024"), "{}", stderr(&out));
            assert!(stdout(&out).is_empty());
        }
    }
    // At the limit, MLA shares its one head between all 1024 x 1024 pairs: the text names the
    // skipping replicas as ranges, a few lines per decode rank.
    let out = mori_tp(&[
        "plan",
        "--model",
        "deepseek-v3",
        "--prefill-tp",
        "1024",
        "--decode-tp",
        "1024",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("1024 pairs send, 1047552 skip as replicas"),
        "{}",
        &text[..500]
    );
    assert!(
        text.lines().count() < 8 * 1024,
        "{} lines",
        text.lines().count()
    );
    assert!(text.contains("prefill ranks 1-1023 skip head 0 (replicas: prefill rank 0 sends it)"));
}

#[test]
fn json_plans_report_errors_as_json_on_stdout_with_the_exit_status() {
    let out = mori_tp(&[
        "plan",
        "--json",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "3",
        "--decode-tp",
        "6",
    ]);
    assert_eq!(code(&out), 3);
    let error: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let error = &error["error"];
    assert_eq!(error["exit_status"], 3);
    assert_eq!(error["kind"], "invalid_layout");
    let problems = error["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 2, "{error}");
    for (problem, (side, tp, nearest)) in problems
        .iter()
        .zip([("prefill", 3, [2, 4]), ("decode", 6, [4, 8])])
    {
        assert_eq!(problem["side"], side);
        assert_eq!(problem["tp_size"], tp);
        assert_eq!(problem["kv_heads"], 4);
        assert_eq!(
            problem["nearest_valid_tp_sizes"],
            serde_json::json!(nearest)
        );
    }
    // The same for a bad argument and for an unreadable config.
    for args in [
        vec!["plan", "--json", "--prefill-tp", "-2"],
        vec!["plan", "--json", "--config", "/no/such/config.json"],
    ] {
        let out = mori_tp(&args);
        assert_eq!(code(&out), 2, "{args:?}");
        let error: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
        assert_eq!(error["error"]["exit_status"], 2, "{args:?}");
        assert!(!stderr(&out).is_empty());
    }
}

#[test]
fn the_hip_backend_runs_or_fails_with_the_librarys_message() {
    let out = mori_tp(&[
        "simulate",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--backend",
        "hip",
        "--tokens",
        "64",
        "--page-size",
        "4",
        "--layers-limit",
        "1",
    ]);
    if mori_tp::backend::hip_device_present() {
        assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
        assert!(stdout(&out).contains("HIP engine"), "{}", stdout(&out));
    } else {
        assert_eq!(code(&out), 4, "{}", stderr(&out));
        assert!(
            stderr(&out).contains("backend unavailable: the HIP backend"),
            "{}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty());
    }
}

// ---- page layouts and page sizes per side, partial last pages -------------------------------

/// `plan --json` with `args` after the command; the page-layout tests plan qwen2.5-7b from
/// prefill TP 2 to decode TP 8 where `args` names no model or TP size (`plan` itself assumes
/// none: `the_model_and_both_tp_sizes_are_required` in new_user.rs).
fn plan_json(args: &[&str]) -> Value {
    let mut all = vec!["plan", "--json"];
    if !args
        .iter()
        .any(|a| ["--model", "--config", "--kv-heads"].contains(a))
    {
        all.extend(["--model", "qwen2.5-7b"]);
    }
    for (flag, size) in [("--prefill-tp", "2"), ("--decode-tp", "8")] {
        if !args.contains(&flag) {
            all.extend([flag, size]);
        }
    }
    all.extend_from_slice(args);
    json_of(&all)
}

/// The sending pairs of a JSON plan, by (prefill rank, decode rank).
fn sending(plan: &Value) -> BTreeMap<(u32, u32), Value> {
    plan["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|pair| pair["action"] == "send")
        .map(|pair| {
            let rank = |key: &str| pair[key].as_u64().unwrap() as u32;
            ((rank("prefill_rank"), rank("decode_rank")), pair.clone())
        })
        .collect()
}

/// A `MoriTpLayout` as the JSON plan writes it: (total_kv_heads, tp_size, tp_rank, page_size,
/// head_bytes, page_stride, offset, token_stride, head_stride).
fn layout_fields(value: &Value) -> [u64; 9] {
    [
        "total_kv_heads",
        "tp_size",
        "tp_rank",
        "page_size",
        "head_bytes",
        "page_stride",
        "offset",
        "token_stride",
        "head_stride",
    ]
    .map(|key| {
        value[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {value}"))
    })
}

fn staging_name(staging: Staging) -> &'static str {
    match staging {
        Staging::None => "none",
        Staging::Src => "src",
        Staging::Dst => "dst",
        Staging::Both => "both",
    }
}

/// Checks every sending pair of a JSON plan against the library: the pair config of both ranks'
/// layouts (`Layout::nhd` or `Layout::hnd`), `pair_staging_for`, the staging length and the
/// segments `pair_segments` gives for the request on pages 0, 1, ... of each side.
fn check_pairs_against_the_library(plan: &Value, layouts: [&str; 2]) {
    use mori_tp::{Layout, Request, pair_config, pair_segments, pair_staging_for};
    let num = |key: &str| plan[key].as_u64().unwrap_or_else(|| panic!("{key}"));
    let heads = plan["model"]["kv_heads"].as_u64().unwrap() as u32;
    let hb = plan["model"]["bytes_per_head"].as_u64().unwrap();
    let buffers = plan["model"]["layers"].as_u64().unwrap()
        * plan["model"]["buffers_per_layer"].as_u64().unwrap();
    let tokens = num("request_tokens");
    let page_sizes = [num("prefill_page_size"), num("decode_page_size")];
    assert_eq!(plan["prefill_layout"], layouts[0]);
    assert_eq!(plan["decode_layout"], layouts[1]);
    let pages: Vec<Vec<i32>> = page_sizes
        .iter()
        .map(|&ps| (0..tokens.div_ceil(ps) as i32).collect())
        .collect();
    assert_eq!(num("prefill_pages"), pages[0].len() as u64);
    assert_eq!(num("decode_pages"), pages[1].len() as u64);
    let make = |order: &str, tp: u64, rank: u32, ps: u64| {
        let make = if order == "hnd" {
            Layout::hnd
        } else {
            Layout::nhd
        };
        make(heads, tp as u32, rank, ps as u32, hb).unwrap()
    };
    let pairs = sending(plan);
    assert!(!pairs.is_empty());
    for ((p, d), pair) in pairs {
        let src = make(layouts[0], num("prefill_tp"), p, page_sizes[0]);
        let dst = make(layouts[1], num("decode_tp"), d, page_sizes[1]);
        let config = pair_config(&src, &dst).unwrap();
        let at = format!("({p}, {d})");
        assert_eq!(pair["first_head"], config.first_head(), "{at}");
        assert_eq!(pair["num_heads"], config.num_heads(), "{at}");
        assert_eq!(pair["src_first_local"], config.src_first_local(), "{at}");
        assert_eq!(pair["dst_first_local"], config.dst_first_local(), "{at}");
        let src_fields = [
            src.total_kv_heads.into(),
            src.tp_size.into(),
            src.tp_rank.into(),
            src.page_size.into(),
            src.head_bytes,
            src.page_stride,
            src.offset,
            src.token_stride,
            src.head_stride,
        ];
        assert_eq!(layout_fields(&pair["src_layout"]), src_fields, "{at}");
        assert_eq!(
            layout_fields(&pair["dst_layout"])[..4],
            [
                u64::from(dst.total_kv_heads),
                dst.tp_size.into(),
                dst.tp_rank.into(),
                dst.page_size.into()
            ]
        );
        assert_eq!(
            layout_fields(&pair["dst_layout"])[4..],
            [
                dst.head_bytes,
                dst.page_stride,
                dst.offset,
                dst.token_stride,
                dst.head_stride
            ],
            "{at}"
        );
        let staging = pair_staging_for(&config);
        assert_eq!(pair["staging"], staging_name(staging), "{at}");
        assert_eq!(
            pair["staging_bytes_per_request"],
            config.staging_len(tokens).unwrap() * buffers,
            "{at}"
        );
        let request = Request {
            src_pages: &pages[0],
            dst_pages: &pages[1],
            num_tokens: tokens,
        };
        let count = |mode| pair_segments(&config, &request, mode).unwrap().len();
        assert_eq!(pair["segments_per_buffer"], count(staging), "{at}");
        assert_eq!(
            pair["direct_segments_per_buffer"],
            count(Staging::None),
            "{at}"
        );
        assert_eq!(
            pair["segments_per_request"],
            count(staging) as u64 * buffers,
            "{at}"
        );
        assert_eq!(
            pair["direct_segments_per_request"],
            count(Staging::None) as u64 * buffers,
            "{at}"
        );
    }
}

#[test]
fn head_major_pages_of_an_8_kv_head_model_from_tp_8_to_tp_2_as_vllm_on_rocm_keeps_them() {
    let deployment = [
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "2",
        "--prefill-layout",
        "hnd",
        "--decode-layout",
        "hnd",
        "--page-size",
        "16",
        "--tokens",
        "40",
    ];
    let plan = plan_json(&deployment);
    check_pairs_against_the_library(&plan, ["hnd", "hnd"]);
    // By hand (the HND strides of REFERENCE.md section 11, 256-byte heads): a prefill rank holds 1 head, so a page
    // is 16 slots x 256 B = 4096 B; a decode rank holds 4 heads, each a 4096-byte block of a
    // 16384-byte page.
    assert_eq!(plan["page_size"], 16);
    assert_eq!(plan["src_item_len"], 4096);
    assert_eq!(plan["dst_item_len"], 16384);
    assert_eq!(plan["partial_last_page"], true);
    let pairs = sending(&plan);
    assert_eq!(pairs.len(), 8);
    for ((p, d), pair) in pairs {
        assert_eq!(d, p / 4);
        assert_eq!(pair["first_head"], p);
        assert_eq!(pair["dst_first_local"], p % 4);
        assert_eq!(
            layout_fields(&pair["src_layout"]),
            [8, 8, p.into(), 16, 256, 4096, 0, 256, 4096]
        );
        assert_eq!(
            layout_fields(&pair["dst_layout"]),
            [8, 2, d.into(), 16, 256, 16384, 0, 256, 4096]
        );
        // The prefill pages hold the slice alone, back to back: the decode rank unpacks, and the
        // transport gets one segment per buffer instead of one per page (3 pages for 40 tokens).
        assert_eq!(pair["staging"], "dst");
        assert_eq!(pair["segments_per_buffer"], 1);
        assert_eq!(pair["direct_segments_per_buffer"], 3);
        // 32 layers of K and V: 64 buffers.
        assert_eq!(pair["segments_per_request"], 64);
        assert_eq!(pair["direct_segments_per_request"], 3 * 64);
        assert_eq!(pair["staging_bytes_per_request"], 40 * 256 * 64);
    }
    let text = stdout(&mori_tp(&[&["plan"][..], &deployment].concat()));
    for line in [
        "cache:    bf16, 256 B per head; prefill HND pages of 16 tokens, decode HND pages of 16 tokens",
        "  prefill rank 5 sends head 5: bytes [0, 4096) of each 4096 B head-major page -> [4096, 8192) of each 16384 B head-major page",
        "    segments per buffer: 1 segment with staging dst, 3 unstaged; per request (64 buffers): 64 and 192",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    assert!(
        text.contains("the last page of each side holds 8 of 16 slots"),
        "{text}"
    );
}

#[test]
fn token_major_prefill_to_head_major_decode_packs_on_the_prefill_rank() {
    let plan = plan_json(&[
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--decode-layout",
        "hnd",
        "--page-size",
        "16",
        "--tokens",
        "64",
    ]);
    check_pairs_against_the_library(&plan, ["nhd", "hnd"]);
    assert_eq!(plan["partial_last_page"], false);
    for ((p, d), pair) in sending(&plan) {
        assert_eq!(p, d / 4);
        assert_eq!(pair["src_first_local"], d % 4);
        // One head out of four-head NHD slots (1024 B apart): a segment per token unstaged; the
        // decode rank's one-head HND pages take the packed slice in one segment.
        assert_eq!(pair["staging"], "src");
        assert_eq!(pair["direct_segments_per_buffer"], 64);
        assert_eq!(pair["segments_per_buffer"], 1);
    }
}

#[test]
fn page_sizes_that_differ_between_the_sides_plan_either_way() {
    for (prefill, decode, p, d, staging, staged, direct) in [
        // One head into four-head slots: the decode rank unpacks; a segment per token unstaged.
        ("16", "64", "8", "2", "dst", 1, 100),
        ("64", "16", "8", "2", "dst", 1, 100),
        // Whole tokens on both sides: pages to pages, one segment for pages back to back.
        ("16", "64", "2", "2", "none", 1, 1),
        ("64", "16", "2", "2", "none", 1, 1),
    ] {
        let plan = plan_json(&[
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            p,
            "--decode-tp",
            d,
            "--prefill-page-size",
            prefill,
            "--decode-page-size",
            decode,
            "--tokens",
            "100",
        ]);
        check_pairs_against_the_library(&plan, ["nhd", "nhd"]);
        let at = format!("{prefill} -> {decode}, TP {p} -> {d}");
        // 100 tokens: 7 pages of 16 (the last holds 4) and 2 of 64 (the last holds 36).
        assert_eq!(plan["page_size"], Value::Null, "{at}");
        assert_eq!(plan["prefill_page_size"], prefill.parse::<u64>().unwrap());
        let pages = |ps: &str| 100u64.div_ceil(ps.parse().unwrap());
        assert_eq!(plan["prefill_pages"], pages(prefill), "{at}");
        assert_eq!(plan["decode_pages"], pages(decode), "{at}");
        assert_eq!(plan["partial_last_page"], true, "{at}");
        for pair in sending(&plan).values() {
            assert_eq!(pair["staging"], staging, "{at}");
            assert_eq!(pair["segments_per_buffer"], staged, "{at}");
            assert_eq!(pair["direct_segments_per_buffer"], direct, "{at}");
        }
    }
}

#[test]
fn token_major_pages_of_one_size_count_the_segments_of_the_section_4_functions() {
    // Whole pages, NHD on both sides, one page size: the counts are those of plan_transfer and
    // plan_segments for the same pages, and the staging that of staging_for.
    use mori_tp::{plan_segments, plan_transfer};
    for (model, heads, p_size, d_size, page_size) in [
        ("qwen2.5-7b", 4u32, 2u32, 8u32, 16u32),
        ("llama-3.1-8b", 8, 16, 2, 4),
        ("llama-3.1-8b", 8, 8, 8, 64),
        ("deepseek-v3", 1, 8, 4, 1),
    ] {
        let (p_text, d_text, ps_text) = (
            p_size.to_string(),
            d_size.to_string(),
            page_size.to_string(),
        );
        let plan = plan_json(&[
            "--model",
            model,
            "--prefill-tp",
            &p_text,
            "--decode-tp",
            &d_text,
            "--page-size",
            &ps_text,
            "--tokens",
            "1024",
        ]);
        assert_eq!(plan["partial_last_page"], false);
        let head_dim = MODELS.iter().find(|m| m.0 == model).unwrap().2;
        let bytes_per_head = u64::from(head_dim) * 2;
        let pages: Vec<i32> = (0..1024 / page_size as i32).collect();
        for ((p, d), pair) in sending(&plan) {
            let config =
                section4_config(heads, (p_size, p), (d_size, d), page_size, bytes_per_head);
            let staging = staging_for(&config).unwrap();
            let at = format!("{model} ({p}, {d})");
            assert_eq!(pair["staging"], staging_name(staging), "{at}");
            assert_eq!(
                pair["segments_per_buffer"],
                plan_transfer(&config, staging, &pages, &pages)
                    .unwrap()
                    .len(),
                "{at}"
            );
            assert_eq!(
                pair["direct_segments_per_buffer"],
                plan_segments(&config, &pages, &pages).unwrap().len(),
                "{at}"
            );
        }
    }
}

#[test]
fn a_partial_last_page_is_said_in_text_and_json() {
    // The text wraps at 100 columns; compare its words.
    let words = |text: String| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let text = |tokens: &str| {
        let out = mori_tp(&[
            "plan",
            "--model",
            "qwen2.5-7b",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--page-size",
            "16",
            "--tokens",
            tokens,
        ]);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        words(stdout(&out))
    };
    let partial = text("40");
    assert!(
        partial.contains(
            "40 tokens on 3 pages of 16 a side; the last page of each side holds 8 of 16 slots"
        ),
        "{partial}"
    );
    assert!(partial.contains("per 40-token request"), "{partial}");
    assert!(!text("48").contains("holds"));
    let plan = plan_json(&["--page-size", "16", "--tokens", "40"]);
    assert_eq!(plan["partial_last_page"], true);
    assert_eq!(plan["request_tokens"], 40);
    // Only the request's tokens move: 40, not the 48 slots of its pages.
    let rank = &plan["decode_ranks"][0];
    assert_eq!(
        rank["bytes_per_request"].as_u64().unwrap(),
        40 * rank["bytes_per_token"].as_u64().unwrap()
    );
    let both = plan_json(&[
        "--prefill-page-size",
        "16",
        "--decode-page-size",
        "64",
        "--tokens",
        "64",
    ]);
    assert_eq!(both["partial_last_page"], false);
    let text = words(stdout(&mori_tp(&[
        "plan",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--prefill-page-size",
        "16",
        "--decode-page-size",
        "64",
        "--tokens",
        "100",
    ])));
    assert!(
        text.contains(
            "the last prefill page holds 4 of 16 slots, the last decode page 36 of 64 slots"
        ),
        "{text}"
    );
}

#[test]
fn page_size_sets_both_sides_and_a_contradicting_side_flag_is_refused() {
    let plan = plan_json(&["--page-size", "32"]);
    assert_eq!(plan["prefill_page_size"], 32);
    assert_eq!(plan["decode_page_size"], 32);
    assert_eq!(plan["page_size"], 32);
    // Agreeing flags are not a contradiction.
    let plan = plan_json(&["--page-size", "32", "--decode-page-size", "32"]);
    assert_eq!(plan["decode_page_size"], 32);
    // One side's own flag, the other side at the default of 1.
    let plan = plan_json(&["--decode-page-size", "8"]);
    assert_eq!(plan["prefill_page_size"], 1);
    assert_eq!(plan["decode_page_size"], 8);
    for command in ["plan", "simulate"] {
        for (flag, value) in [("--prefill-page-size", "64"), ("--decode-page-size", "8")] {
            let out = mori_tp(&[
                command,
                "--model",
                "qwen2.5-7b",
                "--prefill-tp",
                "2",
                "--decode-tp",
                "8",
                "--page-size",
                "16",
                flag,
                value,
            ]);
            assert_eq!(code(&out), 2, "{command} {flag}");
            assert!(stdout(&out).is_empty());
            let err = stderr(&out);
            assert!(
                err.contains(&format!(
                    "--page-size 16 sets both engines' page size, but {flag} {value}"
                )),
                "{err}"
            );
        }
    }
    let out = mori_tp(&[
        "plan",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--page-size",
        "16",
        "--prefill-page-size",
        "64",
    ]);
    assert_eq!(code(&out), 2);
    let error: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(error["error"]["kind"], "usage");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--prefill-page-size 64")
    );
}

#[test]
fn bad_layout_and_page_size_values_exit_2_naming_the_value() {
    for (args, says) in [
        (vec!["plan", "--prefill-layout", "nchw"], "'nchw'"),
        (vec!["simulate", "--decode-layout", "HND-ish"], "'HND-ish'"),
        (
            vec!["plan", "--decode-layout", ""],
            "possible values: nhd, hnd",
        ),
        (vec!["plan", "--prefill-page-size", "0"], "0 is too small"),
        (vec!["plan", "--decode-page-size", "-4"], "-4 is negative"),
        (
            vec!["simulate", "--prefill-page-size", "1.5"],
            "1.5 is not a whole number",
        ),
    ] {
        let out = mori_tp(&args);
        assert_eq!(code(&out), 2, "{args:?}");
        assert!(stdout(&out).is_empty(), "{args:?}");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn a_layout_that_cannot_work_exits_3_with_the_librarys_numbers() {
    for command in ["plan", "simulate"] {
        // A head-major page whose size overflows 64 bits: the library names the factors.
        let out = mori_tp(&[
            command,
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--kv-heads",
            "1",
            "--head-dim",
            "4294967295",
            "--dtype",
            "fp32",
            "--prefill-layout",
            "hnd",
            "--prefill-page-size",
            "4294967295",
        ]);
        assert_eq!(code(&out), 3, "{command}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(
                "prefill side: HND pages of 4294967295 tokens: invalid argument: page_size * \
                 head_bytes = 4294967295 * 17179869180 overflows 64 bits"
            ),
            "{err}"
        );
        // A TP size that does not fit the heads, whatever the layout.
        let out = mori_tp(&[
            command,
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "3",
            "--decode-tp",
            "8",
            "--prefill-layout",
            "hnd",
            "--decode-page-size",
            "64",
        ]);
        assert_eq!(code(&out), 3, "{command}");
        assert!(
            stderr(&out).contains("tp_size 3 and total_kv_heads 8"),
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn simulate_moves_every_mix_of_layouts_and_page_sizes_and_agrees_with_the_plan() {
    // Fragmentation 0: each side's pages are one run, so the segments are the plan's.
    let common = [
        "--model",
        "llama-3.1-8b",
        "--tokens",
        "150",
        "--layers-limit",
        "2",
        "--fragmentation",
        "0",
    ];
    for (p, d, prefill, decode) in [
        // vLLM on ROCm: HND, 8 KV heads, TP 8 -> 2.
        ("8", "2", ["hnd", "16"], ["hnd", "16"]),
        ("2", "8", ["nhd", "16"], ["hnd", "16"]),
        ("8", "2", ["hnd", "16"], ["nhd", "64"]),
        ("4", "2", ["nhd", "64"], ["hnd", "16"]),
    ] {
        let mut args = common.to_vec();
        args.extend_from_slice(&[
            "--prefill-tp",
            p,
            "--decode-tp",
            d,
            "--prefill-layout",
            prefill[0],
            "--prefill-page-size",
            prefill[1],
            "--decode-layout",
            decode[0],
            "--decode-page-size",
            decode[1],
        ]);
        let out = simulate(&args);
        let at = format!("{args:?}");
        assert!(out.trim_end().ends_with("OK"), "{at}\n{out}");
        let label = |order: &str| order.to_uppercase();
        assert!(
            out.contains(&format!(
                "prefill {} pages of {} tokens, decode {} pages of {} tokens",
                label(prefill[0]),
                prefill[1],
                label(decode[0]),
                decode[1]
            )),
            "{out}"
        );
        // 150 tokens leave both last pages partial; the check covers the slots after them.
        let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
        for (paging, used) in [(prefill, "holds"), (decode, "")] {
            let slots = if paging[1] == "16" {
                "6 of 16"
            } else {
                "22 of 64"
            };
            assert!(flat.contains(&format!("{used} {slots} slots")), "{out}");
        }
        assert!(
            flat.contains("the slots after the last token are never written"),
            "{out}"
        );
        let mut plan_args = vec!["plan", "--json"];
        plan_args.extend_from_slice(&args[..2]);
        plan_args.extend_from_slice(&args[2..4]);
        plan_args.extend_from_slice(&args[8..]);
        let plan = json_of(&plan_args);
        let pairs = sending(&plan);
        assert_eq!(
            number_before(&out, "sent:", "pair"),
            pairs.len() as u64,
            "{out}"
        );
        // A per-token plan copies each token of each pair once per buffer (4: K and V of 2
        // layers), and once per head where a head-major side keeps a token's heads apart.
        let (mut direct, mut staged, mut per_token) = (0, 0, 0);
        for pair in pairs.values() {
            direct += pair["direct_segments_per_buffer"].as_u64().unwrap();
            staged += pair["segments_per_buffer"].as_u64().unwrap();
            let heads = pair["num_heads"].as_u64().unwrap();
            let hnd = prefill[0] == "hnd" || decode[0] == "hnd";
            per_token += 150 * if hnd { heads } else { 1 };
        }
        assert_eq!(number_before(&out, "copies:", "("), per_token * 4, "{out}");
        let rest = out
            .lines()
            .skip_while(|l| !l.starts_with("segments:"))
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(
            number_before(&rest, "segments:", "direct"),
            direct * 4,
            "{out}"
        );
        assert_eq!(
            number_before(&rest, "segments:", "staged"),
            staged * 4,
            "{out}"
        );
    }
}

#[test]
fn the_svg_picture_says_the_page_layouts_in_its_caption() {
    let picture = |name: &str, extra: &[&str]| {
        let file = scratch_file(name, "");
        let mut args = vec![
            "plan",
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "8",
            "--decode-tp",
            "2",
            "--svg",
            file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = mori_tp(&args);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        std::fs::read_to_string(&file).unwrap()
    };
    let plain = picture("caption-nhd.svg", &[]);
    let mixed = picture(
        "caption-hnd.svg",
        &["--prefill-layout", "hnd", "--decode-page-size", "64"],
    );
    let doc = roxmltree::Document::parse(&mixed).expect("well-formed XML");
    let caption = doc
        .descendants()
        .find(|n| n.attribute("id") == Some("layouts"))
        .expect("a caption line for the layouts");
    assert!(
        caption
            .text()
            .unwrap()
            .contains("prefill HND pages of 1 token, decode NHD pages of 64 tokens"),
        "{:?}",
        caption.text()
    );
    assert!(!plain.contains("id=\"layouts\""));
    // Layouts change where bytes sit, not who sends what: the same arrows.
    let arrows = |svg: &str| svg.matches("class=\"send\"").count();
    assert_eq!(arrows(&plain), arrows(&mixed));
    assert_eq!(arrows(&plain), 8);
}
