//! What an iOS app receives: the registration's `router_data`, and the APNs
//! request built from a Web Push notification.
//!
//! The body is `{"aps": {...}, "chid", "ver", "body"?, "con"?, "enc"?,
//! "cryptokey"?}`: the ciphertext base64url with the Web Push encryption
//! headers, so the app's notification service extension can decrypt it and
//! replace the alert `aps` describes.

use std::borrow::Cow;
use std::collections::BTreeMap;

use autopush_common::bridge::{web_push_fields, write_json_members};
use autopush_common::router::{RouterDataInput, RouterError, WakeUp};
use autopush_common::{Notification, Urgency, User};
use serde_json::{Value, json};

use crate::sender::{ApnsHeaders, ApnsRequest};

/// APNs refuses a body larger than this.
pub const MAX_PAYLOAD_BYTES: usize = 4096;

/// The largest `aps` override a registration may store: the rest of the
/// 4096 bytes is for the message.
pub const MAX_APS_BYTES: usize = 1024;

/// The `aps` sent when the registration gave none: an alert the app's
/// notification service extension may rewrite (`mutable-content`) once it
/// has decrypted the message; shown as is if the extension cannot.
const DEFAULT_APS: &str = r#"{"alert":{"title":"New message"},"mutable-content":1}"#;

/// The `aps` of a background push (a `very-low` message): Apple allows no
/// alert, sound or badge in one.
const BACKGROUND_APS: &str = r#"{"content-available":1}"#;

/// [`DEFAULT_APS`] as a value.
pub fn default_aps() -> Value {
    serde_json::from_str(DEFAULT_APS).unwrap_or_default()
}

/// A user's `router_data`, as [`register`] stores it.
pub struct RouterData<'a> {
    pub token: &'a str,
    pub channel: &'a str,
    pub aps: Option<Cow<'a, Value>>,
}

impl<'a> RouterData<'a> {
    pub fn of(user: &'a User) -> Result<RouterData<'a>, RouterError> {
        let data = user.router_data.as_ref();
        let text = |name: &str| data.and_then(|d| d.get(name)).and_then(Value::as_str);
        let broken = |what: &str| RouterError::Upstream(format!("the registration has no {what}"));
        Ok(RouterData {
            token: text("token").ok_or_else(|| broken("device token"))?,
            channel: text("rel_channel").ok_or_else(|| broken("release channel"))?,
            // Older records (and Mozilla's) keep the override as JSON text.
            aps: data
                .and_then(|d| d.get("aps"))
                .and_then(|aps| match aps {
                    Value::String(text) => serde_json::from_str(text).ok().map(Cow::Owned),
                    other => Some(Cow::Borrowed(other)),
                })
                .filter(|aps| aps.is_object()),
        })
    }
}

/// Validate a registration for `channel` and return its `router_data`:
/// `{token, rel_channel}` and the optional `aps` override.
pub fn register(input: &RouterDataInput, channel: &str) -> Result<Value, RouterError> {
    let token = input.token.as_deref().unwrap_or_default();
    check_device_token(token)?;
    let mut data = json!({"token": token, "rel_channel": channel});
    if let Some(aps) = input.extra.get("aps") {
        data["aps"] = check_aps(aps)?;
    }
    Ok(data)
}

/// An APNs device token is hex: 32 bytes today, up to 100 by Apple's word.
fn check_device_token(token: &str) -> Result<(), RouterError> {
    let invalid = |why: &str| {
        RouterError::InvalidRegistration(format!(
            "token must be the APNs device token as hex digits: {why}"
        ))
    };
    if token.is_empty() {
        return Err(invalid("none given"));
    }
    if !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(invalid("it has characters other than 0-9 and a-f"));
    }
    if !(32..=200).contains(&token.len()) || !token.len().is_multiple_of(2) {
        return Err(invalid("expected an even number of 32 to 200 digits"));
    }
    Ok(())
}

/// An `aps` override: a JSON object (or JSON text of one, as Mozilla's
/// clients send it) whose well-known keys have the types Apple expects.
fn check_aps(aps: &Value) -> Result<Value, RouterError> {
    let invalid = |why: String| RouterError::InvalidRegistration(format!("aps: {why}"));
    let aps = match aps {
        Value::String(text) => {
            serde_json::from_str(text).map_err(|e| invalid(format!("not a JSON object ({e})")))?
        }
        other => other.clone(),
    };
    let Some(object) = aps.as_object() else {
        return Err(invalid("must be a JSON object".into()));
    };
    if aps.to_string().len() > MAX_APS_BYTES {
        return Err(invalid(format!(
            "at most {MAX_APS_BYTES} bytes, to leave room for the message"
        )));
    }
    for (key, value) in object {
        let ok = match key.as_str() {
            "alert" | "sound" => value.is_string() || value.is_object(),
            "badge" => value.is_u64(),
            "content-available" | "mutable-content" => value.is_u64(),
            "category" | "thread-id" | "target-content-id" | "interruption-level" => {
                value.is_string()
            }
            "relevance-score" => value.is_number(),
            _ => true,
        };
        if !ok {
            return Err(invalid(format!("{key:?} has the wrong type")));
        }
    }
    Ok(aps)
}

/// The APNs request for `notification` to the device in `data`.
pub fn request(
    notification: &Notification,
    data: &RouterData<'_>,
    topic: &str,
) -> Result<ApnsRequest, RouterError> {
    // Borrowed, in the order serde_json's map would write them.
    let chid = notification.channel_id.to_string();
    let mut fields = web_push_fields(notification);
    fields.insert("chid", &chid);
    fields.insert("ver", &notification.version);
    let ciphertext = notification.data.as_deref().unwrap_or_default();
    // `very-low`: a background push, which Apple requires at priority 5
    // and without the registration's alert; `low`: an alert at 5.
    let background = notification.urgency == Some(Urgency::VeryLow);
    let (aps, default_aps) = match background {
        true => (None, BACKGROUND_APS),
        false => (data.aps.as_deref(), DEFAULT_APS),
    };
    let payload = body_json(aps, default_aps, &fields)
        .map_err(|e| RouterError::Upstream(format!("cannot encode the APNs body: {e}")))?;
    if payload.len() > MAX_PAYLOAD_BYTES {
        // What the base64url body may take, in bytes of ciphertext.
        let room = MAX_PAYLOAD_BYTES.saturating_sub(payload.len() - ciphertext.len());
        return Err(RouterError::TooMuchData(room * 3 / 4));
    }
    let low = notification.urgency.is_some_and(|u| u.is_low());
    Ok(ApnsRequest {
        device_token: data.token.to_owned(),
        headers: ApnsHeaders {
            topic: topic.to_owned(),
            priority: if low { 5 } else { 10 },
            expiration: match notification.ttl {
                0 => 0,
                ttl => notification.timestamp.saturating_add(ttl),
            },
            collapse_id: notification.topic.clone(),
            push_type: if background {
                ApnsHeaders::BACKGROUND
            } else {
                ApnsHeaders::ALERT
            },
        },
        payload,
    })
}

/// The `aps` of a wake-up below `high` urgency: a background push.
const WAKE_APS: &str = r#"{"aps":{"content-available":1},"wake":1}"#;

/// The `aps` of a `high` wake-up: an alert with a generic text, which the
/// app's notification service extension may replace once it has fetched
/// what is waiting.
const WAKE_ALERT_APS: &str = r#"{"aps":{"alert":{"title":"New message"},"content-available":1,"mutable-content":1},"wake":1}"#;

/// The APNs request of a wake-up to device `token`: nothing of the message
/// that caused it, collapsed (`apns-collapse-id: wake`) with any earlier
/// wake-up the device has not seen yet.
pub fn wake_request(token: &str, wake: &WakeUp, topic: &str) -> ApnsRequest {
    let alert = wake.urgency == Urgency::High;
    ApnsRequest {
        device_token: token.to_owned(),
        headers: ApnsHeaders {
            topic: topic.to_owned(),
            priority: if alert { 10 } else { 5 },
            expiration: wake.timestamp.saturating_add(wake.ttl),
            collapse_id: Some("wake".into()),
            push_type: if alert {
                ApnsHeaders::ALERT
            } else {
                ApnsHeaders::BACKGROUND
            },
        },
        payload: if alert { WAKE_ALERT_APS } else { WAKE_APS }.to_owned(),
    }
}

/// A device token a client registers as its wake route.
pub fn check_wake_token(token: &str) -> Result<(), RouterError> {
    check_device_token(token)
}

/// `{"aps": ..., "body": ..., "chid": ...}` (`aps` as given, else
/// `default_aps`), written by hand rather than by
/// serde_json so that the body, base64url, is copied instead of scanned for
/// escapes ([`write_json_members`]).
fn body_json(
    aps: Option<&Value>,
    default_aps: &str,
    fields: &BTreeMap<&str, &str>,
) -> serde_json::Result<String> {
    let fields_len: usize = fields.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
    let mut out = Vec::with_capacity(fields_len + 256);
    out.extend_from_slice(b"{\"aps\":");
    match aps {
        Some(aps) => serde_json::to_writer(&mut out, aps)?,
        None => out.extend_from_slice(default_aps.as_bytes()),
    }
    out.push(b',');
    write_json_members(&mut out, fields.iter().map(|(k, v)| (*k, *v)))?;
    out.push(b'}');
    // Only JSON text went in.
    String::from_utf8(out).map_err(serde::ser::Error::custom)
}

#[cfg(test)]
mod tests {
    use autopush_common::RouterType;
    use uuid::Uuid;

    use super::*;

    const TOKEN: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";

    fn input(token: &str, aps: Option<Value>) -> RouterDataInput {
        let mut input = RouterDataInput {
            token: Some(token.into()),
            ..Default::default()
        };
        if let Some(aps) = aps {
            input.extra.insert("aps".into(), aps);
        }
        input
    }

    fn user(data: Value) -> User {
        User {
            uaid: Uuid::new_v4(),
            router_type: RouterType::Apns,
            router_data: Some(data),
            node_id: None,
            connected_at: 0,
            last_connect: 0,
            over_msg_limit: false,
            current_month: None,
            min_urgency: autopush_common::Urgency::VeryLow,
            wake_route: None,
            last_wake: 0,
        }
    }

    fn notification(data: Option<String>) -> Notification {
        Notification {
            channel_id: Uuid::nil(),
            version: "message-id".into(),
            ttl: 60,
            timestamp: 1_000_000,
            topic: None,
            sortkey_timestamp: None,
            data,
            headers: Some(BTreeMap::from([
                ("encoding".into(), "aesgcm".into()),
                ("encryption".into(), "salt=abc".into()),
                ("crypto_key".into(), "dh=xyz".into()),
            ])),
            urgency: None,
            durable: false,
        }
    }

    #[test]
    fn wake_ups_are_background_pushes_or_for_high_a_generic_alert() {
        let wake = WakeUp {
            urgency: Urgency::Normal,
            ttl: 60,
            timestamp: 1000,
        };
        let request = wake_request(TOKEN, &wake, "org.example.app");
        assert_eq!(
            (request.headers.push_type, request.headers.priority),
            (ApnsHeaders::BACKGROUND, 5)
        );
        assert_eq!(request.headers.collapse_id.as_deref(), Some("wake"));
        assert_eq!(request.headers.expiration, 1060);
        let body: Value = serde_json::from_str(&request.payload).unwrap();
        assert_eq!(body, json!({"aps": {"content-available": 1}, "wake": 1}));
        let high = WakeUp {
            urgency: Urgency::High,
            ..wake
        };
        let request = wake_request(TOKEN, &high, "org.example.app");
        assert_eq!(
            (request.headers.push_type, request.headers.priority),
            (ApnsHeaders::ALERT, 10)
        );
        let body: Value = serde_json::from_str(&request.payload).unwrap();
        assert_eq!(body["aps"]["alert"]["title"], "New message");
        assert_eq!(body["aps"]["mutable-content"], 1);
    }

    #[test]
    fn registration_keeps_token_channel_and_override() {
        let data = register(&input(TOKEN, None), "firefox").unwrap();
        assert_eq!(data, json!({"token": TOKEN, "rel_channel": "firefox"}));
        let aps = json!({"alert": "hi", "badge": 2});
        let data = register(&input(TOKEN, Some(aps.clone())), "beta").unwrap();
        assert_eq!(data["aps"], aps);
        // Mozilla's clients send the override as JSON text.
        let data = register(&input(TOKEN, Some(aps.to_string().into())), "beta").unwrap();
        assert_eq!(data["aps"], aps);
    }

    #[test]
    fn registration_refuses_what_apple_would() {
        let refused = |token: &str, aps: Option<Value>| {
            register(&input(token, aps), "firefox")
                .unwrap_err()
                .to_string()
        };
        assert!(refused("", None).contains("none given"));
        assert!(refused("not-hex-at-all", None).contains("0-9"));
        assert!(refused("abcd", None).contains("32 to 200"));
        assert!(refused(&"a".repeat(65), None).contains("even"));
        assert!(refused(TOKEN, Some(json!([1]))).contains("aps: must be a JSON object"));
        assert!(refused(TOKEN, Some(json!("{"))).contains("aps: not a JSON object"));
        assert!(refused(TOKEN, Some(json!({"badge": "one"}))).contains("\"badge\""));
        let big = json!({"alert": "x".repeat(MAX_APS_BYTES)});
        assert!(refused(TOKEN, Some(big)).contains("at most"));
    }

    #[test]
    fn the_body_carries_ciphertext_and_encryption_headers() {
        let u = user(json!({"token": TOKEN, "rel_channel": "firefox"}));
        let data = RouterData::of(&u).unwrap();
        let request = request(&notification(Some("Y2lwaGVy".into())), &data, "org.x").unwrap();
        let body: Value = serde_json::from_str(&request.payload).unwrap();
        assert_eq!(
            body,
            json!({
                "aps": default_aps(),
                "chid": Uuid::nil().to_string(),
                "ver": "message-id",
                "body": "Y2lwaGVy",
                "con": "aesgcm",
                "enc": "salt=abc",
                "cryptokey": "dh=xyz",
            })
        );
        assert_eq!(request.device_token, TOKEN);
        assert_eq!(
            request.headers.pairs(),
            vec![
                ("apns-topic", "org.x".to_owned()),
                ("apns-push-type", "alert".to_owned()),
                ("apns-priority", "10".to_owned()),
                ("apns-expiration", "1000060".to_owned()),
            ]
        );
    }

    #[test]
    fn headers_follow_ttl_urgency_and_topic() {
        let u = user(json!({"token": TOKEN, "rel_channel": "firefox", "aps": "{\"badge\":1}"}));
        let data = RouterData::of(&u).unwrap();
        let mut n = notification(None);
        n.ttl = 0;
        n.urgency = Some(Urgency::Low);
        n.topic = Some("scores".into());
        let request = request(&n, &data, "org.x").unwrap();
        assert_eq!(request.headers.priority, 5);
        assert_eq!(request.headers.push_type, ApnsHeaders::ALERT);
        assert_eq!(request.headers.expiration, 0);
        assert_eq!(request.headers.collapse_id.as_deref(), Some("scores"));
        let body: Value = serde_json::from_str(&request.payload).unwrap();
        assert_eq!(body["aps"], json!({"badge": 1}));
        assert!(body.get("body").is_none() && body.get("con").is_none());
    }

    /// Apple: a background push has priority 5, `content-available` and
    /// no alert, sound or badge (not even the registration's own).
    #[test]
    fn very_low_is_a_background_push_at_priority_5() {
        let u = user(json!({"token": TOKEN, "rel_channel": "firefox", "aps": "{\"badge\":1}"}));
        let data = RouterData::of(&u).unwrap();
        let mut n = notification(Some("YWJj".into()));
        n.urgency = Some(Urgency::VeryLow);
        let request = request(&n, &data, "org.x").unwrap();
        assert_eq!(request.headers.priority, 5);
        assert_eq!(request.headers.push_type, ApnsHeaders::BACKGROUND);
        let body: Value = serde_json::from_str(&request.payload).unwrap();
        assert_eq!(body["aps"], json!({"content-available": 1}));
        assert_eq!(body["body"], "YWJj");
    }

    #[test]
    fn too_large_a_body_is_refused_with_the_room_there_is() {
        let u = user(json!({"token": TOKEN, "rel_channel": "firefox"}));
        let data = RouterData::of(&u).unwrap();
        let Err(RouterError::TooMuchData(room)) =
            request(&notification(Some("A".repeat(4000))), &data, "org.x")
        else {
            panic!("a 4000-character body cannot fit");
        };
        let fits = "A".repeat(room * 4 / 3);
        assert!(request(&notification(Some(fits)), &data, "org.x").is_ok());
        let too_much = "A".repeat(room * 4 / 3 + 4);
        assert!(request(&notification(Some(too_much)), &data, "org.x").is_err());
    }
}
