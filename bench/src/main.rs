//! `autopush-bench`: start the release `autopush` binary on loopback and load
//! it. Each scenario prints a Markdown table (see BENCHMARKS.md).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use autopush_bench::delay::{DelayProxy, Latency, parse_duration};
use autopush_bench::scenario::{apns, direct, drain, fcm, handshakes, idle, requests};
use autopush_bench::server::{ServerUnderTest, Store, Target};
use autopush_bench::tls::KeyKind;
use autopush_bench::{stand_in, try_bridges};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Load generator for autopush (build with --release)")]
struct Cli {
    /// Where the server under test writes its log
    #[arg(long, default_value = "target/bench-server.log", global = true)]
    server_log: PathBuf,
    /// Target mode: load the server already running at this websocket URL
    /// (`ws://IP:PORT/`) instead of starting ours
    #[arg(long, global = true, requires_all = ["target_endpoint", "target_pids"])]
    target_ws: Option<String>,
    /// Target mode: the base URL of the target's Web Push HTTP API (the VAPID audience)
    #[arg(long, global = true, requires = "target_ws")]
    target_endpoint: Option<String>,
    /// Target mode: the target's process ids, comma-separated (their RSS and
    /// CPU are measured)
    #[arg(long, global = true, value_delimiter = ',', requires = "target_ws")]
    target_pids: Vec<u32>,
    /// Serve TLS on the public ports of the server we start (a P-256
    /// certificate made for the run): clients use `wss://` and `https://`
    #[arg(long, global = true, conflicts_with = "target_ws")]
    tls: bool,
    /// Seconds to wait for any answer from the server before failing the scenario
    #[arg(long, default_value_t = 30.0, global = true)]
    timeout: f64,
    /// The store of the server started here (idle, direct, drain,
    /// requests): moto and the Bigtable emulator are started too, each
    /// behind a proxy that counts their requests; PostgreSQL too (or the
    /// cluster AUTOPUSH_TEST_PG_DSN names), its statements counted and its
    /// CPU measured with the server's
    #[arg(long, value_enum, default_value_t = Store::Embedded, global = true, conflicts_with = "target_ws")]
    store: Store,
    /// With a shared --store, whether the server keeps direct copies in a
    /// journal of its own (`--journal-dir`, the server's default)
    #[arg(long, global = true, conflicts_with = "target_ws", default_value_t = true, action = clap::ArgAction::Set)]
    journal: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// Idle clients (hello + register): server RSS per client
    Idle {
        /// Client counts to measure at, ascending [default: 1000,5000,10000 and
        /// as many as the open-file limit allows]
        #[arg(long, value_delimiter = ',')]
        levels: Vec<usize>,
        #[command(flatten)]
        latency: ClientLatency,
    },
    /// Direct delivery to connected clients: throughput and latency
    Direct {
        #[arg(long, default_value_t = 1000)]
        clients: usize,
        /// HTTP/1.1 connections the application server pushes over
        #[arg(long, default_value_t = 32)]
        connections: usize,
        /// Offered pushes per second, in order; `max` is a closed loop (the
        /// ceiling) and `half` half of the last ceiling measured
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "max,half,5000,10000,20000"
        )]
        rates: Vec<String>,
        /// Seconds per rate
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Disable the server's VAPID cache (every push verifies a signature)
        #[arg(long)]
        no_vapid_cache: bool,
        /// The server's --durable-direct (write before delivering, delete on ack)
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        durable_direct: bool,
        /// The server's --receipt-retention (seconds; 0: receipts off)
        #[arg(long, default_value_t = 86_400)]
        receipt_retention: u64,
        /// The server's per-sender rate limit: on (never reached, but
        /// checked on every push) or off
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        rate_limits: bool,
        /// Milliseconds each client waits before it acks a notification
        /// (on top of --rtt, which delays the ack on the wire instead)
        #[arg(long, default_value_t = 0)]
        ack_delay_ms: u64,
        /// Clients never ack (every push stays unacknowledged; what the
        /// server then holds back is noted, not a failure)
        #[arg(long)]
        no_ack: bool,
        #[command(flatten)]
        latency: ClientLatency,
        /// Round trip between the application server and the endpoint: its
        /// HTTP connections go through a latency stand-in (e.g. 100ms; 0: none)
        #[arg(long, value_parser = parse_duration, default_value = "0")]
        sender_rtt: Duration,
    },
    /// TLS handshakes per second per core of the server, with a P-256 and
    /// an RSA-2048 certificate (made for the run)
    Handshakes {
        /// Clients handshaking at once
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Seconds per certificate
        #[arg(long, default_value_t = 5)]
        seconds: u64,
    },
    /// Store for offline clients, then drain when they reconnect
    Drain {
        #[arg(long, default_value_t = 2000)]
        clients: usize,
        /// Messages per client (at most the server's msg_limit, 100)
        #[arg(long, default_value_t = 50)]
        per_client: usize,
        #[arg(long, default_value_t = 32)]
        connections: usize,
        #[command(flatten)]
        latency: ClientLatency,
    },
    /// Requests to the shared store per push, counted at the wire (with
    /// --store moto or bigtable; statements with --store postgres), by operation: pushes to clients that ack
    /// them, to clients that never ack, and to offline clients (stored),
    /// then the drain of those, at each client round trip
    Requests {
        /// Client round trips, one run each (e.g. 0,20ms,100ms,300ms)
        #[arg(long, value_delimiter = ',', value_parser = parse_duration, default_value = "0,20ms,100ms,300ms")]
        rtts: Vec<Duration>,
        /// Pushes per kind and round trip
        #[arg(long, default_value_t = 200)]
        pushes: usize,
        /// Clients the pushes go to (each gets pushes/clients)
        #[arg(long, default_value_t = 20)]
        clients: usize,
        /// HTTP/1.1 connections the application server pushes over
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// Seconds to let the server finish its writes before counting
        /// (a held copy's grace, an ack that arrives after the 201)
        #[arg(long, default_value_t = 2.0)]
        settle: f64,
    },
    /// A latency stand-in in front of any port: a TCP proxy that holds
    /// every chunk for half the round trip (plus jitter) in each direction,
    /// without limiting bandwidth. Runs until Ctrl-C
    Delay {
        /// Where to listen, IP:PORT
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// Where to carry each connection, IP:PORT
        #[arg(long)]
        to: std::net::SocketAddr,
        /// The round trip it adds (e.g. 100ms)
        #[arg(long, value_parser = parse_duration)]
        rtt: Duration,
        /// Up to this much more per chunk and direction, at random
        /// (bytes keep their order)
        #[arg(long, value_parser = parse_duration, default_value = "0")]
        jitter: Duration,
    },
    /// Pushes through the APNs bridge to a stand-in for Apple (a process of
    /// its own) answering after a fixed delay, at fixed rates (open loop):
    /// throughput, latency, CPU of each process and per push
    Apns {
        #[arg(long, default_value_t = 1000)]
        devices: usize,
        /// HTTP/1.1 connections the application server pushes over, one push
        /// at a time each: the most pushes in flight
        #[arg(long, default_value_t = 2000)]
        connections: usize,
        /// Simulated Apple latencies in milliseconds, one run each
        #[arg(long, value_delimiter = ',', default_value = "1,50")]
        latencies: Vec<u64>,
        /// Offered pushes per second, in order; `max` is a closed loop
        #[arg(long, value_delimiter = ',', default_value = "1000,5000,10000")]
        rates: Vec<String>,
        /// Seconds per rate
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// The channel's cap on pushes in flight to Apple
        #[arg(long, default_value_t = 1000)]
        max_in_flight: usize,
    },
    /// Pushes to FCM devices through a stand-in for Google (a process of its
    /// own) answering after a fixed delay, at fixed rates (open loop):
    /// throughput, latency, CPU of each process and per push, token fetches
    Fcm {
        #[arg(long, default_value_t = 1000)]
        devices: usize,
        /// HTTP/1.1 connections the application server pushes over, one push
        /// at a time each: the most pushes in flight
        #[arg(long, default_value_t = 2000)]
        connections: usize,
        /// Milliseconds the stand-in takes to answer each message, one run each
        #[arg(long, value_delimiter = ',', default_value = "1,50")]
        delays_ms: Vec<u64>,
        /// Offered pushes per second, in order; `max` is a closed loop
        #[arg(long, value_delimiter = ',', default_value = "1000,5000,10000")]
        rates: Vec<String>,
        /// Seconds per rate
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// The app's cap on messages in flight to FCM
        #[arg(long, default_value_t = 1000)]
        max_in_flight: usize,
    },
    /// A stand-in for Google (OAuth and FCM HTTP v1) and the settings that
    /// point `autopush` at it: try the FCM bridge, the mailbox and receipts
    /// with no credentials (docs/try-bridges.md). Runs until Ctrl-C
    TryBridges {
        /// Where the service account, the settings file and the store go
        #[arg(long, default_value = "target/try-bridges")]
        dir: PathBuf,
        /// The stand-in's port on 127.0.0.1 (0: any free one)
        #[arg(long, default_value_t = 8190)]
        port: u16,
    },
    /// A stand-in for `google` or `apple` (started by `fcm` and `apns`)
    #[command(hide = true)]
    StandIn {
        which: String,
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// The service with an APNs channel sending to a stand-in (started by `apns`)
    #[command(hide = true)]
    ApnsService {
        #[arg(long)]
        apple: String,
        #[arg(long, default_value_t = 1000)]
        max_in_flight: usize,
        #[arg(long, default_value_t = 1024)]
        max_http_connections: usize,
    },
    /// A worker process of `idle` (not run by hand)
    #[command(hide = true)]
    IdleWorker {
        #[arg(long)]
        url: String,
        #[arg(long)]
        source: IpAddr,
        #[arg(long)]
        count: usize,
        /// The CA to trust for `wss://`
        #[arg(long)]
        ca: Option<PathBuf>,
    },
}

/// How far the clients are from the server: their websockets go through a
/// latency stand-in (`autopush-bench delay`) in this process.
#[derive(clap::Args)]
struct ClientLatency {
    /// Round trip between each client and the server (e.g. 100ms; 0: none)
    #[arg(long, value_parser = parse_duration, default_value = "0")]
    rtt: Duration,
    /// Up to this much more per chunk and direction, at random
    #[arg(long, value_parser = parse_duration, default_value = "0")]
    jitter: Duration,
}

impl ClientLatency {
    fn latency(&self) -> Latency {
        Latency {
            rtt: self.rtt,
            jitter: self.jitter,
        }
    }
}

/// The gateway's allocator: `apns-service` runs the gateway in this
/// process, and its CPU per push is measured as the server's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    raise_open_files();
    autopush_bench::client::set_wait(Duration::from_secs_f64(cli.timeout));
    let under_test = match (cli.target_ws, cli.target_endpoint) {
        (Some(ws_url), Some(endpoint_url)) => ServerUnderTest::Target(Target {
            ws_url,
            endpoint_url,
            pids: cli.target_pids,
        }),
        _ => ServerUnderTest::Start {
            log: cli.server_log.clone(),
            store: cli.store,
            tls: cli.tls.then_some(KeyKind::P256),
            journal: cli.journal,
        },
    };
    match cli.scenario {
        Scenario::Idle {
            mut levels,
            latency,
        } => {
            if levels.is_empty() {
                levels = vec![1_000, 5_000, 10_000, max_idle_clients()];
            }
            idle::run(&levels, latency.latency(), &under_test).await;
        }
        Scenario::Direct {
            clients,
            connections,
            rates,
            seconds,
            no_vapid_cache,
            durable_direct,
            receipt_retention,
            rate_limits,
            ack_delay_ms,
            no_ack,
            latency,
            sender_rtt,
        } => {
            let rates = rates
                .iter()
                .map(|rate| match rate.as_str() {
                    "max" => 0,
                    "half" => u64::MAX,
                    n => n.parse().unwrap_or_else(|_| {
                        eprintln!("--rates: {n} is not a number, max or half");
                        std::process::exit(2);
                    }),
                })
                .collect();
            let options = direct::Options {
                clients,
                connections,
                rates,
                seconds,
                vapid_cache: !no_vapid_cache,
                durable_direct,
                receipt_retention,
                rate_limits,
                ack_delay: Duration::from_millis(ack_delay_ms),
                ack: !no_ack,
                client_latency: latency.latency(),
                sender_latency: Latency::rtt(sender_rtt),
            };
            if !direct::run(&options, &under_test).await {
                eprintln!("some pushes were refused or never delivered");
                std::process::exit(1);
            }
        }
        Scenario::Handshakes {
            concurrency,
            seconds,
        } => handshakes::run(concurrency, seconds, &under_test).await,
        Scenario::Drain {
            clients,
            per_client,
            connections,
            latency,
        } => {
            let options = drain::Options {
                clients,
                per_client,
                connections,
                client_latency: latency.latency(),
            };
            drain::run(&options, &under_test).await;
        }
        Scenario::Requests {
            rtts,
            pushes,
            clients,
            connections,
            settle,
        } => {
            let options = requests::Options {
                rtts,
                pushes,
                clients: clients.max(1),
                connections: connections.max(1),
                settle: Duration::from_secs_f64(settle),
            };
            if !requests::run(&options, &under_test).await {
                eprintln!("some pushes were refused or never delivered");
                std::process::exit(1);
            }
        }
        Scenario::Delay {
            listen,
            to,
            rtt,
            jitter,
        } => {
            let proxy = DelayProxy::start(listen, to, Latency { rtt, jitter })
                .await
                .unwrap_or_else(|e| {
                    eprintln!("delay: cannot listen on {listen}: {e}");
                    std::process::exit(1);
                });
            eprintln!(
                "delay: {} -> {to}, round trip {rtt:?}, jitter up to {jitter:?} per direction",
                proxy.addr
            );
            let _ = tokio::signal::ctrl_c().await;
        }
        Scenario::Apns {
            devices,
            connections,
            latencies,
            rates,
            seconds,
            max_in_flight,
        } => {
            let options = apns::Options {
                devices,
                connections,
                latencies,
                rates: parse_rates(&rates),
                seconds,
                max_in_flight,
            };
            if !apns::run(&options, &cli.server_log).await {
                eprintln!("some pushes were refused or never reached Apple");
                std::process::exit(1);
            }
        }
        Scenario::Fcm {
            devices,
            connections,
            delays_ms,
            rates,
            seconds,
            max_in_flight,
        } => {
            let options = fcm::Options {
                devices,
                connections,
                delays_ms,
                rates: parse_rates(&rates),
                seconds,
                max_in_flight,
            };
            if !fcm::run(&options, &cli.server_log).await {
                eprintln!(
                    "some pushes were refused, never reached FCM, or needed more than one token"
                );
                std::process::exit(1);
            }
        }
        Scenario::TryBridges { dir, port } => {
            if let Err(e) = try_bridges::run(&dir, port).await {
                eprintln!("try-bridges: {e}");
                std::process::exit(1);
            }
        }
        Scenario::StandIn { which, delay_ms } => {
            stand_in::serve(&which, Duration::from_millis(delay_ms)).await;
        }
        Scenario::ApnsService {
            apple,
            max_in_flight,
            max_http_connections,
        } => apns::serve(&apple, max_in_flight, max_http_connections).await,
        Scenario::IdleWorker {
            url,
            source,
            count,
            ca,
        } => {
            if let Some(ca) = ca {
                autopush_bench::client::trust(&ca);
            }
            idle::worker(url, source, count).await
        }
    }
}

/// Offered rates: numbers, or `max` (0: a closed loop).
fn parse_rates(rates: &[String]) -> Vec<u64> {
    rates
        .iter()
        .map(|rate| match rate.as_str() {
            "max" => 0,
            n => n.parse().unwrap_or_else(|_| {
                eprintln!("--rates: {n} is not a number or max");
                std::process::exit(2);
            }),
        })
        .collect()
}

/// Raise the soft open-file limit to the hard one, for this process and the
/// server and workers it starts (a soft limit of 1 024 is common).
fn raise_open_files() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write `limit`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// As many clients as the server process may hold sockets for: its hard
/// open-file limit less room for listeners, the store and pushes.
fn max_idle_clients() -> usize {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let hard = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| line.split_whitespace().nth(4))
        .and_then(|hard| hard.parse::<usize>().ok())
        .unwrap_or(20_000);
    hard.saturating_sub(500)
}
