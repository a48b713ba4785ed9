//! Calls to other connection nodes' internal router API ([`NodeClient`]),
//! signed with the shared router key and naming the version this build
//! speaks; the webpush router delivers through it, and a connection node
//! tells the node a client left to drop it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use autopush_common::node_auth::NodeKeys;
use autopush_common::time::now_secs;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{Method, StatusCode};
use tracing::warn;
use uuid::Uuid;

use crate::protocol::{ROUTER_API, VERSION};

/// Calls to other connection nodes' internal router API, signed with the
/// shared router key (see [`autopush_common::node_auth`]).
#[derive(Clone)]
pub struct NodeClient {
    http: reqwest::Client,
    keys: Arc<NodeKeys>,
    /// Whether the last answer was a 401, so a key mismatch is logged once
    /// per outage rather than once per call.
    refused: Arc<AtomicBool>,
    /// The nodes and users whose notify is being asked again.
    retrying: Arc<Mutex<HashSet<(String, Uuid)>>>,
}

/// The waits before each retry of a notify that got no answer: half a
/// minute in all, longer than a node's usual stall (a VM paused, a
/// runtime starved), short enough that a node gone for good is let go.
const RETRY_AFTER: [Duration; 5] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(16),
];

/// Most notifies retried at once: past it, a stored message waits for its
/// client's next connection or push, as it would with no retry.
const RETRYING_AT_ONCE: usize = 10_000;

/// A node call that got no answer. Its text never holds the URL: paths
/// carry UAIDs.
#[derive(Debug, thiserror::Error)]
pub enum NodeCallError {
    #[error("the node id is not a URL")]
    BadNodeId,
    #[error("{0}")]
    Unreachable(reqwest::Error),
}

impl NodeClient {
    pub fn new(keys: NodeKeys) -> Self {
        let http = autopush_common::http_client::builder()
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(3))
            .build()
            .unwrap_or_default();
        NodeClient {
            http,
            keys: Arc::new(keys),
            refused: Arc::default(),
            retrying: Arc::default(),
        }
    }

    /// The router key(s), which also check calls this node receives.
    pub fn keys(&self) -> &NodeKeys {
        &self.keys
    }

    /// `METHOD {node_id}{path}` with `body`, signed.
    pub async fn call(
        &self,
        method: Method,
        node_id: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<reqwest::Response, NodeCallError> {
        self.call_with(method, node_id, path, body, None).await
    }

    /// `PUT {node_id}/notif/{uaid}`: have the node's session of `uaid`, if
    /// it holds one, look in storage. A node that does not answer is asked
    /// again in the background ([`RETRY_AFTER`]): one paused or overloaded
    /// past the call's timeout keeps its clients, who would otherwise get
    /// what was stored meanwhile only at their next connection or push.
    pub async fn notify(&self, node_id: &str, uaid: &Uuid) -> Result<(), NodeCallError> {
        let told = self.notify_once(node_id, uaid).await;
        if let Err(NodeCallError::Unreachable(_)) = &told {
            self.notify_later(node_id, uaid);
        }
        told
    }

    async fn notify_once(&self, node_id: &str, uaid: &Uuid) -> Result<(), NodeCallError> {
        let path = format!("/notif/{}", uaid.simple());
        self.call(Method::PUT, node_id, &path, Vec::new())
            .await
            .map(drop)
    }

    /// Ask `node_id` about `uaid` again after each of [`RETRY_AFTER`], until
    /// it answers: one task per node and user, at most [`RETRYING_AT_ONCE`].
    fn notify_later(&self, node_id: &str, uaid: &Uuid) {
        let key = (node_id.to_owned(), *uaid);
        {
            let mut retrying = self.retrying.lock().unwrap_or_else(|e| e.into_inner());
            if retrying.len() >= RETRYING_AT_ONCE || !retrying.insert(key.clone()) {
                return;
            }
        }
        let client = self.clone();
        tokio::spawn(async move {
            let (node_id, uaid) = &key;
            for wait in RETRY_AFTER {
                tokio::time::sleep(wait).await;
                if client.notify_once(node_id, uaid).await.is_ok() {
                    break;
                }
            }
            let mut retrying = client.retrying.lock().unwrap_or_else(|e| e.into_inner());
            retrying.remove(&key);
        });
    }

    /// [`NodeClient::call`] with one more request header.
    pub async fn call_with(
        &self,
        method: Method,
        node_id: &str,
        path: &str,
        body: Vec<u8>,
        header: Option<(&'static str, &'static str)>,
    ) -> Result<reqwest::Response, NodeCallError> {
        let url = reqwest::Url::parse(&format!("{node_id}{path}"))
            .map_err(|_| NodeCallError::BadNodeId)?;
        let authorization = self
            .keys
            .authorization(method.as_str(), url.path(), &body, now_secs());
        let mut request = self
            .http
            .request(method, url)
            .header(AUTHORIZATION, authorization)
            .header(ROUTER_API, VERSION.to_string());
        if !body.is_empty() {
            request = request.header(CONTENT_TYPE, "application/json").body(body);
        }
        if let Some((name, value)) = header {
            request = request.header(name, value);
        }
        let response = request
            .send()
            .await
            .map_err(|e| NodeCallError::Unreachable(e.without_url()))?;
        let refused = response.status() == StatusCode::UNAUTHORIZED;
        if refused && !self.refused.swap(true, Ordering::Relaxed) {
            warn!(
                node_id,
                "a connection node refused our signature: every node needs the same --router-key"
            );
        } else if !refused {
            self.refused.store(false, Ordering::Relaxed);
        }
        Ok(response)
    }
}
