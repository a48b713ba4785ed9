//! `tests/py/webpush_tool.py`: the real application-server libraries from
//! PyPI (pywebpush, py_vapid, http_ece) behind a small JSON CLI.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

use crate::{hex_decode, hex_encode, target_dir};

/// The Python interpreter: `AUTOPUSH_TEST_PYTHON`, else the venv
/// `scripts/test` makes (`<target>/pyenv`), else `python3`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("AUTOPUSH_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = target_dir().join("pyenv").join("bin").join("python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// The path of `webpush_tool.py`.
pub fn tool_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("py")
        .join("webpush_tool.py")
}

/// Run `webpush_tool.py ARGS...` and return the JSON object it prints.
/// Panics (with its stderr) when it fails.
pub async fn run_tool(args: &[String]) -> Value {
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg(tool_path())
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(Duration::from_secs(60), cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!(
            "could not run {} (set AUTOPUSH_TEST_PYTHON or run scripts/test): {e}",
            python().display()
        ),
        Err(_) => panic!("webpush_tool.py {args:?} did not finish within 60 s"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "webpush_tool.py {args:?} failed ({}):\n{stderr}\n(python: {}; run scripts/test \
         --setup-python to install tests/py/requirements.txt)",
        out.status,
        python().display()
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("webpush_tool.py {args:?} printed no JSON ({e}): {stdout}"))
}

/// `--name=value`: the one form argparse never mistakes for an option
/// (base64url values may start with `-`).
fn opt(name: &str, value: impl std::fmt::Display) -> String {
    format!("--{name}={value}")
}

fn str_field(v: &Value, name: &str) -> String {
    v[name]
        .as_str()
        .unwrap_or_else(|| panic!("no string {name:?} in {v}"))
        .to_string()
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.as_str().map_or_else(|| v.to_string(), str::to_string),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A browser subscription's keys (all base64url without padding).
#[derive(Debug, Clone)]
pub struct Keys {
    /// The raw 32-byte EC private scalar.
    pub private_key: String,
    /// The 65-byte uncompressed public point.
    pub p256dh: String,
    /// The 16-byte auth secret.
    pub auth: String,
}

impl Keys {
    /// New keys, as `PushManager.subscribe()` makes them.
    pub async fn generate() -> Keys {
        let v = run_tool(&["keys".to_string()]).await;
        Keys {
            private_key: str_field(&v, "private_key"),
            p256dh: str_field(&v, "p256dh"),
            auth: str_field(&v, "auth"),
        }
    }
}

/// A VAPID key pair; the private key lives in a PEM file in its own temp dir.
#[derive(Debug, Clone)]
pub struct VapidKey {
    /// The private key PEM file.
    pub pem: PathBuf,
    /// The raw public key, base64url (a page's `applicationServerKey`, the
    /// `key` of a register message).
    pub public_key: String,
    /// The raw 32-byte private scalar, base64url (web-push's `vapidDetails.privateKey`).
    pub private_key: String,
    _dir: Arc<TempDir>,
}

impl VapidKey {
    /// A new key pair.
    pub async fn generate() -> VapidKey {
        let dir = tempfile::Builder::new()
            .prefix("autopush-vapid-")
            .tempdir()
            .expect("temp dir");
        let pem = dir.path().join("vapid_private.pem");
        let v = run_tool(&["vapid-key".to_string(), opt("out", pem.display())]).await;
        VapidKey {
            pem,
            public_key: str_field(&v, "public_key"),
            private_key: str_field(&v, "private_key"),
            _dir: Arc::new(dir),
        }
    }
}

/// The content encoding of a push message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// RFC 8188, the standard.
    Aes128Gcm,
    /// The older draft (`Encryption` + `Crypto-Key` headers).
    AesGcm,
}

impl Encoding {
    /// Both encodings, for tests that cover each.
    pub const ALL: [Encoding; 2] = [Encoding::Aes128Gcm, Encoding::AesGcm];

    /// The `Content-Encoding` token.
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Aes128Gcm => "aes128gcm",
            Encoding::AesGcm => "aesgcm",
        }
    }
}

/// What a push message carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// No body at all.
    Empty,
    /// UTF-8 text.
    Text(String),
    /// Arbitrary bytes.
    Bytes(Vec<u8>),
    /// N bytes of [`crate::data_pattern`].
    Pattern(usize),
}

impl Payload {
    /// The plaintext bytes.
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Payload::Empty => Vec::new(),
            Payload::Text(s) => s.as_bytes().to_vec(),
            Payload::Bytes(b) => b.clone(),
            Payload::Pattern(n) => crate::data_pattern(*n).into_bytes(),
        }
    }

    fn args(&self) -> Vec<String> {
        match self {
            Payload::Empty => vec![],
            Payload::Text(s) => vec![opt("data", s)],
            Payload::Bytes(b) => vec![opt("data-hex", hex_encode(b))],
            Payload::Pattern(n) => vec![opt("data-len", n)],
        }
    }
}

/// The VAPID `Authorization` scheme to sign with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VapidScheme {
    /// RFC 8292 `Authorization: vapid t=<jwt>,k=<key>` (pywebpush's default).
    Vapid,
    /// The draft `Authorization: WebPush <jwt>` + `Crypto-Key: p256ecdsa=<key>`.
    WebPush,
}

/// How to send one push message with pywebpush. Build with the constructors
/// and chain the setters; the TTL defaults to 60 s (pywebpush's own default, 0,
/// would drop the message for an offline client).
#[derive(Debug, Clone)]
pub struct SendOptions {
    pub payload: Payload,
    pub encoding: Encoding,
    pub ttl: u64,
    pub topic: Option<String>,
    pub urgency: Option<String>,
    pub vapid: Option<VapidKey>,
    pub vapid_sub: Option<String>,
    pub vapid_aud: Option<String>,
    pub vapid_exp: Option<i64>,
    pub vapid_scheme: VapidScheme,
    /// Trust only the CA certificates in this PEM file for an https endpoint.
    pub ca_file: Option<PathBuf>,
}

impl SendOptions {
    fn new(payload: Payload) -> SendOptions {
        SendOptions {
            payload,
            encoding: Encoding::Aes128Gcm,
            ttl: 60,
            topic: None,
            urgency: None,
            vapid: None,
            vapid_sub: None,
            vapid_aud: None,
            vapid_exp: None,
            vapid_scheme: VapidScheme::Vapid,
            ca_file: None,
        }
    }

    /// A UTF-8 text payload.
    pub fn text(text: &str) -> SendOptions {
        SendOptions::new(Payload::Text(text.to_string()))
    }

    /// `n` bytes of [`crate::data_pattern`].
    pub fn pattern(n: usize) -> SendOptions {
        SendOptions::new(Payload::Pattern(n))
    }

    /// Arbitrary bytes.
    pub fn bytes(bytes: &[u8]) -> SendOptions {
        SendOptions::new(Payload::Bytes(bytes.to_vec()))
    }

    /// No body (a "tickle").
    pub fn empty() -> SendOptions {
        SendOptions::new(Payload::Empty)
    }

    pub fn encoding(mut self, encoding: Encoding) -> SendOptions {
        self.encoding = encoding;
        self
    }

    pub fn ttl(mut self, ttl: u64) -> SendOptions {
        self.ttl = ttl;
        self
    }

    pub fn topic(mut self, topic: &str) -> SendOptions {
        self.topic = Some(topic.to_string());
        self
    }

    /// The `Urgency` header (RFC 8030: very-low, low, normal, high).
    pub fn urgency(mut self, urgency: &str) -> SendOptions {
        self.urgency = Some(urgency.to_string());
        self
    }

    /// Sign with this VAPID key (claims: `sub` mailto:test@example.com, `aud`
    /// the endpoint's origin, `exp` py_vapid's default).
    pub fn vapid(mut self, key: &VapidKey) -> SendOptions {
        self.vapid = Some(key.clone());
        self
    }

    pub fn vapid_sub(mut self, sub: &str) -> SendOptions {
        self.vapid_sub = Some(sub.to_string());
        self
    }

    pub fn vapid_aud(mut self, aud: &str) -> SendOptions {
        self.vapid_aud = Some(aud.to_string());
        self
    }

    pub fn vapid_exp(mut self, exp: i64) -> SendOptions {
        self.vapid_exp = Some(exp);
        self
    }

    pub fn vapid_scheme(mut self, scheme: VapidScheme) -> SendOptions {
        self.vapid_scheme = scheme;
        self
    }

    /// Send to an https endpoint whose certificate this CA (a PEM file) signed.
    pub fn ca_file(mut self, ca: &std::path::Path) -> SendOptions {
        self.ca_file = Some(ca.to_path_buf());
        self
    }

    fn args(&self) -> Vec<String> {
        let mut args = self.payload.args();
        if let Some(ca) = &self.ca_file {
            args.push(opt("ca-file", ca.display()));
        }
        args.extend([
            opt("encoding", self.encoding.as_str()),
            opt("ttl", self.ttl),
        ]);
        if let Some(t) = &self.topic {
            args.push(opt("topic", t));
        }
        if let Some(u) = &self.urgency {
            args.push(opt("urgency", u));
        }
        if let Some(k) = &self.vapid {
            args.push(opt("vapid-pem", k.pem.display()));
            let scheme = match self.vapid_scheme {
                VapidScheme::Vapid => "vapid",
                VapidScheme::WebPush => "webpush",
            };
            args.push(opt("vapid-scheme", scheme));
            if let Some(s) = &self.vapid_sub {
                args.push(opt("vapid-sub", s));
            }
            if let Some(a) = &self.vapid_aud {
                args.push(opt("vapid-aud", a));
            }
            if let Some(e) = self.vapid_exp {
                args.push(opt("vapid-exp", e));
            }
        }
        args
    }
}

/// What the push service answered to a pywebpush send, and what was sent.
#[derive(Debug, Clone)]
pub struct SendResult {
    pub status: u16,
    /// Response headers, lower-case names.
    pub headers: BTreeMap<String, String>,
    /// Response body text.
    pub body: String,
    /// The request headers pywebpush sent, lower-case names.
    pub sent_headers: BTreeMap<String, String>,
    /// The request body's length in bytes.
    pub sent_body_len: usize,
}

impl SendResult {
    /// The response body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// A response header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// Assert the push was accepted: 201 with `Location` and `TTL`.
    pub fn assert_created(&self) -> &SendResult {
        assert_eq!(
            self.status, 201,
            "push not accepted: {} {}\nsent headers: {:?}",
            self.status, self.body, self.sent_headers
        );
        assert!(self.header("location").is_some(), "no Location: {self:?}");
        assert!(self.header("ttl").is_some(), "no TTL: {self:?}");
        self
    }

    /// Assert an error response with this status and errno (and the JSON
    /// error shape `{code, errno, error, message, more_info}`).
    pub fn assert_error(&self, status: u16, errno: u64) {
        crate::http::assert_error_parts(status, errno, self.status, &self.json(), &self.body);
    }

    /// Assert a limit's refusal: 429 errno 201, with `Retry-After` and the
    /// [`crate::http::RateLimit`] headers agreeing on the wait; the limit
    /// they name.
    pub fn assert_rate_limited(&self, what: &str) -> crate::http::RateLimit {
        self.assert_error(429, 201);
        crate::http::RateLimit::refused(&self.headers, what)
    }
}

/// Send a push message with pywebpush to `endpoint` for a subscription with `keys`.
pub async fn send(endpoint: &str, keys: &Keys, opts: &SendOptions) -> SendResult {
    let mut args = vec![
        "send".to_string(),
        opt("endpoint", endpoint),
        opt("p256dh", &keys.p256dh),
        opt("auth", &keys.auth),
    ];
    args.extend(opts.args());
    let v = run_tool(&args).await;
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

/// A message encrypted by pywebpush without sending it: the base64url body
/// and the headers as the push service forwards them to the websocket client
/// (`encoding`, `encryption`, `crypto_key`).
#[derive(Debug, Clone)]
pub struct Encrypted {
    pub body: String,
    pub headers: Value,
}

/// Encrypt `payload` for a subscription with `keys`.
pub async fn encrypt(keys: &Keys, payload: &Payload, encoding: Encoding) -> Encrypted {
    let mut args = vec![
        "encrypt".to_string(),
        opt("p256dh", &keys.p256dh),
        opt("auth", &keys.auth),
        opt("encoding", encoding.as_str()),
    ];
    args.extend(payload.args());
    let v = run_tool(&args).await;
    Encrypted {
        body: str_field(&v, "body"),
        headers: v["headers"].clone(),
    }
}

/// A decrypted notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decrypted {
    /// The plaintext as UTF-8 (lossy).
    pub text: String,
    /// The plaintext bytes.
    pub bytes: Vec<u8>,
}

/// Decrypt a notification as received over the websocket (its `data` and
/// `headers`) with the subscription's private key and auth secret.
pub async fn decrypt(keys: &Keys, notification: &Value) -> Decrypted {
    let data = notification["data"]
        .as_str()
        .unwrap_or_else(|| panic!("notification has no data: {notification}"));
    let headers = &notification["headers"];
    assert!(
        headers.is_object(),
        "notification has no headers object: {notification}"
    );
    let v = run_tool(&[
        "decrypt".to_string(),
        opt("private-key", &keys.private_key),
        opt("auth", &keys.auth),
        opt("data", data),
        opt("headers", headers),
    ])
    .await;
    Decrypted {
        text: str_field(&v, "plaintext"),
        bytes: hex_decode(&str_field(&v, "plaintext_hex")),
    }
}
