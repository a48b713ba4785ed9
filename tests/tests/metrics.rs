//! `GET /metrics`: after a known sequence of pushes, deliveries, acks,
//! nacks and refusals, the scraped counters have exactly the expected
//! values (parsed from the Prometheus text, not grepped).

use autopush_tests::http::{get, post_push};
use autopush_tests::prometheus::Scrape;
use autopush_tests::server::free_ports;
use autopush_tests::*;

async fn scrape(base: &str) -> Scrape {
    let reply = get(&format!("{base}/metrics")).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(
        reply
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/plain")),
        "{:?}",
        reply.headers
    );
    Scrape::parse(&reply.text)
}

/// Scrape until `done` holds: the server counts a closed websocket after
/// the client has seen the close, so the test waits for the count itself.
async fn scrape_until(base: &str, done: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    loop {
        let scraped = scrape(base).await;
        if done(&scraped) {
            return scraped;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "metrics never reached the expected state: {scraped:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn closed(scrape: &Scrape) -> f64 {
    scrape.value("ua_connection_closed", &[("code", "1000")])
}

#[tokio::test]
async fn counters_follow_pushes_acks_nacks_and_refusals() {
    let [metrics_port] = free_ports::<1>();
    let server = Server::start_with(&["--metrics-port", &metrics_port.to_string()]).await;
    let metrics_base = format!("http://127.0.0.1:{metrics_port}");

    // A client subscribes; a push to it is delivered directly and acked.
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::with_vapid(&mut ws).await;
    sub.push_text("direct").await;
    let (notification, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "direct");
    ws.ack_notification(&notification).await;
    ws.close().await;
    scrape_until(&metrics_base, |s| closed(s) == 1.0).await;

    // Offline: one push is stored, one with TTL 0 is dropped.
    sub.push_text("stored").await;
    let now_or_never = SendOptions::text("now or never")
        .ttl(0)
        .vapid(sub.vapid_key());
    sub.send(&now_or_never).await.assert_created();

    // Refusals: a forged VAPID key (401/109) and an unknown endpoint (404/102).
    let forged = post_push(
        &sub.endpoint,
        &[
            ("ttl", "60"),
            ("authorization", "vapid t=a.b.c,k=not-a-key!"),
        ],
        None,
    )
    .await;
    forged.assert_error(401, 109);
    let unknown = post_push(
        &format!("{}/wpush/v1/garbage", server.endpoint_base()),
        &[("ttl", "60")],
        None,
    )
    .await;
    unknown.assert_error(404, 102);

    // Back online: the stored message is nacked (kept), then at the next
    // connection sent again and acked.
    let mut ws = server.reconnect(&uaid).await;
    let (notification, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "stored");
    ws.nack(
        sub.channel_id.as_str(),
        notification["version"].as_str().unwrap(),
        301,
    )
    .await;
    ws.close().await;
    let mut ws = server.reconnect(&uaid).await;
    let (notification, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "stored");
    ws.ack_notification(&notification).await;
    ws.close().await;

    let s = scrape_until(&metrics_base, |s| closed(s) == 3.0).await;
    let pushes = |labels: &[(&str, &str)]| s.value("notification_received", labels);
    assert_eq!(
        pushes(&[("router_type", "webpush"), ("status", "201")]),
        3.0
    );
    assert_eq!(
        pushes(&[
            ("router_type", "unknown"),
            ("status", "401"),
            ("errno", "109")
        ]),
        1.0
    );
    assert_eq!(
        pushes(&[
            ("router_type", "unknown"),
            ("status", "404"),
            ("errno", "102")
        ]),
        1.0
    );
    assert_eq!(s.sum("notification_received"), 5.0);

    let delivered = |outcome| {
        s.value(
            "notification_delivery",
            &[("router_type", "webpush"), ("outcome", outcome)],
        )
    };
    assert_eq!(
        (
            delivered("direct"),
            delivered("stored"),
            delivered("dropped")
        ),
        (1.0, 1.0, 1.0)
    );
    assert_eq!(s.sum("notification_message_retrieved"), 2.0);
    assert_eq!(s.value("ua_command_ack", &[("source", "direct")]), 1.0);
    assert_eq!(s.value("ua_command_ack", &[("source", "stored")]), 1.0);
    assert_eq!(s.sum("ua_command_ack"), 2.0);
    assert_eq!(s.sum("ua_command_nack"), 1.0);

    assert_eq!(s.value("ua_command_hello", &[("outcome", "new")]), 1.0);
    assert_eq!(s.value("ua_command_hello", &[("outcome", "existing")]), 2.0);
    assert_eq!(s.sum("ua_command_hello"), 3.0);
    assert_eq!(s.sum("ua_connection_opened"), 3.0);
    assert_eq!(s.sum("ua_connection_closed"), 3.0);
    assert_eq!(s.get("ua_connection_open", &[]), Some(0.0));

    // pywebpush signs a new token per push: each one verified, none cached.
    assert_eq!(
        s.value("notification_auth", &[("outcome", "verified")]),
        3.0
    );
    assert_eq!(
        s.value(
            "notification_auth",
            &[("outcome", "failed"), ("check", "key")]
        ),
        1.0
    );
    assert_eq!(s.sum("notification_auth"), 4.0);

    // Every storage call is timed; none failed; no bridge was called. Each
    // push that reached storage read its user and channel in one call; the
    // two reconnections read their user.
    let timed = |op| s.value("storage_time_count", &[("backend", "embedded"), ("op", op)]);
    assert_eq!(timed("get_user_and_channel"), 3.0);
    let get_user = timed("get_user");
    assert!(get_user >= 2.0, "get_user timed {get_user} times");
    assert_eq!(s.sum("storage_error"), 0.0);
    assert_eq!(s.sum("notification_bridge_request"), 0.0);

    // No UAID, token or key in any label.
    let token = sub.endpoint.rsplit('/').next().unwrap_or_default();
    let key = sub.vapid_key().public_key.as_str();
    for value in s.label_values() {
        assert!(
            ![uaid.as_str(), token, key]
                .iter()
                .any(|s| value.contains(s)),
            "label value {value:?} names a user, endpoint or key"
        );
    }

    // The router API port serves the same metrics without a signature;
    // everything else there still needs one.
    let on_router = scrape(&server.router_base()).await;
    assert_eq!(on_router.sum("ua_command_hello"), 3.0);
    let unsigned = get(&format!("{}/user/{uaid}", server.router_base())).await;
    unsigned.assert_error(401, 109);
}

/// A client still over `--msg-limit` at its second hello starts over: the
/// hello is counted with `outcome="reset"`, and the first two as
/// `new` and `existing`.
#[tokio::test]
async fn a_reset_over_the_message_limit_is_its_own_hello_outcome() {
    let server = Server::start_with(&["--msg-limit", "1"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    for i in 0..3 {
        sub.push_text(&format!("message {i}")).await;
    }
    // Over the limit: the first message only; the UAID is kept this time.
    let mut ws = server.reconnect(&uaid).await;
    let (notification, _) = sub.receive(&mut ws).await;
    ws.ack_notification(&notification).await;
    ws.close().await;
    // Still over: a new UAID.
    let mut ws = WsClient::connect(&server.ws_url()).await;
    let reply = ws.hello(Some(&uaid)).await;
    assert_ne!(reply["uaid"], uaid.as_str(), "{reply}");
    ws.close().await;

    let s = scrape_until(&server.router_base(), |s| closed(s) == 3.0).await;
    for (outcome, count) in [("new", 1.0), ("existing", 1.0), ("reset", 1.0)] {
        assert_eq!(
            s.value("ua_command_hello", &[("outcome", outcome)]),
            count,
            "{outcome}"
        );
    }
}

/// With `--statsd-host`, the same metrics go out as statsd datagrams named
/// `LABEL.NAME` with their labels as tags, and never name a user.
#[tokio::test]
async fn statsd_datagrams_carry_the_same_metrics() {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let statsd = socket.local_addr().unwrap().to_string();
    let server = Server::start_with(&["--statsd-host", &statsd, "--statsd-label", "push"]).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::with_vapid(&mut ws).await;
    let token = sub
        .endpoint
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();

    // Keep the service busy until every expected name has been seen.
    let wanted = [
        "push.ua.command.hello",
        "push.ua.command.ack",
        "push.notification.received",
        "push.notification.delivery",
        "push.storage.time",
    ];
    let mut lines: Vec<String> = Vec::new();
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    let mut buf = vec![0u8; 65_536];
    while !wanted
        .iter()
        .all(|name| lines.iter().any(|l| l.starts_with(&format!("{name}:"))))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every metric arrived: {lines:?}"
        );
        sub.push_text("counted").await;
        let (notification, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&notification).await;
        while let Ok(Ok(n)) =
            tokio::time::timeout(std::time::Duration::from_millis(50), socket.recv(&mut buf)).await
        {
            let datagram = String::from_utf8_lossy(&buf[..n]).into_owned();
            lines.extend(datagram.lines().map(str::to_owned));
        }
    }
    let received = lines
        .iter()
        .find(|l| l.starts_with("push.notification.received:"))
        .unwrap();
    // name:value|c|#tag:value,...
    let (_, tags) = received.split_once("|#").expect("tags");
    let tags: Vec<_> = tags.split(',').collect();
    assert!(tags.contains(&"router_type:webpush"), "{received}");
    assert!(tags.contains(&"status:201"), "{received}");
    assert!(received.contains(":1|c"), "{received}");
    for line in &lines {
        assert!(
            !line.contains(&uaid) && !line.contains(&token),
            "{line} names a user or endpoint"
        );
    }
}

/// Read statsd lines from `socket` until one starts with `name:`, for at
/// most `within`; every line read so far is returned either way.
async fn statsd_lines_until(
    socket: &tokio::net::UdpSocket,
    name: &str,
    within: std::time::Duration,
) -> (bool, Vec<String>) {
    let mut lines: Vec<String> = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = vec![0u8; 65_536];
    while !lines.iter().any(|l| l.starts_with(&format!("{name}:"))) {
        match tokio::time::timeout_at(deadline, socket.recv(&mut buf)).await {
            Ok(Ok(n)) => {
                let datagram = String::from_utf8_lossy(&buf[..n]).into_owned();
                lines.extend(datagram.lines().map(str::to_owned));
            }
            _ => return (false, lines),
        }
    }
    (true, lines)
}

/// At low traffic a metric still arrives: the exporter's buffer is flushed
/// every `--statsd-flush-interval` (2 seconds by default), not only when it
/// fills.
#[tokio::test]
async fn a_single_push_reaches_statsd_without_more_traffic() {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let statsd = socket.local_addr().unwrap().to_string();
    let server = Server::start_with(&["--statsd-host", &statsd, "--statsd-label", "push"]).await;
    let (_, sub) = server.offline_subscription(false).await;
    sub.push_text("one").await;
    let (arrived, lines) =
        statsd_lines_until(&socket, "push.notification.received", HANG_GUARD).await;
    assert!(arrived, "the push's counter never arrived: {lines:?}");
}

/// What was recorded just before SIGTERM is sent at shutdown, however long
/// the flush interval.
#[tokio::test]
async fn statsd_lines_recorded_before_sigterm_are_sent() {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let statsd = socket.local_addr().unwrap().to_string();
    let mut server = Server::start_with(&[
        "--statsd-host",
        &statsd,
        "--statsd-label",
        "push",
        "--statsd-flush-interval",
        "3600",
    ])
    .await;
    let (_, sub) = server.offline_subscription(false).await;
    sub.push_text("last words").await;
    assert!(server.terminate(), "exit status: {}", server.stderr());
    let (arrived, lines) =
        statsd_lines_until(&socket, "push.notification.received", HANG_GUARD).await;
    assert!(
        arrived,
        "the push's counter was lost at shutdown: {lines:?}"
    );
}
