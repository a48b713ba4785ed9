//! End-to-end scenarios every shared store runs (DynamoDB, Bigtable),
//! written once so the stores cannot drift.

use std::collections::BTreeMap;

use crate::server::run_autopush;
use crate::{Server, Subscription, WsClient};

/// The keys every node of one cluster shares, fresh, as flags.
pub async fn cluster_keys() -> Vec<String> {
    let keygen = async || {
        let out = run_autopush(&["keygen"]).await;
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let (crypto_key, auth_key) = (keygen().await, keygen().await);
    vec![
        format!("--crypto-key={crypto_key}"),
        format!("--auth-key={auth_key}"),
        // Node-to-node calls are signed; any shared secret will do here.
        format!("--router-key={auth_key}"),
    ]
}

/// Receive everything up to `expected` notifications on `ws`, ack each, and
/// count what arrived by plaintext.
pub async fn receive_and_ack(
    ws: &mut WsClient,
    sub: &Subscription,
    expected: usize,
    seen: &mut BTreeMap<String, usize>,
) {
    for _ in 0..expected {
        let (n, d) = sub.receive(ws).await;
        ws.ack_notification(&n).await;
        *seen.entry(d.text).or_default() += 1;
    }
}

/// Split mode: a client subscribed through connection node `a` (pushes
/// through `endpoint`) moves between `a` and `b`, pushes racing its moves;
/// every message arrives once, and a stale connection never gets one.
pub async fn clients_move_between_nodes(endpoint: &Server, a: &Server, b: &Server) {
    let mut seen = BTreeMap::new();

    // Subscribed on node A, a push through the endpoint node arrives on A.
    let mut on_a = WsClient::connect_hello(&a.ws_url(), None).await;
    let uaid = on_a.uaid().to_owned();
    let sub = Subscription::new(&mut on_a).await;
    assert!(sub.endpoint.starts_with(&endpoint.endpoint_base()));
    sub.push_text("one").await;
    receive_and_ack(&mut on_a, &sub, 1, &mut seen).await;

    // The client shows up on node B: A drops its stale connection, and the
    // endpoint finds the client on B.
    let mut on_b = b.reconnect(&uaid).await;
    let closed = on_a.expect_closed().await;
    assert!(
        closed
            .messages
            .iter()
            .all(|m| m["messageType"] != "notification"),
        "{:?}",
        closed.messages
    );
    sub.push_text("two").await;
    receive_and_ack(&mut on_b, &sub, 1, &mut seen).await;

    // Offline: the endpoint finds B without the client, stores the message;
    // the client gets it on A.
    on_b.close().await;
    sub.push_text("three").await;
    let mut on_a = a.reconnect(&uaid).await;
    receive_and_ack(&mut on_a, &sub, 1, &mut seen).await;

    // Pushes racing the client's moves between nodes.
    let mut ws = on_a;
    let nodes = [b, a];
    let rounds = 6;
    for round in 0..rounds {
        let pusher = {
            let sub = sub.clone();
            tokio::spawn(async move {
                sub.push_text(&format!("race {round}")).await;
            })
        };
        ws.close().await;
        ws = nodes[round % 2].reconnect(&uaid).await;
        pusher.await.unwrap();
        // Direct or from storage, on whichever connection it reached.
        receive_and_ack(&mut ws, &sub, 1, &mut seen).await;
    }
    ws.close().await;
    let mut last = b.reconnect(&uaid).await;
    last.assert_nothing_arrives().await;

    let mut want: BTreeMap<String, usize> = ["one", "two", "three"]
        .iter()
        .map(|s| (s.to_string(), 1))
        .collect();
    want.extend((0..rounds).map(|r| (format!("race {r}"), 1)));
    assert_eq!(seen, want);
}
