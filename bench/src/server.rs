//! The service under test: the release `autopush` binary, all-in-one, on
//! loopback, with a fresh embedded store, and what `/proc` says about it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

pub struct Server {
    child: Child,
    _data: TempDir,
    pub ws_url: String,
    pub endpoint_url: String,
}

impl Server {
    /// Start `autopush all` with `extra` flags and wait until it answers.
    /// Its log goes to `log` (per-connection info lines at 20k clients would
    /// otherwise flood the terminal).
    pub async fn start(extra: &[&str], log: &Path) -> Server {
        let data = TempDir::new().expect("a temporary data directory");
        let [ws, router, endpoint] = free_ports();
        let endpoint_url = format!("http://127.0.0.1:{endpoint}");
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
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("autopush starts (build it with `cargo build --release`)");
        let server = Server {
            child,
            _data: data,
            ws_url: format!("ws://127.0.0.1:{ws}/"),
            endpoint_url,
        };
        server.wait_ready(ws).await;
        server
    }

    async fn wait_ready(&self, ws_port: u16) {
        for _ in 0..600 {
            if tokio::net::TcpStream::connect(("127.0.0.1", ws_port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("autopush did not start listening within 30 s");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident set size, KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("/proc/<pid>/status of the server");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }

    /// CPU time used so far (user + system), in clock ticks (1/100 s).
    pub fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.pid())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
