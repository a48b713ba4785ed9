//! The endpoint crypto key(s).
//!
//! All-in-one mode works with zero configuration: without a configured key
//! one is generated on first start and kept in the data directory, so
//! endpoints handed out before a restart still work after it. Split mode
//! needs the same explicit key on every node.

use std::io::Write;
use std::path::Path;

use autopush_common::endpoint::{generate_key, parse_key_list};

const KEY_FILE: &str = "crypto_key";

/// Whether a missing all-in-one key may be created (a server starting) or
/// not (a tool reading an existing data directory).
#[derive(Clone, Copy, PartialEq)]
pub enum Missing {
    Generate,
    Fail,
}

/// The configured keys, or the all-in-one key kept in `data_dir`.
pub fn resolve(
    configured: Option<&str>,
    data_dir: Option<&Path>,
    missing: Missing,
) -> Result<Vec<String>, String> {
    if let Some(configured) = configured {
        let keys = parse_key_list(configured);
        if keys.is_empty() {
            return Err("crypto_key is empty".into());
        }
        return Ok(keys);
    }
    let Some(dir) = data_dir else {
        return Err("this mode needs --crypto-key (the same on every node; make one with `autopush keygen`)".into());
    };
    let path = dir.join(KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(parse_key_list(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && missing == Missing::Fail => {
            Err(format!(
                "no crypto key at {}: give --crypto-key or the --db of an all-in-one server",
                path.display()
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = generate_key();
            write_private(&path, &key)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            tracing::info!(path = %path.display(), "generated a new endpoint crypto key");
            Ok(vec![key])
        }
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
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
        assert!(resolve(None, Some(dir.path()), Missing::Fail).is_err());
        let first = resolve(None, Some(dir.path()), Missing::Generate).unwrap();
        assert_eq!(
            resolve(None, Some(dir.path()), Missing::Fail).unwrap(),
            first
        );
        assert_eq!(
            resolve(Some("[a,b]"), Some(dir.path()), Missing::Fail).unwrap(),
            vec!["a", "b"]
        );
        assert!(resolve(None, None, Missing::Generate).is_err());
    }
}
