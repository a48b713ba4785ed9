//! Settings, from four layers: command-line flag > `AUTOPUSH_*` environment
//! variable > TOML file (`--config`) > default.
//!
//! One struct, [`SettingsLayer`], is both the clap argument set (flags and
//! env) and the TOML file schema, so the two can never drift apart; an
//! unknown key in the file is an error at start-up. Layers are merged
//! through serde ([`SettingsLayer::over`]), so every field is merged without
//! being named: a new setting is a field here, its default in
//! [`SettingsLayer::with_defaults`], a field in [`Settings`] and its line in
//! [`Settings::checked`]; then regenerate docs/settings.md and
//! packaging/autopush.toml (see [`crate::reference`]). A bridge's settings
//! are its crate's section, flattened in through
//! [`crate::bridges::BridgeSettings`].

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use autopush_common::limit::Rate;
use autopush_common::{Secret, Urgency};
use autopush_serving::http::HttpLimits;
use autopush_serving::tls::TlsFiles;
use autopush_webpush::WakeSettings;
use autopush_webpush::node_journal::WINDOW;
use clap::Args;

use crate::bridges::BridgeSettings;
use crate::metrics::{Statsd, parse_statsd};
use crate::secrets::{self, SecretFiles};
use crate::sources::{Source, Sources};
use serde::{Deserialize, Serialize};

/// One layer of settings; `None` means "not set here".
#[derive(Args, Debug, Default, Clone, Deserialize, Serialize)]
// Unknown keys are refused by `from_file`: serde cannot refuse them
// through the flattened bridge sections.
#[serde(rename_all = "snake_case")]
pub struct SettingsLayer {
    /// Address the public ports (websocket, endpoint) listen on: an IP
    /// address (IPv6 bare or in brackets, `::` or `[::]`) or a name,
    /// resolved at start-up and listened on at every address it has [default: 0.0.0.0]
    #[arg(long, env = "AUTOPUSH_HOST", global = true)]
    pub host: Option<String>,
    /// Websocket port for user agents [default: 8080]
    #[arg(long, env = "AUTOPUSH_PORT", global = true)]
    pub port: Option<u16>,
    /// Address the internal router API listens on, written as --host is [default: 127.0.0.1]
    #[arg(long, env = "AUTOPUSH_ROUTER_HOST", global = true)]
    pub router_host: Option<String>,
    /// Internal router API port (never expose publicly) [default: 8081]
    #[arg(long, env = "AUTOPUSH_ROUTER_PORT", global = true)]
    pub router_port: Option<u16>,
    /// URL other nodes use to reach this node's router API [default: http://ROUTER_HOST:ROUTER_PORT]
    #[arg(long, env = "AUTOPUSH_NODE_URL", global = true)]
    pub node_url: Option<String>,
    /// Public HTTP port for application servers [default: 8082]
    #[arg(long, env = "AUTOPUSH_ENDPOINT_PORT", global = true)]
    pub endpoint_port: Option<u16>,
    /// Base of every push endpoint URL and the VAPID audience [default:
    /// http://localhost:ENDPOINT_PORT, or https:// with --tls-cert]
    #[arg(long, env = "AUTOPUSH_ENDPOINT_URL", global = true)]
    pub endpoint_url: Option<String>,
    /// TLS certificate chain (PEM, the server's first) of the public ports,
    /// with --tls-key; reloaded on SIGHUP and when the file changes [default: off]
    #[arg(long, env = "AUTOPUSH_TLS_CERT", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// The TLS certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1), with --tls-cert [default: off]
    #[arg(long, env = "AUTOPUSH_TLS_KEY", global = true)]
    pub tls_key: Option<PathBuf>,
    /// Storage: a directory for the embedded store, `dynamodb`, Bigtable
    /// as `grpc://HOST:PORT` (or `bigtable` for Google's endpoint), or
    /// PostgreSQL as `postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE` (libpq's
    /// URL: several hosts as `HOST1,HOST2` with `?target_session_attrs=read-write`,
    /// `sslmode`, `sslrootcert`) [default: ./autopush-data]
    #[arg(long, env = "AUTOPUSH_DB", global = true)]
    pub db: Option<String>,
    /// Bigtable settings as autopush-rs's JSON `db_settings`: `table_name`
    /// (projects/P/instances/I/tables/T), `app_profile_id`, `router_family`,
    /// `message_family`, `message_topic_family`; with a Bigtable --db.
    /// PostgreSQL's: `schema`, `router_table`, `message_table`, `meta_table`,
    /// `reliability_table`, `max_router_ttl`, and our `pool_size` [default: 16]
    #[arg(long, env = "AUTOPUSH_DB_SETTINGS", global = true)]
    pub db_settings: Option<String>,
    /// MiB of the database file the embedded store keeps in memory, on top
    /// of the OS's page cache; most of a busy node's memory. With a
    /// directory --db [default: 64]
    #[arg(long, env = "AUTOPUSH_DB_CACHE_MIB", global = true)]
    pub db_cache_mib: Option<usize>,
    /// A directory on this node's own disk where a connection node on a
    /// shared store (DynamoDB, Bigtable, PostgreSQL) journals the durable
    /// copies of the direct messages it delivers: senders are answered
    /// once a copy is synced there, and a copy its client acks within
    /// seconds never reaches the shared store. A node moves what it holds
    /// there to the shared store when it starts: keep it across restarts,
    /// one per node. `off` turns it off (`./off` is a directory of that
    /// name): the node then writes a copy not acked within milliseconds
    /// to the shared store before its sender is answered. With a shared
    /// store [default: ./autopush-journal]
    #[arg(long, env = "AUTOPUSH_JOURNAL_DIR", global = true)]
    pub journal_dir: Option<PathBuf>,
    /// Seconds a node keeps a copy its client has not acked in its journal
    /// before it moves it to the shared store: a client that acks later
    /// costs the shared store a write, and the loss of the node's disk
    /// loses at most this long of its pushes not acked yet. With a journal
    /// [default: 10]
    #[arg(long, env = "AUTOPUSH_JOURNAL_WINDOW", global = true)]
    pub journal_window: Option<f64>,
    /// DynamoDB router (user) table, with --db dynamodb [default: router]
    #[arg(long, env = "AUTOPUSH_ROUTER_TABLE", global = true)]
    pub router_table: Option<String>,
    /// DynamoDB message table, with --db dynamodb [default: message]
    #[arg(long, env = "AUTOPUSH_MESSAGE_TABLE", global = true)]
    pub message_table: Option<String>,
    /// Legacy monthly message tables as Python autopush rotated them:
    /// MESSAGE_TABLE is then the prefix of MESSAGE_TABLE_YYYY_MM, with
    /// --db dynamodb [default: false]
    #[arg(long, env = "AUTOPUSH_MESSAGE_TABLE_ROTATION", global = true)]
    pub message_table_rotation: Option<bool>,
    /// Endpoint encryption key(s), comma-separated, first encrypts (also read from CRYPTO_KEY)
    /// [default: generated once and kept in the data directory, all-in-one only]
    #[arg(
        long,
        env = "AUTOPUSH_CRYPTO_KEY",
        global = true,
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub crypto_key: Option<Secret>,
    /// Key(s) that sign /v1 registration secrets, comma-separated, first signs
    /// [default: generated once and kept in the data directory, all-in-one only]
    #[arg(
        long,
        env = "AUTOPUSH_AUTH_KEY",
        global = true,
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub auth_key: Option<Secret>,
    /// Key(s) shared by all nodes that sign internal router API calls,
    /// comma-separated, first signs; required when the router API listens
    /// beyond loopback [default: generated once and kept in the data
    /// directory, all-in-one only]
    #[arg(
        long,
        env = "AUTOPUSH_ROUTER_KEY",
        global = true,
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub router_key: Option<Secret>,
    /// The `_file` forms of the settings that hold a secret.
    #[command(flatten)]
    #[serde(flatten)]
    pub secret_files: SecretFiles,
    /// A client with more stored messages than this gets a new UAID [default: 100]
    #[arg(long, env = "AUTOPUSH_MSG_LIMIT", global = true)]
    pub msg_limit: Option<usize>,
    /// Write every message to storage before delivering it directly, and delete
    /// it on ack, so a node killed before the ack loses nothing [default: true]
    #[arg(long, env = "AUTOPUSH_DURABLE_DIRECT", global = true)]
    pub durable_direct: Option<bool>,
    /// Seconds a message's receipt (`GET` on its `Location` URL) answers
    /// after its final state; 0 turns receipts off [default: 86400; 0 on
    /// Bigtable, where autopush-rs cannot read a receipt row]
    #[arg(long, env = "AUTOPUSH_RECEIPT_RETENTION", global = true)]
    pub receipt_retention: Option<u64>,
    /// Most channels (subscriptions) one user agent may hold [default: 1000]
    #[arg(long, env = "AUTOPUSH_MAX_CHANNELS", global = true)]
    pub max_channels: Option<usize>,
    /// Seconds between housekeeping passes that delete expired messages and
    /// idle users from the store [default: 600]
    #[arg(long, env = "AUTOPUSH_SWEEP_INTERVAL", global = true)]
    pub sweep_interval: Option<f64>,
    /// Remove webpush users that have not connected for this many days, with
    /// their subscriptions and messages; 0 keeps them forever [default: 60]
    #[arg(long, env = "AUTOPUSH_DROP_IDLE_USERS_AFTER_DAYS", global = true)]
    pub drop_idle_users_after_days: Option<f64>,
    /// Largest push body accepted, in bytes [default: 5630]
    #[arg(long, env = "AUTOPUSH_MAX_DATA_BYTES", global = true)]
    pub max_data_bytes: Option<usize>,
    /// Seconds a new connection has to say hello [default: 30]
    #[arg(long, env = "AUTOPUSH_HELLO_TIMEOUT", global = true)]
    pub hello_timeout: Option<f64>,
    /// Seconds of silence before the server pings a client [default: 300]
    #[arg(long, env = "AUTOPUSH_AUTO_PING_INTERVAL", global = true)]
    pub auto_ping_interval: Option<f64>,
    /// Seconds to wait for the pong before closing [default: 10]
    #[arg(long, env = "AUTOPUSH_AUTO_PING_TIMEOUT", global = true)]
    pub auto_ping_timeout: Option<f64>,
    /// Seconds a client's own `{}` pings must be apart on average: each takes
    /// one of 10 tokens, one comes back per interval, and a client that runs
    /// out (pinging in a tight loop) is closed with 4774; 0: no limit [default: 20]
    #[arg(long, env = "AUTOPUSH_MIN_PING_INTERVAL", global = true)]
    pub min_ping_interval: Option<f64>,
    /// Most websocket clients held at once; more are refused with 503 until
    /// some leave [default: the open-file limit less 256]
    #[arg(long, env = "AUTOPUSH_MAX_CONNECTIONS", global = true)]
    pub max_connections: Option<usize>,
    /// Seconds a websocket client has to take a message; a client that stops
    /// reading is disconnected and its unacknowledged messages stored [default: 5]
    #[arg(long, env = "AUTOPUSH_WS_SEND_TIMEOUT", global = true)]
    pub ws_send_timeout: Option<f64>,
    /// The least urgent message (very-low, low, normal, high) that wakes a
    /// user agent that is away, through its wake route [default: normal]
    #[arg(long, env = "AUTOPUSH_WAKE_THRESHOLD", global = true)]
    pub wake_threshold: Option<String>,
    /// Seconds within which a user agent that stays away gets at most one
    /// wake-up [default: 30]
    #[arg(long, env = "AUTOPUSH_WAKE_INTERVAL", global = true)]
    pub wake_interval: Option<f64>,
    /// Pushes per VAPID key (signed pushes), as `PER_SECOND,BURST`; `0`
    /// turns the limit off [default: 1000,10000]
    #[arg(long, env = "AUTOPUSH_SENDER_LIMIT", global = true)]
    pub sender_limit: Option<String>,
    /// Named senders' own rates instead of `--sender-limit`, as
    /// space-separated `KEY=PER_SECOND,BURST` entries, KEY a VAPID public
    /// key as `k=` spells it (base64url, 65 bytes); `0` for no limit
    /// [default: none]
    #[arg(long, env = "AUTOPUSH_SENDER_LIMITS", global = true)]
    pub sender_limits: Option<String>,
    /// Pushes per subscription not signed with a key it pins (unsigned, or
    /// to a v1 endpoint), as `PER_SECOND,BURST` [default: 10,100]
    #[arg(long, env = "AUTOPUSH_SUBSCRIPTION_LIMIT", global = true)]
    pub subscription_limit: Option<String>,
    /// The same pushes per source address (an IPv6 /64), but for those
    /// signed by a token this node has verified, as `PER_SECOND,BURST`;
    /// also, in a bucket of its own, pushes whose VAPID signature fails
    /// [default: 100,1000]
    #[arg(long, env = "AUTOPUSH_SOURCE_IP_LIMIT", global = true)]
    pub source_ip_limit: Option<String>,
    /// `/v1` registrations per source address (an IPv6 /64), as
    /// `PER_SECOND,BURST` [default: 1,20]
    #[arg(long, env = "AUTOPUSH_REGISTRATION_LIMIT", global = true)]
    pub registration_limit: Option<String>,
    /// New UAIDs handed out at websocket hello per source address, as
    /// `PER_SECOND,BURST` [default: 1,20]
    #[arg(long, env = "AUTOPUSH_NEW_UAID_LIMIT", global = true)]
    pub new_uaid_limit: Option<String>,
    /// Pushes per bridge app (APNs channel, FCM/GCM app), as
    /// `PER_SECOND,BURST` [default: 5000,10000]
    #[arg(long, env = "AUTOPUSH_BRIDGE_APP_LIMIT", global = true)]
    pub bridge_app_limit: Option<String>,
    /// Matrix gateway notifications (one per device) per homeserver source
    /// address (an IPv6 /64), as `PER_SECOND,BURST` [default: 100,1000]
    #[arg(long, env = "AUTOPUSH_MATRIX_GATEWAY_LIMIT", global = true)]
    pub matrix_gateway_limit: Option<String>,
    /// Most keys (senders, subscriptions, addresses) each rate limiter
    /// tracks; beyond it, the least informative are forgotten [default: 100000]
    #[arg(long, env = "AUTOPUSH_LIMITER_MAX_KEYS", global = true)]
    pub limiter_max_keys: Option<usize>,
    /// Proxies (comma-separated IP addresses or networks, e.g. a load
    /// balancer's 10.0.0.0/8) whose `X-Forwarded-For` names the client; from
    /// anyone else the header is ignored [default: none]
    #[arg(long, env = "AUTOPUSH_TRUSTED_PROXIES", global = true)]
    pub trusted_proxies: Option<String>,
    /// During a migration from autopush-rs only: its endpoints call the
    /// router API unsigned; take their `PUT /push` and `PUT /notif` from
    /// these addresses or networks (comma-separated, e.g.
    /// 10.0.2.0/24,10.0.3.7), counted in node.unsigned_call. Every other
    /// call stays signed [default: none]
    #[arg(long, env = "AUTOPUSH_UNSIGNED_NODE_CALLS_FROM", global = true)]
    pub unsigned_node_calls_from: Option<String>,
    /// During a migration from autopush-rs only, on endpoints: its
    /// connection nodes' addresses or networks (comma-separated, e.g.
    /// 10.0.2.0/24,10.0.3.7). A push one of them takes leaves no durable
    /// copy behind, as its acks never touch storage; any other node that
    /// does not name its router API version gets the copy kept [default: none]
    #[arg(long, env = "AUTOPUSH_AUTOPUSH_RS_NODES", global = true)]
    pub autopush_rs_nodes: Option<String>,
    /// Seconds an HTTP client has to send a request head, from connecting or
    /// from its first byte, on every port [default: 10]
    #[arg(long, env = "AUTOPUSH_HTTP_HEADER_TIMEOUT", global = true)]
    pub http_header_timeout: Option<f64>,
    /// Seconds an HTTP keep-alive connection may sit idle between requests [default: 75]
    #[arg(long, env = "AUTOPUSH_HTTP_IDLE_TIMEOUT", global = true)]
    pub http_idle_timeout: Option<f64>,
    /// Seconds an HTTP client has to send a request body, and to take a
    /// response once its socket is full [default: 30]
    #[arg(long, env = "AUTOPUSH_HTTP_BODY_TIMEOUT", global = true)]
    pub http_body_timeout: Option<f64>,
    /// Most HTTP connections open at once on each port, and on each address
    /// of a host name (websockets count only during their handshake); more
    /// are answered 503 [default: 1024]
    #[arg(long, env = "AUTOPUSH_MAX_HTTP_CONNECTIONS", global = true)]
    pub max_http_connections: Option<usize>,
    /// Verified VAPID tokens kept to skip repeated signature checks [default: 10000]
    #[arg(long, env = "AUTOPUSH_VAPID_CACHE_SIZE", global = true)]
    pub vapid_cache_size: Option<usize>,
    /// Also serve `GET /metrics` (Prometheus text, unauthenticated) on this
    /// port, on the router host [default: off; /metrics is always on the router API port]
    #[arg(long, env = "AUTOPUSH_METRICS_PORT", global = true)]
    pub metrics_port: Option<u16>,
    /// Also send metrics as statsd datagrams to HOST[:PORT] (port 8125 by default) [default: off]
    #[arg(long, env = "AUTOPUSH_STATSD_HOST", global = true)]
    pub statsd_host: Option<String>,
    /// Most seconds a statsd line waits to be sent: lines are gathered into
    /// datagrams, sent when full, at this interval and at shutdown [default: 2]
    #[arg(long, env = "AUTOPUSH_STATSD_FLUSH_INTERVAL", global = true)]
    pub statsd_flush_interval: Option<f64>,
    /// Prefix of every statsd metric name [default: autopush]
    #[arg(long, env = "AUTOPUSH_STATSD_LABEL", global = true)]
    pub statsd_label: Option<String>,
    /// Log format: `human` or `json` [default: human]
    #[arg(long, env = "AUTOPUSH_LOG_FORMAT", global = true)]
    pub log_format: Option<String>,
    /// Each bridge's section, as its crate defines it (`--apns-channels`,
    /// `[fcm.apps.NAME]`, ...).
    #[command(flatten)]
    #[serde(flatten)]
    pub bridges: BridgeSettings,
    /// Where each value came from, for errors (not a setting).
    #[arg(skip)]
    #[serde(skip)]
    pub sources: Sources,
    /// What SIGHUP reads the bridges' apps from again (not a setting).
    #[arg(skip)]
    #[serde(skip)]
    pub reread: Option<Reread>,
}

impl SettingsLayer {
    /// The settings file's layer. An unknown key is an error: inside a
    /// table, by that table's own schema; at the top, here, as a key the
    /// layer does not read back.
    fn from_file(text: &str, path: &std::path::Path) -> Result<SettingsLayer, String> {
        let mut layer: SettingsLayer = toml::from_str(text).map_err(|e| e.to_string())?;
        let given: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        let read = toml::Table::try_from(&layer).map_err(|e| e.to_string())?;
        if let Some(key) = given.keys().find(|key| !read.contains_key(*key)) {
            let args = settings_args();
            let known = args.iter().map(|a| a.get_id().as_str());
            return Err(match nearest(key, known.chain(["fcm", "gcm"])) {
                Some(near) => format!("unknown key `{key}`: did you mean `{near}`?"),
                None => format!("unknown key `{key}`"),
            });
        }
        for key in given.keys() {
            layer.sources.set(key, Source::File(path.to_owned()));
        }
        Ok(layer)
    }

    /// This layer over `lower`: every setting left unset here comes from
    /// `lower`. Both layers become tables of the settings they set, so no
    /// field can be forgotten.
    pub fn over(self, lower: SettingsLayer) -> Result<SettingsLayer, String> {
        let table = |layer: SettingsLayer| {
            toml::Table::try_from(layer).map_err(|e| format!("cannot merge settings: {e}"))
        };
        let mut merged = table(lower)?;
        merged.extend(table(self)?);
        merged
            .try_into()
            .map_err(|e| format!("cannot merge settings: {e}"))
    }
}

impl SettingsLayer {
    /// The flags' layer (which carries the environment's values, through
    /// clap) over the TOML file at `config`, if any: every setting given,
    /// none defaulted yet.
    pub fn merged(
        mut flags: SettingsLayer,
        config: Option<&std::path::Path>,
    ) -> Result<SettingsLayer, String> {
        // autopush's historical name, below AUTOPUSH_CRYPTO_KEY and above the file.
        if flags.crypto_key.is_none() {
            flags.crypto_key = std::env::var("CRYPTO_KEY")
                .ok()
                .filter(|k| !k.is_empty())
                .map(Secret::from);
            if flags.crypto_key.is_some() {
                let env = Source::Env("CRYPTO_KEY".into());
                flags.sources.set("crypto_key", env);
            }
        }
        match config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let mut merged = flags.clone().over_file(&text, path)?;
                merged.reread = Some(Reread {
                    flags: Box::new(flags),
                    path: path.to_owned(),
                });
                Ok(merged)
            }
            None => Ok(flags),
        }
    }

    /// This layer over the settings file `text` read from `path`.
    pub fn over_file(self, text: &str, path: &std::path::Path) -> Result<SettingsLayer, String> {
        let file =
            SettingsLayer::from_file(text, path).map_err(|e| format!("{}: {e}", path.display()))?;
        let sources = self.sources.clone().under_lower(file.sources.clone());
        let mut merged = self.over(file)?;
        merged.sources = sources;
        Ok(merged)
    }

    /// This layer with every setting that has a default filled in: the
    /// one place defaults are decided. Settings still unset are off, or
    /// decided at start-up (keys, `max_connections`).
    pub fn with_defaults(mut self) -> SettingsLayer {
        fn or<T>(value: &mut Option<T>, default: impl FnOnce() -> T) {
            value.get_or_insert_with(default);
        }
        or(&mut self.host, || "0.0.0.0".into());
        or(&mut self.port, || 8080);
        or(&mut self.router_host, || "127.0.0.1".into());
        or(&mut self.router_port, || 8081);
        let router = format!(
            "http://{}:{}",
            url_host(self.router_host.as_deref().unwrap_or_default()),
            self.router_port.unwrap_or_default()
        );
        or(&mut self.node_url, || router);
        or(&mut self.endpoint_port, || 8082);
        // With TLS on the public ports, endpoints are https.
        let scheme = if self.tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        let endpoint = format!(
            "{scheme}://localhost:{}",
            self.endpoint_port.unwrap_or_default()
        );
        or(&mut self.endpoint_url, || endpoint);
        or(&mut self.db, || "./autopush-data".into());
        let db = self.db.as_deref().unwrap_or_default();
        let bigtable = db == "bigtable" || db.starts_with("grpc://");
        // Any other URL is a store not served here, refused on its own.
        if db != "dynamodb" && !bigtable && !db.contains("://") {
            or(&mut self.db_cache_mib, || {
                autopush_storage::embedded::DEFAULT_CACHE_MIB
            });
        } else {
            or(&mut self.journal_dir, || "./autopush-journal".into());
            if self.journal_dir.as_deref() != Some(Path::new("off")) {
                or(&mut self.journal_window, || WINDOW.as_secs_f64());
            }
        }
        // The table settings are an error on any other store.
        if db == "dynamodb" {
            let tables = Tables::default();
            or(&mut self.router_table, || tables.router);
            or(&mut self.message_table, || tables.message);
            or(&mut self.message_table_rotation, || false);
        }
        or(&mut self.msg_limit, || 100);
        or(&mut self.durable_direct, || true);
        // On Bigtable receipts are off unless asked for: autopush-rs fails
        // a fetch on a receipt row, and going back to it must stay a swap.
        or(&mut self.receipt_retention, || {
            if bigtable { 0 } else { 86_400 }
        });
        or(&mut self.max_channels, || 1000);
        or(&mut self.sweep_interval, || 600.0);
        or(&mut self.drop_idle_users_after_days, || 60.0);
        or(&mut self.max_data_bytes, || 5630);
        or(&mut self.hello_timeout, || 30.0);
        or(&mut self.auto_ping_interval, || 300.0);
        or(&mut self.auto_ping_timeout, || 10.0);
        or(&mut self.min_ping_interval, || 20.0);
        or(&mut self.ws_send_timeout, || 5.0);
        or(&mut self.wake_threshold, || "normal".into());
        or(&mut self.wake_interval, || 30.0);
        or(&mut self.sender_limit, || "1000,10000".into());
        or(&mut self.subscription_limit, || "10,100".into());
        or(&mut self.source_ip_limit, || "100,1000".into());
        or(&mut self.registration_limit, || "1,20".into());
        or(&mut self.new_uaid_limit, || "1,20".into());
        or(&mut self.bridge_app_limit, || "5000,10000".into());
        or(&mut self.matrix_gateway_limit, || "100,1000".into());
        or(&mut self.limiter_max_keys, || 100_000);
        or(&mut self.http_header_timeout, || 10.0);
        or(&mut self.http_idle_timeout, || 75.0);
        or(&mut self.http_body_timeout, || 30.0);
        or(&mut self.max_http_connections, || 1024);
        or(&mut self.vapid_cache_size, || 10_000);
        or(&mut self.statsd_flush_interval, || 2.0);
        or(&mut self.statsd_label, || "autopush".into());
        or(&mut self.log_format, || "human".into());
        self
    }

    /// One line per setting, in the order `--help` lists them: `key = value`
    /// in TOML, or a comment naming a setting that is not set. Secrets
    /// (the settings whose environment values `--help` hides) are left
    /// out unless `show_secrets`, with a comment saying where they go; key
    /// material written inline in a bridge's tables shows as `[redacted]`.
    pub fn lines(&self, show_secrets: bool) -> Result<Vec<String>, String> {
        let mut table = toml::Table::try_from(self).map_err(|e| e.to_string())?;
        let mut lines = Vec::new();
        for arg in settings_args() {
            let key = arg.get_id().as_str();
            let long = arg.get_long().unwrap_or(key).replace('-', "_");
            let credential = || secrets::credential_path(&long);
            match table.remove(key) {
                Some(toml::Value::String(_)) if arg.is_hide_env_values_set() && !show_secrets => {
                    lines.push(format!(
                        "# {key}: set, and left out here: a secret goes in the systemd \
                         credential {long} or in the file {long}_file names"
                    ));
                }
                Some(mut value) => {
                    if arg.is_hide_env_values_set() && !show_secrets {
                        redact(&mut value);
                    }
                    lines.push(format!("{key} = {value}"));
                }
                None if arg.is_hide_env_values_set() && credential().is_some() => {
                    let path = credential().unwrap_or_default();
                    lines.push(format!("# {key}: from the credential {}", path.display()));
                }
                None => lines.push(format!("# {key}: not set")),
            }
        }
        // The bridges' file tables (`[fcm.apps.NAME]`), which have no flag.
        for (key, mut value) in table {
            if !show_secrets {
                redact(&mut value);
            }
            lines.push(format!("{key} = {value}"));
        }
        Ok(lines)
    }
}

/// The settings' arguments as clap declares them, bridges' included: each
/// one's id is its TOML key.
pub fn settings_args() -> Vec<clap::Arg> {
    SettingsLayer::augment_args(clap::Command::new("autopush"))
        .get_arguments()
        .cloned()
        .collect()
}

/// What `[redacted]` replaces: a secret setting's string, and in tables,
/// inline key material (PEM text starts with `-`, JSON keys with `{`;
/// paths to key files are shown).
fn redact(value: &mut toml::Value) {
    match value {
        toml::Value::String(_) => *value = toml::Value::String("[redacted]".into()),
        toml::Value::Table(table) => {
            for (_, value) in table.iter_mut() {
                match value {
                    toml::Value::String(s) if !s.trim_start().starts_with(['-', '{']) => {}
                    _ => redact(value),
                }
            }
        }
        toml::Value::Array(values) => values.iter_mut().for_each(redact),
        _ => {}
    }
}

/// The candidate nearest to `word` in edit distance, if near enough to be
/// what was meant (a third of its letters, at least two, may differ).
fn nearest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let distance = |a: &str, b: &str| {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut diagonal = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let above = row[j + 1];
                row[j + 1] = (diagonal + usize::from(ca != *cb))
                    .min(row[j] + 1)
                    .min(above + 1);
                diagonal = above;
            }
        }
        row[b.len()]
    };
    let most = (word.chars().count() / 3).max(2);
    candidates
        .map(|c| (distance(word, c), c))
        .filter(|(d, _)| *d <= most)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `host` as the host of a URL: an IPv6 address in brackets.
fn url_host(host: &str) -> String {
    match host.parse::<std::net::Ipv6Addr>() {
        Ok(ip) => format!("[{ip}]"),
        Err(_) => host.to_owned(),
    }
}

/// Every problem found in the settings, reported together in one error:
/// an operator fixes them all in one go, not one per run.
/// Settings found wrong are noted too, so that what follows from one
/// (keys in a store that cannot be used) is not named as another problem.
#[derive(Debug, Default)]
pub struct Problems(Vec<String>, Vec<&'static str>);

impl Problems {
    pub fn add(&mut self, problem: String) {
        self.0.push(problem);
    }

    /// `result`'s value, as [`Problems::take`]; an error is also noted as
    /// the setting `key`'s.
    pub fn take_for<T>(&mut self, key: &'static str, result: Result<T, String>, stand_in: T) -> T {
        if result.is_err() {
            self.1.push(key);
        }
        self.take(result, stand_in)
    }

    /// Whether the setting `key` was found wrong.
    pub fn failed(&self, key: &str) -> bool {
        self.1.contains(&key)
    }

    /// `result`'s value; or, its error noted, `stand_in`.
    pub fn take<T>(&mut self, result: Result<T, String>, stand_in: T) -> T {
        result.unwrap_or_else(|problem| {
            self.add(problem);
            stand_in
        })
    }

    /// `value` if no problem was found, else the error naming them all.
    pub fn or<T>(self, value: T) -> Result<T, String> {
        match self.0.as_slice() {
            [] => Ok(value),
            [one] => Err(one.clone()),
            many => Err(format!(
                "{} problems with the settings:\n{}",
                many.len(),
                many.iter()
                    .map(|p| format!("  - {p}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )),
        }
    }
}

/// Where settings live: the embedded store in a directory, DynamoDB, or
/// Bigtable.
#[derive(Clone, Debug, PartialEq)]
pub enum Db {
    Embedded(PathBuf),
    DynamoDb,
    Bigtable(BigtableSettings),
    /// Boxed: the parsed DSN is large beside the other variants.
    Postgres(Box<PostgresSettings>),
}

pub use autopush_storage::bigtable::BigtableSettings;
pub use autopush_storage::postgres::PostgresSettings;

/// A PostgreSQL DSN, in either of libpq's URL schemes.
fn is_postgres(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://")
}

/// The stores `--db` names, for the error that refuses another.
const STORES_SERVED: &str = "a directory (the embedded store), `dynamodb`, Bigtable as \
     `grpc://HOST:PORT` or `bigtable`, or PostgreSQL as `postgres://USER@HOST/DATABASE`";

/// `--db` and `--db-settings`: a Bigtable DSN in autopush-rs's shape
/// (`grpc://HOST:PORT`) or `bigtable`, with `BIGTABLE_EMULATOR_HOST`
/// honoured; `dynamodb`; or a directory. Any other URL is refused (never
/// a directory), naming its scheme only: it may hold a password.
fn db_from(db: Option<&str>, db_settings: Option<&str>, setting: &str) -> Result<Db, String> {
    let db = match db {
        Some(dsn) if dsn == "bigtable" || dsn.starts_with("grpc://") => {
            let emulator = std::env::var("BIGTABLE_EMULATOR_HOST").ok();
            return BigtableSettings::parse(dsn, db_settings, emulator.as_deref())
                .map(Db::Bigtable);
        }
        Some(dsn) if is_postgres(dsn) => {
            return PostgresSettings::parse(dsn, db_settings).map(|s| Db::Postgres(Box::new(s)));
        }
        Some(url) if url.contains("://") => {
            let scheme = url.split("://").next().unwrap_or_default();
            return Err(format!(
                "{setting}: a {scheme}:// store is not served here; --db takes {STORES_SERVED}"
            ));
        }
        Some("dynamodb") => Db::DynamoDb,
        Some(dir) => Db::Embedded(PathBuf::from(dir)),
        None => Db::Embedded(PathBuf::from("./autopush-data")),
    };
    match db_settings {
        Some(_) => Err(
            "db_settings applies to a Bigtable --db (grpc://HOST:PORT) or a PostgreSQL one (postgres://...) only"
                .into(),
        ),
        None => Ok(db),
    }
}

pub use autopush_storage::dynamodb::Tables;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LogFormat {
    Human,
    Json,
}

/// Resolved settings, every value decided.
#[derive(Clone, Debug)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub router_host: String,
    pub router_port: u16,
    pub node_url: String,
    pub endpoint_port: u16,
    pub endpoint_url: String,
    /// TLS on the public ports; `None`: plain HTTP.
    pub tls: Option<TlsFiles>,
    pub db: Db,
    /// Bytes of the embedded store's cache (with `Db::Embedded`).
    pub db_cache: usize,
    /// The connection node's own journal of durable copies (on a shared
    /// store).
    pub journal_dir: Option<PathBuf>,
    /// How long the journal keeps a copy for its ack before it moves it.
    pub journal_window: Duration,
    /// DynamoDB table names (with `Db::DynamoDb`).
    pub tables: Tables,
    pub crypto_key: Option<Secret>,
    pub auth_key: Option<Secret>,
    pub router_key: Option<Secret>,
    pub msg_limit: usize,
    pub durable_direct: bool,
    /// Seconds receipts are kept after a message's final state; 0: off.
    pub receipt_retention: u64,
    pub max_channels: usize,
    pub sweep_interval: Duration,
    /// `None`: idle users are kept.
    pub drop_idle_users_after: Option<Duration>,
    pub max_data_bytes: usize,
    pub hello_timeout: Duration,
    pub auto_ping_interval: Duration,
    pub auto_ping_timeout: Duration,
    pub min_ping_interval: Duration,
    /// `None`: decided at start-up from the open-file limit.
    pub max_connections: Option<usize>,
    pub ws_send_timeout: Duration,
    /// Which stored messages wake a user agent that is away, how often.
    pub wake: WakeSettings,
    /// Rate limits and who they count.
    pub limits: RateLimits,
    /// Timeouts and connection cap of every HTTP port.
    pub http: HttpLimits,
    /// Peers whose unsigned `PUT /push`, `PUT /notif` are taken (autopush-rs's
    /// endpoints during a migration); empty: none.
    pub unsigned_node_calls_from: Vec<ipnet::IpNet>,
    pub autopush_rs_nodes: Vec<ipnet::IpNet>,
    pub vapid_cache_size: usize,
    pub metrics_port: Option<u16>,
    pub statsd: Option<Statsd>,
    pub statsd_flush_interval: Duration,
    pub statsd_label: String,
    pub log_format: LogFormat,
    /// Each bridge's section, read when the bridges are built.
    pub bridges: BridgeSettings,
    /// Where each value came from, to name it in errors.
    pub sources: Sources,
    /// What SIGHUP reads the bridges' apps from again; `None`: no settings
    /// file, nothing to re-read.
    pub reread: Option<Reread>,
}

/// The flags (and environment) given at start-up and the settings file
/// under them: a reload reads the file again under the same flags, so
/// they keep their precedence.
#[derive(Clone)]
pub struct Reread {
    pub flags: Box<SettingsLayer>,
    pub path: PathBuf,
}

/// The flags may hold secrets: only the file is shown.
impl std::fmt::Debug for Reread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reread").field("path", &self.path).finish()
    }
}

/// An RFC 8030 urgency, as the `Urgency` header spells it.
fn urgency(name: &str, value: Option<&str>) -> Result<Urgency, String> {
    let value = value.unwrap_or_default();
    Urgency::parse(value)
        .ok_or_else(|| format!("{name} must be very-low, low, normal or high, got {value:?}"))
}

fn seconds(name: &str, value: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| format!("{name} must be a non-negative number of seconds"))
}

/// Rate limits (`None`: off) and the proxies trusted to name the client.
#[derive(Clone, Debug, PartialEq)]
pub struct RateLimits {
    pub sender: Option<Rate>,
    /// `--sender-limits`: named senders' own rates.
    pub senders: Vec<SenderLimit>,
    pub subscription: Option<Rate>,
    pub source_ip: Option<Rate>,
    pub registration: Option<Rate>,
    pub new_uaid: Option<Rate>,
    pub bridge_app: Option<Rate>,
    pub matrix_gateway: Option<Rate>,
    pub max_keys: usize,
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

/// A named sender's rate (`None`: no limit), by its key's SHA-256, as a
/// verified sender is known.
pub type SenderLimit = ([u8; 32], Option<Rate>);

/// A rate setting: `PER_SECOND,BURST` (burst defaults to the rate), or `0`
/// for no limit.
fn rate(name: &str, value: &str) -> Result<Option<Rate>, String> {
    let value = value.trim();
    let (per_second, burst) = value.split_once(',').unwrap_or((value, value));
    let number = |v: &str| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
    };
    match (number(per_second), number(burst)) {
        (Some(per_second), Some(burst)) => Ok(Rate::new(per_second, burst)),
        _ => Err(format!(
            "{name} must be PER_SECOND,BURST (e.g. 10,100) or 0 for no limit, got {value:?}"
        )),
    }
}

/// `--sender-limits`: space-separated `KEY=PER_SECOND,BURST` entries, each
/// KEY a VAPID public key (as `k=` spells it) named once; each key by its
/// SHA-256, as a verified sender is known.
fn sender_limits(name: &str, value: Option<&str>) -> Result<Vec<SenderLimit>, String> {
    use sha2::{Digest, Sha256};
    let mut senders: Vec<SenderLimit> = Vec::new();
    for entry in value.unwrap_or_default().split_ascii_whitespace() {
        let (key, rate_text) = entry
            .split_once('=')
            .ok_or_else(|| format!("{name}: {entry:?} is not KEY=PER_SECOND,BURST"))?;
        let key =
            crate::vapid::decode_public_key(key).map_err(|e| format!("{name}: {entry:?}: {e}"))?;
        let key_hash: [u8; 32] = Sha256::digest(&key).into();
        let rate = rate(&format!("{name}: {entry:?}:"), rate_text)?;
        if senders.iter().any(|(named, _)| *named == key_hash) {
            return Err(format!("{name}: {entry:?} names a key already named"));
        }
        senders.push((key_hash, rate));
    }
    Ok(senders)
}

/// The items of a comma-separated setting, trimmed, empty ones skipped.
fn items(value: Option<&str>) -> impl Iterator<Item = &str> {
    value
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Addresses and networks, comma-separated; an address is a network of
/// one. A network of every address (`/0`) is refused: these settings name
/// particular hosts (proxies, autopush-rs endpoints), never the world.
fn networks(name: &str, value: Option<&str>) -> Result<Vec<ipnet::IpNet>, String> {
    items(value)
        .map(|v| {
            let net = v
                .parse::<ipnet::IpNet>()
                .or_else(|_| v.parse::<IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| format!("{name}: {v:?} is neither an IP address nor a network"))?;
            match net.prefix_len() {
                0 => Err(format!(
                    "{name}: {v:?} is every address; name the hosts it means"
                )),
                _ => Ok(net.trunc()),
            }
        })
        .collect()
}

/// A timeout or interval that cannot be zero (a timeout would close every
/// connection at once, an interval spin).
fn timeout(name: &str, value: f64) -> Result<Duration, String> {
    match seconds(name, value)? {
        d if d.is_zero() => Err(format!("{name} must be more than 0 seconds")),
        d => Ok(d),
    }
}

/// The longest journal window: a node's disk alone holds that much of its
/// pushes not acked yet.
const WINDOW_MAX: Duration = Duration::from_secs(3600);

/// A journal window: more than 0 seconds, at most [`WINDOW_MAX`].
fn journal_window(name: &str, value: f64) -> Result<Duration, String> {
    match timeout(name, value)? {
        d if d > WINDOW_MAX => Err(format!(
            "{name} must be at most {} seconds: the node's disk alone holds what it keeps",
            WINDOW_MAX.as_secs()
        )),
        d => Ok(d),
    }
}

impl Settings {
    /// Resolve `flags` (which already carry env values, via clap) over the
    /// TOML file at `config`, if any, over the defaults. Every problem
    /// with the settings is named in the one error.
    pub fn resolve(
        flags: SettingsLayer,
        config: Option<&std::path::Path>,
    ) -> Result<Settings, String> {
        Settings::from_layer(SettingsLayer::merged(flags, config)?)
    }

    pub fn from_layer(l: SettingsLayer) -> Result<Settings, String> {
        let (settings, problems) = Settings::checked(l);
        problems.or(settings)
    }

    /// The settings of `l` with its defaults, and every problem found in
    /// them. Where a setting is wrong its default stands in, so that the
    /// settings after it are still checked.
    pub fn checked(l: SettingsLayer) -> (Settings, Problems) {
        let l = l.with_defaults();
        let mut p = Problems::default();
        let mut sources = l.sources.clone();
        let files = l.secret_files.clone();
        let mut key = |key: &str, given: Option<Secret>, file: &Option<String>| {
            secrets::key(&mut p, &mut sources, key, given, file.as_deref())
        };
        let crypto_key = key("crypto_key", l.crypto_key, &files.crypto_key_file);
        let auth_key = key("auth_key", l.auth_key, &files.auth_key_file);
        let router_key = key("router_key", l.router_key, &files.router_key_file);
        let mut bridges = l.bridges;
        secrets::read_bridges(&mut p, &mut sources, &mut bridges, &files);
        let sources = sources;
        let name = |key: &str| sources.name(key);
        // Every setting with a default has it now (`with_defaults`); an
        // `unwrap_or_default` below reads a setting that has one.
        let tls = match (l.tls_cert, l.tls_key) {
            (Some(cert), Some(key)) => {
                // Either may name a credential.
                let mut file = |key: &str, value: PathBuf| {
                    let found = secrets::path(&value.to_string_lossy());
                    p.take(found.map_err(|e| format!("{}: {e}", name(key))), value)
                };
                let cert = file("tls_cert", cert);
                Some(TlsFiles {
                    cert,
                    key: file("tls_key", key),
                })
            }
            (None, None) => None,
            _ => {
                p.add(
                    "tls_cert and tls_key go together: give both --tls-cert and --tls-key".into(),
                );
                None
            }
        };
        let endpoint_url = l.endpoint_url.unwrap_or_default();
        let endpoint_url = endpoint_url.trim_end_matches('/').to_owned();
        if !(endpoint_url.starts_with("http://") || endpoint_url.starts_with("https://")) {
            p.add(format!(
                "{} must start with http:// or https://, got {endpoint_url:?}",
                name("endpoint_url")
            ));
        }
        // Standing in for a store whose settings are wrong: the same store,
        // or another shared one, so that no check after it is misled.
        let stand_in = db_from(l.db.as_deref(), None, "").unwrap_or(Db::DynamoDb);
        let db = db_from(l.db.as_deref(), l.db_settings.as_deref(), &name("db"));
        let db = p.take_for("db", db, stand_in);
        if db != Db::DynamoDb {
            for (key, given) in [
                ("router_table", l.router_table.is_some()),
                ("message_table", l.message_table.is_some()),
                ("message_table_rotation", l.message_table_rotation.is_some()),
            ] {
                if given {
                    p.add(format!("{} applies to --db dynamodb only", name(key)));
                }
            }
        }
        let db_cache = match (&db, l.db_cache_mib) {
            (Db::Embedded(_), Some(mib)) => match mib.checked_mul(1 << 20) {
                Some(0) => {
                    p.add(format!("{} must be at least 1", name("db_cache_mib")));
                    0
                }
                Some(bytes) => bytes,
                None => {
                    p.add(format!(
                        "{} is more than this machine can address: {mib}",
                        name("db_cache_mib")
                    ));
                    0
                }
            },
            (Db::Embedded(_), None) => autopush_storage::embedded::DEFAULT_CACHE_MIB << 20,
            (_, Some(_)) => {
                p.add(format!(
                    "{} applies to the embedded store only (a directory --db)",
                    name("db_cache_mib")
                ));
                0
            }
            (_, None) => 0,
        };
        // `off`: no journal, on any store.
        let journal_dir = l.journal_dir.filter(|dir| dir.as_os_str() != "off");
        if matches!(db, Db::Embedded(_)) && journal_dir.is_some() {
            p.add(format!(
                "{} applies to a shared store only (the embedded store journals direct copies itself)",
                name("journal_dir")
            ));
        }
        let journal_window = match (&journal_dir, l.journal_window) {
            (Some(_), Some(window)) => {
                p.take(journal_window(&name("journal_window"), window), WINDOW_MAX)
            }
            (Some(_), None) => WINDOW,
            (None, Some(_)) => {
                p.add(format!(
                    "{} applies to a node with a journal only (--journal-dir on a shared store)",
                    name("journal_window")
                ));
                Duration::ZERO
            }
            (None, None) => Duration::ZERO,
        };
        let defaults = Tables::default();
        let tables = Tables {
            router: l.router_table.unwrap_or(defaults.router),
            message: l.message_table.unwrap_or(defaults.message),
            rotate_messages: l.message_table_rotation.unwrap_or_default(),
        };
        for name in [&tables.router, &tables.message] {
            let valid = (3..=255).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
            if !valid {
                p.add(format!(
                    "router_table/message_table: {name:?} is not a DynamoDB table name (3-255 of a-z A-Z 0-9 _ - .)"
                ));
            }
        }
        let log_format = match l.log_format.as_deref() {
            Some("json") => LogFormat::Json,
            Some("human") | None => LogFormat::Human,
            Some(other) => {
                let log_format = name("log_format");
                p.add(format!("{log_format} must be human or json, got {other:?}"));
                LogFormat::Human
            }
        };
        let at_least_1 = |p: &mut Problems, name: &str, value: Option<usize>| match value {
            Some(0) => {
                p.add(format!("{name} must be at least 1"));
                1
            }
            other => other.unwrap_or_default(),
        };
        let mut secs = |name: &str, value: Option<f64>| {
            p.take(seconds(name, value.unwrap_or_default()), Duration::MAX)
        };
        let hello_timeout = secs(&name("hello_timeout"), l.hello_timeout);
        let auto_ping_interval = secs(&name("auto_ping_interval"), l.auto_ping_interval);
        let auto_ping_timeout = secs(&name("auto_ping_timeout"), l.auto_ping_timeout);
        let min_ping_interval = secs(&name("min_ping_interval"), l.min_ping_interval);
        let wake_interval = secs(&name("wake_interval"), l.wake_interval);
        let mut nonzero = |name: &str, value: Option<f64>| {
            p.take(timeout(name, value.unwrap_or_default()), Duration::MAX)
        };
        let sweep_interval = nonzero(&name("sweep_interval"), l.sweep_interval);
        let statsd_flush_interval =
            nonzero(&name("statsd_flush_interval"), l.statsd_flush_interval);
        let ws_send_timeout = nonzero(&name("ws_send_timeout"), l.ws_send_timeout);
        let http_header_timeout = nonzero(&name("http_header_timeout"), l.http_header_timeout);
        let http_idle_timeout = nonzero(&name("http_idle_timeout"), l.http_idle_timeout);
        let http_body_timeout = nonzero(&name("http_body_timeout"), l.http_body_timeout);
        let drop_idle_users_after = match l.drop_idle_users_after_days.unwrap_or_default() {
            0.0 => None,
            days => p
                .take(
                    Duration::try_from_secs_f64(days * 86_400.0).map_err(|_| {
                        format!(
                            "{} must be a non-negative number",
                            name("drop_idle_users_after_days")
                        )
                    }),
                    Duration::ZERO,
                )
                .into(),
        };
        let mut rate_of = |name: &str, value: Option<String>| {
            p.take(rate(name, &value.unwrap_or_default()), None)
        };
        let rates = [
            rate_of(&name("sender_limit"), l.sender_limit),
            rate_of(&name("subscription_limit"), l.subscription_limit),
            rate_of(&name("source_ip_limit"), l.source_ip_limit),
            rate_of(&name("registration_limit"), l.registration_limit),
            rate_of(&name("new_uaid_limit"), l.new_uaid_limit),
            rate_of(&name("bridge_app_limit"), l.bridge_app_limit),
            rate_of(&name("matrix_gateway_limit"), l.matrix_gateway_limit),
        ];
        let [
            sender,
            subscription,
            source_ip,
            registration,
            new_uaid,
            bridge_app,
            matrix_gateway,
        ] = rates;
        let senders = p.take(
            sender_limits(&name("sender_limits"), l.sender_limits.as_deref()),
            Vec::new(),
        );
        let limits = RateLimits {
            sender,
            senders,
            subscription,
            source_ip,
            registration,
            new_uaid,
            bridge_app,
            matrix_gateway,
            max_keys: at_least_1(&mut p, &name("limiter_max_keys"), l.limiter_max_keys),
            trusted_proxies: p.take(
                networks(&name("trusted_proxies"), l.trusted_proxies.as_deref()),
                Vec::new(),
            ),
        };
        let http = HttpLimits {
            header_timeout: http_header_timeout,
            idle_timeout: http_idle_timeout,
            body_timeout: http_body_timeout,
            max_connections: at_least_1(
                &mut p,
                &name("max_http_connections"),
                l.max_http_connections,
            ),
        };
        let settings = Settings {
            host: l.host.unwrap_or_default(),
            port: l.port.unwrap_or_default(),
            router_host: l.router_host.unwrap_or_default(),
            router_port: l.router_port.unwrap_or_default(),
            node_url: l
                .node_url
                .unwrap_or_default()
                .trim_end_matches('/')
                .to_owned(),
            endpoint_port: l.endpoint_port.unwrap_or_default(),
            endpoint_url,
            tls,
            db,
            db_cache,
            journal_dir,
            journal_window,
            tables,
            crypto_key,
            auth_key,
            router_key,
            msg_limit: l.msg_limit.unwrap_or_default(),
            durable_direct: l.durable_direct.unwrap_or_default(),
            receipt_retention: l.receipt_retention.unwrap_or_default(),
            max_channels: at_least_1(&mut p, &name("max_channels"), l.max_channels),
            sweep_interval,
            drop_idle_users_after,
            max_data_bytes: l.max_data_bytes.unwrap_or_default(),
            hello_timeout,
            auto_ping_interval,
            auto_ping_timeout,
            min_ping_interval,
            max_connections: match l.max_connections {
                Some(0) => {
                    p.add(format!("{} must be at least 1", name("max_connections")));
                    None
                }
                other => other,
            },
            ws_send_timeout,
            wake: WakeSettings {
                threshold: p.take(
                    urgency(&name("wake_threshold"), l.wake_threshold.as_deref()),
                    Urgency::Normal,
                ),
                interval: wake_interval,
            },
            limits,
            http,
            unsigned_node_calls_from: p.take(
                networks(
                    &name("unsigned_node_calls_from"),
                    l.unsigned_node_calls_from.as_deref(),
                ),
                Vec::new(),
            ),
            autopush_rs_nodes: p.take(
                networks(&name("autopush_rs_nodes"), l.autopush_rs_nodes.as_deref()),
                Vec::new(),
            ),
            vapid_cache_size: l.vapid_cache_size.unwrap_or_default(),
            metrics_port: l.metrics_port,
            statsd: p.take(l.statsd_host.as_deref().map(parse_statsd).transpose(), None),
            statsd_flush_interval,
            statsd_label: l.statsd_label.unwrap_or_default(),
            log_format,
            bridges,
            sources: sources.clone(),
            reread: l.reread,
        };
        (settings, p)
    }

    /// The VAPID `aud` senders must use: the origin of `endpoint_url`.
    pub fn endpoint_origin(&self) -> String {
        let after_scheme = self.endpoint_url.find("://").map_or(0, |i| i + 3);
        match self.endpoint_url[after_scheme..].find('/') {
            Some(slash) => self.endpoint_url[..after_scheme + slash].to_owned(),
            None => self.endpoint_url.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsigned_node_calls_name_addresses_and_networks_never_everyone() {
        let nets = networks("n", Some(" 10.0.2.7 , 10.0.3.9/24,::1")).unwrap();
        let shown: Vec<String> = nets.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10.0.2.7/32", "10.0.3.0/24", "::1/128"]);
        assert!(networks("n", None).unwrap().is_empty());
        assert!(
            networks("n", Some("0.0.0.0/0"))
                .unwrap_err()
                .contains("every address")
        );
        assert!(networks("n", Some("::/0")).is_err());
        assert!(networks("n", Some("example.com")).is_err());
    }

    #[test]
    fn sender_limits_name_keys_by_their_hash_and_refuse_what_is_not_one() {
        use sha2::{Digest, Sha256};
        let key = "BCdPnPTMwkQ4ASavS7d6K3u50FNrhaphBqiK_yRi1vyxL6CsFD1GHNxMd5KiXyQX5cWG7_U2MJWgFnYMO5sk3Tc";
        let hash: [u8; 32] = Sha256::digest(crate::vapid::decode_public_key(key).unwrap()).into();
        let limits = sender_limits("--sender-limits", Some(&format!("  {key}=0.5,20 "))).unwrap();
        assert_eq!(limits, [(hash, Rate::new(0.5, 20.0))]);
        let unlimited = sender_limits("--sender-limits", Some(&format!("{key}=0"))).unwrap();
        assert_eq!(unlimited, [(hash, None)]);
        assert!(sender_limits("--sender-limits", None).unwrap().is_empty());
        for bad in [
            key.to_owned(),
            format!("{key}=fast"),
            format!("{}=1,1", &key[1..]),
            format!("{key}=1,1 {key}=2,2"),
        ] {
            let error = sender_limits("--sender-limits", Some(&bad)).unwrap_err();
            assert!(error.starts_with("--sender-limits"), "{bad}: {error}");
            let entry = bad.split(' ').next_back().unwrap();
            assert!(error.contains(entry), "{bad}: {error}");
        }
    }

    #[test]
    fn bigtable_takes_autopush_rs_dsn_and_db_settings() {
        let layer = |db: &str, db_settings: Option<&str>| SettingsLayer {
            db: Some(db.into()),
            db_settings: db_settings.map(str::to_owned),
            ..Default::default()
        };
        let table = r#"{"table_name": "projects/p/instances/i/tables/autopush"}"#;
        let s = Settings::from_layer(layer("grpc://bigtable.example:443", Some(table))).unwrap();
        // Receipts off unless asked for: autopush-rs cannot read their rows.
        assert_eq!(s.receipt_retention, 0);
        let asked = SettingsLayer {
            receipt_retention: Some(60),
            ..layer("grpc://h:1", Some(table))
        };
        assert_eq!(Settings::from_layer(asked).unwrap().receipt_retention, 60);
        let Db::Bigtable(bigtable) = s.db else {
            panic!("not Bigtable: {:?}", s.db)
        };
        assert_eq!(
            bigtable.table_name,
            "projects/p/instances/i/tables/autopush"
        );
        assert_eq!(bigtable.families.message_topic, "message_topic");
        let e = Settings::from_layer(layer("grpc://h:1", None)).unwrap_err();
        assert!(e.contains("table_name"), "{e}");
        let e = Settings::from_layer(layer("dynamodb", Some(table))).unwrap_err();
        assert!(e.contains("db_settings applies to a Bigtable --db"), "{e}");
    }

    #[test]
    fn postgres_takes_a_dsn_and_autopush_rs_db_settings() {
        let layer = |db: &str, db_settings: Option<&str>| SettingsLayer {
            db: Some(db.into()),
            db_settings: db_settings.map(str::to_owned),
            ..Default::default()
        };
        let tables = r#"{"schema": "push", "router_table": "r", "pool_size": 8}"#;
        let s =
            Settings::from_layer(layer("postgres://push:pw@db/autopush", Some(tables))).unwrap();
        let Db::Postgres(postgres) = &s.db else {
            panic!("not PostgreSQL: {:?}", s.db)
        };
        assert_eq!(postgres.qualified(&postgres.router_table), "push.r");
        assert_eq!(postgres.pool_size, 8);
        // Receipts are in a table of their own, which autopush-rs never reads.
        assert_eq!(s.receipt_retention, 86_400);
        let e =
            Settings::from_layer(layer("postgres://u:pw@h/d", Some(r#"{"x": 1}"#))).unwrap_err();
        assert!(e.contains("unknown key") && !e.contains("pw"), "{e}");
    }

    #[test]
    fn dynamodb_table_names_are_checked() {
        let layer = |db: &str, router: &str| SettingsLayer {
            db: Some(db.into()),
            router_table: Some(router.into()),
            ..SettingsLayer::default()
        };
        let s = Settings::from_layer(layer("dynamodb", "push_router")).unwrap();
        assert_eq!(s.tables.router, "push_router");
        assert_eq!(s.tables.message, "message");
        let e = Settings::from_layer(layer("./data", "push_router")).unwrap_err();
        assert!(
            e.contains("--router-table applies to --db dynamodb only"),
            "{e}"
        );
        let e = Settings::from_layer(layer("dynamodb", "no spaces")).unwrap_err();
        assert!(e.contains("not a DynamoDB table name"), "{e}");
    }

    #[test]
    fn message_table_rotation_is_off_by_default_and_needs_dynamodb() {
        let dynamodb = SettingsLayer {
            db: Some("dynamodb".into()),
            ..SettingsLayer::default()
        };
        assert!(
            !Settings::from_layer(dynamodb.clone())
                .unwrap()
                .tables
                .rotate_messages
        );
        let rotating = SettingsLayer {
            message_table_rotation: Some(true),
            ..dynamodb
        };
        assert!(
            Settings::from_layer(rotating.clone())
                .unwrap()
                .tables
                .rotate_messages
        );
        let embedded = SettingsLayer {
            db: None,
            ..rotating
        };
        let e = Settings::from_layer(embedded).unwrap_err();
        assert!(
            e.contains("--message-table-rotation applies to --db dynamodb only"),
            "{e}"
        );
    }

    #[test]
    fn the_embedded_store_cache_is_64_mib_unless_asked() {
        let s = Settings::from_layer(SettingsLayer::default()).unwrap();
        assert_eq!(s.db_cache, 64 << 20);
        let asked = SettingsLayer {
            db_cache_mib: Some(8),
            ..SettingsLayer::default()
        };
        assert_eq!(Settings::from_layer(asked).unwrap().db_cache, 8 << 20);
        let none = SettingsLayer {
            db_cache_mib: Some(0),
            ..SettingsLayer::default()
        };
        let e = Settings::from_layer(none).unwrap_err();
        assert!(e.contains("--db-cache-mib must be at least 1"), "{e}");
        let dynamodb = SettingsLayer {
            db: Some("dynamodb".into()),
            db_cache_mib: Some(8),
            ..SettingsLayer::default()
        };
        let e = Settings::from_layer(dynamodb).unwrap_err();
        assert!(
            e.contains("--db-cache-mib applies to the embedded store only"),
            "{e}"
        );
    }

    #[test]
    fn a_journal_directory_is_for_a_shared_store_only() {
        let journal = Some(PathBuf::from("/var/lib/autopush/journal"));
        let embedded = SettingsLayer {
            journal_dir: journal.clone(),
            ..SettingsLayer::default()
        };
        let e = Settings::from_layer(embedded).unwrap_err();
        assert!(
            e.contains("--journal-dir applies to a shared store only"),
            "{e}"
        );
        let dynamodb = SettingsLayer {
            db: Some("dynamodb".into()),
            journal_dir: journal.clone(),
            ..SettingsLayer::default()
        };
        assert_eq!(Settings::from_layer(dynamodb).unwrap().journal_dir, journal);
    }

    #[test]
    fn a_journal_window_is_for_a_journal_and_bounded() {
        let window = |db: &str, dir: Option<&str>, secs: Option<f64>| {
            let layer = SettingsLayer {
                db: Some(db.into()),
                journal_dir: dir.map(PathBuf::from),
                journal_window: secs,
                ..SettingsLayer::default()
            };
            Settings::from_layer(layer).map(|s| s.journal_window)
        };
        assert_eq!(window("dynamodb", None, None), Ok(Duration::from_secs(10)));
        assert_eq!(
            window("dynamodb", None, Some(0.5)),
            Ok(Duration::from_millis(500))
        );
        for (secs, says) in [
            (0.0, "--journal-window must be more than 0 seconds"),
            (-1.0, "--journal-window"),
            (3601.0, "--journal-window must be at most 3600 seconds"),
        ] {
            let e = window("dynamodb", None, Some(secs)).unwrap_err();
            assert!(e.contains(says), "{secs}: {e}");
        }
        for (db, dir) in [("dynamodb", Some("off")), ("/var/lib/autopush", None)] {
            let e = window(db, dir, Some(30.0)).unwrap_err();
            assert!(
                e.contains("--journal-window applies to a node with a journal only"),
                "{db}: {e}"
            );
        }
    }

    #[test]
    fn a_shared_store_journals_by_default_unless_turned_off() {
        let on = |db: &str, dir: Option<&str>| {
            let table = r#"{"table_name": "projects/p/instances/i/tables/autopush"}"#;
            let layer = SettingsLayer {
                db: Some(db.into()),
                db_settings: db.starts_with("grpc://").then(|| table.into()),
                journal_dir: dir.map(PathBuf::from),
                ..SettingsLayer::default()
            };
            Settings::from_layer(layer).unwrap().journal_dir
        };
        let default = Some(PathBuf::from("./autopush-journal"));
        assert_eq!(on("dynamodb", None), default);
        assert_eq!(on("grpc://127.0.0.1:8086", None), default);
        assert_eq!(on("postgres://autopush@db/autopush", None), default);
        assert_eq!(on("dynamodb", Some("off")), None);
        assert_eq!(on("dynamodb", Some("./off")), Some(PathBuf::from("./off")));
        assert_eq!(on("/var/lib/autopush", None), None);
        assert_eq!(on("/var/lib/autopush", Some("off")), None);
    }

    #[test]
    fn defaults_match_the_design() {
        let s = Settings::from_layer(SettingsLayer::default()).unwrap();
        assert_eq!(
            (s.port, s.router_port, s.endpoint_port, s.msg_limit),
            (8080, 8081, 8082, 100)
        );
        assert_eq!(s.endpoint_url, "http://localhost:8082");
        assert_eq!(s.node_url, "http://127.0.0.1:8081");
        assert_eq!(s.db, Db::Embedded(PathBuf::from("./autopush-data")));
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autopush.toml");
        std::fs::write(&path, "port = 9000\nendpoint_port = 9002\nmsg_limit = 7\n").unwrap();
        let flags = SettingsLayer {
            port: Some(7000),
            ..Default::default()
        };
        let s = Settings::resolve(flags, Some(&path)).unwrap();
        assert_eq!((s.port, s.endpoint_port, s.msg_limit), (7000, 9002, 7));
        assert_eq!(s.endpoint_url, "http://localhost:9002");
    }

    #[test]
    fn unknown_file_keys_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autopush.toml");
        // At the top (beside the bridges' keys, which serde reads through
        // flattened sections), and inside a bridge's table.
        for (file, key) in [
            ("prot = 9000\n[fcm.apps]\n", "prot"),
            ("[gcm]\napss = {}\n", "apss"),
        ] {
            std::fs::write(&path, file).unwrap();
            let err = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap_err();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn every_problem_is_named_in_one_error() {
        let layer = SettingsLayer {
            log_format: Some("xml".into()),
            max_channels: Some(0),
            sender_limit: Some("fast".into()),
            db: Some("grpc://h:1".into()),
            ..Default::default()
        };
        let err = Settings::from_layer(layer).unwrap_err();
        assert!(err.starts_with("4 problems with the settings:"), "{err}");
        for name in [
            "--log-format",
            "--max-channels",
            "--sender-limit",
            "table_name",
        ] {
            assert!(err.contains(name), "{name}: {err}");
        }
    }

    #[test]
    fn lines_redact_secrets_and_inline_key_material() {
        let mut layer = SettingsLayer {
            auth_key: Some(Secret::new("auth-secret-2")),
            ..Default::default()
        };
        layer.bridges.apns.apns = Some(
            autopush_apns::settings::ApnsSettings::from_json(
                r#"{"a": {"key": "-----BEGIN secret-pem", "key_id": "K", "team_id": "T", "topic": "t"},
                    "b": {"key": "/etc/apns/b.p8", "key_id": "K", "team_id": "T", "topic": "t"}}"#,
            )
            .unwrap(),
        );
        let lines = layer.with_defaults().lines(false).unwrap().join("\n");
        assert!(
            lines.contains("# auth_key: set, and left out here: a secret goes in the systemd credential auth_key or in the file auth_key_file names"),
            "{lines}"
        );
        assert!(lines.contains("/etc/apns/b.p8"), "{lines}");
        assert!(lines.contains("# crypto_key: not set"), "{lines}");
        assert!(lines.contains("port = 8080"), "{lines}");
        for secret in ["auth-secret-2", "secret-pem"] {
            assert!(!lines.contains(secret), "{secret} in {lines}");
        }
    }

    #[test]
    fn debug_output_never_shows_keys() {
        let layer = SettingsLayer {
            crypto_key: Some(Secret::new("crypto-secret-1")),
            auth_key: Some(Secret::new("auth-secret-2")),
            router_key: Some(Secret::new("router-secret-3")),
            ..Default::default()
        };
        let settings = Settings::from_layer(layer.clone()).unwrap();
        let shown = format!("{layer:?} {settings:?} {settings:#?}");
        for key in ["crypto-secret-1", "auth-secret-2", "router-secret-3"] {
            assert!(!shown.contains(key), "{key} in {shown}");
        }
        assert!(shown.contains("[redacted]"), "{shown}");
    }

    #[test]
    fn http_limits_refuse_zero() {
        for layer in [
            SettingsLayer {
                http_header_timeout: Some(0.0),
                ..Default::default()
            },
            SettingsLayer {
                max_http_connections: Some(0),
                ..Default::default()
            },
            SettingsLayer {
                ws_send_timeout: Some(0.0),
                ..Default::default()
            },
        ] {
            let err = Settings::from_layer(layer).unwrap_err();
            assert!(err.contains("must be"), "{err}");
        }
        let s = Settings::from_layer(SettingsLayer::default()).unwrap();
        assert_eq!(s.http.max_connections, 1024);
    }

    #[test]
    fn wake_settings_default_to_normal_and_30_s_and_refuse_nonsense() {
        let s = Settings::from_layer(SettingsLayer::default()).unwrap();
        assert_eq!(s.wake.threshold, Urgency::Normal);
        assert_eq!(s.wake.interval, Duration::from_secs(30));
        let s = Settings::from_layer(SettingsLayer {
            wake_threshold: Some("very-low".into()),
            wake_interval: Some(0.5),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.wake.threshold, Urgency::VeryLow);
        assert_eq!(s.wake.interval, Duration::from_millis(500));
        let err = Settings::from_layer(SettingsLayer {
            wake_threshold: Some("urgent".into()),
            wake_interval: Some(-1.0),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            err.contains("--wake-threshold must be very-low, low, normal or high"),
            "{err}"
        );
        assert!(err.contains("--wake-interval"), "{err}");
    }

    #[test]
    fn a_store_url_not_served_is_refused_never_a_directory() {
        for url in ["mysql://u:pw@127.0.0.1:5999/autopush", "redis://h:6379"] {
            let layer = SettingsLayer {
                db: Some(url.into()),
                ..Default::default()
            };
            let err = Settings::from_layer(layer).unwrap_err();
            let scheme = url.split("://").next().unwrap();
            assert!(err.contains(&format!("--db: a {scheme}:// store")), "{err}");
            assert!(
                err.contains("`dynamodb`") && err.contains("grpc://"),
                "{err}"
            );
            assert!(!err.contains("pw"), "the URL's password in {err}");
        }
    }

    #[test]
    fn an_unknown_key_is_named_with_the_nearest_known_one() {
        let known = ["port", "router_port", "crypto_key", "log_format"];
        assert_eq!(nearest("prot", known.into_iter()), Some("port"));
        assert_eq!(nearest("cryptokey", known.into_iter()), Some("crypto_key"));
        assert_eq!(nearest("log_fromat", known.into_iter()), Some("log_format"));
        assert_eq!(nearest("colour", known.into_iter()), None);
    }

    #[test]
    fn apns_channels_from_file_tables_or_env_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autopush.toml");
        std::fs::write(
            &path,
            "[apns.channels.firefox]\ncert = \"c.pem\"\nkey = \"k.pem\"\ntopic = \"org.example.app\"\nsandbox = true\n",
        )
        .unwrap();
        let s = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap();
        assert!(s.bridges.apns.settings().channels["firefox"].sandbox);
        // The environment's JSON replaces the file's channels.
        let mut flags = SettingsLayer::default();
        flags.bridges.apns.apns = Some(
            autopush_apns::settings::ApnsSettings::from_json(
                r#"{"beta": {"key": "k.p8", "key_id": "K", "team_id": "T", "topic": "t"}}"#,
            )
            .unwrap(),
        );
        let s = Settings::resolve(flags, Some(&path)).unwrap();
        let channels = s.bridges.apns.settings().channels;
        assert_eq!(channels.keys().collect::<Vec<_>>(), ["beta"]);

        std::fs::write(
            &path,
            "[apns.channels.firefox]\ncert = \"c.pem\"\nkey = \"k.pem\"\ntopic = \"t\"\nkeyid = \"K\"\n",
        )
        .unwrap();
        let err = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap_err();
        assert!(
            err.contains("\"firefox\"") && err.contains("keyid"),
            "{err}"
        );
    }

    #[test]
    fn bridge_apps_come_from_the_file_or_the_environment_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autopush.toml");
        std::fs::write(
            &path,
            "[fcm.apps.myapp]\nproject_id = \"p1\"\ncredential = \"/etc/sa.json\"\ntimeout = 2.5\n\
             [gcm.apps.123456]\nproject_id = \"p2\"\ncredential = \"/etc/sa2.json\"\n",
        )
        .unwrap();
        let s = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap();
        let (fcm, gcm) = (s.bridges.fcm.apps().unwrap(), s.bridges.gcm.apps().unwrap());
        assert_eq!(fcm["myapp"].project_id, "p1");
        assert_eq!(fcm["myapp"].timeout, Some(2.5));
        assert_eq!(gcm["123456"].project_id, "p2");

        let secret =
            r#"{"other": {"project_id": "p3", "credential": "{\"private_key\": \"pk-secret\"}"}}"#;
        let mut flags = SettingsLayer::default();
        flags.bridges.fcm.fcm_credentials = Some(secret.into());
        let s = Settings::resolve(flags.clone(), Some(&path)).unwrap();
        let fcm = s.bridges.fcm.apps().unwrap();
        assert_eq!(fcm.keys().collect::<Vec<_>>(), ["other"]);
        assert_eq!(s.bridges.gcm.apps().unwrap()["123456"].project_id, "p2");
        let shown = format!("{flags:?} {s:?}");
        assert!(!shown.contains("pk-secret"), "{shown}");

        std::fs::write(&path, "[fcm.apps.myapp]\nproject = \"p1\"\n").unwrap();
        let err = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap_err();
        assert!(err.contains("project"), "{err}");
        let mut flags = SettingsLayer::default();
        flags.bridges.gcm.gcm_credentials = Some("not json".into());
        let s = Settings::resolve(flags, None).unwrap();
        let err = s.bridges.gcm.apps().unwrap_err();
        assert!(err.contains("AUTOPUSH_GCM_CREDENTIALS"), "{err}");
    }

    #[test]
    fn tls_needs_both_files_and_makes_the_default_endpoint_https() {
        let err = Settings::from_layer(SettingsLayer {
            tls_cert: Some("cert.pem".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            err.contains("--tls-cert") && err.contains("--tls-key"),
            "{err}"
        );
        let s = Settings::from_layer(SettingsLayer {
            tls_cert: Some("cert.pem".into()),
            tls_key: Some("key.pem".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.endpoint_url, "https://localhost:8082");
        let tls = s.tls.expect("TLS on");
        assert_eq!((tls.cert, tls.key), ("cert.pem".into(), "key.pem".into()));
        // From the file, as TOML keys.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autopush.toml");
        std::fs::write(
            &path,
            "tls_cert = \"/etc/c.pem\"\ntls_key = \"/etc/k.pem\"\n",
        )
        .unwrap();
        let s = Settings::resolve(SettingsLayer::default(), Some(&path)).unwrap();
        assert_eq!(s.tls.map(|t| t.key), Some("/etc/k.pem".into()));
    }

    #[test]
    fn origin_drops_the_path() {
        let layer = SettingsLayer {
            endpoint_url: Some("https://push.example.com:8443/base/".into()),
            ..Default::default()
        };
        let s = Settings::from_layer(layer).unwrap();
        assert_eq!(s.endpoint_origin(), "https://push.example.com:8443");
    }
}
