//! The record layer of an established TLS 1.3 connection, in a few hundred
//! bytes: what the connection keeps once its handshake is over.
//!
//! rustls keeps its whole connection state for the life of a connection,
//! about 2 KB of heap on top of what the service needs, while all an
//! established connection does is protect records (RFC 8446, section 5).
//! Once the handshake is done, rustls hands over the traffic keys and a
//! small [`KernelConnection`] (its API for kernel TLS), and the records are
//! sealed and opened here with ring's AEADs. rustls still derives every
//! key: a key update asks it for the next ones.
//!
//! Only TLS 1.3 is handled here; a TLS 1.2 connection stays with rustls.
//! Post-handshake messages other than `KeyUpdate` are refused: the server
//! asks for no client certificate.

use std::io;

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};

const HEADER: usize = 5;
const TAG: usize = 16;
/// The most plaintext one record holds.
const MAX_PLAINTEXT: usize = 1 << 14;
/// The most a protected record's body may hold: plaintext, content type,
/// padding and tag.
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;

// Content types (RFC 8446, B.1).
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;

// Handshake message type and alert descriptions used here.
const KEY_UPDATE: u8 = 24;
const CLOSE_NOTIFY: u8 = 0;
const UNEXPECTED_MESSAGE: u8 = 10;
const BAD_RECORD_MAC: u8 = 20;
const RECORD_OVERFLOW: u8 = 22;
const ILLEGAL_PARAMETER: u8 = 47;
const DECODE_ERROR: u8 = 50;
const USER_CANCELED: u8 = 90;

/// One direction's traffic keys and the sequence number of its next record.
struct Keys {
    secrets: ConnectionTrafficSecrets,
    seq: u64,
}

impl Keys {
    fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> Keys {
        Keys { secrets, seq }
    }

    /// Whether ring seals with this suite (all of rustls's TLS 1.3 suites on
    /// ring do).
    fn supported(&self) -> bool {
        self.algorithm().is_some()
    }

    fn algorithm(&self) -> Option<(&'static aead::Algorithm, &[u8], &[u8])> {
        match &self.secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => {
                Some((&aead::AES_128_GCM, key.as_ref(), iv.as_ref()))
            }
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
                Some((&aead::AES_256_GCM, key.as_ref(), iv.as_ref()))
            }
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                Some((&aead::CHACHA20_POLY1305, key.as_ref(), iv.as_ref()))
            }
            _ => None,
        }
    }

    /// The key and the nonce of the next record (RFC 8446, 5.3: the IV
    /// XORed with the sequence number), counting it. The key is expanded
    /// per record rather than kept: an idle connection holds the 16 or 32
    /// bytes of its secret, not ring's key schedule.
    fn next(&mut self) -> io::Result<(LessSafeKey, Nonce)> {
        let (algorithm, key, iv) = self
            .algorithm()
            .ok_or_else(|| io::Error::other("TLS: a cipher suite ring does not seal with"))?;
        let key = UnboundKey::new(algorithm, key)
            .map_err(|_| io::Error::other("TLS: a traffic key of the wrong length"))?;
        let mut nonce = [0u8; aead::NONCE_LEN];
        nonce.copy_from_slice(iv);
        for (byte, seq) in nonce[aead::NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.seq.to_be_bytes())
        {
            *byte ^= seq;
        }
        // A sequence number never wraps: the connection ends first.
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or_else(|| io::Error::other("TLS: the record sequence is spent"))?;
        Ok((LessSafeKey::new(key), Nonce::assume_unique_for_key(nonce)))
    }
}

/// An established TLS 1.3 connection's record protection.
pub(crate) struct RecordLayer {
    kernel: KernelConnection<ServerConnectionData>,
    tx: Keys,
    rx: Keys,
    /// Records sealed under one key before this end updates it (the
    /// suite's confidentiality limit, as rustls counts it).
    tx_limit: u64,
}

/// What [`RecordLayer::open`] found.
pub(crate) struct Opened {
    /// The peer sent its close_notify: nothing more will come.
    pub peer_closed: bool,
}

impl RecordLayer {
    /// Take over from rustls once the handshake is done and nothing it
    /// queued is left to send. A connection not on TLS 1.3, or on a suite
    /// not handled here, is handed back.
    pub(crate) fn take_over(
        conn: Box<UnbufferedServerConnection>,
    ) -> Result<io::Result<RecordLayer>, Box<UnbufferedServerConnection>> {
        if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
            return Err(conn);
        }
        let Some(tx_limit) = conn
            .negotiated_cipher_suite()
            .and_then(|suite| suite.tls13())
            .map(|suite| suite.common.confidentiality_limit)
        else {
            return Err(conn);
        };
        Ok(match (*conn).dangerous_into_kernel_connection() {
            Ok((secrets, kernel)) => {
                let (tx, rx) = (Keys::new(secrets.tx), Keys::new(secrets.rx));
                if tx.supported() && rx.supported() {
                    Ok(RecordLayer {
                        kernel,
                        tx,
                        rx,
                        tx_limit,
                    })
                } else {
                    Err(io::Error::other(
                        "TLS: a cipher suite ring does not seal with",
                    ))
                }
            }
            Err(e) => Err(io::Error::other(format!("TLS: {e}"))),
        })
    }

    /// Open every whole record at the start of `received` (which keeps what
    /// is left of an incomplete one), appending application data to
    /// `readable` and queueing what the peer asks for (the answer to a key
    /// update) in `sending`. A record that fails queues a fatal alert and
    /// ends the connection with an error.
    pub(crate) fn open(
        &mut self,
        received: &mut Vec<u8>,
        readable: &mut Vec<u8>,
        sending: &mut Vec<u8>,
    ) -> io::Result<Opened> {
        let mut at = 0;
        let mut peer_closed = false;
        let result = loop {
            if peer_closed {
                break Ok(());
            }
            let rest = &mut received[at..];
            if rest.len() < HEADER {
                break Ok(());
            }
            let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
            if rest[0] != APPLICATION_DATA {
                break Err((UNEXPECTED_MESSAGE, "a record not protected"));
            }
            if len > MAX_CIPHERTEXT {
                break Err((RECORD_OVERFLOW, "a record longer than TLS allows"));
            }
            if rest.len() < HEADER + len {
                break Ok(());
            }
            let (header, body) = rest[..HEADER + len].split_at_mut(HEADER);
            let header: [u8; HEADER] = [header[0], header[1], header[2], header[3], header[4]];
            at += HEADER + len;
            let (key, nonce) = self.rx.next()?;
            let Ok(plain) = key.open_in_place(nonce, Aad::from(header), body) else {
                break Err((BAD_RECORD_MAC, "a record that does not decrypt"));
            };
            // The content type is the last byte that is not padding.
            let Some(end) = plain.iter().rposition(|byte| *byte != 0) else {
                break Err((UNEXPECTED_MESSAGE, "a record without a content type"));
            };
            let (content, content_type) = (&plain[..end], plain[end]);
            if content.len() > MAX_PLAINTEXT {
                break Err((RECORD_OVERFLOW, "a record longer than TLS allows"));
            }
            match content_type {
                APPLICATION_DATA => readable.extend_from_slice(content),
                ALERT => match content {
                    [_, CLOSE_NOTIFY] => peer_closed = true,
                    [_, USER_CANCELED] => {}
                    [_, description] => {
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            format!("TLS: the peer sent alert {description}"),
                        ));
                    }
                    _ => break Err((DECODE_ERROR, "a malformed alert")),
                },
                HANDSHAKE => {
                    if let Err(refused) = self.handshake(content, sending)? {
                        break Err(refused);
                    }
                }
                _ => break Err((UNEXPECTED_MESSAGE, "a record of an unknown type")),
            }
        };
        received.drain(..at);
        if received.is_empty() {
            // An idle connection keeps no buffer.
            *received = Vec::new();
        }
        match result {
            Ok(()) => Ok(Opened { peer_closed }),
            Err((alert, why)) => {
                self.seal(ALERT, &[2, alert], sending)?;
                Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("TLS: the peer sent {why}"),
                ))
            }
        }
    }

    /// A handshake message after the handshake: only `KeyUpdate` (RFC 8446,
    /// 4.6.3), whole and alone in its record (no message may span a key
    /// change). An update the peer asks for is answered with this end's
    /// own, sealed under the old key.
    fn handshake(
        &mut self,
        message: &[u8],
        sending: &mut Vec<u8>,
    ) -> io::Result<Result<(), (u8, &'static str)>> {
        let update_requested = match message {
            [KEY_UPDATE, 0, 0, 1, 0] => false,
            [KEY_UPDATE, 0, 0, 1, 1] => true,
            [KEY_UPDATE, 0, 0, 1, _] => {
                return Ok(Err((ILLEGAL_PARAMETER, "a KeyUpdate of an unknown kind")));
            }
            [KEY_UPDATE, ..] => {
                return Ok(Err((DECODE_ERROR, "a KeyUpdate not alone in its record")));
            }
            _ => {
                return Ok(Err((
                    UNEXPECTED_MESSAGE,
                    "a handshake message after the handshake",
                )));
            }
        };
        self.rx = Keys::new(self.kernel.update_rx_secret().map_err(io::Error::other)?);
        if update_requested {
            self.update_tx(sending)?;
        }
        Ok(Ok(()))
    }

    /// Send a `KeyUpdate` (not asking the peer for one) under the current
    /// key, and seal what follows under the next.
    fn update_tx(&mut self, sending: &mut Vec<u8>) -> io::Result<()> {
        self.seal(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0], sending)?;
        self.tx = Keys::new(self.kernel.update_tx_secret().map_err(io::Error::other)?);
        Ok(())
    }

    /// Update this end's key after every `records` records from now on, as
    /// at the suite's limit.
    #[cfg(test)]
    pub(crate) fn wear_out_after(&mut self, records: u64) {
        self.tx_limit = records;
    }

    /// Records sealed under this end's current key.
    #[cfg(test)]
    pub(crate) fn sealed_under_this_key(&self) -> u64 {
        self.tx.seq
    }

    /// Seal `data` into application data records appended to `sending`.
    pub(crate) fn encrypt(&mut self, data: &[u8], sending: &mut Vec<u8>) -> io::Result<()> {
        sending.reserve(data.len() + (data.len() / MAX_PLAINTEXT + 1) * (HEADER + 1 + TAG));
        for chunk in data.chunks(MAX_PLAINTEXT) {
            self.seal(APPLICATION_DATA, chunk, sending)?;
        }
        Ok(())
    }

    /// Queue this end's close_notify.
    pub(crate) fn close_notify(&mut self, sending: &mut Vec<u8>) -> io::Result<()> {
        self.seal(ALERT, &[1, CLOSE_NOTIFY], sending)
    }

    /// Append one record of `content_type` holding `content` (at most
    /// [`MAX_PLAINTEXT`] bytes), without padding; past the key's limit,
    /// update it.
    fn seal(&mut self, content_type: u8, content: &[u8], sending: &mut Vec<u8>) -> io::Result<()> {
        let len = content.len() + 1 + TAG;
        let [hi, lo] = u16::try_from(len)
            .map_err(|_| io::Error::other("TLS: a record too long"))?
            .to_be_bytes();
        let header = [APPLICATION_DATA, 3, 3, hi, lo];
        sending.extend_from_slice(&header);
        let start = sending.len();
        sending.extend_from_slice(content);
        sending.push(content_type);
        let (key, nonce) = self.tx.next()?;
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::from(header), &mut sending[start..])
            .map_err(|_| io::Error::other("TLS: a record could not be sealed"))?;
        sending.extend_from_slice(tag.as_ref());
        if self.tx.seq >= self.tx_limit && content_type != HANDSHAKE {
            self.update_tx(sending)?;
        }
        Ok(())
    }
}
