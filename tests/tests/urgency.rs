//! The user agent's minimum urgency (RFC 8030 §5.3) end to end: a client
//! says the least urgent message it wants with the websocket's `urgency`
//! message; less urgent pushes wait in storage (their receipt says
//! `stored`) until it lowers its minimum, TTL-0 ones are dropped. Senders
//! are pywebpush and the npm web-push, each with its own `Urgency` header.

use autopush_storage::dynamodb::Tables;
use autopush_tests::http::post_push;
use autopush_tests::node::{self, WebPushOptions};
use autopush_tests::{
    Node, SendOptions, Server, Subscription, WsClient, dynamo, receipt, scenarios,
};
use serde_json::{Value, json};

/// Set the client's minimum and check it was taken.
async fn set_min(ws: &mut WsClient, min: &str) {
    let reply = ws.set_min_urgency(json!(min)).await;
    assert_eq!(
        reply,
        json!({"messageType": "urgency", "status": 200}),
        "setting the minimum urgency to {min}"
    );
}

/// Push `text` with `Urgency: urgency` (pywebpush); its receipt URL.
async fn push(sub: &Subscription, text: &str, urgency: &str) -> String {
    let sent = sub.send(&SendOptions::text(text).urgency(urgency)).await;
    receipt::location(&sent)
}

/// Receive the next notification, check its plaintext and ack it.
async fn receive(ws: &mut WsClient, sub: &Subscription, want: &str) {
    let (n, d) = sub.receive(ws).await;
    assert_eq!(d.text, want, "the next notification to arrive");
    ws.ack_notification(&n).await;
}

#[tokio::test]
async fn at_low_high_pushes_arrive_and_very_low_ones_wait_in_storage() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "low").await;

    let held = push(&sub, "very-low, held", "very-low").await;
    assert_eq!(receipt::state_of(&held).await, "stored");
    push(&sub, "high", "high").await;
    receive(&mut ws, &sub, "high").await;
    // No Urgency header means normal; low is the minimum itself.
    sub.push_text("no urgency").await;
    receive(&mut ws, &sub, "no urgency").await;
    push(&sub, "low", "low").await;
    receive(&mut ws, &sub, "low").await;

    // Nor is it sent at the next hello: the minimum is on the record.
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    let mut ws = server.reconnect(&uaid).await;
    push(&sub, "after reconnecting", "normal").await;
    receive(&mut ws, &sub, "after reconnecting").await;
    assert_eq!(receipt::state_of(&held).await, "stored");
}

#[tokio::test]
async fn lowering_the_minimum_releases_the_held_messages_oldest_first() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "high").await;
    let first = push(&sub, "very-low 1", "very-low").await;
    push(&sub, "low 1", "low").await;
    push(&sub, "normal 1", "normal").await;
    push(&sub, "very-low 2", "very-low").await;
    push(&sub, "low 2", "low").await;
    push(&sub, "urgent", "high").await;
    receive(&mut ws, &sub, "urgent").await;

    // Down to low: the low and normal ones, in the order they came.
    set_min(&mut ws, "low").await;
    for text in ["low 1", "normal 1", "low 2"] {
        receive(&mut ws, &sub, text).await;
    }
    assert_eq!(receipt::state_of(&first).await, "stored");
    // Down to very-low: the rest.
    set_min(&mut ws, "very-low").await;
    for text in ["very-low 1", "very-low 2"] {
        receive(&mut ws, &sub, text).await;
    }
    receipt::wait_for_state(&first, "delivered").await;
    // Everything flows again.
    push(&sub, "very-low 3", "very-low").await;
    receive(&mut ws, &sub, "very-low 3").await;
}

/// More held messages than a batch of stored ones (100) and than
/// `--msg-limit`'s worth of pages: the deliverable ones behind them still
/// arrive, at hello and when the minimum is lowered.
#[tokio::test]
async fn held_messages_do_not_block_the_ones_behind_them() {
    let server =
        Server::start_with(&["--msg-limit", "1000", "--subscription-limit", "1000,1000"]).await;
    let (uaid, sub) = server.offline_subscription(false).await;
    let mut ws = server.reconnect(&uaid).await;
    set_min(&mut ws, "normal").await;
    ws.close().await;
    // Straight to the endpoint (no body): 150 pywebpush runs take long.
    // Each push's version, from its Location.
    let raw = async |urgency: &str| {
        let reply = post_push(&sub.endpoint, &[("ttl", "600"), ("urgency", urgency)], None).await;
        assert_eq!(reply.status, 201, "{reply:?}");
        let location = reply.header("location").expect("Location");
        receipt::id_of(location).to_owned()
    };
    let mut low = Vec::new();
    for _ in 0..150 {
        low.push(raw("low").await);
    }
    let high = raw("high").await;

    let mut ws = server.reconnect(&uaid).await;
    let n = ws.recv_notification().await;
    assert_eq!(n["version"], high.as_str(), "the first message after hello");
    ws.ack_notification(&n).await;
    set_min(&mut ws, "low").await;
    // Released in batches: each acked before the next comes.
    let mut released = Vec::new();
    while released.len() < low.len() {
        let n = ws.recv_notification().await;
        ws.ack_notification(&n).await;
        released.push(n["version"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(released, low, "the held messages, oldest first");
}

#[tokio::test]
async fn a_ttl_0_push_below_the_minimum_is_dropped() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "normal").await;
    let sent = sub
        .send(&SendOptions::text("now or never").urgency("low").ttl(0))
        .await;
    assert_eq!(
        receipt::state_of(&receipt::location(&sent)).await,
        "dropped"
    );
    set_min(&mut ws, "very-low").await;
    push(&sub, "marker", "very-low").await;
    receive(&mut ws, &sub, "marker").await;
}

#[tokio::test]
async fn a_minimum_outside_the_four_values_is_refused_with_400() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    for bad in [json!("urgent"), json!("HIGH"), json!(2), Value::Null] {
        let reply = ws.set_min_urgency(bad.clone()).await;
        assert_eq!(reply["status"], 400, "min {bad}: {reply}");
        let reason = reply["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(&bad.to_string()), "min {bad}: {reply}");
    }
    // The connection stays, and so does the minimum (very-low).
    push(&sub, "still here", "very-low").await;
    receive(&mut ws, &sub, "still here").await;
}

#[tokio::test]
async fn the_endpoint_refuses_an_unknown_urgency_and_keeps_it_from_the_client() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    let reply = post_push(&sub.endpoint, &[("ttl", "60"), ("urgency", "urgent")], None).await;
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.text.contains("urgent"), "{}", reply.text);

    push(&sub, "high", "high").await;
    let (n, _) = sub.receive(&mut ws).await;
    assert!(
        !n.to_string().to_ascii_lowercase().contains("urgency"),
        "the client sees the sender's Urgency: {n}"
    );
}

/// pywebpush and the npm web-push both send `Urgency`, and it is honoured.
#[tokio::test]
async fn pywebpush_and_web_push_send_urgency_and_it_is_honoured() {
    let server = Server::start().await;
    let mut ws = server.client().await;
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "normal").await;

    let py_low = sub
        .send(&SendOptions::text("pywebpush low").urgency("low"))
        .await;
    assert_eq!(
        py_low.sent_headers.get("urgency").map(String::as_str),
        Some("low")
    );
    let node_low = node::send(
        &sub.endpoint,
        &sub.keys,
        &WebPushOptions::text("web-push low").urgency("very-low"),
    )
    .await;
    assert_eq!(
        node_low.sent_headers.get("urgency").map(String::as_str),
        Some("very-low")
    );
    for sent in [&py_low, &node_low] {
        assert_eq!(receipt::state_of(&receipt::location(sent)).await, "stored");
    }
    node::send(
        &sub.endpoint,
        &sub.keys,
        &WebPushOptions::text("web-push high").urgency("high"),
    )
    .await
    .assert_created();
    receive(&mut ws, &sub, "web-push high").await;
    sub.send(&SendOptions::text("pywebpush normal").urgency("normal"))
        .await
        .assert_created();
    receive(&mut ws, &sub, "pywebpush normal").await;

    set_min(&mut ws, "very-low").await;
    receive(&mut ws, &sub, "pywebpush low").await;
    receive(&mut ws, &sub, "web-push low").await;
}

/// Split mode on DynamoDB: the minimum set on one connection node holds
/// when the client comes back on the other.
#[tokio::test]
async fn the_minimum_holds_after_reconnecting_to_another_node() {
    let dynamo = dynamo::local().await;
    let tables: Tables = dynamo::tables();
    let out = {
        let mut cmd = tokio::process::Command::from(autopush_tests::server::autopush_command());
        cmd.args(["db", "create-tables", "--db", "dynamodb"])
            .args(["--router-table", &tables.router])
            .args(["--message-table", &tables.message])
            .envs(dynamo::aws_env(&dynamo.endpoint))
            .kill_on_drop(true);
        cmd.output().await.expect("run autopush db create-tables")
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut args = vec![
        format!("--router-table={}", tables.router),
        format!("--message-table={}", tables.message),
    ];
    args.extend(scenarios::cluster_keys().await);
    let env: Vec<(String, String)> = dynamo::aws_env(&dynamo.endpoint)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let node = |role, endpoint_url| Node {
        role,
        db: Some("dynamodb".into()),
        endpoint_url,
        env: env.clone(),
        args: args.clone(),
        clock_offset_secs: 0,
    };
    let endpoint = Server::start_node(node("endpoint", None)).await;
    let a = Server::start_node(node("connection", Some(endpoint.endpoint_base()))).await;
    let b = Server::start_node(node("connection", Some(endpoint.endpoint_base()))).await;

    let mut ws = a.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "high").await;
    ws.close().await;

    let mut ws = b.reconnect(&uaid).await;
    let held = push(&sub, "normal, held", "normal").await;
    push(&sub, "high", "high").await;
    receive(&mut ws, &sub, "high").await;
    assert_eq!(receipt::state_of(&held).await, "stored");
    set_min(&mut ws, "normal").await;
    receive(&mut ws, &sub, "normal, held").await;
}

/// A bodyless push straight to the endpoint with `Urgency: urgency`: its
/// answer.
async fn raw_push(sub: &Subscription, urgency: &str) -> autopush_tests::http::HttpReply {
    post_push(&sub.endpoint, &[("ttl", "600"), ("urgency", urgency)], None).await
}

/// The answer to a push over the hold's bound of `bound` messages: 429
/// errno 201, with a `Retry-After`, and the `hold` policy: that bound, with
/// no window (the hold empties as the user agent takes its messages, not
/// with time).
fn assert_hold_full(reply: &autopush_tests::http::HttpReply, bound: u64) {
    let limit = reply.assert_rate_limited("a push over the hold's bound");
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("hold", bound, None),
        "{limit:?}"
    );
}

/// Messages held below the minimum are never sent while held, so they are
/// not a client falling behind: holding more than `--msg-limit` of them
/// never resets the user agent, however often it reconnects. They have a
/// bound of their own (`--msg-limit` again), and a push over it is refused
/// with 429 rather than accepted and lost.
#[tokio::test]
async fn held_messages_never_reset_the_user_agent_and_are_bounded() {
    let server = Server::start_with(&["--msg-limit", "3"]).await;
    let mut ws = server.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    set_min(&mut ws, "high").await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(raw_push(&sub, "normal").await);
    }
    for _ in 0..2 {
        ws.close().await;
        ws = WsClient::connect_hello(&server.ws_url(), Some(&uaid)).await;
        assert_eq!(
            ws.uaid(),
            uaid,
            "the user agent was reset for its held messages"
        );
    }
    let answered: Vec<u16> = statuses.iter().map(|r| r.status).collect();
    assert_eq!(answered, [201, 201, 201, 429], "{statuses:?}");
    assert_hold_full(&statuses[3], 3);
    set_min(&mut ws, "very-low").await;
    let released = ws.recv_notifications(3).await;
    for n in &released {
        ws.ack_notification(n).await;
    }
    ws.assert_nothing_arrives().await;
}

/// A full hold costs the subscription holding the most, never another: its
/// next push is refused, while another subscription's push is taken and
/// the heaviest one's oldest held message goes (its receipt reads
/// `dropped`). One sender filling the hold cannot keep another out.
#[tokio::test]
async fn a_full_hold_costs_only_the_subscription_holding_the_most() {
    let server = Server::start_with(&["--msg-limit", "3"]).await;
    let mut ws = server.client().await;
    let filler = Subscription::new(&mut ws).await;
    let other = Subscription::new(&mut ws).await;
    set_min(&mut ws, "high").await;
    let mut filled = Vec::new();
    for _ in 0..3 {
        let reply = raw_push(&filler, "low").await;
        assert_eq!(reply.status, 201, "{reply:?}");
        filled.push(reply.header("location").expect("Location").to_owned());
    }
    assert_hold_full(&raw_push(&filler, "low").await, 3);

    let reply = raw_push(&other, "low").await;
    assert_eq!(
        reply.status, 201,
        "another subscription kept out: {reply:?}"
    );
    assert_eq!(receipt::state_of(&filled[0]).await, "dropped");
    assert_eq!(receipt::state_of(&filled[1]).await, "stored");
    assert_hold_full(&raw_push(&filler, "low").await, 3);

    set_min(&mut ws, "very-low").await;
    let released = ws.recv_notifications(3).await;
    let from_other = released
        .iter()
        .filter(|n| n["channelID"] == other.channel_id.as_str())
        .count();
    assert_eq!(from_other, 1, "{released:?}");
    for n in &released {
        ws.ack_notification(n).await;
    }
    ws.assert_nothing_arrives().await;
}
