//! The internal router API, called by endpoint nodes (never public):
//!
//! * `PUT /push/{uaid}` with a notification: 200 queued for the connected
//!   client, 404 not connected here, 503 connected but busy. With
//!   `x-autopush-durable-copy: hold`, the 200 waits until the client acked
//!   or the durable copy is written, and says which in the same header
//!   ([`autopush_webpush::held`]).
//! * `PUT /notif/{uaid}`: 200 the client will check storage, 404 not here.
//! * `DELETE /notif/{uaid}/{connected_at}`: 200 that connection is dropped,
//!   404 no such connection.
//! * `GET /user/{uaid}`: the user record, channels and stored-message count,
//!   for `autopush diagnose` while the embedded store is held by this process.
//! * `GET /receipt/{uaid}/{sort_key}/{tag}`: the receipt of a message whose
//!   copy this node keeps in its own journal (`{"state", "updated"}`), 404
//!   when it does not know it (see [`autopush_webpush::node_journal`]).
//!
//! Every call must be signed with the shared router key
//! ([`autopush_common::node_auth`]); anything else gets 401 (errno 109).
//! The exceptions: `GET /metrics` (served ahead of these routes, see
//! [`crate::server::serve_router_api`]) is read-only and carries no user
//! data: Prometheus scrapers cannot sign. And while autopush-rs's endpoints
//! share the table (a migration), its unsigned `PUT /push` and `PUT /notif`
//! from the peers `--unsigned-node-calls-from` names, each counted.
//!
//! Every answer names the router API version this node speaks
//! ([`ROUTER_API`], see docs/internals.md), and carries
//! [`SETTLES_DURABLE_COPY`] for the endpoints of protocol 2, which know a
//! node of ours by it. A request of any version is answered the same way:
//! each version only added what an older endpoint ignores, and a request
//! without a version (protocols 1 and 2, or autopush-rs's endpoint) or of a
//! later one asks nothing this node does not know (an unknown
//! `x-autopush-durable-copy` value is a plain push, so its endpoint writes
//! the copy).

use std::sync::Arc;

use autopush_common::metrics;
use autopush_common::node::{LocalNode, PushOutcome};
use autopush_common::node_auth::NodeAuthError;
use autopush_common::time::now_secs;
use autopush_common::{ApiError, Notification};
use autopush_serving::http::Peer;
pub use autopush_webpush::SETTLES_DURABLE_COPY;
use autopush_webpush::protocol::{SEALS_ACKS, TAKES_KEPT, VERSION, version_of};
use autopush_webpush::{DURABLE_COPY, HOLD, ROUTER_API};
use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use serde_json::json;
use tracing::debug;
use uuid::Uuid;
use warp::filters::BoxedFilter;
use warp::filters::path::FullPath;
use warp::http::{Method, StatusCode};
use warp::reply::{Reply, Response};
use warp::{Filter, Rejection};

use crate::NodeContext;

/// Largest request body read: a notification with the largest payload
/// fits many times over.
const MAX_BODY: usize = 64 * 1024;

#[derive(Debug)]
struct Refused(NodeAuthError);
impl warp::reject::Reject for Refused {}

#[derive(Debug)]
struct TooLarge;
impl warp::reject::Reject for TooLarge {}

fn error(error: &ApiError) -> Response {
    warp::reply::with_status(warp::reply::json(&error.body()), error.status()).into_response()
}

/// The body of a call whose signature (over method, path, time and body)
/// verifies, or, for `route` (`Some`: one autopush-rs calls), an unsigned
/// call from a peer `--unsigned-node-calls-from` names; any other call is
/// rejected with [`Refused`].
fn signed(
    ctx: Arc<NodeContext>,
    route: Option<&'static str>,
) -> impl Filter<Extract = (Bytes,), Error = Rejection> + Clone {
    warp::method()
        .and(warp::path::full())
        .and(warp::header::optional::<String>("authorization"))
        .and(warp::ext::optional::<Peer>())
        .and(warp::body::stream())
        .and_then(
            move |method: Method,
                  path: FullPath,
                  authorization: Option<String>,
                  peer: Option<Peer>,
                  body| {
                let ctx = ctx.clone();
                async move {
                    let body = read_bounded(body).await?;
                    if let (None, Some(route), Some(Peer(peer))) = (&authorization, route, peer)
                        && unsigned_allowed(&ctx, peer)
                    {
                        metrics::unsigned_node_call(route);
                        return Ok(body);
                    }
                    ctx.nodes
                        .keys()
                        .verify(
                            method.as_str(),
                            path.as_str(),
                            authorization.as_deref(),
                            &body,
                            now_secs(),
                        )
                        .map(|()| body)
                        .map_err(|e| warp::reject::custom(Refused(e)))
                }
            },
        )
}

/// Whether `peer` is one whose unsigned calls are taken.
fn unsigned_allowed(ctx: &NodeContext, peer: std::net::IpAddr) -> bool {
    autopush_serving::http::in_networks(peer, &ctx.settings.unsigned_node_calls_from)
}

/// The whole body, refused once it grows past [`MAX_BODY`] (chunked bodies
/// carry no length to check up front).
async fn read_bounded(
    body: impl Stream<Item = Result<impl Buf, warp::Error>>,
) -> Result<Bytes, Rejection> {
    let mut body = std::pin::pin!(body);
    let mut out = BytesMut::new();
    while let Some(chunk) = body.next().await {
        let mut chunk = chunk.map_err(|_| warp::reject::custom(TooLarge))?;
        if out.len() + chunk.remaining() > MAX_BODY {
            return Err(warp::reject::custom(TooLarge));
        }
        while chunk.has_remaining() {
            let part = chunk.chunk();
            out.extend_from_slice(part);
            let n = part.len();
            chunk.advance(n);
        }
    }
    Ok(out.freeze())
}

/// Unsigned calls get 401, oversized ones 413; other rejections stay as warp
/// renders them (404, 405).
async fn refusal(rejection: Rejection) -> Result<Response, Rejection> {
    if let Some(Refused(reason)) = rejection.find() {
        debug!(%reason, "refused an internal router API call");
        return Ok(error(&ApiError::InvalidAuthentication(reason.to_string())));
    }
    if rejection.find::<TooLarge>().is_some() {
        return Ok(error(&ApiError::PayloadTooLarge(MAX_BODY)));
    }
    Err(rejection)
}

fn status(code: StatusCode) -> Response {
    warp::reply::with_status(warp::reply::json(&json!({"status": code.as_u16()})), code)
        .into_response()
}

fn push_answer(outcome: PushOutcome) -> Response {
    match outcome {
        PushOutcome::Delivered => status(StatusCode::OK),
        PushOutcome::NotConnected => status(StatusCode::NOT_FOUND),
        PushOutcome::Busy => status(StatusCode::SERVICE_UNAVAILABLE),
    }
}

/// A push whose durable copy the endpoint asks this node to hold: answered
/// once the client acked it or the copy is written (see
/// [`autopush_webpush::held`]), saying which in [`DURABLE_COPY`]. Without
/// that header on a 200, the endpoint writes the copy itself. An endpoint
/// of router API 4 or later (`caller`) seals an ack within the grace into
/// the message's id: its receipt is not written here. With a journal of
/// its own, this node keeps the copy there for an endpoint of router API 5
/// or later, and answers `kept` once it is synced.
async fn push_holding_copy(
    ctx: &NodeContext,
    uaid: &Uuid,
    notification: Notification,
    caller: Option<u32>,
) -> Response {
    let node = ctx.registry.clone();
    let seals = caller.is_some_and(|version| version >= SEALS_ACKS);
    // An older endpoint would write a kept copy again.
    let journal = ctx
        .journal
        .clone()
        .filter(|_| caller.is_some_and(|version| version >= TAKES_KEPT));
    let (outcome, fate) = autopush_webpush::push_holding_copy(
        node,
        ctx.storage.clone(),
        journal,
        *uaid,
        notification,
        seals,
    )
    .await;
    let mut answer = push_answer(outcome);
    if let Some(fate) = fate {
        answer.headers_mut().insert(
            DURABLE_COPY,
            warp::http::HeaderValue::from_static(fate.as_str()),
        );
    }
    answer
}

fn parse_uaid(uaid: &str) -> Option<Uuid> {
    Uuid::parse_str(uaid).ok()
}

/// A message id's tag, in the 16 hex digits `GET /receipt` carries.
fn parse_tag(hex: &str) -> Option<[u8; 8]> {
    <[u8; 8]>::try_from(autopush_common::ids::unhex(hex)?).ok()
}

pub fn routes(ctx: Arc<NodeContext>) -> BoxedFilter<(Response,)> {
    let push_ctx = ctx.clone();
    let push = warp::put()
        .and(warp::path!("push" / String))
        .and(warp::header::optional::<String>(DURABLE_COPY))
        .and(warp::header::optional::<String>(ROUTER_API))
        .and(signed(ctx.clone(), Some("push")))
        .then(
            move |uaid: String, copy: Option<String>, caller: Option<String>, body: Bytes| {
                let ctx = push_ctx.clone();
                async move {
                    let Ok(notification) = serde_json::from_slice::<Notification>(&body) else {
                        return error(&ApiError::BadRequest(
                            "the body is not a notification".into(),
                        ));
                    };
                    let Some(uaid) = parse_uaid(&uaid) else {
                        return status(StatusCode::NOT_FOUND);
                    };
                    if copy.as_deref() == Some(HOLD) {
                        let caller = caller.and_then(|v| version_of(v.as_bytes()));
                        return push_holding_copy(&ctx, &uaid, notification, caller).await;
                    }
                    push_answer(ctx.registry.push(&uaid, notification))
                }
            },
        );

    let registry = ctx.registry.clone();
    let notify = warp::put()
        .and(warp::path!("notif" / String))
        .and(signed(ctx.clone(), Some("notif")))
        .map(move |uaid: String, _: Bytes| {
            match parse_uaid(&uaid).filter(|u| registry.notify(u)) {
                Some(_) => status(StatusCode::OK),
                None => status(StatusCode::NOT_FOUND),
            }
        });

    let registry = ctx.registry.clone();
    let drop_client = warp::delete()
        .and(warp::path!("notif" / String / u64))
        .and(signed(ctx.clone(), None))
        .map(move |uaid: String, connected_at: u64, _: Bytes| {
            match parse_uaid(&uaid).filter(|u| registry.kick(u, connected_at)) {
                Some(_) => status(StatusCode::OK),
                None => status(StatusCode::NOT_FOUND),
            }
        });

    let journal = ctx.journal.clone();
    let receipt = warp::get()
        .and(warp::path!("receipt" / String / String / String))
        .and(signed(ctx.clone(), None))
        .then(
            move |uaid: String, sort_key: String, tag: String, _: Bytes| {
                let journal = journal.clone();
                async move {
                    let (Some(uaid), Some(tag)) = (parse_uaid(&uaid), parse_tag(&tag)) else {
                        return status(StatusCode::NOT_FOUND);
                    };
                    // A node without its journal cannot tell a receipt
                    // it forgot from one it never had.
                    let Some(journal) = journal else {
                        return status(StatusCode::SERVICE_UNAVAILABLE);
                    };
                    match journal.receipt(&uaid, &sort_key, tag).await {
                        Ok(Some((state, updated))) => {
                            warp::reply::json(&json!({"state": state, "updated": updated}))
                                .into_response()
                        }
                        Ok(None) => status(StatusCode::NOT_FOUND),
                        Err(e) => {
                            debug!(error = %e, "could not read a receipt in the node's journal");
                            status(StatusCode::SERVICE_UNAVAILABLE)
                        }
                    }
                }
            },
        );

    let user = warp::get()
        .and(warp::path!("user" / String))
        .and(signed(ctx.clone(), None))
        .then(move |uaid: String, _: Bytes| {
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
        .or(receipt)
        .unify()
        .or(user)
        .unify()
        .recover(refusal)
        .unify()
        .map(|mut reply: Response| {
            let headers = reply.headers_mut();
            headers.insert(ROUTER_API, warp::http::HeaderValue::from(VERSION));
            headers.insert(
                SETTLES_DURABLE_COPY,
                warp::http::HeaderValue::from_static("1"),
            );
            reply
        })
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
        body["router_data"] = autopush_common::router::mask_tokens(data);
    }
    body["channels"] = json!(channels);
    body["stored_messages"] = json!(storage.count_messages(uaid, usize::MAX).await?);
    Ok(Some(body))
}
