//! The FCM and GCM bridges end to end: the real binary, configured with a
//! local stand-in for Google (OAuth token endpoint and FCM HTTP v1, see
//! `autopush_tests::google`), apps registering through `/v1/fcm/...` and
//! `/v1/gcm/...`, and pywebpush pushing to the endpoints they get back.
//! Each test asserts what Google received and what the sender was told.

use std::time::Duration;

use autopush_tests::backend::{self, Db};
use autopush_tests::google::{Google, Received, Reply};
use autopush_tests::http::{self, HttpReply};
use autopush_tests::prometheus::Scrape;
use autopush_tests::py::{self, Encoding, Keys, SendOptions, SendResult};
use autopush_tests::tls::TlsFront;
use autopush_tests::{Server, new_channel_id, receipt, server};
use reqwest::Method;
use serde_json::{Value, json};
use tempfile::TempDir;

/// The Firebase project of the test service account.
const PROJECT: &str = "autopush-test";
/// The GCM sender id configured.
const SENDER_ID: &str = "1234567890";

/// Google's stand-in and the server configured for it: FCM app `app1` (TOML
/// table), GCM sender `SENDER_ID` (the `--gcm-credentials` JSON, inline
/// key), both on project [`PROJECT`]; FCM app `slow` on its own project
/// with room for one request in flight; FCM app `down` whose FCM is not
/// listening.
struct Bridge {
    google: Google,
    server: Server,
    keys: Keys,
    _dir: TempDir,
    /// The https front of [`Bridge::start_https`].
    _tls: Option<TlsFront>,
}

const TIMEOUT_SECS: u64 = 3;

impl Bridge {
    async fn start() -> Bridge {
        Bridge::start_with(&[]).await
    }

    /// [`Bridge::start`] with more command-line arguments.
    async fn start_with(args: &[&str]) -> Bridge {
        Bridge::start_on(Db::Embedded, args).await
    }

    /// [`Bridge::start_with`] on the storage backend `db`.
    async fn start_on(db: Db, args: &[&str]) -> Bridge {
        let google = Google::start().await;
        let dir = tempfile::tempdir().expect("temp dir");
        let key_file = google.write_service_account(dir.path(), "service-account.json");
        let [closed_port] = server::free_ports::<1>();
        let config = dir.path().join("autopush.toml");
        let app = |name: &str, project: &str, base_url: &str, extra: &str| {
            format!(
                "[fcm.apps.{name}]\nproject_id = \"{project}\"\ncredential = \"{}\"\n\
                 base_url = \"{base_url}\"\ntimeout = {TIMEOUT_SECS}\n{extra}\n",
                key_file.display()
            )
        };
        let toml = [
            app("app1", PROJECT, &google.base_url(), ""),
            app(
                "slow",
                "slow-project",
                &google.base_url(),
                "max_in_flight = 1",
            ),
            app(
                "down",
                "down-project",
                &format!("http://127.0.0.1:{closed_port}"),
                "",
            ),
        ]
        .concat();
        std::fs::write(&config, toml).expect("write the settings file");
        let gcm = json!({SENDER_ID: {
            "project_id": PROJECT,
            "credential": google.service_account().to_string(),
            "base_url": google.base_url(),
            "timeout": TIMEOUT_SECS,
        }})
        .to_string();
        let config = config.display().to_string();
        let mut all_args = vec!["--config", &config, "--gcm-credentials", &gcm];
        all_args.extend_from_slice(args);
        let server = backend::start(db, &all_args).await;
        Bridge::of(google, server, dir, None).await
    }

    /// Google's stand-in behind https (the test certificate for
    /// 127.0.0.1), and the server with FCM app `app1` there, trusting only
    /// the roots in the test certificate file `roots` (`SSL_CERT_FILE`).
    async fn start_https(roots: &str) -> Bridge {
        let google = Google::start().await;
        let front = TlsFront::start(google.addr()).await;
        let dir = tempfile::tempdir().expect("temp dir");
        let key_file = google.write_service_account(dir.path(), "service-account.json");
        let config = dir.path().join("autopush.toml");
        let toml = format!(
            "[fcm.apps.app1]\nproject_id = \"{PROJECT}\"\ncredential = \"{}\"\n\
             base_url = \"{}\"\ntimeout = {TIMEOUT_SECS}\n",
            key_file.display(),
            front.base_url()
        );
        std::fs::write(&config, toml).expect("write the settings file");
        let roots = autopush_tests::cert_file(roots).display().to_string();
        let config = config.display().to_string();
        // An empty SSL_CERT_DIR: no directory of roots beside the file
        // (this machine's environment names /etc/ssl/certs).
        let env = [("SSL_CERT_FILE", roots.as_str()), ("SSL_CERT_DIR", "")];
        let server = Server::start_with_env(&["--config", &config], &env).await;
        Bridge::of(google, server, dir, Some(front)).await
    }

    async fn of(google: Google, server: Server, dir: TempDir, tls: Option<TlsFront>) -> Bridge {
        Bridge {
            google,
            server,
            keys: Keys::generate().await,
            _dir: dir,
            _tls: tls,
        }
    }

    fn registration_url(&self, router_type: &str, app_id: &str, path: &str) -> String {
        format!(
            "{}/v1/{router_type}/{app_id}/registration{path}",
            self.server.endpoint_base()
        )
    }

    async fn register_reply(&self, router_type: &str, app_id: &str, token: &str) -> HttpReply {
        self.register_body(router_type, app_id, json!({"token": token}))
            .await
    }

    async fn register_body(&self, router_type: &str, app_id: &str, body: Value) -> HttpReply {
        http::request(
            Method::POST,
            &self.registration_url(router_type, app_id, ""),
            &[("content-type", "application/json")],
            Some(body.to_string().into_bytes()),
        )
        .await
    }

    async fn register(&self, router_type: &str, app_id: &str, token: &str) -> Registration {
        let reply = self.register_reply(router_type, app_id, token).await;
        Registration::from_reply(router_type, app_id, &reply)
    }

    /// `METHOD .../registration/{uaid}{path}` with the registration's secret.
    async fn call(&self, method: Method, r: &Registration, path: &str) -> HttpReply {
        self.call_as(method, r, &r.secret, path).await
    }

    /// [`Bridge::call`] with `secret` as the bearer token.
    async fn call_as(
        &self,
        method: Method,
        r: &Registration,
        secret: &str,
        path: &str,
    ) -> HttpReply {
        let url = self.registration_url(&r.router_type, &r.app_id, &format!("/{}{path}", r.uaid));
        let auth = format!("Bearer {secret}");
        http::request(method, &url, &[("authorization", &auth)], None).await
    }

    async fn push(&self, r: &Registration, options: &SendOptions) -> SendResult {
        py::send(&r.endpoint, &self.keys, options).await
    }

    /// The registration as the registration API shows it to its app.
    async fn channels(&self, r: &Registration) -> HttpReply {
        self.call(Method::GET, r, "/").await
    }

    /// Decrypt what FCM carried to the device, as the app would.
    async fn decrypt(&self, data: &Value) -> String {
        let mut headers = json!({"encoding": data["con"]});
        if let Some(enc) = data.get("enc") {
            headers["encryption"] = enc.clone();
        }
        if let Some(key) = data.get("cryptokey") {
            headers["crypto_key"] = key.clone();
        }
        let notification = json!({"data": data["body"], "headers": headers});
        py::decrypt(&self.keys, &notification).await.text
    }

    /// Lines of the server's log with `needle`.
    fn log_lines(&self, needle: &str) -> usize {
        self.server
            .stderr()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

struct Registration {
    router_type: String,
    app_id: String,
    uaid: String,
    secret: String,
    endpoint: String,
    channel_id: String,
    senderid: Option<String>,
}

impl Registration {
    fn from_reply(router_type: &str, app_id: &str, reply: &HttpReply) -> Registration {
        assert_eq!(reply.status, 200, "{}", reply.text);
        let field = |name: &str| reply.field(name);
        Registration {
            router_type: router_type.into(),
            app_id: app_id.into(),
            uaid: field("uaid"),
            secret: field("secret"),
            endpoint: field("endpoint"),
            channel_id: field("channelID"),
            senderid: reply.json["senderid"].as_str().map(str::to_owned),
        }
    }
}

/// The request's headers as FCM requires them.
fn assert_fcm_headers(received: &Received) {
    let auth = &received.headers["authorization"];
    assert!(auth.starts_with("Bearer ya29.mock-"), "{auth}");
    assert_eq!(received.headers["content-type"], "application/json");
    assert_eq!(received.project, PROJECT);
}

#[tokio::test]
async fn fcm_pushes_reach_google_as_data_messages_the_app_can_decrypt() {
    let bridge = Bridge::start().await;
    let token = "fcm-token-1:APA91bExample_token-with.all-chars";
    let r = bridge.register("fcm", "app1", token).await;
    assert_eq!(r.senderid.as_deref(), Some("app1"), "autopush's senderid");

    // aes128gcm, a topic, low urgency.
    let sent = bridge
        .push(
            &r,
            &SendOptions::text("hello android")
                .ttl(120)
                .topic("news")
                .urgency("low"),
        )
        .await;
    sent.assert_created();
    assert_eq!(sent.header("ttl"), Some("120"));
    let got = bridge.google.wait_for(token, 1).await;
    assert_fcm_headers(&got[0]);
    let body = got[0].data()["body"].as_str().expect("a body").to_owned();
    assert_eq!(
        got[0].body,
        json!({"message": {"token": token, "android": {
            "ttl": "120s",
            "priority": "normal",
            "collapse_key": "news",
            "data": {
                "chid": r.channel_id,
                "ver": receipt::id_of(&receipt::location(&sent)),
                "body": body,
                "con": "aes128gcm",
            },
        }}})
    );
    assert_eq!(bridge.decrypt(got[0].data()).await, "hello android");

    // aesgcm carries its two headers; no Urgency is high priority; a TTL
    // over FCM's 28 days is clamped.
    let sent = bridge
        .push(
            &r,
            &SendOptions::text("second")
                .encoding(Encoding::AesGcm)
                .ttl(2_592_000),
        )
        .await;
    sent.assert_created();
    let got = bridge.google.wait_for(token, 2).await;
    let android = &got[1].body["message"]["android"];
    assert_eq!(android["ttl"], "2419200s");
    assert_eq!(android["priority"], "high");
    assert!(android.get("collapse_key").is_none(), "{android}");
    let data = &android["data"];
    assert_eq!(data["con"], "aesgcm");
    assert!(
        data["enc"].as_str().is_some_and(|e| e.starts_with("salt=")),
        "{data}"
    );
    assert!(
        data["cryptokey"]
            .as_str()
            .is_some_and(|k| k.contains("dh=")),
        "{data}"
    );
    assert_eq!(bridge.decrypt(data).await, "second");

    // A push without a body: the channel and version only; urgency high.
    bridge
        .push(&r, &SendOptions::empty().urgency("high"))
        .await
        .assert_created();
    let got = bridge.google.wait_for(token, 3).await;
    let android = &got[2].body["message"]["android"];
    assert_eq!(android["priority"], "high");
    let keys: Vec<&String> = android["data"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["chid", "ver"]);

    // One access token served every push.
    assert_eq!(bridge.google.token_fetches(), 1);
}

/// The README's Urgency table, as Google receives it: `very-low` and `low`
/// are `normal` priority, `normal` and `high` are `high`. The app still gets
/// the message to decrypt, whatever its urgency.
/// A body of `Content-Type: application/webpush-message` reaches the app as
/// sent, named by `content_type` instead of `con`.
#[tokio::test]
async fn a_webpush_message_body_reaches_the_app_named_by_its_media_type() {
    let bridge = Bridge::start().await;
    let token = "fcm-token-pq:APA91bExample";
    let r = bridge.register("fcm", "app1", token).await;
    let body: Vec<u8> = (0..1_300u32).map(|i| (i * 7 + 3) as u8).collect();
    let headers = [
        ("TTL", "60"),
        ("Content-Type", "application/webpush-message"),
    ];
    let sent = http::post_push(&r.endpoint, &headers, Some(body.clone())).await;
    sent.assert_created();
    let got = bridge.google.wait_for(token, 1).await;
    let data = got[0].data();
    assert_eq!(
        data["content_type"], "application/webpush-message",
        "{data}"
    );
    assert!(data.get("con").is_none(), "{data}");
    let carried = data["body"].as_str().expect("a body");
    let carried =
        base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, carried)
            .expect("base64url body");
    assert!(carried == body, "the body changed on its way");
}

#[tokio::test]
async fn every_urgency_maps_onto_android_priority() {
    let bridge = Bridge::start().await;
    let token = "fcm-token-urgency";
    let r = bridge.register("fcm", "app1", token).await;
    let table = [
        ("very-low", "normal"),
        ("low", "normal"),
        ("normal", "high"),
        ("high", "high"),
    ];
    for (i, (urgency, _)) in table.iter().enumerate() {
        let sent = bridge
            .push(&r, &SendOptions::text(urgency).urgency(urgency))
            .await;
        sent.assert_created();
        bridge.google.wait_for(token, i + 1).await;
    }
    let got = bridge.google.wait_for(token, table.len()).await;
    for ((urgency, priority), received) in table.iter().zip(&got) {
        let android = &received.body["message"]["android"];
        assert_eq!(
            android["priority"], *priority,
            "Urgency {urgency}: {android}"
        );
        assert_eq!(bridge.decrypt(received.data()).await, *urgency);
    }
}

#[tokio::test]
async fn gcm_registrations_use_the_sender_id_and_hex_channel_ids() {
    let bridge = Bridge::start().await;
    let token = "gcm-era-registration-token";
    let r = bridge.register("gcm", SENDER_ID, token).await;
    assert_eq!(r.senderid.as_deref(), Some(SENDER_ID));
    let sent = bridge
        .push(&r, &SendOptions::text("hi gcm").topic("t1"))
        .await;
    sent.assert_created();
    let got = bridge.google.wait_for(token, 1).await;
    assert_fcm_headers(&got[0]);
    let body = got[0].data()["body"].as_str().expect("a body").to_owned();
    assert_eq!(
        got[0].body,
        json!({"message": {"token": token, "android": {
            "ttl": "60s",
            "priority": "high",
            "collapse_key": "t1",
            "data": {
                "chid": r.channel_id.replace('-', ""),
                "ver": receipt::id_of(&receipt::location(&sent)),
                "body": body,
                "con": "aes128gcm",
            },
        }}})
    );
    assert_eq!(bridge.decrypt(got[0].data()).await, "hi gcm");

    // A sender id, or an FCM app, that is not configured is refused,
    // naming it.
    for (router_type, app) in [("gcm", "999"), ("fcm", SENDER_ID)] {
        let reply = bridge.register_reply(router_type, app, token).await;
        reply.assert_error(400, 108);
        let message = reply.json["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("{app:?}")),
            "{router_type}: {message}"
        );
    }
}

/// One start-up line names the bridges served and their apps, never what
/// authenticates them.
#[tokio::test]
async fn the_start_up_log_names_the_apps_served_and_no_credentials() {
    let bridge = Bridge::start().await;
    let log = bridge.server.stderr();
    let lines: Vec<_> = log.lines().filter(|l| l.contains("bridges:")).collect();
    assert_eq!(lines.len(), 1, "one line lists the bridges:\n{log}");
    let line = lines[0];
    assert!(line.contains("apns channels: none"), "{line}");
    assert!(line.contains("fcm apps: app1, down, slow"), "{line}");
    assert!(line.contains(&format!("gcm apps: {SENDER_ID}")), "{line}");
    let account = bridge.google.service_account();
    let pem = account["private_key"].as_str().expect("a private key");
    let body_line = pem.lines().nth(1).expect("a PEM body");
    assert!(
        !log.contains("PRIVATE KEY") && !log.contains(body_line),
        "a credential is logged:\n{log}"
    );
}

#[tokio::test]
async fn registration_tokens_are_validated() {
    let bridge = Bridge::start().await;
    for bad in ["", "has space", "semi;colon", &"a".repeat(1025)] {
        let reply = bridge.register_reply("fcm", "app1", bad).await;
        reply.assert_error(400, 110);
        assert!(
            reply.json["message"].as_str().unwrap().contains("token"),
            "{}",
            reply.text
        );
    }
    assert!(bridge.google.received().is_empty());
}

/// The sender is told 410 and the registration is gone: the next push is
/// 410 without asking Google, and the app sees it gone too.
async fn assert_removed(bridge: &Bridge, r: &Registration, token: &str, first: &SendResult) {
    first.assert_error(410, 106);
    let again = bridge.push(r, &SendOptions::text("again")).await;
    assert_eq!(again.status, 410, "{}", again.body);
    assert_eq!(
        bridge.google.received_for(token).len(),
        1,
        "Google asked again"
    );
    assert_eq!(bridge.channels(r).await.status, 410);
}

#[tokio::test]
async fn an_unregistered_device_is_removed() {
    let bridge = Bridge::start().await;
    let token = "uninstalled-app-token";
    bridge.google.script(token, &[Reply::Unregistered]);
    let r = bridge.register("fcm", "app1", token).await;
    let first = bridge.push(&r, &SendOptions::text("anyone there?")).await;
    assert_removed(&bridge, &r, token, &first).await;

    let token = "gcm-token-google-calls-invalid";
    bridge.google.script(token, &[Reply::InvalidToken]);
    let r = bridge.register("gcm", SENDER_ID, token).await;
    let first = bridge.push(&r, &SendOptions::text("anyone there?")).await;
    assert_removed(&bridge, &r, token, &first).await;
}

#[tokio::test]
async fn refusals_reach_the_sender_and_credential_errors_are_logged_once() {
    let bridge = Bridge::start().await;
    let token = "device-with-a-picky-message";
    bridge.google.script(
        token,
        &[Reply::InvalidArgument(
            "Invalid value at 'message.android.collapse_key'".into(),
        )],
    );
    let r = bridge.register("fcm", "app1", token).await;
    let sent = bridge.push(&r, &SendOptions::text("x")).await;
    sent.assert_error(400, 110);
    assert!(
        sent.json()["message"]
            .as_str()
            .unwrap()
            .contains("Invalid value at 'message.android.collapse_key'"),
        "FCM's reason: {}",
        sent.body
    );
    // Not the device's fault: the registration stays.
    bridge
        .push(&r, &SendOptions::text("y"))
        .await
        .assert_created();
    assert_eq!(bridge.channels(&r).await.status, 200);

    // 403: our credentials are refused; told 502/901, logged once.
    bridge
        .google
        .script(token, &[Reply::PermissionDenied, Reply::PermissionDenied]);
    for _ in 0..2 {
        bridge
            .push(&r, &SendOptions::text("z"))
            .await
            .assert_error(502, 901);
    }
    assert_eq!(bridge.log_lines("the bridge refused our credentials"), 1);
    bridge
        .push(&r, &SendOptions::text("ok"))
        .await
        .assert_created();
    assert_eq!(bridge.log_lines("accepts our credentials again"), 1);
    assert_eq!(bridge.google.received_for(token).len(), 5);
}

/// FCM never redirects `messages:send`: a 3xx is a bad answer (502), and
/// neither the message nor the bearer token is posted again elsewhere.
#[tokio::test]
async fn a_redirect_is_not_followed() {
    let bridge = Bridge::start().await;
    let token = "device-behind-a-redirect";
    bridge.google.script(token, &[Reply::Redirect]);
    let r = bridge.register("fcm", "app1", token).await;
    bridge
        .push(&r, &SendOptions::text("x"))
        .await
        .assert_error(502, 902);
    assert_eq!(bridge.google.received_for(token).len(), 1);
    // The registration stays: the next push goes through.
    bridge
        .push(&r, &SendOptions::text("y"))
        .await
        .assert_created();
    assert_eq!(bridge.google.received_for(token).len(), 2);
}

#[tokio::test]
async fn access_tokens_are_refreshed_after_a_401_and_before_they_expire() {
    let bridge = Bridge::start().await;
    let token = "device-for-token-tests";
    let r = bridge.register("fcm", "app1", token).await;
    bridge.google.set_token_lifetime(2);
    bridge
        .push(&r, &SendOptions::text("1"))
        .await
        .assert_created();
    assert_eq!(bridge.google.token_fetches(), 1);

    // Half the 2 s lifetime gone: renewed before it expires, no 401 needed.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    bridge.google.set_token_lifetime(3600);
    bridge
        .push(&r, &SendOptions::text("2"))
        .await
        .assert_created();
    assert_eq!(bridge.google.token_fetches(), 2);
    assert_eq!(bridge.google.unauthenticated(), 0);
    for n in 3..6 {
        bridge
            .push(&r, &SendOptions::text(&n.to_string()))
            .await
            .assert_created();
    }
    assert_eq!(
        bridge.google.token_fetches(),
        2,
        "one fetch per token lifetime"
    );

    // Revoked early: FCM says 401, one new token, one more try.
    bridge.google.revoke_tokens();
    bridge
        .push(&r, &SendOptions::text("6"))
        .await
        .assert_created();
    assert_eq!(bridge.google.unauthenticated(), 1);
    assert_eq!(bridge.google.token_fetches(), 3);
    assert_eq!(bridge.google.received_for(token).len(), 6);

    // A 401 the new token does not cure: 502/901 after one refresh.
    bridge
        .google
        .script(token, &[Reply::Unauthenticated, Reply::Unauthenticated]);
    bridge
        .push(&r, &SendOptions::text("7"))
        .await
        .assert_error(502, 901);
    assert_eq!(bridge.google.token_fetches(), 4);
    assert_eq!(bridge.google.received_for(token).len(), 8);

    // The token endpoint refuses the key: 502/901 too.
    bridge.google.revoke_tokens();
    bridge.google.refuse_grants(true);
    bridge
        .push(&r, &SendOptions::text("8"))
        .await
        .assert_error(502, 901);
    assert_eq!(bridge.google.received_for(token).len(), 8);
}

#[tokio::test]
async fn a_busy_fcm_is_retried_honouring_retry_after() {
    let bridge = Bridge::start().await;
    let token = "device-behind-a-busy-fcm";
    let r = bridge.register("fcm", "app1", token).await;

    // 503 with Retry-After 1, then 200: the sender gets 201.
    bridge.google.script(
        token,
        &[Reply::Unavailable {
            retry_after: Some(1),
        }],
    );
    bridge
        .push(&r, &SendOptions::text("patience"))
        .await
        .assert_created();
    let got = bridge.google.wait_for(token, 2).await;
    assert_eq!(got[0].body, got[1].body);
    assert!(
        got[1].at - got[0].at >= Duration::from_secs(1),
        "retried before Retry-After: {:?}",
        got[1].at - got[0].at
    );

    // 503 asking for more than the deadline: 503 with FCM's Retry-After at once.
    bridge.google.script(
        token,
        &[Reply::Unavailable {
            retry_after: Some(60),
        }],
    );
    let sent = bridge.push(&r, &SendOptions::text("later")).await;
    sent.assert_error(503, 201);
    assert_eq!(sent.header("retry-after"), Some("60"));
    assert_eq!(bridge.google.received_for(token).len(), 3);

    // 500 every time: three tries, then 503 with a Retry-After.
    bridge
        .google
        .script(token, &[Reply::Internal, Reply::Internal, Reply::Internal]);
    let sent = bridge.push(&r, &SendOptions::text("broken")).await;
    sent.assert_error(503, 201);
    assert!(
        sent.header("retry-after")
            .is_some_and(|s| s.parse::<u64>().is_ok())
    );
    assert_eq!(bridge.google.received_for(token).len(), 6);
    // The registration stays.
    bridge
        .push(&r, &SendOptions::text("fine"))
        .await
        .assert_created();
}

/// A push as is (the bridge carries any body), without pywebpush.
async fn raw_push(r: &Registration) -> HttpReply {
    http::post_push(
        &r.endpoint,
        &[("ttl", "60"), ("content-encoding", "aes128gcm")],
        Some(b"opaque".to_vec()),
    )
    .await
}

/// `Retry-After` of a refusal, in seconds.
fn retry_after(reply: &HttpReply) -> u64 {
    reply
        .header("retry-after")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {:?}", reply.headers))
}

/// FCM's refusal as the sender sees it: 429 errno 201, to wait `seconds`,
/// under the `upstream` policy, whose quota is not known: none passes for
/// that long.
fn assert_upstream_refused(sent: &HttpReply, seconds: u64) {
    let limit = sent.assert_rate_limited("FCM's quota");
    assert_eq!(retry_after(sent), seconds);
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("upstream", 0, Some(seconds)),
        "{limit:?}"
    );
}

#[tokio::test]
async fn fcm_quota_exhausted_is_a_429_with_a_clamped_retry_after() {
    let bridge = Bridge::start().await;
    let token = "device-of-an-app-over-quota";
    let r = bridge.register("fcm", "app1", token).await;

    // FCM asks for more than the deadline: no retry, its Retry-After, at
    // most an hour.
    for (asked, told) in [(60, 60), (86_400, 3600)] {
        bridge.google.script(
            token,
            &[Reply::QuotaExceeded {
                retry_after: Some(asked),
            }],
        );
        let sent = raw_push(&r).await;
        assert_upstream_refused(&sent, told);
    }
    assert_eq!(bridge.google.received_for(token).len(), 2);

    // FCM keeps saying 429 "now": three tries, then 429 with at least 1 s.
    let now = Reply::QuotaExceeded {
        retry_after: Some(0),
    };
    bridge
        .google
        .script(token, &[now.clone(), now.clone(), now]);
    let sent = raw_push(&r).await;
    assert_upstream_refused(&sent, 1);
    assert_eq!(bridge.google.received_for(token).len(), 5);

    // No Retry-After at all: three tries, then the default 30 s.
    let unsaid = Reply::QuotaExceeded { retry_after: None };
    bridge
        .google
        .script(token, &[unsaid.clone(), unsaid.clone(), unsaid]);
    let sent = raw_push(&r).await;
    assert_upstream_refused(&sent, 30);
    assert_eq!(bridge.google.received_for(token).len(), 8);

    // The registration stays.
    raw_push(&r).await.assert_created();
}

#[tokio::test]
async fn an_app_over_its_rate_gets_429_while_other_apps_go_on() {
    // Two pushes at once per app, then one per 100 s.
    let bridge = Bridge::start_with(&["--bridge-app-limit", "0.01,2"]).await;
    let busy_token = "device-of-a-busy-app";
    let busy = bridge.register("fcm", "app1", busy_token).await;
    // Another app, on the same Firebase project.
    let other_token = "device-of-another-app";
    let other = bridge.register("gcm", SENDER_ID, other_token).await;

    for _ in 0..2 {
        raw_push(&busy).await.assert_created();
    }
    let refused = raw_push(&busy).await;
    let limit = refused.assert_rate_limited("the app's 3rd push");
    assert!((1..=100).contains(&limit.reset), "{limit:?}");
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("bridge_app", 2, Some(200)),
        "{limit:?}"
    );
    assert!(refused.text.contains("bridge app"), "{}", refused.text);
    // The other app's burst is whole.
    for _ in 0..2 {
        raw_push(&other).await.assert_created();
    }
    assert_eq!(bridge.google.received_for(busy_token).len(), 2);
    assert_eq!(bridge.google.received_for(other_token).len(), 2);

    let metrics = http::get(&format!("{}/metrics", bridge.server.router_base())).await;
    let scrape = Scrape::parse(&metrics.text);
    assert_eq!(
        scrape.value("rate_limit_refused", &[("limit", "bridge_app")]),
        1.0,
        "{}",
        metrics.text
    );
}

#[tokio::test]
async fn a_stalled_project_times_out_without_delaying_others() {
    let bridge = Bridge::start().await;
    let stalled = "device-of-a-stalled-project";
    bridge.google.script(stalled, &[Reply::Stall]);
    let slow = bridge.register("fcm", "slow", stalled).await;
    let slow_too = bridge.register("fcm", "slow", "another-slow-device").await;
    let fine = bridge
        .register("fcm", "app1", "device-of-a-fine-project")
        .await;

    let keys = bridge.keys.clone();
    let endpoint = slow.endpoint.clone();
    let first =
        tokio::spawn(async move { py::send(&endpoint, &keys, &SendOptions::text("stuck")).await });
    bridge.google.wait_for(stalled, 1).await;

    // The slow project's one slot is taken: 503 + Retry-After, at once.
    let sent = bridge.push(&slow_too, &SendOptions::text("full")).await;
    sent.assert_error(503, 201);
    assert!(sent.header("retry-after").is_some());
    // Another project and webpush are not held up.
    bridge
        .push(&fine, &SendOptions::text("other project"))
        .await
        .assert_created();
    let mut ws = bridge.server.client().await;
    let chid = new_channel_id();
    let endpoint = ws.register(&chid, None).await["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_owned();
    py::send(&endpoint, &bridge.keys, &SendOptions::text("webpush"))
        .await
        .assert_created();
    let delivered = ws.recv_notification().await;
    assert_eq!(delivered["channelID"], chid.as_str());
    assert!(bridge.google.received_for("another-slow-device").is_empty());

    // The stalled push ends at the deadline: 502/903.
    let first = first.await.expect("the stalled push");
    first.assert_error(502, 903);
}

#[tokio::test]
async fn an_unreachable_fcm_is_a_502_and_oversized_data_is_refused_before_sending() {
    let bridge = Bridge::start().await;
    let r = bridge
        .register("fcm", "down", "device-of-an-unreachable-fcm")
        .await;
    bridge
        .push(&r, &SendOptions::text("hello?"))
        .await
        .assert_error(502, 902);

    let token = "device-with-little-room";
    let r = bridge.register("fcm", "app1", token).await;
    let sent = bridge.push(&r, &SendOptions::pattern(4096)).await;
    sent.assert_error(413, 104);
    let message = sent.json()["message"].as_str().unwrap().to_owned();
    assert!(message.contains("bridge"), "{message}");
    assert!(bridge.google.received_for(token).is_empty());
    // What the seeds promise bridged senders: 2744 bytes of plaintext.
    bridge
        .push(&r, &SendOptions::pattern(2744))
        .await
        .assert_created();
    let got = bridge.google.wait_for(token, 1).await;
    assert_eq!(
        bridge.decrypt(got[0].data()).await,
        autopush_tests::data_pattern(2744)
    );
}

/// FCM over https: a push reaches Google when the system's roots vouch for
/// its certificate, and is refused with 502 and never sent when they do not.
#[tokio::test]
async fn fcm_over_https_reaches_only_a_certificate_the_roots_vouch_for() {
    for (roots, vouched) in [("tls-ca.pem", true), ("tls-other-ca.pem", false)] {
        let bridge = Bridge::start_https(roots).await;
        let token = format!("device-behind-https-{vouched}");
        let r = bridge.register("fcm", "app1", &token).await;
        let sent = bridge.push(&r, &SendOptions::text("over https")).await;
        if vouched {
            sent.assert_created();
            let got = bridge.google.wait_for(&token, 1).await;
            assert_eq!(bridge.decrypt(got[0].data()).await, "over https");
        } else {
            sent.assert_error(502, 902);
            assert!(bridge.google.received_for(&token).is_empty());
        }
    }
}

#[tokio::test]
async fn diagnose_shows_the_bridge_with_a_masked_token() {
    let bridge = Bridge::start().await;
    let token = "a-long-fcm-registration-token-nobody-should-see";
    let r = bridge.register("fcm", "app1", token).await;
    let db = bridge.server.data_dir().display().to_string();
    let port = bridge
        .server
        .router_base()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let out =
        server::run_autopush(&["diagnose", &r.endpoint, "--db", &db, "--router-port", &port]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains(token), "the token is shown: {stdout}");
    let info: Value = serde_json::from_str(&stdout).expect("diagnose prints JSON");
    let user = &info["user"];
    assert_eq!(user["router_type"], "fcm", "{info}");
    assert_eq!(user["router_data"]["app_id"], "app1", "{info}");
    let shown = user["router_data"]["token"].as_str().unwrap();
    assert!(
        shown.starts_with("a-lo") && shown.contains("-see"),
        "{shown}"
    );
}

#[tokio::test]
async fn bad_bridge_settings_stop_the_server_naming_the_app() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().display().to_string();
    let missing = json!({"myapp": {"project_id": "p", "credential": "/nonexistent/key.json"}});
    let not_a_key =
        json!({"42": {"project_id": "p", "credential": "{\"type\": \"service_account\"}"}});
    for (flag, value, name) in [
        ("--fcm-credentials", missing.to_string(), "myapp"),
        ("--gcm-credentials", not_a_key.to_string(), "42"),
        (
            "--fcm-credentials",
            "{not json".to_string(),
            "AUTOPUSH_FCM_CREDENTIALS",
        ),
    ] {
        let ports = server::port_flags();
        let mut args = vec!["all", "--db", &db, flag, &value];
        args.extend(ports.iter().map(String::as_str));
        let out = server::run_autopush(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "started with {value}");
        assert!(stderr.contains(name), "{flag} {value}: {stderr}");
        assert!(
            !stderr.contains("service_account"),
            "the key is echoed: {stderr}"
        );
    }
}

/// An https FCM with no root certificates to check it by stops start-up,
/// and the error says so (gcp_auth would call the key unusable).
#[tokio::test]
async fn no_root_certificates_for_an_https_fcm_stop_the_server_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().display().to_string();
    let key = autopush_tests::cert_file("fcm-service-account.json");
    let apps = json!({"myapp": {"project_id": "p", "credential": key}}).to_string();
    let ports = server::port_flags();
    let mut args = vec!["all", "--db", &db, "--fcm-credentials", &apps];
    args.extend(ports.iter().map(String::as_str));
    let env = [
        ("SSL_CERT_FILE", "/nonexistent/roots.pem"),
        ("SSL_CERT_DIR", ""),
    ];
    let out = server::run_autopush_with_env(&args, &env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without roots");
    assert!(
        stderr.contains("myapp") && stderr.contains("base_url: no root certificates for https"),
        "{stderr}"
    );
}

/// Receipts of pushes to an Android app, and the mailbox of a registration
/// that asked for one, on every storage backend.
mod mailbox {
    use autopush_tests::mailbox::{assert_holds_none_of, body_bytes, fetch_all};
    use autopush_tests::on_every_backend;
    use autopush_tests::receipt::{id_of, location, state_of, wait_for_state};

    use super::*;

    impl Bridge {
        /// An `app1` registration with a mailbox.
        async fn register_mailbox(&self, token: &str) -> Registration {
            let body = json!({"token": token, "mailbox": true});
            let reply = self.register_body("fcm", "app1", body).await;
            Registration::from_reply("fcm", "app1", &reply)
        }

        /// Every message in `r`'s mailbox, `limit` a page.
        async fn fetch_all(&self, r: &Registration, limit: usize) -> Vec<Value> {
            fetch_all(limit, async |query| {
                self.call(Method::GET, r, &format!("/messages?{query}"))
                    .await
            })
            .await
        }

        /// The app acks message `id` of its mailbox.
        async fn ack(&self, r: &Registration, id: &str) -> HttpReply {
            self.call(Method::DELETE, r, &format!("/messages/{id}"))
                .await
        }

        /// The texts of `messages`, decrypted as the app does.
        async fn texts(&self, messages: &[Value]) -> Vec<String> {
            let mut texts = Vec::new();
            for message in messages {
                texts.push(self.decrypt(message).await);
            }
            texts
        }
    }

    /// What a push to an Android app became: `bridged` once Google took it
    /// (the id Google carried as `ver` is the one in `Location`). With a
    /// mailbox, whatever FCM does with its backlog, the app fetches every
    /// message, oldest first in pages whatever their Topic, and acks each: `fetched`, and a
    /// second ack is 404. One FCM refused (the sender heard an error) is
    /// not kept.
    async fn the_mailbox_keeps_every_message(db: Db) {
        let bridge = Bridge::start_on(db, &[]).await;
        let plain = bridge.register("fcm", "app1", "fcm-token-plain").await;
        let sent = bridge.push(&plain, &SendOptions::text("plain")).await;
        assert_eq!(state_of(&location(&sent)).await, "bridged");
        let received = bridge.google.wait_for("fcm-token-plain", 1).await;
        assert_eq!(received[0].data()["ver"], id_of(&location(&sent)));

        let token = "fcm-token-box";
        let boxed = bridge.register_mailbox(token).await;
        // Topic messages among them: listed in their place too.
        let texts = ["one", "two", "three", "four", "five"];
        let topics = [None, Some("a"), Some("b"), None, Some("c")];
        let mut receipts = Vec::new();
        for (text, topic) in texts.into_iter().zip(topics) {
            let options = match topic {
                Some(topic) => SendOptions::text(text).topic(topic),
                None => SendOptions::text(text),
            };
            let sent = location(&bridge.push(&boxed, &options).await);
            assert_eq!(state_of(&sent).await, "bridged");
            receipts.push(sent);
        }
        bridge.google.script(
            token,
            &[Reply::InvalidArgument("Invalid value at 'message'".into())],
        );
        bridge
            .push(&boxed, &SendOptions::text("refused"))
            .await
            .assert_error(400, 110);
        assert_eq!(bridge.google.wait_for(token, 6).await.len(), 6);

        let listed = bridge.fetch_all(&boxed, 2).await;
        assert_eq!(bridge.texts(&listed).await, texts, "{listed:?}");
        for (message, receipt) in listed.iter().zip(&receipts) {
            assert_eq!(message["ver"], id_of(receipt), "{message}");
            assert_eq!(message["chid"], boxed.channel_id.as_str(), "{message}");
        }
        for receipt in &receipts {
            let acked = bridge.ack(&boxed, id_of(receipt)).await;
            assert_eq!(acked.status, 200, "{}", acked.text);
            assert_eq!(state_of(receipt).await, "fetched");
            bridge
                .ack(&boxed, id_of(receipt))
                .await
                .assert_error(404, 102);
        }
        assert!(bridge.fetch_all(&boxed, 10).await.is_empty());
    }

    /// The mailbox keeps the usual rules: a newer message with the same
    /// Topic replaces an older one (an ack of the older one, listed before
    /// the newer came, leaves the newer), an expired one is not listed, the
    /// sender may delete one, and a removed registration leaves the rest
    /// `gone`.
    async fn the_mailbox_keeps_topic_ttl_and_delete_rules(db: Db) {
        let bridge = Bridge::start_on(db, &[]).await;
        let r = bridge.register_mailbox("fcm-token-rules").await;
        let push = async |options: SendOptions| location(&bridge.push(&r, &options).await);
        let first = push(SendOptions::text("first").topic("score")).await;
        let second = push(SendOptions::text("second").topic("score")).await;
        let expiring = push(SendOptions::text("expiring").ttl(1)).await;
        let deleted = push(SendOptions::text("deleted")).await;
        let pending = push(SendOptions::text("pending")).await;
        assert_eq!(http::delete(&deleted).await.status, 204);
        assert_eq!(state_of(&first).await, "replaced");
        assert_eq!(state_of(&deleted).await, "deleted");
        wait_for_state(&expiring, "expired").await;
        // Expired is final: neither the app's ack nor the sender's delete
        // takes it.
        bridge
            .ack(&r, id_of(&expiring))
            .await
            .assert_error(404, 102);
        http::delete(&expiring).await.assert_error(404, 102);
        assert_eq!(state_of(&expiring).await, "expired");
        let listed = bridge.fetch_all(&r, 10).await;
        assert_eq!(bridge.texts(&listed).await, ["second", "pending"]);
        assert_eq!(listed[0]["topic"], "score");
        // A newer message with the Topic arrives after the listing: the
        // app's ack of the one it listed leaves the newer one pending.
        let third = push(SendOptions::text("third").topic("score")).await;
        bridge.ack(&r, id_of(&second)).await.assert_error(404, 102);
        assert_eq!(state_of(&second).await, "replaced");
        let listed = bridge.fetch_all(&r, 10).await;
        assert_eq!(bridge.texts(&listed).await, ["pending", "third"]);

        let removed = bridge.call(Method::DELETE, &r, "").await;
        assert_eq!(removed.status, 200, "{}", removed.text);
        assert_eq!(state_of(&third).await, "gone");
        assert_eq!(state_of(&pending).await, "gone");
        assert_eq!(state_of(&second).await, "replaced");
        assert_eq!(state_of(&deleted).await, "deleted");
        assert_eq!(state_of(&expiring).await, "expired");
    }

    /// A mailbox holds at most `--msg-limit` messages: past it the sender
    /// gets 429 with Retry-After and nothing goes to FCM; an ack makes
    /// room, and a message that only replaces one with its Topic takes no
    /// more.
    async fn a_full_mailbox_refuses_more(db: Db) {
        let bridge = Bridge::start_on(db, &["--msg-limit", "2"]).await;
        let token = "fcm-token-full";
        let r = bridge.register_mailbox(token).await;
        let first = location(&bridge.push(&r, &SendOptions::text("1")).await);
        location(&bridge.push(&r, &SendOptions::text("2")).await);
        let refused = bridge.push(&r, &SendOptions::text("3")).await;
        autopush_tests::mailbox::assert_full(&refused, 2);
        assert_eq!(bridge.google.received_for(token).len(), 2);

        assert_eq!(bridge.ack(&r, id_of(&first)).await.status, 200);
        let scored = location(
            &bridge
                .push(&r, &SendOptions::text("3").topic("score"))
                .await,
        );
        bridge
            .push(&r, &SendOptions::text("4").topic("other"))
            .await
            .assert_error(429, 201);
        location(
            &bridge
                .push(&r, &SendOptions::text("4").topic("score"))
                .await,
        );
        assert_eq!(state_of(&scored).await, "replaced");
        assert_eq!(bridge.google.received_for(token).len(), 4);
        let listed = bridge.fetch_all(&r, 10).await;
        let mut texts = bridge.texts(&listed).await;
        texts.sort();
        assert_eq!(texts, ["2", "4"], "{listed:?}");
    }

    /// Only the registration's own secret reads or acks its mailbox.
    async fn the_mailbox_needs_the_registration_secret(db: Db) {
        let bridge = Bridge::start_on(db, &[]).await;
        let mine = bridge.register_mailbox("fcm-token-mine").await;
        let other = bridge.register_mailbox("fcm-token-other").await;
        let sent = location(&bridge.push(&mine, &SendOptions::text("mine")).await);
        for secret in [other.secret.as_str(), "not-a-secret"] {
            bridge
                .call_as(Method::GET, &mine, secret, "/messages")
                .await
                .assert_error(401, 109);
            let ack = format!("/messages/{}", id_of(&sent));
            bridge
                .call_as(Method::DELETE, &mine, secret, &ack)
                .await
                .assert_error(401, 109);
        }
        // Another registration cannot ack it, even with its own secret.
        bridge
            .ack(&other, id_of(&sent))
            .await
            .assert_error(404, 102);
        assert_eq!(bridge.fetch_all(&mine, 10).await.len(), 1);
        assert_eq!(state_of(&sent).await, "bridged");
    }

    /// A new device token (`PUT` without `mailbox`) keeps the mailbox and
    /// what it holds; the next wake-up goes to the new token.
    async fn a_new_token_keeps_the_mailbox(db: Db) {
        let bridge = Bridge::start_on(db, &[]).await;
        let r = bridge.register_mailbox("fcm-token-old").await;
        location(&bridge.push(&r, &SendOptions::text("before")).await);
        let url = bridge.registration_url("fcm", "app1", &format!("/{}", r.uaid));
        let auth = format!("Bearer {}", r.secret);
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ];
        let body = json!({"token": "fcm-token-new"}).to_string().into_bytes();
        let updated = http::request(Method::PUT, &url, &headers, Some(body)).await;
        assert_eq!(updated.status, 200, "{}", updated.text);
        location(&bridge.push(&r, &SendOptions::text("after")).await);
        bridge.google.wait_for("fcm-token-new", 1).await;
        assert_eq!(bridge.google.received_for("fcm-token-old").len(), 1);
        let listed = bridge.fetch_all(&r, 10).await;
        assert_eq!(bridge.texts(&listed).await, ["before", "after"]);
    }

    impl Bridge {
        /// An `app1` registration whose upstream pushes are wake-ups only.
        async fn register_wake_only(&self, token: &str) -> Registration {
            let body = json!({"token": token, "mailbox": true, "wake_only": true});
            let reply = self.register_body("fcm", "app1", body).await;
            Registration::from_reply("fcm", "app1", &reply)
        }

        /// `PUT .../registration/{uaid}` with `body`.
        async fn update(&self, r: &Registration, body: Value) -> HttpReply {
            let url = self.registration_url("fcm", "app1", &format!("/{}", r.uaid));
            let auth = format!("Bearer {}", r.secret);
            let headers = [
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ];
            http::request(
                Method::PUT,
                &url,
                &headers,
                Some(body.to_string().into_bytes()),
            )
            .await
        }
    }

    /// The wake-up Google receives for a message of `ttl` and `priority`:
    /// one fixed key, and nothing of the message.
    fn wake_up(token: &str, ttl: &str, priority: &str) -> Value {
        json!({"message": {"token": token, "android": {
            "ttl": ttl, "priority": priority, "collapse_key": "wake",
            "data": {"wake": "1"},
        }}})
    }

    /// Everything of `received` as text: its headers and its body.
    fn as_text(received: &Received) -> String {
        format!("{:?} {}", received.headers, received.body)
    }

    /// A wake-only registration: Google receives content-free wake-ups
    /// (urgency and TTL only: no body, channel id, version or sender),
    /// while the app fetches a 6 KB body from its mailbox, more than FCM
    /// could carry. A fetch answers a wake-up: the next message wakes
    /// again; one more before the next fetch is coalesced.
    async fn a_wake_only_registration_shows_google_nothing_of_the_message(db: Db) {
        let args = [
            "--max-data-bytes",
            "8192",
            "--wake-interval",
            "3600",
            "--wake-threshold",
            "low",
        ];
        let bridge = Bridge::start_on(db, &args).await;
        let token = "fcm-token-private";
        let r = bridge.register_wake_only(token).await;
        let body = autopush_tests::opaque_body(6 * 1024);
        let headers = [
            ("TTL", "600"),
            ("Urgency", "high"),
            ("Topic", "chat-topic-7"),
            ("Content-Type", "application/webpush-message"),
        ];
        let sent = http::post_push(&r.endpoint, &headers, Some(body.clone())).await;
        assert_eq!(sent.status, 201, "{}", sent.text);
        let first = sent.header("location").expect("Location").to_owned();
        let got = bridge.google.wait_for(token, 1).await;
        assert_eq!(got[0].body, wake_up(token, "600s", "high"));
        assert_fcm_headers(&got[0]);

        assert_eq!(state_of(&first).await, "stored", "nothing went upstream");

        let listed = bridge.fetch_all(&r, 10).await;
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert!(body_bytes(&listed[0]) == body, "the fetched body differs");
        assert_eq!(listed[0]["content_type"], "application/webpush-message");
        assert_eq!(listed[0]["ver"], id_of(&first));
        assert_eq!(bridge.ack(&r, id_of(&first)).await.status, 200);
        assert_eq!(state_of(&first).await, "fetched");

        // Signed and encrypted, as a self-hosted server sends.
        let vapid = py::VapidKey::generate().await;
        let signed = SendOptions::text("second")
            .vapid(&vapid)
            .vapid_sub("mailto:sender@self-hosted.example")
            .urgency("low")
            .ttl(60);
        let second = location(&bridge.push(&r, &signed).await);
        let got = bridge.google.wait_for(token, 2).await;
        assert_eq!(got[1].body, wake_up(token, "60s", "normal"));
        let third = location(&bridge.push(&r, &SendOptions::text("third")).await);
        assert_eq!(
            bridge.google.received_for(token).len(),
            2,
            "a message before the next fetch is coalesced"
        );

        let sample = base64::Engine::encode(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
            &body[..48],
        );
        let secrets = [
            r.channel_id.as_str(),
            id_of(&first),
            id_of(&second),
            id_of(&third),
            &sample,
            "self-hosted",
            "webpush-message",
            "aes128gcm",
            "chat-topic-7",
            "body",
            "chid",
        ];
        for received in bridge.google.received_for(token) {
            assert_holds_none_of(&as_text(&received), &secrets);
        }
        let listed = bridge.fetch_all(&r, 10).await;
        assert_eq!(bridge.texts(&listed).await, ["second", "third"]);
    }

    /// `"wake_only"` needs `"mailbox": true` (400, naming both) and a
    /// bridge that can wake (not GCM). The flag stays with the registration
    /// across a new token and a restart; `PUT` may turn it off, but not the
    /// mailbox under it.
    #[tokio::test]
    async fn wake_only_needs_a_mailbox_and_stays_with_its_registration() {
        let mut bridge = Bridge::start().await;
        for body in [
            json!({"token": "fcm-token-x", "wake_only": true}),
            json!({"token": "fcm-token-x", "mailbox": false, "wake_only": true}),
        ] {
            let refused = bridge.register_body("fcm", "app1", body).await;
            refused.assert_error(400, 110);
            let message = refused.json["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("wake_only") && message.contains("mailbox"),
                "{message}"
            );
        }
        let gcm = json!({"token": "gcm-token-x", "mailbox": true, "wake_only": true});
        bridge
            .register_body("gcm", SENDER_ID, gcm)
            .await
            .assert_error(400, 110);

        let r = bridge.register_wake_only("fcm-token-old").await;
        let updated = bridge.update(&r, json!({"token": "fcm-token-new"})).await;
        assert_eq!(updated.status, 200, "{}", updated.text);
        bridge.server.restart().await;
        bridge
            .push(&r, &SendOptions::text("one"))
            .await
            .assert_created();
        let got = bridge.google.wait_for("fcm-token-new", 1).await;
        assert_eq!(got[0].data(), &json!({"wake": "1"}));

        let no_mailbox = json!({"token": "fcm-token-new", "mailbox": false});
        bridge.update(&r, no_mailbox).await.assert_error(400, 110);
        let off = json!({"token": "fcm-token-new", "wake_only": false});
        let updated = bridge.update(&r, off).await;
        assert_eq!(updated.status, 200, "{}", updated.text);
        bridge
            .push(&r, &SendOptions::text("two"))
            .await
            .assert_created();
        let got = bridge.google.wait_for("fcm-token-new", 2).await;
        assert_eq!(bridge.decrypt(got[1].data()).await, "two");
        assert_eq!(
            bridge.texts(&bridge.fetch_all(&r, 10).await).await,
            ["one", "two"]
        );
        assert!(bridge.google.received_for("fcm-token-old").is_empty());
    }

    /// Google says a wake-only registration's device is gone (answering
    /// its wake-up): the registration goes, and the sender's next push is
    /// 410, as for a bridged push.
    #[tokio::test]
    async fn a_wake_only_device_google_calls_gone_loses_its_registration() {
        let bridge = Bridge::start().await;
        let token = "fcm-token-uninstalled";
        let r = bridge.register_wake_only(token).await;
        bridge.google.script(token, &[Reply::Unregistered]);
        bridge
            .push(&r, &SendOptions::text("anyone?"))
            .await
            .assert_created();
        bridge.google.wait_for(token, 1).await;
        let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
        loop {
            let sent = http::post_push(&r.endpoint, &[("TTL", "60")], None).await;
            if sent.status == 410 {
                break;
            }
            assert_eq!(sent.status, 201, "{}", sent.text);
            assert!(
                tokio::time::Instant::now() < deadline,
                "the registration was never removed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(bridge.google.received_for(token).len(), 1);
    }

    /// A body FCM cannot carry (over its 4 KB with the rest of the data)
    /// is 413 errno 104 naming the room there is, with or without a
    /// mailbox, and before anything goes to Google; a wake-only
    /// registration takes it, up to `--max-data-bytes` (413 past that too).
    #[tokio::test]
    async fn a_body_fcm_cannot_carry_is_413_unless_the_registration_is_wake_only() {
        let bridge = Bridge::start().await;
        let body = autopush_tests::opaque_body(4000);
        let headers = [
            ("TTL", "60"),
            ("Content-Type", "application/webpush-message"),
        ];
        let plain = bridge.register("fcm", "app1", "fcm-token-small").await;
        let boxed = bridge.register_mailbox("fcm-token-boxed").await;
        for r in [&plain, &boxed] {
            let refused = http::post_push(&r.endpoint, &headers, Some(body.clone())).await;
            refused.assert_error(413, 104);
            let message = refused.json["message"].as_str().unwrap_or_default();
            let limit = message
                .split("at most ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse::<usize>().ok());
            assert!(limit.is_some_and(|n| n < 4000), "{message}");
        }
        assert!(bridge.google.received().is_empty());
        assert!(bridge.fetch_all(&boxed, 10).await.is_empty());

        let private = bridge.register_wake_only("fcm-token-private").await;
        let sent = http::post_push(&private.endpoint, &headers, Some(body.clone())).await;
        assert_eq!(sent.status, 201, "{}", sent.text);
        let listed = bridge.fetch_all(&private, 10).await;
        assert!(body_bytes(&listed[0]) == body, "the fetched body differs");
        // TTL 0: no app fetches it in time.
        let now = location(
            &bridge
                .push(&private, &SendOptions::text("now").ttl(0))
                .await,
        );
        assert_eq!(state_of(&now).await, "dropped");
        let over = autopush_tests::opaque_body(autopush_tests::MAX_BODY_BYTES + 1);
        let refused = http::post_push(&private.endpoint, &headers, Some(over)).await;
        refused.assert_error(413, 104);
        let message = refused.json["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&autopush_tests::MAX_BODY_BYTES.to_string()),
            "{message}"
        );
    }

    on_every_backend!(
        the_mailbox_keeps_every_message,
        a_new_token_keeps_the_mailbox,
        the_mailbox_keeps_topic_ttl_and_delete_rules,
        a_full_mailbox_refuses_more,
        the_mailbox_needs_the_registration_secret,
        a_wake_only_registration_shows_google_nothing_of_the_message,
    );
}
