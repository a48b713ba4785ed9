//! A Bigtable `--db` end to end, on Google's emulator (not Google Cloud):
//! the `db` subcommands, rows laid out by autopush-rs delivered by our
//! node, our rows in the shape autopush-rs reads, split mode with two
//! connection nodes and an endpoint node, and an outage.

use std::collections::{BTreeMap, HashMap};

use autopush_common::time::{now_millis, now_secs};
use autopush_storage::Storage;
use autopush_storage::bigtable::{BigtableStore, proto};
use autopush_tests::server::run_autopush;
use autopush_tests::{Node, SendOptions, Server, Subscription, WsClient, bigtable, scenarios};
use uuid::Uuid;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `autopush ARGS --db DSN --db-settings {table_name}` on the emulator.
async fn db_command(table: &str, args: &[&str]) -> std::process::Output {
    let dsn = bigtable::local().await.dsn();
    let settings = bigtable::db_settings(table);
    let mut all = args.to_vec();
    all.extend(["--db", &dsn, "--db-settings", &settings]);
    run_autopush(&all).await
}

#[tokio::test]
async fn db_commands_create_and_check_the_table() {
    let table = bigtable::table_name();
    let out = db_command(&table, &["db", "preflight"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stdout).contains(&format!("missing: table {table}")),
        "{}",
        text(&out.stdout)
    );

    let out = db_command(&table, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("with families router, message, message_topic"),
        "{}",
        text(&out.stdout)
    );
    // Again: nothing to do.
    let out = db_command(&table, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("exists"),
        "{}",
        text(&out.stdout)
    );

    let out = db_command(&table, &["db", "preflight"]).await;
    assert!(out.status.success(), "{}", text(&out.stdout));
    let said = text(&out.stdout);
    assert!(said.starts_with("ready:"), "{said}");
    // The GC policies are autopush-rs's: nothing to note.
    assert!(!said.contains("note:"), "{said}");

    let out = db_command(&table, &["db", "drop-old-users", "--months", "2"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--db dynamodb"),
        "{}",
        text(&out.stderr)
    );
}

/// What every node of one cluster shares: the table and fresh keys.
async fn shared_args(table: &str) -> Vec<String> {
    let mut args = vec![format!("--db-settings={}", bigtable::db_settings(table))];
    args.extend(scenarios::cluster_keys().await);
    args
}

/// Nodes of a role on the Bigtable at `host` (`HOST:PORT`), with `args`.
fn node_on(host: &str, args: Vec<String>) -> impl Fn(&'static str) -> Node {
    let dsn = format!("grpc://{host}");
    move |role| Node {
        role,
        db: Some(dsn.clone()),
        args: args.clone(),
        ..Node::default()
    }
}

/// `shared_args` for a node sharing the table with autopush-rs: the
/// defaults, which keep receipts off on Bigtable (autopush-rs cannot read a
/// receipt row; with them on, the delivery test below fails).
async fn beside_autopush_rs(table: &str) -> Vec<String> {
    shared_args(table).await
}

/// A fresh, created table on the shared emulator; a store on it.
async fn fresh_table() -> (String, BigtableStore) {
    let table = bigtable::table_name();
    let out = db_command(&table, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let store = BigtableStore::connect(bigtable::local().await.settings(&table))
        .await
        .unwrap();
    (table, store)
}

// ---- interop with autopush-rs's layout ----------------------------------

/// A cell as autopush-rs writes one: its timestamp in milliseconds (as
/// microseconds), the value as given.
fn cell(family: &str, qualifier: &str, value: Vec<u8>, stamp_ms: u64) -> proto::Mutation {
    proto::Mutation {
        mutation: Some(proto::mutation::Mutation::SetCell(
            proto::mutation::SetCell {
                family_name: family.into(),
                column_qualifier: qualifier.as_bytes().to_vec(),
                timestamp_micros: (stamp_ms * 1000) as i64,
                value,
            },
        )),
    }
}

async fn write_row(store: &BigtableStore, key: String, mutations: Vec<proto::Mutation>) {
    let settings = store.settings();
    store
        .connection()
        .mutate_row(proto::MutateRowRequest {
            table_name: settings.table_name.clone(),
            app_profile_id: settings.app_profile_id.clone(),
            row_key: key.into_bytes(),
            mutations,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// A stored message as autopush-rs's `save_message` lays it out: row
/// `{uaid}#{chidmessageid}`, family by topic, `ttl`/`timestamp` 8 bytes
/// big-endian, `version`/`data` UTF-8, `headers` JSON, every cell stamped
/// with now + ttl.
#[allow(clippy::too_many_arguments)]
async fn save_like_autopush_rs(
    store: &BigtableStore,
    uaid: &Uuid,
    chidmessageid: &str,
    topic: bool,
    version: &str,
    timestamp: u64,
    ttl: u64,
    data: &str,
) {
    let family = if topic { "message_topic" } else { "message" };
    let expiry_ms = (timestamp + ttl) * 1000;
    let headers = serde_json::json!({"encoding": "aes128gcm"}).to_string();
    write_row(
        store,
        format!("{}#{chidmessageid}", uaid.simple()),
        vec![
            cell(family, "ttl", ttl.to_be_bytes().to_vec(), expiry_ms),
            cell(
                family,
                "timestamp",
                timestamp.to_be_bytes().to_vec(),
                expiry_ms,
            ),
            cell(family, "version", version.as_bytes().to_vec(), expiry_ms),
            cell(family, "headers", headers.into_bytes(), expiry_ms),
            cell(family, "data", data.as_bytes().to_vec(), expiry_ms),
        ],
    )
    .await;
}

/// A user with two channels and four stored messages, written the way
/// autopush-rs's code lays them out (none of our row code): a Topic
/// message, a timestamp message autopush-rs already delivered (at or
/// before the user's `current_timestamp`), one after it, and an expired
/// one. A client coming back to our node gets exactly the two it is owed,
/// Topic first, and its acks delete them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_by_autopush_rs_are_delivered() {
    let (table, store) = fresh_table().await;
    let uaid = Uuid::new_v4();
    let (chid1, chid2) = (Uuid::new_v4(), Uuid::new_v4());
    let now_ms = now_millis();
    let router_stamp = now_ms + 60 * 86_400 * 1000;
    let current_timestamp = now_ms - 10_000;
    let router = |q: &str, v: Vec<u8>| cell("router", q, v, router_stamp);
    write_row(
        &store,
        uaid.simple().to_string(),
        vec![
            router("connected_at", (now_ms - 60_000).to_be_bytes().to_vec()),
            router("router_type", b"webpush".to_vec()),
            router("record_version", 1u64.to_be_bytes().to_vec()),
            router("version", Uuid::new_v4().as_bytes().to_vec()),
            router("node_id", b"http://10.9.9.9:8081".to_vec()),
            router(
                "current_timestamp",
                current_timestamp.to_be_bytes().to_vec(),
            ),
            router(&format!("chid:{}", chid1.hyphenated()), Vec::new()),
            router(&format!("chid:{}", chid2.hyphenated()), Vec::new()),
        ],
    )
    .await;
    let now = now_secs();
    let (c1, c2) = (chid1.hyphenated(), chid2.hyphenated());
    save_like_autopush_rs(
        &store,
        &uaid,
        &format!("01:{c1}:news"),
        true,
        "vtopic",
        now,
        600,
        "dG9waWM",
    )
    .await;
    let delivered = current_timestamp - 5_000;
    save_like_autopush_rs(
        &store,
        &uaid,
        &format!("02:{delivered}:{c2}"),
        false,
        "vold",
        now,
        600,
        "b2xk",
    )
    .await;
    let owed = current_timestamp + 5_000;
    save_like_autopush_rs(
        &store,
        &uaid,
        &format!("02:{owed}:{c2}"),
        false,
        "vnew",
        now,
        600,
        "bmV3",
    )
    .await;
    let later = current_timestamp + 6_000;
    save_like_autopush_rs(
        &store,
        &uaid,
        &format!("02:{later}:{c1}"),
        false,
        "vexpired",
        now - 120,
        60,
        "ZXhwaXJlZA",
    )
    .await;

    let args = beside_autopush_rs(&table).await;
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    let mut ws = node.reconnect(&uaid.simple().to_string()).await;
    let got = ws.recv_notifications(2).await;
    let shown: Vec<_> = got
        .iter()
        .map(|n| {
            (
                n["channelID"].as_str().unwrap().to_owned(),
                n["version"].as_str().unwrap().to_owned(),
                n["data"].as_str().unwrap().to_owned(),
                n["headers"]["encoding"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            (
                c1.to_string(),
                "vtopic".into(),
                "dG9waWM".into(),
                "aes128gcm".into()
            ),
            (
                c2.to_string(),
                "vnew".into(),
                "bmV3".into(),
                "aes128gcm".into()
            ),
        ]
    );
    for n in &got {
        ws.ack_notification(n).await;
    }
    ws.assert_nothing_arrives().await;
    ws.close().await;

    // The acks deleted both (the timestamp one under autopush-rs's
    // unpadded key); the user kept its channels and now names our node.
    assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    assert!(
        raw_row(&store, &format!("{}#02:{owed}:{c2}", uaid.simple()))
            .await
            .is_none()
    );
    assert_eq!(
        store.get_channels(&uaid).await.unwrap(),
        [chid1, chid2].into_iter().collect()
    );
    let user = store.get_user(&uaid).await.unwrap().unwrap();
    assert_eq!(user.node_id.as_deref(), Some(node.router_base().as_str()));
    let mut ws = node.reconnect(&uaid.simple().to_string()).await;
    ws.assert_nothing_arrives().await;
}

/// Every cell of row `key`, newest per column, by `family:qualifier`.
async fn raw_row(store: &BigtableStore, key: &str) -> Option<HashMap<String, Vec<u8>>> {
    let settings = store.settings();
    let rows = store
        .connection()
        .read_rows(proto::ReadRowsRequest {
            table_name: settings.table_name.clone(),
            app_profile_id: settings.app_profile_id.clone(),
            rows: Some(proto::RowSet {
                row_keys: vec![key.as_bytes().to_vec()],
                row_ranges: Vec::new(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    rows.into_iter().next().map(|row| {
        row.cells
            .into_iter()
            .map(|((f, q), v)| (format!("{f}:{}", text(&q)), v))
            .collect()
    })
}

/// What our node writes has every cell autopush-rs requires, in its
/// encodings: the user row (`connected_at`, `router_type`, `record_version`,
/// `version`, checked by its `get_user`), the channel cells, and a stored
/// message under a key its `parse_chidmessageid` accepts, with `ttl`,
/// `timestamp` and `version` (its `row_to_notification`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_rows_are_in_autopush_rs_shape() {
    let (table, store) = fresh_table().await;
    let args = beside_autopush_rs(&table).await;
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    let (uaid, sub) = node.offline_subscription(false).await;
    sub.push_text("stored").await;

    let user = raw_row(&store, &uaid).await.expect("the user row");
    assert_eq!(user["router:connected_at"].len(), 8);
    assert_eq!(user["router:router_type"], b"webpush");
    assert_eq!(user["router:record_version"], 1u64.to_be_bytes());
    assert_eq!(user["router:version"].len(), 16);
    assert_eq!(user[&format!("router:chid:{}", sub.channel_id)], b"");

    let uaid = Uuid::parse_str(&uaid).unwrap();
    let stored = store.fetch_messages(&uaid, 10).await.unwrap();
    assert_eq!(stored.len(), 1);
    let ts = stored[0].sortkey_timestamp.unwrap();
    let key = format!("{}#02:{ts}:{}", uaid.simple(), sub.channel_id);
    let message = raw_row(&store, &key)
        .await
        .expect("the message row, unpadded");
    assert_eq!(message["message:ttl"], stored[0].ttl.to_be_bytes());
    assert_eq!(
        message["message:timestamp"],
        stored[0].timestamp.to_be_bytes()
    );
    assert_eq!(message["message:version"], stored[0].version.as_bytes());
    assert!(message.contains_key("message:data"));
}

// ---- several nodes --------------------------------------------------------

/// Split mode on one table: an endpoint node and two connection nodes.
struct Cluster {
    endpoint: Server,
    a: Server,
    b: Server,
}

impl Cluster {
    async fn start_on(host: &str, table: &str) -> Cluster {
        let node = node_on(host, shared_args(table).await);
        let endpoint = Server::start_node(node("endpoint")).await;
        let connection = || Node {
            endpoint_url: Some(endpoint.endpoint_base()),
            ..node("connection")
        };
        let a = Server::start_node(connection()).await;
        let b = Server::start_node(connection()).await;
        Cluster { endpoint, a, b }
    }
}

/// The DynamoDB suite's scenario on Bigtable: a client moving between
/// connection nodes, pushes racing its moves, nothing lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_move_between_connection_nodes_without_loss_or_duplicates() {
    let (table, _) = fresh_table().await;
    let cluster = Cluster::start_on(&bigtable::local().await.host, &table).await;
    scenarios::clients_move_between_nodes(&cluster.endpoint, &cluster.a, &cluster.b).await;
}

/// Bigtable unreachable: senders get 503 errno 201 with Retry-After,
/// clients saying hello a 503 and a 1013 close; when it is back, what was
/// accepted before arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_503_and_1013_and_nothing_accepted_is_lost() {
    let (table, _) = fresh_table().await;
    let outage = bigtable::Outage::start(&bigtable::local().await.host).await;
    let node = Server::start_node(node_on(&outage.host, shared_args(&table).await)("all")).await;
    let (uaid, sub) = node.offline_subscription(false).await;
    sub.push_text("before").await;

    outage.begin();
    let refused = sub.send(&SendOptions::text("refused")).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["errno"], 201, "{}", refused.body);
    // Backend detail stays in the log.
    assert!(
        !refused.body.contains("Bigtable") && !refused.body.contains(&outage.host),
        "{}",
        refused.body
    );
    assert!(
        refused.headers.contains_key("retry-after"),
        "{:?}",
        refused.headers
    );
    let mut ws = WsClient::connect(&node.ws_url()).await;
    let reply = ws.hello(Some(&uaid)).await;
    assert_eq!(reply["status"], 503, "{reply}");
    assert_eq!(ws.expect_closed().await.code, Some(1013));

    outage.end();
    // As a client told 1013 does: try again until the node answers.
    let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
    let mut ws = loop {
        let mut ws = WsClient::connect(&node.ws_url()).await;
        if ws.hello(Some(&uaid)).await["status"] == 200 {
            break ws;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "hello still refused after the outage ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "before");
    ws.ack_notification(&n).await;
    ws.assert_nothing_arrives().await;
}

/// The Bigtable requests a node sends, by RPC, from its `storage.request`
/// counter (each attempt counted).
async fn requests(metrics: &str) -> BTreeMap<String, usize> {
    let text = reqwest::get(format!("{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let scrape = autopush_tests::prometheus::Scrape::parse(&text);
    scrape
        .series("storage_request")
        .map(|(labels, value)| (labels["rpc"].clone(), value as usize))
        .collect()
}

fn minus(
    after: &BTreeMap<String, usize>,
    before: &BTreeMap<String, usize>,
) -> BTreeMap<String, usize> {
    after
        .iter()
        .map(|(rpc, n)| (rpc.clone(), n - before.get(rpc).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// What a Bigtable bill is made of: requests per delivered message, direct,
/// stored and drained, with receipts off and on (BENCHMARKS.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_delivered_message() {
    let off = requests_per_message(&["--receipt-retention=0"]).await;
    let on = requests_per_message(&["--receipt-retention=86400"]).await;
    autopush_tests::receipt::assert_receipts_cost_no_request(&off, &on);
}

/// The Bigtable requests of 10 messages delivered directly (push + ack),
/// 10 stored (push) and those 10 drained (hello + deliver + ack), by RPC,
/// on a node started with `extra` arguments.
async fn requests_per_message(extra: &[&str]) -> autopush_tests::receipt::PathRequests {
    let (table, _) = fresh_table().await;
    let [metrics_port] = autopush_tests::server::free_ports::<1>();
    let mut args = shared_args(&table).await;
    args.push(format!("--metrics-port={metrics_port}"));
    args.extend(extra.iter().map(|a| a.to_string()));
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    let metrics = format!("http://127.0.0.1:{metrics_port}");
    let mut ws = node.client().await;
    let sub = Subscription::new(&mut ws).await;

    let count = 10;
    let start = requests(&metrics).await;
    for i in 0..count {
        sub.push_text(&format!("direct {i}")).await;
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    // The session handles the close after the last ack (and its delete).
    tokio::time::sleep(autopush_tests::QUIET).await;
    let after_direct = requests(&metrics).await;
    for i in 0..count {
        sub.push_text(&format!("stored {i}")).await;
    }
    let after_stored = requests(&metrics).await;
    let mut ws = node.reconnect(&uaid).await;
    for _ in 0..count {
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    ws.close().await;
    tokio::time::sleep(autopush_tests::QUIET).await;
    let after_drain = requests(&metrics).await;
    let direct = minus(&after_direct, &start);
    let stored = minus(&after_stored, &after_direct);
    let drained = minus(&after_drain, &after_stored);
    eprintln!(
        "Bigtable requests for {count} messages ({extra:?}):\n  direct (push + ack): {direct:?}\n  \
         stored (push): {stored:?}\n  drained (hello + deliver + ack): {drained:?}"
    );
    let total = |ops: &BTreeMap<String, usize>| ops.values().sum::<usize>();
    assert!(total(&direct) <= 5 * count, "{direct:?}");
    assert!(total(&stored) <= 4 * count + 1, "{stored:?}");
    assert!(total(&drained) <= 2 * count + 10, "{drained:?}");
    [direct, stored, drained]
}
