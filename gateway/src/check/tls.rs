//! The certificates `autopush check` trusts, for `wss://` and `https://`:
//! the system's roots (Debian: `ca-certificates`), and a private CA given
//! with `--ca`.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};

/// A client configuration trusting the system's roots and `ca` (PEM).
pub fn client_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    // A system without roots can still check a service with a private CA.
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    if let Some(ca) = ca {
        let certs = CertificateDer::pem_file_iter(ca)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("--ca {}: not a readable PEM file: {e}", ca.display()))?;
        if certs.is_empty() {
            return Err(format!("--ca {}: no certificate in it", ca.display()));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("--ca {}: {e}", ca.display()))?;
        }
    }
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Why a TLS connection to `url` failed, in one line: rustls's reason, and
/// what to do about a certificate it refused.
pub fn failed(url: &str, error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        // An io::Error's source skips the error it wraps: look inside.
        let inner = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map_or(e, |inner| inner as &(dyn std::error::Error + 'static));
        if let Some(refused @ rustls::Error::InvalidCertificate(_)) = inner.downcast_ref() {
            return format!(
                "{url}: the server's certificate is refused ({refused}); for a private CA, \
                 give its certificate with --ca FILE"
            );
        }
        cause = e.source();
    }
    format!(
        "{url}: TLS failed: {}",
        autopush_common::http_client::error_chain(error)
    )
}
