//! A user agent as the load generator plays it: one websocket speaking the
//! push protocol (hello, register, receive, ack), from a chosen loopback
//! source address so that tens of thousands of clients do not run out of
//! ephemeral ports, over TLS (`wss://`) when the server speaks it.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{WebSocketStream, client_async_with_config};
use tokio_util::either::Either;

pub type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// The longest the generator waits for any answer from the server under
/// test (`--timeout`, 30 s by default): one that refuses or stalls fails the
/// scenario with the reason instead of hanging it.
static WAIT: OnceLock<Duration> = OnceLock::new();

/// Set the wait (once, before any scenario runs).
pub fn set_wait(wait: Duration) {
    let _ = WAIT.set(wait);
}

pub fn wait() -> Duration {
    *WAIT.get_or_init(|| Duration::from_secs(30))
}

/// The CA `wss://` and `https://` connections trust (the run's, or `--ca`
/// of an idle worker), and the file it came from.
static TRUST: OnceLock<(PathBuf, Arc<rustls::ClientConfig>)> = OnceLock::new();

/// Trust the CA certificate in `ca` (once, before any TLS connection).
pub fn trust(ca: &Path) {
    TRUST.get_or_init(|| (ca.to_owned(), crate::tls::client_config(ca)));
}

/// The CA file trusted, if any.
pub fn trusted() -> Option<&'static Path> {
    TRUST.get().map(|(ca, _)| ca.as_path())
}

/// A TCP or TLS connection.
pub type Socket = Either<TcpStream, TlsStream<TcpStream>>;

/// `stream`, over TLS with the trusted CA when `tls`.
pub async fn secure(stream: TcpStream, tls: bool) -> Result<Socket, BenchError> {
    if !tls {
        return Ok(Either::Left(stream));
    }
    let (_, config) = TRUST
        .get()
        .ok_or("a TLS server, but no CA to trust (the run's or --ca)")?;
    let name = rustls::pki_types::ServerName::IpAddress(stream.peer_addr()?.ip().into());
    let tls = within(
        "the TLS handshake",
        TlsConnector::from(config.clone()).connect(name, stream),
    )
    .await?;
    Ok(Either::Right(tls))
}

/// `step`, or an error naming `what` was not answered within [`wait`].
pub async fn within<T, E: Into<BenchError>>(
    what: &str,
    step: impl Future<Output = Result<T, E>>,
) -> Result<T, BenchError> {
    match tokio::time::timeout(wait(), step).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(format!("the server did not answer {what} within {:?}", wait()).into()),
    }
}

/// The loopback source address of the `i`-th client: 10 000 per address
/// (127.0.0.2, .3, ...), well within each address's ephemeral port range.
pub fn source_address(i: usize) -> IpAddr {
    [127, 0, 0, 2 + (i / 10_000) as u8].into()
}

pub struct PushClient {
    ws: WebSocketStream<Socket>,
    pub uaid: String,
}

/// One notification as the client received it.
pub struct Received {
    pub channel_id: String,
    pub version: String,
    pub data: Option<String>,
}

impl PushClient {
    /// Connect from `source` and say hello (with `uaid` to come back as a
    /// known client).
    pub async fn connect(
        url: &str,
        source: IpAddr,
        uaid: Option<&str>,
    ) -> Result<PushClient, BenchError> {
        let (tls, address) = match url.strip_prefix("wss://") {
            Some(address) => (true, address),
            None => (false, url.trim_start_matches("ws://")),
        };
        let server: SocketAddr = address.trim_end_matches('/').parse()?;
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(source, 0))?;
        let stream = within("the TCP connect", socket.connect(server)).await?;
        stream.set_nodelay(true)?;
        let stream = secure(stream, tls).await?;
        // The generator holds thousands of sockets: keep its own buffers small.
        let config = WebSocketConfig::default()
            .read_buffer_size(8 * 1024)
            .write_buffer_size(0);
        let (ws, _) = within(
            "the websocket handshake",
            client_async_with_config(url, stream, Some(config)),
        )
        .await?;
        let mut client = PushClient {
            ws,
            uaid: String::new(),
        };
        let mut hello = json!({"messageType": "hello", "use_webpush": true});
        if let Some(uaid) = uaid {
            hello["uaid"] = json!(uaid);
        }
        client.send(&hello).await?;
        let reply = client.expect("hello").await?;
        client.uaid = reply["uaid"].as_str().unwrap_or_default().to_owned();
        Ok(client)
    }

    /// Subscribe a new channel; returns its push endpoint. `key` is the
    /// application server's public key (a v2, VAPID-bound endpoint).
    pub async fn register(&mut self, key: Option<&str>) -> Result<String, BenchError> {
        let channel_id = uuid::Uuid::new_v4().to_string();
        let mut register = json!({"messageType": "register", "channelID": channel_id});
        if let Some(key) = key {
            register["key"] = json!(key);
        }
        self.send(&register).await?;
        let reply = self.expect("register").await?;
        match reply["pushEndpoint"].as_str() {
            Some(endpoint) => Ok(endpoint.to_owned()),
            None => Err(format!("register failed: {reply}").into()),
        }
    }

    /// The next notification within [`wait`]; `None` when the server closed
    /// the socket.
    pub async fn wait_notification(&mut self) -> Result<Option<Received>, BenchError> {
        within("with a notification", self.next_notification()).await
    }

    /// The next notification, however long it takes (for clients that idle
    /// on purpose); `None` when the server closed the socket.
    pub async fn next_notification(&mut self) -> Result<Option<Received>, BenchError> {
        loop {
            let Some(reply) = self.next_json().await? else {
                return Ok(None);
            };
            if reply["messageType"] == "notification" {
                return Ok(Some(Received {
                    channel_id: text(&reply["channelID"]),
                    version: text(&reply["version"]),
                    data: reply["data"].as_str().map(str::to_owned),
                }));
            }
        }
    }

    pub async fn ack(&mut self, received: &Received) -> Result<(), BenchError> {
        self.send(&json!({
            "messageType": "ack",
            "updates": [{"channelID": received.channel_id, "version": received.version}],
        }))
        .await
    }

    pub async fn close(mut self) {
        let _ = tokio::time::timeout(wait(), self.ws.close(None)).await;
    }

    async fn send(&mut self, message: &Value) -> Result<(), BenchError> {
        within(
            "a websocket write",
            self.ws.send(Message::text(message.to_string())),
        )
        .await
    }

    async fn expect(&mut self, message_type: &str) -> Result<Value, BenchError> {
        within(message_type, self.expect_forever(message_type)).await
    }

    async fn expect_forever(&mut self, message_type: &str) -> Result<Value, BenchError> {
        loop {
            match self.next_json().await? {
                Some(reply) if reply["messageType"] == message_type => return Ok(reply),
                Some(_) => continue,
                None => return Err(format!("closed while waiting for {message_type}").into()),
            }
        }
    }

    async fn next_json(&mut self) -> Result<Option<Value>, BenchError> {
        while let Some(frame) = self.ws.next().await {
            match frame? {
                Message::Text(text) => return Ok(Some(serde_json::from_str(&text)?)),
                Message::Close(_) => return Ok(None),
                _ => continue,
            }
        }
        Ok(None)
    }
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}

/// Handshakes in flight at once when connecting many clients: enough that
/// clients a long round trip away connect in seconds, not minutes.
const CONNECT_CONCURRENCY: usize = 64;

/// Connect `count` clients to `url` (client `i` from [`source_address`]`(i)`),
/// each registering one channel with the application server's `key`; in
/// order, with their endpoints.
pub async fn connect_many(
    url: &str,
    count: usize,
    key: &str,
) -> Result<Vec<(PushClient, String)>, BenchError> {
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(CONNECT_CONCURRENCY));
    let mut connecting = tokio::task::JoinSet::new();
    for i in 0..count {
        let (url, key, permits) = (url.to_owned(), key.to_owned(), permits.clone());
        connecting.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let mut client = PushClient::connect(&url, source_address(i), None).await?;
            let endpoint = client.register(Some(&key)).await?;
            Ok::<_, BenchError>((i, client, endpoint))
        });
    }
    let mut clients = Vec::with_capacity(count);
    while let Some(joined) = connecting.join_next().await {
        clients.push(joined??);
    }
    clients.sort_by_key(|(i, _, _)| *i);
    Ok(clients
        .into_iter()
        .map(|(_, client, endpoint)| (client, endpoint))
        .collect())
}
