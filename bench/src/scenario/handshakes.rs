//! TLS handshakes per second per core: clients that connect to the
//! websocket port, make a full handshake (no resumption) and close, as fast
//! as they go, against a server with a P-256 certificate and one with an
//! RSA-2048 certificate. The server's CPU time gives handshakes per second
//! of one core, whatever the generator beside it takes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpSocket;

use crate::client::{secure, source_address};
use crate::server::{Server, ServerUnderTest, Store};
use crate::tls::KeyKind;

/// Measure `seconds` of handshakes from `concurrency` clients, with each key kind.
pub async fn run(concurrency: usize, seconds: u64, under_test: &ServerUnderTest) {
    let ServerUnderTest::Start { log, .. } = under_test else {
        eprintln!("handshakes: starts its own server (no target mode)");
        std::process::exit(2);
    };
    println!("{concurrency} clients, {seconds} s per certificate, full handshakes (TLS 1.3)\n");
    println!(
        "| certificate | handshakes/s | server CPU (%) | handshakes per server CPU-second | generator CPU (%) |"
    );
    println!("|---|---:|---:|---:|---:|");
    for kind in [KeyKind::P256, KeyKind::Rsa2048] {
        let server = Server::launch(Store::Embedded, &[], log, Some(kind)).await;
        let address: SocketAddr = server
            .ws_url
            .trim_start_matches("wss://")
            .trim_end_matches('/')
            .parse()
            .expect("the websocket address");
        // Warm up: the first handshakes load the key and fill caches.
        shake(address, 0).await.expect("a first handshake");
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (cpu_before, own_before) = (
            server.cpu_ticks(),
            crate::server::cpu_ticks(std::process::id()),
        );
        let started = Instant::now();
        let clients: Vec<_> = (0..concurrency)
            .map(|i| {
                let (done, stop) = (done.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = i;
                    while !stop.load(Ordering::Relaxed) {
                        match shake(address, n).await {
                            Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                            Err(e) => panic!("a handshake failed: {e}"),
                        };
                        n += concurrency;
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let shaken = done.load(Ordering::Relaxed);
        let elapsed = started.elapsed().as_secs_f64();
        let server_cpu = (server.cpu_ticks() - cpu_before) as f64 / 100.0;
        let own_cpu = (crate::server::cpu_ticks(std::process::id()) - own_before) as f64 / 100.0;
        stop.store(true, Ordering::Relaxed);
        for client in clients {
            let _ = client.await;
        }
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} |",
            kind.name(),
            shaken as f64 / elapsed,
            100.0 * server_cpu / elapsed,
            shaken as f64 / server_cpu.max(0.01),
            100.0 * own_cpu / elapsed,
        );
    }
}

/// One full handshake from the `n`-th connection's source address, then close.
async fn shake(address: SocketAddr, n: usize) -> Result<(), crate::client::BenchError> {
    let socket = TcpSocket::new_v4()?;
    // Spread over source addresses: closed connections wait in TIME_WAIT.
    socket.bind(SocketAddr::new(source_address(n % 200_000), 0))?;
    let stream = crate::client::within("the TCP connect", socket.connect(address)).await?;
    stream.set_nodelay(true)?;
    drop(secure(stream, true).await?);
    Ok(())
}
