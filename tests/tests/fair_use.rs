//! Rate limits per sender, not per address: a sender over its limit gets
//! 429 with Retry-After (errno 201) while everyone else keeps getting 201.
//! The limits are set tiny here (a token every 100 s) so that what a test
//! sends is all the bucket ever gets. Where a test needs senders at other
//! addresses, the server trusts 127.0.0.1 as a proxy and each request names
//! its client in `X-Forwarded-For`.

use autopush_crypto::vapid::VapidKey as SigningKey;
use autopush_tests::http::{self, HttpReply, request};
use autopush_tests::prometheus::Scrape;
use autopush_tests::*;
use reqwest::Method;
use serde_json::json;

/// A 429 as the README promises it: errno 201 and a Retry-After to honour.
fn assert_limited(status: u16, errno: Option<u64>, retry_after: Option<&str>, what: &str) {
    assert_eq!(status, 429, "{what}: expected 429");
    assert_eq!(errno, Some(201), "{what}: errno");
    let seconds: u64 = retry_after
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{what}: no Retry-After in seconds"));
    assert!(seconds >= 1, "{what}: Retry-After {seconds}");
}

async fn refused(server: &Server, limit: &str) -> f64 {
    let reply = http::get(&format!("{}/metrics", server.router_base())).await;
    Scrape::parse(&reply.text).value("rate_limit_refused", &[("limit", limit)])
}

#[tokio::test]
async fn a_sender_over_its_limit_does_not_slow_another_sender() {
    let server = Server::start_with(&["--sender-limit", "0.01,3"]).await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let (noisy, quiet) = (VapidKey::generate().await, VapidKey::generate().await);
    for i in 0..3 {
        sub.send(&SendOptions::text(&format!("noisy {i}")).vapid(&noisy))
            .await
            .assert_created();
    }
    let over = sub.send(&SendOptions::text("noisy 3").vapid(&noisy)).await;
    assert_limited(
        over.status,
        over.json()["errno"].as_u64(),
        over.header("retry-after"),
        "the noisy sender's 4th push",
    );
    // The same subscription, another VAPID key: unaffected.
    for i in 0..3 {
        sub.send(&SendOptions::text(&format!("quiet {i}")).vapid(&quiet))
            .await
            .assert_created();
    }
    // What was refused was never delivered; what was accepted was.
    let mut got = Vec::new();
    for _ in 0..6 {
        let (n, d) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
        got.push(d.text);
    }
    got.sort();
    assert_eq!(
        got,
        [
            "noisy 0", "noisy 1", "noisy 2", "quiet 0", "quiet 1", "quiet 2"
        ]
    );
    ws.assert_nothing_arrives().await;
    assert_eq!(refused(&server, "sender").await, 1.0);
}

#[tokio::test]
async fn unsigned_pushes_count_against_their_subscription_and_address() {
    let server = Server::start_with(&[
        "--subscription-limit",
        "0.01,2",
        "--source-ip-limit",
        "0.01,4",
    ])
    .await;
    let mut ws = server.client().await;
    let flooded = Subscription::new(&mut ws).await;
    let other = Subscription::new(&mut ws).await;
    let third = Subscription::new(&mut ws).await;
    let push = |endpoint: &str| {
        let endpoint = endpoint.to_owned();
        async move { http::post_push(&endpoint, &[("ttl", "60")], None).await }
    };
    for _ in 0..2 {
        push(&flooded.endpoint).await.assert_created();
    }
    let over = push(&flooded.endpoint).await;
    assert_limited(
        over.status,
        over.json["errno"].as_u64(),
        over.header("retry-after"),
        "the flooded subscription's 3rd unsigned push",
    );
    // Another subscription is not affected by that one's flood...
    for _ in 0..2 {
        push(&other.endpoint).await.assert_created();
    }
    // ...but the address has had its 4 (the refused push was stopped at its
    // subscription and cost the address nothing), so it is over its limit
    // whatever subscription it pushes to next.
    let over = push(&third.endpoint).await;
    assert_limited(
        over.status,
        over.json["errno"].as_u64(),
        over.header("retry-after"),
        "the address's 5th accepted unsigned push",
    );
    // A push signed with the key its subscription pins counts against its
    // sender alone.
    Subscription::with_vapid(&mut ws)
        .await
        .push_text("signed")
        .await;
    assert_eq!(refused(&server, "subscription").await, 1.0);
    assert_eq!(refused(&server, "source_ip").await, 1.0);
}

#[tokio::test]
async fn registrations_from_one_address_are_limited() {
    let server = Server::start_with(&["--registration-limit", "0.01,2"]).await;
    let base = format!("{}/v1/webpush/app/registration", server.endpoint_base());
    let register = || {
        request(
            Method::POST,
            &base,
            &[("content-type", "application/json")],
            Some(json!({}).to_string().into_bytes()),
        )
    };
    for _ in 0..2 {
        let created = register().await;
        assert_eq!(created.status, 200, "{}", created.text);
    }
    let over = register().await;
    assert_limited(
        over.status,
        over.json["errno"].as_u64(),
        over.header("retry-after"),
        "the 3rd registration",
    );
    assert_eq!(refused(&server, "registration").await, 1.0);
}

/// `POST /v1/webpush/app/registration` as the client at `client` behind
/// our proxy (127.0.0.1).
async fn register_from(server: &Server, client: &str) -> HttpReply {
    request(
        Method::POST,
        &format!("{}/v1/webpush/app/registration", server.endpoint_base()),
        &[
            ("content-type", "application/json"),
            ("x-forwarded-for", client),
        ],
        Some(json!({}).to_string().into_bytes()),
    )
    .await
}

/// An unsigned push to `endpoint` from the client at `client` behind our proxy.
async fn unsigned_push_from(endpoint: &str, client: &str) -> HttpReply {
    http::post_push(
        endpoint,
        &[("ttl", "60"), ("x-forwarded-for", client)],
        None,
    )
    .await
}

/// A push to `endpoint` signed by `key`, from 127.0.0.1.
async fn signed_push(server: &Server, endpoint: &str, key: &SigningKey) -> HttpReply {
    let authorization = key.authorization(&server.endpoint_base(), "mailto:ops@example.com");
    http::post_push(
        endpoint,
        &[("ttl", "60"), ("authorization", authorization.as_str())],
        None,
    )
    .await
}

fn assert_429(reply: &HttpReply, what: &str) {
    assert_limited(
        reply.status,
        reply.json["errno"].as_u64(),
        reply.header("retry-after"),
        what,
    );
}

/// One host holds a whole IPv6 /64: its addresses share one bucket for
/// `/v1` registrations and for unsigned pushes, as they do for new UAIDs.
#[tokio::test]
async fn an_ipv6_64_is_one_address_for_every_limit() {
    let server = Server::start_with(&[
        "--trusted-proxies",
        "127.0.0.1",
        "--registration-limit",
        "0.01,2",
        "--source-ip-limit",
        "0.01,2",
    ])
    .await;
    for client in ["2001:db8:1:2::1", "2001:db8:1:2::2"] {
        let created = register_from(&server, client).await;
        assert_eq!(created.status, 200, "{client}: {}", created.text);
    }
    let over = register_from(&server, "2001:db8:1:2:ffff::3").await;
    assert_429(&over, "a 3rd registration from the /64");
    let other = register_from(&server, "2001:db8:1:3::1").await;
    assert_eq!(other.status, 200, "another /64: {}", other.text);

    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    for client in ["2001:db8:5:6::a", "2001:db8:5:6::b"] {
        unsigned_push_from(&sub.endpoint, client)
            .await
            .assert_created();
    }
    let over = unsigned_push_from(&sub.endpoint, "2001:db8:5:6:ffff::c").await;
    assert_429(&over, "a 3rd unsigned push from the /64");
    unsigned_push_from(&sub.endpoint, "2001:db8:5:7::a")
        .await
        .assert_created();
    assert_eq!(refused(&server, "registration").await, 1.0);
    assert_eq!(refused(&server, "source_ip").await, 1.0);
}

/// A key proves who sent a push only where the subscription pins it: on a
/// v1 endpoint, a sender signing each push with a fresh key is limited as
/// an unsigned one is, per subscription and per source address, and a push
/// refused so costs no signature check; on a v2 endpoint another key than
/// the pinned one is refused without one.
#[tokio::test]
async fn fresh_vapid_keys_do_not_escape_the_limits() {
    let server = Server::start_with(&[
        "--subscription-limit",
        "0.01,2",
        "--source-ip-limit",
        "0.01,3",
    ])
    .await;
    let mut ws = server.client().await;
    let (first, second) = (
        Subscription::new(&mut ws).await,
        Subscription::new(&mut ws).await,
    );
    let fresh = |endpoint: &str| {
        let endpoint = endpoint.to_owned();
        let server = &server;
        async move { signed_push(server, &endpoint, &SigningKey::generate()).await }
    };
    for _ in 0..2 {
        fresh(&first.endpoint).await.assert_created();
    }
    assert_429(
        &fresh(&first.endpoint).await,
        "a 3rd push to one subscription, each by a fresh key",
    );
    // The address has had 2 of its 3 (the refused push cost it nothing).
    fresh(&second.endpoint).await.assert_created();
    assert_429(
        &fresh(&second.endpoint).await,
        "a 4th push from one address, each by a fresh key",
    );
    // The key a subscription pins is its sender's: not limited by address.
    let key = SigningKey::generate();
    let pinned = &pinned_endpoint(&mut ws, &key).await;
    for _ in 0..2 {
        signed_push(&server, pinned, &key).await.assert_created();
    }
    // Any other key there is refused, before its signature is checked.
    for _ in 0..2 {
        signed_push(&server, pinned, &SigningKey::generate())
            .await
            .assert_error(401, 109);
    }
    assert_eq!(refused(&server, "subscription").await, 1.0);
    assert_eq!(refused(&server, "source_ip").await, 1.0);
    // Checked: the 3 accepted fresh keys' and the pinned key's 2 (its
    // second may have come from the cache); none of the refused ones.
    let auth = http::get(&format!("{}/metrics", server.router_base())).await;
    let scrape = Scrape::parse(&auth.text);
    let checked = scrape.value("notification_auth", &[("outcome", "verified")])
        + scrape.value("notification_auth", &[("outcome", "cached")]);
    assert_eq!(checked, 5.0, "signature checks");
    let not_pinned = [("outcome", "failed"), ("check", "pinned")];
    assert_eq!(scrape.value("notification_auth", &not_pinned), 2.0);
}

/// A v2 subscription's key is public: anyone can name it beside a forged
/// signature, and each such push costs an ECDSA verification. Pushes whose
/// signature fails count against their source address, and an address out
/// of that budget is refused before any verification; another address's
/// sender is not slowed.
#[tokio::test]
async fn forged_signatures_for_a_pinned_key_are_limited_by_address() {
    let server = Server::start_with(&[
        "--trusted-proxies",
        "127.0.0.1",
        "--source-ip-limit",
        "0.01,2",
    ])
    .await;
    let mut ws = server.client().await;
    let key = SigningKey::generate();
    let pinned = &pinned_endpoint(&mut ws, &key).await;
    // Signed by another key, but naming the pinned one: only the signature
    // check can tell.
    let forger = SigningKey::generate();
    let forged = forger
        .authorization(&server.endpoint_base(), "mailto:ops@example.com")
        .replace(
            &autopush_crypto::b64(forger.public_key()),
            &autopush_crypto::b64(key.public_key()),
        );
    let push = |client: &'static str, authorization: String| async move {
        http::post_push(
            pinned,
            &[
                ("ttl", "60"),
                ("x-forwarded-for", client),
                ("authorization", authorization.as_str()),
            ],
            None,
        )
        .await
    };
    for _ in 0..2 {
        push("192.0.2.1", forged.clone())
            .await
            .assert_error(401, 109);
    }
    assert_429(
        &push("192.0.2.1", forged.clone()).await,
        "a 3rd forged signature from one address",
    );
    // The real sender, elsewhere, is not slowed.
    let genuine = key.authorization(&server.endpoint_base(), "mailto:ops@example.com");
    push("192.0.2.2", genuine).await.assert_created();
    // Two forged signatures were checked, the refused one was not.
    let scrape = Scrape::parse(
        &http::get(&format!("{}/metrics", server.router_base()))
            .await
            .text,
    );
    let forged = [("outcome", "failed"), ("check", "signature")];
    assert_eq!(
        scrape.value("notification_auth", &forged),
        2.0,
        "signatures checked and failed"
    );
    assert_eq!(refused(&server, "forged").await, 1.0);
}

/// On a dual-stack listener (`--host [::]`) a proxy that connects over
/// IPv4 is seen as `::ffff:127.0.0.1`: still the proxy `--trusted-proxies
/// 127.0.0.1` names, so the clients it forwards are told apart.
#[tokio::test]
async fn a_proxy_seen_ipv4_mapped_is_trusted() {
    let server = Server::start_with(&[
        "--host",
        "[::]",
        "--trusted-proxies",
        "127.0.0.1",
        "--registration-limit",
        "0.01,1",
    ])
    .await;
    let created = register_from(&server, "192.0.2.1").await;
    assert_eq!(created.status, 200, "{}", created.text);
    assert_429(
        &register_from(&server, "192.0.2.1").await,
        "the same client's 2nd registration",
    );
    let other = register_from(&server, "192.0.2.2").await;
    assert_eq!(other.status, 200, "another client: {}", other.text);
}

/// Register a new channel pinned to `key` (a v2 endpoint); its endpoint.
async fn pinned_endpoint(ws: &mut WsClient, key: &SigningKey) -> String {
    let reply = ws
        .register(
            &new_channel_id(),
            Some(&autopush_crypto::b64(key.public_key())),
        )
        .await;
    reply["pushEndpoint"]
        .as_str()
        .expect("pushEndpoint")
        .to_string()
}
