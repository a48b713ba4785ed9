//! TLS on the public ports: wss:// and https:// with the test CA, the ports
//! that stay plain, certificate reloads that keep connections up, and the
//! start-up refusals of a bad pair. The certificates are `certs/tls-*.pem`
//! (`certs/make-tls.sh`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use autopush_crypto::ece;
use autopush_crypto::unb64;
use autopush_tests::server::run_autopush;
use autopush_tests::*;
use reqwest::Method;

const CA: &str = "tls-ca.pem";
const FIRST: (&str, &str) = ("tls-127.0.0.1.pem", "tls-127.0.0.1-key.pem");
const RENEWED: (&str, &str) = ("tls-127.0.0.1-renewed.pem", "tls-127.0.0.1-renewed-key.pem");

/// How long a reload may take to show (the files are polled every few
/// seconds); a hang guard only.
const RELOAD_GUARD: Duration = Duration::from_secs(60);

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// The certificate and key files a server is started with, in a directory
/// of their own so a test can replace them.
struct Pair {
    dir: tempfile::TempDir,
}

impl Pair {
    fn new(pair: (&str, &str)) -> Pair {
        let files = Pair {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        files.install(pair);
        files
    }

    fn cert(&self) -> PathBuf {
        self.dir.path().join("cert.pem")
    }

    fn key(&self) -> PathBuf {
        self.dir.path().join("key.pem")
    }

    /// Put `pair` in place, as a renewal does.
    fn install(&self, (cert, key): (&str, &str)) {
        std::fs::copy(cert_file(cert), self.cert()).expect("copy the certificate");
        std::fs::copy(cert_file(key), self.key()).expect("copy the key");
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            path(&self.cert()),
            "--tls-key".into(),
            path(&self.key()),
        ]
    }

    async fn start(&self) -> Server {
        let args = self.args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start_with(&args).await
    }
}

/// The leaf certificate of `certs/NAME`.
fn leaf(name: &str) -> rustls::pki_types::CertificateDer<'static> {
    tls::certificates(&cert_file(name)).remove(0)
}

async fn wss_client(server: &Server) -> WsClient {
    WsClient::connect_tls_hello(&server.wss_url(), &cert_file(CA)).await
}

/// Push `text` to `sub` over https (trusting the test CA); the status.
async fn push_over_https(sub: &Subscription, text: &str) -> u16 {
    let p256dh = unb64(&sub.keys.p256dh).expect("p256dh");
    let auth = unb64(&sub.keys.auth).expect("auth");
    let message =
        ece::encrypt(&p256dh, &auth, text.as_bytes(), ece::Encoding::Aes128Gcm).expect("encrypt");
    let mut headers = vec![("ttl".to_owned(), "60".to_owned())];
    headers.extend(
        message
            .http_headers()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v)),
    );
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let (status, body) = tls::post(&sub.endpoint, CA, &headers, &message.body).await;
    assert_eq!(status, 201, "push over https: {body}");
    status
}

/// Push `text` over https and receive it, decrypted, on `ws`.
async fn delivered(ws: &mut WsClient, sub: &Subscription, text: &str) {
    push_over_https(sub, text).await;
    let (notification, plain) = sub.receive(ws).await;
    assert_eq!(plain.text, text);
    ws.ack_notification(&notification).await;
}

/// Wait (hang-guarded) until `port` shows the certificate of `name`.
async fn until_shown(port: u16, name: &str) {
    let want = leaf(name);
    let deadline = tokio::time::Instant::now() + RELOAD_GUARD;
    while tls::peer_certificate(port, CA).await != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "port {port} did not show {name} within {RELOAD_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Wait (hang-guarded) until the server's log has `line`.
async fn until_logged(server: &Server, line: &str) -> String {
    let deadline = tokio::time::Instant::now() + RELOAD_GUARD;
    loop {
        let log = server.stderr();
        if log.contains(line) {
            return log;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {line:?} in the log within {RELOAD_GUARD:?}:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_wss_client_receives_a_push_sent_to_the_https_endpoint() {
    let pair = Pair::new(FIRST);
    let server = pair.start().await;
    let mut ws = wss_client(&server).await;
    let sub = Subscription::new(&mut ws).await;
    assert!(
        sub.endpoint
            .starts_with(&format!("{}/", server.https_endpoint_base())),
        "the endpoint is not https: {}",
        sub.endpoint
    );
    delivered(&mut ws, &sub, "over TLS both ways").await;

    // Plain HTTP on the TLS ports fails, and hurts nobody else.
    assert!(
        WsClient::try_connect(&server.ws_url(), Some(ws::SUBPROTOCOL))
            .await
            .is_err(),
        "a ws:// client got through on the TLS port"
    );
    let plain = reqwest::get(format!("{}/health", server.endpoint_base())).await;
    assert!(plain.is_err(), "plain http on the TLS endpoint: {plain:?}");
    delivered(&mut ws, &sub, "still here").await;
    wss_client(&server).await.close().await;
    // The internal router API stays plain.
    let metrics = http::get(&format!("{}/metrics", server.router_base())).await;
    assert_eq!(metrics.status, 200, "{metrics:?}");
    let log = server.stderr();
    assert!(
        !log.contains("ERROR"),
        "a client's bad TLS was logged as an error:\n{log}"
    );
    ws.close().await;
}

#[tokio::test]
async fn autopush_check_passes_over_wss_with_the_ca_and_names_the_problem_without() {
    let pair = Pair::new(FIRST);
    let server = pair.start().await;
    let ca = path(&cert_file(CA));
    let out = run_autopush(&["check", &server.wss_url(), "--ca", &ca]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "check with --ca failed:\n{stdout}");
    assert!(stdout.contains("checks passed"), "{stdout}");

    let out = run_autopush(&["check", &server.wss_url()]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "check without --ca passed:\n{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("FAIL"))
        .unwrap_or_else(|| panic!("no FAIL line:\n{stdout}"));
    assert!(
        line.contains(&server.wss_url())
            && line.contains("certificate")
            && line.contains("UnknownIssuer")
            && line.contains("--ca"),
        "{line}"
    );
}

#[tokio::test]
async fn sighup_reloads_the_certificate_and_keeps_connections() {
    let pair = Pair::new(FIRST);
    let server = pair.start().await;
    let (ws_port, endpoint_port) = server.public_ports();
    assert_eq!(tls::peer_certificate(ws_port, CA).await, leaf(FIRST.0));
    let mut ws = wss_client(&server).await;
    let sub = Subscription::new(&mut ws).await;

    pair.install(RENEWED);
    server.hangup();
    until_logged(&server, "TLS certificate reloaded").await;
    assert_eq!(tls::peer_certificate(ws_port, CA).await, leaf(RENEWED.0));
    assert_eq!(
        tls::peer_certificate(endpoint_port, CA).await,
        leaf(RENEWED.0)
    );
    // The websocket made with the first certificate is still up.
    delivered(&mut ws, &sub, "after the reload").await;
    ws.close().await;
}

#[tokio::test]
async fn a_changed_file_is_reloaded_without_a_signal() {
    let pair = Pair::new(FIRST);
    let server = pair.start().await;
    let (ws_port, endpoint_port) = server.public_ports();
    let mut ws = wss_client(&server).await;
    let sub = Subscription::new(&mut ws).await;

    pair.install(RENEWED);
    until_shown(ws_port, RENEWED.0).await;
    until_shown(endpoint_port, RENEWED.0).await;
    delivered(&mut ws, &sub, "after the files changed").await;
    ws.close().await;
}

#[tokio::test]
async fn a_broken_new_certificate_keeps_the_old_one() {
    let pair = Pair::new(FIRST);
    let server = pair.start().await;
    let (ws_port, _) = server.public_ports();
    std::fs::write(pair.cert(), "not a certificate\n").expect("break the certificate");
    server.hangup();
    let log = until_logged(&server, "not reloaded").await;
    let line = log
        .lines()
        .find(|l| l.contains("not reloaded"))
        .unwrap_or_default();
    assert!(
        line.contains("ERROR") && line.contains(&path(&pair.cert())),
        "{line}"
    );
    assert_eq!(tls::peer_certificate(ws_port, CA).await, leaf(FIRST.0));
    wss_client(&server).await.close().await;
}

#[tokio::test]
async fn sighup_without_tls_does_not_stop_the_service() {
    let server = Server::start().await;
    server.hangup();
    until_logged(&server, "nothing to reload").await;
    let reply = http::request(
        Method::GET,
        &format!("{}/health", server.endpoint_base()),
        &[],
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
}

/// `autopush` with `args`, which must fail at start-up before making its
/// data directory; its stderr.
async fn refused(args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db");
    let ports = server::port_flags();
    let mut all: Vec<&str> = vec!["--db", db.to_str().expect("utf-8 path")];
    all.extend(ports.iter().map(String::as_str));
    all.extend(args);
    let out = run_autopush(&all).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "autopush {args:?} started:\n{stderr}"
    );
    assert!(
        !db.exists(),
        "autopush {args:?} made its data directory first"
    );
    stderr
}

#[tokio::test]
async fn a_bad_pair_stops_start_up_naming_the_file() {
    let (cert, key) = (path(&cert_file(FIRST.0)), path(&cert_file(FIRST.1)));
    let stderr = refused(&["--tls-cert", &cert]).await;
    assert!(
        stderr.contains("--tls-cert") && stderr.contains("--tls-key"),
        "{stderr}"
    );

    let missing = "/nonexistent/autopush-cert.pem";
    let stderr = refused(&["--tls-cert", missing, "--tls-key", &key]).await;
    assert!(
        stderr.contains(missing) && stderr.contains("cannot read"),
        "{stderr}"
    );

    let other_key = path(&cert_file(RENEWED.1));
    let stderr = refused(&["--tls-cert", &cert, "--tls-key", &other_key]).await;
    assert!(
        stderr.contains(&other_key) && stderr.contains("is not the key of the certificate"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_client_that_stalls_the_handshake_is_closed() {
    let pair = Pair::new(FIRST);
    let mut args = pair.args();
    args.extend(["--http-header-timeout".into(), "1".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start_with(&args).await;
    let (ws_port, _) = server.public_ports();
    let mut stalled = tokio::net::TcpStream::connect(("127.0.0.1", ws_port))
        .await
        .expect("TCP connect");
    // Half a ClientHello's record header, then nothing.
    tokio::io::AsyncWriteExt::write_all(&mut stalled, &[0x16, 0x03])
        .await
        .expect("write");
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(
        HANG_GUARD,
        tokio::io::AsyncReadExt::read(&mut stalled, &mut buf),
    )
    .await
    .expect("the server kept a stalled handshake open");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the server answered: {read:?}"
    );
    wss_client(&server).await.close().await;
}

/// docs/tls.md's private CA, its openssl commands as written but for
/// 127.0.0.1 rather than push.internal: the service serves the pair they
/// make, and `autopush check --ca ca.pem` passes.
#[tokio::test]
async fn the_private_ca_of_the_tls_docs_serves_and_checks() {
    let doc = std::fs::read_to_string(workspace_root().join("docs/tls.md")).unwrap();
    let section = doc
        .split("### A private CA in five commands")
        .nth(1)
        .expect("docs/tls.md has its private CA");
    let commands = section
        .split("```sh\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .expect("the private CA's commands");
    let openssl: String = commands
        .lines()
        .take_while(|line| !line.starts_with("sudo "))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("DNS:push.internal", "IP:127.0.0.1");
    assert_eq!(openssl.matches("openssl req").count(), 2, "{openssl}");
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("bash")
        .args(["-ec", &openssl])
        .current_dir(dir.path())
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "{openssl}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = |name: &str| path(&dir.path().join(name));
    let (cert, key) = (file("fullchain.pem"), file("privkey.pem"));
    let server = Server::start_with(&["--tls-cert", &cert, "--tls-key", &key]).await;
    let out = run_autopush(&["check", &server.wss_url(), "--ca", &file("ca.pem")]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check with the private CA failed:\n{stdout}"
    );
}
