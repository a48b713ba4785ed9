use super::format::*;
use super::rotation::*;
use super::*;
use crate::Storage;
use crate::embedded::EmbeddedStore;
use crate::embedded::backend;
use crate::embedded::receipts::RECEIPTS;
use crate::embedded::tests::store_with_receipts;
use crate::{CopyEnd, Receipt, StorageError, StoredMessage};
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use uuid::Uuid;

fn message(ts: u64, data: &str) -> Notification {
    Notification {
        channel_id: Uuid::from_u128(7),
        version: format!("v-{data}"),
        ttl: 60,
        timestamp: now_secs(),
        topic: None,
        sortkey_timestamp: Some(ts),
        data: Some(data.to_owned()),
        headers: None,
        urgency: None,
        durable: false,
    }
}

fn data(messages: &[Notification]) -> Vec<String> {
    messages.iter().map(|m| m.data.clone().unwrap()).collect()
}

/// One record, framed on its own.
fn frame(record: &RecordRef, data: Option<&str>) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    frame_into(&mut out, |out| record.write_json(out), data)?;
    Ok(out)
}

fn put(uaid: Uuid, m: &Notification) -> Vec<u8> {
    let mut m = m.clone();
    let data = m.data.take();
    let message = &m;
    frame(&RecordRef::Put { uaid, message }, data.as_deref()).unwrap()
}

#[test]
fn records_are_written_as_serde_json_writes_them() {
    let uaid = Uuid::new_v4();
    let mut message = message(1, "body");
    message.data = None;
    message.version = "gAAAAABp\"v\"".into();
    let settled = Receipt::new("v", MessageState::Delivered, 1_764_000_000, 86_400);
    let records = [
        RecordRef::Synced { to: 1 << 40 },
        RecordRef::Put {
            uaid,
            message: &message,
        },
        RecordRef::Settle {
            uaid,
            key: "02:00000000000000000001:k",
            version: &message.version,
            receipt: Some(SettledAs::of(&settled)),
        },
        RecordRef::Settle {
            uaid,
            key: "k\n",
            version: "v",
            receipt: None,
        },
    ];
    for record in &records {
        let mut out = Vec::new();
        record.write_json(&mut out).unwrap();
        let want = serde_json::to_string(record).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }
}

/// Settle records framed back to back (as settles queue them) are
/// each stamped, and read back whole and in order.
#[test]
fn settles_framed_back_to_back_are_all_stamped() {
    let uaid = Uuid::new_v4();
    let settled = Receipt::new("v", MessageState::Delivered, 1_764_000_000, 86_400);
    let mut queued = Vec::new();
    let keys = [
        "k",
        "a longer key, so that the records differ in size",
        "k2",
    ];
    for (i, key) in keys.iter().enumerate() {
        let receipt = (i != 1).then(|| SettledAs::of(&settled));
        let record = RecordRef::Settle {
            uaid,
            key,
            version: "v",
            receipt,
        };
        frame_into(&mut queued, |out| record.write_json(out), None).unwrap();
    }
    stamp_all(&mut queued, 7);
    let mut file = header(7).to_vec();
    file.resize(HEADER as usize, 0);
    file.extend(queued);
    let read: Vec<String> = read_records(&file, 7, Format::V2)
        .unwrap()
        .records
        .into_iter()
        .map(|record| match record {
            Record::Settle { key, .. } => key,
            _ => panic!("a settle was read as another record"),
        })
        .collect();
    assert_eq!(read, keys);
}

/// A journal file of `epoch` holding `records` (stamped with
/// `epoch`), as a node leaves it: each record a batch of its own, synced
/// before the next was written.
fn journal_file(epoch: u32, records: &[Vec<u8>]) -> Vec<u8> {
    journal_file_at(epoch, records).0
}

/// [`journal_file`], and where each record starts.
fn journal_file_at(epoch: u32, records: &[Vec<u8>]) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = header(epoch).to_vec();
    bytes.resize(HEADER as usize, 0);
    let mut starts = Vec::new();
    for record in records {
        let synced = batch_start(bytes.len() as u64);
        bytes.extend(stamped(&synced, epoch));
        starts.push(bytes.len());
        bytes.extend(stamped(record, epoch));
    }
    (bytes, starts)
}

/// The record that starts a batch written once the file was synced up to `to`.
fn batch_start(to: u64) -> Vec<u8> {
    frame(&RecordRef::Synced { to }, None).unwrap()
}

/// `record`, stamped with `epoch`.
fn stamped(record: &[u8], epoch: u32) -> Vec<u8> {
    let mut record = record.to_vec();
    stamp(&mut record, epoch);
    record
}

/// A journal file of `epoch` holding `records`, as the release before
/// wrote them ([`Format::V1`]): no batch says how far the file was synced.
fn journal_file_v1(epoch: u32, records: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = header_of(FILE_MAGIC_V1, epoch).to_vec();
    bytes.resize(HEADER as usize, 0);
    for record in records {
        bytes.extend(stamped(record, epoch));
    }
    bytes
}

/// What start-up finds in the file at `path` (of `dir`) after `bytes`
/// were left there: the messages of `uaid`, oldest first.
async fn replayed(dir: &Path, bytes: &[u8], uaid: &Uuid) -> Vec<String> {
    std::fs::write(dir.join("direct.journal"), bytes).unwrap();
    let store = EmbeddedStore::open(dir).unwrap();
    data(&store.fetch_messages(uaid, 10).await.unwrap())
}

/// A settle's record as written before its receipt lost its second
/// copy of the version.
#[derive(Serialize)]
enum OldRecord<'a> {
    Settle {
        uaid: Uuid,
        key: &'a str,
        version: &'a str,
        receipt: Option<&'a Receipt>,
    },
}

/// What a node killed mid-run leaves: unsettled messages, settled ones
/// with their receipts (in a record of this version and of the one
/// before), and a record torn by the kill. Start-up moves all but the
/// torn one into redb.
#[tokio::test]
async fn start_up_replays_what_a_killed_node_left() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let (a, b, c) = (message(1, "a"), message(2, "b"), message(3, "c"));
    let d = message(5, "d");
    let receipt = Receipt::new(&b.version, MessageState::Delivered, now_secs(), 3600);
    let old = OldRecord::Settle {
        uaid,
        key: &b.sort_key(),
        version: &b.version,
        receipt: Some(&receipt),
    };
    let mut settle = Vec::new();
    frame_into(&mut settle, |out| serde_json::to_writer(out, &old), None).unwrap();
    let d_receipt = Receipt::new(&d.version, MessageState::Delivered, now_secs(), 3600);
    let d_settle = RecordRef::Settle {
        uaid,
        key: &d.sort_key(),
        version: &d.version,
        receipt: Some(SettledAs::of(&d_receipt)),
    };
    let d_settle = frame(&d_settle, None).unwrap();
    let records = [put(uaid, &a), put(uaid, &b), put(uaid, &c), settle];
    let records = [&records[..], &[put(uaid, &d), d_settle]].concat();
    let mut bytes = journal_file(7, &records);
    let mut torn = put(uaid, &message(4, "torn"));
    stamp(&mut torn, 7);
    bytes.extend_from_slice(&torn[..torn.len() - 11]);
    let path = dir.path().join("direct.journal");
    std::fs::write(&path, bytes).unwrap();

    let store = EmbeddedStore::open(dir.path())
        .unwrap()
        .with_receipt_retention(3600);
    // The file starts over in the next epoch, zeros past its first page.
    let file = std::fs::read(&path).unwrap();
    assert_eq!(epoch_of(&file).unwrap(), Some(8));
    assert!(
        read_records(&file, 8, Format::V2)
            .unwrap()
            .records
            .is_empty()
    );
    assert!(file.len() as u64 >= PREALLOCATE);
    assert_eq!(
        data(&store.fetch_messages(&uaid, 10).await.unwrap()),
        ["a", "c"]
    );
    assert_eq!(
        store.read_message(&uaid, &b.sort_key()).await.unwrap(),
        Some(StoredMessage::Settled(receipt))
    );
    assert_eq!(
        store.read_message(&uaid, &d.sort_key()).await.unwrap(),
        Some(StoredMessage::Settled(d_receipt))
    );
    // Replayed messages are stored ones now: they settle in redb.
    let key = a.sort_key();
    let delivered = MessageState::Delivered;
    assert!(
        store
            .settle_message(&uaid, &key, &a.version, delivered)
            .await
            .unwrap()
    );
    assert_eq!(data(&store.fetch_messages(&uaid, 10).await.unwrap()), ["c"]);
}

/// Past the rotation size, unsettled messages move into redb and the
/// file starts over; every message stays readable and settles once,
/// wherever it is; closing the store leaves nothing to replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_and_closing_keep_every_message() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let messages: Vec<_> = (0..100).map(|i| message(i, &format!("m{i:03}"))).collect();
    for (i, m) in messages.iter().enumerate() {
        store.save_direct(&uaid, m.clone()).await.unwrap();
        if i % 2 == 0 {
            let delivered = MessageState::Delivered;
            let key = m.sort_key();
            assert!(
                store
                    .settle_message(&uaid, &key, &m.version, delivered)
                    .await
                    .unwrap()
            );
        }
    }
    let odd: Vec<String> = messages
        .iter()
        .skip(1)
        .step_by(2)
        .map(|m| m.data.clone().unwrap())
        .collect();
    assert_eq!(data(&store.fetch_messages(&uaid, 100).await.unwrap()), odd);
    let path = dir.path().join("direct.journal");
    // Rotated in place: the file never grew past its zeros.
    assert_eq!(std::fs::metadata(&path).unwrap().len(), PREALLOCATE);
    let m = &messages[1];
    let deleted = MessageState::Deleted;
    assert!(
        store
            .settle_message(&uaid, &m.sort_key(), &m.version, deleted)
            .await
            .unwrap()
    );
    assert!(
        !store
            .settle_message(&uaid, &m.sort_key(), &m.version, deleted)
            .await
            .unwrap()
    );
    drop(store);
    let file = std::fs::read(&path).unwrap();
    let epoch = epoch_of(&file).unwrap().unwrap();
    let read = read_records(&file, epoch, Format::V2).unwrap();
    assert!(read.records.is_empty());
    let store = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(
        data(&store.fetch_messages(&uaid, 100).await.unwrap()),
        odd[1..]
    );
}

/// Where the current epoch's records end in the journal file at `path`
/// (the journal thread writes them one after another).
fn records_end(path: &Path) -> u64 {
    let file = std::fs::read(path).unwrap();
    let epoch = epoch_of(&file).unwrap().unwrap();
    let mut at = HEADER as usize;
    while let Some((_, size)) = record_at(&file[at..], epoch) {
        at += size;
    }
    at as u64
}

/// The current epoch's records in the journal file at `path`.
fn records_in(path: &Path) -> Vec<Record> {
    let file = std::fs::read(path).unwrap();
    let epoch = epoch_of(&file).unwrap().unwrap();
    read_records(&file, epoch, Format::V2).unwrap().records
}

/// The versions of the messages put in the journal file at `path`.
fn puts_in(path: &Path) -> Vec<String> {
    records_in(path)
        .into_iter()
        .filter_map(|record| match record {
            Record::Put { message, .. } => Some(message.version),
            _ => None,
        })
        .collect()
}

/// A message staged for a connected client is seen at once; acked
/// within its grace it is never written, its sender waits no longer and
/// hears it was acked (its receipt is sealed into the id it gets, so
/// none is kept); one not acked is written when its sender asks for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_acked_within_its_grace_is_never_written() {
    use futures_util::FutureExt;
    let (dir, uaid, store) = store_with_receipts();
    let (acked, kept) = (message(1, "acked"), message(2, "kept"));
    let first = store.stage_direct(&uaid, acked.clone()).await.unwrap();
    let second = store.stage_direct(&uaid, kept.clone()).await.unwrap();
    assert_eq!(
        data(&store.fetch_messages(&uaid, 10).await.unwrap()),
        ["acked", "kept"]
    );
    let delivered = MessageState::Delivered;
    let key = acked.sort_key();
    assert!(
        store
            .settle_message(&uaid, &key, &acked.version, delivered)
            .await
            .unwrap()
    );
    let answered = first.saved_or_settled().now_or_never();
    assert!(
        matches!(answered, Some(Ok(CopyEnd::Acked))),
        "the ack did not answer: {answered:?}"
    );
    second.saved_now().await.unwrap();
    let path = dir.path().join("direct.journal");
    assert_eq!(puts_in(&path), [kept.version]);

    // What a node killed now leaves: start-up finds the message still
    // pending, and nothing of the acked one.
    let left = std::fs::read(&path).unwrap();
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("direct.journal"), left).unwrap();
    let restarted = EmbeddedStore::open(other.path())
        .unwrap()
        .with_receipt_retention(3600);
    assert_eq!(
        data(&restarted.fetch_messages(&uaid, 10).await.unwrap()),
        ["kept"]
    );
    let receipt = restarted.read_message(&uaid, &key).await.unwrap();
    assert!(receipt.is_none(), "{receipt:?}");
}

/// The receipt of a message acked within its grace reaches the file on
/// its own, within [`TOMBSTONES_WAIT`] and without waiting for a grace
/// (30 s under test) to end; no message is written with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_is_written_without_its_message() {
    let (dir, uaid, store) = store_with_receipts();
    let (acked, waiting) = (message(1, "acked"), message(2, "waiting"));
    // Its sender stopped waiting (hung up): no id seals its receipt.
    drop(store.stage_direct(&uaid, acked.clone()).await.unwrap());
    let _second = store.stage_direct(&uaid, waiting.clone()).await.unwrap();
    let (key, delivered) = (acked.sort_key(), MessageState::Delivered);
    let settle = store.settle_message(&uaid, &key, &acked.version, delivered);
    assert!(settle.await.unwrap());
    let path = dir.path().join("direct.journal");
    let settles = || {
        records_in(&path)
            .into_iter()
            .filter_map(|record| match record {
                Record::Settle {
                    version, receipt, ..
                } => Some((version, receipt)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while settles().is_empty() {
        assert!(Instant::now() < deadline, "no settle record was written");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let written = settles();
    assert!(
        matches!(&written[..], [(version, Some(receipt))]
            if *version == acked.version && receipt.state == delivered),
        "{} settle records",
        written.len()
    );
    assert!(puts_in(&path).is_empty(), "a message was written");
}

/// The ack of a written message has its tombstone written with the
/// journal thread's next batch, without a sync and without waiting for
/// a grace (30 s under test): a node killed once it is there does not
/// deliver the message again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_written_message_acked_is_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let (acked, kept) = (message(1, "acked"), message(2, "kept"));
    store.save_direct(&uaid, acked.clone()).await.unwrap();
    store.save_direct(&uaid, kept.clone()).await.unwrap();
    let key = acked.sort_key();
    let settle = store.settle_message(&uaid, &key, &acked.version, MessageState::Delivered);
    assert!(settle.await.unwrap());
    let path = dir.path().join("direct.journal");
    let settled = || {
        records_in(&path).into_iter().any(
            |record| matches!(record, Record::Settle { version, .. } if version == acked.version),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !settled() {
        assert!(Instant::now() < deadline, "no tombstone was written");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let other = tempfile::tempdir().unwrap();
    std::fs::copy(&path, other.path().join("direct.journal")).unwrap();
    let restarted = EmbeddedStore::open(other.path()).unwrap();
    assert_eq!(
        data(&restarted.fetch_messages(&uaid, 10).await.unwrap()),
        ["kept"]
    );
}

/// Every message of `settled` reads as its receipt.
async fn assert_receipts(store: &EmbeddedStore, uaid: &Uuid, settled: &[Notification], when: &str) {
    for m in settled {
        let receipt = store.read_message(uaid, &m.sort_key()).await.unwrap();
        assert!(
            matches!(&receipt, Some(StoredMessage::Settled(r)) if r.is_for(&m.version)),
            "{when}, {}: {receipt:?}",
            m.version
        );
    }
}

/// Tasks stage, save and settle messages at random while the file
/// starts over every few records and receipts are flushed every few
/// settles (both small under test): every message
/// whose copy answered and that no settle took stays readable, before
/// and after the store is closed and opened again; every settled one
/// is gone, its receipt kept, and reads as its receipt all along, also
/// while a checkpoint moves it; every one acked while its sender waited
/// leaves nothing (its sender seals it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_messages_survive_rotations() {
    let (dir, uaid, store) = store_with_receipts();
    let store = Arc::new(store);
    let clock = Arc::new(AtomicU64::new(1));
    let settled_so_far = Arc::new(Mutex::new(Vec::<Notification>::new()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (store, settled, done) = (store.clone(), settled_so_far.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let settled = lock(&settled).clone();
                assert_receipts(&store, &uaid, &settled, "while settling").await;
                tokio::task::yield_now().await;
            }
        })
    };
    let tasks: Vec<_> = (0..4u64)
        .map(|task| {
            let (store, clock) = (store.clone(), clock.clone());
            let settled_so_far = settled_so_far.clone();
            tokio::spawn(async move {
                let (mut kept, mut settled, mut sealed) = (Vec::new(), Vec::new(), Vec::new());
                for i in 0..60u64 {
                    let ts = clock.fetch_add(1, Ordering::Relaxed);
                    let m = message(ts, &format!("m{ts:04}"));
                    match (task * 7 + i * 13) % 4 {
                        0 => store.save_direct(&uaid, m.clone()).await.unwrap(),
                        1 => {
                            let copy = store.stage_direct(&uaid, m.clone()).await.unwrap();
                            tokio::task::yield_now().await;
                            copy.saved_now().await.unwrap();
                        }
                        2 => {
                            // Its sender stopped waiting: the ack keeps a receipt.
                            drop(store.stage_direct(&uaid, m.clone()).await.unwrap());
                            tokio::task::yield_now().await;
                            let (key, delivered) = (m.sort_key(), MessageState::Delivered);
                            let settle = store.settle_message(&uaid, &key, &m.version, delivered);
                            assert!(settle.await.unwrap(), "{} did not settle", m.version);
                            lock(&settled_so_far).push(m.clone());
                            settled.push(m);
                            continue;
                        }
                        _ => {
                            let copy = store.stage_direct(&uaid, m.clone()).await.unwrap();
                            tokio::task::yield_now().await;
                            let (key, delivered) = (m.sort_key(), MessageState::Delivered);
                            let settle = store.settle_message(&uaid, &key, &m.version, delivered);
                            assert!(settle.await.unwrap(), "{} did not settle", m.version);
                            // Sealed, unless a rotation moved it into redb
                            // first: then its receipt is kept there.
                            match copy.saved_or_settled().await.unwrap() {
                                CopyEnd::Acked => sealed.push(m),
                                CopyEnd::Saved => {
                                    lock(&settled_so_far).push(m.clone());
                                    settled.push(m);
                                }
                            }
                            continue;
                        }
                    }
                    kept.push(m);
                }
                (kept, settled, sealed)
            })
        })
        .collect();
    let (mut kept, mut settled, mut sealed) = (Vec::new(), Vec::new(), Vec::new());
    for task in tasks {
        let (k, s, n) = task.await.unwrap();
        kept.extend(k);
        settled.extend(s);
        sealed.extend(n);
    }
    done.store(true, Ordering::Relaxed);
    reader.await.unwrap();
    kept.sort_by_key(|m| m.sortkey_timestamp);
    let kept = data(&kept);
    assert_eq!(
        data(&store.fetch_messages(&uaid, 1000).await.unwrap()),
        kept
    );
    assert_receipts(&store, &uaid, &settled, "before closing").await;
    drop(store);
    let store = EmbeddedStore::open(dir.path())
        .unwrap()
        .with_receipt_retention(3600);
    assert_eq!(
        data(&store.fetch_messages(&uaid, 1000).await.unwrap()),
        kept
    );
    assert_receipts(&store, &uaid, &settled, "after opening again").await;
    for m in &sealed {
        let row = store.read_message(&uaid, &m.sort_key()).await.unwrap();
        assert!(
            row.is_none(),
            "{} was sealed, yet stored: {row:?}",
            m.version
        );
    }
}

/// A rotation that fails (here: the receipts table is not one redb can
/// open as such) leaves the staged messages it was moving
/// where they were; the journal thread, which skipped them meanwhile,
/// writes them after all and answers their senders (within the test's
/// 30 s grace only because of that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rotation_still_writes_what_it_skipped() {
    let (dir, uaid, store) = store_with_receipts();
    let (staged, acked) = (message(1, "staged"), message(2, "acked"));
    let acked_key = acked.sort_key();
    // A receipts table of another type: every move into it fails.
    store
        .write(move |txn| {
            txn.delete_table(RECEIPTS).map_err(backend)?;
            let other = redb::TableDefinition::<u64, u64>::new("receipt_rows");
            txn.open_table(other).map_err(backend)?;
            Ok(())
        })
        .await
        .unwrap();
    // The file filled to just short of the rotation size (4 KiB under
    // test): the acked message's tombstone, written in a batch of its
    // own, starts the rotation while the other is staged.
    let delivered = MessageState::Delivered;
    let receipt = Receipt::new(&acked.version, delivered, now_secs(), 3600);
    let settle = RecordRef::Settle {
        uaid,
        key: &acked_key,
        version: &acked.version,
        receipt: Some(SettledAs::of(&receipt)),
    };
    // Each batch starts with a record of how far the file was synced.
    let synced = batch_start(HEADER).len() as u64;
    let tombstone = synced + frame(&settle, None).unwrap().len() as u64;
    let path = dir.path().join("direct.journal");
    let left = || ROTATE_AT.saturating_sub(records_end(&path) - HEADER);
    let mut ts = 10;
    while left() > tombstone + 1024 {
        store
            .save_direct(&uaid, message(ts, "small"))
            .await
            .unwrap();
        ts += 1;
    }
    // Records are whole multiples of 8 bytes: this one leaves 8 fewer
    // than the tombstone takes.
    let want = left() - tombstone + 8;
    let last = (1..)
        .map(|n| message(ts, &"x".repeat(n)))
        .find(|m| synced + put(uaid, m).len() as u64 >= want)
        .unwrap();
    store.save_direct(&uaid, last).await.unwrap();
    assert_eq!(left(), tombstone - 8);
    let copy = store.stage_direct(&uaid, staged.clone()).await.unwrap();
    // Its sender gone: the ack leaves a receipt, and so a tombstone.
    drop(store.stage_direct(&uaid, acked.clone()).await.unwrap());
    let settle = store.settle_message(&uaid, &acked_key, &acked.version, delivered);
    assert!(settle.await.unwrap());
    let answered = tokio::time::timeout(Duration::from_secs(20), copy.saved_or_settled());
    assert!(
        matches!(answered.await, Ok(Ok(CopyEnd::Saved))),
        "the staged message was not written after the failed rotation"
    );
    assert!(puts_in(&dir.path().join("direct.journal")).contains(&staged.version));
}

/// Stage and ack FLUSH_AT (4 under test) messages, with receipts: the
/// journal thread queues a checkpoint once their tombstones are
/// written. Returns the messages.
async fn settle_for_a_checkpoint(store: &EmbeddedStore, uaid: &Uuid) -> Vec<Notification> {
    let settled: Vec<_> = (0..FLUSH_AT as u64)
        .map(|i| message(i + 1, &format!("m{i}")))
        .collect();
    for m in &settled {
        // Its sender gone: no id seals it, so its receipt is kept.
        drop(store.stage_direct(uaid, m.clone()).await.unwrap());
        let (key, delivered) = (m.sort_key(), MessageState::Delivered);
        let settle = store.settle_message(uaid, &key, &m.version, delivered);
        assert!(settle.await.unwrap());
    }
    settled
}

/// The writer runs a checkpoint again, in a transaction of its own,
/// when the one it shared with other writes failed: the receipts it
/// took out the first time are the ones it commits the second, and
/// every settled message still reads as its receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_run_twice_keeps_its_receipts() {
    let (_dir, uaid, store) = store_with_receipts();
    let store = Arc::new(store);
    // Holds the writer, so that the checkpoint and the failing write
    // below queue behind it and share the next transaction.
    let busy = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .write(|_| {
                    std::thread::sleep(Duration::from_millis(500));
                    Ok(())
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let settled = settle_for_a_checkpoint(&store, &uaid).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let failed = store
        .write(|_| -> Result<()> { Err(StorageError::Backend("a failing write".into())) })
        .await;
    assert!(failed.is_err());
    busy.await.unwrap().unwrap();
    assert_receipts(&store, &uaid, &settled, "after the checkpoint ran twice").await;
}

/// A checkpoint of receipts does not hold up the journal thread: a
/// message hurried while the checkpoint waits for the writer is written
/// and answered. The writer is held here until then: a journal thread
/// that waited for its checkpoint would not answer before the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_does_not_hold_up_the_journal() {
    let (_dir, uaid, store) = store_with_receipts();
    let store = Arc::new(store);
    let (release, held) = std::sync::mpsc::channel::<()>();
    let busy = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .write(move |_| {
                    let _ = held.recv_timeout(Duration::from_secs(60));
                    Ok(())
                })
                .await
        })
    };
    let settled = settle_for_a_checkpoint(&store, &uaid).await;
    let guard = Instant::now() + Duration::from_secs(20);
    while !lock(&store.journal.shared.state).checkpointing {
        assert!(Instant::now() < guard, "no checkpoint was queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let hurried = message(100, "hurried");
    let copy = store.stage_direct(&uaid, hurried.clone()).await.unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(20), copy.saved_now()).await;
    release.send(()).unwrap();
    assert!(
        matches!(answered, Ok(Ok(CopyEnd::Saved))),
        "the journal thread waited for its checkpoint"
    );
    busy.await.unwrap().unwrap();
    assert_receipts(&store, &uaid, &settled, "after the checkpoint").await;
}

/// Open the store in `dir` on a journal file holding `bytes`: the error
/// that stops it.
fn refused(dir: &Path, bytes: &[u8]) -> String {
    std::fs::write(dir.join("direct.journal"), bytes).unwrap();
    match EmbeddedStore::open(dir) {
        Ok(_) => panic!("the store opened: what it could not read was dropped without a word"),
        Err(error) => error.to_string(),
    }
}

/// The journal writes in order and syncs before it answers: a record of
/// the current epoch that cannot be read, before a batch written once the
/// file was synced past it, is not a batch a crash cut short but a record
/// whose sender heard 201. Start-up refuses, naming the file and the
/// offset, rather than drop it without a word.
#[test]
fn a_corrupt_record_in_the_middle_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let records = [1, 2, 3].map(|i| put(uaid, &message(i, &format!("m{i}"))));
    let (mut bytes, starts) = journal_file_at(3, &records);
    let second = starts[1];
    bytes[second + RECORD_HEAD + 10] ^= 0x04;
    let error = refused(dir.path(), &bytes);
    let path = dir.path().join("direct.journal");
    assert!(
        error.contains(&path.display().to_string()) && error.contains(&format!("offset {second}")),
        "{error}"
    );
}

/// A gap (zeros, or an older record) before a batch written once the file
/// was synced past it is damage too: the one writer writes in order, and
/// starts a new epoch after a failed write. Refused as well.
#[test]
fn a_gap_before_a_batch_that_says_it_was_synced_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let (a, b) = (message(1, "a"), message(2, "b"));
    let mut bytes = journal_file(3, &[put(uaid, &a)]);
    let gap = bytes.len();
    bytes.extend([0u8; 40]);
    bytes.extend(stamped(&put(uaid, &message(9, "old")), 2));
    bytes.extend(stamped(&batch_start(bytes.len() as u64), 3));
    bytes.extend(stamped(&put(uaid, &b), 3));
    let error = refused(dir.path(), &bytes);
    assert!(error.contains(&format!("offset {gap}")), "{error}");
}

/// The same gap before a batch that says the file was synced only up to
/// the gap: a power loss kept that batch's later blocks and not the ones
/// before. Never synced, so nobody was told it was saved: dropped, and
/// every record before the gap is kept.
#[tokio::test]
async fn a_gap_before_a_batch_never_synced_drops_it() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let (a, b) = (message(1, "a"), message(2, "b"));
    let mut bytes = journal_file(3, &[put(uaid, &a)]);
    let gap = bytes.len();
    bytes.extend([0u8; 40]);
    bytes.extend(stamped(&batch_start(gap as u64), 3));
    bytes.extend(stamped(&put(uaid, &b), 3));
    assert_eq!(replayed(dir.path(), &bytes, &uaid).await, ["a"]);
}

/// A journal written by the release before (no batch says how far the file
/// was synced) is read as that release read it: its records replayed, a
/// gap before whole records refused (nothing tells a batch never synced
/// from damage there), and the file starts over in this release's format.
#[tokio::test]
async fn a_journal_of_the_release_before_opens_as_it_did() {
    let uaid = Uuid::new_v4();
    let (a, b) = (message(1, "a"), message(2, "b"));
    let records = [put(uaid, &a), put(uaid, &b)];
    let dir = tempfile::tempdir().unwrap();
    let bytes = journal_file_v1(6, &records);
    assert_eq!(replayed(dir.path(), &bytes, &uaid).await, ["a", "b"]);
    let file = std::fs::read(dir.path().join("direct.journal")).unwrap();
    let format = first_page(&file).unwrap().map(|(_, format)| format);
    assert_eq!(format, Some(Format::V2));

    let dir = tempfile::tempdir().unwrap();
    let mut bytes = journal_file_v1(6, &records[..1]);
    let gap = bytes.len();
    bytes.extend([0u8; 40]);
    bytes.extend(stamped(&records[1], 6));
    let error = refused(dir.path(), &bytes);
    assert!(error.contains(&format!("offset {gap}")), "{error}");
}

/// Records of an earlier epoch were moved into redb when the file
/// started over: they are never read again, even where the new epoch
/// has not overwritten them yet.
#[tokio::test]
async fn an_earlier_epoch_is_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let mut bytes = journal_file(5, &[put(uaid, &message(1, "new"))]);
    let mut stale = put(uaid, &message(2, "stale"));
    stamp(&mut stale, 4);
    bytes.extend(stale);
    assert_eq!(replayed(dir.path(), &bytes, &uaid).await, ["new"]);
}

/// A first page that is not a journal's stops the start, naming it,
/// rather than dropping what the file may hold.
#[test]
fn a_file_that_is_not_a_journal_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("direct.journal"), b"something else").unwrap();
    let Err(error) = EmbeddedStore::open(dir.path()) else {
        panic!("opened");
    };
    assert!(error.to_string().contains("direct journal"), "{error}");
}

/// A first page of zeros with whole records after it is not a new file:
/// its epoch was lost, and with it which records are current. Refused,
/// naming the file and the first record, rather than read as empty.
#[tokio::test]
async fn a_zeroed_first_page_before_records_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let mut bytes = journal_file(
        3,
        &[put(uaid, &message(1, "a")), put(uaid, &message(2, "b"))],
    );
    bytes[..HEADER as usize].fill(0);
    let error = refused(dir.path(), &bytes);
    let path = dir.path().join("direct.journal");
    assert!(
        error.contains(&path.display().to_string()) && error.contains(&format!("offset {HEADER}")),
        "{error}"
    );
    // Zeros and nothing else: a file whose first start was cut short.
    let zeros = vec![0; 3 * HEADER as usize];
    assert!(replayed(dir.path(), &zeros, &uaid).await.is_empty());
}

/// A message whose receipt is in redb was settled there: a replay of its
/// record (left by a kill during the rotation that moved it, when its ack
/// came meanwhile, or by a power loss after a checkpoint, with the
/// tombstone unsynced) neither brings it back nor turns its receipt back
/// into `stored`.
#[tokio::test]
async fn a_replay_does_not_resurrect_a_settled_message() {
    let (dir, uaid, store) = store_with_receipts();
    let m = message(1, "settled");
    store.save_messages(&uaid, vec![m.clone()]).await.unwrap();
    let (key, delivered) = (m.sort_key(), MessageState::Delivered);
    assert!(
        store
            .settle_message(&uaid, &key, &m.version, delivered)
            .await
            .unwrap()
    );
    drop(store);
    let bytes = journal_file(9, &[put(uaid, &m)]);
    std::fs::write(dir.path().join("direct.journal"), bytes).unwrap();
    let store = EmbeddedStore::open(dir.path())
        .unwrap()
        .with_receipt_retention(3600);
    let pending = data(&store.fetch_messages(&uaid, 10).await.unwrap());
    assert!(
        pending.is_empty(),
        "the settled message came back: {pending:?}"
    );
    let row = store.read_message(&uaid, &key).await.unwrap();
    assert!(
        matches!(&row, Some(StoredMessage::Settled(r)) if r.state == delivered),
        "{row:?}"
    );
}

/// Wait (hang-guarded) until the store's health says `healthy`.
async fn await_health(store: &EmbeddedStore, healthy: bool, what: &str) {
    let guard = Instant::now() + Duration::from_secs(20);
    while store.health_check().await.is_ok() != healthy {
        assert!(Instant::now() < guard, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The epoch the first page of the journal file at `path` names.
fn epoch_in(path: &Path) -> u32 {
    epoch_of(&std::fs::read(path).unwrap()).unwrap().unwrap()
}

/// A node killed now: what a start-up on a copy of its journal file alone
/// (not its redb) finds pending for `uaid`.
async fn replayed_from_a_copy(path: &Path, uaid: &Uuid) -> Vec<String> {
    let other = tempfile::tempdir().unwrap();
    replayed(other.path(), &std::fs::read(path).unwrap(), uaid).await
}

/// A new epoch's first page written, its sync failed: the first page may
/// name the new epoch or the old one. Nothing more is stamped with either
/// until it is synced: the journal takes no message (redb does, health
/// says so) until a new first page is synced, then takes messages again,
/// and a node killed after that replays them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sync_of_a_new_first_page_stops_the_journal_until_one_is_synced() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let path = dir.path().join("direct.journal");
    let first = epoch_in(&path);
    lock(&store.journal.shared.state).faults.header_sync = true;
    // Past the rotation size (4 KiB under test), the file starts over.
    let mut ts = 1;
    while epoch_in(&path) == first {
        assert!(ts < 1000, "the file did not start over");
        let _ = store.save_direct(&uaid, message(ts, "before")).await;
        ts += 1;
    }
    await_health(&store, false, "health did not say the journal cannot write").await;
    // Not the journal's to take on an unsynced first page: redb's.
    store
        .save_direct(&uaid, message(ts, "during"))
        .await
        .unwrap();
    lock(&store.journal.shared.state).faults.header_sync = false;
    await_health(&store, true, "the journal did not start over again").await;
    // The failed epoch's number again: no record was stamped with it.
    assert_eq!(epoch_in(&path), first + 1);
    store
        .save_direct(&uaid, message(ts + 1, "after"))
        .await
        .unwrap();
    assert_eq!(replayed_from_a_copy(&path, &uaid).await, ["after"]);
}

/// A batch's write or sync failed: what it held may not be on disk, and a
/// later sync would not say so (Linux marks the pages clean). The journal
/// takes no message until it is on a new epoch, synced; what it had taken
/// before is kept (moved into redb), and what it takes after is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_or_sync_of_a_batch_stops_the_journal_until_a_new_epoch() {
    for fail_write in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let uaid = Uuid::new_v4();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let path = dir.path().join("direct.journal");
        store.save_direct(&uaid, message(1, "kept")).await.unwrap();
        let before = epoch_in(&path);
        let set = |on: bool| {
            let faults = &mut lock(&store.journal.shared.state).faults;
            match fail_write {
                true => faults.batch_write = on,
                false => faults.batch_sync = on,
            }
        };
        set(true);
        let failed = store.save_direct(&uaid, message(2, "failed")).await;
        assert!(failed.is_err(), "a message was answered on a failed batch");
        await_health(&store, false, "health did not say the journal cannot write").await;
        set(false);
        await_health(&store, true, "the journal did not start over").await;
        assert!(
            epoch_in(&path) > before,
            "the journal went on in the same epoch"
        );
        store.save_direct(&uaid, message(3, "after")).await.unwrap();
        assert_eq!(
            data(&store.fetch_messages(&uaid, 10).await.unwrap()),
            ["kept", "after"]
        );
        assert_eq!(replayed_from_a_copy(&path, &uaid).await, ["after"]);
    }
}

/// Three messages' records in a journal file of epoch 5, each a batch of
/// its own, and where each record starts.
fn three_records(uaid: Uuid) -> (Vec<u8>, Vec<usize>) {
    let records = [1, 2, 3].map(|i| put(uaid, &message(i, &format!("m{i}"))));
    journal_file_at(5, &records)
}

/// One bit flipped in each part of a record (its magic, epoch, length,
/// checksum, JSON, data, padding aside): in the middle, the node refuses
/// and names the record's offset, and `db replay-journal` reads the
/// others; in the last record, it is a torn tail: the others are kept.
#[tokio::test]
async fn a_flipped_bit_in_each_part_of_a_record() {
    let uaid = Uuid::new_v4();
    let (bytes, starts) = three_records(uaid);
    let data_at = |start: usize| {
        let json = u32_at(&bytes, start + RECORD_HEAD).unwrap() as usize;
        start + RECORD_HEAD + 4 + json + 1
    };
    for (victim, survivors) in [(1, vec!["m1", "m3"]), (2, vec!["m1", "m2"])] {
        let start = starts[victim];
        let parts = [
            ("magic", start + 1),
            ("epoch", start + 4),
            ("length", start + 9),
            ("checksum", start + 13),
            ("json", start + RECORD_HEAD + 6),
            ("data", data_at(start)),
        ];
        for (part, at) in parts {
            let dir = tempfile::tempdir().unwrap();
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x10;
            if victim == 1 {
                let error = refused(dir.path(), &flipped);
                assert!(
                    error.contains(&format!("offset {start}")),
                    "{part}: {error}"
                );
                let aside = dir.path().join("direct.journal.unreadable");
                std::fs::rename(dir.path().join("direct.journal"), &aside).unwrap();
                let store = EmbeddedStore::open(dir.path()).unwrap();
                let found = store.replay_journal(&aside).unwrap();
                assert_eq!(
                    (found.records, &found.skipped[..]),
                    (2, &[start][..]),
                    "{part}"
                );
                let pending = data(&store.fetch_messages(&uaid, 10).await.unwrap());
                assert_eq!(pending, survivors, "{part}");
            } else {
                let pending = replayed(dir.path(), &flipped, &uaid).await;
                assert_eq!(pending, survivors, "{part}");
            }
        }
    }
}

/// A file cut anywhere (a torn tail, or a truncated copy) keeps every
/// record it still holds whole, and never stops the start.
#[tokio::test]
async fn a_file_cut_anywhere_keeps_its_whole_records() {
    let uaid = Uuid::new_v4();
    let (bytes, starts) = three_records(uaid);
    let all = ["m1", "m2", "m3"];
    for cut in (HEADER as usize..=bytes.len()).step_by(5) {
        let dir = tempfile::tempdir().unwrap();
        // Whole up to its body's end; the padding after it may be cut.
        let whole = starts
            .iter()
            .filter(|at| **at + RECORD_HEAD + u32_at(&bytes, **at + 8).unwrap() as usize <= cut)
            .count();
        let pending = replayed(dir.path(), &bytes[..cut], &uaid).await;
        assert_eq!(pending, all[..whole], "cut at {cut}");
    }
    // Cut inside the first page: not a journal's any more.
    let dir = tempfile::tempdir().unwrap();
    refused(dir.path(), &bytes[..12]);
}

/// A first page lost: `db replay-journal` reads the records of the latest
/// epoch it finds, not the older ones still in the file.
#[tokio::test]
async fn replay_journal_reads_the_latest_epoch_of_a_file_without_its_first_page() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let (mut bytes, _) = three_records(uaid);
    let mut older = put(uaid, &message(9, "older"));
    stamp(&mut older, 4);
    bytes.extend(older);
    bytes[..16].fill(0);
    let aside = dir.path().join("journal.aside");
    std::fs::write(&aside, &bytes).unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let found = store.replay_journal(&aside).unwrap();
    assert_eq!((found.epoch, found.records), (Some(5), 3));
    let pending = data(&store.fetch_messages(&uaid, 10).await.unwrap());
    assert_eq!(pending, ["m1", "m2", "m3"]);
}

/// The disk writes in blocks of this size (a sector; a page is eight):
/// until a sync returns, a power loss may keep any of them and not others.
const BLOCK: usize = 512;

/// Until `fdatasync` returns, the disk may keep any subset of a batch's
/// blocks. A power loss that kept a later block of the last batch and not
/// its first leaves whole records after a place that holds none: not
/// damage to what was synced, but a batch never synced, whose senders
/// were not answered. The node starts, with every message synced before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_loss_that_kept_a_later_block_of_an_unsynced_batch_keeps_what_was_synced() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let path = dir.path().join("direct.journal");
    store
        .save_direct(&uaid, message(1, "synced"))
        .await
        .unwrap();
    let batch = records_end(&path) as usize;
    // Two messages in one batch, the first longer than a block.
    let long = "b".repeat(BLOCK);
    let first = store.stage_direct(&uaid, message(2, &long)).await.unwrap();
    let second = store.stage_direct(&uaid, message(3, "c")).await.unwrap();
    first.saved_now().await.unwrap();
    second.saved_now().await.unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let end = records_end(&path) as usize;
    let lost = batch..(batch + 1).next_multiple_of(BLOCK);
    assert!(
        end > lost.end + RECORD_HEAD,
        "the batch ends in its first block"
    );
    // The batch was written, its sync had not returned: its first block
    // is as it was before, zeros; its later ones reached the disk.
    bytes[lost].fill(0);
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("direct.journal"), &bytes).unwrap();
    let restarted = match EmbeddedStore::open(other.path()) {
        Ok(store) => store,
        Err(e) => panic!("the node refused to start after a power loss: {e}"),
    };
    assert_eq!(
        data(&restarted.fetch_messages(&uaid, 10).await.unwrap()),
        ["synced"]
    );
}

/// While the journal takes no message (a batch's sync failed, and so does
/// every sync of a new first page), redb takes them: a message for a
/// client not connected (`save_direct`) and the copy of one for a
/// connected client (`stage_direct`, saved at once) are stored, readable,
/// and settle in redb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_journal_takes_no_message_redb_takes_them() {
    let dir = tempfile::tempdir().unwrap();
    let uaid = Uuid::new_v4();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    {
        let faults = &mut lock(&store.journal.shared.state).faults;
        (faults.batch_sync, faults.header_sync) = (true, true);
    }
    let failed = store.save_direct(&uaid, message(1, "failed")).await;
    assert!(failed.is_err(), "a message was answered on a failed sync");
    await_health(&store, false, "health did not say the journal cannot write").await;
    let (offline, direct) = (message(2, "offline"), message(3, "direct"));
    if let Err(e) = store.save_direct(&uaid, offline.clone()).await {
        panic!("a message for a client not connected was refused: {e}");
    }
    match store.stage_direct(&uaid, direct.clone()).await {
        Ok(copy) => assert_eq!(copy.saved_or_settled().await.unwrap(), CopyEnd::Saved),
        Err(e) => panic!("a connected client's copy was refused: {e}"),
    }
    assert_eq!(
        data(&store.fetch_messages(&uaid, 10).await.unwrap()),
        ["offline", "direct"]
    );
    let (key, delivered) = (direct.sort_key(), MessageState::Delivered);
    assert!(
        store
            .settle_message(&uaid, &key, &direct.version, delivered)
            .await
            .unwrap()
    );
    drop(store);
    let store = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(
        data(&store.fetch_messages(&uaid, 10).await.unwrap()),
        ["offline"]
    );
}
