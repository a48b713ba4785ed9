//! `DELETE /m/{message_id}`: cancel a push that has not been delivered yet.
//!
//! A message id names one message. If a newer push with the same `Topic`
//! has replaced it, the old id cancels nothing: the newer message stays
//! (cancel it with its own id). The answer is 204 either way, as autopush's,
//! except for a message past its TTL: expired is final, so there is nothing
//! to cancel (404 errno 102) and its receipt stays `expired`. A cancelled
//! message's receipt says `deleted`. A message to a VAPID-restricted (v2)
//! subscription is cancelled only with a VAPID signature by the key of its
//! push, as its receipt is read (else `401`/109): its URL alone does not
//! prove who sent it.

use std::sync::Arc;

use autopush_common::ids::uaid_tag;
use autopush_common::receipt::MessageState;
use autopush_common::time::now_secs;
use autopush_common::{ApiError, ApiResult, RouterType, metrics};
use autopush_storage::StoredMessage;
use tracing::debug;
use uuid::Uuid;
use warp::http::{HeaderMap, StatusCode};
use warp::reply::{Reply, Response};

use super::EndpointState;
use super::receipt::authorize;

pub async fn cancel(
    state: Arc<EndpointState>,
    message_id: String,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let message = state.crypto.parse_message_id(&message_id)?;
    authorize(&state, &message, &headers)?;
    let sort_key = message.sort_key();
    let existed = state
        .storage
        .settle_message(&message.uaid, &sort_key, &message_id, MessageState::Deleted)
        .await?;
    if existed {
        // Rare enough to read whose it was: a webpush client's, or a
        // bridged app's mailbox.
        let user = state.storage.get_user(&message.uaid).await.ok().flatten();
        let router_type = user.map_or(RouterType::WebPush, |u| u.router_type);
        metrics::final_state(router_type, MessageState::Deleted);
    } else if expired(&state, &message.uaid, &sort_key, &message_id).await? {
        return Err(ApiError::NotFound);
    }
    debug!(uaid = %uaid_tag(&message.uaid), existed, "message cancelled");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Whether the row under `sort_key` is message `version` past its TTL
/// (what a settle refuses, leaving the row for its `expired` receipt).
async fn expired(
    state: &EndpointState,
    uaid: &Uuid,
    sort_key: &str,
    version: &str,
) -> ApiResult<bool> {
    let row = state.storage.read_message(uaid, sort_key).await?;
    Ok(
        matches!(row, Some(StoredMessage::Pending(m)) if m.version == version && m.is_expired(now_secs())),
    )
}
