//! The settings reference (docs/settings.md) and the example settings file
//! (packaging/autopush.toml), generated from the settings' clap
//! declarations so that neither can drift from the code: a test compares
//! the checked-in files with what this module makes, and rewrites them
//! with `UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs`.

use std::collections::BTreeMap;

use crate::secrets::SECRETS;
use crate::settings::{SettingsLayer, settings_args};

/// The data directory of the packaged service (its `StateDirectory=`), set
/// in the packaged settings file so that every command given `--config`
/// alone finds it.
pub const PACKAGED_DB: &str = "/var/lib/autopush";

/// An example value (TOML) of each setting that has no default, for the
/// example file: uncommented, each is a valid setting.
fn example(key: &str) -> Option<&'static str> {
    Some(match key {
        "tls_cert" => r#""/etc/autopush/tls/fullchain.pem""#,
        "tls_key" => r#""/etc/autopush/tls/privkey.pem""#,
        "db_settings" => {
            r#"'{"table_name": "projects/my-project/instances/my-instance/tables/autopush"}'"#
        }
        "journal_dir" => r#""/var/lib/autopush/journal""#,
        "journal_window" => "10",
        "router_table" => r#""router""#,
        "message_table" => r#""message""#,
        "message_table_rotation" => "false",
        "crypto_key_file" => r#""/run/secrets/autopush_crypto_key""#,
        "auth_key_file" => r#""/run/secrets/autopush_auth_key""#,
        "router_key_file" => r#""/run/secrets/autopush_router_key""#,
        "apns_channels_file" => r#""/run/secrets/autopush_apns_channels.json""#,
        "fcm_credentials_file" => r#""/run/secrets/autopush_fcm_credentials.json""#,
        "gcm_credentials_file" => r#""/run/secrets/autopush_gcm_credentials.json""#,
        "max_connections" => "100000",
        "sender_limits" => {
            r#""BCdPnPTMwkQ4ASavS7d6K3u50FNrhaphBqiK_yRi1vyxL6CsFD1GHNxMd5KiXyQX5cWG7_U2MJWgFnYMO5sk3Tc=5000,50000""#
        }
        "trusted_proxies" => r#""10.0.0.0/8""#,
        "unsigned_node_calls_from" => r#""10.0.2.0/24""#,
        "autopush_rs_nodes" => r#""10.0.3.0/24""#,
        "metrics_port" => "9100",
        "statsd_host" => r#""127.0.0.1:8125""#,
        "apns" => {
            r#"{ channels = { firefox = { topic = "org.example.app", key = "credential:apns-firefox.p8", key_id = "ABC123DEFG", team_id = "TEAM123456" } } }"#
        }
        _ => return None,
    })
}

/// Where a secret goes instead of the settings file, for its comment.
fn secret_note(name: &str) -> String {
    if name == "apns_channels" {
        return "Its keys are secrets: name each as credential:NAME, as below, or give the \
                channels as the systemd credential apns_channels or in apns_channels_file."
            .into();
    }
    format!(
        "A secret: not in this file. Give it as the systemd credential {name} \
         (docs/package.md), or name the file that holds it with {name}_file."
    )
}

/// One setting as `--help` declares it.
struct Setting {
    /// The TOML key (and the field's name).
    key: String,
    flag: String,
    env: String,
    /// The help text without its `[default: …]`.
    description: String,
    /// What the help says of the default, if anything.
    default: Option<String>,
}

fn settings() -> Vec<Setting> {
    settings_args()
        .iter()
        .map(|arg| {
            let help = arg
                .get_long_help()
                .or(arg.get_help())
                .map(ToString::to_string)
                .unwrap_or_default();
            let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
            let (description, default) = match help.rfind("[default:") {
                Some(at) => {
                    let default = help[at + "[default:".len()..].trim_end();
                    let default = default.strip_suffix(']').unwrap_or(default);
                    (help[..at].trim_end(), Some(default.trim().to_owned()))
                }
                None => (help.as_str(), None),
            };
            Setting {
                key: arg.get_id().to_string(),
                flag: format!("--{}", arg.get_long().unwrap_or_default()),
                env: arg
                    .get_env()
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                description: description.trim_end_matches('.').to_owned(),
                default,
            }
        })
        .collect()
}

/// The default of each setting that has one, as its TOML value.
fn default_values() -> BTreeMap<String, String> {
    let lines = SettingsLayer::default()
        .with_defaults()
        .lines(true)
        .unwrap_or_default();
    lines
        .iter()
        .filter_map(|line| line.split_once(" = "))
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

/// docs/settings.md.
pub fn markdown() -> String {
    let mut out = String::from(
        "# Settings\n\
         \n\
         <!-- Generated from the code: do not edit. After changing a setting, run\n\
         \x20    UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs -->\n\
         \n\
         Every setting can be given as a command-line flag, as an environment\n\
         variable, or as a key in a TOML file named by `--config FILE` (or\n\
         `AUTOPUSH_CONFIG`). A flag wins over the environment, which wins over the\n\
         file, which wins over the default. An unknown key in the file is an error.\n\
         `autopush config` prints the settings a service would run with, as a file\n\
         `--config` reads back (secrets left out unless `--show-secrets`, with a\n\
         comment saying where they go), and a service logs them, one `setting`\n\
         line each, when it starts.\n\
         [packaging/autopush.toml](../packaging/autopush.toml) lists them all,\n\
         commented out with their defaults or an example value. An error names a\n\
         value by where it was given: `--log-format`, `AUTOPUSH_LOG_FORMAT`, or\n\
         `log_format in /etc/autopush/autopush.toml`; an unknown key in the file\n\
         is named with the nearest known one.\n\
         \n\
         ## Secrets\n\
         \n\
         The settings that hold a secret are `crypto_key`, `auth_key`,\n\
         `router_key`, `apns_channels` (`--apns-channels`), `fcm_credentials`\n\
         and `gcm_credentials`. Keep them out of the settings file:\n\
         \n\
         * each has a `_file` form naming a file that holds it: flag\n\
         \x20 `--crypto-key-file`, environment `AUTOPUSH_CRYPTO_KEY_FILE`, file key\n\
         \x20 `crypto_key_file`. Giving a secret and its `_file` form is an error\n\
         \x20 naming both;\n\
         * under systemd, each is read from `$CREDENTIALS_DIRECTORY` by its name\n\
         \x20 (`LoadCredential=crypto_key:/etc/autopush/credentials/crypto_key`, or\n\
         \x20 `LoadCredentialEncrypted=`): the file `crypto_key` there gives\n\
         \x20 `crypto_key`. A credential counts below every explicit setting: a\n\
         \x20 flag, then the environment, then the settings file, then the\n\
         \x20 credential, then the default;\n\
         * every setting that names a file (`tls_cert`, `tls_key`, an APNs\n\
         \x20 channel's `cert` and `key`, an FCM or GCM app's `credential`, the\n\
         \x20 `_file` settings) names a credential as `credential:NAME`: the file\n\
         \x20 NAME in `$CREDENTIALS_DIRECTORY`, which must be there.\n\
         \n\
         A secret read from a file loses its trailing newline; an empty one is an\n\
         error. [The Debian package](package.md#secrets) passes them this way.\n\
         \n\
         The crypto key is also read from `CRYPTO_KEY` (autopush's historical\n\
         name), below `AUTOPUSH_CRYPTO_KEY` and above the file. In the file, the\n\
         bridges' apps are tables: `[apns.channels.NAME]`, `[fcm.apps.NAME]`,\n\
         `[gcm.apps.SENDER_ID]`.\n\
         \n\
         | TOML key | Flag | Environment | Default | Description |\n\
         |---|---|---|---|---|\n",
    );
    let cell = |text: &str| text.replace('|', "\\|");
    for s in settings() {
        let default = s.default.as_deref().map(cell).unwrap_or_default();
        out.push_str(&format!(
            "| `{}` | `{}` | `{}` | {} | {} |\n",
            s.key,
            s.flag,
            s.env,
            default,
            cell(&s.description)
        ));
    }
    out
}

/// packaging/autopush.toml: every setting, commented out, with its
/// description above it.
pub fn example_toml() -> String {
    let defaults = default_values();
    let mut out = String::from(
        "# autopush settings: every setting, commented out with its default or an\n\
         # example, but for the data directory. Uncomment and change what you need;\n\
         # docs/settings.md says more. A flag or an AUTOPUSH_* environment variable\n\
         # wins over this file. It holds no secret: keys and bridge credentials go\n\
         # in systemd credentials (docs/package.md) or in files their `_file`\n\
         # settings name, and a setting that names a file takes credential:NAME.\n\
         # Generated from the code: UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs\n",
    );
    for s in settings() {
        out.push('\n');
        let mut text = format!("{}.", s.description);
        if let Some(default) = &s.default {
            text.push_str(&format!(" Default: {default}."));
        }
        text.push_str(&format!(" ({}, {})", s.flag, s.env));
        // A secret's name is its flag's (`apns_channels`, not `apns`).
        let name = s.flag.trim_start_matches('-').replace('-', "_");
        let secret = SECRETS.contains(&name.as_str());
        if secret {
            text.push_str(&format!(" {}", secret_note(&name)));
        }
        for line in wrap(&text, 76) {
            out.push_str(&format!("# {line}\n"));
        }
        if s.key == "db" {
            out.push_str("# The packaged service's state directory (StateDirectory=autopush):\n");
            out.push_str(&format!("db = \"{PACKAGED_DB}\"\n"));
            continue;
        }
        match (defaults.get(&s.key), example(&s.key)) {
            (Some(value), _) => out.push_str(&format!("# {} = {value}\n", s.key)),
            (None, Some(value)) => out.push_str(&format!("# {} = {value}\n", s.key)),
            (None, None) if secret => {}
            (None, None) => out.push_str(&format!("# {} =\n", s.key)),
        }
    }
    out
}

/// `text` in lines of at most `width` characters (a longer word stands alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split_whitespace() {
        match lines.last_mut() {
            Some(line) if line.len() + 1 + word.len() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_owned()),
        }
    }
    lines
}
