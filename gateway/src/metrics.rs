//! The metrics exporters: Prometheus text on `GET /metrics` (on the router
//! API port, and on `--metrics-port` when set), and statsd datagrams when
//! `--statsd-host` is set. What is recorded, and under which names, is
//! [`autopush_common::metrics`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use autopush_connection::http::HttpLimits;
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

/// The recorder is global to the process; several services started in one
/// process (as tests do) share it.
static INSTALLED: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Install the process's recorder (once; later calls share it) and return
/// the handle that renders Prometheus text. Statsd names start with `prefix.`.
pub fn install(statsd: Option<&Statsd>, prefix: &str) -> Result<PrometheusHandle, String> {
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
            let datagrams = StatsdBuilder::from(statsd.host.clone(), statsd.port)
                .build(Some(prefix))
                .map_err(|e| format!("statsd_host {}:{}: {e}", statsd.host, statsd.port))?;
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
    autopush_connection::http::serve(listener, warp::service(route(handle)), limits).await;
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
