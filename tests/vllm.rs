//! The vLLM connector (`mori_tp.vllm`, REFERENCE.md "mori-tp in vLLM") against vLLM 0.34.0's
//! real code, in the venv that `.ci/vllm-venv` makes (about 7 GB, outside the checkout):
//! `python/tests/vllm/vllm_scheduler.py` (the scheduler lifecycle), `vllm_transfer.py` (two
//! processes moving a request's KV byte-exact over Mooncake and NIXL on 127.0.0.1, TP
//! mismatches and replicas included) and `vllm_tp_mapping.py` (mori-tp's plans against vLLM's
//! `compute_tp_mapping` and `compute_write_tp_mapping`).
//!
//! The venv is `MORI_TP_VLLM_VENV`, default `/var/cache/mori-tp/venv-vllm-0.34.0`; it counts
//! once the script's marker file is there. Without it each test skips, saying so; with
//! `MORI_TP_REQUIRE_TOOLS=1` (CI) a missing venv fails. One command runs them all:
//! `.ci/vllm-venv && cargo test --test vllm`. With the `hip` or `cuda` feature they skip: the
//! connector uses the host backend, which those features leave as it is.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// One script at a time: each imports vLLM and torch, and the transfers start a second
/// process and up to eight engines; side by side on two cores they would only slow each other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Exit status of the scripts when vLLM or an engine is missing.
const SKIPPED: i32 = 77;

fn venv() -> PathBuf {
    std::env::var_os("MORI_TP_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/mori-tp/venv-vllm-0.34.0"))
}

/// The venv's python, or None after skipping `test` (failing it under MORI_TP_REQUIRE_TOOLS).
fn venv_python(test: &str) -> Option<PathBuf> {
    let venv = venv();
    let python = venv.join("bin/python");
    if venv.join(".mori-tp-complete").is_file() && python.is_file() {
        return Some(python);
    }
    common::skip_missing(
        test,
        "MORI_TP_REQUIRE_TOOLS",
        &format!(
            "no complete vLLM 0.34.0 venv at {} (make it with .ci/vllm-venv, or set \
             MORI_TP_VLLM_VENV)",
            venv.display()
        ),
    );
    None
}

fn run_script(test: &str, args: &[&str], limit: Duration) {
    if cfg!(any(feature = "hip", feature = "cuda")) {
        // The connector moves host memory with the host backend: a GPU feature changes nothing
        // these tests reach, and .ci/run's feature passes would only run them again.
        common::skip(
            test,
            "runs in the pass without GPU features (.ci/run's cargo test)",
        );
        return;
    }
    let Some(python) = venv_python(test) else {
        return;
    };
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let root = common::root();
    let mut command = Command::new(python);
    command
        .args(args)
        .current_dir(root)
        .env("MORI_TP_LIBRARY", common::built_library())
        .env("PYTHONPATH", root.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let (output, report) = common::run_bounded(command, limit);
    if output.status.code() == Some(SKIPPED) {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_TOOLS",
            String::from_utf8_lossy(&output.stdout).trim(),
        );
        return;
    }
    assert!(
        output.status.success(),
        "{args:?} failed ({}):\n{report}",
        output.status
    );
    // The scripts' "ok:" lines, with `cargo test -- --nocapture`.
    for line in report.lines().filter(|l| l.starts_with("ok:")) {
        println!("{line}");
    }
}

#[test]
fn vllm_scheduler_runs_the_connector_through_a_requests_life() {
    run_script(
        "vllm_scheduler_runs_the_connector_through_a_requests_life",
        &["python/tests/vllm/vllm_scheduler.py"],
        Duration::from_secs(300),
    );
}

#[test]
fn vllm_connector_moves_kv_byte_exact_over_mooncake_between_two_processes() {
    run_script(
        "vllm_connector_moves_kv_byte_exact_over_mooncake_between_two_processes",
        &["python/tests/vllm/vllm_transfer.py", "mooncake"],
        Duration::from_secs(600),
    );
}

#[test]
fn vllm_connector_moves_kv_byte_exact_over_nixl_between_two_processes() {
    run_script(
        "vllm_connector_moves_kv_byte_exact_over_nixl_between_two_processes",
        &["python/tests/vllm/vllm_transfer.py", "nixl"],
        Duration::from_secs(600),
    );
}

#[test]
fn mori_tp_plans_equal_vllms_own_tp_mappings() {
    run_script(
        "mori_tp_plans_equal_vllms_own_tp_mappings",
        &["python/tests/vllm/vllm_tp_mapping.py"],
        Duration::from_secs(300),
    );
}
