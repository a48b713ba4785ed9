//! APNs settings: one entry per release channel, the `app_id` of
//! `/v1/apns/{app_id}/registration` (e.g. `firefox`, `beta`).
//!
//! The shape is the one Mozilla's autopush-rs reads (`cert`, `key`, `topic`,
//! `sandbox`), plus token auth (`key_id`, `team_id`), so operators can carry
//! their settings over. In a TOML file: `[apns.channels.NAME]` tables; in the
//! environment: `AUTOPUSH_APNS_CHANNELS`, one JSON object of channels.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Every configured channel, by name. (Serialize: settings layers merge as
/// tables.)
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ApnsSettings {
    pub channels: BTreeMap<String, ApnsChannel>,
}

/// How to reach APNs for one release channel.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApnsChannel {
    /// The app's bundle id, sent as `apns-topic`.
    pub topic: String,
    /// Apple's development environment instead of production.
    #[serde(default)]
    pub sandbox: bool,
    /// Certificate auth: the provider certificate (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<KeyMaterial>,
    /// The private key: the `.p8` key for token auth, or the certificate's
    /// PKCS#8 key for certificate auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeyMaterial>,
    /// Token auth: the key's id, as Apple shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// Token auth: the developer team id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team_id: Option<String>,
    /// Most pushes in flight to Apple at once for this channel; beyond it
    /// senders get 503 with `Retry-After`.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Seconds one push may take, retries included, before the sender gets
    /// 502/903.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
}

fn default_max_in_flight() -> usize {
    1000
}

fn default_timeout() -> f64 {
    10.0
}

/// A PEM file's path, or the PEM text itself (anything starting with `-`,
/// as in `-----BEGIN PRIVATE KEY-----`). Never shown in logs or errors.
#[derive(Clone, PartialEq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct KeyMaterial(String);

impl KeyMaterial {
    pub fn is_inline(&self) -> bool {
        self.0.trim_start().starts_with('-')
    }

    /// The PEM bytes: the inline text, or the file's contents.
    pub fn load(&self) -> Result<Vec<u8>, String> {
        if self.is_inline() {
            return Ok(self.0.as_bytes().to_vec());
        }
        std::fs::read(&self.0).map_err(|e| format!("cannot read {}: {e}", self.0))
    }

    fn is_empty(&self) -> bool {
        self.0.trim().is_empty()
    }
}

impl From<&str> for KeyMaterial {
    fn from(value: &str) -> Self {
        KeyMaterial(value.to_owned())
    }
}

impl fmt::Debug for KeyMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_inline() {
            f.write_str("<inline PEM>")
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

/// How a channel proves itself to Apple.
#[derive(Debug, PartialEq)]
pub enum Auth<'a> {
    /// A `.p8` signing key: JWT provider tokens (Apple's preferred way).
    Token {
        key: &'a KeyMaterial,
        key_id: &'a str,
        team_id: &'a str,
    },
    /// A TLS client certificate and its key.
    Certificate {
        cert: &'a KeyMaterial,
        key: &'a KeyMaterial,
    },
}

impl ApnsChannel {
    /// Token auth when `key_id` or `team_id` is given, else certificate auth.
    /// Errors name the field at fault.
    pub fn auth(&self) -> Result<Auth<'_>, String> {
        fn text(v: &Option<String>) -> Option<&str> {
            v.as_deref().filter(|s| !s.trim().is_empty())
        }
        fn pem(v: &Option<KeyMaterial>) -> Option<&KeyMaterial> {
            v.as_ref().filter(|m| !m.is_empty())
        }
        match (text(&self.key_id), text(&self.team_id), pem(&self.cert)) {
            (None, None, Some(cert)) => {
                let key = pem(&self.key).ok_or(
                    "key: certificate auth needs the certificate's private key (PEM), as a path or inline",
                )?;
                Ok(Auth::Certificate { cert, key })
            }
            (None, None, None) => Err("key_id: give key, key_id and team_id (token auth, \
                 preferred) or cert and key (certificate auth)"
                .into()),
            (_, _, Some(_)) => Err("cert: give either cert and key (certificate auth) or key, \
                 key_id and team_id (token auth), not both"
                .into()),
            (None, Some(_), None) => Err("key_id: token auth needs key_id with team_id".into()),
            (Some(_), None, None) => Err("team_id: token auth needs team_id with key_id".into()),
            (Some(key_id), Some(team_id), None) => {
                let key = pem(&self.key)
                    .ok_or("key: token auth needs the .p8 key, as a path or inline")?;
                Ok(Auth::Token {
                    key,
                    key_id,
                    team_id,
                })
            }
        }
    }

    /// The key material as it reads now (inline or from its files), to
    /// tell a rotated file from an unchanged one.
    pub fn material(&self) -> Result<Vec<Vec<u8>>, String> {
        [&self.cert, &self.key]
            .into_iter()
            .flatten()
            .map(KeyMaterial::load)
            .collect()
    }

    /// The whole-push deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout)
    }

    /// Checks that need no file: every field makes sense on its own.
    fn check(&self) -> Result<(), String> {
        if self.topic.trim().is_empty() {
            return Err("topic: the app's bundle id is required".into());
        }
        if self.max_in_flight == 0 {
            return Err("max_in_flight: must be at least 1".into());
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 3600.0) {
            return Err("timeout: must be a number of seconds above 0 (at most 3600)".into());
        }
        self.auth().map(|_| ())
    }
}

impl ApnsSettings {
    /// The environment's form: one JSON object of channels,
    /// `{"firefox": {"key": ..., "key_id": ..., "team_id": ..., "topic": ..., "sandbox": true}}`.
    pub fn from_json(text: &str) -> Result<ApnsSettings, String> {
        let channels: BTreeMap<String, Value> = serde_json::from_str(text)
            .map_err(|e| format!("apns channels: not a JSON object of channels: {e}"))?;
        ApnsSettings::from_values(channels)
    }

    fn from_values(values: BTreeMap<String, Value>) -> Result<ApnsSettings, String> {
        let mut channels = BTreeMap::new();
        for (name, value) in values {
            let channel: ApnsChannel =
                serde_json::from_value(value).map_err(|e| format!("apns channel {name:?}: {e}"))?;
            channel
                .check()
                .map_err(|e| format!("apns channel {name:?}: {e}"))?;
            channels.insert(name, channel);
        }
        Ok(ApnsSettings { channels })
    }
}

/// The APNs bridge's section of the service's settings (flattened into the
/// gateway's): `--apns-channels` / `AUTOPUSH_APNS_CHANNELS`, or the file's
/// `[apns.channels.NAME]` tables.
#[derive(clap::Args, Clone, Debug, Default, Deserialize, Serialize)]
pub struct ApnsSection {
    /// APNs release channels as one JSON object, `{"NAME": {"topic": ..., "key": ...,
    /// "key_id": ..., "team_id": ..., "sandbox": ...}, ...}`; in the file,
    /// `[apns.channels.NAME]` tables [default: none, APNs not served]
    #[arg(
        long = "apns-channels",
        env = "AUTOPUSH_APNS_CHANNELS",
        global = true,
        hide_env_values = true,
        value_parser = ApnsChannelsParser
    )]
    pub apns: Option<ApnsSettings>,
}

impl ApnsSection {
    /// The channels configured (none when the section is absent).
    pub fn settings(&self) -> ApnsSettings {
        self.apns.clone().unwrap_or_default()
    }
}

/// Parses `--apns-channels` / `AUTOPUSH_APNS_CHANNELS` without echoing the
/// value in errors, as clap would: it may hold inline private keys.
#[derive(Clone)]
struct ApnsChannelsParser;

impl clap::builder::TypedValueParser for ApnsChannelsParser {
    type Value = ApnsSettings;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<ApnsSettings, clap::Error> {
        let error = |message: String| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!("AUTOPUSH_APNS_CHANNELS (--apns-channels): {message}\n"),
            )
            .with_cmd(cmd)
        };
        let text = value.to_str().ok_or_else(|| error("not UTF-8".into()))?;
        ApnsSettings::from_json(text).map_err(error)
    }
}

/// The file's form: `[apns.channels.NAME]` tables. Each channel is read on
/// its own so that an error names it.
impl<'de> Deserialize<'de> for ApnsSettings {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            #[serde(default)]
            channels: BTreeMap<String, Value>,
        }
        let file = File::deserialize(deserializer)?;
        ApnsSettings::from_values(file.channels).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ApnsSettings, String> {
        ApnsSettings::from_json(json)
    }

    #[test]
    fn token_and_certificate_channels() {
        let s = parse(
            r#"{"firefox": {"key": "/k.p8", "key_id": "KID", "team_id": "TEAM", "topic": "org.example.app", "sandbox": true},
                "beta": {"cert": "-----BEGIN CERTIFICATE-----", "key": "/k.pem", "topic": "org.example.beta"}}"#,
        )
        .unwrap();
        let firefox = &s.channels["firefox"];
        assert!(firefox.sandbox);
        assert_eq!(firefox.max_in_flight, 1000);
        assert_eq!(firefox.timeout(), Duration::from_secs(10));
        assert!(matches!(
            firefox.auth(),
            Ok(Auth::Token {
                key_id: "KID",
                team_id: "TEAM",
                ..
            })
        ));
        let beta = &s.channels["beta"];
        assert!(!beta.sandbox);
        let Ok(Auth::Certificate { cert, key }) = beta.auth() else {
            panic!("certificate auth expected");
        };
        assert!(cert.is_inline() && !key.is_inline());
        // Inline key material never shows in Debug output.
        assert!(!format!("{beta:?}").contains("BEGIN"));
    }

    #[test]
    fn errors_name_the_channel_and_the_field() {
        let cases = [
            (r#"{"firefox": {"keyid": "K", "topic": "t"}}"#, "keyid"),
            (
                r#"{"firefox": {"key": "/k.p8", "key_id": "K", "team_id": "T"}}"#,
                "topic",
            ),
            (
                r#"{"firefox": {"key": "/k.p8", "key_id": "K", "topic": "t"}}"#,
                "team_id",
            ),
            (
                r#"{"firefox": {"key_id": "K", "team_id": "T", "topic": "t"}}"#,
                "key",
            ),
            (r#"{"firefox": {"cert": "/c.pem", "topic": "t"}}"#, "key"),
            (
                r#"{"firefox": {"cert": "/c.pem", "key": "/k", "key_id": "K", "team_id": "T", "topic": "t"}}"#,
                "cert",
            ),
            (r#"{"firefox": {"topic": "t"}}"#, "key_id"),
            (
                r#"{"firefox": {"cert": "/c", "key": "/k", "topic": "t", "timeout": 0}}"#,
                "timeout",
            ),
            (
                r#"{"firefox": {"cert": "/c", "key": "/k", "topic": "t", "max_in_flight": 0}}"#,
                "max_in_flight",
            ),
        ];
        for (json, field) in cases {
            let err = parse(json).unwrap_err();
            assert!(
                err.contains("\"firefox\"") && err.contains(field),
                "{json}: {err}"
            );
        }
        assert!(parse("[1]").unwrap_err().contains("JSON object"));
    }

    #[test]
    fn reads_toml_tables() {
        #[derive(Deserialize)]
        struct File {
            apns: ApnsSettings,
        }
        let file: File = serde_json::from_value(serde_json::json!({
            "apns": {"channels": {"firefox": {"cert": "c.pem", "key": "k.pem", "topic": "t"}}}
        }))
        .unwrap();
        assert_eq!(file.apns.channels["firefox"].topic, "t");
        let err = serde_json::from_value::<File>(serde_json::json!({
            "apns": {"channels": {"firefox": {"cert": "c.pem", "key": "k.pem", "topic": "t", "sandbx": true}}}
        }))
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("firefox") && err.contains("sandbx"), "{err}");
    }
}
