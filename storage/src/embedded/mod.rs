//! The embedded backend: one redb file in the data directory.
//!
//! Every write commits durably before returning, so a message the endpoint
//! acknowledged survives `kill -9`; writes waiting at the same moment share
//! one commit ([`writer`]). Point reads run inline: they are served from
//! redb's cache or the OS page cache in microseconds, and a hop to the
//! blocking pool would cost more than the read. Scans run on the blocking
//! pool.

mod journal;
mod receipts;
mod writer;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use autopush_common::{Notification, RouterType, Urgency, User, WakeRoute, time::now_secs};
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use uuid::Uuid;

use crate::{DirectCopy, Hurry, Receipt, Result, Storage, StorageError, StoredMessage, SweepStep};
use autopush_common::metrics::final_states_in_store;
use autopush_common::notification::receipt_key;
use autopush_common::receipt::MessageState;
pub use journal::JournalReplay;
use journal::{Journal, JournalFile, NotStaged, Settled};
use receipts::RECEIPTS;
use writer::Writer;

/// uaid -> JSON router record.
const USERS: TableDefinition<u128, &[u8]> = TableDefinition::new("users");
/// (uaid, channel id) -> nothing: the channel set.
const CHANNELS: TableDefinition<(u128, u128), ()> = TableDefinition::new("channels");
/// (uaid, sort key) -> JSON notification (or, in stores written before the
/// receipts table, a JSON receipt once settled).
const MESSAGES: TableDefinition<(u128, &str), &[u8]> = TableDefinition::new("messages");

/// Sort keys are ASCII, so this bounds every key of one user from above.
const SORT_KEY_MAX: &str = "\u{7f}";

fn backend<E: Into<redb::Error>>(e: E) -> StorageError {
    StorageError::Backend(e.into().to_string())
}

fn corrupt(e: serde_json::Error) -> StorageError {
    StorageError::Corrupt(e.to_string())
}

/// A message row as stored: a receipt, or a message.
fn decode(json: &[u8]) -> Result<StoredMessage> {
    if Receipt::is_encoded(json) {
        serde_json::from_slice(json)
            .map(StoredMessage::Settled)
            .map_err(corrupt)
    } else {
        serde_json::from_slice(json)
            .map(StoredMessage::Pending)
            .map_err(corrupt)
    }
}

#[derive(Clone)]
pub struct EmbeddedStore {
    db: Arc<Database>,
    writer: Writer,
    /// Durable copies of direct messages in flight ([`journal`]).
    journal: Journal,
    /// What a [`DirectCopy`] calls to have its copy written now.
    hurry: Hurry,
    /// Where the next housekeeping step over messages and receipts starts.
    sweep_cursor: Arc<Mutex<SweepCursor>>,
    /// Where the next housekeeping step over users starts (exclusive).
    user_cursor: Arc<Mutex<Option<u128>>>,
    /// Seconds a receipt is kept after its message's final state; 0: off.
    retention: u64,
    /// Whether the store holds receipts an older store wrote (see
    /// [`receipts::OLD_RECEIPTS`]), until a start-up finds them all swept.
    old_receipts: bool,
}

/// MiB of the database file kept in memory unless asked otherwise: the
/// users and channels of a few hundred thousand clients, and the newest
/// messages and receipts. redb's own default, 1 GiB, filled up within
/// minutes of a busy node's writes and stayed.
pub const DEFAULT_CACHE_MIB: usize = 64;

impl EmbeddedStore {
    /// Open (creating if needed) the store in directory `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with_cache(dir, DEFAULT_CACHE_MIB << 20)
    }

    /// [`EmbeddedStore::open`], keeping up to `cache` bytes of the database
    /// file in memory.
    pub fn open_with_cache(dir: &Path, cache: usize) -> Result<Self> {
        Self::open_with(dir, cache, |file, _| Box::new(file))
    }

    /// [`EmbeddedStore::open_with_cache`], the journal writing its file
    /// through what `wrap` makes of it and the database (a test's
    /// recorder).
    fn open_with(
        dir: &Path,
        cache: usize,
        wrap: impl FnOnce(std::fs::File, &Arc<Database>) -> Box<dyn JournalFile>,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StorageError::Backend(format!("cannot create {}: {e}", dir.display())))?;
        let path: PathBuf = dir.join("autopush.redb");
        let db = redb::Builder::new()
            .set_cache_size(cache)
            .create(&path)
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => {
                    StorageError::InUse(path.display().to_string())
                }
                e => StorageError::Backend(format!("{}: {}", path.display(), redb::Error::from(e))),
            })?;
        let txn = db.begin_write().map_err(backend)?;
        txn.open_table(USERS).map_err(backend)?;
        txn.open_table(CHANNELS).map_err(backend)?;
        txn.open_table(MESSAGES).map_err(backend)?;
        txn.open_table(RECEIPTS).map_err(backend)?;
        let old_receipts = receipts::old_held(&txn)?;
        txn.commit().map_err(backend)?;
        let db = Arc::new(db);
        let writer = Writer::start(db.clone())?;
        let journal = Journal::open(dir, &db, writer.clone(), |file| wrap(file, &db))?;
        let hurry = {
            let journal = journal.clone();
            Arc::new(move || journal.hurry())
        };
        Ok(EmbeddedStore {
            db,
            writer,
            journal,
            hurry,
            sweep_cursor: Default::default(),
            user_cursor: Default::default(),
            retention: 0,
            old_receipts,
        })
    }

    /// Move every record that can be read from a direct journal file the
    /// node refused to start on (moved aside, not this store's own) into
    /// this store: `autopush db replay-journal`.
    pub fn replay_journal(&self, file: &Path) -> Result<JournalReplay> {
        Journal::replay_file(file, &self.db)
    }

    /// The users with a message pending in this store: what a connection
    /// node's journal moves at start (see `autopush_webpush::node_journal`).
    pub async fn users_with_messages(&self) -> Result<Vec<Uuid>> {
        self.run(|db| {
            let txn = db.begin_read().map_err(backend)?;
            let table = txn.open_table(MESSAGES).map_err(backend)?;
            let mut users: Vec<Uuid> = Vec::new();
            for entry in table.iter().map_err(backend)? {
                let (key, row) = entry.map_err(backend)?;
                let uaid = Uuid::from_u128(key.value().0);
                if users.last() != Some(&uaid)
                    && matches!(decode(row.value())?, StoredMessage::Pending(_))
                {
                    users.push(uaid);
                }
            }
            Ok(users)
        })
        .await
    }

    /// Keep receipts `seconds` after a message's final state (0: off, the
    /// default): see [`crate::receipt`].
    pub fn with_receipt_retention(mut self, seconds: u64) -> Self {
        self.retention = seconds;
        self
    }

    /// Run a point read now, on this thread.
    fn read<T>(&self, f: impl FnOnce(&Database) -> Result<T>) -> Result<T> {
        f(&self.db)
    }

    /// Run a scan on the blocking pool.
    async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T> + Send + 'static,
    {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| StorageError::Backend(format!("storage task failed: {e}")))?
    }

    /// Change an existing user record in one write transaction: `change`
    /// sees the record as stored and says whether to write it back. Returns
    /// whether it was written (`false` also when there is no record).
    async fn change_user<F>(&self, uaid: Uuid, mut change: F) -> Result<bool>
    where
        F: FnMut(&mut User) -> bool + Send + 'static,
    {
        self.write(move |txn| {
            let Some(mut user) = read_user(txn, uaid.as_u128())? else {
                return Ok(false);
            };
            if !change(&mut user) {
                return Ok(false);
            }
            write_user(txn, &user)?;
            Ok(true)
        })
        .await
    }

    /// Apply `f` in the next group commit; returns once it is durable.
    async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&redb::WriteTransaction) -> Result<T> + Send + 'static,
    {
        self.writer.write(f).await
    }

    /// After a user's removal: its journaled messages go as its stored ones
    /// did (`gone` receipts with receipts on), each on its version.
    async fn remove_journaled(&self, uaid: u128) -> Result<()> {
        let uaid = Uuid::from_u128(uaid);
        for (key, version) in self.journal.versions(uaid.as_u128()) {
            if self.retention > 0 {
                let gone = self
                    .settle_message(&uaid, &key, &version, MessageState::Gone)
                    .await?;
                final_states_in_store(MessageState::Gone, usize::from(gone));
            } else {
                self.remove_message(&uaid, &key, &version).await?;
            }
        }
        Ok(())
    }
}

fn read_user(txn: &redb::WriteTransaction, uaid: u128) -> Result<Option<User>> {
    user_in(&txn.open_table(USERS).map_err(backend)?, uaid)
}

/// The user `uaid` of `users` (read or write transaction's), decoded.
fn user_in(users: &impl ReadableTable<u128, &'static [u8]>, uaid: u128) -> Result<Option<User>> {
    let record = users.get(uaid).map_err(backend)?;
    record
        .map(|v| serde_json::from_slice(v.value()).map_err(corrupt))
        .transpose()
}

/// Remove a user's record, channels and messages. With receipts on
/// (`retention` seconds), its pending messages leave `gone` receipts instead,
/// and its receipts and expired messages stay until their own expiry.
fn remove_user_rows(txn: &redb::WriteTransaction, uaid: u128, retention: u64) -> Result<usize> {
    txn.open_table(USERS)
        .map_err(backend)?
        .remove(uaid)
        .map_err(backend)?;
    txn.open_table(CHANNELS)
        .map_err(backend)?
        .retain_in((uaid, 0)..=(uaid, u128::MAX), |_, _| false)
        .map_err(backend)?;
    let mut messages = txn.open_table(MESSAGES).map_err(backend)?;
    let range = (uaid, "")..=(uaid, SORT_KEY_MAX);
    if retention == 0 {
        messages.retain_in(range, |_, _| false).map_err(backend)?;
        return Ok(0);
    }
    let now = now_secs();
    let mut gone = Vec::new();
    for entry in messages.range(range).map_err(backend)? {
        let (key, value) = entry.map_err(backend)?;
        if let StoredMessage::Pending(m) = decode(value.value())?
            && !m.is_expired(now)
        {
            let receipt = Receipt::new(&m.version, MessageState::Gone, now, retention);
            gone.push((key.value().1.to_owned(), receipt));
        }
    }
    let mut receipts = txn.open_table(RECEIPTS).map_err(backend)?;
    for (key, receipt) in &gone {
        put_receipt(&mut messages, &mut receipts, uaid, key, receipt)?;
    }
    Ok(gone.len())
}

/// Settle the message stored under `key` into `receipt`: its row goes and
/// the receipt takes one in the receipts table, under the message's key or,
/// for a Topic message, under a key of its own (see [`receipt_key`]), so
/// that the next message with that Topic cannot hide it.
fn put_receipt(
    messages: &mut redb::Table<(u128, &str), &[u8]>,
    receipts: &mut redb::Table<receipts::Key, receipts::Row>,
    uaid: u128,
    key: &str,
    receipt: &Receipt,
) -> Result<()> {
    messages.remove((uaid, key)).map_err(backend)?;
    let own = receipt_key(key, &receipt.version);
    receipts::put(receipts, uaid, own.as_deref().unwrap_or(key), receipt)
}

/// Delete the message under `key` if it is still `version`; returns whether
/// it was deleted.
fn remove_version(
    table: &mut redb::Table<(u128, &str), &[u8]>,
    key: (u128, &str),
    version: &str,
) -> Result<bool> {
    let is_version = match table.get(key).map_err(backend)? {
        Some(stored) => decode(stored.value())?.version() == version,
        None => false,
    };
    if is_version {
        table.remove(key).map_err(backend)?;
    }
    Ok(is_version)
}

/// The first `limit` of the messages read from redb and the journal's
/// unexpired ones, in key order; a key in both is the same message, its
/// journal copy moving into redb.
fn merge_journaled(
    stored: Vec<Notification>,
    journaled: Vec<Notification>,
    limit: usize,
) -> Vec<Notification> {
    if journaled.is_empty() {
        return stored;
    }
    let now = now_secs();
    let mut merged: std::collections::BTreeMap<String, Notification> =
        stored.into_iter().map(|m| (m.sort_key(), m)).collect();
    for message in journaled {
        if !message.is_expired(now) {
            merged.insert(message.sort_key(), message);
        }
    }
    merged.into_values().take(limit).collect()
}

/// Where a pass of housekeeping over the stored rows is: over the
/// messages, then over the receipts, each after the row named (exclusive).
#[derive(Clone, Default)]
struct SweepCursor {
    messages: Option<(u128, String)>,
    in_receipts: bool,
    receipts: Option<receipts::Cursor>,
}

impl SweepCursor {
    /// Whether a pass starts here: the last one has ended.
    fn is_start(&self) -> bool {
        !self.in_receipts && self.messages.is_none()
    }
}

/// What one step of a pass over a table found: its dead rows, how many rows
/// it looked at, and where the next step starts (`None`: the pass ended).
type Step<R> = (Vec<R>, usize, Option<R>);

/// One step of a pass over a table's rows, given as (row, whether it is
/// dead) in key order from `start` on: up to `budget` rows after `start`.
fn step_over<R: PartialEq + Clone>(
    rows: impl Iterator<Item = Result<(R, bool)>>,
    start: Option<&R>,
    budget: usize,
) -> Result<Step<R>> {
    let (mut dead, mut seen, mut last) = (Vec::new(), 0, None);
    for row in rows {
        let (row, is_dead) = row?;
        if start == Some(&row) {
            continue;
        }
        if seen == budget {
            return Ok((dead, seen, last));
        }
        if is_dead {
            dead.push(last.insert(row).clone());
        } else {
            last = Some(row);
        }
        seen += 1;
    }
    Ok((dead, seen, None))
}

/// [`step_over`] the message table: rows past their use at `now` (see
/// [`StoredMessage::is_dead`]).
fn dead_messages_after(
    table: &redb::ReadOnlyTable<(u128, &'static str), &'static [u8]>,
    start: Option<&(u128, String)>,
    budget: usize,
    now: u64,
    retention: u64,
) -> Result<Step<(u128, String)>> {
    let entries = match start {
        Some((uaid, key)) => table.range((*uaid, key.as_str())..),
        None => table.range::<(u128, &str)>(..),
    }
    .map_err(backend)?;
    let rows = entries.map(|entry| {
        let (key, value) = entry.map_err(backend)?;
        let (uaid, sort_key) = key.value();
        let is_dead = decode(value.value())?.is_dead(now, retention);
        Ok(((uaid, sort_key.to_owned()), is_dead))
    });
    step_over(rows, start, budget)
}

/// A webpush user that has not said hello since `before` (ms).
fn is_idle(user: &User, before: u64) -> bool {
    user.router_type == RouterType::WebPush && user.last_connect < before
}

fn lock<T>(cursor: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    cursor
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write_user(txn: &redb::WriteTransaction, user: &User) -> Result<()> {
    let json = serde_json::to_vec(user).map_err(corrupt)?;
    let mut users = txn.open_table(USERS).map_err(backend)?;
    users
        .insert(user.uaid.as_u128(), json.as_slice())
        .map_err(backend)?;
    Ok(())
}

#[async_trait]
impl Storage for EmbeddedStore {
    async fn add_user(&self, user: &User) -> Result<()> {
        let user = user.clone();
        self.write(move |txn| write_user(txn, &user)).await
    }

    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool> {
        let user = user.clone();
        self.change_user(user.uaid, move |stored| {
            if stored.connected_at != seen_connected_at {
                return false;
            }
            stored.node_id = user.node_id.clone();
            stored.connected_at = user.connected_at;
            stored.last_connect = user.last_connect;
            stored.over_msg_limit = user.over_msg_limit;
            true
        })
        .await
    }

    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool> {
        self.change_user(*uaid, move |stored| {
            stored.last_connect = last_connect;
            true
        })
        .await
    }

    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool> {
        let (seen, router_data) = (seen.cloned(), router_data.clone());
        self.change_user(*uaid, move |stored| {
            if stored.router_data != seen {
                return false;
            }
            stored.router_data = Some(router_data.clone());
            true
        })
        .await
    }

    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
        let route = route.cloned();
        self.change_user(*uaid, move |stored| {
            stored.wake_route = route.clone();
            true
        })
        .await
    }

    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
        let seen = seen.clone();
        self.change_user(*uaid, move |stored| {
            if stored.wake_route.as_ref() != Some(&seen) {
                return false;
            }
            stored.wake_route = None;
            true
        })
        .await
    }

    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
        self.change_user(*uaid, move |stored| {
            if stored.last_wake != seen {
                return false;
            }
            stored.last_wake = now;
            true
        })
        .await
    }

    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        self.read(|db| {
            let txn = db.begin_read().map_err(backend)?;
            user_in(&txn.open_table(USERS).map_err(backend)?, uaid.as_u128())
        })
    }

    async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
        let uaid = uaid.as_u128();
        let retention = self.retention;
        let gone = self
            .write(move |txn| remove_user_rows(txn, uaid, retention))
            .await?;
        final_states_in_store(MessageState::Gone, gone);
        self.remove_journaled(uaid).await
    }

    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
        let retention = self.retention;
        let (uaid, connected_at, router_data) = (
            seen.uaid.as_u128(),
            seen.connected_at,
            seen.router_data.clone(),
        );
        let gone = self
            .write(move |txn| match read_user(txn, uaid)? {
                Some(user)
                    if user.connected_at == connected_at && user.router_data == router_data =>
                {
                    remove_user_rows(txn, uaid, retention).map(Some)
                }
                _ => Ok(None),
            })
            .await?;
        let Some(gone) = gone else {
            return Ok(false);
        };
        final_states_in_store(MessageState::Gone, gone);
        self.remove_journaled(uaid).await?;
        Ok(true)
    }

    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool> {
        let node_id = node_id.to_owned();
        self.change_user(*uaid, move |user| {
            if user.node_id.as_deref() != Some(&node_id) || user.connected_at != connected_at {
                return false;
            }
            user.node_id = None;
            true
        })
        .await
    }

    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool> {
        let node_id = node_id.to_owned();
        self.change_user(*uaid, move |user| {
            if user.node_id.as_deref() != Some(&node_id) || user.connected_at != connected_at {
                return false;
            }
            user.min_urgency = min;
            true
        })
        .await
    }

    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool> {
        let key = (uaid.as_u128(), channel_id.as_u128());
        self.write(move |txn| {
            let mut channels = txn.open_table(CHANNELS).map_err(backend)?;
            if channels.get(key).map_err(backend)?.is_some() {
                return Ok(true);
            }
            let held = channels
                .range((key.0, 0)..=(key.0, u128::MAX))
                .map_err(backend)?
                .take(limit)
                .count();
            if held >= limit {
                return Ok(false);
            }
            channels.insert(key, ()).map_err(backend)?;
            Ok(true)
        })
        .await
    }

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
        let uaid = uaid.as_u128();
        self.run(move |db| {
            let txn = db.begin_read().map_err(backend)?;
            let channels = txn.open_table(CHANNELS).map_err(backend)?;
            let mut out = HashSet::new();
            for entry in channels
                .range((uaid, 0)..=(uaid, u128::MAX))
                .map_err(backend)?
            {
                let (key, _) = entry.map_err(backend)?;
                out.insert(Uuid::from_u128(key.value().1));
            }
            Ok(out)
        })
        .await
    }

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let key = (uaid.as_u128(), channel_id.as_u128());
        self.read(|db| {
            let txn = db.begin_read().map_err(backend)?;
            let channels = txn.open_table(CHANNELS).map_err(backend)?;
            Ok(channels.get(key).map_err(backend)?.is_some())
        })
    }

    /// One read transaction for both.
    async fn get_user_and_channel(
        &self,
        uaid: &Uuid,
        channel_id: &Uuid,
    ) -> Result<Option<(User, bool)>> {
        let key = (uaid.as_u128(), channel_id.as_u128());
        self.read(|db| {
            let txn = db.begin_read().map_err(backend)?;
            let users = txn.open_table(USERS).map_err(backend)?;
            let Some(user) = user_in(&users, key.0)? else {
                return Ok(None);
            };
            let channels = txn.open_table(CHANNELS).map_err(backend)?;
            let subscribed = channels.get(key).map_err(backend)?.is_some();
            Ok(Some((user, subscribed)))
        })
    }

    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let key = (uaid.as_u128(), channel_id.as_u128());
        let removed = self
            .write(move |txn| {
                let mut channels = txn.open_table(CHANNELS).map_err(backend)?;
                Ok(channels.remove(key).map_err(backend)?.is_some())
            })
            .await?;
        if removed && self.retention > 0 {
            crate::receipt::after_unsubscribe(self, uaid, channel_id).await;
        }
        Ok(removed)
    }

    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let (uaid, retention, old) = (uaid.as_u128(), self.retention, self.old_receipts);
        let (taken, replaced) = self
            .write(move |txn| {
                let mut table = txn.open_table(MESSAGES).map_err(backend)?;
                let mut receipts = txn.open_table(RECEIPTS).map_err(backend)?;
                let old = receipts::old_in_write(txn, old)?;
                let (mut taken, mut replacements) = (Vec::new(), 0);
                for message in &messages {
                    let key = message.sort_key();
                    let mut replaced = None;
                    // Another message's receipt under this key: it arrived at
                    // the same microsecond on another endpoint node.
                    if message.topic.is_none()
                        && let Some(receipt) =
                            receipts::get(&receipts, old.as_ref(), uaid, &key, retention)?
                        && !receipt.is_for(&message.version)
                    {
                        taken.push(key);
                        continue;
                    }
                    if let Some(stored) = table.get((uaid, key.as_str())).map_err(backend)? {
                        let stored = decode(stored.value())?;
                        // A receipt under a Topic key is an older message's.
                        let stored_at = match &stored {
                            StoredMessage::Pending(m) => m.sortkey_timestamp,
                            StoredMessage::Settled(_) => None,
                        };
                        if message.topic.is_some() && stored_at > message.sortkey_timestamp {
                            continue;
                        }
                        if message.topic.is_none() && stored.version() != message.version {
                            taken.push(key);
                            continue;
                        }
                        replaced = match stored {
                            StoredMessage::Pending(old) if old.version != message.version => {
                                Some(old)
                            }
                            _ => None,
                        };
                    }
                    let json = message.to_json().map_err(corrupt)?;
                    table
                        .insert((uaid, key.as_str()), json.as_slice())
                        .map_err(backend)?;
                    if let Some(old) = replaced.filter(|_| retention > 0)
                        && let Some(own) = receipt_key(&key, &old.version)
                    {
                        let receipt = Receipt::replaced(&old, now_secs(), retention);
                        replacements += usize::from(receipt.state == MessageState::Replaced);
                        receipts::put(&mut receipts, uaid, &own, &receipt)?;
                    }
                }
                Ok((taken, replacements))
            })
            .await?;
        final_states_in_store(MessageState::Replaced, replaced);
        match taken.first() {
            Some(key) => Err(StorageError::KeyTaken(key.clone())),
            None => Ok(()),
        }
    }

    async fn save_direct(&self, uaid: &Uuid, message: Notification) -> Result<()> {
        if !Journal::takes(&message) {
            return self.save_messages(uaid, vec![message]).await;
        }
        match self.journal.stage(uaid, message, false) {
            Ok(done) => crate::copy_written(done).await.map(drop),
            // While the journal takes none (until it starts over), redb
            // takes the message.
            Err(NotStaged::Closed(message, _)) => self.save_messages(uaid, vec![*message]).await,
            Err(NotStaged::Refused(e)) => Err(e),
        }
    }

    /// Into the journal's index at once, written after its grace unless
    /// the client acks it first (see `Journal::stage`).
    async fn stage_direct(&self, uaid: &Uuid, message: Notification) -> Result<DirectCopy> {
        if !Journal::takes(&message) {
            self.save_messages(uaid, vec![message]).await?;
            return Ok(DirectCopy::saved());
        }
        match self.journal.stage(uaid, message, true) {
            Ok(done) => Ok(DirectCopy::new(done, self.hurry.clone())),
            // While the journal takes none (until it starts over), the
            // copy goes to redb, saved at once: its ack settles it there.
            Err(NotStaged::Closed(message, _)) => {
                self.save_messages(uaid, vec![*message]).await?;
                Ok(DirectCopy::saved())
            }
            Err(NotStaged::Refused(e)) => Err(e),
        }
    }

    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
        let (uaid, retention) = (uaid.as_u128(), self.retention);
        // Read before redb: see `Journal::messages`.
        let journaled = self.journal.messages(uaid);
        let (messages, expired) = self
            .run(move |db| {
                let now = now_secs();
                let txn = db.begin_read().map_err(backend)?;
                let table = txn.open_table(MESSAGES).map_err(backend)?;
                let (mut messages, mut expired) = (Vec::new(), Vec::new());
                for entry in table
                    .range((uaid, "")..=(uaid, SORT_KEY_MAX))
                    .map_err(backend)?
                {
                    let (key, value) = entry.map_err(backend)?;
                    let row = decode(value.value())?;
                    if row.is_dead(now, retention) {
                        expired.push((key.value().1.to_owned(), row.version().to_owned()));
                        continue;
                    }
                    match row {
                        StoredMessage::Pending(m) if !m.is_expired(now) => {
                            if messages.len() == limit {
                                break;
                            }
                            messages.push(m);
                        }
                        _ => {}
                    }
                }
                Ok((messages, expired))
            })
            .await?;
        let messages = merge_journaled(messages, journaled, limit);
        if !expired.is_empty() {
            // A sender may have stored a new message under an expired one's
            // Topic since it was read: delete only the version read.
            self.write(move |txn| {
                let mut table = txn.open_table(MESSAGES).map_err(backend)?;
                for (key, version) in &expired {
                    remove_version(&mut table, (uaid, key), version)?;
                }
                Ok(())
            })
            .await?;
        }
        Ok(messages)
    }

    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
        let uaid = uaid.as_u128();
        let journaled = self.journal.messages(uaid);
        let now = now_secs();
        let journaled = journaled.iter().filter(|m| !m.is_expired(now)).count();
        let (limit, up_to) = (up_to, up_to.saturating_sub(journaled));
        // Up to `up_to` rows (msg_limit at hello): a scan, not a point read.
        let stored = self
            .run(move |db| {
                let now = now_secs();
                let txn = db.begin_read().map_err(backend)?;
                let table = txn.open_table(MESSAGES).map_err(backend)?;
                let mut count = 0;
                for entry in table
                    .range((uaid, "")..=(uaid, SORT_KEY_MAX))
                    .map_err(backend)?
                {
                    if count >= up_to {
                        break;
                    }
                    let (_, value) = entry.map_err(backend)?;
                    if let StoredMessage::Pending(m) = decode(value.value())?
                        && !m.is_expired(now)
                    {
                        count += 1;
                    }
                }
                Ok(count)
            })
            .await?;
        Ok((stored + journaled).min(limit))
    }

    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool> {
        if let Settled::Here(removed) =
            self.journal
                .settle(uaid.as_u128(), sort_key, version, None, None, false)?
        {
            return Ok(removed);
        }
        let (uaid, sort_key, version) = (uaid.as_u128(), sort_key.to_owned(), version.to_owned());
        let old = self.old_receipts;
        self.write(move |txn| {
            let mut table = txn.open_table(MESSAGES).map_err(backend)?;
            if remove_version(&mut table, (uaid, &sort_key), &version)? {
                return Ok(true);
            }
            // A settled message: its receipt goes, as its row would.
            let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
            let mut old = receipts::old_in_write(txn, old)?;
            receipts::remove_version(&mut table, old.as_mut(), uaid, &sort_key, &version)
        })
        .await
    }

    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        let (uaid, retention, now) = (uaid.as_u128(), self.retention, now_secs());
        let receipt = (retention > 0).then(|| Receipt::new(version, state, now, retention));
        let ack = state == MessageState::Delivered;
        let journaled = self
            .journal
            .settle(uaid, sort_key, version, receipt, Some(now), ack)?;
        if let Settled::Here(settled) = journaled {
            return Ok(settled);
        }
        // Owned only now: the journal settles almost every message.
        let (sort_key, version) = (sort_key.to_owned(), version.to_owned());
        self.write(move |txn| {
            let mut table = txn.open_table(MESSAGES).map_err(backend)?;
            let mut receipts = txn.open_table(RECEIPTS).map_err(backend)?;
            let key = (uaid, sort_key.as_str());
            // Expired is final: its row stays for its `expired` receipt.
            let pending = match table.get(key).map_err(backend)? {
                Some(row) => matches!(decode(row.value())?, StoredMessage::Pending(m)
                    if m.version == version && !m.is_expired(now_secs())),
                None => false,
            };
            if !pending {
                return Ok(false);
            }
            if retention == 0 {
                table.remove(key).map_err(backend)?;
            } else {
                let receipt = Receipt::new(&version, state, now_secs(), retention);
                put_receipt(&mut table, &mut receipts, uaid, &sort_key, &receipt)?;
            }
            Ok(true)
        })
        .await
    }

    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>> {
        if let Some(row) = self.journal.read(uaid.as_u128(), sort_key) {
            return Ok(Some(row));
        }
        let (uaid, retention) = (uaid.as_u128(), self.retention);
        self.read(|db| {
            let txn = db.begin_read().map_err(backend)?;
            let table = txn.open_table(MESSAGES).map_err(backend)?;
            if let Some(row) = table.get((uaid, sort_key)).map_err(backend)? {
                return decode(row.value()).map(Some);
            }
            let receipts = txn.open_table(RECEIPTS).map_err(backend)?;
            let old = receipts::old_in_read(&txn)?;
            let receipt = receipts::get(&receipts, old.as_ref(), uaid, sort_key, retention)?;
            Ok(receipt.map(StoredMessage::Settled))
        })
    }

    async fn sweep_expired_messages(&self, budget: usize) -> Result<SweepStep> {
        let cursor = lock(&self.sweep_cursor).clone();
        let retention = self.retention;
        let (messages, receipts, next) = self
            .run(move |db| {
                let now = now_secs();
                let txn = db.begin_read().map_err(backend)?;
                let (mut next, mut left) = (cursor, budget);
                let mut messages = Vec::new();
                if !next.in_receipts {
                    let table = txn.open_table(MESSAGES).map_err(backend)?;
                    let (dead, seen, after) = dead_messages_after(
                        &table,
                        next.messages.as_ref(),
                        budget,
                        now,
                        retention,
                    )?;
                    (messages, left) = (dead, budget - seen);
                    next.in_receipts = after.is_none();
                    next.messages = after;
                }
                let mut receipts = Vec::new();
                if next.in_receipts && left > 0 {
                    let table = txn.open_table(RECEIPTS).map_err(backend)?;
                    let old = receipts::old_in_read(&txn)?;
                    let (dead, _, after) = receipts::expired_after(
                        &table,
                        old.as_ref(),
                        next.receipts.as_ref(),
                        left,
                        now,
                        retention,
                    )?;
                    receipts = dead;
                    next = match after {
                        Some(after) => SweepCursor {
                            receipts: Some(after),
                            ..next
                        },
                        None => SweepCursor::default(),
                    };
                }
                Ok((messages, receipts, next))
            })
            .await?;
        let finished_pass = next.is_start();
        *lock(&self.sweep_cursor) = next;
        if messages.is_empty() && receipts.is_empty() {
            return Ok(SweepStep {
                removed: 0,
                finished_pass,
            });
        }
        let old = self.old_receipts;
        let removed = self
            .write(move |txn| {
                let now = now_secs();
                let mut table = txn.open_table(MESSAGES).map_err(backend)?;
                let mut removed = 0;
                for (uaid, sort_key) in &messages {
                    let key = (*uaid, sort_key.as_str());
                    // Looked again under the write lock: a newer Topic
                    // message may have replaced the expired one meanwhile.
                    let still_expired = match table.get(key).map_err(backend)? {
                        Some(value) => decode(value.value())?.is_dead(now, retention),
                        None => false,
                    };
                    if still_expired {
                        table.remove(key).map_err(backend)?;
                        removed += 1;
                    }
                }
                let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
                let mut old = receipts::old_in_write(txn, old)?;
                let gone =
                    receipts::remove_expired(&mut table, old.as_mut(), &receipts, now, retention)?;
                Ok(removed + gone)
            })
            .await?;
        Ok(SweepStep {
            removed,
            finished_pass,
        })
    }

    async fn drop_idle_users(&self, last_connect_before: u64, budget: usize) -> Result<SweepStep> {
        let retention = self.retention;
        let start = *lock(&self.user_cursor);
        let (idle, next) = self
            .run(move |db| {
                let txn = db.begin_read().map_err(backend)?;
                let users = txn.open_table(USERS).map_err(backend)?;
                let entries = match start {
                    Some(uaid) => users.range(uaid..),
                    None => users.range::<u128>(..),
                }
                .map_err(backend)?;
                let (mut idle, mut seen, mut last) = (Vec::new(), 0, None);
                for entry in entries {
                    let (key, value) = entry.map_err(backend)?;
                    let uaid = key.value();
                    if start == Some(uaid) {
                        continue;
                    }
                    let user: User = serde_json::from_slice(value.value()).map_err(corrupt)?;
                    if is_idle(&user, last_connect_before) {
                        idle.push(uaid);
                    }
                    last = Some(uaid);
                    seen += 1;
                    if seen == budget {
                        break;
                    }
                }
                Ok((idle, (seen == budget).then_some(last).flatten()))
            })
            .await?;
        let finished_pass = next.is_none();
        *lock(&self.user_cursor) = next;
        let mut removed = 0;
        // One user per write: removing one holds the writer only briefly.
        for uaid in idle {
            let gone = self
                .write(move |txn| match read_user(txn, uaid)? {
                    // Looked again under the write lock: it may have said hello.
                    Some(user) if is_idle(&user, last_connect_before) => {
                        remove_user_rows(txn, uaid, retention).map(Some)
                    }
                    _ => Ok(None),
                })
                .await?;
            if let Some(gone) = gone {
                final_states_in_store(MessageState::Gone, gone);
                self.remove_journaled(uaid).await?;
                removed += 1;
            }
        }
        Ok(SweepStep {
            removed,
            finished_pass,
        })
    }

    async fn health_check(&self) -> Result<()> {
        if !self.writer.is_running() {
            return Err(StorageError::Backend(
                "the embedded store's writer thread has stopped".into(),
            ));
        }
        self.journal.health()?;
        self.read(|db| {
            let txn = db.begin_read().map_err(backend)?;
            txn.open_table(USERS)
                .map_err(backend)?
                .len()
                .map_err(backend)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads alone would keep answering after the writer thread died; the
    /// health check must say the store cannot take writes.
    #[tokio::test]
    async fn health_fails_once_the_writer_has_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        store.health_check().await.unwrap();
        let died = store
            .write(|_| -> Result<()> { panic!("a bug in a write") })
            .await;
        assert!(died.is_err());
        // The caller hears of the panic while the thread is still unwinding.
        let guard = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let health = loop {
            let health = store.health_check().await;
            if health.is_err() || std::time::Instant::now() > guard {
                break health;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        assert!(
            matches!(&health, Err(StorageError::Backend(m)) if m.contains("writer")),
            "{health:?}"
        );
    }

    fn message(channel_id: Uuid, topic: Option<&str>, ts: u64) -> Notification {
        Notification {
            channel_id,
            version: format!("v{ts}"),
            ttl: 600,
            timestamp: now_secs(),
            topic: topic.map(str::to_owned),
            sortkey_timestamp: Some(ts),
            data: Some(format!("data {ts}")),
            headers: None,
            urgency: None,
            durable: false,
        }
    }

    /// A store in a new directory, receipts kept an hour, and a user.
    pub(super) fn store_with_receipts() -> (tempfile::TempDir, Uuid, EmbeddedStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path())
            .unwrap()
            .with_receipt_retention(3600);
        (dir, Uuid::new_v4(), store)
    }

    /// The keys of a user's rows in the message table.
    fn message_rows(store: &EmbeddedStore, uaid: u128) -> Vec<String> {
        let txn = store.db.begin_read().unwrap();
        let table = txn.open_table(MESSAGES).unwrap();
        table
            .range((uaid, "")..=(uaid, SORT_KEY_MAX))
            .unwrap()
            .map(|entry| entry.unwrap().0.value().1.to_owned())
            .collect()
    }

    /// A settled message leaves the message table (a fetch of its user's
    /// pending messages never reads past it) for the receipts table, where
    /// its receipt is read from its key; the sweep removes receipts past
    /// their expiry. Receipts written by an older store, in the message
    /// table, are still read.
    #[tokio::test]
    async fn receipts_live_apart_from_messages_and_expire() {
        let (_dir, uaid, store) = store_with_receipts();
        let chid = Uuid::new_v4();
        let plain = message(chid, None, 1);
        let topic = message(chid, Some("t"), 2);
        let pending = message(chid, None, 3);
        let all = vec![plain.clone(), topic.clone(), pending.clone()];
        store.save_messages(&uaid, all).await.unwrap();
        let delivered = MessageState::Delivered;
        for m in [&plain, &topic] {
            let key = m.sort_key();
            let settled = store.settle_message(&uaid, &key, &m.version, delivered);
            assert!(settled.await.unwrap());
        }
        assert_eq!(message_rows(&store, uaid.as_u128()), [pending.sort_key()]);
        let topic_receipt = receipt_key(&topic.sort_key(), &topic.version).unwrap();
        for (key, version) in [
            (plain.sort_key(), &plain.version),
            (topic_receipt, &topic.version),
        ] {
            match store.read_message(&uaid, &key).await.unwrap() {
                Some(StoredMessage::Settled(r)) => {
                    assert!(r.is_for(version) && r.state == delivered, "{r:?}");
                }
                other => panic!("{key}: {other:?}"),
            }
        }

        let (old, legacy) = (message(chid, None, 0), message(chid, None, 4));
        let expired = Receipt::new(&old.version, delivered, 10, 60);
        let kept = Receipt::new(&legacy.version, delivered, now_secs(), 60);
        let (old_key, legacy_key) = (old.sort_key(), legacy.sort_key());
        store
            .write(move |txn| {
                let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
                receipts::put(&mut table, uaid.as_u128(), &old_key, &expired)?;
                let json = serde_json::to_vec(&kept).map_err(corrupt)?;
                let mut table = txn.open_table(MESSAGES).map_err(backend)?;
                table
                    .insert((uaid.as_u128(), legacy_key.as_str()), json.as_slice())
                    .map_err(backend)?;
                Ok(())
            })
            .await
            .unwrap();
        let legacy_row = store.read_message(&uaid, &legacy.sort_key()).await.unwrap();
        assert!(
            matches!(legacy_row, Some(StoredMessage::Settled(r)) if r.version == legacy.version)
        );
        let mut removed = 0;
        loop {
            let step = store.sweep_expired_messages(1).await.unwrap();
            removed += step.removed;
            if step.finished_pass {
                break;
            }
        }
        assert_eq!(removed, 1);
        assert_eq!(
            store.read_message(&uaid, &old.sort_key()).await.unwrap(),
            None
        );
        let left = store.read_message(&uaid, &plain.sort_key()).await.unwrap();
        assert!(matches!(left, Some(StoredMessage::Settled(_))));
        assert_eq!(
            data(&store.fetch_messages(&uaid, 10).await.unwrap()),
            ["data 3"]
        );
    }

    /// Removing a settled message takes its receipt, as removing its row
    /// did when the receipt was that row (and as on the other backends);
    /// another version's removal leaves it.
    #[tokio::test]
    async fn removing_a_settled_message_takes_its_receipt() {
        let (_dir, uaid, store) = store_with_receipts();
        let m = message(Uuid::new_v4(), None, 1);
        let key = m.sort_key();
        store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
        let settled = store.settle_message(&uaid, &key, &m.version, MessageState::Delivered);
        assert!(settled.await.unwrap());
        assert!(!store.remove_message(&uaid, &key, "another").await.unwrap());
        assert!(store.read_message(&uaid, &key).await.unwrap().is_some());
        assert!(store.remove_message(&uaid, &key, &m.version).await.unwrap());
        assert_eq!(store.read_message(&uaid, &key).await.unwrap(), None);
    }

    fn data(messages: &[Notification]) -> Vec<&str> {
        messages.iter().filter_map(|m| m.data.as_deref()).collect()
    }
}
