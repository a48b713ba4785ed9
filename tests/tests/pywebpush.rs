//! pywebpush as an application server uses it: VAPID (RFC 8292 and the older
//! `WebPush` scheme), both encodings, the largest payload, binary payloads.

use std::time::{SystemTime, UNIX_EPOCH};

use autopush_tests::*;

#[tokio::test]
async fn vapid_restricted_endpoint_accepts_its_key_in_both_encodings() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    assert!(sub.endpoint.contains("/wpush/v2/"), "{}", sub.endpoint);
    for encoding in Encoding::ALL {
        let text = format!("signed, {}", encoding.as_str());
        let res = sub
            .send(
                &SendOptions::text(&text)
                    .encoding(encoding)
                    .vapid(sub.vapid_key()),
            )
            .await;
        let auth = res
            .sent_headers
            .get("authorization")
            .cloned()
            .unwrap_or_default();
        assert!(auth.starts_with("vapid t="), "pywebpush sent {auth:?}");
        res.assert_created();
        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(d.text, text);
        ws.ack_notification(&notif).await;
    }
}

#[tokio::test]
async fn legacy_webpush_vapid_scheme_with_aesgcm_is_accepted() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    let res = sub
        .send(
            &SendOptions::text("old style")
                .encoding(Encoding::AesGcm)
                .vapid(sub.vapid_key())
                .vapid_scheme(VapidScheme::WebPush),
        )
        .await;
    let auth = res
        .sent_headers
        .get("authorization")
        .cloned()
        .unwrap_or_default();
    let crypto_key = res
        .sent_headers
        .get("crypto-key")
        .cloned()
        .unwrap_or_default();
    assert!(auth.starts_with("WebPush "), "sent {auth:?}");
    assert!(
        crypto_key.contains("p256ecdsa=") && crypto_key.contains("dh="),
        "sent Crypto-Key {crypto_key:?}"
    );
    res.assert_created();
    let (notif, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "old style");
    ws.ack_notification(&notif).await;
}

#[tokio::test]
async fn vapid_is_optional_on_an_unrestricted_endpoint() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let key = VapidKey::generate().await;
    sub.send(&SendOptions::text("signed anyway").vapid(&key))
        .await
        .assert_created();
    let (notif, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "signed anyway");
    ws.ack_notification(&notif).await;
}

#[tokio::test]
async fn vapid_restricted_endpoint_rejects_no_key_and_other_keys() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    sub.send(&SendOptions::text("unsigned"))
        .await
        .assert_error(401, 109);
    let other = VapidKey::generate().await;
    for encoding in Encoding::ALL {
        sub.send(
            &SendOptions::text("wrong key")
                .encoding(encoding)
                .vapid(&other),
        )
        .await
        .assert_error(401, 109);
    }
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn vapid_for_another_audience_is_rejected() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    sub.send(
        &SendOptions::text("wrong aud")
            .vapid(sub.vapid_key())
            .vapid_aud("https://push.example.com"),
    )
    .await
    .assert_error(401, 109);
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn expired_vapid_is_rejected() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::with_vapid(&mut ws).await;
    let an_hour_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
        - 3600;
    sub.send(
        &SendOptions::text("expired")
            .vapid(sub.vapid_key())
            .vapid_exp(an_hour_ago),
    )
    .await
    .assert_error(401, 109);
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn largest_payload_works_in_both_encodings_online() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    for encoding in Encoding::ALL {
        let res = sub
            .send(&SendOptions::pattern(MAX_PLAINTEXT).encoding(encoding))
            .await;
        assert!(
            res.sent_body_len <= MAX_BODY_BYTES,
            "{encoding:?}: {}",
            res.sent_body_len
        );
        res.assert_created();
        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(
            d.bytes,
            data_pattern(MAX_PLAINTEXT).into_bytes(),
            "{encoding:?}"
        );
        ws.ack_notification(&notif).await;
    }
}

#[tokio::test]
async fn largest_payload_works_in_both_encodings_when_stored() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(true).await;
    for encoding in Encoding::ALL {
        sub.send(
            &SendOptions::pattern(MAX_PLAINTEXT)
                .encoding(encoding)
                .vapid(sub.vapid_key()),
        )
        .await
        .assert_created();
    }
    let mut ws = server.reconnect(&uaid).await;
    let mut encodings = Vec::new();
    for _ in Encoding::ALL {
        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(d.bytes, data_pattern(MAX_PLAINTEXT).into_bytes(), "{notif}");
        encodings.push(
            notif["headers"]["encoding"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        ws.ack_notification(&notif).await;
    }
    encodings.sort();
    assert_eq!(encodings, ["aes128gcm", "aesgcm"]);
}

#[tokio::test]
async fn binary_payload_round_trips() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let bytes: Vec<u8> = (0..=255u8).collect();
    for encoding in Encoding::ALL {
        sub.send(&SendOptions::bytes(&bytes).encoding(encoding))
            .await
            .assert_created();
        let (notif, d) = sub.receive(&mut ws).await;
        assert_eq!(d.bytes, bytes, "{encoding:?}");
        ws.ack_notification(&notif).await;
    }
}
