//! Health and version routes, served on every public HTTP port.

use std::sync::Arc;

use autopush_storage::Storage;
use serde_json::json;
use tracing::warn;
use warp::Filter;
use warp::filters::BoxedFilter;
use warp::http::StatusCode;
use warp::reply::{Reply, Response};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit built, stamped by `build.rs` ("unknown" without git).
pub const COMMIT: &str = env!("AUTOPUSH_GIT_COMMIT");

/// `/health` and `/__heartbeat__` (storage answers), `/__lbheartbeat__`
/// (the process answers), `/__version__` (version and commit; no `source`
/// field, as the project has no public repository address).
pub fn routes(storage: Arc<dyn Storage>) -> BoxedFilter<(Response,)> {
    let deep = warp::get()
        .and(warp::path("health").or(warp::path("__heartbeat__")).unify())
        .and(warp::path::end())
        .then(move || {
            let storage = storage.clone();
            async move {
                // The backend's detail is for the log: these routes are
                // public.
                let (status, database) = match storage.health_check().await {
                    Ok(()) => (StatusCode::OK, "OK"),
                    Err(e) => {
                        warn!(error = %e, "health check: storage failed");
                        (StatusCode::SERVICE_UNAVAILABLE, "ERROR")
                    }
                };
                let overall = if status == StatusCode::OK {
                    "OK"
                } else {
                    "ERROR"
                };
                let body = json!({"status": overall, "version": VERSION, "database": database});
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
