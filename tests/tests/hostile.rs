//! Hostile and broken clients: whatever they send, the node answers or
//! closes the connection, never panics, and keeps serving everyone else.

use std::collections::HashSet;
use std::time::Duration;

use autopush_tests::prometheus::Scrape;
use autopush_tests::*;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A message type long enough that the close reason quoting it must be cut,
/// made of two-byte characters so that a cut at a fixed byte index lands
/// inside one.
fn long_multibyte_type() -> String {
    "é".repeat(200)
}

/// The close reason is cut to fit a close frame at a character boundary, for
/// the first message and for a later one.
#[tokio::test]
async fn a_close_reason_quoting_multibyte_client_text_is_cut_cleanly() {
    let server = Server::start().await;
    let bad = json!({ "messageType": long_multibyte_type() });

    // As the first message (before hello).
    let mut ws = WsClient::connect(&server.ws_url()).await;
    ws.send_json(bad.clone()).await;
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert!(
        closed.reason.starts_with("unknown messageType"),
        "{closed:?}"
    );
    assert!(closed.reason.len() <= 123, "{closed:?}");

    // After hello, from a registered session.
    let mut ws = server.client().await;
    ws.send_json(bad).await;
    let closed = ws.expect_closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert_eq!(closed.messages[0]["status"], 401, "{closed:?}");
    assert!(closed.reason.len() <= 123, "{closed:?}");

    // The node still serves, and nothing panicked.
    let ws = server.client().await;
    ws.close().await;
    let stderr = server.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

// ---- HTTP on every port: timeouts and the connection cap ----

/// A raw TCP connection to `base` (`http://IP:PORT`).
async fn connect(base: &str) -> TcpStream {
    let addr = base.trim_start_matches("http://");
    tokio::time::timeout(HANG_GUARD, TcpStream::connect(addr))
        .await
        .unwrap_or_else(|_| panic!("connect to {addr} hung"))
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// Read until the server closes the connection (end of stream or reset);
/// returns what it sent. Panics if it keeps the connection open.
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(HANG_GUARD, stream.read(&mut buf)).await {
            Err(_) => panic!(
                "the server kept the connection open; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Ok(Err(e)) => panic!("reading: {e}"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Read one response (head and a `content-length` body) off a kept-alive
/// connection; returns it as text.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + length {
                return text;
            }
        }
        match tokio::time::timeout(HANG_GUARD, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            other => panic!(
                "no complete response ({other:?}); got {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
}

fn bases(server: &Server) -> [String; 3] {
    [
        server.ws_http_base(),
        server.router_base(),
        server.endpoint_base(),
    ]
}

const GET: &[u8] = b"GET /__lbheartbeat__ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

#[tokio::test]
async fn a_stalled_request_head_is_closed_on_every_port() {
    let [metrics_port] = autopush_tests::server::free_ports::<1>();
    let metrics_port = metrics_port.to_string();
    let server = Server::start_with(&[
        "--http-header-timeout",
        "1",
        "--metrics-port",
        &metrics_port,
    ])
    .await;
    let metrics = format!("http://127.0.0.1:{metrics_port}");
    for base in bases(&server).into_iter().chain([metrics]) {
        // Part of a head, then nothing.
        let mut stream = connect(&base).await;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .expect("write");
        let got = read_until_closed(&mut stream).await;
        assert_eq!(got, "", "{base}: answered a head that never ended");

        // A head one byte at a time, never finished: progress does not
        // extend the deadline.
        let stream = connect(&base).await;
        let (mut reader, mut writer) = stream.into_split();
        let trickle = tokio::spawn(async move {
            for byte in b"GET /health HTTP/1.1\r\nX-Slow: ".iter().cycle() {
                if writer.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(HANG_GUARD, reader.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "{base}: a trickled head kept the connection open: {closed:?}"
        );
        trickle.abort();
    }
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_on_every_port() {
    // The head timeout is longer than the test's hang guard: only the idle
    // timeout can close these connections.
    let server =
        Server::start_with(&["--http-idle-timeout", "1", "--http-header-timeout", "60"]).await;
    for base in bases(&server) {
        let mut stream = connect(&base).await;
        stream.write_all(GET).await.expect("write");
        let response = read_response(&mut stream).await;
        assert!(response.starts_with("HTTP/1.1 "), "{base}: {response}");
        assert!(
            !response.to_ascii_lowercase().contains("connection: close"),
            "{base}: not kept alive: {response}"
        );
        let got = read_until_closed(&mut stream).await;
        assert_eq!(got, "", "{base}");
    }
}

#[tokio::test]
async fn a_stalled_request_body_is_closed() {
    // Head and idle timeouts longer than the test's hang guard: only the
    // body timeout can close these connections.
    let server = Server::start_with(&[
        "--http-body-timeout",
        "1",
        "--http-header-timeout",
        "60",
        "--http-idle-timeout",
        "60",
    ])
    .await;
    let uaid = random_uaid();
    let requests = [
        (
            server.endpoint_base(),
            "POST /wpush/v1/abc HTTP/1.1\r\nHost: 127.0.0.1\r\nTTL: 60\r\n\
             Content-Encoding: aes128gcm\r\nContent-Length: 100\r\n\r\n0123456789"
                .to_string(),
        ),
        (
            server.endpoint_base(),
            "POST /v1/webpush/app/registration HTTP/1.1\r\nHost: 127.0.0.1\r\n\
             Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"token\""
                .to_string(),
        ),
        (
            server.router_base(),
            format!(
                "PUT /push/{uaid} HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                 Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"channelID\""
            ),
        ),
    ];
    for (base, request) in requests {
        let mut stream = connect(&base).await;
        stream.write_all(request.as_bytes()).await.expect("write");
        let got = read_until_closed(&mut stream).await;
        assert!(
            got.is_empty() || got.starts_with("HTTP/1.1 4"),
            "{base}: {got}"
        );
    }
}

#[tokio::test]
async fn connections_over_the_cap_are_refused_on_every_port() {
    let server = Server::start_with(&["--max-http-connections", "2"]).await;
    for base in bases(&server) {
        // Two kept-alive connections that have been answered hold the two
        // places (one refused while an earlier connection still closes is
        // simply opened again).
        let mut held = Vec::new();
        while held.len() < 2 {
            let mut stream = connect(&base).await;
            stream.write_all(GET).await.expect("write");
            if !read_response(&mut stream).await.starts_with("HTTP/1.1 503") {
                held.push(stream);
            }
        }
        let mut extra = connect(&base).await;
        extra.write_all(GET).await.expect("write");
        let refused = read_until_closed(&mut extra).await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{base}: {refused}");
        assert!(
            refused.to_ascii_lowercase().contains("retry-after:"),
            "{base}: {refused}"
        );
        assert!(refused.contains(r#""errno":201"#), "{base}: {refused}");

        // A place frees up when a connection closes.
        drop(held.pop());
        tokio::time::timeout(HANG_GUARD, async {
            loop {
                let mut stream = connect(&base).await;
                stream.write_all(GET).await.expect("write");
                if !read_response(&mut stream).await.starts_with("HTTP/1.1 503") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{base}: no place freed up"));
    }
    // Websockets leave the HTTP count once upgraded.
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(server.client().await);
    }
}

// ---- The websocket port serves only the websocket and health ----

#[tokio::test]
async fn the_websocket_port_answers_404_to_anything_else() {
    let server = Server::start().await;
    let base = server.ws_http_base();
    let uaid = random_uaid();
    for (method, path) in [
        ("GET", "/".to_string()),
        ("POST", "/".to_string()),
        ("PUT", "/".to_string()),
        ("DELETE", "/".to_string()),
        ("PATCH", "/".to_string()),
        ("OPTIONS", "/".to_string()),
        ("GET", "/nope".to_string()),
        ("POST", "/health".to_string()),
        ("DELETE", "/__heartbeat__".to_string()),
        ("GET", "/health/more".to_string()),
        ("PUT", format!("/push/{uaid}")),
        ("POST", "/wpush/v1/abc".to_string()),
    ] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let reply = http::request(method, &format!("{base}{path}"), &[], None).await;
        reply.assert_error(404, 102);
    }
}

// ---- A websocket client that stops reading ----

/// Bodies large enough that the node's sends to a client that does not read
/// block long before all of them are out, whatever the kernel buffers (they
/// grow to a few MiB on loopback).
const BIG_BODY: usize = 100_000;
const BIG_PUSHES: usize = 60;
const BIG_PUSH_ARGS: [&str; 4] = ["--max-data-bytes", "100000", "--msg-limit", "1000"];

/// A client with a small receive buffer that has registered a channel and
/// then stops reading, and `BIG_PUSHES` large pushes sent to it. Returns the
/// client and the pushed bodies (base64url, as delivered).
async fn stalled_client_with_pushes(server: &Server) -> (WsClient, HashSet<String>) {
    let mut slow = WsClient::connect_small_buffer(&server.ws_url()).await;
    assert_eq!(slow.hello(None).await["status"], 200);
    let reply = slow.register(&new_channel_id(), None).await;
    let endpoint = reply["pushEndpoint"].as_str().expect("pushEndpoint");
    let mut bodies = HashSet::new();
    for i in 0..BIG_PUSHES {
        let mut body = opaque_body(BIG_BODY);
        body[..8].copy_from_slice(&(i as u64).to_be_bytes());
        bodies.insert(URL_SAFE_NO_PAD.encode(&body));
        let reply = http::post_push(
            endpoint,
            &[("TTL", "600"), ("Content-Encoding", "aes128gcm")],
            Some(body),
        )
        .await;
        reply.assert_created();
    }
    (slow, bodies)
}

/// Receive (and acknowledge) notifications until every body in `want` has
/// arrived.
async fn receive_all(ws: &mut WsClient, want: &HashSet<String>) {
    let mut got = HashSet::new();
    while got.len() < want.len() {
        let n = ws.recv_notification().await;
        ws.ack_notification(&n).await;
        let data = n["data"].as_str().expect("data").to_string();
        assert!(want.contains(&data), "an unexpected notification");
        got.insert(data);
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_dropped_and_its_messages_kept() {
    let mut args = vec!["--ws-send-timeout", "1"];
    args.extend(BIG_PUSH_ARGS);
    let server = Server::start_with(&args).await;
    let (mut slow, bodies) = stalled_client_with_pushes(&server).await;
    let uaid = slow.uaid().to_string();

    // The node gives up on the client (nothing else tells it to: no kick,
    // no shutdown); the client must not read before that, or it would
    // unblock the send the node is waiting on.
    let metrics = format!("{}/metrics", server.router_base());
    tokio::time::timeout(HANG_GUARD, async {
        loop {
            let scrape = Scrape::parse(&http::get(&metrics).await.text);
            if scrape.value("ua_connection_closed", &[("code", "1000")]) == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the node never gave up on the stalled client"));
    // Every message it never acknowledged is stored.
    let path = format!("/user/{uaid}");
    let user = server.router_call(reqwest::Method::GET, &path, None).await;
    assert_eq!(user.json["stored_messages"], BIG_PUSHES, "{}", user.json);
    slow.expect_closed().await;

    let mut again = server.reconnect(&uaid).await;
    receive_all(&mut again, &bodies).await;
}

#[tokio::test]
async fn a_new_connection_replaces_one_whose_client_stopped_reading() {
    let mut args = vec!["--ws-send-timeout", "2"];
    args.extend(BIG_PUSH_ARGS);
    let server = Server::start_with(&args).await;
    let (mut slow, bodies) = stalled_client_with_pushes(&server).await;
    let uaid = slow.uaid().to_string();

    // The same user agent comes back on a new connection: the stuck session
    // is closed and everything reaches the new one.
    let mut again = server.reconnect(&uaid).await;
    receive_all(&mut again, &bodies).await;
    slow.expect_closed().await;
}
