//! The copy kernel's own source on the CPU: tests/kernel/kernel_test.cpp compiles
//! hip/copy_kernel.hip with a C++ compiler through hip/cpu_shim.hpp, links the libmori_tp.a of
//! this test run, and checks every byte the kernel moves against the library's host backend
//! (heterogeneous-TP layouts, page sizes 1 and 16, fragmented and contiguous pages, unaligned
//! widths and base pointers, many buffers, small grids). It runs twice: optimised, and under
//! AddressSanitizer and UndefinedBehaviorSanitizer.
//!
//! Needs `c++` (g++ or clang++). Without it the tests say so and skip, unless
//! MORI_TP_REQUIRE_TOOLS=1 (CI), which makes a missing compiler a failure.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{built_static_library as static_library, hip_link, root};

fn compiler_present() -> bool {
    Command::new("c++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Builds kernel_test.cpp with `flags` into `name` and runs it; it must pass.
fn build_and_run(name: &str, flags: &[&str]) {
    if !compiler_present() {
        common::skip_missing(
            name,
            "MORI_TP_REQUIRE_TOOLS",
            "no C++ compiler (c++) to build the kernel's CPU test",
        );
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("copy-kernel");
    std::fs::create_dir_all(&dir).expect("create the output directory");
    let exe = dir.join(name);
    let output = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror"])
        .args(flags)
        .arg("-DMORI_COPY_KERNEL_CPU")
        .arg("-I")
        .arg(root().join("include"))
        .arg("-I")
        .arg(root().join("hip"))
        .arg(root().join("tests/kernel/kernel_test.cpp"))
        .arg(static_library())
        .args(["-lpthread", "-ldl", "-lm", "-lrt", "-lutil", "-lgcc_s"])
        .args(hip_link())
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run c++");
    assert!(
        output.status.success(),
        "c++ could not build tests/kernel/kernel_test.cpp:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run = Command::new(&exe)
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        .output()
        .expect("run kernel_test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        run.status.success() && text.contains("every byte equal to the host backend's"),
        "{name} ({}):\n{text}",
        run.status
    );
}

#[test]
fn the_copy_kernel_source_moves_the_same_bytes_as_the_host_backend_on_the_cpu() {
    build_and_run("kernel_test", &["-O2"]);
}

#[test]
fn the_copy_kernel_source_is_clean_under_address_and_undefined_behaviour_sanitizers() {
    build_and_run(
        "kernel_test_sanitized",
        &[
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
        ],
    );
}

/// The target ids of an uncompressed clang offload bundle (the magic, a u64 count, then per
/// entry u64 offset, u64 size, u64 id length and the id, little-endian).
#[cfg(feature = "hip")]
fn bundle_targets(image: &[u8]) -> Vec<String> {
    let body = image
        .strip_prefix(b"__CLANG_OFFLOAD_BUNDLE__")
        .expect("the embedded kernel is a clang offload bundle");
    let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap()) as usize;
    let mut at = 8;
    (0..word(0))
        .map(|_| {
            let len = word(at + 16);
            let id = String::from_utf8_lossy(&body[at + 24..at + 24 + len]).into_owned();
            at += 24 + len;
            id
        })
        .collect()
}

/// The targets of gfx90a, gfx942 and gfx950 that `hipcc` compiles a kernel for.
#[cfg(feature = "hip")]
fn targets_hipcc_supports() -> Vec<&'static str> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hipcc-probe");
    std::fs::create_dir_all(&dir).expect("create the probe directory");
    let probe = dir.join("probe.hip");
    std::fs::write(
        &probe,
        "#include <hip/hip_runtime.h>\n__global__ void probe(int *p) { *p = 2; }\n",
    )
    .expect("write the probe");
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".into());
    let probes: Vec<_> = ["gfx90a", "gfx942", "gfx950"]
        .into_iter()
        .map(|arch| {
            let (hipcc, probe, out) = (hipcc.clone(), probe.clone(), dir.join(arch));
            (
                arch,
                std::thread::spawn(move || {
                    Command::new(hipcc)
                        .args(["--genco", &format!("--offload-arch={arch}")])
                        .arg(probe)
                        .arg("-o")
                        .arg(out)
                        .output()
                        .is_ok_and(|o| o.status.success())
                }),
            )
        })
        .collect();
    probes
        .into_iter()
        .filter_map(|(arch, probe)| probe.join().unwrap().then_some(arch))
        .collect()
}

#[test]
fn the_library_built_with_hip_embeds_the_kernel_for_every_target_its_hipcc_supports() {
    #[cfg(not(feature = "hip"))]
    {
        common::skip_missing(
            "the_library_built_with_hip_embeds_the_kernel",
            "MORI_TP_REQUIRE_HIP",
            "built without `--features hip`: no kernel is embedded",
        );
    }
    #[cfg(feature = "hip")]
    {
        use mori_tp::backend::copy_kernel::{ARCHS, IMAGE};
        let targets = bundle_targets(IMAGE);
        let built: Vec<&str> = ARCHS.split(',').collect();
        for arch in &built {
            let id = format!("hipv4-amdgcn-amd-amdhsa--{arch}");
            assert!(
                targets
                    .iter()
                    .any(|t| *t == id || t.starts_with(&format!("{id}:"))),
                "the embedded bundle lacks {arch}: {targets:?}"
            );
        }
        if std::env::var_os("MORI_TP_HIP_ARCHS").is_none() {
            assert_eq!(
                built,
                targets_hipcc_supports(),
                "build.rs built for {ARCHS}, but hipcc supports a different set"
            );
        }
        // libmori_tp.a holds the bundle verbatim and calls hipModuleLaunchKernel.
        let archive = std::fs::read(static_library()).expect("read libmori_tp.a");
        let head = &IMAGE[..IMAGE.len().min(4096)];
        assert!(
            archive.windows(head.len()).any(|w| w == head),
            "libmori_tp.a does not embed the kernel bundle"
        );
        let symbols = Command::new("nm")
            .arg("--undefined-only")
            .arg(static_library())
            .output()
            .expect("run nm");
        let symbols = String::from_utf8_lossy(&symbols.stdout);
        for call in [
            "hipModuleLaunchKernel",
            "hipModuleLoadData",
            "hipMemcpyAsync",
        ] {
            assert!(symbols.contains(call), "libmori_tp.a does not call {call}");
        }
        eprintln!("the embedded copy kernel holds {targets:?}");
    }
}
