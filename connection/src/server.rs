//! The two listeners of a connection node: the public websocket port (with
//! health routes) and the internal router API port.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use autopush_common::ApiError;
use autopush_common::metrics;
use hyper::upgrade::OnUpgrade;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tracing::{debug, warn};
use warp::Filter;
use warp::filters::BoxedFilter;
use warp::http::{HeaderMap, HeaderValue, StatusCode, header};
use warp::reply::Reply;

use autopush_serving::health;
use autopush_serving::http::{self, HttpLimits, Peer};
use autopush_serving::tls::TlsAcceptor;
use autopush_serving::upgraded::{self, UpgradedStream};

use crate::websocket::WebSocket;
use crate::{NodeContext, router_api, session};

/// A client's websocket, after the HTTP upgrade.
pub type Socket = WebSocket<UpgradedStream>;

/// The subprotocol Firefox offers; echoed when offered, never required.
const SUBPROTOCOL: &str = "push-notification";

/// Serve websockets at `/` and health routes (checking storage through
/// `health`) on `listener`, over TLS when given an acceptor; anything else
/// is 404.
pub async fn serve_websocket(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    ctx: Arc<NodeContext>,
    health: Arc<health::HealthCheck>,
    limits: HttpLimits,
) {
    let health = health::routes(health);
    let ctx_filter = warp::any().map(move || ctx.clone());
    let websocket = warp::path::end()
        .and(warp::get())
        .and(warp::header::headers_cloned())
        .and(warp::ext::optional::<OnUpgrade>())
        .and(warp::ext::optional::<Peer>())
        .and(ctx_filter)
        .and_then(
            |headers: HeaderMap, on_upgrade, peer: Option<Peer>, ctx: Arc<NodeContext>| async move {
                if asks_websocket(&headers) {
                    let client = peer.map(|Peer(peer)| {
                        http::client_ip(peer, &headers, &ctx.settings.trusted_proxies)
                    });
                    Ok(upgrade(&headers, on_upgrade, client, ctx))
                } else {
                    Err(warp::reject::not_found())
                }
            },
        );
    let not_found = warp::any().map(|| {
        let error = ApiError::NotFound;
        warp::reply::with_status(warp::reply::json(&error.body()), error.status()).into_response()
    });
    let routes = websocket.or(health).unify().or(not_found).unify();
    http::serve_with(listener, tls, warp::service(routes), limits).await;
}

/// Whether a request asks to become a websocket (`Upgrade: websocket`
/// with `Connection: upgrade`); it may still get the handshake wrong.
fn asks_websocket(headers: &HeaderMap) -> bool {
    let has = |name, token: &str| {
        headers.get_all(name).iter().any(|value| {
            value
                .to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    has(header::UPGRADE, "websocket") && has(header::CONNECTION, "upgrade")
}

/// Answer the handshake (101) and, once hyper hands over the connection,
/// run the session on it for `client` (the address it came from).
fn upgrade(
    headers: &HeaderMap,
    on_upgrade: Option<OnUpgrade>,
    client: Option<IpAddr>,
    ctx: Arc<NodeContext>,
) -> warp::reply::Response {
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if header(header::SEC_WEBSOCKET_VERSION) != Some("13") {
        // RFC 6455 4.4: name the version this server speaks.
        let mut reply = warp::reply::with_status(
            "this server speaks websocket version 13",
            StatusCode::UPGRADE_REQUIRED,
        )
        .into_response();
        reply.headers_mut().insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        return reply;
    }
    let (Some(key), Some(on_upgrade)) = (header(header::SEC_WEBSOCKET_KEY), on_upgrade) else {
        return warp::reply::with_status(
            "a websocket handshake needs a Sec-WebSocket-Key",
            StatusCode::BAD_REQUEST,
        )
        .into_response();
    };
    let offered = header(header::SEC_WEBSOCKET_PROTOCOL);
    let Some(slot) = SocketSlot::take(&ctx) else {
        debug!("refusing a websocket: the node is full");
        let mut refused = warp::reply::with_status(
            "this node holds as many clients as it may; try again later",
            StatusCode::SERVICE_UNAVAILABLE,
        )
        .into_response();
        refused
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("30"));
        return refused;
    };
    tokio::spawn(async move {
        // The upgrade and the hello run on this task, and an accepted
        // session on a task of its own: an idle client's task holds the
        // serving session and nothing of what the hello needed.
        if let Some(session) = open_and_greet(on_upgrade, ctx, client).await {
            tokio::spawn(session.serve(slot));
        }
    });
    let mut response =
        warp::reply::with_status(warp::reply(), StatusCode::SWITCHING_PROTOCOLS).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    if offered.is_some_and(|o| o.split(',').any(|p| p.trim() == SUBPROTOCOL)) {
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(SUBPROTOCOL),
        );
    }
    response
}

/// Once hyper hands the connection over, make it a websocket and wait for
/// the client's hello; the session to serve, if it was accepted.
async fn open_and_greet(
    on_upgrade: OnUpgrade,
    ctx: Arc<NodeContext>,
    client: Option<IpAddr>,
) -> Option<session::Accepted> {
    let upgraded = match on_upgrade.await {
        Ok(upgraded) => upgraded,
        Err(e) => {
            debug!(error = %e, "websocket upgrade failed");
            return None;
        }
    };
    let upgraded = upgraded::unwrap(upgraded);
    let socket = WebSocket::new(upgraded.stream, ctx.settings.max_message_size)
        .read_ahead(&upgraded.read_ahead);
    session::hello(ctx, socket, client).await
}

/// One of the node's `max_connections` websockets, given back on drop.
struct SocketSlot(Arc<NodeContext>);

impl SocketSlot {
    fn take(ctx: &Arc<NodeContext>) -> Option<SocketSlot> {
        let max = ctx.settings.max_connections;
        let open = ctx
            .open_sockets
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < max).then_some(open + 1)
            })
            .ok()?;
        if open + 1 == max {
            warn!(
                max_connections = max,
                "the node is full: new websockets get 503 until clients leave"
            );
        }
        metrics::connection_opened();
        Some(SocketSlot(ctx.clone()))
    }
}

impl Drop for SocketSlot {
    fn drop(&mut self) {
        self.0.open_sockets.fetch_sub(1, Ordering::AcqRel);
        metrics::connection_released();
    }
}

/// Serve the internal router API on `listener`, with `unsigned` routes
/// (`GET /metrics`: Prometheus scrapers cannot sign) ahead of the signed ones.
pub async fn serve_router_api(
    listener: TcpListener,
    ctx: Arc<NodeContext>,
    unsigned: BoxedFilter<(warp::reply::Response,)>,
    limits: HttpLimits,
) {
    let routes = unsigned.or(router_api::routes(ctx)).unify();
    http::serve(listener, warp::service(routes), limits).await;
}
