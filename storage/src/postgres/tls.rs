//! TLS to PostgreSQL as libpq's DSN asks for it: `sslmode` and
//! `sslrootcert`, on rustls with ring (the process's one crypto provider).
//!
//! tokio-postgres knows `disable`, `prefer` and `require` only and no
//! `sslrootcert`, so both are taken out of the DSN here and the connector
//! does the checking:
//!
//! * absent or `disable`: plain connections;
//! * `prefer`: TLS when the server offers it, else plain; the certificate is
//!   not checked (as libpq does);
//! * `require`: TLS; with `sslrootcert` the certificate is checked as by
//!   `verify-ca`, else not at all (as libpq does);
//! * `verify-ca`: TLS, the certificate signed by a CA of `sslrootcert`;
//! * `verify-full`: that, and issued to the host the DSN names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`, all five that use or refuse TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SslMode {
    #[default]
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// What the DSN asked of TLS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`: the PEM file of the CA certificates to trust.
    pub root_cert: Option<PathBuf>,
}

impl TlsSettings {
    /// `dsn` without its `sslmode` and `sslrootcert` (for tokio-postgres),
    /// and what they said. Errors never repeat the DSN.
    pub fn split_dsn(dsn: &str) -> Result<(String, TlsSettings), String> {
        let Some((base, query)) = dsn.split_once('?') else {
            return Ok((dsn.to_owned(), TlsSettings::default()));
        };
        let mut mode = None;
        let mut root_cert = None;
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "sslmode" => mode = Some(percent_decoded(value)?),
                "sslrootcert" => root_cert = Some(PathBuf::from(percent_decoded(value)?)),
                _ => rest.push(pair),
            }
        }
        let mode = match mode.as_deref() {
            None | Some("disable") => SslMode::Disable,
            Some("prefer") => SslMode::Prefer,
            Some("require") => SslMode::Require,
            Some("verify-ca") => SslMode::VerifyCa,
            Some("verify-full") => SslMode::VerifyFull,
            Some(other) => {
                return Err(format!(
                    "--db postgres://...: sslmode={other} is not one of disable, prefer, \
                     require, verify-ca, verify-full"
                ));
            }
        };
        match (mode, &root_cert) {
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(format!(
                    "--db postgres://...: sslmode={} needs sslrootcert=PATH, the PEM file of \
                     the CA certificates to trust",
                    mode.name()
                ));
            }
            (SslMode::Disable | SslMode::Prefer, Some(_)) => {
                return Err(format!(
                    "--db postgres://...: sslrootcert checks nothing with sslmode={}: \
                     say sslmode=verify-full (or verify-ca)",
                    mode.name()
                ));
            }
            _ => {}
        }
        let dsn = match rest.is_empty() {
            true => base.to_owned(),
            false => format!("{base}?{}", rest.join("&")),
        };
        Ok((dsn, TlsSettings { mode, root_cert }))
    }

    /// tokio-postgres's mode: whether to ask the server for TLS, and
    /// whether to go on without it.
    pub fn tokio_postgres_mode(&self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Tp;
        match self.mode {
            SslMode::Disable => Tp::Disable,
            SslMode::Prefer => Tp::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Tp::Require,
        }
    }

    /// The connector for these settings, `None` for plain connections.
    /// An unreadable `sslrootcert`, or one without a usable certificate,
    /// is an error naming the file.
    pub fn connector(&self) -> Result<Option<MakeRustlsConnect>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match (self.mode, &self.root_cert) {
            (SslMode::Disable, _) => return Ok(None),
            (SslMode::Prefer, _) | (SslMode::Require, None) => Arc::new(HostUnchecked {
                roots: None,
                provider: provider.clone(),
            }),
            (SslMode::Require | SslMode::VerifyCa, Some(path)) => Arc::new(HostUnchecked {
                roots: Some(Arc::new(roots(path)?)),
                provider: provider.clone(),
            }),
            (SslMode::VerifyFull, Some(path)) => WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(path)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?,
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(format!("sslmode={} needs sslrootcert", self.mode.name()));
            }
        };
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS to PostgreSQL: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Some(MakeRustlsConnect::new(config)))
    }
}

impl SslMode {
    /// As the DSN spells it.
    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The CA certificates in the PEM file at `path`.
fn roots(path: &Path) -> Result<RootCertStore, String> {
    let named = |e: &dyn std::fmt::Display| format!("sslrootcert {}: {e}", path.display());
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| named(&e))?;
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| named(&e))?;
    }
    if roots.is_empty() {
        return Err(named(&"no certificate in it"));
    }
    Ok(roots)
}

/// A URL query value as written: `%XX` escapes decoded.
fn percent_decoded(value: &str) -> Result<String, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = value
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or("--db postgres://...: a % in the query is not followed by two hex digits")?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "--db postgres://...: the query is not UTF-8".to_owned())
}

/// Every mode but `verify-full`: the host the certificate names is not
/// checked. With `roots` (`verify-ca`, and `require` with `sslrootcert`)
/// the certificate must chain to one of them; without (`prefer`, and
/// `require` without `sslrootcert`) the connection is only encrypted. The
/// handshake's signatures are checked either way.
#[derive(Debug)]
struct HostUnchecked {
    roots: Option<Arc<RootCertStore>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for HostUnchecked {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            let cert = ParsedCertificate::try_from(end_entity)?;
            verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.provider.signature_verification_algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_leave_the_dsn() {
        let (dsn, tls) = TlsSettings::split_dsn(
            "postgres://u@a,b/d?target_session_attrs=read-write&sslmode=verify-full\
             &sslrootcert=/etc/ssl/pg%20ca.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(
            dsn,
            "postgres://u@a,b/d?target_session_attrs=read-write&connect_timeout=3"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(
            tls.root_cert.as_deref(),
            Some(Path::new("/etc/ssl/pg ca.pem"))
        );
        let (dsn, tls) = TlsSettings::split_dsn("postgres://u@h/d?sslmode=require").unwrap();
        assert_eq!(
            (dsn.as_str(), tls.mode),
            ("postgres://u@h/d", SslMode::Require)
        );
        let (_, tls) = TlsSettings::split_dsn("postgres://u@h/d").unwrap();
        assert_eq!(tls, TlsSettings::default());
        assert!(tls.connector().unwrap().is_none());
    }

    #[test]
    fn a_check_without_its_ca_or_a_ca_without_a_check_is_refused() {
        for (dsn, says) in [
            (
                "postgres://u:pw@h/d?sslmode=verify-full",
                "needs sslrootcert",
            ),
            ("postgres://u:pw@h/d?sslmode=verify-ca", "needs sslrootcert"),
            ("postgres://u:pw@h/d?sslrootcert=/ca.pem", "checks nothing"),
            ("postgres://u:pw@h/d?sslmode=allow", "not one of"),
            (
                "postgres://u:pw@h/d?sslmode=verify-full&sslrootcert=%zz",
                "hex",
            ),
        ] {
            let e = TlsSettings::split_dsn(dsn).unwrap_err();
            assert!(e.contains(says) && !e.contains("pw"), "{dsn}: {e}");
        }
    }

    #[test]
    fn an_unreadable_or_empty_root_cert_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        for path in [dir.path().join("missing.pem"), empty] {
            for mode in [SslMode::VerifyFull, SslMode::VerifyCa, SslMode::Require] {
                let tls = TlsSettings {
                    mode,
                    root_cert: Some(path.clone()),
                };
                let e = tls.connector().err().expect("refused");
                assert!(e.contains(&path.display().to_string()), "{e}");
            }
        }
    }
}
