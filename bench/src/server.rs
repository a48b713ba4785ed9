//! The service under test, and what `/proc` says about it: either the
//! release `autopush` binary, all-in-one, on loopback, with a fresh embedded
//! store (and its built-in TLS if asked; or DynamoDB on moto, or the
//! Bigtable emulator, each behind a proxy that counts its requests, or
//! PostgreSQL, its statements counted by `pg_stat_statements`), or any
//! running server speaking the push websocket protocol and the Web Push HTTP
//! API (target mode), named by its URLs and process ids.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use autopush_tests::backend::{Db, node};
use autopush_tests::dynamo::ThrottlingProxy;
use tempfile::TempDir;

use crate::tls::KeyKind;
use crate::wire::{Counter, Counts, GrpcCounter, StatementCounter};

/// The store the server started here runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Store {
    /// The embedded store in a fresh data directory.
    #[default]
    Embedded,
    /// DynamoDB on moto (`scripts/test --setup-python`), fresh tables.
    Moto,
    /// Google's Bigtable emulator (`cbtemulator`), a fresh table.
    Bigtable,
    /// PostgreSQL 15, a fresh schema: a private cluster, or the one
    /// `AUTOPUSH_TEST_PG_DSN` names. Its CPU is measured with the server's.
    Postgres,
}

pub struct Server {
    /// The process started here, with its data directory (none in target mode).
    owned: Option<(Child, TempDir)>,
    /// Counts the requests to a shared store (moto, Bigtable, PostgreSQL).
    counter: Option<Counter>,
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
    /// Start our binary on `store`, logging to `log`, serving TLS on its
    /// public ports with a certificate of this kind if `tls` (clients trust
    /// the run's CA).
    Start {
        log: PathBuf,
        store: Store,
        tls: Option<KeyKind>,
        /// On a shared store, keep direct copies in a journal of the
        /// node's own (`--journal-dir` in its data directory), or not.
        journal: bool,
    },
    Target(Target),
}

impl Server {
    /// Start our binary with `flags`, or attach to the target (where `flags`,
    /// settings of our binary, cannot apply: they are named on stderr).
    pub async fn open(under_test: &ServerUnderTest, flags: &[&str]) -> Server {
        match under_test {
            ServerUnderTest::Start {
                log,
                store,
                tls,
                journal,
            } => Server::launch_in(*store, flags, log, *tls, *journal).await,
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
                    counter: None,
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
        Server::launch(Store::Embedded, extra, log, None).await
    }

    /// [`Server::start`] on `store`, over TLS with a new `tls` certificate
    /// if given.
    pub async fn launch(store: Store, extra: &[&str], log: &Path, tls: Option<KeyKind>) -> Server {
        Server::launch_in(store, extra, log, tls, false).await
    }

    /// [`Server::launch`], keeping direct copies in a journal of the
    /// node's own if `journal` (on a shared store).
    async fn launch_in(
        store: Store,
        extra: &[&str],
        log: &Path,
        tls: Option<KeyKind>,
        journal: bool,
    ) -> Server {
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
        let mut args: Vec<String> = limit_flags(extra)
            .into_iter()
            .chain(extra.iter().copied())
            .map(str::to_owned)
            .collect();
        let mut env = Vec::new();
        let mut pids = Vec::new();
        let (db, counter) = match store {
            Store::Embedded => (data.path().display().to_string(), None),
            Store::Moto => {
                let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let node = node(Db::Dynamo, &arg_refs).await;
                let moto = &autopush_tests::dynamo::local().await.endpoint;
                let proxy = ThrottlingProxy::start(moto).await;
                env = node.env;
                env.retain(|(key, _)| key != "AWS_ENDPOINT_URL_DYNAMODB");
                env.push(("AWS_ENDPOINT_URL_DYNAMODB".into(), proxy.endpoint.clone()));
                args = node.args;
                (node.db.unwrap_or_default(), Some(Counter::Dynamo(proxy)))
            }
            Store::Bigtable => {
                let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let node = node(Db::Bigtable, &arg_refs).await;
                let emulator = autopush_tests::bigtable::local().await;
                let counter = GrpcCounter::start(&emulator.host).await;
                args = node.args;
                (
                    format!("grpc://{}", counter.host),
                    Some(Counter::Bigtable(counter)),
                )
            }
            Store::Postgres => {
                let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let node = node(Db::Postgres, &arg_refs).await;
                let dsn = node.db.unwrap_or_default();
                // The node's settings name its schema; its pool is the
                // default one, not the tests' small one.
                let schema = node
                    .args
                    .iter()
                    .find_map(|arg| arg.strip_prefix("--db-settings="))
                    .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok())
                    .and_then(|json| json["schema"].as_str().map(str::to_owned))
                    .expect("the node's schema");
                args = node
                    .args
                    .into_iter()
                    .filter(|arg| !arg.starts_with("--db-settings="))
                    .collect();
                args.push(format!(
                    "--db-settings={}",
                    serde_json::json!({ "schema": schema })
                ));
                let counter = StatementCounter::start(&dsn, &schema);
                pids.push(counter.postmaster_pid());
                (dsn, Some(Counter::Postgres(counter)))
            }
        };
        if store != Store::Embedded {
            let dir = match journal {
                true => data.path().join("journal").display().to_string(),
                false => "off".into(),
            };
            args.push(format!("--journal-dir={dir}"));
        }
        let child = Command::new(server_binary())
            .arg("all")
            .args(["--host", "127.0.0.1"])
            .args(["--port", &ws.to_string()])
            .args(["--router-port", &router.to_string()])
            .args(["--endpoint-port", &endpoint.to_string()])
            .args(["--endpoint-url", &endpoint_url])
            .args(["--db", &db])
            .args(&args)
            .args(tls_flags.into_iter().flatten())
            .envs(env)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("autopush starts (build it with `cargo build --release`)");
        pids.insert(0, child.id());
        let server = Server {
            pids,
            owned: Some((child, data)),
            counter,
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

    /// Requests to the shared store since the last call, by operation
    /// (`None` on the embedded store and in target mode).
    pub fn take_requests(&self) -> Option<Counts> {
        self.counter.as_ref().map(Counter::take)
    }

    /// Bytes on disk under the data directory of the server started here
    /// on the embedded store (`None` otherwise).
    pub fn data_bytes(&self) -> Option<u64> {
        if self.counter.is_some() {
            return None; // the data is in moto or the emulator
        }
        self.owned.as_ref().map(|(_, data)| disk_usage(data.path()))
    }

    /// CPU time used so far by every server process and its descendants
    /// (user + system), in clock ticks (1/100 s): a database's connection
    /// processes count with the server that forked them.
    pub fn cpu_ticks(&self) -> u64 {
        let parents = parents();
        self.pids
            .iter()
            .map(|&pid| tree_cpu_ticks(pid, &parents))
            .sum()
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

/// Bytes allocated on disk for the files under `dir` (what `du` counts:
/// a sparse or preallocated file by its blocks, not its length).
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => disk_usage(&entry.path()),
            Ok(meta) => meta.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
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
    // utime and stime.
    stat_field(pid, 14).unwrap_or(0) + stat_field(pid, 15).unwrap_or(0)
}

/// Each live process's parent, from `/proc/<pid>/stat`.
fn parents() -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, stat_field(pid, 4)?)))
        .map(|(pid, parent)| (pid, parent as u32))
        .collect()
}

/// CPU time of `pid`, of its children it has waited for, and of its live
/// descendants, in clock ticks.
fn tree_cpu_ticks(pid: u32, parents: &[(u32, u32)]) -> u64 {
    let waited_for = stat_field(pid, 16).unwrap_or(0) + stat_field(pid, 17).unwrap_or(0);
    let live: u64 = parents
        .iter()
        .filter(|&&(_, parent)| parent == pid)
        .map(|&(child, _)| tree_cpu_ticks(child, parents))
        .sum();
    cpu_ticks(pid) + waited_for + live
}

/// Field `n` of `/proc/<pid>/stat` (1-based, as `man proc` numbers them;
/// from the state, field 3, on), if a number.
fn stat_field(pid: u32, n: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the parenthesised command name, which may hold spaces.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after_name
        .split_whitespace()
        .nth(n.checked_sub(3)?)?
        .parse()
        .ok()
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
