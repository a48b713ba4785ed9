//! Delivery semantics: direct, stored, re-sent until acked, Topic, TTL 0,
//! DELETE, the stored-message limit. Every payload is encrypted by pywebpush
//! and the plaintext the client decrypts is compared with what was sent.

use std::collections::BTreeSet;

use autopush_tests::*;

fn texts(decrypted: &[Decrypted]) -> BTreeSet<String> {
    decrypted.iter().map(|d| d.text.clone()).collect()
}

/// Receive `n` notifications for `sub`, decrypt and ack each.
async fn receive_and_ack(ws: &mut WsClient, sub: &Subscription, n: usize) -> Vec<Decrypted> {
    let mut out = Vec::new();
    for _ in 0..n {
        let (notif, decrypted) = sub.receive(ws).await;
        ws.ack_notification(&notif).await;
        out.push(decrypted);
    }
    out
}

#[tokio::test]
async fn connected_client_receives_and_decrypts_both_encodings() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    for encoding in Encoding::ALL {
        let text = format!("hello over {}", encoding.as_str());
        let res = sub.send(&SendOptions::text(&text).encoding(encoding)).await;
        res.assert_created();
        let location = res.header("location").unwrap();
        assert!(
            location.starts_with(&format!("{}/m/", server.endpoint_base())),
            "Location {location}"
        );
        assert_eq!(res.header("ttl"), Some("60"));

        let (notif, decrypted) = sub.receive(&mut ws).await;
        assert_eq!(decrypted.text, text);
        assert_eq!(notif["ttl"], 60, "{notif}");
        assert!(
            notif["version"].as_str().is_some_and(|v| !v.is_empty()),
            "version: {notif}"
        );
        let headers = &notif["headers"];
        assert_eq!(headers["encoding"], encoding.as_str(), "{notif}");
        if encoding == Encoding::AesGcm {
            assert!(
                headers["encryption"]
                    .as_str()
                    .is_some_and(|h| h.contains("salt=")),
                "{notif}"
            );
            assert!(
                headers["crypto_key"]
                    .as_str()
                    .is_some_and(|h| h.contains("dh=")),
                "{notif}"
            );
        }
        ws.ack_notification(&notif).await;
    }
}

#[tokio::test]
async fn notifications_go_to_the_right_channel() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let a = Subscription::new(&mut ws).await;
    let b = Subscription::new(&mut ws).await;
    b.push_text("for b").await;
    let (notif, d) = b.receive(&mut ws).await;
    assert_eq!(d.text, "for b");
    ws.ack_notification(&notif).await;
    a.push_text("for a").await;
    let (notif, d) = a.receive(&mut ws).await;
    assert_eq!(d.text, "for a");
    ws.ack_notification(&notif).await;
}

#[tokio::test]
async fn push_without_a_body_is_delivered_without_data() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.send(&SendOptions::empty()).await.assert_created();
    let notif = ws.recv_notification().await;
    assert_eq!(notif["channelID"], sub.channel_id.as_str(), "{notif}");
    assert!(notif["data"].is_null(), "no data expected: {notif}");
    let headers = &notif["headers"];
    assert!(
        headers.is_null() || headers.as_object().is_some_and(|h| h.is_empty()),
        "no headers expected: {notif}"
    );
    ws.ack_notification(&notif).await;
}

#[tokio::test]
async fn offline_messages_are_stored_and_delivered_after_hello() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let sent = ["stored aes128gcm", "stored aesgcm"];
    sub.send(&SendOptions::text(sent[0]).encoding(Encoding::Aes128Gcm))
        .await
        .assert_created();
    sub.send(&SendOptions::text(sent[1]).encoding(Encoding::AesGcm))
        .await
        .assert_created();

    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 2).await;
    assert_eq!(texts(&got), sent.iter().map(|s| s.to_string()).collect());
    ws.close().await;

    // Acked: not delivered again.
    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn unacked_direct_message_is_resent_on_reconnect() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    sub.send(&SendOptions::text("ack me").encoding(Encoding::AesGcm))
        .await
        .assert_created();
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "ack me");
    ws.close().await; // without acking

    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 1).await;
    assert_eq!(got[0].text, "ack me");
    ws.close().await;

    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn unacked_stored_message_is_resent_on_reconnect() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.push_text("stored, ack me").await;

    let mut ws = server.reconnect(&uaid).await;
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "stored, ack me");
    ws.close().await; // without acking

    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 1).await;
    assert_eq!(got[0].text, "stored, ack me");
    ws.close().await;

    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn nack_gets_no_reply_and_keeps_the_connection() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("nack me").await;
    let (notif, _) = sub.receive(&mut ws).await;
    ws.nack(
        &sub.channel_id,
        notif["version"].as_str().expect("version"),
        301,
    )
    .await;
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");
}

#[tokio::test]
async fn topic_replaces_the_pending_message() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.send(&SendOptions::text("first").topic("news"))
        .await
        .assert_created();
    sub.send(
        &SendOptions::text("second")
            .topic("news")
            .encoding(Encoding::AesGcm),
    )
    .await
    .assert_created();

    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 1).await;
    assert_eq!(got[0].text, "second");
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn different_topics_are_kept_apart() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.send(&SendOptions::text("weather").topic("weather"))
        .await
        .assert_created();
    sub.send(&SendOptions::text("sports").topic("sports"))
        .await
        .assert_created();

    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 2).await;
    assert_eq!(
        texts(&got),
        ["sports", "weather"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
}

#[tokio::test]
async fn ttl_zero_is_not_stored_for_an_offline_client() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let res = sub.send(&SendOptions::text("now or never").ttl(0)).await;
    res.assert_created();
    assert_eq!(res.header("ttl"), Some("0"));

    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn ttl_zero_reaches_a_connected_client() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    sub.send(&SendOptions::text("now").ttl(0))
        .await
        .assert_created();
    let got = receive_and_ack(&mut ws, &sub, 1).await;
    assert_eq!(got[0].text, "now");
}

#[tokio::test]
async fn deleted_message_is_never_delivered() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let res = sub.push_text("take it back").await;
    let location = res.header("location").unwrap().to_string();
    let deleted = http::delete(&location).await;
    assert_eq!(deleted.status, 204, "DELETE {location}: {deleted:?}");

    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn stored_messages_up_to_the_limit_keep_the_uaid() {
    let server = Server::start_with(&["--msg-limit", "3"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    for i in 0..3 {
        sub.push_text(&format!("message {i}")).await;
    }
    let mut ws = server.reconnect(&uaid).await;
    let got = receive_and_ack(&mut ws, &sub, 3).await;
    assert_eq!(
        texts(&got),
        (0..3).map(|i| format!("message {i}")).collect()
    );
}

/// What a user agent receives holds the protocol's fields and nothing of the
/// service's own bookkeeping (sort keys, timestamps, urgency), whether it
/// was delivered live or from storage.
#[tokio::test]
async fn notifications_carry_only_protocol_fields_live_and_stored() {
    const PROTOCOL_FIELDS: [&str; 7] = [
        "messageType",
        "channelID",
        "version",
        "ttl",
        "topic",
        "data",
        "headers",
    ];
    let body = opaque_body(64);
    let push_headers = [
        ("ttl", "60"),
        ("content-encoding", "aes128gcm"),
        ("urgency", "high"),
    ];
    let check = |how: &str, notif: &serde_json::Value| {
        let fields = notif.as_object().expect("a JSON object");
        let extra: Vec<_> = fields
            .keys()
            .filter(|k| !PROTOCOL_FIELDS.contains(&k.as_str()))
            .collect();
        assert!(
            extra.is_empty(),
            "{how}: internal fields {extra:?} in {notif}"
        );
        assert_eq!(notif["ttl"], 60, "{how}: {notif}");
        assert!(notif["version"].is_string(), "{how}: {notif}");
        assert_eq!(notif["headers"]["encoding"], "aes128gcm", "{how}: {notif}");
    };

    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    http::post_push(&sub.endpoint, &push_headers, Some(body.clone()))
        .await
        .assert_created();
    let live = ws.recv_notification().await;
    check("live", &live);
    ws.ack_notification(&live).await;

    let uaid = ws.uaid().to_string();
    ws.close().await;
    let mut topical = push_headers.to_vec();
    topical.push(("topic", "weather"));
    http::post_push(&sub.endpoint, &push_headers, Some(body.clone()))
        .await
        .assert_created();
    http::post_push(&sub.endpoint, &topical, Some(body))
        .await
        .assert_created();
    let mut ws = server.reconnect(&uaid).await;
    let stored = ws.recv_notifications(2).await;
    for notif in &stored {
        check("stored", notif);
        ws.ack_notification(notif).await;
    }
    assert!(
        stored.iter().any(|n| n["topic"] == "weather"),
        "the topic reaches the client: {stored:?}"
    );
}

/// A client whose last ack came later than the grace has its next durable
/// copy written at once: its sender does not wait out a grace the ack
/// would not come within. Here the graces are two minutes and a client is
/// late past one second; without that rule, the second push would wait
/// the two minutes out. On the embedded store (its journal), and on
/// DynamoDB with the node's journal and without it (the copy held back).
async fn a_client_that_acks_late_does_not_keep_its_sender_waiting(db: backend::Db, args: &[&str]) {
    let mut node = backend::node(db, args).await;
    node.env.extend(
        [
            ("AUTOPUSH_TEST_JOURNAL_GRACE_MS", "120000"),
            ("AUTOPUSH_TEST_DIRECT_GRACE_MS", "120000"),
            ("AUTOPUSH_TEST_LATE_ACK_MS", "1000"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let server = Server::start_node(node).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;

    // Acked 1.5 s after it arrived: its sender waits for that ack.
    let (first, n) = tokio::join!(sub.push_text("first"), async {
        let n = ws.recv_notification().await;
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        ws.ack_notification(&n).await;
        n
    });
    assert_eq!(sub.decrypt(&n).await.text, "first");
    let first = receipt::location(&first);
    assert_eq!(receipt::state_of(&first).await, "delivered");

    // Not acked yet: the 201 comes once the copy is durable.
    let second = tokio::time::timeout(std::time::Duration::from_secs(25), sub.push_text("second"))
        .await
        .expect("the sender waited out the grace of a client that acks late");
    let n = ws.recv_notification().await;
    ws.ack_notification(&n).await;
    assert_eq!(sub.decrypt(&n).await.text, "second");
    let second = receipt::location(&second);
    receipt::wait_until("the ack settles the written copy", async || {
        receipt::state_of(&second).await == "delivered"
    })
    .await;

    ws.close().await;
    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

#[tokio::test]
async fn a_client_that_acks_late_does_not_keep_its_sender_waiting_embedded() {
    a_client_that_acks_late_does_not_keep_its_sender_waiting(backend::Db::Embedded, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_acks_late_does_not_keep_its_sender_waiting_dynamodb() {
    // A window longer than the grace, or the window would end the wait.
    let args = ["--journal-window=300"];
    a_client_that_acks_late_does_not_keep_its_sender_waiting(backend::Db::Dynamo, &args).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_acks_late_does_not_keep_its_sender_waiting_dynamodb_without_journal() {
    let args = ["--journal-dir=off"];
    a_client_that_acks_late_does_not_keep_its_sender_waiting(backend::Db::Dynamo, &args).await;
}
