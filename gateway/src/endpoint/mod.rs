//! The public HTTP API application servers use:
//!
//! * `POST /wpush/{v1|v2}/{token}`: send a push ([`webpush`]).
//! * `DELETE /m/{message_id}`: cancel an undelivered push ([`message`]).
//! * `GET /m/{message_id}`: what became of a push, its receipt ([`receipt`]).
//! * `/_matrix/push/v1/notify`: a Matrix push gateway ([`matrix`]).
//! * health routes.
//!
//! Every failure is a JSON `{code, errno, error, message, more_info}`.

pub mod fair_use;
pub mod headers;
pub mod mailbox;
pub mod matrix;
pub mod message;
pub mod receipt;
pub mod webpush;

use std::convert::Infallible;
use std::sync::Arc;

use autopush_common::endpoint::EndpointCrypto;
use autopush_common::{ApiError, metrics};
use autopush_serving::health::HealthCheck;
use autopush_serving::http::{Peer, client_ip};
use autopush_storage::Storage;
use std::net::{IpAddr, Ipv4Addr};
use warp::Filter;
use warp::http::HeaderMap;
use warp::http::StatusCode;
use warp::reply::{Reply, Response};

use crate::vapid::VapidVerifier;
use autopush_common::router::RouterRegistry;
use autopush_registration::RegistrationState;
use autopush_webpush::{Waker, WebPushRouter};
use fair_use::FairUse;

/// What the endpoint handlers share.
pub struct EndpointState {
    pub crypto: Arc<EndpointCrypto>,
    pub storage: Arc<dyn Storage>,
    pub routers: RouterRegistry,
    pub registration: Arc<RegistrationState>,
    pub vapid: VapidVerifier,
    pub max_data_bytes: usize,
    /// `--durable-direct`: which direct messages have a stored copy.
    pub durable_direct: bool,
    /// Seconds a receipt answers after its message's final state; 0: off.
    pub receipt_retention: u64,
    /// The storage check of the health routes, shared with the websocket
    /// port in all-in-one mode.
    pub health: Arc<HealthCheck>,
    /// Rate limits per sender, subscription and source address.
    pub fair_use: FairUse,
    /// Wakes the devices of wake-only bridge registrations (and, through
    /// the webpush router, absent websocket clients).
    pub waker: Arc<Waker>,
    /// The webpush router, which also asks a connection node for the
    /// receipt of a message whose copy it keeps.
    pub webpush: Arc<WebPushRouter>,
}

impl EndpointState {
    /// The client a request speaks for (see [`client_ip`]).
    fn client(&self, peer: Option<Peer>, headers: &HeaderMap) -> IpAddr {
        let peer = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.0);
        client_ip(peer, headers, &self.fair_use.trusted_proxies)
    }
}

/// Render an API error for the sender.
pub fn error_response(error: &ApiError) -> Response {
    let status = error.status();
    let mut response =
        warp::reply::with_status(warp::reply::json(&error.body()), status).into_response();
    if status == StatusCode::GONE {
        // Gone for good: let CDNs and senders remember it instead of retrying.
        response.headers_mut().insert(
            "cache-control",
            warp::http::HeaderValue::from_static("max-age=86400"),
        );
    }
    if let ApiError::MethodNotAllowed { allowed } = error {
        response
            .headers_mut()
            .insert("allow", warp::http::HeaderValue::from_static(allowed));
    }
    if let Some(seconds) = error.retry_after() {
        response
            .headers_mut()
            .insert("retry-after", warp::http::HeaderValue::from(seconds));
    }
    if let Some(limit) = error.rate_limit() {
        limit.add_headers(response.headers_mut());
    }
    response
}

fn render(result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        if e.status().is_server_error() {
            tracing::error!(error = %e, "request failed");
        }
        error_response(&e)
    })
}

pub fn routes(
    state: Arc<EndpointState>,
) -> impl Filter<Extract = (Response,), Error = Infallible> + Clone {
    let with_state = {
        let state = state.clone();
        warp::any().map(move || state.clone())
    };
    let push = warp::post()
        .and(warp::path!("wpush" / String / String))
        .and(warp::header::headers_cloned())
        .and(warp::ext::optional::<Peer>())
        .and(warp::body::stream())
        .and(with_state.clone())
        .then(
            |version, token, headers: HeaderMap, peer, body, state: Arc<EndpointState>| async move {
                let (mut router_type, mut binding) = (None, None);
                let client = state.client(peer, &headers);
                let result = match read_body(body, state.max_data_bytes).await {
                    Ok(body) => {
                        let push = webpush::Push {
                            version,
                            token,
                            headers,
                            body,
                            client,
                        };
                        webpush::send(state, push, &mut router_type, &mut binding).await
                    }
                    Err(e) => Err(e),
                };
                // Every push answered, counted in one place.
                match &result {
                    Ok(response) => {
                        metrics::push_answered(router_type, response.status().as_u16(), None)
                    }
                    Err(e) => {
                        metrics::push_answered(router_type, e.status().as_u16(), Some(e.errno()))
                    }
                }
                // An accepted push names the limit it stands closest to;
                // a refused one, whatever refused it, its own (a 429 the
                // limit that refused).
                let binding = binding.filter(|_| result.is_ok());
                let mut response = render(result);
                if let Some(binding) = binding {
                    binding.rate_limit().add_headers(response.headers_mut());
                }
                response
            },
        );
    let cancel = warp::delete()
        .and(warp::path!("m" / String))
        .and(warp::header::headers_cloned())
        .and(with_state.clone())
        .then(
            |id, headers, state| async move { render(message::cancel(state, id, headers).await) },
        );
    let receipt = warp::get()
        .and(warp::path!("m" / String))
        .and(warp::header::headers_cloned())
        .and(with_state.clone())
        .then(
            |id, headers, state| async move { render(receipt::answer(state, id, headers).await) },
        );
    let registration = warp::path!("v1" / String / String / "registration" / ..)
        .and(warp::path::tail())
        .and(warp::query::raw().or(warp::any().map(String::new)).unify())
        .and(warp::method())
        .and(warp::header::headers_cloned())
        .and(warp::ext::optional::<Peer>())
        .and(warp::body::stream())
        .and(with_state)
        .then(
            |router_type: String,
             app_id: String,
             tail: warp::path::Tail,
             query: String,
             method: warp::http::Method,
             headers: HeaderMap,
             peer,
             body,
             state: Arc<EndpointState>| async move {
                let path: Vec<&str> = tail.as_str().split('/').filter(|s| !s.is_empty()).collect();
                // A new registration is a new user, made without credentials.
                if method == warp::http::Method::POST && path.is_empty() {
                    let client = state.client(peer, &headers);
                    if let Err(e) = state.fair_use.registration(client) {
                        return error_response(&e);
                    }
                }
                let body = match read_body(body, autopush_registration::MAX_BODY).await {
                    Ok(body) => body,
                    Err(e) => return error_response(&e),
                };
                let reply = autopush_registration::handle(
                    &state.registration,
                    method,
                    &router_type,
                    app_id,
                    autopush_registration::Target {
                        path: &path,
                        query: &query,
                    },
                    headers,
                    body.to_vec(),
                )
                .await;
                render(reply.map(|json| warp::reply::json(&json).into_response()))
            },
        );
    let matrix = matrix::routes(state.clone());
    let health = autopush_serving::health::routes(state.health.clone());
    // Whatever no route took: decided here from the path alone, not from
    // which of warp's rejections ranks highest.
    let unmatched = warp::path::full()
        .map(|path: warp::path::FullPath| error_response(&unmatched(path.as_str())));
    push.or(cancel)
        .unify()
        .or(receipt)
        .unify()
        .or(registration)
        .unify()
        .or(matrix)
        .unify()
        .or(health)
        .unify()
        .or(unmatched)
        .unify()
}

/// Read a request body of at most `max` bytes, with or without a
/// Content-Length, without ever buffering more than `max`.
async fn read_body(
    mut body: impl futures_util::Stream<Item = Result<impl bytes::Buf, warp::Error>> + Unpin,
    max: usize,
) -> Result<bytes::Bytes, ApiError> {
    use futures_util::StreamExt;
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let mut chunk =
            chunk.map_err(|e| ApiError::BadRequest(format!("cannot read the body: {e}")))?;
        if out.len() + chunk.remaining() > max {
            return Err(ApiError::PayloadTooLarge(max));
        }
        while chunk.has_remaining() {
            let piece = chunk.chunk();
            let n = piece.len();
            out.extend_from_slice(piece);
            chunk.advance(n);
        }
    }
    Ok(out.freeze())
}

/// The answer to a request no route took: `405` naming the method a known
/// path takes (a push, a cancel, a health route), else `404`.
fn unmatched(path: &str) -> ApiError {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let allowed = match segments.as_slice() {
        ["wpush", version, token] if !version.is_empty() && !token.is_empty() => "POST",
        ["m", id] if !id.is_empty() => "GET, DELETE",
        ["health" | "__heartbeat__" | "__lbheartbeat__" | "__version__"] => "GET",
        _ => return ApiError::NotFound,
    };
    ApiError::MethodNotAllowed { allowed }
}
