//! Start-up as an operator meets it: every setting, key and address is
//! checked before anything is touched, and every problem is named in one
//! error; `--host` takes names and IPv6 addresses; the first lines of the
//! log give the effective settings; `autopush config` prints them.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use autopush_tests::*;
use reqwest::Method;

/// A key `autopush keygen` could have made (base64url of 32 bytes).
const KEY: &str = "Jr2pJ8uOEBwYuSvC2WV8I3SrSZ81nXGeJ7qi5CAjCUA=";

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Run `autopush ARGS` expecting a refusal of its settings (exit code 2);
/// returns its stderr.
async fn refused(args: &[&str]) -> String {
    let out = server::run_autopush(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "autopush {args:?}: {stderr}");
    stderr
}

#[tokio::test]
async fn a_bad_key_is_refused_before_the_data_directory_is_made() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("fresh");
    let db_arg = db.display().to_string();
    let ports = server::port_flags();
    let args = [
        &["all", "--db", &db_arg, "--auth-key", "short"][..],
        &strs(&ports),
    ]
    .concat();
    let stderr = refused(&args).await;
    assert!(stderr.contains("--auth-key"), "{stderr}");
    assert!(!db.exists(), "the data directory was made: {stderr}");
    assert!(!stderr.contains("generated a new one"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}

/// A split node without its keys names every one it needs in one run.
#[tokio::test]
async fn split_mode_names_every_missing_key_at_once() {
    let ports = server::port_flags();
    for (role, needed) in [
        (
            "endpoint",
            &["--crypto-key", "--auth-key", "--router-key"][..],
        ),
        ("connection", &["--crypto-key", "--router-key"][..]),
    ] {
        let args = [&[role, "--db", "dynamodb"][..], &strs(&ports)].concat();
        let stderr = refused(&args).await;
        for flag in needed {
            assert!(stderr.contains(flag), "{role}: {flag} not named: {stderr}");
        }
        assert_eq!(
            stderr.lines().filter(|l| l.contains("autopush:")).count(),
            1,
            "{role}: not one message: {stderr}"
        );
    }
}

#[tokio::test]
async fn every_bad_setting_is_named_in_one_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db").display().to_string();
    let ports = server::port_flags();
    let base = [&["all", "--db", &db][..], &strs(&ports)].concat();
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--log-format", "xml", "--max-channels", "0"],
            &["log_format", "max_channels"],
        ),
        (
            &[
                "--auth-key",
                "short",
                "--router-host",
                "no-such-host.invalid",
            ],
            &["--auth-key", "no-such-host.invalid"],
        ),
    ];
    for (bad, named) in cases {
        let stderr = refused(&[&base[..], bad].concat()).await;
        assert!(stderr.contains("2 problems"), "{bad:?}: {stderr}");
        for name in named {
            assert!(stderr.contains(name), "{bad:?}: {name} not named: {stderr}");
        }
    }
}

/// A node started by hand on `host` (for --host and --router-host), its
/// public and router ports reached at `reach` (an address as a URL writes
/// it). Killed on drop.
struct HandStarted {
    child: std::process::Child,
    _work: tempfile::TempDir,
    stderr: std::path::PathBuf,
}

impl Drop for HandStarted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_on(host: &str, reach: &str) -> (HandStarted, [u16; 3]) {
    let work = tempfile::tempdir().expect("temp dir");
    let ports = server::free_ports::<3>();
    let [port, router_port, endpoint_port] = ports.map(|p| p.to_string());
    let db = work.path().join("db").display().to_string();
    let stderr_path = work.path().join("stderr");
    let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
    let child = server::autopush_command()
        .args(["all", "--db", &db, "--host", host, "--router-host", host])
        .args(["--port", &port, "--router-port", &router_port])
        .args(["--endpoint-port", &endpoint_port, "--router-key", KEY])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn autopush");
    let mut node = HandStarted {
        child,
        _work: work,
        stderr: stderr_path,
    };
    let health = format!("http://{reach}:{endpoint_port}/health");
    let client = autopush_common::http_client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("reqwest client");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(status)) = node.child.try_wait() {
            let log = std::fs::read_to_string(&node.stderr).unwrap_or_default();
            panic!("--host {host}: exited ({status}):\n{log}");
        }
        if let Ok(reply) = client.get(&health).send().await
            && reply.status() == 200
        {
            return (node, ports);
        }
        let log = std::fs::read_to_string(&node.stderr).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "--host {host}: {health} did not answer:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `--host` and `--router-host` take IPv6 addresses bare and in brackets,
/// and names; a client reaches every port at the address asked for.
#[tokio::test]
async fn hosts_take_ipv6_addresses_and_names() {
    for (host, reach) in [
        ("::1", "[::1]"),
        ("[::1]", "[::1]"),
        ("::", "[::1]"),
        ("[::]", "[::1]"),
        ("localhost", "127.0.0.1"),
    ] {
        let (_node, [port, router_port, _]) = start_on(host, reach).await;
        let mut ws = WsClient::connect_hello(&format!("ws://{reach}:{port}/"), None).await;
        ws.register(&new_channel_id(), None).await;
        let path = format!("/user/{}", random_uaid());
        let base = format!("http://{reach}:{router_port}");
        let reply = http::signed(Method::GET, &base, &path, KEY, None).await;
        assert_eq!(reply.status, 404, "--router-host {host}: {reply:?}");
    }
}

#[tokio::test]
async fn a_host_name_that_does_not_resolve_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("db").display().to_string();
    let ports = server::port_flags();
    let args = [
        &["all", "--db", &db][..],
        &strs(&ports),
        &["--router-host", "no-such-host.invalid"],
    ]
    .concat();
    let stderr = refused(&args).await;
    assert!(
        stderr.contains("--router-host no-such-host.invalid"),
        "{stderr}"
    );
}

/// The first lines of the log give every setting's effective value, keys
/// redacted; a key's value is nowhere in the log.
#[tokio::test]
async fn the_log_opens_with_the_effective_settings() {
    let server = Server::start_with(&["--crypto-key", KEY, "--msg-limit", "7"]).await;
    let log = server.stderr();
    let lines: Vec<&str> = log.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{log}"))
    };
    let port = server
        .ws_url()
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_owned();
    at(&format!("setting port = {port}"));
    at("setting msg_limit = 7");
    at("setting max_channels = 1000");
    let key = at("setting crypto_key = \"[redacted]\"");
    assert!(
        key < at("listening on"),
        "settings after the listeners:\n{log}"
    );
    assert!(!log.contains(KEY), "the crypto key is in the log:\n{log}");
}

async fn config(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = server::run_autopush_with_env(&[&["config"][..], args].concat(), env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "autopush config {args:?}: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `autopush config` prints flags over environment over file over
/// defaults, as a file `--config` reads back to the same settings; keys
/// redacted unless `--show-secrets`.
#[tokio::test]
async fn config_prints_the_effective_settings_as_a_file_it_reads_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("autopush.toml");
    std::fs::write(&file, "max_channels = 5\nmsg_limit = 9\nport = 9000\n").unwrap();
    let file = file.display().to_string();
    let secret = "an-auth-key-nobody-may-see";
    let env = [("AUTOPUSH_MSG_LIMIT", "7"), ("AUTOPUSH_PORT", "9001")];
    let args = ["--config", &file, "--port", "7001", "--auth-key", secret];
    let printed = config(&args, &env).await;
    for line in [
        "port = 7001",
        "msg_limit = 7",
        "max_channels = 5",
        "endpoint_port = 8082",
        "auth_key = \"[redacted]\"",
    ] {
        assert!(
            printed.lines().any(|l| l == line),
            "no {line:?} in\n{printed}"
        );
    }
    assert!(!printed.contains(secret), "{printed}");

    let round_trip = |text: &str, name: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let printed_file = round_trip(&printed, "printed.toml");
    assert_eq!(config(&["--config", &printed_file], &[]).await, printed);

    let shown = config(&[&args[..], &["--show-secrets"]].concat(), &env).await;
    assert!(
        shown.contains(&format!("auth_key = \"{secret}\"")),
        "{shown}"
    );
    let shown_file = round_trip(&shown, "shown.toml");
    let again = config(&["--config", &shown_file, "--show-secrets"], &[]).await;
    assert_eq!(again, shown);
}

/// The packaged example file (every setting commented out) parses, and
/// changes nothing.
#[tokio::test]
async fn the_example_config_file_is_read() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/autopush.toml");
    let example = example.display().to_string();
    assert_eq!(
        config(&["--config", &example], &[]).await,
        config(&[], &[]).await
    );
}
