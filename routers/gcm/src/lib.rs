//! The GCM bridge: Android apps that registered through
//! `/v1/gcm/{sender_id}/registration`, as GCM-era clients do. Google shut
//! GCM down; their registration tokens are FCM tokens, so notifications go
//! over FCM HTTP v1 through `autopush-fcm`'s transport. What stays GCM's:
//!
//! * the app id is the sender id (the Firebase project number), returned
//!   as `senderid` in the registration reply;
//! * registrations stored by older servers keep the sender id in
//!   `creds.senderID` instead of `app_id`;
//! * the data GCM-era clients match on: `chid` in hex without dashes (the
//!   form those clients registered channels with), plus `ver` (the message
//!   id), `body`, `con`, `enc` and `cryptokey` as for FCM.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use autopush_common::bridge::AppLimits;
use autopush_common::router::{Delivery, Router, RouterDataInput, RouterError};
use autopush_common::{ApiResult, Notification, User};
use autopush_fcm::message::{android_message, payload_data};
use autopush_fcm::router::{find_app, registration_token, stored_token};
use autopush_fcm::settings::apps_of;
use autopush_fcm::{App, AppSettings, Apps, BridgeSection, Projects};
use serde_json::{Value, json};

/// The GCM bridge's section of the service's settings (flattened into the
/// gateway's): `--gcm-credentials` / `AUTOPUSH_GCM_CREDENTIALS`, or the
/// file's `[gcm.apps.SENDER_ID]` tables.
#[derive(clap::Args, Clone, Default, serde::Deserialize, serde::Serialize)]
pub struct GcmSection {
    /// GCM sender ids as one JSON object: {"SENDER_ID": {"project_id": ..., "credential": ...}};
    /// replaces the settings file's [gcm.apps.*] tables
    #[arg(
        long,
        env = "AUTOPUSH_GCM_CREDENTIALS",
        global = true,
        hide_env_values = true
    )]
    pub gcm_credentials: Option<String>,
    /// The settings file's `[gcm.apps.SENDER_ID]` tables.
    #[arg(skip)]
    pub gcm: Option<BridgeSection>,
}

impl GcmSection {
    /// GCM apps by sender id.
    pub fn apps(&self) -> Result<BTreeMap<String, AppSettings>, String> {
        apps_of(
            "AUTOPUSH_GCM_CREDENTIALS",
            self.gcm_credentials.as_deref(),
            self.gcm.as_ref(),
        )
    }

    /// The GCM bridge, its apps sharing the clients of `projects` with the
    /// FCM bridge's, each within its rate in `limits`; not served without
    /// apps.
    pub fn router(&self, projects: &Projects, limits: &AppLimits) -> Result<GcmRouter, String> {
        let apps = App::configured("gcm", &self.apps()?, projects, limits)?;
        Ok(GcmRouter { apps })
    }
}

/// The credentials are secrets: the apps are shown as [`AppSettings`] shows them.
impl fmt::Debug for GcmSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GcmSection")
            .field("apps", &self.apps())
            .finish()
    }
}

#[derive(Default)]
pub struct GcmRouter {
    /// By sender id.
    apps: Apps,
}

impl GcmRouter {
    /// This router's apps after a reload (see [`App::reloaded`]), and the
    /// refusals by sender id.
    pub fn reloaded(
        &self,
        offered: &BTreeMap<String, Result<AppSettings, String>>,
        projects: &Projects,
        limits: &AppLimits,
    ) -> (GcmRouter, Vec<(String, String)>) {
        let (apps, refused) = App::reloaded("gcm", offered, &self.apps, projects, limits);
        (GcmRouter { apps }, refused)
    }

    /// The apps served, as [`Projects::after`] takes them.
    pub fn apps(&self) -> impl Iterator<Item = &Arc<App>> {
        self.apps.values()
    }

    /// How many sender ids are served.
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

/// The sender id of a registration: `app_id`, or `creds.senderID` in
/// registrations older servers stored.
fn sender_id(router_data: &Value) -> Option<&str> {
    router_data["app_id"]
        .as_str()
        .or_else(|| router_data["creds"]["senderID"].as_str())
}

#[async_trait]
impl Router for GcmRouter {
    fn register(&self, input: &RouterDataInput, sender_id: &str) -> Result<Value, RouterError> {
        if !self.apps.contains_key(sender_id) {
            return Err(RouterError::UnknownApp(sender_id.to_owned()));
        }
        let token = registration_token(input)?;
        Ok(json!({"token": token, "app_id": sender_id}))
    }

    fn amend_endpoint_response(
        &self,
        response: &mut serde_json::Map<String, Value>,
        router_data: &Value,
    ) {
        if let Some(sender_id) = sender_id(router_data) {
            response.insert("senderid".into(), json!(sender_id));
        }
    }

    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        let data = user.router_data.as_ref().unwrap_or(&Value::Null);
        let token = stored_token(data)?;
        let app = find_app(&self.apps, "gcm", sender_id(data))?;
        let chid = notification.channel_id.simple().to_string();
        let mut fields = payload_data(&notification);
        fields.insert("chid", &chid);
        fields.insert("ver", &notification.version);
        app.send(&android_message(token, &notification, &fields)?)
            .await?;
        Ok(Delivery::Direct)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sender_id_is_read_from_either_shape() {
        assert_eq!(
            sender_id(&json!({"token": "t", "app_id": "123"})),
            Some("123")
        );
        let older = json!({"token": "t", "creds": {"senderID": "456", "auth": "x"}});
        assert_eq!(sender_id(&older), Some("456"));
        assert_eq!(sender_id(&json!({"token": "t"})), None);
    }
}
