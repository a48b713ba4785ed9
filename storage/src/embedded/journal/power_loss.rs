//! Power loss, as file-system crash checkers model it (ALICE,
//! CrashMonkey). A workload that rotates the journal, checkpoints its
//! receipts and restarts the store runs on a journal file that records
//! every write and sync (a [`JournalFile`]), and redb's tables before and
//! after each. At each point, with redb as it was then, it builds the
//! states a power loss can leave: everything synced, plus any version of
//! each block written since the last sync (all of them when there are few,
//! a sample when there are more). Each state is opened as the node would
//! open it when the power comes back, and checked against a model:
//!
//! * the store opens;
//! * every message answered is there, unless a settle of it had begun;
//! * with receipts on, no message comes back once its settle was durable
//!   (a message staged after the settle returned was answered), and its
//!   receipt is there (with receipts off, a settled message may come back,
//!   as documented);
//! * damage to what was synced (a record of a batch that a later batch,
//!   written after the sync, follows) stops the start, naming the file and
//!   the offset.
//!
//! `JOURNAL_POWER_LOSS_ROUNDS` (default 1) runs more workloads, each of
//! `JOURNAL_POWER_LOSS_STEPS` steps (default 40); `JOURNAL_POWER_LOSS_SEED`
//! repeats one.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use autopush_common::Notification;
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use redb::{Database, ReadableDatabase, ReadableTable};
use uuid::Uuid;

use super::JournalFile;
use super::format::HEADER;
use super::lock;
use crate::embedded::receipts::RECEIPTS;
use crate::embedded::{DEFAULT_CACHE_MIB, EmbeddedStore, MESSAGES};
use crate::{CopyEnd, Storage, StoredMessage};

/// The disk keeps or loses what was written since the last sync in blocks
/// of this size: a sector (a page is eight, and may be torn between them).
const BLOCK: usize = 512;
/// A point with at most this many states has each checked; one with more,
/// this many at random, and the two where every block was lost or kept.
const ENUMERATE_UP_TO: usize = 16;
const SAMPLE: usize = 6;
/// One point in this many also has a synced record damaged.
const DAMAGE_ONE_IN: u32 = 3;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// What the journal did to its file.
enum Op {
    Write { at: u64, bytes: Vec<u8> },
    Sync,
}

/// redb's messages and receipts at one moment.
#[derive(PartialEq, Default)]
struct Tables {
    messages: Vec<((u128, String), Vec<u8>)>,
    receipts: Vec<([u8; 16], [u8; 13])>,
}

impl Tables {
    fn of(db: &Database) -> Tables {
        let txn = db.begin_read().unwrap();
        let messages = txn.open_table(MESSAGES).unwrap();
        let receipts = txn.open_table(RECEIPTS).unwrap();
        Tables {
            messages: messages
                .iter()
                .unwrap()
                .map(|row| {
                    let (k, v) = row.unwrap();
                    let (uaid, key) = k.value();
                    ((uaid, key.to_owned()), v.value().to_vec())
                })
                .collect(),
            receipts: receipts
                .iter()
                .unwrap()
                .map(|row| {
                    let (k, v) = row.unwrap();
                    (k.value(), v.value())
                })
                .collect(),
        }
    }

    /// A store in `dir` holding these rows (and nothing else yet).
    fn write_to(&self, dir: &Path) {
        let db = Database::create(dir.join("autopush.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut messages = txn.open_table(MESSAGES).unwrap();
            for ((uaid, key), value) in &self.messages {
                messages
                    .insert((*uaid, key.as_str()), value.as_slice())
                    .unwrap();
            }
            let mut receipts = txn.open_table(RECEIPTS).unwrap();
            for (key, value) in &self.receipts {
                receipts.insert(key, value).unwrap();
            }
        }
        txn.commit().unwrap();
    }
}

/// What the model hears from the workload, by message number.
#[derive(Clone, Copy)]
enum Event {
    Staged(usize),
    Answered(usize),
    SettleStarted(usize),
    Settled(usize),
    /// Acked before anything of it was written: its sender's id carries
    /// its receipt, and the store keeps none.
    Sealed(usize),
}

/// The instants a power loss is tried at: just before and just after each
/// op, each with redb's tables then. An event of the workload logged
/// before an instant happened before a power loss then.
#[derive(Default)]
struct Recording {
    ops: Vec<Op>,
    /// The instants between op `k - 1` and op `k` (after the last op for
    /// `k` = `ops.len()`): each one's number, and redb's tables then.
    moments: Vec<Vec<(usize, Arc<Tables>)>>,
    /// How many instants there were so far.
    instants: usize,
    last: Arc<Tables>,
    /// Each with how many instants there were when it happened.
    events: Vec<(usize, Event)>,
}

impl Recording {
    /// An instant: redb as seen now, between ops (read while the
    /// recording is locked, so that no event is logged meanwhile).
    fn seen(&mut self, db: &Weak<Database>) {
        let Some(db) = db.upgrade() else {
            return;
        };
        let tables = Tables::of(&db);
        if *self.last != tables {
            self.last = Arc::new(tables);
        }
        let k = self.ops.len();
        self.moments.resize_with(k + 1, Vec::new);
        self.moments[k].push((self.instants, self.last.clone()));
        self.instants += 1;
    }
}

/// The journal's file, recording what the journal does to it.
struct Recorder {
    file: File,
    recording: Arc<Mutex<Recording>>,
    db: Weak<Database>,
}

impl Recorder {
    fn seen(&self) {
        lock(&self.recording).seen(&self.db);
    }

    fn done(&self, op: Op) {
        let mut recording = lock(&self.recording);
        recording.ops.push(op);
        recording.seen(&self.db);
    }
}

impl JournalFile for Recorder {
    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        self.file.read_all()
    }

    fn write_at(&self, bytes: &[u8], at: u64) -> std::io::Result<()> {
        self.seen();
        JournalFile::write_at(&self.file, bytes, at)?;
        self.done(Op::Write {
            at,
            bytes: bytes.to_vec(),
        });
        Ok(())
    }

    fn sync(&self) -> std::io::Result<()> {
        self.seen();
        JournalFile::sync(&self.file)?;
        self.done(Op::Sync);
        Ok(())
    }
}

/// A directory for a store: in memory where there is one (a state is
/// opened thousands of times), else the temporary directory.
fn scratch() -> tempfile::TempDir {
    match Path::new("/dev/shm").is_dir() {
        true => tempfile::tempdir_in("/dev/shm").unwrap(),
        false => tempfile::tempdir().unwrap(),
    }
}

struct Workload {
    recording: Arc<Mutex<Recording>>,
    receipts: bool,
    /// Every message staged, by number.
    sent: Vec<(Uuid, Notification)>,
}

impl Workload {
    fn open(&self, dir: &Path) -> EmbeddedStore {
        let recording = self.recording.clone();
        let store = EmbeddedStore::open_with(dir, DEFAULT_CACHE_MIB << 20, |file, db| {
            let recorder = Recorder {
                file,
                recording,
                db: Arc::downgrade(db),
            };
            recorder.seen();
            Box::new(recorder)
        })
        .unwrap();
        match self.receipts {
            true => store.with_receipt_retention(3600),
            false => store,
        }
    }

    fn log(&self, event: Event) {
        let mut recording = lock(&self.recording);
        let instant = recording.instants;
        recording.events.push((instant, event));
    }

    /// A new message for one of two users: a few bytes, or more than a block.
    fn message(&mut self, rng: &mut fastrand::Rng) -> usize {
        let n = self.sent.len();
        let uaid = Uuid::from_u128(1 + rng.u128(0..2));
        let size = if rng.u8(0..4) == 0 {
            rng.usize(BLOCK..3 * BLOCK)
        } else {
            rng.usize(1..64)
        };
        let message = Notification {
            channel_id: Uuid::from_u128(7),
            version: format!("v{n}"),
            ttl: 3600,
            timestamp: now_secs(),
            topic: None,
            sortkey_timestamp: Some(n as u64 + 1),
            data: Some(format!("{n}:{}", "x".repeat(size))),
            headers: None,
            urgency: None,
            durable: false,
        };
        self.sent.push((uaid, message));
        n
    }

    /// Stage `count` messages at once and have them written, in one
    /// batch: their numbers.
    async fn put(
        &mut self,
        store: &EmbeddedStore,
        rng: &mut fastrand::Rng,
        count: usize,
    ) -> Vec<usize> {
        let mut copies = Vec::new();
        for _ in 0..count {
            let n = self.message(rng);
            self.log(Event::Staged(n));
            let (uaid, message) = self.sent[n].clone();
            copies.push((n, store.stage_direct(&uaid, message).await.unwrap()));
        }
        let answers = copies
            .into_iter()
            .map(|(n, copy)| async move { copy.saved_now().await.map(|_| n) });
        let mut answered = Vec::new();
        for answer in futures_util::future::join_all(answers).await {
            let n = answer.unwrap();
            self.log(Event::Answered(n));
            answered.push(n);
        }
        answered
    }

    async fn settle(&self, store: &EmbeddedStore, n: usize) {
        let (uaid, message) = &self.sent[n];
        self.log(Event::SettleStarted(n));
        let settled = store
            .settle_message(
                uaid,
                &message.sort_key(),
                &message.version,
                MessageState::Delivered,
            )
            .await
            .unwrap();
        assert!(settled, "{} did not settle", message.version);
        self.log(Event::Settled(n));
    }

    /// Run `steps` random steps in `dir`.
    async fn run(&mut self, dir: &Path, rng: &mut fastrand::Rng, steps: u64) {
        let mut store = self.open(dir);
        let mut unsettled = Vec::new();
        for _ in 0..steps {
            match rng.u8(0..12) {
                0..=2 => unsettled.extend(self.put(&store, rng, 1).await),
                3..=4 => {
                    let count = rng.usize(2..5);
                    unsettled.extend(self.put(&store, rng, count).await);
                }
                5 => {
                    // Acked within its grace: never written as a message.
                    let n = self.message(rng);
                    self.log(Event::Staged(n));
                    let (uaid, message) = self.sent[n].clone();
                    let copy = store.stage_direct(&uaid, message).await.unwrap();
                    self.settle(&store, n).await;
                    // Sealed, unless a rotation moved it into redb first.
                    if copy.saved_or_settled().await.unwrap() == CopyEnd::Acked {
                        self.log(Event::Sealed(n));
                    }
                }
                6..=8 if !unsettled.is_empty() => {
                    let n = unsettled.swap_remove(rng.usize(..unsettled.len()));
                    self.settle(&store, n).await;
                }
                6..=10 => {
                    // Settle records wait 10 ms, then go alone, unsynced.
                    tokio::time::sleep(Duration::from_millis(12)).await;
                }
                _ => {
                    drop(store);
                    store = self.open(dir);
                }
            }
        }
        drop(store);
        let mut recording = lock(&self.recording);
        let k = recording.ops.len();
        recording.moments.resize_with(k + 1, Vec::new);
    }
}

/// The journal file as the disk holds it: what was synced, what was
/// written, and each block written since the last sync, with each of its
/// versions since (none the synced one).
#[derive(Default)]
struct Disk {
    synced: Vec<u8>,
    written: Vec<u8>,
    unsynced: BTreeMap<usize, Vec<Vec<u8>>>,
}

impl Disk {
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Write { at, bytes } => {
                let (at, end) = (*at as usize, *at as usize + bytes.len());
                if self.written.len() < end {
                    self.written.resize(end, 0);
                }
                self.written[at..end].copy_from_slice(bytes);
                for block in at / BLOCK..end.div_ceil(BLOCK) {
                    let version = self.block(&self.written, block);
                    let synced = self.block(&self.synced, block);
                    let versions = self.unsynced.entry(block).or_default();
                    if version != synced && !versions.contains(&version) {
                        versions.push(version);
                    }
                }
            }
            Op::Sync => {
                self.synced = self.written.clone();
                self.unsynced.clear();
            }
        }
    }

    /// Block `block` of `image`, zeros past its end.
    fn block(&self, image: &[u8], block: usize) -> Vec<u8> {
        let mut bytes = vec![0; BLOCK];
        let from = (block * BLOCK).min(image.len());
        let to = (from + BLOCK).min(image.len());
        bytes[..to - from].copy_from_slice(&image[from..to]);
        bytes
    }

    /// The states a power loss can leave now: which version of each block
    /// written since the last sync (0: the synced one).
    fn states(&self, rng: &mut fastrand::Rng) -> Vec<Vec<usize>> {
        let radix: Vec<usize> = self.unsynced.values().map(|v| v.len() + 1).collect();
        let count = radix
            .iter()
            .try_fold(1usize, |n, r| n.checked_mul(*r))
            .unwrap_or(usize::MAX);
        if count <= ENUMERATE_UP_TO {
            return (0..count)
                .map(|mut i| {
                    radix
                        .iter()
                        .map(|r| {
                            let digit = i % r;
                            i /= r;
                            digit
                        })
                        .collect()
                })
                .collect();
        }
        let mut states = vec![vec![0; radix.len()], radix.iter().map(|r| r - 1).collect()];
        for _ in 0..SAMPLE {
            states.push(radix.iter().map(|r| rng.usize(..*r)).collect());
        }
        states
    }

    /// The file in state `choice` (see [`Disk::states`]).
    fn image(&self, choice: &[usize]) -> Vec<u8> {
        let mut image = self.synced.clone();
        image.resize(self.written.len().max(image.len()), 0);
        for ((block, versions), which) in self.unsynced.iter().zip(choice) {
            let version = match which {
                0 => self.block(&self.synced, *block),
                n => versions[n - 1].clone(),
            };
            let from = block * BLOCK;
            let to = (from + BLOCK).min(image.len());
            image[from..to].copy_from_slice(&version[..to - from]);
        }
        image
    }

    /// Which blocks of state `choice` hold what was written since the
    /// last sync, for a failure's message.
    fn kept(&self, choice: &[usize]) -> String {
        let blocks: Vec<String> = self
            .unsynced
            .iter()
            .zip(choice)
            .map(|((block, versions), which)| match which {
                0 => format!("{block}: lost"),
                n if *n == versions.len() => format!("{block}: kept"),
                n => format!("{block}: write {n} of {}", versions.len()),
            })
            .collect();
        format!("blocks written since the last sync: {}", blocks.join(", "))
    }
}

/// What a state opened as: each message's row, by number, and the
/// versions pending that no message of the workload has.
#[derive(Clone)]
struct Seen {
    rows: Vec<Option<StoredMessage>>,
    strangers: Vec<String>,
}

/// Open the store on `journal` and `tables`, as after a power loss.
async fn open_state(
    journal: &[u8],
    tables: &Tables,
    sent: &[(Uuid, Notification)],
) -> Result<Seen, String> {
    let dir = scratch();
    tables.write_to(dir.path());
    std::fs::write(dir.path().join("direct.journal"), journal).unwrap();
    let store = EmbeddedStore::open(dir.path()).map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for (uaid, message) in sent {
        rows.push(store.read_message(uaid, &message.sort_key()).await.unwrap());
    }
    let mut strangers = Vec::new();
    for uaid in [1, 2].map(Uuid::from_u128) {
        for pending in store.fetch_messages(&uaid, 10_000).await.unwrap() {
            let known = pending
                .version
                .strip_prefix('v')
                .and_then(|n| n.parse().ok());
            let sent = known.and_then(|n: usize| sent.get(n));
            if sent.is_none_or(|(_, m)| m.data != pending.data) {
                strangers.push(pending.version);
            }
        }
    }
    Ok(Seen { rows, strangers })
}

/// What the model knows of each message: the instants (see
/// [`Recording`]) from which on each holds.
#[derive(Default, Clone, Copy)]
struct Facts {
    /// It was answered.
    answered: Option<usize>,
    /// Its settle had begun.
    settle_started: Option<usize>,
    /// A message staged after its settle returned was answered: with
    /// receipts on, its receipt is durable (in the file, synced, or in
    /// redb). (With receipts off, a tombstone still waiting when the file
    /// starts over is not written in the epoch that holds the message:
    /// until the new epoch is synced, a power loss brings the message
    /// back, as documented.)
    settle_durable: Option<usize>,
    /// Its receipt was sealed into its id: nothing of it is ever stored.
    sealed: bool,
}

fn facts(events: &[(usize, Event)], messages: usize) -> Vec<Facts> {
    let mut facts = vec![Facts::default(); messages];
    let mut staged_at = vec![usize::MAX; messages];
    let mut settled_at = vec![usize::MAX; messages];
    for (i, (k, event)) in events.iter().enumerate() {
        match *event {
            Event::Staged(n) => staged_at[n] = i,
            Event::Answered(n) => {
                facts[n].answered = Some(*k);
                for (m, settled) in settled_at.iter().enumerate() {
                    if *settled < staged_at[n] && facts[m].settle_durable.is_none() {
                        facts[m].settle_durable = Some(*k);
                    }
                }
            }
            Event::SettleStarted(n) => facts[n].settle_started = Some(*k),
            Event::Settled(n) => settled_at[n] = i,
            Event::Sealed(n) => facts[n].sealed = true,
        }
    }
    facts
}

/// What is wrong with `seen`, a state a power loss at instant `now` left.
fn check(now: usize, seen: &Seen, facts: &[Facts], receipts: bool) -> Option<String> {
    if let Some(stranger) = seen.strangers.first() {
        return Some(format!(
            "{stranger} is pending, and no message of the workload"
        ));
    }
    for (n, (fact, row)) in facts.iter().zip(&seen.rows).enumerate() {
        let pending = matches!(row, Some(StoredMessage::Pending(_)));
        let before = |at: Option<usize>| at.is_some_and(|at| at <= now);
        if before(fact.answered) && !before(fact.settle_started) && !pending {
            return Some(format!("v{n} was answered and is lost: {row:?}"));
        }
        if fact.sealed {
            if row.is_some() {
                return Some(format!("v{n} was sealed, yet stored: {row:?}"));
            }
            continue;
        }
        if receipts && before(fact.settle_durable) {
            if pending {
                return Some(format!("v{n} came back after its settle was durable"));
            }
            let receipt =
                matches!(row, Some(StoredMessage::Settled(r)) if r.is_for(&format!("v{n}")));
            if !receipt {
                return Some(format!("v{n}'s receipt is lost: {row:?}"));
            }
        }
    }
    None
}

/// A record that a batch written after a later sync follows, in the file
/// as written after `ops`: where it starts (a write of a batch starts
/// with a record), chosen at random.
fn synced_record(ops: &[Op], rng: &mut fastrand::Rng) -> Option<u64> {
    let mut candidates = Vec::new();
    let (mut epoch_writes, mut synced_writes) = (Vec::new(), 0);
    let mut proven = 0;
    for op in ops {
        match op {
            Op::Write { at: 0, .. } => {
                // A new epoch: what came before is not read again.
                (epoch_writes, synced_writes, proven) = (Vec::new(), 0, 0);
                candidates.clear();
            }
            Op::Write { at, bytes } if *at >= HEADER && bytes.iter().any(|b| *b != 0) => {
                // Written after a sync: every write before it is proven synced.
                proven = synced_writes;
                epoch_writes.push(*at);
            }
            Op::Write { .. } => {}
            Op::Sync => synced_writes = epoch_writes.len(),
        }
        candidates = epoch_writes[..proven].to_vec();
    }
    (!candidates.is_empty()).then(|| candidates[rng.usize(..candidates.len())])
}

/// Counts of one search, for its summary.
#[derive(Default)]
struct Explored {
    points: usize,
    states: usize,
    opened: usize,
    damaged: usize,
}

/// Build, open and check every state of one workload's recording.
async fn search(
    workload: &Workload,
    rng: &mut fastrand::Rng,
    explored: &mut Explored,
) -> Result<(), String> {
    // The workload is over: nothing records any more.
    let recording = std::mem::take(&mut *lock(&workload.recording));
    let facts = facts(&recording.events, workload.sent.len());
    let mut disk = Disk::default();
    let mut outcomes: HashMap<(u64, usize), Result<Seen, String>> = HashMap::new();
    for k in 0..=recording.ops.len() {
        if k > 0 {
            disk.apply(&recording.ops[k - 1]);
        }
        let after = match k {
            0 => "before the first write".to_owned(),
            k => match &recording.ops[k - 1] {
                Op::Write { at, bytes } => {
                    format!("after a write of {} bytes at {at}", bytes.len())
                }
                Op::Sync => "after a sync".to_owned(),
            },
        };
        explored.points += 1;
        for (now, tables) in &recording.moments[k] {
            for choice in disk.states(rng) {
                explored.states += 1;
                let image = disk.image(&choice);
                let mut hasher = DefaultHasher::new();
                image.hash(&mut hasher);
                let key = (hasher.finish(), Arc::as_ptr(tables) as usize);
                if let Entry::Vacant(slot) = outcomes.entry(key) {
                    explored.opened += 1;
                    slot.insert(open_state(&image, tables, &workload.sent).await);
                }
                let failed = match &outcomes[&key] {
                    Err(e) => Some(format!("the store did not open: {e}")),
                    Ok(seen) => check(*now, seen, &facts, workload.receipts),
                };
                if let Some(failed) = failed {
                    return Err(format!(
                        "power lost at op {k} of {} ({after}; {}): {failed}",
                        recording.ops.len(),
                        disk.kept(&choice)
                    ));
                }
            }
            if rng.u32(..DAMAGE_ONE_IN) == 0
                && let Some(at) = synced_record(&recording.ops[..k], rng)
            {
                explored.damaged += 1;
                let mut image = disk.written.clone();
                image[at as usize + rng.usize(..16)] ^= 1 << rng.u8(..8);
                let offset = format!("offset {at}");
                match open_state(&image, tables, &workload.sent).await {
                    Err(e) if e.contains("direct.journal") && e.contains(&offset) => {}
                    other => {
                        let got = other.map(|_| "it opened".to_owned()).unwrap_or_else(|e| e);
                        return Err(format!(
                            "power lost at op {k} ({after}), the synced record at {at} damaged: \
                             not refused naming the file and {offset}: {got}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// See the module's notes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_state_a_power_loss_leaves_opens_and_keeps_what_was_answered() {
    let rounds = env_or("JOURNAL_POWER_LOSS_ROUNDS", 1);
    let steps = env_or("JOURNAL_POWER_LOSS_STEPS", 40);
    let first_seed = env_or("JOURNAL_POWER_LOSS_SEED", fastrand::u64(..));
    let started = Instant::now();
    let mut explored = Explored::default();
    for round in 0..rounds {
        let seed = first_seed.wrapping_add(round);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut workload = Workload {
            recording: Default::default(),
            receipts: seed % 2 == 0,
            sent: Vec::new(),
        };
        let dir = scratch();
        workload.run(dir.path(), &mut rng, steps).await;
        if let Err(e) = search(&workload, &mut rng, &mut explored).await {
            panic!("seed {seed} (JOURNAL_POWER_LOSS_SEED={seed}): {e}");
        }
    }
    eprintln!(
        "power loss: {rounds} workload(s) of {steps} steps from seed {first_seed}: {} points, \
         {} states ({} distinct, opened), {} with a synced record damaged, in {:.1} s",
        explored.points,
        explored.states,
        explored.opened,
        explored.damaged,
        started.elapsed().as_secs_f64()
    );
}
