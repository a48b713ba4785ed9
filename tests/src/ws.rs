//! A websocket client speaking the push protocol as Firefox does.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::HANG_GUARD;

/// The websocket subprotocol of the push service.
pub const SUBPROTOCOL: &str = "push-notification";

/// How the server ended a connection.
#[derive(Debug, Clone)]
pub struct Closed {
    /// The close frame's code, when the server sent one.
    pub code: Option<u16>,
    /// The close frame's reason ("" when none).
    pub reason: String,
    /// JSON messages received (or still unread) before the close.
    pub messages: Vec<Value>,
}

/// A websocket client of the push service.
pub struct WsClient {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    /// The subprotocol the server accepted (from the handshake response).
    pub subprotocol: Option<String>,
    /// The UAID of the last successful `hello`.
    pub uaid: Option<String>,
    /// Messages read while looking for another kind, returned first by `recv`.
    pending: VecDeque<Value>,
}

impl WsClient {
    /// Connect offering the `push-notification` subprotocol.
    pub async fn connect(url: &str) -> WsClient {
        Self::try_connect(url, Some(SUBPROTOCOL))
            .await
            .unwrap_or_else(|e| panic!("websocket connect to {url}: {e}"))
    }

    /// Connect and say hello (`uaid` None = a new user agent); panics unless
    /// the hello succeeds.
    pub async fn connect_hello(url: &str, uaid: Option<&str>) -> WsClient {
        let mut ws = WsClient::connect(url).await;
        let reply = ws.hello(uaid).await;
        assert_eq!(reply["status"], 200, "hello failed: {reply}");
        ws
    }

    /// Connect offering no subprotocol.
    pub async fn connect_without_subprotocol(url: &str) -> WsClient {
        Self::try_connect(url, None)
            .await
            .unwrap_or_else(|e| panic!("websocket connect to {url}: {e}"))
    }

    /// Connect (offering the subprotocol) with a socket receive buffer of a
    /// few KiB, so that the server's sends block as soon as this client stops
    /// reading, as they would over a slow or stalled network.
    pub async fn connect_small_buffer(url: &str) -> WsClient {
        let addr = url
            .trim_start_matches("ws://")
            .trim_end_matches('/')
            .parse::<std::net::SocketAddr>()
            .unwrap_or_else(|e| panic!("{url}: not ws://IP:PORT/: {e}"));
        let socket = tokio::net::TcpSocket::new_v4().expect("TCP socket");
        socket
            .set_recv_buffer_size(4096)
            .expect("set the receive buffer size");
        let stream = tokio::time::timeout(HANG_GUARD, socket.connect(addr))
            .await
            .unwrap_or_else(|_| panic!("TCP connect to {url} hung"))
            .unwrap_or_else(|e| panic!("TCP connect to {url}: {e}"));
        let mut request = url.into_client_request().expect("websocket request");
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static(SUBPROTOCOL),
        );
        let (ws, response) = tokio::time::timeout(
            HANG_GUARD,
            tokio_tungstenite::client_async(request, MaybeTlsStream::Plain(stream)),
        )
        .await
        .unwrap_or_else(|_| panic!("websocket handshake with {url} hung"))
        .unwrap_or_else(|e| panic!("websocket handshake with {url}: {e}"));
        WsClient::after_handshake(ws, &response)
    }

    /// Connect offering the subprotocol, with extra request headers (e.g.
    /// `X-Forwarded-For`, as a proxy in front of the node would add).
    pub async fn connect_with_headers(url: &str, headers: &[(&'static str, &str)]) -> WsClient {
        Self::try_connect_with(url, Some(SUBPROTOCOL), headers)
            .await
            .unwrap_or_else(|e| panic!("websocket connect to {url}: {e}"))
    }

    /// Connect, offering `subprotocol` if given.
    pub async fn try_connect(
        url: &str,
        subprotocol: Option<&str>,
    ) -> Result<WsClient, tungstenite::Error> {
        Self::try_connect_with(url, subprotocol, &[]).await
    }

    async fn try_connect_with(
        url: &str,
        subprotocol: Option<&str>,
        headers: &[(&'static str, &str)],
    ) -> Result<WsClient, tungstenite::Error> {
        let request = handshake_request(url, subprotocol, headers)?;
        let (ws, response) =
            tokio::time::timeout(HANG_GUARD, tokio_tungstenite::connect_async(request))
                .await
                .unwrap_or_else(|_| panic!("websocket connect to {url} hung"))?;
        Ok(WsClient::after_handshake(ws, &response))
    }

    /// Connect to a `wss://IP:PORT/` URL (offering the subprotocol) from the
    /// local address `from`, trusting only the CA certificates in the PEM
    /// file `ca`, with extra request headers. Clients behind one proxy are
    /// told apart by their address: loopback has a whole /8 (127.0.0.2, ...).
    pub async fn try_connect_tls(
        url: &str,
        ca: &Path,
        from: IpAddr,
        headers: &[(&'static str, &str)],
    ) -> Result<WsClient, tungstenite::Error> {
        let request = handshake_request(url, Some(SUBPROTOCOL), headers)?;
        let uri = request.uri();
        let to: SocketAddr = format!(
            "{}:{}",
            uri.host().unwrap_or_default(),
            uri.port_u16().unwrap_or(443)
        )
        .parse()
        .unwrap_or_else(|e| panic!("{url}: not wss://IP:PORT/: {e}"));
        let socket = tokio::net::TcpSocket::new_v4().expect("TCP socket");
        socket
            .bind(SocketAddr::new(from, 0))
            .unwrap_or_else(|e| panic!("bind the client to {from}: {e}"));
        let stream = tokio::time::timeout(HANG_GUARD, socket.connect(to))
            .await
            .unwrap_or_else(|_| panic!("TCP connect to {url} hung"))?;
        let connector = tokio_tungstenite::Connector::Rustls(crate::tls::client_config_from(ca));
        let (ws, response) = tokio::time::timeout(
            HANG_GUARD,
            tokio_tungstenite::client_async_tls_with_config(request, stream, None, Some(connector)),
        )
        .await
        .unwrap_or_else(|_| panic!("websocket handshake with {url} hung"))?;
        Ok(WsClient::after_handshake(ws, &response))
    }

    /// [`WsClient::try_connect_tls`] from 127.0.0.1 that says hello as a new
    /// user agent; panics unless both succeed.
    pub async fn connect_tls_hello(url: &str, ca: &Path) -> WsClient {
        let localhost = IpAddr::from([127, 0, 0, 1]);
        let mut ws = WsClient::try_connect_tls(url, ca, localhost, &[])
            .await
            .unwrap_or_else(|e| panic!("websocket connect to {url}: {e}"));
        let reply = ws.hello(None).await;
        assert_eq!(reply["status"], 200, "hello failed: {reply}");
        ws
    }

    fn after_handshake(
        ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
        response: &tungstenite::handshake::client::Response,
    ) -> WsClient {
        let subprotocol = response
            .headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        WsClient {
            ws,
            subprotocol,
            uaid: None,
            pending: VecDeque::new(),
        }
    }

    /// Send a hello (`uaid` None = `""`, a new user agent) and return the
    /// server's hello reply. Remembers the reply's UAID.
    pub async fn hello(&mut self, uaid: Option<&str>) -> Value {
        self.send_json(json!({
            "messageType": "hello",
            "uaid": uaid.unwrap_or(""),
            "use_webpush": true,
        }))
        .await;
        let reply = self.recv_type("hello").await;
        if let Some(u) = reply["uaid"].as_str() {
            self.uaid = Some(u.to_string());
        }
        reply
    }

    /// The UAID of the last hello; panics when there was none.
    pub fn uaid(&self) -> &str {
        self.uaid
            .as_deref()
            .expect("no hello reply with a uaid yet")
    }

    /// Register a channel (with an optional VAPID public key) and return the reply.
    pub async fn register(&mut self, channel_id: &str, key: Option<&str>) -> Value {
        let mut msg = json!({"messageType": "register", "channelID": channel_id});
        if let Some(k) = key {
            msg["key"] = json!(k);
        }
        self.send_json(msg).await;
        self.recv_type("register").await
    }

    /// Unregister a channel with a reason code and return the reply.
    pub async fn unregister(&mut self, channel_id: &str, code: u16) -> Value {
        self.send_json(json!({
            "messageType": "unregister",
            "channelID": channel_id,
            "code": code,
        }))
        .await;
        self.recv_type("unregister").await
    }

    /// Acknowledge a notification (code 100). The server sends no reply.
    pub async fn ack(&mut self, channel_id: &str, version: &str) {
        self.send_json(json!({
            "messageType": "ack",
            "updates": [{"channelID": channel_id, "version": version, "code": 100}],
        }))
        .await;
    }

    /// Acknowledge the notification `notification` (as received).
    pub async fn ack_notification(&mut self, notification: &Value) {
        let chid = notification["channelID"].as_str().expect("channelID");
        let version = notification["version"].as_str().expect("version");
        self.ack(chid, version).await;
    }

    /// Acknowledge the notifications `notifications` (as received) in one
    /// `ack` message.
    pub async fn ack_notifications(&mut self, notifications: &[Value]) {
        let updates: Vec<Value> = notifications
            .iter()
            .map(|n| json!({"channelID": n["channelID"], "version": n["version"], "code": 100}))
            .collect();
        self.send_json(json!({"messageType": "ack", "updates": updates}))
            .await;
    }

    /// Negatively acknowledge a notification. The server sends no reply.
    pub async fn nack(&mut self, channel_id: &str, version: &str, code: u16) {
        self.send_json(json!({
            "messageType": "nack",
            "updates": [{"channelID": channel_id, "version": version, "code": code}],
        }))
        .await;
    }

    /// Send `{"messageType":"urgency","min":min}` and return the answer.
    pub async fn set_min_urgency(&mut self, min: Value) -> Value {
        self.send_json(json!({"messageType": "urgency", "min": min}))
            .await;
        self.recv_type("urgency").await
    }

    /// Send a ping (`{}`); read the `{}` reply with [`WsClient::recv`].
    pub async fn ping(&mut self) {
        self.send_text("{}").await;
    }

    /// Send a JSON text message.
    pub async fn send_json(&mut self, value: Value) {
        self.send_text(&value.to_string()).await;
    }

    /// Send a text message as is.
    pub async fn send_text(&mut self, text: &str) {
        let sent = tokio::time::timeout(HANG_GUARD, self.ws.send(Message::text(text.to_string())))
            .await
            .unwrap_or_else(|_| panic!("sending {text:?} hung"));
        if let Err(e) = sent {
            panic!("sending {text:?}: {e}");
        }
    }

    /// The next JSON message (hang guard: panics after [`HANG_GUARD`]).
    pub async fn recv(&mut self) -> Value {
        if let Some(v) = self.pending.pop_front() {
            return v;
        }
        match self.next_json(Instant::now() + HANG_GUARD).await {
            Next::Json(v) => v,
            Next::TimedOut => panic!("no message from the server within {HANG_GUARD:?}"),
            Next::Closed(c) => panic!("connection closed while waiting for a message: {c:?}"),
        }
    }

    /// The next JSON message, or how the server closed the connection
    /// (hang guard: panics after [`HANG_GUARD`]).
    pub async fn recv_or_closed(&mut self) -> Result<Value, Closed> {
        if let Some(v) = self.pending.pop_front() {
            return Ok(v);
        }
        match self.next_json(Instant::now() + HANG_GUARD).await {
            Next::Json(v) => Ok(v),
            Next::TimedOut => panic!("no message or close from the server within {HANG_GUARD:?}"),
            Next::Closed(c) => Err(c),
        }
    }

    /// The next message whose `messageType` is `kind`; other messages read
    /// meanwhile are kept for later `recv` calls.
    pub async fn recv_type(&mut self, kind: &str) -> Value {
        if let Some(i) = self.pending.iter().position(|v| v["messageType"] == kind) {
            return self.pending.remove(i).expect("pending index");
        }
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            match self.next_json(deadline).await {
                Next::Json(v) if v["messageType"] == kind => return v,
                Next::Json(v) => self.pending.push_back(v),
                Next::TimedOut => panic!(
                    "no {kind:?} message within {HANG_GUARD:?}; other messages: {:?}",
                    self.pending
                ),
                Next::Closed(c) => panic!(
                    "connection closed while waiting for a {kind:?} message: {c:?}; \
                     other messages: {:?}",
                    self.pending
                ),
            }
        }
    }

    /// The next notification.
    pub async fn recv_notification(&mut self) -> Value {
        self.recv_type("notification").await
    }

    /// `n` notifications, in arrival order.
    pub async fn recv_notifications(&mut self, n: usize) -> Vec<Value> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.recv_notification().await);
        }
        out
    }

    /// A message arriving within `wait`, if any. Only for asserting absence.
    pub async fn try_recv_for(&mut self, wait: Duration) -> Option<Value> {
        if let Some(v) = self.pending.pop_front() {
            return Some(v);
        }
        match self.next_json(Instant::now() + wait).await {
            Next::Json(v) => Some(v),
            Next::TimedOut => None,
            Next::Closed(c) => panic!("connection closed unexpectedly: {c:?}"),
        }
    }

    /// Assert that no message arrives within [`crate::QUIET`].
    pub async fn assert_nothing_arrives(&mut self) {
        if let Some(v) = self.try_recv_for(crate::QUIET).await {
            panic!("expected no message, got: {v}");
        }
    }

    /// Wait until the server closes the connection (hang guard: panics after
    /// [`HANG_GUARD`]). Messages received before the close are returned too.
    pub async fn expect_closed(&mut self) -> Closed {
        let mut messages: Vec<Value> = self.pending.drain(..).collect();
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            match self.next_json(deadline).await {
                Next::Json(v) => messages.push(v),
                Next::TimedOut => {
                    // Message types only: notifications can be megabytes.
                    let types: Vec<&str> = messages
                        .iter()
                        .map(|m| m["messageType"].as_str().unwrap_or("?"))
                        .collect();
                    panic!(
                        "the server did not close the connection within {HANG_GUARD:?}; \
                         received {} messages: {types:?}",
                        messages.len()
                    )
                }
                Next::Closed(mut c) => {
                    c.messages = messages;
                    return c;
                }
            }
        }
    }

    /// Close with close code `code` (e.g. 4774: "wake me when something
    /// arrives") and wait for the close handshake.
    pub async fn close_with(mut self, code: u16) {
        use tokio_tungstenite::tungstenite::protocol::CloseFrame;
        let frame = CloseFrame {
            code: code.into(),
            reason: "".into(),
        };
        let _ = tokio::time::timeout(HANG_GUARD, self.ws.close(Some(frame))).await;
        let deadline = Instant::now() + HANG_GUARD;
        while let Ok(Some(Ok(_))) = tokio::time::timeout_at(deadline, self.ws.next()).await {}
    }

    /// Close the connection from the client side and wait for the close handshake.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(HANG_GUARD, self.ws.close(None)).await;
        let deadline = Instant::now() + HANG_GUARD;
        while let Ok(Some(Ok(_))) = tokio::time::timeout_at(deadline, self.ws.next()).await {}
    }

    async fn next_json(&mut self, deadline: Instant) -> Next {
        loop {
            let msg = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Next::TimedOut,
                Ok(m) => m,
            };
            match msg {
                Some(Ok(Message::Text(text))) => {
                    let v = serde_json::from_str(text.as_str()).unwrap_or_else(|e| {
                        panic!("server sent a text message that is not JSON ({e}): {text:?}")
                    });
                    return Next::Json(v);
                }
                Some(Ok(Message::Binary(b))) => {
                    panic!("server sent a binary message: {b:?}")
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                Some(Ok(Message::Close(frame))) => {
                    return Next::Closed(Closed {
                        code: frame.as_ref().map(|f| u16::from(f.code)),
                        reason: frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                        messages: Vec::new(),
                    });
                }
                Some(Err(_)) | None => {
                    return Next::Closed(Closed {
                        code: None,
                        reason: String::new(),
                        messages: Vec::new(),
                    });
                }
            }
        }
    }
}

/// The handshake request for `url`: the subprotocol, if any, and `headers`.
fn handshake_request(
    url: &str,
    subprotocol: Option<&str>,
    headers: &[(&'static str, &str)],
) -> Result<tungstenite::handshake::client::Request, tungstenite::Error> {
    let mut request = url.into_client_request()?;
    for (name, value) in headers {
        request
            .headers_mut()
            .append(*name, HeaderValue::from_str(value).expect("header value"));
    }
    if let Some(p) = subprotocol {
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_str(p).expect("subprotocol header value"),
        );
    }
    Ok(request)
}

enum Next {
    Json(Value),
    TimedOut,
    Closed(Closed),
}
