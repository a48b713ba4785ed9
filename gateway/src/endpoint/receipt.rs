//! `GET /m/{message_id}`: the receipt of a push, what became of it.
//!
//! Answers `200` with `{"state", "updated"}` (see
//! [`MessageState`] for the states) while the message is pending and for
//! `--receipt-retention` seconds after its final state; after that, for an
//! id this service never gave, `404`/102; with receipts off, `404`/102
//! saying so. Whoever
//! holds the URL may read it (the id is sealed, so it cannot be guessed);
//! a message to a VAPID-restricted (v2) subscription also needs a VAPID
//! signature with the key of the push, else `401`/109 (as for `DELETE`).
//!
//! Most answers cost one point read of the message's row: a settled message
//! left a receipt there, an unsettled one is still there (kept past its TTL
//! for its `expired` answer). A replaced Topic message (on the embedded
//! store, a settled one too) costs a second: its receipt has a row of its
//! own, since the Topic's row belongs to the newest message with that Topic.
//! A message settled before the sender got its id (bridged, dropped)
//! carries its receipt in the id and costs nothing; a pending one costs one
//! more read, of its user, to tell `sent` (the client is connected) from
//! `stored`, and a bridged app's mailbox (`bridged` until the app acks it:
//! `fetched`).

use std::sync::Arc;

use autopush_common::endpoint::MessageIdInfo;
use autopush_common::notification::{receipt_key, version_tag};
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use autopush_common::{ApiError, ApiResult, RouterType};
use autopush_storage::{Receipt, StoredMessage};
use autopush_webpush::KeptReceipt;
use serde_json::json;
use warp::http::HeaderMap;
use warp::reply::{Reply, Response};

use super::EndpointState;

pub async fn answer(
    state: Arc<EndpointState>,
    message_id: String,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let message = state.crypto.parse_message_id(&message_id)?;
    if state.receipt_retention == 0 {
        return Err(ApiError::ReceiptsOff);
    }
    authorize(&state, &message, &headers)?;
    let now = now_secs();
    let kept = |at: u64| at.saturating_add(state.receipt_retention) > now;
    let found = match (message.settled, message.tag) {
        // Sent, its copy kept by its connection node, which answers for
        // it while it knows it; storage has its row once it moved there.
        (Some(sent), Some(tag)) => {
            let node = match &message.node {
                Some(node) => {
                    let (uaid, sort_key) = (&message.uaid, message.sort_key());
                    state.webpush.kept_receipt(node, uaid, &sort_key, tag).await
                }
                None => KeptReceipt::Unanswered,
            };
            let stored = || look_up(&state, &message, ClientId::Tagged(tag), now);
            match node {
                KeptReceipt::Known(settled, at) => Some((settled, at)),
                // Moved to storage, or its receipt's retention is over.
                KeptReceipt::Unknown => stored().await?,
                KeptReceipt::Unanswered => stored().await?.or(Some(sent)),
            }
        }
        (Some((settled, at)), None) => kept(at).then_some((settled, at)),
        (None, _) => look_up(&state, &message, ClientId::Same(&message_id), now).await?,
    };
    let (settled, updated) = found
        .filter(|(settled, at)| !settled.is_final() || kept(*at))
        .ok_or(ApiError::NotFound)?;
    Ok(warp::reply::json(&json!({"state": settled, "updated": updated})).into_response())
}

/// A message to a v2 subscription: its receipt, and cancelling it
/// (`DELETE`), are for the holder of the subscription's VAPID key alone.
pub(super) fn authorize(
    state: &EndpointState,
    message: &MessageIdInfo,
    headers: &HeaderMap,
) -> ApiResult<()> {
    let Some(expected) = &message.key_hash else {
        return Ok(());
    };
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    state
        .vapid
        .verify_pinned(text("authorization"), text("crypto-key"), Some(expected))
        .map_err(|e| ApiError::InvalidAuthentication(e.to_string()))?
        .ok_or_else(|| {
            ApiError::InvalidAuthentication(
                "this message's subscription is restricted to a VAPID key: sign the request".into(),
            )
        })?;
    Ok(())
}

/// The id a stored row carries when it is the message's: the id asked
/// about, or, for an id sealed after routing, the one its client knows,
/// of which the sealed id holds the tag.
#[derive(Clone, Copy)]
enum ClientId<'a> {
    Same(&'a str),
    Tagged([u8; 8]),
}

impl ClientId<'_> {
    fn is(self, version: &str) -> bool {
        match self {
            ClientId::Same(id) => version == id,
            ClientId::Tagged(tag) => version_tag(version) == tag,
        }
    }

    fn owns(self, receipt: &Receipt) -> bool {
        match self {
            ClientId::Same(id) => receipt.is_for(id),
            ClientId::Tagged(tag) => receipt.has_tag(tag),
        }
    }
}

/// The state and time of the message from its row, if it is still known.
async fn look_up(
    state: &EndpointState,
    message: &MessageIdInfo,
    client_id: ClientId<'_>,
    now: u64,
) -> ApiResult<Option<(MessageState, u64)>> {
    let row = state
        .storage
        .read_message(&message.uaid, &message.sort_key())
        .await?;
    Ok(match row {
        Some(StoredMessage::Settled(receipt)) if client_id.owns(&receipt) => {
            (receipt.expiry > now).then_some((receipt.state, receipt.updated))
        }
        Some(StoredMessage::Pending(pending)) if client_id.is(&pending.version) => {
            if pending.is_expired(now) {
                return Ok(Some((MessageState::Expired, pending.expiry())));
            }
            let user = state.storage.get_user(&message.uaid).await?;
            Some(match user {
                // In a bridged app's mailbox: the upstream took it before
                // the sender got its id; the app has not acked it yet. (A
                // wake-only registration's upstream never sees it: it is
                // `stored` until fetched.)
                Some(user) if user.router_type != RouterType::WebPush && !user.is_wake_only() => {
                    (MessageState::Bridged, pending.timestamp)
                }
                // Below the client's minimum urgency: it waits in storage
                // while the client is connected.
                Some(user) if user.node_id.is_some() && !user.holds(&pending) => (
                    MessageState::Sent,
                    pending.timestamp.max(user.connected_at / 1000),
                ),
                _ => (MessageState::Stored, pending.timestamp),
            })
        }
        other => match own_receipt(state, message, client_id, now).await? {
            Some(found) => Some(found),
            // Another message under a Topic's key and no receipt of this
            // one's own (kept by stores from before Topic receipts had
            // rows of their own): a newer one with the same Topic took its
            // place.
            None => match other {
                Some(StoredMessage::Pending(newer)) if message.topic.is_some() => {
                    Some((MessageState::Replaced, newer.timestamp))
                }
                Some(StoredMessage::Settled(newer)) if message.topic.is_some() => {
                    Some((MessageState::Replaced, newer.updated))
                }
                _ => None,
            },
        },
    })
}

/// A Topic message's receipt, in its row of its own (the Topic's row is
/// the newest message's): settled there, or left there by the message that
/// replaced it.
async fn own_receipt(
    state: &EndpointState,
    message: &MessageIdInfo,
    client_id: ClientId<'_>,
    now: u64,
) -> ApiResult<Option<(MessageState, u64)>> {
    // Only a Topic message has one, and no Topic message is kept.
    let ClientId::Same(message_id) = client_id else {
        return Ok(None);
    };
    let Some(own) = receipt_key(&message.sort_key(), message_id) else {
        return Ok(None);
    };
    Ok(
        match state.storage.read_message(&message.uaid, &own).await? {
            Some(StoredMessage::Settled(receipt)) if receipt.is_for(message_id) => {
                (receipt.expiry > now).then_some((receipt.state, receipt.updated))
            }
            _ => None,
        },
    )
}
