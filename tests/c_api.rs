//! The header and the libraries from C and C++: the header compiles alone as C89, C99 and C++17
//! with every warning an error; tests/c/abi_test.c and abi_test.cpp link the static and the
//! shared library with the flags docs/src/guides/link-c.md shows, also under AddressSanitizer; tests/c/cpp_api_test.cpp
//! (include/mori_tp.hpp) from C++17 and C++20, static, shared and fully static, without
//! exceptions, under AddressSanitizer with UndefinedBehaviorSanitizer and under
//! ThreadSanitizer; a pool's free space poisoned for AddressSanitizer; a shared object that links
//! the archive exports none of its symbols; and the static library carries no code of the CLI's
//! or the tests' dependencies. (tests/install.rs links the installed package through CMake and
//! pkg-config.)
//!
//! Needs `cc` and `c++` (gcc/g++ or clang) and, for the sanitizer tests, their runtimes (a
//! missing one skips that test, or fails it when MORI_TP_REQUIRE_TOOLS is set).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{EXCLUDE_LIBS, STATIC_LIBS, hip_link, root, run, scratch};

use mori_tp::ffi::MORI_TP_ABI_VERSION;

/// How docs/src/guides/link-c.md links the shared library.
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
fn the_header_compiles_alone_as_c89_c99_and_cpp17() {
    let dir = out_dir("header");
    for std in ["c89", "c99"] {
        compile(
            "cc",
            std,
            "header_alone.c",
            &dir.join(format!("alone_{std}")),
            &["-c".into()],
        );
    }
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

/// AddressSanitizer and UndefinedBehaviorSanitizer, every report fatal.
fn asan_ubsan() -> Vec<String> {
    let mut flags = asan();
    flags[0] = "-fsanitize=address,undefined".into();
    flags.push("-fno-sanitize-recover=undefined".into());
    flags
}

/// Whether `compiler` links a program with `flags` (a sanitizer's runtime is installed); if not,
/// the test skips, or fails under MORI_TP_REQUIRE_TOOLS.
fn links_with(compiler: &str, flags: &[&str], test: &str) -> bool {
    let dir = out_dir("probe");
    let source = dir.join("probe.c");
    std::fs::write(&source, "int main(void) { return 0; }\n").expect("write the probe");
    let linked = Command::new(compiler)
        .args(flags)
        .arg(&source)
        .arg("-o")
        .arg(dir.join(format!(
            "probe-{}",
            flags.join("").replace(['-', '=', ','], "")
        )))
        .output()
        .is_ok_and(|o| o.status.success());
    if !linked {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_TOOLS",
            &format!("{compiler} cannot link with {flags:?} (install the sanitizer runtime)"),
        );
    }
    linked
}

/// Builds tests/c/cpp_api_test.cpp (include/mori_tp.hpp) once per (name, C++ standard, link
/// arguments) and runs each build.
fn build_and_run_cpp_api(builds: Vec<(&str, &str, Vec<String>)>) {
    let dir = out_dir("cpp_api_test");
    for (name, std, link) in builds {
        let exe = dir.join(format!("cpp_api_test_{name}"));
        compile("c++", std, "cpp_api_test.cpp", &exe, &link);
        run_program(&exe, "cpp_api_test.cpp: all checks passed");
    }
}

#[test]
fn the_cpp_header_passes_from_cpp17_and_cpp20_static_shared_and_without_exceptions() {
    let with = |mut link: Vec<String>, flag: &str| {
        link.push(flag.into());
        link
    };
    let mut builds = vec![
        ("cpp17_static", "c++17", static_link()),
        ("cpp17_shared", "c++17", shared_link()),
        ("cpp20_static", "c++20", static_link()),
        ("cpp20_shared", "c++20", shared_link()),
        (
            "cpp17_no_exceptions",
            "c++17",
            with(static_link(), "-fno-exceptions"),
        ),
    ];
    // Fully static: the driver links libgcc_eh (-lgcc_s would not link). libamdhip64 has no
    // static library, so not with HIP.
    if !cfg!(feature = "hip") {
        builds.push((
            "cpp17_fully_static",
            "c++17",
            with(static_link(), "-static"),
        ));
    }
    build_and_run_cpp_api(builds);
}

#[test]
fn the_cpp_header_passes_under_address_and_undefined_behavior_sanitizers() {
    if !links_with("c++", &["-fsanitize=address,undefined"], "c_api asan") {
        return;
    }
    let sanitized = |mut link: Vec<String>| {
        link.extend(asan_ubsan());
        link
    };
    build_and_run_cpp_api(vec![
        ("cpp17_asan_ubsan_static", "c++17", sanitized(static_link())),
        ("cpp20_asan_ubsan_shared", "c++20", sanitized(shared_link())),
    ]);
}

/// ThreadSanitizer sees the order the pool's lock imposes (the library tells it, see
/// src/pool/sanitizer.rs): eight threads taking, writing and freeing slots, and slots handed
/// between threads, report no race. Before, each slot reused across threads and the pool's own
/// allocations were reported as races.
#[test]
fn pools_and_slot_handoffs_report_no_race_under_thread_sanitizer() {
    if !links_with("c++", &["-fsanitize=thread"], "c_api tsan") {
        return;
    }
    let dir = out_dir("cpp_api_test");
    for (name, mut link) in [("static", static_link()), ("shared", shared_link())] {
        link.extend(["-fsanitize=thread".into(), "-g".into(), "-O1".into()]);
        let exe = dir.join(format!("cpp_api_test_tsan_{name}"));
        compile("c++", "c++17", "cpp_api_test.cpp", &exe, &link);
        let output = Command::new(&exe)
            .env("TSAN_OPTIONS", "halt_on_error=1 exitcode=66")
            .output()
            .expect("run the ThreadSanitizer build");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            output.status.success() && !text.contains("ThreadSanitizer"),
            "{}:\n{text}",
            exe.display()
        );
        assert!(
            text.contains("cpp_api_test.cpp: all checks passed"),
            "{text}"
        );
    }
}

/// Runs tests/c/pool_poison.c in `mode`; returns (exited successfully, what it printed).
fn poison(exe: &Path, mode: &str) -> (bool, String) {
    let output = Command::new(exe)
        .arg(mode)
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .output()
        .expect("run pool_poison");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// A program built with AddressSanitizer gets a report for a write past a slot into the pool's
/// free space, and for a write into a freed slot; none for its slots' own bytes. A write into
/// a neighbouring live slot is not caught (no red zones between slots: documented).
#[test]
fn the_pools_free_space_is_poisoned_under_address_sanitizer() {
    if !links_with("cc", &["-fsanitize=address"], "c_api pool poisoning") {
        return;
    }
    let dir = out_dir("pool_poison");
    for (name, mut link) in [("static", static_link()), ("shared", shared_link())] {
        link.extend(asan());
        let exe = dir.join(format!("pool_poison_{name}"));
        compile("cc", "c99", "pool_poison.c", &exe, &link);
        for mode in ["inside", "neighbour"] {
            let (ok, text) = poison(&exe, mode);
            assert!(
                ok && text.contains(&format!("pool_poison: {mode}: no report")),
                "{name} {mode}:\n{text}"
            );
        }
        for mode in ["past", "freed"] {
            let (ok, text) = poison(&exe, mode);
            assert!(
                !ok && text.contains("use-after-poison") && text.contains("WRITE of size 1"),
                "{name} {mode}: no AddressSanitizer report:\n{text}"
            );
        }
    }
}

/// The dynamic symbols a shared object defines.
fn exported(library: &Path) -> Vec<String> {
    run(Command::new("nm")
        .args(["-D", "--defined-only", "--format=posix"])
        .arg(library))
    .lines()
    .filter_map(|line| line.split_whitespace().next().map(String::from))
    .collect()
}

/// A symbol of Rust's standard library or of mori-tp's Rust code (legacy or v0 mangling).
fn is_rust(symbol: &str) -> bool {
    let legacy_hash = symbol.len() > 20 && {
        let tail = &symbol[symbol.len() - 20..];
        tail.starts_with("17h")
            && tail.ends_with('E')
            && tail[3..19].bytes().all(|b| b.is_ascii_hexdigit())
    };
    legacy_hash || symbol.starts_with("_R") || symbol.contains("rust_")
}

/// A plugin (tests/c/plugin.cpp) that links libmori_tp.a with --exclude-libs exports its own
/// function and none of the library's: without the flag it would export every mori_* function
/// and the Rust internals.
#[test]
fn a_shared_object_that_links_the_archive_exports_none_of_its_symbols() {
    let dir = out_dir("plugin");
    let build = |name: &str, exclude: bool| {
        let library = dir.join(format!("libmori_tp_plugin_{name}.so"));
        let mut link = vec![
            "-shared".to_string(),
            "-fPIC".into(),
            "-fvisibility=hidden".into(),
        ];
        link.extend(static_link());
        if exclude {
            link.push(EXCLUDE_LIBS.into());
        }
        compile("c++", "c++17", "plugin.cpp", &library, &link);
        library
    };
    let leaky = exported(&build("leaky", false));
    assert!(
        leaky.iter().any(|s| s == "mori_tp_kvcache_send") && leaky.iter().any(|s| is_rust(s)),
        "without --exclude-libs the plugin re-exports the library (the case this test guards)"
    );
    let plugin = build("hygienic", true);
    let symbols = exported(&plugin);
    assert!(
        symbols.iter().any(|s| s == "mori_tp_plugin_check"),
        "{symbols:?}"
    );
    let foreign: Vec<&String> = symbols
        .iter()
        .filter(|s| (s.starts_with("mori_") && *s != "mori_tp_plugin_check") || is_rust(s))
        .collect();
    assert!(
        foreign.is_empty(),
        "the plugin exports mori-tp's symbols: {foreign:?}"
    );

    let host = dir.join("plugin_host");
    let link = vec![
        format!("-L{}", dir.display()),
        "-lmori_tp_plugin_hygienic".into(),
        format!("-Wl,-rpath,{}", dir.display()),
    ];
    compile("cc", "c99", "plugin_host.c", &host, &link);
    run_program(&host, "plugin_host: the plugin works");
}

/// The page that shows how to link from C and C++.
const LINK_C: &str = "docs/src/guides/link-c.md";

#[test]
fn the_linking_page_shows_the_linking_that_these_tests_run() {
    let page = std::fs::read_to_string(root().join(LINK_C)).expect(LINK_C);
    assert!(
        page.contains(STATIC_LIBS),
        "{LINK_C} must list the static link flags {STATIC_LIBS:?}"
    );
    assert!(
        page.contains(SHARED_LINK),
        "{LINK_C} must show the shared link {SHARED_LINK:?}"
    );
    assert!(
        page.contains(EXCLUDE_LIBS),
        "{LINK_C} must show {EXCLUDE_LIBS:?} for shared objects"
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
