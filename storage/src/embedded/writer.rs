//! Group commit: one thread owns redb's write side and commits every write
//! that is waiting in one durable transaction.
//!
//! A durable commit costs an fsync, whatever it holds. Under load many pushes
//! and acks wait for a commit at the same moment; committing them together
//! turns N fsyncs into one, and each caller still hears back only after its
//! write is on disk. Writes apply in the order they arrive, so a write sees
//! every earlier one.

use std::sync::Arc;
use std::thread::JoinHandle;

use redb::{Database, WriteTransaction};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use super::backend;
use crate::{Result, StorageError};

/// Writes waiting for the writer thread; senders wait when it is full.
const QUEUE: usize = 4096;
/// Most writes in one transaction, so one commit's latency stays bounded.
const MAX_BATCH: usize = 512;

/// A write waiting to commit: applied inside a shared transaction, answered
/// once that transaction has committed (or failed).
trait PendingWrite: Send {
    fn apply(&mut self, txn: &WriteTransaction) -> Result<()>;
    fn answer(self: Box<Self>, committed: Result<()>);
}

/// `write`, and `then`, which hears its output once the transaction is
/// durable. Dropped unanswered (the writer thread stopped), it hears that.
struct Write<T, F, G: FnOnce(Result<T>)> {
    write: F,
    output: Option<T>,
    then: Option<G>,
}

impl<T, F, G: FnOnce(Result<T>)> Write<T, F, G> {
    fn pending(write: F, then: G) -> Box<Self> {
        Box::new(Write {
            write,
            output: None,
            then: Some(then),
        })
    }
}

/// `write` as a pending write, and where its answer will come.
fn pending<T, F>(write: F) -> (Box<dyn PendingWrite>, oneshot::Receiver<Result<T>>)
where
    T: Send + 'static,
    F: FnMut(&WriteTransaction) -> Result<T> + Send + 'static,
{
    let (reply, answer) = oneshot::channel();
    let pending = Write::pending(write, move |result| {
        let _ = reply.send(result);
    });
    (pending, answer)
}

fn stopped() -> StorageError {
    StorageError::Backend("the writer thread has stopped".into())
}

impl<T, F, G> PendingWrite for Write<T, F, G>
where
    T: Send,
    F: FnMut(&WriteTransaction) -> Result<T> + Send,
    G: FnOnce(Result<T>) + Send,
{
    fn apply(&mut self, txn: &WriteTransaction) -> Result<()> {
        self.output = Some((self.write)(txn)?);
        Ok(())
    }

    fn answer(mut self: Box<Self>, committed: Result<()>) {
        let output = self.output.take();
        let result = committed.and_then(|()| {
            output.ok_or_else(|| StorageError::Backend("write was not applied".into()))
        });
        if let Some(then) = self.then.take() {
            then(result);
        }
    }
}

impl<T, F, G: FnOnce(Result<T>)> Drop for Write<T, F, G> {
    fn drop(&mut self) {
        if let Some(then) = self.then.take() {
            then(Err(stopped()));
        }
    }
}

#[derive(Clone)]
pub(super) struct Writer {
    thread: Arc<WriterThread>,
}

/// The thread and its queue. Dropping the last handle closes the queue and
/// waits for the thread to commit what is left and release the database, so
/// the store can be reopened at once.
struct WriterThread {
    queue: Option<mpsc::Sender<Box<dyn PendingWrite>>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for WriterThread {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Writer {
    /// Start the writer thread for `db`.
    pub(super) fn start(db: Arc<Database>) -> Result<Writer> {
        let (queue, pending) = mpsc::channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("redb-writer".into())
            .spawn(move || commit_loop(&db, pending))
            .map_err(|e| StorageError::Backend(format!("cannot start the writer thread: {e}")))?;
        Ok(Writer {
            thread: Arc::new(WriterThread {
                queue: Some(queue),
                thread: Some(thread),
            }),
        })
    }

    /// Whether the writer thread still takes writes (it stops only if it
    /// panicked).
    pub(super) fn is_running(&self) -> bool {
        self.thread
            .thread
            .as_ref()
            .is_some_and(|thread| !thread.is_finished())
    }

    /// Apply `write` in the next transaction and return its output once that
    /// transaction is durable. `write` may run twice (see `commit_loop`), so
    /// it must not have effects outside the transaction.
    pub(super) async fn write<T, F>(&self, write: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let (pending, answer) = pending(write);
        self.queue()?.send(pending).await.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// [`Writer::write`] for a thread outside the runtime: blocks it until
    /// the transaction holding `write` is durable.
    pub(super) fn write_blocking<T, F>(&self, write: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let (pending, answer) = pending(write);
        self.queue()?
            .blocking_send(pending)
            .map_err(|_| stopped())?;
        answer.blocking_recv().map_err(|_| stopped())?
    }

    /// [`Writer::write`] without waiting for it: `then` hears its output,
    /// on the writer's thread, once the transaction holding `write` is
    /// durable (or failed, or the writer stopped). Blocks only while the
    /// queue is full.
    pub(super) fn write_then<T, F, G>(&self, write: F, then: G)
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T> + Send + 'static,
        G: FnOnce(Result<T>) + Send + 'static,
    {
        let pending = Write::pending(write, then);
        // Refused, the write is dropped, and `then` hears that.
        if let Ok(queue) = self.queue() {
            let _ = queue.blocking_send(pending);
        }
    }

    fn queue(&self) -> Result<&mpsc::Sender<Box<dyn PendingWrite>>> {
        self.thread.queue.as_ref().ok_or_else(stopped)
    }
}

fn commit_loop(db: &Database, mut pending: mpsc::Receiver<Box<dyn PendingWrite>>) {
    while let Some(first) = pending.blocking_recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match pending.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        match commit(db, &mut batch) {
            Ok(()) => batch.into_iter().for_each(|write| write.answer(Ok(()))),
            Err(e) if batch.len() == 1 => {
                if let Some(write) = batch.pop() {
                    write.answer(Err(e));
                }
            }
            Err(e) => {
                // One failing write must not take the others down with it:
                // nothing was committed, so give each its own transaction.
                warn!(writes = batch.len(), error = %e, "a grouped commit failed; retrying its writes one by one");
                for mut write in batch {
                    let committed = commit(db, std::slice::from_mut(&mut write));
                    write.answer(committed);
                }
            }
        }
    }
}

/// Apply every write in one transaction and commit it durably.
fn commit(db: &Database, batch: &mut [Box<dyn PendingWrite>]) -> Result<()> {
    let txn = db.begin_write().map_err(backend)?;
    for write in batch.iter_mut() {
        write.apply(&txn)?;
    }
    txn.commit().map_err(backend)
}
