//! The README's worked example (vLLM's head-major layout on ROCm, 8 KV heads, prefill TP 8 ->
//! decode TP 2) as a C program: the `c` block under its heading is compiled against the header
//! and the static library this test run built, run, and must print exactly the `text` block
//! that follows it. Its numbers are also checked against the contract's formulas, restated
//! here, so that the README shows what the library returns and what the contract promises.
//!
//! Needs `cc`.

mod common;

use std::process::Command;

use common::{STATIC_LIBS, built_static_library, hip_link, root, run, scratch};

const HEADING: &str = "### Worked example: vLLM's head-major layout on ROCm";

/// The first fenced block of kind `fence` after `from` in `text`, and where it ends.
fn block<'a>(text: &'a str, from: usize, fence: &str) -> (&'a str, usize) {
    let open = format!("```{fence}\n");
    let start = from
        + text[from..]
            .find(&open)
            .unwrap_or_else(|| panic!("no ```{fence} block after the heading"))
        + open.len();
    let end = start + text[start..].find("```").expect("the block ends");
    (&text[start..end], end + 3)
}

/// The program and the output the README shows for it.
fn example() -> (String, String) {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let at = readme.find(HEADING).expect("the worked example's heading");
    let (program, end) = block(&readme, at, "c");
    let (output, _) = block(&readme, end, "text");
    (program.to_string(), output.to_string())
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
fn the_readmes_worked_example_prints_what_the_readme_shows_and_the_contract_says() {
    let (program, shown) = example();
    assert_eq!(
        shown,
        by_the_contract(),
        "the README's numbers against the contract"
    );
    let dir = scratch(&["readme-example"]);
    let source = dir.join("example.c");
    std::fs::write(&source, &program).expect("write the program");
    let exe = dir.join("example");
    let mut compile = Command::new("cc");
    compile
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(root().join("include"))
        .arg(&source)
        .arg(built_static_library())
        .args(STATIC_LIBS.split(' '))
        .args(hip_link())
        .arg("-o")
        .arg(&exe);
    run(&mut compile);
    let printed = run(&mut Command::new(&exe));
    assert_eq!(printed, shown, "the program printed something else");
}
