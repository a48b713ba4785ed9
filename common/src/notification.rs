//! A push message on its way from an application server to a user agent.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::bridge::{write_json_members, write_json_str, write_json_uuid};

/// One notification, as stored and as passed between nodes. The websocket
/// client gets only the protocol's fields of it (the connection node's
/// `notification_json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    #[serde(rename = "channelID")]
    pub channel_id: Uuid,
    /// The message id: opaque to the client, which echoes it in `ack`; the
    /// same id the application server got in `Location` and may `DELETE`.
    pub version: String,
    /// Seconds the message may wait for delivery, counted from `timestamp`.
    pub ttl: u64,
    /// Unix seconds when the endpoint accepted the message.
    pub timestamp: u64,
    /// A newer message with the same topic replaces an undelivered older one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// When the endpoint accepted it, in unique microseconds: orders stored
    /// messages without a topic (it is in their sort key), and tells which of
    /// two messages with the same topic is newer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sortkey_timestamp: Option<u64>,
    /// The encrypted body, base64url without padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// The encryption headers the client needs: `encoding`, `encryption`, `crypto_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
    /// The sender's `Urgency` (RFC 8030 §5.3); bridges map it onto their
    /// upstream's priority. `None`: the sender said nothing (normal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urgency: Option<Urgency>,
    /// Direct delivery with a copy in storage (`--durable-direct`): the
    /// session deletes that copy when the client acks.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub durable: bool,
}

/// RFC 8030 §5.3 `Urgency`, ordered from `very-low` to `high`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Urgency {
    VeryLow,
    Low,
    Normal,
    High,
}

impl Urgency {
    /// The header value, as RFC 8030 spells it (case-insensitive).
    pub fn parse(value: &str) -> Option<Urgency> {
        match value.to_ascii_lowercase().as_str() {
            "very-low" => Some(Urgency::VeryLow),
            "low" => Some(Urgency::Low),
            "normal" => Some(Urgency::Normal),
            "high" => Some(Urgency::High),
            _ => None,
        }
    }

    /// The header value, as serde writes it too.
    pub fn as_str(self) -> &'static str {
        match self {
            Urgency::VeryLow => "very-low",
            Urgency::Low => "low",
            Urgency::Normal => "normal",
            Urgency::High => "high",
        }
    }

    /// `very-low` and `low`: the device may wait for a good moment.
    pub fn is_low(self) -> bool {
        matches!(self, Urgency::VeryLow | Urgency::Low)
    }
}

impl Notification {
    /// The message-table sort key: topic messages `01:{chid}:{topic}` (so a
    /// newer one overwrites the older), others `02:{timestamp}:{chid}` (so they
    /// sort in arrival order, after every topic message).
    pub fn sort_key(&self) -> String {
        sort_key(
            &self.channel_id,
            self.topic.as_deref(),
            self.sortkey_timestamp,
        )
    }

    /// Unix seconds after which the message must not be delivered.
    pub fn expiry(&self) -> u64 {
        self.timestamp.saturating_add(self.ttl)
    }

    pub fn is_expired(&self, now_secs: u64) -> bool {
        self.expiry() <= now_secs
    }

    /// Less urgent than `min` (a message without `Urgency` is normal).
    pub fn is_below(&self, min: Urgency) -> bool {
        self.urgency.unwrap_or(Urgency::Normal) < min
    }

    /// This notification's JSON: see [`Notification::write_json`].
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        let body = self.data.as_deref().map_or(0, str::len);
        let mut out = Vec::with_capacity(body + self.version.len() + 256);
        self.write_json(&mut out)?;
        Ok(out)
    }

    /// Append this notification's JSON to `out`: the bytes `serde_json`
    /// writes, faster. Its long strings (the message id, the body) are
    /// base64url, checked for characters to escape many bytes at a time
    /// (see [`write_json_str`]) rather than byte by byte. Messages stored
    /// in the embedded store, journaled, or sent to another node are
    /// written this way.
    pub fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        let number = |out: &mut Vec<u8>, name: &[u8], n: u64| {
            out.extend_from_slice(name);
            serde_json::to_writer(out, &n)
        };
        out.extend_from_slice(br#"{"channelID":"#);
        write_json_uuid(out, &self.channel_id);
        out.extend_from_slice(br#","version":"#);
        write_json_str(out, &self.version)?;
        number(out, br#","ttl":"#, self.ttl)?;
        number(out, br#","timestamp":"#, self.timestamp)?;
        if let Some(topic) = &self.topic {
            out.extend_from_slice(br#","topic":"#);
            write_json_str(out, topic)?;
        }
        if let Some(at) = self.sortkey_timestamp {
            number(out, br#","sortkey_timestamp":"#, at)?;
        }
        if let Some(data) = &self.data {
            out.extend_from_slice(br#","data":"#);
            write_json_str(out, data)?;
        }
        if let Some(headers) = &self.headers {
            out.extend_from_slice(br#","headers":{"#);
            write_json_members(out, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
            out.push(b'}');
        }
        if let Some(urgency) = self.urgency {
            out.extend_from_slice(br#","urgency":""#);
            out.extend_from_slice(urgency.as_str().as_bytes());
            out.push(b'"');
        }
        if self.durable {
            out.extend_from_slice(br#","durable":true"#);
        }
        out.push(b'}');
        Ok(())
    }
}

/// Where the receipt of message `version`, stored under `sort_key`, is
/// kept when it is not that row itself: a Topic message's row is taken by
/// the next message with its Topic, so its receipt gets a row of its own
/// beside it (`{sort_key}:{hash of version}`; a Topic has no `:`), which
/// the receipt's reader finds from the message id alone. `None` for any
/// other message: its receipt stays in its row.
pub fn receipt_key(sort_key: &str, version: &str) -> Option<String> {
    sort_key
        .starts_with("01:")
        .then(|| format!("{sort_key}:{}", crate::ids::hex(&version_tag(version))))
}

/// A message id's first 8 bytes of SHA-256: enough to tell it from the
/// other ids of one key (ids are sealed, so no sender picks one to match).
pub fn version_tag(version: &str) -> [u8; 8] {
    use sha2::{Digest, Sha256};
    let hash = Sha256::digest(version.as_bytes());
    let mut tag = [0; 8];
    tag.copy_from_slice(&hash[..8]);
    tag
}

/// The sort key of a message; see [`Notification::sort_key`]:
/// `01:{channel_id}:{topic}`, or `02:{timestamp, 20 digits}:{channel_id}`.
/// Built by hand rather than with `format!`: a durable direct push makes
/// it three times.
pub fn sort_key(channel_id: &Uuid, topic: Option<&str>, sortkey_timestamp: Option<u64>) -> String {
    let mut buffer = Uuid::encode_buffer();
    let channel_id = channel_id.hyphenated().encode_lower(&mut buffer);
    match topic {
        Some(topic) => ["01:", channel_id, ":", topic].concat(),
        None => {
            // `02:`, 20 digits (u64::MAX has 20), `:`, then the channel id.
            let mut key = [0u8; 24 + 36];
            key[..3].copy_from_slice(b"02:");
            let mut left = sortkey_timestamp.unwrap_or(0);
            for digit in key[3..23].iter_mut().rev() {
                *digit = b'0' + (left % 10) as u8;
                left /= 10;
            }
            key[23] = b':';
            key[24..].copy_from_slice(channel_id.as_bytes());
            // ASCII throughout: the check passes (a word at a time).
            std::str::from_utf8(&key).unwrap_or_default().to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(topic: Option<&str>, ts: u64) -> Notification {
        Notification {
            channel_id: Uuid::nil(),
            version: "v".into(),
            ttl: 60,
            timestamp: 1000,
            topic: topic.map(str::to_owned),
            sortkey_timestamp: Some(ts),
            data: None,
            headers: None,
            urgency: None,
            durable: false,
        }
    }

    #[test]
    fn write_json_writes_what_serde_json_writes() {
        let headers = BTreeMap::from([
            ("encoding".to_owned(), "aes128gcm".to_owned()),
            ("crypto_key".to_owned(), "dh=\"a\\b\"\n".to_owned()),
        ]);
        let mut variants = vec![message(None, 7), message(Some("t\"opic"), 0)];
        for mut n in variants.clone() {
            n.version = "gAAAAABp-_version\u{1}".into();
            n.sortkey_timestamp = None;
            n.data = Some("aGVsbG8".into());
            n.headers = Some(headers.clone());
            n.durable = true;
            for urgency in [
                Urgency::VeryLow,
                Urgency::Low,
                Urgency::Normal,
                Urgency::High,
            ] {
                variants.push(Notification {
                    urgency: Some(urgency),
                    ..n.clone()
                });
            }
        }
        for n in &variants {
            let mut out = Vec::new();
            n.write_json(&mut out).unwrap();
            let want = serde_json::to_string(n).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), want);
        }
    }

    #[test]
    fn a_topic_receipt_has_a_row_of_its_own_per_version() {
        let topic = message(Some("score"), 1).sort_key();
        let (a, b) = (
            receipt_key(&topic, "va").unwrap(),
            receipt_key(&topic, "vb").unwrap(),
        );
        assert!(a.starts_with(&format!("{topic}:")) && b.starts_with(&format!("{topic}:")));
        assert_ne!(a, b);
        assert_eq!(receipt_key(&topic, "va"), Some(a));
        assert_eq!(receipt_key(&message(None, 1).sort_key(), "va"), None);
    }

    #[test]
    fn sort_keys_are_what_format_writes() {
        let chid = Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        for ts in [
            None,
            Some(0),
            Some(7),
            Some(1_700_000_000_123),
            Some(u64::MAX),
        ] {
            let want = format!("02:{:020}:{chid}", ts.unwrap_or(0));
            assert_eq!(sort_key(&chid, None, ts), want);
        }
        assert_eq!(
            sort_key(&chid, Some("score"), Some(3)),
            format!("01:{chid}:score")
        );
    }

    #[test]
    fn topic_messages_sort_first_and_others_by_time() {
        let mut keys = [
            message(None, 20).sort_key(),
            message(Some("b"), 0).sort_key(),
            message(None, 3).sort_key(),
        ];
        keys.sort();
        assert!(keys[0].starts_with("01:"));
        assert!(keys[1].contains(":00000000000000000003:"));
        assert!(keys[2].contains(":00000000000000000020:"));
    }

    #[test]
    fn expiry_is_inclusive_of_ttl() {
        let m = message(None, 1);
        assert!(!m.is_expired(1059));
        assert!(m.is_expired(1060));
    }
}
