//! The websocket push protocol (see the seeds' "User Agent Protocol Overview"):
//! client messages in, server messages out, as JSON text frames.

use std::collections::BTreeMap;

use autopush_common::Notification;
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
    Notification(ClientNotification),
}

/// A notification as the user agent sees it: only the protocol's fields. The
/// stored and inter-node form ([`Notification`]) carries more (timestamps,
/// sort keys, urgency) that stays inside the service.
#[derive(Debug, Serialize)]
pub struct ClientNotification {
    #[serde(rename = "channelID")]
    pub channel_id: uuid::Uuid,
    pub version: String,
    pub ttl: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

impl From<&Notification> for ClientNotification {
    fn from(n: &Notification) -> Self {
        ClientNotification {
            channel_id: n.channel_id,
            version: n.version.clone(),
            ttl: n.ttl,
            topic: n.topic.clone(),
            data: n.data.clone(),
            headers: n.headers.clone(),
        }
    }
}

impl ServerMessage {
    /// The message that delivers `notification` to the user agent.
    pub fn notification(notification: &Notification) -> Self {
        ServerMessage::Notification(notification.into())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| error_json("error", 500, &e.to_string()))
    }
}

/// The reply to a client ping.
pub const PONG: &str = "{}";

/// An error reply: `{"messageType": <what it answers>, "status": .., "reason": ..}`.
pub fn error_json(message_type: &str, status: u16, reason: &str) -> String {
    json!({"messageType": message_type, "status": status, "reason": reason}).to_string()
}

#[cfg(test)]
mod tests {
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
        let v: Value = serde_json::from_str(&ServerMessage::notification(&n).to_json()).unwrap();
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
}
