//! The router registry and the `/v1` bridge registration API, over HTTP, with
//! a test-double bridge registered as `fcm` for apps `app1` and `app2`.

use autopush_tests::bridge::{BridgeService, GONE_TOKEN, TIMEOUT_TOKEN, TestRouter};
use autopush_tests::http::{self, HttpReply, request};
use autopush_tests::{WsClient, new_channel_id};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use reqwest::Method;
use serde_json::{Value, json};

struct Registered {
    uaid: String,
    secret: String,
    endpoint: String,
    channel_id: String,
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

async fn register(
    service: &BridgeService,
    router_type: &str,
    app_id: &str,
    body: Value,
) -> Registered {
    let reply = call(
        Method::POST,
        &service.registration_url(router_type, app_id, ""),
        None,
        Some(body),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let field = |name: &str| reply.field(name);
    Registered {
        uaid: field("uaid"),
        secret: field("secret"),
        endpoint: field("endpoint"),
        channel_id: field("channelID"),
    }
}

async fn channels(service: &BridgeService, r: &Registered) -> Vec<String> {
    let url = service.registration_url("fcm", "app1", &format!("/{}/", r.uaid));
    let reply = call(Method::GET, &url, Some(&r.secret), None).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json["uid"], r.uaid);
    let mut ids: Vec<String> = reply.json["channelIDs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

async fn push(endpoint: &str, body: &[u8]) -> HttpReply {
    http::post_push(
        endpoint,
        &[
            ("ttl", "120"),
            ("topic", "news"),
            ("content-encoding", "aes128gcm"),
        ],
        Some(body.to_vec()),
    )
    .await
}

#[tokio::test]
async fn registration_returns_credentials_and_a_working_endpoint() {
    let router = TestRouter::new(&["app1", "app2"]);
    let service = BridgeService::start(router.clone()).await;
    let r = register(&service, "fcm", "app1", json!({"token": "device-1"})).await;
    assert_eq!(r.uaid.len(), 32);
    assert!(r.uaid.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(r.endpoint.contains("/wpush/v1/"), "{}", r.endpoint);
    assert_eq!(channels(&service, &r).await, vec![r.channel_id.clone()]);

    let body = b"opaque encrypted bytes";
    let reply = push(&r.endpoint, body).await;
    reply.assert_created();
    assert_eq!(reply.header("ttl"), Some("120"));

    let routed = router.routed();
    assert_eq!(routed.len(), 1);
    let n = &routed[0].notification;
    assert_eq!(n.channel_id.to_string(), r.channel_id);
    assert_eq!(
        n.data.as_deref(),
        Some(URL_SAFE_NO_PAD.encode(body).as_str())
    );
    assert_eq!(n.headers.as_ref().unwrap()["encoding"], "aes128gcm");
    assert_eq!((n.ttl, n.topic.as_deref()), (120, Some("news")));
    assert_eq!(
        routed[0].user.router_data.as_ref().unwrap()["token"],
        "device-1"
    );
    assert!(reply.header("location").unwrap().ends_with(&n.version));
}

#[tokio::test]
async fn the_router_may_amend_the_registration_reply() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let reply = call(
        Method::POST,
        &service.registration_url("fcm", "app1", ""),
        None,
        Some(json!({"token": "t"})),
    )
    .await;
    assert_eq!(reply.json["senderid"], "test-sender", "{}", reply.text);
}

#[tokio::test]
async fn registration_with_a_channel_and_key_gives_a_restricted_endpoint() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let chid = new_channel_id();
    let key = URL_SAFE_NO_PAD.encode([4u8; 65]);
    let r = register(
        &service,
        "fcm",
        "app1",
        json!({"token": "t", "channelID": chid, "key": key}),
    )
    .await;
    assert_eq!(r.channel_id, chid);
    assert!(r.endpoint.contains("/wpush/v2/"), "{}", r.endpoint);
    push(&r.endpoint, b"x").await.assert_error(401, 109);
}

#[tokio::test]
async fn token_updates_reach_the_router() {
    let router = TestRouter::new(&["app1"]);
    let service = BridgeService::start(router.clone()).await;
    let r = register(&service, "fcm", "app1", json!({"token": "old-token"})).await;
    let url = service.registration_url("fcm", "app1", &format!("/{}", r.uaid));
    let reply = call(
        Method::PUT,
        &url,
        Some(&r.secret),
        Some(json!({"token": "new-token"})),
    )
    .await;
    assert_eq!(
        (reply.status, reply.json.clone()),
        (200, json!({})),
        "{}",
        reply.text
    );
    push(&r.endpoint, b"x").await.assert_created();
    assert_eq!(
        router.routed()[0].user.router_data.as_ref().unwrap()["token"],
        "new-token"
    );
}

#[tokio::test]
async fn channels_can_be_added_and_removed() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let r = register(&service, "fcm", "app1", json!({"token": "t"})).await;
    let sub_url = service.registration_url("fcm", "app1", &format!("/{}/subscription", r.uaid));

    let chid = new_channel_id();
    let added = call(
        Method::POST,
        &sub_url,
        Some(&r.secret),
        Some(json!({"channelID": chid})),
    )
    .await;
    assert_eq!(added.status, 200, "{}", added.text);
    assert_eq!(added.json["channelID"], chid);
    let second_endpoint = added.json["endpoint"].as_str().unwrap().to_owned();
    let generated = call(Method::POST, &sub_url, Some(&r.secret), None).await;
    assert_eq!(generated.status, 200, "{}", generated.text);
    let generated_id = generated.json["channelID"].as_str().unwrap().to_owned();

    let mut expected = vec![r.channel_id.clone(), chid.clone(), generated_id];
    expected.sort();
    assert_eq!(channels(&service, &r).await, expected);

    let remove_url = format!("{sub_url}/{chid}");
    let removed = call(Method::DELETE, &remove_url, Some(&r.secret), None).await;
    assert_eq!(
        (removed.status, removed.json.clone()),
        (200, json!({})),
        "{}",
        removed.text
    );
    assert!(!channels(&service, &r).await.contains(&chid));
    push(&second_endpoint, b"x").await.assert_error(410, 106);
    call(Method::DELETE, &remove_url, Some(&r.secret), None)
        .await
        .assert_error(410, 106);
    push(&r.endpoint, b"x").await.assert_created();
}

#[tokio::test]
async fn unregistering_the_uaid_drops_everything() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let r = register(&service, "fcm", "app1", json!({"token": "t"})).await;
    let url = service.registration_url("fcm", "app1", &format!("/{}", r.uaid));
    let reply = call(Method::DELETE, &url, Some(&r.secret), None).await;
    assert_eq!(
        (reply.status, reply.json.clone()),
        (200, json!({})),
        "{}",
        reply.text
    );
    call(Method::GET, &format!("{url}/"), Some(&r.secret), None)
        .await
        .assert_error(410, 103);
    push(&r.endpoint, b"x").await.assert_error(410, 103);
}

#[tokio::test]
async fn every_call_on_a_uaid_needs_its_secret() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let r = register(&service, "fcm", "app1", json!({"token": "t"})).await;
    let other = register(&service, "fcm", "app1", json!({"token": "u"})).await;
    let base = service.registration_url("fcm", "app1", &format!("/{}", r.uaid));
    let calls = [
        (Method::GET, format!("{base}/")),
        (Method::PUT, base.clone()),
        (Method::DELETE, base.clone()),
        (Method::POST, format!("{base}/subscription")),
        (
            Method::DELETE,
            format!("{base}/subscription/{}", r.channel_id),
        ),
    ];
    for (method, url) in calls {
        for secret in [None, Some("wrong"), Some(other.secret.as_str())] {
            let body = Some(json!({"token": "t"}));
            call(method.clone(), &url, secret, body)
                .await
                .assert_error(401, 109);
        }
        let basic = request(
            method.clone(),
            &url,
            &[("authorization", &format!("Basic {}", r.secret))],
            None,
        )
        .await;
        basic.assert_error(401, 109);
    }
    // Nothing was changed by the refused calls.
    assert_eq!(channels(&service, &r).await, vec![r.channel_id.clone()]);
}

#[tokio::test]
async fn bad_requests_are_refused_with_their_errno() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let new = |router_type: &str, app_id: &str| service.registration_url(router_type, app_id, "");
    let cases = [
        (new("fcm", "app1"), json!({}), 400, 110), // missing token
        (new("fcm", "app1"), json!({"token": ""}), 400, 110), // empty token
        (
            new("fcm", "app1"),
            json!({"token": "t", "channelID": "NOT-A-UUID"}),
            400,
            110,
        ), // bad channelID
        (
            new("fcm", "app1"),
            json!({"token": "t", "key": "short"}),
            400,
            110,
        ), // bad key
        (new("bogus", "app1"), json!({"token": "t"}), 400, 108), // unknown type
        (new("apns", "app1"), json!({"token": "t"}), 400, 108), // not configured here
        (new("fcm", "unknown-app"), json!({"token": "t"}), 400, 108), // unknown app
    ];
    for (url, body, status, errno) in cases {
        call(Method::POST, &url, None, Some(body))
            .await
            .assert_error(status, errno);
    }
    let invalid_json = request(
        Method::POST,
        &new("fcm", "app1"),
        &[],
        Some(b"{not json".to_vec()),
    )
    .await;
    invalid_json.assert_error(400, 110);
}

#[tokio::test]
async fn a_uaid_is_only_reachable_under_its_own_router_type_and_app() {
    let service = BridgeService::start(TestRouter::new(&["app1", "app2"])).await;
    let r = register(&service, "fcm", "app1", json!({"token": "t"})).await;
    for (router_type, app_id) in [("fcm", "app2"), ("webpush", "app1")] {
        let url = service.registration_url(router_type, app_id, &format!("/{}/", r.uaid));
        call(Method::GET, &url, Some(&r.secret), None)
            .await
            .assert_error(404, 102);
    }
}

#[tokio::test]
async fn bridge_failures_map_to_their_status_and_errno() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let gone = register(&service, "fcm", "app1", json!({"token": GONE_TOKEN})).await;
    push(&gone.endpoint, b"x").await.assert_error(410, 106);
    let slow = register(&service, "fcm", "app1", json!({"token": TIMEOUT_TOKEN})).await;
    push(&slow.endpoint, b"x").await.assert_error(502, 903);
}

#[tokio::test]
async fn webpush_clients_may_register_over_http_and_connect_later() {
    let service = BridgeService::start(TestRouter::new(&["app1"])).await;
    let reply = call(
        Method::POST,
        &service.registration_url("webpush", "any", ""),
        None,
        Some(json!({})),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let (uaid, endpoint) = (
        reply.json["uaid"].as_str().unwrap(),
        reply.json["endpoint"].as_str().unwrap(),
    );
    http::post_push(endpoint, &[("ttl", "60")], None)
        .await
        .assert_created();

    let mut ws = WsClient::connect_hello(service.ws_url(), Some(uaid)).await;
    assert_eq!(ws.uaid(), uaid);
    let notification = ws.recv_notification().await;
    assert_eq!(notification["channelID"], reply.json["channelID"]);
}
