//! The metrics exporters: Prometheus text on `GET /metrics` (on the router
//! API port, and on `--metrics-port` when set), and statsd datagrams when
//! `--statsd-host` is set. What is recorded, and under which names, is
//! [`autopush_common::metrics`].

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use autopush_serving::http::HttpLimits;
use cadence::{BufferedUdpMetricSink, MetricSink, QueuingMetricSink};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use metrics_exporter_statsd::StatsdBuilder;
use metrics_util::layers::FanoutBuilder;
use tokio::net::TcpListener;
use tracing::warn;
use warp::Filter;
use warp::filters::BoxedFilter;
use warp::http::HeaderValue;
use warp::reply::{Reply, Response};

/// Histogram buckets, in seconds: storage and bridge calls range from tens
/// of microseconds (embedded store) to seconds (a bridge retrying).
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// How often histogram samples are folded into their buckets between scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

/// Where statsd datagrams go.
#[derive(Clone, Debug, PartialEq)]
pub struct Statsd {
    pub host: String,
    pub port: u16,
}

/// Bytes of statsd lines gathered into one datagram.
const STATSD_DATAGRAM: usize = 256;
/// Lines waiting for the sending thread; more are dropped.
const STATSD_QUEUE: usize = 5000;

/// The recorder is global to the process; several services started in one
/// process (as tests do) share it.
static INSTALLED: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// The statsd sink, kept to flush it (`None` without `--statsd-host`).
static STATSD: Mutex<Option<Arc<StatsdSink>>> = Mutex::new(None);

/// The buffered UDP sink, run by the queue's thread. An empty line, which no
/// metric is, asks it to send what it holds: queued behind the lines
/// recorded before it, those go too.
struct Flushing {
    udp: BufferedUdpMetricSink,
    flushes: Arc<AtomicU64>,
}

impl MetricSink for Flushing {
    fn emit(&self, line: &str) -> io::Result<usize> {
        if !line.is_empty() {
            return self.udp.emit(line);
        }
        let sent = self.udp.flush();
        self.flushes.fetch_add(1, Ordering::Release);
        sent.map(|()| 0)
    }

    fn flush(&self) -> io::Result<()> {
        self.udp.flush()
    }
}

/// The queue in front of [`Flushing`], shared by the recorder and the flushes.
struct StatsdSink {
    queue: QueuingMetricSink,
    flushes: Arc<AtomicU64>,
}

impl StatsdSink {
    /// Send every line recorded so far, waiting at most `within`.
    fn flush(&self, within: Duration) {
        let before = self.flushes.load(Ordering::Acquire);
        if self.queue.emit("").is_err() {
            return;
        }
        let deadline = Instant::now() + within;
        while self.flushes.load(Ordering::Acquire) == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// What the statsd client writes to.
struct Shared(Arc<StatsdSink>);

impl MetricSink for Shared {
    fn emit(&self, line: &str) -> io::Result<usize> {
        self.0.queue.emit(line)
    }
}

fn statsd_sink(statsd: &Statsd) -> io::Result<Arc<StatsdSink>> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    socket.set_nonblocking(true)?;
    let udp = BufferedUdpMetricSink::with_capacity(
        (statsd.host.as_str(), statsd.port),
        socket,
        STATSD_DATAGRAM,
    )
    .map_err(io::Error::other)?;
    let flushes = Arc::new(AtomicU64::new(0));
    let flushing = Flushing {
        udp,
        flushes: flushes.clone(),
    };
    Ok(Arc::new(StatsdSink {
        queue: QueuingMetricSink::with_capacity(flushing, STATSD_QUEUE),
        flushes,
    }))
}

/// Send the statsd lines recorded so far (at shutdown), waiting up to a
/// second for them to go out.
pub fn flush_statsd() {
    let sink = STATSD.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(sink) = sink {
        sink.flush(Duration::from_secs(1));
    }
}

/// Install the process's recorder (once; later calls share it) and return
/// the handle that renders Prometheus text. Statsd names start with `prefix.`;
/// statsd lines are gathered into datagrams and sent when one is full, and
/// what is gathered at least every `flush_every`.
pub fn install(
    statsd: Option<&Statsd>,
    prefix: &str,
    flush_every: Duration,
) -> Result<PrometheusHandle, String> {
    let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = installed.as_ref() {
        if statsd.is_some() {
            warn!(
                "metrics were already set up in this process: --statsd-host applies to the first service only"
            );
        }
        return Ok(handle.clone());
    }
    let prometheus = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| format!("metrics: {e}"))?
        .build_recorder();
    let handle = prometheus.handle();
    let result = match statsd {
        None => metrics::set_global_recorder(prometheus).map_err(|_| ()),
        Some(statsd) => {
            let bad = |e: &dyn std::fmt::Display| {
                format!("statsd_host {}:{}: {e}", statsd.host, statsd.port)
            };
            let sink = statsd_sink(statsd).map_err(|e| bad(&e))?;
            let datagrams = StatsdBuilder::from(statsd.host.clone(), statsd.port)
                .with_sink(Shared(sink.clone()))
                .build(Some(prefix))
                .map_err(|e| bad(&e))?;
            let flusher = sink.clone();
            std::thread::Builder::new()
                .name("statsd-flush".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(flush_every);
                        flusher.flush(Duration::ZERO);
                    }
                })
                .map_err(|e| format!("metrics: cannot start the statsd flush thread: {e}"))?;
            *STATSD.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
            let both = FanoutBuilder::default()
                .add_recorder(prometheus)
                .add_recorder(datagrams)
                .build();
            metrics::set_global_recorder(both).map_err(|_| ())
        }
    };
    if result.is_err() {
        warn!("another metrics recorder is installed in this process: /metrics stays empty");
    }
    autopush_common::metrics::forget_handles();
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP);
                upkeep.run_upkeep();
            }
        })
        .map_err(|e| format!("metrics: cannot start the upkeep thread: {e}"))?;
    *installed = Some(handle.clone());
    Ok(handle)
}

/// How many apps (APNs channels, FCM apps, GCM sender ids) a bridge serves.
pub fn bridge_apps(router_type: autopush_common::RouterType, apps: usize) {
    metrics::gauge!("bridge.apps", "router_type" => router_type.as_str()).set(apps as f64);
}

/// A reload of the bridges' apps (SIGHUP): `ok`, `partial` (some apps
/// refused, kept as they were) or `rejected` (the file refused whole).
pub fn bridge_reload(outcome: &'static str) {
    metrics::counter!("bridge.reload", "outcome" => outcome).increment(1);
}

/// `GET /metrics`: every metric in the Prometheus text format.
pub fn route(handle: PrometheusHandle) -> BoxedFilter<(Response,)> {
    let handle = Arc::new(handle);
    warp::get()
        .and(warp::path("metrics"))
        .and(warp::path::end())
        .map(move || {
            let mut response = handle.render().into_response();
            response.headers_mut().insert(
                "content-type",
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        })
        .boxed()
}

/// The `--metrics-port` listener: `/metrics` and nothing else, with the
/// same connection cap and timeouts as every other port.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle, limits: HttpLimits) {
    autopush_serving::http::serve(listener, warp::service(route(handle)), limits).await;
}

/// Parse `--statsd-host` (`HOST` or `HOST:PORT`, port 8125 by default).
pub fn parse_statsd(host: &str) -> Result<Statsd, String> {
    let (host, port) = match host.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("statsd_host: bad port in {host:?}"))?,
        ),
        _ => (host, 8125),
    };
    if host.is_empty() {
        return Err("statsd_host must name a host".into());
    }
    Ok(Statsd {
        host: host.trim_matches(|c| c == '[' || c == ']').to_owned(),
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statsd_host_takes_an_optional_port() {
        let parsed = |h| parse_statsd(h).map(|s| (s.host, s.port));
        assert_eq!(parsed("localhost"), Ok(("localhost".into(), 8125)));
        assert_eq!(parsed("10.0.0.1:9125"), Ok(("10.0.0.1".into(), 9125)));
        assert_eq!(parsed("[::1]:9125"), Ok(("::1".into(), 9125)));
        assert!(parsed("host:port").is_err());
        assert!(parsed(":9125").is_err());
    }
}
