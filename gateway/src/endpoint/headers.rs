//! Validation of a push request's headers (RFC 8030 §5, RFC 8188/8291, the
//! older `aesgcm` draft Firefox still understands, and the
//! `application/webpush-message` bodies of draft-thomson-webpush-hpke and
//! draft-thomson-webpush-sym, which carry their encryption inside).

use std::collections::BTreeMap;

use autopush_common::{ApiError, ApiResult, Urgency};
use warp::http::HeaderMap;

/// Longest TTL honoured; larger values are capped, not refused.
pub const MAX_TTL: u64 = 30 * 24 * 60 * 60;

/// Longest Topic (RFC 8030 §5.4: at most 32 base64url characters).
const MAX_TOPIC_LEN: usize = 32;

/// The media type of a push message that says how it is encrypted in its
/// own bytes (the HPKE and symmetric-key drafts replacing RFC 8291): it
/// comes without `Content-Encoding`, and the user agent gets it as
/// `content_type` instead of `encoding`.
pub const WEBPUSH_MESSAGE: &str = "application/webpush-message";

/// What a valid push request's headers say.
#[derive(Debug, PartialEq)]
pub struct PushHeaders {
    pub ttl: u64,
    pub topic: Option<String>,
    pub urgency: Option<Urgency>,
    /// Headers forwarded to the user agent so it can decrypt: `encoding`,
    /// and for `aesgcm` also `encryption` and `crypto_key`; or, for an
    /// [`WEBPUSH_MESSAGE`] body, `content_type` alone.
    pub forward: Option<BTreeMap<String, String>>,
}

fn header<'a>(
    headers: &'a HeaderMap,
    name: &str,
    invalid: impl Fn(String) -> ApiError,
) -> ApiResult<Option<&'a str>> {
    headers
        .get(name)
        .map(|v| {
            v.to_str()
                .map(str::trim)
                .map_err(|_| invalid(format!("{name} is not ASCII")))
        })
        .transpose()
}

pub fn parse(headers: &HeaderMap, has_body: bool) -> ApiResult<PushHeaders> {
    let ttl = match header(headers, "ttl", ApiError::InvalidTtl)? {
        None => return Err(ApiError::MissingTtl),
        Some(value) => value
            .parse::<u64>()
            .map_err(|_| {
                ApiError::InvalidTtl(format!("{value:?} is not a whole number of seconds"))
            })?
            .min(MAX_TTL),
    };
    let topic = header(headers, "topic", ApiError::InvalidTopic)?.map(str::to_owned);
    if let Some(topic) = &topic {
        let base64url = topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if topic.is_empty() || topic.len() > MAX_TOPIC_LEN || !base64url {
            return Err(ApiError::InvalidTopic(format!(
                "at most {MAX_TOPIC_LEN} characters of A-Z, a-z, 0-9, '-' and '_'"
            )));
        }
    }
    let urgency = header(headers, "urgency", ApiError::BadRequest)?
        .map(|value| {
            Urgency::parse(value).ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "Urgency must be very-low, low, normal or high, got {value:?}"
                ))
            })
        })
        .transpose()?;
    let forward = if has_body {
        Some(encryption_headers(headers)?)
    } else {
        None
    };
    Ok(PushHeaders {
        ttl,
        topic,
        urgency,
        forward,
    })
}

/// How a push's body is encrypted, for metrics
/// ([`autopush_common::metrics::ENCODINGS`]), from its forwarded headers.
pub fn encoding_label(forward: Option<&BTreeMap<String, String>>) -> &'static str {
    let Some(forward) = forward else {
        return "none";
    };
    if forward.contains_key("content_type") {
        return "webpush-message";
    }
    match forward.get("encoding").map(String::as_str) {
        Some("aesgcm") => "aesgcm",
        _ => "aes128gcm",
    }
}

/// Whether the request's `Content-Type` is [`WEBPUSH_MESSAGE`] (any
/// parameters aside).
fn is_webpush_message(headers: &HeaderMap) -> ApiResult<bool> {
    let media_type = header(headers, "content-type", ApiError::InvalidEncryption)?
        .and_then(|value| value.split(';').next())
        .map(str::trim);
    Ok(media_type.is_some_and(|t| t.eq_ignore_ascii_case(WEBPUSH_MESSAGE)))
}

/// A body is encrypted; say how, in a way the user agent can undo.
fn encryption_headers(headers: &HeaderMap) -> ApiResult<BTreeMap<String, String>> {
    let encoding = header(headers, "content-encoding", ApiError::InvalidEncryption)?;
    if is_webpush_message(headers)? {
        if encoding.is_some() {
            return Err(ApiError::InvalidEncryption(format!(
                "a {WEBPUSH_MESSAGE} body says how it is encrypted itself: send it without \
                 Content-Encoding"
            )));
        }
        return Ok(BTreeMap::from([(
            "content_type".into(),
            WEBPUSH_MESSAGE.into(),
        )]));
    }
    let encoding = encoding
        .ok_or_else(|| {
            ApiError::InvalidEncryption(format!(
                "a body needs Content-Encoding: aes128gcm (or aesgcm), or Content-Type: \
                 {WEBPUSH_MESSAGE}"
            ))
        })?
        .to_ascii_lowercase();
    let mut forward = BTreeMap::new();
    match encoding.as_str() {
        // Everything needed to decrypt travels in the body's own header.
        "aes128gcm" => {}
        "aesgcm" => {
            let encryption = header(headers, "encryption", ApiError::InvalidEncryption)?
                .ok_or_else(|| {
                    ApiError::InvalidEncryption("aesgcm needs an Encryption header".into())
                })?;
            if !has_param(encryption, "salt") {
                return Err(ApiError::InvalidEncryption(
                    "the Encryption header needs salt=".into(),
                ));
            }
            let crypto_key = header(headers, "crypto-key", ApiError::InvalidEncryption)?
                .ok_or_else(|| {
                    ApiError::InvalidEncryption("aesgcm needs a Crypto-Key header".into())
                })?;
            if !has_param(crypto_key, "dh") {
                return Err(ApiError::InvalidEncryption(
                    "the Crypto-Key header needs dh=".into(),
                ));
            }
            forward.insert("encryption".into(), clean_params(encryption));
            forward.insert("crypto_key".into(), clean_params(crypto_key));
        }
        other => {
            return Err(ApiError::InvalidEncryption(format!(
                "unsupported Content-Encoding {other:?}: use aes128gcm or aesgcm"
            )));
        }
    }
    forward.insert("encoding".into(), encoding);
    Ok(forward)
}

/// A `k1=v1;k2=v2,k3=v3` header as the user agent should get it, the way
/// Mozilla's service forwards it: no spaces, values without quotes, and
/// base64 values without `=` padding, so clients that compare or decode
/// strictly get clean values.
fn clean_params(value: &str) -> String {
    let is_base64 = |v: &str| {
        v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'+' | b'/' | b'='))
    };
    value
        .split(',')
        .map(|item| {
            item.split(';')
                .filter_map(|param| {
                    let (key, value) = param.split_once('=')?;
                    let value = value.trim().trim_matches('"');
                    let value = if is_base64(value) {
                        value.trim_end_matches('=')
                    } else {
                        value
                    };
                    Some(format!("{}={value}", key.trim()))
                })
                .collect::<Vec<_>>()
                .join(";")
        })
        .filter(|item| !item.is_empty())
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether a `k1=v1;k2=v2,k3=v3` header has a non-empty `name`.
fn has_param(value: &str, name: &str) -> bool {
    value.split([';', ',']).any(|part| {
        part.split_once('=').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case(name) && !v.trim().trim_matches('"').is_empty()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, v.parse().unwrap());
        }
        map
    }

    #[test]
    fn ttl_is_required_numeric_and_capped() {
        assert_eq!(parse(&headers(&[]), false), Err(ApiError::MissingTtl));
        for bad in ["-1", "abc", "1.5", ""] {
            let h = headers(&[("ttl", Box::leak(bad.to_owned().into_boxed_str()))]);
            assert_eq!(parse(&h, false).unwrap_err().errno(), 112, "{bad}");
        }
        assert_eq!(
            parse(&headers(&[("ttl", "99999999")]), false).unwrap().ttl,
            MAX_TTL
        );
        assert_eq!(parse(&headers(&[("ttl", "0")]), false).unwrap().ttl, 0);
    }

    #[test]
    fn topics_are_short_base64url() {
        assert_eq!(
            parse(&headers(&[("ttl", "1"), ("topic", "new_mail-2")]), false)
                .unwrap()
                .topic
                .unwrap(),
            "new_mail-2"
        );
        for bad in ["has space", "a.b", "x23456789012345678901234567890123"] {
            let h = headers(&[
                ("ttl", "1"),
                ("topic", Box::leak(bad.to_owned().into_boxed_str())),
            ]);
            assert_eq!(parse(&h, false).unwrap_err().errno(), 113, "{bad}");
        }
    }

    #[test]
    fn a_webpush_message_body_needs_no_encoding_and_takes_none() {
        let ok = parse(
            &headers(&[
                ("ttl", "1"),
                ("content-type", "Application/WebPush-Message; x=1"),
            ]),
            true,
        )
        .unwrap();
        let forward = ok.forward.unwrap();
        assert_eq!(forward.len(), 1, "{forward:?}");
        assert_eq!(forward["content_type"], WEBPUSH_MESSAGE);
        let both = parse(
            &headers(&[
                ("ttl", "1"),
                ("content-type", WEBPUSH_MESSAGE),
                ("content-encoding", "aes128gcm"),
            ]),
            true,
        );
        assert!(
            matches!(&both, Err(ApiError::InvalidEncryption(m)) if m.contains("without Content-Encoding")),
            "{both:?}"
        );
        // Another media type is no encoding either.
        let other = parse(
            &headers(&[("ttl", "1"), ("content-type", "application/octet-stream")]),
            true,
        );
        assert!(
            matches!(&other, Err(ApiError::InvalidEncryption(_))),
            "{other:?}"
        );
    }

    #[test]
    fn bodies_need_a_known_encoding_with_its_parameters() {
        let ok = parse(
            &headers(&[("ttl", "1"), ("content-encoding", "aes128gcm")]),
            true,
        )
        .unwrap();
        assert_eq!(ok.forward.unwrap()["encoding"], "aes128gcm");
        let aesgcm = headers(&[
            ("ttl", "1"),
            ("content-encoding", "aesgcm"),
            ("encryption", "salt=abc"),
            ("crypto-key", "dh=def;p256ecdsa=xyz"),
        ]);
        let forward = parse(&aesgcm, true).unwrap().forward.unwrap();
        assert_eq!(
            (
                forward["encryption"].as_str(),
                forward["crypto_key"].as_str()
            ),
            ("salt=abc", "dh=def;p256ecdsa=xyz")
        );
        for bad in [
            headers(&[("ttl", "1")]),
            headers(&[("ttl", "1"), ("content-encoding", "gzip")]),
            headers(&[
                ("ttl", "1"),
                ("content-encoding", "aesgcm"),
                ("crypto-key", "dh=x"),
            ]),
            headers(&[
                ("ttl", "1"),
                ("content-encoding", "aesgcm"),
                ("encryption", "rs=4096"),
                ("crypto-key", "dh=x"),
            ]),
            headers(&[
                ("ttl", "1"),
                ("content-encoding", "aesgcm"),
                ("encryption", "salt=x"),
                ("crypto-key", "p256ecdsa=x"),
            ]),
        ] {
            assert_eq!(parse(&bad, true).unwrap_err().errno(), 110, "{bad:?}");
        }
        // Forwarded clean: no quotes, no padding, no spaces.
        let quoted = headers(&[
            ("ttl", "1"),
            ("content-encoding", "aesgcm"),
            ("encryption", "keyid=\"p256dh\"; salt=\"c2FsdA==\""),
            (
                "crypto-key",
                "keyid=p256dh;dh=\"BCd_ef==\", p256ecdsa=BAbc-_=",
            ),
        ]);
        let forward = parse(&quoted, true).unwrap().forward.unwrap();
        assert_eq!(forward["encryption"], "keyid=p256dh;salt=c2FsdA");
        assert_eq!(
            forward["crypto_key"],
            "keyid=p256dh;dh=BCd_ef,p256ecdsa=BAbc-_"
        );
        // No body, nothing to decrypt: no encoding needed.
        assert_eq!(
            parse(&headers(&[("ttl", "1")]), false).unwrap().forward,
            None
        );
    }
}
