//! The router (user) record: one per UAID, telling the endpoint how to reach it.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::notification::{Notification, Urgency};

/// How notifications for a user are delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterType {
    WebPush,
    Apns,
    Fcm,
    Gcm,
}

impl RouterType {
    /// The router type named in a `/v1/{type}/...` path.
    pub fn from_path(name: &str) -> Option<Self> {
        match name {
            "webpush" => Some(RouterType::WebPush),
            "apns" => Some(RouterType::Apns),
            "fcm" => Some(RouterType::Fcm),
            "gcm" => Some(RouterType::Gcm),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            RouterType::WebPush => "webpush",
            RouterType::Apns => "apns",
            RouterType::Fcm => "fcm",
            RouterType::Gcm => "gcm",
        }
    }
}

/// The router record of one user agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct User {
    pub uaid: Uuid,
    pub router_type: RouterType,
    /// Bridge-specific data (device token, app id); empty for webpush.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_data: Option<serde_json::Value>,
    /// Internal router URL of the connection node the client is on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// When the client connected to `node_id`, in milliseconds. Guards
    /// conditional writes so an older connection never overwrites a newer one.
    pub connected_at: u64,
    /// Last time the client said hello, in milliseconds.
    #[serde(default)]
    pub last_connect: u64,
    /// At its last hello the client had more stored messages than the node's
    /// `msg_limit`: it was sent what fits, and if it is still over the limit
    /// at its next hello it starts over with a new UAID.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub over_msg_limit: bool,
    /// With legacy monthly message tables (`--message-table-rotation`): the
    /// message table holding this user's channels and the messages it has
    /// not read yet, e.g. `message_2026_11`. Kept as read; `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_month: Option<String>,
    /// The least urgent message the user agent wants now (RFC 8030 §5.3),
    /// set with the websocket's `urgency` message: less urgent ones are
    /// held in storage. `very-low` (take everything) is not stored.
    #[serde(default = "lowest", skip_serializing_if = "is_lowest")]
    pub min_urgency: Urgency,
    /// Where a wake-up goes when a message is stored while the client is
    /// away (the websocket's `wake` message); `None`: no wake-ups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_route: Option<WakeRoute>,
    /// When the last wake-up went to this user agent, in milliseconds (0:
    /// never). Conditional writes on it decide which endpoint node sends
    /// the next one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub last_wake: u64,
}

fn lowest() -> Urgency {
    Urgency::VeryLow
}

fn is_lowest(urgency: &Urgency) -> bool {
    *urgency == Urgency::VeryLow
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A client's wake route: the bridge app (an APNs channel or an FCM app of
/// this server) and the device token a content-free wake-up is sent to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeRoute {
    pub router: RouterType,
    pub app_id: String,
    pub token: String,
}

impl WakeRoute {
    /// The route as stored on DynamoDB and Bigtable: compact JSON, its
    /// fields always in this order, so conditions compare it as text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> Option<WakeRoute> {
        serde_json::from_str(text).ok()
    }
}

/// The `router_data` key of a bridge registration that asked for a mailbox.
pub const MAILBOX: &str = "mailbox";

/// The `last_wake` of a wake-only registration whose app listed its
/// mailbox since its last wake-up: long past, so the next message wakes it
/// again (0 would read as "never woken", which a store may keep as no value).
pub const WAKE_ANSWERED: u64 = 1;

/// The `router_data` key of a bridge registration with a mailbox whose
/// upstream pushes are content-free wake-ups.
pub const WAKE_ONLY: &str = "wake_only";

impl User {
    /// Whether this bridge registration keeps its messages in a mailbox
    /// until the app acks them, besides sending them upstream.
    pub fn has_mailbox(&self) -> bool {
        self.router_type != RouterType::WebPush && self.router_flag(MAILBOX)
    }

    /// Whether this bridge registration keeps its messages in its mailbox
    /// only, and its device gets wake-ups instead (see [`User::own_wake_route`]).
    pub fn is_wake_only(&self) -> bool {
        self.has_mailbox() && self.router_flag(WAKE_ONLY)
    }

    /// Where a wake-only registration's wake-ups go: its own app and
    /// device token (`None` for any other user).
    pub fn own_wake_route(&self) -> Option<WakeRoute> {
        if !self.is_wake_only() {
            return None;
        }
        let data = self.router_data.as_ref()?;
        let text = |key: &str| data.get(key).and_then(|v| v.as_str()).map(str::to_owned);
        Some(WakeRoute {
            router: self.router_type,
            app_id: text("app_id")?,
            token: text("token")?,
        })
    }

    /// Whether `router_data` holds `key: true`.
    fn router_flag(&self, key: &str) -> bool {
        self.router_data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|m| m.as_bool())
            == Some(true)
    }

    /// A fresh webpush user connected to `node_id` now.
    pub fn new_webpush(uaid: Uuid, node_id: &str, connected_at: u64) -> Self {
        User {
            uaid,
            router_type: RouterType::WebPush,
            router_data: None,
            node_id: Some(node_id.to_owned()),
            connected_at,
            last_connect: connected_at,
            over_msg_limit: false,
            current_month: None,
            min_urgency: Urgency::VeryLow,
            wake_route: None,
            last_wake: 0,
        }
    }

    /// Carry over what a new connection leaves as it was in `read`, the
    /// record it takes over: the minimum urgency, the wake route and the
    /// last wake-up. A store whose cells expire (Bigtable) writes them
    /// again while they are unchanged, so they live as long as the user.
    pub fn keep_as_read(&mut self, read: &User) {
        self.min_urgency = read.min_urgency;
        self.wake_route = read.wake_route.clone();
        self.last_wake = read.last_wake;
    }

    /// Whether `message` waits in storage until the user agent lowers its
    /// minimum urgency.
    pub fn holds(&self, message: &Notification) -> bool {
        message.is_below(self.min_urgency)
    }
}
