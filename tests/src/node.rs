//! `tests/node/send.js`: the `web-push` npm package as an application server.
//!
//! Needs Node.js (`AUTOPUSH_TEST_NODE`, else `node` on `PATH`) and
//! `tests/node/node_modules` (`scripts/test` runs `npm ci` there).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};

use crate::py::{Encoding, Keys, SendResult, VapidKey};

/// The Node.js binary.
pub fn node() -> PathBuf {
    std::env::var_os("AUTOPUSH_TEST_NODE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("node"))
}

/// `tests/node`, with `package.json` and `send.js`.
pub fn node_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("node")
}

/// How to send one message with web-push: UTF-8 text, TTL 60, aes128gcm,
/// no VAPID unless given.
#[derive(Debug, Clone)]
pub struct WebPushOptions {
    pub text: Option<String>,
    pub encoding: Encoding,
    pub ttl: u64,
    pub vapid: Option<VapidKey>,
    pub vapid_subject: String,
    pub topic: Option<String>,
    /// web-push's `urgency` option, sent as the `Urgency` header.
    pub urgency: Option<String>,
}

impl WebPushOptions {
    pub fn text(text: &str) -> WebPushOptions {
        WebPushOptions {
            text: Some(text.to_string()),
            encoding: Encoding::Aes128Gcm,
            ttl: 60,
            vapid: None,
            vapid_subject: "mailto:test@example.com".to_string(),
            topic: None,
            urgency: None,
        }
    }

    pub fn encoding(mut self, encoding: Encoding) -> WebPushOptions {
        self.encoding = encoding;
        self
    }

    pub fn vapid(mut self, key: &VapidKey) -> WebPushOptions {
        self.vapid = Some(key.clone());
        self
    }

    pub fn topic(mut self, topic: &str) -> WebPushOptions {
        self.topic = Some(topic.to_string());
        self
    }

    pub fn urgency(mut self, urgency: &str) -> WebPushOptions {
        self.urgency = Some(urgency.to_string());
        self
    }

    fn request(&self, endpoint: &str, keys: &Keys) -> Value {
        let mut options = json!({
            "TTL": self.ttl,
            "contentEncoding": self.encoding.as_str(),
        });
        if let Some(k) = &self.vapid {
            options["vapidDetails"] = json!({
                "subject": self.vapid_subject,
                "publicKey": k.public_key,
                "privateKey": k.private_key,
            });
        }
        if let Some(t) = &self.topic {
            options["topic"] = json!(t);
        }
        if let Some(u) = &self.urgency {
            options["urgency"] = json!(u);
        }
        json!({
            "subscription": {
                "endpoint": endpoint,
                "keys": {"p256dh": keys.p256dh, "auth": keys.auth},
            },
            "payload": self.text,
            "options": options,
        })
    }
}

fn string_map(v: &Value) -> std::collections::BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                    (k.clone(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Send with web-push to `endpoint` for a subscription with `keys`.
pub async fn send(endpoint: &str, keys: &Keys, opts: &WebPushOptions) -> SendResult {
    let dir = node_dir();
    assert!(
        dir.join("node_modules").join("web-push").exists(),
        "{}/node_modules has no web-push: run `npm ci` there (scripts/test does)",
        dir.display()
    );
    let request = opts.request(endpoint, keys).to_string();
    let mut cmd = tokio::process::Command::new(node());
    cmd.arg(dir.join("send.js"))
        .arg(&request)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(Duration::from_secs(60), cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!(
            "could not run {} (install Node.js, or set AUTOPUSH_TEST_NODE): {e}",
            node().display()
        ),
        Err(_) => panic!("send.js {request} did not finish within 60 s"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "send.js {request} failed ({}):\n{stderr}",
        out.status
    );
    let v: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("send.js printed no JSON ({e}): {stdout}\n{stderr}"));
    SendResult {
        status: v["status"]
            .as_u64()
            .unwrap_or_else(|| panic!("no status in {v}")) as u16,
        headers: string_map(&v["headers"]),
        body: v["body"].as_str().unwrap_or_default().to_string(),
        sent_headers: string_map(&v["sent_headers"]),
        sent_body_len: v["sent_body_len"].as_u64().unwrap_or_default() as usize,
    }
}
