//! The `web-push` npm package (tests/node/send.js) as an application server:
//! each encoding with the VAPID header style web-push gives it, on restricted
//! (v2) and unrestricted (v1) endpoints; the websocket client decrypts with
//! http_ece and compares the plaintext.

use autopush_tests::node::{self, WebPushOptions};
use autopush_tests::*;

/// Send `opts` to `sub` with web-push, assert 201, receive, decrypt, ack;
/// returns what web-push sent.
async fn deliver(ws: &mut WsClient, sub: &Subscription, opts: &WebPushOptions) -> SendResult {
    let res = node::send(&sub.endpoint, &sub.keys, opts).await;
    res.assert_created();
    let (notif, d) = sub.receive(ws).await;
    assert_eq!(
        Some(d.text.as_str()),
        opts.text.as_deref(),
        "plaintext differs; web-push sent {:?}",
        res.sent_headers
    );
    assert_eq!(
        notif["headers"]["encoding"],
        opts.encoding.as_str(),
        "{notif}"
    );
    ws.ack_notification(&notif).await;
    res
}

fn sent(res: &SendResult, name: &str) -> String {
    res.sent_headers.get(name).cloned().unwrap_or_default()
}

#[tokio::test]
async fn web_push_delivers_to_a_vapid_restricted_endpoint_in_both_encodings() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    assert!(sub.endpoint.contains("/wpush/v2/"), "{}", sub.endpoint);
    let key = sub.vapid_key();

    // aes128gcm: RFC 8292 `Authorization: vapid t=<jwt>, k=<key>`.
    let text = "web-push says héllo ✓ (aes128gcm)";
    let res = deliver(
        &mut ws,
        &sub,
        &WebPushOptions::text(text)
            .encoding(Encoding::Aes128Gcm)
            .vapid(key),
    )
    .await;
    let auth = sent(&res, "authorization");
    assert!(
        auth.starts_with("vapid t=") && auth.contains(&format!("k={}", key.public_key)),
        "web-push sent Authorization {auth:?}"
    );
    assert!(
        !res.sent_headers.contains_key("crypto-key"),
        "{:?}",
        res.sent_headers
    );

    // aesgcm: the draft `Authorization: WebPush <jwt>` with the key in
    // `Crypto-Key: dh=...;p256ecdsa=...` (one header, ';'-joined).
    let text = "web-push says héllo ✓ (aesgcm)";
    let res = deliver(
        &mut ws,
        &sub,
        &WebPushOptions::text(text)
            .encoding(Encoding::AesGcm)
            .vapid(key),
    )
    .await;
    let auth = sent(&res, "authorization");
    let crypto_key = sent(&res, "crypto-key");
    assert!(
        auth.starts_with("WebPush "),
        "web-push sent Authorization {auth:?}"
    );
    assert!(
        crypto_key.starts_with("dh=")
            && crypto_key.contains(&format!(";p256ecdsa={}", key.public_key)),
        "web-push sent Crypto-Key {crypto_key:?}"
    );
    assert!(
        sent(&res, "encryption").starts_with("salt="),
        "{:?}",
        res.sent_headers
    );
}

#[tokio::test]
async fn web_push_delivers_to_an_unrestricted_endpoint_with_and_without_vapid() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    assert!(sub.endpoint.contains("/wpush/v1/"), "{}", sub.endpoint);
    let key = VapidKey::generate().await;
    for encoding in Encoding::ALL {
        let text = format!("unsigned, {}", encoding.as_str());
        let res = deliver(
            &mut ws,
            &sub,
            &WebPushOptions::text(&text).encoding(encoding),
        )
        .await;
        assert!(
            !res.sent_headers.contains_key("authorization"),
            "{:?}",
            res.sent_headers
        );

        let text = format!("signed, {}, topic", encoding.as_str());
        deliver(
            &mut ws,
            &sub,
            &WebPushOptions::text(&text)
                .encoding(encoding)
                .vapid(&key)
                .topic("webpush-npm"),
        )
        .await;
    }
}

#[tokio::test]
async fn a_restricted_endpoint_refuses_web_push_signed_with_another_key() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    let other = VapidKey::generate().await;
    for encoding in Encoding::ALL {
        let res = node::send(
            &sub.endpoint,
            &sub.keys,
            &WebPushOptions::text("not for you")
                .encoding(encoding)
                .vapid(&other),
        )
        .await;
        res.assert_error(401, 109);
    }
    ws.assert_nothing_arrives().await;
}
