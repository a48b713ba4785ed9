//! The connection node: holds Firefox's websockets, speaks the push protocol,
//! delivers direct and stored notifications, and serves the internal router
//! API that endpoint nodes call.
//!
//! * [`protocol`] parses client messages and renders server messages.
//! * [`session`] owns one websocket; its submodules handle one message each.
//! * [`registry`] maps connected UAIDs to their sessions.
//! * [`router_api`] is the internal HTTP API (`/push`, `/notif`, `/user`).
//! * [`server`] serves both ports through `autopush-serving`.
//! * [`websocket`] is the server's end of a websocket, holding no buffer
//!   while its client is idle.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use autopush_common::endpoint::EndpointCrypto;
use autopush_common::limit::AddressLimiter;
use autopush_common::router::RouterRegistry;
use autopush_storage::Storage;
use autopush_webpush::{NodeClient, NodeJournal};

pub mod protocol;
pub mod registry;
pub mod router_api;
pub mod server;
pub mod session;
pub mod websocket;

pub use registry::ClientRegistry;

/// Tunables of the websocket protocol.
#[derive(Clone, Debug)]
pub struct ConnectionSettings {
    /// Close a connection that has not said `hello` within this time.
    pub hello_timeout: Duration,
    /// Send a websocket ping after this much silence...
    pub auto_ping_interval: Duration,
    /// ...and close the connection if no pong arrives within this time.
    pub auto_ping_timeout: Duration,
    /// A client's `{}` pings may come this often on average: each takes a
    /// token, one comes back per interval, and a client that runs out
    /// (pinging in a tight loop) is closed. Zero: no limit.
    pub min_ping_interval: Duration,
    /// A client with more stored messages than this gets a new UAID at hello.
    pub msg_limit: usize,
    /// Most channels one UAID may subscribe.
    pub max_channels: usize,
    /// Largest websocket message accepted from a client.
    pub max_message_size: usize,
    /// Most websockets open at once; upgrades beyond are refused with 503.
    pub max_connections: usize,
    /// A client that does not take a message within this time is closed.
    pub send_timeout: Duration,
    /// A connected client's `last_connect` is refreshed this often, so
    /// housekeeping never takes a client connected for longer than the
    /// idle window for an idle one.
    pub refresh_last_connect: Duration,
    /// Proxies whose `X-Forwarded-For` names the client of a websocket
    /// upgrade (for the quota of new UAIDs).
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// During a migration from autopush-rs, whose endpoints call the router
    /// API unsigned: peers whose unsigned `PUT /push` and `PUT /notif` are
    /// taken. Empty (the default): every call must be signed.
    pub unsigned_node_calls_from: Vec<ipnet::IpNet>,
}

impl Default for ConnectionSettings {
    fn default() -> Self {
        ConnectionSettings {
            hello_timeout: Duration::from_secs(30),
            auto_ping_interval: Duration::from_secs(300),
            auto_ping_timeout: Duration::from_secs(10),
            min_ping_interval: Duration::from_secs(20),
            msg_limit: 100,
            max_channels: 1000,
            max_message_size: 32 * 1024,
            max_connections: 10_000,
            send_timeout: Duration::from_secs(5),
            refresh_last_connect: Duration::from_secs(86_400),
            trusted_proxies: Vec::new(),
            unsigned_node_calls_from: Vec::new(),
        }
    }
}

/// Everything a session needs, shared by all sessions of the node.
pub struct NodeContext {
    pub settings: ConnectionSettings,
    pub storage: Arc<dyn Storage>,
    pub crypto: Arc<EndpointCrypto>,
    pub registry: Arc<ClientRegistry>,
    /// Signed calls to other connection nodes; its key also checks the
    /// calls this node's router API receives.
    pub nodes: NodeClient,
    /// This node's own journal of the durable copies it holds, on a
    /// shared store (`--journal-dir`).
    pub journal: Option<Arc<NodeJournal>>,
    /// Websockets open now (from the upgrade until the session ends).
    pub open_sockets: AtomicUsize,
    /// New UAIDs handed out at hello, by client address (`None`: no quota).
    pub new_uaids: Option<AddressLimiter>,
    /// The bridges (APNs, FCM) whose apps a client may name as its wake
    /// route.
    pub wake_bridges: RouterRegistry,
}

impl NodeContext {
    pub fn node_id(&self) -> &str {
        self.registry.node_id()
    }
}
