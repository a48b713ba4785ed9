//! Finding the JWT and the public key in the request headers.
//!
//! Three styles are in use, because VAPID changed shape while senders were shipping:
//!
//! * RFC 8292: `Authorization: vapid t=<jwt>, k=<key>` — everything in one header;
//! * draft VAPID: `Authorization: WebPush <jwt>` with `Crypto-Key: p256ecdsa=<key>`;
//! * the same with `Bearer` (an even earlier draft, still sent by old libraries).
//!
//! `Crypto-Key` was shared with the `aesgcm` content encoding, so it often carries other
//! parts too (`dh=...;p256ecdsa=...`), separated by `;` or `,`, sometimes quoted.
//! Parsing is deliberately lenient about this syntax: it cannot weaken anything, since
//! whatever is extracted still has to pass the signature check.
//!
//! Nothing is decoded here; the key's encoding is [`super::jws`]'s business. Keeping
//! the header text as-is also lets the cache key on it without any decoding.

use super::VapidError;

/// The token and key exactly as found in the headers (trimmed and unquoted).
#[derive(Debug, PartialEq)]
pub(super) struct Credentials<'a> {
    pub(super) token: &'a str,
    pub(super) key: &'a str,
}

/// `Ok(None)` when there is no `Authorization` header, or a blank one: no VAPID claim
/// was made. A `Crypto-Key` alone proves nothing (and is often there only for
/// `aesgcm`), so it is ignored in that case.
pub(super) fn parse<'a>(
    authorization: Option<&'a str>,
    crypto_key: Option<&'a str>,
) -> Result<Option<Credentials<'a>>, VapidError> {
    let Some(authorization) = authorization.map(str::trim).filter(|a| !a.is_empty()) else {
        return Ok(None);
    };
    let (scheme, rest) = authorization
        .split_once(|c: char| c.is_ascii_whitespace())
        .unwrap_or((authorization, ""));
    let rest = rest.trim();

    if scheme.eq_ignore_ascii_case("vapid") {
        let token = auth_param(rest, "t").ok_or(VapidError::MissingToken)?;
        let key = auth_param(rest, "k").ok_or(VapidError::MissingKey)?;
        Ok(Some(Credentials { token, key }))
    } else if scheme.eq_ignore_ascii_case("webpush") || scheme.eq_ignore_ascii_case("bearer") {
        let token = unquote(rest);
        if token.is_empty() {
            return Err(VapidError::MissingToken);
        }
        let key = crypto_key
            .and_then(|value| {
                let parts = value.split(';').flat_map(|part| part.split(','));
                key_value_param(parts, "p256ecdsa")
            })
            .ok_or(VapidError::MissingKey)?;
        Ok(Some(Credentials { token, key }))
    } else {
        // Another scheme (Basic, a foreign bearer...) is a claim we cannot check;
        // answering Ok(None) would quietly downgrade it to "no VAPID at all".
        Err(VapidError::UnknownScheme)
    }
}

/// An RFC 7235 auth-param of `vapid`: `t=..., k=...` in any order.
fn auth_param<'a>(params: &'a str, name: &str) -> Option<&'a str> {
    key_value_param(params.split(','), name)
}

/// The first non-empty `name=value` among `parts`; names are case-insensitive and
/// whitespace around parts, names and values is ignored. Splitting at the first `=`
/// keeps base64 padding in the value. (Callers split on one character at a time: that
/// search is a fast byte scan, where a set of characters is matched char by char.)
fn key_value_param<'a>(parts: impl Iterator<Item = &'a str>, name: &str) -> Option<&'a str> {
    parts
        .filter_map(|part| part.split_once('='))
        .find(|(key, _)| key.trim().eq_ignore_ascii_case(name))
        .map(|(_, value)| unquote(value.trim()))
        .filter(|value| !value.is_empty())
}

fn unquote(value: &str) -> &str {
    value
        .strip_prefix('"')
        .and_then(|inner| inner.strip_suffix('"'))
        .unwrap_or(value)
        .trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds<'a>(token: &'a str, key: &'a str) -> Option<Credentials<'a>> {
        Some(Credentials { token, key })
    }

    #[test]
    fn absent_or_blank_authorization_is_no_credentials() {
        assert_eq!(parse(None, None), Ok(None));
        assert_eq!(parse(None, Some("p256ecdsa=KEY")), Ok(None));
        assert_eq!(parse(Some("  "), Some("p256ecdsa=KEY")), Ok(None));
    }

    #[test]
    fn vapid_params_in_any_order_and_spacing() {
        for header in [
            "vapid t=TOK,k=KEY",
            "vapid t=TOK, k=KEY",
            "VAPID k=KEY, t=TOK",
            "Vapid  k = \"KEY\" ,t=TOK ",
            "vapid t=TOK, k=KEY, extra=ignored",
        ] {
            assert_eq!(
                parse(Some(header), None),
                Ok(creds("TOK", "KEY")),
                "{header}"
            );
        }
    }

    #[test]
    fn vapid_without_t_or_k() {
        assert_eq!(
            parse(Some("vapid k=KEY"), None),
            Err(VapidError::MissingToken)
        );
        assert_eq!(parse(Some("vapid"), None), Err(VapidError::MissingToken));
        assert_eq!(
            parse(Some("vapid t=TOK"), None),
            Err(VapidError::MissingKey)
        );
        assert_eq!(
            parse(Some("vapid t=TOK, k="), None),
            Err(VapidError::MissingKey)
        );
    }

    #[test]
    fn draft_schemes_take_the_key_from_crypto_key() {
        for scheme in ["WebPush", "webpush", "Bearer", "bearer"] {
            let header = format!("{scheme} TOK");
            assert_eq!(
                parse(Some(&header), Some("p256ecdsa=KEY")),
                Ok(creds("TOK", "KEY"))
            );
        }
    }

    #[test]
    fn crypto_key_with_several_parts_and_quotes() {
        for crypto_key in [
            "dh=DH;p256ecdsa=KEY",
            "dh=\"DH\"; p256ecdsa=\"KEY\"",
            "keyid=p256dh, P256ECDSA=KEY",
            "p256ecdsa=KEY;dh=DH",
        ] {
            assert_eq!(
                parse(Some("WebPush TOK"), Some(crypto_key)),
                Ok(creds("TOK", "KEY")),
                "{crypto_key}"
            );
        }
        // Padding survives: only the first `=` separates name and value.
        assert_eq!(
            parse(Some("WebPush TOK"), Some("dh=DH;p256ecdsa=KE==")),
            Ok(creds("TOK", "KE=="))
        );
    }

    #[test]
    fn draft_schemes_without_key_or_token() {
        assert_eq!(
            parse(Some("WebPush TOK"), None),
            Err(VapidError::MissingKey)
        );
        assert_eq!(
            parse(Some("WebPush TOK"), Some("dh=DH")),
            Err(VapidError::MissingKey)
        );
        assert_eq!(
            parse(Some("WebPush"), Some("p256ecdsa=KEY")),
            Err(VapidError::MissingToken)
        );
    }

    #[test]
    fn other_schemes_are_errors_not_absence() {
        for header in [
            "Basic dXNlcjpwYXNz",
            "Digest x=y",
            "TOKENONLY",
            "vapidx t=a,k=b",
        ] {
            assert_eq!(
                parse(Some(header), None),
                Err(VapidError::UnknownScheme),
                "{header}"
            );
        }
    }
}
