//! End-to-end checks of [`VapidVerifier`]: real keys, hand-made JWTs, every header
//! style, every refusal, and the cache.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use p256::ecdsa::signature::Signer;
use p256::ecdsa::{Signature, SigningKey};
use p256::elliptic_curve::rand_core::OsRng;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::claims::{CLOCK_SKEW_SECS, MAX_LIFETIME_SECS};
use super::*;

const AUD: &str = "http://localhost:8082";
const NOW: u64 = 1_700_000_000;

/// A verifier whose clock the test controls.
fn verifier(cache_capacity: usize) -> (VapidVerifier, Arc<AtomicU64>) {
    let now = Arc::new(AtomicU64::new(NOW));
    let clock = Arc::clone(&now);
    let verifier = VapidVerifier::with_clock(
        AUD.to_owned(),
        cache_capacity,
        Box::new(move || clock.load(Ordering::Relaxed)),
    );
    (verifier, now)
}

/// An application server with its VAPID key pair.
struct Sender {
    key: SigningKey,
}

impl Sender {
    fn new() -> Self {
        Self {
            key: SigningKey::random(&mut OsRng),
        }
    }

    fn public_key(&self) -> Vec<u8> {
        self.key
            .verifying_key()
            .to_encoded_point(false)
            .as_bytes()
            .to_vec()
    }

    /// `k` as senders normally send it: base64url, unpadded.
    fn k(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.public_key())
    }

    fn signing_input(header: &Value, claims: &Value) -> String {
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        )
    }

    fn signature(&self, signing_input: &str) -> Signature {
        self.key.sign(signing_input.as_bytes())
    }

    fn jwt_with_header(&self, header: &Value, claims: &Value) -> String {
        let input = Self::signing_input(header, claims);
        let signature = URL_SAFE_NO_PAD.encode(self.signature(&input).to_bytes());
        format!("{input}.{signature}")
    }

    fn jwt(&self, claims: &Value) -> String {
        self.jwt_with_header(&json!({"typ": "JWT", "alg": "ES256"}), claims)
    }

    fn vapid_header(&self, claims: &Value) -> String {
        format!("vapid t={}, k={}", self.jwt(claims), self.k())
    }
}

fn good_claims() -> Value {
    json!({"aud": AUD, "exp": NOW + 12 * 3600, "sub": "mailto:ops@example.com"})
}

fn verify_vapid(verifier: &VapidVerifier, header: &str) -> Result<Arc<VapidIdentity>, VapidError> {
    verifier
        .verify(Some(header), None)
        .map(|identity| identity.expect("credentials were sent"))
}

fn claims_result(claims: Value) -> Result<Arc<VapidIdentity>, VapidError> {
    let sender = Sender::new();
    verify_vapid(&verifier(0).0, &sender.vapid_header(&claims))
}

// --- accepted header styles -------------------------------------------------------

#[test]
fn rfc8292_vapid_scheme() {
    let sender = Sender::new();
    let identity =
        verify_vapid(&verifier(16).0, &sender.vapid_header(&good_claims())).expect("valid token");
    assert_eq!(identity.public_key, sender.public_key());
    assert_eq!(
        identity.key_hash,
        <[u8; 32]>::from(Sha256::digest(sender.public_key()))
    );
    assert_eq!(identity.sub.as_deref(), Some("mailto:ops@example.com"));
    assert_eq!(identity.exp, NOW + 12 * 3600);
}

#[test]
fn vapid_scheme_params_in_any_order_and_case() {
    let sender = Sender::new();
    let (verifier, _) = verifier(0);
    let jwt = sender.jwt(&good_claims());
    let k = sender.k();
    for header in [
        format!("vapid t={jwt},k={k}"),
        format!("VAPID k={k}, t={jwt}"),
    ] {
        assert!(verify_vapid(&verifier, &header).is_ok(), "{header}");
    }
}

#[test]
fn draft_webpush_and_bearer_schemes_with_crypto_key() {
    let sender = Sender::new();
    let (verifier, _) = verifier(0);
    let jwt = sender.jwt(&good_claims());
    let crypto_key = format!("p256ecdsa={}", sender.k());
    for scheme in ["WebPush", "Bearer"] {
        let authorization = format!("{scheme} {jwt}");
        let identity = verifier
            .verify(Some(&authorization), Some(&crypto_key))
            .expect("valid token")
            .expect("credentials were sent");
        assert_eq!(identity.public_key, sender.public_key(), "{scheme}");
    }
}

#[test]
fn key_in_padded_standard_base64() {
    // Pick a key whose standard encoding differs from the URL-safe one.
    let sender = std::iter::repeat_with(Sender::new)
        .find(|s| STANDARD.encode(s.public_key()).contains(['+', '/']))
        .expect("a random key soon has + or / in base64");
    let k = STANDARD.encode(sender.public_key());
    assert!(k.ends_with('='), "65 bytes encode with padding");
    let header = format!("vapid t={}, k={k}", sender.jwt(&good_claims()));
    assert!(verify_vapid(&verifier(0).0, &header).is_ok());
}

#[test]
fn crypto_key_with_several_parts_and_quotes() {
    let sender = Sender::new();
    let dh = URL_SAFE_NO_PAD.encode(Sender::new().public_key());
    let authorization = format!("WebPush {}", sender.jwt(&good_claims()));
    let k = sender.k();
    for crypto_key in [
        format!("dh={dh};p256ecdsa={k}"),
        format!("dh=\"{dh}\"; p256ecdsa=\"{k}\""),
        format!("keyid=\"p256dh\", dh={dh}, p256ecdsa={k}"),
    ] {
        let result = verifier(0)
            .0
            .verify(Some(&authorization), Some(&crypto_key));
        assert!(matches!(result, Ok(Some(_))), "{crypto_key}: {result:?}");
    }
}

#[test]
fn no_authorization_is_not_an_error() {
    let (verifier, _) = verifier(16);
    assert_eq!(verifier.verify(None, None).map(|i| i.is_some()), Ok(false));
    assert_eq!(
        verifier
            .verify(None, Some("p256ecdsa=AAAA"))
            .map(|i| i.is_some()),
        Ok(false)
    );
}

#[test]
fn odd_sub_is_accepted() {
    let claims = json!({"aud": AUD, "exp": NOW + 60, "sub": "ops@example.com"});
    assert_eq!(
        claims_result(claims).map(|i| i.sub.clone()),
        Ok(Some("ops@example.com".to_owned()))
    );
    let claims = json!({"aud": AUD, "exp": NOW + 60});
    assert_eq!(claims_result(claims).map(|i| i.sub.clone()), Ok(None));
}

#[test]
fn high_s_signature_is_accepted() {
    // Signers need not normalise s (JOSE does not require it); both forms are valid.
    let sender = Sender::new();
    let input = Sender::signing_input(&json!({"alg": "ES256"}), &good_claims());
    let signature = sender.signature(&input);
    let (r, s) = signature.split_scalars();
    let flipped = Signature::from_scalars(r.to_bytes(), (-*s).to_bytes()).expect("valid s");
    for signature in [signature, flipped] {
        let jwt = format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()));
        let header = format!("vapid t={jwt}, k={}", sender.k());
        assert!(verify_vapid(&verifier(0).0, &header).is_ok());
    }
}

// --- refused keys -------------------------------------------------------------------

#[test]
fn missing_key() {
    let sender = Sender::new();
    let jwt = sender.jwt(&good_claims());
    let (verifier, _) = verifier(0);
    assert_eq!(
        verify_vapid(&verifier, &format!("vapid t={jwt}")).err(),
        Some(VapidError::MissingKey)
    );
    assert_eq!(
        verifier
            .verify(Some(&format!("WebPush {jwt}")), Some("dh=abc"))
            .err(),
        Some(VapidError::MissingKey)
    );
}

#[test]
fn compressed_key_is_refused() {
    let sender = Sender::new();
    let compressed = sender.key.verifying_key().to_encoded_point(true);
    assert_eq!(compressed.len(), 33);
    let header = format!(
        "vapid t={}, k={}",
        sender.jwt(&good_claims()),
        URL_SAFE_NO_PAD.encode(compressed.as_bytes())
    );
    assert!(matches!(
        verify_vapid(&verifier(0).0, &header).err(),
        Some(VapidError::InvalidKey(_))
    ));
}

#[test]
fn point_not_on_the_curve_is_refused() {
    let sender = Sender::new();
    let mut bogus = vec![0x04];
    bogus.extend_from_slice(&[0x01; 64]);
    let header = format!(
        "vapid t={}, k={}",
        sender.jwt(&good_claims()),
        URL_SAFE_NO_PAD.encode(bogus)
    );
    assert_eq!(
        verify_vapid(&verifier(0).0, &header).err(),
        Some(VapidError::InvalidKey("not a point on the P-256 curve"))
    );
}

#[test]
fn key_that_is_not_base64_is_refused() {
    let sender = Sender::new();
    let header = format!("vapid t={}, k=not*base64!", sender.jwt(&good_claims()));
    assert_eq!(
        verify_vapid(&verifier(0).0, &header).err(),
        Some(VapidError::InvalidKey("not base64"))
    );
}

// --- refused tokens -----------------------------------------------------------------

fn with_token(sender: &Sender, token: &str) -> Result<(), VapidError> {
    verify_vapid(
        &verifier(0).0,
        &format!("vapid t={token}, k={}", sender.k()),
    )
    .map(|_| ())
}

#[test]
fn malformed_tokens() {
    let sender = Sender::new();
    let jwt = sender.jwt(&good_claims());
    let b64 = |value: &Value| URL_SAFE_NO_PAD.encode(value.to_string());
    let signature = jwt.rsplit('.').next().unwrap_or_default();
    let cases = [
        ("two parts".to_owned(), "expected three dot-separated parts"),
        (format!("{jwt}.extra"), "expected three dot-separated parts"),
        (
            format!("!!.{}.{signature}", b64(&good_claims())),
            "header is not base64url",
        ),
        (
            format!(
                "{}.{}.{signature}",
                URL_SAFE_NO_PAD.encode("not json"),
                b64(&good_claims())
            ),
            "header is not a JSON object",
        ),
        (
            format!("{}.!!.{signature}", b64(&json!({"alg": "ES256"}))),
            "payload is not base64url",
        ),
        (
            format!(
                "{}.{}.{signature}",
                b64(&json!({"alg": "ES256"})),
                b64(&json!([1]))
            ),
            "payload is not a JSON object",
        ),
        (
            format!(
                "{}.{}.!!",
                b64(&json!({"alg": "ES256"})),
                b64(&good_claims())
            ),
            "signature is not base64url",
        ),
    ];
    for (token, reason) in cases {
        assert_eq!(
            with_token(&sender, &token),
            Err(VapidError::MalformedToken(reason)),
            "{token}"
        );
    }
}

#[test]
fn wrong_alg_is_refused_even_when_signed() {
    let sender = Sender::new();
    for header in [
        json!({"alg": "HS256"}),
        json!({"alg": "none"}),
        json!({"typ": "JWT"}),
    ] {
        let token = sender.jwt_with_header(&header, &good_claims());
        assert_eq!(
            with_token(&sender, &token),
            Err(VapidError::MalformedToken("header `alg` is not ES256"))
        );
    }
}

#[test]
fn truncated_signature() {
    let sender = Sender::new();
    let input = Sender::signing_input(&json!({"alg": "ES256"}), &good_claims());
    let signature = sender.signature(&input).to_bytes();
    let token = format!("{input}.{}", URL_SAFE_NO_PAD.encode(&signature[..63]));
    assert_eq!(
        with_token(&sender, &token),
        Err(VapidError::SignatureFormat(63))
    );
}

#[test]
fn der_signature_is_refused() {
    let sender = Sender::new();
    let input = Sender::signing_input(&json!({"alg": "ES256"}), &good_claims());
    let der = sender.signature(&input).to_der();
    let token = format!("{input}.{}", URL_SAFE_NO_PAD.encode(der.as_bytes()));
    assert_eq!(
        with_token(&sender, &token),
        Err(VapidError::SignatureFormat(der.as_bytes().len()))
    );
}

#[test]
fn signature_by_another_key_than_k() {
    let (signer, claimed) = (Sender::new(), Sender::new());
    let header = format!("vapid t={}, k={}", signer.jwt(&good_claims()), claimed.k());
    assert_eq!(
        verify_vapid(&verifier(0).0, &header).err(),
        Some(VapidError::BadSignature)
    );
}

#[test]
fn tampered_claims_break_the_signature() {
    let sender = Sender::new();
    let jwt = sender.jwt(&good_claims());
    let mut parts: Vec<&str> = jwt.split('.').collect();
    let forged = URL_SAFE_NO_PAD.encode(json!({"aud": AUD, "exp": NOW + 86_000}).to_string());
    parts[1] = &forged;
    assert_eq!(
        with_token(&sender, &parts.join(".")),
        Err(VapidError::BadSignature)
    );
}

#[test]
fn zero_signature_is_a_bad_signature() {
    let sender = Sender::new();
    let input = Sender::signing_input(&json!({"alg": "ES256"}), &good_claims());
    let token = format!("{input}.{}", URL_SAFE_NO_PAD.encode([0u8; 64]));
    assert_eq!(with_token(&sender, &token), Err(VapidError::BadSignature));
}

#[test]
fn unknown_scheme() {
    let (verifier, _) = verifier(0);
    assert_eq!(
        verifier
            .verify(Some("Basic dXNlcjpwYXNz"), None)
            .map(|i| i.is_some()),
        Err(VapidError::UnknownScheme)
    );
}

// --- refused claims -----------------------------------------------------------------

#[test]
fn exp_in_the_past() {
    let claims = json!({"aud": AUD, "exp": NOW - CLOCK_SKEW_SECS - 1});
    assert_eq!(claims_result(claims).map(|_| ()), Err(VapidError::Expired));
    // Within the skew allowance it is still accepted.
    let claims = json!({"aud": AUD, "exp": NOW - 30});
    assert!(claims_result(claims).is_ok());
}

#[test]
fn exp_more_than_24h_ahead() {
    let claims = json!({"aud": AUD, "exp": NOW + MAX_LIFETIME_SECS + CLOCK_SKEW_SECS + 1});
    assert_eq!(
        claims_result(claims).map(|_| ()),
        Err(VapidError::ExpTooFar)
    );
    let claims = json!({"aud": AUD, "exp": NOW + MAX_LIFETIME_SECS});
    assert!(claims_result(claims).is_ok());
}

#[test]
fn exp_missing_or_not_a_number() {
    let claims = json!({"aud": AUD, "exp": (NOW + 60).to_string()});
    assert_eq!(
        claims_result(claims).map(|_| ()),
        Err(VapidError::InvalidExp)
    );
    let claims = json!({"aud": AUD});
    assert_eq!(
        claims_result(claims).map(|_| ()),
        Err(VapidError::MissingExp)
    );
}

#[test]
fn aud_missing_or_not_exactly_our_origin() {
    let claims = json!({"exp": NOW + 60});
    assert_eq!(
        claims_result(claims).map(|_| ()),
        Err(VapidError::MissingAud)
    );
    for aud in [
        "http://localhost:8082/wpush/v2/abc",
        "http://localhost:8082/",
        "http://localhost:8083",
        "https://localhost:8082",
        "http://localhost",
    ] {
        let claims = json!({"aud": aud, "exp": NOW + 60});
        assert_eq!(
            claims_result(claims).map(|_| ()),
            Err(VapidError::WrongAud {
                expected: AUD.to_owned()
            }),
            "{aud}"
        );
    }
}

#[test]
fn configured_audience_trailing_slash_is_ignored() {
    let sender = Sender::new();
    let verifier = VapidVerifier::new(format!("{AUD}/"), 0);
    let claims = json!({"aud": AUD, "exp": system_now() + 60});
    assert!(verify_vapid(&verifier, &sender.vapid_header(&claims)).is_ok());
}

#[test]
fn error_messages_name_the_check() {
    assert!(VapidError::Expired.to_string().contains("expired"));
    assert!(VapidError::ExpTooFar.to_string().contains("24 hours"));
    assert!(VapidError::MissingAud.to_string().contains("aud"));
    assert!(VapidError::SignatureFormat(72).to_string().contains("DER"));
    assert!(
        VapidError::WrongAud {
            expected: AUD.to_owned()
        }
        .to_string()
        .contains(AUD)
    );
}

// --- the cache ----------------------------------------------------------------------

fn cache_of(verifier: &VapidVerifier) -> &VerifiedCache {
    verifier.cache.as_ref().expect("cache enabled")
}

#[test]
fn repeated_token_is_a_cache_hit() {
    let sender = Sender::new();
    let (verifier, _) = verifier(16);
    let header = sender.vapid_header(&good_claims());
    let first = verify_vapid(&verifier, &header).expect("valid");
    assert_eq!(cache_of(&verifier).hits(), 0);
    let second = verify_vapid(&verifier, &header).expect("valid");
    assert_eq!(cache_of(&verifier).hits(), 1);
    assert!(Arc::ptr_eq(&first, &second));
}

#[test]
fn expired_cached_token_is_rejected_and_dropped() {
    let sender = Sender::new();
    let (verifier, now) = verifier(16);
    let exp = NOW + 3600;
    let header = sender.vapid_header(&json!({"aud": AUD, "exp": exp}));
    assert!(verify_vapid(&verifier, &header).is_ok());
    now.store(exp + CLOCK_SKEW_SECS + 1, Ordering::Relaxed);
    assert_eq!(
        verify_vapid(&verifier, &header).map(|_| ()),
        Err(VapidError::Expired)
    );
    assert_eq!(
        cache_of(&verifier).hits(),
        1,
        "the refusal came from the cache"
    );
    assert_eq!(cache_of(&verifier).len(), 0);
}

#[test]
fn cached_token_with_another_key_is_not_a_hit() {
    let (sender, other) = (Sender::new(), Sender::new());
    let (verifier, _) = verifier(16);
    let jwt = sender.jwt(&good_claims());
    assert!(verify_vapid(&verifier, &format!("vapid t={jwt}, k={}", sender.k())).is_ok());
    assert_eq!(
        verify_vapid(&verifier, &format!("vapid t={jwt}, k={}", other.k())).err(),
        Some(VapidError::BadSignature)
    );
    assert_eq!(cache_of(&verifier).hits(), 0);
}

#[test]
fn failures_are_not_cached() {
    let sender = Sender::new();
    let (verifier, _) = verifier(16);
    let header = sender.vapid_header(&json!({"aud": "http://elsewhere", "exp": NOW + 60}));
    for _ in 0..2 {
        assert!(verify_vapid(&verifier, &header).is_err());
    }
    assert_eq!(cache_of(&verifier).len(), 0);
}

#[test]
fn cache_stays_bounded() {
    let sender = Sender::new();
    let (verifier, _) = verifier(3);
    for i in 0..10 {
        let header = sender.vapid_header(&json!({"aud": AUD, "exp": NOW + 60 + i}));
        assert!(verify_vapid(&verifier, &header).is_ok());
    }
    assert_eq!(cache_of(&verifier).len(), 3);
}

#[test]
fn without_cache_never_caches() {
    let sender = Sender::new();
    let verifier = VapidVerifier::without_cache(AUD.to_owned());
    assert!(verifier.cache.is_none());
    let claims = json!({"aud": AUD, "exp": system_now() + 60});
    assert!(verify_vapid(&verifier, &sender.vapid_header(&claims)).is_ok());
}

#[test]
fn key_hash_matching() {
    let sender = Sender::new();
    let identity =
        verify_vapid(&verifier(0).0, &sender.vapid_header(&good_claims())).expect("valid");
    let hash = Sha256::digest(sender.public_key());
    let key_hash = &identity.key_hash;
    assert!(key_hash_matches(key_hash, &hash));
    assert!(!key_hash_matches(key_hash, &Sha256::digest(b"another key")));
    // A message id's prefix; nothing shorter, nothing longer.
    assert!(key_hash_matches(key_hash, &hash[..16]));
    assert!(!key_hash_matches(key_hash, &hash[..15]));
    assert!(!key_hash_matches(key_hash, &[]));
    let mut longer = hash.to_vec();
    longer.push(0);
    assert!(!key_hash_matches(key_hash, &longer));
}

/// Only the pinned key may sign, and another is refused before its
/// signature is checked: a garbage signature by another key is `NotPinned`,
/// not `BadSignature`, and a cached token by another key is refused too.
#[test]
fn another_key_than_the_pinned_one_is_refused_unverified() {
    let (pinned, other) = (Sender::new(), Sender::new());
    let hash = Sha256::digest(pinned.public_key());
    let (verifier, _) = verifier(16);
    let verify = |header: &str| verifier.verify_pinned(Some(header), None, Some(&hash));
    assert!(verify(&pinned.vapid_header(&good_claims())).is_ok_and(|i| i.is_some()));
    let header = other.vapid_header(&good_claims());
    assert_eq!(verify(&header).unwrap_err(), VapidError::NotPinned);
    let (token, key) = header.split_once(", k=").unwrap();
    let forged = format!("{}AAAA, k={key}", &token[..token.len() - 4]);
    assert_eq!(verify(&forged).unwrap_err(), VapidError::NotPinned);
    // Verified unpinned (so cached), then presented to a pinned check.
    assert!(verifier.verify(Some(&header), None).is_ok());
    assert_eq!(verify(&header).unwrap_err(), VapidError::NotPinned);
    assert!(matches!(
        verifier.verify_pinned(None, None, Some(&hash)),
        Ok(None)
    ));
}

#[test]
fn verifier_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<VapidVerifier>();
    assert_send_sync::<Arc<VapidIdentity>>();
}
