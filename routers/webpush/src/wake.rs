//! Wake-ups: a user agent that registered a wake route (the websocket's
//! `wake` message) and is away gets one content-free push through APNs or
//! FCM when a message is stored for it, so its app reconnects and drains.
//!
//! The rule, after a message is stored and the user record read again:
//! the record has a wake route and names no connection node; the message is
//! at least as urgent as the threshold; and no wake-up went out within the
//! interval, unless the client has connected since the last one (that one
//! was answered). Endpoint nodes race on one conditional write of the
//! record's `last_wake`: the node whose write holds sends. A user without a
//! route costs nothing here: no storage request, no task.
//!
//! A wake-up never fails the push: the message is stored, the sender gets
//! its 201 either way. A bridge answer that the device is gone removes the
//! route (if it is still that route); the subscription stays.
//!
//! A wake-only bridge registration (its messages in its mailbox only) is
//! woken by the same rule, through its own app and device token; its app
//! answers a wake-up by listing its mailbox. A device gone removes that
//! registration (if it is still as read), as a bridged push's would.

use std::sync::Arc;
use std::time::Duration;

use autopush_common::metrics::wake_up;
use autopush_common::router::{RouterError, RouterRegistry, WakeUp};
use autopush_common::time::now_millis;
use autopush_common::{Notification, Urgency, User, WakeRoute};
use autopush_storage::Storage;
use tracing::{debug, warn};

/// `--wake-threshold` and `--wake-interval`.
#[derive(Clone, Copy, Debug)]
pub struct WakeSettings {
    /// The least urgent message that wakes a client.
    pub threshold: Urgency,
    /// At most one wake-up per user agent within this time (while it stays
    /// away).
    pub interval: Duration,
}

impl Default for WakeSettings {
    fn default() -> Self {
        WakeSettings {
            threshold: Urgency::Normal,
            interval: Duration::from_secs(30),
        }
    }
}

/// Sends wake-ups through the bridges of this endpoint.
pub struct Waker {
    storage: Arc<dyn Storage>,
    /// The APNs and FCM routers.
    bridges: RouterRegistry,
    settings: WakeSettings,
}

/// What a wake-up may say of `notification`: its urgency and lifetime only.
pub fn wake_up_for(notification: &Notification) -> WakeUp {
    WakeUp {
        urgency: notification.urgency.unwrap_or(Urgency::Normal),
        ttl: notification.ttl,
        timestamp: notification.timestamp,
    }
}

/// Urgencies in order, least urgent first.
fn rank(urgency: Urgency) -> u8 {
    match urgency {
        Urgency::VeryLow => 0,
        Urgency::Low => 1,
        Urgency::Normal => 2,
        Urgency::High => 3,
    }
}

impl Waker {
    pub fn new(storage: Arc<dyn Storage>, bridges: RouterRegistry, settings: WakeSettings) -> Self {
        Waker {
            storage,
            bridges,
            settings,
        }
    }

    /// A message was stored for `user` (read after storing: not connected
    /// anywhere): send a wake-up if the rule says so. The claim and the
    /// send run on their own task, so the sender's 201 never waits for
    /// Apple or Google.
    pub fn after_stored(self: &Arc<Self>, user: &User, wake: WakeUp) {
        if user.node_id.is_some() || rank(wake.urgency) < rank(self.settings.threshold) {
            return;
        }
        let Some(route) = user.wake_route.clone().or_else(|| user.own_wake_route()) else {
            return;
        };
        let now = now_millis();
        if self.recently_woken(user, now) {
            wake_up(route.router, "coalesced");
            return;
        }
        let (waker, user) = (self.clone(), user.clone());
        tokio::spawn(async move { waker.claim_and_send(&user, route, now, wake).await });
    }

    /// A wake-up went out within the interval, and the client has not
    /// connected since (it has not answered it yet). Its connection is
    /// read from `connected_at`, which every hello sets to the
    /// millisecond: DynamoDB keeps `last_connect` by the hour.
    fn recently_woken(&self, user: &User, now: u64) -> bool {
        let interval = self.settings.interval.as_millis() as u64;
        user.last_wake > 0
            && now < user.last_wake.saturating_add(interval)
            && user.connected_at <= user.last_wake
    }

    async fn claim_and_send(&self, user: &User, route: WakeRoute, now: u64, wake: WakeUp) {
        match self
            .storage
            .claim_wake(&user.uaid, user.last_wake, now)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                // Another endpoint node sent it (or the user is gone).
                wake_up(route.router, "coalesced");
                return;
            }
            Err(e) => {
                warn!(error = %e, "could not record a wake-up; not sending it");
                wake_up(route.router, "failed");
                return;
            }
        }
        let result = match self.bridges.get(route.router) {
            Some(bridge) => bridge.wake(&route.app_id, &route.token, &wake).await,
            None => Err(RouterError::UnknownApp(route.app_id.clone())),
        };
        match result {
            Ok(()) => {
                debug!(router = route.router.as_str(), app = %route.app_id, "wake-up sent");
                wake_up(route.router, "sent");
            }
            Err(RouterError::DeviceGone) => {
                self.forget_route(user, &route).await;
                // Counted once the route is gone.
                wake_up(route.router, "failed");
            }
            Err(e) => {
                wake_up(route.router, "failed");
                warn!(router = route.router.as_str(), app = %route.app_id, error = %e, "wake-up failed");
            }
        }
    }

    /// The bridge says the device of `route` is gone: a websocket client
    /// loses its wake route, a wake-only registration itself goes (the
    /// sender's next push gets 410), each only if still as `user` read it.
    async fn forget_route(&self, user: &User, route: &WakeRoute) {
        if user.wake_route.as_ref() != Some(route) {
            match self.storage.remove_user_if_unchanged(user).await {
                Ok(_) => debug!(app = %route.app_id, "the device is gone; registration removed"),
                Err(e) => warn!(error = %e, "could not remove a registration whose device is gone"),
            }
            return;
        }
        match self.storage.remove_wake_route(&user.uaid, route).await {
            Ok(_) => debug!(app = %route.app_id, "the device is gone; wake route removed"),
            Err(e) => warn!(error = %e, "could not remove a wake route whose device is gone"),
        }
    }
}
