//! Requests to the shared store per push, counted at the wire: the server
//! on moto or the Bigtable emulator (`--store`), a proxy counting what it
//! sends there (on PostgreSQL, the statements its server ran), and at each client round trip, pushes of each kind:
//!
//! * acked: to connected clients that ack each message as it arrives (a
//!   round trip later at the server);
//! * unacked: to connected clients that never ack;
//! * stored: to clients that are offline;
//! * drained: those stored messages, when their clients come back and ack
//!   them (per message).
//!
//! Each kind's count starts once the clients are connected and the server
//! is quiet, and ends `settle` after the last delivery, so a write the
//! server makes after its 201 (a held copy after its grace, the ack's
//! update) is counted with the push that caused it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::app_server::{AppServer, Bodies, Connection};
use crate::client::{PushClient, connect_many, source_address, wait};
use crate::delay::{DelayProxy, Latency};
use crate::server::{Server, ServerUnderTest};
use crate::stats::{Latencies, per_push_cell};

pub struct Options {
    /// Client round trips, one run each.
    pub rtts: Vec<Duration>,
    /// Pushes per kind and round trip.
    pub pushes: usize,
    pub clients: usize,
    pub connections: usize,
    /// How long the server is given to finish its writes before a count.
    pub settle: Duration,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Acked,
    Unacked,
    Stored,
}

/// Returns whether every push was accepted and delivered.
pub async fn run(options: &Options, under_test: &ServerUnderTest) -> bool {
    let server = Server::open(under_test, &[]).await;
    if server.take_requests().is_none() {
        eprintln!("requests: counting needs a shared store: --store moto, bigtable or postgres");
        return false;
    }
    let sender = Arc::new(AppServer::new(&server.endpoint_url));
    let public_key = sender.public_key();
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD.decode(&public_key).unwrap_or_default(),
    ));
    println!(
        "\n{} pushes of 2 KiB per row to {} clients over {} HTTP connections, server defaults\n",
        options.pushes, options.clients, options.connections
    );
    println!(
        "| client RTT (ms) | push | requests per push | by operation (per push) | POST → 201 p50 (ms) | p99 (ms) |"
    );
    println!("|---:|---|---:|---|---:|---:|");
    let mut all_well = true;
    for &rtt in &options.rtts {
        let (_proxy, ws_url) = if rtt.is_zero() {
            (None, server.ws_url.clone())
        } else {
            let (proxy, url) = DelayProxy::in_front_of(&server.ws_url, Latency::rtt(rtt)).await;
            (Some(proxy), url)
        };
        let row = |kind: &str,
                   counts: &BTreeMap<String, usize>,
                   pushes: usize,
                   answers: &mut Latencies| {
            let total: usize = counts.values().sum();
            println!(
                "| {} | {kind} | {:.2} | {} | {} | {} |",
                rtt.as_millis(),
                total as f64 / pushes.max(1) as f64,
                per_push_cell(counts, pushes),
                cell(answers, 50.0),
                cell(answers, 99.0),
            );
        };
        for kind in [Kind::Acked, Kind::Unacked, Kind::Stored] {
            let run = Run {
                server: &server,
                ws_url: &ws_url,
                sender: &sender,
                bodies: &bodies,
                options,
            };
            match run.measure(kind, &public_key).await {
                Ok(mut measured) => {
                    let name = match kind {
                        Kind::Acked => "acked",
                        Kind::Unacked => "unacked",
                        Kind::Stored => "stored",
                    };
                    row(
                        name,
                        &measured.counts,
                        options.pushes,
                        &mut measured.answers,
                    );
                    if let Some(drained) = measured.drained {
                        row(
                            "stored, drained (reconnect, ack)",
                            &drained,
                            options.pushes,
                            &mut Latencies::default(),
                        );
                    }
                }
                Err(e) => {
                    eprintln!("requests: at {} ms: {e}", rtt.as_millis());
                    all_well = false;
                }
            }
        }
    }
    all_well
}

/// A percentile cell, `-` when there is nothing to report.
fn cell(latencies: &mut Latencies, p: f64) -> String {
    if latencies.is_empty() {
        "-".to_owned()
    } else {
        format!("{:.2}", latencies.percentile_ms(p))
    }
}

struct Run<'a> {
    server: &'a Server,
    ws_url: &'a str,
    sender: &'a Arc<AppServer>,
    bodies: &'a Arc<Bodies>,
    options: &'a Options,
}

struct Measured {
    counts: BTreeMap<String, usize>,
    answers: Latencies,
    /// For stored pushes: the drain's requests.
    drained: Option<BTreeMap<String, usize>>,
}

impl Run<'_> {
    async fn measure(
        &self,
        kind: Kind,
        public_key: &str,
    ) -> Result<Measured, crate::client::BenchError> {
        let options = self.options;
        // Clients: connected and reading (acking or not), or gone.
        let received = Arc::new(AtomicUsize::new(0));
        let mut readers = tokio::task::JoinSet::new();
        let mut subscribers = Vec::with_capacity(options.clients);
        for (mut client, endpoint) in connect_many(self.ws_url, options.clients, public_key).await?
        {
            subscribers.push((client.uaid.clone(), endpoint));
            if kind == Kind::Stored {
                client.close().await;
                continue;
            }
            let received = received.clone();
            readers.spawn(async move {
                while let Ok(Some(notification)) = client.next_notification().await {
                    received.fetch_add(1, Ordering::AcqRel);
                    if kind == Kind::Acked && client.ack(&notification).await.is_err() {
                        break;
                    }
                }
            });
        }
        // Registrations and goodbyes are not pushes.
        tokio::time::sleep(self.options.settle).await;
        let _ = self.server.take_requests();

        let answers = self.push_all(&subscribers).await?;
        if kind != Kind::Stored {
            let deadline = Instant::now() + wait();
            while received.load(Ordering::Acquire) < options.pushes {
                if Instant::now() > deadline {
                    return Err(format!(
                        "{} of {} pushes delivered within {:?}",
                        received.load(Ordering::Acquire),
                        options.pushes,
                        wait()
                    )
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        tokio::time::sleep(options.settle).await;
        let counts = self.server.take_requests().unwrap_or_default();
        readers.shutdown().await;

        let drained = if kind == Kind::Stored {
            Some(self.drain(&subscribers).await?)
        } else {
            None
        };
        Ok(Measured {
            counts,
            answers,
            drained,
        })
    }

    /// `options.pushes` pushes, round robin over `subscribers`, each
    /// connection one at a time; every one must be accepted.
    async fn push_all(
        &self,
        subscribers: &[(String, String)],
    ) -> Result<Latencies, crate::client::BenchError> {
        let next = Arc::new(AtomicUsize::new(0));
        let endpoints: Arc<Vec<String>> =
            Arc::new(subscribers.iter().map(|(_, e)| e.clone()).collect());
        let mut senders = tokio::task::JoinSet::new();
        for _ in 0..self.options.connections {
            let (sender, bodies, endpoints, next) = (
                self.sender.clone(),
                self.bodies.clone(),
                endpoints.clone(),
                next.clone(),
            );
            let (url, total) = (self.server.endpoint_url.clone(), self.options.pushes);
            senders.spawn(async move {
                let mut connection = Connection::open(&url).await?;
                let mut answers = Latencies::default();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return Ok::<_, crate::client::BenchError>(answers);
                    }
                    let posted = Instant::now();
                    let status = connection
                        .push(
                            &endpoints[n % endpoints.len()],
                            sender.authorization(),
                            bodies.stamped(n as u64),
                        )
                        .await?;
                    answers.record(posted.elapsed());
                    if status != 201 {
                        return Err(format!("a push was answered {status}").into());
                    }
                }
            });
        }
        let mut answers = Latencies::default();
        while let Some(result) = senders.join_next().await {
            answers.extend(result??);
        }
        Ok(answers)
    }

    /// The offline clients come back, receive and ack everything stored
    /// for them; the requests this took.
    async fn drain(
        &self,
        subscribers: &[(String, String)],
    ) -> Result<BTreeMap<String, usize>, crate::client::BenchError> {
        let per_client = self.options.pushes / subscribers.len();
        let extra = self.options.pushes % subscribers.len();
        let mut drainers = tokio::task::JoinSet::new();
        for (i, (uaid, _)) in subscribers.iter().enumerate() {
            let (url, uaid) = (self.ws_url.to_owned(), uaid.clone());
            let expected = per_client + usize::from(i < extra);
            drainers.spawn(async move {
                let mut client = PushClient::connect(&url, source_address(i), Some(&uaid)).await?;
                for _ in 0..expected {
                    match client.wait_notification().await? {
                        Some(notification) => client.ack(&notification).await?,
                        None => return Err("the server closed a draining client".into()),
                    }
                }
                Ok::<_, crate::client::BenchError>(client)
            });
        }
        let mut clients = Vec::new();
        while let Some(result) = drainers.join_next().await {
            clients.push(result??);
        }
        tokio::time::sleep(self.options.settle).await;
        let counts = self.server.take_requests().unwrap_or_default();
        for client in clients {
            client.close().await;
        }
        Ok(counts)
    }
}
