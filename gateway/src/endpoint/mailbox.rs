//! The sender's side of a bridge registration's mailbox (see
//! `autopush_registration::mailbox` for the app's side): a push to an app
//! with a mailbox is stored before it goes upstream, so that however the
//! upstream coalesces or drops, the app's next fetch gets it; the upstream
//! push is the wake-up.

use autopush_common::{ApiError, ApiResult, Notification, User};
use tracing::warn;

use super::EndpointState;

/// Store `notification` in `user`'s mailbox, unless it is full (429).
/// Costs one more storage request per push (the count) besides the write.
pub async fn keep(
    state: &EndpointState,
    user: &User,
    notification: &Notification,
) -> ApiResult<()> {
    let limit = state.registration.mailbox_limit;
    if state.storage.count_messages(&user.uaid, limit).await? >= limit {
        return Err(ApiError::MailboxFull(limit));
    }
    state
        .storage
        .save_messages(&user.uaid, vec![notification.clone()])
        .await?;
    Ok(())
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
