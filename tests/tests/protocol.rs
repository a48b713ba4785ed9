//! The websocket protocol: hello, register, unregister, ping, errors.

use std::time::Duration;

use autopush_tests::*;
use serde_json::{Value, json};

/// The server answers a bad message with a JSON error (status 4xx and a
/// reason) and then closes the connection.
async fn expect_error_then_close(ws: &mut WsClient) -> Value {
    let closed = ws.expect_closed().await;
    let err = closed
        .messages
        .first()
        .unwrap_or_else(|| panic!("closed without an error message: {closed:?}"))
        .clone();
    let status = err["status"].as_u64().unwrap_or_default();
    assert!((400..500).contains(&status), "error status 4xx: {err}");
    assert!(err["reason"].is_string(), "error without reason: {err}");
    err
}

#[tokio::test]
async fn hello_assigns_a_new_uaid() {
    let server = Server::start().await;
    let mut ws = WsClient::connect(&server.ws_url()).await;
    assert_eq!(ws.subprotocol.as_deref(), Some("push-notification"));
    let reply = ws.hello(None).await;
    assert_eq!(reply["messageType"], "hello", "{reply}");
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(reply["use_webpush"], true, "{reply}");
    assert_eq!(reply["broadcasts"], json!({}), "{reply}");
    let uaid = reply["uaid"].as_str().expect("uaid");
    assert!(is_uaid(uaid), "uaid is 32 lower-case hex: {uaid}");

    let other = WsClient::connect_hello(&server.ws_url(), None).await;
    assert_ne!(other.uaid(), uaid, "two new user agents share a uaid");
    other.close().await;
}

#[tokio::test]
async fn subprotocol_is_optional() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_without_subprotocol(&server.ws_url()).await;
    assert_eq!(ws.subprotocol, None);
    let reply = ws.hello(None).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert!(is_uaid(ws.uaid()));
}

#[tokio::test]
async fn hello_with_a_known_uaid_keeps_it() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    let uaid = ws.uaid().to_string();
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");
    ws.close().await;

    let mut again = WsClient::connect(&server.ws_url()).await;
    let reply = again.hello(Some(&uaid)).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(reply["uaid"], uaid.as_str(), "{reply}");
}

#[tokio::test]
async fn hello_with_an_unknown_or_malformed_uaid_gets_a_new_one() {
    let server = Server::start().await;
    let unknown = random_uaid();
    let unknown_dashed = uuid::Uuid::new_v4().hyphenated().to_string();
    for given in [
        unknown.as_str(),
        unknown_dashed.as_str(),
        "not-a-uaid",
        "ZZZZ",
    ] {
        let mut ws = WsClient::connect(&server.ws_url()).await;
        let reply = ws.hello(Some(given)).await;
        assert_eq!(reply["status"], 200, "hello {given:?}: {reply}");
        let uaid = reply["uaid"].as_str().expect("uaid");
        assert!(is_uaid(uaid), "hello {given:?}: {reply}");
        assert_ne!(
            uaid.replace('-', ""),
            given.replace('-', ""),
            "unknown uaid {given:?} accepted"
        );
        ws.close().await;
    }
}

#[tokio::test]
async fn register_returns_an_endpoint() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    let chid = new_channel_id();
    let reply = ws.register(&chid, None).await;
    assert_eq!(reply["messageType"], "register", "{reply}");
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(reply["channelID"], chid.as_str(), "{reply}");
    let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");
    let prefix = format!("{}/wpush/v1/", server.endpoint_base());
    assert!(
        endpoint.starts_with(&prefix) && endpoint.len() > prefix.len(),
        "endpoint {endpoint} under {prefix}"
    );

    // A second channel gets its own endpoint.
    let reply2 = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply2["status"], 200, "{reply2}");
    assert_ne!(reply2["pushEndpoint"], reply["pushEndpoint"]);
}

#[tokio::test]
async fn register_with_a_vapid_key_returns_a_v2_endpoint() {
    let server = Server::start().await;
    let key = VapidKey::generate().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    let chid = new_channel_id();
    let reply = ws.register(&chid, Some(&key.public_key)).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(reply["channelID"], chid.as_str(), "{reply}");
    let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");
    let prefix = format!("{}/wpush/v2/", server.endpoint_base());
    assert!(
        endpoint.starts_with(&prefix),
        "endpoint {endpoint} under {prefix}"
    );
}

#[tokio::test]
async fn register_rejects_bad_channel_ids_and_stays_open() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    let good = new_channel_id();
    for bad in [
        good.to_ascii_uppercase(),
        good.replace('-', ""),
        "not-a-uuid".to_string(),
        String::new(),
    ] {
        let reply = ws.register(&bad, None).await;
        assert_eq!(reply["messageType"], "register", "{bad:?}: {reply}");
        assert_eq!(reply["status"], 401, "{bad:?}: {reply}");
        assert!(reply["reason"].is_string(), "{bad:?}: {reply}");
    }
    let reply = ws.register(&good, None).await;
    assert_eq!(reply["status"], 200, "connection still usable: {reply}");
}

#[tokio::test]
async fn unregister_accepts_codes_200_to_202() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    for code in [200, 201, 202] {
        let chid = new_channel_id();
        assert_eq!(ws.register(&chid, None).await["status"], 200);
        let reply = ws.unregister(&chid, code).await;
        assert_eq!(reply["messageType"], "unregister", "code {code}: {reply}");
        assert_eq!(reply["channelID"], chid.as_str(), "code {code}: {reply}");
        assert_eq!(reply["status"], 200, "code {code}: {reply}");
    }
}

#[tokio::test]
async fn ping_gets_an_empty_object() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    ws.ping().await;
    assert_eq!(ws.recv().await, json!({}));
}

/// Ping, wait for the pong, and sleep `gap` before the next, `n` times.
async fn ping_every(ws: &mut WsClient, gap: Duration, n: usize) {
    for i in 0..n {
        ws.ping().await;
        let pong = ws.recv().await;
        assert_eq!(pong, json!({}), "ping {i} of {n}");
        tokio::time::sleep(gap).await;
    }
}

#[tokio::test]
async fn a_client_pinging_just_slower_than_the_minimum_stays_connected() {
    // Pings spaced just above --min-ping-interval (each waits for its pong
    // and then the gap, so the server never sees two closer than the gap),
    // many more of them than any burst allowance: every one is answered.
    let server = Server::start_with(&["--min-ping-interval", "0.2"]).await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    ping_every(&mut ws, Duration::from_millis(250), 40).await;
    // Still connected and served.
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");
}

#[tokio::test]
async fn a_few_pings_too_early_are_answered_and_the_client_stays() {
    // Default --min-ping-interval: three pings in a row are too early, but
    // a client that does this now and then (a network change, a resume) is
    // answered, not closed.
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    for _ in 0..3 {
        ws.ping().await;
        assert_eq!(ws.recv().await, json!({}));
    }
    let reply = ws.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");
}

#[tokio::test]
async fn a_client_pinging_in_a_tight_loop_is_closed_with_4774() {
    let server = Server::start_with(&["--min-ping-interval", "0.5"]).await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    // Each ping right after the last pong: however slowly the server
    // answers, 200 of them cannot have been 0.5 s apart. (One at a time,
    // so no ping is left unread when the server closes.)
    let mut pongs = 0;
    let closed = loop {
        ws.ping().await;
        match ws.recv_or_closed().await {
            Ok(pong) if pong == json!({}) => {
                pongs += 1;
                assert!(pongs < 200, "200 pings in a tight loop, never closed");
            }
            // The error message that comes before the close.
            Ok(refusal) => {
                assert!(refusal["reason"].is_string(), "{refusal}");
                break ws.expect_closed().await;
            }
            Err(closed) => break closed,
        }
    };
    assert_eq!(closed.code, Some(4774), "{closed:?}");
    assert!(pongs > 0, "the first ping was not answered: {closed:?}");
}

#[tokio::test]
async fn pings_spaced_by_the_minimum_interval_are_answered() {
    let server = Server::start_with(&["--min-ping-interval", "1"]).await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    ws.ping().await;
    assert_eq!(ws.recv().await, json!({}));
    // Longer than the 1 s minimum: waiting more is always allowed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    ws.ping().await;
    assert_eq!(ws.recv().await, json!({}));
}

/// Say hello as a new user agent and expect the quota's refusal: status
/// 429 in the hello reply, then close 1013 (try again later).
async fn expect_new_uaid_refused(ws: &mut WsClient, offered: Option<&str>) {
    let reply = ws.hello(offered).await;
    assert_eq!(reply["messageType"], "hello", "{reply}");
    assert_eq!(reply["status"], 429, "{reply}");
    assert!(reply["reason"].is_string(), "{reply}");
    assert!(reply.get("uaid").is_none(), "{reply}");
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1013), "{closed:?}");
}

#[tokio::test]
async fn new_uaids_at_hello_are_limited_per_address() {
    // A burst of 3, then one new UAID per 100 s: the 4th is over the quota
    // however slowly this machine runs the test.
    let server = Server::start_with(&["--new-uaid-limit", "0.01,3"]).await;
    let first = WsClient::connect_hello(&server.ws_url(), None).await;
    let uaid = first.uaid().to_string();
    first.close().await;
    for _ in 0..2 {
        WsClient::connect_hello(&server.ws_url(), None)
            .await
            .close()
            .await;
    }

    let mut fourth = WsClient::connect(&server.ws_url()).await;
    expect_new_uaid_refused(&mut fourth, None).await;
    // An unknown UAID would be replaced by a new one: refused too.
    let mut unknown = WsClient::connect(&server.ws_url()).await;
    expect_new_uaid_refused(&mut unknown, Some("0123456789abcdef0123456789abcdef")).await;

    // A user agent the service knows reconnects from the same address.
    let mut again = WsClient::connect_hello(&server.ws_url(), Some(&uaid)).await;
    assert_eq!(again.uaid(), uaid);
    let reply = again.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "{reply}");

    let metrics = autopush_tests::http::get(&format!("{}/metrics", server.router_base())).await;
    let scrape = autopush_tests::prometheus::Scrape::parse(&metrics.text);
    assert_eq!(
        scrape.value("rate_limit_refused", &[("limit", "new_uaid")]),
        2.0,
        "{}",
        metrics.text
    );
}

#[tokio::test]
async fn the_new_uaid_quota_counts_the_client_a_trusted_proxy_names() {
    let server = Server::start_with(&[
        "--new-uaid-limit",
        "0.01,1",
        "--trusted-proxies",
        "127.0.0.1",
    ])
    .await;
    let from = |ip: &'static str| [("x-forwarded-for", ip)];
    let mut a = WsClient::connect_with_headers(&server.ws_url(), &from("192.0.2.1")).await;
    assert_eq!(a.hello(None).await["status"], 200);
    let mut a_again = WsClient::connect_with_headers(&server.ws_url(), &from("192.0.2.1")).await;
    expect_new_uaid_refused(&mut a_again, None).await;
    // Another client behind the same proxy has its own quota.
    let mut b = WsClient::connect_with_headers(&server.ws_url(), &from("192.0.2.2")).await;
    assert_eq!(b.hello(None).await["status"], 200);
}

#[tokio::test]
async fn invalid_json_gets_an_error_and_a_close() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    ws.send_text("{this is not json").await;
    expect_error_then_close(&mut ws).await;
}

#[tokio::test]
async fn unknown_message_type_gets_an_error_and_a_close() {
    let server = Server::start().await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    ws.send_json(json!({"messageType": "frobnicate", "channelID": new_channel_id()}))
        .await;
    expect_error_then_close(&mut ws).await;
}

#[tokio::test]
async fn register_before_hello_gets_an_error_and_a_close() {
    let server = Server::start().await;
    let mut ws = WsClient::connect(&server.ws_url()).await;
    ws.send_json(json!({"messageType": "register", "channelID": new_channel_id()}))
        .await;
    expect_error_then_close(&mut ws).await;
}

#[tokio::test]
async fn no_hello_within_the_timeout_closes_the_connection() {
    let server = Server::start_with(&["--hello-timeout", "1"]).await;
    let mut ws = WsClient::connect(&server.ws_url()).await;
    ws.expect_closed().await;
}

#[tokio::test]
async fn a_second_connection_with_the_same_uaid_replaces_the_first() {
    let server = Server::start().await;
    let mut first = WsClient::connect_hello(&server.ws_url(), None).await;
    let uaid = first.uaid().to_string();
    assert_eq!(first.register(&new_channel_id(), None).await["status"], 200);

    let mut second = WsClient::connect(&server.ws_url()).await;
    let reply = second.hello(Some(&uaid)).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert_eq!(reply["uaid"], uaid.as_str(), "{reply}");

    first.expect_closed().await;
    let reply = second.register(&new_channel_id(), None).await;
    assert_eq!(reply["status"], 200, "the new connection works: {reply}");
}

#[tokio::test]
async fn a_client_that_never_answers_the_server_ping_is_closed() {
    let server =
        Server::start_with(&["--auto-ping-interval", "1", "--auto-ping-timeout", "1"]).await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    // Not reading means the client's websocket never answers the server's
    // ping with a pong, as with a client whose network silently died.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1001), "{closed:?}");
}

#[tokio::test]
async fn a_client_that_answers_server_pings_stays_connected() {
    let server =
        Server::start_with(&["--auto-ping-interval", "1", "--auto-ping-timeout", "1"]).await;
    let mut ws = WsClient::connect_hello(&server.ws_url(), None).await;
    // Reading answers pings; several ping rounds pass without a close.
    assert!(
        ws.try_recv_for(std::time::Duration::from_secs(4))
            .await
            .is_none()
    );
    assert_eq!(ws.register(&new_channel_id(), None).await["status"], 200);
}

#[tokio::test]
async fn a_full_node_refuses_new_websockets_with_503_until_a_client_leaves() {
    let server = Server::start_with(&["--max-connections", "2"]).await;
    let first = WsClient::connect_hello(&server.ws_url(), None).await;
    let _second = WsClient::connect_hello(&server.ws_url(), None).await;

    match WsClient::try_connect(&server.ws_url(), Some("push-notification")).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 503);
            assert!(response.headers().contains_key("retry-after"));
        }
        Err(other) => panic!("expected an HTTP 503, got {other}"),
        Ok(_) => panic!("a third websocket was accepted with --max-connections 2"),
    }

    // A client leaving frees its place (once its session has ended).
    first.close().await;
    let mut attempts = 0;
    let mut third = loop {
        match WsClient::try_connect(&server.ws_url(), Some("push-notification")).await {
            Ok(ws) => break ws,
            Err(_) if attempts < 100 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no place freed after a client left: {e}"),
        }
    };
    assert_eq!(third.hello(None).await["status"], 200);
}
