//! Google's Bigtable emulator for the Bigtable tests: `cbtemulator`
//! (Debian package google-cloud-cli-bigtable-emulator), started on a free
//! loopback port once per test binary. It is not Google Cloud: it answers
//! the same data and admin APIs, filters and conditional mutations, in
//! memory.
//!
//! Each test gets its own table ([`table_name`]), so tests share the
//! emulator without seeing each other's rows.

use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use autopush_storage::bigtable::{BigtableSettings, BigtableStore};
use tokio::sync::OnceCell;

use crate::server::free_ports;

/// Where Debian's package puts the emulator (it is not on `PATH`).
const DEBIAN_EMULATOR: &str = "/usr/lib/google-cloud-sdk/platform/bigtable-emulator/cbtemulator";

pub struct LocalBigtable {
    /// `127.0.0.1:PORT`, as `BIGTABLE_EMULATOR_HOST` names it.
    pub host: String,
    _child: Child,
    _stdin: ChildStdin,
}

static SHARED: OnceCell<LocalBigtable> = OnceCell::const_new();

/// The emulator this test binary shares, started on first use.
pub async fn local() -> &'static LocalBigtable {
    SHARED.get_or_init(LocalBigtable::start).await
}

/// The emulator binary: `AUTOPUSH_TEST_CBTEMULATOR`, else `cbtemulator` on
/// `PATH`, else Debian's place for it.
pub fn emulator() -> PathBuf {
    if let Some(path) = std::env::var_os("AUTOPUSH_TEST_CBTEMULATOR") {
        return PathBuf::from(path);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("cbtemulator"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(DEBIAN_EMULATOR))
}

impl LocalBigtable {
    async fn start() -> LocalBigtable {
        let [port] = free_ports::<1>();
        let binary = emulator();
        // The shell ends the emulator when its stdin closes, i.e. when the
        // test binary that started it exits, however it exits.
        let script = r#""$0" -host 127.0.0.1 -port "$1" & pid=$!; cat >/dev/null; kill $pid"#;
        let mut child = Command::new("sh")
            .args(["-c", script])
            .arg(&binary)
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sh for the Bigtable emulator");
        let stdin = child.stdin.take().expect("emulator stdin");
        let host = format!("127.0.0.1:{port}");
        let started = Instant::now();
        while tokio::net::TcpStream::connect(&host).await.is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the Bigtable emulator {} exited ({status}): install google-cloud-cli-bigtable-emulator",
                    binary.display()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the Bigtable emulator {} did not listen on {host} within 60 s \
                 (install google-cloud-cli-bigtable-emulator)",
                binary.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        LocalBigtable {
            host,
            _child: child,
            _stdin: stdin,
        }
    }

    /// The settings of a store on table `table_name` of this emulator.
    pub fn settings(&self, table_name: &str) -> BigtableSettings {
        let db_settings = serde_json::json!({ "table_name": table_name }).to_string();
        BigtableSettings::parse(&self.dsn(), Some(&db_settings), None).expect("emulator settings")
    }

    /// `grpc://127.0.0.1:PORT`, the DSN of `--db`.
    pub fn dsn(&self) -> String {
        format!("grpc://{}", self.host)
    }
}

/// A fresh table name for one test.
pub fn table_name() -> String {
    format!(
        "projects/test/instances/test/tables/t_{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// The `db_settings` JSON naming `table_name`.
pub fn db_settings(table_name: &str) -> String {
    serde_json::json!({ "table_name": table_name }).to_string()
}

/// A store on the shared emulator with a fresh, created table.
pub async fn fresh_store() -> BigtableStore {
    let store = BigtableStore::connect(local().await.settings(&table_name()))
        .await
        .expect("connect to the Bigtable emulator");
    store.create_tables().await.expect("create the table");
    store
}
