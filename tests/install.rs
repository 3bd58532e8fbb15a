//! The install a C or C++ project consumes: the top-level CMakeLists.txt builds the library with
//! cargo and installs it into a temporary prefix, which is then moved (the package must not
//! depend on where it was installed). Then tests/c/CMakeLists.txt finds it with
//! `find_package(mori_tp CONFIG REQUIRED)`, or takes the checkout itself with `add_subdirectory`
//! and with FetchContent, and pkg-config finds it with `mori_tp.pc` and `mori_tp-static.pc`;
//! every program (C, and C++ through mori_tp.hpp) is linked static and shared, a C++ program
//! fully static, a plugin (a shared object) links the archive and exports none of its symbols,
//! and every program runs.
//!
//! With `--features hip` the install is built with `-DMORI_TP_HIP=ON`, and the static programs
//! must link libamdhip64 (and none is fully static). Needs cmake, pkg-config, readelf, nm, cc and
//! c++; a missing one skips these tests, or fails them when MORI_TP_REQUIRE_TOOLS is set (CI).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{root, run};
use mori_tp::ffi::MORI_TP_ABI_VERSION;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const STRICT_C: &str = "-Wall -Wextra -Werror -pedantic";

/// This test's scratch folder: target/<profile>/deps/c-tests/install/<name>, kept between runs
/// so that the cargo build inside CMake's build folder is incremental.
fn scratch(name: &str) -> PathBuf {
    common::scratch(&["c-tests", "install", name])
}

fn tools_present(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|tool| {
            Command::new(tool)
                .arg("--version")
                .output()
                .map_or(true, |o| !o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    common::skip_missing(
        "install",
        "MORI_TP_REQUIRE_TOOLS",
        &format!(
            "{missing:?} not installed (Debian: apt-get install cmake pkg-config binutils gcc g++)"
        ),
    );
    false
}

/// `readelf -d` of an ELF file: its NEEDED, SONAME and RUNPATH entries.
fn dynamic_section(file: &Path) -> String {
    run(Command::new("readelf").arg("-d").arg(file))
}

/// The installed prefix, or None when cmake is missing (the skip is printed once per test).
/// Built and installed once per test run: configure, build (cargo inside), install into
/// `staged`, then renamed to `prefix` so that every consumer uses a moved install.
fn installed_prefix() -> Option<&'static Path> {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    if !tools_present(&["cmake", "readelf"]) {
        return None;
    }
    Some(PREFIX.get_or_init(|| {
        let build = scratch("build");
        let staged = scratch("staged");
        let prefix = scratch("prefix");
        for dir in [&staged, &prefix] {
            std::fs::remove_dir_all(dir).expect("clear the previous install");
        }
        let hip = if cfg!(feature = "hip") { "ON" } else { "OFF" };
        // The three commands of docs/src/guides/link-c.md, with a scratch prefix.
        run(Command::new("cmake")
            .arg("-S")
            .arg(root())
            .arg("-B")
            .arg(&build)
            .arg(format!("-DMORI_TP_HIP={hip}"))
            .arg("-DCMAKE_INSTALL_LIBDIR=lib"));
        run(Command::new("cmake").arg("--build").arg(&build));
        run(Command::new("cmake")
            .arg("--install")
            .arg(&build)
            .arg("--prefix")
            .arg(&staged));
        std::fs::rename(&staged, &prefix).expect("move the install");
        prefix
    }))
}

/// Every file and link under `dir`, relative to it, with links shown as `name -> target`.
fn listing(dir: &Path) -> Vec<String> {
    let mut entries = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).expect("read the install") {
            let path = entry.expect("directory entry").path();
            let relative = path.strip_prefix(dir).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                entries.push(format!("{relative} -> {}", target.display()));
            } else if meta.is_dir() {
                pending.push(path);
            } else {
                entries.push(relative);
            }
        }
    }
    entries.sort();
    entries
}

#[test]
fn the_install_holds_the_header_both_libraries_the_soname_chain_and_the_package_files() {
    let Some(prefix) = installed_prefix() else {
        return;
    };
    let real = format!("libmori_tp.so.{VERSION}");
    let soname = format!("libmori_tp.so.{MORI_TP_ABI_VERSION}");
    let mut expected = vec![
        "include/mori_tp.h".to_string(),
        "include/mori_tp.hpp".into(),
        "lib/cmake/mori_tp/mori_tpConfig.cmake".into(),
        "lib/cmake/mori_tp/mori_tpConfigVersion.cmake".into(),
        "lib/libmori_tp.a".into(),
        format!("lib/libmori_tp.so -> {soname}"),
        format!("lib/{real}"),
        format!("lib/{soname} -> {real}"),
        "lib/pkgconfig/mori_tp-static.pc".into(),
        "lib/pkgconfig/mori_tp.pc".into(),
    ];
    expected.sort();
    assert_eq!(listing(prefix), expected);

    for header in ["mori_tp.h", "mori_tp.hpp"] {
        let installed = std::fs::read(prefix.join("include").join(header)).unwrap();
        let committed = std::fs::read(root().join("include").join(header)).unwrap();
        assert!(
            installed == committed,
            "the installed {header} differs from include/{header}"
        );
    }
    let dynamic = dynamic_section(&prefix.join("lib").join(&real));
    assert!(
        dynamic.contains(&format!("Library soname: [{soname}]")),
        "{real} must carry the SONAME {soname}:\n{dynamic}"
    );
    assert_eq!(
        dynamic.contains("libamdhip64"),
        cfg!(feature = "hip"),
        "libamdhip64 must be a dependency exactly when built with the hip feature:\n{dynamic}"
    );
}

/// Runs `exe` without cargo's LD_LIBRARY_PATH (which lists its own output folders), so the
/// program finds the shared library only the way a user's program would; returns what it printed.
fn run_consumer(exe: &Path) -> String {
    run(Command::new(exe).env_remove("LD_LIBRARY_PATH"))
}

/// Checks how `exe` links mori-tp: `shared` needs the SONAME and finds it through the RUNPATH in
/// the install; static has no libmori_tp dependency (and with HIP, needs libamdhip64 itself).
fn check_linkage(exe: &Path, shared: bool, libdir: &Path) {
    let dynamic = dynamic_section(exe);
    let soname = format!("Shared library: [libmori_tp.so.{MORI_TP_ABI_VERSION}]");
    if shared {
        assert!(dynamic.contains(&soname), "{}:\n{dynamic}", exe.display());
        assert!(
            dynamic.contains(&libdir.display().to_string()),
            "{} must find the library in {}:\n{dynamic}",
            exe.display(),
            libdir.display()
        );
    } else {
        assert!(
            !dynamic.contains("libmori_tp"),
            "{}:\n{dynamic}",
            exe.display()
        );
        assert_eq!(
            dynamic.contains("libamdhip64"),
            cfg!(feature = "hip"),
            "{}:\n{dynamic}",
            exe.display()
        );
    }
}

/// `readelf -d` of a fully static program: no dynamic section at all.
fn check_fully_static(exe: &Path) {
    let dynamic = dynamic_section(exe);
    assert!(
        dynamic.contains("no dynamic section"),
        "{} is not fully static:\n{dynamic}",
        exe.display()
    );
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

/// Checks that the plugin (tests/c/plugin.cpp) exports its function and none of mori-tp's: no
/// other mori_* function, no Rust symbol (legacy `...17h<hash>E` or v0 `_R` mangling).
fn check_plugin_exports(library: &Path) {
    let symbols = exported(library);
    assert!(
        symbols.iter().any(|s| s == "mori_tp_plugin_check"),
        "{}: {symbols:?}",
        library.display()
    );
    let foreign: Vec<&String> = symbols
        .iter()
        .filter(|s| {
            let rust_hash =
                s.len() > 20 && s[s.len() - 20..].starts_with("17h") && s.ends_with('E');
            (s.starts_with("mori_") && *s != "mori_tp_plugin_check")
                || rust_hash
                || s.starts_with("_R")
                || s.contains("rust_")
        })
        .collect();
    assert!(
        foreign.is_empty(),
        "{} exports mori-tp's symbols: {foreign:?}",
        library.display()
    );
}

/// Configures and builds tests/c/CMakeLists.txt in `build`, getting mori-tp the way `consume`
/// says (package, subdirectory, fetchcontent), then runs and checks every program. `libdir` is
/// where the shared programs must find libmori_tp.so.1.
fn build_and_run_consumer(build: &Path, consume: &str, extra: &[String], libdir: &Path) {
    run(Command::new("cmake")
        .arg("-S")
        .arg(root().join("tests/c"))
        .arg("-B")
        .arg(build)
        .arg(format!("-DMORI_TP_CONSUME={consume}"))
        .args(extra)
        .arg(format!("-DCMAKE_C_FLAGS={STRICT_C}"))
        .arg(format!("-DCMAKE_CXX_FLAGS={STRICT_C}")));
    run(Command::new("cmake").arg("--build").arg(build));
    let cpp_api = "cpp_api_test.cpp: all checks passed";
    let mut programs = vec![
        ("abi_test_c_static", "abi_test.c: all checks passed", false),
        ("abi_test_c_shared", "abi_test.c: all checks passed", true),
        (
            "abi_test_cpp_static",
            "abi_test.cpp: all checks passed",
            false,
        ),
        (
            "abi_test_cpp_shared",
            "abi_test.cpp: all checks passed",
            true,
        ),
        ("cpp_api_test_static", cpp_api, false),
        ("cpp_api_test_shared", cpp_api, true),
        ("cpp_api_test_cpp20_static", cpp_api, false),
    ];
    let version = format!(
        "version_check: header and library are version {VERSION}, ABI {MORI_TP_ABI_VERSION}"
    );
    programs.push(("version_check_static", &version, false));
    programs.push(("version_check_shared", &version, true));
    for (program, expected, shared) in programs {
        let exe = build.join(program);
        check_linkage(&exe, shared, libdir);
        let output = run_consumer(&exe);
        assert!(output.contains(expected), "{}:\n{output}", exe.display());
    }
    if !cfg!(feature = "hip") {
        let exe = build.join("cpp_api_test_fully_static");
        check_fully_static(&exe);
        assert!(run_consumer(&exe).contains(cpp_api));
    }
    check_plugin_exports(&build.join("libmori_tp_plugin.so"));
    let host = run_consumer(&build.join("plugin_host"));
    assert!(host.contains("plugin_host: the plugin works"), "{host}");
}

#[test]
fn a_cmake_project_finds_the_package_and_links_it_static_and_shared() {
    let Some(prefix) = installed_prefix() else {
        return;
    };
    if !tools_present(&["cc", "c++", "nm"]) {
        return;
    }
    let build = scratch("consumer");
    std::fs::remove_dir_all(&build).unwrap();
    build_and_run_consumer(
        &build,
        "package",
        &[format!("-DCMAKE_PREFIX_PATH={}", prefix.display())],
        &prefix.join("lib"),
    );
}

/// The checkout taken into a project's build, as a vendored copy (add_subdirectory) or with
/// FetchContent: the same targets as the package, mori_tp::mori_tp among them, each built by
/// cargo before the programs that link it. cargo reuses the install's target folder.
#[test]
fn a_cmake_project_adds_the_checkout_with_add_subdirectory_and_fetchcontent() {
    let Some(_) = installed_prefix() else {
        return;
    };
    if !tools_present(&["cc", "c++", "nm"]) {
        return;
    }
    let hip = if cfg!(feature = "hip") { "ON" } else { "OFF" };
    let cargo = scratch("build").join("cargo");
    // Where each way puts the checkout's build tree.
    for (consume, subproject) in [
        ("subdirectory", "mori_tp"),
        ("fetchcontent", "_deps/mori_tp-build"),
    ] {
        let build = scratch(&format!("consumer-{consume}"));
        std::fs::remove_dir_all(&build).unwrap();
        build_and_run_consumer(
            &build,
            consume,
            &[
                format!("-DMORI_TP_SOURCE_DIR={}", root().display()),
                format!("-DMORI_TP_CARGO_TARGET_DIR={}", cargo.display()),
                format!("-DMORI_TP_HIP={hip}"),
            ],
            &build.join(subproject).join("lib"),
        );
        // Taken into another project, the checkout generates no install rules of its own.
        let rules = std::fs::read_to_string(build.join(subproject).join("cmake_install.cmake"))
            .expect("the subproject's cmake_install.cmake");
        assert!(
            !rules.contains("libmori_tp"),
            "{consume}: the added checkout installs its files:\n{rules}"
        );
    }
}

#[test]
fn pkg_config_links_the_installed_libraries_static_and_shared() {
    let Some(prefix) = installed_prefix() else {
        return;
    };
    if !tools_present(&["pkg-config", "cc", "c++", "nm"]) {
        return;
    }
    let pkg_config = |args: &[&str]| -> String {
        run(Command::new("pkg-config")
            .args(args)
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")))
        .trim()
        .to_string()
    };
    assert_eq!(pkg_config(&["--modversion", "mori_tp"]), VERSION);
    assert_eq!(pkg_config(&["--modversion", "mori_tp-static"]), VERSION);
    let libdir = PathBuf::from(pkg_config(&["--variable=libdir", "mori_tp"]));
    // The paths pkg-config prints are clean: each folder once, no empty component ("//").
    for package in ["mori_tp", "mori_tp-static"] {
        for query in [
            "--variable=prefix",
            "--variable=libdir",
            "--variable=includedir",
            "--cflags",
            "--libs",
        ] {
            let printed = pkg_config(&[query, package]);
            assert!(
                !printed.contains("//"),
                "{package} {query} prints an empty path component: {printed}"
            );
        }
    }
    assert_eq!(
        libdir.canonicalize().unwrap(),
        prefix.join("lib").canonicalize().unwrap(),
        "mori_tp.pc must name the moved prefix"
    );
    let out = scratch("pkg-config");
    for (package, shared) in [("mori_tp", true), ("mori_tp-static", false)] {
        let flags = pkg_config(&["--cflags", "--libs", package]);
        for (source, expected) in [
            ("abi_test.c", "abi_test.c: all checks passed".to_string()),
            (
                "version_check.c",
                format!("version_check: header and library are version {VERSION}"),
            ),
        ] {
            let exe = out.join(format!("{source}-{package}"));
            // The order a user writes: sources, then the libraries pkg-config names.
            let mut command = Command::new("cc");
            command
                .arg("-std=c99")
                .args(STRICT_C.split(' '))
                .arg(root().join("tests/c").join(source))
                .args(flags.split_whitespace())
                .arg(format!("-Wl,-rpath,{}", libdir.display()))
                .arg("-o")
                .arg(&exe);
            run(&mut command);
            check_linkage(&exe, shared, &libdir);
            let output = run_consumer(&exe);
            assert!(output.contains(&expected), "{}:\n{output}", exe.display());
        }
        // C++ through mori_tp.hpp, as docs/src/guides/cpp.md writes it.
        let exe = out.join(format!("cpp_api_test-{package}"));
        run(Command::new("c++")
            .arg("-std=c++17")
            .args(STRICT_C.split(' '))
            .arg(root().join("tests/c/cpp_api_test.cpp"))
            .args(flags.split_whitespace())
            .arg(format!("-Wl,-rpath,{}", libdir.display()))
            .arg("-o")
            .arg(&exe));
        check_linkage(&exe, shared, &libdir);
        assert!(run_consumer(&exe).contains("cpp_api_test.cpp: all checks passed"));
    }

    let flags = pkg_config(&["--cflags", "--libs", "mori_tp-static"]);
    // Fully static: `g++ -static app.cpp $(pkg-config --cflags --libs mori_tp-static)`.
    if !cfg!(feature = "hip") {
        let exe = out.join("cpp_api_test-fully-static");
        run(Command::new("c++")
            .args(["-std=c++17", "-static"])
            .arg(root().join("tests/c/cpp_api_test.cpp"))
            .args(flags.split_whitespace())
            .arg("-o")
            .arg(&exe));
        check_fully_static(&exe);
        assert!(run_consumer(&exe).contains("cpp_api_test.cpp: all checks passed"));
    }
    // A plugin: the package's flags keep the library's symbols out of its exports.
    let plugin = out.join("libmori_tp_plugin.so");
    run(Command::new("c++")
        .args(["-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"])
        .arg(root().join("tests/c/plugin.cpp"))
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&plugin));
    check_plugin_exports(&plugin);
}

#[test]
fn the_linking_page_shows_the_install_commands_and_the_consumer_block_these_tests_run() {
    const LINK_C: &str = "docs/src/guides/link-c.md";
    let readme = std::fs::read_to_string(root().join(LINK_C)).expect(LINK_C);
    for command in [
        "cmake -S . -B build",
        "cmake --build build",
        "cmake --install build --prefix",
        "pkg-config --cflags --libs mori_tp-static",
        "pkg-config --cflags --libs mori_tp",
        "g++ -static",
        "find_package(mori_tp 0.1 CONFIG REQUIRED)",
        "add_subdirectory(",
        "FetchContent_MakeAvailable(mori_tp)",
        "mori_tp.hpp",
    ] {
        assert!(readme.contains(command), "{LINK_C} must show `{command}`");
    }
    let cmake = std::fs::read_to_string(root().join("tests/c/CMakeLists.txt")).expect("CMakeLists");
    let start = cmake.find("# >>> use mori-tp").expect("start marker");
    let end = cmake.find("# <<< use mori-tp").expect("end marker");
    let block = cmake[start..end].trim_end();
    assert!(
        readme.contains(block),
        "{LINK_C} must show tests/c/CMakeLists.txt's block verbatim:\n{block}"
    );
}
