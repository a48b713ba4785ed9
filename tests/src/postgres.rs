//! A private PostgreSQL 15 cluster for the PostgreSQL tests: `initdb` in
//! a temporary directory and `postgres` on a free loopback port, once per
//! test binary (Debian's package postgresql-15; as root, both run as the
//! `postgres` user, which PostgreSQL requires). The cluster and its
//! directory go when the test binary exits, however it exits.
//!
//! Each test gets its own schema ([`fresh_settings`]), so tests share the
//! cluster without seeing each other's rows. `pg_stat_statements` is
//! loaded, for tests that count statements. `AUTOPUSH_TEST_PG_DSN` names a
//! running cluster to use instead (one a benchmark measures).

use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use autopush_storage::postgres::{PostgresSettings, PostgresStore};
use tokio::sync::OnceCell;

use crate::server::free_ports;

/// Where Debian's postgresql-15 puts its programs (not on `PATH`).
const DEBIAN_BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct LocalPostgres {
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub dsn: String,
    /// The server started here (none when `AUTOPUSH_TEST_PG_DSN` names one).
    _started: Option<(Child, ChildStdin)>,
}

static SHARED: OnceCell<LocalPostgres> = OnceCell::const_new();

/// The cluster this test binary shares, started on first use.
pub async fn local() -> &'static LocalPostgres {
    SHARED
        .get_or_init(|| async {
            match std::env::var("AUTOPUSH_TEST_PG_DSN") {
                Ok(dsn) => LocalPostgres {
                    dsn,
                    _started: None,
                },
                Err(_) => LocalPostgres::start().await,
            }
        })
        .await
}

/// PostgreSQL's programs: `AUTOPUSH_TEST_PG_BIN`, else Debian's place.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("AUTOPUSH_TEST_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEBIAN_BIN))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// `program` with `args`, as the `postgres` user when we are root.
fn command(program: &str, args: &[&str]) -> Command {
    let program = bin_dir().join(program);
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program).args(args);
        c
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    }
}

impl LocalPostgres {
    async fn start() -> LocalPostgres {
        let dir = tempfile::Builder::new()
            .prefix("autopush-pg-")
            .tempdir()
            .expect("temp dir")
            .keep();
        if is_root() {
            let chown = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("run chown");
            assert!(
                chown.success(),
                "chown {} to postgres failed",
                dir.display()
            );
        }
        let data = dir.join("data");
        let data = data.to_str().expect("utf-8 temp path");
        let init = command(
            "initdb",
            &[
                "-D",
                data,
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "run {}/initdb: {e} (install postgresql-15)",
                bin_dir().display()
            )
        });
        assert!(
            init.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let [port] = free_ports::<1>();
        let port = port.to_string();
        let socket_dir = dir.to_str().expect("utf-8 temp path");
        // The shell ends the server when its stdin closes, i.e. when the
        // test binary that started it exits, and removes its directory.
        // Durability is off: the cluster lives as long as the test run.
        let script = r#""$0" -D "$1/data" -p "$2" -k "$1" -c listen_addresses=127.0.0.1 \
            -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
            -c max_connections=300 -c shared_preload_libraries=pg_stat_statements \
            >"$1/log" 2>&1 & pid=$!
            cat >/dev/null; kill $pid; wait $pid; rm -rf "$1""#;
        let postgres = bin_dir().join("postgres");
        let postgres = postgres.to_str().expect("utf-8 path");
        let mut shell = match is_root() {
            true => {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--", "sh"]);
                c
            }
            false => Command::new("sh"),
        };
        let mut child = shell
            .args(["-c", script, postgres, socket_dir, &port])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sh for postgres");
        let stdin = child.stdin.take().expect("postgres stdin");
        let host = format!("127.0.0.1:{port}");
        let started = Instant::now();
        while tokio::net::TcpStream::connect(&host).await.is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
                panic!("postgres exited ({status}): {log}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "postgres did not listen on {host} within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let local = LocalPostgres {
            dsn: format!("postgres://postgres@{host}/postgres"),
            _started: Some((child, stdin)),
        };
        // Listening is not ready yet ("the database system is starting up").
        let probe = PostgresStore::connect(local.settings(&schema_name())).expect("settings");
        loop {
            match probe.create_tables().await {
                Ok(_) => break,
                Err(e) => assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "postgres did not answer within 60 s: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        local
    }

    /// The settings of a store whose tables are in `schema`.
    pub fn settings(&self, schema: &str) -> PostgresSettings {
        PostgresSettings::parse(&self.dsn, Some(&db_settings(schema))).expect("postgres settings")
    }
}

/// `sql` run by `psql` on the shared cluster: its rows, `|` between
/// columns.
pub async fn psql(sql: &str) -> String {
    let dsn = &local().await.dsn;
    let out = Command::new(bin_dir().join("psql"))
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", dsn, "-c", sql])
        .output()
        .expect("run psql");
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh schema name for one test.
pub fn schema_name() -> String {
    format!("t_{}", uuid::Uuid::new_v4().simple())
}

/// The `db_settings` JSON naming `schema`, with a pool small enough for
/// many tests at once.
pub fn db_settings(schema: &str) -> String {
    serde_json::json!({ "schema": schema, "pool_size": 4 }).to_string()
}

/// The settings of a fresh schema on the shared cluster, its tables made.
pub async fn fresh_settings() -> PostgresSettings {
    let settings = local().await.settings(&schema_name());
    let store = PostgresStore::connect(settings.clone()).expect("postgres settings");
    store.create_tables().await.expect("create the tables");
    settings
}

/// A store on a fresh schema of the shared cluster.
pub async fn fresh_store() -> PostgresStore {
    let store =
        PostgresStore::connect(local().await.settings(&schema_name())).expect("postgres settings");
    store.create_tables().await.expect("create the tables");
    store
}
