//! Reading a bridged app's mailbox as the app does.

use serde_json::Value;

use crate::http::HttpReply;

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
