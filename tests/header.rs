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

/// The integer macros have the C types of what holds them, so that C++ deduces one type for a
/// field and its constant (`std::max(config.action, MORI_TP_ACTION_SEND)`): the enum values and
/// flag bits of uint32_t fields are `Nu`, the status codes (MoriStatus is int32_t) plain `N`,
/// and the version macros plain numbers that `#if` and stringizing take. A new macro must fall
/// in one of these families (give a u32 constant a `u32` literal in src/ffi/types.rs).
#[test]
fn integer_macros_have_the_types_of_the_fields_that_hold_them() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mori_tp.h"))
            .expect("read include/mori_tp.h");
    let mut seen = 0;
    for line in header.lines() {
        let Some(define) = line.strip_prefix("#define MORI_") else {
            continue;
        };
        let (name, value) = define.split_once(' ').unwrap_or((define, ""));
        let name = format!("MORI_{name}");
        if name == "MORI_TP_H" {
            continue; // the include guard
        }
        let digits = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
        let unsigned = value.strip_suffix('u').is_some_and(digits);
        let ok = if [
            "MORI_TP_ACTION_",
            "MORI_BACKEND_",
            "MORI_TP_STAGING_",
            "MORI_SEND_",
        ]
        .iter()
        .chain(&["MORI_TP_POOL_"])
        .any(|family| name.starts_with(family))
        {
            unsigned
        } else if name == "MORI_OK" || name.starts_with("MORI_ERR_") {
            digits(value)
        } else if name.starts_with("MORI_TP_VERSION") || name == "MORI_TP_ABI_VERSION" {
            // MORI_TP_VERSION is an expression of the three others.
            digits(value) || value.starts_with('(')
        } else {
            false
        };
        assert!(ok, "{name} is {value:?}: not of its family's type");
        seen += 1;
    }
    assert!(seen > 30, "only {seen} MORI_ macros found");
}

/// The header is C89: no `//` comment anywhere (`gcc -std=c89 -pedantic` refuses one, even after
/// `#endif`), which tests/c_api.rs also checks by compiling it.
#[test]
fn the_header_has_no_cpp_comments() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mori_tp.h"))
            .expect("read include/mori_tp.h");
    let mut in_comment = false;
    for (number, line) in header.lines().enumerate() {
        let mut rest = line;
        loop {
            if in_comment {
                match rest.find("*/") {
                    Some(end) => {
                        rest = &rest[end + 2..];
                        in_comment = false;
                    }
                    None => break,
                }
            } else {
                let open = rest.find("/*");
                let slash = rest.find("//");
                match (open, slash) {
                    (_, Some(s)) if open.is_none_or(|o| s < o) => {
                        panic!("include/mori_tp.h line {}: a // comment", number + 1)
                    }
                    (Some(o), _) => {
                        rest = &rest[o + 2..];
                        in_comment = true;
                    }
                    _ => break,
                }
            }
        }
    }
}

/// Every function is `mori_tp_<noun>_<verb>`, but the names from before the prefix (`mori_`
/// alone is MORI's own, as in `mori_shmem_*`): each of those is documented as the alias of a
/// `mori_tp_` function the header also declares, with the same parameters and result.
#[test]
fn every_function_has_the_mori_tp_prefix_or_is_a_documented_alias() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mori_tp.h"))
            .expect("read include/mori_tp.h");
    // (doc comment, return type, name, parameters) of each declaration.
    let mut functions = Vec::new();
    let mut doc = String::new();
    let mut lines = header.lines();
    while let Some(line) = lines.next() {
        if line.starts_with("/**") {
            doc.clear();
        }
        if line.starts_with(" *") || line.starts_with("/**") {
            doc.push_str(line.trim_start_matches(['/', '*', ' ']));
            doc.push(' ');
            continue;
        }
        let Some(open) = line.find("mori_").filter(|_| line.contains('(')) else {
            continue;
        };
        let mut declaration = line.to_string();
        while !declaration.trim_end().ends_with(");") {
            declaration.push_str(lines.next().expect("a declaration ends"));
        }
        let (returns, rest) = declaration.split_at(open);
        let (name, params) = rest.split_once('(').expect("a parameter list");
        let params: String = params.split_whitespace().collect::<Vec<_>>().join(" ");
        functions.push((
            doc.clone(),
            returns.trim().to_string(),
            name.to_string(),
            params,
        ));
    }
    assert!(
        functions.len() > 40,
        "only {} functions found",
        functions.len()
    );
    let mut aliases = 0;
    for (doc, returns, name, params) in &functions {
        if name.starts_with("mori_tp_") {
            continue;
        }
        let target = doc
            .trim_start()
            .strip_prefix("Alias of ")
            .and_then(|rest| rest.split([' ', ',']).next())
            .unwrap_or_else(|| panic!("{name} is neither mori_tp_* nor documented as an alias"));
        let new = functions
            .iter()
            .find(|(_, _, n, _)| n == target)
            .unwrap_or_else(|| panic!("{name} is an alias of {target}, which is not declared"));
        assert_eq!(
            (&new.1, &new.3),
            (returns, params),
            "{name} and {target} differ"
        );
        aliases += 1;
    }
    assert_eq!(
        aliases, 14,
        "the 14 names from before the prefix, each an alias"
    );
}
