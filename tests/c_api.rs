//! The header and the libraries from C and C++: the header compiles alone as C99 and C++17 with
//! every warning an error; tests/c/abi_test.c and abi_test.cpp link the static and the shared
//! library with the README's flags, also under AddressSanitizer; and the static library carries
//! no code of the CLI's or the tests' dependencies. (tests/install.rs links the installed
//! package through CMake and pkg-config.)
//!
//! Needs `cc` and `c++` (gcc/g++ or clang).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{STATIC_LIBS, hip_link, root, run, scratch};

use mori_tp::ffi::MORI_TP_ABI_VERSION;

/// How the README links the shared library.
const SHARED_LINK: &str = "-lmori_tp -Wl,-rpath,";
const STRICT: &[&str] = &["-Wall", "-Wextra", "-Werror", "-pedantic"];

/// Where cargo put libmori_tp.a and libmori_tp.so for this test run: `cargo test` leaves them in
/// target/<profile>/deps (next to this test binary); `cargo build` also copies them one level up.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let candidates = [deps, deps.parent().expect("target/<profile>")];
    candidates
        .iter()
        .find(|dir| dir.join("libmori_tp.a").is_file() && dir.join("libmori_tp.so").is_file())
        .unwrap_or_else(|| {
            panic!("cargo built no libmori_tp.a and libmori_tp.so in {candidates:?}")
        })
        .to_path_buf()
}

fn out_dir(name: &str) -> PathBuf {
    scratch(&["c-tests", name])
}

/// Compiles `source` into `exe` with `compiler`, the strict flags and `extra` arguments.
fn compile(compiler: &str, std: &str, source: &str, exe: &Path, extra: &[String]) {
    let mut command = Command::new(compiler);
    command
        .arg(format!("-std={std}"))
        .args(STRICT)
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join("tests/c").join(source))
        .args(extra)
        .arg("-o")
        .arg(exe);
    run(&mut command);
}

fn static_link() -> Vec<String> {
    let mut args = vec![lib_dir().join("libmori_tp.a").display().to_string()];
    args.extend(STATIC_LIBS.split(' ').map(String::from));
    args.extend(hip_link());
    args
}

/// A folder laid out like an installed library folder, with links to the shared library this
/// test run built: `libmori_tp.so` (what `-lmori_tp` finds) and `libmori_tp.so.1` (its SONAME,
/// the name a linked program asks the loader for). cargo's output folder has only the first.
fn shared_lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = out_dir("shared-lib");
        let library = lib_dir().join("libmori_tp.so");
        let soname = format!("libmori_tp.so.{MORI_TP_ABI_VERSION}");
        for name in ["libmori_tp.so", soname.as_str()] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&library, &link).unwrap_or_else(|e| {
                panic!(
                    "cannot link {} to {}: {e}",
                    link.display(),
                    library.display()
                )
            });
        }
        dir
    })
}

fn shared_link() -> Vec<String> {
    let dir = shared_lib_dir().display().to_string();
    let mut args = vec![
        format!("-L{dir}"),
        "-lmori_tp".into(),
        format!("-Wl,-rpath,{dir}"),
    ];
    args.extend(hip_link());
    args
}

fn asan() -> Vec<String> {
    vec![
        "-fsanitize=address".into(),
        "-fno-omit-frame-pointer".into(),
        "-g".into(),
    ]
}

fn run_program(exe: &Path, expected: &str) {
    let output = run(Command::new(exe).env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1"));
    assert!(
        output.contains(expected),
        "{} printed:\n{output}",
        exe.display()
    );
}

#[test]
fn the_header_compiles_alone_as_c99_and_as_cpp17() {
    let dir = out_dir("header");
    compile(
        "cc",
        "c99",
        "header_alone.c",
        &dir.join("alone_c"),
        &["-c".into()],
    );
    compile(
        "c++",
        "c++17",
        "header_alone.c",
        &dir.join("alone_cpp"),
        &["-x".into(), "c++".into(), "-c".into()],
    );
}

/// Builds `source` linked statically, dynamically and statically under AddressSanitizer, and runs
/// each build.
fn build_and_run_three_ways(compiler: &str, std: &str, source: &str) {
    let dir = out_dir(source);
    let expected = format!("{source}: all checks passed");
    let mut asan_link = static_link();
    asan_link.extend(asan());
    for (name, link) in [
        ("static", static_link()),
        ("shared", shared_link()),
        ("asan", asan_link),
    ] {
        let exe = dir.join(format!("abi_test_{name}"));
        compile(compiler, std, source, &exe, &link);
        run_program(&exe, &expected);
    }
}

#[test]
fn the_c_program_passes_linked_static_shared_and_under_asan() {
    build_and_run_three_ways("cc", "c99", "abi_test.c");
}

#[test]
fn the_cpp_program_passes_linked_static_shared_and_under_asan() {
    build_and_run_three_ways("c++", "c++17", "abi_test.cpp");
}

#[test]
fn the_readme_shows_the_linking_that_these_tests_run() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    assert!(
        readme.contains(STATIC_LIBS),
        "README must list the static link flags {STATIC_LIBS:?}"
    );
    assert!(
        readme.contains(SHARED_LINK),
        "README must show the shared link {SHARED_LINK:?}"
    );
}

#[test]
fn the_static_library_carries_no_cli_or_test_dependencies() {
    let archive = lib_dir().join("libmori_tp.a");
    let symbols = run(Command::new("nm").arg("--defined-only").arg(&archive));
    assert!(
        symbols.contains("mori_send_kvcache"),
        "nm shows no mori-tp symbols"
    );
    for unwanted in [
        "clap",
        "serde_json",
        "cbindgen",
        "criterion",
        "mori_tp_testkit",
        "roxmltree",
    ] {
        // Symbol lines only: nm also prints each member's name ("<crate>.<hash>.rcgu.o:"),
        // whose codegen-unit hash may spell anything.
        let hits = symbols
            .lines()
            .filter(|l| !l.ends_with(':') && l.contains(unwanted))
            .count();
        assert_eq!(
            hits, 0,
            "libmori_tp.a defines {hits} symbols from {unwanted}"
        );
    }
}

#[test]
fn the_library_prints_only_when_mori_tp_log_is_set() {
    let exe = out_dir("log").join("abi_test_log");
    compile("cc", "c99", "abi_test.c", &exe, &static_link());
    let quiet = Command::new(&exe)
        .env_remove("MORI_TP_LOG")
        .output()
        .expect("run abi_test");
    assert!(quiet.status.success());
    assert_eq!(
        String::from_utf8_lossy(&quiet.stderr),
        "",
        "the library printed without MORI_TP_LOG"
    );

    let loud = Command::new(&exe)
        .env("MORI_TP_LOG", "debug")
        .output()
        .expect("run abi_test");
    assert!(loud.status.success());
    let log = String::from_utf8_lossy(&loud.stderr);
    // Failures with their message, and one canary per distinct layout (not one per pair).
    assert!(
        log.contains("mori_tp_slice_config: invalid topology: prefill side: tp_size 3"),
        "{log}"
    );
    // abi_test.c asks mori_tp_plan for its size (out = NULL, capacity = 0) once per sending
    // pair: those answers are not failures and are not logged as such. Its one real refusal
    // (an array of capacity 0 that is not NULL) is.
    let too_small = log
        .lines()
        .filter(|l| l.contains("mori_tp_plan: buffer too small"))
        .count();
    assert_eq!(too_small, 1, "size queries logged as failures:\n{log}");
    let canaries = log.lines().filter(|l| l.contains("first config")).count();
    assert!(
        log.contains("layout total_kv_heads=4 prefill_tp=2 decode_tp=8"),
        "{log}"
    );
    assert_eq!(
        canaries, 1,
        "abi_test.c computes configs for one valid layout:\n{log}"
    );
}
