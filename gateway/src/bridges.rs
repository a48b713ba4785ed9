//! The bridges this service can serve, in one list. Each bridge crate owns
//! its settings section (flags, environment variables, file tables) and the
//! constructor that turns that section into its router.
//!
//! Each bridge's router sits behind a [`Swappable`], so that SIGHUP can
//! replace its apps while it serves ([`Bridges::reload`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use autopush_apns::ApnsRouter;
use autopush_apns::settings::{ApnsChannel, ApnsSettings};
use autopush_common::RouterType;
use autopush_common::bridge::AppLimits;
use autopush_common::router::{Router, RouterRegistry, Swappable};
use autopush_fcm::{AppSettings, FcmRouter, Projects};
use autopush_gcm::GcmRouter;
use clap::Args;
use serde::{Deserialize, Serialize};
use tracing::{error, info};

use crate::settings::{Problems, Reread};

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

/// The bridge routers served, each replaceable while it serves, and what a
/// reload needs to build them again.
pub struct Bridges {
    apns: Arc<Swappable<ApnsRouter>>,
    fcm: Arc<Swappable<FcmRouter>>,
    gcm: Arc<Swappable<GcmRouter>>,
    limits: AppLimits,
    /// The settings file and the flags over it; `None`: nothing to re-read.
    reread: Option<Reread>,
}

/// The bridge routers `settings` configure, clients built and key material
/// checked, and one line naming what they serve (names only) for the
/// start-up log. A bridge with nothing configured serves no app (until a
/// reload gives it some); bad settings are an error naming the channel or
/// app.
///
/// A new bridge is its crate (owning its settings section and a `bridge`
/// constructor), its section in [`BridgeSettings`], its lines in the list
/// below and in [`Bridges::reload`], and its `RouterType` variant (stored
/// in user records, so named explicitly).
pub fn bridges(
    settings: &BridgeSettings,
    limits: &AppLimits,
    reread: Option<Reread>,
) -> Result<(Bridges, String), String> {
    // FCM and GCM apps naming the same Firebase project share its client and tokens.
    let google = Projects::default();
    let bridges = Bridges {
        apns: Arc::new(Swappable::new(Arc::new(settings.apns.router(limits)?))),
        fcm: Arc::new(Swappable::new(Arc::new(
            settings.fcm.router(&google, limits)?,
        ))),
        gcm: Arc::new(Swappable::new(Arc::new(
            settings.gcm.router(&google, limits)?,
        ))),
        limits: limits.clone(),
        reread,
    };
    let serves = bridges.serves();
    Ok((bridges, serves))
}

impl Bridges {
    /// The registry of the bridges: an entry for each, apps or not, so
    /// that a reload can add apps to any.
    pub fn registry(&self) -> RouterRegistry {
        RouterRegistry::default()
            .with(RouterType::Apns, self.apns.clone() as Arc<dyn Router>)
            .with(RouterType::Fcm, self.fcm.clone() as Arc<dyn Router>)
            .with(RouterType::Gcm, self.gcm.clone() as Arc<dyn Router>)
    }

    /// What is served, by name only: `bridges: apns channels: none; fcm
    /// apps: app1, app2; gcm apps: none`.
    pub fn serves(&self) -> String {
        let (apns, fcm, gcm) = (self.apns.current(), self.fcm.current(), self.gcm.current());
        let list = |what: &str, mut names: Vec<&str>| {
            names.sort_unstable();
            match names.is_empty() {
                true => format!("{what}: none"),
                false => format!("{what}: {}", names.join(", ")),
            }
        };
        format!(
            "bridges: {}; {}; {}",
            list("apns channels", apns.names().collect()),
            list("fcm apps", fcm.names().collect()),
            list("gcm apps", gcm.names().collect()),
        )
    }

    /// Record how many apps each bridge serves.
    pub fn report(&self) {
        crate::metrics::bridge_apps(RouterType::Apns, self.apns.current().len());
        crate::metrics::bridge_apps(RouterType::Fcm, self.fcm.current().len());
        crate::metrics::bridge_apps(RouterType::Gcm, self.gcm.current().len());
    }

    /// Read the settings file again (under the flags given at start-up)
    /// and serve its bridges' apps: new ones at once, changed ones with
    /// their new settings from the next push, unchanged ones with the
    /// clients (and tokens) they had. A section that fails to parse or to
    /// build is logged by name and the one before stays; a file that cannot
    /// be read changes nothing. Called by the one SIGHUP handler, so
    /// reloads never overlap.
    pub fn reload(&self) {
        let Some(reread) = &self.reread else {
            info!("SIGHUP: no settings file (--config): the bridges stay as they are");
            return;
        };
        let offered = match offered(reread) {
            Ok(offered) => offered,
            Err(e) => {
                error!(file = %reread.path.display(), error = %e, "bridges not reloaded: every app stays as it was");
                crate::metrics::bridge_reload("rejected");
                return;
            }
        };
        let (apns, fcm, gcm) = (self.apns.current(), self.fcm.current(), self.gcm.current());
        let google = Projects::after(fcm.apps().chain(gcm.apps()));
        let (apns, apns_refused) = apns.reloaded(&offered.apns, &self.limits);
        let (fcm, fcm_refused) = fcm.reloaded(&offered.fcm, &google, &self.limits);
        let (gcm, gcm_refused) = gcm.reloaded(&offered.gcm, &google, &self.limits);
        self.apns.swap(Arc::new(apns));
        self.fcm.swap(Arc::new(fcm));
        self.gcm.swap(Arc::new(gcm));
        let refused = [
            ("apns", apns_refused),
            ("fcm", fcm_refused),
            ("gcm", gcm_refused),
        ];
        let mut count = 0;
        for (bridge, refusals) in refused {
            for (app, reason) in refusals {
                count += 1;
                error!(
                    bridge,
                    app = %app,
                    error = %reason,
                    "bridge app rejected: it stays as it was (not served if it is new)"
                );
            }
        }
        self.report();
        info!(refused = count, "bridges reloaded: {}", self.serves());
        crate::metrics::bridge_reload(if count == 0 { "ok" } else { "partial" });
    }
}

/// Each bridge's apps as a reload finds them: the settings of each, or why
/// they were refused.
struct Offered {
    apns: BTreeMap<String, Result<ApnsChannel, String>>,
    fcm: BTreeMap<String, Result<AppSettings, String>>,
    gcm: BTreeMap<String, Result<AppSettings, String>>,
}

/// The bridges' apps as the settings file says now, under the flags of
/// start-up: an app whose table does not parse is refused on its own (and
/// taken out of the file, so that the rest still applies); anything else
/// wrong with the file refuses it whole.
fn offered(reread: &Reread) -> Result<Offered, String> {
    let path = &reread.path;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        // The message and line only: toml's own display quotes the line,
        // which may hold a key.
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].lines().count().max(1));
        match line {
            Some(line) => format!("line {line}: {}", e.message().trim_end()),
            None => e.message().trim_end().to_owned(),
        }
    })?;
    let apns_refused = take_refused(&mut table, "apns", "channels", |name, value| {
        let one = toml::Value::Table(toml::Table::from_iter([(
            "channels".to_owned(),
            toml::Value::Table(toml::Table::from_iter([(name.to_owned(), value.clone())])),
        )]));
        ApnsSettings::deserialize(one)
            .map(drop)
            .map_err(|e| e.message().to_owned())
    });
    let google = |_: &str, value: &toml::Value| {
        AppSettings::deserialize(value.clone())
            .map(drop)
            .map_err(|e| e.message().to_owned())
    };
    let fcm_refused = take_refused(&mut table, "fcm", "apps", google);
    let gcm_refused = take_refused(&mut table, "gcm", "apps", google);

    let text = toml::to_string(&table).map_err(|e| e.to_string())?;
    let layer = reread
        .flags
        .as_ref()
        .clone()
        .over_file(&text, path)?
        .with_defaults();
    let mut problems = Problems::default();
    let mut sources = layer.sources.clone();
    let mut bridges = layer.bridges;
    crate::secrets::read_bridges(
        &mut problems,
        &mut sources,
        &mut bridges,
        &layer.secret_files,
    );
    let bridges = problems.or(bridges)?;
    Ok(Offered {
        apns: with(bridges.apns.settings().channels, apns_refused),
        fcm: with(bridges.fcm.apps()?, fcm_refused),
        gcm: with(bridges.gcm.apps()?, gcm_refused),
    })
}

/// The apps `found`, and those `refused` that are not among them.
fn with<T>(
    found: BTreeMap<String, T>,
    refused: BTreeMap<String, String>,
) -> BTreeMap<String, Result<T, String>> {
    let mut all: BTreeMap<String, Result<T, String>> =
        found.into_iter().map(|(name, s)| (name, Ok(s))).collect();
    for (name, reason) in refused {
        all.entry(name).or_insert(Err(reason));
    }
    all
}

/// Take out of `table`'s `[bridge.apps.*]` (`apps`: `apps` or `channels`)
/// each entry that `check` refuses, and return the refusals by name.
fn take_refused(
    table: &mut toml::Table,
    bridge: &str,
    apps: &str,
    check: impl Fn(&str, &toml::Value) -> Result<(), String>,
) -> BTreeMap<String, String> {
    let Some(toml::Value::Table(entries)) = table
        .get_mut(bridge)
        .and_then(|section| section.get_mut(apps))
    else {
        return BTreeMap::new();
    };
    let refused: BTreeMap<String, String> = entries
        .iter()
        .filter_map(|(name, value)| check(name, value).err().map(|e| (name.clone(), e)))
        .collect();
    for name in refused.keys() {
        entries.remove(name);
    }
    refused
}
