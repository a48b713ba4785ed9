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
fn direct_through_latency_stand_ins_reports_per_sender_connection() {
    let out = bench(&[
        "direct",
        "--clients",
        "3",
        "--connections",
        "2",
        "--rates",
        "max",
        "--seconds",
        "1",
        "--rtt",
        "40ms",
        "--jitter",
        "2ms",
        "--sender-rtt",
        "20ms",
    ]);
    assert!(
        out.contains(
            "3 clients 40 ms away (round trip) acking after 0 ms, 2 HTTP connections 20 ms away"
        ),
        "{out}"
    );
    assert!(out.contains("| per sender connection (/s) |"), "{out}");
    // Every push crossed the sender's stand-in both ways: its POST → 201
    // took at least that round trip.
    let row = out
        .lines()
        .filter(|line| line.starts_with("| max |"))
        .nth(1)
        .unwrap_or_else(|| panic!("no per-connection row:\n{out}"));
    let p50: f64 = row
        .split('|')
        .nth(4)
        .and_then(|c| c.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(
        p50 >= 20.0,
        "POST → 201 p50 {p50} ms under the 20 ms round trip\n{out}"
    );
}

#[test]
fn direct_with_clients_that_never_ack_runs_every_step() {
    let out = bench(&[
        "direct",
        "--clients",
        "3",
        "--connections",
        "2",
        "--rates",
        "50",
        "--seconds",
        "1",
        "--no-ack",
    ]);
    assert!(out.contains("never acking"), "{out}");
}

/// Requests per push on each shared store, counted at the wire: a row per
/// kind and round trip, each with its store operations.
fn requests_on(store: &str, reads: &str, writes: &str) {
    let out = bench(&[
        "--store",
        store,
        "requests",
        "--rtts",
        "0,20ms",
        "--pushes",
        "4",
        "--clients",
        "2",
        "--connections",
        "1",
        "--settle",
        "0.5",
    ]);
    for rtt in ["0", "20"] {
        for kind in [
            "acked",
            "unacked",
            "stored",
            "stored, drained (reconnect, ack)",
        ] {
            let row = out
                .lines()
                .find(|line| line.starts_with(&format!("| {rtt} | {kind} |")))
                .unwrap_or_else(|| panic!("no row for {kind} at {rtt} ms:\n{out}"));
            assert!(
                row.contains(reads),
                "{kind} at {rtt} ms read nothing:\n{out}"
            );
            if kind == "stored" {
                assert!(row.contains(writes), "a stored push wrote nothing:\n{out}");
            }
        }
    }
}

#[test]
fn requests_are_counted_per_push_on_moto() {
    requests_on("moto", "GetItem", "PutItem");
}

#[test]
fn requests_are_counted_per_push_on_the_bigtable_emulator() {
    requests_on("bigtable", "ReadRows", "CheckAndMutateRow");
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

#[test]
fn delay_carries_bytes_to_any_port_and_back() {
    use std::io::{Read, Write};
    let echo = TcpListener::bind("127.0.0.1:0").expect("a port");
    let to = echo.local_addr().expect("bound");
    std::thread::spawn(move || {
        if let Ok((mut socket, _)) = echo.accept() {
            let mut buffer = [0u8; 64];
            while let Ok(n) = socket.read(&mut buffer) {
                if n == 0 || socket.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
        }
    });
    let listen = TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("bound");
    let mut child = Command::new(env!("CARGO_BIN_EXE_autopush-bench"))
        .args([
            "delay",
            "--listen",
            &listen.to_string(),
            "--to",
            &to.to_string(),
        ])
        .args(["--rtt", "10ms", "--jitter", "1ms"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("autopush-bench delay starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut socket = loop {
        if let Ok(socket) = TcpStream::connect(listen) {
            break socket;
        }
        assert!(Instant::now() < deadline, "delay never listened");
        std::thread::sleep(Duration::from_millis(50));
    };
    socket
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("a hang guard");
    socket.write_all(b"hello").expect("write");
    let mut back = [0u8; 5];
    let read = socket.read_exact(&mut back);
    let _ = child.kill();
    let _ = child.wait();
    read.expect("the bytes came back");
    assert_eq!(&back, b"hello");
}
