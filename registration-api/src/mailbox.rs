//! The mailbox of a bridge registration that asked for one (`"mailbox":
//! true` in its registration body): its messages are kept until the app
//! acks them here, whatever APNs or FCM did with the push (APNs keeps only
//! the last notification for an offline device; FCM drops a backlog past
//! 100), so the app's next fetch still gets every one.
//!
//! * `GET .../registration/{uaid}/messages[?limit=N&after=CURSOR]`: pending
//!   messages, oldest first, `limit` (default and most [`PAGE`]) a page,
//!   with `next` the cursor of the following page (`null` on the last).
//!   For a wake-only registration (`"wake_only": true`, whose upstream
//!   pushes are wake-ups), a listing answers the wake-ups sent so far, as a
//!   websocket client's hello does: the next message wakes the app again.
//! * `DELETE .../registration/{uaid}/messages/{id}`: ack one message (its
//!   `id`, the `ver` the bridge payload carried), conditional on that
//!   version: a newer message that replaced it under the same Topic stays.
//!   One message a call: an ack is one conditional write, as a websocket
//!   client's is, and an app acks what it has processed.

use autopush_common::bridge::web_push_fields;
use autopush_common::receipt::MessageState;
use autopush_common::user::WAKE_ANSWERED;
use autopush_common::{ApiError, ApiResult, Notification, metrics};
use serde_json::{Value, json};

use crate::{Call, RegistrationState};

/// Most messages one page lists.
pub const PAGE: usize = 100;

pub async fn list(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    if !user.has_mailbox() {
        return Err(ApiError::NotFound);
    }
    let (limit, after) = page_query(&call.query)?;
    if user.is_wake_only() && user.last_wake > WAKE_ANSWERED {
        // A listing answers the wake-ups so far. Marked before reading, so
        // a message stored after this read finds the mark and wakes the
        // app again. A wake-up sent since the record was read wins: the
        // app answers that one next.
        state
            .storage
            .claim_wake(&user.uaid, user.last_wake, WAKE_ANSWERED)
            .await?;
    }
    // The mailbox holds at most `mailbox_limit` messages: read them all,
    // then order and page them here.
    let mut messages = state
        .storage
        .fetch_messages(&user.uaid, state.mailbox_limit)
        .await?;
    messages.sort_by_key(|m| m.sortkey_timestamp);
    let pending: Vec<&Notification> = messages
        .iter()
        .filter(|m| after.is_none_or(|after| m.sortkey_timestamp > Some(after)))
        .collect();
    let page = &pending[..pending.len().min(limit)];
    let next = (pending.len() > page.len())
        .then(|| page.last().and_then(|m| m.sortkey_timestamp))
        .flatten();
    Ok(json!({
        "messages": page.iter().map(|m| listed(m)).collect::<Vec<_>>(),
        "next": next.map(|n| n.to_string()),
    }))
}

pub async fn ack(state: &RegistrationState, call: Call, uaid: &str, id: &str) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    if !user.has_mailbox() {
        return Err(ApiError::NotFound);
    }
    let message = state.crypto.parse_message_id(id)?;
    if message.uaid != user.uaid {
        return Err(ApiError::InvalidMessageId);
    }
    let acked = state
        .storage
        .settle_message(&user.uaid, &message.sort_key(), id, MessageState::Fetched)
        .await?;
    if !acked {
        return Err(ApiError::NotFound);
    }
    metrics::final_state(user.router_type, MessageState::Fetched);
    Ok(json!({}))
}

/// One listed message: the fields of the bridge payload, its TTL and when
/// it was received (unix seconds).
fn listed(message: &Notification) -> Value {
    let mut fields = json!({
        "chid": message.channel_id.to_string(),
        "ver": message.version,
        "ttl": message.ttl,
        "received": message.timestamp,
    });
    if let Some(object) = fields.as_object_mut() {
        for (key, value) in web_push_fields(message) {
            object.insert(key.into(), value.into());
        }
        if let Some(topic) = &message.topic {
            object.insert("topic".into(), topic.clone().into());
        }
    }
    fields
}

/// `limit` and `after` from a query string.
fn page_query(query: &str) -> ApiResult<(usize, Option<u64>)> {
    let (mut limit, mut after) = (PAGE, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let bad = || ApiError::BadRequest(format!("bad query parameter {pair:?}"));
        match pair.split_once('=').ok_or_else(bad)? {
            ("limit", n) => limit = n.parse::<usize>().map_err(|_| bad())?.clamp(1, PAGE),
            ("after", cursor) => after = Some(cursor.parse().map_err(|_| bad())?),
            _ => return Err(bad()),
        }
    }
    Ok((limit, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_queries_are_bounded_and_strict() {
        assert_eq!(page_query("").unwrap(), (PAGE, None));
        assert_eq!(page_query("limit=2&after=17").unwrap(), (2, Some(17)));
        assert_eq!(page_query("limit=100000").unwrap(), (PAGE, None));
        assert_eq!(page_query("limit=0").unwrap(), (1, None));
        for bad in ["limit=x", "after=-1", "cursor=1", "limit"] {
            assert!(page_query(bad).is_err(), "{bad}");
        }
    }
}
