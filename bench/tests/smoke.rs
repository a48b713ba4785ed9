//! The load generator itself works: each scenario, scaled down, runs against
//! the real server and checks what it must (every push accepted, every stored
//! message drained, idle workers connected). No timing is asserted.
//!
//! Needs `target/<profile>/autopush` beside the bench binary (`scripts/test`
//! builds it first).

use std::process::Command;

fn bench(args: &[&str]) -> String {
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let output = Command::new(env!("CARGO_BIN_EXE_autopush-bench"))
        .arg("--server-log")
        .arg(log.path())
        .args(args)
        .output()
        .expect("autopush-bench runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "autopush-bench {args:?} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn idle_reports_memory_per_client_for_each_level() {
    let out = bench(&["idle", "--levels", "10,30"]);
    assert!(out.contains("| 10 |"), "{out}");
    assert!(out.contains("| 30 |"), "{out}");
}

#[test]
fn direct_delivers_every_push_at_a_fixed_rate_and_closed_loop() {
    let out = bench(&[
        "direct",
        "--clients",
        "5",
        "--connections",
        "2",
        "--rates",
        "100,max",
        "--seconds",
        "1",
    ]);
    assert!(out.contains("| 100 |"), "{out}");
    assert!(out.contains("| max |"), "{out}");
}

#[test]
fn drain_stores_and_delivers_every_message() {
    let out = bench(&[
        "drain",
        "--clients",
        "4",
        "--per-client",
        "3",
        "--connections",
        "2",
    ]);
    assert!(
        out.contains("4 offline clients x 3 messages = 12 messages"),
        "{out}"
    );
    assert!(out.contains("| store"), "{out}");
}

#[test]
fn apns_pushes_reach_the_double_at_each_latency() {
    let out = bench(&[
        "apns",
        "--devices",
        "5",
        "--connections",
        "2",
        "--latencies",
        "1,5",
        "--seconds",
        "1",
    ]);
    assert!(out.contains("| 1 |"), "{out}");
    assert!(out.contains("| 5 |"), "{out}");
}

#[test]
fn fcm_reaches_google_with_one_token() {
    let out = bench(&[
        "fcm",
        "--devices",
        "3",
        "--connections",
        "2",
        "--delays-ms",
        "1",
        "--rates",
        "50,max",
        "--seconds",
        "1",
    ]);
    assert!(out.contains("| 1 | 50 |"), "{out}");
    assert!(out.contains("| 1 | max |"), "{out}");
}
