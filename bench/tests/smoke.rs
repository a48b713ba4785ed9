//! The load generator itself works: each scenario, scaled down, runs against
//! the real server and checks what it must (every push accepted, every stored
//! message drained, idle workers connected). No timing is asserted.
//!
//! Needs `target/<profile>/autopush` beside the bench binary (`scripts/test`
//! builds it first).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn run_bench(args: &[&str]) -> Output {
    let log = tempfile::NamedTempFile::new().expect("a log file");
    Command::new(env!("CARGO_BIN_EXE_autopush-bench"))
        .arg("--server-log")
        .arg(log.path())
        .args(args)
        .output()
        .expect("autopush-bench runs")
}

fn bench(args: &[&str]) -> String {
    let output = run_bench(args);
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
fn apns_pushes_reach_the_apple_stand_in_at_each_latency_and_rate() {
    let out = bench(&[
        "apns",
        "--devices",
        "5",
        "--connections",
        "2",
        "--latencies",
        "1,5",
        "--rates",
        "50,max",
        "--seconds",
        "1",
    ]);
    assert!(out.contains("| 1 | 50 |"), "{out}");
    assert!(out.contains("| 5 | max |"), "{out}");
}

#[test]
fn fcm_reaches_the_google_stand_in_with_one_token() {
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

/// Our binary started on its own, as any server under test would be.
struct Target {
    child: Child,
    _data: tempfile::TempDir,
    ws: String,
    endpoint: String,
}

impl Target {
    fn start() -> Target {
        let ports: Vec<u16> = (0..3)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
            .collect::<Vec<_>>()
            .iter()
            .map(|l| l.local_addr().expect("bound").port())
            .collect();
        let data = tempfile::tempdir().expect("a data dir");
        let endpoint = format!("http://127.0.0.1:{}", ports[2]);
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_autopush-bench")).with_file_name("autopush");
        let child = Command::new(binary)
            .args(["all", "--host", "127.0.0.1"])
            .args(["--port", &ports[0].to_string()])
            .args(["--router-port", &ports[1].to_string()])
            .args(["--endpoint-port", &ports[2].to_string()])
            .args(["--endpoint-url", &endpoint])
            .arg("--db")
            .arg(data.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("autopush starts (scripts/test builds it first)");
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", ports[0])).is_err() {
            assert!(Instant::now() < deadline, "autopush never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Target {
            child,
            _data: data,
            ws: format!("ws://127.0.0.1:{}/", ports[0]),
            endpoint,
        }
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--target-ws".into(),
            self.ws.clone(),
            "--target-endpoint".into(),
            self.endpoint.clone(),
            "--target-pids".into(),
            self.child.id().to_string(),
        ]
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn target_mode_runs_every_scenario_against_a_server_started_separately() {
    let target = Target::start();
    let with_target = |scenario: &[&str]| {
        let mut args: Vec<&str> = scenario.to_vec();
        let target_args = target.args();
        args.extend(target_args.iter().map(String::as_str));
        bench(&args)
    };
    let out = with_target(&["idle", "--levels", "10"]);
    assert!(out.contains("| 10 |"), "{out}");
    let out = with_target(&[
        "direct",
        "--clients",
        "3",
        "--connections",
        "2",
        "--rates",
        "50",
        "--seconds",
        "1",
    ]);
    assert!(out.contains("| 50 |"), "{out}");
    let out = with_target(&[
        "drain",
        "--clients",
        "3",
        "--per-client",
        "2",
        "--connections",
        "2",
    ]);
    assert!(
        out.contains("3 offline clients x 2 messages = 6 messages"),
        "{out}"
    );
}

#[test]
fn a_stalled_server_fails_the_scenario_with_the_reason() {
    // Accepts connections (the kernel's backlog) and never answers.
    let stalled = TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = stalled.local_addr().expect("bound").port();
    let output = run_bench(&[
        "drain",
        "--clients",
        "1",
        "--per-client",
        "1",
        "--timeout",
        "1",
        "--target-ws",
        &format!("ws://127.0.0.1:{port}/"),
        "--target-endpoint",
        &format!("http://127.0.0.1:{port}"),
        "--target-pids",
        &std::process::id().to_string(),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("did not answer the websocket handshake"),
        "{stderr}"
    );
}
