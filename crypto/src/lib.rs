//! The two other parties of Web Push, in Rust: an application server that
//! encrypts a message for a subscription and signs a VAPID token, and a user
//! agent that holds the subscription keys and decrypts what arrives.
//!
//! * [`ece`]: message encryption, RFC 8291 (`aes128gcm`, over RFC 8188) and
//!   the older draft `aesgcm` still sent by many servers; both directions.
//! * [`vapid`]: RFC 8292 `Authorization: vapid t=..., k=...` headers.
//!
//! The push service itself never decrypts; `autopush check` and the load
//! generator use this crate to play the other parties.

pub mod ece;
pub mod vapid;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// Base64url without padding, as every Web Push key and body is written.
pub fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Decode base64url, with or without padding (senders differ).
pub fn unb64(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    URL_SAFE_NO_PAD.decode(text.trim().trim_end_matches('='))
}
