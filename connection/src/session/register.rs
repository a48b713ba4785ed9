//! `register`: subscribe a channel and hand out its push endpoint.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use uuid::Uuid;

use super::{Flow, Session};
use crate::protocol::ServerMessage;

/// Channel ids are lowercase dashed UUIDs, exactly as Firefox makes them.
pub(super) fn parse_channel_id(channel_id: &str) -> Option<Uuid> {
    let uuid = Uuid::parse_str(channel_id).ok()?;
    (uuid.hyphenated().to_string() == channel_id).then_some(uuid)
}

/// A VAPID public key: an uncompressed P-256 point (65 bytes, leading 0x04)
/// in base64url or base64, padded or not.
pub(super) fn decode_vapid_key(key: &str) -> Option<Vec<u8>> {
    let trimmed = key.trim().trim_end_matches('=');
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(trimmed)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(trimmed))
        .or_else(|_| URL_SAFE.decode(key.trim()))
        .or_else(|_| STANDARD.decode(key.trim()))
        .ok()?;
    (bytes.len() == 65 && bytes[0] == 4).then_some(bytes)
}

impl Session {
    pub(super) async fn register(&mut self, channel_id: &str, key: Option<&str>) -> Flow {
        let refuse = |status: u16, reason: &str| ServerMessage::Register {
            channel_id: channel_id.to_owned(),
            status,
            push_endpoint: None,
            reason: Some(reason.to_owned()),
        };
        let Some(chid) = parse_channel_id(channel_id) else {
            return self
                .send(&refuse(401, "channelID must be a lowercase dashed UUID"))
                .await;
        };
        let key = match key.map(decode_vapid_key) {
            Some(None) => {
                return self
                    .send(&refuse(
                        400,
                        "key must be an uncompressed P-256 public key in base64url",
                    ))
                    .await;
            }
            Some(Some(key)) => Some(key),
            None => None,
        };
        if let Err(e) = self.ctx.storage.add_channel(&self.uaid, &chid).await {
            return self.send(&refuse(500, &e.to_string())).await;
        }
        let endpoint = self
            .ctx
            .crypto
            .make_endpoint(&self.uaid, &chid, key.as_deref());
        self.send(&ServerMessage::Register {
            channel_id: channel_id.to_owned(),
            status: 200,
            push_endpoint: Some(endpoint),
            reason: None,
        })
        .await
    }
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
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key),
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
