//! The documents tell the truth about what can be checked without a measurement: measured
//! figures are BENCHMARKS.md's (which `benches/regenerate` writes), the module order of
//! REFERENCE.md section 10 and of docs/src/design/source-layout.md is the import order of
//! `src/`, and docs/src/guides/link-c.md names the static library's dependencies as `cargo tree`
//! lists them. And the docs/ book holds together: SUMMARY.md links every page and every page it
//! links exists, each page asks one question in its title, every link between documents (and
//! every `docs/src/<page>.md#<anchor>` the sources cite) lands on a page and a heading that exist,
//! the test map names every test file, README.md stays a short page, and no user document talks
//! about how the project itself is run.

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

/// The user documents whose measured figures must come from BENCHMARKS.md: these, and every
/// page of the docs/ book.
const DOCUMENTS: [&str; 3] = ["README.md", "REFERENCE.md", "python/README.md"];

/// DOCUMENTS and the book's pages, as (path, text).
fn all_documents() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> =
        DOCUMENTS.iter().map(|d| (d.to_string(), read(d))).collect();
    out.extend(
        common::user_documents()
            .into_iter()
            .filter(|(path, _)| path != "README.md"),
    );
    out
}

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
    for (document, text) in all_documents() {
        let document = document.as_str();
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

/// The page on the source's list of `src/`, in order: the `x.rs` and `x/` of its paragraph.
const SOURCE_LAYOUT: &str = "docs/src/design/source-layout.md";

fn readme_order() -> Vec<String> {
    let readme = read(SOURCE_LAYOUT);
    let start = readme
        .find("`src/` reads top-down")
        .expect("the source-layout page's paragraph on src/");
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
        "{SOURCE_LAYOUT}'s list of src/ must follow REFERENCE.md section 10"
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

/// The page on linking from C and C++.
const LINK_C: &str = "docs/src/guides/link-c.md";

#[test]
fn the_linking_page_names_the_static_librarys_dependencies_as_cargo_tree_lists_them() {
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
    let readme = read(LINK_C);
    let start = readme
        .find("The static library contains only mori-tp")
        .expect("the linking page's sentence on the static library");
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
            "cargo tree lists {name}, which {LINK_C}'s sentence on the static library does not \
             name: {paragraph}"
        );
    }
    for name in &named {
        assert!(
            with_hip.contains(name)
                || with_cuda.contains(name)
                || ["c-logging", "hip", "cuda"].contains(&name.as_str()),
            "{LINK_C} names {name} as a dependency of the static library; cargo tree does not"
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

// ---------------------------------------------------------------------------------------------
// The docs/ book

/// The anchor a heading gets (GitHub's and mdBook's rule): lower case, spaces as hyphens, every
/// other character but letters, digits, `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown document: one per heading outside fenced blocks.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// The relative Markdown links of a document, outside fenced blocks and code spans: the targets
/// of `[text](target)` that are not URLs.
fn relative_links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans hold code, not links.
        let prose: String = line
            .split('`')
            .enumerate()
            .filter(|(k, _)| k % 2 == 0)
            .map(|(_, part)| part)
            .collect::<Vec<_>>()
            .join(" ");
        for (at, _) in prose.match_indices("](") {
            let rest = &prose[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push(target.to_string());
            }
        }
    }
    out
}

/// Where a link `target` of the document at `from` lands: (file relative to the root, anchor).
fn resolve(from: &str, target: &str) -> (String, Option<String>) {
    let (path, fragment) = match target.split_once('#') {
        Some((path, fragment)) => (path, Some(fragment.to_string())),
        None => (target, None),
    };
    if path.is_empty() {
        return (from.to_string(), fragment);
    }
    let mut parts: Vec<&str> = from.split('/').collect();
    parts.pop();
    for part in path.split('/') {
        match part {
            "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    (parts.join("/"), fragment)
}

/// SUMMARY.md's links, in order.
fn summary_pages() -> Vec<String> {
    relative_links(&read("docs/src/SUMMARY.md"))
        .into_iter()
        .map(|target| resolve("docs/src/SUMMARY.md", &target).0)
        .collect()
}

/// The book is an mdBook: docs/book.toml, docs/src/SUMMARY.md linking every page once, and
/// every page it links exists. Each page's title (its one `# ` heading) is the question it
/// answers, so it ends with a question mark.
#[test]
fn the_books_summary_links_every_page_once_and_every_page_asks_one_question() {
    let book = read("docs/book.toml");
    assert!(
        book.contains("[book]") && book.contains("src = \"src\""),
        "docs/book.toml must be an mdBook's: {book}"
    );
    let linked = summary_pages();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for page in &linked {
        if !seen.insert(page.clone()) {
            problems.push(format!("SUMMARY.md links {page} twice"));
        }
        if !root().join(page).is_file() {
            problems.push(format!("SUMMARY.md links {page}, which does not exist"));
        }
    }
    for (page, text) in common::user_documents() {
        if page == "README.md" || page == "docs/src/SUMMARY.md" {
            continue;
        }
        if !seen.contains(&page) {
            problems.push(format!(
                "{page} is a page of the book that SUMMARY.md does not link"
            ));
        }
        let mut fenced = false;
        let titles: Vec<&str> = text
            .lines()
            .filter(|l| {
                fenced ^= l.starts_with("```");
                !fenced && l.starts_with("# ")
            })
            .collect();
        match titles.as_slice() {
            [title] if title.trim_end().ends_with('?') => {}
            _ => problems.push(format!(
                "{page} must have one title, the question it answers: {titles:?}"
            )),
        }
    }
    assert!(
        linked.len() >= 20,
        "SUMMARY.md links only {} pages",
        linked.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every relative link of README.md, the book, python/README.md and REFERENCE.md lands on a file
/// that exists and, with an anchor, on a heading of that file.
#[test]
fn every_link_between_the_documents_lands_on_a_page_and_a_heading() {
    let mut documents = common::user_documents();
    for extra in ["python/README.md", "REFERENCE.md", "BENCHMARKS.md"] {
        documents.push((extra.to_string(), read(extra)));
    }
    let mut problems = Vec::new();
    let mut checked = 0;
    for (document, text) in &documents {
        for target in relative_links(text) {
            let (file, fragment) = resolve(document, &target);
            checked += 1;
            let path = root().join(&file);
            if !path.exists() {
                problems.push(format!("{document} links {target}: {file} does not exist"));
                continue;
            }
            if let Some(fragment) = fragment {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if !anchors(&text).contains(&fragment) {
                    problems.push(format!(
                        "{document} links {target}: {file} has no heading #{fragment}"
                    ));
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} links found");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(anchor("The device check"), "the-device-check");
    assert_eq!(anchor(" C++: mori_tp.hpp"), "c-mori_tphpp");
    assert_eq!(
        resolve("docs/src/guides/cli.md", "../design/test-map.md#beside"),
        ("docs/src/design/test-map.md".into(), Some("beside".into()))
    );
    assert_eq!(
        relative_links("see [a](x.md#y), `[b](no.md)` and [c](https://e.org)"),
        ["x.md#y"]
    );
}

/// Text files of the checkout that code lives in (sources, build files, scripts, tests).
fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a checkout directory") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | "build" | "__pycache__")
                && !name.starts_with('.')
                || name == ".ci"
            {
                source_files(&path, out);
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

/// Where code cites a page of the book, it names it by path and anchor
/// (`docs/src/guides/build-nvidia.md#the-device-check`), and both exist; no source cites a
/// section of README.md by its title any more (README.md is a short page whose sections moved
/// into the book).
#[test]
fn every_page_the_sources_cite_exists_with_its_heading() {
    let mut files = Vec::new();
    source_files(&root(), &mut files);
    let mut problems = Vec::new();
    let mut cited = 0;
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let shown = file
            .strip_prefix(root())
            .unwrap_or(file)
            .display()
            .to_string();
        for (at, _) in text.match_indices("docs/src/") {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || "/._-#".contains(c)))
                .unwrap_or(rest.len());
            let citation = rest[..end].trim_end_matches('.');
            let (page, fragment) = match citation.split_once('#') {
                Some((page, fragment)) => (page, Some(fragment)),
                None => (citation, None),
            };
            if !page.ends_with(".md") {
                continue; // the folder itself (docs/src/)
            }
            cited += 1;
            let Ok(target) = std::fs::read_to_string(root().join(page)) else {
                problems.push(format!("{shown} cites {citation}: {page} does not exist"));
                continue;
            };
            if let Some(fragment) = fragment
                && !anchors(&target).contains(fragment)
            {
                problems.push(format!(
                    "{shown} cites {citation}: {page} has no such heading"
                ));
            }
        }
        // Spelled in halves, so that this list does not match itself.
        for stale in [
            concat!("README", ", \""),
            concat!("README", ".md (\""),
            concat!("README", ".md, \""),
            concat!("of ", "README.md)"),
            concat!("see the ", "README)"),
            concat!("see the ", "README for"),
        ] {
            // python/README.md and cli/configs/README.md keep their sections.
            let cited = text.match_indices(stale).any(|(at, _)| {
                !text[..at].ends_with("python/") && !text[..at].ends_with("configs/")
            });
            if cited {
                problems.push(format!(
                    "{shown} cites a section of README.md ({stale:?}): cite the book's page by \
                     path and anchor"
                ));
            }
        }
    }
    assert!(cited >= 5, "only {cited} citations of the book found");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Words about how the project itself is run (its issue tracker, its sessions, its development
/// machine) have no place in a user document: a benchmark names the machine it ran on, not the
/// process that ran it. Each pattern, case-insensitive.
const PROCESS_WORDS: &[&str] = &[
    "issue 1",
    "issue 2",
    "issue 3",
    "issue 4",
    "issue 5",
    "issue 6",
    "issue 7",
    "issue 8",
    "issue 9",
    "issues 1",
    "issues 2",
    "issues 3",
    "issues 4",
    "issues 5",
    "issues 6",
    "issues 7",
    "issues 8",
    "issues 9",
    "issue #",
    "no session",
    "a session",
    "the session",
    "session of",
    "development vm",
    "development machine",
    "the helper",
    "a helper",
];

#[test]
fn no_user_document_talks_about_how_the_project_is_run() {
    let mut documents = common::user_documents();
    for extra in [
        "REFERENCE.md",
        "python/README.md",
        "BENCHMARKS.md",
        "cli/configs/README.md",
    ] {
        documents.push((extra.to_string(), read(extra)));
    }
    let mut problems = Vec::new();
    for (document, text) in &documents {
        let flat = text
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase();
        for word in PROCESS_WORDS {
            if let Some(at) = flat.find(word) {
                let from = flat[..at]
                    .char_indices()
                    .rev()
                    .nth(40)
                    .map_or(0, |(i, _)| i);
                let context: String = flat[from..].chars().take(100).collect();
                problems.push(format!("{document}: {word:?} in \"...{context}...\""));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// docs/src/design/test-map.md names every test file (tests/*.rs, the programs and stand-ins the
/// tests build, cli/tests/*.rs, python/tests/*.py), and every file it names exists.
#[test]
fn the_test_map_names_every_test_file_and_only_files_that_exist() {
    let map = read("docs/src/design/test-map.md");
    let named: BTreeSet<String> = map
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| {
            ["tests/", "cli/tests/", "python/tests/"]
                .iter()
                .any(|dir| code.starts_with(dir))
                && code.contains('.')
                && !code.contains(' ')
        })
        .map(str::to_string)
        .collect();
    let mut problems = Vec::new();
    for file in &named {
        if !root().join(file).is_file() {
            problems.push(format!("the test map names {file}, which does not exist"));
        }
    }
    for dir in [
        "tests",
        "tests/gpu_engine",
        "tests/c",
        "tests/kernel",
        "tests/fake_hip",
        "tests/fake_cuda",
        "cli/tests",
        "python/tests",
    ] {
        for entry in std::fs::read_dir(root().join(dir)).expect("a test folder") {
            let path = entry.expect("an entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_file() && !name.ends_with(".pyc") && name != "__init__.py" {
                let file = format!("{dir}/{name}");
                if !named.contains(&file) {
                    problems.push(format!("the test map does not name {file}"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// README.md stays a short page (about 150 lines): what it is, the two commands, install, one
/// example per language, links. The two commands are there, and what `cargo run --release`
/// runs is the CLI's default: the `mori-tp` binary (the root package has none) simulating the
/// deployment the README names.
#[test]
fn the_readme_is_a_short_page_with_the_two_commands() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 160,
        "README.md has {lines} lines: about 150 is the aim; move the rest into the book"
    );
    for needed in [
        "cargo run --release",
        "cargo test",
        "package registries",
        "docs/src/SUMMARY.md",
    ] {
        assert!(readme.contains(needed), "README.md must say {needed:?}");
    }
    let main = read("cli/src/main.rs");
    for word in [
        "\"qwen2.5-7b\"",
        "\"--prefill-tp\",\n    \"2\"",
        "\"--decode-tp\",\n    \"8\"",
    ] {
        assert!(
            main.contains(word),
            "the CLI's default deployment changed ({word}): update README.md's `cargo run` line"
        );
    }
    assert!(
        readme.contains("Qwen2.5-7B from prefill TP 2 to decode TP 8"),
        "README.md must name the deployment `cargo run --release` simulates"
    );
    // The root package has no binary, so `cargo run` runs the only one of the default members.
    let root_manifest = read("Cargo.toml");
    assert!(!root_manifest.contains("[[bin]]") && !root().join("src/main.rs").exists());
    assert!(read("cli/Cargo.toml").contains("name = \"mori-tp\""));
}

// ---------------------------------------------------------------------------------------------
// BENCHMARKS.md's account of a full run

/// BENCHMARKS.md says how long a full `benches/regenerate` run took, from the headers of the
/// run of one commit: from the first header's start to the last one's start plus its minutes.
#[test]
fn the_full_run_time_benchmarks_md_states_is_what_its_headers_give() {
    let text = read("BENCHMARKS.md");
    let sentence_at = text
        .find("A full run of commit ")
        .expect("BENCHMARKS.md's sentence on a full run");
    let sentence = &text[sentence_at..];
    let words: Vec<&str> = sentence.split_whitespace().take(12).collect();
    // "A full run of commit <c> took <N> minutes ..."
    let commit = words[5];
    let claimed: f64 = words[7].parse().expect("a number of minutes");
    assert_eq!(words[8].trim_end_matches(','), "minutes", "{words:?}");
    let minute_of = |stamp: &str| -> f64 {
        let (h, m) = stamp.split_once(':').expect("HH:MM");
        h.parse::<f64>().unwrap() * 60.0 + m.parse::<f64>().unwrap()
    };
    let mut spans = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("Measured ")) {
        let parts: Vec<&str> = line.split_whitespace().collect();
        // "Measured DATE HH:MM UTC on commit C; ... Command (`benches/regenerate NAME`, M min)"
        if parts.get(6).map(|p| p.trim_end_matches(';')) != Some(commit) {
            continue;
        }
        let Some(command) = line.find("Command (`") else {
            continue;
        };
        let Some(at) = line[command..].find("`, ").map(|k| command + k) else {
            continue;
        };
        let minutes: f64 = line[at + 3..]
            .split_whitespace()
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or(0.0);
        let start = minute_of(parts[2]);
        spans.push((start, start + minutes));
    }
    assert!(
        spans.len() >= 10,
        "BENCHMARKS.md's claim names commit {commit}, whose run left {} headers: re-measure the \
         full run and say so",
        spans.len()
    );
    let first = spans.iter().map(|s| s.0).fold(f64::MAX, f64::min);
    let last = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    let took = last - first;
    assert!(
        (took - claimed).abs() <= 1.0,
        "the headers of commit {commit} span {took:.1} minutes; BENCHMARKS.md says {claimed}"
    );
}
