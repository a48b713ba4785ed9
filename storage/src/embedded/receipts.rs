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
//! message table, as JSON: reads look there first, and the sweep removes
//! them at their expiry.

use autopush_common::receipt::MessageState;
use redb::{ReadableTable, Table, TableDefinition};

use super::backend;
use crate::{Receipt, Result, StorageError};

/// (arrival of the message in µs, uaid, receipt key) -> receipt ([`encode`]).
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
    table
        .insert((arrival(key), uaid, key), encode(receipt).as_slice())
        .map_err(backend)?;
    Ok(())
}

/// A receipt's row: its state's name after its length, when it was settled
/// and when it expires (Unix seconds, little-endian), then its version. Not
/// JSON: a busy node writes thousands a second, and serde_json would scan
/// every version for characters to escape.
fn encode(receipt: &Receipt) -> Vec<u8> {
    let state = receipt.state.as_str().as_bytes();
    let mut row = Vec::with_capacity(1 + state.len() + 16 + receipt.version.len());
    row.push(state.len() as u8);
    row.extend_from_slice(state);
    row.extend_from_slice(&receipt.updated.to_le_bytes());
    row.extend_from_slice(&receipt.expiry.to_le_bytes());
    row.extend_from_slice(receipt.version.as_bytes());
    row
}

fn decode(row: &[u8]) -> Result<Receipt> {
    let corrupt = || StorageError::Corrupt("a receipt's row does not decode".into());
    let (&len, rest) = row.split_first().ok_or_else(corrupt)?;
    let (state, rest) = rest.split_at_checked(len.into()).ok_or_else(corrupt)?;
    let (updated, rest) = rest.split_first_chunk::<8>().ok_or_else(corrupt)?;
    let (expiry, version) = rest.split_first_chunk::<8>().ok_or_else(corrupt)?;
    let state = std::str::from_utf8(state)
        .ok()
        .and_then(MessageState::parse);
    Ok(Receipt {
        state: state.ok_or_else(corrupt)?,
        version: String::from_utf8(version.to_vec()).map_err(|_| corrupt())?,
        updated: u64::from_le_bytes(*updated),
        expiry: u64::from_le_bytes(*expiry),
    })
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
        .map(|row| decode(row.value()))
        .transpose()
}

/// Whether a receipt is kept under `key` (read or not).
pub(super) fn holds(
    table: &impl ReadableTable<(u64, u128, &'static str), &'static [u8]>,
    uaid: u128,
    key: &str,
) -> Result<bool> {
    Ok(table
        .get((arrival(key), uaid, key))
        .map_err(backend)?
        .is_some())
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
        Ok((
            (at, uaid, key.to_owned()),
            decode(value.value())?.expiry <= now,
        ))
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
            Some(row) => decode(row.value())?.expiry <= now,
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
    fn a_row_decodes_to_the_receipt_written() {
        for state in MessageState::ALL {
            let receipt = Receipt::new("gAAAAABp-version_", state, 1_764_000_000, 86_400);
            assert_eq!(decode(&encode(&receipt)).unwrap(), receipt);
        }
        let row = encode(&Receipt::new("v", MessageState::Delivered, 1, 1));
        for cut in 0..row.len() - 1 {
            assert!(decode(&row[..cut]).is_err(), "{cut} bytes decoded");
        }
    }

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

    /// Bytes the database file grows by per receipt kept, written as the
    /// journal's checkpoints write them: batches of 1 024, in hash order,
    /// of messages that arrived at 2 800 a second, each to its own user,
    /// with ids as long as sealed ones. Run with
    /// `cargo test -p autopush-storage --lib bytes_on_disk_per_receipt -- --ignored --nocapture`.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "a measurement: writes 500 000 receipts"]
    async fn bytes_on_disk_per_receipt() {
        const RECEIPTS_WRITTEN: usize = 500_000;
        const BATCH: usize = 1024;
        let (dir, _, store) = super::super::tests::store_with_receipts();
        let file = dir.path().join("autopush.redb");
        let size = || std::fs::metadata(&file).unwrap().len();
        let before = size();
        let start = autopush_common::time::now_secs() * 1_000_000;
        let id_chars: Vec<char> = ('a'..='z').chain('A'..='Z').chain('0'..='9').collect();
        for batch in 0..RECEIPTS_WRITTEN / BATCH {
            let mut rows: Vec<(u128, String, Receipt)> = (0..BATCH)
                .map(|n| {
                    let arrival = start + ((batch * BATCH + n) as u64) * 1_000_000 / 2_800;
                    let key = sort_key(&Uuid::new_v4(), None, Some(arrival));
                    // A sealed id is about 204 characters of base64url.
                    let id: String = (0..204).map(|_| fastrand::choice(&id_chars).unwrap()).collect();
                    let receipt =
                        Receipt::new(&id, MessageState::Delivered, arrival / 1_000_000, 86_400);
                    (fastrand::u128(..), key, receipt)
                })
                .collect();
            fastrand::shuffle(&mut rows);
            store
                .write(move |txn| {
                    let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
                    for (uaid, key, receipt) in &rows {
                        put(&mut table, *uaid, key, receipt)?;
                    }
                    Ok(())
                })
                .await
                .unwrap();
        }
        let grown = size() - before;
        println!(
            "{RECEIPTS_WRITTEN} receipts: the file grew {grown} bytes, {:.1} bytes per receipt",
            grown as f64 / RECEIPTS_WRITTEN as f64
        );
    }
}
