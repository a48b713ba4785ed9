//! The service under test, and what `/proc` says about it: either the
//! release `autopush` binary, all-in-one, on loopback, with a fresh embedded
//! store (and its built-in TLS if asked), or any running server speaking the push websocket protocol and the
//! Web Push HTTP API (target mode), named by its URLs and process ids.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::tls::KeyKind;

pub struct Server {
    /// The process started here, with its data directory (none in target mode).
    owned: Option<(Child, TempDir)>,
    /// The processes whose memory and CPU are measured.
    pids: Vec<u32>,
    pub ws_url: String,
    pub endpoint_url: String,
}

/// A server started elsewhere: `--target-ws`, `--target-endpoint`, `--target-pids`.
#[derive(Clone, Debug)]
pub struct Target {
    pub ws_url: String,
    pub endpoint_url: String,
    pub pids: Vec<u32>,
}

/// Which server a scenario loads.
#[derive(Clone, Debug)]
pub enum ServerUnderTest {
    /// Start our binary, logging to `log`, serving TLS on its public ports
    /// with a certificate of this kind if `tls` (clients trust the run's CA).
    Start {
        log: PathBuf,
        tls: Option<KeyKind>,
    },
    Target(Target),
}

impl Server {
    /// Start our binary with `flags`, or attach to the target (where `flags`,
    /// settings of our binary, cannot apply: they are named on stderr).
    pub async fn open(under_test: &ServerUnderTest, flags: &[&str]) -> Server {
        match under_test {
            ServerUnderTest::Start { log, tls } => Server::launch(flags, log, *tls).await,
            ServerUnderTest::Target(target) => {
                if !flags.is_empty() {
                    eprintln!(
                        "note: target mode: {} apply to our binary only, not to the target",
                        flags.join(" ")
                    );
                }
                for pid in &target.pids {
                    if !Path::new(&format!("/proc/{pid}")).exists() {
                        panic!("--target-pids: no process {pid}");
                    }
                }
                Server {
                    owned: None,
                    pids: target.pids.clone(),
                    ws_url: target.ws_url.clone(),
                    endpoint_url: target.endpoint_url.trim_end_matches('/').to_owned(),
                }
            }
        }
    }

    /// Start `autopush all` with `extra` flags and wait until it answers.
    /// Its log goes to `log` (per-connection info lines at 20k clients would
    /// otherwise flood the terminal).
    pub async fn start(extra: &[&str], log: &Path) -> Server {
        Server::launch(extra, log, None).await
    }

    /// [`Server::start`], over TLS with a new `tls` certificate if given.
    pub async fn launch(extra: &[&str], log: &Path, tls: Option<KeyKind>) -> Server {
        let data = TempDir::new().expect("a temporary data directory");
        let [ws, router, endpoint] = free_ports();
        let (ws_scheme, http_scheme) = if tls.is_some() {
            ("wss", "https")
        } else {
            ("ws", "http")
        };
        let endpoint_url = format!("{http_scheme}://127.0.0.1:{endpoint}");
        let tls_flags = tls.map(|kind| {
            crate::client::trust(&crate::tls::ca_file());
            let certificate = crate::tls::issue(kind);
            [
                "--tls-cert".into(),
                certificate.cert.into_os_string(),
                "--tls-key".into(),
                certificate.key.into_os_string(),
            ]
        });
        let log_file = std::fs::File::create(log).expect("the server log file");
        let child = Command::new(server_binary())
            .arg("all")
            .args(["--host", "127.0.0.1"])
            .args(["--port", &ws.to_string()])
            .args(["--router-port", &router.to_string()])
            .args(["--endpoint-port", &endpoint.to_string()])
            .args(["--endpoint-url", &endpoint_url])
            .arg("--db")
            .arg(data.path())
            .args(limit_flags(extra))
            .args(extra)
            .args(tls_flags.into_iter().flatten())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("autopush starts (build it with `cargo build --release`)");
        let server = Server {
            pids: vec![child.id()],
            owned: Some((child, data)),
            ws_url: format!("{ws_scheme}://127.0.0.1:{ws}/"),
            endpoint_url,
        };
        server.wait_ready(ws).await;
        server.wait_ready(endpoint).await;
        server
    }

    async fn wait_ready(&self, port: u16) {
        for _ in 0..600 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("autopush did not start listening within 30 s");
    }

    /// Resident set size of every server process, KiB.
    pub fn rss_kib(&self) -> u64 {
        self.pids.iter().map(|&pid| rss_kib(pid)).sum()
    }

    /// CPU time used so far by every server process (user + system), in
    /// clock ticks (1/100 s).
    pub fn cpu_ticks(&self) -> u64 {
        self.pids.iter().map(|&pid| cpu_ticks(pid)).sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some((child, _)) = &mut self.owned {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Resident set size of process `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status of the server: {e} (did it exit?)"));
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

/// CPU time used so far by process `pid` (user + system), in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |i: usize| fields.get(i - 3).and_then(|f| f.parse::<u64>().ok());
    field(14).unwrap_or(0) + field(15).unwrap_or(0)
}

/// The `autopush` binary built beside this one (same profile, same target dir).
fn server_binary() -> PathBuf {
    let me = std::env::current_exe().expect("the bench binary's path");
    me.with_file_name("autopush")
}

/// Three free loopback ports.
pub fn free_ports() -> [u16; 3] {
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    let port = |i: usize| listeners[i].local_addr().expect("bound").port();
    [port(0), port(1), port(2)]
}

/// Rate limits for a load generator: every client and push comes from one
/// address and one VAPID key, so per-address limits are off and the sender
/// limit is on but never reached (its check is part of what is measured).
/// A scenario that sets one of these flags itself keeps its own.
fn limit_flags(extra: &[&str]) -> Vec<&'static str> {
    [
        ("--sender-limit", "1000000000,1000000000"),
        ("--subscription-limit", "0"),
        ("--source-ip-limit", "0"),
        ("--registration-limit", "0"),
        ("--new-uaid-limit", "0"),
        ("--bridge-app-limit", "1000000000,1000000000"),
    ]
    .into_iter()
    .filter(|(flag, _)| !extra.contains(flag))
    .flat_map(|(flag, value)| [flag, value])
    .collect()
}
