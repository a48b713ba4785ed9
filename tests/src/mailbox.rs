//! Reading a bridged app's mailbox as the app does.

use serde_json::Value;

use crate::http::HttpReply;
use crate::py::SendResult;

/// A push refused for a full mailbox of `size` messages, as its sender
/// sees it: 429 errno 201 with `Retry-After`, and the `mailbox` policy:
/// its size, with no window (a mailbox empties as its app fetches and
/// acks, not with time).
pub fn assert_full(refused: &SendResult, size: u64) {
    let limit = refused.assert_rate_limited("a push to a full mailbox");
    assert_eq!(
        (limit.policy.as_str(), limit.quota, limit.window),
        ("mailbox", size, None),
        "{limit:?}"
    );
}

/// Every message in a mailbox, page by page (`limit` a page), oldest
/// first; `page` lists one page given the query string.
pub async fn fetch_all(limit: usize, mut page: impl AsyncFnMut(&str) -> HttpReply) -> Vec<Value> {
    let (mut messages, mut query) = (Vec::new(), format!("limit={limit}"));
    loop {
        let reply = page(&query).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let listed = reply.json["messages"].as_array().expect("messages").clone();
        assert!(listed.len() <= limit, "{}", reply.text);
        messages.extend(listed);
        match reply.json["next"].as_str() {
            Some(next) => query = format!("limit={limit}&after={next}"),
            None => return messages,
        }
    }
}

/// The body bytes of a listed message (`body`, base64url), as the app
/// decodes them.
pub fn body_bytes(message: &Value) -> Vec<u8> {
    let body = message["body"].as_str().unwrap_or_else(|| {
        panic!("no body in {message}");
    });
    base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, body)
        .unwrap_or_else(|e| panic!("the body is not base64url ({e})"))
}

/// What a bridge's upstream was sent for a wake-only registration: it holds
/// none of `secrets` (the channel id, message ids, pieces of the body, the
/// sender's VAPID subject).
pub fn assert_holds_none_of(upstream: &str, secrets: &[&str]) {
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        assert!(
            !upstream.contains(secret),
            "the upstream got {secret:?}: {upstream}"
        );
    }
}
