//! The server's secret keys: the endpoint crypto key(s), the registration
//! auth key(s) and the router key(s) that sign node-to-node calls.
//!
//! All-in-one mode works with zero configuration: without a configured key
//! one is generated on first start and kept in the data directory, so
//! endpoints and secrets handed out before a restart still work after it.
//! Split mode needs the same explicit keys on every node.

use std::io::Write;
use std::path::{Path, PathBuf};

use autopush_common::Secret;
use autopush_common::endpoint::{generate_key, parse_key_list};

/// Which key, and the file it is kept in.
#[derive(Clone, Copy, Debug)]
pub enum Key {
    Crypto,
    Auth,
    Router,
}

impl Key {
    fn file(self) -> &'static str {
        match self {
            Key::Crypto => "crypto_key",
            Key::Auth => "auth_key",
            Key::Router => "router_key",
        }
    }

    /// The setting's environment variable.
    fn env(self) -> &'static str {
        match self {
            Key::Crypto => "AUTOPUSH_CRYPTO_KEY",
            Key::Auth => "AUTOPUSH_AUTH_KEY",
            Key::Router => "AUTOPUSH_ROUTER_KEY",
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Key::Crypto => "--crypto-key",
            Key::Auth => "--auth-key",
            Key::Router => "--router-key",
        }
    }
}

/// The shortest `--auth-key` or `--router-key` accepted, in bytes. Both
/// are HMAC-SHA256 keys used as written (`autopush keygen` makes 44 bytes
/// of base64 carrying 32 random ones); a shorter key can be guessed.
pub const MIN_HMAC_KEY_BYTES: usize = 16;

/// Refuse configured HMAC keys shorter than [`MIN_HMAC_KEY_BYTES`], naming
/// where the setting was given (`source`) and which key, never the key
/// itself. The crypto key is a Fernet key, checked when it is decoded.
fn check_strength(key: Key, source: &str, keys: &[String]) -> Result<(), String> {
    if matches!(key, Key::Crypto) {
        return Ok(());
    }
    for (i, k) in keys.iter().enumerate() {
        if k.len() < MIN_HMAC_KEY_BYTES {
            return Err(format!(
                "{source}: key {} of {} is {} bytes; each key must be at least \
                 {MIN_HMAC_KEY_BYTES} bytes (make one with `autopush keygen`)",
                i + 1,
                keys.len(),
                k.len()
            ));
        }
    }
    Ok(())
}

/// Whether a missing all-in-one key may be created (a server starting) or
/// not (a tool reading an existing data directory).
#[derive(Clone, Copy, PartialEq)]
pub enum Missing {
    Generate,
    Fail,
}

/// A key as start-up finds it, before anything is written.
#[derive(Debug)]
pub enum Planned {
    /// Configured, or kept in the data directory.
    Ready(Vec<String>),
    /// Missing from the data directory: made there by [`Planned::load`].
    Generate(Key, PathBuf),
}

/// Check `key` and find it without writing anything: the configured keys
/// (given as `source` names), parsed and checked, or the all-in-one key
/// kept in `data_dir` (to be generated there when missing).
pub fn plan(
    key: Key,
    configured: Option<(&Secret, &str)>,
    data_dir: Option<&Path>,
) -> Result<Planned, String> {
    if let Some((configured, source)) = configured {
        let keys = parse_key_list(configured.expose());
        if keys.is_empty() {
            return Err(format!("{source} is empty"));
        }
        check_strength(key, source, &keys)?;
        return Ok(Planned::Ready(keys));
    }
    let Some(dir) = data_dir else {
        return Err(format!(
            "this mode needs {} ({}, {}_file or the systemd credential {}; the same on every \
             node; make one with `autopush keygen`)",
            key.flag(),
            key.env(),
            key.file(),
            key.file()
        ));
    };
    let path = dir.join(key.file());
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Planned::Ready(parse_key_list(&text))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Planned::Generate(key, path)),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

impl Planned {
    /// The keys, generating (and announcing) a missing all-in-one key.
    pub fn load(self) -> Result<Vec<String>, String> {
        let (key, path) = match self {
            Planned::Ready(keys) => return Ok(keys),
            Planned::Generate(key, path) => (key, path),
        };
        let secret = generate_key();
        write_private(&path, &secret)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let path = std::path::absolute(&path).unwrap_or(path);
        tracing::warn!(
            path = %path.display(),
            "no {} in this data directory: generated a new one. Endpoints and secrets \
             issued by a server on another data directory are not valid here; if you \
             meant to keep them, stop and give that directory as --db",
            key.file()
        );
        Ok(vec![secret])
    }
}

/// The configured keys, or the all-in-one key kept in `data_dir`.
pub fn resolve(
    key: Key,
    configured: Option<(&Secret, &str)>,
    data_dir: Option<&Path>,
    missing: Missing,
) -> Result<Vec<String>, String> {
    match plan(key, configured, data_dir)? {
        Planned::Generate(key, path) if missing == Missing::Fail => Err(format!(
            "no {} at {}: give {} or the --db of an all-in-one server",
            key.file(),
            path.display(),
            key.flag()
        )),
        planned => planned.load(),
    }
}

/// Write a secret readable by its owner only.
fn write_private(path: &Path, secret: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    writeln!(file, "{secret}")?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_key_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        assert!(resolve(Key::Crypto, None, Some(dir.path()), Missing::Fail).is_err());
        let first = resolve(Key::Crypto, None, Some(dir.path()), Missing::Generate).unwrap();
        assert_eq!(
            resolve(Key::Crypto, None, Some(dir.path()), Missing::Fail).unwrap(),
            first
        );
        assert_eq!(
            resolve(
                Key::Crypto,
                Some((&Secret::new("[a,b]"), "--crypto-key")),
                Some(dir.path()),
                Missing::Fail
            )
            .unwrap(),
            vec!["a", "b"]
        );
        assert!(resolve(Key::Crypto, None, None, Missing::Generate).is_err());
    }

    #[test]
    fn short_hmac_keys_are_refused_without_being_echoed() {
        for key in [Key::Auth, Key::Router] {
            let err = resolve(
                key,
                Some((&Secret::new("0123456789abcdef,tiny"), key.flag())),
                None,
                Missing::Fail,
            )
            .unwrap_err();
            assert!(err.contains(key.flag()), "{err}");
            assert!(err.contains("key 2 of 2 is 4 bytes"), "{err}");
            assert!(!err.contains("tiny"), "{err}");
            let strong = generate_key();
            assert_eq!(
                resolve(
                    key,
                    Some((&Secret::new(strong.as_str()), key.flag())),
                    None,
                    Missing::Fail
                )
                .unwrap(),
                vec![strong]
            );
        }
    }
}
