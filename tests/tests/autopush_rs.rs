//! Mozilla's autopush-rs 1.83.1 and this service on one database: a
//! Bigtable table (the emulator), or a PostgreSQL schema with
//! `AUTOPUSH_RS_DB=postgres` (see `autopush_tests::autopush_rs`). Run by
//! `scripts/interop-autopush-rs` with the operator's own autopush-rs
//! binaries (`AUTOPUSH_RS_BIN_DIR`); ignored otherwise.
//!
//! Both ways: autopush-rs, ours, autopush-rs, ours, each taking over the
//! same table and the same endpoint host (a forwarder, as a load balancer
//! would be): stored messages delivered at each switch, the UAID kept,
//! endpoint URLs either side issued working on the other, nothing acked
//! delivered again. Mixed: both sides' connection and endpoint nodes at
//! once, every push reaching its client live, once.
//! A user row holding a wake route, a minimum urgency, the time of a
//! wake-up and of the last connection (cells of ours in its message
//! family, columns of ours on PostgreSQL) is read by autopush-rs as any
//! other, and autopush-rs serving the user keeps them.
//! Bigtable only: a row an older build of ours left (its cells in the router family):
//! autopush-rs's again after `autopush db move-legacy-cells`.

use autopush_tests::autopush_rs::{AutoConnect, AutoEndpoint, Db, Front, Shared, via};
use autopush_tests::google::Google;
use autopush_tests::server::{free_ports, run_autopush};
use autopush_tests::{SendOptions, Server, Subscription, WsClient, bigtable};
use serde_json::json;

/// A client's subscriptions, by channel, to decrypt what arrives.
struct Client {
    uaid: String,
    subs: Vec<Subscription>,
}

impl Client {
    /// Every notification arriving on `ws` until it is quiet, acked and
    /// decrypted: their texts, sorted (a duplicate shows twice).
    async fn texts(&self, ws: &mut WsClient) -> Vec<String> {
        let mut texts = Vec::new();
        while let Some(n) = ws.try_recv_for(autopush_tests::QUIET).await {
            if n["messageType"] != "notification" {
                continue;
            }
            ws.ack_notification(&n).await;
            let sub = self
                .subs
                .iter()
                .find(|s| n["channelID"] == s.channel_id.as_str())
                .unwrap_or_else(|| panic!("a notification for no subscription: {n}"));
            texts.push(sub.decrypt(&n).await.text);
        }
        texts.sort();
        texts
    }

    /// [`Client::texts`] on autopush-rs's connection node: on its
    /// PostgreSQL backend, autopush-rs itself delivers a stored message
    /// twice when its client's backlog spans more than one second
    /// (`postgres_only_autopush_rs_alone_delivers_a_backlog_spanning_seconds_twice`),
    /// so there each text counts once; a text that should not come at all
    /// still fails the scenario.
    async fn texts_from_autopush_rs(&self, ws: &mut WsClient, shared: &Shared) -> Vec<String> {
        let mut texts = self.texts(ws).await;
        if let Db::Postgres(_) = shared.db {
            texts.dedup();
        }
        texts
    }

    /// Say hello at `ws_url` as this client; the UAID must be kept.
    async fn hello(&self, ws_url: &str) -> WsClient {
        let ws = hello(ws_url, Some(&self.uaid)).await;
        assert_eq!(ws.uaid(), self.uaid, "the UAID was not kept");
        ws
    }
}

/// Connect to `ws_url` and say hello (`uaid` None: a new user agent).
/// Without offering the subprotocol: autopush-rs does not echo it.
async fn hello(ws_url: &str, uaid: Option<&str>) -> WsClient {
    let mut ws = WsClient::connect_without_subprotocol(ws_url).await;
    let reply = ws.hello(uaid).await;
    assert_eq!(reply["status"], 200, "hello at {ws_url}: {reply}");
    ws
}

/// Send `text` to `sub` (signed when it has a VAPID key) through the
/// endpoint at `base`.
async fn push(sub: &Subscription, base: &str, text: &str, topic: Option<&str>) {
    let mut options = SendOptions::text(text);
    if let Some(key) = &sub.vapid {
        options = options.vapid(key);
    }
    if let Some(topic) = topic {
        options = options.topic(topic);
    }
    let sent = autopush_tests::py::send(&via(&sub.endpoint, base), &sub.keys, &options).await;
    assert_eq!(sent.status, 201, "push {text:?} via {base}: {}", sent.body);
}

/// A settings file with FCM app `app1` on `google`, in `dir`.
fn fcm_app(google: &Google, dir: &tempfile::TempDir) -> String {
    let key_file = google.write_service_account(dir.path(), "service-account.json");
    let config = dir.path().join("autopush.toml");
    let toml = format!(
        "[fcm.apps.app1]\nproject_id = \"autopush-test\"\ncredential = \"{}\"\nbase_url = \"{}\"\n",
        key_file.display(),
        google.base_url()
    );
    std::fs::write(&config, toml).expect("write the settings file");
    config.display().to_string()
}

fn sorted(texts: &[&str]) -> Vec<String> {
    let mut texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
    texts.sort();
    texts
}

/// autopush-rs's two services, its endpoint URLs on `front`.
struct Theirs {
    connect: AutoConnect,
    _endpoint: AutoEndpoint,
}

impl Theirs {
    async fn start(shared: &Shared, front: &Front) -> Theirs {
        let [port] = free_ports::<1>();
        let endpoint = AutoEndpoint::start(shared, port, &front.base).await;
        front.to(&endpoint.base());
        let connect = AutoConnect::start(shared, &front.base).await;
        Theirs {
            connect,
            _endpoint: endpoint,
        }
    }
}

/// Ours, all in one, its endpoint URLs on `front`.
async fn ours(shared: &Shared, front: &Front) -> Server {
    let node = shared.ours("all", Some(&front.base), &[]).await;
    front.to(&node.endpoint_base());
    node
}

/// autopush-rs, then ours, then autopush-rs, then ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs autopush-rs binaries: scripts/interop-autopush-rs"]
async fn both_ways_autopush_rs_ours_autopush_rs_ours() {
    let shared = Shared::new().await;
    let front = Front::start().await;

    // autopush-rs: a client subscribes (a /v1 and a VAPID /v2 URL) and
    // leaves; three messages wait for it, one with a Topic.
    let theirs = Theirs::start(&shared, &front).await;
    let mut ws = hello(&theirs.connect.ws_url(), None).await;
    let mut client = Client {
        uaid: ws.uaid().to_owned(),
        subs: vec![
            Subscription::new(&mut ws).await,
            Subscription::with_vapid(&mut ws).await,
        ],
    };
    ws.close().await;
    let (rs1, rs2) = (client.subs[0].clone(), client.subs[1].clone());
    push(&rs1, &front.base, "1", None).await;
    push(&rs2, &front.base, "2", Some("news")).await;
    push(&rs1, &front.base, "3", None).await;
    drop(theirs);

    // Ours: the client is back with its UAID and gets the three; a URL of
    // ours and one of theirs take pushes, live and stored. It registers a
    // wake route and a minimum urgency, and the stored pushes send it a
    // wake-up: the user row holds the route, the minimum and the time of
    // the wake-up when autopush-rs reads it.
    let google = Google::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let fcm = fcm_app(&google, &dir);
    let node = shared
        .ours("all", Some(&front.base), &["--config", &fcm])
        .await;
    front.to(&node.endpoint_base());
    let mut ws = client.hello(&node.ws_url()).await;
    assert_eq!(client.texts(&mut ws).await, sorted(&["1", "2", "3"]));
    client.subs.push(Subscription::new(&mut ws).await);
    let our3 = client.subs[2].clone();
    push(&rs1, &front.base, "4", None).await;
    assert_eq!(client.texts(&mut ws).await, sorted(&["4"]));
    ws.send_json(
        json!({"messageType": "wake", "router": "fcm", "app_id": "app1", "token": "wake:token"}),
    )
    .await;
    assert_eq!(ws.recv_type("wake").await["status"], 200);
    assert_eq!(ws.set_min_urgency(json!("low")).await["status"], 200);
    ws.close().await;
    push(&our3, &front.base, "5", None).await;
    push(&rs2, &front.base, "6", None).await;
    google.wait_for("wake:token", 1).await;
    drop(node);
    let uaid = uuid::Uuid::parse_str(&client.uaid).expect("a UAID");
    let ours_left = shared.store().await.get_user(&uaid).await.unwrap();
    let ours_left = ours_left.expect("the user row");
    assert!(ours_left.wake_route.is_some() && ours_left.last_wake > 0);

    // autopush-rs again: it reads the user and messages we wrote.
    let theirs = Theirs::start(&shared, &front).await;
    let mut ws = client.hello(&theirs.connect.ws_url()).await;
    assert_eq!(
        client.texts_from_autopush_rs(&mut ws, &shared).await,
        sorted(&["5", "6"])
    );
    push(&our3, &front.base, "7", None).await;
    assert_eq!(
        client.texts_from_autopush_rs(&mut ws, &shared).await,
        sorted(&["7"])
    );
    ws.close().await;
    push(&rs1, &front.base, "8", Some("later")).await;
    push(&rs2, &front.base, "9", None).await;
    let mut ws = client.hello(&theirs.connect.ws_url()).await;
    assert_eq!(
        client.texts_from_autopush_rs(&mut ws, &shared).await,
        sorted(&["8", "9"])
    );
    ws.close().await;
    push(&our3, &front.base, "10", None).await;
    drop(theirs);
    let theirs_left = shared.store().await.get_user(&uaid).await.unwrap();
    let theirs_left = theirs_left.expect("the user row");
    assert_eq!(
        (
            &theirs_left.wake_route,
            theirs_left.min_urgency,
            theirs_left.last_wake,
            theirs_left.last_connect
        ),
        (
            &ours_left.wake_route,
            ours_left.min_urgency,
            ours_left.last_wake,
            ours_left.last_connect
        ),
        "our state in the user row after autopush-rs served it"
    );

    // Ours again: only what autopush-rs did not deliver.
    let node = ours(&shared, &front).await;
    let mut ws = client.hello(&node.ws_url()).await;
    assert_eq!(client.texts(&mut ws).await, sorted(&["10"]));
    ws.close().await;
    let mut ws = client.hello(&node.ws_url()).await;
    assert!(client.texts(&mut ws).await.is_empty(), "delivered again");
}

/// Both sides' nodes at once (a rolling switch): a client on autopush-rs's
/// connection node and one on ours; a push through either side's endpoint
/// reaches either client live, once, and nothing comes again when they
/// reconnect, on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs autopush-rs binaries: scripts/interop-autopush-rs"]
async fn mixed_fleet_every_endpoint_reaches_every_node_once() {
    let shared = Shared::new().await;
    let rs_endpoint = AutoEndpoint::start_own(&shared).await;
    let rs_base = rs_endpoint.base();
    let rs_connect = AutoConnect::start(&shared, &rs_base).await;
    // A declared migration: autopush-rs's nodes are known by their address.
    let our_endpoint = shared
        .ours("endpoint", None, &["--autopush-rs-nodes=127.0.0.1"])
        .await;
    let our_base = our_endpoint.endpoint_base();
    let our_connect = shared
        .ours(
            "connection",
            Some(&our_base),
            &["--unsigned-node-calls-from=127.0.0.1"],
        )
        .await;

    let mut on_rs = hello(&rs_connect.ws_url(), None).await;
    let x = Client {
        uaid: on_rs.uaid().to_owned(),
        subs: vec![Subscription::new(&mut on_rs).await],
    };
    let mut on_ours = hello(&our_connect.ws_url(), None).await;
    let y = Client {
        uaid: on_ours.uaid().to_owned(),
        subs: vec![Subscription::new(&mut on_ours).await],
    };
    for (side, base) in [("theirs", &rs_endpoint.base()), ("ours", &our_base)] {
        let text = format!("{side} to autopush-rs's node");
        push(&x.subs[0], base, &text, None).await;
        assert_eq!(x.texts(&mut on_rs).await, [text]);
        let text = format!("{side} to our node");
        push(&y.subs[0], base, &text, None).await;
        assert_eq!(y.texts(&mut on_ours).await, [text]);
    }
    on_rs.close().await;
    on_ours.close().await;
    for ws_url in [rs_connect.ws_url(), our_connect.ws_url()] {
        for client in [&x, &y] {
            let mut ws = client.hello(&ws_url).await;
            assert!(client.texts(&mut ws).await.is_empty(), "delivered again");
            ws.close().await;
        }
    }
    // Taken unsigned: said at start-up, and counted.
    assert!(
        our_connect.stderr().contains("MIGRATION"),
        "no start-up warning"
    );
    let metrics =
        autopush_tests::http::get(&format!("{}/metrics", our_connect.router_base())).await;
    assert!(metrics.text.contains("node_unsigned_call"), "not counted");
}

/// Without `--unsigned-node-calls-from`, autopush-rs's unsigned call to our
/// node is refused: its push is stored, not lost, and arrives at the
/// client's next hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs autopush-rs binaries: scripts/interop-autopush-rs"]
async fn mixed_fleet_without_the_setting_stores_instead() {
    let shared = Shared::new().await;
    let rs_endpoint = AutoEndpoint::start_own(&shared).await;
    let rs_base = rs_endpoint.base();
    let our_connect = shared.ours("connection", Some(&rs_base), &[]).await;
    let mut ws = hello(&our_connect.ws_url(), None).await;
    let y = Client {
        uaid: ws.uaid().to_owned(),
        subs: vec![Subscription::new(&mut ws).await],
    };
    push(&y.subs[0], &rs_endpoint.base(), "unsigned", None).await;
    assert!(
        y.texts(&mut ws).await.is_empty(),
        "an unsigned call was taken"
    );
    ws.close().await;
    let mut ws = y.hello(&our_connect.ws_url()).await;
    assert_eq!(y.texts(&mut ws).await, ["unsigned"]);
}

/// autopush-rs alone on its PostgreSQL backend: two messages stored in
/// different seconds, and its client gets the second twice. Its first
/// read of a backlog is unordered; once the client acked it, it moves the
/// user's `last_update` to the first message's `timestamp` (seconds) and
/// reads again from there, finding the second message again. The control
/// for [`Client::texts_from_autopush_rs`]: nothing of ours runs here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs autopush-rs binaries: scripts/interop-autopush-rs --db postgres"]
async fn postgres_only_autopush_rs_alone_delivers_a_backlog_spanning_seconds_twice() {
    let shared = Shared::new().await;
    assert!(
        matches!(shared.db, Db::Postgres(_)),
        "AUTOPUSH_RS_DB=postgres"
    );
    let front = Front::start().await;
    let theirs = Theirs::start(&shared, &front).await;
    let mut ws = hello(&theirs.connect.ws_url(), None).await;
    let client = Client {
        uaid: ws.uaid().to_owned(),
        subs: vec![Subscription::new(&mut ws).await],
    };
    ws.close().await;
    push(&client.subs[0], &front.base, "a", None).await;
    // The next second: messages' `timestamp` counts seconds.
    let second = autopush_common::time::now_secs();
    while autopush_common::time::now_secs() == second {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    push(&client.subs[0], &front.base, "b", None).await;
    let mut ws = client.hello(&theirs.connect.ws_url()).await;
    assert_eq!(
        client.texts(&mut ws).await,
        sorted(&["a", "b", "b"]),
        "autopush-rs no longer delivers twice: drop texts_from_autopush_rs's allowance"
    );
}

/// Put user `uaid`'s cells of ours back where builds before 8bfba7c wrote
/// them: the router family, which autopush-rs's `get_user` takes for
/// channels.
async fn to_old_layout(shared: &Shared, uaid: &str) {
    use autopush_storage::bigtable::{BigtableStore, row};
    use autopush_tests::bigtable::{cell, write_row};
    let autopush_tests::autopush_rs::Db::Bigtable(table) = &shared.db else {
        panic!("a Bigtable layout");
    };
    let store = BigtableStore::connect(bigtable::local().await.settings(table))
        .await
        .unwrap();
    let uaid = uuid::Uuid::parse_str(uaid).unwrap();
    let read = store.read_legacy_cells(&uaid).await.unwrap().unwrap();
    let (last_connect, stamp) = read.get_stamped("message", "last_connect").unwrap();
    let stamp_ms = u64::try_from(stamp / 1000).unwrap();
    let mutations = vec![
        row::delete_column("message", b"last_connect"),
        row::delete_column("message", b"over_msg_limit"),
        cell("router", "last_connect", last_connect.to_vec(), stamp_ms),
        cell("router", "over_msg_limit", vec![1], stamp_ms),
    ];
    write_row(&store, uaid.simple().to_string(), mutations).await;
}

/// A user an older build of ours left with its cells in the router
/// family: autopush-rs's endpoint fails its pushes until `autopush db
/// move-legacy-cells` has run; then a push through it is stored and
/// autopush-rs's connection node accepts the user's hello, keeps its UAID
/// and delivers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs autopush-rs binaries: scripts/interop-autopush-rs"]
async fn old_layout_rows_read_by_autopush_rs_after_move_legacy_cells() {
    let shared = Shared::new().await;
    let front = Front::start().await;
    let node = ours(&shared, &front).await;
    let mut ws = hello(&node.ws_url(), None).await;
    let client = Client {
        uaid: ws.uaid().to_owned(),
        subs: vec![Subscription::new(&mut ws).await],
    };
    ws.close().await;
    drop(node);
    to_old_layout(&shared, &client.uaid).await;

    let theirs = Theirs::start(&shared, &front).await;
    let sub = &client.subs[0];
    let refused = autopush_tests::py::send(
        &via(&sub.endpoint, &front.base),
        &sub.keys,
        &SendOptions::text("before"),
    )
    .await;
    assert_ne!(
        refused.status, 201,
        "autopush-rs took a push for an old-layout row: the scenario proves nothing"
    );

    let dsn = shared.dsn().await;
    let settings = shared.db_settings();
    let out = run_autopush(&[
        "db",
        "move-legacy-cells",
        "--db",
        &dsn,
        "--db-settings",
        &settings,
    ])
    .await;
    let said = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}{stderr}");
    assert!(said.contains("family in 1 rows"), "{said}");

    push(sub, &front.base, "after", None).await;
    let mut ws = client.hello(&theirs.connect.ws_url()).await;
    assert_eq!(client.texts(&mut ws).await, ["after"]);
}
