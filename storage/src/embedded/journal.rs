//! The direct journal: durable copies of messages delivered directly, kept
//! out of redb's B-tree while they are in flight.
//!
//! A direct message is usually acked within milliseconds of its write. In
//! redb that costs two commits and two copy-on-write B-tree updates (the
//! write, then the delete or the receipt on the ack), each far dearer than
//! the push itself. Here the message is written to a file instead, and the
//! writes waiting at the same moment share one `fdatasync` (group commit).
//! A message handed to a connected client is staged first: in the index at
//! once, written only after a grace of [`GRACE`], and not at all if the
//! client acks it meanwhile (most do, within a millisecond). Either way the
//! sender hears 201 only once its message is on disk or acked. The ack of a
//! written message needs a small tombstone, the ack of one never written a
//! record only for its receipt (with receipts on): both go with the journal
//! thread's next write, within [`TOMBSTONES_WAIT`], many in one `write` and
//! without a sync of their own (a tombstone lost with the process or the
//! machine only means the message is delivered again, never that it is
//! lost). Only the journal thread writes the file. Staging costs no system
//! call: the journal thread sleeps until the oldest staged message's grace
//! ends, and is woken only by work it must do sooner than that. Readers see
//! the journal's messages through an in-memory index of the unsettled ones;
//! with receipts on, a settled message's receipt waits in memory and
//! reaches redb with many others in one commit (a checkpoint), at most
//! [`FLUSH_AFTER`] later.
//!
//! When the file outgrows [`ROTATE_AT`], a checkpoint moves every message
//! still in the index into redb as a stored message, and the file starts
//! over; so memory and disk stay bounded by the file's size. At start-up the
//! file is replayed the same way: unsettled messages become stored messages,
//! receipts are written, and the file starts over.
//!
//! The file is written in place, never appended to: it is filled with zeros
//! once ([`PREALLOCATE`]), and starting over means a new epoch in its first
//! page, not a shorter file. An `fdatasync` of blocks the file already has
//! writes the data and nothing else; one that grows the file also writes
//! its new size and blocks (and on a journaled ext4 commits the journal),
//! about twice the time, and the pushes waiting for it wait that much. Each
//! record carries the epoch, so records of earlier epochs that are still in
//! the file are not read again, and a space reserved by a writer that died
//! before writing it (zeros, or an older record) is skipped. Every move into redb is
//! conditional: a message is written only where its key is free, a receipt
//! only where its key is free or holds another receipt, so a replay never
//! resurrects a settled message whose receipt reached redb, nor overwrites
//! a newer message.
//!
//! Only messages without a topic are journaled: their key holds a unique
//! timestamp, so two of them never compete for a key. A topic message
//! replaces an older one under its key, which redb's conditional write does.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use autopush_common::bridge::{write_json_str, write_json_uuid};
use autopush_common::receipt::MessageState;
use autopush_common::{FastMap, Notification};
use redb::{Database, ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tracing::warn;
use uuid::Uuid;

use super::receipts::{RECEIPTS, put as put_receipt};
use super::writer::Writer;
use super::{MESSAGES, backend, corrupt};
use crate::{Receipt, Result, StorageError, StoredMessage};

/// The file outgrows this: its unsettled messages move to redb and it starts over.
/// (Small under test, so that tests rotate.)
const ROTATE_AT: u64 = if cfg!(test) { 4096 } else { 16 << 20 };
/// Receipts waiting in memory past this many reach redb at once: appended
/// to the receipts table, the more go in one commit, the fewer pages and
/// syncs each costs, down to about this many. More only make the commit
/// longer: one of 8 192 held a CPU for tens of milliseconds, and on a node
/// with one core delayed deliveries meanwhile (p99 46–54 ms at 5 700
/// pushes/s, against 5–10 ms with 1 024, for the same CPU and disk
/// writes). (Small under test, so that tests flush.)
const FLUSH_AT: usize = if cfg!(test) { 4 } else { 1024 };
/// A receipt waits in memory at most about this long (it is in the file
/// meanwhile: a restart does not lose it).
const FLUSH_AFTER: Duration = Duration::from_secs(5);
/// Most records written and synced together.
const MAX_BATCH: usize = 1024;
/// How long a message being delivered to a connected client waits before
/// its record is written: one acked meanwhile is never written nor synced
/// (see [`Journal::stage`]). Clients on a busy node ack in 1–5 ms: with
/// 2 ms, 4.5–10 MB/s of records were still written at 4 000 pushes/s,
/// with 10 ms none. (Long under test, so that a test decides what is
/// acked within it.)
const GRACE: Duration = if cfg!(test) {
    Duration::from_secs(30)
} else {
    Duration::from_millis(10)
};
/// A settle record (a written message's tombstone, or a receipt) waits at
/// most this long, to be written with others in one `write` (see
/// [`Journal::settle`]). Nobody waits for these records: as long as a
/// grace, so that under load the thread wakes for them no more often than
/// for the staged messages (at 2 ms it woke about a thousand times a
/// second at 4 000 pushes/s). Written one by one as acks came, they cost a
/// `write` per ack, under the state's lock.
const TOMBSTONES_WAIT: Duration = Duration::from_millis(10);
/// The first page of the file: [`FILE_MAGIC`] and the epoch (twice, the
/// second inverted) whose records are current. Records start after it.
const HEADER: u64 = 4096;
const FILE_MAGIC: &[u8; 8] = b"APJRNL01";
/// Starts every record: bytes that JSON and base64url text never hold, so
/// that a record is not seen where another's body is.
const RECORD_MAGIC: [u8; 4] = [0xa7, 0x4a, 0x9c, 0xf1];
/// A record's head: magic, epoch, body length, body checksum.
const RECORD_HEAD: usize = 16;
/// Bytes of zeros the file is given once, so that records overwrite
/// blocks it has (see the module's notes); past it (a burst before a
/// rotation) it grows.
const PREALLOCATE: u64 = HEADER + ROTATE_AT + ROTATE_AT / 2;

/// One journal record.
#[derive(Serialize, Deserialize)]
enum Record {
    /// A message accepted for direct delivery.
    Put { uaid: Uuid, message: Notification },
    /// The message under `key` was settled, if it is still `version`; its
    /// receipt, with receipts on.
    Settle {
        uaid: Uuid,
        key: String,
        version: String,
        receipt: Option<SettledAs>,
    },
}

/// A receipt as a settle's record carries it: its version is the record's,
/// not written twice. (Records written before carry it twice; the second
/// is not read.)
#[derive(Clone, Copy, Serialize, Deserialize)]
struct SettledAs {
    #[serde(rename = "settled")]
    state: MessageState,
    updated: u64,
    expiry: u64,
}

impl SettledAs {
    fn of(receipt: &Receipt) -> SettledAs {
        SettledAs {
            state: receipt.state,
            updated: receipt.updated,
            expiry: receipt.expiry,
        }
    }

    /// What `serde_json` writes for it, without its escape scan of the
    /// names (a settle's record, on every ack with receipts on).
    fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        out.extend_from_slice(br#"{"settled":""#);
        out.extend_from_slice(self.state.as_str().as_bytes());
        out.extend_from_slice(br#"","updated":"#);
        serde_json::to_writer(&mut *out, &self.updated)?;
        out.extend_from_slice(br#","expiry":"#);
        serde_json::to_writer(&mut *out, &self.expiry)?;
        out.push(b'}');
        Ok(())
    }

    fn receipt(self, version: String) -> Receipt {
        Receipt {
            state: self.state,
            version,
            updated: self.updated,
            expiry: self.expiry,
        }
    }
}

/// What the journal knows: unsettled messages and receipts not in redb yet.
#[derive(Default)]
struct State {
    /// uaid -> sort key -> message.
    live: FastMap<u128, BTreeMap<String, Entry>>,
    /// Receipts of settled journal messages, until a checkpoint commits them.
    receipts: FastMap<(u128, String), Receipt>,
    /// The receipts the transaction running now is committing, taken out
    /// of `receipts` whole (no copy under the lock) and read here until
    /// it has.
    receipts_moving: Option<Arc<FastMap<(u128, String), Receipt>>>,
    /// A checkpoint of receipts is queued or committing (one at a time).
    checkpointing: bool,
    /// Staged messages the journal thread is to write, oldest first: when
    /// each was staged, its uaid and key.
    due: VecDeque<(Instant, u128, String)>,
    /// Someone waits for the due messages to be written now.
    hurry: bool,
    /// Settle records (tombstones of written messages, receipts of messages
    /// acked within their grace), framed one after the other: written with
    /// the next batch, at most [`TOMBSTONES_WAIT`] after the first of them,
    /// in the order of their settles and after the record of every message
    /// they settle.
    tombstones: Vec<u8>,
    tombstones_since: Option<Instant>,
    /// When the journal thread wakes by itself, while it waits for work;
    /// `None` while it works (it looks at the state again before it waits).
    asleep_until: Option<Instant>,
    /// The store is closing: the journal thread finishes.
    closing: bool,
    /// The journal thread has stopped (closed, or panicked).
    stopped: bool,
}

struct Entry {
    message: Notification,
    /// Being moved into redb by the transaction running now: a settle must
    /// go to redb, after that transaction.
    moving: bool,
    /// Its record is written (or being written by the journal thread): a
    /// settle must have a tombstone written after it.
    written: bool,
    /// Who waits for it to be durable, until the journal thread writes it
    /// or something else answers first: a settle (the message is acked,
    /// nothing is left to keep) or a checkpoint (it is in redb).
    waiter: Option<oneshot::Sender<Result<()>>>,
}

impl Entry {
    /// A message whose record is in the file already (replayed).
    fn written(message: Notification) -> Entry {
        Entry {
            message,
            moving: false,
            written: true,
            waiter: None,
        }
    }

    /// Tell whoever waits that the message needs nothing more from the file.
    fn answer(&mut self) {
        if let Some(waiter) = self.waiter.take() {
            let _ = waiter.send(Ok(()));
        }
    }
}

impl State {
    /// When the oldest message still staged (not settled, written nor
    /// moved) was staged; what the journal no longer needs to write is
    /// dropped from [`State::due`] on the way.
    fn first_staged(&mut self) -> Option<Instant> {
        while let Some((at, uaid, key)) = self.due.front() {
            let entry = self.live.get(uaid).and_then(|keys| keys.get(key));
            if entry.is_some_and(|entry| !entry.written && !entry.moving) {
                return Some(*at);
            }
            self.due.pop_front();
        }
        None
    }

    /// Drop `version` from the index, if it is still what `key` holds.
    fn remove_version(&mut self, uaid: u128, key: &str, version: &str) {
        let held = self.live.get(&uaid).and_then(|keys| keys.get(key));
        if held.is_some_and(|entry| entry.message.version == version) {
            self.remove(uaid, key);
        }
    }

    /// Drop `key` from the index: its owned key (a settle keeps it for
    /// the receipt) and its entry.
    fn remove(&mut self, uaid: u128, key: &str) -> Option<(String, Entry)> {
        let keys = self.live.get_mut(&uaid)?;
        let entry = keys.remove_entry(key);
        if keys.is_empty() {
            self.live.remove(&uaid);
        }
        entry
    }
}

/// What the journal did with a settle or a delete.
pub(super) enum Settled {
    /// Settled (or, with `false`, the key holds another version).
    Here(bool),
    /// Not in the journal: ask redb.
    NotHere,
}

#[derive(Clone)]
pub(super) struct Journal {
    shared: Arc<Shared>,
}

struct Shared {
    state: Arc<Mutex<State>>,
    /// Wakes the journal thread (see [`State::asleep_until`]).
    work: Arc<Condvar>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        lock(&self.state).closing = true;
        self.work.notify_one();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn io(what: &str, e: std::io::Error) -> StorageError {
    StorageError::Backend(format!("direct journal: {what}: {e}"))
}

/// Tells a record torn by a crash from a whole one: a word-at-a-time hash
/// (cheap next to the message it covers; not a defence against tampering).
fn checksum(bytes: &[u8]) -> u32 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut hash = K ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        hash = (hash ^ u64::from_le_bytes(w))
            .wrapping_mul(K)
            .rotate_left(31);
    }
    for b in words.remainder() {
        hash = (hash ^ u64::from(*b)).wrapping_mul(K).rotate_left(31);
    }
    (hash ^ (hash >> 32)) as u32
}

/// [`Record`] to write, borrowing the message.
#[cfg_attr(test, derive(Serialize))]
enum RecordRef<'a> {
    Put {
        uaid: Uuid,
        message: &'a Notification,
    },
    Settle {
        uaid: Uuid,
        key: &'a str,
        version: &'a str,
        receipt: Option<SettledAs>,
    },
}

impl RecordRef<'_> {
    /// Append the record's JSON to `out`: what `serde_json` writes for the
    /// [`Record`] it reads back, without its escape scan of every byte of
    /// the message id, which every push's records hold.
    fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        match self {
            RecordRef::Put { uaid, message } => {
                out.extend_from_slice(br#"{"Put":{"uaid":"#);
                write_json_uuid(out, uaid);
                out.extend_from_slice(br#","message":"#);
                message.write_json(out)?;
            }
            RecordRef::Settle {
                uaid,
                key,
                version,
                receipt,
            } => {
                out.extend_from_slice(br#"{"Settle":{"uaid":"#);
                write_json_uuid(out, uaid);
                out.extend_from_slice(br#","key":"#);
                write_json_str(out, key)?;
                out.extend_from_slice(br#","version":"#);
                write_json_str(out, version)?;
                out.extend_from_slice(br#","receipt":"#);
                match receipt {
                    Some(receipt) => receipt.write_json(out)?,
                    None => out.extend_from_slice(b"null"),
                }
            }
        }
        out.extend_from_slice(b"}}");
        Ok(())
    }
}

/// Frame a record at the end of `out` (a batch being written, or the
/// settles waiting for one), its JSON written by `json`; on an error `out`
/// is left as it was.
///
/// A record as written: `[magic][epoch][length][checksum]` (see
/// [`RECORD_HEAD`]; the epoch is [`stamp`]ed when the record is written),
/// then the body: `[JSON length][JSON][0, or 1 and a message's data]`,
/// zero-padded to 8 bytes. A message's data (its encrypted body, most of
/// its size) is kept out of the JSON, which would scan it for characters
/// to escape; it is base64url, so has none.
fn frame_into(
    out: &mut Vec<u8>,
    json: impl FnOnce(&mut Vec<u8>) -> serde_json::Result<()>,
    data: Option<&str>,
) -> Result<()> {
    let too_large = || StorageError::Backend("direct journal: record too large".into());
    let start = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEAD + 4]);
    if let Err(e) = json(out) {
        out.truncate(start);
        return Err(corrupt(e));
    }
    let json = out.len() - start - RECORD_HEAD - 4;
    match data {
        Some(data) => {
            out.push(1);
            out.extend_from_slice(data.as_bytes());
        }
        None => out.push(0),
    }
    let (Ok(json), Ok(len)) = (
        u32::try_from(json),
        u32::try_from(out.len() - start - RECORD_HEAD),
    ) else {
        out.truncate(start);
        return Err(too_large());
    };
    let record = &mut out[start..];
    record[RECORD_HEAD..RECORD_HEAD + 4].copy_from_slice(&json.to_le_bytes());
    let sum = checksum(&record[RECORD_HEAD..]);
    record[0..4].copy_from_slice(&RECORD_MAGIC);
    record[8..12].copy_from_slice(&len.to_le_bytes());
    record[12..16].copy_from_slice(&sum.to_le_bytes());
    out.resize(out.len().next_multiple_of(8), 0);
    Ok(())
}

/// The little-endian `u32` at `at` in `bytes`, if they reach that far.
fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let word = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(word.try_into().ok()?))
}

/// Mark a framed record as written in `epoch`.
fn stamp(record: &mut [u8], epoch: u32) {
    record[4..8].copy_from_slice(&epoch.to_le_bytes());
}

/// Mark every framed record in `records` (whole ones, back to back) as
/// written in `epoch`.
fn stamp_all(records: &mut [u8], epoch: u32) {
    let mut at = 0;
    while let Some(len) = u32_at(records, at + 8) {
        stamp(&mut records[at..], epoch);
        at += (RECORD_HEAD + len as usize).next_multiple_of(8);
    }
}

/// The record of `epoch` at the start of `bytes` and its framed size, if
/// one is there whole.
fn record_at(bytes: &[u8], epoch: u32) -> Option<(Record, usize)> {
    if bytes.get(0..4)? != RECORD_MAGIC || u32_at(bytes, 4)? != epoch {
        return None;
    }
    let len = u32_at(bytes, 8)? as usize;
    let body = bytes.get(RECORD_HEAD..RECORD_HEAD.checked_add(len)?)?;
    if checksum(body) != u32_at(bytes, 12)? {
        return None;
    }
    Some((unframe(body)?, (RECORD_HEAD + len).next_multiple_of(8)))
}

/// The records of `epoch` in a journal file's `bytes`, in order. What is
/// not one (a record torn by a crash, zeros a writer reserved but never
/// wrote, an earlier epoch's record) is stepped over 8 bytes at a time.
fn read_records(bytes: &[u8], epoch: u32) -> Vec<Record> {
    let mut records = Vec::new();
    let mut at = HEADER as usize;
    while at < bytes.len() {
        match record_at(&bytes[at..], epoch) {
            Some((record, size)) => {
                records.push(record);
                at += size;
            }
            None => at += 8,
        }
    }
    records
}

/// The file's first page for `epoch`.
fn header(epoch: u32) -> [u8; 16] {
    let mut page = [0u8; 16];
    page[..8].copy_from_slice(FILE_MAGIC);
    page[8..12].copy_from_slice(&epoch.to_le_bytes());
    page[12..].copy_from_slice(&(!epoch).to_le_bytes());
    page
}

/// The epoch in a journal file's first page: `None` for a new file (its
/// first page never written: nothing was journaled in it).
fn epoch_of(bytes: &[u8]) -> Result<Option<u32>> {
    let page = &bytes[..bytes.len().min(16)];
    if page.iter().all(|b| *b == 0) {
        return Ok(None);
    }
    match (page.get(..8), u32_at(page, 8), u32_at(page, 12)) {
        (Some(magic), Some(epoch), Some(check)) if magic == FILE_MAGIC && epoch == !check => {
            Ok(Some(epoch))
        }
        _ => Err(StorageError::Backend(
            "direct journal: its first page is not a journal's; move the file aside to start"
                .into(),
        )),
    }
}

/// One record's body back (see [`frame_into`]); `None` if it does not parse.
fn unframe(body: &[u8]) -> Option<Record> {
    let json_len = u32_at(body, 0)? as usize;
    let json = body.get(4..4 + json_len)?;
    let mut record: Record = serde_json::from_slice(json).ok()?;
    let rest = body.get(4 + json_len..)?;
    match (rest.first()?, &mut record) {
        (0, _) => {}
        (1, Record::Put { message, .. }) => {
            message.data = Some(std::str::from_utf8(&rest[1..]).ok()?.to_owned());
        }
        _ => return None,
    }
    Some(record)
}

/// Write `message` into redb unless its key holds something already.
fn move_message(
    table: &mut redb::Table<(u128, &str), &[u8]>,
    uaid: u128,
    message: &Notification,
) -> Result<()> {
    let key = message.sort_key();
    if table.get((uaid, key.as_str())).map_err(backend)?.is_none() {
        let json = message.to_json().map_err(corrupt)?;
        table
            .insert((uaid, key.as_str()), json.as_slice())
            .map_err(backend)?;
    }
    Ok(())
}

impl Journal {
    /// Open the journal in `dir`: replay what a previous run left into `db`
    /// (before anything else writes to it), then start the journal thread.
    pub(super) fn open(dir: &Path, db: &Database, writer: Writer) -> Result<Journal> {
        let path = dir.join("direct.journal");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("cannot open", e))?;
        let epoch = replay(&mut file, db)?;
        let state = Arc::new(Mutex::new(State::default()));
        let work = Arc::new(Condvar::new());
        let thread = JournalThread {
            file,
            state: state.clone(),
            work: work.clone(),
            writer,
            last_flush: Instant::now(),
            epoch,
            next: HEADER,
            buffer: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("direct-journal".into())
            .spawn(move || thread.run())
            .map_err(|e| io("cannot start its thread", e))?;
        Ok(Journal {
            shared: Arc::new(Shared {
                state,
                work,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// Have the journal thread look at the state by `at`. Whether it must
    /// be woken for that (it would sleep past then): the caller does so
    /// with [`Journal::wake`] once it has let go of the state's lock, so
    /// that the thread does not wake only to wait for that lock. (Under
    /// steady load it is awake already, or set to wake for an earlier
    /// message: no system call.)
    #[must_use]
    fn wake_by(&self, state: &mut State, at: Instant) -> bool {
        let wake = state.asleep_until.is_some_and(|until| until > at);
        if wake {
            state.asleep_until = Some(at);
        }
        wake
    }

    /// Wake the journal thread if [`Journal::wake_by`] said to.
    fn wake(&self, wake: bool) {
        if wake {
            self.shared.work.notify_one();
        }
    }

    /// Whether the journal thread still takes messages (it stops only if
    /// it panicked).
    pub(super) fn is_running(&self) -> bool {
        lock(&self.shared.thread)
            .as_ref()
            .is_some_and(|thread| !thread.is_finished())
    }

    /// Whether `message` can be journaled (see the module's notes).
    pub(super) fn takes(message: &Notification) -> bool {
        message.topic.is_none()
    }

    /// Append `message` and return once it is on disk.
    pub(super) async fn put(&self, uaid: &Uuid, message: Notification) -> Result<()> {
        crate::copy_written(self.stage(uaid, message, false)?).await
    }

    /// Put `message` in the index now (every read and settle sees it from
    /// here on), and have the journal thread write it: at once, or with
    /// `grace` once [`GRACE`] has passed. The receiver answers once the
    /// record is on disk, or before that if the message no longer needs
    /// it: settled (a client acked it within the grace, so it is never
    /// written at all) or moved into redb by a checkpoint.
    ///
    /// Fails with [`StorageError::KeyTaken`] if the index holds another
    /// message under its key, or this one not yet on disk.
    pub(super) fn stage(
        &self,
        uaid: &Uuid,
        message: Notification,
        grace: bool,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        let (uaid, key) = (uaid.as_u128(), message.sort_key());
        let due_key = key.clone();
        let (waiter, done) = oneshot::channel();
        let mut state = lock(&self.shared.state);
        if state.stopped {
            return Err(StorageError::Backend(
                "the direct journal has stopped".into(),
            ));
        }
        let keys = state.live.entry(uaid).or_default();
        if let Some(held) = keys.get(&key) {
            // The same message again, once on disk, is saved already.
            if held.message.version == message.version && held.written && !held.moving {
                let _ = waiter.send(Ok(()));
                return Ok(done);
            }
            return Err(StorageError::KeyTaken(key));
        }
        keys.insert(
            key,
            Entry {
                message,
                moving: false,
                written: false,
                waiter: Some(waiter),
            },
        );
        let now = Instant::now();
        state.due.push_back((now, uaid, due_key));
        let wake = match grace {
            true => self.wake_by(&mut state, now + GRACE),
            false => self.hurry_locked(&mut state),
        };
        drop(state);
        self.wake(wake);
        Ok(done)
    }

    /// Have the journal thread write what is staged now, without waiting
    /// for the rest of a grace.
    pub(super) fn hurry(&self) {
        let wake = self.hurry_locked(&mut lock(&self.shared.state));
        self.wake(wake);
    }

    /// [`Journal::hurry`], for a caller holding the state's lock: whether
    /// to [`Journal::wake`] the thread once it lets go.
    #[must_use]
    fn hurry_locked(&self, state: &mut State) -> bool {
        state.hurry = true;
        self.wake_by(state, Instant::now())
    }

    /// Settle the journaled message under `key` if it is still `version`
    /// (and, given `unexpired_at`, not past its TTL then: expired is
    /// final): drop it from the index, keep its receipt (if any) for the
    /// next checkpoint, and have a tombstone written with the next batch if
    /// the file holds the message or the receipt needs one.
    pub(super) fn settle(
        &self,
        uaid: u128,
        key: &str,
        version: &str,
        receipt: Option<Receipt>,
        unexpired_at: Option<u64>,
    ) -> Result<Settled> {
        let record = |receipt: Option<SettledAs>| RecordRef::Settle {
            uaid: Uuid::from_u128(uaid),
            key,
            version,
            receipt,
        };
        let mut state = lock(&self.shared.state);
        let Some(entry) = state.live.get(&uaid).and_then(|keys| keys.get(key)) else {
            // A sender's delete of a settled message takes its receipt
            // (as a redb row's would go); a second settle changes nothing.
            // One being moved is redb's to delete, after the move.
            let receipt_key = (uaid, key.to_owned());
            let held = state.receipts.get(&receipt_key);
            if receipt.is_some() || held.is_none_or(|held| held.version != version) {
                return Ok(Settled::NotHere);
            }
            // After the receipt's own tombstone, which may still wait.
            let wake = self.tombstone_later(&mut state, &record(None))?;
            state.receipts.remove(&receipt_key);
            drop(state);
            self.wake(wake);
            return Ok(Settled::Here(true));
        };
        if entry.moving {
            return Ok(Settled::NotHere);
        }
        if entry.message.version != version
            || unexpired_at.is_some_and(|now| entry.message.is_expired(now))
        {
            return Ok(Settled::Here(false));
        }
        // No tombstone for a message acked within its grace with receipts
        // off: nothing of it is in the file, nor needs to be.
        let tombstone = match &receipt {
            Some(receipt) => Some(record(Some(SettledAs::of(receipt)))),
            None if entry.written => Some(record(None)),
            None => None,
        };
        // Queued under the lock: tombstones of one key land in the order
        // of its settles, after the batch that holds the message.
        let wake = match tombstone {
            Some(tombstone) => self.tombstone_later(&mut state, &tombstone)?,
            None => false,
        };
        let settled = state.remove(uaid, key).map(|(key, entry)| {
            // The index's key becomes the receipt's: no copy.
            if let Some(receipt) = receipt {
                state.receipts.insert((uaid, key), receipt);
            }
            entry
        });
        drop(state);
        self.wake(wake);
        // Not written yet: its sender waits no longer, and the journal
        // thread will not write it. Answered (a task to wake) and freed
        // once the lock is let go.
        if let Some(mut entry) = settled {
            entry.answer();
        }
        Ok(Settled::Here(true))
    }

    /// Have the journal thread write a settle's record with its next batch
    /// (within [`TOMBSTONES_WAIT`]): framed at the end of the waiting ones,
    /// with no buffer of its own; whether to [`Journal::wake`] the thread.
    fn tombstone_later(&self, state: &mut State, record: &RecordRef) -> Result<bool> {
        frame_into(&mut state.tombstones, |out| record.write_json(out), None)?;
        let since = *state.tombstones_since.get_or_insert_with(Instant::now);
        Ok(self.wake_by(state, since + TOMBSTONES_WAIT))
    }

    /// The row the journal holds under `key`: an unsettled message, or a
    /// receipt not in redb yet.
    pub(super) fn read(&self, uaid: u128, key: &str) -> Option<StoredMessage> {
        let state = lock(&self.shared.state);
        if let Some(entry) = state.live.get(&uaid).and_then(|keys| keys.get(key)) {
            return Some(StoredMessage::Pending(entry.message.clone()));
        }
        let key = (uaid, key.to_owned());
        let moving = state.receipts_moving.as_ref();
        state
            .receipts
            .get(&key)
            .or_else(|| moving.and_then(|moving| moving.get(&key)))
            .map(|receipt| StoredMessage::Settled(receipt.clone()))
    }

    /// The unsettled messages of `uaid`, in key order. Read this before
    /// redb: a message moving into redb meanwhile is then seen in one or
    /// the other.
    pub(super) fn messages(&self, uaid: u128) -> Vec<Notification> {
        let state = lock(&self.shared.state);
        state
            .live
            .get(&uaid)
            .map(|keys| keys.values().map(|e| e.message.clone()).collect())
            .unwrap_or_default()
    }

    /// The keys and versions of `uaid`'s unsettled messages.
    pub(super) fn versions(&self, uaid: u128) -> Vec<(String, String)> {
        let state = lock(&self.shared.state);
        state
            .live
            .get(&uaid)
            .map(|keys| {
                keys.iter()
                    .map(|(k, e)| (k.clone(), e.message.version.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Move what the file holds into redb, then start it over: write it the
/// epoch it is to be written in from now on, which is returned (and give it
/// its zeros, the first time).
fn replay(file: &mut File, db: &Database) -> Result<u32> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| io("cannot read", e))?;
    let epoch = epoch_of(&bytes)?;
    let records = epoch.map_or_else(Vec::new, |epoch| read_records(&bytes, epoch));
    if !records.is_empty() {
        move_records(records, db)?;
    }
    let epoch = epoch.map_or(1, |epoch| epoch.wrapping_add(1));
    file.write_all_at(&header(epoch), 0)
        .map_err(|e| io("cannot write", e))?;
    let zeros = vec![0u8; 1 << 20];
    let mut len = bytes.len().max(16) as u64;
    while len < PREALLOCATE {
        let n = zeros.len().min((PREALLOCATE - len) as usize);
        file.write_all_at(&zeros[..n], len)
            .map_err(|e| io("cannot write", e))?;
        len += n as u64;
    }
    file.sync_all().map_err(|e| io("cannot sync", e))?;
    Ok(epoch)
}

/// Move replayed records into redb: what they left unsettled as stored
/// messages, their receipts as receipts.
fn move_records(records: Vec<Record>, db: &Database) -> Result<()> {
    let mut state = State::default();
    for record in records {
        match record {
            Record::Put { uaid, message } => {
                state
                    .live
                    .entry(uaid.as_u128())
                    .or_default()
                    .insert(message.sort_key(), Entry::written(message));
            }
            Record::Settle {
                uaid,
                key,
                version,
                receipt,
            } => {
                let uaid = uaid.as_u128();
                state.remove_version(uaid, &key, &version);
                match receipt {
                    Some(receipt) => {
                        state.receipts.insert((uaid, key), receipt.receipt(version));
                    }
                    None => {
                        let held = state.receipts.get(&(uaid, key.clone()));
                        if held.is_some_and(|held| held.version == version) {
                            state.receipts.remove(&(uaid, key));
                        }
                    }
                }
            }
        }
    }
    let txn = db.begin_write().map_err(backend)?;
    move_state(&txn, &state.live, &state.receipts)?;
    txn.commit().map_err(backend)
}

fn move_state(
    txn: &WriteTransaction,
    live: &FastMap<u128, BTreeMap<String, Entry>>,
    receipts: &FastMap<(u128, String), Receipt>,
) -> Result<()> {
    put_receipts(txn, receipts)?;
    let mut table = txn.open_table(MESSAGES).map_err(backend)?;
    for (uaid, keys) in live {
        for entry in keys.values() {
            move_message(&mut table, *uaid, &entry.message)?;
        }
    }
    Ok(())
}

impl State {
    /// The receipts a checkpoint commits: taken out of `receipts` whole
    /// the first time, and the same ones again if the writer runs the
    /// checkpoint a second time, in a transaction of its own, because the
    /// one it shared failed.
    fn receipts_to_move(&mut self) -> Arc<FastMap<(u128, String), Receipt>> {
        match &self.receipts_moving {
            Some(moving) => moving.clone(),
            None => {
                // The next checkpoint will hold about as many: its map
                // does not grow from empty, rehashing, one settle at a time.
                let next = FastMap::with_capacity_and_hasher(
                    self.receipts.len().min(FLUSH_AT),
                    Default::default(),
                );
                let taken = Arc::new(std::mem::replace(&mut self.receipts, next));
                self.receipts_moving = Some(taken.clone());
                taken
            }
        }
    }

    /// The transaction committing the moving receipts is over: they are in
    /// redb, or, if it failed, back to wait for the next try (none of their
    /// keys can have settled again meanwhile).
    fn receipts_moved(&mut self, moved: &Result<()>) {
        let receipts = self.receipts_moving.take();
        if moved.is_err() {
            for (key, receipt) in receipts.iter().flat_map(|moving| moving.iter()) {
                self.receipts
                    .entry(key.clone())
                    .or_insert_with(|| receipt.clone());
            }
        }
    }
}

fn put_receipts(txn: &WriteTransaction, receipts: &FastMap<(u128, String), Receipt>) -> Result<()> {
    let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
    for ((uaid, key), receipt) in receipts {
        put_receipt(&mut table, *uaid, key, receipt)?;
    }
    Ok(())
}

struct JournalThread {
    file: File,
    state: Arc<Mutex<State>>,
    work: Arc<Condvar>,
    writer: Writer,
    last_flush: Instant,
    /// The epoch records are written with now (see [`HEADER`]).
    epoch: u32,
    /// Where the next record goes (reset by a rotation).
    next: u64,
    /// The last batch's bytes, emptied, for the next: a batch of messages
    /// is tens of kilobytes, which a new buffer would grow to by copying
    /// and fault in page by page.
    buffer: Vec<u8>,
}

/// The most [`JournalThread::buffer`] keeps between batches (a burst's
/// batch of [`MAX_BATCH`] large messages is several megabytes).
const BUFFER_KEPT: usize = 1 << 20;

/// Records the journal thread writes in one `write`: staged messages
/// (then synced) and tombstones (not synced).
struct Batch {
    bytes: Vec<u8>,
    /// Where they go in the file.
    at: u64,
    /// The messages among them: uaid, key, version.
    puts: Vec<(u128, String, String)>,
    /// Who waits for those messages.
    waiters: Vec<oneshot::Sender<Result<()>>>,
}

/// Marks the journal stopped when its thread ends, even by a panic: no
/// message is staged any more, and whoever waits hears it.
struct Stopped(Arc<Mutex<State>>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let mut state = lock(&self.0);
        state.stopped = true;
        for entry in state.live.values_mut().flat_map(|keys| keys.values_mut()) {
            drop(entry.waiter.take());
        }
    }
}

impl JournalThread {
    fn run(mut self) {
        let _stopped = Stopped(self.state.clone());
        while let Some(batch) = self.next_batch() {
            let Some(batch) = batch else {
                // A checkpoint's time: the receipts have waited long enough.
                self.checkpoint();
                continue;
            };
            self.write(batch);
            let receipts = lock(&self.state).receipts.len();
            if self.next - HEADER >= ROTATE_AT {
                self.rotate();
            } else if receipts >= FLUSH_AT
                || (receipts > 0 && self.last_flush.elapsed() >= FLUSH_AFTER)
            {
                self.checkpoint();
            }
        }
        // Closing: leave nothing for the next start-up to replay.
        self.rotate();
    }

    /// Wait for work: the records to write once the first staged message's
    /// grace ends (or at once, if someone hurries), `Some(None)` when it is
    /// time for a checkpoint, `None` when the store closes. Waits on the
    /// condition variable, which stagers signal only when they need it
    /// sooner than it would wake.
    fn next_batch(&mut self) -> Option<Option<Batch>> {
        let shared = self.state.clone();
        let mut state = lock(&shared);
        loop {
            if state.closing {
                return None;
            }
            let now = Instant::now();
            let grace_ends = state.first_staged().map(|at| at + GRACE);
            let write_at = if state.hurry {
                Some(now)
            } else {
                let tombstones = state.tombstones_since.map(|at| at + TOMBSTONES_WAIT);
                grace_ends.into_iter().chain(tombstones).min()
            };
            if write_at.is_some_and(|at| at <= now) {
                // Once a grace has ended (the sync is paid for), messages
                // staged for half a grace go with it: fewer, larger batches
                // when clients do not ack, and those acking at once are
                // still never written.
                let staged_by = if state.hurry {
                    Some(now)
                } else if grace_ends.is_some_and(|at| at <= now) {
                    now.checked_sub(GRACE / 2)
                } else {
                    None
                };
                return Some(Some(self.take_batch(&mut state, staged_by)));
            }
            let flush_at = self.last_flush + FLUSH_AFTER;
            if flush_at <= now {
                return Some(None);
            }
            let wake = write_at.map_or(flush_at, |at| at.min(flush_at));
            state.asleep_until = Some(wake);
            state = match self.work.wait_timeout(state, wake - now) {
                Ok((state, _)) => state,
                Err(poisoned) => poisoned.into_inner().0,
            };
            state.asleep_until = None;
        }
    }

    /// Frame the messages staged by `staged_by` (up to [`MAX_BATCH`]) that
    /// are still staged, and the waiting tombstones. Marked written under
    /// the state's lock, so that a tombstone of one of them goes in a
    /// later batch.
    fn take_batch(&mut self, state: &mut State, staged_by: Option<Instant>) -> Batch {
        let hurry = std::mem::take(&mut state.hurry);
        let mut batch = Batch {
            bytes: std::mem::take(&mut self.buffer),
            at: 0,
            puts: Vec::new(),
            waiters: Vec::new(),
        };
        let mut unframed = Vec::new();
        let ripe = staged_by.map_or(0, |by| state.due.partition_point(|(at, ..)| *at <= by));
        let n = ripe.min(MAX_BATCH);
        let epoch = self.epoch;
        let State { due, live, .. } = state;
        for (_, uaid, key) in due.drain(..n) {
            // Settled or moved into redb meanwhile: nothing to write.
            let Some(entry) = live.get_mut(&uaid).and_then(|keys| keys.get_mut(&key)) else {
                continue;
            };
            if entry.written || entry.moving {
                continue;
            }
            let start = batch.bytes.len();
            let message = &mut entry.message;
            let data = message.data.take();
            let record = RecordRef::Put {
                uaid: Uuid::from_u128(uaid),
                message,
            };
            let framed = frame_into(
                &mut batch.bytes,
                |out| record.write_json(out),
                data.as_deref(),
            );
            message.data = data;
            if let Err(e) = framed {
                if let Some(waiter) = entry.waiter.take() {
                    let _ = waiter.send(Err(e));
                }
                unframed.push((uaid, key, entry.message.version.clone()));
                continue;
            }
            stamp(&mut batch.bytes[start..], epoch);
            entry.written = true;
            batch.waiters.extend(entry.waiter.take());
            batch.puts.push((uaid, key, entry.message.version.clone()));
        }
        for (uaid, key, version) in &unframed {
            state.remove_version(*uaid, key, version);
        }
        // More than a batch was hurried: the rest goes next.
        state.hurry = hurry && !state.due.is_empty();
        let tombstones = batch.bytes.len();
        batch.bytes.extend_from_slice(&state.tombstones);
        stamp_all(&mut batch.bytes[tombstones..], epoch);
        // Emptied, not freed: the next settles frame into it again.
        state.tombstones.clear();
        if state.tombstones.capacity() > BUFFER_KEPT {
            state.tombstones.shrink_to(BUFFER_KEPT);
        }
        state.tombstones_since = None;
        batch.at = self.next;
        self.next += batch.bytes.len() as u64;
        batch
    }

    /// Write a batch, sync it if it holds messages, and answer who waits.
    fn write(&mut self, batch: Batch) {
        let Batch {
            mut bytes,
            at,
            puts,
            waiters,
        } = batch;
        if bytes.is_empty() {
            self.buffer = bytes;
            return;
        }
        let mut written = self.file.write_all_at(&bytes, at);
        if !puts.is_empty() {
            written = written.and_then(|()| self.file.sync_data());
        }
        bytes.clear();
        bytes.shrink_to(BUFFER_KEPT);
        self.buffer = bytes;
        let written = written.map_err(|e| io("cannot append", e));
        if written.is_err() {
            // Not durable: out of the index, and the senders hear it.
            let mut state = lock(&self.state);
            for (uaid, key, version) in &puts {
                state.remove_version(*uaid, key, version);
            }
        }
        for waiter in waiters {
            let _ = waiter.send(match &written {
                Ok(()) => Ok(()),
                Err(e) => Err(StorageError::Backend(e.to_string())),
            });
        }
        if let Err(e) = written {
            warn!(error = %e, "direct journal append failed");
        }
    }

    /// Commit the waiting receipts to redb, without waiting for the
    /// commit: a commit of thousands of receipts takes a hundred
    /// milliseconds or more, and the staged messages whose grace ends
    /// meanwhile would wait for it. One at a time; a second is not needed
    /// before the first is done.
    fn checkpoint(&mut self) {
        self.last_flush = Instant::now();
        {
            let mut state = lock(&self.state);
            if state.receipts.is_empty() || state.checkpointing {
                return;
            }
            state.checkpointing = true;
        }
        let (state, done, work) = (self.state.clone(), self.state.clone(), self.work.clone());
        self.writer.write_then(
            move |txn| {
                let receipts = lock(&state).receipts_to_move();
                put_receipts(txn, &receipts)
            },
            move |moved| {
                let mut state = lock(&done);
                state.receipts_moved(&moved);
                state.checkpointing = false;
                drop(state);
                if let Err(e) = moved {
                    warn!(error = %e, "direct journal checkpoint failed; will try again");
                }
                // A rotation may wait for it.
                work.notify_all();
            },
        );
    }

    /// Wait until no checkpoint of receipts is queued or committing.
    fn wait_for_checkpoint(&self) {
        let mut state = lock(&self.state);
        while state.checkpointing {
            state = match self.work.wait(state) {
                Ok(state) => state,
                Err(poisoned) => poisoned.into_inner(),
            };
        }
    }

    /// Commit the waiting receipts and every unsettled message to redb,
    /// then empty the file. The journal thread writes nothing meanwhile:
    /// what it would write in the old epoch would not be read again.
    fn rotate(&mut self) {
        // Its receipts would not be in redb when the file starts over.
        self.wait_for_checkpoint();
        self.last_flush = Instant::now();
        {
            let state = lock(&self.state);
            if state.receipts.is_empty() && state.live.is_empty() {
                drop(state);
                self.start_over();
                return;
            }
        }
        let state = self.state.clone();
        // Marked inside the transaction, on the writer's thread: a settle
        // that finds a message moving queues its write after this one.
        // Messages are copied out and receipts taken out, so that readers
        // and settles wait for the lock only that long, not while redb
        // writes them.
        let moved = self.writer.write_blocking(move |txn| {
            let (live, receipts) = {
                let mut state = lock(&state);
                let mut live = Vec::new();
                for (uaid, keys) in state.live.iter_mut() {
                    for entry in keys.values_mut() {
                        entry.moving = true;
                        live.push((*uaid, entry.message.clone()));
                    }
                }
                (live, state.receipts_to_move())
            };
            put_receipts(txn, &receipts)?;
            let mut table = txn.open_table(MESSAGES).map_err(backend)?;
            for (uaid, message) in &live {
                move_message(&mut table, *uaid, message)?;
            }
            Ok(())
        });
        let mut state = lock(&self.state);
        state.receipts_moved(&moved);
        match moved {
            Ok(()) => {
                // Only what was moved: a message staged meanwhile is still
                // to be written, in the new epoch.
                state.live.retain(|_, keys| {
                    keys.retain(|_, entry| {
                        if entry.moving {
                            entry.answer();
                        }
                        !entry.moving
                    });
                    !keys.is_empty()
                });
                drop(state);
                self.start_over();
            }
            Err(e) => {
                // A staged message the journal thread skipped while it was
                // moving is to be written after all, at once: its sender
                // has waited.
                let now = Instant::now();
                let State { live, due, .. } = &mut *state;
                for (uaid, keys) in live.iter_mut() {
                    for (key, entry) in keys.iter_mut() {
                        if entry.moving && !entry.written {
                            due.push_back((now, *uaid, key.clone()));
                        }
                        entry.moving = false;
                    }
                }
                state.hurry |= !state.due.is_empty();
                warn!(error = %e, "direct journal rotation failed; will try again");
            }
        }
    }

    /// A new epoch: what the file holds is in redb, and is not read again.
    /// Synced before anything is written in it, so that a crash never
    /// replays the old one. Only this thread writes the file and stamps
    /// records, so stagers and settles do not wait for the sync.
    fn start_over(&mut self) {
        let epoch = self.epoch.wrapping_add(1);
        let written = self
            .file
            .write_all_at(&header(epoch), 0)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| io("cannot start over", e));
        match written {
            Ok(()) => {
                self.epoch = epoch;
                self.next = HEADER;
            }
            Err(e) => warn!(error = %e, "direct journal rotation failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Storage;
    use crate::embedded::EmbeddedStore;
    use crate::embedded::tests::store_with_receipts;
    use autopush_common::receipt::MessageState;
    use autopush_common::time::now_secs;
    use std::sync::atomic::{AtomicU64, Ordering};

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
        let read: Vec<String> = read_records(&file, 7)
            .into_iter()
            .map(|record| match record {
                Record::Settle { key, .. } => key,
                Record::Put { .. } => panic!("a settle was read as a put"),
            })
            .collect();
        assert_eq!(read, keys);
    }

    /// A journal file of `epoch` holding `records` (stamped with
    /// `epoch`), as a node leaves it.
    fn journal_file(epoch: u32, records: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = header(epoch).to_vec();
        bytes.resize(HEADER as usize, 0);
        for record in records {
            let mut record = record.clone();
            stamp(&mut record, epoch);
            bytes.extend(record);
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
        assert!(read_records(&file, 8).is_empty());
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
        assert!(read_records(&file, epoch).is_empty());
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
        read_records(&file, epoch)
    }

    /// The versions of the messages put in the journal file at `path`.
    fn puts_in(path: &Path) -> Vec<String> {
        records_in(path)
            .into_iter()
            .filter_map(|record| match record {
                Record::Put { message, .. } => Some(message.version),
                Record::Settle { .. } => None,
            })
            .collect()
    }

    /// A message staged for a connected client is seen at once; acked
    /// within its grace it is never written, its sender waits no longer,
    /// and its receipt is in the file; one not acked is written when its
    /// sender asks for it.
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
        assert!(matches!(answered, Some(Ok(()))), "the ack did not answer");
        second.saved_now().await.unwrap();
        let path = dir.path().join("direct.journal");
        assert_eq!(puts_in(&path), [kept.version]);

        // What a node killed now leaves: start-up finds the receipt and
        // the message still pending.
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
        assert!(
            matches!(&receipt, Some(StoredMessage::Settled(r)) if r.state == delivered),
            "{receipt:?}"
        );
    }

    /// The receipt of a message acked within its grace reaches the file on
    /// its own, within [`TOMBSTONES_WAIT`] and without waiting for a grace
    /// (30 s under test) to end; no message is written with it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receipt_is_written_without_its_message() {
        let (dir, uaid, store) = store_with_receipts();
        let (acked, waiting) = (message(1, "acked"), message(2, "waiting"));
        let _first = store.stage_direct(&uaid, acked.clone()).await.unwrap();
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
                    Record::Put { .. } => None,
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
            records_in(&path).into_iter().any(|record| matches!(record, Record::Settle { version, .. } if version == acked.version))
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
    async fn assert_receipts(
        store: &EmbeddedStore,
        uaid: &Uuid,
        settled: &[Notification],
        when: &str,
    ) {
        for m in settled {
            let receipt = store.read_message(uaid, &m.sort_key()).await.unwrap();
            assert!(
                matches!(&receipt, Some(StoredMessage::Settled(r)) if r.version == m.version),
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
    /// while a checkpoint moves it.
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
                    let (mut kept, mut settled) = (Vec::new(), Vec::new());
                    for i in 0..60u64 {
                        let ts = clock.fetch_add(1, Ordering::Relaxed);
                        let m = message(ts, &format!("m{ts:04}"));
                        match (task * 7 + i * 13) % 3 {
                            0 => store.save_direct(&uaid, m.clone()).await.unwrap(),
                            1 => {
                                let copy = store.stage_direct(&uaid, m.clone()).await.unwrap();
                                tokio::task::yield_now().await;
                                copy.saved_now().await.unwrap();
                            }
                            _ => {
                                let copy = store.stage_direct(&uaid, m.clone()).await.unwrap();
                                tokio::task::yield_now().await;
                                let (key, delivered) = (m.sort_key(), MessageState::Delivered);
                                let settle =
                                    store.settle_message(&uaid, &key, &m.version, delivered);
                                assert!(settle.await.unwrap(), "{} did not settle", m.version);
                                copy.saved_or_settled().await.unwrap();
                                lock(&settled_so_far).push(m.clone());
                                settled.push(m);
                                continue;
                            }
                        }
                        kept.push(m);
                    }
                    (kept, settled)
                })
            })
            .collect();
        let (mut kept, mut settled) = (Vec::new(), Vec::new());
        for task in tasks {
            let (k, s) = task.await.unwrap();
            kept.extend(k);
            settled.extend(s);
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
                let other = redb::TableDefinition::<u64, u64>::new("receipts");
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
        let tombstone = frame(&settle, None).unwrap().len() as u64;
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
            .find(|m| put(uaid, m).len() as u64 >= want)
            .unwrap();
        store.save_direct(&uaid, last).await.unwrap();
        assert_eq!(left(), tombstone - 8);
        let copy = store.stage_direct(&uaid, staged.clone()).await.unwrap();
        let _acked_copy = store.stage_direct(&uaid, acked.clone()).await.unwrap();
        let settle = store.settle_message(&uaid, &acked_key, &acked.version, delivered);
        assert!(settle.await.unwrap());
        let answered = tokio::time::timeout(Duration::from_secs(20), copy.saved_or_settled());
        assert!(
            matches!(answered.await, Ok(Ok(()))),
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
            let _copy = store.stage_direct(uaid, m.clone()).await.unwrap();
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
            matches!(answered, Ok(Ok(()))),
            "the journal thread waited for its checkpoint"
        );
        busy.await.unwrap().unwrap();
        assert_receipts(&store, &uaid, &settled, "after the checkpoint").await;
    }

    /// A tombstone's writer reserves its place, then writes: one killed in
    /// between leaves zeros (or an older record) before records that were
    /// synced after them. Start-up steps over the gap and keeps them.
    #[tokio::test]
    async fn a_gap_left_by_a_killed_writer_is_stepped_over() {
        let dir = tempfile::tempdir().unwrap();
        let uaid = Uuid::new_v4();
        let (a, b) = (message(1, "a"), message(2, "b"));
        let mut bytes = journal_file(3, &[put(uaid, &a)]);
        bytes.extend([0u8; 40]);
        let mut old = put(uaid, &message(9, "old"));
        stamp(&mut old, 2);
        bytes.extend(old);
        let mut b = put(uaid, &b);
        stamp(&mut b, 3);
        bytes.extend(b);
        assert_eq!(replayed(dir.path(), &bytes, &uaid).await, ["a", "b"]);
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
}
