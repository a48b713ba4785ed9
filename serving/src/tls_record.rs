//! The record layer of an established TLS 1.3 connection, in about 250
//! bytes: what the connection keeps once its handshake is over.
//!
//! rustls keeps its whole connection state for the life of a connection,
//! about 2 KB of heap on top of what the service needs, and even its
//! kernel-TLS connection (the key schedule and room for QUIC's secrets) is
//! 0.8 KB, while all an established connection does is protect records
//! (RFC 8446, section 5) and, now and then, update a key (4.6.3). rustls
//! derives the handshake and its traffic secrets; [`SecretCapture`] keeps
//! the two application traffic secrets it logs, and [`RecordLayer`] checks
//! them against the keys rustls hands over, then keeps only them: it seals
//! and opens the records with ring's AEADs and derives each next secret
//! with ring's HKDF (RFC 8446, 7.1 to 7.3).
//!
//! Only TLS 1.3 is handled here; a TLS 1.2 connection stays with rustls.
//! Post-handshake messages other than `KeyUpdate` are refused: the server
//! asks for no client certificate.

use std::io;
use std::sync::{Arc, Mutex};

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use rustls::server::UnbufferedServerConnection;
use rustls::{ConnectionTrafficSecrets, KeyLog};
use zeroize::Zeroize;

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

/// The longest traffic secret (SHA-384's), key (AES-256's and ChaCha20's)
/// and IV of TLS 1.3's suites.
const MAX_SECRET: usize = 48;
const MAX_KEY: usize = 32;
const IV: usize = aead::NONCE_LEN;

/// Key updates of one direction rustls may have made before the records
/// are taken over (a peer's `KeyUpdate` in the flight of its `Finished`).
const MAX_EARLY_UPDATES: usize = 4;

/// The key log of one handshake: keeps the client's and the server's first
/// application traffic secrets (no other secret is passed to it), for
/// [`RecordLayer::take_over`]. rustls logs every secret it derives to a
/// config's `key_log`, so each handshake gets a config of its own with one.
#[derive(Default)]
pub(crate) struct SecretCapture(Mutex<Captured>);

/// Never shows the secrets.
impl std::fmt::Debug for SecretCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretCapture")
    }
}

#[derive(Default)]
struct Captured {
    client: Option<Secret>,
    server: Option<Secret>,
}

const CLIENT_TRAFFIC_SECRET_0: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_TRAFFIC_SECRET_0: &str = "SERVER_TRAFFIC_SECRET_0";

impl KeyLog for SecretCapture {
    fn will_log(&self, label: &str) -> bool {
        label == CLIENT_TRAFFIC_SECRET_0 || label == SERVER_TRAFFIC_SECRET_0
    }

    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        let Some(secret) = Secret::new(secret) else {
            return;
        };
        let mut captured = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match label {
            CLIENT_TRAFFIC_SECRET_0 => captured.client = Some(secret),
            SERVER_TRAFFIC_SECRET_0 => captured.server = Some(secret),
            _ => {}
        }
    }
}

impl SecretCapture {
    /// A capture for one handshake under `config`.
    pub(crate) fn config(
        config: &rustls::ServerConfig,
    ) -> (Arc<SecretCapture>, Arc<rustls::ServerConfig>) {
        let capture = Arc::new(SecretCapture::default());
        let mut config = config.clone();
        config.key_log = capture.clone();
        (capture, Arc::new(config))
    }

    fn take(&self) -> Captured {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A traffic secret, wiped when dropped.
struct Secret {
    bytes: [u8; MAX_SECRET],
    len: u8,
}

impl Secret {
    fn new(secret: &[u8]) -> Option<Secret> {
        let mut bytes = [0u8; MAX_SECRET];
        bytes.get_mut(..secret.len())?.copy_from_slice(secret);
        Some(Secret {
            bytes,
            len: u8::try_from(secret.len()).ok()?,
        })
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

/// The hash and AEAD of the connection's suite.
#[derive(Clone, Copy)]
struct Suite {
    hkdf: hkdf::Algorithm,
    aead: &'static aead::Algorithm,
}

impl Suite {
    /// The suite's hash and AEAD, if ring's are those of a TLS 1.3 suite
    /// handled here (all of rustls's on ring are).
    fn of(suite: &rustls::Tls13CipherSuite) -> Option<Suite> {
        use rustls::CipherSuite::*;
        let (hkdf, aead) = match suite.common.suite {
            TLS13_AES_128_GCM_SHA256 => (hkdf::HKDF_SHA256, &aead::AES_128_GCM),
            TLS13_AES_256_GCM_SHA384 => (hkdf::HKDF_SHA384, &aead::AES_256_GCM),
            TLS13_CHACHA20_POLY1305_SHA256 => (hkdf::HKDF_SHA256, &aead::CHACHA20_POLY1305),
            _ => return None,
        };
        Some(Suite { hkdf, aead })
    }

    /// HKDF-Expand-Label(secret, label, "", out.len()) (RFC 8446, 7.1).
    fn expand_label(&self, secret: &Secret, label: &[u8], out: &mut [u8]) -> io::Result<()> {
        struct Len(usize);
        impl hkdf::KeyType for Len {
            fn len(&self) -> usize {
                self.0
            }
        }
        let length = u16::try_from(out.len())
            .map_err(|_| io::Error::other("TLS: a key too long"))?
            .to_be_bytes();
        let label_len =
            [u8::try_from(6 + label.len())
                .map_err(|_| io::Error::other("TLS: a label too long"))?];
        let info = [&length[..], &label_len, b"tls13 ", label, &[0]];
        hkdf::Prk::new_less_safe(self.hkdf, secret.as_bytes())
            .expand(&info, Len(out.len()))
            .and_then(|okm| okm.fill(out))
            .map_err(|_| io::Error::other("TLS: a key that cannot be derived"))
    }

    /// The secret after `secret` (RFC 8446, 7.2).
    fn next_secret(&self, secret: &Secret) -> io::Result<Secret> {
        let mut next = Secret {
            bytes: [0u8; MAX_SECRET],
            len: secret.len,
        };
        let len = usize::from(next.len);
        self.expand_label(secret, b"traffic upd", &mut next.bytes[..len])?;
        Ok(next)
    }
}

/// One direction's traffic secret, the key and IV derived from it, and the
/// sequence number of its next record.
struct Keys {
    secret: Secret,
    key: [u8; MAX_KEY],
    iv: [u8; IV],
    seq: u64,
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.key.zeroize();
        self.iv.zeroize();
    }
}

impl Keys {
    /// The key and IV of `secret` (RFC 8446, 7.3), from record `seq` on.
    fn new(suite: Suite, secret: Secret, seq: u64) -> io::Result<Keys> {
        let mut keys = Keys {
            secret,
            key: [0u8; MAX_KEY],
            iv: [0u8; IV],
            seq,
        };
        let key_len = suite.aead.key_len();
        suite.expand_label(&keys.secret, b"key", &mut keys.key[..key_len])?;
        suite.expand_label(&keys.secret, b"iv", &mut keys.iv)?;
        Ok(keys)
    }

    /// The keys of `secret`, or of one of the few secrets after it, that
    /// rustls handed over as `(seq, keys)`.
    fn matching(
        suite: Suite,
        secret: Secret,
        (seq, rustls): (u64, ConnectionTrafficSecrets),
    ) -> io::Result<Keys> {
        let mut keys = Keys::new(suite, secret, seq)?;
        for _ in 0..=MAX_EARLY_UPDATES {
            if keys.are(suite, &rustls) {
                keys.seq = seq;
                return Ok(keys);
            }
            keys = keys.update(suite)?;
        }
        Err(io::Error::other(
            "TLS: the captured secrets are not those of the connection's keys",
        ))
    }

    /// The keys of the next secret, from record 0.
    fn update(&self, suite: Suite) -> io::Result<Keys> {
        Keys::new(suite, suite.next_secret(&self.secret)?, 0)
    }

    /// Whether these are the key and IV rustls handed over.
    fn are(&self, suite: Suite, rustls: &ConnectionTrafficSecrets) -> bool {
        let (key, iv) = match rustls {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv }
            | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
            | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (key, iv),
            _ => return false,
        };
        self.key[..suite.aead.key_len()] == *key.as_ref() && self.iv == *iv.as_ref()
    }

    /// The key and the nonce of the next record (RFC 8446, 5.3: the IV
    /// XORed with the sequence number), counting it. The key is expanded
    /// per record rather than kept: an idle connection holds the 16 or 32
    /// bytes of its key, not ring's key schedule.
    fn next(&mut self, suite: Suite) -> io::Result<(LessSafeKey, Nonce)> {
        let key = UnboundKey::new(suite.aead, &self.key[..suite.aead.key_len()])
            .map_err(|_| io::Error::other("TLS: a traffic key of the wrong length"))?;
        let mut nonce = self.iv;
        for (byte, seq) in nonce[IV - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
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
    suite: Suite,
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
    /// queued is left to send, with the secrets `capture` kept from its
    /// handshake. A connection not on TLS 1.3, or on a suite not handled
    /// here, is handed back. The keys rustls hands over must be those of
    /// the captured secrets (or of a secret after them, if the peer
    /// already updated its key), else the connection fails.
    pub(crate) fn take_over(
        conn: Box<UnbufferedServerConnection>,
        capture: &SecretCapture,
    ) -> Result<io::Result<RecordLayer>, Box<UnbufferedServerConnection>> {
        if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
            return Err(conn);
        }
        let Some((suite, tx_limit)) = conn
            .negotiated_cipher_suite()
            .and_then(|suite| suite.tls13())
            .and_then(|suite| Some((Suite::of(suite)?, suite.common.confidentiality_limit)))
        else {
            return Err(conn);
        };
        let Captured { client, server } = capture.take();
        let (Some(client), Some(server)) = (client, server) else {
            return Ok(Err(io::Error::other(
                "TLS: the traffic secrets were not captured",
            )));
        };
        Ok((|| {
            // rustls's kernel connection is dropped: key updates are
            // derived here.
            let (secrets, _) = (*conn)
                .dangerous_into_kernel_connection()
                .map_err(|e| io::Error::other(format!("TLS: {e}")))?;
            Ok(RecordLayer {
                suite,
                tx: Keys::matching(suite, server, secrets.tx)?,
                rx: Keys::matching(suite, client, secrets.rx)?,
                tx_limit,
            })
        })())
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
            let (key, nonce) = self.rx.next(self.suite)?;
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
        self.rx = self.rx.update(self.suite)?;
        if update_requested {
            self.update_tx(sending)?;
        }
        Ok(Ok(()))
    }

    /// Send a `KeyUpdate` (not asking the peer for one) under the current
    /// key, and seal what follows under the next.
    fn update_tx(&mut self, sending: &mut Vec<u8>) -> io::Result<()> {
        self.seal(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0], sending)?;
        self.tx = self.tx.update(self.suite)?;
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
        let (key, nonce) = self.tx.next(self.suite)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn suite() -> Suite {
        Suite {
            hkdf: hkdf::HKDF_SHA384,
            aead: &aead::AES_256_GCM,
        }
    }

    /// rustls's view of `keys`.
    fn handed_over(keys: &Keys) -> ConnectionTrafficSecrets {
        ConnectionTrafficSecrets::Aes256Gcm {
            key: rustls::crypto::cipher::AeadKey::from(keys.key),
            iv: rustls::crypto::cipher::Iv::new(keys.iv),
        }
    }

    fn secret(byte: u8) -> Secret {
        Secret::new(&[byte; 48]).expect("a secret")
    }

    #[test]
    fn the_keys_rustls_hands_over_must_be_those_of_the_captured_secret() {
        let captured = Keys::new(suite(), secret(1), 0).expect("keys");
        let same = Keys::matching(suite(), secret(1), (3, handed_over(&captured)))
            .expect("the captured secret's keys");
        assert_eq!(
            (same.key, same.iv, same.seq),
            (captured.key, captured.iv, 3)
        );

        // The peer updated its key before the records were taken over.
        let updated = captured.update(suite()).expect("an update");
        let later = Keys::matching(suite(), secret(1), (2, handed_over(&updated)))
            .expect("the keys of the next secret");
        assert_eq!((later.key, later.seq), (updated.key, 2));
        assert_eq!(later.secret.as_bytes(), updated.secret.as_bytes());

        assert!(
            Keys::matching(suite(), secret(2), (0, handed_over(&captured))).is_err(),
            "keys of another secret were taken"
        );
    }
}
