//! Runs the Python package's tests against the libmori_tp shared library that this `cargo test`
//! just built, so the README's one test command covers the Python binding too:
//! `python/tests` (standard-library unittest), and the two-process transfers through real
//! engines (`python/tests/engine_loopback.py` and, pipelined and streamed with staging pools,
//! `python/tests/engine_streaming.py`; requests of several groups of a hybrid model with
//! pipeline stages that differ, `python/tests/engine_groups.py`; Mooncake and NIXL over
//! 127.0.0.1, and MORI-IO's TCP backend in `hip/mori-io-build.sh`'s chroot), with faults (`python/tests/engine_faults.py`: a peer killed, a notification
//! lost, a peer restarted, more segments than an engine call takes), under load
//! (`python/tests/engine_load.py`) and between two network namespaces
//! (`python/tests/engine_two_hosts.py`).

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

/// `python3 args...` in the crate directory, with the package and the built library.
fn python3(args: &[&str]) -> Command {
    let library = common::built_library();
    assert!(
        library.is_file(),
        "{} is missing: cargo builds the cdylib with the library target (crate-type \
         \"cdylib\" in Cargo.toml)",
        library.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut command = Command::new("python3");
    command
        .args(args)
        .current_dir(crate_dir)
        .env("MORI_TP_LIBRARY", &library)
        .env("PYTHONPATH", crate_dir.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    command
}

#[test]
fn python_package_tests_pass_against_the_library_cargo_built() {
    let command = python3(&["-m", "unittest", "discover", "-s", "python/tests", "-v"]);
    let (output, report) = common::run_bounded(command, Duration::from_secs(600));
    assert!(
        output.status.success(),
        "the Python tests failed ({}) against {}:\n{report}",
        output.status,
        common::built_library().display()
    );
    // unittest's per-test report, including skips (numpy), with `cargo test -- --nocapture`.
    println!("{report}");
}

/// Exit status of engine_loopback.py and nixl_exit.py when what they need is not installed.
const SKIPPED: i32 = 77;

/// Runs `python3 args...`; None after skipping `test` (the script exited [`SKIPPED`], saying
/// why; under MORI_TP_REQUIRE_TOOLS that fails the test instead).
fn run_or_skip(test: &str, args: &[&str], limit: Duration) -> Option<(Output, String)> {
    if cfg!(any(feature = "hip", feature = "cuda")) {
        // The two-process engine scripts move host memory on the host backend: a GPU feature
        // changes nothing they reach (the package's own tests above do run against that
        // build), and .ci/run's feature pass would only run them again.
        common::skip(
            test,
            "runs in the pass without GPU features (.ci/run's cargo test)",
        );
        return None;
    }
    let (output, report) = common::run_bounded(python3(args), limit);
    if output.status.code() == Some(SKIPPED) {
        common::skip_missing(
            test,
            "MORI_TP_REQUIRE_TOOLS",
            String::from_utf8_lossy(&output.stdout).trim(),
        );
        return None;
    }
    Some((output, report))
}

/// MORI-IO's run of a two-process script (`python/tests/<script> mori_io ...`): in the chroot
/// of `hip/mori-io-build.sh`, whose build of ROCm/mori 1e3ce4e1 (TCP backend) it uses, with
/// `env` set there; skips (under MORI_TP_REQUIRE_TOOLS fails) without that build or root.
fn mori_io_run(test: &str, env: &[&str], args: &[&str]) -> Option<(Output, String)> {
    if cfg!(any(feature = "hip", feature = "cuda")) {
        // A `hip` build links the host's libamdhip64.so.5 (Debian bookworm's HIP 5.2), which
        // MORI-IO's chroot (HIP 7.2.4) does not have; the adapter moves host memory on the host
        // backend, which the default build runs here.
        common::skip(
            test,
            "runs in the pass without GPU features (.ci/run's cargo test)",
        );
        return None;
    }
    if let Some(why) = common::mori_io_missing() {
        common::skip_missing(test, "MORI_TP_REQUIRE_TOOLS", &why);
        return None;
    }
    let mut inner = vec!["env"];
    inner.extend_from_slice(env);
    inner.push("python3");
    inner.extend_from_slice(args);
    let mut command = common::mori_io_command(&inner);
    command
        .env("MORI_TP_LIBRARY", common::built_library())
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let (output, report) = common::run_bounded(command, Duration::from_secs(300));
    assert_ne!(
        output.status.code(),
        Some(SKIPPED),
        "{test}: the MORI-IO build is there, but the script skipped:\n{report}"
    );
    assert!(
        output.status.success(),
        "{test} failed ({}):\n{report}",
        output.status
    );
    Some((output, report))
}

/// `python/tests/<script> mori_io [case]` through MORI-IO, side-channel completion (as SGLang
/// and vLLM use it) or MORI-IO's inbound status as well.
fn mori_io_script(test: &str, completion: &str, args: &[&str]) {
    let env = format!("MORI_TP_MORI_IO_COMPLETION={completion}");
    if let Some((output, _)) = mori_io_run(test, &[&env], args) {
        println!("{}", String::from_utf8_lossy(&output.stdout));
    }
}

#[test]
fn mori_io_moves_every_pair_byte_exact_between_two_processes() {
    mori_io_script(
        "mori_io_moves_every_pair_byte_exact_between_two_processes",
        "side-channel",
        &["python/tests/engine_loopback.py", "mori_io"],
    );
}

#[test]
fn mori_io_with_inbound_status_completion_moves_every_pair_byte_exact() {
    mori_io_script(
        "mori_io_with_inbound_status_completion_moves_every_pair_byte_exact",
        "inbound",
        &["python/tests/engine_loopback.py", "mori_io"],
    );
}

#[test]
fn mori_io_pipelines_and_streams_requests_byte_exact_between_two_processes() {
    mori_io_script(
        "mori_io_pipelines_and_streams_requests_byte_exact_between_two_processes",
        "side-channel",
        &["python/tests/engine_streaming.py", "mori_io"],
    );
}

#[test]
fn mori_io_with_inbound_status_completion_pipelines_and_streams_requests() {
    mori_io_script(
        "mori_io_with_inbound_status_completion_pipelines_and_streams_requests",
        "inbound",
        &["python/tests/engine_streaming.py", "mori_io"],
    );
}

#[test]
fn mori_io_moves_hybrid_requests_of_several_groups_between_two_processes() {
    mori_io_script(
        "mori_io_moves_hybrid_requests_of_several_groups_between_two_processes",
        "side-channel",
        &["python/tests/engine_groups.py", "mori_io"],
    );
}

#[test]
fn mori_io_faults_decode_killed_prefill_killed_lost_notification_restart_and_segments() {
    for case in [
        "decode-killed",
        "prefill-killed",
        "lost-notification",
        "restart",
        "segments",
    ] {
        mori_io_script(
            &format!("mori_io_fault_{}", case.replace('-', "_")),
            "side-channel",
            &["python/tests/engine_faults.py", "mori_io", case],
        );
    }
}

fn engine_moves_every_pair_between_two_processes(engine: &str) {
    let test = format!("{engine}_moves_every_pair_byte_exact_between_two_processes");
    let args = ["python/tests/engine_loopback.py", engine];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} loopback transfers failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_moves_every_pair_byte_exact_between_two_processes() {
    engine_moves_every_pair_between_two_processes("mooncake");
}

#[test]
fn nixl_moves_every_pair_byte_exact_between_two_processes() {
    engine_moves_every_pair_between_two_processes("nixl");
}

fn engine_streams_requests_between_two_processes(engine: &str) {
    let test = format!("{engine}_pipelines_and_streams_requests_byte_exact_between_two_processes");
    let args = ["python/tests/engine_streaming.py", engine];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} pipelined and streamed transfers failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_pipelines_and_streams_requests_byte_exact_between_two_processes() {
    engine_streams_requests_between_two_processes("mooncake");
}

#[test]
fn nixl_pipelines_and_streams_requests_byte_exact_between_two_processes() {
    engine_streams_requests_between_two_processes("nixl");
}

fn engine_moves_hybrid_requests_between_two_processes(engine: &str) {
    let test = format!("{engine}_moves_hybrid_requests_of_several_groups_between_two_processes");
    let args = ["python/tests/engine_groups.py", engine];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} requests of several groups failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_moves_hybrid_requests_of_several_groups_between_two_processes() {
    engine_moves_hybrid_requests_between_two_processes("mooncake");
}

#[test]
fn nixl_moves_hybrid_requests_of_several_groups_between_two_processes() {
    engine_moves_hybrid_requests_between_two_processes("nixl");
}

/// `python/tests/engine_faults.py <engine> <case>`: one fault between two processes on
/// 127.0.0.1 (the script bounds every wait itself, and this test kills it after 300 s).
fn engine_survives_a_fault(engine: &str, case: &str) {
    let test = format!("{engine}_fault_{}", case.replace('-', "_"));
    let args = ["python/tests/engine_faults.py", engine, case];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} fault case {case} failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

/// `python/tests/engine_late_writes.py <engine>`: a prefill rank stalled past the decode
/// rank's timeout at every stage (before its first chunk, between chunks, inside a write,
/// before and after the seal) writes nothing into memory the decode rank reused, and its
/// stream never reports success (issue 44 F01).
fn engine_late_writes_never_land_in_reused_memory(engine: &str) {
    let test = format!("{engine}_late_writes");
    let args = ["python/tests/engine_late_writes.py", engine];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} late writes failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_a_stalled_sender_never_writes_into_reused_pages_nor_reports_success() {
    engine_late_writes_never_land_in_reused_memory("mooncake");
}

#[test]
fn nixl_a_stalled_sender_never_writes_into_reused_pages_nor_reports_success() {
    engine_late_writes_never_land_in_reused_memory("nixl");
}

#[test]
fn mooncake_decode_killed_mid_transfer_fails_the_request_in_bounded_time_and_frees_its_slot() {
    engine_survives_a_fault("mooncake", "decode-killed");
}

#[test]
fn nixl_decode_killed_mid_transfer_fails_the_request_in_bounded_time_and_frees_its_slot() {
    engine_survives_a_fault("nixl", "decode-killed");
}

#[test]
fn mooncake_prefill_killed_mid_chunk_times_out_on_decode_and_unpacks_nothing_partial() {
    engine_survives_a_fault("mooncake", "prefill-killed");
}

#[test]
fn nixl_prefill_killed_mid_chunk_times_out_on_decode_and_unpacks_nothing_partial() {
    engine_survives_a_fault("nixl", "prefill-killed");
}

#[test]
fn mooncake_lost_or_never_sent_notifications_end_in_bounded_errors() {
    engine_survives_a_fault("mooncake", "lost-notification");
}

#[test]
fn nixl_lost_or_never_sent_notifications_end_in_bounded_errors() {
    engine_survives_a_fault("nixl", "lost-notification");
}

#[test]
fn mooncake_plan_against_a_restarted_peers_old_memory_is_refused_and_writes_nothing() {
    engine_survives_a_fault("mooncake", "restart");
}

#[test]
fn nixl_plan_against_a_restarted_peers_old_memory_is_refused_and_writes_nothing() {
    engine_survives_a_fault("nixl", "restart");
}

#[test]
fn mooncake_requests_past_the_per_peer_queue_are_split_and_land_whole() {
    engine_survives_a_fault("mooncake", "segments");
}

#[test]
fn nixl_requests_of_many_segments_land_whole() {
    engine_survives_a_fault("nixl", "segments");
}

/// `python/tests/engine_load.py <engine>`: 16 requests in flight of mixed layouts and sizes,
/// then a soak of `MORI_TP_SOAK_SECONDS` (default 30; at most 60 in CI) with every byte checked
/// and the processes' RSS flat; the script bounds itself at the soak plus 240 s.
fn engine_under_load(engine: &str) {
    let test = format!("{engine}_sixteen_in_flight_and_a_soak_lose_nothing_and_keep_rss_flat");
    let args = ["python/tests/engine_load.py", engine];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(900)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} load failed ({}):\n{report}",
        output.status
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_sixteen_in_flight_and_a_soak_lose_nothing_and_keep_rss_flat() {
    engine_under_load("mooncake");
}

#[test]
fn nixl_sixteen_in_flight_and_a_soak_lose_nothing_and_keep_rss_flat() {
    engine_under_load("nixl");
}

/// Removes, when dropped (also while a failed or timed-out test unwinds), every network
/// namespace whose name starts with its prefix, after killing what still runs in it.
struct Namespaces(String);

impl Namespaces {
    fn left(&self) -> Vec<String> {
        let Ok(output) = Command::new("ip").args(["netns", "list"]).output() else {
            return Vec::new();
        };
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .filter(|name| name.starts_with(&self.0))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in self.left() {
            if let Ok(output) = Command::new("ip").args(["netns", "pids", &name]).output() {
                for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

/// `python/tests/engine_two_hosts.py <engine>`: a prefill and a decode process in two network
/// namespaces joined by a veth pair (netem delay and loss where the kernel has it, else a
/// token bucket that drops), every byte verified; the namespaces go whatever happens.
fn engine_moves_requests_between_two_namespaces(engine: &str) {
    let test = format!("{engine}_moves_requests_between_two_network_namespaces_byte_exact");
    // Unique per test process and engine, at most 12 characters.
    let prefix = format!("mtp{}{}", std::process::id() % 100_000, &engine[..1]);
    let namespaces = Namespaces(prefix.clone());
    let args = [
        "python/tests/engine_two_hosts.py",
        engine,
        "--prefix",
        &prefix,
    ];
    let Some((output, report)) = run_or_skip(&test, &args, Duration::from_secs(300)) else {
        return;
    };
    assert!(
        output.status.success(),
        "{engine} between two namespaces failed ({}):\n{report}",
        output.status
    );
    assert!(
        namespaces.left().is_empty(),
        "the script left namespaces {:?} behind:\n{report}",
        namespaces.left()
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn mooncake_moves_requests_between_two_network_namespaces_byte_exact() {
    engine_moves_requests_between_two_namespaces("mooncake");
}

#[test]
fn nixl_moves_requests_between_two_network_namespaces_byte_exact() {
    engine_moves_requests_between_two_namespaces("nixl");
}

/// nixl-cu12 1.5.1's UCX loads the system libefa, libibverbs and libnl next to its own copies,
/// and the system libnl's destructors then crash at exit (SIGSEGV) unless mori_tp loaded it
/// first (python/mori_tp/engines/nixl.py). Whether NIXL and the system libefa.so.1 are here:
/// without them these tests cannot reproduce that, and skip (fail under MORI_TP_REQUIRE_TOOLS).
fn nixl_with_system_rdma_core(test: &str) -> bool {
    let args = ["python/tests/nixl_exit.py", "probe"];
    let Some((output, report)) = run_or_skip(test, &args, Duration::from_secs(120)) else {
        return false;
    };
    assert!(
        output.status.success(),
        "the probe failed ({}):\n{report}",
        output.status
    );
    true
}

/// `python3 python/tests/nixl_exit.py args...`, which must end with `status` (not by a signal).
fn nixl_exit_script_ends_with(args: &[&str], status: i32) -> String {
    let mut all = vec!["python/tests/nixl_exit.py"];
    all.extend(args);
    let (output, report) = common::run_bounded(python3(&all), Duration::from_secs(120));
    assert_eq!(
        output.status.code(),
        Some(status),
        "nixl_exit.py {args:?} ended with {} instead of exit status {status}:\n{report}",
        output.status
    );
    report
}

#[test]
fn nixl_agent_made_by_the_adapter_exits_zero_with_the_system_rdma_core_loaded() {
    let test = "nixl_agent_made_by_the_adapter_exits_zero_with_the_system_rdma_core_loaded";
    if !nixl_with_system_rdma_core(test) {
        return;
    }
    // The script checks that the system libefa.so.1 is loaded, then returns normally: the
    // system libnl's destructors run, and crashed before NixlTransport.start loaded it first.
    let report = nixl_exit_script_ends_with(&["adapter"], 0);
    // Without that preload the same agent ends the process by a signal (nixl-cu12 1.5.1): shown
    // to say whether this machine reproduces the upstream crash, not checked (upstream may fix it).
    let (unprotected, _) = common::run_bounded(
        python3(&["python/tests/nixl_exit.py", "unprotected"]),
        Duration::from_secs(120),
    );
    println!(
        "{report}\nthe same agent made without the preload exits with {}",
        unprotected.status
    );
}

#[test]
fn nixl_exit_process_keeps_the_status_where_nixl_would_crash_at_exit() {
    let test = "nixl_exit_process_keeps_the_status_where_nixl_would_crash_at_exit";
    if !nixl_with_system_rdma_core(test) {
        return;
    }
    // An agent made without the preload (the crash armed), then exit_process(status).
    for status in [0, 3] {
        nixl_exit_script_ends_with(&["unprotected", &status.to_string()], status);
    }
}

#[test]
fn nixl_demo_exits_zero_after_success_and_one_after_a_failure() {
    let test = "nixl_demo_exits_zero_after_success_and_one_after_a_failure";
    if !nixl_with_system_rdma_core(test) {
        return;
    }
    let demo = |extra: &[&str]| {
        let mut args = vec!["-m", "mori_tp.demo", "--engine", "nixl", "--tokens", "256"];
        args.extend(["--layers", "2"]);
        args.extend(extra);
        common::run_bounded(python3(&args), Duration::from_secs(300))
    };
    let (output, report) = demo(&[]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "the NIXL demo ended with {} instead of exit status 0:\n{report}",
        output.status
    );
    assert_eq!(
        report.matches("every byte").count(),
        3,
        "the demo's table lacks its three verified methods:\n{report}"
    );
    // A zero timeout fails the first wait, after both agents exist: the wait for the decode
    // process's answer, or (when it answers at once: it only records the prefill's name) the
    // warm-up write's.
    let (output, report) = demo(&["--timeout", "0"]);
    assert_eq!(
        output.status.code(),
        Some(1),
        "the NIXL demo failed but ended with {} instead of exit status 1:\n{report}",
        output.status
    );
    assert!(
        report.contains("PeerError: the decode process sent nothing for 0.0 s")
            || report.contains("was still in progress after 0.0 s"),
        "the demo failed for another reason than the forced timeout:\n{report}"
    );
}
