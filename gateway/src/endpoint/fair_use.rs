//! Rate limits on the public HTTP API, per sender where a sender is proven,
//! else per subscription and source address.
//!
//! A key proves who sent a push where the subscription pins it (a v2
//! endpoint, made for one VAPID key), and where this node has already
//! verified the token it signs (the VAPID cache: the same token with the
//! same key, unexpired). Such a push counts against its sender, the key,
//! alone: a sender is never slowed by another behind the same address (a
//! NAT, a hosting provider, a homeserver), and a noisy one is refused
//! whatever address it comes from. `--sender-limits` gives named keys
//! their own rate instead of `--sender-limit`.
//!
//! Any other push costs proof: an unsigned one proves nothing, and a key
//! costs nothing to mint, so a sender signing each push with a fresh key
//! would escape every limit by key (and cost us an ECDSA verification each
//! time). So a push to a subscription that pins no key counts against the
//! subscription it targets, first (a push it refuses costs the address
//! nothing), and, unless its token is one already verified, against its
//! source address; all of it decided from the cache before any signature
//! is checked, so a refused push costs no verification. A signed one also
//! counts against its key once verified. Throwaway keys stay limited by
//! address: each of them costs one verification, charged there.
//!
//! A pinned key is public, so anyone can name it beside a forged signature:
//! a push whose signature fails counts against its source address, and an
//! address out of that budget is refused before any verification (a token
//! already verified needs none, so it is not refused for its address). A
//! Matrix homeserver's notifications count, one per device, against its
//! source address in a bucket of their own, and against each subscription
//! they reach, as an unsigned push does. `/v1` registrations, which create
//! users without credentials, count against their source address.
//! Addresses count by [`AddressLimiter`] (an IPv6 host by its /64, and its
//! /48 at 16 times the rate). Limits are per node: behind a load balancer
//! spreading over N nodes, a sender gets up to N times the rate.
//!
//! Over any limit is 429 with `Retry-After`, never 403 (a Matrix homeserver
//! deletes a pusher on 403). A push's 201 names the limit the push stands
//! closest to (the one with the fewest requests left, [`Binding`]), and a
//! limit's 429 the one that refused it, in the IETF `RateLimit-Policy` and
//! `RateLimit` headers ([`RateLimit`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use autopush_common::endpoint::TokenInfo;
use autopush_common::limit::{AddressLimiter, Bucket, Limiter, Rate, Span, Standing};
use autopush_common::limit_headers::RateLimit;
use autopush_common::{ApiError, ApiResult, metrics};
use uuid::Uuid;

use crate::settings::RateLimits;
use crate::vapid::VapidIdentity;

/// How often the limiters' sizes are reported.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// A limit by address: its metric label, its policy names for a host and
/// for the IPv6 /48 around it, and what a refusal names.
struct AddressPolicy {
    limit: &'static str,
    site: &'static str,
    what: &'static str,
}

const SOURCE_IP: AddressPolicy = AddressPolicy {
    limit: "source_ip",
    site: "source_ip_48",
    what: "source address",
};
const FORGED: AddressPolicy = AddressPolicy {
    limit: "forged",
    site: "forged_48",
    what: "source address",
};
const REGISTRATION: AddressPolicy = AddressPolicy {
    limit: "registration",
    site: "registration_48",
    what: "source address",
};
const MATRIX_GATEWAY: AddressPolicy = AddressPolicy {
    limit: "matrix_gateway",
    site: "matrix_gateway_48",
    what: "homeserver address",
};

/// A sender's own rate (`--sender-limits`); `None`: no limit.
type NamedSender = Option<(Rate, Mutex<Bucket>)>;

pub struct FairUse {
    sender: Option<Limiter<[u8; 32]>>,
    /// Named senders, by their key's SHA-256.
    senders: HashMap<[u8; 32], NamedSender>,
    subscription: Option<Limiter<(Uuid, Uuid)>>,
    source_ip: Option<AddressLimiter>,
    registration: Option<AddressLimiter>,
    /// Failed signature checks by source address (at `source_ip`'s rate).
    forged: Option<AddressLimiter>,
    /// Matrix gateway notifications by the homeserver's source address.
    matrix_gateway: Option<AddressLimiter>,
    /// Proxies whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

/// Of the limits a push passed, the one it stands closest to (the fewest
/// requests left): what its 201's `RateLimit` headers name. (A refusal
/// names its own limit, in its [`ApiError::TooManyRequests`].)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Binding {
    pub policy: &'static str,
    pub standing: Standing,
}

impl Binding {
    /// Keep in `binding` the closer of it and `candidate`.
    fn closer(binding: &mut Option<Binding>, candidate: Binding) {
        if binding.is_none_or(|b| candidate.standing.remaining() < b.standing.remaining()) {
            *binding = Some(candidate);
        }
    }

    /// The limit as the answer's headers tell it.
    pub fn rate_limit(&self) -> RateLimit {
        RateLimit::passed(self.policy, self.standing)
    }
}

impl FairUse {
    pub fn new(limits: &RateLimits) -> Self {
        fn limiter<K: std::hash::Hash + Eq + Clone>(
            rate: Option<Rate>,
            max_keys: usize,
        ) -> Option<Limiter<K>> {
            rate.map(|rate| Limiter::new(rate, max_keys))
        }
        fn addresses(rate: Option<Rate>, max_keys: usize) -> Option<AddressLimiter> {
            rate.map(|rate| AddressLimiter::new(rate, max_keys))
        }
        let now = Instant::now();
        FairUse {
            sender: limiter(limits.sender, limits.max_keys),
            senders: limits
                .senders
                .iter()
                .map(|(key_hash, rate)| {
                    let named = rate.map(|rate| (rate, Mutex::new(Bucket::full(rate, now))));
                    (*key_hash, named)
                })
                .collect(),
            subscription: limiter(limits.subscription, limits.max_keys),
            source_ip: addresses(limits.source_ip, limits.max_keys),
            registration: addresses(limits.registration, limits.max_keys),
            forged: addresses(limits.source_ip, limits.max_keys),
            matrix_gateway: addresses(limits.matrix_gateway, limits.max_keys),
            trusted_proxies: limits.trusted_proxies.clone(),
        }
    }

    /// A push to the subscription `(uaid, channel_id)`, which pins no
    /// VAPID key: taken before its token is looked at.
    pub fn unpinned_push(
        &self,
        uaid: Uuid,
        channel_id: Uuid,
        binding: &mut Option<Binding>,
    ) -> ApiResult<()> {
        take(
            &self.subscription,
            &(uaid, channel_id),
            "subscription",
            "subscription",
            binding,
        )
    }

    /// A push from `client` that proves no sender (unsigned, or signed by a
    /// token not verified yet) to a subscription that pins no key: taken
    /// before any signature is checked.
    pub fn unproven_push(&self, client: IpAddr, binding: &mut Option<Binding>) -> ApiResult<()> {
        take_address(&self.source_ip, client, &SOURCE_IP, binding)
    }

    /// Before a signature from `client` is checked: refused while its
    /// address is out of budget for failed checks ([`FairUse::forged`]).
    pub fn may_verify(&self, client: IpAddr) -> ApiResult<()> {
        let Some(limiter) = &self.forged else {
            return Ok(());
        };
        limiter
            .ready_counted(client, FORGED.limit)
            .map_err(|(span, refused)| refuse(FORGED.policy(span), FORGED.what, refused))
    }

    /// A signature from `client` failed its check.
    pub fn forged(&self, client: IpAddr) {
        if let Some(limiter) = &self.forged {
            // Refused or not, the failure is spent.
            let _ = limiter.check(client);
        }
    }

    /// A push signed by `sender` (verified, or found in the cache), to any
    /// subscription: counted at its own rate if it is named, else at
    /// `--sender-limit`.
    pub fn signed_push(
        &self,
        sender: &VapidIdentity,
        binding: &mut Option<Binding>,
    ) -> ApiResult<()> {
        let Some(named) = self.senders.get(&sender.key_hash) else {
            return take(&self.sender, &sender.key_hash, "sender", "sender", binding);
        };
        let Some((rate, bucket)) = named else {
            return Ok(());
        };
        let taken = bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take_standing(*rate, Instant::now());
        settle("sender", "sender", taken, binding).inspect_err(|_| {
            metrics::rate_limited("sender", self.sender.as_ref().map_or(0, Limiter::len));
        })
    }

    /// Report how many keys each limiter tracks (`rate_limit.keys`).
    pub fn report(&self) {
        fn keys(name: &'static str, held: Option<usize>) {
            if let Some(held) = held {
                metrics::rate_limit_keys(name, held);
            }
        }
        keys("sender", self.sender.as_ref().map(Limiter::len));
        keys("subscription", self.subscription.as_ref().map(Limiter::len));
        keys(
            "source_ip",
            self.source_ip.as_ref().map(AddressLimiter::len),
        );
        keys(
            "registration",
            self.registration.as_ref().map(AddressLimiter::len),
        );
        keys("forged", self.forged.as_ref().map(AddressLimiter::len));
        keys(
            "matrix_gateway",
            self.matrix_gateway.as_ref().map(AddressLimiter::len),
        );
    }

    /// A Matrix gateway notification for one device, from the homeserver
    /// at `client`: taken before its pushkey is looked at.
    pub fn matrix_notification(&self, client: IpAddr) -> ApiResult<()> {
        take_address(&self.matrix_gateway, client, &MATRIX_GATEWAY, &mut None)
    }

    /// A Matrix gateway notification to `subscription`, which counts as
    /// an unsigned push to it does.
    pub fn matrix_subscription(&self, subscription: &TokenInfo) -> ApiResult<()> {
        self.unpinned_push(subscription.uaid, subscription.channel_id, &mut None)
    }

    /// A `/v1` registration from `client`.
    pub fn registration(&self, client: IpAddr) -> ApiResult<()> {
        take_address(&self.registration, client, &REGISTRATION, &mut None)
    }
}

impl AddressPolicy {
    fn policy(&self, span: Span) -> &'static str {
        match span {
            Span::Host => self.limit,
            Span::Site => self.site,
        }
    }
}

/// Take a token from `limiter` for `client`'s address, or refuse with 429.
fn take_address(
    limiter: &Option<AddressLimiter>,
    client: IpAddr,
    policy: &AddressPolicy,
    binding: &mut Option<Binding>,
) -> ApiResult<()> {
    let Some(limiter) = limiter else {
        return Ok(());
    };
    // The span (host or site) that answered names the policy.
    let (span, taken) = match limiter.take_counted(client, policy.limit) {
        Ok((span, standing)) => (span, Ok(standing)),
        Err((span, refused)) => (span, Err(refused)),
    };
    settle(policy.policy(span), policy.what, taken, binding)
}

/// Take a token from `limiter` for `key`, or refuse with 429.
fn take<K: std::hash::Hash + Eq + Clone>(
    limiter: &Option<Limiter<K>>,
    key: &K,
    limit: &'static str,
    what: &'static str,
    binding: &mut Option<Binding>,
) -> ApiResult<()> {
    let Some(limiter) = limiter else {
        return Ok(());
    };
    settle(limit, what, limiter.take_counted(key, limit), binding)
}

/// Note a take's standing under `policy` in `binding`, or refuse.
fn settle(
    policy: &'static str,
    what: &'static str,
    taken: Result<Standing, Standing>,
    binding: &mut Option<Binding>,
) -> ApiResult<()> {
    match taken {
        Ok(standing) => {
            Binding::closer(binding, Binding { policy, standing });
            Ok(())
        }
        Err(refused) => Err(refuse(policy, what, refused)),
    }
}

/// The 429 for `what`, refused under `policy`: it names that limit,
/// whatever others stand at.
fn refuse(policy: &'static str, what: &'static str, refused: Standing) -> ApiError {
    ApiError::TooManyRequests {
        what,
        limit: RateLimit::refused(policy, refused),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every limit a burst of `burst` that never refills within a test.
    fn fair_use(burst: f64) -> FairUse {
        let rate = Rate::new(0.001, burst);
        FairUse::new(&RateLimits {
            sender: rate,
            senders: Vec::new(),
            subscription: rate,
            source_ip: rate,
            registration: rate,
            new_uaid: rate,
            bridge_app: rate,
            matrix_gateway: rate,
            max_keys: 1000,
            trusted_proxies: Vec::new(),
        })
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn refused(result: ApiResult<()>) -> bool {
        matches!(result, Err(ApiError::TooManyRequests { .. }))
    }

    #[test]
    fn the_binding_limit_is_the_one_with_fewest_left() {
        let limits = fair_use(3.0);
        let (uaid, channel_id) = (Uuid::new_v4(), Uuid::new_v4());
        let (client, other) = (ip("192.0.2.1"), ip("192.0.2.2"));
        let closest = |binding: Option<Binding>| {
            let binding = binding.unwrap();
            (binding.policy, binding.standing.remaining())
        };
        let mut binding = None;
        limits
            .unpinned_push(uaid, channel_id, &mut binding)
            .unwrap();
        limits.unproven_push(client, &mut None).unwrap();
        limits.unproven_push(client, &mut binding).unwrap();
        assert_eq!(closest(binding), ("source_ip", 1));
        let mut binding = None;
        limits
            .unpinned_push(uaid, channel_id, &mut binding)
            .unwrap();
        limits.unproven_push(other, &mut binding).unwrap();
        assert_eq!(closest(binding), ("subscription", 1));
        limits.unpinned_push(uaid, channel_id, &mut None).unwrap();
        // The subscription's 4th: its refusal names it.
        let Err(ApiError::TooManyRequests { limit, .. }) =
            limits.unpinned_push(uaid, channel_id, &mut None)
        else {
            panic!("the subscription's 4th push passed");
        };
        assert_eq!(
            (limit.policy, limit.quota, limit.remaining),
            ("subscription", 3, 0)
        );
    }

    #[test]
    fn registrations_from_one_ipv6_64_share_a_bucket() {
        let limits = fair_use(2.0);
        assert!(limits.registration(ip("2001:db8:1:2::1")).is_ok());
        assert!(limits.registration(ip("2001:db8:1:2::2")).is_ok());
        assert!(refused(limits.registration(ip("2001:db8:1:2::3"))));
        assert!(limits.registration(ip("2001:db8:1:3::1")).is_ok());
    }

    #[test]
    fn unpinned_pushes_from_one_ipv6_64_share_a_bucket() {
        let limits = fair_use(2.0);
        let push = |client: &str| limits.unproven_push(ip(client), &mut None);
        assert!(push("2001:db8:1:2::1").is_ok());
        assert!(push("2001:db8:1:2::2").is_ok());
        assert!(refused(push("2001:db8:1:2:ffff::3")));
        assert!(push("2001:db8:1:3::1").is_ok());
        // An IPv4 sender seen IPv4-mapped is the IPv4 one.
        assert!(push("192.0.2.1").is_ok());
        assert!(push("::ffff:192.0.2.1").is_ok());
        assert!(refused(push("192.0.2.1")));
    }
}
