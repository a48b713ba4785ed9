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
        let mut shell = postgres_shell();
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
        // Once, before the tests: their own `CREATE EXTENSION IF NOT
        // EXISTS` run at the same time would race on creating it.
        psql_at(
            &local.dsn,
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements",
        );
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
    psql_at(&local().await.dsn, sql)
}

/// `sql` run by `psql` at `dsn`: its rows, `|` between columns.
pub fn psql_at(dsn: &str, sql: &str) -> String {
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

/// A cluster of one test's own, for what the shared one cannot do: its own
/// settings (TLS, synchronous replication), a streaming standby, kill -9
/// and promotion. It runs as the shared one does (as the `postgres` user;
/// stopped and removed when the test binary exits) until dropped, when it
/// is stopped at once (SIGQUIT) and removed.
pub struct Cluster {
    pub port: u16,
    /// Owned by `postgres`: `data/`, `log`, the socket, any files added.
    dir: PathBuf,
    running: Option<(Child, ChildStdin)>,
}

/// `sh`, as the `postgres` user when this runs as root (PostgreSQL will
/// not run as root).
fn postgres_shell() -> Command {
    match is_root() {
        true => {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "sh"]);
            c
        }
        false => Command::new("sh"),
    }
}

/// A fresh directory the `postgres` user owns.
fn postgres_dir() -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("autopush-pg-")
        .tempdir()
        .expect("temp dir")
        .keep();
    chown_to_postgres(&dir);
    dir
}

fn chown_to_postgres(path: &std::path::Path) {
    if is_root() {
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .expect("run chown");
        assert!(chown.success(), "chown {} failed", path.display());
    }
}

/// Run `c`, panicking with its stderr if it fails.
fn run(what: &str, c: &mut Command) {
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e} (install postgresql-15)"));
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Cluster {
    /// A new cluster (`initdb`), not started yet.
    pub fn init() -> Cluster {
        let dir = postgres_dir();
        let data = dir.join("data");
        let data = data.to_str().expect("utf-8 temp path");
        run(
            "initdb",
            &mut command(
                "initdb",
                &["-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8"],
            ),
        );
        let [port] = free_ports::<1>();
        Cluster {
            port,
            dir,
            running: None,
        }
    }

    /// A standby of `primary` (running), copied by `pg_basebackup -R`: once
    /// started it streams from the primary; not started yet.
    pub fn standby_of(primary: &Cluster) -> Cluster {
        let dir = postgres_dir();
        let data = dir.join("data");
        let port = primary.port.to_string();
        run(
            "pg_basebackup",
            &mut command(
                "pg_basebackup",
                &[
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port,
                    "-U",
                    "postgres",
                    "-D",
                    data.to_str().expect("utf-8 temp path"),
                    "-R",
                    "-X",
                    "stream",
                ],
            ),
        );
        let [port] = free_ports::<1>();
        Cluster {
            port,
            dir,
            running: None,
        }
    }

    /// Put `contents` in the cluster's directory as `name`, readable by
    /// `postgres` only (as a server key must be); its path.
    pub fn add_file(&self, name: &str, contents: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(name);
        std::fs::write(&path, contents).expect("write a cluster file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .expect("chmod a cluster file");
        chown_to_postgres(&path);
        path
    }

    /// Start the server with `options` (`name=value`, each given as `-c`),
    /// and wait until it answers queries.
    pub async fn start(&mut self, options: &[&str]) {
        let script = r#"pg=$0 dir=$1 port=$2; shift 2
            "$pg" -D "$dir/data" -p "$port" -k "$dir" -c listen_addresses=127.0.0.1 "$@" \
                >>"$dir/log" 2>&1 & pid=$!
            cat >/dev/null; kill -QUIT $pid 2>/dev/null; wait $pid; rm -rf "$dir""#;
        let postgres = bin_dir().join("postgres");
        let port = self.port.to_string();
        let mut args = vec![
            "-c".to_owned(),
            script.to_owned(),
            postgres.to_str().expect("utf-8 path").to_owned(),
            self.dir.to_str().expect("utf-8 temp path").to_owned(),
            port,
        ];
        for option in options {
            args.extend(["-c".to_owned(), (*option).to_owned()]);
        }
        let mut shell = postgres_shell();
        let mut child = shell
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sh for postgres");
        let stdin = child.stdin.take().expect("postgres stdin");
        self.running = Some((child, stdin));
        let started = Instant::now();
        while let Err(e) = self.try_psql("SELECT 1") {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "postgres on port {} did not answer within 120 s: {e}\n{}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn dsn(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.host())
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// SIGKILL to the postmaster, as a crash or the OOM killer does.
    pub fn kill9(&self) {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
            .expect("postmaster.pid of a running cluster");
        let pid = pid.lines().next().unwrap_or_default().trim().to_owned();
        run("kill -9", Command::new("kill").args(["-9", &pid]));
    }

    /// `pg_ctl promote`: the standby takes writes (waits until it does).
    pub fn promote(&self) {
        let data = self.dir.join("data");
        run(
            "pg_ctl promote",
            &mut command(
                "pg_ctl",
                &["promote", "-w", "-D", data.to_str().expect("utf-8 path")],
            ),
        );
    }

    /// `sql` run by `psql` on this cluster: its rows, `|` between columns.
    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|e| panic!("psql failed: {e}"))
    }

    fn try_psql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(bin_dir().join("psql"))
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                &self.dsn(),
                "-c",
                sql,
            ])
            .output()
            .map_err(|e| format!("run psql: {e}"))?;
        match out.status.success() {
            true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
            false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Closing its stdin stops the server and removes the directory.
        match self.running.take() {
            Some((mut child, stdin)) => {
                drop(stdin);
                let _ = child.wait();
            }
            None => {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }
}

/// The tables of `schema` made on the cluster at `dsn`.
pub async fn create_tables_on(dsn: &str, schema: &str) {
    let settings =
        PostgresSettings::parse(dsn, Some(&db_settings(schema))).expect("postgres settings");
    let store = PostgresStore::connect(settings).expect("postgres settings");
    store.create_tables().await.expect("create the tables");
}

/// A fresh schema with its tables made on the cluster at `dsn`.
pub async fn fresh_schema_on(dsn: &str) -> String {
    let schema = schema_name();
    create_tables_on(dsn, &schema).await;
    schema
}

/// autopush-rs's `schema.psql`, when `AUTOPUSH_RS_SCHEMA` names it (the
/// operator's own checkout: its schema is not kept here).
pub fn autopush_rs_schema_file() -> Option<PathBuf> {
    std::env::var_os("AUTOPUSH_RS_SCHEMA").map(PathBuf::from)
}

/// A fresh schema holding tables as autopush-rs makes them, then given our
/// columns by `create-tables`, as an operator coming from autopush-rs
/// does: made by its `schema.psql` when [`autopush_rs_schema_file`] names
/// it, else ours with the foreign keys that file gives `meta` and
/// `message` (each row's `uaid` references `router`, once with `ON DELETE
/// CASCADE` and once without).
pub async fn fresh_autopush_rs_settings() -> PostgresSettings {
    let schema = schema_name();
    let settings = local().await.settings(&schema);
    let store = PostgresStore::connect(settings.clone()).expect("postgres settings");
    match autopush_rs_schema_file() {
        Some(file) => {
            // Its first statements drop tables that are not there yet:
            // errors are expected until its CREATEs.
            let out = Command::new(bin_dir().join("psql"))
                .args(["-X", "-q", &local().await.dsn])
                .args(["-c", &format!("CREATE SCHEMA {schema}")])
                .env("PGOPTIONS", format!("-c search_path={schema}"))
                .arg("-f")
                .arg(&file)
                .output()
                .expect("run psql");
            assert!(out.status.success(), "psql -f {}", file.display());
            let tables = psql(&format!(
                "SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}'"
            ))
            .await;
            assert_eq!(tables.trim(), "4", "{} made no tables", file.display());
        }
        None => {
            store.create_tables().await.expect("create the tables");
            let (r, c, m) = (
                settings.qualified(&settings.router_table),
                settings.qualified(&settings.meta_table),
                settings.qualified(&settings.message_table),
            );
            psql(&format!(
                "ALTER TABLE {c} ADD FOREIGN KEY (uaid) REFERENCES {r} ON DELETE CASCADE, \
                 ADD FOREIGN KEY (uaid) REFERENCES {r} (uaid); \
                 ALTER TABLE {m} ADD FOREIGN KEY (uaid) REFERENCES {r} ON DELETE CASCADE, \
                 ADD FOREIGN KEY (uaid) REFERENCES {r} (uaid)"
            ))
            .await;
        }
    }
    store
        .create_tables()
        .await
        .expect("create-tables on autopush-rs's tables");
    settings
}

/// A store on [`fresh_autopush_rs_settings`].
pub async fn fresh_autopush_rs_store() -> PostgresStore {
    PostgresStore::connect(fresh_autopush_rs_settings().await).expect("postgres settings")
}
