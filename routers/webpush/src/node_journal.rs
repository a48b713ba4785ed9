//! A connection node's own journal of the durable direct copies it holds,
//! on a shared store (DynamoDB, Bigtable, PostgreSQL): its senders never
//! wait for their clients, and a copy its client acks costs the shared
//! store no write.
//!
//! Without it the node holds a copy back for a grace of milliseconds and
//! writes it to the shared store unless the ack came first; a client 20 to
//! 300 ms away never acks that soon, so each of its pushes cost the shared
//! store a write, its settle a second, and its sender the wait.
//!
//! Here the copy goes to a journal on this node's disk: an embedded store
//! (its file journal, fsync'd and group-committed) in `--journal-dir`. The
//! sender hears 201 once the copy is synced there (or acked). The node then
//! keeps the copy for a window of seconds ([`WINDOW`]):
//! * acked within it, the copy is settled in the journal, which keeps its
//!   receipt (with receipts on): the endpoint that serves `GET /m/…` asks
//!   this node for it (`GET /receipt/…` on the router API), as the id the
//!   sender got names the node. The shared store sees nothing of it;
//! * not acked within it, or its client's session ending first, the copy
//!   is moved: written to the shared store, then forgotten here, and the
//!   node that holds the client now is told to look ([`NodeJournal::nudge`]).
//!
//! At start, before it serves anyone, the node moves what its journal
//! holds ([`NodeJournal::recover`]): the copies of a node killed or cut off
//! from power are delivered when it comes back. So the loss of a node's
//! disk loses the copies it held that were not acked nor moved yet: at most
//! a window's worth of its pushes. A node that never comes back delays
//! them until a node starts on its journal directory (copied to another
//! machine, if need be).
//!
//! Each move is a write of the message under its own key (a unique
//! timestamp: no Topic message is journaled), so a move repeated after a
//! crash writes the same message again, and its client's next connection
//! sees it at most twice: a duplicate, never a loss.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use autopush_common::Notification;
use autopush_common::ids::uaid_tag;
use autopush_common::node::LocalNode;
use autopush_common::notification::version_tag;
use autopush_common::receipt::MessageState;
use autopush_storage::embedded::EmbeddedStore;
use autopush_storage::{DirectCopy, Storage, StorageError, StoredMessage};
use futures_util::StreamExt;
use tracing::{info, warn};
use uuid::Uuid;

use crate::NodeClient;

/// How long the node keeps a copy its client has not acked before it
/// moves it to the shared store, unless `--journal-window` says otherwise.
/// Long enough for a client a few seconds away (a phone on a poor
/// network); short enough that a node lost for good loses little.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Memory for the journal's store: it holds at most a window of copies,
/// and the receipts of those acked (29 bytes each on disk) for their
/// retention.
const CACHE: usize = 8 << 20;

/// Moves to the shared store in flight at once while recovering.
const RECOVER_AT_ONCE: usize = 32;

/// See the module's notes.
pub struct NodeJournal {
    local: EmbeddedStore,
    shared: Arc<dyn Storage>,
    nodes: NodeClient,
    /// This node's id, as user records name it.
    node_id: String,
    window: Duration,
}

impl NodeJournal {
    /// Open the journal in `dir` (made if missing) of the node `node_id`,
    /// for copies bound for `shared`, each kept `window` for its ack;
    /// `nodes` tells other nodes to look. The receipts of copies acked
    /// here are kept `retention` seconds (0: receipts off).
    pub fn open(
        dir: &Path,
        node_id: &str,
        shared: Arc<dyn Storage>,
        nodes: NodeClient,
        window: Duration,
        retention: u64,
    ) -> Result<NodeJournal, StorageError> {
        let local = EmbeddedStore::open_with_cache(dir, CACHE)?.with_receipt_retention(retention);
        Ok(NodeJournal {
            local,
            shared,
            nodes,
            node_id: node_id.to_owned(),
            window,
        })
    }

    /// How long a copy is kept for its ack before it moves.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The copy of `message`, offered to its client: in the journal's
    /// index at once, and written after the journal's grace unless it is
    /// settled first ([`NodeJournal::acked`]).
    pub async fn stage(
        &self,
        uaid: &Uuid,
        message: Notification,
    ) -> Result<DirectCopy, StorageError> {
        self.local.stage_direct(uaid, message).await
    }

    /// The store of the journal, for its housekeeping (receipts past
    /// their retention).
    pub fn local(&self) -> &EmbeddedStore {
        &self.local
    }

    /// The receipt of the message `sort_key` of `uaid` whose client's id
    /// has `tag`, while this journal knows it: `sent` while it is kept
    /// here, `delivered` once acked here (for the receipts' retention).
    /// `None`: not here (never, moved, or forgotten).
    pub async fn receipt(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        tag: [u8; 8],
    ) -> Result<Option<(MessageState, u64)>, StorageError> {
        let now = autopush_common::time::now_secs();
        Ok(match self.local.read_message(uaid, sort_key).await? {
            Some(StoredMessage::Settled(receipt))
                if receipt.has_tag(tag) && receipt.expiry > now =>
            {
                Some((receipt.state, receipt.updated))
            }
            Some(StoredMessage::Pending(pending)) if version_tag(&pending.version) == tag => {
                Some((MessageState::Sent, pending.timestamp))
            }
            _ => None,
        })
    }

    /// The client acked `message` after its sender was answered: its copy
    /// here is settled, leaving its receipt here (with receipts on).
    pub async fn acked(&self, uaid: &Uuid, message: &Notification) {
        let settled = self
            .local
            .settle_message(
                uaid,
                &message.sort_key(),
                &message.version,
                MessageState::Delivered,
            )
            .await;
        if let Err(e) = settled {
            // Moved at the next start: delivered twice, not lost.
            warn!(error = %e, "could not settle a copy in the node's journal");
        }
    }

    /// Write `message` to the shared store, then forget it here.
    pub async fn move_to_shared(
        &self,
        uaid: &Uuid,
        message: &Notification,
    ) -> Result<(), StorageError> {
        self.shared.save_direct(uaid, message.clone()).await?;
        self.forget(uaid, message).await;
        Ok(())
    }

    /// [`NodeJournal::move_to_shared`] the copy kept here of `message`,
    /// known by its key and version (its keeper drops the payload once the
    /// copy is synced here): read back whole from this journal.
    pub async fn move_kept(&self, uaid: &Uuid, message: &Notification) -> Result<(), StorageError> {
        match self.local.read_message(uaid, &message.sort_key()).await? {
            Some(StoredMessage::Pending(kept)) if kept.version == message.version => {
                self.move_to_shared(uaid, &kept).await
            }
            // Only its keeper settles or forgets it, so this is not seen:
            // nothing is left here to move.
            _ => {
                warn!(uaid = %uaid_tag(uaid), "a kept copy to move is no longer in the node's journal");
                Ok(())
            }
        }
    }

    /// Drop the copy of `message` here, without a receipt: the shared
    /// store has it now, or it was acked before its sender was answered
    /// (whoever answers seals its receipt into its id, or writes it to the
    /// shared store), or the endpoint writes it.
    pub async fn forget(&self, uaid: &Uuid, message: &Notification) {
        let removed = self
            .local
            .remove_message(uaid, &message.sort_key(), &message.version)
            .await;
        if let Err(e) = removed {
            // Moved again at the next start: delivered twice, not lost.
            warn!(error = %e, "could not drop a moved copy from the node's journal");
        }
    }

    /// A copy of `uaid`'s was moved to the shared store: the session that
    /// holds the client now, here or on another node, may have looked
    /// there before, so tell it to look again. (One that still has the
    /// message in flight passes over it.)
    pub async fn nudge(&self, node: Option<&dyn LocalNode>, uaid: &Uuid) {
        let on = match self.shared.get_user(uaid).await {
            Ok(user) => user.and_then(|user| user.node_id),
            Err(e) => {
                warn!(uaid = %uaid_tag(uaid), error = %e, "could not read the user of a moved copy");
                return;
            }
        };
        match on {
            Some(on) if on == self.node_id => {
                if let Some(node) = node {
                    node.notify(uaid);
                }
            }
            Some(on) => {
                if let Err(e) = self.nodes.notify(&on, uaid).await {
                    warn!(node_id = %on, error = %e, "could not tell a node about a moved copy");
                }
            }
            None => {}
        }
    }

    /// Move every copy the journal holds to the shared store: at start,
    /// before this node serves anyone, so none of it is in flight. Returns
    /// how many moved. A failure stops the start: what is left stays here.
    pub async fn recover(&self) -> Result<usize, StorageError> {
        let users = self.local.users_with_messages().await?;
        let mut moves = futures_util::stream::iter(users)
            .map(|uaid| async move {
                let messages = self.local.fetch_messages(&uaid, usize::MAX).await?;
                for message in &messages {
                    self.move_to_shared(&uaid, message).await?;
                }
                self.nudge(None, &uaid).await;
                Ok::<_, StorageError>(messages.len())
            })
            .buffer_unordered(RECOVER_AT_ONCE);
        let mut moved = 0;
        while let Some(count) = moves.next().await {
            moved += count?;
        }
        if moved > 0 {
            info!(
                moved,
                "moved the copies the node's journal held to the shared store"
            );
        }
        Ok(moved)
    }
}
