//! An application server as the load generator plays it: a VAPID key pair,
//! a signed token reused for every push (as real senders do), aes128gcm-shaped
//! bodies, and bare HTTP/1.1 keep-alive connections to the endpoint.

use autopush_crypto::vapid::VapidKey;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::client::{BenchError, within};

/// Size of a push body: a typical encrypted Web Push message.
pub const BODY_BYTES: usize = 2048;

pub struct AppServer {
    key: VapidKey,
    authorization: String,
}

impl AppServer {
    /// A sender whose tokens name `audience` (the endpoint's origin). The key
    /// is fixed so that runs are comparable.
    pub fn new(audience: &str) -> AppServer {
        let key = match VapidKey::from_bytes(&[0x42; 32]) {
            Ok(key) => key,
            Err(error) => panic!("fixed benchmark key rejected: {error}"),
        };
        let authorization = key.authorization(audience, "mailto:bench@example.com");
        AppServer { key, authorization }
    }

    /// The `Authorization` header of every push: RFC 8292 `vapid t=..., k=...`
    /// with 12 hours of validity.
    pub fn authorization(&self) -> &str {
        &self.authorization
    }

    /// The public key a client registers with (`key` in `register`), which
    /// binds its endpoint to this sender.
    pub fn public_key(&self) -> String {
        autopush_crypto::b64(self.key.public_key())
    }
}

/// Bodies laid out as aes128gcm (RFC 8188) with random "ciphertext". The
/// service never decrypts, so real encryption would only cost the generator
/// CPU; the salt, random in real messages, carries a stamp the receiving
/// client reads back to measure latency.
pub struct Bodies {
    template: Bytes,
}

impl Bodies {
    pub fn new(sender_public_key: &[u8]) -> Bodies {
        // RFC 8188 header: salt (16) | record size (4) | key id length (1) | key id.
        let mut template = BytesMut::with_capacity(BODY_BYTES);
        template.put_slice(&[0; 16]);
        template.put_u32(4096);
        template.put_u8(sender_public_key.len() as u8);
        template.put_slice(sender_public_key);
        while template.len() < BODY_BYTES {
            template.put_slice(uuid::Uuid::new_v4().as_bytes());
        }
        template.truncate(BODY_BYTES);
        Bodies {
            template: template.freeze(),
        }
    }

    /// A body whose salt carries `stamp` (e.g. nanoseconds since the run began).
    pub fn stamped(&self, stamp: u64) -> Bytes {
        let mut body = BytesMut::from(&self.template[..]);
        body[..8].copy_from_slice(&stamp.to_be_bytes());
        body.freeze()
    }
}

/// The stamp of a delivered body (the websocket `data`, base64url).
pub fn read_stamp(data: &str) -> Option<u64> {
    // 12 characters decode to 9 bytes: the 8-byte stamp and one more.
    let head = URL_SAFE_NO_PAD.decode(data.get(..12)?).ok()?;
    Some(u64::from_be_bytes(head.get(..8)?.try_into().ok()?))
}

/// One keep-alive HTTP/1.1 connection to the endpoint.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    authority: String,
}

impl Connection {
    /// Connect to the origin of `url` (`http://host:port/...`, or
    /// `https://` trusting the run's CA).
    pub async fn open(url: &str) -> Result<Connection, BenchError> {
        let (tls, rest) = match url.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, url.trim_start_matches("http://")),
        };
        let authority = rest.split('/').next().unwrap_or_default().to_owned();
        let stream = within("the TCP connect", TcpStream::connect(&authority)).await?;
        stream.set_nodelay(true)?;
        let stream = crate::client::secure(stream, tls).await?;
        let (sender, connection) = within(
            "the HTTP handshake",
            hyper::client::conn::http1::handshake(TokioIo::new(stream)),
        )
        .await?;
        tokio::spawn(connection);
        Ok(Connection { sender, authority })
    }

    /// POST a JSON body to `path` (e.g. a `/v1` registration); returns the
    /// status and the response body.
    pub async fn post_json(
        &mut self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, Bytes), BenchError> {
        let request = hyper::Request::post(path)
            .header("host", &self.authority)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status().as_u16();
        Ok((status, response.into_body().collect().await?.to_bytes()))
    }

    /// POST one push to `endpoint`; returns the status.
    pub async fn push(
        &mut self,
        endpoint: &str,
        authorization: &str,
        body: Bytes,
    ) -> Result<u16, BenchError> {
        // The path alone: the connection may go through a proxy, whose
        // authority is not the endpoint's.
        let after_scheme = endpoint
            .trim_start_matches("http://")
            .trim_start_matches("https://");
        let path = &after_scheme[after_scheme.find('/').unwrap_or(after_scheme.len())..];
        let request = hyper::Request::post(path)
            .header("host", &self.authority)
            .header("ttl", "3600")
            .header("content-encoding", "aes128gcm")
            .header("content-type", "application/octet-stream")
            .header("authorization", authorization)
            .body(Full::new(body))?;
        within("a push", async {
            self.sender.ready().await?;
            let response = self.sender.send_request(request).await?;
            let status = response.status().as_u16();
            // Read the (short) body so the connection can carry the next request.
            response.into_body().collect().await?;
            Ok::<_, BenchError>(status)
        })
        .await
    }
}
