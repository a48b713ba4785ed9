//! The internal router API (router port only, every call signed with the
//! router key) and the health endpoints, called directly over HTTP.

use autopush_tests::http::router_notification;
use autopush_tests::*;
use reqwest::Method;
use serde_json::{Value, json};

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
        let body = router_notification(&sub.channel_id, &version, &enc);
        let reply = server
            .router_call(Method::PUT, &format!("/push/{uaid}"), Some(&body))
            .await;
        assert_eq!(reply.status, 200, "PUT /push: {reply:?}");

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
        let body = router_notification(&sub.channel_id, "v1", &enc);
        let reply = server
            .router_call(Method::PUT, &format!("/push/{who}"), Some(&body))
            .await;
        assert_eq!(reply.status, 404, "PUT /push/{who}: {reply:?}");
    }
}

#[tokio::test]
async fn put_notif_answers_200_when_connected_and_404_otherwise() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;

    let reply = server
        .router_call(Method::PUT, &format!("/notif/{uaid}"), None)
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    // The connection carries on.
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);

    let reply = server
        .router_call(Method::PUT, &format!("/notif/{}", random_uaid()), None)
        .await;
    assert_eq!(reply.status, 404, "{reply:?}");
}

#[tokio::test]
async fn get_user_returns_the_record() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;

    let reply = server
        .router_call(Method::GET, &format!("/user/{uaid}"), None)
        .await;
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

    let reply = server
        .router_call(Method::GET, &format!("/user/{}", random_uaid()), None)
        .await;
    assert_eq!(reply.status, 404, "{reply:?}");
}

#[tokio::test]
async fn delete_notif_disconnects_only_the_matching_connection() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;
    let record = server
        .router_call(Method::GET, &format!("/user/{uaid}"), None)
        .await;
    assert_eq!(record.status, 200, "{record:?}");
    let at = connected_at(&record.json);

    // Another connected_at: not this connection.
    let stale = if at == "1" { "2" } else { "1" };
    let reply = server
        .router_call(Method::DELETE, &format!("/notif/{uaid}/{stale}"), None)
        .await;
    assert_eq!(reply.status, 404, "{reply:?}");
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);

    let reply = server
        .router_call(Method::DELETE, &format!("/notif/{uaid}/{at}"), None)
        .await;
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
    let body = router_notification(&sub.channel_id, "v1", &enc).to_string();
    let key = server.router_key();
    for base in [server.ws_http_base(), server.endpoint_base()] {
        let call = |method, path: String, body: Option<&str>| {
            let (base, key) = (&base, &key);
            let body = body.map(|b| b.as_bytes().to_vec());
            async move { http::signed(method, base, &path, key, body).await }
        };
        let reply = call(Method::PUT, format!("/push/{uaid}"), Some(&body)).await;
        assert!(
            !(200..300).contains(&reply.status),
            "PUT {base}/push: {reply:?}"
        );
        let reply = call(Method::PUT, format!("/notif/{uaid}"), None).await;
        assert!(
            !(200..300).contains(&reply.status),
            "PUT {base}/notif: {reply:?}"
        );
        let reply = call(Method::GET, format!("/user/{uaid}"), None).await;
        assert!(
            !(200..300).contains(&reply.status),
            "GET {base}/user: {reply:?}"
        );
    }
    ws.assert_nothing_arrives().await;
}

/// `METHOD {router_base}{path}` with exactly these headers and body.
async fn raw_router_call(
    server: &Server,
    method: Method,
    path: &str,
    authorization: Option<&str>,
    body: Option<&str>,
) -> HttpReply {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(authorization) = authorization {
        headers.push(("authorization", authorization));
    }
    let url = format!("{}{path}", server.router_base());
    http::request(method, &url, &headers, body.map(|b| b.as_bytes().to_vec())).await
}

#[tokio::test]
async fn unsigned_or_badly_signed_calls_get_401_and_do_nothing() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let enc = py::encrypt(
        &sub.keys,
        &Payload::Text("only with the key".into()),
        Encoding::Aes128Gcm,
    )
    .await;
    let body = router_notification(&sub.channel_id, "v1", &enc).to_string();
    let key = server.router_key();
    let push = format!("/push/{uaid}");
    let now = http::unix_now();
    let sign = |key: &str, path: &str, body: &str, t: u64| {
        http::router_authorization(key, &Method::PUT, path, body.as_bytes(), t)
    };
    let refused = [
        ("no Authorization", None),
        ("another key", Some(sign("not-the-key", &push, &body, now))),
        ("an hour old", Some(sign(&key, &push, &body, now - 3600))),
        ("an hour ahead", Some(sign(&key, &push, &body, now + 3600))),
        ("another body", Some(sign(&key, &push, "{}", now))),
        (
            "another path",
            Some(sign(&key, &format!("/push/{}", random_uaid()), &body, now)),
        ),
        ("another scheme", Some(format!("Bearer {key}"))),
    ];
    for (what, authorization) in refused {
        let reply = raw_router_call(
            &server,
            Method::PUT,
            &push,
            authorization.as_deref(),
            Some(&body),
        )
        .await;
        assert_eq!(reply.status, 401, "PUT /push signed with {what}: {reply:?}");
        reply.assert_error(401, 109);
    }

    // The other calls refuse unsigned requests too, revealing nothing.
    let record = server
        .router_call(Method::GET, &format!("/user/{uaid}"), None)
        .await;
    let at = connected_at(&record.json);
    for (method, path) in [
        (Method::PUT, format!("/notif/{uaid}")),
        (Method::DELETE, format!("/notif/{uaid}/{at}")),
        (Method::GET, format!("/user/{uaid}")),
    ] {
        let reply = raw_router_call(&server, method.clone(), &path, None, None).await;
        reply.assert_error(401, 109);
        assert!(
            !reply.text.contains("node_id"),
            "{method} {path}: {reply:?}"
        );
    }
    ws.assert_nothing_arrives().await;
    // Still connected: the unsigned DELETE did not kick the client.
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);

    // The same call, signed: delivered.
    let reply = raw_router_call(
        &server,
        Method::PUT,
        &push,
        Some(&sign(&key, &push, &body, http::unix_now())),
        Some(&body),
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "only with the key");
}

/// During a migration (`--unsigned-node-calls-from`), the two calls
/// autopush-rs's endpoints make unsigned, `PUT /push` and `PUT /notif`, are
/// taken from the peers named, said at start-up and counted; every other
/// call, and every call from another peer, still needs the signature.
#[tokio::test]
async fn unsigned_calls_from_the_peers_named_during_a_migration() {
    let server = Server::start_with(&["--unsigned-node-calls-from", "127.0.0.0/8"]).await;
    let stderr = server.stderr();
    assert!(stderr.contains("MIGRATION"), "{stderr}");
    assert!(stderr.contains("127.0.0.0/8"), "{stderr}");
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let enc = py::encrypt(
        &sub.keys,
        &Payload::Text("unsigned".into()),
        Encoding::Aes128Gcm,
    )
    .await;
    // As autopush-rs sends it: the UAID hyphenated, `topic` null.
    let mut body = router_notification(&sub.channel_id, "v1", &enc);
    body["topic"] = Value::Null;
    let hyphenated = uuid::Uuid::parse_str(&uaid)
        .unwrap()
        .hyphenated()
        .to_string();
    let push = format!("/push/{hyphenated}");
    let reply = raw_router_call(&server, Method::PUT, &push, None, Some(&body.to_string())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(reply.header("x-autopush-settles-durable-copy").is_some());
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "unsigned");
    ws.ack_notification(&n).await;
    let notif = format!("/notif/{uaid}");
    let reply = raw_router_call(&server, Method::PUT, &notif, None, None).await;
    assert_eq!(reply.status, 200, "{reply:?}");

    let record = server
        .router_call(Method::GET, &format!("/user/{uaid}"), None)
        .await;
    let at = connected_at(&record.json);
    for (method, path) in [
        (Method::DELETE, format!("/notif/{uaid}/{at}")),
        (Method::GET, format!("/user/{uaid}")),
    ] {
        let reply = raw_router_call(&server, method.clone(), &path, None, None).await;
        reply.assert_error(401, 109);
    }
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);
    let metrics = http::get(&format!("{}/metrics", server.router_base())).await;
    let counted = |route: &str| {
        metrics
            .text
            .lines()
            .any(|l| l.starts_with("node_unsigned_call{") && l.contains(route))
    };
    assert!(
        counted("route=\"push\"") && counted("route=\"notif\""),
        "{}",
        metrics.text
    );

    // Another peer's unsigned calls are refused.
    let elsewhere =
        Server::start_with(&["--unsigned-node-calls-from", "10.1.2.3,192.168.0.0/16"]).await;
    let mut ws = elsewhere.client().await;
    let uaid = ws.uaid().to_string();
    Subscription::new(&mut ws).await;
    let reply = raw_router_call(
        &elsewhere,
        Method::PUT,
        &format!("/notif/{uaid}"),
        None,
        None,
    )
    .await;
    reply.assert_error(401, 109);
}

#[tokio::test]
async fn a_configured_router_key_list_verifies_with_any_key() {
    let server = Server::start_with(&["--router-key", "new-router-key-1,old-router-key-0"]).await;
    assert!(
        !server.data_dir().join("router_key").exists(),
        "a configured key is not replaced by a generated one"
    );
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let _sub = Subscription::new(&mut ws).await;
    let path = format!("/user/{uaid}");
    for (key, status) in [
        ("new-router-key-1", 200),
        ("old-router-key-0", 200),
        ("other-router-key", 401),
    ] {
        let reply = http::signed(Method::GET, &server.router_base(), &path, key, None).await;
        assert_eq!(reply.status, status, "signed with {key}: {reply:?}");
    }
}

/// The webpush router reaches a connection node in another process over
/// the router API: with the node's key its pushes are delivered, without it
/// they are refused and the router falls back to storing.
#[tokio::test]
async fn the_webpush_router_signs_its_calls_to_other_nodes() {
    use autopush_common::User;
    use autopush_common::node_auth::NodeKeys;
    use autopush_common::router::{Delivery, Router};
    use autopush_storage::embedded::EmbeddedStore;
    use autopush_webpush::NodeClient;
    use autopush_webpush::WebPushRouter;
    use std::sync::Arc;

    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = uuid::Uuid::parse_str(ws.uaid()).expect("uaid");
    let sub = Subscription::new(&mut ws).await;
    // This endpoint's own store: the node is in the user record, so a
    // direct delivery never touches it.
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = Arc::new(EmbeddedStore::open(dir.path()).expect("store"));
    let user = User::new_webpush(uaid, &server.router_base(), 1);
    let notification = |text: &str| {
        let text = text.to_string();
        let keys = sub.keys.clone();
        let chid = sub.channel_id.clone();
        async move {
            let enc = py::encrypt(&keys, &Payload::Text(text), Encoding::Aes128Gcm).await;
            serde_json::from_value(router_notification(&chid, &new_channel_id(), &enc))
                .expect("a notification")
        }
    };

    for (key, text, expected) in [
        (
            "a-key-the-node-does-not-have",
            "wrong key",
            Delivery::Stored,
        ),
        (server.router_key().as_str(), "right key", Delivery::Direct),
    ] {
        let nodes = NodeClient::new(NodeKeys::new(&[key.to_string()]).expect("keys"));
        let router = WebPushRouter::new(storage.clone(), None, false, nodes);
        let delivery = router
            .route_notification(notification(text).await, &user)
            .await
            .expect("routed");
        assert_eq!(delivery, expected, "{text}");
    }
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "right key", "only the signed push arrives");
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn bodies_over_64_kib_are_refused_before_the_signature_is_checked() {
    let server = Server::start().await;
    let big = json!({"data": "x".repeat(65 * 1024)});
    let reply = server
        .router_call(Method::PUT, &format!("/push/{}", random_uaid()), Some(&big))
        .await;
    reply.assert_error(413, 104);
}

/// `/__version__` names the version and the git commit the binary was
/// built from (built from this checkout: its HEAD), and no invented source URL.
#[tokio::test]
async fn version_names_the_built_commit_and_no_source() {
    let server = Server::start().await;
    let reply = http::get(&format!("{}/__version__", server.endpoint_base())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json["name"], "autopush", "{reply:?}");
    assert_eq!(
        reply.json["version"],
        env!("CARGO_PKG_VERSION"),
        "{reply:?}"
    );
    assert!(reply.json.get("source").is_none(), "{reply:?}");
    // The binary's --version names the same version (the workspace's).
    let flag = server::run_autopush(&["--version"]).await;
    assert!(flag.status.success(), "autopush --version: {flag:?}");
    assert_eq!(
        String::from_utf8_lossy(&flag.stdout).trim(),
        format!("autopush {}", reply.json["version"].as_str().unwrap_or("?")),
        "autopush --version and /__version__ disagree"
    );
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(workspace_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let expected = head.unwrap_or_else(|| "unknown".into());
    assert_eq!(
        reply.json["commit"], expected,
        "rebuild the binary after committing: {reply:?}"
    );
}

/// Our node answers requests as endpoints of every router API version send
/// them (docs/internals.md): version 1 (no header of its own), version 2
/// (a hold, naming no version), versions 3 and 4 (a hold, naming itself)
/// and version 6 (naming itself, with a header and a hold value this node
/// does not know, which make a plain push). Every answer names version 5
/// and keeps version 2's header. (This node keeps no journal of its own:
/// no hold is answered `kept`.)
#[tokio::test]
async fn the_node_answers_endpoints_of_every_version() {
    // A grace no test run outlasts: the ack, not the clock, ends the hold.
    let server = Server::start_with_env(&[], &[("AUTOPUSH_TEST_DIRECT_GRACE_MS", "60000")]).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    let hold = ("x-autopush-durable-copy", "hold");
    let three = [("x-autopush-router-api", "3"), hold];
    let four = [("x-autopush-router-api", "4"), hold];
    let next = [
        ("x-autopush-router-api", "6"),
        ("x-autopush-router-api-next", "a header of version 6"),
        ("x-autopush-durable-copy", "journal"),
    ];
    // Each endpoint version: its request's extra headers, the fate answered.
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let endpoints: [(&str, Headers, Option<&str>); 5] = [
        ("version 1", &[], None),
        ("version 2", &[hold], Some("acked")),
        ("version 3", &three, Some("acked")),
        ("version 4", &four, Some("acked")),
        ("version 6", &next, None),
    ];
    let (base, path, key) = (
        server.router_base(),
        format!("/push/{uaid}"),
        server.router_key(),
    );
    for (i, (name, headers, fate)) in endpoints.into_iter().enumerate() {
        let enc = py::encrypt(&sub.keys, &Payload::Text(name.into()), Encoding::Aes128Gcm).await;
        let body = router_notification(&sub.channel_id, &format!("v{i}"), &enc);
        let body = Some(body.to_string().into_bytes());
        let push = http::signed_with(Method::PUT, &base, &path, &key, body, headers);
        // A held push is answered at the ack: ack as it arrives.
        let receive = async {
            let n = ws.recv_notification().await;
            ws.ack_notification(&n).await;
            n
        };
        let (reply, n) = tokio::join!(push, receive);
        assert_eq!(reply.status, 200, "{name}: {reply:?}");
        assert_eq!(reply.header("x-autopush-router-api"), Some("5"), "{name}");
        assert_eq!(
            reply.header("x-autopush-settles-durable-copy"),
            Some("1"),
            "{name}"
        );
        assert_eq!(reply.header("x-autopush-durable-copy"), fate, "{name}");
        assert_eq!(sub.decrypt(&n).await.text, name);
    }
    // A refusal names the version too.
    let reply = server
        .router_call(Method::PUT, &format!("/push/{}", "0".repeat(32)), None)
        .await;
    assert_eq!(
        reply.header("x-autopush-router-api"),
        Some("5"),
        "{reply:?}"
    );
}
