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
//! once ([`rotation::PREALLOCATE`]), and starting over means a new epoch in its first
//! page, not a shorter file. An `fdatasync` of blocks the file already has
//! writes the data and nothing else; one that grows the file also writes
//! its new size and blocks (and on a journaled ext4 commits the journal),
//! about twice the time, and the pushes waiting for it wait that much. Each
//! record carries the epoch, so records of earlier epochs that are still in
//! the file are not read again.
//!
//! Only the journal thread writes, each batch right after the last, and it
//! syncs before it answers. `kill -9` leaves at most a torn tail past the
//! last whole record; a power loss may leave any of the blocks of a batch
//! whose sync had not returned, and not others. Each batch starts by saying
//! how far the file was synced when it was written, so replay tells the
//! two apart ([`format::Format`]): what a crash cut short is dropped, with a
//! warning naming its offset; a place it cannot read, before a batch that
//! says it was synced, was answered for: the node refuses to start, naming
//! the file and the offset (`autopush db replay-journal` reads what it can).
//! Every move into redb is
//! conditional: a message is written only where its key is free in the
//! messages table and holds no receipt, so a replay never overwrites a
//! newer message nor resurrects a settled message whose receipt reached
//! redb. (With receipts off a settled message leaves no row: one whose
//! tombstone a crash lost is delivered again, never lost.)
//!
//! Only messages without a topic are journaled: their key holds a unique
//! timestamp, so two of them never compete for a key. A topic message
//! replaces an older one under its key, which redb's conditional write does.

mod file;
mod format;
mod index;
#[cfg(test)]
mod power_loss;
mod rotation;
#[cfg(test)]
mod tests;
mod thread;

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use autopush_common::Notification;
use redb::Database;

use super::writer::Writer;
use crate::{Result, StorageError};
pub(super) use file::JournalFile;
use format::HEADER;
pub(super) use index::NotStaged;
use index::State;
pub use rotation::JournalReplay;
use rotation::{replay, replay_file};
use thread::JournalThread;

/// The file outgrows this: its unsettled messages move to redb and it starts over.
/// (Small under test, so that tests rotate.)
const ROTATE_AT: u64 = if cfg!(test) { 4096 } else { 16 << 20 };

/// [`ROTATE_AT`], or `AUTOPUSH_TEST_JOURNAL_ROTATE_AT` bytes: the crash
/// tests of the binary rotate every few pushes (hidden: not a setting).
fn rotate_at() -> u64 {
    std::env::var("AUTOPUSH_TEST_JOURNAL_ROTATE_AT")
        .ok()
        .and_then(|bytes| bytes.parse().ok())
        .filter(|bytes| *bytes > 0)
        .unwrap_or(ROTATE_AT)
}
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
/// (see [`Journal::stage`]). Its sender waits for the first of the ack
/// and the sync, so this is what a client's round trip can cost a
/// sender: short, since real clients are 20–300 ms away and would never
/// ack within any grace a sender could wait out (and the copies of a
/// client known to ack late are hurried, see `DirectCopy::hurry`). On
/// loopback, clients of a busy node ack in 1–5 ms: at 4 000 pushes/s,
/// 10 ms kept every record out of the file, 2 ms let 4.5–10 MB/s of them
/// in, the price of senders that do not wait.
const GRACE: Duration = Duration::from_millis(2);

/// [`GRACE`], or longer where a test decides what is acked within it: 30 s
/// under this crate's tests, `AUTOPUSH_TEST_JOURNAL_GRACE_MS` for the
/// binary's (hidden: not a setting). Read once.
fn grace() -> Duration {
    static TEST: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *TEST.get_or_init(|| {
        if cfg!(test) {
            return Duration::from_secs(30);
        }
        autopush_common::time::test_millis("AUTOPUSH_TEST_JOURNAL_GRACE_MS").unwrap_or(GRACE)
    })
}

/// A settle record (a written message's tombstone, or a receipt) waits at
/// most this long, to be written with others in one `write` (see
/// [`Journal::settle`]). Nobody waits for these records: as long as a
/// grace, so that under load the thread wakes for them no more often than
/// for the staged messages (at 2 ms it woke about a thousand times a
/// second at 4 000 pushes/s). Written one by one as acks came, they cost a
/// `write` per ack, under the state's lock.
const TOMBSTONES_WAIT: Duration = Duration::from_millis(10);
/// How long the journal thread waits before it tries again to start over
/// after a failed write or sync. (Short under test.)
const RETRY_AFTER: Duration = if cfg!(test) {
    Duration::from_millis(20)
} else {
    Duration::from_secs(1)
};

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

/// A failed read or write of the journal file at `path`, named.
fn io(path: &Path, what: &str, e: std::io::Error) -> StorageError {
    StorageError::Backend(format!("direct journal {}: {what}: {e}", path.display()))
}

impl Journal {
    /// Open the journal in `dir`: replay what a previous run left into `db`
    /// (before anything else writes to it), then start the journal thread,
    /// which writes the file through what `wrap` makes of it (the file
    /// itself, but under test).
    pub(super) fn open(
        dir: &Path,
        db: &Database,
        writer: Writer,
        wrap: impl FnOnce(File) -> Box<dyn JournalFile>,
    ) -> Result<Journal> {
        let path = dir.join("direct.journal");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io(&path, "cannot open", e))?;
        let mut file = wrap(file);
        let epoch = replay(&mut *file, &path, db)?;
        // A file just made (this one, the store's) is lost to a power loss
        // until its directory is synced as well.
        File::open(dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|e| io(dir, "cannot sync its directory", e))?;
        let state = Arc::new(Mutex::new(State::default()));
        let work = Arc::new(Condvar::new());
        let thread = JournalThread {
            file,
            path: path.clone(),
            state: state.clone(),
            work: work.clone(),
            writer,
            last_flush: Instant::now(),
            epoch,
            next: HEADER,
            synced: HEADER,
            rotate_at: rotate_at(),
            buffer: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("direct-journal".into())
            .spawn(move || thread.run())
            .map_err(|e| io(&path, "cannot start its thread", e))?;
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

    /// Whether the journal takes messages: its thread runs (it stops only
    /// if it panicked), and no failed write or sync waits for a new epoch.
    pub(super) fn health(&self) -> Result<()> {
        let running = lock(&self.shared.thread)
            .as_ref()
            .is_some_and(|thread| !thread.is_finished());
        if !running {
            return Err(StorageError::Backend(
                "the embedded store's direct journal thread has stopped".into(),
            ));
        }
        match &lock(&self.shared.state).fault {
            Some(fault) => Err(StorageError::Backend(format!(
                "the embedded store's direct journal takes no message until it starts over: {fault}"
            ))),
            None => Ok(()),
        }
    }

    /// Move what can be read of the journal file at `path` (one the node
    /// refused, moved aside) into `db`: see [`replay_file`].
    pub(super) fn replay_file(path: &Path, db: &Database) -> Result<JournalReplay> {
        replay_file(path, db)
    }

    /// Whether `message` can be journaled (see the module's notes).
    pub(super) fn takes(message: &Notification) -> bool {
        message.topic.is_none()
    }
}
