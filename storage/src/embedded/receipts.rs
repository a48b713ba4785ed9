//! The receipts table: what a settled message leaves, apart from the
//! messages.
//!
//! A receipt keeps its message's state, when it got there, and what finds
//! it: 29 bytes, where the message id alone is about 200. Its key is its
//! message's arrival time (µs, big-endian) then a digest of its user and
//! key; its row the state, the time (Unix seconds) and the tag of its
//! message id, which tells it from another message's receipt under the
//! same key. It expires `--receipt-retention` after that time.
//!
//! Receipts are written in the order their messages arrive, give or take
//! the moments before the acks, and a checkpoint writes its batch in key
//! order: redb then appends them to full leaves at the end of the table
//! (an insert in the middle of a leaf splits it in halves). Kept among
//! their users' messages, they cost a leaf rewritten per receipt, and a
//! fetch of a user's pending messages read past a day of its receipts.
//!
//! A receipt is found from its message's key alone: a message without a
//! Topic has its arrival time in its key (`02:{micros}:{chid}`). The
//! receipt of a Topic message (`01:…`, no time) sorts first, under 0.
//!
//! Stores written before kept receipts whole (their message id among them)
//! in [`OLD_RECEIPTS`], or before that in the message table, as JSON:
//! reads look there too, and the sweep removes them at their expiry.

use autopush_common::notification::version_tag;
use autopush_common::receipt::MessageState;
use redb::{ReadableTable, ReadableTableMetadata, Table, TableDefinition, TableError, TableHandle};
use sha2::{Digest, Sha256};

use super::backend;
use crate::{Receipt, Result, StorageError};

/// A receipt's key: its message's arrival in µs (big-endian, so that keys
/// sort by it), then the first 8 bytes of SHA-256 of its user and key.
/// Two receipts share one only if their messages arrived in the same µs
/// and their digests meet; the later then takes the earlier's row, and the
/// earlier's reader, finding another tag there, is told it is not known.
pub(super) type Key = [u8; 16];
/// A receipt's row: its state (its place in [`MessageState::ALL`]), when
/// it was settled (Unix seconds, little-endian), its message id's tag.
pub(super) type Row = [u8; 13];

/// The receipts: [`Key`] -> [`Row`].
pub(super) const RECEIPTS: TableDefinition<Key, Row> = TableDefinition::new("receipt_rows");

/// Receipts as stores wrote them before [`RECEIPTS`]: (arrival in µs, uaid,
/// receipt key) -> state, settled and expiry times, message id. Read and
/// swept, never written.
pub(super) const OLD_RECEIPTS: TableDefinition<OldKey, &[u8]> = TableDefinition::new("receipts");

/// A key of [`OLD_RECEIPTS`].
type OldKey = (u64, u128, &'static str);
/// [`OLD_RECEIPTS`] open in a write transaction.
type OldTable<'txn> = Table<'txn, OldKey, &'static [u8]>;

/// Where the receipt kept under `key` sorts: the arrival time of its
/// message in µs, or 0 for a key without one (a Topic message's).
pub(super) fn arrival(key: &str) -> u64 {
    key.strip_prefix("02:")
        .and_then(|rest| rest.get(..20))
        .and_then(|digits| digits.parse().ok())
        .unwrap_or(0)
}

/// The key of the receipt kept under `key` (the message's key, or its Topic
/// receipt's own) for user `uaid`.
pub(super) fn key_of(uaid: u128, key: &str) -> Key {
    let digest = Sha256::new()
        .chain_update(uaid.to_be_bytes())
        .chain_update(key.as_bytes())
        .finalize();
    let mut row_key = [0; 16];
    row_key[..8].copy_from_slice(&arrival(key).to_be_bytes());
    row_key[8..].copy_from_slice(&digest[..8]);
    row_key
}

fn encode(receipt: &Receipt) -> Row {
    let state = MessageState::ALL
        .iter()
        .position(|state| *state == receipt.state)
        .unwrap_or_default();
    let mut row = [0; 13];
    row[0] = state as u8;
    row[1..5].copy_from_slice(&seconds(receipt.updated).to_le_bytes());
    row[5..].copy_from_slice(&version_tag(&receipt.version));
    row
}

/// Unix seconds in 4 bytes: enough until 2106.
fn seconds(at: u64) -> u32 {
    at.try_into().unwrap_or(u32::MAX)
}

/// The receipt in `row`, kept `retention` seconds after it was settled.
fn decode(row: Row, retention: u64) -> Result<Receipt> {
    let state = MessageState::ALL.get(usize::from(row[0])).ok_or_else(|| {
        StorageError::Corrupt(format!("a receipt's state is {}, not one known", row[0]))
    })?;
    let updated = u32::from_le_bytes([row[1], row[2], row[3], row[4]]).into();
    let mut tag = [0; 8];
    tag.copy_from_slice(&row[5..]);
    Ok(Receipt::of_tag(
        *state,
        tag,
        updated,
        u64::saturating_add(updated, retention),
    ))
}

/// When the receipt in `row` was settled.
fn settled_at(row: &Row) -> u64 {
    u32::from_le_bytes([row[1], row[2], row[3], row[4]]).into()
}

/// Write `receipt` under `key` (the message's key, or its Topic receipt's
/// own), replacing any receipt there.
pub(super) fn put(
    table: &mut Table<Key, Row>,
    uaid: u128,
    key: &str,
    receipt: &Receipt,
) -> Result<()> {
    table
        .insert(key_of(uaid, key), encode(receipt))
        .map_err(backend)?;
    Ok(())
}

/// [`put`] each of `receipts`, in key order: most go after every key in
/// the table, which redb appends to a full leaf.
pub(super) fn put_all<'a>(
    table: &mut Table<Key, Row>,
    receipts: impl IntoIterator<Item = (u128, &'a str, &'a Receipt)>,
) -> Result<()> {
    let mut rows: Vec<(Key, Row)> = receipts
        .into_iter()
        .map(|(uaid, key, receipt)| (key_of(uaid, key), encode(receipt)))
        .collect();
    rows.sort_unstable_by_key(|(key, _)| *key);
    for (key, row) in rows {
        table.insert(key, row).map_err(backend)?;
    }
    Ok(())
}

/// The receipts table of an older store, if it has one: in a read
/// transaction, whether or not; in a write transaction, only if the store
/// said at start-up that it had one (opening it there would make one).
pub(super) fn old_in_read(
    txn: &redb::ReadTransaction,
) -> Result<Option<redb::ReadOnlyTable<OldKey, &'static [u8]>>> {
    match txn.open_table(OLD_RECEIPTS) {
        Ok(table) => Ok(Some(table)),
        Err(TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(backend(e)),
    }
}

/// [`old_in_read`] for a write transaction: `held` says whether the store
/// has the table.
pub(super) fn old_in_write(
    txn: &redb::WriteTransaction,
    held: bool,
) -> Result<Option<OldTable<'_>>> {
    held.then(|| txn.open_table(OLD_RECEIPTS).map_err(backend))
        .transpose()
}

/// Whether the store opened in `txn` holds receipts written in the old
/// layout; drops the old table once it is empty.
pub(super) fn old_held(txn: &redb::WriteTransaction) -> Result<bool> {
    let exists = txn
        .list_tables()
        .map_err(backend)?
        .any(|table| table.name() == OLD_RECEIPTS.name());
    if !exists {
        return Ok(false);
    }
    if txn
        .open_table(OLD_RECEIPTS)
        .map_err(backend)?
        .is_empty()
        .map_err(backend)?
    {
        txn.delete_table(OLD_RECEIPTS).map_err(backend)?;
        return Ok(false);
    }
    Ok(true)
}

/// The receipt under `key`, if any, kept `retention` seconds; `old`: the
/// table of an older store, read when the receipt is not in `table`.
pub(super) fn get(
    table: &impl ReadableTable<Key, Row>,
    old: Option<&impl ReadableTable<OldKey, &'static [u8]>>,
    uaid: u128,
    key: &str,
    retention: u64,
) -> Result<Option<Receipt>> {
    if let Some(row) = table.get(key_of(uaid, key)).map_err(backend)? {
        return decode(row.value(), retention).map(Some);
    }
    match old {
        Some(old) => old
            .get((arrival(key), uaid, key))
            .map_err(backend)?
            .map(|row| old_layout::decode(row.value()))
            .transpose(),
        None => Ok(None),
    }
}

/// Whether a receipt is kept under `key` (read or not) in [`RECEIPTS`].
pub(super) fn holds(table: &impl ReadableTable<Key, Row>, uaid: u128, key: &str) -> Result<bool> {
    Ok(table.get(key_of(uaid, key)).map_err(backend)?.is_some())
}

/// Remove the receipt under `key` if it is `version`'s; returns whether it
/// was there.
pub(super) fn remove_version(
    table: &mut Table<Key, Row>,
    old: Option<&mut OldTable<'_>>,
    uaid: u128,
    key: &str,
    version: &str,
) -> Result<bool> {
    let row_key = key_of(uaid, key);
    let is_version = match table.get(row_key).map_err(backend)? {
        Some(row) => row.value()[5..] == version_tag(version),
        None => false,
    };
    if is_version {
        table.remove(row_key).map_err(backend)?;
        return Ok(true);
    }
    match old {
        Some(old) => old_layout::remove_version(old, uaid, key, version),
        None => Ok(false),
    }
}

/// Where a sweep stops and starts again: after a row of the old table
/// (swept first), or of [`RECEIPTS`] (`None`: at its start).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Cursor {
    Old(old_layout::Cursor),
    New(Option<Key>),
}

/// [`super::step_over`] the receipts: those past their expiry at `now`,
/// kept `retention` seconds after they were settled; `old`: the table of an
/// older store, swept first. A receipt whose message arrived within the
/// last `retention` seconds was settled since, and is not looked at.
pub(super) fn expired_after(
    table: &impl ReadableTable<Key, Row>,
    old: Option<&impl ReadableTable<OldKey, &'static [u8]>>,
    start: Option<&Cursor>,
    budget: usize,
    now: u64,
    retention: u64,
) -> Result<super::Step<Cursor>> {
    let (mut dead, mut seen) = (Vec::new(), 0);
    if let Some(old) = old
        && !matches!(start, Some(Cursor::New(_)))
    {
        let start = match start {
            Some(Cursor::Old(at)) => Some(at),
            _ => None,
        };
        let (old_dead, old_seen, next) = old_layout::expired_after(old, start, budget, now)?;
        dead.extend(old_dead.into_iter().map(Cursor::Old));
        if let Some(next) = next {
            return Ok((dead, old_seen, Some(Cursor::Old(next))));
        }
        if old_seen == budget {
            return Ok((dead, old_seen, Some(Cursor::New(None))));
        }
        seen = old_seen;
    }
    let start = match start {
        Some(Cursor::New(at)) => at.as_ref(),
        _ => None,
    };
    let arrived_by = now.saturating_sub(retention).saturating_mul(1_000_000);
    let mut last = [u8::MAX; 16];
    last[..8].copy_from_slice(&arrived_by.to_be_bytes());
    let entries = match start {
        // Past the last receipt old enough: the pass is over.
        Some(at) if *at > last => return Ok((dead, seen, None)),
        Some(at) => table.range(*at..=last),
        None => table.range(..=last),
    }
    .map_err(backend)?;
    let rows = entries.map(|entry| {
        let (key, row) = entry.map_err(backend)?;
        let expired = settled_at(&row.value()).saturating_add(retention) <= now;
        Ok((key.value(), expired))
    });
    let (new_dead, new_seen, next) = super::step_over(rows, start, budget - seen)?;
    dead.extend(new_dead.into_iter().map(|key| Cursor::New(Some(key))));
    Ok((
        dead,
        seen + new_seen,
        next.map(|key| Cursor::New(Some(key))),
    ))
}

/// Remove the receipts under `keys` that are still past their expiry at
/// `now` (a sender's message may have settled again under the same key
/// since they were read). Returns how many went.
pub(super) fn remove_expired(
    table: &mut Table<Key, Row>,
    mut old: Option<&mut OldTable<'_>>,
    keys: &[Cursor],
    now: u64,
    retention: u64,
) -> Result<usize> {
    let mut removed = 0;
    for key in keys {
        match (key, old.as_deref_mut()) {
            (Cursor::New(None), _) => {}
            (Cursor::New(Some(key)), _) => {
                let still_expired = match table.get(key).map_err(backend)? {
                    Some(row) => settled_at(&row.value()).saturating_add(retention) <= now,
                    None => false,
                };
                if still_expired {
                    table.remove(key).map_err(backend)?;
                    removed += 1;
                }
            }
            (Cursor::Old(key), Some(old)) => {
                removed += old_layout::remove_expired(old, key, now)?;
            }
            (Cursor::Old(_), None) => {}
        }
    }
    Ok(removed)
}

/// Receipts as [`OLD_RECEIPTS`] holds them: their state's name after its
/// length, when they were settled and when they expire (Unix seconds,
/// little-endian), then their message id.
mod old_layout {
    use super::*;

    pub(super) type Cursor = (u64, u128, String);

    #[cfg(test)]
    pub(super) fn encode(receipt: &Receipt) -> Vec<u8> {
        let state = receipt.state.as_str().as_bytes();
        let mut row = Vec::with_capacity(1 + state.len() + 16 + receipt.version.len());
        row.push(state.len() as u8);
        row.extend_from_slice(state);
        row.extend_from_slice(&receipt.updated.to_le_bytes());
        row.extend_from_slice(&receipt.expiry.to_le_bytes());
        row.extend_from_slice(receipt.version.as_bytes());
        row
    }

    pub(super) fn decode(row: &[u8]) -> Result<Receipt> {
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

    pub(super) fn remove_version(
        table: &mut OldTable<'_>,
        uaid: u128,
        key: &str,
        version: &str,
    ) -> Result<bool> {
        let row_key = (arrival(key), uaid, key);
        let is_version = match table.get(row_key).map_err(backend)? {
            Some(row) => decode(row.value())?.version == version,
            None => false,
        };
        if is_version {
            table.remove(row_key).map_err(backend)?;
        }
        Ok(is_version)
    }

    pub(super) fn expired_after(
        table: &impl ReadableTable<OldKey, &'static [u8]>,
        start: Option<&Cursor>,
        budget: usize,
        now: u64,
    ) -> Result<super::super::Step<Cursor>> {
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
        super::super::step_over(rows, start, budget)
    }

    pub(super) fn remove_expired(
        table: &mut OldTable<'_>,
        (at, uaid, key): &Cursor,
        now: u64,
    ) -> Result<usize> {
        let key = (*at, *uaid, key.as_str());
        let still_expired = match table.get(key).map_err(backend)? {
            Some(row) => decode(row.value())?.expiry <= now,
            None => false,
        };
        if still_expired {
            table.remove(key).map_err(backend)?;
        }
        Ok(usize::from(still_expired))
    }
}

#[cfg(test)]
mod tests {
    use super::super::EmbeddedStore;
    use super::*;
    use autopush_common::notification::sort_key;
    use redb::ReadableDatabase;
    use uuid::Uuid;

    #[test]
    fn a_row_decodes_to_the_receipt_written_but_its_id() {
        let id = "gAAAAABp-version_";
        for state in MessageState::ALL {
            let receipt = Receipt::new(id, state, 1_764_000_000, 86_400);
            let read = decode(encode(&receipt), 86_400).unwrap();
            assert!(read.is_for(id) && !read.is_for("gAAAAABp-another"));
            assert_eq!(
                Receipt {
                    version: id.into(),
                    ..read
                },
                receipt
            );
        }
        let mut row = encode(&Receipt::new(id, MessageState::Delivered, 1, 1));
        row[0] = MessageState::ALL.len() as u8;
        assert!(decode(row, 1).is_err());
    }

    #[test]
    fn an_old_row_decodes_to_the_receipt_written() {
        for state in MessageState::ALL {
            let receipt = Receipt::new("gAAAAABp-version_", state, 1_764_000_000, 86_400);
            assert_eq!(
                old_layout::decode(&old_layout::encode(&receipt)).unwrap(),
                receipt
            );
        }
        let row = old_layout::encode(&Receipt::new("v", MessageState::Delivered, 1, 1));
        for cut in 0..row.len() - 1 {
            assert!(
                old_layout::decode(&row[..cut]).is_err(),
                "{cut} bytes decoded"
            );
        }
    }

    #[test]
    fn receipts_keys_sort_by_their_message_arrival_then_differ_by_user_and_key() {
        let (chid, uaid) = (Uuid::new_v4(), 7);
        let key = sort_key(&chid, None, Some(1_700_000_000_123_456));
        assert_eq!(
            key_of(uaid, &key)[..8],
            1_700_000_000_123_456u64.to_be_bytes()
        );
        assert!(
            key_of(uaid, &key) < key_of(uaid, &sort_key(&chid, None, Some(1_700_000_000_123_457)))
        );
        assert_ne!(key_of(uaid, &key), key_of(uaid + 1, &key));
        assert_ne!(
            key_of(uaid, &key),
            key_of(
                uaid,
                &sort_key(&Uuid::new_v4(), None, Some(1_700_000_000_123_456))
            )
        );
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

    /// A store the release before wrote, its receipts whole in the old
    /// table: they read as they did until their expiry, a DELETE of a
    /// settled message takes its receipt, the sweep removes those past
    /// their expiry, new receipts go to the new table meanwhile, and the
    /// first start that finds the old table empty drops it.
    #[tokio::test]
    async fn a_store_with_receipts_in_the_old_layout() {
        use crate::{Storage, StoredMessage};
        use autopush_common::Notification;
        use autopush_common::time::now_secs;

        let dir = tempfile::tempdir().unwrap();
        let (uaid, chid, now) = (Uuid::new_v4(), Uuid::new_v4(), now_secs());
        let delivered = MessageState::Delivered;
        let old_receipt = |n: u64, updated: u64| {
            let key = sort_key(&chid, None, Some(now * 1_000_000 + n));
            (
                key,
                Receipt::new(&format!("v{n}"), delivered, updated, 3600),
            )
        };
        let kept = old_receipt(1, now);
        let deleted = old_receipt(2, now);
        let expired = old_receipt(3, now - 7200);
        let topic_key = sort_key(&chid, Some("t"), None);
        let topic = Receipt::new("v-topic", MessageState::Replaced, now, 3600);
        let topic_own = autopush_common::notification::receipt_key(&topic_key, "v-topic").unwrap();
        {
            let db = redb::Database::create(dir.path().join("autopush.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            let mut old = txn.open_table(OLD_RECEIPTS).unwrap();
            for (key, receipt) in [
                &kept,
                &deleted,
                &expired,
                &(topic_own.clone(), topic.clone()),
            ] {
                let row = old_layout::encode(receipt);
                old.insert((arrival(key), uaid.as_u128(), key.as_str()), row.as_slice())
                    .unwrap();
            }
            drop(old);
            txn.commit().unwrap();
        }
        let open = || {
            EmbeddedStore::open(dir.path())
                .unwrap()
                .with_receipt_retention(3600)
        };
        let store = open();
        let read = async |store: &EmbeddedStore, key: &str| match store
            .read_message(&uaid, key)
            .await
            .unwrap()
        {
            Some(StoredMessage::Settled(receipt)) => Some(receipt),
            None => None,
            other => panic!("{key}: {other:?}"),
        };
        for (key, receipt) in [
            &kept,
            &deleted,
            &expired,
            &(topic_own.clone(), topic.clone()),
        ] {
            assert_eq!(read(&store, key).await.as_ref(), Some(receipt), "{key}");
        }
        let (key, receipt) = &deleted;
        assert!(!store.remove_message(&uaid, key, "v1").await.unwrap());
        assert!(
            store
                .remove_message(&uaid, key, &receipt.version)
                .await
                .unwrap()
        );
        assert_eq!(read(&store, key).await, None);
        // Another message under a key an old receipt holds is refused.
        let mut taken = Notification {
            channel_id: chid,
            version: "v-other".into(),
            ttl: 600,
            timestamp: now,
            topic: None,
            sortkey_timestamp: Some(now * 1_000_000 + 1),
            data: None,
            headers: None,
            urgency: None,
            durable: false,
        };
        let refused = store.save_messages(&uaid, vec![taken.clone()]).await;
        assert!(
            matches!(refused, Err(StorageError::KeyTaken(_))),
            "{refused:?}"
        );
        taken.sortkey_timestamp = Some(now * 1_000_000 + 4);
        store
            .save_messages(&uaid, vec![taken.clone()])
            .await
            .unwrap();
        let taken_key = taken.sort_key();
        let settled = store.settle_message(&uaid, &taken_key, "v-other", delivered);
        assert!(settled.await.unwrap());
        let mut removed = 0;
        loop {
            let step = store.sweep_expired_messages(2).await.unwrap();
            removed += step.removed;
            if step.finished_pass {
                break;
            }
        }
        assert_eq!(removed, 1);
        assert_eq!(read(&store, &expired.0).await, None);
        assert_eq!(read(&store, &kept.0).await.as_ref(), Some(&kept.1));
        let new = read(&store, &taken.sort_key()).await.unwrap();
        assert!(new.is_for("v-other") && new.state == delivered, "{new:?}");

        let old_table = |store: &EmbeddedStore| {
            let txn = store.db.begin_read().unwrap();
            old_in_read(&txn).unwrap().is_some()
        };
        drop(store);
        let store = open();
        assert!(old_table(&store), "dropped while it held receipts");
        for (key, version) in [(&kept.0, "v1"), (&topic_own, "v-topic")] {
            assert!(store.remove_message(&uaid, key, version).await.unwrap());
        }
        drop(store);
        let store = open();
        assert!(!old_table(&store), "kept once empty");
        assert!(read(&store, &taken.sort_key()).await.is_some());
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
                    let id: String = (0..204)
                        .map(|_| fastrand::choice(&id_chars).unwrap())
                        .collect();
                    let receipt =
                        Receipt::new(&id, MessageState::Delivered, arrival / 1_000_000, 86_400);
                    (fastrand::u128(..), key, receipt)
                })
                .collect();
            fastrand::shuffle(&mut rows);
            store
                .write(move |txn| {
                    let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
                    let rows = rows.iter().map(|(uaid, key, r)| (*uaid, key.as_str(), r));
                    put_all(&mut table, rows)
                })
                .await
                .unwrap();
        }
        let grown = size() - before;
        println!(
            "{RECEIPTS_WRITTEN} receipts: the file grew {grown} bytes, {:.1} bytes per receipt",
            grown as f64 / RECEIPTS_WRITTEN as f64
        );
        let txn = store.db.begin_write().unwrap();
        println!("{:?}", txn.stats().unwrap());
        let table = txn.open_table(RECEIPTS).unwrap();
        println!("{:?}", table.stats().unwrap());
    }
}
