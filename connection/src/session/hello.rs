//! `hello`: identify the user agent, record where it is connected, and reply.

use std::sync::Arc;

use autopush_common::time::now_millis;
use autopush_common::{RouterType, User};
use tokio_tungstenite::tungstenite::Message;
use tracing::{info, warn};
use uuid::Uuid;

use super::{Close, Session, Sink};
use crate::NodeContext;
use crate::protocol::ServerMessage;

/// A UAID the client offers is honoured only if it names a webpush user we
/// know; anything else (empty, malformed, unknown) gets a fresh UAID.
async fn known_user(ctx: &NodeContext, offered: Option<&str>) -> Result<Option<User>, Close> {
    let Some(uaid) = offered.and_then(|u| Uuid::parse_str(u).ok()) else {
        return Ok(None);
    };
    let user = ctx
        .storage
        .get_user(&uaid)
        .await
        .map_err(|e| Close::server(e.to_string()))?;
    Ok(user.filter(|u| u.router_type == RouterType::WebPush))
}

pub(super) async fn accept(
    ctx: &Arc<NodeContext>,
    offered: Option<&str>,
    mut sink: Sink,
) -> Result<Session, (Sink, Close)> {
    let connected_at = now_millis();
    let mut previous = match known_user(ctx, offered).await {
        Ok(user) => user,
        Err(e) => return Err((sink, e)),
    };
    if let Some(user) = &previous {
        // Too far behind: start over rather than replay an unbounded backlog.
        match ctx.storage.count_messages(&user.uaid).await {
            Ok(count) if count > ctx.settings.msg_limit => {
                info!(uaid = %user.uaid.simple(), count, "stored messages over msg_limit; issuing a new UAID");
                if let Err(e) = ctx.storage.remove_user(&user.uaid).await {
                    return Err((sink, Close::server(e.to_string())));
                }
                previous = None;
            }
            Ok(_) => {}
            Err(e) => return Err((sink, Close::server(e.to_string()))),
        }
    }
    let uaid = previous.as_ref().map_or_else(Uuid::new_v4, |u| u.uaid);

    // Join the registry before publishing node_id, so an endpoint that reads
    // the new record always finds this session here.
    let membership = ctx.registry.connect(uaid, connected_at);
    let mut user = User::new_webpush(uaid, ctx.node_id(), connected_at);
    if let Some(prev) = &previous {
        user.router_data = prev.router_data.clone();
    }
    if let Err(e) = ctx.storage.update_user(&user).await {
        ctx.registry.disconnect(&uaid, connected_at);
        return Err((sink, Close::server(e.to_string())));
    }
    if let Some(prev) = previous {
        drop_elsewhere(ctx, &prev);
    }

    let reply = ServerMessage::Hello {
        uaid: uaid.simple().to_string(),
        status: 200,
        use_webpush: true,
        broadcasts: serde_json::Map::new(),
    };
    let reply = Message::text(reply.to_json());
    if let Err(gone) = super::send_within(&mut sink, ctx.settings.send_timeout, reply).await {
        ctx.registry.disconnect(&uaid, connected_at);
        return Err((sink, gone));
    }
    info!(uaid = %uaid.simple(), "client connected");
    Ok(Session {
        ctx: ctx.clone(),
        sink,
        uaid,
        connected_at,
        inbox: membership.inbox,
        signals: membership.signals,
        _live: membership.live,
        unacked_direct: Default::default(),
        unacked_stored: Default::default(),
        recheck_storage: false,
        last_client_ping: None,
    })
}

/// The user's previous connection on another node is stale now: ask that
/// node to drop it (`DELETE /notif/{uaid}/{connected_at}`). Same-node
/// replacement is handled by the registry.
fn drop_elsewhere(ctx: &Arc<NodeContext>, previous: &User) {
    let Some(node_id) = previous.node_id.clone().filter(|n| n != ctx.node_id()) else {
        return;
    };
    let url = format!(
        "{node_id}/notif/{}/{}",
        previous.uaid.simple(),
        previous.connected_at
    );
    let http = ctx.http.clone();
    tokio::spawn(async move {
        if let Err(e) = http.delete(&url).send().await {
            warn!(node_id, error = %e, "could not reach the previous node of a reconnecting client");
        }
    });
}
