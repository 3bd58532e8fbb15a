//! SGLang's mori disaggregation backend, its real code, with and without the `mori_tp.sglang`
//! plugin: `python/tests/sglang_mori.py`, run with the Python of the SGLang 0.5.23 venv that
//! `.ci/sglang-venv` makes (REFERENCE.md, "SGLang's mori backend"). Without the venv the test
//! skips, saying so; with `MORI_TP_REQUIRE_TOOLS=1` (CI) a missing venv fails it.

mod common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Exit status of sglang_mori.py when SGLang is not importable.
const SKIPPED: i32 = 77;

/// The venv: `MORI_TP_SGLANG_VENV`, else `.ci/sglang-venv`'s default.
fn venv() -> PathBuf {
    std::env::var_os("MORI_TP_SGLANG_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/mori-tp/venv-sglang-0.5.23"))
}

/// The shared library this `cargo test` built (as tests/python.rs finds it).
fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let name = format!(
        "{}mori_tp{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    match deps.parent() {
        Some(profile) if !deps.join(&name).is_file() => profile.join(&name),
        _ => deps.join(&name),
    }
}

#[test]
fn sglang_mori_backend_with_the_plugin_refuses_or_moves_every_byte_once_on_138_layouts() {
    let test =
        "sglang_mori_backend_with_the_plugin_refuses_or_moves_every_byte_once_on_138_layouts";
    let venv = venv();
    let python = venv.join("bin/python");
    if !venv.join(".mori-tp-complete").is_file() || !python.is_file() {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_TOOLS",
            &format!(
                "no complete SGLang venv at {} (make it with .ci/sglang-venv, about 7 min and \
                 11 GB; MORI_TP_SGLANG_VENV names another)",
                venv.display()
            ),
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Into a file, not a pipe: a full pipe would stall the script until the limit.
    let log_path = common::scratch(&["sglang"]).join("sglang_mori.log");
    let log = File::create(&log_path).expect("create the script's log");
    let mut child = Command::new(&python)
        .arg("python/tests/sglang_mori.py")
        .current_dir(root)
        .env("PYTHONPATH", root.join("python"))
        .env("MORI_TP_LIBRARY", built_library())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("clone the log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let limit = Duration::from_secs(300);
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for python") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("python/tests/sglang_mori.py ran past {limit:?} and was killed");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let report = std::fs::read_to_string(&log_path).expect("read the script's log");
    if status.code() == Some(SKIPPED) {
        common::skip_missing(test, "MORI_TP_REQUIRE_TOOLS", report.trim());
        return;
    }
    assert!(
        status.success(),
        "python/tests/sglang_mori.py failed ({status}):\n{report}"
    );
    assert!(
        report.contains(" passed, 0 failed"),
        "no summary line:\n{report}"
    );
    println!("{report}");
}
