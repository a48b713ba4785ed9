//! The FCM router: registrations through `/v1/fcm/{app_id}/registration`,
//! notifications delivered as FCM HTTP v1 data messages.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use autopush_common::bridge::AppLimits;
use autopush_common::router::{Delivery, Router, RouterDataInput, RouterError, WakeUp};
use autopush_common::{ApiResult, Notification, User};
use serde_json::{Value, json};

use crate::message::{android_message, payload_data, wake_message};
use crate::settings::{AppSettings, FcmSection};
use crate::transport::{App, Apps, Projects};

/// Longest registration token accepted (FCM's are about 160 characters).
const MAX_TOKEN_LEN: usize = 1024;

#[derive(Default)]
pub struct FcmRouter {
    apps: Apps,
}

impl FcmRouter {
    /// This router's apps after a reload (see [`App::reloaded`]), and the
    /// refusals by app name.
    pub fn reloaded(
        &self,
        offered: &BTreeMap<String, Result<AppSettings, String>>,
        projects: &Projects,
        limits: &AppLimits,
    ) -> (FcmRouter, Vec<(String, String)>) {
        let (apps, refused) = App::reloaded("fcm", offered, &self.apps, projects, limits);
        (FcmRouter { apps }, refused)
    }

    /// The apps served, as [`Projects::after`] takes them.
    pub fn apps(&self) -> impl Iterator<Item = &Arc<App>> {
        self.apps.values()
    }

    /// How many apps are served.
    pub fn len(&self) -> usize {
        self.apps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.apps.is_empty()
    }

    /// The names of what is served, in no order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.apps.keys().map(String::as_str)
    }
}

impl FcmSection {
    /// The FCM bridge, its apps sharing the clients of `projects` with the
    /// GCM bridge's, each within its rate in `limits`; not served without
    /// apps.
    pub fn router(&self, projects: &Projects, limits: &AppLimits) -> Result<FcmRouter, String> {
        let apps = App::configured("fcm", &self.apps()?, projects, limits)?;
        Ok(FcmRouter { apps })
    }
}

#[async_trait]
impl Router for FcmRouter {
    fn register(&self, input: &RouterDataInput, app_id: &str) -> Result<Value, RouterError> {
        if !self.apps.contains_key(app_id) {
            return Err(RouterError::UnknownApp(app_id.to_owned()));
        }
        let token = registration_token(input)?;
        Ok(json!({"token": token, "app_id": app_id}))
    }

    /// autopush's FCM replies carry the app id as `senderid`.
    fn amend_endpoint_response(
        &self,
        response: &mut serde_json::Map<String, Value>,
        router_data: &Value,
    ) {
        if let Some(app_id) = router_data["app_id"].as_str() {
            response.insert("senderid".into(), json!(app_id));
        }
    }

    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        let data = user.router_data.as_ref().unwrap_or(&Value::Null);
        let (token, app_id) = (stored_token(data)?, data["app_id"].as_str());
        let app = find_app(&self.apps, "fcm", app_id)?;
        let chid = notification.channel_id.hyphenated().to_string();
        let mut fields = payload_data(&notification);
        fields.insert("chid", &chid);
        fields.insert("ver", &notification.version);
        app.send(&android_message(token, &notification, &fields)?)
            .await?;
        Ok(Delivery::Direct)
    }

    fn check_wake_route(&self, app_id: &str, token: &str) -> Result<(), RouterError> {
        if !self.apps.contains_key(app_id) {
            return Err(RouterError::UnknownApp(app_id.to_owned()));
        }
        check_token(token).map(drop)
    }

    async fn wake(&self, app_id: &str, token: &str, wake: &WakeUp) -> Result<(), RouterError> {
        let app = self
            .apps
            .get(app_id)
            .ok_or_else(|| RouterError::UnknownApp(app_id.to_owned()))?;
        app.send(&wake_message(token, wake)).await
    }
}

/// The registration token a client registers with: present, and made of
/// the characters FCM tokens use, at a sane length.
pub fn registration_token(input: &RouterDataInput) -> Result<&str, RouterError> {
    let token = input
        .token
        .as_deref()
        .ok_or_else(|| RouterError::InvalidRegistration("token is required".into()))?;
    check_token(token)
}

/// A registration token made of the characters FCM tokens use, at a sane
/// length.
fn check_token(token: &str) -> Result<&str, RouterError> {
    if token.is_empty() || token.len() > MAX_TOKEN_LEN {
        return Err(RouterError::InvalidRegistration(format!(
            "token must be 1 to {MAX_TOKEN_LEN} characters"
        )));
    }
    if !token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b':' | b'.'))
    {
        return Err(RouterError::InvalidRegistration(
            "token may hold only letters, digits, '-', '_', ':' and '.'".into(),
        ));
    }
    Ok(token)
}

/// The device token of a stored registration; none left means the device
/// cannot be reached (410).
pub fn stored_token(router_data: &Value) -> Result<&str, RouterError> {
    router_data["token"]
        .as_str()
        .filter(|t| !t.is_empty())
        .ok_or(RouterError::DeviceGone)
}

/// The app a registration names: one this server no longer configures is
/// our fault, not the device's (502, and the registration is kept).
pub fn find_app<'a>(
    apps: &'a Apps,
    bridge: &str,
    app_id: Option<&str>,
) -> Result<&'a App, RouterError> {
    let app_id = app_id.unwrap_or_default();
    apps.get(app_id).map(|app| &**app).ok_or_else(|| {
        tracing::error!(
            bridge,
            app_id,
            "a registration names an app this server has no settings for"
        );
        RouterError::Upstream(format!(
            "no {bridge} app {app_id:?} is configured on this server"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(token: Option<&str>) -> RouterDataInput {
        RouterDataInput {
            token: token.map(str::to_owned),
            ..RouterDataInput::default()
        }
    }

    #[test]
    fn registration_tokens_are_checked() {
        let fcm_like = "dXk3Yj:APA91bH-x_y.z";
        assert_eq!(registration_token(&input(Some(fcm_like))), Ok(fcm_like));
        for bad in [None, Some(""), Some("has space"), Some("semi;colon")] {
            assert!(matches!(
                registration_token(&input(bad)),
                Err(RouterError::InvalidRegistration(_))
            ));
        }
        let long = "a".repeat(MAX_TOKEN_LEN + 1);
        assert!(registration_token(&input(Some(&long))).is_err());
    }

    #[test]
    fn a_registration_without_a_token_is_gone() {
        assert_eq!(
            stored_token(&json!({"app_id": "a"})),
            Err(RouterError::DeviceGone)
        );
        assert_eq!(stored_token(&json!({"token": "t"})), Ok("t"));
    }
}
