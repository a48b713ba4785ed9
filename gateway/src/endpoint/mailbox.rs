//! The sender's side of a bridge registration's mailbox (see
//! `autopush_registration::mailbox` for the app's side): a push to an app
//! with a mailbox is stored before it goes upstream, so that however the
//! upstream coalesces or drops, the app's next fetch gets it; the upstream
//! push is the wake-up. A wake-only registration's messages go nowhere
//! else: its device gets the content-free wake-ups of the
//! [`Waker`](autopush_webpush::Waker).

use autopush_common::router::Delivery;
use autopush_common::time::now_secs;
use autopush_common::{ApiError, ApiResult, Notification, User};
use autopush_storage::StoredMessage;
use autopush_webpush::wake::wake_up_for;
use tracing::warn;

use super::EndpointState;

/// Store `notification` in `user`'s mailbox, unless it is full (429) and
/// the message would not just replace one with its Topic. Costs one more
/// storage request per push (the count) besides the write, and a point
/// read for a Topic message to a full mailbox.
pub async fn keep(
    state: &EndpointState,
    user: &User,
    notification: &Notification,
) -> ApiResult<()> {
    let limit = state.registration.mailbox_limit;
    if state.storage.count_messages(&user.uaid, limit).await? >= limit
        && !replaces_one(state, user, notification).await?
    {
        return Err(ApiError::MailboxFull(limit));
    }
    state
        .storage
        .save_messages(&user.uaid, vec![notification.clone()])
        .await?;
    Ok(())
}

/// A push to a wake-only registration: kept in its mailbox, and its device
/// woken by the websocket clients' rule (at most one wake-up per
/// `--wake-interval` until the app lists its mailbox), on a task of its
/// own. TTL 0 is dropped: no app fetches it in time.
pub async fn keep_and_wake(
    state: &EndpointState,
    user: &User,
    notification: &Notification,
) -> ApiResult<Delivery> {
    if notification.ttl == 0 {
        return Ok(Delivery::Dropped);
    }
    keep(state, user, notification).await?;
    // Read again after storing: if the app listed its mailbox since the
    // first read, that listing may have missed this message, and the
    // record now says the last wake-up was answered.
    if let Some(now) = state.storage.get_user(&user.uaid).await? {
        state.waker.after_stored(&now, wake_up_for(notification));
    }
    Ok(Delivery::Stored)
}

/// Whether `notification` has a Topic and a pending message with that
/// Topic is in the mailbox: storing it replaces that one.
async fn replaces_one(
    state: &EndpointState,
    user: &User,
    notification: &Notification,
) -> ApiResult<bool> {
    if notification.topic.is_none() {
        return Ok(false);
    }
    let stored = state
        .storage
        .read_message(&user.uaid, &notification.sort_key())
        .await?;
    Ok(matches!(stored, Some(StoredMessage::Pending(m)) if !m.is_expired(now_secs())))
}

/// The upstream refused a message kept in the mailbox: the sender hears an
/// error and sends again, so this copy goes (only this version).
pub async fn forget(state: &EndpointState, user: &User, sort_key: &str, version: &str) {
    if let Err(e) = state
        .storage
        .remove_message(&user.uaid, sort_key, version)
        .await
    {
        warn!(error = %e, "could not remove a refused message from its mailbox");
    }
}
