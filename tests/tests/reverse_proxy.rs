//! The service behind Debian's nginx and Caddy, configured with
//! `docs/examples/nginx.conf` and `docs/examples/Caddyfile` themselves: TLS
//! at the proxy with the test CA, the websocket upgrade, `X-Forwarded-For`
//! with `--trusted-proxies`, and (nginx) a proxy read timeout that the
//! service's pings outlast. Fails (never skips) when nginx or Caddy is
//! missing (Debian packages `nginx`, `caddy`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use autopush_tests::caddy::Caddy;
use autopush_tests::nginx::{Nginx, PublicPorts};
use autopush_tests::tls;
use autopush_tests::*;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

/// nginx's `proxy_read_timeout` where a test does not look at it (seconds).
const READ_TIMEOUT: u64 = 60;

fn test_ca() -> PathBuf {
    cert_file("tls-ca.pem")
}

/// The reverse proxy in front of the service, running while this lives.
enum Front {
    Nginx(Nginx),
    Caddy(Caddy),
}

impl Front {
    fn ports(&self) -> PublicPorts {
        match self {
            Front::Nginx(nginx) => nginx.ports,
            Front::Caddy(caddy) => caddy.ports,
        }
    }

    fn wss_url(&self) -> String {
        self.ports().wss_url()
    }

    fn endpoint_url(&self) -> String {
        self.ports().endpoint_url()
    }
}

/// The service with `args` and its endpoint URL on the proxy's https port,
/// and the proxy `start` makes in front of it.
async fn behind(
    args: &[&str],
    start: impl FnOnce(PublicPorts, &Server) -> Front,
) -> (Server, Front) {
    let ports = PublicPorts::pick();
    let endpoint_url = ports.endpoint_url();
    let mut all = vec!["--endpoint-url", endpoint_url.as_str()];
    all.extend_from_slice(args);
    let server = Server::start_with(&all).await;
    let front = start(ports, &server);
    (server, front)
}

fn nginx(read_timeout: u64) -> impl FnOnce(PublicPorts, &Server) -> Front {
    move |ports, server| Front::Nginx(Nginx::start(ports, server, read_timeout))
}

fn caddy(ports: PublicPorts, server: &Server) -> Front {
    Front::Caddy(Caddy::start(ports, server))
}

/// A new user agent's hello over wss:// from the loopback address `from`,
/// with extra request headers; returns the hello reply (and the client).
async fn hello_from(
    front: &Front,
    from: [u8; 4],
    headers: &[(&'static str, &str)],
) -> (serde_json::Value, WsClient) {
    let from = IpAddr::from(from);
    let mut ws = WsClient::try_connect_tls(&front.wss_url(), &test_ca(), from, headers)
        .await
        .unwrap_or_else(|e| panic!("wss connect through the proxy from {from}: {e}"));
    (ws.hello(None).await, ws)
}

/// The status of a `/v1` registration (`POST /v1/webpush/app/registration`)
/// over https through the proxy, from the loopback address `from`: one
/// HTTP/1.1 request on its own TLS connection.
async fn register_from(front: &Front, from: [u8; 4]) -> u16 {
    let from = IpAddr::from(from);
    let port = front.ports().endpoint;
    let socket = tokio::net::TcpSocket::new_v4().expect("TCP socket");
    socket
        .bind(SocketAddr::new(from, 0))
        .unwrap_or_else(|e| panic!("bind the client to {from}: {e}"));
    let tcp = socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .unwrap_or_else(|e| panic!("connect to the proxy's endpoint port: {e}"));
    let connector = TlsConnector::from(tls::client_config_from(&test_ca()));
    let name = ServerName::from(IpAddr::from([127, 0, 0, 1]));
    let exchange = async {
        let mut tls = connector.connect(name, tcp).await?;
        let request = format!(
            "POST /v1/webpush/app/registration HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        tls.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        tls.read_to_end(&mut response).await?;
        std::io::Result::Ok(response)
    };
    let response = tokio::time::timeout(HANG_GUARD, exchange)
        .await
        .expect("the registration hung")
        .unwrap_or_else(|e| panic!("a registration over https from {from}: {e}"));
    let response = String::from_utf8_lossy(&response);
    response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"))
}

/// Refused by the per-address quota of new UAIDs: status 429 and close 1013.
async fn assert_new_uaid_refused(from: [u8; 4], (reply, mut ws): (serde_json::Value, WsClient)) {
    let from = IpAddr::from(from);
    assert_eq!(reply["status"], 429, "hello from {from}: {reply}");
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1013), "hello from {from}: {closed:?}");
}

#[tokio::test]
async fn a_push_sent_over_https_reaches_a_client_over_wss_through_nginx() {
    push_over_wss(behind(&[], nginx(READ_TIMEOUT)).await.1).await;
}

#[tokio::test]
async fn a_push_sent_over_https_reaches_a_client_over_wss_through_caddy() {
    push_over_wss(behind(&[], caddy).await.1).await;
}

async fn push_over_wss(front: Front) {
    let mut ws = WsClient::connect_tls_hello(&front.wss_url(), &test_ca()).await;
    assert_eq!(
        ws.subprotocol.as_deref(),
        Some("push-notification"),
        "the subprotocol through the proxy"
    );
    let sub = Subscription::with_vapid(&mut ws).await;
    let public = format!("{}/wpush/v2/", front.endpoint_url());
    assert!(
        sub.endpoint.starts_with(&public),
        "the endpoint handed out is the proxy's https URL: {}",
        sub.endpoint
    );

    let text = "through the proxy, over https and wss: héllo ✓";
    let sent = sub
        .send(
            &SendOptions::text(text)
                .vapid(sub.vapid_key())
                .ca_file(&test_ca()),
        )
        .await;
    sent.assert_created();
    let location = sent.header("location").unwrap_or_default();
    assert!(
        location.starts_with(&front.endpoint_url()),
        "the receipt URL is the proxy's too: {location}"
    );
    let (notification, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, text);
    ws.ack_notification(&notification).await;

    // A client that does not trust the test CA gets no connection.
    let other_ca = cert_file("tls-other-ca.pem");
    let localhost = IpAddr::from([127, 0, 0, 1]);
    let refused = WsClient::try_connect_tls(&front.wss_url(), &other_ca, localhost, &[]).await;
    assert!(
        refused.is_err(),
        "a client trusting another CA connected to the proxy"
    );
}

/// With `--trusted-proxies 127.0.0.1` (the proxy's address), each client is
/// counted by the address the proxy names, and one that sends its own
/// `X-Forwarded-For` naming another address is still counted by its own.
#[tokio::test]
async fn with_trusted_proxies_each_client_behind_nginx_has_its_own_quota() {
    each_client_has_its_own_quota(nginx(READ_TIMEOUT)).await;
}

#[tokio::test]
async fn with_trusted_proxies_each_client_behind_caddy_has_its_own_quota() {
    each_client_has_its_own_quota(caddy).await;
}

async fn each_client_has_its_own_quota(start: impl FnOnce(PublicPorts, &Server) -> Front) {
    let args = [
        "--trusted-proxies",
        "127.0.0.1",
        "--new-uaid-limit",
        "0.01,1",
        "--registration-limit",
        "0.01,1",
    ];
    let (_server, front) = behind(&args, start).await;
    let (a, b) = ([127, 0, 0, 2], [127, 0, 0, 3]);
    let (reply, _a1) = hello_from(&front, a, &[]).await;
    assert_eq!(reply["status"], 200, "first hello from {a:?}: {reply}");
    assert_new_uaid_refused(a, hello_from(&front, a, &[]).await).await;

    let (reply, _b1) = hello_from(&front, b, &[]).await;
    assert_eq!(
        reply["status"], 200,
        "another client's first hello: {reply}"
    );
    let forged = [("x-forwarded-for", "192.0.2.7")];
    assert_new_uaid_refused(b, hello_from(&front, b, &forged).await).await;

    // The endpoint port's /v1 registrations, likewise.
    assert_eq!(register_from(&front, a).await, 200, "from {a:?}");
    assert_eq!(register_from(&front, a).await, 429, "again from {a:?}");
    assert_eq!(register_from(&front, b).await, 200, "from {b:?}");
}

/// Without `--trusted-proxies`, the header is ignored: every client behind
/// nginx is nginx's own address, and shares one quota.
#[tokio::test]
async fn without_trusted_proxies_every_client_behind_nginx_shares_its_address() {
    let limits = [
        "--new-uaid-limit",
        "0.01,1",
        "--registration-limit",
        "0.01,1",
    ];
    let (_server, front) = behind(&limits, nginx(READ_TIMEOUT)).await;
    let (a, b) = ([127, 0, 0, 2], [127, 0, 0, 3]);
    let (reply, _a) = hello_from(&front, a, &[]).await;
    assert_eq!(reply["status"], 200, "the first hello: {reply}");
    assert_new_uaid_refused(b, hello_from(&front, b, &[]).await).await;
    assert_eq!(
        register_from(&front, a).await,
        200,
        "the first registration"
    );
    assert_eq!(register_from(&front, b).await, 429, "from {b:?}");
}

/// The service pings a silent client every second; nginx closes a proxied
/// connection after 3 s with nothing from the service. An idle websocket
/// outlives that several times over and still gets its pushes.
#[tokio::test]
async fn the_services_pings_keep_an_idle_websocket_open_through_nginx() {
    let read_timeout = 3;
    let (_server, front) = behind(&["--auto-ping-interval", "1"], nginx(read_timeout)).await;
    let mut ws = WsClient::connect_tls_hello(&front.wss_url(), &test_ca()).await;
    let sub = Subscription::new(&mut ws).await;
    // Reading (the client answers pings as it reads), with nothing to read.
    let idle = Duration::from_secs(4 * read_timeout);
    if let Some(message) = ws.try_recv_for(idle).await {
        panic!("an idle client got {message}");
    }
    let sent = sub
        .send(&SendOptions::text("still here").ca_file(&test_ca()))
        .await;
    sent.assert_created();
    let (_, decrypted) = sub.receive(&mut ws).await;
    assert_eq!(decrypted.text, "still here");
}

/// The same idle client, with the service's pings (every 300 s) rarer than
/// nginx's read timeout: nginx closes it. What the test above guards against.
#[tokio::test]
async fn nginx_closes_an_idle_websocket_that_pings_do_not_outlast() {
    let (_server, front) = behind(&[], nginx(2)).await;
    let mut ws = WsClient::connect_tls_hello(&front.wss_url(), &test_ca()).await;
    let closed = ws.expect_closed().await;
    assert_eq!(
        closed.code, None,
        "nginx drops the connection without a close frame: {closed:?}"
    );
}

/// docs/reverse-proxy.md shows the example files as they are (the nginx one
/// being what the tests above run).
#[test]
fn the_guide_shows_the_example_configs_verbatim() {
    let docs = workspace_root().join("docs");
    let guide = std::fs::read_to_string(docs.join("reverse-proxy.md")).expect("the guide");
    for (file, lang) in [("nginx.conf", "nginx"), ("Caddyfile", "caddy")] {
        let path = docs.join("examples").join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let block = format!("```{lang}\n{text}```\n");
        assert!(
            guide.contains(&block),
            "docs/reverse-proxy.md does not show docs/examples/{file} as it is"
        );
    }
}
