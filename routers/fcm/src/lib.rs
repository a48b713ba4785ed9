//! The FCM bridge: Web Push notifications for Android apps registered
//! through `/v1/fcm/{app_id}/registration`, delivered over FCM HTTP v1
//! (`messages:send` with a service account's OAuth2 token).
//!
//! * [`settings`]: per-app settings (`[fcm.apps.NAME]`, `AUTOPUSH_FCM_CREDENTIALS`).
//! * [`auth`]: the access tokens of one service account.
//! * [`client`]: the pooled HTTP/1.1 client messages are posted through.
//! * [`transport`]: one [`Project`] (HTTP client, tokens, in-flight cap,
//!   retries) per Firebase project, and how FCM's answers map onto errors.
//! * [`message`]: the FCM message a notification becomes.
//! * [`router`]: the FCM [`Router`](autopush_common::router::Router).
//!
//! The GCM bridge (`autopush-gcm`) delivers over the same transport.

pub mod auth;
pub mod client;
pub mod message;
pub mod router;
pub mod settings;
pub mod transport;

pub use router::FcmRouter;
pub use settings::{AppSettings, BridgeSection, FcmSection};
pub use transport::{App, Apps, Project, Projects};
