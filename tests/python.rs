//! Runs the Python package's tests against the libmori_tp shared library that this `cargo test`
//! just built, so the README's one test command covers the Python binding too:
//! `python/tests` (standard-library unittest), and the two-process transfers through real
//! engines (`python/tests/engine_loopback.py`, Mooncake and NIXL over 127.0.0.1).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The shared library this `cargo test` built. The test binary is
/// `target/<profile>/deps/<name>-<hash>`; cargo test writes the cdylib beside it in `deps/` and
/// copies it up to `target/<profile>/` only on `cargo build`, so `deps/` comes first.
fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let deps_dir = exe.parent().expect("the test binary lives in a folder");
    let name = format!(
        "{}mori_tp{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let in_deps = deps_dir.join(&name);
    match deps_dir.parent() {
        Some(profile_dir) if !in_deps.is_file() => profile_dir.join(&name),
        _ => in_deps,
    }
}

/// `python3 args...` in the crate directory, with the package and the built library.
fn python3(args: &[&str]) -> Command {
    let library = built_library();
    assert!(
        library.is_file(),
        "{} is missing: cargo builds the cdylib with the library target (crate-type \
         \"cdylib\" in Cargo.toml)",
        library.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut command = Command::new("python3");
    command
        .args(args)
        .current_dir(crate_dir)
        .env("MORI_TP_LIBRARY", &library)
        .env("PYTHONPATH", crate_dir.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    command
}

/// Runs `command` to completion, killing it after `limit`; stdout and stderr together.
fn run_bounded(mut command: Command, limit: Duration) -> (Output, String) {
    let mut child = match command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
            "python3 is not installed, and the Python package tests need it \
             (Debian: apt-get install python3)"
        ),
        Err(error) => panic!("cannot run python3: {error}"),
    };
    // Drained on threads: an engine that logs a lot must not block on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for python3") {
            break status;
        }
        if Instant::now() > deadline {
            // Its decode child dies with it (PR_SET_PDEATHSIG).
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} ran past {limit:?} and was killed");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let output = Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, report)
}

#[test]
fn python_package_tests_pass_against_the_library_cargo_built() {
    let command = python3(&["-m", "unittest", "discover", "-s", "python/tests", "-v"]);
    let (output, report) = run_bounded(command, Duration::from_secs(600));
    assert!(
        output.status.success(),
        "the Python tests failed ({}) against {}:\n{report}",
        output.status,
        built_library().display()
    );
    // unittest's per-test report, including skips (numpy), with `cargo test -- --nocapture`.
    println!("{report}");
}

/// Exit status of engine_loopback.py when the engine is not installed (and not required).
const SKIPPED: i32 = 77;

fn engine_moves_every_pair_between_two_processes(engine: &str) {
    let command = python3(&["python/tests/engine_loopback.py", engine]);
    let (output, report) = run_bounded(command, Duration::from_secs(300));
    if output.status.code() == Some(SKIPPED) {
        // The script says why (and itself fails instead when MORI_TP_REQUIRE_TOOLS is set).
        common::skip_missing(
            &format!("{engine}_moves_every_pair_byte_exact_between_two_processes"),
            "MORI_TP_REQUIRE_TOOLS",
            String::from_utf8_lossy(&output.stdout).trim(),
        );
        return;
    }
    assert!(
        output.status.success(),
        "{engine} loopback transfers failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_moves_every_pair_byte_exact_between_two_processes() {
    engine_moves_every_pair_between_two_processes("mooncake");
}

#[test]
fn nixl_moves_every_pair_byte_exact_between_two_processes() {
    engine_moves_every_pair_between_two_processes("nixl");
}
