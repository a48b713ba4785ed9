//! The APNs bridge: devices registered through `/v1/apns/bench/registration`,
//! an application server pushing VAPID-signed ~2 KB aes128gcm bodies to
//! them as fast as its connections go (closed loop), and Apple played by a
//! double that answers 200 after a fixed delay. Reports pushes per second
//! and the time from POST to 201, which includes Apple's answer.
//!
//! The double lives in the service's process, so the service runs in this
//! process (the gateway's own start-up and settings, the real a2 clients
//! built from `certs/`, then the double swapped in for Apple), and "CPU"
//! counts service and generator together.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use autopush_apns::double::ApnsDouble;
use autopush_apns::settings::{ApnsSection, ApnsSettings};
use autopush_common::RouterType;
use autopush_common::router::RouterRegistry;
use autopush_gateway::app::{self, Mode, Running};
use autopush_gateway::bridges::BridgeSettings;
use autopush_gateway::settings::{Settings, SettingsLayer};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::json;

use crate::app_server::{AppServer, Bodies, Connection};
use crate::server::{cpu_ticks, free_ports};
use crate::stats::{Latencies, rate, refused_cell};

/// A rate limit the bench never reaches (`PER_SECOND,BURST`).
const OUT_OF_REACH: &str = "1000000000,1000000000";

pub struct Options {
    pub devices: usize,
    pub connections: usize,
    /// Simulated Apple latencies, in milliseconds; one step each.
    pub latencies: Vec<u64>,
    pub seconds: u64,
    /// The channel's in-flight cap.
    pub max_in_flight: usize,
}

/// Returns whether every push was accepted and reached the double.
pub async fn run(options: &Options) -> bool {
    println!(
        "\n{} devices, {} HTTP connections (closed loop), in-flight cap {}\n",
        options.devices, options.connections, options.max_in_flight
    );
    println!(
        "| Apple latency (ms) | pushes/s | p50 (ms) | p99 (ms) | max (ms) | CPU, service + generator (%) | non-201 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---|");
    let mut all_good = true;
    for &latency in &options.latencies {
        all_good &= step(options, Duration::from_millis(latency)).await;
    }
    all_good
}

/// The service with an APNs channel `bench` whose Apple answers after `delay`.
struct Service {
    double: Arc<ApnsDouble>,
    endpoint_url: String,
    _running: Running,
    _data: tempfile::TempDir,
}

async fn start(delay: Duration, max_in_flight: usize) -> Service {
    let data = tempfile::TempDir::new().expect("a temporary data directory");
    let [ws, router, endpoint] = free_ports();
    let endpoint_url = format!("http://127.0.0.1:{endpoint}");
    let p8 = concat!(env!("CARGO_MANIFEST_DIR"), "/../certs/apns-token-key.p8");
    let channels = json!({"bench": {
        "topic": "org.example.bench", "key": p8, "key_id": "BENCHKEY01", "team_id": "BENCHTEAM1",
        "max_in_flight": max_in_flight,
    }});
    let layer = SettingsLayer {
        host: Some("127.0.0.1".into()),
        port: Some(ws),
        router_port: Some(router),
        endpoint_port: Some(endpoint),
        endpoint_url: Some(endpoint_url.clone()),
        db: Some(data.path().display().to_string()),
        bridges: BridgeSettings {
            apns: ApnsSection {
                apns: Some(ApnsSettings::from_json(&channels.to_string()).expect("APNs settings")),
            },
            ..BridgeSettings::default()
        },
        // As the load generator's own servers have them (`server::limit_flags`):
        // every device registers from one address, so per-address limits are
        // off; the sender and bridge app limits are on but out of reach.
        sender_limit: Some(OUT_OF_REACH.into()),
        subscription_limit: Some("0".into()),
        source_ip_limit: Some("0".into()),
        registration_limit: Some("0".into()),
        new_uaid_limit: Some("0".into()),
        bridge_app_limit: Some(OUT_OF_REACH.into()),
        ..SettingsLayer::default()
    };
    let settings = Settings::resolve(layer, None).expect("settings");
    let double = ApnsDouble::counting(delay);
    let router = double
        .router(
            &settings.bridges.apns.settings(),
            &app::bridge_limits(&settings),
        )
        .expect("the APNs router");
    let bridges = RouterRegistry::default().with(RouterType::Apns, Arc::new(router));
    let running = app::start(Mode::All, &settings, bridges)
        .await
        .expect("the service starts");
    Service {
        double,
        endpoint_url,
        _running: running,
        _data: data,
    }
}

async fn step(options: &Options, delay: Duration) -> bool {
    let service = start(delay, options.max_in_flight).await;
    let endpoints = Arc::new(register(&service, options.devices).await);
    let sender = Arc::new(AppServer::new(&service.endpoint_url));
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD
            .decode(sender.public_key())
            .unwrap_or_default(),
    ));
    let latencies = Arc::new(Mutex::new(Latencies::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let pid = std::process::id();
    let cpu_before = cpu_ticks(pid);
    let started = Instant::now();
    let end = started + Duration::from_secs(options.seconds);
    let mut senders = Vec::new();
    for _ in 0..options.connections {
        let (sender, bodies, endpoints, latencies, next) = (
            sender.clone(),
            bodies.clone(),
            endpoints.clone(),
            latencies.clone(),
            next.clone(),
        );
        let url = service.endpoint_url.clone();
        senders.push(tokio::spawn(async move {
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            let Ok(mut connection) = Connection::open(&url).await else {
                *statuses.entry(0).or_default() += 1;
                return statuses;
            };
            let mut mine = Latencies::default();
            while Instant::now() < end {
                let target = next.fetch_add(1, Ordering::Relaxed) % endpoints.len();
                let sent = Instant::now();
                let status = connection
                    .push(
                        &endpoints[target],
                        sender.authorization(),
                        bodies.stamped(0),
                    )
                    .await
                    .unwrap_or(0);
                if status == 201 {
                    mine.record(sent.elapsed());
                }
                *statuses.entry(status).or_default() += 1;
            }
            if let Ok(mut all) = latencies.lock() {
                all.extend(mine);
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
    let elapsed = started.elapsed();
    let cpu = cpu_ticks(pid).saturating_sub(cpu_before);
    let accepted = statuses.remove(&201).unwrap_or(0);
    let mut latencies = latencies
        .lock()
        .map(|mut l| std::mem::take(&mut *l))
        .unwrap_or_default();
    let refused = refused_cell(&statuses);
    println!(
        "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} | {refused} |",
        delay.as_millis(),
        rate(accepted, elapsed),
        latencies.percentile_ms(50.0),
        latencies.percentile_ms(99.0),
        latencies.percentile_ms(100.0),
        cpu as f64 / elapsed.as_secs_f64(),
    );
    let reached_apple = service.double.count();
    if reached_apple != accepted {
        eprintln!("{accepted} pushes accepted but {reached_apple} reached the double");
    }
    statuses.is_empty() && reached_apple == accepted
}

/// Register `count` devices on the `bench` channel; their endpoints.
async fn register(service: &Service, count: usize) -> Vec<String> {
    let mut connection = Connection::open(&service.endpoint_url)
        .await
        .expect("an HTTP connection");
    let mut endpoints = Vec::with_capacity(count);
    for i in 0..count {
        let token = format!("{i:064x}");
        let (status, body) = connection
            .post_json("/v1/apns/bench/registration", &json!({"token": token}))
            .await
            .expect("a registration");
        let reply: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        match reply["endpoint"].as_str() {
            Some(endpoint) if status == 200 => endpoints.push(endpoint.to_owned()),
            _ => panic!("registration answered {status}: {reply}"),
        }
    }
    endpoints
}
