//! The HTTP client a project posts its messages through: hyper-util's pooled
//! HTTP/1.1 client over rustls (ring), one keep-alive connection per request
//! in flight, reused from push to push.
//!
//! This is the client reqwest wraps, used without reqwest: reqwest 0.13
//! turns every request's URI back into a string and parses it as a URL twice
//! (for its redirect policy, then for the response), whatever the policy,
//! which cost about 15 000 instructions of a push's 210 000. A project posts
//! to one URL, parsed once here, and follows no redirects (a 3xx is an answer
//! to judge, and the bearer token goes to no other URL).

use std::time::Duration;

use autopush_common::http_client::{error_chain, install_crypto_provider};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// The most of an answer's body that is read: FCM's error bodies are a few
/// hundred bytes, and an upstream that sends more cannot make a push hold
/// more memory than this.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// How long an idle connection is kept for the next push (reqwest's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// FCM's answer to one request.
pub struct Answer {
    pub status: StatusCode,
    /// `Retry-After`, in seconds as FCM sends it.
    pub retry_after: Option<u64>,
    pub body: Bytes,
}

/// Why a request got no answer.
#[derive(Debug)]
pub struct NoAnswer(String);

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Posts JSON bodies to one URL.
pub struct Upstream {
    uri: Uri,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl Upstream {
    /// A client for `url` (http or https), giving up on a connection that is
    /// not made within `connect_timeout`. An https URL needs the system's
    /// root certificates (Debian: `ca-certificates`), as Google's OAuth
    /// client does.
    pub fn new(url: &str, connect_timeout: Duration) -> Result<Upstream, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{url:?}: {e}"))?;
        install_crypto_provider();
        let tls = HttpsConnectorBuilder::new();
        let tls = if uri.scheme_str() == Some("https") {
            tls.with_native_roots()
                .map_err(|e| format!("no root certificates for https: {e}"))?
        } else {
            // Plain http: no certificate is ever checked.
            tls.with_tls_config(
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            )
        };
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(connect_timeout));
        let connector = tls.https_or_http().enable_http1().wrap_connector(tcp);
        let http = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .build(connector);
        Ok(Upstream { uri, http })
    }

    /// POST `body` (JSON) with this `Authorization` header.
    pub async fn post(&self, authorization: &HeaderValue, body: Bytes) -> Result<Answer, NoAnswer> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.uri.clone();
        let headers = request.headers_mut();
        headers.insert(AUTHORIZATION, authorization.clone());
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let response = self
            .http
            .request(request)
            .await
            .map_err(|e| NoAnswer(error_chain(&e)))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        // Read to the end, so the connection goes back to the pool.
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| NoAnswer(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok(Answer {
            status,
            retry_after,
            body,
        })
    }
}
