//! The journal thread: the one writer of the file. It batches staged
//! messages whose grace has ended and waiting settle records into one
//! `write`, syncs the batch if it holds messages, and answers their senders.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;
use tracing::{error, info};
use uuid::Uuid;

use super::super::writer::Writer;
use super::file::JournalFile;
use super::format::{HEADER, RecordRef, frame_into, stamp, stamp_all};
use super::index::State;
use super::{FLUSH_AFTER, FLUSH_AT, MAX_BATCH, RETRY_AFTER, TOMBSTONES_WAIT, grace, io, lock};
use crate::{CopyEnd, Result, StorageError};

pub(super) struct JournalThread {
    pub(super) file: Box<dyn JournalFile>,
    /// The file's path, for errors.
    pub(super) path: PathBuf,
    pub(super) state: Arc<Mutex<State>>,
    pub(super) work: Arc<Condvar>,
    pub(super) writer: Writer,
    pub(super) last_flush: Instant,
    /// The epoch records are written with now (see [`HEADER`]).
    pub(super) epoch: u32,
    /// Where the next record goes (reset by a rotation).
    pub(super) next: u64,
    /// How far the file is synced in this epoch: each batch says so in
    /// its first record (see [`super::format::Format::V2`]).
    pub(super) synced: u64,
    /// The file outgrows this: it rotates (see [`super::rotate_at`]).
    pub(super) rotate_at: u64,
    /// The last batch's bytes, emptied, for the next: a batch of messages
    /// is tens of kilobytes, which a new buffer would grow to by copying
    /// and fault in page by page.
    pub(super) buffer: Vec<u8>,
}

/// The most [`JournalThread::buffer`] keeps between batches (a burst's
/// batch of [`MAX_BATCH`] large messages is several megabytes).
pub(super) const BUFFER_KEPT: usize = 1 << 20;

/// Records the journal thread writes in one `write`: staged messages
/// (then synced) and tombstones (not synced).
pub(super) struct Batch {
    pub(super) bytes: Vec<u8>,
    /// Where they go in the file.
    pub(super) at: u64,
    /// The messages among them: uaid, key, version.
    pub(super) puts: Vec<(u128, String, String)>,
    /// Who waits for those messages.
    pub(super) waiters: Vec<oneshot::Sender<Result<CopyEnd>>>,
}

/// Marks the journal stopped when its thread ends, even by a panic: no
/// message is staged any more, and whoever waits hears it.
pub(super) struct Stopped(Arc<Mutex<State>>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let mut state = lock(&self.0);
        state.stopped = true;
        for entry in state.live.values_mut().flat_map(|keys| keys.values_mut()) {
            drop(entry.waiter.take());
        }
    }
}

/// What of the file a write or a sync is for.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Part {
    Header,
    Batch,
}

impl JournalThread {
    /// Write `bytes` at `at` in the file (or fail, under test, as asked).
    pub(super) fn write_at(&self, bytes: &[u8], at: u64, part: Part) -> std::io::Result<()> {
        #[cfg(test)]
        if part == Part::Batch && lock(&self.state).faults.batch_write {
            return Err(std::io::Error::other("a write failed on purpose"));
        }
        let _ = part;
        self.file.write_at(bytes, at)
    }

    /// Sync the file's data (or fail, under test, as asked).
    pub(super) fn sync(&self, part: Part) -> std::io::Result<()> {
        #[cfg(test)]
        {
            let faults = &lock(&self.state).faults;
            if (part == Part::Header && faults.header_sync)
                || (part == Part::Batch && faults.batch_sync)
            {
                return Err(std::io::Error::other("a sync failed on purpose"));
            }
        }
        let _ = part;
        self.file.sync()
    }

    pub(super) fn run(mut self) {
        let _stopped = Stopped(self.state.clone());
        loop {
            if lock(&self.state).fault.is_some() {
                // Everything the index holds into redb, then a new epoch.
                self.rotate();
                if lock(&self.state).fault.is_some() {
                    if self.wait_to_retry() {
                        break;
                    }
                    continue;
                }
                info!("direct journal: started over, takes messages again");
            }
            let Some(batch) = self.next_batch() else {
                break;
            };
            let Some(batch) = batch else {
                // A checkpoint's time: the receipts have waited long enough.
                self.checkpoint();
                continue;
            };
            self.write(batch);
            let receipts = lock(&self.state).receipts.len();
            if self.next - HEADER >= self.rotate_at {
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

    /// A write or sync of the file failed: what it covered may not be on
    /// disk, and a later sync would not say so (Linux marks the pages
    /// clean after a failed writeback). Nothing more is written in this
    /// epoch: the journal takes no message, and health says so, until
    /// the thread has moved what the index holds into redb and synced a
    /// new epoch's first page ([`JournalThread::rotate`]).
    pub(super) fn fail(&self, e: &StorageError) {
        error!(error = %e, "direct journal: takes no message until it starts over");
        lock(&self.state).fault = Some(e.to_string());
    }

    /// Wait [`RETRY_AFTER`], or less if the store closes: whether it does.
    fn wait_to_retry(&self) -> bool {
        let state = lock(&self.state);
        let (state, _) = self
            .work
            .wait_timeout_while(state, RETRY_AFTER, |state| !state.closing)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.closing
    }

    /// Wait for work: the records to write once the first staged message's
    /// grace ends (or at once, if someone hurries), `Some(None)` when it is
    /// time for a checkpoint, `None` when the store closes. Waits on the
    /// condition variable, which stagers signal only when they need it
    /// sooner than it would wake.
    pub(super) fn next_batch(&mut self) -> Option<Option<Batch>> {
        let shared = self.state.clone();
        let mut state = lock(&shared);
        loop {
            if state.closing {
                return None;
            }
            let now = Instant::now();
            let grace_ends = state.first_staged().map(|at| at + grace());
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
                    now.checked_sub(grace() / 2)
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
    pub(super) fn take_batch(&mut self, state: &mut State, staged_by: Option<Instant>) -> Batch {
        let hurry = std::mem::take(&mut state.hurry);
        let mut batch = Batch {
            bytes: std::mem::take(&mut self.buffer),
            at: 0,
            puts: Vec::new(),
            waiters: Vec::new(),
        };
        let mut unframed = Vec::new();
        let synced = RecordRef::Synced { to: self.synced };
        if frame_into(&mut batch.bytes, |out| synced.write_json(out), None).is_ok() {
            stamp(&mut batch.bytes, self.epoch);
        }
        let marker = batch.bytes.len();
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
        if batch.bytes.len() == marker {
            // Nothing to write.
            batch.bytes.clear();
        }
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
    pub(super) fn write(&mut self, batch: Batch) {
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
        let mut written = self.write_at(&bytes, at, Part::Batch);
        if !puts.is_empty() {
            written = written.and_then(|()| self.sync(Part::Batch));
            if written.is_ok() {
                self.synced = at + bytes.len() as u64;
            }
        }
        bytes.clear();
        bytes.shrink_to(BUFFER_KEPT);
        self.buffer = bytes;
        let written = written.map_err(|e| io(&self.path, "cannot append", e));
        if let Err(e) = &written {
            self.fail(e);
            // Not durable: out of the index, and the senders hear it.
            let mut state = lock(&self.state);
            for (uaid, key, version) in &puts {
                state.remove_version(*uaid, key, version);
            }
        }
        for waiter in waiters {
            let _ = waiter.send(match &written {
                Ok(()) => Ok(CopyEnd::Saved),
                Err(e) => Err(StorageError::Backend(e.to_string())),
            });
        }
    }
}
