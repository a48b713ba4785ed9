//! Rate limits: a token bucket per key (a sender's VAPID key, a
//! subscription, a source IP, a bridge app), in a map of bounded size.
//!
//! A bucket holds up to `burst` tokens and gains `rate` tokens a second; a
//! request takes one, and one that finds none is refused with the time until
//! the next token. The map never holds more than `max_keys` buckets: a
//! bucket that has refilled carries no state and is dropped first, and when
//! none has, an arbitrary one goes, so a flood of fresh keys costs bounded
//! memory and at worst hands some other key a fresh burst (never a refusal
//! it did not earn).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, Hash, RandomState};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Independent maps, each behind its own lock, so senders rarely wait on
/// each other.
const SHARDS: usize = 16;

/// A rate: `per_second` sustained, `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: f64,
}

impl Rate {
    /// `per_second` sustained with a burst of `burst`; `None` when
    /// `per_second` is 0 (no limit).
    pub fn new(per_second: f64, burst: f64) -> Option<Rate> {
        (per_second > 0.0).then_some(Rate {
            per_second,
            burst: burst.max(1.0),
        })
    }
}

/// Where a key stands in its bucket once a request is counted: the tokens
/// left (below 1 when refused) and the rate they come at. What the IETF
/// `RateLimit` headers report.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Standing {
    pub tokens: f64,
    pub rate: Rate,
}

impl Standing {
    /// Whole requests that may still be made at once.
    pub fn remaining(&self) -> u64 {
        self.tokens.max(0.0).floor() as u64
    }

    /// How long until the next whole token: the time within which no more
    /// than [`Standing::remaining`] requests can pass, and, for a refused
    /// request, the wait before a retry can.
    pub fn next_token(&self) -> Duration {
        let fraction = self.tokens.max(0.0).fract();
        Duration::from_secs_f64((1.0 - fraction) / self.rate.per_second)
    }
}

/// One token bucket: what [`Limiter`] keeps per key, and what a single
/// holder (one session's pings) keeps for itself.
#[derive(Clone, Copy, Debug)]
pub struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    /// A bucket holding its whole burst at `now`.
    pub fn full(rate: Rate, now: Instant) -> Self {
        Bucket {
            tokens: rate.burst,
            updated: now,
        }
    }

    /// Take a token at `now`, or say how long until one is there.
    pub fn take(&mut self, rate: Rate, now: Instant) -> Result<(), Duration> {
        self.take_standing(rate, now)
            .map(drop)
            .map_err(|refused| refused.next_token())
    }

    /// Take a token at `now`; where the bucket stands after, or, refused,
    /// where it stands without it.
    pub fn take_standing(&mut self, rate: Rate, now: Instant) -> Result<Standing, Standing> {
        self.refill(rate, now);
        let taken = self.tokens >= 1.0;
        if taken {
            self.tokens -= 1.0;
        }
        let standing = Standing {
            tokens: self.tokens,
            rate,
        };
        if taken { Ok(standing) } else { Err(standing) }
    }

    /// Whether a token is there at `now`, without taking it, or where the
    /// bucket stands without.
    fn ready(&self, rate: Rate, now: Instant) -> Result<(), Standing> {
        let mut peek = *self;
        peek.take_standing(rate, now).map(drop)
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.per_second).min(rate.burst);
        self.updated = now;
    }

    fn is_full(&self, rate: Rate, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens + elapsed * rate.per_second >= rate.burst
    }
}

/// The key every limit by address counts a client under: an IPv4 address
/// (also when it arrives IPv4-mapped on a dual-stack socket), or the /64 of
/// an IPv6 one, which one host usually holds whole. Keyed by full IPv6
/// address, one host would get a fresh bucket per address, and its flood of
/// fresh keys would evict other clients' refused buckets.
pub fn address_key(client: IpAddr) -> IpAddr {
    match client.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        v4 => v4,
    }
}

/// How many hosts' worth of a limit by address the /48 around an IPv6 /64
/// gets: a site (an office, a tunnel broker's customer) holds a /48 and
/// several hosts, but one host of it with 65 536 /64s must not get 65 536
/// buckets' worth of rate.
pub const SITE_HOSTS: f64 = 16.0;

/// The /48 around an IPv6 address ([`SITE_HOSTS`]); `None` for IPv4.
fn site_key(client: IpAddr) -> Option<IpAddr> {
    match client.to_canonical() {
        IpAddr::V6(v6) => Some(IpAddr::V6(Ipv6Addr::from(
            u128::from(v6) & !((1u128 << 80) - 1),
        ))),
        IpAddr::V4(_) => None,
    }
}

/// Which bucket of an [`AddressLimiter`] a standing is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Span {
    /// The host: an IPv4 address or an IPv6 /64.
    Host,
    /// The IPv6 /48 around it, at [`SITE_HOSTS`] times the rate.
    Site,
}

/// A limit by source address: a bucket per host ([`address_key`]) and, for
/// IPv6, one per enclosing /48 at [`SITE_HOSTS`] times the rate. The site
/// is charged first, so a /48 out of its budget is refused before any of its
/// /64s takes a bucket: its flood of fresh /64s neither multiplies its rate
/// nor evicts other senders' refused buckets.
pub struct AddressLimiter {
    hosts: Limiter<IpAddr>,
    sites: Limiter<IpAddr>,
}

impl AddressLimiter {
    pub fn new(rate: Rate, max_keys: usize) -> Self {
        let site = Rate {
            per_second: rate.per_second * SITE_HOSTS,
            burst: rate.burst * SITE_HOSTS,
        };
        AddressLimiter {
            hosts: Limiter::new(rate, max_keys),
            sites: Limiter::new(site, max_keys),
        }
    }

    /// Take a token for `client`'s site and host, or say how long until
    /// there is one.
    pub fn check(&self, client: IpAddr) -> Result<(), Duration> {
        self.check_at(client, Instant::now())
    }

    /// [`AddressLimiter::check`], counting a refusal as
    /// [`Limiter::check_counted`] does.
    pub fn check_counted(&self, client: IpAddr, limit: &'static str) -> Result<(), Duration> {
        self.check(client).inspect_err(|_| {
            crate::metrics::rate_limited(limit, self.len());
        })
    }

    /// [`AddressLimiter::check`] at `now`.
    pub fn check_at(&self, client: IpAddr, now: Instant) -> Result<(), Duration> {
        self.take_at(client, now)
            .map(drop)
            .map_err(|(_, refused)| refused.next_token())
    }

    /// Take a token for `client`'s site and host; where the one with the
    /// fewer left stands, or where the one that refused stands.
    pub fn take_at(
        &self,
        client: IpAddr,
        now: Instant,
    ) -> Result<(Span, Standing), (Span, Standing)> {
        let site = match site_key(client) {
            Some(site) => Some(
                self.sites
                    .take_at(&site, now)
                    .map_err(|refused| (Span::Site, refused))?,
            ),
            None => None,
        };
        let host = self
            .hosts
            .take_at(&address_key(client), now)
            .map_err(|refused| (Span::Host, refused))?;
        Ok(match site {
            Some(site) if site.remaining() < host.remaining() => (Span::Site, site),
            _ => (Span::Host, host),
        })
    }

    /// [`AddressLimiter::take_at`] now, counting a refusal as
    /// [`Limiter::check_counted`] does.
    pub fn take_counted(
        &self,
        client: IpAddr,
        limit: &'static str,
    ) -> Result<(Span, Standing), (Span, Standing)> {
        self.take_at(client, Instant::now())
            .inspect_err(|_| crate::metrics::rate_limited(limit, self.len()))
    }

    /// Whether `client`'s site and host have a token, without taking one;
    /// refused, where the one without stands.
    pub fn ready_counted(
        &self,
        client: IpAddr,
        limit: &'static str,
    ) -> Result<(), (Span, Standing)> {
        let now = Instant::now();
        site_key(client)
            .map_or(Ok(()), |site| {
                self.sites
                    .ready_at(&site, now)
                    .map_err(|refused| (Span::Site, refused))
            })
            .and_then(|()| {
                self.hosts
                    .ready_at(&address_key(client), now)
                    .map_err(|refused| (Span::Host, refused))
            })
            .inspect_err(|_| crate::metrics::rate_limited(limit, self.len()))
    }

    /// Buckets tracked now, hosts and sites.
    pub fn len(&self) -> usize {
        self.hosts.len() + self.sites.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Shard<K> {
    buckets: HashMap<K, Bucket>,
    /// When refilled buckets were last dropped to make room.
    last_purge: Option<Instant>,
}

/// Token buckets by key, at most `max_keys` of them.
pub struct Limiter<K> {
    rate: Rate,
    per_shard: usize,
    shards: Vec<Mutex<Shard<K>>>,
    hasher: RandomState,
    /// Buckets held across all shards, kept as they come and go so that
    /// reading it (at every refusal) locks nothing.
    keys: AtomicUsize,
}

impl<K: Hash + Eq + Clone> Limiter<K> {
    pub fn new(rate: Rate, max_keys: usize) -> Self {
        Limiter {
            rate,
            per_shard: max_keys.div_ceil(SHARDS).max(1),
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        buckets: HashMap::new(),
                        last_purge: None,
                    })
                })
                .collect(),
            hasher: RandomState::new(),
            keys: AtomicUsize::new(0),
        }
    }

    /// Take a token for `key`, or say how long until one is there.
    pub fn check(&self, key: &K) -> Result<(), Duration> {
        self.check_at(key, Instant::now())
    }

    /// [`Limiter::check`], counting a refusal in `rate_limit.refused`
    /// under `limit` (and the keys tracked in `rate_limit.keys`).
    pub fn check_counted(&self, key: &K, limit: &'static str) -> Result<(), Duration> {
        self.check(key).inspect_err(|_| {
            crate::metrics::rate_limited(limit, self.len());
        })
    }

    /// [`Limiter::check`] at `now` (tests drive the clock).
    pub fn check_at(&self, key: &K, now: Instant) -> Result<(), Duration> {
        self.take_at(key, now)
            .map(drop)
            .map_err(|refused| refused.next_token())
    }

    /// [`Limiter::take_at`] now, counting a refusal as
    /// [`Limiter::check_counted`] does.
    pub fn take_counted(&self, key: &K, limit: &'static str) -> Result<Standing, Standing> {
        self.take_at(key, Instant::now()).inspect_err(|_| {
            crate::metrics::rate_limited(limit, self.len());
        })
    }

    /// Take a token for `key` at `now`: where its bucket stands after, or,
    /// refused, where it stands. One lock, as [`Limiter::check_at`].
    pub fn take_at(&self, key: &K, now: Instant) -> Result<Standing, Standing> {
        let shard = &self.shards[self.hasher.hash_one(key) as usize % SHARDS];
        let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
        if !shard.buckets.contains_key(key) && shard.buckets.len() >= self.per_shard {
            self.make_room(&mut shard, now);
        }
        let rate = self.rate;
        let bucket = match shard.buckets.entry(key.clone()) {
            Entry::Occupied(bucket) => bucket.into_mut(),
            Entry::Vacant(slot) => {
                self.keys.fetch_add(1, Ordering::Relaxed);
                slot.insert(Bucket::full(rate, now))
            }
        };
        bucket.take_standing(rate, now)
    }

    /// Whether `key` has a token, without taking it: a key never seen has
    /// its whole burst (and is not added). Refused, where it stands.
    pub fn ready(&self, key: &K) -> Result<(), Standing> {
        self.ready_at(key, Instant::now())
    }

    /// [`Limiter::ready`], counting a refusal as [`Limiter::check_counted`]
    /// does.
    pub fn ready_counted(&self, key: &K, limit: &'static str) -> Result<(), Standing> {
        self.ready(key).inspect_err(|_| {
            crate::metrics::rate_limited(limit, self.len());
        })
    }

    /// [`Limiter::ready`] at `now`.
    pub fn ready_at(&self, key: &K, now: Instant) -> Result<(), Standing> {
        let shard = &self.shards[self.hasher.hash_one(key) as usize % SHARDS];
        let shard = shard.lock().unwrap_or_else(|p| p.into_inner());
        shard
            .buckets
            .get(key)
            .map_or(Ok(()), |bucket| bucket.ready(self.rate, now))
    }

    /// Drop the buckets that have refilled (at most once a second: it is a
    /// scan), else any one bucket.
    fn make_room(&self, shard: &mut Shard<K>, now: Instant) {
        let held = shard.buckets.len();
        let due = shard
            .last_purge
            .is_none_or(|last| now.saturating_duration_since(last) >= Duration::from_secs(1));
        if due {
            shard.last_purge = Some(now);
            let rate = self.rate;
            shard.buckets.retain(|_, b| !b.is_full(rate, now));
        }
        if shard.buckets.len() >= self.per_shard
            && let Some(key) = shard.buckets.keys().next().cloned()
        {
            shard.buckets.remove(&key);
        }
        self.keys
            .fetch_sub(held - shard.buckets.len(), Ordering::Relaxed);
    }

    /// Keys tracked now (at most `max_keys`, rounded up to the shards).
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(per_second: f64, burst: f64, max_keys: usize) -> Limiter<u64> {
        Limiter::new(Rate::new(per_second, burst).unwrap(), max_keys)
    }

    #[test]
    fn a_burst_then_the_sustained_rate() {
        let limiter = limiter(2.0, 3.0, 100);
        let start = Instant::now();
        for _ in 0..3 {
            assert!(limiter.check_at(&1, start).is_ok());
        }
        let wait = limiter.check_at(&1, start).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        // Another key is not affected.
        assert!(limiter.check_at(&2, start).is_ok());
        let later = start + Duration::from_millis(500);
        assert!(limiter.check_at(&1, later).is_ok());
        assert!(limiter.check_at(&1, later).is_err());
    }

    #[test]
    fn a_take_tells_where_its_bucket_stands() {
        let limiter = limiter(0.5, 3.0, 100);
        let start = Instant::now();
        let standing = limiter.take_at(&1, start).unwrap();
        assert_eq!(standing.remaining(), 2);
        assert_eq!(standing.rate, Rate::new(0.5, 3.0).unwrap());
        limiter.take_at(&1, start).unwrap();
        let last = limiter.take_at(&1, start).unwrap();
        assert_eq!(
            (last.remaining(), last.next_token()),
            (0, Duration::from_secs(2))
        );
        let refused = limiter
            .take_at(&1, start + Duration::from_millis(500))
            .unwrap_err();
        assert_eq!(refused.remaining(), 0);
        assert_eq!(refused.next_token(), Duration::from_millis(1500));
        // A refused take leaves the bucket as it was.
        let later = start + Duration::from_secs(2);
        assert_eq!(limiter.take_at(&1, later).unwrap().remaining(), 0);
    }

    #[test]
    fn an_address_reports_the_bucket_with_fewer_left() {
        let rate = Rate::new(0.001, 2.0).unwrap();
        let limiter = AddressLimiter::new(rate, 1000);
        let start = Instant::now();
        let (span, standing) = limiter
            .take_at("192.0.2.1".parse().unwrap(), start)
            .unwrap();
        assert_eq!((span, standing.remaining()), (Span::Host, 1));
        // /64s of one /48 taking its 32 tokens: the site has fewer left
        // than a fresh host once 31 are gone, and then refuses.
        let ip = |n: u16| -> IpAddr { format!("2001:db8:1:{n:x}::1").parse().unwrap() };
        for n in 0..15 {
            for _ in 0..2 {
                assert_eq!(limiter.take_at(ip(n), start).unwrap().0, Span::Host);
            }
        }
        assert_eq!(limiter.take_at(ip(15), start).unwrap().0, Span::Host);
        let (span, standing) = limiter.take_at(ip(16), start).unwrap();
        assert_eq!((span, standing.remaining()), (Span::Site, 0));
        assert_eq!(limiter.take_at(ip(17), start).unwrap_err().0, Span::Site);
    }

    #[test]
    fn ready_peeks_without_taking() {
        let limiter = limiter(2.0, 2.0, 100);
        let start = Instant::now();
        assert!(limiter.ready_at(&1, start).is_ok());
        assert!(limiter.is_empty(), "a peek adds no key");
        for _ in 0..2 {
            assert!(limiter.check_at(&1, start).is_ok());
        }
        let refused = limiter.ready_at(&1, start).unwrap_err();
        assert_eq!(refused.next_token(), Duration::from_millis(500));
        assert!(
            limiter
                .ready_at(&1, start + Duration::from_millis(500))
                .is_ok()
        );
        assert!(
            limiter
                .check_at(&1, start + Duration::from_millis(500))
                .is_ok()
        );
    }

    #[test]
    fn addresses_count_as_ipv4_addresses_and_ipv6_64s() {
        let key = |ip: &str| address_key(ip.parse().unwrap());
        assert_eq!(key("192.0.2.7"), key("192.0.2.7"));
        assert_ne!(key("192.0.2.7"), key("192.0.2.8"));
        assert_eq!(key("::ffff:192.0.2.7"), key("192.0.2.7"));
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_eq!(
            key("2001:db8:1:2::1"),
            "2001:db8:1:2::".parse::<IpAddr>().unwrap()
        );
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
    }

    #[test]
    fn the_64s_of_one_48_share_its_budget_and_leave_others_their_refusals() {
        let rate = Rate::new(1.0, 2.0).unwrap();
        let limiter = AddressLimiter::new(rate, 1000);
        let start = Instant::now();
        // Another sender, out of its budget: refused.
        let other: IpAddr = "2001:db8:ffff:1::1".parse().unwrap();
        while limiter.check_at(other, start).is_ok() {}
        // One host walking through the /64s of its /48.
        let accepted = (0..65_536u128)
            .filter(|n| {
                let ip = IpAddr::V6(Ipv6Addr::from(
                    u128::from("2001:db8:1::1".parse::<Ipv6Addr>().unwrap()) | (n << 64),
                ));
                limiter.check_at(ip, start).is_ok()
            })
            .count();
        assert_eq!(accepted as f64, rate.burst * SITE_HOSTS, "the /48's burst");
        // The other sender's host and site, the /48's and its first 32 /64s.
        assert_eq!(limiter.len(), 2 + 1 + 32);
        assert!(
            limiter.check_at(other, start).is_err(),
            "the other sender's refusal stays"
        );
        // IPv4 is limited by address alone.
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        assert!(limiter.check_at(v4, start).is_ok());
        assert!(
            limiter
                .check_at("192.0.2.8".parse().unwrap(), start)
                .is_ok()
        );
    }

    #[test]
    fn memory_stays_bounded_under_many_fresh_keys() {
        let limiter = limiter(1.0, 5.0, 1000);
        let start = Instant::now();
        for key in 0..100_000u64 {
            let now = start + Duration::from_micros(key);
            assert!(limiter.check_at(&key, now).is_ok());
            assert!(limiter.len() <= 1000 + SHARDS, "{} keys", limiter.len());
        }
        // The count kept as buckets come and go is what the shards hold.
        let held: usize = limiter
            .shards
            .iter()
            .map(|s| s.lock().unwrap().buckets.len())
            .sum();
        assert_eq!(limiter.len(), held);
    }
}
