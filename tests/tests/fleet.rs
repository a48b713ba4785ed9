//! Two versions in one fleet: our endpoint beside connection nodes of other
//! versions of the router API (docs/internals.md), each a stand-in that
//! answers as that version does ([`autopush_tests::fleet`]), on Bigtable
//! (a store whose nodes hold durable direct copies). What the user sees:
//! a message answered 201 reaches its client when it comes back, whatever
//! the node that took it did next.

use autopush_tests::backend::{self, Db};
use autopush_tests::fleet::{Answers, StandInNode};
use autopush_tests::*;

/// The endpoint and a connection node of ours on one fresh table, the
/// connection node telling endpoints that `stand_in` holds its clients:
/// every push for them goes to the stand-in. `endpoint_args` are the
/// endpoint's extra settings.
async fn fleet_beside(stand_in: &StandInNode, endpoint_args: &[&str]) -> (Server, Server) {
    let node = backend::node(Db::Bigtable, &[]).await;
    let mut endpoint = Node {
        role: "endpoint",
        ..node.clone()
    };
    endpoint
        .args
        .extend(endpoint_args.iter().map(|a| a.to_string()));
    let endpoint = Server::start_node(endpoint).await;
    let mut connection = Node {
        role: "connection",
        endpoint_url: Some(endpoint.endpoint_base()),
        ..node
    };
    connection.args.push(format!("--node-url={}", stand_in.url));
    let connection = Server::start_node(connection).await;
    (endpoint, connection)
}

/// A push, with or without a Topic, that a stand-in answering as
/// `answers` takes for a connected client; the client then leaves without
/// having seen it, and the stand-in dies. Whether the message arrives when
/// the client comes back (within [`QUIET`]), and what the endpoint logged.
async fn arrives_after_the_node_that_took_it_died(
    answers: Answers,
    topic: bool,
    endpoint_args: &[&str],
) -> (bool, String) {
    let stand_in = StandInNode::start(answers).await;
    let (endpoint, connection) = fleet_beside(&stand_in, endpoint_args).await;
    let mut ws = connection.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let mut opts = SendOptions::text("taken by another version");
    if topic {
        opts = opts.topic("upgrade");
    }
    sub.send(&opts).await.assert_created();
    let pushes = stand_in.pushes();
    assert_eq!(pushes.len(), 1, "the stand-in took no push");
    // The endpoint names its version, for a node to tell an older one.
    assert_eq!(
        pushes[0]
            .get("x-autopush-router-api")
            .map(|v| v.to_str().unwrap_or_default()),
        Some("5"),
        "{:?}",
        pushes[0]
    );
    ws.close().await;
    stand_in.kill();

    let mut ws = connection.reconnect(&uaid).await;
    let arrived = match ws.try_recv_for(QUIET).await {
        Some(n) => {
            assert_eq!(sub.decrypt(&n).await.text, "taken by another version");
            true
        }
        None => false,
    };
    (arrived, endpoint.stderr())
}

/// A node of the release before held copies (protocol 1) names no
/// version and does not hold copies: the endpoint keeps a Topic message's
/// copy and writes a plain one's, so both arrive after that node's client
/// left without an ack and the node died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_a_node_of_the_previous_release_took_arrives_after_it_died() {
    let mut lost = Vec::new();
    for topic in [true, false] {
        let (arrived, log) =
            arrives_after_the_node_that_took_it_died(Answers::Protocol1, topic, &[]).await;
        if !arrived {
            lost.push(if topic { "with a Topic" } else { "without" });
        }
        // Said to the operator, once.
        let said = "answered without naming its router API version";
        assert_eq!(log.matches(said).count(), 1, "{log}");
    }
    assert!(lost.is_empty(), "lost after a 201: {lost:?}");
}

/// The cases of [`arrives_after_the_node_that_took_it_died`] whose outcome
/// differs from `expected` (as "topic"/"plain"), for one failure message.
async fn differing(
    answers: Answers,
    endpoint_args: &[&str],
    expected: impl Fn(bool) -> bool,
) -> Vec<&'static str> {
    let mut differ = Vec::new();
    for topic in [true, false] {
        let (arrived, _) =
            arrives_after_the_node_that_took_it_died(answers, topic, endpoint_args).await;
        if arrived != expected(topic) {
            differ.push(if topic { "topic" } else { "plain" });
        }
    }
    differ
}

/// A node of protocol 2 (names no version, says it settles copies) is
/// still ours: a held copy it says was acked is not written again (no
/// duplicate), and a Topic message's copy stays until that ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_protocol_2_is_still_taken_at_its_word() {
    let acked = Answers::Protocol2 { fate: "acked" };
    let differ = differing(acked, &[], |topic| topic).await;
    assert!(differ.is_empty(), "unexpected outcome: {differ:?}");
}

/// A node of the next version (4) names it, without protocol 2's header
/// and with a header we do not know: it is ours, and a fate we know is
/// taken at its word. A fate we do not know has the endpoint write the
/// copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_next_version_is_read_as_ours() {
    let acked = Answers::Next { fate: "acked" };
    let differ = differing(acked, &[], |topic| topic).await;
    assert!(differ.is_empty(), "fate acked: {differ:?}");
    let unknown = Answers::Next { fate: "journaled" };
    let differ = differing(unknown, &[], |_| true).await;
    assert!(
        differ.is_empty(),
        "lost with a fate we do not know: {differ:?}"
    );
}

/// autopush-rs's node sends nothing of its own: undeclared, it is treated
/// as anything unknown (the copy kept or written, a duplicate at worst);
/// declared by `--autopush-rs-nodes` during a migration, a push it takes
/// leaves no copy (that node keeps the message until its ack, and stores
/// it if its client leaves; killed, it loses it, as autopush-rs does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autopush_rs_nodes_are_known_only_by_declaration() {
    let differ = differing(Answers::AutopushRs, &[], |_| true).await;
    assert!(differ.is_empty(), "undeclared, lost: {differ:?}");
    let declared = ["--autopush-rs-nodes=127.0.0.1"];
    let differ = differing(Answers::AutopushRs, &declared, |_| false).await;
    assert!(differ.is_empty(), "declared, a copy stayed: {differ:?}");
}

/// A declaration that is not one of addresses or networks, or that names
/// every address, stops the start naming the setting as it was given.
#[tokio::test]
async fn a_wrong_autopush_rs_nodes_setting_stops_the_start() {
    for value in ["10.0.2.0/33", "autoconnect-1", "0.0.0.0/0"] {
        let flag = format!("--autopush-rs-nodes={value}");
        let out = server::run_autopush(&["endpoint", &flag]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {stderr}");
        assert!(
            stderr.contains(&format!("--autopush-rs-nodes: {value:?}")),
            "{value}: {stderr}"
        );
    }
}
