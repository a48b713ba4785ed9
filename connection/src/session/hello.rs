//! `hello`: identify the user agent, record where it is connected, and reply.

use std::net::IpAddr;
use std::sync::Arc;

use autopush_common::ids::uaid_tag;
use autopush_common::time::now_millis;
use autopush_common::{RouterType, Urgency, User};
use tokio_tungstenite::tungstenite::Message;
use tracing::{debug, info, warn};
use uuid::Uuid;
use warp::http::Method;

use super::stored::store_undelivered;
use super::{Close, Session};
use crate::NodeContext;
use crate::protocol::ServerMessage;
use crate::registry::Membership;
use crate::server::Socket;

/// A UAID the client offers is honoured only if it names a webpush user we
/// know; anything else (empty, malformed, unknown) gets a fresh UAID.
async fn known_user(ctx: &NodeContext, offered: Option<&str>) -> Result<Option<User>, Close> {
    let Some(uaid) = offered.and_then(|u| Uuid::parse_str(u).ok()) else {
        return Ok(None);
    };
    let user = ctx.storage.get_user(&uaid).await.map_err(Close::storage)?;
    Ok(user.filter(|u| u.router_type == RouterType::WebPush))
}

/// A hello that would create a user takes one of its address's new UAIDs
/// (`--new-uaid-limit`); over the quota it is refused with 429 and the
/// connection closed with 1013. A known user reconnecting is never counted.
fn within_new_uaid_quota(ctx: &NodeContext, client: Option<IpAddr>) -> Result<(), Close> {
    let (Some(limiter), Some(client)) = (&ctx.new_uaids, client) else {
        return Ok(());
    };
    limiter.check_counted(client, "new_uaid").map_err(|wait| {
        debug!(
            ?wait,
            "refusing a new UAID: the client's address is over its quota"
        );
        Close::too_many(format!(
            "too many new user agents from this address; try again in {} s",
            wait.as_secs_f64().ceil().max(1.0)
        ))
    })
}

/// A client that joined the registry and published its `node_id`: from now
/// on endpoints route notifications into `membership.inbox`.
pub(super) struct Joined {
    pub uaid: Uuid,
    pub membership: Membership,
    /// Stored messages this session may send: `Some(msg_limit)` when the
    /// client is over the limit, `None` for no bound.
    pub stored_budget: Option<usize>,
    /// When this connection recorded itself: what its own writes to the
    /// user record are conditional on.
    pub connected_at: u64,
    /// The user agent's minimum urgency, as its record holds it.
    pub min_urgency: Urgency,
}

/// Why a `hello` could not take its user over.
enum Refused {
    /// The user was removed since it was read (idle, over `msg_limit`, or
    /// unregistered): the client starts over under a new UAID.
    Gone,
    Close(Close),
}

/// The storage half of `hello`: decide the UAID (honouring `msg_limit`),
/// join the registry and record the connection. On failure nothing routed
/// to the client in the meantime is lost: it is stored.
pub(super) async fn join(
    ctx: &Arc<NodeContext>,
    offered: Option<&str>,
    client: Option<IpAddr>,
) -> Result<Joined, Close> {
    let previous = known_user(ctx, offered).await?;
    if previous.is_none() {
        within_new_uaid_quota(ctx, client)?;
    }
    match take_over(ctx, previous).await {
        Err(Refused::Gone) => take_over(ctx, None).await,
        other => other,
    }
    .map_err(|refused| match refused {
        Refused::Close(close) => close,
        // Only a known user can be removed meanwhile; a new one is added.
        Refused::Gone => Close::superseded(),
    })
}

/// Record this connection as the user's (a new user when `previous` is
/// `None`), in one conditional write on what was read.
async fn take_over(ctx: &Arc<NodeContext>, mut previous: Option<User>) -> Result<Joined, Refused> {
    let storage_failed = |e| Refused::Close(Close::storage(e));
    let mut over_limit = false;
    let mut outcome = if previous.is_some() {
        "existing"
    } else {
        "new"
    };
    if let Some(user) = &previous {
        let limit = ctx.settings.msg_limit;
        over_limit = behind(ctx, user, limit).await.map_err(storage_failed)?;
        if over_limit && user.over_msg_limit {
            // Sent what fit last time and still too far behind: start over
            // rather than replay an unbounded backlog.
            info!(uaid = %uaid_tag(&user.uaid), limit, "still over msg_limit: issuing a new UAID");
            if !ctx
                .storage
                .remove_user_if_unchanged(user)
                .await
                .map_err(storage_failed)?
            {
                return Err(replaced_meanwhile(ctx, user).await);
            }
            previous = None;
            over_limit = false;
            outcome = "reset";
        } else if over_limit {
            info!(uaid = %uaid_tag(&user.uaid), limit, "over msg_limit: sending what fits; a new UAID at the next hello if still over");
        }
    }
    let uaid = previous.as_ref().map_or_else(Uuid::new_v4, |u| u.uaid);
    // A reconnect wins over the session it replaces whatever the nodes'
    // clocks say: its connected_at is later than the one it replaces.
    let connected_at = match &previous {
        Some(prev) => now_millis().max(prev.connected_at + 1),
        None => now_millis(),
    };

    // Join the registry before publishing node_id, so an endpoint that reads
    // the new record always finds this session here.
    let membership = ctx.registry.connect(uaid, connected_at);
    let mut user = User::new_webpush(uaid, ctx.node_id(), connected_at);
    user.over_msg_limit = over_limit;
    if let Some(prev) = &previous {
        user.keep_as_read(prev);
    }
    let written = match &previous {
        Some(prev) => ctx.storage.take_over_user(&user, prev.connected_at).await,
        None => ctx.storage.add_user(&user).await.map(|()| true),
    };
    match written {
        Ok(true) => {}
        Ok(false) => {
            leave(ctx, uaid, membership).await;
            let prev = previous.as_ref().unwrap_or(&user);
            return Err(replaced_meanwhile(ctx, prev).await);
        }
        Err(e) => {
            leave(ctx, uaid, membership).await;
            return Err(storage_failed(e));
        }
    }
    if let Some(prev) = previous {
        drop_elsewhere(ctx, &prev);
    }
    autopush_common::metrics::hello(outcome);
    Ok(Joined {
        uaid,
        membership,
        stored_budget: over_limit.then_some(ctx.settings.msg_limit),
        connected_at,
        min_urgency: user.min_urgency,
    })
}

/// Whether more than `limit` stored messages wait to be sent to `user`.
/// Those held below its minimum urgency are not sent while held, so they
/// are not the client falling behind: they have a bound of their own,
/// `limit` again, kept by the endpoint. Counted first, as that is cheap;
/// read only when the count is over.
async fn behind(
    ctx: &NodeContext,
    user: &User,
    limit: usize,
) -> Result<bool, autopush_storage::StorageError> {
    let count = ctx
        .storage
        .count_messages(&user.uaid, limit.saturating_add(1))
        .await?;
    if count <= limit || user.min_urgency == Urgency::VeryLow {
        return Ok(count > limit);
    }
    let stored = ctx
        .storage
        .fetch_messages(&user.uaid, limit.saturating_mul(2).saturating_add(1))
        .await?;
    Ok(stored.iter().filter(|m| !user.holds(m)).count() > limit)
}

/// The record of `seen` changed between the read and the conditional
/// write: either the user was removed (the client starts over), or another
/// connection of it took over meanwhile (that one stays; this one is
/// refused and the client tries again).
async fn replaced_meanwhile(ctx: &Arc<NodeContext>, seen: &User) -> Refused {
    match ctx.storage.get_user(&seen.uaid).await {
        Ok(None) => Refused::Gone,
        Ok(Some(_)) => {
            info!(uaid = %uaid_tag(&seen.uaid), "another connection took the user over during hello");
            Refused::Close(Close::superseded())
        }
        Err(e) => Refused::Close(Close::storage(e)),
    }
}

/// Leave the registry after a failed `hello`, storing whatever endpoints
/// routed into the inbox meanwhile (they answered 201 for it). The session
/// stops counting as live only once that is done.
pub(super) async fn leave(ctx: &Arc<NodeContext>, uaid: Uuid, membership: Membership) {
    let Membership {
        session,
        inbox,
        live,
    } = membership;
    ctx.registry.disconnect(&uaid, session);
    let routed = inbox.close();
    if let Err(e) = store_undelivered(ctx, &uaid, routed).await {
        warn!(uaid = %uaid_tag(&uaid), error = %e, "could not store notifications routed to a failed hello");
    }
    drop(live);
}

pub(super) async fn accept(
    ctx: &Arc<NodeContext>,
    offered: Option<&str>,
    client: Option<IpAddr>,
    mut socket: Socket,
) -> Result<Session, (Socket, Close)> {
    let joined = match join(ctx, offered, client).await {
        Ok(joined) => joined,
        Err(close) => return Err((socket, close)),
    };
    let Joined {
        uaid,
        membership,
        stored_budget,
        connected_at,
        min_urgency,
    } = joined;
    let reply = ServerMessage::Hello {
        uaid: uaid.simple().to_string(),
        status: 200,
        use_webpush: true,
        broadcasts: serde_json::Map::new(),
    };
    let reply = Message::text(reply.to_json());
    if let Err(gone) = super::send_within(&mut socket, ctx.settings.send_timeout, reply).await {
        leave(ctx, uaid, membership).await;
        return Err((socket, gone));
    }
    info!(uaid = %uaid_tag(&uaid), "client connected");
    Ok(Session {
        ctx: ctx.clone(),
        socket,
        uaid,
        session: membership.session,
        inbox: membership.inbox,
        _live: membership.live,
        in_flight: None,
        recheck_storage: false,
        ping_tokens: super::ping::PingTokens::new(tokio::time::Instant::now()),
        stored_budget,
        connected_at,
        min_urgency,
        held: 0,
    })
}

/// The user's previous connection on another node is stale now: ask that
/// node to drop it (`DELETE /notif/{uaid}/{connected_at}`). Same-node
/// replacement is handled by the registry.
fn drop_elsewhere(ctx: &Arc<NodeContext>, previous: &User) {
    let Some(node_id) = previous.node_id.clone().filter(|n| n != ctx.node_id()) else {
        return;
    };
    let path = format!(
        "/notif/{}/{}",
        previous.uaid.simple(),
        previous.connected_at
    );
    let nodes = ctx.nodes.clone();
    tokio::spawn(async move {
        if let Err(e) = nodes
            .call(Method::DELETE, &node_id, &path, Vec::new())
            .await
        {
            warn!(node_id, error = %e, "could not reach the previous node of a reconnecting client");
        }
    });
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use async_trait::async_trait;
    use autopush_common::endpoint::{EndpointCrypto, generate_key};
    use autopush_common::node::{LocalNode, PushOutcome};
    use autopush_common::node_auth::NodeKeys;
    use autopush_common::{Notification, WakeRoute};
    use autopush_storage::embedded::EmbeddedStore;
    use autopush_storage::{Result, Storage, StorageError};
    use autopush_webpush::NodeClient;
    use tokio::sync::Notify;

    use super::*;
    use crate::{ClientRegistry, ConnectionSettings};

    /// The embedded store, except that recording a connection waits for the
    /// test's go-ahead and then fails, as a storage outage would.
    struct FailingConnect {
        inner: EmbeddedStore,
        entered: Notify,
        release: Notify,
    }

    #[async_trait]
    impl Storage for FailingConnect {
        async fn add_user(&self, user: &User) -> Result<()> {
            self.inner.add_user(user).await
        }
        async fn take_over_user(&self, _user: &User, _seen: u64) -> Result<bool> {
            self.entered.notify_one();
            self.release.notified().await;
            Err(StorageError::Backend("the store is down".into()))
        }
        async fn touch_user(&self, uaid: &Uuid, at: u64) -> Result<bool> {
            self.inner.touch_user(uaid, at).await
        }
        async fn set_router_data(
            &self,
            uaid: &Uuid,
            seen: Option<&serde_json::Value>,
            data: &serde_json::Value,
        ) -> Result<bool> {
            self.inner.set_router_data(uaid, seen, data).await
        }
        async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
            self.inner.remove_user_if_unchanged(seen).await
        }
        async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
            self.inner.get_user(uaid).await
        }
        async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
            self.inner.remove_user(uaid).await
        }
        async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, at: u64) -> Result<bool> {
            self.inner.remove_node_id(uaid, node_id, at).await
        }
        async fn set_min_urgency(
            &self,
            uaid: &Uuid,
            node_id: &str,
            at: u64,
            min: autopush_common::Urgency,
        ) -> Result<bool> {
            self.inner.set_min_urgency(uaid, node_id, at, min).await
        }
        async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
            self.inner.set_wake_route(uaid, route).await
        }
        async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
            self.inner.remove_wake_route(uaid, seen).await
        }
        async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
            self.inner.claim_wake(uaid, seen, now).await
        }
        async fn add_channel(&self, uaid: &Uuid, chid: &Uuid, limit: usize) -> Result<bool> {
            self.inner.add_channel(uaid, chid, limit).await
        }
        async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
            self.inner.get_channels(uaid).await
        }
        async fn has_channel(&self, uaid: &Uuid, chid: &Uuid) -> Result<bool> {
            self.inner.has_channel(uaid, chid).await
        }
        async fn remove_channel(&self, uaid: &Uuid, chid: &Uuid) -> Result<bool> {
            self.inner.remove_channel(uaid, chid).await
        }
        async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
            self.inner.save_messages(uaid, messages).await
        }
        async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
            self.inner.fetch_messages(uaid, limit).await
        }
        async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
            self.inner.count_messages(uaid, up_to).await
        }
        async fn remove_message(&self, uaid: &Uuid, key: &str, version: &str) -> Result<bool> {
            self.inner.remove_message(uaid, key, version).await
        }
        async fn settle_message(
            &self,
            uaid: &Uuid,
            key: &str,
            version: &str,
            state: autopush_common::receipt::MessageState,
        ) -> Result<bool> {
            self.inner.settle_message(uaid, key, version, state).await
        }
        async fn read_message(
            &self,
            uaid: &Uuid,
            key: &str,
        ) -> Result<Option<autopush_storage::StoredMessage>> {
            self.inner.read_message(uaid, key).await
        }
        async fn health_check(&self) -> Result<()> {
            self.inner.health_check().await
        }
    }

    /// A push routed into a session whose `hello` then fails (here: the
    /// store refuses to record the connection) is stored, not dropped.
    #[tokio::test]
    async fn messages_routed_into_a_failed_hello_are_stored() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Arc::new(FailingConnect {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            entered: Notify::new(),
            release: Notify::new(),
        });
        let registry = Arc::new(ClientRegistry::new("http://node-a".into()));
        let ctx = Arc::new(NodeContext {
            settings: ConnectionSettings::default(),
            storage: storage.clone(),
            crypto: Arc::new(EndpointCrypto::new(&[generate_key()], "http://localhost").unwrap()),
            registry: registry.clone(),
            nodes: NodeClient::new(NodeKeys::new(&[generate_key()]).unwrap()),
            journal: None,
            open_sockets: Default::default(),
            new_uaids: None,
            wake_bridges: Default::default(),
        });
        let uaid = Uuid::new_v4();
        storage
            .add_user(&User::new_webpush(uaid, "http://node-a", 1))
            .await
            .unwrap();

        let offered = uaid.simple().to_string();
        let hello = tokio::spawn({
            let ctx = ctx.clone();
            async move { join(&ctx, Some(&offered), None).await.err() }
        });
        storage.entered.notified().await;
        let message = Notification {
            channel_id: Uuid::new_v4(),
            version: "routed-during-hello".into(),
            ttl: 60,
            timestamp: autopush_common::time::now_secs(),
            topic: None,
            sortkey_timestamp: Some(1),
            data: None,
            headers: None,
            urgency: None,
            durable: false,
        };
        assert_eq!(
            registry.push(&uaid, message.clone()),
            PushOutcome::Delivered
        );
        storage.release.notify_one();

        let close = hello.await.unwrap().expect("hello must fail");
        assert_eq!(close.code, 1013);
        let stored = storage.inner.fetch_messages(&uaid, 10).await.unwrap();
        assert_eq!(stored, vec![message]);
        assert_eq!(registry.live_sessions(), 0);
        assert_eq!(
            registry.push(&uaid, stored[0].clone()),
            PushOutcome::NotConnected
        );
    }
}
