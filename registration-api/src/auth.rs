//! Registration secrets: `HMAC-SHA256(server key, uaid)`, hex.
//!
//! Nothing is stored: the secret is recomputed and compared in constant
//! time. Several server keys may be configured for rotation; the first
//! signs new registrations, any verifies.

use autopush_common::{ApiError, ApiResult};
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use uuid::Uuid;

pub struct SecretKeys {
    keys: Vec<Vec<u8>>,
}

impl SecretKeys {
    pub fn new(keys: &[String]) -> Result<Self, String> {
        if keys.is_empty() {
            return Err("no registration auth key given".into());
        }
        Ok(SecretKeys {
            keys: keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
        })
    }

    fn sign(key: &[u8], uaid: &Uuid) -> String {
        // HMAC takes keys of any length.
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
        mac.update(uaid.simple().to_string().as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The secret a client uses for `uaid`.
    pub fn secret(&self, uaid: &Uuid) -> String {
        Self::sign(&self.keys[0], uaid)
    }

    /// Check `Authorization: Bearer {secret}` (401/109 otherwise).
    pub fn check(&self, uaid: &Uuid, headers: &HeaderMap) -> ApiResult<()> {
        let header = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                ApiError::InvalidAuthentication("missing Authorization: Bearer {secret}".into())
            })?;
        let (scheme, secret) = header.trim().split_once(' ').unwrap_or((header, ""));
        if !(scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("webpush")) {
            return Err(ApiError::InvalidAuthentication(
                "use the Bearer scheme".into(),
            ));
        }
        let secret = secret.trim().as_bytes();
        let valid = self.keys.iter().fold(false, |found, key| {
            found | bool::from(Self::sign(key, uaid).as_bytes().ct_eq(secret))
        });
        if valid {
            Ok(())
        } else {
            Err(ApiError::InvalidAuthentication(
                "wrong secret for this UAID".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(secret: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", format!("Bearer {secret}").parse().unwrap());
        h
    }

    #[test]
    fn secrets_verify_under_any_key_and_only_for_their_uaid() {
        let old = SecretKeys::new(&["old".into()]).unwrap();
        let rotated = SecretKeys::new(&["new".into(), "old".into()]).unwrap();
        let uaid = Uuid::new_v4();
        let secret = old.secret(&uaid);
        assert!(rotated.check(&uaid, &bearer(&secret)).is_ok());
        assert_ne!(rotated.secret(&uaid), secret);
        assert!(old.check(&Uuid::new_v4(), &bearer(&secret)).is_err());
        assert!(old.check(&uaid, &bearer("00")).is_err());
        assert!(old.check(&uaid, &HeaderMap::new()).is_err());
    }
}
