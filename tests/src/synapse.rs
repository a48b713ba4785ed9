//! A real Matrix homeserver: Synapse (`matrix-synapse` from
//! tests/py/requirements.txt) on sqlite and loopback, with a config made
//! here, for the tests of the Matrix push gateway.
//!
//! Synapse refuses to push to private addresses (its `ip_range_blacklist`
//! holds loopback); the config lets it push to loopback alone
//! (`ip_range_whitelist`), where the service under test listens.

use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use reqwest::Method;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::HANG_GUARD;
use crate::http::{HttpReply, request};
use crate::py::python;
use crate::server::free_ports;

/// Synapse, exiting when its stdin closes (when the test that started it
/// ends, however it ends).
const RUN: &str = r#"
import os, sys, threading
def watch():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
from synapse.app.homeserver import main
sys.argv = ["synapse", "--config-path", sys.argv[1]]
main()
"#;

/// The shared secret of the admin registration API.
const REGISTRATION_SECRET: &str = "autopush-tests-registration-secret";

/// The homeserver's name: users are `@NAME:localhost`.
pub const SERVER_NAME: &str = "localhost";

/// A running Synapse, killed on drop.
pub struct Synapse {
    /// `http://127.0.0.1:PORT`: its client API.
    pub base: String,
    dir: TempDir,
    child: Child,
    _stdin: ChildStdin,
}

/// A registered user, with an access token.
pub struct MatrixUser {
    /// `@name:localhost`.
    pub user_id: String,
    token: String,
    base: String,
}

impl Synapse {
    /// Start Synapse with a fresh database and wait until it answers.
    pub async fn start() -> Synapse {
        let dir = tempfile::Builder::new()
            .prefix("autopush-synapse-")
            .tempdir()
            .expect("Synapse's directory");
        let [port] = free_ports::<1>();
        let config = dir.path().join("homeserver.yaml");
        std::fs::write(&config, config_text(dir.path(), port)).expect("write homeserver.yaml");
        std::fs::write(dir.path().join("signing.key"), signing_key()).expect("write signing key");
        let log = std::fs::File::create(dir.path().join("synapse.log")).expect("Synapse's log");
        let mut child = Command::new(python())
            .arg("-c")
            .arg(RUN)
            .arg(&config)
            .current_dir(dir.path())
            .stdin(Stdio::piped())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start Synapse with {}: {e}", python().display()));
        let stdin = child.stdin.take().expect("Synapse's stdin");
        let mut synapse = Synapse {
            base: format!("http://127.0.0.1:{port}"),
            dir,
            child,
            _stdin: stdin,
        };
        synapse.wait_until_up().await;
        synapse
    }

    async fn wait_until_up(&mut self) {
        let versions = format!("{}/_matrix/client/versions", self.base);
        let started = Instant::now();
        while crate::http::client().get(&versions).send().await.is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "Synapse exited ({status}); is matrix-synapse installed (scripts/test \
                     --setup-python)? Its log:\n{}",
                    self.log()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "Synapse did not answer on {versions} within 120 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Synapse's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("synapse.log")).unwrap_or_default()
    }

    /// Register `name` through the admin registration API (its shared
    /// secret signs the request), as a user who is not an admin.
    pub async fn register(&self, name: &str) -> MatrixUser {
        let url = format!("{}/_synapse/admin/v1/register", self.base);
        let nonce = request(Method::GET, &url, &[], None).await;
        assert_eq!(nonce.status, 200, "register nonce: {}", nonce.text);
        let nonce = nonce.field("nonce");
        let password = format!("{name}-password");
        let key = ring::hmac::Key::new(
            ring::hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY,
            REGISTRATION_SECRET.as_bytes(),
        );
        let signed = [nonce.as_str(), name, password.as_str(), "notadmin"].join("\0");
        let mac = crate::hex_encode(ring::hmac::sign(&key, signed.as_bytes()).as_ref());
        let body = json!({
            "nonce": nonce, "username": name, "password": password,
            "admin": false, "mac": mac,
        });
        let reply = post_json(&url, None, &body).await;
        assert_eq!(reply.status, 200, "register {name}: {}", reply.text);
        MatrixUser {
            user_id: reply.field("user_id"),
            token: reply.field("access_token"),
            base: self.base.clone(),
        }
    }
}

impl Drop for Synapse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MatrixUser {
    /// A client-server API call as this user; panics unless it answers 200.
    pub async fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Value {
        let url = format!("{}/_matrix/client/v3{path}", self.base);
        let reply = match body {
            Some(body) => post_or_put(method.clone(), &url, Some(&self.token), body).await,
            None => {
                let auth = format!("Bearer {}", self.token);
                request(method.clone(), &url, &[("authorization", &auth)], None).await
            }
        };
        assert_eq!(
            reply.status, 200,
            "{method} {path} as {}: {}",
            self.user_id, reply.text
        );
        reply.json
    }

    /// A private room with `other` invited; returns its id.
    pub async fn create_room_with(&self, other: &MatrixUser) -> String {
        let body = json!({"preset": "private_chat", "invite": [other.user_id]});
        let reply = self.call(Method::POST, "/createRoom", Some(&body)).await;
        reply["room_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no room_id: {reply}"))
            .to_owned()
    }

    pub async fn join(&self, room_id: &str) {
        self.call(Method::POST, &format!("/join/{room_id}"), Some(&json!({})))
            .await;
    }

    /// Send a text message to `room_id`; returns its event id.
    pub async fn send_text(&self, room_id: &str, text: &str) -> String {
        let txn = crate::new_channel_id();
        let body = json!({"msgtype": "m.text", "body": text});
        let path = format!("/rooms/{room_id}/send/m.room.message/{txn}");
        let reply = self.call(Method::PUT, &path, Some(&body)).await;
        reply["event_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no event_id: {reply}"))
            .to_owned()
    }

    /// Set an HTTP pusher sending to the gateway at `gateway_url` with
    /// `pushkey`.
    pub async fn set_http_pusher(&self, gateway_url: &str, pushkey: &str) {
        let body = json!({
            "kind": "http",
            "app_id": "org.autopush.test",
            "pushkey": pushkey,
            "app_display_name": "autopush tests",
            "device_display_name": "a websocket client",
            "lang": "en",
            "data": {"url": gateway_url},
        });
        self.call(Method::POST, "/pushers/set", Some(&body)).await;
    }

    /// The pushkeys of this user's pushers.
    pub async fn pushkeys(&self) -> Vec<String> {
        let reply = self.call(Method::GET, "/pushers", None).await;
        reply["pushers"]
            .as_array()
            .unwrap_or_else(|| panic!("no pushers list: {reply}"))
            .iter()
            .filter_map(|p| p["pushkey"].as_str().map(str::to_owned))
            .collect()
    }

    /// Wait (up to the hang guard) until this user has no pusher left.
    pub async fn wait_for_no_pushers(&self, synapse: &Synapse) {
        let deadline = Instant::now() + HANG_GUARD * 2;
        while !self.pushkeys().await.is_empty() {
            assert!(
                Instant::now() < deadline,
                "Synapse kept the pusher of {}; its log:\n{}",
                self.user_id,
                synapse.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

async fn post_json(url: &str, token: Option<&str>, body: &Value) -> HttpReply {
    post_or_put(Method::POST, url, token, body).await
}

async fn post_or_put(method: Method, url: &str, token: Option<&str>, body: &Value) -> HttpReply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth));
    }
    request(method, url, &headers, Some(body.to_string().into_bytes())).await
}

/// A fresh ed25519 signing key in Synapse's file format (saves running
/// Synapse once with `--generate-keys`).
fn signing_key() -> String {
    let seed: Vec<u8> = (0..32).map(|_| fastrand::u8(..)).collect();
    let seed = base64::engine::general_purpose::STANDARD_NO_PAD.encode(seed);
    format!("ed25519 a_test {seed}\n")
}

/// The homeserver's config: sqlite and a client listener in `dir`, on
/// loopback `port`; no federation key servers; pushers may reach loopback;
/// rate limits out of a test's reach.
fn config_text(dir: &Path, port: u16) -> String {
    let dir = dir.display();
    format!(
        r#"server_name: "{SERVER_NAME}"
pid_file: "{dir}/homeserver.pid"
listeners:
  - port: {port}
    bind_addresses: ["127.0.0.1"]
    type: http
    tls: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: "{dir}/homeserver.db"
media_store_path: "{dir}/media_store"
signing_key_path: "{dir}/signing.key"
registration_shared_secret: "{REGISTRATION_SECRET}"
report_stats: false
trusted_key_servers: []
suppress_key_server_warning: true
ip_range_whitelist: ["127.0.0.0/8"]
rc_message:
  per_second: 1000
  burst_count: 1000
"#
    )
}
