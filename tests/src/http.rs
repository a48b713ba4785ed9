//! Raw HTTP requests (reqwest) to the endpoint and internal APIs.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use hmac::{Hmac, Mac};
use reqwest::Method;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A shared client that never uses a proxy.
pub fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        autopush_common::http_client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("reqwest client")
    })
}

/// An HTTP response, fully read.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    /// Response headers, lower-case names.
    pub headers: BTreeMap<String, String>,
    pub text: String,
    /// The body as JSON (`Null` when it is not JSON).
    pub json: Value,
}

impl HttpReply {
    /// A response header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// A string field of the JSON body; panics naming the field when absent.
    pub fn field(&self, name: &str) -> String {
        self.json[name]
            .as_str()
            .unwrap_or_else(|| panic!("no {name}: {}", self.text))
            .to_owned()
    }

    /// Assert an error response with this status and errno, in the JSON shape
    /// `{code, errno, error, message, more_info}`.
    pub fn assert_error(&self, status: u16, errno: u64) {
        assert_error_parts(status, errno, self.status, &self.json, &self.text);
    }

    /// Assert a limit's refusal: 429 errno 201, with `Retry-After` and the
    /// [`RateLimit`] headers agreeing on the wait; the limit they name.
    pub fn assert_rate_limited(&self, what: &str) -> RateLimit {
        self.assert_error(429, 201);
        RateLimit::refused(&self.headers, what)
    }

    /// Assert a push was accepted: 201 with `Location` and `TTL`.
    pub fn assert_created(&self) {
        assert_eq!(self.status, 201, "push not accepted: {self:?}");
        assert!(self.header("location").is_some(), "no Location: {self:?}");
        assert!(self.header("ttl").is_some(), "no TTL: {self:?}");
    }
}

/// A limit as a sender reads it in the IETF `RateLimit-Policy` and
/// `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers): the policy's
/// name, its quota `q` and window `w` in seconds (none for a limit that
/// does not refill with time), the requests left `r`, and the seconds `t`
/// until more may pass.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimit {
    pub policy: String,
    pub quota: u64,
    pub window: Option<u64>,
    pub remaining: u64,
    pub reset: u64,
}

impl RateLimit {
    /// Both headers of an answer; panics, naming `what`, when one is
    /// missing or malformed, or when they name two policies.
    pub fn read(headers: &BTreeMap<String, String>, what: &str) -> RateLimit {
        let (policy, mut p) = rate_limit_item(headers, "ratelimit-policy", &["q", "w"], what);
        let (named, mut l) = rate_limit_item(headers, "ratelimit", &["r", "t"], what);
        assert_eq!(policy, named, "{what}: the two headers name one policy");
        let required = |params: &mut BTreeMap<String, u64>, key: &str| {
            params
                .remove(key)
                .unwrap_or_else(|| panic!("{what}: no {key} in {headers:?}"))
        };
        RateLimit {
            quota: required(&mut p, "q"),
            window: p.remove("w"),
            remaining: required(&mut l, "r"),
            reset: required(&mut l, "t"),
            policy,
        }
    }

    /// A refusal's: besides, a `Retry-After` of whole seconds (at least
    /// one), nothing left (`r=0`), and `t` that same wait.
    pub fn refused(headers: &BTreeMap<String, String>, what: &str) -> RateLimit {
        let retry_after: u64 = headers
            .get("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{what}: no Retry-After in seconds: {headers:?}"));
        assert!(retry_after >= 1, "{what}: Retry-After {retry_after}");
        let limit = RateLimit::read(headers, what);
        assert_eq!(
            (limit.remaining, limit.reset),
            (0, retry_after),
            "{what}: r and t of a refusal, against Retry-After {retry_after}: {limit:?}"
        );
        limit
    }
}

/// One `RateLimit-Policy` or `RateLimit` item, `"name";key=value;...`,
/// with integer parameters among `keys`: its name and parameters.
fn rate_limit_item(
    headers: &BTreeMap<String, String>,
    header: &str,
    keys: &[&str],
    what: &str,
) -> (String, BTreeMap<String, u64>) {
    let value = headers
        .get(header)
        .unwrap_or_else(|| panic!("{what}: no {header} header: {headers:?}"));
    let mut parts = value.split(';');
    let name = parts
        .next()
        .and_then(|n| n.strip_prefix('"'))
        .and_then(|n| n.strip_suffix('"'))
        .unwrap_or_else(|| panic!("{what}: {header}: {value:?} does not start with a string"));
    let mut params = BTreeMap::new();
    for part in parts {
        let parsed = part
            .split_once('=')
            .filter(|(k, _)| keys.contains(k))
            .and_then(|(k, v)| Some((k.to_owned(), v.parse::<u64>().ok()?)));
        let Some((key, number)) = parsed else {
            panic!("{what}: {header}: {value:?}: {part:?} is not one of {keys:?}=integer");
        };
        assert!(
            params.insert(key, number).is_none(),
            "{what}: {header}: {value:?}: {part:?} twice"
        );
    }
    (name.to_owned(), params)
}

pub(crate) fn assert_error_parts(
    status: u16,
    errno: u64,
    got_status: u16,
    json: &Value,
    text: &str,
) {
    assert_eq!(
        (got_status, json["errno"].as_u64()),
        (status, Some(errno)),
        "expected status {status} errno {errno}, got {got_status}: {text}"
    );
    assert_eq!(
        json["code"].as_u64(),
        Some(u64::from(status)),
        "code: {text}"
    );
    for field in ["error", "message", "more_info"] {
        assert!(
            json[field].is_string(),
            "error body without {field:?}: {text}"
        );
    }
}

/// Send a request and read the whole response. Panics on transport errors.
pub async fn request(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> HttpReply {
    let mut req = client().request(method.clone(), url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    if let Some(body) = body {
        req = req.body(body);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_ascii_lowercase(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let text = resp
        .text()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: reading body: {e}"));
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    HttpReply {
        status,
        headers,
        text,
        json,
    }
}

/// POST a push message as is (no encryption, no VAPID unless given in `headers`).
pub async fn post_push(
    endpoint: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> HttpReply {
    request(Method::POST, endpoint, headers, body).await
}

pub async fn get(url: &str) -> HttpReply {
    request(Method::GET, url, &[], None).await
}

pub async fn delete(url: &str) -> HttpReply {
    request(Method::DELETE, url, &[], None).await
}

pub async fn put(url: &str) -> HttpReply {
    request(Method::PUT, url, &[], None).await
}

pub async fn put_json(url: &str, body: &Value) -> HttpReply {
    request(
        Method::PUT,
        url,
        &[("content-type", "application/json")],
        Some(body.to_string().into_bytes()),
    )
    .await
}

/// The `Authorization` value for an internal router API call, computed here
/// from the documented scheme (not with the server's own code):
/// `AUTOPUSH-HMAC t={t},sig={hex HMAC-SHA256(key, "{METHOD}\n{path}\n{t}\n{hex SHA-256(body)}")}`.
pub fn router_authorization(key: &str, method: &Method, path: &str, body: &[u8], t: u64) -> String {
    let body_hash = crate::hex_encode(&Sha256::digest(body));
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("any key length");
    mac.update(format!("{method}\n{path}\n{t}\n{body_hash}").as_bytes());
    let sig = crate::hex_encode(&mac.finalize().into_bytes());
    format!("AUTOPUSH-HMAC t={t},sig={sig}")
}

/// Seconds since the Unix epoch, as the signature's `t`.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// A notification as the endpoint hands it to a connection node's
/// `PUT /push/{uaid}`: `enc` for channel `chid`, TTL 60, accepted now.
pub fn router_notification(chid: &str, version: &str, enc: &crate::py::Encrypted) -> Value {
    serde_json::json!({
        "channelID": chid,
        "version": version,
        "ttl": 60,
        "timestamp": unix_now(),
        "data": enc.body,
        "headers": enc.headers,
    })
}

/// An internal router API call signed with `key` now: `base` is the router
/// API's base URL, `path` starts with `/`.
pub async fn signed(
    method: Method,
    base: &str,
    path: &str,
    key: &str,
    body: Option<Vec<u8>>,
) -> HttpReply {
    signed_with(method, base, path, key, body, &[]).await
}

/// [`signed`], with `extra` headers (which the signature does not cover).
pub async fn signed_with(
    method: Method,
    base: &str,
    path: &str,
    key: &str,
    body: Option<Vec<u8>>,
    extra: &[(&str, &str)],
) -> HttpReply {
    let bytes = body.clone().unwrap_or_default();
    let authorization = router_authorization(key, &method, path, &bytes, unix_now());
    let mut headers = vec![("authorization", authorization.as_str())];
    if body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    headers.extend_from_slice(extra);
    request(method, &format!("{base}{path}"), &headers, body).await
}
