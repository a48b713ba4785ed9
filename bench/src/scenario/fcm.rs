//! The FCM bridge: devices registered through `/v1/fcm/...`, an application
//! server pushing VAPID-signed ~2 KB bodies to them, and the local stand-in
//! for Google (`autopush_tests::google`) answering `messages:send` after a
//! fixed delay. Latency is the sender's: from the moment a POST was due
//! until its 201, which covers the round trip to FCM. Also counted: the
//! access tokens fetched (one per token lifetime is the goal) and the
//! messages Google received (every accepted push).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use autopush_tests::google::Google;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::json;
use tokio::time::sleep_until;

use crate::app_server::{AppServer, Bodies, Connection};
use crate::server::Server;
use crate::stats::{Latencies, offered_cell, rate, refused_cell};

pub struct Options {
    pub devices: usize,
    pub connections: usize,
    /// Milliseconds FCM takes to answer, one run each.
    pub delays_ms: Vec<u64>,
    /// Offered pushes per second, in order; 0 is a closed loop.
    pub rates: Vec<u64>,
    pub seconds: u64,
}

/// Returns whether every push was accepted and reached Google on one token.
pub async fn run(options: &Options, log: &Path) -> bool {
    println!(
        "\n{} FCM devices, {} HTTP connections, {} s per rate\n",
        options.devices, options.connections, options.seconds
    );
    println!(
        "| FCM answers after (ms) | offered (/s) | accepted (/s) | p50 (ms) | p99 (ms) | max (ms) | server CPU (%) | non-201 | reached FCM | token fetches |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    let mut all_good = true;
    for &delay in &options.delays_ms {
        all_good &= run_delay(options, Duration::from_millis(delay), log).await;
    }
    all_good
}

async fn run_delay(options: &Options, delay: Duration, log: &Path) -> bool {
    let google = Google::start().await;
    google.set_delay(delay);
    google.count_only();
    let apps = json!({"bench": {
        "project_id": "autopush-bench",
        "credential": google.service_account().to_string(),
        "base_url": google.base_url(),
        "max_in_flight": 100_000,
    }})
    .to_string();
    let server = Server::start(&["--fcm-credentials", &apps], log).await;
    let sender = Arc::new(AppServer::new(&server.endpoint_url));
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD
            .decode(sender.public_key())
            .unwrap_or_default(),
    ));
    let endpoints = Arc::new(register(&server, options.devices).await);
    let mut all_good = true;
    for &offered in &options.rates {
        let before = google.received_count();
        let step = run_step(&server, &sender, &bodies, &endpoints, offered, options).await;
        let reached = google.received_count() - before;
        let (offered, refused) = (offered_cell(offered), refused_cell(&step.refused));
        println!(
            "| {} | {offered} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} | {refused} | {reached} | {} |",
            delay.as_millis(),
            step.accepted_per_s,
            step.p50,
            step.p99,
            step.max,
            step.cpu_percent,
            google.token_fetches(),
        );
        all_good &= step.refused.is_empty() && reached == step.accepted as u64;
    }
    all_good && google.token_fetches() == 1
}

/// Register `count` FCM devices; their push endpoints.
async fn register(server: &Server, count: usize) -> Vec<String> {
    let url = format!("{}/v1/fcm/bench/registration", server.endpoint_url);
    let mut endpoints = Vec::with_capacity(count);
    for i in 0..count {
        let body = json!({"token": format!("bench-device-{i}")}).to_string();
        let reply = autopush_tests::http::request(
            reqwest::Method::POST,
            &url,
            &[("content-type", "application/json")],
            Some(body.into_bytes()),
        )
        .await;
        let endpoint = reply.json["endpoint"]
            .as_str()
            .unwrap_or_else(|| panic!("registration failed: {} {}", reply.status, reply.text));
        endpoints.push(endpoint.to_owned());
    }
    endpoints
}

struct Step {
    accepted: usize,
    accepted_per_s: f64,
    p50: f64,
    p99: f64,
    max: f64,
    cpu_percent: f64,
    refused: BTreeMap<u16, usize>,
}

/// Push at `offered` per second (0: closed loop) for `options.seconds`.
async fn run_step(
    server: &Server,
    sender: &Arc<AppServer>,
    bodies: &Arc<Bodies>,
    endpoints: &Arc<Vec<String>>,
    offered: u64,
    options: &Options,
) -> Step {
    let started = Instant::now();
    let cpu_before = server.cpu_ticks();
    let end = started + Duration::from_secs(options.seconds);
    let next = Arc::new(AtomicUsize::new(0));
    let mut senders = Vec::new();
    for i in 0..options.connections {
        let period = (offered > 0)
            .then(|| Duration::from_secs_f64(options.connections as f64 / offered as f64));
        let first = started
            + period.map_or(Duration::ZERO, |p| {
                p.mul_f64(i as f64 / options.connections as f64)
            });
        let (sender, bodies, endpoints, next) = (
            sender.clone(),
            bodies.clone(),
            endpoints.clone(),
            next.clone(),
        );
        let url = server.endpoint_url.clone();
        senders.push(tokio::spawn(async move {
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            let mut latencies = Latencies::default();
            let Ok(mut connection) = Connection::open(&url).await else {
                *statuses.entry(0).or_default() += 1;
                return (statuses, latencies);
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
                let target = next.fetch_add(1, Ordering::Relaxed) % endpoints.len();
                let status = connection
                    .push(
                        &endpoints[target],
                        sender.authorization(),
                        bodies.stamped(0),
                    )
                    .await
                    .unwrap_or(0);
                *statuses.entry(status).or_default() += 1;
                if status == 201 {
                    latencies.record(due.elapsed());
                }
                if let Some(period) = period {
                    due += period;
                }
            }
            (statuses, latencies)
        }));
    }
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut latencies = Latencies::default();
    for sender in senders {
        if let Ok((counts, samples)) = sender.await {
            for (status, count) in counts {
                *statuses.entry(status).or_default() += count;
            }
            latencies.extend(samples);
        }
    }
    let elapsed = started.elapsed();
    let accepted = statuses.remove(&201).unwrap_or(0);
    let cpu_ticks = server.cpu_ticks().saturating_sub(cpu_before);
    Step {
        accepted,
        accepted_per_s: rate(accepted, elapsed),
        p50: latencies.percentile_ms(50.0),
        p99: latencies.percentile_ms(99.0),
        max: latencies.percentile_ms(100.0),
        cpu_percent: cpu_ticks as f64 / elapsed.as_secs_f64(),
        refused: statuses,
    }
}
