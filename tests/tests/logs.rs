//! Log hygiene: a UAID is a credential (a `hello` with it takes over the
//! user's connection) and keys are secrets, so neither may reach the logs,
//! even at debug level. Logs name users by a short hash of the UAID.

use autopush_tests::*;
use reqwest::Method;
use serde_json::json;
use sha2::{Digest, Sha256};

/// The tag logs use for a UAID, as the README tells operators to compute
/// it: the first 8 hex digits of SHA-256 of the 32-digit UAID.
fn tag(uaid: &str) -> String {
    hex_encode(&Sha256::digest(uaid.as_bytes()))[..8].to_string()
}

fn dashed(uaid: &str) -> String {
    uuid::Uuid::parse_str(uaid)
        .expect("a uaid")
        .hyphenated()
        .to_string()
}

#[tokio::test]
async fn debug_logs_name_users_by_a_hash_and_never_show_uaids_or_keys() {
    let server = Server::start_with_env(&[], &[("RUST_LOG", "debug")]).await;

    // A user agent's whole life: hello, register, direct push and ack,
    // unregister, stored push while away, reconnect and drain.
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("direct").await;
    let (notification, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "direct");
    ws.ack_notification(&notification).await;
    let other = Subscription::new(&mut ws).await;
    assert_eq!(ws.unregister(&other.channel_id, 200).await["status"], 200);
    ws.ping().await;
    ws.close().await;
    sub.push_text("stored").await;
    let mut ws = server.reconnect(&uaid).await;
    let (notification, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "stored");
    ws.ack_notification(&notification).await;

    // The router API, signed and not.
    let reply = server
        .router_call(Method::PUT, &format!("/notif/{uaid}"), None)
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = http::get(&format!("{}/user/{uaid}", server.router_base())).await;
    assert_eq!(reply.status, 401, "{reply:?}");

    // A user registered over /v1.
    let url = format!("{}/v1/webpush/app/registration", server.endpoint_base());
    let body = json!({"token": "t"}).to_string().into_bytes();
    let reply = http::request(
        Method::POST,
        &url,
        &[("content-type", "application/json")],
        Some(body),
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let registered = reply.json["uaid"].as_str().expect("uaid").to_string();
    ws.close().await;

    let logs = server.stderr();
    assert!(
        logs.contains(&tag(&uaid)),
        "the logs should name the user by its tag {}:\n{logs}",
        tag(&uaid)
    );
    for uaid in [&uaid, &registered] {
        for shown in [uaid.clone(), dashed(uaid)] {
            assert!(
                !logs.contains(&shown),
                "the UAID {shown} is in the logs:\n{logs}"
            );
        }
    }
    for key in ["crypto_key", "auth_key", "router_key"] {
        let path = server.data_dir().join(key);
        let text = std::fs::read_to_string(&path).expect("a generated key");
        let value = text.trim();
        assert!(!value.is_empty(), "{key} is empty");
        assert!(!logs.contains(value), "the {key} is in the logs:\n{logs}");
    }
}
