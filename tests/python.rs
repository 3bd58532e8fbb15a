//! Runs the Python package's tests (`python/tests`, standard-library unittest) against the
//! libmori_tp shared library that this `cargo test` just built, so the README's one test command
//! covers the Python binding too.

use std::path::{Path, PathBuf};
use std::process::Command;

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

#[test]
fn python_package_tests_pass_against_the_library_cargo_built() {
    let library = built_library();
    assert!(
        library.is_file(),
        "{} is missing: cargo builds the cdylib with the library target (crate-type \
         \"cdylib\" in Cargo.toml)",
        library.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s", "python/tests", "-v"])
        .current_dir(crate_dir)
        .env("MORI_TP_LIBRARY", &library)
        .env("PYTHONPATH", crate_dir.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output();
    let output = match output {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
            "python3 is not installed, and the Python package tests need it \
             (Debian: apt-get install python3)"
        ),
        Err(error) => panic!("cannot run python3: {error}"),
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "the Python tests failed ({}) against {}:\n{report}",
        output.status,
        library.display()
    );
    // unittest's per-test report, including skips (numpy), with `cargo test -- --nocapture`.
    println!("{report}");
}
