//! The `Router` trait: how a notification reaches a user of one router type,
//! and how a bridge client registers with it. The gateway keeps one router per
//! [`RouterType`] in a [`RouterRegistry`] built at start-up; a bridge's
//! entry is [`Swappable`], so its apps can change while it serves.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;

use crate::bridge::mask_token;
use crate::limit_headers::RateLimit;
use crate::{ApiError, ApiResult, Notification, RouterType, Urgency, User};

/// How a router disposed of a notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Handed to the client (or to the bridge) right away.
    Direct,
    /// Handed to a connected client, which acked it before the sender was
    /// answered: `delivered` for good, so its receipt is sealed into the
    /// message's id and nothing of it is stored.
    Acked,
    /// Handed to a connected client, whose node keeps the copy in its own
    /// journal until the ack (or moves it to storage): `sent` until
    /// storage says more.
    Kept,
    /// Kept until the client comes back.
    Stored,
    /// TTL 0 and the client was not reachable now: dropped, as the sender asked.
    Dropped,
}

/// The body of a `/v1/{type}/{app_id}/registration` call.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct RouterDataInput {
    /// The bridge's device token (APNs device token, FCM registration token).
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default, rename = "channelID")]
    pub channel_id: Option<String>,
    /// A VAPID public key to restrict the new endpoint to.
    #[serde(default)]
    pub key: Option<String>,
    /// A bridge registration's messages are also kept until the app acks
    /// them through `/v1/.../messages` (`true`); `false` turns that off on
    /// a token update. Unset: as before.
    #[serde(default)]
    pub mailbox: Option<bool>,
    /// A bridge registration with a mailbox gets content-free wake-ups
    /// upstream instead of its messages (`true`), which the app fetches
    /// from the mailbox; `false` turns that off on a token update. Unset:
    /// as before.
    #[serde(default)]
    pub wake_only: Option<bool>,
    /// Anything else the bridge wants (e.g. an APNs `aps` override).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// What can go wrong in a router; each maps onto the errno table.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    /// The registration data is not acceptable to this bridge.
    #[error("invalid registration: {0}")]
    InvalidRegistration(String),
    /// The bridge is not configured for this application.
    #[error("no application {0:?} is configured for this router")]
    UnknownApp(String),
    /// The bridge says the device is gone for good.
    #[error("the bridge reports the device is gone")]
    DeviceGone,
    /// The bridge's payload limit is smaller than this message: it holds at
    /// most this many bytes of encrypted body.
    #[error("the message is too large for this bridge: at most {0} bytes")]
    TooMuchData(usize),
    /// The bridge refused this message for a reason of its own (e.g. FCM's
    /// `INVALID_ARGUMENT`); retrying the same message cannot help.
    #[error("the bridge refused the message: {0}")]
    Refused(String),
    #[error("the bridge refused our credentials")]
    Authentication,
    #[error("could not connect to the bridge: {0}")]
    Connect(String),
    #[error("the bridge did not answer in time")]
    Timeout,
    #[error("the bridge failed: {0}")]
    Upstream(String),
    /// The bridge (or our cap on requests in flight to it) asks senders to
    /// come back later.
    #[error("the bridge is busy; retry after {retry_after:?}")]
    Unavailable { retry_after: std::time::Duration },
    /// Too many requests, by our own rate for the app (`what`: `bridge
    /// app`) or by the upstream's answer (`bridge`): 429 for the sender,
    /// naming `limit`.
    #[error("too many requests for this {what}; retry after {} s", .limit.reset)]
    TooManyRequests {
        what: &'static str,
        limit: RateLimit,
    },
}

impl From<RouterError> for ApiError {
    fn from(e: RouterError) -> Self {
        match e {
            RouterError::InvalidRegistration(m) => ApiError::BadRequest(m),
            RouterError::UnknownApp(app) => ApiError::UnknownApp(app),
            RouterError::DeviceGone => ApiError::DeviceGone,
            RouterError::TooMuchData(max) => ApiError::BridgePayloadTooLarge(max),
            RouterError::Refused(m) => {
                ApiError::BadRequest(format!("the bridge refused the message: {m}"))
            }
            RouterError::Authentication => ApiError::BridgeAuthentication,
            RouterError::Connect(m) => ApiError::BridgeConnect(m),
            RouterError::Timeout => ApiError::BridgeTimeout,
            RouterError::Upstream(m) => ApiError::BridgeConnect(m),
            RouterError::Unavailable { retry_after } => ApiError::BridgeUnavailable {
                // Whole seconds, rounded up: `Retry-After: 0` would invite a storm.
                retry_after: retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0),
            },
            RouterError::TooManyRequests { what, limit } => {
                ApiError::TooManyRequests { what, limit }
            }
        }
    }
}

#[async_trait]
pub trait Router: Send + Sync {
    /// Validate what a client registers with for `app_id` and return the
    /// `router_data` to store in its user record.
    fn register(
        &self,
        input: &RouterDataInput,
        app_id: &str,
    ) -> Result<serde_json::Value, RouterError>;

    /// Add router-specific fields to a registration reply (e.g. a sender id).
    fn amend_endpoint_response(
        &self,
        _response: &mut serde_json::Map<String, serde_json::Value>,
        _router_data: &serde_json::Value,
    ) {
    }

    /// Deliver `notification` to `user`, or store it.
    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery>;

    /// Check a wake route a websocket client registers: `app_id` must be
    /// one of this bridge's apps and `token` a device token it can use.
    /// Bridges that cannot wake a client refuse every route.
    fn check_wake_route(&self, app_id: &str, _token: &str) -> Result<(), RouterError> {
        Err(RouterError::UnknownApp(app_id.to_owned()))
    }

    /// Send one content-free wake-up to device `token` of app `app_id`,
    /// within the app's limits.
    async fn wake(&self, app_id: &str, _token: &str, _wake: &WakeUp) -> Result<(), RouterError> {
        Err(RouterError::UnknownApp(app_id.to_owned()))
    }
}

/// What a wake-up may say: only how urgent and how long-lived the stored
/// message that caused it is. Nothing of the message itself (bytes,
/// channel, version, sender) ever reaches the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeUp {
    pub urgency: Urgency,
    /// Seconds the wake-up is worth delivering: at most the message's TTL.
    pub ttl: u64,
    /// When the message was stored, Unix seconds.
    pub timestamp: u64,
}

/// `data` with the value of every `token` key, at any depth, masked with
/// [`mask_token`].
pub fn mask_tokens(data: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match data {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, value)| {
                    let shown = match value {
                        Value::String(token) if key == "token" => Value::String(mask_token(token)),
                        other => mask_tokens(other),
                    };
                    (key.clone(), shown)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(mask_tokens).collect()),
        other => other.clone(),
    }
}

/// A router that can be replaced while it serves (a bridge's apps reloaded
/// on SIGHUP): each call goes to the router current when it starts, so a
/// swap waits for no request and drops none.
pub struct Swappable<R> {
    current: std::sync::RwLock<Arc<R>>,
}

impl<R: Router> Swappable<R> {
    pub fn new(router: Arc<R>) -> Swappable<R> {
        Swappable {
            current: std::sync::RwLock::new(router),
        }
    }

    /// The router serving now.
    pub fn current(&self) -> Arc<R> {
        // A panic elsewhere cannot leave the pointer half-written.
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Serve every call from now on with `router`.
    pub fn swap(&self, router: Arc<R>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = router;
    }
}

#[async_trait]
impl<R: Router + 'static> Router for Swappable<R> {
    fn register(
        &self,
        input: &RouterDataInput,
        app_id: &str,
    ) -> Result<serde_json::Value, RouterError> {
        self.current().register(input, app_id)
    }

    fn amend_endpoint_response(
        &self,
        response: &mut serde_json::Map<String, serde_json::Value>,
        router_data: &serde_json::Value,
    ) {
        self.current()
            .amend_endpoint_response(response, router_data);
    }

    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        self.current().route_notification(notification, user).await
    }

    fn check_wake_route(&self, app_id: &str, token: &str) -> Result<(), RouterError> {
        self.current().check_wake_route(app_id, token)
    }

    async fn wake(&self, app_id: &str, token: &str, wake: &WakeUp) -> Result<(), RouterError> {
        self.current().wake(app_id, token, wake).await
    }
}

/// One router per router type; a type without an entry is not served here.
#[derive(Default, Clone)]
pub struct RouterRegistry {
    routers: HashMap<RouterType, Arc<dyn Router>>,
}

impl RouterRegistry {
    pub fn with(mut self, router_type: RouterType, router: Arc<dyn Router>) -> Self {
        self.routers.insert(router_type, router);
        self
    }

    /// The router for `router_type`, if this service is configured for it.
    pub fn get(&self, router_type: RouterType) -> Option<&Arc<dyn Router>> {
        self.routers.get(&router_type)
    }

    /// Merge `other` in; its entries win.
    pub fn extend(mut self, other: RouterRegistry) -> Self {
        self.routers.extend(other.routers);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_requests_is_a_429_naming_its_limit_in_whole_seconds() {
        // Half a token short at 0.2 a second: 2.5 s.
        let standing = crate::limit::Standing {
            tokens: 0.5,
            rate: crate::limit::Rate::new(0.2, 2.0).unwrap(),
        };
        let error = ApiError::from(RouterError::TooManyRequests {
            what: "bridge app",
            limit: RateLimit::refused("bridge_app", standing),
        });
        assert_eq!(
            (error.status().as_u16(), error.errno(), error.retry_after()),
            (429, 201, Some(3))
        );
        let limit = error.rate_limit().unwrap();
        assert_eq!((limit.policy, limit.reset), ("bridge_app", 3));
        assert!(error.public_message().contains("bridge app"), "{error}");
    }

    #[test]
    fn tokens_are_masked_at_any_depth() {
        let token = "dGVzdC1yZWdpc3RyYXRpb24tdG9rZW4tZm9yLWZjbQ";
        let data = serde_json::json!({
            "token": token,
            "app_id": "app1",
            "creds": {"token": token, "senderID": "1234"},
        });
        let shown = mask_tokens(&data);
        assert!(!shown.to_string().contains(token), "{shown}");
        assert_eq!(shown["token"], mask_token(token));
        assert_eq!(shown["creds"]["token"], mask_token(token));
        assert_eq!(
            (
                shown["app_id"].as_str(),
                shown["creds"]["senderID"].as_str()
            ),
            (Some("app1"), Some("1234"))
        );
    }
}
