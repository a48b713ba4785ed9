//! Where users, their channels and their undelivered messages live.
//!
//! [`Storage`] is what the routers and the connection node need; each backend
//! implements it. The embedded backend ([`embedded::EmbeddedStore`], redb) is
//! the zero-configuration default for a single process; the DynamoDB backend
//! ([`dynamodb::DynamoStore`]) is shared by any number of nodes, and so is
//! the Bigtable backend ([`bigtable::BigtableStore`], autopush-rs's schema)
//! and the PostgreSQL backend ([`postgres::PostgresStore`], autopush-rs's
//! schema too).

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use autopush_common::{ApiError, Notification, Urgency, User, WakeRoute};
use tokio::sync::oneshot;
use uuid::Uuid;

pub mod bigtable;
pub mod dynamodb;
pub mod embedded;
pub mod metered;
pub mod postgres;
pub mod receipt;
pub mod sweeper;

use autopush_common::receipt::MessageState;
pub use receipt::{Receipt, StoredMessage};

pub type Result<T> = std::result::Result<T, StorageError>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StorageError {
    #[error(
        "the store at {0} is in use by another process (the embedded store belongs to one process; run several processes on --db dynamodb)"
    )]
    InUse(String),
    #[error("storage backend error: {0}")]
    Backend(String),
    /// The backend has no such table (DynamoDB's ResourceNotFoundException).
    #[error("storage backend error: {0}")]
    NoTable(String),
    #[error("corrupt record: {0}")]
    Corrupt(String),
    #[error("another message is stored under {0}: send it again")]
    KeyTaken(String),
}

impl From<StorageError> for ApiError {
    fn from(e: StorageError) -> Self {
        ApiError::Storage(e.to_string())
    }
}

/// How the wait for a durable direct copy ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyEnd {
    /// The copy is durable, or no longer needed and its message settled
    /// with its receipt kept as usual.
    Saved,
    /// The client acked the message before any of it was written, and
    /// nothing was: not the copy, not a receipt. The caller, which has
    /// not answered the sender yet, seals `delivered` into the message's
    /// id instead (with receipts on).
    Acked,
}

/// A durable direct copy on its way (see [`Storage::stage_direct`]).
///
/// Made on every durable direct push, so it holds no boxes: a receiver the
/// backend answers, and a shared handle to ask it to hurry.
pub struct DirectCopy {
    /// `None`: durable already. Else what answers once the copy is durable
    /// or no longer needed, and what asks for it to be written without
    /// waiting further.
    pending: Option<(oneshot::Receiver<Result<CopyEnd>>, Hurry)>,
}

/// Asks a backend to write a staged copy now: made once, shared by every copy.
pub(crate) type Hurry = Arc<dyn Fn() + Send + Sync>;

impl DirectCopy {
    /// A copy that is durable already.
    pub fn saved() -> DirectCopy {
        DirectCopy { pending: None }
    }

    /// A copy that is durable (or no longer needed) once `done` answers;
    /// `hurry` asks for it to be written without waiting further.
    pub fn new(done: oneshot::Receiver<Result<CopyEnd>>, hurry: Hurry) -> DirectCopy {
        DirectCopy {
            pending: Some((done, hurry)),
        }
    }

    /// Wait until the copy is durable or its message settled.
    pub async fn saved_or_settled(self) -> Result<CopyEnd> {
        match self.pending {
            Some((done, _)) => copy_written(done).await,
            None => Ok(CopyEnd::Saved),
        }
    }

    /// Ask for the copy to be written now, without waiting further for an
    /// ack: its client takes longer than the grace to ack.
    pub fn hurry(&self) {
        if let Some((_, hurry)) = &self.pending {
            hurry();
        }
    }

    /// The client did not take the message: wait until the copy is
    /// durable, asking for it to be written now.
    pub async fn saved_now(self) -> Result<CopyEnd> {
        self.hurry();
        self.saved_or_settled().await
    }
}

/// What the writer of a durable copy answers, as a storage result: a
/// writer gone before answering has stopped.
pub(crate) async fn copy_written(done: oneshot::Receiver<Result<CopyEnd>>) -> Result<CopyEnd> {
    done.await
        .map_err(|_| StorageError::Backend("the durable copy's writer has stopped".into()))?
}

/// The storage model of the seeds: one router record per UAID, the channel
/// set of each UAID, and its stored messages keyed by sort key.
#[async_trait]
pub trait Storage: Send + Sync {
    /// Write `user` unconditionally: a new user under a fresh UAID (a first
    /// `hello`, a `/v1` registration). Every later change to a user record
    /// is one of the conditional writes below, never a read, change and
    /// write back.
    async fn add_user(&self, user: &User) -> Result<()>;

    /// Record a connection of a user that was read holding
    /// `seen_connected_at`: set `node_id`, `connected_at`, `last_connect` and
    /// `over_msg_limit` from `user`, in one write conditional on the record
    /// still existing and still holding `seen_connected_at`. Returns whether
    /// it was written; `false` means the user was removed, or another
    /// connection took it over since it was read. Nothing else in the record
    /// (router data, message month) is touched, except that a backend whose
    /// cells expire (Bigtable) writes what `user` carries as read with
    /// `seen_connected_at` ([`User::keep_as_read`]) again: `min_urgency`,
    /// required unchanged too, and the wake route and last wake-up, each
    /// written again only while unchanged (one written meanwhile is fresh).
    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool>;

    /// Set `last_connect` (ms) of a user, if it exists: a long connection
    /// and a bridged app listing its channels keep the user alive. A
    /// backend whose cells expire (Bigtable) writes the user's other cells
    /// again too. Returns whether it exists.
    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool>;

    /// Replace the router data of a user, if the record exists and still
    /// holds `seen`. Returns whether it was written.
    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool>;

    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>>;

    /// Remove the user with its channels and stored messages.
    async fn remove_user(&self, uaid: &Uuid) -> Result<()>;

    /// Remove the user with its channels and stored messages, if its record
    /// still holds the `connected_at` and `router_data` of `seen` (no
    /// connection took it over, no new token arrived since it was read).
    /// Returns whether it was removed.
    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool>;

    /// Clear `node_id` if the record still names `node_id` at `connected_at`
    /// (an endpoint found the client gone). Returns whether it was cleared.
    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool>;

    /// Set the user agent's minimum urgency (`very-low` is stored as no
    /// minimum at all), if the record still names `node_id` at
    /// `connected_at`: only the connection that owns the record changes
    /// it. Returns whether it was written.
    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool>;

    /// Set the user's wake route (`None` removes it), if the record exists.
    /// Returns whether it exists. `last_wake` is kept.
    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool>;

    /// Remove the user's wake route if it is still `seen` (the bridge said
    /// that device is gone; a route registered since stays). The user and
    /// its channels stay. Returns whether it was removed.
    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool>;

    /// Record a wake-up sent at `now` (ms), if the record exists and its
    /// `last_wake` is still `seen`: of endpoint nodes racing to wake the
    /// same user agent, the one whose write holds sends. Returns whether
    /// it held.
    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool>;

    /// Subscribe `channel_id` unless the user already has `limit` channels
    /// (re-adding a channel it has always succeeds). Returns whether the
    /// channel is subscribed.
    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool>;

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>>;

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool>;

    /// The user and whether it has `channel_id`: what every push reads
    /// before routing. A backend that can answer both in one read does;
    /// the others ask [`Storage::get_user`], then [`Storage::has_channel`].
    async fn get_user_and_channel(
        &self,
        uaid: &Uuid,
        channel_id: &Uuid,
    ) -> Result<Option<(User, bool)>> {
        let Some(user) = self.get_user(uaid).await? else {
            return Ok(None);
        };
        let subscribed = self.has_channel(uaid, channel_id).await?;
        Ok(Some((user, subscribed)))
    }

    /// Unsubscribe `channel_id`; returns whether the channel existed. With
    /// receipts on, its pending messages then become `gone` receipts, each
    /// conditional on its version.
    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool>;

    /// Store messages; one with a topic replaces a stored one with the same
    /// channel and topic, unless the stored one is newer (a larger
    /// `sortkey_timestamp`): an older message written back late, e.g. an
    /// unacknowledged direct one at disconnect, never replaces a newer one.
    /// One without a topic never replaces a different message under its key
    /// (two endpoint nodes stamped the same microsecond): the others are
    /// stored and the call fails with [`StorageError::KeyTaken`], so the
    /// sender hears 503 and sends again instead of a 201 for a message that
    /// overwrote another. Writing the same message again is fine.
    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()>;

    /// Store one message about to be delivered directly (durable direct
    /// delivery), with [`Storage::save_messages`]'s rules. The session
    /// settles it on the ack, usually within milliseconds, so a backend may
    /// keep it somewhere cheaper to write and delete than its message table,
    /// as long as it is durable on return and every read and settle sees it.
    async fn save_direct(&self, uaid: &Uuid, message: Notification) -> Result<()> {
        self.save_messages(uaid, vec![message]).await
    }

    /// Start a [`Storage::save_direct`] of a message about to be handed to
    /// its connected client. Every read and settle sees the message from
    /// the return on; the [`DirectCopy`] answers once the copy is durable,
    /// or once the message is settled (the client acked it: nothing is
    /// left to keep), whichever comes first. A backend may wait a moment
    /// before it writes, so that a message acked at once is never written;
    /// one acked before anything of it was written answers
    /// [`CopyEnd::Acked`] and leaves no receipt: the caller seals it.
    async fn stage_direct(&self, uaid: &Uuid, message: Notification) -> Result<DirectCopy> {
        self.save_direct(uaid, message).await?;
        Ok(DirectCopy::saved())
    }

    /// Whether a connection node should hold a durable direct copy back
    /// for a grace and write it only if its client has not acked by then
    /// ([`autopush_common::node::HeldCopies`]), instead of the endpoint
    /// writing it first: on a store whose every write is a billed request.
    /// A store whose [`Storage::stage_direct`] has a grace of its own (the
    /// embedded journal) says no.
    fn node_holds_direct_copies(&self) -> bool {
        false
    }

    /// A direct message its client acked before any copy of it was written
    /// (a copy a node held back): write what its receipt needs, with
    /// receipts on, and nothing otherwise. The receipt is written only
    /// where no row is (a copy written after all is settled instead).
    async fn settle_unwritten(
        &self,
        _uaid: &Uuid,
        _message: &Notification,
        _state: MessageState,
    ) -> Result<()> {
        Ok(())
    }

    /// Remove the durable copy of `message` that [`Storage::stage_direct`]
    /// wrote, once a node that does not settle copies (autopush-rs's) took
    /// the message: if it is still that version, and no one wrote the
    /// message again since (that node storing it because its client left
    /// without an ack). Returns whether it was removed.
    async fn remove_direct_copy(&self, uaid: &Uuid, message: &Notification) -> Result<bool> {
        self.remove_message(uaid, &message.sort_key(), &message.version)
            .await
    }

    /// Up to `limit` unexpired messages: topic messages first, then the rest
    /// in arrival order. Expired messages are never returned; a backend
    /// either deletes those it finds, each on the condition that it is still
    /// the version it read, or leaves them to its own expiry.
    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>>;

    /// Unexpired stored messages, counted up to `up_to` (so the cost is
    /// bounded by what the caller needs to know, not by the backlog).
    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize>;

    /// Delete the message stored under `sort_key` if it is still `version`.
    /// A newer message stored under the same key since (a Topic replacement)
    /// stays. Returns whether a message was deleted.
    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool>;

    /// Settle the message stored under `sort_key` if it is still `version`
    /// and not settled yet, in one conditional write: with receipts on (a
    /// retention window set on the backend) the row becomes a [`Receipt`]
    /// of `state`, kept for that window; off, it is deleted, as
    /// [`Storage::remove_message`] does. Returns whether it was settled.
    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool>;

    /// Settle several messages of one user, each `(sort_key, version)` as
    /// [`Storage::settle_message`] settles it: conditional on its own
    /// version, and at most once (a pair given twice settles once).
    /// Returns whether each was settled, in order. A backend may write the
    /// whole batch in one statement; the default settles one at a time.
    async fn settle_messages(
        &self,
        uaid: &Uuid,
        messages: &[(String, String)],
        state: MessageState,
    ) -> Result<Vec<bool>> {
        let mut settled = Vec::with_capacity(messages.len());
        for (sort_key, version) in messages {
            settled.push(self.settle_message(uaid, sort_key, version, state).await?);
        }
        Ok(settled)
    }

    /// The row stored under `sort_key`, whatever it holds: a message
    /// (pending, or past its TTL and kept for its receipt) or a receipt,
    /// even one past its expiry that the backend has not removed yet. One
    /// point read.
    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>>;

    /// A cheap round trip proving the store answers.
    async fn health_check(&self) -> Result<()>;

    /// One bounded step of housekeeping: look at up to `budget` stored
    /// messages after where the last step stopped and delete those past
    /// their TTL. A backend whose own expiry does this may do nothing.
    async fn sweep_expired_messages(&self, _budget: usize) -> Result<SweepStep> {
        Ok(SweepStep::default())
    }

    /// One bounded step of housekeeping: look at up to `budget` users after
    /// where the last step stopped and remove webpush users that are not
    /// connected and last said hello before `last_connect_before` (ms), with
    /// their channels and messages. Bridge registrations are kept.
    async fn drop_idle_users(
        &self,
        _last_connect_before: u64,
        _budget: usize,
    ) -> Result<SweepStep> {
        Ok(SweepStep::default())
    }
}

/// What one housekeeping step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStep {
    /// Records removed.
    pub removed: usize,
    /// The step reached the end of the table; the next one starts over.
    pub finished_pass: bool,
}
