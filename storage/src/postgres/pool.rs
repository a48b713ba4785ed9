//! The pool of connections a node keeps: TLS as the DSN asks, and no
//! connection to a server that stopped taking writes handed out again.
//!
//! With several hosts and `target_session_attrs=read-write`, a new
//! connection goes to whichever host takes writes. One already open stays
//! where it is: if its server dies it is closed, and the pool drops it; if
//! its server stays up but turns read-only (demoted, or
//! `default_transaction_read_only` set), its next write fails with SQLSTATE
//! 25006. That failure is [`Demotion::note`]d, and every connection opened
//! before it is dropped when next taken from the pool, so the calls after it
//! connect anew and find the host that takes writes now.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_postgres::{
    HookError, Manager, ManagerConfig, Metrics, Pool, RecyclingMethod, Runtime,
};
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use super::PostgresSettings;

/// When a statement last failed because its server refused writes.
#[derive(Debug, Default)]
pub struct Demotion {
    seen: Mutex<Option<Instant>>,
}

impl Demotion {
    /// Note `e` if it says the server no longer takes writes.
    pub fn note(&self, e: &tokio_postgres::Error) {
        if e.code() != Some(&SqlState::READ_ONLY_SQL_TRANSACTION) {
            return;
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.is_none_or(|at| at.elapsed() > Duration::from_secs(1)) {
            tracing::warn!(
                "PostgreSQL refused a write (read-only): connecting again to find the host \
                 that takes writes"
            );
        }
        *seen = Some(Instant::now());
    }

    /// Whether a connection opened at `created` may have been to the
    /// server that refused a write since.
    fn outdates(&self, created: Instant) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.is_some_and(|at| created <= at)
    }
}

/// The pool for `settings`, and the [`Demotion`] its users note failures
/// in. An unreadable `sslrootcert` is an error naming it.
pub fn build(settings: &PostgresSettings, wait: Duration) -> Result<(Pool, Arc<Demotion>), String> {
    let manager_config = ManagerConfig {
        // A connection the server closed (a restart, a failover) is
        // dropped, not handed out.
        recycling_method: RecyclingMethod::Fast,
    };
    let config = settings.config.clone();
    let manager = match settings.tls.connector()? {
        Some(tls) => Manager::from_config(config, tls, manager_config),
        None => Manager::from_config(config, NoTls, manager_config),
    };
    let demotion = Arc::new(Demotion::default());
    let watch = demotion.clone();
    let pool = Pool::builder(manager)
        .max_size(settings.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(wait))
        .create_timeout(Some(wait))
        .pre_recycle(deadpool_postgres::Hook::sync_fn(
            move |_, metrics: &Metrics| match watch.outdates(metrics.created) {
                true => Err(HookError::message("opened before a read-only refusal")),
                false => Ok(()),
            },
        ))
        .build()
        .map_err(|e| format!("PostgreSQL pool: {e}"))?;
    Ok((pool, demotion))
}
