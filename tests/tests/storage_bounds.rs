//! Storage stays bounded: channels per user agent are capped, and idle users
//! are swept in the background.

use std::time::Duration;

use autopush_tests::http::{self, request};
use autopush_tests::*;
use reqwest::Method;
use serde_json::json;

#[tokio::test]
async fn channels_per_user_agent_are_capped_over_the_websocket() {
    let server = Server::start_with(&["--max-channels", "2"]).await;
    let mut ws = server.client().await;
    for _ in 0..2 {
        Subscription::new(&mut ws).await;
    }
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 413, "{reply}");
    assert!(
        reply["reason"]
            .as_str()
            .is_some_and(|r| r.contains("at most 2")),
        "{reply}"
    );
    // The connection stays usable.
    ws.ping().await;
}

#[tokio::test]
async fn subscriptions_per_registration_are_capped_over_v1() {
    let server = Server::start_with(&["--max-channels", "1"]).await;
    let base = format!("{}/v1/webpush/app/registration", server.endpoint_base());
    let created = request(
        Method::POST,
        &base,
        &[("content-type", "application/json")],
        Some(json!({}).to_string().into_bytes()),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.text);
    let uaid = created.json["uaid"].as_str().unwrap();
    let auth = format!("Bearer {}", created.json["secret"].as_str().unwrap());
    let more = request(
        Method::POST,
        &format!("{base}/{uaid}/subscription"),
        &[
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ],
        Some(json!({}).to_string().into_bytes()),
    )
    .await;
    more.assert_error(400, 110);
    assert!(more.text.contains("at most 1"), "{}", more.text);
}

/// A user agent that has not connected for longer than
/// `--drop-idle-users-after-days` is removed by the housekeeping sweep:
/// its endpoints answer 410.
#[tokio::test]
async fn idle_users_are_swept() {
    // 0.00002 days is about 1.7 s.
    let server = Server::start_with(&[
        "--sweep-interval",
        "0.2",
        "--drop-idle-users-after-days",
        "0.00002",
    ])
    .await;
    let (_, sub) = server.offline_subscription(false).await;
    until_swept(&sub, HANG_GUARD).await;
}

/// Push to `sub` until it answers 410 (its user was swept); panics after
/// `guard`.
async fn until_swept(sub: &Subscription, guard: Duration) {
    let guard = tokio::time::Instant::now() + guard;
    loop {
        let reply = http::post_push(&sub.endpoint, &[("ttl", "60")], None).await;
        if reply.status == 410 {
            reply.assert_error(410, 103);
            return;
        }
        assert_eq!(reply.status, 201, "{}", reply.text);
        assert!(
            tokio::time::Instant::now() < guard,
            "the idle user was never swept"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A client connected for longer than the idle window is not idle: the
/// sweep that removes an offline user agent keeps it, and it keeps
/// receiving on the same connection.
#[tokio::test]
async fn connected_clients_are_never_swept_as_idle() {
    // 0.0001 days is about 8.6 s.
    let server = Server::start_with(&[
        "--sweep-interval",
        "0.2",
        "--drop-idle-users-after-days",
        "0.0001",
    ])
    .await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    // Said hello after the connected client: idle for less long.
    let (_, offline) = server.offline_subscription(false).await;
    // The window alone is most of a hang guard.
    until_swept(&offline, 4 * HANG_GUARD).await;
    let reply = http::post_push(&sub.endpoint, &[("ttl", "60")], None).await;
    reply.assert_created();
    let notification = ws.recv_notification().await;
    assert_eq!(
        notification["channelID"],
        sub.channel_id.as_str(),
        "{notification}"
    );
}
