//! Replay and rotation: what the file holds moves into redb, at start-up
//! and when the file starts over, and receipts reach redb in checkpoints.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use autopush_common::{FastMap, Notification};
use redb::{Database, ReadableTable, WriteTransaction};
use tracing::warn;

use super::super::receipts::{self, RECEIPTS, holds as receipt_held};
use super::super::{MESSAGES, backend, corrupt};
use super::file::JournalFile;
use super::format::{
    FirstPage, Format, HEADER, Record, epoch_of, first_page, header, latest_epoch, read_records,
    salvage_records,
};
use super::index::{Entry, State};
use super::thread::{JournalThread, Part};
use super::{ROTATE_AT, io, lock};
use crate::{CopyEnd, Receipt, Result, StorageError};

/// Bytes of zeros the file is given once, so that records overwrite
/// blocks it has (see the module's notes); past it (a burst before a
/// rotation) it grows.
pub(super) const PREALLOCATE: u64 = HEADER + ROTATE_AT + ROTATE_AT / 2;

/// Write `message` into redb unless its key holds something already, in
/// the messages table or in the receipts table: a message settled in redb
/// (acked while a rotation moved it, or checkpointed while its tombstone
/// was not synced yet) is not brought back, nor its receipt undone.
pub(super) fn move_message(
    table: &mut redb::Table<(u128, &str), &[u8]>,
    receipts: &redb::Table<receipts::Key, receipts::Row>,
    uaid: u128,
    message: &Notification,
) -> Result<()> {
    let key = message.sort_key();
    if table.get((uaid, key.as_str())).map_err(backend)?.is_none()
        && !receipt_held(receipts, uaid, &key)?
    {
        let json = message.to_json().map_err(corrupt)?;
        table
            .insert((uaid, key.as_str()), json.as_slice())
            .map_err(backend)?;
    }
    Ok(())
}

/// Move what the file holds into redb, then start it over: write it the
/// epoch it is to be written in from now on, which is returned (and give it
/// its zeros, the first time).
///
/// A file it cannot read whole stops it: see [`unreadable`].
pub(super) fn replay(file: &mut dyn JournalFile, path: &Path, db: &Database) -> Result<u32> {
    let bytes = file.read_all().map_err(|e| io(path, "cannot read", e))?;
    let current = first_page(&bytes).map_err(|first| {
        refuse(
            path,
            &match first {
                FirstPage::Foreign => "its first page is not a journal's".to_owned(),
                FirstPage::Zeroed(at) => format!(
                    "its first page is zeros, yet a whole record starts at offset {at}: \
                     the epoch that tells its current records from older ones was lost"
                ),
            },
        )
    })?;
    if let Some((epoch, format)) = current {
        let read = read_records(&bytes, epoch, format).map_err(|bad| {
            let what = match format {
                Format::V1 => format!(
                    "nothing whole at offset {}, yet whole records after it (the next at \
                     offset {}): a record there was synced and its sender told it was saved",
                    bad.at, bad.next
                ),
                Format::V2 => format!(
                    "nothing whole at offset {}, yet the batch at offset {} was written once \
                     the file was synced past it: what stood there was synced and its senders \
                     told it was saved",
                    bad.at, bad.next
                ),
            };
            refuse(path, &what)
        })?;
        if let Some(first) = read.unsynced {
            warn!(
                file = %path.display(),
                offset = read.end,
                first_dropped = first,
                "direct journal: a batch from this offset on was never synced (a power loss \
                 kept some of its blocks and not others; its senders had not been answered); \
                 dropped"
            );
        } else if read.torn {
            warn!(
                file = %path.display(),
                offset = read.end,
                "direct journal: the last record was torn by a crash while it was written \
                 (its sender had not been answered); dropped"
            );
        }
        if !read.records.is_empty() {
            move_records(read.records, db)?;
        }
    }
    let epoch = current.map(|(epoch, _)| epoch);
    let epoch = epoch.map_or(1, |epoch| epoch.wrapping_add(1));
    file.write_at(&header(epoch), 0)
        .map_err(|e| io(path, "cannot write", e))?;
    let zeros = vec![0u8; 1 << 20];
    let mut len = bytes.len().max(16) as u64;
    while len < PREALLOCATE {
        let n = zeros.len().min((PREALLOCATE - len) as usize);
        file.write_at(&zeros[..n], len)
            .map_err(|e| io(path, "cannot write", e))?;
        len += n as u64;
    }
    file.sync().map_err(|e| io(path, "cannot sync", e))?;
    Ok(epoch)
}

/// Why the node does not start on the journal file at `path` (`what` it
/// found there), and what to do.
fn refuse(path: &Path, what: &str) -> StorageError {
    let path = path.display();
    StorageError::Corrupt(format!(
        "direct journal {path}: {what}. Refusing to start rather than drop what it holds. \
         Move the file aside (mv {path} {path}.unreadable), run `autopush db replay-journal \
         {path}.unreadable` with the same --db, then start again (\"A journal the node refuses to \
         read\" in /usr/share/doc/autopush/docs/operations.md, docs/operations.md in the source)"
    ))
}

/// What [`replay_file`] found in a journal file the node refused.
#[derive(Debug)]
pub struct JournalReplay {
    /// The epoch whose records were read: the first page's, else (a page
    /// lost or not a journal's) the latest among the records; `None` if
    /// the file holds no whole record.
    pub epoch: Option<u32>,
    /// Records of that epoch moved into the store.
    pub records: usize,
    /// Where each stretch that holds no whole record starts, before
    /// records that were read: what was there is lost.
    pub skipped: Vec<usize>,
}

/// Move every whole record of the current epoch of the journal file at
/// `path` into `db`, stepping over what cannot be read (what the node
/// refused to do by itself). The moves are conditional, as at start-up.
pub(super) fn replay_file(path: &Path, db: &Database) -> Result<JournalReplay> {
    let bytes = std::fs::read(path).map_err(|e| io(path, "cannot read", e))?;
    let epoch = match epoch_of(&bytes) {
        Ok(Some(epoch)) => Some(epoch),
        Ok(None) | Err(_) => latest_epoch(&bytes),
    };
    let Some(epoch) = epoch else {
        return Ok(JournalReplay {
            epoch: None,
            records: 0,
            skipped: Vec::new(),
        });
    };
    let (records, skipped) = salvage_records(&bytes, epoch);
    let found = records.len();
    if found > 0 {
        move_records(records, db)?;
    }
    Ok(JournalReplay {
        epoch: Some(epoch),
        records: found,
        skipped,
    })
}

/// Move replayed records into redb: what they left unsettled as stored
/// messages, their receipts as receipts.
pub(super) fn move_records(records: Vec<Record>, db: &Database) -> Result<()> {
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
            Record::Synced { .. } => {}
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

pub(super) fn move_state(
    txn: &WriteTransaction,
    live: &FastMap<u128, BTreeMap<String, Entry>>,
    receipts: &FastMap<(u128, String), Receipt>,
) -> Result<()> {
    put_receipts(txn, receipts)?;
    let receipts = txn.open_table(RECEIPTS).map_err(backend)?;
    let mut table = txn.open_table(MESSAGES).map_err(backend)?;
    for (uaid, keys) in live {
        for entry in keys.values() {
            move_message(&mut table, &receipts, *uaid, &entry.message)?;
        }
    }
    Ok(())
}

pub(super) fn put_receipts(
    txn: &WriteTransaction,
    receipts: &FastMap<(u128, String), Receipt>,
) -> Result<()> {
    let mut table = txn.open_table(RECEIPTS).map_err(backend)?;
    let receipts = receipts
        .iter()
        .map(|((uaid, key), receipt)| (*uaid, key.as_str(), receipt));
    receipts::put_all(&mut table, receipts)
}

impl JournalThread {
    /// Commit the waiting receipts to redb, without waiting for the
    /// commit: a commit of thousands of receipts takes a hundred
    /// milliseconds or more, and the staged messages whose grace ends
    /// meanwhile would wait for it. One at a time; a second is not needed
    /// before the first is done.
    pub(super) fn checkpoint(&mut self) {
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
    pub(super) fn wait_for_checkpoint(&self) {
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
    pub(super) fn rotate(&mut self) {
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
            let receipts = txn.open_table(RECEIPTS).map_err(backend)?;
            let mut table = txn.open_table(MESSAGES).map_err(backend)?;
            for (uaid, message) in &live {
                move_message(&mut table, &receipts, *uaid, message)?;
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
                            entry.answer(CopyEnd::Saved);
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
    pub(super) fn start_over(&mut self) {
        let epoch = self.epoch.wrapping_add(1);
        let written = self
            .write_at(&header(epoch), 0, Part::Header)
            .and_then(|()| self.sync(Part::Header))
            .map_err(|e| io(&self.path, "cannot start over", e));
        match written {
            Ok(()) => {
                self.epoch = epoch;
                self.next = HEADER;
                self.synced = HEADER;
                lock(&self.state).fault = None;
            }
            Err(e) => self.fail(&e),
        }
    }
}
