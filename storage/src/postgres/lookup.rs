//! A push's read of its user and channel, coalesced: the lookups that
//! arrive while a batch is in flight, or while the next one gathers, go
//! to PostgreSQL together as one statement, and each caller gets its own
//! answer from its rows.
//!
//! No caller waits for a timer. A batch gathers for a few turns of the
//! node's scheduler ([`GATHER_TURNS`]): each turn runs every task that is
//! ready, so the requests the node is already parsing add their lookups to
//! it. On an idle node a turn takes microseconds and a lookup alone is one
//! statement at once; on a busy one the turns are longer and the batch
//! larger. A statement costs the server, and the node, far more than a row
//! does (BENCHMARKS.md, PostgreSQL).
//!
//! Reads only: every write stays one statement of its caller's.

use std::sync::{Arc, Mutex};

use autopush_common::User;
use deadpool_postgres::Pool;
use tokio::sync::oneshot;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::{backend, hex, pool::Demotion, query_on, user_from_row};
use crate::{Result, StorageError};

/// Lookups in one statement at most: a bound on its size and on how long
/// its first caller waits for the last row.
const MAX_BATCH: usize = 256;

/// Turns of the scheduler a batch gathers before it goes (see the module's
/// doc). With PostgreSQL on the node's core, eight took the statements per
/// push at the ceiling from 0.22 to 0.06; sixteen made no fewer.
const GATHER_TURNS: usize = 8;

/// A user, and whether it has the channel asked about (false when none
/// was); `None`: no such user.
pub type Answer = Option<(User, bool)>;

/// One caller's lookup, waiting in the queue.
struct Lookup {
    uaid: Uuid,
    channel_id: Option<Uuid>,
    reply: oneshot::Sender<Result<Answer>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Lookup>,
    /// Batches in flight, each a task draining the queue.
    running: usize,
}

pub struct Lookups {
    pool: Pool,
    demotion: Arc<Demotion>,
    /// The batch statement: `$1` the users, `$2` the channels (NULL: none
    /// asked); a row per user found, with its lookup's place.
    sql: String,
    /// Batches in flight at most.
    slots: usize,
    queue: Mutex<Queue>,
}

/// A batch slot, held by the task draining the queue; given back when the
/// queue is empty (under the queue's lock, so no lookup queued meanwhile is
/// left without a task), or when the task ends otherwise.
struct Slot {
    lookups: Arc<Lookups>,
    given_back: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.given_back {
            self.lookups.lock().running -= 1;
        }
    }
}

impl Lookups {
    pub fn new(pool: Pool, demotion: Arc<Demotion>, sql: String, slots: usize) -> Arc<Lookups> {
        Arc::new(Lookups {
            pool,
            demotion,
            sql,
            slots: slots.max(1),
            queue: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `uaid`'s user and whether it has `channel_id`, as one statement
    /// reading them alone would answer.
    pub async fn get(self: &Arc<Self>, uaid: &Uuid, channel_id: Option<&Uuid>) -> Result<Answer> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut queue = self.lock();
            queue.waiting.push(Lookup {
                uaid: *uaid,
                channel_id: channel_id.copied(),
                reply,
            });
            let free = queue.running < self.slots;
            queue.running += usize::from(free);
            free
        };
        // In a task of its own: a caller that gives up does not take the
        // others' batch with it.
        if start {
            let slot = Slot {
                lookups: self.clone(),
                given_back: false,
            };
            tokio::spawn(slot.drain());
        }
        answer
            .await
            .map_err(|_| StorageError::Backend("PostgreSQL: a lookup's batch ended".into()))?
    }

    /// The next batch: up to [`MAX_BATCH`] of the oldest waiting; none
    /// when none waits, the caller's slot then given back.
    fn next_batch(&self) -> Option<Vec<Lookup>> {
        let mut queue = self.lock();
        if queue.waiting.is_empty() {
            queue.running -= 1;
            return None;
        }
        let n = queue.waiting.len().min(MAX_BATCH);
        Some(queue.waiting.drain(..n).collect())
    }

    /// One statement for `batch`, and each caller's answer.
    async fn run(&self, batch: Vec<Lookup>) {
        match self.query(&batch).await {
            Ok(answers) => {
                for (lookup, answer) in batch.into_iter().zip(answers) {
                    let _ = lookup.reply.send(answer);
                }
            }
            Err(e) => {
                for lookup in batch {
                    let _ = lookup.reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// The answers to `batch`, in its order.
    async fn query(&self, batch: &[Lookup]) -> Result<Vec<Result<Answer>>> {
        let uaids: Vec<String> = batch.iter().map(|l| hex(&l.uaid)).collect();
        let channels: Vec<Option<String>> = batch
            .iter()
            .map(|l| l.channel_id.as_ref().map(hex))
            .collect();
        let params: [&(dyn ToSql + Sync); 2] = [&uaids, &channels];
        let rows = query_on(&self.pool, &self.demotion, &self.sql, &params).await?;
        let mut answers: Vec<Result<Answer>> = batch.iter().map(|_| Ok(None)).collect();
        for row in &rows {
            let place: i32 = row.try_get(10).map_err(|e| backend("read", e))?;
            let Some((lookup, answer)) = usize::try_from(place)
                .ok()
                .and_then(|n| Some((batch.get(n)?, answers.get_mut(n)?)))
            else {
                continue;
            };
            *answer = row
                .try_get::<_, bool>(9)
                .map_err(|e| backend("read", e))
                .and_then(|subscribed| Ok(Some((user_from_row(&lookup.uaid, row)?, subscribed))));
        }
        Ok(answers)
    }
}

impl Slot {
    /// Batch after batch while lookups wait, each gathered first.
    async fn drain(mut self) {
        loop {
            for _ in 0..GATHER_TURNS {
                tokio::task::yield_now().await;
            }
            let Some(batch) = self.lookups.next_batch() else {
                break;
            };
            self.lookups.run(batch).await;
        }
        self.given_back = true;
    }
}
