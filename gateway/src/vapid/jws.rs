//! The cryptography: decoding the sender's public key and checking the ES256 signature
//! of a compact JWS (`base64url(header).base64url(payload).base64url(signature)`).
//!
//! Two encodings trip senders up, so both are pinned down here:
//!
//! * the key must be the raw 65-byte uncompressed point. A compressed (33-byte) point
//!   names the same key but hashes differently, and the hash is what v2 endpoints are
//!   bound to, so accepting it would make such endpoints unreachable in confusing ways;
//! * the signature must be JOSE's raw `r || s` (64 bytes), not the DER structure that
//!   general-purpose crypto libraries emit (RFC 7518 §3.4).
//!
//! The signature is checked with ring, about five times faster than the pure-Rust
//! `p256` here (see BENCHMARKS.md): senders such as pywebpush and web-push mint a new
//! token for every push, so this check runs once per message for them.
//!
//! Verification accepts high-S signatures: ECDSA has two valid `s` per signature and
//! JOSE does not require the low one, so popular signers (e.g. Python's
//! `cryptography`, behind py_vapid) emit either.

use base64::Engine;
use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use p256::ecdsa::{Signature, VerifyingKey};
use ring::signature::{ECDSA_P256_SHA256_FIXED, UnparsedPublicKey};
use serde_json::{Map, Value};

use super::VapidError;

const LENIENT: GeneralPurposeConfig =
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
/// base64url, padded or not. JWS forbids padding, but refusing it helps nobody.
const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, LENIENT);
/// Standard base64, padded or not: some senders copy keys from tools that use it.
const STANDARD: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, LENIENT);

const UNCOMPRESSED_POINT_LEN: usize = 65;
const JOSE_ES256_SIGNATURE_LEN: usize = 64;

/// Decodes `k` / `p256ecdsa` into the raw 65-byte point, checked to be a valid
/// P-256 public key. Standard or URL-safe base64, padded or not.
pub(super) fn decode_public_key(text: &str) -> Result<Vec<u8>, VapidError> {
    let raw = URL_SAFE
        .decode(text)
        .or_else(|_| STANDARD.decode(text))
        .map_err(|_| VapidError::InvalidKey("not base64"))?;
    if raw.len() != UNCOMPRESSED_POINT_LEN || raw.first() != Some(&0x04) {
        return Err(VapidError::InvalidKey(
            "not a 65-byte uncompressed P-256 point",
        ));
    }
    // The on-curve check happens here: a point off the curve would make ECDSA
    // verification meaningless (invalid-curve attacks).
    VerifyingKey::from_sec1_bytes(&raw)
        .map_err(|_| VapidError::InvalidKey("not a point on the P-256 curve"))?;
    Ok(raw)
}

/// Checks that `token` is an ES256 compact JWS signed by `key` (a point from
/// [`decode_public_key`]) and returns its claims.
///
/// All structural checks come before the signature: they are cheap, so garbage is
/// refused without spending an ECDSA verification on it, and the sender learns the
/// precise problem. The claims are returned, not judged: only after the signature holds
/// are they worth reading, and judging them is [`super::claims`]'s job.
pub(super) fn verify_es256(token: &str, key: &[u8]) -> Result<Map<String, Value>, VapidError> {
    let mut parts = token.split('.');
    let (Some(header_b64), Some(payload_b64), Some(signature_b64), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(VapidError::MalformedToken(
            "expected three dot-separated parts",
        ));
    };

    let header = decode_json_object(
        header_b64,
        "header is not base64url",
        "header is not a JSON object",
    )?;
    // Pinning `alg` closes the classic JWT holes (`none`, or HMAC keyed with the
    // public key): the algorithm is ours to choose, never the token's.
    if header.get("alg").and_then(Value::as_str) != Some("ES256") {
        return Err(VapidError::MalformedToken("header `alg` is not ES256"));
    }
    let claims = decode_json_object(
        payload_b64,
        "payload is not base64url",
        "payload is not a JSON object",
    )?;

    let signature_bytes = URL_SAFE
        .decode(signature_b64)
        .map_err(|_| VapidError::MalformedToken("signature is not base64url"))?;
    if signature_bytes.len() != JOSE_ES256_SIGNATURE_LEN {
        return Err(VapidError::SignatureFormat(signature_bytes.len()));
    }
    // Fails when r or s is zero or not below the group order: no valid signature has that.
    Signature::from_slice(&signature_bytes).map_err(|_| VapidError::BadSignature)?;

    // The signing input is the token up to the second dot, exactly as sent.
    let signing_input = &token[..header_b64.len() + 1 + payload_b64.len()];
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, key)
        .verify(signing_input.as_bytes(), &signature_bytes)
        .map_err(|_| VapidError::BadSignature)?;
    Ok(claims)
}

fn decode_json_object(
    part: &str,
    not_base64: &'static str,
    not_json: &'static str,
) -> Result<Map<String, Value>, VapidError> {
    let bytes = URL_SAFE
        .decode(part)
        .map_err(|_| VapidError::MalformedToken(not_base64))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(object)) => Ok(object),
        _ => Err(VapidError::MalformedToken(not_json)),
    }
}
