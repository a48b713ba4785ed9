//! Background housekeeping: expired messages and long-unseen users are
//! removed in small steps, so the store does not grow without bound and the
//! writer is never held for long (each step is one short write, and other
//! writes queue between steps).

use std::sync::Arc;
use std::time::Duration;

use autopush_common::time::now_millis;
use tracing::{info, warn};

use crate::{Storage, SweepStep};

/// Records looked at per step.
const STEP: usize = 500;
/// Pause between steps of one pass, so foreground writes go first.
const BETWEEN_STEPS: Duration = Duration::from_millis(20);

#[derive(Clone, Debug)]
pub struct SweepSettings {
    /// Time between the starts of two passes.
    pub interval: Duration,
    /// Remove webpush users not seen for this long; `None` keeps them.
    pub drop_idle_users_after: Option<Duration>,
}

/// Sweep every `settings.interval`, forever.
pub async fn run(storage: Arc<dyn Storage>, settings: SweepSettings) {
    let mut ticks = tokio::time::interval(settings.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await; // the first tick is now; the store was just opened
    loop {
        ticks.tick().await;
        let expired = pass(|| storage.sweep_expired_messages(STEP)).await;
        let idle = match settings.drop_idle_users_after {
            Some(after) => {
                let before = now_millis().saturating_sub(after.as_millis() as u64);
                pass(|| storage.drop_idle_users(before, STEP)).await
            }
            None => 0,
        };
        if expired + idle > 0 {
            info!(
                expired_messages = expired,
                idle_users = idle,
                "housekeeping removed records"
            );
        }
    }
}

/// Run steps until one finishes the pass; returns how many records went.
async fn pass<'a, F, Fut>(mut step: F) -> usize
where
    F: FnMut() -> Fut + 'a,
    Fut: std::future::Future<Output = crate::Result<SweepStep>> + 'a,
{
    let mut removed = 0;
    loop {
        match step().await {
            Ok(done) => {
                removed += done.removed;
                if done.finished_pass {
                    return removed;
                }
            }
            Err(e) => {
                warn!(error = %e, "housekeeping step failed; trying again next pass");
                return removed;
            }
        }
        tokio::time::sleep(BETWEEN_STEPS).await;
    }
}
