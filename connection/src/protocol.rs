//! The websocket push protocol (see the seeds' "User Agent Protocol Overview"):
//! client messages in, server messages out, as JSON text frames.

use autopush_common::bridge::{write_json_members, write_json_str, write_json_uuid};
use autopush_common::{Notification, Urgency};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A message from the user agent.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(tag = "messageType", rename_all = "snake_case")]
pub enum ClientMessage {
    Hello {
        #[serde(default)]
        uaid: Option<String>,
        #[serde(default)]
        use_webpush: Option<bool>,
        #[serde(default)]
        broadcasts: Option<Value>,
    },
    Register {
        #[serde(rename = "channelID")]
        channel_id: String,
        #[serde(default)]
        key: Option<String>,
    },
    Unregister {
        #[serde(rename = "channelID")]
        channel_id: String,
        #[serde(default)]
        code: Option<u32>,
    },
    Ack {
        updates: Vec<Update>,
    },
    /// Firefox sends `{version, code}`; the seeds show `updates`: take both.
    Nack {
        #[serde(default)]
        updates: Vec<Update>,
        #[serde(default)]
        version: Option<String>,
        #[serde(default)]
        code: Option<u32>,
    },
    BroadcastSubscribe {
        #[serde(default)]
        broadcasts: Option<Value>,
    },
    /// `{}`: the client's keep-alive.
    Ping,
    /// The least urgent message the client wants now: `min` is read by
    /// [`min_urgency`], so that a bad value is answered, not a protocol
    /// error.
    Urgency {
        #[serde(default)]
        min: Value,
    },
    /// Where to wake this user agent while it is away: a bridge (`fcm`,
    /// `apns`; `null` removes the route), one of its apps here, and the
    /// device token.
    Wake {
        #[serde(default)]
        router: Option<String>,
        #[serde(default)]
        app_id: Option<String>,
        #[serde(default)]
        token: Option<String>,
    },
}

#[derive(Debug, PartialEq, Deserialize)]
pub struct Update {
    #[serde(rename = "channelID", default)]
    pub channel_id: Option<String>,
    pub version: String,
    #[serde(default)]
    pub code: Option<u32>,
}

/// Why a client message could not be understood.
#[derive(Debug, PartialEq)]
pub struct ParseError {
    /// The `messageType` the client claimed, if any.
    pub message_type: Option<String>,
    pub reason: String,
}

impl ClientMessage {
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ParseError {
            message_type: None,
            reason: format!("invalid JSON: {e}"),
        })?;
        let Some(object) = value.as_object() else {
            return Err(ParseError {
                message_type: None,
                reason: "a message must be a JSON object".into(),
            });
        };
        let message_type = match object.get("messageType") {
            None if object.is_empty() => return Ok(ClientMessage::Ping),
            None => {
                return Err(ParseError {
                    message_type: None,
                    reason: "missing messageType".into(),
                });
            }
            Some(Value::String(t)) => t.clone(),
            Some(_) => {
                return Err(ParseError {
                    message_type: None,
                    reason: "messageType must be a string".into(),
                });
            }
        };
        if message_type == "ping" {
            return Ok(ClientMessage::Ping);
        }
        serde_json::from_value(value).map_err(|e| {
            let reason = if e.to_string().starts_with("unknown variant") {
                format!("unknown messageType {message_type:?}")
            } else {
                format!("invalid {message_type} message: {e}")
            };
            ParseError {
                message_type: Some(message_type),
                reason,
            }
        })
    }
}

/// The `min` of an `urgency` message: one of RFC 8030's four values, as
/// the `Urgency` header spells them; else why not.
pub fn min_urgency(min: &Value) -> Result<Urgency, String> {
    serde_json::from_value(min.clone()).map_err(|_| {
        format!("min must be \"very-low\", \"low\", \"normal\" or \"high\", got {min}")
    })
}

/// A message to the user agent.
#[derive(Debug, Serialize)]
#[serde(tag = "messageType", rename_all = "snake_case")]
pub enum ServerMessage {
    Hello {
        uaid: String,
        status: u16,
        use_webpush: bool,
        broadcasts: serde_json::Map<String, Value>,
    },
    Register {
        #[serde(rename = "channelID")]
        channel_id: String,
        status: u16,
        #[serde(rename = "pushEndpoint", skip_serializing_if = "Option::is_none")]
        push_endpoint: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    Unregister {
        #[serde(rename = "channelID")]
        channel_id: String,
        status: u16,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    Urgency {
        status: u16,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    Wake {
        status: u16,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

impl ServerMessage {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| error_json("error", 500, &e.to_string()))
    }
}

/// The message that delivers `n` to the user agent, as JSON text: only the
/// protocol's fields (the stored and inter-node form carries timestamps,
/// sort keys and urgency, which stay inside the service). Written by hand
/// from the notification's fields, without copying them first, and its
/// body (base64url, most of the message) copied without serde_json's
/// escape scan byte by byte ([`write_json_str`]): that scan was 3 % of the
/// server's CPU per direct push.
pub fn notification_json(n: &Notification) -> String {
    let write = || -> serde_json::Result<Vec<u8>> {
        let body = n.data.as_deref().map_or(0, str::len);
        let mut out = Vec::with_capacity(body + n.version.len() + 256);
        out.extend_from_slice(br#"{"messageType":"notification","channelID":"#);
        write_json_uuid(&mut out, &n.channel_id);
        out.extend_from_slice(br#","version":"#);
        write_json_str(&mut out, &n.version)?;
        out.extend_from_slice(br#","ttl":"#);
        serde_json::to_writer(&mut out, &n.ttl)?;
        if let Some(topic) = &n.topic {
            out.extend_from_slice(br#","topic":"#);
            write_json_str(&mut out, topic)?;
        }
        if let Some(data) = &n.data {
            out.extend_from_slice(br#","data":"#);
            write_json_str(&mut out, data)?;
        }
        if let Some(headers) = &n.headers {
            out.extend_from_slice(br#","headers":{"#);
            write_json_members(
                &mut out,
                headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            )?;
            out.push(b'}');
        }
        out.push(b'}');
        Ok(out)
    };
    write()
        .map_err(|e| e.to_string())
        .and_then(|out| String::from_utf8(out).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| error_json("notification", 500, &e))
}

/// The reply to a client ping.
pub const PONG: &str = "{}";

/// An error reply: `{"messageType": <what it answers>, "status": .., "reason": ..}`.
pub fn error_json(message_type: &str, status: u16, reason: &str) -> String {
    json!({"messageType": message_type, "status": status, "reason": reason}).to_string()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn parses_what_firefox_sends() {
        assert_eq!(
            ClientMessage::parse(
                r#"{"messageType":"hello","uaid":"","use_webpush":true,"broadcasts":{}}"#
            )
            .unwrap(),
            ClientMessage::Hello {
                uaid: Some(String::new()),
                use_webpush: Some(true),
                broadcasts: Some(json!({}))
            }
        );
        assert_eq!(ClientMessage::parse("{}").unwrap(), ClientMessage::Ping);
        assert!(matches!(
            ClientMessage::parse(r#"{"messageType":"nack","version":"v","code":301}"#).unwrap(),
            ClientMessage::Nack {
                version: Some(_),
                code: Some(301),
                ..
            }
        ));
        assert!(matches!(
            ClientMessage::parse(r#"{"messageType":"ack","updates":[{"channelID":"x","version":"v","code":100}]}"#)
                .unwrap(),
            ClientMessage::Ack { updates } if updates.len() == 1
        ));
    }

    #[test]
    fn explains_what_is_wrong() {
        assert!(
            ClientMessage::parse("{nope")
                .unwrap_err()
                .reason
                .starts_with("invalid JSON")
        );
        assert_eq!(
            ClientMessage::parse("[]").unwrap_err().reason,
            "a message must be a JSON object"
        );
        let e = ClientMessage::parse(r#"{"messageType":"dance"}"#).unwrap_err();
        assert_eq!(
            (e.message_type.as_deref(), e.reason.as_str()),
            (Some("dance"), "unknown messageType \"dance\"")
        );
        let e = ClientMessage::parse(r#"{"messageType":"register"}"#).unwrap_err();
        assert!(e.reason.contains("channelID"), "{}", e.reason);
    }

    #[test]
    fn reads_the_minimum_urgency() {
        let ClientMessage::Urgency { min } =
            ClientMessage::parse(r#"{"messageType":"urgency","min":"very-low"}"#).unwrap()
        else {
            panic!("not an urgency message");
        };
        assert_eq!(min_urgency(&min), Ok(Urgency::VeryLow));
        for bad in [json!("urgent"), json!("LOW"), json!(3), Value::Null] {
            let e = min_urgency(&bad).unwrap_err();
            assert!(e.contains(&bad.to_string()), "{e}");
        }
        let ClientMessage::Urgency { min } =
            ClientMessage::parse(r#"{"messageType":"urgency"}"#).unwrap()
        else {
            panic!("not an urgency message");
        };
        assert_eq!(min, Value::Null);
    }

    #[test]
    fn parses_wake_routes_and_their_removal() {
        assert_eq!(
            ClientMessage::parse(
                r#"{"messageType":"wake","router":"fcm","app_id":"app1","token":"t"}"#
            )
            .unwrap(),
            ClientMessage::Wake {
                router: Some("fcm".into()),
                app_id: Some("app1".into()),
                token: Some("t".into()),
            }
        );
        assert_eq!(
            ClientMessage::parse(r#"{"messageType":"wake","router":null}"#).unwrap(),
            ClientMessage::Wake {
                router: None,
                app_id: None,
                token: None,
            }
        );
        let e = ClientMessage::parse(r#"{"messageType":"wake","token":5}"#).unwrap_err();
        assert_eq!(e.message_type.as_deref(), Some("wake"));
        assert_eq!(
            ServerMessage::Wake {
                status: 200,
                reason: None
            }
            .to_json(),
            r#"{"messageType":"wake","status":200}"#
        );
    }

    #[test]
    fn notification_carries_only_protocol_fields() {
        let n = Notification {
            channel_id: uuid::Uuid::nil(),
            version: "v".into(),
            ttl: 5,
            timestamp: 1,
            topic: Some("t".into()),
            sortkey_timestamp: Some(7),
            data: Some("ZGF0YQ".into()),
            headers: Some(BTreeMap::from([("encoding".into(), "aes128gcm".into())])),
            urgency: Some(autopush_common::notification::Urgency::High),
            durable: false,
        };
        let v: Value = serde_json::from_str(&notification_json(&n)).unwrap();
        assert_eq!(
            v,
            json!({
                "messageType": "notification",
                "channelID": "00000000-0000-0000-0000-000000000000",
                "version": "v",
                "ttl": 5,
                "topic": "t",
                "data": "ZGF0YQ",
                "headers": {"encoding": "aes128gcm"},
            })
        );
    }

    /// Fields left out when absent; text that needs escaping (never a
    /// base64url body, but a header or topic could) escaped as serde_json
    /// would.
    #[test]
    fn notification_json_leaves_out_absent_fields_and_escapes_text() {
        let channel_id = uuid::Uuid::new_v4();
        let mut n = Notification {
            channel_id,
            ttl: 0,
            timestamp: 1,
            ..crate::registry::test_notification("v\"1\"")
        };
        let parsed = |n: &Notification| -> Value {
            serde_json::from_str(&notification_json(n)).expect("valid JSON")
        };
        let mut expected = json!({
            "messageType": "notification",
            "channelID": channel_id.to_string(),
            "version": "v\"1\"",
            "ttl": 0,
        });
        assert_eq!(parsed(&n), expected);
        n.data = Some("bm90IGVzY2FwZWQ".into());
        n.headers = Some(BTreeMap::from([
            ("encryption".into(), "salt=\"a\\b\"\n".into()),
            ("encoding".into(), "aesgcm".into()),
        ]));
        expected["data"] = json!("bm90IGVzY2FwZWQ");
        expected["headers"] = json!({"encoding": "aesgcm", "encryption": "salt=\"a\\b\"\n"});
        assert_eq!(parsed(&n), expected);
    }
}
