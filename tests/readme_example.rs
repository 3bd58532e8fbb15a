//! The documents' snippets run as written. Every fenced block of README.md and the docs/ book
//! whose info string says `runnable` is run as a reader would: C (`c runnable`) is compiled
//! with every warning an error against the header and the static library this test run built,
//! C++ (`cpp runnable`) likewise under C++17, Python (`python runnable`) runs against the shared
//! library and the package in python/, and each must exit 0 and print exactly the `text output`
//! block that follows it, where there is one. (`sh runnable` blocks are `mori-tp` commands:
//! cli/tests/readme.rs runs them against the built binary.) Each runs in a scratch folder, so
//! nothing is written into the checkout.
//!
//! The worked example of docs/src/guides/c-head-major.md is also checked against the contract's
//! formulas, restated here, so that the page shows what the library returns and what the
//! contract promises.
//!
//! Needs `cc`, `c++` and `python3`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    Fenced, STATIC_LIBS, built_static_library, hip_link, root, run, runnable_snippets, scratch,
    skip_missing,
};

/// The page of the worked example, and the heading of its program.
const WORKED_EXAMPLE: &str = "docs/src/guides/c-head-major.md";

/// The worked example's program and the output the page shows for it.
fn example() -> (String, String) {
    let (block, output) = runnable_snippets()
        .into_iter()
        .find(|(block, _)| block.document == WORKED_EXAMPLE && block.language == "c")
        .expect("the worked example's `c runnable` block");
    (
        block.text,
        output.expect("the worked example's `text output` block"),
    )
}

/// What the contract says the example prints: prefill rank 5 of TP 8 and decode rank 1 of TP 2,
/// HND pages of 16 slots of 256-byte heads, head 5, a 40-token request on prefill pages
/// {3, 4, 9} and decode pages {7, 2, 8}.
fn by_the_contract() -> String {
    let (page_size, hb, tokens) = (16u64, 256u64, 40u64);
    // HND: token_stride = head_bytes, head_stride = page_size * head_bytes, page_stride = L *
    // page_size * head_bytes, with L local heads (8 / 8 = 1 and 8 / 2 = 4).
    let layout = |tp: u64, rank: u64, local: u64| {
        format!(
            "total_kv_heads 8, tp_size {tp}, tp_rank {rank}, page_size {page_size}, head_bytes \
             {hb},\n    page_stride {}, offset 0, token_stride {hb}, head_stride {}",
            local * page_size * hb,
            page_size * hb
        )
    };
    let mut out = format!(
        "prefill rank 5: {}\ndecode rank 1: {}\n",
        layout(8, 5, 1),
        layout(2, 1, 4)
    );
    // Decode rank 1 owns heads 4-7: head 5 is its local head 1; prefill rank 5's only head.
    out += "pair: action SEND, first_head 5, num_heads 1, src_first_local 0, dst_first_local 1\n";
    // The prefill pages hold the slice and nothing else; the decode pages do not: DST.
    out += &format!("staging: DST, {} bytes per buffer\n", tokens * hb);
    let (src_pages, dst_pages) = ([3u64, 4, 9], [7u64, 2, 8]);
    let tokens_of = |i: usize| (tokens - i as u64 * page_size).min(page_size);
    let line = |src: u64, dst: u64, len: u64| {
        format!("    src_offset {src:>6}  dst_offset {dst:>6}  length {len:>4}\n")
    };
    // Pages to pages: each page's block of head 5, one segment per page (no two pairs of
    // pages are adjacent on both sides).
    out += "pages to pages: 3 segments per buffer\n";
    for i in 0..3 {
        let src = src_pages[i] * page_size * hb;
        let dst = dst_pages[i] * 4 * page_size * hb + page_size * hb;
        out += &line(src, dst, tokens_of(i) * hb);
    }
    // Staged: the region holds the tokens in order; prefill pages 3 and 4 are adjacent.
    out += "staged: 2 segments per buffer\n";
    out += &line(3 * page_size * hb, 0, 2 * page_size * hb);
    out += &line(9 * page_size * hb, 2 * page_size * hb, tokens_of(2) * hb);
    out
}

#[test]
fn the_worked_example_prints_what_its_page_shows_and_the_contract_says() {
    let (_, shown) = example();
    assert_eq!(
        shown,
        by_the_contract(),
        "{WORKED_EXAMPLE}'s numbers against the contract"
    );
    // The program itself runs with the other snippets, below.
}

/// The shared library this test run built (target/<profile>/deps, else target/<profile>).
fn built_shared_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps");
    [deps, deps.parent().expect("target/<profile>")]
        .iter()
        .map(|dir| dir.join("libmori_tp.so"))
        .find(|path| path.is_file())
        .expect("cargo builds libmori_tp.so with the library (crate-type cdylib)")
}

/// Runs one snippet in `dir` and returns what it printed on stdout; fails with its output when
/// it does not build or exits non-zero.
fn run_snippet(block: &Fenced, dir: &Path) -> String {
    let (source, compiler, standard) = match block.language.as_str() {
        "c" => ("snippet.c", "cc", "-std=c99"),
        "cpp" => ("snippet.cpp", "c++", "-std=c++17"),
        "python" => ("snippet.py", "python3", ""),
        other => panic!(
            "{}:{}: a `{other} runnable` block, which no test runs (c, cpp, python here; sh in \
             cli/tests/readme.rs)",
            block.document, block.line
        ),
    };
    let file = dir.join(source);
    std::fs::write(&file, &block.text).expect("write the snippet");
    let mut program = if block.language == "python" {
        let mut command = Command::new("python3");
        command
            .arg(&file)
            .env("PYTHONPATH", root().join("python"))
            .env("MORI_TP_LIBRARY", built_shared_library())
            .env("PYTHONDONTWRITEBYTECODE", "1");
        command
    } else {
        let exe = dir.join("snippet");
        let mut compile = Command::new(compiler);
        compile
            .args([standard, "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
            .arg(root().join("include"))
            .arg(&file)
            .arg(built_static_library())
            .args(STATIC_LIBS.split(' '))
            .args(hip_link())
            .arg("-o")
            .arg(&exe);
        run(&mut compile);
        Command::new(&exe)
    };
    let output = program.current_dir(dir).output().unwrap_or_else(|e| {
        panic!(
            "cannot run the snippet of {}:{}: {e}",
            block.document, block.line
        )
    });
    assert!(
        output.status.success(),
        "the snippet of {}:{} failed ({}):\n{}{}",
        block.document,
        block.line,
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn every_runnable_snippet_of_the_documents_runs_and_prints_what_is_shown() {
    let snippets: Vec<(Fenced, Option<String>)> = runnable_snippets()
        .into_iter()
        .filter(|(block, _)| block.language != "sh")
        .collect();
    for language in ["c", "cpp", "python"] {
        assert!(
            snippets
                .iter()
                .any(|(b, _)| b.document == "README.md" && b.language == language),
            "README.md must show a `{language} runnable` example"
        );
    }
    // A code block a reader might copy either runs here or says it is a sketch.
    for (document, text) in common::user_documents() {
        for block in common::fenced_blocks(&document, &text) {
            if ["c", "cpp", "python", "rust"].contains(&block.language.as_str()) {
                assert!(
                    block.has("runnable") || block.has("sketch"),
                    "{document}:{}: a `{}` block must be `runnable` (a test runs it) or say it \
                     is a `sketch`",
                    block.line,
                    block.language
                );
            }
        }
    }
    if Command::new("python3").arg("--version").output().is_err() {
        skip_missing(
            "every_runnable_snippet_of_the_documents_runs_and_prints_what_is_shown",
            "MORI_TP_REQUIRE_TOOLS",
            "python3 is not installed: the Python snippets cannot run",
        );
        return;
    }
    for (k, (block, shown)) in snippets.iter().enumerate() {
        let dir = scratch(&["snippets", &k.to_string()]);
        let printed = run_snippet(block, &dir);
        if let Some(shown) = shown {
            assert_eq!(
                &printed, shown,
                "the snippet of {}:{} printed something else than the page shows",
                block.document, block.line
            );
        }
        let left: Vec<_> = std::fs::read_dir(root())
            .expect("the root")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("snippet"))
            .collect();
        assert!(
            left.is_empty(),
            "a snippet wrote {left:?} into the checkout"
        );
    }
}
