//! Rate limits per sender, not per address: a sender over its limit gets
//! 429 with Retry-After (errno 201) while everyone else keeps getting 201.
//! The limits are set tiny here (a token every 100 s) so that what a test
//! sends is all the bucket ever gets. Where a test needs senders at other
//! addresses, the server trusts 127.0.0.1 as a proxy and each request names
//! its client in `X-Forwarded-For`.

use autopush_crypto::vapid::VapidKey as SigningKey;
use autopush_tests::http::{self, HttpReply, RateLimit, request};
use autopush_tests::prometheus::Scrape;
use autopush_tests::*;
use reqwest::Method;
use serde_json::json;

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
    assert_eq!(
        over.assert_rate_limited("the noisy sender's 4th push")
            .policy,
        "sender"
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
    assert_429(
        &over,
        "the flooded subscription's 3rd unsigned push",
        "subscription",
    );
    // Another subscription is not affected by that one's flood...
    for _ in 0..2 {
        push(&other.endpoint).await.assert_created();
    }
    // ...but the address has had its 4 (the refused push was stopped at its
    // subscription and cost the address nothing), so it is over its limit
    // whatever subscription it pushes to next.
    let over = push(&third.endpoint).await;
    assert_429(
        &over,
        "the address's 5th accepted unsigned push",
        "source_ip",
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
    assert_429(&over, "the 3rd registration", "registration");
    // A burst of 2, refilled at one every 100 s.
    let limit = RateLimit::read(&over.headers, "the 3rd registration");
    assert_eq!((limit.quota, limit.window), (2, Some(200)), "{limit:?}");
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

/// A 429 as the README promises it: errno 201, a Retry-After to honour,
/// and the RateLimit headers naming `policy`, the limit that refused.
fn assert_429(reply: &HttpReply, what: &str, policy: &str) {
    let limit = reply.assert_rate_limited(what);
    assert_eq!(limit.policy, policy, "{what}: {limit:?}");
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
    assert_429(&over, "a 3rd registration from the /64", "registration");
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
    assert_429(&over, "a 3rd unsigned push from the /64", "source_ip");
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
        "subscription",
    );
    // The address has had 2 of its 3 (the refused push cost it nothing).
    fresh(&second.endpoint).await.assert_created();
    assert_429(
        &fresh(&second.endpoint).await,
        "a 4th push from one address, each by a fresh key",
        "source_ip",
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
        "forged",
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
        "registration",
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

/// `count` v1 subscriptions (pinning no key) of a user agent that has gone
/// away: their pushes are stored, so each answers 201 until a limit says
/// otherwise.
async fn v1_endpoints(server: &Server, count: usize) -> Vec<String> {
    let mut ws = server.client().await;
    let mut endpoints = Vec::with_capacity(count);
    for _ in 0..count {
        let reply = ws.register(&new_channel_id(), None).await;
        let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");
        endpoints.push(endpoint.to_owned());
    }
    ws.close().await;
    endpoints
}

/// A push to `endpoint` carrying `authorization` as it is (one token
/// reused, as senders do), from 127.0.0.1.
async fn push_with(endpoint: &str, authorization: &str) -> HttpReply {
    http::post_push(
        endpoint,
        &[("ttl", "60"), ("authorization", authorization)],
        None,
    )
    .await
}

fn auth_count(scrape: &Scrape, outcome: &str) -> f64 {
    scrape.value("notification_auth", &[("outcome", outcome)])
}

/// A sender reusing one verified token is the sender, whatever address it
/// shares: its pushes to v1 subscriptions count against its key, not its
/// address, and cost no signature check. Keys that cost a verification
/// still count against the address, so fresh keys from there are refused
/// once its budget is spent, before their signature is checked.
#[tokio::test]
async fn a_verified_token_is_limited_by_its_key_not_its_address() {
    let server = Server::start_with(&["--source-ip-limit", "0.01,5"]).await;
    let endpoints = v1_endpoints(&server, 205).await;
    let key = SigningKey::generate();
    let authorization = key.authorization(&server.endpoint_base(), "mailto:ops@example.com");
    for (n, endpoint) in endpoints[..200].iter().enumerate() {
        let reply = push_with(endpoint, &authorization).await;
        assert_eq!(
            reply.status,
            201,
            "push {} of 200 by one key and token from one address: {}",
            n + 1,
            reply.text
        );
    }
    // The first cost a verification, charged to the address: 4 of its 5
    // are left for fresh keys.
    for (n, endpoint) in endpoints[200..204].iter().enumerate() {
        let fresh = SigningKey::generate();
        let reply = signed_push(&server, endpoint, &fresh).await;
        assert_eq!(reply.status, 201, "fresh key {}: {}", n + 1, reply.text);
    }
    assert_429(
        &signed_push(&server, &endpoints[204], &SigningKey::generate()).await,
        "a 5th fresh key from the address",
        "source_ip",
    );
    // The token that is known still passes.
    push_with(&endpoints[204], &authorization)
        .await
        .assert_created();
    let scrape = Scrape::parse(
        &http::get(&format!("{}/metrics", server.router_base()))
            .await
            .text,
    );
    assert_eq!(auth_count(&scrape, "verified"), 5.0, "signatures checked");
    assert_eq!(auth_count(&scrape, "cached"), 200.0, "tokens known");
    assert_eq!(refused(&server, "source_ip").await, 1.0);
}

/// `--sender-limits` gives a named key its own rate instead of
/// `--sender-limit`: here more than the others get, and its pushes beyond
/// its burst are refused with 429 while another key's are not.
#[tokio::test]
async fn a_named_sender_has_its_own_rate() {
    let named = SigningKey::generate();
    let entry = format!("{}=0.01,5", autopush_crypto::b64(named.public_key()));
    let other_named = format!(
        "{}=0",
        autopush_crypto::b64(SigningKey::generate().public_key())
    );
    let limits = format!("{entry} {other_named}");
    let server =
        Server::start_with(&["--sender-limit", "0.01,2", "--sender-limits", &limits]).await;
    let endpoints = v1_endpoints(&server, 12).await;
    let authorization = named.authorization(&server.endpoint_base(), "mailto:ops@example.com");
    for (n, endpoint) in endpoints[..5].iter().enumerate() {
        let reply = push_with(endpoint, &authorization).await;
        assert_eq!(
            reply.status,
            201,
            "the named sender's push {}: {}",
            n + 1,
            reply.text
        );
    }
    assert_429(
        &push_with(&endpoints[5], &authorization).await,
        "the named sender's 6th push",
        "sender",
    );
    // Another key has --sender-limit's 2, refused or not the named one.
    let other = SigningKey::generate();
    let other_authorization =
        other.authorization(&server.endpoint_base(), "mailto:ops@example.com");
    for endpoint in &endpoints[6..8] {
        push_with(endpoint, &other_authorization)
            .await
            .assert_created();
    }
    assert_429(
        &push_with(&endpoints[8], &other_authorization).await,
        "another key's 3rd push",
        "sender",
    );
    assert_eq!(refused(&server, "sender").await, 2.0);
}

/// A malformed `--sender-limits` entry stops start-up, naming the setting
/// and the entry.
#[tokio::test]
async fn a_malformed_sender_limit_is_named_at_start_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().display().to_string();
    let key = autopush_crypto::b64(SigningKey::generate().public_key());
    let good = format!("{key}=1,10");
    for entry in [
        "not-a-key=1,10".to_owned(),
        format!("{key}=fast"),
        key.clone(),
        format!("{key}=1,1"),
    ] {
        let limits = format!("{good} {entry}");
        let ports = server::port_flags();
        let ports: Vec<&str> = ports.iter().map(String::as_str).collect();
        let args = [
            &["all", "--db", &db, "--sender-limits", &limits][..],
            &ports,
        ]
        .concat();
        let out = server::run_autopush(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{entry:?} accepted: {stderr}");
        assert!(stderr.contains("--sender-limits"), "{entry:?}: {stderr}");
        assert!(stderr.contains(entry.as_str()), "{entry:?}: {stderr}");
    }
}

/// The binding limit's name, its policy's q and w, and its r and t.
fn rate_limit(reply: &HttpReply, what: &str) -> (String, [u64; 4]) {
    let limit = RateLimit::read(&reply.headers, what);
    let window = limit
        .window
        .unwrap_or_else(|| panic!("{what}: a bucket's policy without its window: {limit:?}"));
    (
        limit.policy,
        [limit.quota, window, limit.remaining, limit.reset],
    )
}

/// Each 201 and 429 of a push names, in the IETF RateLimit headers, the
/// limit it stands closest to: the fewest requests left, or the one that
/// refused. A bucket's policy is its burst over the seconds it takes to
/// refill; what is left counts down with each push, and on a 429 `t` is
/// the Retry-After.
#[tokio::test]
async fn each_answer_names_the_limit_that_binds() {
    let server = Server::start_with(&[
        "--sender-limit",
        "0.01,3",
        "--subscription-limit",
        "0.01,10",
        "--source-ip-limit",
        "0.01,2",
    ])
    .await;
    let endpoints = v1_endpoints(&server, 1).await;
    let unsigned = |n: usize| {
        let endpoint = endpoints[0].clone();
        async move {
            let reply = http::post_push(&endpoint, &[("ttl", "60")], None).await;
            (reply, format!("unsigned push {n}"))
        }
    };
    // The address has 2 to the subscription's 10: it binds.
    for (n, left) in [(1, 1), (2, 0)] {
        let (reply, what) = unsigned(n).await;
        reply.assert_created();
        let (name, [q, w, r, t]) = rate_limit(&reply, &what);
        assert_eq!(
            (name.as_str(), q, w, r),
            ("source_ip", 2, 200, left),
            "{what}"
        );
        assert!(t <= 100, "{what}: t={t}");
    }
    let (over, what) = unsigned(3).await;
    assert_429(&over, &what, "source_ip");
    let (name, [q, w, r, _]) = rate_limit(&over, &what);
    assert_eq!((name.as_str(), q, w, r), ("source_ip", 2, 200, 0), "{what}");

    // A pinned key counts against its sender alone.
    let mut ws = server.client().await;
    let key = SigningKey::generate();
    let pinned = pinned_endpoint(&mut ws, &key).await;
    for left in [2, 1, 0] {
        let reply = signed_push(&server, &pinned, &key).await;
        let what = format!("a signed push leaving {left}");
        reply.assert_created();
        let (name, [q, w, r, _]) = rate_limit(&reply, &what);
        assert_eq!((name.as_str(), q, w, r), ("sender", 3, 300, left), "{what}");
    }
    let over = signed_push(&server, &pinned, &key).await;
    assert_429(&over, "the sender's 4th push", "sender");
    let (name, [q, w, r, _]) = rate_limit(&over, "the sender's 4th push");
    assert_eq!((name.as_str(), q, w, r), ("sender", 3, 300, 0));
}
