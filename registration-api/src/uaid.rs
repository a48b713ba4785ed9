//! Calls on an existing registration: update its bridge token (`PUT`), list
//! its channels (`GET`, which also marks it alive), remove it (`DELETE`).

use autopush_common::time::now_millis;
use autopush_common::{ApiError, ApiResult};
use serde_json::{Value, json};

use crate::{Call, RegistrationState};

/// Token updates racing for one registration each try again on what the
/// other wrote, this many times at most.
const UPDATE_TRIES: usize = 3;

pub async fn update_token(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let input = call.input()?;
    for _ in 0..UPDATE_TRIES {
        // Read again on each try: the registration may have been removed
        // (404/410), or another update may have landed.
        let user = call.authorized_user(state, uaid).await?;
        let router_data = call.router_data(&input, Some(&user))?;
        if state
            .storage
            .set_router_data(&user.uaid, user.router_data.as_ref(), &router_data)
            .await?
        {
            return Ok(json!({}));
        }
    }
    Err(ApiError::Storage(
        "the registration kept changing while being updated".into(),
    ))
}

pub async fn channels(state: &RegistrationState, call: Call, uaid: &str) -> ApiResult<Value> {
    let user = call.authorized_user(state, uaid).await?;
    let mut channels: Vec<String> = state
        .storage
        .get_channels(&user.uaid)
        .await?
        .iter()
        .map(|c| c.to_string())
        .collect();
    channels.sort();
    if !state.storage.touch_user(&user.uaid, now_millis()).await? {
        return Err(ApiError::NoUser);
    }
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
