//! The boundary with Apple: one request to the provider API and its answer.
//!
//! The router builds an [`ApnsRequest`] and hands it to an [`ApnsSender`].
//! In the binary that is [`crate::client::A2Sender`], the only code that
//! calls the a2 crate; tests and benchmarks use a recording double instead
//! (a2 cannot be pointed at a local server).

use async_trait::async_trait;

/// One notification as Apple receives it: `POST /3/device/{device_token}`
/// with these headers and this JSON body.
#[derive(Clone, Debug, PartialEq)]
pub struct ApnsRequest {
    pub device_token: String,
    pub headers: ApnsHeaders,
    /// The JSON body, exactly as sent.
    pub payload: String,
}

/// The `apns-*` request headers the router sets.
#[derive(Clone, Debug, PartialEq)]
pub struct ApnsHeaders {
    /// `apns-topic`: the app's bundle id.
    pub topic: String,
    /// `apns-priority`: 10 (now) or 5 (when the device sees fit; the only
    /// one Apple allows for a background push).
    pub priority: u8,
    /// `apns-expiration`: Unix seconds; 0 means "now or never".
    pub expiration: u64,
    /// `apns-collapse-id`: the Web Push `Topic`, if the sender gave one.
    pub collapse_id: Option<String>,
    /// `apns-push-type`: [`ApnsHeaders::ALERT`], or [`ApnsHeaders::BACKGROUND`]
    /// to wake the app without an alert, when the system sees fit (Apple
    /// throttles these).
    pub push_type: &'static str,
}

impl ApnsHeaders {
    /// An alert the app's notification service extension can rewrite
    /// (`mutable-content`).
    pub const ALERT: &'static str = "alert";
    /// A `very-low` message, or a wake-up below `high` urgency:
    /// `content-available`, no alert.
    pub const BACKGROUND: &'static str = "background";

    /// The headers as they go on the wire, by name.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs = vec![
            ("apns-topic", self.topic.clone()),
            ("apns-push-type", self.push_type.to_owned()),
            ("apns-priority", self.priority.to_string()),
            ("apns-expiration", self.expiration.to_string()),
        ];
        if let Some(id) = &self.collapse_id {
            pairs.push(("apns-collapse-id", id.clone()));
        }
        pairs
    }
}

/// Apple's answer: 200, or a refusal with its `reason` (e.g.
/// `BadDeviceToken`, `TooManyRequests`) when Apple gave one we could read.
#[derive(Clone, Debug, PartialEq)]
pub struct ApnsResponse {
    pub status: u16,
    pub reason: Option<String>,
}

impl ApnsResponse {
    pub fn accepted() -> ApnsResponse {
        ApnsResponse {
            status: 200,
            reason: None,
        }
    }

    pub fn refused(status: u16, reason: &str) -> ApnsResponse {
        ApnsResponse {
            status,
            reason: Some(reason.to_owned()),
        }
    }
}

/// Apple could not be asked, or did not answer.
#[derive(Clone, Debug, PartialEq)]
pub enum TransportError {
    /// No connection (refused, reset, TLS failure): worth another try.
    Connect(String),
    /// No answer within the client's request timeout.
    Timeout,
    /// The request could not be built or signed: retrying cannot help.
    Request(String),
}

/// Sends one request to APNs.
#[async_trait]
pub trait ApnsSender: Send + Sync {
    async fn send(&self, request: &ApnsRequest) -> Result<ApnsResponse, TransportError>;
}
