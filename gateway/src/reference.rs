//! The settings reference (docs/settings.md) and the example settings file
//! (packaging/autopush.toml), generated from the settings' clap
//! declarations so that neither can drift from the code: a test compares
//! the checked-in files with what this module makes, and rewrites them
//! with `UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs`.

use std::collections::BTreeMap;

use crate::settings::{SettingsLayer, settings_args};

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
         `--config` reads back (secrets redacted unless `--show-secrets`), and a\n\
         service logs them, one `setting` line each, when it starts.\n\
         [packaging/autopush.toml](../packaging/autopush.toml) lists them all,\n\
         commented out, with their defaults.\n\
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
        "# autopush settings: every setting, commented out with its default.\n\
         # Uncomment and change what you need; docs/settings.md says more.\n\
         # A flag or an AUTOPUSH_* environment variable wins over this file.\n\
         # Generated from the code: UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs\n",
    );
    for s in settings() {
        out.push('\n');
        let mut text = format!("{}.", s.description);
        if let Some(default) = &s.default {
            text.push_str(&format!(" Default: {default}."));
        }
        text.push_str(&format!(" ({}, {})", s.flag, s.env));
        for line in wrap(&text, 76) {
            out.push_str(&format!("# {line}\n"));
        }
        match defaults.get(&s.key) {
            Some(value) => out.push_str(&format!("# {} = {value}\n", s.key)),
            None => out.push_str(&format!("# {} =\n", s.key)),
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
