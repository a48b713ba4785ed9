//! Parsing what clients send as identifiers and keys.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use uuid::Uuid;

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
