//! The Matrix push gateway on the endpoint port (`/_matrix/push/v1/notify`):
//! a real Synapse pushes through it to a websocket client, and gets back
//! `rejected` once the subscription is gone; raw requests check the
//! discovery answer, pushkeys that are not ours, bad bodies, the rate limit,
//! stored delivery, and delivery through the FCM bridge (to Google's
//! stand-in).

use autopush_tests::google::{Google, Reply};
use autopush_tests::http::{RateLimit, get, request};
use autopush_tests::prometheus::Scrape;
use autopush_tests::synapse::Synapse;
use autopush_tests::*;
use base64::Engine;
use reqwest::Method;
use serde_json::{Value, json};

fn gateway_url(server: &Server) -> String {
    format!("{}/_matrix/push/v1/notify", server.endpoint_base())
}

/// POST a body to the gateway.
async fn notify(server: &Server, body: &[u8]) -> HttpReply {
    request(
        Method::POST,
        &gateway_url(server),
        &[("content-type", "application/json")],
        Some(body.to_vec()),
    )
    .await
}

/// A notification as a homeserver sends it, for these pushkeys.
fn notification(pushkeys: &[&str], body: &str) -> Value {
    let devices: Vec<Value> = pushkeys
        .iter()
        .map(|k| json!({"app_id": "org.example.app", "pushkey": k, "pushkey_ts": 1, "data": {"cs": "secret"}}))
        .collect();
    json!({"notification": {
        "event_id": "$event:example.org",
        "room_id": "!room:example.org",
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "content": {"msgtype": "m.text", "body": body},
        "counts": {"unread": 1},
        "prio": "high",
        "devices": devices,
    }})
}

/// The JSON a websocket notification carries, unencrypted.
fn received_json(message: &Value) -> Value {
    assert!(
        message.get("headers").is_none(),
        "a gateway notification has no encryption headers: {message}"
    );
    let data = message["data"]
        .as_str()
        .unwrap_or_else(|| panic!("no data: {message}"));
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(data)
        .unwrap_or_else(|e| panic!("data is not base64url ({e}): {message}"));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("data is not JSON ({e}): {message}"))
}

async fn matrix_outcome(server: &Server, outcome: &str) -> f64 {
    let reply = get(&format!("{}/metrics", server.router_base())).await;
    Scrape::parse(&reply.text)
        .get("notification_matrix", &[("outcome", outcome)])
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_synapse_user_is_notified_through_the_gateway_until_the_subscription_goes() {
    let (server, synapse) = tokio::join!(Server::start(), Synapse::start());
    let mut ws = server.client().await;
    let subscription = Subscription::new(&mut ws).await;

    let alice = synapse.register("alice").await;
    let bob = synapse.register("bob").await;
    let room = alice.create_room_with(&bob).await;
    bob.join(&room).await;
    bob.set_http_pusher(&gateway_url(&server), &subscription.endpoint)
        .await;
    assert_eq!(bob.pushkeys().await, vec![subscription.endpoint.clone()]);

    let event_id = alice.send_text(&room, "hello bob").await;
    let message = ws.recv_notification().await;
    assert_eq!(message["channelID"], subscription.channel_id.as_str());
    let received = received_json(&message);
    let n = &received["notification"];
    assert_eq!(n["event_id"], event_id.as_str(), "{received}");
    assert_eq!(n["room_id"], room.as_str(), "{received}");
    assert_eq!(n["sender"], alice.user_id.as_str(), "{received}");
    assert_eq!(n["content"]["body"], "hello bob", "{received}");
    assert_eq!(n["devices"][0]["pushkey"], subscription.endpoint.as_str());
    ws.ack_notification(&message).await;

    // The subscription goes: the next notification comes back rejected,
    // and Synapse deletes the pusher.
    let reply = ws.unregister(&subscription.channel_id, 200).await;
    assert_eq!(reply["status"], 200, "{reply}");
    alice.send_text(&room, "are you there?").await;
    bob.wait_for_no_pushers(&synapse).await;
    assert_eq!(matrix_outcome(&server, "gone").await, 1.0);
    assert_eq!(matrix_outcome(&server, "delivered").await, 1.0);
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn get_answers_the_unifiedpush_discovery_body() {
    let server = Server::start().await;
    let reply = get(&gateway_url(&server)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json, json!({"unifiedpush": {"gateway": "matrix"}}));
    let reply = request(Method::PUT, &gateway_url(&server), &[], None).await;
    assert_eq!(reply.status, 405, "{}", reply.text);
    assert_eq!(reply.json["errcode"], "M_UNRECOGNIZED", "{}", reply.text);
}

#[tokio::test]
async fn pushkeys_that_are_not_our_endpoints_are_rejected_and_never_fetched() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let ours = Subscription::new(&mut ws).await;
    let pinned = Subscription::with_vapid(&mut ws).await;
    let token = ours
        .endpoint
        .rsplit('/')
        .next()
        .expect("a token in the endpoint");
    // Anything listening here would see a request the gateway made.
    let elsewhere = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    elsewhere.set_nonblocking(true).expect("nonblocking");
    let elsewhere_port = elsewhere.local_addr().expect("addr").port();
    let foreign = [
        format!("https://push.example.com/wpush/v1/{token}"),
        format!("{}/wpush/v1/{}x", server.endpoint_base(), token),
        format!("{}/wpush/v1/not-a-token", server.endpoint_base()),
        format!("http://127.0.0.1:{elsewhere_port}/wpush/v1/{token}"),
        format!("http://127.0.0.1:{elsewhere_port}/_matrix/push/v1/notify"),
        format!("{}@127.0.0.1:{elsewhere_port}/", server.endpoint_base()),
        // Pinned to a VAPID key: only signed pushes, which a homeserver
        // cannot make.
        pinned.endpoint.clone(),
    ];
    let mut pushkeys: Vec<&str> = foreign.iter().map(String::as_str).collect();
    pushkeys.push(&ours.endpoint);
    let reply = notify(
        &server,
        notification(&pushkeys, "hi").to_string().as_bytes(),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json, json!({ "rejected": foreign }), "{}", reply.text);

    // Ours got it, alone in its devices; nothing reached the listener.
    let message = ws.recv_notification().await;
    assert_eq!(message["channelID"], ours.channel_id.as_str());
    let received = received_json(&message);
    assert_eq!(received["notification"]["content"]["body"], "hi");
    assert_eq!(
        received["notification"]["devices"],
        json!([{"app_id": "org.example.app", "pushkey": ours.endpoint, "pushkey_ts": 1,
            "data": {"cs": "secret"}}])
    );
    ws.assert_nothing_arrives().await;
    assert!(
        matches!(elsewhere.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the gateway connected to a pushkey's address"
    );
    assert_eq!(matrix_outcome(&server, "foreign").await, 7.0);
}

#[tokio::test]
async fn a_body_not_of_the_apis_shape_gets_a_matrix_error() {
    let server = Server::start().await;
    let reply = notify(&server, b"{not json").await;
    assert_eq!(reply.status, 400, "{}", reply.text);
    assert_eq!(reply.json["errcode"], "M_NOT_JSON", "{}", reply.text);
    assert!(reply.json["error"].is_string(), "{}", reply.text);
    for body in [
        json!([]),
        json!({"notification": {}}),
        json!({"notification": {"devices": [{"app_id": "a"}]}}),
        json!({"notification": {"devices": [], "prio": "urgent"}}),
    ] {
        let reply = notify(&server, body.to_string().as_bytes()).await;
        assert_eq!(reply.status, 400, "{body}: {}", reply.text);
        assert_eq!(
            reply.json["errcode"], "M_BAD_JSON",
            "{body}: {}",
            reply.text
        );
    }
}

#[tokio::test]
async fn a_homeserver_over_its_rate_gets_429_with_retry_after() {
    let server = Server::start_with(&["--matrix-gateway-limit", "0.001,2"]).await;
    let body = notification(&["https://push.example.com/wpush/v1/x"], "hi").to_string();
    for _ in 0..2 {
        let reply = notify(&server, body.as_bytes()).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    let reply = notify(&server, body.as_bytes()).await;
    assert_eq!(reply.status, 429, "{}", reply.text);
    assert_eq!(reply.json["errcode"], "M_LIMIT_EXCEEDED", "{}", reply.text);
    // The homeserver's bucket: 2 at once, refilled at one every 1000 s.
    let limit = RateLimit::refused(&reply.headers, "the homeserver's 3rd notification");
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("matrix_gateway", 2, Some(2000)),
        "{limit:?}"
    );
}

#[tokio::test]
async fn a_notification_for_an_offline_client_is_stored_and_delivered_at_hello() {
    let server = Server::start().await;
    let (uaid, subscription) = server.offline_subscription(false).await;
    let reply = notify(
        &server,
        notification(&[&subscription.endpoint], "while you were away")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json, json!({"rejected": []}));

    let mut ws = server.reconnect(&uaid).await;
    let message = ws.recv_notification().await;
    assert_eq!(message["channelID"], subscription.channel_id.as_str());
    let received = received_json(&message);
    assert_eq!(
        received["notification"]["content"]["body"],
        "while you were away"
    );
}

#[tokio::test]
async fn a_notification_too_large_for_a_push_arrives_event_id_only() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let subscription = Subscription::new(&mut ws).await;
    let long = "x".repeat(MAX_BODY_BYTES);
    let reply = notify(
        &server,
        notification(&[&subscription.endpoint], &long)
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_eq!(reply.json, json!({"rejected": []}), "{}", reply.text);
    let received = received_json(&ws.recv_notification().await);
    assert_eq!(
        received,
        json!({"notification": {
            "event_id": "$event:example.org",
            "room_id": "!room:example.org",
            "counts": {"unread": 1},
            "prio": "high",
            "devices": [{"app_id": "org.example.app", "pushkey": subscription.endpoint,
                "pushkey_ts": 1, "data": {"cs": "secret"}}],
        }})
    );
}

#[tokio::test]
async fn a_bridged_app_gets_the_notification_through_fcm_and_a_gone_device_is_rejected() {
    let google = Google::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let key_file = google.write_service_account(dir.path(), "service-account.json");
    let config = dir.path().join("autopush.toml");
    let toml = format!(
        "[fcm.apps.app1]\nproject_id = \"autopush-test\"\ncredential = \"{}\"\n\
         base_url = \"{}\"\n",
        key_file.display(),
        google.base_url()
    );
    std::fs::write(&config, toml).expect("write the settings file");
    let server = Server::start_with(&["--config", &config.display().to_string()]).await;
    let registration = request(
        Method::POST,
        &format!("{}/v1/fcm/app1/registration", server.endpoint_base()),
        &[("content-type", "application/json")],
        Some(json!({"token": "device-1"}).to_string().into_bytes()),
    )
    .await;
    assert_eq!(registration.status, 200, "{}", registration.text);
    let endpoint = registration.field("endpoint");

    let body = notification(&[&endpoint], "to the app").to_string();
    let reply = notify(&server, body.as_bytes()).await;
    assert_eq!(reply.json, json!({"rejected": []}), "{}", reply.text);
    let got = google.wait_for("device-1", 1).await;
    let data = got[0].data();
    assert!(data.get("con").is_none(), "not encrypted: {data}");
    let sent = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(
            data["body"]
                .as_str()
                .unwrap_or_else(|| panic!("no body: {data}")),
        )
        .expect("base64url");
    let sent: Value = serde_json::from_slice(&sent).expect("JSON");
    assert_eq!(sent["notification"]["content"]["body"], "to the app");

    // FCM says the app was uninstalled: the homeserver is told to stop.
    google.script("device-1", &[Reply::Unregistered]);
    let reply = notify(&server, body.as_bytes()).await;
    assert_eq!(
        reply.json,
        json!({ "rejected": [endpoint] }),
        "{}",
        reply.text
    );
}
