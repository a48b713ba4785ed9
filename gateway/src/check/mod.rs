//! `autopush check URL`: prove that a deployment works, end to end, from the
//! outside, by playing both of its users at once.
//!
//! As a user agent it connects to the websocket at URL, says hello and
//! subscribes twice with fresh keys (a v1 endpoint, and a v2 one restricted
//! to a VAPID key). As an application server it sends VAPID-signed pushes in
//! both encodings to the endpoints the service returned, and the user agent
//! decrypts and acks each. Then it checks that a message sent while offline
//! arrives after reconnecting, and that an unsubscribed endpoint answers 410.
//! It works against any autopush-compatible service: it only uses the
//! protocol, and learns the endpoint URLs from the service's replies.
//!
//! One line per check with its latency; every wait is bounded, so a stalled
//! service fails with a reason instead of hanging.

mod agent;
mod tls;

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use autopush_common::http_client::error_chain;
use autopush_crypto::b64;
use autopush_crypto::ece::{self, Encoding, Encrypted, SubscriptionKeys};
use autopush_crypto::vapid::VapidKey;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use reqwest::Url;
use uuid::Uuid;

use agent::Agent;

pub struct Options {
    /// The service's websocket URL (`ws://localhost:8080/`, `wss://…`).
    pub url: String,
    /// A CA certificate (PEM) to trust beyond the system's roots.
    pub ca: Option<PathBuf>,
    /// The longest any single wait may take.
    pub wait: Duration,
    /// The VAPID `sub` claim of the pushes.
    pub vapid_sub: String,
}

/// Run every check, printing one line each; whether all passed.
pub async fn run(options: &Options) -> bool {
    let mut report = Report::default();
    let finished = checks(options, &mut report).await.is_some();
    let total = report.passed + report.failed;
    if report.failed == 0 && finished {
        println!("autopush check: all {total} checks passed");
        true
    } else if finished {
        println!("autopush check: {} of {total} checks failed", report.failed);
        false
    } else {
        println!("autopush check: stopped at the first failure that later checks depend on");
        false
    }
}

#[derive(Default)]
struct Report {
    passed: usize,
    failed: usize,
}

impl Report {
    /// Run one check and print its line.
    async fn check<T>(
        &mut self,
        name: &str,
        work: impl Future<Output = Result<T, String>>,
    ) -> Option<T> {
        let start = Instant::now();
        match work.await {
            Ok(value) => {
                let ms = start.elapsed().as_secs_f64() * 1000.0;
                println!("ok   {name:<34} {ms:>8.1} ms");
                self.passed += 1;
                Some(value)
            }
            Err(reason) => {
                println!("FAIL {name}: {reason}");
                self.failed += 1;
                None
            }
        }
    }
}

/// A channel the check subscribed, with the user agent's keys for it.
struct Subscription {
    name: &'static str,
    channel_id: String,
    endpoint: Url,
    keys: SubscriptionKeys,
}

impl Subscription {
    async fn register(
        agent: &mut Agent,
        name: &'static str,
        key: Option<&VapidKey>,
    ) -> Result<Subscription, String> {
        let channel_id = Uuid::new_v4().to_string();
        let key = key.map(|k| b64(k.public_key()));
        let endpoint = agent.register(&channel_id, key.as_deref()).await?;
        let endpoint = Url::parse(&endpoint)
            .ok()
            .filter(|url| matches!(url.scheme(), "http" | "https"))
            .ok_or_else(|| format!("the pushEndpoint {endpoint:?} is not an http(s):// URL"))?;
        Ok(Subscription {
            name,
            channel_id,
            endpoint,
            keys: SubscriptionKeys::generate(),
        })
    }

    /// The endpoint without its token, for messages.
    fn endpoint_shown(&self) -> String {
        let url = self.endpoint.as_str();
        match url.rfind('/') {
            Some(slash) => format!("{}/…", &url[..slash]),
            None => url.to_owned(),
        }
    }
}

/// The most of an answer's body that is read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The application server the check plays.
struct Sender {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    wait: Duration,
    vapid: VapidKey,
    vapid_sub: String,
}

impl Sender {
    /// Encrypt `text` for `sub` and POST it with a VAPID signature; the status.
    async fn post(
        &self,
        sub: &Subscription,
        encoding: Encoding,
        text: &str,
    ) -> Result<(u16, String), String> {
        let message = ece::encrypt(
            sub.keys.p256dh(),
            sub.keys.auth(),
            text.as_bytes(),
            encoding,
        )
        .map_err(|e| format!("encrypting: {e}"))?;
        let audience = sub.endpoint.origin().ascii_serialization();
        let mut request = http::Request::post(sub.endpoint.as_str())
            .header("ttl", "60")
            .header(
                "authorization",
                self.vapid.authorization(&audience, &self.vapid_sub),
            );
        for (name, value) in message.http_headers() {
            request = request.header(name, value);
        }
        let where_to = sub.endpoint_shown();
        let request = request
            .body(Full::new(Bytes::from(message.body)))
            .map_err(|e| format!("POST {where_to}: {e}"))?;
        let unreachable = |e: String| {
            format!(
                "POST {where_to}: {e}; the endpoint URL comes from the service's \
                 --endpoint-url: is it right, and reachable from here?"
            )
        };
        let answered = async {
            let response = self.http.request(request).await.map_err(|e| {
                if sub.endpoint.scheme() == "https" {
                    unreachable(tls::failed(&where_to, &e))
                } else {
                    unreachable(error_chain(&e))
                }
            })?;
            let status = response.status().as_u16();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
                .unwrap_or_default();
            Ok((status, body))
        };
        tokio::time::timeout(self.wait, answered)
            .await
            .map_err(|_| unreachable(format!("no answer within {:?}", self.wait)))?
    }

    /// [`Sender::post`], which must be accepted (201).
    async fn push(&self, sub: &Subscription, encoding: Encoding, text: &str) -> Result<(), String> {
        match self.post(sub, encoding, text).await? {
            (201, _) => Ok(()),
            (status, body) => Err(format!(
                "POST {} answered {status}: {}",
                sub.endpoint_shown(),
                body.trim()
            )),
        }
    }
}

/// A message nobody else could have sent.
fn new_text(what: &str) -> String {
    format!("autopush check: {what} {}", Uuid::new_v4().simple())
}

/// The next notification for `sub`: decrypted, compared with `expected`, acked.
async fn receive(
    agent: &mut Agent,
    sub: &Subscription,
    expected: &str,
    acked: &mut Vec<String>,
) -> Result<(), String> {
    let notification = agent.notification(&sub.channel_id).await?;
    let message = Encrypted::from_notification(&notification)
        .map_err(|e| format!("the notification cannot be read: {e}: {notification}"))?;
    let plaintext = sub
        .keys
        .decrypt(&message)
        .map_err(|e| format!("the notification does not decrypt: {e}"))?;
    agent.ack(&notification).await?;
    let plaintext = String::from_utf8_lossy(&plaintext);
    if plaintext == expected {
        acked.push(plaintext.into_owned());
        Ok(())
    } else if acked.iter().any(|a| *a == plaintext) {
        Err(format!(
            "a message acknowledged before came again ({plaintext:?}): the ack was lost"
        ))
    } else {
        Err(format!("received {plaintext:?}, sent {expected:?}"))
    }
}

/// `None`: stopped at a failure that later checks depend on.
async fn checks(options: &Options, report: &mut Report) -> Option<()> {
    let wait = options.wait;
    let tls = tls::client_config(options.ca.as_deref())
        .map_err(|e| println!("FAIL {e}"))
        .ok()?;
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(Some(wait));
    // No redirects are followed: a push answered 3xx fails its check.
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config((*tls).clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(tcp);
    let sender = Sender {
        http: Client::builder(TokioExecutor::new()).build(connector),
        wait,
        vapid: VapidKey::generate(),
        vapid_sub: options.vapid_sub.clone(),
    };
    let url = options.url.as_str();

    let mut agent = report
        .check("connect", Agent::connect(url, wait, &tls))
        .await?;
    let uaid = report.check("hello", agent.hello("")).await?;
    let v1 = report
        .check(
            "register v1",
            Subscription::register(&mut agent, "v1", None),
        )
        .await?;
    let v2 = report
        .check(
            "register v2 (with key)",
            Subscription::register(&mut agent, "v2", Some(&sender.vapid)),
        )
        .await?;

    let mut acked = Vec::new();
    for (sub, encoding) in [
        (&v1, Encoding::Aes128Gcm),
        (&v1, Encoding::AesGcm),
        (&v2, Encoding::Aes128Gcm),
        (&v2, Encoding::AesGcm),
    ] {
        let name = format!("push {} to {}", encoding.as_str(), sub.name);
        let delivered = report
            .check(&name, async {
                let text = new_text(&name);
                sender.push(sub, encoding, &text).await?;
                receive(&mut agent, sub, &text, &mut acked).await
            })
            .await;
        // Without the plainest push working, nothing after it can.
        if acked.is_empty() {
            return delivered;
        }
    }

    agent.close().await;
    let offline_text = new_text("sent while offline");
    report
        .check(
            "push while offline",
            sender.push(&v1, Encoding::Aes128Gcm, &offline_text),
        )
        .await?;
    let mut agent = report
        .check("stored delivery on reconnect", async {
            let mut agent = Agent::connect(url, wait, &tls).await?;
            let again = agent.hello(&uaid).await?;
            if again != uaid {
                return Err(format!(
                    "the service gave a new uaid on reconnect ({again} for {uaid}): \
                     messages stored for the old one are lost"
                ));
            }
            receive(&mut agent, &v1, &offline_text, &mut acked).await?;
            Ok(agent)
        })
        .await?;

    let unsubscribed = report
        .check("unregister v2", agent.unregister(&v2.channel_id))
        .await;
    agent.close().await;
    if unsubscribed.is_some() {
        report
            .check("unsubscribed endpoint answers 410", async {
                match sender
                    .post(&v2, Encoding::Aes128Gcm, &new_text("after unregister"))
                    .await?
                {
                    (410, _) => Ok(()),
                    (status, body) => Err(format!(
                        "POST {} answered {status}, not 410: {}",
                        v2.endpoint_shown(),
                        body.trim()
                    )),
                }
            })
            .await;
    }
    Some(())
}
