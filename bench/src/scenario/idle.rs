//! Idle connections: how much memory one connection node spends per client
//! that has said hello, registered a channel, and now waits.
//!
//! A process may hold only `ulimit -Hn` open files (20 000 on the CI machine),
//! so the clients live in several worker processes (this binary, subcommand
//! `idle-worker`), each on its own loopback source address.
//!
//! Beside the server's RSS, the kernel's share: the growth of its slab
//! caches ([`crate::slab`]). Both ends of each loopback connection are on
//! this machine and hold the same kernel objects (a socket, its inode,
//! dentry, file and epoll entry), so half of the growth is the server's.
//! "All in" is the RSS and that half.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::client::PushClient;
use crate::delay::{DelayProxy, Latency};
use crate::server::{Server, ServerUnderTest};
use crate::slab::Slabs;

/// Clients per worker process: well under its own open-file limit.
const CLIENTS_PER_WORKER: usize = 5_000;
/// Handshakes a worker has in flight at once.
const CONNECT_CONCURRENCY: usize = 64;

/// Measure RSS at each client count in `levels` (ascending), with the
/// clients `latency` away.
pub async fn run(levels: &[usize], latency: Latency, under_test: &ServerUnderTest) {
    let server = Server::open(under_test, &[]).await;
    // The workers connect through the latency stand-in, held in this process.
    let (_proxy, ws_url) = if latency.is_zero() {
        (None, server.ws_url.clone())
    } else {
        let (proxy, url) = DelayProxy::in_front_of(&server.ws_url, latency).await;
        println!("clients {:?} away (round trip)", latency.rtt);
        (Some(proxy), url)
    };
    // Warm up: threads, pools and the store's first pages exist before the baseline.
    let mut warm = PushClient::connect(&server.ws_url, [127, 0, 0, 1].into(), None)
        .await
        .expect("a first client connects");
    warm.register(None).await.expect("a first register");
    warm.close().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline = server.rss_kib();
    let slab_baseline = Slabs::read();
    println!(
        "server RSS with no clients: {baseline} KiB{}\n",
        if slab_baseline.is_none() {
            " (kernel slab: /proc/slabinfo is not readable, run as root)"
        } else {
            ""
        }
    );
    println!(
        "| clients | server RSS (MiB) | RSS per client (KiB) | kernel slab per client (KiB) | all in per client (KiB) | clients per GiB, all in | connect+hello+register rate (clients/s) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut slab_growth = Vec::new();

    let mut workers: Vec<Worker> = Vec::new();
    let mut connected = 0;
    for &level in levels {
        let started = Instant::now();
        let mut added = Vec::new();
        while connected < level {
            let count = (level - connected).min(CLIENTS_PER_WORKER);
            // Sources 127.0.0.2, .3, ...: each has its own ephemeral port range.
            let source: IpAddr = [127, 0, 0, 2 + workers.len() as u8 + added.len() as u8].into();
            added.push(Worker::spawn(&ws_url, source, count));
            connected += count;
        }
        // Blocking reads; the latency stand-in's tasks run on the other threads.
        for worker in &mut added {
            tokio::task::block_in_place(|| worker.wait_ready());
        }
        let connect_rate = (connected - workers.iter().map(|w| w.count).sum::<usize>()) as f64
            / started.elapsed().as_secs_f64();
        workers.extend(added);
        // Let allocations from the handshakes settle before reading RSS.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss = server.rss_kib();
        let per_client = (rss.saturating_sub(baseline)) as f64 / connected as f64;
        // The server's end: half of what both ends grew.
        let kernel = match (&slab_baseline, Slabs::read()) {
            (Some(before), Some(now)) => {
                slab_growth = now.growth_since(before);
                Some(now.total_growth_since(before) as f64 / 2.0 / 1024.0 / connected as f64)
            }
            _ => None,
        };
        let (kernel_cell, all_in_cell, per_gib_cell) = match kernel {
            Some(kernel) => {
                let all_in = per_client + kernel;
                (
                    format!("{kernel:.2}"),
                    format!("{all_in:.2}"),
                    format!("{:.0}", 1024.0 * 1024.0 / all_in),
                )
            }
            None => ("?".into(), "?".into(), "?".into()),
        };
        println!(
            "| {connected} | {:.1} | {per_client:.2} | {kernel_cell} | {all_in_cell} | {per_gib_cell} | {connect_rate:.0} |",
            rss as f64 / 1024.0
        );
    }
    if !slab_growth.is_empty() {
        println!(
            "\nkernel slab growth per client at {connected} clients (both ends of each connection; the server's is half), largest caches:\n"
        );
        println!("| cache | bytes per client |");
        println!("|---|---:|");
        for (cache, grew) in slab_growth.iter().take(8) {
            println!("| {cache} | {:.0} |", *grew as f64 / connected as f64);
        }
    }
    drop(workers);
}

/// A worker process holding `count` idle clients.
struct Worker {
    child: Child,
    ready: BufReader<ChildStdout>,
    count: usize,
}

impl Worker {
    fn spawn(ws_url: &str, source: IpAddr, count: usize) -> Worker {
        let mut child = Command::new(std::env::current_exe().expect("this binary's path"))
            .args(["idle-worker", "--url", ws_url])
            .args(["--source", &source.to_string()])
            .args(["--count", &count.to_string()])
            .args([
                "--timeout",
                &crate::client::wait().as_secs_f64().to_string(),
            ])
            .args(
                crate::client::trusted()
                    .map(|ca| ["--ca".as_ref(), ca.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("a worker process starts");
        let ready = BufReader::new(child.stdout.take().expect("worker stdout"));
        Worker {
            child,
            ready,
            count,
        }
    }

    /// Block until the worker reports all its clients registered.
    fn wait_ready(&mut self) {
        let mut line = String::new();
        let _ = self.ready.read_line(&mut line);
        if line.trim() != "ready" {
            panic!("an idle worker failed: {}", line.trim());
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing its stdin tells the worker to exit; kill in case it hangs.
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The worker process: connect `count` clients from `source`, print `ready`,
/// and hold them (answering pings) until stdin closes.
pub async fn worker(url: String, source: IpAddr, count: usize) {
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Result<(), String>>(count.max(1));
    for _ in 0..count {
        let url = url.clone();
        let permits = permits.clone();
        let ready_tx = ready_tx.clone();
        tokio::spawn(async move {
            let permit = permits.acquire_owned().await;
            let client = async {
                let mut client = PushClient::connect(&url, source, None).await?;
                client.register(None).await?;
                Ok::<_, crate::client::BenchError>(client)
            }
            .await;
            drop(permit);
            match client {
                Ok(mut client) => {
                    let _ = ready_tx.send(Ok(())).await;
                    // Reading keeps answering the server's pings.
                    while let Ok(Some(_)) = client.next_notification().await {}
                }
                Err(error) => {
                    let _ = ready_tx.send(Err(error.to_string())).await;
                }
            }
        });
    }
    for _ in 0..count {
        match ready_rx.recv().await {
            Some(Ok(())) => {}
            Some(Err(error)) => {
                println!("client failed: {error}");
                std::process::exit(1);
            }
            None => std::process::exit(1),
        }
    }
    println!("ready");
    // Hold until the parent closes stdin.
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        let _ = std::io::stdin().read_line(&mut sink);
    })
    .await;
}
