//! What every bridge router (APNs, FCM, GCM) shares, so each one only says
//! how to talk to its upstream and how to read its answers:
//!
//! * [`RetryPolicy`] and [`with_retries`]: a deadline per push and bounded
//!   retries with exponential backoff and full jitter, honouring the
//!   upstream's `Retry-After`.
//! * [`InFlight`]: a cap on requests in flight per app, so one slow app
//!   cannot take every task of the node; beyond it the sender gets 503.
//! * [`AppLimits`]: a rate per app (`--bridge-app-limit`), so one app
//!   server cannot spend a project's FCM quota or an APNs connection for
//!   the others; beyond it the sender gets 429.
//! * [`upstream_too_many`]: the upstream's own "too many requests" becomes
//!   a 429 for the sender, with its `Retry-After` clamped to
//!   [`UPSTREAM_RETRY_AFTER_RANGE`].
//! * [`CredentialAlarm`]: one loud log line when an upstream refuses our
//!   credentials, not one per push.
//! * [`mask_token`]: how a device token may appear in logs and `diagnose`;
//!   [`crate::router::mask_tokens`] applies it to a bridge user's `router_data`.
//! * [`Bridge`]: what a bridge's settings section builds for the gateway.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use uuid::Uuid;

use crate::Notification;
use crate::errors::retry_after_secs;
use crate::limit::{Limiter, Rate};
use crate::limit_headers::RateLimit;
use crate::router::RouterError;

/// How long and how often a bridge tries one push.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts: u32,
    /// Backoff before the second attempt; doubled before each later one.
    pub base_delay: Duration,
    /// Longest wait between two attempts.
    pub max_delay: Duration,
    /// The whole push, every attempt and wait included, ends by then.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            deadline: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The wait before attempt `attempt + 1` (so `attempt` >= 1): full jitter
    /// over the exponential step, but never less than the upstream asked for.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let step = self
            .base_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(16))
            .min(self.max_delay);
        let jittered = step.mul_f64(fastrand::f64());
        jittered.max(retry_after.unwrap_or_default())
    }
}

/// How one attempt ended, as the bridge reads its upstream's answer.
#[derive(Debug)]
pub enum Attempt<T> {
    Done(T),
    /// Worth another try (429, 5xx, connection refused). `error` is what the
    /// sender gets if no try is left.
    Retry {
        error: RouterError,
        retry_after: Option<Duration>,
    },
    /// Final: retrying cannot help.
    Fail(RouterError),
}

/// Run `attempt` (given the attempt number, from 1) until it is done, fails
/// for good, runs out of tries, or the deadline passes ([`RouterError::Timeout`]).
/// A wait that would end past the deadline is not started: the last error
/// is returned at once, with the upstream's `Retry-After` when it gave one.
pub async fn with_retries<T, F, Fut>(policy: &RetryPolicy, mut attempt: F) -> Result<T, RouterError>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Attempt<T>>,
{
    let deadline = Instant::now() + policy.deadline;
    let mut number = 1;
    loop {
        let outcome = match tokio::time::timeout_at(deadline, attempt(number)).await {
            Ok(outcome) => outcome,
            Err(_) => return Err(RouterError::Timeout),
        };
        match outcome {
            Attempt::Done(value) => return Ok(value),
            Attempt::Fail(error) => return Err(error),
            Attempt::Retry { error, retry_after } => {
                if number >= policy.attempts.max(1) {
                    return Err(error);
                }
                let wait = policy.delay(number, retry_after);
                // (Compared this way, an upstream's absurd Retry-After
                // cannot overflow the clock.)
                if wait >= deadline.saturating_duration_since(Instant::now()) {
                    return Err(error);
                }
                tokio::time::sleep(wait).await;
                number += 1;
            }
        }
    }
}

/// A cap on one app's requests in flight.
#[derive(Clone, Debug)]
pub struct InFlight {
    permits: Arc<Semaphore>,
    retry_after: Duration,
}

impl InFlight {
    /// At most `limit` requests at once; beyond it the sender is told to come
    /// back after `retry_after`.
    pub fn new(limit: usize, retry_after: Duration) -> Self {
        InFlight {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            retry_after,
        }
    }

    /// A slot, held until the permit is dropped, or
    /// [`RouterError::Unavailable`] when every slot is taken.
    pub fn try_acquire(&self) -> Result<OwnedSemaphorePermit, RouterError> {
        self.permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| RouterError::Unavailable {
                retry_after: self.retry_after,
            })
    }
}

/// The per-app rate of every bridge (`--bridge-app-limit`): each configured
/// app (APNs release channel, FCM app, GCM sender id) may send this many
/// pushes a second upstream. One limiter serves every bridge, keyed by
/// bridge and app; only configured apps are ever counted, so its keys are
/// bounded by the settings.
#[derive(Clone, Default)]
pub struct AppLimits {
    /// `None`: no limit.
    limiter: Option<Arc<Limiter<String>>>,
}

impl AppLimits {
    /// `rate` per app (`None`: no limit), tracking at most `max_keys` apps.
    pub fn new(rate: Option<Rate>, max_keys: usize) -> AppLimits {
        AppLimits {
            limiter: rate.map(|rate| Arc::new(Limiter::new(rate, max_keys))),
        }
    }

    /// The share of configured app `app` of `bridge` (`apns`, `fcm`, `gcm`).
    pub fn app(&self, bridge: &str, app: &str) -> AppLimit {
        AppLimit {
            limiter: self.limiter.clone(),
            key: format!("{bridge}/{app}"),
        }
    }
}

/// One app's rate, held by the bridge's app (or channel) for its life.
#[derive(Clone)]
pub struct AppLimit {
    limiter: Option<Arc<Limiter<String>>>,
    key: String,
}

impl AppLimit {
    /// A token for one push upstream, or [`RouterError::TooManyRequests`]
    /// (429 `bridge app` for the sender, counted as
    /// `rate_limit.refused{limit="bridge_app"}`) naming the app's bucket,
    /// with the wait until its next token.
    pub fn check(&self) -> Result<(), RouterError> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        limiter
            .take_counted(&self.key, "bridge_app")
            .map(drop)
            .map_err(|refused| RouterError::TooManyRequests {
                what: "bridge app",
                limit: RateLimit::refused("bridge_app", refused),
            })
    }
}

/// What a sender is told to wait when the upstream said "too many
/// requests" (FCM's 429 `RESOURCE_EXHAUSTED`, APNs' 429 `TooManyRequests`)
/// without saying for how long.
pub const UPSTREAM_RETRY_AFTER_DEFAULT: Duration = Duration::from_secs(30);

/// The range an upstream's own `Retry-After` is clamped to before a sender
/// is told: at least a second (`0` invites a storm), at most an hour.
pub const UPSTREAM_RETRY_AFTER_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));

/// `Retry-After` for a sender whose push the upstream refused as too many:
/// the upstream's value clamped to [`UPSTREAM_RETRY_AFTER_RANGE`], or
/// [`UPSTREAM_RETRY_AFTER_DEFAULT`] when it gave none.
pub fn upstream_retry_after(given: Option<Duration>) -> Duration {
    let (min, max) = UPSTREAM_RETRY_AFTER_RANGE;
    given.map_or(UPSTREAM_RETRY_AFTER_DEFAULT, |wait| wait.clamp(min, max))
}

/// The upstream said "too many requests": the sender gets 429 (`bridge`)
/// with [`upstream_retry_after`], under the `upstream` policy.
pub fn upstream_too_many(given: Option<Duration>) -> RouterError {
    RouterError::TooManyRequests {
        what: "bridge",
        limit: RateLimit::upstream(retry_after_secs(upstream_retry_after(given))),
    }
}

/// Logs an upstream's refusal of our credentials once per outage, loudly,
/// naming the app, instead of once per push.
#[derive(Debug, Default)]
pub struct CredentialAlarm {
    raised: AtomicBool,
}

impl CredentialAlarm {
    /// The upstream refused us: log `detail` if this is news.
    pub fn raise(&self, bridge: &str, app: &str, detail: &str) {
        if !self.raised.swap(true, Ordering::Relaxed) {
            tracing::error!(
                bridge,
                app,
                detail,
                "the bridge refused our credentials: every push for this app fails with 502/901 until they are fixed"
            );
        }
    }

    /// The upstream accepted us again: a later refusal is news again.
    pub fn clear(&self, bridge: &str, app: &str) {
        if self.raised.swap(false, Ordering::Relaxed) {
            tracing::warn!(bridge, app, "the bridge accepts our credentials again");
        }
    }
}

/// The fields every bridged Web Push notification carries to the app:
/// `body` (the ciphertext, base64url) with the encryption headers it needs,
/// `con` (`Content-Encoding`), `enc` (`Encryption`) and `cryptokey`
/// (`Crypto-Key`), or `content_type` (`application/webpush-message`, a body
/// that says how it is encrypted itself), when the notification has a body. Bridges add their own
/// identification keys (`chid`, `ver`...); the mailbox lists the same.
/// Borrowed: the body is kilobytes, written once, where the bridge's
/// request is made.
pub fn web_push_fields(notification: &Notification) -> BTreeMap<&'static str, &str> {
    let mut data = BTreeMap::new();
    let Some(body) = notification.data.as_deref().filter(|b| !b.is_empty()) else {
        return data;
    };
    data.insert("body", body);
    let headers = notification.headers.as_ref();
    for (key, header_name) in [
        ("con", "encoding"),
        ("enc", "encryption"),
        ("cryptokey", "crypto_key"),
        ("content_type", "content_type"),
    ] {
        if let Some(value) = headers.and_then(|h| h.get(header_name)) {
            data.insert(key, value.as_str());
        }
    }
    data
}

/// Appends `text` to `out` as a JSON string, as serde_json writes it. A
/// push's body is base64url, with nothing to escape: checked without a branch
/// per byte (so many bytes at a time) and copied, it skips serde_json's escape
/// scan byte by byte, which was most of what a bridged push's JSON cost.
pub fn write_json_str(out: &mut Vec<u8>, text: &str) -> serde_json::Result<()> {
    let escapes = text.bytes().fold(false, |any, b| {
        any | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if escapes {
        return serde_json::to_writer(out, text);
    }
    out.reserve(text.len() + 2);
    out.push(b'"');
    out.extend_from_slice(text.as_bytes());
    out.push(b'"');
    Ok(())
}

/// Appends `id` to `out` as a JSON string, as serde writes a `Uuid`
/// (hyphenated, lower case).
pub fn write_json_uuid(out: &mut Vec<u8>, id: &Uuid) {
    out.push(b'"');
    let mut buffer = Uuid::encode_buffer();
    out.extend_from_slice(id.hyphenated().encode_lower(&mut buffer).as_bytes());
    out.push(b'"');
}

/// Appends `members` to `out` as a JSON object's members, `"key":"value"`
/// separated by commas, each string as [`write_json_str`] writes it.
pub fn write_json_members<'a>(
    out: &mut Vec<u8>,
    members: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> serde_json::Result<()> {
    for (i, (key, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_json_str(out, key)?;
        out.push(b':');
        write_json_str(out, value)?;
    }
    Ok(())
}

/// A device token as it may be shown: its first and last four characters.
pub fn mask_token(token: &str) -> String {
    let chars: Vec<char> = token.chars().collect();
    if chars.len() <= 12 {
        return "*".repeat(chars.len());
    }
    let head: String = chars[..4].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}…{tail} ({} chars)", chars.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn quick(attempts: u32) -> RetryPolicy {
        RetryPolicy {
            attempts,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
            deadline: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn retries_until_done() {
        let calls = AtomicU32::new(0);
        let result = with_retries(&quick(3), |n| {
            calls.fetch_add(1, Ordering::Relaxed);
            async move {
                if n < 3 {
                    Attempt::Retry {
                        error: RouterError::Connect("refused".into()),
                        retry_after: None,
                    }
                } else {
                    Attempt::Done(n)
                }
            }
        })
        .await;
        assert_eq!(result, Ok(3));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn gives_the_last_error_when_tries_run_out() {
        let calls = AtomicU32::new(0);
        let result: Result<(), _> = with_retries(&quick(2), |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            async {
                Attempt::Retry {
                    error: RouterError::Upstream("503".into()),
                    retry_after: None,
                }
            }
        })
        .await;
        assert_eq!(result, Err(RouterError::Upstream("503".into())));
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn final_errors_are_not_retried() {
        let calls = AtomicU32::new(0);
        let result: Result<(), _> = with_retries(&quick(5), |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            async { Attempt::Fail(RouterError::DeviceGone) }
        })
        .await;
        assert_eq!(result, Err(RouterError::DeviceGone));
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_retry_after_past_the_deadline_ends_at_once() {
        let policy = RetryPolicy {
            deadline: Duration::from_secs(1),
            ..quick(5)
        };
        let calls = AtomicU32::new(0);
        let unavailable = RouterError::Unavailable {
            retry_after: Duration::from_secs(30),
        };
        let result: Result<(), _> = with_retries(&policy, |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            let error = unavailable.clone();
            async move {
                Attempt::Retry {
                    error,
                    retry_after: Some(Duration::from_secs(30)),
                }
            }
        })
        .await;
        assert_eq!(result, Err(unavailable));
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_stalled_upstream_times_out() {
        let policy = RetryPolicy {
            deadline: Duration::from_millis(50),
            ..quick(3)
        };
        let result: Result<(), _> = with_retries(&policy, |_| async {
            std::future::pending::<Attempt<()>>().await
        })
        .await;
        assert_eq!(result, Err(RouterError::Timeout));
    }

    #[test]
    fn delay_grows_is_capped_and_honours_retry_after() {
        let policy = RetryPolicy {
            attempts: 10,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(400),
            deadline: Duration::from_secs(10),
        };
        for attempt in 1..10 {
            assert!(policy.delay(attempt, None) <= Duration::from_millis(400));
        }
        assert!(policy.delay(1, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
    }

    #[test]
    fn in_flight_refuses_beyond_the_cap() {
        let cap = InFlight::new(1, Duration::from_secs(7));
        let held = cap.try_acquire().unwrap();
        assert_eq!(
            cap.try_acquire().unwrap_err(),
            RouterError::Unavailable {
                retry_after: Duration::from_secs(7)
            }
        );
        drop(held);
        assert!(cap.try_acquire().is_ok());
    }

    #[tokio::test]
    async fn an_absurd_retry_after_ends_at_once() {
        let result: Result<(), _> = with_retries(&quick(3), |_| async {
            Attempt::Retry {
                error: upstream_too_many(Some(Duration::MAX)),
                retry_after: Some(Duration::MAX),
            }
        })
        .await;
        assert_eq!(
            result,
            Err(RouterError::TooManyRequests {
                what: "bridge",
                limit: RateLimit::upstream(3600)
            })
        );
    }

    #[test]
    fn upstream_retry_after_is_clamped_with_a_default() {
        let secs = |s| upstream_retry_after(Some(Duration::from_secs(s))).as_secs();
        assert_eq!((secs(0), secs(60), secs(86_400)), (1, 60, 3600));
        assert_eq!(upstream_retry_after(None), UPSTREAM_RETRY_AFTER_DEFAULT);
    }

    #[test]
    fn each_app_has_its_own_rate_and_none_means_no_limit() {
        let limits = AppLimits::new(Rate::new(0.001, 2.0), 100);
        let (fcm, gcm) = (limits.app("fcm", "a"), limits.app("gcm", "a"));
        assert!(fcm.check().is_ok() && fcm.check().is_ok());
        let Err(RouterError::TooManyRequests { what, limit }) = fcm.check() else {
            panic!("the third push is over the rate");
        };
        assert_eq!(what, "bridge app");
        assert_eq!(
            (limit.policy, limit.quota, limit.window, limit.remaining),
            ("bridge_app", 2, Some(2000), 0)
        );
        assert!(limit.reset > 100, "{limit:?}");
        assert!(gcm.check().is_ok(), "another bridge's app of the same name");
        let off = AppLimits::default().app("fcm", "a");
        assert!((0..1000).all(|_| off.check().is_ok()));
    }

    #[test]
    fn tokens_are_masked() {
        let token = "a1b2c3d4e5f60718293a4b5c6d7e8f90";
        let masked = mask_token(token);
        assert!(masked.starts_with("a1b2") && masked.contains("8f90"));
        assert!(!masked.contains("c3d4e5f6"));
        assert_eq!(mask_token("short"), "*****");
    }

    #[test]
    fn json_strings_are_written_as_serde_json_writes_them() {
        let base64url = "AAEC-_09azAZ".repeat(300);
        let escaped_at_the_end = format!("{base64url}\"");
        for text in [
            "",
            &base64url,
            &escaped_at_the_end,
            "quote \" backslash \\ tab \t nul \u{0} del \u{7f} é",
        ] {
            let mut out = b"x".to_vec();
            write_json_str(&mut out, text).unwrap();
            let mut expected = b"x".to_vec();
            serde_json::to_writer(&mut expected, text).unwrap();
            assert_eq!(out, expected, "{text:?}");
        }
    }
}
