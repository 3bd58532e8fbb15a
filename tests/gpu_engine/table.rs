//! The copy kernel's table from both builders: `hip/copy_table.hpp` (the C++ tests and
//! hip/bench build tables with it, and tests/fake_hip decodes them with it) and
//! `src/backend/copy_kernel.rs` (the library launches with it) must make the same bytes, the
//! same argument and the same grid from the same rects and bases. The C++ builder is compiled
//! with `c++ -shared` (tests/kernel/table_builder.cpp) and loaded with dlopen; without a C++
//! compiler the test says so and skips, unless MORI_TP_REQUIRE_TOOLS=1 (CI).

use std::ffi::{CString, c_void};
use std::process::Command;

use super::common;
use mori_tp::gpu_runtime::{KernelArgs, KernelTable};
use mori_tp::plan::CopyRect;

type Build = unsafe extern "C" fn(
    *const u64,
    usize,
    *const u64,
    *const u64,
    usize,
    *mut KernelArgs,
    *mut u8,
    usize,
    *mut usize,
    *mut u32,
    *mut i32,
) -> i32;

/// The C++ builder, or why it cannot be built.
fn cpp_builder() -> Result<Build, String> {
    let library = common::scratch(&["table-builder"])
        .join(format!("libtable_builder.{}.so", std::process::id()));
    let output = Command::new("c++")
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
        ])
        .arg(common::root().join("tests/kernel/table_builder.cpp"))
        .arg("-o")
        .arg(&library)
        .output()
        .map_err(|e| format!("cannot run c++ ({e})"))?;
    if !output.status.success() {
        return Err(format!(
            "c++ could not build tests/kernel/table_builder.cpp:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let path = CString::new(library.to_string_lossy().into_owned()).expect("no NUL");
    // SAFETY: a NUL-terminated path to a library without constructors that need anything.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return Err(format!("cannot load {}", library.display()));
    }
    // SAFETY: dlsym on a live handle with a NUL-terminated name.
    let symbol = unsafe { libc::dlsym(handle, c"mori_cpu_copy_table".as_ptr()) };
    if symbol.is_null() {
        return Err("mori_cpu_copy_table is missing".into());
    }
    // SAFETY: the entry point's C signature is `Build`.
    Ok(unsafe { std::mem::transmute::<*mut c_void, Build>(symbol) })
}

/// What the C++ builder makes of `rects` and `bases`: the argument, the table's bytes, the grid
/// and whether it fits in the argument; None when it refuses.
fn cpp_table(build: Build, rects: &[CopyRect], bases: &[(u64, u64)]) -> Option<Built> {
    let words: Vec<u64> = rects
        .iter()
        .flat_map(|r| {
            [
                r.src_offset,
                r.dst_offset,
                r.src_pitch,
                r.dst_pitch,
                r.width,
                r.height,
            ]
        })
        .collect();
    let src: Vec<u64> = bases.iter().map(|b| b.0).collect();
    let dst: Vec<u64> = bases.iter().map(|b| b.1).collect();
    let mut args = Box::new(KernelArgs::default());
    let (mut len, mut grid, mut fits) = (0usize, [0u32; 2], 0i32);
    let mut table = vec![0u8; 4096];
    loop {
        // SAFETY: every pointer is valid for the lengths passed.
        let status = unsafe {
            build(
                words.as_ptr(),
                rects.len(),
                src.as_ptr(),
                dst.as_ptr(),
                bases.len(),
                &mut *args,
                table.as_mut_ptr(),
                table.len(),
                &mut len,
                grid.as_mut_ptr(),
                &mut fits,
            )
        };
        match status {
            0 => {
                table.truncate(len);
                return Some((*args, table, (grid[0], grid[1]), fits != 0));
            }
            // Too small: again with room for `len` bytes.
            2 => table = vec![0u8; len],
            _ => return None,
        }
    }
}

/// A case: rects and (source, destination) buffer bases.
type Case = (Vec<CopyRect>, Vec<(u64, u64)>);

/// What a builder makes: the argument, the table's bytes, the grid, whether it fits inline.
type Built = (KernelArgs, Vec<u8>, (u32, u32), bool);

fn rect(src: u64, dst: u64, sp: u64, dp: u64, width: u64, height: u64) -> CopyRect {
    CopyRect {
        src_offset: src,
        dst_offset: dst,
        src_pitch: sp,
        dst_pitch: dp,
        width,
        height,
    }
}

#[test]
fn the_cpp_and_the_rust_builder_make_the_same_table() {
    let build = match cpp_builder() {
        Ok(build) => build,
        Err(why) => {
            common::skip_missing(
                "the_cpp_and_the_rust_builder_make_the_same_table",
                "MORI_TP_REQUIRE_TOOLS",
                &why,
            );
            return;
        }
    };
    let mut cases: Vec<Case> = vec![
        // The shapes, in small: contiguous, pages of 16, one-row rects.
        (
            vec![rect(0, 0, 1024, 256, 256, 4096)],
            vec![(1 << 30, 2 << 30); 64],
        ),
        (
            (0..256u64)
                .map(|i| {
                    rect(
                        (i * 37 % 512) * 16384,
                        (i * 91 % 512) * 4096,
                        1024,
                        256,
                        256,
                        16,
                    )
                })
                .collect(),
            (0..64u64)
                .map(|b| ((b + 1) << 30, (b + 100) << 30))
                .collect(),
        ),
        (
            (0..4096u64)
                .map(|i| {
                    rect(
                        (i * 37 % 8192) * 1024,
                        (i * 91 % 8192) * 256,
                        1024,
                        256,
                        256,
                        1,
                    )
                })
                .collect(),
            vec![(1 << 20, 1 << 21)],
        ),
        // Cuts and joins: huge rows and runs, heights that split, wide offsets, empty rects.
        (
            vec![
                rect(0, 0, 0, 0, 3 * (1 << 30) + 16, 1),
                rect(1 << 40, 1 << 41, 64, 32, 32, (1 << 30) + 5),
                rect(0, 0, 64, 32, 32, 16),
                rect(4096, 8192, 64, 32, 32, 48),
                rect(7, 3, 9, 9, 0, 9),
                rect(5, 1 << 45, 9, 9, 9, 0),
                rect(1 << 35, 3, 0, 0, 1, 1),
            ],
            vec![(8, 24), (1 << 20, 1 << 21)],
        ),
    ];
    let mut rng = mori_tp_testkit::Rng::new(77);
    for _ in 0..200 {
        let align = 1u64 << rng.range(0, 4);
        let width = rng.range(1, 3000);
        let rects = (0..rng.range(0, 30))
            .map(|_| {
                let height = if rng.range(0, 2) == 0 {
                    16 * rng.range(1, 70)
                } else {
                    rng.range(0, 20)
                };
                rect(
                    rng.range(0, 1 << 34) * align,
                    rng.range(0, 1 << 20) * align,
                    width + rng.range(0, 9) * align,
                    width + rng.range(0, 9) * align,
                    if rng.range(0, 4) == 0 {
                        rng.range(0, 40_000)
                    } else {
                        width
                    },
                    height,
                )
            })
            .collect();
        let bases = (0..rng.range(0, 40))
            .map(|_| {
                (
                    rng.range(1, 1 << 40) << rng.range(0, 5),
                    rng.range(1, 1 << 40),
                )
            })
            .collect();
        cases.push((rects, bases));
    }
    // 16-byte-aligned bases and rows equally misaligned on both sides, of widths around the
    // split's minimum: heads, bodies and tails (MORI_COPY_SPLIT_MIN_WIDTH).
    for _ in 0..150 {
        let residue = rng.range(0, 16);
        let width = rng.range(100, 800);
        let pitch = width.div_ceil(16) * 16 + 16 * rng.range(0, 3);
        let rects = (0..rng.range(0, 20))
            .map(|i| {
                let same = rng.range(0, 3) != 0;
                rect(
                    (i << 14) + if same { residue } else { rng.range(0, 16) },
                    (i << 15) + residue,
                    if rng.range(0, 5) == 0 {
                        pitch + 8
                    } else {
                        pitch
                    },
                    pitch,
                    if same { width } else { rng.range(1, 800) },
                    rng.range(0, 6),
                )
            })
            .collect();
        let bases = (0..rng.range(1, 9))
            .map(|_| (rng.range(1, 1 << 36) << 4, rng.range(1, 1 << 36) << 4))
            .collect();
        cases.push((rects, bases));
    }
    for (n, (rects, bases)) in cases.iter().enumerate() {
        let rust = KernelTable::build(rects.iter().copied(), bases).expect("a table");
        let (args, bytes, grid, fits) =
            cpp_table(build, rects, bases).unwrap_or_else(|| panic!("case {n}: C++ refused"));
        let differ = bytes.iter().zip(rust.bytes()).position(|(a, b)| a != b);
        assert!(
            differ.is_none() && bytes.len() == rust.bytes().len(),
            "case {n}: C++ table of {} bytes, Rust {}; first different byte {differ:?}",
            bytes.len(),
            rust.bytes().len()
        );
        assert_eq!(args, rust.args(0), "case {n}: argument");
        assert_eq!(grid, rust.grid(), "case {n}: grid");
        assert_eq!(fits, rust.is_inline(), "case {n}: fits in the argument");
    }
    // Both refuse a table beyond its 32-bit fields.
    let too_many_tiles = [rect(0, 0, 1 << 30, 1 << 30, 1 << 30, 1 << 13)];
    assert!(KernelTable::build(too_many_tiles, &[(1, 1)]).is_err());
    assert!(cpp_table(build, &too_many_tiles, &[(1, 1)]).is_none());
}
