//! `autopush db create-tables` on PostgreSQL: autopush-rs's tables, their
//! keys and indexes (its `schema.psql`), and the columns, index and
//! receipt table of our own that it never names.

use super::{PostgresStore, backend};
use crate::Result;

impl PostgresStore {
    /// Create the schema (if one is set), the tables and their indexes
    /// unless they exist, and add our own columns to tables that lack them
    /// (made by autopush-rs's `schema.psql`). One transaction; safe again.
    ///
    /// Unlike `schema.psql`, `meta` and `message` are made without a
    /// foreign key to `router`: as on every other backend a channel or a
    /// message may be written before its user, and a user's removal deletes
    /// its rows itself, in the same statement. Tables `schema.psql` made
    /// keep theirs.
    pub async fn create_tables(&self) -> Result<Vec<String>> {
        let s = &self.settings;
        let (r, m, c, rel, rc) = (
            s.qualified(&s.router_table),
            s.qualified(&s.message_table),
            s.qualified(&s.meta_table),
            s.qualified(&s.reliability_table),
            s.qualified(&s.receipt_table),
        );
        // autopush-rs's index names with its default table names; with
        // others, prefixed by the table, so two sets in a schema never
        // share one (CREATE INDEX IF NOT EXISTS would skip the second).
        let index = |table: &str, default: &str, name: &str| match table == default {
            true => name.to_owned(),
            false => format!("{table}_{name}"),
        };
        let chid_message_idx = index(&s.message_table, "message", "chid_message_idx");
        let reliability_idx = index(&s.message_table, "message", "message_reliability_id_idx");
        let expiry_idx = index(&s.message_table, "message", "message_expiry_idx");
        let meta_uaid_idx = index(&s.meta_table, "meta", "meta_uaid_idx");
        let update_idx = index(&s.reliability_table, "reliability", "update_idx");
        let receipt_expiry_idx = format!("{}_expiry_idx", s.receipt_table);
        let schema = match &s.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS {schema};"),
            None => String::new(),
        };
        let ddl = format!(
            "BEGIN;
            {schema}
            CREATE TABLE IF NOT EXISTS {r} (
                uaid varchar(40) NOT NULL PRIMARY KEY,
                connected_at bigint,
                router_type varchar(100),
                router_data text,
                last_connect bigint,
                node_id varchar(100),
                record_version bigint,
                version text,
                last_update bigint,
                expiry bigint,
                priv_channels varchar(40)[]
            );
            ALTER TABLE {r} ADD COLUMN IF NOT EXISTS over_msg_limit boolean,
                ADD COLUMN IF NOT EXISTS min_urgency varchar(16),
                ADD COLUMN IF NOT EXISTS wake_route text,
                ADD COLUMN IF NOT EXISTS last_wake bigint;
            CREATE TABLE IF NOT EXISTS {c} (
                channel_id varchar(40) NOT NULL,
                uaid varchar(40) NOT NULL,
                PRIMARY KEY (uaid, channel_id)
            );
            CREATE TABLE IF NOT EXISTS {rel} (
                id varchar(40) NOT NULL PRIMARY KEY,
                states jsonb,
                last_update_timestamp bigint
            );
            CREATE TABLE IF NOT EXISTS {m} (
                uaid varchar(40) NOT NULL,
                channel_id varchar(40),
                chid_message_id varchar(100),
                version text,
                ttl bigint,
                expiry bigint,
                topic varchar,
                timestamp bigint,
                data text,
                sortkey_timestamp bigint,
                headers text,
                reliability_id varchar(40) REFERENCES {rel} (id),
                PRIMARY KEY (uaid, chid_message_id)
            );
            ALTER TABLE {m} ADD COLUMN IF NOT EXISTS urgency varchar(16),
                ADD COLUMN IF NOT EXISTS durable boolean;
            CREATE UNIQUE INDEX IF NOT EXISTS {chid_message_idx} ON {m} (chid_message_id);
            CREATE INDEX IF NOT EXISTS {reliability_idx} ON {m} (reliability_id);
            CREATE INDEX IF NOT EXISTS {meta_uaid_idx} ON {c} (uaid);
            CREATE INDEX IF NOT EXISTS {update_idx} ON {rel} (last_update_timestamp);
            CREATE INDEX IF NOT EXISTS {expiry_idx} ON {m} (expiry);
            CREATE TABLE IF NOT EXISTS {rc} (
                uaid varchar(40) NOT NULL,
                chid_message_id text NOT NULL,
                version text NOT NULL,
                state varchar(16) NOT NULL,
                updated bigint NOT NULL,
                expiry bigint NOT NULL,
                PRIMARY KEY (uaid, chid_message_id)
            );
            CREATE INDEX IF NOT EXISTS {receipt_expiry_idx} ON {rc} (expiry);
            COMMIT;"
        );
        let client = self.client().await?;
        client
            .batch_execute(&ddl)
            .await
            .map_err(|e| backend("create tables", e))?;
        Ok(vec![
            format!("tables {r}, {c}, {m} and {rel} ready, with their indexes"),
            format!(
                "our own columns: {r}.over_msg_limit, min_urgency, wake_route, last_wake; \
                 {m}.urgency, durable; index {expiry_idx} for the expiry sweep; \
                 table {rc} for receipts"
            ),
        ])
    }
}

/// What `db preflight` found.
#[derive(Debug, Default)]
pub struct Preflight {
    /// What must be fixed before a node can run on these tables.
    pub problems: Vec<String>,
}

/// The columns each table needs: autopush-rs's that we read or write, and
/// our own (`create-tables` adds those to tables autopush-rs made).
const ROUTER_COLUMNS: &[&str] = &[
    "uaid",
    "connected_at",
    "router_type",
    "router_data",
    "last_connect",
    "node_id",
    "record_version",
    "version",
    "expiry",
];
const ROUTER_OWN: &[&str] = &["over_msg_limit", "min_urgency", "wake_route", "last_wake"];
const META_COLUMNS: &[&str] = &["uaid", "channel_id"];
const MESSAGE_COLUMNS: &[&str] = &[
    "uaid",
    "channel_id",
    "chid_message_id",
    "version",
    "ttl",
    "expiry",
    "topic",
    "timestamp",
    "data",
    "sortkey_timestamp",
    "headers",
];
const MESSAGE_OWN: &[&str] = &["urgency", "durable"];
/// Our own table, all of it.
const RECEIPT_OWN: &[&str] = &[
    "uaid",
    "chid_message_id",
    "version",
    "state",
    "updated",
    "expiry",
];

impl PostgresStore {
    /// Check that the tables exist with every column this server reads and
    /// writes (an autopush-rs schema lacks only our own, which
    /// `create-tables` adds), then that these credentials can write, read
    /// and delete a user with a channel and a message.
    pub async fn preflight(&self) -> Result<Preflight> {
        let s = &self.settings;
        let tables = [
            (&s.router_table, ROUTER_COLUMNS, ROUTER_OWN),
            (&s.meta_table, META_COLUMNS, &[][..]),
            (&s.message_table, MESSAGE_COLUMNS, MESSAGE_OWN),
            (&s.receipt_table, &[][..], RECEIPT_OWN),
        ];
        let names: Vec<&str> = tables.iter().map(|(t, _, _)| t.as_str()).collect();
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT table_name::text, column_name::text FROM information_schema.columns \
                 WHERE table_schema::text = coalesce($1::text, current_schema()) \
                 AND table_name::text = ANY($2::text[])",
                &[&s.schema, &names],
            )
            .await
            .map_err(|e| backend("preflight", e))?;
        drop(client);
        let found: std::collections::HashSet<(String, String)> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let mut problems = Vec::new();
        for (table, columns, own) in tables {
            let qualified = s.qualified(table);
            if !found.iter().any(|(t, _)| t == table) {
                problems.push(format!(
                    "table {qualified} (`autopush db create-tables` makes it)"
                ));
                continue;
            }
            for column in columns.iter() {
                if !found.contains(&(table.clone(), column.to_string())) {
                    problems.push(format!("column {qualified}.{column}"));
                }
            }
            for column in own.iter() {
                if !found.contains(&(table.clone(), column.to_string())) {
                    problems.push(format!(
                        "column {qualified}.{column} (ours: `autopush db create-tables` adds it)"
                    ));
                }
            }
        }
        if problems.is_empty()
            && let Err(e) = self.round_trip().await
        {
            problems.push(format!("a write, read and delete: {e}"));
        }
        Ok(Preflight { problems })
    }

    /// Write a user with a channel and a message, read them and remove them.
    async fn round_trip(&self) -> Result<()> {
        use crate::Storage;
        use autopush_common::{Notification, User, time::now_secs};
        let uaid = uuid::Uuid::new_v4();
        let chid = uuid::Uuid::new_v4();
        let now = now_secs();
        self.add_user(&User::new_webpush(uaid, "preflight", now * 1000))
            .await?;
        let check = async {
            self.add_channel(&uaid, &chid, 1).await?;
            let message = Notification {
                channel_id: chid,
                version: "preflight".into(),
                ttl: 60,
                timestamp: now,
                topic: None,
                sortkey_timestamp: Some(now * 1_000_000),
                data: None,
                headers: None,
                urgency: None,
                durable: false,
            };
            self.save_messages(&uaid, vec![message]).await?;
            match self.get_user_and_channel(&uaid, &chid).await? {
                Some((_, true)) if self.count_messages(&uaid, 1).await? == 1 => Ok(()),
                _ => Err(crate::StorageError::Backend(
                    "what was written did not read back".into(),
                )),
            }
        };
        let checked = check.await;
        self.remove_user(&uaid).await?;
        checked
    }
}
