//! The Bigtable backend, on autopush-rs's schema (see [`row`]), so an
//! operator of autopush-rs switches in place: same table, same rows, and a
//! way back.
//!
//! Every change to a user record is one `CheckAndMutateRow` on the row
//! `{uaid}`, its predicate the condition the other backends check (the
//! `connected_at`, `node_id` or `router_data` that was read); a message is
//! deleted by `CheckAndMutateRow` on its version. Reads skip expired cells
//! (the families' GC is asynchronous) and, like autopush-rs, the timestamp
//! messages up to the user's `current_timestamp`, which autopush-rs uses
//! instead of deleting what a client acknowledged.
//!
//! With receipts on (a retention window), settling a message is one
//! `CheckAndMutateRow` on its version that replaces its cells with the
//! receipt's, and a pending message keeps a small cell past its TTL for its
//! `expired` receipt (see [`row`]; autopush-rs cannot read those rows).
//!
//! Not touched: the `reliability` family autopush-rs writes for Mozilla's
//! own delivery tracking.

pub mod admin;
pub mod client;
pub mod legacy;
pub mod row;
pub mod settings;

use std::collections::HashSet;

use async_trait::async_trait;
use autopush_common::{Notification, Urgency, User, WakeRoute, time::now_secs};
use futures_util::{StreamExt, TryStreamExt};
use googleapis_tonic_google_bigtable_v2::google::bigtable::v2::{
    self as pb, RowFilter, RowRange, RowSet, mutate_rows_request, row_range,
};
use uuid::Uuid;

use crate::{Receipt, Result, Storage, StorageError, StoredMessage};
use autopush_common::metrics::final_states_in_store;
use autopush_common::notification::receipt_key;
use autopush_common::receipt::MessageState;
use client::Connection;
pub use googleapis_tonic_google_bigtable_v2::google::bigtable::v2 as proto;
use row::Families;
pub use settings::BigtableSettings;

#[derive(Clone)]
pub struct BigtableStore {
    conn: Connection,
    /// Seconds a receipt is kept; 0: receipts off.
    retention: u64,
    /// Now, in unix seconds, for the stamps of the user row's cells.
    clock: Clock,
}

/// Unix seconds.
type Clock = std::sync::Arc<dyn Fn() -> u64 + Send + Sync>;

/// Rows `start` (exclusive when `open`) to `end` (exclusive).
fn range(start: Vec<u8>, open: bool, end: Vec<u8>) -> RowSet {
    let start = match open {
        true => row_range::StartKey::StartKeyOpen(start),
        false => row_range::StartKey::StartKeyClosed(start),
    };
    RowSet {
        row_keys: Vec::new(),
        row_ranges: vec![RowRange {
            start_key: Some(start),
            end_key: Some(row_range::EndKey::EndKeyOpen(end)),
        }],
    }
}

/// Bigtable's `rows_limit`, where 0 means no limit.
fn rows_limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl BigtableStore {
    pub async fn connect(settings: BigtableSettings) -> Result<Self> {
        Ok(BigtableStore {
            conn: Connection::open(settings).await?,
            retention: 0,
            clock: std::sync::Arc::new(now_secs),
        })
    }

    /// Stamp the user row's cells from `clock` (unix seconds) instead of
    /// the system clock: tests live through months of GC in a moment.
    pub fn with_clock(mut self, clock: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        self.clock = std::sync::Arc::new(clock);
        self
    }

    /// The stamp of a user row's cell written now.
    fn stamp(&self) -> i64 {
        row::router_stamp((self.clock)())
    }

    /// Keep receipts of settled messages, and pending messages past their
    /// TTL, for `seconds` (0: off, as autopush-rs needs).
    pub fn with_receipt_retention(mut self, seconds: u64) -> Self {
        self.retention = seconds;
        self
    }

    pub fn settings(&self) -> &BigtableSettings {
        &self.conn.settings
    }

    /// The gRPC connection, for tests and tools that write rows as
    /// autopush-rs lays them out.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    fn families(&self) -> &Families {
        &self.conn.settings.families
    }

    fn read_request(&self, rows: RowSet, filter: RowFilter, limit: usize) -> pb::ReadRowsRequest {
        pb::ReadRowsRequest {
            table_name: self.conn.settings.table_name.clone(),
            app_profile_id: self.conn.settings.app_profile_id.clone(),
            rows: Some(rows),
            filter: Some(filter),
            rows_limit: rows_limit(limit),
            ..Default::default()
        }
    }

    /// One row, the cells `filter` keeps.
    async fn read_row(&self, key: Vec<u8>, filter: RowFilter) -> Result<Option<row::Row>> {
        let rows = RowSet {
            row_keys: vec![key],
            row_ranges: Vec::new(),
        };
        let mut rows = self
            .conn
            .read_rows(self.read_request(rows, filter, 1))
            .await?;
        Ok(rows.pop())
    }

    async fn write(&self, key: Vec<u8>, mutations: Vec<pb::Mutation>) -> Result<()> {
        self.conn
            .mutate_row(pb::MutateRowRequest {
                table_name: self.conn.settings.table_name.clone(),
                app_profile_id: self.conn.settings.app_profile_id.clone(),
                row_key: key,
                mutations,
                ..Default::default()
            })
            .await
    }

    /// Apply `when_true` if `predicate` yields a cell of row `key`, else
    /// `when_false`, in one `CheckAndMutateRow`; returns whether it
    /// matched.
    async fn check_and_mutate(
        &self,
        key: Vec<u8>,
        predicate: RowFilter,
        when_true: Vec<pb::Mutation>,
        when_false: Vec<pb::Mutation>,
    ) -> Result<bool> {
        self.conn
            .check_and_mutate(pb::CheckAndMutateRowRequest {
                table_name: self.conn.settings.table_name.clone(),
                app_profile_id: self.conn.settings.app_profile_id.clone(),
                row_key: key,
                predicate_filter: Some(predicate),
                true_mutations: when_true,
                false_mutations: when_false,
                ..Default::default()
            })
            .await
    }

    /// Write the user's cells of ours (`last_connect` as given, if) again
    /// as they are, so that they live as long as the user (see [`row`]):
    /// one read, then one `CheckAndMutateRow` on those cells being what
    /// was read (value and stamp); read again after a write lost to a
    /// change. Returns whether the user exists.
    async fn keep_own_cells(&self, uaid: &Uuid, last_connect: Option<u64>) -> Result<bool> {
        let families = self.families();
        let key = row::user_key(uaid);
        let exists = || row::column(&families.router, b"connected_at");
        for _ in 0..KEEP_TRIES {
            let read = self.read_row(key.clone(), row::own_cells(families)).await?;
            let Some(read) = read.filter(|r| r.get(&families.router, "connected_at").is_some())
            else {
                return Ok(false);
            };
            let stamp = self.stamp();
            let mut mutations = row::own_cells_rewritten(families, &read, stamp);
            if let Some(at) = last_connect {
                mutations.extend(row::last_connect_mutations(families, at, stamp));
            }
            let unchanged = row::and(exists(), row::own_cells_unchanged(families, &read));
            if self
                .check_and_mutate(key.clone(), unchanged, mutations, Vec::new())
                .await?
            {
                return Ok(true);
            }
        }
        // Written by others each time, so written lately: what was asked
        // of this call alone.
        let Some(at) = last_connect else {
            return Ok(true);
        };
        let mutations = row::last_connect_mutations(families, at, self.stamp());
        self.check_and_mutate(key, exists(), mutations, Vec::new())
            .await
    }

    /// The user's `connected_at` is `seen`.
    fn connected_at_is(&self, seen: u64) -> RowFilter {
        row::column_is(&self.families().router, "connected_at", &seen.to_be_bytes())
    }

    /// The user's `router_data` is `seen` (or it has none, for `None`).
    fn router_data_is(&self, seen: Option<&serde_json::Value>) -> RowFilter {
        let router = &self.families().router;
        match seen {
            Some(data) => row::column_is(router, "router_data", &row::json_bytes(data)),
            None => row::absent(row::column(router, b"router_data")),
        }
    }

    /// Delete every message row of `uaid`, expired or not. With receipts
    /// on, its pending messages leave `gone` receipts instead, each one
    /// `CheckAndMutateRow` on the version read (an ack that settled it since
    /// keeps its `delivered`), and its receipts and expired messages stay
    /// until their own expiry.
    async fn remove_message_rows(&self, uaid: &Uuid) -> Result<()> {
        let (start, end) = row::message_rows(uaid);
        let filter = match self.retention {
            0 => row::chain(vec![row::first_cell(), row::strip_values()]),
            // Pending messages: their unexpired `ttl` and `version`.
            _ => row::chain(vec![
                row::latest(),
                row::unexpired(),
                row::qualifiers(&["ttl", "version", "settled"]),
            ]),
        };
        let rows = self
            .conn
            .read_rows(self.read_request(range(start, false, end), filter, 0))
            .await?;
        if self.retention == 0 {
            let entries: Vec<_> = rows
                .into_iter()
                .map(|r| mutate_rows_request::Entry {
                    row_key: r.key,
                    mutations: vec![row::delete_row()],
                    ..Default::default()
                })
                .collect();
            if entries.is_empty() {
                return Ok(());
            }
            return self.conn.mutate_rows(entries).await;
        }
        let now = now_secs();
        let pending = rows.into_iter().filter_map(|r| {
            let (Some(version), true, None) =
                (r.any("version"), r.any("ttl").is_some(), r.any("settled"))
            else {
                return None;
            };
            let version = String::from_utf8_lossy(version).into_owned();
            Some((r.key, version))
        });
        let settled = futures_util::stream::iter(pending)
            .map(|(key, version)| async move {
                let gone = Receipt::new(&version, MessageState::Gone, now, self.retention);
                let sort_key = row::sort_key_of(&key).to_owned();
                self.settle_row(uaid, key, &sort_key, &gone).await
            })
            .buffer_unordered(REMOVAL_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
        crate::receipt::count_gone(&settled);
        Ok(())
    }

    /// The topic messages and the user's `current_timestamp` in one read,
    /// then the timestamp messages after it: up to `limit` rows, the cells
    /// `cells` keeps of each.
    async fn message_rows(
        &self,
        uaid: &Uuid,
        limit: usize,
        cells: RowFilter,
    ) -> Result<Vec<row::Row>> {
        let families = self.families();
        let (topic_start, topic_end) = row::topic_messages(uaid);
        let rows = RowSet {
            row_keys: vec![row::user_key(uaid)],
            row_ranges: range(topic_start, false, topic_end).row_ranges,
        };
        let filter = row::interleave(vec![
            row::column(&families.router, b"current_timestamp"),
            row::chain(vec![
                row::family(&families.message_topic),
                row::latest(),
                row::pending(&families.message_topic, cells.clone()),
            ]),
        ]);
        let user_key = row::user_key(uaid);
        let mut current_timestamp = None;
        let mut found = Vec::new();
        for r in self
            .conn
            .read_rows(self.read_request(rows, filter, limit.saturating_add(1)))
            .await?
        {
            match r.key == user_key {
                true => current_timestamp = row::current_timestamp(families, &r)?,
                false => found.push(r),
            }
        }
        found.truncate(limit);
        if found.len() < limit {
            let start = row::timestamp_messages_start(uaid, current_timestamp);
            let rows = range(start, true, row::timestamp_messages_end(uaid));
            let filter = row::chain(vec![
                row::family(&families.message),
                row::latest(),
                row::pending(&families.message, cells),
            ]);
            found.extend(
                self.conn
                    .read_rows(self.read_request(rows, filter, limit - found.len()))
                    .await?,
            );
        }
        Ok(found)
    }

    /// Delete message `key` if it is still `version`.
    async fn delete_version(&self, key: Vec<u8>, family: &str, version: &str) -> Result<bool> {
        let predicate = row::column_is(family, "version", version.as_bytes());
        self.check_and_mutate(key, predicate, vec![row::delete_row()], Vec::new())
            .await
    }

    /// Store one message on its condition; returns whether it was written
    /// (or was already there).
    async fn save_message(&self, uaid: &Uuid, message: &Notification) -> Result<bool> {
        let families = self.families();
        let sort_key = message.sort_key();
        let key = row::message_key(uaid, &sort_key);
        // With receipts on, what a Topic message replaces is read first: a
        // pending message there gets its `replaced` receipt.
        let before = match (&message.topic, self.retention) {
            (Some(_), 1..) => match self.read_row(key.clone(), row::latest()).await? {
                Some(r) => row::stored_from_row(&r, self.retention)?,
                None => None,
            },
            _ => None,
        };
        let mutations = row::message_mutations(families, message, self.retention);
        // Matches when what is stored must stay.
        let keep = match message.topic {
            // A newer message under this topic.
            Some(_) => {
                let ts = message.sortkey_timestamp.unwrap_or(0).to_be_bytes();
                row::chain(vec![
                    row::column(&families.message_topic, b"sortkey_timestamp"),
                    row::unexpired(),
                    row::value_above(&ts),
                ])
            }
            // A different, unexpired message under this key.
            None => {
                let version = || {
                    row::chain(vec![
                        row::column(&families.message, b"version"),
                        row::unexpired(),
                    ])
                };
                let same = row::chain(vec![version(), row::value_is(message.version.as_bytes())]);
                row::condition(same, row::block_all(), version())
            }
        };
        let kept = self
            .check_and_mutate(key, keep, Vec::new(), mutations)
            .await?;
        if !kept
            && let Some(StoredMessage::Pending(old)) = before
            && old.version != message.version
            && let Some(own) = receipt_key(&sort_key, &old.version)
        {
            // Unless it was settled between the read and the write: then
            // its own receipt is there already and stays.
            let receipt = Receipt::replaced(&old, now_secs(), self.retention);
            let mutations = row::receipt_mutations(&families.message_topic, &receipt);
            let own = row::message_key(uaid, &own);
            let settled_meanwhile = self
                .check_and_mutate(own, row::pass_all(), Vec::new(), mutations)
                .await?;
            if !settled_meanwhile && receipt.state == MessageState::Replaced {
                final_states_in_store(MessageState::Replaced, 1);
            }
        }
        Ok(!kept)
    }

    /// Settle the row `key` (our sort key `sort_key`) into `receipt` if it
    /// is still the pending message `version`: one `CheckAndMutateRow`
    /// that turns the row into the receipt. A Topic message's receipt is
    /// then also written to a row of its own (see [`receipt_key`]), where
    /// it outlives the next message with that Topic, which takes the
    /// Topic's row. The receipt is readable in the Topic's row from the
    /// first write on; Bigtable has no transaction across rows, so a crash
    /// before the second loses only the copy that would outlive a newer
    /// message.
    async fn settle_row(
        &self,
        uaid: &Uuid,
        key: Vec<u8>,
        sort_key: &str,
        receipt: &Receipt,
    ) -> Result<bool> {
        let family = row::message_family(self.families(), sort_key);
        let pending = still_pending(family, &receipt.version);
        let mutations = row::receipt_mutations(family, receipt);
        if !self
            .check_and_mutate(key, pending, mutations.clone(), Vec::new())
            .await?
        {
            return Ok(false);
        }
        if let Some(own) = receipt_key(sort_key, &receipt.version) {
            self.write(row::message_key(uaid, &own), mutations).await?;
        }
        Ok(true)
    }
}

/// Conditional writes [`BigtableStore::keep_own_cells`] tries before it
/// leaves the cells to those writing them.
const KEEP_TRIES: usize = 3;

/// Conditional writes of one user's removal in flight at once.
const REMOVAL_CONCURRENCY: usize = 16;

/// The message row in `family` is still `version`, not past its TTL (its
/// `version` cell is stamped with its expiry: expired is final), and not
/// settled yet.
fn still_pending(family: &str, version: &str) -> RowFilter {
    let version = row::chain(vec![
        row::column(family, b"version"),
        row::unexpired(),
        row::value_is(version.as_bytes()),
    ]);
    row::and(version, row::absent(row::settled(family)))
}

#[async_trait]
impl Storage for BigtableStore {
    async fn add_user(&self, user: &User) -> Result<()> {
        let mutations = row::user_mutations(self.families(), user, self.stamp());
        self.write(row::user_key(&user.uaid), mutations).await
    }

    /// With the wake route and last wake-up `user` carries as read,
    /// written again in the same `CheckAndMutateRow` while they are
    /// unchanged. A wake-up or route written since loses only that: the
    /// take-over is written alone, and the user's cells of ours are
    /// then written again as they are.
    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool> {
        let families = self.families();
        let key = row::user_key(&user.uaid);
        let stamp = self.stamp();
        let mut mutations = row::connection_mutations(families, user, stamp);
        mutations.extend(row::new_version(families, stamp));
        let taken = row::and(
            self.connected_at_is(seen_connected_at),
            row::min_urgency_is(families, user.min_urgency),
        );
        let mut kept = mutations.clone();
        kept.extend(row::wake_cells_mutations(families, user, stamp));
        let unchanged = row::and(taken.clone(), row::wake_cells_are(families, user));
        if self
            .check_and_mutate(key.clone(), unchanged, kept, Vec::new())
            .await?
        {
            return Ok(true);
        }
        if !self
            .check_and_mutate(key, taken, mutations, Vec::new())
            .await?
        {
            return Ok(false);
        }
        self.keep_own_cells(&user.uaid, None).await
    }

    /// With the user's other cells of ours written again as they are.
    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool> {
        self.keep_own_cells(uaid, Some(last_connect)).await
    }

    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool> {
        let exists = row::column(&self.families().router, b"connected_at");
        let predicate = row::and(exists, self.router_data_is(seen));
        let mutations = row::router_data_mutations(self.families(), router_data, self.stamp());
        self.check_and_mutate(row::user_key(uaid), predicate, mutations, Vec::new())
            .await
    }

    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
        let exists = row::column(&self.families().router, b"connected_at");
        let mutations = row::wake_route_mutations(self.families(), route, self.stamp());
        self.check_and_mutate(row::user_key(uaid), exists, mutations, Vec::new())
            .await
    }

    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
        let message = &self.families().message;
        let still_seen = row::column_is(message, "wake_route", seen.to_json().as_bytes());
        let mutations = row::wake_route_mutations(self.families(), None, self.stamp());
        self.check_and_mutate(row::user_key(uaid), still_seen, mutations, Vec::new())
            .await
    }

    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
        let families = self.families();
        let exists = row::column(&families.router, b"connected_at");
        let last_wake = row::column(&families.message, b"last_wake");
        let predicate = match seen {
            0 => row::and(exists, row::absent(last_wake)),
            _ => row::column_is(&families.message, "last_wake", &seen.to_be_bytes()),
        };
        let mutations = row::last_wake_mutations(families, Some(now), self.stamp());
        self.check_and_mutate(row::user_key(uaid), predicate, mutations, Vec::new())
            .await
    }

    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        let filter = row::user_columns(self.families());
        match self.read_row(row::user_key(uaid), filter).await? {
            Some(r) => row::user_from_row(self.families(), uaid, &r),
            None => Ok(None),
        }
    }

    async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
        self.write(row::user_key(uaid), vec![row::delete_row()])
            .await?;
        self.remove_message_rows(uaid).await
    }

    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
        let predicate = row::and(
            self.connected_at_is(seen.connected_at),
            self.router_data_is(seen.router_data.as_ref()),
        );
        let removed = self
            .check_and_mutate(
                row::user_key(&seen.uaid),
                predicate,
                vec![row::delete_row()],
                Vec::new(),
            )
            .await?;
        if removed {
            self.remove_message_rows(&seen.uaid).await?;
        }
        Ok(removed)
    }

    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool> {
        let router = &self.families().router;
        let predicate = row::and(
            row::column_is(router, "node_id", node_id.as_bytes()),
            self.connected_at_is(connected_at),
        );
        let mut mutations = vec![row::delete_column(router, b"node_id")];
        mutations.extend(row::new_version(self.families(), self.stamp()));
        self.check_and_mutate(row::user_key(uaid), predicate, mutations, Vec::new())
            .await
    }

    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool> {
        let predicate = row::and(
            row::column_is(&self.families().router, "node_id", node_id.as_bytes()),
            self.connected_at_is(connected_at),
        );
        let mutations = row::min_urgency_mutations(self.families(), min, self.stamp());
        self.check_and_mutate(row::user_key(uaid), predicate, mutations, Vec::new())
            .await
    }

    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool> {
        if limit == 0 {
            return self.has_channel(uaid, channel_id).await;
        }
        let families = self.families();
        let this = row::column(&families.router, &row::chid_qualifier(channel_id));
        // Matches when the channel is new and `limit` others are there.
        let full = row::condition(
            this,
            row::block_all(),
            row::chain(vec![row::channels(families), row::skip_cells(limit - 1)]),
        );
        let refused = self
            .check_and_mutate(
                row::user_key(uaid),
                full,
                Vec::new(),
                vec![row::add_channel_mutation(
                    families,
                    channel_id,
                    self.stamp(),
                )],
            )
            .await?;
        Ok(!refused)
    }

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
        let filter = row::chain(vec![row::channels(self.families()), row::strip_values()]);
        Ok(self
            .read_row(row::user_key(uaid), filter)
            .await?
            .map(|r| row::channels_from_row(&r))
            .unwrap_or_default())
    }

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let column = row::column(&self.families().router, &row::chid_qualifier(channel_id));
        let filter = row::chain(vec![column, row::strip_values()]);
        Ok(self.read_row(row::user_key(uaid), filter).await?.is_some())
    }

    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let router = &self.families().router;
        let qualifier = row::chid_qualifier(channel_id);
        let mut mutations = vec![row::delete_column(router, &qualifier)];
        mutations.extend(row::new_version(self.families(), self.stamp()));
        let removed = self
            .check_and_mutate(
                row::user_key(uaid),
                row::column(router, &qualifier),
                mutations,
                Vec::new(),
            )
            .await?;
        if removed && self.retention > 0 {
            crate::receipt::after_unsubscribe(self, uaid, channel_id).await;
        }
        Ok(removed)
    }

    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
        let mut taken = None;
        for message in &messages {
            if !self.save_message(uaid, message).await? && message.topic.is_none() {
                taken.get_or_insert_with(|| message.sort_key());
            }
        }
        match taken {
            Some(key) => Err(StorageError::KeyTaken(key)),
            None => Ok(()),
        }
    }

    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let now = now_secs();
        let mut messages = Vec::new();
        for r in self.message_rows(uaid, limit, row::pass_all()).await? {
            let message = row::message_from_row(&r)?;
            if !message.is_expired(now) {
                messages.push(message);
            }
        }
        Ok(messages)
    }

    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
        if up_to == 0 {
            return Ok(0);
        }
        let cells = row::chain(vec![row::first_cell(), row::strip_values()]);
        Ok(self.message_rows(uaid, up_to, cells).await?.len())
    }

    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool> {
        let family = row::message_family(self.families(), sort_key);
        for key in row::message_keys(uaid, sort_key) {
            if self.delete_version(key, family, version).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// On the version we wrote, and only if no cell of `version` carries
    /// another stamp than ours: autopush-rs's node storing the message
    /// because its client left unacked rewrites the row's cells with its
    /// own stamps, and that copy must stay.
    async fn remove_direct_copy(&self, uaid: &Uuid, message: &Notification) -> Result<bool> {
        let sort_key = message.sort_key();
        let family = row::message_family(self.families(), &sort_key);
        let written_again = row::stamped_otherwise(family, "version", message.expiry());
        let ours = row::column_is(family, "version", message.version.as_bytes());
        let predicate = row::condition(written_again, row::block_all(), ours);
        self.check_and_mutate(
            row::message_key(uaid, &sort_key),
            predicate,
            vec![row::delete_row()],
            Vec::new(),
        )
        .await
    }

    /// Every write is a billed request: a node holds direct copies back.
    fn node_holds_direct_copies(&self) -> bool {
        true
    }

    /// With receipts on, one `CheckAndMutateRow` writing the receipt into
    /// the row if it is empty; a row there (a copy written after all) is
    /// settled instead.
    async fn settle_unwritten(
        &self,
        uaid: &Uuid,
        message: &Notification,
        state: MessageState,
    ) -> Result<()> {
        if self.retention == 0 {
            return Ok(());
        }
        let sort_key = message.sort_key();
        let family = row::message_family(self.families(), &sort_key);
        let receipt = Receipt::new(&message.version, state, now_secs(), self.retention);
        let row_there = self
            .check_and_mutate(
                row::message_key(uaid, &sort_key),
                row::pass_all(),
                Vec::new(),
                row::receipt_mutations(family, &receipt),
            )
            .await?;
        if row_there {
            self.settle_message(uaid, &sort_key, &message.version, state)
                .await?;
        }
        Ok(())
    }

    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        if self.retention == 0 {
            // Deleted, on a settle's condition.
            let family = row::message_family(self.families(), sort_key);
            for key in row::message_keys(uaid, sort_key) {
                let pending = still_pending(family, version);
                let delete = vec![row::delete_row()];
                if self
                    .check_and_mutate(key, pending, delete, Vec::new())
                    .await?
                {
                    return Ok(true);
                }
            }
            return Ok(false);
        }
        let receipt = Receipt::new(version, state, now_secs(), self.retention);
        for key in row::message_keys(uaid, sort_key) {
            if self.settle_row(uaid, key, sort_key, &receipt).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>> {
        for key in row::message_keys(uaid, sort_key) {
            if let Some(r) = self.read_row(key, row::latest()).await? {
                return row::stored_from_row(&r, self.retention);
            }
        }
        Ok(None)
    }

    async fn health_check(&self) -> Result<()> {
        // A random row, so health checks never make a hot tablet.
        self.read_row(row::user_key(&Uuid::new_v4()), row::block_all())
            .await
            .map(|_| ())
    }
}
