//! How an all-in-one process reaches its own connection node without an
//! HTTP round trip ([`LocalNode`]), and what a node says to an offered
//! notification ([`PushOutcome`]). The HTTP client for other nodes is the
//! webpush router's (`autopush_webpush::node_client`).
//!
//! [`HeldCopies`]: the durable direct copies a connection node holds back
//! for a grace, so that a message its client acks at once is never written.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use uuid::Uuid;

use crate::Notification;
use crate::time::test_millis;

/// What happened to a notification offered to a connection node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Queued for the connected client.
    Delivered,
    /// The client is not connected to this node.
    NotConnected,
    /// The client is connected but cannot take more right now; store it.
    Busy,
}

/// A connection node that lives in this process.
pub trait LocalNode: Send + Sync {
    /// The node id written to user records (its internal router URL).
    fn node_id(&self) -> &str;
    /// Offer a notification to the client `uaid` if it is connected here.
    fn push(&self, uaid: &Uuid, notification: Notification) -> PushOutcome;
    /// Ask the client `uaid`, if connected here, to check storage. Returns
    /// whether it is connected.
    fn notify(&self, uaid: &Uuid) -> bool;
    /// Whether the client `uaid` is connected here.
    fn is_connected(&self, uaid: &Uuid) -> bool;
    /// Whether the client `uaid`, connected here, acked its last direct
    /// notification too late for a grace to save its durable copy's write:
    /// the copy of the next is written at once, so its sender does not wait
    /// the grace out first.
    fn acks_late(&self, uaid: &Uuid) -> bool;
    /// The durable direct copies this node holds back for their grace.
    fn held_copies(&self) -> &HeldCopies;
}

/// How long a node holding a durable direct copy waits for the client's ack
/// before it writes the copy: most clients ack within a millisecond. The
/// embedded store's journal waits as long.
pub const DIRECT_GRACE: Duration = Duration::from_millis(10);

/// [`DIRECT_GRACE`], or `AUTOPUSH_TEST_DIRECT_GRACE_MS` milliseconds: the
/// crash tests of the binary kill a node inside a grace they can see
/// (hidden: not a setting). Read once.
fn direct_grace() -> Duration {
    static GRACE: OnceLock<Duration> = OnceLock::new();
    *GRACE.get_or_init(|| test_millis("AUTOPUSH_TEST_DIRECT_GRACE_MS").unwrap_or(DIRECT_GRACE))
}

/// Whether a client that acked a direct notification `delay` after it was
/// sent acks too late for a grace to save its next copy's write (see
/// [`LocalNode::acks_late`]): later than the grace, or than
/// `AUTOPUSH_TEST_LATE_ACK_MS` milliseconds, for tests that hold copies
/// back for long and need a client deemed late all the same (hidden: not a
/// setting). Loopback clients of a busy node ack within 1 to 5 ms; real
/// ones are 20 to 300 ms away.
pub fn acked_late(delay: Duration) -> bool {
    static LATE: OnceLock<Duration> = OnceLock::new();
    delay
        > *LATE
            .get_or_init(|| test_millis("AUTOPUSH_TEST_LATE_ACK_MS").unwrap_or_else(direct_grace))
}

/// The durable direct copies a connection node holds back: each is written
/// by its holder only if the client has not acked it within
/// [`DIRECT_GRACE`]. The holder and the session that sees the ack meet
/// here, under one lock, so that exactly one of them settles the message:
/// an ack before the holder claims the copy means "nothing to write"; an
/// ack after it means "the holder settles the copy it wrote"; once the
/// holder released the copy, it is an ordinary durable copy in storage,
/// which the session settles itself. A copy acked while its holder writes
/// it stays here until the holder has settled it: storage checks pass over
/// it meanwhile ([`HeldCopies::settling`]), as the session that saw the
/// ack no longer knows it.
#[derive(Default)]
pub struct HeldCopies(Mutex<HashMap<(Uuid, String), Held>>);

struct Held {
    acked: bool,
    /// The session it was offered to ended, or holds it back, without an
    /// ack ([`HeldCopies::write_now`]).
    left: bool,
    /// Wakes the holder at the ack, or when no ack will come.
    wake: Arc<Notify>,
    /// Wakes a session waiting for the copy to be written.
    released: Arc<Notify>,
}

/// What a holder finds when the grace ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraceEnd {
    /// The client acked: nothing to write, the copy is released.
    Acked,
    /// No ack yet: the holder writes the copy, then calls
    /// [`HeldCopies::release`].
    Write,
}

impl HeldCopies {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(Uuid, String), Held>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether no copy is held: at shutdown, once every holder has moved
    /// or settled its copy.
    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Hold the copy of `version` (before the message is offered to the
    /// client, so its ack cannot come first); what wakes the holder.
    pub fn hold(&self, uaid: &Uuid, version: &str) -> Arc<Notify> {
        let wake = Arc::new(Notify::new());
        let held = Held {
            acked: false,
            left: false,
            wake: wake.clone(),
            released: Arc::default(),
        };
        self.map().insert((*uaid, version.to_owned()), held);
        wake
    }

    /// Wait until the client acks `version` or the grace ends.
    pub async fn wait(&self, wake: &Notify, uaid: &Uuid, version: &str) -> GraceEnd {
        self.wait_up_to(wake, uaid, version, direct_grace()).await
    }

    /// Wait until the client acks `version`, its session asks for the copy
    /// to be written ([`HeldCopies::write_now`]), or `limit` has passed.
    pub async fn wait_up_to(
        &self,
        wake: &Notify,
        uaid: &Uuid,
        version: &str,
        limit: Duration,
    ) -> GraceEnd {
        // A wake-up before this wait left a permit: no ack is missed.
        let _ = tokio::time::timeout(limit, wake.notified()).await;
        let mut map = self.map();
        let key = (*uaid, version.to_owned());
        match map.get(&key) {
            Some(held) if !held.acked => GraceEnd::Write,
            _ => {
                if let Some(held) = map.remove(&key) {
                    held.released.notify_one();
                }
                GraceEnd::Acked
            }
        }
    }

    /// The holder is done with the copy of `version` (written, or not
    /// offered after all): whether the client acked it meanwhile, which
    /// leaves the settle to the holder. Not acked, the copy is released: an
    /// ack from now on is the session's. Acked, it stays held, passed over
    /// by storage checks, until the holder calls [`HeldCopies::settled`].
    pub fn release(&self, uaid: &Uuid, version: &str) -> bool {
        let mut map = self.map();
        let key = (*uaid, version.to_owned());
        if map.get(&key).is_some_and(|held| held.acked) {
            return true;
        }
        if let Some(held) = map.remove(&key) {
            held.released.notify_one();
        }
        false
    }

    /// The holder settled the copy of `version` its client acked while it
    /// was written (or found nothing to settle): the copy is released.
    pub fn settled(&self, uaid: &Uuid, version: &str) {
        if let Some(held) = self.map().remove(&(*uaid, version.to_owned())) {
            held.released.notify_one();
        }
    }

    /// Whether a holder has the copy of `version`, acked or not.
    pub fn holds(&self, uaid: &Uuid, version: &str) -> bool {
        self.map().contains_key(&(*uaid, version.to_owned()))
    }

    /// Whether the client acked `version` and its holder has not settled
    /// the copy yet: a storage check that finds the copy passes over it,
    /// or the message would be sent again.
    pub fn settling(&self, uaid: &Uuid, version: &str) -> bool {
        self.map()
            .get(&(*uaid, version.to_owned()))
            .is_some_and(|held| held.acked)
    }

    /// The session holds `version` back from its client (below the
    /// minimum urgency), so no ack will come: wake the holder to write the
    /// copy now, and return once it is written (at once if no copy of it is
    /// held here). A storage check after this finds the message.
    pub async fn written_now(&self, uaid: &Uuid, version: &str) {
        let Some(released) = self.write_now(uaid, version) else {
            return;
        };
        // A release since the lock was let go left a permit.
        released.notified().await;
    }

    /// The session that was offered `version` ends without its ack: wake
    /// the holder to write the copy to storage now, where the client's
    /// next connection finds it. What tells the copy's release, if one is
    /// held here.
    pub fn write_now(&self, uaid: &Uuid, version: &str) -> Option<Arc<Notify>> {
        let mut map = self.map();
        let held = map.get_mut(&(*uaid, version.to_owned()))?;
        held.left = true;
        held.wake.notify_one();
        Some(held.released.clone())
    }

    /// Whether the session `version` was offered to asked for its copy to
    /// be written ([`HeldCopies::write_now`]).
    pub fn left(&self, uaid: &Uuid, version: &str) -> bool {
        self.map()
            .get(&(*uaid, version.to_owned()))
            .is_some_and(|held| held.left)
    }

    /// The client acked `version`: whether its copy is held (its holder
    /// settles it); `false` means any copy is in storage, for the session
    /// to settle.
    pub fn ack(&self, uaid: &Uuid, version: &str) -> bool {
        let mut map = self.map();
        let Some(held) = map.get_mut(&(*uaid, version.to_owned())) else {
            return false;
        };
        held.acked = true;
        held.wake.notify_one();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uaid() -> Uuid {
        Uuid::from_u128(7)
    }

    #[tokio::test]
    async fn an_ack_within_the_grace_leaves_nothing_to_write() {
        let held = HeldCopies::default();
        let wake = held.hold(&uaid(), "v");
        assert!(held.ack(&uaid(), "v"));
        assert_eq!(held.wait(&wake, &uaid(), "v").await, GraceEnd::Acked);
        // Released: a later ack is an ordinary one.
        assert!(!held.ack(&uaid(), "v"));
    }

    #[tokio::test]
    async fn an_ack_while_the_holder_writes_is_the_holders_to_settle() {
        let held = HeldCopies::default();
        let wake = held.hold(&uaid(), "v");
        assert_eq!(held.wait(&wake, &uaid(), "v").await, GraceEnd::Write);
        assert!(!held.settling(&uaid(), "v"));
        assert!(held.ack(&uaid(), "v"));
        assert!(held.settling(&uaid(), "v"));
        assert!(held.release(&uaid(), "v"));
        // Storage checks pass over it until the holder has settled it.
        assert!(held.settling(&uaid(), "v"));
        held.settled(&uaid(), "v");
        assert!(!held.settling(&uaid(), "v"));
        assert!(!held.ack(&uaid(), "v"));
    }

    #[tokio::test]
    async fn a_copy_no_ack_will_come_for_is_written_at_once() {
        let held = std::sync::Arc::new(HeldCopies::default());
        let id = uaid();
        let wake = held.hold(&id, "v");
        let session = tokio::spawn({
            let held = held.clone();
            async move { held.written_now(&uaid(), "v").await }
        });
        // The session, once it waits, has woken the holder...
        tokio::task::yield_now().await;
        let woken = tokio::time::timeout(Duration::ZERO, wake.notified()).await;
        assert!(woken.is_ok(), "the holder was not woken");
        assert!(!session.is_finished());
        // ...which finds no ack, writes, and releases the copy.
        assert_eq!(held.wait(&wake, &id, "v").await, GraceEnd::Write);
        assert!(!held.release(&id, "v"));
        session
            .await
            .expect("the session's wait ends at the release");
        // Nothing held: no wait.
        held.written_now(&id, "other").await;
    }

    #[tokio::test]
    async fn an_ack_after_the_release_is_the_sessions() {
        let held = HeldCopies::default();
        let wake = held.hold(&uaid(), "v");
        assert_eq!(held.wait(&wake, &uaid(), "v").await, GraceEnd::Write);
        assert!(!held.release(&uaid(), "v"));
        assert!(!held.ack(&uaid(), "v"));
    }
}
