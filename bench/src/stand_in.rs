//! Stand-ins for Google and Apple, each run as a process of its own
//! (`autopush-bench stand-in google|apple`) so that what they spend is
//! neither the server's nor the load generator's CPU.
//!
//! The child prints one JSON line on stdout when it listens (its base URL,
//! and for Google the service-account key whose `token_uri` points at it),
//! serves `GET /stats` (`{"received": N, ...}`), and exits when its stdin
//! closes, so it never outlives the generator that started it.

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::server::cpu_ticks;

/// A stand-in running in a child process; killed when dropped.
pub struct StandIn {
    child: Child,
    /// What the child printed when it was ready.
    pub info: Value,
    pub base_url: String,
}

impl StandIn {
    /// Start `autopush-bench stand-in WHICH --delay-ms N` and wait until it
    /// listens.
    pub fn start(which: &str, delay: Duration) -> StandIn {
        let me = std::env::current_exe().expect("the bench binary's path");
        let mut child = Command::new(me)
            .args(["stand-in", which, "--delay-ms"])
            .arg(delay.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the stand-in starts");
        let mut line = String::new();
        if let Some(stdout) = child.stdout.take() {
            let _ = BufReader::new(stdout).read_line(&mut line);
        }
        let info: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the {which} stand-in printed {line:?}: {e}"));
        let base_url = info["base_url"].as_str().unwrap_or_default().to_owned();
        StandIn {
            child,
            info,
            base_url,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its CPU time so far, in clock ticks.
    pub fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.pid())
    }

    /// Its counters (`GET /stats`).
    pub async fn stats(&self) -> Value {
        let reply = autopush_tests::http::request(
            reqwest::Method::GET,
            &format!("{}/stats", self.base_url),
            &[],
            None,
        )
        .await;
        reply.json
    }

    /// Requests received so far.
    pub async fn received(&self) -> u64 {
        self.stats().await["received"].as_u64().unwrap_or(0)
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        stop(&mut self.child);
    }
}

/// Stop a child that exits when its stdin closes: close it, give the child
/// half a minute to exit on its own (a profiler around it then writes its
/// counts), then kill it.
pub fn stop(child: &mut Child) {
    drop(child.stdin.take());
    for _ in 0..600 {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The child's side: serve until stdin closes.
pub async fn serve(which: &str, delay: Duration) {
    match which {
        "google" => {
            let google = autopush_tests::google::Google::start().await;
            google.set_delay(delay);
            google.count_only();
            announce(json!({
                "base_url": google.base_url(),
                "service_account": google.service_account(),
            }));
            wait_for_stdin_to_close().await;
        }
        "apple" => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind the Apple stand-in");
            let addr = listener.local_addr().expect("local_addr");
            let apple = Arc::new(Apple {
                delay,
                received: AtomicU64::new(0),
            });
            tokio::spawn(apple.serve(listener));
            announce(json!({"base_url": format!("http://{addr}")}));
            wait_for_stdin_to_close().await;
        }
        other => {
            eprintln!("stand-in: {other} is not google or apple");
            std::process::exit(2);
        }
    }
}

fn announce(info: Value) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{info}");
    let _ = stdout.flush();
}

async fn wait_for_stdin_to_close() {
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0u8; 64];
    while matches!(stdin.read(&mut buffer).await, Ok(n) if n > 0) {}
}

/// Apple's provider API as the bench needs it: `POST /3/device/{token}`
/// over HTTP/2 (h2c, prior knowledge) answered 200 with an `apns-id` after
/// a fixed delay, and `GET /stats`. Like Apple it lets a connection carry
/// 1 000 requests at once.
struct Apple {
    delay: Duration,
    received: AtomicU64,
}

/// Streams a connection may carry at once (Apple's documented figure).
pub const APPLE_MAX_STREAMS: u32 = 1000;

impl Apple {
    async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let apple = self.clone();
            tokio::spawn(async move {
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                builder
                    .http2()
                    .max_concurrent_streams(APPLE_MAX_STREAMS)
                    .timer(hyper_util::rt::TokioTimer::new());
                let service = hyper::service::service_fn(move |request| {
                    let apple = apple.clone();
                    async move { Ok::<_, Infallible>(apple.answer(request).await) }
                });
                let _ = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    }

    async fn answer(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let reply = |status: StatusCode, body: String| {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response
        };
        if request.uri().path() == "/stats" {
            let received = self.received.load(Ordering::Relaxed);
            return reply(StatusCode::OK, json!({"received": received}).to_string());
        }
        let is_push = request.method() == hyper::Method::POST
            && request.uri().path().starts_with("/3/device/");
        let has_topic = request.headers().contains_key("apns-topic");
        let body = request.into_body().collect().await;
        if !is_push || !has_topic || body.is_err() {
            return reply(
                StatusCode::BAD_REQUEST,
                json!({"reason": "BadPath"}).to_string(),
            );
        }
        self.received.fetch_add(1, Ordering::Relaxed);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let mut response = reply(StatusCode::OK, String::new());
        response.headers_mut().insert(
            "apns-id",
            hyper::header::HeaderValue::from_static("00000000-0000-0000-0000-000000000000"),
        );
        response
    }
}
