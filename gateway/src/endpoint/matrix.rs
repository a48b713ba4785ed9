//! `/_matrix/push/v1/notify`: a Matrix push gateway (the Matrix Push
//! Gateway API), so that a homeserver pushes straight to the endpoint a
//! UnifiedPush distributor gave a Matrix client.
//!
//! * `GET` answers `{"unifiedpush":{"gateway":"matrix"}}`, the discovery
//!   answer UnifiedPush clients look for.
//! * `POST` takes the homeserver's notification. Each device's pushkey must
//!   be one of our own endpoints: our endpoint URL and a token our keys
//!   decrypt. Anything else is `rejected` and nothing is fetched, so the
//!   gateway relays to no one else. A subscription pinned to a VAPID key
//!   takes signed pushes only; a homeserver cannot sign, so such a pushkey
//!   is rejected too.
//! * The subscription gets the notification as a push without encryption:
//!   `{"notification":{...}}`, compact, with this device alone in
//!   `devices`; when that would not fit in `--max-data-bytes` (or in a
//!   bridge's message), only the event's ids, counts and priority with the
//!   device (Matrix's `event_id_only` format). It is routed as any push:
//!   direct, stored or bridged. A subscription that is gone is `rejected`,
//!   which makes the homeserver delete its pusher.
//!
//! Errors are Matrix's `{"errcode","error"}`. A homeserver counts against
//! `--matrix-gateway-limit` by source address, one token per device, and
//! each subscription against `--subscription-limit`, as an unsigned push.

use std::net::IpAddr;
use std::sync::Arc;

use autopush_common::endpoint::TokenInfo;
use autopush_common::limit_headers::RateLimit;
use autopush_common::{ApiError, ApiResult, metrics};
use autopush_serving::http::Peer;
use serde_json::{Map, Value, json};
use tracing::{debug, warn};
use warp::Filter;
use warp::http::{HeaderMap, HeaderValue, Method, StatusCode};
use warp::reply::{Reply, Response};

use super::{EndpointState, headers, read_body, webpush};

/// How long a notification waits for an offline client: a day, after which
/// the client's next sync says more than the notification would.
const TTL_SECONDS: u64 = 86_400;

/// The largest request body taken: a notification carries the event's
/// content, which the homeserver bounds well below this.
const MAX_BODY: usize = 64 * 1024;

/// The members an `event_id_only` notification keeps (besides `devices`).
const EVENT_ID_ONLY: [&str; 4] = ["event_id", "room_id", "counts", "prio"];

/// The notification's members that are text when present.
const TEXT_MEMBERS: [&str; 7] = [
    "event_id",
    "room_id",
    "type",
    "sender",
    "sender_display_name",
    "room_name",
    "room_alias",
];

pub fn routes(
    state: Arc<EndpointState>,
) -> impl Filter<Extract = (Response,), Error = warp::Rejection> + Clone {
    warp::path!("_matrix" / "push" / "v1" / "notify")
        .and(warp::method())
        .and(warp::header::headers_cloned())
        .and(warp::ext::optional::<Peer>())
        .and(warp::body::stream())
        .then(move |method: Method, headers: HeaderMap, peer, body| {
            let state = state.clone();
            async move {
                match method {
                    Method::GET => {
                        warp::reply::json(&json!({"unifiedpush": {"gateway": "matrix"}}))
                            .into_response()
                    }
                    Method::POST => {
                        let client = state.client(peer, &headers);
                        let result = match read_body(body, MAX_BODY).await {
                            Ok(body) => notify(&state, client, &body).await,
                            Err(e) => Err(e.into()),
                        };
                        match result {
                            Ok(rejected) => {
                                warp::reply::json(&json!({ "rejected": rejected })).into_response()
                            }
                            Err(e) => e.into_response(),
                        }
                    }
                    _ => MatrixError {
                        status: StatusCode::METHOD_NOT_ALLOWED,
                        errcode: "M_UNRECOGNIZED",
                        error: "this path takes GET and POST only".into(),
                        retry_after: None,
                        rate_limit: None,
                    }
                    .into_response(),
                }
            }
        })
}

/// Deliver the notification to each device; the pushkeys to reject.
async fn notify(
    state: &Arc<EndpointState>,
    client: IpAddr,
    body: &[u8],
) -> Result<Vec<String>, MatrixError> {
    let (notification, devices) = parse(body)?;
    let mut rejected = Vec::new();
    // The first failure the homeserver should retry for (the others still
    // get theirs meanwhile).
    let mut failure = None;
    for device in &devices {
        state.fair_use.matrix_notification(client)?;
        let pushkey = device["pushkey"].as_str().unwrap_or_default();
        let Some(subscription) = our_subscription(state, pushkey) else {
            debug!("matrix gateway: a pushkey that is not one of our endpoints, rejected");
            metrics::matrix_notification("foreign");
            rejected.push(pushkey.to_owned());
            continue;
        };
        state.fair_use.matrix_subscription(&subscription)?;
        match deliver(state, &subscription, &notification, device).await {
            Ok(()) => metrics::matrix_notification("delivered"),
            Err(ApiError::NoUser | ApiError::NoSubscription | ApiError::DeviceGone) => {
                metrics::matrix_notification("gone");
                rejected.push(pushkey.to_owned());
            }
            Err(ApiError::PayloadTooLarge(_) | ApiError::BridgePayloadTooLarge(_)) => {
                // Even the event's ids do not fit: nothing to retry.
                metrics::matrix_notification("too_large");
            }
            Err(e) => {
                metrics::matrix_notification("failed");
                if e.status().is_server_error() {
                    warn!(error = %e, "matrix gateway: delivery failed");
                }
                failure.get_or_insert(e);
            }
        }
    }
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(rejected),
    }
}

/// The request's notification (without `devices`) and its devices, or
/// why the body is not the API's.
fn parse(body: &[u8]) -> Result<(Map<String, Value>, Vec<Value>), MatrixError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| MatrixError::bad("M_NOT_JSON", format!("the body is not JSON: {e}")))?;
    let bad = |what: &str| MatrixError::bad("M_BAD_JSON", what.to_owned());
    let Value::Object(mut request) = value else {
        return Err(bad("the body must be a JSON object"));
    };
    let Some(Value::Object(mut notification)) = request.remove("notification") else {
        return Err(bad("`notification` must be an object"));
    };
    let Some(Value::Array(devices)) = notification.remove("devices") else {
        return Err(bad("`notification.devices` must be a list"));
    };
    for name in TEXT_MEMBERS {
        if !matches!(
            notification.get(name),
            None | Some(Value::String(_) | Value::Null)
        ) {
            return Err(bad(&format!("`notification.{name}` must be a string")));
        }
    }
    if !matches!(notification.get("counts"), None | Some(Value::Object(_))) {
        return Err(bad("`notification.counts` must be an object"));
    }
    let prio = notification.get("prio").map(|p| p.as_str());
    if !matches!(prio, None | Some(Some("high" | "low"))) {
        return Err(bad("`notification.prio` must be \"high\" or \"low\""));
    }
    for device in &devices {
        let text = |name| device.get(name).and_then(Value::as_str).is_some();
        if !text("pushkey") || !text("app_id") {
            return Err(bad(
                "each device must be an object with a string `pushkey` and `app_id`",
            ));
        }
    }
    Ok((notification, devices))
}

/// The subscription `pushkey` is the endpoint of, if it is one of ours
/// that takes unsigned pushes. Decided from the text alone: nothing is
/// fetched.
fn our_subscription(state: &EndpointState, pushkey: &str) -> Option<TokenInfo> {
    let path = pushkey
        .strip_prefix(state.crypto.endpoint_url())?
        .strip_prefix("/wpush/")?;
    let (version, token) = path.split_once('/')?;
    let subscription = state.crypto.parse_token(version, token).ok()?;
    subscription.key_hash.is_none().then_some(subscription)
}

/// Route the notification for `device` to `subscription`: whole, or
/// `event_id_only` when the whole does not fit.
async fn deliver(
    state: &Arc<EndpointState>,
    subscription: &TokenInfo,
    notification: &Map<String, Value>,
    device: &Value,
) -> ApiResult<()> {
    let whole = payload(notification, device, false);
    if whole.len() <= state.max_data_bytes {
        match route(state, subscription, notification, whole).await {
            // A bridge's message holds less than a Web Push one.
            Err(ApiError::BridgePayloadTooLarge(_)) => {}
            delivered_or_not => return delivered_or_not,
        }
    }
    let event_id_only = payload(notification, device, true);
    route(state, subscription, notification, event_id_only).await
}

/// The JSON the subscription receives for `device`.
fn payload(notification: &Map<String, Value>, device: &Value, event_id_only: bool) -> Vec<u8> {
    let mut members: Map<String, Value> = notification
        .iter()
        .filter(|(name, _)| !event_id_only || EVENT_ID_ONLY.contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    members.insert("devices".into(), Value::Array(vec![device.clone()]));
    json!({ "notification": members }).to_string().into_bytes()
}

/// Hand `body` to the push path as an unencrypted push.
async fn route(
    state: &Arc<EndpointState>,
    subscription: &TokenInfo,
    notification: &Map<String, Value>,
    body: Vec<u8>,
) -> ApiResult<()> {
    if body.len() > state.max_data_bytes {
        return Err(ApiError::PayloadTooLarge(state.max_data_bytes));
    }
    // Matrix's `high` wakes the device; `low` is an ordinary message.
    let urgency = match notification.get("prio").and_then(Value::as_str) {
        Some("low") => "normal",
        _ => "high",
    };
    let mut push_headers = HeaderMap::new();
    push_headers.insert("ttl", HeaderValue::from(TTL_SECONDS));
    push_headers.insert("urgency", HeaderValue::from_static(urgency));
    let push = headers::parse(&push_headers, false)?;
    let mut router_type = None;
    webpush::deliver(
        state.clone(),
        subscription,
        push,
        body.into(),
        Some("matrix gateway"),
        &mut router_type,
    )
    .await
    .map(|_| ())
}

/// A Matrix-style error answer.
#[derive(Debug)]
struct MatrixError {
    status: StatusCode,
    errcode: &'static str,
    error: String,
    /// Seconds to wait, for `Retry-After` (and `retry_after_ms`).
    retry_after: Option<u64>,
    /// The limit that refused a 429, for the `RateLimit` headers.
    rate_limit: Option<RateLimit>,
}

impl MatrixError {
    fn bad(errcode: &'static str, error: String) -> Self {
        MatrixError {
            status: StatusCode::BAD_REQUEST,
            errcode,
            error,
            retry_after: None,
            rate_limit: None,
        }
    }

    fn into_response(self) -> Response {
        let mut body = json!({"errcode": self.errcode, "error": self.error});
        if let Some(seconds) = self.retry_after {
            body["retry_after_ms"] = json!(seconds * 1000);
        }
        let mut response =
            warp::reply::with_status(warp::reply::json(&body), self.status).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from(seconds));
        }
        if let Some(limit) = self.rate_limit {
            limit.add_headers(response.headers_mut());
        }
        response
    }
}

impl From<ApiError> for MatrixError {
    fn from(e: ApiError) -> Self {
        let status = e.status();
        let errcode = match status {
            StatusCode::TOO_MANY_REQUESTS => "M_LIMIT_EXCEEDED",
            StatusCode::PAYLOAD_TOO_LARGE => "M_TOO_LARGE",
            // Not the body's shape (that is `parse`'s): the store, a bridge.
            _ => "M_UNKNOWN",
        };
        MatrixError {
            status,
            errcode,
            error: e.public_message(),
            retry_after: e.retry_after(),
            rate_limit: e.rate_limit(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad_json(body: &str) -> bool {
        matches!(parse(body.as_bytes()), Err(e) if e.errcode == "M_BAD_JSON")
    }

    #[test]
    fn a_body_not_of_the_apis_shape_is_bad_json() {
        assert!(matches!(parse(b"{"), Err(e) if e.errcode == "M_NOT_JSON"));
        assert!(bad_json("[]"));
        assert!(bad_json(r#"{"notification":1}"#));
        assert!(bad_json(r#"{"notification":{}}"#));
        assert!(bad_json(
            r#"{"notification":{"devices":[{"pushkey":1,"app_id":"a"}]}}"#
        ));
        assert!(bad_json(
            r#"{"notification":{"devices":[],"prio":"urgent"}}"#
        ));
        assert!(bad_json(r#"{"notification":{"devices":[],"room_id":7}}"#));
        let (notification, devices) = parse(
            br#"{"notification":{"devices":[{"pushkey":"k","app_id":"a"}],"prio":"low","x":1}}"#,
        )
        .expect("the API's shape");
        assert_eq!(devices.len(), 1);
        assert_eq!(notification["x"], 1);
        assert!(!notification.contains_key("devices"));
    }

    #[test]
    fn event_id_only_keeps_ids_counts_priority_and_the_device() {
        let (notification, devices) = parse(
            br#"{"notification":{"event_id":"$e","room_id":"!r","counts":{"unread":2},
                "prio":"high","content":{"body":"hello"},"sender":"@a:b",
                "devices":[{"pushkey":"k","app_id":"a","data":{"cs":"s"}}]}}"#,
        )
        .expect("the API's shape");
        let short: Value =
            serde_json::from_slice(&payload(&notification, &devices[0], true)).expect("JSON");
        assert_eq!(
            short,
            json!({"notification": {"event_id": "$e", "room_id": "!r",
                "counts": {"unread": 2}, "prio": "high",
                "devices": [{"pushkey": "k", "app_id": "a", "data": {"cs": "s"}}]}})
        );
    }
}
