//! The server's end of a TLS connection, made for clients that are idle
//! nearly always: between records it holds no buffer at all.
//!
//! rustls's buffered connection (what tokio-rustls drives) keeps a 4 KiB
//! buffer for incoming records for the life of a connection, and queues of
//! plaintext and records beside it: over 4 KiB of every idle websocket
//! client. This drives rustls's unbuffered connection instead, with buffers
//! of its own that are freed as soon as they are empty: bytes are read
//! through a buffer on the stack and kept on the heap only while a record is
//! incomplete, decrypted data only until it is read, and records to send
//! only until the socket took them.
//!
//! What rustls asks to send at any time (handshake messages, a key update's
//! answer, an alert) is queued in order with the application's records and
//! sent before anything the application writes next.
//!
//! Once a TLS 1.3 handshake is done, rustls hands the connection's keys over
//! and [`RecordLayer`] protects its records: an idle connection then keeps a
//! few hundred bytes of TLS state instead of rustls's whole connection.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use rustls::ServerConfig;
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, EncryptError, InsufficientSizeError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::tls_record::{RecordLayer, SecretCapture};

/// Bytes read from the socket at a time, on the stack of the poll.
const READ_CHUNK: usize = 8 * 1024;

/// The most plaintext one write takes, so a large write is not encrypted
/// into one large buffer.
const MAX_WRITE: usize = 64 * 1024;

/// Accepts TLS connections with one configuration.
#[derive(Clone)]
pub struct TlsAcceptor {
    config: Arc<ServerConfig>,
}

impl From<Arc<ServerConfig>> for TlsAcceptor {
    fn from(config: Arc<ServerConfig>) -> Self {
        TlsAcceptor { config }
    }
}

impl TlsAcceptor {
    /// The handshake over `io`; the connection once it is done. A failed
    /// handshake sends rustls's alert, if any, before the error is returned.
    pub fn accept(&self, io: TcpStream) -> impl Future<Output = io::Result<TlsStream>> + use<> {
        let (capture, config) = SecretCapture::config(&self.config);
        async move {
            let conn = UnbufferedServerConnection::new(config).map_err(invalid_data)?;
            let mut stream = TlsStream {
                io,
                session: Session::Rustls(Box::new(conn)),
                received: Vec::new(),
                readable: Vec::new(),
                read_from: 0,
                sending: Vec::new(),
                sent: 0,
                peer_closed: false,
                close_notify_queued: false,
            };
            loop {
                let step = stream.process(Then::Nothing);
                // Handshake messages, or the alert of a failed handshake.
                poll_fn(|cx| stream.poll_send(cx)).await?;
                match step? {
                    Step::Traffic => return stream.established(&capture),
                    Step::Closed => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Step::Handshaking => {
                        if !poll_fn(|cx| stream.poll_receive(cx)).await? {
                            return Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the peer closed the connection during the TLS handshake",
                            ));
                        }
                    }
                }
            }
        }
    }
}

/// A TLS connection after its handshake.
pub struct TlsStream {
    io: TcpStream,
    session: Session,
    /// Bytes received that do not yet make a whole record: empty, and not
    /// allocated, between records.
    received: Vec<u8>,
    /// Decrypted bytes not yet read (from `read_from` on); not allocated
    /// once read.
    readable: Vec<u8>,
    read_from: usize,
    /// Records to send (from `sent` on); not allocated once sent.
    sending: Vec<u8>,
    sent: usize,
    /// The peer sent its close_notify: no more data will come.
    peer_closed: bool,
    /// This end's close_notify is queued.
    close_notify_queued: bool,
}

/// Who protects the connection's records.
enum Session {
    /// rustls: during the handshake, and for good on TLS 1.2.
    Rustls(Box<UnbufferedServerConnection>),
    /// [`RecordLayer`], once a TLS 1.3 handshake is done.
    Records(Box<RecordLayer>),
}

/// What [`TlsStream::process`] does once application data may be sent.
enum Then<'a> {
    Nothing,
    Encrypt(&'a [u8]),
    CloseNotify,
}

/// Where the connection is, once what was received is processed.
enum Step {
    /// The handshake is still going: it needs bytes from the peer.
    Handshaking,
    /// Application data may flow.
    Traffic,
    /// Both ends sent their close_notify.
    Closed,
}

impl TlsStream {
    /// The handshake is done: on TLS 1.3, [`RecordLayer`] takes over with
    /// the secrets `capture` kept.
    fn established(mut self, capture: &SecretCapture) -> io::Result<TlsStream> {
        if let Session::Rustls(conn) = self.session {
            self.session = match RecordLayer::take_over(conn, capture) {
                Ok(records) => Session::Records(Box::new(records?)),
                Err(conn) => Session::Rustls(conn),
            };
        }
        Ok(self)
    }

    /// Process every whole record received, queue what the peer is owed,
    /// and then do `then`.
    fn process(&mut self, then: Then<'_>) -> io::Result<Step> {
        let Session::Records(records) = &mut self.session else {
            return self.process_rustls(then);
        };
        let opened = records.open(&mut self.received, &mut self.readable, &mut self.sending)?;
        self.peer_closed |= opened.peer_closed;
        match then {
            Then::Nothing => {}
            Then::Encrypt(_) if self.close_notify_queued => return Ok(Step::Closed),
            Then::Encrypt(data) => records.encrypt(data, &mut self.sending)?,
            Then::CloseNotify => records.close_notify(&mut self.sending)?,
        }
        Ok(Step::Traffic)
    }

    /// [`TlsStream::process`] while rustls protects the records.
    fn process_rustls(&mut self, then: Then<'_>) -> io::Result<Step> {
        loop {
            let Session::Rustls(conn) = &mut self.session else {
                return Err(io::Error::other("TLS: the records are not rustls's"));
            };
            let status = conn.process_tls_records(&mut self.received);
            let mut discard = status.discard;
            let state = match status.state {
                Ok(state) => state,
                Err(e) => {
                    self.queue_alert();
                    return Err(invalid_data(e));
                }
            };
            let step = match state {
                ConnectionState::ReadTraffic(mut traffic) => {
                    while let Some(record) = traffic.next_record() {
                        let record = record.map_err(invalid_data)?;
                        discard += record.discard;
                        self.readable.extend_from_slice(record.payload);
                    }
                    None
                }
                ConnectionState::ReadEarlyData(mut early) => {
                    while let Some(record) = early.next_record() {
                        let record = record.map_err(invalid_data)?;
                        discard += record.discard;
                        self.readable.extend_from_slice(record.payload);
                    }
                    None
                }
                ConnectionState::EncodeTlsData(mut encode) => {
                    append(&mut self.sending, 0, |buf| match encode.encode(buf) {
                        Err(EncodeError::InsufficientSize(need)) => Err(Some(need)),
                        other => other.map_err(|e| {
                            tracing::debug!(error = %e, "TLS record not encoded");
                            None
                        }),
                    })?;
                    None
                }
                // What was encoded is in `sending`, in order: it goes before
                // anything queued after it.
                ConnectionState::TransmitTlsData(transmit) => {
                    transmit.done();
                    None
                }
                ConnectionState::WriteTraffic(mut traffic) => {
                    match then {
                        Then::Nothing => {}
                        Then::Encrypt(data) => {
                            // Headers, tags and padding of a record per 16 KiB.
                            let room = data.len() + (data.len() / 16_384 + 1) * 64;
                            append(&mut self.sending, room, |buf| {
                                match traffic.encrypt(data, buf) {
                                    Err(EncryptError::InsufficientSize(need)) => Err(Some(need)),
                                    other => other.map_err(|e| {
                                        tracing::debug!(error = %e, "TLS record not encrypted");
                                        None
                                    }),
                                }
                            })?;
                        }
                        Then::CloseNotify => {
                            append(&mut self.sending, 64, |buf| {
                                match traffic.queue_close_notify(buf) {
                                    Err(EncryptError::InsufficientSize(need)) => Err(Some(need)),
                                    other => other.map_err(|_| None),
                                }
                            })?;
                        }
                    }
                    Some(Step::Traffic)
                }
                ConnectionState::BlockedHandshake => Some(Step::Handshaking),
                ConnectionState::PeerClosed => {
                    self.peer_closed = true;
                    None
                }
                ConnectionState::Closed => {
                    self.peer_closed = true;
                    Some(Step::Closed)
                }
                _ => return Err(io::Error::other("an unknown TLS connection state")),
            };
            self.received.drain(..discard);
            if self.received.is_empty() {
                // Give the buffer back: an idle connection keeps none.
                self.received = Vec::new();
            }
            if let Some(step) = step {
                return Ok(step);
            }
        }
    }

    /// After an error, queue the alert rustls has for the peer, if any.
    fn queue_alert(&mut self) {
        let Session::Rustls(conn) = &mut self.session else {
            return;
        };
        for _ in 0..4 {
            let status = conn.process_tls_records(&mut []);
            match status.state {
                Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                    let _ = append(&mut self.sending, 0, |buf| match encode.encode(buf) {
                        Err(EncodeError::InsufficientSize(need)) => Err(Some(need)),
                        other => other.map_err(|_| None),
                    });
                }
                Ok(ConnectionState::TransmitTlsData(transmit)) => transmit.done(),
                _ => return,
            }
        }
    }

    /// Write what is queued to the socket; ready once all of it is written.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.sending.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.sending[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.sending = Vec::new();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }

    /// Read what the socket has into `received`; false at its end.
    fn poll_receive(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        // A local of this call: nothing is kept across a wait.
        let mut chunk = [0u8; READ_CHUNK];
        let mut buf = ReadBuf::new(&mut chunk);
        ready!(Pin::new(&mut self.io).poll_read(cx, &mut buf))?;
        self.received.extend_from_slice(buf.filled());
        Poll::Ready(Ok(!buf.filled().is_empty()))
    }

    /// Move decrypted bytes to `buf`; whether there were any.
    fn take_readable(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        let available = &self.readable[self.read_from..];
        if available.is_empty() {
            return false;
        }
        let n = available.len().min(buf.remaining());
        buf.put_slice(&available[..n]);
        self.read_from += n;
        if self.read_from == self.readable.len() {
            self.readable = Vec::new();
            self.read_from = 0;
        }
        true
    }
}

/// Append what `write` puts into a buffer of `room` bytes (or of the size
/// it says it needs) to `sending`.
fn append(
    sending: &mut Vec<u8>,
    room: usize,
    mut write: impl FnMut(&mut [u8]) -> Result<usize, Option<InsufficientSizeError>>,
) -> io::Result<()> {
    let start = sending.len();
    let mut room = room;
    loop {
        sending.resize(start + room, 0);
        match write(&mut sending[start..]) {
            Ok(written) => {
                sending.truncate(start + written);
                return Ok(());
            }
            Err(Some(need)) if need.required_size > room => room = need.required_size,
            Err(_) => {
                sending.truncate(start);
                return Err(io::Error::other("TLS: a record could not be written"));
            }
        }
    }
}

fn invalid_data(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.take_readable(buf) || this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if let Err(e) = this.process(Then::Nothing) {
                // Send the alert if the socket takes it now.
                let _ = this.poll_send(cx);
                return Poll::Ready(Err(e));
            }
            if !this.readable.is_empty() || this.peer_closed {
                continue;
            }
            // Whatever rustls answered (a key update) goes out as the
            // socket takes it; reading does not wait for it.
            if let Poll::Ready(Err(e)) = this.poll_send(cx) {
                return Poll::Ready(Err(e));
            }
            if !ready!(this.poll_receive(cx))? {
                // The socket ended without a close_notify: the data may
                // have been cut short.
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection without sending a TLS close_notify",
                )));
            }
        }
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // What was queued before goes first: a peer that does not read
        // holds back the writer, not memory.
        ready!(this.poll_send(cx))?;
        let data = &data[..data.len().min(MAX_WRITE)];
        match this.process(Then::Encrypt(data))? {
            Step::Traffic => {}
            Step::Handshaking | Step::Closed => {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
        }
        // Start sending at once; what the socket does not take now goes
        // with the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_send(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_notify_queued {
            this.close_notify_queued = true;
            // Errors here only mean the peer is gone already.
            let _ = this.process(Then::CloseNotify);
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::tls::{Certificates, TlsFiles};

    use crate::test_support::{cert_file, client_config};

    /// A key worn out every few records is updated, and the client reads
    /// on across every update.
    #[tokio::test]
    async fn the_server_updates_a_worn_out_key_and_the_client_reads_on() {
        let certs = Certificates::load(&TlsFiles {
            cert: cert_file("tls-127.0.0.1.pem"),
            key: cert_file("tls-127.0.0.1-key.pem"),
        })
        .expect("the test certificate");
        let acceptor = certs.acceptor(&[b"http/1.1"]);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.expect("accept");
            let mut stream = acceptor.accept(tcp).await.expect("a handshake");
            let Session::Records(records) = &mut stream.session else {
                panic!("a TLS 1.3 connection is not protected by RecordLayer");
            };
            records.wear_out_after(3);
            for i in 0..10u8 {
                stream.write_all(&[i; 100]).await.expect("a write");
                stream.flush().await.expect("a flush");
            }
            let Session::Records(records) = &stream.session else {
                unreachable!();
            };
            assert!(
                records.sealed_under_this_key() <= 3,
                "{} records sealed under one key: it was never updated",
                records.sealed_under_this_key()
            );
            let mut back = [0u8; 4];
            stream
                .read_exact(&mut back)
                .await
                .expect("the client's answer");
            assert_eq!(&back, b"done");
        });

        let tcp = TcpStream::connect(addr).await.expect("connect");
        let mut client = tokio_rustls::TlsConnector::from(client_config(rustls::DEFAULT_VERSIONS))
            .connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await
            .expect("a handshake");
        let mut got = vec![0u8; 1000];
        client.read_exact(&mut got).await.expect("every record");
        let expected: Vec<u8> = (0..10u8).flat_map(|i| [i; 100]).collect();
        assert!(
            got == expected,
            "the records read differ from those written"
        );
        client.write_all(b"done").await.expect("the answer");
        client.flush().await.expect("a flush");
        server.await.expect("the server");
    }
}
