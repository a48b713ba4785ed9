//! Bridged messages accounted for: receipts of pushes to an iOS app (the
//! APNs double), and the mailbox of a registration that asked for one,
//! which still holds every message when Apple keeps only the last.

use autopush_apns::double::{ApnsDouble, Outcome};
use autopush_tests::apns::{
    ApnsService, FIREFOX, IosApp, device_token, headers as apns_headers, payload,
};
use autopush_tests::http::{self, HttpReply};
use autopush_tests::mailbox;
use autopush_tests::receipt::{id_of, location, state_of, wait_for_state};
use autopush_tests::*;
use serde_json::{Value, json};

/// Every message in `app`'s mailbox, page by page (`limit` a page).
async fn fetch_all(service: &ApnsService, app: &IosApp, limit: usize) -> Vec<Value> {
    mailbox::fetch_all(limit, async |query| {
        service.mailbox(app, &app.secret, query).await
    })
    .await
}

/// Without a mailbox, a push Apple accepted is `bridged` for good: a
/// DELETE changes nothing. One Apple refused got an error and no receipt.
#[tokio::test]
async fn a_push_apple_accepted_is_bridged() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service.register(FIREFOX, &token, json!({})).await;
    let bridged = location(&app.send(&SendOptions::text("to the phone")).await);
    assert_eq!(state_of(&bridged).await, "bridged");
    assert_eq!(http::delete(&bridged).await.status, 204);
    assert_eq!(state_of(&bridged).await, "bridged");
    // TTL 0 goes to Apple too.
    let now = location(&app.send(&SendOptions::text("now").ttl(0)).await);
    assert_eq!(state_of(&now).await, "bridged");
    // A mailbox listing is only for registrations that asked for one.
    service
        .mailbox(&app, &app.secret, "")
        .await
        .assert_error(404, 102);

    service
        .double
        .script(&token, [Outcome::refused(400, "BadDeviceToken")]);
    let refused = app.send(&SendOptions::text("refused")).await;
    assert!(refused.header("location").is_none(), "{refused:?}");
    assert!(refused.status >= 400, "{refused:?}");
}

/// The app's device is offline: Apple keeps only the last notification,
/// but the mailbox has all of them, oldest first, in pages; the app
/// decrypts and acks each (fetched), and a second ack is 404.
#[tokio::test]
async fn the_mailbox_survives_apple_keeping_only_the_last() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service
        .register(FIREFOX, &token, json!({"mailbox": true}))
        .await;
    service.double.go_offline(&token);
    let texts = ["one", "two", "three", "four", "five"];
    let mut receipts = Vec::new();
    for text in texts {
        receipts.push(location(&app.send(&SendOptions::text(text)).await));
    }
    for receipt in &receipts {
        assert_eq!(state_of(receipt).await, "bridged");
    }
    assert_eq!(service.double.requests_for(&token).len(), texts.len());
    // The device comes back with the last notification only.
    let kept = service
        .double
        .come_online(&token)
        .expect("a kept notification");
    assert_eq!(app.decrypt(&kept).await.text, "five");

    let listed = fetch_all(&service, &app, 2).await;
    assert_eq!(listed.len(), texts.len(), "{listed:?}");
    for ((message, text), receipt) in listed.iter().zip(texts).zip(&receipts) {
        assert_eq!(app.decrypt_fields(message).await.text, text);
        assert_eq!(message["ver"], id_of(receipt), "{message}");
        assert_eq!(message["chid"], app.channel_id.as_str(), "{message}");
        assert_eq!(message["ttl"], 60, "{message}");
        assert!(message["received"].as_u64().is_some(), "{message}");
    }
    for (message, receipt) in listed.iter().zip(&receipts) {
        let id = message["ver"].as_str().unwrap();
        let acked = service.ack(&app, id).await;
        assert_eq!(acked.status, 200, "{}", acked.text);
        assert_eq!(state_of(receipt).await, "fetched");
        service.ack(&app, id).await.assert_error(404, 102);
    }
    assert!(fetch_all(&service, &app, 10).await.is_empty());
}

/// The mailbox keeps the usual rules: a newer message with the same Topic
/// replaces an older one, an expired one is not listed, the sender may
/// delete one, and a removed registration leaves the rest `gone`.
#[tokio::test]
async fn the_mailbox_keeps_topic_ttl_and_delete_rules() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service
        .register(FIREFOX, &token, json!({"mailbox": true}))
        .await;
    let first = location(&app.send(&SendOptions::text("first").topic("score")).await);
    let second = location(&app.send(&SendOptions::text("second").topic("score")).await);
    let expiring = location(&app.send(&SendOptions::text("expiring").ttl(1)).await);
    let deleted = location(&app.send(&SendOptions::text("deleted")).await);
    let pending = location(&app.send(&SendOptions::text("pending")).await);
    assert_eq!(http::delete(&deleted).await.status, 204);
    assert_eq!(state_of(&first).await, "replaced");
    assert_eq!(state_of(&deleted).await, "deleted");
    wait_for_state(&expiring, "expired").await;
    let listed = fetch_all(&service, &app, 10).await;
    let mut texts = Vec::new();
    for message in &listed {
        texts.push(app.decrypt_fields(message).await.text);
    }
    assert_eq!(texts, ["second", "pending"], "{listed:?}");
    assert_eq!(listed[0]["topic"], "score");

    let url = service.registration_url(FIREFOX, &format!("/{}", app.uaid));
    let bearer = format!("Bearer {}", app.secret);
    let removed = http::request(
        reqwest::Method::DELETE,
        &url,
        &[("authorization", bearer.as_str())],
        None,
    )
    .await;
    assert_eq!(removed.status, 200, "{}", removed.text);
    assert_eq!(state_of(&second).await, "gone");
    assert_eq!(state_of(&pending).await, "gone");
    assert_eq!(state_of(&deleted).await, "deleted");
}

/// Only the registration's own secret reads or acks its mailbox.
#[tokio::test]
async fn the_mailbox_needs_the_registration_secret() {
    let service = ApnsService::start().await;
    let app = service
        .register(FIREFOX, &device_token(), json!({"mailbox": true}))
        .await;
    let other = service
        .register(FIREFOX, &device_token(), json!({"mailbox": true}))
        .await;
    let sent = location(&app.send(&SendOptions::text("mine")).await);
    let expect_401 = |reply: HttpReply| reply.assert_error(401, 109);
    expect_401(service.mailbox(&app, &other.secret, "").await);
    expect_401(service.mailbox(&app, "not-a-secret", "").await);
    // Another registration cannot ack it, even with its own secret.
    service
        .ack(&other, id_of(&sent))
        .await
        .assert_error(404, 102);
    let mine = service.mailbox(&app, &app.secret, "").await;
    assert_eq!(mine.json["messages"].as_array().map(Vec::len), Some(1));
}

/// A mailbox holds at most `--msg-limit` messages: past it the sender gets
/// 429 with Retry-After and nothing goes to Apple; an ack makes room.
#[tokio::test]
async fn a_full_mailbox_refuses_more() {
    let double = ApnsDouble::new();
    let service = ApnsService::start_configured(double, |layer| layer.msg_limit = Some(2)).await;
    let token = device_token();
    let app = service
        .register(FIREFOX, &token, json!({"mailbox": true}))
        .await;
    let first = location(&app.send(&SendOptions::text("1")).await);
    location(&app.send(&SendOptions::text("2")).await);
    let refused = app.send(&SendOptions::text("3")).await;
    mailbox::assert_full(&refused, 2);
    assert_eq!(service.double.requests_for(&token).len(), 2);
    assert_eq!(service.ack(&app, id_of(&first)).await.status, 200);
    let scored = location(&app.send(&SendOptions::text("3").topic("score")).await);
    // Full again, but a message that only replaces one with its Topic
    // takes no more room: it is accepted; a new Topic is not.
    app.send(&SendOptions::text("4").topic("other"))
        .await
        .assert_error(429, 201);
    location(&app.send(&SendOptions::text("4").topic("score")).await);
    assert_eq!(state_of(&scored).await, "replaced");
    let listed = fetch_all(&service, &app, 10).await;
    assert_eq!(listed.len(), 2);
}

/// A wake-only registration: Apple receives the content-free wake-up
/// (expiry and urgency only: no body, channel id, version or sender)
/// while the app fetches a 6 KB body from its mailbox. The same body to a
/// registration that sends it to Apple is 413 errno 104 naming the room
/// there is, and nothing goes to Apple.
#[tokio::test]
async fn a_wake_only_registration_shows_apple_nothing_of_the_message() {
    let double = ApnsDouble::new();
    let service =
        ApnsService::start_configured(double, |layer| layer.max_data_bytes = Some(8192)).await;
    let token = device_token();
    let private = json!({"mailbox": true, "wake_only": true});
    let app = service.register(FIREFOX, &token, private).await;
    let body = opaque_body(6 * 1024);
    let headers = [
        ("TTL", "600"),
        ("Topic", "chat-topic-7"),
        ("Content-Type", "application/webpush-message"),
    ];
    let sent = http::post_push(&app.endpoint, &headers, Some(body.clone())).await;
    assert_eq!(sent.status, 201, "{}", sent.text);
    let id = sent.header("location").and_then(|l| l.rsplit('/').next());
    let id = id.expect("Location").to_owned();
    service.double.wait_for(1).await;
    let woken = service.double.requests_for(&token);
    assert_eq!(woken.len(), 1);
    assert_eq!(
        payload(&woken[0]),
        json!({"aps": {"content-available": 1}, "wake": 1})
    );
    let sent_headers = apns_headers(&woken[0]);
    assert_eq!(sent_headers["apns-collapse-id"], "wake");
    assert_eq!(sent_headers["apns-push-type"], "background");
    assert_eq!(sent_headers["apns-priority"], "5");
    let upstream = format!("{sent_headers:?} {}", woken[0].request.payload);
    let sample = base64::Engine::encode(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        &body[..48],
    );
    let secrets = [
        app.channel_id.as_str(),
        &id,
        &sample,
        "chat-topic-7",
        "body",
    ];
    mailbox::assert_holds_none_of(&upstream, &secrets);

    let listed = fetch_all(&service, &app, 10).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(
        mailbox::body_bytes(&listed[0]) == body,
        "the fetched body differs"
    );
    assert_eq!(listed[0]["ver"], id.as_str());

    for extra in [json!({}), json!({"mailbox": true})] {
        let other = device_token();
        let app = service.register(FIREFOX, &other, extra).await;
        let refused = http::post_push(&app.endpoint, &headers, Some(body[..4000].to_vec())).await;
        refused.assert_error(413, 104);
        let message = refused.json["message"].as_str().unwrap_or_default();
        let limit = message
            .split("at most ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse::<usize>().ok());
        assert!(limit.is_some_and(|n| n < 4000), "{message}");
        assert!(service.double.requests_for(&other).is_empty());
    }
}
