//! The two listeners of a connection node: the public websocket port (with
//! health routes) and the internal router API port.

use std::sync::Arc;

use tokio::net::TcpListener;
use warp::Filter;
use warp::reply::Reply;

use crate::{NodeContext, health, router_api, session};

/// The subprotocol Firefox offers; echoed when offered, never required.
const SUBPROTOCOL: &str = "push-notification";

/// Serve websockets at `/` and health routes on `listener`.
pub async fn serve_websocket(listener: TcpListener, ctx: Arc<NodeContext>) {
    let max_message = ctx.settings.max_message_size;
    let health = health::routes(ctx.storage.clone());
    let ctx_filter = warp::any().map(move || ctx.clone());
    let websocket = warp::path::end()
        .and(warp::ws())
        .and(warp::header::optional::<String>("sec-websocket-protocol"))
        .and(ctx_filter)
        .map(
            move |ws: warp::ws::Ws, offered: Option<String>, ctx: Arc<NodeContext>| {
                let reply = ws
                    .max_message_size(max_message)
                    .max_frame_size(max_message)
                    .on_upgrade(move |socket| session::run(ctx, socket));
                let offers_push =
                    offered.is_some_and(|o| o.split(',').any(|p| p.trim() == SUBPROTOCOL));
                let mut response = reply.into_response();
                if offers_push {
                    response.headers_mut().insert(
                        "sec-websocket-protocol",
                        warp::http::HeaderValue::from_static(SUBPROTOCOL),
                    );
                }
                response
            },
        );
    warp::serve(websocket.or(health))
        .incoming(listener)
        .run()
        .await;
}

/// Serve the internal router API on `listener`.
pub async fn serve_router_api(listener: TcpListener, ctx: Arc<NodeContext>) {
    warp::serve(router_api::routes(ctx))
        .incoming(listener)
        .run()
        .await;
}
