//! The bridges this service can serve, in one list. Each bridge crate owns
//! its settings section (flags, environment variables, file tables) and the
//! constructor that turns that section into its router.

use autopush_common::RouterType;
use autopush_common::bridge::AppLimits;
use autopush_common::router::RouterRegistry;
use clap::Args;
use serde::{Deserialize, Serialize};

/// Every bridge's settings section, flattened into the service's settings
/// as each crate defines it.
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize)]
pub struct BridgeSettings {
    #[command(flatten)]
    #[serde(flatten)]
    pub apns: autopush_apns::settings::ApnsSection,
    #[command(flatten)]
    #[serde(flatten)]
    pub fcm: autopush_fcm::FcmSection,
    #[command(flatten)]
    #[serde(flatten)]
    pub gcm: autopush_gcm::GcmSection,
}

/// The bridge routers `settings` configure, clients built and key material
/// checked, and one line naming what they serve (names only) for the
/// start-up log. A bridge with nothing configured is not served; bad
/// settings are an error naming the channel or app.
///
/// A new bridge is its crate (owning its settings section and a `bridge`
/// constructor), its section in [`BridgeSettings`], its line in the list
/// below, and its `RouterType` variant (stored in user records, so named
/// explicitly).
pub fn bridges(
    settings: &BridgeSettings,
    limits: &AppLimits,
) -> Result<(RouterRegistry, String), String> {
    // FCM and GCM apps naming the same Firebase project share its client and tokens.
    let google = autopush_fcm::Projects::default();
    let list = [
        (RouterType::Apns, settings.apns.bridge(limits)?),
        (RouterType::Fcm, settings.fcm.bridge(&google, limits)?),
        (RouterType::Gcm, settings.gcm.bridge(&google, limits)?),
    ];
    let mut registry = RouterRegistry::default();
    let mut serves = Vec::new();
    for (router_type, bridge) in list {
        if let Some(router) = bridge.router {
            registry = registry.with(router_type, router);
        }
        serves.push(bridge.serves);
    }
    Ok((registry, format!("bridges: {}", serves.join("; "))))
}
