//! TLS for the server under test: certificates made at run time with the
//! `openssl` command line tool (P-256 or RSA-2048 keys), signed by one CA of
//! this run, which every client of the run trusts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use tempfile::TempDir;

/// The kind of key a server certificate has.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KeyKind {
    P256,
    Rsa2048,
}

impl KeyKind {
    pub fn name(self) -> &'static str {
        match self {
            KeyKind::P256 => "P-256",
            KeyKind::Rsa2048 => "RSA-2048",
        }
    }

    fn newkey(self) -> &'static [&'static str] {
        match self {
            KeyKind::P256 => &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
            KeyKind::Rsa2048 => &["-newkey", "rsa:2048"],
        }
    }
}

/// A certificate for 127.0.0.1 and its key, signed by the run's CA.
pub struct Certificate {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The run's CA: its files live as long as the process.
struct Authority {
    dir: TempDir,
}

static AUTHORITY: OnceLock<Authority> = OnceLock::new();

fn authority() -> &'static Authority {
    AUTHORITY.get_or_init(|| {
        let dir = TempDir::new().expect("a temporary directory for certificates");
        openssl(
            dir.path(),
            &["req", "-x509", "-noenc", "-days", "2"],
            KeyKind::P256,
            &[
                "-subj",
                "/CN=autopush-bench CA (TEST ONLY)",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        );
        Authority { dir }
    })
}

/// The run's CA certificate (PEM), for clients to trust.
pub fn ca_file() -> PathBuf {
    authority().dir.path().join("ca.pem")
}

/// A new certificate for 127.0.0.1 with a `kind` key, signed by the run's CA.
pub fn issue(kind: KeyKind) -> Certificate {
    let dir = authority().dir.path();
    let stem = match kind {
        KeyKind::P256 => "p256",
        KeyKind::Rsa2048 => "rsa2048",
    };
    let (cert, key) = (format!("{stem}.pem"), format!("{stem}-key.pem"));
    openssl(
        dir,
        &["req", "-x509", "-noenc", "-days", "2"],
        kind,
        &[
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:FALSE",
            "-addext",
            "extendedKeyUsage=serverAuth",
            "-keyout",
            &key,
            "-out",
            &cert,
        ],
    );
    Certificate {
        cert: dir.join(cert),
        key: dir.join(key),
    }
}

fn openssl(dir: &Path, command: &[&str], kind: KeyKind, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(command)
        .args(kind.newkey())
        .args(args)
        .output()
        .expect("the openssl command line tool (to make test certificates)");
    if !out.status.success() {
        panic!(
            "openssl {}: {}",
            command.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A TLS client (rustls on ring) trusting only the CA in `ca`, without
/// session resumption: every connection makes a full handshake, as a
/// node's clients do after it restarts.
pub fn client_config(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut config = (*autopush_tests::tls::client_config_from(ca)).clone();
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}
