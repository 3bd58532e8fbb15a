//! What a packager relies on: the shared library's SONAME is its ABI version, and the header's
//! version macros are the crate's version, the one mori_tp_version() reports. And what a new user
//! relies on: running the README's example compiles no dev-dependency.

mod common;

use std::ffi::CStr;
use std::path::PathBuf;
use std::process::Command;

use mori_tp::ffi::{
    MORI_TP_ABI_VERSION, MORI_TP_VERSION_MAJOR, MORI_TP_VERSION_MINOR, MORI_TP_VERSION_PATCH,
    mori_tp_abi_version, mori_tp_version,
};

/// The libmori_tp.so of this test run: beside the test binary in target/<profile>/deps, or one
/// level up after a `cargo build`.
fn built_shared_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps");
    [deps, deps.parent().expect("target/<profile>")]
        .iter()
        .map(|dir| dir.join("libmori_tp.so"))
        .find(|path| path.is_file())
        .expect("cargo builds libmori_tp.so with the library (crate-type cdylib)")
}

#[test]
fn the_shared_library_is_named_by_its_abi_version() {
    let library = built_shared_library();
    let output = match Command::new("readelf").arg("-d").arg(&library).output() {
        Ok(output) => output,
        Err(error) => {
            common::skip_missing(
                "the_shared_library_is_named_by_its_abi_version",
                "MORI_TP_REQUIRE_TOOLS",
                &format!("readelf (Debian: binutils) cannot run: {error}"),
            );
            return;
        }
    };
    assert!(output.status.success(), "readelf -d {}", library.display());
    let dynamic = String::from_utf8_lossy(&output.stdout);
    let sonames: Vec<&str> = dynamic
        .lines()
        .filter(|line| line.contains("(SONAME)"))
        .collect();
    assert_eq!(
        sonames.len(),
        1,
        "{} must have one SONAME:\n{dynamic}",
        library.display()
    );
    let expected = format!("Library soname: [libmori_tp.so.{}]", mori_tp_abi_version());
    assert!(sonames[0].ends_with(&expected), "{}", sonames[0]);
    assert_eq!(mori_tp_abi_version(), MORI_TP_ABI_VERSION);
}

#[test]
fn the_header_version_macros_are_the_crate_version_that_mori_version_reports() {
    let parse = |part: &str| part.parse::<u32>().expect("numeric version part");
    assert_eq!(
        (
            MORI_TP_VERSION_MAJOR,
            MORI_TP_VERSION_MINOR,
            MORI_TP_VERSION_PATCH
        ),
        (
            parse(env!("CARGO_PKG_VERSION_MAJOR")),
            parse(env!("CARGO_PKG_VERSION_MINOR")),
            parse(env!("CARGO_PKG_VERSION_PATCH"))
        ),
        "update MORI_TP_VERSION_* in src/ffi/types.rs to Cargo.toml's version, then regenerate the \
         header (MORI_TP_UPDATE_HEADER=1 cargo test --test header)"
    );
    // SAFETY: mori_tp_version returns a static NUL-terminated string.
    let reported = unsafe { CStr::from_ptr(mori_tp_version()) };
    assert_eq!(
        reported.to_str().unwrap(),
        format!("{MORI_TP_VERSION_MAJOR}.{MORI_TP_VERSION_MINOR}.{MORI_TP_VERSION_PATCH}")
    );
}

/// `cargo run --example simulate` compiles the dev-dependencies of the package that owns the
/// example, and finds it only in a default workspace member. The README offers the example as
/// the light way to see the Rust API, so its package must have none (the root's are cbindgen and
/// criterion).
#[test]
fn the_readme_example_runs_from_the_root_without_compiling_dev_dependencies() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let owners: Vec<&serde_json::Value> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|package| {
            package["targets"].as_array().unwrap().iter().any(|target| {
                target["name"] == "simulate"
                    && target["kind"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k == "example")
            })
        })
        .collect();
    assert_eq!(
        owners.len(),
        1,
        "exactly one package has the example simulate"
    );
    let owner = owners[0];
    let defaults = metadata["workspace_default_members"]
        .as_array()
        .expect("workspace_default_members");
    assert!(
        defaults.contains(&owner["id"]),
        "{} must be a default member for `cargo run --example simulate` at the root",
        owner["name"]
    );
    let dev: Vec<&serde_json::Value> = owner["dependencies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|dependency| dependency["kind"] == "dev")
        .map(|dependency| &dependency["name"])
        .collect();
    assert!(
        dev.is_empty(),
        "{} has dev-dependencies {dev:?}, which `cargo run --example simulate` compiles",
        owner["name"]
    );
}
