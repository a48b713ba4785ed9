//! End-to-end test harness for autopush.
//!
//! The tests in `tests/tests/*.rs` start the real `autopush` binary on loopback
//! ports ([`Server`]), talk to it as Firefox does over the websocket
//! ([`WsClient`]), and as an application server does over HTTP, either through
//! the real PyPI libraries (pywebpush, py_vapid, http_ece via
//! `tests/py/webpush_tool.py`, see [`py`]) or with raw requests ([`http`]).
//! Interop with software nobody on the team wrote: a real Firefox ([`firefox`])
//! and the `web-push` npm package ([`node`]). The APNs bridge runs in-process
//! with a recording double for Apple ([`apns`]). DynamoDB tests run on local
//! DynamoDB-compatible servers, moto and dynalite ([`dynamo`]); Bigtable tests
//! on Google's emulator ([`bigtable`]). An upstream is put behind https, and the
//! server's own TLS ports are spoken to, with [`tls`]; the service also runs
//! behind Debian's nginx and Caddy, as the docs deploy it, with [`nginx`] and
//! [`caddy`]. The Matrix push gateway is pushed to by a real Synapse
//! ([`synapse`]). A test that must hold on every
//! backend runs once on each ([`backend`], `on_every_backend!`).
//!
//! Environment:
//! * `AUTOPUSH_BIN`: the binary under test (default `<workspace>/target/debug/autopush`).
//! * `AUTOPUSH_TEST_PYTHON`: a Python with `tests/py/requirements.txt` installed
//!   (default `<workspace>/target/pyenv/bin/python` when present, else `python3`).
//! * `AUTOPUSH_TEST_FIREFOX`: the Firefox for [`firefox`] (default `firefox-esr` on `PATH`).
//! * `AUTOPUSH_TEST_NODE`: the Node.js for [`node`] (default `node` on `PATH`), with
//!   `tests/node/node_modules` installed (`npm ci`).
//! * `AUTOPUSH_TEST_PG_DSN`: a running PostgreSQL (with `pg_stat_statements` preloaded)
//!   for [`postgres`] to use instead of starting a private cluster.
//!
//! `scripts/test` sets up Python, the binary and `node_modules`; `.ci/run` also installs
//! Firefox.

pub mod apns;
pub mod autopush_rs;
pub mod backend;
pub mod bigtable;
pub mod bridge;
pub mod caddy;
pub mod cut_off;
pub mod dynamo;
pub mod firefox;
pub mod fleet;
pub mod google;
pub mod http;
pub mod mailbox;
pub mod nginx;
pub mod node;
pub mod postgres;
pub mod prometheus;
pub mod py;
pub mod receipt;
pub mod scenarios;
pub mod server;
pub mod subscription;
pub mod synapse;
pub mod tls;
pub mod ws;

use std::path::PathBuf;
use std::time::Duration;

pub use http::HttpReply;
pub use py::{
    Decrypted, Encoding, Encrypted, Keys, Payload, SendOptions, SendResult, VapidKey, VapidScheme,
};
pub use server::{Node, Server};
pub use subscription::Subscription;
pub use ws::{Closed, WsClient};

/// How long any single wait may take before the harness gives up. A hang
/// guard only: no test asserts on timing.
pub const HANG_GUARD: Duration = Duration::from_secs(15);

/// The number in environment variable `name`, or `default`: how a search
/// test is run longer, or made to repeat one seed.
pub fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// How long to listen when asserting that nothing (more) arrives.
pub const QUIET: Duration = Duration::from_secs(2);

/// Largest request body the endpoint must accept (bytes). Everything
/// pywebpush produces from a 4096-byte plaintext is below it in both
/// encodings (aes128gcm: 4216 bytes, aesgcm: 4132 bytes).
pub const MAX_BODY_BYTES: usize = 5630;

/// Largest TTL the endpoint keeps; larger values are capped to it.
pub const MAX_TTL: u64 = 2_592_000;

/// The largest plaintext a Web Push message carries.
pub const MAX_PLAINTEXT: usize = 4096;

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// A file of test-only key material in `certs/`, made by one of its
/// `make-*.sh` scripts.
pub fn cert_file(name: &str) -> PathBuf {
    workspace_root().join("certs").join(name)
}

/// The cargo target directory (`CARGO_TARGET_DIR` or `<workspace>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        }
        None => workspace_root().join("target"),
    }
}

/// A new channel ID as a user agent makes one: lower-case dashed UUID v4.
pub fn new_channel_id() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}

/// A random UAID in the server's format (32 lower-case hex digits) that no
/// server has issued.
pub fn random_uaid() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Whether `s` is a UAID as the server hands them out: 32 lower-case hex digits.
pub fn is_uaid(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `s` is a lower-case dashed UUID.
pub fn is_dashed_uuid(s: &str) -> bool {
    s.len() == 36
        && s == s.to_ascii_lowercase()
        && uuid::Uuid::parse_str(s).is_ok_and(|u| u.hyphenated().to_string() == s)
}

/// The deterministic payload `webpush_tool.py --data-len N` sends.
pub fn data_pattern(n: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    (0..n)
        .map(|i| ALPHABET[i % ALPHABET.len()] as char)
        .collect()
}

/// Opaque bytes standing in for an encrypted body in raw HTTP requests (the
/// push service forwards bodies without decrypting them).
pub fn opaque_body(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

/// Decode lower-case or upper-case hex; panics on malformed input.
pub fn hex_decode(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd-length hex: {s}");
    (0..s.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_else(|e| panic!("bad hex {s}: {e}"))
        })
        .collect()
}

/// Encode bytes as lower-case hex.
pub fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
