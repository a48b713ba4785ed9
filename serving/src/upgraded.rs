//! A connection hyper handed over after an upgrade, back as the socket it
//! was accepted on.
//!
//! hyper's [`Upgraded`] keeps the connection boxed as it served it: inside
//! the request watchdog of [`crate::http`], whose state (the connection's
//! limits and phase) stays alive with it, beside a slot for bytes read
//! ahead. A websocket holds its connection for hours and none of that does
//! anything once upgraded: about 0.2 KiB of every idle client.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::tls_stream::TlsStream;

/// The socket under an upgraded connection.
pub enum UpgradedStream {
    Tcp(TcpStream),
    /// Boxed: rustls's state is kilobytes, and most nodes sit behind a
    /// balancer that ends TLS.
    Tls(Box<TlsStream>),
    /// A connection not accepted by [`crate::http::serve_with`], left as
    /// hyper gave it (boxed, so it does not make the others larger).
    Other(Box<TokioIo<Upgraded>>),
}

/// What [`unwrap`] gives back: the socket, and what hyper had read past the
/// request (a client may send its first frame without waiting for the
/// `101`), to be read before anything on the socket.
pub struct Parts {
    pub stream: UpgradedStream,
    pub read_ahead: Bytes,
}

/// The socket under `upgraded`.
pub fn unwrap(upgraded: Upgraded) -> Parts {
    crate::http::unwrap_upgraded(upgraded).unwrap_or_else(|upgraded| Parts {
        stream: UpgradedStream::Other(Box::new(TokioIo::new(upgraded))),
        read_ahead: Bytes::new(),
    })
}

/// Calls `$method` on whichever stream this is.
macro_rules! on_stream {
    ($self:expr, $stream:ident => $call:expr) => {
        match $self.get_mut() {
            UpgradedStream::Tcp($stream) => {
                let $stream = Pin::new($stream);
                $call
            }
            UpgradedStream::Tls($stream) => {
                let $stream = Pin::new($stream.as_mut());
                $call
            }
            UpgradedStream::Other($stream) => {
                let $stream = Pin::new($stream.as_mut());
                $call
            }
        }
    };
}

impl AsyncRead for UpgradedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        on_stream!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for UpgradedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        on_stream!(self, s => s.poll_write(cx, data))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        on_stream!(self, s => s.poll_write_vectored(cx, data))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpgradedStream::Tcp(s) => s.is_write_vectored(),
            UpgradedStream::Tls(s) => s.is_write_vectored(),
            UpgradedStream::Other(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_stream!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_stream!(self, s => s.poll_shutdown(cx))
    }
}
