//! Build script of the mori-tp library. Each job is one function called from `main`.

use std::env;
use std::fs;
use std::path::Path;

fn main() {
    set_soname();
}

/// Gives libmori_tp.so the SONAME `libmori_tp.so.<ABI version>`, so that a program linked
/// against one ABI never loads a library of another. The number is the generated header's
/// `MORI_TP_ABI_VERSION`, which is what `mori_abi_version()` returns (tests/packaging.rs reads
/// the SONAME back and compares). ELF platforms only: Apple's install names and Windows' DLLs
/// version differently.
fn set_soname() {
    let header = Path::new(&env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("include/mori_tp.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let unix = env::var("CARGO_CFG_TARGET_FAMILY").is_ok_and(|f| f.split(',').any(|f| f == "unix"));
    let apple = env::var("CARGO_CFG_TARGET_VENDOR").is_ok_and(|v| v == "apple");
    if !unix || apple {
        return;
    }
    let text = fs::read_to_string(&header)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", header.display()));
    let abi = text
        .lines()
        .find_map(|line| line.strip_prefix("#define MORI_TP_ABI_VERSION "))
        .map(str::trim)
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or_else(|| {
            panic!(
                "{} defines no numeric MORI_TP_ABI_VERSION",
                header.display()
            )
        });
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmori_tp.so.{abi}");
}
