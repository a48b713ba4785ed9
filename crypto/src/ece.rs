//! Web Push message encryption, both ways.
//!
//! * `aes128gcm` (RFC 8291 over RFC 8188): the salt, record size and the
//!   sender's public key travel in a header at the start of the body.
//! * `aesgcm` (draft-ietf-webpush-encryption-04): the salt travels in an
//!   `Encryption` header and the sender's key in `Crypto-Key: dh=`. Older,
//!   but many application servers still send it.
//!
//! Both derive a content key and nonce with HKDF-SHA256 from an ECDH secret
//! between the sender's one-time key and the subscription's `p256dh` key,
//! mixed with the subscription's `auth` secret, then seal records with
//! AES-128-GCM. Encryption writes one record for `aes128gcm` (RFC 8291 §4
//! asks for that) and 4096-byte records for `aesgcm`; decryption reads any
//! record size, since senders such as pywebpush split long messages.

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes128Gcm, Nonce};
use hkdf::Hkdf;
use p256::elliptic_curve::sec1::ToEncodedPoint;
use p256::{PublicKey, SecretKey};
use rand_core::{OsRng, RngCore};
use serde_json::Value;
use sha2::Sha256;

use crate::{b64, unb64};

const TAG_BYTES: usize = 16;
const SALT_BYTES: usize = 16;
const AUTH_BYTES: usize = 16;
/// An uncompressed P-256 point: `0x04 || x || y`.
const POINT_BYTES: usize = 65;
/// The record size senders use unless a message needs more.
pub const RECORD_SIZE: u32 = 4096;

/// A message's `Content-Encoding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Aes128Gcm,
    AesGcm,
}

impl Encoding {
    pub const ALL: [Encoding; 2] = [Encoding::Aes128Gcm, Encoding::AesGcm];

    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Aes128Gcm => "aes128gcm",
            Encoding::AesGcm => "aesgcm",
        }
    }

    pub fn parse(value: &str) -> Option<Encoding> {
        match value.trim().to_ascii_lowercase().as_str() {
            "aes128gcm" => Some(Encoding::Aes128Gcm),
            "aesgcm" => Some(Encoding::AesGcm),
            _ => None,
        }
    }
}

/// Why a message could not be encrypted or decrypted.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EceError {
    #[error("{0} is not valid base64url")]
    Base64(&'static str),
    #[error("{0} is not an uncompressed P-256 public key")]
    PublicKey(&'static str),
    #[error("the private key is not a P-256 scalar")]
    PrivateKey,
    #[error("the auth secret must be 16 bytes, got {0}")]
    AuthSecret(usize),
    #[error("the salt must be 16 bytes, got {0}")]
    Salt(usize),
    #[error("the body ({0} bytes) is too short for an aes128gcm header")]
    ShortHeader(usize),
    #[error("record size {0} is too small")]
    RecordSize(u64),
    #[error("the message is too long to encrypt")]
    TooLong,
    #[error("unknown content encoding {0:?}")]
    UnknownEncoding(String),
    #[error("missing {0}")]
    Missing(&'static str),
    #[error("record {0} does not decrypt: other keys, or the message was altered")]
    Decrypt(usize),
    #[error("record {0} has invalid padding")]
    Padding(usize),
    #[error("the message is truncated")]
    Truncated,
}

/// An encrypted message as it travels: the body and, for `aesgcm`, the
/// values of the two headers that carry its salt and the sender's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encrypted {
    pub encoding: Encoding,
    pub body: Vec<u8>,
    /// `aesgcm`: the `Encryption` header (`salt=...`, maybe `rs=...`).
    pub encryption: Option<String>,
    /// `aesgcm`: the `Crypto-Key` header (`dh=...`).
    pub crypto_key: Option<String>,
}

impl Encrypted {
    /// The HTTP headers a sender sends with the body.
    pub fn http_headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![("content-encoding", self.encoding.as_str().to_owned())];
        if let Some(value) = &self.encryption {
            headers.push(("encryption", value.clone()));
        }
        if let Some(value) = &self.crypto_key {
            headers.push(("crypto-key", value.clone()));
        }
        headers
    }

    /// A websocket `notification` message as the push service delivers it:
    /// `data` (base64url body) and `headers` (`encoding`, `encryption`,
    /// `crypto_key`).
    pub fn from_notification(notification: &Value) -> Result<Encrypted, EceError> {
        let data = notification["data"]
            .as_str()
            .ok_or(EceError::Missing("data in the notification"))?;
        let headers = &notification["headers"];
        let encoding = headers["encoding"]
            .as_str()
            .ok_or(EceError::Missing("headers.encoding in the notification"))?;
        Ok(Encrypted {
            encoding: Encoding::parse(encoding)
                .ok_or_else(|| EceError::UnknownEncoding(encoding.to_owned()))?,
            body: unb64(data).map_err(|_| EceError::Base64("data"))?,
            encryption: headers["encryption"].as_str().map(str::to_owned),
            crypto_key: headers["crypto_key"].as_str().map(str::to_owned),
        })
    }
}

/// A user agent's subscription keys, as `PushManager.subscribe()` makes them:
/// a P-256 key pair (the public half is `p256dh`) and a 16-byte `auth` secret.
#[derive(Clone)]
pub struct SubscriptionKeys {
    private: SecretKey,
    p256dh: Vec<u8>,
    auth: [u8; AUTH_BYTES],
}

impl std::fmt::Debug for SubscriptionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriptionKeys")
            .field("p256dh", &b64(&self.p256dh))
            .finish_non_exhaustive()
    }
}

impl SubscriptionKeys {
    /// New random keys.
    pub fn generate() -> SubscriptionKeys {
        let mut auth = [0; AUTH_BYTES];
        OsRng.fill_bytes(&mut auth);
        SubscriptionKeys::new(SecretKey::random(&mut OsRng), auth)
    }

    /// Keys from a raw 32-byte private scalar and the auth secret.
    pub fn from_bytes(private: &[u8], auth: &[u8]) -> Result<SubscriptionKeys, EceError> {
        let private = SecretKey::from_slice(private).map_err(|_| EceError::PrivateKey)?;
        Ok(SubscriptionKeys::new(private, auth_secret(auth)?))
    }

    fn new(private: SecretKey, auth: [u8; AUTH_BYTES]) -> SubscriptionKeys {
        let p256dh = private
            .public_key()
            .to_encoded_point(false)
            .as_bytes()
            .to_vec();
        SubscriptionKeys {
            private,
            p256dh,
            auth,
        }
    }

    /// The public key senders encrypt to (65 bytes, uncompressed).
    pub fn p256dh(&self) -> &[u8] {
        &self.p256dh
    }

    pub fn auth(&self) -> &[u8; AUTH_BYTES] {
        &self.auth
    }

    /// The raw private scalar (to hand the keys to another implementation).
    pub fn private_bytes(&self) -> Vec<u8> {
        self.private.to_bytes().to_vec()
    }

    /// Decrypt a message sent to these keys.
    pub fn decrypt(&self, message: &Encrypted) -> Result<Vec<u8>, EceError> {
        match message.encoding {
            Encoding::Aes128Gcm => {
                let header = Aes128GcmHeader::parse(&message.body)?;
                let sender = public_key(header.keyid, "the aes128gcm keyid")?;
                let ikm = webpush_ikm(
                    &shared_secret(&self.private, &sender),
                    &self.auth,
                    &self.p256dh,
                    header.keyid,
                );
                open_aes128gcm(&ikm, &header)
            }
            Encoding::AesGcm => {
                let encryption = message
                    .encryption
                    .as_deref()
                    .ok_or(EceError::Missing("the Encryption header"))?;
                let salt = param(encryption, "salt")
                    .ok_or(EceError::Missing("salt= in the Encryption header"))?;
                let salt = unb64(salt).map_err(|_| EceError::Base64("the salt"))?;
                let rs = match param(encryption, "rs") {
                    None => u64::from(RECORD_SIZE),
                    Some(rs) => rs.parse().map_err(|_| EceError::RecordSize(0))?,
                };
                let dh = message
                    .crypto_key
                    .as_deref()
                    .and_then(|value| param(value, "dh"))
                    .ok_or(EceError::Missing("dh= in the Crypto-Key header"))?;
                let dh = unb64(dh).map_err(|_| EceError::Base64("the dh key"))?;
                let sender = public_key(&dh, "the dh key")?;
                let (key, nonce) = aesgcm_key_nonce(
                    &shared_secret(&self.private, &sender),
                    &self.auth,
                    &salt_bytes(&salt)?,
                    &self.p256dh,
                    &dh,
                );
                open_aesgcm(&key, &nonce, rs, &message.body)
            }
        }
    }
}

/// Encrypt `plaintext` for the subscription with public key `p256dh` and
/// secret `auth`, with a new one-time key and salt, as an application
/// server does.
pub fn encrypt(
    p256dh: &[u8],
    auth: &[u8],
    plaintext: &[u8],
    encoding: Encoding,
) -> Result<Encrypted, EceError> {
    let mut salt = [0; SALT_BYTES];
    OsRng.fill_bytes(&mut salt);
    encrypt_with(
        &SecretKey::random(&mut OsRng),
        salt,
        p256dh,
        auth,
        plaintext,
        encoding,
    )
}

/// [`encrypt`] with a given one-time key and salt (for test vectors).
fn encrypt_with(
    sender: &SecretKey,
    salt: [u8; SALT_BYTES],
    p256dh: &[u8],
    auth: &[u8],
    plaintext: &[u8],
    encoding: Encoding,
) -> Result<Encrypted, EceError> {
    let receiver = public_key(p256dh, "p256dh")?;
    let auth = auth_secret(auth)?;
    let sender_public = sender.public_key().to_encoded_point(false);
    let sender_public = sender_public.as_bytes();
    let ecdh = shared_secret(sender, &receiver);
    match encoding {
        Encoding::Aes128Gcm => {
            let ikm = webpush_ikm(&ecdh, &auth, p256dh, sender_public);
            // One record: larger than the plaintext, its delimiter and tag.
            let rs = u32::try_from(plaintext.len() + 1 + TAG_BYTES + 1)
                .map_err(|_| EceError::TooLong)?
                .max(RECORD_SIZE);
            Ok(Encrypted {
                encoding,
                body: seal_aes128gcm(&ikm, &salt, rs, sender_public, plaintext),
                encryption: None,
                crypto_key: None,
            })
        }
        Encoding::AesGcm => {
            let (key, nonce) = aesgcm_key_nonce(&ecdh, &auth, &salt, p256dh, sender_public);
            Ok(Encrypted {
                encoding,
                body: seal_aesgcm(&key, &nonce, RECORD_SIZE as usize, plaintext),
                encryption: Some(format!("salt={}", b64(&salt))),
                crypto_key: Some(format!("dh={}", b64(sender_public))),
            })
        }
    }
}

fn public_key(bytes: &[u8], what: &'static str) -> Result<PublicKey, EceError> {
    if bytes.len() != POINT_BYTES || bytes[0] != 4 {
        return Err(EceError::PublicKey(what));
    }
    PublicKey::from_sec1_bytes(bytes).map_err(|_| EceError::PublicKey(what))
}

fn auth_secret(bytes: &[u8]) -> Result<[u8; AUTH_BYTES], EceError> {
    bytes
        .try_into()
        .map_err(|_| EceError::AuthSecret(bytes.len()))
}

fn salt_bytes(bytes: &[u8]) -> Result<[u8; SALT_BYTES], EceError> {
    bytes.try_into().map_err(|_| EceError::Salt(bytes.len()))
}

fn shared_secret(private: &SecretKey, public: &PublicKey) -> [u8; 32] {
    let shared = p256::ecdh::diffie_hellman(private.to_nonzero_scalar(), public.as_affine());
    (*shared.raw_secret_bytes()).into()
}

fn hkdf<const N: usize>(salt: &[u8], ikm: &[u8], info: &[&[u8]]) -> [u8; N] {
    let mut okm = [0; N];
    // N is at most 32 here, far below HKDF-SHA256's limit of 8160 bytes.
    if Hkdf::<Sha256>::new(Some(salt), ikm)
        .expand_multi_info(info, &mut okm)
        .is_err()
    {
        unreachable!("HKDF output of {N} bytes");
    }
    okm
}

/// The record nonce: the base nonce XOR the record's sequence number.
fn record_nonce(base: &[u8; 12], seq: usize) -> [u8; 12] {
    let mut nonce = *base;
    for (byte, seq_byte) in nonce[4..].iter_mut().zip((seq as u64).to_be_bytes()) {
        *byte ^= seq_byte;
    }
    nonce
}

fn cipher(key: &[u8; 16]) -> Aes128Gcm {
    Aes128Gcm::new(key.into())
}

fn seal(cipher: &Aes128Gcm, nonce: &[u8; 12], record: &[u8]) -> Vec<u8> {
    match cipher.encrypt(Nonce::from_slice(nonce), record) {
        Ok(sealed) => sealed,
        // Only fails for inputs near 64 GiB, which no caller makes.
        Err(_) => unreachable!("AES-GCM of a {}-byte record", record.len()),
    }
}

// ------------------------------------------------------------- aes128gcm

/// RFC 8291 §3.3: the input keying material from the ECDH secret.
fn webpush_ikm(ecdh: &[u8; 32], auth: &[u8; 16], ua_public: &[u8], as_public: &[u8]) -> [u8; 32] {
    hkdf(auth, ecdh, &[b"WebPush: info\0", ua_public, as_public])
}

fn aes128gcm_key_nonce(ikm: &[u8], salt: &[u8; 16]) -> ([u8; 16], [u8; 12]) {
    (
        hkdf(salt, ikm, &[b"Content-Encoding: aes128gcm\0"]),
        hkdf(salt, ikm, &[b"Content-Encoding: nonce\0"]),
    )
}

/// The RFC 8188 §2.1 header at the start of an `aes128gcm` body.
struct Aes128GcmHeader<'a> {
    salt: [u8; 16],
    rs: u32,
    keyid: &'a [u8],
    records: &'a [u8],
}

impl<'a> Aes128GcmHeader<'a> {
    fn parse(body: &'a [u8]) -> Result<Self, EceError> {
        let short = || EceError::ShortHeader(body.len());
        let (salt, rest) = body.split_first_chunk::<16>().ok_or_else(short)?;
        let (rs, rest) = rest.split_first_chunk::<4>().ok_or_else(short)?;
        let (&idlen, rest) = rest.split_first().ok_or_else(short)?;
        let (keyid, records) = rest.split_at_checked(idlen.into()).ok_or_else(short)?;
        Ok(Aes128GcmHeader {
            salt: *salt,
            rs: u32::from_be_bytes(*rs),
            keyid,
            records,
        })
    }
}

fn seal_aes128gcm(ikm: &[u8], salt: &[u8; 16], rs: u32, keyid: &[u8], plaintext: &[u8]) -> Vec<u8> {
    let (key, nonce) = aes128gcm_key_nonce(ikm, salt);
    let cipher = cipher(&key);
    let capacity = rs as usize - 1 - TAG_BYTES;
    let chunks: Vec<&[u8]> = if plaintext.is_empty() {
        vec![&[]]
    } else {
        plaintext.chunks(capacity).collect()
    };
    let mut body = Vec::with_capacity(21 + keyid.len() + plaintext.len() + 17 * chunks.len());
    body.extend_from_slice(salt);
    body.extend_from_slice(&rs.to_be_bytes());
    body.push(keyid.len() as u8);
    body.extend_from_slice(keyid);
    for (seq, chunk) in chunks.iter().enumerate() {
        let mut record = chunk.to_vec();
        record.push(if seq + 1 == chunks.len() { 2 } else { 1 });
        body.extend(seal(&cipher, &record_nonce(&nonce, seq), &record));
    }
    body
}

fn open_aes128gcm(ikm: &[u8], header: &Aes128GcmHeader) -> Result<Vec<u8>, EceError> {
    let rs = header.rs as usize;
    if rs <= 1 + TAG_BYTES {
        return Err(EceError::RecordSize(header.rs.into()));
    }
    if header.records.is_empty() {
        return Err(EceError::Truncated);
    }
    let (key, nonce) = aes128gcm_key_nonce(ikm, &header.salt);
    let cipher = cipher(&key);
    let count = header.records.len().div_ceil(rs);
    let mut plaintext = Vec::with_capacity(header.records.len());
    for (seq, record) in header.records.chunks(rs).enumerate() {
        let mut record = cipher
            .decrypt(Nonce::from_slice(&record_nonce(&nonce, seq)), record)
            .map_err(|_| EceError::Decrypt(seq))?;
        // Content, then the delimiter (2 on the last record, else 1), then zeros.
        let delimiter = record.iter().rposition(|&b| b != 0);
        let want = if seq + 1 == count { 2 } else { 1 };
        match delimiter {
            Some(at) if record[at] == want => record.truncate(at),
            _ => return Err(EceError::Padding(seq)),
        }
        plaintext.extend_from_slice(&record);
    }
    Ok(plaintext)
}

// ------------------------------------------------------------- aesgcm

/// draft-ietf-webpush-encryption-04 §3 and draft-ietf-httpbis-encryption-encoding-03 §4.2.
fn aesgcm_key_nonce(
    ecdh: &[u8; 32],
    auth: &[u8; 16],
    salt: &[u8; 16],
    receiver: &[u8],
    sender: &[u8],
) -> ([u8; 16], [u8; 12]) {
    let ikm: [u8; 32] = hkdf(auth, ecdh, &[b"Content-Encoding: auth\0"]);
    // Both keys are 65 bytes: the length prefix is always 0x0041.
    let context: &[&[u8]] = &[b"P-256\0", &[0, 65], receiver, &[0, 65], sender];
    let info = |label: &'static [u8]| -> Vec<&[u8]> {
        std::iter::once(label)
            .chain(context.iter().copied())
            .collect()
    };
    (
        hkdf(salt, &ikm, &info(b"Content-Encoding: aesgcm\0")),
        hkdf(salt, &ikm, &info(b"Content-Encoding: nonce\0")),
    )
}

fn seal_aesgcm(key: &[u8; 16], nonce: &[u8; 12], rs: usize, plaintext: &[u8]) -> Vec<u8> {
    let cipher = cipher(key);
    // Each record is a 2-byte padding length (0 here) and up to rs - 2 bytes;
    // a full last record would read as "more follows", so one empty record
    // then closes the message.
    let capacity = rs - 2;
    let mut chunks: Vec<&[u8]> = plaintext.chunks(capacity).collect();
    if plaintext.len().is_multiple_of(capacity) {
        chunks.push(&[]);
    }
    let mut body = Vec::with_capacity(plaintext.len() + chunks.len() * (2 + TAG_BYTES));
    for (seq, chunk) in chunks.iter().enumerate() {
        let mut record = vec![0, 0];
        record.extend_from_slice(chunk);
        body.extend(seal(&cipher, &record_nonce(nonce, seq), &record));
    }
    body
}

fn open_aesgcm(
    key: &[u8; 16],
    nonce: &[u8; 12],
    rs: u64,
    body: &[u8],
) -> Result<Vec<u8>, EceError> {
    if rs <= 2 {
        return Err(EceError::RecordSize(rs));
    }
    let chunk = usize::try_from(rs)
        .ok()
        .and_then(|rs| rs.checked_add(TAG_BYTES))
        .ok_or(EceError::RecordSize(rs))?;
    // The last record is shorter than a full one.
    if body.len().is_multiple_of(chunk) {
        return Err(EceError::Truncated);
    }
    let cipher = cipher(key);
    let mut plaintext = Vec::with_capacity(body.len());
    for (seq, record) in body.chunks(chunk).enumerate() {
        let record = cipher
            .decrypt(Nonce::from_slice(&record_nonce(nonce, seq)), record)
            .map_err(|_| EceError::Decrypt(seq))?;
        let (pad, rest) = record
            .split_first_chunk::<2>()
            .ok_or(EceError::Padding(seq))?;
        let pad = usize::from(u16::from_be_bytes(*pad));
        let (zeros, content) = rest.split_at_checked(pad).ok_or(EceError::Padding(seq))?;
        if zeros.iter().any(|&b| b != 0) {
            return Err(EceError::Padding(seq));
        }
        plaintext.extend_from_slice(content);
    }
    Ok(plaintext)
}

/// The value of parameter `name` in a header such as
/// `keyid=p256dh;dh=BNc..., p256ecdsa=BF...` (entries split by `,`,
/// parameters by `;`, values maybe quoted).
fn param<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header
        .split([',', ';'])
        .filter_map(|part| part.split_once('='))
        .find(|(key, _)| key.trim().eq_ignore_ascii_case(name))
        .map(|(_, value)| value.trim().trim_matches('"'))
}

#[cfg(test)]
mod tests;
