//! VAPID (RFC 8292): how an application server proves who it is to the push service.
//!
//! A sender signs a short JWT (`aud` = our origin, `exp` = a few hours from now,
//! optionally `sub` = a contact URI) with an ECDSA P-256 key and sends the token plus
//! the public key with every push. Anyone can make a key pair, so this does not prove
//! the sender is *someone in particular*; it proves the request comes from whoever holds
//! the private half of `k`. That is exactly what the service needs:
//!
//! * a v2 endpoint was minted for one public key (its SHA-256 is sealed inside the
//!   endpoint token), so a push to it must be signed by that key — see
//!   [`VapidVerifier::verify_pinned`], which refuses another key before checking its
//!   signature;
//! * operators get a stable identity to contact (`sub`) or throttle (`key_hash`).
//!
//! The work is split the way the checks are ordered:
//!
//! 1. `header.rs` finds the token and the key in `Authorization` / `Crypto-Key` (three
//!    header styles are in use in the wild);
//! 2. the cache (`cache.rs`) answers repeated tokens without any cryptography;
//! 3. `jws.rs` decodes the key and checks the ES256 signature;
//! 4. `claims.rs` checks what the signed token says (`aud`, `exp`, `sub`).
//!
//! Why not the `jsonwebtoken` crate? Its `decode` applies its own claim rules (one
//! leeway for everything, no upper bound on `exp`, audience lists) and folds distinct
//! failures into its own error kinds, so every claim would have to be re-checked here
//! anyway to give senders a precise error. A compact ES256 JWS is three base64url parts
//! and one ECDSA verification; doing it directly keeps every rule in view.

mod cache;
mod claims;
mod header;
mod jws;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use autopush_common::endpoint::KEY_HASH_IN_ID;
use autopush_common::metrics;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use cache::{CacheKey, VerifiedCache};
use header::Credentials;

/// Who sent a push, as proven by its VAPID header. Cheap to clone.
#[derive(Clone, Debug)]
pub struct VapidIdentity {
    /// Raw 65-byte uncompressed P-256 point (`0x04 || x || y`).
    pub public_key: Vec<u8>,
    /// SHA-256 of `public_key`: what v2 endpoint tokens carry, so a subscription can be
    /// bound to a sender without storing its key.
    pub key_hash: [u8; 32],
    /// The `sub` claim (a `mailto:` or `https:` contact), when the sender gave one.
    pub sub: Option<String>,
    /// The `exp` claim, unix seconds.
    pub exp: u64,
}

/// Why a VAPID header was refused. The `Display` text names the failed check, because
/// it goes back to the sender, whose only way to fix a rejected push is to read it.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum VapidError {
    /// `Authorization` is present but is not `vapid`, `WebPush` or `Bearer`.
    #[error(
        "unknown Authorization scheme: expected `vapid t=..,k=..`, `WebPush <jwt>` or `Bearer <jwt>`"
    )]
    UnknownScheme,
    /// The scheme is right but no JWT follows it.
    #[error("VAPID Authorization header carries no token")]
    MissingToken,
    /// No public key: no `k=` parameter, or no `p256ecdsa=` in `Crypto-Key`.
    #[error("VAPID public key missing: send `k=` in Authorization or `p256ecdsa=` in Crypto-Key")]
    MissingKey,
    /// The public key is not base64, or not an uncompressed point on P-256.
    #[error("invalid VAPID public key: {0}")]
    InvalidKey(&'static str),
    /// The JWT is not a well-formed ES256 compact JWS (parts, base64, JSON, `alg`).
    #[error("malformed VAPID JWT: {0}")]
    MalformedToken(&'static str),
    /// The signature is not 64 bytes, typically because it was DER-encoded.
    #[error(
        "VAPID JWT signature must be the 64-byte raw r||s (JOSE) form, got {0} bytes (DER-encoded?)"
    )]
    SignatureFormat(usize),
    /// The signature does not verify against the given public key.
    #[error("VAPID JWT signature does not verify with the given public key")]
    BadSignature,
    /// `exp` is absent.
    #[error("VAPID JWT has no `exp` claim")]
    MissingExp,
    /// `exp` is not a JSON number.
    #[error("VAPID JWT `exp` claim is not a number")]
    InvalidExp,
    /// `exp` is in the past.
    #[error("VAPID JWT has expired (`exp` is in the past)")]
    Expired,
    /// `exp` is more than 24 hours ahead (RFC 8292 §2).
    #[error("VAPID JWT `exp` is more than 24 hours in the future")]
    ExpTooFar,
    /// `aud` is absent.
    #[error("VAPID JWT has no `aud` claim")]
    MissingAud,
    /// `aud` is not this service's origin.
    #[error("VAPID JWT `aud` must be this push service's origin, {expected:?}")]
    WrongAud {
        /// The origin the token should have named.
        expected: String,
    },
    /// The key is not the one the subscription was made for (v2).
    #[error("the VAPID key is not the key this subscription was created with")]
    NotPinned,
}

impl VapidError {
    /// The rule that failed, as a short metric label.
    pub fn check(&self) -> &'static str {
        match self {
            VapidError::UnknownScheme | VapidError::MissingToken => "header",
            VapidError::MissingKey | VapidError::InvalidKey(_) => "key",
            VapidError::MalformedToken(_) => "token",
            VapidError::SignatureFormat(_) | VapidError::BadSignature => "signature",
            VapidError::MissingExp | VapidError::InvalidExp => "exp",
            VapidError::Expired => "expired",
            VapidError::ExpTooFar => "exp_too_far",
            VapidError::MissingAud | VapidError::WrongAud { .. } => "aud",
            VapidError::NotPinned => "pinned",
        }
    }
}

/// What a request's VAPID headers claim, as far as can be told without
/// cryptography ([`VapidVerifier::look_up`]).
pub enum Claim<'a> {
    /// No VAPID credentials (no or blank `Authorization`).
    Unsigned,
    /// A token this node verified before with the same key, unexpired.
    Verified(Arc<VapidIdentity>),
    /// A token to check ([`VapidVerifier::verify_claim`]): an ECDSA
    /// verification.
    Unverified(Unverified<'a>),
}

/// A token and key found in the headers, not yet verified.
pub struct Unverified<'a> {
    credentials: Credentials<'a>,
    /// Where it goes in the cache once verified (`None`: no cache).
    cache_key: Option<CacheKey>,
    /// The time it was looked up at, which its claims are checked against.
    now: u64,
}

/// Where "now" comes from. Production uses the system clock; tests substitute a
/// settable one so that expiry can be tested without sleeping.
type Clock = Box<dyn Fn() -> u64 + Send + Sync>;

fn system_now() -> u64 {
    // A clock before 1970 is a broken host; treating it as the epoch makes every
    // token look far-future, which fails closed (ExpTooFar) rather than open.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// Verifies VAPID headers for one push service origin. Share one per process (it is
/// `Sync`): its cache only pays off if every request sees the same one.
pub struct VapidVerifier {
    audience: String,
    cache: Option<VerifiedCache>,
    clock: Clock,
}

impl std::fmt::Debug for VapidVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VapidVerifier")
            .field("audience", &self.audience)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl VapidVerifier {
    /// `audience` is the origin of the service's endpoint URL, e.g.
    /// `"http://localhost:8082"` (`scheme://host[:port]`, no path, no trailing slash);
    /// senders derive `aud` from the endpoint URL the same way.
    ///
    /// `cache_capacity` bounds how many verified tokens are remembered. Senders reuse
    /// one JWT for hours, so a few thousand entries absorb nearly all signature checks;
    /// `0` disables the cache.
    pub fn new(audience: String, cache_capacity: usize) -> Self {
        Self::with_clock(audience, cache_capacity, Box::new(system_now))
    }

    /// Same, but with the cache disabled (for the benchmark's cold path).
    pub fn without_cache(audience: String) -> Self {
        Self::new(audience, 0)
    }

    fn with_clock(audience: String, cache_capacity: usize, clock: Clock) -> Self {
        // A trailing slash in configuration is a common slip; an origin never has one,
        // and keeping it would reject every correctly made token.
        let audience = audience.trim_end_matches('/').to_owned();
        let cache = (cache_capacity > 0).then(|| VerifiedCache::new(cache_capacity));
        Self {
            audience,
            cache,
            clock,
        }
    }

    /// Checks the VAPID credentials of one request. `Ok(None)` when the request
    /// carries no VAPID credentials at all (no or blank `Authorization`): whether that
    /// is acceptable depends on the endpoint version, which is the caller's business.
    ///
    /// A token seen before with the same key skips the signature check, but its `exp`
    /// is checked against the current time on every call.
    ///
    /// Every outcome is counted (`notification.auth`): `cached`, `verified`,
    /// or `failed` with the rule that failed.
    pub fn verify(
        &self,
        authorization: Option<&str>,
        crypto_key: Option<&str>,
    ) -> Result<Option<Arc<VapidIdentity>>, VapidError> {
        self.verify_pinned(authorization, crypto_key, None)
    }

    /// [`Self::verify`], where only the key `pinned` names may sign (its
    /// SHA-256, or a prefix of it, as a v2 endpoint or a message id carries
    /// it): any other key is refused with [`VapidError::NotPinned`] before
    /// its signature is checked. Anyone can mint keys; an ECDSA verification
    /// is the costly part of a push.
    pub fn verify_pinned(
        &self,
        authorization: Option<&str>,
        crypto_key: Option<&str>,
        pinned: Option<&[u8]>,
    ) -> Result<Option<Arc<VapidIdentity>>, VapidError> {
        match self.look_up(authorization, crypto_key, pinned)? {
            Claim::Unsigned => Ok(None),
            Claim::Verified(identity) => Ok(Some(identity)),
            Claim::Unverified(unverified) => self.verify_claim(unverified, pinned).map(Some),
        }
    }

    /// The first half of [`Self::verify_pinned`], without any
    /// cryptography: the headers parsed, and the token looked up in the
    /// cache. What a push costs is known from its answer, before it is
    /// paid: a [`Claim::Unverified`] costs an ECDSA verification
    /// ([`Self::verify_claim`]). A cached token's `exp` and pin are checked
    /// here; `cached` and failures are counted as by [`Self::verify`].
    pub fn look_up<'a>(
        &self,
        authorization: Option<&'a str>,
        crypto_key: Option<&'a str>,
        pinned: Option<&[u8]>,
    ) -> Result<Claim<'a>, VapidError> {
        self.look_up_uncounted(authorization, crypto_key, pinned)
            .inspect(|claim| {
                if let Claim::Verified(_) = claim {
                    metrics::vapid("cached");
                }
            })
            .inspect_err(|error| metrics::vapid_failed(error.check()))
    }

    fn look_up_uncounted<'a>(
        &self,
        authorization: Option<&'a str>,
        crypto_key: Option<&'a str>,
        pinned: Option<&[u8]>,
    ) -> Result<Claim<'a>, VapidError> {
        let Some(credentials) = header::parse(authorization, crypto_key)? else {
            return Ok(Claim::Unsigned);
        };
        let now = (self.clock)();
        let Some(cache) = &self.cache else {
            return Ok(Claim::Unverified(Unverified {
                credentials,
                cache_key: None,
                now,
            }));
        };
        let cache_key = CacheKey::new(credentials.token, credentials.key);
        let Some(identity) = cache.get(&cache_key) else {
            return Ok(Claim::Unverified(Unverified {
                credentials,
                cache_key: Some(cache_key),
                now,
            }));
        };
        if pinned.is_some_and(|pinned| !key_hash_matches(&identity.key_hash, pinned)) {
            return Err(VapidError::NotPinned);
        }
        if let Err(error) = claims::check_exp(identity.exp, now) {
            cache.remove(&cache_key);
            return Err(error);
        }
        Ok(Claim::Verified(identity))
    }

    /// The second half of [`Self::verify_pinned`]: the full check of a
    /// token [`Self::look_up`] did not find, remembered once it passes.
    /// Counted `verified`, or `failed` with the rule that failed.
    pub fn verify_claim(
        &self,
        unverified: Unverified<'_>,
        pinned: Option<&[u8]>,
    ) -> Result<Arc<VapidIdentity>, VapidError> {
        let Unverified {
            credentials,
            cache_key,
            now,
        } = unverified;
        let identity = self
            .verify_uncached(&credentials, pinned, now)
            .inspect_err(|error| metrics::vapid_failed(error.check()))?;
        if let (Some(cache), Some(cache_key)) = (&self.cache, cache_key) {
            cache.insert(cache_key, Arc::clone(&identity), now);
        }
        metrics::vapid("verified");
        Ok(identity)
    }

    /// The full check: key, signature, claims. The order puts cheap checks first and
    /// makes sure nothing in the claims is believed before the signature is.
    fn verify_uncached(
        &self,
        credentials: &Credentials<'_>,
        pinned: Option<&[u8]>,
        now: u64,
    ) -> Result<Arc<VapidIdentity>, VapidError> {
        let public_key = jws::decode_public_key(credentials.key)?;
        let key_hash = Sha256::digest(&public_key).into();
        if pinned.is_some_and(|pinned| !key_hash_matches(&key_hash, pinned)) {
            return Err(VapidError::NotPinned);
        }
        let token_claims = jws::verify_es256(credentials.token, &public_key)?;
        let checked = claims::check(&token_claims, &self.audience, now)?;
        Ok(Arc::new(VapidIdentity {
            public_key,
            key_hash,
            sub: checked.sub,
            exp: checked.exp,
        }))
    }
}

/// Constant-time check that `key_hash` (a key's SHA-256) begins with
/// `pinned`, the hash a v2 endpoint token carries (whole) or a message id
/// (a prefix of it).
///
/// The hash is of a public key, so it is not a secret in itself, but it is sealed
/// inside the encrypted endpoint for a reason: an early-exit comparison would let a
/// prober learn it byte by byte from response times. Constant time costs nothing here.
/// A `pinned` shorter than a message id's prefix (easier to collide with) or
/// longer than a hash never matches.
fn key_hash_matches(key_hash: &[u8; 32], pinned: &[u8]) -> bool {
    pinned.len() >= KEY_HASH_IN_ID
        && key_hash
            .get(..pinned.len())
            .is_some_and(|prefix| prefix.ct_eq(pinned).into())
}

/// A VAPID public key as `k=` spells it (base64url of an uncompressed
/// P-256 point), decoded and checked to be on the curve: the raw 65 bytes.
pub fn decode_public_key(text: &str) -> Result<Vec<u8>, VapidError> {
    jws::decode_public_key(text)
}
