//! `ack` and `nack`: the client is done with a notification.
//!
//! Either way the message leaves storage: a nack means the client received it
//! but its service worker failed, and sending it again would fail again.

use std::sync::atomic::Ordering;

use tracing::{debug, info};

use super::{Close, Flow, Session};
use crate::protocol::Update;

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
            info!(uaid = %self.uaid.simple(), code, "client could not process a notification");
            self.settle(&version).await?;
        }
        self.after_settling().await
    }

    /// Forget `version`, deleting it from storage if it came from there.
    async fn settle(&mut self, version: &str) -> Flow {
        if self.unacked_direct.remove(version).is_some() {
            self.signals.pending_direct.fetch_sub(1, Ordering::AcqRel);
        } else if let Some(notification) = self.unacked_stored.remove(version) {
            self.ctx
                .storage
                .remove_message(&self.uaid, &notification.sort_key())
                .await
                .map_err(|e| Close::server(e.to_string()))?;
        } else {
            debug!(uaid = %self.uaid.simple(), "ack for an unknown version");
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
