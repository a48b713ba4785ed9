//! Bridge calls are counted by router type, app and outcome, and timed, by
//! the gateway around any bridge router (here the test double registered as
//! `fcm`). Its own test process: the metrics recorder is global to a process.

use autopush_tests::bridge::{BridgeService, TIMEOUT_TOKEN, TestRouter};
use autopush_tests::http::{get, post_push, request};
use autopush_tests::prometheus::Scrape;
use reqwest::Method;
use serde_json::{Value, json};

async fn register(service: &BridgeService, app_id: &str, token: &str) -> String {
    let reply = request(
        Method::POST,
        &service.registration_url("fcm", app_id, ""),
        &[("content-type", "application/json")],
        Some(json!({ "token": token }).to_string().into_bytes()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    match &reply.json["endpoint"] {
        Value::String(endpoint) => endpoint.clone(),
        other => panic!("no endpoint ({other}): {}", reply.text),
    }
}

async fn push(endpoint: &str) -> u16 {
    post_push(
        endpoint,
        &[("ttl", "120"), ("content-encoding", "aes128gcm")],
        Some(b"opaque".to_vec()),
    )
    .await
    .status
}

#[tokio::test]
async fn bridge_calls_are_counted_by_app_and_outcome_and_timed() {
    let router = TestRouter::new(&["app1", "app2"]);
    let service = BridgeService::start(router.clone()).await;
    let app1 = register(&service, "app1", "device-token-1").await;
    let app2 = register(&service, "app2", "device-token-2").await;
    let slow = register(&service, "app2", TIMEOUT_TOKEN).await;
    for endpoint in [&app1, &app1, &app2] {
        assert_eq!(push(endpoint).await, 201);
    }
    assert_eq!(push(&slow).await, 502);
    assert_eq!(router.routed().len(), 3);

    let reply = get(&format!("{}/metrics", service.router_base())).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let s = Scrape::parse(&reply.text);
    let requests = |app, outcome| {
        s.value(
            "notification_bridge_request",
            &[("router_type", "fcm"), ("app", app), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("app1", "sent"), 2.0);
    assert_eq!(requests("app2", "sent"), 1.0);
    assert_eq!(requests("app2", "903"), 1.0);
    assert_eq!(s.sum("notification_bridge_request"), 4.0);
    let timed = |app| {
        s.value(
            "notification_bridge_time_count",
            &[("router_type", "fcm"), ("app", app)],
        )
    };
    assert_eq!((timed("app1"), timed("app2")), (2.0, 2.0));
    let delivered = s.value(
        "notification_delivery",
        &[("router_type", "fcm"), ("outcome", "direct")],
    );
    assert_eq!(delivered, 3.0);
    assert_eq!(
        s.value(
            "notification_received",
            &[("router_type", "fcm"), ("status", "502"), ("errno", "903")]
        ),
        1.0
    );
    for value in s.label_values() {
        assert!(
            !value.contains("device-"),
            "a device token in a label: {value}"
        );
    }
}
