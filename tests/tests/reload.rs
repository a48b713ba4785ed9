//! Bridge credentials without restarts: the real binary re-reads its
//! settings file's `[fcm.apps.*]` tables on SIGHUP (what `systemctl reload`
//! sends), against the local stand-in for Google. Apps added, changed,
//! removed and broken by the operator, while clients stay connected.

use std::path::{Path, PathBuf};
use std::time::Duration;

use autopush_tests::google::Google;
use autopush_tests::http::{self, HttpReply};
use autopush_tests::prometheus::Scrape;
use autopush_tests::py::{self, Keys, SendOptions, SendResult};
use autopush_tests::subscription::Subscription;
use autopush_tests::ws::WsClient;
use autopush_tests::{HANG_GUARD, Server};
use reqwest::Method;
use serde_json::json;
use tempfile::TempDir;

/// The Firebase project of the app configured at start.
const PROJECT: &str = "autopush-test";

/// Google's stand-in, a settings file the test rewrites, and the server
/// reading it.
struct Reloading {
    google: Google,
    server: Server,
    keys: Keys,
    config: PathBuf,
    key_file: PathBuf,
    _dir: TempDir,
}

/// One `[fcm.apps.NAME]` table on `project`, with `extra` lines.
fn app(name: &str, project: &str, google: &Google, key_file: &Path, extra: &str) -> String {
    format!(
        "[fcm.apps.{name}]\nproject_id = \"{project}\"\ncredential = \"{}\"\n\
         base_url = \"{}\"\ntimeout = 3\n{extra}\n",
        key_file.display(),
        google.base_url()
    )
}

impl Reloading {
    /// The server with FCM app `app1` on [`PROJECT`] in its settings file,
    /// and GCM sender id `1234` given by `--gcm-credentials`.
    async fn start() -> Reloading {
        let google = Google::start().await;
        let dir = tempfile::tempdir().expect("temp dir");
        let key_file = google.write_service_account(dir.path(), "service-account.json");
        let config = dir.path().join("autopush.toml");
        std::fs::write(&config, app("app1", PROJECT, &google, &key_file, ""))
            .expect("write the settings file");
        let gcm = json!({"1234": {
            "project_id": PROJECT,
            "credential": google.service_account().to_string(),
            "base_url": google.base_url(),
            "timeout": 3,
        }})
        .to_string();
        let config_arg = config.display().to_string();
        let server =
            Server::start_with(&["--config", &config_arg, "--gcm-credentials", &gcm]).await;
        Reloading {
            google,
            server,
            keys: Keys::generate().await,
            config,
            key_file,
            _dir: dir,
        }
    }

    fn app(&self, name: &str, project: &str) -> String {
        app(name, project, &self.google, &self.key_file, "")
    }

    /// Write `toml` as the settings file, send SIGHUP, and wait until the
    /// server has read it (its `reloads`-th reload, counting the log's
    /// summary lines).
    async fn reload(&self, toml: &str, reloads: usize) {
        std::fs::write(&self.config, toml).expect("rewrite the settings file");
        self.server.hangup();
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            let log = self.server.stderr();
            let done = log
                .lines()
                .filter(|l| l.contains("bridges reloaded") || l.contains("bridges not reloaded"))
                .count();
            if done >= reloads {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "reload {reloads} not logged within {HANG_GUARD:?}:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn register_reply(&self, app_id: &str, token: &str) -> HttpReply {
        http::request(
            Method::POST,
            &format!(
                "{}/v1/fcm/{app_id}/registration",
                self.server.endpoint_base()
            ),
            &[("content-type", "application/json")],
            Some(json!({ "token": token }).to_string().into_bytes()),
        )
        .await
    }

    /// Register `token` with `app_id`; the endpoint it gets.
    async fn register(&self, app_id: &str, token: &str) -> String {
        let reply = self.register_reply(app_id, token).await;
        assert_eq!(reply.status, 200, "register with {app_id}: {}", reply.text);
        reply.field("endpoint")
    }

    async fn push(&self, endpoint: &str, text: &str) -> SendResult {
        py::send(endpoint, &self.keys, &SendOptions::text(text)).await
    }

    /// Push `text` to `endpoint` and return the Firebase project Google saw
    /// it sent under.
    async fn delivered_under(&self, endpoint: &str, token: &str, text: &str) -> String {
        let before = self.google.received_for(token).len();
        self.push(endpoint, text).await.assert_created();
        let got = self.google.wait_for(token, before + 1).await;
        got[before].project.clone()
    }

    fn log_lines(&self, needle: &str) -> Vec<String> {
        self.server
            .stderr()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    async fn metrics(&self) -> Scrape {
        let reply = http::get(&format!("{}/metrics", self.server.router_base())).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        Scrape::parse(&reply.text)
    }
}

/// The errno of a refusal, and its message.
fn refusal(reply: &HttpReply) -> (u16, u64, String) {
    (
        reply.status,
        reply.json["errno"].as_u64().unwrap_or_default(),
        reply.json["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test]
async fn an_app_added_by_sighup_is_served_at_once_and_no_connection_drops() {
    let r = Reloading::start().await;
    // A websocket client and an FCM app connected before the reload.
    let mut ws = WsClient::connect_hello(&r.server.ws_url(), None).await;
    let sub = Subscription::new(&mut ws).await;
    let app1 = r.register("app1", "token-app1").await;
    assert_eq!(
        r.delivered_under(&app1, "token-app1", "before").await,
        PROJECT
    );
    let (status, errno, _) = refusal(&r.register_reply("app2", "token-app2").await);
    assert_eq!((status, errno), (400, 108), "app2 is not served yet");

    let toml = [r.app("app1", PROJECT), r.app("app2", "second-project")].concat();
    r.reload(&toml, 1).await;

    let app2 = r.register("app2", "token-app2").await;
    assert_eq!(
        r.delivered_under(&app2, "token-app2", "new app").await,
        "second-project"
    );
    let sent = r.google.received_for("token-app2");
    assert!(
        sent[0].headers["authorization"].starts_with("Bearer ya29.mock-"),
        "{:?}",
        sent[0].headers
    );
    // The unchanged app kept its client and its access token: the only
    // token fetched since is the new project's.
    assert_eq!(
        r.delivered_under(&app1, "token-app1", "after").await,
        PROJECT
    );
    assert_eq!(r.google.token_fetches(), 2, "one token per project");

    // The websocket made before the reload is still up and delivered to.
    sub.push_text("still here").await.assert_created();
    let (notification, plain) = sub.receive(&mut ws).await;
    assert_eq!(plain.text, "still here");
    ws.ack_notification(&notification).await;

    // The flag's GCM sender id stays over the file, which has none.
    let reply = http::request(
        Method::POST,
        &format!("{}/v1/gcm/1234/registration", r.server.endpoint_base()),
        &[("content-type", "application/json")],
        Some(json!({"token": "token-gcm"}).to_string().into_bytes()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);

    let s = r.metrics().await;
    assert_eq!(s.value("bridge_apps", &[("router_type", "fcm")]), 2.0);
    assert_eq!(s.value("bridge_apps", &[("router_type", "gcm")]), 1.0);
    assert_eq!(s.value("bridge_apps", &[("router_type", "apns")]), 0.0);
    assert_eq!(s.value("bridge_reload", &[("outcome", "ok")]), 1.0);
    ws.close().await;
}

#[tokio::test]
async fn a_changed_credential_is_used_for_the_next_push_and_a_removed_app_is_refused_by_name() {
    let r = Reloading::start().await;
    let app1 = r.register("app1", "token-app1").await;
    assert_eq!(r.delivered_under(&app1, "token-app1", "one").await, PROJECT);

    // The same app, on another project: the next push goes there.
    r.reload(&r.app("app1", "rotated-project"), 1).await;
    assert_eq!(
        r.delivered_under(&app1, "token-app1", "two").await,
        "rotated-project"
    );

    // Removed: its registrations stay, pushes to them are the operator's
    // problem (502/902 naming the app), not a gone device; new ones are
    // refused as for any app not served.
    r.reload(&r.app("other", PROJECT), 2).await;
    let sent = r.push(&app1, "three").await;
    let json = sent.json();
    assert_eq!(
        (sent.status, json["errno"].as_u64()),
        (502, Some(902)),
        "{}",
        sent.body
    );
    let (status, errno, message) = refusal(&r.register_reply("app1", "token-b").await);
    assert_eq!((status, errno), (400, 108), "{message}");
    assert!(message.contains("app1"), "{message}");
    assert_eq!(r.google.received_for("token-app1").len(), 2);

    // Put back, the registration made before is delivered to again.
    r.reload(&r.app("app1", PROJECT), 3).await;
    assert_eq!(
        r.delivered_under(&app1, "token-app1", "four").await,
        PROJECT
    );
}

#[tokio::test]
async fn a_bad_section_is_logged_by_name_and_the_one_before_stays() {
    let r = Reloading::start().await;
    let app1 = r.register("app1", "token-app1").await;
    assert_eq!(r.delivered_under(&app1, "token-app1", "one").await, PROJECT);

    // app1: an inline key that is not JSON (fails to build); app2: a key
    // the table does not take (fails to parse); app3: good.
    let secret = "{not json, but secret-looking-material}";
    let broken = format!(
        "[fcm.apps.app1]\nproject_id = \"broken-project\"\ncredential = '{secret}'\n\
         base_url = \"{}\"\n",
        r.google.base_url()
    );
    let unknown = format!(
        "[fcm.apps.app2]\nprojectid = \"p\"\ncredential = \"{}\"\n",
        r.key_file.display()
    );
    let toml = [broken, unknown, r.app("app3", "third-project")].concat();
    r.reload(&toml, 1).await;

    let rejected = r.log_lines("rejected");
    assert_eq!(rejected.len(), 2, "{rejected:#?}");
    for (line, name) in rejected.iter().zip(["app1", "app2"]) {
        assert!(line.contains("ERROR") && line.contains(name), "{line}");
        assert!(!line.contains("secret-looking-material"), "{line}");
    }
    // app1 as it was; app2 not served; app3 served.
    assert_eq!(r.delivered_under(&app1, "token-app1", "two").await, PROJECT);
    let (status, errno, _) = refusal(&r.register_reply("app2", "token-app2").await);
    assert_eq!((status, errno), (400, 108));
    let app3 = r.register("app3", "token-app3").await;
    assert_eq!(
        r.delivered_under(&app3, "token-app3", "three").await,
        "third-project"
    );

    // A file that is not TOML at all changes nothing.
    r.reload("[fcm.apps.app1\n", 2).await;
    assert_eq!(r.log_lines("bridges not reloaded").len(), 1);
    assert_eq!(
        r.delivered_under(&app3, "token-app3", "four").await,
        "third-project"
    );

    // The first reload applied in part, the second not at all.
    let s = r.metrics().await;
    assert_eq!(s.value("bridge_apps", &[("router_type", "fcm")]), 2.0);
    assert_eq!(s.get("bridge_reload", &[("outcome", "ok")]), None);
    assert_eq!(s.value("bridge_reload", &[("outcome", "partial")]), 1.0);
    assert_eq!(s.value("bridge_reload", &[("outcome", "rejected")]), 1.0);
}
