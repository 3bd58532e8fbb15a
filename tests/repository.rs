//! The repository is all a user has: every document it names must be in it, and nothing may
//! point outside it.

use std::path::{Path, PathBuf};

/// Text files of the checkout (sources, docs, scripts), skipping build outputs and VCS data.
fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a checkout directory") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | "build" | "__pycache__")
                && !name.starts_with('.')
            {
                text_files(&path, out);
            }
        } else if [
            "rs", "md", "py", "h", "hpp", "c", "cpp", "hip", "toml", "txt", "sh", "in",
        ]
        .iter()
        .any(|ext| name.ends_with(&format!(".{ext}")))
            || name == "run"
        {
            out.push(path);
        }
    }
}

/// The upper-case document names (README and REFERENCE, each followed by ".md") of a text.
fn document_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in text.match_indices(".md") {
        let stem: String = text[..at]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let after = text[at + 3..].chars().next();
        if stem.len() >= 2 && !after.is_some_and(|c| c.is_ascii_alphanumeric()) {
            names.push(format!("{stem}.md"));
        }
    }
    names
}

#[test]
fn every_document_the_repository_names_is_in_it_and_nothing_points_outside() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    text_files(root, &mut files);
    let mut present = Vec::new();
    for file in &files {
        if let Some(name) = file.file_name().and_then(|n| n.to_str()) {
            present.push(name.to_string());
        }
    }
    assert!(files.len() > 50, "only {} text files found", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(file).display();
        for name in document_names(&text) {
            if !present.contains(&name) {
                problems.push(format!(
                    "{shown} names {name}, which is not in the repository"
                ));
            }
        }
        if text.contains(concat!("..", "/shared")) {
            problems.push(format!("{shown} points at a folder outside the repository"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Where a source file cites a numbered section, the section is REFERENCE.md's: the repository
/// ships no other numbered document, so a bare number (once the seventh section of a contract
/// users never see, for what REFERENCE.md numbers 11) sends a reader to the wrong place.
#[test]
fn every_section_a_source_file_cites_is_one_of_reference_md() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    text_files(root, &mut files);
    let mut problems = Vec::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e != "md"))
    {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(file).display();
        for word in ["section ", "sections ", "Section ", "Sections ", "§"] {
            for (at, _) in text.match_indices(word) {
                let rest = &text[at + word.len()..];
                if !rest.trim_start().starts_with(|c: char| c.is_ascii_digit())
                    || text[..at].ends_with(|c: char| c.is_ascii_alphanumeric())
                {
                    continue;
                }
                let from = text[..at]
                    .char_indices()
                    .rev()
                    .nth(59)
                    .map_or(0, |(i, _)| i);
                if !text[from..at].contains("REFERENCE") {
                    let line = text[..at].matches('\n').count() + 1;
                    let cited: String = rest.chars().take(12).collect();
                    problems.push(format!(
                        "{shown}:{line}: \"{word}{cited}\" names no document"
                    ));
                }
            }
        }
        if text.contains(concat!("CONTRACT", ".md")) || text.contains(concat!("CONTRACT", "'s")) {
            problems.push(format!(
                "{shown} cites a contract the repository does not ship"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// What the repository tracks and what its packages ship

/// Files the repository tracks: `git ls-files` in a git checkout, else every file under the root
/// except build outputs (an unpacked source archive).
fn tracked_files(root: &Path) -> Vec<PathBuf> {
    let listed = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output();
    if let Some(output) = listed
        .ok()
        .filter(|o| o.status.success() && !o.stdout.is_empty())
    {
        return output
            .stdout
            .split(|&b| b == 0)
            .filter(|name| !name.is_empty())
            .map(|name| PathBuf::from(String::from_utf8_lossy(name).into_owned()))
            .filter(|name| root.join(name).is_file())
            .collect();
    }
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read a checkout directory") {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !matches!(name, "target" | ".git" | "build" | "__pycache__") {
                    walk(root, &path, out);
                }
            } else {
                out.push(
                    path.strip_prefix(root)
                        .expect("under the root")
                        .to_path_buf(),
                );
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// Binary files the repository may track (path, why). None today: a wheel, an archive or a
/// built library belongs to a package registry or to the build, not to the sources.
const BINARIES_ALLOWED: &[(&str, &str)] = &[];

/// The files the repository's root may hold: the manifests, the documents, the licenses and the
/// build's own files. Anything else goes into a folder (or is not tracked at all).
const ROOT_FILES: &[&str] = &[
    ".gitignore",
    "BENCHMARKS.md",
    "CMakeLists.txt",
    "Cargo.lock",
    "Cargo.toml",
    "LICENSE-APACHE",
    "LICENSE-MIT",
    "MANIFEST.in",
    "README.md",
    "REFERENCE.md",
    "build.rs",
    "cbindgen.toml",
    "pyproject.toml",
    "setup.py",
];

/// Whether bytes are text: UTF-8 without NUL bytes.
fn is_text(bytes: &[u8]) -> bool {
    !bytes.contains(&0) && std::str::from_utf8(bytes).is_ok()
}

/// The repository tracks sources, not build outputs or downloads: every tracked file is text
/// (outside `BINARIES_ALLOWED`), none is larger than 1 MiB, and the root holds only
/// `ROOT_FILES` (a 3.8 MB shellcheck wheel once sat there; `.ci/run` installs shellcheck from
/// PyPI instead, and `.gitignore` keeps `*.whl` out).
#[test]
fn the_repository_tracks_no_binaries_and_keeps_its_root_to_the_listed_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tracked_files(root);
    assert!(files.len() > 50, "only {} tracked files found", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let shown = file.display().to_string();
        let bytes = std::fs::read(root.join(file)).expect("read a tracked file");
        if !is_text(&bytes) && !BINARIES_ALLOWED.iter().any(|(path, _)| *path == shown) {
            problems.push(format!("{shown} is binary ({} bytes)", bytes.len()));
        }
        if bytes.len() > 1 << 20 {
            problems.push(format!("{shown} is {} bytes, over 1 MiB", bytes.len()));
        }
        if file.components().count() == 1 && !ROOT_FILES.contains(&shown.as_str()) {
            problems.push(format!(
                "{shown} sits at the repository root, which holds only {ROOT_FILES:?}"
            ));
        }
    }
    for (path, _) in BINARIES_ALLOWED {
        assert!(
            files.iter().any(|f| f.display().to_string() == *path),
            "BINARIES_ALLOWED lists {path}, which is not tracked"
        );
    }
    let ignore = std::fs::read_to_string(root.join(".gitignore")).expect(".gitignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "*.whl"),
        ".gitignore must keep wheels out (*.whl)"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(is_text(b"text\n") && !is_text(b"PK\x03\x04\0\0") && !is_text(&[0xff, 0xfe]));
}

/// The workspace's manifests.
const MANIFESTS: [&str; 4] = [
    "Cargo.toml",
    "cli/Cargo.toml",
    "crates/testkit/Cargo.toml",
    "examples/Cargo.toml",
];

/// The paths a manifest names, as (key, path relative to the manifest's folder): `path`,
/// `readme`, `build`, the workspace's `members`, and `include` entries (a leading `/` dropped).
fn manifest_paths(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut list: Option<String> = None;
    let quoted = |s: &str| -> Vec<String> {
        s.split('"')
            .skip(1)
            .step_by(2)
            .map(|p| p.trim_start_matches('/').to_string())
            .collect()
    };
    for line in text.lines() {
        let line = line.split(" #").next().unwrap_or("").trim();
        if line.starts_with('#') {
            continue;
        }
        if let Some(key) = &list {
            out.extend(quoted(line).into_iter().map(|p| (key.clone(), p)));
            if line.contains(']') {
                list = None;
            }
            continue;
        }
        for key in ["include", "members", "default-members"] {
            if let Some(rest) = line
                .strip_prefix(key)
                .and_then(|r| r.trim_start().strip_prefix('='))
            {
                out.extend(quoted(rest).into_iter().map(|p| (key.to_string(), p)));
                if !rest.contains(']') {
                    list = Some(key.to_string());
                }
            }
        }
        for key in ["path", "readme", "build"] {
            // `path = "..."` on its own line, or inside an inline table.
            for (at, _) in line.match_indices(key) {
                let before = line[..at].chars().next_back();
                let rest = line[at + key.len()..].trim_start();
                if before.is_none_or(|c| c == ' ' || c == '{' || c == ',')
                    && let Some(value) = rest.strip_prefix('=')
                    && let Some(path) = quoted(value).into_iter().next()
                {
                    out.push((key.to_string(), path));
                }
            }
        }
    }
    out
}

/// Whether an `include` pattern (`dir/**`, `dir/**/*.ext`, or a plain path) matches a file.
fn include_matches(dir: &Path, pattern: &str) -> bool {
    match pattern.split_once("/**") {
        Some((folder, rest)) => {
            let ext = rest.trim_start_matches("/*").trim_start_matches('.');
            let mut files = Vec::new();
            fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
                for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                    let path = entry.path();
                    if path.is_dir() {
                        walk(&path, out);
                    } else {
                        out.push(path);
                    }
                }
            }
            walk(&dir.join(folder), &mut files);
            files
                .iter()
                .any(|f| ext.is_empty() || f.extension().is_some_and(|e| e == ext))
        }
        None => dir.join(pattern).exists(),
    }
}

/// Every path a Cargo.toml of the workspace names exists (a `path`, `readme`, `build`, workspace
/// member or `include` entry), and each package lists what it ships with `include`.
#[test]
fn every_path_a_cargo_manifest_names_exists_and_each_package_lists_what_it_ships() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut problems = Vec::new();
    for manifest in MANIFESTS {
        let text = std::fs::read_to_string(root.join(manifest)).expect("a manifest");
        let dir = root
            .join(manifest)
            .parent()
            .expect("a folder")
            .to_path_buf();
        let paths = manifest_paths(&text);
        for (key, path) in &paths {
            if !include_matches(&dir, path) {
                problems.push(format!(
                    "{manifest}: {key} names {path}, which does not exist"
                ));
            }
        }
        let publishable = !text.contains("publish = false");
        let shown = paths.iter().any(|(key, _)| key == "include");
        if (publishable || manifest == "cli/Cargo.toml") && !shown {
            problems.push(format!("{manifest} must list what it ships with `include`"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let sample = "[lib]\npath = \"lib.rs\"\nx = { path = \"..\" }\ninclude = [\n  \"/src/**/*.rs\", # c\n  \"/a.md\",\n]\nreadme = \"R.md\"\n";
    assert_eq!(
        manifest_paths(sample),
        [
            ("path".to_string(), "lib.rs".to_string()),
            ("path".into(), "..".into()),
            ("include".into(), "src/**/*.rs".into()),
            ("include".into(), "a.md".into()),
            ("readme".into(), "R.md".into()),
        ]
    );
    assert!(include_matches(root, "src/**/*.rs") && !include_matches(root, "src/**/*.whl"));
}

/// What `cargo package` would put in the library's crate: what the build reads (build.rs, the
/// copy kernel's sources, the header it takes the ABI version from), the sources, the headers,
/// the documents and the licenses; no tests, benchmarks, Python, CI or binaries.
#[test]
fn the_library_crate_ships_what_its_build_reads_and_nothing_of_the_checkouts_tooling() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let list = |package: &str| -> Vec<String> {
        let output = std::process::Command::new(&cargo)
            .args([
                "package",
                "--list",
                "--allow-dirty",
                "--offline",
                "-p",
                package,
            ])
            .current_dir(root)
            .output()
            .expect("run cargo package --list");
        assert!(
            output.status.success(),
            "cargo package --list -p {package}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    };
    let shipped = list("mori-tp");
    for needed in [
        "Cargo.toml",
        "README.md",
        "REFERENCE.md",
        "LICENSE-APACHE",
        "LICENSE-MIT",
        "build.rs",
        "src/lib.rs",
        "hip/bundle.rs",
        "hip/copy_kernel.hip",
        "hip/copy_kernel.h",
        "hip/cuda_stand_in.h",
        "include/mori_tp.h",
        "include/mori_tp.hpp",
    ] {
        assert!(
            shipped.iter().any(|f| f == needed),
            "the crate must ship {needed}: {shipped:?}"
        );
    }
    // Every file build.rs names under hip/ or include/ is shipped.
    let build = std::fs::read_to_string(root.join("build.rs")).expect("build.rs");
    for (at, _) in build.match_indices('"') {
        let rest = &build[at + 1..];
        let word = &rest[..rest.find('"').unwrap_or(0)];
        if (word.starts_with("hip/") || word.starts_with("include/")) && word.contains('.') {
            assert!(
                shipped.iter().any(|f| f == word),
                "build.rs reads {word}, which the crate does not ship"
            );
        }
    }
    for file in &shipped {
        assert!(
            !["tests/", "python/", "benches/", ".ci/", "docs/", "cli/"]
                .iter()
                .any(|dir| file.starts_with(dir))
                && !file.ends_with(".whl"),
            "the crate ships {file}, which belongs to the checkout"
        );
    }
    let cli = list("mori-tp-cli");
    assert!(
        cli.iter().any(|f| f == "src/main.rs")
            && cli.iter().any(|f| f == "configs/llama-3.1-8b/config.json")
            && !cli.iter().any(|f| f.starts_with("tests/")),
        "the CLI package ships its sources and configs: {cli:?}"
    );
}

/// What under `src` (a crate's source folder) holds tests other than the `#[cfg(test)] mod
/// tests` beside the code: a file or folder whose name says test (`src/hip_tests/` once held
/// the GPU engine's tests), `extern crate self` (which let that code name the crate as the
/// integration tests do), and a test-only module not named `tests` or one pulled in by
/// `#[path]`. `//` comments are left out, so that a comment may name the rule.
fn tests_outside_mod_tests(src: &Path) -> Vec<String> {
    fn walk(src: &Path, dir: &Path, problems: &mut Vec<String>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("a source folder")
            .map(|entry| entry.expect("an entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let shown = path
                .strip_prefix(src)
                .unwrap_or(&path)
                .display()
                .to_string();
            let name = path.file_name().unwrap().to_string_lossy().to_lowercase();
            if name.contains("test") {
                problems.push(format!(
                    "src/{shown} is named for tests: integration tests belong in tests/"
                ));
            }
            if path.is_dir() {
                walk(src, &path, problems);
            } else if name.ends_with(".rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                let code: Vec<&str> = text
                    .lines()
                    .map(|line| line.find("//").map_or(line, |at| &line[..at]).trim())
                    .collect();
                for (k, line) in code.iter().enumerate() {
                    if line.contains("extern crate self") {
                        problems.push(format!("src/{shown}:{}: extern crate self", k + 1));
                    }
                    if !(line.starts_with("#[cfg(") && line.contains("test")) {
                        continue;
                    }
                    // The item the attribute is on, past further attributes and blank lines.
                    let mut item = code[k + 1..].iter().filter(|l| !l.is_empty());
                    let mut next = item.next();
                    while let Some(attribute) = next.filter(|l| l.starts_with("#[")) {
                        if attribute.starts_with("#[path") {
                            problems.push(format!(
                                "src/{shown}:{}: a test-only module from another file (#[path])",
                                k + 1
                            ));
                        }
                        next = item.next();
                    }
                    let module = next.and_then(|l| {
                        let l = l
                            .strip_prefix("pub(crate) ")
                            .or(l.strip_prefix("pub "))
                            .unwrap_or(l);
                        l.strip_prefix("mod ")
                    });
                    if let Some(module) = module {
                        let module: String = module
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if module != "tests" {
                            problems.push(format!(
                                "src/{shown}:{}: test-only module `{module}`: only `mod tests` \
                                 beside the code",
                                k + 1
                            ));
                        }
                    }
                }
            }
        }
    }
    let mut problems = Vec::new();
    walk(src, src, &mut problems);
    problems
}

/// The library's and the CLI's tests live in src/ and cli/src/ only as `#[cfg(test)] mod tests`
/// beside the code; every other test is an integration test in tests/
/// (docs/src/design/test-map.md, "Beside the code"). The check
/// also runs on a copy of the layout src/ had before the GPU engine's tests moved to
/// tests/gpu_engine.rs, and must refuse it.
#[test]
fn src_holds_no_tests_but_the_mod_tests_beside_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in ["src", "cli/src"] {
        let problems = tests_outside_mod_tests(&root.join(src));
        assert!(problems.is_empty(), "{src}: {}", problems.join("\n"));
    }

    let old = std::env::temp_dir().join(format!("mori_tp_old_src_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&old);
    std::fs::create_dir_all(old.join("hip_tests")).unwrap();
    std::fs::write(
        old.join("lib.rs"),
        "// extern crate self in a comment is fine.\n#[cfg(test)]\nextern crate self as \
         mori_tp;\npub mod send;\n#[cfg(test)]\nmod hip_tests;\n",
    )
    .unwrap();
    std::fs::write(
        old.join("hip_tests/mod.rs"),
        "#[path = \"../../tests/common/mod.rs\"]\nmod common;\n#[test]\nfn t() {}\n",
    )
    .unwrap();
    std::fs::write(
        old.join("send.rs"),
        "pub fn f() {}\n\n#[cfg(test)]\nmod tests {\n    #[test]\n    fn t() {}\n}\n\
         #[cfg(test)]\n#[path = \"x.rs\"]\nmod tests;\n",
    )
    .unwrap();
    let problems = tests_outside_mod_tests(&old);
    std::fs::remove_dir_all(&old).unwrap();
    assert_eq!(
        problems,
        [
            "src/hip_tests is named for tests: integration tests belong in tests/",
            "src/lib.rs:3: extern crate self",
            "src/lib.rs:5: test-only module `hip_tests`: only `mod tests` beside the code",
            "src/send.rs:8: a test-only module from another file (#[path])",
        ],
    );
}
