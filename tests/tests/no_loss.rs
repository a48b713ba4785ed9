//! Nothing accepted is lost: Topic replacement racing an ack, nacks, the
//! stored-message limit, and direct messages in flight when the node dies.

use autopush_tests::*;

/// Receive one notification for `sub` and return it with its plaintext.
async fn next_text(ws: &mut WsClient, sub: &Subscription) -> (serde_json::Value, String) {
    let (notif, d) = sub.receive(ws).await;
    (notif, d.text)
}

/// Close `ws`, come back as `uaid`, and find nothing left to deliver.
async fn nothing_left(server: &Server, ws: WsClient, uaid: &str) {
    ws.close().await;
    let mut ws = server.reconnect(uaid).await;
    ws.assert_nothing_arrives().await;
}

/// The client holds stored Topic message T1 unacked; T2 replaces it (stored
/// and, the client being connected, delivered). Acking T1 must not delete T2.
#[tokio::test]
async fn acking_an_old_topic_message_keeps_the_newer_one() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.send(&SendOptions::text("T1").topic("score"))
        .await
        .assert_created();

    let mut ws = server.reconnect(&uaid).await;
    let (t1, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "T1");
    sub.send(&SendOptions::text("T2").topic("score"))
        .await
        .assert_created();
    let (_, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "T2");
    ws.ack_notification(&t1).await;
    ws.close().await;

    // T2 was never acked: it comes back.
    let mut ws = server.reconnect(&uaid).await;
    let (t2, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "T2");
    ws.ack_notification(&t2).await;
    nothing_left(&server, ws, &uaid).await;
}

/// The same race when T2 is stored because the client is busy (too many
/// unacknowledged direct messages), with durable direct delivery off.
#[tokio::test]
async fn acking_an_old_topic_message_keeps_the_newer_one_stored_while_busy() {
    let server = Server::start_with(&["--durable-direct", "false"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.send(&SendOptions::text("T1").topic("score"))
        .await
        .assert_created();
    let mut ws = server.reconnect(&uaid).await;
    let (t1, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "T1");

    // Fill the client's direct window without acking, so T2 is stored.
    let filler = Subscription::new(&mut ws).await;
    for _ in 0..32 {
        http::post_push(&filler.endpoint, &[("ttl", "60")], None)
            .await
            .assert_created();
        assert_eq!(
            ws.recv_notification().await["channelID"],
            filler.channel_id.as_str()
        );
    }
    sub.send(&SendOptions::text("T2").topic("score"))
        .await
        .assert_created();
    ws.ack_notification(&t1).await;

    // With T1 settled the session looks in storage again and finds T2.
    let (t2, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "T2");
    ws.ack_notification(&t2).await;
}

/// A nack deletes nothing: the message comes back at the next connection.
#[tokio::test]
async fn a_nacked_message_is_offered_again_at_the_next_connection() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    sub.push_text("handler threw").await;

    let mut ws = server.reconnect(&uaid).await;
    let (notif, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "handler threw");
    ws.nack(
        notif["channelID"].as_str().unwrap(),
        notif["version"].as_str().unwrap(),
        301,
    )
    .await;
    // Not sent again in this session.
    ws.assert_nothing_arrives().await;
    ws.close().await;

    let mut ws = server.reconnect(&uaid).await;
    let (notif, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "handler threw");
    ws.ack_notification(&notif).await;
}

/// A direct message nacked is kept too.
#[tokio::test]
async fn a_nacked_direct_message_is_kept() {
    for durable in ["true", "false"] {
        let server = Server::start_with(&["--durable-direct", durable]).await;
        let mut ws = server.client().await;
        let uaid = ws.uaid().to_string();
        let sub = Subscription::new(&mut ws).await;
        sub.push_text("live, nacked").await;
        let (notif, _) = next_text(&mut ws, &sub).await;
        ws.nack(
            notif["channelID"].as_str().unwrap(),
            notif["version"].as_str().unwrap(),
            302,
        )
        .await;
        ws.close().await;
        let mut ws = server.reconnect(&uaid).await;
        let (_, text) = next_text(&mut ws, &sub).await;
        assert_eq!(text, "live, nacked", "durable-direct {durable}");
    }
}

/// Over `msg_limit`, the client first gets what fits and keeps its UAID; if
/// it has caught up by its next hello, nothing is reset or lost.
#[tokio::test]
async fn over_the_limit_the_client_first_receives_what_fits() {
    let server = Server::start_with(&["--msg-limit", "3"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    for i in 0..5 {
        sub.push_text(&format!("message {i}")).await;
    }
    let mut ws = server.reconnect(&uaid).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let (notif, text) = next_text(&mut ws, &sub).await;
        ws.ack_notification(&notif).await;
        got.push(text);
    }
    assert_eq!(got, ["message 0", "message 1", "message 2"]);
    ws.assert_nothing_arrives().await;
    ws.close().await;

    // Two left, under the limit: same UAID, and they arrive.
    let mut ws = server.reconnect(&uaid).await;
    for i in 3..5 {
        let (notif, text) = next_text(&mut ws, &sub).await;
        assert_eq!(text, format!("message {i}"));
        ws.ack_notification(&notif).await;
    }
}

/// Still over the limit at the next hello: a new UAID, and the old
/// endpoints answer 410.
#[tokio::test]
async fn still_over_the_limit_at_the_next_hello_resets_the_uaid() {
    let server = Server::start_with(&["--msg-limit", "2"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    for i in 0..6 {
        sub.push_text(&format!("message {i}")).await;
    }
    let mut ws = server.reconnect(&uaid).await;
    for _ in 0..2 {
        let (notif, _) = next_text(&mut ws, &sub).await;
        ws.ack_notification(&notif).await;
    }
    ws.close().await;

    let mut ws = WsClient::connect(&server.ws_url()).await;
    let reply = ws.hello(Some(&uaid)).await;
    assert_eq!(reply["status"], 200, "{reply}");
    assert_ne!(reply["uaid"], uaid.as_str(), "a new uaid expected: {reply}");
    sub.send(&SendOptions::text("too late"))
        .await
        .assert_error(410, 103);
}

/// Expired messages never count toward the limit.
#[tokio::test]
async fn expired_messages_do_not_count_toward_the_limit() {
    let server = Server::start_with(&["--msg-limit", "2"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    for i in 0..4 {
        sub.send(&SendOptions::text(&format!("short {i}")).ttl(1))
            .await
            .assert_created();
    }
    sub.push_text("long-lived").await;
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    for _ in 0..2 {
        let mut ws = server.reconnect(&uaid).await;
        let (_, text) = next_text(&mut ws, &sub).await;
        assert_eq!(text, "long-lived");
        ws.close().await;
    }
}

/// Durable direct delivery (the default): messages handed to a connected
/// client and not yet acked survive `kill -9` of the node.
#[tokio::test]
async fn direct_messages_in_flight_survive_kill9() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    for i in 0..3 {
        sub.push_text(&format!("in flight {i}")).await;
        let (_, text) = next_text(&mut ws, &sub).await;
        assert_eq!(text, format!("in flight {i}"));
    }
    server.kill9();
    ws.expect_closed().await;
    server.restart().await;

    let mut ws = server.reconnect(&uaid).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let (notif, text) = next_text(&mut ws, &sub).await;
        ws.ack_notification(&notif).await;
        got.push(text);
    }
    got.sort();
    assert_eq!(got, ["in flight 0", "in flight 1", "in flight 2"]);
    nothing_left(&server, ws, &uaid).await;
}

/// Acked durable direct messages stay acked across `kill -9`: start-up
/// brings back only those not acked.
#[tokio::test]
async fn after_kill9_only_unacked_direct_messages_come_back() {
    let mut server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    for i in 0..4 {
        sub.push_text(&format!("message {i}")).await;
        let (notif, text) = next_text(&mut ws, &sub).await;
        assert_eq!(text, format!("message {i}"));
        if i % 2 == 0 {
            ws.ack_notification(&notif).await;
        }
    }
    // A ping answered means the acks before it were handled.
    ws.ping().await;
    ws.recv().await;
    server.kill9();
    ws.expect_closed().await;
    server.restart().await;

    let mut ws = server.reconnect(&uaid).await;
    let mut got = Vec::new();
    for _ in 0..2 {
        let (notif, text) = next_text(&mut ws, &sub).await;
        ws.ack_notification(&notif).await;
        got.push(text);
    }
    got.sort();
    assert_eq!(got, ["message 1", "message 3"]);
    nothing_left(&server, ws, &uaid).await;
}

/// With durable direct delivery off, the README's promise is narrower: a
/// direct message not yet acked lives in memory, and `kill -9` loses it.
#[tokio::test]
async fn without_durable_direct_kill9_loses_unacked_direct_messages() {
    let mut server = Server::start_with(&["--durable-direct", "false"]).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    sub.push_text("only in memory").await;
    next_text(&mut ws, &sub).await;
    server.kill9();
    ws.expect_closed().await;
    server.restart().await;
    let mut ws = server.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

/// Acked durable direct messages are deleted: nothing comes back.
#[tokio::test]
async fn acked_direct_messages_are_not_delivered_again() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_string();
    let sub = Subscription::new(&mut ws).await;
    for i in 0..3 {
        sub.push_text(&format!("acked {i}")).await;
        let (notif, _) = next_text(&mut ws, &sub).await;
        ws.ack_notification(&notif).await;
    }
    nothing_left(&server, ws, &uaid).await;
}

/// `DELETE` of a Topic message's id after a newer message replaced it
/// cancels nothing: the newer message is still delivered.
#[tokio::test]
async fn deleting_a_replaced_topic_message_keeps_the_newer_one() {
    let server = Server::start().await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let old = sub
        .send(&SendOptions::text("old").topic("news"))
        .await
        .assert_created()
        .header("location")
        .unwrap()
        .to_string();
    sub.send(&SendOptions::text("new").topic("news"))
        .await
        .assert_created();
    assert_eq!(http::delete(&old).await.status, 204);
    let mut ws = server.reconnect(&uaid).await;
    let (_, text) = next_text(&mut ws, &sub).await;
    assert_eq!(text, "new");
}

/// What became of the pushes to a webpush client so far, from the router
/// API's `/metrics`: (direct, stored).
async fn deliveries(server: &Server) -> (f64, f64) {
    let reply = http::get(&format!("{}/metrics", server.router_base())).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let scrape = prometheus::Scrape::parse(&reply.text);
    let outcome = |outcome| {
        scrape.value(
            "notification_delivery",
            &[("outcome", outcome), ("router_type", "webpush")],
        )
    };
    (outcome("direct"), outcome("stored"))
}

/// A nacked direct message no longer counts against the client's window of
/// unacknowledged direct messages: a client whose push handler failed more
/// times than the window holds (32) still gets its pushes directly. The
/// nacked ones are not sent again on this connection, and all come back at
/// the next one.
#[tokio::test]
async fn nacked_direct_messages_do_not_fill_the_direct_window() {
    const NACKED: usize = 40;
    for durable in ["true", "false"] {
        let server = Server::start_with(&["--durable-direct", durable]).await;
        let mut ws = server.client().await;
        let uaid = ws.uaid().to_string();
        let sub = Subscription::new(&mut ws).await;
        for _ in 0..NACKED {
            http::post_push(&sub.endpoint, &[("ttl", "600")], None)
                .await
                .assert_created();
            let notif = ws.recv_notification().await;
            ws.nack(&sub.channel_id, notif["version"].as_str().unwrap(), 302)
                .await;
        }
        let last = http::post_push(&sub.endpoint, &[("ttl", "600")], None).await;
        last.assert_created();
        let notif = ws.recv_notification().await;
        ws.ack_notification(&notif).await;
        let (direct, stored) = deliveries(&server).await;
        assert!(
            (direct, stored) == (NACKED as f64 + 1.0, 0.0),
            "durable-direct {durable}: after {NACKED} nacks, {direct} pushes went direct \
             and {stored} to storage (want all {} direct)",
            NACKED + 1
        );
        ws.assert_nothing_arrives().await;
        ws.close().await;

        let mut ws = server.reconnect(&uaid).await;
        let mut again = std::collections::BTreeSet::new();
        for _ in 0..NACKED {
            let notif = ws.recv_notification().await;
            again.insert(notif["version"].as_str().unwrap_or_default().to_owned());
            ws.ack_notification(&notif).await;
        }
        assert_eq!(again.len(), NACKED, "durable-direct {durable}");
        nothing_left(&server, ws, &uaid).await;
    }
}
