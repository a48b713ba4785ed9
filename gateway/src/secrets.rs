//! Secrets kept out of the settings file.
//!
//! Every setting that holds a secret has a `_file` form naming a file that
//! holds it (`--crypto-key-file`, `AUTOPUSH_CRYPTO_KEY_FILE`,
//! `crypto_key_file`); giving both forms is an error. Below every explicit
//! setting, a systemd credential (`LoadCredential=`,
//! `LoadCredentialEncrypted=`) gives a secret by the setting's name: the
//! file `$CREDENTIALS_DIRECTORY/crypto_key`. A setting that names a file
//! (the TLS pair, APNs keys, FCM/GCM service accounts, the `_file` forms)
//! names a credential as `credential:NAME`. A trailing newline is not
//! part of a secret read from a file; an empty credential counts as none
//! (the packaged unit passes every secret's credential, empty until the
//! operator writes one).

use std::path::{Path, PathBuf};

use autopush_common::Secret;
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::bridges::BridgeSettings;
use crate::settings::Problems;
use crate::sources::{Source, Sources};

/// The environment variable systemd sets to the service's credentials.
pub const CREDENTIALS_DIRECTORY: &str = "CREDENTIALS_DIRECTORY";

/// How a setting that names a file names a credential instead.
pub const CREDENTIAL_PREFIX: &str = "credential:";

/// The settings that hold a secret, each also a credential's name.
pub const SECRETS: [&str; 6] = [
    "crypto_key",
    "auth_key",
    "router_key",
    "apns_channels",
    "fcm_credentials",
    "gcm_credentials",
];

/// The `_file` form of every setting that holds a secret.
#[derive(Args, Debug, Default, Clone, Deserialize, Serialize)]
pub struct SecretFiles {
    /// A file holding --crypto-key, instead of the key itself (a path, or
    /// credential:NAME) [default: none]
    #[arg(long, env = "AUTOPUSH_CRYPTO_KEY_FILE", global = true)]
    pub crypto_key_file: Option<String>,
    /// A file holding --auth-key, instead of the key itself [default: none]
    #[arg(long, env = "AUTOPUSH_AUTH_KEY_FILE", global = true)]
    pub auth_key_file: Option<String>,
    /// A file holding --router-key, instead of the key itself [default: none]
    #[arg(long, env = "AUTOPUSH_ROUTER_KEY_FILE", global = true)]
    pub router_key_file: Option<String>,
    /// A file holding --apns-channels' JSON [default: none]
    #[arg(long, env = "AUTOPUSH_APNS_CHANNELS_FILE", global = true)]
    pub apns_channels_file: Option<String>,
    /// A file holding --fcm-credentials' JSON [default: none]
    #[arg(long, env = "AUTOPUSH_FCM_CREDENTIALS_FILE", global = true)]
    pub fcm_credentials_file: Option<String>,
    /// A file holding --gcm-credentials' JSON [default: none]
    #[arg(long, env = "AUTOPUSH_GCM_CREDENTIALS_FILE", global = true)]
    pub gcm_credentials_file: Option<String>,
}

/// The file a setting names: `credential:NAME` is NAME in
/// `$CREDENTIALS_DIRECTORY` (which must hold it), anything else a path.
pub fn path(value: &str) -> Result<PathBuf, String> {
    let Some(name) = value.strip_prefix(CREDENTIAL_PREFIX) else {
        return Ok(PathBuf::from(value));
    };
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(format!(
            "{value:?}: a credential is named by a file name, as credential:NAME"
        ));
    }
    let Some(dir) = std::env::var_os(CREDENTIALS_DIRECTORY) else {
        return Err(format!(
            "{value:?} names a systemd credential, but CREDENTIALS_DIRECTORY is not set \
             (the unit passes it with LoadCredential={name}:FILE)"
        ));
    };
    let path = Path::new(&dir).join(name);
    match path.exists() {
        true => Ok(path),
        false => Err(format!(
            "{value:?}: no credential {name} in {} (the unit passes it with \
             LoadCredential={name}:FILE)",
            Path::new(&dir).display()
        )),
    }
}

/// Where systemd put the credential `name`, if it did. An empty one
/// counts as none: a unit can name a credential file that the operator
/// has left empty.
pub fn credential_path(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os(CREDENTIALS_DIRECTORY)?;
    let path = Path::new(&dir).join(name);
    let empty = std::fs::read(&path).is_ok_and(|data| data.trim_ascii().is_empty());
    (path.exists() && !empty).then_some(path)
}

/// A secret's text in the file at `path`, without its trailing newline.
fn read(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let text = text.trim_end_matches(['\n', '\r']);
    match text.trim().is_empty() {
        true => Err(format!("{} is empty", path.display())),
        false => Ok(text.to_owned()),
    }
}

/// The secret `key` read from where it is not given inline: its `_file`
/// form `file` (both forms is an error), or else its credential. `None`:
/// given inline (`given`), or nowhere. A credential read is noted in
/// `sources`.
pub fn read_secret(
    sources: &mut Sources,
    key: &str,
    given: bool,
    file: Option<&str>,
) -> Result<Option<String>, String> {
    let file_key = format!("{key}_file");
    match (given, file) {
        (true, Some(_)) => Err(format!(
            "{} and {} both give {key}: give one of them",
            sources.name(key),
            sources.name(&file_key)
        )),
        (true, None) => Ok(None),
        (false, Some(file)) => {
            let at = |e: String| format!("{}: {e}", sources.name(&file_key));
            read(&path(file).map_err(at)?).map(Some).map_err(at)
        }
        (false, None) => match credential_path(key) {
            Some(path) => {
                let text = read(&path).map_err(|e| format!("the credential {key}: {e}"))?;
                sources.set(key, Source::Credential(path));
                Ok(Some(text))
            }
            None => Ok(None),
        },
    }
}

/// A key setting (`crypto_key`, `auth_key`, `router_key`): `given`, or
/// read from its file or credential; a problem is noted in `p`.
pub fn key(
    p: &mut Problems,
    sources: &mut Sources,
    key: &str,
    given: Option<Secret>,
    file: Option<&str>,
) -> Option<Secret> {
    match p.take(read_secret(sources, key, given.is_some(), file), None) {
        Some(text) => Some(Secret::from(text)),
        None => given,
    }
}

/// The bridges' secrets read from their `_file` forms or credentials, and
/// every key file they name as `credential:NAME` found.
pub fn read_bridges(
    p: &mut Problems,
    sources: &mut Sources,
    bridges: &mut BridgeSettings,
    files: &SecretFiles,
) {
    let apns = &mut bridges.apns.apns;
    let given = apns.is_some();
    let file = files.apns_channels_file.as_deref();
    if let Some(json) = p.take(read_secret(sources, "apns_channels", given, file), None) {
        let from = sources.name(if file.is_some() {
            "apns_channels_file"
        } else {
            "apns_channels"
        });
        let channels = autopush_apns::settings::ApnsSettings::from_json(&json);
        *apns = p.take(channels.map(Some).map_err(|e| format!("{from}: {e}")), None);
    }
    for channel in apns.iter_mut().flat_map(|a| a.channels.values_mut()) {
        for material in [&mut channel.cert, &mut channel.key].into_iter().flatten() {
            let named = serde_json::to_value(&*material).ok();
            let Some(value) = named.as_ref().and_then(|v| v.as_str()) else {
                continue;
            };
            if value.starts_with(CREDENTIAL_PREFIX)
                && let Some(found) = p.take(path(value).map(Some), None)
            {
                *material = found.to_string_lossy().as_ref().into();
            }
        }
    }
    let fcm = &mut bridges.fcm;
    let file = files.fcm_credentials_file.as_deref();
    read_google(
        p,
        sources,
        "fcm_credentials",
        file,
        &mut fcm.fcm_credentials,
        &mut fcm.fcm,
    );
    let gcm = &mut bridges.gcm;
    let file = files.gcm_credentials_file.as_deref();
    read_google(
        p,
        sources,
        "gcm_credentials",
        file,
        &mut gcm.gcm_credentials,
        &mut gcm.gcm,
    );
}

/// An FCM or GCM bridge's apps, as `json` (the secret `key`) or the
/// settings file's `section`: the JSON read from `key`'s `_file` form or
/// credential, and each app's `credential:NAME` service account found.
fn read_google(
    p: &mut Problems,
    sources: &mut Sources,
    key: &str,
    file: Option<&str>,
    json: &mut Option<String>,
    section: &mut Option<autopush_fcm::BridgeSection>,
) {
    let given = json.is_some() || section.is_some();
    if let Some(text) = p.take(read_secret(sources, key, given, file), None) {
        *json = Some(text);
    }
    let variable = format!("AUTOPUSH_{}", key.to_uppercase());
    if let Ok(apps) = autopush_fcm::settings::apps_of(&variable, json.as_deref(), section.as_ref())
        && let Some(found) = google_apps(p, apps)
    {
        *section = Some(found);
        *json = None;
    }
}

/// FCM or GCM apps with each `credential:NAME` service account found; `None`
/// when no app names a credential.
fn google_apps(
    p: &mut Problems,
    mut apps: std::collections::BTreeMap<String, autopush_fcm::AppSettings>,
) -> Option<autopush_fcm::BridgeSection> {
    let mut named = false;
    for app in apps.values_mut() {
        if app.credential.starts_with(CREDENTIAL_PREFIX) {
            named = true;
            if let Some(found) = p.take(path(&app.credential).map(Some), None) {
                app.credential = found.to_string_lossy().into_owned();
            }
        }
    }
    named.then_some(autopush_fcm::BridgeSection { apps })
}
