//! TLS with the test certificates (`certs/tls-127.0.0.1.pem`, signed by
//! `certs/tls-ca.pem`; `certs/make-tls.sh` makes them):
//!
//! * [`TlsFront`], a TLS front for a plain-HTTP stand-in, so the server can
//!   be tested speaking https to an upstream: it terminates TLS and forwards
//!   the bytes.
//! * TLS clients of the server's own public ports: [`connect`] (and the
//!   certificate the server showed), and [`post`], an https request.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::{HANG_GUARD, cert_file};

/// The certificates (PEM) in `path`.
pub fn certificates(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .unwrap_or_else(|e| panic!("{} (run certs/make-tls.sh): {e}", path.display()))
}

/// A client trusting only `ca` (a file in `certs/`, e.g. `tls-ca.pem`).
pub fn client_config(ca: &str) -> Arc<rustls::ClientConfig> {
    client_config_from(&cert_file(ca))
}

/// A TLS client (rustls on ring) whose only roots are the certificates in
/// the PEM file at `ca`.
pub fn client_config_from(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca) {
        roots
            .add(cert)
            .unwrap_or_else(|e| panic!("a CA certificate in {}: {e}", ca.display()));
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    Arc::new(config)
}

/// A TLS connection to `addr` (an IP address, checked against the
/// certificate), or why the handshake failed.
pub async fn connect(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> Result<TlsStream<TcpStream>, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("TCP connect to {addr}: {e}"))?;
    let name = ServerName::IpAddress(addr.ip().into());
    TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS handshake with {addr}: {e}"))
}

/// The leaf certificate 127.0.0.1:`port` shows a client trusting `ca`.
pub async fn peer_certificate(port: u16, ca: &str) -> CertificateDer<'static> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let tls = tokio::time::timeout(HANG_GUARD, connect(addr, client_config(ca)))
        .await
        .unwrap_or_else(|_| panic!("TLS handshake with {addr} hung"))
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, session) = tls.get_ref();
    session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .expect("the server showed a certificate")
        .clone()
        .into_owned()
}

/// `POST url` (`https://127.0.0.1:P/...`) over a connection trusting `ca`,
/// as HTTP/1.1 with `Connection: close`; the status and the body.
pub async fn post(url: &str, ca: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let rest = url
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("{url} is not https://"));
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let addr: SocketAddr = host.parse().expect("https://IP:PORT/...");
    let exchange = async {
        let mut tls = connect(addr, client_config(ca))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {}\r\nconnection: close\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        tls.write_all(head.as_bytes()).await.expect("send the head");
        tls.write_all(body).await.expect("send the body");
        let mut answer = Vec::new();
        // The server closes after answering (the client asked it to); a
        // missing close_notify is not this test's business.
        let _ = tls.read_to_end(&mut answer).await;
        answer
    };
    let answer = tokio::time::timeout(HANG_GUARD, exchange)
        .await
        .unwrap_or_else(|_| panic!("POST {url} hung"));
    let answer = String::from_utf8_lossy(&answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("POST {url}: not an HTTP answer: {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_owned())
}

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
