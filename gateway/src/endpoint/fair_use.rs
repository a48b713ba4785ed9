//! Rate limits on the public HTTP API, per sender where a sender is proven,
//! else per subscription and source address.
//!
//! A key proves who sent a push only where the subscription pins it (a v2
//! endpoint, made for one VAPID key): such a push counts against its
//! sender, the key, alone, so a sender is never slowed by another behind
//! the same address, and a noisy one is refused whatever address it comes
//! from. On a v1 endpoint any key signs, and a key costs nothing to mint: a
//! sender signing each push with a fresh one would escape every limit (and
//! cost us an ECDSA verification each time). So a push to a subscription
//! that pins no key counts, signed or not, against the subscription it
//! targets and its source address, before its signature is checked; a
//! signed one also counts against its key. A pinned key is public, so
//! anyone can name it beside a forged signature: a push whose signature
//! fails counts against its source address, and an address out of that
//! budget is refused before any verification. A Matrix homeserver's
//! notifications count, one per device, against its source address in a
//! bucket of their own, and against each subscription they reach, as an
//! unsigned push does. `/v1` registrations, which
//! create users without credentials, count against their source address.
//! Addresses count by [`AddressLimiter`] (an IPv6 host by its /64, and its
//! /48 at 16 times the rate). Limits are
//! per node: behind a load balancer spreading over N nodes, a sender gets
//! up to N times the rate.

use std::net::IpAddr;
use std::time::Duration;

use autopush_common::endpoint::TokenInfo;
use autopush_common::errors::retry_after_secs;
use autopush_common::limit::{AddressLimiter, Limiter, Rate};
use autopush_common::{ApiError, ApiResult, metrics};
use uuid::Uuid;

use crate::settings::RateLimits;
use crate::vapid::VapidIdentity;

/// How often the limiters' sizes are reported.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

pub struct FairUse {
    sender: Option<Limiter<[u8; 32]>>,
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
        FairUse {
            sender: limiter(limits.sender, limits.max_keys),
            subscription: limiter(limits.subscription, limits.max_keys),
            source_ip: addresses(limits.source_ip, limits.max_keys),
            registration: addresses(limits.registration, limits.max_keys),
            forged: addresses(limits.source_ip, limits.max_keys),
            matrix_gateway: addresses(limits.matrix_gateway, limits.max_keys),
            trusted_proxies: limits.trusted_proxies.clone(),
        }
    }

    /// A push to the subscription `(uaid, channel_id)`, which pins no
    /// VAPID key, from `client`: taken before any signature is checked, so
    /// a refused push costs no verification. The subscription first: a
    /// push it refuses costs the address nothing.
    pub fn unpinned_push(&self, uaid: Uuid, channel_id: Uuid, client: IpAddr) -> ApiResult<()> {
        take(
            &self.subscription,
            &(uaid, channel_id),
            "subscription",
            "subscription",
        )?;
        take_address(&self.source_ip, client, "source_ip", "source address")
    }

    /// Before a signature from `client` is checked: refused while its
    /// address is out of budget for failed checks ([`FairUse::forged`]).
    pub fn may_verify(&self, client: IpAddr) -> ApiResult<()> {
        let Some(limiter) = &self.forged else {
            return Ok(());
        };
        limiter
            .ready_counted(client, "forged")
            .map_err(too_many("source address"))
    }

    /// A signature from `client` failed its check.
    pub fn forged(&self, client: IpAddr) {
        if let Some(limiter) = &self.forged {
            // Refused or not, the failure is spent.
            let _ = limiter.check(client);
        }
    }

    /// A push signed by `sender` (verified), to any subscription.
    pub fn signed_push(&self, sender: &VapidIdentity) -> ApiResult<()> {
        take(&self.sender, &sender.key_hash, "sender", "sender")
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
        take_address(
            &self.matrix_gateway,
            client,
            "matrix_gateway",
            "homeserver address",
        )
    }

    /// A Matrix gateway notification to `subscription`, which counts as
    /// an unsigned push to it does.
    pub fn matrix_subscription(&self, subscription: &TokenInfo) -> ApiResult<()> {
        take(
            &self.subscription,
            &(subscription.uaid, subscription.channel_id),
            "subscription",
            "subscription",
        )
    }

    /// A `/v1` registration from `client`.
    pub fn registration(&self, client: IpAddr) -> ApiResult<()> {
        take_address(&self.registration, client, "registration", "source address")
    }
}

/// Take a token from `limiter` for `client`'s address, or refuse with 429.
fn take_address(
    limiter: &Option<AddressLimiter>,
    client: IpAddr,
    limit: &'static str,
    what: &'static str,
) -> ApiResult<()> {
    let Some(limiter) = limiter else {
        return Ok(());
    };
    limiter.check_counted(client, limit).map_err(too_many(what))
}

/// Take a token from `limiter` for `key`, or refuse with 429.
fn take<K: std::hash::Hash + Eq + Clone>(
    limiter: &Option<Limiter<K>>,
    key: &K,
    limit: &'static str,
    what: &'static str,
) -> ApiResult<()> {
    let Some(limiter) = limiter else {
        return Ok(());
    };
    limiter.check_counted(key, limit).map_err(too_many(what))
}

/// The 429 for `what`, given how long until a token is there.
fn too_many(what: &'static str) -> impl Fn(Duration) -> ApiError {
    move |wait| ApiError::TooManyRequests {
        what,
        retry_after: retry_after_secs(wait),
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
        let push = |client: &str| limits.unpinned_push(Uuid::new_v4(), Uuid::new_v4(), ip(client));
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
