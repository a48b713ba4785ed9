//! Which clients are connected to this node, and how to reach their sessions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use autopush_common::Notification;
use autopush_common::node::{LocalNode, PushOutcome};
use tokio::sync::{Notify, mpsc};
use uuid::Uuid;

/// Direct notifications a client may have queued or unacknowledged before
/// the node reports it busy (and the endpoint stores instead).
pub const MAX_PENDING_DIRECT: usize = 32;

/// Signals from the rest of the node to one session.
#[derive(Default)]
pub struct Signals {
    /// Look in storage for messages (`PUT /notif`).
    pub check_storage: Notify,
    /// Close: replaced by a newer connection or dropped by `DELETE /notif`.
    pub kick: Notify,
    /// Direct notifications queued or sent but not yet acknowledged.
    pub pending_direct: AtomicUsize,
}

struct ClientHandle {
    /// Which session this is: unique on this node, unlike `connected_at`
    /// (two hellos for one UAID can land in the same millisecond).
    session: u64,
    connected_at: u64,
    inbox: mpsc::Sender<Box<Notification>>,
    signals: Arc<Signals>,
}

/// What a session receives when it joins the registry.
pub struct Membership {
    /// The session's id, to leave the registry with.
    pub session: u64,
    pub inbox: mpsc::Receiver<Box<Notification>>,
    pub signals: Arc<Signals>,
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
}

impl ClientRegistry {
    /// `node_id` is this node's internal router URL, e.g. `http://10.0.0.5:8081`.
    pub fn new(node_id: String) -> Self {
        ClientRegistry {
            node_id,
            clients: RwLock::new(HashMap::new()),
            live_sessions: Arc::default(),
            next_session: AtomicU64::new(1),
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
        let (tx, inbox) = mpsc::channel(MAX_PENDING_DIRECT);
        let signals = Arc::new(Signals::default());
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        let handle = ClientHandle {
            session,
            connected_at,
            inbox: tx,
            signals: signals.clone(),
        };
        self.live_sessions.fetch_add(1, Ordering::AcqRel);
        let live = LiveSession(self.live_sessions.clone());
        let previous = self.write().insert(uaid, handle);
        if let Some(previous) = previous {
            previous.signals.kick.notify_one();
        }
        Membership {
            session,
            inbox,
            signals,
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
                client.signals.kick.notify_one();
                true
            }
            _ => false,
        }
    }

    /// Close every session (at shutdown); each stores what its client has
    /// not acknowledged as it ends.
    pub fn kick_all(&self) {
        for client in self.read().values() {
            client.signals.kick.notify_one();
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
        if client.signals.pending_direct.load(Ordering::Acquire) >= MAX_PENDING_DIRECT {
            return PushOutcome::Busy;
        }
        match client.inbox.try_send(Box::new(notification)) {
            Ok(()) => {
                client.signals.pending_direct.fetch_add(1, Ordering::AcqRel);
                PushOutcome::Delivered
            }
            Err(mpsc::error::TrySendError::Full(_)) => PushOutcome::Busy,
            // The session is shutting down and no longer reads its inbox.
            Err(mpsc::error::TrySendError::Closed(_)) => PushOutcome::NotConnected,
        }
    }

    fn notify(&self, uaid: &Uuid) -> bool {
        match self.read().get(uaid) {
            Some(client) => {
                client.signals.check_storage.notify_one();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let message = Notification {
            channel_id: Uuid::new_v4(),
            version: "v".into(),
            ttl: 60,
            timestamp: 0,
            topic: None,
            sortkey_timestamp: None,
            data: None,
            headers: None,
            urgency: None,
            durable: false,
        };
        let pushed = registry.push(&uaid, message);
        assert_eq!(pushed, PushOutcome::Delivered);
        drop(second);
    }
}
