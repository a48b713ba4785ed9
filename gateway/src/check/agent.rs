//! The user agent `autopush check` plays: a websocket client of the push
//! protocol whose every wait is bounded and whose every failure is a
//! sentence for the operator.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_rustls::TlsConnector;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};

/// The connection under the websocket: TCP, or TLS over TCP.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub struct Agent {
    ws: WebSocketStream<Box<dyn Io>>,
    wait: Duration,
    /// Messages read while waiting for another kind.
    pending: VecDeque<Value>,
}

impl Agent {
    /// Open the websocket (offering the `push-notification` subprotocol, as
    /// Firefox does); a `wss://` one trusting the roots of `tls`.
    pub async fn connect(
        url: &str,
        wait: Duration,
        tls: &Arc<ClientConfig>,
    ) -> Result<Agent, String> {
        if !(url.starts_with("ws://") || url.starts_with("wss://")) {
            return Err(format!(
                "{url} is not a websocket URL: give the service's ws://… or wss://… URL, \
                 as Firefox's dom.push.serverURL holds it"
            ));
        }
        let mut request = url
            .into_client_request()
            .map_err(|e| format!("{url} is not a websocket URL: {e}"))?;
        request.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static("push-notification"),
        );
        let secure = url.starts_with("wss://");
        let uri = request.uri();
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_matches(|c| c == '[' || c == ']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
        let connecting = async {
            let tcp = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| format!("{url}: cannot connect: {e}"))?;
            // Without TCP_NODELAY a message right after one the server does
            // not answer (an ack, then unregister) would wait ~40 ms for its
            // TCP ack.
            let _ = tcp.set_nodelay(true);
            let stream: Box<dyn Io> = if secure {
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| format!("{url}: {host:?} is not a TLS server name: {e}"))?;
                let tls = TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| super::tls::failed(url, &e))?;
                Box::new(tls)
            } else {
                Box::new(tcp)
            };
            tokio_tungstenite::client_async_with_config(request, stream, None)
                .await
                .map_err(|e| match e {
                    tungstenite::Error::Http(response) => format!(
                        "{url} answered {} instead of a websocket upgrade: is it the service's \
                         websocket port (--port)?",
                        response.status()
                    ),
                    e => format!("{url}: {e}"),
                })
        };
        let (ws, _) = timeout(wait, connecting)
            .await
            .map_err(|_| format!("{url} did not complete the websocket handshake in {wait:?}"))??;
        Ok(Agent {
            ws,
            wait,
            pending: VecDeque::new(),
        })
    }

    /// Say hello (`uaid` "" for a new user agent); the UAID the server gave.
    pub async fn hello(&mut self, uaid: &str) -> Result<String, String> {
        self.send(json!({"messageType": "hello", "uaid": uaid, "use_webpush": true}))
            .await?;
        let reply = self.reply("hello", |_| true).await?;
        match reply["uaid"].as_str() {
            Some(uaid) if !uaid.is_empty() => Ok(uaid.to_owned()),
            _ => Err(format!("the hello reply has no uaid: {reply}")),
        }
    }

    /// Register a channel, restricted to a VAPID `key` when given; the
    /// endpoint the server gave.
    pub async fn register(
        &mut self,
        channel_id: &str,
        key: Option<&str>,
    ) -> Result<String, String> {
        let mut message = json!({"messageType": "register", "channelID": channel_id});
        if let Some(key) = key {
            message["key"] = json!(key);
        }
        self.send(message).await?;
        let reply = self
            .reply("register", |m| m["channelID"] == channel_id)
            .await?;
        reply["pushEndpoint"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("the register reply has no pushEndpoint: {reply}"))
    }

    pub async fn unregister(&mut self, channel_id: &str) -> Result<(), String> {
        self.send(json!({"messageType": "unregister", "channelID": channel_id, "code": 200}))
            .await?;
        self.reply("unregister", |m| m["channelID"] == channel_id)
            .await
            .map(drop)
    }

    /// The next notification for `channel_id`.
    pub async fn notification(&mut self, channel_id: &str) -> Result<Value, String> {
        self.next("notification", |m| {
            m["messageType"] == "notification" && m["channelID"] == channel_id
        })
        .await
    }

    pub async fn ack(&mut self, notification: &Value) -> Result<(), String> {
        self.send(json!({
            "messageType": "ack",
            "updates": [{
                "channelID": notification["channelID"],
                "version": notification["version"],
                "code": 100,
            }],
        }))
        .await
    }

    /// Close the websocket and wait (bounded) for the server's close.
    pub async fn close(mut self) {
        let deadline = Instant::now() + self.wait;
        let _ = timeout_at(deadline, self.ws.close(None)).await;
        while let Ok(Some(Ok(_))) = timeout_at(deadline, self.ws.next()).await {}
    }

    async fn send(&mut self, message: Value) -> Result<(), String> {
        timeout(self.wait, self.ws.send(Message::text(message.to_string())))
            .await
            .map_err(|_| "the server did not take a message in time".to_owned())?
            .map_err(|e| format!("sending to the server: {e}"))
    }

    /// The reply of kind `kind` that `matches`, checked for `status: 200`.
    async fn reply(
        &mut self,
        kind: &str,
        matches: impl Fn(&Value) -> bool,
    ) -> Result<Value, String> {
        let reply = self
            .next(&format!("the {kind} reply"), |m| {
                m["messageType"] == kind && matches(m)
            })
            .await?;
        match reply["status"].as_u64() {
            Some(200) => Ok(reply),
            _ => Err(format!("the server refused the {kind}: {reply}")),
        }
    }

    /// The next message that `wanted`, within the wait; others are kept.
    async fn next(&mut self, what: &str, wanted: impl Fn(&Value) -> bool) -> Result<Value, String> {
        if let Some(i) = self.pending.iter().position(&wanted) {
            return Ok(self.pending.remove(i).unwrap_or_default());
        }
        let deadline = Instant::now() + self.wait;
        loop {
            let message = match timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Err(format!("no {what} within {:?}", self.wait)),
                Ok(None) => return Err(format!("the server closed the connection before {what}")),
                Ok(Some(Err(e))) => {
                    return Err(format!("the connection failed before {what}: {e}"));
                }
                Ok(Some(Ok(message))) => message,
            };
            let text = match message {
                Message::Text(text) => text,
                Message::Close(frame) => {
                    let why =
                        frame.map_or_else(String::new, |f| format!(" ({} {})", f.code, f.reason));
                    return Err(format!(
                        "the server closed the connection{why} before {what}"
                    ));
                }
                _ => continue,
            };
            let value: Value = serde_json::from_str(text.as_str())
                .map_err(|e| format!("the server sent a message that is not JSON ({e}): {text}"))?;
            if wanted(&value) {
                return Ok(value);
            }
            self.pending.push_back(value);
        }
    }
}
