//! The bound on messages held below a user agent's minimum urgency.
//!
//! Held messages are never sent while held, so they are not what
//! `--msg-limit` resets a user agent for (a client sent what fit and still
//! behind): they have a bound of their own, as many again, per user agent.
//! Anyone holding one of its endpoints could fill it, so a full hold costs
//! the subscription holding the most, and no other: a push from it is
//! refused (`429`), and a push from any other subscription takes the place
//! of that one's oldest held message, whose receipt then reads `dropped`.
//! However hard one sender pushes, each other subscription keeps an equal
//! share.

use std::collections::HashMap;

use autopush_common::receipt::MessageState;
use autopush_common::{ApiError, ApiResult, Notification, RouterType, User, metrics};
use autopush_storage::Storage;
use tracing::info;
use uuid::Uuid;

/// Make room for `notification`, below `user`'s minimum, among at most
/// `limit` held messages: `Ok` when it may be stored. Costs one count per
/// held push, and a read of the stored messages when the hold is full.
pub async fn make_room(
    storage: &dyn Storage,
    user: &User,
    notification: &Notification,
    limit: usize,
) -> ApiResult<()> {
    let uaid = user.uaid;
    // Fewer stored messages than the bound: fewer held ones.
    if storage.count_messages(&uaid, limit).await? < limit {
        return Ok(());
    }
    // Those awaiting delivery come with them: read twice the bound.
    let stored = storage
        .fetch_messages(&uaid, limit.saturating_mul(2))
        .await?;
    let held: Vec<&Notification> = stored.iter().filter(|m| user.holds(m)).collect();
    let replaced =
        |m: &&Notification| notification.topic.is_some() && m.sort_key() == notification.sort_key();
    if held.len() < limit || held.iter().any(replaced) {
        return Ok(());
    }
    let mut per_channel: HashMap<Uuid, usize> = HashMap::new();
    for message in &held {
        *per_channel.entry(message.channel_id).or_default() += 1;
    }
    let own = per_channel
        .get(&notification.channel_id)
        .copied()
        .unwrap_or(0);
    let Some((&heaviest, &most)) = per_channel.iter().max_by_key(|(_, n)| **n) else {
        return Ok(());
    };
    if own >= most {
        return Err(ApiError::HoldFull {
            held: held.len(),
            bound: limit,
        });
    }
    let Some(oldest) = held
        .iter()
        .filter(|m| m.channel_id == heaviest)
        .min_by_key(|m| m.sortkey_timestamp)
    else {
        return Ok(());
    };
    // Delivered or replaced meanwhile: the room is made all the same.
    if storage
        .settle_message(
            &uaid,
            &oldest.sort_key(),
            &oldest.version,
            MessageState::Dropped,
        )
        .await?
    {
        metrics::final_state(RouterType::WebPush, MessageState::Dropped);
        info!(
            "held messages at their bound: the oldest of the subscription holding the most dropped"
        );
    }
    Ok(())
}
