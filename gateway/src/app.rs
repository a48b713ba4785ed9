//! Wiring: open storage, build the router registry, bind the listeners, and
//! run the roles this process plays.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use autopush_common::RouterType;
use autopush_common::bridge::AppLimits;
use autopush_common::endpoint::EndpointCrypto;
use autopush_common::limit::AddressLimiter;
use autopush_common::node::LocalNode;
use autopush_common::node_auth::NodeKeys;
use autopush_common::router::RouterRegistry;
use autopush_connection::{ClientRegistry, ConnectionSettings, NodeContext, server};
use autopush_registration::{RegistrationState, SecretKeys};
use autopush_serving::health::HealthCheck;
use autopush_serving::tls::{self, Certificates, TlsAcceptor};
use autopush_storage::bigtable::{BigtableSettings, BigtableStore};
use autopush_storage::dynamodb::DynamoStore;
use autopush_storage::embedded::EmbeddedStore;
use autopush_storage::metered::MeteredStorage;
use autopush_storage::postgres::{PostgresSettings, PostgresStore};
use autopush_storage::{Storage, StorageError};
use autopush_webpush::{NodeClient, NodeJournal};
use autopush_webpush::{Waker, WebPushRouter};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::bridges::Bridges;
use crate::endpoint::{self, EndpointState};
use crate::keys::{self, Key, Planned};
use crate::limits;
use crate::settings::{Db, Problems, Settings};
use crate::vapid::VapidVerifier;

/// The roles a process plays.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// Connection and endpoint in one process (the default).
    All,
    Connection,
    Endpoint,
}

impl Mode {
    fn connection(self) -> bool {
        matches!(self, Mode::All | Mode::Connection)
    }

    fn endpoint(self) -> bool {
        matches!(self, Mode::All | Mode::Endpoint)
    }
}

/// The configured backend, with every operation's latency and failures
/// recorded (`storage.time`, `storage.error`).
pub async fn open_storage(settings: &Settings) -> Result<Arc<dyn Storage>, String> {
    let (backend, name): (Arc<dyn Storage>, _) = match &settings.db {
        Db::Embedded(dir) => (
            Arc::new(
                open_embedded(dir, settings.db_cache)?
                    .with_receipt_retention(settings.receipt_retention),
            ),
            "embedded",
        ),
        Db::DynamoDb => {
            let store = open_dynamodb(settings).await?;
            let store = store.with_receipt_retention(settings.receipt_retention);
            (answering(store, "dynamodb").await?, "dynamodb")
        }
        Db::Bigtable(bigtable) => {
            let store = open_bigtable(bigtable).await?;
            let store = store.with_receipt_retention(settings.receipt_retention);
            (answering(store, "bigtable").await?, "bigtable")
        }
        Db::Postgres(postgres) => {
            let store = open_postgres(postgres)?.with_receipt_retention(settings.receipt_retention);
            (answering(store, "postgres://...").await?, "postgres")
        }
    };
    Ok(Arc::new(MeteredStorage::new(backend, name)))
}

/// The connection node's own journal in `dir`, made if missing, once what
/// it held is moved to the shared store (before the node serves anyone).
async fn open_journal(
    dir: &Path,
    settings: &Settings,
    storage: &Arc<dyn Storage>,
    nodes: &NodeClient,
) -> Result<Arc<NodeJournal>, String> {
    let name = dir.display();
    if !check_data_dir(dir, "--journal-dir")? {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("--journal-dir {name}: cannot create it: {e}"))?;
    }
    let journal = NodeJournal::open(
        dir,
        &settings.node_url,
        storage.clone(),
        nodes.clone(),
        settings.journal_window,
        settings.receipt_retention,
    )
    .map_err(|e| match e {
        StorageError::InUse(_) => format!(
            "--journal-dir {name} is in use by another node: give each node a journal of its own"
        ),
        e => format!("--journal-dir {name}: {e}"),
    })?;
    journal.recover().await.map_err(|e| {
        format!("--journal-dir {name}: cannot move the copies it holds to the shared store: {e}")
    })?;
    info!(journal_dir = %name, "the node's journal of direct copies is open");
    Ok(Arc::new(journal))
}

/// A remote store once it answers: missing tables or refused credentials
/// stop start-up here rather than as 503s on the first pushes.
async fn answering<S: Storage + 'static>(store: S, db: &str) -> Result<Arc<dyn Storage>, String> {
    store
        .health_check()
        .await
        .map_err(|e| format!("--db {db}: {e} (`autopush db preflight` says what is missing)"))?;
    Ok(Arc::new(store))
}

/// The embedded store in `dir`, created if missing, keeping up to `cache`
/// bytes of its file in memory; every refusal names the directory and says
/// what is wrong with it.
pub(crate) fn open_embedded(dir: &Path, cache: usize) -> Result<EmbeddedStore, String> {
    let name = dir.display();
    if !check_data_dir(dir, "--db")? {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("--db {name}: cannot create the data directory: {e}"))?;
    }
    let store =
        EmbeddedStore::open_with_cache(dir, cache).map_err(|e| format!("--db {name}: {e}"))?;
    // A relative --db depends on where the service was started from: say
    // where the data (and the keys every issued endpoint depends on) is.
    let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    info!(data_dir = %absolute.display(), "embedded store open");
    Ok(store)
}

/// Whether the embedded store's directory exists, checked without making
/// it: an existing one must be a directory this process can write (a probe
/// file is written and removed), a missing one must lie under a directory.
fn check_data_dir(dir: &Path, setting: &str) -> Result<bool, String> {
    let name = format!("{setting} {}", dir.display());
    match std::fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => Err(format!(
            "{name}: not a directory (the embedded store needs a directory, \
             or give `--db dynamodb`)"
        )),
        Ok(_) => {
            let probe = dir.join(format!(".write-check-{}", std::process::id()));
            std::fs::write(&probe, b"")
                .and_then(|()| std::fs::remove_file(&probe))
                .map_err(|e| format!("{name}: the data directory cannot be written: {e}"))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
            match absolute.ancestors().skip(1).find(|a| a.exists()) {
                Some(parent) if !parent.is_dir() => Err(format!(
                    "{name}: cannot create the data directory: {} is not a directory",
                    parent.display()
                )),
                _ => Ok(false),
            }
        }
        Err(e) => Err(format!("{name}: cannot use the data directory: {e}")),
    }
}

/// Refuse settings that cannot work in `mode`: split mode on the embedded
/// store, and two of this process's listeners on one port.
fn check_mode(mode: Mode, settings: &Settings) -> Result<(), String> {
    if let (Db::Embedded(dir), Mode::Connection | Mode::Endpoint) = (&settings.db, mode) {
        let role = if mode == Mode::Connection {
            "connection"
        } else {
            "endpoint"
        };
        return Err(format!(
            "`autopush {role}` is split mode, which needs a shared store (--db dynamodb or \
             bigtable): the embedded store \
             (--db {}) belongs to one process. Run `autopush all` on it instead",
            dir.display()
        ));
    }
    let mut listeners = Vec::new();
    if mode.connection() {
        listeners.push(("--port", settings.host.as_str(), settings.port));
        listeners.push((
            "--router-port",
            settings.router_host.as_str(),
            settings.router_port,
        ));
    }
    if let Some(port) = settings.metrics_port {
        listeners.push(("--metrics-port", settings.router_host.as_str(), port));
    }
    if mode.endpoint() {
        listeners.push((
            "--endpoint-port",
            settings.host.as_str(),
            settings.endpoint_port,
        ));
    }
    for (i, (a, a_host, a_port)) in listeners.iter().enumerate() {
        for (b, b_host, b_port) in &listeners[i + 1..] {
            // Port 0 asks for any free port: never the same one twice.
            if *a_port != 0 && a_port == b_port && hosts_overlap(a_host, b_host) {
                return Err(format!(
                    "{a} and {b} clash: both are {a_port}; give each its own port"
                ));
            }
        }
    }
    Ok(())
}

/// Whether listeners on `a` and `b` can want the same socket: the same
/// address, or either listening on every address.
fn hosts_overlap(a: &str, b: &str) -> bool {
    let every = |host: &str| {
        host.trim_matches(|c| c == '[' || c == ']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified())
    };
    a == b || every(a) || every(b)
}

/// The DynamoDB store of `--db dynamodb`, from the standard AWS configuration.
pub async fn open_dynamodb(settings: &Settings) -> Result<DynamoStore, String> {
    DynamoStore::connect(settings.tables.clone())
        .await
        .map_err(|e| e.to_string())
}

/// The Bigtable store of a Bigtable `--db`.
pub async fn open_bigtable(settings: &BigtableSettings) -> Result<BigtableStore, String> {
    if !settings.ignored.is_empty() {
        info!(
            keys = settings.ignored.join(", "),
            "db_settings: autopush-rs pool and timeout settings not used here"
        );
    }
    info!(
        endpoint = settings.endpoint,
        table = settings.table_name,
        emulator = settings.emulator,
        "Bigtable"
    );
    BigtableStore::connect(settings.clone())
        .await
        .map_err(|e| format!("--db bigtable: {e}"))
}

/// The PostgreSQL store of a `postgres://` --db; connections open as calls
/// need them.
pub fn open_postgres(settings: &PostgresSettings) -> Result<PostgresStore, String> {
    info!(
        hosts = settings.config.get_hosts().len(),
        schema = settings.schema.as_deref().unwrap_or("(search path)"),
        pool_size = settings.pool_size,
        sslmode = settings.tls.mode.name(),
        "PostgreSQL"
    );
    PostgresStore::connect(settings.clone()).map_err(|e| format!("--db postgres://...: {e}"))
}

/// How often a session refreshes its client's `last_connect`: daily, or a
/// quarter of a shorter idle window, so no connected client ever looks idle
/// to the sweep (or to `db drop-old-users`).
fn refresh_last_connect(drop_idle_users_after: Option<Duration>) -> Duration {
    let daily = Duration::from_secs(86_400);
    drop_idle_users_after.map_or(daily, |after| daily.min(after / 4))
}

/// A listener on `port` at each of `addresses` (those of one host
/// setting), bound while start-up checks the settings: a port another
/// process holds is named with the other problems, before anything is
/// made. `setting` names the port's setting.
fn bind(addresses: &[IpAddr], port: u16, setting: &str) -> Result<Vec<TcpListener>, String> {
    let mut listeners = Vec::new();
    for ip in addresses {
        let addr = SocketAddr::new(*ip, port);
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        };
        // As TcpListener::bind: a restarted service takes its port back
        // while the last one's connections linger in TIME_WAIT.
        let listener = socket
            .and_then(|socket| {
                socket.set_reuseaddr(true)?;
                socket.bind(addr)?;
                socket.listen(1024)
            })
            .map_err(|e| format!("{setting}: cannot listen on {addr}: {e}"))?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// Log where `listeners` (of the role `what`) listen.
fn listening(what: &str, listeners: &[TcpListener]) {
    for listener in listeners {
        if let Ok(bound) = listener.local_addr() {
            info!("{what} listening on {bound}");
        }
    }
}

/// Every port of this process, bound at check time.
#[derive(Default)]
struct Listeners {
    websocket: Vec<TcpListener>,
    router_api: Vec<TcpListener>,
    metrics: Vec<TcpListener>,
    endpoint: Vec<TcpListener>,
}

impl Listeners {
    /// Bind every port `mode` listens on; each one that cannot be is a
    /// problem, named by its setting.
    fn bind(
        mode: Mode,
        settings: &Settings,
        (hosts, router_hosts): (&[IpAddr], &[IpAddr]),
        problems: &mut Problems,
    ) -> Listeners {
        let mut port = |key: &str, addresses: &[IpAddr], port: u16| {
            let setting = format!("{} {port}", settings.sources.name(key));
            problems.take(bind(addresses, port, &setting), Vec::new())
        };
        let mut listeners = Listeners::default();
        if mode.connection() {
            listeners.websocket = port("port", hosts, settings.port);
            listeners.router_api = port("router_port", router_hosts, settings.router_port);
        }
        if let Some(metrics) = settings.metrics_port {
            listeners.metrics = port("metrics_port", router_hosts, metrics);
        }
        if mode.endpoint() {
            listeners.endpoint = port("endpoint_port", hosts, settings.endpoint_port);
        }
        listeners
    }
}

/// The addresses `--host` or `--router-host` (`setting`) names: an IP
/// address (IPv6 bare or in brackets, as in `::` or `[::1]`), or a name,
/// resolved at start-up: the service listens on every address it has
/// (`localhost`: 127.0.0.1 and ::1 where both are configured).
fn listen_addresses(setting: &str, host: &str) -> Result<Vec<IpAddr>, String> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![ip]);
    }
    let unresolved = |why: String| format!("{setting} {host}: cannot resolve the name: {why}");
    let resolved = std::net::ToSocketAddrs::to_socket_addrs(&(bare, 0))
        .map_err(|e| unresolved(e.to_string()))?;
    let mut addresses = Vec::new();
    for addr in resolved {
        if !addresses.contains(&addr.ip()) {
            addresses.push(addr.ip());
        }
    }
    match addresses.is_empty() {
        true => Err(unresolved("no address".into())),
        false => Ok(addresses),
    }
}

/// Where the key(s) that sign and check internal router API calls come
/// from. A key generated into the data directory is known to this machine
/// only, so a router API that other machines can reach needs a
/// configured, shared one.
fn router_keys(
    settings: &Settings,
    mode: Mode,
    router_hosts: &[IpAddr],
    data_dir: Option<&Path>,
) -> Result<Planned, String> {
    let loopback = router_hosts.iter().all(IpAddr::is_loopback);
    if mode.connection() && !loopback && settings.router_key.is_none() {
        return Err(format!(
            "--router-host {} lets other machines call the internal router API: give every \
             node the same --router-key (AUTOPUSH_ROUTER_KEY; make one with `autopush keygen`)",
            settings.router_host
        ));
    }
    let source = settings.sources.name("router_key");
    let configured = settings.router_key.as_ref().map(|k| (k, source.as_str()));
    keys::plan(Key::Router, configured, data_dir)
}

/// Start-up's findings, every setting, key and port checked before
/// anything was made: the ports are bound, but no directory is made, no
/// key written, no store opened. [`Checked::start`] does those.
pub struct Checked {
    mode: Mode,
    settings: Settings,
    crypto: Planned,
    auth: Option<Planned>,
    router: Planned,
    /// The certificate of the public ports, if they speak TLS.
    tls: Option<Arc<Certificates>>,
    /// `None` only with a problem named.
    bridges: Option<Arc<Bridges>>,
    listeners: Listeners,
}

/// Check everything `mode` needs from `settings` (with the `problems`
/// already found in them), touching nothing: one error names every
/// problem.
pub fn check(mode: Mode, settings: Settings, mut problems: Problems) -> Result<Checked, String> {
    let mode_ok = problems.take(check_mode(mode, &settings).map(|()| true), false);
    let data_dir = match (&settings.db, mode) {
        (Db::Embedded(dir), Mode::All) => Some(dir.as_path()),
        _ => None,
    };
    let db = settings.sources.name("db");
    // Keys kept in a store that cannot be used are not looked for: the
    // store is the one problem.
    let store_ok = !problems.failed("db")
        && match data_dir {
            Some(dir) => problems.take(check_data_dir(dir, &db).map(|_| true), false),
            None => true,
        };
    let hosts = problems.take(listen_addresses("--host", &settings.host), Vec::new());
    let router_hosts = match mode.connection() || settings.metrics_port.is_some() {
        true => problems.take(
            listen_addresses("--router-host", &settings.router_host),
            Vec::new(),
        ),
        false => Vec::new(),
    };
    let none = || Planned::Ready(Vec::new());
    let plan = |key: Key, setting: &str, configured: Option<&autopush_common::Secret>| {
        let source = settings.sources.name(setting);
        match configured {
            None if !store_ok => Ok(none()),
            _ => keys::plan(key, configured.map(|k| (k, source.as_str())), data_dir),
        }
    };
    let crypto = plan(Key::Crypto, "crypto_key", settings.crypto_key.as_ref());
    let crypto = problems.take(
        crypto.and_then(|planned| match &planned {
            Planned::Ready(keys) if !keys.is_empty() => {
                EndpointCrypto::new(keys, &settings.endpoint_url)
                    .map(|_| planned)
                    .map_err(|e| format!("{}: {e}", settings.sources.name("crypto_key")))
            }
            _ => Ok(planned),
        }),
        none(),
    );
    let auth = match mode.endpoint() {
        true => Some(problems.take(
            plan(Key::Auth, "auth_key", settings.auth_key.as_ref()),
            none(),
        )),
        false => None,
    };
    let router = match (&settings.router_key, store_ok) {
        (None, false) => none(),
        _ => problems.take(
            router_keys(&settings, mode, &router_hosts, data_dir),
            none(),
        ),
    };
    let tls = match &settings.tls {
        Some(files) => problems.take(Certificates::load(files).map(Some), None),
        None => None,
    };
    let limits = bridge_limits(&settings);
    let built = crate::bridges::bridges(&settings.bridges, &limits, settings.reread.clone());
    let bridges = problems.take(built.map(|(bridges, _)| Some(Arc::new(bridges))), None);
    // Two listeners on one port are one problem, already named.
    let listeners = match mode_ok {
        true => Listeners::bind(mode, &settings, (&hosts, &router_hosts), &mut problems),
        false => Listeners::default(),
    };
    let checked = Checked {
        mode,
        settings,
        crypto,
        auth,
        router,
        tls,
        bridges,
        listeners,
    };
    problems.or(checked)
}

/// A started service: its servers run until [`Running::wait`] returns or the
/// value is dropped.
pub struct Running {
    servers: JoinSet<()>,
    clients: Option<Arc<ClientRegistry>>,
}

/// What both roles share, built once per process.
struct Shared {
    storage: Arc<dyn Storage>,
    crypto: Arc<EndpointCrypto>,
    nodes: NodeClient,
    /// One storage check behind the health routes of every public port.
    health: Arc<HealthCheck>,
    /// The connection node's own journal of durable copies.
    journal: Option<Arc<NodeJournal>>,
}

/// Start the roles of `mode`. `bridges` adds routers for bridge router types
/// over those the settings configure (the webpush router is always present).
pub async fn start(
    mode: Mode,
    settings: &Settings,
    bridges: RouterRegistry,
) -> Result<Running, String> {
    check(mode, settings.clone(), Problems::default())?
        .start(bridges)
        .await
}

impl Checked {
    /// Make what is missing (the data directory, all-in-one keys), open
    /// the store, bind the ports and serve. `bridges` as for [`start`].
    pub async fn start(self, bridges: RouterRegistry) -> Result<Running, String> {
        let Checked {
            mode,
            settings,
            crypto,
            auth,
            router,
            tls,
            bridges: configured,
            listeners,
        } = self;
        let settings = &settings;
        let configured = configured.ok_or("the bridges were not built")?;
        let serves = configured.serves();
        let bridges = configured.registry().extend(bridges);
        let metrics = crate::metrics::install(
            settings.statsd.as_ref(),
            &settings.statsd_label,
            settings.statsd_flush_interval,
        )?;
        configured.report();
        let storage = open_storage(settings).await?;
        let crypto_keys = crypto.load()?;
        let nodes = NodeClient::new(NodeKeys::new(&router.load()?)?);
        let journal = match (&settings.journal_dir, mode.connection()) {
            (Some(dir), true) => Some(open_journal(dir, settings, &storage, &nodes).await?),
            _ => None,
        };
        let shared = Shared {
            crypto: Arc::new(EndpointCrypto::new(&crypto_keys, &settings.endpoint_url)?),
            nodes,
            health: HealthCheck::new(storage.clone()),
            storage,
            journal,
        };

        let mut servers = JoinSet::new();
        servers.spawn(
            tls::reloader(tls.clone(), tls::POLL_EVERY, move || configured.reload())
                .map_err(|e| format!("cannot handle SIGHUP: {e}"))?,
        );
        // Both public ports speak HTTP/1.1 only (see autopush_serving::http).
        let tls = tls.map(|certs| certs.acceptor(&[b"http/1.1"]));
        let sweep = autopush_storage::sweeper::SweepSettings {
            interval: settings.sweep_interval,
            drop_idle_users_after: settings.drop_idle_users_after,
        };
        servers.spawn(autopush_storage::sweeper::run(
            shared.storage.clone(),
            sweep.clone(),
        ));
        if let Some(journal) = &shared.journal {
            // Receipts of copies acked there, past their retention.
            let local = Arc::new(journal.local().clone());
            servers.spawn(autopush_storage::sweeper::run(local, sweep));
        }
        let Listeners {
            websocket,
            router_api,
            metrics: metrics_listeners,
            endpoint,
        } = listeners;
        let mut clients = None;
        if mode.connection() {
            let listen = (websocket, router_api);
            let tls = tls.clone();
            clients = Some(start_connection(
                settings,
                listen,
                (&shared, &bridges),
                &metrics,
                tls,
                &mut servers,
            ));
        }
        listening("metrics", &metrics_listeners);
        for listener in metrics_listeners {
            servers.spawn(crate::metrics::serve(
                listener,
                metrics.clone(),
                settings.http,
            ));
        }
        if let Some(auth) = auth {
            // In all-in-one mode the webpush router hands notifications to the
            // local connection node directly instead of over HTTP.
            let local = clients.clone().map(|c| c as Arc<dyn LocalNode>);
            let auth_keys = auth.load()?;
            info!("{serves}");
            let roles = (shared, bridges, local);
            start_endpoint(settings, endpoint, roles, &auth_keys, tls, &mut servers)?;
        }
        if mode.connection() {
            info!(endpoint_url = %settings.endpoint_url, node = %settings.node_url, ?mode, "autopush running");
        } else {
            // An endpoint node has no router API, so no node URL of its own.
            info!(endpoint_url = %settings.endpoint_url, ?mode, "autopush running");
        }
        Ok(Running { servers, clients })
    }
}

/// The connection role: the websocket port and the internal router API.
/// Returns the registry of the clients connected here.
fn start_connection(
    settings: &Settings,
    (websockets, router_apis): (Vec<TcpListener>, Vec<TcpListener>),
    (shared, bridges): (&Shared, &RouterRegistry),
    metrics: &PrometheusHandle,
    tls: Option<TlsAcceptor>,
    servers: &mut JoinSet<()>,
) -> Arc<ClientRegistry> {
    let registry = Arc::new(ClientRegistry::new(settings.node_url.clone()));
    let ctx = Arc::new(NodeContext {
        settings: ConnectionSettings {
            hello_timeout: settings.hello_timeout,
            auto_ping_interval: settings.auto_ping_interval,
            auto_ping_timeout: settings.auto_ping_timeout,
            min_ping_interval: settings.min_ping_interval,
            msg_limit: settings.msg_limit,
            max_channels: settings.max_channels,
            max_connections: settings
                .max_connections
                .unwrap_or_else(|| limits::default_max_connections(limits::raise_open_files())),
            send_timeout: settings.ws_send_timeout,
            refresh_last_connect: refresh_last_connect(settings.drop_idle_users_after),
            trusted_proxies: settings.limits.trusted_proxies.clone(),
            unsigned_node_calls_from: settings.unsigned_node_calls_from.clone(),
            ..ConnectionSettings::default()
        },
        storage: shared.storage.clone(),
        crypto: shared.crypto.clone(),
        registry: registry.clone(),
        nodes: shared.nodes.clone(),
        journal: shared.journal.clone(),
        open_sockets: Default::default(),
        new_uaids: settings
            .limits
            .new_uaid
            .map(|rate| AddressLimiter::new(rate, settings.limits.max_keys)),
        wake_bridges: bridges.clone(),
    });
    warn_migration(
        "unsigned PUT /push and PUT /notif are taken from these peers (autopush-rs's \
         endpoints), counted in node.unsigned_call; turn --unsigned-node-calls-from off \
         once no autopush-rs endpoint is left",
        &settings.unsigned_node_calls_from,
    );
    listening("websocket", &websockets);
    listening("internal router API", &router_apis);
    for websocket in websockets {
        servers.spawn(server::serve_websocket(
            websocket,
            tls.clone(),
            ctx.clone(),
            shared.health.clone(),
            settings.http,
        ));
    }
    for router_api in router_apis {
        servers.spawn(server::serve_router_api(
            router_api,
            ctx.clone(),
            crate::metrics::route(metrics.clone()),
            settings.http,
        ));
    }
    registry
}

/// Say at every start, loudly, that a migration setting names `networks`
/// and `what` that changes, so that it is not left on once done.
fn warn_migration(what: &str, networks: &[ipnet::IpNet]) {
    if networks.is_empty() {
        return;
    }
    let networks: Vec<String> = networks.iter().map(ToString::to_string).collect();
    warn!(networks = %networks.join(","), "MIGRATION: {what}");
}

/// The endpoint role: the public HTTP API (push, registration, health),
/// routing through the webpush router (handing to `local` clients when
/// this process also holds connections) and `bridges`, over `tls` if given.
fn start_endpoint(
    settings: &Settings,
    listeners: Vec<TcpListener>,
    (shared, bridges, local): (Shared, RouterRegistry, Option<Arc<dyn LocalNode>>),
    auth_keys: &[String],
    tls: Option<TlsAcceptor>,
    servers: &mut JoinSet<()>,
) -> Result<(), String> {
    let Shared {
        storage,
        crypto,
        nodes,
        health,
        journal,
    } = shared;
    let waker = Arc::new(Waker::new(storage.clone(), bridges.clone(), settings.wake));
    let webpush = Arc::new(
        WebPushRouter::new(storage.clone(), local, settings.durable_direct, nodes)
            .with_journal(journal)
            .with_waker(waker.clone())
            .with_autopush_rs_nodes(settings.autopush_rs_nodes.clone())
            .with_hold_limit(settings.msg_limit),
    );
    warn_migration(
        "answers naming no router API version from these addresses are autopush-rs's \
         connection nodes': a push they take leaves no durable copy; turn \
         --autopush-rs-nodes off once no autopush-rs node is left",
        &settings.autopush_rs_nodes,
    );
    let routers = RouterRegistry::default()
        .with(RouterType::WebPush, webpush.clone())
        .extend(bridges);
    let registration = Arc::new(RegistrationState {
        storage: storage.clone(),
        crypto: crypto.clone(),
        routers: routers.clone(),
        secrets: SecretKeys::new(auth_keys)?,
        max_channels: settings.max_channels,
        mailbox_limit: settings.msg_limit,
    });
    let state = Arc::new(EndpointState {
        crypto,
        storage,
        routers,
        registration,
        vapid: VapidVerifier::new(settings.endpoint_origin(), settings.vapid_cache_size),
        max_data_bytes: settings.max_data_bytes,
        durable_direct: settings.durable_direct,
        receipt_retention: settings.receipt_retention,
        health,
        fair_use: endpoint::fair_use::FairUse::new(&settings.limits),
        waker,
        webpush,
    });
    servers.spawn({
        let state = state.clone();
        async move {
            let mut every = tokio::time::interval(endpoint::fair_use::REPORT_EVERY);
            loop {
                every.tick().await;
                state.fair_use.report();
            }
        }
    });
    let routes = warp::service(endpoint::routes(state));
    listening("endpoint", &listeners);
    for listener in listeners {
        servers.spawn(autopush_serving::http::serve_with(
            listener,
            tls.clone(),
            routes.clone(),
            settings.http,
        ));
    }
    Ok(())
}

impl Running {
    /// Serve until SIGTERM or Ctrl-C, then close client connections cleanly.
    pub async fn wait(mut self) -> Result<(), String> {
        let stopped = tokio::select! {
            _ = self.servers.join_next() => Err("a server stopped unexpectedly".into()),
            _ = shutdown_signal() => {
                if let Some(clients) = &self.clients {
                    close_sessions(clients).await;
                }
                info!("shut down");
                Ok(())
            }
        };
        // What the last moments recorded (closed sessions among them).
        tokio::task::spawn_blocking(crate::metrics::flush_statsd)
            .await
            .ok();
        stopped
    }
}

/// The per-app rate every bridge applies (`--bridge-app-limit`).
pub fn bridge_limits(settings: &Settings) -> AppLimits {
    AppLimits::new(settings.limits.bridge_app, settings.limits.max_keys)
}

/// Run until the process is stopped.
pub async fn run(mode: Mode, settings: Settings) -> Result<(), String> {
    start(mode, &settings, RouterRegistry::default())
        .await?
        .wait()
        .await
}

/// Close every websocket and give sessions a moment to store what their
/// clients had not acknowledged, and the holders of their copies to move
/// them to storage (what a node's journal still holds after that moves at
/// its next start).
async fn close_sessions(clients: &ClientRegistry) {
    info!(
        clients = clients.len(),
        "shutting down: closing client connections"
    );
    clients.kick_all();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let busy = || clients.live_sessions() > 0 || !clients.held_copies().is_empty();
    while busy() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::SettingsLayer;

    fn settings(layer: SettingsLayer) -> Settings {
        Settings::from_layer(layer).unwrap()
    }

    #[test]
    fn a_split_node_needs_a_configured_router_key() {
        let s = settings(SettingsLayer::default());
        let loopback = [IpAddr::from([127, 0, 0, 1])];
        let err = router_keys(&s, Mode::Connection, &loopback, None).unwrap_err();
        assert!(err.contains("--router-key"), "{err}");
    }

    #[test]
    fn hosts_are_addresses_or_names() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        for (host, want) in [
            ("::", ip("::")),
            ("[::]", ip("::")),
            ("::1", ip("::1")),
            ("[::1]", ip("::1")),
            ("127.0.0.1", ip("127.0.0.1")),
        ] {
            assert_eq!(listen_addresses("--host", host).unwrap(), [want], "{host}");
        }
        let local = listen_addresses("--host", "localhost").unwrap();
        assert!(local.iter().all(IpAddr::is_loopback), "{local:?}");
        let err = listen_addresses("--host", "no-such-host.invalid").unwrap_err();
        assert!(err.contains("--host no-such-host.invalid"), "{err}");
    }

    #[test]
    fn refused_modes_and_clashing_ports() {
        let split = settings(SettingsLayer {
            db: Some("/some/dir".into()),
            ..Default::default()
        });
        for mode in [Mode::Connection, Mode::Endpoint] {
            let err = check_mode(mode, &split).unwrap_err();
            assert!(err.contains("--db dynamodb"), "{err}");
        }
        assert!(check_mode(Mode::All, &split).is_ok());
        let dynamodb = settings(SettingsLayer {
            db: Some("dynamodb".into()),
            ..Default::default()
        });
        assert!(check_mode(Mode::Connection, &dynamodb).is_ok());

        // An endpoint node does not listen on --port: no clash with it.
        let same = SettingsLayer {
            db: Some("dynamodb".into()),
            port: Some(9000),
            endpoint_port: Some(9000),
            ..Default::default()
        };
        assert!(check_mode(Mode::Endpoint, &settings(same.clone())).is_ok());
        let err = check_mode(Mode::All, &settings(same)).unwrap_err();
        assert!(err.contains("--port and --endpoint-port clash"), "{err}");
        // The metrics port is on the router host: 127.0.0.1 and 0.0.0.0 overlap.
        let metrics = SettingsLayer {
            metrics_port: Some(8080),
            ..Default::default()
        };
        let err = check_mode(Mode::All, &settings(metrics)).unwrap_err();
        assert!(err.contains("--port and --metrics-port"), "{err}");
        // Different specific addresses do not clash; port 0 never does.
        let apart = SettingsLayer {
            host: Some("10.0.0.5".into()),
            router_port: Some(8080),
            ..Default::default()
        };
        assert!(check_mode(Mode::All, &settings(apart)).is_ok());
        let any = SettingsLayer {
            port: Some(0),
            router_port: Some(0),
            endpoint_port: Some(0),
            ..Default::default()
        };
        assert!(check_mode(Mode::All, &settings(any)).is_ok());
    }
}
