//! Settings of the FCM and GCM bridges: one entry per app id (FCM: the app's
//! name; GCM: the sender id), from TOML (`[fcm.apps.NAME]`) or one JSON
//! object in the environment (`AUTOPUSH_FCM_CREDENTIALS`), the shape
//! Mozilla's autopush-rs reads.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Google's FCM HTTP v1 API.
pub const DEFAULT_BASE_URL: &str = "https://fcm.googleapis.com";
/// The whole push, every attempt and wait included [seconds].
pub const DEFAULT_TIMEOUT: f64 = 10.0;
/// Requests in flight to one project at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1000;

/// The `[fcm]` / `[gcm]` table of the settings file.
/// (Serialize: settings layers merge as tables.)
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSection {
    #[serde(default)]
    pub apps: BTreeMap<String, AppSettings>,
}

/// One app: which Firebase project delivers for it, and how.
#[derive(Clone, Deserialize, PartialEq, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AppSettings {
    /// The Firebase project id (`messages:send` is under it).
    pub project_id: String,
    /// The service-account key: a path to its JSON file, or the JSON itself.
    pub credential: String,
    /// Base URL of the FCM API [default: https://fcm.googleapis.com].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Seconds one push may take, retries included [default: 10].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Requests in flight to this project at once; beyond it senders get
    /// 503 + Retry-After [default: 1000].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
}

/// The key's JSON is a secret: never printed.
impl fmt::Debug for AppSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let credential = if self.credential.trim_start().starts_with('{') {
            "<inline service-account JSON>"
        } else {
            self.credential.as_str()
        };
        f.debug_struct("AppSettings")
            .field("project_id", &self.project_id)
            .field("credential", &credential)
            .field("base_url", &self.base_url)
            .field("timeout", &self.timeout)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

impl AppSettings {
    /// The service-account JSON: inline, or read from the file named.
    pub fn credential_json(&self) -> Result<String, String> {
        if self.credential.trim_start().starts_with('{') {
            return Ok(self.credential.clone());
        }
        std::fs::read_to_string(&self.credential).map_err(|e| {
            format!(
                "cannot read the service-account file {}: {e}",
                self.credential
            )
        })
    }

    pub fn base_url(&self) -> &str {
        self.base_url
            .as_deref()
            .unwrap_or(DEFAULT_BASE_URL)
            .trim_end_matches('/')
    }

    pub fn timeout(&self) -> Result<Duration, String> {
        let seconds = self.timeout.unwrap_or(DEFAULT_TIMEOUT);
        Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("timeout must be a positive number of seconds, got {seconds}"))
    }

    pub fn max_in_flight(&self) -> Result<usize, String> {
        match self.max_in_flight {
            Some(0) => Err("max_in_flight must be at least 1".into()),
            other => Ok(other.unwrap_or(DEFAULT_MAX_IN_FLIGHT)),
        }
    }
}

/// The FCM bridge's section of the service's settings (flattened into the
/// gateway's): `--fcm-credentials` / `AUTOPUSH_FCM_CREDENTIALS`, or the
/// file's `[fcm.apps.NAME]` tables.
#[derive(clap::Args, Clone, Default, Deserialize, Serialize)]
pub struct FcmSection {
    /// FCM apps as one JSON object: {"APP": {"project_id": ..., "credential": ...}};
    /// replaces the settings file's [fcm.apps.*] tables
    #[arg(
        long,
        env = "AUTOPUSH_FCM_CREDENTIALS",
        global = true,
        hide_env_values = true
    )]
    pub fcm_credentials: Option<String>,
    /// The settings file's `[fcm.apps.NAME]` tables.
    #[arg(skip)]
    pub fcm: Option<BridgeSection>,
}

impl FcmSection {
    /// FCM apps by name.
    pub fn apps(&self) -> Result<BTreeMap<String, AppSettings>, String> {
        apps_of(
            "AUTOPUSH_FCM_CREDENTIALS",
            self.fcm_credentials.as_deref(),
            self.fcm.as_ref(),
        )
    }
}

/// The credentials are secrets: the apps are shown as [`AppSettings`] shows them.
impl fmt::Debug for FcmSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FcmSection")
            .field("apps", &self.apps())
            .finish()
    }
}

/// A bridge's apps: the environment's (or flag's) JSON object `json` if
/// given (`variable` names it in errors), else the settings file's tables.
pub fn apps_of(
    variable: &str,
    json: Option<&str>,
    file: Option<&BridgeSection>,
) -> Result<BTreeMap<String, AppSettings>, String> {
    match json {
        Some(json) => apps_from_json(variable, json),
        None => Ok(file.map(|f| f.apps.clone()).unwrap_or_default()),
    }
}

/// Parse the environment's JSON object `{"APP": {"project_id", "credential", ...}}`.
/// `variable` names it in errors.
pub fn apps_from_json(variable: &str, json: &str) -> Result<BTreeMap<String, AppSettings>, String> {
    serde_json::from_str(json).map_err(|e| {
        format!(
            "{variable} must be a JSON object {{\"APP\": {{\"project_id\": ..., \"credential\": ...}}}}: {e}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_autopush_rs_shape_is_read() {
        let apps = apps_from_json(
            "AUTOPUSH_FCM_CREDENTIALS",
            r#"{"dev": {"project_id": "p1", "credential": "{\"type\": \"service_account\"}"}}"#,
        )
        .unwrap();
        let dev = &apps["dev"];
        assert_eq!(dev.project_id, "p1");
        assert_eq!(dev.base_url(), DEFAULT_BASE_URL);
        assert_eq!(dev.timeout().unwrap(), Duration::from_secs(10));
        assert!(dev.credential_json().unwrap().contains("service_account"));
        assert!(!format!("{dev:?}").contains("service_account"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let err = apps_from_json(
            "AUTOPUSH_FCM_CREDENTIALS",
            r#"{"dev": {"project_id": "p1", "credential": "x", "projectid": "p"}}"#,
        )
        .unwrap_err();
        assert!(
            err.contains("projectid") && err.contains("AUTOPUSH_FCM_CREDENTIALS"),
            "{err}"
        );
        let app: AppSettings =
            serde_json::from_str(r#"{"project_id": "p", "credential": "x", "timeout": 0}"#)
                .unwrap();
        assert!(app.timeout().is_err());
        let err = app.credential_json().unwrap_err();
        assert!(err.contains("service-account file x"), "{err}");
    }
}
