//! An application server pushing at a fixed rate (open loop) over many
//! HTTP/1.1 keep-alive connections, as the bridge scenarios use it.
//!
//! Each connection sends its share of the rate on its own schedule, offset
//! so that the connections interleave; one connection carries one push at a
//! time, so the connections bound the pushes in flight (2 000 by default:
//! 10 000 pushes/s at 200 ms each). Latency is measured from the moment a
//! push was *due*, so a server (or generator) that falls behind shows up as
//! latency instead of as a lower rate (no coordinated omission). A rate of 0
//! is a closed loop: every connection as fast as it goes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::time::sleep_until;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::app_server::{AppServer, Bodies, Connection};
use crate::server::cpu_ticks;
use crate::stats::{Latencies, offered_cell, rate, refused_cell};

/// Who pushes, to what, over how many connections.
pub struct Load {
    pub endpoint_url: String,
    pub sender: Arc<AppServer>,
    pub bodies: Arc<Bodies>,
    pub endpoints: Arc<Vec<String>>,
    pub connections: usize,
    pub seconds: u64,
}

impl Load {
    /// VAPID-signed pushes from one application server to `endpoints`
    /// behind `endpoint_url`.
    pub fn new(
        endpoint_url: &str,
        endpoints: Vec<String>,
        connections: usize,
        seconds: u64,
    ) -> Load {
        let sender = Arc::new(AppServer::new(endpoint_url));
        let bodies = Arc::new(Bodies::new(
            &URL_SAFE_NO_PAD
                .decode(sender.public_key())
                .unwrap_or_default(),
        ));
        Load {
            endpoint_url: endpoint_url.to_owned(),
            sender,
            bodies,
            endpoints: Arc::new(endpoints),
            connections,
            seconds,
        }
    }
}

/// What one rate gave.
pub struct Outcome {
    pub accepted: usize,
    /// From the first push due to the last answer.
    pub elapsed: Duration,
    /// Of the accepted pushes, from due to 201.
    pub latencies: Latencies,
    /// Answers other than 201, by status (0: no answer).
    pub refused: BTreeMap<u16, usize>,
    /// The most pushes that were ever waiting for their answer at once.
    pub most_in_flight: usize,
}

/// The open connections of a load, opened once and reused across rates.
pub struct Connections {
    open: Vec<Connection>,
}

impl Connections {
    /// Open `load.connections` connections (the server's accept queue
    /// bounds how many open at once, so they open a few hundred at a time).
    pub async fn open(load: &Load) -> Connections {
        let mut open = Vec::with_capacity(load.connections);
        while open.len() < load.connections {
            let batch = (load.connections - open.len()).min(256);
            let opening: Vec<_> = (0..batch)
                .map(|_| {
                    let url = load.endpoint_url.clone();
                    tokio::spawn(async move { Connection::open(&url).await })
                })
                .collect();
            for task in opening {
                match task.await {
                    Ok(Ok(connection)) => open.push(connection),
                    Ok(Err(error)) => panic!("cannot open a connection to the endpoint: {error}"),
                    Err(error) => panic!("a connection task failed: {error}"),
                }
            }
        }
        Connections { open }
    }
}

/// Push at `offered` per second (0: closed loop) for `load.seconds` over
/// `connections`, which it gives back.
pub async fn push(load: &Load, connections: Connections, offered: u64) -> (Outcome, Connections) {
    let count = connections.open.len().max(1);
    let started = Instant::now();
    let end = started + Duration::from_secs(load.seconds);
    let period = (offered > 0).then(|| Duration::from_secs_f64(count as f64 / offered as f64));
    let next = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most_in_flight = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(count);
    for (i, mut connection) in connections.open.into_iter().enumerate() {
        let first = started + period.map_or(Duration::ZERO, |p| p.mul_f64(i as f64 / count as f64));
        let (sender, bodies, endpoints) = (
            load.sender.clone(),
            load.bodies.clone(),
            load.endpoints.clone(),
        );
        let (next, in_flight, most_in_flight) =
            (next.clone(), in_flight.clone(), most_in_flight.clone());
        tasks.push(tokio::spawn(async move {
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            let mut latencies = Latencies::default();
            let mut due = first;
            let mut usable = true;
            let mut last_answer = None;
            loop {
                if period.is_some() {
                    sleep_until(due.into()).await;
                } else {
                    due = Instant::now();
                }
                if due >= end || !usable {
                    break;
                }
                let target = next.fetch_add(1, Ordering::Relaxed) % endpoints.len();
                let now = in_flight.fetch_add(1, Ordering::Relaxed) + 1;
                most_in_flight.fetch_max(now, Ordering::Relaxed);
                let status = connection
                    .push(
                        &endpoints[target],
                        sender.authorization(),
                        bodies.stamped(0),
                    )
                    .await;
                in_flight.fetch_sub(1, Ordering::Relaxed);
                last_answer = Some(Instant::now());
                let status = status.unwrap_or_else(|_| {
                    usable = false;
                    0
                });
                *statuses.entry(status).or_default() += 1;
                if status == 201 {
                    latencies.record(due.elapsed());
                }
                if let Some(period) = period {
                    due += period;
                }
            }
            (statuses, latencies, connection, usable, last_answer)
        }));
    }
    let mut refused: BTreeMap<u16, usize> = BTreeMap::new();
    let mut latencies = Latencies::default();
    let mut open = Vec::with_capacity(count);
    let mut last_answer = started;
    for task in tasks {
        if let Ok((counts, samples, connection, usable, last)) = task.await {
            last_answer = last_answer.max(last.unwrap_or(started));
            for (status, n) in counts {
                *refused.entry(status).or_default() += n;
            }
            latencies.extend(samples);
            if usable {
                open.push(connection);
            }
        }
    }
    // Until the last answer: a connection's wait for its next due time
    // past the end is not part of the run.
    let elapsed = last_answer.duration_since(started);
    let accepted = refused.remove(&201).unwrap_or(0);
    // A connection that failed is replaced for the next rate.
    while open.len() < count {
        match Connection::open(&load.endpoint_url).await {
            Ok(connection) => open.push(connection),
            Err(_) => break,
        }
    }
    let outcome = Outcome {
        accepted,
        elapsed,
        latencies,
        refused,
        most_in_flight: most_in_flight.load(Ordering::Relaxed),
    };
    (outcome, Connections { open })
}

/// One push, which must be accepted: what the first push sets up (an
/// access token, a connection upstream) is not part of any rate.
pub async fn warm_up(load: &Load) {
    let mut connection = Connection::open(&load.endpoint_url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the endpoint: {e}"));
    let status = connection
        .push(
            &load.endpoints[0],
            load.sender.authorization(),
            load.bodies.stamped(0),
        )
        .await
        .unwrap_or_else(|e| panic!("the first push failed: {e}"));
    assert_eq!(status, 201, "the first push was answered {status}");
}

/// One rate of a bridge scenario, with the CPU (clock ticks) the server,
/// the upstream's stand-in and this generator each spent on it.
pub struct Measured {
    pub offered: u64,
    pub outcome: Outcome,
    pub server_cpu: u64,
    pub stand_in_cpu: u64,
    pub generator_cpu: u64,
}

/// Push at `offered` per second as [`push`] does, measuring the CPU of the
/// server and of the stand-in with `server_ticks` and `stand_in_ticks`.
pub async fn push_measured(
    load: &Load,
    connections: Connections,
    offered: u64,
    server_ticks: impl Fn() -> u64,
    stand_in_ticks: impl Fn() -> u64,
) -> (Measured, Connections) {
    let me = std::process::id();
    let before = (server_ticks(), stand_in_ticks(), cpu_ticks(me));
    let (outcome, connections) = push(load, connections, offered).await;
    let measured = Measured {
        offered,
        outcome,
        server_cpu: server_ticks().saturating_sub(before.0),
        stand_in_cpu: stand_in_ticks().saturating_sub(before.1),
        generator_cpu: cpu_ticks(me).saturating_sub(before.2),
    };
    (measured, connections)
}

impl Measured {
    /// The table cells every bridge scenario prints, from offered to
    /// non-201: offered, accepted, p50, p99, max, most in flight, server CPU,
    /// server CPU per push, stand-in CPU, generator CPU, non-201.
    pub fn cells(&mut self) -> String {
        let step = &mut self.outcome;
        format!(
            "{} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {}",
            offered_cell(self.offered),
            rate(step.accepted, step.elapsed),
            step.latencies.percentile_ms(50.0),
            step.latencies.percentile_ms(99.0),
            step.latencies.percentile_ms(100.0),
            step.most_in_flight,
            cpu_percent(self.server_cpu, step.elapsed),
            micros_per_push(self.server_cpu, step.accepted),
            cpu_percent(self.stand_in_cpu, step.elapsed),
            cpu_percent(self.generator_cpu, step.elapsed),
            refused_cell(&step.refused),
        )
    }
}

/// Microseconds of one core per push, from clock ticks (1/100 s).
pub fn micros_per_push(ticks: u64, pushes: usize) -> f64 {
    if pushes == 0 {
        return 0.0;
    }
    ticks as f64 * 10_000.0 / pushes as f64
}

/// Percent of one core over `elapsed`, from clock ticks.
pub fn cpu_percent(ticks: u64, elapsed: Duration) -> f64 {
    ticks as f64 / elapsed.as_secs_f64().max(1e-9)
}
