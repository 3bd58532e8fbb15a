//! The documents tell the truth about what can be checked without a measurement: measured
//! figures are BENCHMARKS.md's (which `benches/regenerate` writes), the module order of
//! REFERENCE.md section 10 and README.md is the import order of `src/`, and README.md names the
//! static library's dependencies as `cargo tree` lists them.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Measured figures

/// The user documents whose measured figures must come from BENCHMARKS.md.
const DOCUMENTS: [&str; 3] = ["README.md", "REFERENCE.md", "python/README.md"];

/// Figures that are not measurements, each with the reason: (document, text around the figure,
/// why). Each entry must still match, so that the list cannot outlive its text.
const NOT_MEASURED: &[(&str, &str, &str)] = &[
    (
        "REFERENCE.md",
        "2 ms into a 16 MiB chunk's write",
        "when the fault test kills the decode process: a setting of the test",
    ),
    (
        "REFERENCE.md",
        "backs off to 1 ms while nothing arrives",
        "the polling thread's back-off: a constant of the code",
    ),
    (
        "REFERENCE.md",
        "within 10% of the least",
        "the cost model's tolerance, a parameter (`tolerance`)",
    ),
    (
        "REFERENCE.md",
        "defaults to 0.2 ms",
        "the cost model's default chunk overhead, a parameter",
    ),
    (
        "REFERENCE.md",
        "reports TTFT -61% at 1K tokens",
        "SGLang's own figure, cited as theirs",
    ),
];

/// One figure found in a document: its line, its text and the block it sits in.
#[derive(Debug)]
struct Figure {
    line: usize,
    text: String,
    block: String,
    /// Byte range of the figure inside `block`.
    at: (usize, usize),
}

/// Splits Markdown into the blocks a reference must share with a figure: a table row, a list
/// item with its continuation lines, a heading, a fenced code block, or a paragraph. Returns
/// (first line number, text).
fn blocks(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut current: Option<(usize, String)> = None;
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let starts_item = trimmed.starts_with("- ")
            || trimmed.starts_with("* ")
            || trimmed
                .split_once(". ")
                .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if fenced {
            let block = current.as_mut().expect("a fence opened a block");
            block.1.push('\n');
            block.1.push_str(line);
            if trimmed.starts_with("```") {
                fenced = false;
                out.extend(current.take());
            }
            continue;
        }
        let alone = trimmed.starts_with('|') || trimmed.starts_with('#');
        if trimmed.is_empty() || alone || starts_item || trimmed.starts_with("```") {
            out.extend(current.take());
        }
        if trimmed.is_empty() {
            continue;
        }
        if trimmed.starts_with("```") {
            fenced = true;
            current = Some((i + 1, line.to_string()));
        } else if alone {
            out.push((i + 1, line.to_string()));
        } else if let Some(block) = current.as_mut() {
            block.1.push('\n');
            block.1.push_str(line);
        } else {
            current = Some((i + 1, line.to_string()));
        }
    }
    out.extend(current);
    out
}

/// The measured-looking figures of a text. A figure is a number (digits, an optional decimal
/// part, optionally a range `a-b` or `a–b`), not glued to a letter, digit, `.` or `_` before it,
/// followed by one of:
/// - `x` or `X` with nothing between and no letter, digit or `_` after: a ratio ("12x",
///   "1.8-2.3x"); "8 x 128" (a product, spaced), "0x10" and "2x2" are not figures;
/// - `%` with nothing between: a share ("83%");
/// - a time or rate unit after at most one space, not followed by a letter or digit: `ns`, `us`,
///   `µs`, `ms`, `GB/s`, `MB/s` ("54 ns", "2.5 ms");
/// - " times " and a comparison: faster, slower, fewer, shorter, longer, more, less.
///
/// Sizes ("64 KiB"), counts, versions ("HIP 5.2") and formulas with spaced operators are not
/// figures: a measurement has a ratio, a share, a time or a rate.
fn figures(block: &str) -> Vec<(usize, usize)> {
    let bytes = block.as_bytes();
    let number_end = |mut i: usize| -> usize {
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i + 1 < bytes.len() && bytes[i] == b'.' && bytes[i + 1].is_ascii_digit() {
            i += 1;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
        }
        i
    };
    let glued = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts =
            bytes[i].is_ascii_digit() && (i == 0 || !(glued(bytes[i - 1]) || bytes[i - 1] == b'.'));
        if !starts {
            i += 1;
            continue;
        }
        let mut end = number_end(i);
        // A range: a-b or a–b (en dash).
        for dash in ["-", "\u{2013}"] {
            let after = end + dash.len();
            if block[end..].starts_with(dash)
                && after < bytes.len()
                && bytes[after].is_ascii_digit()
            {
                end = number_end(after);
                break;
            }
        }
        let rest = &block[end..];
        let not_glued_at = |k: usize| bytes.get(end + k).is_none_or(|&c| !glued(c));
        let is_figure = ((rest.starts_with('x') || rest.starts_with('X')) && not_glued_at(1))
            || rest.starts_with('%')
            || ["ns", "us", "µs", "ms", "GB/s", "MB/s"].iter().any(|unit| {
                [0, 1].iter().any(|&space| {
                    (space == 0 || rest.starts_with(' '))
                        && rest[space..].starts_with(unit)
                        && not_glued_at(space + unit.len())
                })
            })
            || [
                "faster", "slower", "fewer", "shorter", "longer", "more", "less",
            ]
            .iter()
            .any(|word| rest.starts_with(&format!(" times {word}")));
        if is_figure {
            let stop = block[end..]
                .find(|c: char| c.is_whitespace() || c == ',' || c == ')')
                .map_or(block.len(), |k| end + k);
            out.push((i, stop));
        }
        i = end.max(i + 1);
    }
    out
}

fn document_figures(text: &str) -> Vec<Figure> {
    let mut out = Vec::new();
    for (line, block) in blocks(text) {
        for (start, end) in figures(&block) {
            out.push(Figure {
                line: line + block[..start].matches('\n').count(),
                text: block[start..end].to_string(),
                block: block.clone(),
                at: (start, end),
            });
        }
    }
    out
}

/// Whether `around` occurs in `block` (whitespace runs counting as one space, so that a line
/// break anywhere in it does not matter) over the byte range `at`.
fn covers(block: &str, around: &str, at: (usize, usize)) -> bool {
    // The block with each run of whitespace as one space, and where each byte came from.
    let (mut flat, mut from) = (String::new(), Vec::new());
    for (k, c) in block.char_indices() {
        if c.is_whitespace() {
            if !flat.ends_with(' ') {
                flat.push(' ');
                from.push(k);
            }
        } else {
            flat.push(c);
            from.extend(std::iter::repeat_n(k, c.len_utf8()));
        }
    }
    flat.match_indices(around).any(|(k, _)| {
        let last = from[k + around.len() - 1];
        from[k] <= at.0 && at.1 <= last + 1
    })
}

/// Whether a text holds a date (YYYY-MM-DD).
fn has_date(text: &str) -> bool {
    let b = text.as_bytes();
    (0..b.len().saturating_sub(9)).any(|i| {
        let d = |k: usize| b[i + k].is_ascii_digit();
        d(0) && d(1)
            && d(2)
            && d(3)
            && b[i + 4] == b'-'
            && d(5)
            && d(6)
            && b[i + 7] == b'-'
            && d(8)
            && d(9)
    })
}

/// The rule: every measured figure (see `figures`) in README.md, REFERENCE.md and
/// python/README.md sits in a block (paragraph, list item, table row; see `blocks`) that names
/// BENCHMARKS.md and the date of the run it quotes (YYYY-MM-DD). BENCHMARKS.md's tables are
/// written by `benches/regenerate` under their date, commit and machine, and change with every
/// run: a document points to them without a figure ("BENCHMARKS.md's `pool` table"), or quotes a
/// figure as of a date. Figures that are settings, constants, targets or other projects' figures
/// are listed in NOT_MEASURED with the reason.
#[test]
fn measured_figures_in_the_documents_sit_next_to_a_benchmarks_md_reference() {
    let mut problems = Vec::new();
    let mut used = vec![false; NOT_MEASURED.len()];
    for document in DOCUMENTS {
        let text = read(document);
        for figure in document_figures(&text) {
            if figure.block.contains("BENCHMARKS.md") && has_date(&figure.block) {
                continue;
            }
            let exempt = NOT_MEASURED.iter().position(|&(doc, around, _)| {
                doc == document && covers(&figure.block, around, figure.at)
            });
            match exempt {
                Some(k) => used[k] = true,
                None => problems.push(format!(
                    "{document}:{}: {:?} is a measured figure without BENCHMARKS.md and the date \
                     of the run in its paragraph: point to BENCHMARKS.md's table instead, or \
                     quote it with BENCHMARKS.md and the date (a setting or a target goes in \
                     NOT_MEASURED, with the reason)",
                    figure.line, figure.text
                )),
            }
        }
    }
    for (k, (document, around, _)) in NOT_MEASURED.iter().enumerate() {
        if !used[k] {
            problems.push(format!(
                "NOT_MEASURED lists {around:?} in {document}, which has no such figure any more"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_figure_rule_finds_measurements_and_leaves_sizes_versions_and_products_alone() {
    let found = |text: &str| -> Vec<String> {
        figures(text)
            .into_iter()
            .map(|(a, b)| text[a..b].to_string())
            .collect()
    };
    let figures_of = [
        ("faster (1.8-2.3x) here", vec!["1.8-2.3x"]),
        ("5x faster to build", vec!["5x"]),
        ("waited at 83% full", vec!["83%"]),
        ("54 ns per call", vec!["54"]),
        ("in 2.5ms and 7-160 ms", vec!["2.5ms", "7-160"]),
        ("at 12.9 GB/s", vec!["12.9"]),
        ("20 to 500 times faster", vec!["500"]),
        ("0.90–1.08x", vec!["0.90–1.08x"]),
    ];
    for (text, want) in figures_of {
        assert_eq!(found(text), want, "{text}");
    }
    for text in [
        "8 x 128 heads",
        "64 KiB units",
        "HIP 5.2 and Rust 1.85",
        "0x10 and 2x2 and x86_64",
        "MI300X and gfx942",
        "`40 x 256 = 10240` bytes",
        "version 0.3.13.post1",
        "tp2to8 and h12p6d4",
        "3 times in a row",
        "1 using us",
    ] {
        assert_eq!(found(text), Vec::<String>::new(), "{text}");
    }
    let doc =
        "A paragraph\nover 2 lines with 3x.\n\n- an item 4x\n  continued\n- next\n| row 5% |\n";
    let b = blocks(doc);
    assert_eq!(
        b.iter().map(|(line, _)| *line).collect::<Vec<_>>(),
        [1, 4, 6, 7]
    );
    assert_eq!(b[1].1, "- an item 4x\n  continued");
    assert!(has_date("measured 2026-12-01.") && !has_date("version 2026-12"));
    let block = "backs off to\n  1 ms while idle";
    assert!(covers(block, "to 1 ms while", (15, 16)));
    assert!(!covers(block, "to 1 ms while", (0, 5)));
    let f = document_figures(doc);
    assert_eq!(
        f.iter()
            .map(|f| (f.line, f.text.as_str()))
            .collect::<Vec<_>>(),
        [(2, "3x."), (4, "4x"), (7, "5%")]
    );
}

// ---------------------------------------------------------------------------------------------
// Module order

/// `src/` text of a module without its test code: items under an attribute that names
/// `test` in a `cfg` are dropped (a `mod x { ... }` to its closing brace, a one-line item).
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(") && t.contains("test") {
            // Skip the item: to the end of its braces, or its one line.
            let mut depth = 0i64;
            for item in lines.by_ref() {
                let t = item.trim_start();
                if t.starts_with("#[") && depth == 0 {
                    continue;
                }
                depth += item.matches('{').count() as i64 - item.matches('}').count() as i64;
                if depth <= 0 && (item.contains('}') || item.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Code without its `//` comments (doc comments' intra-doc links are not imports).
fn without_comments(code: &str) -> String {
    code.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level identifiers of a `crate::{...}` group starting at `group` (after the brace).
fn group_names(group: &str) -> Vec<String> {
    let mut names = Vec::new();
    let (mut depth, mut word, mut leading) = (0, String::new(), true);
    for c in group.chars() {
        match c {
            '{' => {
                depth += 1;
            }
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            c if c.is_alphanumeric() || c == '_' => {
                if depth == 0 && leading {
                    word.push(c);
                }
            }
            _ => {
                if !word.is_empty() {
                    names.push(std::mem::take(&mut word));
                }
                if depth == 0 {
                    leading = c == ',' || (c.is_whitespace() && leading);
                }
            }
        }
    }
    if !word.is_empty() {
        names.push(word);
    }
    names
}

/// Names `lib.rs` re-exports at the crate root, and the module each comes from.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (at, _) in lib.match_indices("pub use ") {
        let rest = &lib[at + "pub use ".len()..];
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        let Some((module, names)) = statement.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.split(" as ").last().unwrap_or("").trim();
            if !name.is_empty() && name != "self" && !name.contains("::") {
                out.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules of `src/` (test-only ones left out) and, for each, the modules its
/// code outside tests names through `crate::` (directly, in a `crate::{...}` group, or through
/// a name `lib.rs` re-exports).
fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = root().join("src");
    let lib = read("src/lib.rs");
    let mut modules = BTreeSet::new();
    let mut previous = "";
    for line in lib.lines() {
        let t = line.trim();
        let declared = t
            .strip_prefix("pub mod ")
            .or_else(|| t.strip_prefix("mod "))
            .and_then(|n| n.strip_suffix(';'));
        let test_only = previous.starts_with("#[cfg(") && previous.contains("test");
        if let Some(name) = declared.filter(|_| !test_only) {
            modules.insert(name.to_string());
        }
        if !t.is_empty() && !t.starts_with("//") {
            previous = t;
        }
    }
    let reexported = reexports(&lib);
    let mut graph = BTreeMap::new();
    for module in &modules {
        let mut files = Vec::new();
        let dir = src.join(module);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        }
        let file = src.join(format!("{module}.rs"));
        if file.is_file() {
            files.push(file);
        }
        assert!(!files.is_empty(), "no source for module {module}");
        let mut imports = BTreeSet::new();
        for file in files {
            let code = without_comments(&without_tests(
                &std::fs::read_to_string(&file).expect("a source file"),
            ));
            for (at, _) in code.match_indices("crate::") {
                let rest = &code[at + "crate::".len()..];
                let names = match rest.strip_prefix('{') {
                    Some(group) => group_names(group),
                    None => vec![
                        rest.chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect(),
                    ],
                };
                for name in names {
                    let target = if modules.contains(&name) {
                        Some(name)
                    } else {
                        reexported.get(&name).cloned()
                    };
                    if let Some(target) = target.filter(|t| t != module) {
                        imports.insert(target);
                    }
                }
            }
        }
        graph.insert(module.clone(), imports);
    }
    graph
}

/// REFERENCE.md section 10's table of modules, in order.
fn reference_order() -> Vec<String> {
    let reference = read("REFERENCE.md");
    let start = reference.find("\n## 10.").expect("REFERENCE.md section 10");
    let section = &reference[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |k| k + 1)];
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`').map(|(name, _)| name.to_string()))
        .collect()
}

/// README.md's list of `src/`, in order: the `x.rs` and `x/` of its paragraph.
fn readme_order() -> Vec<String> {
    let readme = read("README.md");
    let start = readme
        .find("`src/` reads top-down")
        .expect("README.md's paragraph on src/");
    let paragraph = &readme[start..];
    let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
    paragraph
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| {
            code.strip_suffix(".rs")
                .or_else(|| code.strip_suffix('/'))
                .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                .filter(|name| *name != "src")
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn reference_and_readme_list_the_modules_in_an_order_the_imports_respect() {
    let graph = import_graph();
    let order = reference_order();
    let listed: BTreeSet<String> = order.iter().cloned().collect();
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    assert_eq!(
        listed, modules,
        "REFERENCE.md section 10 must list every module of src/ once"
    );
    assert_eq!(
        order.len(),
        listed.len(),
        "a module listed twice: {order:?}"
    );
    let mut problems = Vec::new();
    for (k, module) in order.iter().enumerate() {
        for import in &graph[module] {
            if !order[..k].contains(import) {
                problems.push(format!(
                    "{module} imports {import}, which REFERENCE.md section 10 lists below it"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(
        readme_order(),
        order,
        "README.md's list of src/ must follow REFERENCE.md section 10"
    );
}

#[test]
fn the_import_graph_sees_groups_reexports_and_skips_tests() {
    assert_eq!(
        group_names("error::{Error, Result}, layout::Layout, Plan};"),
        ["error", "layout", "Plan"]
    );
    let lib = "pub use plan::{\n    Plan, plan as make_plan,\n};\npub use send::send_host;\n";
    let map = reexports(lib);
    assert_eq!(map["Plan"], "plan");
    assert_eq!(map["make_plan"], "plan");
    assert_eq!(map["send_host"], "send");
    let code = "use crate::slice;\n#[cfg(test)]\nmod tests {\n    use crate::send;\n    fn f() {}\n}\n#[cfg(test)]\nuse crate::pool;\nfn g() {}\n";
    let kept = without_tests(code);
    assert!(
        kept.contains("crate::slice") && kept.contains("fn g"),
        "{kept}"
    );
    assert_eq!(
        without_comments("use crate::a; // crate::b\n/// [`crate::c`]"),
        "use crate::a; \n"
    );
    assert!(
        !kept.contains("crate::send") && !kept.contains("crate::pool"),
        "{kept}"
    );
    // The real graph: plan uses layout (which is why layout is listed above it).
    assert!(import_graph()["plan"].contains("layout"));
}

// ---------------------------------------------------------------------------------------------
// The static library's dependencies

#[test]
fn the_readme_names_the_static_librarys_dependencies_as_cargo_tree_lists_them() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = |features: &[&str]| -> BTreeSet<String> {
        let output = Command::new(&cargo)
            .args([
                "tree",
                "--offline",
                "-p",
                "mori-tp",
                "-e",
                "normal,no-proc-macro",
                "--prefix",
                "none",
                "--format",
                "{p}",
            ])
            .args(features)
            .current_dir(root())
            .output()
            .expect("run cargo tree");
        assert!(
            output.status.success(),
            "cargo tree: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| *name != "mori-tp")
            .map(str::to_string)
            .collect()
    };
    let readme = read("README.md");
    let start = readme
        .find("The static library contains only mori-tp")
        .expect("README.md's sentence on the static library");
    let paragraph = &readme[start..];
    let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
    let named: BTreeSet<String> = paragraph
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| {
            code.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c == '-')
        })
        .map(str::to_string)
        .collect();
    let with_hip = tree(&["--features", "hip"]);
    let with_cuda = tree(&["--features", "cuda"]);
    let default = tree(&[]);
    for name in default.iter().chain(&with_hip).chain(&with_cuda) {
        assert!(
            named.contains(name),
            "cargo tree lists {name}, which README.md's sentence on the static library does not \
             name: {paragraph}"
        );
    }
    for name in &named {
        assert!(
            with_hip.contains(name)
                || with_cuda.contains(name)
                || ["c-logging", "hip", "cuda"].contains(&name.as_str()),
            "README.md names {name} as a dependency of the static library; cargo tree does not"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// BENCHMARKS.md

/// BENCHMARKS.md's tables are blocks that `benches/regenerate` wrote: each has a header with the
/// date, the commit, the machine and the exact command, holds a table, and the Targets table
/// equals what the tables give (`benches/regenerate --check`, which measures nothing).
#[test]
fn benchmarks_md_holds_tables_that_benches_regenerate_wrote() {
    let Ok(output) = Command::new("python3")
        .arg(root().join("benches/regenerate"))
        .arg("--check")
        .current_dir(root())
        .output()
    else {
        common::skip_missing(
            "benchmarks_md_holds_tables_that_benches_regenerate_wrote",
            "MORI_TP_REQUIRE_TOOLS",
            "python3 is not installed",
        );
        return;
    };
    assert!(
        output.status.success(),
        "benches/regenerate --check:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
