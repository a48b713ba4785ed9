//! The gateway with its APNs bridge, in this process, talking to a recording
//! double instead of Apple ([`ApnsDouble`]), because a2 cannot be pointed at
//! a local server.
//!
//! Everything else is real: the settings come from a TOML file through the
//! gateway's own settings code (so the real a2 clients are built from the
//! test key material in `certs/` at start-up too), and the service serves
//! real HTTP on loopback to pywebpush and the registration API. Only the
//! registry entry for `apns` is swapped for a router built from the same
//! settings whose channels send to the double.

use std::path::PathBuf;
use std::sync::Arc;

use autopush_apns::double::{ApnsDouble, Recorded};
use autopush_common::RouterType;
use autopush_common::router::RouterRegistry;
use autopush_gateway::app::{self, Mode, Running};
use autopush_gateway::settings::{Settings, SettingsLayer};
use reqwest::Method;
use serde_json::{Value, json};

use crate::http::{HttpReply, request};
use crate::{Keys, SendOptions, SendResult, cert_file, py};

/// Release channels of the test configuration.
pub const FIREFOX: &str = "firefox";
pub const BETA: &str = "beta";
/// A channel whose in-flight cap is 1 and whose pushes may wait 30 s.
pub const CAPPED: &str = "capped";

/// Topics (bundle ids) of the channels.
pub const FIREFOX_TOPIC: &str = "org.example.firefox";
pub const BETA_TOPIC: &str = "org.example.beta";

/// The settings file: `firefox` with token auth (the `.p8` by path),
/// `beta` with certificate auth (inline PEM), both giving up on a push
/// after two seconds; `capped` with one push in flight at most, for 30 s.
pub fn config_toml() -> String {
    let read = |name: &str| {
        std::fs::read_to_string(cert_file(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    format!(
        r#"
[apns.channels.{FIREFOX}]
topic = "{FIREFOX_TOPIC}"
sandbox = true
key = "{p8}"
key_id = "TESTKEYID1"
team_id = "TESTTEAM01"
timeout = 2

[apns.channels.{BETA}]
topic = "{BETA_TOPIC}"
cert = """
{cert}"""
key = """
{key}"""
timeout = 2

[apns.channels.{CAPPED}]
topic = "org.example.capped"
key = "{p8}"
key_id = "TESTKEYID1"
team_id = "TESTTEAM01"
max_in_flight = 1
timeout = 30
"#,
        p8 = cert_file("apns-token-key.p8").display(),
        cert = read("apns-cert.pem"),
        key = read("apns-cert-key.pem"),
    )
}

/// An all-in-one service with APNs channels whose Apple is `double`.
pub struct ApnsService {
    pub double: Arc<ApnsDouble>,
    _running: Running,
    dir: tempfile::TempDir,
    endpoint_base: String,
    router_base: String,
    ws_url: String,
}

impl ApnsService {
    pub async fn start() -> ApnsService {
        ApnsService::start_with(ApnsDouble::new()).await
    }

    pub async fn start_with(double: Arc<ApnsDouble>) -> ApnsService {
        ApnsService::start_configured(double, |_| {}).await
    }

    /// [`ApnsService::start_with`], with more settings set by `configure`.
    pub async fn start_configured(
        double: Arc<ApnsDouble>,
        configure: impl FnOnce(&mut SettingsLayer),
    ) -> ApnsService {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("autopush.toml");
        std::fs::write(&config, config_toml()).expect("write the settings file");
        let [port, router_port, endpoint_port] = crate::server::free_ports::<3>();
        let endpoint_base = format!("http://127.0.0.1:{endpoint_port}");
        let mut layer = SettingsLayer {
            host: Some("127.0.0.1".into()),
            port: Some(port),
            router_port: Some(router_port),
            endpoint_port: Some(endpoint_port),
            endpoint_url: Some(endpoint_base.clone()),
            db: Some(dir.path().join("db").display().to_string()),
            ..SettingsLayer::default()
        };
        configure(&mut layer);
        let settings = Settings::resolve(layer, Some(&config)).expect("settings");
        assert_eq!(settings.bridges.apns.settings().channels.len(), 3);
        let router = double
            .router(
                &settings.bridges.apns.settings(),
                &app::bridge_limits(&settings),
            )
            .expect("the APNs router");
        let bridges = RouterRegistry::default().with(RouterType::Apns, Arc::new(router));
        let running = app::start(Mode::All, &settings, bridges)
            .await
            .expect("start the service");
        ApnsService {
            double,
            _running: running,
            dir,
            endpoint_base,
            router_base: format!("http://127.0.0.1:{router_port}"),
            ws_url: format!("ws://127.0.0.1:{port}/"),
        }
    }

    pub fn ws_url(&self) -> &str {
        &self.ws_url
    }

    pub fn endpoint_base(&self) -> &str {
        &self.endpoint_base
    }

    /// The internal router API (what `diagnose` asks when the store is held).
    pub fn router_base(&self) -> &str {
        &self.router_base
    }

    /// The embedded store's directory (holds the generated keys).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("db")
    }

    /// `{endpoint_base}/v1/apns/{channel}/registration{path}`.
    pub fn registration_url(&self, channel: &str, path: &str) -> String {
        format!(
            "{}/v1/apns/{channel}/registration{path}",
            self.endpoint_base
        )
    }

    /// `POST /v1/apns/{channel}/registration` with `body`, as the app does.
    pub async fn try_register(&self, channel: &str, body: Value) -> HttpReply {
        call(
            Method::POST,
            &self.registration_url(channel, ""),
            None,
            Some(body),
        )
        .await
    }

    /// Register `device_token` on `channel` (with `extra` fields, e.g. an
    /// `aps` override) and return the app's view of it, with new keys.
    pub async fn register(&self, channel: &str, device_token: &str, extra: Value) -> IosApp {
        let mut body = json!({"token": device_token});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let reply = self.try_register(channel, body).await;
        assert_eq!(reply.status, 200, "registration: {}", reply.text);
        let field = |name: &str| reply.field(name);
        IosApp {
            channel: channel.to_owned(),
            device_token: device_token.to_owned(),
            uaid: field("uaid"),
            secret: field("secret"),
            endpoint: field("endpoint"),
            channel_id: field("channelID"),
            keys: Keys::generate().await,
        }
    }

    /// `PUT .../registration/{uaid}` with a new device token.
    pub async fn update_token(&self, app: &mut IosApp, device_token: &str) -> HttpReply {
        let url = self.registration_url(&app.channel, &format!("/{}", app.uaid));
        let reply = call(
            Method::PUT,
            &url,
            Some(&app.secret),
            Some(json!({"token": device_token})),
        )
        .await;
        if reply.status == 200 {
            app.device_token = device_token.to_owned();
        }
        reply
    }

    /// `GET .../registration/{uaid}/messages?{query}`: a page of the app's
    /// mailbox, with `secret`.
    pub async fn mailbox(&self, app: &IosApp, secret: &str, query: &str) -> HttpReply {
        let url = self.registration_url(&app.channel, &format!("/{}/messages?{query}", app.uaid));
        call(Method::GET, &url, Some(secret), None).await
    }

    /// `DELETE .../registration/{uaid}/messages/{id}`: the app acks one message.
    pub async fn ack(&self, app: &IosApp, id: &str) -> HttpReply {
        let url = self.registration_url(&app.channel, &format!("/{}/messages/{id}", app.uaid));
        call(Method::DELETE, &url, Some(&app.secret), None).await
    }

    /// `GET .../registration/{uaid}/`: the app's channels, or the error.
    pub async fn channels(&self, app: &IosApp) -> HttpReply {
        let url = self.registration_url(&app.channel, &format!("/{}/", app.uaid));
        call(Method::GET, &url, Some(&app.secret), None).await
    }
}

async fn call(method: Method, url: &str, secret: Option<&str>, body: Option<Value>) -> HttpReply {
    let auth = secret.map(|s| format!("Bearer {s}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth.as_str()));
    }
    request(
        method,
        url,
        &headers,
        body.map(|b| b.to_string().into_bytes()),
    )
    .await
}

/// An iOS app registered through the bridge API, with the Web Push keys it
/// hands to its application server.
pub struct IosApp {
    pub channel: String,
    pub device_token: String,
    pub uaid: String,
    pub secret: String,
    pub endpoint: String,
    pub channel_id: String,
    pub keys: Keys,
}

impl IosApp {
    /// Send to this app with pywebpush.
    pub async fn send(&self, opts: &SendOptions) -> SendResult {
        py::send(&self.endpoint, &self.keys, opts).await
    }

    /// Decrypt what Apple delivered, as the app's notification service
    /// extension does: `body` with the `con`, `enc` and `cryptokey` fields.
    pub async fn decrypt(&self, delivered: &Recorded) -> py::Decrypted {
        self.decrypt_fields(&payload(delivered)).await
    }

    /// Decrypt a message from its bridge payload fields (`body`, `con`,
    /// `enc`, `cryptokey`), as APNs delivers them or the mailbox lists them.
    pub async fn decrypt_fields(&self, payload: &Value) -> py::Decrypted {
        let mut headers = serde_json::Map::new();
        for (theirs, ours) in [
            ("con", "encoding"),
            ("enc", "encryption"),
            ("cryptokey", "crypto_key"),
        ] {
            if let Some(value) = payload.get(theirs) {
                headers.insert(ours.into(), value.clone());
            }
        }
        py::decrypt(
            &self.keys,
            &json!({"data": payload["body"], "headers": headers}),
        )
        .await
    }
}

/// The JSON body Apple received.
pub fn payload(delivered: &Recorded) -> Value {
    serde_json::from_str(&delivered.request.payload).unwrap_or_else(|e| {
        panic!(
            "APNs payload is not JSON ({e}): {}",
            delivered.request.payload
        )
    })
}

/// The request headers Apple received, by name.
pub fn headers(delivered: &Recorded) -> std::collections::BTreeMap<&'static str, String> {
    delivered.request.headers.pairs().into_iter().collect()
}

/// A device token as APNs issues them: 32 random bytes as hex.
pub fn device_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}
