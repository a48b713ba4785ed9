//! A PostgreSQL `--db` end to end, on a private cluster: the `db`
//! subcommands, split mode with two connection nodes and an endpoint node,
//! and an outage.

use std::collections::BTreeMap;

use autopush_tests::server::run_autopush;
use autopush_tests::{
    Node, SendOptions, Server, Subscription, WsClient, bigtable, postgres, scenarios,
};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `autopush ARGS --db DSN --db-settings {schema}` on the shared cluster.
async fn db_command(schema: &str, args: &[&str]) -> std::process::Output {
    let dsn = &postgres::local().await.dsn;
    let settings = postgres::db_settings(schema);
    let mut all = args.to_vec();
    all.extend(["--db", dsn, "--db-settings", &settings]);
    run_autopush(&all).await
}

#[tokio::test]
async fn db_commands_create_and_check_the_tables() {
    let schema = postgres::schema_name();
    let out = db_command(&schema, &["db", "preflight"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stdout).contains(&format!("missing: table {schema}.router")),
        "{}",
        text(&out.stdout)
    );

    for _ in 0..2 {
        // Again: nothing to do, and no error.
        let out = db_command(&schema, &["db", "create-tables"]).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains(&format!("tables {schema}.router, {schema}.meta")),
            "{}",
            text(&out.stdout)
        );
    }

    let out = db_command(&schema, &["db", "preflight"]).await;
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout).starts_with("ready:"),
        "{}",
        text(&out.stdout)
    );

    let out = db_command(&schema, &["db", "drop-old-users", "--months", "2"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--drop-idle-users-after-days"),
        "{}",
        text(&out.stderr)
    );
}

/// What every node of one cluster shares: the schema and fresh keys.
async fn shared_args(schema: &str) -> Vec<String> {
    let mut args = vec![format!("--db-settings={}", postgres::db_settings(schema))];
    args.extend(scenarios::cluster_keys().await);
    args
}

/// Nodes of a role on the PostgreSQL at `host` (`HOST:PORT`), with `args`.
fn node_on(host: &str, args: Vec<String>) -> impl Fn(&'static str) -> Node + use<> {
    let dsn = format!("postgres://postgres@{host}/postgres");
    move |role| Node {
        role,
        db: Some(dsn.clone()),
        args: args.clone(),
        ..Node::default()
    }
}

/// `HOST:PORT` of the shared cluster.
async fn host() -> String {
    let dsn = &postgres::local().await.dsn;
    let rest = dsn.split_once('@').map_or("", |(_, rest)| rest);
    rest.split('/').next().unwrap_or_default().to_owned()
}

/// A fresh schema with its tables made.
async fn fresh_schema() -> String {
    let settings = postgres::fresh_settings().await;
    settings.schema.unwrap_or_default()
}

/// The DynamoDB suite's scenario on PostgreSQL: an endpoint node and two
/// connection nodes on one schema, a client moving between the connection
/// nodes, pushes racing its moves, nothing lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_move_between_connection_nodes_without_loss_or_duplicates() {
    let schema = fresh_schema().await;
    let node = node_on(&host().await, shared_args(&schema).await);
    let endpoint = Server::start_node(node("endpoint")).await;
    let connection = || Node {
        endpoint_url: Some(endpoint.endpoint_base()),
        ..node("connection")
    };
    let a = Server::start_node(connection()).await;
    let b = Server::start_node(connection()).await;
    scenarios::clients_move_between_nodes(&endpoint, &a, &b).await;
}

/// PostgreSQL unreachable: senders get 503 errno 201 with Retry-After,
/// clients saying hello a 503 and a 1013 close; when it is back, the
/// node's pool connects again by itself and what was accepted before
/// arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_503_and_1013_and_nothing_accepted_is_lost() {
    let schema = fresh_schema().await;
    let outage = bigtable::Outage::start(&host().await).await;
    let node = Server::start_node(node_on(&outage.host, shared_args(&schema).await)("all")).await;
    let (uaid, sub) = node.offline_subscription(false).await;
    sub.push_text("before").await;

    outage.begin();
    let refused = sub.send(&SendOptions::text("refused")).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["errno"], 201, "{}", refused.body);
    // Backend detail stays in the log.
    assert!(
        !refused.body.contains("PostgreSQL") && !refused.body.contains(&outage.host),
        "{}",
        refused.body
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

/// The housekeeping steps on PostgreSQL: idle webpush users go page by
/// page with their channels and messages, bridge users and recent ones
/// stay; expired messages go in bounded batches, live ones stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn housekeeping_drops_idle_users_and_expired_messages_in_batches() {
    use autopush_common::time::now_secs;
    use autopush_common::{Notification, RouterType, User};
    use autopush_storage::Storage;
    use uuid::Uuid;

    let store = postgres::fresh_store().await;
    let message = |chid: Uuid, ttl: u64, at: u64| Notification {
        channel_id: chid,
        version: format!("v{at}"),
        ttl,
        timestamp: now_secs() - 10,
        topic: None,
        sortkey_timestamp: Some(at),
        data: Some("x".into()),
        headers: None,
        urgency: None,
        durable: false,
    };
    let mut idle = Vec::new();
    let mut kept = Vec::new();
    for i in 0..7u64 {
        let uaid = Uuid::new_v4();
        let mut user = User::new_webpush(uaid, "http://n", 1000 + i);
        if i % 3 == 0 {
            user.router_type = RouterType::Fcm;
            kept.push(uaid);
        } else if i % 3 == 1 {
            user.last_connect = 10_000_000;
            user.connected_at = 10_000_000;
            kept.push(uaid);
        } else {
            idle.push(uaid);
        }
        store.add_user(&user).await.unwrap();
        let chid = Uuid::new_v4();
        assert!(store.add_channel(&uaid, &chid, 10).await.unwrap());
        // Two expired (a TTL of 5 s, 10 s ago) and one live message each.
        store
            .save_messages(
                &uaid,
                vec![
                    message(chid, 5, 1),
                    message(chid, 5, 2),
                    message(chid, 600, 3),
                ],
            )
            .await
            .unwrap();
    }
    let mut removed = 0;
    let mut steps = 0;
    loop {
        let step = store.drop_idle_users(5_000_000, 2).await.unwrap();
        removed += step.removed;
        steps += 1;
        if step.finished_pass {
            break;
        }
        assert!(steps < 20, "the idle-user sweep never finished its pass");
    }
    assert_eq!(removed, idle.len());
    assert!(steps >= 4, "7 users in pages of 2 took {steps} steps");
    for uaid in &idle {
        assert!(store.get_user(uaid).await.unwrap().is_none());
        assert!(store.get_channels(uaid).await.unwrap().is_empty());
        assert_eq!(store.count_messages(uaid, 10).await.unwrap(), 0);
    }
    let mut swept = 0;
    loop {
        let step = store.sweep_expired_messages(3).await.unwrap();
        assert!(step.removed <= 3, "{step:?}");
        swept += step.removed;
        if step.finished_pass {
            break;
        }
    }
    assert_eq!(swept, kept.len() * 2);
    for uaid in &kept {
        assert!(store.get_user(uaid).await.unwrap().is_some());
        let left = store.fetch_messages(uaid, 10).await.unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(left[0].version, "v3");
    }
}

/// Statements of `schema` the server ran so far, by statement.
async fn statements(schema: &str) -> BTreeMap<String, u64> {
    let rows = postgres::psql(&format!(
        "SELECT calls, regexp_replace(query, '\\s+', ' ', 'g') FROM pg_stat_statements \
         WHERE query LIKE '%{schema}.%'"
    ))
    .await;
    rows.lines()
        .filter_map(|line| line.split_once('|'))
        .map(|(calls, query)| (query.to_owned(), calls.parse().unwrap_or(0)))
        .collect()
}

/// The statements of one path: reads and writes (a statement that
/// inserts, updates or deletes), by statement.
struct Spent {
    reads: u64,
    writes: u64,
    by_statement: BTreeMap<String, u64>,
}

impl Spent {
    fn print(&self, path: &str, per: u64) {
        eprintln!(
            "{path}: {} reads, {} writes ({:.2} and {:.2} each of {per})",
            self.reads,
            self.writes,
            self.reads as f64 / per as f64,
            self.writes as f64 / per as f64
        );
        for (query, calls) in &self.by_statement {
            eprintln!("  {calls:>4}  {}", &query[..query.len().min(120)]);
        }
    }
}

/// Whether statement `q` inserts, updates or deletes rows (a column such
/// as `last_update` is not an UPDATE).
fn is_write(q: &str) -> bool {
    let q = q.to_uppercase();
    let words: Vec<&str> = q
        .split_whitespace()
        .map(|w| w.trim_start_matches('('))
        .collect();
    words.windows(3).any(|w| {
        matches!(
            w,
            ["INSERT", "INTO", _] | ["DELETE", "FROM", _] | ["UPDATE", _, "SET"]
        )
    })
}

/// Counts statements path by path: each [`Counter::spent`] is what ran
/// since the last, once at least the writes the path is known to make
/// are counted and the server's counts stop moving (a path's last
/// statements may still be on their way when its client has its answer).
struct Counter {
    schema: String,
    seen: BTreeMap<String, u64>,
}

impl Counter {
    async fn new(schema: &str) -> Counter {
        Counter {
            schema: schema.to_owned(),
            seen: statements(schema).await,
        }
    }

    async fn spent(&mut self, writes_at_least: u64) -> Spent {
        let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
        let mut now = statements(&self.schema).await;
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let again = statements(&self.schema).await;
            let settled = again == now && self.since(&now).writes >= writes_at_least;
            if settled || tokio::time::Instant::now() > deadline {
                break;
            }
            now = again;
        }
        let spent = self.since(&now);
        self.seen = now;
        spent
    }

    fn since(&self, now: &BTreeMap<String, u64>) -> Spent {
        let by_statement: BTreeMap<String, u64> = now
            .iter()
            .map(|(q, n)| (q.clone(), n - self.seen.get(q).copied().unwrap_or(0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        let writes = by_statement
            .iter()
            .filter(|(q, _)| is_write(q))
            .map(|(_, n)| n)
            .sum();
        let total: u64 = by_statement.values().sum();
        Spent {
            reads: total - writes,
            writes,
            by_statement,
        }
    }
}

/// What each path costs on PostgreSQL, counted by the server
/// (`pg_stat_statements`): a new client's hello and register; a direct
/// push its client acks (within the node's grace: the copy is held, never
/// written) is one read and no write; a stored push two reads (the second
/// after the write, in case the client came back meanwhile) and a write;
/// a returning client's hello with the drain of those messages and their
/// acks: one write each when the client acks them one at a time, one for
/// them all when it acks them in one `ack` message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_per_path() {
    const PUSHES: u64 = 10;
    postgres::psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
    let schema = fresh_schema().await;
    let mut node = node_on(&host().await, shared_args(&schema).await)("all");
    // A grace no ack misses on a loaded machine: counted is the path of a
    // client that acks in time.
    node.env
        .push(("AUTOPUSH_TEST_DIRECT_GRACE_MS".into(), "60000".into()));
    let node = Server::start_node(node).await;
    let mut counter = Counter::new(&schema).await;

    let mut ws = node.client().await;
    counter.spent(1).await.print("hello, new client", 1);
    let sub = Subscription::new(&mut ws).await;
    counter.spent(1).await.print("register", 1);

    for i in 0..PUSHES {
        let client = async {
            let (n, _) = sub.receive(&mut ws).await;
            ws.ack_notification(&n).await;
        };
        let text = format!("direct {i}");
        tokio::join!(sub.push_text(&text), client);
    }
    let direct = counter.spent(0).await;
    direct.print("acked direct push", PUSHES);

    let uaid = ws.uaid().to_owned();
    ws.close().await;
    counter.spent(0).await.print("disconnect", 1);
    for i in 0..PUSHES {
        sub.push_text(&format!("stored {i}")).await;
    }
    let stored = counter.spent(PUSHES).await;
    stored.print("stored push", PUSHES);

    let mut ws = node.reconnect(&uaid).await;
    for _ in 0..PUSHES {
        let (n, _) = sub.receive(&mut ws).await;
        ws.ack_notification(&n).await;
    }
    let drain = counter.spent(PUSHES + 1).await;
    drain.print("hello, drain and acks one at a time", PUSHES);

    ws.close().await;
    counter.spent(0).await;
    for i in 0..PUSHES {
        sub.push_text(&format!("stored again {i}")).await;
    }
    counter.spent(PUSHES).await;
    let mut ws = node.reconnect(&uaid).await;
    let mut drained = Vec::new();
    for _ in 0..PUSHES {
        drained.push(sub.receive(&mut ws).await.0);
    }
    ws.ack_notifications(&drained).await;
    let batched = counter.spent(2).await;
    batched.print("hello, drain and one ack of them all", PUSHES);

    assert_eq!(direct.writes, 0, "acked direct pushes wrote");
    assert!(direct.reads <= 2 * PUSHES, "{} reads", direct.reads);
    // Each message, and the first push's clearing of the node the client left.
    assert_eq!(stored.writes, PUSHES + 1, "stored pushes");
    assert_eq!(drain.writes, PUSHES + 1, "hello and acks");
    assert_eq!(batched.writes, 2, "hello and one ack of the whole drain");
    let left = postgres::psql(&format!("SELECT count(*) FROM {schema}.message")).await;
    assert_eq!(left.trim(), "0", "messages left after their acks");
}

/// A user's lookups coalesce: many at once get exactly the answers each
/// got alone (users with the channel asked and without, users whose row is
/// past its `expiry`, users with no row, and lookups of the user alone), in
/// fewer statements than lookups; one alone is one statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_lookups_coalesce_into_fewer_statements() {
    use autopush_common::{Urgency, User};
    use autopush_storage::Storage;
    use uuid::Uuid;

    const USERS: u64 = 40;
    const ROUNDS: usize = 5;
    postgres::psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
    let store = postgres::fresh_store().await;
    let schema = store.settings().schema.clone().unwrap_or_default();
    // Each user's lookups: of its channel, of a channel it lacks, of the
    // user alone; and as many of users with no row.
    let (mut asks, mut expected) = (Vec::new(), Vec::new());
    for i in 0..USERS {
        let mut user = User::new_webpush(Uuid::new_v4(), &format!("http://node-{i}"), 1000 + i);
        user.min_urgency = [Urgency::VeryLow, Urgency::High][i as usize % 2];
        user.last_wake = i;
        store.add_user(&user).await.unwrap();
        let (chid, other) = (Uuid::new_v4(), Uuid::new_v4());
        assert!(store.add_channel(&user.uaid, &chid, 100).await.unwrap());
        asks.extend([
            (user.uaid, Some(chid)),
            (user.uaid, Some(other)),
            (user.uaid, None),
        ]);
        expected.extend([
            Some((user.clone(), true)),
            Some((user.clone(), false)),
            Some((user, false)),
        ]);
        asks.extend([(Uuid::new_v4(), Some(chid)), (Uuid::new_v4(), None)]);
        expected.extend([None, None]);
    }
    // A quarter of the rows past their expiry: read as before, not hidden.
    postgres::psql(&format!(
        "UPDATE {schema}.router SET expiry = 1 WHERE uaid IN \
         (SELECT uaid FROM {schema}.router ORDER BY uaid LIMIT {})",
        USERS / 4
    ))
    .await;
    let ask = async |(uaid, chid): &(Uuid, Option<Uuid>)| match chid {
        Some(chid) => store.get_user_and_channel(uaid, chid).await.unwrap(),
        None => store
            .get_user(uaid)
            .await
            .unwrap()
            .map(|user| (user, false)),
    };
    let mut counter = Counter::new(&schema).await;

    let mut alone = Vec::new();
    for one in &asks {
        alone.push(ask(one).await);
    }
    assert_eq!(alone, expected, "lookups one at a time");
    let spent = counter.spent(0).await;
    assert_eq!(
        spent.reads,
        asks.len() as u64,
        "one statement per lookup alone"
    );

    for round in 0..ROUNDS {
        let together = futures_util::future::join_all(asks.iter().map(ask)).await;
        for (n, (got, want)) in together.iter().zip(&alone).enumerate() {
            assert_eq!(got, want, "round {round}, lookup {n} of {:?}", asks[n]);
        }
    }
    let spent = counter.spent(0).await;
    spent.print("concurrent lookups", (asks.len() * ROUNDS) as u64);
    assert_eq!(spent.writes, 0);
    assert!(
        spent.reads < (asks.len() * ROUNDS) as u64,
        "{} statements for {} lookups",
        spent.reads,
        asks.len() * ROUNDS
    );
}

/// Lookups that reach the store over a few turns of the node's scheduler,
/// as a busy node's requests reach theirs one after another, share one
/// statement: a batch gathers for those turns before it goes.
#[tokio::test]
async fn lookups_arriving_over_a_few_scheduler_turns_share_one_statement() {
    use autopush_common::User;
    use autopush_storage::Storage;
    use uuid::Uuid;

    // Fewer turns than a batch gathers for.
    const TURNS: usize = 4;
    const PER_TURN: usize = 3;
    postgres::psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
    let store = postgres::fresh_store().await;
    let schema = store.settings().schema.clone().unwrap_or_default();
    let mut users = Vec::new();
    for i in 0..TURNS * PER_TURN {
        let user = User::new_webpush(Uuid::new_v4(), "http://node", 1000 + i as u64);
        store.add_user(&user).await.unwrap();
        let chid = Uuid::new_v4();
        assert!(store.add_channel(&user.uaid, &chid, 100).await.unwrap());
        users.push((user.uaid, chid));
    }
    // The connection opened and the statement prepared before counting.
    store.get_user(&users[0].0).await.unwrap();
    let mut counter = Counter::new(&schema).await;

    let asks = users.iter().enumerate().map(|(n, (uaid, chid))| {
        let store = &store;
        async move {
            for _ in 0..n / PER_TURN {
                tokio::task::yield_now().await;
            }
            store.get_user_and_channel(uaid, chid).await.unwrap()
        }
    });
    let answers = futures_util::future::join_all(asks).await;
    for (answer, (uaid, _)) in answers.iter().zip(&users) {
        let got = answer
            .as_ref()
            .map(|(user, subscribed)| (user.uaid, *subscribed));
        assert_eq!(got, Some((*uaid, true)), "the answer to {uaid}'s lookup");
    }
    let spent = counter.spent(0).await;
    assert_eq!(
        spent.reads,
        1,
        "statements for {} lookups over {TURNS} turns",
        users.len()
    );
}

/// A lookup's statement keeps its plan: PostgreSQL plans it for the first
/// few calls on a connection, then keeps the generic plan, as it does for a
/// statement of one user. Planning it at every call costs the server more
/// than running it. Counted by the server (`pg_stat_statements` with
/// `track_planning`, turned on for the cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_keep_their_plan() {
    use autopush_common::User;
    use autopush_storage::Storage;
    use uuid::Uuid;

    const LOOKUPS: u64 = 60;
    postgres::psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
    postgres::psql("ALTER SYSTEM SET pg_stat_statements.track_planning = on").await;
    postgres::psql("SELECT pg_reload_conf()").await;
    // Connections opened once the server has reloaded its settings count
    // their plans.
    let deadline = tokio::time::Instant::now() + autopush_tests::HANG_GUARD;
    while postgres::psql("SHOW pg_stat_statements.track_planning")
        .await
        .trim()
        != "on"
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "track_planning stays off"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let store = postgres::fresh_store().await;
    let schema = store.settings().schema.clone().unwrap_or_default();
    let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
    store
        .add_user(&User::new_webpush(uaid, "http://node", 1))
        .await
        .unwrap();
    assert!(store.add_channel(&uaid, &chid, 100).await.unwrap());
    for _ in 0..LOOKUPS {
        let (_, subscribed) = store
            .get_user_and_channel(&uaid, &chid)
            .await
            .unwrap()
            .expect("the user");
        assert!(subscribed);
    }
    let counts = postgres::psql(&format!(
        "SELECT sum(calls), sum(plans) FROM pg_stat_statements \
         WHERE query LIKE '%batch%{schema}.router%'"
    ))
    .await;
    let (calls, plans) = counts.trim().split_once('|').expect("calls|plans");
    let (calls, plans): (u64, u64) = (calls.parse().unwrap(), plans.parse().unwrap());
    assert_eq!(calls, LOOKUPS, "lookup statements");
    assert!(plans <= LOOKUPS / 3, "{plans} plans for {calls} lookups");
}

/// autopush-rs leaves the timestamp messages a client acknowledged in
/// the table and moves the user's `last_update` past them (its
/// `increment_storage`); its reads then skip them, and ours must too, or a
/// client moving to us gets them again. Topic messages it deletes on ack:
/// those left are pending whatever `last_update` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_autopush_rs_delivered_are_not_read_again() {
    use autopush_common::time::now_secs;
    use autopush_common::{Notification, User};
    use autopush_storage::Storage;
    use uuid::Uuid;

    let store = postgres::fresh_autopush_rs_store().await;
    let settings = store.settings().clone();
    let (uaid, chid) = (Uuid::new_v4(), Uuid::new_v4());
    store
        .add_user(&User::new_webpush(uaid, "http://n", 1))
        .await
        .unwrap();
    let now = now_secs();
    let message = |text: &str, at: u64, topic: Option<&str>| Notification {
        channel_id: chid,
        version: format!("v-{text}"),
        ttl: 600,
        timestamp: at,
        topic: topic.map(str::to_owned),
        sortkey_timestamp: Some(at * 1000),
        data: Some(text.into()),
        headers: None,
        urgency: None,
        durable: false,
    };
    store
        .save_messages(
            &uaid,
            vec![
                message("delivered before", now - 20, None),
                message("delivered at", now - 10, None),
                message("topic", now - 15, Some("t")),
                message("pending", now - 5, None),
            ],
        )
        .await
        .unwrap();
    // What autopush-rs's increment_storage writes when its client has
    // acknowledged everything up to `now - 10`.
    postgres::psql(&format!(
        "UPDATE {} SET last_update = {} WHERE uaid = '{}'",
        settings.qualified(&settings.router_table),
        now - 10,
        uaid.simple()
    ))
    .await;
    let texts: Vec<_> = store
        .fetch_messages(&uaid, 10)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| m.data)
        .collect();
    assert_eq!(texts, ["topic", "pending"], "read again or lost");
    assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 2);
}

/// On tables as autopush-rs makes them (its foreign keys; its own
/// `schema.psql` when `AUTOPUSH_RS_SCHEMA` names it), `db create-tables`
/// runs again without error and keeps its keys, and `db preflight` finds
/// them ready. On the tables `create-tables` makes alone, autopush-rs's
/// message insert (`ON CONFLICT (chid_message_id)`) has its unique index.
#[tokio::test]
async fn autopush_rs_tables_pass_preflight_and_ours_take_its_statements() {
    let settings = postgres::fresh_autopush_rs_settings().await;
    let schema = settings.schema.clone().unwrap_or_default();
    let out = db_command(&schema, &["db", "create-tables"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = db_command(&schema, &["db", "preflight"]).await;
    assert!(
        out.status.success() && text(&out.stdout).starts_with("ready:"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let keys = postgres::psql(&format!(
        "SELECT count(*) FROM pg_constraint WHERE contype = 'f' \
         AND connamespace = '{schema}'::regnamespace"
    ))
    .await;
    assert!(keys.trim().parse::<u32>().unwrap_or(0) >= 4, "keys: {keys}");

    let schema = fresh_schema().await;
    let insert = format!(
        "INSERT INTO {schema}.message (uaid, channel_id, chid_message_id, version, ttl, expiry, \
         topic, timestamp, data, sortkey_timestamp, headers, reliability_id) \
         VALUES ('u', 'c', '02:1:c', 'v', 60, 2, NULL, 1, '', 1, 'null', NULL) \
         ON CONFLICT (chid_message_id) DO UPDATE SET version = EXCLUDED.version"
    );
    postgres::psql(&insert).await;
    postgres::psql(&insert).await;
}

/// A message autopush-rs stored, under its key (its millisecond sort-key
/// timestamp unpadded, where ours pads it): ours read it, and an ack or a
/// settle, alone or in a batch, deletes it by the key read, conditional on
/// its version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_autopush_rs_stored_are_acked_under_its_key() {
    use autopush_common::User;
    use autopush_common::receipt::MessageState;
    use autopush_common::time::now_secs;
    use autopush_storage::Storage;
    use uuid::Uuid;

    let store = postgres::fresh_autopush_rs_store().await;
    let settings = store.settings().clone();
    let uaid = Uuid::new_v4();
    store
        .add_user(&User::new_webpush(uaid, "http://n", 1))
        .await
        .unwrap();
    let now = now_secs();
    let versions = ["acked", "settled", "batched 1", "batched 2"];
    for (i, version) in versions.iter().enumerate() {
        let chid = Uuid::new_v4();
        let ms = now * 1000 + i as u64;
        // As autopush-rs's save_message writes it.
        postgres::psql(&format!(
            "INSERT INTO {} (uaid, channel_id, chid_message_id, version, ttl, expiry, topic, \
             timestamp, data, sortkey_timestamp, headers) VALUES ('{}', '{}', '02:{ms}:{}', \
             '{version}', 600, {}, NULL, {now}, 'x', {ms}, 'null')",
            settings.qualified(&settings.message_table),
            uaid.simple(),
            chid.simple(),
            chid.hyphenated(),
            now + 600,
        ))
        .await;
    }
    let stored = store.fetch_messages(&uaid, 10).await.unwrap();
    assert_eq!(stored.len(), 4);
    let (batched, one_by_one): (Vec<_>, Vec<_>) = stored
        .iter()
        .partition(|m| m.version.starts_with("batched"));
    let mut batch: Vec<_> = batched
        .iter()
        .map(|m| (m.sort_key(), m.version.clone()))
        .collect();
    batch.push((batched[0].sort_key(), "other".into()));
    let settled = store.settle_messages(&uaid, &batch, MessageState::Delivered);
    assert_eq!(settled.await.unwrap(), [true, true, false], "batch");
    for m in one_by_one {
        let key = m.sort_key();
        assert!(
            store.read_message(&uaid, &key).await.unwrap().is_some(),
            "not read by its key"
        );
        assert!(!store.remove_message(&uaid, &key, "other").await.unwrap());
        let gone = match m.version.as_str() {
            "acked" => store.remove_message(&uaid, &key, &m.version).await,
            _ => {
                let state = MessageState::Delivered;
                store.settle_message(&uaid, &key, &m.version, state).await
            }
        };
        assert!(gone.unwrap(), "{} not deleted under its key", m.version);
    }
    assert_eq!(store.count_messages(&uaid, 10).await.unwrap(), 0);
}
