//! Stored notifications: sent in batches after hello and whenever the node
//! is told to look; written back for direct ones the client never acked.

use std::sync::Arc;

use autopush_common::Notification;
use autopush_common::ids::uaid_tag;
use autopush_common::node::LocalNode;
use autopush_common::time::now_secs;
use tracing::debug;
use uuid::Uuid;

use super::{Close, Flow, Session};
use crate::NodeContext;
use crate::protocol::notification_json;

/// Stored messages sent at once; the next batch waits for their acks.
pub(super) const BATCH: usize = 100;

impl Session {
    pub(super) async fn check_storage(&mut self) -> Flow {
        if !self.in_flight().unacked_stored.is_empty() {
            // Some are still out; look again once they are settled.
            self.recheck_storage = true;
            return Ok(());
        }
        let batch = self.stored_budget.map_or(BATCH, |left| left.min(BATCH));
        if batch == 0 {
            self.recheck_storage = false;
            return Ok(());
        }
        // Nacked messages stay stored but are not sent again in this
        // session, and held ones (below the minimum urgency) wait: fetch
        // past them. Held ones are counted, so the next look fetches past
        // them in one read; until then the fetch doubles while they fill it.
        // A direct copy acked while this node wrote it is about to be
        // settled by its holder: passed over too. A copy of a held message
        // in flight, or acked already, was written by an endpoint that gave
        // up on this node: settled at its ack, or now.
        let ctx = self.ctx.clone();
        let copies = ctx.registry.held_copies();
        let mut limit = batch + self.in_flight().skip_stored.len() + self.held;
        let (ready, held, acked) = loop {
            let messages = self
                .ctx
                .storage
                .fetch_messages(&self.uaid, limit)
                .await
                .map_err(Close::storage)?;
            let read = messages.len();
            let (mut ready, mut held, mut acked) = (Vec::new(), 0, Vec::new());
            for message in messages {
                let version = &message.version;
                if self.in_flight().unacked_direct.contains_key(version) {
                    if copies.holds(&self.uaid, version) {
                        self.in_flight_mut().stored_too.insert(version.clone());
                    }
                    continue;
                }
                if self.in_flight().skip_stored.contains(version)
                    || copies.settling(&self.uaid, version)
                {
                    continue;
                }
                if self.in_flight().recently_acked_held.contains(version) {
                    acked.push((message.sort_key(), version.clone()));
                    continue;
                }
                if message.is_below(self.min_urgency) {
                    held += 1;
                    continue;
                }
                if ready.len() < batch {
                    ready.push(message);
                }
            }
            if ready.len() == batch || read < limit {
                break (ready, held, acked);
            }
            limit = limit.saturating_mul(2);
        };
        self.settle_stored(acked).await?;
        self.held = held;
        let fresh = ready.len();
        let mut sent = 0;
        for message in ready {
            // A direct notification stored at a previous disconnect (or
            // durably, before it was sent) may still be out with this client.
            if self
                .in_flight()
                .unacked_direct
                .contains_key(&message.version)
            {
                continue;
            }
            self.in_flight_mut()
                .unacked_stored
                .insert(message.version.clone(), message.clone());
            self.send_text(notification_json(&message)).await?;
            sent += 1;
        }
        autopush_common::metrics::stored_sent(sent);
        if let Some(left) = &mut self.stored_budget {
            *left = left.saturating_sub(sent);
        }
        self.recheck_storage = fresh == batch && self.stored_budget != Some(0);
        debug!(uaid = %uaid_tag(&self.uaid), count = sent, "sent stored notifications");
        Ok(())
    }

    /// Store the direct notifications the client never acknowledged (those
    /// without a durable copy already), then nudge a newer connection of the
    /// same user to pick them up.
    pub(super) async fn store_unacked_direct(
        &mut self,
    ) -> Result<(), autopush_storage::StorageError> {
        let unacked = self
            .in_flight
            .as_mut()
            .map(|f| f.unacked_direct.drain().map(|(_, (n, _))| n).collect())
            .unwrap_or_default();
        store_undelivered(&self.ctx, &self.uaid, unacked).await
    }
}

/// Store direct notifications that were routed to a session of `uaid` but
/// never acknowledged, so the client gets them at its next connection. Those
/// with TTL 0 ("now or never") or past their TTL are dropped; those the
/// endpoint already stored durably need no second write. Then the session
/// that replaced this one, if any, is told to look in storage.
pub(super) async fn store_undelivered(
    ctx: &Arc<NodeContext>,
    uaid: &Uuid,
    notifications: Vec<Notification>,
) -> Result<(), autopush_storage::StorageError> {
    // A durable one's holder writes its copy now, if it holds one here.
    for held in notifications.iter().filter(|n| n.durable) {
        ctx.registry.held_copies().write_now(uaid, &held.version);
    }
    let now = now_secs();
    let keep: Vec<_> = notifications
        .into_iter()
        .filter(|n| n.ttl > 0 && !n.is_expired(now))
        .collect();
    if keep.is_empty() {
        return Ok(());
    }
    let unstored: Vec<_> = keep.iter().filter(|n| !n.durable).cloned().collect();
    debug!(uaid = %uaid_tag(uaid), count = keep.len(), written = unstored.len(), "storing unacknowledged direct notifications");
    ctx.storage.save_messages(uaid, unstored).await?;
    if !LocalNode::notify(ctx.registry.as_ref(), uaid)
        && let Some(node_id) = ctx.storage.get_user(uaid).await?.and_then(|u| u.node_id)
        && node_id != ctx.node_id()
    {
        let _ = ctx.nodes.notify(&node_id, uaid).await;
    }
    Ok(())
}
