//! A data directory that belongs to the service's user (as the packaged
//! unit's `DynamicUser=` leaves `/var/lib/private/autopush`), maintained by
//! root: what `autopush db` writes there stays the service's and readable by
//! it only, a root that cannot give it away refuses before writing, and every
//! store file the service cannot open is named. The service runs as `nobody`
//! here. These tests need root (CI runs them as root); as another user they
//! say so and pass.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use autopush_tests::http::post_push;
use autopush_tests::server::{autopush_bin, autopush_command, free_ports, run_autopush};
use autopush_tests::*;

/// `nobody`, standing in for the unit's dynamic user.
const SERVICE_USER: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: making a directory owned by another user needs root");
    }
    root
}

/// A data directory owned by the service's user, mode 0700 (as systemd
/// makes a `StateDirectory=`), under a scratch directory it can reach.
fn service_data_dir() -> (tempfile::TempDir, PathBuf) {
    let scratch = tempfile::tempdir().expect("create a scratch directory");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let db = scratch.path().join("db");
    std::fs::create_dir(&db).unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&db, Some(SERVICE_USER), Some(SERVICE_USER)).unwrap();
    (scratch, db)
}

/// `autopush` on `db`, run as the service's user.
struct Service {
    child: Child,
    ws_url: String,
    endpoint_base: String,
    stderr: PathBuf,
}

impl Service {
    /// Started as the service's user, and up; `Err` with its standard
    /// error if it exits first.
    async fn start(db: &Path) -> Result<Service, String> {
        let [ws, router, endpoint] = free_ports::<3>();
        let stderr = db.with_extension(format!("{ws}.stderr"));
        let log = std::fs::File::create(&stderr).unwrap();
        let mut command = autopush_command();
        // SAFETY: umask is async-signal-safe and cannot fail.
        unsafe {
            command.pre_exec(|| {
                libc::umask(0o077); // the unit's UMask=
                Ok(())
            })
        };
        let mut child = command
            .uid(SERVICE_USER)
            .gid(SERVICE_USER)
            .args(["--host", "127.0.0.1", "--db"])
            .arg(db)
            .args(["--port", &ws.to_string()])
            .args(["--router-port", &router.to_string()])
            .args(["--endpoint-port", &endpoint.to_string()])
            .args(["--endpoint-url", &format!("http://127.0.0.1:{endpoint}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", autopush_bin().display()));
        let service = |child| Service {
            child,
            ws_url: format!("ws://127.0.0.1:{ws}/"),
            endpoint_base: format!("http://127.0.0.1:{endpoint}"),
            stderr: stderr.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&stderr).unwrap_or_default();
                return Err(format!("exited ({status}):\n{log}"));
            }
            let health = format!("http://127.0.0.1:{endpoint}/health");
            let up = autopush_common::http_client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(2))
                .build()
                .expect("reqwest client")
                .get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if up {
                return Ok(service(child));
            }
            assert!(
                Instant::now() < deadline,
                "the service did not come up within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// Files under `dir` that are not the service user's alone: another owner,
/// or readable or writable by group or others.
fn not_the_services(dir: &Path) -> Vec<String> {
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = std::fs::symlink_metadata(entry.path()).unwrap();
        if meta.uid() != SERVICE_USER || meta.gid() != SERVICE_USER || meta.mode() & 0o077 != 0 {
            wrong.push(format!(
                "{}: owner {}:{}, mode {:o}",
                entry.file_name().to_string_lossy(),
                meta.uid(),
                meta.gid(),
                meta.mode() & 0o7777
            ));
        }
    }
    wrong
}

/// The service, run as its user, holds `n` pushes in its direct journal
/// for a client that does not ack them, and is killed. Returns the uaid.
async fn journal_left_by_the_service(db: &Path, n: usize) -> String {
    let service = Service::start(db).await.unwrap();
    let mut ws = WsClient::connect_hello(&service.ws_url, None).await;
    let uaid = ws.uaid().to_owned();
    let reply = ws.register(&new_channel_id(), None).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("an endpoint")
        .to_owned();
    assert!(endpoint.starts_with(&service.endpoint_base), "{endpoint}");
    for _ in 0..n {
        post_push(&endpoint, &[("TTL", "3600")], None)
            .await
            .assert_created();
    }
    service.kill9();
    uaid
}

/// The recovery of docs/operations.md as root on the service's directory:
/// the journal moved aside, `db replay-journal`, and the service started
/// again as its user, which gets what the journal held.
#[tokio::test]
async fn replay_journal_as_root_leaves_the_files_to_the_services_user() {
    if !is_root() {
        return;
    }
    let (_scratch, db) = service_data_dir();
    let uaid = journal_left_by_the_service(&db, 3).await;
    let aside = db.join("direct.journal.unreadable");
    std::fs::rename(db.join("direct.journal"), &aside).unwrap();

    let out = run_autopush(&[
        "db",
        "replay-journal",
        &aside.display().to_string(),
        "--db",
        &db.display().to_string(),
    ])
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("moved 3 record(s)"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wrong = not_the_services(&db);
    assert!(
        wrong.is_empty(),
        "after `db replay-journal` as root, files the service does not own alone:\n{}",
        wrong.join("\n")
    );

    let service = Service::start(&db)
        .await
        .unwrap_or_else(|e| panic!("the service does not start after the recovery: {e}"));
    let mut ws = WsClient::connect_hello(&service.ws_url, Some(&uaid)).await;
    assert_eq!(ws.uaid(), uaid);
    let got = ws.recv_notifications(3).await;
    assert_eq!(got.len(), 3);
}

/// Root that cannot give files away (no CAP_CHOWN) refuses before it writes
/// anything, naming the command that runs it as the service's user.
#[tokio::test]
async fn root_that_cannot_chown_refuses_and_names_systemd_run() {
    if !is_root() {
        return;
    }
    let (_scratch, db) = service_data_dir();
    journal_left_by_the_service(&db, 1).await;
    let aside = db.join("direct.journal.unreadable");
    std::fs::rename(db.join("direct.journal"), &aside).unwrap();
    let before = std::fs::read_dir(&db).unwrap().count();

    let mut command = tokio::process::Command::new("setpriv");
    command
        .args(["--bounding-set=-chown", "--inh-caps=-chown"])
        .arg(autopush_bin())
        .args(["db", "replay-journal"])
        .arg(&aside)
        .arg("--db")
        .arg(&db)
        .env("NO_COLOR", "1")
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("autopush db replay-journal did not finish within 60 s")
        .expect("run setpriv (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("systemd-run -p DynamicUser=yes -p StateDirectory=autopush")
            && stderr.contains(&db.display().to_string()),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(&db).unwrap().count(),
        before,
        "it wrote in {} before refusing",
        db.display()
    );
}

/// A store file the service's user cannot open stops the start with an
/// error that names it.
#[tokio::test]
async fn a_store_file_the_service_cannot_open_is_named() {
    if !is_root() {
        return;
    }
    for file in ["direct.journal", "autopush.redb"] {
        let (_scratch, db) = service_data_dir();
        journal_left_by_the_service(&db, 1).await;
        let path = db.join(file);
        std::os::unix::fs::chown(&path, Some(0), Some(0)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let Err(stderr) = Service::start(&db).await else {
            panic!("the service started without reading {file}");
        };
        assert!(
            stderr.contains(&path.display().to_string()) && stderr.contains("Permission denied"),
            "{file} unreadable, and the error does not name it:\n{stderr}"
        );
    }
}
