//! The copy kernel's own source on the CPU: tests/kernel/kernel_test.cpp compiles
//! hip/copy_kernel.hip with a C++ compiler through hip/cpu_shim.hpp, links the libmori_tp.a of
//! this test run, and checks every byte the kernel moves against the library's host backend
//! (heterogeneous-TP layouts, page sizes 1 and 16, fragmented and contiguous pages, unaligned
//! widths and base pointers, many buffers, small grids, and the pair plans of any page layout:
//! head-major and padded pages, page sizes that differ, partial last pages). It runs twice:
//! optimised, and under AddressSanitizer and UndefinedBehaviorSanitizer.
//!
//! Needs `c++` (g++ or clang++). Without it the tests say so and skip, unless
//! MORI_TP_REQUIRE_TOOLS=1 (CI), which makes a missing compiler a failure.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{built_static_library as static_library, hip_link, root};

// The offload-bundle reader build.rs uses.
#[path = "../hip/bundle.rs"]
mod bundle;

fn compiler_present() -> bool {
    Command::new("c++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Builds kernel_test.cpp with `flags` into `name` and runs it; it must pass.
fn build_and_run(name: &str, flags: &[&str]) {
    if cfg!(any(feature = "hip", feature = "cuda")) {
        // The kernel's source on the CPU with the host's c++: no feature of the library reaches
        // it, and .ci/run's feature passes would only build and run it again (over a minute).
        common::skip(
            name,
            "runs in the pass without GPU features (.ci/run's cargo test)",
        );
        return;
    }
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

/// The copy kernel's bundle as libmori_tp.a embeds it, and where: the first uncompressed bundle
/// header in the archive that names an AMD GPU target, or the first compressed one (`hipcc
/// --offload-compress`: `CCOB`, a known format version and compression method), whose targets
/// are inside its compressed payload.
fn embedded_bundle(archive: &[u8]) -> Option<(usize, bundle::Bundle)> {
    (0..archive.len()).find_map(|at| {
        let rest = &archive[at..];
        if !rest.starts_with(bundle::PLAIN_MAGIC) && !rest.starts_with(bundle::COMPRESSED_MAGIC) {
            return None;
        }
        match bundle::read(rest) {
            Ok(bundle::Bundle::Plain(ids))
                if ids.iter().any(|id| bundle::gpu_target(id).is_some()) =>
            {
                Some((at, bundle::Bundle::Plain(ids)))
            }
            // Format versions 1 to 3 exist; methods are zlib and zstd. Anything else is four
            // bytes that happen to spell CCOB.
            Ok(found @ bundle::Bundle::Compressed { version, method })
                if (1..=3).contains(&version) && method <= 2 =>
            {
                Some((at, found))
            }
            _ => None,
        }
    })
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
        // libmori_tp.a holds the bundle verbatim (the library's own copy is not public API).
        let archive = std::fs::read(static_library()).expect("read libmori_tp.a");
        let (at, found) =
            embedded_bundle(&archive).expect("libmori_tp.a does not embed the kernel bundle");
        match found {
            bundle::Bundle::Plain(targets) => check_targets(at, &targets),
            // Its targets are inside the compressed payload, which build.rs listed with
            // clang-offload-bundler (or warned that it could not).
            bundle::Bundle::Compressed { version, method } => eprintln!(
                "the embedded copy kernel (at byte {at} of libmori_tp.a) is a compressed bundle \
                 (format {version}, method {method}); build.rs checked its targets"
            ),
        }
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
    }
}

/// The embedded bundle at byte `at` holds a code object for every target asked for
/// (`MORI_TP_HIP_ARCHS`), or else for exactly those the installed hipcc supports.
#[cfg(feature = "hip")]
fn check_targets(at: usize, targets: &[String]) {
    let built: Vec<&str> = targets
        .iter()
        .filter_map(|id| bundle::gpu_target(id))
        .collect();
    assert!(
        !built.is_empty(),
        "the embedded bundle holds no GPU target: {targets:?}"
    );
    if let Ok(archs) = std::env::var("MORI_TP_HIP_ARCHS") {
        for arch in archs.split([' ', ',']).filter(|a| !a.is_empty()) {
            assert!(
                built.contains(&arch),
                "the embedded bundle lacks {arch}: {targets:?}"
            );
        }
    } else {
        assert_eq!(
            built,
            targets_hipcc_supports(),
            "the library embeds code objects for {built:?}, but hipcc supports a different set"
        );
    }
    eprintln!("the embedded copy kernel (at byte {at} of libmori_tp.a) holds {targets:?}");
}

/// A header of an uncompressed bundle with entries of these ids.
fn plain_header(ids: &[&str]) -> Vec<u8> {
    let mut bytes = bundle::PLAIN_MAGIC.to_vec();
    bytes.extend((ids.len() as u64).to_le_bytes());
    for (n, id) in ids.iter().enumerate() {
        bytes.extend((4096 * (n as u64 + 1)).to_le_bytes());
        bytes.extend(100u64.to_le_bytes());
        bytes.extend((id.len() as u64).to_le_bytes());
        bytes.extend(id.as_bytes());
    }
    bytes
}

#[test]
fn the_bundle_reader_lists_the_targets_of_a_plain_bundle_and_refuses_garbage() {
    let ids = [
        "host-x86_64-unknown-linux-gnu-",
        "hipv4-amdgcn-amd-amdhsa--gfx90a:xnack-",
        "hipv4-amdgcn-amd-amdhsa--gfx942",
    ];
    let header = plain_header(&ids);
    assert_eq!(
        bundle::read(&header),
        Ok(bundle::Bundle::Plain(ids.map(String::from).to_vec()))
    );
    let gpus: Vec<_> = ids.iter().filter_map(|id| bundle::gpu_target(id)).collect();
    assert_eq!(gpus, ["gfx90a", "gfx942"]);
    assert!(
        bundle::read(&header[..header.len() - 3]).is_err(),
        "truncated id"
    );
    assert!(bundle::read(b"\x7fELF not a bundle").is_err());
}

/// `hipcc --offload-compress` writes a compressed bundle; build.rs used to panic on it.
#[test]
fn the_bundle_reader_recognises_a_compressed_bundle_instead_of_refusing_it() {
    let mut compressed = bundle::COMPRESSED_MAGIC.to_vec();
    compressed.extend(2u16.to_le_bytes()); // format version
    compressed.extend(2u16.to_le_bytes()); // zstd
    compressed.extend([0u8; 24]);
    assert_eq!(
        bundle::read(&compressed),
        Ok(bundle::Bundle::Compressed {
            version: 2,
            method: 2
        })
    );
    assert!(bundle::read(b"CCOB\x01").is_err(), "truncated header");
}

/// A compressed bundle (`hipcc --offload-compress`) in the archive is the embedded kernel, as an
/// uncompressed one is; four bytes that spell CCOB without a known header are not.
#[test]
fn the_embedded_bundle_is_found_whether_compressed_or_not() {
    let mut compressed = bundle::COMPRESSED_MAGIC.to_vec();
    compressed.extend(2u16.to_le_bytes()); // format version
    compressed.extend(1u16.to_le_bytes()); // method
    compressed.extend(40u32.to_le_bytes()); // total size
    compressed.extend([0xa5u8; 28]);
    let mut archive = b"!<arch>\nlibmori_tp CCOB\xff\xff\x07\x00 not a bundle ".to_vec();
    let at = archive.len();
    archive.extend(&compressed);
    archive.extend(b" trailing object code");
    assert_eq!(
        embedded_bundle(&archive),
        Some((
            at,
            bundle::Bundle::Compressed {
                version: 2,
                method: 1
            }
        ))
    );

    let ids = [
        "host-x86_64-unknown-linux-gnu-",
        "hipv4-amdgcn-amd-amdhsa--gfx942",
    ];
    let mut archive = b"!<arch>\n".to_vec();
    archive.extend(plain_header(&ids[..1])); // a host-only bundle is not the kernel's
    let at = archive.len();
    archive.extend(plain_header(&ids));
    assert_eq!(
        embedded_bundle(&archive),
        Some((at, bundle::Bundle::Plain(ids.map(String::from).to_vec())))
    );
    assert_eq!(embedded_bundle(b"!<arch>\nCCOB"), None);
}
