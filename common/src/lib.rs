//! Types every autopush crate shares: identifiers, the notification and user
//! records, the API error table, the `Router` trait, and endpoint tokens.

pub mod bridge;
pub mod endpoint;
pub mod errors;
pub mod http_client;
pub mod ids;
pub mod limit;
pub mod limit_headers;
pub mod metrics;
pub mod node;
pub mod node_auth;
pub mod notification;
pub mod receipt;
pub mod router;
pub mod secret;
pub mod time;
pub mod user;

pub use errors::{ApiError, ApiResult};
pub use notification::{Notification, Urgency};
pub use secret::Secret;
pub use user::{RouterType, User, WakeRoute};

/// A `HashMap` with a fast, seeded hasher (foldhash), for maps on a push's
/// path keyed by what the server made: metric labels, uaids. SipHash, the
/// default, cost a few percent of a push; foldhash resists collisions
/// less, so keys a client picks freely stay in maps with the default.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
