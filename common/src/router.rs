//! The `Router` trait: how a notification reaches a user of one router type.
//! The gateway keeps one router per [`RouterType`](crate::RouterType) in a registry.

use async_trait::async_trait;

use crate::{ApiResult, Notification, User};

/// How a router disposed of a notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Handed to the client (or to the bridge) right away.
    Direct,
    /// Kept until the client comes back.
    Stored,
    /// TTL 0 and the client was not reachable now: dropped, as the sender asked.
    Dropped,
}

#[async_trait]
pub trait Router: Send + Sync {
    /// Deliver `notification` to `user`, or store it.
    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery>;
}
