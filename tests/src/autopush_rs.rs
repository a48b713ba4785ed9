//! Mozilla's autopush-rs beside this service on one database, for the
//! interop scenarios (`tests/tests/autopush_rs.rs`, run by
//! `scripts/interop-autopush-rs`): a Bigtable table on the shared emulator
//! ([`crate::bigtable`]), or with `AUTOPUSH_RS_DB=postgres` a schema on the
//! private PostgreSQL cluster ([`crate::postgres`]), its tables made by
//! `autopush db create-tables`, or by autopush-rs's own `schema.psql` when
//! `AUTOPUSH_RS_SCHEMA` names it.
//!
//! autopush-rs is not built here: `AUTOPUSH_RS_BIN_DIR` names a directory
//! holding `autoconnect` and `autoendpoint` that the operator built from
//! their own checkout, with the backend under test. Both run on loopback
//! names (autoconnect binds its two ports on 0.0.0.0: it has no setting for
//! that).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use autopush_storage::Storage;

use crate::server::{free_ports, run_autopush};
use crate::{Node, Server, bigtable, postgres};

/// The directory of the operator's autopush-rs binaries.
pub fn bin_dir() -> PathBuf {
    let dir = std::env::var_os("AUTOPUSH_RS_BIN_DIR")
        .map(PathBuf::from)
        .expect("AUTOPUSH_RS_BIN_DIR: the directory of autopush-rs's autoconnect and autoendpoint");
    for binary in ["autoconnect", "autoendpoint"] {
        assert!(
            dir.join(binary).is_file(),
            "no {binary} in {}",
            dir.display()
        );
    }
    dir
}

/// The database both services share.
#[derive(Clone)]
pub enum Db {
    /// `projects/test/instances/test/tables/...`, created.
    Bigtable(String),
    /// A schema on the private cluster, its tables made.
    Postgres(String),
}

/// What both services share: the database and the keys.
#[derive(Clone)]
pub struct Shared {
    pub db: Db,
    /// The Fernet key of endpoint URLs.
    pub crypto_key: String,
    /// The key of `/v1` secrets (and, on our side, node-to-node calls).
    pub auth_key: String,
}

impl Shared {
    /// A fresh database of the backend `AUTOPUSH_RS_DB` names
    /// (`bigtable`, the default, or `postgres`) and fresh keys.
    pub async fn new() -> Shared {
        let db = match std::env::var("AUTOPUSH_RS_DB").as_deref() {
            Ok("postgres") => {
                let settings = match postgres::autopush_rs_schema_file() {
                    Some(_) => postgres::fresh_autopush_rs_settings().await,
                    None => postgres::fresh_settings().await,
                };
                Db::Postgres(settings.schema.expect("a schema"))
            }
            Ok("bigtable") | Err(_) => {
                let store = bigtable::fresh_store().await;
                Db::Bigtable(store.settings().table_name.clone())
            }
            Ok(other) => panic!("AUTOPUSH_RS_DB={other}: bigtable or postgres"),
        };
        let keygen = async || {
            let out = run_autopush(&["keygen"]).await;
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        Shared {
            db,
            crypto_key: keygen().await,
            auth_key: keygen().await,
        }
    }

    /// The `--db` DSN both sides are given.
    pub async fn dsn(&self) -> String {
        match &self.db {
            Db::Bigtable(_) => bigtable::local().await.dsn(),
            Db::Postgres(_) => postgres::local().await.dsn.clone(),
        }
    }

    /// The `db_settings` JSON both sides are given.
    pub fn db_settings(&self) -> String {
        match &self.db {
            Db::Bigtable(table) => bigtable::db_settings(table),
            Db::Postgres(schema) => serde_json::json!({ "schema": schema }).to_string(),
        }
    }

    /// A store of ours on the database, to look at rows.
    pub async fn store(&self) -> Box<dyn Storage> {
        match &self.db {
            Db::Bigtable(table) => Box::new(
                autopush_storage::bigtable::BigtableStore::connect(
                    bigtable::local().await.settings(table),
                )
                .await
                .expect("connect to the Bigtable emulator"),
            ),
            Db::Postgres(schema) => Box::new(
                autopush_storage::postgres::PostgresStore::connect(
                    postgres::local().await.settings(schema),
                )
                .expect("postgres settings"),
            ),
        }
    }

    /// One of our nodes of `role` on the database, its endpoint URLs on
    /// `endpoint_url` (`None`: its own endpoint port), with `args`.
    pub async fn ours(
        &self,
        role: &'static str,
        endpoint_url: Option<&str>,
        args: &[&str],
    ) -> Server {
        let mut all = vec![
            format!("--db-settings={}", self.db_settings()),
            format!("--crypto-key={}", self.crypto_key),
            format!("--auth-key={}", self.auth_key),
            format!("--router-key={}", self.auth_key),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        Server::start_node(Node {
            role,
            db: Some(self.dsn().await),
            endpoint_url: endpoint_url.map(str::to_owned),
            args: all,
            ..Node::default()
        })
        .await
    }
}

/// One autopush-rs process; killed when dropped.
pub struct Process {
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Process {
    /// What it logged so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn spawn(binary: &str, env: Vec<(String, String)>) -> Process {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join(format!("{binary}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let err = file.try_clone().expect("log file");
        let child = Command::new(bin_dir().join(binary))
            .envs(env)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary}: {e}"));
        Process {
            child,
            log,
            _dir: dir,
        }
    }

    /// Wait until `port` on loopback takes connections.
    async fn listening(&mut self, port: u16) {
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("autopush-rs exited ({status}):\n{}", self.log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "autopush-rs not listening on {port}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment both autopush-rs services read the database from.
async fn db_env(prefix: &str, shared: &Shared) -> Vec<(String, String)> {
    let mut env = vec![
        (format!("{prefix}DB_DSN"), shared.dsn().await),
        (format!("{prefix}DB_SETTINGS"), shared.db_settings()),
        (format!("{prefix}HUMAN_LOGS"), "true".into()),
        (format!("{prefix}DISABLE_SENTRY"), "true".into()),
        ("RUST_LOG".into(), "warn".into()),
    ];
    if let Db::Bigtable(_) = shared.db {
        // Plain HTTP/2, no credentials.
        let host = bigtable::local().await.host.clone();
        env.push(("BIGTABLE_EMULATOR_HOST".into(), host));
    }
    env
}

/// autopush-rs's connection node.
pub struct AutoConnect {
    pub process: Process,
    pub port: u16,
    pub router_port: u16,
}

impl AutoConnect {
    /// Its endpoint URLs on `endpoint` (`http://127.0.0.1:PORT`).
    pub async fn start(shared: &Shared, endpoint: &str) -> AutoConnect {
        let [port, router_port] = free_ports::<2>();
        let endpoint_port = endpoint.rsplit(':').next().unwrap_or_default();
        let mut env = db_env("AUTOCONNECT__", shared).await;
        env.extend(
            [
                ("PORT", port.to_string()),
                ("ROUTER_PORT", router_port.to_string()),
                ("HOSTNAME", "127.0.0.1".into()),
                ("ROUTER_HOSTNAME", "127.0.0.1".into()),
                ("ENDPOINT_SCHEME", "http".into()),
                ("ENDPOINT_HOSTNAME", "127.0.0.1".into()),
                ("ENDPOINT_PORT", endpoint_port.into()),
                ("CRYPTO_KEY", format!("[{}]", shared.crypto_key)),
            ]
            .map(|(k, v)| (format!("AUTOCONNECT__{k}"), v)),
        );
        let mut process = Process::spawn("autoconnect", env);
        process.listening(port).await;
        process.listening(router_port).await;
        AutoConnect {
            process,
            port,
            router_port,
        }
    }

    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/", self.port)
    }

    /// Its node id, as it writes it in the user row.
    pub fn node_id(&self) -> String {
        format!("http://127.0.0.1:{}", self.router_port)
    }
}

/// autopush-rs's endpoint node.
pub struct AutoEndpoint {
    pub process: Process,
    pub port: u16,
}

impl AutoEndpoint {
    /// On `port`, naming `endpoint_url` as its own (the VAPID audience).
    pub async fn start(shared: &Shared, port: u16, endpoint_url: &str) -> AutoEndpoint {
        let mut env = db_env("AUTOEND__", shared).await;
        env.extend(
            [
                ("HOST", "127.0.0.1".to_owned()),
                ("PORT", port.to_string()),
                ("ENDPOINT_URL", endpoint_url.to_owned()),
                ("CRYPTO_KEYS", format!("[{}]", shared.crypto_key)),
                ("AUTH_KEYS", format!("[{}]", shared.auth_key)),
            ]
            .map(|(k, v)| (format!("AUTOEND__{k}"), v)),
        );
        let mut process = Process::spawn("autoendpoint", env);
        process.listening(port).await;
        AutoEndpoint { process, port }
    }

    /// On a free port, its endpoint URLs its own.
    pub async fn start_own(shared: &Shared) -> AutoEndpoint {
        let [port] = free_ports::<1>();
        AutoEndpoint::start(shared, port, &format!("http://127.0.0.1:{port}")).await
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// A load balancer's stand-in: the endpoint URLs' host, forwarding each
/// new connection to whichever endpoint node serves now.
pub struct Front {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    upstream: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Front {
    pub async fn start() -> Front {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the front");
        let base = format!("http://{}", listener.local_addr().expect("front addr"));
        let upstream = Arc::new(Mutex::new(String::new()));
        let to = upstream.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = to.lock().map(|t| t.clone()).unwrap_or_default();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Front {
            base,
            upstream,
            task,
        }
    }

    /// New connections go to `base` (`http://HOST:PORT`).
    pub fn to(&self, base: &str) {
        let target = base.trim_start_matches("http://").to_owned();
        if let Ok(mut upstream) = self.upstream.lock() {
            *upstream = target;
        }
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `endpoint` (a push URL) on another endpoint node's `base`.
pub fn via(endpoint: &str, base: &str) -> String {
    let path = endpoint
        .splitn(4, '/')
        .nth(3)
        .expect("a push URL has a path");
    format!("{base}/{path}")
}
