//! A bridge router test double and an in-process service that has it in its
//! router registry, for testing the registry and the `/v1` registration API
//! without a real APNs or FCM.
//!
//! The service is the real gateway code ([`autopush_gateway::app::start`])
//! serving real HTTP on loopback; only the bridge behind it is a double.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use autopush_common::router::{Delivery, Router, RouterDataInput, RouterError, RouterRegistry};
use autopush_common::{ApiResult, Notification, RouterType, User};
use autopush_gateway::app::{self, Mode, Running};
use autopush_gateway::settings::{Settings, SettingsLayer};
use serde_json::{Value, json};

/// Device tokens the double treats specially when routing.
pub const GONE_TOKEN: &str = "device-that-uninstalled-the-app";
pub const TIMEOUT_TOKEN: &str = "device-behind-a-slow-bridge";

/// What the double was asked to deliver.
#[derive(Clone, Debug)]
pub struct Routed {
    pub notification: Notification,
    pub user: User,
}

/// A bridge configured for a fixed set of app ids. Registration needs a
/// `token`; routing records the notification, or fails for special tokens.
pub struct TestRouter {
    apps: Vec<String>,
    routed: Mutex<Vec<Routed>>,
}

impl TestRouter {
    pub fn new(apps: &[&str]) -> Arc<Self> {
        Arc::new(TestRouter {
            apps: apps.iter().map(|a| a.to_string()).collect(),
            routed: Mutex::new(Vec::new()),
        })
    }

    pub fn routed(&self) -> Vec<Routed> {
        self.routed.lock().unwrap().clone()
    }
}

#[async_trait]
impl Router for TestRouter {
    fn register(&self, input: &RouterDataInput, app_id: &str) -> Result<Value, RouterError> {
        if !self.apps.iter().any(|a| a == app_id) {
            return Err(RouterError::UnknownApp(app_id.to_owned()));
        }
        let token = input.token.as_deref().filter(|t| !t.is_empty());
        let token =
            token.ok_or_else(|| RouterError::InvalidRegistration("token is required".into()))?;
        Ok(json!({"token": token}))
    }

    fn amend_endpoint_response(
        &self,
        response: &mut serde_json::Map<String, Value>,
        _router_data: &Value,
    ) {
        response.insert("senderid".into(), json!("test-sender"));
    }

    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        let token = user
            .router_data
            .as_ref()
            .and_then(|d| d["token"].as_str())
            .unwrap_or_default();
        match token {
            GONE_TOKEN => Err(RouterError::DeviceGone.into()),
            TIMEOUT_TOKEN => Err(RouterError::Timeout.into()),
            _ => {
                self.routed.lock().unwrap().push(Routed {
                    notification,
                    user: user.clone(),
                });
                Ok(Delivery::Direct)
            }
        }
    }
}

/// The gateway, in this process, with `router` registered as the FCM bridge.
pub struct BridgeService {
    _running: Running,
    _dir: tempfile::TempDir,
    endpoint_base: String,
    router_base: String,
    ws_url: String,
}

impl BridgeService {
    pub async fn start(router: Arc<TestRouter>) -> BridgeService {
        let dir = tempfile::tempdir().expect("temp dir");
        let [port, router_port, endpoint_port] = crate::server::free_ports::<3>();
        let endpoint_base = format!("http://127.0.0.1:{endpoint_port}");
        let layer = SettingsLayer {
            host: Some("127.0.0.1".into()),
            port: Some(port),
            router_port: Some(router_port),
            endpoint_port: Some(endpoint_port),
            endpoint_url: Some(endpoint_base.clone()),
            db: Some(dir.path().display().to_string()),
            ..SettingsLayer::default()
        };
        let settings = Settings::resolve(layer, None).expect("settings");
        let bridges = RouterRegistry::default().with(RouterType::Fcm, router);
        let running = app::start(Mode::All, &settings, bridges)
            .await
            .expect("start the service");
        BridgeService {
            _running: running,
            _dir: dir,
            endpoint_base,
            router_base: format!("http://127.0.0.1:{router_port}"),
            ws_url: format!("ws://127.0.0.1:{port}/"),
        }
    }

    /// The internal router API base (which also serves `/metrics`).
    pub fn router_base(&self) -> &str {
        &self.router_base
    }

    pub fn ws_url(&self) -> &str {
        &self.ws_url
    }

    /// `{endpoint_base}/v1/{router_type}/{app_id}/registration{path}`.
    pub fn registration_url(&self, router_type: &str, app_id: &str, path: &str) -> String {
        format!(
            "{}/v1/{router_type}/{app_id}/registration{path}",
            self.endpoint_base
        )
    }
}
