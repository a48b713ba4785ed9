//! Direct delivery: K connected clients, an application server pushing
//! VAPID-signed ~2 KB aes128gcm bodies at a fixed rate (open loop), and the
//! time from the moment each POST was due to the moment its client had the
//! notification on the websocket.
//!
//! Latency is measured from the *scheduled* send time, so a generator or
//! server that falls behind shows up as latency instead of hiding it
//! (no coordinated omission). A rate of 0 means "as fast as the connections
//! go" (closed loop): the node's ceiling.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tokio::time::sleep_until;

use crate::app_server::{AppServer, Bodies, Connection, read_stamp};
use crate::client::{PushClient, source_address};
use crate::server::{Server, ServerUnderTest};
use crate::stats::{Latencies, offered_cell, rate, refused_cell};

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
            &server,
            options.clients,
            &public_key,
            &deliveries,
            options.ack_delay,
        )
        .await,
    );

    println!(
        "\n{} clients acking after {} ms, {} HTTP connections, VAPID cache {}, durable direct {}, receipts {}, rate limits {}\n",
        options.clients,
        options.ack_delay.as_millis(),
        options.connections,
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
    for &offered in &options.rates {
        let offered = if offered == u64::MAX {
            // "half": half the ceiling measured so far.
            (ceiling / 2.0) as u64
        } else {
            offered
        };
        let step = run_step(
            &server,
            &sender,
            &bodies,
            &endpoints,
            &deliveries,
            offered,
            options,
        )
        .await;
        if offered == 0 {
            ceiling = step.delivered_per_s;
        }
        step.print(offered);
        all_delivered &= step.lost == 0 && step.refused.is_empty();
    }
    all_delivered
}

/// Connect `count` clients, each registered with the sender's key, each
/// recording every notification's latency and acknowledging it `ack_delay`
/// later.
async fn connect_clients(
    server: &Server,
    count: usize,
    public_key: &str,
    deliveries: &Arc<Deliveries>,
    ack_delay: Duration,
) -> Vec<String> {
    let mut endpoints = Vec::with_capacity(count);
    for i in 0..count {
        let mut client = PushClient::connect(&server.ws_url, source_address(i), None)
            .await
            .expect("a client connects");
        endpoints.push(client.register(Some(public_key)).await.expect("register"));
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
}

/// Push at `offered` per second (0: closed loop) for `options.seconds`, then
/// wait for every accepted push to arrive.
async fn run_step(
    server: &Server,
    sender: &Arc<AppServer>,
    bodies: &Arc<Bodies>,
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
        let (sender, bodies, endpoints, deliveries, next_client) = (
            sender.clone(),
            bodies.clone(),
            endpoints.clone(),
            deliveries.clone(),
            next_client.clone(),
        );
        let url = server.endpoint_url.clone();
        senders.push(tokio::spawn(async move {
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            let Ok(mut connection) = Connection::open(&url).await else {
                *statuses.entry(0).or_default() += 1;
                return statuses;
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
                let status = connection
                    .push(
                        &endpoints[target],
                        sender.authorization(),
                        bodies.stamped(stamp),
                    )
                    .await
                    .unwrap_or(0);
                *statuses.entry(status).or_default() += 1;
                if let Some(period) = period {
                    due += period;
                }
            }
            statuses
        }));
    }
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for sender in senders {
        if let Ok(counts) = sender.await {
            for (status, count) in counts {
                *statuses.entry(status).or_default() += count;
            }
        }
    }
    let sending = started.elapsed();
    let accepted = statuses.remove(&201).unwrap_or(0);
    // Every accepted push is delivered; give stragglers up to 30 s.
    let deadline = Instant::now() + Duration::from_secs(30);
    while deliveries.count.load(Ordering::Acquire) < accepted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let delivering = started.elapsed();
    let delivered = deliveries.count.load(Ordering::Acquire);
    if delivered < accepted {
        eprintln!(
            "warning: {} accepted pushes not delivered within 30 s",
            accepted - delivered
        );
    }
    let cpu_ticks = server.cpu_ticks().saturating_sub(cpu_before);
    let mut latencies = deliveries
        .latencies
        .lock()
        .map(|mut l| std::mem::take(&mut *l))
        .unwrap_or_default();
    Step {
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
