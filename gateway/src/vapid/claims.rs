//! What a verified token must say, and the time rules shared with the cache.
//!
//! RFC 8292 keeps VAPID tokens short-lived and bound to one push service so that a
//! token leaked from one request cannot be replayed for long, or against another
//! service: `aud` must be our origin exactly, and `exp` at most 24 hours ahead.

use serde_json::{Map, Value};

use super::VapidError;

/// Tolerated clock difference between sender and service, applied to both ends of the
/// `exp` window. On the far end it matters more than it seems: py_vapid sets `exp` to
/// exactly now + 24 h by default, so a sender whose clock runs a second ahead of ours
/// would otherwise be refused.
pub(super) const CLOCK_SKEW_SECS: u64 = 60;
/// RFC 8292 §2: `exp` MUST NOT be more than 24 hours from the time of the request.
pub(super) const MAX_LIFETIME_SECS: u64 = 24 * 60 * 60;

/// The claims the rest of the service uses, once checked.
#[derive(Debug, PartialEq)]
pub(super) struct CheckedClaims {
    pub(super) exp: u64,
    pub(super) sub: Option<String>,
}

/// Checks `aud`, `exp` and `sub` of an already signature-checked token.
pub(super) fn check(
    claims: &Map<String, Value>,
    audience: &str,
    now: u64,
) -> Result<CheckedClaims, VapidError> {
    match claims.get("aud") {
        None | Some(Value::Null) => return Err(VapidError::MissingAud),
        // Exact comparison: an origin differing in scheme, port or by a path is another
        // audience, and normalising here would only hide sender bugs.
        Some(Value::String(aud)) if aud == audience => {}
        Some(_) => {
            return Err(VapidError::WrongAud {
                expected: audience.to_owned(),
            });
        }
    }

    let exp = match claims.get("exp") {
        None | Some(Value::Null) => return Err(VapidError::MissingExp),
        Some(Value::Number(exp)) => numeric_date(exp),
        Some(_) => return Err(VapidError::InvalidExp),
    };
    check_exp(exp, now)?;

    let sub = match claims.get("sub") {
        None | Some(Value::Null) => None,
        Some(Value::String(sub)) => {
            // The contact is for operators chasing a misbehaving sender; an odd one is
            // worth a warning, not a refused push. `?` escapes it for the log line.
            if !has_scheme(sub, "mailto:") && !has_scheme(sub, "https:") {
                tracing::warn!(sub = ?sub, "VAPID `sub` is neither a mailto: nor an https: URI");
            }
            Some(sub.clone())
        }
        Some(_) => {
            tracing::warn!("VAPID `sub` is not a string; ignoring it");
            None
        }
    };
    Ok(CheckedClaims { exp, sub })
}

/// Whether a token expiring at `exp` is usable at `now`; used on every call, including
/// cache hits, because a cached token ages like any other.
pub(super) fn check_exp(exp: u64, now: u64) -> Result<(), VapidError> {
    if is_expired(exp, now) {
        return Err(VapidError::Expired);
    }
    if exp > now.saturating_add(MAX_LIFETIME_SECS + CLOCK_SKEW_SECS) {
        return Err(VapidError::ExpTooFar);
    }
    Ok(())
}

/// `exp` is in the past, beyond the skew allowance.
pub(super) fn is_expired(exp: u64, now: u64) -> bool {
    exp.saturating_add(CLOCK_SKEW_SECS) < now
}

/// A JWT NumericDate may have a fraction (RFC 7519 §2); whole seconds are plenty. A
/// negative date is long past, so it becomes 0 and fails as expired.
fn numeric_date(exp: &serde_json::Number) -> u64 {
    exp.as_u64().unwrap_or_else(|| {
        let seconds = exp.as_f64().unwrap_or(0.0);
        // `as` saturates: huge values become u64::MAX (too far), negatives 0 (expired).
        seconds as u64
    })
}

/// URI schemes are case-insensitive (`MAILTO:` is a mailto URI).
fn has_scheme(uri: &str, scheme: &str) -> bool {
    uri.get(..scheme.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(scheme))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const AUD: &str = "http://localhost:8082";
    const NOW: u64 = 1_700_000_000;

    fn check_json(claims: Value) -> Result<CheckedClaims, VapidError> {
        let Value::Object(claims) = claims else {
            panic!("test claims must be an object");
        };
        check(&claims, AUD, NOW)
    }

    #[test]
    fn exp_window_edges() {
        assert_eq!(check_exp(NOW - CLOCK_SKEW_SECS, NOW), Ok(()));
        assert_eq!(
            check_exp(NOW - CLOCK_SKEW_SECS - 1, NOW),
            Err(VapidError::Expired)
        );
        assert_eq!(check_exp(NOW + MAX_LIFETIME_SECS, NOW), Ok(()));
        assert_eq!(
            check_exp(NOW + MAX_LIFETIME_SECS + CLOCK_SKEW_SECS + 1, NOW),
            Err(VapidError::ExpTooFar)
        );
    }

    #[test]
    fn fractional_and_negative_exp() {
        let checked = check_json(json!({"aud": AUD, "exp": (NOW + 10) as f64 + 0.5}));
        assert_eq!(checked.map(|c| c.exp), Ok(NOW + 10));
        assert_eq!(
            check_json(json!({"aud": AUD, "exp": -5})),
            Err(VapidError::Expired)
        );
        assert_eq!(
            check_json(json!({"aud": AUD, "exp": 1e300})),
            Err(VapidError::ExpTooFar)
        );
    }

    #[test]
    fn non_string_aud_and_sub() {
        assert_eq!(
            check_json(json!({"aud": [AUD], "exp": NOW + 60})),
            Err(VapidError::WrongAud {
                expected: AUD.to_owned()
            })
        );
        assert_eq!(
            check_json(json!({"aud": null, "exp": NOW + 60})),
            Err(VapidError::MissingAud)
        );
        let checked = check_json(json!({"aud": AUD, "exp": NOW + 60, "sub": 42}));
        assert_eq!(checked.map(|c| c.sub), Ok(None));
    }

    #[test]
    fn sub_scheme_is_case_insensitive_and_odd_sub_is_kept() {
        assert!(has_scheme("MAILTO:ops@example.com", "mailto:"));
        assert!(has_scheme("https://example.com", "https:"));
        assert!(!has_scheme("ops@example.com", "mailto:"));
        assert!(!has_scheme("é", "mailto:"));
        let checked = check_json(json!({"aud": AUD, "exp": NOW + 60, "sub": "ops@example.com"}));
        assert_eq!(
            checked.map(|c| c.sub),
            Ok(Some("ops@example.com".to_owned()))
        );
    }
}
