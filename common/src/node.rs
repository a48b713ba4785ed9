//! How an all-in-one process reaches its own connection node without an
//! HTTP round trip ([`LocalNode`]), and what a node says to an offered
//! notification ([`PushOutcome`]). The HTTP client for other nodes is the
//! webpush router's (`autopush_webpush::node_client`).

use uuid::Uuid;

use crate::Notification;

/// What happened to a notification offered to a connection node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Queued for the connected client.
    Delivered,
    /// The client is not connected to this node.
    NotConnected,
    /// The client is connected but cannot take more right now; store it.
    Busy,
}

/// A connection node that lives in this process.
pub trait LocalNode: Send + Sync {
    /// The node id written to user records (its internal router URL).
    fn node_id(&self) -> &str;
    /// Offer a notification to the client `uaid` if it is connected here.
    fn push(&self, uaid: &Uuid, notification: Notification) -> PushOutcome;
    /// Ask the client `uaid`, if connected here, to check storage. Returns
    /// whether it is connected.
    fn notify(&self, uaid: &Uuid) -> bool;
}
