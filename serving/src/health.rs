//! Health and version routes, served on every public HTTP port.

use std::sync::Arc;
use std::time::Duration;

use autopush_storage::Storage;
use serde_json::json;
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::warn;
use warp::Filter;
use warp::filters::BoxedFilter;
use warp::http::StatusCode;
use warp::reply::{Reply, Response};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit built, stamped by `build.rs` ("unknown" without git).
pub const COMMIT: &str = env!("AUTOPUSH_GIT_COMMIT");

/// How long the answer of one storage check is reused.
const REUSE_FOR: Duration = Duration::from_secs(1);

/// The storage check behind `/health` and `/__heartbeat__`. These routes
/// are public and unauthenticated, and a check costs storage reads (two
/// on DynamoDB), so one check runs at a time and its answer is reused
/// for [`REUSE_FOR`]: callers arriving meanwhile wait for the check in
/// flight and share its answer. One per process, shared by every port.
pub struct HealthCheck {
    storage: Arc<dyn Storage>,
    /// When the last check finished, and whether storage answered.
    last: Mutex<Option<(Instant, bool)>>,
}

impl HealthCheck {
    pub fn new(storage: Arc<dyn Storage>) -> Arc<HealthCheck> {
        Arc::new(HealthCheck {
            storage,
            last: Mutex::new(None),
        })
    }

    /// Whether storage answers, checked at most once per [`REUSE_FOR`].
    /// The backend's error is logged, never returned: it is for operators.
    pub async fn storage_ok(&self) -> bool {
        let mut last = self.last.lock().await;
        if let Some((at, ok)) = *last
            && at.elapsed() < REUSE_FOR
        {
            return ok;
        }
        let ok = match self.storage.health_check().await {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "health check: storage failed");
                false
            }
        };
        *last = Some((Instant::now(), ok));
        ok
    }
}

/// `/health` and `/__heartbeat__` (storage answers, through `check`),
/// `/__lbheartbeat__` (the process answers), `/__version__` (version and
/// commit; no `source` field, as the project has no public repository
/// address).
pub fn routes(check: Arc<HealthCheck>) -> BoxedFilter<(Response,)> {
    let deep = warp::get()
        .and(warp::path("health").or(warp::path("__heartbeat__")).unify())
        .and(warp::path::end())
        .then(move || {
            let check = check.clone();
            async move {
                let (status, overall) = if check.storage_ok().await {
                    (StatusCode::OK, "OK")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "ERROR")
                };
                let body = json!({"status": overall, "version": VERSION, "database": overall});
                warp::reply::with_status(warp::reply::json(&body), status).into_response()
            }
        });
    let lb = warp::get()
        .and(warp::path("__lbheartbeat__"))
        .and(warp::path::end())
        .map(|| warp::reply::json(&json!({})).into_response());
    let version = warp::get()
        .and(warp::path("__version__"))
        .and(warp::path::end())
        .map(|| {
            let body = json!({
                "name": "autopush",
                "version": VERSION,
                "commit": COMMIT,
            });
            warp::reply::json(&body).into_response()
        });
    deep.or(lb).unify().or(version).unify().boxed()
}
