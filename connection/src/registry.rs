//! Which clients are connected to this node, and how to reach their sessions.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use autopush_common::Notification;
use autopush_common::node::{HeldCopies, LocalNode, PushOutcome};
use tokio::sync::Notify;
use uuid::Uuid;

/// Direct notifications a client may have queued or unacknowledged before
/// the node reports it busy (and the endpoint stores instead).
pub const MAX_PENDING_DIRECT: usize = 32;

/// One session's inbox: what the rest of the node has for it (direct
/// notifications, a storage check, being told to close), behind one lock,
/// with one wake-up. A channel and two `Notify`s did this before, at about
/// 0.8 KiB a session more (a channel allocates its first block of slots at
/// once, and an idle session waited on three futures).
#[derive(Default)]
pub struct Inbox {
    letters: Mutex<Letters>,
    wake: Notify,
    /// Direct notifications queued or sent but not yet acknowledged.
    pending_direct: AtomicUsize,
    /// The client's last ack of a direct notification came too late for a
    /// grace (see [`LocalNode::acks_late`]).
    acks_late: AtomicBool,
}

#[derive(Default)]
struct Letters {
    /// Empty (and unallocated) while the session idles.
    notifications: VecDeque<Box<Notification>>,
    check_storage: bool,
    kick: bool,
    /// The session no longer reads its inbox.
    closed: bool,
}

/// What a session finds in its inbox.
#[derive(Debug, PartialEq)]
pub enum Letter {
    /// Close: replaced by a newer connection, dropped by `DELETE /notif`,
    /// or the node is shutting down.
    Kick,
    /// A direct notification.
    Notification(Box<Notification>),
    /// Look in storage for messages (`PUT /notif`).
    CheckStorage,
}

impl Inbox {
    fn letters(&self) -> std::sync::MutexGuard<'_, Letters> {
        self.letters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queue a direct notification, unless the session has too many
    /// pending (busy) or no longer reads its inbox (not connected).
    fn deliver(&self, notification: Notification) -> PushOutcome {
        let mut letters = self.letters();
        if letters.closed {
            return PushOutcome::NotConnected;
        }
        if self.pending_direct.load(Ordering::Acquire) >= MAX_PENDING_DIRECT {
            return PushOutcome::Busy;
        }
        self.pending_direct.fetch_add(1, Ordering::AcqRel);
        letters.notifications.push_back(Box::new(notification));
        drop(letters);
        self.wake.notify_one();
        PushOutcome::Delivered
    }

    fn check_storage(&self) {
        self.letters().check_storage = true;
        self.wake.notify_one();
    }

    fn kick(&self) {
        self.letters().kick = true;
        self.wake.notify_one();
    }

    /// The next letter, waiting for one. A kick comes first, then
    /// notifications in the order they came, then a storage check.
    /// Cancel-safe: a letter is taken only when it is returned.
    pub async fn next(&self) -> Letter {
        loop {
            if let Some(letter) = self.take() {
                return letter;
            }
            // A letter that came since `take` left a permit: no wake-up is lost.
            self.wake.notified().await;
        }
    }

    fn take(&self) -> Option<Letter> {
        let mut letters = self.letters();
        if std::mem::take(&mut letters.kick) {
            return Some(Letter::Kick);
        }
        if let Some(notification) = letters.notifications.pop_front() {
            return Some(Letter::Notification(notification));
        }
        std::mem::take(&mut letters.check_storage).then_some(Letter::CheckStorage)
    }

    /// Stop taking notifications, and return those still queued.
    pub fn close(&self) -> Vec<Notification> {
        let mut letters = self.letters();
        letters.closed = true;
        std::mem::take(&mut letters.notifications)
            .into_iter()
            .map(|notification| *notification)
            .collect()
    }

    /// A direct notification was acknowledged, nacked or dropped: it no
    /// longer counts against the session's window.
    pub fn settled_direct(&self) {
        self.pending_direct.fetch_sub(1, Ordering::AcqRel);
    }

    /// The client acked a direct notification `delay` after it was sent.
    pub fn acked_after(&self, delay: Duration) {
        let late = autopush_common::node::acked_late(delay);
        self.acks_late.store(late, Ordering::Relaxed);
    }
}

struct ClientHandle {
    /// Which session this is: unique on this node, unlike `connected_at`
    /// (two hellos for one UAID can land in the same millisecond).
    session: u64,
    connected_at: u64,
    inbox: Arc<Inbox>,
}

/// What a session receives when it joins the registry.
pub struct Membership {
    /// The session's id, to leave the registry with.
    pub session: u64,
    pub inbox: Arc<Inbox>,
    /// Counts the session as live until dropped.
    pub live: LiveSession,
}

/// One session counted in [`ClientRegistry::live_sessions`] until this is
/// dropped: when the session finishes its clean-up, or when its task unwinds
/// from a panic, so shutdown never waits for a session that is gone.
pub struct LiveSession(Arc<AtomicUsize>);

impl Drop for LiveSession {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub struct ClientRegistry {
    node_id: String,
    clients: RwLock<HashMap<Uuid, ClientHandle>>,
    /// Sessions that joined and have not finished their clean-up yet.
    live_sessions: Arc<AtomicUsize>,
    /// The id of the next session to join.
    next_session: AtomicU64,
    /// Durable direct copies held back for their grace.
    held: HeldCopies,
}

impl ClientRegistry {
    /// `node_id` is this node's internal router URL, e.g. `http://10.0.0.5:8081`.
    pub fn new(node_id: String) -> Self {
        ClientRegistry {
            node_id,
            clients: RwLock::new(HashMap::new()),
            live_sessions: Arc::default(),
            next_session: AtomicU64::new(1),
            held: HeldCopies::default(),
        }
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    pub fn len(&self) -> usize {
        self.clients.read().map(|c| c.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a session for `uaid`; an older session for the same UAID is told
    /// to close (a second connection replaces the first).
    pub fn connect(&self, uaid: Uuid, connected_at: u64) -> Membership {
        let inbox = Arc::new(Inbox::default());
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        let handle = ClientHandle {
            session,
            connected_at,
            inbox: inbox.clone(),
        };
        self.live_sessions.fetch_add(1, Ordering::AcqRel);
        let live = LiveSession(self.live_sessions.clone());
        let previous = self.write().insert(uaid, handle);
        if let Some(previous) = previous {
            previous.inbox.kick();
        }
        Membership {
            session,
            inbox,
            live,
        }
    }

    /// Remove `session` of `uaid` (a newer one that replaced it stays);
    /// returns its `connected_at` if it was still the registered one.
    pub fn disconnect(&self, uaid: &Uuid, session: u64) -> Option<u64> {
        let mut clients = self.write();
        if clients.get(uaid).is_some_and(|c| c.session == session) {
            return clients.remove(uaid).map(|c| c.connected_at);
        }
        None
    }

    /// Sessions still running or cleaning up (see [`LiveSession`]).
    pub fn live_sessions(&self) -> usize {
        self.live_sessions.load(Ordering::Acquire)
    }

    /// Close the session of `uaid` if it connected at `connected_at`.
    pub fn kick(&self, uaid: &Uuid, connected_at: u64) -> bool {
        match self.read().get(uaid) {
            Some(client) if client.connected_at == connected_at => {
                client.inbox.kick();
                true
            }
            _ => false,
        }
    }

    /// Close every session (at shutdown); each stores what its client has
    /// not acknowledged as it ends.
    pub fn kick_all(&self) {
        for client in self.read().values() {
            client.inbox.kick();
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<Uuid, ClientHandle>> {
        self.clients
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<Uuid, ClientHandle>> {
        self.clients
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl LocalNode for ClientRegistry {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn push(&self, uaid: &Uuid, notification: Notification) -> PushOutcome {
        let clients = self.read();
        let Some(client) = clients.get(uaid) else {
            return PushOutcome::NotConnected;
        };
        client.inbox.deliver(notification)
    }

    fn notify(&self, uaid: &Uuid) -> bool {
        match self.read().get(uaid) {
            Some(client) => {
                client.inbox.check_storage();
                true
            }
            None => false,
        }
    }

    fn is_connected(&self, uaid: &Uuid) -> bool {
        self.read().contains_key(uaid)
    }

    fn acks_late(&self, uaid: &Uuid) -> bool {
        self.read()
            .get(uaid)
            .is_some_and(|client| client.inbox.acks_late.load(Ordering::Relaxed))
    }

    fn held_copies(&self) -> &HeldCopies {
        &self.held
    }
}

/// A plain notification of `version`, for this crate's tests.
#[cfg(test)]
pub(crate) fn test_notification(version: &str) -> Notification {
    Notification {
        channel_id: Uuid::new_v4(),
        version: version.into(),
        ttl: 60,
        timestamp: 0,
        topic: None,
        sortkey_timestamp: None,
        data: None,
        headers: None,
        urgency: None,
        durable: false,
    }
}

#[cfg(test)]
mod tests {
    use super::test_notification as notification;
    use super::*;

    use futures_util::FutureExt;

    fn version(letter: Letter) -> String {
        match letter {
            Letter::Notification(notification) => notification.version,
            other => panic!("expected a notification, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_kick_comes_first_then_notifications_in_order_then_a_storage_check() {
        let inbox = Inbox::default();
        inbox.check_storage();
        assert_eq!(inbox.deliver(notification("a")), PushOutcome::Delivered);
        assert_eq!(inbox.deliver(notification("b")), PushOutcome::Delivered);
        inbox.kick();
        assert_eq!(inbox.next().await, Letter::Kick);
        assert_eq!(version(inbox.next().await), "a");
        assert_eq!(version(inbox.next().await), "b");
        assert_eq!(inbox.next().await, Letter::CheckStorage);
        assert!(inbox.take().is_none());
    }

    #[tokio::test]
    async fn a_letter_wakes_a_waiting_session() {
        let inbox = Arc::new(Inbox::default());
        let waiting = tokio::spawn({
            let inbox = inbox.clone();
            async move { inbox.next().await }
        });
        tokio::task::yield_now().await;
        assert_eq!(inbox.deliver(notification("a")), PushOutcome::Delivered);
        let letter = waiting.await.expect("the waiting session");
        assert_eq!(version(letter), "a");
    }

    #[tokio::test]
    async fn waiting_given_up_loses_no_letter() {
        let inbox = Inbox::default();
        let mut waiting = Box::pin(inbox.next());
        assert!(waiting.as_mut().now_or_never().is_none());
        drop(waiting);
        inbox.check_storage();
        let mut waiting = Box::pin(inbox.next());
        assert!(waiting.as_mut().now_or_never().is_some());
        drop(waiting);
        assert_eq!(inbox.deliver(notification("a")), PushOutcome::Delivered);
        assert_eq!(version(inbox.next().await), "a");
    }

    #[tokio::test]
    async fn a_full_window_is_busy_until_one_is_settled() {
        let inbox = Inbox::default();
        for i in 0..MAX_PENDING_DIRECT {
            assert_eq!(
                inbox.deliver(notification(&i.to_string())),
                PushOutcome::Delivered
            );
        }
        assert_eq!(inbox.deliver(notification("over")), PushOutcome::Busy);
        // Sent to the client, not yet acknowledged: still pending.
        inbox.next().await;
        assert_eq!(inbox.deliver(notification("over")), PushOutcome::Busy);
        inbox.settled_direct();
        assert_eq!(inbox.deliver(notification("fits")), PushOutcome::Delivered);
    }

    #[tokio::test]
    async fn a_closed_inbox_hands_back_what_was_queued_and_takes_no_more() {
        let inbox = Inbox::default();
        assert_eq!(inbox.deliver(notification("a")), PushOutcome::Delivered);
        let queued: Vec<String> = inbox.close().into_iter().map(|n| n.version).collect();
        assert_eq!(queued, ["a"]);
        assert_eq!(inbox.deliver(notification("b")), PushOutcome::NotConnected);
        assert!(inbox.close().is_empty());
    }

    #[tokio::test]
    async fn a_session_that_panics_is_no_longer_live() {
        let registry = ClientRegistry::new("http://127.0.0.1:8081".into());
        let membership = registry.connect(Uuid::new_v4(), 1);
        assert_eq!(registry.live_sessions(), 1);
        let session = tokio::spawn(async move {
            let _membership = membership;
            panic!("a bug in a session");
        });
        assert!(session.await.is_err_and(|e| e.is_panic()));
        assert_eq!(registry.live_sessions(), 0);
    }

    /// Two sessions of one UAID that joined in the same millisecond: the
    /// one replaced leaving must not take its replacement with it.
    #[tokio::test]
    async fn a_replaced_session_leaving_keeps_its_replacement() {
        let registry = ClientRegistry::new("http://127.0.0.1:8081".into());
        let uaid = Uuid::new_v4();
        let first = registry.connect(uaid, 1_700_000_000_000);
        let second = registry.connect(uaid, 1_700_000_000_000);
        registry.disconnect(&uaid, first.session);
        let pushed = registry.push(&uaid, notification("v"));
        assert_eq!(pushed, PushOutcome::Delivered);
        drop(second);
    }
}
