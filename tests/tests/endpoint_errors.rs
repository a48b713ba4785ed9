//! The endpoint HTTP API's validation: every error is JSON
//! `{code, errno, error, message, more_info}` with the seeds' errno.
//! Requests are raw (reqwest) so that each one is valid but for one thing.

use autopush_tests::*;

const AES128GCM: [(&str, &str); 2] = [("TTL", "60"), ("Content-Encoding", "aes128gcm")];

/// A registered channel on a connected client (kept open so that pushes
/// are delivered directly and nothing piles up in storage).
async fn registered(server: &Server) -> (WsClient, String) {
    let mut ws = server.client().await;
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    (ws, endpoint)
}

fn with<'a>(base: &[(&'a str, &'a str)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut headers = base.to_vec();
    headers.extend_from_slice(extra);
    headers
}

fn body() -> Option<Vec<u8>> {
    Some(opaque_body(100))
}

#[tokio::test]
async fn a_valid_raw_push_is_accepted() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    let reply = http::post_push(&endpoint, &AES128GCM, body()).await;
    reply.assert_created();
    assert!(
        reply
            .header("location")
            .unwrap()
            .starts_with(&format!("{}/m/", server.endpoint_base())),
        "{reply:?}"
    );
    assert_eq!(reply.header("ttl"), Some("60"));
}

#[tokio::test]
async fn missing_ttl_is_400_111() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    http::post_push(&endpoint, &[("Content-Encoding", "aes128gcm")], body())
        .await
        .assert_error(400, 111);
}

#[tokio::test]
async fn invalid_ttl_is_400_112() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    for ttl in ["abc", "-1", "1.5", ""] {
        let headers = [("TTL", ttl), ("Content-Encoding", "aes128gcm")];
        let reply = http::post_push(&endpoint, &headers, body()).await;
        if ttl.is_empty() && reply.json["errno"] == 111 {
            continue; // an empty header may count as a missing one
        }
        reply.assert_error(400, 112);
    }
}

#[tokio::test]
async fn ttl_above_the_maximum_is_capped() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    let headers = [("TTL", "5000000"), ("Content-Encoding", "aes128gcm")];
    let reply = http::post_push(&endpoint, &headers, body()).await;
    reply.assert_created();
    assert_eq!(reply.header("ttl"), Some(MAX_TTL.to_string().as_str()));
}

#[tokio::test]
async fn invalid_topic_is_400_113() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    let too_long = "a".repeat(33);
    for topic in [too_long.as_str(), "bad topic", "bad+topic", "bad/topic"] {
        let reply =
            http::post_push(&endpoint, &with(&AES128GCM, &[("Topic", topic)]), body()).await;
        assert_eq!(reply.status, 400, "Topic {topic:?}: {reply:?}");
        reply.assert_error(400, 113);
    }
    let longest = "A-z_".repeat(8);
    http::post_push(
        &endpoint,
        &with(&AES128GCM, &[("Topic", longest.as_str())]),
        body(),
    )
    .await
    .assert_created();
}

#[tokio::test]
async fn body_without_content_encoding_is_400_110() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    http::post_push(&endpoint, &[("TTL", "60")], body())
        .await
        .assert_error(400, 110);
}

#[tokio::test]
async fn unknown_content_encoding_is_400_110() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    for encoding in ["gzip", "aes256gcm"] {
        let headers = [("TTL", "60"), ("Content-Encoding", encoding)];
        http::post_push(&endpoint, &headers, body())
            .await
            .assert_error(400, 110);
    }
}

#[tokio::test]
async fn aesgcm_needs_encryption_salt_and_crypto_key_dh() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    let salt = "salt=lngarbyKfMoi9Z75xYXmkg";
    let dh = "dh=BNoRDbb84JGm8g5Z5CFxurSqsXWJ11ItfXEWYVLE85Y7CYkDjXsIEc4aqxYaQ1G8BqkXCJ6DPpDrWtdWj_mugHU";
    let base = [("TTL", "60"), ("Content-Encoding", "aesgcm")];

    // Both present: accepted.
    http::post_push(
        &endpoint,
        &with(&base, &[("Encryption", salt), ("Crypto-Key", dh)]),
        body(),
    )
    .await
    .assert_created();
    // No Encryption header.
    http::post_push(&endpoint, &with(&base, &[("Crypto-Key", dh)]), body())
        .await
        .assert_error(400, 110);
    // Encryption without a salt.
    http::post_push(
        &endpoint,
        &with(&base, &[("Encryption", "rs=4096"), ("Crypto-Key", dh)]),
        body(),
    )
    .await
    .assert_error(400, 110);
    // No Crypto-Key header.
    http::post_push(&endpoint, &with(&base, &[("Encryption", salt)]), body())
        .await
        .assert_error(400, 110);
    // Crypto-Key without dh.
    http::post_push(
        &endpoint,
        &with(
            &base,
            &[("Encryption", salt), ("Crypto-Key", "keyid=p256dh")],
        ),
        body(),
    )
    .await
    .assert_error(400, 110);
}

#[tokio::test]
async fn body_too_large_is_413_104() {
    let server = Server::start().await;
    let (_ws, endpoint) = registered(&server).await;
    http::post_push(&endpoint, &AES128GCM, Some(opaque_body(MAX_BODY_BYTES + 1)))
        .await
        .assert_error(413, 104);
}

#[tokio::test]
async fn garbage_token_is_404_102() {
    let server = Server::start().await;
    let base = server.endpoint_base();
    let long_garbage = "gAAAAABf".to_string() + &"x1_-".repeat(40);
    for token in ["not-a-token", long_garbage.as_str()] {
        let url = format!("{base}/wpush/v1/{token}");
        http::post_push(&url, &AES128GCM, body())
            .await
            .assert_error(404, 102);
    }
}

#[tokio::test]
async fn unregistered_channel_is_410_106() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let chid = new_channel_id();
    let reply = ws.register(&chid, None).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    assert_eq!(ws.unregister(&chid, 200).await["status"], 200);
    let reply = http::post_push(&endpoint, &AES128GCM, body()).await;
    reply.assert_error(410, 106);
    // Gone for good: CDNs and senders may remember it for a day.
    assert_eq!(reply.header("cache-control"), Some("max-age=86400"));
}

/// aesgcm headers reach the client clean: no quotes, no `=` padding.
#[tokio::test]
async fn aesgcm_headers_are_forwarded_without_quotes_or_padding() {
    let server = Server::start().await;
    let (mut ws, endpoint) = registered(&server).await;
    http::post_push(
        &endpoint,
        &[
            ("TTL", "60"),
            ("Content-Encoding", "aesgcm"),
            (
                "Encryption",
                "keyid=\"p256dh\"; salt=\"c2FsdHNhbHRzYWx0c2E=\"",
            ),
            ("Crypto-Key", "keyid=\"p256dh\"; dh=\"BCdhZGg=\""),
        ],
        body(),
    )
    .await
    .assert_created();
    let notification = ws.recv_notification().await;
    assert_eq!(
        notification["headers"]["encryption"], "keyid=p256dh;salt=c2FsdHNhbHRzYWx0c2E",
        "{notification}"
    );
    assert_eq!(
        notification["headers"]["crypto_key"], "keyid=p256dh;dh=BCdhZGg",
        "{notification}"
    );
}

#[tokio::test]
async fn dropped_user_is_410_103() {
    // Over --msg-limit at two hellos in a row drops the user: the second
    // hello gets a new uaid.
    let server = Server::start_with(&["--msg-limit", "1"]).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let reply = ws.register(&new_channel_id(), None).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    ws.close().await;
    for _ in 0..2 {
        http::post_push(&endpoint, &AES128GCM, body())
            .await
            .assert_created();
    }
    server.reconnect(&uaid).await.close().await;
    let mut ws = WsClient::connect(&server.ws_url()).await;
    let reply = ws.hello(Some(&uaid)).await;
    assert_ne!(
        reply["uaid"],
        uaid.as_str(),
        "user should have been dropped: {reply}"
    );

    http::post_push(&endpoint, &AES128GCM, body())
        .await
        .assert_error(410, 103);
}

#[tokio::test]
async fn restricted_endpoint_without_vapid_is_401_109() {
    let server = Server::start().await;
    let key = VapidKey::generate().await;
    let mut ws = server.client().await;
    let reply = ws.register(&new_channel_id(), Some(&key.public_key)).await;
    let endpoint = reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string();
    assert!(endpoint.contains("/wpush/v2/"), "{endpoint}");
    http::post_push(&endpoint, &AES128GCM, body())
        .await
        .assert_error(401, 109);
}

#[tokio::test]
async fn delete_of_a_garbage_message_id_is_404_102() {
    let server = Server::start().await;
    let url = format!("{}/m/not-a-message-id", server.endpoint_base());
    http::delete(&url).await.assert_error(404, 102);
}

/// An unknown path is 404/102 whatever the method; a known path asked with
/// a method it does not take is 405 naming the method it does take. Both
/// carry the whole error body.
#[tokio::test]
async fn unknown_paths_are_404_and_wrong_methods_405() {
    use reqwest::Method;
    let server = Server::start().await;
    let base = server.endpoint_base();
    for (method, path) in [
        (Method::GET, "/nothing-here"),
        (Method::POST, "/nothing-here"),
        (Method::GET, "/"),
        (Method::DELETE, "/wpush/v1"),
        (Method::POST, "/wpush/v1/token/extra"),
        (Method::PUT, "/m"),
    ] {
        let reply = http::request(method.clone(), &format!("{base}{path}"), &[], None).await;
        assert_eq!(reply.status, 404, "{method} {path}: {reply:?}");
        reply.assert_error(404, 102);
    }
    for (method, path, allowed) in [
        (Method::GET, "/wpush/v1/some-token", "POST"),
        (Method::PUT, "/wpush/v2/some-token", "POST"),
        (Method::PUT, "/m/some-message-id", "GET, DELETE"),
        (Method::POST, "/m/some-message-id", "GET, DELETE"),
        (Method::POST, "/health", "GET"),
        (Method::DELETE, "/__heartbeat__", "GET"),
        (Method::POST, "/__lbheartbeat__", "GET"),
        (Method::PUT, "/__version__", "GET"),
    ] {
        let reply = http::request(method.clone(), &format!("{base}{path}"), &[], None).await;
        assert_eq!(reply.status, 405, "{method} {path}: {reply:?}");
        reply.assert_error(405, 999);
        assert_eq!(reply.header("allow"), Some(allowed), "{method} {path}");
        let message = reply.json["message"].as_str().unwrap();
        assert!(message.contains(allowed), "{method} {path}: {message}");
    }
}

/// A body of `Content-Type: application/webpush-message` (the HPKE and
/// symmetric-key drafts replacing RFC 8291) says how it is encrypted
/// itself: taken without `Content-Encoding`, its bytes reach the client as
/// sent, named by `content_type` and no `encoding`. Both at once is 400;
/// each encoding is counted.
#[tokio::test]
async fn a_webpush_message_body_reaches_the_client_named_by_its_media_type() {
    let server = Server::start().await;
    let (mut ws, endpoint) = registered(&server).await;
    let message = [
        ("TTL", "60"),
        ("Content-Type", "application/webpush-message"),
    ];
    // What the HPKE draft adds to each message, and more.
    let sent = opaque_body(1_300);
    http::post_push(&endpoint, &message, Some(sent.clone()))
        .await
        .assert_created();
    let notification = ws.recv_notification().await;
    assert_eq!(
        notification["headers"],
        serde_json::json!({"content_type": "application/webpush-message"}),
        "{notification}"
    );
    let data = notification["data"].as_str().expect("data");
    let got = base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, data)
        .expect("base64url data");
    assert!(got == sent, "the body changed on its way");

    let both = [
        ("TTL", "60"),
        ("Content-Type", "application/webpush-message"),
        ("Content-Encoding", "aes128gcm"),
    ];
    let reply = http::post_push(&endpoint, &both, body()).await;
    reply.assert_error(400, 110);
    assert!(
        reply.text.contains("without Content-Encoding"),
        "{}",
        reply.text
    );

    http::post_push(&endpoint, &AES128GCM, body())
        .await
        .assert_created();
    let metrics = http::get(&format!("{}/metrics", server.router_base())).await;
    let scrape = prometheus::Scrape::parse(&metrics.text);
    for encoding in ["webpush-message", "aes128gcm"] {
        assert_eq!(
            scrape.value("notification_encoding", &[("encoding", encoding)]),
            1.0,
            "{encoding}"
        );
    }
}
