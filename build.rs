//! Build script of the mori-tp library. Each job is one function called from `main`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// The offload-bundle reader tests/copy_kernel.rs uses too.
#[path = "hip/bundle.rs"]
mod bundle;

fn main() {
    set_soname();
    // With the `hip` feature only: without it, nothing costly runs.
    if env::var_os("CARGO_FEATURE_HIP").is_some() {
        build_copy_kernel();
    }
    // With the `cuda` feature only: the same kernel as PTX, built without a CUDA toolkit.
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_copy_kernel_ptx();
    }
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

/// The GPU targets the kernel is built for when the compiler knows them: MI200 (gfx90a), MI300
/// (gfx942) and MI350 (gfx950).
const KERNEL_ARCHS: [&str; 3] = ["gfx90a", "gfx942", "gfx950"];

/// Compiles hip/copy_kernel.hip with `hipcc --genco` for every target of [`KERNEL_ARCHS`] that
/// hipcc can build (or exactly those of `MORI_TP_HIP_ARCHS`, space- or comma-separated) into
/// `$OUT_DIR/copy_kernel.hsaco`, a clang offload bundle that hipModuleLoadData accepts, checks
/// that the bundle holds one code object per target, and tells the library which targets it has
/// (`MORI_TP_HIP_KERNEL_ARCHS`). `HIPCC` names the compiler (default: hipcc on PATH, else
/// `$ROCM_PATH/bin/hipcc`); `MORI_TP_HIPCC_FLAGS` adds flags (space-separated), such as
/// `--offload-compress`, whose compressed bundle is checked with `clang-offload-bundler --list`.
fn build_copy_kernel() {
    for file in ["hip/copy_kernel.hip", "hip/copy_kernel.h", "hip/bundle.rs"] {
        println!("cargo:rerun-if-changed={file}");
    }
    for var in [
        "HIPCC",
        "MORI_TP_HIP_ARCHS",
        "MORI_TP_HIPCC_FLAGS",
        "ROCM_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let hipcc = hipcc();
    let archs: Vec<String> = match env::var("MORI_TP_HIP_ARCHS") {
        Ok(list) => list
            .split([' ', ','])
            .filter(|a| !a.is_empty())
            .map(String::from)
            .collect(),
        Err(_) => probe_archs(&hipcc, &out),
    };
    if archs.is_empty() {
        panic!(
            "the `hip` feature builds the copy kernel, but {hipcc} can build none of {} \
             (set MORI_TP_HIP_ARCHS to the targets to build, or use a newer hipcc)",
            KERNEL_ARCHS.join(", ")
        );
    }
    let bundle = out.join("copy_kernel.hsaco");
    let output = Command::new(&hipcc)
        // AMD code objects, whatever else is installed: with nvcc on PATH hipcc would target
        // NVIDIA unless told.
        .env("HIP_PLATFORM", "amd")
        .args([
            "--genco",
            "-O3",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .args(archs.iter().map(|a| format!("--offload-arch={a}")))
        .args(
            env::var("MORI_TP_HIPCC_FLAGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("hip/copy_kernel.hip"))
        .arg("-o")
        .arg(&bundle)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "the `hip` feature builds the copy kernel with {hipcc}, which did not run ({e}); \
                 install hipcc (Debian: apt install hipcc) or set HIPCC"
            )
        });
    if !output.status.success() {
        panic!(
            "{hipcc} --genco hip/copy_kernel.hip for {archs:?} failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let image = fs::read(&bundle).expect("read the kernel bundle");
    let targets = match bundle::read(&image) {
        Ok(bundle::Bundle::Plain(ids)) => ids,
        Ok(bundle::Bundle::Compressed { version, method }) => {
            match list_compressed(&bundle) {
                Ok(ids) => ids,
                Err(why) => {
                    // hipModuleLoadData of a runtime that reads compressed bundles takes it as
                    // it is; only the check is skipped.
                    println!(
                        "cargo:warning=the copy kernel's bundle is compressed (format {version}, \
                         method {method}) and its targets cannot be listed ({why}); it is \
                         embedded unchecked"
                    );
                    archs
                        .iter()
                        .map(|a| format!("hipv4-amdgcn-amd-amdhsa--{a}"))
                        .collect()
                }
            }
        }
        Err(why) => panic!("{} is not a clang offload bundle: {why}", bundle.display()),
    };
    for arch in &archs {
        assert!(
            targets
                .iter()
                .any(|t| bundle::gpu_target(t) == Some(arch.as_str())),
            "{} lacks a code object for {arch}; it holds {targets:?}",
            bundle.display()
        );
    }
    println!(
        "cargo:rustc-env=MORI_TP_HIP_KERNEL_ARCHS={}",
        archs.join(",")
    );
}

/// `$HIPCC`, else `hipcc` on PATH, else `$ROCM_PATH/bin/hipcc`.
fn hipcc() -> String {
    if let Ok(hipcc) = env::var("HIPCC") {
        return hipcc;
    }
    let on_path = Command::new("hipcc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    match env::var("ROCM_PATH") {
        Ok(rocm) if !on_path => format!("{rocm}/bin/hipcc"),
        _ => "hipcc".into(),
    }
}

/// The targets of [`KERNEL_ARCHS`] that `hipcc` compiles a tiny kernel for, probed in parallel.
fn probe_archs(hipcc: &str, out: &Path) -> Vec<String> {
    let probe = out.join("probe.hip");
    fs::write(
        &probe,
        "#include <hip/hip_runtime.h>\n__global__ void probe(int *p) { *p = 1; }\n",
    )
    .expect("write the probe source");
    let probes: Vec<_> = KERNEL_ARCHS
        .iter()
        .map(|arch| {
            let (hipcc, probe) = (hipcc.to_string(), probe.clone());
            let object = out.join(format!("probe-{arch}.hsaco"));
            std::thread::spawn(move || {
                Command::new(hipcc)
                    .env("HIP_PLATFORM", "amd")
                    .args(["--genco", &format!("--offload-arch={arch}")])
                    .arg(&probe)
                    .arg("-o")
                    .arg(&object)
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
        })
        .collect();
    KERNEL_ARCHS
        .iter()
        .zip(probes)
        .filter_map(|(arch, probe)| probe.join().unwrap_or(false).then(|| arch.to_string()))
        .collect()
}

/// The target ids of the compressed bundle at `path`, from `clang-offload-bundler --list` (on
/// PATH, next to the clang that `hipconfig --hipclangpath` names, or in `$ROCM_PATH/llvm/bin`).
fn list_compressed(path: &Path) -> Result<Vec<String>, String> {
    let mut dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Ok(out) = Command::new("hipconfig").arg("--hipclangpath").output() {
        dirs.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    if let Ok(rocm) = env::var("ROCM_PATH") {
        dirs.push(Path::new(&rocm).join("llvm/bin"));
    }
    // Debian installs it as clang-offload-bundler-<LLVM version>.
    let bundler = dirs
        .iter()
        .filter_map(|dir| fs::read_dir(dir).ok())
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("clang-offload-bundler"))
        })
        .ok_or("no clang-offload-bundler found")?;
    let output = Command::new(&bundler)
        .args(["--list", "--type=o"])
        .arg(format!("--input={}", path.display()))
        .output()
        .map_err(|e| format!("{} did not run: {e}", bundler.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} --list failed: {}",
            bundler.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// The virtual GPU architecture the PTX is written for by default: Volta (sm_70), the oldest
/// the CUDA 12 and 13 drivers JIT-compile for, so the driver compiles it for any newer GPU.
const PTX_ARCH: &str = "sm_70";

/// Compiles hip/copy_kernel.hip as CUDA device code for NVPTX with clang, without a CUDA
/// toolkit (`-nocudainc -nocudalib`; hip/cuda_stand_in.h supplies the few CUDA names the kernel
/// uses), into `$OUT_DIR/copy_kernel.ptx`, NUL-terminated as `cuModuleLoadData` takes PTX text,
/// and checks that it declares the kernel's entry with its 4 KiB argument; then the wide entry
/// as a module of its own ([`build_wide_ptx`]). `MORI_TP_CLANG` names
/// the compiler (default: the first of `clang`, `clang-21` .. `clang-14` on PATH, clang in
/// `hipconfig --hipclangpath`, `/usr/lib/llvm-*/bin/clang`: Debian's hipcc package installs
/// clang-15); `MORI_TP_PTX_ARCH` the architecture (default sm_70).
fn build_copy_kernel_ptx() {
    for file in [
        "hip/copy_kernel.hip",
        "hip/copy_kernel.h",
        "hip/cuda_stand_in.h",
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
    for var in ["MORI_TP_CLANG", "MORI_TP_PTX_ARCH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let clang = clang().unwrap_or_else(|| {
        panic!(
            "the `cuda` feature builds the copy kernel as PTX with clang, and none was found \
             (install clang, e.g. Debian: apt install clang-15 (hipcc brings it), or set \
             MORI_TP_CLANG)"
        )
    });
    let arch = env::var("MORI_TP_PTX_ARCH").unwrap_or_else(|_| PTX_ARCH.into());
    let ptx = out.join("copy_kernel.ptx.text");
    compile_ptx(&clang, &arch, &[], &ptx);
    let text = fs::read(&ptx).expect("read the PTX");
    check_entry(&ptx, &text, "mori_copy_kernel", 4096);
    write_terminated(&out.join("copy_kernel.ptx"), text);
    println!("cargo:rustc-env=MORI_TP_PTX_ARCH={arch}");
    build_cubins(&out, &ptx, "copy_kernel");
    build_wide_ptx(&out, &clang, &arch);
}

/// The wide entry, `mori_copy_kernel_wide`, whose argument is 32,760 bytes (a 32,696-byte table
/// room), as a PTX module of its own: `$OUT_DIR/copy_kernel_wide.ptx` and its cubins
/// (`copy_kernel_wide.<arch>.cubin`). Kernel parameters beyond 4 KiB need PTX ISA 8.1 and
/// sm_70 (CUDA C++ Programming Guide, "Function Parameters"; CUDA 12.1 release notes), and
/// clang-15 writes an older `.version`, so the line is raised to 8.1: PTX is backward compatible
/// (an ISA version accepts every program of the earlier ones), so the text means the same under
/// 8.1. Only a CUDA 12.1+ driver loads it, which is why it is not in the main module: an older
/// driver still loads that one. The target is `MORI_TP_PTX_ARCH` when it is sm_70 or newer, else
/// sm_70.
fn build_wide_ptx(out: &Path, clang: &Path, arch: &str) {
    let number = arch.strip_prefix("sm_").and_then(|n| {
        n.trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<u32>()
            .ok()
    });
    let arch = match number {
        Some(n) if n >= 70 => arch,
        _ => "sm_70",
    };
    let ptx = out.join("copy_kernel_wide.ptx.text");
    compile_ptx(
        clang,
        arch,
        &["-DMORI_COPY_NARROW_ENTRY=0", "-DMORI_COPY_WIDE_ENTRY=1"],
        &ptx,
    );
    let text = String::from_utf8(fs::read(&ptx).expect("read the wide PTX"))
        .expect("the PTX is ASCII text");
    let mut raised = false;
    let text: String = text
        .lines()
        .map(|line| {
            let version = line.trim().strip_prefix(".version ").and_then(|v| {
                let (major, minor) = v.trim().split_once('.')?;
                Some((major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?))
            });
            match version {
                Some(v) if !raised && v < (8, 1) => {
                    raised = true;
                    ".version 8.1".to_string()
                }
                Some(_) if !raised => {
                    raised = true;
                    line.to_string()
                }
                _ => line.to_string(),
            }
        })
        .map(|line| line + "\n")
        .collect();
    assert!(raised, "{} has no .version line", ptx.display());
    check_entry(&ptx, text.as_bytes(), "mori_copy_kernel_wide", 32760);
    assert!(
        !text.contains(".entry mori_copy_kernel("),
        "{} holds the main entry too (the wide module must hold the wide entry alone)",
        ptx.display()
    );
    fs::write(&ptx, &text).expect("write the wide PTX");
    println!("cargo:rustc-env=MORI_TP_WIDE_PTX_ARCH={arch}");
    write_terminated(&out.join("copy_kernel_wide.ptx"), text.into_bytes());
    build_cubins(out, &ptx, "copy_kernel_wide");
}

/// Compiles hip/copy_kernel.hip with `clang` for NVPTX `arch` with `defines` into PTX at `ptx`.
fn compile_ptx(clang: &Path, arch: &str, defines: &[&str], ptx: &Path) {
    let output = Command::new(clang)
        .args([
            "-x",
            "cuda",
            "--cuda-device-only",
            &format!("--cuda-gpu-arch={arch}"),
            "-nocudainc",
            "-nocudalib",
            "-O3",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            // -nocudainc -nocudalib use nothing of an installed CUDA toolkit, so a toolkit
            // newer than this clang knows is no reason to stop.
            "-Wno-unknown-cuda-version",
            "-S",
        ])
        .args(defines)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("hip/copy_kernel.hip"))
        .arg("-o")
        .arg(ptx)
        .output()
        .unwrap_or_else(|e| panic!("{} did not run: {e}", clang.display()));
    if !output.status.success() {
        panic!(
            "{} -x cuda --cuda-device-only --cuda-gpu-arch={arch} {defines:?} hip/copy_kernel.hip \
             failed:\n{}",
            clang.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Checks that the PTX `text` (read from `ptx`) declares the entry `name` with one `bytes`-byte
/// parameter.
fn check_entry(ptx: &Path, text: &[u8], name: &str, bytes: usize) {
    let text = String::from_utf8_lossy(text);
    assert!(
        text.contains(&format!(".entry {name}("))
            && text.contains(&format!(".b8 {name}_param_0[{bytes}]")),
        "{} lacks the entry {name} with its {bytes}-byte argument",
        ptx.display()
    );
}

/// Writes the PTX `text` NUL-terminated to `path`, as `cuModuleLoadData` takes PTX text.
fn write_terminated(path: &Path, mut text: Vec<u8>) {
    assert!(!text.contains(&0), "PTX text holds a NUL byte");
    text.push(0);
    fs::write(path, &text).expect("write the PTX");
}

/// The GPUs the kernel is embedded as SASS for, beside the PTX, when `ptxas` is at hand: H100 /
/// H200 (sm_90) and B200 / GB200 (sm_100).
const SASS_ARCHS: [&str; 2] = ["sm_90", "sm_100"];

/// Assembles the PTX at `ptx` with `ptxas` for every arch of [`SASS_ARCHS`] into
/// `$OUT_DIR/<stem>.<arch>.cubin`, so that a GPU of that compute capability loads SASS and
/// needs no JIT at first use. `MORI_TP_PTXAS` names ptxas (default: on PATH, in
/// `$CUDA_HOME/bin`, `/usr/local/cuda/bin`); PyPI's `nvidia-cuda-nvcc-cu12` wheel ships one
/// (`nvidia/cuda_nvcc/bin/ptxas`). Without ptxas, or for an arch it does not know, the cubin is
/// empty and the driver JIT-compiles the PTX (a warning says so).
fn build_cubins(out: &Path, ptx: &Path, stem: &str) {
    for var in ["MORI_TP_PTXAS", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let ptxas = env::var_os("MORI_TP_PTXAS").map(PathBuf::from).or_else(|| {
        let mut dirs: Vec<PathBuf> = env::var_os("PATH")
            .map(|p| env::split_paths(&p).collect())
            .unwrap_or_default();
        if let Some(cuda) = env::var_os("CUDA_HOME") {
            dirs.push(Path::new(&cuda).join("bin"));
        }
        dirs.push("/usr/local/cuda/bin".into());
        dirs.into_iter()
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    });
    for arch in SASS_ARCHS {
        let cubin = out.join(format!("{stem}.{arch}.cubin"));
        let _ = fs::remove_file(&cubin);
        let built = match &ptxas {
            None => {
                Err("no ptxas (set MORI_TP_PTXAS, or pip install nvidia-cuda-nvcc-cu12)".into())
            }
            Some(ptxas) => Command::new(ptxas)
                .args([&format!("-arch={arch}"), "-O3", "-o"])
                .arg(&cubin)
                .arg(ptx)
                .output()
                .map_err(|e| format!("{} did not run: {e}", ptxas.display()))
                .and_then(|o| {
                    if o.status.success() {
                        Ok(())
                    } else {
                        Err(format!(
                            "{} -arch={arch} failed: {}",
                            ptxas.display(),
                            String::from_utf8_lossy(&o.stderr).trim()
                        ))
                    }
                }),
        };
        match built.and_then(|()| fs::read(&cubin).map_err(|e| e.to_string())) {
            Ok(image) if image.starts_with(b"\x7fELF") => {}
            Ok(_) => panic!("{} is not an ELF cubin", cubin.display()),
            Err(why) => {
                println!(
                    "cargo:warning=the copy kernel ({stem}) is embedded without {arch} SASS \
                     ({why}); the driver JIT-compiles the PTX at first use"
                );
                fs::write(&cubin, b"").expect("write an empty cubin");
            }
        }
    }
}

/// `$MORI_TP_CLANG`, else the first clang that runs: `clang`, `clang-21` .. `clang-14` on PATH,
/// then in `hipconfig --hipclangpath`, then `/usr/lib/llvm-*/bin/clang` (newest first).
fn clang() -> Option<PathBuf> {
    if let Some(clang) = env::var_os("MORI_TP_CLANG") {
        return Some(PathBuf::from(clang));
    }
    let runs = |path: &Path| {
        Command::new(path)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let mut candidates: Vec<PathBuf> = vec!["clang".into()];
    candidates.extend((14..=21).rev().map(|v| PathBuf::from(format!("clang-{v}"))));
    if let Ok(out) = Command::new("hipconfig").arg("--hipclangpath").output() {
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !dir.is_empty() {
            candidates.push(Path::new(&dir).join("clang"));
        }
    }
    let mut llvm: Vec<PathBuf> = fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("llvm-"))
        })
        .map(|p| p.join("bin/clang"))
        .collect();
    llvm.sort_by_key(|p| {
        std::cmp::Reverse(
            p.to_string_lossy()
                .split("llvm-")
                .nth(1)
                .and_then(|v| v.split('/').next())
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0),
        )
    });
    candidates.extend(llvm);
    candidates.into_iter().find(|c| runs(c))
}
