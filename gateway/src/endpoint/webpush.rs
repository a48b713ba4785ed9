//! `POST /wpush/{v1|v2}/{token}`: accept a push and route it.

use std::net::IpAddr;
use std::sync::Arc;

use autopush_common::endpoint::{MessageIdInfo, TokenInfo, key_hash_in_id};
use autopush_common::ids::uaid_tag;
use autopush_common::notification::version_tag;
use autopush_common::receipt::MessageState;
use autopush_webpush::stores_direct;
use std::time::Instant;

use autopush_common::metrics;
use autopush_common::router::{Delivery, Router};
use autopush_common::time::{now_secs, unique_micros};
use autopush_common::{ApiError, ApiResult, Notification, RouterType, User};
use bytes::Bytes;
use tracing::{debug, info};
use warp::http::{HeaderMap, HeaderValue, StatusCode};
use warp::reply::{Reply, Response};

use super::fair_use::Binding;
use super::headers::{self, PushHeaders};
use super::{EndpointState, mailbox};
use crate::vapid::{Claim, VapidError, VapidIdentity};

/// One push request as it arrived.
pub struct Push {
    /// `v1` or `v2`, from the path.
    pub version: String,
    pub token: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Who sent it, as far as the network says (see `client_ip`).
    pub client: IpAddr,
}

/// Accept a push and route it. `router_type` is set once the subscriber's
/// router type is known, and `binding` to the limit the push stands
/// closest to once it is counted (for the caller's metrics and headers).
pub async fn send(
    state: Arc<EndpointState>,
    request: Push,
    router_type: &mut Option<RouterType>,
    binding: &mut Option<Binding>,
) -> ApiResult<Response> {
    let Push {
        version,
        token,
        headers,
        body,
        client,
    } = request;
    let subscription = state.crypto.parse_token(&version, &token)?;
    let push = headers::parse(&headers, !body.is_empty())?;
    let sender = authenticate(&state, &subscription, &headers, client, binding)?;
    let sender = sender.as_ref().and_then(|s| s.sub.as_deref());
    deliver(state, &subscription, push, body, sender, router_type).await
}
/// Route an accepted push to `subscription`: directly, stored, or through
/// its bridge. `sender` names who signed it, for the logs.
pub async fn deliver(
    state: Arc<EndpointState>,
    subscription: &TokenInfo,
    push: PushHeaders,
    body: Bytes,
    sender: Option<&str>,
    router_type: &mut Option<RouterType>,
) -> ApiResult<Response> {
    let (user, subscribed) = state
        .storage
        .get_user_and_channel(&subscription.uaid, &subscription.channel_id)
        .await?
        .ok_or(ApiError::NoUser)?;
    *router_type = Some(user.router_type);
    let router = state
        .routers
        .get(user.router_type)
        .ok_or(ApiError::InvalidRouterType)?;
    if !subscribed {
        return Err(ApiError::NoSubscription);
    }
    let encoding = headers::encoding_label(push.forward.as_ref());

    let mailbox = user.has_mailbox();
    // A bridge without a mailbox keeps nothing: once the upstream takes the
    // message (the only way the sender gets its id) it is `bridged` for
    // good, sealed into the id the app receives as `ver` too.
    let bridged =
        (state.receipt_retention > 0 && user.router_type != RouterType::WebPush && !mailbox)
            .then(|| (MessageState::Bridged, now_secs()));
    let (notification, mut message) =
        build_notification(&state, subscription, push, &body, bridged);
    let (mut message_id, ttl) = (notification.version.clone(), notification.ttl);
    let delivery = if user.is_wake_only() {
        // Nothing of the message goes upstream: its app fetches it.
        mailbox::keep_and_wake(&state, &user, &notification).await?
    } else {
        if mailbox {
            mailbox::keep(&state, &user, &notification).await?;
        }
        route_bridged(&state, router.as_ref(), notification, &user, mailbox).await?
    };
    metrics::encoding(encoding);
    metrics::delivery(
        user.router_type,
        match delivery {
            Delivery::Direct | Delivery::Acked | Delivery::Kept => "direct",
            Delivery::Stored => "stored",
            Delivery::Dropped => "dropped",
        },
    );
    let settled = match mailbox && delivery != Delivery::Dropped {
        // Its row in the mailbox follows it.
        true => None,
        false => settled_at_once(&state, user.router_type, delivery, ttl),
    };
    if let Some(settled) = settled {
        // An acked one was counted where its ack was seen.
        if settled.is_final() && delivery != Delivery::Acked {
            metrics::final_state(user.router_type, settled);
        }
        if state.receipt_retention > 0 && message.settled.is_none() {
            // Nothing stored follows this message: its receipt is sealed
            // into the id the sender gets. A kept one's row may come later
            // (at its ack, or its move), under the id its client knows.
            message.settled = Some((settled, now_secs()));
            if delivery == Delivery::Kept {
                message.tag = Some(version_tag(&message_id));
                message.node = user.node_id.clone();
            }
            message_id = state.crypto.make_message_id(&message);
        }
    }
    debug!(
        uaid = %uaid_tag(&subscription.uaid),
        ?delivery,
        sender = sender.unwrap_or("-"),
        "push routed"
    );

    let location = format!("{}/m/{message_id}", state.crypto.endpoint_url());
    let mut response = warp::reply::with_status(warp::reply(), StatusCode::CREATED).into_response();
    let out = response.headers_mut();
    out.insert("ttl", HeaderValue::from(ttl));
    if let Ok(location) = HeaderValue::from_str(&location) {
        out.insert("location", location);
    }
    if delivery == Delivery::Dropped {
        debug!(uaid = %uaid_tag(&subscription.uaid), "TTL 0 and client not connected: dropped");
    }
    Ok(response)
}

/// The state a message is in for good once routed, when no stored copy
/// will follow it: accepted by a bridge, dropped (TTL 0, no client),
/// acked by its client already, or handed to a client without a copy in
/// storage (its ack is not recorded, so its receipt stays `sent`).
fn settled_at_once(
    state: &EndpointState,
    router_type: RouterType,
    delivery: Delivery,
    ttl: u64,
) -> Option<MessageState> {
    match (router_type, delivery) {
        (_, Delivery::Dropped) => Some(MessageState::Dropped),
        (_, Delivery::Acked) => Some(MessageState::Delivered),
        (_, Delivery::Kept) => Some(MessageState::Sent),
        (RouterType::WebPush, Delivery::Direct) => {
            (!stores_direct(state.durable_direct, ttl)).then_some(MessageState::Sent)
        }
        (RouterType::WebPush, Delivery::Stored) => None,
        (_, _) => Some(MessageState::Bridged),
    }
}

/// Hand the notification to its router, which may be a bridge: a copy
/// kept in the registration's mailbox (`mailbox`) goes if the upstream
/// refuses it (the sender hears the error and sends again), and a device
/// the upstream calls gone loses its registration.
async fn route_bridged(
    state: &EndpointState,
    router: &dyn Router,
    notification: Notification,
    user: &User,
    mailbox: bool,
) -> ApiResult<Delivery> {
    let kept = mailbox.then(|| (notification.sort_key(), notification.version.clone()));
    let error = match route(router, notification, user).await {
        Ok(delivery) => return Ok(delivery),
        Err(e) => e,
    };
    if let Some((sort_key, version)) = kept {
        mailbox::forget(state, user, &sort_key, &version).await;
    }
    if error == ApiError::DeviceGone {
        forget_gone_device(state, user).await?;
    }
    Err(error)
}

/// Hand the notification to its router; calls to a bridge are counted and
/// timed here (`notification.bridge.*`), so bridge routers need no metrics
/// code of their own.
async fn route(
    router: &dyn Router,
    notification: Notification,
    user: &User,
) -> ApiResult<Delivery> {
    if user.router_type == RouterType::WebPush {
        return router.route_notification(notification, user).await;
    }
    let started = Instant::now();
    let result = router.route_notification(notification, user).await;
    let app = user
        .router_data
        .as_ref()
        .and_then(|d| d.get("app_id"))
        .and_then(|a| a.as_str())
        .unwrap_or("");
    metrics::bridge_request(
        user.router_type,
        app,
        result.as_ref().map(|_| ()),
        started.elapsed(),
    );
    result
}

/// A bridge said the device is gone for good: remove the registration, so
/// the sender's next push gets 410 without asking the bridge again. Only the
/// registration the bridge refused is removed: if the app re-registered a new
/// token meanwhile (`PUT .../registration/{uaid}`), the record stays.
async fn forget_gone_device(state: &EndpointState, seen: &User) -> ApiResult<()> {
    if state.storage.remove_user_if_unchanged(seen).await? {
        info!(
            router_type = seen.router_type.as_str(),
            "the bridge reports the device gone: registration removed"
        );
    }
    Ok(())
}

/// VAPID is optional on v1 endpoints (but checked when present) and
/// required, with the subscription's own key, on v2 endpoints (another key
/// is refused before its signature is checked). Returns the verified
/// sender, if the request was signed.
///
/// Counted before any storage read, and before its signature is checked
/// ([`super::fair_use`]): a push over a rate costs us nothing more. A key
/// the subscription does not pin proves nothing until this node has
/// verified its token: until then such a push counts as an unsigned one
/// does, against its subscription and its address.
fn authenticate(
    state: &EndpointState,
    subscription: &TokenInfo,
    headers: &HeaderMap,
    client: IpAddr,
    binding: &mut Option<Binding>,
) -> ApiResult<Option<Arc<VapidIdentity>>> {
    let fair_use = &state.fair_use;
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let pinned = subscription.key_hash.as_ref().map(|hash| &hash[..]);
    if pinned.is_none() {
        fair_use.unpinned_push(subscription.uaid, subscription.channel_id, binding)?;
    }
    // An address whose signatures keep failing gets no more checks.
    let refused = |e: VapidError| {
        fair_use.forged(client);
        ApiError::InvalidAuthentication(e.to_string())
    };
    let identity = match state
        .vapid
        .look_up(text("authorization"), text("crypto-key"), pinned)
        .map_err(refused)?
    {
        Claim::Verified(identity) => identity,
        Claim::Unsigned if pinned.is_some() => {
            return Err(ApiError::InvalidAuthentication(
                "this subscription is restricted to a VAPID key: sign the request".into(),
            ));
        }
        Claim::Unsigned => {
            fair_use.unproven_push(client, binding)?;
            return Ok(None);
        }
        Claim::Unverified(unverified) => {
            if pinned.is_none() {
                fair_use.unproven_push(client, binding)?;
            }
            fair_use.may_verify(client)?;
            state
                .vapid
                .verify_claim(unverified, pinned)
                .map_err(refused)?
        }
    };
    fair_use.signed_push(&identity, binding)?;
    Ok(Some(identity))
}

/// The notification to route, and what its id says.
fn build_notification(
    state: &EndpointState,
    subscription: &TokenInfo,
    push: PushHeaders,
    body: &[u8],
    settled: Option<(MessageState, u64)>,
) -> (Notification, MessageIdInfo) {
    // Orders every message, Topic ones included: a Topic message never
    // replaces a newer one with the same Topic.
    let sortkey_timestamp = unique_micros();
    let info = MessageIdInfo {
        uaid: subscription.uaid,
        channel_id: subscription.channel_id,
        topic: push.topic.clone(),
        sortkey_timestamp: push.topic.is_none().then_some(sortkey_timestamp),
        key_hash: subscription.key_hash.as_ref().map(key_hash_in_id),
        settled,
        tag: None,
        node: None,
    };
    let message_id = state.crypto.make_message_id(&info);
    let notification = Notification {
        channel_id: subscription.channel_id,
        version: message_id,
        ttl: push.ttl,
        timestamp: now_secs(),
        topic: push.topic,
        sortkey_timestamp: Some(sortkey_timestamp),
        // SIMD: several times fewer instructions than the base64 crate's
        // encoder on a ~3 KB body.
        data: (!body.is_empty()).then(|| base64_simd::URL_SAFE_NO_PAD.encode_to_string(body)),
        headers: push.forward,
        urgency: push.urgency,
        durable: false,
    };
    (notification, info)
}
