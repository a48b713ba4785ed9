//! The APNs bridge: devices registered through `/v1/apns/bench/registration`,
//! an application server pushing VAPID-signed ~2 KB aes128gcm bodies to
//! them at fixed rates (open loop, see [`crate::open_loop`]), and Apple
//! played by a stand-in process answering 200 over HTTP/2 after a fixed
//! delay. Reports pushes per second, the time from a push's due moment to
//! its 201 (which includes Apple's answer) and the CPU of each process.
//!
//! a2 talks to Apple only (its hosts and roots are built in), so the service
//! runs as `autopush-bench apns-service`: the gateway's own start-up and
//! settings, with the channel's a2 client replaced by [`H2Sender`], which
//! sends what a2 would (the same path, headers, bearer token and body) over
//! HTTP/2 to the stand-in, without TLS. Its CPU is the server's.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use autopush_apns::ApnsRouter;
use autopush_apns::sender::{ApnsRequest, ApnsResponse, ApnsSender, TransportError};
use autopush_apns::settings::{ApnsSection, ApnsSettings};
use autopush_common::RouterType;
use autopush_common::router::RouterRegistry;
use autopush_gateway::app::{self, Mode};
use autopush_gateway::bridges::BridgeSettings;
use autopush_gateway::settings::{Settings, SettingsLayer};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::app_server::Connection;
use crate::open_loop::{self, Connections, Load};
use crate::server::{cpu_ticks, free_ports};
use crate::stand_in::StandIn;

/// A rate limit the bench never reaches (`PER_SECOND,BURST`).
const OUT_OF_REACH: &str = "1000000000,1000000000";

pub struct Options {
    pub devices: usize,
    pub connections: usize,
    /// Simulated Apple latencies, in milliseconds; one run each.
    pub latencies: Vec<u64>,
    /// Offered pushes per second, in order; 0 is a closed loop.
    pub rates: Vec<u64>,
    pub seconds: u64,
    /// The channel's in-flight cap.
    pub max_in_flight: usize,
}

/// Returns whether every push was accepted and reached the stand-in.
pub async fn run(options: &Options, log: &Path) -> bool {
    println!(
        "\n{} devices, {} HTTP/1.1 connections (open loop: at most that many pushes in flight), in-flight cap {}, {} s per rate\n",
        options.devices, options.connections, options.max_in_flight, options.seconds
    );
    println!(
        "| Apple latency (ms) | offered (/s) | accepted (/s) | p50 (ms) | p99 (ms) | max (ms) | most in flight | server CPU (%) | server CPU per push (µs) | Apple CPU (%) | generator CPU (%) | non-201 | reached Apple |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
    let mut all_good = true;
    for &latency in &options.latencies {
        all_good &= run_latency(options, Duration::from_millis(latency), log).await;
    }
    all_good
}

async fn run_latency(options: &Options, delay: Duration, log: &Path) -> bool {
    let apple = StandIn::start("apple", delay);
    let service = ServiceProcess::start(
        &apple.base_url,
        options.max_in_flight,
        options.connections + 100,
        log,
    );
    let endpoints = register(&service.endpoint_url, options.devices).await;
    let load = Load::new(
        &service.endpoint_url,
        endpoints,
        options.connections,
        options.seconds,
    );
    // The first push opens the connection to Apple; the rates measure what follows.
    open_loop::warm_up(&load).await;
    let mut connections = Connections::open(&load).await;
    let mut all_good = true;
    for &offered in &options.rates {
        let before = apple.received().await;
        let (mut measured, open) = open_loop::push_measured(
            &load,
            connections,
            offered,
            || service.cpu_ticks(),
            || apple.cpu_ticks(),
        )
        .await;
        connections = open;
        let reached = apple.received().await - before;
        println!(
            "| {} | {} | {reached} |",
            delay.as_millis(),
            measured.cells()
        );
        let step = &measured.outcome;
        if reached != step.accepted as u64 {
            eprintln!(
                "{} pushes accepted but {reached} reached Apple",
                step.accepted
            );
        }
        all_good &= step.refused.is_empty() && reached == step.accepted as u64;
    }
    all_good
}

/// `autopush-bench apns-service` in a child process; killed when dropped.
struct ServiceProcess {
    child: Child,
    endpoint_url: String,
}

impl ServiceProcess {
    fn start(apple: &str, max_in_flight: usize, max_http: usize, log: &Path) -> ServiceProcess {
        let me = std::env::current_exe().expect("the bench binary's path");
        let log = std::fs::File::create(log).expect("the server log file");
        // A profiler to run the service under, e.g. `valgrind
        // --tool=callgrind` (scripts/bench-callgrind-bridges).
        let wrapper = std::env::var("AUTOPUSH_BENCH_SERVICE_WRAPPER").unwrap_or_default();
        let mut command: Vec<String> = wrapper.split_whitespace().map(str::to_owned).collect();
        command.push(me.display().to_string());
        let mut child = Command::new(&command[0])
            .args(&command[1..])
            .args(["apns-service", "--apple", apple, "--max-in-flight"])
            .arg(max_in_flight.to_string())
            .arg("--max-http-connections")
            .arg(max_http.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("the APNs service starts");
        let mut line = String::new();
        if let Some(stdout) = child.stdout.take() {
            use std::io::BufRead;
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        }
        let info: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("apns-service printed {line:?}: {e}"));
        ServiceProcess {
            child,
            endpoint_url: info["endpoint_url"].as_str().unwrap_or_default().to_owned(),
        }
    }

    fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.child.id())
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        crate::stand_in::stop(&mut self.child);
    }
}

/// The child's side: the service with an APNs channel `bench` whose
/// pushes go to the stand-in at `apple`; prints its endpoint URL, serves
/// until stdin closes.
pub async fn serve(apple: &str, max_in_flight: usize, max_http_connections: usize) {
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
        max_http_connections: Some(max_http_connections),
        ..SettingsLayer::default()
    };
    let settings = Settings::resolve(layer, None).expect("settings");
    let router = ApnsRouter::with_senders(
        &settings.bridges.apns.settings(),
        &app::bridge_limits(&settings),
        |_, channel| Ok(Arc::new(H2Sender::new(apple, channel.timeout())) as Arc<dyn ApnsSender>),
    )
    .expect("the APNs router");
    let bridges = RouterRegistry::default().with(RouterType::Apns, Arc::new(router));
    let _running = app::start(Mode::All, &settings, bridges)
        .await
        .expect("the service starts");
    {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", json!({"endpoint_url": endpoint_url}));
        let _ = stdout.flush();
    }
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0u8; 64];
    use tokio::io::AsyncReadExt;
    while matches!(stdin.read(&mut buffer).await, Ok(n) if n > 0) {}
}

/// What a2 sends for one push, over HTTP/2 without TLS to `base_url`: one
/// pooled connection, `POST /3/device/{token}` with the `apns-*` headers, a
/// bearer token (a2 signs one per 55 minutes and reuses it) and the JSON
/// body, within the request timeout; the reason read from a refusal's body.
pub struct H2Sender {
    client: Client<HttpConnector, Full<Bytes>>,
    base_url: String,
    authorization: HeaderValue,
    timeout: Duration,
}

impl H2Sender {
    pub fn new(base_url: &str, timeout: Duration) -> H2Sender {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector);
        H2Sender {
            client,
            base_url: base_url.trim_end_matches('/').to_owned(),
            // The shape of an ES256 JWT as a2 sends it.
            authorization: HeaderValue::from_static(
                "Bearer eyJhbGciOiJFUzI1NiIsImtpZCI6IkJFTkNIS0VZMDEifQ.eyJpc3MiOiJCRU5DSFRFQU0xIiwiaWF0IjoxNzAwMDAwMDAwfQ.c2lnbmF0dXJlLXNpZ25hdHVyZS1zaWduYXR1cmUtc2lnbmF0dXJlLXNpZ25hdHVyZS1zaWduYXR1cmU",
            ),
            timeout,
        }
    }
}

#[async_trait]
impl ApnsSender for H2Sender {
    async fn send(&self, request: &ApnsRequest) -> Result<ApnsResponse, TransportError> {
        let mut builder = hyper::Request::post(format!(
            "{}/3/device/{}",
            self.base_url, request.device_token
        ))
        .header(CONTENT_TYPE, "application/json")
        .header(AUTHORIZATION, self.authorization.clone())
        .header(CONTENT_LENGTH, request.payload.len());
        for (name, value) in request.headers.pairs() {
            builder = builder.header(name, value);
        }
        let http_request = builder
            .body(Full::new(Bytes::from(request.payload.clone())))
            .map_err(|e| TransportError::Request(e.to_string()))?;
        let response =
            match tokio::time::timeout(self.timeout, self.client.request(http_request)).await {
                Err(_) => return Err(TransportError::Timeout),
                Ok(Err(e)) => return Err(TransportError::Connect(e.to_string())),
                Ok(Ok(response)) => response,
            };
        let status = response.status().as_u16();
        if status == 200 {
            return Ok(ApnsResponse::accepted());
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let reason: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Ok(ApnsResponse {
            status,
            reason: reason["reason"].as_str().map(str::to_owned),
        })
    }
}

/// Register `count` devices on the `bench` channel; their endpoints.
async fn register(endpoint_url: &str, count: usize) -> Vec<String> {
    let mut connection = Connection::open(endpoint_url)
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
