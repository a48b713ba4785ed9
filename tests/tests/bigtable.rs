//! A Bigtable `--db` end to end, on Google's emulator (not Google Cloud):
//! the `db` subcommands, rows laid out by autopush-rs delivered by our
//! node, our rows in the shape autopush-rs reads, split mode with two
//! connection nodes and an endpoint node, and an outage.

use std::collections::{BTreeMap, HashMap};

use autopush_common::time::{now_millis, now_secs};
use autopush_common::{RouterType, Urgency, User, WakeRoute};
use autopush_storage::Storage;
use autopush_storage::bigtable::{BigtableStore, proto, row};
use autopush_tests::bigtable::{cell, write_row};
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

/// The rows of `rows` (`None`: the whole table), every cell as read.
async fn read(store: &BigtableStore, rows: Option<proto::RowSet>) -> Vec<row::Row> {
    let settings = store.settings();
    store
        .connection()
        .read_rows(proto::ReadRowsRequest {
            table_name: settings.table_name.clone(),
            app_profile_id: settings.app_profile_id.clone(),
            rows,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Every cell of row `key`, newest per column, by `family:qualifier`.
async fn raw_row(store: &BigtableStore, key: &str) -> Option<HashMap<String, Vec<u8>>> {
    let rows = proto::RowSet {
        row_keys: vec![key.as_bytes().to_vec()],
        row_ranges: Vec::new(),
    };
    read(store, Some(rows)).await.into_iter().next().map(|row| {
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
    // A direct message acked within the grace costs the seeds' two reads
    // and no write, receipts on or off: its receipt is sealed into its id.
    let reads_only = BTreeMap::from([("ReadRows".to_owned(), 20)]);
    assert_eq!(off[0], reads_only, "direct, receipts off");
    assert_eq!(on[0], reads_only, "direct, receipts on");
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
    let mut node = node_on(&bigtable::local().await.host, args)("all");
    node.env.push(autopush_tests::receipt::long_grace());
    let node = Server::start_node(node).await;
    let metrics = format!("http://127.0.0.1:{metrics_port}");
    let mut ws = node.client().await;
    let sub = Subscription::new(&mut ws).await;

    let count = 10;
    let start = requests(&metrics).await;
    for i in 0..count {
        // The 201 comes once the client acked (within the grace).
        let text = format!("direct {i}");
        tokio::join!(sub.push_text(&text), async {
            let (n, _) = sub.receive(&mut ws).await;
            ws.ack_notification(&n).await;
        });
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

// ---- every cell we write, against what autopush-rs reads ---------------

/// What autopush-rs 1.83.1 reads (`autopush-common/src/db/bigtable`):
/// `get_user` takes every router cell of row `{uaid}` and fails on one that
/// is neither one of these nor `chid:{uuid}`.
const AUTOPUSH_RS_ROUTER_CELLS: [&str; 7] = [
    "connected_at",
    "router_type",
    "record_version",
    "version",
    "router_data",
    "node_id",
    "current_timestamp",
];
/// `row_to_notification` requires `ttl`, `timestamp` and `version` in a
/// message row and reads `data` and `headers`; it drops other cells.
const AUTOPUSH_RS_MESSAGE_CELLS: [&str; 5] = ["ttl", "timestamp", "version", "data", "headers"];
/// Our message cells that autopush-rs drops (read back by us only).
const OUR_MESSAGE_CELLS: [&str; 3] = ["sortkey_timestamp", "urgency", "durable"];

/// What one scan of the whole table found wrong, and which cells it saw.
#[derive(Default)]
struct CellAudit {
    wrong: Vec<String>,
    seen: std::collections::BTreeSet<String>,
}

impl CellAudit {
    /// Read every row of the table and check each cell against what
    /// autopush-rs reads; `phase` names the path that wrote them.
    async fn scan(&mut self, store: &BigtableStore, phase: &str) {
        for row in read(store, None).await {
            let key = text(&row.key);
            for ((family, qualifier), value) in &row.cells {
                let qualifier = text(qualifier);
                let kind = match key.split_once('#') {
                    None => "user",
                    Some(_) => "message",
                };
                self.seen.insert(format!("{kind} {family}:{qualifier}"));
                if let Err(why) = check_cell(&key, family, &qualifier, value) {
                    self.wrong
                        .push(format!("{phase}: {key} {family}:{qualifier}: {why}"));
                }
            }
            if let Some((_, sort_key)) = key.split_once('#') {
                for required in ["ttl", "timestamp", "version"] {
                    if !row.cells.keys().any(|(_, q)| q == required.as_bytes()) {
                        self.wrong
                            .push(format!("{phase}: {key} lacks {required} ({sort_key})"));
                    }
                }
            }
        }
    }
}

/// Whether autopush-rs reads cell `family:qualifier` of row `key` without
/// error (or does not look at it).
fn check_cell(key: &str, family: &str, qualifier: &str, value: &[u8]) -> Result<(), String> {
    let eight = |v: &[u8]| match v.len() {
        8 => Ok(()),
        n => Err(format!("{n} bytes, not 8")),
    };
    let Some((uaid, sort_key)) = key.split_once('#') else {
        if uaid_ok(key).is_err() {
            return Err("not a UAID row".into());
        }
        return match (family, qualifier) {
            ("router", "connected_at" | "record_version" | "current_timestamp") => eight(value),
            ("router", "version") if value.len() == 16 => Ok(()),
            ("router", "router_type") => match value {
                b"webpush" | b"fcm" | b"gcm" | b"apns" => Ok(()),
                _ => Err("unknown router type".into()),
            },
            ("router", "router_data") => {
                serde_json::from_slice::<HashMap<String, serde_json::Value>>(value)
                    .map(|_| ())
                    .map_err(|_| "not a JSON object".into())
            }
            ("router", "node_id") => std::str::from_utf8(value)
                .map(|_| ())
                .map_err(|_| "not UTF-8".into()),
            ("router", q) if AUTOPUSH_RS_ROUTER_CELLS.contains(&q) => Err("bad value".into()),
            ("router", q) => match q.strip_prefix("chid:").map(Uuid::parse_str) {
                Some(Ok(_)) => Ok(()),
                _ => Err("autopush-rs takes it for a channel and fails".into()),
            },
            // Ours, where autopush-rs does not look (its get_user reads
            // the router family only).
            ("message", "last_connect") => eight(value),
            ("message", "over_msg_limit") => Ok(()),
            ("message", "min_urgency") => match value {
                b"low" | b"normal" | b"high" => Ok(()),
                _ => Err("not a minimum urgency (very-low is no cell)".into()),
            },
            _ => Err("a cell of the user row autopush-rs does not know".into()),
        };
    };
    uaid_ok(uaid)?;
    let family_of_key = match sort_key.split(':').next() {
        Some("01") => "message_topic",
        Some("02") => "message",
        _ => return Err("a sort key autopush-rs cannot parse".into()),
    };
    let parts: Vec<&str> = sort_key.splitn(3, ':').collect();
    let chid = match family_of_key {
        "message_topic" => parts.get(1),
        _ => {
            if parts.get(1).and_then(|t| t.parse::<u64>().ok()).is_none() {
                return Err("sort key timestamp".into());
            }
            parts.get(2)
        }
    };
    if chid.and_then(|c| Uuid::parse_str(c).ok()).is_none() {
        return Err("sort key channel".into());
    }
    if family != family_of_key {
        return Err(format!("in {family}, autopush-rs reads {family_of_key}"));
    }
    match qualifier {
        "ttl" | "timestamp" | "sortkey_timestamp" => eight(value),
        "version" | "data" | "urgency" => std::str::from_utf8(value)
            .map(|_| ())
            .map_err(|_| "not UTF-8".into()),
        "headers" => serde_json::from_slice::<HashMap<String, String>>(value)
            .map(|_| ())
            .map_err(|_| "not a JSON map of strings".into()),
        q if OUR_MESSAGE_CELLS.contains(&q) => Ok(()),
        q if AUTOPUSH_RS_MESSAGE_CELLS.contains(&q) => Ok(()),
        _ => Err("a message cell nobody listed".into()),
    }
}

fn uaid_ok(uaid: &str) -> Result<(), String> {
    match uaid.len() == 32 && Uuid::parse_str(uaid).is_ok() {
        true => Ok(()),
        false => Err("not a UAID".into()),
    }
}

/// A push of `body` (aes128gcm, as is) with extra `headers`.
async fn raw_push(endpoint: &str, headers: &[(&str, &str)]) -> autopush_tests::HttpReply {
    let mut all = vec![("ttl", "600"), ("content-encoding", "aes128gcm")];
    all.extend_from_slice(headers);
    let reply = autopush_tests::http::post_push(endpoint, &all, Some(b"opaque".to_vec())).await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    reply
}

/// Every path that writes to Bigtable (hello, register, direct and stored
/// pushes, acks, unregister, msg_limit, receipts, `/v1` registrations, a
/// bridged mailbox, the daily `last_connect`), the whole table read after
/// each: every cell in the router and message families is one autopush-rs
/// 1.83.1 reads without error, or one it never looks at. A new cell fails
/// here before it fails an operator going back to autopush-rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cell_we_write_is_one_autopush_rs_reads() {
    use autopush_tests::http as h;
    use reqwest::Method;
    let (table, store) = fresh_table().await;
    let google = autopush_tests::google::Google::start().await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = google.write_service_account(dir.path(), "sa.json");
    let config = dir.path().join("autopush.toml");
    let fcm = format!(
        "[fcm.apps.app1]\nproject_id = \"autopush-test\"\ncredential = \"{}\"\nbase_url = \"{}\"\n",
        key_file.display(),
        google.base_url()
    );
    std::fs::write(&config, fcm).unwrap();
    let mut args = beside_autopush_rs(&table).await;
    args.extend([
        format!("--config={}", config.display()),
        "--msg-limit=2".into(),
        // The direct copy is written after the grace, as a node's journal
        // writes one it moves: that write is audited too.
        "--journal-dir=off".into(),
    ]);
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    let mut audit = CellAudit::default();

    // hello, register, a direct push before and after its ack.
    let mut ws = node.client().await;
    let uaid = ws.uaid().to_owned();
    let (chid, other) = (
        autopush_tests::new_channel_id(),
        autopush_tests::new_channel_id(),
    );
    let endpoint = ws.register(&chid, None).await["pushEndpoint"]
        .as_str()
        .unwrap()
        .to_owned();
    ws.register(&other, None).await;
    audit.scan(&store, "hello+register").await;
    let min = ws.set_min_urgency(serde_json::json!("low")).await;
    assert_eq!(min["status"], 200, "{min}");
    audit.scan(&store, "minimum urgency").await;
    raw_push(&endpoint, &[("urgency", "high")]).await;
    let n = ws.recv_notification().await;
    audit.scan(&store, "direct").await;
    ws.ack_notification(&n).await;
    ws.unregister(&other, 200).await;
    ws.close().await;

    // Stored (timestamp and Topic), read and acked at the next hello.
    let stored = raw_push(&endpoint, &[]).await;
    raw_push(&endpoint, &[("topic", "news")]).await;
    audit.scan(&store, "stored").await;
    // Receipts (off beside autopush-rs): a read, and the sender's delete.
    let location = stored.header("location").unwrap().to_owned();
    h::get(&location).await;
    audit.scan(&store, "receipt").await;
    let mut ws = node.reconnect(&uaid).await;
    for n in ws.recv_notifications(2).await {
        ws.ack_notification(&n).await;
    }
    ws.close().await;
    let sent = raw_push(&endpoint, &[]).await;
    h::request(Method::DELETE, sent.header("location").unwrap(), &[], None).await;
    audit.scan(&store, "acked").await;

    // msg_limit 2: three stored; the next hello marks the user over it,
    // the one after starts over with a new UAID.
    for _ in 0..3 {
        raw_push(&endpoint, &[]).await;
    }
    let mut ws = node.reconnect(&uaid).await;
    ws.recv_notifications(2).await;
    ws.close().await;
    audit.scan(&store, "over msg_limit").await;
    let ws = WsClient::connect_hello(&node.ws_url(), Some(&uaid)).await;
    let fresh = Uuid::parse_str(ws.uaid()).unwrap();
    assert_ne!(fresh.simple().to_string(), uaid);
    ws.close().await;
    audit.scan(&store, "msg_limit reset").await;

    // The daily refresh of last_connect.
    assert!(store.touch_user(&fresh, now_millis()).await.unwrap());
    audit.scan(&store, "touch").await;

    // /v1: a webpush registration, a new channel, a bridged one with a
    // mailbox, its token updated, a message acked from the mailbox.
    let v1 =
        |t: &str, path: &str| format!("{}/v1/{t}/app1/registration{path}", node.endpoint_base());
    let json = [("content-type", "application/json")];
    let web = h::request(
        Method::POST,
        &v1("webpush", ""),
        &json,
        Some(b"{}".to_vec()),
    )
    .await;
    assert_eq!(web.status, 200, "{}", web.text);
    raw_push(web.json["endpoint"].as_str().unwrap(), &[]).await;
    let body = serde_json::json!({"token": "fcm-token", "mailbox": true}).to_string();
    let fcm = h::request(Method::POST, &v1("fcm", ""), &json, Some(body.into_bytes())).await;
    assert_eq!(fcm.status, 200, "{}", fcm.text);
    let (fcm_uaid, secret) = (fcm.field("uaid"), fcm.field("secret"));
    let auth = format!("Bearer {secret}");
    let with_auth = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    let sub = h::request(
        Method::POST,
        &v1("fcm", &format!("/{fcm_uaid}/subscription")),
        &with_auth,
        Some(b"{}".to_vec()),
    )
    .await;
    assert_eq!(sub.status, 200, "{}", sub.text);
    let token = serde_json::json!({"token": "fcm-token-2"}).to_string();
    let updated = h::request(
        Method::PUT,
        &v1("fcm", &format!("/{fcm_uaid}")),
        &with_auth,
        Some(token.into_bytes()),
    )
    .await;
    assert_eq!(updated.status, 200, "{}", updated.text);
    let boxed = raw_push(fcm.json["endpoint"].as_str().unwrap(), &[]).await;
    raw_push(fcm.json["endpoint"].as_str().unwrap(), &[("topic", "t")]).await;
    audit.scan(&store, "v1 + mailbox").await;
    let id = autopush_tests::receipt::id_of(boxed.header("location").unwrap()).to_owned();
    let acked = h::request(
        Method::DELETE,
        &v1("fcm", &format!("/{fcm_uaid}/messages/{id}")),
        &with_auth,
        None,
    )
    .await;
    assert_eq!(acked.status, 200, "{}", acked.text);
    audit.scan(&store, "mailbox ack").await;

    assert!(audit.wrong.is_empty(), "{:#?}", audit.wrong);
    // The scans saw what they are meant to check.
    for cell in [
        "user router:connected_at",
        "user message:last_connect",
        "user message:over_msg_limit",
        "user message:min_urgency",
        "user router:router_data",
        "message message:data",
        "message message_topic:sortkey_timestamp",
        "message message:urgency",
    ] {
        assert!(
            audit.seen.contains(cell),
            "{cell} never written: {:?}",
            audit.seen
        );
    }
}

// ---- durable direct copies and nodes that do not settle them -------------

/// A connection node that takes every push (200) and counts them; it says
/// it settles durable copies (as ours do) when `settles`, else it is
/// autopush-rs's kind: its direct acks never touch storage.
async fn taking_node(settles: bool) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use warp::{Filter, Reply};
    let taken = std::sync::Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    let routes = warp::put()
        .and(warp::path!("push" / String))
        .and(warp::body::bytes())
        .map(move |_: String, _: bytes::Bytes| {
            count.fetch_add(1, Ordering::SeqCst);
            let reply = warp::reply::with_status("", warp::http::StatusCode::OK);
            match settles {
                true => warp::reply::with_header(reply, "x-autopush-settles-durable-copy", "1")
                    .into_response(),
                false => reply.into_response(),
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(warp::serve(routes).incoming(listener).run());
    (base, taken)
}

/// A push our endpoint delivers through a node that does not settle
/// durable copies (autopush-rs's, declared by `--autopush-rs-nodes`) leaves
/// no copy behind: it would be delivered again at the client's next hello.
/// Through one of ours, the copy stays until the client's ack. (Undeclared,
/// the copy stays too: tests/tests/fleet.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_durable_copy_stays_behind_a_node_that_does_not_settle_it() {
    let (table, store) = fresh_table().await;
    let mut args = beside_autopush_rs(&table).await;
    args.push("--autopush-rs-nodes=127.0.0.1".into());
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    for settles in [false, true] {
        let (node_id, taken) = taking_node(settles).await;
        let (uaid, sub) = node.offline_subscription(false).await;
        // Newer than the cell hello wrote (stamped now + 60 days).
        let stamp = now_millis() + 90 * 86_400_000;
        write_row(
            &store,
            uaid.clone(),
            vec![cell("router", "node_id", node_id.into_bytes(), stamp)],
        )
        .await;
        sub.push_text("direct").await;
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
        let left = store
            .fetch_messages(&Uuid::parse_str(&uaid).unwrap(), 10)
            .await
            .unwrap();
        assert_eq!(left.len(), usize::from(settles), "settles: {settles}");
    }
}

/// The copy is removed on its version, and not once someone wrote the
/// message again (autopush-rs's node storing it as its client left
/// without an ack, its cells stamped by its own clock).
#[tokio::test]
async fn a_direct_copy_written_again_is_not_removed() {
    let (_, store) = fresh_table().await;
    let uaid = Uuid::new_v4();
    let message = autopush_common::Notification {
        channel_id: Uuid::new_v4(),
        version: "v1".into(),
        ttl: 600,
        timestamp: now_secs(),
        topic: None,
        sortkey_timestamp: Some(now_millis() * 1000),
        data: Some("ZGF0YQ".into()),
        headers: None,
        urgency: None,
        durable: false,
    };
    store.save_direct(&uaid, message.clone()).await.unwrap();
    let mut other = message.clone();
    other.version = "v2".into();
    assert!(!store.remove_direct_copy(&uaid, &other).await.unwrap());
    assert!(store.remove_direct_copy(&uaid, &message).await.unwrap());
    assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());

    store.save_direct(&uaid, message.clone()).await.unwrap();
    let key = row::message_key(&uaid, &message.sort_key());
    let rewritten = (now_millis() + 1) + message.ttl * 1000;
    write_row(
        &store,
        String::from_utf8(key).unwrap(),
        vec![cell("message", "version", b"v1".to_vec(), rewritten)],
    )
    .await;
    assert!(!store.remove_direct_copy(&uaid, &message).await.unwrap());
    assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap().len(), 1);
}

// ---- rows older builds of ours left --------------------------------------

/// A user row as builds before 8bfba7c wrote it: autopush-rs's router
/// cells and one channel, and `last_connect` (and `over_msg_limit` when
/// `over`) in the router family, stamped now + 60 days as router cells are.
async fn write_old_layout_user(store: &BigtableStore, uaid: &Uuid, last_connect: u64, over: bool) {
    let stamp = (now_secs() + 60 * 86_400) * 1000;
    let connected_at = now_millis() - 86_400_000;
    let chid = format!("chid:{}", Uuid::new_v4().as_hyphenated());
    let mut cells = vec![
        cell(
            "router",
            "connected_at",
            connected_at.to_be_bytes().to_vec(),
            stamp,
        ),
        cell("router", "router_type", b"webpush".to_vec(), stamp),
        cell(
            "router",
            "record_version",
            1u64.to_be_bytes().to_vec(),
            stamp,
        ),
        cell(
            "router",
            "version",
            Uuid::new_v4().as_bytes().to_vec(),
            stamp,
        ),
        cell("router", &chid, Vec::new(), stamp),
        cell(
            "router",
            "last_connect",
            last_connect.to_be_bytes().to_vec(),
            stamp,
        ),
    ];
    if over {
        cells.push(cell("router", "over_msg_limit", vec![1], stamp));
    }
    write_row(store, uaid.simple().to_string(), cells).await;
}

/// The lines `db move-legacy-cells` printed; asserts it succeeded.
async fn move_legacy_cells(table: &str) -> String {
    let out = db_command(table, &["db", "move-legacy-cells"]).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}{}", text(&out.stderr));
    said
}

/// `autopush db move-legacy-cells` on rows older builds left (our own
/// cells in the router family, which autopush-rs takes for channels and
/// fails on): afterwards every cell of the table is one autopush-rs reads,
/// the values read the same, rows already in the current layout and
/// message rows are left alone, a second run has nothing to do, and the
/// users keep their UAIDs at their next hello here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_move_legacy_cells_leaves_every_row_readable_by_autopush_rs() {
    let (table, store) = fresh_table().await;
    let day = 86_400_000;
    let (over, plain, both) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let last = now_millis() - 3 * day;
    write_old_layout_user(&store, &over, last, true).await;
    write_old_layout_user(&store, &plain, last - day, false).await;
    // Router and message copies at once (an older node wrote the router
    // one after ours had moved it): the later last_connect stays.
    write_old_layout_user(&store, &both, last, false).await;
    let stamp = (now_secs() + 60 * 86_400) * 1000;
    let earlier = (last - day).to_be_bytes().to_vec();
    write_row(
        &store,
        both.simple().to_string(),
        vec![cell("message", "last_connect", earlier, stamp)],
    )
    .await;
    // A user in the current layout, with a stored message.
    let args = beside_autopush_rs(&table).await;
    let node = Server::start_node(node_on(&bigtable::local().await.host, args)("all")).await;
    let (current, sub) = node.offline_subscription(false).await;
    sub.push_text("stored").await;
    let current_row = raw_row(&store, &current).await.unwrap();

    let mut before = CellAudit::default();
    before.scan(&store, "old layout").await;
    assert_eq!(before.wrong.len(), 4, "{:#?}", before.wrong);

    let said = move_legacy_cells(&table).await;
    assert!(said.contains("scanned 4 user rows"), "{said}");
    assert!(said.contains("family in 3 rows"), "{said}");
    assert!(said.contains("skipped 0 rows"), "{said}");
    let mut after = CellAudit::default();
    after.scan(&store, "moved").await;
    assert!(after.wrong.is_empty(), "{:#?}", after.wrong);

    // The values moved intact, as this build reads them.
    let row = raw_row(&store, &over.simple().to_string()).await.unwrap();
    assert_eq!(row["message:last_connect"], last.to_be_bytes());
    assert_eq!(row["message:over_msg_limit"], [1]);
    for (uaid, last_connect, over_limit) in [
        (over, last, true),
        (plain, last - day, false),
        (both, last, false),
    ] {
        let user = store.get_user(&uaid).await.unwrap().unwrap();
        assert_eq!(
            (user.last_connect, user.over_msg_limit),
            (last_connect, over_limit)
        );
    }
    assert_eq!(raw_row(&store, &current).await.unwrap(), current_row);

    let said = move_legacy_cells(&table).await;
    assert!(said.contains("family in 0 rows"), "{said}");
    // Other stores never held them: nothing to do, said plainly.
    let dir = tempfile::tempdir().unwrap();
    let embedded = dir.path().join("data");
    let out = run_autopush(&[
        "db",
        "move-legacy-cells",
        "--db",
        embedded.to_str().unwrap(),
    ])
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("nothing to do"),
        "{}",
        text(&out.stdout)
    );

    for uaid in [over, plain, both] {
        node.reconnect(&uaid.simple().to_string())
            .await
            .close()
            .await;
    }
    let mut ws = node.reconnect(&current).await;
    assert_eq!(sub.receive(&mut ws).await.1.text, "stored");
}

/// A node changing a user between the command's read and its write wins:
/// the write is conditional on the cells read, value and timestamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_move_legacy_cells_never_overwrites_a_change_since_its_read() {
    let (table, store) = fresh_table().await;
    let day = 86_400_000;
    let (old_node, our_node) = (Uuid::new_v4(), Uuid::new_v4());
    let last = now_millis() - 3 * day;
    write_old_layout_user(&store, &old_node, last, true).await;
    write_old_layout_user(&store, &our_node, last, true).await;
    let stale_old = store.read_legacy_cells(&old_node).await.unwrap().unwrap();
    let stale_ours = store.read_legacy_cells(&our_node).await.unwrap().unwrap();

    // An older build of ours connects the first user: its router cells
    // again, one second later, the same value of over_msg_limit.
    let stamp = (now_secs() + 60 * 86_400 + 1) * 1000;
    let newer = now_millis();
    write_row(
        &store,
        old_node.simple().to_string(),
        vec![
            cell(
                "router",
                "last_connect",
                newer.to_be_bytes().to_vec(),
                stamp,
            ),
            cell("router", "over_msg_limit", vec![1], stamp),
        ],
    )
    .await;
    // This build connects the second: it moves them itself.
    let mut user = store.get_user(&our_node).await.unwrap().unwrap();
    let seen = user.connected_at;
    user.connected_at = seen + 1;
    user.last_connect = newer;
    user.over_msg_limit = false;
    assert!(store.take_over_user(&user, seen).await.unwrap());

    assert!(!store.move_legacy_row(&stale_old).await.unwrap());
    assert!(!store.move_legacy_row(&stale_ours).await.unwrap());
    let row = raw_row(&store, &old_node.simple().to_string())
        .await
        .unwrap();
    assert_eq!(row["router:last_connect"], newer.to_be_bytes());
    assert!(!row.contains_key("message:last_connect"));
    let user = store.get_user(&our_node).await.unwrap().unwrap();
    assert_eq!((user.last_connect, user.over_msg_limit), (newer, false));

    // The command reads again: the newer cells move, the moved ones stay.
    let said = move_legacy_cells(&table).await;
    assert!(said.contains("family in 1 rows"), "{said}");
    let user = store.get_user(&old_node).await.unwrap().unwrap();
    assert_eq!((user.last_connect, user.over_msg_limit), (newer, true));
    let user = store.get_user(&our_node).await.unwrap().unwrap();
    assert_eq!((user.last_connect, user.over_msg_limit), (newer, false));
    let mut audit = CellAudit::default();
    audit.scan(&store, "moved").await;
    assert!(audit.wrong.is_empty(), "{:#?}", audit.wrong);
}

/// More user rows than one page of the command's scan (500): every one is
/// read once and moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_move_legacy_cells_pages_through_the_table() {
    let (table, store) = fresh_table().await;
    let stamp = (now_secs() + 60 * 86_400) * 1000;
    let entries = (0..1201u64)
        .map(|i| proto::mutate_rows_request::Entry {
            row_key: row::user_key(&Uuid::new_v4()),
            mutations: vec![
                cell("router", "connected_at", i.to_be_bytes().to_vec(), stamp),
                cell("router", "last_connect", i.to_be_bytes().to_vec(), stamp),
            ],
            ..Default::default()
        })
        .collect();
    store.connection().mutate_rows(entries).await.unwrap();
    let said = move_legacy_cells(&table).await;
    assert!(said.contains("scanned 1201 user rows"), "{said}");
    assert!(said.contains("family in 1201 rows"), "{said}");
    let mut audit = CellAudit::default();
    audit.scan(&store, "moved").await;
    assert!(
        audit.wrong.is_empty(),
        "{} wrong, first {:?}",
        audit.wrong.len(),
        audit.wrong.first()
    );
}

// ---- our cells of a user live as long as the user ------------------------

const DAY: u64 = 86_400;
/// How long a cell of ours lives after its last write (autopush-rs's
/// `MAX_ROUTER_TTL`, which its stamps add).
const CELL_LIFE: u64 = 60 * DAY;

/// A fresh store whose stamps read the simulated clock `now` (unix
/// seconds), and a user on it connected at `now`.
async fn user_on_a_simulated_clock(
    now: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> (BigtableStore, Uuid) {
    let clock = now.clone();
    let store = bigtable::fresh_store()
        .await
        .with_clock(move || clock.load(std::sync::atomic::Ordering::SeqCst));
    let uaid = Uuid::new_v4();
    let at = now.load(std::sync::atomic::Ordering::SeqCst) * 1000;
    store
        .add_user(&User::new_webpush(uaid, "http://node-0", at))
        .await
        .unwrap();
    (store, uaid)
}

/// What the connection node's `hello` writes for a user agent it read as
/// `prev`, at `now_ms`.
fn reconnection(prev: &User, node: &str, now_ms: u64) -> User {
    let mut user = User::new_webpush(prev.uaid, node, now_ms.max(prev.connected_at + 1));
    user.keep_as_read(prev);
    user
}

async fn hello(store: &BigtableStore, uaid: &Uuid, node: &str, now_ms: u64) -> User {
    let prev = store.get_user(uaid).await.unwrap().expect("the user");
    let user = reconnection(&prev, node, now_ms);
    assert!(
        store
            .take_over_user(&user, prev.connected_at)
            .await
            .unwrap(),
        "hello lost its take-over"
    );
    user
}

fn route(token: &str) -> WakeRoute {
    WakeRoute {
        router: RouterType::Fcm,
        app_id: "app1".into(),
        token: token.into(),
    }
}

/// A distributor sets its wake route once and says hello every day; a
/// client stays connected for 61 days, its node touching it daily. GC
/// runs as autopush-rs sets it; the route, the last wake-up and the
/// minimum urgency are all still there on day 61.
#[tokio::test]
async fn our_cells_outlive_61_days_of_daily_hellos_or_one_long_connection() {
    use std::sync::atomic::Ordering::SeqCst;
    let start = now_secs();
    let now = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(start));
    let (store, distributor) = user_on_a_simulated_clock(&now).await;
    assert!(
        store
            .set_wake_route(&distributor, Some(&route("t1")))
            .await
            .unwrap()
    );
    assert!(
        store
            .claim_wake(&distributor, 0, start * 1000)
            .await
            .unwrap()
    );
    let (long, connected) = user_on_a_simulated_clock(&now).await;
    let at = now.load(SeqCst) * 1000;
    assert!(
        long.set_min_urgency(&connected, "http://node-0", at, Urgency::High)
            .await
            .unwrap()
    );
    for day in 1..=61 {
        let today = start + day * DAY;
        now.store(today, SeqCst);
        bigtable::collect_garbage(&store, &distributor, today).await;
        bigtable::collect_garbage(&long, &connected, today).await;
        hello(&store, &distributor, "http://node-1", today * 1000).await;
        assert!(long.touch_user(&connected, today * 1000).await.unwrap());
    }
    let read = store.get_user(&distributor).await.unwrap().unwrap();
    assert_eq!(
        (read.wake_route, read.last_wake),
        (Some(route("t1")), start * 1000),
        "the distributor's wake route on day 61"
    );
    let read = long.get_user(&connected).await.unwrap().unwrap();
    assert_eq!(
        read.min_urgency,
        Urgency::High,
        "the long connection's minimum urgency on day 61"
    );
}

/// What the model says user row holds of ours, and until when something
/// kept the user alive.
#[derive(Debug)]
struct Kept {
    node: String,
    connected_at: u64,
    last_connect: u64,
    over_msg_limit: bool,
    min_urgency: Urgency,
    wake_route: Option<WakeRoute>,
    last_wake: u64,
    /// The last hello or touch (unix seconds): the user lives until
    /// [`CELL_LIFE`] after it.
    kept_alive_at: u64,
}

/// Whatever touches a user between two hellos: what the connection, an
/// endpoint waking it, or a bridge saying its token is gone write.
async fn meanwhile(
    store: &BigtableStore,
    uaid: &Uuid,
    kept: &mut Kept,
    rng: &mut fastrand::Rng,
    ms: u64,
) -> String {
    match rng.u8(0..4) {
        0 => {
            let set = rng.bool().then(|| route(&format!("t{}", rng.u8(0..3))));
            assert!(store.set_wake_route(uaid, set.as_ref()).await.unwrap());
            kept.wake_route = set;
            format!(
                "set the wake route {:?}",
                kept.wake_route.as_ref().map(|r| &r.token)
            )
        }
        1 => {
            let seen = store.get_user(uaid).await.unwrap().unwrap().last_wake;
            assert!(store.claim_wake(uaid, seen, ms).await.unwrap());
            kept.last_wake = ms;
            "woke it".into()
        }
        2 => {
            let Some(gone) = kept.wake_route.take() else {
                return "found no route to remove".into();
            };
            assert!(store.remove_wake_route(uaid, &gone).await.unwrap());
            "removed the gone route".into()
        }
        _ => {
            let min = [
                Urgency::VeryLow,
                Urgency::Low,
                Urgency::Normal,
                Urgency::High,
            ][rng.usize(0..4)];
            let owner = (kept.node.as_str(), kept.connected_at);
            assert!(
                store
                    .set_min_urgency(uaid, owner.0, owner.1, min)
                    .await
                    .unwrap()
            );
            kept.min_urgency = min;
            format!("set the minimum urgency {min:?}")
        }
    }
}

/// Random lives of a user agent at random times over months: hellos
/// (some with a wake-up, a new route or a gone token landing between
/// their read and their write), a long connection's touches, wake routes
/// set and removed, wake-ups, minimum urgencies. autopush-rs's GC runs
/// before each step. After each, while a hello or touch kept the user
/// alive within [`CELL_LIFE`], it reads what the model holds and no cell
/// of ours is stamped to go before the user. `STAMP_ROUNDS` (default 8)
/// makes the search longer, `STAMP_SEED` repeats one.
#[tokio::test]
async fn our_cells_outlive_every_use_that_keeps_their_user() {
    use autopush_tests::env_or;
    use std::sync::atomic::Ordering::SeqCst;
    let rounds = env_or("STAMP_ROUNDS", 8);
    let seed = env_or("STAMP_SEED", fastrand::u64(..));
    eprintln!("STAMP_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let start = now_secs();
    let now = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(start));
    for round in 0..rounds {
        now.store(start, SeqCst);
        let (store, uaid) = user_on_a_simulated_clock(&now).await;
        let first = store.get_user(&uaid).await.unwrap().unwrap();
        let mut kept = Kept {
            node: "http://node-0".into(),
            connected_at: first.connected_at,
            last_connect: first.last_connect,
            over_msg_limit: false,
            min_urgency: Urgency::VeryLow,
            wake_route: None,
            last_wake: 0,
            kept_alive_at: start,
        };
        let mut story = Vec::new();
        for step in 0..40 {
            let gap = match rng.u8(0..4) {
                0 => rng.u64(0..DAY),
                1 => rng.u64(DAY..20 * DAY),
                2 => rng.u64(20 * DAY..50 * DAY),
                _ => rng.u64(50 * DAY..70 * DAY),
            };
            let deadline = kept.kept_alive_at + CELL_LIFE;
            let mut at = now.load(SeqCst) + gap;
            // Past the user's life only a hello or touch keeps it: make
            // this step one, on the last day it lives.
            let must_keep = at > deadline;
            if must_keep {
                at = deadline;
            }
            now.store(at, SeqCst);
            bigtable::collect_garbage(&store, &uaid, at).await;
            let ms = at * 1000 + step;
            let did = match (must_keep, rng.u8(0..5)) {
                (true, 0..=2) | (false, 0) => {
                    let prev = store.get_user(&uaid).await.unwrap().expect("the user");
                    let raced = match rng.bool() {
                        true => Some(meanwhile(&store, &uaid, &mut kept, &mut rng, ms).await),
                        false => None,
                    };
                    let node = format!("http://node-{}", rng.u8(0..3));
                    let mut user = reconnection(&prev, &node, ms);
                    user.over_msg_limit = rng.bool();
                    let taken = store
                        .take_over_user(&user, prev.connected_at)
                        .await
                        .unwrap();
                    // A minimum changed meanwhile fails the take-over, as it should.
                    if taken {
                        kept.node = node;
                        kept.connected_at = user.connected_at;
                        kept.last_connect = user.last_connect;
                        kept.over_msg_limit = user.over_msg_limit;
                        kept.kept_alive_at = at;
                    } else {
                        assert_ne!(
                            prev.min_urgency, kept.min_urgency,
                            "hello lost its take-over"
                        );
                    }
                    format!("hello (taken: {taken}, {raced:?} meanwhile)")
                }
                (true, _) | (false, 1) => {
                    assert!(store.touch_user(&uaid, ms).await.unwrap());
                    kept.last_connect = ms;
                    kept.kept_alive_at = at;
                    "touch".into()
                }
                _ => meanwhile(&store, &uaid, &mut kept, &mut rng, ms).await,
            };
            story.push(format!("day {}: {did}", (at - start) / DAY));
            let read = store.get_user(&uaid).await.unwrap().expect("the user");
            let got = (
                read.last_connect,
                read.over_msg_limit,
                read.min_urgency,
                read.wake_route.clone(),
                read.last_wake,
            );
            let want = (
                kept.last_connect,
                kept.over_msg_limit,
                kept.min_urgency,
                kept.wake_route.clone(),
                kept.last_wake,
            );
            let lives_until = autopush_storage::bigtable::row::router_stamp(kept.kept_alive_at);
            let cells = store.read_legacy_cells(&uaid).await.unwrap().unwrap();
            let dying: Vec<_> = cells
                .stamps
                .iter()
                .filter(|((_, q), stamp)| q != b"connected_at" && **stamp < lives_until)
                .map(|((f, q), stamp)| {
                    let days = (lives_until - stamp) / 1_000_000 / DAY as i64;
                    format!("{f}:{} {days} days early", text(q))
                })
                .collect();
            assert!(
                got == want && dying.is_empty(),
                "STAMP_SEED={seed} round {round}: after\n  {}\nread (last_connect, over, min, route, last_wake) {got:?}\nnot {want:?}; cells to go before the user: {dying:?}",
                story.join("\n  ")
            );
        }
    }
}
