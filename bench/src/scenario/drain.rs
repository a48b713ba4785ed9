//! Store and drain: pushes to clients that are offline are stored; when the
//! clients come back they receive and acknowledge everything (which deletes
//! it). Reports how fast the node stores and how fast it drains.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::app_server::{AppServer, Bodies, Connection};
use crate::client::{PushClient, connect_many, source_address};
use crate::delay::{DelayProxy, Latency};
use crate::server::{Server, ServerUnderTest};
use crate::stats::rate;

pub struct Options {
    pub clients: usize,
    pub per_client: usize,
    pub connections: usize,
    /// How far the clients are from the server.
    pub client_latency: Latency,
}

pub async fn run(options: &Options, under_test: &ServerUnderTest) {
    let server = Server::open(under_test, &[]).await;
    let (_proxy, ws_url) = if options.client_latency.is_zero() {
        (None, server.ws_url.clone())
    } else {
        let (proxy, url) = DelayProxy::in_front_of(&server.ws_url, options.client_latency).await;
        (Some(proxy), url)
    };
    let sender = Arc::new(AppServer::new(&server.endpoint_url));
    let public_key = sender.public_key();
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD.decode(&public_key).unwrap_or_default(),
    ));

    // Clients subscribe, then go away.
    let mut subscribers = Vec::with_capacity(options.clients);
    let clients = connect_many(&ws_url, options.clients, &public_key)
        .await
        .unwrap_or_else(|e| panic!("a client connects and registers: {e}"));
    for (client, endpoint) in clients {
        subscribers.push((client.uaid.clone(), endpoint));
        client.close().await;
    }
    let subscribers = Arc::new(subscribers);

    // Store: every push finds its client offline.
    let total = options.clients * options.per_client;
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_before = server.cpu_ticks();
    let started = Instant::now();
    let mut senders = Vec::new();
    for _ in 0..options.connections {
        let (sender, bodies, subscribers, next) = (
            sender.clone(),
            bodies.clone(),
            subscribers.clone(),
            next.clone(),
        );
        let url = server.endpoint_url.clone();
        senders.push(tokio::spawn(async move {
            let mut connection = Connection::open(&url).await.expect("an HTTP connection");
            let mut accepted = 0;
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    return accepted;
                }
                let endpoint = &subscribers[n % subscribers.len()].1;
                let status = connection
                    .push(endpoint, sender.authorization(), bodies.stamped(n as u64))
                    .await
                    .unwrap_or(0);
                accepted += usize::from(status == 201);
            }
        }));
    }
    let mut stored = 0;
    for sender in senders {
        stored += sender.await.unwrap_or(0);
    }
    let storing = started.elapsed();
    let store_cpu = server.cpu_ticks().saturating_sub(cpu_before);
    assert_eq!(stored, total, "every push to an offline client is accepted");

    // Drain: everyone comes back at once and acknowledges everything.
    let cpu_before = server.cpu_ticks();
    let started = Instant::now();
    let mut drainers = Vec::new();
    for (i, (uaid, _)) in subscribers.iter().enumerate() {
        let url = ws_url.clone();
        let uaid = uaid.clone();
        let expected = options.per_client;
        drainers.push(tokio::spawn(async move {
            let mut client = PushClient::connect(&url, source_address(i), Some(&uaid))
                .await
                .expect("a client reconnects");
            assert_eq!(client.uaid, uaid, "the client keeps its UAID");
            let mut received = 0;
            while received < expected {
                match client.wait_notification().await {
                    Ok(Some(notification)) => {
                        if let Err(e) = client.ack(&notification).await {
                            eprintln!("drain: a client could not ack: {e}");
                            break;
                        }
                        received += 1;
                    }
                    Ok(None) => {
                        eprintln!("drain: the server closed a client after {received} messages");
                        break;
                    }
                    Err(e) => {
                        eprintln!("drain: after {received} of {expected} messages: {e}");
                        break;
                    }
                }
            }
            client.close().await;
            received
        }));
    }
    let mut drained = 0;
    for drainer in drainers {
        drained += drainer.await.unwrap_or(0);
    }
    let draining = started.elapsed();
    let drain_cpu = server.cpu_ticks().saturating_sub(cpu_before);
    assert_eq!(drained, total, "every stored message is delivered");

    println!(
        "\n{} offline clients x {} messages = {total} messages of 2 KiB, {} HTTP connections, clients {} ms away\n",
        options.clients,
        options.per_client,
        options.connections,
        options.client_latency.rtt.as_millis()
    );
    println!("| phase | messages/s | seconds | server CPU (%) |");
    println!("|---|---:|---:|---:|");
    println!(
        "| store (POST -> 201) | {:.0} | {:.2} | {:.0} |",
        rate(total, storing),
        storing.as_secs_f64(),
        store_cpu as f64 / storing.as_secs_f64()
    );
    println!(
        "| drain (reconnect -> all received and acked) | {:.0} | {:.2} | {:.0} |",
        rate(drained, draining),
        draining.as_secs_f64(),
        drain_cpu as f64 / draining.as_secs_f64()
    );
}
