//! A TLS front for a plain-HTTP stand-in, so the server can be tested
//! speaking https to an upstream: it terminates TLS with the test
//! certificate for 127.0.0.1 (`certs/tls-127.0.0.1.pem`, signed by
//! `certs/tls-ca.pem`; `certs/make-tls.sh` makes them) and forwards the bytes.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::cert_file;

pub struct TlsFront {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Listen on a free loopback port, forwarding to `backend`.
    pub async fn start(backend: SocketAddr) -> TlsFront {
        let certs = CertificateDer::pem_file_iter(cert_file("tls-127.0.0.1.pem"))
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .expect("certs/tls-127.0.0.1.pem (run certs/make-tls.sh)");
        let key = PrivateKeyDer::from_pem_file(cert_file("tls-127.0.0.1-key.pem"))
            .expect("certs/tls-127.0.0.1-key.pem (run certs/make-tls.sh)");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("the test certificate and its key");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the TLS front");
        let addr = listener.local_addr().expect("local_addr");
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that refuses the certificate ends here.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    if let Ok(mut plain) = TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    }
                });
            }
        });
        TlsFront { addr, task }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TLS client (rustls on ring) whose only roots are the certificates in
/// the PEM file `ca`.
pub fn client_config(ca: &Path) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(ca)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .unwrap_or_else(|e| panic!("CA certificates in {}: {e}", ca.display()));
    for cert in certs {
        roots
            .add(cert)
            .unwrap_or_else(|e| panic!("a CA certificate in {}: {e}", ca.display()));
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}
