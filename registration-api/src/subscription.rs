//! Channels of an existing registration: add one, remove one.

use autopush_common::ids::parse_channel_id;
use autopush_common::{ApiError, ApiResult};
use serde_json::{Value, json};

use crate::{Call, RegistrationState, add_channel};

pub async fn subscribe(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    let input = call.input()?;
    let (channel_id, endpoint) = add_channel(state, &user.uaid, &input).await?;
    Ok(json!({"channelID": channel_id.to_string(), "endpoint": endpoint}))
}

pub async fn unsubscribe(
    state: &RegistrationState,
    call: Call,
    uaid: &str,
    channel_id: &str,
) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    let channel_id = parse_channel_id(channel_id).ok_or(ApiError::NoSubscription)?;
    if !state
        .storage
        .remove_channel(&user.uaid, &channel_id)
        .await?
    {
        return Err(ApiError::NoSubscription);
    }
    Ok(json!({}))
}
