//! Hostile and broken clients: whatever they send, the node answers or
//! closes the connection, never panics, and keeps serving everyone else.

use autopush_tests::*;
use serde_json::json;

/// A message type long enough that the close reason quoting it must be cut,
/// made of two-byte characters so that a cut at a fixed byte index lands
/// inside one.
fn long_multibyte_type() -> String {
    "é".repeat(200)
}

/// The close reason is cut to fit a close frame at a character boundary, for
/// the first message and for a later one.
#[tokio::test]
async fn a_close_reason_quoting_multibyte_client_text_is_cut_cleanly() {
    let server = Server::start().await;
    let bad = json!({ "messageType": long_multibyte_type() });

    // As the first message (before hello).
    let mut ws = WsClient::connect(&server.ws_url()).await;
    ws.send_json(bad.clone()).await;
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert!(
        closed.reason.starts_with("unknown messageType"),
        "{closed:?}"
    );
    assert!(closed.reason.len() <= 123, "{closed:?}");

    // After hello, from a registered session.
    let mut ws = server.client().await;
    ws.send_json(bad).await;
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert_eq!(closed.messages[0]["status"], 401, "{closed:?}");
    assert!(closed.reason.len() <= 123, "{closed:?}");

    // The node still serves, and nothing panicked.
    let ws = server.client().await;
    ws.close().await;
    let stderr = server.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
}
