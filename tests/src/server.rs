//! The real `autopush` binary, started in all-in-one mode on loopback ports.

use std::collections::BTreeSet;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::target_dir;

/// How long a (re)start may take before the harness gives up.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The binary under test: `AUTOPUSH_BIN`, else `<target>/debug/autopush`.
pub fn autopush_bin() -> PathBuf {
    match std::env::var_os("AUTOPUSH_BIN") {
        Some(p) => PathBuf::from(p),
        None => target_dir().join("debug").join("autopush"),
    }
}

/// A `Command` for the binary with a hermetic environment: every
/// `AUTOPUSH_*` variable (the server reads its settings from them) and
/// `CRYPTO_KEY` removed.
pub fn autopush_command() -> Command {
    let bin = autopush_bin();
    assert!(
        bin.exists(),
        "autopush binary not found at {} (run scripts/test, or `cargo build --bin autopush`, \
         or set AUTOPUSH_BIN)",
        bin.display()
    );
    let mut cmd = Command::new(bin);
    cmd.env("NO_COLOR", "1"); // plain logs in failure messages
    for (key, _) in std::env::vars_os() {
        let key_str = key.to_string_lossy();
        if key_str.starts_with("AUTOPUSH_") || key_str == "CRYPTO_KEY" {
            cmd.env_remove(&key);
        }
    }
    cmd
}

/// Run `autopush ARGS...` to completion (hang-guarded) and return its output.
pub async fn run_autopush(args: &[&str]) -> std::process::Output {
    run_autopush_with_env(args, &[]).await
}

/// [`run_autopush`] with these environment variables set.
pub async fn run_autopush_with_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = tokio::process::Command::from(autopush_command());
    cmd.args(args)
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .stdin(Stdio::null());
    match tokio::time::timeout(Duration::from_secs(60), cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("could not run autopush {args:?}: {e}"),
        Err(_) => panic!("autopush {args:?} did not finish within 60 s"),
    }
}

/// `--host 127.0.0.1` and free ports for `--port`, `--router-port` and
/// `--endpoint-port`, as flags for [`run_autopush`].
pub fn port_flags() -> Vec<String> {
    let [port, router_port, endpoint_port] = free_ports::<3>();
    [
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--router-port",
        &router_port.to_string(),
        "--endpoint-port",
        &endpoint_port.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// Free loopback TCP ports, none of them given out before in this process.
/// A port given out is free again to the OS until its user binds it (a
/// test's `--metrics-port` is bound only once its server starts), so the OS
/// may offer it again, to the same server's `--endpoint-port`.
pub fn free_ports<const N: usize>() -> [u16; N] {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // Held open until every port is chosen, so that the OS offers new ones.
    let mut held = Vec::new();
    let mut ports = Vec::with_capacity(N);
    while ports.len() < N {
        assert!(
            held.len() < 10_000,
            "no loopback port left that was not given out"
        );
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local_addr").port();
        if given.insert(port) {
            ports.push(port);
        }
        held.push(listener);
    }
    std::array::from_fn(|i| ports[i])
}

/// A running `autopush` process (`all` unless started with
/// [`Server::start_node`]). Killed on drop.
pub struct Server {
    /// Owned scratch space: logs, and the data dir unless one was given.
    work: TempDir,
    db: PathBuf,
    /// Which roles: `all`, `connection` or `endpoint`; and how it is set up
    /// beyond the defaults (see [`Node`]).
    node: Node,
    ws_port: u16,
    router_port: u16,
    endpoint_port: u16,
    child: Option<Child>,
    starts: u32,
}

impl Server {
    /// Start a server with default settings in a fresh data dir.
    pub async fn start() -> Server {
        Server::start_with(&[]).await
    }

    /// Start a server in a fresh data dir with extra command-line arguments
    /// (e.g. `["--msg-limit", "3"]`).
    pub async fn start_with(args: &[&str]) -> Server {
        Server::launch(None, args, &[]).await
    }

    /// Start a server in a fresh data dir with extra arguments and
    /// environment variables (e.g. `[("RUST_LOG", "debug")]`).
    pub async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        Server::launch(None, args, env).await
    }

    /// Start a server on an existing data dir (e.g. one a stopped server left).
    pub async fn start_in(dir: &Path, args: &[&str]) -> Server {
        Server::launch(Some(dir), args, &[]).await
    }

    async fn launch(dir: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Server {
        let node = Node {
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Node::default()
        };
        Server::launch_node(dir, node).await
    }

    /// Start `autopush ROLE` as `node` says (e.g. a connection node on
    /// DynamoDB whose endpoint URLs name a separate endpoint node).
    pub async fn start_node(node: Node) -> Server {
        Server::launch_node(None, node).await
    }

    async fn launch_node(dir: Option<&Path>, node: Node) -> Server {
        let work = tempfile::Builder::new()
            .prefix("autopush-e2e-")
            .tempdir()
            .expect("create temp dir");
        let db = match dir {
            Some(d) => d.to_path_buf(),
            None => work.path().join("db"),
        };
        std::fs::create_dir_all(&db).expect("create data dir");
        let [ws_port, router_port, endpoint_port] = free_ports::<3>();
        let mut server = Server {
            work,
            db,
            ws_port,
            router_port,
            endpoint_port,
            node,
            child: None,
            starts: 0,
        };
        // A port picked above can be taken by someone else before the server
        // binds it (more often on a machine busy with many connections, and
        // for a listener on 0.0.0.0): pick new ones and try again.
        const ATTEMPTS: usize = 8;
        for attempt in 1..=ATTEMPTS {
            match server.spawn_and_wait().await {
                Ok(()) => return server,
                Err(msg) if attempt < ATTEMPTS && msg.to_ascii_lowercase().contains("in use") => {
                    [server.ws_port, server.router_port, server.endpoint_port] = free_ports::<3>();
                }
                Err(msg) => panic!("{msg}"),
            }
        }
        unreachable!()
    }

    /// Whether the public ports speak TLS (started with `--tls-cert`).
    fn tls(&self) -> bool {
        self.node.args.iter().any(|a| a == "--tls-cert")
    }

    /// The websocket URL over TLS, `wss://127.0.0.1:P/`.
    pub fn wss_url(&self) -> String {
        format!("wss://127.0.0.1:{}/", self.ws_port)
    }

    /// The public HTTP base over TLS, `https://127.0.0.1:E`.
    pub fn https_endpoint_base(&self) -> String {
        format!("https://127.0.0.1:{}", self.endpoint_port)
    }

    /// The public ports: (websocket, endpoint).
    pub fn public_ports(&self) -> (u16, u16) {
        (self.ws_port, self.endpoint_port)
    }

    /// The websocket URL, `ws://127.0.0.1:P/`.
    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/", self.ws_port)
    }

    /// The public HTTP base, `http://127.0.0.1:E` (what `--endpoint-url` is).
    pub fn endpoint_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.endpoint_port)
    }

    /// The internal router API base, `http://127.0.0.1:R`.
    pub fn router_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.router_port)
    }

    /// The websocket port's HTTP base, `http://127.0.0.1:P`.
    pub fn ws_http_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.ws_port)
    }

    /// The data dir passed as `--db`.
    pub fn data_dir(&self) -> &Path {
        &self.db
    }

    /// The router key the server generated into its data dir (the first
    /// line of `router_key`), which signs internal router API calls.
    pub fn router_key(&self) -> String {
        let path = self.db.join("router_key");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("no router key at {}: {e}", path.display()));
        text.lines().next().unwrap_or_default().trim().to_string()
    }

    /// `METHOD {router_base}{path}`, signed with the server's router key.
    pub async fn router_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> crate::HttpReply {
        crate::http::signed(
            method,
            &self.router_base(),
            path,
            &self.router_key(),
            body.map(|b| b.to_string().into_bytes()),
        )
        .await
    }

    /// The running process's id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the server is not running").id()
    }

    /// The current run's stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.log_path("stderr")).unwrap_or_default()
    }

    /// Kill the process with SIGKILL and wait for it to be gone.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL on Unix
            let _ = child.wait();
        }
    }

    /// Stop the process with SIGTERM, as an orchestrator does, and wait (up
    /// to the hang guard) for it to exit; returns whether it exited cleanly.
    pub fn terminate(&mut self) -> bool {
        self.signal(libc::SIGTERM);
        let mut child = self.child.take().expect("the server is not running");
        let deadline = std::time::Instant::now() + crate::HANG_GUARD;
        loop {
            match child.try_wait().expect("wait for the server") {
                Some(status) => return status.success(),
                None if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "the server did not exit within {:?} of SIGTERM",
                        crate::HANG_GUARD
                    );
                }
            }
        }
    }

    /// Ask the process to reload (SIGHUP), as `systemctl reload` does.
    pub fn hangup(&self) {
        self.signal(libc::SIGHUP);
    }

    /// Freeze the process (SIGSTOP), as a stalled machine or VM is frozen:
    /// it keeps its sockets, and the kernel still accepts connections and
    /// buffers requests for it, but nothing answers until [`Server::resume`].
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Let a [`Server::pause`]d process run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let child = self.child.as_ref().expect("the server is not running");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) with our own child's pid; it touches no memory.
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            sent,
            0,
            "kill({pid}, {signal}): {}",
            std::io::Error::last_os_error()
        );
    }

    /// Start again on the same data dir, ports and arguments (killing the
    /// running process first, if any).
    pub async fn restart(&mut self) {
        self.kill9();
        if let Err(msg) = self.spawn_and_wait().await {
            panic!("restart failed: {msg}");
        }
    }

    fn log_path(&self, stream: &str) -> PathBuf {
        self.work
            .path()
            .join(format!("server-{}.{stream}.log", self.starts))
    }

    /// The command line: our ports, endpoint URL and data dir, then the extra
    /// arguments, which may replace any of those (e.g. `--endpoint-url`).
    fn args(&self) -> Vec<String> {
        let endpoint_url = match &self.node.endpoint_url {
            Some(url) => url.clone(),
            None if self.tls() => self.https_endpoint_base(),
            None => self.endpoint_base(),
        };
        let db = match &self.node.db {
            Some(db) => db.clone(),
            None => self.db.display().to_string(),
        };
        // A connection node on a shared store journals its direct copies
        // by default in ./autopush-journal: give each node its own, kept
        // across its restarts.
        let journal = shared_store(&db).then(|| {
            let dir = self.work.path().join("journal");
            ("--journal-dir", dir.display().to_string())
        });
        // The node's own arguments replace these defaults where they name
        // the same flag (e.g. a wrong --endpoint-url on purpose).
        let defaults = [
            ("--host", "127.0.0.1".to_string()),
            ("--port", self.ws_port.to_string()),
            ("--router-port", self.router_port.to_string()),
            ("--endpoint-port", self.endpoint_port.to_string()),
            ("--endpoint-url", endpoint_url),
            ("--db", db),
            // Every test client comes from 127.0.0.1: limits per source
            // address would count a whole test as one user. Tests of those
            // limits set them.
            ("--source-ip-limit", "0".to_string()),
            ("--registration-limit", "0".to_string()),
            ("--new-uaid-limit", "0".to_string()),
        ];
        let mut args = vec![self.node.role.to_string()];
        for (flag, value) in defaults.into_iter().chain(journal) {
            let named =
                |a: &String| a == flag || a.strip_prefix(flag).is_some_and(|v| v.starts_with('='));
            if !self.node.args.iter().any(named) {
                args.extend([flag.to_string(), value]);
            }
        }
        args.extend(self.node.args.iter().cloned());
        args
    }

    async fn spawn_and_wait(&mut self) -> Result<(), String> {
        self.starts += 1;
        let stdout = File::create(self.log_path("stdout")).expect("create stdout log");
        let stderr = File::create(self.log_path("stderr")).expect("create stderr log");
        let args = self.args();
        let mut command = autopush_command();
        if self.node.clock_offset_secs != 0 {
            // Preloaded rather than through the `faketime` wrapper, which
            // forks: the child must be the node itself, for `pause`.
            command
                .env("LD_PRELOAD", libfaketime())
                .env("FAKETIME", format!("{:+}s", self.node.clock_offset_secs))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = command
            .args(&args)
            .envs(self.node.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} {args:?}: {e}", autopush_bin().display()));
        self.child = Some(child);

        let client = autopush_common::http_client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("reqwest client");
        // Over TLS the listeners are bound once the service says it runs
        // (the health routes there are the TLS tests' business).
        let mut urls = Vec::new();
        if self.node.role != "connection" && !self.tls() {
            urls.push(format!("{}/health", self.endpoint_base()));
        }
        if self.node.role != "endpoint" && !self.tls() {
            urls.push(format!("{}/health", self.ws_http_base()));
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(self.failure(&args, &format!("exited during start-up ({status})")));
            }
            let mut healthy = !self.tls() || self.stderr().contains("autopush running");
            for url in &urls {
                let ok =
                    matches!(client.get(url).send().await, Ok(r) if r.status().as_u16() == 200);
                healthy &= ok;
            }
            if healthy {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill9();
                return Err(self.failure(
                    &args,
                    &format!("not healthy within {START_TIMEOUT:?} ({urls:?})"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn failure(&self, args: &[String], what: &str) -> String {
        let tail = |s: String| {
            let start = s.len().saturating_sub(6000);
            let start = (start..s.len())
                .find(|i| s.is_char_boundary(*i))
                .unwrap_or(0);
            s[start..].to_string()
        };
        let stdout = std::fs::read_to_string(self.log_path("stdout")).unwrap_or_default();
        format!(
            "autopush {args:?} {what}\n--- stderr ---\n{}\n--- stdout ---\n{}",
            tail(self.stderr()),
            tail(stdout)
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        // Shown by the test runner only for a failed test.
        if std::thread::panicking() {
            let stderr = self.stderr();
            let start = stderr.len().saturating_sub(8000);
            let start = (start..stderr.len())
                .find(|i| stderr.is_char_boundary(*i))
                .unwrap_or(0);
            eprintln!(
                "--- autopush stderr (last run, tail) ---\n{}",
                &stderr[start..]
            );
        }
    }
}

/// How to start a node with [`Server::start_node`].
#[derive(Clone, Debug)]
pub struct Node {
    /// `all`, `connection` or `endpoint`.
    pub role: &'static str,
    /// `--db`; `None`: a fresh data dir.
    pub db: Option<String>,
    /// `--endpoint-url`; `None`: this process's own endpoint port.
    pub endpoint_url: Option<String>,
    /// Extra environment (e.g. where DynamoDB is).
    pub env: Vec<(String, String)>,
    /// Extra command-line arguments.
    pub args: Vec<String>,
    /// Seconds the node's wall clock (`SystemTime::now`, `clock_gettime`)
    /// runs ahead of the real one, negative for behind, faked with
    /// libfaketime; 0 for the real clock. Its monotonic clock is left alone.
    pub clock_offset_secs: i64,
}

impl Default for Node {
    fn default() -> Self {
        Node {
            role: "all",
            db: None,
            endpoint_url: None,
            env: Vec::new(),
            args: Vec::new(),
            clock_offset_secs: 0,
        }
    }
}

/// libfaketime, from the Debian package `faketime`.
fn libfaketime() -> PathBuf {
    // Where Debian puts it: /usr/lib/<multiarch triplet>/faketime/.
    let triplets = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("faketime"));
    let candidates =
        triplets.chain(["/usr/lib/faketime", "/usr/local/lib/faketime"].map(PathBuf::from));
    candidates
        .map(|dir| dir.join("libfaketime.so.1"))
        .find(|lib| lib.exists())
        .expect(
            "libfaketime not found; a node with a clock offset needs it \
             (apt-get install faketime)",
        )
}

/// Client shortcuts.
impl Server {
    /// A new user agent: connected, hello done.
    pub async fn client(&self) -> crate::WsClient {
        crate::WsClient::connect_hello(&self.ws_url(), None).await
    }

    /// The user agent `uaid` coming back: connected, hello done, and the
    /// server kept its uaid.
    pub async fn reconnect(&self, uaid: &str) -> crate::WsClient {
        let ws = crate::WsClient::connect_hello(&self.ws_url(), Some(uaid)).await;
        assert_eq!(ws.uaid(), uaid, "the server replaced the uaid on reconnect");
        ws
    }

    /// A new user agent with one subscription (VAPID-restricted when
    /// `vapid`), then disconnected. Returns its uaid and the subscription.
    pub async fn offline_subscription(&self, vapid: bool) -> (String, crate::Subscription) {
        let mut ws = self.client().await;
        let sub = if vapid {
            crate::Subscription::with_vapid(&mut ws).await
        } else {
            crate::Subscription::new(&mut ws).await
        };
        let uaid = ws.uaid().to_string();
        ws.close().await;
        (uaid, sub)
    }
}

/// Whether `--db` names a store shared by nodes (DynamoDB, Bigtable,
/// PostgreSQL) rather than an embedded store's directory.
fn shared_store(db: &str) -> bool {
    db == "dynamodb" || db == "bigtable" || db.contains("://")
}
