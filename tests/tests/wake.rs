//! Wake-ups end to end: a websocket client registers a wake route (an FCM
//! app of the server and its device token, or an APNs channel), leaves, and
//! its app gets one content-free wake-up through the local Google stand-in
//! (`autopush_tests::google`) or the APNs double, then reconnects and
//! drains what was stored. The real binary, except for APNs (in-process,
//! see `autopush_tests::apns`).

use std::time::Duration;

use autopush_apns::double::ApnsDouble;
use autopush_tests::apns::{self, ApnsService};
use autopush_tests::backend::{self, Db};
use autopush_tests::google::{Google, Received, Reply};
use autopush_tests::prometheus::Scrape;
use autopush_tests::{
    HANG_GUARD, Node, QUIET, SendOptions, Server, Subscription, WsClient, dynamo, http, scenarios,
};
use serde_json::{Value, json};
use tempfile::TempDir;

/// The FCM app every test server has.
const APP: &str = "app1";
/// The close code of a client that expects to be woken.
const EXPECTS_WAKE_UP: u16 = 4774;

/// The settings file naming FCM app [`APP`] on `google`, written in `dir`.
fn fcm_config(google: &Google, dir: &TempDir) -> String {
    let key_file = google.write_service_account(dir.path(), "service-account.json");
    let config = dir.path().join("autopush.toml");
    let toml = format!(
        "[fcm.apps.{APP}]\nproject_id = \"autopush-test\"\ncredential = \"{}\"\n\
         base_url = \"{}\"\ntimeout = 3\n",
        key_file.display(),
        google.base_url()
    );
    std::fs::write(&config, toml).expect("write the settings file");
    config.display().to_string()
}

/// Google's stand-in and an all-in-one server with FCM app [`APP`] there.
struct Fcm {
    google: Google,
    server: Server,
    _dir: TempDir,
}

impl Fcm {
    async fn start(args: &[&str]) -> Fcm {
        Fcm::start_on(Db::Embedded, args).await
    }

    /// [`Fcm::start`] on the storage backend `db`.
    async fn start_on(db: Db, args: &[&str]) -> Fcm {
        let google = Google::start().await;
        let dir = tempfile::tempdir().expect("temp dir");
        let config = fcm_config(&google, &dir);
        let mut all = vec!["--config", &config];
        all.extend_from_slice(args);
        let server = backend::start(db, &all).await;
        Fcm {
            google,
            server,
            _dir: dir,
        }
    }

    /// A client with one subscription and the wake route `token`.
    async fn client(&self, token: &str) -> (WsClient, Subscription) {
        let mut ws = self.server.client().await;
        let sub = Subscription::new(&mut ws).await;
        let reply = register_route(&mut ws, "fcm", APP, token).await;
        assert_eq!(reply["status"], 200, "wake: {reply}");
        (ws, sub)
    }

    async fn metric(&self, outcome: &str) -> f64 {
        let metrics = http::get(&format!("{}/metrics", self.server.router_base())).await;
        Scrape::parse(&metrics.text)
            .get(
                "notification_wake",
                &[("router_type", "fcm"), ("outcome", outcome)],
            )
            .unwrap_or(0.0)
    }

    /// Wait (hang-guarded) until `outcome` was counted `n` times.
    async fn wait_for_metric(&self, outcome: &str, n: f64) {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        while self.metric(outcome).await < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "notification_wake {outcome} never reached {n}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Send `{"messageType":"wake",...}` and return the answer.
async fn register_route(ws: &mut WsClient, router: &str, app_id: &str, token: &str) -> Value {
    ws.send_json(
        json!({"messageType": "wake", "router": router, "app_id": app_id, "token": token}),
    )
    .await;
    ws.recv_type("wake").await
}

/// An FCM registration token as Google issues them (the shape checked).
fn fcm_token() -> String {
    format!("wake-{}:APA91b", uuid::Uuid::new_v4().simple())
}

/// The wake-up carries one fixed key and nothing of the messages behind it.
fn assert_content_free(wake_up: &Received, sub: &Subscription, sent: &[String]) {
    let android = &wake_up.body["message"]["android"];
    assert_eq!(android["data"], json!({"wake": "1"}), "{}", wake_up.body);
    assert_eq!(android["collapse_key"], "wake", "{}", wake_up.body);
    let text = wake_up.body.to_string();
    assert!(!text.contains(&sub.channel_id), "channel id in {text}");
    for location in sent {
        let id = location.rsplit('/').next().unwrap_or_default();
        assert!(!text.contains(id), "message id in {text}");
    }
    assert!(!text.contains("body"), "ciphertext in {text}");
}

#[tokio::test]
async fn an_fcm_route_wakes_an_absent_client_once_and_it_drains_everything() {
    let fcm = Fcm::start(&[]).await;
    let token = fcm_token();
    let (ws, sub) = fcm.client(&token).await;
    let uaid = ws.uaid().to_owned();
    ws.close_with(EXPECTS_WAKE_UP).await;

    let mut locations = Vec::new();
    for i in 0..5 {
        let sent = sub.push_text(&format!("message {i}")).await;
        locations.push(sent.headers["location"].clone());
    }
    let wake_ups = fcm.google.wait_for(&token, 1).await;
    assert_content_free(&wake_ups[0], &sub, &locations);
    assert_eq!(wake_ups[0].body["message"]["android"]["priority"], "high");
    fcm.wait_for_metric("coalesced", 4.0).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        fcm.google.received_for(&token).len(),
        1,
        "one wake-up for 5"
    );
    assert_eq!(fcm.metric("sent").await, 1.0);
    assert!(
        fcm.server.stderr().contains("expecting a wake-up"),
        "close code 4774 not logged"
    );

    let mut ws = fcm.server.reconnect(&uaid).await;
    for i in 0..5 {
        let (n, plain) = sub.receive(&mut ws).await;
        assert_eq!(plain.text, format!("message {i}"));
        ws.ack_notification(&n).await;
    }
}

#[tokio::test]
async fn a_connected_client_gets_its_messages_and_no_wake_up() {
    let fcm = Fcm::start(&[]).await;
    let token = fcm_token();
    let (mut ws, sub) = fcm.client(&token).await;
    for i in 0..3 {
        sub.push_text(&format!("live {i}")).await;
        let (n, plain) = sub.receive(&mut ws).await;
        assert_eq!(plain.text, format!("live {i}"));
        ws.ack_notification(&n).await;
    }
    tokio::time::sleep(QUIET).await;
    assert!(fcm.google.received_for(&token).is_empty());
}

#[tokio::test]
async fn after_the_interval_the_next_message_wakes_again() {
    let fcm = Fcm::start(&["--wake-interval", "1"]).await;
    let token = fcm_token();
    let (ws, sub) = fcm.client(&token).await;
    ws.close().await;
    sub.push_text("first").await;
    fcm.google.wait_for(&token, 1).await;
    // Past the interval: not an assertion on time, only a wait beyond it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sub.push_text("second").await;
    fcm.google.wait_for(&token, 2).await;
}

/// On every backend: DynamoDB keeps `last_connect` by the hour, so the
/// rule reads the reconnection from `connected_at`.
async fn a_client_that_answered_its_wake_up_is_woken_again_within_the_interval(db: Db) {
    let fcm = Fcm::start_on(db, &["--wake-interval", "3600"]).await;
    let token = fcm_token();
    let (ws, sub) = fcm.client(&token).await;
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    sub.push_text("first").await;
    fcm.google.wait_for(&token, 1).await;
    let mut ws = fcm.server.reconnect(&uaid).await;
    let (n, _) = sub.receive(&mut ws).await;
    ws.ack_notification(&n).await;
    ws.close().await;
    sub.push_text("second").await;
    fcm.google.wait_for(&token, 2).await;
    sub.push_text("third").await;
    fcm.wait_for_metric("coalesced", 1.0).await;
    assert_eq!(fcm.google.received_for(&token).len(), 2);
}

autopush_tests::on_every_backend!(
    a_client_that_answered_its_wake_up_is_woken_again_within_the_interval
);

#[tokio::test]
async fn a_very_low_message_under_the_normal_threshold_wakes_nobody() {
    let fcm = Fcm::start(&[]).await;
    let token = fcm_token();
    let (ws, sub) = fcm.client(&token).await;
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    let mut very_low = SendOptions::text("can wait");
    very_low.urgency = Some("very-low".into());
    sub.send(&very_low).await.assert_created();
    let mut low = SendOptions::text("can wait too");
    low.urgency = Some("low".into());
    sub.send(&low).await.assert_created();
    sub.push_text("now").await;
    let wake_ups = fcm.google.wait_for(&token, 1).await;
    assert_eq!(wake_ups[0].body["message"]["android"]["priority"], "high");
    tokio::time::sleep(QUIET).await;
    assert_eq!(fcm.google.received_for(&token).len(), 1);
    assert_eq!(fcm.metric("coalesced").await, 0.0, "nothing to coalesce");

    let mut ws = fcm.server.reconnect(&uaid).await;
    let texts: Vec<String> = {
        let mut texts = Vec::new();
        for _ in 0..3 {
            texts.push(sub.receive(&mut ws).await.1.text);
        }
        texts
    };
    assert_eq!(texts, ["can wait", "can wait too", "now"]);
}

#[tokio::test]
async fn a_token_google_calls_gone_loses_its_route_not_its_subscription() {
    let fcm = Fcm::start(&["--wake-interval", "0"]).await;
    let token = fcm_token();
    fcm.google.script(&token, &[Reply::Unregistered]);
    let (ws, sub) = fcm.client(&token).await;
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    sub.push_text("one").await;
    fcm.google.wait_for(&token, 1).await;
    fcm.wait_for_metric("failed", 1.0).await;
    // With the route gone, an interval of 0 wakes nobody.
    sub.push_text("two").await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(fcm.google.received_for(&token).len(), 1);

    let mut ws = fcm.server.reconnect(&uaid).await;
    for text in ["one", "two"] {
        let (n, plain) = sub.receive(&mut ws).await;
        assert_eq!(plain.text, text);
        ws.ack_notification(&n).await;
    }
    sub.push_text("three").await;
    assert_eq!(sub.receive(&mut ws).await.1.text, "three");
}

#[tokio::test]
async fn unknown_apps_and_malformed_tokens_are_refused() {
    let fcm = Fcm::start(&[]).await;
    let mut ws = fcm.server.client().await;
    let reply = register_route(&mut ws, "fcm", "nope", &fcm_token()).await;
    assert_eq!(reply["status"], 404, "{reply}");
    let reply = register_route(&mut ws, "fcm", APP, "has space").await;
    assert_eq!(reply["status"], 400, "{reply}");
    let reply = register_route(&mut ws, "apns", APP, &apns::device_token()).await;
    assert_eq!(reply["status"], 404, "no APNs here: {reply}");
    let reply = register_route(&mut ws, "gcm", APP, &fcm_token()).await;
    assert_eq!(reply["status"], 400, "{reply}");
    // Removing a route that was never set is fine.
    ws.send_json(json!({"messageType": "wake", "router": null}))
        .await;
    assert_eq!(ws.recv_type("wake").await["status"], 200);
}

#[tokio::test]
async fn an_apns_route_gets_a_background_push_and_high_gets_an_alert() {
    let double = ApnsDouble::new();
    let service = ApnsService::start_configured(double.clone(), |layer| {
        layer.wake_interval = Some(0.0);
    })
    .await;
    let token = apns::device_token();
    let mut ws = WsClient::connect_hello(service.ws_url(), None).await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let reply = register_route(&mut ws, "apns", "nope", &token).await;
    assert_eq!(reply["status"], 404, "{reply}");
    let reply = register_route(&mut ws, "apns", apns::FIREFOX, "not-hex").await;
    assert_eq!(reply["status"], 400, "{reply}");
    let reply = register_route(&mut ws, "apns", apns::FIREFOX, &token).await;
    assert_eq!(reply["status"], 200, "{reply}");
    ws.close_with(EXPECTS_WAKE_UP).await;

    sub.push_text("normal").await;
    double.wait_for(1).await;
    let mut high = SendOptions::text("urgent");
    high.urgency = Some("high".into());
    sub.send(&high).await.assert_created();
    double.wait_for(2).await;
    let sent = double.requests_for(&token);
    assert_eq!(sent.len(), 2);
    let background = apns::headers(&sent[0]);
    assert_eq!(background["apns-push-type"], "background");
    assert_eq!(background["apns-priority"], "5");
    assert_eq!(background["apns-collapse-id"], "wake");
    assert_eq!(background["apns-topic"], apns::FIREFOX_TOPIC);
    assert_eq!(
        apns::payload(&sent[0]),
        json!({"aps": {"content-available": 1}, "wake": 1})
    );
    let alert = apns::headers(&sent[1]);
    assert_eq!(alert["apns-push-type"], "alert");
    assert_eq!(alert["apns-collapse-id"], "wake");
    let body = apns::payload(&sent[1]);
    assert_eq!(body["aps"]["alert"]["title"], "New message");
    assert_eq!(body["aps"]["mutable-content"], 1);
    for request in &sent {
        let text = &request.request.payload;
        assert!(!text.contains(&sub.channel_id), "channel id in {text}");
        assert!(!text.contains("body"), "ciphertext in {text}");
    }

    // Apple says the token is gone: the route goes, the subscription stays.
    double.script(
        &token,
        [autopush_apns::double::Outcome::refused(410, "Unregistered")],
    );
    sub.push_text("gone").await;
    double.wait_for(3).await;
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    loop {
        // Each push while the route is there wakes (interval 0).
        let before = double.count();
        sub.push_text("after").await;
        tokio::time::sleep(QUIET).await;
        if double.count() == before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "route never removed"
        );
    }
    let mut ws = WsClient::connect_hello(service.ws_url(), Some(&uaid)).await;
    let mut texts = Vec::new();
    loop {
        let (n, plain) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
        texts.push(plain.text.clone());
        if texts.last().map(String::as_str) == Some("after") && texts.len() >= 4 {
            break;
        }
    }
    assert_eq!(texts[..3], ["normal", "urgent", "gone"]);
}

/// Two endpoint nodes and a connection node on one DynamoDB, all with FCM
/// app [`APP`]: pushes for an absent client reach both endpoint nodes at
/// once, and one wake-up goes out, whichever node stored what.
#[tokio::test]
async fn two_endpoint_nodes_send_one_wake_up_between_them() {
    let server = dynamo::local().await;
    let google = Google::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = fcm_config(&google, &dir);
    let tables = dynamo::tables();
    dynamo::connect(&server.endpoint, tables.clone())
        .await
        .create_tables()
        .await
        .expect("create tables");
    let mut args = vec![
        format!("--router-table={}", tables.router),
        format!("--message-table={}", tables.message),
        format!("--config={config}"),
    ];
    args.extend(scenarios::cluster_keys().await);
    let env: Vec<(String, String)> = dynamo::aws_env(&server.endpoint)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let node = |role, endpoint_url: Option<String>| Node {
        role,
        db: Some("dynamodb".into()),
        endpoint_url,
        env: env.clone(),
        args: args.clone(),
        clock_offset_secs: 0,
    };
    let a = Server::start_node(node("endpoint", None)).await;
    let b = Server::start_node(node("endpoint", None)).await;
    let connection = Server::start_node(node("connection", Some(a.endpoint_base()))).await;

    let token = fcm_token();
    let mut ws = connection.client().await;
    let sub = Subscription::new(&mut ws).await;
    let reply = register_route(&mut ws, "fcm", APP, &token).await;
    assert_eq!(reply["status"], 200, "wake: {reply}");
    let uaid = ws.uaid().to_owned();
    ws.close_with(EXPECTS_WAKE_UP).await;

    let via_b = Subscription {
        endpoint: sub.endpoint.replace(&a.endpoint_base(), &b.endpoint_base()),
        channel_id: sub.channel_id.clone(),
        keys: sub.keys.clone(),
        vapid: None,
    };
    assert_ne!(via_b.endpoint, sub.endpoint);
    for round in 0..3 {
        let (text_a, text_b) = (format!("a{round}"), format!("b{round}"));
        let (on_a, on_b) = tokio::join!(sub.push_text(&text_a), via_b.push_text(&text_b));
        on_a.assert_created();
        on_b.assert_created();
    }
    google.wait_for(&token, 1).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(google.received_for(&token).len(), 1, "one wake-up for 6");

    let mut ws = connection.reconnect(&uaid).await;
    let mut texts = Vec::new();
    for _ in 0..6 {
        let (n, plain) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
        texts.push(plain.text.clone());
    }
    texts.sort();
    assert_eq!(texts, ["a0", "a1", "a2", "b0", "b1", "b2"]);
}

/// The figure in BENCHMARKS.md: wake-ups per 1 000 messages for a phone
/// that, woken, connects, drains and acks until 300 ms pass without a
/// message, then leaves with 4774; the messages come in 50 bursts of 20, a
/// second apart. A bridged registration would cost one push per message.
/// `cargo test -p autopush-tests --test wake -- --ignored --nocapture`
#[tokio::test]
#[ignore = "a measurement: run by hand for BENCHMARKS.md"]
async fn wake_ups_per_thousand_messages() {
    const BURSTS: usize = 50;
    const PER_BURST: usize = 20;
    let total = BURSTS * PER_BURST;
    // One sender for one subscription: over its unsigned rate otherwise.
    let fcm = Fcm::start(&["--subscription-limit", "0"]).await;
    let token = fcm_token();
    let (ws, sub) = fcm.client(&token).await;
    let uaid = ws.uaid().to_owned();
    ws.close_with(EXPECTS_WAKE_UP).await;
    let sent_all = std::sync::atomic::AtomicBool::new(false);

    let sender = async {
        for _ in 0..BURSTS {
            for _ in 0..PER_BURST {
                let reply = http::request(
                    reqwest::Method::POST,
                    &sub.endpoint,
                    &[("ttl", "600")],
                    None,
                )
                .await;
                assert_eq!(reply.status, 201, "{}", reply.text);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        sent_all.store(true, std::sync::atomic::Ordering::Relaxed);
    };
    let phone = async {
        let (mut handled, mut delivered) = (0, std::collections::HashSet::new());
        while delivered.len() < total {
            let woken = fcm.google.received_for(&token).len();
            let done = sent_all.load(std::sync::atomic::Ordering::Relaxed);
            if woken == handled && !done {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            handled = woken;
            let mut ws = fcm.server.reconnect(&uaid).await;
            while let Some(n) = ws.try_recv_for(Duration::from_millis(300)).await {
                if n["messageType"] == "notification" {
                    ws.ack_notification(&n).await;
                    delivered.insert(n["version"].as_str().unwrap_or_default().to_owned());
                }
            }
            ws.close_with(EXPECTS_WAKE_UP).await;
        }
        delivered.len()
    };
    let ((), delivered) = tokio::join!(sender, phone);
    assert_eq!(delivered, total);
    let wake_ups = fcm.google.received_for(&token).len();
    eprintln!(
        "{total} messages in {BURSTS} bursts: {wake_ups} wake-ups ({} per 1 000), {} coalesced; \
         a bridged registration: {total} pushes",
        wake_ups * 1000 / total,
        fcm.metric("coalesced").await
    );
}
