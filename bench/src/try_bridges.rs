//! `autopush-bench try-bridges`: a stand-in for Google (OAuth and FCM HTTP v1)
//! on loopback, and the files that point `autopush` at it, so that the FCM
//! bridge, the mailbox and receipts can be tried with no credentials
//! (docs/try-bridges.md). It prints each message FCM receives until Ctrl-C.
//!
//! Apple has no such stand-in for the binary: a2, the APNs client, connects
//! only to Apple's two hosts.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use autopush_tests::google::Google;

/// The FCM app the settings name (`/v1/fcm/try/registration`).
pub const APP: &str = "try";
/// The Firebase project the stand-in is asked for.
pub const PROJECT: &str = "try-bridges";

/// Serve until Ctrl-C; `Err` when the stand-in or its files cannot be made.
pub async fn run(dir: &Path, port: u16) -> Result<(), String> {
    let google = Google::start_on(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{port} (try --port 0): {e}"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let key = google.write_service_account(&dir, "service-account.json");
    let data = dir.join("data");
    let settings = dir.join("autopush.toml");
    let toml = format!(
        "# autopush with the FCM app \"{APP}\" delivering to the Google stand-in\n\
         # of `autopush-bench try-bridges`, and a store of its own.\n\
         db = {data}\n\n\
         [fcm.apps.{APP}]\n\
         project_id = \"{PROJECT}\"\n\
         credential = {key_path}\n\
         base_url = \"{base}\"\n",
        data = toml_string(&data),
        key_path = toml_string(&key),
        base = google.base_url(),
    );
    std::fs::write(&settings, toml)
        .map_err(|e| format!("cannot write {}: {e}", settings.display()))?;
    println!(
        "Google stand-in (OAuth token endpoint and FCM HTTP v1) on {base}\n\
         \x20 service account: {key} (token_uri {base}/token)\n\
         \x20 settings:        {settings}\n\
         \x20 counters:        curl {base}/stats\n\
         \n\
         Start autopush with the FCM app \"{APP}\" (in another terminal, from the repository):\n\
         \n\
         \x20 cargo run --release -- --config {settings}\n\
         \n\
         Apple: not available. The APNs bridge sends through a2, which connects only to\n\
         api.push.apple.com and api.development.push.apple.com.\n\
         \n\
         Each message FCM receives is printed below; Ctrl-C stops.",
        base = google.base_url(),
        key = key.display(),
        settings = settings.display(),
    );
    let _ = std::io::stdout().flush();
    let mut shown = 0;
    let mut every = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = every.tick() => {}
        }
        let received = google.received();
        for message in received.iter().skip(shown) {
            println!(
                "FCM received: project {} token {} data {}",
                message.project,
                message.token(),
                message.data()
            );
        }
        shown = received.len();
        let _ = std::io::stdout().flush();
    }
}

/// A path as a TOML string (JSON's escapes are TOML's).
fn toml_string(path: &Path) -> String {
    serde_json::Value::from(path.to_string_lossy()).to_string()
}
