//! `POST /v1/{type}/{app_id}/registration`: a new user with its first channel.

use autopush_common::ApiResult;
use autopush_common::User;
use autopush_common::ids::uaid_tag;
use autopush_common::time::now_millis;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{Call, RegistrationState, add_channel};

pub async fn new_user(state: &RegistrationState, call: Call) -> ApiResult<Value> {
    let input = call.input()?;
    let router_data = call.router_data(&input, None)?;
    let now = now_millis();
    let uaid = Uuid::new_v4();
    let user = User {
        uaid,
        router_type: call.router_type,
        router_data: Some(router_data.clone()),
        node_id: None,
        connected_at: now,
        last_connect: now,
        over_msg_limit: false,
        current_month: None,
        min_urgency: autopush_common::Urgency::VeryLow,
        wake_route: None,
        last_wake: 0,
    };
    state.storage.add_user(&user).await?;
    let (channel_id, endpoint) = add_channel(state, &uaid, &input).await?;
    let mut reply = json!({
        "uaid": uaid.simple().to_string(),
        "secret": state.secrets.secret(&uaid),
        "endpoint": endpoint,
        "channelID": channel_id.to_string(),
    });
    if let Some(object) = reply.as_object_mut() {
        call.router.amend_endpoint_response(object, &router_data);
    }
    tracing::info!(uaid = %uaid_tag(&uaid), router = call.router_type.as_str(), app_id = %call.app_id, "bridge user registered");
    Ok(reply)
}
