//! The internal router API, called by endpoint nodes (never public):
//!
//! * `PUT /push/{uaid}` with a notification: 200 queued for the connected
//!   client, 404 not connected here, 503 connected but busy.
//! * `PUT /notif/{uaid}`: 200 the client will check storage, 404 not here.
//! * `DELETE /notif/{uaid}/{connected_at}`: 200 that connection is dropped,
//!   404 no such connection.
//! * `GET /user/{uaid}`: the user record, channels and stored-message count,
//!   for `autopush diagnose` while the embedded store is held by this process.

use std::sync::Arc;

use autopush_common::Notification;
use autopush_common::node::{LocalNode, PushOutcome};
use serde_json::json;
use uuid::Uuid;
use warp::Filter;
use warp::filters::BoxedFilter;
use warp::http::StatusCode;
use warp::reply::{Reply, Response};

use crate::NodeContext;

fn status(code: StatusCode) -> Response {
    warp::reply::with_status(warp::reply::json(&json!({"status": code.as_u16()})), code)
        .into_response()
}

fn parse_uaid(uaid: &str) -> Option<Uuid> {
    Uuid::parse_str(uaid).ok()
}

pub fn routes(ctx: Arc<NodeContext>) -> BoxedFilter<(Response,)> {
    let registry = ctx.registry.clone();
    let push = warp::put()
        .and(warp::path!("push" / String))
        .and(warp::body::content_length_limit(64 * 1024))
        .and(warp::body::json::<Notification>())
        .map(move |uaid: String, notification: Notification| {
            let Some(uaid) = parse_uaid(&uaid) else {
                return status(StatusCode::NOT_FOUND);
            };
            match registry.push(&uaid, notification) {
                PushOutcome::Delivered => status(StatusCode::OK),
                PushOutcome::NotConnected => status(StatusCode::NOT_FOUND),
                PushOutcome::Busy => status(StatusCode::SERVICE_UNAVAILABLE),
            }
        });

    let registry = ctx.registry.clone();
    let notify = warp::put()
        .and(warp::path!("notif" / String))
        .map(
            move |uaid: String| match parse_uaid(&uaid).filter(|u| registry.notify(u)) {
                Some(_) => status(StatusCode::OK),
                None => status(StatusCode::NOT_FOUND),
            },
        );

    let registry = ctx.registry.clone();
    let drop_client = warp::delete().and(warp::path!("notif" / String / u64)).map(
        move |uaid: String, connected_at: u64| match parse_uaid(&uaid)
            .filter(|u| registry.kick(u, connected_at))
        {
            Some(_) => status(StatusCode::OK),
            None => status(StatusCode::NOT_FOUND),
        },
    );

    let user = warp::get()
        .and(warp::path!("user" / String))
        .then(move |uaid: String| {
            let ctx = ctx.clone();
            async move {
                let Some(uaid) = parse_uaid(&uaid) else {
                    return status(StatusCode::NOT_FOUND);
                };
                match describe_user(ctx.storage.as_ref(), &uaid).await {
                    Ok(Some(body)) => warp::reply::json(&body).into_response(),
                    Ok(None) => status(StatusCode::NOT_FOUND),
                    Err(e) => warp::reply::with_status(
                        warp::reply::json(&json!({"status": 503, "error": e.to_string()})),
                        StatusCode::SERVICE_UNAVAILABLE,
                    )
                    .into_response(),
                }
            }
        });

    push.or(notify)
        .unify()
        .or(drop_client)
        .unify()
        .or(user)
        .unify()
        .boxed()
}

/// The user record with its channels and stored-message count (also used
/// by `autopush diagnose`).
pub async fn describe_user(
    storage: &dyn autopush_storage::Storage,
    uaid: &Uuid,
) -> Result<Option<serde_json::Value>, autopush_storage::StorageError> {
    let Some(user) = storage.get_user(uaid).await? else {
        return Ok(None);
    };
    let mut channels: Vec<String> = storage
        .get_channels(uaid)
        .await?
        .iter()
        .map(Uuid::to_string)
        .collect();
    channels.sort();
    let mut body = serde_json::to_value(&user).unwrap_or_default();
    body["uaid"] = json!(uaid.simple().to_string());
    if let Some(data) = &user.router_data {
        body["router_data"] = autopush_common::bridge::masked_router_data(data);
    }
    body["channels"] = json!(channels);
    body["stored_messages"] = json!(storage.count_messages(uaid).await?);
    Ok(Some(body))
}
