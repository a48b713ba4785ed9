//! The bridge registration API (the seeds' "Push Service Bridge HTTP
//! Interface"), used by mobile apps that receive pushes through APNs or FCM
//! and by webpush clients that register over HTTP:
//!
//! | call | module |
//! |---|---|
//! | `POST /v1/{type}/{app_id}/registration` | [`register`] |
//! | `PUT`, `GET`, `DELETE .../registration/{uaid}` | [`uaid`] |
//! | `POST .../registration/{uaid}/subscription`, `DELETE .../subscription/{chid}` | [`subscription`] |
//! | `GET .../registration/{uaid}/messages`, `DELETE .../messages/{id}` | [`mailbox`] |
//!
//! Every call but the first needs `Authorization: Bearer {secret}`, the
//! secret the first call returned ([`auth`]).

pub mod auth;
pub mod mailbox;
pub mod register;
pub mod subscription;
pub mod uaid;

use std::sync::Arc;

use autopush_common::endpoint::EndpointCrypto;
use autopush_common::ids::{decode_vapid_key, parse_channel_id};
use autopush_common::router::{Router, RouterDataInput, RouterError, RouterRegistry};
use autopush_common::user::{MAILBOX, WAKE_ONLY};
use autopush_common::{ApiError, ApiResult, RouterType, User};
use autopush_storage::Storage;
use http::{HeaderMap, Method};
use uuid::Uuid;

pub use auth::SecretKeys;

/// What the registration handlers share.
pub struct RegistrationState {
    pub storage: Arc<dyn Storage>,
    pub crypto: Arc<EndpointCrypto>,
    pub routers: RouterRegistry,
    pub secrets: SecretKeys,
    /// Most channels one UAID may subscribe.
    pub max_channels: usize,
    /// Most messages a bridge registration's mailbox holds (`--msg-limit`).
    pub mailbox_limit: usize,
}

/// One `/v1/...` request, resolved to its router.
pub struct Call {
    pub router_type: RouterType,
    pub router: Arc<dyn Router>,
    pub app_id: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// The query string, without `?` (empty when none).
    pub query: String,
}

/// Largest registration body accepted.
pub const MAX_BODY: usize = 16 * 1024;

/// What follows `registration` in a `/v1` URL: the path's segments and the
/// query string (without `?`, empty when none).
#[derive(Clone, Copy, Debug, Default)]
pub struct Target<'a> {
    pub path: &'a [&'a str],
    pub query: &'a str,
}

/// Serve `{method} /v1/{router_type}/{app_id}/registration/{path...}?{query}`.
pub async fn handle(
    state: &RegistrationState,
    method: Method,
    router_type: &str,
    app_id: String,
    target: Target<'_>,
    headers: HeaderMap,
    body: Vec<u8>,
) -> ApiResult<serde_json::Value> {
    // An unknown or unconfigured router type is 400/108.
    let router_type = RouterType::from_path(router_type).ok_or(ApiError::InvalidRouterType)?;
    let router = state
        .routers
        .get(router_type)
        .ok_or(ApiError::InvalidRouterType)?
        .clone();
    let call = Call {
        router_type,
        router,
        app_id,
        headers,
        body,
        query: target.query.to_owned(),
    };
    match (method, target.path) {
        (Method::POST, []) => register::new_user(state, call).await,
        (Method::PUT, [uaid]) => uaid::update_token(state, call, uaid).await,
        (Method::GET, [uaid]) => uaid::channels(state, call, uaid).await,
        (Method::DELETE, [uaid]) => uaid::unregister_user(state, call, uaid).await,
        (Method::POST, [uaid, "subscription"]) => subscription::subscribe(state, call, uaid).await,
        (Method::DELETE, [uaid, "subscription", chid]) => {
            subscription::unsubscribe(state, call, uaid, chid).await
        }
        (Method::GET, [uaid, "messages"]) => mailbox::list(state, call, uaid).await,
        (Method::DELETE, [uaid, "messages", id]) => mailbox::ack(state, call, uaid, id).await,
        _ => Err(ApiError::NotFound),
    }
}

/// A request body as registration input; an empty body is `{}`.
pub fn parse_body(body: &[u8]) -> ApiResult<RouterDataInput> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(RouterDataInput::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("the body is not valid JSON: {e}")))
}

impl Call {
    /// The body as registration input; an empty body is `{}`.
    pub fn input(&self) -> ApiResult<RouterDataInput> {
        parse_body(&self.body)
    }

    /// Authenticate the caller for `uaid` and load its record, which must
    /// belong to this router type and app.
    pub async fn authorized_user(&self, state: &RegistrationState, uaid: &str) -> ApiResult<User> {
        let uaid = Uuid::parse_str(uaid).map_err(|_| ApiError::NotFound)?;
        state.secrets.check(&uaid, &self.headers)?;
        let user = state
            .storage
            .get_user(&uaid)
            .await?
            .ok_or(ApiError::NoUser)?;
        let app_id = user
            .router_data
            .as_ref()
            .and_then(|d| d.get("app_id"))
            .and_then(|a| a.as_str());
        if user.router_type != self.router_type || app_id.is_some_and(|a| a != self.app_id) {
            return Err(ApiError::NotFound);
        }
        Ok(user)
    }

    /// Ask the router to validate `input`, and note the app it belongs to,
    /// whether it keeps a mailbox (`input.mailbox`, else as `before`) and
    /// whether its upstream pushes are wake-ups only (`input.wake_only`,
    /// else as `before`).
    pub fn router_data(
        &self,
        input: &RouterDataInput,
        before: Option<&User>,
    ) -> ApiResult<serde_json::Value> {
        let mailbox = input
            .mailbox
            .unwrap_or_else(|| before.is_some_and(User::has_mailbox));
        let wake_only = input
            .wake_only
            .unwrap_or_else(|| before.is_some_and(User::is_wake_only));
        if wake_only && !mailbox {
            return Err(ApiError::BadRequest(
                "\"wake_only\": true needs \"mailbox\": true: the app fetches from its \
                 mailbox the messages its wake-ups announce"
                    .into(),
            ));
        }
        if mailbox && self.router_type == RouterType::WebPush {
            return Err(ApiError::BadRequest(
                "a mailbox is for APNs, FCM and GCM registrations: webpush clients fetch \
                 their stored messages when they connect"
                    .into(),
            ));
        }
        let mut data = self.router.register(input, &self.app_id)?;
        if wake_only {
            self.check_wakes(&data)?;
        }
        if let Some(object) = data.as_object_mut() {
            object.insert("app_id".into(), self.app_id.clone().into());
            if mailbox {
                object.insert(MAILBOX.into(), true.into());
            }
            if wake_only {
                object.insert(WAKE_ONLY.into(), true.into());
            }
        }
        Ok(data)
    }

    /// A wake-only registration needs a bridge that sends wake-ups to its
    /// device (APNs, FCM).
    fn check_wakes(&self, data: &serde_json::Value) -> ApiResult<()> {
        let token = data.get("token").and_then(|t| t.as_str()).unwrap_or("");
        self.router
            .check_wake_route(&self.app_id, token)
            .map_err(|e| match e {
                RouterError::UnknownApp(_) => ApiError::BadRequest(format!(
                    "\"wake_only\" is for APNs and FCM registrations: {} sends no wake-ups",
                    self.router_type.as_str()
                )),
                other => other.into(),
            })
    }
}

/// Subscribe a channel (the given one or a new one) and return its endpoint.
pub async fn add_channel(
    state: &RegistrationState,
    uaid: &Uuid,
    input: &RouterDataInput,
) -> ApiResult<(Uuid, String)> {
    let channel_id = match &input.channel_id {
        None => Uuid::new_v4(),
        Some(chid) => parse_channel_id(chid).ok_or_else(|| {
            ApiError::BadRequest("channelID must be a lowercase dashed UUID".into())
        })?,
    };
    let key = match &input.key {
        None => None,
        Some(key) => Some(decode_vapid_key(key).ok_or_else(|| {
            ApiError::BadRequest("key must be an uncompressed P-256 public key in base64url".into())
        })?),
    };
    if !state
        .storage
        .add_channel(uaid, &channel_id, state.max_channels)
        .await?
    {
        return Err(ApiError::BadRequest(format!(
            "too many subscriptions: at most {} per registration",
            state.max_channels
        )));
    }
    Ok((
        channel_id,
        state
            .crypto
            .make_endpoint(uaid, &channel_id, key.as_deref()),
    ))
}
