//! Items as the seeds lay them out, to and from our types.
//!
//! Router table: `uaid` (S, partition), `router_type`, `router_data` (M),
//! `node_id`, `connected_at` (ms), `last_connect` (N, the hour key of
//! [`last_connect_key`], partition of the `AccessIndex` GSI).
//! Message table: `uaid` (S, partition), `chidmessageid` (S, sort); the row
//! whose sort key is `" "` holds the channel set `chids` (SS); every other
//! row is a message whose channel and topic are in its sort key
//! (`01:{chid}:{topic}` or `02:{sortkey_timestamp}:{chid}`), with
//! `timestamp`, `ttl`, `expiry` (the TTL attribute), `updateid` (the message
//! id, the version a client acks), `data`, `headers`, `sortkey_timestamp`.
//! With legacy monthly rotation the router record also names the user's
//! message table in `current_month`. A user agent's minimum urgency other
//! than `very-low` is in `min_urgency` (S, as the `Urgency` header spells it).

use std::collections::{BTreeMap, HashMap};

use autopush_common::{Notification, RouterType, User, WakeRoute, notification::Urgency};
use aws_sdk_dynamodb::types::AttributeValue;
use uuid::Uuid;

use crate::{Receipt, Result, StorageError, StoredMessage};
use autopush_common::receipt::MessageState;

pub type Item = HashMap<String, AttributeValue>;

/// The sort key of the channel-set row.
pub const CHANNELS_ROW: &str = " ";

fn corrupt(what: impl std::fmt::Display) -> StorageError {
    StorageError::Corrupt(what.to_string())
}

pub fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

pub fn n(value: impl std::fmt::Display) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

/// The simple (`uaid`) key of a UAID's router record.
pub fn user_key(uaid: &Uuid) -> Item {
    HashMap::from([("uaid".to_owned(), s(uaid.simple().to_string()))])
}

/// The key of one message-table row.
pub fn message_key(uaid: &Uuid, sort_key: &str) -> Item {
    HashMap::from([
        ("uaid".to_owned(), s(uaid.simple().to_string())),
        ("chidmessageid".to_owned(), s(sort_key)),
    ])
}

fn get_s<'a>(item: &'a Item, name: &str) -> Option<&'a str> {
    match item.get(name) {
        Some(AttributeValue::S(v)) => Some(v),
        _ => None,
    }
}

fn get_n(item: &Item, name: &str) -> Result<Option<u64>> {
    match item.get(name) {
        Some(AttributeValue::N(v)) => v
            .parse::<u64>()
            .or_else(|_| v.parse::<f64>().map(|f| f as u64))
            .map(Some)
            .map_err(|_| corrupt(format!("{name} is not a number: {v:?}"))),
        _ => Ok(None),
    }
}

/// `last_connect` as the seeds key it: `YYYYMMDDHH` then a random
/// `0001`-`0010`, so a month's switch-over is spread over ten GSI partitions.
pub fn last_connect_key(millis: u64, suffix: u32) -> u64 {
    let secs = millis / 1000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let hour = (secs % 86_400) / 3600;
    ((y as u64 * 100 + m as u64) * 100 + d as u64) * 100 * 10_000 + hour * 10_000 + suffix as u64
}

/// `last_connect` as stored: its [`last_connect_key`] with a random suffix.
pub fn last_connect_attr(millis: u64) -> AttributeValue {
    n(last_connect_key(millis, fastrand::u32(1..=10)))
}

/// The start of the hour a [`last_connect_key`] names, in milliseconds.
pub fn last_connect_millis(key: u64) -> u64 {
    let hours = key / 10_000;
    let (hour, day) = (hours % 100, hours / 100);
    let (y, m, d) = (day / 10_000, (day / 100) % 100, day % 100);
    let days = days_from_civil(y as i64, m as u32, d as u32).max(0) as u64;
    (days * 86_400 + hour * 3600) * 1000
}

/// Every hour key (with each of the ten suffixes) of the UTC calendar month
/// `year`-`month`: what `drop-old-users` queries the `AccessIndex` for.
pub fn month_keys(year: i64, month: u32) -> impl Iterator<Item = u64> {
    let first = days_from_civil(year, month, 1);
    let (ny, nm) = if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    };
    let days = days_from_civil(ny, nm, 1) - first;
    (0..days as u64).flat_map(move |day| {
        let millis = (first as u64 + day) * 86_400_000;
        (0..24u64).flat_map(move |hour| {
            (1..=10).map(move |suffix| last_connect_key(millis + hour * 3_600_000, suffix))
        })
    })
}

/// The UTC (year, month) `months` calendar months before the one `millis` is in.
pub fn months_before(millis: u64, months: u32) -> (i64, u32) {
    month_offset(millis, -i64::from(months))
}

/// The UTC (year, month) `delta` calendar months from the one `millis` is in.
pub fn month_offset(millis: u64, delta: i64) -> (i64, u32) {
    let (y, m, _) = civil_from_days((millis / 86_400_000) as i64);
    let total = y * 12 + (m as i64 - 1) + delta;
    (total.div_euclid(12), (total.rem_euclid(12) + 1) as u32)
}

/// Days since 1970-01-01 to (year, month, day), UTC.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let julian = i64::from(unix_epoch_julian_day()) + days;
    let date = i32::try_from(julian)
        .ok()
        .and_then(|j| time::Date::from_julian_day(j).ok())
        .unwrap_or(time::Date::MAX);
    (
        i64::from(date.year()),
        u32::from(u8::from(date.month())),
        u32::from(date.day()),
    )
}

/// (year, month, day) to days since 1970-01-01; an impossible date (read
/// from a corrupt key) counts as the epoch.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let date = i32::try_from(year).ok().and_then(|year| {
        let month = time::Month::try_from(u8::try_from(month).ok()?).ok()?;
        time::Date::from_calendar_date(year, month, u8::try_from(day).ok()?).ok()
    });
    date.map_or(0, |d| {
        i64::from(d.to_julian_day()) - i64::from(unix_epoch_julian_day())
    })
}

fn unix_epoch_julian_day() -> i32 {
    time::OffsetDateTime::UNIX_EPOCH.date().to_julian_day()
}

pub fn json_to_attr(value: &serde_json::Value) -> AttributeValue {
    use serde_json::Value;
    match value {
        Value::Null => AttributeValue::Null(true),
        Value::Bool(b) => AttributeValue::Bool(*b),
        Value::Number(v) => AttributeValue::N(v.to_string()),
        Value::String(v) => AttributeValue::S(v.clone()),
        Value::Array(v) => AttributeValue::L(v.iter().map(json_to_attr).collect()),
        Value::Object(v) => AttributeValue::M(
            v.iter()
                .map(|(k, v)| (k.clone(), json_to_attr(v)))
                .collect(),
        ),
    }
}

/// A condition expression with the names and values it spells with `#`
/// and `:`.
#[derive(Debug, Default, PartialEq)]
pub struct Condition {
    pub expression: String,
    pub names: HashMap<String, String>,
    pub values: Item,
}

/// The condition that the attribute `path` holds exactly `value` (as
/// [`json_to_attr`] writes it), spelled as checks of scalars: each map and
/// list by its type and size, each scalar by value. dynalite compares maps
/// and lists by reference (never equal), so `path = :map` would never hold
/// there; every server answers these.
pub fn json_equals(path: &str, value: &serde_json::Value) -> Condition {
    let mut condition = Condition::default();
    let mut checks = Vec::new();
    equals_into(path.to_owned(), value, &mut condition, &mut checks);
    condition.expression = checks.join(" AND ");
    condition
}

fn equals_into(
    path: String,
    value: &serde_json::Value,
    condition: &mut Condition,
    checks: &mut Vec<String>,
) {
    use serde_json::Value;
    let mut placeholder = |value: AttributeValue| {
        let name = format!(":eq{}", condition.values.len());
        condition.values.insert(name.clone(), value);
        name
    };
    let mut shape = |kind: &str, size: usize| {
        let (kind, size) = (placeholder(s(kind)), placeholder(n(size)));
        checks.push(format!("attribute_type({path}, {kind})"));
        checks.push(format!("size({path}) = {size}"));
    };
    match value {
        Value::Object(map) => {
            shape("M", map.len());
            for (key, value) in map {
                let name = format!("#eq{}", condition.names.len());
                condition.names.insert(name.clone(), key.clone());
                equals_into(format!("{path}.{name}"), value, condition, checks);
            }
        }
        Value::Array(items) => {
            shape("L", items.len());
            for (i, value) in items.iter().enumerate() {
                equals_into(format!("{path}[{i}]"), value, condition, checks);
            }
        }
        Value::Null => {
            let kind = placeholder(s("NULL"));
            checks.push(format!("attribute_type({path}, {kind})"));
        }
        scalar => {
            let value = placeholder(json_to_attr(scalar));
            checks.push(format!("{path} = {value}"));
        }
    }
}

pub fn attr_to_json(value: &AttributeValue) -> Result<serde_json::Value> {
    use serde_json::Value;
    Ok(match value {
        AttributeValue::Null(_) => Value::Null,
        AttributeValue::Bool(b) => Value::Bool(*b),
        AttributeValue::N(v) => serde_json::from_str(v).map_err(|_| corrupt(v))?,
        AttributeValue::S(v) => Value::String(v.clone()),
        AttributeValue::Ss(v) => Value::Array(v.iter().cloned().map(Value::String).collect()),
        AttributeValue::L(v) => Value::Array(v.iter().map(attr_to_json).collect::<Result<_>>()?),
        AttributeValue::M(v) => Value::Object(
            v.iter()
                .map(|(k, v)| Ok((k.clone(), attr_to_json(v)?)))
                .collect::<Result<_>>()?,
        ),
        other => return Err(corrupt(format!("unexpected attribute {other:?}"))),
    })
}

pub fn user_to_item(user: &User) -> Item {
    let mut item = user_key(&user.uaid);
    let router_type = serde_json::to_value(user.router_type)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    item.insert("router_type".into(), s(router_type));
    if let Some(data) = &user.router_data {
        item.insert("router_data".into(), json_to_attr(data));
    }
    if let Some(node_id) = &user.node_id {
        item.insert("node_id".into(), s(node_id));
    }
    item.insert("connected_at".into(), n(user.connected_at));
    item.insert("last_connect".into(), last_connect_attr(user.last_connect));
    if user.over_msg_limit {
        item.insert("over_msg_limit".into(), AttributeValue::Bool(true));
    }
    if let Some(month) = &user.current_month {
        item.insert("current_month".into(), s(month));
    }
    if user.min_urgency != Urgency::VeryLow {
        item.insert("min_urgency".into(), s(user.min_urgency.as_str()));
    }
    if let Some(route) = &user.wake_route {
        item.insert("wake_route".into(), s(route.to_json()));
    }
    if user.last_wake > 0 {
        item.insert("last_wake".into(), n(user.last_wake));
    }
    item
}

pub fn user_from_item(item: &Item) -> Result<User> {
    let uaid = get_s(item, "uaid")
        .and_then(|v| Uuid::parse_str(v).ok())
        .ok_or_else(|| corrupt("router record without a valid uaid"))?;
    let router_type = get_s(item, "router_type").unwrap_or("webpush");
    let router_type: RouterType = serde_json::from_value(router_type.into())
        .map_err(|_| corrupt(format!("unknown router_type {router_type:?}")))?;
    Ok(User {
        uaid,
        router_type,
        router_data: item.get("router_data").map(attr_to_json).transpose()?,
        node_id: get_s(item, "node_id").map(str::to_owned),
        connected_at: get_n(item, "connected_at")?.unwrap_or(0),
        last_connect: get_n(item, "last_connect")?
            .map(last_connect_millis)
            .unwrap_or(0),
        over_msg_limit: matches!(item.get("over_msg_limit"), Some(AttributeValue::Bool(true))),
        current_month: get_s(item, "current_month").map(str::to_owned),
        min_urgency: match get_s(item, "min_urgency") {
            Some(value) => Urgency::parse(value)
                .ok_or_else(|| corrupt(format!("unknown min_urgency {value:?}")))?,
            None => Urgency::VeryLow,
        },
        wake_route: get_s(item, "wake_route")
            .map(|text| WakeRoute::from_json(text).ok_or_else(|| corrupt("wake_route")))
            .transpose()?,
        last_wake: get_n(item, "last_wake")?.unwrap_or(0),
    })
}

/// A message's item; `retention` (receipt seconds) keeps it that long past
/// its TTL, for its `expired` receipt: `expiry`, the table's TTL attribute,
/// is then later than the message's own deadline (`timestamp + ttl`), which
/// `deadline` keeps, for the settle's condition (see [`UNEXPIRED`]).
pub fn message_to_item(uaid: &Uuid, message: &Notification, retention: u64) -> Item {
    let mut item = message_key(uaid, &message.sort_key());
    item.insert("timestamp".into(), n(message.timestamp));
    item.insert("ttl".into(), n(message.ttl));
    item.insert(
        "expiry".into(),
        n(message.expiry().saturating_add(retention)),
    );
    if retention > 0 {
        item.insert("deadline".into(), n(message.expiry()));
    }
    item.insert("updateid".into(), s(&message.version));
    if let Some(ts) = message.sortkey_timestamp {
        item.insert("sortkey_timestamp".into(), n(ts));
    }
    if let Some(data) = &message.data {
        item.insert("data".into(), s(data));
    }
    if let Some(headers) = &message.headers {
        item.insert(
            "headers".into(),
            AttributeValue::M(headers.iter().map(|(k, v)| (k.clone(), s(v))).collect()),
        );
    }
    if let Some(urgency) = message.urgency {
        let urgency = serde_json::to_value(urgency)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        item.insert("urgency".into(), s(urgency));
    }
    if message.durable {
        item.insert("durable".into(), AttributeValue::Bool(true));
    }
    item
}

/// A settled message's row under `sort_key`: `updateid`, `settled` (the
/// state), `settled_at` and `expiry` (when the receipt goes).
pub fn receipt_to_item(uaid: &Uuid, sort_key: &str, receipt: &Receipt) -> Item {
    let mut item = message_key(uaid, sort_key);
    item.insert("updateid".into(), s(&receipt.version));
    item.insert("settled".into(), s(receipt.state.as_str()));
    item.insert("settled_at".into(), n(receipt.updated));
    item.insert("expiry".into(), n(receipt.expiry));
    item
}

/// What a settle writes into a message's row: the receipt's attributes,
/// and none of those that make it a message (so no reader of the seeds'
/// schema takes it for one: autopush-rs skips a row without `timestamp`).
/// Names are spelled with `#`: DynamoDB reserves some.
pub const SETTLE: &str = "SET settled = :state, settled_at = :at, expiry = :expiry \
    REMOVE #timestamp, #ttl, #data, #headers, #urgency, #durable, #sortkey_timestamp, #deadline";

/// The condition that a message row is not past its TTL at `:now`: its
/// `deadline`, or in a row without one (written with receipts off, or by
/// Python autopush) its `expiry`, which is then the same. A settle holds it
/// too: expired is final.
pub const UNEXPIRED: &str =
    "(#deadline > :now OR (attribute_not_exists(#deadline) AND expiry > :now))";

/// The names [`SETTLE`] spells with `#`.
pub fn settle_names() -> HashMap<String, String> {
    [
        "timestamp",
        "ttl",
        "data",
        "headers",
        "urgency",
        "durable",
        "sortkey_timestamp",
        "deadline",
    ]
    .into_iter()
    .map(|name| (format!("#{name}"), name.to_owned()))
    .collect()
}

/// The values of [`SETTLE`] for `receipt`, with `:now` for [`UNEXPIRED`].
pub fn settle_values(receipt: &Receipt) -> Item {
    HashMap::from([
        (":state".to_owned(), s(receipt.state.as_str())),
        (":at".to_owned(), n(receipt.updated)),
        (":expiry".to_owned(), n(receipt.expiry)),
        (":now".to_owned(), n(receipt.updated)),
    ])
}

/// A message-table row other than the channel set: a receipt or a message.
pub fn stored_from_item(item: &Item) -> Result<StoredMessage> {
    let Some(state) = get_s(item, "settled") else {
        return message_from_item(item).map(StoredMessage::Pending);
    };
    Ok(StoredMessage::Settled(Receipt {
        state: MessageState::parse(state)
            .ok_or_else(|| corrupt(format!("unknown receipt state {state:?}")))?,
        version: get_s(item, "updateid")
            .ok_or_else(|| corrupt("receipt without updateid"))?
            .to_owned(),
        updated: get_n(item, "settled_at")?.unwrap_or(0),
        expiry: get_n(item, "expiry")?.unwrap_or(0),
    }))
}

/// The channel, topic and sort-key timestamp a message's sort key names.
fn parse_sort_key(key: &str) -> Option<(Uuid, Option<String>, Option<u64>)> {
    if let Some(rest) = key.strip_prefix("01:") {
        let (chid, topic) = rest.split_once(':')?;
        Some((Uuid::parse_str(chid).ok()?, Some(topic.to_owned()), None))
    } else if let Some(rest) = key.strip_prefix("02:") {
        let (ts, chid) = rest.rsplit_once(':')?;
        Some((Uuid::parse_str(chid).ok()?, None, ts.parse().ok()))
    } else {
        None
    }
}

/// The key Python autopush gave the timestamp message whose key we spell
/// `sort_key`: its `sortkey_timestamp` was not zero-padded. `None` when the
/// two spellings agree.
pub fn legacy_sort_key(sort_key: &str) -> Option<String> {
    let rest = sort_key.strip_prefix("02:")?;
    let (ts, chid) = rest.split_once(':')?;
    let unpadded = ts.trim_start_matches('0');
    (unpadded.len() != ts.len() && !unpadded.is_empty()).then(|| format!("02:{unpadded}:{chid}"))
}

pub fn message_from_item(item: &Item) -> Result<Notification> {
    let key = get_s(item, "chidmessageid").unwrap_or_default();
    let (channel_id, topic, key_ts) =
        parse_sort_key(key).ok_or_else(|| corrupt(format!("unknown sort key {key:?}")))?;
    let timestamp = get_n(item, "timestamp")?.unwrap_or(0);
    let ttl = match get_n(item, "ttl")? {
        Some(ttl) => ttl,
        None => get_n(item, "expiry")?
            .unwrap_or(0)
            .saturating_sub(timestamp),
    };
    let headers = match item.get("headers") {
        Some(AttributeValue::M(map)) => Some(
            map.iter()
                .filter_map(|(k, v)| match v {
                    AttributeValue::S(v) => Some((k.clone(), v.clone())),
                    _ => None,
                })
                .collect::<BTreeMap<_, _>>(),
        ),
        _ => None,
    };
    let urgency = get_s(item, "urgency").and_then(Urgency::parse);
    Ok(Notification {
        channel_id,
        version: get_s(item, "updateid")
            .ok_or_else(|| corrupt(format!("message {key:?} without updateid")))?
            .to_owned(),
        ttl,
        timestamp,
        topic,
        sortkey_timestamp: get_n(item, "sortkey_timestamp")?.or(key_ts),
        data: get_s(item, "data").map(str::to_owned),
        headers,
        urgency,
        durable: matches!(item.get("durable"), Some(AttributeValue::Bool(true))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_days_round_trip() {
        assert_eq!(civil_from_days(20_781), (2026, 11, 24));
        assert_eq!(days_from_civil(2000, 2, 29), 11_016);
        for day in 0..80_000 {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day, "{y}-{m}-{d}");
        }
        // A corrupt key's impossible date counts as the epoch.
        assert_eq!(days_from_civil(2024, 13, 1), 0);
    }

    #[test]
    fn last_connect_keys_name_the_hour() {
        // 2024-02-29 13:45:10 UTC
        let millis = 1_709_214_310_000;
        let key = last_connect_key(millis, 7);
        assert_eq!(key, 20240229130007);
        assert_eq!(last_connect_millis(key), 1_709_211_600_000);
        assert_eq!(months_before(millis, 2), (2023, 12));
        assert_eq!(months_before(millis, 0), (2024, 2));
        let keys: Vec<_> = month_keys(2024, 2).collect();
        assert_eq!(keys.len(), 29 * 24 * 10);
        assert_eq!(keys[0], 20240201000001);
        assert_eq!(*keys.last().unwrap(), 20240229230010);
    }

    #[test]
    fn json_equality_checks_scalars() {
        let data = serde_json::json!({"token": "t", "n": 1, "l": [true, null], "m": {}});
        let eq = json_equals("router_data", &data);
        assert_eq!(eq.names.len(), 4);
        assert_eq!(eq.values.len(), 10);
        assert!(
            eq.expression
                .starts_with("attribute_type(router_data, :eq0) AND size(router_data) = :eq1 AND ")
        );
        assert!(eq.expression.contains("router_data.#eq"));
        assert!(eq.expression.contains("[1], :eq"));
        assert_eq!(eq.values[":eq0"], s("M"));
        assert_eq!(eq.values[":eq1"], n(4));
    }

    #[test]
    fn messages_round_trip() {
        let uaid = Uuid::new_v4();
        for topic in [None, Some("a:b".to_owned())] {
            let m = Notification {
                channel_id: Uuid::new_v4(),
                version: "v1".into(),
                ttl: 60,
                timestamp: 1000,
                topic,
                sortkey_timestamp: Some(123),
                data: Some("abc".into()),
                headers: Some(BTreeMap::from([("encoding".into(), "aes128gcm".into())])),
                urgency: Some(Urgency::High),
                durable: true,
            };
            assert_eq!(
                message_from_item(&message_to_item(&uaid, &m, 0)).unwrap(),
                m
            );
            assert!(!message_to_item(&uaid, &m, 0).contains_key("deadline"));
            let kept = message_to_item(&uaid, &m, 100);
            assert_eq!(kept["expiry"], n(m.expiry() + 100));
            assert_eq!(kept["deadline"], n(m.expiry()));
            assert_eq!(message_from_item(&kept).unwrap(), m);
        }
        let receipt = Receipt::new("v1", MessageState::Delivered, 1000, 60);
        let item = receipt_to_item(&uaid, "02:1:x", &receipt);
        assert_eq!(
            stored_from_item(&item).unwrap(),
            StoredMessage::Settled(receipt)
        );
        {}
    }
}
