//! A connection node holds a direct message's durable copy back for a
//! grace and writes it only if its client has not acked by then: on every
//! store whose writes cost (DynamoDB, PostgreSQL). Kills, moves and acks
//! racing the grace, end to end through split mode; none may lose a
//! message answered 201. With a journal of its own (`--journal-dir`), the
//! node keeps the copy there for a window instead: those tests run on the
//! Bigtable emulator too.

use std::collections::BTreeMap;
use std::sync::Arc;

use autopush_common::time::now_millis;
use autopush_storage::Storage;
use autopush_tests::backend::{self, Db};
use autopush_tests::cut_off::CutOffRelay;
use autopush_tests::scenarios::receive_and_ack;
use autopush_tests::{Node, SendOptions, Server, Subscription};

/// Split mode on one shared store: an endpoint node and two connection
/// nodes, A holding direct copies back for its grace.
struct Cluster {
    endpoint: Server,
    a: Server,
    b: Server,
    store: Arc<dyn Storage>,
    /// The key the nodes sign their calls to each other with.
    router_key: String,
}

impl Cluster {
    /// The three nodes on fresh tables of `db`, A's grace `grace_ms` (long
    /// enough to act inside it).
    async fn holding_for(db: Db, grace_ms: u64) -> Cluster {
        Cluster::start(db, grace_ms, None, &[], &[]).await
    }

    /// The three nodes, A keeping copies in a journal of its own, each for
    /// up to `window_ms` before it moves it to the shared store.
    async fn keeping_for(db: Db, window_ms: u64) -> Cluster {
        Cluster::start(db, 10, Some(window_ms), &[], &[]).await
    }

    /// The three nodes, each started with `args` too, A with `a_args`.
    async fn start(
        db: Db,
        grace_ms: u64,
        window_ms: Option<u64>,
        args: &[&str],
        a_args: &[&str],
    ) -> Cluster {
        let (node, store) = backend::shared(db, args).await;
        let router_key = node
            .args
            .iter()
            .find_map(|arg| arg.strip_prefix("--router-key="))
            .expect("the cluster's router key")
            .to_owned();
        let endpoint = Server::start_node(Node {
            role: "endpoint",
            ..node.clone()
        })
        .await;
        let connection = || Node {
            role: "connection",
            endpoint_url: Some(endpoint.endpoint_base()),
            ..node.clone()
        };
        let mut node_a = connection();
        node_a
            .env
            .push(("AUTOPUSH_TEST_DIRECT_GRACE_MS".into(), grace_ms.to_string()));
        // The harness gives each node a journal of its own (the default on
        // a shared store); without a window, A has none.
        match window_ms {
            Some(window_ms) => node_a
                .args
                .push(format!("--journal-window={}", window_ms as f64 / 1000.0)),
            None => node_a.args.push("--journal-dir=off".into()),
        }
        node_a.args.extend(a_args.iter().map(|arg| arg.to_string()));
        let a = Server::start_node(node_a).await;
        let b = Server::start_node(connection()).await;
        Cluster {
            endpoint,
            a,
            b,
            store,
            router_key,
        }
    }

    /// [`Cluster::keeping_for`] a minute, A's router API reached through
    /// `relay` (its node id the relay's URL, so the endpoint calls go
    /// there), which relays to A until told otherwise: the cluster and A's
    /// router API address.
    async fn keeping_behind(db: Db, relay: &CutOffRelay) -> (Cluster, std::net::SocketAddr) {
        let node_url = format!("--node-url={}", relay.url());
        let cluster = Cluster::start(db, 10, Some(60_000), &[], &[&node_url]).await;
        let a_router = cluster.a.router_base();
        let a_router = a_router
            .trim_start_matches("http://")
            .parse()
            .expect("A's router address");
        relay.forward_to(a_router);
        (cluster, a_router)
    }

    /// Nothing more arrives on `ws`, nor at the client's next connection,
    /// on B.
    async fn nothing_comes_again(&self, mut ws: autopush_tests::WsClient, uaid: &str) {
        ws.assert_nothing_arrives().await;
        ws.close().await;
        let mut ws = self.b.reconnect(uaid).await;
        ws.assert_nothing_arrives().await;
    }

    /// A client on node A, subscribed: the client, its UAID and
    /// subscription.
    async fn subscribed_on_a(&self) -> (autopush_tests::WsClient, String, Subscription) {
        let mut ws = self.a.client().await;
        let uaid = ws.uaid().to_owned();
        let sub = Subscription::new(&mut ws).await;
        (ws, uaid, sub)
    }

    /// A client on node A, subscribed, that received `text` (answered 201)
    /// and holds its ack back: the client, its UAID and subscription.
    async fn taken_unacked_on_a(
        &self,
        text: &str,
    ) -> (autopush_tests::WsClient, String, Subscription) {
        let (mut ws, uaid, sub) = self.subscribed_on_a().await;
        let (sent, n) = tokio::join!(sub.push_text(text), ws.recv_notification());
        sent.assert_created();
        assert_eq!(sub.decrypt(&n).await.text, text);
        (ws, uaid, sub)
    }

    /// Stored messages of `uaid`, as the nodes stored them.
    async fn stored_count(&self, uaid: &str) -> usize {
        let uaid = uuid::Uuid::parse_str(uaid).unwrap();
        self.store.count_messages(&uaid, 10).await.unwrap()
    }
}

/// The body of an endpoint's `PUT /push` of `text` to `sub` (TTL 600 s),
/// its version `text` with dashes.
async fn router_push(sub: &Subscription, text: &str) -> serde_json::Value {
    let encrypted = autopush_tests::py::encrypt(
        &sub.keys,
        &autopush_tests::Payload::Text(text.into()),
        autopush_tests::Encoding::Aes128Gcm,
    )
    .await;
    let version = text.replace(' ', "-");
    let mut body = autopush_tests::http::router_notification(&sub.channel_id, &version, &encrypted);
    body["ttl"] = serde_json::json!(600);
    body["sortkey_timestamp"] = serde_json::json!(now_millis() * 1000);
    body
}

/// `text`, and nothing else, arrives once on `ws` (acked there).
async fn arrives_once(ws: &mut autopush_tests::WsClient, sub: &Subscription, text: &str) {
    let mut seen = BTreeMap::new();
    receive_and_ack(ws, sub, 1, &mut seen).await;
    ws.assert_nothing_arrives().await;
    assert_eq!(seen, BTreeMap::from([(text.to_owned(), 1)]));
}

/// `kill -9` of the connection node while it holds the copy of a message
/// its client received but did not ack: the endpoint, whose call failed,
/// writes the copy before its 201, and the client gets the message on the
/// node it moves to.
async fn a_connection_node_killed_inside_the_grace_loses_nothing(db: Db) {
    let mut cluster = Cluster::holding_for(db, 30_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    let a = &mut cluster.a;
    let (sent, ()) = tokio::join!(sub.push_text("held"), async {
        let (_, d) = sub.receive(&mut ws).await;
        assert_eq!(d.text, "held");
        // Not acked: node A holds the only copy.
        a.kill9();
    });
    sent.assert_created();

    let mut ws = cluster.b.reconnect(&uaid).await;
    arrives_once(&mut ws, &sub, "held").await;
}

/// `kill -9` of the endpoint while the connection node holds the copy: the
/// node writes it at the grace's end all the same, and the client, which
/// never acked, gets the message again at its next connection.
async fn an_endpoint_killed_while_the_node_holds_the_copy_loses_nothing(db: Db) {
    let mut cluster = Cluster::holding_for(db, 3_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    // The sender never hears back; its answer is not waited for.
    let sender = sub.clone();
    let sending = tokio::spawn(async move { sender.send(&SendOptions::text("held")).await });
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "held");
    cluster.endpoint.kill9();
    sending.abort();

    autopush_tests::receipt::wait_until("node A writes the copy it held", async || {
        cluster.stored_count(&uaid).await == 1
    })
    .await;
    ws.close().await;
    let mut ws = cluster.b.reconnect(&uaid).await;
    arrives_once(&mut ws, &sub, "held").await;
}

/// The client leaves node A for node B inside the grace without acking:
/// B's storage check at hello comes before A writes the copy, so the
/// endpoint, told the copy was written, finds the client on B and has B
/// look again. The message arrives on B without another reconnect.
async fn a_client_moving_inside_the_grace_gets_the_message_on_its_new_node(db: Db) {
    // Longer than a hello on a loaded machine, shorter than the endpoint's
    // node call timeout (3 s): the node answers, after B's storage check.
    let cluster = Cluster::holding_for(db, 2_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    let (sent, mut on_b) = tokio::join!(sub.push_text("moving"), async {
        let (_, d) = sub.receive(&mut ws).await;
        assert_eq!(d.text, "moving");
        ws.close().await;
        cluster.b.reconnect(&uaid).await
    });
    sent.assert_created();
    arrives_once(&mut on_b, &sub, "moving").await;
}

/// The ack racing the grace, both ways: acked within it, the message is
/// never written and its receipt reads `delivered`; acked after it (the
/// copy written), the ack settles the copy. Neither comes back at the next
/// connection. The grace is long (10 s) so that a loaded machine, slow to
/// hand the first message over and ack it, still acks within it.
async fn acks_inside_and_after_the_grace_settle_the_message_once(db: Db) {
    let cluster = Cluster::holding_for(db, 10_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    // Acked as it arrives (decrypted after): the endpoint's call to the
    // node waits for the ack.
    let (inside, n) = tokio::join!(sub.push_text("inside"), async {
        let n = ws.recv_notification().await;
        ws.ack_notification(&n).await;
        n
    });
    assert_eq!(sub.decrypt(&n).await.text, "inside");
    let location = autopush_tests::receipt::location(&inside);
    assert_eq!(
        autopush_tests::receipt::state_of(&location).await,
        "delivered"
    );
    assert_eq!(cluster.stored_count(&uaid).await, 0);

    // The 201 comes once the grace ended and the copy is written.
    sub.push_text("after").await;
    assert_eq!(cluster.stored_count(&uaid).await, 1);
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "after");
    ws.ack_notification(&n).await;
    autopush_tests::receipt::wait_until("the ack settles the written copy", async || {
        cluster.stored_count(&uaid).await == 0
    })
    .await;

    ws.close().await;
    let mut ws = cluster.b.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

/// A message below the client's minimum urgency reaches its node with the
/// copy held (the endpoint read the record before the client raised its
/// minimum): the session holds it back, so no ack will come, and its copy
/// is written at once rather than at the grace's end. Lowering the minimum
/// then finds it in storage. Without that, the copy waits out the grace
/// (a minute here) and lowering finds nothing: the message would wait for
/// the client's next connection.
async fn a_held_copy_below_the_minimum_is_delivered_when_the_minimum_is_lowered(db: Db) {
    let cluster = Cluster::holding_for(db, 60_000).await;
    let router_key = cluster.router_key.clone();
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;
    let answer = ws.set_min_urgency(serde_json::json!("high")).await;
    assert_eq!(answer["status"], 200, "{answer}");

    // What an endpoint that read the record just before the raise sends.
    let mut body = router_push(&sub, "held below the minimum").await;
    body["urgency"] = serde_json::json!("low");
    let (base, path) = (cluster.a.router_base(), format!("/push/{uaid}"));
    // The node answers once the copy is written; not waited for here.
    let call = tokio::spawn(async move {
        autopush_tests::http::signed_with(
            reqwest::Method::PUT,
            &base,
            &path,
            &router_key,
            Some(body.to_string().into_bytes()),
            &[("x-autopush-durable-copy", "hold")],
        )
        .await
    });
    autopush_tests::receipt::wait_until("the held-back copy is written", async || {
        cluster.stored_count(&uaid).await == 1
    })
    .await;

    let answer = ws.set_min_urgency(serde_json::json!("very-low")).await;
    assert_eq!(answer["status"], 200, "{answer}");
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "held below the minimum");
    ws.ack_notification(&n).await;
    ws.assert_nothing_arrives().await;
    call.abort();
}

/// `kill -9` of the connection node at random points of pushes whose
/// copies it holds (a grace of 100–400 ms, so kills land inside it, during
/// the node's write, or between pushes), round after round; the client
/// moves to the other node, then back. The model: every push answered 201
/// and not acked arrives after the move (none lost); one the client acked
/// may come again (the kill may take the ack with it) and is acked again,
/// as may one not answered 201. `HELD_CRASH_ROUNDS` (default 3) makes the
/// hunt longer, `HELD_CRASH_SEED` repeats one.
async fn kill9_of_the_holding_node_at_random_points_loses_nothing(db: Db) {
    kill9_at_random_points(db, false).await;
}

/// The same hunt with node A keeping copies in its own journal, each for a
/// window of 100–400 ms: A's copies answered 201 are on its disk alone
/// until they move, so A starts again (moving them) before the client
/// looks on node B.
async fn kill9_of_the_keeping_node_at_random_points_loses_nothing(db: Db) {
    kill9_at_random_points(db, true).await;
}

async fn kill9_at_random_points(db: Db, keeps: bool) {
    use autopush_tests::env_or;
    use std::collections::BTreeSet;
    let rounds = env_or("HELD_CRASH_ROUNDS", 3);
    let seed = env_or("HELD_CRASH_SEED", fastrand::u64(..));
    eprintln!("HELD_CRASH_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let grace = rng.u64(100..400);
    let mut cluster = match keeps {
        true => Cluster::keeping_for(db, grace).await,
        false => Cluster::holding_for(db, grace).await,
    };
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;
    // Answered 201 and not acked: must arrive.
    let mut owed = BTreeSet::new();
    // Acked, or not answered 201: may arrive (again).
    let mut may_come = BTreeSet::new();
    for round in 0..rounds {
        let texts: Vec<String> = (0..rng.usize(2..6))
            .map(|i| format!("round {round} push {i}"))
            .collect();
        let pushing = tokio::spawn({
            let (sub, texts) = (sub.clone(), texts.clone());
            async move {
                let mut answers = Vec::new();
                for text in texts {
                    let status = sub.send(&SendOptions::text(&text)).await.status;
                    answers.push((text, status));
                }
                answers
            }
        });
        // Take some on node A, acking some, then kill A somewhere.
        let mut taken = 0;
        let take = rng.usize(0..=texts.len());
        while taken < take {
            let (n, d) = sub.receive(&mut ws).await;
            if texts.contains(&d.text) {
                taken += 1;
                if rng.bool() {
                    ws.ack_notification(&n).await;
                    may_come.insert(d.text);
                }
            } else {
                assert!(
                    may_come.contains(&d.text),
                    "seed {seed}: {} unexpected",
                    d.text
                );
                ws.ack_notification(&n).await;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(rng.u64(0..grace))).await;
        cluster.a.kill9();
        drop(ws);
        for (text, status) in pushing.await.expect("the pushes") {
            if status == 201 && !may_come.contains(&text) {
                owed.insert(text);
            } else {
                may_come.insert(text);
            }
        }

        // Printed with the seed if a message never comes.
        eprintln!("round {round}: owed after the kill {owed:?}");
        if keeps {
            cluster.a.restart().await;
        }
        let mut on_b = cluster.b.reconnect(&uaid).await;
        while !owed.is_empty() {
            let (n, d) = sub.receive(&mut on_b).await;
            assert!(
                owed.contains(&d.text) || may_come.contains(&d.text),
                "seed {seed}, round {round}: {} unexpected",
                d.text
            );
            on_b.ack_notification(&n).await;
            owed.remove(&d.text);
            may_come.insert(d.text);
        }
        on_b.close().await;
        if !keeps {
            cluster.a.restart().await;
        }
        ws = cluster.a.reconnect(&uaid).await;
    }
}

/// With a journal of its own, node A answers the sender once the copy is
/// synced there, before the client acks, and the shared store sees no
/// write of it: the receipt reads `sent`, then `delivered` at the ack,
/// answered by A from its journal (with A down, the shared store knows
/// nothing more than the id's `sent`), before and after A restarts.
async fn a_kept_copy_is_answered_before_the_ack_and_never_written(db: Db) {
    let mut cluster = Cluster::keeping_for(db, 60_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    // The 201 comes while the client holds its ack back.
    let (sent, n) = tokio::join!(sub.push_text("kept"), ws.recv_notification());
    sent.assert_created();
    assert_eq!(sub.decrypt(&n).await.text, "kept");
    let location = autopush_tests::receipt::location(&sent);
    assert_eq!(autopush_tests::receipt::state_of(&location).await, "sent");
    assert_eq!(cluster.stored_count(&uaid).await, 0);

    ws.ack_notification(&n).await;
    autopush_tests::receipt::wait_until("the receipt reads delivered", async || {
        autopush_tests::receipt::state_of(&location).await == "delivered"
    })
    .await;
    assert_eq!(cluster.stored_count(&uaid).await, 0);
    ws.close().await;
    cluster.a.kill9();
    assert_eq!(autopush_tests::receipt::state_of(&location).await, "sent");
    cluster.a.restart().await;
    assert_eq!(
        autopush_tests::receipt::state_of(&location).await,
        "delivered"
    );
    let mut ws = cluster.b.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

/// The receipt of a kept copy acked after its 201 lives in A's journal for
/// the receipts' retention, then is gone: `GET /m/…` answers 404, not the
/// id's `sent`, once A says it no longer knows it.
async fn a_kept_copy_receipt_is_gone_after_its_retention(db: Db) {
    let cluster = Cluster::start(db, 10, Some(60_000), &["--receipt-retention", "1"], &[]).await;
    let (mut ws, _, sub) = cluster.subscribed_on_a().await;
    let (sent, n) = tokio::join!(sub.push_text("kept"), ws.recv_notification());
    let location = autopush_tests::receipt::location(&sent);
    assert_eq!(autopush_tests::receipt::state_of(&location).await, "sent");
    ws.ack_notification(&n).await;
    autopush_tests::receipt::wait_for_404(&location).await;
}

/// One journal, one node: a node started on the journal directory of a
/// running one refuses to start, and says why, rather than share it.
async fn a_second_node_on_a_journal_in_use_refuses_to_start(db: Db) {
    let (node, _) = backend::shared(db, &[]).await;
    let dir = tempfile::tempdir().expect("a journal directory");
    let journal = format!("--journal-dir={}", dir.path().display());
    let mut first = Node {
        role: "connection",
        ..node.clone()
    };
    first.args.push(journal.clone());
    let _running = Server::start_node(first).await;

    let mut args = vec![
        "connection".to_owned(),
        format!("--db={}", node.db.clone().unwrap_or_default()),
    ];
    args.extend(autopush_tests::server::port_flags());
    args.extend(node.args.iter().cloned());
    args.push(journal);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = node
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let out = autopush_tests::server::run_autopush_with_env(&args, &env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second node started: {stderr}");
    assert!(
        stderr.contains("is in use by another node: give each node a journal of its own"),
        "{stderr}"
    );
}

/// A copy its client does not ack within the window moves to the shared
/// store, and is not sent again meanwhile; the ack that comes after
/// settles it there.
async fn a_kept_copy_not_acked_within_the_window_moves_to_the_shared_store(db: Db) {
    let cluster = Cluster::keeping_for(db, 500).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    let (sent, n) = tokio::join!(sub.push_text("slow"), ws.recv_notification());
    sent.assert_created();
    autopush_tests::receipt::wait_until("the copy moves to the shared store", async || {
        cluster.stored_count(&uaid).await == 1
    })
    .await;
    // The session, told to look, passes over the message it has in flight.
    ws.assert_nothing_arrives().await;
    ws.ack_notification(&n).await;
    autopush_tests::receipt::wait_until("the ack settles the moved copy", async || {
        cluster.stored_count(&uaid).await == 0
    })
    .await;
    let location = autopush_tests::receipt::location(&sent);
    assert_eq!(
        autopush_tests::receipt::state_of(&location).await,
        "delivered"
    );
    ws.close().await;
    let mut ws = cluster.b.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

/// The endpoint gives up on a paused node A (its call times out) and
/// writes the copy itself; A, resumed, still offers the message and keeps
/// its own copy. When A's journal syncs before the ack, A's answer,
/// `kept`, finds no one: the copy the endpoint wrote is in the shared
/// store, and the ack must settle it there, or the next connection gets
/// the message again. A resumed also handles the endpoint's nudge, which
/// may deliver the stored copy first (a path without the race): rounds
/// make the racy one all but certain.
async fn a_kept_copy_whose_endpoint_gave_up_is_delivered_once(db: Db) {
    let cluster = Cluster::keeping_for(db, 60_000).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    for round in 0..4 {
        let text = format!("given up {round}");
        cluster.a.pause();
        sub.push_text(&text).await;
        assert_eq!(cluster.stored_count(&uaid).await, 1, "round {round}");
        cluster.a.resume();
        let n = ws.recv_notification().await;
        assert_eq!(sub.decrypt(&n).await.text, text);
        // Held back past A's journal sync (milliseconds).
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        ws.ack_notification(&n).await;
        let what = format!("round {round}: the ack settles the endpoint's copy");
        autopush_tests::receipt::wait_until(&what, async || cluster.stored_count(&uaid).await == 0)
            .await;
        // Nothing comes again, and A is idle before it is paused: a
        // storage call paused midway would time out at once on resuming.
        ws.assert_nothing_arrives().await;
    }
    cluster.nothing_comes_again(ws, &uaid).await;
}

/// Node A cut off from the endpoint past its calls' timeout (3 s), then
/// back, its client connected all along: the endpoint stores the push,
/// its nudge to A gets no answer either, and it asks A again until A
/// answers, so the message arrives without another push or reconnect.
async fn a_node_cut_off_gets_what_was_stored_meanwhile_when_it_is_back(db: Db) {
    let relay = CutOffRelay::start().await;
    let (cluster, a_router) = Cluster::keeping_behind(db, &relay).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;

    relay.cut();
    sub.push_text("while cut off").await;
    assert_eq!(cluster.stored_count(&uaid).await, 1);
    relay.forward_to(a_router);
    arrives_once(&mut ws, &sub, "while cut off").await;
    autopush_tests::receipt::wait_until("the ack settles the stored copy", async || {
        cluster.stored_count(&uaid).await == 0
    })
    .await;
}

/// Node A's answers lost on the way (a muted relay): the endpoint gives
/// up on each push after its timeout and writes the copy itself, though A
/// delivered the message and keeps its own copy. A, nudged, finds the
/// endpoint's copy in storage: settled there at the ack if the message is
/// still in flight, or at once if its client acked it already. Neither
/// comes again, on A or at the next connection.
async fn copies_an_endpoint_wrote_after_losing_the_answer_are_settled(db: Db) {
    let relay = CutOffRelay::start().await;
    let (cluster, a_router) = Cluster::keeping_behind(db, &relay).await;
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;
    relay.mute(a_router);

    // Acked after the 201: A's session found the copy meanwhile.
    let (sent, n) = tokio::join!(sub.push_text("in flight"), ws.recv_notification());
    sent.assert_created();
    assert_eq!(cluster.stored_count(&uaid).await, 1);
    ws.ack_notification(&n).await;
    autopush_tests::receipt::wait_until("the ack settles the endpoint's copy", async || {
        cluster.stored_count(&uaid).await == 0
    })
    .await;

    // Acked before the endpoint gave up: A's session finds the copy after.
    let (sent, ()) = tokio::join!(sub.push_text("acked"), async {
        let n = ws.recv_notification().await;
        ws.ack_notification(&n).await;
    });
    sent.assert_created();
    autopush_tests::receipt::wait_until("the endpoint's later copy is settled", async || {
        cluster.stored_count(&uaid).await == 0
    })
    .await;
    cluster.nothing_comes_again(ws, &uaid).await;
}

/// The client leaves node A without acking a kept message and comes back
/// on node B: A moves the copy when the session ends and has B look, so
/// the message arrives on B long before the window (a minute) ends.
async fn a_client_leaving_gets_its_kept_message_on_its_new_node(db: Db) {
    let cluster = Cluster::keeping_for(db, 60_000).await;
    let (ws, uaid, sub) = cluster.taken_unacked_on_a("left").await;
    ws.close().await;
    let mut on_b = cluster.b.reconnect(&uaid).await;
    arrives_once(&mut on_b, &sub, "left").await;
}

/// `kill -9` of node A while it keeps a copy answered 201 and not acked:
/// the copy is on A's disk alone. When A starts again it moves the copy
/// to the shared store, before it serves anyone, and has B, where the
/// client went meanwhile, look.
async fn a_keeping_node_killed_delivers_its_copies_when_it_starts_again(db: Db) {
    let mut cluster = Cluster::keeping_for(db, 60_000).await;
    let (ws, uaid, sub) = cluster.taken_unacked_on_a("on disk").await;
    cluster.a.kill9();
    drop(ws);
    let mut on_b = cluster.b.reconnect(&uaid).await;
    cluster.a.restart().await;
    arrives_once(&mut on_b, &sub, "on disk").await;
    assert_eq!(cluster.stored_count(&uaid).await, 0);
}

/// A keeping node stopped the way a service manager stops it (SIGTERM)
/// closes its sessions and moves the copies they leave unacked to the
/// shared store before it exits: the client gets them on node B while A
/// stays down.
async fn a_keeping_node_stopped_moves_its_copies_before_it_exits(db: Db) {
    let mut cluster = Cluster::keeping_for(db, 60_000).await;
    let (ws, uaid, sub) = cluster.taken_unacked_on_a("before the stop").await;
    assert!(cluster.a.terminate(), "node A exits on SIGTERM");
    drop(ws);
    let mut on_b = cluster.b.reconnect(&uaid).await;
    arrives_once(&mut on_b, &sub, "before the stop").await;
}

/// A node keeping copies answers a hold `kept` only to an endpoint of
/// router API 5 or later; an older one, which would write a kept copy
/// again, gets what it knows: the copy written after the grace.
async fn a_keeping_node_answers_an_older_endpoint_as_before(db: Db) {
    let cluster = Cluster::keeping_for(db, 60_000).await;
    let router_key = cluster.router_key.clone();
    let (mut ws, uaid, sub) = cluster.subscribed_on_a().await;
    for (version, fate, stored) in [("4", "written", 1), ("5", "kept", 1)] {
        let body = router_push(&sub, &format!("from version {version}")).await;
        let (base, path) = (cluster.a.router_base(), format!("/push/{uaid}"));
        let headers = [
            ("x-autopush-router-api", version),
            ("x-autopush-durable-copy", "hold"),
        ];
        let (answer, n) = tokio::join!(
            autopush_tests::http::signed_with(
                reqwest::Method::PUT,
                &base,
                &path,
                &router_key,
                Some(body.to_string().into_bytes()),
                &headers,
            ),
            ws.recv_notification()
        );
        assert_eq!(answer.status, 200, "version {version}: {answer:?}");
        assert_eq!(
            answer.header("x-autopush-durable-copy"),
            Some(fate),
            "version {version}"
        );
        // Version 4's copy stays written; version 5's is in A's journal.
        assert_eq!(
            cluster.stored_count(&uaid).await,
            stored,
            "version {version}"
        );
        drop(n);
    }
}

/// Each test on DynamoDB (moto) and on PostgreSQL.
macro_rules! on_holding_stores {
    ($($test:ident),* $(,)?) => {
        mod dynamodb {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Db::Dynamo).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Db::Postgres).await;
                }
            )*
        }
    };
}

/// The journal's tests on the Bigtable emulator too.
macro_rules! on_bigtable {
    ($($test:ident),* $(,)?) => {
        mod bigtable {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Db::Bigtable).await;
                }
            )*
        }
    };
}

on_holding_stores!(
    a_connection_node_killed_inside_the_grace_loses_nothing,
    an_endpoint_killed_while_the_node_holds_the_copy_loses_nothing,
    a_client_moving_inside_the_grace_gets_the_message_on_its_new_node,
    acks_inside_and_after_the_grace_settle_the_message_once,
    a_held_copy_below_the_minimum_is_delivered_when_the_minimum_is_lowered,
    kill9_of_the_holding_node_at_random_points_loses_nothing,
    a_kept_copy_is_answered_before_the_ack_and_never_written,
    a_kept_copy_receipt_is_gone_after_its_retention,
    a_second_node_on_a_journal_in_use_refuses_to_start,
    a_kept_copy_not_acked_within_the_window_moves_to_the_shared_store,
    a_client_leaving_gets_its_kept_message_on_its_new_node,
    a_keeping_node_killed_delivers_its_copies_when_it_starts_again,
    kill9_of_the_keeping_node_at_random_points_loses_nothing,
    a_keeping_node_answers_an_older_endpoint_as_before,
    a_keeping_node_stopped_moves_its_copies_before_it_exits,
    a_kept_copy_whose_endpoint_gave_up_is_delivered_once,
    a_node_cut_off_gets_what_was_stored_meanwhile_when_it_is_back,
    copies_an_endpoint_wrote_after_losing_the_answer_are_settled,
);

on_bigtable!(
    a_kept_copy_is_answered_before_the_ack_and_never_written,
    a_kept_copy_not_acked_within_the_window_moves_to_the_shared_store,
    a_client_leaving_gets_its_kept_message_on_its_new_node,
    a_keeping_node_killed_delivers_its_copies_when_it_starts_again,
    kill9_of_the_keeping_node_at_random_points_loses_nothing,
);
