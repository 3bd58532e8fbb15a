//! `pip install .` as a user gets it. In a fresh virtual environment, pip builds the wheel from
//! the repository root (setuptools-rust runs cargo in release mode), installs it with the `numpy`
//! extra, and the Python package's tests run against the installed package from a folder outside
//! the checkout, with neither MORI_TP_LIBRARY nor PYTHONPATH set: the package must load the
//! library it carries. The engine extras must resolve on PyPI.
//!
//! With `--features hip` the wheel is built with MORI_TP_FEATURES=hip, and its library must link
//! libamdhip64. Needs python3 with venv and pip (Debian: python3-venv), readelf, and PyPI (pip
//! fetches setuptools, setuptools-rust and numpy). Without them this test skips, or fails when
//! MORI_TP_REQUIRE_TOOLS is set (CI). About a minute the first time (a release build in
//! `wheel-test` of this test's own target directory, so that passes with other features and
//! target directories, which .ci/run runs side by side, never share one), seconds after.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const VERSION: &str = env!("CARGO_PKG_VERSION");

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `wheel-test` in the target directory this test was built in (`<target>/<profile>/deps` holds
/// the test executable): pip's release build of the wheel's library.
fn wheel_target() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<test>")
        .join("wheel-test")
}

/// target/<profile>/deps/python-wheel, emptied: the environment and the wheel of this run only.
fn scratch() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .expect("target/<profile>/deps")
        .join("python-wheel");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clear the previous run");
    }
    std::fs::create_dir_all(&dir).expect("create the scratch folder");
    dir
}

/// A command with none of the variables that would point Python at the checkout.
fn clean(program: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .env_remove("MORI_TP_LIBRARY")
        .env_remove("PYTHONPATH")
        .env_remove("LD_LIBRARY_PATH")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_NO_INPUT", "1");
    command
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let printed = text(&output);
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{printed}",
        output.status
    );
    printed
}

/// Prints why the test skips, or fails instead under MORI_TP_REQUIRE_TOOLS.
fn skip(why: &str) {
    common::skip_missing("the_wheel", "MORI_TP_REQUIRE_TOOLS", why);
}

/// Whether pip's output says PyPI could not be reached (rather than that the build failed).
fn pypi_unreachable(printed: &str) -> bool {
    [
        "No matching distribution found for setuptools",
        "Failed to establish a new connection",
        "Temporary failure in name resolution",
    ]
    .iter()
    .any(|sign| printed.contains(sign))
}

/// Runs one of the environment's Python programs from `dir` and returns what it printed.
fn python(venv: &Path, dir: &Path, args: &[&str]) -> String {
    run(clean(&venv.join("bin/python")).args(args).current_dir(dir))
}

#[test]
fn pip_install_builds_the_library_into_the_package_and_its_tests_pass_outside_the_checkout() {
    let probe = Command::new("python3")
        .args(["-c", "import ensurepip, venv"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return skip(
            "python3 with the venv and ensurepip modules is missing (Debian: python3-venv)",
        );
    }
    if Command::new("readelf").arg("--version").output().is_err() {
        return skip("readelf is missing (Debian: binutils)");
    }
    let dir = scratch();
    let venv = dir.join("venv");
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv));

    // The wheel `pip install .` builds and installs, kept to look inside.
    let dist = dir.join("dist");
    let mut build = clean(&venv.join("bin/python"));
    build
        .args(["-m", "pip", "wheel", "--no-deps", "--wheel-dir"])
        .arg(&dist)
        .arg(root())
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", wheel_target());
    if cfg!(feature = "hip") {
        build.env("MORI_TP_FEATURES", "hip");
    } else {
        build.env_remove("MORI_TP_FEATURES");
    }
    let output = build.output().expect("run pip wheel");
    if !output.status.success() && pypi_unreachable(&text(&output)) {
        return skip("PyPI cannot be reached, and pip needs it for setuptools-rust");
    }
    assert!(
        output.status.success(),
        "pip wheel failed:\n{}",
        text(&output)
    );
    let wheels: Vec<PathBuf> = std::fs::read_dir(&dist)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(wheels.len(), 1, "{wheels:?}");
    let wheel = &wheels[0];
    let wheel_name = wheel.file_name().unwrap().to_str().unwrap();
    // One wheel for every Python 3: the library does not use Python's C API.
    let prefix = format!("mori_tp-{VERSION}-py3-none-linux_");
    assert!(wheel_name.starts_with(&prefix), "{wheel_name}");

    // The package's files (whatever python/mori_tp holds), the library, the licenses.
    let listing = python(
        &venv,
        &dir,
        &[
            "-c",
            "import sys, zipfile; print('\\n'.join(zipfile.ZipFile(sys.argv[1]).namelist()))",
            wheel.to_str().unwrap(),
        ],
    );
    let in_wheel: BTreeSet<&str> = listing.lines().collect();
    let mut expected = BTreeSet::new();
    package_files(&root().join("python/mori_tp"), "mori_tp/", &mut expected);
    expected.insert("mori_tp/libmori_tp.so".into());
    let dist_info = format!("mori_tp-{VERSION}.dist-info/");
    for license in ["LICENSE-MIT", "LICENSE-APACHE"] {
        expected.insert(format!("{dist_info}licenses/{license}"));
    }
    let missing: Vec<&String> = expected
        .iter()
        .filter(|name| !in_wheel.contains(name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the wheel lacks {missing:?}:\n{listing}"
    );
    let strays: Vec<&&str> = in_wheel
        .iter()
        .filter(|name| !name.starts_with(&dist_info) && !expected.contains(**name))
        .collect();
    assert!(strays.is_empty(), "the wheel also holds {strays:?}");

    // A fresh environment with the numpy extra (from PyPI), and the engine extras resolvable.
    run(clean(&venv.join("bin/python"))
        .args(["-m", "pip", "install", "--quiet"])
        .arg(format!("{}[numpy]", wheel.display()))
        .current_dir(&dir));
    let metadata = python(
        &venv,
        &dir,
        &[
            "-c",
            "from importlib.metadata import metadata; m = metadata('mori-tp'); \
             print(m['Version'], m['License-Expression'], sorted(m.get_all('Provides-Extra')))",
        ],
    );
    assert_eq!(
        metadata.trim(),
        format!("{VERSION} MIT OR Apache-2.0 ['mooncake', 'mooncake-rocm', 'numpy']")
    );
    let engines_python = python(
        &venv,
        &dir,
        &["-c", "import sys; print(sys.version_info >= (3, 10))"],
    );
    if engines_python.trim() == "True" {
        for extra in ["mooncake", "mooncake-rocm"] {
            run(clean(&venv.join("bin/python"))
                .args(["-m", "pip", "install", "--dry-run", "--quiet"])
                .arg(format!("{}[{extra}]", wheel.display()))
                .current_dir(&dir));
        }
    } else {
        eprintln!(
            "the engine extras were not resolved: Mooncake's wheels need Python 3.10 or newer"
        );
    }

    // The package loads the library inside it, not one from the checkout.
    let loaded = python(
        &venv,
        &dir,
        &[
            "-c",
            "import mori_tp, pathlib; print(pathlib.Path(mori_tp.__file__).parent); \
             print(mori_tp.library_path); print(mori_tp.library_version())",
        ],
    );
    let lines: Vec<&str> = loaded.lines().collect();
    let installed = Path::new(lines[0]);
    assert!(
        installed.starts_with(&venv),
        "imported {} instead of the installed package",
        lines[0]
    );
    let library = installed.join("libmori_tp.so");
    assert_eq!(Path::new(lines[1]), library, "{loaded}");
    assert_eq!(lines[2], VERSION);
    let dynamic = run(Command::new("readelf").arg("-d").arg(&library));
    assert!(
        dynamic.contains("Library soname: [libmori_tp.so.1]"),
        "{dynamic}"
    );
    assert_eq!(
        dynamic.contains("libamdhip64"),
        cfg!(feature = "hip"),
        "the wheel's library links libamdhip64 exactly when built with MORI_TP_FEATURES=hip:\n{dynamic}"
    );

    // The Python tests, copied out of the checkout, against the installed package.
    let tests = dir.join("tests");
    std::fs::create_dir_all(&tests).unwrap();
    for entry in std::fs::read_dir(root().join("python/tests")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, tests.join(path.file_name().unwrap())).unwrap();
        }
    }
    let report = python(
        &venv,
        &dir,
        &["-m", "unittest", "discover", "-s", "tests", "-v"],
    );
    // unittest's per-test report, with `cargo test -- --nocapture`.
    println!("{report}");
}

/// Every file the wheel must hold from the package directory `dir`: its `.py` files and
/// `py.typed`, subpackages (`mori_tp/engines/`) included, named as in the wheel.
fn package_files(dir: &Path, prefix: &str, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if path.is_dir() {
            if name != "__pycache__" {
                package_files(&path, &format!("{prefix}{name}/"), out);
            }
        } else if name.ends_with(".py") || name == "py.typed" {
            out.insert(format!("{prefix}{name}"));
        }
    }
}
