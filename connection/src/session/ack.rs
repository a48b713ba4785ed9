//! `ack` and `nack`: the client is done with a notification, or could not
//! process it.
//!
//! An ack settles a stored message as `delivered` (its row becomes its
//! receipt, or is deleted with receipts off), but only the version acked: a
//! newer message that replaced it under the same Topic stays. A nack (Firefox
//! sends one when the service worker's push handler failed) deletes nothing,
//! as in the seeds: the message is logged, not sent again in this session,
//! and offered again at the client's next connection until its TTL runs out
//! (a nacked direct one is stored for that, if it was not already).

use std::collections::VecDeque;

use autopush_common::ids::uaid_tag;
use autopush_common::metrics;
use autopush_common::node::LocalNode;
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use autopush_common::{Notification, RouterType};

use tracing::{debug, info};

use super::stored::BATCH;
use super::{Close, Flow, Session};
use crate::protocol::Update;
use crate::registry::MAX_PENDING_DIRECT;

/// The versions of the stored messages settled last, so that a durable
/// direct copy of one, arriving from the inbox after its stored copy was
/// sent and acked, is not delivered a second time.
#[derive(Default)]
pub(super) struct RecentlySettled(VecDeque<String>);

impl RecentlySettled {
    /// Versions remembered; the oldest is forgotten first. A client may
    /// ack a whole stored batch at once while up to `MAX_PENDING_DIRECT`
    /// durable direct copies wait in its inbox: that many are remembered.
    const CAPACITY: usize = BATCH + MAX_PENDING_DIRECT;

    pub(super) fn remember(&mut self, version: &str) {
        if self.0.len() == Self::CAPACITY {
            self.0.pop_front();
        }
        self.0.push_back(version.to_owned());
    }

    pub(super) fn contains(&self, version: &str) -> bool {
        self.0.iter().any(|v| v == version)
    }
}

impl Session {
    pub(super) async fn ack(&mut self, updates: Vec<Update>) -> Flow {
        for update in updates {
            self.settle(&update.version).await?;
        }
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
            if let Some(direct) = self.unacked_direct.remove(&version) {
                self.keep_nacked_direct(direct).await?;
                continue;
            }
            if self.unacked_stored.remove(&version).is_some() {
                self.skip_stored.insert(version);
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
                self.unacked_direct.insert(direct.version.clone(), direct);
                return Err(Close::storage(e));
            }
        }
        self.skip_stored.insert(direct.version);
        Ok(())
    }

    /// The client acked `version`: forget it, deleting it from storage if
    /// it came from there or has a durable copy there.
    async fn settle(&mut self, version: &str) -> Flow {
        let stored = if let Some(direct) = self.unacked_direct.remove(version) {
            self.inbox.settled_direct();
            metrics::ack("direct");
            // A copy held back for its grace is its holder's to settle.
            let held = direct.durable && self.ctx.registry.held_copies().ack(&self.uaid, version);
            (direct.durable && !held).then_some(direct)
        } else if let Some(stored) = self.unacked_stored.remove(version) {
            self.recently_settled.remember(version);
            metrics::ack("stored");
            Some(stored)
        } else {
            debug!(uaid = %uaid_tag(&self.uaid), "ack for an unknown version");
            metrics::ack("unknown");
            None
        };
        if let Some(message) = stored {
            let settled = self
                .ctx
                .storage
                .settle_message(
                    &self.uaid,
                    &message.sort_key(),
                    version,
                    MessageState::Delivered,
                )
                .await
                .map_err(Close::storage)?;
            if settled {
                metrics::final_state(RouterType::WebPush, MessageState::Delivered);
            }
        }
        Ok(())
    }

    /// With every stored message settled, fetch the next batch if one is owed.
    async fn after_settling(&mut self) -> Flow {
        if self.unacked_stored.is_empty() && self.recheck_storage {
            self.check_storage().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client acks a full stored batch at once while durable direct
    /// copies of those messages wait in its inbox (at most
    /// `MAX_PENDING_DIRECT` of them): every version of the batch, and of as
    /// many more, must still be recognised when the copies come out.
    #[test]
    fn a_full_batch_and_the_direct_window_are_remembered() {
        let mut settled = RecentlySettled::default();
        let versions: Vec<String> = (0..BATCH + MAX_PENDING_DIRECT)
            .map(|i| format!("v{i}"))
            .collect();
        for version in &versions {
            settled.remember(version);
        }
        let forgotten = versions.iter().filter(|v| !settled.contains(v)).count();
        assert_eq!(
            forgotten,
            0,
            "{forgotten} of the last {} settled versions forgotten",
            versions.len()
        );
        // Bounded all the same: the oldest goes first.
        settled.remember("one more");
        assert!(!settled.contains("v0") && settled.contains("one more"));
    }
}
