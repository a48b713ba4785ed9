//! PostgreSQL with a standby that takes over, on clusters of each test's
//! own: the DSN names both hosts with `target_session_attrs=read-write`,
//! the primary is killed (`kill -9` to the postmaster) and the standby
//! promoted, and the nodes follow without a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use autopush_common::User;
use autopush_storage::Storage;
use autopush_storage::postgres::{PostgresSettings, PostgresStore};
use autopush_tests::postgres::{self, Cluster};
use autopush_tests::{Node, SendOptions, Server, Subscription, WsClient, scenarios};
use tokio::time::Instant;

/// How long any one wait of these tests may take before it is a hang.
const PATIENCE: Duration = Duration::from_secs(180);

/// Wait until `done` says so, polling; panic saying `what` after
/// [`PATIENCE`].
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "hung waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A primary whose commits wait for its standby (`synchronous_commit=on`,
/// `synchronous_standby_names=*`), and that standby, streaming.
async fn primary_and_synchronous_standby() -> (Cluster, Cluster) {
    let mut primary = Cluster::init();
    primary
        .start(&["synchronous_standby_names=*", "synchronous_commit=on"])
        .await;
    let mut standby = Cluster::standby_of(&primary);
    standby.start(&[]).await;
    wait_for("the standby to stream synchronously", || {
        primary.psql("SELECT sync_state FROM pg_stat_replication") == "sync"
    })
    .await;
    (primary, standby)
}

/// A user agent of the test.
struct Client {
    uaid: String,
    /// Its open socket, for the clients that stay connected.
    ws: Option<WsClient>,
}

/// Every push the senders made: (client, text, status).
type Sent = Arc<Mutex<Vec<(usize, String, u16)>>>;

fn count(sent: &Sent, status: u16) -> usize {
    let sent = sent.lock().unwrap();
    sent.iter().filter(|(_, _, s)| *s == status).count()
}

/// Hello as `uaid` until the node accepts it (a client told 503 and 1013
/// tries again); the socket and how many tries it took.
async fn hello_until_accepted(node: &Server, uaid: &str) -> (WsClient, usize) {
    let deadline = Instant::now() + PATIENCE;
    for tries in 1.. {
        let mut ws = WsClient::connect(&node.ws_url()).await;
        let reply = ws.hello(Some(uaid)).await;
        if reply["status"] == 200 {
            assert_eq!(reply["uaid"], uaid, "the node replaced the uaid: {reply}");
            return (ws, tries);
        }
        assert!(Instant::now() < deadline, "hello still refused: {reply}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    unreachable!()
}

/// Read `ws` until every text of `expected` arrived, acking each, into
/// `read`; `false` if the node closed the socket first.
async fn drain(
    sub: &Subscription,
    ws: &mut WsClient,
    expected: &BTreeSet<String>,
    read: &mut Vec<String>,
) -> bool {
    eprintln!("{}: waiting for {expected:?}", &ws.uaid()[..8]);
    while !expected.iter().all(|t| read.contains(t)) {
        match ws.recv_or_closed().await {
            Ok(n) if n["messageType"] == "notification" => {
                read.push(sub.decrypt(&n).await.text);
                ws.ack_notification(&n).await;
            }
            Ok(_) => {}
            Err(closed) => {
                eprintln!("{}: closed by the node: {closed:?}", &ws.uaid()[..8]);
                return false;
            }
        }
    }
    true
}

/// The primary killed with `kill -9` while senders push to connected and
/// offline clients, the standby promoted: every push answered 201 is
/// delivered, pushes during the outage are answered 503 (the sender's to
/// retry) and nothing else, hellos succeed again, and the endpoint and
/// connection nodes reconnect by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_takes_over_and_nothing_answered_201_is_lost() {
    const CONNECTED: usize = 3;
    const OFFLINE: usize = 3;
    const SENDERS: usize = 2;
    let (primary, standby) = primary_and_synchronous_standby().await;
    let schema = postgres::fresh_schema_on(&primary.dsn()).await;
    let dsn = format!(
        "postgres://postgres@{},{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.host(),
        standby.host()
    );
    let mut args = vec![format!("--db-settings={}", postgres::db_settings(&schema))];
    args.extend(scenarios::cluster_keys().await);
    let node = |role| Node {
        role,
        db: Some(dsn.clone()),
        args: args.clone(),
        ..Node::default()
    };
    let endpoint = Server::start_node(node("endpoint")).await;
    let connection = Server::start_node(Node {
        endpoint_url: Some(endpoint.endpoint_base()),
        ..node("connection")
    })
    .await;

    let mut clients = Vec::new();
    let mut subs = Vec::new();
    for i in 0..CONNECTED + OFFLINE {
        let mut ws = connection.client().await;
        let sub = Subscription::new(&mut ws).await;
        let uaid = ws.uaid().to_owned();
        let ws = match i < CONNECTED {
            true => {
                // Connected clients get theirs at once.
                sub.push_text("before").await;
                let (n, d) = sub.receive(&mut ws).await;
                assert_eq!(d.text, "before");
                ws.ack_notification(&n).await;
                Some(ws)
            }
            false => {
                ws.close().await;
                None
            }
        };
        clients.push(Client { uaid, ws });
        subs.push(sub);
    }

    // Senders push round the clients, with a TTL that outlives the test.
    let subs = Arc::new(subs);
    let sent: Sent = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..SENDERS)
        .map(|s| {
            let (sent, stop, subs) = (sent.clone(), stop.clone(), subs.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let to = (n * SENDERS + s) % subs.len();
                    let text = format!("s{s}-{n}");
                    let res = subs[to].send(&SendOptions::text(&text).ttl(86_400)).await;
                    sent.lock().unwrap().push((to, text, res.status));
                    n += 1;
                }
            })
        })
        .collect();

    wait_for("20 pushes answered 201", || count(&sent, 201) >= 20).await;
    let before_kill = sent.lock().unwrap().len();
    primary.kill9();
    eprintln!("killed the primary (kill -9) after {before_kill} pushes");
    wait_for("4 pushes sent into the outage", || {
        sent.lock().unwrap().len() >= before_kill + 4
    })
    .await;
    standby.promote();
    let at_promotion = count(&sent, 201);
    eprintln!(
        "promoted the standby after {} pushes",
        sent.lock().unwrap().len()
    );
    wait_for("20 pushes answered 201 after the promotion", || {
        count(&sent, 201) >= at_promotion + 20
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for sender in senders {
        sender.await.expect("a sender panicked");
    }

    let sent = sent.lock().unwrap().clone();
    let others: Vec<_> = sent
        .iter()
        .filter(|(_, _, s)| *s != 201 && *s != 503)
        .collect();
    assert!(
        others.is_empty(),
        "answers other than 201 and 503: {others:?}"
    );
    let mut expected: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for (to, text, status) in &sent {
        if *status == 201 {
            expected.entry(*to).or_default().insert(text.clone());
        }
    }
    let accepted = sent.iter().filter(|(_, _, s)| *s == 201).count();
    eprintln!(
        "{} pushes: {accepted} answered 201, {} answered 503",
        sent.len(),
        sent.len() - accepted
    );

    // Connected clients: a push after the promotion arrives on the open
    // socket (a sender retries a 503), after what was sent to it before.
    let mut delivered = 0;
    let mut twice = 0;
    let mut hello_tries = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        let sub = &subs[i];
        let mut want = expected.remove(&i).unwrap_or_default();
        let mut read = Vec::new();
        if let Some(mut ws) = client.ws {
            let live = format!("live-{i}");
            wait_for_201(sub, &live).await;
            want.insert(live.clone());
            if drain(sub, &mut ws, &BTreeSet::from([live]), &mut read).await {
                ws.close().await;
            }
        }
        // Everyone comes back: what is left arrives after the hello.
        want.retain(|t| !read.contains(t));
        let (mut ws, tries) = hello_until_accepted(&connection, &client.uaid).await;
        hello_tries.push(tries);
        assert!(
            drain(sub, &mut ws, &want, &mut read).await,
            "closed before delivering all"
        );
        let unique: BTreeSet<_> = read.iter().collect();
        twice += read.len() - unique.len();
        delivered += unique.len();
    }
    eprintln!(
        "delivered {delivered} ({twice} twice); hellos after the promotion took {hello_tries:?} tries"
    );
}

/// Send `text` until it is answered 201, as a sender retries a 503.
async fn wait_for_201(sub: &Subscription, text: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let res = sub.send(&SendOptions::text(text).ttl(86_400)).await;
        match res.status {
            201 => return,
            503 => assert!(Instant::now() < deadline, "still 503: {}", res.body),
            other => panic!("{other}: {}", res.body),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A host that stops taking writes while the pool holds connections to it
/// (`default_transaction_read_only` set, as a demotion does): a write there
/// fails with SQLSTATE 25006, and the writes after it go to the host that
/// takes writes, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_leave_a_host_that_turned_read_only() {
    let mut a = Cluster::init();
    a.start(&[]).await;
    let mut b = Cluster::init();
    b.start(&[]).await;
    let schema = postgres::schema_name();
    postgres::create_tables_on(&a.dsn(), &schema).await;
    postgres::create_tables_on(&b.dsn(), &schema).await;
    let dsn = format!(
        "postgres://postgres@{},{}/postgres?target_session_attrs=read-write",
        a.host(),
        b.host()
    );
    let settings = PostgresSettings::parse(&dsn, Some(&postgres::db_settings(&schema)))
        .expect("postgres settings");
    let store = PostgresStore::connect(settings).expect("postgres settings");
    let users_on =
        |cluster: &Cluster| cluster.psql(&format!("SELECT count(*) FROM {schema}.router"));
    let add = |i: u64| {
        let user = User::new_webpush(uuid::Uuid::new_v4(), "http://n", 1000 + i);
        let store = &store;
        async move { store.add_user(&user).await }
    };
    for i in 0..3 {
        add(i).await.expect("a write on the first host");
    }
    assert_eq!(users_on(&a), "3");

    a.psql("ALTER SYSTEM SET default_transaction_read_only = on");
    a.psql("SELECT pg_reload_conf()");
    wait_for("the first host to refuse writes", || {
        a.psql("SHOW default_transaction_read_only") == "on"
    })
    .await;
    let mut refused = Vec::new();
    for i in 3..23 {
        match add(i).await {
            Ok(()) if users_on(&b) != "0" => break,
            Ok(()) => {}
            Err(e) => refused.push(e.to_string()),
        }
    }
    eprintln!("refused before a write reached the host that takes writes: {refused:?}");
    assert_eq!(
        users_on(&b),
        "1",
        "{} writes refused, none reached the host that takes writes; the first: {:?}",
        refused.len(),
        refused.first()
    );
    assert!(refused.len() <= 1, "{refused:?}");
}

/// A standby that stopped streaming (behind, as an asynchronous standby
/// may be at any moment) when the primary is killed and it is promoted:
/// what a push sent meanwhile was answered, and whether its client got it
/// after the promotion. A push sent before the standby stopped is delivered.
async fn standby_behind_at_the_kill(synchronous: bool) -> (u16, bool) {
    let mut primary = Cluster::init();
    let options: &[&str] = match synchronous {
        true => &["synchronous_standby_names=*", "synchronous_commit=on"],
        false => &[],
    };
    primary.start(options).await;
    let mut standby = Cluster::standby_of(&primary);
    standby.start(&[]).await;
    let streaming = |n: &str| primary.psql("SELECT count(*) FROM pg_stat_replication") == n;
    wait_for("the standby to stream", || streaming("1")).await;
    let schema = postgres::fresh_schema_on(&primary.dsn()).await;
    let mut args = vec![format!("--db-settings={}", postgres::db_settings(&schema))];
    args.extend(scenarios::cluster_keys().await);
    let node = Server::start_node(Node {
        db: Some(format!(
            "postgres://postgres@{},{}/postgres?target_session_attrs=read-write",
            primary.host(),
            standby.host()
        )),
        args,
        ..Node::default()
    })
    .await;
    let (uaid, sub) = node.offline_subscription(false).await;
    let sub = Arc::new(sub);
    let send = |text: &'static str| {
        let sub = sub.clone();
        tokio::spawn(async move { sub.send(&SendOptions::text(text).ttl(86_400)).await.status })
    };
    let streamed = send("streamed").await.expect("a sender");
    assert_eq!(streamed, 201);
    wait_for("the standby to replay it", || {
        primary.psql("SELECT bool_and(replay_lsn >= pg_current_wal_lsn()) FROM pg_stat_replication")
            == "t"
    })
    .await;
    standby.psql("ALTER SYSTEM SET primary_conninfo = ''");
    standby.psql("SELECT pg_reload_conf()");
    wait_for("the standby to stop streaming", || streaming("0")).await;
    let behind = send("behind");
    match synchronous {
        // Its commit waits for the standby: no answer yet.
        true => {
            wait_for("the commit to wait for the standby", || {
                primary.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
                    == "1"
            })
            .await;
            assert!(!behind.is_finished(), "answered while its commit waited");
        }
        false => wait_for("the answer", || behind.is_finished()).await,
    }

    primary.kill9();
    standby.promote();
    let status = behind.await.expect("a sender");
    let (mut ws, _) = hello_until_accepted(&node, &uaid).await;
    let (n, d) = sub.receive(&mut ws).await;
    assert_eq!(d.text, "streamed");
    ws.ack_notification(&n).await;
    // Stored messages come in the first batch after the hello.
    let delivered = match ws.try_recv_for(autopush_tests::QUIET).await {
        Some(n) => sub.decrypt(&n).await.text == "behind",
        None => false,
    };
    (status, delivered)
}

/// What asynchronous replication loses, so the docs can say it: a push
/// answered 201 while the standby was not streaming is gone once the
/// primary dies and the standby is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_standby_loses_the_201s_it_had_not_received() {
    let (status, delivered) = standby_behind_at_the_kill(false).await;
    assert_eq!(status, 201);
    assert!(!delivered, "delivered: the standby had it after all");
}

/// The same with a synchronous standby: the push is not answered while its
/// commit waits for the standby; once the primary is killed it is answered
/// 503 (the sender's to retry) or, written again on the promoted standby,
/// 201 and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_behind_holds_the_201_back() {
    let (status, delivered) = standby_behind_at_the_kill(true).await;
    eprintln!("answered {status} after the kill, delivered: {delivered}");
    assert!(
        status == 503 || (status == 201 && delivered),
        "answered {status}, delivered: {delivered}"
    );
}
