//! `mori-tp` tried as a new user checking a deployment would: the commands of issue 36, each
//! with what a user expects of it. Numbers are worked out here from the models' figures (the
//! shipped configs and transformers' gpt-oss config), independently of the program.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

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

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited, not killed")
}

/// The text with its wrapped lines joined: every run of whitespace as one space.
fn flat(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn json_of(args: &[&str]) -> Value {
    let out = mori_tp(args);
    assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON value")
}

fn group<'a>(plan: &'a Value, name: &str) -> &'a Value {
    plan["groups"]
        .as_array()
        .expect("the plan has groups")
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no group {name}"))
}

fn u(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("{value} is not a count"))
}

/// 1. `simulate` applies `plan`'s checks: a TP size the engines cannot split a Mamba2 or Gated
///    DeltaNet part by is refused by both, with the same message and exit status 3.
#[test]
fn simulate_refuses_what_plan_refuses_with_the_same_message() {
    for (config, p, d, says) in [
        (
            "cli/configs/nemotron-h-8b-base-8k",
            "16",
            "2",
            "TP 16 does not divide the 8 B groups of conv_state",
        ),
        (
            "cli/configs/qwen3-next-80b-a3b",
            "64",
            "2",
            "TP 64 does not divide the 16 q heads of conv_state",
        ),
    ] {
        let args = |command| {
            vec![
                command,
                "--config",
                config,
                "--prefill-tp",
                p,
                "--decode-tp",
                d,
                "--tokens",
                "4",
            ]
        };
        let plan = mori_tp(&args("plan"));
        let simulate = mori_tp(&args("simulate"));
        assert_eq!((code(&plan), code(&simulate)), (3, 3), "{config}");
        assert!(stderr(&plan).contains(says), "{}", stderr(&plan));
        // The same refusal (plan notes the state dtypes before it; simulate plans no state).
        let error = |out: &Output| {
            stderr(out)
                .lines()
                .skip_while(|l| !l.starts_with("error:"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(error(&simulate), error(&plan));
        assert!(!stdout(&simulate).contains("OK"));
    }
}

/// 3. The gpt-oss-120b preset carries its sliding-window layers (transformers' `GptOssConfig`,
///    whose defaults are gpt-oss-120b's: 36 layers, layer `i` slides over the last 128 tokens
///    when `i` is even), as `--config` of the same model would.
#[test]
fn the_gpt_oss_120b_preset_plans_its_sliding_window_layers() {
    let plan = json_of(&[
        "plan",
        "--model",
        "gpt-oss-120b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "8",
        "--tokens",
        "1000",
        "--json",
    ]);
    assert_eq!(plan["model"]["family"], "sliding_window");
    assert_eq!(u(&plan["model"]["total_layers"]), 36);
    let full = group(&plan, "full_attention");
    let sliding = group(&plan, "sliding_attention");
    let layers =
        |g: &Value| -> Vec<u64> { g["layers"].as_array().unwrap().iter().map(u).collect() };
    assert_eq!(layers(full), (1..36).step_by(2).collect::<Vec<_>>());
    assert_eq!(layers(sliding), (0..36).step_by(2).collect::<Vec<_>>());
    assert_eq!(u(&sliding["window"]), 128);
    // One KV head of 64 bf16 elements per decode rank, K and V, 18 layers each: every token of
    // the full layers, the last 128 of the sliding ones.
    let per_layer_token = 64 * 2 * 2;
    let full_bytes = 18 * per_layer_token * 1000;
    let sliding_bytes = 18 * per_layer_token * 128;
    for d in 0..8 {
        assert_eq!(u(&full["decode_ranks"][d]["bytes_per_request"]), full_bytes);
        assert_eq!(
            u(&sliding["decode_ranks"][d]["bytes_per_request"]),
            sliding_bytes
        );
    }
    // About 5.2 MB a decode rank, not the 9.2 MB of 36 full-attention layers.
    assert_eq!(full_bytes + sliding_bytes, 5_197_824);
    let text = flat(&stdout(&mori_tp(&[
        "plan",
        "--model",
        "gpt-oss-120b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "8",
        "--tokens",
        "1000",
    ])));
    assert!(
        text.contains("18 of 36 layers (the full_attention group"),
        "{text}"
    );
    assert!(
        text.contains("589.8 kB per request (its last 128 tokens)"),
        "{text}"
    );
    // `presets` says which presets are full attention on every layer and which are not.
    let presets = stdout(&mori_tp(&["presets"]));
    let line = |name: &str| {
        presets
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name}"))
            .to_string()
    };
    assert!(
        line("gpt-oss-120b")
            .contains("18 full-attention layers and 18 sliding-window layers of 128 tokens")
    );
    assert!(line("llama-3.1-8b").contains("full attention on every layer"));
    let list: Value = serde_json::from_slice(&mori_tp(&["presets", "--json"]).stdout).unwrap();
    for p in list.as_array().unwrap() {
        let want = if p["name"] == "gpt-oss-120b" {
            Value::from(128)
        } else {
            Value::Null
        };
        assert_eq!(p["sliding_window"], want, "{p}");
    }
}

/// The panels of a multi-panel SVG: (title, subtitle) of each.
fn panels(svg: &str) -> Vec<(String, String)> {
    let doc = roxmltree::Document::parse(svg).expect("well-formed XML");
    let text = |id: String| {
        doc.descendants()
            .find(|n| n.attribute("id") == Some(id.as_str()))
            .and_then(|n| n.text())
            .unwrap_or_default()
            .to_string()
    };
    (0..)
        .map_while(|i| {
            doc.descendants()
                .any(|n| n.attribute("id") == Some(format!("g{i}").as_str()))
                .then(|| (text(format!("g{i}-title")), text(format!("g{i}-subtitle"))))
        })
        .collect()
}

/// 4. A hybrid model's panels name the model and what their units are: DeltaNet and Mamba heads
///    and groups are not KV heads. 10. `--svg -` writes the picture to stdout.
#[test]
fn hybrid_svg_panels_name_the_model_and_their_units_and_svg_dash_is_stdout() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("svg-to-stdout");
    std::fs::create_dir_all(&scratch).unwrap();
    for (config, counts) in [
        ("cli/configs/qwen3-next-80b-a3b", vec![2, 16, 32]),
        ("cli/configs/nemotron-h-8b-base-8k", vec![8, 128]),
    ] {
        // Run where a file named "-" would show.
        let out = Command::new(env!("CARGO_BIN_EXE_mori-tp"))
            .args([
                "plan",
                "--config",
                repository().join(config).to_str().unwrap(),
                "--prefill-tp",
                "2",
                "--decode-tp",
                "4",
                "--svg",
                "-",
            ])
            .current_dir(&scratch)
            .output()
            .unwrap();
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        assert!(!scratch.join("-").exists(), "--svg - wrote a file named -");
        let svg = stdout(&out);
        assert!(svg.starts_with("<svg"), "stdout holds only the picture");
        let got = panels(&svg);
        assert_eq!(got.len(), counts.len(), "{config}");
        for ((title, subtitle), units) in got.iter().zip(&counts) {
            assert!(
                title.starts_with(&format!("{}: ", repository().join(config).display()))
                    || title.contains(config),
                "{title}"
            );
            assert!(
                subtitle.starts_with(&format!("{units} units")),
                "{subtitle}"
            );
            assert!(!subtitle.contains("KV head"), "{subtitle}");
            if !title.contains("full_attention") {
                assert!(!title.contains("kv heads"), "{title}");
            }
        }
        // The panels say what their units are.
        let titles: Vec<&str> = got.iter().map(|(t, _)| t.as_str()).collect();
        let all = titles.join(" | ");
        assert!(all.contains("full_attention kv heads"), "{all}");
        assert!(
            all.contains("conv_state q heads") || all.contains("conv_state x heads"),
            "{all}"
        );
    }
    // With --json, stdout is taken: refused.
    let out = mori_tp(&[
        "plan",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--json",
        "--svg",
        "-",
    ]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("--svg -"), "{}", stderr(&out));
}

/// Runs `mori-tp args` with its stdout and/or stderr a pipe whose reading end is closed before
/// it writes, and returns its exit status.
fn with_closed(args: &[&str], close_stdout: bool, close_stderr: bool) -> i32 {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mori-tp"))
        .args(args)
        .current_dir(repository())
        .stdout(if close_stdout {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(if close_stderr {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .spawn()
        .unwrap();
    // Dropping the reading ends closes them: every write the program makes then fails (EPIPE;
    // Rust programs ignore SIGPIPE).
    drop(child.stdout.take());
    drop(child.stderr.take());
    child
        .wait()
        .unwrap()
        .code()
        .expect("exited, not killed by a signal")
}

/// 5. A closed stderr or stdout never panics (exit 101): the documented status comes back.
#[test]
fn a_closed_stdout_or_stderr_keeps_the_documented_exit_status() {
    let bad = [
        "plan",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "3",
        "--decode-tp",
        "8",
    ];
    let mut bad_json = bad.to_vec();
    bad_json.push("--json");
    let good = [
        "plan",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
    ];
    for _ in 0..5 {
        assert_eq!(with_closed(&bad, false, true), 3, "closed stderr");
        assert_eq!(with_closed(&bad_json, true, false), 3, "closed stdout");
        assert_eq!(with_closed(&bad_json, true, true), 3, "both closed");
        // Notes go to stderr; the plan itself is fine.
        assert_eq!(
            with_closed(
                &[
                    "plan",
                    "--prefill-tp",
                    "2",
                    "--decode-tp",
                    "8",
                    "--config",
                    "cli/configs/nemotron-h-8b-base-8k"
                ],
                false,
                true
            ),
            0
        );
        assert_eq!(with_closed(&good, true, true), 0);
        // Usage errors, from the argument parser and after it.
        assert_eq!(with_closed(&["plan", "--prefill-tp", "-2"], true, true), 2);
        assert_eq!(
            with_closed(&["plan", "--json", "--prefill-tp", "-2"], true, true),
            2
        );
        assert_eq!(
            with_closed(
                &[
                    "plan",
                    "--prefill-tp",
                    "2",
                    "--decode-tp",
                    "8",
                    "--config",
                    "/no/such"
                ],
                false,
                true
            ),
            2
        );
    }
    // A closed stdout still reads what it is given up to then: `| head` sees the start.
    let mut child = Command::new(env!("CARGO_BIN_EXE_mori-tp"))
        .args(bad_json)
        .current_dir(repository())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut head = [0u8; 16];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    drop(child.stdout.take());
    assert_eq!(child.wait().unwrap().code(), Some(3));
    assert!(String::from_utf8_lossy(&head).starts_with('{'));
}

/// 6. Page layouts in any case, as vLLM prints them (HND) and as mori-tp prints them.
#[test]
fn page_layouts_are_taken_in_any_case() {
    let plan = |layout: &str| {
        json_of(&[
            "plan",
            "--model",
            "qwen2.5-7b",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--prefill-layout",
            layout,
            "--decode-layout",
            layout,
            "--page-size",
            "16",
            "--json",
        ])
    };
    let lower = plan("hnd");
    assert_eq!(lower["prefill_layout"], "hnd");
    for spelling in ["HND", "Hnd"] {
        assert_eq!(plan(spelling), lower, "{spelling}");
    }
    assert_eq!(plan("NHD")["decode_layout"], "nhd");
    let out = mori_tp(&["plan", "--prefill-layout", "HDN"]);
    assert_eq!(code(&out), 2);
}

/// 7. `simulate` of a hybrid model says what it moves, and blames the page size when the pages
///    are what does not fit.
#[test]
fn hybrid_simulate_says_what_it_moves_and_blames_the_right_flag() {
    let out = mori_tp(&[
        "simulate",
        "--config",
        "cli/configs/nemotron-h-8b-base-8k",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "4",
        "--tokens",
        "8",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = flat(&stdout(&out));
    assert!(!text.contains("all groups below"), "{text}");
    assert!(
        text.contains("`plan` lists every group, this simulation moves this one"),
        "{text}"
    );
    assert!(text.ends_with("OK"));
    assert!(stderr(&out).contains("`plan` lists every group"));

    let out = mori_tp(&[
        "simulate",
        "--model",
        "qwen2.5-7b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--page-size",
        "100000000",
        "--tokens",
        "10",
    ]);
    assert_eq!(code(&out), 2);
    let message = flat(&stderr(&out));
    assert!(message.contains("the page size is the cause"), "{message}");
    assert!(
        message.contains("prefill pages of 100,000,000 tokens"),
        "{message}"
    );
    assert!(message.contains("--page-size"), "{message}");
    assert!(!message.contains("lower --tokens"), "{message}");
    // Where the request itself is too large, the request is what is named.
    let out = mori_tp(&[
        "simulate",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--model",
        "llama-3.1-70b",
        "--tokens",
        "4000000000",
    ]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("lower --tokens"), "{}", stderr(&out));
}

/// 8. A hybrid group's replicas that skip are condensed as the main plan condenses them, so the
///    output grows with the decode ranks, not with P x D.
#[test]
fn skipping_replicas_of_a_group_are_condensed_in_text_and_json() {
    let (p, d) = (256u64, 256u64);
    let (p_text, d_text) = (p.to_string(), d.to_string());
    let args = [
        "plan",
        "--config",
        "cli/configs/deepseek-v3.2",
        "--prefill-tp",
        &p_text,
        "--decode-tp",
        &d_text,
        "--tokens",
        "10",
    ];
    let out = mori_tp(&args);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    let groups = &text[text.find("\ngroups:").expect("the groups follow the plan")..];
    // Per decode rank of the indexer: its heading, one sender, at most two runs of replicas,
    // what it receives.
    assert!(
        groups.lines().count() < 5 * d as usize + 20,
        "{} lines",
        groups.lines().count()
    );
    assert!(
        groups.contains(
            "  decode rank 0, index_k record 0:\n    prefill rank 0 sends index_k record 0"
        )
    );
    assert!(groups.contains(
        "    prefill ranks 1-255 skip index_k record 0 (replicas: prefill rank 0 sends it)"
    ));
    assert!(groups.contains(
        "    prefill rank 0 skips index_k record 0 (replica: prefill rank 1 sends it)\n    \
         prefill ranks 2-255 skip index_k record 0 (replicas: prefill rank 1 sends it)"
    ));
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let plan = json_of(&json_args);
    let indexer = group(&plan, "indexer");
    let pairs = indexer["pairs"].as_array().unwrap();
    assert_eq!(pairs.len() as u64, d, "one sending pair per decode rank");
    for (rank, pair) in pairs.iter().enumerate() {
        assert_eq!(u(&pair["prefill_rank"]), rank as u64);
    }
    // The first and the last decode rank's replicas are one run, every other rank's two (before
    // and after its sender), each naming the sender.
    let replicas = indexer["replicas"].as_array().unwrap();
    assert_eq!(replicas.len() as u64, 2 * d - 2);
    let mut covered = vec![0u64; d as usize];
    for run in replicas {
        let rank = u(&run["decode_rank"]);
        let (first, end) = (u(&run["prefill_ranks"][0]), u(&run["prefill_ranks"][1]));
        assert!(first < end && !(first..end).contains(&rank));
        assert_eq!(u(&run["parts"][0]["sent_by"]), rank);
        covered[rank as usize] += end - first;
    }
    assert!(covered.iter().all(|&n| n == p - 1));
}

/// 9. Unknown models get the configs mori-tp ships as tips, and a model name given to --config
///    gets --model.
#[test]
fn unknown_model_tips_name_the_shipped_configs_and_presets() {
    for (typed, config) in [
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"),
        ("deepseek-ai/DeepSeek-V3.2", "deepseek-v3.2"),
        ("nvidia/Nemotron-H-8B-Base-8K", "nemotron-h-8b-base-8k"),
        ("openai/gpt-oss-20b", "gpt-oss-20b"),
    ] {
        let out = mori_tp(&[
            "plan",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--model",
            typed,
        ]);
        assert_eq!(code(&out), 2, "{typed}");
        let message = flat(&stderr(&out));
        assert!(
            message.contains(&format!("--config cli/configs/{config}")),
            "{typed}: {message}"
        );
        // The tip is the config, not a preset of another shape.
        assert!(!message.contains("Closest:"), "{typed}: {message}");
        // And the tip works.
        let tip = mori_tp(&[
            "plan",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
            "--config",
            &format!("cli/configs/{config}"),
        ]);
        assert_eq!(code(&tip), 0, "{config}");
    }
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "meta-llama/Llama-3.1-8B-Instruct",
    ]);
    assert_eq!(code(&out), 2);
    let message = flat(&stderr(&out));
    assert!(message.contains("--model llama-3.1-8b"), "{message}");
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
    ]);
    assert!(flat(&stderr(&out)).contains("--config cli/configs/qwen3-next-80b-a3b"));
    // The list of shipped configs the tips use is the directory's.
    let presets = stdout(&mori_tp(&["presets"]));
    let listed: Vec<String> = presets
        .lines()
        .filter_map(|l| l.trim().strip_prefix("cli/configs/"))
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    let mut dirs: Vec<String> = std::fs::read_dir(repository().join("cli/configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    dirs.sort();
    assert_eq!(listed, dirs);
}

/// 11. `--mla` with a model that knows its attention gives advice that works.
#[test]
fn mla_advice_works_when_followed() {
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--model",
        "llama-3.1-8b",
        "--mla",
    ]);
    assert_eq!(code(&out), 2);
    let message = flat(&stderr(&out));
    assert!(message.contains("leave out --mla"), "{message}");
    assert!(!message.contains("required"), "{message}");
    let followed = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--model",
        "llama-3.1-8b",
    ]);
    assert_eq!(code(&followed), 0);
    let out = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--config",
        "cli/configs/deepseek-v3.2",
        "--mla",
    ]);
    assert_eq!(code(&out), 2);
    assert!(flat(&stderr(&out)).contains("leave out --mla"));
    // Alone, it says what to add; adding it works.
    let out = mori_tp(&["plan", "--mla"]);
    assert_eq!(code(&out), 2);
    let message = flat(&stderr(&out));
    assert!(
        message.contains("--kv-heads 1") && message.contains("--head-dim"),
        "{message}"
    );
    let followed = mori_tp(&[
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--mla",
        "--kv-heads",
        "1",
        "--head-dim",
        "576",
        "--layers",
        "61",
    ]);
    assert_eq!(code(&followed), 0, "{}", stderr(&followed));
}

// ---- what a new user following the README tripped on ------------------------------------------

/// `plan` and `simulate` check the deployment they are told about: a missing model or TP size is
/// refused (status 2, nothing on stdout, the missing flags named) instead of filled in from a
/// default (it once planned decode TP 8 for `--prefill-tp 2` alone, and qwen2.5-7b without a
/// model). `mori-tp` without a command still simulates its example and says which it is.
#[test]
fn the_model_and_both_tp_sizes_are_required() {
    for command in ["plan", "simulate"] {
        for (args, named, not_named) in [
            (
                vec!["--model", "llama-3.1-8b", "--prefill-tp", "2"],
                vec!["--decode-tp D"],
                vec!["--model NAME", "--prefill-tp P"],
            ),
            (
                vec!["--prefill-tp", "2", "--decode-tp", "8"],
                vec!["--model NAME", "--config PATH", "--kv-heads N"],
                vec!["--prefill-tp P", "--decode-tp D"],
            ),
            (
                vec!["--config", "cli/configs/llama-3.1-8b", "--decode-tp", "8"],
                vec!["--prefill-tp P"],
                vec!["--model NAME", "--decode-tp D"],
            ),
            (
                vec![],
                vec!["--model NAME", "--prefill-tp P", "--decode-tp D"],
                vec![],
            ),
        ] {
            let mut all = vec![command];
            all.extend(&args);
            let out = mori_tp(&all);
            let err = flat(&stderr(&out));
            assert_eq!(code(&out), 2, "{all:?}: {err}");
            assert!(stdout(&out).is_empty(), "{all:?}: {}", stdout(&out));
            assert!(err.contains("assumes no model and no TP size"), "{err}");
            for flag in named {
                assert!(err.contains(flag), "{all:?} must name {flag}: {err}");
            }
            for flag in not_named {
                assert!(
                    !err.contains(flag),
                    "{all:?} names {flag}, which was given: {err}"
                );
            }
        }
    }
    // With --json the refusal is the documented JSON error.
    let out = mori_tp(&[
        "plan",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "2",
    ]);
    assert_eq!(code(&out), 2);
    let error: Value = serde_json::from_slice(&out.stdout).expect("a JSON error");
    assert_eq!(error["error"]["kind"], "usage");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--decode-tp"),
        "{error}"
    );
    // Given in full, the same deployment plans as asked: decode TP 2, not a default.
    let plan = json_of(&[
        "plan",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "2",
    ]);
    assert_eq!(
        (plan["prefill_tp"].clone(), plan["decode_tp"].clone()),
        (8.into(), 2.into())
    );
    // The example `mori-tp` runs (`cargo run --release`) names its deployment first.
    let out = mori_tp(&["--help"]);
    assert!(
        flat(&stdout(&out)).contains(
            "need the model (--model, --config or --kv-heads with --head-dim) and both TP sizes"
        ),
        "{}",
        stdout(&out)
    );
}

#[test]
fn the_bare_command_simulates_its_named_example_and_says_what_it_verified() {
    let out = mori_tp(&[]);
    let text = stdout(&out);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        text.starts_with(
            "Simulating one request of qwen2.5-7b from prefill TP 2 to decode TP 8, in host memory"
        ),
        "{text}"
    );
    // It checks every decode byte of the layers it simulates, and says that those are 4 of the
    // model's 28 (qwen2.5-7b's num_hidden_layers), not all of them.
    let flat = flat(&text);
    assert!(
        flat.contains("decode bytes of the 4 simulated layers (4 of 28: every layer moves the same way; --layers-limit 28 for all)"),
        "{flat}"
    );
}

/// Both page-layout flags say what each value is and which engine keeps it, and neither says
/// something the values contradict (the prefill one said "vLLM writes HND" above a list that
/// gives vLLM's FlashAttention layout as nhd, the default).
#[test]
fn the_page_layout_help_names_both_values_without_contradicting_them() {
    let help = stdout(&mori_tp(&["plan", "--help"]));
    for flag in ["--prefill-layout <LAYOUT>", "--decode-layout <LAYOUT>"] {
        let at = help
            .find(flag)
            .unwrap_or_else(|| panic!("{flag} in {help}"));
        let rest = &help[at + flag.len()..];
        let entry = flat(&rest[..rest.find("\n      --").unwrap_or(rest.len())]);
        for needed in [
            "nhd or hnd",
            "- nhd: Token-major",
            "- hnd: Head-major",
            "[default: nhd]",
        ] {
            assert!(entry.contains(needed), "{flag}: {needed:?} in {entry}");
        }
        assert!(!entry.contains("vLLM writes HND"), "{flag}: {entry}");
    }
    let prefill = flat(&help[help.find("--prefill-layout <LAYOUT>").unwrap()..]);
    assert!(
        prefill.contains("vLLM: nhd with FlashAttention on CUDA, hnd with NIXL and on ROCm"),
        "{prefill}"
    );
}

/// A `--config` path in the wrong case names the existing one (the shipped directory), instead
/// of advising a preset.
#[test]
fn a_wrong_case_config_path_points_to_the_shipped_directory() {
    for (typed, meant) in [
        ("cli/configs/Llama-3.1-8B", "cli/configs/llama-3.1-8b"),
        (
            "CLI/Configs/LLAMA-3.1-8B/Config.json",
            "cli/configs/llama-3.1-8b/config.json",
        ),
        (
            "cli/configs/Qwen3-Next-80B-A3B",
            "cli/configs/qwen3-next-80b-a3b",
        ),
    ] {
        let out = mori_tp(&[
            "plan",
            "--config",
            typed,
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
        ]);
        let err = flat(&stderr(&out));
        assert_eq!(code(&out), 2, "{typed}: {err}");
        assert!(
            err.contains(&format!(
                "{meant} exists: paths are case-sensitive, so give --config {meant} (the config \
                 mori-tp ships)"
            )),
            "{typed}: {err}"
        );
        // Followed, the advice works.
        json_of(&[
            "plan",
            "--json",
            "--config",
            meant,
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
        ]);
    }
    // A path that matches nothing in any case still gets the general advice.
    let err = flat(&stderr(&mori_tp(&[
        "plan",
        "--config",
        "cli/configs/no-such-model",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
    ])));
    assert!(!err.contains("exists"), "{err}");
}

/// Only the TP sizes are capped (at 1024); a page size is any whole number, so the help and the
/// documents say so and plan takes one past 1024.
#[test]
fn only_the_tp_sizes_are_capped_at_1024() {
    let help = flat(&stdout(&mori_tp(&["plan", "--help"])));
    assert!(help.contains("--prefill-tp <P> Tensor-parallel size of the prefill engine (the sender), 1 to 1024 (required)"), "{help}");
    assert!(
        help.contains("--page-size <TOKENS> Tokens per KV-cache page, both engines [default: 1]"),
        "{help}"
    );
    let plan = json_of(&[
        "plan",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "8",
        "--page-size",
        "4096",
        "--tokens",
        "10000",
    ]);
    assert_eq!(plan["prefill_page_size"], 4096);
    assert_eq!(plan["prefill_pages"], 3);
    let out = mori_tp(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--prefill-tp",
        "1025",
        "--decode-tp",
        "8",
    ]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("from 1 to 1024"), "{}", stderr(&out));
}
