//! Durable direct copies held back by the connection node (on stores whose
//! every write is a billed request, see
//! [`autopush_storage::Storage::node_holds_direct_copies`]).
//!
//! The node that holds the client is the one that sees its ack, so it holds
//! the copy: it offers the message, waits up to the grace for the ack, and
//! writes the copy only if none came; then it answers the endpoint, which
//! answers 201. A 201 still means "on disk or acked": the endpoint writes
//! the copy itself whenever the node did not say it was acked or written
//! (no answer, a failed write, an older node). An endpoint that seals an
//! acked message's receipt into its id (router API 4 and later, and the
//! one in this process) needs nothing written for an ack within the grace:
//! such a push costs no write at all.

use std::sync::Arc;
use std::time::Duration;

use autopush_common::metrics;
use autopush_common::node::{GraceEnd, HeldCopies, LocalNode, PushOutcome};
use autopush_common::receipt::MessageState;
use autopush_common::{Notification, RouterType};
use autopush_storage::Storage;
use tokio::sync::{Notify, oneshot};
use tracing::warn;
use uuid::Uuid;

use crate::node_journal::NodeJournal;

/// On `PUT /push`, the endpoint's request that the node hold the durable
/// copy (value [`HOLD`]); on the node's answer, what became of it
/// ([`CopyFate`]). Not signed: changing it can only make a copy be written
/// twice (a duplicate delivery), never missing.
pub const DURABLE_COPY: &str = "x-autopush-durable-copy";

/// The request value of [`DURABLE_COPY`].
pub const HOLD: &str = "hold";

/// What became of a copy the node held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyFate {
    /// The client acked it: nothing is left to keep (but its receipt).
    Acked,
    /// No ack within the grace: the copy is in storage, settled at the ack.
    Written,
    /// Not acked yet: the copy is in the node's own journal, which keeps it
    /// until the ack or moves it to storage ([`crate::node_journal`]).
    Kept,
}

impl CopyFate {
    pub fn as_str(self) -> &'static str {
        match self {
            CopyFate::Acked => "acked",
            CopyFate::Written => "written",
            CopyFate::Kept => "kept",
        }
    }

    pub fn parse(value: &[u8]) -> Option<CopyFate> {
        match value {
            b"acked" => Some(CopyFate::Acked),
            b"written" => Some(CopyFate::Written),
            b"kept" => Some(CopyFate::Kept),
            _ => None,
        }
    }
}

/// Offer `notification` to the client `uaid` on `node`, holding its durable
/// copy back for the grace. With [`PushOutcome::Delivered`], the copy's
/// fate; `None` when it could not be written (the endpoint writes it).
/// `seals`: the endpoint seals `delivered` into the id of a message acked
/// within the grace, so its receipt is not written.
///
/// The hold runs on a task of its own, to its end, even if the caller stops
/// waiting (the endpoint timed out, hung up or was killed): a message its
/// client took and has not acked is written all the same, never left only
/// in a session that stores no durable message when its client leaves. An
/// ack within the grace is sealed only if the caller takes the answer: one
/// that stopped waiting seals nothing, and its endpoint may have written
/// the copy itself, so the ack is settled as an unsealed one is.
///
/// With `journal` (the node's own, see [`crate::node_journal`]), the copy
/// goes there, and the answer comes once it is synced there or acked:
/// [`CopyFate::Kept`] or [`CopyFate::Acked`].
pub async fn push_holding_copy(
    node: Arc<dyn LocalNode>,
    storage: Arc<dyn Storage>,
    journal: Option<Arc<NodeJournal>>,
    uaid: Uuid,
    notification: Notification,
    seals: bool,
) -> (PushOutcome, Option<CopyFate>) {
    let (answer, answered) = tokio::sync::oneshot::channel();
    if let Some(journal) = journal {
        let keeper = Keeper {
            node,
            storage,
            journal,
            uaid,
        };
        tokio::spawn(keeper.keep(notification, seals, answer));
        return answered.await.unwrap_or((PushOutcome::Busy, None));
    }
    tokio::spawn(async move {
        let (outcome, fate, sealed) =
            hold_copy(node.as_ref(), &storage, &uaid, notification, seals).await;
        if answer.send((outcome, fate)).is_err()
            && let Some(notification) = sealed
        {
            settle_unanswered(storage.as_ref(), &uaid, &notification).await;
        }
    });
    // A holder that panicked said nothing: the endpoint writes the copy.
    answered.await.unwrap_or((PushOutcome::Busy, None))
}

/// [`push_holding_copy`]'s hold: its outcome and fate, and, for an ack
/// within the grace left to the endpoint to seal, the message (settled
/// here after all if no one takes the answer).
async fn hold_copy(
    node: &dyn LocalNode,
    storage: &Arc<dyn Storage>,
    uaid: &Uuid,
    mut notification: Notification,
    seals: bool,
) -> (PushOutcome, Option<CopyFate>, Option<Notification>) {
    // Acks of durable messages are what the session offers to the holder.
    notification.durable = true;
    let held = node.held_copies();
    let version = notification.version.clone();
    let wake = held.hold(uaid, &version);
    let mut holding = Holding {
        held,
        storage,
        uaid: *uaid,
        notification: Some(notification.clone()),
    };
    let outcome = node.push(uaid, notification.clone());
    if outcome != PushOutcome::Delivered {
        holding.disarm();
        held.release(uaid, &version);
        return (outcome, None, None);
    }
    let end = match node.acks_late(uaid) {
        // Its ack would not come within the grace either.
        true => held.wait_up_to(&wake, uaid, &version, Duration::ZERO).await,
        false => held.wait(&wake, uaid, &version).await,
    };
    if end == GraceEnd::Acked {
        holding.disarm();
        if seals {
            metrics::final_state(RouterType::WebPush, MessageState::Delivered);
            return (outcome, Some(CopyFate::Acked), Some(notification));
        }
        return (
            outcome,
            Some(acked(storage.as_ref(), uaid, &notification).await),
            None,
        );
    }
    let saved = storage.save_direct(uaid, notification.clone()).await;
    holding.disarm();
    let fate = released(held, storage.as_ref(), uaid, &notification, saved).await;
    (outcome, fate, None)
}

/// Release a held copy its holder tried to write (`written`, the result),
/// settling an ack that came meanwhile: after the release an ack is the
/// session's to settle; before it, the holder's. The copy's fate; `None`
/// when it was neither written nor acked (the endpoint writes it).
async fn released(
    held: &HeldCopies,
    storage: &dyn Storage,
    uaid: &Uuid,
    notification: &Notification,
    written: autopush_storage::Result<()>,
) -> Option<CopyFate> {
    let version = &notification.version;
    match (written, held.release(uaid, version)) {
        (Ok(()), false) => Some(CopyFate::Written),
        (Ok(()), true) => {
            settle_written(storage, uaid, notification).await;
            held.settled(uaid, version);
            Some(CopyFate::Acked)
        }
        (Err(_), true) => {
            let fate = acked(storage, uaid, notification).await;
            held.settled(uaid, version);
            Some(fate)
        }
        (Err(e), false) => {
            warn!(error = %e, "could not write a held direct copy; the endpoint writes it");
            None
        }
    }
}

/// A copy being held, released if its holder is dropped before it is done
/// (the runtime shutting down). From then on the session settles the copy
/// at the ack; an ack that came before is settled here, as the endpoint's
/// copy may be in storage.
struct Holding<'a> {
    held: &'a HeldCopies,
    storage: &'a Arc<dyn Storage>,
    uaid: Uuid,
    /// `None` once the holder runs to its end.
    notification: Option<Notification>,
}

impl Holding<'_> {
    fn disarm(&mut self) {
        self.notification = None;
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let Some(notification) = self.notification.take() else {
            return;
        };
        if self.held.release(&self.uaid, &notification.version) {
            self.held.settled(&self.uaid, &notification.version);
            let storage = self.storage.clone();
            let uaid = self.uaid;
            tokio::spawn(async move {
                settle_written(storage.as_ref(), &uaid, &notification).await;
            });
        }
    }
}

/// A message acked within the grace whose endpoint stopped waiting for the
/// answer that would have sealed it: it may have written the copy itself.
async fn settle_unanswered(storage: &dyn Storage, uaid: &Uuid, notification: &Notification) {
    // Counted as delivered already.
    let settled = storage
        .settle_unwritten(uaid, notification, MessageState::Delivered)
        .await;
    if let Err(e) = settled {
        warn!(error = %e, "could not settle a direct message acked as its endpoint gave up");
    }
}

/// Settle a copy that may be in storage: its client acked it.
async fn settle_written(storage: &dyn Storage, uaid: &Uuid, notification: &Notification) {
    let settled = storage
        .settle_message(
            uaid,
            &notification.sort_key(),
            &notification.version,
            MessageState::Delivered,
        )
        .await;
    match settled {
        Ok(true) => metrics::final_state(RouterType::WebPush, MessageState::Delivered),
        Ok(false) => {}
        // Delivered again at the next hello: a duplicate, not a loss.
        Err(e) => warn!(error = %e, "could not settle an acked direct copy"),
    }
}

/// The client acked a message whose copy was never written: only its
/// receipt is left to write (with receipts on).
async fn acked(storage: &dyn Storage, uaid: &Uuid, notification: &Notification) -> CopyFate {
    match storage
        .settle_unwritten(uaid, notification, MessageState::Delivered)
        .await
    {
        Ok(()) => metrics::final_state(RouterType::WebPush, MessageState::Delivered),
        // Delivered all the same: only its receipt is missing.
        Err(e) => warn!(error = %e, "could not write the receipt of a direct message"),
    }
    CopyFate::Acked
}

/// The holder of a copy kept in the node's own journal (see
/// [`push_holding_copy`] and [`crate::node_journal`]).
struct Keeper {
    node: Arc<dyn LocalNode>,
    storage: Arc<dyn Storage>,
    journal: Arc<NodeJournal>,
    uaid: Uuid,
}

/// What the holder of a kept copy answers its endpoint with.
type Answer = oneshot::Sender<(PushOutcome, Option<CopyFate>)>;

/// How long a keeper waits for the ack before it tries again to move a
/// copy the shared store refused.
const MOVE_RETRY: Duration = Duration::from_secs(1);

/// How the wait for a kept copy's first end ended.
enum First {
    Woken(GraceEnd),
    Synced(autopush_storage::Result<autopush_storage::CopyEnd>),
}

impl Keeper {
    fn held(&self) -> &HeldCopies {
        self.node.held_copies()
    }

    /// Offer `notification`, journal its copy, answer once it is synced or
    /// acked, and stay with it until it is acked or moved.
    async fn keep(self, mut notification: Notification, seals: bool, answer: Answer) {
        notification.durable = true;
        let (uaid, version) = (self.uaid, notification.version.clone());
        let wake = self.held().hold(&uaid, &version);
        let outcome = self.node.push(&uaid, notification.clone());
        if outcome != PushOutcome::Delivered {
            self.held().release(&uaid, &version);
            let _ = answer.send((outcome, None));
            return;
        }
        let copy = match self.journal.stage(&uaid, notification.clone()).await {
            Ok(copy) => copy,
            Err(e) => {
                // Released: the endpoint writes the copy, an ack settles it.
                warn!(error = %e, "could not journal a direct copy; the endpoint writes it");
                self.held().release(&uaid, &version);
                let _ = answer.send((outcome, None));
                return;
            }
        };
        if self.node.acks_late(&uaid) {
            // Its ack would not come within the journal's grace either.
            copy.hurry();
        }
        // The sender waits for the first of the ack and the journal's sync
        // (or the window, if the disk stalls that long).
        let window = self.journal.window();
        let first = tokio::select! {
            end = self.held().wait_up_to(&wake, &uaid, &version, window) => First::Woken(end),
            saved = copy.saved_or_settled() => First::Synced(saved),
        };
        match first {
            First::Woken(GraceEnd::Acked) => self.acked_first(&notification, seals, answer).await,
            First::Synced(Ok(_)) => {
                if answer.send((outcome, Some(CopyFate::Kept))).is_ok() {
                    // The journal holds the payload now, for as long as the
                    // copy is kept; a move reads it back from there.
                    notification.data = None;
                    self.keep_until_settled(&notification, &wake).await;
                    return;
                }
                // The endpoint stopped waiting and wrote the copy to the
                // shared store itself: an ack settled only here would
                // leave that copy to be delivered again. Ours goes there
                // too (the same message under the same key), where the
                // session settles it at the ack.
                self.move_now(&notification).await;
            }
            First::Woken(GraceEnd::Write) | First::Synced(Err(_)) => {
                // The session ended, or the journal could not write it.
                let fate = self.move_now(&notification).await;
                let _ = answer.send((outcome, fate));
            }
        }
    }

    /// Acked before its copy was synced here: nothing of it is left but,
    /// with receipts on, its receipt, sealed into its id by an endpoint
    /// that `seals`.
    async fn acked_first(&self, notification: &Notification, seals: bool, answer: Answer) {
        self.journal.forget(&self.uaid, notification).await;
        let answered = if seals {
            metrics::final_state(RouterType::WebPush, MessageState::Delivered);
            answer.send((PushOutcome::Delivered, Some(CopyFate::Acked)))
        } else {
            let fate = acked(self.storage.as_ref(), &self.uaid, notification).await;
            answer.send((PushOutcome::Delivered, Some(fate)))
        };
        if answered.is_err() && seals {
            settle_unanswered(self.storage.as_ref(), &self.uaid, notification).await;
        }
    }

    /// Move the copy to the shared store now (its sender waiting, or gone):
    /// its fate, `None` if the shared store refused it (the endpoint writes
    /// it).
    async fn move_now(&self, notification: &Notification) -> Option<CopyFate> {
        let uaid = &self.uaid;
        let moved = self.journal.move_to_shared(uaid, notification).await;
        let was_moved = moved.is_ok();
        if !was_moved {
            // Acked, or the endpoint writes it: this journal's no more.
            self.journal.forget(uaid, notification).await;
        }
        let storage = self.storage.as_ref();
        let fate = released(self.held(), storage, uaid, notification, moved).await;
        if was_moved {
            self.journal.nudge(Some(self.node.as_ref()), uaid).await;
        }
        fate
    }

    /// Answered: keep the copy until its client acks it, or move it to the
    /// shared store once the window ends or the session does, trying again
    /// while the shared store refuses it.
    async fn keep_until_settled(&self, notification: &Notification, wake: &Notify) {
        let (uaid, version) = (&self.uaid, &notification.version);
        let mut wait = self.journal.window();
        loop {
            if self.held().wait_up_to(wake, uaid, version, wait).await == GraceEnd::Acked {
                // Its receipt stays here, for the endpoint to ask for.
                self.journal.acked(uaid, notification).await;
                metrics::final_state(RouterType::WebPush, MessageState::Delivered);
                return;
            }
            match self.journal.move_kept(uaid, notification).await {
                Ok(()) => break,
                Err(e) => {
                    warn!(error = %e, "could not move a direct copy to the shared store; trying again");
                    wait = MOVE_RETRY;
                }
            }
        }
        let left = self.held().left(uaid, version);
        released(
            self.held(),
            self.storage.as_ref(),
            uaid,
            notification,
            Ok(()),
        )
        .await;
        // A client still connected here has the message in flight, or
        // its session, ending, tells its next node to look.
        if left || !self.node.is_connected(uaid) {
            self.journal.nudge(Some(self.node.as_ref()), uaid).await;
        }
    }
}
