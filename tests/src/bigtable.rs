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

use autopush_storage::bigtable::{BigtableSettings, BigtableStore, proto};
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

/// A cell as autopush-rs writes one: its timestamp in milliseconds (as
/// microseconds), the value as given.
pub fn cell(family: &str, qualifier: &str, value: Vec<u8>, stamp_ms: u64) -> proto::Mutation {
    proto::Mutation {
        mutation: Some(proto::mutation::Mutation::SetCell(
            proto::mutation::SetCell {
                family_name: family.into(),
                column_qualifier: qualifier.as_bytes().to_vec(),
                timestamp_micros: (stamp_ms * 1000) as i64,
                value,
            },
        )),
    }
}

/// Write `mutations` to row `key` as they are (none of our row code).
pub async fn write_row(store: &BigtableStore, key: String, mutations: Vec<proto::Mutation>) {
    let settings = store.settings();
    store
        .connection()
        .mutate_row(proto::MutateRowRequest {
            table_name: settings.table_name.clone(),
            app_profile_id: settings.app_profile_id.clone(),
            row_key: key.into_bytes(),
            mutations,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// autopush-rs's GC rule for the message family (`maxage=1s`), applied
/// at `now` (unix seconds) to user `uaid`'s row, where our own cells of
/// the user are: every cell stamped more than a second before `now` goes.
/// The emulator runs no GC of its own.
pub async fn collect_garbage(store: &BigtableStore, uaid: &uuid::Uuid, now: u64) {
    let family = store.settings().families.message.clone();
    let older = proto::TimestampRange {
        start_timestamp_micros: 0,
        end_timestamp_micros: (now.saturating_sub(1) * 1_000_000) as i64,
    };
    let mutations = autopush_storage::bigtable::row::OWN_USER_CELLS
        .iter()
        .map(|q| proto::Mutation {
            mutation: Some(proto::mutation::Mutation::DeleteFromColumn(
                proto::mutation::DeleteFromColumn {
                    family_name: family.clone(),
                    column_qualifier: q.as_bytes().to_vec(),
                    time_range: Some(older),
                },
            )),
        })
        .collect();
    write_row(store, uaid.simple().to_string(), mutations).await;
}

/// A TCP forwarder in front of the emulator that can be cut: while cut, it
/// drops every connection and refuses new ones, as a Bigtable outage looks
/// to a client.
pub struct Outage {
    /// `127.0.0.1:PORT`.
    pub host: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    closed: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Outage {
    pub async fn start(upstream: &str) -> Outage {
        use std::sync::atomic::Ordering::SeqCst;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind forwarder");
        let host = listener.local_addr().expect("forwarder addr").to_string();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (closed, _) = tokio::sync::watch::channel(0u64);
        let (upstream, flag, cuts) = (upstream.to_owned(), cut.clone(), closed.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if flag.load(SeqCst) {
                    continue; // dropped: connection reset
                }
                let upstream = upstream.clone();
                let mut cuts = cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Outage {
            host,
            cut,
            closed,
            task,
        }
    }

    /// Drop every connection and refuse new ones until [`Outage::end`].
    pub fn begin(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        self.closed.send_modify(|n| *n += 1);
    }

    pub fn end(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Outage {
    fn drop(&mut self) {
        self.task.abort();
    }
}
