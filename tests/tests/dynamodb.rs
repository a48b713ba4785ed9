//! `--db dynamodb` end to end, on local DynamoDB-compatible servers (moto
//! and dynalite, not AWS): the `db` subcommands, and split mode with two
//! connection nodes and an endpoint node as separate processes.

use std::collections::BTreeMap;

use autopush_common::{User, time::now_millis};
use autopush_storage::Storage;
use autopush_storage::dynamodb::Tables;
use autopush_tests::dynamo::{LocalDynamo, ThrottlingProxy};
use autopush_tests::scenarios::{self, receive_and_ack};
use autopush_tests::server::run_autopush;
use autopush_tests::{Node, SendOptions, Server, Subscription, WsClient, dynamo};

/// `autopush ARGS` against the local moto server, with `tables`.
async fn db_command(tables: &Tables, args: &[&str]) -> std::process::Output {
    db_command_on(&dynamo::local().await.endpoint, tables, args).await
}

/// `autopush ARGS` against the server at `endpoint`, with `tables`.
async fn db_command_on(endpoint: &str, tables: &Tables, args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::from(autopush_tests::server::autopush_command());
    cmd.args(args)
        .args(["--db", "dynamodb", "--router-table", &tables.router])
        .args(["--message-table", &tables.message])
        .envs(dynamo::aws_env(endpoint))
        .kill_on_drop(true);
    // drop-old-users queries the 7,440 hour keys of a month: about a minute
    // on moto.
    tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .expect("autopush db did not finish")
        .expect("run autopush db")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn db_commands_create_check_and_drop_old_users() {
    let tables = dynamo::tables();
    let out = db_command(&tables, &["db", "preflight"]).await;
    assert!(!out.status.success());
    let said = text(&out.stdout);
    assert!(
        said.contains(&format!("router table {} does not exist", tables.router))
            && said.contains(&format!("message table {} does not exist", tables.message)),
        "{said}"
    );

    let out = db_command(&tables, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("created"),
        "{}",
        text(&out.stdout)
    );
    // Again: nothing to do, still success.
    let out = db_command(&tables, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("exists") && !said.contains("created"),
        "{said}"
    );

    let out = db_command(&tables, &["db", "preflight"]).await;
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(text(&out.stdout).starts_with("ready"));

    // Users last seen two calendar months ago go, with their channels and
    // messages; a recent user and a bridge registration of that month stay.
    let store = dynamo::connect(&dynamo::local().await.endpoint, tables.clone()).await;
    let two_months_ago = now_millis() - 62 * 86_400_000;
    let mut old = User::new_webpush(uuid::Uuid::new_v4(), "http://gone", two_months_ago);
    old.node_id = None;
    let recent = User::new_webpush(uuid::Uuid::new_v4(), "http://here", now_millis());
    let mut bridge = old.clone();
    bridge.uaid = uuid::Uuid::new_v4();
    bridge.router_type = autopush_common::RouterType::Fcm;
    for user in [&old, &recent, &bridge] {
        store.add_user(user).await.unwrap();
        store
            .add_channel(&user.uaid, &uuid::Uuid::new_v4(), 10)
            .await
            .unwrap();
    }
    let out = db_command(
        &tables,
        &["db", "drop-old-users", "--months", "2", "--pause", "0"],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.trim_end().ends_with("dropped 1 users"), "{said}");
    assert!(
        said.contains("old users found"),
        "no progress lines: {said}"
    );
    assert!(store.get_user(&old.uaid).await.unwrap().is_none());
    assert!(store.get_channels(&old.uaid).await.unwrap().is_empty());
    assert!(store.get_user(&recent.uaid).await.unwrap().is_some());
    assert!(store.get_user(&bridge.uaid).await.unwrap().is_some());
}

/// dynalite has no TTL API: `db create-tables` makes the tables and warns
/// what running without TTL costs, `db preflight` passes with the warning,
/// and a node on it stores and delivers.
#[tokio::test]
async fn a_server_without_ttl_gets_a_warning_not_a_failure() {
    let endpoint = &dynamo::dynalite().await.endpoint;
    let tables = dynamo::tables();
    let out = db_command_on(endpoint, &tables, &["db", "create-tables"]).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}{}", text(&out.stderr));
    assert!(
        said.contains(&format!("message table {}: created", tables.message)),
        "{said}"
    );
    let warning = format!("warning: message table {} has no TTL", tables.message);
    assert!(
        said.contains(&warning) && said.contains("drop-old-users"),
        "{said}"
    );

    let out = db_command_on(endpoint, &tables, &["db", "preflight"]).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}{}", text(&out.stderr));
    assert!(
        said.starts_with("ready") && said.contains(&warning),
        "{said}"
    );

    let node = Server::start_node(node_on(endpoint, shared_args(&tables).await)("all")).await;
    let (uaid, sub) = node.offline_subscription(false).await;
    sub.push_text("no ttl").await;
    let mut ws = node.reconnect(&uaid).await;
    let (_, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "no ttl");
}

#[tokio::test]
async fn db_commands_need_dynamodb() {
    let out = run_autopush(&["db", "create-tables", "--db", "/tmp/nowhere"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--db dynamodb"),
        "{}",
        text(&out.stderr)
    );
}

/// Without a region, or with tables missing, a node refuses to start and
/// says why.
#[tokio::test]
async fn nodes_refuse_to_start_without_a_region_or_tables() {
    let mut cmd = tokio::process::Command::from(autopush_tests::server::autopush_command());
    cmd.args(["endpoint", "--db", "dynamodb", "--endpoint-port", "0"])
        .args(scenarios::cluster_keys().await)
        .env_remove("AWS_REGION")
        .env_remove("AWS_DEFAULT_REGION")
        .env_remove("AWS_PROFILE")
        .env("AWS_CONFIG_FILE", "/nonexistent")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .kill_on_drop(true);
    let out = tokio::time::timeout(autopush_tests::HANG_GUARD, cmd.output())
        .await
        .expect("autopush did not exit")
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("AWS_REGION"),
        "{}",
        text(&out.stderr)
    );

    let tables = dynamo::tables();
    let mut cmd = tokio::process::Command::from(autopush_tests::server::autopush_command());
    cmd.args(["endpoint", "--db", "dynamodb", "--endpoint-port", "0"])
        .args(shared_args(&tables).await)
        .envs(dynamo::local().await.env())
        .kill_on_drop(true);
    let out = tokio::time::timeout(autopush_tests::HANG_GUARD * 2, cmd.output())
        .await
        .expect("autopush did not exit")
        .unwrap();
    assert!(!out.status.success());
    let said = text(&out.stderr);
    assert!(
        said.contains("autopush db preflight") && said.contains(&tables.router),
        "{said}"
    );
}

/// Tests `async fn test(server: &LocalDynamo)`, run on moto
/// (`moto::test`) and on dynalite (`dynalite::test`).
macro_rules! on_both_servers {
    ($($test:ident),* $(,)?) => {
        mod moto {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(autopush_tests::dynamo::local().await).await;
                }
            )*
        }
        mod dynalite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(autopush_tests::dynamo::dynalite().await).await;
                }
            )*
        }
    };
}

on_both_servers!(
    clients_move_between_connection_nodes_without_loss_or_duplicates,
    clients_move_between_nodes_whose_clocks_disagree,
    clients_of_a_paused_connection_node_keep_receiving_when_it_resumes,
    throttling_is_retried_then_refused_and_nothing_accepted_is_lost,
    records_written_by_the_seeds_schema_are_read,
    requests_per_delivered_message,
);

/// Split mode on one DynamoDB: an endpoint node and two connection nodes.
struct Cluster {
    endpoint: Server,
    a: Server,
    b: Server,
    tables: Tables,
    server: &'static LocalDynamo,
}

impl Cluster {
    /// Start the three nodes on fresh tables on `server`. Every node gets
    /// the same [`shared_args`].
    async fn start(server: &'static LocalDynamo) -> Cluster {
        Cluster::start_with(server, |_| {}).await
    }

    /// [`Cluster::start`], with connection node A set up further by
    /// `tweak_a` (e.g. given a clock offset).
    async fn start_with(server: &'static LocalDynamo, tweak_a: impl FnOnce(&mut Node)) -> Cluster {
        let tables = dynamo::tables();
        let out = db_command_on(&server.endpoint, &tables, &["db", "create-tables"]).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let node = node_on(&server.endpoint, shared_args(&tables).await);
        let endpoint = Server::start_node(node("endpoint")).await;
        let connection = || Node {
            endpoint_url: Some(endpoint.endpoint_base()),
            ..node("connection")
        };
        let mut node_a = connection();
        tweak_a(&mut node_a);
        let a = Server::start_node(node_a).await;
        let b = Server::start_node(connection()).await;
        Cluster {
            endpoint,
            a,
            b,
            tables,
            server,
        }
    }

    /// The user record of `uaid`, as the nodes stored it.
    async fn user(&self, uaid: &str) -> User {
        let store = dynamo::connect(&self.server.endpoint, self.tables.clone()).await;
        let uaid = uuid::Uuid::parse_str(uaid).unwrap();
        store.get_user(&uaid).await.unwrap().expect("a user record")
    }
}

/// What every node of one cluster must agree on: the tables and fresh keys
/// (and any other cluster-wide secret, added here).
async fn shared_args(tables: &Tables) -> Vec<String> {
    let mut args = vec![
        format!("--router-table={}", tables.router),
        format!("--message-table={}", tables.message),
    ];
    args.extend(scenarios::cluster_keys().await);
    args
}

/// Nodes of a role on the DynamoDB-compatible server at `endpoint`, with
/// `args`.
fn node_on(endpoint: &str, args: Vec<String>) -> impl Fn(&'static str) -> Node {
    let env: Vec<(String, String)> = dynamo::aws_env(endpoint)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    move |role| Node {
        role,
        db: Some("dynamodb".into()),
        endpoint_url: None,
        env: env.clone(),
        args: args.clone(),
        clock_offset_secs: 0,
    }
}

/// An endpoint-only node has no internal router API: its log names no
/// node URL or router port.
#[tokio::test]
async fn an_endpoint_node_logs_no_router_url() {
    let tables = dynamo::tables();
    let out = db_command(&tables, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let endpoint = &dynamo::local().await.endpoint;
    let server =
        Server::start_node(node_on(endpoint, shared_args(&tables).await)("endpoint")).await;
    // Past the effective settings it opens with, which list them all.
    let log: String = server
        .stderr()
        .lines()
        .filter(|l| !l.contains("autopush: setting "))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(log.contains("autopush running"), "{log}");
    let router_port = server.router_base().rsplit(':').next().unwrap().to_owned();
    assert!(
        !log.contains("node=")
            && !log.contains(&format!(":{router_port}"))
            && !log.contains(":8081"),
        "an endpoint node logs a router URL:\n{log}"
    );
}

async fn clients_move_between_connection_nodes_without_loss_or_duplicates(
    server: &'static LocalDynamo,
) {
    let cluster = Cluster::start(server).await;
    scenarios::clients_move_between_nodes(&cluster.endpoint, &cluster.a, &cluster.b).await;
}

/// Connection nodes whose clocks disagree: node A's runs ahead, so a
/// client that moves from A to B reconnects "earlier" than the connection
/// it replaces. Each reconnect wins all the same: the record names the
/// node the client is on, and pushes reach it on that connection.
async fn clients_move_between_nodes_whose_clocks_disagree(server: &'static LocalDynamo) {
    // Longer than one push and one move take, even on a loaded machine, so
    // that every move from A to B happens while A's clock is still ahead.
    const AHEAD_SECS: i64 = 10;
    let cluster = Cluster::start_with(server, |a| a.clock_offset_secs = AHEAD_SECS).await;
    let mut ws = cluster.b.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let mut seen = BTreeMap::new();

    let moves = [("A", &cluster.a), ("B", &cluster.b)].repeat(2);
    for (i, (name, node)) in moves.iter().enumerate() {
        let before = now_millis();
        ws.close().await;
        ws = node.reconnect(&uaid).await;
        let user = cluster.user(&uaid).await;
        if *name == "A" {
            let ahead = user.connected_at.saturating_sub(before);
            assert!(
                ahead >= (AHEAD_SECS as u64 - 1) * 1000,
                "node A's connected_at is {ahead} ms after the real clock: not {AHEAD_SECS} s ahead \
                 (is libfaketime applied?)"
            );
        }
        assert_eq!(
            user.node_id.as_deref(),
            Some(node.router_base().as_str()),
            "move {i}: the client is on node {name} but its record names another node"
        );
        sub.push_text(&format!("move {i}")).await;
        receive_and_ack(&mut ws, &sub, 1, &mut seen).await;
    }
    let want: BTreeMap<String, usize> =
        (0..moves.len()).map(|i| (format!("move {i}"), 1)).collect();
    assert_eq!(seen, want);
}

/// A connection node frozen (SIGSTOP) until the endpoint has given up on
/// it (the node call times out), then thawed (SIGCONT): its client, on the
/// same connection, gets what is sent afterwards, and nothing answered 201
/// is lost.
async fn clients_of_a_paused_connection_node_keep_receiving_when_it_resumes(
    server: &'static LocalDynamo,
) {
    let cluster = Cluster::start(server).await;
    let mut ws = cluster.a.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let mut want = BTreeMap::new();

    // The endpoint answers only once its call to A has timed out.
    cluster.a.pause();
    let paused = sub.send(&SendOptions::text("while paused")).await;
    cluster.a.resume();
    if paused.status == 201 {
        want.insert("while paused".to_owned(), 1);
    }
    assert_eq!(
        cluster.user(&uaid).await.node_id.as_deref(),
        Some(cluster.a.router_base().as_str()),
        "after a node call timed out, the record no longer names node A, where the client is"
    );

    sub.push_text("after").await;
    want.insert("after".to_owned(), 1);
    let mut seen = BTreeMap::new();
    while !seen.contains_key("after") {
        receive_and_ack(&mut ws, &sub, 1, &mut seen).await;
    }
    // Whatever did not come on that connection comes at the next one.
    ws.close().await;
    let mut ws = cluster.b.reconnect(&uaid).await;
    let owed = want
        .values()
        .sum::<usize>()
        .saturating_sub(seen.values().sum());
    receive_and_ack(&mut ws, &sub, owed, &mut seen).await;
    ws.assert_nothing_arrives().await;
    assert_eq!(seen, want);
}

/// An all-in-one node on fresh tables, reaching DynamoDB through a
/// [`ThrottlingProxy`] (which counts requests and can refuse them).
async fn node_behind_proxy() -> (Tables, ThrottlingProxy, Server) {
    node_behind_proxy_with(dynamo::local().await, &[]).await
}

/// [`node_behind_proxy`] in front of `server`, the node started with
/// `extra` arguments too.
async fn node_behind_proxy_with(
    server: &LocalDynamo,
    extra: &[&str],
) -> (Tables, ThrottlingProxy, Server) {
    node_behind_proxy_env(server, extra, Vec::new()).await
}

/// [`node_behind_proxy_with`], the node given `env` too.
async fn node_behind_proxy_env(
    server: &LocalDynamo,
    extra: &[&str],
    env: Vec<(String, String)>,
) -> (Tables, ThrottlingProxy, Server) {
    let tables = dynamo::tables();
    let out = db_command_on(&server.endpoint, &tables, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let proxy = ThrottlingProxy::start(&server.endpoint).await;
    let mut args = shared_args(&tables).await;
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut node = node_on(&proxy.endpoint, args)("all");
    node.env.extend(env);
    let node = Server::start_node(node).await;
    (tables, proxy, node)
}

/// DynamoDB refusing requests for throughput: a short burst is absorbed by
/// the retries; a long one reaches senders as 503 errno 201 with
/// Retry-After, clients as close 1013 and the heartbeat as failing; when it
/// ends, everything accepted is delivered.
async fn throttling_is_retried_then_refused_and_nothing_accepted_is_lost(server: &LocalDynamo) {
    let (_, proxy, node) = node_behind_proxy_with(server, &[]).await;
    let (uaid, sub) = node.offline_subscription(false).await;

    proxy.throttle_next(3);
    sub.push_text("absorbed").await;
    assert_eq!(proxy.refused(), 3);

    proxy.throttle();
    let refused = sub.send(&SendOptions::text("refused")).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["errno"], 201, "{}", refused.body);
    assert!(
        refused.headers.contains_key("retry-after"),
        "{:?}",
        refused.headers
    );
    let http = autopush_tests::http::client();
    let heartbeat = http
        .get(format!("{}/__heartbeat__", node.endpoint_base()))
        .send()
        .await
        .unwrap();
    assert_eq!(heartbeat.status(), 503);
    let mut ws = WsClient::connect(&node.ws_url()).await;
    let reply = ws.hello(Some(&uaid)).await;
    assert_eq!(reply["status"], 503, "{reply}");
    assert_eq!(ws.expect_closed().await.code, Some(1013));

    proxy.stop();
    // The heartbeat reuses a check's answer for about a second: wait for
    // it to see the recovery.
    let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
    loop {
        let heartbeat = http
            .get(format!("{}/__heartbeat__", node.endpoint_base()))
            .send()
            .await
            .unwrap();
        if heartbeat.status() == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the heartbeat still answers {} after the throttling ended",
            heartbeat.status()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut ws = node.reconnect(&uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "absorbed");
    ws.ack_notification(&n).await;
    ws.assert_nothing_arrives().await;
}

/// A webpush user with two channels and three messages (one expired),
/// written into `router` and `message` by `tests/py/seed_dynamo.py` (boto3,
/// the seeds' schema, none of our code). Returns its UAID, its channels and
/// what the script says it wrote.
async fn seed_like_python(
    server: &LocalDynamo,
    router: &str,
    message: &str,
) -> (uuid::Uuid, uuid::Uuid, uuid::Uuid, serde_json::Value) {
    let (uaid, a, b) = (
        uuid::Uuid::new_v4(),
        uuid::Uuid::new_v4(),
        uuid::Uuid::new_v4(),
    );
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("py/seed_dynamo.py");
    let out = tokio::process::Command::new(autopush_tests::py::python())
        .arg(script)
        .args([router, message])
        .arg(uaid.simple().to_string())
        .args([a.to_string(), b.to_string()])
        .envs(server.env())
        .output()
        .await
        .expect("run seed_dynamo.py");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let wrote = serde_json::from_slice(&out.stdout).expect("seed_dynamo.py prints JSON");
    (uaid, a, b, wrote)
}

/// Migration: tables written with the seeds' schema by Python (boto3, not
/// our code) are read correctly: the router record, the channel set
/// (dashed or hex), topic and timestamp messages, expired ones skipped, and
/// an ack of a migrated message removes it.
async fn records_written_by_the_seeds_schema_are_read(server: &LocalDynamo) {
    let tables = dynamo::tables();
    let store = dynamo::connect(&server.endpoint, tables.clone()).await;
    store.create_tables().await.expect("create tables");
    let (uaid, a, b, wrote) = seed_like_python(server, &tables.router, &tables.message).await;

    let user = store.get_user(&uaid).await.unwrap().expect("migrated user");
    assert_eq!(user.router_type, autopush_common::RouterType::WebPush);
    assert_eq!(user.node_id.as_deref(), Some("http://old-node:8081"));
    assert_eq!(serde_json::json!(user.connected_at), wrote["connected_at"]);
    assert!(now_millis() - user.last_connect < 3_600_000 + 60_000);
    assert_eq!(
        store.get_channels(&uaid).await.unwrap(),
        [a, b].into_iter().collect()
    );
    let messages = store.fetch_messages(&uaid, 10).await.unwrap();
    let versions: Vec<_> = messages.iter().map(|m| m.version.as_str()).collect();
    assert_eq!(versions, ["legacy-topic", "legacy-plain"]);
    assert_eq!(messages[0].topic.as_deref(), Some("scores"));
    assert_eq!(messages[0].channel_id, a);
    assert_eq!(messages[0].data.as_deref(), Some("dG9waWM"));
    let headers = messages[0].headers.as_ref().unwrap();
    assert_eq!(headers["crypto_key"], "dh=def");
    assert_eq!(messages[1].channel_id, b);
    assert_eq!(messages[1].ttl, 600);
    // A connection newer than the migrated one takes over; an ack removes.
    let mut newer = User::new_webpush(uaid, "http://new-node:8081", now_millis() + 1);
    newer.router_data = None;
    assert!(
        store
            .take_over_user(&newer, user.connected_at)
            .await
            .unwrap()
    );
    let plain = &messages[1];
    assert!(
        store
            .remove_message(&uaid, &plain.sort_key(), &plain.version)
            .await
            .unwrap()
    );
    assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 1);
}

/// The DynamoDB requests one message costs, counted at the wire: delivered
/// directly to a connected client, and stored for an offline one then
/// drained. Printed for BENCHMARKS.md; bounded here so a change that adds
/// requests per message is noticed.
async fn requests_per_delivered_message(server: &LocalDynamo) {
    let off = requests_per_message(server, &["--receipt-retention", "0"]).await;
    let on = requests_per_message(server, &[]).await;
    // A direct message acked within the grace costs the seeds' two reads
    // and no write, receipts on or off: its receipt is sealed into its id.
    let reads_only = BTreeMap::from([("GetItem".to_owned(), 20)]);
    assert_eq!(off[0], reads_only, "direct, receipts off");
    assert_eq!(on[0], reads_only, "direct, receipts on");
    autopush_tests::receipt::assert_receipts_cost_no_request(&off, &on);
}

/// The DynamoDB requests of 10 messages delivered directly (push + ack),
/// 10 stored (push) and those 10 drained (hello + deliver + ack), by
/// operation, on a node started with `args`.
async fn requests_per_message(
    server: &LocalDynamo,
    args: &[&str],
) -> autopush_tests::receipt::PathRequests {
    let env = vec![autopush_tests::receipt::long_grace()];
    let (_, proxy, node) = node_behind_proxy_env(server, args, env).await;
    let mut ws = node.client().await;
    let sub = Subscription::new(&mut ws).await;

    let count = 10;
    proxy.take_operations();
    for i in 0..count {
        // The 201 comes once the client acked (within the grace).
        let text = format!("direct {i}");
        tokio::join!(sub.push_text(&text), async {
            let (n, _) = sub.receive(&mut ws).await;
            ws.ack_notification(&n).await;
        });
    }
    // The session handles the close after the last ack (and its delete).
    let uaid = ws.uaid().to_owned();
    ws.close().await;
    let direct = proxy.take_operations();
    for i in 0..count {
        sub.push_text(&format!("stored {i}")).await;
    }
    let stored = proxy.take_operations();
    let mut ws = node.reconnect(&uaid).await;
    for _ in 0..count {
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    ws.close().await;
    let drained = proxy.take_operations();
    eprintln!(
        "DynamoDB requests for {count} messages ({args:?}):\n  direct (push + ack): {direct:?}\n  \
         stored (push): {stored:?}\n  drained (hello + deliver + ack): {drained:?}"
    );
    let total = |ops: &BTreeMap<String, usize>| ops.values().sum::<usize>();
    assert!(total(&direct) <= 5 * count, "{direct:?}");
    // Plus the one optimistic node_id clear when the first push finds the
    // client gone.
    assert!(total(&stored) <= 4 * count + 1, "{stored:?}");
    assert!(total(&drained) <= 2 * count + 10, "{drained:?}");
    [direct, stored, drained]
}

/// A store on the local server reading `message` as its one message table:
/// what a node without rotation, or an endpoint that read an old month,
/// sees of one monthly table.
async fn one_table(router: &str, message: &str) -> autopush_storage::dynamodb::DynamoStore {
    let tables = Tables {
        router: router.to_owned(),
        message: message.to_owned(),
        rotate_messages: false,
    };
    let store = dynamo::connect(&dynamo::local().await.endpoint, tables).await;
    store.create_tables().await.expect("create tables");
    store
}

/// Legacy monthly message tables (`--message-table-rotation`), on records
/// Python autopush wrote into last month's table: the user reads there
/// until nothing is left unread, then moves to this month's table with its
/// channels; a message an endpoint stores in the old table after the move
/// is still read; users more than a month behind are gone, bridge users
/// keep their table.
#[tokio::test]
async fn monthly_tables_move_users_forward_without_loss() {
    use autopush_storage::dynamodb::months::MonthTables;
    let local = dynamo::local().await;
    let mut tables = dynamo::tables();
    tables.rotate_messages = true;
    let months = MonthTables::new(&tables.message);
    let (this_month, last_month) = (months.month(0), months.month(-1));
    let store = dynamo::connect(&local.endpoint, tables.clone()).await;
    let report = store.create_tables().await.unwrap().join("\n");
    for made in [&this_month, &months.month(1)] {
        assert!(
            report.contains(&format!("message table {made}: created")),
            "{report}"
        );
    }
    let last = one_table(&tables.router, &last_month).await;
    let now = one_table(&tables.router, &this_month).await;

    let (uaid, a, b, _) =
        seed_like_python(dynamo::local().await, &tables.router, &last_month).await;

    let month_of = async |uaid| {
        store
            .get_user(&uaid)
            .await
            .unwrap()
            .and_then(|u| u.current_month)
    };
    assert_eq!(month_of(uaid).await.as_ref(), Some(&last_month));
    let channels: std::collections::HashSet<_> = [a, b].into_iter().collect();
    assert_eq!(store.get_channels(&uaid).await.unwrap(), channels);
    // An endpoint stores where the user's month says.
    let pushed = autopush_common::Notification {
        version: "pushed-to-last-month".into(),
        ..store_message(a)
    };
    store.save_messages(&uaid, vec![pushed]).await.unwrap();
    assert_eq!(last.count_messages(&uaid, 10).await.unwrap(), 3);
    assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 3);

    // Read, but not all acked: the user stays on last month's table.
    let unread = store.fetch_messages(&uaid, 10).await.unwrap();
    assert_eq!(unread.len(), 3);
    let (acked, kept) = unread.split_at(2);
    for m in acked {
        assert!(
            store
                .remove_message(&uaid, &m.sort_key(), &m.version)
                .await
                .unwrap()
        );
    }
    assert_eq!(store.fetch_messages(&uaid, 10).await.unwrap().len(), 1);
    assert_eq!(month_of(uaid).await.as_ref(), Some(&last_month));
    let m = &kept[0];
    assert!(
        store
            .remove_message(&uaid, &m.sort_key(), &m.version)
            .await
            .unwrap()
    );

    // All acked: the next look moves the user, channels first.
    assert!(store.fetch_messages(&uaid, 10).await.unwrap().is_empty());
    assert_eq!(month_of(uaid).await.as_ref(), Some(&this_month));
    assert_eq!(now.get_channels(&uaid).await.unwrap(), channels);
    assert!(store.has_channel(&uaid, &b).await.unwrap());

    // An endpoint that read the old month just before the move stores in
    // the old table just after it: still read, counted and removable.
    let mut late = autopush_common::Notification {
        version: "late".into(),
        sortkey_timestamp: Some(autopush_common::time::unique_micros()),
        ..store_message(b)
    };
    last.save_messages(&uaid, vec![late.clone()]).await.unwrap();
    // And one stored after the move lands in this month's table.
    late.version = "after".into();
    late.sortkey_timestamp = Some(autopush_common::time::unique_micros());
    store.save_messages(&uaid, vec![late]).await.unwrap();
    assert_eq!(now.count_messages(&uaid, 10).await.unwrap(), 1);
    assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 2);
    let both = store.fetch_messages(&uaid, 10).await.unwrap();
    let mut versions: Vec<_> = both.iter().map(|m| m.version.as_str()).collect();
    versions.sort();
    assert_eq!(versions, ["after", "late"]);
    for m in &both {
        assert!(
            store
                .remove_message(&uaid, &m.sort_key(), &m.version)
                .await
                .unwrap()
        );
    }
    assert_eq!(last.count_messages(&uaid, 10).await.unwrap(), 0);

    // A webpush user two months behind is gone (410, a new UAID at hello);
    // a bridge user registered then keeps its table and channels.
    let two_back = months.month(-2);
    let old = one_table(&tables.router, &two_back).await;
    let mut behind = User::new_webpush(uuid::Uuid::new_v4(), "http://gone", now_millis());
    behind.current_month = Some(two_back.clone());
    let mut bridge = behind.clone();
    bridge.uaid = uuid::Uuid::new_v4();
    bridge.router_type = autopush_common::RouterType::Fcm;
    for user in [&behind, &bridge] {
        store.add_user(user).await.unwrap();
        old.add_channel(&user.uaid, &a, 10).await.unwrap();
    }
    assert!(store.get_user(&behind.uaid).await.unwrap().is_none());
    assert_eq!(month_of(bridge.uaid).await.as_ref(), Some(&two_back));
    assert!(store.has_channel(&bridge.uaid, &a).await.unwrap());
    // A new user starts on this month's table.
    let fresh = User::new_webpush(uuid::Uuid::new_v4(), "http://here", now_millis());
    store.add_user(&fresh).await.unwrap();
    assert_eq!(month_of(fresh.uaid).await.as_ref(), Some(&this_month));
}

/// A plain stored message on `channel_id`.
fn store_message(channel_id: uuid::Uuid) -> autopush_common::Notification {
    autopush_common::Notification {
        channel_id,
        version: "v".into(),
        ttl: 600,
        timestamp: autopush_common::time::now_secs(),
        topic: None,
        data: Some("ZGF0YQ".into()),
        headers: None,
        sortkey_timestamp: Some(autopush_common::time::unique_micros()),
        urgency: None,
        durable: false,
    }
}

/// `--message-table-rotation true` end to end: `db create-tables` makes
/// this month's and next month's tables, preflight accepts them, and a node
/// delivers stored messages from them.
#[tokio::test]
async fn monthly_tables_from_the_command_line() {
    use autopush_storage::dynamodb::months::MonthTables;
    let tables = dynamo::tables();
    let months = MonthTables::new(&tables.message);
    let rotation = ["--message-table-rotation", "true"];
    let out = db_command(&tables, &[&["db", "create-tables"][..], &rotation].concat()).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    for made in [months.month(0), months.month(1)] {
        assert!(
            said.contains(&format!("message table {made}: created")),
            "{said}"
        );
    }
    let out = db_command(&tables, &[&["db", "preflight"][..], &rotation].concat()).await;
    let said = text(&out.stdout);
    assert!(said.starts_with("ready"), "{said}");
    for checked in [months.month(0), months.month(1)] {
        assert!(said.contains(&checked), "{checked} not named: {said}");
    }

    let mut args = shared_args(&tables).await;
    args.push("--message-table-rotation=true".into());
    let node = Server::start_node(node_on(&dynamo::local().await.endpoint, args)("all")).await;
    let (uaid, sub) = node.offline_subscription(false).await;
    sub.push_text("monthly").await;
    let mut ws = node.reconnect(&uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "monthly");
    ws.ack_notification(&n).await;
    ws.assert_nothing_arrives().await;
    let mut rotating = tables.clone();
    rotating.rotate_messages = true;
    let store = dynamo::connect(&dynamo::local().await.endpoint, rotating).await;
    let uaid = uuid::Uuid::parse_str(&uaid).unwrap();
    let user = store.get_user(&uaid).await.unwrap().expect("user");
    assert_eq!(user.current_month, Some(months.month(0)));
}

/// A user flooded with messages that expired before it came back costs its
/// hello reads, not a delete per expired message: DynamoDB filters them and
/// TTL removes them.
#[tokio::test]
async fn expired_messages_cost_a_fetch_no_writes() {
    let created = dynamo::fresh_store().await;
    let proxy = ThrottlingProxy::start(&dynamo::local().await.endpoint).await;
    let store = dynamo::connect(&proxy.endpoint, created.tables().clone()).await;
    let (uaid, chid) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let mut messages: Vec<_> = (0..30).map(|_| store_message(chid)).collect();
    for (i, m) in messages.iter_mut().enumerate() {
        m.version = format!("v{i}");
        if i < 28 {
            m.timestamp -= 2 * m.ttl;
        }
    }
    store.save_messages(&uaid, messages.clone()).await.unwrap();
    proxy.take_operations();
    let fetched = store.fetch_messages(&uaid, 100).await.unwrap();
    let versions: Vec<_> = fetched.iter().map(|m| &m.version).collect();
    assert_eq!(versions, [&messages[28].version, &messages[29].version]);
    let operations = proxy.take_operations();
    assert_eq!(
        operations.keys().collect::<Vec<_>>(),
        ["Query"],
        "{operations:?}"
    );
}

/// Words of the backend's own error that must never reach the public: the
/// error code, the AWS account and role the proxy's message names, the
/// table names, and which store and calls we use.
fn backend_words(tables: &Tables) -> Vec<String> {
    [
        "AccessDenied",
        "arn:aws",
        dynamo::DENIED_ACCOUNT,
        dynamo::DENIED_ROLE,
        "DynamoDB",
        "dynamodb",
        "GetItem",
        "Query",
        "UpdateItem",
        "PutItem",
        "DeleteItem",
        &tables.router,
        &tables.message,
    ]
    .iter()
    .map(|w| w.to_string())
    .collect()
}

/// Panics, briefly, if `shown` (what `what` showed the public) holds any
/// of `words`.
fn assert_shows_none(what: &str, shown: &str, words: &[String]) {
    if let Some(word) = words.iter().find(|w| shown.contains(w.as_str())) {
        let start = shown.find(word.as_str()).unwrap_or(0).saturating_sub(80);
        let end = (start + 240).min(shown.len());
        let excerpt = String::from_utf8_lossy(&shown.as_bytes()[start..end]);
        panic!("{what} shows the backend's {word:?}: ...{excerpt}...");
    }
}

/// The store refusing us (here: DynamoDB's `AccessDeniedException`, whose
/// message names the AWS account, the role and the table) reaches senders,
/// clients and health checks only as "unavailable", with the status and
/// errno of a storage outage; the detail goes to the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_errors_reach_the_log_and_never_the_public() {
    use autopush_tests::http;
    let (tables, proxy, node) = node_behind_proxy().await;
    let words = backend_words(&tables);

    // Before the outage: a connected client with a channel, a message for
    // it (its Location kept), and an offline user.
    let mut ws = node.client().await;
    let sub = Subscription::new(&mut ws).await;
    let accepted = http::post_push(&sub.endpoint, &[("ttl", "60")], None).await;
    accepted.assert_created();
    let location = accepted.header("location").unwrap_or_default().to_owned();
    ws.recv_notification().await;
    let (offline_uaid, _) = node.offline_subscription(false).await;

    proxy.deny_access();

    // Senders: 503 errno 201 with Retry-After, and nothing more.
    let push = http::post_push(&sub.endpoint, &[("ttl", "60")], None).await;
    push.assert_error(503, 201);
    assert!(push.header("retry-after").is_some(), "{:?}", push.headers);
    assert_shows_none("a refused push", &push.text, &words);
    let cancel = http::delete(&location).await;
    cancel.assert_error(503, 201);
    assert_shows_none("a refused DELETE /m/", &cancel.text, &words);
    let registration = http::request(
        reqwest::Method::POST,
        &format!("{}/v1/webpush/any/registration", node.endpoint_base()),
        &[("content-type", "application/json")],
        Some(b"{}".to_vec()),
    )
    .await;
    registration.assert_error(503, 201);
    assert_shows_none("a refused /v1 registration", &registration.text, &words);

    // Health checks on both public ports (which may reuse the answer of a
    // check made before the outage for a second).
    for base in [node.endpoint_base(), node.ws_http_base()] {
        for route in ["health", "__heartbeat__"] {
            let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
            let health = loop {
                let health = http::get(&format!("{base}/{route}")).await;
                if health.status != 200 || tokio::time::Instant::now() > deadline {
                    break health;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            };
            assert_eq!(health.status, 503, "/{route}: {}", health.text);
            assert_eq!(health.json["status"], "ERROR", "/{route}: {}", health.text);
            assert_shows_none(&format!("/{route}"), &health.text, &words);
        }
    }

    // Clients: register and unregister answer 500, a returning client's
    // hello 503 and close 1013; never the backend's words.
    let register = ws.register(&autopush_tests::new_channel_id(), None).await;
    assert_eq!(register["status"], 500, "{register}");
    assert_shows_none("a refused register", &register.to_string(), &words);
    let unregister = ws.unregister(&sub.channel_id, 200).await;
    assert_eq!(unregister["status"], 500, "{unregister}");
    assert_shows_none("a refused unregister", &unregister.to_string(), &words);
    let mut returning = WsClient::connect(&node.ws_url()).await;
    let hello = returning.hello(Some(&offline_uaid)).await;
    assert_eq!(hello["status"], 503, "{hello}");
    assert_shows_none("a refused hello", &hello.to_string(), &words);
    let closed = returning.expect_closed().await;
    assert_eq!(closed.code, Some(1013), "{closed:?}");
    assert_shows_none("a close frame", &closed.reason, &words);
    assert_shows_none(
        "messages before a close",
        &serde_json::Value::from(closed.messages).to_string(),
        &words,
    );

    // The operator's log has what the public did not get.
    let log = node.stderr();
    assert!(
        log.contains("AccessDeniedException") && log.contains(dynamo::DENIED_ACCOUNT),
        "the log lacks the backend's error"
    );
}

/// `/health` and `/__heartbeat__` are public and unauthenticated, and each
/// check reads storage: rapid hits on both ports of a node share one check
/// at a time and its result for about a second, so a flood of them costs
/// a few reads, not one per hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_hits_share_one_storage_check_at_a_time() {
    use autopush_tests::http;
    let (_, proxy, node) = node_behind_proxy().await;

    let urls: Vec<String> = [node.endpoint_base(), node.ws_http_base()]
        .iter()
        .flat_map(|base| ["health", "__heartbeat__"].map(|r| format!("{base}/{r}")))
        .collect();
    let started = std::time::Instant::now();
    proxy.take_operations();
    // Waves of 20 concurrent hits, at least 200 in all, and on until the
    // flood has seen storage checked twice (so the answer is not just the
    // one from start-up, reused).
    let (mut hits, mut reads) = (0, 0);
    while hits < 200 || reads < 4 {
        assert!(
            started.elapsed() < autopush_tests::HANG_GUARD,
            "{hits} health hits cost {reads} storage reads: no second check"
        );
        let replies = futures_util::future::join_all(
            (0..20).map(|i| http::get(&urls[(hits + i) % urls.len()])),
        )
        .await;
        for reply in replies {
            assert_eq!(reply.status, 200, "{}", reply.text);
        }
        hits += 20;
        reads += proxy.take_operations().values().sum::<usize>();
    }
    eprintln!("{hits} health hits cost {reads} storage reads");
    // One check (two reads) per second of the flood, plus one at each edge;
    // with a check per hit it would be two reads per hit.
    let allowed = 2 * (started.elapsed().as_secs() as usize + 2);
    assert!(
        reads <= allowed,
        "{hits} health hits cost {reads} storage reads (at most {allowed} expected)"
    );
}

// ---- the connection node holds a direct copy back for its grace ---------

// The tests of the grace that need no proxy, on every store whose
// connection nodes hold copies back: tests/tests/held_copies.rs.

/// The client acks a message while its node writes the held copy (the
/// grace over, the write slow), and the session then looks in storage
/// before the node has settled the copy it wrote: the message, acked, must
/// not be sent again. The proxy holds the write until the ack is in, then
/// holds the settle while the session looks (receipts off: the settle is a
/// `DeleteItem`, lowering the minimum an `UpdateItem`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_acked_while_its_node_writes_it_is_not_sent_again() {
    let (_, proxy, node) =
        node_behind_proxy_with(dynamo::local().await, &["--receipt-retention=0"]).await;
    let mut ws = node.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;

    proxy.park("PutItem");
    let sending = tokio::spawn({
        let sub = sub.clone();
        async move { sub.push_text("acked while written").await }
    });
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "acked while written");
    // The grace is over: the node writes the copy.
    proxy.wait_parked("PutItem", 1).await;
    ws.ack_notification(&n).await;
    // Answered after the ack: the session has taken it.
    let answer = ws.set_min_urgency(serde_json::json!("high")).await;
    assert_eq!(answer["status"], 200, "{answer}");
    proxy.park("DeleteItem");
    proxy.release("PutItem");
    // The node settles the copy it wrote; meanwhile the session looks.
    proxy.wait_parked("DeleteItem", 1).await;
    let answer = ws.set_min_urgency(serde_json::json!("very-low")).await;
    assert_eq!(answer["status"], 200, "{answer}");
    // The ping's answer comes after whatever that look sent.
    ws.ping().await;
    let next = ws.recv().await;
    assert_eq!(
        next,
        serde_json::json!({}),
        "the acked message was sent again while its copy was being settled"
    );
    proxy.release("DeleteItem");
    sending.await.expect("the push").assert_created();
    ws.close().await;
    let mut ws = node.reconnect(&uaid).await;
    ws.assert_nothing_arrives().await;
}

/// When the client acks a message whose copy its node holds, relative to
/// the node's write of that copy.
#[derive(Clone, Copy, Debug, PartialEq)]
enum AckAt {
    /// At once: inside the grace, or while the write starts.
    AtOnce,
    /// While the write is held in the proxy.
    WhileWritten,
    /// Once the push is answered (the copy written, and released).
    AfterWritten,
    /// Never: the message is owed at the next connection.
    Never,
}

/// When the session looks in storage (the client lowers its minimum).
#[derive(Clone, Copy, Debug, PartialEq)]
enum LookAt {
    WhileWritten,
    /// While the node's settle of a copy acked during its write is held.
    WhileSettled,
    AfterAnswered,
    Nowhere,
}

/// The client raises, then lowers its minimum (a storage check) and pings:
/// the notifications sent before the ping's answer.
async fn look_in_storage(ws: &mut WsClient) -> Vec<serde_json::Value> {
    for min in ["high", "very-low"] {
        let answer = ws.set_min_urgency(serde_json::json!(min)).await;
        assert_eq!(answer["status"], 200, "{answer}");
    }
    ws.ping().await;
    let mut sent = Vec::new();
    loop {
        let next = ws.recv().await;
        if next == serde_json::json!({}) {
            return sent;
        }
        if next["messageType"] == "notification" {
            sent.push(next);
        }
    }
}

/// Every schedule of one held copy's ack against its write and settle,
/// and of a storage check against both, each on its own message, in one
/// session (the proxy holds the write and the settle to place them). The
/// model: an acked message is never sent again, and every message answered
/// 201 and not acked arrives at the next connection, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_schedule_of_an_ack_and_a_look_against_the_held_write() {
    use std::collections::BTreeSet;
    let (_, proxy, node) =
        node_behind_proxy_with(dynamo::local().await, &["--receipt-retention=0"]).await;
    let mut ws = node.client().await;
    let uaid = ws.uaid().to_owned();
    let sub = Subscription::new(&mut ws).await;
    let mut acked = BTreeSet::new();
    let mut owed = BTreeSet::new();
    let acks = [
        AckAt::AtOnce,
        AckAt::WhileWritten,
        AckAt::AfterWritten,
        AckAt::Never,
    ];
    let looks = [
        LookAt::WhileWritten,
        LookAt::WhileSettled,
        LookAt::AfterAnswered,
        LookAt::Nowhere,
    ];
    for ack_at in acks {
        for look_at in looks {
            let schedule = format!("{ack_at:?} / {look_at:?}");
            let check = |seen: Vec<serde_json::Value>, acked: &BTreeSet<String>| {
                for n in seen {
                    let version = n["version"].as_str().unwrap_or_default();
                    assert!(
                        !acked.contains(version),
                        "{schedule}: an acked message was sent again"
                    );
                }
            };
            // An ack at once may beat the grace: then nothing is written.
            let holds_write = ack_at != AckAt::AtOnce;
            if holds_write {
                proxy.park("PutItem");
            }
            let sending = tokio::spawn({
                let sub = sub.clone();
                let text = schedule.clone();
                async move { sub.push_text(&text).await }
            });
            let (n, d) = sub.receive(&mut ws).await;
            assert_eq!(d.text, schedule);
            let version = n["version"].as_str().unwrap_or_default().to_owned();
            let ack = async |ws: &mut WsClient, acked: &mut BTreeSet<String>| {
                ws.ack_notification(&n).await;
                acked.insert(version.clone());
            };
            if ack_at == AckAt::AtOnce {
                ack(&mut ws, &mut acked).await;
            }
            if holds_write {
                proxy.wait_parked("PutItem", 1).await;
                if ack_at == AckAt::WhileWritten {
                    ack(&mut ws, &mut acked).await;
                }
                if look_at == LookAt::WhileWritten {
                    check(look_in_storage(&mut ws).await, &acked);
                }
                let settles = ack_at == AckAt::WhileWritten;
                if settles {
                    proxy.park("DeleteItem");
                }
                proxy.release("PutItem");
                if settles {
                    proxy.wait_parked("DeleteItem", 1).await;
                    if look_at == LookAt::WhileSettled {
                        check(look_in_storage(&mut ws).await, &acked);
                    }
                    proxy.release("DeleteItem");
                }
            }
            sending.await.expect("the push").assert_created();
            if ack_at == AckAt::AfterWritten {
                ack(&mut ws, &mut acked).await;
            }
            if look_at == LookAt::AfterAnswered {
                check(look_in_storage(&mut ws).await, &acked);
            }
            if ack_at == AckAt::Never {
                owed.insert(version.clone());
            }
        }
    }
    ws.close().await;
    let mut ws = node.reconnect(&uaid).await;
    let mut arrived = BTreeSet::new();
    while arrived.len() < owed.len() {
        let n = ws.recv_notification().await;
        let version = n["version"].as_str().unwrap_or_default().to_owned();
        assert!(
            !acked.contains(&version),
            "an acked message came at the next connection"
        );
        assert!(
            arrived.insert(version),
            "a message came twice at the next connection"
        );
        ws.ack_notification(&n).await;
    }
    assert_eq!(arrived, owed);
    ws.assert_nothing_arrives().await;
}

/// A cluster whose connection node A holds direct copies back for
/// `grace_ms`, with the router key its nodes sign with, for a test that
/// calls node A's router API as an endpoint would.
async fn cluster_holding_with_key(grace_ms: u64) -> (Cluster, String) {
    let mut router_key = String::new();
    let cluster = Cluster::start_with(dynamo::local().await, |a| {
        a.env
            .push(("AUTOPUSH_TEST_DIRECT_GRACE_MS".into(), grace_ms.to_string()));
        router_key = a
            .args
            .iter()
            .find_map(|arg| arg.strip_prefix("--router-key="))
            .expect("the cluster's router key")
            .to_owned();
    })
    .await;
    (cluster, router_key)
}

/// A node holding a copy writes nothing for an ack within the grace when
/// the endpoint that asked says it seals the receipt into the message's
/// id (router API 4 and later); for an endpoint of version 3, which does
/// not, it writes the receipt as before, so that endpoint's sender still
/// reads `delivered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_writes_the_receipt_of_an_ack_within_the_grace_only_for_an_endpoint_that_does_not_seal()
 {
    // A grace no test run outlasts: the ack, not the clock, ends it.
    let (cluster, key) = cluster_holding_with_key(60_000).await;
    let mut ws = cluster.a.client().await;
    let uaid = uuid::Uuid::parse_str(ws.uaid()).unwrap();
    let sub = Subscription::new(&mut ws).await;
    let store = dynamo::connect(&cluster.server.endpoint, cluster.tables.clone()).await;
    let path = format!("/push/{}", uaid.simple());
    let base = cluster.a.router_base();
    for (version, receipt_written) in [("3", true), ("4", false)] {
        let text = autopush_tests::Payload::Text(version.into());
        let enc =
            autopush_tests::py::encrypt(&sub.keys, &text, autopush_tests::Encoding::Aes128Gcm)
                .await;
        let mut body = autopush_tests::http::router_notification(
            &sub.channel_id,
            &format!("v{version}"),
            &enc,
        );
        body["sortkey_timestamp"] = serde_json::json!(now_millis() * 1000);
        let sort_key: autopush_common::Notification = serde_json::from_value(body.clone()).unwrap();
        let sort_key = sort_key.sort_key();
        let headers = [
            ("x-autopush-router-api", version),
            ("x-autopush-durable-copy", "hold"),
        ];
        let body = Some(body.to_string().into_bytes());
        let push = autopush_tests::http::signed_with(
            reqwest::Method::PUT,
            &base,
            &path,
            &key,
            body,
            &headers,
        );
        let receive = async {
            let n = ws.recv_notification().await;
            ws.ack_notification(&n).await;
        };
        let (reply, ()) = tokio::join!(push, receive);
        assert_eq!(reply.status, 200, "version {version}: {reply:?}");
        assert_eq!(reply.header("x-autopush-durable-copy"), Some("acked"));
        let row = store.read_message(&uaid, &sort_key).await.unwrap();
        let written = matches!(&row, Some(autopush_storage::StoredMessage::Settled(r))
            if r.state == autopush_common::receipt::MessageState::Delivered);
        assert_eq!(
            (written, row.is_some()),
            (receipt_written, receipt_written),
            "an endpoint of version {version}: {row:?}"
        );
    }
}
