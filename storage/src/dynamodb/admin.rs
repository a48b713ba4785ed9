//! Operator commands: create the tables, check them, drop old users.

use std::time::Duration;

use autopush_common::time::now_millis;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, KeySchemaElement,
    KeyType, Projection, ProjectionType, ReturnValue, ScalarAttributeType, TableDescription,
    TableStatus, TimeToLiveSpecification, TimeToLiveStatus,
};
use uuid::Uuid;

use super::item::{self, month_keys, months_before, n, s};
use super::{DynamoStore, backend};
use crate::{Result, StorageError};

/// The router table's GSI on `last_connect` (the seeds' name).
pub const ACCESS_INDEX: &str = "AccessIndex";
/// The message table's TTL attribute.
pub const TTL_ATTRIBUTE: &str = "expiry";
/// What a DynamoDB-compatible server without an operation answers.
const UNKNOWN_OPERATION: &str = "UnknownOperationException";
const NO_TTL_API: &str = "this server has no TTL API";
/// The UAID the preflight check writes and removes (the seeds' default).
const PREFLIGHT_UAID: Uuid = Uuid::from_u128(0xdeadbeef00000000deadbeef00000000);

fn attribute(name: &str, kind: ScalarAttributeType) -> Result<AttributeDefinition> {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(kind)
        .build()
        .map_err(|e| StorageError::Backend(e.to_string()))
}

fn key(name: &str, kind: KeyType) -> Result<KeySchemaElement> {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .map_err(|e| StorageError::Backend(e.to_string()))
}

fn key_names(keys: &[KeySchemaElement]) -> Vec<(String, KeyType)> {
    keys.iter()
        .map(|k| (k.attribute_name.clone(), k.key_type.clone()))
        .collect()
}

/// What running without TTL on `message` costs (nothing a user sees, but
/// the space of expired messages), and `why` it is off.
fn no_ttl(message: &str, why: &str) -> String {
    format!(
        "message table {message} has no TTL on {TTL_ATTRIBUTE} ({why}): expired messages \
         are still never delivered, since reads filter them, but nothing deletes them; their \
         space comes back only when their user is removed (`autopush db drop-old-users`)"
    )
}

/// What [`DynamoStore::preflight`] found.
#[derive(Debug, Default)]
pub struct Preflight {
    /// What stops the service from working, one line each; empty means ready.
    pub problems: Vec<String>,
    /// What works but costs something, one line each.
    pub warnings: Vec<String>,
}

impl DynamoStore {
    /// The table's description, or `None` if it does not exist.
    async fn describe(&self, table: &str) -> Result<Option<TableDescription>> {
        match self.client.describe_table().table_name(table).send().await {
            Ok(out) => Ok(out.table),
            Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(None),
            Err(e) => Err(backend("DescribeTable", e)),
        }
    }

    async fn wait_active(&self, table: &str) -> Result<()> {
        for _ in 0..120 {
            if let Some(desc) = self.describe(table).await?
                && desc.table_status == Some(TableStatus::Active)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(StorageError::Backend(format!(
            "table {table} did not become ACTIVE within a minute"
        )))
    }

    /// Create the router and message tables (on-demand capacity) unless they
    /// exist, and turn on TTL on `expiry`. Returns one line per action.
    pub async fn create_tables(&self) -> Result<Vec<String>> {
        let mut report = Vec::new();
        let router = &self.tables.router;
        if self.describe(router).await?.is_some() {
            report.push(format!("router table {router}: exists"));
        } else {
            let index = GlobalSecondaryIndex::builder()
                .index_name(ACCESS_INDEX)
                .key_schema(key("last_connect", KeyType::Hash)?)
                .projection(
                    Projection::builder()
                        .projection_type(ProjectionType::KeysOnly)
                        .build(),
                )
                .build()
                .map_err(|e| StorageError::Backend(e.to_string()))?;
            let created = self
                .client
                .create_table()
                .table_name(router)
                .attribute_definitions(attribute("uaid", ScalarAttributeType::S)?)
                .attribute_definitions(attribute("last_connect", ScalarAttributeType::N)?)
                .key_schema(key("uaid", KeyType::Hash)?)
                .global_secondary_indexes(index)
                .billing_mode(BillingMode::PayPerRequest)
                .send()
                .await;
            match created {
                Ok(_) => report.push(format!("router table {router}: created")),
                Err(e) if e.code() == Some("ResourceInUseException") => {
                    report.push(format!("router table {router}: exists"))
                }
                Err(e) => return Err(backend("CreateTable", e)),
            }
        }
        for message in self.message_tables_now() {
            report.push(self.create_message_table(&message).await?);
        }
        self.wait_active(router).await?;
        for message in self.message_tables_now() {
            self.wait_active(&message).await?;
            report.push(self.enable_ttl(&message).await?);
        }
        Ok(report)
    }

    /// Create message table `message` unless it exists.
    async fn create_message_table(&self, message: &str) -> Result<String> {
        if self.describe(message).await?.is_some() {
            return Ok(format!("message table {message}: exists"));
        }
        let created = self
            .client
            .create_table()
            .table_name(message)
            .attribute_definitions(attribute("uaid", ScalarAttributeType::S)?)
            .attribute_definitions(attribute("chidmessageid", ScalarAttributeType::S)?)
            .key_schema(key("uaid", KeyType::Hash)?)
            .key_schema(key("chidmessageid", KeyType::Range)?)
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match created {
            Ok(_) => Ok(format!("message table {message}: created")),
            Err(e) if e.code() == Some("ResourceInUseException") => {
                Ok(format!("message table {message}: exists"))
            }
            Err(e) => Err(backend("CreateTable", e)),
        }
    }

    /// Whether TTL is on for `expiry`; `None` when the server has no TTL
    /// API (dynalite answers DescribeTimeToLive, but not UpdateTimeToLive).
    async fn ttl_enabled(&self, message: &str) -> Result<Option<bool>> {
        let out = self
            .client
            .describe_time_to_live()
            .table_name(message)
            .send()
            .await;
        match out {
            Ok(out) => Ok(Some(out.time_to_live_description.is_some_and(|d| {
                d.attribute_name.as_deref() == Some(TTL_ATTRIBUTE)
                    && matches!(
                        d.time_to_live_status,
                        Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
                    )
            }))),
            Err(e) if e.code() == Some(UNKNOWN_OPERATION) => Ok(None),
            Err(e) => Err(backend("DescribeTimeToLive", e)),
        }
    }

    /// Turn TTL on; on a server without a TTL API, say what that costs
    /// instead of failing, since reads filter expired messages anyway.
    async fn enable_ttl(&self, message: &str) -> Result<String> {
        match self.ttl_enabled(message).await? {
            Some(true) => return Ok(format!("message table {message}: TTL on expiry: on")),
            None => return Ok(format!("warning: {}", no_ttl(message, NO_TTL_API))),
            Some(false) => {}
        }
        let spec = TimeToLiveSpecification::builder()
            .attribute_name(TTL_ATTRIBUTE)
            .enabled(true)
            .build()
            .map_err(|e| StorageError::Backend(e.to_string()))?;
        let updated = self
            .client
            .update_time_to_live()
            .table_name(message)
            .time_to_live_specification(spec)
            .send()
            .await;
        match updated {
            Ok(_) => Ok(format!("message table {message}: TTL on expiry: turned on")),
            Err(e) if e.code() == Some(UNKNOWN_OPERATION) => {
                Ok(format!("warning: {}", no_ttl(message, NO_TTL_API)))
            }
            Err(e) => Err(backend("UpdateTimeToLive", e)),
        }
    }

    /// Check that both tables exist with the seeds' keys, and that these
    /// credentials can write, read and delete in both. A message table
    /// without TTL is a warning: the service works, expired messages keep
    /// their space (servers such as dynalite have no TTL at all).
    pub async fn preflight(&self) -> Result<Preflight> {
        let mut problems = Vec::new();
        let mut warnings = Vec::new();
        let router = &self.tables.router;
        match self.describe(router).await {
            Ok(None) => problems.push(format!(
                "router table {router} does not exist (run `autopush db create-tables`)"
            )),
            Ok(Some(desc)) => {
                if key_names(desc.key_schema()) != [("uaid".to_owned(), KeyType::Hash)] {
                    problems.push(format!(
                        "router table {router} must have the partition key uaid (S) and no sort key"
                    ));
                }
                let index = desc
                    .global_secondary_indexes()
                    .iter()
                    .find(|i| i.index_name.as_deref() == Some(ACCESS_INDEX));
                if !index.is_some_and(|i| {
                    key_names(i.key_schema()) == [("last_connect".to_owned(), KeyType::Hash)]
                }) {
                    problems.push(format!(
                        "router table {router} lacks the global secondary index {ACCESS_INDEX} on last_connect (N) (drop-old-users needs it)"
                    ));
                }
            }
            Err(e) => problems.push(format!("cannot describe router table {router}: {e}")),
        }
        for message in self.message_tables_now() {
            match self.describe(&message).await {
                Ok(None) => problems.push(format!(
                    "message table {message} does not exist (run `autopush db create-tables`)"
                )),
                Ok(Some(desc)) => {
                    let want = [
                        ("uaid".to_owned(), KeyType::Hash),
                        ("chidmessageid".to_owned(), KeyType::Range),
                    ];
                    if key_names(desc.key_schema()) != want {
                        problems.push(format!(
                            "message table {message} must have the partition key uaid (S) and the sort key chidmessageid (S)"
                        ));
                    }
                    match self.ttl_enabled(&message).await {
                        Ok(Some(true)) => {}
                        Ok(Some(false)) => warnings.push(no_ttl(
                            &message,
                            "it is off; `autopush db create-tables` turns it on where the server has a TTL API",
                        )),
                        Ok(None) => warnings.push(no_ttl(&message, NO_TTL_API)),
                        Err(e) => problems.push(format!("cannot read the TTL of {message}: {e}")),
                    }
                }
                Err(e) => problems.push(format!("cannot describe message table {message}: {e}")),
            }
        }
        if problems.is_empty() {
            problems.extend(self.preflight_round_trip().await);
        }
        Ok(Preflight { problems, warnings })
    }

    /// Write, read and delete one record in each table.
    async fn preflight_round_trip(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let router = &self.tables.router;
        let message = &self.message_tables_now()[0];
        let user_item = item::user_to_item(&autopush_common::User::new_webpush(
            PREFLIGHT_UAID,
            "preflight",
            now_millis(),
        ));
        let steps = [
            (router.as_str(), user_item, item::user_key(&PREFLIGHT_UAID)),
            (
                message.as_str(),
                item::message_key(&PREFLIGHT_UAID, "preflight"),
                item::message_key(&PREFLIGHT_UAID, "preflight"),
            ),
        ];
        for (table, record, key) in steps {
            if let Err(e) = self
                .client
                .put_item()
                .table_name(table)
                .set_item(Some(record))
                .send()
                .await
            {
                problems.push(format!(
                    "cannot write to {table} (PutItem): {}",
                    backend("PutItem", e)
                ));
                continue;
            }
            match self
                .client
                .get_item()
                .table_name(table)
                .set_key(Some(key.clone()))
                .consistent_read(true)
                .send()
                .await
            {
                Ok(out) if out.item.is_some() => {}
                Ok(_) => problems.push(format!("{table}: a record just written was not found")),
                Err(e) => problems.push(format!(
                    "cannot read from {table} (GetItem): {}",
                    backend("GetItem", e)
                )),
            }
            if let Err(e) = self
                .client
                .delete_item()
                .table_name(table)
                .set_key(Some(key))
                .send()
                .await
            {
                problems.push(format!(
                    "cannot delete from {table} (DeleteItem): {}",
                    backend("DeleteItem", e)
                ));
            }
        }
        problems
    }

    /// Drop the webpush users whose last connection was in the calendar
    /// month `months` before this one (UTC), with their channels and
    /// messages, by querying `AccessIndex` for each hour key of that month.
    /// Users are removed in batches of `batch`, with `pause` between
    /// batches to stay inside the table's capacity. Each deletion is
    /// conditional on the `last_connect` found, so a user who connected
    /// since stays. `progress` gets a line per day of the month.
    pub async fn drop_old_users(
        &self,
        months: u32,
        batch: usize,
        pause: Duration,
        progress: &mut (dyn FnMut(String) + Send),
    ) -> Result<usize> {
        let (year, month) = months_before(now_millis(), months);
        let (mut dropped, mut in_batch, mut day_dropped, mut day_seen) = (0, 0, 0, 0);
        let keys: Vec<u64> = month_keys(year, month).collect();
        for (i, hour_key) in keys.iter().enumerate() {
            let mut start = None;
            loop {
                let page = self
                    .client
                    .query()
                    .table_name(&self.tables.router)
                    .index_name(ACCESS_INDEX)
                    .key_condition_expression("last_connect = :k")
                    .expression_attribute_values(":k", n(hour_key))
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .map_err(|e| {
                        backend(&format!("Query {}.{ACCESS_INDEX}", self.tables.router), e)
                    })?;
                for found in page.items.unwrap_or_default() {
                    let Some(uaid) = found
                        .get("uaid")
                        .and_then(|v| v.as_s().ok())
                        .and_then(|v| Uuid::parse_str(v).ok())
                    else {
                        continue;
                    };
                    day_seen += 1;
                    if self.drop_if_unchanged(&uaid, *hour_key).await? {
                        dropped += 1;
                        day_dropped += 1;
                    }
                    in_batch += 1;
                    if in_batch >= batch.max(1) {
                        in_batch = 0;
                        tokio::time::sleep(pause).await;
                    }
                }
                start = page.last_evaluated_key;
                if start.is_none() {
                    break;
                }
            }
            // 240 keys a day: 24 hours times 10 suffixes.
            if (i + 1) % 240 == 0 {
                progress(format!(
                    "{year}-{month:02}-{:02}: {day_seen} old users found, {day_dropped} dropped ({dropped} in all)",
                    (i + 1) / 240
                ));
                (day_seen, day_dropped) = (0, 0);
            }
        }
        Ok(dropped)
    }

    /// Remove a webpush user still last seen at `hour_key`.
    async fn drop_if_unchanged(&self, uaid: &Uuid, hour_key: u64) -> Result<bool> {
        let deleted = self
            .client
            .delete_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(uaid)))
            .condition_expression(
                "last_connect = :k AND (attribute_not_exists(router_type) OR router_type = :webpush)",
            )
            .expression_attribute_values(":k", n(hour_key))
            .expression_attribute_values(":webpush", s("webpush"))
            .return_values(ReturnValue::AllOld)
            .send()
            .await;
        match deleted {
            Ok(out) => {
                let mut tables = self.message_tables_now();
                if let Some(months) = &self.months {
                    tables.push(months.month(-1));
                }
                // With rotation, the month the user was last on (a table
                // the operator may have dropped already).
                if let Some(AttributeValue::S(month)) = out
                    .attributes
                    .as_ref()
                    .and_then(|old| old.get("current_month"))
                    && !tables.contains(month)
                {
                    tables.push(month.clone());
                }
                self.remove_message_rows(uaid, &tables).await?;
                Ok(true)
            }
            Err(e) if super::is_condition_failed(&e) => Ok(false),
            Err(e) => Err(backend("DeleteItem", e)),
        }
    }
}
