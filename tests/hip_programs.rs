//! Builds the HIP programs of hip/ with hipcc against include/mori_tp.h and the libmori_tp.a this
//! `cargo test --features hip` just built, and runs them: each must pass (exit 0) on a machine
//! with a HIP device, or exit 77 with "skipped: no HIP device" (after checking that the library
//! refuses MORI_BACKEND_HIP cleanly) on one without.
//!
//! Then it runs them again over tests/fake_hip (LD_PRELOAD: host memory behind the HIP calls), with
//! one and with two devices, and with two devices over its HIP 5.2 flavour (no hipStreamGetDevice:
//! the programs must make the stream's device current), where they must pass: that checks the programs' own logic (layouts,
//! expected bytes, staging configs, pinned and registered host memory, the two-device placement,
//! timing, the lane count) on machines without a GPU. It says nothing about a GPU.
//!
//! Needs the `hip` feature and hipcc (HIPCC overrides the compiler). Without them the test says
//! so and skips, unless MORI_TP_REQUIRE_HIP=1 (CI), which makes either missing a failure;
//! MORI_TP_REQUIRE_HIP_DEVICE=1 (a GPU runner) makes a skip for want of a device a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::required;

/// Skips with `why`, or fails when CI requires the HIP toolchain.
fn skip(why: &str) {
    common::skip_missing("the_hip_programs", "MORI_TP_REQUIRE_HIP", why);
}

fn text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn the_hip_programs_build_with_hipcc_skip_without_a_device_and_pass_over_a_stand_in() {
    let built_with_hip = cfg!(feature = "hip");
    if !built_with_hip {
        skip("built without `--features hip`: the hip/ programs need the HIP backend");
        return;
    }
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".into());
    let found = Command::new(&hipcc)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        skip(&format!(
            "{hipcc} is not installed (Debian: apt install hipcc)"
        ));
        return;
    }
    // cargo test builds libmori_tp.a with this run's features next to the test executables.
    let lib = common::built_static_library();
    let build = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hip-programs");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let make = Command::new("make")
        .arg("-C")
        .arg(root.join("hip"))
        .arg(format!("HIPCC={hipcc}"))
        .arg(format!("MORI_TP_LIB={}", lib.display()))
        .arg(format!("BUILD={}", build.display()))
        .output()
        .expect("run make");
    let log = text(&make);
    assert!(make.status.success(), "make -C hip failed:\n{log}");
    assert!(log.contains("built for: gfx90a"), "{log}");

    for (program, args, passed) in [
        ("device_test", &[][..], "device_test: all checks passed"),
        ("bench", &["--quick"][..], "bench: done"),
    ] {
        let output = Command::new(build.join(program))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        let out = text(&output);
        match output.status.code() {
            Some(0) => assert!(
                out.contains(passed),
                "{program} exited 0 but printed:\n{out}"
            ),
            Some(77) => {
                assert!(
                    out.contains(&format!("{program}: skipped: no HIP device")),
                    "{program} exited 77 but printed:\n{out}"
                );
                assert!(
                    !required("MORI_TP_REQUIRE_HIP_DEVICE"),
                    "MORI_TP_REQUIRE_HIP_DEVICE=1 but {program} found no device:\n{out}"
                );
                eprint!("{out}");
            }
            code => panic!("{program} {args:?} failed ({code:?}):\n{out}"),
        }
    }

    let fake = common::build_fake_hip().unwrap_or_else(|why| panic!("{why}"));
    let fake_5_2 = common::build_fake_hip_5_2().unwrap_or_else(|why| panic!("{why}"));
    for (runtime, program, args, devices, passed) in [
        (
            &fake,
            "device_test",
            &[][..],
            "1",
            &[
                "direct, hipMemcpy2DAsync per rect: every decode byte checked",
                "pack + unpack, one copy-kernel launch: every decode byte checked",
                "page size 1, prefill TP 2 -> decode TP 8, device memory, 48 pages",
                "pinned host memory, 48 pages",
                "registered host memory (hipHostRegister): the copy kernel takes the device address",
                "pair NHD (pages of 16) -> HND (pages of 64), 173 tokens, hipMemcpy2DAsync per rect: send, \
                 pack, unpack checked",
                "pair NHD (pages of 16) -> HND (pages of 64), 173 tokens, one copy-kernel launch: send, \
                 pack, unpack checked",
                "groups: two pairs (NHD 16 -> HND 64, 173 tokens; HND 16 -> NHD 16, 40 tokens) in one \
                 mori_tp_groups_send, per rect and with the kernel: every byte checked",
                "device staging pool (MORI_TP_POOL_DEVICE): pack into a slot and unpack from it, per \
                 rect and with the kernel: every byte checked",
                "two streams, 8 interleaved sends each way (kernel, then per rect), not waited for \
                 between calls: every byte checked",
                "one device: the two-device checks need two",
                "device_test: all checks passed",
            ][..],
        ),
        (
            &fake,
            "device_test",
            &[][..],
            "2",
            &[
                "two devices, device 0 current, stream and decode side on device 1, peer access on:",
                "rule: this HIP runtime has hipStreamGetDevice",
                "prefill on device 0, decode on device 1, 48 pages",
                "device_test: all checks passed",
            ][..],
        ),
        // HIP 5.x has no hipStreamGetDevice: the library refuses a copy-kernel call whose stream
        // is not the current device's, so the programs make the stream's device current.
        (
            &fake_5_2,
            "device_test",
            &[][..],
            "2",
            &[
                "two devices, device 1 made current, stream and decode side on device 1",
                "rule: this HIP runtime has no hipStreamGetDevice",
                "prefill on device 0, decode on device 1, 48 pages",
                "device_test: all checks passed",
            ][..],
        ),
        (
            &fake_5_2,
            "bench",
            &["--quick"][..],
            "2",
            &[
                "bench: two devices: this HIP runtime has no hipStreamGetDevice, so device 1",
                "bench: prefill on device 0, decode on device 1",
                "bench: done",
            ][..],
        ),
        // Rows of both paths for every shape: the one-row rects (640 rects x 4 buffers for the
        // per-rect path; a table of 64 + 48 + 8 * 640 bytes, too big for the kernel's argument,
        // so uploaded), the contiguous shape (a table inside the argument), the last pair
        // shape, the byte check of every shape, the other placements. The one-row shape keeps
        // every lane of the kernel busy.
        (
            &fake,
            "bench",
            &["--quick"][..],
            "2",
            &[
                "bench: two devices: this HIP runtime has hipStreamGetDevice",
                "nhd-tp2to8-p1-runs1       640    640     0.6 send   memcpy2d     2560",
                "nhd-tp2to8-p1-runs1       640    640     0.6 send   kernel          1     5232",
                "nhd-tp2to8-p16-contig     640      1     0.6 send   kernel          1        0",
                "hnd16-nhd16-tp4to4        640     80     1.2 unpack kernel          1",
                "bench: staging in pinned host memory",
                "bench: prefill on device 0, decode on device 1",
                "bench: byte checks: 9 cases, the kernel's send equal to the memcpy2D send",
                "bench: done",
            ][..],
        ),
    ] {
        let output = Command::new(build.join(program))
            .args(args)
            .env("LD_PRELOAD", runtime)
            .env("FAKE_HIP_DEVICES", devices)
            .env_remove("FAKE_HIP_COPY_STATUS")
            .env_remove("FAKE_HIP_LAUNCH_STATUS")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        let out = text(&output);
        assert!(
            output.status.code() == Some(0)
                && out.contains("fake_hip")
                && passed.iter().all(|p| out.contains(p)),
            "{program} over the stand-in runtime {} with {devices} devices ({:?}) lacks one of \
             {passed:?}:\n{out}",
            runtime.display(),
            output.status
        );
        if program == "bench" && runtime == &fake {
            let fragmented = out
                .lines()
                .find(|l| {
                    l.starts_with("nhd-tp2to8-p1-runs1       640    640     0.6 send   kernel")
                })
                .expect("the one-row rects' kernel row");
            assert!(
                fragmented.ends_with("100.0%"),
                "one-row rects keep every lane busy: {fragmented}"
            );
        }
    }
}
