//! Where each setting's value came from, so that an error names the place
//! to fix: the flag, the environment variable, the settings file's key, or
//! the systemd credential.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::parser::ValueSource;

/// Where one setting's value was given.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A command-line flag, as `--log-format`.
    Flag,
    /// An environment variable, by its name.
    Env(String),
    /// A key of the settings file at this path.
    File(PathBuf),
    /// A systemd credential, at this path.
    Credential(PathBuf),
}

/// The source of every setting given, by TOML key; a setting not in it
/// holds its default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sources(BTreeMap<String, Source>);

impl Sources {
    /// The flags' and the environment's settings, as clap parsed them.
    pub fn of_matches(matches: &clap::ArgMatches) -> Sources {
        let mut sources = Sources::default();
        for arg in crate::settings::settings_args() {
            let id = arg.get_id().as_str();
            let source = match matches.try_get_raw(id).ok().flatten() {
                Some(_) => matches.value_source(id),
                None => None,
            };
            match source {
                Some(ValueSource::CommandLine) => sources.set(id, Source::Flag),
                Some(ValueSource::EnvVariable) => {
                    let var = arg.get_env().map(|v| v.to_string_lossy().into_owned());
                    sources.set(id, Source::Env(var.unwrap_or_default()));
                }
                _ => {}
            }
        }
        sources
    }

    pub fn set(&mut self, key: &str, source: Source) {
        self.0.insert(key.to_owned(), source);
    }

    pub fn get(&self, key: &str) -> Option<&Source> {
        self.0.get(key)
    }

    /// These sources over `lower`'s: a setting given in both is this one's.
    pub fn under_lower(mut self, lower: Sources) -> Sources {
        for (key, source) in lower.0 {
            self.0.entry(key).or_insert(source);
        }
        self
    }

    /// The setting `key` as its source names it: `--log-format`,
    /// `AUTOPUSH_LOG_FORMAT`, `log_format in /etc/autopush/autopush.toml`,
    /// `the credential crypto_key`; by its flag when it holds its default.
    pub fn name(&self, key: &str) -> String {
        match self.0.get(key) {
            Some(Source::Env(var)) => var.clone(),
            Some(Source::File(path)) => format!("{key} in {}", path.display()),
            Some(Source::Credential(path)) => format!("the credential {}", path.display()),
            Some(Source::Flag) | None => {
                let args = crate::settings::settings_args();
                let arg = args.iter().find(|a| a.get_id() == key);
                let long = arg.and_then(clap::Arg::get_long);
                format!("--{}", long.map_or(key.replace('_', "-"), str::to_owned))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_is_named_as_the_operator_wrote_it() {
        let mut sources = Sources::default();
        sources.set("log_format", Source::Flag);
        sources.set("port", Source::Env("AUTOPUSH_PORT".into()));
        let mut file = Sources::default();
        for key in ["db", "port"] {
            file.set(key, Source::File("/etc/a.toml".into()));
        }
        let sources = sources.under_lower(file);
        assert_eq!(sources.name("log_format"), "--log-format");
        assert_eq!(sources.name("port"), "AUTOPUSH_PORT");
        assert_eq!(sources.name("db"), "db in /etc/a.toml");
        assert_eq!(sources.name("max_channels"), "--max-channels");
    }
}
