//! The PostgreSQL backend, on autopush-rs's schema (its `schema.psql`):
//! the `router` table (a row per user), `meta` (a row per channel) and
//! `message` (a row per stored message, keyed by the user and the
//! message's sort key, autopush-rs's `chid_message_id`).
//!
//! Our own state that autopush-rs has no column for is in columns it never
//! names (it reads and writes rows by column name): `over_msg_limit`,
//! `min_urgency`, `wake_route` and `last_wake` on `router`, `urgency` and
//! `durable` on `message`. `last_connect` is autopush-rs's own `router`
//! column, which it leaves alone. Like autopush-rs's own reads, ours skip
//! the timestamp messages up to the user's `last_update`: autopush-rs
//! leaves those its clients acknowledged in the table.
//!
//! Every change to a row is one statement conditional on what the caller
//! saw (`UPDATE ... WHERE`, `DELETE ... WHERE`, `INSERT ... ON CONFLICT DO
//! UPDATE ... WHERE`); a user's removal takes its channels and messages in
//! the same statement. Expired messages are filtered on read and deleted
//! by the sweep, in bounded batches. Statements are prepared once per
//! connection; independent ones of a call are pipelined on one connection.
//! Reads of a user (and a channel) that arrive together go to the server
//! as one statement ([`lookup`]).
//!
//! Receipts (`--receipt-retention`) are rows of our own `receipt` table,
//! which autopush-rs never reads: the statement that settles a message
//! deletes its row and writes its receipt, so autopush-rs's nodes never
//! deliver a receipt as a message. A Topic message's receipt is under a
//! key of its own ([`receipt_key`]), where the Topic's next messages leave
//! it. With receipts on, the sweep turns expired messages into `expired`
//! receipts and deletes receipts past their retention.

pub mod admin;
mod lookup;
mod pool;
pub mod settings;
pub mod tls;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use autopush_common::notification::receipt_key;
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use autopush_common::{Notification, RouterType, Urgency, User, WakeRoute};
use deadpool_postgres::{Object, Pool};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::{Receipt, Result, Storage, StorageError, StoredMessage, SweepStep};
pub use settings::PostgresSettings;

/// How long a call waits for a connection of the pool, or for a new one.
const POOL_WAIT: Duration = Duration::from_secs(5);

/// Lookups of users in flight at most, each a batch of those that queued
/// (see [`lookup`]); at most the pool's size. One: a second batch in
/// flight splits what the first would have gathered, and with PostgreSQL
/// on the node's core cost 12–36% of the ceiling. A batch of up to 256
/// lookups a round trip leaves one slot far from the bound.
const LOOKUP_SLOTS: usize = 1;

/// The first key of the advisory locks that serialize one user's
/// registrations (ASCII "push"), kept apart from other users of advisory
/// locks on the database.
const USER_LOCK: i32 = 0x7075_7368;

/// The `router` columns a [`User`] is read from, in [`user_from_row`]'s order.
const USER_COLUMNS: &str = "router_type, router_data, node_id, connected_at, last_connect, \
     over_msg_limit, min_urgency, wake_route, last_wake";

/// The `message` columns a [`Notification`] is read from, in
/// [`message_from_row`]'s order.
const MESSAGE_COLUMNS: &str = "channel_id, version, ttl, timestamp, topic, sortkey_timestamp, data, headers, urgency, durable";

/// The key of the receipt of a message row `row` (with its
/// `chid_message_id` and `version`), as [`receipt_row_key`] makes it: a
/// Topic message's own key, its sort key and its id's tag
/// ([`receipt_key`]), any other message's sort key.
fn receipt_key_sql(row: &str) -> String {
    format!(
        "CASE WHEN {row}.chid_message_id LIKE '01:%' THEN {row}.chid_message_id || ':' || \
         left(encode(sha256(convert_to({row}.version, 'UTF8')), 'hex'), 16) \
         ELSE {row}.chid_message_id END"
    )
}

/// The key of message `version`'s receipt under `sort_key`.
fn receipt_row_key(sort_key: &str, version: &str) -> String {
    receipt_key(sort_key, version).unwrap_or_else(|| sort_key.to_owned())
}

/// A statement's part that writes the receipts of the messages a
/// `DELETE ... RETURNING uaid, chid_message_id, version, expiry` named
/// `gone` removed: `state` for each unexpired at `now`, `expired` (as of
/// its deadline) for the rest, kept `retention` (the three are parameters).
/// A receipt already there stays: it settled first.
fn receipts_of(rc: &str, gone: &str, state: &str, now: &str, retention: &str) -> String {
    let key = receipt_key_sql(gone);
    format!(
        "INSERT INTO {rc} (uaid, chid_message_id, version, state, updated, expiry) \
         SELECT uaid, key, version, state, updated, updated + {retention} FROM \
         (SELECT {gone}.uaid, {key} AS key, {gone}.version, \
         CASE WHEN coalesce({gone}.expiry, 0) > {now} THEN {state}::text ELSE 'expired' END AS state, \
         CASE WHEN coalesce({gone}.expiry, 0) > {now} THEN {now} ELSE coalesce({gone}.expiry, 0) END AS updated \
         FROM {gone}) AS settled WHERE updated + {retention} > {now} \
         ON CONFLICT (uaid, chid_message_id) DO NOTHING"
    )
}

/// Every statement, with the table names of the settings in it.
struct Sql {
    add_user: String,
    take_over_user: String,
    touch_user: String,
    set_router_data: String,
    lookup_users: String,
    remove_user: String,
    remove_user_if_unchanged: String,
    remove_node_id: String,
    set_min_urgency: String,
    set_wake_route: String,
    remove_wake_route: String,
    claim_wake: String,
    add_channel: String,
    lock_user: String,
    get_channels: String,
    has_channel: String,
    remove_channel: String,
    save_topic: String,
    save_plain: String,
    fetch_messages: String,
    count_messages: String,
    remove_message: String,
    settle_message: String,
    settle_messages: String,
    read_message: String,
    read_receipt: String,
    settle_unwritten: String,
    health_check: String,
    sweep_expired: String,
    drop_idle_users: String,
}

impl Sql {
    /// The statements on the tables `s` names; with `retention` > 0 (receipts
    /// on), those that remove messages write their receipts, with two
    /// parameters more after the others: now and the retention (seconds).
    fn new(s: &PostgresSettings, retention: u64) -> Sql {
        let r = s.qualified(&s.router_table);
        let m = s.qualified(&s.message_table);
        let c = s.qualified(&s.meta_table);
        let rc = s.qualified(&s.receipt_table);
        let receipts = retention > 0;
        // With receipts on, `gone`'s receipts (of `state`) from the
        // messages a `DELETE ... RETURNING` named `removed` took, as one
        // more part of a WITH; parameters `now` and `retention`.
        let keep = |removed: &str, state: &str, now: &str, retention: &str| match receipts {
            true => format!(
                ", kept AS ({})",
                receipts_of(&rc, removed, state, now, retention)
            ),
            false => String::new(),
        };
        const TAKEN: &str = "RETURNING uaid, chid_message_id, version, expiry";
        // A user's removal, given `doomed`, a statement returning the
        // removed router rows' `uaid` with `n` parameters: its channels and
        // messages go in the same statement.
        let removal = |doomed: &str, n: usize| {
            let kept = keep(
                "msgs",
                "'gone'",
                &format!("${}", n + 1),
                &format!("${}", n + 2),
            );
            format!(
                "WITH gone AS ({doomed} RETURNING uaid), \
                 msgs AS (DELETE FROM {m} WHERE uaid IN (SELECT uaid FROM gone) {TAKEN}), \
                 chans AS (DELETE FROM {c} WHERE uaid IN (SELECT uaid FROM gone)){kept} \
                 SELECT count(*) FROM gone"
            )
        };
        // Not one autopush-rs delivered: it leaves a timestamp message a
        // client acked in the table and moves the user's `last_update` to
        // its `timestamp` (its reads skip up to there); Topic messages it
        // deletes on ack.
        let pending = format!(
            "(coalesce(topic, '') <> '' OR coalesce(timestamp, 0) > \
             coalesce((SELECT last_update FROM {r} WHERE uaid = $1), -1))"
        );
        let save = |condition: &str| {
            format!(
                "INSERT INTO {m} AS old (uaid, channel_id, chid_message_id, version, ttl, expiry, \
                 topic, timestamp, data, sortkey_timestamp, headers, urgency, durable) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
                 ON CONFLICT (uaid, chid_message_id) DO UPDATE SET channel_id = EXCLUDED.channel_id, \
                 version = EXCLUDED.version, ttl = EXCLUDED.ttl, expiry = EXCLUDED.expiry, \
                 topic = EXCLUDED.topic, timestamp = EXCLUDED.timestamp, data = EXCLUDED.data, \
                 sortkey_timestamp = EXCLUDED.sortkey_timestamp, headers = EXCLUDED.headers, \
                 urgency = EXCLUDED.urgency, durable = EXCLUDED.durable \
                 WHERE {condition} RETURNING 1"
            )
        };
        Sql {
            add_user: format!(
                "INSERT INTO {r} (uaid, router_type, router_data, node_id, connected_at, \
                 last_connect, over_msg_limit, min_urgency, wake_route, last_wake, \
                 record_version, version, expiry) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, $11, $12) \
                 ON CONFLICT (uaid) DO UPDATE SET router_type = EXCLUDED.router_type, \
                 router_data = EXCLUDED.router_data, node_id = EXCLUDED.node_id, \
                 connected_at = EXCLUDED.connected_at, last_connect = EXCLUDED.last_connect, \
                 over_msg_limit = EXCLUDED.over_msg_limit, min_urgency = EXCLUDED.min_urgency, \
                 wake_route = EXCLUDED.wake_route, last_wake = EXCLUDED.last_wake, \
                 record_version = EXCLUDED.record_version, version = EXCLUDED.version, \
                 expiry = EXCLUDED.expiry"
            ),
            // A record from before connected_at was kept reads as 0.
            take_over_user: format!(
                "UPDATE {r} SET node_id = $2, connected_at = $3, last_connect = $4, \
                 over_msg_limit = $5, version = $6, expiry = $7 \
                 WHERE uaid = $1 AND coalesce(connected_at, 0) = $8"
            ),
            touch_user: format!("UPDATE {r} SET last_connect = $2, expiry = $3 WHERE uaid = $1"),
            // JSON compared as JSON: key order and spacing do not matter.
            set_router_data: format!(
                "UPDATE {r} SET router_data = $3 \
                 WHERE uaid = $1 AND coalesce(router_data, 'null')::jsonb = $2::text::jsonb"
            ),
            // A batch of lookups (see `lookup`): element `n` is a user
            // ($1), a channel or NULL ($2) and `n` ($3); a row for each
            // user found, its columns, whether it has the channel, and `n`.
            // Each element its own index lookups (the LIMIT keeps the
            // subquery a per-element one): as a join, the planner would
            // scan the whole tables for a few dozen elements.
            // By the arrays' subscripts, not `unnest`: the planner sees
            // an array's length only in a plan for its values, which then
            // looks cheaper than the generic plan, so it would plan every
            // call anew; `generate_subscripts` is estimated alike in both,
            // and the generic plan is kept after the first few calls.
            lookup_users: format!(
                "SELECT found.*, batch.n - 1 \
                 FROM generate_subscripts($1::text[], 1) AS batch(n) \
                 CROSS JOIN LATERAL (SELECT {USER_COLUMNS}, \
                 EXISTS (SELECT 1 FROM {c} WHERE uaid = ($1::text[])[batch.n] \
                 AND channel_id = ($2::text[])[batch.n]) \
                 FROM {r} WHERE uaid = ($1::text[])[batch.n] LIMIT 1) AS found"
            ),
            // Channels and messages go even where no router row is.
            remove_user: format!(
                "WITH gone AS (DELETE FROM {r} WHERE uaid = $1), \
                 msgs AS (DELETE FROM {m} WHERE uaid = $1 {TAKEN}), \
                 chans AS (DELETE FROM {c} WHERE uaid = $1){} SELECT 1",
                keep("msgs", "'gone'", "$2", "$3")
            ),
            remove_user_if_unchanged: removal(
                &format!(
                    "DELETE FROM {r} WHERE uaid = $1 AND coalesce(connected_at, 0) = $2 \
                     AND coalesce(router_data, 'null')::jsonb = $3::text::jsonb"
                ),
                3,
            ),
            remove_node_id: format!(
                "UPDATE {r} SET node_id = NULL \
                 WHERE uaid = $1 AND node_id = $2 AND connected_at = $3"
            ),
            set_min_urgency: format!(
                "UPDATE {r} SET min_urgency = $4 \
                 WHERE uaid = $1 AND node_id = $2 AND connected_at = $3"
            ),
            set_wake_route: format!("UPDATE {r} SET wake_route = $2 WHERE uaid = $1"),
            remove_wake_route: format!(
                "UPDATE {r} SET wake_route = NULL WHERE uaid = $1 AND wake_route = $2"
            ),
            claim_wake: format!(
                "UPDATE {r} SET last_wake = $3 WHERE uaid = $1 AND coalesce(last_wake, 0) = $2"
            ),
            // The insert's statement sees the channels as they were before
            // it: a channel the user had already counts as subscribed. It
            // runs under `lock_user`, so the count it sees is not stale.
            add_channel: format!(
                "WITH added AS (INSERT INTO {c} (uaid, channel_id) \
                 SELECT $1::text, $2::text WHERE (SELECT count(*) FROM {c} WHERE uaid = $1) < $3 \
                 ON CONFLICT DO NOTHING RETURNING 1) \
                 SELECT EXISTS (SELECT 1 FROM added) \
                 OR EXISTS (SELECT 1 FROM {c} WHERE uaid = $1 AND channel_id = $2)"
            ),
            // One user's registrations, one at a time until their
            // transaction ends (the first key names this use of advisory
            // locks, the second the user).
            lock_user: format!("SELECT pg_advisory_xact_lock({USER_LOCK}, hashtext($1))"),
            get_channels: format!("SELECT channel_id FROM {c} WHERE uaid = $1"),
            has_channel: format!(
                "SELECT EXISTS (SELECT 1 FROM {c} WHERE uaid = $1 AND channel_id = $2)"
            ),
            // With receipts on, the channel's pending messages become
            // `gone` receipts in the same statement.
            remove_channel: match receipts {
                false => format!("DELETE FROM {c} WHERE uaid = $1 AND channel_id = $2"),
                true => format!(
                    "WITH gone AS (DELETE FROM {c} WHERE uaid = $1 AND channel_id = $2 RETURNING 1), \
                     msgs AS (DELETE FROM {m} WHERE uaid = $1 AND channel_id = $2 \
                     AND coalesce(expiry, 0) > $3 AND EXISTS (SELECT 1 FROM gone) {TAKEN}){} \
                     SELECT count(*) FROM gone",
                    keep("msgs", "'gone'", "$3", "$4")
                ),
            },
            // A Topic message replaces the stored one unless that is newer;
            // with receipts on, the one it replaced, as the statement's
            // snapshot has it, leaves its `replaced` receipt (`expired` if
            // past its TTL) under its own key. (Not `FOR UPDATE`: that
            // skips a row the same statement's upsert changed first. Of two
            // racing saves, the second's receipt names the message the
            // first replaced; the first's message then reads `replaced`
            // from the row, as a Topic message without a receipt does.)
            save_topic: match receipts {
                false => save("coalesce(old.sortkey_timestamp, 0) <= EXCLUDED.sortkey_timestamp"),
                true => format!(
                    "WITH before AS (SELECT uaid, chid_message_id, version, expiry FROM {m} \
                     WHERE uaid = $1 AND chid_message_id = $3), \
                     saved AS ({}), \
                     replaced AS (SELECT * FROM before WHERE version IS DISTINCT FROM $4 \
                     AND EXISTS (SELECT 1 FROM saved)){} \
                     SELECT count(*) FROM saved",
                    save("coalesce(old.sortkey_timestamp, 0) <= EXCLUDED.sortkey_timestamp"),
                    keep("replaced", "'replaced'", "$14", "$15")
                ),
            },
            // Any other never replaces a different message under its key.
            save_plain: save("old.version = EXCLUDED.version"),
            // Sort keys put Topic messages first, the rest in arrival order.
            fetch_messages: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {m} WHERE uaid = $1 AND expiry > $2 \
                 AND {pending} ORDER BY chid_message_id LIMIT $3"
            ),
            count_messages: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {m} WHERE uaid = $1 AND expiry > $2 \
                 AND {pending} LIMIT $3) AS s"
            ),
            // A key in either spelling (see `key_spellings`).
            remove_message: format!(
                "DELETE FROM {m} WHERE uaid = $1 AND chid_message_id = ANY($2) AND version = $3"
            ),
            // Expired is final: such a message is never settled. A key in
            // either spelling (see `key_spellings`). With receipts on, the
            // row goes and its receipt ($5, under key $7, kept $6) comes in
            // one statement.
            settle_message: match receipts {
                false => format!(
                    "DELETE FROM {m} WHERE uaid = $1 AND chid_message_id = ANY($2) AND version = $3 \
                     AND expiry > $4"
                ),
                true => format!(
                    "WITH settled AS (DELETE FROM {m} WHERE uaid = $1 AND chid_message_id = ANY($2) \
                     AND version = $3 AND expiry > $4 RETURNING 1), \
                     kept AS (INSERT INTO {rc} (uaid, chid_message_id, version, state, updated, expiry) \
                     SELECT $1, $7, $3, $5, $4, $4::bigint + $6::bigint FROM settled \
                     ON CONFLICT (uaid, chid_message_id) DO UPDATE SET version = EXCLUDED.version, \
                     state = EXCLUDED.state, updated = EXCLUDED.updated, expiry = EXCLUDED.expiry) \
                     SELECT count(*) FROM settled"
                ),
            },
            // `settle_message` for a batch, in one statement: element `n`
            // is a row of each spelling of its key ($2), its version ($3)
            // and its receipt's key ($4), `n` in $5; now is $6. Returned
            // are the `n`s settled. With receipts on, their receipts ($7,
            // kept $8) come in the same statement.
            settle_messages: {
                let settled = format!(
                    "DELETE FROM {m} AS msg \
                     USING unnest($2::text[], $3::text[], $4::text[], $5::int[]) \
                     AS batch(key, version, receipt_key, n) \
                     WHERE msg.uaid = $1 AND msg.chid_message_id = batch.key \
                     AND msg.version = batch.version AND msg.expiry > $6 \
                     RETURNING batch.n, batch.version, batch.receipt_key"
                );
                match receipts {
                    false => format!("WITH settled AS ({settled}) SELECT DISTINCT n FROM settled"),
                    true => format!(
                        "WITH settled AS ({settled}), \
                         kept AS (INSERT INTO {rc} (uaid, chid_message_id, version, state, updated, expiry) \
                         SELECT DISTINCT ON (receipt_key) $1, receipt_key, version, $7, $6, \
                         $6::bigint + $8::bigint FROM settled \
                         ON CONFLICT (uaid, chid_message_id) DO UPDATE SET version = EXCLUDED.version, \
                         state = EXCLUDED.state, updated = EXCLUDED.updated, expiry = EXCLUDED.expiry) \
                         SELECT DISTINCT n FROM settled"
                    ),
                }
            },
            read_message: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {m} WHERE uaid = $1 AND chid_message_id = ANY($2) \
                 LIMIT 1"
            ),
            read_receipt: format!(
                "SELECT state, version, updated, expiry FROM {rc} \
                 WHERE uaid = $1 AND chid_message_id = $2"
            ),
            // A receipt where none is; a copy written after all goes.
            settle_unwritten: format!(
                "WITH copy AS (DELETE FROM {m} WHERE uaid = $1 AND chid_message_id = $2 \
                 AND version = $3) \
                 INSERT INTO {rc} (uaid, chid_message_id, version, state, updated, expiry) \
                 VALUES ($1, $7, $3, $5, $4, $4::bigint + $6::bigint) \
                 ON CONFLICT (uaid, chid_message_id) DO NOTHING"
            ),
            // Every table the statements name: a missing one stops start-up.
            health_check: format!(
                "SELECT EXISTS (SELECT 1 FROM {r}), EXISTS (SELECT 1 FROM {m}), \
                 EXISTS (SELECT 1 FROM {c}){}",
                match receipts {
                    true => format!(", EXISTS (SELECT 1 FROM {rc})"),
                    false => String::new(),
                }
            ),
            // The expiry is looked at again on the row deleted: a message
            // stored under the key since stays.
            // With receipts on, expired messages become `expired` receipts
            // and receipts past their retention go, as many again.
            sweep_expired: match receipts {
                false => format!(
                    "DELETE FROM {m} WHERE expiry <= $1 AND (uaid, chid_message_id) IN \
                     (SELECT uaid, chid_message_id FROM {m} WHERE expiry <= $1 LIMIT $2)"
                ),
                true => format!(
                    "WITH msgs AS (DELETE FROM {m} WHERE expiry <= $1 AND (uaid, chid_message_id) IN \
                     (SELECT uaid, chid_message_id FROM {m} WHERE expiry <= $1 LIMIT $2) {TAKEN}), \
                     old AS (DELETE FROM {rc} WHERE expiry <= $1 AND (uaid, chid_message_id) IN \
                     (SELECT uaid, chid_message_id FROM {rc} WHERE expiry <= $1 LIMIT $2) \
                     RETURNING 1){} \
                     SELECT (SELECT count(*) FROM msgs), (SELECT count(*) FROM old)",
                    keep("msgs", "'expired'", "$1", "$3")
                ),
            },
            // One page of users after the cursor; of those, idle webpush
            // users go (idle looked at again on the row deleted). A user
            // autopush-rs wrote has no last_connect: its connected_at says.
            drop_idle_users: format!(
                "WITH page AS (SELECT uaid FROM {r} WHERE uaid > $1 ORDER BY uaid LIMIT $2), \
                 gone AS (DELETE FROM {r} WHERE uaid IN (SELECT uaid FROM page) \
                 AND router_type = 'webpush' AND greatest(last_connect, connected_at) < $3 \
                 RETURNING uaid), \
                 msgs AS (DELETE FROM {m} WHERE uaid IN (SELECT uaid FROM gone) {TAKEN}), \
                 chans AS (DELETE FROM {c} WHERE uaid IN (SELECT uaid FROM gone)){} \
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM page), \
                 (SELECT max(uaid) FROM page)",
                keep("msgs", "'gone'", "$4", "$5")
            ),
        }
    }
}

pub struct PostgresStore {
    pool: Pool,
    /// Reads of users, coalesced.
    lookups: Arc<lookup::Lookups>,
    /// Where a refused write is noted, so the pool reconnects.
    demotion: Arc<pool::Demotion>,
    settings: PostgresSettings,
    sql: Sql,
    /// Seconds a receipt is kept; 0: none is.
    retention: u64,
    /// The last user of the idle-user sweep's last page.
    user_cursor: Mutex<String>,
}

/// A failed statement: the server's message when it answered, else what
/// went wrong on the way. A missing table is [`StorageError::NoTable`].
/// A connection of `pool`.
async fn checkout(pool: &Pool) -> Result<Object> {
    pool.get().await.map_err(|e| match e {
        deadpool_postgres::PoolError::Backend(e) => backend("connect", e),
        other => StorageError::Backend(format!("PostgreSQL connect: {other}")),
    })
}

/// Run `sql` (prepared once per connection) on a connection of `pool` and
/// return its rows; a refusal as a write to a read-only server is noted in
/// `demotion`.
async fn query_on(
    pool: &Pool,
    demotion: &pool::Demotion,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>> {
    let client = checkout(pool).await?;
    let statement = client
        .prepare_cached(sql)
        .await
        .map_err(|e| backend("prepare", e))?;
    client
        .query(&statement, params)
        .await
        .map_err(|e| failed(demotion, "query", e))
}

/// A failed statement; one refused as a write to a read-only server
/// makes the pool connect anew (see [`pool`]).
fn failed(demotion: &pool::Demotion, op: &str, e: tokio_postgres::Error) -> StorageError {
    demotion.note(&e);
    backend(op, e)
}

fn backend(op: &str, e: tokio_postgres::Error) -> StorageError {
    match e.as_db_error() {
        Some(db) if db.code() == &tokio_postgres::error::SqlState::UNDEFINED_TABLE => {
            StorageError::NoTable(format!("PostgreSQL {op}: {}", db.message()))
        }
        Some(db) => StorageError::Backend(format!(
            "PostgreSQL {op}: {} ({})",
            db.message(),
            db.code().code()
        )),
        None => {
            let cause = std::error::Error::source(&e)
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            StorageError::Backend(format!("PostgreSQL {op}: {e}{cause}"))
        }
    }
}

/// The `chid_message_id`s the message our sort key `sort_key` names may be
/// stored under: ours, and autopush-rs's when it differs (it writes the
/// sort-key timestamp of `02:{timestamp}:{channel}` without our padding).
fn key_spellings(sort_key: &str) -> Vec<String> {
    let unpadded = sort_key
        .strip_prefix("02:")
        .and_then(|rest| rest.split_once(':'))
        .and_then(|(ts, chid)| Some(format!("02:{}:{chid}", ts.parse::<u64>().ok()?)))
        .filter(|theirs| theirs != sort_key);
    std::iter::once(sort_key.to_owned())
        .chain(unpadded)
        .collect()
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> StorageError {
    StorageError::Corrupt(format!("PostgreSQL {what}: {e}"))
}

/// `uaid` as stored: hex without dashes, as autopush-rs writes it.
fn hex(uuid: &Uuid) -> String {
    uuid.simple().to_string()
}

/// Unsigned values in `bigint` columns.
fn big(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn unsigned(n: Option<i64>) -> u64 {
    n.map_or(0, |n| n.max(0) as u64)
}

/// `router_data` as stored: JSON text, `null` for none (autopush-rs reads
/// the column as JSON and fails on SQL NULL).
fn router_data_text(data: Option<&serde_json::Value>) -> String {
    data.map_or_else(|| "null".to_owned(), |d| d.to_string())
}

fn user_from_row(uaid: &Uuid, row: &Row) -> Result<User> {
    let router_type: Option<String> = row.get(0);
    let router_type = router_type.unwrap_or_else(|| "webpush".into());
    let router_type = RouterType::from_path(&router_type).ok_or_else(|| {
        corrupt(
            "router_type",
            format!("unknown router type {router_type:?}"),
        )
    })?;
    let router_data: Option<String> = row.get(1);
    let router_data = match router_data.as_deref() {
        None | Some("") | Some("null") => None,
        Some(text) => Some(serde_json::from_str(text).map_err(|e| corrupt("router_data", e))?),
    };
    let min_urgency: Option<String> = row.get(6);
    let wake_route: Option<String> = row.get(7);
    Ok(User {
        uaid: *uaid,
        router_type,
        router_data,
        node_id: row.get(2),
        connected_at: unsigned(row.get(3)),
        last_connect: unsigned(row.get(4)),
        over_msg_limit: row.get::<_, Option<bool>>(5).unwrap_or(false),
        current_month: None,
        min_urgency: min_urgency
            .as_deref()
            .and_then(Urgency::parse)
            .unwrap_or(Urgency::VeryLow),
        wake_route: wake_route.as_deref().and_then(WakeRoute::from_json),
        last_wake: unsigned(row.get(8)),
    })
}

fn message_from_row(row: &Row) -> Result<Notification> {
    let channel_id: Option<String> = row.get(0);
    let channel_id = Uuid::parse_str(channel_id.as_deref().unwrap_or_default())
        .map_err(|e| corrupt("message channel_id", e))?;
    let headers: Option<String> = row.get(7);
    let headers = match headers.as_deref() {
        None | Some("") | Some("null") | Some("{}") => None,
        Some(text) => Some(serde_json::from_str(text).map_err(|e| corrupt("message headers", e))?),
    };
    let urgency: Option<String> = row.get(8);
    Ok(Notification {
        channel_id,
        version: row.get::<_, Option<String>>(1).unwrap_or_default(),
        ttl: unsigned(row.get(2)),
        timestamp: unsigned(row.get(3)),
        topic: row.get::<_, Option<String>>(4).filter(|t| !t.is_empty()),
        sortkey_timestamp: row.get::<_, Option<i64>>(5).map(|t| t.max(0) as u64),
        // autopush-rs writes an empty body as ''.
        data: row.get::<_, Option<String>>(6).filter(|d| !d.is_empty()),
        headers,
        urgency: urgency.as_deref().and_then(Urgency::parse),
        durable: row.get::<_, Option<bool>>(9).unwrap_or(false),
    })
}

fn receipt_from_row(row: &Row) -> Result<Receipt> {
    let state: String = row.try_get(0).map_err(|e| backend("read", e))?;
    let state = MessageState::parse(&state)
        .ok_or_else(|| corrupt("receipt state", format!("unknown state {state:?}")))?;
    Ok(Receipt {
        state,
        version: row.try_get(1).map_err(|e| backend("read", e))?,
        updated: unsigned(row.try_get(2).map_err(|e| backend("read", e))?),
        expiry: unsigned(row.try_get(3).map_err(|e| backend("read", e))?),
    })
}

/// A message's row values, owned, in the order of the save statements.
struct MessageRow {
    uaid: String,
    channel_id: String,
    sort_key: String,
    version: String,
    ttl: i64,
    expiry: i64,
    topic: Option<String>,
    timestamp: i64,
    data: String,
    sortkey_timestamp: Option<i64>,
    headers: String,
    urgency: Option<&'static str>,
    durable: bool,
}

impl MessageRow {
    fn new(uaid: &Uuid, m: &Notification) -> Result<MessageRow> {
        Ok(MessageRow {
            uaid: hex(uaid),
            channel_id: hex(&m.channel_id),
            sort_key: m.sort_key(),
            version: m.version.clone(),
            ttl: big(m.ttl),
            expiry: big(m.expiry()),
            topic: m.topic.clone().filter(|t| !t.is_empty()),
            timestamp: big(m.timestamp),
            data: m.data.clone().unwrap_or_default(),
            sortkey_timestamp: m.sortkey_timestamp.map(big),
            headers: serde_json::to_string(&m.headers).map_err(|e| corrupt("headers", e))?,
            urgency: m.urgency.map(Urgency::as_str),
            durable: m.durable,
        })
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 13] {
        [
            &self.uaid,
            &self.channel_id,
            &self.sort_key,
            &self.version,
            &self.ttl,
            &self.expiry,
            &self.topic,
            &self.timestamp,
            &self.data,
            &self.sortkey_timestamp,
            &self.headers,
            &self.urgency,
            &self.durable,
        ]
    }
}

impl PostgresStore {
    /// A store on the database `settings` name. Connections are opened as
    /// calls need them, up to `pool_size`; none is opened here. An
    /// unreadable `sslrootcert` is an error naming it.
    pub fn connect(settings: PostgresSettings) -> Result<Self> {
        let (pool, demotion) = pool::build(&settings, POOL_WAIT).map_err(StorageError::Backend)?;
        let sql = Sql::new(&settings, 0);
        let lookups = lookup::Lookups::new(
            pool.clone(),
            demotion.clone(),
            sql.lookup_users.clone(),
            LOOKUP_SLOTS.min(settings.pool_size),
        );
        Ok(PostgresStore {
            pool,
            lookups,
            demotion,
            sql,
            settings,
            retention: 0,
            user_cursor: Mutex::new(String::new()),
        })
    }

    /// Keep a receipt of each settled message for `seconds` (0: none).
    pub fn with_receipt_retention(mut self, seconds: u64) -> Self {
        self.retention = seconds;
        self.sql = Sql::new(&self.settings, seconds);
        self
    }

    /// With receipts on, `params` and the two more the statements that
    /// keep receipts take: now and the retention.
    fn with_receipts<'a>(
        &self,
        params: &[&'a (dyn ToSql + Sync)],
        extra: &'a [i64; 2],
    ) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut all = params.to_vec();
        if self.retention > 0 {
            all.extend(extra.iter().map(|n| n as &(dyn ToSql + Sync)));
        }
        all
    }

    /// Now and the retention, as [`Self::with_receipts`] passes them.
    fn receipt_params(&self) -> [i64; 2] {
        [big(now_secs()), big(self.retention)]
    }

    pub fn settings(&self) -> &PostgresSettings {
        &self.settings
    }

    /// A connection of the pool.
    async fn client(&self) -> Result<Object> {
        checkout(&self.pool).await
    }

    /// Run `sql` (prepared once per connection) and return its rows.
    async fn query(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        query_on(&self.pool, &self.demotion, sql, params).await
    }

    /// Run `sql` and return how many rows it changed.
    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| backend("prepare", e))?;
        client
            .execute(&statement, params)
            .await
            .map_err(|e| self.failed("execute", e))
    }

    /// A failed statement; one refused as a write to a read-only server
    /// makes the pool connect anew (see [`pool`]).
    fn failed(&self, op: &str, e: tokio_postgres::Error) -> StorageError {
        failed(&self.demotion, op, e)
    }

    /// The one value of the one row `sql` returns.
    async fn one<T>(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<T>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        let rows = self.query(sql, params).await?;
        let row = rows
            .first()
            .ok_or_else(|| StorageError::Backend("PostgreSQL: no row returned".into()))?;
        row.try_get(0).map_err(|e| backend("read", e))
    }

    /// A router row's `expiry`, as autopush-rs writes it: seconds.
    fn router_expiry(&self) -> i64 {
        big(now_secs().saturating_add(self.settings.max_router_ttl))
    }

    /// A fresh `version` of the router row, as autopush-rs gives each
    /// connection (it requires one to clear `node_id`).
    fn record_version() -> String {
        hex(&Uuid::new_v4())
    }
}

#[async_trait]
impl Storage for PostgresStore {
    async fn add_user(&self, user: &User) -> Result<()> {
        let wake_route = user.wake_route.as_ref().map(WakeRoute::to_json);
        let min_urgency = (user.min_urgency != Urgency::VeryLow).then(|| user.min_urgency.as_str());
        self.execute(
            &self.sql.add_user,
            &[
                &hex(&user.uaid),
                &user.router_type.as_str(),
                &router_data_text(user.router_data.as_ref()),
                &user.node_id,
                &big(user.connected_at),
                &big(user.last_connect),
                &user.over_msg_limit,
                &min_urgency,
                &wake_route,
                &big(user.last_wake),
                &Self::record_version(),
                &self.router_expiry(),
            ],
        )
        .await?;
        Ok(())
    }

    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool> {
        let changed = self
            .execute(
                &self.sql.take_over_user,
                &[
                    &hex(&user.uaid),
                    &user.node_id,
                    &big(user.connected_at),
                    &big(user.last_connect),
                    &user.over_msg_limit,
                    &Self::record_version(),
                    &self.router_expiry(),
                    &big(seen_connected_at),
                ],
            )
            .await?;
        Ok(changed > 0)
    }

    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool> {
        let changed = self
            .execute(
                &self.sql.touch_user,
                &[&hex(uaid), &big(last_connect), &self.router_expiry()],
            )
            .await?;
        Ok(changed > 0)
    }

    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool> {
        let changed = self
            .execute(
                &self.sql.set_router_data,
                &[
                    &hex(uaid),
                    &router_data_text(seen),
                    &router_data_text(Some(router_data)),
                ],
            )
            .await?;
        Ok(changed > 0)
    }

    /// Coalesced with the lookups in flight with it (see [`lookup`]).
    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        Ok(self.lookups.get(uaid, None).await?.map(|(user, _)| user))
    }

    /// Coalesced with the lookups in flight with it (see [`lookup`]).
    async fn get_user_and_channel(
        &self,
        uaid: &Uuid,
        channel_id: &Uuid,
    ) -> Result<Option<(User, bool)>> {
        self.lookups.get(uaid, Some(channel_id)).await
    }

    async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
        let extra = self.receipt_params();
        let uaid = hex(uaid);
        let params = self.with_receipts(&[&uaid], &extra);
        let _: i32 = self.one(&self.sql.remove_user, &params).await?;
        Ok(())
    }

    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
        let extra = self.receipt_params();
        let (uaid, connected_at) = (hex(&seen.uaid), big(seen.connected_at));
        let router_data = router_data_text(seen.router_data.as_ref());
        let params = self.with_receipts(&[&uaid, &connected_at, &router_data], &extra);
        let removed: i64 = self
            .one(&self.sql.remove_user_if_unchanged, &params)
            .await?;
        Ok(removed > 0)
    }

    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool> {
        let changed = self
            .execute(
                &self.sql.remove_node_id,
                &[&hex(uaid), &node_id, &big(connected_at)],
            )
            .await?;
        Ok(changed > 0)
    }

    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool> {
        let min = (min != Urgency::VeryLow).then(|| min.as_str());
        let changed = self
            .execute(
                &self.sql.set_min_urgency,
                &[&hex(uaid), &node_id, &big(connected_at), &min],
            )
            .await?;
        Ok(changed > 0)
    }

    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
        let route = route.map(WakeRoute::to_json);
        let changed = self
            .execute(&self.sql.set_wake_route, &[&hex(uaid), &route])
            .await?;
        Ok(changed > 0)
    }

    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
        let changed = self
            .execute(&self.sql.remove_wake_route, &[&hex(uaid), &seen.to_json()])
            .await?;
        Ok(changed > 0)
    }

    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
        let changed = self
            .execute(&self.sql.claim_wake, &[&hex(uaid), &big(seen), &big(now)])
            .await?;
        Ok(changed > 0)
    }

    /// The cap is counted under the user's lock, in a transaction sent in
    /// one round trip: two registrations racing for the last free channel
    /// would otherwise both see it free.
    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool> {
        let client = self.client().await?;
        let (lock, add) = tokio::try_join!(
            client.prepare_cached(&self.sql.lock_user),
            client.prepare_cached(&self.sql.add_channel),
        )
        .map_err(|e| backend("prepare", e))?;
        let (uaid, channel_id, limit) = (hex(uaid), hex(channel_id), big(limit as u64));
        // Each is sent on its first poll, in this order: an error in one
        // leaves COMMIT to roll the transaction back.
        let lock_params: [&(dyn ToSql + Sync); 1] = [&uaid];
        let add_params: [&(dyn ToSql + Sync); 3] = [&uaid, &channel_id, &limit];
        let (_, _, added, _) = tokio::try_join!(
            client.batch_execute("BEGIN"),
            client.execute(&lock, &lock_params),
            client.query_one(&add, &add_params),
            client.batch_execute("COMMIT"),
        )
        .map_err(|e| self.failed("add channel", e))?;
        added.try_get(0).map_err(|e| backend("read", e))
    }

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
        let rows = self.query(&self.sql.get_channels, &[&hex(uaid)]).await?;
        Ok(rows
            .iter()
            .filter_map(|row| row.get::<_, Option<String>>(0))
            .filter_map(|c| Uuid::parse_str(&c).ok())
            .collect())
    }

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        self.one(&self.sql.has_channel, &[&hex(uaid), &hex(channel_id)])
            .await
    }

    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let extra = self.receipt_params();
        let (uaid, channel_id) = (hex(uaid), hex(channel_id));
        let params = self.with_receipts(&[&uaid, &channel_id], &extra);
        let removed = match self.retention {
            0 => self.execute(&self.sql.remove_channel, &params).await?,
            _ => self
                .one::<i64>(&self.sql.remove_channel, &params)
                .await?
                .max(0) as u64,
        };
        Ok(removed > 0)
    }

    /// One conditional insert per message, pipelined on one connection in
    /// the batch's order (so a key twice in a batch ends as its last).
    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let rows = messages
            .iter()
            .map(|m| MessageRow::new(uaid, m))
            .collect::<Result<Vec<_>>>()?;
        let client = self.client().await?;
        let (topic, plain) = tokio::try_join!(
            client.prepare_cached(&self.sql.save_topic),
            client.prepare_cached(&self.sql.save_plain),
        )
        .map_err(|e| backend("prepare", e))?;
        let extra = self.receipt_params();
        let params: Vec<_> = rows
            .iter()
            .map(|row| match row.topic {
                Some(_) => self.with_receipts(&row.params(), &extra),
                None => row.params().to_vec(),
            })
            .collect();
        let written =
            futures_util::future::try_join_all(rows.iter().zip(&params).map(|(row, params)| {
                let statement = if row.topic.is_some() { &topic } else { &plain };
                client.execute(statement, params)
            }))
            .await
            .map_err(|e| self.failed("save", e))?;
        match rows
            .iter()
            .zip(written)
            .find(|(row, n)| row.topic.is_none() && *n == 0)
        {
            Some((row, _)) => Err(StorageError::KeyTaken(row.sort_key.clone())),
            None => Ok(()),
        }
    }

    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
        let rows = self
            .query(
                &self.sql.fetch_messages,
                &[&hex(uaid), &big(now_secs()), &big(limit as u64)],
            )
            .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
        let count: i64 = self
            .one(
                &self.sql.count_messages,
                &[&hex(uaid), &big(now_secs()), &big(up_to as u64)],
            )
            .await?;
        Ok(count.max(0) as usize)
    }

    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool> {
        let removed = self
            .execute(
                &self.sql.remove_message,
                &[&hex(uaid), &key_spellings(sort_key), &version],
            )
            .await?;
        Ok(removed > 0)
    }

    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        let (uaid, now, keys) = (hex(uaid), big(now_secs()), key_spellings(sort_key));
        let removed = match self.retention {
            0 => {
                self.execute(&self.sql.settle_message, &[&uaid, &keys, &version, &now])
                    .await?
            }
            retention => {
                let receipt_key = receipt_row_key(sort_key, version);
                let settled: i64 = self
                    .one(
                        &self.sql.settle_message,
                        &[
                            &uaid,
                            &keys,
                            &version,
                            &now,
                            &state.as_str(),
                            &big(retention),
                            &receipt_key,
                        ],
                    )
                    .await?;
                settled.max(0) as u64
            }
        };
        Ok(removed > 0)
    }

    /// One statement for the whole batch, each message conditional on its
    /// own version as in `settle_message`.
    async fn settle_messages(
        &self,
        uaid: &Uuid,
        messages: &[(String, String)],
        state: MessageState,
    ) -> Result<Vec<bool>> {
        let mut settled = vec![false; messages.len()];
        let too_large = || StorageError::Backend("PostgreSQL: a batch too large to settle".into());
        let (mut rows, mut seen) = (Vec::new(), HashSet::new());
        for (n, (sort_key, version)) in messages.iter().enumerate() {
            // A pair given twice: its first settles, as one at a time would.
            if !seen.insert((sort_key, version)) {
                continue;
            }
            let (n, receipt_key) = (
                i32::try_from(n).map_err(|_| too_large())?,
                receipt_row_key(sort_key, version),
            );
            for key in key_spellings(sort_key) {
                rows.push((key, version.as_str(), receipt_key.clone(), n));
            }
        }
        if rows.is_empty() {
            return Ok(settled);
        }
        // By key: two batches walked in array order lock the rows they
        // share in one order.
        rows.sort_unstable();
        let (mut keys, mut versions, mut receipt_keys, mut ns) = (vec![], vec![], vec![], vec![]);
        for (key, version, receipt_key, n) in rows {
            keys.push(key);
            versions.push(version);
            receipt_keys.push(receipt_key);
            ns.push(n);
        }
        let (uaid, now) = (hex(uaid), big(now_secs()));
        let (state, retention) = (state.as_str(), big(self.retention));
        let mut params: Vec<&(dyn ToSql + Sync)> =
            vec![&uaid, &keys, &versions, &receipt_keys, &ns, &now];
        if self.retention > 0 {
            params.extend([&state as &(dyn ToSql + Sync), &retention]);
        }
        for row in self.query(&self.sql.settle_messages, &params).await? {
            let n: i32 = row.try_get(0).map_err(|e| backend("read", e))?;
            if let Some(one) = usize::try_from(n).ok().and_then(|n| settled.get_mut(n)) {
                *one = true;
            }
        }
        Ok(settled)
    }

    /// Held copies, as on DynamoDB: a message its client acks within the
    /// grace costs no write.
    fn node_holds_direct_copies(&self) -> bool {
        true
    }

    /// With receipts on, one statement: the receipt where none is, and a
    /// copy written after all removed.
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
        let receipt_key = receipt_row_key(&sort_key, &message.version);
        self.execute(
            &self.sql.settle_unwritten,
            &[
                &hex(uaid),
                &sort_key,
                &message.version,
                &big(now_secs()),
                &state.as_str(),
                &big(self.retention),
                &receipt_key,
            ],
        )
        .await?;
        Ok(())
    }

    /// The message row under `sort_key`, else (receipts on) the receipt
    /// there: both asked at once, in one round trip.
    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>> {
        let (uaid, keys) = (hex(uaid), key_spellings(sort_key));
        if self.retention == 0 {
            let rows = self.query(&self.sql.read_message, &[&uaid, &keys]).await?;
            return rows
                .first()
                .map(|row| message_from_row(row).map(StoredMessage::Pending))
                .transpose();
        }
        let client = self.client().await?;
        let (message, receipt) = tokio::try_join!(
            client.prepare_cached(&self.sql.read_message),
            client.prepare_cached(&self.sql.read_receipt),
        )
        .map_err(|e| backend("prepare", e))?;
        let message_params: [&(dyn ToSql + Sync); 2] = [&uaid, &keys];
        let receipt_params: [&(dyn ToSql + Sync); 2] = [&uaid, &sort_key];
        let (messages, receipts) = tokio::try_join!(
            client.query(&message, &message_params),
            client.query(&receipt, &receipt_params),
        )
        .map_err(|e| self.failed("query", e))?;
        if let Some(row) = messages.first() {
            return message_from_row(row).map(|m| Some(StoredMessage::Pending(m)));
        }
        receipts
            .first()
            .map(|row| receipt_from_row(row).map(StoredMessage::Settled))
            .transpose()
    }

    async fn health_check(&self) -> Result<()> {
        self.query(&self.sql.health_check, &[]).await?;
        Ok(())
    }

    /// With receipts on, as many receipts past their retention go too;
    /// the pass is finished when neither filled the budget.
    async fn sweep_expired_messages(&self, budget: usize) -> Result<SweepStep> {
        let (now, limit) = (big(now_secs()), big(budget as u64));
        let (removed, most) = match self.retention {
            0 => {
                let removed = self
                    .execute(&self.sql.sweep_expired, &[&now, &limit])
                    .await? as usize;
                (removed, removed)
            }
            retention => {
                let rows = self
                    .query(&self.sql.sweep_expired, &[&now, &limit, &big(retention)])
                    .await?;
                let row = rows
                    .first()
                    .ok_or_else(|| StorageError::Backend("PostgreSQL: no row returned".into()))?;
                let messages: i64 = row.try_get(0).map_err(|e| backend("read", e))?;
                let receipts: i64 = row.try_get(1).map_err(|e| backend("read", e))?;
                let (messages, receipts) = (messages.max(0) as usize, receipts.max(0) as usize);
                (messages + receipts, messages.max(receipts))
            }
        };
        Ok(SweepStep {
            removed,
            finished_pass: most < budget,
        })
    }

    async fn drop_idle_users(&self, last_connect_before: u64, budget: usize) -> Result<SweepStep> {
        let after = self
            .user_cursor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let extra = self.receipt_params();
        let (limit, before) = (big(budget as u64), big(last_connect_before));
        let params = self.with_receipts(&[&after, &limit, &before], &extra);
        let rows = self.query(&self.sql.drop_idle_users, &params).await?;
        let row = rows
            .first()
            .ok_or_else(|| StorageError::Backend("PostgreSQL: no row returned".into()))?;
        let removed: i64 = row.try_get(0).map_err(|e| backend("read", e))?;
        let seen: i64 = row.try_get(1).map_err(|e| backend("read", e))?;
        let last: Option<String> = row.try_get(2).map_err(|e| backend("read", e))?;
        let finished_pass = (seen as usize) < budget;
        *self.user_cursor.lock().unwrap_or_else(|p| p.into_inner()) = match finished_pass {
            true => String::new(),
            false => last.unwrap_or_default(),
        };
        Ok(SweepStep {
            removed: removed.max(0) as usize,
            finished_pass,
        })
    }
}
