//! Calls on an existing registration: update its bridge token (`PUT`), list
//! its channels (`GET`, which also marks it alive), remove it (`DELETE`).

use autopush_common::ApiResult;
use autopush_common::time::now_millis;
use serde_json::{Value, json};

use crate::{Call, RegistrationState};

pub async fn update_token(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let mut user = call.authorized_user(state, uaid).await?;
    let input = call.input()?;
    user.router_data = Some(call.router_data(&input)?);
    state.storage.add_user(&user).await?;
    Ok(json!({}))
}

pub async fn channels(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let mut user = call.authorized_user(state, uaid).await?;
    let mut channels: Vec<String> = state
        .storage
        .get_channels(&user.uaid)
        .await?
        .iter()
        .map(|c| c.to_string())
        .collect();
    channels.sort();
    user.last_connect = now_millis();
    state.storage.add_user(&user).await?;
    Ok(json!({"uid": user.uaid.simple().to_string(), "channelIDs": channels}))
}

pub async fn unregister_user(
    state: &RegistrationState,
    call: Call,
    uaid: &str,
) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    state.storage.remove_user(&user.uaid).await?;
    Ok(json!({}))
}
