//! The FCM HTTP v1 message a Web Push notification becomes:
//!
//! ```json
//! {"message": {"token": "...", "android": {"ttl": "60s", "priority": "high",
//!   "collapse_key": "topic", "data": {"chid": "...", "ver": "...", "body": "...",
//!   "con": "aes128gcm"}}}}
//! ```

use std::collections::BTreeMap;
use std::io::Write;

use autopush_common::Notification;
use autopush_common::bridge::{web_push_fields, write_json_members, write_json_str};
use autopush_common::router::{RouterError, WakeUp};

/// FCM keeps a message at most 28 days.
pub const MAX_TTL: u64 = 28 * 24 * 60 * 60;

/// FCM's limit on a message's data, keys and values together.
pub const MAX_DATA_BYTES: usize = 4096;

/// The data keys every Web Push notification carries to the app (see
/// [`web_push_fields`]). The caller adds its own identification keys
/// (`chid`, ...).
pub fn payload_data(notification: &Notification) -> BTreeMap<&'static str, &str> {
    web_push_fields(notification)
}

/// The `messages:send` body for `token`, or [`RouterError::TooMuchData`]
/// when `data` is over FCM's limit. It borrows what it sends (the body
/// alone is ~3 KB) and is written once, straight to the request body.
pub fn android_message<'a>(
    token: &'a str,
    notification: &'a Notification,
    data: &'a BTreeMap<&'static str, &'a str>,
) -> Result<AndroidMessage<'a>, RouterError> {
    check_size(data)?;
    let priority = match notification.urgency {
        Some(urgency) if urgency.is_low() => "normal",
        _ => "high",
    };
    Ok(AndroidMessage {
        token,
        ttl: notification.ttl.min(MAX_TTL),
        priority,
        collapse_key: notification.topic.as_deref(),
        data,
    })
}

/// The data of every wake-up: one fixed key, nothing of the message.
static WAKE_DATA: std::sync::LazyLock<BTreeMap<&'static str, &'static str>> =
    std::sync::LazyLock::new(|| BTreeMap::from([("wake", "1")]));

/// The `messages:send` body of a wake-up to `token`: a data message with
/// one fixed key, collapsed (`collapse_key: wake`) with any earlier wake-up
/// the device has not received yet, its priority from the urgency of the
/// message that caused it and its TTL no longer than that message's.
pub fn wake_message<'a>(token: &'a str, wake: &WakeUp) -> AndroidMessage<'a> {
    AndroidMessage {
        token,
        ttl: wake.ttl.min(MAX_TTL),
        priority: if wake.urgency.is_low() {
            "normal"
        } else {
            "high"
        },
        collapse_key: Some("wake"),
        data: &WAKE_DATA,
    }
}

/// `{"message": {"token", "android": {"ttl", "priority", "collapse_key"?,
/// "data"}}}`.
#[derive(Debug)]
pub struct AndroidMessage<'a> {
    token: &'a str,
    ttl: u64,
    priority: &'static str,
    collapse_key: Option<&'a str>,
    data: &'a BTreeMap<&'static str, &'a str>,
}

impl AndroidMessage<'_> {
    /// The JSON text, written by hand rather than by serde_json so that
    /// the body, base64url, is copied instead of scanned for escapes
    /// ([`write_json_members`]).
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        let data_len: usize = self.data.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
        let mut out = Vec::with_capacity(data_len + self.token.len() + 128);
        out.extend_from_slice(b"{\"message\":{\"token\":");
        write_json_str(&mut out, self.token)?;
        write!(
            out,
            ",\"android\":{{\"ttl\":\"{}s\",\"priority\":",
            self.ttl
        )
        .map_err(serde_json::Error::io)?;
        write_json_str(&mut out, self.priority)?;
        if let Some(collapse_key) = self.collapse_key {
            out.extend_from_slice(b",\"collapse_key\":");
            write_json_str(&mut out, collapse_key)?;
        }
        out.extend_from_slice(b",\"data\":{");
        write_json_members(&mut out, self.data.iter().map(|(k, v)| (*k, *v)))?;
        out.extend_from_slice(b"}}}}");
        Ok(out)
    }
}

/// Refuse data over FCM's limit before sending, telling the sender how
/// much encrypted body (before base64) would have fit.
fn check_size(data: &BTreeMap<&'static str, &str>) -> Result<(), RouterError> {
    let total: usize = data.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total <= MAX_DATA_BYTES {
        return Ok(());
    }
    let body = data.get("body").map_or(0, |body| body.len());
    let room_for_body = MAX_DATA_BYTES.saturating_sub(total - body);
    Err(RouterError::TooMuchData(room_for_body / 4 * 3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopush_common::Urgency;
    use serde_json::{Value, json};

    fn json_of(message: &AndroidMessage<'_>) -> Value {
        serde_json::from_slice(&message.to_json().unwrap()).unwrap()
    }

    fn notification() -> Notification {
        Notification {
            channel_id: uuid::Uuid::nil(),
            version: "msgid".into(),
            ttl: 90,
            timestamp: 1,
            topic: None,
            sortkey_timestamp: None,
            data: Some("AAEC".into()),
            headers: Some(
                [("encoding".to_string(), "aes128gcm".to_string())]
                    .into_iter()
                    .collect(),
            ),
            urgency: None,
            durable: false,
        }
    }

    #[test]
    fn a_notification_becomes_an_android_data_message() {
        let mut n = notification();
        n.topic = Some("news".into());
        let mut data = payload_data(&n);
        data.insert("chid", "c");
        let message = json_of(&android_message("tok", &n, &data).unwrap());
        assert_eq!(
            message,
            json!({"message": {"token": "tok", "android": {
                "ttl": "90s", "priority": "high", "collapse_key": "news",
                "data": {"chid": "c", "body": "AAEC", "con": "aes128gcm"}}}})
        );
    }

    #[test]
    fn low_urgency_is_normal_priority_and_ttl_is_clamped() {
        let mut n = notification();
        n.urgency = Some(Urgency::VeryLow);
        n.ttl = 60 * 24 * 3600;
        let data = payload_data(&n);
        let message = json_of(&android_message("tok", &n, &data).unwrap());
        assert_eq!(message["message"]["android"]["priority"], "normal");
        assert_eq!(message["message"]["android"]["ttl"], "2419200s");
        n.urgency = Some(Urgency::Normal);
        let data = payload_data(&n);
        let message = json_of(&android_message("tok", &n, &data).unwrap());
        assert_eq!(message["message"]["android"]["priority"], "high");
    }

    #[test]
    fn a_wake_up_carries_one_fixed_key_and_nothing_of_the_message() {
        let wake = WakeUp {
            urgency: Urgency::Low,
            ttl: 60 * 24 * 3600,
            timestamp: 1,
        };
        let message = json_of(&wake_message("tok", &wake));
        assert_eq!(
            message,
            json!({"message": {"token": "tok", "android": {
                "ttl": "2419200s", "priority": "normal", "collapse_key": "wake",
                "data": {"wake": "1"}}}})
        );
        let high = WakeUp {
            urgency: Urgency::Normal,
            ttl: 30,
            ..wake
        };
        let message = json_of(&wake_message("tok", &high));
        assert_eq!(message["message"]["android"]["priority"], "high");
        assert_eq!(message["message"]["android"]["ttl"], "30s");
    }

    #[test]
    fn data_over_the_limit_is_refused_with_the_room_left() {
        let mut n = notification();
        n.data = Some("A".repeat(MAX_DATA_BYTES));
        let data = payload_data(&n);
        let err = android_message("tok", &n, &data).unwrap_err();
        // 4096 less "body", "con" and "aes128gcm", as raw bytes before base64.
        assert_eq!(err, RouterError::TooMuchData((4096 - 4 - 3 - 9) / 4 * 3));
    }
}
