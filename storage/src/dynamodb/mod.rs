//! The DynamoDB backend: the seeds' router and message tables, shared by any
//! number of connection and endpoint nodes.
//!
//! Configuration is the standard AWS one (environment, profiles, instance
//! roles; `AWS_ENDPOINT_URL_DYNAMODB` for a local or compatible server).
//! Every call is retried with exponential backoff and full jitter on
//! throttling (`ProvisionedThroughputExceededException`,
//! `ThrottlingException`), 5xx and timeouts, inside [`RETRY_BUDGET`]; past
//! it the error reaches the caller as [`StorageError::Backend`] (503 errno
//! 201 to senders, close 1013 to clients). DynamoDB's TTL deletes expired
//! messages lazily, so reads filter them too. Legacy monthly message
//! tables (`--message-table-rotation`) are described in [`months`].

pub mod admin;
pub mod item;
pub mod months;

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use autopush_common::{Notification, Urgency, User, WakeRoute, time::now_secs};
use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{AttributeValue, DeleteRequest, ReturnValue, Select, WriteRequest};
use futures_util::{StreamExt, TryStreamExt};
use uuid::Uuid;

use crate::{Receipt, Result, Storage, StorageError, StoredMessage};
use autopush_common::metrics::final_states_in_store;
use autopush_common::notification::receipt_key;
use autopush_common::receipt::MessageState;
use item::{CHANNELS_ROW, Item, n, s};
use months::{Home, MonthTables};

/// The filter of message queries: rows that are messages (not receipts)
/// whose `expiry` is after `:now`.
const UNSETTLED_AND_UNEXPIRED: &str =
    "(attribute_not_exists(expiry) OR expiry > :now) AND attribute_not_exists(settled)";

/// How long one storage call may take, retries included.
pub const RETRY_BUDGET: Duration = Duration::from_secs(5);
/// Most items DynamoDB takes in one BatchWriteItem.
const BATCH_WRITE_MAX: usize = 25;
/// Conditional writes of one user's removal in flight at once.
const REMOVAL_CONCURRENCY: usize = 16;

/// Table names; the defaults are the seeds' `router` and `message`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tables {
    pub router: String,
    pub message: String,
    /// Legacy monthly rotation: `message` is then the prefix of one table per
    /// month (see [`months`]).
    pub rotate_messages: bool,
}

impl Default for Tables {
    fn default() -> Self {
        Tables {
            router: "router".into(),
            message: "message".into(),
            rotate_messages: false,
        }
    }
}

#[derive(Clone)]
pub struct DynamoStore {
    client: Client,
    tables: Tables,
    /// With legacy rotation, the monthly message tables.
    months: Option<MonthTables>,
    /// Most items one Query page asks for (DynamoDB also stops at 1 MB).
    page_size: usize,
    /// Seconds a receipt is kept after its message's final state; 0: off.
    retention: u64,
}

/// A failed call: the service's error code and message when it answered,
/// else what went wrong on the way (timeout, connection).
fn backend<E>(op: &str, e: SdkError<E>) -> StorageError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match e.code() {
        Some(code @ "ResourceNotFoundException") => StorageError::NoTable(format!(
            "DynamoDB {op}: {code}: {}",
            e.message().unwrap_or_default()
        )),
        Some(code) => StorageError::Backend(format!(
            "DynamoDB {op}: {code}: {}",
            e.message().unwrap_or_default()
        )),
        None => StorageError::Backend(format!("DynamoDB {op}: {}", no_answer(&e))),
    }
}

/// Why a call got no answer from DynamoDB, in one line: the SDK's own
/// message nests every cause and ends in a debug dump.
fn no_answer<E>(e: &SdkError<E>) -> String
where
    E: std::error::Error + 'static,
{
    let mut causes = Vec::new();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = cause {
        if let Some(credentials) = error.downcast_ref::<CredentialsError>() {
            return match credentials {
                CredentialsError::CredentialsNotLoaded(_) => "no AWS credentials found: set \
                    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (any values for a local \
                    server), or use a profile or an instance role"
                    .into(),
                other => format!("AWS credentials: {}", first_line(other)),
            };
        }
        causes.push(first_line(error));
        cause = error.source();
    }
    match e {
        SdkError::TimeoutError(_) => "timed out".into(),
        SdkError::DispatchFailure(d) if d.is_timeout() => "timed out".into(),
        // The innermost cause says it best ("Connection refused (os error 111)").
        SdkError::DispatchFailure(d) if d.is_io() => {
            format!(
                "cannot connect: {}",
                causes.last().map_or("", String::as_str)
            )
        }
        _ => causes.join(": "),
    }
}

fn first_line(error: &dyn std::error::Error) -> String {
    error
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn is_condition_failed<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    e.code() == Some("ConditionalCheckFailedException")
}

/// The outcome of a conditional write `op`: whether its condition held (and
/// the write was made), or the backend's error.
fn condition_held<T, E>(result: std::result::Result<T, SdkError<E>>, op: &str) -> Result<bool>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match result {
        Ok(_) => Ok(true),
        Err(e) if is_condition_failed(&e) => Ok(false),
        Err(e) => Err(backend(op, e)),
    }
}

/// A BatchWriteItem delete of the row `row` (its key attributes).
fn delete_request(
    row: &Item,
) -> std::result::Result<WriteRequest, aws_sdk_dynamodb::error::BuildError> {
    let key = ["uaid", "chidmessageid"]
        .into_iter()
        .filter_map(|name| Some((name.to_owned(), row.get(name)?.clone())))
        .collect();
    DeleteRequest::builder()
        .set_key(Some(key))
        .build()
        .map(|d| WriteRequest::builder().delete_request(d).build())
}

/// `uaid` as a key value: hex without dashes, as the seeds store it.
fn uaid_attr(uaid: &Uuid) -> AttributeValue {
    s(uaid.simple().to_string())
}

impl DynamoStore {
    /// An `UpdateItem` of `uaid`'s router record: every change to a user is
    /// one, with its own condition.
    fn update_user(
        &self,
        uaid: &Uuid,
    ) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(uaid)))
    }

    /// A client from the standard AWS configuration, with our retry policy.
    pub async fn connect(tables: Tables) -> Result<Self> {
        Self::connect_with(aws_config::defaults(BehaviorVersion::latest()), tables).await
    }

    /// A client from `config` (e.g. with an endpoint and credentials set),
    /// with our HTTP client, retry policy and time budget.
    pub async fn connect_with(config: aws_config::ConfigLoader, tables: Tables) -> Result<Self> {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let config = config
            .http_client(http)
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(8)
                    .with_initial_backoff(Duration::from_millis(25))
                    .with_max_backoff(Duration::from_secs(1)),
            )
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .operation_attempt_timeout(Duration::from_secs(2))
                    .operation_timeout(RETRY_BUDGET)
                    .build(),
            )
            .load()
            .await;
        if config.region().is_none() {
            return Err(StorageError::Backend(
                "--db dynamodb needs an AWS region: set AWS_REGION (or a profile with a region)"
                    .into(),
            ));
        }
        Ok(DynamoStore {
            client: Client::new(&config),
            months: tables
                .rotate_messages
                .then(|| MonthTables::new(&tables.message)),
            tables,
            page_size: 1000,
            retention: 0,
        })
    }

    /// Keep receipts `seconds` after a message's final state (0: off, the
    /// default): see [`crate::receipt`].
    pub fn with_receipt_retention(mut self, seconds: u64) -> Self {
        self.retention = seconds;
        self
    }

    /// Ask for at most `items` per Query page (tests use small pages to
    /// walk pagination with little data).
    pub fn with_page_size(mut self, items: usize) -> Self {
        self.page_size = items.max(1);
        self
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The message tables in use now: the one table, or with rotation this
    /// month's and the next (made ahead, as the seeds ask).
    pub fn message_tables_now(&self) -> Vec<String> {
        match &self.months {
            Some(months) => vec![months.month(0), months.month(1)],
            None => vec![self.tables.message.clone()],
        }
    }

    /// The router record as stored, stale or not.
    async fn read_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        let out = self
            .client
            .get_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(uaid)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| backend("GetItem", e))?;
        out.item.as_ref().map(item::user_from_item).transpose()
    }

    /// Where `uaid`'s channels and messages are. Without rotation that is
    /// the one message table, known without asking; with it, the router
    /// record says.
    async fn home(&self, uaid: &Uuid) -> Result<Home> {
        match &self.months {
            None => Ok(Home {
                table: self.tables.message.clone(),
                reads: vec![self.tables.message.clone()],
            }),
            Some(months) => Ok(months.home(self.read_user(uaid).await?.as_ref())),
        }
    }

    /// `user` as written: with rotation a user without a month starts in
    /// this month's table.
    fn with_month<'a>(&self, user: &'a User) -> std::borrow::Cow<'a, User> {
        match &self.months {
            Some(months) if user.current_month.is_none() => {
                let mut user = user.clone();
                user.current_month = Some(months.month(0));
                std::borrow::Cow::Owned(user)
            }
            _ => std::borrow::Cow::Borrowed(user),
        }
    }

    /// Every row of `uaid` in message table `table` (keys, and what tells a
    /// pending message from the rest), page by page.
    async fn message_rows(&self, table: &str, uaid: &Uuid) -> Result<Vec<Item>> {
        let mut keys = Vec::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .query()
                .table_name(table)
                .key_condition_expression("uaid = :u")
                .expression_attribute_values(":u", uaid_attr(uaid))
                // What tells a pending message from a receipt or an
                // expired one (see `remove_message_rows`).
                .projection_expression("uaid, chidmessageid, updateid, settled, #ts, #ttl")
                .expression_attribute_names("#ts", "timestamp")
                .expression_attribute_names("#ttl", "ttl")
                .consistent_read(true)
                .limit(self.page_size as i32)
                .set_exclusive_start_key(start)
                .send()
                .await;
            let page = match page {
                Ok(page) => page,
                // A monthly table the operator dropped holds nothing.
                Err(e) if e.code() == Some("ResourceNotFoundException") => return Ok(keys),
                Err(e) => return Err(backend("Query", e)),
            };
            keys.extend(page.items.unwrap_or_default());
            start = page.last_evaluated_key;
            if start.is_none() {
                return Ok(keys);
            }
        }
    }

    /// BatchWriteItem in chunks, resending what DynamoDB left unprocessed.
    async fn batch_write(&self, table: &str, requests: Vec<WriteRequest>) -> Result<()> {
        for chunk in requests.chunks(BATCH_WRITE_MAX) {
            let mut pending = chunk.to_vec();
            let mut backoff = Duration::from_millis(25);
            let deadline = tokio::time::Instant::now() + RETRY_BUDGET;
            while !pending.is_empty() {
                let out = self
                    .client
                    .batch_write_item()
                    .request_items(table, pending)
                    .send()
                    .await
                    .map_err(|e| backend("BatchWriteItem", e))?;
                pending = out
                    .unprocessed_items
                    .and_then(|mut left| left.remove(table))
                    .unwrap_or_default();
                if !pending.is_empty() {
                    if tokio::time::Instant::now() + backoff > deadline {
                        return Err(StorageError::Backend(format!(
                            "DynamoDB BatchWriteItem: {} writes still unprocessed after retries",
                            pending.len()
                        )));
                    }
                    tokio::time::sleep(backoff.mul_f64(fastrand::f64() + 0.5)).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
        Ok(())
    }

    /// Delete every row of `uaid` (channels and messages) in `tables`. With
    /// receipts on, its pending messages leave `gone` receipts instead, each
    /// one conditional write on the version read (an ack that settled it
    /// since keeps its `delivered`), and its receipts and expired messages
    /// stay until their own expiry.
    async fn remove_message_rows(&self, uaid: &Uuid, tables: &[String]) -> Result<()> {
        let now = now_secs();
        for table in tables {
            let mut deletes = Vec::new();
            let mut gone = Vec::new();
            for row in self.message_rows(table, uaid).await? {
                let sort_key = match row.get("chidmessageid") {
                    Some(AttributeValue::S(key)) => key.clone(),
                    _ => String::new(),
                };
                if self.retention == 0 || sort_key == CHANNELS_ROW {
                    deletes.push(delete_request(&row));
                    continue;
                }
                match item::stored_from_item(&row) {
                    Ok(StoredMessage::Pending(m)) if !m.is_expired(now) => {
                        gone.push((
                            sort_key,
                            Receipt::new(&m.version, MessageState::Gone, now, self.retention),
                        ));
                    }
                    Ok(_) => {}
                    Err(_) => deletes.push(delete_request(&row)),
                }
            }
            let deletes = deletes
                .into_iter()
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| StorageError::Backend(e.to_string()))?;
            self.batch_write(table, deletes).await?;
            let settled = futures_util::stream::iter(gone)
                .map(|(key, receipt)| async move {
                    let version = receipt.version.clone();
                    self.settle_key(table, uaid, &key, &version, &receipt).await
                })
                .buffer_unordered(REMOVAL_CONCURRENCY)
                .try_collect::<Vec<_>>()
                .await?;
            crate::receipt::count_gone(&settled);
        }
        Ok(())
    }

    /// Delete the message under `sort_key` in `table` if it is still
    /// `version` (and, for a `settle`, not past its TTL: expired is final).
    async fn delete_version(
        &self,
        table: &str,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        settle: bool,
    ) -> Result<bool> {
        let delete = self
            .client
            .delete_item()
            .table_name(table)
            .set_key(Some(item::message_key(uaid, sort_key)))
            .expression_attribute_values(":v", s(version));
        let delete = match settle {
            true => delete
                .condition_expression(format!("updateid = :v AND {}", item::UNEXPIRED))
                .expression_attribute_names("#deadline", "deadline")
                .expression_attribute_values(":now", n(now_secs())),
            false => delete.condition_expression("updateid = :v"),
        };
        condition_held(delete.send().await, "DeleteItem")
    }

    /// One page of `uaid`'s unexpired messages in `table` (sort keys after
    /// the channel row). Expired ones are filtered out by DynamoDB, which
    /// still reads them: TTL deletes them, within 48 hours.
    async fn message_page(
        &self,
        table: &str,
        uaid: &Uuid,
        limit: usize,
        start: Option<Item>,
    ) -> Result<(Vec<Item>, Option<Item>)> {
        let page = self
            .client
            .query()
            .table_name(table)
            .key_condition_expression("uaid = :u AND chidmessageid > :channels")
            .filter_expression(UNSETTLED_AND_UNEXPIRED)
            .expression_attribute_values(":u", uaid_attr(uaid))
            .expression_attribute_values(":channels", s(CHANNELS_ROW))
            .expression_attribute_values(":now", n(now_secs()))
            .consistent_read(true)
            .limit(limit.clamp(1, self.page_size) as i32)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(|e| backend("Query", e))?;
        Ok((page.items.unwrap_or_default(), page.last_evaluated_key))
    }

    /// The channel set in `table` as stored (the seeds' Python wrote hex,
    /// we write hyphenated).
    async fn chids_in(&self, table: &str, uaid: &Uuid) -> Result<Vec<String>> {
        let row = self.get_row(table, uaid, CHANNELS_ROW).await?;
        Ok(match row.and_then(|mut i| i.remove("chids")) {
            Some(AttributeValue::Ss(chids)) => chids,
            _ => Vec::new(),
        })
    }

    /// Add `chids` to the channel set in `table`.
    async fn add_chids(&self, table: &str, uaid: &Uuid, chids: Vec<String>) -> Result<()> {
        if chids.is_empty() {
            return Ok(()); // DynamoDB has no empty sets
        }
        self.client
            .update_item()
            .table_name(table)
            .set_key(Some(item::message_key(uaid, CHANNELS_ROW)))
            .update_expression("ADD chids :set")
            .expression_attribute_values(":set", AttributeValue::Ss(chids))
            .send()
            .await
            .map_err(|e| backend("UpdateItem", e))?;
        Ok(())
    }

    /// Up to `limit` unexpired messages of `uaid` in `table`. Expired ones
    /// are left to TTL: deleting them here would cost a request each, at
    /// hello, for a user a flood left with thousands.
    async fn fetch_from(
        &self,
        table: &str,
        uaid: &Uuid,
        limit: usize,
    ) -> Result<Vec<Notification>> {
        let now = now_secs();
        let mut messages = Vec::new();
        let mut start = None;
        while messages.len() < limit {
            let (items, next) = self
                .message_page(table, uaid, limit - messages.len(), start)
                .await?;
            for item in &items {
                match item::message_from_item(item) {
                    // Expired between DynamoDB's filter and now.
                    Ok(m) if m.is_expired(now) => {}
                    Ok(m) => messages.push(m),
                    Err(e) => tracing::warn!("skipping a stored message: {e}"),
                }
            }
            start = next;
            if start.is_none() {
                break;
            }
        }
        Ok(messages)
    }

    /// Unexpired messages of `uaid` in `table`, counted up to `up_to`.
    async fn count_in(&self, table: &str, uaid: &Uuid, up_to: usize) -> Result<usize> {
        let (mut count, mut start) = (0, None);
        while count < up_to {
            let page = self
                .client
                .query()
                .table_name(table)
                .key_condition_expression("uaid = :u AND chidmessageid > :channels")
                .filter_expression(UNSETTLED_AND_UNEXPIRED)
                .expression_attribute_values(":u", uaid_attr(uaid))
                .expression_attribute_values(":channels", s(CHANNELS_ROW))
                // A message is kept `retention` past its deadline (for its
                // receipt): its `expiry` is that much later.
                .expression_attribute_values(":now", n(now_secs() + self.retention))
                .select(Select::Count)
                .consistent_read(true)
                .limit((up_to - count).clamp(1, self.page_size) as i32)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|e| backend("Query", e))?;
            count += page.count.max(0) as usize;
            start = page.last_evaluated_key;
            if start.is_none() {
                break;
            }
        }
        Ok(count.min(up_to))
    }

    /// Delete the message under `sort_key` (or the key Python autopush gave
    /// it) in `table` if it is still `version` (see [`Self::delete_version`]).
    async fn delete_message_in(
        &self,
        table: &str,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        settle: bool,
    ) -> Result<bool> {
        let legacy = item::legacy_sort_key(sort_key);
        for key in std::iter::once(sort_key).chain(legacy.as_deref()) {
            if self
                .delete_version(table, uaid, key, version, settle)
                .await?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Turn the pending message `version` under `sort_key` (or the key
    /// Python autopush gave it) in `table` into a receipt of `state`.
    async fn settle_in(
        &self,
        table: &str,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        if self.retention == 0 {
            return self
                .delete_message_in(table, uaid, sort_key, version, true)
                .await;
        }
        let receipt = Receipt::new(version, state, now_secs(), self.retention);
        let legacy = item::legacy_sort_key(sort_key);
        for key in std::iter::once(sort_key).chain(legacy.as_deref()) {
            if self.settle_key(table, uaid, key, version, &receipt).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Settle the row under exactly `sort_key` in `table` into `receipt` if
    /// it is still the pending message `version`: one conditional
    /// `UpdateItem` that turns the row itself into the receipt, a Topic
    /// message's too. What made it a message goes with it (`timestamp`,
    /// which autopush-rs requires of a message; `sortkey_timestamp`, so
    /// the Topic's next message takes the row as it would an empty one),
    /// and that next message moves the receipt to a row of its own (see
    /// [`Self::keep_receipt`]). No transaction: dynalite and ScyllaDB
    /// Alternator have none, and it would cost twice the write units.
    async fn settle_key(
        &self,
        table: &str,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        receipt: &Receipt,
    ) -> Result<bool> {
        let update = self
            .client
            .update_item()
            .table_name(table)
            .set_key(Some(item::message_key(uaid, sort_key)))
            .update_expression(item::SETTLE)
            .condition_expression(format!(
                "updateid = :v AND attribute_not_exists(settled) AND {}",
                item::UNEXPIRED
            ))
            .set_expression_attribute_names(Some(item::settle_names()))
            .set_expression_attribute_values(Some(item::settle_values(receipt)))
            .expression_attribute_values(":v", s(version))
            .send()
            .await;
        condition_held(update, "UpdateItem")
    }

    /// After a Topic message took the row under `sort_key` in `table` from
    /// `old`: `old`'s receipt in a row of its own, where the Topic's next
    /// messages leave it. A pending `old` was `replaced` (or `expired`);
    /// a settled one keeps the receipt its settle wrote.
    async fn keep_receipt(
        &self,
        table: &str,
        uaid: &Uuid,
        sort_key: &str,
        old: &StoredMessage,
    ) -> Result<()> {
        let Some(own) = receipt_key(sort_key, old.version()) else {
            return Ok(());
        };
        let now = now_secs();
        let receipt = match old {
            StoredMessage::Pending(old) => Receipt::replaced(old, now, self.retention),
            StoredMessage::Settled(receipt) if receipt.expiry > now => receipt.clone(),
            StoredMessage::Settled(_) => return Ok(()),
        };
        let put = self
            .client
            .put_item()
            .table_name(table)
            .set_item(Some(item::receipt_to_item(uaid, &own, &receipt)))
            .condition_expression("attribute_not_exists(updateid)")
            .send()
            .await;
        if condition_held(put, "PutItem")? && receipt.state == MessageState::Replaced {
            final_states_in_store(MessageState::Replaced, 1);
        }
        Ok(())
    }

    /// The row under `sort_key` (or the key Python autopush gave it) in `table`.
    async fn read_in(&self, table: &str, uaid: &Uuid, sort_key: &str) -> Result<Option<Item>> {
        let legacy = item::legacy_sort_key(sort_key);
        for key in std::iter::once(sort_key).chain(legacy.as_deref()) {
            if let Some(row) = self.get_row(table, uaid, key).await? {
                return Ok(Some(row));
            }
        }
        Ok(None)
    }

    /// One row of `uaid` in message table `table`, read consistently.
    async fn get_row(&self, table: &str, uaid: &Uuid, sort_key: &str) -> Result<Option<Item>> {
        let out = self
            .client
            .get_item()
            .table_name(table)
            .set_key(Some(item::message_key(uaid, sort_key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| backend("GetItem", e))?;
        Ok(out.item)
    }

    /// The seeds' `update_message_month`: move a user whose table `from`
    /// holds nothing unread to this month's table `to`. The channel set is
    /// copied first, so an endpoint that sees the new month finds the
    /// channels there; the flip is conditional on the month read, so of two
    /// sessions moving the same user one flips and the other does nothing.
    async fn move_to_month(&self, uaid: &Uuid, from: &str, to: &str) -> Result<()> {
        let copied = self.chids_in(from, uaid).await?;
        self.add_chids(to, uaid, copied.clone()).await?;
        let flip = self
            .update_user(uaid)
            .update_expression("SET current_month = :to")
            .condition_expression("current_month = :from")
            .expression_attribute_values(":to", s(to))
            .expression_attribute_values(":from", s(from))
            .send()
            .await;
        if !condition_held(flip, "UpdateItem")? {
            return Ok(());
        }
        tracing::debug!(uaid = %autopush_common::ids::uaid_tag(uaid), from, to, "moved to this month's message table");
        // A channel another node registered in `from` between the copy and
        // the flip.
        let late: Vec<_> = self
            .chids_in(from, uaid)
            .await?
            .into_iter()
            .filter(|c| !copied.contains(c))
            .collect();
        self.add_chids(to, uaid, late).await
    }
}

#[async_trait]
impl Storage for DynamoStore {
    async fn add_user(&self, user: &User) -> Result<()> {
        self.client
            .put_item()
            .table_name(&self.tables.router)
            .set_item(Some(item::user_to_item(&self.with_month(user))))
            .send()
            .await
            .map_err(|e| backend("PutItem", e))?;
        Ok(())
    }

    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool> {
        // A record from before connected_at was kept reads as 0.
        let seen = match seen_connected_at {
            0 => "(attribute_not_exists(connected_at) OR connected_at = :seen)",
            _ => "connected_at = :seen",
        };
        let mut set = vec!["connected_at = :c", "last_connect = :lc"];
        let mut remove = Vec::new();
        let mut update = self
            .update_user(&user.uaid)
            .condition_expression(format!("attribute_exists(uaid) AND {seen}"))
            .expression_attribute_values(":seen", n(seen_connected_at))
            .expression_attribute_values(":c", n(user.connected_at))
            .expression_attribute_values(":lc", item::last_connect_attr(user.last_connect));
        match &user.node_id {
            Some(node_id) => {
                set.push("node_id = :n");
                update = update.expression_attribute_values(":n", s(node_id));
            }
            None => remove.push("node_id"),
        }
        if user.over_msg_limit {
            set.push("over_msg_limit = :true");
            update = update.expression_attribute_values(":true", AttributeValue::Bool(true));
        } else {
            remove.push("over_msg_limit");
        }
        if let Some(months) = &self.months {
            // A record from before rotation starts in this month's table.
            set.push("current_month = if_not_exists(current_month, :month)");
            update = update.expression_attribute_values(":month", s(months.month(0)));
        }
        let mut expression = format!("SET {}", set.join(", "));
        if !remove.is_empty() {
            expression += &format!(" REMOVE {}", remove.join(", "));
        }
        let update = update.update_expression(expression).send().await;
        condition_held(update, "UpdateItem")
    }

    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .update_expression("SET last_connect = :lc")
            .condition_expression("attribute_exists(uaid)")
            .expression_attribute_values(":lc", item::last_connect_attr(last_connect))
            .send()
            .await;
        condition_held(update, "UpdateItem")
    }

    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .update_expression("SET router_data = :new")
            .expression_attribute_values(":new", item::json_to_attr(router_data));
        let update = match seen {
            Some(seen) => {
                let seen = item::json_equals("router_data", seen);
                let mut update = update.condition_expression(format!(
                    "attribute_exists(uaid) AND {}",
                    seen.expression
                ));
                for (name, attribute) in seen.names {
                    update = update.expression_attribute_names(name, attribute);
                }
                for (name, value) in seen.values {
                    update = update.expression_attribute_values(name, value);
                }
                update
            }
            None => update.condition_expression(
                "attribute_exists(uaid) AND attribute_not_exists(router_data)",
            ),
        };
        condition_held(update.send().await, "UpdateItem")
    }

    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .condition_expression("attribute_exists(uaid)");
        let update = match route {
            Some(route) => update
                .update_expression("SET wake_route = :r")
                .expression_attribute_values(":r", s(route.to_json())),
            None => update.update_expression("REMOVE wake_route"),
        };
        condition_held(update.send().await, "UpdateItem")
    }

    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .update_expression("REMOVE wake_route")
            .condition_expression("wake_route = :seen")
            .expression_attribute_values(":seen", s(seen.to_json()))
            .send()
            .await;
        condition_held(update, "UpdateItem")
    }

    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
        let seen_holds = match seen {
            0 => "attribute_exists(uaid) AND attribute_not_exists(last_wake)",
            _ => "last_wake = :seen",
        };
        let mut update = self
            .update_user(uaid)
            .update_expression("SET last_wake = :now")
            .condition_expression(seen_holds)
            .expression_attribute_values(":now", n(now));
        if seen > 0 {
            update = update.expression_attribute_values(":seen", n(seen));
        }
        condition_held(update.send().await, "UpdateItem")
    }

    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        let user = self.read_user(uaid).await?;
        Ok(match &self.months {
            Some(months) => user.filter(|u| !months.is_stale(u)),
            None => user,
        })
    }

    async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
        let home = self.home(uaid).await?;
        self.client
            .delete_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(uaid)))
            .send()
            .await
            .map_err(|e| backend("DeleteItem", e))?;
        self.remove_message_rows(uaid, &home.reads).await
    }

    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
        let home = self.home(&seen.uaid).await?;
        let delete = self
            .client
            .delete_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(&seen.uaid)))
            .expression_attribute_values(":c", n(seen.connected_at));
        let delete = match &seen.router_data {
            Some(data) => {
                let seen = item::json_equals("router_data", data);
                let mut delete = delete
                    .condition_expression(format!("connected_at = :c AND {}", seen.expression));
                for (name, attribute) in seen.names {
                    delete = delete.expression_attribute_names(name, attribute);
                }
                for (name, value) in seen.values {
                    delete = delete.expression_attribute_values(name, value);
                }
                delete
            }
            None => delete
                .condition_expression("connected_at = :c AND attribute_not_exists(router_data)"),
        };
        if !condition_held(delete.send().await, "DeleteItem")? {
            return Ok(false);
        }
        self.remove_message_rows(&seen.uaid, &home.reads).await?;
        Ok(true)
    }

    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .update_expression("REMOVE node_id")
            .condition_expression("node_id = :n AND connected_at = :c")
            .expression_attribute_values(":n", s(node_id))
            .expression_attribute_values(":c", n(connected_at))
            .send()
            .await;
        condition_held(update, "UpdateItem")
    }

    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool> {
        let update = self
            .update_user(uaid)
            .condition_expression("node_id = :n AND connected_at = :c")
            .expression_attribute_values(":n", s(node_id))
            .expression_attribute_values(":c", n(connected_at));
        let update = match min {
            Urgency::VeryLow => update.update_expression("REMOVE min_urgency"),
            min => update
                .update_expression("SET min_urgency = :u")
                .expression_attribute_values(":u", s(min.as_str())),
        };
        condition_held(update.send().await, "UpdateItem")
    }

    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool> {
        let home = self.home(uaid).await?;
        let chid = channel_id.as_hyphenated().to_string();
        let update = self
            .client
            .update_item()
            .table_name(&home.table)
            .set_key(Some(item::message_key(uaid, CHANNELS_ROW)))
            .update_expression("ADD chids :set")
            .condition_expression(
                "attribute_not_exists(chids) OR contains(chids, :chid) OR size(chids) < :limit",
            )
            .expression_attribute_values(":set", AttributeValue::Ss(vec![chid.clone()]))
            .expression_attribute_values(":chid", s(chid))
            .expression_attribute_values(":limit", n(limit))
            .send()
            .await;
        condition_held(update, "UpdateItem")
    }

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
        let home = self.home(uaid).await?;
        Ok(self
            .chids_in(&home.table, uaid)
            .await?
            .iter()
            .filter_map(|c| Uuid::parse_str(c).ok())
            .collect())
    }

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        Ok(self.get_channels(uaid).await?.contains(channel_id))
    }

    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let home = self.home(uaid).await?;
        let chid = channel_id.as_hyphenated().to_string();
        let update = self
            .client
            .update_item()
            .table_name(&home.table)
            .set_key(Some(item::message_key(uaid, CHANNELS_ROW)))
            .update_expression("DELETE chids :set")
            .condition_expression("contains(chids, :chid)")
            .expression_attribute_values(":set", AttributeValue::Ss(vec![chid.clone()]))
            .expression_attribute_values(":chid", s(chid))
            .send()
            .await;
        let removed = condition_held(update, "UpdateItem")?;
        if removed && self.retention > 0 {
            crate::receipt::after_unsubscribe(self, uaid, channel_id).await;
        }
        Ok(removed)
    }

    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let table = self.home(uaid).await?.table;
        let mut taken = None;
        for message in &messages {
            // A Topic message replaces the stored one unless that is newer;
            // any other never replaces a different message under its key.
            let put = self
                .client
                .put_item()
                .table_name(&table)
                .set_item(Some(item::message_to_item(uaid, message, self.retention)));
            let put = match message.topic {
                // With receipts on, the row it replaces comes back: a
                // pending message there gets its `replaced` receipt, a
                // settled one keeps its own, each in a row of its own.
                Some(_) => put
                    .condition_expression(
                        "attribute_not_exists(sortkey_timestamp) OR sortkey_timestamp <= :ts",
                    )
                    .expression_attribute_values(":ts", n(message.sortkey_timestamp.unwrap_or(0)))
                    .return_values(match self.retention {
                        0 => ReturnValue::None,
                        _ => ReturnValue::AllOld,
                    }),
                None => put
                    .condition_expression("attribute_not_exists(updateid) OR updateid = :v")
                    .expression_attribute_values(":v", s(&message.version)),
            };
            match put.send().await {
                Ok(out) => {
                    let old = out.attributes.as_ref().map(item::stored_from_item);
                    if let Some(Ok(old)) = old
                        && old.version() != message.version
                    {
                        self.keep_receipt(&table, uaid, &message.sort_key(), &old)
                            .await?;
                    }
                }
                Err(e) if is_condition_failed(&e) => {
                    if message.topic.is_none() {
                        taken.get_or_insert_with(|| message.sort_key());
                    }
                }
                Err(e) => return Err(backend("PutItem", e)),
            }
        }
        match taken {
            Some(key) => Err(StorageError::KeyTaken(key)),
            None => Ok(()),
        }
    }

    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
        let home = self.home(uaid).await?;
        let mut messages = Vec::new();
        for table in &home.reads {
            if messages.len() >= limit {
                break;
            }
            let found = home
                .unless_absent(table, self.fetch_from(table, uaid, limit - messages.len()))
                .await?;
            if let Some(months) = &self.months
                && found.is_empty()
                && *table == home.table
                && months.is_behind(table)
            {
                self.move_to_month(uaid, table, &months.month(0)).await?;
            }
            messages.extend(found);
        }
        Ok(messages)
    }

    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
        let mut count = 0;
        let home = self.home(uaid).await?;
        for table in &home.reads {
            if count >= up_to {
                break;
            }
            count += home
                .unless_absent(table, self.count_in(table, uaid, up_to - count))
                .await?;
        }
        Ok(count)
    }

    /// Every write is a billed request: a node holds direct copies back.
    fn node_holds_direct_copies(&self) -> bool {
        true
    }

    /// With receipts on, one `PutItem` of the receipt where no row is; a
    /// row there (a copy written after all) is settled instead.
    async fn settle_unwritten(
        &self,
        uaid: &Uuid,
        message: &Notification,
        state: MessageState,
    ) -> Result<()> {
        if self.retention == 0 {
            return Ok(());
        }
        let table = self.home(uaid).await?.table;
        let sort_key = message.sort_key();
        let receipt = Receipt::new(&message.version, state, now_secs(), self.retention);
        let put = self
            .client
            .put_item()
            .table_name(&table)
            .set_item(Some(item::receipt_to_item(uaid, &sort_key, &receipt)))
            .condition_expression("attribute_not_exists(updateid)")
            .send()
            .await;
        if !condition_held(put, "PutItem")? {
            self.settle_message(uaid, &sort_key, &message.version, state)
                .await?;
        }
        Ok(())
    }

    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool> {
        let home = self.home(uaid).await?;
        for table in &home.reads {
            if home
                .unless_absent(
                    table,
                    self.delete_message_in(table, uaid, sort_key, version, false),
                )
                .await?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        let home = self.home(uaid).await?;
        for table in &home.reads {
            let settle = self.settle_in(table, uaid, sort_key, version, state);
            if home.unless_absent(table, settle).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>> {
        let home = self.home(uaid).await?;
        for table in &home.reads {
            if let Some(row) = home
                .unless_absent(table, self.read_in(table, uaid, sort_key))
                .await?
            {
                return item::stored_from_item(&row).map(Some);
            }
        }
        Ok(None)
    }

    async fn health_check(&self) -> Result<()> {
        let message_table = match &self.months {
            Some(months) => months.month(0),
            None => self.tables.message.clone(),
        };
        let router = self
            .client
            .get_item()
            .table_name(&self.tables.router)
            .set_key(Some(item::user_key(&Uuid::nil())))
            .send();
        let message = self
            .client
            .get_item()
            .table_name(&message_table)
            .set_key(Some(item::message_key(&Uuid::nil(), CHANNELS_ROW)))
            .send();
        let (router, message) = tokio::join!(router, message);
        router.map_err(|e| backend(&format!("GetItem on table {}", self.tables.router), e))?;
        message.map_err(|e| backend(&format!("GetItem on table {message_table}"), e))?;
        Ok(())
    }
}
