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

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// (doc comment, return type, name, parameters) of each function the header declares.
fn declarations() -> Vec<(String, String, String, String)> {
    let header = read("include/mori_tp.h");
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
    functions
}

/// (alias, function) for each name from before the prefix, as the header documents it.
fn aliases() -> Vec<(String, String)> {
    declarations()
        .into_iter()
        .filter(|(_, _, name, _)| !name.starts_with("mori_tp_"))
        .filter_map(|(doc, _, name, _)| {
            let target = doc.trim_start().strip_prefix("Alias of ")?;
            Some((name, target.split([' ', ',']).next()?.to_string()))
        })
        .collect()
}

/// Whether `text` names `name` as a whole identifier (not as part of a longer one).
fn names(text: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(name).any(|(at, _)| {
        !text[..at].chars().next_back().is_some_and(ident)
            && !text[at + name.len()..].chars().next().is_some_and(ident)
    })
}

/// Every function is `mori_tp_<noun>_<verb>`, but the names from before the prefix (`mori_`
/// alone is MORI's own, as in `mori_shmem_*`): each of those is documented as the alias of a
/// `mori_tp_` function the header also declares, with the same parameters and result.
#[test]
fn every_function_has_the_mori_tp_prefix_or_is_a_documented_alias() {
    let functions = declarations();
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

/// What users read and copy (the documents, the C++ header, the device programs) calls the
/// `mori_tp_` names; an alias appears only on a line that also names its function (REFERENCE.md's
/// table of aliases). The C tests keep calling the aliases on purpose: they check that both
/// names work.
#[test]
fn user_documents_and_programs_call_the_new_names() {
    let aliases = aliases();
    assert_eq!(aliases.len(), 14, "{aliases:?}");
    assert!(names("a mori_version() b", "mori_version"));
    assert!(!names(
        "mori_tp_version mori_send_kvcache_pair",
        "mori_send_kvcache"
    ));
    let mut files: Vec<String> = [
        "README.md",
        "REFERENCE.md",
        "BENCHMARKS.md",
        "python/README.md",
        "include/mori_tp.hpp",
        "hip/device_test.cpp",
        "hip/bench.cpp",
        "hip/driver_cases.cpp",
    ]
    .iter()
    .map(|f| f.to_string())
    .collect();
    let mut pages = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src")];
    while let Some(dir) = pages.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/src") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                pages.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                let root = Path::new(env!("CARGO_MANIFEST_DIR"));
                files.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut found = Vec::new();
    for file in &files {
        for (number, line) in read(file).lines().enumerate() {
            for (alias, function) in &aliases {
                if names(line, alias) && !names(line, function) {
                    found.push(format!("{file}:{}: {alias} (call {function})", number + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "aliases where users read:\n{}",
        found.join("\n")
    );
}
