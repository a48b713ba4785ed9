//! `urgency`: the least urgent message the user agent wants now (RFC 8030
//! §5.3), kept on its user record so that it holds on every node.
//!
//! A message below the minimum is held: the endpoint stores it instead of
//! routing it here, and storage checks pass over it. Lowering the minimum
//! looks at storage once the record says so, so a message held meanwhile
//! (stored after this check by an endpoint that read the record before the
//! write) is not left behind: that endpoint reads the record again after
//! storing and, finding the new minimum, tells this node to look. One that
//! routed it here instead holds its copy with this node (DynamoDB,
//! Bigtable): the session, holding the message back, has that copy written
//! at once rather than at the end of the grace, so a lowering right after
//! finds it too.

use std::time::Duration;

use autopush_common::Notification;
use autopush_common::ids::uaid_tag;
use autopush_common::node::LocalNode;
use autopush_common::time::now_secs;
use serde_json::Value;
use tokio::time::{Instant, timeout};
use tracing::{debug, info, warn};

use super::{Close, Flow, Session};
use crate::protocol::{ServerMessage, min_urgency};

/// How long a session waits for the holder of a copy it held back to write
/// it: a bound on a storage write with its retries (a failed write ends the
/// wait at once).
const COPY_WRITTEN_WITHIN: Duration = Duration::from_secs(10);

impl Session {
    pub(super) async fn set_min_urgency(&mut self, min: &Value) -> Flow {
        let reply = |status: u16, reason: Option<&str>| ServerMessage::Urgency {
            status,
            reason: reason.map(str::to_owned),
        };
        let min = match min_urgency(min) {
            Ok(min) => min,
            Err(reason) => return self.send(&reply(400, Some(&reason))).await,
        };
        let written = self
            .ctx
            .storage
            .set_min_urgency(&self.uaid, self.ctx.node_id(), self.connected_at, min)
            .await;
        match written {
            Ok(true) => {}
            // Another connection of this user agent took the record over,
            // or the user was removed: this one is on its way out.
            Ok(false) => {
                return Err(Close::new(
                    4000,
                    "this connection no longer holds the user agent's record; say hello again",
                ));
            }
            Err(e) => {
                let reason = self.storage_failed("urgency", &e);
                return self.send(&reply(500, Some(reason))).await;
            }
        }
        let lowered = min < self.min_urgency;
        info!(uaid = %uaid_tag(&self.uaid), min = min.as_str(), "minimum urgency set");
        self.min_urgency = min;
        self.send(&reply(200, None)).await?;
        if lowered {
            // What was held and is now accepted, oldest first.
            self.check_storage().await?;
        }
        Ok(())
    }

    /// A direct message below the minimum (routed before the endpoint read
    /// a minimum just raised): held in storage like one the endpoint held,
    /// or dropped if its TTL is 0.
    pub(super) async fn hold_direct(&mut self, message: Notification) -> Flow {
        self.inbox.settled_direct();
        debug!(uaid = %uaid_tag(&self.uaid), "holding a direct message below the minimum urgency");
        if message.durable {
            // Its copy is in storage, or held by this node until an ack
            // that will not come: have it written now, so that lowering
            // the minimum right after finds it.
            let held = self.ctx.registry.held_copies();
            let written = held.written_now(&self.uaid, &message.version);
            if timeout(COPY_WRITTEN_WITHIN, written).await.is_err() {
                warn!(uaid = %uaid_tag(&self.uaid), "a held direct copy is not written yet; it waits for the next storage check");
            }
            return Ok(());
        }
        if message.ttl == 0 || message.is_expired(now_secs()) {
            return Ok(());
        }
        if let Err(e) = self
            .ctx
            .storage
            .save_messages(&self.uaid, vec![message.clone()])
            .await
        {
            // Stored as unacknowledged when the session ends instead.
            self.in_flight_mut().unacked(message, Instant::now());
            return Err(Close::storage(e));
        }
        Ok(())
    }
}
