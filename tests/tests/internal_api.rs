//! The internal router API (router port only) and the health endpoints,
//! called directly over HTTP.

use std::time::{SystemTime, UNIX_EPOCH};

use autopush_tests::*;
use serde_json::{Value, json};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// A notification as the endpoint hands it to the connection node.
fn router_notification(chid: &str, version: &str, enc: &py::Encrypted) -> Value {
    json!({
        "channelID": chid,
        "version": version,
        "ttl": 60,
        "timestamp": now(),
        "data": enc.body,
        "headers": enc.headers,
    })
}

/// The user record's `connected_at` as it appears in a URL path.
fn connected_at(record: &Value) -> String {
    match &record["connected_at"] {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => panic!("no connected_at in the user record ({other}): {record}"),
    }
}

#[tokio::test]
async fn health_endpoints_answer_on_both_public_ports() {
    let server = Server::start().await;
    for base in [server.ws_http_base(), server.endpoint_base()] {
        for path in [
            "/health",
            "/__heartbeat__",
            "/__lbheartbeat__",
            "/__version__",
        ] {
            let reply = http::get(&format!("{base}{path}")).await;
            assert_eq!(reply.status, 200, "GET {base}{path}: {reply:?}");
        }
    }
}

#[tokio::test]
async fn put_push_delivers_to_a_connected_client() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    for (i, encoding) in Encoding::ALL.into_iter().enumerate() {
        let text = format!("via the router API ({})", encoding.as_str());
        let enc = py::encrypt(&sub.keys, &Payload::Text(text.clone()), encoding).await;
        let version = format!("v{i}");
        let url = format!("{}/push/{uaid}", server.router_base());
        let reply =
            http::put_json(&url, &router_notification(&sub.channel_id, &version, &enc)).await;
        assert_eq!(reply.status, 200, "PUT {url}: {reply:?}");

        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(d.text, text);
        assert_eq!(notif["version"], version.as_str(), "{notif}");
        ws.ack_notification(&notif).await;
    }
}

#[tokio::test]
async fn put_push_for_a_client_not_connected_here_is_404() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let enc = py::encrypt(
        &sub.keys,
        &Payload::Text("nobody home".into()),
        Encoding::Aes128Gcm,
    )
    .await;
    for who in [uaid, random_uaid()] {
        let url = format!("{}/push/{who}", server.router_base());
        let reply = http::put_json(&url, &router_notification(&sub.channel_id, "v1", &enc)).await;
        assert_eq!(reply.status, 404, "PUT {url}: {reply:?}");
    }
}

#[tokio::test]
async fn put_notif_answers_200_when_connected_and_404_otherwise() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;

    let reply = http::put(&format!("{}/notif/{uaid}", server.router_base())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    // The connection carries on.
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);

    let reply = http::put(&format!("{}/notif/{}", server.router_base(), random_uaid())).await;
    assert_eq!(reply.status, 404, "{reply:?}");
}

#[tokio::test]
async fn get_user_returns_the_record() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;

    let reply = http::get(&format!("{}/user/{uaid}", server.router_base())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let record = &reply.json;
    assert_eq!(
        record["uaid"].as_str().map(|u| u.replace('-', "")),
        Some(uaid.clone()),
        "{record}"
    );
    assert_eq!(record["router_type"], "webpush", "{record}");
    assert!(
        record["node_id"].as_str().is_some_and(|n| !n.is_empty()),
        "a connected client's record names its node: {record}"
    );
    connected_at(record);

    let reply = http::get(&format!("{}/user/{}", server.router_base(), random_uaid())).await;
    assert_eq!(reply.status, 404, "{reply:?}");
}

#[tokio::test]
async fn delete_notif_disconnects_only_the_matching_connection() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;
    let record = http::get(&format!("{}/user/{uaid}", server.router_base())).await;
    assert_eq!(record.status, 200, "{record:?}");
    let at = connected_at(&record.json);

    // Another connected_at: not this connection.
    let stale = if at == "1" { "2" } else { "1" };
    let reply = http::delete(&format!("{}/notif/{uaid}/{stale}", server.router_base())).await;
    assert_eq!(reply.status, 404, "{reply:?}");
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);

    let reply = http::delete(&format!("{}/notif/{uaid}/{at}", server.router_base())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    ws.expect_closed().await;
}

#[tokio::test]
async fn the_internal_api_is_not_served_on_the_public_ports() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let enc = py::encrypt(
        &sub.keys,
        &Payload::Text("sneaky".into()),
        Encoding::Aes128Gcm,
    )
    .await;
    let body = router_notification(&sub.channel_id, "v1", &enc);
    for base in [server.ws_http_base(), server.endpoint_base()] {
        let reply = http::put_json(&format!("{base}/push/{uaid}"), &body).await;
        assert!(
            !(200..300).contains(&reply.status),
            "PUT {base}/push: {reply:?}"
        );
        let reply = http::put(&format!("{base}/notif/{uaid}")).await;
        assert!(
            !(200..300).contains(&reply.status),
            "PUT {base}/notif: {reply:?}"
        );
        let reply = http::get(&format!("{base}/user/{uaid}")).await;
        assert!(
            !(200..300).contains(&reply.status),
            "GET {base}/user: {reply:?}"
        );
    }
    ws.assert_nothing_arrives().await;
}
