//! The metrics every node reports, named in one place.
//!
//! Recording goes through the `metrics` facade; the `autopush` binary
//! installs the exporters (Prometheus text on `/metrics`, statsd when
//! configured). Until one is installed, recording costs next to nothing.
//!
//! Names follow Mozilla autopush's statsd names where a counterpart exists,
//! so dashboards carry over; Prometheus sees them with `.` turned into `_`.
//! Labels carry only bounded values (router types, app names from the
//! settings, status codes, errnos, close codes, outcomes): never a UAID,
//! token or key.

use crate::FastMap;
use std::sync::{LazyLock, PoisonError, RwLock};
use std::time::Duration;

use metrics::{Counter, Histogram, counter, gauge, histogram};

use crate::receipt::MessageState;
use crate::{ApiError, RouterType};

/// Pushes answered by the endpoint: `router_type`, `status`, `errno` (errors only).
pub const PUSHES: &str = "notification.received";
/// Accepted pushes by what became of them: `router_type`, `outcome`
/// (`direct`, `stored`, `dropped`).
pub const DELIVERIES: &str = "notification.delivery";
/// Accepted pushes by how their body is encrypted: `encoding` (`aes128gcm`,
/// `aesgcm`, `webpush-message` for a body of that media type, `none` without
/// a body), so an operator sees when the old `aesgcm` is no longer sent.
pub const ENCODINGS: &str = "notification.encoding";
/// Messages that reached a final state where this service settled them:
/// `router_type`, `state` (`delivered`, `deleted`, `bridged`, `dropped`...;
/// see [`crate::receipt::MessageState`]).
pub const FINAL_STATES: &str = "notification.final";
/// Stored messages sent to a connected client.
pub const STORED_SENT: &str = "notification.message.retrieved";
/// Client acks: `source` (`direct`, `stored`, `unknown`).
pub const ACKS: &str = "ua.command.ack";
/// Client nacks (one per message).
pub const NACKS: &str = "ua.command.nack";
/// Successful hellos: `outcome` (`new`, `existing`, `reset`).
pub const HELLOS: &str = "ua.command.hello";
/// Websockets open now.
pub const CONNECTIONS_OPEN: &str = "ua.connection.open";
/// Websockets accepted since start.
pub const CONNECTIONS_OPENED: &str = "ua.connection.opened";
/// Websockets closed: `code` (the close code; 1000 when the client left).
pub const CONNECTIONS_CLOSED: &str = "ua.connection.closed";
/// VAPID checks: `outcome` (`cached`, `verified`, `failed`), and `check`
/// (the failed rule) for failures.
pub const VAPID: &str = "notification.auth";
/// Calls to a bridge (APNs, FCM...): `router_type`, `app`, `outcome`
/// (`sent`, or the errno of the failure).
pub const BRIDGE_REQUESTS: &str = "notification.bridge.request";
/// Seconds a bridge call took: `router_type`, `app`.
pub const BRIDGE_TIME: &str = "notification.bridge.time";
/// Seconds a storage operation took: `backend`, `op`.
pub const STORAGE_TIME: &str = "storage.time";
/// Failed storage operations: `backend`, `op`.
pub const STORAGE_ERRORS: &str = "storage.error";
/// Requests a backend sent its server, each attempt counted: `backend`,
/// `rpc` (Bigtable's `ReadRows`, `CheckAndMutateRow`...).
pub const STORAGE_REQUESTS: &str = "storage.request";
/// Requests refused over a rate limit: `limit` (`sender`, `subscription`,
/// `source_ip`, `registration`, `new_uaid`, `bridge_app`, `matrix_gateway`).
pub const RATE_LIMITED: &str = "rate_limit.refused";
/// Keys a rate limiter tracks now: `limit`.
pub const RATE_LIMIT_KEYS: &str = "rate_limit.keys";
/// Router API calls taken unsigned from an autopush-rs endpoint during a
/// migration (`--unsigned-node-calls-from`): `route` (`push`, `notif`).
pub const UNSIGNED_NODE_CALLS: &str = "node.unsigned_call";
/// Matrix gateway notifications, one per device: `outcome` (`delivered`,
/// `foreign` (a pushkey not ours), `gone`, `too_large`, `failed`).
pub const MATRIX_NOTIFICATIONS: &str = "notification.matrix";

/// A Matrix gateway notification for one device, by what became of it.
pub fn matrix_notification(outcome: &'static str) {
    counter!(MATRIX_NOTIFICATIONS, "outcome" => outcome).increment(1);
}

/// Wake-ups for user agents that are away: `router_type` (`fcm`, `apns`),
/// `outcome` (`sent`; `coalesced`: another went within the wake interval;
/// `failed`).
pub const WAKE_UPS: &str = "notification.wake";

/// A wake-up through `router_type` that was sent, coalesced or failed.
pub fn wake_up(router_type: RouterType, outcome: &'static str) {
    counter!(WAKE_UPS, "router_type" => router_type.as_str(), "outcome" => outcome).increment(1);
}

/// A request refused by the `limit` limiter, which now tracks `keys` keys.
pub fn rate_limited(limit: &'static str, keys: usize) {
    counter!(RATE_LIMITED, "limit" => limit).increment(1);
    gauge!(RATE_LIMIT_KEYS, "limit" => limit).set(keys as f64);
}

/// How many keys the `limit` limiter tracks (sampled now and then).
pub fn rate_limit_keys(limit: &'static str, keys: usize) {
    gauge!(RATE_LIMIT_KEYS, "limit" => limit).set(keys as f64);
}

/// A series recorded on every push, by its labels' values: the key of
/// [`COUNTERS`] and [`HISTOGRAMS`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Series {
    Pushes(Option<RouterType>, u16, Option<u16>),
    Delivery(RouterType, &'static str),
    Encoding(&'static str),
    Final(RouterType, MessageState),
    Ack(&'static str),
    Vapid(&'static str),
    StorageTime(&'static str, &'static str),
}

/// The recorder's handles of the series every push records, asked for once.
/// Asking for one by name and labels builds the key (allocating its labels),
/// hashes and compares it: about a twentieth of a push's instructions over
/// the handful of series a push records.
type Handles<H> = LazyLock<RwLock<FastMap<Series, H>>>;
static COUNTERS: Handles<Counter> = LazyLock::new(Default::default);
static HISTOGRAMS: Handles<Histogram> = LazyLock::new(Default::default);

/// Record on `series`'s handle in `handles`, asking the recorder for it
/// (`make`) the first time.
fn with_handle<H>(
    handles: &RwLock<FastMap<Series, H>>,
    series: Series,
    make: impl FnOnce() -> H,
    record: impl Fn(&H),
) {
    let read = handles.read().unwrap_or_else(PoisonError::into_inner);
    if let Some(handle) = read.get(&series) {
        return record(handle);
    }
    drop(read);
    let mut write = handles.write().unwrap_or_else(PoisonError::into_inner);
    record(write.entry(series).or_insert_with(make));
}

fn increment(series: Series, make: impl FnOnce() -> Counter) {
    with_handle(&COUNTERS, series, make, |counter| counter.increment(1));
}

/// Forget the handles asked for so far: those asked for before a recorder
/// was installed record nowhere.
pub fn forget_handles() {
    COUNTERS
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    HISTOGRAMS
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    BRIDGES
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
}

/// What became of an accepted push.
pub fn push_answered(router_type: Option<RouterType>, status: u16, errno: Option<u16>) {
    increment(Series::Pushes(router_type, status, errno), || {
        let router_type = router_type.map_or("unknown", |r| r.as_str());
        let status = status.to_string();
        match errno {
            Some(errno) => {
                counter!(PUSHES, "router_type" => router_type, "status" => status, "errno" => errno.to_string())
            }
            None => counter!(PUSHES, "router_type" => router_type, "status" => status),
        }
    });
}

pub fn delivery(router_type: RouterType, outcome: &'static str) {
    increment(
        Series::Delivery(router_type, outcome),
        || counter!(DELIVERIES, "router_type" => router_type.as_str(), "outcome" => outcome),
    );
}

/// An accepted push's body was encrypted as `encoding` (see [`ENCODINGS`]).
pub fn encoding(encoding: &'static str) {
    increment(
        Series::Encoding(encoding),
        || counter!(ENCODINGS, "encoding" => encoding),
    );
}

/// A message of a `router_type` subscription reached final `state`.
pub fn final_state(router_type: RouterType, state: MessageState) {
    increment(
        Series::Final(router_type, state),
        || counter!(FINAL_STATES, "router_type" => router_type.as_str(), "state" => state.as_str()),
    );
}

/// `count` messages the store itself settled in `state`: `gone` at a
/// removal or an unsubscribe, `replaced` by a newer message with the
/// Topic. The store does not know the subscription's router type, so they
/// count under `router_type` `unknown`.
pub fn final_states_in_store(state: MessageState, count: usize) {
    if count > 0 {
        counter!(FINAL_STATES, "router_type" => "unknown", "state" => state.as_str())
            .increment(count as u64);
    }
}

pub fn stored_sent(count: usize) {
    counter!(STORED_SENT).increment(count as u64);
}

pub fn ack(source: &'static str) {
    increment(Series::Ack(source), || counter!(ACKS, "source" => source));
}

pub fn unsigned_node_call(route: &'static str) {
    counter!(UNSIGNED_NODE_CALLS, "route" => route).increment(1);
}

pub fn nack() {
    counter!(NACKS).increment(1);
}

pub fn hello(outcome: &'static str) {
    counter!(HELLOS, "outcome" => outcome).increment(1);
}

pub fn connection_opened() {
    counter!(CONNECTIONS_OPENED).increment(1);
    gauge!(CONNECTIONS_OPEN).increment(1.0);
}

/// The socket slot is given back (whether or not a session ran on it).
pub fn connection_released() {
    gauge!(CONNECTIONS_OPEN).decrement(1.0);
}

pub fn connection_closed(code: u16) {
    counter!(CONNECTIONS_CLOSED, "code" => code.to_string()).increment(1);
}

pub fn vapid(outcome: &'static str) {
    increment(
        Series::Vapid(outcome),
        || counter!(VAPID, "outcome" => outcome),
    );
}

pub fn vapid_failed(check: &'static str) {
    counter!(VAPID, "outcome" => "failed", "check" => check).increment(1);
}

/// One bridge call. `app` is the operator's name for the app (from the
/// registration's `app_id`), bounded by the settings.
pub fn bridge_request(
    router_type: RouterType,
    app: &str,
    result: Result<(), &ApiError>,
    took: Duration,
) {
    let record = |handles: &BridgeHandles| {
        match result {
            Ok(()) => handles.sent.increment(1),
            Err(e) => counter!(BRIDGE_REQUESTS, "router_type" => router_type.as_str(), "app" => app.to_owned(), "outcome" => e.errno().to_string())
                .increment(1),
        }
        handles.time.record(took.as_secs_f64());
    };
    let read = BRIDGES.read().unwrap_or_else(PoisonError::into_inner);
    if let Some(handles) = read.get(&router_type).and_then(|apps| apps.get(app)) {
        return record(handles);
    }
    drop(read);
    let mut write = BRIDGES.write().unwrap_or_else(PoisonError::into_inner);
    let apps = write.entry(router_type).or_default();
    record(apps.entry(app.to_owned()).or_insert_with(|| {
        let (router_type, app) = (router_type.as_str(), app.to_owned());
        BridgeHandles {
            sent: counter!(BRIDGE_REQUESTS, "router_type" => router_type, "app" => app.clone(), "outcome" => "sent"),
            time: histogram!(BRIDGE_TIME, "router_type" => router_type, "app" => app),
        }
    }));
}

/// The series every call to one app of a bridge records.
struct BridgeHandles {
    sent: Counter,
    time: Histogram,
}

/// [`BridgeHandles`] by router type, then app: looked up by the app's name
/// without building a key.
static BRIDGES: LazyLock<RwLock<FastMap<RouterType, FastMap<String, BridgeHandles>>>> =
    LazyLock::new(Default::default);

/// One request (attempt) `rpc` that `backend` sent its server.
pub fn storage_request(backend: &'static str, rpc: &'static str) {
    counter!(STORAGE_REQUESTS, "backend" => backend, "rpc" => rpc).increment(1);
}

pub fn storage_op(backend: &'static str, op: &'static str, ok: bool, took: Duration) {
    with_handle(
        &HISTOGRAMS,
        Series::StorageTime(backend, op),
        || histogram!(STORAGE_TIME, "backend" => backend, "op" => op),
        |histogram| histogram.record(took.as_secs_f64()),
    );
    if !ok {
        counter!(STORAGE_ERRORS, "backend" => backend, "op" => op).increment(1);
    }
}
