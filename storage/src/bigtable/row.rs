//! autopush-rs's Bigtable layout, to and from our types, and the filters
//! that read and condition on it.
//!
//! One table. Row `{uaid}` (UAID as 32 hex digits) holds the user in the
//! router family: `connected_at`, `router_type`, `record_version` (1),
//! `version` (16 random bytes, renewed on every change so an autopush-rs
//! node holding the old one loses its conditional write), `router_data`
//! (JSON), `node_id`, `current_timestamp` (how far autopush-rs has read the
//! timestamp messages), and one empty cell `chid:{channel id, hyphenated}`
//! per subscribed channel. Integers are 8 bytes big-endian, text UTF-8.
//! Router cells carry the time now + 60 days as their timestamp.
//!
//! Row `{uaid}#{sort key}` is one stored message (`01:{chid}:{topic}` in the
//! message_topic family, `02:{sortkey_timestamp}:{chid}` in the message
//! family) with `ttl`, `timestamp`, `version`, `data` and `headers` (JSON);
//! every cell's timestamp is the message's expiry, which the families' GC
//! (`maxage=1s`) eventually deletes, so reads skip expired cells.
//!
//! autopush-rs's `get_user` reads every router cell of the user row and
//! takes each one it does not know for a channel (`chid:{uuid}`), failing
//! the whole read otherwise: the router family holds only the cells above.
//! What we keep of a user beside them, `last_connect`, `over_msg_limit`,
//! `min_urgency` (the user agent's minimum urgency as the `Urgency` header
//! spells it; absent for `very-low`), the wake route (`wake_route`, JSON)
//! and when the last wake-up went out (`last_wake`), is in the user row's
//! *message* family ([`OWN_USER_CELLS`]): autopush-rs reads that row only
//! through its router family and message families only in rows
//! `{uaid}#...`, and its `remove_user` deletes the whole row, these cells
//! with it. They are stamped like router cells (now + 60 days), and that
//! family's GC (`maxage=1s`) deletes each 60 days after its last write, so
//! each is written again whenever the user is kept alive, and none
//! outlives it: a hello writes the connection's cells, `min_urgency` as
//! read, and the wake route and last wake-up as read while unchanged
//! ([`wake_cells_are`]); a touch (a long connection's periodic refresh, a
//! bridged app listing its channels) reads them all and writes them again
//! on their being unchanged ([`own_cells_unchanged`]). Older versions of
//! ours wrote them in the router family; every connection deletes those,
//! and `autopush db move-legacy-cells` moves them ([`super::legacy`]).
//!
//! Message cells autopush-rs does not know and ignores (its
//! `row_to_notification` takes the cells it knows and drops the rest):
//! `sortkey_timestamp` (topic messages: which of two is newer), `urgency`
//! and `durable`.
//!
//! Receipts (a receipt retention window set) add cells of our own to a
//! message row, in its family, stamped with when they go:
//! * a pending message also holds `receipt_hold`, JSON
//!   `{"version", "ttl", "timestamp"}` stamped TTL + retention: its
//!   `expired` receipt after the message's own cells are gone;
//! * a settled message's row holds only `version`, `settled` (the final
//!   state's name) and `settled_at` (unix seconds, 8 bytes big-endian),
//!   stamped `settled_at` + retention: the one `CheckAndMutateRow` that
//!   settles it deletes the message's cells.
//!
//! autopush-rs reads a message row's cells stamped now or later and
//! requires `version`, `ttl` and `timestamp` (`take_required_cell`): a
//! receipt row, or a held row past its TTL, fails its whole fetch for that
//! user. Receipts must be off (`--receipt-retention 0`) while autopush-rs
//! shares the table.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use autopush_common::{
    Notification, RouterType, User, WakeRoute, notification::Urgency, time::now_secs,
};
use googleapis_tonic_google_bigtable_v2::google::bigtable::v2::{
    self as pb, RowFilter, column_range, mutation, row_filter, value_range,
};
use uuid::Uuid;

use crate::{Receipt, Result, StorageError, StoredMessage};
use autopush_common::receipt::MessageState;

/// How far ahead router cells are stamped, as autopush-rs does
/// (`MAX_ROUTER_TTL_SECS`).
pub const ROUTER_TTL: Duration = Duration::from_secs(60 * 86_400);
/// autopush-rs's `USER_RECORD_VERSION`.
const RECORD_VERSION: u64 = 1;
/// Digits of the sort-key timestamp in a row key: microseconds have 16
/// until the year 2286, so real keys read as autopush-rs writes them
/// (unpadded) and small test values still sort by number.
const SORTKEY_DIGITS: usize = 16;
/// The channel-set cells' qualifier prefix, and the first qualifier after
/// them (`:` + 1).
const CHID_PREFIX: &str = "chid:";
const AFTER_CHIDS: &[u8] = b"chid;";

/// The family names (autopush-rs's defaults: router, message, message_topic).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Families {
    pub router: String,
    pub message: String,
    pub message_topic: String,
}

impl Default for Families {
    fn default() -> Self {
        Families {
            router: "router".into(),
            message: "message".into(),
            message_topic: "message_topic".into(),
        }
    }
}

fn corrupt(what: impl std::fmt::Display) -> StorageError {
    StorageError::Corrupt(what.to_string())
}

pub fn user_key(uaid: &Uuid) -> Vec<u8> {
    uaid.simple().to_string().into_bytes()
}

/// Where `uaid`'s message rows start (`{uaid}#`) and end (`{uaid}$`).
pub fn message_rows(uaid: &Uuid) -> (Vec<u8>, Vec<u8>) {
    let uaid = uaid.simple();
    (
        format!("{uaid}#").into_bytes(),
        format!("{uaid}$").into_bytes(),
    )
}

/// The row key of the message our sort key `sort_key` names.
pub fn message_key(uaid: &Uuid, sort_key: &str) -> Vec<u8> {
    let key = match split_timestamp_key(sort_key) {
        Some((ts, chid)) => format!("02:{ts:0SORTKEY_DIGITS$}:{chid}"),
        None => sort_key.to_owned(),
    };
    format!("{}#{key}", uaid.simple()).into_bytes()
}

/// The row key autopush-rs gives the same message when it differs from
/// [`message_key`]: its millisecond timestamps are not padded.
pub fn unpadded_message_key(uaid: &Uuid, sort_key: &str) -> Option<Vec<u8>> {
    let (ts, chid) = split_timestamp_key(sort_key)?;
    let unpadded = format!("{}#02:{ts}:{chid}", uaid.simple()).into_bytes();
    (unpadded != message_key(uaid, sort_key)).then_some(unpadded)
}

/// The row keys the message `sort_key` names may be under: ours, then
/// autopush-rs's spelling when it differs.
pub fn message_keys(uaid: &Uuid, sort_key: &str) -> impl Iterator<Item = Vec<u8>> {
    std::iter::once(message_key(uaid, sort_key)).chain(unpadded_message_key(uaid, sort_key))
}

fn split_timestamp_key(sort_key: &str) -> Option<(u64, &str)> {
    let (ts, chid) = sort_key.strip_prefix("02:")?.split_once(':')?;
    Some((ts.parse().ok()?, chid))
}

/// Where the timestamp messages start: after those autopush-rs has already
/// delivered (`current_timestamp`, as its own reads start), else at `02:`.
pub fn timestamp_messages_start(uaid: &Uuid, current_timestamp: Option<u64>) -> Vec<u8> {
    match current_timestamp {
        Some(ts) => format!("{}#02:{ts}z", uaid.simple()).into_bytes(),
        None => format!("{}#02:", uaid.simple()).into_bytes(),
    }
}

pub fn topic_messages(uaid: &Uuid) -> (Vec<u8>, Vec<u8>) {
    let uaid = uaid.simple();
    (
        format!("{uaid}#01:").into_bytes(),
        format!("{uaid}#02:").into_bytes(),
    )
}

pub fn timestamp_messages_end(uaid: &Uuid) -> Vec<u8> {
    format!("{}#03:", uaid.simple()).into_bytes()
}

/// A Bigtable timestamp: microseconds, at the millisecond granularity
/// tables are created with.
fn micros(secs: u64) -> i64 {
    i64::try_from(secs.saturating_mul(1_000_000)).unwrap_or(i64::MAX)
}

/// The stamp of a user row's cells written at `now` (unix seconds):
/// `now` + [`ROUTER_TTL`], as autopush-rs stamps its router cells.
pub fn router_stamp(now: u64) -> i64 {
    micros(now.saturating_add(ROUTER_TTL.as_secs()))
}

// ---- mutations ------------------------------------------------------------

fn set(family: &str, qualifier: &[u8], value: Vec<u8>, timestamp_micros: i64) -> pb::Mutation {
    pb::Mutation {
        mutation: Some(mutation::Mutation::SetCell(mutation::SetCell {
            family_name: family.to_owned(),
            column_qualifier: qualifier.to_vec(),
            timestamp_micros,
            value,
        })),
    }
}

pub fn delete_column(family: &str, qualifier: &[u8]) -> pb::Mutation {
    pb::Mutation {
        mutation: Some(mutation::Mutation::DeleteFromColumn(
            mutation::DeleteFromColumn {
                family_name: family.to_owned(),
                column_qualifier: qualifier.to_vec(),
                time_range: None,
            },
        )),
    }
}

pub fn delete_row() -> pb::Mutation {
    pb::Mutation {
        mutation: Some(mutation::Mutation::DeleteFromRow(
            mutation::DeleteFromRow {},
        )),
    }
}

/// Replace a column of the user row with `value`, or remove it when `None`: the old
/// cells go first, so the new value is the one read whatever timestamp a
/// node with a skewed clock gave them.
fn replace(family: &str, qualifier: &str, value: Option<Vec<u8>>, stamp: i64) -> Vec<pb::Mutation> {
    let mut mutations = vec![delete_column(family, qualifier.as_bytes())];
    if let Some(value) = value {
        mutations.push(set(family, qualifier.as_bytes(), value, stamp));
    }
    mutations
}

/// A fresh `version`, so autopush-rs's own conditional writes on the
/// version it read fail after our change.
pub fn new_version(families: &Families, stamp: i64) -> Vec<pb::Mutation> {
    replace(
        &families.router,
        "version",
        Some(Uuid::new_v4().as_bytes().to_vec()),
        stamp,
    )
}

/// Every router column of `user` (channels and `current_timestamp` are
/// left as they are), and our cells of it; `stamp` is
/// [`router_stamp`] of now.
pub fn user_mutations(families: &Families, user: &User, stamp: i64) -> Vec<pb::Mutation> {
    let f = &families.router;
    let mut m = Vec::new();
    m.extend(replace(
        f,
        "connected_at",
        Some(user.connected_at.to_be_bytes().to_vec()),
        stamp,
    ));
    m.extend(replace(
        f,
        "router_type",
        Some(user.router_type.as_str().as_bytes().to_vec()),
        stamp,
    ));
    m.extend(replace(
        f,
        "record_version",
        Some(RECORD_VERSION.to_be_bytes().to_vec()),
        stamp,
    ));
    m.extend(replace(
        f,
        "router_data",
        user.router_data.as_ref().map(json_bytes),
        stamp,
    ));
    m.extend(connection_mutations(families, user, stamp));
    m.extend(wake_cells_mutations(families, user, stamp));
    m.extend(new_version(families, stamp));
    m
}

/// The user row's cells of ours, kept in its message family where
/// autopush-rs does not look (see the module's notes).
pub const OWN_USER_CELLS: [&str; 5] = [
    "last_connect",
    "over_msg_limit",
    "min_urgency",
    "wake_route",
    "last_wake",
];

/// What a connection changes: `node_id`, `connected_at`, `last_connect`,
/// `over_msg_limit`; and `min_urgency`, written again as read so that its
/// stamp moves on with the others.
pub fn connection_mutations(families: &Families, user: &User, stamp: i64) -> Vec<pb::Mutation> {
    let f = &families.router;
    let mut m = Vec::new();
    m.extend(replace(
        f,
        "node_id",
        user.node_id.as_ref().map(|n| n.as_bytes().to_vec()),
        stamp,
    ));
    m.extend(replace(
        f,
        "connected_at",
        Some(user.connected_at.to_be_bytes().to_vec()),
        stamp,
    ));
    m.extend(last_connect_mutations(families, user.last_connect, stamp));
    m.extend(replace(
        &families.message,
        "over_msg_limit",
        user.over_msg_limit.then(|| vec![1]),
        stamp,
    ));
    m.extend(min_urgency_mutations(families, user.min_urgency, stamp));
    m
}

/// Sets `min_urgency`, or removes it for `very-low`.
pub fn min_urgency_mutations(families: &Families, min: Urgency, stamp: i64) -> Vec<pb::Mutation> {
    let value = (min != Urgency::VeryLow).then(|| min.as_str().as_bytes().to_vec());
    replace(&families.message, "min_urgency", value, stamp)
}

/// Matches while our cell `qualifier` of the user row holds `value`
/// (`None`: while it has none).
fn own_cell_is(families: &Families, qualifier: &str, value: Option<&[u8]>) -> RowFilter {
    match value {
        Some(value) => column_is(&families.message, qualifier, value),
        None => absent(column(&families.message, qualifier.as_bytes())),
    }
}

/// Matches while the user row holds `min` as its minimum urgency.
pub fn min_urgency_is(families: &Families, min: Urgency) -> RowFilter {
    let value = (min != Urgency::VeryLow).then(|| min.as_str().as_bytes());
    own_cell_is(families, "min_urgency", value)
}

/// Matches while the user row holds `user`'s wake route and last
/// wake-up (none for 0).
pub fn wake_cells_are(families: &Families, user: &User) -> RowFilter {
    let route = user.wake_route.as_ref().map(|r| r.to_json().into_bytes());
    let last_wake = (user.last_wake > 0).then(|| user.last_wake.to_be_bytes());
    and(
        own_cell_is(families, "wake_route", route.as_deref()),
        own_cell_is(families, "last_wake", last_wake.as_ref().map(|v| &v[..])),
    )
}

/// `user`'s wake route and last wake-up, written again.
pub fn wake_cells_mutations(families: &Families, user: &User, stamp: i64) -> Vec<pb::Mutation> {
    let mut m = wake_route_mutations(families, user.wake_route.as_ref(), stamp);
    m.extend(last_wake_mutations(
        families,
        (user.last_wake > 0).then_some(user.last_wake),
        stamp,
    ));
    m
}

/// Sets (or removes) the user's wake route, JSON in [`OWN_USER_CELLS`].
pub fn wake_route_mutations(
    families: &Families,
    route: Option<&WakeRoute>,
    stamp: i64,
) -> Vec<pb::Mutation> {
    let value = route.map(|r| r.to_json().into_bytes());
    replace(&families.message, "wake_route", value, stamp)
}

/// Sets (or removes) when the last wake-up went out, in [`OWN_USER_CELLS`].
pub fn last_wake_mutations(
    families: &Families,
    last_wake: Option<u64>,
    stamp: i64,
) -> Vec<pb::Mutation> {
    let value = last_wake.map(|ms| ms.to_be_bytes().to_vec());
    replace(&families.message, "last_wake", value, stamp)
}

/// Sets `last_connect`, and removes the router cells of ours older
/// versions wrote, which autopush-rs cannot read.
pub fn last_connect_mutations(
    families: &Families,
    last_connect: u64,
    stamp: i64,
) -> Vec<pb::Mutation> {
    let mut m: Vec<_> = OWN_USER_CELLS
        .iter()
        .map(|q| delete_column(&families.router, q.as_bytes()))
        .collect();
    m.extend(replace(
        &families.message,
        "last_connect",
        Some(last_connect.to_be_bytes().to_vec()),
        stamp,
    ));
    m
}

/// Whether user row `row` (read with [`own_cells`]) still holds a
/// router cell of ours, which autopush-rs cannot read.
pub fn has_legacy_cells(families: &Families, row: &Row) -> bool {
    OWN_USER_CELLS
        .iter()
        .any(|q| row.get(&families.router, q).is_some())
}

/// The cells [`own_cells_rewritten`] needs of a user row: `connected_at`
/// (valueless: a user row) and our cells in both families, newest only.
pub fn own_cells(families: &Families) -> RowFilter {
    let ours = |f| chain(vec![family(f), qualifiers(&OWN_USER_CELLS), latest()]);
    interleave(vec![
        chain(vec![
            column(&families.router, b"connected_at"),
            strip_values(),
        ]),
        ours(&families.router),
        ours(&families.message),
    ])
}

/// Matches while our cells of the user, in both families, are what `row`
/// read: the same value at the same timestamp, or still absent. Any
/// connection since (ours rewrites them, an older build of ours stamps its
/// router copies anew), any other write of one of them, or a removal
/// fails it.
pub fn own_cells_unchanged(families: &Families, row: &Row) -> RowFilter {
    let mut conditions = Vec::new();
    for f in [&families.router, &families.message] {
        for q in OWN_USER_CELLS {
            let column = || column(f, q.as_bytes());
            conditions.push(match row.get_stamped(f, q) {
                Some((value, stamp)) => {
                    chain(vec![column(), value_is(value), stamped_in_ms_of(stamp)])
                }
                None => absent(column()),
            });
        }
    }
    let last = conditions.pop().unwrap_or_else(pass_all);
    conditions.into_iter().rfold(last, |all, c| and(c, all))
}

/// Our cells of user row `row` (read with [`own_cells`]) written again,
/// at `stamp`, in the message family, where this build reads them: the
/// message family's GC (`maxage`) takes each one its stamp after its last
/// write, so they are written again while the user lives. A router copy
/// an older build wrote goes; its value is kept unless the message family
/// has one (which this build reads first), except a later `last_connect`.
pub fn own_cells_rewritten(families: &Families, row: &Row, stamp: i64) -> Vec<pb::Mutation> {
    let mut m = Vec::new();
    for q in OWN_USER_CELLS {
        let old = row.get(&families.router, q);
        if old.is_some() {
            m.push(delete_column(&families.router, q.as_bytes()));
        }
        let value = match (old, row.get(&families.message, q)) {
            (Some(old), Some(current)) if q == "last_connect" && later(old, current) => old,
            (_, Some(current)) => current,
            (Some(old), None) => old,
            (None, None) => continue,
        };
        m.extend(replace(&families.message, q, Some(value.to_vec()), stamp));
    }
    m
}

/// `a` is a larger 8-byte big-endian integer than `b` (`false` when either
/// is not one).
fn later(a: &[u8], b: &[u8]) -> bool {
    match (<[u8; 8]>::try_from(a), <[u8; 8]>::try_from(b)) {
        (Ok(a), Ok(b)) => u64::from_be_bytes(a) > u64::from_be_bytes(b),
        _ => false,
    }
}

pub fn router_data_mutations(
    families: &Families,
    data: &serde_json::Value,
    stamp: i64,
) -> Vec<pb::Mutation> {
    let mut m = replace(
        &families.router,
        "router_data",
        Some(json_bytes(data)),
        stamp,
    );
    m.extend(new_version(families, stamp));
    m
}

/// `router_data` as stored (and compared): compact JSON with its keys
/// sorted, as autopush-rs's serde_json writes it.
pub fn json_bytes(value: &serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

pub fn chid_qualifier(channel_id: &Uuid) -> Vec<u8> {
    format!("{CHID_PREFIX}{}", channel_id.as_hyphenated()).into_bytes()
}

pub fn add_channel_mutation(families: &Families, channel_id: &Uuid, stamp: i64) -> pb::Mutation {
    set(
        &families.router,
        &chid_qualifier(channel_id),
        Vec::new(),
        stamp,
    )
}

pub fn message_family<'a>(families: &'a Families, sort_key: &str) -> &'a str {
    match sort_key.starts_with("01:") {
        true => &families.message_topic,
        false => &families.message,
    }
}

/// The cells of `message`, replacing whatever its row held; with receipts
/// on (`retention` seconds) also its `receipt_hold`.
pub fn message_mutations(
    families: &Families,
    message: &Notification,
    retention: u64,
) -> Vec<pb::Mutation> {
    let family = match message.topic {
        Some(_) => &families.message_topic,
        None => &families.message,
    };
    let expiry = micros(message.expiry());
    let cell = |name: &str, value: Vec<u8>| set(family, name.as_bytes(), value, expiry);
    let mut m = vec![
        delete_row(),
        cell("ttl", message.ttl.to_be_bytes().to_vec()),
        cell("timestamp", message.timestamp.to_be_bytes().to_vec()),
        cell("version", message.version.as_bytes().to_vec()),
    ];
    if let Some(data) = &message.data {
        m.push(cell("data", data.as_bytes().to_vec()));
    }
    if let Some(headers) = message.headers.as_ref().filter(|h| !h.is_empty()) {
        let json = serde_json::to_vec(headers).unwrap_or_default();
        m.push(cell("headers", json));
    }
    if let (Some(_), Some(ts)) = (&message.topic, message.sortkey_timestamp) {
        m.push(cell("sortkey_timestamp", ts.to_be_bytes().to_vec()));
    }
    if let Some(urgency) = message.urgency {
        let name = serde_json::to_value(urgency)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        m.push(cell("urgency", name.into_bytes()));
    }
    if message.durable {
        m.push(cell("durable", vec![1]));
    }
    if retention > 0 {
        let hold = Hold {
            version: message.version.clone(),
            ttl: message.ttl,
            timestamp: message.timestamp,
        };
        let kept_until = micros(message.expiry().saturating_add(retention));
        let json = serde_json::to_vec(&hold).unwrap_or_default();
        m.push(set(family, HOLD.as_bytes(), json, kept_until));
    }
    m
}

/// What a pending message's `receipt_hold` keeps of it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hold {
    version: String,
    ttl: u64,
    timestamp: u64,
}

const HOLD: &str = "receipt_hold";
const SETTLED: &str = "settled";
const SETTLED_AT: &str = "settled_at";

/// Turn a message's row (in `family`) into `receipt`, kept until its
/// expiry.
pub fn receipt_mutations(family: &str, receipt: &Receipt) -> Vec<pb::Mutation> {
    let until = micros(receipt.expiry);
    vec![
        delete_row(),
        set(
            family,
            b"version",
            receipt.version.as_bytes().to_vec(),
            until,
        ),
        set(
            family,
            SETTLED.as_bytes(),
            receipt.state.as_str().as_bytes().to_vec(),
            until,
        ),
        set(
            family,
            SETTLED_AT.as_bytes(),
            receipt.updated.to_be_bytes().to_vec(),
            until,
        ),
    ]
}

/// Yields cells when the row is a receipt.
pub fn settled(family: &str) -> RowFilter {
    column(family, SETTLED.as_bytes())
}

// ---- filters --------------------------------------------------------------

fn filter(f: row_filter::Filter) -> RowFilter {
    RowFilter { filter: Some(f) }
}

pub fn chain(filters: Vec<RowFilter>) -> RowFilter {
    filter(row_filter::Filter::Chain(row_filter::Chain { filters }))
}

pub fn interleave(filters: Vec<RowFilter>) -> RowFilter {
    filter(row_filter::Filter::Interleave(row_filter::Interleave {
        filters,
    }))
}

/// Cells of `when_true` if `predicate` yields any cell, else of `otherwise`.
pub fn condition(predicate: RowFilter, when_true: RowFilter, otherwise: RowFilter) -> RowFilter {
    filter(row_filter::Filter::Condition(Box::new(
        row_filter::Condition {
            predicate_filter: Some(Box::new(predicate)),
            true_filter: Some(Box::new(when_true)),
            false_filter: Some(Box::new(otherwise)),
        },
    )))
}

/// Yields cells only if both `a` and `b` do (the cells of `b`).
pub fn and(a: RowFilter, b: RowFilter) -> RowFilter {
    condition(a, b, block_all())
}

/// Yields cells only if `a` yields none and the row is not empty.
pub fn absent(a: RowFilter) -> RowFilter {
    condition(a, block_all(), pass_all())
}

pub fn block_all() -> RowFilter {
    filter(row_filter::Filter::BlockAllFilter(true))
}

pub fn pass_all() -> RowFilter {
    filter(row_filter::Filter::PassAllFilter(true))
}

pub fn strip_values() -> RowFilter {
    filter(row_filter::Filter::StripValueTransformer(true))
}

/// The newest cell of each column (router family GC: `maxversions=1`).
pub fn latest() -> RowFilter {
    filter(row_filter::Filter::CellsPerColumnLimitFilter(1))
}

pub fn first_cell() -> RowFilter {
    filter(row_filter::Filter::CellsPerRowLimitFilter(1))
}

/// Cells after the first `n` of the row.
pub fn skip_cells(n: usize) -> RowFilter {
    filter(row_filter::Filter::CellsPerRowOffsetFilter(
        i32::try_from(n).unwrap_or(i32::MAX),
    ))
}

pub fn family(name: &str) -> RowFilter {
    filter(row_filter::Filter::FamilyNameRegexFilter(format!(
        "^{}$",
        regex_escape(name)
    )))
}

/// The newest cell of one column.
pub fn column(family: &str, qualifier: &[u8]) -> RowFilter {
    chain(vec![
        filter(row_filter::Filter::ColumnRangeFilter(pb::ColumnRange {
            family_name: family.to_owned(),
            start_qualifier: Some(column_range::StartQualifier::StartQualifierClosed(
                qualifier.to_vec(),
            )),
            end_qualifier: Some(column_range::EndQualifier::EndQualifierClosed(
                qualifier.to_vec(),
            )),
        })),
        latest(),
    ])
}

/// The newest cell of every `chid:` column.
pub fn channels(families: &Families) -> RowFilter {
    chain(vec![
        filter(row_filter::Filter::ColumnRangeFilter(pb::ColumnRange {
            family_name: families.router.clone(),
            start_qualifier: Some(column_range::StartQualifier::StartQualifierClosed(
                CHID_PREFIX.as_bytes().to_vec(),
            )),
            end_qualifier: Some(column_range::EndQualifier::EndQualifierOpen(
                AFTER_CHIDS.to_vec(),
            )),
        })),
        latest(),
    ])
}

/// The newest cell of every router column but the channel set (a user
/// may have thousands of channels: reading it has no use), and of our own
/// cells of the user in its message family.
pub fn user_columns(families: &Families) -> RowFilter {
    let range = |start, end| {
        filter(row_filter::Filter::ColumnRangeFilter(pb::ColumnRange {
            family_name: families.router.clone(),
            start_qualifier: start,
            end_qualifier: end,
        }))
    };
    chain(vec![
        interleave(vec![
            range(
                None,
                Some(column_range::EndQualifier::EndQualifierOpen(
                    CHID_PREFIX.as_bytes().to_vec(),
                )),
            ),
            range(
                Some(column_range::StartQualifier::StartQualifierClosed(
                    AFTER_CHIDS.to_vec(),
                )),
                None,
            ),
            chain(vec![family(&families.message), qualifiers(&OWN_USER_CELLS)]),
        ]),
        latest(),
    ])
}

/// Cells whose value is exactly `value`.
pub fn value_is(value: &[u8]) -> RowFilter {
    filter(row_filter::Filter::ValueRangeFilter(pb::ValueRange {
        start_value: Some(value_range::StartValue::StartValueClosed(value.to_vec())),
        end_value: Some(value_range::EndValue::EndValueClosed(value.to_vec())),
    }))
}

/// Cells whose value sorts after `value` (for big-endian integers: larger).
pub fn value_above(value: &[u8]) -> RowFilter {
    filter(row_filter::Filter::ValueRangeFilter(pb::ValueRange {
        start_value: Some(value_range::StartValue::StartValueOpen(value.to_vec())),
        end_value: None,
    }))
}

/// The column `qualifier` holds exactly `value`.
pub fn column_is(family: &str, qualifier: &str, value: &[u8]) -> RowFilter {
    chain(vec![column(family, qualifier.as_bytes()), value_is(value)])
}

/// The cells `cells` keeps of a pending, unexpired message in `family`;
/// none of a receipt, or of a message past its TTL kept for its receipt.
pub fn pending(family: &str, cells: RowFilter) -> RowFilter {
    let ttl = chain(vec![column(family, b"ttl"), unexpired()]);
    and(ttl, chain(vec![unexpired(), cells]))
}

/// The cells named `names`, in any family.
pub fn qualifiers(names: &[&str]) -> RowFilter {
    let names = names.iter().map(|n| regex_escape(n)).collect::<Vec<_>>();
    filter(row_filter::Filter::ColumnQualifierRegexFilter(
        format!("^({})$", names.join("|")).into_bytes(),
    ))
}

/// The family of message row `key` (`{uaid}#{sort key}`).
pub fn family_of_key<'a>(families: &'a Families, key: &[u8]) -> &'a str {
    message_family(families, sort_key_of(key))
}

/// The part of message row `key` after `{uaid}#`, as our sort keys spell
/// it for Topic rows (timestamp rows may differ in padding).
pub fn sort_key_of(key: &[u8]) -> &str {
    let sort_key = key.splitn(2, |&b| b == b'#').nth(1).unwrap_or_default();
    std::str::from_utf8(sort_key).unwrap_or_default()
}

/// Message cells not yet expired: a cell's timestamp is its expiry.
pub fn unexpired() -> RowFilter {
    filter(row_filter::Filter::TimestampRangeFilter(
        pb::TimestampRange {
            start_timestamp_micros: micros(now_secs() + 1),
            end_timestamp_micros: 0,
        },
    ))
}

/// Cells stamped within the millisecond of `stamp` (microseconds):
/// Bigtable's granularity.
pub fn stamped_in_ms_of(stamp: i64) -> RowFilter {
    let start = stamp - stamp.rem_euclid(1000);
    filter(row_filter::Filter::TimestampRangeFilter(
        pb::TimestampRange {
            start_timestamp_micros: start,
            end_timestamp_micros: start + 1000,
        },
    ))
}

/// Cells of column `qualifier` in `family` stamped other than at
/// `expiry` (unix seconds), where we stamp a message's cells: a write of
/// the message by someone else (autopush-rs stamps its cells with its
/// clock's now + TTL, in milliseconds).
pub fn stamped_otherwise(family_name: &str, qualifier: &str, expiry: u64) -> RowFilter {
    let ours = micros(expiry);
    let stamps = |start, end| {
        filter(row_filter::Filter::TimestampRangeFilter(
            pb::TimestampRange {
                start_timestamp_micros: start,
                end_timestamp_micros: end,
            },
        ))
    };
    chain(vec![
        family(family_name),
        qualifiers(&[qualifier]),
        // Bigtable's granularity is the millisecond; 0 ends nowhere.
        interleave(vec![stamps(0, ours), stamps(ours + 1000, 0)]),
    ])
}

/// A family name or literal for RE2: everything but letters, digits and
/// `_` escaped.
fn regex_escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() * 2);
    for c in name.chars() {
        if !(c.is_ascii_alphanumeric() || c == '_') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

// ---- rows read back -------------------------------------------------------

/// One row as read: the newest cell of each column.
#[derive(Debug, Default)]
pub struct Row {
    pub key: Vec<u8>,
    pub cells: HashMap<(String, Vec<u8>), Vec<u8>>,
    /// Each of those cells' timestamp (microseconds), for writes
    /// conditional on the very cell that was read.
    pub stamps: HashMap<(String, Vec<u8>), i64>,
}

impl Row {
    pub fn get(&self, family: &str, qualifier: &str) -> Option<&[u8]> {
        self.cells
            .get(&(family.to_owned(), qualifier.as_bytes().to_vec()))
            .map(Vec::as_slice)
    }

    /// The cell `family:qualifier` with its timestamp.
    pub fn get_stamped(&self, family: &str, qualifier: &str) -> Option<(&[u8], i64)> {
        let at = (family.to_owned(), qualifier.as_bytes().to_vec());
        Some((self.cells.get(&at)?.as_slice(), *self.stamps.get(&at)?))
    }

    /// The cell `qualifier` in whichever family holds it.
    pub fn any(&self, qualifier: &str) -> Option<&[u8]> {
        self.cells
            .iter()
            .find(|((_, q), _)| q == qualifier.as_bytes())
            .map(|(_, v)| v.as_slice())
    }
}

fn u64_of(value: &[u8], name: &str) -> Result<u64> {
    let bytes: [u8; 8] = value
        .try_into()
        .map_err(|_| corrupt(format!("{name} is not 8 bytes")))?;
    Ok(u64::from_be_bytes(bytes))
}

fn text_of(value: &[u8], name: &str) -> Result<String> {
    String::from_utf8(value.to_vec()).map_err(|_| corrupt(format!("{name} is not UTF-8")))
}

/// The user in router row `row`; `None` for a row without `connected_at`
/// (only channel cells: autopush-rs counts it as no user, too).
pub fn user_from_row(families: &Families, uaid: &Uuid, row: &Row) -> Result<Option<User>> {
    let f = &families.router;
    let Some(connected_at) = row.get(f, "connected_at") else {
        return Ok(None);
    };
    let connected_at = u64_of(connected_at, "connected_at")?;
    let router_type = match row.get(f, "router_type") {
        Some(v) => text_of(v, "router_type")?,
        None => "webpush".into(),
    };
    let router_type: RouterType = serde_json::from_value(router_type.clone().into())
        .map_err(|_| corrupt(format!("unknown router_type {router_type:?}")))?;
    let router_data = row
        .get(f, "router_data")
        .map(|v| {
            serde_json::from_slice(v).map_err(|_| corrupt("router_data is not JSON".to_string()))
        })
        .transpose()?;
    let node_id = row
        .get(f, "node_id")
        .map(|v| text_of(v, "node_id"))
        .transpose()?;
    // Ours, in the message family; older versions wrote them in router.
    let own = |name| row.get(&families.message, name).or(row.get(f, name));
    let last_connect = match own("last_connect") {
        Some(v) => u64_of(v, "last_connect")?,
        None => connected_at,
    };
    Ok(Some(User {
        uaid: *uaid,
        router_type,
        router_data,
        node_id,
        connected_at,
        last_connect,
        over_msg_limit: own("over_msg_limit").is_some(),
        current_month: None,
        min_urgency: match row.get(&families.message, "min_urgency") {
            Some(v) => {
                let v = text_of(v, "min_urgency")?;
                Urgency::parse(&v).ok_or_else(|| corrupt(format!("unknown min_urgency {v:?}")))?
            }
            None => Urgency::VeryLow,
        },
        wake_route: row
            .get(&families.message, "wake_route")
            .map(|v| {
                let text = text_of(v, "wake_route")?;
                WakeRoute::from_json(&text).ok_or_else(|| corrupt("wake_route is not a route"))
            })
            .transpose()?,
        last_wake: row
            .get(&families.message, "last_wake")
            .map(|v| u64_of(v, "last_wake"))
            .transpose()?
            .unwrap_or(0),
    }))
}

pub fn current_timestamp(families: &Families, row: &Row) -> Result<Option<u64>> {
    row.get(&families.router, "current_timestamp")
        .map(|v| u64_of(v, "current_timestamp"))
        .transpose()
}

pub fn channels_from_row(row: &Row) -> HashSet<Uuid> {
    row.cells
        .keys()
        .filter_map(|(_, q)| std::str::from_utf8(q).ok()?.strip_prefix(CHID_PREFIX))
        .filter_map(|chid| Uuid::parse_str(chid).ok())
        .collect()
}

/// What row `row` holds (every cell as read, expired or not): a receipt;
/// a message, whole or as its `receipt_hold` kept once its cells are gone;
/// `None` when neither. `retention` dates a receipt's expiry.
pub fn stored_from_row(row: &Row, retention: u64) -> Result<Option<StoredMessage>> {
    if let Some(state) = row.any(SETTLED) {
        let state = text_of(state, SETTLED)?;
        let state = MessageState::parse(&state)
            .ok_or_else(|| corrupt(format!("unknown receipt state {state:?}")))?;
        let version = row
            .any("version")
            .ok_or_else(|| corrupt("receipt without version"))?;
        let updated = match row.any(SETTLED_AT) {
            Some(v) => u64_of(v, SETTLED_AT)?,
            None => 0,
        };
        return Ok(Some(StoredMessage::Settled(Receipt {
            state,
            version: text_of(version, "version")?,
            updated,
            expiry: updated.saturating_add(retention),
        })));
    }
    if row.any("ttl").is_some() {
        return message_from_row(row).map(|m| Some(StoredMessage::Pending(m)));
    }
    let Some(hold) = row.any(HOLD) else {
        return Ok(None);
    };
    let hold: Hold =
        serde_json::from_slice(hold).map_err(|_| corrupt(format!("{HOLD} is not JSON")))?;
    let mut held = Row {
        key: row.key.clone(),
        ..Row::default()
    };
    let family = String::new();
    for (name, value) in [
        ("version", hold.version.into_bytes()),
        ("ttl", hold.ttl.to_be_bytes().to_vec()),
        ("timestamp", hold.timestamp.to_be_bytes().to_vec()),
    ] {
        held.cells
            .insert((family.clone(), name.as_bytes().to_vec()), value);
    }
    message_from_row(&held).map(|m| Some(StoredMessage::Pending(m)))
}

/// The message in row `row` (its key `{uaid}#{sort key}`).
pub fn message_from_row(row: &Row) -> Result<Notification> {
    let key = std::str::from_utf8(&row.key).map_err(|_| corrupt("message key is not UTF-8"))?;
    let sort_key = key
        .split_once('#')
        .map(|(_, k)| k)
        .ok_or_else(|| corrupt(format!("message key {key:?} without '#'")))?;
    let (channel_id, topic, key_ts) = if let Some(rest) = sort_key.strip_prefix("01:") {
        let (chid, topic) = rest
            .split_once(':')
            .ok_or_else(|| corrupt(format!("topic key {sort_key:?}")))?;
        (chid, Some(topic.to_owned()), None)
    } else {
        let (ts, chid) = split_timestamp_key(sort_key)
            .ok_or_else(|| corrupt(format!("unknown sort key {sort_key:?}")))?;
        (chid, None, Some(ts))
    };
    let channel_id =
        Uuid::parse_str(channel_id).map_err(|_| corrupt(format!("channel in {sort_key:?}")))?;
    let required = |name: &str| {
        row.any(name)
            .ok_or_else(|| corrupt(format!("message {sort_key:?} without {name}")))
    };
    let headers = row
        .any("headers")
        .map(|v| {
            serde_json::from_slice::<BTreeMap<String, String>>(v)
                .map_err(|_| corrupt(format!("message {sort_key:?}: headers are not JSON")))
        })
        .transpose()?;
    Ok(Notification {
        channel_id,
        version: text_of(required("version")?, "version")?,
        ttl: u64_of(required("ttl")?, "ttl")?,
        timestamp: u64_of(required("timestamp")?, "timestamp")?,
        topic,
        sortkey_timestamp: match row.any("sortkey_timestamp") {
            Some(v) => Some(u64_of(v, "sortkey_timestamp")?),
            None => key_ts,
        },
        data: row.any("data").map(|v| text_of(v, "data")).transpose()?,
        headers,
        urgency: row
            .any("urgency")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(Urgency::parse),
        durable: row.any("durable").is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_keys_are_autopush_rs_keys() {
        let uaid = Uuid::parse_str("c7d4b1e2a9f84a0b8c1d2e3f4a5b6c7d").unwrap();
        let chid = Uuid::parse_str("0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap();
        let ours =
            autopush_common::notification::sort_key(&chid, None, Some(1_764_000_000_000_123));
        assert_eq!(
            message_key(&uaid, &ours),
            b"c7d4b1e2a9f84a0b8c1d2e3f4a5b6c7d#02:1764000000000123:0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
        );
        assert_eq!(unpadded_message_key(&uaid, &ours), None);
        // autopush-rs's millisecond keys are found under their own spelling.
        let theirs = autopush_common::notification::sort_key(&chid, None, Some(1_764_000_000_000));
        assert_eq!(
            unpadded_message_key(&uaid, &theirs).unwrap(),
            b"c7d4b1e2a9f84a0b8c1d2e3f4a5b6c7d#02:1764000000000:0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
        );
        let topic = autopush_common::notification::sort_key(&chid, Some("news"), None);
        assert_eq!(
            message_key(&uaid, &topic),
            b"c7d4b1e2a9f84a0b8c1d2e3f4a5b6c7d#01:0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:news"
        );
    }

    fn set_cells(mutations: Vec<pb::Mutation>, key: Vec<u8>, only: Option<&str>) -> Row {
        let mut row = Row {
            key,
            ..Row::default()
        };
        for m in mutations {
            if let Some(mutation::Mutation::SetCell(c)) = m.mutation
                && only.is_none_or(|q| c.column_qualifier == q.as_bytes())
            {
                row.cells
                    .insert((c.family_name, c.column_qualifier), c.value);
            }
        }
        row
    }

    /// Once a pending message's own cells are gone (its TTL ran out and GC
    /// took them), its `receipt_hold` still reads as the message, for its
    /// `expired` receipt; a receipt row reads as the receipt.
    #[test]
    fn held_and_settled_rows_read_back() {
        let families = Families::default();
        let message = Notification {
            channel_id: Uuid::new_v4(),
            version: "v1".into(),
            ttl: 60,
            timestamp: 1_764_000_000,
            topic: None,
            sortkey_timestamp: Some(7),
            data: Some("payload".into()),
            headers: None,
            urgency: None,
            durable: false,
        };
        let key = message_key(&Uuid::new_v4(), &message.sort_key());
        let written = |retention| message_mutations(&families, &message, retention);
        let held = set_cells(written(3600), key.clone(), Some(HOLD));
        let Some(StoredMessage::Pending(read)) = stored_from_row(&held, 3600).unwrap() else {
            panic!("the held row is not the pending message");
        };
        assert_eq!(
            (
                read.version.as_str(),
                read.ttl,
                read.timestamp,
                read.data.as_deref()
            ),
            ("v1", 60, 1_764_000_000, None)
        );
        assert_eq!(read.sort_key(), message.sort_key());
        // Receipts off: no hold, the row is autopush-rs's.
        assert!(
            set_cells(written(0), key.clone(), Some(HOLD))
                .cells
                .is_empty()
        );

        let receipt = Receipt::new("v1", MessageState::Delivered, 1_764_000_100, 3600);
        let settled = set_cells(receipt_mutations(&families.message, &receipt), key, None);
        assert_eq!(
            stored_from_row(&settled, 3600).unwrap(),
            Some(StoredMessage::Settled(receipt))
        );
    }

    /// A router copy moves unless the message family has one, which this
    /// build reads first; a later `last_connect` wins either way. Every
    /// cell of ours is written again, stamped anew.
    #[test]
    fn own_cells_are_moved_to_the_message_family_and_stamped_anew() {
        let families = Families::default();
        let at = |family: &str, q: &str| (family.to_owned(), q.as_bytes().to_vec());
        let stamp = router_stamp(1_764_000_000);
        let mut row = Row::default();
        row.cells
            .insert(at("router", "last_connect"), 7u64.to_be_bytes().to_vec());
        row.cells.insert(at("router", "over_msg_limit"), vec![1]);
        let rewritten = |row: &Row| {
            let m = own_cells_rewritten(&families, row, stamp);
            let deleted = m
                .iter()
                .filter(|m| matches!(&m.mutation, Some(mutation::Mutation::DeleteFromColumn(d)) if d.family_name == "router"))
                .count();
            let stamps: HashSet<_> = m
                .iter()
                .filter_map(|m| match &m.mutation {
                    Some(mutation::Mutation::SetCell(c)) => Some(c.timestamp_micros),
                    _ => None,
                })
                .collect();
            (deleted, stamps, set_cells(m, Vec::new(), None).cells)
        };
        let (deleted, stamps, set) = rewritten(&row);
        assert_eq!((deleted, stamps), (2, HashSet::from([stamp])));
        assert_eq!(set[&at("message", "last_connect")], 7u64.to_be_bytes());
        assert_eq!(set[&at("message", "over_msg_limit")], [1]);
        assert!(!set.keys().any(|(f, _)| f == "router"));

        row.cells
            .insert(at("message", "last_connect"), 5u64.to_be_bytes().to_vec());
        row.cells.insert(at("message", "over_msg_limit"), vec![1]);
        row.cells
            .insert(at("message", "wake_route"), b"{\"route\"}".to_vec());
        let (_, _, set) = rewritten(&row);
        assert_eq!(set[&at("message", "last_connect")], 7u64.to_be_bytes());
        assert_eq!(set[&at("message", "wake_route")], b"{\"route\"}");
        row.cells
            .insert(at("message", "last_connect"), 9u64.to_be_bytes().to_vec());
        row.cells.retain(|(f, _), _| f == "message");
        let (deleted, stamps, set) = rewritten(&row);
        assert_eq!((deleted, stamps), (0, HashSet::from([stamp])));
        assert_eq!(set, row.cells);
    }

    #[test]
    fn family_names_are_escaped_for_re2() {
        assert_eq!(regex_escape("message_topic"), "message_topic");
        assert_eq!(regex_escape("a-b.c"), "a\\-b\\.c");
    }
}
