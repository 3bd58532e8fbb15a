//! MORI-IO itself: ROCm/mori at commit 1e3ce4e1 (branch feature/tcp-backend), built by
//! `hip/mori-io-build.sh` in its chroot, moving host memory with its TCP backend on 127.0.0.1.
//! `tests/mori_io/pair_batch_write.cpp`, linked against MORI-IO's libmori_io and this
//! `cargo test`'s libmori_tp.a, drives `IOEngine::BatchWrite` and an `IOEngineSession`'s
//! `BatchWrite` with mori-tp's pair plan (`mori_tp_pair_config`, `mori_tp_pair_segments`)
//! between two processes and checks every decode byte against `mori_send_kvcache_pair`.
//! (The Python transport's two-process tests are in tests/python.rs.) Without the build, or
//! without root, the test skips saying so; under MORI_TP_REQUIRE_TOOLS=1 (CI) it fails.

mod common;

#[test]
fn mori_io_batch_write_moves_the_pair_plan_byte_exact_between_two_processes() {
    let test = "mori_io_batch_write_moves_the_pair_plan_byte_exact_between_two_processes";
    if cfg!(any(feature = "hip", feature = "cuda")) {
        // libmori_tp.a would need the host's GPU runtimes inside the chroot; the program
        // uses only the host backend, which the default build tests.
        common::skip(
            test,
            "runs in the default-feature build (its libmori_tp.a is host-only)",
        );
        return;
    }
    if let Some(why) = common::mori_io_missing() {
        common::skip_missing(test, "MORI_TP_REQUIRE_TOOLS", &why);
        return;
    }
    let library = common::built_static_library();
    let program = common::scratch(&["mori_io"]).join("pair_batch_write");
    let build = format!(
        "g++ -std=c++17 -O1 -w -D__HIP_PLATFORM_AMD__=1 -DMSGPACK_NO_BOOST -DSPDLOG_HEADER_ONLY \
         -Iinclude -I\"$MORI_TP_MORI_SRC/include\" -I\"$MORI_TP_MORI_SRC\" \
         -I\"$MORI_TP_MORI_SRC/3rdparty/spdlog/include\" tests/mori_io/pair_batch_write.cpp \
         -o '{program}' '{library}' {libs} -L\"$MORI_TP_MORI_IO/python/mori\" -lmori_io \
         -Wl,-rpath,\"$MORI_TP_MORI_IO/python/mori\" -lamdhip64 && timeout 120 '{program}'",
        program = program.display(),
        library = library.display(),
        libs = common::STATIC_LIBS,
    );
    let report = common::run(&mut common::mori_io_command(&["bash", "-c", &build]));
    assert!(
        report.contains("pair_batch_write: passed")
            && report.contains("every status SUCCESS")
            && report.contains("the check fails in that segment only"),
        "pair_batch_write did not report every check:\n{report}"
    );
    println!("{report}");
}
