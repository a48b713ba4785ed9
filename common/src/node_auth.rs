//! Authentication of node-to-node calls (the internal router API).
//!
//! Every call carries
//! `Authorization: AUTOPUSH-HMAC t={unix seconds},sig={hex}` where `sig` is
//! HMAC-SHA256 under the shared router key of
//! `"{METHOD}\n{path}\n{t}\n{hex SHA-256 of the body}"`. The receiver accepts
//! it within [`MAX_SKEW_SECS`] of its own clock, so a captured call can be
//! replayed only inside that window and only to the same path with the same
//! body. Several keys may be configured for rotation: the first signs, any
//! verifies.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::ids::{hex, unhex};
use crate::secret::Secret;

/// The `Authorization` scheme.
pub const SCHEME: &str = "AUTOPUSH-HMAC";

/// How far a call's timestamp may be from the receiver's clock.
pub const MAX_SKEW_SECS: u64 = 60;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeAuthError {
    #[error("missing Authorization: {SCHEME} t=...,sig=...")]
    Missing,
    #[error("malformed {SCHEME} authorization")]
    Malformed,
    #[error("timestamp more than {MAX_SKEW_SECS} s from this node's clock")]
    Stale,
    #[error("wrong signature (the nodes do not share a router key)")]
    BadSignature,
}

/// The shared router key(s).
#[derive(Clone)]
pub struct NodeKeys {
    keys: Vec<Secret>,
}

impl fmt::Debug for NodeKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeKeys({} keys, [redacted])", self.keys.len())
    }
}

fn mac(key: &Secret, method: &str, path: &str, t: u64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key.expose().as_bytes())
        .expect("HMAC accepts any key length");
    let body_hash = hex(&Sha256::digest(body));
    mac.update(format!("{method}\n{path}\n{t}\n{body_hash}").as_bytes());
    mac
}

impl NodeKeys {
    pub fn new(keys: &[String]) -> Result<Self, String> {
        if keys.is_empty() {
            return Err("no router key given".into());
        }
        Ok(NodeKeys {
            keys: keys.iter().cloned().map(Secret::from).collect(),
        })
    }

    /// The `Authorization` value for a call made at `t` (Unix seconds).
    pub fn authorization(&self, method: &str, path: &str, body: &[u8], t: u64) -> String {
        let sig = mac(&self.keys[0], method, path, t, body)
            .finalize()
            .into_bytes();
        format!("{SCHEME} t={t},sig={}", hex(&sig))
    }

    /// Check a call's `Authorization` value against every key, in constant
    /// time, at the receiver's time `now`.
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: &[u8],
        now: u64,
    ) -> Result<(), NodeAuthError> {
        let value = authorization.ok_or(NodeAuthError::Missing)?.trim();
        let (scheme, params) = value.split_once(' ').ok_or(NodeAuthError::Malformed)?;
        if !scheme.eq_ignore_ascii_case(SCHEME) {
            return Err(NodeAuthError::Malformed);
        }
        let (mut t, mut sig) = (None, None);
        for param in params.split(',') {
            match param.trim().split_once('=') {
                Some(("t", v)) => t = v.parse::<u64>().ok(),
                Some(("sig", v)) => sig = unhex(v),
                _ => return Err(NodeAuthError::Malformed),
            }
        }
        let (Some(t), Some(sig)) = (t, sig) else {
            return Err(NodeAuthError::Malformed);
        };
        if t.abs_diff(now) > MAX_SKEW_SECS {
            return Err(NodeAuthError::Stale);
        }
        let valid = self.keys.iter().fold(false, |found, key| {
            found | mac(key, method, path, t, body).verify_slice(&sig).is_ok()
        });
        if valid {
            Ok(())
        } else {
            Err(NodeAuthError::BadSignature)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> NodeKeys {
        NodeKeys::new(&list.iter().map(|k| k.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn a_signed_call_verifies_only_as_signed() {
        let k = keys(&["k1"]);
        let auth = k.authorization("PUT", "/push/abc", b"{}", 1000);
        let ok = |m, p, a: &str, b: &[u8], now| k.verify(m, p, Some(a), b, now);
        assert_eq!(ok("PUT", "/push/abc", &auth, b"{}", 1000), Ok(()));
        assert_eq!(ok("PUT", "/push/abc", &auth, b"{}", 1060), Ok(()));
        assert_eq!(
            ok("PUT", "/push/abc", &auth, b"{}", 1061),
            Err(NodeAuthError::Stale)
        );
        assert_eq!(
            ok("PUT", "/push/abc", &auth, b"{}", 939),
            Err(NodeAuthError::Stale)
        );
        for (method, path, body) in [
            ("GET", "/push/abc", &b"{}"[..]),
            ("PUT", "/push/abd", b"{}"),
            ("PUT", "/push/abc", b"{ }"),
        ] {
            assert_eq!(
                ok(method, path, &auth, body, 1000),
                Err(NodeAuthError::BadSignature)
            );
        }
        let forged = auth.replace("t=1000", "t=1001");
        assert_eq!(
            ok("PUT", "/push/abc", &forged, b"{}", 1000),
            Err(NodeAuthError::BadSignature)
        );
    }

    #[test]
    fn any_configured_key_verifies_and_the_first_signs() {
        let old = keys(&["old"]);
        let rotated = keys(&["new", "old"]);
        let by_old = old.authorization("DELETE", "/notif/a/1", b"", 5);
        assert_eq!(
            rotated.verify("DELETE", "/notif/a/1", Some(&by_old), b"", 5),
            Ok(())
        );
        let by_new = rotated.authorization("DELETE", "/notif/a/1", b"", 5);
        assert_eq!(
            old.verify("DELETE", "/notif/a/1", Some(&by_new), b"", 5),
            Err(NodeAuthError::BadSignature)
        );
        assert!(!format!("{rotated:?}").contains("old"));
    }

    #[test]
    fn malformed_headers_are_refused() {
        let k = keys(&["k"]);
        let verify = |a: Option<&str>| k.verify("GET", "/user/a", a, b"", 5);
        assert_eq!(verify(None), Err(NodeAuthError::Missing));
        for bad in [
            "",
            "Bearer x",
            "AUTOPUSH-HMAC",
            "AUTOPUSH-HMAC t=5",
            "AUTOPUSH-HMAC t=5,sig=zz",
            "AUTOPUSH-HMAC t=x,sig=00",
            "AUTOPUSH-HMAC t=5,sig=00,extra=1",
        ] {
            assert!(verify(Some(bad)).is_err(), "{bad}");
        }
    }
}
