//! The APNs bridge end to end: an iOS app registers through
//! `/v1/apns/{channel}/registration`, an application server pushes to the
//! endpoint with pywebpush, and we check what Apple would have received (the
//! double records it) and what the application server was told, for every
//! answer Apple can give.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use autopush_apns::double::{ApnsDouble, Outcome};
use autopush_apns::payload::default_aps;
use autopush_apns::sender::TransportError;
use autopush_tests::apns::{
    ApnsService, BETA, BETA_TOPIC, CAPPED, FIREFOX, FIREFOX_TOPIC, device_token, headers, payload,
};
use autopush_tests::http::post_push;
use autopush_tests::*;
use serde_json::json;
use tokio::sync::Notify;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[tokio::test]
async fn pywebpush_reaches_the_app_in_both_encodings() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service.register(FIREFOX, &token, json!({})).await;
    assert!(
        app.endpoint.starts_with(service.endpoint_base()),
        "{}",
        app.endpoint
    );
    let vapid = VapidKey::generate().await;
    for (i, encoding) in Encoding::ALL.into_iter().enumerate() {
        let text = format!("hello iPhone, {}", encoding.as_str());
        let before = now();
        let sent = app
            .send(
                &SendOptions::text(&text)
                    .encoding(encoding)
                    .ttl(120)
                    .topic("news")
                    .vapid(&vapid),
            )
            .await;
        let after = now();
        sent.assert_created();
        assert_eq!(sent.header("ttl"), Some("120"));

        let recorded = service.double.recorded();
        assert_eq!(recorded.len(), i + 1, "one request to Apple per push");
        let delivered = &recorded[i];
        assert_eq!(delivered.channel, FIREFOX);
        assert_eq!(delivered.request.device_token, token);

        let sent_headers = headers(delivered);
        assert_eq!(sent_headers["apns-topic"], FIREFOX_TOPIC);
        assert_eq!(sent_headers["apns-push-type"], "alert");
        assert_eq!(sent_headers["apns-priority"], "10");
        assert_eq!(sent_headers["apns-collapse-id"], "news");
        let expiration: u64 = sent_headers["apns-expiration"].parse().unwrap();
        assert!(
            (before + 120..=after + 120).contains(&expiration),
            "apns-expiration {expiration} is not now + TTL"
        );
        assert_eq!(sent_headers.len(), 5, "{sent_headers:?}");

        let body = payload(delivered);
        let mut keys: Vec<&str> = body
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort();
        let mut expected = vec!["aps", "body", "chid", "con", "ver"];
        if encoding == Encoding::AesGcm {
            expected.extend(["cryptokey", "enc"]);
            expected.sort();
        }
        assert_eq!(keys, expected, "{body}");
        assert_eq!(body["aps"], default_aps());
        assert_eq!(body["chid"], app.channel_id.as_str());
        assert_eq!(body["con"], encoding.as_str());
        let location = sent.header("location").unwrap();
        assert!(
            location.ends_with(body["ver"].as_str().unwrap()),
            "{location} vs {body}"
        );
        assert!(delivered.request.payload.len() <= 4096);

        // The app's notification service extension can decrypt it.
        assert_eq!(app.decrypt(delivered).await.text, text);
    }
}

#[tokio::test]
async fn urgency_ttl_zero_and_an_empty_push_map_onto_apns_headers() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service.register(BETA, &token, json!({})).await;
    post_push(&app.endpoint, &[("ttl", "0"), ("urgency", "low")], None)
        .await
        .assert_created();
    post_push(
        &app.endpoint,
        &[("ttl", "30"), ("urgency", "very-low")],
        None,
    )
    .await
    .assert_created();
    post_push(&app.endpoint, &[("ttl", "30"), ("urgency", "high")], None)
        .await
        .assert_created();
    let recorded = service.double.recorded();
    let first = headers(&recorded[0]);
    assert_eq!(first["apns-topic"], BETA_TOPIC);
    assert_eq!(first["apns-priority"], "5");
    assert_eq!(first["apns-expiration"], "0", "TTL 0: now or never");
    assert!(!first.contains_key("apns-collapse-id"));
    assert_eq!(headers(&recorded[1])["apns-priority"], "5");
    assert_eq!(headers(&recorded[2])["apns-priority"], "10");
    // No body: the app learns which channel, and nothing to decrypt.
    let body = payload(&recorded[0]);
    assert_eq!(body["chid"], app.channel_id.as_str());
    assert!(
        body.get("body").is_none() && body.get("con").is_none(),
        "{body}"
    );
}

/// The README's Urgency table, as Apple receives it: `very-low` is a
/// background push at priority 5 (Apple allows no other for one) with
/// `content-available` and no alert, even over a registration's own `aps`;
/// `low` an alert at 5; `normal` and `high` alerts at 10. The app can
/// decrypt each.
#[tokio::test]
async fn every_urgency_maps_onto_apns_priority_and_push_type() {
    let service = ApnsService::start().await;
    let token = device_token();
    let aps = json!({"alert": {"loc-key": "push.body"}, "sound": "default"});
    let app = service
        .register(FIREFOX, &token, json!({"aps": aps.clone()}))
        .await;
    let table = [
        ("very-low", "5", "background"),
        ("low", "5", "alert"),
        ("normal", "10", "alert"),
        ("high", "10", "alert"),
    ];
    for (urgency, _, _) in table {
        app.send(&SendOptions::text(urgency).ttl(60).urgency(urgency))
            .await
            .assert_created();
    }
    let recorded = service.double.recorded();
    assert_eq!(recorded.len(), table.len());
    for ((urgency, priority, push_type), delivered) in table.iter().zip(&recorded) {
        let sent = headers(delivered);
        assert_eq!(
            (
                sent["apns-priority"].as_str(),
                sent["apns-push-type"].as_str()
            ),
            (*priority, *push_type),
            "Urgency {urgency}"
        );
        let body = payload(delivered);
        let want_aps = match *push_type {
            "background" => json!({"content-available": 1}),
            _ => aps.clone(),
        };
        assert_eq!(body["aps"], want_aps, "Urgency {urgency}");
        assert_eq!(app.decrypt(delivered).await.text, *urgency);
    }
}

#[tokio::test]
async fn a_registration_may_replace_the_default_aps_and_its_token() {
    let service = ApnsService::start().await;
    let aps = json!({"alert": {"title-loc-key": "push.title", "loc-key": "push.body"},
                     "mutable-content": 1, "sound": "default"});
    let first = device_token();
    let mut app = service
        .register(FIREFOX, &first, json!({"aps": aps.clone()}))
        .await;
    app.send(&SendOptions::text("one")).await.assert_created();

    let second = device_token();
    let reply = service.update_token(&mut app, &second).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    app.send(&SendOptions::text("two")).await.assert_created();

    let recorded = service.double.recorded();
    assert_eq!(recorded[0].request.device_token, first);
    assert_eq!(payload(&recorded[0])["aps"], aps);
    assert_eq!(recorded[1].request.device_token, second);
    assert_eq!(app.decrypt(&recorded[1]).await.text, "two");
}

#[tokio::test]
async fn registrations_apple_would_refuse_are_refused() {
    let service = ApnsService::start().await;
    for (body, why) in [
        (json!({}), "none given"),
        (json!({"token": "11-instance-id-11"}), "hex"),
        (json!({"token": "abcdef"}), "32 to 200"),
        (json!({"token": device_token(), "aps": [1]}), "aps"),
        (
            json!({"token": device_token(), "aps": {"badge": "one"}}),
            "badge",
        ),
    ] {
        let reply = service.try_register(FIREFOX, body.clone()).await;
        reply.assert_error(400, 110);
        assert!(
            reply.json["message"].as_str().unwrap().contains(why),
            "{body}: {}",
            reply.text
        );
    }
    let reply = service
        .try_register("nightly", json!({"token": device_token()}))
        .await;
    reply.assert_error(400, 108);
    assert!(service.double.recorded().is_empty());
}

#[tokio::test]
async fn a_device_apple_says_is_gone_is_removed_and_the_sender_gets_410() {
    let service = ApnsService::start().await;
    for (status, reason) in [
        (410, "Unregistered"),
        (400, "BadDeviceToken"),
        (400, "DeviceTokenNotForTopic"),
    ] {
        let token = device_token();
        let app = service.register(FIREFOX, &token, json!({})).await;
        service
            .double
            .script(&token, [Outcome::refused(status, reason)]);
        app.send(&SendOptions::text("anyone there?"))
            .await
            .assert_error(410, 106);
        // The registration is gone: the app's own view and the next push say so,
        // and Apple is not asked again.
        let reply = service.channels(&app).await;
        assert_eq!(reply.status, 410, "{reason}: {}", reply.text);
        let again = app.send(&SendOptions::text("still?")).await;
        assert_eq!(again.status, 410, "{reason}: {}", again.body);
        assert_eq!(service.double.requests_for(&token).len(), 1, "{reason}");
    }
}

#[tokio::test]
async fn a_503_is_retried_and_the_push_delivered() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service.register(FIREFOX, &token, json!({})).await;
    service
        .double
        .script(&token, [Outcome::refused(503, "ServiceUnavailable")]);
    app.send(&SendOptions::text("second time lucky"))
        .await
        .assert_created();
    let requests = service.double.requests_for(&token);
    assert_eq!(requests.len(), 2);
    assert_eq!(
        requests[0].request, requests[1].request,
        "the same request again"
    );
    assert_eq!(app.decrypt(&requests[1]).await.text, "second time lucky");
}

#[tokio::test]
async fn apple_failing_for_good_gives_502_or_503_with_retry_after() {
    let service = ApnsService::start().await;
    let cases = [
        (Outcome::refused(503, "ServiceUnavailable"), 503, 201),
        (Outcome::refused(500, "InternalServerError"), 502, 902),
        (
            Outcome::Fail(TransportError::Connect("connection refused".into())),
            502,
            902,
        ),
    ];
    for (outcome, status, errno) in cases {
        let token = device_token();
        let app = service.register(FIREFOX, &token, json!({})).await;
        service
            .double
            .script(&token, std::iter::repeat_n(outcome.clone(), 10));
        let sent = app.send(&SendOptions::text("nobody home")).await;
        sent.assert_error(status, errno);
        if status == 503 {
            let retry_after: u64 = sent.header("retry-after").unwrap_or("").parse().unwrap();
            assert!(retry_after > 0, "{outcome:?}");
        }
        let tries = service.double.requests_for(&token).len();
        assert!((2..=3).contains(&tries), "{outcome:?}: {tries} tries");
        // The registration stays.
        assert_eq!(service.channels(&app).await.status, 200);
    }
}

#[tokio::test]
async fn apples_too_many_requests_is_a_429_to_the_sender() {
    let service = ApnsService::start().await;
    for outcome in [
        Outcome::refused(429, "TooManyRequests"),
        Outcome::refused(429, ""),
    ] {
        let token = device_token();
        let app = service.register(FIREFOX, &token, json!({})).await;
        service
            .double
            .script(&token, std::iter::repeat_n(outcome.clone(), 10));
        let sent = post_push(&app.endpoint, &[("ttl", "60")], None).await;
        let limit = sent.assert_rate_limited(&format!("{outcome:?}"));
        // Apple gives no Retry-After: the documented default. Its quota is
        // not known: none passes for that long.
        assert_eq!(sent.header("retry-after"), Some("30"), "{outcome:?}");
        assert_eq!(
            (limit.policy.as_str(), limit.quota, limit.window),
            ("upstream", 0, Some(30)),
            "{outcome:?}"
        );
        // Apple asks us to slow down for this device: not asked again at once.
        assert_eq!(service.double.requests_for(&token).len(), 1, "{outcome:?}");
        assert_eq!(service.channels(&app).await.status, 200, "{outcome:?}");
    }
}

#[tokio::test]
async fn a_channel_over_its_rate_gets_429_while_other_channels_go_on() {
    // Two pushes at once per channel, then one per 100 s.
    let service = ApnsService::start_configured(ApnsDouble::new(), |layer| {
        layer.bridge_app_limit = Some("0.01,2".into());
    })
    .await;
    let busy_token = device_token();
    let busy = service.register(FIREFOX, &busy_token, json!({})).await;
    let other_token = device_token();
    let other = service.register(BETA, &other_token, json!({})).await;
    let push = |endpoint: String| async move { post_push(&endpoint, &[("ttl", "60")], None).await };

    for _ in 0..2 {
        push(busy.endpoint.clone()).await.assert_created();
    }
    let refused = push(busy.endpoint.clone()).await;
    let limit = refused.assert_rate_limited("the channel's 3rd push");
    assert!((1..=100).contains(&limit.reset), "{limit:?}");
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("bridge_app", 2, Some(200)),
        "{limit:?}"
    );
    assert!(refused.text.contains("bridge app"), "{}", refused.text);
    // The other channel's burst is whole.
    for _ in 0..2 {
        push(other.endpoint.clone()).await.assert_created();
    }
    assert_eq!(service.double.requests_for(&busy_token).len(), 2);
    assert_eq!(service.double.requests_for(&other_token).len(), 2);
}

#[tokio::test]
async fn refused_credentials_timeouts_and_unknown_reasons_are_bridge_errors() {
    let service = ApnsService::start().await;
    let cases = [
        (Outcome::refused(403, "ExpiredProviderToken"), 502, 901),
        (Outcome::refused(403, "InvalidProviderToken"), 502, 901),
        (Outcome::refused(403, "BadCertificate"), 502, 901),
        (Outcome::refused(400, "BadTopic"), 502, 902),
        (Outcome::refused(400, "ANewReasonAppleAdded"), 502, 902),
        (Outcome::Hang, 502, 903),
    ];
    for (outcome, status, errno) in cases {
        let token = device_token();
        let app = service.register(FIREFOX, &token, json!({})).await;
        service.double.script(&token, [outcome.clone()]);
        app.send(&SendOptions::text("hmm"))
            .await
            .assert_error(status, errno);
        assert_eq!(service.double.requests_for(&token).len(), 1, "{outcome:?}");
        assert_eq!(service.channels(&app).await.status, 200, "{outcome:?}");
    }
}

#[tokio::test]
async fn a_payload_over_apples_limit_is_refused_before_sending() {
    let service = ApnsService::start().await;
    let token = device_token();
    let app = service.register(FIREFOX, &token, json!({})).await;
    let sent = app.send(&SendOptions::pattern(MAX_PLAINTEXT)).await;
    sent.assert_error(413, 104);
    let message = sent.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("bridged messages hold less"), "{message}");
    assert!(service.double.recorded().is_empty());
    // What the message says fits, does: an aes128gcm body is the plaintext
    // plus 103 bytes.
    let room: usize = message
        .split("at most ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size in {message:?}"));
    assert!(room > 2000, "{message}");
    app.send(&SendOptions::pattern(room - 103 - 16))
        .await
        .assert_created();
}

#[tokio::test]
async fn a_slow_channel_delays_neither_other_channels_nor_webpush() {
    let service = ApnsService::start().await;
    let slow_token = device_token();
    let slow = service.register(CAPPED, &slow_token, json!({})).await;
    let fast = service.register(BETA, &device_token(), json!({})).await;
    let release = Arc::new(Notify::new());
    service
        .double
        .script(&slow_token, [Outcome::HoldUntil(release.clone())]);
    let stuck = tokio::spawn(async move { slow.send(&SendOptions::text("slow")).await });
    service.double.wait_for(1).await;

    // While Apple sits on the capped channel's push, the others go through.
    fast.send(&SendOptions::text("fast")).await.assert_created();
    let mut ws = WsClient::connect_hello(service.ws_url(), None).await;
    let sub = Subscription::new(&mut ws).await;
    sub.send(&SendOptions::text("webpush"))
        .await
        .assert_created();
    let (_, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "webpush");
    assert!(
        !stuck.is_finished(),
        "Apple has not answered the slow push yet"
    );

    release.notify_one();
    stuck.await.unwrap().assert_created();
}

#[tokio::test]
async fn beyond_a_channels_in_flight_cap_senders_get_503_with_retry_after() {
    let double = ApnsDouble::new();
    let service = ApnsService::start_with(double.clone()).await;
    let held_token = device_token();
    let held = service.register(CAPPED, &held_token, json!({})).await;
    let other = service.register(CAPPED, &device_token(), json!({})).await;
    let release = Arc::new(Notify::new());
    double.script(&held_token, [Outcome::HoldUntil(release.clone())]);
    let stuck = tokio::spawn(async move { held.send(&SendOptions::text("held")).await });
    double.wait_for(1).await;

    let refused = other.send(&SendOptions::text("no room")).await;
    refused.assert_error(503, 201);
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(
        double.recorded().len(),
        1,
        "the refused push never reached Apple"
    );

    release.notify_one();
    stuck.await.unwrap().assert_created();
    // The slot is free again.
    other
        .send(&SendOptions::text("room now"))
        .await
        .assert_created();
}
