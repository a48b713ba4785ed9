//! Direct delivery: K connected clients, an application server pushing
//! VAPID-signed ~2 KB aes128gcm bodies at a fixed rate (open loop), and the
//! time from the moment each POST was due to the moment its client had the
//! notification on the websocket.
//!
//! Latency is measured from the *scheduled* send time, so a generator or
//! server that falls behind shows up as latency instead of hiding it
//! (no coordinated omission). A rate of 0 means "as fast as the connections
//! go" (closed loop): the node's ceiling.
//!
//! The clients, and the application server, may be a round trip away: their
//! connections then go through a latency stand-in ([`crate::delay`]). Per
//! sender connection it reports pushes per second and POST → 201, and per
//! step the server's RSS, its data directory's growth per push, and (on moto
//! and Bigtable) the store's requests per push.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tokio::time::sleep_until;

use crate::app_server::{AppServer, Bodies, Connection, read_stamp};
use crate::client::connect_many;
use crate::delay::{DelayProxy, Latency};
use crate::server::{Server, ServerUnderTest};
use crate::stats::{Latencies, offered_cell, per_push_cell, rate, refused_cell};
use crate::wire::Counts;

pub struct Options {
    pub clients: usize,
    pub connections: usize,
    pub rates: Vec<u64>,
    pub seconds: u64,
    pub vapid_cache: bool,
    /// The server's `--durable-direct`: write before delivering, delete on ack.
    pub durable_direct: bool,
    /// The server's `--receipt-retention` (0: receipts off).
    pub receipt_retention: u64,
    /// The server's per-sender limit on (never reached) or off.
    pub rate_limits: bool,
    /// How long each client waits before it acks a notification: a client
    /// across a real network acks a round trip later, not at once.
    pub ack_delay: Duration,
    /// Whether clients ack at all.
    pub ack: bool,
    /// How far the clients are from the server.
    pub client_latency: Latency,
    /// How far the application server is from the endpoint.
    pub sender_latency: Latency,
}

/// What the receiving clients saw, shared by all of them.
struct Deliveries {
    epoch: Instant,
    /// Stamps (ns since `epoch`) below this belong to an earlier step.
    step_start: AtomicU64,
    count: AtomicUsize,
    latencies: Mutex<Latencies>,
}

/// Returns whether every push was accepted and delivered.
pub async fn run(options: &Options, under_test: &ServerUnderTest) -> bool {
    let mut flags = vec![
        "--durable-direct",
        if options.durable_direct {
            "true"
        } else {
            "false"
        },
    ];
    let retention = options.receipt_retention.to_string();
    flags.extend(["--receipt-retention", &retention]);
    if !options.vapid_cache {
        flags.extend(["--vapid-cache-size", "0"]);
    }
    if !options.rate_limits {
        flags.extend(["--sender-limit", "0"]);
    }
    let server = Server::open(under_test, &flags).await;
    let (_client_proxy, ws_url) = through(&server.ws_url, options.client_latency).await;
    let (_sender_proxy, push_url) = through(&server.endpoint_url, options.sender_latency).await;
    let sender = Arc::new(AppServer::new(&server.endpoint_url));
    let public_key = sender.public_key();
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD.decode(&public_key).unwrap_or_default(),
    ));

    let deliveries = Arc::new(Deliveries {
        epoch: Instant::now(),
        step_start: AtomicU64::new(0),
        count: AtomicUsize::new(0),
        latencies: Mutex::new(Latencies::default()),
    });
    let endpoints = Arc::new(
        connect_clients(
            &ws_url,
            options.clients,
            &public_key,
            &deliveries,
            options.ack.then_some(options.ack_delay),
        )
        .await,
    );

    let acking = if options.ack {
        format!("acking after {} ms", options.ack_delay.as_millis())
    } else {
        "never acking".to_owned()
    };
    println!(
        "\n{} clients {} ms away (round trip) {acking}, {} HTTP connections {} ms away, VAPID cache {}, durable direct {}, receipts {}, rate limits {}\n",
        options.clients,
        options.client_latency.rtt.as_millis(),
        options.connections,
        options.sender_latency.rtt.as_millis(),
        if options.vapid_cache { "on" } else { "off" },
        if options.durable_direct { "on" } else { "off" },
        if options.receipt_retention > 0 {
            "on"
        } else {
            "off"
        },
        if options.rate_limits { "on" } else { "off" }
    );
    println!(
        "| offered (/s) | accepted (/s) | delivered (/s) | p50 (ms) | p99 (ms) | max (ms) | server CPU (%) | non-201 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut ceiling = 0.0;
    let mut all_delivered = true;
    let mut steps = Vec::new();
    let pusher = Pusher {
        app: sender,
        bodies,
        url: push_url,
    };
    for &offered in &options.rates {
        let offered = if offered == u64::MAX {
            // "half": half the ceiling measured so far.
            (ceiling / 2.0) as u64
        } else {
            offered
        };
        let step = run_step(&server, &pusher, &endpoints, &deliveries, offered, options).await;
        if offered == 0 {
            ceiling = step.delivered_per_s;
        }
        step.print(offered);
        all_delivered &= (step.lost == 0 || !options.ack) && step.refused.is_empty();
        steps.push((offered, step));
    }
    println!(
        "\n| offered (/s) | per sender connection (/s) | slowest connection (/s) | POST → 201 p50 (ms) | p99 (ms) | server RSS after (MiB) | data dir growth (B/push) | store requests per push |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    for (offered, step) in &mut steps {
        step.print_per_connection(*offered);
    }
    all_delivered
}

/// `url` itself, or the URL of a latency stand-in in front of it.
async fn through(url: &str, latency: Latency) -> (Option<DelayProxy>, String) {
    if latency.is_zero() {
        (None, url.to_owned())
    } else {
        let (proxy, proxied) = DelayProxy::in_front_of(url, latency).await;
        (Some(proxy), proxied)
    }
}

/// Connect `count` clients to `ws_url`, each registered with the sender's
/// key, each recording every notification's latency and acknowledging it
/// `ack_delay` later (`None`: never).
async fn connect_clients(
    ws_url: &str,
    count: usize,
    public_key: &str,
    deliveries: &Arc<Deliveries>,
    ack_delay: Option<Duration>,
) -> Vec<String> {
    let clients = connect_many(ws_url, count, public_key)
        .await
        .unwrap_or_else(|e| panic!("a client connects and registers: {e}"));
    let mut endpoints = Vec::with_capacity(count);
    for (mut client, endpoint) in clients {
        endpoints.push(endpoint);
        let deliveries = deliveries.clone();
        tokio::spawn(async move {
            while let Ok(Some(received)) = client.next_notification().await {
                let stamp = received.data.as_deref().and_then(read_stamp);
                if let Some(stamp) = stamp
                    && stamp >= deliveries.step_start.load(Ordering::Acquire)
                {
                    let latency = deliveries
                        .epoch
                        .elapsed()
                        .saturating_sub(Duration::from_nanos(stamp));
                    deliveries.count.fetch_add(1, Ordering::AcqRel);
                    if let Ok(mut latencies) = deliveries.latencies.lock() {
                        latencies.record(latency);
                    }
                }
                let Some(ack_delay) = ack_delay else {
                    continue;
                };
                if !ack_delay.is_zero() {
                    tokio::time::sleep(ack_delay).await;
                }
                if client.ack(&received).await.is_err() {
                    break;
                }
            }
        });
    }
    endpoints
}

struct Step {
    accepted_per_s: f64,
    delivered_per_s: f64,
    p50: f64,
    p99: f64,
    max: f64,
    cpu_percent: f64,
    refused: BTreeMap<u16, usize>,
    /// Accepted but never delivered.
    lost: usize,
    /// Accepted pushes per second over each sender connection.
    per_connection: Vec<f64>,
    /// POST → response, every push.
    answers: Latencies,
    rss_kib: u64,
    /// Growth of the data directory, bytes (`None`: not ours).
    data_growth: Option<i64>,
    accepted: usize,
    /// Requests to the shared store during the step (moto, Bigtable).
    requests: Option<Counts>,
}

impl Step {
    fn print(&self, offered: u64) {
        let (offered, refused) = (offered_cell(offered), refused_cell(&self.refused));
        println!(
            "| {offered} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} | {refused} |",
            self.accepted_per_s,
            self.delivered_per_s,
            self.p50,
            self.p99,
            self.max,
            self.cpu_percent
        );
    }

    fn print_per_connection(&mut self, offered: u64) {
        let mean =
            self.per_connection.iter().sum::<f64>() / self.per_connection.len().max(1) as f64;
        let slowest = self
            .per_connection
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let per_push = |bytes: i64| bytes as f64 / self.accepted.max(1) as f64;
        println!(
            "| {} | {mean:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {} | {} |",
            offered_cell(offered),
            if slowest.is_finite() { slowest } else { 0.0 },
            self.answers.percentile_ms(50.0),
            self.answers.percentile_ms(99.0),
            self.rss_kib as f64 / 1024.0,
            self.data_growth
                .map_or("-".to_owned(), |bytes| format!("{:.0}", per_push(bytes))),
            self.requests
                .as_ref()
                .map_or("-".to_owned(), |counts| per_push_cell(
                    counts,
                    self.accepted
                )),
        );
    }
}

/// Push at `offered` per second (0: closed loop) for `options.seconds`, then
/// wait for every accepted push to arrive.
/// The application server: its key, its bodies, and the URL its
/// connections go to (the endpoint, or a latency stand-in in front of it).
struct Pusher {
    app: Arc<AppServer>,
    bodies: Arc<Bodies>,
    url: String,
}

async fn run_step(
    server: &Server,
    pusher: &Pusher,
    endpoints: &Arc<Vec<String>>,
    deliveries: &Arc<Deliveries>,
    offered: u64,
    options: &Options,
) -> Step {
    let started = Instant::now();
    let start_ns = started.duration_since(deliveries.epoch).as_nanos() as u64;
    deliveries.step_start.store(start_ns, Ordering::Release);
    deliveries.count.store(0, Ordering::Release);
    if let Ok(mut latencies) = deliveries.latencies.lock() {
        *latencies = Latencies::default();
    }
    let cpu_before = server.cpu_ticks();
    let data_before = server.data_bytes();
    let _ = server.take_requests();
    let end = started + Duration::from_secs(options.seconds);
    let next_client = Arc::new(AtomicUsize::new(0));
    let mut senders = Vec::new();
    for i in 0..options.connections {
        // Each connection sends its share of the rate on its own schedule,
        // offset so that the connections interleave.
        let period = (offered > 0)
            .then(|| Duration::from_secs_f64(options.connections as f64 / offered as f64));
        let first = started
            + period.map_or(Duration::ZERO, |p| {
                p.mul_f64(i as f64 / options.connections as f64)
            });
        let url = pusher.url.clone();
        let (sender, bodies, endpoints, deliveries, next_client) = (
            pusher.app.clone(),
            pusher.bodies.clone(),
            endpoints.clone(),
            deliveries.clone(),
            next_client.clone(),
        );
        senders.push(tokio::spawn(async move {
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            let mut answers = Latencies::default();
            let Ok(mut connection) = Connection::open(&url).await else {
                *statuses.entry(0).or_default() += 1;
                return (statuses, answers);
            };
            let mut due = first;
            loop {
                if period.is_some() {
                    sleep_until(due.into()).await;
                } else {
                    due = Instant::now();
                }
                if due >= end {
                    break;
                }
                let stamp = due.duration_since(deliveries.epoch).as_nanos() as u64;
                let target = next_client.fetch_add(1, Ordering::Relaxed) % endpoints.len();
                let posted = Instant::now();
                let status = connection
                    .push(
                        &endpoints[target],
                        sender.authorization(),
                        bodies.stamped(stamp),
                    )
                    .await
                    .unwrap_or(0);
                answers.record(posted.elapsed());
                *statuses.entry(status).or_default() += 1;
                if let Some(period) = period {
                    due += period;
                }
            }
            (statuses, answers)
        }));
    }
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut answers = Latencies::default();
    let mut per_connection_accepted = Vec::new();
    for sender in senders {
        if let Ok((counts, latencies)) = sender.await {
            per_connection_accepted.push(counts.get(&201).copied().unwrap_or(0));
            for (status, count) in counts {
                *statuses.entry(status).or_default() += count;
            }
            answers.extend(latencies);
        }
    }
    let sending = started.elapsed();
    let accepted = statuses.remove(&201).unwrap_or(0);
    // Every accepted push is delivered; give stragglers up to 30 s. Clients
    // that never ack get what the server sends before it holds the rest
    // back for them: a short wait, and no failure.
    let straggling = if options.ack {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(2)
    };
    let deadline = Instant::now() + straggling;
    while deliveries.count.load(Ordering::Acquire) < accepted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let delivering = started.elapsed();
    let delivered = deliveries.count.load(Ordering::Acquire);
    if delivered < accepted {
        eprintln!(
            "{}: {} accepted pushes not delivered within {straggling:?}",
            if options.ack {
                "warning"
            } else {
                "note (clients never ack)"
            },
            accepted - delivered
        );
    }
    let cpu_ticks = server.cpu_ticks().saturating_sub(cpu_before);
    let mut latencies = deliveries
        .latencies
        .lock()
        .map(|mut l| std::mem::take(&mut *l))
        .unwrap_or_default();
    let data_growth = data_before
        .zip(server.data_bytes())
        .map(|(before, after)| after as i64 - before as i64);
    Step {
        per_connection: per_connection_accepted
            .iter()
            .map(|&n| rate(n, sending))
            .collect(),
        answers,
        rss_kib: server.rss_kib(),
        data_growth,
        accepted,
        requests: server.take_requests(),
        accepted_per_s: rate(accepted, sending),
        delivered_per_s: rate(delivered, delivering),
        p50: latencies.percentile_ms(50.0),
        p99: latencies.percentile_ms(99.0),
        max: latencies.percentile_ms(100.0),
        cpu_percent: cpu_ticks as f64 / delivering.as_secs_f64(),
        refused: statuses,
        lost: accepted.saturating_sub(delivered),
    }
}
