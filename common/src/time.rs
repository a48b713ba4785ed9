//! Wall-clock helpers. Storage and message ids speak in Unix time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

fn since_epoch() -> std::time::Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> u64 {
    since_epoch().as_secs()
}

/// Milliseconds since the Unix epoch.
pub fn now_millis() -> u64 {
    since_epoch().as_millis() as u64
}

/// Microseconds since the Unix epoch, strictly increasing within this process.
///
/// Stored messages are keyed by this value, so two messages for the same
/// channel arriving in the same microsecond must still get distinct keys.
pub fn unique_micros() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = since_epoch().as_micros() as u64;
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last + 1);
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// The milliseconds a hidden test variable `name` sets, if it does: the
/// end-to-end tests shorten or lengthen a node's waits with these (not
/// settings).
pub fn test_millis(name: &str) -> Option<std::time::Duration> {
    let ms = std::env::var(name).ok()?.parse().ok()?;
    Some(std::time::Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    #[test]
    fn unique_micros_never_repeats() {
        let mut prev = 0;
        for _ in 0..10_000 {
            let t = super::unique_micros();
            assert!(t > prev);
            prev = t;
        }
    }
}
