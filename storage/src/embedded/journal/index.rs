//! The index: what the journal knows in memory (unsettled messages and
//! receipts not in redb yet), and how stagers, settles and readers use it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use autopush_common::{FastMap, Notification};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::format::{RecordRef, SettledAs, frame_into};
use super::{FLUSH_AT, Journal, Settled, TOMBSTONES_WAIT, lock};
use crate::{CopyEnd, Receipt, Result, StorageError, StoredMessage};

/// What the journal knows: unsettled messages and receipts not in redb yet.
#[derive(Default)]
pub(super) struct State {
    /// uaid -> sort key -> message.
    pub(super) live: FastMap<u128, BTreeMap<String, Entry>>,
    /// Receipts of settled journal messages, until a checkpoint commits them.
    pub(super) receipts: FastMap<(u128, String), Receipt>,
    /// The receipts the transaction running now is committing, taken out
    /// of `receipts` whole (no copy under the lock) and read here until
    /// it has.
    pub(super) receipts_moving: Option<Arc<FastMap<(u128, String), Receipt>>>,
    /// A checkpoint of receipts is queued or committing (one at a time).
    pub(super) checkpointing: bool,
    /// Staged messages the journal thread is to write, oldest first: when
    /// each was staged, its uaid and key.
    pub(super) due: VecDeque<(Instant, u128, String)>,
    /// Someone waits for the due messages to be written now.
    pub(super) hurry: bool,
    /// Settle records (tombstones of written messages, receipts of messages
    /// acked within their grace), framed one after the other: written with
    /// the next batch, at most [`TOMBSTONES_WAIT`] after the first of them,
    /// in the order of their settles and after the record of every message
    /// they settle.
    pub(super) tombstones: Vec<u8>,
    pub(super) tombstones_since: Option<Instant>,
    /// When the journal thread wakes by itself, while it waits for work;
    /// `None` while it works (it looks at the state again before it waits).
    pub(super) asleep_until: Option<Instant>,
    /// The store is closing: the journal thread finishes.
    pub(super) closing: bool,
    /// The journal thread has stopped (closed, or panicked).
    pub(super) stopped: bool,
    /// Why the journal takes no message: a write or sync of the file
    /// failed, and it is not on a new epoch yet (see
    /// [`super::thread::JournalThread::fail`]).
    pub(super) fault: Option<String>,
    /// Failures the journal thread meets on purpose.
    #[cfg(test)]
    pub(super) faults: Faults,
}

/// Test seam: while one is set, every such write or sync of the file fails.
#[cfg(test)]
#[derive(Default)]
pub(super) struct Faults {
    pub(super) header_sync: bool,
    pub(super) batch_sync: bool,
    pub(super) batch_write: bool,
}

pub(super) struct Entry {
    pub(super) message: Notification,
    /// Being moved into redb by the transaction running now: a settle must
    /// go to redb, after that transaction.
    pub(super) moving: bool,
    /// Its record is written (or being written by the journal thread): a
    /// settle must have a tombstone written after it.
    pub(super) written: bool,
    /// Who waits for it to be durable, until the journal thread writes it
    /// or something else answers first: a settle (the message is acked,
    /// nothing is left to keep) or a checkpoint (it is in redb).
    pub(super) waiter: Option<oneshot::Sender<Result<CopyEnd>>>,
    /// Staged for a connected client, by a caller that answers its sender
    /// only once the waiter answers: an ack that comes before the record
    /// is written leaves nothing, not even a receipt, since the caller
    /// seals `delivered` into the id it answers with ([`CopyEnd::Acked`]).
    pub(super) seals: bool,
}

impl Entry {
    /// A message whose record is in the file already (replayed).
    pub(super) fn written(message: Notification) -> Entry {
        Entry {
            message,
            moving: false,
            written: true,
            waiter: None,
            seals: false,
        }
    }

    /// Tell whoever waits that the message needs nothing more from the file.
    pub(super) fn answer(&mut self, end: CopyEnd) {
        if let Some(waiter) = self.waiter.take() {
            let _ = waiter.send(Ok(end));
        }
    }

    /// Whether its client's ack now is sealed by whoever waits (see
    /// [`Entry::seals`]): it comes before any of the message was written,
    /// while its caller still waits (one that stopped answers no sender).
    fn sealed_by_ack(&self) -> bool {
        self.seals && !self.written && self.waiter.as_ref().is_some_and(|w| !w.is_closed())
    }
}

/// Why [`Journal::stage`] did not stage a message.
pub(in crate::embedded) enum NotStaged {
    /// The journal takes no message now (a write or sync failed and it has
    /// not started over, or its thread stopped): the message, handed back
    /// for redb to take.
    Closed(Box<Notification>, StorageError),
    Refused(StorageError),
}

impl From<NotStaged> for StorageError {
    fn from(not: NotStaged) -> StorageError {
        match not {
            NotStaged::Closed(_, e) | NotStaged::Refused(e) => e,
        }
    }
}

impl State {
    /// When the oldest message still staged (not settled, written nor
    /// moved) was staged; what the journal no longer needs to write is
    /// dropped from [`State::due`] on the way.
    pub(super) fn first_staged(&mut self) -> Option<Instant> {
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
    pub(super) fn remove_version(&mut self, uaid: u128, key: &str, version: &str) {
        let held = self.live.get(&uaid).and_then(|keys| keys.get(key));
        if held.is_some_and(|entry| entry.message.version == version) {
            self.remove(uaid, key);
        }
    }

    /// Drop `key` from the index: its owned key (a settle keeps it for
    /// the receipt) and its entry.
    pub(super) fn remove(&mut self, uaid: u128, key: &str) -> Option<(String, Entry)> {
        let keys = self.live.get_mut(&uaid)?;
        let entry = keys.remove_entry(key);
        if keys.is_empty() {
            self.live.remove(&uaid);
        }
        entry
    }
}

impl State {
    /// The receipts a checkpoint commits: taken out of `receipts` whole
    /// the first time, and the same ones again if the writer runs the
    /// checkpoint a second time, in a transaction of its own, because the
    /// one it shared failed.
    pub(super) fn receipts_to_move(&mut self) -> Arc<FastMap<(u128, String), Receipt>> {
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
    pub(super) fn receipts_moved(&mut self, moved: &Result<()>) {
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

impl Journal {
    /// Put `message` in the index now (every read and settle sees it from
    /// here on), and have the journal thread write it: at once, or with
    /// `grace` once its grace (see [`super::GRACE`]) has passed. The
    /// receiver answers once the record is on disk, or before that if the
    /// message no longer needs it: settled (a client acked it within the
    /// grace, so it is never written at all) or moved into redb by a
    /// checkpoint. With `grace`, the caller answers its sender only after
    /// the receiver, and seals an ack that came first ([`CopyEnd::Acked`]):
    /// no receipt is kept for it.
    ///
    /// Fails with [`StorageError::KeyTaken`] if the index holds another
    /// message under its key, or this one not yet on disk; with the
    /// message handed back if the journal takes none now (see
    /// [`NotStaged`]).
    pub(in crate::embedded) fn stage(
        &self,
        uaid: &Uuid,
        message: Notification,
        grace: bool,
    ) -> std::result::Result<oneshot::Receiver<Result<CopyEnd>>, NotStaged> {
        let (uaid, key) = (uaid.as_u128(), message.sort_key());
        let due_key = key.clone();
        let (waiter, done) = oneshot::channel();
        let mut state = lock(&self.shared.state);
        if state.stopped {
            let why = "the direct journal has stopped".into();
            return Err(NotStaged::Closed(
                Box::new(message),
                StorageError::Backend(why),
            ));
        }
        if let Some(fault) = &state.fault {
            let why = format!("the direct journal takes no message until it starts over: {fault}");
            return Err(NotStaged::Closed(
                Box::new(message),
                StorageError::Backend(why),
            ));
        }
        let keys = state.live.entry(uaid).or_default();
        if let Some(held) = keys.get(&key) {
            // The same message again, once on disk, is saved already.
            if held.message.version == message.version && held.written && !held.moving {
                let _ = waiter.send(Ok(CopyEnd::Saved));
                return Ok(done);
            }
            return Err(NotStaged::Refused(StorageError::KeyTaken(key)));
        }
        keys.insert(
            key,
            Entry {
                message,
                moving: false,
                written: false,
                waiter: Some(waiter),
                seals: grace,
            },
        );
        let now = Instant::now();
        state.due.push_back((now, uaid, due_key));
        let wake = match grace {
            true => self.wake_by(&mut state, now + super::grace()),
            false => self.hurry_locked(&mut state),
        };
        drop(state);
        self.wake(wake);
        Ok(done)
    }

    /// Have the journal thread write what is staged now, without waiting
    /// for the rest of a grace.
    pub(in crate::embedded) fn hurry(&self) {
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
    /// the file holds the message or the receipt needs one. An `ack` (its
    /// client's) of a message whose sender is still waiting and that is
    /// not written yet keeps nothing (see [`Entry::seals`]).
    pub(in crate::embedded) fn settle(
        &self,
        uaid: u128,
        key: &str,
        version: &str,
        receipt: Option<Receipt>,
        unexpired_at: Option<u64>,
        ack: bool,
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
        // Acked before its sender was answered, which seals its receipt
        // into the message's id: nothing of it goes to the file.
        let sealed = ack && entry.sealed_by_ack();
        let receipt = receipt.filter(|_| !sealed);
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
            entry.answer(match sealed {
                true => CopyEnd::Acked,
                false => CopyEnd::Saved,
            });
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
    pub(in crate::embedded) fn read(&self, uaid: u128, key: &str) -> Option<StoredMessage> {
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
    pub(in crate::embedded) fn messages(&self, uaid: u128) -> Vec<Notification> {
        let state = lock(&self.shared.state);
        state
            .live
            .get(&uaid)
            .map(|keys| keys.values().map(|e| e.message.clone()).collect())
            .unwrap_or_default()
    }

    /// The keys and versions of `uaid`'s unsettled messages.
    pub(in crate::embedded) fn versions(&self, uaid: u128) -> Vec<(String, String)> {
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
