//! The receipts table: what a settled message leaves, apart from the
//! messages.
//!
//! A receipt is keyed by its message's arrival time first, then user and
//! key. Receipts are written in the order their messages arrive, give or
//! take the moments before the acks, so a commit of thousands of them
//! appends to a few leaves at the end of the table. Kept among their users'
//! messages, they cost a leaf rewritten per receipt, and a fetch of a
//! user's pending messages read past a day of its receipts.
//!
//! A receipt is found from its message's key alone: a message without a
//! Topic has its arrival time in its key (`02:{micros}:{chid}`). The
//! receipt of a Topic message (`01:…`, no time) sorts first, under 0.
//!
//! Stores written before this table keep their older receipts in the
//! message table: reads look there first, and the sweep removes them at
//! their expiry.

use redb::{ReadableTable, Table, TableDefinition};

use super::{backend, corrupt};
use crate::{Receipt, Result};

/// (arrival of the message in µs, uaid, receipt key) -> JSON receipt.
pub(super) const RECEIPTS: TableDefinition<(u64, u128, &str), &[u8]> =
    TableDefinition::new("receipts");

/// Where the receipt kept under `key` sorts: the arrival time of its
/// message in µs, or 0 for a key without one (a Topic message's).
pub(super) fn arrival(key: &str) -> u64 {
    key.strip_prefix("02:")
        .and_then(|rest| rest.get(..20))
        .and_then(|digits| digits.parse().ok())
        .unwrap_or(0)
}

/// Write `receipt` under `key` (the message's key, or its Topic receipt's
/// own), replacing any receipt there.
pub(super) fn put(
    table: &mut Table<(u64, u128, &str), &[u8]>,
    uaid: u128,
    key: &str,
    receipt: &Receipt,
) -> Result<()> {
    let json = serde_json::to_vec(receipt).map_err(corrupt)?;
    table
        .insert((arrival(key), uaid, key), json.as_slice())
        .map_err(backend)?;
    Ok(())
}

/// The receipt under `key`, if any.
pub(super) fn get(
    table: &impl ReadableTable<(u64, u128, &'static str), &'static [u8]>,
    uaid: u128,
    key: &str,
) -> Result<Option<Receipt>> {
    table
        .get((arrival(key), uaid, key))
        .map_err(backend)?
        .map(|row| serde_json::from_slice(row.value()).map_err(corrupt))
        .transpose()
}

/// Remove the receipt under `key` if it is `version`'s; returns whether it
/// was there.
pub(super) fn remove_version(
    table: &mut Table<(u64, u128, &str), &[u8]>,
    uaid: u128,
    key: &str,
    version: &str,
) -> Result<bool> {
    let is_version = get(table, uaid, key)?.is_some_and(|receipt| receipt.version == version);
    if is_version {
        table.remove((arrival(key), uaid, key)).map_err(backend)?;
    }
    Ok(is_version)
}

/// A row of the table, owned: where a sweep stops and starts again.
pub(super) type Cursor = (u64, u128, String);

/// [`super::step_over`] the receipts: those past their expiry at `now`.
pub(super) fn expired_after(
    table: &impl ReadableTable<(u64, u128, &'static str), &'static [u8]>,
    start: Option<&Cursor>,
    budget: usize,
    now: u64,
) -> Result<super::Step<Cursor>> {
    let entries = match start {
        Some((at, uaid, key)) => table.range((*at, *uaid, key.as_str())..),
        None => table.range::<(u64, u128, &str)>(..),
    }
    .map_err(backend)?;
    let rows = entries.map(|entry| {
        let (key, value) = entry.map_err(backend)?;
        let (at, uaid, key) = key.value();
        let receipt: Receipt = serde_json::from_slice(value.value()).map_err(corrupt)?;
        Ok(((at, uaid, key.to_owned()), receipt.expiry <= now))
    });
    super::step_over(rows, start, budget)
}

/// Remove the receipts under `keys` that are still past their expiry at
/// `now` (a sender's message may have settled again under the same key
/// since they were read). Returns how many went.
pub(super) fn remove_expired(
    table: &mut Table<(u64, u128, &str), &[u8]>,
    keys: &[Cursor],
    now: u64,
) -> Result<usize> {
    let mut removed = 0;
    for (at, uaid, key) in keys {
        let key = (*at, *uaid, key.as_str());
        let still_expired = match table.get(key).map_err(backend)? {
            Some(row) => {
                let receipt: Receipt = serde_json::from_slice(row.value()).map_err(corrupt)?;
                receipt.expiry <= now
            }
            None => false,
        };
        if still_expired {
            table.remove(key).map_err(backend)?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopush_common::notification::sort_key;
    use uuid::Uuid;

    #[test]
    fn a_receipt_sorts_by_its_message_arrival() {
        let chid = Uuid::new_v4();
        assert_eq!(
            arrival(&sort_key(&chid, None, Some(1_700_000_000_123_456))),
            1_700_000_000_123_456
        );
        assert_eq!(arrival(&sort_key(&chid, None, Some(u64::MAX))), u64::MAX);
        assert_eq!(arrival(&sort_key(&chid, Some("topic"), Some(5))), 0);
        assert_eq!(arrival("02:garbage"), 0);
    }
}
