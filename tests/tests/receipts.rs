//! Receipts: `GET` on the `Location` URL of a push says what became of it,
//! through the real binary, on the embedded store, DynamoDB and Bigtable
//! (Google's emulator).

use autopush_crypto::vapid::VapidKey as SigningKey;
use autopush_tests::backend::{Db, start};
use autopush_tests::http;
use autopush_tests::on_every_backend;
use autopush_tests::prometheus::Scrape;
use autopush_tests::receipt::{
    location, state, state_of, wait_for_404, wait_for_state, wait_until,
};
use autopush_tests::server::free_ports;
use autopush_tests::*;

/// Every webpush state: stored, sent, delivered, deleted, dropped,
/// replaced, expired, and an unknown id.
async fn each_webpush_state(db: Db) {
    let server = start(db, &[]).await;

    // Stored while the client is away; sent once it is back; delivered on ack.
    let (uaid, sub) = server.offline_subscription(false).await;
    let stored = location(&sub.push_text("stored").await);
    assert_eq!(state_of(&stored).await, "stored");
    let mut ws = server.reconnect(&uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "stored");
    assert_eq!(state_of(&stored).await, "sent");
    ws.ack_notification(&n).await;
    wait_for_state(&stored, "delivered").await;

    // Direct to the connected client: sent, then delivered on ack.
    let direct = location(&sub.push_text("direct").await);
    let (n, _) = sub.receive(&mut ws).await;
    assert_eq!(state_of(&direct).await, "sent");
    ws.ack_notification(&n).await;
    wait_for_state(&direct, "delivered").await;
    // TTL 0 to a connected client is never stored: its receipt stays sent.
    let now_or_never = location(&sub.send(&SendOptions::text("ttl 0").ttl(0)).await);
    let (n, _) = sub.receive(&mut ws).await;
    ws.ack_notification(&n).await;
    assert_eq!(state_of(&now_or_never).await, "sent");
    ws.close().await;

    // Deleted by the sender before delivery; a second DELETE changes nothing.
    let deleted = location(&sub.push_text("deleted").await);
    assert_eq!(http::delete(&deleted).await.status, 204);
    assert_eq!(state_of(&deleted).await, "deleted");
    assert_eq!(http::delete(&deleted).await.status, 204);
    assert_eq!(state_of(&deleted).await, "deleted");

    // TTL 0 and nobody connected.
    let dropped = sub.send(&SendOptions::text("dropped").ttl(0)).await;
    dropped.assert_created();
    assert_eq!(state_of(&location(&dropped)).await, "dropped");

    // A newer message with the same Topic replaces the stored one.
    let first = sub.send(&SendOptions::text("first").topic("score")).await;
    let second = sub.send(&SendOptions::text("second").topic("score")).await;
    assert_eq!(state_of(&location(&first)).await, "replaced");
    assert_eq!(state_of(&location(&second)).await, "stored");

    // TTL runs out before the client comes back.
    let expiring = location(&sub.send(&SendOptions::text("expiring").ttl(1)).await);
    wait_for_state(&expiring, "expired").await;
    // Expired is final: the sender's delete finds nothing to cancel.
    http::delete(&expiring).await.assert_error(404, 102);
    assert_eq!(state_of(&expiring).await, "expired");
    // The client comes back: it gets the Topic message only.
    let mut ws = server.reconnect(&uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "second");
    ws.ack_notification(&n).await;
    wait_for_state(&location(&second), "delivered").await;
    ws.assert_nothing_arrives().await;
    assert_eq!(state_of(&expiring).await, "expired");
    // A newer message with the Topic does not hide what became of the
    // older ones.
    let third = location(&sub.send(&SendOptions::text("third").topic("score")).await);
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "third");
    ws.ack_notification(&n).await;
    wait_for_state(&third, "delivered").await;
    assert_eq!(state_of(&location(&second)).await, "delivered");
    assert_eq!(state_of(&location(&first)).await, "replaced");

    // An id this service never gave.
    let unknown = format!("{}/m/not-an-id", server.endpoint_base());
    http::get(&unknown).await.assert_error(404, 102);
}

/// A message still pending when its subscription ends is `gone`; one
/// delivered before stays `delivered`.
async fn a_pending_message_of_a_removed_registration_is_gone(db: Db) {
    let server = start(db, &[]).await;
    let base = server.endpoint_base();
    let registration = format!("{base}/v1/webpush/any/registration");
    let reply = http::request(
        reqwest::Method::POST,
        &registration,
        &[("content-type", "application/json")],
        Some(b"{}".to_vec()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let field = |name: &str| reply.json[name].as_str().expect(name).to_owned();
    let (uaid, secret, endpoint) = (field("uaid"), field("secret"), field("endpoint"));
    let push = async || {
        let sent = http::post_push(&endpoint, &[("ttl", "60")], None).await;
        sent.assert_created();
        sent.header("location").expect("Location").to_owned()
    };
    let (delivered, pending) = (push().await, push().await);
    let mut ws = server.reconnect(&uaid).await;
    let first = ws.recv_notification().await;
    ws.ack_notification(&first).await;
    let second = ws.recv_notification().await;
    ws.close().await;
    // Whichever came first was acked.
    let (delivered, pending) = match first["version"] == second["version"] {
        true => panic!("the same message twice: {first}"),
        false if delivered.ends_with(first["version"].as_str().unwrap()) => (delivered, pending),
        false => (pending, delivered),
    };
    wait_for_state(&delivered, "delivered").await;
    wait_for_state(&pending, "stored").await;
    let bearer = format!("Bearer {secret}");
    let removed = http::request(
        reqwest::Method::DELETE,
        &format!("{registration}/{uaid}"),
        &[("authorization", bearer.as_str())],
        None,
    )
    .await;
    assert_eq!(removed.status, 200, "{}", removed.text);
    assert_eq!(state_of(&pending).await, "gone");
    assert_eq!(state_of(&delivered).await, "delivered");
    http::post_push(&endpoint, &[("ttl", "60")], None)
        .await
        .assert_error(410, 103);
}

/// A message still pending when the client unsubscribes its channel is
/// `gone`; another channel's is not touched.
async fn a_pending_message_of_an_unsubscribed_channel_is_gone(db: Db) {
    let server = start(db, &[]).await;
    let mut ws = server.client().await;
    let (leaving, staying) = (
        Subscription::new(&mut ws).await,
        Subscription::new(&mut ws).await,
    );
    let uaid = ws.uaid().to_string();
    ws.close().await;
    let to_leaving = location(&leaving.push_text("to the leaving channel").await);
    let to_staying = location(&staying.push_text("to the staying channel").await);
    let mut ws = server.reconnect(&uaid).await;
    let got = ws.recv_notifications(2).await;
    let reply = ws.unregister(&leaving.channel_id, 200).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(state_of(&to_leaving).await, "gone");
    assert_eq!(state_of(&to_staying).await, "sent");
    let staying_one = got
        .iter()
        .find(|n| n["channelID"] == staying.channel_id.as_str())
        .expect("the staying channel's message");
    ws.ack_notification(staying_one).await;
    wait_for_state(&to_staying, "delivered").await;
    assert_eq!(state_of(&to_leaving).await, "gone");
}

/// A client that leaves without acking: its messages read `stored` (it
/// will get them at its next hello), not `sent` to a client that is gone.
async fn a_client_that_leaves_unacked_turns_sent_back_into_stored(db: Db) {
    let server = start(db, &[]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let stored = location(&sub.push_text("stored").await);
    let mut ws = server.reconnect(&uaid).await;
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "stored");
    let direct = location(&sub.push_text("direct").await);
    sub.receive(&mut ws).await;
    assert_eq!(state_of(&stored).await, "sent");
    assert_eq!(state_of(&direct).await, "sent");
    ws.close().await;
    wait_for_state(&stored, "stored").await;
    wait_for_state(&direct, "stored").await;
    let mut ws = server.reconnect(&uaid).await;
    for n in ws.recv_notifications(2).await {
        ws.ack_notification(&n).await;
    }
    wait_for_state(&stored, "delivered").await;
    wait_for_state(&direct, "delivered").await;
}

/// A client that acks its drain in one `ack` message: each message it
/// names reads `delivered` and is counted once as such, one it names with
/// a version that is not its own stays, and the next hello brings only
/// that one.
async fn a_drain_acked_in_one_message_settles_each_message_named(db: Db) {
    let [metrics_port] = free_ports::<1>();
    let server = start(db, &["--metrics-port", &metrics_port.to_string()]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let mut receipts = Vec::new();
    for i in 0..4 {
        receipts.push(location(&sub.push_text(&format!("m{i}")).await));
    }
    let mut ws = server.reconnect(&uaid).await;
    let mut drained = Vec::new();
    for _ in 0..4 {
        let (n, d) = sub.receive(&mut ws).await;
        drained.push((d.text, n));
    }
    drained.sort_by(|a, b| a.0.cmp(&b.0));
    let mut acks: Vec<_> = drained.iter().map(|(_, n)| n.clone()).collect();
    acks[3]["version"] = "not its version".into();
    ws.ack_notifications(&acks).await;
    for receipt in &receipts[..3] {
        wait_for_state(receipt, "delivered").await;
    }
    let delivered = [("router_type", "webpush"), ("state", "delivered")];
    wait_until("three delivered counted", async || {
        let reply = http::get(&format!("http://127.0.0.1:{metrics_port}/metrics")).await;
        Scrape::parse(&reply.text).value("notification_final", &delivered) == 3.0
    })
    .await;
    assert_eq!(state_of(&receipts[3]).await, "sent");
    ws.close().await;
    let mut ws = server.reconnect(&uaid).await;
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "m3");
    ws.assert_nothing_arrives().await;
}

/// A VAPID-restricted subscription's receipts need the push's VAPID key.
async fn a_v2_receipt_needs_the_push_vapid_key(db: Db) {
    let server = start(db, &[]).await;
    let (_, sub) = server.offline_subscription(true).await;
    let receipt = location(&sub.push_text("restricted").await);
    let audience = server.endpoint_base();
    let signed_by = |key: &SigningKey| {
        let authorization = key.authorization(&audience, "mailto:ops@example.com");
        let receipt = receipt.clone();
        async move {
            let headers = [("authorization", authorization.as_str())];
            http::request(reqwest::Method::GET, &receipt, &headers, None).await
        }
    };
    http::get(&receipt).await.assert_error(401, 109);
    signed_by(&SigningKey::generate())
        .await
        .assert_error(401, 109);
    let private = unb64(&sub.vapid_key().private_key);
    let key = SigningKey::from_bytes(&private).expect("the subscription's VAPID key");
    assert_eq!(state(&signed_by(&key).await), "stored");
}

/// Cancelling a message to a VAPID-restricted subscription needs the
/// push's VAPID key, as reading its receipt does: its URL is not enough.
#[tokio::test]
async fn a_v2_message_is_cancelled_only_with_its_vapid_key() {
    let server = Server::start().await;
    let (_, sub) = server.offline_subscription(true).await;
    let message = location(&sub.push_text("restricted").await);
    let audience = server.endpoint_base();
    let signed_by = |method: reqwest::Method, key: &SigningKey| {
        let authorization = key.authorization(&audience, "mailto:ops@example.com");
        let message = message.clone();
        async move {
            let headers = [("authorization", authorization.as_str())];
            http::request(method, &message, &headers, None).await
        }
    };
    let key = SigningKey::from_bytes(&unb64(&sub.vapid_key().private_key))
        .expect("the subscription's VAPID key");
    http::delete(&message).await.assert_error(401, 109);
    signed_by(reqwest::Method::DELETE, &SigningKey::generate())
        .await
        .assert_error(401, 109);
    assert_eq!(
        state(&signed_by(reqwest::Method::GET, &key).await),
        "stored"
    );
    let cancelled = signed_by(reqwest::Method::DELETE, &key).await;
    assert_eq!(cancelled.status, 204, "{}", cancelled.text);
    assert_eq!(
        state(&signed_by(reqwest::Method::GET, &key).await),
        "deleted"
    );
}

fn unb64(text: &str) -> Vec<u8> {
    autopush_crypto::unb64(text).expect("base64url")
}

/// Past its retention window a receipt is 404/102, whether it was kept in
/// storage (delivered) or sealed into the id (dropped). The `delivered`
/// receipt itself is not awaited here: on a loaded machine the one-second
/// window may pass first (the other tests read it with the default window).
async fn a_receipt_is_gone_after_its_retention(db: Db) {
    let server = start(db, &["--receipt-retention", "1"]).await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let delivered = location(&sub.push_text("delivered").await);
    let (n, _) = sub.receive(&mut ws).await;
    ws.ack_notification(&n).await;
    ws.close().await;
    let dropped = location(&sub.send(&SendOptions::text("dropped").ttl(0)).await);
    wait_for_404(&delivered).await;
    wait_for_404(&dropped).await;
}

on_every_backend!(
    each_webpush_state,
    a_pending_message_of_a_removed_registration_is_gone,
    a_pending_message_of_an_unsubscribed_channel_is_gone,
    a_client_that_leaves_unacked_turns_sent_back_into_stored,
    a_drain_acked_in_one_message_settles_each_message_named,
    a_v2_receipt_needs_the_push_vapid_key,
    a_receipt_is_gone_after_its_retention,
);

/// With `--receipt-retention 0` (the default on Bigtable) there are no
/// receipts: a receipt URL answers 404 saying so, and pushes, acks and
/// DELETE work as before.
#[tokio::test]
async fn receipts_can_be_turned_off() {
    let server = start(Db::Embedded, &["--receipt-retention", "0"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let kept = location(&sub.push_text("kept").await);
    let cancelled = location(&sub.push_text("cancelled").await);
    let reply = http::get(&kept).await;
    reply.assert_error(404, 102);
    let message = reply.json["message"].as_str().unwrap_or_default();
    assert!(message.contains("Receipts are off"), "{reply:?}");
    assert_eq!(http::delete(&cancelled).await.status, 204);
    let mut ws = server.reconnect(&uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "kept");
    ws.ack_notification(&n).await;
    ws.assert_nothing_arrives().await;
}

/// Operators see what the 201s became: `notification.final` by state and
/// router type; what the store settles itself (`replaced`, `gone`) under
/// router type `unknown`.
#[tokio::test]
async fn final_states_are_counted() {
    let [metrics_port] = free_ports::<1>();
    let server = start(Db::Embedded, &["--metrics-port", &metrics_port.to_string()]).await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let uaid = ws.uaid().to_string();
    sub.push_text("delivered").await;
    let (n, _) = sub.receive(&mut ws).await;
    ws.ack_notification(&n).await;
    ws.close().await;
    let deleted = location(&sub.push_text("deleted").await);
    assert_eq!(http::delete(&deleted).await.status, 204);
    sub.send(&SendOptions::text("dropped").ttl(0))
        .await
        .assert_created();
    // Replaced by a newer message with its Topic, which is then gone with
    // its channel, as is a plain one.
    sub.send(&SendOptions::text("replaced").topic("t"))
        .await
        .assert_created();
    sub.send(&SendOptions::text("gone").topic("t"))
        .await
        .assert_created();
    sub.push_text("gone too").await;
    let mut ws = server.reconnect(&uaid).await;
    ws.recv_notifications(2).await;
    ws.unregister(&sub.channel_id, 200).await;
    let want = [
        ("webpush", "delivered", 1.0),
        ("webpush", "deleted", 1.0),
        ("webpush", "dropped", 1.0),
        ("unknown", "replaced", 1.0),
        ("unknown", "gone", 2.0),
    ];
    let counted = async || {
        let reply = http::get(&format!("http://127.0.0.1:{metrics_port}/metrics")).await;
        let scrape = Scrape::parse(&reply.text);
        want.iter().all(|(router_type, state, n)| {
            let labels = [("router_type", *router_type), ("state", *state)];
            scrape.value("notification_final", &labels) == *n
        })
    };
    wait_until(&format!("notification_final counting {want:?}"), counted).await;
}

/// Storage operations (as `storage.time` counts them) of 10 messages
/// pushed to a connected client and acked, then 10 stored and drained.
async fn storage_operations(args: &[&str]) -> (f64, f64) {
    let [metrics_port] = free_ports::<1>();
    let mut all = vec!["--metrics-port".to_owned(), metrics_port.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let server = start(Db::Embedded, &all).await;
    // Every operation so far, once `acks` acks have been settled.
    let scrape = async |acks: f64| {
        let settle = [("backend", "embedded"), ("op", "settle_message")];
        let mut total = 0.0;
        wait_until("the acks settling", async || {
            let reply = http::get(&format!("http://127.0.0.1:{metrics_port}/metrics")).await;
            let scrape = Scrape::parse(&reply.text);
            total = scrape.sum("storage_time_count");
            scrape.value("storage_time_count", &settle) >= acks
        })
        .await;
        total
    };
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let before = scrape(0.0).await;
    for i in 0..10 {
        sub.push_text(&format!("direct {i}")).await;
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    ws.close().await;
    let direct = scrape(10.0).await - before;
    let before = scrape(10.0).await;
    for i in 0..10 {
        sub.push_text(&format!("stored {i}")).await;
    }
    let mut ws = server.reconnect(&uaid).await;
    for _ in 0..10 {
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    (direct, scrape(20.0).await - before)
}

/// On the embedded store too, receipts cost no storage operation: the
/// ack's delete becomes the write of the receipt.
#[tokio::test]
async fn receipts_cost_no_storage_operation() {
    let off = storage_operations(&["--receipt-retention", "0"]).await;
    let on = storage_operations(&[]).await;
    eprintln!(
        "embedded storage operations for 10 messages (direct, stored+drained): receipts off {off:?}, on {on:?}"
    );
    assert_eq!(off, on);
}
