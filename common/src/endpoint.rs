//! Endpoint tokens and message ids: Fernet-encrypted so the URL an application
//! server holds reveals neither the UAID nor the channel.
//!
//! Several keys may be configured for rotation: the first encrypts, any
//! decrypts. Tokens are URL-safe base64 with the `=` padding stripped.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use fernet::{Fernet, MultiFernet};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::receipt::MessageState;
use crate::{ApiError, ApiResult};

/// What an endpoint token says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenInfo {
    pub uaid: Uuid,
    pub channel_id: Uuid,
    /// SHA-256 of the VAPID key the subscription is restricted to (v2 only).
    pub key_hash: Option<[u8; 32]>,
}

/// What a message id says: enough to find the stored message again, and
/// to answer for it (its receipt).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MessageIdInfo {
    pub uaid: Uuid,
    pub channel_id: Uuid,
    pub topic: Option<String>,
    pub sortkey_timestamp: Option<u64>,
    /// The first bytes of the subscription's VAPID key hash (v2 only): the
    /// receipt is for the holder of that key alone.
    pub key_hash: Option<[u8; KEY_HASH_IN_ID]>,
    /// A final state reached before the sender got the id (bridged,
    /// dropped), with its unix seconds: sealed into the id, so its receipt
    /// costs no storage.
    pub settled: Option<(MessageState, u64)>,
    /// With a sealed state that is not final (`sent`: its connection node
    /// keeps the copy, see `autopush_webpush::node_journal`): the tag
    /// ([`crate::notification::version_tag`]) of the id its client acks,
    /// under which storage may hold its row or receipt later.
    pub tag: Option<[u8; 8]>,
    /// With `tag`: the connection node that keeps the copy, which answers
    /// for its receipt while it does.
    pub node: Option<String>,
}

/// Bytes of the VAPID key hash a message id carries: finding another key
/// with the same prefix is as hard as guessing a 128-bit secret.
pub const KEY_HASH_IN_ID: usize = 16;

/// The prefix of `hash` a message id carries.
pub fn key_hash_in_id(hash: &[u8; 32]) -> [u8; KEY_HASH_IN_ID] {
    let mut prefix = [0; KEY_HASH_IN_ID];
    prefix.copy_from_slice(&hash[..KEY_HASH_IN_ID]);
    prefix
}

impl MessageIdInfo {
    pub fn sort_key(&self) -> String {
        crate::notification::sort_key(
            &self.channel_id,
            self.topic.as_deref(),
            self.sortkey_timestamp,
        )
    }
}

/// Makes and reads endpoint URLs and message ids.
pub struct EndpointCrypto {
    fernet: MultiFernet,
    endpoint_url: String,
}

/// Parse a key list: one key, or several separated by commas, optionally in
/// brackets (`[k1,k2]`, as autopush's `CRYPTO_KEY` allows).
pub fn parse_key_list(keys: &str) -> Vec<String> {
    keys.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(|k| k.trim().trim_matches(|c| c == '"' || c == '\'').to_owned())
        .filter(|k| !k.is_empty())
        .collect()
}

/// A new random key, as `autopush keygen` prints it.
pub fn generate_key() -> String {
    Fernet::generate_key()
}

/// SHA-256 of a raw VAPID public key: what a v2 token carries.
pub fn key_hash(public_key: &[u8]) -> [u8; 32] {
    Sha256::digest(public_key).into()
}

impl EndpointCrypto {
    /// `keys`: base64url 32-byte Fernet keys, the first used to encrypt.
    /// `endpoint_url`: the public base URL, e.g. `http://localhost:8082`.
    pub fn new(keys: &[String], endpoint_url: &str) -> Result<Self, String> {
        if keys.is_empty() {
            return Err("no crypto key given".into());
        }
        let fernets = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                Fernet::new(k).ok_or_else(|| {
                    format!("crypto key #{} is not a valid key (32 bytes, base64url; see `autopush keygen`)", i + 1)
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(EndpointCrypto {
            fernet: MultiFernet::new(fernets),
            endpoint_url: endpoint_url.trim_end_matches('/').to_owned(),
        })
    }

    pub fn endpoint_url(&self) -> &str {
        &self.endpoint_url
    }

    /// The push endpoint for a subscription; bound to `vapid_key` (raw public
    /// key bytes) when given, which makes it a v2 endpoint.
    pub fn make_endpoint(
        &self,
        uaid: &Uuid,
        channel_id: &Uuid,
        vapid_key: Option<&[u8]>,
    ) -> String {
        let mut plain = Vec::with_capacity(64);
        plain.extend_from_slice(uaid.as_bytes());
        plain.extend_from_slice(channel_id.as_bytes());
        let version = match vapid_key {
            Some(key) => {
                plain.extend_from_slice(&key_hash(key));
                "v2"
            }
            None => "v1",
        };
        let token = self.fernet.encrypt(&plain);
        format!(
            "{}/wpush/{version}/{}",
            self.endpoint_url,
            token.trim_end_matches('=')
        )
    }

    /// Read a `/wpush/{version}/{token}` token. Anything malformed is 404/102.
    pub fn parse_token(&self, version: &str, token: &str) -> ApiResult<TokenInfo> {
        let plain = self.decrypt(token).ok_or(ApiError::InvalidToken)?;
        let ids = |b: &[u8]| -> Option<(Uuid, Uuid)> {
            Some((
                Uuid::from_slice(b.get(..16)?).ok()?,
                Uuid::from_slice(b.get(16..32)?).ok()?,
            ))
        };
        match (version, plain.len()) {
            ("v1", 32) => {
                let (uaid, channel_id) = ids(&plain).ok_or(ApiError::InvalidToken)?;
                Ok(TokenInfo {
                    uaid,
                    channel_id,
                    key_hash: None,
                })
            }
            ("v2", 64) => {
                let (uaid, channel_id) = ids(&plain).ok_or(ApiError::InvalidToken)?;
                let mut hash = [0u8; 32];
                hash.copy_from_slice(&plain[32..]);
                Ok(TokenInfo {
                    uaid,
                    channel_id,
                    key_hash: Some(hash),
                })
            }
            _ => Err(ApiError::InvalidToken),
        }
    }

    /// A message id for a notification about to be routed. The plain text
    /// is `01:{uaid}:{chid}:{topic}` or `02:{uaid}:{chid}:{timestamp}`, then
    /// `;k{key hash prefix}` for a v2 subscription and `;s{state}@{secs}`
    /// for a sealed final state (ids from before receipts have neither);
    /// a `sent` one kept by a connection node adds `;t{tag}` and
    /// `;n{node id}`.
    pub fn make_message_id(&self, info: &MessageIdInfo) -> String {
        let mut plain = match (&info.topic, info.sortkey_timestamp) {
            (Some(topic), _) => format!("01:{}:{}:{}", info.uaid.simple(), info.channel_id, topic),
            (None, ts) => format!(
                "02:{}:{}:{}",
                info.uaid.simple(),
                info.channel_id,
                ts.unwrap_or(0)
            ),
        };
        if let Some(hash) = &info.key_hash {
            plain += &format!(";k{}", URL_SAFE_NO_PAD.encode(hash));
        }
        if let Some((state, at)) = info.settled {
            plain += &format!(";s{}@{at}", state.as_str());
        }
        if let Some(tag) = &info.tag {
            plain += &format!(";t{}", URL_SAFE_NO_PAD.encode(tag));
        }
        if let Some(node) = &info.node {
            plain += &format!(";n{node}");
        }
        self.fernet
            .encrypt(plain.as_bytes())
            .trim_end_matches('=')
            .to_owned()
    }

    /// Read a message id from `DELETE /m/{id}`.
    pub fn parse_message_id(&self, id: &str) -> ApiResult<MessageIdInfo> {
        let plain = self.decrypt(id).ok_or(ApiError::InvalidMessageId)?;
        let plain = String::from_utf8(plain).map_err(|_| ApiError::InvalidMessageId)?;
        let mut fields = plain.split(';');
        let mut parts = fields.next().unwrap_or_default().splitn(4, ':');
        let (Some(kind), Some(uaid), Some(chid), Some(rest)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(ApiError::InvalidMessageId);
        };
        let uaid = Uuid::parse_str(uaid).map_err(|_| ApiError::InvalidMessageId)?;
        let channel_id = Uuid::parse_str(chid).map_err(|_| ApiError::InvalidMessageId)?;
        let (topic, sortkey_timestamp) = match kind {
            "01" => (Some(rest.to_owned()), None),
            "02" => (
                None,
                Some(rest.parse().map_err(|_| ApiError::InvalidMessageId)?),
            ),
            _ => return Err(ApiError::InvalidMessageId),
        };
        let (mut key_hash, mut settled, mut tag, mut node) = (None, None, None, None);
        for field in fields {
            if let Some(hash) = field.strip_prefix('k') {
                let hash = URL_SAFE_NO_PAD.decode(hash).ok();
                key_hash = Some(
                    hash.and_then(|h| <[u8; KEY_HASH_IN_ID]>::try_from(h).ok())
                        .ok_or(ApiError::InvalidMessageId)?,
                );
            } else if let Some((state, at)) =
                field.strip_prefix('s').and_then(|s| s.split_once('@'))
            {
                let state = MessageState::parse(state).ok_or(ApiError::InvalidMessageId)?;
                settled = Some((state, at.parse().map_err(|_| ApiError::InvalidMessageId)?));
            } else if let Some(id) = field.strip_prefix('n') {
                node = Some(id.to_owned());
            } else if let Some(encoded) = field.strip_prefix('t') {
                let decoded = URL_SAFE_NO_PAD.decode(encoded).ok();
                tag = Some(
                    decoded
                        .and_then(|t| <[u8; 8]>::try_from(t).ok())
                        .ok_or(ApiError::InvalidMessageId)?,
                );
            } else {
                return Err(ApiError::InvalidMessageId);
            }
        }
        Ok(MessageIdInfo {
            uaid,
            channel_id,
            topic,
            sortkey_timestamp,
            key_hash,
            settled,
            tag,
            node,
        })
    }

    fn decrypt(&self, token: &str) -> Option<Vec<u8>> {
        // Tokens travel without padding; Fernet wants it back. Reject early
        // anything that is not base64url so garbage never reaches the cipher.
        let raw = URL_SAFE_NO_PAD.decode(token.trim_end_matches('=')).ok()?;
        let padded = base64::engine::general_purpose::URL_SAFE.encode(raw);
        self.fernet.decrypt(&padded).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crypto(keys: &[String]) -> EndpointCrypto {
        EndpointCrypto::new(keys, "http://localhost:8082/").unwrap()
    }

    #[test]
    fn v1_and_v2_endpoints_round_trip() {
        let c = crypto(&[generate_key()]);
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let url = c.make_endpoint(&uaid, &chid, None);
        let token = url.strip_prefix("http://localhost:8082/wpush/v1/").unwrap();
        assert!(!token.contains('='));
        assert_eq!(
            c.parse_token("v1", token).unwrap(),
            TokenInfo {
                uaid,
                channel_id: chid,
                key_hash: None
            }
        );
        assert_eq!(c.parse_token("v2", token), Err(ApiError::InvalidToken));

        let key = [4u8; 65];
        let url = c.make_endpoint(&uaid, &chid, Some(&key));
        let token = url.strip_prefix("http://localhost:8082/wpush/v2/").unwrap();
        assert_eq!(
            c.parse_token("v2", token).unwrap().key_hash,
            Some(key_hash(&key))
        );
    }

    #[test]
    fn any_configured_key_decrypts_but_the_first_encrypts() {
        let (old, new) = (generate_key(), generate_key());
        let before = crypto(std::slice::from_ref(&old));
        let after = crypto(&[new.clone(), old]);
        let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
        let url = before.make_endpoint(&uaid, &chid, None);
        let token = url.rsplit('/').next().unwrap();
        assert!(after.parse_token("v1", token).is_ok());
        let fresh = after.make_endpoint(&uaid, &chid, None);
        let fresh_token = fresh.rsplit('/').next().unwrap();
        assert!(crypto(&[new]).parse_token("v1", fresh_token).is_ok());
        assert_eq!(
            before.parse_token("v1", fresh_token),
            Err(ApiError::InvalidToken)
        );
    }

    #[test]
    fn garbage_tokens_are_invalid() {
        let c = crypto(&[generate_key()]);
        for t in ["", "abc", "!!!!", "gAAAAABk"] {
            assert_eq!(c.parse_token("v1", t), Err(ApiError::InvalidToken));
        }
    }

    #[test]
    fn message_ids_round_trip() {
        let c = crypto(&[generate_key()]);
        for info in [
            MessageIdInfo {
                uaid: Uuid::new_v4(),
                channel_id: Uuid::new_v4(),
                topic: Some("mail-x".into()),
                ..Default::default()
            },
            MessageIdInfo {
                uaid: Uuid::new_v4(),
                channel_id: Uuid::new_v4(),
                sortkey_timestamp: Some(123),
                ..Default::default()
            },
            MessageIdInfo {
                uaid: Uuid::new_v4(),
                channel_id: Uuid::new_v4(),
                topic: Some("t".into()),
                key_hash: Some(key_hash_in_id(&key_hash(&[4; 65]))),
                settled: Some((MessageState::Bridged, 1_700_000_000)),
                ..Default::default()
            },
            MessageIdInfo {
                uaid: Uuid::new_v4(),
                channel_id: Uuid::new_v4(),
                sortkey_timestamp: Some(456),
                settled: Some((MessageState::Sent, 1_700_000_000)),
                tag: Some(*b"\x01tag\xfe\x00\x7f!"),
                node: Some("http://10.0.0.7:8081".into()),
                ..Default::default()
            },
        ] {
            let id = c.make_message_id(&info);
            assert_eq!(c.parse_message_id(&id).unwrap(), info);
        }
        assert_eq!(c.parse_message_id("nope"), Err(ApiError::InvalidMessageId));
    }

    #[test]
    fn key_lists_accept_brackets_and_commas() {
        assert_eq!(parse_key_list("[a, b]"), vec!["a", "b"]);
        assert_eq!(parse_key_list("a"), vec!["a"]);
        assert!(parse_key_list(" ").is_empty());
    }
}
