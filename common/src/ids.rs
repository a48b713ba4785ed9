//! Parsing what clients send as identifiers and keys, and naming UAIDs in logs.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// How logs name a user: a UAID is a credential (a `hello` with it takes
/// over the user's connection), so logs carry the first 8 hex digits of
/// SHA-256 of its 32-digit form instead. An operator holding a UAID finds
/// its lines with `printf %s UAID | sha256sum | cut -c1-8`.
pub fn uaid_tag(uaid: &Uuid) -> UaidTag {
    UaidTag(*uaid)
}

/// A UAID as logs show it; hashed only when the log line is written.
#[derive(Clone, Copy)]
pub struct UaidTag(Uuid);

impl fmt::Display for UaidTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = Uuid::encode_buffer();
        let digest = Sha256::digest(self.0.simple().encode_lower(&mut buf).as_bytes());
        digest[..4].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for UaidTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `bytes` as lowercase hex digits.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes hex digits `s` spell; `None` if it is not an even count of them.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// Channel ids are lowercase dashed UUIDs, exactly as Firefox makes them.
pub fn parse_channel_id(channel_id: &str) -> Option<Uuid> {
    let uuid = Uuid::parse_str(channel_id).ok()?;
    (uuid.hyphenated().to_string() == channel_id).then_some(uuid)
}

/// A VAPID public key: an uncompressed P-256 point (65 bytes, leading 0x04)
/// in base64url or base64, padded or not.
pub fn decode_vapid_key(key: &str) -> Option<Vec<u8>> {
    let key = key.trim();
    let unpadded = key.trim_end_matches('=');
    let bytes = URL_SAFE_NO_PAD
        .decode(unpadded)
        .or_else(|_| STANDARD_NO_PAD.decode(unpadded))
        .or_else(|_| URL_SAFE.decode(key))
        .or_else(|_| STANDARD.decode(key))
        .ok()?;
    (bytes.len() == 65 && bytes[0] == 4).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uaid_tags_are_a_short_hash() {
        let uaid = Uuid::parse_str("0123456789abcdef0123456789abcdef").unwrap();
        // printf %s 0123456789abcdef0123456789abcdef | sha256sum | cut -c1-8
        assert_eq!(uaid_tag(&uaid).to_string(), "3eb1bd43");
        assert_eq!(
            format!("{:?}", uaid_tag(&uaid)),
            uaid_tag(&uaid).to_string()
        );
    }

    #[test]
    fn channel_ids_must_be_lowercase_dashed() {
        assert!(parse_channel_id("6f8b3e1e-3d5a-4c4b-9a57-0f1d8c9b2a11").is_some());
        assert!(parse_channel_id("6F8B3E1E-3D5A-4C4B-9A57-0F1D8C9B2A11").is_none());
        assert!(parse_channel_id("6f8b3e1e3d5a4c4b9a570f1d8c9b2a11").is_none());
        assert!(parse_channel_id("not-a-uuid").is_none());
    }

    #[test]
    fn vapid_keys_in_any_base64() {
        let key = [4u8; 65];
        for encoded in [
            URL_SAFE_NO_PAD.encode(key),
            URL_SAFE.encode(key),
            STANDARD.encode(key),
        ] {
            assert_eq!(
                decode_vapid_key(&encoded).as_deref(),
                Some(&key[..]),
                "{encoded}"
            );
        }
        assert!(decode_vapid_key("AAAA").is_none());
        assert!(decode_vapid_key(&URL_SAFE.encode([3u8; 65])).is_none());
    }
}
