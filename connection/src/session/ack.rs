//! `ack` and `nack`: the client is done with a notification, or could not
//! process it.
//!
//! An ack settles a stored message as `delivered` (its row becomes its
//! receipt, or is deleted with receipts off), but only the version acked: a
//! newer message that replaced it under the same Topic stays. The stored
//! messages one `ack` names are settled together, in one write where the
//! backend can (one statement on PostgreSQL). A nack (Firefox sends one
//! when the service worker's push handler failed) deletes nothing, as in
//! the seeds: the message is logged, not sent again in this session, and
//! offered again at the client's next connection until its TTL runs out (a
//! nacked direct one is stored for that, if it was not already).

use autopush_common::ids::uaid_tag;
use autopush_common::metrics;
use autopush_common::node::LocalNode;
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use autopush_common::{Notification, RouterType};

use tokio::time::Instant;
use tracing::{debug, info};

use super::{Close, Flow, Session};
use crate::protocol::Update;

impl Session {
    /// The messages one `ack` leaves in storage (sent from there, or a
    /// direct message's durable copy) go to storage together, in one call.
    pub(super) async fn ack(&mut self, updates: Vec<Update>) -> Flow {
        let mut stored = Vec::new();
        for update in updates {
            if let Some(message) = self.forget(&update.version) {
                stored.push((message.sort_key(), update.version));
            }
        }
        self.settle_stored(stored).await?;
        self.after_settling().await
    }

    pub(super) async fn nack(
        &mut self,
        updates: Vec<Update>,
        version: Option<String>,
        code: Option<u32>,
    ) -> Flow {
        let versions = updates
            .into_iter()
            .map(|u| (u.version, u.code.or(code)))
            .chain(version.map(|v| (v, code)));
        for (version, code) in versions {
            metrics::nack();
            info!(uaid = %uaid_tag(&self.uaid), code, "client could not process a notification; kept for its next connection");
            let in_flight = self.in_flight_mut();
            in_flight.stored_too.remove(&version);
            if let Some((direct, _)) = in_flight.unacked_direct.remove(&version) {
                self.keep_nacked_direct(direct).await?;
                continue;
            }
            if in_flight.unacked_stored.remove(&version).is_some() {
                in_flight.skip_stored.insert(version);
            }
        }
        self.after_settling().await
    }

    /// A nacked direct notification no longer counts against the client's
    /// window of pending direct ones (or every push would soon be stored
    /// instead). It is kept for the client's next connection, as a nacked
    /// stored one is: a durable one is in storage already, another is
    /// stored now (unless its TTL is 0 or over). Like those, it is not sent
    /// again in this session.
    async fn keep_nacked_direct(&mut self, direct: Notification) -> Flow {
        self.inbox.settled_direct();
        let keep = direct.ttl > 0 && !direct.is_expired(now_secs());
        if keep && !direct.durable {
            let saved = self
                .ctx
                .storage
                .save_messages(&self.uaid, vec![direct.clone()])
                .await;
            if let Err(e) = saved {
                // Stored as unacknowledged when the session ends instead.
                self.in_flight_mut().unacked(direct, Instant::now());
                return Err(Close::storage(e));
            }
        }
        self.in_flight_mut().skip_stored.insert(direct.version);
        Ok(())
    }

    /// The client acked `version`: forget it, and return it if it is left
    /// in storage to settle (it came from there, or has a durable copy
    /// there).
    fn forget(&mut self, version: &str) -> Option<Notification> {
        let in_flight = self.in_flight_mut();
        if let Some((direct, sent)) = in_flight.unacked_direct.remove(version) {
            let stored_too = in_flight.stored_too.remove(version);
            self.inbox.settled_direct();
            self.inbox.acked_after(sent.elapsed());
            metrics::ack("direct");
            // A copy held back for its grace is its holder's to settle,
            // unless an endpoint wrote one to storage too.
            let held = direct.durable && self.ctx.registry.held_copies().ack(&self.uaid, version);
            if held {
                let acked = &mut self.in_flight_mut().recently_acked_held;
                acked.remember(version, Instant::now());
            }
            (direct.durable && (!held || stored_too)).then_some(direct)
        } else if let Some(stored) = in_flight.unacked_stored.remove(version) {
            in_flight.recently_settled.remember(version, Instant::now());
            metrics::ack("stored");
            Some(stored)
        } else {
            debug!(uaid = %uaid_tag(&self.uaid), "ack for an unknown version");
            metrics::ack("unknown");
            None
        }
    }

    /// Settle the acked messages stored under these `(sort_key, version)`s
    /// as `delivered`, each if it is still that version.
    pub(super) async fn settle_stored(&mut self, messages: Vec<(String, String)>) -> Flow {
        let settled = match messages.as_slice() {
            [] => return Ok(()),
            // One (a client acking one at a time): as ever.
            [(sort_key, version)] => vec![
                self.ctx
                    .storage
                    .settle_message(&self.uaid, sort_key, version, MessageState::Delivered)
                    .await
                    .map_err(Close::storage)?,
            ],
            _ => self
                .ctx
                .storage
                .settle_messages(&self.uaid, &messages, MessageState::Delivered)
                .await
                .map_err(Close::storage)?,
        };
        for _ in settled.into_iter().filter(|settled| *settled) {
            metrics::final_state(RouterType::WebPush, MessageState::Delivered);
        }
        Ok(())
    }

    /// With every stored message settled, fetch the next batch if one is owed.
    async fn after_settling(&mut self) -> Flow {
        if self.in_flight().unacked_stored.is_empty() && self.recheck_storage {
            self.check_storage().await?;
        }
        Ok(())
    }
}
