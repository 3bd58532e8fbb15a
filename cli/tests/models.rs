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
                               decode_page_size=d["decode_page_size"]))
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
        "prefill_layout": flag("--prefill-layout").unwrap_or("nhd".into()),
        "decode_layout": flag("--decode-layout").unwrap_or("nhd".into()),
        "prefill_page_size": page("prefill"),
        "decode_page_size": page("decode"),
    })
}

#[test]
fn python_and_the_cli_derive_the_same_groups_for_every_shipped_config() {
    let configs = shipped_configs();
    let families: BTreeSet<String> = configs
        .iter()
        .map(|c| {
            json_of(&["plan", "--config", &format!("cli/configs/{c}"), "--json"])["model"]["family"]
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
    let library = built_library();
    let mut compared = 0;
    for name in &configs {
        let path = format!("cli/configs/{name}");
        let args: Vec<Value> = DEPLOYMENTS
            .iter()
            .map(|&(p, d, tokens, flags)| python_args(p, d, tokens, flags))
            .collect();
        let out = Command::new("python3")
            .args(["-c", PYTHON, &path, &Value::Array(args).to_string()])
            .current_dir(repository())
            .env("PYTHONPATH", repository().join("python"))
            .env("MORI_TP_LIBRARY", &library)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "python3 failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let python: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        for (&(p, d, tokens, flags), python) in DEPLOYMENTS.iter().zip(&python) {
            let (p_text, d_text, n_text) = (p.to_string(), d.to_string(), tokens.to_string());
            let mut args = vec![
                "plan",
                "--config",
                &path,
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
            let what = format!("{name} {args:?}");
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
            compared += 1;
        }
    }
    assert!(
        compared >= 3 * configs.len(),
        "only {compared} plans were compared"
    );
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

    // bf16 (the config's torch_dtype) for the conv state and, as no SSM dtype is named, the SSM.
    let (heads, head_dim, groups, state) = (
        field("mamba_num_heads"),
        field("mamba_head_dim"),
        field("n_groups"),
        field("ssm_state_size"),
    );
    assert_eq!(u(&part(conv, "x")["unit_bytes"]), head_dim * 2);
    assert_eq!(u(&part(conv, "B")["unit_bytes"]), state * 2);
    assert_eq!(u(&part(ssm, "state")["unit_bytes"]), head_dim * state * 2);
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
            x * head_dim * state * 2 * mamba.len() as u64
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
    assert!(stderr.contains("names no SSM state dtype") && stderr.contains("--ssm-dtype"));
}

#[test]
fn ssm_dtype_and_the_fp8_latent_change_only_the_bytes_they_name() {
    let base = [
        "plan",
        "--config",
        "cli/configs/qwen3-next-80b-a3b",
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
