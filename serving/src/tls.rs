//! TLS on the public ports (websocket and endpoint): a certificate chain and
//! its key from PEM files, replaced without a restart.
//!
//! Every handshake asks [`Certificates`] for the pair in use, so a reload
//! (on SIGHUP, or when either file changes) serves new handshakes with the
//! new pair while established connections keep theirs. A pair that fails to
//! load is logged and the old one stays.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub use crate::tls_stream::TlsAcceptor;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{error, info};

/// The PEM files of a certificate chain (leaf first) and its private key
/// (PKCS#8, PKCS#1 or SEC1).
#[derive(Clone, Debug, PartialEq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How often the files are looked at for a change.
pub const POLL_EVERY: Duration = Duration::from_secs(5);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The pair in use, shared by the handshakes of every TLS port.
#[derive(Debug)]
pub struct Certificates {
    files: TlsFiles,
    current: RwLock<Arc<CertifiedKey>>,
    /// What the files held at the last load, and at the last look.
    loaded: Mutex<(Contents, Contents)>,
}

/// The bytes of both files (`None`: unreadable).
type Contents = Option<(Vec<u8>, Vec<u8>)>;

fn read(files: &TlsFiles) -> Contents {
    Some((
        std::fs::read(&files.cert).ok()?,
        std::fs::read(&files.key).ok()?,
    ))
}

/// The pair in `files`, checked: every error names the file and what is wrong.
pub fn load(files: &TlsFiles) -> Result<CertifiedKey, String> {
    let (cert, key) = (files.cert.display(), files.key.display());
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("--tls-cert {cert}: {}", pem_error(e)))?;
    if certs.is_empty() {
        return Err(format!(
            "--tls-cert {cert}: no certificate in it (it needs -----BEGIN CERTIFICATE----- blocks, \
             the server's first)"
        ));
    }
    let private = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("--tls-key {key}: {}", pem_error(e)))?;
    let signing = provider()
        .key_provider
        .load_private_key(private)
        .map_err(|e| format!("--tls-key {key}: not a usable private key: {e}"))?;
    let pair = CertifiedKey::new(certs, signing);
    match pair.keys_match() {
        Ok(()) => Ok(pair),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(
            format!("--tls-key {key} is not the key of the certificate in --tls-cert {cert}"),
        ),
        Err(e) => Err(format!("--tls-cert {cert}: {e}")),
    }
}

fn pem_error(e: rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::Io(e) => format!("cannot read it: {e}"),
        Error::NoItemsFound => "no PEM block of the expected kind in it".into(),
        e => format!("not a valid PEM file: {e:?}"),
    }
}

impl Certificates {
    /// The pair in `files`, or why it cannot be used.
    pub fn load(files: &TlsFiles) -> Result<Arc<Certificates>, String> {
        let contents = read(files);
        let pair = load(files)?;
        info!(cert = %files.cert.display(), key = %files.key.display(), "TLS on the public ports");
        Ok(Arc::new(Certificates {
            files: files.clone(),
            current: RwLock::new(Arc::new(pair)),
            loaded: Mutex::new((contents.clone(), contents)),
        }))
    }

    /// An acceptor offering `alpn` (e.g. `http/1.1`) with the pair in use.
    pub fn acceptor(self: &Arc<Self>, alpn: &[&[u8]]) -> TlsAcceptor {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        // Established TLS 1.3 connections protect their records themselves
        // (tls_record.rs), with the keys rustls hands over.
        config.enable_secret_extraction = true;
        TlsAcceptor::from(Arc::new(config))
    }

    /// Load the files again; on success new handshakes use the new pair,
    /// else the error is logged and the old pair stays.
    pub fn reload(&self, why: &str) -> bool {
        let contents = read(&self.files);
        *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) = (contents.clone(), contents);
        match load(&self.files) {
            Ok(pair) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(pair);
                info!(cert = %self.files.cert.display(), why, "TLS certificate reloaded");
                true
            }
            Err(e) => {
                error!(
                    why,
                    "TLS certificate not reloaded, the old one stays in use: {e}"
                );
                false
            }
        }
    }

    /// Whether the files changed since the last load and have stayed the
    /// same since the last look (so a pair half-way through being written
    /// is not loaded).
    fn changed(&self) -> bool {
        let now = read(&self.files);
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let (at_load, last_look) = &mut *loaded;
        let settled = now == *last_look;
        *last_look = now.clone();
        settled && now != *at_load && now.is_some()
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// Reload `certs` on SIGHUP and when their files change, forever, and
/// call `also` on each SIGHUP after them (the service's one handler of the
/// signal). Without TLS, SIGHUP reloads no certificate: a reload
/// (systemd's `ExecReload`) must never stop the service. The handler is
/// installed before this returns.
pub fn reloader(
    certs: Option<Arc<Certificates>>,
    poll: Duration,
    mut also: impl FnMut() + Send + 'static,
) -> std::io::Result<impl std::future::Future<Output = ()> + Send> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup())?;
    Ok(async move {
        let mut every = tokio::time::interval(poll);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = hangup.recv() => {
                    match &certs {
                        Some(certs) => {
                            certs.reload("SIGHUP");
                        }
                        None => info!("SIGHUP: nothing to reload (no --tls-cert)"),
                    }
                    also();
                },
                _ = every.tick(), if certs.is_some() => {
                    if let Some(certs) = certs.as_ref().filter(|c| c.changed()) {
                        certs.reload("the files changed");
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certs_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../certs")
    }

    fn files(cert: &str, key: &str) -> TlsFiles {
        TlsFiles {
            cert: certs_dir().join(cert),
            key: certs_dir().join(key),
        }
    }

    #[test]
    fn a_pair_loads_and_every_error_names_its_file() {
        assert!(load(&files("tls-127.0.0.1.pem", "tls-127.0.0.1-key.pem")).is_ok());
        let e = load(&files("missing.pem", "tls-127.0.0.1-key.pem")).unwrap_err();
        assert!(e.contains("--tls-cert") && e.contains("missing.pem"), "{e}");
        let e = load(&files("tls-127.0.0.1.pem", "tls-127.0.0.1.pem")).unwrap_err();
        assert!(
            e.contains("--tls-key") && e.contains("tls-127.0.0.1.pem"),
            "{e}"
        );
        let e = load(&files("tls-127.0.0.1.pem", "apns-other-key.pem")).unwrap_err();
        assert!(e.contains("is not the key of the certificate"), "{e}");
    }

    #[test]
    fn a_change_is_loaded_once_it_has_settled() {
        let dir = tempfile::tempdir().unwrap();
        let tls = TlsFiles {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
        };
        let copy = |cert: &str, key: &str| {
            std::fs::copy(certs_dir().join(cert), &tls.cert).unwrap();
            std::fs::copy(certs_dir().join(key), &tls.key).unwrap();
        };
        copy("tls-127.0.0.1.pem", "tls-127.0.0.1-key.pem");
        let certs = Certificates::load(&tls).unwrap();
        assert!(!certs.changed());
        std::fs::write(&tls.cert, b"half-written").unwrap();
        assert!(!certs.changed(), "a file that just changed is not settled");
        assert!(certs.changed());
        assert!(!certs.reload("test"), "a broken cert is refused");
        assert!(!certs.changed(), "a refused change is not tried again");
    }
}
