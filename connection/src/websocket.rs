//! The server's end of a websocket (RFC 6455), made for clients that are
//! idle nearly always: between frames it holds no buffer at all.
//!
//! Bytes are read through a buffer on the stack and kept on the heap only
//! while a frame (or a fragmented message) is incomplete; each frame sent is
//! written at once from a buffer freed when it is written. tungstenite keeps
//! its read and write buffers at their largest for the life of a connection,
//! and tokio-tungstenite adds the shared state and wakers of its two halves:
//! over a kilobyte for every idle client.
//!
//! No extensions are negotiated, so any reserved bit is an error; frames
//! from the client must be masked; a message's size is capped as it arrives.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

/// Bytes read from the socket at a time, on the stack of the poll: a hello,
/// a register or an ack fits in one read.
const READ_CHUNK: usize = 4096;

/// The longest payload a control frame (close, ping, pong) may have.
const MAX_CONTROL_PAYLOAD: usize = 125;

const CONTINUATION: u8 = 0x0;
const TEXT: u8 = 0x1;
const BINARY: u8 = 0x2;
const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;

/// Why a websocket cannot go on.
#[derive(Debug)]
pub enum Error {
    Io(io::Error),
    /// The peer broke RFC 6455.
    Protocol(&'static str),
    /// A message over the size limit.
    TooLarge {
        size: u64,
        max: usize,
    },
    /// A message this end does not send (a raw frame).
    Unsendable,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "websocket I/O: {e}"),
            Error::Protocol(what) => write!(f, "websocket protocol error: {what}"),
            Error::TooLarge { size, max } => {
                write!(f, "a websocket message of {size} bytes is over {max}")
            }
            Error::Unsendable => f.write_str("raw frames are not sent"),
        }
    }
}

impl std::error::Error for Error {}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

/// The server's end of an open websocket over `S`.
pub struct WebSocket<S> {
    io: S,
    /// Bytes received that do not yet make a whole frame; empty, and not
    /// allocated, between frames.
    received: Vec<u8>,
    /// The data frames so far of a fragmented message; `None` (and nothing
    /// allocated) between messages.
    fragmented: Option<Box<Fragmented>>,
    max_message_size: usize,
}

/// A message that came in several frames, as far as it has come.
struct Fragmented {
    text: bool,
    payload: Vec<u8>,
}

/// A frame's header, parsed.
struct Header {
    fin: bool,
    opcode: u8,
    mask: [u8; 4],
    /// Bytes of header before the payload.
    len: usize,
    payload_len: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin> WebSocket<S> {
    /// A websocket over `io`, after the handshake, refusing messages over
    /// `max_message_size` bytes.
    pub fn new(io: S, max_message_size: usize) -> Self {
        WebSocket {
            io,
            received: Vec::new(),
            fragmented: None,
            max_message_size,
        }
    }

    /// This websocket, with `bytes` received before anything on its socket
    /// (what the HTTP server read past the upgrade request).
    pub fn read_ahead(mut self, bytes: &[u8]) -> Self {
        self.received.extend_from_slice(bytes);
        self
    }

    /// The next message from the client: text, binary, ping, pong or close
    /// (pings are not answered here: send the pong). `None` once the
    /// connection has ended. Cancel-safe: what was read stays here.
    pub fn receive(&mut self) -> impl Future<Output = Option<Result<Message, Error>>> + '_ {
        std::future::poll_fn(|cx| self.poll_next(cx))
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message, Error>>> {
        loop {
            match self.take_message() {
                Ok(Some(message)) => return Poll::Ready(Some(Ok(message))),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
            // A local of this call, not of the future: nothing is kept
            // across a wait but what was read.
            let mut chunk = [0u8; READ_CHUNK];
            let mut buf = ReadBuf::new(&mut chunk);
            match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(None),
                Poll::Ready(Ok(())) => self.received.extend_from_slice(buf.filled()),
            }
        }
    }

    /// The next whole message in what was received, if there is one yet.
    fn take_message(&mut self) -> Result<Option<Message>, Error> {
        loop {
            let Some(header) = parse_header(&self.received)? else {
                return Ok(None);
            };
            self.check(&header)?;
            let Some(end) = usize::try_from(header.payload_len)
                .ok()
                .and_then(|n| n.checked_add(header.len))
                .filter(|&end| end <= self.received.len())
            else {
                return Ok(None);
            };
            let mut payload = self.received[header.len..end].to_vec();
            self.received.drain(..end);
            if self.received.is_empty() {
                // Give the buffer back: an idle connection keeps none.
                self.received = Vec::new();
            }
            unmask(&mut payload, header.mask);
            if let Some(message) = self.on_frame(&header, payload)? {
                return Ok(Some(message));
            }
        }
    }

    /// Refuse a frame as soon as its header shows it breaks the protocol or
    /// the size limit, before its payload is waited for.
    fn check(&self, header: &Header) -> Result<(), Error> {
        match header.opcode {
            CLOSE | PING | PONG => {
                if !header.fin {
                    return Err(Error::Protocol("a fragmented control frame"));
                }
                if header.payload_len > MAX_CONTROL_PAYLOAD as u64 {
                    return Err(Error::Protocol("a control frame over 125 bytes"));
                }
            }
            CONTINUATION if self.fragmented.is_none() => {
                return Err(Error::Protocol(
                    "a continuation frame with nothing to continue",
                ));
            }
            TEXT | BINARY if self.fragmented.is_some() => {
                return Err(Error::Protocol("a new message inside a fragmented one"));
            }
            CONTINUATION | TEXT | BINARY => {}
            _ => return Err(Error::Protocol("an unknown opcode")),
        }
        let so_far = self.fragmented.as_ref().map_or(0, |m| m.payload.len()) as u64;
        let size = so_far.saturating_add(header.payload_len);
        if size > self.max_message_size as u64 {
            return Err(Error::TooLarge {
                size,
                max: self.max_message_size,
            });
        }
        Ok(())
    }

    /// A whole frame, checked: the message it ends, if any.
    fn on_frame(&mut self, header: &Header, payload: Vec<u8>) -> Result<Option<Message>, Error> {
        let (text, payload) = match header.opcode {
            PING => return Ok(Some(Message::Ping(payload.into()))),
            PONG => return Ok(Some(Message::Pong(payload.into()))),
            CLOSE => return close_message(payload).map(Some),
            TEXT | BINARY if header.fin => (header.opcode == TEXT, payload),
            TEXT | BINARY => {
                self.fragmented = Some(Box::new(Fragmented {
                    text: header.opcode == TEXT,
                    payload,
                }));
                return Ok(None);
            }
            _ => {
                let Some(message) = self.fragmented.as_mut() else {
                    return Err(Error::Protocol(
                        "a continuation frame with nothing to continue",
                    ));
                };
                message.payload.extend_from_slice(&payload);
                if !header.fin {
                    return Ok(None);
                }
                let Some(message) = self.fragmented.take() else {
                    return Ok(None);
                };
                (message.text, message.payload)
            }
        };
        if text {
            let text = String::from_utf8(payload)
                .map_err(|_| Error::Protocol("a text message that is not UTF-8"))?;
            Ok(Some(Message::text(text)))
        } else {
            Ok(Some(Message::Binary(payload.into())))
        }
    }

    /// Send `message` as one frame and flush it.
    pub async fn send(&mut self, message: Message) -> Result<(), Error> {
        let frame = encode(message)?;
        self.io.write_all(&frame).await?;
        self.io.flush().await?;
        Ok(())
    }

    /// Flush and shut down the sending side (after a close frame).
    pub async fn close(&mut self) -> Result<(), Error> {
        self.io.shutdown().await?;
        Ok(())
    }

    /// The bytes of heap this end holds for frames and messages not yet
    /// whole: none while the client is idle.
    #[cfg(test)]
    fn buffered_capacity(&self) -> usize {
        self.received.capacity() + self.fragmented.as_ref().map_or(0, |m| m.payload.capacity())
    }
}

/// The header at the start of `bytes`, `None` if it has not all come.
fn parse_header(bytes: &[u8]) -> Result<Option<Header>, Error> {
    let [first, second, ..] = *bytes else {
        return Ok(None);
    };
    if first & 0x70 != 0 {
        return Err(Error::Protocol("reserved bits set without an extension"));
    }
    if second & 0x80 == 0 {
        // RFC 6455 5.1: a server closes on an unmasked frame.
        return Err(Error::Protocol("an unmasked frame from the client"));
    }
    let (payload_len, mut len) = match second & 0x7F {
        126 => match bytes.get(2..4) {
            Some(n) => (u64::from(u16::from_be_bytes([n[0], n[1]])), 4),
            None => return Ok(None),
        },
        127 => match bytes.get(2..10).and_then(|n| <[u8; 8]>::try_from(n).ok()) {
            Some(n) => (u64::from_be_bytes(n), 10),
            None => return Ok(None),
        },
        n => (u64::from(n), 2),
    };
    let Some(mask) = bytes
        .get(len..len + 4)
        .and_then(|m| <[u8; 4]>::try_from(m).ok())
    else {
        return Ok(None);
    };
    len += 4;
    Ok(Some(Header {
        fin: first & 0x80 != 0,
        opcode: first & 0x0F,
        mask,
        len,
        payload_len,
    }))
}

fn unmask(payload: &mut [u8], mask: [u8; 4]) {
    for (i, byte) in payload.iter_mut().enumerate() {
        *byte ^= mask[i % 4];
    }
}

/// A close frame's payload: nothing, or a code and a UTF-8 reason.
fn close_message(payload: Vec<u8>) -> Result<Message, Error> {
    let Some((code, reason)) = payload.split_first_chunk::<2>() else {
        return if payload.is_empty() {
            Ok(Message::Close(None))
        } else {
            Err(Error::Protocol("a close frame of one byte"))
        };
    };
    let reason = String::from_utf8(reason.to_vec())
        .map_err(|_| Error::Protocol("a close reason that is not UTF-8"))?;
    Ok(Message::Close(Some(CloseFrame {
        code: u16::from_be_bytes(*code).into(),
        reason: reason.into(),
    })))
}

/// `message` as an unmasked frame, as a server sends it.
fn encode(message: Message) -> Result<Vec<u8>, Error> {
    let (opcode, payload): (u8, Bytes) = match message {
        Message::Text(text) => (TEXT, text.into()),
        Message::Binary(data) => (BINARY, data),
        Message::Ping(data) => (PING, data),
        Message::Pong(data) => (PONG, data),
        Message::Close(None) => (CLOSE, Bytes::new()),
        Message::Close(Some(CloseFrame { code, reason })) => {
            let mut payload = u16::from(code).to_be_bytes().to_vec();
            payload.extend_from_slice(reason.as_bytes());
            (CLOSE, payload.into())
        }
        Message::Frame(_) => return Err(Error::Unsendable),
    };
    let mut frame = Vec::with_capacity(payload.len() + 10);
    frame.push(0x80 | opcode);
    match payload.len() {
        n @ 0..=125 => frame.push(n as u8),
        n if n <= usize::from(u16::MAX) => {
            frame.push(126);
            frame.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            frame.push(127);
            frame.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(&payload);
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use futures_util::{FutureExt, SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

    use super::*;

    const MAX: usize = 1024;

    /// Our end, and tungstenite's client end, of one websocket.
    async fn pair() -> (WebSocket<DuplexStream>, WebSocketStream<DuplexStream>) {
        let (ours, theirs) = duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(theirs, Role::Client, None).await;
        (WebSocket::new(ours, MAX), client)
    }

    /// Our end, and a raw socket to write hand-made frames into.
    fn raw_pair() -> (WebSocket<DuplexStream>, DuplexStream) {
        let (ours, theirs) = duplex(256 * 1024);
        (WebSocket::new(ours, MAX), theirs)
    }

    /// A masked client frame (the mask is not zero, so unmasking matters).
    fn client_frame(first: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [0x12, 0x34, 0x56, 0x78];
        let mut frame = vec![first];
        match payload.len() {
            n @ 0..=125 => frame.push(0x80 | n as u8),
            n if n <= 0xFFFF => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        frame
    }

    async fn next_ok(ws: &mut WebSocket<DuplexStream>) -> Message {
        ws.receive()
            .await
            .expect("a message")
            .expect("a valid message")
    }

    async fn next_err(ws: &mut WebSocket<DuplexStream>) -> String {
        match ws.receive().await {
            Some(Err(e)) => e.to_string(),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    /// What the HTTP server read past the upgrade request comes first: a
    /// whole frame, and the start of one the socket finishes.
    #[tokio::test]
    async fn frames_read_ahead_come_before_the_socket() {
        let (ours, mut theirs) = duplex(1024);
        let first = client_frame(0x81, b"first");
        let second = client_frame(0x81, b"second");
        let mut read_ahead = first.clone();
        read_ahead.extend_from_slice(&second[..3]);
        let mut ours = WebSocket::new(ours, MAX).read_ahead(&read_ahead);
        theirs.write_all(&second[3..]).await.unwrap();
        assert_eq!(next_ok(&mut ours).await, Message::text("first"));
        assert_eq!(next_ok(&mut ours).await, Message::text("second"));
    }

    #[tokio::test]
    async fn messages_go_both_ways_with_a_real_client() {
        let (mut ours, mut client) = pair().await;
        client
            .send(Message::text(r#"{"messageType":"hello"}"#))
            .await
            .unwrap();
        client
            .send(Message::Ping(Bytes::from_static(b"hi")))
            .await
            .unwrap();
        client.send(Message::binary(vec![1, 2, 3])).await.unwrap();
        assert_eq!(
            next_ok(&mut ours).await,
            Message::text(r#"{"messageType":"hello"}"#)
        );
        assert_eq!(
            next_ok(&mut ours).await,
            Message::Ping(Bytes::from_static(b"hi"))
        );
        assert_eq!(next_ok(&mut ours).await, Message::binary(vec![1, 2, 3]));

        let long = "é".repeat(300);
        ours.send(Message::text(long.clone())).await.unwrap();
        ours.send(Message::text("short")).await.unwrap();
        ours.send(Message::Ping(Bytes::new())).await.unwrap();
        assert_eq!(client.next().await.unwrap().unwrap(), Message::text(long));
        assert_eq!(
            client.next().await.unwrap().unwrap(),
            Message::text("short")
        );
        assert_eq!(
            client.next().await.unwrap().unwrap(),
            Message::Ping(Bytes::new())
        );

        ours.send(Message::Close(Some(CloseFrame {
            code: CloseCode::from(4000),
            reason: "bye".into(),
        })))
        .await
        .unwrap();
        ours.close().await.unwrap();
        match client.next().await.unwrap().unwrap() {
            Message::Close(Some(frame)) => {
                assert_eq!(u16::from(frame.code), 4000);
                assert_eq!(frame.reason, "bye");
            }
            other => panic!("expected a close frame, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_client_closing_ends_the_stream() {
        let (mut ours, mut client) = pair().await;
        client.close(None).await.unwrap();
        assert!(matches!(next_ok(&mut ours).await, Message::Close(_)));
        drop(client);
        assert!(ours.receive().await.is_none());
    }

    #[tokio::test]
    async fn an_idle_connection_holds_no_buffer() {
        let (mut ours, mut raw) = raw_pair();
        let hello = client_frame(0x81, br#"{"messageType":"hello","uaid":""}"#);
        // Half a frame: kept until the rest comes.
        raw.write_all(&hello[..10]).await.unwrap();
        assert!(
            ours.receive().now_or_never().is_none(),
            "half a frame must not make a message"
        );
        assert!(ours.buffered_capacity() > 0);
        raw.write_all(&hello[10..]).await.unwrap();
        assert_eq!(
            next_ok(&mut ours).await,
            Message::text(r#"{"messageType":"hello","uaid":""}"#)
        );
        assert_eq!(
            ours.buffered_capacity(),
            0,
            "a whole message leaves no buffer"
        );

        // A fragmented text message, a ping between its frames.
        let mut frames = client_frame(0x01, "ab".as_bytes());
        frames.extend(client_frame(0x89, b"p"));
        frames.extend(client_frame(0x00, "cé".as_bytes()));
        frames.extend(client_frame(0x80, b"d"));
        raw.write_all(&frames).await.unwrap();
        assert_eq!(
            next_ok(&mut ours).await,
            Message::Ping(Bytes::from_static(b"p"))
        );
        assert!(ours.buffered_capacity() > 0, "the message is not whole yet");
        assert_eq!(next_ok(&mut ours).await, Message::text("abcéd"));
        assert_eq!(ours.buffered_capacity(), 0);
    }

    #[tokio::test]
    async fn frames_of_every_length_encoding_are_read() {
        let (mut ours, mut raw) = raw_pair();
        for len in [0, 125, 126, 1000] {
            let text = "x".repeat(len);
            raw.write_all(&client_frame(0x81, text.as_bytes()))
                .await
                .unwrap();
            assert_eq!(next_ok(&mut ours).await, Message::text(text));
        }
    }

    #[tokio::test]
    async fn frames_that_break_the_protocol_are_refused() {
        let cases: [(&str, Vec<u8>); 9] = [
            ("unmasked", vec![0x81, 0x01, b'a']),
            ("reserved bits", client_frame(0xC1, b"a")),
            ("unknown opcode", client_frame(0x83, b"a")),
            ("continuation of nothing", client_frame(0x80, b"a")),
            ("fragmented ping", client_frame(0x09, b"a")),
            ("long ping", client_frame(0x89, &[0; 126])),
            ("not UTF-8", client_frame(0x81, &[0xFF, 0xFE])),
            ("one-byte close", client_frame(0x88, &[3])),
            ("new message inside one", {
                let mut f = client_frame(0x01, b"a");
                f.extend(client_frame(0x81, b"b"));
                f
            }),
        ];
        for (what, bytes) in cases {
            let (mut ours, mut raw) = raw_pair();
            raw.write_all(&bytes).await.unwrap();
            let error = next_err(&mut ours).await;
            assert!(error.contains("protocol"), "{what}: {error}");
        }
    }

    #[tokio::test]
    async fn a_message_over_the_limit_is_refused_from_its_header() {
        let (mut ours, mut raw) = raw_pair();
        // Only the header: the payload is never waited for.
        let frame = client_frame(0x82, &[0; MAX + 1]);
        raw.write_all(&frame[..8]).await.unwrap();
        assert!(next_err(&mut ours).await.contains("over 1024"));

        let (mut ours, mut raw) = raw_pair();
        let mut frames = client_frame(0x01, &[b'a'; MAX]);
        frames.extend(client_frame(0x80, b"a"));
        raw.write_all(&frames).await.unwrap();
        assert!(next_err(&mut ours).await.contains("over 1024"));
    }

    #[tokio::test]
    async fn a_close_frame_carries_its_code_and_reason() {
        let (mut ours, mut raw) = raw_pair();
        let mut payload = 1001u16.to_be_bytes().to_vec();
        payload.extend_from_slice(b"going");
        raw.write_all(&client_frame(0x88, &payload)).await.unwrap();
        match next_ok(&mut ours).await {
            Message::Close(Some(frame)) => {
                assert_eq!(u16::from(frame.code), 1001);
                assert_eq!(frame.reason, "going");
            }
            other => panic!("expected a close frame, got {other:?}"),
        }
        drop(raw);
        assert!(ours.receive().await.is_none());
    }

    #[tokio::test]
    async fn frames_sent_are_unmasked_with_the_right_length() {
        let (mut ours, mut raw) = raw_pair();
        for len in [0usize, 125, 126, 70_000] {
            ours.send(Message::binary(vec![7; len])).await.unwrap();
            let mut head = [0u8; 2];
            raw.read_exact(&mut head).await.unwrap();
            assert_eq!(head[0], 0x82);
            assert_eq!(head[1] & 0x80, 0, "a server's frames are not masked");
            let got = match head[1] {
                126 => u64::from(raw.read_u16().await.unwrap()),
                127 => raw.read_u64().await.unwrap(),
                n => u64::from(n),
            };
            assert_eq!(got, len as u64);
            let mut payload = vec![0; len];
            raw.read_exact(&mut payload).await.unwrap();
            assert!(payload.iter().all(|&b| b == 7));
        }
    }
}
