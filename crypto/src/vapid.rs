//! VAPID (RFC 8292), the sender's side: an ES256-signed JWT naming the push
//! service's origin (`aud`), an expiry (`exp`) and a contact (`sub`), sent
//! with the public key as `Authorization: vapid t=<jwt>, k=<key>`.

use std::time::{SystemTime, UNIX_EPOCH};

use p256::ecdsa::signature::Signer;
use p256::ecdsa::{Signature, SigningKey};
use rand_core::OsRng;
use serde_json::json;

use crate::b64;

/// How long a signed token stays valid (RFC 8292 allows at most 24 hours).
pub const VALIDITY_SECS: u64 = 12 * 3600;

/// An application server's VAPID key pair.
#[derive(Clone)]
pub struct VapidKey {
    key: SigningKey,
    public_key: Vec<u8>,
}

impl std::fmt::Debug for VapidKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VapidKey")
            .field("public_key", &b64(&self.public_key))
            .finish_non_exhaustive()
    }
}

/// The private key is not a P-256 scalar.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the VAPID private key is not a P-256 scalar")]
pub struct InvalidKey;

impl VapidKey {
    /// A new random key pair.
    pub fn generate() -> VapidKey {
        VapidKey::new(SigningKey::random(&mut OsRng))
    }

    /// The key pair of a raw 32-byte private scalar.
    pub fn from_bytes(private: &[u8]) -> Result<VapidKey, InvalidKey> {
        SigningKey::from_slice(private)
            .map(VapidKey::new)
            .map_err(|_| InvalidKey)
    }

    fn new(key: SigningKey) -> VapidKey {
        let public_key = key
            .verifying_key()
            .to_encoded_point(false)
            .as_bytes()
            .to_vec();
        VapidKey { key, public_key }
    }

    /// The raw 65-byte public key: a page's `applicationServerKey`, the `key`
    /// of a websocket `register`, `k=` in the header.
    pub fn public_key(&self) -> &[u8] {
        &self.public_key
    }

    /// The `Authorization` header value for pushes to endpoints at
    /// `audience` (an origin: `https://push.example.com`), signed now and
    /// valid for [`VALIDITY_SECS`].
    pub fn authorization(&self, audience: &str, subject: &str) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        self.authorization_until(audience, subject, now + VALIDITY_SECS)
    }

    /// [`VapidKey::authorization`] with a given expiry (unix seconds).
    pub fn authorization_until(&self, audience: &str, subject: &str, expires: u64) -> String {
        let header = b64(br#"{"typ":"JWT","alg":"ES256"}"#);
        let claims = b64(json!({"aud": audience, "exp": expires, "sub": subject})
            .to_string()
            .as_bytes());
        let signing_input = format!("{header}.{claims}");
        let signature: Signature = self.key.sign(signing_input.as_bytes());
        format!(
            "vapid t={signing_input}.{}, k={}",
            b64(&signature.to_bytes()),
            b64(&self.public_key)
        )
    }
}

#[cfg(test)]
mod tests {
    use p256::ecdsa::VerifyingKey;
    use p256::ecdsa::signature::Verifier;
    use serde_json::Value;

    use super::*;
    use crate::unb64;

    #[test]
    fn signs_a_token_its_public_key_verifies() {
        let key = VapidKey::generate();
        let header = key.authorization_until("https://push.example.com", "mailto:a@b.c", 1234);
        let (t, k) = header
            .strip_prefix("vapid t=")
            .and_then(|rest| rest.split_once(", k="))
            .unwrap();
        assert_eq!(unb64(k).unwrap(), key.public_key());
        let (signing_input, signature) = t.rsplit_once('.').unwrap();
        let verifier = VerifyingKey::from_sec1_bytes(key.public_key()).unwrap();
        let signature = Signature::from_slice(&unb64(signature).unwrap()).unwrap();
        verifier
            .verify(signing_input.as_bytes(), &signature)
            .unwrap();
        let (jose, claims) = signing_input.split_once('.').unwrap();
        let jose: Value = serde_json::from_slice(&unb64(jose).unwrap()).unwrap();
        assert_eq!(jose["alg"], "ES256");
        let claims: Value = serde_json::from_slice(&unb64(claims).unwrap()).unwrap();
        assert_eq!(
            claims,
            json!({"aud": "https://push.example.com", "exp": 1234, "sub": "mailto:a@b.c"})
        );
    }

    #[test]
    fn a_raw_scalar_gives_the_same_key() {
        let scalar = [0x42; 32];
        let a = VapidKey::from_bytes(&scalar).unwrap();
        assert_eq!(
            a.public_key(),
            VapidKey::from_bytes(&scalar).unwrap().public_key()
        );
        assert_eq!(VapidKey::from_bytes(&[0; 32]).unwrap_err(), InvalidKey);
    }
}
