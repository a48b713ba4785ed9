//! Reading a push's receipt (`GET` on its `Location` URL) as a sender does.

use std::time::Duration;

use crate::HANG_GUARD;
use crate::http::{self, HttpReply};
use crate::py::SendResult;

/// The `Location` URL of an accepted push.
pub fn location(sent: &SendResult) -> String {
    sent.assert_created();
    sent.header("location").expect("Location").to_owned()
}

/// The message id a `Location` URL ends with.
pub fn id_of(location: &str) -> &str {
    location.rsplit('/').next().unwrap_or_default()
}

/// A receipt's state, after checking it is a 200 whose `updated` is a
/// unix time of the last two minutes.
pub fn state(reply: &HttpReply) -> String {
    assert_eq!(reply.status, 200, "receipt: {reply:?}");
    let updated = reply.json["updated"].as_u64();
    let now = http::unix_now();
    assert!(
        updated.is_some_and(|t| t + 120 > now && t <= now + 1),
        "updated: {}",
        reply.text
    );
    reply.json["state"]
        .as_str()
        .unwrap_or_else(|| panic!("no state: {}", reply.text))
        .to_owned()
}

/// The state of the receipt at `location`.
pub async fn state_of(location: &str) -> String {
    state(&http::get(location).await)
}

/// Ask `check` again (every 20 ms) until it holds; past the hang guard,
/// panic saying `what` never happened.
pub async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} never happened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until the receipt at `location` says `want`.
pub async fn wait_for_state(location: &str, want: &str) {
    let what = format!("receipt {want}");
    wait_until(&what, async || state_of(location).await == want).await;
}

/// Wait until the receipt at `location` is gone: 404/102.
pub async fn wait_for_404(location: &str) {
    let gone = async || {
        let reply = http::get(location).await;
        if reply.status == 404 {
            reply.assert_error(404, 102);
        }
        reply.status == 404
    };
    wait_until("receipt 404", gone).await;
}

/// Requests by operation for the three paths a request count measures
/// (direct, stored, drained).
pub type PathRequests = [std::collections::BTreeMap<String, usize>; 3];

/// Receipts cost no request: on each path, as many requests with receipts
/// on as off (the ack's conditional delete writes the receipt instead).
pub fn assert_receipts_cost_no_request(off: &PathRequests, on: &PathRequests) {
    let total = |ops: &std::collections::BTreeMap<String, usize>| ops.values().sum::<usize>();
    for (path, (off, on)) in ["direct", "stored", "drained"]
        .iter()
        .zip(off.iter().zip(on))
    {
        assert_eq!(
            total(off),
            total(on),
            "{path}: receipts off {off:?}, on {on:?}"
        );
    }
}

/// The environment that makes a node hold direct copies back for a grace
/// every ack of a test comes within (30 s instead of 10 ms), so that the
/// path a test takes does not depend on how fast a loaded machine acks.
pub fn long_grace() -> (String, String) {
    ("AUTOPUSH_TEST_DIRECT_GRACE_MS".into(), "30000".into())
}
