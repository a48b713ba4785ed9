//! What a client sees of the records of an established connection, once
//! the handshake is over and the server protects them itself: a record
//! changed in flight ends the connection with a `bad_record_mac` alert, a
//! record of the wrong type with `unexpected_message`, and a TLS 1.2
//! client (whose records rustls keeps protecting) is served as well. On
//! each TLS 1.3 suite, the keys the server derives at each key update are
//! the client's.

use std::io::{Read, Write};

use autopush_serving::tls::{Certificates, TlsFiles};
use rustls::pki_types::ServerName;
use rustls::{AlertDescription, ClientConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod support;
use support::{cert_file, client_config, client_config_with};

/// An echo server on a free port; its address.
async fn echo_server() -> std::net::SocketAddr {
    let certs = Certificates::load(&TlsFiles {
        cert: cert_file("tls-127.0.0.1.pem"),
        key: cert_file("tls-127.0.0.1-key.pem"),
    })
    .expect("the test certificate");
    let acceptor = certs.acceptor(&[b"http/1.1"]);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.expect("accept");
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = [0u8; 512];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    if stream.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    addr
}

/// A client whose handshake is done, and that then drives its records by
/// hand over a blocking socket.
async fn handshaken(addr: std::net::SocketAddr) -> (std::net::TcpStream, ClientConnection) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::IpAddress(addr.ip().into());
    let mut client = tokio_rustls::TlsConnector::from(client_config(&[&rustls::version::TLS13]))
        .connect(name, tcp)
        .await
        .expect("a handshake");
    // One echo: the server's handshake is over, its records its own.
    client.write_all(b"hello").await.expect("a write");
    let mut back = [0u8; 5];
    client.read_exact(&mut back).await.expect("the echo");
    let (tcp, conn) = client.into_inner();
    let tcp = tcp.into_std().expect("a std socket");
    tcp.set_nonblocking(false).expect("blocking");
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .expect("a hang guard");
    (tcp, conn)
}

/// Read what the server sends until it closes, through `conn`: the error
/// rustls reports, if any.
fn error_received(
    mut tcp: std::net::TcpStream,
    mut conn: ClientConnection,
) -> Option<rustls::Error> {
    let mut buf = [0u8; 4096];
    loop {
        let n = tcp.read(&mut buf).expect("the server's answer");
        if n == 0 {
            return None;
        }
        conn.read_tls(&mut &buf[..n]).expect("read_tls");
        if let Err(e) = conn.process_new_packets() {
            return Some(e);
        }
    }
}

#[tokio::test]
async fn a_record_changed_in_flight_ends_the_connection_with_bad_record_mac() {
    let addr = echo_server().await;
    let (mut tcp, mut conn) = handshaken(addr).await;
    conn.writer()
        .write_all(b"changed in flight")
        .expect("a write");
    let mut record = Vec::new();
    conn.write_tls(&mut record).expect("a record");
    let last = record.len() - 1;
    record[last] ^= 1;
    tcp.write_all(&record).expect("the record sent");
    let error = tokio::task::spawn_blocking(move || error_received(tcp, conn))
        .await
        .expect("the reader");
    assert!(
        matches!(
            error,
            Some(rustls::Error::AlertReceived(AlertDescription::BadRecordMac))
        ),
        "the client got {error:?}, not the alert bad_record_mac"
    );
}

#[tokio::test]
async fn a_record_not_protected_ends_the_connection_with_unexpected_message() {
    let addr = echo_server().await;
    let (mut tcp, conn) = handshaken(addr).await;
    // A plaintext handshake record (a ClientHello's header) after the handshake.
    tcp.write_all(&[22, 3, 3, 0, 4, 1, 0, 0, 0])
        .expect("the record sent");
    let error = tokio::task::spawn_blocking(move || error_received(tcp, conn))
        .await
        .expect("the reader");
    assert!(
        matches!(
            error,
            Some(rustls::Error::AlertReceived(
                AlertDescription::UnexpectedMessage
            ))
        ),
        "the client got {error:?}, not the alert unexpected_message"
    );
}

#[tokio::test]
async fn a_tls_1_2_client_is_served() {
    let addr = echo_server().await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::IpAddress(addr.ip().into());
    let mut client = tokio_rustls::TlsConnector::from(client_config(&[&rustls::version::TLS12]))
        .connect(name, tcp)
        .await
        .expect("a TLS 1.2 handshake");
    assert_eq!(
        client.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );
    let big: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
    let mut back = vec![0u8; big.len()];
    let (mut reader, mut writer) = tokio::io::split(&mut client);
    let (written, read) = tokio::join!(writer.write_all(&big), reader.read_exact(&mut back));
    written.expect("a large write");
    read.expect("the large echo");
    assert!(back == big, "the echo differs");
    support::close_cleanly(&mut client).await;
}

/// A client that offers only `suite` updates its keys (asking the server to
/// update its own) at once after the handshake and after each echo: the
/// server reads and answers under every new key.
async fn keys_updated_on(suite: rustls::SupportedCipherSuite) {
    let addr = echo_server().await;
    let provider = rustls::crypto::CryptoProvider {
        cipher_suites: vec![suite],
        ..rustls::crypto::ring::default_provider()
    };
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::IpAddress(addr.ip().into());
    let mut client =
        tokio_rustls::TlsConnector::from(client_config_with(provider, &[&rustls::version::TLS13]))
            .connect(name, tcp)
            .await
            .expect("a handshake");
    assert_eq!(
        client.get_ref().1.negotiated_cipher_suite(),
        Some(suite),
        "another suite was negotiated"
    );
    for round in 0..4u8 {
        client
            .get_mut()
            .1
            .refresh_traffic_keys()
            .expect("a key update");
        let hello = [round; 300];
        client.write_all(&hello).await.expect("a write");
        let mut back = [0u8; 300];
        client.read_exact(&mut back).await.expect("the echo");
        assert!(back == hello, "the echo after key update {round} differs");
    }
    support::close_cleanly(&mut client).await;
}

#[tokio::test]
async fn keys_are_updated_on_aes_128_gcm_sha256() {
    keys_updated_on(rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256).await;
}

#[tokio::test]
async fn keys_are_updated_on_aes_256_gcm_sha384() {
    keys_updated_on(rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384).await;
}

#[tokio::test]
async fn keys_are_updated_on_chacha20_poly1305_sha256() {
    keys_updated_on(rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256).await;
}
