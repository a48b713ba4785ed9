//! A limit as an answer tells it, in the IETF `RateLimit-Policy` and
//! `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers): a push's 201
//! names the limit it stands closest to, and every 429 the limit that
//! refused it, so a sender reads each limit the same way.

use http::{HeaderMap, HeaderValue};

use crate::errors::retry_after_secs;
use crate::limit::Standing;

/// `RateLimit-Policy: "policy";q=QUOTA[;w=WINDOW]` and
/// `RateLimit: "policy";r=REMAINING;t=RESET`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// The limit's name (`sender`, `source_ip`, `bridge_app`, `mailbox`...).
    pub policy: &'static str,
    /// `q`: the requests the limit lets pass at once.
    pub quota: u64,
    /// `w`: the seconds over which the quota comes back; `None` for a
    /// bound that time does not empty (a mailbox empties as its app
    /// fetches).
    pub window: Option<u64>,
    /// `r`: the requests that may still pass at once.
    pub remaining: u64,
    /// `t`: whole seconds before another may pass; on a refusal, the
    /// `Retry-After`.
    pub reset: u64,
}

impl RateLimit {
    /// A token bucket's, where a request that passed left it: its burst
    /// over the whole seconds it takes to refill from empty (its sustained
    /// rate is q/w), and the seconds, rounded down, within which no more
    /// than `r` can pass.
    pub fn passed(policy: &'static str, standing: Standing) -> Self {
        RateLimit {
            reset: standing.next_token().as_secs(),
            ..Self::bucket(policy, standing)
        }
    }

    /// A token bucket's that refused a request: `t` the wait until its
    /// next token, rounded up, as `Retry-After` says it.
    pub fn refused(policy: &'static str, standing: Standing) -> Self {
        RateLimit {
            reset: retry_after_secs(standing.next_token()),
            ..Self::bucket(policy, standing)
        }
    }

    fn bucket(policy: &'static str, standing: Standing) -> Self {
        let rate = standing.rate;
        RateLimit {
            policy,
            quota: rate.burst.floor() as u64,
            window: Some(((rate.burst / rate.per_second).round() as u64).max(1)),
            remaining: standing.remaining(),
            reset: 0,
        }
    }

    /// A bound of `quota` messages that is full (a mailbox, a hold): no
    /// window, since time does not empty it, and `retry_after` seconds to
    /// wait.
    pub fn full(policy: &'static str, quota: usize, retry_after: u64) -> Self {
        RateLimit {
            policy,
            quota: quota as u64,
            window: None,
            remaining: 0,
            reset: retry_after,
        }
    }

    /// An upstream's (APNs', FCM's) "too many requests": its quota is not
    /// known, only that none passes for `retry_after` seconds.
    pub fn upstream(retry_after: u64) -> Self {
        RateLimit {
            policy: "upstream",
            quota: 0,
            window: Some(retry_after),
            remaining: 0,
            reset: retry_after,
        }
    }

    /// Write both headers.
    pub fn add_headers(&self, headers: &mut HeaderMap) {
        let RateLimit {
            policy,
            quota,
            window,
            remaining,
            reset,
        } = *self;
        let window = window.map(|w| format!(";w={w}")).unwrap_or_default();
        let policy_value = format!("\"{policy}\";q={quota}{window}");
        let limit_value = format!("\"{policy}\";r={remaining};t={reset}");
        for (name, value) in [
            ("ratelimit-policy", policy_value),
            ("ratelimit", limit_value),
        ] {
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.insert(name, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Rate;

    fn headers(limit: RateLimit) -> (String, String) {
        let mut out = HeaderMap::new();
        limit.add_headers(&mut out);
        let text = |name: &str| out[name].to_str().unwrap().to_owned();
        (text("ratelimit-policy"), text("ratelimit"))
    }

    fn pair(policy: &str, limit: &str) -> (String, String) {
        (policy.to_owned(), limit.to_owned())
    }

    #[test]
    fn a_bucket_names_its_burst_and_where_it_stands() {
        let standing = Standing {
            tokens: 9957.4,
            rate: Rate::new(1000.0, 10_000.0).unwrap(),
        };
        assert_eq!(
            headers(RateLimit::passed("sender", standing)),
            pair(r#""sender";q=10000;w=10"#, r#""sender";r=9957;t=0"#)
        );
    }

    #[test]
    fn a_refusal_waits_as_long_as_retry_after_says() {
        // Three quarters of a token short at a token every 100 s.
        let standing = Standing {
            tokens: 0.25,
            rate: Rate::new(0.01, 3.0).unwrap(),
        };
        assert_eq!(
            headers(RateLimit::refused("source_ip", standing)),
            pair(r#""source_ip";q=3;w=300"#, r#""source_ip";r=0;t=75"#)
        );
        // A wait of a fraction of a second is a second, never 0.
        let standing = Standing {
            tokens: 0.9,
            rate: Rate::new(1.0, 3.0).unwrap(),
        };
        let refused = RateLimit::refused("sender", standing);
        assert_eq!(refused.reset, retry_after_secs(standing.next_token()));
        assert_eq!(refused.reset, 1);
    }

    #[test]
    fn a_full_bound_has_no_window_and_an_upstream_no_quota() {
        assert_eq!(
            headers(RateLimit::full("mailbox", 100, 60)),
            pair(r#""mailbox";q=100"#, r#""mailbox";r=0;t=60"#)
        );
        assert_eq!(
            headers(RateLimit::upstream(30)),
            pair(r#""upstream";q=0;w=30"#, r#""upstream";r=0;t=30"#)
        );
    }
}
