//! Stored notifications: sent in batches after hello and whenever the node
//! is told to look; written back for direct ones the client never acked.

use autopush_common::node::LocalNode;
use autopush_common::time::now_secs;
use tracing::debug;

use super::{Close, Flow, Session};
use crate::protocol::ServerMessage;

/// Stored messages sent at once; the next batch waits for their acks.
const BATCH: usize = 100;

impl Session {
    pub(super) async fn check_storage(&mut self) -> Flow {
        if !self.unacked_stored.is_empty() {
            // Some are still out; look again once they are settled.
            self.recheck_storage = true;
            return Ok(());
        }
        let messages = self
            .ctx
            .storage
            .fetch_messages(&self.uaid, BATCH)
            .await
            .map_err(|e| Close::server(e.to_string()))?;
        self.recheck_storage = messages.len() == BATCH;
        debug!(uaid = %self.uaid.simple(), count = messages.len(), "sending stored notifications");
        for message in messages {
            // A direct notification stored at a previous disconnect may still
            // be out with this client.
            if self.unacked_direct.contains_key(&message.version) {
                continue;
            }
            self.unacked_stored
                .insert(message.version.clone(), message.clone());
            self.send(&ServerMessage::notification(&message)).await?;
        }
        Ok(())
    }

    /// Store the direct notifications the client never acknowledged, then
    /// nudge a newer connection of the same user to pick them up.
    pub(super) async fn store_unacked_direct(
        &mut self,
    ) -> Result<(), autopush_storage::StorageError> {
        let now = now_secs();
        let keep: Vec<_> = self
            .unacked_direct
            .drain()
            .map(|(_, n)| n)
            .filter(|n| n.ttl > 0 && !n.is_expired(now))
            .collect();
        if keep.is_empty() {
            return Ok(());
        }
        debug!(uaid = %self.uaid.simple(), count = keep.len(), "storing unacknowledged direct notifications");
        self.ctx.storage.save_messages(&self.uaid, keep).await?;
        if !LocalNode::notify(self.ctx.registry.as_ref(), &self.uaid)
            && let Some(node_id) = self
                .ctx
                .storage
                .get_user(&self.uaid)
                .await?
                .and_then(|u| u.node_id)
            && node_id != self.ctx.node_id()
        {
            let _ = self
                .ctx
                .http
                .put(format!("{node_id}/notif/{}", self.uaid.simple()))
                .send()
                .await;
        }
        Ok(())
    }
}
