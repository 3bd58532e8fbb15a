//! The committed C header must be exactly what cbindgen generates from the Rust source.
//!
//! Run `MORI_TP_UPDATE_HEADER=1 cargo test --test header` to regenerate it after changing the
//! C API or its doc comments.

use std::path::Path;

#[test]
fn committed_header_matches_the_rust_source() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = crate_dir.join("include/mori_tp.h");
    if std::env::var_os("MORI_TP_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("write include/mori_tp.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/mori_tp.h is stale: regenerate it with \
         `MORI_TP_UPDATE_HEADER=1 cargo test --test header` and commit the result"
    );
}

#[test]
fn the_header_speaks_to_c_programmers_only() {
    // cbindgen copies doc comments verbatim: Rust-only sections and link syntax must not leak
    // into the reference a C++ programmer reads.
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mori_tp.h"))
            .expect("read include/mori_tp.h");
    for rust_only in [
        "# Safety", "# Panics", "# Errors", "[`", "`]", "crate::", "Option<", "Result<",
    ] {
        let line = header.lines().position(|l| l.contains(rust_only));
        assert!(
            line.is_none(),
            "include/mori_tp.h line {}: Rust-only text {rust_only:?}",
            line.unwrap_or(0) + 1
        );
    }
}
