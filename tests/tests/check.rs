//! `autopush check URL` against the real binary: every check passes on a
//! healthy service, and a broken deployment fails with a clear reason and
//! a non-zero exit, never a hang.

use std::net::TcpListener;
use std::process::Output;

use autopush_tests::*;

/// The checks a healthy service passes, in the order they run.
const CHECKS: [&str; 12] = [
    "connect",
    "hello",
    "register v1",
    "register v2 (with key)",
    "push aes128gcm to v1",
    "push aesgcm to v1",
    "push aes128gcm to v2",
    "push aesgcm to v2",
    "push while offline",
    "stored delivery on reconnect",
    "unregister v2",
    "unsubscribed endpoint answers 410",
];

async fn check(args: &[&str]) -> (Output, String) {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    let out = server::run_autopush(&all).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out, stdout)
}

#[tokio::test]
async fn a_healthy_service_passes_every_check() {
    let server = Server::start().await;
    let (out, stdout) = check(&[&server.ws_url()]).await;
    assert!(
        out.status.success(),
        "autopush check failed ({}):\n{stdout}\n{}\nserver log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        server.stderr()
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), CHECKS.len() + 1, "{stdout}");
    for (line, name) in lines.iter().zip(CHECKS) {
        let rest = line
            .strip_prefix("ok   ")
            .unwrap_or_else(|| panic!("not ok: {line:?}\n{stdout}"));
        assert!(rest.starts_with(name), "{line:?} is not {name:?}");
        let ms = rest[name.len()..].trim().strip_suffix(" ms");
        assert!(
            ms.is_some_and(|ms| ms.parse::<f64>().is_ok()),
            "no latency on {line:?}"
        );
    }
    assert_eq!(lines[CHECKS.len()], "autopush check: all 12 checks passed");
}

/// The commonest deployment mistake: `--endpoint-url` names a host or port
/// where no endpoint listens, so every push URL the service hands out is dead.
#[tokio::test]
async fn a_wrong_endpoint_url_fails_with_the_reason() {
    let [dead_port] = server::free_ports::<1>();
    let dead = format!("http://127.0.0.1:{dead_port}");
    let server = Server::start_with(&["--endpoint-url", &dead]).await;
    let (out, stdout) = check(&["--timeout", "5", &server.ws_url()]).await;
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL"))
        .unwrap_or_else(|| panic!("no FAIL line:\n{stdout}"));
    assert!(
        fail.starts_with(&format!(
            "FAIL push aes128gcm to v1: POST {dead}/wpush/v1/…"
        )),
        "{fail}"
    );
    assert!(fail.contains("Connection refused"), "{fail}");
    assert!(fail.contains("--endpoint-url"), "{fail}");
    assert!(stdout.contains("ok   register v1"), "{stdout}");
    assert!(
        stdout
            .trim_end()
            .ends_with("stopped at the first failure that later checks depend on"),
        "{stdout}"
    );
}

/// A service that accepts connections and never answers fails the first
/// check once the timeout passes.
#[tokio::test]
async fn a_stalled_service_fails_after_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("ws://{}/", listener.local_addr().expect("addr"));
    let (out, stdout) = check(&["--timeout", "1", &url]).await;
    drop(listener);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "FAIL connect: {url} did not complete the websocket handshake in 1s"
        )),
        "{stdout}"
    );
}

#[tokio::test]
async fn the_url_must_be_the_websocket() {
    let server = Server::start().await;
    let (out, stdout) = check(&[&server.endpoint_base()]).await;
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("is not a websocket URL"), "{stdout}");
    let (out, stdout) = check(&["wss://127.0.0.1:1/"]).await;
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("wss://127.0.0.1:1/: cannot connect"),
        "{stdout}"
    );
    // TLS to the plain websocket port: the handshake fails, with its reason.
    let plain_as_wss = server.ws_url().replace("ws://", "wss://");
    let (out, stdout) = check(&[&plain_as_wss]).await;
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(&format!("{plain_as_wss}: TLS failed")),
        "{stdout}"
    );
    let endpoint_port_as_ws = server.endpoint_base().replace("http://", "ws://") + "/";
    let (out, stdout) = check(&[&endpoint_port_as_ws]).await;
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("instead of a websocket upgrade: is it the service's websocket port"),
        "{stdout}"
    );
}
