//! Model facts of hybrid and quantized models in `mori-tp plan --config`: the groups of every
//! config the repository ships (cli/configs), checked against the formulas restated here from
//! the configs' own fields, and against the Python package's `mori_tp.models`, which derives
//! the same facts independently: the two must agree on every shipped config.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ is inside the repository")
}

fn mori_tp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mori-tp"))
        .args(args)
        .current_dir(repository())
        .output()
        .expect("the binary runs")
}

fn json_of(args: &[&str]) -> Value {
    let out = mori_tp(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON value")
}

/// The configs the repository ships: every directory of cli/configs.
fn shipped_configs() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repository().join("cli/configs"))
        .expect("cli/configs")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

fn config(name: &str) -> Value {
    let path = repository()
        .join("cli/configs")
        .join(name)
        .join("config.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn group<'a>(plan: &'a Value, name: &str) -> &'a Value {
    plan["groups"]
        .as_array()
        .expect("a plan --config has groups")
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no group {name}"))
}

fn part<'a>(group: &'a Value, name: &str) -> &'a Value {
    group["parts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no part {name}"))
}

fn u(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("{value} is not a count"))
}

/// The libmori_tp shared library this `cargo test` built beside the test binary (cargo writes
/// the dependency's cdylib into `deps/`), for the Python package.
fn built_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let name = format!(
        "{}mori_tp{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    [deps.join(&name), deps.parent().unwrap().join(&name)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} was not built beside {}", deps.display()))
}

/// The deployments each config is planned for: (prefill TP, decode TP, tokens, extra flags).
const DEPLOYMENTS: &[(u32, u32, u32, &[&str])] = &[
    (1, 4, 300, &[]),
    (2, 8, 700, &[]),
    (
        4,
        2,
        1000,
        &[
            "--prefill-layout",
            "hnd",
            "--prefill-page-size",
            "16",
            "--decode-page-size",
            "64",
        ],
    ),
    (8, 1, 130, &["--dtype", "fp8", "--ssm-dtype", "fp32"]),
    // An fp8 KV cache with the states in their defaults (the model's dtype for the conv state).
    (
        2,
        4,
        500,
        &["--dtype", "fp8", "--num-speculative-tokens", "2"],
    ),
    (
        4,
        8,
        33,
        &[
            "--mamba-cache-dtype",
            "fp32",
            "--mamba-ssm-cache-dtype",
            "bf16",
            "--num-speculative-tokens",
            "1",
        ],
    ),
    (
        2,
        2,
        1,
        &[
            "--dtype",
            "fp32",
            "--page-size",
            "16",
            "--decode-layout",
            "hnd",
        ],
    ),
    (16, 4, 64, &[]),
];

/// The Python package's plan of each deployment (None where it refuses one).
const PYTHON: &str = r#"
import json, sys
import mori_tp.models as models
facts = models.read_config(sys.argv[1])
out = []
for d in json.loads(sys.argv[2]):
    try:
        out.append(models.plan(facts, d["p"], d["d"], d["tokens"], dtype=d.get("dtype"),
                               ssm_dtype=d.get("ssm_dtype"), prefill_layout=d["prefill_layout"],
                               decode_layout=d["decode_layout"],
                               prefill_page_size=d["prefill_page_size"],
                               decode_page_size=d["decode_page_size"],
                               mamba_cache_dtype=d.get("mamba_cache_dtype"),
                               mamba_ssm_cache_dtype=d.get("mamba_ssm_cache_dtype"),
                               num_spec=d["num_spec"]))
    except Exception as error:  # the refusal, whichever class: compared with the exit status
        out.append({"refused": str(error)})
print(json.dumps(out))
"#;

/// The flag values of a deployment, as the Python call takes them.
fn python_args(p: u32, d: u32, tokens: u32, flags: &[&str]) -> Value {
    let flag = |name: &str| {
        flags
            .iter()
            .position(|f| *f == name)
            .map(|i| flags[i + 1].to_string())
    };
    let page = |side: &str| -> u64 {
        flag(&format!("--{side}-page-size"))
            .or_else(|| flag("--page-size"))
            .map_or(1, |s| s.parse().unwrap())
    };
    json!({
        "p": p, "d": d, "tokens": tokens,
        "dtype": flag("--dtype"),
        "ssm_dtype": flag("--ssm-dtype"),
        "mamba_cache_dtype": flag("--mamba-cache-dtype"),
        "mamba_ssm_cache_dtype": flag("--mamba-ssm-cache-dtype"),
        "num_spec": flag("--num-speculative-tokens").map_or(0, |n| n.parse::<u64>().unwrap()),
        "prefill_layout": flag("--prefill-layout").unwrap_or("nhd".into()),
        "decode_layout": flag("--decode-layout").unwrap_or("nhd".into()),
        "prefill_page_size": page("prefill"),
        "decode_page_size": page("decode"),
    })
}

/// Python's plan of each deployment of `config` (a path from the repository root).
fn python_plans(config: &str, deployments: &[(u32, u32, u32, &[&str])]) -> Vec<Value> {
    let args: Vec<Value> = deployments
        .iter()
        .map(|&(p, d, tokens, flags)| python_args(p, d, tokens, flags))
        .collect();
    let out = Command::new("python3")
        .args(["-c", PYTHON, config, &Value::Array(args).to_string()])
        .current_dir(repository())
        .env("PYTHONPATH", repository().join("python"))
        .env("MORI_TP_LIBRARY", built_library())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Plans each deployment of `config` with the CLI and with Python and requires the two to agree
/// (or both to refuse); returns the CLI's plans of the deployments both took.
fn cli_and_python_agree(config: &str, deployments: &[(u32, u32, u32, &[&str])]) -> Vec<Value> {
    let python = python_plans(config, deployments);
    let mut plans = Vec::new();
    for (&(p, d, tokens, flags), python) in deployments.iter().zip(&python) {
        let (p_text, d_text, n_text) = (p.to_string(), d.to_string(), tokens.to_string());
        let mut args = vec![
            "plan",
            "--config",
            config,
            "--json",
            "--prefill-tp",
            &p_text,
            "--decode-tp",
            &d_text,
            "--tokens",
            &n_text,
        ];
        args.extend_from_slice(flags);
        let out = mori_tp(&args);
        let what = format!("{config} {args:?}");
        if out.status.code() == Some(3) {
            // A TP size one of the model's parts cannot take: Python refuses it too.
            assert!(
                python.get("refused").is_some(),
                "{what}: only the CLI refused"
            );
            continue;
        }
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cli: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(
            python.get("refused").is_none(),
            "{what}: Python refused: {python}"
        );
        assert_eq!(
            &cli["groups"], python,
            "{what}: the CLI and Python disagree"
        );
        plans.push(cli);
    }
    plans
}

#[test]
fn python_and_the_cli_derive_the_same_groups_for_every_shipped_config() {
    let configs = shipped_configs();
    let families: BTreeSet<String> = configs
        .iter()
        .map(|c| {
            json_of(&[
                "plan",
                "--prefill-tp",
                "2",
                "--decode-tp",
                "8",
                "--config",
                &format!("cli/configs/{c}"),
                "--json",
            ])["model"]["family"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    // Every family mori-tp derives has a shipped config.
    for family in [
        "dense",
        "mla_indexer",
        "sliding_window",
        "gated_deltanet",
        "mamba2",
    ] {
        assert!(
            families.contains(family),
            "no shipped config of {family}: {families:?}"
        );
    }
    let mut compared = 0;
    for name in &configs {
        compared += cli_and_python_agree(&format!("cli/configs/{name}"), DEPLOYMENTS).len();
    }
    assert!(
        compared >= 3 * configs.len(),
        "only {compared} plans were compared"
    );
}

/// Mamba2 models of one group (`n_groups` 1), in the three spellings mori-tp reads: Falcon-H1
/// (transformers' `FalconH1Config`: attention and Mamba2 on every layer; the 0.5B model's figures
/// in transformers' Falcon-H1 documentation), Granite-4.0-H (`GraniteMoeHybridConfig`:
/// `layer_types`, `mamba_d_head` auto; shaped as Granite-4.0-H-Tiny) and Nemotron-H (the shipped
/// 8B config with one group).
fn one_group_configs() -> Vec<(&'static str, Value)> {
    let granite_layers: Vec<&str> = (0..40)
        .map(|i| {
            if [5, 15, 25, 35].contains(&i) {
                "attention"
            } else {
                "mamba"
            }
        })
        .collect();
    let mut nemotron = config("nemotron-h-8b-base-8k");
    nemotron["n_groups"] = json!(1);
    vec![
        (
            "falcon-h1",
            json!({
                "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
                "num_hidden_layers": 36, "hidden_size": 1024, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "mamba_n_heads": 24,
                "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_n_groups": 1,
                "mamba_d_state": 128, "mamba_d_conv": 4, "torch_dtype": "bfloat16"
            }),
        ),
        (
            "granite-4.0-h",
            json!({
                "model_type": "granitemoehybrid",
                "architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 40,
                "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 4,
                "mamba_n_heads": 48, "mamba_d_head": "auto", "mamba_expand": 2,
                "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4,
                "layer_types": granite_layers, "torch_dtype": "bfloat16"
            }),
        ),
        ("nemotron-h-one-group", nemotron),
    ]
}

#[test]
fn models_of_one_group_plan_alike_in_the_cli_and_python_and_send_b_and_c_from_one_rank() {
    const ONE_GROUP: &[(u32, u32, u32, &[&str])] = &[
        (1, 2, 100, &[]),
        (2, 4, 100, &[]),
        (4, 2, 100, &[]),
        (8, 1, 100, &[]),
        (
            2,
            8,
            64,
            &["--dtype", "fp8", "--num-speculative-tokens", "3"],
        ),
        (
            4,
            4,
            10,
            &[
                "--mamba-cache-dtype",
                "fp32",
                "--mamba-ssm-cache-dtype",
                "fp16",
            ],
        ),
    ];
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("one-group-configs");
    for (name, value) in one_group_configs() {
        let folder = dir.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("config.json"), value.to_string()).unwrap();
        let path = folder.to_str().unwrap().to_string();
        let plans = cli_and_python_agree(&path, ONE_GROUP);
        assert_eq!(
            plans.len(),
            ONE_GROUP.len(),
            "{name}: every deployment plans"
        );
        for plan in &plans {
            let (p_size, d_size) = (u(&plan["prefill_tp"]), u(&plan["decode_tp"]));
            let conv = group(plan, "conv_state");
            assert_eq!(part(conv, "B")["held_whole"], true, "{name}");
            for rank in conv["decode_ranks"].as_array().unwrap() {
                assert_eq!(rank["owned_units"]["B"], json!([0, 1]), "{name}");
            }
            // Each decode rank gets B and C whole from prefill rank d * P / D, and only it.
            for d in 0..d_size {
                for name_bc in ["B", "C"] {
                    let senders: Vec<u64> = conv["pairs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|pair| u(&pair["decode_rank"]) == d)
                        .filter(|pair| {
                            pair["parts"].as_array().unwrap().iter().any(|x| {
                                x["part"] == name_bc
                                    && x["action"] == "send"
                                    && u(&x["num_units"]) == 1
                            })
                        })
                        .map(|pair| u(&pair["prefill_rank"]))
                        .collect();
                    assert_eq!(senders, [d * p_size / d_size], "{name} {p_size}->{d_size}");
                }
            }
        }
    }
}

/// The layers whose character in a Nemotron-H pattern is `c`.
fn pattern_layers(pattern: &str, c: char) -> Vec<u64> {
    pattern
        .char_indices()
        .filter(|&(_, x)| x == c)
        .map(|(i, _)| i as u64)
        .collect()
}

/// Nemotron-H-8B from prefill TP 2 to decode TP 4, a request of 1,000 tokens.
const NEMOTRON_2_TO_4: [&str; 9] = [
    "plan",
    "--config",
    "cli/configs/nemotron-h-8b-base-8k",
    "--prefill-tp",
    "2",
    "--decode-tp",
    "4",
    "--tokens",
    "1000",
];

#[test]
fn a_mamba2_hybrid_plans_every_group_with_the_bytes_of_its_formulas() {
    let cfg = config("nemotron-h-8b-base-8k");
    let field = |key: &str| u(&cfg[key]);
    let pattern = cfg["hybrid_override_pattern"].as_str().unwrap();
    let (p_size, d_size, tokens) = (2u64, 4u64, 1000u64);
    let mut args = NEMOTRON_2_TO_4.to_vec();
    args.push("--json");
    let plan = json_of(&args);
    assert_eq!(plan["model"]["family"], "mamba2");
    assert_eq!(
        u(&plan["model"]["total_layers"]),
        field("num_hidden_layers")
    );
    let names: Vec<&str> = plan["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["full_attention", "conv_state", "ssm_state"]);

    let (attention, mamba) = (pattern_layers(pattern, '*'), pattern_layers(pattern, 'M'));
    let full = group(&plan, "full_attention");
    let layers =
        |g: &Value| -> Vec<u64> { g["layers"].as_array().unwrap().iter().map(u).collect() };
    assert_eq!(layers(full), attention);
    // The classic plan above describes the attention layers only.
    assert_eq!(u(&plan["model"]["layers"]), attention.len() as u64);
    let conv = group(&plan, "conv_state");
    let ssm = group(&plan, "ssm_state");
    assert_eq!(layers(conv), mamba);
    assert_eq!(layers(ssm), mamba);
    let steps = field("conv_kernel") - 1;
    assert_eq!(u(&conv["slot_steps"]), steps);
    assert_eq!(conv["storage"], "slot");

    // bf16 (the config's torch_dtype) for the conv state and, as the config names no SSM dtype,
    // fp32 for the SSM state: vLLM's Nemotron-H default (NemotronHForCausalLMConfig).
    assert_eq!(cfg["architectures"][0], "NemotronHForCausalLM");
    assert!(cfg.get("mamba_ssm_cache_dtype").is_none());
    let (heads, head_dim, groups, state) = (
        field("mamba_num_heads"),
        field("mamba_head_dim"),
        field("n_groups"),
        field("ssm_state_size"),
    );
    assert_eq!(u(&part(conv, "x")["unit_bytes"]), head_dim * 2);
    assert_eq!(u(&part(conv, "B")["unit_bytes"]), state * 2);
    assert_eq!(u(&part(ssm, "state")["unit_bytes"]), head_dim * state * 4);
    assert_eq!(part(ssm, "state")["dtype"], "fp32");
    let kv_per_token = field("num_key_value_heads") / d_size * field("attention_head_dim") * 2 * 2;
    for rank in conv["decode_ranks"].as_array().unwrap() {
        let d = u(&rank["decode_rank"]);
        // x heads d*32..; B and C groups d*2.. (each split evenly over 4 ranks).
        let x = heads / d_size;
        assert_eq!(rank["owned_units"]["x"], json!([d * x, (d + 1) * x]));
        let g = groups / d_size;
        assert_eq!(rank["owned_units"]["C"], json!([d * g, (d + 1) * g]));
        let per_step = x * head_dim * 2 + 2 * g * state * 2;
        assert_eq!(
            u(&rank["bytes_per_request"]),
            per_step * steps * mamba.len() as u64
        );
        assert!(rank["bytes_per_token"].is_null());
    }
    for rank in ssm["decode_ranks"].as_array().unwrap() {
        let x = heads / d_size;
        assert_eq!(
            u(&rank["bytes_per_request"]),
            x * head_dim * state * 4 * mamba.len() as u64
        );
    }
    for rank in full["decode_ranks"].as_array().unwrap() {
        let per_token = kv_per_token * attention.len() as u64;
        assert_eq!(u(&rank["bytes_per_token"]), per_token);
        assert_eq!(u(&rank["bytes_per_request"]), per_token * tokens);
    }
    // Decode rank d gets its x heads, B and C groups from prefill rank d * P / D, whole.
    for pair in conv["pairs"].as_array().unwrap() {
        let (p, d) = (u(&pair["prefill_rank"]), u(&pair["decode_rank"]));
        assert_eq!(p, d * p_size / d_size);
        for part in pair["parts"].as_array().unwrap() {
            assert_eq!(part["action"], "send");
        }
    }

    // The text says the same, and that the slot layout is the engine's.
    let out = mori_tp(&NEMOTRON_2_TO_4);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("groups:   3 kinds of state over 52 layers"),
        "{text}"
    );
    assert!(
        text.contains("prefill rank 0 sends x heads 0-31, B groups 0-1, C groups 0-1"),
        "{text}"
    );
    assert!(text.contains("is not\n          guessed here") || text.contains("is not guessed"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("conv state bf16 (the model's dtype), SSM state fp32 (vLLM's Nemotron-H")
            && stderr.contains("--mamba-ssm-cache-dtype"),
        "{stderr}"
    );
}

#[test]
fn ssm_dtype_and_the_fp8_latent_change_only_the_bytes_they_name() {
    let base = [
        "plan",
        "--config",
        "cli/configs/qwen3-next-80b-a3b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
    ];
    let bf16 = json_of(&base);
    let mut args = base.to_vec();
    args.extend(["--ssm-dtype", "fp32"]);
    let fp32 = json_of(&args);
    let cfg = config("qwen3-next-80b-a3b");
    let state = u(&cfg["linear_value_head_dim"]) * u(&cfg["linear_key_head_dim"]);
    let bytes = |plan: &Value| u(&part(group(plan, "recurrent_state"), "state")["unit_bytes"]);
    assert_eq!((bytes(&bf16), bytes(&fp32)), (state * 2, state * 4));
    let conv = |plan: &Value| group(plan, "conv_state")["parts"].clone();
    assert_eq!(conv(&bf16), conv(&fp32));

    // DeepSeek V3.2 with an fp8 cache: a 656-byte latent, the classic plan's head bytes too.
    let fp8 = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/deepseek-v3.2",
        "--dtype",
        "fp8",
        "--json",
    ]);
    let cfg = config("deepseek-v3.2");
    let rank = u(&cfg["kv_lora_rank"]);
    let latent = rank + rank / 128 * 4 + u(&cfg["qk_rope_head_dim"]) * 2;
    assert_eq!(latent, 656);
    assert_eq!(
        u(&part(group(&fp8, "mla_latent"), "latent")["unit_bytes"]),
        latent
    );
    assert_eq!(u(&fp8["model"]["bytes_per_head"]), latent);
    let index = u(&cfg["index_head_dim"]);
    let indexer = part(group(&fp8, "indexer"), "index_k");
    assert_eq!(u(&indexer["unit_bytes"]), index + index / 128 * 4);
    assert_eq!(indexer["held_whole"], true);
}

#[test]
fn a_sliding_window_group_moves_only_its_window() {
    let cfg = config("gpt-oss-20b");
    let window = u(&cfg["sliding_window"]);
    assert_eq!(window, 128);
    // (prefill page size, decode page size, tokens, tokens the library moves): the window
    // starts at tokens - window rounded down to a multiple of both page sizes, the only start
    // the library takes (REFERENCE.md section 15: pages 16 and 64, 1000 tokens, 168 tokens).
    let cases = [
        (1u64, 1u64, 1000u64, 128u64),
        (1, 1, 100, 100),
        (16, 64, 1000, 168),
        (64, 16, 1000, 168),
        (16, 16, 1000, 136),
        (48, 32, 1000, 136),
        (16, 64, 192, 128),
        (16, 64, 150, 150),
    ];
    for (prefill_page, decode_page, tokens, moved) in cases {
        let label = format!("pages {prefill_page}/{decode_page}, {tokens} tokens");
        let (n, pp, dp) = (
            tokens.to_string(),
            prefill_page.to_string(),
            decode_page.to_string(),
        );
        let plan = json_of(&[
            "plan",
            "--config",
            "cli/configs/gpt-oss-20b",
            "--prefill-tp",
            "1",
            "--decode-tp",
            "4",
            "--prefill-page-size",
            &pp,
            "--decode-page-size",
            &dp,
            "--tokens",
            &n,
            "--json",
        ]);
        let sliding = group(&plan, "sliding_attention");
        assert_eq!(u(&sliding["window"]), window, "{label}");
        assert_eq!(u(&sliding["tokens_moved"]), moved, "{label}");
        // The start is on a page of both sides, and no later start on one covers the window.
        let start = tokens - moved;
        assert_eq!(start % prefill_page, 0, "{label}");
        assert_eq!(start % decode_page, 0, "{label}");
        assert!(moved >= tokens.min(window), "{label}");
        for rank in sliding["decode_ranks"].as_array().unwrap() {
            assert_eq!(
                u(&rank["bytes_per_request"]),
                u(&rank["bytes_per_token"]) * moved,
                "{label}"
            );
        }
        let full = group(&plan, "full_attention");
        assert_eq!(u(&full["tokens_moved"]), tokens, "{label}");
    }
}

#[test]
fn a_dense_config_keeps_its_plan_and_its_one_group_agrees_with_it() {
    let mut args = vec![
        "plan",
        "--config",
        "cli/configs/llama-3.1-8b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "2",
    ];
    let out = mori_tp(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !text.contains("groups:"), "{text}");
    args.push("--json");
    let plan = json_of(&args);
    assert_eq!(plan["groups"].as_array().unwrap().len(), 1);
    let full = group(&plan, "full_attention");
    for (rank, classic) in full["decode_ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(plan["decode_ranks"].as_array().unwrap())
    {
        assert_eq!(rank["bytes_per_token"], classic["bytes_per_token"]);
        assert_eq!(rank["bytes_per_request"], classic["bytes_per_request"]);
    }
    // The same pairs send as in the classic plan, with the same heads.
    let sends = |pairs: &[Value],
                 heads: &dyn Fn(&Value) -> (u64, u64)|
     -> BTreeMap<(u64, u64), (u64, u64)> {
        pairs
            .iter()
            .filter_map(|pair| {
                let key = (u(&pair["prefill_rank"]), u(&pair["decode_rank"]));
                let (first, n) = heads(pair);
                (n > 0).then_some((key, (first, n)))
            })
            .collect()
    };
    let classic = sends(plan["pairs"].as_array().unwrap(), &|p| {
        (u(&p["first_head"]), u(&p["num_heads"]))
    });
    let grouped = sends(full["pairs"].as_array().unwrap(), &|p| {
        let kv = &p["parts"][0];
        (u(&kv["first_unit"]), u(&kv["num_units"]))
    });
    assert_eq!(classic, grouped);
}

#[test]
fn tp_sizes_the_engines_cannot_split_a_part_by_are_refused_with_the_numbers() {
    // Nemotron-H's 8 groups split only evenly: decode TP 16 divides its 128 heads, not them.
    let args = [
        "plan",
        "--config",
        "cli/configs/nemotron-h-8b-base-8k",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "16",
    ];
    let out = mori_tp(&args);
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TP 16 does not divide the 8 B groups of conv_state"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let out = mori_tp(&json_args);
    assert_eq!(out.status.code(), Some(3));
    let error: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(error["error"]["kind"], "invalid_layout");
    // --layers would contradict the groups' own layers.
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/qwen3-next-80b-a3b",
        "--layers",
        "4",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--layers 4") && stderr.contains("conv_state"),
        "{stderr}"
    );
}

#[test]
fn the_svg_of_a_hybrid_model_draws_a_panel_per_unit_count() {
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nemotron-groups.svg");
    let _ = std::fs::remove_file(&file);
    let plan = json_of(&[
        "plan",
        "--config",
        "cli/configs/nemotron-h-8b-base-8k",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--svg",
        file.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&file).expect("the SVG was written");
    let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
    // Parts by unit count, in the order they appear: 8 (KV heads, B and C groups), 128.
    let mut counts: Vec<(u64, Vec<String>)> = Vec::new();
    for g in plan["groups"].as_array().unwrap() {
        for p in g["parts"].as_array().unwrap() {
            let units = u(&p["units"]);
            let name = format!(
                "{} {}",
                g["name"].as_str().unwrap(),
                p["name"].as_str().unwrap()
            );
            match counts.iter_mut().find(|(n, _)| *n == units) {
                Some((_, names)) => names.push(name),
                None => counts.push((units, vec![name])),
            }
        }
    }
    assert_eq!(counts.iter().map(|c| c.0).collect::<Vec<_>>(), [8, 128]);
    let panels: Vec<roxmltree::Node> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("panel"))
        .collect();
    assert_eq!(panels.len(), counts.len());
    let ids: BTreeSet<&str> = doc
        .descendants()
        .filter_map(|n| n.attribute("id"))
        .collect();
    assert_eq!(
        ids.len(),
        doc.descendants()
            .filter(|n| n.attribute("id").is_some())
            .count(),
        "ids are unique"
    );
    for (i, (panel, (units, names))) in panels.iter().zip(&counts).enumerate() {
        assert_eq!(
            panel.attribute("data-units"),
            Some(units.to_string().as_str())
        );
        let title = doc
            .descendants()
            .find(|n| n.attribute("id") == Some(format!("g{i}-title").as_str()))
            .unwrap();
        let title = title.text().unwrap();
        assert!(names.iter().all(|n| title.contains(n.as_str())), "{title}");
        for r in 0..2 {
            assert!(ids.contains(format!("g{i}-p{r}").as_str()));
        }
        for r in 0..8 {
            assert!(ids.contains(format!("g{i}-d{r}").as_str()));
        }
        // One arrow per sending pair of a part with this many units (every such part sends the
        // same pairs): decode rank d from prefill rank d * 2 / 8.
        let arrows: Vec<(u64, u64)> = panel
            .descendants()
            .filter(|n| n.attribute("class") == Some("send"))
            .map(|n| {
                (
                    n.attribute("data-prefill").unwrap().parse().unwrap(),
                    n.attribute("data-decode").unwrap().parse().unwrap(),
                )
            })
            .collect();
        assert_eq!(arrows, (0..8).map(|d| (d * 2 / 8, d)).collect::<Vec<_>>());
    }

    // gpt-oss: both groups shard 8 KV heads alike, so one picture as before.
    let _ = std::fs::remove_file(&file);
    json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/gpt-oss-20b",
        "--json",
        "--svg",
        file.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&file).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    assert!(
        doc.descendants()
            .any(|n| n.attribute("id") == Some("title"))
    );
    assert!(
        !doc.descendants()
            .any(|n| n.attribute("class") == Some("panel"))
    );
}

/// The unit bytes and dtype of a part of a plan's group.
fn part_dtype(plan: &Value, group_name: &str, part_name: &str) -> (u64, String) {
    let p = part(group(plan, group_name), part_name);
    (
        u(&p["unit_bytes"]),
        p["dtype"].as_str().unwrap().to_string(),
    )
}

/// What decode rank 0 receives of a group per request.
fn rank0_request(plan: &Value, group_name: &str) -> u64 {
    u(&group(plan, group_name)["decode_ranks"][0]["bytes_per_request"])
}

#[test]
fn an_fp8_kv_cache_leaves_the_conv_and_ssm_states_in_their_own_dtypes() {
    // Nemotron-H with an fp8 KV cache, prefill TP 1, decode TP 2: vLLM keeps the conv state in
    // the model's bf16 (mamba_cache_dtype auto) and, as the config names no SSM dtype, the SSM
    // state in fp32 (NemotronHForCausalLMConfig's default).
    let base = [
        "plan",
        "--config",
        "cli/configs/nemotron-h-8b-base-8k",
        "--prefill-tp",
        "1",
        "--decode-tp",
        "2",
        "--dtype",
        "fp8",
    ];
    let with = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        args.push("--json");
        json_of(&args)
    };
    let plan = with(&[]);
    let cfg = config("nemotron-h-8b-base-8k");
    let mamba = pattern_layers(cfg["hybrid_override_pattern"].as_str().unwrap(), 'M').len() as u64;
    assert_eq!(
        part_dtype(&plan, "full_attention", "kv"),
        (128, "fp8".into())
    );
    assert_eq!(
        part_dtype(&plan, "conv_state", "x"),
        (64 * 2, "bf16".into())
    );
    assert_eq!(
        part_dtype(&plan, "conv_state", "B"),
        (128 * 2, "bf16".into())
    );
    assert_eq!(
        part_dtype(&plan, "ssm_state", "state"),
        (64 * 128 * 4, "fp32".into())
    );
    // x: 64 heads of 64, B and C: 4 groups of 128, 3 rows, bf16: 737,280 B (the issue's
    // 737.3 kB); the SSM state: 64 heads of 64 x 128 fp32 values.
    let conv = (64 * 64 + 2 * 4 * 128) * 3 * 2 * mamba;
    assert_eq!(rank0_request(&plan, "conv_state"), conv);
    assert_eq!(conv, 737_280);
    assert_eq!(rank0_request(&plan, "ssm_state"), 64 * 64 * 128 * 4 * mamba);
    let out = mori_tp(&base);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("receives 737.3 kB per request"), "{text}");
    assert!(text.contains("receives 50.3 MB per request"), "{text}");

    // Each state dtype by its own flag; --ssm-dtype is --mamba-ssm-cache-dtype's other name.
    let bf16_ssm = with(&["--mamba-ssm-cache-dtype", "bf16"]);
    assert_eq!(rank0_request(&bf16_ssm, "ssm_state"), 25_165_824);
    assert_eq!(rank0_request(&bf16_ssm, "conv_state"), conv);
    assert_eq!(
        bf16_ssm["groups"],
        with(&["--ssm-dtype", "bfloat16"])["groups"]
    );
    let fp8_conv = with(&["--mamba-cache-dtype", "fp8"]);
    assert_eq!(rank0_request(&fp8_conv, "conv_state"), conv / 2);
    assert_eq!(
        rank0_request(&fp8_conv, "ssm_state"),
        rank0_request(&plan, "ssm_state")
    );
    assert_eq!(
        with(&["--mamba-cache-dtype", "auto"])["groups"],
        plan["groups"]
    );

    // Qwen3-Next (no Nemotron-H hook): both states in the model's bf16 under an fp8 cache.
    let qwen = json_of(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/qwen3-next-80b-a3b",
        "--dtype",
        "fp8",
        "--json",
    ]);
    assert_eq!(
        part_dtype(&qwen, "full_attention", "kv"),
        (256, "fp8".into())
    );
    assert_eq!(
        part_dtype(&qwen, "conv_state", "v"),
        (128 * 2, "bf16".into())
    );
    assert_eq!(
        part_dtype(&qwen, "recurrent_state", "state"),
        (128 * 128 * 2, "bf16".into())
    );
}

#[test]
fn speculative_tokens_lengthen_the_conv_state_and_nothing_else() {
    let plan = |spec: &str| {
        json_of(&[
            "plan",
            "--config",
            "cli/configs/qwen3-next-80b-a3b",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--num-speculative-tokens",
            spec,
            "--json",
        ])
    };
    let (base, spec) = (plan("0"), plan("2"));
    let kernel = u(&config("qwen3-next-80b-a3b")["linear_conv_kernel_dim"]);
    for (g0, g2) in base["groups"]
        .as_array()
        .unwrap()
        .iter()
        .zip(spec["groups"].as_array().unwrap())
    {
        if g0["name"] == "conv_state" {
            // vLLM's gated_delta_net_state_shape: conv_kernel - 1 + num_spec rows.
            assert_eq!(
                (u(&g0["slot_steps"]), u(&g2["slot_steps"])),
                (kernel - 1, kernel + 1)
            );
            assert_eq!(
                u(&g2["decode_ranks"][0]["bytes_per_request"]) * (kernel - 1),
                u(&g0["decode_ranks"][0]["bytes_per_request"]) * (kernel + 1)
            );
            assert_eq!(g0["parts"], g2["parts"], "a row's bytes do not change");
        } else {
            assert_eq!(g0, g2, "{}", g0["name"]);
        }
    }
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/qwen3-next-80b-a3b",
        "--num-speculative-tokens",
        "2",
    ]);
    // The text wraps its long lines: compare with the whitespace runs as single spaces.
    let text = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        text.contains("one slot per request of 5 time steps (3 + 2 speculative tokens)"),
        "{text}"
    );
    // A model without a conv state says the flag changes nothing.
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/gpt-oss-20b",
        "--num-speculative-tokens",
        "2",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has none"));
    let out = mori_tp(&["plan", "--num-speculative-tokens", "-1"]);
    assert_eq!(out.status.code(), Some(2));
}
