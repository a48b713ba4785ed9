//! HTTP/1.1 serving with limits a slow or hostile client cannot get around,
//! used by every port of the service (websocket, internal router API,
//! public endpoint).
//!
//! * A request head must arrive within `header_timeout`, counted from the
//!   connection's start or from the first byte of a later request.
//! * A keep-alive connection may sit idle between requests for `idle_timeout`.
//! * A request body must arrive within `body_timeout` of its head, and a
//!   response the client does not take must be taken within `body_timeout`
//!   of the socket filling up.
//! * At most `max_connections` connections are open on the port; the next
//!   one is answered `503` with `Retry-After` and closed, so a load balancer
//!   tries another node instead of queueing.
//!
//! Over TLS ([`serve_with`]), the handshake is due with the first request
//! head. A connection past a deadline is closed. A connection handed over to a
//! websocket leaves these limits (and the connection count) behind: the
//! session has its own.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use ipnet::IpNet;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep, sleep_until};
use tracing::{debug, warn};

use crate::tls_stream::{TlsAcceptor, TlsStream};

/// The limits of one port.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub body_timeout: Duration,
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            // Longer than the 60 s idle timeout of common load balancers, so
            // the balancer, not this node, closes idle connections.
            idle_timeout: Duration::from_secs(75),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// The address a request came from, in every request's extensions (read it
/// with `warp::ext::get::<Peer>()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub IpAddr);

/// Whether `ip` is in one of `networks`, either spelling of an IPv4
/// address counting as the same: on a dual-stack listener an IPv4 peer
/// connects as `::ffff:10.0.0.1`, and a setting may name either form.
pub fn in_networks(ip: IpAddr, networks: &[IpNet]) -> bool {
    let ip = ip.to_canonical();
    let mapped = match ip {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        v6 => v6,
    };
    networks
        .iter()
        .any(|net| net.contains(&ip) || net.contains(&mapped))
}

/// The client a request speaks for: the peer, unless the peer is in one of
/// the `trusted` proxy networks, in which case the nearest address in
/// `X-Forwarded-For` that is not a trusted proxy (a client can put anything
/// at the start of that header; only what our proxies appended counts).
///
/// Addresses are compared and returned canonical: on a dual-stack listener
/// an IPv4 proxy connects as `::ffff:10.0.0.1`, which must match a proxy
/// configured as `10.0.0.1` (and the other way round).
pub fn client_ip(peer: IpAddr, headers: &http::HeaderMap, trusted: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    let is_trusted = |ip: IpAddr| in_networks(ip, trusted);
    if !is_trusted(peer) {
        return peer;
    }
    let forwarded = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for hop in forwarded.iter().rev() {
        match hop.parse::<IpAddr>().map(|ip| ip.to_canonical()) {
            Ok(ip) if is_trusted(ip) => continue,
            Ok(ip) => return ip,
            // Garbage where a proxy should have written an address: the
            // last trustworthy hop is the proxy itself.
            Err(_) => return peer,
        }
    }
    peer
}

/// Refused connections answered at once; beyond these, new connections over
/// the cap are closed without an answer.
const MAX_REFUSING: usize = 64;

/// How long a refused connection is kept open for the client to read the 503.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Serve `service` (a warp filter made a service with `warp::service`) on
/// `listener`, forever.
pub async fn serve<S, B>(listener: TcpListener, service: S, limits: HttpLimits)
where
    S: tower_service::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(listener, None, service, limits).await
}

/// [`serve`], over TLS when given an acceptor. The TLS handshake counts
/// towards the first request head's deadline (`header_timeout`), so a client
/// that stalls it is closed like one that stalls its head.
pub async fn serve_with<S, B>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    service: S,
    limits: HttpLimits,
) where
    S: tower_service::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok((stream, peer)) => {
                // Small websocket frames and responses go out at once rather
                // than waiting ~40 ms on the client's delayed ack (Nagle).
                let _ = stream.set_nodelay(true);
                (stream, peer)
            }
            Err(e) => {
                accept_failed(e).await;
                continue;
            }
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            debug!(port, "refusing an HTTP connection: the port is full");
            if let Ok(refusal) = refusing.clone().try_acquire_owned() {
                let tls = tls.clone();
                tokio::spawn(async move {
                    match tls {
                        None => refuse(stream).await,
                        Some(tls) => {
                            let shaken = tokio::time::timeout(REFUSAL_LINGER, tls.accept(stream));
                            if let Ok(Ok(stream)) = shaken.await {
                                refuse(stream).await;
                            }
                        }
                    }
                    drop(refusal);
                });
            }
            continue;
        };
        if open.available_permits() == 0 {
            warn!(
                port,
                max_http_connections = limits.max_connections,
                "the port is full: new HTTP connections get 503 until some close"
            );
        }
        let service = service.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let peer = Peer(peer.ip());
            let cycle = Arc::new(Cycle::new(limits));
            match tls {
                None => serve_connection(stream, cycle, service, peer, port).await,
                Some(tls) => {
                    let due = cycle.head_due();
                    match tokio::time::timeout_at(due, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, cycle, service, peer, port).await
                        }
                        // A scanner, a client that refuses the certificate,
                        // or plain HTTP on the TLS port: its own business.
                        Ok(Err(e)) => {
                            debug!(port, peer = %peer.0, error = %e, "TLS handshake failed")
                        }
                        Err(_) => debug!(port, peer = %peer.0, "TLS handshake timed out"),
                    }
                }
            }
            drop(slot);
        });
    }
}

/// Serve one connection's requests until it closes or misses a deadline.
async fn serve_connection<I, S, B>(stream: I, cycle: Arc<Cycle>, service: S, peer: Peer, port: u16)
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: tower_service::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limits = cycle.limits;
    let io = TokioIo::new(Watched::new(stream, cycle.clone()));
    let service = Served {
        service,
        cycle,
        peer,
    };
    let served = http1::Builder::new()
        .timer(TokioTimer::new())
        // hyper's own header timer runs from the end of the previous
        // response, so it bounds idle time and head together; the
        // finer deadlines are the watchdog's (see `Cycle`).
        .header_read_timeout(limits.idle_timeout + limits.header_timeout)
        .serve_connection(io, service)
        .with_upgrades();
    if let Err(e) = served.await {
        debug!(port, error = %e, "HTTP connection ended");
    }
}

/// Back off on accept errors other than a client giving up (e.g. out of
/// file descriptors: only closing connections frees one).
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused
    ) {
        return;
    }
    warn!(error = %e, "cannot accept connections; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Answer a connection over the cap with `503` and close it. What the client
/// sent is read and discarded for a moment first, so the close does not
/// reset the connection before the client reads the answer.
async fn refuse<T: AsyncRead + AsyncWrite + Unpin>(mut stream: T) {
    const BODY: &str = concat!(
        r#"{"code":503,"errno":201,"error":"Service Unavailable","#,
        r#""message":"Too many open connections; retry later","#,
        r#""more_info":"http://autopush.readthedocs.io/en/latest/http.html#error-codes"}"#
    );
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 5\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// Where a connection is in its request cycle: moved on by the service,
/// enforced by the socket ([`Watched`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Reading a request head, due by then.
    Head(Instant),
    /// Between requests, closed at then.
    Idle(Instant),
    /// A request is being served (its body has its own deadline).
    Busy,
    /// Handed over to a websocket.
    Upgraded,
}

struct Cycle {
    phase: Mutex<Phase>,
    limits: HttpLimits,
}

impl Cycle {
    fn new(limits: HttpLimits) -> Self {
        Cycle {
            phase: Mutex::new(Phase::Head(Instant::now() + limits.header_timeout)),
            limits,
        }
    }

    /// When the first request head is due (the connection's start).
    fn head_due(&self) -> Instant {
        match self.phase() {
            Phase::Head(at) => at,
            _ => Instant::now(),
        }
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = phase;
    }

    /// Bytes arrived: an idle connection starts a new request head.
    fn read_some(&self) {
        let mut phase = self.phase.lock().unwrap_or_else(|p| p.into_inner());
        if let Phase::Idle(_) = *phase {
            *phase = Phase::Head(Instant::now() + self.limits.header_timeout);
        }
    }

    /// A response is done with: wait for the next request.
    fn responded(&self) {
        let mut phase = self.phase.lock().unwrap_or_else(|p| p.into_inner());
        if *phase == Phase::Busy {
            *phase = Phase::Idle(Instant::now() + self.limits.idle_timeout);
        }
    }
}

/// A socket that fails its reads and writes once the connection is past a
/// deadline of its [`Cycle`], which makes hyper close it.
struct Watched<T> {
    io: T,
    cycle: Arc<Cycle>,
    /// Since a write found the socket full, due by then; cleared by a flush.
    write_due: Option<Instant>,
    /// Wakes the connection at the earliest deadline; dropped once upgraded
    /// (a websocket keeps this socket for hours).
    timer: Option<(Pin<Box<Sleep>>, Instant)>,
}

/// The socket under a connection [`serve_with`] accepted and hyper then
/// upgraded, with the bytes hyper read past the request; `upgraded` back if
/// it is some other connection. Once upgraded, [`Watched`] only passes
/// calls through, so dropping it changes nothing but the memory it held.
pub(crate) fn unwrap_upgraded(
    upgraded: hyper::upgrade::Upgraded,
) -> Result<crate::upgraded::Parts, hyper::upgrade::Upgraded> {
    use crate::upgraded::{Parts, UpgradedStream};
    let upgraded = match upgraded.downcast::<TokioIo<Watched<TcpStream>>>() {
        Ok(parts) => {
            return Ok(Parts {
                stream: UpgradedStream::Tcp(parts.io.into_inner().io),
                read_ahead: parts.read_buf,
            });
        }
        Err(upgraded) => upgraded,
    };
    let parts = upgraded.downcast::<TokioIo<Watched<TlsStream>>>()?;
    Ok(Parts {
        stream: UpgradedStream::Tls(Box::new(parts.io.into_inner().io)),
        read_ahead: parts.read_buf,
    })
}

impl<T: AsyncRead + AsyncWrite + Unpin> Watched<T> {
    fn new(io: T, cycle: Arc<Cycle>) -> Self {
        Watched {
            io,
            cycle,
            write_due: None,
            timer: None,
        }
    }

    /// With the socket not ready: an error once the earliest deadline has
    /// passed, else pending (with a wake-up set for that deadline).
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let phase_due = match self.cycle.phase() {
            Phase::Head(at) | Phase::Idle(at) => Some(at),
            Phase::Busy => None,
            Phase::Upgraded => {
                self.timer = None;
                return Poll::Pending;
            }
        };
        let Some(due) = phase_due.into_iter().chain(self.write_due).min() else {
            return Poll::Pending;
        };
        let (timer, at) = self
            .timer
            .get_or_insert_with(|| (Box::pin(sleep_until(due)), due));
        if *at != due {
            timer.as_mut().reset(due);
            *at = due;
        }
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client was too slow",
        ))
    }

    fn on_write<R>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if written.is_ready() {
            return written;
        }
        if self.write_due.is_none() && self.cycle.phase() != Phase::Upgraded {
            self.write_due = Some(Instant::now() + self.cycle.limits.body_timeout);
        }
        self.poll_deadline(cx).map(Err)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending => this.poll_deadline(cx).map(Err),
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.cycle.read_some();
                }
                Poll::Ready(Ok(()))
            }
            failed => failed,
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write(cx, data);
        this.on_write(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write_vectored(cx, data);
        this.on_write(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.io).poll_flush(cx);
        if flushed.is_ready() {
            this.write_due = None;
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The service of one connection: moves its [`Cycle`] along and gives each
/// request body its deadline.
struct Served<S> {
    service: S,
    cycle: Arc<Cycle>,
    peer: Peer,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Served<S>
where
    S: tower_service::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Responding<B>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.cycle.set(Phase::Busy);
        let due = Instant::now() + self.cycle.limits.body_timeout;
        let mut request = request.map(|body| TimedBody::new(body, due));
        request.extensions_mut().insert(self.peer);
        let mut service = self.service.clone();
        let cycle = self.cycle.clone();
        Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
            let response = service.call(request).await?;
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                cycle.set(Phase::Upgraded);
            }
            Ok(response.map(|body| Responding { body, cycle }))
        })
    }
}

/// A response body; once hyper is done with it, the connection is idle.
pub struct Responding<B> {
    body: B,
    cycle: Arc<Cycle>,
}

impl<B> Drop for Responding<B> {
    fn drop(&mut self) {
        self.cycle.responded();
    }
}

impl<B: Body + Unpin> Body for Responding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that fails once it is late.
pub struct TimedBody {
    body: Incoming,
    due: Instant,
    /// Made only when the body is not there at once (most have none).
    timer: Option<Pin<Box<Sleep>>>,
}

impl TimedBody {
    fn new(body: Incoming, due: Instant) -> Self {
        TimedBody {
            body,
            due,
            timer: None,
        }
    }
}

/// The error a late request body ends with.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimeout;

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let due = this.due;
        let timer = this.timer.get_or_insert_with(|| Box::pin(sleep_until(due)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Some(Err(BodyTimeout.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod client_ip_tests {
    use super::*;

    fn headers(xff: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert("x-forwarded-for", xff.parse().unwrap());
        h
    }

    #[test]
    fn forwarded_for_counts_only_from_trusted_proxies() {
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let client: IpAddr = "203.0.113.9".parse().unwrap();
        let proxies = [IpNet::from(proxy)];
        let h = headers("198.51.100.1, 203.0.113.9");
        // Not from a proxy: the header is the client's own say.
        assert_eq!(client_ip(client, &h, &proxies), client);
        // From our proxy: the address it appended, not what the client put first.
        assert_eq!(client_ip(proxy, &h, &proxies), client);
        assert_eq!(client_ip(proxy, &headers("garbage"), &proxies), proxy);
        assert_eq!(client_ip(proxy, &http::HeaderMap::new(), &proxies), proxy);
        // A network of proxies (a load balancer's range): every hop inside it
        // is skipped.
        let range = ["10.0.0.0/8".parse::<IpNet>().unwrap()];
        let h = headers("198.51.100.1, 203.0.113.9, 10.1.2.3");
        assert_eq!(client_ip(proxy, &h, &range), client);
    }

    #[test]
    fn ipv4_mapped_addresses_are_the_ipv4_ones() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let h = headers("198.51.100.1, 203.0.113.9, ::ffff:10.0.0.1");
        // A proxy configured as IPv4, seen IPv4-mapped on a dual-stack
        // socket, and each hop compared the same way.
        let trusted = [IpNet::from(ip("10.0.0.1")), IpNet::from(ip("10.0.0.2"))];
        assert_eq!(
            client_ip(ip("::ffff:10.0.0.2"), &h, &trusted),
            ip("203.0.113.9")
        );
        // Configured IPv4-mapped, seen IPv4.
        let h = headers("::ffff:203.0.113.9");
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &[IpNet::from(ip("::ffff:10.0.0.1"))]),
            ip("203.0.113.9")
        );
        // An untrusted peer is its canonical self.
        assert_eq!(client_ip(ip("::ffff:192.0.2.1"), &h, &[]), ip("192.0.2.1"));
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, duplex};

    use super::*;

    #[test]
    fn either_spelling_of_an_ipv4_address_is_in_a_network_of_the_other() {
        let nets = |s: &str| -> Vec<IpNet> { vec![s.parse().unwrap()] };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        for (net, peer) in [
            ("::ffff:10.0.0.5/128", "10.0.0.5"),
            ("::ffff:10.0.0.5/128", "::ffff:10.0.0.5"),
            ("10.0.0.5/32", "::ffff:10.0.0.5"),
            ("::ffff:10.0.0.0/104", "10.0.0.9"),
            ("10.0.0.0/8", "::ffff:10.0.0.9"),
        ] {
            assert!(in_networks(ip(peer), &nets(net)), "{peer} in {net}");
        }
        assert!(!in_networks(ip("10.0.0.6"), &nets("::ffff:10.0.0.5/128")));
        assert!(!in_networks(ip("::1"), &nets("::ffff:0.0.0.1/128")));
    }

    // Short enough for a quick test; no test asserts on how long anything took.
    const LIMITS: HttpLimits = HttpLimits {
        header_timeout: Duration::from_millis(50),
        idle_timeout: Duration::from_millis(50),
        body_timeout: Duration::from_millis(50),
        max_connections: 1,
    };

    /// A socket of this module, the cycle moving it, and the client's end.
    fn socket() -> (
        Watched<tokio::io::DuplexStream>,
        Arc<Cycle>,
        tokio::io::DuplexStream,
    ) {
        let (server, client) = duplex(64);
        let cycle = Arc::new(Cycle::new(LIMITS));
        (Watched::new(server, cycle.clone()), cycle, client)
    }

    fn timed_out<T: std::fmt::Debug>(result: io::Result<T>) -> bool {
        result.is_err_and(|e| e.kind() == io::ErrorKind::TimedOut)
    }

    #[tokio::test]
    async fn a_head_that_never_comes_fails_the_read() {
        let (mut socket, _cycle, mut client) = socket();
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(socket.read(&mut buf).await.is_ok_and(|n| n > 0));
        assert!(timed_out(socket.read(&mut buf).await));
    }

    #[tokio::test]
    async fn an_idle_connection_fails_the_read_and_a_new_request_starts_a_head() {
        let (mut socket, cycle, mut client) = socket();
        cycle.set(Phase::Busy);
        cycle.responded();
        assert!(matches!(cycle.phase(), Phase::Idle(_)));
        client.write_all(b"G").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(socket.read(&mut buf).await.is_ok());
        assert!(matches!(cycle.phase(), Phase::Head(_)));
        assert!(timed_out(socket.read(&mut buf).await));
    }

    #[tokio::test]
    async fn a_response_the_client_does_not_take_fails_the_write() {
        let (mut socket, cycle, _client) = socket();
        cycle.set(Phase::Busy);
        assert!(timed_out(socket.write_all(&[0u8; 1024]).await));
    }

    #[tokio::test]
    async fn a_busy_or_upgraded_connection_reads_without_a_deadline() {
        for phase in [Phase::Busy, Phase::Upgraded] {
            let (mut socket, cycle, _client) = socket();
            cycle.set(phase);
            let mut buf = [0u8; 64];
            // Many deadlines' worth of waiting, and the read is still waiting.
            let read = tokio::time::timeout(Duration::from_millis(500), socket.read(&mut buf));
            assert!(read.await.is_err(), "{phase:?}: the read ended");
        }
    }
}

#[cfg(test)]
mod upgrade_tests {
    use std::sync::Mutex;

    use hyper::upgrade::OnUpgrade;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::oneshot;
    use warp::Filter;
    use warp::reply::Reply;

    use super::*;
    use crate::upgraded::{self, UpgradedStream};

    /// A connection this module served and hyper upgraded comes back as the
    /// TCP socket it was accepted on, without the watchdog around it, and
    /// what the client sent right behind its request is read first.
    #[tokio::test]
    async fn an_upgraded_connection_is_its_socket_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (handed_over, parts) = oneshot::channel();
        let handed_over = Arc::new(Mutex::new(Some(handed_over)));
        let route = warp::ext::optional::<OnUpgrade>().map(move |on_upgrade: Option<OnUpgrade>| {
            let handed_over = handed_over.lock().unwrap().take().unwrap();
            tokio::spawn(async move {
                let upgraded = on_upgrade.unwrap().await.unwrap();
                let _ = handed_over.send(upgraded::unwrap(upgraded));
            });
            let mut response =
                warp::reply::with_status(warp::reply(), StatusCode::SWITCHING_PROTOCOLS)
                    .into_response();
            let headers = response.headers_mut();
            headers.insert("connection", "upgrade".parse().unwrap());
            headers.insert("upgrade", "test".parse().unwrap());
            response
        });
        tokio::spawn(serve(listener, warp::service(route), HttpLimits::default()));

        let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
        client
            .write_all(
                b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: test\r\n\r\nfirst",
            )
            .await
            .unwrap();
        let upgraded::Parts {
            mut stream,
            read_ahead,
        } = parts.await.unwrap();
        assert!(
            matches!(stream, UpgradedStream::Tcp(_)),
            "the connection is still wrapped"
        );
        client.write_all(b" then").await.unwrap();
        client.shutdown().await.unwrap();
        let mut received = read_ahead.to_vec();
        stream.read_to_end(&mut received).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&received), "first then");
    }
}
