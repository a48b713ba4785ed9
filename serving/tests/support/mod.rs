//! What the TLS tests share: the test certificates (made by
//! `certs/make-tls.sh`) and a client that trusts their CA.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A file of `certs/`.
pub fn cert_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../certs")
        .join(name)
}

/// A client on ring trusting the test CA, speaking `versions`
/// (`rustls::DEFAULT_VERSIONS`: both 1.3 and 1.2).
pub fn client_config(
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    client_config_with(rustls::crypto::ring::default_provider(), versions)
}

/// [`client_config`] on `provider` (ring's, with the suites a test offers).
pub fn client_config_with(
    provider: rustls::crypto::CryptoProvider,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(cert_file("tls-ca.pem"))
        .expect("certs/tls-ca.pem")
    {
        roots.add(cert.expect("a CA certificate")).expect("a root");
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}

/// Close `client` as a TLS client should: its `close_notify`, then what the
/// server sends up to its own (an end, not a cut), returned.
#[allow(dead_code)] // the library's own tests include this module too
pub async fn close_cleanly(client: &mut (impl AsyncRead + AsyncWrite + Unpin)) -> Vec<u8> {
    client.shutdown().await.expect("close_notify");
    let mut rest = Vec::new();
    client
        .read_to_end(&mut rest)
        .await
        .expect("the server's close_notify, not a cut");
    rest
}
